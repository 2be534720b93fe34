"""
FLAMIA: FLAsh MIcroscaling Attention — FP8 / MXFP8 flash attention for training causal
language models on packed variable-length documents, causally safe by construction.

A from-scratch, single-file reimplementation of the method of "FLAMIA: FLAsh MIcroscaling
Attention for Fast and Causally Safe Training on Blackwell" (arXiv 2611.03344). Only the
paper's abstract is public; everything here is derived from it, from public analyses of the
low-precision leak (MatX, TransformerEngine #3248, cuDNN-frontend #983/#1123) and from
measurements on an H200. Reading order (each section starts with a `# ---` divider):

  1. formats          E4M3 + E8M0 scales (MXFP8); NVFP4 (E2M1 + E4M3 + FP32); MXFP4 (E2M1 + E8M0)
  2. scaling & plan   token-block, document-local scaling; the Plan (tiles of packed documents)
  3. quantizers       PyTorch reference and the fused Triton quantizer (bit-identical)
  4. reference oracle the exact function every recipe computes, plus exact fp64 attention
  5. kernels          fused Triton forward / backward, with the causal safeguard
  6. public API       autograd + torch custom ops: flamia_attn_varlen_func, flamia_attn_func
  7. auditor          audit_causality: a bitwise leak test for any attention implementation

The leak, in one paragraph. A scale shared by several tokens is a function of all of them. If
key j's quantized value depends on a later token j' of its block, a query i with j <= i < j'
sees the future through j's rounding. FLAMIA therefore (a) scales Q per token, (b) scales K, V
(and the FP4 recipes' dO) per block of `block_tokens` consecutive tokens of ONE document and ONE
head (blocks restart at every document start, so nothing crosses documents), and (c) applies a *targeted
safeguard*: for the (query, key) pairs whose key block straddles the query position — only on
the diagonal — the kernel uses a per-token quantized copy of K and V instead (per pair, or per tile
when block_tokens is a multiple of every tile size: _tile_safeguard). Everything that
is a statistic over the sequence (the online-softmax max, the P scale) is taken per query row
over that row's visible keys only.

Limitations
  * head_dim 64 or 128; inputs bf16 or fp16; Q and K/V documents given by cu_seqlens (int32).
  * Causal alignment when seqlen_q != seqlen_k is bottom-right (as flash-attn).
  * Non-finite inputs: the quantizer encodes a non-finite block as NaN (E8M0 0xFF and E4M3
    NaN), so outputs that depend on it are NaN, never finite garbage (with the caveat that a NaN key
    also reaches the earlier rows of its own key tile through 0 * NaN in the P V MMA); the public
    functions raise a ValueError when `check_finite=True` (default; costs one host sync per call).
  * Speed (H200): MXFP8 fwd+bwd beats the same kernels in BF16 on long documents (one 16k document: 419
    vs 404 TFLOP/s) and loses on short ones, and cuDNN's BF16 is faster than both (README). The backward
    runs bf16 MMAs on the dequantized fp8 operands (measured faster, section 5b). block_tokens=128 is the
    fastest setting on long documents (scalar tile scales, the safeguard per tile: forward level with
    cuDNN's), the default block_tokens=1 on packed short ones (README, "Choosing block_tokens").
  * FP4 recipes put K (of S = Q K^T) in FP4 and keep Q, V, dO in MXFP8: the split that trained best on
    the H200 (README, "The FP4 split"). recipe="nvfp4" is an exact emulation of FP4 (bf16 MMAs): Triton's
    tl.dot_scaled takes no E4M3 block scales. recipe="mxfp4" (E8M0 block scales) is the FP4 recipe for
    Blackwell's tensor cores; that path has only run under the interpreter.

What was run where (see README): every kernel runs under Triton's CPU interpreter in CI and on
an H200 (sm_90). The Blackwell path (`backend="dot_scaled"`, native E8M0 scales through
`tl.dot_scaled`) has only run under the interpreter and through its bf16 emulation on Hopper.
"""
import math
import os
import weakref

import torch
import triton
import triton.language as tl

# ---------------------------------------------------------------------------------------------
# 1. Formats
# ---------------------------------------------------------------------------------------------
# MXFP8 element: E4M3 (torch.float8_e4m3fn / tl.float8e4nv): 1 sign, 4 exponent, 3 mantissa
# bits, max 448, no infinities, one NaN pattern (0x7F / 0xFF).
# MX scale: E8M0, a bare biased exponent byte e meaning 2^(e - 127); 0xFF is NaN.
#
# THE SCALE RULE (the production one, TransformerEngine / cuDNN): the scale of a block is the
# smallest power of two s with amax / s <= 448, so nothing ever saturates. It is computed from
# the bits of amax, exactly, with no division or log that could round differently on the CPU,
# the GPU and the interpreter. Write amax = m * 2^E with m in [1, 2):
#     amax / 2^k <= 448 = 1.75 * 2^8   <=>   k >= E - 8 + (m > 1.75)
# so the biased exponent is e = E_biased - 8 + (mantissa bits > 0x600000), clamped to >= 1.
# The clamp makes tiny and all-zero blocks well defined: amax < 2^-118 gets s = 2^-126 (and
# amax / s < 256), an all-zero block quantizes to exact zeros. Keeping e >= 1 also keeps every
# scale a *normal* fp32 number, so kernels build it with a shift instead of an exp2.
# A non-finite amax (E_biased == 255) gets e = 0xFF (NaN), and its elements are E4M3 NaN.
E4M3_MAX = 448.0
E8M0_NAN = 255
E2M1_MAX = 6.0
NVFP4_BLOCK = 16  # NVFP4: one E4M3 scale per 16 elements along the head dim
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)  # magnitude of code 0..7


def e8m0_exponent(amax: torch.Tensor, elem_max: float = E4M3_MAX) -> torch.Tensor:
    """The scale rule: uint8 E8M0 exponent of the smallest power of two s with amax/s <= elem_max,
    for E4M3 elements (448 = 1.75 * 2^8) or E2M1 ones (6 = 1.5 * 2^2, MXFP4)."""
    shift, mant = {E4M3_MAX: (8, 0x600000), E2M1_MAX: (2, 0x400000)}[elem_max]
    bits = amax.float().view(torch.int32)
    biased = (bits >> 23) & 0xFF
    e = biased - shift + ((bits & 0x7FFFFF) > mant).int()
    e = torch.where(biased == 255, E8M0_NAN, e.clamp(min=1))
    return e.to(torch.uint8)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """2^(e - 127) as fp32; NaN for 0xFF."""
    s = torch.ldexp(torch.ones_like(e, dtype=torch.float32), e.int() - 127)  # exact
    return torch.where(e == E8M0_NAN, torch.nan, s)


def e4m3_encode(x_over_s: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even E4M3 of x / s (already divided); NaN where the scale is NaN."""
    q = x_over_s.clamp(-E4M3_MAX, E4M3_MAX)  # torch's cast gives NaN above 448; the GPU saturates
    q = torch.where(e == E8M0_NAN, torch.nan, q)
    return q.to(torch.float8_e4m3fn)


# NVFP4: E2M1 elements (values
# +-{0, .5, 1, 1.5, 2, 3, 4, 6}) in 16-element blocks along the head dim, an E4M3 scale per
# block, and a second-level FP32 scale. The usual second level is ONE amax over the whole
# tensor, which is a statistic over every token of every document: it leaks across time and
# documents. Here it is per token and head: s2 = amax(token, head) / (448 * 6).
def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest-even onto the E2M1 grid, saturating at 6. Returns uint8 codes 0..15
    (bit 3 = sign, bits 0-2 = magnitude index into E2M1_VALUES)."""
    a = x.abs()
    # Boundaries between neighbours; a tie goes to the even mantissa (0, 1, 2, 4 have mantissa 0):
    # 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
    k = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int()
         + (a > 2.5).int() + (a >= 3.5).int() + (a > 5.0).int())
    return (k + 8 * (x < 0).int()).to(torch.uint8)


def e2m1_decode(code: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(E2M1_VALUES, device=code.device)
    mag = lut[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def quantize_nvfp4_reference(x: torch.Tensor):
    """x: (T, H, D) -> (packed (T, H, D//2) uint8 [two E2M1 codes per byte, first element in the
    low nibble], block scales (T, H, D//16) float8_e4m3fn, per-token scale (T, H) fp32)."""
    _check_thd(x, "x")
    T, H, D = x.shape
    xf = x.float()
    amax_tok = xf.abs().amax(-1)  # (T, H)
    # Divide by tensors, not Python scalars: CUDA torch turns `x / scalar` into x * (1 / scalar), which
    # is not the correctly rounded quotient the Triton quantizer (div_rn) and the CPU compute.
    s2 = amax_tok / torch.full_like(amax_tok, E4M3_MAX * E2M1_MAX)
    s2 = torch.where(s2 > 0, s2, torch.ones_like(s2))  # all-zero token: any scale, codes are 0
    xb = xf.view(T, H, D // NVFP4_BLOCK, NVFP4_BLOCK)
    amax_b = xb.abs().amax(-1)
    sb = (amax_b / torch.full_like(amax_b, E2M1_MAX) / s2[..., None]).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = sb.float() * s2[..., None]
    denom = torch.where(denom > 0, denom, torch.ones_like(denom))
    codes = e2m1_encode(xb / denom[..., None]).view(T, H, D)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, sb, s2


def dequantize_nvfp4(packed: torch.Tensor, sb: torch.Tensor, s2: torch.Tensor) -> torch.Tensor:
    """NVFP4 (E4M3 block scales) or MXFP4 (uint8 E8M0 block scales, s2 = 1) back to fp32."""
    T, H, D2 = packed.shape
    codes = torch.stack([packed & 15, packed >> 4], dim=-1).view(T, H, 2 * D2)
    vals = e2m1_decode(codes).view(T, H, sb.shape[-1], -1)
    block_scale = e8m0_to_float(sb) if sb.dtype == torch.uint8 else sb.float()
    return (vals * block_scale[..., None] * s2[..., None, None]).view(T, H, 2 * D2)


# MXFP4 (OCP MX): E2M1 elements in 32-element blocks along the head dim, an E8M0 scale per block,
# no second level (E8M0 spans 2^-126..2^127 by itself). This is what Triton's tl.dot_scaled("e2m1")
# takes -- it has no E4M3 block scales -- so it is the FP4 format Blackwell's tensor cores run here
# (recipe="mxfp4"); NVFP4 stays an emulation. Scale rule: MXFP8's, for E2M1's maximum 6. The block
# scale is a power of two, so x / s is exact and only the E2M1 rounding remains.
MXFP4_BLOCK = 32


def quantize_mxfp4_reference(x: torch.Tensor):
    """x: (T, H, D) -> (packed (T, H, D//2) uint8 as NVFP4's, E8M0 exponents (T, H, D//32) uint8,
    second-level scale (T, H) fp32 of ones, so MXFP4 travels through NVFP4's code paths)."""
    _check_thd(x, "x")
    T, H, D = x.shape
    xb = x.float().view(T, H, D // MXFP4_BLOCK, MXFP4_BLOCK)
    e = e8m0_exponent(xb.abs().amax(-1), E2M1_MAX)
    codes = e2m1_encode(xb / e8m0_to_float(e)[..., None]).view(T, H, D)  # a NaN block (e = 0xFF) -> codes 0
    return codes[..., 0::2] | (codes[..., 1::2] << 4), e, torch.ones(T, H, device=x.device)


# ---------------------------------------------------------------------------------------------
# 2. Token-block, document-local scaling, and the Plan (the varlen scheduler)
# ---------------------------------------------------------------------------------------------
# Packed documents come as THD tensors (total_tokens, heads, head_dim) plus cu_seqlens, the
# int32 offsets [0, L0, L0+L1, ..., total] of the documents (flash-attn's convention; zero-length
# documents are legal). A scale block is `block_tokens` (B_t) consecutive tokens of ONE document
# and ONE head, over the whole head dim; blocks restart at every document start, so no block,
# and no statistic, ever spans two documents. Every token carries a copy of its block's E8M0
# byte, stored head-major (H, T) so that a kernel reads a tile's scales with one contiguous load.
#
# The Plan cuts every document into tiles that never cross a document boundary, aligned to the
# document start: the quantizer works on 128-token tiles (a multiple of every B_t, so each tile
# holds whole scale blocks) and the attention kernels on query tiles (forward, dQ) or key tiles
# (dK/dV). Per document, only the tiles that contain unmasked pairs exist at all, so no program is
# ever launched on a fully masked tile, and documents of length 0, 1 or 33 need no special case.
# Work items are sorted heaviest first (longest-processing-time order): the GPU picks programs
# up roughly in launch order, so the long causal rows start first and the short ones fill the
# tail. The Plan reads cu_seqlens to the host ONCE (the only host sync) and caches its tables;
# build it once per batch and pass it to every layer, like FlexAttention's BlockMask.
BLOCK_TOKENS = (1, 32, 64, 128)
QUANT_TILE = 128  # tokens per quantizer program; a multiple of every B_t
PAD_ALIGN = 16  # document starts in token-transposed layouts are padded to 16 tokens (16-byte loads)
HEAD_DIMS = (64, 128)
# Columns of a tile table (int32, one row per work item). "own" is the document the tile lives in
# (queries for query tiles, keys for key tiles), "other" the matching document on the other side.
TILE_START, TILE_END, OWN_START, OWN_END, OTHER_START, OTHER_END, OTHER_PAD, OWN_PAD = (tl.constexpr(i) for i in range(8))


def _check_thd(x, name: str, dims: int = 3) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != dims:
        shape = "(total_tokens, heads, head_dim)" if dims == 3 else "(batch, seqlen, heads, head_dim)"
        raise ValueError(f"{name} must have {dims} dims {shape}, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
        raise TypeError(f"{name} must be bfloat16 or float16, got {x.dtype}")
    if x.shape[-1] not in HEAD_DIMS:
        raise ValueError(f"{name} has head_dim {x.shape[-1]}; supported head dims are {HEAD_DIMS}")


def _check_block_tokens(block_tokens) -> None:
    if block_tokens not in BLOCK_TOKENS:
        raise ValueError(f"block_tokens must be one of {BLOCK_TOKENS}, got {block_tokens!r}")


def _check_cu_seqlens(cu: torch.Tensor, total: int, name: str, device) -> None:
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of int32 offsets, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name} must be int32 (flash-attn convention), got {cu.dtype}")
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"{name} must be 1-D with at least 2 entries [0, ..., total], got shape {tuple(cu.shape)}")
    if device is not None and cu.device != device:
        raise ValueError(f"{name} is on {cu.device} but the tensors are on {device}")


def _check_offsets(offsets: list, total: int, name: str) -> None:
    if offsets[0] != 0:
        raise ValueError(f"{name} must start at 0, got {offsets[0]}")
    if any(b < a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"{name} must be non-decreasing, got {offsets}")
    if total is not None and offsets[-1] != total:
        raise ValueError(f"{name} must end at the total number of tokens {total}, got {offsets[-1]}")


class Plan:
    """The schedule of one packed batch: documents, tiles and their order.

    cu_seqlens_q / cu_seqlens_k: int32 (n_docs + 1,) offsets (k defaults to q: the training case).
    device: where the kernels run; default: the cu_seqlens' device. Offsets that are still on the host
    (a data loader usually has them there) plus device="cuda" make the plan without any GPU sync.
    Build it once per batch; every layer's forward and backward reuse it.
    """

    def __init__(self, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor = None, total_q: int = None,
                 total_k: int = None, device=None):
        cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
        _check_cu_seqlens(cu_seqlens_q, total_q, "cu_seqlens_q", None)
        _check_cu_seqlens(cu_seqlens_k, total_k, "cu_seqlens_k", cu_seqlens_q.device)
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, "
                             f"got {cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}")
        self.offsets_q = cu_seqlens_q.tolist()  # the one host sync of a batch
        self.offsets_k = self.offsets_q if cu_seqlens_k is cu_seqlens_q else cu_seqlens_k.tolist()
        _check_offsets(self.offsets_q, total_q, "cu_seqlens_q")
        _check_offsets(self.offsets_k, total_k, "cu_seqlens_k")
        self.device = torch.device(device) if device is not None else cu_seqlens_q.device
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" means the current GPU, as in torch
            self.device = torch.device("cuda", torch.cuda.current_device())
        if cu_seqlens_q.device != self.device:
            cu_seqlens_q = cu_seqlens_q.to(self.device, non_blocking=True)
            cu_seqlens_k = cu_seqlens_q if self.offsets_k is self.offsets_q else cu_seqlens_k.to(self.device)
        self.cu_seqlens_q, self.cu_seqlens_k = cu_seqlens_q, cu_seqlens_k
        self.total_q, self.total_k = self.offsets_q[-1], self.offsets_k[-1]
        self.max_seqlen_q = max(b - a for a, b in zip(self.offsets_q, self.offsets_q[1:]))
        self.max_seqlen_k = max(b - a for a, b in zip(self.offsets_k, self.offsets_k[1:]))
        pad = lambda offs: [0] + torch.cumsum(torch.tensor([-(-(b - a) // PAD_ALIGN) * PAD_ALIGN for a, b in
                                                            zip(offs, offs[1:])]), 0).tolist()
        self.pad_q, self.pad_k = pad(self.offsets_q), pad(self.offsets_k)
        self.padded_q = padded_tokens(self.total_q, len(self.offsets_q) - 1)
        self.padded_k = padded_tokens(self.total_k, len(self.offsets_k) - 1)
        lens = [(b - a, d - c) for a, b, c, d in zip(self.offsets_q, self.offsets_q[1:], self.offsets_k, self.offsets_k[1:])]
        # Rows that see no key at all (bottom-right causal with Lq > Lk, or an empty key document):
        # their tiles are never launched, so their outputs must start as 0 (and their LSE as -inf).
        self.rows_without_keys = {True: any(lq > lk for lq, lk in lens), False: any(lk == 0 < lq for lq, lk in lens)}
        self.keys_without_rows = any(lq == 0 < lk for lq, lk in lens)  # their dK, dV must start as 0
        # Every document's causal shift Lk - Lq is a multiple of this (0: all shifts are 0, the training
        # case). The per-tile safeguard needs query tiles that lie inside one key block (_tile_safeguard).
        self.shift_gcd = math.gcd(*(lk - lq for lq, lk in lens))
        self._tables = {}

    @classmethod
    def dense(cls, batch: int, seqlen_q: int, seqlen_k: int, device) -> "Plan":
        """Plan for (B, S, H, D) inputs: B equal documents, built without any host sync."""
        cu = lambda s: torch.arange(0, (batch + 1) * s, s, dtype=torch.int32)
        return cls(cu(seqlen_q), cu(seqlen_k), device=device)  # host offsets: no sync

    def tiles(self, block: int, side: str, causal: bool = True, skip_masked: bool = True) -> torch.Tensor:
        """(n_tiles, 8) int32 tile table (columns TILE_START..OWN_PAD) of `block`-token tiles of the
        `side` ("q" or "k") documents, heaviest work first, on the plan's device (cached).
        skip_masked=False keeps tiles without any unmasked pair (the quantizer must see every token)."""
        key = (block, side, causal, skip_masked)
        if key not in self._tables:
            own, other = (self.offsets_q, self.offsets_k) if side == "q" else (self.offsets_k, self.offsets_q)
            own_pad, other_pad = (self.pad_q, self.pad_k) if side == "q" else (self.pad_k, self.pad_q)
            rows, costs = [], []
            for d in range(len(own) - 1):
                o0, o1, t0, t1 = own[d], own[d + 1], other[d], other[d + 1]
                lq, lk = (o1 - o0, t1 - t0) if side == "q" else (t1 - t0, o1 - o0)
                shift = lk - lq  # bottom-right causal alignment: key pos <= query pos + shift
                for s in range(o0, o1, block):
                    e = min(s + block, o1)
                    if not causal or not skip_masked:
                        cost = t1 - t0
                    elif side == "q":  # keys visible to the tile's last row
                        cost = min(lk, max(0, e - o0 + shift))
                    else:  # queries that see the tile's first key (query pos >= key pos - shift)
                        cost = min(lq, max(0, lq - max(0, s - o0 - shift)))
                    if cost == 0 and skip_masked:
                        continue  # fully masked tile: never launched (outputs of such rows are set to 0)
                    rows.append((s, e, o0, o1, t0, t1, other_pad[d], own_pad[d]))
                    costs.append(cost)
            order = sorted(range(len(rows)), key=lambda i: -costs[i])  # LPT: heaviest first
            table = torch.tensor([rows[i] for i in order], dtype=torch.int32).view(-1, 8)
            self._tables[key] = table.to(self.device)
        return self._tables[key]


def padded_tokens(total: int, n_docs: int) -> int:
    """Token length of a token-transposed layout (H, D, T_padded). Each document starts at a multiple of
    PAD_ALIGN, which takes at most PAD_ALIGN - 1 extra positions per document; the length is this bound
    (the tail past the last document is never read), so that shapes do not depend on the cu_seqlens'
    values: the custom op's fake implementation must know them without reading cu_seqlens. Rounded up
    to 128 tokens (128 bytes of E4M3) so that every channel row starts on a 128-byte cache line: with
    the bound alone (16,400 for one 16k document) a 128-key V tile's rows straddle lines, and the H200
    forward measured 493 / 549 TFLOP/s (B_t=1 / 128) against 518-535 / 599-605 rounded to 128..2048
    tokens and 528-530 / 601-614 at the exact 16,384 (README, "Results")."""
    return max(-(-(total + (PAD_ALIGN - 1) * n_docs) // 128) * 128, 128)


def token_block_start(cu_seqlens: torch.Tensor, total: int, block_tokens: int) -> torch.Tensor:
    """(T,) int64: the index of the first token of each token's scale block (document-local)."""
    t = torch.arange(total, device=cu_seqlens.device)
    cu = cu_seqlens.long()
    doc = torch.searchsorted(cu, t, right=True) - 1  # the document of each token (skips empty ones)
    start = cu[doc]
    return start + (t - start) // block_tokens * block_tokens


# ---------------------------------------------------------------------------------------------
# 3. Quantizers: PyTorch reference and the fused Triton kernel (bit-identical)
# ---------------------------------------------------------------------------------------------
# quantize(x) for x of shape (T, H, D), block size B_t:
#     amax[t, h]  = max_d |x[t, h, d]|                        (per token)
#     amax_b      = max over the B_t-token block of t          (document-local)
#     e[h, t]     = scale rule(amax_b)                         (E8M0 byte, one copy per token)
#     data[t,h,:] = E4M3(x[t, h, :] / 2^(e - 127))             (exact power-of-two division, RNE)
# The same quantized tensor serves both matrix orientations: along the head dim its scale is
# constant (a rank-1 post-scale of QK^T or dO V^T), along tokens it changes only every B_t tokens
# (B_t = 32 is exactly an MX block along the contraction of P V, dS K, ...). Hopper's fp8 wgmma
# wants its second operand K-major, so the Triton quantizer also writes a token-transposed copy
# (H, D, T_padded) in the same pass when asked (each document starts at a 16-token boundary).
class MXFP8(tuple):
    """A quantized (T, H, D) tensor: data (T, H, D) float8_e4m3fn, exp (H, T) uint8 E8M0,
    data_t (H, D, T_padded) float8_e4m3fn or None (token-transposed, documents 16-aligned)."""
    __slots__ = ()

    def __new__(cls, data, exp, data_t=None):
        return super().__new__(cls, (data, exp, data_t))

    data, exp, data_t = property(lambda s: s[0]), property(lambda s: s[1]), property(lambda s: s[2])

    def dequantize(self) -> torch.Tensor:
        return self.data.float() * e8m0_to_float(self.exp).t()[..., None]


def quantize_mxfp8_reference(x: torch.Tensor, cu_seqlens: torch.Tensor, block_tokens: int = 1) -> MXFP8:
    """The PyTorch definition of the quantizer (no transposed copy)."""
    _check_thd(x, "x")
    _check_block_tokens(block_tokens)
    _check_cu_seqlens(cu_seqlens, x.shape[0], "cu_seqlens", x.device)
    T, H, D = x.shape
    amax = x.float().abs().amax(-1)  # (T, H); NaN propagates, so a NaN token gets e = 0xFF
    if block_tokens > 1:
        start = token_block_start(cu_seqlens, T, block_tokens)
        idx = start[:, None].expand(T, H)
        amax = torch.zeros_like(amax).scatter_reduce(0, idx, amax, "amax", include_self=False).gather(0, idx)
    e = e8m0_exponent(amax)  # (T, H)
    inv = torch.ldexp(torch.ones_like(amax), 127 - e.int().clamp(max=253))  # 1/s, exact; NaN blocks overwritten
    data = e4m3_encode(x.float() * inv[..., None], e[..., None])
    return MXFP8(data, e.t().contiguous())


def transpose_tokens_reference(data: torch.Tensor, offsets: list) -> torch.Tensor:
    """(T, H, D) -> (H, D, T_padded) with every document starting at a multiple of 16 tokens: the layout
    the Triton quantizer writes, up to the end of the last document's padding (padding is zero; the
    quantizer's copy is padded_tokens() long, its tail after that is never written or read)."""
    T, H, D = data.shape
    lens = [b - a for a, b in zip(offsets, offsets[1:])]
    padded = [-(-n // PAD_ALIGN) * PAD_ALIGN for n in lens]
    out = torch.zeros(H, D, sum(padded), dtype=data.dtype, device=data.device)
    p = 0
    for a, n, pn in zip(offsets, lens, padded):
        out[:, :, p:p + n] = data[a:a + n].permute(1, 2, 0)
        p += pn
    return out


@triton.jit
def _scale_exponent(amax, SHIFT: tl.constexpr = 8, MANT: tl.constexpr = 0x600000):
    """The scale rule on fp32 bits (see e8m0_exponent; defaults: E4M3, (2, 0x400000): E2M1): returns the
    E8M0 byte as int32."""
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
def _e4m3_code(v):
    """The E4M3 byte (as int32) of fp32 v, |v| <= 448 or NaN, rounded to nearest even, by integer
    arithmetic on the fp32 bits: the interpreter's twin of _e4m3_word's PTX (see there)."""
    bits = v.to(tl.int32, bitcast=True)
    a = tl.minimum(bits & 0x7FFFFFFF, 0x43E00000)  # |v|, saturated at 448 (E4M3's largest normal)
    # normal range (|v| >= 2^-6): keep the exponent and 3 mantissa bits, RNE; a carry moves into the exponent
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - ((127 - 7) << 3)
    # subnormal range: |v| in multiples of 2^-9, RNE: the 24-bit significand shifted right by 141 - exponent
    shift = tl.minimum(tl.maximum(141 - (a >> 23), 1), 31)
    full = (a & 0x7FFFFF) | 0x800000
    sub = (full + (1 << (shift - 1)) - 1 + ((full >> shift) & 1)) >> shift
    code = tl.where(a >= 0x3C800000, normal, sub)  # 0x3C800000 = 2^-6
    code = tl.where((bits & 0x7FFFFFFF) > 0x7F800000, 0x7F, code)  # NaN
    return code | ((bits >> 24) & 0x80)  # sign


@triton.jit
def _e4m3_word(v0, v1, v2, v3, PTX_CVT: tl.constexpr):
    """The E4M3 bytes of four fp32 tensors (|v| <= 448 or NaN, RNE) packed into one little-endian int32,
    v0 in the low byte. Where the bytes feed two stores (the data and its token-transposed copy) Triton's
    own `.to(tl.float8e4nv)` miscompiled with Triton 3.6 (ptxas 12.8 / 12.9) on the H200: foreign bytes
    (0x60, 0xFC) in whole channel rows, as in triton-lang/triton#11111 (README, "Quantizer"). On the GPU
    the word therefore comes from the PTX instruction itself, two cvt.rn.satfinite.e4m3x2.f32 and a mov
    in registers (bit-exact, and 1.5x faster than the integer encoder); the interpreter, which runs no
    PTX, uses the integer encoder _e4m3_code (tested bit-identical to torch's cast)."""
    if PTX_CVT:
        return tl.inline_asm_elementwise(
            "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1; cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3; "
            "mov.b32 $0, {lo, hi}; }", "=r,f,f,f,f", [v0, v1, v2, v3], dtype=tl.int32, is_pure=True, pack=1)
    return _e4m3_code(v0) | (_e4m3_code(v1) << 8) | (_e4m3_code(v2) << 16) | (_e4m3_code(v3) << 24)


@triton.jit
def _quantize_rows(x, amax, offs_t, in_doc, h, Y, E, T, H: tl.constexpr, D: tl.constexpr, WRITE_T: tl.constexpr):
    """Quantizes rows x (tokens offs_t of head h) with their amax: stores the E8M0 bytes and, unless
    WRITE_T (then _quantize_store stores them), the E4M3 data. Returns x / s in fp32."""
    e = _scale_exponent(amax)
    inv = _exp2_int(254 - tl.minimum(e, 253))  # 1/s = 2^(127 - e), exact
    v = tl.where(e[:, None] == 255, float("nan"), x * inv[:, None])
    tl.store(E + h * T + offs_t, e.to(tl.uint8), mask=in_doc)
    if not WRITE_T:  # one store: Triton's cast (RNE, saturating) is right here
        tl.store(Y + (offs_t[:, None] * H + h) * D + tl.arange(0, D)[None, :], v.to(tl.float8e4nv),
                 mask=in_doc[:, None])
    return v


@triton.jit
def _quantize_store(x0, x1, x2, x3, a0, a1, a2, a3, offs_t, end, h, p0, doc_pad_end, Y, E, YT, T, T_PAD,
                    H: tl.constexpr, D: tl.constexpr, WRITE_T: tl.constexpr, WRITE_ROWS: tl.constexpr,
                    PTX_CVT: tl.constexpr):
    """Quantizes and stores the four token phases of a tile (rows offs_t + j of x_j, amax a_j)."""
    v0 = _quantize_rows(x0, a0, offs_t, offs_t < end, h, Y, E, T, H, D, WRITE_T)
    v1 = _quantize_rows(x1, a1, offs_t + 1, offs_t + 1 < end, h, Y, E, T, H, D, WRITE_T)
    v2 = _quantize_rows(x2, a2, offs_t + 2, offs_t + 2 < end, h, Y, E, T, H, D, WRITE_T)
    v3 = _quantize_rows(x3, a3, offs_t + 3, offs_t + 3 < end, h, Y, E, T, H, D, WRITE_T)
    if WRITE_T:  # tokens 4i..4i+3 of channel d, first in the low byte: one little-endian int32 per (i, d),
        w = _e4m3_word(v0, v1, v2, v3, PTX_CVT)  # built in registers, elementwise
        if WRITE_ROWS:  # row-major data: byte j of w is token 4i + j
            Y8 = Y.to(tl.pointer_type(tl.uint8), bitcast=True)
            offs = (offs_t[:, None] * H + h) * D + tl.arange(0, D)[None, :]
            for j in tl.static_range(4):
                tl.store(Y8 + offs + j * H * D, ((w >> (8 * j)) & 0xFF).to(tl.uint8), mask=(offs_t + j < end)[:, None])
        # Over the document's whole padded range, zeros past its end: the padding is defined data, so the
        # attention kernels may load it with 16-byte async copies. p0 and doc_pad_end are multiples of 16.
        offs_w = p0 // 4 + tl.arange(0, offs_t.shape[0])
        YT32 = YT.to(tl.pointer_type(tl.int32), bitcast=True)
        tl.store(YT32 + (h * D + tl.arange(0, D)[None, :]) * (T_PAD // 4) + offs_w[:, None], w,
                 mask=(offs_w < doc_pad_end // 4)[:, None])


@triton.jit
def _load_quant_tile(X, TILES, stride_xt, stride_xh, D: tl.constexpr, ROWS: tl.constexpr, PHASE: tl.constexpr = 0,
                     STEP: tl.constexpr = 1):
    """Rows PHASE, PHASE + STEP, ... of a quantizer program's tile (tokens of one document), fp32. Also
    returns which rows hold a non-finite value (detected explicitly: the saturating E4M3 cast would
    turn inf into 448)."""
    tile, h = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(TILES + tile * 8 + TILE_START), tl.load(TILES + tile * 8 + TILE_END)
    offs_t = start + tl.arange(0, ROWS) * STEP + PHASE
    x = tl.load(X + offs_t[:, None] * stride_xt + h * stride_xh + tl.arange(0, D)[None, :],
                mask=(offs_t < end)[:, None], other=0.0).to(tl.float32)
    bad = tl.max(((x != x) | (tl.abs(x) == float("inf"))).to(tl.int32), axis=1)
    return x, offs_t, end, bad, h


@triton.jit
def _row_amax(x, bad):
    # Non-finite input: make amax +inf so the scale becomes NaN (tl.max may drop a NaN).
    return tl.where(bad != 0, float("inf"), tl.max(tl.abs(x), axis=1))


@triton.jit
def _quantize_kernel(
        X, TILES, FLAG,  # input (T, H, D), the Plan's 128-token tiles, int32 non-finite flag
        Y, E, YT, Y_TOK, E_TOK, YT_TOK,  # outputs: data (T, H, D), exp (H, T), data_t (H, D, T_pad); *_TOK per token
        stride_xt, stride_xh, T, T_PAD,  # strides of X (last dim contiguous); token counts
        H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
        WRITE_T: tl.constexpr, WRITE_ROWS: tl.constexpr, WRITE_TOK: tl.constexpr, PTX_CVT: tl.constexpr):
    # The tile is read as four token phases, x_j = rows 4i + j, all in one register layout. The
    # token-transposed copy then packs four tokens of a channel into an int32 with shifts, elementwise,
    # and stores 32-bit words, consecutive across a warp (128 contiguous bytes per store). Storing the
    # (BLOCK_T, D) fp8 tile transposed instead lets Triton shuffle bytes between threads: 19% of copy
    # bandwidth with byte stores (measured on the H200; 16-byte ones hit the cast bug of _e4m3_word).
    Q: tl.constexpr = BLOCK_T // 4
    x0, offs_t, end, bad0, h = _load_quant_tile(X, TILES, stride_xt, stride_xh, D, Q, 0, 4)
    x1, _, _, bad1, _ = _load_quant_tile(X, TILES, stride_xt, stride_xh, D, Q, 1, 4)
    x2, _, _, bad2, _ = _load_quant_tile(X, TILES, stride_xt, stride_xh, D, Q, 2, 4)
    x3, _, _, bad3, _ = _load_quant_tile(X, TILES, stride_xt, stride_xh, D, Q, 3, 4)
    row = TILES + tl.program_id(0) * 8
    doc_start, doc_pad = tl.load(row + OWN_START), tl.load(row + OWN_PAD)
    doc_pad_end = doc_pad + (tl.load(row + OWN_END) - doc_start + 15) // 16 * 16
    p0 = doc_pad + (tl.load(row + TILE_START) - doc_start)  # the tile's first padded position
    a0, a1, a2, a3 = _row_amax(x0, bad0), _row_amax(x1, bad1), _row_amax(x2, bad2), _row_amax(x3, bad3)
    if WRITE_TOK:  # the per-token copy the causal safeguard uses on the diagonal
        _quantize_store(x0, x1, x2, x3, a0, a1, a2, a3, offs_t, end, h, p0, doc_pad_end, Y_TOK, E_TOK, YT_TOK,
                        T, T_PAD, H, D, WRITE_T, WRITE_ROWS, PTX_CVT)
    if BLOCK_TOKENS > 1:  # the tile starts at a block boundary and holds BLOCK_T // B_t whole blocks
        amax = tl.maximum(tl.maximum(a0, a1), tl.maximum(a2, a3))  # tokens 4i..4i+3
        amax = tl.max(tl.reshape(amax, (BLOCK_T // BLOCK_TOKENS, BLOCK_TOKENS // 4)), axis=1)
        a0 = tl.reshape(tl.broadcast_to(amax[:, None], (BLOCK_T // BLOCK_TOKENS, BLOCK_TOKENS // 4)), (Q,))
        a1, a2, a3 = a0, a0, a0
    _quantize_store(x0, x1, x2, x3, a0, a1, a2, a3, offs_t, end, h, p0, doc_pad_end, Y, E, YT, T, T_PAD, H, D,
                    WRITE_T, WRITE_ROWS, PTX_CVT)
    bad = tl.maximum(tl.maximum(bad0, bad1), tl.maximum(bad2, bad3))
    tl.store(FLAG, 1, mask=tl.max(bad) != 0)  # any non-finite value: the host raises if asked


def quantize_mxfp8(x: torch.Tensor, plan: Plan, block_tokens: int = 1, side: str = "q", transposed: bool = False,
                   per_token_copy: bool = False, nonfinite_flag: torch.Tensor = None, rows: bool = True):
    """Fused Triton quantizer: ONE launch reads x (T, H, D) once and writes the block-scaled data, its
    exponents, the token-transposed copy (transposed=True) and a per-token scaled copy
    (per_token_copy=True, for the causal safeguard). rows=False (with transposed=True) skips the
    row-major data, leaving data None: MXFP8's forward reads V only token-transposed. `side` says whose
    documents x follows in `plan` ("q" or "k"). nonfinite_flag: optional int32 (1,) tensor set to 1 if x
    holds inf/NaN (no host sync here). Returns an MXFP8, or (block MXFP8, per-token MXFP8) with
    per_token_copy."""
    _check_thd(x, "x")
    _check_block_tokens(block_tokens)
    T, H, D = x.shape
    total = plan.total_q if side == "q" else plan.total_k
    if T != total:
        raise ValueError(f"x has {T} tokens but the plan's cu_seqlens_{side} ends at {total}")
    if x.device != plan.device:
        raise ValueError(f"x is on {x.device} but the plan is on {plan.device}")
    if not (rows or transposed):
        raise ValueError("quantize_mxfp8: rows=False needs transposed=True (some data layout must be written)")
    x = x if x.stride(-1) == 1 else x.contiguous()
    t_pad = plan.padded_q if side == "q" else plan.padded_k

    def alloc():
        return MXFP8(torch.empty(T, H, D, dtype=torch.float8_e4m3fn, device=x.device) if rows else None,
                     torch.empty(H, T, dtype=torch.uint8, device=x.device),
                     torch.empty(H, D, t_pad, dtype=torch.float8_e4m3fn, device=x.device) if transposed else None)
    out = alloc()
    tok = alloc() if per_token_copy else out
    flag = nonfinite_flag if nonfinite_flag is not None else torch.zeros(1, dtype=torch.int32, device=x.device)
    tiles = plan.tiles(QUANT_TILE, side, causal=False, skip_masked=False)
    if tiles.shape[0] > 0:
        ptr = lambda *a: next(t for t in a if t is not None)  # a layout not written: any tensor (never touched)
        _quantize_kernel[(tiles.shape[0], H)](
            x, tiles, flag, ptr(out.data, out.data_t), out.exp, ptr(out.data_t, out.data), ptr(tok.data, tok.data_t),
            tok.exp, ptr(tok.data_t, tok.data), x.stride(0), x.stride(1), T, t_pad, H=H, D=D, BLOCK_T=QUANT_TILE,
            BLOCK_TOKENS=block_tokens, WRITE_T=transposed, WRITE_ROWS=rows, WRITE_TOK=per_token_copy,
            PTX_CVT=os.environ.get("TRITON_INTERPRET") != "1",
            num_warps=8)  # 4 spill with the per-token copy; 8 measured 1.1-2x faster (H200; README, "Quantizer")
    return (out, tok) if per_token_copy else out


@triton.jit
def _e2m1_code(a):
    """Round-to-nearest-even onto the E2M1 grid, as e2m1_encode: the code is the number of boundaries passed."""
    m = tl.abs(a)
    k = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32) + (m >= 1.75).to(tl.int32)
         + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32))
    return k + 8 * (a < 0).to(tl.int32)


@triton.jit
def _quantize_fp4_kernel(
        X, TILES, FLAG, P, SB, S2, stride_xt, stride_xh, T,
        H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, MX: tl.constexpr):
    """NVFP4 (MX=False) or MXFP4 in one pass, bit-identical to quantize_nvfp4_reference /
    quantize_mxfp4_reference (IEEE-rounded divisions, like torch)."""
    x, offs_t, end, bad, h = _load_quant_tile(X, TILES, stride_xt, stride_xh, D, BLOCK_T)
    in_doc = offs_t < end
    if MX:  # E8M0 per 32 elements; the second level is 1
        NB: tl.constexpr = D // 32
        xb = tl.reshape(x, (BLOCK_T, NB, 32))
        bad_b = tl.max(((xb != xb) | (tl.abs(xb) == float("inf"))).to(tl.int32), axis=2)
        e = _scale_exponent(tl.where(bad_b != 0, float("inf"), tl.max(tl.abs(xb), axis=2)), 2, 0x400000)
        inv = _exp2_int(254 - tl.minimum(e, 253))  # 1/s = 2^(127 - e), exact
        code = tl.where((e == 255)[:, :, None], 0, _e2m1_code(xb * inv[:, :, None]))  # as x / NaN in torch
        sb = e.to(tl.uint8)
        s2 = tl.full((BLOCK_T,), 1.0, tl.float32)
    else:  # E4M3 per 16 elements, relative to a per-token FP32 second level
        NB: tl.constexpr = D // 16
        s2 = tl.math.div_rn(tl.max(tl.abs(x), axis=1), 2688.0)  # 448 * 6: the block scale then fits E4M3
        s2 = tl.where(bad != 0, float("nan"), tl.where(s2 > 0, s2, 1.0))
        xb = tl.reshape(x, (BLOCK_T, NB, 16))
        sb = tl.math.div_rn(tl.math.div_rn(tl.max(tl.abs(xb), axis=2), 6.0), s2[:, None])
        sb = tl.minimum(sb, 448.0).to(tl.float8e4nv)
        denom = sb.to(tl.float32) * s2[:, None]
        denom = tl.where(denom > 0, denom, 1.0)
        code = _e2m1_code(tl.math.div_rn(xb, denom[:, :, None]))
    lo, hi = tl.split(tl.reshape(code, (BLOCK_T, D // 2, 2)))  # first element of each pair in the low nibble
    offs_p = tl.arange(0, D // 2)
    tl.store(P + (offs_t[:, None] * H + h) * (D // 2) + offs_p[None, :], (lo | (hi << 4)).to(tl.uint8),
             mask=in_doc[:, None])
    offs_b = tl.arange(0, NB)
    tl.store(SB + (offs_t[:, None] * H + h) * NB + offs_b[None, :], sb, mask=in_doc[:, None])
    tl.store(S2 + h * T + offs_t, s2, mask=in_doc)
    tl.store(FLAG, 1, mask=tl.max(bad) != 0)


class NVFP4(tuple):
    """A quantized (T, H, D) tensor: packed E2M1 (T, H, D/2) uint8, block scales (T, H, D/16)
    float8_e4m3fn, per-token second-level scales (H, T) fp32. MXFP4 uses the same container with
    (T, H, D/32) uint8 E8M0 block scales and a second level of ones."""
    __slots__ = ()

    def __new__(cls, packed, sb, s2):
        return super().__new__(cls, (packed, sb, s2))

    packed, sb, s2 = property(lambda s: s[0]), property(lambda s: s[1]), property(lambda s: s[2])

    def dequantize(self) -> torch.Tensor:
        return dequantize_nvfp4(self.packed, self.sb, self.s2.t())


def quantize_nvfp4(x: torch.Tensor, plan: Plan, side: str = "q", nonfinite_flag: torch.Tensor = None,
                   mx: bool = False) -> NVFP4:
    """Fused Triton FP4 quantizer: one launch, x (T, H, D) read once. NVFP4, or MXFP4 with mx=True (see
    quantize_nvfp4_reference / quantize_mxfp4_reference)."""
    _check_thd(x, "x")
    T, H, D = x.shape
    if T != (plan.total_q if side == "q" else plan.total_k):
        raise ValueError(f"x has {T} tokens but the plan's cu_seqlens_{side} does not end there")
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = NVFP4(torch.empty(T, H, D // 2, dtype=torch.uint8, device=x.device),
                torch.empty(T, H, D // MXFP4_BLOCK, dtype=torch.uint8, device=x.device) if mx else
                torch.empty(T, H, D // NVFP4_BLOCK, dtype=torch.float8_e4m3fn, device=x.device),
                torch.empty(H, T, dtype=torch.float32, device=x.device))
    flag = nonfinite_flag if nonfinite_flag is not None else torch.zeros(1, dtype=torch.int32, device=x.device)
    tiles = plan.tiles(QUANT_TILE, side, causal=False, skip_masked=False)
    if tiles.shape[0] > 0:
        _quantize_fp4_kernel[(tiles.shape[0], H)](x, tiles, flag, *out, x.stride(0), x.stride(1), T, H=H, D=D,
                                                   BLOCK_T=QUANT_TILE, MX=mx, num_warps=4)
    return out


# Q/K rotation ("incoherence processing", as FlashAttention-3 does for FP8), rotate_qk=True.
# S = Q K^T does not change when Q and K are both multiplied by one orthogonal matrix, but their
# quantization error does: a head-dim channel with outliers (RoPE'd queries and keys have some)
# sets the scale of its whole block and pushes the other channels toward E4M3's / E2M1's bottom.
# A Hadamard matrix with random column signs spreads every channel over all D, so a block's amax
# comes close to its RMS. We multiply by the UNNORMALIZED +-1 matrix (exact in bf16; 1/sqrt(128)
# is not) and divide the softmax scale by D (a power of two: exact): S' = (Q H)(K H)^T = D Q K^T.
# It is per token, along the head dim only: no statistic crosses tokens, so it cannot leak.
# Measured: 2-2.6x less error on synthetic outlier channels, nothing on Gaussian data, and a WORSE
# loss in train_llama's runs on the H200 (README), so it is off by default: a knob for studies.
_HADAMARD = {}


def qk_rotation(head_dim: int, device=None) -> torch.Tensor:
    """The (D, D) +-1 matrix H diag(signs), H H^T = D I (Sylvester Hadamard, fixed random signs)."""
    if head_dim & (head_dim - 1):
        raise ValueError(f"rotate_qk needs a power-of-two head_dim, got {head_dim}")
    key = (head_dim, str(device))
    if key not in _HADAMARD:
        h = torch.ones(1, 1)
        while h.shape[0] < head_dim:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
        signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(0)) * 2 - 1
        _HADAMARD[key] = (h * signs).to(device)
    return _HADAMARD[key]


def _rotate_qk(q, k, softmax_scale):
    h = qk_rotation(q.shape[-1], q.device)
    return q @ h.to(q.dtype), k @ h.to(k.dtype), softmax_scale / q.shape[-1]


# ---------------------------------------------------------------------------------------------
# 4. The reference oracle
# ---------------------------------------------------------------------------------------------
# reference_attention() is THE definition of what a recipe computes: quantize with the recipe's
# scaling, dequantize, then exact attention with per-document (causal) masking. The kernels are
# tested against it; train_llama.py uses it as the CPU path. Quantizers are straight-through
# (identity gradient), so autograd through it gives the gradients the kernels must reproduce.
RECIPES = ("bf16", "mxfp8", "nvfp4", "mxfp4")
FP4_RECIPES = ("nvfp4", "mxfp4")  # K in FP4 (E2M1); Q, V and dO in MXFP8 (README: "The FP4 split")
DOT_SCALED_RECIPES = ("mxfp8", "mxfp4")  # E8M0-scaled operands: what tl.dot_scaled takes


def _k_fp4(recipe: str) -> int:
    """The kernels' K_FP4 constexpr: 0 (K in bf16 or E4M3), 1 (NVFP4), 2 (MXFP4)."""
    return FP4_RECIPES.index(recipe) + 1 if recipe in FP4_RECIPES else 0


def _fake_quant(x: torch.Tensor, cu_seqlens: torch.Tensor, block_tokens: int) -> torch.Tensor:
    deq = quantize_mxfp8_reference(x.detach(), cu_seqlens, block_tokens).dequantize()  # fp32, exact
    return x.float() + (deq - x.float()).detach()  # straight-through estimator


def _fake_quant_fp4(x: torch.Tensor, recipe: str) -> torch.Tensor:
    quantize = quantize_nvfp4_reference if recipe == "nvfp4" else quantize_mxfp4_reference
    deq = dequantize_nvfp4(*quantize(x.detach()))  # fp32: the FP32 second level is not bf16
    return x.float() + (deq - x.float()).detach()


def _doc_positions(cu_seqlens: torch.Tensor, total: int):
    """(T,) document index and document start of every token."""
    t = torch.arange(total, device=cu_seqlens.device)
    doc = torch.searchsorted(cu_seqlens.long(), t, right=True) - 1
    return doc, cu_seqlens.long()[doc]


def reference_attention(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, causal=True, softmax_scale=None,
                        recipe="mxfp8", block_tokens=1, safeguard=True, rotate_qk=False, return_lse=False):
    """q (Tq, H, D), k and v (Tk, Hk, D) packed documents -> o (Tq, H, D) [, lse (H, Tq) natural log].

    Computes in fp32 (fp64 if q is fp64) on the recipe's dequantized operands:
      recipe="bf16":  the inputs as they are.
      recipe="nvfp4": K in NVFP4 (per token and head; never straddles), Q and V as in mxfp8.
      recipe="mxfp4": the same with K in MXFP4 (E8M0 scales per 32 elements).
      recipe="mxfp8": Q per token, K and V per `block_tokens` block of one document (E4M3 + E8M0);
                      with the safeguard, a (query i, key j) pair whose key block also holds the
                      position of i uses per-token quantized k_j, v_j instead (no future token can
                      then reach i through a shared scale). safeguard=False is the leaky setting.
    rotate_qk: first multiply Q and K by qk_rotation (S unchanged in exact arithmetic; see above).
    Causal alignment is bottom-right within each document. Rows without any visible key give 0.
    """
    cu_seqlens_k = cu_seqlens_q if cu_seqlens_k is None else cu_seqlens_k
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    _check_block_tokens(block_tokens)
    Tq, H, D = q.shape
    Tk, Hk = k.shape[:2]
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    if rotate_qk:
        q, k, scale = _rotate_qk(q, k, scale)
    k_tok, v_tok = k, v
    if recipe == "mxfp8":
        q = _fake_quant(q, cu_seqlens_q, 1)  # Q is never block-scaled: its scale would leak along rows
        k_tok, k = _fake_quant(k, cu_seqlens_k, 1), _fake_quant(k, cu_seqlens_k, block_tokens)
    elif recipe in FP4_RECIPES:
        q, k = _fake_quant(q, cu_seqlens_q, 1), _fake_quant_fp4(k, recipe)
        k_tok = k
    if recipe != "bf16":
        v_tok, v = _fake_quant(v, cu_seqlens_k, 1), _fake_quant(v, cu_seqlens_k, block_tokens)
    q, k, v, k_tok, v_tok = (x.to(cdt) for x in (q, k, v, k_tok, v_tok))
    if Hk != H:  # GQA / MQA: each K/V head serves H // Hk consecutive query heads
        k, v, k_tok, v_tok = (x.repeat_interleave(H // Hk, dim=1) for x in (k, v, k_tok, v_tok))
    doc_q, start_q = _doc_positions(cu_seqlens_q, Tq)
    doc_k, start_k = _doc_positions(cu_seqlens_k, Tk)
    lens_q, lens_k = cu_seqlens_q.diff().long(), cu_seqlens_k.diff().long()
    # Position of each query on its document's key axis (bottom-right alignment).
    pos_q = (torch.arange(Tq, device=q.device) - start_q + (lens_k - lens_q)[doc_q])[:, None]
    pos_k = (torch.arange(Tk, device=q.device) - start_k)[None, :]
    visible = doc_q[:, None] == doc_k[None, :]
    if causal:
        visible &= pos_k <= pos_q
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    same_block = torch.zeros_like(visible)
    if recipe != "bf16" and safeguard and causal and block_tokens > 1:
        same_block = visible & (pos_k // block_tokens == pos_q // block_tokens)
        s = torch.where(same_block, torch.einsum("ihd,jhd->hij", q, k_tok) * scale, s)
    s = s.masked_fill(~visible, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # (H, Tq)
    p = torch.exp(s - torch.where(lse.isfinite(), lse, 0.0)[..., None])
    o = torch.einsum("hij,jhd->ihd", p.masked_fill(same_block, 0), v)
    o = o + torch.einsum("hij,jhd->ihd", p.masked_fill(~same_block, 0), v_tok)
    return (o, lse) if return_lse else o


def attention_fp64(q, k, v, cu_seqlens_q, cu_seqlens_k=None, *, causal=True, softmax_scale=None):
    """Exact attention in float64 (for error reports): no quantization anywhere."""
    return reference_attention(q.double(), k.double(), v.double(), cu_seqlens_q, cu_seqlens_k, causal=causal,
                               softmax_scale=softmax_scale, recipe="bf16")


# ---------------------------------------------------------------------------------------------
# 5a. Forward kernel
# ---------------------------------------------------------------------------------------------
# One program = one query tile (BLOCK_M rows of one document, from the Plan) x one query head.
# Online softmax over the document's key tiles, in the base-2 domain (s2 = S * log2(e)):
#
#   for each key tile j:           (first the tiles every row sees fully, then the masked ones)
#       s2   = (Qq Kq^T) * sk[j] * (sq[i] * scale * log2 e)   fp8 MMA, rank-1 post-scale
#       m    = max(m, rowmax(s2));  p = exp2(s2 - m);  l = l * alpha + rowsum(p)
#       acc += E4M3(p * 2^(ev[j] - ref_i + 8)) @ Vq^T          fp8 MMA, V's scale folded into P
#
# V's scale varies along the contraction (keys), so it is folded into P before P is quantized:
# exact, since scales are powers of two. To keep p * 2^ev inside E4M3's range, each row carries a
# reference exponent ref_i = max ev over the keys it has seen so far (then p~ <= 2^8 < 448) and the
# accumulator lives in units of 2^(ref_i - 8), rescaled when ref_i grows, like the softmax max m.
# ref_i is a per-row statistic over *visible* keys only (a max over the whole tile would leak the
# future on the diagonal).
#
# The causal safeguard, on masked (diagonal) tiles only: for a pair (i, j) whose key block holds
# the position of i, the block scale of k_j, v_j depends on keys after i, so those pairs use the
# per-token quantized copies KS, VS (a second small MMA on the diagonal tiles). Blocks of earlier
# keys end before i's block starts and are safe. Q is scaled per token, so nothing leaks along rows.
# When B_t is a multiple of every tile size (B_t=128) the choice is the same for a whole tile, and the
# masked tiles read KS, VS instead of K, V: one MMA (TILE_SAFEGUARD, see _tile_safeguard).
@triton.jit
def _load_k(PTR, SB, offs_t, h, HEADS, mask, ROWS: tl.constexpr, D: tl.constexpr, FP4: tl.constexpr):
    """A K tile for the MMAs: the tile as stored (bf16 or E4M3), or for FP4 the E2M1 values times
    their block scales (NVFP4: E4M3 per 16, MXFP4: E8M0 per 32), as bf16. That product has at most 2 + 4
    significant bits, so bf16 holds it exactly and a bf16 MMA is an exact emulation of FP4 (Hopper has
    no FP4 tensor cores)."""
    if FP4:
        NB: tl.constexpr = D // 16 if FP4 == 1 else D // 32
        offs_p = tl.arange(0, D // 2)
        packed = tl.load(PTR + (offs_t[:, None] * HEADS + h) * (D // 2) + offs_p[None, :], mask=mask[:, None],
                         other=0).to(tl.int32)
        code = tl.reshape(tl.join(packed & 15, packed >> 4), (ROWS, D))  # low nibble first
        e = (code >> 1) & 3
        mag = tl.where(e == 0, (code & 1).to(tl.float32) * 0.5,  # subnormal 0 / 0.5; else (2 + m) * 2^(e - 2)
                       (2 + (code & 1)).to(tl.float32) * _exp2_int(e + 125))
        val = tl.where((code & 8) != 0, -mag, mag)
        offs_b = tl.arange(0, NB)
        sb_ptrs = SB + (offs_t[:, None] * HEADS + h) * NB + offs_b[None, :]
        if FP4 == 1:  # E4M3
            sb = tl.load(sb_ptrs, mask=mask[:, None], other=0.0).to(tl.float32)
        else:  # E8M0; a NaN block (0xFF -> inf) has codes 0, and 0 * inf = NaN
            sb = _exp2_int(tl.load(sb_ptrs, mask=mask[:, None], other=0).to(tl.int32))
        tile = tl.reshape(tl.reshape(val, (ROWS, NB, D // NB)) * sb[:, :, None], (ROWS, D)).to(tl.bfloat16)
    else:
        offs_d = tl.arange(0, D)
        tile = tl.load(PTR + (offs_t[:, None] * HEADS + h) * D + offs_d[None, :], mask=mask[:, None], other=0.0)
    return tile


@triton.jit
def _load_fp4_raw(PTR, SB, offs_t, h, HEADS, mask, D: tl.constexpr):
    """An MXFP4 K tile as tl.dot_scaled takes it: packed E2M1 (rows, D/2) and E8M0 scales (rows, D/32)."""
    offs_p = tl.arange(0, D // 2)
    packed = tl.load(PTR + (offs_t[:, None] * HEADS + h) * (D // 2) + offs_p[None, :], mask=mask[:, None], other=0)
    offs_b = tl.arange(0, D // 32)
    e8 = tl.load(SB + (offs_t[:, None] * HEADS + h) * (D // 32) + offs_b[None, :], mask=mask[:, None], other=127)
    return packed, e8


@triton.jit
def _token_scale(SCALE, offs_t, h, T, mask, ROWS: tl.constexpr, QUANT: tl.constexpr, FP4: tl.constexpr):
    """Per-token scale factors of a tile, from the (H, T) scale rows: bf16 recipe: 1; MXFP8: 2^(e - 127)
    from the E8M0 byte; FP4 (K of nvfp4 / mxfp4): the FP32 second-level scale."""
    if FP4:
        scale = tl.load(SCALE + h * T + offs_t, mask=mask, other=1.0)
    elif QUANT:
        scale = _exp2_int(tl.load(SCALE + h * T + offs_t, mask=mask, other=127).to(tl.int32))
    else:
        scale = tl.full((ROWS,), 1.0, tl.float32)
    return scale


@triton.jit
def _key_range(q_start, q_end, qd_start, shift, kd_start, kd_end, BLOCK_N: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
               CAUSAL: tl.constexpr, SAFEGUARD: tl.constexpr):
    """Key tiles of a query tile: [kd_start, kd_start + n_full) are seen in full by every row and hold no
    block that straddles a row's position (no mask, no safeguard); [kd_start + n_full, hi) are masked."""
    kd_len = kd_end - kd_start
    if CAUSAL:
        first = q_start - qd_start + shift  # position of the tile's first row on the key axis
        n_full = tl.maximum(first + 1, 0) // BLOCK_N * BLOCK_N
        if SAFEGUARD:  # the block holding `first` and every later one go through the masked path
            n_full = tl.minimum(n_full, tl.maximum(first, 0) // BLOCK_TOKENS * BLOCK_TOKENS // BLOCK_N * BLOCK_N)
        hi = kd_start + tl.minimum(kd_len, q_end - qd_start + shift)
    else:
        n_full = kd_len // BLOCK_N * BLOCK_N
        hi = kd_end
    return n_full, hi


@triton.jit
def _key_scales(EK, EV, hk, T_K, n0, kd_end, BLOCK_N: tl.constexpr, QUANT: tl.constexpr, K_FP4: tl.constexpr,
                TILE_SCALE: tl.constexpr = False):
    """The scales of the key tile starting at n0: K's (E8M0 byte as int32, or NVFP4's FP32 second level) and
    V's unbiased exponent (-126 past the document, so it never raises the reference exponent). TILE_SCALE:
    the tile lies inside one scale block (B_t a multiple of the tile width), so each is one scalar."""
    offs_n = n0 if TILE_SCALE else n0 + tl.arange(0, BLOCK_N)
    kmask = offs_n < kd_end
    if QUANT:
        if K_FP4:
            ek = tl.load(EK + hk * T_K + offs_n, mask=kmask, other=1.0)
        else:
            ek = tl.load(EK + hk * T_K + offs_n, mask=kmask, other=127).to(tl.int32)
        ev = tl.load(EV + hk * T_K + offs_n, mask=kmask, other=1).to(tl.int32) - 127
    else:
        ek = tl.zeros((BLOCK_N,), tl.int32)
        ev = ek
    return ek, ev


@triton.jit
def _attn_fwd_step(acc, l_i, m_i, ref_i, ek, ev, q, qscale, q_e8, sm_scale_log2, start_n, offs_m, hk,
                   K, KSB, EK, V, EV, KS, EKS, VS, EVS,
                   stride_vh, stride_vd, stride_vt, T_K, HK, kd_start, kd_end, v_base, v_end, qd_start, shift,
                   D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TOKENS: tl.constexpr, CAUSAL: tl.constexpr,
                   MASKED: tl.constexpr, QUANT: tl.constexpr, K_FP4: tl.constexpr, SAFEGUARD: tl.constexpr,
                   DOT_SCALED: tl.constexpr, TILE_SCALE: tl.constexpr = False):
    """One key tile; ek, ev are its scales (_key_scales), loaded one step ahead: Triton software-pipelines
    only the loads that feed a dot, so the step issues the next tile's scale loads first and their
    latency hides behind this tile's MMAs instead of stalling every iteration. TILE_SCALE (unmasked
    tiles inside one MXFP8 scale block): ek, ev are scalars, folded into per-row factors, which saves
    two multiplies per element of S (the column scales of S and of P)."""
    start_n = tl.multiple_of(start_n, BLOCK_N)  # document-local offset of the key tile
    offs_n = kd_start + start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    kmask = offs_n < kd_end
    ek_next, ev_next = _key_scales(EK, EV, hk, T_K, kd_start + start_n + BLOCK_N, kd_end, BLOCK_N, QUANT, K_FP4,
                                   TILE_SCALE)
    # fp8 V^T: the aligned local offset keeps its loads provably 16-byte aligned, and its mask (up to the
    # document's padded end, a multiple of 16 holding zeros) constant over 16 keys, so the masked load
    # is still a pipelined 16-byte async copy; a per-key mask would make it a synchronous byte load.
    offs_v = v_base + start_n + tl.arange(0, BLOCK_N)
    vmask = offs_v < v_end
    v_ptrs = hk * stride_vh + offs_d[None, :] * stride_vd + offs_v[:, None] * stride_vt
    if DOT_SCALED and K_FP4:
        k, k_e8 = _load_fp4_raw(K, KSB, offs_n, hk, HK, kmask, D)
    else:
        k = _load_k(K, KSB, offs_n, hk, HK, kmask, BLOCK_N, D, K_FP4)
    # s holds QK^T with the column (key) scales applied; the row factor qscale (Q's scale * softmax
    # scale * log2 e) is applied inside the exp2's FMA below, and the row max is taken before it:
    # qscale > 0, so max_j(s * qscale) = qscale * max_j(s) exactly (rounding is monotonic).
    if DOT_SCALED and K_FP4:  # Blackwell FP4: E4M3 x E2M1, both with E8M0 block scales, in the tensor core
        s = tl.dot_scaled(q, q_e8, "e4m3", tl.trans(k), k_e8, "e2m1") * ek[None, :]
    elif DOT_SCALED:  # Blackwell: E8M0 scales applied by the tensor core, 32 head-dim elements each
        s = tl.dot_scaled(q, q_e8, "e4m3", tl.trans(k), tl.broadcast_to(ek.to(tl.uint8)[:, None], (BLOCK_N, D // 32)),
                          "e4m3")
    elif K_FP4:
        s = tl.dot(q, tl.trans(k)) * ek[None, :]
    elif TILE_SCALE:  # K's one scale joins the row factor (exact: a power of two)
        s = tl.dot(q, tl.trans(k))
        qscale = qscale * _exp2_int(ek)
    elif QUANT:
        s = tl.dot(q, tl.trans(k)) * _exp2_int(ek)[None, :]
    else:
        s = tl.dot(q, tl.trans(k))
    if MASKED:
        pos_q = offs_m - qd_start + shift  # each row's position on the key axis
        pos_k = offs_n - kd_start
        visible = kmask[None, :]
        if CAUSAL:
            visible = visible & (pos_k[None, :] <= pos_q[:, None])
        if SAFEGUARD:  # pairs whose key block straddles the query position use per-token K, V
            same = visible & ((pos_k // BLOCK_TOKENS)[None, :] == (pos_q // BLOCK_TOKENS)[:, None])
            if not K_FP4:  # FP4 K is per token already: only V needs the per-token copy
                ks = _load_k(KS, KSB, offs_n, hk, HK, kmask, BLOCK_N, D, K_FP4)
                if DOT_SCALED:
                    eks8 = tl.load(EKS + hk * T_K + offs_n, mask=kmask, other=127)
                    s_tok = tl.dot_scaled(q, q_e8, "e4m3", tl.trans(ks), tl.broadcast_to(
                        eks8[:, None], (BLOCK_N, D // 32)), "e4m3")
                else:
                    s_tok = tl.dot(q, tl.trans(ks)) * _token_scale(EKS, offs_n, hk, T_K, kmask, BLOCK_N, QUANT,
                                                                   K_FP4)[None, :]
                s = tl.where(same, s_tok, s)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qscale)
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    alpha = tl.exp2(m_i - m_use)
    if QUANT:
        if MASKED:
            ev2 = tl.where(visible, ev[None, :], -1000)
            if SAFEGUARD:
                evs = tl.load(EVS + hk * T_K + offs_n, mask=kmask, other=1).to(tl.int32) - 127
                ev2 = tl.where(same, evs[None, :], ev2)
            ref_new = tl.maximum(ref_i, tl.max(ev2, 1))
        elif TILE_SCALE:
            ref_new = tl.maximum(ref_i, ev)
        else:  # every row sees every key: one max for the tile
            ref_new = tl.maximum(ref_i, tl.max(ev, 0))
        # p_r = p * 2^(8 - ref): the row part of V's folded scale rides in the exp2's offset for free;
        # the softmax sum takes it back out per row. (p_r can only underflow where p < 2^(ref - 134),
        # i.e. never unless |V| reaches ~2^100.) With TILE_SCALE, V's whole scale rides there too:
        # p8 = p_r * 2^ev straight out of the exp2, and the sum divides 2^ev back out. A tile more than
        # 2^64 below the reference (e.g. all-zero V, ev = -126) would underflow p8 and lose its keys from
        # the sum: it uses ev_eff = ref - 64 instead, where p8 < 2^-56 rounds to E4M3 zero either way,
        # so the MMA is unchanged and the sum stays exact.
        if TILE_SCALE:
            ev_eff = tl.maximum(ref_new - 64, ev)
            p8 = tl.exp2(s * qscale[:, None] - (m_use + (ref_new - 8 - ev_eff).to(tl.float32))[:, None])
            l_i = l_i * alpha + tl.sum(p8, 1) * _exp2_int(127 - ev_eff) * _exp2_int(ref_new + 119)
        else:
            p_r = tl.exp2(s * qscale[:, None] - (m_use + (ref_new - 8).to(tl.float32))[:, None])
            l_i = l_i * alpha + tl.sum(p_r, 1) * _exp2_int(ref_new + 119)  # 2^(ref - 8)
        # one exp2 per row rescales for both the new softmax max and the new reference exponent
        acc = acc * tl.exp2((m_i - m_use) + (ref_i - ref_new).to(tl.float32))[:, None]
        if MASKED:
            v = tl.load(V + v_ptrs, mask=vmask[:, None], other=0.0)
        else:
            v = tl.load(V + v_ptrs)
        if TILE_SCALE:
            acc = tl.dot(p8.to(tl.float8e4nv), v, acc)
        elif SAFEGUARD:
            p8 = tl.where(same, 0.0, p_r * _exp2_int(ev + 127)[None, :]).to(tl.float8e4nv)
            acc = tl.dot(p8, v, acc)
            vs = tl.load(VS + v_ptrs, mask=vmask[:, None], other=0.0)
            p8 = tl.where(same, p_r * _exp2_int(evs + 127)[None, :], 0.0).to(tl.float8e4nv)
            acc = tl.dot(p8, vs, acc)
        else:  # p~ = p * 2^(ev - ref + 8) <= 2^8: inside E4M3's range, no saturation
            acc = tl.dot((p_r * _exp2_int(ev + 127)[None, :]).to(tl.float8e4nv), v, acc)
        ref_i = ref_new
    else:
        p = tl.exp2(s * qscale[:, None] - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if MASKED:
            v = tl.load(V + v_ptrs, mask=vmask[:, None], other=0.0)
        else:
            v = tl.load(V + v_ptrs)
        acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new, ref_i, ek_next, ev_next


@triton.jit
def _attn_fwd(
        Q, EQ, K, EK, V, EV, KS, EKS, VS, EVS,  # operands: data and (H, T) E8M0 exponents; *S = per-token copies
        KSB,  # FP4 K: its block scales (E4M3 or E8M0; then EK holds the FP32 second-level scales)
        O, LSE, TILES,  # outputs (Tq, H, D) and (H, Tq) natural-log LSE; the Plan's query tiles
        stride_vh, stride_vd, stride_vt,  # V's layout: token-transposed (H, D, T_pad) for fp8, else (T, H, D)
        sm_scale_log2, T_Q, T_K, H, HK,  # softmax scale * log2(e); token and head counts
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED_N: tl.constexpr,
        BLOCK_TOKENS: tl.constexpr, CAUSAL: tl.constexpr, QUANT: tl.constexpr, K_FP4: tl.constexpr,
        SAFEGUARD: tl.constexpr, TILE_SAFEGUARD: tl.constexpr, DOT_SCALED: tl.constexpr):
    tile, h = tl.program_id(0), tl.program_id(1)
    hk = h // (H // HK)  # GQA: consecutive query heads share a K/V head
    row = TILES + tile * 8
    q_start, q_end = tl.load(row + TILE_START), tl.load(row + TILE_END)
    qd_start, qd_end = tl.load(row + OWN_START), tl.load(row + OWN_END)
    kd_start, kd_end = tl.load(row + OTHER_START), tl.load(row + OTHER_END)
    # fp8: V is read from the token-transposed copy, where the document starts at OTHER_PAD.
    v_base = tl.multiple_of(tl.load(row + OTHER_PAD), 16) if QUANT else kd_start
    v_end = tl.multiple_of(v_base + (kd_end - kd_start + 15) // 16 * 16, 16) if QUANT else kd_end
    shift = (kd_end - kd_start) - (qd_end - qd_start)  # bottom-right causal alignment (0 when self-attention)
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    qmask = offs_m < q_end
    q = tl.load(Q + (offs_m[:, None] * H + h) * D + offs_d[None, :], mask=qmask[:, None], other=0.0)
    if K_FP4 and not DOT_SCALED:  # the emulated FP4 K is bf16: E4M3 -> bf16 is exact
        q = q.to(tl.bfloat16)
    q_e8 = q  # unused unless DOT_SCALED
    qscale = _token_scale(EQ, offs_m, h, T_Q, qmask, BLOCK_M, QUANT, False) * sm_scale_log2  # S's row factor
    if DOT_SCALED:  # the tensor core applies Q's scale; the row factor is the softmax scale alone
        q_e8 = tl.broadcast_to(tl.load(EQ + h * T_Q + offs_m, mask=qmask, other=127)[:, None], (BLOCK_M, D // 32))
        qscale = tl.full((BLOCK_M,), sm_scale_log2, tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    ref_i = tl.full((BLOCK_M,), -100, tl.int32)  # V reference exponent; >= -100 keeps 2^(8 - ref) finite
    acc = tl.zeros((BLOCK_M, D), tl.float32)
    n_full, hi = _key_range(q_start, q_end, qd_start, shift, kd_start, kd_end, BLOCK_N, BLOCK_TOKENS, CAUSAL,
                            SAFEGUARD)
    # Unmasked key tiles lie inside one scale block when B_t is a multiple of BLOCK_N (both are aligned
    # to the document start): then their scales are scalars (see _attn_fwd_step).
    TILE_SCALE: tl.constexpr = QUANT and not K_FP4 and not DOT_SCALED and BLOCK_TOKENS % BLOCK_N == 0
    ek, ev = _key_scales(EK, EV, hk, T_K, kd_start, kd_end, BLOCK_N, QUANT, K_FP4, TILE_SCALE)
    for start_n in range(0, n_full, BLOCK_N):
        acc, l_i, m_i, ref_i, ek, ev = _attn_fwd_step(
            acc, l_i, m_i, ref_i, ek, ev, q, qscale, q_e8, sm_scale_log2, start_n, offs_m, hk,
            K, KSB, EK, V, EV, KS, EKS, VS, EVS, stride_vh, stride_vd, stride_vt, T_K, HK, kd_start, kd_end, v_base,
            v_end, qd_start, shift, D, BLOCK_N, BLOCK_TOKENS, CAUSAL, False, QUANT, K_FP4, False, DOT_SCALED,
            TILE_SCALE)
    # Masked tiles (the diagonal) are MASKED_N keys wide: narrower tiles there waste fewer masked pairs
    # and keep the mask and safeguard temporaries within the register budget (fewer spills).
    # TILE_SAFEGUARD: every masked tile lies in the query tile's own key block (see _tile_safeguard), so
    # all of them read the per-token copies: one MMA per tile, no per-pair selection.
    if TILE_SAFEGUARD:
        K, EK, V, EV = KS, EKS, VS, EVS
    ek, ev = _key_scales(EK, EV, hk, T_K, kd_start + n_full, kd_end, MASKED_N, QUANT, K_FP4)
    for start_n in range(n_full, hi - kd_start, MASKED_N):
        acc, l_i, m_i, ref_i, ek, ev = _attn_fwd_step(
            acc, l_i, m_i, ref_i, ek, ev, q, qscale, q_e8, sm_scale_log2, start_n, offs_m, hk,
            K, KSB, EK, V, EV, KS, EKS, VS, EVS, stride_vh, stride_vd, stride_vt, T_K, HK, kd_start, kd_end, v_base,
            v_end, qd_start, shift, D, MASKED_N, BLOCK_TOKENS, CAUSAL, True, QUANT, K_FP4,
            SAFEGUARD and not TILE_SAFEGUARD, DOT_SCALED)
    if QUANT:
        acc = acc * _exp2_int(ref_i + 119)[:, None]  # back from units of 2^(ref - 8)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    o = acc / l_safe[:, None]
    m_use = tl.where(m_i == float("-inf"), 0.0, m_i)
    lse = tl.where(l_i == 0.0, float("-inf"), (m_use + tl.log2(l_safe)) * 0.6931471805599453)  # ln(2)
    tl.store(O + (offs_m[:, None] * H + h) * D + offs_d[None, :], o.to(O.dtype.element_ty), mask=qmask[:, None])
    tl.store(LSE + h * T_Q + offs_m, lse, mask=qmask)


def _fwd_config(D: int, recipe: str):
    """(BLOCK_M, BLOCK_N, MASKED_N, num_warps, num_stages) of the forward kernel, from `bench.py --tune`
    on the H200 (D=128; see README). fp8 wants long key tiles (the P V MMA contracts over BLOCK_N) and
    one warpgroup per 64 query rows; 32-key diagonal tiles: +7% forward on packed 2k / lognormal
    documents over 64 (one 16k document: level; 128-wide: +2.6% there, -5% packed). The NVFP4 emulation
    decodes K to bf16 in registers and spills less with the smaller key tile (not tuned for speed).
    D=64 has not been tuned."""
    if recipe == "mxfp8":
        return 64, 128, 32, 4, 3
    if recipe in FP4_RECIPES:
        return 128, 64, 64, 8, 3
    return 128, 128, 64, 8, 3


def _tile_safeguard(plan: Plan, block_tokens: int, *blocks: int) -> bool:
    """Whether a kernel with these tile sizes can take the causal safeguard per tile instead of per pair.
    Tiles are aligned to the document start; when B_t is a multiple of every tile size and every causal
    shift is a multiple of B_t (always in self-attention), each query tile and each key tile lies inside
    one key block. A tile pair then either shares its block -- every visible pair straddles, and the
    whole tile uses the per-token copies -- or lies in an earlier block, safe with the block scales.
    This is what makes B_t=128 cheap: one MMA per masked tile, as at B_t=1."""
    return block_tokens % max(blocks) == 0 and plan.shift_gcd % block_tokens == 0


def _quantize_qkv(q, k, v, plan, recipe, block_tokens, safeguard, flag):
    """Quantize the forward's operands, one quantizer launch per tensor. Returns a dict of the operands the
    kernels read: "q" as (E4M3, E8M0 exponents); "k", "ks" as (data, scale, block scale) — mxfp8: (E4M3,
    E8M0 exponents, unused); nvfp4 / mxfp4: (packed E2M1, FP32 second level, E4M3 / E8M0 block scales) — and
    "v", "vs" as MXFP8 with the token-transposed copy. "ks", "vs" are the per-token copies of the safeguard
    (or K, V themselves)."""
    none = q.new_empty(0)
    q8 = quantize_mxfp8(q, plan, 1, "q", nonfinite_flag=flag)  # Q per token: its scale must not span rows
    ops = {"q": (q8.data, q8.exp)}
    if recipe in FP4_RECIPES:  # K: FP4 along the head dim, per token, so the safeguard never needs it
        kp, ksb, ks2 = quantize_nvfp4(k, plan, "k", flag, recipe == "mxfp4")
        ops["k"] = ops["ks"] = (kp, ks2, ksb)
    else:
        if safeguard:
            k8, ks8 = quantize_mxfp8(k, plan, block_tokens, "k", per_token_copy=True, nonfinite_flag=flag)
            ops["ks"] = (ks8.data, ks8.exp, none)
        else:
            k8 = quantize_mxfp8(k, plan, block_tokens, "k", nonfinite_flag=flag)
        ops["k"] = (k8.data, k8.exp, none)
        ops.setdefault("ks", ops["k"])
    # The forward reads V token-transposed only; MXFP8's backward dequantizes that copy (_dequantize), while
    # the FP4 recipes' backward multiplies the row-major E4M3 V (dP = dO V^T).
    rows = recipe in FP4_RECIPES
    if safeguard:
        ops["v"], ops["vs"] = quantize_mxfp8(v, plan, block_tokens, "k", transposed=True, per_token_copy=True,
                                             nonfinite_flag=flag, rows=rows)
    else:
        ops["v"] = ops["vs"] = quantize_mxfp8(v, plan, block_tokens, "k", transposed=True, nonfinite_flag=flag,
                                              rows=rows)
    return ops


def _attn_forward(q, k, v, plan: Plan, *, causal, softmax_scale, recipe, block_tokens, safeguard, backend):
    """Launch the forward. Returns (o, lse, ops) where ops holds the operands the backward reuses."""
    Tq, H, D = q.shape
    Tk, HK = k.shape[:2]
    quant = recipe != "bf16"
    safeguard = quant and causal and safeguard and block_tokens > 1
    flag = torch.zeros(1, dtype=torch.int32, device=q.device)
    if quant:
        ops = _quantize_qkv(q, k, v, plan, recipe, block_tokens, safeguard, flag)
        (Qd, EQ), (Kd, EK, KSB), (KS, EKS, _) = ops["q"], ops["k"], ops["ks"]
        Vd, EV, VS, EVS = ops["v"].data_t, ops["v"].exp, ops["vs"].data_t, ops["vs"].exp
        strides_v = (D * plan.padded_k, plan.padded_k, 1)  # (H, D, T_pad) token-transposed
    else:
        ops = {}
        Qd, Kd, Vd = (x.contiguous() for x in (q, k, v))
        EQ = EK = EKS = EV = EVS = KSB = flag  # unused
        KS, VS = Kd, Vd
        strides_v = (D, 1, HK * D)  # (T, H, D)
    ops["flag"] = flag
    empty_rows = plan.rows_without_keys[causal]
    o = (torch.zeros if empty_rows else torch.empty)(Tq, H, D, dtype=q.dtype, device=q.device)
    lse = torch.full((H, Tq), float("-inf"), device=q.device) if empty_rows else torch.empty(H, Tq, device=q.device)
    BLOCK_M, BLOCK_N, MASKED_N, warps, stages = _fwd_config(D, recipe)
    tiles = plan.tiles(BLOCK_M, "q", causal)
    if tiles.shape[0] > 0:
        _attn_fwd[(tiles.shape[0], H)](
            Qd, EQ, Kd, EK, Vd, EV, KS, EKS, VS, EVS, KSB, o, lse, tiles, *strides_v,
            softmax_scale * 1.4426950408889634, Tq, Tk, H, HK,  # log2(e)
            D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, MASKED_N=MASKED_N, BLOCK_TOKENS=block_tokens, CAUSAL=causal, QUANT=quant,
            K_FP4=_k_fp4(recipe), SAFEGUARD=safeguard,
            TILE_SAFEGUARD=safeguard and _tile_safeguard(plan, block_tokens, BLOCK_M, BLOCK_N, MASKED_N),
            DOT_SCALED=backend == "dot_scaled",
            num_warps=warps, num_stages=stages)
    return o, lse, ops


# ---------------------------------------------------------------------------------------------
# 5b. Backward kernels
# ---------------------------------------------------------------------------------------------
# The backward differentiates the function the forward computed: S is recomputed from exactly the
# forward's quantized operands (the same safeguard selection on the diagonal) and P from the saved
# LSE. Which matmuls run in fp8 was decided by measurement (H200, one 16k document, torch profiler):
# with S = Q K^T and dP = dO V^T in fp8 and dV, dK, dQ in bf16 (the sequence contractions, whose
# scales vary along the contraction), the dK/dV kernel took 4.92 ms and the dQ kernel 3.93 ms, against
# 4.28 and 2.53 ms for the same kernels in bf16: the fp8 MMAs save less than the per-element scale
# multiplies and fp8 -> bf16 conversions cost (ncu: 1.5x and 2.3x the instructions; these kernels are
# issue-bound, not MMA-bound). So MXFP8's backward DEQUANTIZES the forward's E4M3 operands to bf16 --
# exact: 4 significant bits times a power of two -- and runs the bf16 kernels on them, with dO as
# given (no dO quantization at all). Every MMA is bf16: the gradients are those of the oracle's
# function up to bf16 rounding of P and dS, as for recipe="bf16". The FP4 recipes keep the scaled
# path (K's FP32 second-level scale is not exact in bf16): S, dP on MXFP8 Q, V, dO, bf16 dV, dK, dQ.
# Two kernels, no atomics (deterministic): dK/dV per key tile iterating over query tiles, and dQ per
# query tile iterating over key tiles (the forward's schedule). Before them, two memory-bound passes:
# Delta = rowsum(dO * O) (one read of each; PyTorch's five elementwise passes took 0.37 ms at 16k
# tokens, 20% of an 8 x 2k backward) and, for MXFP8, the dequantization.
@triton.jit
def _delta_kernel(O, DO, DELTA, T, H, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """DELTA[h, t] = sum_d O[t, h, d] * dO[t, h, d] in fp32: rowsum(P * dP) of the softmax backward."""
    offs_t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1)
    mask = offs_t < T
    ptrs = (offs_t[:, None] * H + h) * D + tl.arange(0, D)[None, :]
    o = tl.load(O + ptrs, mask=mask[:, None], other=0.0).to(tl.float32)
    do = tl.load(DO + ptrs, mask=mask[:, None], other=0.0).to(tl.float32)
    tl.store(DELTA + h * T + offs_t, tl.sum(o * do, 1), mask=mask)


@triton.jit
def _dequantize_kernel(X, E, Y, TILES, T, T_PAD, H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr,
                       TRANSPOSED: tl.constexpr, FP16: tl.constexpr):
    """Y = E4M3 data times 2^(E - 127) per (token, head), in Y's dtype (exact in bf16), over one Plan tile
    of tokens. X is the row-major data (T, H, D), or with TRANSPOSED the token-transposed copy
    (H, D, T_pad), read along tokens and transposed in registers."""
    tile, h = tl.program_id(0), tl.program_id(1)
    row = TILES + tile * 8
    start, end = tl.load(row + TILE_START), tl.load(row + TILE_END)
    offs = tl.arange(0, BLOCK_T)
    offs_d = tl.arange(0, D)
    mask = start + offs < end
    if TRANSPOSED:
        p0 = tl.load(row + OWN_PAD) + (start - tl.load(row + OWN_START))  # the tile's first padded position
        x = tl.trans(tl.load(X + (h * D + offs_d[:, None]) * T_PAD + p0 + offs[None, :], mask=mask[None, :],
                             other=0.0).to(tl.float32))
    else:
        x = tl.load(X + ((start + offs[:, None]) * H + h) * D + offs_d[None, :], mask=mask[:, None],
                    other=0.0).to(tl.float32)
    e = tl.load(E + h * T + start + offs, mask=mask, other=127).to(tl.int32)
    y = x * _exp2_int(e)[:, None]
    if FP16:  # a value within a rounding step of fp16's max (65504) can dequantize past it: keep it finite
        y = tl.where(y > 65504.0, 65504.0, tl.where(y < -65504.0, -65504.0, y))  # (NaN stays NaN)
    tl.store(Y + ((start + offs[:, None]) * H + h) * D + offs_d[None, :], y.to(Y.dtype.element_ty),
             mask=mask[:, None])


def _delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    T, H, D = o.shape
    delta = torch.empty(H, T, dtype=torch.float32, device=o.device)
    if T > 0:
        _delta_kernel[(triton.cdiv(T, 64), H)](o, do, delta, T, H, D=D, BLOCK_T=64)
    return delta


def _dequantize(x: MXFP8, dtype: torch.dtype, plan: Plan, side: str) -> torch.Tensor:
    """The Triton twin of MXFP8.dequantize(), into bf16 / fp16 for the backward's MMAs; from the row-major
    data, or from the token-transposed copy when that is all there is (V). side: as in quantize_mxfp8."""
    H, T = x.exp.shape
    D = x.data.shape[2] if x.data is not None else x.data_t.shape[1]
    y = torch.empty(T, H, D, dtype=dtype, device=x.exp.device)
    tiles = plan.tiles(QUANT_TILE, side, causal=False, skip_masked=False)
    if tiles.shape[0] > 0:
        transposed = x.data is None
        _dequantize_kernel[(tiles.shape[0], H)](
            x.data_t if transposed else x.data, x.exp, y, tiles, T, x.data_t.shape[-1] if transposed else T, H=H,
            D=D, BLOCK_T=QUANT_TILE, TRANSPOSED=transposed, FP16=dtype == torch.float16, num_warps=8)
    return y


@triton.jit
def _query_rows(EQ, EDO, LSE, DELTA, hq, T_Q, offs_m, qmask, BLOCK_M: tl.constexpr, QUANT: tl.constexpr):
    """A query tile's per-row data for the backward: Q's and dO's scales, LSE in log2 units, Delta."""
    qs = _token_scale(EQ, offs_m, hq, T_Q, qmask, BLOCK_M, QUANT, False)  # Q and dO are MXFP8 in every recipe
    dos = _token_scale(EDO, offs_m, hq, T_Q, qmask, BLOCK_M, QUANT, False)
    lse2 = tl.load(LSE + hq * T_Q + offs_m, mask=qmask, other=0.0) * 1.4426950408889634  # log2(e)
    lse2 = tl.where(lse2 == float("-inf"), float("inf"), lse2)  # rows without keys: P = 0
    delta = tl.load(DELTA + hq * T_Q + offs_m, mask=qmask, other=0.0)
    return qs, dos, lse2, delta


@triton.jit
def _attn_bwd_dkdv_step(dk, dv, qs, dos, lse2, delta, k, v, ks, vs, kscale, vscale, kscale_s, vscale_s, start_m,
                        offs_n, hq, Q, EQ, DO, DO16, EDO, LSE, DELTA, sm_scale_log2, T_Q, H, qd_start, kd_start,
                        qd_end, shift, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
                        CAUSAL: tl.constexpr, MASKED: tl.constexpr, QUANT: tl.constexpr, K_FP4: tl.constexpr,
                        SAFEGUARD: tl.constexpr):
    """One query tile; its row data (_query_rows) arrives loaded one step ahead, as in the forward."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    qmask = offs_m < qd_end
    rows_next = _query_rows(EQ, EDO, LSE, DELTA, hq, T_Q, offs_m + BLOCK_M, offs_m + BLOCK_M < qd_end, BLOCK_M,
                            QUANT)
    ptrs = (offs_m[:, None] * H + hq) * D + offs_d[None, :]
    q = tl.load(Q + ptrs, mask=qmask[:, None], other=0.0)
    if K_FP4:  # the emulated FP4 K is bf16: E4M3 -> bf16 is exact
        q = q.to(tl.bfloat16)
    do = tl.load(DO + ptrs, mask=qmask[:, None], other=0.0)
    # Row (key) scales are applied to the MMA results; column (query) factors ride in the FMAs below.
    qsl = qs * sm_scale_log2  # Q's scale * softmax scale * log2(e)
    if QUANT:
        st = tl.dot(k, tl.trans(q)) * kscale[:, None]  # S^T without the column factor
        dpt = tl.dot(v, tl.trans(do)) * vscale[:, None]
    else:
        st = tl.dot(k, tl.trans(q))
        dpt = tl.dot(v, tl.trans(do))
    if MASKED:
        pos_q = offs_m - qd_start + shift
        pos_k = offs_n - kd_start
        visible = qmask[None, :]
        if CAUSAL:
            visible = visible & (pos_k[:, None] <= pos_q[None, :])
        if SAFEGUARD:  # the forward's per-token K, V on pairs whose key block straddles the query
            same = visible & ((pos_k // BLOCK_TOKENS)[:, None] == (pos_q // BLOCK_TOKENS)[None, :])
            st = tl.where(same, tl.dot(ks, tl.trans(q)) * kscale_s[:, None], st)
            dpt = tl.where(same, tl.dot(vs, tl.trans(do)) * vscale_s[:, None], dpt)
        st = tl.where(visible, st, float("-inf"))
    pt = tl.exp2(st * qsl[None, :] - lse2[None, :])
    if QUANT:
        dst = pt * (dpt * dos[None, :] - delta[None, :])
        # dV from the unquantized dO (the oracle's): no fp8 upcast in this MMA, and dV is exact up to P's
        # rounding; dO's fp8 copy serves only dP^T = V dO^T on the tensor cores.
        do16 = tl.load(DO16 + ptrs, mask=qmask[:, None], other=0.0)
        dv = tl.dot(pt.to(do16.dtype), do16, dv)
        dk = tl.dot((dst * qs[None, :]).to(tl.bfloat16), q.to(tl.bfloat16), dk)
    else:
        dst = pt * (dpt - delta[None, :])
        dv = tl.dot(pt.to(do.dtype), do, dv)
        dk = tl.dot(dst.to(q.dtype), q, dk)
    return (dk, dv) + rows_next


@triton.jit
def _attn_bwd_dkdv(
        Q, EQ, K, EK, V, EV, KS, EKS, VS, EVS, DO, EDO,  # forward operands (all (T, H, D)) and quantized dO
        KSB,  # FP4 K: its block scales
        DO16, LSE, DELTA, DK, DV, TILES,  # dO as given; (H, Tq) LSE, rowsum(dO * O); outputs (Tk, Hk, D); key tiles
        sm_scale, T_Q, T_K, H, HK,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
        CAUSAL: tl.constexpr, QUANT: tl.constexpr, K_FP4: tl.constexpr, SAFEGUARD: tl.constexpr,
        TILE_SAFEGUARD: tl.constexpr):
    tile, hk = tl.program_id(0), tl.program_id(1)
    row = TILES + tile * 8
    k_start, k_end = tl.load(row + TILE_START), tl.load(row + TILE_END)
    kd_start, kd_end = tl.load(row + OWN_START), tl.load(row + OWN_END)
    qd_start, qd_end = tl.load(row + OTHER_START), tl.load(row + OTHER_END)
    shift = (kd_end - kd_start) - (qd_end - qd_start)
    offs_n = k_start + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    kmask = offs_n < k_end
    ptrs = (offs_n[:, None] * HK + hk) * D + offs_d[None, :]
    k = _load_k(K, KSB, offs_n, hk, HK, kmask, BLOCK_N, D, K_FP4)
    kscale = _token_scale(EK, offs_n, hk, T_K, kmask, BLOCK_N, QUANT, K_FP4)
    v = tl.load(V + ptrs, mask=kmask[:, None], other=0.0)
    vscale = _token_scale(EV, offs_n, hk, T_K, kmask, BLOCK_N, QUANT, False)
    ks, vs, kscale_s, vscale_s = k, v, kscale, vscale
    if SAFEGUARD:
        if not K_FP4:  # FP4 K is per token already
            ks = _load_k(KS, KSB, offs_n, hk, HK, kmask, BLOCK_N, D, K_FP4)
            kscale_s = _token_scale(EKS, offs_n, hk, T_K, kmask, BLOCK_N, QUANT, K_FP4)
        vs = tl.load(VS + ptrs, mask=kmask[:, None], other=0.0)
        vscale_s = _token_scale(EVS, offs_n, hk, T_K, kmask, BLOCK_N, QUANT, False)
    sm_scale_log2 = sm_scale * 1.4426950408889634
    # Query tiles of the document that see this key tile: masked ones first (the diagonal, and the
    # safeguard's straddling blocks; the document's last tile too if it is one of them), then those
    # every row of which sees every key, then the document's partial last tile (bounds mask).
    qd_len = qd_end - qd_start
    q_full = qd_start + qd_len // BLOCK_M * BLOCK_M
    if CAUSAL:
        first = tl.maximum(k_start - kd_start - shift, 0)  # first query position that sees key k_start
        q_lo = qd_start + first // BLOCK_M * BLOCK_M
        thr = k_end - kd_start - 1  # a row at or past this position sees every key of the tile...
        if SAFEGUARD:  # ...and past the straddling block when the safeguard is on
            thr = (k_end - kd_start + BLOCK_TOKENS - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        q_mid = tl.minimum(qd_start + (tl.maximum(thr - shift, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M, qd_end)
        q_mid = tl.maximum(q_mid, q_lo)
    else:
        q_lo = qd_start
        q_mid = qd_start
    # TILE_SAFEGUARD (see _tile_safeguard): the masked query tiles [q_lo, q_mid) all lie in this key
    # tile's block and see it through the per-token copies only; every later tile through K, V.
    if TILE_SAFEGUARD:
        k_diag, v_diag, kscale_diag, vscale_diag = ks, vs, kscale_s, vscale_s
    else:
        k_diag, v_diag, kscale_diag, vscale_diag = k, v, kscale, vscale
    dk = tl.zeros((BLOCK_N, D), tl.float32)
    dv = tl.zeros((BLOCK_N, D), tl.float32)
    for hq in range(hk * (H // HK), (hk + 1) * (H // HK)):  # GQA: sum over the query heads of this K/V head
        offs_m = q_lo + tl.arange(0, BLOCK_M)
        qs, dos, lse2, delta = _query_rows(EQ, EDO, LSE, DELTA, hq, T_Q, offs_m, offs_m < qd_end, BLOCK_M, QUANT)
        for start_m in range(q_lo, q_mid, BLOCK_M):  # the three loops walk one contiguous tile sequence
            dk, dv, qs, dos, lse2, delta = _attn_bwd_dkdv_step(
                dk, dv, qs, dos, lse2, delta, k_diag, v_diag, ks, vs, kscale_diag, vscale_diag, kscale_s, vscale_s,
                start_m, offs_n, hq, Q, EQ, DO, DO16, EDO, LSE, DELTA, sm_scale_log2, T_Q, H, qd_start, kd_start,
                qd_end, shift, D, BLOCK_M, BLOCK_TOKENS, CAUSAL, True, QUANT, K_FP4, SAFEGUARD and not TILE_SAFEGUARD)
        for start_m in range(q_mid, q_full, BLOCK_M):
            dk, dv, qs, dos, lse2, delta = _attn_bwd_dkdv_step(
                dk, dv, qs, dos, lse2, delta, k, v, ks, vs, kscale, vscale, kscale_s, vscale_s, start_m, offs_n, hq,
                Q, EQ, DO, DO16, EDO, LSE, DELTA, sm_scale_log2, T_Q, H, qd_start, kd_start, qd_end, shift, D,
                BLOCK_M, BLOCK_TOKENS, CAUSAL, False, QUANT, K_FP4, False)
        for start_m in range(tl.maximum(q_full, q_mid), qd_end, BLOCK_M):
            dk, dv, qs, dos, lse2, delta = _attn_bwd_dkdv_step(
                dk, dv, qs, dos, lse2, delta, k, v, ks, vs, kscale, vscale, kscale_s, vscale_s, start_m, offs_n, hq,
                Q, EQ, DO, DO16, EDO, LSE, DELTA, sm_scale_log2, T_Q, H, qd_start, kd_start, qd_end, shift, D,
                BLOCK_M, BLOCK_TOKENS, CAUSAL, True, QUANT, K_FP4, False)
    tl.store(DK + ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=kmask[:, None])
    tl.store(DV + ptrs, dv.to(DV.dtype.element_ty), mask=kmask[:, None])


@triton.jit
def _attn_bwd_dq_step(dq, ek, ev, q, do, qscale_log2, doscale, lse2, delta, start_n, offs_m, hk,
                      K, KSB, EK, V, EV, KS, EKS, VS, EVS, T_K, HK, kd_start, kd_end, qd_start, shift,
                      D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TOKENS: tl.constexpr, CAUSAL: tl.constexpr,
                      MASKED: tl.constexpr, QUANT: tl.constexpr, K_FP4: tl.constexpr, SAFEGUARD: tl.constexpr):
    """One key tile; its scales (_key_scales) arrive loaded one step ahead, as in the forward."""
    offs_n = kd_start + start_n + tl.arange(0, BLOCK_N)  # start_n: document-local offset
    offs_d = tl.arange(0, D)
    kmask = offs_n < kd_end
    ek_next, ev_next = _key_scales(EK, EV, hk, T_K, kd_start + start_n + BLOCK_N, kd_end, BLOCK_N, QUANT, K_FP4)
    ptrs = (offs_n[:, None] * HK + hk) * D + offs_d[None, :]
    k = _load_k(K, KSB, offs_n, hk, HK, kmask, BLOCK_N, D, K_FP4)
    v = tl.load(V + ptrs, mask=kmask[:, None], other=0.0)
    if QUANT:  # (FP4 recipes) column (key) scales on the MMA results; row factors ride in the FMAs below
        kscale = ek  # K's FP32 second-level scale
        s = tl.dot(q, tl.trans(k)) * kscale[None, :]
        dp = tl.dot(do, tl.trans(v)) * _exp2_int(ev + 127)[None, :]
    else:
        s = tl.dot(q, tl.trans(k))
        dp = tl.dot(do, tl.trans(v))
    if MASKED:
        pos_q = offs_m - qd_start + shift
        pos_k = offs_n - kd_start
        visible = kmask[None, :]
        if CAUSAL:
            visible = visible & (pos_k[None, :] <= pos_q[:, None])
        if SAFEGUARD:
            same = visible & ((pos_k // BLOCK_TOKENS)[None, :] == (pos_q // BLOCK_TOKENS)[:, None])
            ks = k
            if not K_FP4:  # FP4 K is per token already
                ks = _load_k(KS, KSB, offs_n, hk, HK, kmask, BLOCK_N, D, K_FP4)
                kscale_s = _token_scale(EKS, offs_n, hk, T_K, kmask, BLOCK_N, QUANT, K_FP4)
                s = tl.where(same, tl.dot(q, tl.trans(ks)) * kscale_s[None, :], s)
            vs = tl.load(VS + ptrs, mask=kmask[:, None], other=0.0)
            vscale_s = _token_scale(EVS, offs_n, hk, T_K, kmask, BLOCK_N, QUANT, False)
            dp = tl.where(same, tl.dot(do, tl.trans(vs)) * vscale_s[None, :], dp)
        s = tl.where(visible, s, float("-inf"))
    p = tl.exp2(s * qscale_log2[:, None] - lse2[:, None])
    if QUANT:  # FP4 K is per token, so the safeguard pairs use K itself: one MMA
        ds = p * (dp * doscale[:, None] - delta[:, None])
        dq = tl.dot((ds * kscale[None, :]).to(tl.bfloat16), k, dq)
    else:
        ds = p * (dp - delta[:, None])
        if SAFEGUARD:
            dq = tl.dot(tl.where(same, 0.0, ds).to(k.dtype), k, dq)
            dq = tl.dot(tl.where(same, ds, 0.0).to(ks.dtype), ks, dq)
        else:
            dq = tl.dot(ds.to(k.dtype), k, dq)
    return dq, ek_next, ev_next


@triton.jit
def _attn_bwd_dq(
        Q, EQ, K, EK, V, EV, KS, EKS, VS, EVS, DO, EDO, KSB,  # as in _attn_bwd_dkdv
        LSE, DELTA, DQ, TILES,  # output (Tq, H, D); the Plan's query tiles
        sm_scale, T_Q, T_K, H, HK,
        D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_TOKENS: tl.constexpr,
        CAUSAL: tl.constexpr, QUANT: tl.constexpr, K_FP4: tl.constexpr, SAFEGUARD: tl.constexpr,
        TILE_SAFEGUARD: tl.constexpr):
    tile, h = tl.program_id(0), tl.program_id(1)
    hk = h // (H // HK)
    row = TILES + tile * 8
    q_start, q_end = tl.load(row + TILE_START), tl.load(row + TILE_END)
    qd_start, qd_end = tl.load(row + OWN_START), tl.load(row + OWN_END)
    kd_start, kd_end = tl.load(row + OTHER_START), tl.load(row + OTHER_END)
    shift = (kd_end - kd_start) - (qd_end - qd_start)
    offs_m = q_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    qmask = offs_m < q_end
    ptrs = (offs_m[:, None] * H + h) * D + offs_d[None, :]
    q = tl.load(Q + ptrs, mask=qmask[:, None], other=0.0)
    if K_FP4:  # the emulated FP4 K is bf16: E4M3 -> bf16 is exact
        q = q.to(tl.bfloat16)
    do = tl.load(DO + ptrs, mask=qmask[:, None], other=0.0)
    qscale, doscale, lse2, delta = _query_rows(EQ, EDO, LSE, DELTA, h, T_Q, offs_m, qmask, BLOCK_M, QUANT)
    qscale_log2 = qscale * (sm_scale * 1.4426950408889634)
    n_full, hi = _key_range(q_start, q_end, qd_start, shift, kd_start, kd_end, BLOCK_N, BLOCK_TOKENS, CAUSAL,
                            SAFEGUARD)
    dq = tl.zeros((BLOCK_M, D), tl.float32)
    ek, ev = _key_scales(EK, EV, hk, T_K, kd_start, kd_end, BLOCK_N, QUANT, K_FP4)
    for start_n in range(0, n_full, BLOCK_N):
        dq, ek, ev = _attn_bwd_dq_step(dq, ek, ev, q, do, qscale_log2, doscale, lse2, delta, start_n, offs_m, hk,
                                       K, KSB, EK, V, EV, KS, EKS, VS, EVS, T_K, HK, kd_start, kd_end, qd_start,
                                       shift, D, BLOCK_N, BLOCK_TOKENS, CAUSAL, False, QUANT, K_FP4, False)
    if TILE_SAFEGUARD:  # the masked key tiles all lie in this query tile's block: per-token copies only
        K, EK, V, EV = KS, EKS, VS, EVS
        ek, ev = _key_scales(EK, EV, hk, T_K, kd_start + n_full, kd_end, BLOCK_N, QUANT, K_FP4)
    for start_n in range(n_full, hi - kd_start, BLOCK_N):
        dq, ek, ev = _attn_bwd_dq_step(dq, ek, ev, q, do, qscale_log2, doscale, lse2, delta, start_n, offs_m, hk,
                                       K, KSB, EK, V, EV, KS, EKS, VS, EVS, T_K, HK, kd_start, kd_end, qd_start,
                                       shift, D, BLOCK_N, BLOCK_TOKENS, CAUSAL, True, QUANT, K_FP4,
                                       SAFEGUARD and not TILE_SAFEGUARD)
    tl.store(DQ + ptrs, (dq * sm_scale).to(DQ.dtype.element_ty), mask=qmask[:, None])


def _bwd_config(D: int):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of the dK/dV kernel (query x key tiles) and of the dQ kernel,
    from `bench.py --tune` on the H200 (D=128): 3 stages beat 2 by 8-16%; bigger query tiles in dK/dV
    spill registers (cuobjdump -res-usage) and are within 5%."""
    return (32, 128, 8, 3), (128, 64, 8, 3)


def _attn_backward(do, q, k, v, o, lse, ops, plan: Plan, *, causal, softmax_scale, recipe, block_tokens, safeguard):
    """ops: the forward's quantized operands (see _quantize_qkv); unused for recipe="bf16"."""
    Tq, H, D = q.shape
    Tk, HK = k.shape[:2]
    quant = recipe != "bf16"
    safeguard = quant and causal and safeguard and block_tokens > 1
    do = do.contiguous()
    delta = _delta(o, do)  # (H, Tq): rowsum(P * dP) = dO . O
    if recipe == "mxfp8":  # bf16 kernels on the exactly dequantized operands (see the section comment)
        deq = lambda x, side: _dequantize(x, q.dtype, plan, side)
        q, k, v = deq(MXFP8(*ops["q"][:2]), "q"), deq(MXFP8(*ops["k"][:2]), "k"), deq(ops["v"], "k")
        ks = deq(MXFP8(*ops["ks"][:2]), "k") if safeguard else k
        vs = deq(ops["vs"], "k") if safeguard else v
        quant = False
        operands = (q, delta, k, delta, v, delta, ks, delta, vs, delta, do, delta, delta)  # scales unused
    elif quant:
        do8 = quantize_mxfp8(do, plan, block_tokens, "q")
        (Qd, EQ), (Kd, EK, KSB), (KS, EKS, _) = ops["q"], ops["k"], ops["ks"]
        operands = (Qd, EQ, Kd, EK, ops["v"].data, ops["v"].exp, KS, EKS, ops["vs"].data, ops["vs"].exp,
                    do8.data, do8.exp, KSB)
    else:
        q, k, v = (x.contiguous() for x in (q, k, v))
        operands = (q, delta, k, delta, v, delta, k, delta, v, delta, do, delta, delta)  # scales unused
    init = torch.zeros if plan.keys_without_rows else torch.empty
    dk, dv = init(Tk, HK, D, dtype=q.dtype, device=q.device), init(Tk, HK, D, dtype=q.dtype, device=q.device)
    dq = (torch.zeros if plan.rows_without_keys[causal] else torch.empty)(Tq, H, D, dtype=q.dtype, device=q.device)
    (BM1, BN1, w1, s1), (BM2, BN2, w2, s2) = _bwd_config(D)
    tile_dkdv = safeguard and _tile_safeguard(plan, block_tokens, BM1, BN1)
    tile_dq = safeguard and _tile_safeguard(plan, block_tokens, BM2, BN2)
    if safeguard and not tile_dq and D > 64:  # the per-pair safeguard's dQ loop streams K, V and their
        s2 = 2  # per-token copies: three stages of four bf16 key tiles need 256 KiB of shared memory (H200: 227)
    meta = dict(D=D, BLOCK_TOKENS=block_tokens, CAUSAL=causal, QUANT=quant, K_FP4=_k_fp4(recipe),
                SAFEGUARD=safeguard)
    tiles = plan.tiles(BN1, "k", causal)
    if tiles.shape[0] > 0:
        _attn_bwd_dkdv[(tiles.shape[0], HK)](*operands, do, lse, delta, dk, dv, tiles, softmax_scale, Tq, Tk, H, HK,
                                             BLOCK_M=BM1, BLOCK_N=BN1, num_warps=w1, num_stages=s1,
                                             TILE_SAFEGUARD=tile_dkdv, **meta)
    tiles = plan.tiles(BM2, "q", causal)
    if tiles.shape[0] > 0:
        _attn_bwd_dq[(tiles.shape[0], H)](*operands, lse, delta, dq, tiles, softmax_scale, Tq, Tk, H, HK,
                                          BLOCK_M=BM2, BLOCK_N=BN2, num_warps=w2, num_stages=s2,
                                          TILE_SAFEGUARD=tile_dq, **meta)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# 6. Autograd, torch custom ops and the public API
# ---------------------------------------------------------------------------------------------
# The launches are wrapped in torch.library custom ops (with fake implementations for shapes), so
# torch.compile treats them as opaque nodes instead of breaking the graph. The Plan is a Python
# object, so it cannot cross the op boundary: the op receives the cu_seqlens tensors and finds the
# Plan built for exactly those tensor objects (a weak-keyed cache), or builds it (one host sync).
DEFAULT_BLOCK_TOKENS = 1  # measured choice, see README ("Choosing block_tokens")
BACKENDS = ("wgmma", "dot_scaled")
_PLANS = {}  # ("dense", B, Sq, Sk, device) -> Plan
_VARLEN_PLANS = {}  # id(cu_seqlens_q) -> Plan, dropped when that tensor dies (ids are reused afterwards)


def _register_plan(plan: Plan) -> Plan:
    key = id(plan.cu_seqlens_q)
    _VARLEN_PLANS[key] = plan
    weakref.finalize(plan.cu_seqlens_q, _VARLEN_PLANS.pop, key, None)
    plan.version = plan.cu_seqlens_q._version  # an in-place change of cu_seqlens invalidates the plan
    return plan


def flamia_plan(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor = None, device=None) -> Plan:
    """Build (once per batch) the Plan for these cu_seqlens; pass it as plan= to every layer.
    With host cu_seqlens and device="cuda" it costs no GPU sync (see Plan)."""
    return _register_plan(Plan(cu_seqlens_q, cu_seqlens_k, device=device))


def _plan_for(cu_q: torch.Tensor, cu_k: torch.Tensor, dense: list, total_q: int, total_k: int) -> Plan:
    if dense[0] > 0:  # (B, S, H, D) inputs: B equal documents, cached by shape
        key = ("dense", *dense, str(cu_q.device))
        if key not in _PLANS:
            _PLANS[key] = Plan.dense(dense[0], dense[1], dense[2], cu_q.device)
        return _PLANS[key]
    plan = _VARLEN_PLANS.get(id(cu_q))
    if plan is None or plan.cu_seqlens_k is not cu_k or plan.version != cu_q._version:
        plan = flamia_plan(cu_q, cu_k)
    for name, have, want in (("cu_seqlens_q", plan.total_q, total_q), ("cu_seqlens_k", plan.total_k, total_k)):
        if have != want:
            raise ValueError(f"{name} must end at the total number of tokens {want}, got {have}")
    return plan


_SAVED = 11  # quantized operands the forward hands to the backward: q (2), k (3), ks (2), v (2), vs (2)


def _pack_saved(ops):
    """The forward's operands as a flat list of distinct tensors (custom-op outputs may not alias):
    a per-token copy that is K or V itself travels as an empty tensor. V travels as the data the
    backward reads: row-major for the FP4 recipes, token-transposed for mxfp8 (see _quantize_qkv)."""
    ks = ops["ks"][:2] if ops["ks"] is not ops["k"] else (None, None)
    v_data = lambda m: m.data if m.data is not None else m.data_t
    vs = (v_data(ops["vs"]), ops["vs"].exp) if ops["vs"] is not ops["v"] else (None, None)
    flat = [*ops["q"], *ops["k"], *ks, v_data(ops["v"]), ops["v"].exp, *vs]
    return [t if t is not None and t.numel() else torch.empty(0, device=ops["flag"].device) for t in flat]


def _unpack_saved(saved, recipe):
    v = lambda data, exp: MXFP8(data, exp) if recipe in FP4_RECIPES else MXFP8(None, exp, data)
    ops = {"q": tuple(saved[0:2]), "k": tuple(saved[2:5]), "v": v(saved[7], saved[8])}
    ops["ks"] = (saved[5], saved[6], saved[4]) if saved[5].numel() else ops["k"]
    ops["vs"] = v(saved[9], saved[10]) if saved[9].numel() else ops["v"]
    return ops


@torch.library.custom_op("flamia::fwd", mutates_args=(), device_types=("cuda", "cpu"))
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
            cu_seqlens_k: torch.Tensor, dense: list[int], causal: bool, softmax_scale: float, recipe: str,
            block_tokens: int, safeguard: bool, backend: str, check_finite: bool) -> list[torch.Tensor]:
    plan = _plan_for(cu_seqlens_q, cu_seqlens_k, dense, q.shape[0], k.shape[0])
    o, lse, ops = _attn_forward(q, k, v, plan, causal=causal, softmax_scale=softmax_scale, recipe=recipe,
                                block_tokens=block_tokens, safeguard=safeguard, backend=backend)
    if check_finite and recipe == "bf16":  # no quantizer pass to detect it on the way: one extra read
        ops["flag"] = ~(torch.isfinite(q).all() & torch.isfinite(k).all() & torch.isfinite(v).all())
    if check_finite and ops["flag"].item():  # one host sync; pass check_finite=False to skip it
        raise ValueError("q, k or v contains inf or NaN: E8M0 scales of such blocks are NaN "
                         "(FLAMIA refuses to turn them into finite garbage)")
    if recipe == "bf16":
        saved = [q.new_empty(0, dtype=torch.float32) for _ in range(_SAVED)]
    else:
        saved = _pack_saved(ops)
    return [o, lse] + saved


@_fwd_op.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, dense, causal, softmax_scale, recipe, block_tokens, safeguard, backend,
      check_finite):
    Tq, H, D = q.shape
    Tk, HK = k.shape[:2]
    f8, u8, e = torch.float8_e4m3fn, torch.uint8, lambda: q.new_empty(0, dtype=torch.float32)
    if recipe == "bf16":
        return [torch.empty_like(q), q.new_empty(H, Tq, dtype=torch.float32)] + [e() for _ in range(_SAVED)]
    mx = lambda T, h: [q.new_empty(T, h, D, dtype=f8), q.new_empty(h, T, dtype=u8)]
    tok = causal and safeguard and block_tokens > 1
    if recipe in FP4_RECIPES:
        block_scales = ((D // NVFP4_BLOCK, f8) if recipe == "nvfp4" else (D // MXFP4_BLOCK, u8))
        fp4 = lambda T, h: [q.new_empty(T, h, D // 2, dtype=u8), q.new_empty(h, T, dtype=torch.float32),
                            q.new_empty(T, h, block_scales[0], dtype=block_scales[1])]
        saved = mx(Tq, H) + fp4(Tk, HK) + [e(), e()]
    else:
        saved = mx(Tq, H) + mx(Tk, HK) + [e()] + (mx(Tk, HK) if tok else [e(), e()])
    v_mx = mx  # V as the backward reads it: row-major for FP4, token-transposed for mxfp8 (see _pack_saved)
    if recipe not in FP4_RECIPES:
        t_pad = padded_tokens(Tk, cu_seqlens_k.shape[0] - 1)
        v_mx = lambda T, h: [q.new_empty(h, D, t_pad, dtype=f8), q.new_empty(h, T, dtype=u8)]
    saved += v_mx(Tk, HK) + (v_mx(Tk, HK) if tok else [e(), e()])
    return [torch.empty_like(q), q.new_empty(H, Tq, dtype=torch.float32)] + saved


@torch.library.custom_op("flamia::bwd", mutates_args=(), device_types=("cuda", "cpu"))
def _bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
            lse: torch.Tensor, saved: list[torch.Tensor], cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
            dense: list[int], causal: bool, softmax_scale: float, recipe: str, block_tokens: int,
            safeguard: bool) -> list[torch.Tensor]:
    plan = _plan_for(cu_seqlens_q, cu_seqlens_k, dense, q.shape[0], k.shape[0])
    ops = _unpack_saved(saved, recipe)
    return list(_attn_backward(do, q, k, v, o, lse, ops, plan, causal=causal, softmax_scale=softmax_scale,
                               recipe=recipe, block_tokens=block_tokens, safeguard=safeguard))


@_bwd_op.register_fake
def _(do, q, k, v, o, lse, saved, cu_seqlens_q, cu_seqlens_k, dense, causal, softmax_scale, recipe, block_tokens,
      safeguard):
    return [torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)]


class _FlamiaAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, dense, causal, scale, recipe, block_tokens, safeguard, backend, check):
        o, lse, *saved = torch.ops.flamia.fwd(q, k, v, cu_q, cu_k, dense, causal, scale, recipe, block_tokens,
                                              safeguard, backend, check)
        # bf16 recipe: the kernels read q, k, v themselves; mxfp8: only their quantized copies (half the bytes)
        keep = (q, k, v) if recipe == "bf16" else (q.new_empty(0),) * 3
        ctx.save_for_backward(*keep, o, lse, cu_q, cu_k, *saved)
        ctx.args = (dense, causal, scale, recipe, block_tokens, safeguard)
        ctx.shapes = (q.shape, k.shape, v.shape)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse, cu_q, cu_k, *saved = ctx.saved_tensors
        if q.numel() == 0:  # mxfp8: the kernels only need shapes of the originals
            q, k, v = (o.new_empty(s) for s in ctx.shapes)
        dq, dk, dv = torch.ops.flamia.bwd(do, q, k, v, o, lse, saved, cu_q, cu_k, *ctx.args)
        return dq, dk, dv, *([None] * 10)


def kernels_available(device) -> bool:
    """True where the Triton kernels run (a CUDA device, or Triton's interpreter); elsewhere the public
    functions compute the same function through the PyTorch oracle."""
    return torch.device(device).type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _check_qkv(q, k, v, dims: int):
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_thd(x, name, dims)
        if x.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"{name} must be bfloat16 or float16, got {x.dtype}")
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"q, k, v must share dtype and device; {name} is {x.dtype} on {x.device}, "
                             f"q is {q.dtype} on {q.device}")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    if q.shape[-2] % k.shape[-2] != 0:
        raise ValueError(f"the number of q heads ({q.shape[-2]}) must be a multiple of the number of k/v heads "
                         f"({k.shape[-2]}) (GQA/MQA)")


def _check_options(recipe, block_tokens, backend):
    if recipe not in RECIPES:
        raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
    _check_block_tokens(block_tokens)
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    if backend == "dot_scaled" and recipe not in DOT_SCALED_RECIPES:
        raise ValueError(f"backend='dot_scaled' is for recipe='mxfp8' or 'mxfp4', got recipe={recipe!r}; "
                         "use backend='wgmma' (nvfp4: tl.dot_scaled takes no E4M3 block scales)")


def _default_backend(x: torch.Tensor, recipe: str) -> str:
    # Blackwell (sm_100+) applies E8M0 scales in its tensor cores; Hopper has plain fp8 wgmma, where
    # tl.dot_scaled is emulated through bf16 (289 vs 1184 TFLOP/s measured on H200). NVFP4's E4M3 block
    # scales are not a tl.dot_scaled input: it stays the exact bf16 emulation everywhere.
    if recipe in DOT_SCALED_RECIPES and x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 10:
        return "dot_scaled"
    return "wgmma"


def flamia_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=True,
                            softmax_scale=None, recipe="mxfp8", block_tokens=DEFAULT_BLOCK_TOKENS, safeguard=True,
                            rotate_qk=False, backend=None, plan=None, return_lse=False, check_finite=True):
    """FLAMIA attention on packed documents (flash-attn's varlen signature).

    q: (total_q, H, D); k, v: (total_k, Hk, D) with H % Hk == 0 (GQA/MQA); bf16 or fp16; D in (64, 128).
    cu_seqlens_q / cu_seqlens_k: int32 (n_docs + 1,) document offsets; max_seqlen_*: upper bounds of the
    document lengths (as in flash-attn). causal: per-document causal mask, bottom-right aligned.
    recipe: "mxfp8" (FLAMIA), "bf16" (the same kernels without quantization), "nvfp4" or "mxfp4" (K in
        FP4; Q, V, dO in MXFP8; nvfp4 is an exact bf16 emulation everywhere, mxfp4 runs on Blackwell's
        tensor cores, E4M3 x E2M1, with backend="dot_scaled").
    block_tokens: tokens per K/V scale block (FP4 recipes: also dO) (1, 32, 64, 128); Q is always scaled per token.
    safeguard: False disables the causal safeguard (LEAKS the future; for tests and demos only).
    rotate_qk: multiply Q and K by a +-1 Hadamard matrix with random signs before quantizing (same
        S, less quantization error when head-dim channels have outliers; two small matmuls).
    backend: "wgmma" (fp8 tl.dot, scales outside the MMA) or "dot_scaled" (E8M0 scales in the MMA);
        default: dot_scaled on Blackwell (sm_100+), wgmma otherwise.
    plan: flamia_plan(cu_seqlens_q, cu_seqlens_k), built once per batch and shared by all layers.
    check_finite: raise ValueError on inf/NaN inputs (one host sync per call).
    Returns out (total_q, H, D) [and lse (H, total_q), natural log, not differentiable].
    """
    _check_qkv(q, k, v, 3)
    _check_options(recipe, block_tokens, backend)
    if plan is not None:
        if not isinstance(plan, Plan):
            raise TypeError(f"plan must be a flamia.Plan (from flamia_plan), got {type(plan).__name__}")
        for name, cu, mine in (("cu_seqlens_q", cu_seqlens_q, plan.cu_seqlens_q),
                               ("cu_seqlens_k", cu_seqlens_k, plan.cu_seqlens_k)):
            if cu is not None and cu is not mine and cu.shape != mine.shape:
                raise ValueError(f"{name} describes {cu.numel() - 1} documents but the plan was built for "
                                 f"{mine.numel() - 1}")
        cu_seqlens_q, cu_seqlens_k = plan.cu_seqlens_q, plan.cu_seqlens_k
    for name, cu, total in (("cu_seqlens_q", cu_seqlens_q, q.shape[0]), ("cu_seqlens_k", cu_seqlens_k, k.shape[0])):
        _check_cu_seqlens(cu, total, name, q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must describe the same number of documents, got "
                         f"{cu_seqlens_q.numel() - 1} and {cu_seqlens_k.numel() - 1}")
    softmax_scale = 1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale)
    if not kernels_available(q.device):  # CPU without the interpreter: the oracle computes the same function
        o, lse = reference_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, causal=causal, softmax_scale=softmax_scale,
                                     recipe=recipe, block_tokens=block_tokens, safeguard=safeguard,
                                     rotate_qk=rotate_qk, return_lse=True)
        o = o.to(q.dtype)
        return (o, lse) if return_lse else o
    if rotate_qk:  # outside the custom op: autograd rotates dQ, dK back
        q, k, softmax_scale = _rotate_qk(q, k, softmax_scale)
    if plan is None and not torch.compiler.is_compiling():
        plan = _plan_for(cu_seqlens_q, cu_seqlens_k, [0, 0, 0], q.shape[0], k.shape[0])
    elif plan is not None and (plan.total_q, plan.total_k) != (q.shape[0], k.shape[0]):
        raise ValueError(f"the plan covers ({plan.total_q}, {plan.total_k}) tokens but q, k have "
                         f"({q.shape[0]}, {k.shape[0]})")
    if plan is not None and (max_seqlen_q < plan.max_seqlen_q or max_seqlen_k < plan.max_seqlen_k):
        raise ValueError(f"max_seqlen_q / max_seqlen_k ({max_seqlen_q}, {max_seqlen_k}) are smaller than the longest "
                         f"documents in cu_seqlens ({plan.max_seqlen_q}, {plan.max_seqlen_k})")
    o, lse = _FlamiaAttention.apply(q, k, v, cu_seqlens_q, cu_seqlens_k, [0, 0, 0], causal, softmax_scale, recipe,
                                    block_tokens, safeguard, backend or _default_backend(q, recipe), check_finite)
    return (o, lse) if return_lse else o


def flamia_attn_func(q, k, v, *, causal=True, softmax_scale=None, recipe="mxfp8", block_tokens=DEFAULT_BLOCK_TOKENS,
                     safeguard=True, rotate_qk=False, backend=None, return_lse=False, check_finite=True):
    """FLAMIA attention on (batch, seqlen, heads, head_dim) tensors; see flamia_attn_varlen_func.
    Returns out (B, Sq, H, D) [and lse (B, H, Sq)]. Needs no host sync (the Plan comes from shapes)."""
    _check_qkv(q, k, v, 4)
    _check_options(recipe, block_tokens, backend)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    B, Sq, H, D = q.shape
    Sk = k.shape[1]
    softmax_scale = 1.0 / math.sqrt(D) if softmax_scale is None else float(softmax_scale)
    qf, kf, vf = q.reshape(B * Sq, H, D), k.reshape(B * Sk, *k.shape[2:]), v.reshape(B * Sk, *v.shape[2:])
    cu_q = torch.arange(0, (B + 1) * Sq, Sq, dtype=torch.int32, device=q.device)
    cu_k = torch.arange(0, (B + 1) * Sk, Sk, dtype=torch.int32, device=q.device)
    if not kernels_available(q.device):
        o, lse = reference_attention(qf, kf, vf, cu_q, cu_k, causal=causal, softmax_scale=softmax_scale,
                                     recipe=recipe, block_tokens=block_tokens, safeguard=safeguard,
                                     rotate_qk=rotate_qk, return_lse=True)
        o = o.to(q.dtype)
    else:
        if rotate_qk:
            qf, kf, softmax_scale = _rotate_qk(qf, kf, softmax_scale)
        o, lse = _FlamiaAttention.apply(qf, kf, vf, cu_q, cu_k, [B, Sq, Sk], causal, softmax_scale, recipe,
                                        block_tokens, safeguard, backend or _default_backend(q, recipe), check_finite)
    o, lse = o.view(B, Sq, H, D), lse.view(H, B, Sq).transpose(0, 1)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------
# 7. Causality auditor: does an attention implementation leak the future or across documents?
# ---------------------------------------------------------------------------------------------
# Bitwise and black-box: run the implementation on an adversarial packed batch, then again with
# one token's q, k or v replaced by a large outlier (enough to move any data-dependent scale:
# per-token, per-block, per-tensor). Every output row that must not depend on that token (earlier
# rows of its document, every row of other documents) must stay bit-identical, LSE too when the
# implementation returns it. The layout has documents that start mid-block, lengths 1/31/32/33,
# an empty document and a long one; positions probe the middle and the end of scale blocks.
AUDIT_DOC_LENS = (33, 1, 31, 0, 32, 161)


def audit_causality(attn_fn, *, heads=2, kv_heads=None, head_dim=64, doc_lens=AUDIT_DOC_LENS, positions=None,
                    tensors=("q", "k", "v"), outlier=1e3, device=None, dtype=torch.bfloat16, seed=0):
    """Audit `attn_fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)` (flash-attn varlen
    signature, causal self-attention; may return out or (out, lse)).

    positions: {doc index: [positions]} to perturb (default: a few per document, see below).
    Returns a list of findings, one per (doc, position, tensor, kind) that leaked, each a dict with
    kind "future" (an earlier row of the same document changed) or "document" (a row of another
    document changed), the number of changed rows and the largest absolute change. [] means safe.
    """
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    kv_heads = kv_heads or heads
    gen = torch.Generator().manual_seed(seed)
    offsets = [0] + torch.cumsum(torch.tensor(doc_lens), 0).tolist()
    T = offsets[-1]
    cu = torch.tensor(offsets, dtype=torch.int32, device=device)
    base = {n: torch.randn(T, h, head_dim, generator=gen).to(dtype).to(device)
            for n, h in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    max_len = max(doc_lens)

    def run(x):
        out = attn_fn(x["q"], x["k"], x["v"], cu, cu, max_len, max_len)
        o, lse = out if isinstance(out, tuple) else (out, None)
        rows = o.reshape(T, -1)  # (T, H*D) per token
        if lse is not None:  # flash-attn layout (H, T)
            rows = torch.cat([rows.float(), lse.reshape(-1, T).t().float()], dim=1)
        return rows.float()

    ref = run(base)
    doc_of = torch.searchsorted(torch.tensor(offsets), torch.arange(T), right=True) - 1
    if positions is None:  # the middle and the end of the first block, and a late token, per document
        positions = {d: sorted({p for p in (L // 2, min(L - 1, 20), L - 1) if 0 < p < L})
                     for d, L in enumerate(doc_lens) if L > 1}
    findings = []
    for d, plist in positions.items():
        for p in plist:
            t = offsets[d] + p
            for name in tensors:
                x = dict(base)
                x[name] = base[name].clone()
                x[name][t] = outlier * torch.sign(torch.randn(x[name][t].shape, generator=gen)).to(dtype).to(device)
                out = run(x)
                changed = (out != ref).any(dim=1).cpu()  # bitwise, per token row
                diff = (out - ref).abs().amax(dim=1).cpu()
                earlier = (doc_of == d) & (torch.arange(T) < t)
                for kind, rows in (("future", earlier & changed), ("document", (doc_of != d) & changed)):
                    if rows.any():
                        findings.append(dict(doc=d, position=p, tensor=name, kind=kind, rows=int(rows.sum()),
                                             max_abs_change=float(diff[rows].nan_to_num(float("inf")).max())))
    return findings


def varlen_adapter(dense_fn):
    """Wrap a causal attention callable on (batch, seqlen, heads, head_dim) tensors so that
    audit_causality can drive it: the documents become the batch (padded with zeros at their end,
    which a causal row never sees), all in ONE call, so statistics shared across the batch (a
    per-tensor scale, say) show up as document leaks."""
    def fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k):
        offs = [(a, b) for a, b in zip(cu_seqlens_q[:-1].tolist(), cu_seqlens_q[1:].tolist()) if b > a]
        S = max(b - a for a, b in offs)

        def batch(x):  # (T, H, D) -> (B, S, H, D)
            out = x.new_zeros(len(offs), S, *x.shape[1:])
            for i, (a, b) in enumerate(offs):
                out[i, :b - a] = x[a:b]
            return out
        o = dense_fn(batch(q), batch(k), batch(v))
        return torch.cat([o[i, :b - a] for i, (a, b) in enumerate(offs)])
    return fn
