"""FLAMIA: FLAsh MIcroscaling Attention -- FP8 / MXFP8 flash attention for training causal language
models on packed variable-length documents, causally safe by construction.

A single-file reimplementation of "FLAMIA: FLAsh MIcroscaling Attention for Fast and Causally Safe Training on
Blackwell" (arXiv 2611.03344). Only the abstract is public: everything derives from it, from public analyses of the
low-precision leak (MatX, TransformerEngine #3248, cuDNN-frontend #983/#1123) and from H200 measurements. Sections:

  1. formats          E4M3 + E8M0 scales (MXFP8); NVFP4 (E2M1 + E4M3 + FP32); MXFP4 (E2M1 + E8M0)
  2. scaling & plan   token-block, document-local scaling; recipes; the Plan (the varlen scheduler)
  3. quantizers       PyTorch references and the fused Triton quantizers (bit-identical)
  4. reference oracle what every recipe computes (P in fp32), plus exact fp64 attention
  5. kernels          the variant of a call; fused Triton forward (5a) and backward (5b)
  6. public API       custom ops + autograd: flamia_attn_varlen_func, flamia_attn_func
  6b. transformers    flamia_hf_attention_fn: a Hugging Face attention backend, packed rows too
  7. auditor          audit_causality: a bitwise leak test for any attention implementation
  8. interpreter      numerics fixes for Triton's CPU interpreter (applied whenever it runs)
The optional flamia_hopper.py holds Hopper-only warp-specialized Gluon kernels (backend="gluon");
this file alone is complete. The leak and the safeguard: section 2; limits and what ran where: README."""
import collections
import functools
import math
import os
import warnings
import weakref
from dataclasses import dataclass
from typing import NamedTuple, Optional

import numpy as np
import torch
import triton
import triton.language as tl
from triton.language.core import _aggregate  # triton.language's named records (3.6: private name)

# ---- 1. Formats -------------------------------------------------------------------------------
# MXFP8 element: E4M3 (torch.float8_e4m3fn / tl.float8e4nv): sign, 4 exponent, 3 mantissa bits, max 448, no
# infinities, NaN 0x7F / 0xFF. MX scale: E8M0, a biased exponent byte e meaning 2^(e - 127); 0xFF is NaN.
#
# THE SCALE RULE (TransformerEngine's, cuDNN's): a block's scale is the smallest power of two s
# with amax / s <= 448, so nothing saturates. It is exact, on amax's bits (no division or log that
# could round differently on the CPU, the GPU and the interpreter). With amax = m * 2^E, m in [1, 2):
#     amax / 2^k <= 448 = 1.75 * 2^8   <=>   k >= E - 8 + (m > 1.75)
# so e = E_biased - 8 + (mantissa bits > 0x600000), clamped to >= 1: an all-zero block quantizes to
# exact zeros, and every scale is a *normal* fp32 number (kernels build it with a shift, not exp2).
# A non-finite amax (E_biased == 255) gets e = 0xFF (NaN), and its elements are E4M3 NaN.
E4M3_MAX = 448.0
E8M0_NAN = 255
E2M1_MAX = 6.0
NVFP4_BLOCK = 16  # NVFP4: one E4M3 scale per 16 elements along the head dim
MXFP4_BLOCK = 32  # MXFP4: one E8M0 scale per 32 elements along the head dim
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of code 0..7


def e8m0_exponent(amax: torch.Tensor, elem_max: float = E4M3_MAX) -> torch.Tensor:
    """The scale rule as uint8 E8M0, for E4M3 elements or E2M1 ones (MXFP4: 6 = 1.5 * 2^2)."""
    shift, mant = {E4M3_MAX: (8, 0x600000), E2M1_MAX: (2, 0x400000)}[elem_max]
    bits = amax.float().view(torch.int32)
    biased = (bits >> 23) & 0xFF
    e = biased - shift + ((bits & 0x7FFFFF) > mant).int()
    return torch.where(biased == 255, E8M0_NAN, e.clamp(min=1)).to(torch.uint8)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    s = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.int() - 127)  # exact
    return torch.where(e == E8M0_NAN, torch.nan, s)


# FP4 elements are E2M1 (+-{0, .5, 1, 1.5, 2, 3, 4, 6}), two per byte, first in the low nibble. NVFP4: an E4M3 scale
# per 16 elements and a second-level FP32 scale, usually ONE amax over the whole tensor: a statistic over every token
# of every document, which leaks across time and documents. Here: per token and head, s2 = amax / (448 * 6). MXFP4
# (OCP MX, what tl.dot_scaled("e2m1") takes): an E8M0 scale per 32 elements by MXFP8's rule for E2M1's max 6, s2 = 1.
def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """RNE onto the E2M1 grid, saturating at 6: uint8 codes 0..15 (bit 3: sign; bits 0-2: index into E2M1_VALUES)."""
    a = x.abs()
    # Boundaries, a tie to the even mantissa (0, 1, 2, 4): 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
    k = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
         + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    return (k + 8 * (x < 0).int()).to(torch.uint8)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), device=code.device)  # bit 3: sign
    return lut[code.long()]


def quantize_fp4_reference(x: torch.Tensor, fmt: str = "nvfp4"):
    """x (T, H, D) -> (packed (T, H, D//2) uint8, block scales (T, H, D//16) E4M3 (NVFP4) or (T, H, D//32) uint8 E8M0
    (MXFP4), second level s2 (T, H) fp32: NVFP4's per token, MXFP4's ones (so it takes NVFP4's code paths))."""
    _check_tensor(x, "x")
    T, H, D = x.shape
    xf = x.float()
    if fmt == "mxfp4":
        xb = xf.view(T, H, D // MXFP4_BLOCK, MXFP4_BLOCK)
        sb = e8m0_exponent(xb.abs().amax(-1), E2M1_MAX)
        denom, s2 = e8m0_to_float(sb), torch.ones(T, H, device=x.device)  # NaN block -> codes 0
    else:
        amax_tok = xf.abs().amax(-1)  # (T, H)
        # Divide by tensors, not Python scalars: CUDA torch turns `x / scalar` into x * (1 / scalar),
        # which is not the correctly rounded quotient the Triton quantizer (div_rn) and the CPU compute.
        s2 = amax_tok / torch.full_like(amax_tok, E4M3_MAX * E2M1_MAX)
        s2 = torch.where(s2 > 0, s2, torch.ones_like(s2))  # all-zero token: any scale, codes are 0
        xb = xf.view(T, H, D // NVFP4_BLOCK, NVFP4_BLOCK)
        amax_b = xb.abs().amax(-1)
        sb = (amax_b / torch.full_like(amax_b, E2M1_MAX) / s2[..., None]).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
        denom = sb.float() * s2[..., None]
        denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    codes = e2m1_encode(xb / denom[..., None]).view(T, H, D)
    return codes[..., 0::2] | (codes[..., 1::2] << 4), sb, s2


def dequantize_fp4(packed: torch.Tensor, block_scale: torch.Tensor, s2=None, dtype=torch.float32):
    """NVFP4 (E4M3 block scales) or MXFP4 (E8M0 ones) back to `dtype`, (T, H, D); s2 (T, H): the second level, or
    None (the kernels' fp32 factor): code x block scale is exact in bf16; fp16 is clamped (MXFP4's can exceed it)."""
    T, H, D2 = packed.shape
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).view(T, H, 2 * D2)
    n_blocks = block_scale.shape[-1]
    vals = e2m1_decode(codes).view(T, H, n_blocks, 2 * D2 // n_blocks)  # (no -1: T may be 0)
    sb = e8m0_to_float(block_scale) if block_scale.dtype == torch.uint8 else block_scale.float()
    x = (vals * sb[..., None]).view(T, H, 2 * D2)
    x = x if s2 is None else x * s2[..., None]
    return (x.clamp(-65504.0, 65504.0) if dtype == torch.float16 else x).to(dtype)


# ---- 2. Token-block, document-local scaling, recipes, and the Plan (the varlen scheduler) -----
# Packed documents: THD tensors (total_tokens, heads, head_dim) plus int32 cu_seqlens = [0, L0, L0+L1, ..., total]
# (flash-attn's convention; empty documents are legal). A scale block is `block_tokens` (B_t) consecutive tokens of
# ONE document and ONE head, over the whole head dim; blocks restart at every document start, so no block (no
# statistic) spans two documents. Each token holds a copy of its block's E8M0 byte, head-major (H, T_padded) in the
# padded layout (padded_columns): documents start 16-aligned, so tiles load their scales in aligned words.
BLOCK_TOKENS = (1, 32, 64, 128)
DEFAULT_BLOCK_TOKENS = 1  # per token: no per-token copies to write, the cheaper on packed short documents
QUANT_TILE = 128  # tokens per quantizer program; a multiple of every B_t
PAD_ALIGN = 16  # token-transposed layouts start every document at a multiple of 16 tokens


@dataclass(frozen=True)
class Recipe:
    """Which format holds what, and which kernels compute it. k_format: "bf16", "e4m3" (MXFP8), "nvfp4" / "mxfp4"
    (FP4 K). Quantized recipes keep Q and V MXFP8 (each query tile re-reads K: FP4 pays there), Q per token (a
    row-shared scale leaks). A new recipe: a _RECIPES row, quantizer (section 3), operand_slots, oracle rounding."""
    name: str
    k_format: str
    backends: tuple  # "tl": all recipes; "dot_scaled": needs all scales E8M0 (MX MMA); "gluon": flamia_hopper.py

    @property
    def quantized(self) -> bool:
        return self.k_format != "bf16"

    @property
    def k_fp4(self) -> bool:
        return self.k_format in ("nvfp4", "mxfp4")


_RECIPES = {r.name: r for r in (Recipe("bf16", "bf16", ("tl", "gluon")),
                                Recipe("mxfp8", "e4m3", ("tl", "dot_scaled", "gluon")),
                                Recipe("nvfp4", "nvfp4", ("tl",)), Recipe("mxfp4", "mxfp4", ("tl", "dot_scaled")))}
RECIPES = tuple(_RECIPES)
BACKENDS = ("tl", "dot_scaled", "gluon")  # tl: portable tl.dot (wgmma on Hopper)


def _pad16(n):
    """n rounded up to PAD_ALIGN: a document's length in the token-transposed layouts."""
    return -(-n // PAD_ALIGN) * PAD_ALIGN


# The causal safeguard's rules, in one place. Positions: document-local, on the key axis (a query's: its row plus the
# causal shift Lk - Lq). A (query, key) pair STRADDLES when the key's scale block also holds the query's position:
# its scale then depends on keys after the query, so the pair uses K and V's per-token copies. Jitted twins below.
def _token_copies(recipe: Recipe, causal: bool, safeguard: bool, block_tokens: int) -> bool:
    """Whether K and V also get per-token quantized copies (pairs can straddle)."""
    return recipe.quantized and causal and safeguard and block_tokens > 1


def straddles(pos_q: torch.Tensor, pos_k: torch.Tensor, block_tokens: int) -> torch.Tensor:
    """Pairs (broadcast) whose key block also holds the query position (visible pairs only matter)."""
    return pos_k // block_tokens == pos_q // block_tokens


@triton.jit
def _straddles(pos_q, pos_k, BLOCK_TOKENS: tl.constexpr):
    return pos_k // BLOCK_TOKENS == pos_q // BLOCK_TOKENS


@triton.jit
def _first_straddling_key(pos_q, BLOCK_TOKENS: tl.constexpr):
    """The first key that straddles with a query at pos_q >= 0: its block's start (earlier keys: safe)."""
    return pos_q // BLOCK_TOKENS * BLOCK_TOKENS


@triton.jit
def _first_safe_query(key_end, BLOCK_TOKENS: tl.constexpr):
    """The first query position past every block of keys < key_end: no later pair with them straddles."""
    return (key_end + BLOCK_TOKENS - 1) // BLOCK_TOKENS * BLOCK_TOKENS


def _check_tensor(x, name: str, dims: int = 3) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        shape = "(total, heads, head_dim)" if dims == 3 else "(batch, seqlen, heads, head_dim)"
        raise ValueError(f"{name} must have {dims} dims {shape}, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise TypeError(f"{name} must be bfloat16, float16, float32 or float64, got {x.dtype}")
    if x.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"{name} has head_dim {x.shape[-1]}; supported head dims are {HEAD_DIMS}")


def _check_block_tokens(block_tokens) -> None:
    if block_tokens not in BLOCK_TOKENS:
        raise ValueError(f"block_tokens must be one of {BLOCK_TOKENS}, got {block_tokens!r}")


def _check_cu_seqlens(cu, name: str) -> None:
    if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32:
        got = cu.dtype if isinstance(cu, torch.Tensor) else type(cu).__name__
        raise TypeError(f"{name} must be int32 offsets in a torch.Tensor (flash-attn's), got {got}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D [0, ..., total], 2+ entries, got shape {tuple(cu.shape)}")


# The Plan cuts every document into start-aligned tiles that never cross a document boundary: 128-token tiles for the
# quantizer (whole scale blocks), query tiles (forward, dQ) or key tiles (dK/dV) for attention. Only tiles with
# unmasked pairs exist: no program runs on a fully masked tile, and documents of length 0, 1 or 33 need no special
# case. Work is sorted heaviest first (LPT): the GPU takes programs roughly in launch order, so long causal rows
# start first and short ones fill the tail. The Plan reads cu_seqlens to the host ONCE (the only sync) and caches its
# tables, like FlexAttention's BlockMask. Table columns (int32, a row per tile): "own" is the tile's document
# (queries for query tiles, keys for key tiles), "other" the matching one; *_PAD: their starts in the padded layouts.
TILE_START, TILE_END, OWN_START, OWN_END, OTHER_START, OTHER_END, OTHER_PAD, OWN_PAD = (
    tl.constexpr(i) for i in range(8))


# A kernel reads its tile's row once into a TileRow (FA4's BlockInfo), and takes the tiles it visits from
# _key_range / _query_range: the one place where the causal mask and the safeguard decide which tiles run and which
# take the masked path. All kernels call them: the tl and Gluon forwards, dQ, dK/dV (Gluon compiles them too).
def record(cls):
    """A Triton aggregate (values that kernels pass around as one) built from its fields in order;
    triton 3.6 needs the __init__ that later versions write themselves."""
    names = tuple(cls.__annotations__)

    def __init__(self, *values):
        for name, value in zip(names, values):
            setattr(self, name, value)
    cls.__init__ = triton.constexpr_function(__init__)
    return _aggregate(cls)


@record
class TileRow:
    row: tl.tensor  # the table row (its *_PAD columns are read where they are needed)
    start: tl.tensor  # the tile's tokens [start, end), packed
    end: tl.tensor
    doc_start: tl.tensor  # its document's first token ("own")
    other_start: tl.tensor  # the first token of the matching document on the other side
    q_len: tl.tensor  # the query document's length ...
    k_len: tl.tensor  # ... and the key document's
    shift: tl.tensor  # k_len - q_len: query row i sits at key position i + shift (0: self-attention)


@triton.jit
def _tile_row(TILES, index, QUERY_TILES: tl.constexpr):
    """Row `index` of a table of query tiles (QUERY_TILES) or of key tiles."""
    row = TILES + index * 8
    start, end = tl.load(row + TILE_START), tl.load(row + TILE_END)
    doc_start, doc_end = tl.load(row + OWN_START), tl.load(row + OWN_END)
    other_start, other_end = tl.load(row + OTHER_START), tl.load(row + OTHER_END)
    if QUERY_TILES:
        q_len, k_len = doc_end - doc_start, other_end - other_start
    else:
        q_len, k_len = other_end - other_start, doc_end - doc_start
    return TileRow(row, start, end, doc_start, other_start, q_len, k_len, k_len - q_len)


@triton.jit
def _key_range(tile, BLOCK_N: tl.constexpr, BLOCK_TOKENS: tl.constexpr, CAUSAL: tl.constexpr,
               SAFEGUARD: tl.constexpr):
    """Key tiles of a query tile (document-local keys): [0, n_full) are seen by every row and hold no
    block that straddles a row's position (no mask, no safeguard); [n_full, n_end) need the mask."""
    if CAUSAL:
        first = tile.start - tile.doc_start + tile.shift  # the first row's key position
        n_full = tl.maximum(first + 1, 0) // BLOCK_N * BLOCK_N
        if SAFEGUARD:  # the block holding `first` and every later one take the masked path
            n_full = tl.minimum(n_full, _first_straddling_key(tl.maximum(first, 0), BLOCK_TOKENS)
                                // BLOCK_N * BLOCK_N)
        n_end = tl.minimum(tile.k_len, tile.end - tile.doc_start + tile.shift)
    else:
        n_full = tile.k_len // BLOCK_N * BLOCK_N
        n_end = tile.k_len
    return n_full, n_end


@triton.jit
def _query_range(tile, BLOCK_M: tl.constexpr, BLOCK_TOKENS: tl.constexpr, CAUSAL: tl.constexpr,
                 SAFEGUARD: tl.constexpr):
    """Query tiles (document-local rows, BLOCK_M-aligned) that see a key tile: from q_lo; those before
    q_mid need the mask (the diagonal, and with the safeguard the rows whose position the key tile's
    blocks hold); from q_mid on every row sees every key, safely."""
    if CAUSAL:
        key_start, key_end = tile.start - tile.doc_start, tile.end - tile.doc_start
        q_lo = tl.maximum(key_start - tile.shift, 0) // BLOCK_M * BLOCK_M  # the first row seeing a key
        thr = key_end - 1  # a row at or past this position sees every key of the tile...
        if SAFEGUARD:  # ...and past the straddling block when the safeguard is on
            thr = _first_safe_query(key_end, BLOCK_TOKENS)
        q_mid = tl.minimum((tl.maximum(thr - tile.shift, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M, tile.q_len)
        q_mid = tl.maximum(q_mid, q_lo)
    else:
        q_lo, q_mid = 0, 0
    return q_lo, q_mid


# The custom ops find plans here: id(cu_seqlens_q on the plan's device) -> Plan, while the Plan lives (a strong entry
# would keep both forever). Plans that calls build (no plan=) live on in _RECENT_PLANS for later layers, boundedly.
_PLANS = weakref.WeakValueDictionary()
_RECENT_PLANS = collections.deque(maxlen=16)


class Plan:
    """A packed batch's schedule: documents, tiles, their order. cu_seqlens_q / _k: int32 (n_docs + 1,) offsets (k
    defaults to q). device: the kernels' (default: cu_seqlens_q's); host offsets with device="cuda": no GPU sync."""

    def __init__(self, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor = None, device=None):
        cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        _check_cu_seqlens(cu_seqlens_q, "cu_seqlens_q")
        _check_cu_seqlens(cu_seqlens_k, "cu_seqlens_k")
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, "
                             f"got {cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}")
        self.offsets_q = cu_seqlens_q.tolist()  # the one host sync of a batch
        same = cu_seqlens_k is cu_seqlens_q
        self.offsets_k = self.offsets_q if same else cu_seqlens_k.tolist()
        for name, offs in (("cu_seqlens_q", self.offsets_q), ("cu_seqlens_k", self.offsets_k)):
            if offs[0] != 0:
                raise ValueError(f"{name} must start at 0, got {offs[0]}")
            if any(b < a for a, b in zip(offs, offs[1:])):
                raise ValueError(f"{name} must be non-decreasing, got {offs}")
        self.device = torch.device(device) if device is not None else cu_seqlens_q.device
        if self.device.type == "cuda" and self.device.index is None:  # "cuda": the current GPU
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cu_seqlens_q = self._on_device(cu_seqlens_q)
        self.cu_seqlens_k = self.cu_seqlens_q if same else self._on_device(cu_seqlens_k)
        self.total_q, self.total_k = self.offsets_q[-1], self.offsets_k[-1]
        self.same_documents = same or self.offsets_q == self.offsets_k  # self-attention: one tile table, one launch
        lens = [(b - a, d - c) for a, b, c, d in
                zip(self.offsets_q, self.offsets_q[1:], self.offsets_k, self.offsets_k[1:])]
        self.max_seqlen_q, self.max_seqlen_k = map(max, zip(*lens))
        pad = lambda offs: [0] + np.cumsum(_pad16(np.diff(offs))).tolist()
        self.pad_q, self.pad_k = pad(self.offsets_q), pad(self.offsets_k)
        self.padded_q, self.padded_k = (padded_tokens(n, len(lens)) for n in (self.total_q, self.total_k))
        # Rows that see no key at all (bottom-right causal with Lq > Lk, or an empty key document):
        # their tiles are never launched, so their outputs must start as 0 (and their LSE as -inf).
        self.rows_without_keys = {True: any(lq > lk for lq, lk in lens), False: any(lk == 0 < lq for lq, lk in lens)}
        self.keys_without_rows = any(lq == 0 < lk for lq, lk in lens)  # dK, dV must start as 0
        self.shift_gcd = math.gcd(*(lk - lq for lq, lk in lens))  # of all causal shifts (0: all 0); _tile_safeguard
        self._tables = {}
        # (id, side) -> (weak ref, version) of the tensors known to hold these offsets (check_offsets)
        self._known = {(id(t), side): (weakref.ref(t), t._version) for side, t in
                       zip("qqkk", (cu_seqlens_q, self.cu_seqlens_q, cu_seqlens_k, self.cu_seqlens_k))}
        _PLANS[id(self.cu_seqlens_q)] = self  # every plan is found by the custom ops (section 6)
        self.version = self.cu_seqlens_q._version  # an in-place change of cu_seqlens invalidates it

    def check_offsets(self, cu: torch.Tensor, name: str) -> None:
        """Refuse cu_seqlens other than the plan's (its tiles would attend across documents): the plan's own tensors,
        unchanged, pass without a host sync; another is compared once (a sync), remembered until changed in place."""
        side = name[-1]
        if (known := self._known.get((id(cu), side))) and known[0]() is cu and known[1] == cu._version:
            return
        offsets = self.offsets_q if side == "q" else self.offsets_k
        if cu.shape != (len(offsets),) or cu.tolist() != offsets:
            shown = lambda o: str(o if len(o) <= 8 else o[:8] + ["..."])
            raise ValueError(f"{name} {shown(cu.tolist())} is not the cu_seqlens the plan was built for "
                             f"{shown(offsets)}: build a plan for this batch (flamia_plan)")
        for s in ("q", "k") if self.same_documents else (side,):  # self-attention: one read for both
            self._known[id(cu), s] = (weakref.ref(cu), cu._version)

    def _on_device(self, x: torch.Tensor) -> torch.Tensor:
        """x on the plan's device, no GPU sync (torch syncs after a pageable host tensor's copy, not a pinned one's):
        a trainer builds a batch's tables in its step (first layer's forward, backward): a sync drains the GPU."""
        if x.device.type == "cpu" and self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)

    def tiles(self, block: int, side: str, causal: bool = True, skip_masked: bool = True):
        """(n_tiles, 8) int32 table of the `block`-token tiles of the `side` ("q" or "k") documents, on the plan's
        device (cached); skip_masked=False keeps masked tiles (the quantizer sees each token)."""
        if self.same_documents and not (causal and skip_masked):
            side = "k"  # every tile costs its document's length on either side: one table serves both
        key = (block, side, causal, skip_masked)
        if key not in self._tables:
            # numpy (a loop: ~1 us per tile; torch ops: ~10 us each): a trainer builds these in every step
            q_side, q, k = side == "q", (self.offsets_q, self.pad_q), (self.offsets_k, self.pad_k)
            own, own_pad, other, other_pad = (np.asarray(x, np.int64) for x in ((*q, *k) if q_side else (*k, *q)))
            lo, lt = np.diff(own), np.diff(other)  # own, other document lengths
            n = -(-lo // block)  # tiles per document
            d = np.repeat(np.arange(len(lo)), n)  # each tile's document
            o0, o1 = own[d], own[d + 1]
            s = o0 + (np.arange(len(d)) - np.repeat(np.cumsum(n) - n, n)) * block
            e = np.minimum(s + block, o1)
            lq, lk = (lo[d], lt[d]) if q_side else (lt[d], lo[d])
            shift = lk - lq  # bottom-right causal alignment: key pos <= query pos + shift
            if not causal or not skip_masked:
                cost = lt[d]
            elif q_side:  # keys visible to the tile's last row
                cost = np.minimum(lk, np.maximum(0, e - o0 + shift))
            else:  # queries that see the tile's first key (query pos >= key pos - shift)
                cost = np.minimum(lq, np.maximum(0, lq - np.maximum(0, s - o0 - shift)))
            rows = np.stack([s, e, o0, o1, other[d], other[d + 1], other_pad[d], own_pad[d]], 1)
            if skip_masked:  # a fully masked tile is never launched
                rows, cost = rows[cost > 0], cost[cost > 0]
            rows = rows[np.argsort(-cost, kind="stable")]  # LPT: heaviest first (ties keep their order)
            self._tables[key] = self._on_device(torch.from_numpy(rows.astype(np.int32).reshape(-1, 8)))
        return self._tables[key]


flamia_plan = Plan  # the Plan of a batch: build it once and pass it as plan= to every layer


def padded_tokens(total: int, n_docs: int) -> int:
    """Width T_padded of the padded layouts: a bound on the 16-aligned documents from shapes only (fake tensors
    can't read cu_seqlens), rounded up to 128 tokens: rows start on 128-byte cache lines (measured faster, H200)."""
    return max(-(-(total + (PAD_ALIGN - 1) * n_docs) // 128) * 128, 128)


def _doc_index(cu_seqlens: torch.Tensor, total: int):
    """(T,) index of the document holding each token, and the token's position in it."""
    t = torch.arange(total, device=cu_seqlens.device)
    doc = torch.searchsorted(cu_seqlens.long(), t, right=True) - 1  # skips empty documents
    return doc, t - cu_seqlens.long()[doc]


def padded_columns(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """(T,) int64: each token's padded column ((H, T_padded) exponents, (H, D, T_padded) data_t): documents start at
    multiples of PAD_ALIGN; padding holds zero tokens (exponent 1); the tail is never written. No host sync."""
    doc, pos = _doc_index(cu_seqlens, total)
    pad_start = torch.cat([pos.new_zeros(1), _pad16(cu_seqlens.long().diff()).cumsum(0)])
    return pad_start[doc] + pos


def token_block_start(cu_seqlens: torch.Tensor, total: int, block_tokens: int) -> torch.Tensor:
    """(T,) int64: the first token of each token's scale block (document-local)."""
    _, pos = _doc_index(cu_seqlens, total)
    return torch.arange(total, device=pos.device) - pos % block_tokens


# ---- 3. Quantizers: PyTorch references and the fused Triton kernels (bit-identical) -----------
# quantize(x) for x of shape (T, H, D), block size B_t:
#     amax[t, h]  = max_d |x[t, h, d]|                  (per token)
#     amax_b      = max over the B_t-token block of t    (document-local)
#     e[h, t]     = scale rule(amax_b)                   (E8M0, a copy per token, padded_columns)
#     data[t,h,:] = E4M3(x[t, h, :] / 2^(e - 127))       (exact power-of-two division, RNE)
# One quantized tensor serves both matrix orientations: along the head dim its scale is constant (a rank-1 post-scale
# of Q K^T), along tokens it changes every B_t tokens (B_t = 32 is exactly an MX block along the contraction of P V).
# Hopper's fp8 wgmma wants its second operand K-major: the quantizer can also write a token-transposed copy.
class MXFP8(NamedTuple):
    """A quantized (T, H, D) tensor: E4M3 data (T, H, D) or data_t (H, D, T_padded: token-transposed), the other
    None; exp (H, T_padded) uint8 E8M0, in x's padded token layout; tok: the safeguard's per-token copy, if made."""
    data: torch.Tensor
    exp: torch.Tensor
    data_t: torch.Tensor = None
    tok: Optional["MXFP8"] = None

    def token_exp(self, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """(H, T) the exponent of every token of the row-major data."""
        return self.exp[:, padded_columns(cu_seqlens, self.data.shape[0])]

    def dequantize(self, cu_seqlens: torch.Tensor) -> torch.Tensor:
        return self.data.float() * e8m0_to_float(self.token_exp(cu_seqlens)).t()[..., None]


class FP4(NamedTuple):
    """A quantized (T, H, D) tensor, NVFP4 or MXFP4: quantize_fp4_reference's outputs, s2 stored (H, T)."""
    packed: torch.Tensor
    block_scale: torch.Tensor
    s2: torch.Tensor


def quantize_mxfp8_reference(x: torch.Tensor, cu_seqlens: torch.Tensor, block_tokens: int = 1):
    """The PyTorch definition of the quantizer (no transposed copy). Returns an MXFP8."""
    _check_tensor(x, "x")
    _check_block_tokens(block_tokens)
    _check_cu_seqlens(cu_seqlens, "cu_seqlens")
    T, H, D = x.shape
    amax = x.float().abs().amax(-1)  # (T, H); NaN propagates, so a NaN token gets e = 0xFF
    if block_tokens > 1:
        idx = token_block_start(cu_seqlens, T, block_tokens)[:, None].expand(T, H)
        amax = torch.zeros_like(amax).scatter_reduce(0, idx, amax, "amax", include_self=False).gather(0, idx)
    e = e8m0_exponent(amax)  # (T, H)
    inv = torch.ldexp(torch.ones_like(amax), 127 - e.int().clamp(max=253))  # 1/s, exact
    exp = e.new_ones(H, padded_tokens(T, cu_seqlens.numel() - 1))  # padding: zero tokens, e = 1
    exp[:, padded_columns(cu_seqlens, T)] = e.t()
    y = (x.float() * inv[..., None]).clamp(-E4M3_MAX, E4M3_MAX)  # as the GPU (torch's cast: NaN)
    return MXFP8(torch.where(e[..., None] == E8M0_NAN, torch.nan, y).to(torch.float8_e4m3fn), exp)


def transpose_tokens_reference(data: torch.Tensor, offsets: list) -> torch.Tensor:
    """(T, H, D) -> (H, D, T_padded), documents 16-aligned: the quantizer's layout up to the last padded end."""
    _, H, D = data.shape
    out, p = data.new_zeros(H, D, sum(_pad16(b - a) for a, b in zip(offsets, offsets[1:]))), 0
    for a, b in zip(offsets, offsets[1:]):
        out[:, :, p:p + b - a] = data[a:b].permute(1, 2, 0)
        p += _pad16(b - a)
    return out


@triton.jit
def _scale_exponent(amax, SHIFT: tl.constexpr = 8, MANT: tl.constexpr = 0x600000):
    """e8m0_exponent on fp32 bits: the E8M0 byte as int32 (defaults: E4M3; (2, 0x400000): E2M1)."""
    bits = amax.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 0xFF
    e = biased - SHIFT + ((bits & 0x7FFFFF) > MANT).to(tl.int32)
    return tl.where(biased == 255, 255, tl.maximum(e, 1))


@triton.jit
def _exp2_int(e):
    """2^(e - 127) as fp32 for an int32 biased exponent e in [1, 254], by placing e in the
    exponent field: exact, and cheaper than exp2 (255 gives +inf; callers handle NaN blocks)."""
    return (e << 23).to(tl.float32, bitcast=True)


@triton.jit
def _pad16_dev(n):
    return (n + 15) // 16 * 16  # the host's _pad16 (PAD_ALIGN = 16)


@triton.jit
def _e4m3_byte(v):
    return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.int32)


@triton.jit
def _e4m3_word(v0, v1, v2, v3, PTX_CVT: tl.constexpr):
    """The E4M3 bytes of four fp32 tensors (|v| <= 448 or NaN, RNE) packed into one little-endian
    int32, v0 in the low byte. Triton's own `.to(tl.float8e4nv)` miscompiled with Triton 3.6 on the
    H200 where the bytes feed two stores (foreign bytes in whole rows, triton-lang/triton#11111),
    so on the GPU the word comes from the PTX instruction itself (bit-exact); the interpreter runs no
    PTX, and its cast is right (section 8 makes it torch's)."""
    if PTX_CVT:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; "
            "cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; mov.b32 $0, {lo, hi}; }",
            "=r,f,f,f,f", [v0, v1, v2, v3], dtype=tl.int32, is_pure=True, pack=1)
    return _e4m3_byte(v0) | (_e4m3_byte(v1) << 8) | (_e4m3_byte(v2) << 16) | (_e4m3_byte(v3) << 24)


@triton.jit
def _load_quant_tile(X, TILES, stride_xt, stride_xh, D: tl.constexpr, ROWS: tl.constexpr,
                     PHASE: tl.constexpr = 0, STEP: tl.constexpr = 1):
    """Rows PHASE, PHASE + STEP, ... of a quantizer program's tile (tokens of one document), fp32,
    and each row's amax, +inf where the row holds inf/NaN (tl.max may drop a NaN, and the
    saturating E4M3 cast would turn inf into 448: the scale must become NaN instead)."""
    tile, h = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(TILES + tile * 8 + TILE_START), tl.load(TILES + tile * 8 + TILE_END)
    offs_t = start + tl.arange(0, ROWS) * STEP + PHASE
    x = tl.load(X + offs_t[:, None] * stride_xt + h * stride_xh + tl.arange(0, D)[None, :],
                mask=(offs_t < end)[:, None], other=0.0).to(tl.float32)
    return x, _row_amax(x), offs_t, end, h


@triton.jit
def _row_amax(x):
    bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=1)
    return tl.where(bad != 0, float("inf"), tl.max(tl.abs(x), axis=1))


@triton.jit
def _quantize_rows(x, amax, offs_t, end, col_shift, pad_end, h, Y, E, T_PAD, H, D: tl.constexpr,
                   WRITE_T: tl.constexpr):
    """Quantizes rows x (tokens offs_t of head h) with their amax: stores the E8M0 bytes (at
    columns offs_t + col_shift of the padded layout, the document's padding as 1) and, unless
    WRITE_T (then _quantize_store stores them), the E4M3 data. Returns x / s in fp32."""
    in_doc = offs_t < end
    e = _scale_exponent(amax)
    inv = _exp2_int(254 - tl.minimum(e, 253))  # 1/s = 2^(127 - e), exact
    v = tl.where(e[:, None] == 255, float("nan"), x * inv[:, None])
    col = offs_t + col_shift
    tl.store(E + h * T_PAD + col, tl.where(in_doc, e, 1).to(tl.uint8), mask=col < pad_end)
    if not WRITE_T:  # one store: Triton's cast (RNE, saturating) is right here
        offs = (offs_t[:, None] * H + h) * D + tl.arange(0, D)[None, :]
        tl.store(Y + offs, v.to(tl.float8e4nv), mask=in_doc[:, None])
    return v


@triton.jit
def _quantize_store(x0, x1, x2, x3, a0, a1, a2, a3, offs_t, end, h, p0, shift, pad_end, Y, E, YT, T_PAD,
                    H: tl.constexpr, D: tl.constexpr, WRITE_T: tl.constexpr, PTX_CVT: tl.constexpr):
    """Quantizes and stores the four token phases of a tile (rows offs_t + j of x_j, amax a_j);
    p0: the tile's first padded column, shift: token -> padded column."""
    v0 = _quantize_rows(x0, a0, offs_t, end, shift, pad_end, h, Y, E, T_PAD, H, D, WRITE_T)
    v1 = _quantize_rows(x1, a1, offs_t + 1, end, shift, pad_end, h, Y, E, T_PAD, H, D, WRITE_T)
    v2 = _quantize_rows(x2, a2, offs_t + 2, end, shift, pad_end, h, Y, E, T_PAD, H, D, WRITE_T)
    v3 = _quantize_rows(x3, a3, offs_t + 3, end, shift, pad_end, h, Y, E, T_PAD, H, D, WRITE_T)
    if WRITE_T:  # tokens 4i..4i+3 of channel d, first in the low byte: one int32 per (i, d)
        w = _e4m3_word(v0, v1, v2, v3, PTX_CVT)
        # Over the document's whole padded range, zeros past its end: the padding is defined data,
        # so the attention kernels may load it with 16-byte async copies.
        offs_w = p0 // 4 + tl.arange(0, offs_t.shape[0])
        YT32 = YT.to(tl.pointer_type(tl.int32), bitcast=True)
        tl.store(YT32 + (h * D + tl.arange(0, D)[None, :]) * (T_PAD // 4) + offs_w[:, None], w,
                 mask=(offs_w < pad_end // 4)[:, None])


@triton.jit
def _quantize_tile(X, TILES, Y, E, YT, Y_TOK, E_TOK, YT_TOK, stride_xt, stride_xh, T_PAD, H: tl.constexpr,
                   D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
                   WRITE_T: tl.constexpr, WRITE_TOK: tl.constexpr, PTX_CVT: tl.constexpr):
    # The tile is read as four token phases, x_j = rows 4i + j, all in one register layout, so the
    # token-transposed copy packs four tokens of a channel into an int32 elementwise and stores
    # 32-bit words, consecutive across a warp. (Storing the fp8 tile transposed instead makes Triton
    # shuffle bytes between threads: several times slower on the H200.)
    Q: tl.constexpr = BLOCK_T // 4
    x0, a0, offs_t, end, h = _load_quant_tile(X, TILES, stride_xt, stride_xh, D, Q, 0, 4)
    x1, a1, _, _, _ = _load_quant_tile(X, TILES, stride_xt, stride_xh, D, Q, 1, 4)
    x2, a2, _, _, _ = _load_quant_tile(X, TILES, stride_xt, stride_xh, D, Q, 2, 4)
    x3, a3, _, _, _ = _load_quant_tile(X, TILES, stride_xt, stride_xh, D, Q, 3, 4)
    row = TILES + tl.program_id(0) * 8
    doc_start, doc_pad = tl.load(row + OWN_START), tl.load(row + OWN_PAD)
    pad_end = doc_pad + _pad16_dev(tl.load(row + OWN_END) - doc_start)
    p0 = doc_pad + (tl.load(row + TILE_START) - doc_start)  # the tile's first padded position
    if WRITE_TOK:  # the per-token copy the causal safeguard uses on the diagonal
        _quantize_store(x0, x1, x2, x3, a0, a1, a2, a3, offs_t, end, h, p0, doc_pad - doc_start,
                        pad_end, Y_TOK, E_TOK, YT_TOK, T_PAD, H, D, WRITE_T, PTX_CVT)
    if BLOCK_TOKENS > 1:  # the tile starts at a block boundary and holds BLOCK_T // B_t blocks
        amax = tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3))  # tokens 4i..4i+3
        NB: tl.constexpr = BLOCK_T // BLOCK_TOKENS
        amax = tl.max(tl.reshape(amax, (NB, BLOCK_TOKENS // 4)), axis=1)
        a0 = tl.reshape(tl.broadcast_to(amax[:, None], (NB, BLOCK_TOKENS // 4)), (Q,))
        a1, a2, a3 = a0, a0, a0
    _quantize_store(x0, x1, x2, x3, a0, a1, a2, a3, offs_t, end, h, p0, doc_pad - doc_start,
                    pad_end, Y, E, YT, T_PAD, H, D, WRITE_T, PTX_CVT)


@triton.jit
def _quantize_kernel(
        X, TILES,  # input (T, H, D) and the Plan's 128-token tiles
        Y, E, YT, Y_TOK, E_TOK, YT_TOK,  # data (T, H, D), exp, data_t (padded); *_TOK: B_t = 1
        stride_xt, stride_xh, T_PAD,
        X2, Y2, E2, YT2, Y2_TOK, E2_TOK, YT2_TOK, stride_x2t, stride_x2h,  # SECOND: a 2nd tensor
        XQ, YQ, EQ, stride_xqt, stride_xqh,  # QUERIES: Q, per token, row-major
        H: tl.constexpr, HQ: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_TOKENS: tl.constexpr, WRITE_T: tl.constexpr, WRITE_TOK: tl.constexpr,
        PTX_CVT: tl.constexpr, SECOND: tl.constexpr, WRITE_T2: tl.constexpr,
        QUERIES: tl.constexpr):
    """One program = one 128-token tile of one head. Grid axis 2 picks the tensor, so that K
    (row-major), V (token-transposed) and Q (per token) of the same documents share one launch:
    0 -> X, 1 -> X2 (SECOND), last -> Q (QUERIES; axis 1 covers its HQ >= H heads)."""
    which = tl.program_id(2)
    if QUERIES and which == SECOND + 1:
        _quantize_tile(XQ, TILES, YQ, EQ, YQ, YQ, EQ, YQ, stride_xqt, stride_xqh, T_PAD, HQ, D,
                       BLOCK_T, 1, False, False, PTX_CVT)
    elif tl.program_id(1) < H:
        if SECOND and which == 1:
            _quantize_tile(X2, TILES, Y2, E2, YT2, Y2_TOK, E2_TOK, YT2_TOK, stride_x2t, stride_x2h, T_PAD,
                           H, D, BLOCK_T, BLOCK_TOKENS, WRITE_T2, WRITE_TOK, PTX_CVT)
        else:
            _quantize_tile(X, TILES, Y, E, YT, Y_TOK, E_TOK, YT_TOK, stride_xt, stride_xh, T_PAD,
                           H, D, BLOCK_T, BLOCK_TOKENS, WRITE_T, WRITE_TOK, PTX_CVT)


def _quantizer_input(x, plan: Plan, side: str, name: str = "x") -> torch.Tensor:
    _check_tensor(x, name)
    if side not in ("q", "k"):
        raise ValueError(f"side must be 'q' or 'k', got {side!r}")
    total = plan.total_q if side == "q" else plan.total_k
    if x.shape[0] != total:
        raise ValueError(f"{name} has {x.shape[0]} tokens but the plan's cu_seqlens_{side} ends at {total}")
    if x.device != plan.device:
        raise ValueError(f"{name} is on {x.device} but the plan is on {plan.device}")
    return x if x.stride(-1) == 1 else x.contiguous()


class MXFP8Launch(NamedTuple):
    """What one quantize_mxfp8_launch wrote: x's MXFP8, and second's and the queries' if asked."""
    x: MXFP8
    second: Optional[MXFP8]
    queries: Optional[MXFP8]


def quantize_mxfp8(x: torch.Tensor, plan: Plan, block_tokens: int = 1, side: str = "q",
                   transposed: bool = False, per_token_copy: bool = False) -> MXFP8:
    """Fused Triton quantizer: ONE launch reads x (T, H, D) once and writes the block-scaled data (row-major, or
    token-transposed with transposed=True: how the forward reads V), its exponents, and with per_token_copy=True
    the per-token copy in the same layout (.tok, the causal safeguard's). `side`: whose documents x follows."""
    return quantize_mxfp8_launch(x, plan, block_tokens, side, transposed, per_token_copy).x


def quantize_mxfp8_launch(x: torch.Tensor, plan: Plan, block_tokens: int = 1, side: str = "q",
                          transposed: bool = False, per_token_copy: bool = False, second=None,
                          queries=None) -> MXFP8Launch:
    """quantize_mxfp8 with more tensors in its launch (the forward's one): second=(x2, transposed2), like x in shape,
    documents and block_tokens (K and V); queries=q (T, Hq, D), same documents, Hq a multiple of H, per token."""
    _check_block_tokens(block_tokens)
    x = _quantizer_input(x, plan, side)
    T, H, D = x.shape
    t_pad = plan.padded_q if side == "q" else plan.padded_k

    def alloc(x, transposed, tok):  # x's MXFP8 (with its per-token copy if tok), to be written
        new = lambda: MXFP8(None if transposed else x.new_empty(x.shape, dtype=torch.float8_e4m3fn),
                            x.new_empty(x.shape[1], t_pad, dtype=torch.uint8),
                            x.new_empty(x.shape[1], D, t_pad, dtype=torch.float8_e4m3fn) if transposed else None)
        return new()._replace(tok=new()) if tok else new()

    def outputs(m):  # the kernel's Y, E, YT, Y_TOK, E_TOK, YT_TOK for m (Y and YT: the same data)
        tok = m.tok or m  # without per-token copies: m again, never written
        y = lambda m: m.data_t if m.data is None else m.data
        return y(m), m.exp, y(m), y(tok), tok.exp, y(tok)
    out = alloc(x, transposed, per_token_copy)
    x2, out2, xq, out_q = x, out, x, out  # what the kernel reads and writes only if asked
    if second is not None:
        x2 = _quantizer_input(second[0], plan, side, "second")
        if x2.shape != x.shape:
            raise ValueError(f"second has shape {tuple(x2.shape)}, expected x's {tuple(x.shape)}")
        out2 = alloc(x2, second[1], per_token_copy)
    if queries is not None:
        if not plan.same_documents:
            raise ValueError("queries= needs a plan whose cu_seqlens_q and _k are the same documents")
        xq = _quantizer_input(queries, plan, side, "queries")
        if xq.shape[2] != D or xq.shape[1] % H != 0:
            raise ValueError(f"queries has shape {tuple(xq.shape)}, expected ({T}, a multiple of {H}, {D})")
        out_q = alloc(xq, False, False)
    tiles = plan.tiles(QUANT_TILE, side, causal=False, skip_masked=False)
    if tiles.shape[0] > 0:
        _quantize_kernel[(tiles.shape[0], xq.shape[1], 1 + (second is not None) + (queries is not None))](
            x, tiles, *outputs(out), *x.stride()[:2], t_pad, x2, *outputs(out2), *x2.stride()[:2], xq, out_q.data,
            out_q.exp, *xq.stride()[:2], H=H, HQ=xq.shape[1], D=D, BLOCK_T=QUANT_TILE, BLOCK_TOKENS=block_tokens,
            WRITE_T=transposed, WRITE_TOK=per_token_copy, PTX_CVT=not INTERPRETED, SECOND=second is not None,
            WRITE_T2=out2.data is None, QUERIES=queries is not None, num_warps=8)  # 4 warps spill (per-token copy)
    return MXFP8Launch(out, out2 if second is not None else None, out_q if queries is not None else None)


@triton.jit
def _e2m1_code(a):
    """Round-to-nearest-even onto the E2M1 grid, as e2m1_encode: the number of boundaries passed."""
    m = tl.abs(a)
    k = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
         + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32)
         + (m > 5.0).to(tl.int32))
    return k + 8 * (a < 0).to(tl.int32)


@triton.jit
def _quantize_fp4_kernel(X, TILES, P, SB, S2, stride_xt, stride_xh, T,
                         H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, MX: tl.constexpr):
    """NVFP4 (MX=False) or MXFP4 in one pass, bit-identical to quantize_fp4_reference (div_rn, as torch)."""
    x, amax, offs_t, end, h = _load_quant_tile(X, TILES, stride_xt, stride_xh, D, BLOCK_T)
    if MX:  # E8M0 per 32 elements; the second level is 1
        NB: tl.constexpr = D // 32
        xb = tl.reshape(x, (BLOCK_T, NB, 32))
        bad_b = tl.max(((xb != xb) | (tl.abs(xb) == float("inf"))).to(tl.int32), axis=2)
        e = _scale_exponent(tl.where(bad_b != 0, float("inf"), tl.max(tl.abs(xb), axis=2)), 2, 0x400000)
        inv = _exp2_int(254 - tl.minimum(e, 253))  # 1/s = 2^(127 - e), exact
        code = tl.where((e == 255)[:, :, None], 0, _e2m1_code(xb * inv[:, :, None]))  # as torch
        sb = e.to(tl.uint8)
        s2 = tl.full((BLOCK_T,), 1.0, tl.float32)
    else:  # E4M3 per 16 elements, relative to a per-token FP32 second level
        NB: tl.constexpr = D // 16
        s2 = tl.math.div_rn(amax, 2688.0)  # 448 * 6: the block scale then fits E4M3
        s2 = tl.where(amax == float("inf"), float("nan"), tl.where(s2 > 0, s2, 1.0))
        xb = tl.reshape(x, (BLOCK_T, NB, 16))
        sb = tl.math.div_rn(tl.math.div_rn(tl.max(tl.abs(xb), axis=2), 6.0), s2[:, None])
        sb = tl.minimum(sb, 448.0).to(tl.float8e4nv)
        denom = sb.to(tl.float32) * s2[:, None]
        denom = tl.where(denom > 0, denom, 1.0)
        code = _e2m1_code(tl.math.div_rn(xb, denom[:, :, None]))
    lo, hi = tl.split(tl.reshape(code, (BLOCK_T, D // 2, 2)))  # first element in the low nibble
    in_doc = (offs_t < end)[:, None]
    tl.store(P + (offs_t[:, None] * H + h) * (D // 2) + tl.arange(0, D // 2)[None, :],
             (lo | (hi << 4)).to(tl.uint8), mask=in_doc)
    tl.store(SB + (offs_t[:, None] * H + h) * NB + tl.arange(0, NB)[None, :], sb, mask=in_doc)
    tl.store(S2 + h * T + offs_t, s2, mask=offs_t < end)


def quantize_fp4(x: torch.Tensor, plan: Plan, fmt: str = "nvfp4", side: str = "q") -> FP4:
    """Fused Triton quantize_fp4_reference of x (T, H, D) into fmt: one launch, x read once."""
    x = _quantizer_input(x, plan, side)
    if fmt not in ("nvfp4", "mxfp4"):
        raise ValueError(f"fmt must be 'nvfp4' or 'mxfp4', got {fmt!r}")
    T, H, D = x.shape
    mx = fmt == "mxfp4"
    block = (D // MXFP4_BLOCK, torch.uint8) if mx else (D // NVFP4_BLOCK, torch.float8_e4m3fn)  # scales
    out = FP4(x.new_empty(T, H, D // 2, dtype=torch.uint8), x.new_empty(T, H, block[0], dtype=block[1]),
              x.new_empty(H, T, dtype=torch.float32))
    tiles = plan.tiles(QUANT_TILE, side, causal=False, skip_masked=False)
    if tiles.shape[0] > 0:
        _quantize_fp4_kernel[(tiles.shape[0], H)](x, tiles, *out, x.stride(0), x.stride(1), T,
                                                   H=H, D=D, BLOCK_T=QUANT_TILE, MX=mx, num_warps=4)
    return out


# Q/K rotation (rotate_qk=True; "incoherence processing", FlashAttention-3's for FP8). S = Q K^T is unchanged when Q
# and K share one orthogonal rotation; their quantization error is not: a head-dim channel with outliers (RoPE makes
# some) sets its block's scale, pushing the others toward E4M3's bottom. A Hadamard matrix with random column signs
# spreads every channel over all D. We use the UNNORMALIZED +-1 matrix (exact in bf16; 1/sqrt(128) is not) and divide
# the softmax scale by D (a power of two: exact). Along the head dim only: no statistic crosses tokens.
@functools.lru_cache(maxsize=None)  # one per head dim and device
def qk_rotation(head_dim: int, device=None) -> torch.Tensor:
    """The (D, D) +-1 matrix H diag(signs), H H^T = D I (Sylvester Hadamard, fixed random signs)."""
    if head_dim & (head_dim - 1):
        raise ValueError(f"rotate_qk needs a power-of-two head_dim, got {head_dim}")
    h = torch.ones(1, 1)
    while h.shape[0] < head_dim:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(0)) * 2 - 1
    return (h * signs).to(device)


def _rotate_qk(q, k, softmax_scale):
    h = qk_rotation(q.shape[-1], q.device)
    return q @ h.to(q.dtype), k @ h.to(k.dtype), softmax_scale / q.shape[-1]


# ---- 4. The reference oracle ------------------------------------------------------------------
# reference_attention() defines what a recipe computes: quantize as the recipe does, dequantize, then exact attention
# with per-document (causal) masking. It does NOT round P: the kernels also round P (times V's power-of-two scale,
# relative to the row's max) to E4M3 for the fp8 P V (bf16 for recipe="bf16"), a random error of ~1.5e-2 relative L2
# in O (~2e-3 for bf16) that the test tolerances allow; the backward rounds P and dS to bf16. It is the kernels' test
# oracle and the CPU path. Quantizers are straight-through: its autograd defines the kernels' gradients.
def _fake_quant(x: torch.Tensor, cu_seqlens: torch.Tensor, block_tokens: int, fmt: str = "e4m3"):
    """x dequantized exactly (fp32: FP4's s2 isn't bf16) with the identity gradient; x + (deq - x) rounds twice."""
    deq = (quantize_mxfp8_reference(x.detach(), cu_seqlens, block_tokens).dequantize(cu_seqlens) if fmt == "e4m3"
           else dequantize_fp4(*quantize_fp4_reference(x.detach(), fmt)))
    x = x.float()
    return deq + (x - x.detach())


def reference_attention(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, causal=True, softmax_scale=None,
                        recipe="mxfp8", block_tokens=1, safeguard=True, rotate_qk=False, return_lse=False):
    """q (Tq, H, D), k and v (Tk, Hk, D) packed documents -> o (Tq, H, D) [, lse (H, Tq) ln].

    In fp32 (fp64 if q is fp64) on the recipe's dequantized operands, P unrounded (section 4):
      "bf16":  the inputs as they are.
      "mxfp8": Q per token, K and V per `block_tokens` block of one document (E4M3 + E8M0); with
               the safeguard, pairs that straddle use per-token quantized k_j, v_j.
      "nvfp4" / "mxfp4": K in that FP4 format (per token: never straddles), Q and V as in mxfp8.
    rotate_qk: first multiply Q and K by qk_rotation. Causal: bottom-right within each document.
    Rows without any visible key give 0 (and LSE -inf)."""
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    _check_options(recipe, block_tokens, None)
    r = _RECIPES[recipe]
    (Tq, H, D), (Tk, Hk) = q.shape, k.shape[:2]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    if rotate_qk:
        q, k, scale = _rotate_qk(q, k, scale)
    k_tok, v_tok = k, v
    if r.quantized:
        q = _fake_quant(q, cu_seqlens_q, 1)  # Q is never block-scaled: it would leak along rows
        k_tok = _fake_quant(k, cu_seqlens_k, 1, r.k_format)
        k = k_tok if r.k_fp4 else _fake_quant(k, cu_seqlens_k, block_tokens)  # FP4: per token
        v_tok, v = _fake_quant(v, cu_seqlens_k, 1), _fake_quant(v, cu_seqlens_k, block_tokens)
    q, k, v, k_tok, v_tok = (x.to(cdt) for x in (q, k, v, k_tok, v_tok))
    if Hk != H:  # GQA / MQA: each K/V head serves H // Hk consecutive query heads
        k, v, k_tok, v_tok = (x.repeat_interleave(H // Hk, dim=1) for x in (k, v, k_tok, v_tok))
    (doc_q, pos_q), (doc_k, pos_k) = _doc_index(cu_seqlens_q, Tq), _doc_index(cu_seqlens_k, Tk)
    pos_q = (pos_q + (cu_seqlens_k.diff() - cu_seqlens_q.diff()).long()[doc_q])[:, None]  # key axis
    pos_k = pos_k[None, :]
    visible = doc_q[:, None] == doc_k[None, :]
    if causal:
        visible &= pos_k <= pos_q
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    same_block = torch.zeros_like(visible)
    if _token_copies(r, causal, safeguard, block_tokens):
        same_block = visible & straddles(pos_q, pos_k, block_tokens)
        s = torch.where(same_block, torch.einsum("ihd,jhd->hij", q, k_tok) * scale, s)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (H, Tq)
    p = torch.exp(s - torch.where(lse.isfinite(), lse, 0.0)[..., None])
    o = torch.einsum("hij,jhd->ihd", p.masked_fill(same_block, 0), v)
    o = o + torch.einsum("hij,jhd->ihd", p.masked_fill(~same_block, 0), v_tok)
    return (o, lse) if return_lse else o


def attention_fp64(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, causal=True, softmax_scale=None):
    """Exact attention in float64 (for error reports): no quantization anywhere."""
    return reference_attention(q.double(), k.double(), v.double(), cu_seqlens_q, cu_seqlens_k,
                               causal=causal, softmax_scale=softmax_scale, recipe="bf16")


# ---- 5. Kernels. First, the variant: what computes a call -------------------------------------
# variant() decides once per call what runs -- backend, forward kernel, K's format, tiles, the safeguard's
# mode per kernel -- or why the requested backend cannot; the launchers (5a, 5b) only read its Variant.
#
# TILES, one row per head dim: a head dim joins here and nowhere else (HEAD_DIMS: its keys; the Gluon kernels refuse
# head dims they lack). The tl.dot tiles are `bench.py --tune`'s on the H200 at D=128 (D=64 reuses them): fp8 wants
# long key tiles (P V contracts over BLOCK_N) and a warpgroup per 64 query rows, narrow diagonal tiles (MASKED_N)
# help packed documents, bigger query tiles in dK/dV spill; the FP4 emulation is not tuned. Blackwell
# (`bench.py --sm100`, never timed): Triton lowers tl.dot_scaled to the MX MMA only for >= 128 query rows (64 upcast
# K to a bf16 MMA), with the widest key tiles compiling without spills; the H200's dK/dV tiles spill there: 64 keys.
class Tiles(NamedTuple):
    fwd: dict  # K's operand (Variant.k_operand) -> (BLOCK_M, BLOCK_N, MASKED_N, num_warps, num_stages)
    fwd_sm100: dict  # of the tl.dot forward; the same, tl.dot_scaled forward on Blackwell
    dkdv: tuple  # (BLOCK_M, BLOCK_N, num_warps, num_stages) of dK/dV (query x key tiles) ...
    dkdv_sm100: tuple  # ... on Blackwell (tcgen05 needs >= 64 rows)
    dq: tuple  # the same, dQ (every GPU)
    dq_pair_stages: int  # dQ's stages with the per-pair safeguard (it streams K, V and their copies)


_FWD_TILES = dict(bf16=(128, 128, 64, 8, 3), e4m3=(64, 128, 32, 4, 3), fp4_decoded=(128, 64, 64, 8, 3),
                  fp4_packed=(128, 64, 64, 8, 3))
_FWD_TILES_SM100 = dict(e4m3=(128, 128, 32, 8, 3), fp4_packed=(128, 32, 32, 8, 3))
TILES = {  # D=128, per pair: three stages of four bf16 key tiles need 256 KiB of shared memory (H200: 227)
    128: Tiles(_FWD_TILES, _FWD_TILES_SM100, (32, 128, 8, 3), (32, 64, 8, 1), (128, 64, 8, 3), 2),
    64: Tiles(_FWD_TILES, _FWD_TILES_SM100, (32, 128, 8, 3), (32, 64, 4, 1), (128, 64, 8, 3), 3)}
HEAD_DIMS = tuple(sorted(TILES))


class Variant(NamedTuple):  # what computes one call
    recipe: Recipe
    backend: str  # the forward's: "tl", "dot_scaled" or "gluon" (one backward serves all three)
    refusal: Optional[str] = None  # why the requested backend cannot compute the call (ValueError)
    kernel: object = None  # the tl forward: _attn_fwd or _attn_fwd_blackwell (None: Gluon's)
    tma: bool = False  # the forward reads Q, K, V through TMA descriptors (dot_scaled on Blackwell)
    k_operand: str = None  # K as the tl forward reads it (5a): bf16, e4m3, fp4_decoded, fp4_packed
    copies: bool = False  # the safeguard's per-token copies of K and V are made (_token_copies)
    fwd: tuple = None  # (BLOCK_M, BLOCK_N, MASKED_N, num_warps, num_stages) of the forward
    dkdv: tuple = None  # (BLOCK_M, BLOCK_N, num_warps, num_stages) of the dK/dV kernel ...
    dq: tuple = None  # ... and of the dQ kernel
    modes: tuple = None  # the safeguard of the forward, dK/dV and dQ: "off", "tile" or "pair"
    bwd: str = "tl"  # the backward's kernels: "tl" (deterministic) or "gluon" (dQ's adds unordered)
    quantize_q: bool = False  # the tl forward quantizes Q itself (it launches a tile for every row)


def _tile_safeguard(plan: Plan, block_tokens: int, *blocks: int) -> bool:
    """Whether kernels with these tile sizes can take the causal safeguard per tile, not per pair: when B_t is a
    multiple of every tile size and divides every causal shift (always so in self-attention), each start-aligned
    query or key tile lies in one key block, and a tile pair shares its block (every visible pair straddles: the tile
    uses the per-token copies) or lies in an earlier one (safe). So B_t=128 costs one MMA per masked tile."""
    return block_tokens % max(blocks) == 0 and plan.shift_gcd % block_tokens == 0


def _is_blackwell(x: torch.Tensor) -> bool:
    return x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 10


# backend="gluon": flamia_hopper.py (same operands, safeguard); refused, never replaced, where it can't run.
_GLUON_IMPORT_ERROR = None
try:
    import flamia_hopper
except Exception as e:  # absent, or this triton's Gluon API differs from the one it was written for
    flamia_hopper = None
    _GLUON_IMPORT_ERROR = f"flamia_hopper.py not importable: {type(e).__name__}: {e}"
_SAID = set()  # reasons already given for not taking the Gluon forward by default


@functools.lru_cache(maxsize=None)  # facts of the process: the file, triton, the GPU
def gluon_unavailable_reason():
    """None where backend="gluon" runs (flamia_hopper.py, triton 3.6, sm_90), else why not."""
    if flamia_hopper is None:
        return _GLUON_IMPORT_ERROR
    if not getattr(flamia_hopper, "PADDED_EXPONENTS", False):  # never read another layout
        return ("flamia_hopper.py reads E8M0 rows as (H, T), token-indexed; the Operands' rows "
                "are in the padded token layout (padded_columns)")
    return flamia_hopper.unavailable_reason()


def _backend_refusal(r: Recipe, backend: Optional[str]) -> Optional[str]:
    """Why `backend` can compute no call of recipe r here (None: it may compute some)."""
    if backend == "gluon" and gluon_unavailable_reason():
        return f"backend='gluon' is not available here: {gluon_unavailable_reason()}"
    if backend is not None and backend not in r.backends:
        served = " or ".join(repr(n) for n, x in _RECIPES.items() if backend in x.backends)
        return f"backend={backend!r} is for recipe={served}, got recipe={r.name!r} (Recipe.backends)"
    return None


def variant(x, recipe: str, block_tokens: int, plan: Plan = None, causal: bool = True,
            safeguard: bool = True, backend: Optional[str] = None, deterministic: bool = False) -> Variant:
    """The Variant of a call on q-like x (GPU, dtype, head dim). backend=None: the rule below (each choice measured
    fastest); deterministic: the tl backward. No plan: safeguard modes (and their refusals) unknown (None)."""
    r, D = _RECIPES[recipe], x.shape[-1]
    if (row := TILES.get(D)) is None:
        raise ValueError(f"head_dim {D} has no tiles: add a row to flamia.TILES (rows: {sorted(TILES)})")
    copies = _token_copies(r, causal, safeguard, block_tokens)
    mode = lambda blocks: (None if plan is None else "off" if not copies else
                           "tile" if _tile_safeguard(plan, block_tokens, *blocks) else "pair")
    # Gluon's forward and dK/dV tiles (own warps, stages); why Gluon with such tiles can't compute the call
    gluon_fwd = lambda: (flamia_hopper.BLOCK_M, 128, 128, None, None)
    gluon_dkdv = lambda: (flamia_hopper.bwd_block_m(D, copies), flamia_hopper.BWD_BLOCK_N, None, None)
    gluon_refusal = lambda tiles: (gluon_unavailable_reason() or ("gluon" not in r.backends and f"recipe={recipe!r}")
                                   or (plan and flamia_hopper.unsupported_reason(x.dtype, D, mode(tiles()[:2]))))
    blackwell = _is_blackwell(x)
    refusal = _backend_refusal(r, backend)
    gluon_bwd = not deterministic and backend in (None, "gluon") and plan is not None
    if backend is None:
        backend = "dot_scaled" if "dot_scaled" in r.backends and blackwell else "tl"
        if (recipe == "mxfp8" and block_tokens % 128 == 0 and D == 128 and x.is_cuda
                and torch.cuda.get_device_capability(x.device)[0] == 9):
            why = gluon_refusal(gluon_fwd)  # asked only where it decides (variant runs every call)
            if why is None:
                backend = "gluon"
            elif why not in _SAID:
                _SAID.add(why)
                warnings.warn(f"FLAMIA: not using the Gluon forward (the fastest on this GPU for "
                              f"this configuration): {why}; the tl forward computes the same function")
    elif backend == "gluon" and refusal is None and (why := gluon_refusal(gluon_fwd)):
        refusal = f"backend='gluon' cannot compute this call: {why}; use backend='tl'"
    if refusal:
        return Variant(r, backend, refusal)
    tma = backend == "dot_scaled" and blackwell
    k_operand = ("bf16" if not r.quantized else "e4m3" if not r.k_fp4 else
                 "fp4_packed" if backend == "dot_scaled" else "fp4_decoded")
    fwd = gluon_fwd() if backend == "gluon" else (row.fwd_sm100 if tma else row.fwd)[k_operand]
    dkdv, dq = (row.dkdv_sm100 if blackwell else row.dkdv), row.dq
    modes = (mode(fwd[:3]), mode(dkdv[:2]), mode(dq[:2]))
    if modes[2] == "pair":
        dq = (*dq[:3], row.dq_pair_stages)
    bwd = "tl"
    if gluon_bwd and not gluon_refusal(gluon_dkdv):  # dQ's adds in no fixed order: not deterministic
        bwd, dkdv, modes = "gluon", gluon_dkdv(), (modes[0], mode(gluon_dkdv()[:2]), None)
    kernel = {"tl": _attn_fwd, "dot_scaled": _attn_fwd_blackwell}.get(backend)
    quantize_q = kernel is _attn_fwd and r.quantized and plan is not None and not plan.rows_without_keys[causal]
    return Variant(r, backend, None, kernel, tma, k_operand, copies, fwd, dkdv, dq, modes, bwd, quantize_q)


# ---- 5a. Forward kernels ----------------------------------------------------------------------
# Two kernels, _attn_fwd (tl.dot) and _attn_fwd_blackwell (tl.dot_scaled), share their steps. A program:
# a query tile (BLOCK_M rows of one document) x a query head. Online softmax, base 2 (s2 = S * log2(e)):
#
#   for each key tile j:           (first the tiles every row sees fully, then the masked ones)
#       s2   = (Qq Kq^T) * sk[j] * (sq[i] * scale * log2 e)   fp8 MMA, rank-1 post-scale
#       m    = max(m, rowmax(s2));  p = exp2(s2 - m);  l = l * alpha + rowsum(p)
#       acc += E4M3(p * 2^(ev[j] - ref_i + 8)) @ Vq^T          fp8 MMA, V's scale folded into P
#
# V's scale varies along the contraction, so it is folded into P before P is quantized (exact: powers of two). To
# keep p * 2^ev in E4M3's range, each row carries a reference exponent ref_i = max ev over the keys seen (then
# p~ <= 2^8 < 448); the accumulator lives in units of 2^(ref_i - 8), rescaled as ref_i grows (like m). ref_i is a
# per-row statistic over *visible* keys only (a max over the whole tile would leak the future on the diagonal).
#
# The causal safeguard (section 2's rules), on masked (diagonal) tiles only: straddling pairs use the
# per-token copies KS, VS ("pair": a second small MMA on the diagonal tiles), or, where _tile_safeguard
# holds, the masked tiles read KS, VS instead of K, V ("tile": one MMA, as at B_t = 1).
#
# K reaches the forward as one of four operands (K_OPERAND; Recipe.k_format is how K is stored): "bf16"
# (recipe bf16), "e4m3" (MXFP8), "fp4_decoded" (FP4 values times their block scales, decoded to bf16 on the
# host -- exact, 6 significant bits -- with the FP32 second level as a per-key factor: an exact emulation
# for GPUs without FP4 MMAs) and "fp4_packed" (E2M1 + E8M0 for tl.dot_scaled, the Blackwell kernel's).
@triton.jit
def _e8m0_blocks(e, D: tl.constexpr):
    """tl.dot_scaled's scale operand for per-row E8M0 scales: (rows, D // 32) uint8."""
    return tl.broadcast_to(e.to(tl.uint8)[:, None], (e.shape[0], D // 32))


# Hopper's fp8 wgmma takes P from registers in another layout than the fp32 accumulator it was computed in: of
# each 16 keys, a thread's accumulator holds columns 2q, 2q+1, 2q+8, 2q+9 (q = lane % 4), its fp8 A operand the
# contraction's columns 4q .. 4q+3. Converting costs shuffles, byte permutes and selects (~0.9-1 instruction per
# score). FA3's remedy: the unmasked E4M3 tiles load K, its scales and V's exponents in _key_order(WGMMA_ORDER=True),
# so the accumulator's registers ARE the operand's; _in_key_order relabels P to V's key order (no instructions).
@triton.jit
def _key_order(BLOCK_N: tl.constexpr, WGMMA_ORDER: tl.constexpr):
    """Offsets 0 .. BLOCK_N-1 of a key tile in the order its scores are computed: position 16g + 8h + 2q + b
    holds key 16g + 4q + 2h + b with WGMMA_ORDER, else key order."""
    c = tl.arange(0, BLOCK_N)
    if WGMMA_ORDER:
        c = (c & ~15) | (((c >> 1) & 3) << 2) | ((c >> 2) & 2) | (c & 1)
    return c


@triton.jit
def _in_key_order(p, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """P (BLOCK_M, BLOCK_N) computed in _key_order(WGMMA_ORDER=True), its columns in key order."""
    p = tl.permute(tl.reshape(p, (BLOCK_M, BLOCK_N // 16, 2, 4, 2)), (0, 1, 3, 2, 4))
    return tl.reshape(p, (BLOCK_M, BLOCK_N))


@triton.jit
def _load_keys(K, start_n, k_len, stride, W: tl.constexpr, BLOCK_N: tl.constexpr, other=0.0,
               WGMMA_ORDER: tl.constexpr = False):
    """A (BLOCK_N, W) tile of K (rows = the document-local keys from start_n, in _key_order): K
    points at the document start and the head, rows `stride` elements apart; or K is the TMA
    descriptor of exactly that range (Blackwell), whose boxes read zeros past the document's end."""
    if isinstance(K, tl.tensor_descriptor):
        k = K.load([start_n, 0])
    else:
        offs_n = start_n + _key_order(BLOCK_N, WGMMA_ORDER)
        # one offset tensor, then one pointer add: a pointer tensor is 64-bit per element
        k = tl.load(K + (offs_n[:, None] * stride + tl.arange(0, W)[None, :]),
                    mask=(offs_n < k_len)[:, None], other=other)
    return k


@triton.jit
def _load_values(V, start_n, v_len, stride_vd, stride_vt, D: tl.constexpr, BLOCK_N: tl.constexpr,
                 MASKED: tl.constexpr):
    """A (BLOCK_N, D) V tile (V as in _load_keys, or its TMA descriptor over (D, padded keys)).
    The aligned document-local offset keeps fp8 V's loads provably 16-byte aligned, and the mask
    (up to the document's zero-padded end, a multiple of 16) constant over 16 keys, so a masked
    load is still a pipelined 16-byte async copy (a per-key mask would make it a synchronous byte
    load); unmasked tiles lie inside the document's padded range and need no mask."""
    if isinstance(V, tl.tensor_descriptor):
        v = tl.trans(V.load([0, start_n]))
    else:
        offs_n = start_n + tl.arange(0, BLOCK_N)
        v_offs = tl.arange(0, D)[None, :] * stride_vd + offs_n[:, None] * stride_vt
        if MASKED:
            v = tl.load(V + v_offs, mask=(offs_n < v_len)[:, None], other=0.0)
        else:
            v = tl.load(V + v_offs)
    return v


@triton.jit
def _load_e8m0(E, n0, n_valid, other: tl.constexpr, BLOCK: tl.constexpr, WORDS: tl.constexpr,
               WGMMA_ORDER: tl.constexpr = False):
    """E[n0 + i], i < BLOCK (in _key_order), as int32 (`other` from n_valid on) from an E8M0 row in the padded
    layout: E + n0 is 16-byte aligned and n_valid a multiple of 16. WORDS (Blackwell): read in
    aligned little-endian 32-bit words, where Triton would load each byte the MMA's scale layout
    holds on its own; on Hopper that unpacking costs more registers than the bytes save."""
    if WORDS:
        words = n0 // 4 + tl.arange(0, BLOCK // 4)
        w = tl.load(E.to(tl.pointer_type(tl.int32), bitcast=True) + words,
                    mask=words * 4 < n_valid, other=other * 0x01010101)
        e = tl.reshape((w[:, None] >> (tl.arange(0, 4) * 8)[None, :]) & 0xFF, (BLOCK,))
    else:
        offs = n0 + _key_order(BLOCK, WGMMA_ORDER)
        e = tl.load(E + offs, mask=offs < n_valid, other=other).to(tl.int32)
    return e


@triton.jit
def _key_scales(EK, EV, n0, k_len, v_len, BLOCK_N: tl.constexpr, K_OPERAND: tl.constexpr,
                ONE_SCALE: tl.constexpr, WORDS: tl.constexpr, WGMMA_ORDER: tl.constexpr = False):
    """The scales of the key tile starting at n0 (keys in _key_order): K's (E8M0 byte as int32, or FP4's FP32 second
    level) and V's unbiased exponent (-126 past the document: it never raises ref_i). ONE_SCALE:
    the tile lies inside one scale block (B_t a multiple of the tile width): scalars."""
    if K_OPERAND == "bf16":
        ek = tl.zeros((BLOCK_N,), tl.int32)
        ev = ek
    elif ONE_SCALE:
        ek = tl.load(EK + n0, mask=n0 < v_len, other=127).to(tl.int32)
        ev = tl.load(EV + n0, mask=n0 < v_len, other=1).to(tl.int32) - 127
    else:
        if K_OPERAND == "e4m3":
            ek = _load_e8m0(EK, n0, v_len, 127, BLOCK_N, WORDS, WGMMA_ORDER)
        else:  # FP4's second level is token-indexed (HK, Tk) fp32
            offs_n = n0 + tl.arange(0, BLOCK_N)  # (never in wgmma's order: _attn_fwd)
            ek = tl.load(EK + offs_n, mask=offs_n < k_len, other=1.0)
        ev = _load_e8m0(EV, n0, v_len, 1, BLOCK_N, WORDS, WGMMA_ORDER) - 127
    return ek, ev


@triton.jit
def _kv_descriptors(kv, k_len, v_len, HK, stride_vd, D: tl.constexpr, BLOCK_N: tl.constexpr,
                    K_OPERAND: tl.constexpr):
    """kv = (K, EK, V, EV) with K and V as TMA descriptors (Blackwell) of one document's K (k_len
    rows) and V^T (D rows of v_len padded keys), from pointers at its start and head: a box past the
    document's end reads zeros, never the next document (a NaN there times P = 0 would be NaN) or
    V^T's unwritten tail."""
    K, EK, V, EV = kv
    W: tl.constexpr = D // 2 if K_OPERAND == "fp4_packed" else D  # FP4: two E2M1 per byte
    return (tl.make_tensor_descriptor(K, [k_len, W], [HK * W, 1], [BLOCK_N, W]), EK,
            tl.make_tensor_descriptor(V, [D, v_len], [stride_vd, 1], [D, BLOCK_N]), EV)


@triton.jit
def _visible_pairs(offs_n, pos_q, k_len, BLOCK_TOKENS: tl.constexpr, CAUSAL: tl.constexpr,
                   PAIR_SAFEGUARD: tl.constexpr):
    """(queries x keys) of a masked tile: the visible pairs, those whose key block straddles the query position
    (per-token K, V; without the safeguard: the visible ones again), and each row's last visible key (before the
    document's end and, causal, up to its position): a row sees a prefix of every tile, one compare per pair."""
    last = tl.minimum(pos_q, k_len - 1) if CAUSAL else tl.zeros_like(pos_q) + (k_len - 1)
    visible = offs_n[None, :] <= last[:, None]
    same = visible
    if PAIR_SAFEGUARD:
        same = visible & _straddles(pos_q[:, None], offs_n[None, :], BLOCK_TOKENS)
    return visible, same, last


@triton.jit
def _max(a, b):  # tl.associative_scan's combine
    return tl.maximum(a, b)


@triton.jit
def _softmax_pv(state, s, qscale, ev, visible, same, last, start_n, V, VS, EVS, v_len, stride_vd, stride_vt,
                D: tl.constexpr, BLOCK_N: tl.constexpr, QUANT: tl.constexpr, MASKED: tl.constexpr,
                PAIR_SAFEGUARD: tl.constexpr, ONE_SCALE: tl.constexpr, WORDS: tl.constexpr,
                WGMMA_ORDER: tl.constexpr):
    """The online softmax and acc += P V for one key tile's scores s, both kernels': pairs that are
    not `visible` (MASKED tiles) masked out; Q's row factor qscale (> 0) applied inside the exp2's
    FMA, after the row max: max_j(s * qscale) = qscale * max_j(s) exactly. WGMMA_ORDER: s and ev
    in _key_order (unmasked tiles: every reduction here is over the whole row)."""
    acc, l_i, m_i, ref_i = state
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qscale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    alpha = tl.exp2(m_i - m_use)
    if QUANT:
        # ref_i: the max of V's exponents over the keys each row SEES
        if MASKED and PAIR_SAFEGUARD:  # straddling pairs read V's per-token copy: their exponents
            ev_tok = _load_e8m0(EVS, start_n, v_len, 1, BLOCK_N, WORDS) - 127
            ev_seen = tl.where(same, ev_tok[None, :], tl.where(visible, ev[None, :], -1000))
            ref_new = tl.maximum(ref_i, tl.max(ev_seen, 1))
        elif MASKED:  # a row sees a prefix: the running max at its last key (a masked 2-D max costs ~10
            # instructions per pair: Triton rebuilds the mask in the scales' layout)
            seen = tl.gather(tl.associative_scan(ev, 0, _max),
                             tl.minimum(tl.maximum(last - start_n, 0), BLOCK_N - 1), 0)
            ref_new = tl.maximum(ref_i, tl.where(last >= start_n, seen, -1000))
        elif ONE_SCALE:
            ref_new = tl.maximum(ref_i, ev)
        else:  # every row sees every key: one max for the tile
            ref_new = tl.maximum(ref_i, tl.max(ev, 0))
        # p_ref = p * 2^(8 - ref): the row part of V's folded scale rides in the exp2's offset for
        # free; the softmax sum takes it back out per row. With ONE_SCALE, V's whole scale rides
        # there: p_v = p_ref * 2^ev straight out of the exp2. A tile more than 2^64 below the
        # reference (e.g. an all-zero V block, ev = -126) would underflow p_v and lose its keys from
        # the sum, so it uses ev_floor = ref - 64: p_v < 2^-56 rounds to E4M3 zero either way.
        if ONE_SCALE:
            ev_floor = tl.maximum(ref_new - 64, ev)
            offset = m_use + (ref_new - 8 - ev_floor).to(tl.float32)
            p_v = tl.exp2(s * qscale[:, None] - offset[:, None])
            l_i = l_i * alpha + (tl.sum(p_v, 1) * _exp2_int(127 - ev_floor) * _exp2_int(ref_new + 119))
        else:
            p_ref = tl.exp2(s * qscale[:, None] - (m_use + (ref_new - 8).to(tl.float32))[:, None])
            l_i = l_i * alpha + tl.sum(p_ref, 1) * _exp2_int(ref_new + 119)  # x 2^(ref - 8)
        # one exp2 per row rescales for both the new softmax max and the new reference exponent
        acc = acc * tl.exp2((m_i - m_use) + (ref_i - ref_new).to(tl.float32))[:, None]
        # loaded late: a shorter live range
        v = _load_values(V, start_n, v_len, stride_vd, stride_vt, D, BLOCK_N, MASKED)
        if PAIR_SAFEGUARD:
            p_v = tl.where(same, 0.0, p_ref * _exp2_int(ev + 127)[None, :])
            acc = tl.dot(p_v.to(tl.float8e4nv), v, acc)
            vs = _load_values(VS, start_n, v_len, stride_vd, stride_vt, D, BLOCK_N, True)
            p_v = tl.where(same, p_ref * _exp2_int(ev_tok + 127)[None, :], 0.0)
            acc = tl.dot(p_v.to(tl.float8e4nv), vs, acc)
        else:
            if not ONE_SCALE:  # p_v = p * 2^(ev - ref + 8) <= 2^8: inside E4M3's range, no saturation
                p_v = p_ref * _exp2_int(ev + 127)[None, :]
            if WGMMA_ORDER:
                p_v = _in_key_order(p_v, p_v.shape[0], BLOCK_N)
            acc = tl.dot(p_v.to(tl.float8e4nv), v, acc)
        ref_i = ref_new
    else:
        p = tl.exp2(s * qscale[:, None] - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _load_values(V, start_n, v_len, stride_vd, stride_vt, D, BLOCK_N, MASKED)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, l_i, m_new, ref_i


@triton.jit
def _query_tile(TILES, H, HK, BLOCK_M: tl.constexpr):
    """A program's query tile (its TileRow), query head and K/V head, its rows, and each row's
    position on the document's key axis."""
    index, h = tl.program_id(0), tl.program_id(1)
    hk = h // (H // HK)  # GQA: consecutive query heads share a K/V head
    tile = _tile_row(TILES, index, True)
    offs_m = tile.start + tl.arange(0, BLOCK_M)
    return tile, h, hk, offs_m, offs_m < tile.end, offs_m - tile.doc_start + tile.shift


@triton.jit
def _q_exponents(EQ, tile, h, T_QPAD, BLOCK_M: tl.constexpr, WORDS: tl.constexpr):
    """Q's E8M0 row, from the tile's 16-aligned column to the document's padded end."""
    q_col = tl.multiple_of(tl.load(tile.row + OWN_PAD) + (tile.start - tile.doc_start), 16)
    return _load_e8m0(EQ + h * T_QPAD + q_col, 0, _pad16_dev(tile.end - tile.start), 127, BLOCK_M, WORDS)


@triton.jit
def _quantize_query_tile(XQ, stride_t, stride_h, Q, EQ, tile, h, offs_m, T_QPAD, H, D: tl.constexpr):
    """Q per token, quantized where the forward loads it instead of in a pass of its own (which read
    bf16 Q, wrote E4M3 for the forward to read back): the quantizer's rule and bits, stored where it
    stores them (Operands' q, q_exp, the document's padding included) for the backward. Returns the
    E4M3 tile and its exponents."""
    x = tl.load(XQ + offs_m[:, None] * stride_t + h * stride_h + tl.arange(0, D)[None, :],
                mask=(offs_m < tile.end)[:, None], other=0.0).to(tl.float32)
    amax = _row_amax(x)
    doc_pad = tl.load(tile.row + OWN_PAD)
    v = _quantize_rows(x, amax, offs_m, tile.end, doc_pad - tile.doc_start, doc_pad + _pad16_dev(tile.q_len),
                       h, Q, EQ, T_QPAD, H, D, False)
    return v.to(tl.float8e4nv), _scale_exponent(amax)


@triton.jit
def _kv_pointers(kv, kv_tok, KB, tile, hk, HK, T_K, T_KPAD, stride_vh, stride_vt, D: tl.constexpr,
                 K_OPERAND: tl.constexpr):
    """kv = (K, EK, V, EV), the safeguard's per-token copies kv_tok = (KS, EKS, VS, EVS) and FP4's
    block scales KB, moved to the key document's first key and this K/V head, and V's length v_len
    (token-transposed fp8 V and E8M0 rows: in the padded token layout from OTHER_PAD, zero-padded to
    a multiple of 16)."""
    K, EK, V, EV = kv
    KS, EKS, VS, EVS = kv_tok
    kd_start, v_base, v_len = tile.other_start, tile.other_start, tile.k_len
    if K_OPERAND != "bf16":
        v_base = tl.multiple_of(tl.load(tile.row + OTHER_PAD), 16)
        v_len = tl.multiple_of(_pad16_dev(tile.k_len), 16)
    W: tl.constexpr = D // 2 if K_OPERAND == "fp4_packed" else D  # FP4: two E2M1 per byte
    k_row = (kd_start * HK + hk) * W
    K, KS, KB = K + k_row, KS + k_row, KB + (kd_start * HK + hk) * (D // 32)
    e_row = hk * T_KPAD + v_base
    # K's scale row, the same for K and its per-token copy KS (the safeguard may read either): E8M0
    # in the padded layout, or FP4's token-indexed (HK, Tk) fp32 second level (then KS is K itself).
    ek_row = e_row if K_OPERAND == "e4m3" else hk * T_K + kd_start
    EK, EKS = EK + ek_row, EKS + ek_row
    EV, EVS = EV + e_row, EVS + e_row
    V, VS = V + hk * stride_vh + v_base * stride_vt, VS + hk * stride_vh + v_base * stride_vt
    return (K, EK, V, EV), (KS, EKS, VS, EVS), KB, v_len


@triton.jit
def _fwd_state(BLOCK_M: tl.constexpr, D: tl.constexpr):
    """The running (acc, l, m, ref): O, row sum, row max, V's reference exponent (2^(8 - ref) finite)."""
    return (tl.zeros((BLOCK_M, D), tl.float32), tl.zeros((BLOCK_M,), tl.float32),
            tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.full((BLOCK_M,), -100, tl.int32))


@triton.jit
def _fwd_store(state, O, LSE, offs_m, qmask, h, H, T_Q, D: tl.constexpr, QUANT: tl.constexpr):
    """O = acc / l and the natural-log LSE (-inf, and O = 0, for rows that saw no key)."""
    acc, l_i, m_i, ref_i = state
    if QUANT:
        acc = acc * _exp2_int(ref_i + 119)[:, None]  # back from units of 2^(ref - 8)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(l_i == 0.0, float("-inf"), (m_use + tl.log2(l_safe)) * 0.6931471805599453)  # ln2
    tl.store(O + (offs_m[:, None] * H + h) * D + tl.arange(0, D)[None, :],
             (acc / l_safe[:, None]).to(O.dtype.element_ty), mask=qmask[:, None])
    tl.store(LSE + h * T_Q + offs_m, lse, mask=qmask)


# The portable forward (backend="tl": Hopper's fp8 wgmma, other GPUs, the interpreter): Q K^T by tl.dot, the scales
# outside the MMA. A step = the key tile at document-local start_n; its scales ek, ev are loaded one step ahead:
# Triton software-pipelines only the loads that feed a dot, so a step issues the next tile's scale loads first, their
# latency hidden behind its MMAs. ONE_SCALE: scalar ek, ev join the row factors (2 multiplies/entry of S saved).
@triton.jit
def _attn_fwd_step(state, ek, ev, q, qscale, pos_q, start_n, kv, kv_tok, k_len, v_len, HK, stride_vd,
                   stride_vt, D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
                   CAUSAL: tl.constexpr, MASKED: tl.constexpr, K_OPERAND: tl.constexpr,
                   PAIR_SAFEGUARD: tl.constexpr, ONE_SCALE: tl.constexpr, WGMMA_ORDER: tl.constexpr):
    QUANT: tl.constexpr = K_OPERAND != "bf16"
    K, EK, V, EV = kv
    KS, EKS, VS, EVS = kv_tok  # (triton 3.6 parses no nested unpacking)
    start_n = tl.multiple_of(start_n, BLOCK_N)
    offs_n = start_n + _key_order(BLOCK_N, WGMMA_ORDER)  # document-local key positions
    ek_next, ev_next = _key_scales(EK, EV, start_n + BLOCK_N, k_len, v_len, BLOCK_N, K_OPERAND,
                                   ONE_SCALE, False, WGMMA_ORDER)
    k = _load_keys(K, start_n, k_len, HK * D, D, BLOCK_N, 0.0, WGMMA_ORDER)
    s = tl.dot(q, tl.trans(k))  # with K's (column) scales:
    if K_OPERAND == "fp4_decoded":
        s = s * ek[None, :]
    elif QUANT and ONE_SCALE:  # K's one scale joins the row factor (a power of two: exact)
        qscale = qscale * _exp2_int(ek)
    elif QUANT:
        s = s * _exp2_int(ek)[None, :]
    visible, same, last = _visible_pairs(offs_n, pos_q, k_len, BLOCK_TOKENS, CAUSAL, PAIR_SAFEGUARD)
    if MASKED and PAIR_SAFEGUARD and K_OPERAND == "e4m3":  # FP4 K is per token: only V has a copy
        ks = _load_keys(KS, start_n, k_len, HK * D, D, BLOCK_N)
        eks = _load_e8m0(EKS, start_n, v_len, 127, BLOCK_N, False)
        s = tl.where(same, tl.dot(q, tl.trans(ks)) * _exp2_int(eks.to(tl.int32))[None, :], s)
    state = _softmax_pv(state, s, qscale, ev, visible, same, last, start_n, V, VS, EVS, v_len, stride_vd,
                        stride_vt, D, BLOCK_N, QUANT, MASKED, PAIR_SAFEGUARD, ONE_SCALE, False, WGMMA_ORDER)
    return state, ek_next, ev_next


@triton.jit
def _attn_fwd(
        Q, EQ, kv, KB, kv_tok,  # operands (_attn_forward): kv = (K, EK, V, EV), kv_tok: per token
        O, LSE, TILES,  # outputs (Tq, H, D) and (H, Tq) natural-log LSE; the Plan's query tiles
        stride_vh, stride_vd, stride_vt,  # V: token-transposed (H, D, T_pad) if fp8, else (T, H, D)
        sm_scale_log2, T_Q, T_K, H, HK,  # softmax scale * log2(e); token and head counts
        T_QPAD, T_KPAD,  # lengths of the padded token layouts (E8M0 rows, V^T)
        XQ, stride_xqt, stride_xqh,  # the caller's Q (T, H, D), read instead of Q with QUANTIZE_Q
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED_N: tl.constexpr,
        BLOCK_TOKENS: tl.constexpr, CAUSAL: tl.constexpr, K_OPERAND: tl.constexpr,
        SAFEGUARD: tl.constexpr, QUANTIZE_Q: tl.constexpr):
    """The portable forward; K_OPERAND bf16, e4m3 or fp4_decoded (KB, FP4's block scales, unused).
    QUANTIZE_Q: the kernel quantizes Q itself and writes Q, EQ (_quantize_query_tile)."""
    QUANT: tl.constexpr = K_OPERAND != "bf16"
    tile, h, hk, offs_m, qmask, pos_q = _query_tile(TILES, H, HK, BLOCK_M)
    k_len = tile.k_len
    qscale = tl.full((BLOCK_M,), sm_scale_log2, tl.float32)  # S's row factor, and Q's scale:
    if QUANTIZE_Q:
        q, e_q = _quantize_query_tile(XQ, stride_xqt, stride_xqh, Q, EQ, tile, h, offs_m, T_QPAD, H, D)
        qscale *= _exp2_int(e_q)
    else:
        q = tl.load(Q + (offs_m[:, None] * H + h) * D + tl.arange(0, D)[None, :],
                    mask=qmask[:, None], other=0.0)
        if QUANT:
            qscale *= _exp2_int(_q_exponents(EQ, tile, h, T_QPAD, BLOCK_M, False))
    if K_OPERAND == "fp4_decoded":  # K is bf16: E4M3 -> bf16 is exact
        q = q.to(tl.bfloat16)
    kv, kv_tok, KB, v_len = _kv_pointers(kv, kv_tok, KB, tile, hk, HK, T_K, T_KPAD, stride_vh, stride_vt, D,
                                         K_OPERAND)
    state = _fwd_state(BLOCK_M, D)
    n_full, n_end = _key_range(tile, BLOCK_N, BLOCK_TOKENS, CAUSAL, SAFEGUARD != "off")
    ONE_SCALE: tl.constexpr = K_OPERAND == "e4m3" and BLOCK_TOKENS % BLOCK_N == 0  # (_key_scales)
    # Unmasked E4M3 tiles in wgmma's order (masked ones scan V's exponents in key order; with FP4's decoded K the
    # scale loads' address arithmetic cost more than the shuffles saved: sm_90a SASS)
    WGMMA_ORDER: tl.constexpr = K_OPERAND == "e4m3"
    ek, ev = _key_scales(kv[1], kv[3], 0, k_len, v_len, BLOCK_N, K_OPERAND, ONE_SCALE, False, WGMMA_ORDER)
    for start_n in range(0, n_full, BLOCK_N):
        state, ek, ev = _attn_fwd_step(state, ek, ev, q, qscale, pos_q, start_n, kv, kv_tok, k_len, v_len,
                                       HK, stride_vd, stride_vt, D, BLOCK_N, BLOCK_TOKENS, CAUSAL, False,
                                       K_OPERAND, False, ONE_SCALE, WGMMA_ORDER)
    # Masked tiles (the diagonal) are MASKED_N keys wide: narrower tiles there waste fewer masked
    # pairs and keep the mask and safeguard temporaries within the register budget.
    if SAFEGUARD == "tile":  # every masked tile lies in the query tile's own key block
        kv = kv_tok
    ek, ev = _key_scales(kv[1], kv[3], n_full, k_len, v_len, MASKED_N, K_OPERAND, False, False)
    for start_n in range(n_full, n_end, MASKED_N):
        state, ek, ev = _attn_fwd_step(state, ek, ev, q, qscale, pos_q, start_n, kv, kv_tok, k_len, v_len,
                                       HK, stride_vd, stride_vt, D, MASKED_N, BLOCK_TOKENS, CAUSAL, True,
                                       K_OPERAND, SAFEGUARD == "pair", False, False)
    _fwd_store(state, O, LSE, offs_m, qmask, h, H, T_Q, D, QUANT)


# The Blackwell forward (backend="dot_scaled": sm_100's MX MMAs; elsewhere Triton emulates tl.dot_scaled, TMA off):
# tl.dot_scaled computes Q K^T with the E8M0 scales inside the MMA, K as E4M3 (e4m3) or E2M1 (fp4_packed, E8M0 block
# scales KB); with TMA, Q, K, V load through per-document descriptors; E8M0 rows load as 32-bit words. Same steps.
@triton.jit
def _attn_fwd_blackwell_step(state, ek, ev, q, q_e8, qscale, pos_q, start_n, kv, kv_tok, KB, k_len,
                             v_len, HK, stride_vd, stride_vt, D: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_TOKENS: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr,
                             K_OPERAND: tl.constexpr, PAIR_SAFEGUARD: tl.constexpr):
    K, EK, V, EV = kv
    KS, EKS, VS, EVS = kv_tok  # (triton 3.6 parses no nested unpacking)
    start_n = tl.multiple_of(start_n, BLOCK_N)
    offs_n = start_n + tl.arange(0, BLOCK_N)  # document-local key positions
    ek_next, ev_next = _key_scales(EK, EV, start_n + BLOCK_N, k_len, v_len, BLOCK_N, K_OPERAND, False, True)
    if K_OPERAND == "fp4_packed":  # E4M3 x E2M1, both with E8M0 block scales
        k = _load_keys(K, start_n, k_len, HK * D // 2, D // 2, BLOCK_N, 0)
        k_e8 = _load_keys(KB, start_n, k_len, HK * D // 32, D // 32, BLOCK_N, 127)
        s = tl.dot_scaled(q, q_e8, "e4m3", tl.trans(k), k_e8, "e2m1") * ek[None, :]
    else:
        k = _load_keys(K, start_n, k_len, HK * D, D, BLOCK_N)
        s = tl.dot_scaled(q, q_e8, "e4m3", tl.trans(k), _e8m0_blocks(ek, D), "e4m3")
    visible, same, last = _visible_pairs(offs_n, pos_q, k_len, BLOCK_TOKENS, CAUSAL, PAIR_SAFEGUARD)
    if MASKED and PAIR_SAFEGUARD and K_OPERAND == "e4m3":  # FP4 K is per token: only V has a copy
        ks = _load_keys(KS, start_n, k_len, HK * D, D, BLOCK_N)
        eks = _load_e8m0(EKS, start_n, v_len, 127, BLOCK_N, True)
        s_tok = tl.dot_scaled(q, q_e8, "e4m3", tl.trans(ks), _e8m0_blocks(eks, D), "e4m3")
        s = tl.where(same, s_tok, s)
    state = _softmax_pv(state, s, qscale, ev, visible, same, last, start_n, V, VS, EVS, v_len, stride_vd,
                        stride_vt, D, BLOCK_N, True, MASKED, PAIR_SAFEGUARD, False, True, False)
    return state, ek_next, ev_next


@triton.jit
def _attn_fwd_blackwell(Q, EQ, kv, KB, kv_tok, O, LSE, TILES,  # as _attn_fwd's
        stride_vh, stride_vd, stride_vt, sm_scale_log2, T_Q, T_K, H, HK, T_QPAD, T_KPAD,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED_N: tl.constexpr,
        BLOCK_TOKENS: tl.constexpr, CAUSAL: tl.constexpr, K_OPERAND: tl.constexpr,
        SAFEGUARD: tl.constexpr, TMA: tl.constexpr):
    tile, h, hk, offs_m, qmask, pos_q = _query_tile(TILES, H, HK, BLOCK_M)
    k_len = tile.k_len
    if TMA:  # TMA boxes of exactly this tile's rows (zeros past its end)
        q = tl.make_tensor_descriptor(Q + (tile.start * H + h) * D, [tile.end - tile.start, D], [H * D, 1],
                                      [BLOCK_M, D]).load([0, 0])
    else:
        q = tl.load(Q + (offs_m[:, None] * H + h) * D + tl.arange(0, D)[None, :],
                    mask=qmask[:, None], other=0.0)
    qscale = tl.full((BLOCK_M,), sm_scale_log2, tl.float32)  # the MMA applies Q's scale
    q_e8 = _e8m0_blocks(_q_exponents(EQ, tile, h, T_QPAD, BLOCK_M, True), D)
    kv, kv_tok, KB, v_len = _kv_pointers(kv, kv_tok, KB, tile, hk, HK, T_K, T_KPAD, stride_vh, stride_vt, D,
                                         K_OPERAND)
    n_full, n_end = _key_range(tile, BLOCK_N, BLOCK_TOKENS, CAUSAL, SAFEGUARD != "off")
    state = _fwd_state(BLOCK_M, D)
    kv_full = kv
    if TMA:
        kv_full = _kv_descriptors(kv, k_len, v_len, HK, stride_vd, D, BLOCK_N, K_OPERAND)
    ek, ev = _key_scales(kv[1], kv[3], 0, k_len, v_len, BLOCK_N, K_OPERAND, False, True)
    for start_n in range(0, n_full, BLOCK_N):
        state, ek, ev = _attn_fwd_blackwell_step(
            state, ek, ev, q, q_e8, qscale, pos_q, start_n, kv_full, kv_tok, KB, k_len, v_len, HK, stride_vd,
            stride_vt, D, BLOCK_N, BLOCK_TOKENS, CAUSAL, False, K_OPERAND, False)
    if SAFEGUARD == "tile":
        kv = kv_tok
    if TMA:  # the masked tiles' boxes are MASKED_N keys wide
        kv = _kv_descriptors(kv, k_len, v_len, HK, stride_vd, D, MASKED_N, K_OPERAND)
        if SAFEGUARD == "pair":
            kv_tok = _kv_descriptors(kv_tok, k_len, v_len, HK, stride_vd, D, MASKED_N, K_OPERAND)
    ek, ev = _key_scales(kv[1], kv[3], n_full, k_len, v_len, MASKED_N, K_OPERAND, False, True)
    for start_n in range(n_full, n_end, MASKED_N):
        state, ek, ev = _attn_fwd_blackwell_step(
            state, ek, ev, q, q_e8, qscale, pos_q, start_n, kv, kv_tok, KB, k_len, v_len, HK, stride_vd,
            stride_vt, D, MASKED_N, BLOCK_TOKENS, CAUSAL, True, K_OPERAND, SAFEGUARD == "pair")
    _fwd_store(state, O, LSE, offs_m, qmask, h, H, T_Q, D, True)


def _attn_forward(q, k, v, ops, plan: Plan, var: Variant, *, causal, softmax_scale, block_tokens):
    """The forward (tl or Gluon) on the quantized Operands `ops` (bf16: on q, k, v); returns (o, lse)."""
    (Tq, H, D), (Tk, HK) = q.shape, k.shape[:2]
    empty_rows = plan.rows_without_keys[causal]
    o = (torch.zeros if empty_rows else torch.empty)(Tq, H, D, dtype=q.dtype, device=q.device)
    lse = torch.full((H, Tq), float("-inf"), device=q.device) if empty_rows else torch.empty(H, Tq, device=q.device)
    tiles = plan.tiles(var.fwd[0], "q", causal)
    if not var.recipe.quantized:
        ops = ops._replace(q=q.contiguous(), k=k.contiguous(), v_t=v.contiguous())
    if var.backend == "gluon":
        kw = dict(softmax_scale=softmax_scale, causal=causal, block_tokens=block_tokens)
        if not var.recipe.quantized:
            return flamia_hopper.attn_fwd(ops.q, None, ops.k, None, ops.v_t, None, o, lse, tiles, **kw)
        per_token = (ops.k_tok, ops.k_tok_exp, ops.v_tok_t, ops.v_tok_exp) if var.modes[0] == "tile" else None
        # v_len: V^T's tail past the last document's padding is never written: TMA must read zeros there
        return flamia_hopper.attn_fwd(ops.q, ops.q_exp, ops.k, ops.k_exp, ops.v_t, ops.v_exp, o, lse,
                                      tiles, per_token=per_token, v_len=plan.pad_k[-1], **kw)
    BLOCK_M, BLOCK_N, MASKED_N, warps, stages = var.fwd
    strides_v = (D * plan.padded_k, plan.padded_k, 1) if var.recipe.quantized else (D, 1, HK * D)
    k_data = dequantize_fp4(ops.k, ops.k_block, dtype=torch.bfloat16) if var.k_operand == "fp4_decoded" else ops.k
    k_tok = (ops.k_tok, ops.k_tok_exp) if var.copies and not var.recipe.k_fp4 else (k_data, ops.k_exp)
    v_tok = (ops.v_tok_t, ops.v_tok_exp) if var.copies else (ops.v_t, ops.v_exp)
    operands = (ops.q, ops.q_exp, (k_data, ops.k_exp, ops.v_t, ops.v_exp), ops.k_block, (*k_tok, *v_tok))
    if var.tma and q.is_cuda:  # TMA descriptors' global scratch: where Triton launches (device, stream)
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    xq = q if q.stride(-1) == 1 else q.contiguous()  # read by the kernel with var.quantize_q
    if tiles.shape[0] > 0:
        var.kernel[(tiles.shape[0], H)](
            *operands, o, lse, tiles, *strides_v, softmax_scale * 1.4426950408889634,  # log2(e)
            Tq, Tk, H, HK, plan.padded_q, plan.padded_k, D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, MASKED_N=MASKED_N,
            BLOCK_TOKENS=block_tokens, CAUSAL=causal, K_OPERAND=var.k_operand, SAFEGUARD=var.modes[0],
            num_warps=warps, num_stages=stages, **(dict(TMA=var.tma) if var.kernel is _attn_fwd_blackwell else
               dict(XQ=xq, stride_xqt=xq.stride(0), stride_xqh=xq.stride(1), QUANTIZE_Q=var.quantize_q)))
    return o, lse


# ---- 5b. Backward kernels ---------------------------------------------------------------------
# The backward differentiates the function the forward computed: S is recomputed from exactly the forward's quantized
# operands (the same safeguard choice on the diagonal) and P from the saved LSE. On Hopper these kernels are
# issue-bound, not MMA-bound: fp8 MMAs there saved less than the scale multiplies and fp8-to-bf16 conversions cost
# (measured, H200). So every recipe's backward runs bf16 MMAs: the quantized recipes on the forward's operands
# DEQUANTIZED exactly (E4M3 x 2^e and FP4's code x block scale fit bf16; FP4's second level stays an fp32 factor per
# key, K_SCALED), and dO as given. Gradients: the oracle's up to bf16 rounding of P and dS. Two kernels, no atomics
# (deterministic): dK/dV per key tile over query tiles, dQ per query tile over key tiles (as the forward):
#
#   dK/dV:  for each query tile i:  P^T = exp2(S^T - lse_i);  dV += P^T dO_i
#                                   dS^T = P^T * (V dO_i^T - Delta_i);  dK += dS^T Q_i
#   dQ:     for each key tile j:    P = exp2(S - lse);  dS = P * (dO V_j^T - Delta);  dQ += dS K_j
#
# Before them, two memory-bound passes: Delta = rowsum(dO * O), and the dequantization.
@triton.jit
def _delta_kernel(O, DO, DELTA, T, H, D: tl.constexpr, BLOCK_T: tl.constexpr):
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    mask = offs_t < T
    ptrs = (offs_t[:, None] * H + h) * D + tl.arange(0, D)[None, :]
    o = tl.load(O + ptrs, mask=mask[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=mask[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + h * T + offs_t, tl.sum(o * do, 1), mask=mask)


@triton.jit
def _dequantize_kernel(X, E, Y, TILES, T_PAD, H: tl.constexpr, D: tl.constexpr,
                       BLOCK_T: tl.constexpr, TRANSPOSED: tl.constexpr, FP16: tl.constexpr):
    """Y = E4M3 data times 2^(E - 127) per (token, head), in Y's dtype (exact in bf16), over one
    Plan tile of tokens. X is the row-major data (T, H, D), or with TRANSPOSED the token-transposed
    copy (H, D, T_pad), read along tokens and transposed in registers; E is (H, T_pad)."""
    tile, h = tl.program_id(0), tl.program_id(1)
    row = TILES + tile * 8
    start, end = tl.load(row + TILE_START), tl.load(row + TILE_END)
    offs, offs_d = tl.arange(0, BLOCK_T), tl.arange(0, D)
    mask = start + offs < end
    p0 = tl.load(row + OWN_PAD) + (start - tl.load(row + OWN_START))  # first padded position
    if TRANSPOSED:
        x = tl.trans(tl.load(X + (h * D + offs_d[:, None]) * T_PAD + p0 + offs[None, :],
                             mask=mask[None, :], other=0.0).to(tl.float32))
    else:
        x = tl.load(X + ((start + offs[:, None]) * H + h) * D + offs_d[None, :], mask=mask[:, None],
                    other=0.0).to(tl.float32)
    e = tl.load(E + h * T_PAD + p0 + offs, mask=mask, other=127).to(tl.int32)
    y = x * _exp2_int(e)[:, None]
    if FP16:  # a value within a rounding step of fp16's max can dequantize past it: keep it finite
        y = tl.where(y > 65504.0, 65504.0, tl.where(y < -65504.0, -65504.0, y))  # NaN stays NaN
    tl.store(Y + ((start + offs[:, None]) * H + h) * D + offs_d[None, :], y.to(Y.dtype.element_ty),
             mask=mask[:, None])


@triton.jit
def _scale_cast_kernel(X, Y, scale, N, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    tl.store(Y + offs, (tl.load(X + offs, mask=mask) * scale).to(Y.dtype.element_ty), mask=mask)


def _scale_cast(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """(x * scale).to(dtype), bit for bit, in one pass (one read, not three): the Gluon backward's fp32 dQ sum."""
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    if x.numel() > 0:
        _scale_cast_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, scale, x.numel(), BLOCK=4096)
    return y


def _delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """Delta = rowsum(dO * O) = rowsum(P * dP), (H, T) fp32: the backward's first pass."""
    (T, H, D), delta = o.shape, torch.empty(o.shape[1], o.shape[0], dtype=torch.float32, device=o.device)
    if T > 0:
        _delta_kernel[(triton.cdiv(T, 64), H)](o, do, delta, T, H, D=D, BLOCK_T=64)
    return delta


def _dequantize(x: MXFP8, dtype: torch.dtype, plan: Plan, side: str) -> torch.Tensor:
    """The Triton twin of MXFP8.dequantize(), into bf16 / fp16 for the backward's MMAs."""
    H, t_pad = x.exp.shape
    T = plan.total_q if side == "q" else plan.total_k
    transposed = x.data is None
    D = x.data_t.shape[1] if transposed else x.data.shape[2]
    y = torch.empty(T, H, D, dtype=dtype, device=x.exp.device)
    tiles = plan.tiles(QUANT_TILE, side, causal=False, skip_masked=False)
    if tiles.shape[0] > 0:
        _dequantize_kernel[(tiles.shape[0], H)](
            x.data_t if transposed else x.data, x.exp, y, tiles, t_pad, H=H, D=D,
            BLOCK_T=QUANT_TILE, TRANSPOSED=transposed, FP16=dtype == torch.float16, num_warps=8)
    return y


@triton.jit
def _query_rows(LSE, DELTA, offs_m, end):
    """A query tile's LSE (in log2 units; +inf for rows without keys, so P = 0) and Delta."""
    mask = offs_m < end
    lse2 = tl.load(LSE + offs_m, mask=mask, other=0.0) * 1.4426950408889634  # log2(e)
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)
    return lse2, tl.load(DELTA + offs_m, mask=mask, other=0.0)


@triton.jit
def _attn_bwd_dkdv_step(dk, dv, lse2, delta, k, v, ks, vs, kscale, pos_k, start_m, rows, q_len, shift, H,
                        sm_scale_log2, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
                        CAUSAL: tl.constexpr, K_SCALED: tl.constexpr, MASKED: tl.constexpr,
                        PAIR_SAFEGUARD: tl.constexpr):
    """One query tile at document-local row start_m (rows = (Q, DO, LSE, DELTA): pointers at the
    document start and query head); its LSE and Delta arrive loaded one step ahead, as the forward's
    scales."""
    Q, DO, LSE, DELTA = rows
    offs_m = start_m + tl.arange(0, BLOCK_M)
    qmask = offs_m < q_len
    lse2_next, delta_next = _query_rows(LSE, DELTA, offs_m + BLOCK_M, q_len)
    ptrs = offs_m[:, None] * (H * D) + tl.arange(0, D)[None, :]
    q = tl.load(Q + ptrs, mask=qmask[:, None], other=0.0)
    do = tl.load(DO + ptrs, mask=qmask[:, None], other=0.0)
    st = tl.dot(k, tl.trans(q))  # S^T (keys x queries)
    dpt = tl.dot(v, tl.trans(do))
    if MASKED:
        pos_q = offs_m + shift
        visible = qmask[None, :]
        if CAUSAL:
            visible = visible & (pos_k[:, None] <= pos_q[None, :])
        if PAIR_SAFEGUARD:  # the forward's per-token K, V where the key block straddles the query
            same = visible & _straddles(pos_q[None, :], pos_k[:, None], BLOCK_TOKENS)
            if not K_SCALED:  # FP4 K (K_SCALED) is per token: its own copy
                st = tl.where(same, tl.dot(ks, tl.trans(q)), st)
            dpt = tl.where(same, tl.dot(vs, tl.trans(do)), dpt)
        st = tl.where(visible, st, float("-inf"))
    if K_SCALED:  # FP4's FP32 second-level scale, one per key (a row of S^T)
        st = st * kscale[:, None]
    pt = tl.exp2(st * sm_scale_log2 - lse2[None, :])
    dst = pt * (dpt - delta[None, :])
    dv = tl.dot(pt.to(do.dtype), do, dv)
    dk = tl.dot(dst.to(q.dtype), q, dk)
    return dk, dv, lse2_next, delta_next


@triton.jit
def _attn_bwd_dkdv(
        rows, keys,  # (Q, DO, LSE, DELTA): (T, H, D), LSE, Delta (H, T); (K, V, KS, VS, K_SCALE):
        DK, DV, TILES,  # (T, Hk, D), FP4 K's (Hk, Tk) factor; outputs (Tk, Hk, D); the Plan's key tiles
        sm_scale, T_Q, T_K, H, HK,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
        CAUSAL: tl.constexpr, SAFEGUARD: tl.constexpr, K_SCALED: tl.constexpr):
    Q, DO, LSE, DELTA = rows
    K, V, KS, VS, K_SCALE = keys
    tile, hk = _tile_row(TILES, tl.program_id(0), False), tl.program_id(1)
    qd_start, q_len, shift = tile.other_start, tile.q_len, tile.shift
    offs_n = tile.start + tl.arange(0, BLOCK_N)
    kmask = offs_n < tile.end
    pos_k = offs_n - tile.doc_start
    ptrs = (offs_n[:, None] * HK + hk) * D + tl.arange(0, D)[None, :]
    k = tl.load(K + ptrs, mask=kmask[:, None], other=0.0)
    v = tl.load(V + ptrs, mask=kmask[:, None], other=0.0)
    ks, vs = k, v
    if SAFEGUARD != "off":
        if not K_SCALED:
            ks = tl.load(KS + ptrs, mask=kmask[:, None], other=0.0)
        vs = tl.load(VS + ptrs, mask=kmask[:, None], other=0.0)
    kscale = (tl.load(K_SCALE + hk * T_K + offs_n, mask=kmask, other=1.0) if K_SCALED
              else tl.full((BLOCK_N,), 1.0, tl.float32))
    # Query tiles of the document that see this key tile (_query_range): masked ones first, then
    # those every row of which sees every key, then the document's partial last tile (bounds mask).
    q_full = q_len // BLOCK_M * BLOCK_M
    q_lo, q_mid = _query_range(tile, BLOCK_M, BLOCK_TOKENS, CAUSAL, SAFEGUARD != "off")
    k_diag, v_diag = (ks, vs) if SAFEGUARD == "tile" else (k, v)  # "tile": masked tiles share its block
    sm_scale_log2 = sm_scale * 1.4426950408889634
    dk, dv = tl.zeros((BLOCK_N, D), tl.float32), tl.zeros((BLOCK_N, D), tl.float32)
    for hq in range(hk * (H // HK), (hk + 1) * (H // HK)):  # GQA: sum over this K/V head's queries
        rows_h = (Q + (qd_start * H + hq) * D, DO + (qd_start * H + hq) * D, LSE + hq * T_Q + qd_start,
                  DELTA + hq * T_Q + qd_start)
        lse2, delta = _query_rows(rows_h[2], rows_h[3], q_lo + tl.arange(0, BLOCK_M), q_len)
        for start_m in range(q_lo, q_mid, BLOCK_M):  # the three loops walk one tile sequence
            dk, dv, lse2, delta = _attn_bwd_dkdv_step(
                dk, dv, lse2, delta, k_diag, v_diag, ks, vs, kscale, pos_k, start_m, rows_h, q_len, shift, H,
                sm_scale_log2, D, BLOCK_M, BLOCK_TOKENS, CAUSAL, K_SCALED, MASKED=True,
                PAIR_SAFEGUARD=SAFEGUARD == "pair")
        for start_m in range(q_mid, q_full, BLOCK_M):
            dk, dv, lse2, delta = _attn_bwd_dkdv_step(
                dk, dv, lse2, delta, k, v, ks, vs, kscale, pos_k, start_m, rows_h, q_len, shift, H,
                sm_scale_log2, D, BLOCK_M, BLOCK_TOKENS, CAUSAL, K_SCALED, MASKED=False, PAIR_SAFEGUARD=False)
        for start_m in range(tl.maximum(q_full, q_mid), q_len, BLOCK_M):
            dk, dv, lse2, delta = _attn_bwd_dkdv_step(
                dk, dv, lse2, delta, k, v, ks, vs, kscale, pos_k, start_m, rows_h, q_len, shift, H,
                sm_scale_log2, D, BLOCK_M, BLOCK_TOKENS, CAUSAL, K_SCALED, MASKED=True, PAIR_SAFEGUARD=False)
    tl.store(DK + ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=kmask[:, None])
    tl.store(DV + ptrs, dv.to(DV.dtype.element_ty), mask=kmask[:, None])


@triton.jit
def _attn_bwd_dq_step(dq, q, do, lse2, delta, pos_q, start_n, keys, k_len, HK, sm_scale_log2,
                      D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
                      CAUSAL: tl.constexpr, K_SCALED: tl.constexpr, MASKED: tl.constexpr,
                      PAIR_SAFEGUARD: tl.constexpr):
    """One key tile at document-local offset start_n (keys = (K, V, KS, VS, K_SCALE): pointers at
    the document start and head)."""
    K, V, KS, VS, K_SCALE = keys
    offs_n = start_n + tl.arange(0, BLOCK_N)
    kmask = offs_n < k_len
    k = _load_keys(K, start_n, k_len, HK * D, D, BLOCK_N)
    v = _load_keys(V, start_n, k_len, HK * D, D, BLOCK_N)
    s = tl.dot(q, tl.trans(k))
    dp = tl.dot(do, tl.trans(v))
    if MASKED:
        visible, same, _ = _visible_pairs(offs_n, pos_q, k_len, BLOCK_TOKENS, CAUSAL, PAIR_SAFEGUARD)
        if PAIR_SAFEGUARD:
            if not K_SCALED:  # FP4 K is per token: its own copy
                ks = _load_keys(KS, start_n, k_len, HK * D, D, BLOCK_N)
                s = tl.where(same, tl.dot(q, tl.trans(ks)), s)
            vs = _load_keys(VS, start_n, k_len, HK * D, D, BLOCK_N)
            dp = tl.where(same, tl.dot(do, tl.trans(vs)), dp)
        s = tl.where(visible, s, float("-inf"))
    if K_SCALED:  # FP4's second level: S and dQ = dS (s2 * K) both take it per key
        kscale = tl.load(K_SCALE + offs_n, mask=kmask, other=1.0)
        s = s * kscale[None, :]
    p = tl.exp2(s * sm_scale_log2 - lse2[:, None])
    ds = p * (dp - delta[:, None])
    if K_SCALED:
        ds = ds * kscale[None, :]
    if PAIR_SAFEGUARD and not K_SCALED:
        dq = tl.dot(tl.where(same, 0.0, ds).to(k.dtype), k, dq)
        dq = tl.dot(tl.where(same, ds, 0.0).to(ks.dtype), ks, dq)
    else:
        dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def _attn_bwd_dq(
        rows, keys,  # as in _attn_bwd_dkdv
        DQ, TILES,  # output (Tq, H, D); the Plan's query tiles
        sm_scale, T_Q, T_K, H, HK,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
        CAUSAL: tl.constexpr, SAFEGUARD: tl.constexpr, K_SCALED: tl.constexpr):
    Q, DO, LSE, DELTA = rows
    K, V, KS, VS, K_SCALE = keys
    tile, h, hk, offs_m, qmask, pos_q = _query_tile(TILES, H, HK, BLOCK_M)
    ptrs = (offs_m[:, None] * H + h) * D + tl.arange(0, D)[None, :]
    q = tl.load(Q + ptrs, mask=qmask[:, None], other=0.0)
    do = tl.load(DO + ptrs, mask=qmask[:, None], other=0.0)
    lse2, delta = _query_rows(LSE + h * T_Q, DELTA + h * T_Q, offs_m, tile.end)
    n_full, n_end = _key_range(tile, BLOCK_N, BLOCK_TOKENS, CAUSAL, SAFEGUARD != "off")
    k_row = (tile.other_start * HK + hk) * D
    K, V, KS, VS = K + k_row, V + k_row, KS + k_row, VS + k_row
    if K_SCALED:
        K_SCALE = K_SCALE + hk * T_K + tile.other_start
    sm_scale_log2 = sm_scale * 1.4426950408889634
    dq = tl.zeros((BLOCK_M, D), tl.float32)
    for start_n in range(0, n_full, BLOCK_N):
        dq = _attn_bwd_dq_step(dq, q, do, lse2, delta, pos_q, start_n, (K, V, KS, VS, K_SCALE), tile.k_len,
                               HK, sm_scale_log2, D, BLOCK_N, BLOCK_TOKENS, CAUSAL, K_SCALED,
                               MASKED=False, PAIR_SAFEGUARD=False)
    if SAFEGUARD == "tile":  # the masked key tiles all lie in this query tile's block
        K, V = KS, VS
    for start_n in range(n_full, n_end, BLOCK_N):
        dq = _attn_bwd_dq_step(dq, q, do, lse2, delta, pos_q, start_n, (K, V, KS, VS, K_SCALE), tile.k_len,
                               HK, sm_scale_log2, D, BLOCK_N, BLOCK_TOKENS, CAUSAL, K_SCALED,
                               MASKED=True, PAIR_SAFEGUARD=SAFEGUARD == "pair")
    tl.store(DQ + ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=qmask[:, None])


def _attn_backward(do, q, k, v, o, lse, ops, plan: Plan, var: Variant, *, causal, softmax_scale, block_tokens):
    """dq, dk, dv from the forward's quantized operands `ops` (unused for bf16)."""
    (Tq, H, D), (Tk, HK) = q.shape, k.shape[:2]
    r, do, dtype, tile_safeguard = var.recipe, do.contiguous(), q.dtype, var.modes[1] == "tile"
    delta = _delta(o, do)
    k_scale = ops.k_exp if r.k_fp4 else None  # FP4 K's second level (K_SCALED)
    deq = lambda side, *mxfp8: _dequantize(MXFP8(*mxfp8), dtype, plan, side)
    # the Gluon backward dequantizes MXFP8 K, V itself: no copies (except beside the tile safeguard's)
    fp8_kv = (ops.k, ops.k_exp, ops.v_t, ops.v_exp) if (
        var.bwd == "gluon" and r.quantized and not r.k_fp4 and not tile_safeguard) else None
    if r.quantized:  # bf16 kernels on the exactly dequantized operands (see the section comment)
        q, v = deq("q", ops.q, ops.q_exp), None if fp8_kv else deq("k", None, ops.v_exp, ops.v_t)
        k = None if fp8_kv else (dequantize_fp4(ops.k, ops.k_block, dtype=dtype) if r.k_fp4
                                 else deq("k", ops.k, ops.k_exp))
    else:
        q, k, v = (x.contiguous() for x in (q, k, v))
    ks = deq("k", ops.k_tok, ops.k_tok_exp) if var.copies and not r.k_fp4 else k
    vs = deq("k", None, ops.v_tok_exp, ops.v_tok_t) if var.copies else v  # ks, vs: the per-token copies
    dk, dv = ((q.new_zeros if plan.keys_without_rows else q.new_empty)(Tk, HK, D) for _ in "kv")
    if var.bwd == "gluon":  # flamia_hopper.py's backward: the same function, dQ's adds unordered
        tiles = plan.tiles(flamia_hopper.BWD_BLOCK_N, "k", causal)
        dq = flamia_hopper.attn_bwd(q, k, v, ks, vs, do, lse, delta, dk, dv, tiles, fp8_kv=fp8_kv,
                                    softmax_scale=softmax_scale, causal=causal, block_tokens=block_tokens,
                                    tile_safeguard=tile_safeguard)
        del q, k, v, ks, vs  # the bf16 operands: not held while dQ's fp32 sum is converted
        return _scale_cast(dq, softmax_scale, dtype), dk, dv
    dq = (q.new_zeros if plan.rows_without_keys[causal] else q.new_empty)(Tq, H, D)
    for kernel, outs, (BM, BN, warps, stages), side, heads, mode in (  # per key tile, per query tile
            (_attn_bwd_dkdv, (dk, dv), var.dkdv, "k", HK, var.modes[1]),
            (_attn_bwd_dq, (dq,), var.dq, "q", H, var.modes[2])):
        tiles = plan.tiles(BN if side == "k" else BM, side, causal)
        if tiles.shape[0] > 0:
            kernel[(tiles.shape[0], heads)]((q, do, lse, delta), (k, v, ks, vs, k_scale), *outs, tiles,
                                            softmax_scale, Tq, Tk, H, HK, D=D, BLOCK_M=BM, BLOCK_N=BN,
                                            BLOCK_TOKENS=block_tokens, CAUSAL=causal, SAFEGUARD=mode,
                                            K_SCALED=r.k_fp4, num_warps=warps, num_stages=stages)
    return dq, dk, dv


# ---- 6. Autograd, torch custom ops and the public API -----------------------------------------
# Launches run as torch.library custom ops (fakes give shapes): torch.compile sees opaque nodes, no graph break. A
# Plan cannot cross the op boundary: the ops get the cu_seqlens tensors, find the Plan built for them (every Plan
# registers itself), or build one (a host sync). The forward's quantized operands are outputs, for the backward:
class Operands(NamedTuple):
    """Shapes, dtypes: operand_slots. Unused slots are empty tensors (op outputs: never None or aliases)."""
    q: torch.Tensor  # E4M3, per token ...
    q_exp: torch.Tensor  # ... and its E8M0 exponents, in the padded token layout (padded_columns)
    k: torch.Tensor  # E4M3 (mxfp8) or two E2M1 per byte (FP4)
    k_exp: torch.Tensor  # mxfp8: E8M0 per block; FP4: the fp32 second level, per token
    k_block: torch.Tensor  # FP4: block scales along the head dim
    k_tok: torch.Tensor  # mxfp8 with the safeguard: K quantized per token ...
    k_tok_exp: torch.Tensor  # ... and its exponents
    v_t: torch.Tensor  # E4M3, token-transposed
    v_exp: torch.Tensor  # E8M0 per block
    v_tok_t: torch.Tensor  # with the safeguard: V quantized per token, token-transposed ...
    v_tok_exp: torch.Tensor  # ... and its exponents


def operand_slots(recipe: Recipe, q_shape, k_shape, q_pad: int, k_pad: int, copies: bool) -> Operands:
    """(shape, dtype) of each Operands slot `recipe` fills, None where unused: what the quantizers write and
    torch.compile's fake forward (_fwd_fake) returns. q_pad, k_pad: padded_tokens; copies: safeguard's."""
    (Tq, H, D), (Tk, HK) = q_shape, k_shape[:2]
    if not recipe.quantized:
        return Operands(*(None for _ in Operands._fields))
    f8, u8, f32 = torch.float8_e4m3fn, torch.uint8, torch.float32
    if recipe.k_fp4:  # two E2M1 per byte, the per-token second level, block scales (NVFP4's E4M3)
        block = ((Tk, HK, D // NVFP4_BLOCK), f8) if recipe.k_format == "nvfp4" else ((Tk, HK, D // MXFP4_BLOCK), u8)
        k = (((Tk, HK, D // 2), u8), ((HK, Tk), f32), block)
    else:
        k = (((Tk, HK, D), f8), ((HK, k_pad), u8), None)
    v = (((HK, D, k_pad), f8), ((HK, k_pad), u8))
    k_tok = k[:2] if copies and not recipe.k_fp4 else (None, None)  # FP4 K is per token: no copy
    return Operands(((Tq, H, D), f8), ((H, q_pad), u8), *k, *k_tok, *v, *(v if copies else (None, None)))


def _quantize_operands(q, k, v, plan: Plan, recipe: Recipe, block_tokens: int, copies: bool, quantize_q=False):
    """The forward's Operands: ONE fused quantizer launch for Q, K and V (self-attention; two for other query
    documents or FP4 K); bf16: all unused. With quantize_q, Q's slots are only allocated: the forward writes them."""
    unused = lambda: q.new_empty(0, dtype=torch.float32)
    if not recipe.quantized:
        return Operands(*(unused() for _ in Operands._fields))
    # V only token-transposed: the K-major operand of P V (the backward dequantizes this copy).
    queries = q if plan.same_documents and not quantize_q else None  # one tile table: Q joins the launch
    if recipe.k_fp4:  # FP4 along the head dim, per token: the safeguard needs no copy of K
        kf = quantize_fp4(k, plan, recipe.k_format, "k")
        k_parts = (kf.packed, kf.s2, kf.block_scale, None, None)
        v8, _, q8 = quantize_mxfp8_launch(v, plan, block_tokens, "k", transposed=True,
                                          per_token_copy=copies, queries=queries)
    else:  # K row-major and V in the same launch
        k8, v8, q8 = quantize_mxfp8_launch(k, plan, block_tokens, "k", per_token_copy=copies,
                                           second=(v, True), queries=queries)
        k_tok = (k8.tok.data, k8.tok.exp) if copies else (None, None)
        k_parts = (k8.data, k8.exp, None, *k_tok)
    if quantize_q:
        q8 = MXFP8(*(q.new_empty(shape, dtype=dtype) for shape, dtype in
                     operand_slots(recipe, q.shape, k.shape, plan.padded_q, plan.padded_k, copies)[:2]))
    elif q8 is None:  # cross-attention: Q follows other documents, its own launch
        q8 = quantize_mxfp8(q, plan, 1, "q")
    v_tok = (v8.tok.data_t, v8.tok.exp) if copies else (None, None)
    parts = (q8.data, q8.exp, *k_parts, v8.data_t, v8.exp, *v_tok)
    return Operands(*(p if p is not None else unused() for p in parts))


@functools.cache  # the Plans of flamia_attn_func's calls, by shape and device
def _dense_plan(batch: int, seqlen_q: int, seqlen_k: int, device) -> Plan:
    cu = lambda s: torch.arange(0, (batch + 1) * s, s, dtype=torch.int32)  # on the host: no GPU sync
    return Plan(cu(seqlen_q), cu(seqlen_k), device=device)


def _plan_for(cu_q: torch.Tensor, cu_k: torch.Tensor, dense: list) -> Plan:
    if dense[0] > 0:  # (B, S, H, D) inputs: B equal documents
        return _dense_plan(*dense, str(cu_q.device))
    plan = _PLANS.get(id(cu_q))
    if (plan is None or plan.cu_seqlens_q is not cu_q or plan.cu_seqlens_k is not cu_k
            or plan.version != cu_q._version):
        plan = Plan(cu_q, cu_k)
        _RECENT_PLANS.append(plan)
    return plan


def _check_plan(plan: Plan, total_q: int, total_k: int, max_seqlen_q=None, max_seqlen_k=None):
    for side, have, want in (("q", plan.total_q, total_q), ("k", plan.total_k, total_k)):
        if have != want:
            raise ValueError(f"cu_seqlens_{side} must end at the total number of tokens {want}, got {have}")
    if max_seqlen_q is not None and (max_seqlen_q < plan.max_seqlen_q or max_seqlen_k < plan.max_seqlen_k):
        raise ValueError(f"max_seqlen_q / max_seqlen_k ({max_seqlen_q}, {max_seqlen_k}) are smaller than "
                         f"the longest documents ({plan.max_seqlen_q}, {plan.max_seqlen_k})")


def _check_finite(q, k, v) -> None:
    """check_finite=True: one pass over q, k, v and one host sync."""
    for name, ok in zip("qkv", torch.stack([torch.isfinite(x).all() for x in (q, k, v)]).tolist()):
        if not ok:
            raise ValueError(f"{name} contains inf or NaN (check_finite=True)")


def _fwd_impl(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
              cu_seqlens_k: torch.Tensor, dense: list[int], causal: bool, softmax_scale: float, recipe: str,
              block_tokens: int, safeguard: bool, backend: Optional[str], check_finite: bool) -> list[torch.Tensor]:
    plan = _plan_for(cu_seqlens_q, cu_seqlens_k, dense)
    _check_plan(plan, q.shape[0], k.shape[0])
    var = variant(q, recipe, block_tokens, plan, causal, safeguard, backend)
    if check_finite:
        _check_finite(q, k, v)
    if var.refusal:
        raise ValueError(var.refusal)
    ops = _quantize_operands(q, k, v, plan, var.recipe, block_tokens, var.copies, var.quantize_q)
    o, lse = _attn_forward(q, k, v, ops, plan, var, causal=causal, softmax_scale=softmax_scale,
                           block_tokens=block_tokens)
    return [o, lse, *ops]


def _fwd_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, dense, causal, softmax_scale, recipe, block_tokens,
              safeguard, backend, check_finite):
    """The forward op's outputs as torch.compile's fake tensors: o, lse and every slot of Operands."""
    r, n_docs = _RECIPES[recipe], cu_seqlens_k.shape[0] - 1
    slots = operand_slots(r, q.shape, k.shape, *(padded_tokens(x.shape[0], n_docs) for x in (q, k)),
                          _token_copies(r, causal, safeguard, block_tokens))
    return [torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32),
            *(q.new_empty(s[0], dtype=s[1]) if s else q.new_empty(0, dtype=torch.float32) for s in slots)]


def _bwd_impl(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
              lse: torch.Tensor, ops: list[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
              dense: list[int], causal: bool, softmax_scale: float, recipe: str, block_tokens: int, safeguard: bool,
              backend: Optional[str], deterministic: bool) -> list[torch.Tensor]:
    plan = _plan_for(cu_seqlens_q, cu_seqlens_k, dense)
    var = variant(q, recipe, block_tokens, plan, causal, safeguard, backend, deterministic)
    return list(_attn_backward(do, q, k, v, o, lse, Operands(*ops), plan, var, causal=causal,
                               softmax_scale=softmax_scale, block_tokens=block_tokens))


def _custom_op(name, impl, fake):
    """impl as the custom op flamia::name (fake: its outputs' shapes), called only while torch.compile traces:
    else impl runs directly, as the dispatcher's round trip costs tens of microseconds of host time (measured)."""
    op = torch.library.custom_op(f"flamia::{name}", impl, mutates_args=(), device_types=("cuda", "cpu"))
    op.register_fake(fake)
    return lambda *args: (op if torch.compiler.is_compiling() else impl)(*args)


_fwd = _custom_op("fwd", _fwd_impl, _fwd_fake)
_bwd = _custom_op("bwd", _bwd_impl, lambda do, q, k, v, *_: [torch.empty_like(x) for x in (q, k, v)])


class _FlamiaAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, dense, causal, scale, recipe, block_tokens, safeguard,
                backend, check_finite, deterministic):
        o, lse, *ops = _fwd(q, k, v, cu_q, cu_k, dense, causal, scale, recipe, block_tokens,
                            safeguard, backend, check_finite)
        keep = (q, k, v)
        if _RECIPES[recipe].quantized:  # the backward reads only ops (half the bytes) and the shapes
            keep = [x.new_empty(1).expand(x.shape) for x in keep]  # one element each, stride 0
        ctx.save_for_backward(*keep, o, lse, cu_q, cu_k, *ops)
        ctx.args = (dense, causal, scale, recipe, block_tokens, safeguard, backend, deterministic)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, cu_q, cu_k, *ops = ctx.saved_tensors
        dq, dk, dv = _bwd(do, q, k, v, o, lse, ops, cu_q, cu_k, *ctx.args)
        return dq, dk, dv, *([None] * 11)


def kernels_available(device) -> bool:
    """True where the Triton kernels run (CUDA, or TRITON_INTERPRET=1); elsewhere the API runs the oracle."""
    return torch.device(device).type == "cuda" or (INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1")


def _check_call(q, k, v, dims: int, recipe, block_tokens, backend) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(x, name, dims)
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"{name} must be bfloat16 or float16, got {x.dtype}")
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"q, k, v must share dtype and device; {name} is {x.dtype} on "
                             f"{x.device}, q is {q.dtype} on {q.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    if q.shape[-2] % k.shape[-2] != 0:
        raise ValueError(f"the number of q heads ({q.shape[-2]}) must be a multiple of the number "
                         f"of k/v heads ({k.shape[-2]}) (GQA/MQA)")
    _check_options(recipe, block_tokens, backend)


def _check_options(recipe, block_tokens, backend) -> None:
    if recipe not in _RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    _check_block_tokens(block_tokens)
    if backend is not None and backend not in BACKENDS:
        renamed = " (backend='wgmma' is now 'tl')" if backend == "wgmma" else ""
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}{renamed}")
    if why := _backend_refusal(_RECIPES[recipe], backend):
        raise ValueError(why)


def _gpu_refusal(recipe, capability) -> Optional[str]:
    """Why a GPU of this capability cannot run the recipe's kernels (None: it can), said here, not by a
    compiler error: E4M3 operands (quantized recipes' Q, V) need FP8 tensor cores (sm_89+), bf16 sm_80+."""
    fp8 = _RECIPES[recipe].quantized
    if tuple(capability) >= ((8, 9) if fp8 else (8, 0)):
        return None
    return (f"recipe={recipe!r} needs a GPU of compute capability >= {'8.9 (FP8' if fp8 else '8.0 (bf16'} "
            f"tensor cores), this one has {'.'.join(map(str, capability))}"
            + ("; recipe='bf16' runs here" if fp8 and tuple(capability) >= (8, 0) else ""))


def _attention(q, k, v, cu_q, cu_k, dense, causal, softmax_scale, recipe, block_tokens, safeguard,
               rotate_qk, backend, check_finite, deterministic):
    """Both public functions, after validation: the kernels, or the oracle where none run."""
    softmax_scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if not kernels_available(q.device):  # CPU without the interpreter: the oracle (P unrounded)
        if check_finite:
            _check_finite(q, k, v)
        o, lse = reference_attention(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=softmax_scale,
                                     recipe=recipe, block_tokens=block_tokens, safeguard=safeguard,
                                     rotate_qk=rotate_qk, return_lse=True)
        return o.to(q.dtype), lse
    if q.is_cuda and (why := _gpu_refusal(recipe, torch.cuda.get_device_capability(q.device))):
        raise ValueError(why)
    if rotate_qk:  # outside the custom op: autograd rotates dQ, dK back
        q, k, softmax_scale = _rotate_qk(q, k, softmax_scale)
    return _FlamiaAttention.apply(q, k, v, cu_q, cu_k, dense, causal, softmax_scale, recipe,
                                  block_tokens, safeguard, backend, check_finite, deterministic)


def flamia_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=True,
                            softmax_scale=None, recipe="mxfp8", block_tokens=DEFAULT_BLOCK_TOKENS,
                            safeguard=True, rotate_qk=False, backend=None, plan=None, return_lse=False,
                            check_finite=False, deterministic=False):
    """FLAMIA attention on packed documents, flash-attn's varlen signature and layouts: q (total_q, H, D), k, v
    (total_k, Hk, D), H % Hk == 0, bf16 or fp16, D 64 or 128; int32 cu_seqlens (n_docs + 1,); max_seqlen_*: bounds on
    the document lengths. README.md's API table explains each option's default; safeguard=False LEAKS the future
    (tests and demos only). Returns out (total_q, H, D) [and lse (H, total_q): natural log, not differentiable]."""
    _check_call(q, k, v, 3, recipe, block_tokens, backend)
    if plan is not None and not isinstance(plan, Plan):
        raise TypeError(f"plan must be a flamia.Plan (from flamia_plan), got {type(plan).__name__}")
    if plan is not None and plan.device != q.device:
        raise ValueError(f"the plan is on {plan.device} but q is on {q.device}")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if cu is None and plan is not None:  # the plan's own
            continue
        _check_cu_seqlens(cu, name)
        if plan is not None:  # compiling: its host read of cu must stay out of the traced graph
            check = plan.check_offsets
            (torch.compiler.disable(check) if torch.compiler.is_compiling() else check)(cu, name)
        elif cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}")
    if plan is not None:
        cu_seqlens_q, cu_seqlens_k = plan.cu_seqlens_q, plan.cu_seqlens_k
    elif not torch.compiler.is_compiling():  # while tracing, the custom op checks and plans
        plan = _plan_for(cu_seqlens_q, cu_seqlens_k, [0, 0, 0])
    if plan is not None:
        _check_plan(plan, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    o, lse = _attention(q, k, v, cu_seqlens_q, cu_seqlens_k, [0, 0, 0], causal, softmax_scale, recipe,
                        block_tokens, safeguard, rotate_qk, backend, check_finite, deterministic)
    return (o, lse) if return_lse else o


def flamia_attn_func(q, k, v, *, causal=True, softmax_scale=None, recipe="mxfp8",
                     block_tokens=DEFAULT_BLOCK_TOKENS, safeguard=True, rotate_qk=False,
                     backend=None, return_lse=False, check_finite=False, deterministic=False):
    """FLAMIA attention on (batch, seqlen, heads, head_dim) tensors; see flamia_attn_varlen_func.
    Returns out (B, Sq, H, D) [and lse (B, H, Sq)]. No host sync (the Plan comes from shapes)."""
    _check_call(q, k, v, 4, recipe, block_tokens, backend)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    (B, Sq, H, D), Sk = q.shape, k.shape[1]
    cu = lambda s: torch.arange(0, (B + 1) * s, s, dtype=torch.int32, device=q.device)
    o, lse = _attention(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu(Sq), cu(Sk),
                        [B, Sq, Sk], causal, softmax_scale, recipe, block_tokens, safeguard,
                        rotate_qk, backend, check_finite, deterministic)
    o, lse = o.view(B, Sq, H, D), lse.view(H, B, Sq).transpose(0, 1)
    return (o, lse) if return_lse else o


# ---- 6b. Hugging Face transformers: FLAMIA as a model's attention (packed documents included) ----
# transformers passes query (B, H, S, D), key/value (B, Hk, S, D), the rest as keywords. Packed rows
# (DataCollatorWithFlattening) arrive ONLY as keywords, attention_mask None: an adapter that ignores them
# attends across documents. Documents come from cu_seq_lens_q/k, else from position_ids, else one per row.
# Every layer gets the same tensor: the first builds the Plan (one host read), the rest find it.
_HF_PLANS = {}  # id(a batch's cu_seq_lens_q or position_ids) -> (stamp, Plan), while that tensor lives


def _hf_plan(batch_tensor: torch.Tensor, query: torch.Tensor, cu_seqlens) -> Plan:
    """The Plan of `batch_tensor`'s batch, keyed by the tensor object: flamia_plan(*cu_seqlens())
    builds it, again if the tensor was changed in place or now serves another batch shape or device."""
    key = id(batch_tensor)
    stamp = (batch_tensor._version, query.shape[0], query.shape[2], query.device)
    if (hit := _HF_PLANS.get(key)) is None:
        weakref.finalize(batch_tensor, _HF_PLANS.pop, key, None)  # its death ends the Plan (and its _PLANS entry)
    elif hit[0] == stamp:
        return hit[1]
    _HF_PLANS[key] = (stamp, flamia_plan(*cu_seqlens(), device=query.device))
    return _HF_PLANS[key][1]


def _documents_of(position_ids: torch.Tensor, batch: int, seqlen: int) -> torch.Tensor:
    """int32 cu_seqlens of the rows flattened: a document starts at every row start and wherever the position
    does not follow its predecessor (transformers' rule; also for restarts at 1). On the host: one read per batch."""
    pos = position_ids.expand(batch, seqlen).cpu()  # (1, S) position_ids serve every row
    starts = torch.cat([torch.ones(batch, 1, dtype=torch.bool), pos[:, 1:] != pos[:, :-1] + 1], 1)
    return torch.cat([starts.flatten(), torch.tensor([True])]).nonzero().flatten().to(torch.int32)


def flamia_hf_attention_fn(recipe: str = "mxfp8", block_tokens: int = DEFAULT_BLOCK_TOKENS, **options):
    """A transformers attention function: FLAMIA with this recipe and block_tokens (options: safeguard, rotate_qk,
    backend). Register it WITH flash_attention_mask (README.md): without one, transformers DROPS a padding mask
    unseen (with it, the mask is refused). What it cannot compute it refuses (ValueError naming the argument)."""
    _check_options(recipe, block_tokens, options.get("backend"))

    def flamia_hf_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        (B, H, Sq, D), Sk = query.shape, key.shape[2]
        if D not in HEAD_DIMS:
            dims = " or ".join(map(str, HEAD_DIMS))
            raise ValueError(f"head_dim {D}: FLAMIA's kernels take head_dim {dims}; set the model config's head_dim "
                             f"(e.g. LlamaConfig(head_dim=64)), or hidden_size / num_attention_heads to one of them")
        if attention_mask is not None and (attention_mask.dim() != 2 or not attention_mask.all()):
            raise ValueError(f"attention_mask: FLAMIA takes no padding or 4-D mask (it applies the "
                             f"causal, per-document mask itself); got shape {tuple(attention_mask.shape)}. "
                             f"Pack documents without padding (DataCollatorWithFlattening) and register "
                             f"transformers' flash_attention_mask for this attention name")
        if dropout > 0:
            raise ValueError(f"dropout: FLAMIA has no attention dropout; expected 0.0, got "
                             f"{dropout} (set config.attention_dropout = 0.0)")
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        for name, v in (("sliding_window", window), ("softcap", kwargs.get("softcap"))):
            if v is not None:
                raise ValueError(f"{name}: FLAMIA supports neither sliding windows nor logit "
                                 f"softcapping; expected None, got {v!r}")
        if Sq != Sk:
            raise ValueError(f"query length {Sq} != key length {Sk} (a KV cache): FLAMIA's "
                             f"adapter computes full-sequence forwards only; use use_cache=False, "
                             f"or another attn_implementation to generate")
        causal = kwargs["is_causal"] if kwargs.get("is_causal") is not None else getattr(module, "is_causal", True)
        if query.dtype == torch.float32 and torch.is_autocast_enabled(query.device.type):
            # fp32 RoPE tables promote q, k under autocast: attend in the autocast dtype
            query, key, value = (x.to(torch.get_autocast_dtype(x.device.type)) for x in (query, key, value))
        q, k, v = (x.transpose(1, 2) for x in (query, key, value))  # (B, S, heads, D)
        kw = dict(causal=causal, softmax_scale=scaling, recipe=recipe, block_tokens=block_tokens, **options)
        cu_q, pos = kwargs.get("cu_seq_lens_q"), kwargs.get("position_ids")
        if cu_q is None and pos is None:
            return flamia_attn_func(q, k, v, **kw), None
        if cu_q is not None:  # copies: the Plan must not keep the batch's own tensors alive
            cu_k = cu_q if kwargs.get("cu_seq_lens_k") is None else kwargs["cu_seq_lens_k"]
            plan = _hf_plan(cu_q, query, lambda: [c.to(torch.int32, copy=True) for c in (cu_q, cu_k)])
        else:
            plan = _hf_plan(pos, query, lambda: [_documents_of(pos, B, Sq)])
        # max_length_q/k are only bounds: the Plan knows the exact longest documents
        o = flamia_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1),
                                    plan.cu_seqlens_q, plan.cu_seqlens_k, None, None, plan=plan, **kw)
        return o.view(B, Sq, H, D), None

    return flamia_hf_attention


# ---- 7. Causality auditor: does an attention implementation leak the future or across documents? ----
# Bitwise and black-box: run the implementation on an adversarial packed batch, then with one token's q, k or v an
# outlier (enough to move any data-dependent scale: per token, block or tensor). Every output (and LSE) row that must
# not depend on that token (earlier rows of its document, all rows of other documents) must stay bit-identical.
# Documents start mid-block: lengths 1/31/32/33, an empty and a long one; positions probe block middles and ends.
AUDIT_DOC_LENS = (33, 1, 31, 0, 32, 161)


def audit_causality(attn_fn, *, heads=2, kv_heads=None, head_dim=64, doc_lens=AUDIT_DOC_LENS,
                    positions=None, tensors=("q", "k", "v"), outlier=1e3, device=None,
                    dtype=torch.bfloat16, seed=0, gradients=False):
    """Audit `attn_fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)` (flash-attn varlen signature,
    causal self-attention; returns out or (out, lse)). positions: {doc index: [positions]} to perturb (default: a few
    each). Returns the findings, [] if safe: one dict per (doc, position, tensor, kind) that leaked, kind "future"
    (an earlier row of its document changed) or "document" (a row of another document), with the changed rows' count
    and max_abs_change. gradients: also back-propagate a fixed dO; a token's row then holds dQ too (a function of the
    tokens up to it), and for other documents dK and dV (an earlier key's dK, dV rightly depend on later queries)."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kv_heads = kv_heads or heads
    gen = torch.Generator().manual_seed(seed)
    offsets = [0] + torch.cumsum(torch.tensor(doc_lens), 0).tolist()
    T = offsets[-1]
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    randn = lambda h, g: torch.randn(T, h, head_dim, generator=g).to(dtype).to(device)
    base = {n: randn(h, gen) for n, h in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    d_out = randn(heads, torch.Generator().manual_seed(seed + 1))

    def run(x):  # a row per token: O [, LSE] [, dQ, dK, dV]
        if gradients:
            x = {n: t.clone().requires_grad_() for n, t in x.items()}
        out = attn_fn(x["q"], x["k"], x["v"], cu, cu, max(doc_lens), max(doc_lens))
        rows = [out[0], out[1].reshape(-1, T).t()] if isinstance(out, tuple) else [out]  # LSE: (H, T)
        if gradients:
            rows[0].backward(d_out)
            rows += [x[n].grad for n in "qkv"]
        return torch.cat([r.detach().reshape(T, -1).float() for r in rows], 1)

    ref = run(base)
    own = ref.shape[1] - (2 * kv_heads * head_dim if gradients else 0)  # all but dK, dV (docstring)
    doc_of = torch.searchsorted(torch.tensor(offsets), torch.arange(T), right=True) - 1
    if positions is None:  # per document: the middle and end of the first block, a late token
        positions = {d: sorted({p for p in (L // 2, min(L - 1, 20), L - 1) if 0 < p < L})
                     for d, L in enumerate(doc_lens) if L > 1}
    findings = []
    for d, plist in positions.items():
        for p in plist:
            t = offsets[d] + p
            for name in tensors:
                x = dict(base, **{name: base[name].clone()})
                sign = torch.sign(torch.randn(x[name][t].shape, generator=gen))
                x[name][t] = (outlier * sign).to(dtype).to(device)
                out = run(x)
                changed = (out != ref).cpu()  # bitwise
                diff = (out - ref).abs().amax(dim=1).cpu()
                earlier = (doc_of == d) & (torch.arange(T) < t) & changed[:, :own].any(dim=1)
                other_docs = (doc_of != d) & changed.any(dim=1)
                for kind, rows in (("future", earlier), ("document", other_docs)):
                    if rows.any():
                        change = diff[rows].nan_to_num(float("inf")).max()
                        findings.append(dict(doc=d, position=p, tensor=name, kind=kind,
                                             rows=int(rows.sum()), max_abs_change=float(change)))
    return findings


def varlen_adapter(dense_fn):
    """Adapt a causal attention on (B, S, H, D) for audit_causality: documents become the batch (zero-padded at the
    end, unseen by causal rows), in ONE call, so batch-wide statistics (per-tensor scales) show as document leaks."""
    def fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        bounds = cu_seqlens_q.tolist()
        offs = [(a, b) for a, b in zip(bounds, bounds[1:]) if b > a]
        batch = lambda x: torch.nn.utils.rnn.pad_sequence([x[a:b] for a, b in offs], batch_first=True)
        o = dense_fn(batch(q), batch(k), batch(v))  # (T, H, D) -> (B, S, H, D), zeros past the ends
        return torch.cat([o[i, :b - a] for i, (a, b) in enumerate(offs)])
    return fn


# ---- 8. Triton's CPU interpreter: numerics fixes, applied wherever FLAMIA's kernels are interpreted ----
# With TRITON_INTERPRET=1 set before triton is imported, every kernel above runs on the CPU in numpy. The interpreter
# (triton/runtime/interpreter.py; seen in 3.6 to 3.9) has numerics bugs that would make FLAMIA silently wrong there
# (a bf16 forward off by ~1e9): (1) tl.dot on bf16 operands multiplies the raw uint16 bit patterns; (2) float casts
# to bf16 / fp8 truncate, drop the rounding carry into the exponent, mis-round subnormals and turn NaN/inf finite,
# widening ones too; (3) int -> bf16 stores the value as raw bits. The fixes route those operations through torch's
# correctly rounded casts; if the interpreter's internals have moved, FLAMIA refuses to run interpreted.
INTERPRETED = not isinstance(_attn_fwd, triton.runtime.JITFunction)
INTERPRETER_MIN_TRITON = (3, 8)  # older: numpy TypeErrors (3.6), tl.dot_scaled fails (3.7); GPUs need >= 3.6


def _fix_interpreter_numerics():
    if tuple(int(p) for p in triton.__version__.split(".")[:2]) < INTERPRETER_MIN_TRITON:
        need = ".".join(map(str, INTERPRETER_MIN_TRITON))
        raise RuntimeError(f"FLAMIA's kernels in Triton's CPU interpreter (TRITON_INTERPRET=1) need "
                           f"triton >= {need}, found {triton.__version__}: pip install 'triton>={need}', "
                           f"or unset TRITON_INTERPRET (without a GPU FLAMIA then runs its PyTorch oracle)")
    import numpy as np
    from triton._C.libtriton import ir
    from triton.runtime import interpreter as interp
    B = interp.InterpreterBuilder
    if getattr(interp, "_numerics_patched", False):
        return
    if not all(hasattr(o, a) for o, a in ((interp, "_convert_float"), (B, "create_dot"), (B, "cast_impl"))):
        raise RuntimeError(f"triton {triton.__version__}: the interpreter's internals changed, so FLAMIA "
                           "cannot fix its numerics; unset TRITON_INTERPRET or use triton 3.8-3.9")
    # The interpreter stores bf16 / fp8 tensors as raw uint16 / uint8 bit patterns in numpy.
    torch_dt = {tl.float64: torch.float64, tl.float32: torch.float32, tl.float16: torch.float16,
                tl.bfloat16: torch.bfloat16, tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}
    # NVIDIA's fp8 convert (cvt.rn.satfinite) saturates; torch's .to() gives NaN / inf: clamp first (keeps NaN).
    saturate = {tl.float8e4nv: E4M3_MAX, tl.float8e5: 57344.0}
    orig_convert, orig_dot, orig_cast = interp._convert_float, B.create_dot, B.cast_impl

    def convert_float(x, src, dst, rounding_mode):  # bugs (2): through torch's RNE casts
        if src not in torch_dt or dst not in torch_dt or rounding_mode == ir.ROUNDING_MODE.RTZ:
            return orig_convert(x, src, dst, rounding_mode)
        n_in, n_out = src.primitive_bitwidth, dst.primitive_bitwidth
        t = torch.from_numpy(np.array(x).view(f"int{n_in}")).view(torch_dt[src])
        if dst in saturate:
            t = t.float().clamp(-saturate[dst], saturate[dst])
        out = t.to(torch_dt[dst]).view(getattr(torch, f"int{n_out}")).numpy()
        return out.view(f"uint{n_out}")  # the original's contract: raw bits

    def create_dot(self, a, b, d, *args):  # bug (1): upcast bf16 to fp32 (exact) first
        a, b = (orig_cast(self, x, tl.float32) if x.dtype.scalar == tl.bfloat16 else x for x in (a, b))
        return orig_dot(self, a, b, d, *args)

    def cast_impl(self, src, dst_type):  # bug (3): go through fp32 and the fixed rounding
        if dst_type.scalar == tl.bfloat16 and src.dtype.scalar not in (tl.float32, tl.bfloat16):
            src = orig_cast(self, src, tl.float32)
        return orig_cast(self, src, dst_type)

    interp._convert_float, B.create_dot, B.cast_impl = convert_float, create_dot, cast_impl
    interp._numerics_patched = True


if INTERPRETED:
    _fix_interpreter_numerics()
