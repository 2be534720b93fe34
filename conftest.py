"""pytest setup: on machines without CUDA, run the Triton kernels in Triton's CPU interpreter."""
import os

import torch

# @triton.jit picks JITFunction vs InterpretedFunction when it *decorates*, and importing triton
# already decorates triton.language's own helpers (tl.max, tl.sum, ...): so the variable must be set
# before triton is imported at all. pytest imports this conftest before test_flamia.py imports
# flamia, which then fixes the interpreter's numerics itself (flamia.py, section 8).
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"


def interpreter_numerics_patched():
    """True iff kernels run in the interpreter *and* flamia's numerics fixes are installed."""
    import flamia
    from triton.runtime import interpreter
    return flamia.INTERPRETED and getattr(interpreter, "_numerics_patched", False)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA")
