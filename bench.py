"""
bench.py — FLAMIA's benchmark: attention fwd / bwd / fwd+bwd TFLOP/s against every peer that runs
on this machine, the quantizer's bandwidth, and accuracy per recipe.

    python bench.py              # the attention table (all workloads), JSON + PNG in --out
    python bench.py --quick      # a one-minute subset
    python bench.py --quant      # fused quantizer: bit-exactness on a large tensor, GB/s vs the copy ceiling
    python bench.py --accuracy   # relative L2 error vs exact fp64 per recipe and block_tokens (+ speed)
    python bench.py --audit      # the table of who leaks: flamia.audit_causality on every attention here
    python bench.py --tune       # kernel tile-configuration sweep
    python bench.py --block-tokens  # mxfp8 fwd / bwd speed per block_tokens on the --quick workloads
    python bench.py --sm100      # no GPU needed: what each kernel compiles to for Blackwell (sm_100a)
    PYTHONPATH=DIR python bench.py --sm90   # no GPU, triton 3.6 in DIR: the Gluon kernels for sm_90a

FLOP convention (Triton's fused-attention tutorial): fwd = 4 * H * D * sum_docs L(L+1)/2 for causal
documents, bwd = 2.5 x fwd, fwd+bwd = 3.5 x fwd. Times are medians of triton.testing.do_bench on
random (never zero) inputs, after warm-up, and then the median over --rounds interleaved passes over
all implementations of a workload; FLAMIA's times include quantization; bwd = (fwd+bwd) - fwd.
Peers, each only if it runs here (else the reason it was skipped is printed): FlashAttention-4's SM90
path (optional `flash-attn-4`, varlen), cuDNN through nvidia-cudnn-frontend (optional; BF16, ragged/THD
for packed documents, GQA included; FP8 per-tensor-scaled for one document: leaky, shown for reference),
PyTorch SDPA (cuDNN backend; packed equal-length documents as a batch), torch varlen_attn,
FlexAttention (document mask). Every ratio ("x0.80 fa4-sm90") is against the fastest BF16 peer that ran
on that workload, chosen per pass (fwd, bwd, fwd+bwd); leaky FP8 peers are shown, never the reference.
"""
import argparse
import json
import math
import os
import sys
import time

import torch
import triton
import triton.testing

import flamia


def do_bench(fn, leaves=None):
    """Median ms of fn. leaves: tensors whose .grad is cleared before every call, outside the timing
    (grad_to_none): a training step's q, k, v are not leaves, and accumulating into their .grad would
    time an elementwise add in every row (about 0.2 ms per call at 16k tokens, H16 D128), which
    cuDNN's graphs, writing their own buffers, never pay."""
    return triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=leaves, return_mode="median")


def fwd_bwd(fn, q, k, v, do):
    """fn's forward and backward on leaf copies of q, k, v, and those leaves (for do_bench)."""
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    return (lambda: torch.autograd.backward(fn(*leaves), do)), leaves


def bench_rounds(fns, rounds):
    """{name: (fwd, fwd+bwd callables, leaves)} -> {name: (fwd ms, fwd+bwd ms)}: each the median over `rounds`
    round-robin passes of do_bench medians (for an even count the slower of the two middle values). The H200's clock drifts with heat and power over a run
    (the same kernel measured 10-15% apart depending on what ran before it), so every implementation
    is timed in every round, interleaved, instead of one after the other."""
    times = {name: ([], []) for name in fns}
    for _ in range(rounds):
        for name, (fwd, fb, leaves) in fns.items():
            times[name][0].append(do_bench(fwd))
            times[name][1].append(do_bench(fb, leaves))
    return {name: (sorted(tf)[len(tf) // 2], sorted(tfb)[len(tfb) // 2]) for name, (tf, tfb) in times.items()}


def fwd_flops(lens, H, D, causal=True):
    return sum(4.0 * H * D * (L * (L + 1) / 2 if causal else L * L) for L in lens)


def lognormal_docs(total, median=1024, lo=64, hi=16384, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = []
    while sum(lens) < total:
        L = int(min(hi, max(lo, math.exp(math.log(median) + 1.0 * torch.randn(1, generator=g).item()))))
        lens.append(min(L, total - sum(lens)))
    return lens


def workloads(quick):
    """[(name, document lengths, H, HK, D)]."""
    w = [("1doc-16k", [16384], 16, 16, 128), ("2kdocs-16k", [2048] * 8, 16, 16, 128),
         ("lognormal-16k", lognormal_docs(16384), 16, 16, 128)]
    if not quick:
        w += [("1doc-64k", [65536], 16, 16, 128), ("2kdocs-64k", [2048] * 32, 16, 16, 128),
              ("lognormal-64k", lognormal_docs(65536), 16, 16, 128),
              ("1doc-16k-D64", [16384], 32, 32, 64), ("2kdocs-16k-D64", [2048] * 8, 32, 32, 64),
              ("lognormal-16k-D64", lognormal_docs(16384), 32, 32, 64),
              ("gqa32/8-2kdocs-16k", [2048] * 8, 32, 8, 128),
              # train_llama.py's attention: 8 query / 4 KV heads of 64, a 32k-token batch of whole
              # documents cut at an 8k context (--max_doc_len 8192); lengths lognormal, fixed seed
              ("train_llama-gqa8/4-D64-32k", lognormal_docs(32768, hi=8192, seed=1), 8, 4, 64)]
    return w


def selected(name, spec):
    """--workloads: comma-separated name prefixes; one ending in "$" matches the whole name only
    (e.g. "2kdocs-16k$" without "2kdocs-16k-D64"). Empty: everything."""
    pats = [p for p in spec.split(",") if p]
    return not pats or any(name == p[:-1] if p.endswith("$") else name.startswith(p) for p in pats)


# ---- implementations: each returns fn(q, k, v) -> out for packed (T, H, D) inputs, or raises ----
def flamia_impl(recipe, lens, **kw):
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    plan = flamia.flamia_plan(cu)  # once per batch, as in training
    m = max(lens)
    return lambda q, k, v: flamia.flamia_attn_varlen_func(q, k, v, cu, cu, m, m, recipe=recipe, plan=plan, **kw)


# FlashAttention-4's SM90 path (pip flash-attn-4, CuTe DSL): BF16, varlen, GQA; the fastest BF16 attention
# we know on Hopper (measured on the H200: README "Speed"). Optional: bench.py only, never flamia.py or the tests.
def fa4_impl(lens, **kw):
    from flash_attn.cute import flash_attn_varlen_func
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    m = max(lens)

    def fn(q, k, v):
        o = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m,
                                   causal=True)
        return o[0] if isinstance(o, tuple) else o  # some versions return (out, lse)
    return fn


# PyTorch SDPA with the cuDNN backend: packed equal-length documents as a (B, H, S, D) batch.
def sdpa_impl(lens, **kw):
    if len(set(lens)) != 1:
        raise RuntimeError("needs equal-length documents")
    from torch.nn.attention import SDPBackend, sdpa_kernel
    B, S = len(lens), lens[0]

    def fn(q, k, v):
        qb, kb, vb = (x.view(B, S, x.shape[1], x.shape[2]).transpose(1, 2) for x in (q, k, v))
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            o = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True,
                                                                 enable_gqa=kb.shape[1] != qb.shape[1])
        return o.transpose(1, 2).reshape(q.shape)
    return fn


# torch.nn.attention.varlen.varlen_attn: PyTorch's own packed-document attention.
def varlen_impl(lens, **kw):
    from torch.nn.attention.varlen import varlen_attn
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    m = max(lens)
    return lambda q, k, v: varlen_attn(q, k, v, cu, cu, m, m, window_size=(-1, 0))


# FlexAttention (compiled) with a block mask of documents and causality.
def flex_impl(lens, **kw):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    T = sum(lens)
    doc = torch.repeat_interleave(torch.arange(len(lens), device="cuda"), torch.tensor(lens, device="cuda"))
    mask = create_block_mask(lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (ki <= qi), None, None, T, T, device="cuda")
    flex = torch.compile(flex_attention)

    def fn(q, k, v):
        o = flex(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], block_mask=mask,
                 enable_gqa=k.shape[1] != q.shape[1])
        return o[0].transpose(0, 1)
    return fn


def build_graph(g):
    """Validate and build a cuDNN graph; returns its workspace."""
    import cudnn
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()
    return torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")


# cuDNN SDPA through nvidia-cudnn-frontend (optional): BF16 on ragged (THD) packed documents, with
# GQA (K/V with HK < H heads); FP8 per-tensor-scaled on one document (leaky: shown, never a reference).
def cudnn_impls(lens, H, HK, D):
    """cuDNN SDPA graphs through nvidia-cudnn-frontend (as in ../shared/peers/cudnn_sdpa_bench.py).
    Q, O, dO, dQ: (T, H, D); K, V, dK, dV: (T, HK, D) (GQA when HK < H); all addressed as ragged
    (B, heads, S, D) over the packed buffers. Returns {name: (fwd_fn, fwdbwd_fn)}; times are
    measured on the graphs' own buffers."""
    import cudnn
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    DT = cudnn.data_type
    B, T, S = len(lens), sum(lens), max(lens)
    heads = lambda n: HK if n in ("k", "v", "dK", "dV") else H
    dims = lambda n: (B, heads(n), S, D)  # logical BHSD over the packed (T, heads, D) buffer
    st = lambda n: (S * heads(n) * D, D, heads(n) * D, 1)
    cum = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device="cuda", dtype=torch.int64)
    out = {}
    for name, fp8 in (("cudnn-bf16", False), ("cudnn-fp8-leaky", True)):
        if fp8 and B > 1:
            continue  # no THD FP8 backward on Hopper
        io = DT.FP8_E4M3 if fp8 else DT.BFLOAT16
        mk = lambda n: torch.randn(T, heads(n), D, device="cuda", dtype=torch.bfloat16)
        buf = {n: mk(n) for n in ("q", "k", "v", "dO")}
        if fp8:
            buf = {n: x.to(torch.float8_e4m3fn) for n, x in buf.items()}
        buf.update({n: torch.empty_like(buf[n[1].lower()]) for n in ("dQ", "dK", "dV")})
        buf["o"] = torch.empty_like(buf["q"])
        buf["stats"] = torch.empty(T, H, 1, device="cuda", dtype=torch.float32)
        buf["seq"] = torch.tensor(lens, dtype=torch.int32, device="cuda").view(-1, 1, 1, 1)
        for n in ("q", "k", "v", "o", "dO"):
            buf["off_" + n] = (cum * heads(n) * D).view(-1, 1, 1, 1)
        buf["off_stats"] = (cum * H).view(-1, 1, 1, 1)
        one = lambda x=1.0: torch.full((1, 1, 1, 1), x, device="cuda", dtype=torch.float32)

        def graph(bwd):
            g = cudnn.pygraph(io_data_type=io, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT,
                              handle=handle)
            t = {}
            small = lambda n, dt: t.setdefault(n, g.tensor(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=dt, name=n))
            for n in (("q", "k", "v", "o", "dO") if bwd else ("q", "k", "v")):
                t[n] = g.tensor(dim=dims(n), stride=st(n), data_type=io, name=n)
            t["seq"] = g.tensor(dim=(B, 1, 1, 1), stride=(1, 1, 1, 1), data_type=DT.INT32, name="seq")
            rag = lambda n: t[n].set_ragged_offset(t.setdefault("off_" + n, g.tensor(
                dim=(B + 1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=DT.INT64, name="off_" + n)))
            kw = dict(attn_scale=1 / math.sqrt(D), use_causal_mask=True, use_padding_mask=True, seq_len_q=t["seq"],
                      seq_len_kv=t["seq"])
            for n in (("q", "k", "v", "o", "dO") if bwd else ("q", "k", "v")):
                rag(n)
            sdims, sst = (B, H, S, 1), (S * H, 1, H, 1)
            scal = {}
            if fp8:
                names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o") if not bwd else (
                    "descale_q", "descale_k", "descale_v", "descale_o", "descale_dO", "descale_s", "descale_dP",
                    "scale_s", "scale_dQ", "scale_dK", "scale_dV", "scale_dP")
                scal = {n: small(n, DT.FLOAT) for n in names}
            if not bwd:
                kw["generate_stats"] = True
                res = (g.sdpa_fp8 if fp8 else g.sdpa)(q=t["q"], k=t["k"], v=t["v"], name="f", **kw, **scal)
                t["o"] = res[0].set_output(True).set_dim(dims("o")).set_stride(st("o")).set_data_type(io)
                t["stats"] = res[1].set_output(True).set_dim(sdims).set_stride(sst).set_data_type(DT.FLOAT)
                rag("o")
                rag("stats")
                for i, n in enumerate(("amax_s", "amax_o")[:len(res) - 2]):
                    t[n] = res[2 + i].set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(DT.FLOAT)
            else:
                t["stats"] = g.tensor(dim=sdims, stride=sst, data_type=DT.FLOAT, name="stats")
                rag("stats")
                kw.update(max_total_seq_len_q=T, max_total_seq_len_kv=T)
                res = (g.sdpa_fp8_backward if fp8 else g.sdpa_backward)(
                    q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=t["dO"], stats=t["stats"], name="b", **kw, **scal)
                for n, x in zip(("dQ", "dK", "dV"), res[:3]):
                    t[n] = x.set_output(True).set_dim(dims(n)).set_stride(st(n)).set_data_type(io)
                    x.set_ragged_offset(t["off_" + n[1].lower()])  # dK shares K's offsets (HK heads)
                for i, n in enumerate(("amax_dQ", "amax_dK", "amax_dV", "amax_dP")[:len(res) - 3]):
                    t[n] = res[3 + i].set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(DT.FLOAT)
            ws = build_graph(g)
            for n in t:
                if n not in buf:
                    buf[n] = one(448.0 if n == "scale_s" else 1 / 448.0 if n == "descale_s" else 1.0)
            pack = {x: buf[n] for n, x in t.items()}
            return lambda: g.execute(pack, ws, handle=handle)
        try:
            f, b = graph(False), graph(True)
            f()
            out[name] = (f, lambda f=f, b=b: (f(), b()), None)
        except Exception as e:  # e.g. cuDNN declines FP8 graphs it does not support on this GPU
            print(f"  {name}: skipped ({type(e).__name__}: {str(e)[:120]})")
    return out


def bench_attention(args):
    rows = []
    for name, lens, H, HK, D in workloads(args.quick):
        if not selected(name, args.workloads):
            continue
        T = sum(lens)
        flops = fwd_flops(lens, H, D)
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(T, HK, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        do = torch.randn_like(q)
        impls = {"flamia-mxfp8": lambda: flamia_impl("mxfp8", lens),
                 # 128-token scale blocks: the forward's unmasked tiles take scalar scales (faster forward on
                 # long documents; on packed short documents it writes per-token copies too)
                 "flamia-mxfp8 B_t=128": lambda: flamia_impl("mxfp8", lens, block_tokens=128),
                 # the portable tl forward (on Hopper the default above is the Gluon forward)
                 "flamia-mxfp8 B_t=128 tl": lambda: flamia_impl("mxfp8", lens, block_tokens=128,
                                                                backend="tl"),
                 # the portable tl backward (on Hopper the default is the Gluon backward, whose dQ adds
                 # run in no fixed order)
                 "flamia-mxfp8 deterministic": lambda: flamia_impl("mxfp8", lens, deterministic=True),
                 "flamia-bf16": lambda: flamia_impl("bf16", lens),
                 "flamia-nvfp4 (FP4 emulated on Hopper)": lambda: flamia_impl("nvfp4", lens),
                 "flamia-mxfp4 (FP4 emulated on Hopper)": lambda: flamia_impl("mxfp4", lens),
                 "flamia-mxfp8 gluon (Hopper)": lambda: flamia_impl("mxfp8", lens, backend="gluon"),
                 "flamia-mxfp8 B_t=128 gluon (Hopper)": lambda: flamia_impl("mxfp8", lens, block_tokens=128,
                                                                            backend="gluon"),
                 "flamia-bf16 gluon (Hopper)": lambda: flamia_impl("bf16", lens, backend="gluon"),
                 "fa4-sm90": lambda: fa4_impl(lens),
                 "sdpa-cudnn": lambda: sdpa_impl(lens), "varlen_attn": lambda: varlen_impl(lens),
                 "flex": lambda: flex_impl(lens)}
        if args.naive_plan:
            impls["flamia-mxfp8-naive-order"] = lambda: naive_order_impl(lens)
        fns = {}
        for iname, make in impls.items():
            if any(x and x in iname for x in args.skip_impls.split(",")):
                continue
            try:
                fn = make()
                fwd = lambda fn=fn: fn(q, k, v)
                fb, leaves = fwd_bwd(fn, q, k, v, do)
                fwd(), fb()
                torch.cuda.synchronize()
                fns[iname] = (fwd, fb, leaves)
            except Exception as e:
                print(f"  {name} {iname}: skipped ({type(e).__name__}: {str(e)[:120]})")
        try:
            fns.update(cudnn_impls(lens, H, HK, D))
        except Exception as e:
            print(f"  {name} cudnn: skipped ({type(e).__name__}: {str(e)[:120]})")
        done = []
        for iname, (tf, tfb) in bench_rounds(fns, args.rounds).items():
            done.append(dict(workload=name, impl=iname, T=T, H=H, HK=HK, D=D, n_docs=len(lens), fwd_ms=tf,
                             bwd_ms=tfb - tf, fwdbwd_ms=tfb, fwd_tflops=flops / tf / 1e9,
                             bwd_tflops=2.5 * flops / (tfb - tf) / 1e9, fwdbwd_tflops=3.5 * flops / tfb / 1e9))
        add_peer_ratios(done)
        print_rows(done)
        rows += done
        save_json(args, rows)  # after every workload: a run cut short keeps what it measured
        del q, k, v, do
        torch.cuda.empty_cache()
    print_summary(rows)
    return rows


def naive_order_impl(lens):
    """FLAMIA with the Plan's LPT order undone (tiles in document order) to show the scheduler's effect."""
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    plan = flamia.flamia_plan(cu)
    tiles = plan.tiles
    plan.tiles = lambda block, side, causal=True, skip_masked=True: (
        lambda t: t[torch.argsort(t[:, 0])])(tiles(block, side, causal, skip_masked))
    m = max(lens)
    return lambda q, k, v: flamia.flamia_attn_varlen_func(q, k, v, cu, cu, m, m, plan=plan)


# ---- the reference of every ratio: the fastest BF16 peer of the workload, per pass ----
PASSES = (("fwd", "fwd"), ("bwd", "bwd"), ("fwdbwd", "fwd+bwd"))  # (row key, label)


def is_bf16_peer(impl):
    """May this row be the reference? Every peer (FA4, cuDNN, SDPA, varlen, flex, ...), but neither
    FLAMIA's own rows nor a leaky FP8 peer (per-tensor scales: faster because it leaks; shown only)."""
    return not impl.startswith("flamia") and "leaky" not in impl


def fastest_bf16_peers(rows):
    """{pass: (impl, TFLOP/s)} over one workload's rows: the fastest BF16 peer, chosen separately for
    each pass (fwd, bwd, fwd+bwd may each have another winner); a pass is absent if no peer ran."""
    ref = {}
    for p, _ in PASSES:
        ran = [(r[p + "_tflops"], r["impl"]) for r in rows
               if is_bf16_peer(r["impl"]) and math.isfinite(r[p + "_tflops"])]
        if ran:
            tf, impl = max(ran)
            ref[p] = (impl, tf)
    return ref


def add_peer_ratios(rows):
    """Adds to every row of one workload, per pass: ref_<pass> (the fastest BF16 peer's name, None if
    none ran), ref_<pass>_tflops and vs_ref_<pass> (this row's TFLOP/s over that peer's)."""
    ref = fastest_bf16_peers(rows)
    for r in rows:
        for p, _ in PASSES:
            impl, tf = ref.get(p, (None, None))
            r["ref_" + p], r["ref_" + p + "_tflops"] = impl, tf
            r["vs_ref_" + p] = r[p + "_tflops"] / tf if impl else None
    return ref


def _x(v):
    return f"x{v:.2f}" if v is not None else "  -  "


def print_rows(rows):
    """One workload (rows from add_peer_ratios): TFLOP/s per pass, each with its ratio to that pass's
    fastest BF16 peer, named in the header line."""
    ref = fastest_bf16_peers(rows)
    name = lambda p: f"{ref[p][0]} ({ref[p][1]:.1f})" if p in ref else "none ran"
    print(f"{rows[0]['workload']}: fastest BF16 peer: " + " | ".join(f"{lab} {name(p)}" for p, lab in PASSES))
    for r in rows:
        print(f"  {r['impl']:38s} " + "  ".join(f"{lab} {r[p + '_tflops']:6.1f} {_x(r['vs_ref_' + p])}"
                                               for p, lab in PASSES) + f"  ({r['fwdbwd_ms']:.3f} ms)")


def print_summary(rows):
    """Compact, one line per workload: the fastest BF16 peer per pass, FLAMIA's default (mxfp8) and
    its fastest row, as ratios fwd / bwd / fwd+bwd to those peers."""
    print(f"\n{'workload':28s} {'fastest BF16 peer, TFLOP/s: fwd | bwd | fwd+bwd':62s} {'flamia-mxfp8':16s} "
          f"fastest FLAMIA row (fwd+bwd)")
    for w in dict.fromkeys(r["workload"] for r in rows):
        rs = [r for r in rows if r["workload"] == w]
        ref = fastest_bf16_peers(rs)
        peers = " | ".join(f"{ref[p][0]} {ref[p][1]:.0f}" if p in ref else "-" for p, _ in PASSES)
        mx = next((r for r in rs if r["impl"] == "flamia-mxfp8"), None)
        mx = "/".join(f"{r_:.2f}" if r_ is not None else "-" for r_ in
                      (mx["vs_ref_" + p] for p, _ in PASSES)) if mx else "-"
        best = max((r for r in rs if r["impl"].startswith("flamia")), key=lambda r: r["fwdbwd_tflops"], default=None)
        best = f"{best['impl']} {_x(best['vs_ref_fwdbwd'])}" if best else "-"
        print(f"{w:28s} {peers:62s} {mx:16s} {best}")


def bench_quant(args):
    """Quantizer: bitwise vs the PyTorch reference on a large random tensor, then GB/s vs the copy ceiling."""
    T, H, D = 65536, 16, 128
    lens = lognormal_docs(T)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    plan = flamia.flamia_plan(cu)
    x = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    x = x * torch.exp2(torch.randint(-20, 20, (T, H, 1), device="cuda")).to(x.dtype)  # wide dynamic range
    rows = []
    copy_ms = do_bench(lambda: x.clone())
    copy_bw = 2 * x.numel() * 2 / copy_ms / 1e6
    print(f"copy ceiling: {copy_bw:.0f} GB/s")
    # (transposed, per_token_copy): Q and K; K with the safeguard's per-token copy (B_t > 1); V
    # (token-transposed; + the per-token copy for B_t > 1)
    configs = ((False, False), (False, True), (True, False), (True, True))
    for bt in (1, 32, 128):
        for transposed, tok in configs:
            if tok and bt == 1:
                continue
            quant = lambda: flamia.quantize_mxfp8(x, plan, bt, transposed=transposed, per_token_copy=tok)
            out = quant()
            exact = True  # every output, the token-transposed and per-token copies included
            for got, ref_bt in ((out, bt), (out.tok, 1)) if tok else ((out, bt),):
                ref = flamia.quantize_mxfp8_reference(x, cu, ref_bt)
                end = plan.pad_q[-1]  # exponents: padded layout, the tail past the last document unused
                exact &= bool((got.exp[:, :end] == ref.exp[:, :end]).all())
                if not transposed:
                    exact &= bool((got.data.view(torch.uint8) == ref.data.view(torch.uint8)).all())
                else:
                    want = flamia.transpose_tokens_reference(ref.data, plan.offsets_q)
                    got_t = got.data_t[..., :want.shape[-1]]  # the tail past the last document is unused
                    exact &= bool((got_t.view(torch.uint8) == want.view(torch.uint8)).all())
            ms = do_bench(quant)
            writes = (1 + tok) * (x.numel() + T * H)
            gbs = (2 * x.numel() + writes) / ms / 1e6
            rows.append(dict(block_tokens=bt, transposed=transposed, per_token_copy=tok, ms=ms, GBps=gbs,
                             frac_of_copy=gbs / copy_bw, bit_exact=exact))
            print(f"quantize B_t={bt:3d} transposed={transposed!s:5} per_token_copy={tok!s:5}: "
                  f"{ms:.3f} ms {gbs:6.0f} GB/s ({100 * gbs / copy_bw:.0f}% of copy)  bit-exact vs reference: {exact}")
    return rows


def bench_accuracy(args):
    """Relative L2 error vs exact fp64 of O, dQ, dK, dV per recipe / block_tokens, normal and hard data;
    plus fwd+bwd speed per block_tokens (the data behind the default block_tokens)."""
    rows = []
    lens = lognormal_docs(8192, seed=1)
    T, H, D = sum(lens), 8, 128
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    plan = flamia.flamia_plan(cu)
    g = torch.Generator(device="cuda").manual_seed(0)
    for data in ("normal", "hard"):
        q, k, v, do = (torch.randn(T, H, D, device="cuda", generator=g) for _ in range(4))
        if data == "hard":  # outlier channels, attention-sink tokens, per-token magnitude spread
            k[:, :, :4] *= 20
            q[:, :, :4] *= 4
            starts = cu[:-1].long()
            k[starts] *= 8
            v *= torch.exp2(torch.randint(-6, 6, (T, 1, 1), device="cuda", generator=g).float())
        q, k, v, do = (x.bfloat16() for x in (q, k, v, do))
        q6, k6, v6 = (x.double().requires_grad_() for x in (q, k, v))
        o6 = flamia.attention_fp64(q6, k6, v6, cu)
        o6.backward(do.double())
        for recipe, bt in (("bf16", 1), ("mxfp8", 1), ("mxfp8", 32), ("mxfp8", 64), ("mxfp8", 128), ("nvfp4", 1),
                           ("mxfp4", 1)):
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            o = flamia.flamia_attn_varlen_func(qq, kk, vv, cu, cu, max(lens), max(lens), recipe=recipe,
                                               block_tokens=bt, plan=plan)
            o.backward(do)
            rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
            r = dict(data=data, recipe=recipe, block_tokens=bt, o=rel(o, o6), dq=rel(qq.grad, q6.grad),
                     dk=rel(kk.grad, k6.grad), dv=rel(vv.grad, v6.grad))  # before timing: it clears .grad
            fb = lambda: torch.autograd.backward(flamia.flamia_attn_varlen_func(
                qq, kk, vv, cu, cu, max(lens), max(lens), recipe=recipe, block_tokens=bt, plan=plan,
                check_finite=False), do)
            ms = r["fwdbwd_ms"] = do_bench(fb, [qq, kk, vv]) if data == "normal" else float("nan")
            rows.append(r)
            print(f"{data:6s} {recipe:5s} B_t={bt:3d}: rel L2 vs fp64  O {r['o']:.4f}  dQ {r['dq']:.4f}  "
                  f"dK {r['dk']:.4f}  dV {r['dv']:.4f}   fwd+bwd {ms:.3f} ms")
    return rows


def bench_block_tokens(args):
    """MXFP8 fwd / bwd / fwd+bwd speed per block_tokens on the --quick workloads (the speed half of
    the default block_tokens choice; the accuracy half is --accuracy)."""
    rows = []
    for name, lens, H, HK, D in workloads(True):
        T, flops = sum(lens), fwd_flops(lens, H, D)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
        fns = {}
        for bt in flamia.BLOCK_TOKENS:
            fn = flamia_impl("mxfp8", lens, block_tokens=bt)
            fns[bt] = (lambda fn=fn: fn(q, k, v), *fwd_bwd(fn, q, k, v, do))
        for bt, (tf, tfb) in bench_rounds(fns, args.rounds).items():
            rows.append(dict(workload=name, block_tokens=bt, fwd_tflops=flops / tf / 1e9,
                             bwd_tflops=2.5 * flops / (tfb - tf) / 1e9, fwdbwd_tflops=3.5 * flops / tfb / 1e9))
            r = rows[-1]
            print(f"{name:14s} B_t={bt:3d}  fwd {r['fwd_tflops']:4.0f}  bwd {r['bwd_tflops']:4.0f}  "
                  f"fwd+bwd {r['fwdbwd_tflops']:4.0f} TFLOP/s ({tfb:.3f} ms)")
    return rows

def bench_tune(args):
    """Sweep kernel tile configs on one document and on packed documents (--workloads picks others,
    e.g. train_llama,2kdocs-16k-D64: head_dim 64 reuses D=128's tiles, never tuned on its own)."""
    rows = []
    # (BLOCK_M, BLOCK_N, MASKED_N, warps, stages)
    fwd_cfgs = [(64, 128, 32, 4, 3), (64, 128, 64, 4, 3), (64, 128, 128, 4, 3), (64, 64, 64, 4, 3),
                (64, 64, 32, 4, 3), (128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 64, 64, 8, 3)]
    bwd_cfgs = [((32, 128, 8, 3), (128, 64, 8, 3)), ((32, 128, 8, 2), (128, 64, 8, 2)),
                ((32, 64, 4, 3), (64, 64, 4, 3)), ((64, 128, 8, 3), (128, 64, 8, 3))]
    tiles0 = dict(flamia.TILES)  # each config goes into its head dim's row of the tile table
    for name, lens, H, HK, D in workloads(False):
        if not (selected(name, args.workloads) if args.workloads else name in ("1doc-16k", "2kdocs-16k")):
            continue
        T = sum(lens)
        q, k, v, do = (torch.randn(T, h, D, device="cuda", dtype=torch.bfloat16) for h in (H, HK, HK, H))
        flops = fwd_flops(lens, H, D)
        for recipe in ("mxfp8", "bf16"):
            fn = flamia_impl(recipe, lens)
            for cfg in fwd_cfgs:
                k_operand = flamia.variant(q, recipe, 1, backend="tl").k_operand  # the forward's tiles' key
                flamia.TILES[D] = tiles0[D]._replace(fwd=dict(tiles0[D].fwd, **{k_operand: cfg}))
                try:
                    ms = do_bench(lambda: fn(q, k, v))
                    rows.append(dict(workload=name, recipe=recipe, kind="fwd", cfg=cfg, ms=ms, tflops=flops / ms / 1e9))
                    print(f"{name} {recipe} fwd {cfg}: {ms:.3f} ms {flops / ms / 1e9:.0f} TFLOP/s")
                except Exception as e:
                    print(f"{name} {recipe} fwd {cfg}: failed {type(e).__name__}: {str(e)[:100]}")
            flamia.TILES[D] = tiles0[D]
            qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
            o = fn(qq, kk, vv)
            for cfg in bwd_cfgs:
                flamia.TILES[D] = tiles0[D]._replace(dkdv=cfg[0], dq=cfg[1])
                try:
                    ms = do_bench(lambda: torch.autograd.backward(o, do, retain_graph=True), [qq, kk, vv])
                    rows.append(dict(workload=name, recipe=recipe, kind="bwd", cfg=cfg, ms=ms,
                                     tflops=2.5 * flops / ms / 1e9))
                    print(f"{name} {recipe} bwd {cfg}: {ms:.3f} ms {2.5 * flops / ms / 1e9:.0f} TFLOP/s")
                except Exception as e:
                    print(f"{name} {recipe} bwd {cfg}: failed {type(e).__name__}: {str(e)[:100]}")
            flamia.TILES[D] = tiles0[D]
    return rows


def bench_breakdown(args):
    """Each launch of FLAMIA's forward and backward timed alone (ms), mxfp8 beside bf16: what the call
    time is made of. Default workloads: the quick three and the trainer's shape (--workloads picks)."""
    rows = []
    for name, lens, H, HK, D in workloads(False):
        if not (selected(name, args.workloads) if args.workloads else
                name in ("1doc-16k", "2kdocs-16k", "lognormal-16k") or name.startswith("train_llama")):
            continue
        T, scale, flops = sum(lens), D ** -0.5, fwd_flops(lens, H, D)
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        plan = flamia.flamia_plan(cu)
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v, do = (torch.randn(T, h, D, device="cuda", generator=g, dtype=torch.bfloat16) for h in (H, HK, HK, H))
        row = dict(workload=name)
        for recipe in ("mxfp8", "bf16"):
            r, var = flamia._RECIPES[recipe], flamia.variant(q, recipe, 1, plan)
            quantize = lambda: flamia._quantize_operands(q, k, v, plan, r, 1, var.copies, var.quantize_q)
            ops = quantize()
            fwd = lambda: flamia._attn_forward(q, k, v, ops, plan, var, causal=True, softmax_scale=scale,
                                               block_tokens=1)
            o, lse = fwd()
            call = lambda: flamia.flamia_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), recipe=recipe,
                                                          plan=plan)
            row.update({f"{recipe} forward call": do_bench(call), f"{recipe} forward kernel": do_bench(fwd),
                        f"{recipe} backward (all of it)": do_bench(lambda: flamia._attn_backward(
                            do, q, k, v, o, lse, ops, plan, var, causal=True, softmax_scale=scale,
                            block_tokens=1))})
            if r.quantized:
                x8 = flamia.MXFP8(ops.q, ops.q_exp)
                row.update({"mxfp8 quantizer (the forward's launch)": do_bench(quantize),
                            "mxfp8 Q dequantization (backward)": do_bench(
                                lambda: flamia._dequantize(x8, q.dtype, plan, "q"))})
        row["Delta = rowsum(dO O) (backward)"] = do_bench(lambda: flamia._delta(o, do))
        row["fwd TFLOP/s (mxfp8 call, bf16 call)"] = [flops / row[f"{r} forward call"] / 1e9 for r in ("mxfp8", "bf16")]
        rows.append(row)
        print(f"{name}: " + ", ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v[0]:.0f} / {v[1]:.0f}"
                                      for k, v in row.items() if k != "workload"), flush=True)
    return rows


def per_tensor_fp8(x):
    """TransformerEngine-style "current" scaling: ONE scale from the whole tensor's amax (leaky)."""
    scale = 448.0 / x.float().abs().amax().clamp(min=1e-12)
    return (x.float() * scale).to(torch.float8_e4m3fn), 1.0 / scale


def cudnn_fp8_dense(q, k, v):
    """cuDNN FP8 causal forward on a (B, S, H, D) batch through nvidia-cudnn-frontend, driven as a user
    would: per-tensor "current" scaling (each input's scale from its whole-tensor amax, O's from V's,
    since |O| <= max |V|). The batch layout, not THD: the packed FP8 graph crashed once with "illegal
    instruction", which poisons the CUDA context for every audit after it."""
    import cudnn
    DT = cudnn.data_type
    B, S0, H, D = q.shape
    S = -(-S0 // 128) * 128  # a tile-friendly length; causal rows never see the zero padding at the end
    pad = lambda x: torch.nn.functional.pad(x, (0, 0, 0, 0, 0, S - S0))
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    g = cudnn.pygraph(io_data_type=DT.FP8_E4M3, intermediate_data_type=DT.FLOAT, compute_data_type=DT.FLOAT,
                      handle=handle)
    dims, st = (B, H, S, D), (S * H * D, D, H * D, 1)  # logical BHSD over a BSHD buffer
    one = lambda x: torch.full((1, 1, 1, 1), float(x), device="cuda")
    t, buf = {}, {}
    for n, x in (("q", q), ("k", k), ("v", v)):
        data, desc = per_tensor_fp8(pad(x))
        buf[n], buf["descale_" + n] = data.contiguous(), one(desc)
        t[n] = g.tensor(dim=dims, stride=st, data_type=DT.FP8_E4M3, name=n)
    scale_o = 1.0 / buf["descale_v"].item()
    buf.update(descale_s=one(1 / 448.0), scale_s=one(448.0), scale_o=one(scale_o))
    sc = {n: g.tensor(dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=DT.FLOAT, name=n)
          for n in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")}
    t.update(sc)
    o, stats, amax_s, amax_o = g.sdpa_fp8(q=t["q"], k=t["k"], v=t["v"], name="f", generate_stats=True,
                                          attn_scale=1 / math.sqrt(D), use_causal_mask=True, **sc)
    t["o"] = o.set_output(True).set_dim(dims).set_stride(st).set_data_type(DT.FP8_E4M3)
    t["stats"] = stats.set_output(True).set_dim((B, H, S, 1)).set_stride((H * S, S, 1, 1)).set_data_type(DT.FLOAT)
    for n, a in (("amax_s", amax_s), ("amax_o", amax_o)):
        t[n] = a.set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(DT.FLOAT)
        buf[n] = one(0)
    buf["o"] = torch.zeros(B, S, H, D, device="cuda", dtype=torch.float8_e4m3fn)
    buf["stats"] = torch.zeros(B, H, S, 1, device="cuda")
    ws = build_graph(g)
    g.execute({x: buf[n] for n, x in t.items()}, ws, handle=handle)
    torch.cuda.synchronize()
    return buf["o"][:, :S0].float() / scale_o


def audit_impls():
    """Every attention this machine runs, as flash-attn varlen callables (causal, packed documents)."""
    from functools import partial
    F = flamia.flamia_attn_varlen_func
    impls = {f"flamia {r} B_t={bt}": partial(F, recipe=r, block_tokens=bt, return_lse=True)
             for r, bt in (("bf16", 1), ("mxfp8", 1), ("mxfp8", 32), ("mxfp8", 128), ("nvfp4", 32), ("mxfp4", 32))}
    impls["flamia mxfp8 B_t=32 safeguard=False (unsafe)"] = partial(F, recipe="mxfp8", block_tokens=32, safeguard=False,
                                                                    return_lse=True)

    def fp8_per_tensor(q, k, v, cu, *_):  # the per-tensor-scaled recipe of TE's issue #3248, emulated exactly
        deq = lambda x: (lambda d, s: d.float() * s)(*per_tensor_fp8(x)).to(x.dtype)
        return flamia.reference_attention(deq(q), deq(k), deq(v), cu, recipe="bf16", return_lse=True)
    impls["per-tensor FP8 (TE current scaling, emulated)"] = fp8_per_tensor

    def sdpa(q, k, v, cu, *_):  # one call per document, as users do without a varlen kernel
        outs = [torch.nn.functional.scaled_dot_product_attention(
            *(x[a:b].transpose(0, 1) for x in (q, k, v)), is_causal=True).transpose(0, 1)
            for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()) if b > a]
        return torch.cat(outs)
    impls["SDPA per document"] = sdpa

    def varlen(q, k, v, cu, cu_k, mq, mk):
        from torch.nn.attention.varlen import varlen_attn
        return varlen_attn(q, k, v, cu, cu_k, mq, mk, window_size=(-1, 0))
    impls["torch varlen_attn"] = varlen

    def flex(q, k, v, cu, *_):  # compiled, as benchmarked (eager flex is an unfused fallback)
        return flex_impl(cu.diff().tolist())(q, k, v)
    impls["FlexAttention document mask"] = flex
    impls["cuDNN FP8 per-tensor scaling (frontend, batch layout)"] = flamia.varlen_adapter(cudnn_fp8_dense)
    return impls


def bench_audit(args):
    """The table of who leaks: flamia.audit_causality on every attention available here."""
    rows = []
    for name, fn in audit_impls().items():
        t0 = time.time()
        try:
            found = flamia.audit_causality(fn, heads=2, head_dim=128, device="cuda")
        except Exception as e:
            print(f"{name:48s} could not run: {type(e).__name__}: {str(e)[:100]}")
            rows.append(dict(impl=name, error=f"{type(e).__name__}: {e}"[:300]))
            continue
        fut = [f for f in found if f["kind"] == "future"]
        doc = [f for f in found if f["kind"] == "document"]
        rows.append(dict(impl=name, future_leaks=len(fut), document_leaks=len(doc), findings=found,
                         max_future_change=max((f["max_abs_change"] for f in fut), default=0.0),
                         max_document_change=max((f["max_abs_change"] for f in doc), default=0.0)))
        r = rows[-1]
        print(f"{name:48s} future leaks {r['future_leaks']:3d} (max change {r['max_future_change']:.2e})  "
              f"document leaks {r['document_leaks']:3d} (max change {r['max_document_change']:.2e})  "
              f"[{time.time() - t0:.1f} s]")
    return rows


# ---- Blackwell, offline: what a B200 would execute, without a GPU (triton >= 3.9 ships its ptxas) ----
# flamia's own launch code runs on CPU tensors with every kernel launch recorded instead of run; each
# recorded launch then goes through the launcher's binder (the signature, constexprs and alignment a
# real launch would specialize on) and triton.compile for GPUTarget("cuda", 100, 32). The data are
# garbage (nothing runs), which compilation does not care about. Must run without TRITON_INTERPRET.
def sm100_configs():
    """(name, kind, recipe, backend, D, block_tokens): causal; the backward of mxfp8 runs the bf16
    kernels on dequantized operands, with or without the safeguard's per-token copies."""
    out = []
    for D in (128, 64):
        for recipe, backend in (("mxfp8", "dot_scaled"), ("mxfp4", "dot_scaled"), ("bf16", "tl")):
            for bt in ((1, 32, 128) if recipe != "bf16" else (1,)):
                out += [(f"{kind}-{recipe}-bt{bt}-D{D}", kind, recipe, backend, D, bt) for kind in ("fwd", "bwd")]
    return out


def sm100_launches(kind, recipe, backend, D, block_tokens, T=512, H=2):
    """[(kernel, args, kwargs)] of the attention kernels flamia launches for this configuration."""
    from triton.runtime.jit import JITFunction
    calls = []
    run, is_blackwell = JITFunction.run, flamia._is_blackwell
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: calls.append((self, args, kwargs))
    flamia._is_blackwell = lambda x: True  # CPU tensors: take the Blackwell tiles anyway
    try:
        q, k, v, do = (torch.randn(T, H, D, dtype=torch.bfloat16) for _ in range(4))
        plan = flamia.Plan(torch.tensor([0, T], dtype=torch.int32))
        var = flamia.variant(q, recipe, block_tokens, plan, True, True, backend)
        ops = flamia._quantize_operands(q, k, v, plan, var.recipe, block_tokens, var.copies)
        kw = dict(causal=True, softmax_scale=D ** -0.5, block_tokens=block_tokens)
        o, lse = flamia._attn_forward(q, k, v, ops, plan, var, **kw)
        if kind == "bwd":
            calls.clear()
            flamia._attn_backward(do, q, k, v, o, lse, ops, plan, var, **kw)
    finally:
        JITFunction.run, flamia._is_blackwell = run, is_blackwell
    names = ("_attn_fwd", "_attn_fwd_blackwell") if kind == "fwd" else ("_attn_bwd_dkdv", "_attn_bwd_dq")
    return [c for c in calls if c[0].__name__ in names]


def offline_compile(fn, args, kwargs, capability):
    """The launcher's own path (binder -> _pack_args -> ASTSource, GluonASTSource for a Gluon kernel ->
    compile) for a GPU of this compute capability (100: sm_100a, 90: sm_90a), which this machine
    need not have."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    from triton.runtime.jit import create_function_from_signature
    kwargs = dict(kwargs, debug=kwargs.get("debug", fn.debug) or knobs.runtime.debug,
                  instrumentation_mode=knobs.compilation.instrumentation_mode)
    if hasattr(knobs.compilation, "fpsan_homomorphic_casts"):
        kwargs["fpsan_homomorphic_casts"] = knobs.compilation.fpsan_homomorphic_casts
    target = GPUTarget("cuda", capability, 32)  # (backend, compute capability, warp size)
    backend = make_backend(target)
    bound, specialization, options = create_function_from_signature(fn.signature, fn.params, backend)(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    source = GluonASTSource if isinstance(fn, GluonJITFunction) else ASTSource
    return triton.compile(source(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


def compiled_row(row, compile_, facts):
    """row with the facts of compile_() added, or the compiler's error (a fact too), and the time."""
    t0 = time.time()
    try:
        row.update(facts(compile_()))
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[-1500:]}"
    row["compile_s"] = round(time.time() - t0, 1)
    return row


def sm100_facts(ck):
    """What the compiled kernel asks the hardware to do: MMA kinds (PTX), spills (ptxas -v with the
    flags Triton's make_cubin uses), TMA, byte-wide loads, warp-specialized partitions (TTGIR)."""
    import re
    import subprocess
    import tempfile
    ptx, ttgir = ck.asm["ptx"], ck.asm.get("ttgir", "")
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    ptxas = next(os.path.join(bin_dir, n) for n in ("ptxas-blackwell", "ptxas")
                 if os.path.exists(os.path.join(bin_dir, n)))
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        fmad = [] if ck.metadata.enable_fp_fusion else ["--fmad=false"]
        log = subprocess.run([ptxas, "-lineinfo", *fmad, "-v", "--regAllocOptLevel=2", "--gpu-name=sm_100a",
                              path, "-o", path + ".o"], capture_output=True, text=True).stderr
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    regs = re.findall(r"Used (\d+) registers", log)
    mma = re.findall(r"tcgen05\.mma(?:\.[\w:]+)*", ptx)
    return dict(mma_kinds=sorted({m.split("kind::")[1] for m in mma if "kind::" in m}), n_mma=len(mma),
                n_block_scaled=sum("block_scale" in m for m in mma),
                mma_sync=len(re.findall(r"\bmma\.sync\.aligned", ptx)), wgmma="wgmma.mma_async" in ptx,
                regs=int(regs[-1]) if regs else None,
                spill_bytes=sum(int(a) + int(b) for a, b in spills) if spills else None,
                tma="cp.async.bulk.tensor" in ptx,
                byte_loads=len(re.findall(r"ld\.global(?:\.\w+)*\.(?:u8|b8|s8)\b", ptx)),
                warp_specialized="ttg.warp_specialize" in ttgir,
                partitions=1 + len(re.findall(r"partition\d+\(", ttgir)))


def bench_sm100(args):
    """Compile every attention kernel configuration for sm_100a and tabulate what it executes."""
    rows = []
    for name, kind, recipe, backend, D, bt in sm100_configs():
        if not selected(name, args.workloads):
            continue
        for fn, a, kw in sm100_launches(kind, recipe, backend, D, bt):
            launch = {k: v for k, v in kw.items() if isinstance(v, (int, bool, str))}
            row = compiled_row(dict(config=name, kernel=fn.__name__, launch=launch),
                               lambda: offline_compile(fn, a, kw, 100), sm100_facts)
            rows.append(row)
            L = row["launch"]
            print(f"{name:20s} {fn.__name__:15s} tiles {L.get('BLOCK_M')}x{L.get('BLOCK_N')} "
                  f"w{L.get('num_warps')} s{L.get('num_stages')}: " +
                  (row["error"][:120] if "error" in row else
                   f"MMA {','.join(row['mma_kinds'])} ({row['n_block_scaled']} block-scaled), {row['regs']} regs, "
                   f"{row['spill_bytes']} B spilled, TMA {row['tma']}, {row['byte_loads']} byte loads, "
                   f"{row['partitions']} partition(s)"), flush=True)
    return rows


# ---- --sm90: the Gluon kernels (flamia_hopper.py) compiled offline for Hopper, no GPU needed ----
# flamia_hopper.py is written for triton 3.6 (Gluon's API moves between versions), so this mode runs
# with triton 3.6 importable: `pip install --no-deps --target DIR triton==3.6.0` and PYTHONPATH=DIR
# (torch from the main environment). The tests run it so, one configuration per process: a broken
# Gluon kernel can abort the compiler's process (an MLIR verifier error), not only raise.
SM90_CONFIGS = [f"{recipe}-bt{bt}-D{D}" for D in (128, 64) for recipe, bt in (("mxfp8", 1), ("mxfp8", 128), ("bf16", 1))]


def sm90_launches(config, T=512, H=4, HK=2):
    """[(kernel, args, kwargs)] of the launches flamia makes for a causal T-token document, GQA H/HK:
    the Gluon kernels (backend="gluon"), then the tl kernels (backend="tl", deterministic: the forward
    an H100 runs by default where Gluon's does not serve, and the tl backward). flamia's own launch
    code on CPU tensors, kernel launches recorded instead of run, only the GPU checks bypassed (the
    Gluon TensorDescriptor takes CPU tensors)."""
    from triton.experimental.gluon._runtime import GluonJITFunction
    from triton.runtime.jit import JITFunction
    recipe, bt, D = config.split("-")
    bt, D = int(bt[2:]), int(D[1:])
    calls = []
    saved = JITFunction.run, flamia.gluon_unavailable_reason, flamia.flamia_hopper._sm_count
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: calls.append((self, args, kwargs))
    flamia.gluon_unavailable_reason = lambda: None  # as on an sm_90 GPU with triton 3.6
    flamia.flamia_hopper._sm_count = lambda device: 132  # H100 SXM, H200: the persistent grid's size only
    try:
        q, do = (torch.randn(T, H, D, dtype=torch.bfloat16) for _ in range(2))
        k, v = (torch.randn(T, HK, D, dtype=torch.bfloat16) for _ in range(2))
        plan = flamia.Plan(torch.tensor([0, T], dtype=torch.int32))
        for backend, deterministic in (("gluon", False), ("tl", True)):
            var = flamia.variant(q, recipe, bt, plan, True, True, backend, deterministic)
            if var.refusal or var.backend != backend or var.bwd != backend:
                raise RuntimeError(f"{config}: variant() did not pick the {backend} kernels: {var.refusal or var}")
            ops = flamia._quantize_operands(q, k, v, plan, var.recipe, bt, var.copies, var.quantize_q)
            kw = dict(causal=True, softmax_scale=D ** -0.5, block_tokens=bt)
            o, lse = flamia._attn_forward(q, k, v, ops, plan, var, **kw)
            flamia._attn_backward(do, q, k, v, o, lse, ops, plan, var, **kw)
    finally:
        JITFunction.run, flamia.gluon_unavailable_reason, flamia.flamia_hopper._sm_count = saved
    return [c for c in calls if isinstance(c[0], GluonJITFunction) or c[0].__name__.startswith("_attn")]


def launcher_error(ck):
    """None if triton's CUDA launcher takes the compiled kernel's signature (its C source, generated
    here as at a GPU's first launch), else the error: triton 3.6, e.g., refuses tensor descriptors
    inside tuple arguments there, which compiling does not check."""
    from triton.backends.nvidia.driver import make_launcher
    src = ck.src
    index = lambda name: (src.fn.arg_names.index(name),) if isinstance(name, str) else name
    try:
        make_launcher({index(i): v for i, v in src.constants.items()}, dict(src.signature),
                      getattr(ck.metadata, "tensordesc_meta", None))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return None


def sm90_facts(ck):
    """wgmma kinds (PTX), spills (ptxas -v with triton 3.6's make_cubin flags), shared memory (which
    compiling does not check: the driver refuses at load), TMA, warp specialization, ptxas warnings,
    and whether the launcher takes the kernel's arguments."""
    import re
    import subprocess
    import tempfile
    ptx, ttgir = ck.asm["ptx"], ck.asm.get("ttgir", "")
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        fmad = [] if ck.metadata.enable_fp_fusion else ["--fmad=false"]
        log = subprocess.run([ptxas, "-lineinfo", *fmad, "-v", "--gpu-name=sm_90a", path, "-o", path + ".o"],
                             capture_output=True, text=True).stderr
        with open(path + ".cubin", "wb") as f:
            f.write(ck.asm["cubin"])
        sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"), "-sass", path + ".cubin"],
                              capture_output=True, text=True).stdout
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    mma = re.findall(r"wgmma\.mma_async[\w.:]*", ptx)
    # the key loops: innermost SASS loops (a backward branch's range) that issue MMAs; their length is the
    # per-tile cost the schedule has to hide (e.g. the forward's unmasked and masked key tiles)
    ins = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    loops = [(int(m.group(1), 16), a) for a, t in ins
             if (m := re.search(r"BRA\s.*?0x([0-9a-f]+)", t)) and int(m.group(1), 16) < a]
    inner = [(b, e) for b, e in loops if not any(b <= b2 and e2 <= e and (b2, e2) != (b, e) for b2, e2 in loops)]
    key_loops = [n for b, e in sorted(inner) if (body := [t for a, t in ins if b <= a <= e])
                 and any("GMMA" in t for t in body) for n in (len(body),)]
    return dict(wgmma_kinds=sorted({k for m in mma for k in m.split(".")[-2:]}), n_wgmma=len(mma), key_loops=key_loops,
                spill_bytes=sum(int(a) + int(b) for a, b in spills) if spills else None,
                shared=ck.metadata.shared, tma="cp.async.bulk.tensor" in ptx,
                warp_specialized="ttg.warp_specialize" in ttgir,
                ptxas_warnings=[line.strip() for line in log.splitlines() if "warning" in line.lower()],
                launcher_error=launcher_error(ck))


def bench_sm90(args):
    """Compile every Gluon kernel configuration, and the tl kernels beside it, for sm_90a with the
    GPU's triton 3.6, and tabulate what each executes."""
    if not triton.__version__.startswith("3.6"):
        raise SystemExit(f"--sm90 needs triton 3.6 (flamia_hopper.py's Gluon API), found {triton.__version__}: "
                         "pip install --no-deps --target DIR triton==3.6.0, then PYTHONPATH=DIR")
    if flamia.flamia_hopper is None:
        raise SystemExit(flamia._GLUON_IMPORT_ERROR)
    rows = []
    for config in SM90_CONFIGS:
        if not selected(config, args.workloads):
            continue
        for fn, a, kw in sm90_launches(config):
            print(f"compiling {config} {fn.__name__}", file=sys.stderr, flush=True)  # names a crash's kernel
            row = compiled_row(dict(config=config, kernel=fn.__name__), lambda: offline_compile(fn, a, kw, 90),
                               sm90_facts)
            rows.append(row)
            print(f"{config:18s} {fn.__name__:17s} " + (row["error"][:120] if "error" in row else
                  f"wgmma {','.join(row['wgmma_kinds'])} x{row['n_wgmma']}, {row['spill_bytes']} B spilled, "
                  f"{row['shared']} B shared, TMA {row['tma']}, warp-specialized {row['warp_specialized']}, "
                  f"key loops {row['key_loops']} SASS instructions"
                  + (f", ptxas: {row['ptxas_warnings']}" if row["ptxas_warnings"] else "")
                  + (f", LAUNCHER: {row['launcher_error']}" if row["launcher_error"] else "")), flush=True)
    return rows


def plot(rows, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(dict.fromkeys(r["workload"] for r in rows))
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(9, 1.6 * len(names)), 4.5))
    w = 0.8 / len(impls)
    colors = plt.get_cmap("tab20").colors  # one color per implementation (tab10 repeats after ten)
    for i, im in enumerate(impls):
        ys = [next((r["fwdbwd_tflops"] for r in rows if r["workload"] == n and r["impl"] == im), 0) for n in names]
        ax.bar([j + i * w for j in range(len(names))], ys, w, label=im, color=colors[i % len(colors)])
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(names))], names, rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("fwd+bwd TFLOP/s")
    ax.set_title(f"Attention fwd+bwd on {torch.cuda.get_device_name()} (FLAMIA includes quantization)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, not over them
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def peer_versions():
    """Versions of the optional peers' packages installed here (absent ones are left out)."""
    from importlib import metadata
    out = {}
    for pkg in ("flash-attn-4", "nvidia-cutlass-dsl", "nvidia-cudnn-frontend"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            pass
    return out


def save_json(args, rows):
    with open(args.json_path, "w") as f:
        json.dump(dict(meta=args.meta, rows=rows), f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--quick", action="store_true", help="one-minute subset of the workloads")
    ap.add_argument("--quant", action="store_true", help="benchmark the fused quantizer")
    ap.add_argument("--accuracy", action="store_true", help="error vs fp64 per recipe and block_tokens")
    ap.add_argument("--audit", action="store_true", help="causality audit of every attention on this machine")
    ap.add_argument("--tune", action="store_true", help="sweep kernel tile configurations")
    ap.add_argument("--breakdown", action="store_true", help="each launch of the forward and backward timed alone")
    ap.add_argument("--block-tokens", action="store_true", help="mxfp8 speed per block_tokens")
    ap.add_argument("--naive-plan", action="store_true", help="also run FLAMIA with tiles in document order")
    ap.add_argument("--sm100", action="store_true", help="no GPU needed: compile every kernel for Blackwell "
                    "(sm_100a) and print its MMA kinds, spills, TMA, partitions (--workloads filters configs)")
    ap.add_argument("--sm90", action="store_true", help="no GPU needed, triton 3.6: compile the Gluon kernels "
                    "(flamia_hopper.py) for sm_90a and print their wgmma kinds, spills, shared memory")
    ap.add_argument("--workloads", default="", help="comma-separated name prefixes of the attention workloads "
                    "to run, e.g. 1doc,gqa; a trailing $ matches the whole name, e.g. 2kdocs-16k$ (default: all; "
                    "names as printed in the table)")
    ap.add_argument("--skip-impls", default="", help="comma-separated substrings: implementations whose name "
                    "contains one are not run (attention table), e.g. 'FP4 emulated,naive'")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds per implementation "
                    "(the median is reported; with an even count, the slower middle value)")
    ap.add_argument("--out", default="out", help="directory for JSON and PNG")
    args = ap.parse_args()
    modes = ("quant", "accuracy", "tune", "breakdown", "audit", "block_tokens", "sm100", "sm90")
    mode = next((m for m in modes if getattr(args, m)), "attention")
    offline = mode in ("sm100", "sm90")
    if not offline and not torch.cuda.is_available():
        raise SystemExit("bench.py needs a CUDA GPU (only --sm100 and --sm90 run without one)")
    os.makedirs(args.out, exist_ok=True)
    meta = dict(gpu=f"none (compiled for sm_{mode[2:]}a)" if offline else torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, date=time.strftime("%Y-%m-%d"),
                **peer_versions())
    print(json.dumps(meta))
    args.meta, args.json_path = meta, os.path.join(args.out, f"bench_{mode}.json")
    rows = {"quant": bench_quant, "accuracy": bench_accuracy, "tune": bench_tune, "breakdown": bench_breakdown,
            "audit": bench_audit,
            "block_tokens": bench_block_tokens, "sm100": bench_sm100, "sm90": bench_sm90,
            "attention": bench_attention}[mode](args)
    save_json(args, rows)
    if mode == "attention":
        plot(rows, os.path.join(args.out, "bench_attention.png"))


if __name__ == "__main__":
    main()
