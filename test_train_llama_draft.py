"""Tests for train_llama.py (draft, to be merged into test_flamia.py as its own section).

Everything uses a tiny config and a few steps (whole file: well under 3 minutes on 2 CPU cores).
On a CPU, conftest.py sets TRITON_INTERPRET=1 so that test_flamia.py runs the kernels in Triton's
interpreter; training through the interpreter would be far too slow, so these tests ask for the
`cpu_training` fixture (NOT autouse: merged into test_flamia.py, it must not touch the kernel tests).
It unsets TRITON_INTERPRET, so flamia computes attention with its PyTorch oracle as train_llama.py
does on a CPU, and hides CUDA, so that bitwise resume and tight leak tolerances hold on a GPU
machine too (fp32, deterministic). Subprocesses get the same environment (CUDA_VISIBLE_DEVICES="").
test_train_gpu_smoke covers the GPU path (kernels, plan, bf16 autocast) where there is a GPU.
"""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import flamia
import train_llama as tl

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "train_llama.py")
# A tiny Llama: 1 layer, 1 head of 64 (flamia's smallest head_dim), 256-token batches.
TINY = ["--d_model", "64", "--n_layers", "1", "--n_heads", "1", "--n_kv_heads", "1", "--head_dim", "64",
        "--ffn_dim", "128", "--tokens_per_batch", "256", "--max_doc_len", "64", "--lr", "3e-3", "--min_lr", "3e-4",
        "--warmup_steps", "2", "--eval_batches", "2", "--log_interval", "1", "--peak_tflops", "0"]


@pytest.fixture
def cpu_training(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def _env(cpu=False):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _corpus(lens, seed=0):
    """Document d of length n holds tokens d * 1000 + 0 .. n-1: every token says where it came from."""
    tokens = np.concatenate([d * 1000 + np.arange(n) for d, n in enumerate(lens)]).astype(np.int64)
    ends = np.cumsum(lens)
    return tl.Corpus(tokens, ends - np.asarray(lens), ends)


# ---------------------------------------------------------------------------------------------
# packing
# ---------------------------------------------------------------------------------------------
def test_cut_long_documents():
    c = _corpus([10, 3, 4]).cut(4)
    assert (c.ends - c.starts).tolist() == [4, 4, 2, 3, 4]
    assert [c.tokens[a:b].tolist() for a, b in zip(c.starts, c.ends)][:3] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_packing_cu_seqlens_whole_documents_targets_positions():
    budget = max_len = 64
    lens = np.random.default_rng(0).integers(1, 40, 60).tolist() + [150, 64, 65]  # 3 documents >= the budget
    corpus = _corpus(lens).cut(max_len)
    pieces = sorted((int(corpus.tokens[a]), int(b - a)) for a, b in zip(corpus.starts, corpus.ends))
    assert len(pieces) == 60 + 3 + 1 + 2  # 150 -> 64 + 64 + 22, 64 -> 64, 65 -> 64 + 1
    for loop in (False, True):  # one pass in a fixed order (validation), and shuffled epochs (training)
        packer, seen = tl.Packer(corpus, budget, max_len, seed=1, loop=loop), []
        while len(seen) < len(pieces) and (b := packer.next_batch()) is not None:
            cu, tok, tgt = b.cu, b.tokens.numpy(), b.targets.numpy()
            assert cu.dtype == torch.int32 and cu[0] == 0 and cu[-1] == budget == len(tok)
            assert cu.diff().tolist() == b.lens and min(b.lens) > 0 and b.max_len == max(b.lens) <= max_len
            docs = [(int(cu[i]), int(cu[i + 1])) for i in range(len(b.lens)) if cu[i + 1] <= b.n_real]
            assert sum(e - s for s, e in docs) == b.n_real  # real documents first, then padding documents
            for s, e in docs:
                # a whole document (or a whole piece of an over-long one), in order: never split across batches
                assert (tok[s:e] == tok[s] + np.arange(e - s)).all()
                seen.append((int(tok[s]), e - s))
                # targets: the next token of the SAME document; a document's last token has none
                assert (tgt[s:e - 1] == tok[s + 1:e]).all() and tgt[e - 1] == -100
            assert (tgt[b.n_real:] == -100).all()  # padding is never a target
            pos = tl.positions_from_cu(cu, budget)
            for i in range(len(b.lens)):  # RoPE positions restart at 0 at every document start
                assert pos[cu[i]:cu[i + 1]].tolist() == list(range(b.lens[i]))
        if not loop:
            assert sorted(seen) == pieces  # every document exactly once
        else:  # epoch 1 documents enter the lookahead window only once every epoch 0 document has
            first = seen[:len(pieces) - packer.lookahead]
            assert len(set(first)) == len(first) and set(first) <= set(pieces)


def test_packer_deals_documents_to_ranks_and_resumes():
    corpus = _corpus(list(range(1, 41)))
    shards = [set(tl.Packer(corpus, 32, 32, rank=r, world=3).mine.tolist()) for r in range(3)]
    assert set.union(*shards) == set(range(40)) and sum(map(len, shards)) == 40  # dealt, never shared
    a = tl.Packer(corpus, 32, 32, rank=1, world=3, seed=5)
    for _ in range(7):
        a.next_batch()
    b = tl.Packer(corpus, 32, 32, rank=1, world=3, seed=5)
    b.load_state_dict(a.state_dict())
    for _ in range(10):  # crosses an epoch boundary
        x, y = a.next_batch(), b.next_batch()
        assert torch.equal(x.tokens, y.tokens) and torch.equal(x.cu, y.cu)
        assert {int(t) // 1000 for t in x.tokens[:x.n_real]} <= shards[1]  # only this rank's documents


def test_documents_do_not_see_each_other(cpu_training):
    """A document's hidden states are the same alone or packed after another document: positions
    restart and attention stays inside documents (sdpa reference and every FLAMIA recipe)."""
    cfg = tl.parse_config(TINY + ["--vocab_size", "256"])
    torch.manual_seed(0)
    model = tl.Llama(cfg)
    doc1, doc2 = np.arange(20) % 256, (np.arange(30) * 7) % 256
    for attn in ("sdpa",) + flamia.RECIPES:
        cfg.attn = attn
        alone = model.hidden(tl.make_batch(tl.Corpus(doc2, [0], [30]), [0], 64, 64))[:30]
        both = tl.make_batch(tl.Corpus(np.r_[doc1, doc2], [0, 20], [20, 50]), [0, 1], 64, 64)
        torch.testing.assert_close(model.hidden(both)[20:50], alone, atol=1e-5, rtol=1e-5, msg=attn)


def test_flamia_attention_matches_sdpa_reference(cpu_training):
    cfg = tl.parse_config(TINY + ["--vocab_size", "256", "--n_heads", "2"])
    torch.manual_seed(0)
    model = tl.Llama(cfg)
    c = _corpus([17, 40, 3, 64, 90])
    b = tl.Packer(tl.Corpus(c.tokens % 256, c.starts, c.ends).cut(64), 256, 64).next_batch()
    losses = {}
    for attn in ("sdpa",) + flamia.RECIPES:
        cfg.attn = attn
        losses[attn] = model(b).item()
    for attn, tol in (("bf16", 2e-3), ("mxfp8", 2e-2), ("nvfp4", 1e-1)):
        if attn in losses:
            assert abs(losses[attn] - losses["sdpa"]) < tol, losses


def test_data_formats(tmp_path):
    txt = tmp_path / "corpus.txt"
    txt.write_text("doc one\nline\n\n\ndoc two\n\n\n\n\ndoc three\n")  # two or more blank lines separate
    train, val, vocab = tl.load_documents(tl.Config(data=str(txt), val_every=3, max_doc_len=64))
    docs = [bytes(c.tokens[a:b]) for c in (val, train) for a, b in zip(c.starts, c.ends)]
    assert vocab == 256 and docs == [b"doc one\nline", b"doc two", b"doc three\n"]
    (tmp_path / "bin").mkdir()
    np.array([5, 6, 9, 7, 9, 8, 8, 8], np.uint16).tofile(tmp_path / "bin" / "train.bin")  # 9 ends a document
    np.array([1, 9], np.uint16).tofile(tmp_path / "bin" / "val.bin")
    train, val, vocab = tl.load_documents(tl.Config(data=str(tmp_path / "bin"), vocab_size=16, doc_sep_token=9,
                                                    max_doc_len=2))
    assert vocab == 16 and [train.tokens[a:b].tolist() for a, b in zip(train.starts, train.ends)] == \
        [[5, 6], [9], [7, 9], [8, 8], [8]] and [val.tokens[a:b].tolist() for a, b in zip(val.starts, val.ends)] == [[1, 9]]


# ---------------------------------------------------------------------------------------------
# end to end
# ---------------------------------------------------------------------------------------------
def test_train_smoke_checkpoint_resume_and_leak_probe(tmp_path, cpu_training):
    args = TINY + ["--max_steps", "16", "--eval_interval", "8", "--ckpt_interval", "100", "--attn", "mxfp8"]
    full = tl.main(args + ["--out_dir", str(tmp_path / "a"), "--eval_leak", "--leak_docs", "2", "--leak_len", "48"])
    train = [l for _, l in full["train_loss"]]
    assert len(train) == 16 and np.mean(train[-4:]) < np.mean(train[:4]) - 0.5, train  # it learns
    assert full["val_loss"][-1][1] < full["val_loss"][0][1] < np.log(256), full["val_loss"]
    for f in ("ckpt.pt", "log.csv", "loss.png"):
        assert (tmp_path / "a" / f).stat().st_size > 0
    assert len((tmp_path / "a" / "log.csv").read_text().splitlines()) == 17
    tf, ar, diff = full["leak"]
    assert abs(ar - tf) < 1e-4 and diff < 1e-3, full["leak"]  # safe recipe: no gap
    # preempted at step 8, resumed: the same losses, bit for bit
    half = tl.main(args + ["--out_dir", str(tmp_path / "b"), "--stop_at", "8"])
    assert half["train_loss"] == full["train_loss"][:8]
    rest = tl.main(args + ["--out_dir", str(tmp_path / "b"), "--resume"])
    assert rest["train_loss"] == full["train_loss"][8:] and rest["final_val"] == full["final_val"]
    assert (tmp_path / "b" / "log.csv").read_text().count("\n") == 17
    a, b = (torch.load(tmp_path / d / "ckpt.pt", weights_only=False) for d in "ab")
    assert a["step"] == b["step"] == 16 and all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_train_gpu_smoke(tmp_path):
    """The GPU path: a plan per batch, FLAMIA's kernels forward and backward, bf16 autocast."""
    hist = tl.main(TINY + ["--max_steps", "12", "--eval_interval", "6", "--out_dir", str(tmp_path), "--eval_leak",
                           "--leak_docs", "2", "--leak_len", "48"])
    train = [l for _, l in hist["train_loss"]]
    assert np.isfinite(train).all() and np.mean(train[-3:]) < np.mean(train[:3]) - 0.3, train
    tf, ar, diff = hist["leak"]
    assert abs(ar - tf) < 2e-2, hist["leak"]  # bf16 autocast: packing changes the rounding a little


def test_leak_probe_sees_the_unsafe_setting(cpu_training):
    """With 32-token K/V scale blocks and no safeguard, a key's rounding depends on later keys of its
    block. Power-of-two scales over E4M3 only change the rounding of elements that fall into E4M3's
    subnormal range, so the leak needs an outlier: the space byte gets its own direction, which wk
    maps to large keys. Then teacher-forced logits of earlier positions change; with the safeguard
    they stay within summation-order noise of the autoregressive ones (~4e-7 here)."""
    cfg = tl.parse_config(TINY + ["--vocab_size", "256", "--leak_docs", "2", "--leak_len", "64"])
    torch.manual_seed(0)
    model = tl.Llama(cfg)
    with torch.no_grad():
        model.embed.weight[:, 0] = 0
        model.embed.weight[ord(" ")] = torch.nn.functional.one_hot(torch.tensor(0), 64).float()
        model.blocks[0].wk.weight[:, 0] *= 300
    val = tl.Corpus(np.frombuffer(open(tl.__file__, "rb").read()[:2000], np.uint8), [0, 1000], [1000, 2000])
    diffs = {}
    for leaky in (False, True):
        cfg.unsafe_leaky_attention = leaky
        tf, ar, diffs[leaky] = tl.leak_probe(model, cfg, val, torch.device("cpu"), torch.autocast("cpu", enabled=False))
        assert abs(ar - tf) < 1e-4, (leaky, tf, ar)  # the loss gap itself is far below noise here
    assert diffs[False] < 1e-5 < diffs[True], diffs


def test_torchrun_two_ranks_gloo(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", SCRIPT,
           *TINY, "--max_steps", "3", "--eval_interval", "3", "--out_dir", str(tmp_path)]
    r = subprocess.run(cmd, cwd=HERE, env=_env(cpu=True), capture_output=True, text=True, timeout=170)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "2 rank(s)" in r.stdout and "global batch 512 tokens" in r.stdout
    ck = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    assert ck["step"] == 3 and len(ck["packers"]) == 2 and ck["packers"][0] != ck["packers"][1]


# ---------------------------------------------------------------------------------------------
# bad input: one line on stderr, exit code 2, no traceback
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args, msg", [
    (["--data", "/no/such/path"], "no such file"),
    (["--data", "EMPTY_DIR"], "no documents found"),
    (["--tokens_per_batch", "1"], "at least 2 tokens"),
    (["--tokens_per_batch", "0"], "at least 2 tokens"),
    (["--attn", "fp4"], "choose one of"),
    (["--unsafe_leaky_attention", "--attn", "bf16"], "needs --attn mxfp8"),
    (["--resume", "--out_dir", "EMPTY_DIR"], "no checkpoint"),
    (["--max_steps", "many"], "invalid int value"),
    (["--data", "BIN_DIR"], "pass --vocab_size"),
])
def test_bad_input_exits_2(args, msg, tmp_path, capsys, cpu_training):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bin").mkdir()
    np.zeros(4, np.uint16).tofile(tmp_path / "bin" / "train.bin")
    args = [{"EMPTY_DIR": str(tmp_path / "empty"), "BIN_DIR": str(tmp_path / "bin")}.get(a, a) for a in args]
    with pytest.raises(SystemExit) as e:
        tl.main(TINY + ["--max_steps", "1", "--out_dir", str(tmp_path / "out")] + args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and msg in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


def test_nvfp4_refused_when_flamia_lacks_it(monkeypatch, capsys):
    monkeypatch.setattr(flamia, "RECIPES", ("bf16", "mxfp8"))
    with pytest.raises(SystemExit) as e:
        tl.main(["--attn", "nvfp4"])
    assert e.value.code == 2 and "no nvfp4 recipe" in capsys.readouterr().err


def test_bad_input_exit_code_of_the_process():
    r = subprocess.run([sys.executable, SCRIPT, "--attn", "fp4"], cwd=HERE, env=_env(cpu=True), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--attn 'fp4'" in r.stderr, r.stderr
