"""
flamia_hopper: FlashAttention-3-style Gluon kernels for Hopper (sm_90, triton 3.6) that compute the
functions of flamia.py's forward and backward for recipe="mxfp8" (block_tokens 1, and 128 with the
per-tile safeguard) and recipe="bf16". flamia.py imports it when it is present and uses it for
backend="gluon" (and by default where it measured faster). Tested on the H200 by test_flamia.py's
GPU tests: oracle agreement, audit_causality, determinism.

THE FORWARD
The schedule (persistent: one CTA per SM walks work items = (query tile of 128 rows, head))
----------------------------------------------------------------------------------------------------
Work item i = query tile i // H of the Plan's tile table (heavy tiles first: LPT) and head i % H;
CTA p takes item p of every even round of P items (P = number of SMs) and item P-1-p of every odd
one (_item: the snake order balances the LPT-sorted work). Every partition computes the item's
geometry from the table itself (_work_item). Nothing drains between items: the K/V ring's position
runs on across items, and Q has two buffers, so the loader fetches item t+1's Q and first key tiles
while the consumers finish item t and write its O (which a grid of one CTA per item serializes).

Three partitions (gl.warp_specialize), 9 warps. Launch with maxnreg=168: the 9 warps are padded to
3 warpgroups and 3 x 128 x 168 registers are redistributed by setmaxnreg to 240 / 240 / 24.

  loader (1 warp, 24 regs), per item t:
      Loads the item's Q (two 64-row TMA boxes, one per consumer warpgroup w, ring position 2t + w
      of four: the next item's Q loads while this one runs), then walks the document's key tiles
      j = 0 .. n_kt-1 through a ring of STAGES shared-memory slots, ring position
      c = (key tiles of earlier items) + j, slot c % STAGES:
        wait kv_empty[s]                              (both consumers are done with slot s)
        TMA K_j   -> k_s[s],  arrives on k_ready[s]   (expect-tx barrier)
        TMA V_j^T -> v_s[s],  arrives on v_ready[s]   (S can start before V lands)
        mxfp8: load the tile's 2 x 128 scale bytes, store 2^(ek-127) (fp32) and ev-127 (int32)
               to sk_s[s], ev_s[s], then arrive on sc_ready[s] (ONE_SCALE tiles skip the wait).
      Slots and phases come from _acquire_filled / _acquire_free / _release only; Ring lists
      every barrier with who arrives and who waits. The scales are plain loads by this warp, which
      runs STAGES tiles ahead and so hides their latency (loaded in the consumers they sat on the
      critical path).
      B_t=128, causal: the masked (diagonal) tiles come from the per-token copies KS, VS, EKS, EVS
      instead (flamia's per-tile causal safeguard).
  consumer w=0 (4 warps, 240 regs):  one warpgroup = 64 query rows (rows 0..63 of the tile)
  consumer w=1 (4 warps, 240 regs):  rows 64..127. Both read the same slots: kv_empty is
                                     initialised with count 2. After an item's last S each
                                     arrives on its q_empty, then writes the item's O and LSE.

Per consumer warpgroup, key tile j (S_j = Q K_j^T is already in registers; S_0 before the loop):
    wait k_ready[j+1]; issue S_{j+1}   (async wgmma, smem x smem: it runs on the tensor core ...)
    wait sc_ready[j]; softmax(S_j) -> P_j, alpha_j        (... while the CUDA cores / MUFU do this)
    O *= alpha_j;  wait v_ready[j];  issue O += P_j V_j   (async wgmma, P from registers)
    wgmma_wait(1) -> S_{j+1};  wgmma_wait(0) -> O;  arrive kv_empty[j]
and the other warpgroup's softmax runs under this one's P V. Every MMA is retired in the step that
issued it, for two facts of ptxas (seen in the SASS): it cannot follow an accumulator that is
in flight across a loop's back edge (it then serializes every MMA, warning C7514), and it places a
wgmma wait as early as the wait's own dependencies allow, so a softmax can only overlap an MMA
issued before it and waited for after it: FA3's "issue P_{j-1} V_{j-1}, softmax, wait" order
compiled to a wait before the softmax. Tiles every row sees in full (no mask) come first; the
masked ones (diagonal, document end) issue S_{j+1} after P_j V_j instead (their mask temporaries
and a second S do not fit in 240 registers); the last tile issues no S.

With B_t a multiple of BLOCK_N (128), an unmasked tile lies inside one scale block: its two
exponents are scalars (ONE_SCALE, loaded one tile ahead from global memory), K's scale joins the
row factor and V's rides in the exp2's offset: no per-element scale multiplies, the softmax costs
what bf16's does (the unmasked step has about two thirds of the instructions of per-token scales).

Where the scales enter (MXFP8; the numerics of flamia's _attn_fwd_step, per key, B_t=1 or 128):
    s     = (Q8 K8^T)[i, j] * 2^(ek_j - 127)                    column scale on the fp32 S (1 FMUL)
    m_i   = max(m_i, rowmax(s) * qscale_i)     qscale_i = 2^(eq_i - 127) * softmax_scale * log2(e)
    ref_i = max(ref_i, max ev_j over the keys row i SEES)       (visible keys only: no future leak)
    p_r   = exp2(s * qscale_i - m_i - (ref_i - 8))              row part of V's scale in the offset
    l_i   = l_i * exp2(m_old - m_i) + sum_j p_r * 2^(ref_i - 8) l in real units
    P8    = E4M3(p_r * 2^ev_j)  (<= 2^8, never saturates)       V's per-key scale folded into P
    O    += P8 @ V8^T-tile     O in units of 2^(ref_i - 8), rescaled by exp2(dm + dref) per row.

Packed documents: TMA boxes start at any token row. Rows of a K box past the document end belong to
the next document (or are zero-filled past the tensor end): they get -inf in S, exactly as in the tl
kernel, so P is exactly 0 there and the V columns they meet contribute 0 * finite = 0. The
token-transposed V's descriptor ends at the last document's padded end (v_len = plan.pad_k[-1]): the
quantizer leaves the rest of its buffer uninitialized, and a NaN byte there would give
0 * NaN = NaN. A NaN inside the next document's V still reaches this tile through 0 * NaN: flamia's
documented caveat for non-finite inputs (check_finite rejects them). Q rows past the document end
are computed and never stored (masked stores of O and LSE).

Limits: D in {64, 128}; B_t in {1, 128} (128 causal only where flamia's _tile_safeguard holds for
128-wide tiles); B_t = 32/64 causal (per-pair safeguard) stay on flamia's tl kernel; bf16 inputs
(fp16 was not validated); Tq*H*D < 2^31.
"""
import functools

import torch
import triton
# Gluon's API moves between triton versions: this file is written for the H200 machine's triton 3.6.
# Elsewhere these imports (or unavailable_reason) fail, and flamia.py keeps its portable tl kernels.
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.experimental.gluon.language.nvidia.hopper import (tma, mbarrier, warpgroup_mma,
                                                              warpgroup_mma_wait, fence_async_shared)
from triton.language.core import _aggregate as aggregate  # 3.6's (private) name; gl.aggregate later
from triton.experimental.gluon.language._core import builtin
from triton._C.libtriton import ir

# The rules live in flamia.py once: a tile's key range with the causal safeguard (_key_range), the
# backward's query range (_query_range), the tile table's columns and E8M0's 2^e (_exp2_int). Gluon
# kernels call those @triton.jit functions (scalars, or elementwise on any layout); flamia.py imports
# this file mid-way, so they are looked up on the module when a kernel compiles.
import flamia


# flamia.py checks this: the exponent rows are read in its padded token layout (H, T_padded).
PADDED_EXPONENTS = True


def unavailable_reason():
    """None where the Gluon forward can run (triton 3.6, an sm_90 GPU), else why not."""
    if not triton.__version__.startswith("3.6"):
        return (f"flamia_hopper.py is written for triton 3.6 (Gluon's API moves), "
                f"found {triton.__version__}")
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability()[0] != 9:
        cap = "".join(map(str, torch.cuda.get_device_capability()))
        return f"flamia_hopper.py needs an sm_90 GPU (Hopper), found sm_{cap}"
    return None



# ------------------------------------------------------------------------------------------------
# layouts
# ------------------------------------------------------------------------------------------------
@gluon.constexpr_function
def _mma_layout(dtype, N):
    # one warpgroup (4 warps) x 64 rows; K of the instruction: 32 bytes
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                     instr_shape=[16, N, 256 // dtype.primitive_bitwidth])

@gluon.jit
def _row_reduce(x, SUM: gl.constexpr):
    """Max (or sum with SUM) over each row of an accumulator tile, as a tree. A thread holds a
    row's values in N/8 pairs, and gl.max/gl.sum chain them: 32 dependent instructions per row at
    N = 128, whose latency two consumer warps per scheduler do not hide (ncu, unmasked fp8 step:
    34% of its stall samples were fixed-latency dependency waits). Viewed as [64, 4, N/32, 8] (the
    same registers) they reduce in three short levels: longest chain 33 -> 9 in the SASS, the same
    instructions, no data movement (the convert_layout back is asserted trivial). Sums add in
    another order than gl.sum's: a last-bit difference, deterministic."""
    M: gl.constexpr = x.shape[0]
    N: gl.constexpr = x.shape[1]
    t = gl.reshape(x, [M, 4, N // 32, 8])
    if SUM:
        r = gl.sum(gl.sum(gl.sum(t, 2), 1), 1)
    else:
        r = gl.max(gl.max(gl.max(t, 2), 1), 1)
    return gl.convert_layout(r, gl.SliceLayout(1, x.type.layout), assert_trivial=True)

@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """global[box at coord] += src (shared memory), by TMA (cp.reduce.async.bulk.tensor.add): one
    instruction per tile where atomics take one per element. Triton 3.6's Gluon builder has the op,
    its Python API does not yet; completion is tracked like a TMA store's (tma.store_wait)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                              src.handle)

# ------------------------------------------------------------------------------------------------
# rings of shared-memory slots and their mbarriers
# ------------------------------------------------------------------------------------------------
# A ring position c (a count that runs on across work items) uses slot c % STAGES. A barrier
# completes once per lap of the ring, so the phase a waiter needs is the lap's parity (c // STAGES) & 1.
# These three helpers are the only places that compute a slot or a phase.
@gluon.jit
def _acquire_filled(bars, c, STAGES: gl.constexpr):
    """Consumer side: wait until the producer has filled ring position c."""
    mbarrier.wait(bars.index(c % STAGES), (c // STAGES) & 1)

@gluon.jit
def _acquire_free(bars, c, STAGES: gl.constexpr):
    """Producer side: wait until the consumers released position c - STAGES (the slot's previous
    lap). The previous lap's parity: on the first lap a fresh barrier passes at once."""
    mbarrier.wait(bars.index(c % STAGES), ((c // STAGES) & 1) ^ 1)

@gluon.jit
def _release(bars, c, STAGES: gl.constexpr):
    mbarrier.arrive(bars.index(c % STAGES), count=1)

@aggregate
class Ring:
    """The forward's shared memory, passed to every partition as one value. Barriers (count: who
    arrives -> who waits):
      q_bar[4]     (1, expect-tx: TMA)  loader's Q box      -> consumer WG w, position 2t + w
      q_empty[4]   (1) consumer WG w after its item's last S -> loader, before the next Q there
      k_ready[S]   (1, expect-tx: TMA)  K tile              -> both consumers, before S = Q K^T
      v_ready[S]   (1, expect-tx: TMA)  V^T tile            -> both consumers, before O += P V
      sc_ready[S]  (1) loader, scales staged in sk_s/ev_s   -> both consumers, before the softmax
      kv_empty[S]  (2) each consumer WG after its P V       -> loader, before refilling the slot"""
    q_s: gl.shared_memory_descriptor
    k_s: gl.shared_memory_descriptor
    v_s: gl.shared_memory_descriptor
    sk_s: gl.shared_memory_descriptor
    ev_s: gl.shared_memory_descriptor
    q_bar: gl.shared_memory_descriptor
    q_empty: gl.shared_memory_descriptor
    k_ready: gl.shared_memory_descriptor
    v_ready: gl.shared_memory_descriptor
    sc_ready: gl.shared_memory_descriptor
    kv_empty: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, q_s, k_s, v_s, sk_s, ev_s, q_bar, q_empty, k_ready, v_ready, sc_ready,
                 kv_empty):
        self.q_s = q_s
        self.k_s = k_s
        self.v_s = v_s
        self.sk_s = sk_s
        self.ev_s = ev_s
        self.q_bar = q_bar
        self.q_empty = q_empty
        self.k_ready = k_ready
        self.v_ready = v_ready
        self.sc_ready = sc_ready
        self.kv_empty = kv_empty

@gluon.jit
def _stage_scales(EK, EV, EKS, EVS, sk_slot, ev_slot, n0, kd_end, per_token,
                  BLOCK_N: gl.constexpr):
    """Loader: the key tile's scales into its ring slot, ready for the softmax (2^(ek-127) fp32,
    ev-127 int32). The exponent pointers are indexed by token (see _attn_fwd_hopper)."""
    sl: gl.constexpr = gl.BlockedLayout([BLOCK_N // 32], [32], [1], [0])
    offs = n0 + gl.arange(0, BLOCK_N, layout=sl)
    # past the document: ek -> 2^0, ev -> -126 (never raises the reference exponent)
    km = offs < kd_end
    if per_token:  # diagonal tiles of B_t=128: the per-token copies
        ek = gl.load(EKS + offs, mask=km, other=127)
        ev = gl.load(EVS + offs, mask=km, other=1)
    else:
        ek = gl.load(EK + offs, mask=km, other=127)
        ev = gl.load(EV + offs, mask=km, other=1)
    sk_slot.store(flamia._exp2_int(ek.to(gl.int32)))
    ev_slot.store(ev.to(gl.int32) - 127)

@gluon.jit
def _item(t):
    """The work item of this CTA's t-th round. Items are sorted heaviest first (LPT); rounds
    alternate direction (CTA p takes the p-th item of even rounds and the p-th from the end of odd
    ones), so that every CTA's sum of work is near the mean: in plain round-robin CTA 0 takes the
    heaviest item of every round (measured 3-7% slower than a grid of one CTA per item on one long
    document, where the hardware hands out CTAs greedily)."""
    p = gl.program_id(0)
    n = gl.num_programs(0)
    return t * n + gl.where(t % 2 == 0, p, n - 1 - p)

@gluon.jit
def _items_of_cta(n_items):
    """How many rounds of _item this CTA runs: all full rounds, and the last partial one if it
    reaches this CTA (the first CTAs on an even round, the last ones on an odd one)."""
    p = gl.program_id(0)
    n = gl.num_programs(0)
    full = n_items // n
    rest = n_items % n
    mine = gl.where(full % 2 == 0, p < rest, p >= n - rest)
    return full + mine.to(gl.int32)

@gluon.jit
def _work_item(TILES, item, H, HK, BLOCK_N: gl.constexpr, BLOCK_TOKENS: gl.constexpr,
               CAUSAL: gl.constexpr, TILE_SAFEGUARD: gl.constexpr, QUANT: gl.constexpr):
    """Work item `item` of the persistent launch: query tile item // H of the Plan's tile table
    (heads fastest, so the table's LPT order holds across heads), head item % H. Every partition
    computes it from the table (a few scalar loads) rather than receiving it. Returns the tile's
    TileRow, the head, its K/V head, where V^T and the exponent rows place the key document (padded
    token layout) and the key tiles: n_kt in all, the first n_unmasked of which every row sees in
    full."""
    h = item % H
    tile = flamia._tile_row(TILES, item // H, True)
    v_base = gl.load(tile.row + flamia.OTHER_PAD) if QUANT else tile.other_start
    n_full, n_end = flamia._key_range(tile, BLOCK_N, BLOCK_TOKENS, CAUSAL, TILE_SAFEGUARD)
    return tile, h, h // (H // HK), v_base, (n_end + BLOCK_N - 1) // BLOCK_N, n_full // BLOCK_N

# ------------------------------------------------------------------------------------------------
# loader partition (1 warp): TMA into the ring
# ------------------------------------------------------------------------------------------------
@gluon.jit
def _loader(q_desc, k_desc, v_desc, ks_desc, vs_desc, ring, exps, TILES, T_KPAD, H, HK, n_items,
            D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, BLOCK_TOKENS: gl.constexpr,
            CAUSAL: gl.constexpr, QUANT: gl.constexpr, TILE_SAFEGUARD: gl.constexpr):
    _, EK, EV, EKS, EVS = exps
    c0 = 0  # ring position of the item's first key tile: the ring runs on across items
    for t in range(_items_of_cta(n_items)):  # Q buffer t % 2
        tile, h, hk, v_base, n_kt, n_unmasked = _work_item(TILES, _item(t), H, HK, BLOCK_N, BLOCK_TOKENS,
                                                           CAUSAL, TILE_SAFEGUARD, QUANT)
        kd_start = tile.other_start
        # Q of item t, warpgroup w's 64 rows: ring position 2t + w of 4 (two items in flight)
        for w in gl.static_range(2):
            b = (2 * t + w) % 4
            _acquire_free(ring.q_empty, 2 * t + w, 4)
            mbarrier.expect(ring.q_bar.index(b), q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [tile.start + w * 64, h * D], ring.q_bar.index(b),
                                            ring.q_s.index(b))
        col = hk * T_KPAD + (v_base - kd_start)  # exponent rows indexed by token (see _work_item)
        for j in range(n_kt):
            c = c0 + j
            s = c % STAGES
            _acquire_free(ring.kv_empty, c, STAGES)
            n0 = kd_start + j * BLOCK_N
            v0 = v_base + j * BLOCK_N
            k_ready = ring.k_ready.index(s)
            v_ready = ring.v_ready.index(s)
            mbarrier.expect(k_ready, k_desc.block_type.nbytes)
            mbarrier.expect(v_ready, v_desc.block_type.nbytes)
            if TILE_SAFEGUARD:
                if j >= n_unmasked:  # diagonal tiles of B_t=128: the per-token copies
                    tma.async_copy_global_to_shared(ks_desc, [n0, hk * D], k_ready, ring.k_s.index(s))
                    tma.async_copy_global_to_shared(vs_desc, [hk * D, v0], v_ready, ring.v_s.index(s))
                else:
                    tma.async_copy_global_to_shared(k_desc, [n0, hk * D], k_ready, ring.k_s.index(s))
                    tma.async_copy_global_to_shared(v_desc, [hk * D, v0], v_ready, ring.v_s.index(s))
            else:
                tma.async_copy_global_to_shared(k_desc, [n0, hk * D], k_ready, ring.k_s.index(s))
                if QUANT:  # V token-transposed (HK*D, T_pad): box [D, BLOCK_N]
                    tma.async_copy_global_to_shared(v_desc, [hk * D, v0], v_ready, ring.v_s.index(s))
                else:  # V row-major (Tk, HK*D): box [BLOCK_N, D]
                    tma.async_copy_global_to_shared(v_desc, [n0, hk * D], v_ready, ring.v_s.index(s))
            if QUANT:
                # The tile's scales, by ordinary loads from this warp (it runs STAGES tiles ahead,
                # which hides their latency), staged as 2^(ek-127) fp32 and ev - 127 int32 so that
                # the consumers do no global loads and no conversions.
                _stage_scales(EK + col, EV + col, EKS + col, EVS + col, ring.sk_s.index(s),
                              ring.ev_s.index(s), n0, kd_start + tile.k_len,
                              TILE_SAFEGUARD and j >= n_unmasked, BLOCK_N)
                _release(ring.sc_ready, c, STAGES)
        c0 += n_kt

# ------------------------------------------------------------------------------------------------
# consumer partition (one warpgroup, 64 query rows)
# ------------------------------------------------------------------------------------------------
@gluon.jit
def _softmax(s, m_i, l_i, ref_i, qscale, rows, offs_n, SK, EVR, ek1, ev1, tile, CAUSAL: gl.constexpr,
             QUANT: gl.constexpr, MASKED: gl.constexpr, ONE_SCALE: gl.constexpr):
    """Online softmax of one key tile (see the header): returns P (fp32, S's layout), the row
    factor for O, and the new m, l, ref. ONE_SCALE: the tile lies in one scale block, whose
    exponents ek1 (biased) and ev1 (unbiased) are scalars: K's scale joins the row factor and V's
    rides in the exp2's offset (flamia's ONE_SCALE path: two multiplies per element fewer).
    ONE_SCALE tiles reduce their rows as trees (_row_reduce: the kernel measured 3-5% faster on
    long documents and GQA); on the other tiles trees measured slower (per-token scales: that step
    spills more; bf16), and gl.max/gl.sum stay."""
    if ONE_SCALE:
        qs = qscale * flamia._exp2_int(ek1)
        m_new = gl.maximum(m_i, _row_reduce(s, False) * qs)
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
        ref_new = gl.maximum(ref_i, ev1)
        # a tile more than 2^64 below the reference (an all-zero V block: ev1 = -126) would
        # underflow p out of the sum: ev_floor keeps it (its P rounds to E4M3 zero either way)
        ev_floor = gl.maximum(ref_new - 64, ev1)
        p = gl.exp2(s * gl.expand_dims(qs, 1)
                    - gl.expand_dims(m_use + (ref_new - 8 - ev_floor).to(gl.float32), 1))
        l_i = (l_i * gl.exp2(m_i - m_use)
               + _row_reduce(p, True) * flamia._exp2_int(127 - ev_floor)
               * flamia._exp2_int(ref_new + 119))
        alpha = gl.exp2((m_i - m_use) + (ref_i - ref_new).to(gl.float32))
        return p, alpha, m_new, l_i, ref_new
    kmask = offs_n < tile.other_start + tile.k_len
    if QUANT:
        col_l: gl.constexpr = gl.SliceLayout(0, s.type.layout)
        ev = EVR.load(col_l)  # staged by the loader: ev - 127 (int32) and 2^(ek - 127) (fp32)
        s = s * gl.expand_dims(SK.load(col_l), 0)
    if MASKED:  # keys past the document end; (causal) keys after the row's position
        visible = gl.expand_dims(kmask, 0)
        if CAUSAL:
            pos_q = rows - tile.doc_start + tile.shift  # bottom-right alignment
            visible = visible & (gl.expand_dims(offs_n - tile.other_start, 0) <= gl.expand_dims(pos_q, 1))
        s = gl.where(visible, s, float("-inf"))
    # the row max is taken before the row factor: qscale > 0 and rounding is monotonic
    m_new = gl.maximum(m_i, gl.max(s, 1) * qscale)
    m_use = gl.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen no key yet
    if QUANT:
        if MASKED:
            ref_new = gl.maximum(ref_i, gl.max(gl.where(visible, gl.expand_dims(ev, 0), -1000), 1))
        else:  # every row sees every key of the tile
            ref_new = gl.maximum(ref_i, gl.max(ev, 0))
        p_r = gl.exp2(s * gl.expand_dims(qscale, 1)
                      - gl.expand_dims(m_use + (ref_new - 8).to(gl.float32), 1))
        l_i = l_i * gl.exp2(m_i - m_use) + gl.sum(p_r, 1) * flamia._exp2_int(ref_new + 119)  # 2^(ref - 8)
        alpha = gl.exp2((m_i - m_use) + (ref_i - ref_new).to(gl.float32))  # one exp2: max and ref
        p = p_r * gl.expand_dims(flamia._exp2_int(ev + 127), 0)
    else:
        ref_new = ref_i
        p = gl.exp2(s * gl.expand_dims(qscale, 1) - gl.expand_dims(m_use, 1))
        alpha = gl.exp2(m_i - m_use)
        l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, m_new, l_i, ref_new

@gluon.jit
def _v_operand(v_s, st, QUANT: gl.constexpr):
    if QUANT:  # token-transposed slot [D, BLOCK_N]: K-major B operand, as fp8 wgmma needs
        return v_s.index(st).permute((1, 0))
    else:  # row-major slot [BLOCK_N, D]: MN-major B operand (16-bit wgmma takes it)
        return v_s.index(st)

@gluon.jit
def _block_scales(exps_d, n, kd_len):
    """ONE_SCALE: the exponents of the scale block at document-relative key n (ek biased, ev
    unbiased; past the document: 2^0 and -126, which never raise the reference exponent), from
    exps_d: the exponent rows of K and V at the document's first key."""
    EKd, EVd = exps_d
    ek = gl.load(EKd + n, mask=n < kd_len, other=127).to(gl.int32)
    return ek, gl.load(EVd + n, mask=n < kd_len, other=1).to(gl.int32) - 127

@gluon.jit
def _issue_s(c, q, ring, BLOCK_N: gl.constexpr, STAGES: gl.constexpr):
    """S = Q K^T for the key tile at ring position c, asynchronously (a token)."""
    _acquire_filled(ring.k_ready, c, STAGES)
    return warpgroup_mma(q, ring.k_s.index(c % STAGES).permute((1, 0)),
                         gl.zeros([64, BLOCK_N], gl.float32, _mma_layout(q.dtype, BLOCK_N)),
                         use_acc=False, is_async=True)

@gluon.jit
def _step(j, c0, s, state, blk, q, qscale, rows, ring, exps_d, tile, BLOCK_N: gl.constexpr,
          STAGES: gl.constexpr, CAUSAL: gl.constexpr, QUANT: gl.constexpr, MASKED: gl.constexpr,
          LAST: gl.constexpr, ONE_SCALE: gl.constexpr):
    """Key tile j (ring position c0 + j), whose S_j is in registers: issue S_{j+1} (unless LAST),
    softmax(S_j) while it runs, O = alpha_j O + P_j V_j. blk: this tile's ONE_SCALE exponents (ek,
    ev; _block_scales). Returns S_{j+1} (S_j when LAST), the new state (O, m, l, ref) and the next
    tile's blk.
    MASKED tiles issue S_{j+1} after P_j V_j instead: their mask temporaries and S_{j+1}'s 64
    accumulator registers do not fit together in 240 (ptxas spilled ~0.7 KB), and they are one or
    two tiles per query tile."""
    acc, m_i, l_i, ref_i = state
    ek1, ev1 = blk
    dtype: gl.constexpr = q.dtype
    s_layout: gl.constexpr = s.type.layout
    o_layout: gl.constexpr = acc.type.layout
    c = c0 + j
    st = c % STAGES
    if not LAST and not MASKED:
        s_tok = _issue_s(c + 1, q, ring, BLOCK_N, STAGES)
    offs_n = tile.other_start + j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    one: gl.constexpr = ONE_SCALE and not MASKED
    if QUANT and not one:
        _acquire_filled(ring.sc_ready, c, STAGES)
    p, alpha, m_i, l_i, ref_i = _softmax(s, m_i, l_i, ref_i, qscale, rows, offs_n,
                                         ring.sk_s.index(st), ring.ev_s.index(st), ek1, ev1, tile,
                                         CAUSAL, QUANT, MASKED, one)
    if one:  # the next tile's scalar scales, loaded a tile ahead (their latency hides here)
        ek1, ev1 = _block_scales(exps_d, (j + 1) * BLOCK_N, tile.k_len)
    acc = acc * gl.expand_dims(gl.convert_layout(alpha, gl.SliceLayout(1, o_layout)), 1)
    p = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(
        operand_index=0, parent=o_layout, k_width=32 // dtype.primitive_bitwidth))
    _acquire_filled(ring.v_ready, c, STAGES)
    acc_tok = warpgroup_mma(p, _v_operand(ring.v_s, st, QUANT), acc, is_async=True)
    if not LAST and MASKED:
        s_tok = _issue_s(c + 1, q, ring, BLOCK_N, STAGES)
    if not LAST:
        s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
    # Every MMA this step issued is retired inside it: ptxas cannot follow an accumulator that is
    # in flight across the loop's back edge (it serializes every MMA then), and it places a wait
    # for an MMA as early as it can, so the softmax overlaps the MMA issued BEFORE it (S_{j+1}).
    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc_tok,))
    _release(ring.kv_empty, c, STAGES)  # K_j and V_j are consumed
    return s, (acc, m_i, l_i, ref_i), (ek1, ev1)

@gluon.jit
def _consumer(ring, exps, out, TILES, sm_scale_log2, T_Q, T_QPAD, T_KPAD, H, HK, n_items,
              WG: gl.constexpr, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
              BLOCK_TOKENS: gl.constexpr, CAUSAL: gl.constexpr, QUANT: gl.constexpr,
              TILE_SAFEGUARD: gl.constexpr, ONE_SCALE: gl.constexpr):
    EQ, EK, EV, _, _ = exps
    O, LSE = out
    dtype: gl.constexpr = ring.q_s.dtype
    s_layout: gl.constexpr = _mma_layout(dtype, BLOCK_N)
    o_layout: gl.constexpr = _mma_layout(dtype, D)
    row_l: gl.constexpr = gl.SliceLayout(1, s_layout)
    orow_l: gl.constexpr = gl.SliceLayout(1, o_layout)
    c0 = 0  # ring position of the item's first key tile (the loader's count)
    for t in range(_items_of_cta(n_items)):  # Q buffer t % 2
        tile, h, hk, v_base, n_kt, n_unmasked = _work_item(TILES, _item(t), H, HK, BLOCK_N, BLOCK_TOKENS,
                                                           CAUSAL, TILE_SAFEGUARD, QUANT)
        rows = tile.start + WG * 64 + gl.arange(0, 64, layout=row_l)
        qmask = rows < tile.end
        # Exponent rows (H, T_padded) use the padded token layout (a document at its 16-aligned
        # column): pointers shifted so that they are indexed by token, head and document included.
        exps_d = (EK + hk * T_KPAD + v_base, EV + hk * T_KPAD + v_base)  # this document's first key
        if QUANT:
            own_pad = gl.load(tile.row + flamia.OWN_PAD)
            eq = gl.load(EQ + h * T_QPAD + (own_pad - tile.doc_start) + rows, mask=qmask, other=127)
            qscale = flamia._exp2_int(eq.to(gl.int32)) * sm_scale_log2
        else:
            qscale = gl.full([64], 1.0, gl.float32, row_l) * sm_scale_log2
        # (O, row max, row sum, V's reference exponent: >= -100 keeps 2^(8-ref) finite)
        state = (gl.zeros([64, D], gl.float32, o_layout), gl.full([64], float("-inf"), gl.float32, row_l),
                 gl.zeros([64], gl.float32, row_l), gl.full([64], -100, gl.int32, row_l))
        _acquire_filled(ring.q_bar, 2 * t + WG, 4)
        q = ring.q_s.index((2 * t + WG) % 4)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(_issue_s(c0, q, ring, BLOCK_N, STAGES),))
        blk = (0, 0)
        if ONE_SCALE:
            blk = _block_scales(exps_d, 0, tile.k_len)
        # Tiles every row sees in full (no mask), then the masked ones; the last issues no S.
        n_free = gl.minimum(n_unmasked, n_kt - 1)
        for j in range(0, n_free):
            s, state, blk = _step(j, c0, s, state, blk, q, qscale, rows, ring, exps_d, tile, BLOCK_N,
                                  STAGES, CAUSAL, QUANT, False, False, ONE_SCALE)
        for j in range(n_free, n_kt - 1):
            s, state, blk = _step(j, c0, s, state, blk, q, qscale, rows, ring, exps_d, tile, BLOCK_N,
                                  STAGES, CAUSAL, QUANT, True, False, ONE_SCALE)
        if n_kt - 1 < n_unmasked:
            s, state, blk = _step(n_kt - 1, c0, s, state, blk, q, qscale, rows, ring, exps_d, tile,
                                  BLOCK_N, STAGES, CAUSAL, QUANT, False, True, ONE_SCALE)
        else:
            s, state, blk = _step(n_kt - 1, c0, s, state, blk, q, qscale, rows, ring, exps_d, tile,
                                  BLOCK_N, STAGES, CAUSAL, QUANT, True, True, ONE_SCALE)
        acc, m_i, l_i, ref_i = state
        _release(ring.q_empty, 2 * t + WG, 4)  # every S of this item is retired
        c0 += n_kt
        # epilogue: O = acc / l (back from units of 2^(ref - 8)), LSE in natural log. The loader
        # is already fetching the next item's Q, K and V meanwhile.
        if QUANT:
            acc = acc * gl.expand_dims(gl.convert_layout(flamia._exp2_int(ref_i + 119), orow_l), 1)
        l_safe = gl.where(l_i == 0.0, 1.0, l_i)
        o = acc / gl.expand_dims(gl.convert_layout(l_safe, orow_l), 1)
        m_use = gl.where(m_i == float("-inf"), 0.0, m_i)
        lse = gl.where(l_i == 0.0, float("-inf"), (m_use + gl.log2(l_safe)) * 0.6931471805599453)
        gl.store(LSE + h * T_Q + rows, lse, mask=qmask)
        rows_o = gl.convert_layout(rows, orow_l)
        offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
        ptrs = O + (gl.expand_dims(rows_o, 1) * H + h) * D + gl.expand_dims(offs_d, 0)
        omask = gl.expand_dims(rows_o < tile.end, 1) & gl.expand_dims(offs_d < D, 0)
        gl.store(ptrs, o.to(O.dtype.element_ty), mask=omask)

# ------------------------------------------------------------------------------------------------
# the kernel
# ------------------------------------------------------------------------------------------------
@gluon.jit
def _attn_fwd_hopper(q_desc, k_desc, v_desc, ks_desc, vs_desc, exps, out, TILES, sm_scale_log2, T_Q,
                     T_QPAD, T_KPAD, H, HK, n_items, D: gl.constexpr, BLOCK_N: gl.constexpr,
                     STAGES: gl.constexpr, BLOCK_TOKENS: gl.constexpr, CAUSAL: gl.constexpr,
                     QUANT: gl.constexpr, TILE_SAFEGUARD: gl.constexpr):
    """TMA descriptors of Q, K, V and the safeguard's KS, VS (triton 3.6 launches a descriptor only
    as a parameter of its own, never inside a tuple); exps: the exponent rows of Q, K, V, KS, VS;
    out: O, LSE (attn_fwd says what each holds)."""
    # Q: two buffers x two warpgroups (64 rows each), so the next item's Q loads during this one
    q_s = gl.allocate_shared_memory(q_desc.dtype, [4] + q_desc.block_type.shape, q_desc.layout)
    k_s = gl.allocate_shared_memory(k_desc.dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
    v_s = gl.allocate_shared_memory(v_desc.dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
    sc_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    sk_s = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_N], sc_l)
    ev_s = gl.allocate_shared_memory(gl.int32, [STAGES, BLOCK_N], sc_l)
    sc_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(4):
        mbarrier.init(q_bar.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=1)  # its warpgroup is done with the buffer
    for i in gl.static_range(STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(sc_ready.index(i), count=1)
        mbarrier.init(kv_empty.index(i), count=2)  # both consumer warpgroups release a slot
    # Unmasked tiles inside one scale block (B_t a multiple of BLOCK_N, both aligned to the
    # document start): their scales are two scalars
    ONE_SCALE: gl.constexpr = QUANT and BLOCK_TOKENS % BLOCK_N == 0
    ring = Ring(q_s, k_s, v_s, sk_s, ev_s, q_bar, q_empty, k_ready, v_ready, sc_ready, kv_empty)
    gl.warp_specialize([
        (_consumer, (ring, exps, out, TILES, sm_scale_log2, T_Q, T_QPAD, T_KPAD, H, HK, n_items, 0, D,
                     BLOCK_N, STAGES, BLOCK_TOKENS, CAUSAL, QUANT, TILE_SAFEGUARD, ONE_SCALE)),
        (_consumer, (ring, exps, out, TILES, sm_scale_log2, T_Q, T_QPAD, T_KPAD, H, HK, n_items, 1, D,
                     BLOCK_N, STAGES, BLOCK_TOKENS, CAUSAL, QUANT, TILE_SAFEGUARD, ONE_SCALE)),
        (_loader, (q_desc, k_desc, v_desc, ks_desc, vs_desc, ring, exps, TILES, T_KPAD, H, HK, n_items,
                   D, BLOCK_N, STAGES, BLOCK_TOKENS, CAUSAL, QUANT, TILE_SAFEGUARD)),
    ], [4, 1], [240, 24])


# ------------------------------------------------------------------------------------------------
# host side
# ------------------------------------------------------------------------------------------------
BLOCK_M = 128  # query rows per CTA (2 warpgroups x 64): the Plan's tile table must use this


def default_config(quant: bool, D: int) -> dict:
    """BLOCK_N, STAGES (quant: MXFP8 operands, else bf16). Shared memory: Q 2*64*D + STAGES*(K + V)
    tiles."""
    if not quant:
        return dict(BLOCK_N=128, STAGES=2 if D == 128 else 3)
    return dict(BLOCK_N=128, STAGES=4 if D == 128 else 5)


HEAD_DIMS = (64, 128)  # of both kernels: their tiles and shared-memory budgets are sized for these


def unsupported_reason(dtype, head_dim: int, safeguard_mode: str):
    """None when attn_fwd / attn_bwd compute this configuration of a recipe they serve (flamia's
    Recipe.backends; as validated on the H200), else why not. safeguard_mode: flamia's "off", "tile"
    or "pair" for the kernel's tiles."""
    if head_dim not in HEAD_DIMS:
        return f"head_dim {head_dim} (the Gluon kernels have {HEAD_DIMS})"
    if dtype != torch.bfloat16:
        return f"{dtype} inputs (only bfloat16 was validated on the GPU)"
    if safeguard_mode == "pair":
        return ("the per-pair causal safeguard (block_tokens 32 or 64, or 128 with causal shifts "
                "that are not multiples of 128)")
    return None


@functools.lru_cache(maxsize=None)
def _sm_count(device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


@functools.lru_cache(maxsize=None)
def _smem_layout(block: tuple, dtype):
    return gl.NVMMASharedLayout.get_default_for(list(block), dtype)


def _desc(t, shape, strides, block):
    """A TMA descriptor of a 2-D view of t. (Not cached: a cached descriptor would keep its tensor
    alive, and triton 3.6 re-encodes descriptors at every launch anyway; the layout is cached.)"""
    dtype = {torch.float8_e4m3fn: gl.float8e4nv, torch.bfloat16: gl.bfloat16,
             torch.float32: gl.float32}[t.dtype]
    return TensorDescriptor(t, list(shape), list(strides), list(block), _smem_layout(block, dtype))


def attn_fwd(q_data, q_exp, k_data, k_exp, v_data, v_exp, o, lse, tiles, *, softmax_scale, causal,
             block_tokens=1, per_token=None, v_len=None, config=None):
    """Launch the Gluon forward on flamia's operands: recipe mxfp8 where q_exp is given, else bf16.

    mxfp8: q_data (Tq, H, D) e4m3, q_exp (H, Tq_pad) u8; k_data (Tk, HK, D) e4m3, k_exp and v_exp
           (HK, Tk_pad) u8; v_data token-transposed (HK, D, Tk_pad) e4m3. Exponent rows and V^T
           share flamia's padded token layout (documents at 16-aligned columns).
    bf16:  q_data, k_data, v_data (T, H, D) as given; the *_exp are ignored.
    per_token: (ks, eks, vts, evs) per-token copies for B_t=128's per-tile safeguard (causal),
               else None.
    o (Tq, H, D), lse (H, Tq) fp32: outputs (pre-filled by the caller where rows see no key).
    tiles: plan.tiles(128, "q", causal).
    v_len: mxfp8: the written width of the token-transposed V (plan.pad_k[-1], the end of the last
    document's padding). The quantizer leaves the tail of its T_pad-wide buffer uninitialized; a V^T
    tile that reaches past v_len must read zeros there (TMA's out-of-bounds fill), never garbage: a
    NaN byte times P = 0 is NaN."""
    Tq, H, D = q_data.shape
    Tk, HK = k_data.shape[:2]
    quant = q_exp is not None
    cfg = dict(default_config(quant, D), **(config or {}))
    BN, STAGES = cfg["BLOCK_N"], cfg["STAGES"]
    qd = _desc(q_data, (Tq, H * D), (H * D, 1), (64, D))
    kd = _desc(k_data, (Tk, HK * D), (HK * D, 1), (BN, D))
    if quant:
        T_pad = v_data.shape[-1]
        v_len = T_pad if v_len is None else v_len
        vd = _desc(v_data, (HK * D, v_len), (T_pad, 1), (D, BN))
        EQ, EK, EV = q_exp, k_exp, v_exp
    else:
        vd = _desc(v_data, (Tk, HK * D), (HK * D, 1), (BN, D))
        EQ = EK = EV = lse  # unused
    tile_safeguard = per_token is not None
    if tile_safeguard:
        ks, eks, vts, evs = per_token
        ksd = _desc(ks, (Tk, HK * D), (HK * D, 1), (BN, D))
        vsd = _desc(vts, (HK * D, v_len), (vts.shape[-1], 1), (D, BN))
    else:  # None: no descriptors to encode at launch (TILE_SAFEGUARD's branch is compiled out)
        ksd, vsd, eks, evs = None, None, EK, EV
    n_items = tiles.shape[0] * H
    if n_items == 0:
        return o, lse
    ctas = min(n_items, _sm_count(o.device))  # persistent: one CTA per SM
    _attn_fwd_hopper[(ctas,)](qd, kd, vd, ksd, vsd, (EQ, EK, EV, eks, evs), (o, lse), tiles,
                              softmax_scale * 1.4426950408889634, Tq, EQ.shape[-1], EK.shape[-1],
                              H, HK, n_items,
                              D=D, BLOCK_N=BN, STAGES=STAGES, BLOCK_TOKENS=block_tokens,
                              CAUSAL=causal, QUANT=quant, TILE_SAFEGUARD=tile_safeguard,
                              num_warps=4, maxnreg=168)
    return o, lse


# ================================================================================================
# The backward: dK, dV per key tile in registers, dQ by TMA reduce-add (FA3's schedule)
# ================================================================================================
# It computes flamia's backward function (section 5b: bf16 MMAs on the forward's exactly dequantized
# operands; the safeguard's per-token copies KS, VS on the query tiles that straddle) with another
# schedule: one CTA per (key tile of 128 keys, K/V head). A loader warp streams the query tiles (Q,
# dO by TMA; LSE in log2 units and Delta staged) of every query head of the GQA group through a ring;
# two consumer warpgroups, 64 keys each, run per query tile ("swapAB": keys are the MMA's rows):
#     S^T = K Q^T, dP^T = V dO^T          (async wgmma, both in flight)
#     P^T = exp2(S^T * scale - lse);  dS^T = P^T (dP^T - Delta)
#     dV += P^T dO;  dK += dS^T Q         (P^T, dS^T from registers)
#     dQ[:, half w] = dS K[:, half w]  (both warpgroups' dS^T through shared memory: FA4's split),
#                                      added to an fp32 dQ by one TMA reduce-add per step (fp32
#                                      atomics with the tile safeguard, whose copies take dQ's smem).
# K and V (bf16 via TMA, or with FP8_KV the forward's MXFP8 data dequantized by the consumers into
# the same shared memory, once per CTA: no bf16 copies in memory) stay in shared memory, dK and dV
# in registers over all query tiles and heads; dQ's fp32 sum is converted by the host. Its adds run
# in no fixed order, so dQ's last bits vary: flamia's tl backward is the deterministic one.
# Rows past the query document (the next document's, or TMA's zeros past the tensor) get LSE = +inf,
# so P = 0 there without a mask; masks run only on the causal diagonal and on a key tile that ends
# inside its box (its last rows are the next document's keys: P must be 0 there, or dQ takes them).
@aggregate
class BwdSmem:
    """The backward's shared memory. Barriers (count: who arrives -> who waits):
      kv_ready     (1, expect-tx: TMA) K, V (and KS, VS) of the key tile -> both consumers, once;
                   (2) with FP8_KV each consumer WG, its 64 keys dequantized -> both consumers
      q_ready[S]   (1, expect-tx: TMA) Q and dO of ring position c       -> both consumers
      st_ready[S]  (1) loader, LSE (log2) and Delta staged               -> both consumers
      q_free[S]    (2) each consumer WG after its last MMA on the slot   -> loader
      ds_ready[2]  (2) each consumer WG, its dS^T rows stored in ds_s[c%2] -> both consumers' dQ
    dq_s[c%2, WG]: the warpgroup's dQ tile on its way to the TMA reduce-add; no barrier: the
    warpgroup that wrote it waits for the reduce issued two steps earlier (tma.store_wait)."""
    k_s: gl.shared_memory_descriptor
    v_s: gl.shared_memory_descriptor
    ks_s: gl.shared_memory_descriptor
    vs_s: gl.shared_memory_descriptor
    q_s: gl.shared_memory_descriptor
    do_s: gl.shared_memory_descriptor
    lse_s: gl.shared_memory_descriptor
    dl_s: gl.shared_memory_descriptor
    ds_s: gl.shared_memory_descriptor
    dq_s: gl.shared_memory_descriptor
    kv_ready: gl.shared_memory_descriptor
    q_ready: gl.shared_memory_descriptor
    st_ready: gl.shared_memory_descriptor
    q_free: gl.shared_memory_descriptor
    ds_ready: gl.shared_memory_descriptor

    @gluon.constexpr_function
    def __init__(self, k_s, v_s, ks_s, vs_s, q_s, do_s, lse_s, dl_s, ds_s, dq_s, kv_ready, q_ready,
                 st_ready, q_free, ds_ready):
        self.k_s = k_s
        self.v_s = v_s
        self.ks_s = ks_s
        self.vs_s = vs_s
        self.q_s = q_s
        self.do_s = do_s
        self.lse_s = lse_s
        self.dl_s = dl_s
        self.ds_s = ds_s
        self.dq_s = dq_s
        self.kv_ready = kv_ready
        self.q_ready = q_ready
        self.st_ready = st_ready
        self.q_free = q_free
        self.ds_ready = ds_ready

@gluon.jit
def _key_tile(TILES, BLOCK_M: gl.constexpr, BLOCK_TOKENS: gl.constexpr, CAUSAL: gl.constexpr,
              TILE_SAFEGUARD: gl.constexpr):
    """Key tile program_id(0) of the Plan's key-tile table (its TileRow), and flamia's query range
    for it (_attn_bwd_dkdv's q_lo, q_mid: query tiles [q_lo, q_mid) are masked, and with the
    safeguard use the per-token copies; rows are document-local)."""
    tile = flamia._tile_row(TILES, gl.program_id(0), False)
    q_lo, q_mid = flamia._query_range(tile, BLOCK_M, BLOCK_TOKENS, CAUSAL, TILE_SAFEGUARD)
    return tile, q_lo, q_mid

@gluon.jit
def _stage_rows(LSEh, DELTAh, lse_slot, dl_slot, start_m, q_len, BLOCK_M: gl.constexpr):
    """Loader: a query tile's LSE in log2 units (+inf for rows without keys and past the document,
    so that P = 0 there: flamia's _query_rows) and Delta, into the ring slot."""
    sl: gl.constexpr = gl.BlockedLayout([BLOCK_M // 32], [32], [1], [0])
    offs = start_m + gl.arange(0, BLOCK_M, layout=sl)
    m = offs < q_len
    lse2 = gl.load(LSEh + offs, mask=m, other=0.0) * 1.4426950408889634
    lse_slot.store(gl.where((lse2 == float("-inf")) | ~m, float("inf"), lse2))
    dl_slot.store(gl.load(DELTAh + offs, mask=m, other=0.0))

@gluon.jit
def _bwd_loader(q_desc, do_desc, k_desc, v_desc, ks_desc, vs_desc, sm, stats, TILES, T_Q, H, HK,
                D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                BLOCK_TOKENS: gl.constexpr, CAUSAL: gl.constexpr, TILE_SAFEGUARD: gl.constexpr,
                FP8_KV: gl.constexpr):
    LSE, DELTA = stats
    hk = gl.program_id(1)
    tile, q_lo, q_mid = _key_tile(TILES, BLOCK_M, BLOCK_TOKENS, CAUSAL, TILE_SAFEGUARD)
    k_start, qd_start, q_len = tile.start, tile.other_start, tile.q_len
    bar = sm.kv_ready.index(0)
    copies: gl.constexpr = 2 if TILE_SAFEGUARD else 1
    if not FP8_KV:  # (else the consumers dequantize K, V into k_s, v_s themselves)
        mbarrier.expect(bar, 2 * copies * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_start, hk * D], bar, sm.k_s)
        tma.async_copy_global_to_shared(v_desc, [k_start, hk * D], bar, sm.v_s)
    if TILE_SAFEGUARD:
        tma.async_copy_global_to_shared(ks_desc, [k_start, hk * D], bar, sm.ks_s)
        tma.async_copy_global_to_shared(vs_desc, [k_start, hk * D], bar, sm.vs_s)
    n_m = gl.cdiv(q_len - q_lo, BLOCK_M)
    c = 0  # ring position: runs over the group's heads and their query tiles
    for i in range(H // HK):
        hq = hk * (H // HK) + i
        for j in range(n_m):
            start_m = q_lo + j * BLOCK_M
            s = c % STAGES
            _acquire_free(sm.q_free, c, STAGES)
            bar = sm.q_ready.index(s)
            mbarrier.expect(bar, 2 * q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [qd_start + start_m, hq * D], bar, sm.q_s.index(s))
            tma.async_copy_global_to_shared(do_desc, [qd_start + start_m, hq * D], bar,
                                            sm.do_s.index(s))
            _stage_rows(LSE + hq * T_Q + qd_start, DELTA + hq * T_Q + qd_start, sm.lse_s.index(s),
                        sm.dl_s.index(s), start_m, q_len, BLOCK_M)
            _release(sm.st_ready, c, STAGES)
            c += 1

@gluon.jit
def _dequantize_keys(fp8_kv, k_dst, v_dst, k0, k_end, p0, hk, HK, D: gl.constexpr):
    """FP8_KV: 64 keys [k0, k0 + 64) of K/V head hk from the forward's MXFP8 operands into the MMA's
    shared memory in bf16: E4M3 times 2^(e - 127), flamia's _dequantize_kernel (exact in bf16), in
    place of its dequantized copies (their memory and their pass). fp8_kv: K row-major (T, HK, D),
    V token-transposed (HK, D, T_pad), their exponents (HK, T_pad), T_pad; key k0 is at padded
    column p0. Keys past k_end are zeros where TMA read the next document's: masked (P = dS = 0)
    either way."""
    K8, V8T, EK, EV, T_KPAD = fp8_kv
    # 16 keys at a time (few registers live: this runs once per CTA, before dK and dV's)
    kl: gl.constexpr = gl.BlockedLayout([1, 16], [32 // (D // 16), D // 16], [4, 1], [1, 0])
    vl: gl.constexpr = gl.BlockedLayout([16, 1], [1, 32], [1, 4], [0, 1])
    for i in gl.static_range(4):
        # the chunk's padded column, kept inside V^T and the exponent rows: a chunk past them holds
        # only keys past k_end (zeroed below), so the loads need no mask and go 16 bytes wide
        c0 = gl.multiple_of(gl.minimum(p0 + 16 * i, T_KPAD - 16), 16)
        r = 16 * i + gl.arange(0, 16, layout=gl.SliceLayout(1, kl))
        ok = k0 + r < k_end
        k = gl.load(K8 + gl.expand_dims(((k0 + r) * HK + hk) * D, 1)
                    + gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, kl)), 0),
                    mask=gl.expand_dims(ok, 1), other=0.0)
        e = gl.load(EK + hk * T_KPAD + c0 + gl.arange(0, 16, layout=gl.SliceLayout(1, kl)))
        k_dst.slice(16 * i, 16).store(_times_exp2(k, e, ok))
        r = 16 * i + gl.arange(0, 16, layout=gl.SliceLayout(1, vl))
        ok = k0 + r < k_end
        v = gl.load(V8T + (hk * D + gl.expand_dims(gl.arange(0, D, layout=gl.SliceLayout(0, vl)), 0))
                    * T_KPAD + c0 + gl.expand_dims(gl.arange(0, 16, layout=gl.SliceLayout(1, vl)), 1))
        e = gl.load(EV + hk * T_KPAD + c0 + gl.arange(0, 16, layout=gl.SliceLayout(1, vl)))
        v_dst.slice(16 * i, 16).store(_times_exp2(v, e, ok))

@gluon.jit
def _times_exp2(x, e, ok):
    """E4M3 rows x times 2^(e - 127) per row, in bf16 (exact); zeros in rows not ok (keys past the
    tile: never bytes the quantizer left unwritten, where a NaN times P = 0 would be NaN)."""
    y = x.to(gl.float32) * gl.expand_dims(flamia._exp2_int(e.to(gl.int32)), 1)
    return gl.where(gl.expand_dims(ok, 1), y, 0.0).to(gl.bfloat16)

@gluon.jit
def _bwd_step(c, sm, dk, dv, pos_k, kd_len, start_m, shift, dq_dst, q_len, H, sm_scale_log2,
              WG: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, MASKED: gl.constexpr, COPIES: gl.constexpr, DQ_TMA: gl.constexpr):
    """One query tile (ring position c) for this warpgroup's 64 keys: dK, dV updated, dQ added to
    dq_dst: the query head's fp32 dQ rows (atomics), or the TMA descriptor with the document's first
    row and this warpgroup's first column. Every MMA issued here is retired here (see the forward's
    _step)."""
    DQh, dq_desc, dq_row, dq_col = dq_dst
    dtype: gl.constexpr = gl.bfloat16
    s_layout: gl.constexpr = _mma_layout(dtype, BLOCK_M)
    o_layout: gl.constexpr = dk.type.layout
    st = c % STAGES
    if COPIES:  # the safeguard's per-token K, V (query tiles whose position their block holds)
        k_all = sm.ks_s
        v_all = sm.vs_s
    else:
        k_all = sm.k_s
        v_all = sm.v_s
    k = k_all.slice(WG * 64, 64)  # this warpgroup's 64 keys
    v = v_all.slice(WG * 64, 64)
    _acquire_filled(sm.q_ready, c, STAGES)
    q = sm.q_s.index(st)
    do = sm.do_s.index(st)
    zero = gl.zeros([64, BLOCK_M], gl.float32, s_layout)
    s_tok = warpgroup_mma(k, q.permute((1, 0)), zero, use_acc=False, is_async=True)
    dp_tok = warpgroup_mma(v, do.permute((1, 0)), zero, use_acc=False, is_async=True)
    _acquire_filled(sm.st_ready, c, STAGES)
    col_l: gl.constexpr = gl.SliceLayout(0, s_layout)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s_tok,))
    if MASKED:  # keys past the document; (causal) keys after the query's position
        visible = gl.expand_dims(pos_k < kd_len, 1)
        if CAUSAL:
            pos_q = start_m + gl.arange(0, BLOCK_M, layout=col_l) + shift
            visible = visible & (gl.expand_dims(pos_k, 1) <= gl.expand_dims(pos_q, 0))
        s = gl.where(visible, s, float("-inf"))
    p = gl.exp2(s * sm_scale_log2 - gl.expand_dims(sm.lse_s.index(st).load(col_l), 0))
    dp = warpgroup_mma_wait(num_outstanding=0, deps=(dp_tok,))
    ds = (p * (dp - gl.expand_dims(sm.dl_s.index(st).load(col_l), 0))).to(dtype)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dv_tok = warpgroup_mma(gl.convert_layout(p.to(dtype), a_layout), do, dv, is_async=True)
    # dQ = dS K, split like FA4's: both warpgroups put their dS^T (64 keys each) into one shared
    # buffer, then each computes half of dQ's columns over all 128 keys: a [64, D/2] accumulator
    # (a [64, D] one beside dK and dV spills at D=128) and every dQ element added once.
    # buffers (c % 2, warpgroup): a warpgroup one step ahead writes the other parity
    sm.ds_s.index((c % 2) * 2 + WG).store(ds)
    fence_async_shared()
    gl.thread_barrier()  # the whole warpgroup's stores precede its arrival
    _release(sm.ds_ready, c, 2)
    dq_layout: gl.constexpr = _mma_layout(dtype, D // 2)
    _acquire_filled(sm.ds_ready, c, 2)  # both halves of dS^T are in ds_s
    # FA4's order: dV, dQ, dK back to back on the tensor core; dQ's store overlaps dK's MMA
    dq = gl.zeros([BLOCK_M, D // 2], gl.float32, dq_layout)
    for w in gl.static_range(2):  # over the two warpgroups' 64 keys: one dS^T buffer each
        dq = warpgroup_mma(sm.ds_s.index((c % 2) * 2 + w).permute((1, 0)),
                           k_all.slice(w * 64, 64).slice(WG * (D // 2), D // 2, dim=1), dq,
                           use_acc=w > 0, is_async=True)
    dk_tok = warpgroup_mma(gl.convert_layout(ds, a_layout), q, dk, is_async=True)
    dv, dq = warpgroup_mma_wait(num_outstanding=1, deps=(dv_tok, dq))
    if DQ_TMA:  # rows past the document add dS = 0 exactly there: x + 0 = x (never -0: see attn_bwd)
        buf = sm.dq_s.index((c % 2) * 2 + WG)
        tma.store_wait(1)  # this warpgroup's reduce of two steps ago has read the buffer
        buf.store(dq)
        fence_async_shared()
        _tma_reduce_add(dq_desc, [dq_row + start_m, dq_col], buf)
    else:
        rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, dq_layout))
        offs = (gl.expand_dims(rows * (H * D), 1) + WG * (D // 2)
                + gl.expand_dims(gl.arange(0, D // 2, layout=gl.SliceLayout(0, dq_layout)), 0))
        gl.atomic_add(DQh + offs, dq, mask=gl.expand_dims(rows < q_len, 1), sem="relaxed")
    dk = warpgroup_mma_wait(num_outstanding=0, deps=(dk_tok,))
    _release(sm.q_free, c, STAGES)  # Q was dK's last operand
    return dk, dv

@gluon.jit
def _bwd_consumer(sm, DQ, dq_desc, grads, fp8_kv, TILES, sm_scale, T_K, H, HK, WG: gl.constexpr,
                  D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                  BLOCK_TOKENS: gl.constexpr, CAUSAL: gl.constexpr, TILE_SAFEGUARD: gl.constexpr,
                  FP8_KV: gl.constexpr):
    DK, DV = grads
    hk = gl.program_id(1)
    tile, q_lo, q_mid = _key_tile(TILES, BLOCK_M, BLOCK_TOKENS, CAUSAL, TILE_SAFEGUARD)
    k_start, k_end, qd_start, q_len, shift = tile.start, tile.end, tile.other_start, tile.q_len, tile.shift
    o_layout: gl.constexpr = _mma_layout(gl.bfloat16, D)
    row_l: gl.constexpr = gl.SliceLayout(1, _mma_layout(gl.bfloat16, BLOCK_M))
    pos_k = k_start - tile.doc_start + WG * 64 + gl.arange(0, 64, layout=row_l)
    kd_len = tile.k_len
    sm_scale_log2 = sm_scale * 1.4426950408889634
    if FP8_KV:  # before dK, dV's registers are live
        p0 = gl.load(tile.row + flamia.OWN_PAD) + k_start - tile.doc_start  # the padded column
        _dequantize_keys(fp8_kv, sm.k_s.slice(WG * 64, 64), sm.v_s.slice(WG * 64, 64),
                         k_start + WG * 64, k_end, p0 + WG * 64, hk, HK, D)
        fence_async_shared()
        gl.thread_barrier()  # the whole warpgroup's stores precede its arrival
        mbarrier.arrive(sm.kv_ready.index(0), count=1)
    dk = gl.zeros([64, D], gl.float32, o_layout)
    dv = gl.zeros([64, D], gl.float32, o_layout)
    mbarrier.wait(sm.kv_ready.index(0), 0)
    n_m = gl.cdiv(q_len - q_lo, BLOCK_M)
    n_diag = gl.cdiv(q_mid - q_lo, BLOCK_M)  # flamia loops range(q_lo, q_mid, BLOCK_M)
    partial = k_end - k_start < BLOCK_N  # the box's last keys are the next document's
    # dQ's adds: TMA reduce-adds of a shared-memory tile (its buffers do not fit beside the
    # safeguard's per-token K, V copies), else fp32 atomics from registers
    DQ_TMA: gl.constexpr = not TILE_SAFEGUARD
    c = 0
    for i in range(H // HK):
        hq = hk * (H // HK) + i
        dq_dst = (DQ + (qd_start * H + hq) * D, dq_desc, qd_start, hq * D + WG * (D // 2))
        for j in range(0, n_diag):
            dk, dv = _bwd_step(c + j, sm, dk, dv, pos_k, kd_len, q_lo + j * BLOCK_M, shift, dq_dst, q_len,
                               H, sm_scale_log2, WG, D, BLOCK_M, STAGES, CAUSAL, True, TILE_SAFEGUARD,
                               DQ_TMA)
        if partial:
            for j in range(n_diag, n_m):
                dk, dv = _bwd_step(c + j, sm, dk, dv, pos_k, kd_len, q_lo + j * BLOCK_M, shift, dq_dst,
                                   q_len, H, sm_scale_log2, WG, D, BLOCK_M, STAGES, CAUSAL, True, False,
                                   DQ_TMA)
        else:
            for j in range(n_diag, n_m):
                dk, dv = _bwd_step(c + j, sm, dk, dv, pos_k, kd_len, q_lo + j * BLOCK_M, shift, dq_dst,
                                   q_len, H, sm_scale_log2, WG, D, BLOCK_M, STAGES, CAUSAL, False, False,
                                   DQ_TMA)
        c += n_m
    if DQ_TMA:
        tma.store_wait(0)  # the shared memory stays allocated until the last reduce has read it
    keys = k_start + WG * 64 + gl.arange(0, 64, layout=gl.SliceLayout(1, o_layout))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    ptrs = gl.expand_dims((keys * HK + hk) * D, 1) + gl.expand_dims(offs_d, 0)
    kmask = gl.expand_dims(keys < k_end, 1)
    gl.store(DK + ptrs, (dk * sm_scale).to(DK.dtype.element_ty), mask=kmask)
    gl.store(DV + ptrs, dv.to(DV.dtype.element_ty), mask=kmask)

@gluon.jit
def _attn_bwd_hopper(q_desc, do_desc, k_desc, v_desc, ks_desc, vs_desc, fp8_kv, stats, DQ, dq_desc, grads,
                     TILES, sm_scale, T_Q, T_K, H, HK, D: gl.constexpr, BLOCK_M: gl.constexpr,
                     BLOCK_N: gl.constexpr, STAGES: gl.constexpr, BLOCK_TOKENS: gl.constexpr,
                     CAUSAL: gl.constexpr, TILE_SAFEGUARD: gl.constexpr, FP8_KV: gl.constexpr):
    """TMA descriptors of Q, dO, K, V, the safeguard's KS, VS (each a parameter of its own: see the
    forward); fp8_kv: with FP8_KV the forward's MXFP8 K, V^T, their exponents and T_pad; stats: LSE,
    Delta; DQ: the fp32 dQ and its descriptor; grads: dK, dV (attn_bwd says what each holds)."""
    kv_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, D], gl.bfloat16)  # = _desc's
    k_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, D], kv_l)
    v_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, D], kv_l)
    if TILE_SAFEGUARD:
        ks_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, D], kv_l)
        vs_s = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_N, D], kv_l)
    else:
        ks_s = k_s
        vs_s = v_s
    q_s = gl.allocate_shared_memory(q_desc.dtype, [STAGES] + q_desc.block_type.shape,
                                    q_desc.layout)
    do_s = gl.allocate_shared_memory(do_desc.dtype, [STAGES] + do_desc.block_type.shape,
                                     do_desc.layout)
    row_l: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])
    lse_s = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_l)
    dl_s = gl.allocate_shared_memory(gl.float32, [STAGES, BLOCK_M], row_l)
    ds_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_M], gl.bfloat16)
    ds_s = gl.allocate_shared_memory(gl.bfloat16, [4, 64, BLOCK_M], ds_l)
    if TILE_SAFEGUARD:
        dq_s = ds_s  # unused: dQ by atomics
    else:  # (parity, warpgroup) buffers of [BLOCK_M, D/2] fp32
        dq_s = gl.allocate_shared_memory(gl.float32, [4] + dq_desc.block_type.shape, dq_desc.layout)
    kv_ready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    st_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    q_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_ready.index(0), count=2 if FP8_KV else 1)
    for i in gl.static_range(2):
        mbarrier.init(ds_ready.index(i), count=2)  # both consumer warpgroups stored their dS^T
    for i in gl.static_range(STAGES):
        mbarrier.init(q_ready.index(i), count=1)
        mbarrier.init(st_ready.index(i), count=1)
        mbarrier.init(q_free.index(i), count=2)  # both consumer warpgroups release a slot
    sm = BwdSmem(k_s, v_s, ks_s, vs_s, q_s, do_s, lse_s, dl_s, ds_s, dq_s, kv_ready, q_ready,
                 st_ready, q_free, ds_ready)
    gl.warp_specialize([
        (_bwd_consumer, (sm, DQ, dq_desc, grads, fp8_kv, TILES, sm_scale, T_K, H, HK, 0, D, BLOCK_M,
                         BLOCK_N, STAGES, BLOCK_TOKENS, CAUSAL, TILE_SAFEGUARD, FP8_KV)),
        (_bwd_consumer, (sm, DQ, dq_desc, grads, fp8_kv, TILES, sm_scale, T_K, H, HK, 1, D, BLOCK_M,
                         BLOCK_N, STAGES, BLOCK_TOKENS, CAUSAL, TILE_SAFEGUARD, FP8_KV)),
        (_bwd_loader, (q_desc, do_desc, k_desc, v_desc, ks_desc, vs_desc, sm, stats, TILES, T_Q, H, HK,
                       D, BLOCK_M, STAGES, BLOCK_TOKENS, CAUSAL, TILE_SAFEGUARD, FP8_KV)),
    ], [4, 1], [240, 24])


BWD_BLOCK_N = 128  # keys per CTA (2 warpgroups x 64): the Plan's key-tile table must use this
# queries per step, by head dim: FA3/FA4's Hopper tiles (128 at D=64 halves the steps; at D=128 the
# [64, 128] S^T, dP^T beside dK, dV fill the 240 registers)
BWD_BLOCK_M = {64: 128, 128: 64}


def bwd_block_m(D, tile_safeguard):
    """Queries per backward step. With the tile safeguard 64 at every head dim: its per-token K, V
    copies hold registers and shared memory, and dQ goes by atomics (the H200 measured 64 faster at
    D=64 there; 128 faster without it)."""
    return 64 if tile_safeguard else BWD_BLOCK_M.get(D, 64)


def attn_bwd(q, k, v, ks, vs, do, lse, delta, dk, dv, tiles, *, softmax_scale, causal,
             block_tokens=1, tile_safeguard=False, fp8_kv=None):
    """dQ / softmax_scale (returned, fp32), dK, dV (written) of flamia's backward function, on its
    bf16 operands: q, do (Tq, H, D); k, v and the safeguard's per-token copies ks, vs (Tk, HK, D)
    (the quantized recipes': exactly dequantized); lse, delta (H, Tq) fp32; tiles:
    plan.tiles(BWD_BLOCK_N, "k", causal). tile_safeguard: flamia's per-tile safeguard for
    bwd_block_m()-query x 128-key tiles (ks, vs on the masked query tiles); without it ks, vs are
    ignored. fp8_kv: instead of k, v (then None), the forward's MXFP8 K and V as (k_data (Tk, HK,
    D), k_exp, v_data_t (HK, D, T_pad), v_exp (HK, T_pad)), dequantized by the kernel (not with the
    tile safeguard). dQ's fp32 sum starts at +0.0, so it is never -0.0 and the zero rows a TMA box
    adds past a document's end leave the next one's bits."""
    Tq, H, D = q.shape
    Tk, HK = dk.shape[:2]
    BM, BN = bwd_block_m(D, tile_safeguard), BWD_BLOCK_N
    dq = torch.zeros(Tq, H, D, dtype=torch.float32, device=q.device)
    if tiles.shape[0] == 0:
        return dq
    if fp8_kv is not None:
        assert not tile_safeguard, "fp8_kv: the tile safeguard's copies come as bf16 k, v"
        k8, ek, v8t, ev = fp8_kv
        assert ek.shape == ev.shape == (HK, v8t.shape[-1]), "fp8_kv: one padded token layout"
        kd = vd = None
    else:
        kd = _desc(k, (Tk, HK * D), (HK * D, 1), (BN, D))
        vd = _desc(v, (Tk, HK * D), (HK * D, 1), (BN, D))
        k8 = v8t = ek = ev = lse  # unused
    qd = _desc(q, (Tq, H * D), (H * D, 1), (BM, D))
    dod = _desc(do, (Tq, H * D), (H * D, 1), (BM, D))
    ksd = _desc(ks, (Tk, HK * D), (HK * D, 1), (BN, D)) if tile_safeguard else None
    vsd = _desc(vs, (Tk, HK * D), (HK * D, 1), (BN, D)) if tile_safeguard else None
    dqd = None if tile_safeguard else _desc(dq, (Tq, H * D), (H * D, 1), (BM, D // 2))
    _attn_bwd_hopper[(tiles.shape[0], HK)](qd, dod, kd, vd, ksd, vsd, (k8, v8t, ek, ev, ek.shape[-1]),
                                           (lse, delta), dq, dqd, (dk, dv), tiles, softmax_scale, Tq,
                                           Tk, H, HK, D=D, BLOCK_M=BM, BLOCK_N=BN, STAGES=2,
                                           BLOCK_TOKENS=block_tokens, CAUSAL=causal,
                                           TILE_SAFEGUARD=tile_safeguard,
                                           FP8_KV=fp8_kv is not None, num_warps=4, maxnreg=168)
    return dq  # unscaled: the caller scales it as it casts it (one pass over the fp32 sum)
