"""pytest setup: on CPU-only machines run Triton kernels in the interpreter, with its numerics fixed."""
import os

import numpy as np
import pytest
import torch

# @triton.jit picks JITFunction vs InterpretedFunction when it *decorates*, and importing triton
# already decorates triton.language's own helpers (tl.max, tl.sum, ...): so the variable must be set
# before triton is imported at all. pytest imports this conftest before test_flamia.py imports flamia.
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
from triton import knobs  # noqa: E402  (after TRITON_INTERPRET, see above)


def _patch_interpreter():
    """Test-only fixes for numerics bugs in triton/runtime/interpreter.py (seen in 3.6 and 3.9)."""
    import triton
    import triton.language as tl
    from triton.runtime import interpreter as interp
    from triton._C.libtriton import ir

    B = interp.InterpreterBuilder
    # Fail loudly rather than silently testing on the broken path if the internals move.
    if not (hasattr(interp, "_convert_float") and hasattr(B, "create_dot") and hasattr(B, "cast_impl")):
        raise RuntimeError(f"triton {triton.__version__}: interpreter internals changed; update conftest.py")
    if getattr(interp, "_numerics_patched", False):
        return
    # The interpreter stores bf16 / fp8 tensors as raw uint16 / uint8 bit patterns in numpy.
    torch_dt = {tl.float64: torch.float64, tl.float32: torch.float32, tl.float16: torch.float16,
                tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    # NVIDIA's fp8 convert (cvt.rn.satfinite) saturates +-inf / overflow to the max finite value,
    # while torch's .to() gives NaN (e4m3fn) / inf (e5m2): clamp first. clamp keeps NaN.
    sat = {tl.float8e4nv: 448.0, tl.float8e5: 57344.0}
    orig_convert, orig_dot, orig_cast = interp._convert_float, B.create_dot, B.cast_impl

    def convert_float(x, src, dst, rounding_mode):
        # Bugs (2)+(3): the bit-twiddling original truncates fp32->bf16, rounds fp8 ties away from
        # zero, drops the mantissa carry into the exponent (1.875 -> e5m2 gives 1.0), mis-rounds
        # subnormals, and turns NaN/inf into finite numbers -- also when *widening* fp8/bf16
        # (e4m3 NaN -> 480, e5m2 inf -> 65536), so upcasts go through torch too (exact there).
        # torch casts round to nearest even. RTZ (explicit opt-in) keeps the original code.
        if src not in torch_dt or dst not in torch_dt or rounding_mode == ir.ROUNDING_MODE.RTZ:
            return orig_convert(x, src, dst, rounding_mode)
        n_in, n_out = src.primitive_bitwidth, dst.primitive_bitwidth
        t = torch.from_numpy(np.array(x).view(f"int{n_in}")).view(torch_dt[src])
        if dst in sat:
            t = t.float().clamp(-sat[dst], sat[dst])
        out = t.to(torch_dt[dst]).view(getattr(torch, f"int{n_out}")).numpy()
        return out.view(f"uint{n_out}")  # same contract as the original: raw bits, caller .view()s

    def create_dot(self, a, b, d, *args):
        # Bug (1): bf16 operands are uint16 bit patterns, so np.matmul multiplied the raw integers.
        # Upcast to fp32 (exact) first; the result then equals torch's a.float() @ b.float().
        if a.dtype.scalar == tl.bfloat16:
            a = orig_cast(self, a, tl.float32)
        if b.dtype.scalar == tl.bfloat16:
            b = orig_cast(self, b, tl.float32)
        return orig_dot(self, a, b, d, *args)

    def cast_impl(self, src, dst_type):
        # int->bf16 and fp64->bf16 did numpy .astype(uint16), storing the value as raw bits
        # (1 -> 9.2e-41). Go through fp32 so the fixed fp32->bf16 rounding handles it.
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar not in (tl.float32, tl.bfloat16):
            src = orig_cast(self, src, tl.float32)
        return orig_cast(self, src, dst_type)

    interp._convert_float, B.create_dot, B.cast_impl = convert_float, create_dot, cast_impl
    interp._numerics_patched = True


def interpreter_numerics_patched():
    """True iff kernels run in the interpreter *and* the fixes above are installed."""
    if not knobs.runtime.interpret:
        return False
    from triton.runtime import interpreter as interp
    return getattr(interp, "_numerics_patched", False)


@pytest.fixture
def interpreter_patched():
    """Not autouse: tests that request it get interpreter_numerics_patched()."""
    return interpreter_numerics_patched()


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA")


if knobs.runtime.interpret:  # the same test @triton.jit uses: patched whenever kernels are interpreted
    _patch_interpreter()
