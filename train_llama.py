"""
train_llama.py -- pretrain a small Llama on packed documents with FLAMIA attention.

nanoGPT-style: one readable file, no framework. Every batch is a fixed token budget filled with
whole documents; attention never crosses a document (cu_seqlens), RoPE positions restart at every
document, and nothing is learned across a document boundary (the last token of a document has no
target). Attention runs through flamia.flamia_attn_varlen_func (MXFP8 by default).

    python train_llama.py                              # 1 GPU: ~25M-param Llama, ~5 min on an H200
    python train_llama.py                              # no GPU: a tiny config, a few minutes on 2 cores
    python train_llama.py --attn bf16 --max_steps 200  # any Config field is a flag
    torchrun --nproc_per_node=2 train_llama.py         # DDP (nccl on GPUs, gloo on CPU)
    python train_llama.py --data PATH                  # a real corpus (below)
    python train_llama.py --resume                     # continue out_train/ckpt.pt exactly
    python train_llama.py --resume --eval_leak         # leak probe of a trained checkpoint (no more steps)
    python train_llama.py --attn mxfp8 --unsafe_leaky_attention --eval_leak   # the leak demo

Data (no download by default): every *.py file of the Python standard library (site-packages
excluded), sorted, one file = one document, bytes as tokens (vocab 256). --data PATH may be:
  * a directory: every *.txt *.md *.rst *.py file below it (recursive, sorted), one file = one document;
  * a text file: documents separated by two consecutive blank lines ("\\n\\n\\n");
  * a directory holding nanoGPT-style train.bin / val.bin (raw uint16 token ids, no header),
    or one such .bin file: documents END with --doc_sep_token (kept as the document's last token,
    so the model learns to end documents); --vocab_size is then required.
Every --val_every-th document (the first one included) is held out, unless val.bin exists.
A real corpus, e.g. FineWeb-Edu: take nanoGPT's data/openwebtext/prepare.py, load
"HuggingFaceFW/fineweb-edu" (name="sample-10BT") instead of openwebtext, run it (it writes
train.bin / val.bin of GPT-2 tokens, <|endoftext|> = 50256 after every document), then
    python train_llama.py --data data/fineweb_edu --vocab_size 50304 --doc_sep_token 50256
Outputs in --out_dir: ckpt.pt, log.csv (step, train_loss, val_loss, lr, tokens_per_s), loss.png.
"""
import argparse
import contextlib
import csv
import math
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, fields

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import triton
from tqdm import tqdm

import flamia


@dataclass
class Config:
    # data
    data: str = ""  # "" = the standard library's *.py files; else a dir, a text file or train.bin/val.bin
    vocab_size: int = 0  # 0 = 256 (bytes); required for .bin tokens (e.g. 50304 for GPT-2)
    doc_sep_token: int = 50256  # .bin only: the token that ends every document
    val_every: int = 20  # every 20th document is validation (deterministic)
    # model
    d_model: int = 512  # residual width
    n_layers: int = 8  # transformer blocks
    n_heads: int = 8  # query heads
    n_kv_heads: int = 4  # key/value heads (GQA: n_heads / n_kv_heads queries share one)
    head_dim: int = 64  # FLAMIA kernels support 64 and 128
    ffn_dim: int = 1536  # SwiGLU hidden width (~8/3 d_model, rounded to 256)
    tie_embeddings: bool = True  # share input embedding and output head (see Llama)
    rope_theta: float = 10000.0  # RoPE base
    # attention
    attn: str = "mxfp8"  # bf16 | mxfp8 | nvfp4 (FLAMIA recipes) | sdpa (PyTorch reference)
    unsafe_leaky_attention: bool = False  # mxfp8 WITHOUT the causal safeguard: leaks the future (demo)
    # batch
    tokens_per_batch: int = 32768  # token budget per rank and step (the global batch is x world size)
    max_doc_len: int = 2048  # context window: longer documents are cut into pieces of this length
    # optimizer
    lr: float = 2e-3  # peak learning rate
    min_lr: float = 2e-4  # cosine decay floor
    warmup_steps: int = 100  # linear warmup
    max_steps: int = 2500  # total steps (the schedule ends here)
    weight_decay: float = 0.1  # AdamW, on 2-D weights only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    # run
    seed: int = 1337  # model init and data order
    out_dir: str = "out_train"  # checkpoint, CSV log, loss plot
    resume: bool = False  # continue from out_dir/ckpt.pt (model, optimizer, step, data position, RNG)
    stop_at: int = 0  # stop (and checkpoint) after this step without changing the schedule; 0 = max_steps
    eval_interval: int = 250  # validate every N steps (and at the end)
    eval_batches: int = 16  # validation batches per rank (the same ones every time)
    log_interval: int = 10  # CSV row every N steps
    ckpt_interval: int = 500  # checkpoint every N steps (and at the end)
    compile: bool = False  # torch.compile the model
    peak_tflops: float = 989.0  # MFU denominator: H200 dense bf16 (0 = no MFU)
    eval_leak: bool = False  # after training: teacher-forced vs autoregressive val loss (MatX's probe)
    leak_docs: int = 8  # leak probe: documents
    leak_len: int = 256  # leak probe: tokens per document


# Without a GPU: something that finishes in a few minutes on 2 cores but still shows learning.
CPU_DEFAULTS = dict(d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=384, tokens_per_batch=1024,
                    max_doc_len=256, lr=3e-3, min_lr=3e-4, warmup_steps=20, max_steps=300, eval_interval=100,
                    eval_batches=8, log_interval=10, ckpt_interval=100, peak_tflops=0.0, leak_docs=4, leak_len=128)
MODEL_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim",
                "tie_embeddings", "max_doc_len")
TEXT_EXTS = (".txt", ".md", ".rst", ".py")


def die(msg):
    """Bad input: one clear line on stderr and exit code 2 (argparse's convention), no traceback."""
    print(f"train_llama.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse prints usage + error; we want the one-line contract of die()
        die(message)


def parse_config(argv=None) -> Config:
    """Flags are generated from the dataclass, so a new field is a new flag with no extra code.
    All flags default to None so we can tell what the user set: the GPU/CPU defaults apply below it."""
    p = _Parser(description="Pretrain a small Llama with FLAMIA attention (see the module docstring).")
    for f in fields(Config):
        if f.type in (bool, "bool"):  # --compile, --compile true, --compile 0
            p.add_argument(f"--{f.name}", nargs="?", const=True, default=None,
                           type=lambda s: s.lower() in ("1", "true", "yes", "on"))
        else:
            p.add_argument(f"--{f.name}", type=f.type, default=None)
    user = {k: v for k, v in vars(p.parse_args(argv)).items() if v is not None}
    cfg = Config(**(CPU_DEFAULTS if not torch.cuda.is_available() else {}))
    for k, v in user.items():
        setattr(cfg, k, v)
    return cfg


def validate(cfg: Config):
    if cfg.attn == "nvfp4" and "nvfp4" not in flamia.RECIPES:
        die(f"--attn nvfp4: this flamia has no nvfp4 recipe yet (flamia.RECIPES = {flamia.RECIPES})")
    if cfg.attn not in flamia.RECIPES + ("sdpa",):
        die(f"--attn {cfg.attn!r}: choose one of {', '.join(flamia.RECIPES + ('sdpa',))}")
    if cfg.unsafe_leaky_attention and cfg.attn != "mxfp8":
        die("--unsafe_leaky_attention only exists for --attn mxfp8 (it removes mxfp8's causal safeguard)")
    if cfg.tokens_per_batch < 2:
        die(f"--tokens_per_batch {cfg.tokens_per_batch}: a batch needs at least 2 tokens (an input and its target)")
    if cfg.max_doc_len < 2:
        die(f"--max_doc_len {cfg.max_doc_len}: a document needs at least 2 tokens (an input and its target)")
    if cfg.attn != "sdpa" and cfg.head_dim not in flamia.HEAD_DIMS:
        die(f"--head_dim {cfg.head_dim}: FLAMIA supports {flamia.HEAD_DIMS}")
    if cfg.head_dim % 2 or cfg.n_kv_heads < 1 or cfg.n_heads % cfg.n_kv_heads:
        die(f"need an even head_dim and n_heads ({cfg.n_heads}) a multiple of n_kv_heads ({cfg.n_kv_heads})")
    if min(cfg.max_steps, cfg.eval_interval, cfg.eval_batches, cfg.log_interval, cfg.ckpt_interval) < 1:
        die("max_steps, eval_interval, eval_batches, log_interval and ckpt_interval must be >= 1")
    cfg.max_doc_len = min(cfg.max_doc_len, cfg.tokens_per_batch)  # a document must fit in a batch


# ---------------------------------------------------------------------------------------------
# Data: a corpus is ONE flat token array plus document [start, end) offsets. Offsets instead of a
# list of arrays so a 10B-token memmap costs two int64 arrays, not ten million Python objects.
# ---------------------------------------------------------------------------------------------
class Corpus:
    def __init__(self, tokens, starts, ends):
        self.tokens, self.starts, self.ends = tokens, np.asarray(starts, np.int64), np.asarray(ends, np.int64)

    def __len__(self):
        return len(self.starts)

    def subset(self, idx):
        return Corpus(self.tokens, self.starts[idx], self.ends[idx])

    def cut(self, max_len):
        """A document longer than max_len becomes several documents of max_len (the last one shorter)."""
        n = -(-(self.ends - self.starts) // max_len)  # pieces per document
        first = np.repeat(self.starts, n)
        starts = first + (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)) * max_len
        return Corpus(self.tokens, starts, np.minimum(starts + max_len, np.repeat(self.ends, n)))


def _bytes_corpus(blobs):
    blobs = [b for b in blobs if b.strip()]  # skip empty documents (e.g. empty __init__.py)
    ends = np.cumsum([len(b) for b in blobs])
    return Corpus(np.frombuffer(b"".join(blobs), np.uint8), ends - [len(b) for b in blobs], ends)


def _bin_corpus(path, sep):
    """nanoGPT .bin: raw uint16 ids; a document ends with (and includes) the separator token."""
    tok = np.memmap(path, dtype=np.uint16, mode="r")
    chunk = 1 << 26  # scan in chunks: `tok == sep` on 10B tokens at once would need 10 GB
    ends = np.concatenate([np.flatnonzero(tok[i:i + chunk] == sep) + i + 1 for i in range(0, len(tok), chunk)]
                          + [np.array([len(tok)], np.int64)])
    ends = np.unique(ends[ends > 0])  # the tail after the last separator is a document too
    return Corpus(tok, np.concatenate([[0], ends[:-1]]), ends)


def load_documents(cfg: Config):
    """-> (train Corpus, val Corpus, vocab_size), documents cut to cfg.max_doc_len."""
    path, val = cfg.data or os.path.dirname(os.__file__), None
    if not os.path.exists(path):
        die(f"--data {path}: no such file or directory")
    binfile = os.path.join(path, "train.bin") if os.path.isdir(path) else path
    if binfile.endswith(".bin") and os.path.isfile(binfile):
        if cfg.vocab_size <= cfg.doc_sep_token:
            die(f"--data {path} holds .bin token ids: pass --vocab_size (> --doc_sep_token {cfg.doc_sep_token}), "
                "e.g. 50304 for GPT-2 tokens")
        train, vocab = _bin_corpus(binfile, cfg.doc_sep_token), cfg.vocab_size
        vfile = os.path.join(os.path.dirname(binfile), "val.bin")
        val = _bin_corpus(vfile, cfg.doc_sep_token) if os.path.isfile(vfile) else None
    elif os.path.isdir(path):
        skip = {"site-packages", "dist-packages", "__pycache__"} if not cfg.data else set()
        files = []
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in skip)
            files += [os.path.join(root, n) for n in sorted(names) if n.endswith(TEXT_EXTS if cfg.data else ".py")]
        blobs = []
        for f in files:
            with open(f, "rb") as fh:
                blobs.append(fh.read())
        train, vocab = _bytes_corpus(blobs), max(cfg.vocab_size, 256)
    else:
        with open(path, "rb") as fh:
            train, vocab = _bytes_corpus(re.split(rb"\n(?:[ \t]*\n){2,}", fh.read())), max(cfg.vocab_size, 256)
    if len(train) == 0:
        die(f"--data {path}: no documents found (empty, or no {'/'.join(TEXT_EXTS)} files)")
    if val is None:  # hold out whole documents, BEFORE cutting: no file is in both splits
        if len(train) < 2:
            die(f"--data {path}: need at least 2 documents (one to train on, one to validate)")
        is_val = np.arange(len(train)) % cfg.val_every == 0
        train, val = train.subset(~is_val), train.subset(is_val)
    return train.cut(cfg.max_doc_len), val.cut(cfg.max_doc_len), vocab


class Batch:
    """One packed batch. A plain class (not a dataclass) so DDP passes it through untouched."""

    def __init__(self, tokens, targets, cu, lens, n_real):
        self.tokens, self.targets, self.cu, self.lens, self.n_real = tokens, targets, cu, lens, n_real
        self.max_len, self.plan = max(lens), None  # lens: host list (no sync for max_len / FLOPs)

    def to(self, device):
        return Batch(*(t.to(device, non_blocking=True) for t in (self.tokens, self.targets, self.cu)),
                     self.lens, self.n_real)


def make_batch(corpus: Corpus, doc_ids, budget: int, max_len: int) -> Batch:
    """Concatenate whole documents, then pad to exactly `budget` tokens (stable shapes for
    torch.compile and memory). Padding is cut into short documents of its own: nothing attends
    to it, it has no targets, and its attention costs O(128^2) per piece, not O(pad^2)."""
    parts = [np.asarray(corpus.tokens[corpus.starts[d]:corpus.ends[d]], np.int64) for d in doc_ids]
    lens = [len(p) for p in parts]
    n_real, piece = sum(lens), min(128, max_len)
    lens += [piece] * ((budget - n_real) // piece) + ([(budget - n_real) % piece] if (budget - n_real) % piece else [])
    tokens = torch.from_numpy(np.concatenate(parts + [np.zeros(budget - n_real, np.int64)]))
    cu = torch.tensor(np.cumsum([0] + lens), dtype=torch.int32)
    # Next-token targets INSIDE a document only: shift left, then blank the last token of every
    # document (its "next token" is the first token of an unrelated document) and all padding.
    targets = torch.roll(tokens, -1)
    targets[cu[1:].long() - 1] = -100
    targets[n_real:] = -100
    return Batch(tokens, targets, cu, lens, n_real)


class Packer:
    """Deals this rank's documents into fixed-budget batches, reproducibly.

    Documents are dealt to ranks once (piece i goes to rank i % world), so no document is split
    across ranks and none is seen by two ranks; each rank reshuffles its share every epoch from
    (seed, rank, epoch), so an epoch sees each document once. First-fit over a small lookahead
    window keeps padding low without sorting the corpus. The whole data position is
    (epoch, cursor, pending): state_dict() is all a checkpoint needs to continue identically."""

    def __init__(self, corpus, budget, max_len, rank=0, world=1, seed=0, loop=True, lookahead=64):
        self.corpus, self.budget, self.max_len, self.loop, self.seed, self.rank = corpus, budget, max_len, loop, seed, rank
        self.mine = np.arange(rank, len(corpus), world)
        self.lens = corpus.ends - corpus.starts
        self.lookahead = min(lookahead, len(self.mine))  # never the same document twice in a window
        self.epoch, self.cursor, self.pending = 0, 0, []
        self._order = None

    def state_dict(self):
        return {"epoch": self.epoch, "cursor": self.cursor, "pending": list(self.pending)}

    def load_state_dict(self, s):
        self.epoch, self.cursor, self.pending, self._order = s["epoch"], s["cursor"], list(s["pending"]), None

    def _next_doc(self):
        if self.cursor == len(self.mine):
            if not self.loop:
                return None
            self.epoch, self.cursor, self._order = self.epoch + 1, 0, None
        if self._order is None:
            rng = np.random.default_rng([self.seed, self.rank, self.epoch])
            self._order = self.mine[rng.permutation(len(self.mine))] if self.loop else self.mine
        self.cursor += 1
        return int(self._order[self.cursor - 1])

    def doc_ids(self):
        """The documents of the next batch (empty list: a non-looping packer is exhausted)."""
        take, used = [], 0
        while used < self.budget:
            while len(self.pending) < self.lookahead and (d := self._next_doc()) is not None:
                self.pending.append(d)
            fit = next((i for i, d in enumerate(self.pending) if self.lens[d] <= self.budget - used), None)
            if fit is None:
                break
            take.append(self.pending.pop(fit))
            used += int(self.lens[take[-1]])
        return take

    def next_batch(self):
        ids = self.doc_ids()
        return make_batch(self.corpus, ids, self.budget, self.max_len) if ids else None


# ---------------------------------------------------------------------------------------------
# Model: Llama (RMSNorm, RoPE, SwiGLU, GQA, no biases) on packed (total_tokens, ...) tensors.
# There is no batch dimension anywhere: documents are told apart by cu_seqlens alone.
# ---------------------------------------------------------------------------------------------
def positions_from_cu(cu: torch.Tensor, total: int) -> torch.Tensor:
    """Position of every token inside its own document: RoPE restarts at 0 at each document start,
    so a document's representation does not depend on where the packer happened to put it."""
    lens = cu.diff().long()
    return torch.arange(total, device=cu.device) - torch.repeat_interleave(cu[:-1].long(), lens, output_size=total)


def apply_rope(x, cos, sin):  # x (T, H, D); rotate the two halves of the head dim (Llama's layout)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def attend(q, k, v, b: Batch, cfg: Config):
    """Causal attention within each document of the packed batch; q (T, H, D), k/v (T, Hk, D)."""
    if cfg.attn == "sdpa":  # independent reference: one plain causal SDPA per document
        rep = q.shape[1] // k.shape[1]
        out, a = [], 0
        for n in b.lens:  # a Python loop over documents: correct and simple, not fast
            qd, kd, vd = (x[a:a + n].transpose(0, 1) for x in (q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)))
            out.append(F.scaled_dot_product_attention(qd, kd.to(qd.dtype), vd.to(qd.dtype), is_causal=True).transpose(0, 1))
            a += n
        return torch.cat(out)
    # FLAMIA wants bf16/fp16 inputs: on the CPU the model computes in fp32, so cast here. Q is
    # scaled per token; K/V per token (block_tokens=1) unless the leak demo asks for 32-token blocks
    # without the safeguard. check_finite=False: the check costs a host sync per layer, and a
    # diverged run shows up in the loss anyway.
    leaky = cfg.unsafe_leaky_attention
    return flamia.flamia_attn_varlen_func(
        q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), b.cu, b.cu, b.max_len, b.max_len,
        causal=True, recipe=cfg.attn, plan=b.plan, check_finite=False, safeguard=not leaky,
        block_tokens=32 if leaky else flamia.DEFAULT_BLOCK_TOKENS)


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg, H, Hk, D = cfg, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.attn_norm, self.mlp_norm = nn.RMSNorm(cfg.d_model, eps=1e-5), nn.RMSNorm(cfg.d_model, eps=1e-5)
        self.wq, self.wk, self.wv = (nn.Linear(cfg.d_model, h * D, bias=False) for h in (H, Hk, Hk))
        self.wo = nn.Linear(H * D, cfg.d_model, bias=False)
        self.w1, self.w3 = (nn.Linear(cfg.d_model, cfg.ffn_dim, bias=False) for _ in range(2))  # gate, up
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=False)

    def forward(self, x, cos, sin, b: Batch):
        T, c = x.shape[0], self.cfg
        h = self.attn_norm(x)
        q = apply_rope(self.wq(h).view(T, c.n_heads, c.head_dim), cos, sin)
        k = apply_rope(self.wk(h).view(T, c.n_kv_heads, c.head_dim), cos, sin)
        v = self.wv(h).view(T, c.n_kv_heads, c.head_dim)
        x = x + self.wo(attend(q, k, v, b, c).reshape(T, -1).to(q.dtype))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))  # SwiGLU


class Llama(nn.Module):
    """Tied embeddings by default: with byte tokens the embedding is tiny either way, but with a
    50k GPT-2 vocabulary an untied head would be as large as the whole 25M-parameter trunk."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = nn.RMSNorm(cfg.d_model, eps=1e-5)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        ang = torch.outer(torch.arange(cfg.max_doc_len).float(), inv)  # positions never exceed max_doc_len
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:  # GPT-2 init; residual projections scaled down by depth
                std = 0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def hidden(self, b: Batch):
        pos = positions_from_cu(b.cu, b.tokens.shape[0])
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        x = self.embed(b.tokens)
        for blk in self.blocks:
            x = blk(x, cos, sin, b)
        return self.norm(x)

    def forward(self, b: Batch):  # mean next-token loss over the batch's targets
        return F.cross_entropy(self.head(self.hidden(b)).float(), b.targets, ignore_index=-100)


def train_flops(cfg: Config, n_matmul: int, b: Batch) -> float:
    """Model FLOPs of one training step: 6 N per real token, plus causal attention per document:
    QK^T and PV are 2 * 2 * H * D FLOPs per visible (query, key) pair, L (L + 1) / 2 pairs for a
    document of length L, x3 for forward + backward. Sum of L^2 terms, not (sum L)^2: packing saves it."""
    pairs, seen = 0, 0
    for L in b.lens:  # real documents come first; padding documents are not work
        pairs, seen = pairs + (L * (L + 1) / 2 if seen < b.n_real else 0), seen + L
    return 6 * n_matmul * b.n_real + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * pairs


# ---------------------------------------------------------------------------------------------
# Leak probe (MatX's method). Teacher forcing scores every position of a document in ONE pass. The
# autoregressive score of position p runs the model on the prefix [0, p] ALONE, as its own packed
# document, and reads the prediction at its last token: nothing after p exists in that call, so
# it is causal by construction, whatever the attention does. If teacher forcing is lower, the
# attention let the future in (e.g. a K/V scale shared with later tokens). Many prefixes go into
# one packed call as separate documents, which is exactly what varlen attention is for.
# ---------------------------------------------------------------------------------------------
def packed(seqs, budget, max_len, device):
    """Greedy: consecutive token sequences -> packed batches (each sequence its own document)."""
    i = 0
    while i < len(seqs):
        j, used = i, 0
        while j < len(seqs) and used + len(seqs[j]) <= budget:
            used, j = used + len(seqs[j]), j + 1
        ends = np.cumsum([len(s) for s in seqs[i:j]])
        yield i, j, to_device(make_batch(Corpus(np.concatenate(seqs[i:j]), np.r_[0, ends[:-1]], ends), range(j - i),
                                         budget, max_len), device)
        i = j


@torch.no_grad()
def leak_probe(model, cfg, val: Corpus, device, ctx):
    """-> (teacher-forced loss, autoregressive loss) in nats/token, over the same (position, target) pairs."""
    L, budget = min(cfg.leak_len, cfg.max_doc_len), cfg.tokens_per_batch
    docs = [np.asarray(val.tokens[a:min(b, a + L)], np.int64) for a, b in zip(val.starts, val.ends) if b - a >= 2]
    docs = docs[:cfg.leak_docs]
    n, tf, ar = sum(len(d) - 1 for d in docs), 0.0, 0.0
    for _, _, b in packed(docs, budget, L, device):  # teacher forced: whole documents, one pass
        with ctx:
            tf += model(b).item() * (b.targets != -100).sum().item()
    prefixes = [d[:p + 1] for d in docs for p in range(len(d) - 1)]  # predicts d[p + 1] from d[:p + 1] alone
    targets = torch.tensor([d[p + 1] for d in docs for p in range(len(d) - 1)], device=device)
    for i, j, b in packed(prefixes, budget, L, device):
        with ctx:  # the prediction of each prefix is the logit row of its last token
            logits = model.head(model.hidden(b)[b.cu[1:j - i + 1].long() - 1]).float()
        ar += F.cross_entropy(logits, targets[i:j], reduction="sum").item()
    return tf / n, ar / n


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
def kernels_run(device) -> bool:  # mirrors flamia's own test: on a CPU the oracle computes attention
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def to_device(b: Batch, device) -> Batch:
    b = b.to(device)
    # ONE plan per batch (one host sync), shared by the forward and backward of every layer.
    # On a CPU the oracle needs no plan, so we don't pay for one.
    if kernels_run(device):
        b.plan = flamia.flamia_plan(b.cu)
    return b


def lr_at(cfg: Config, step: int) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(model, batches, ctx, world, device):
    tot = torch.zeros(2, dtype=torch.float64, device=device)
    for b in batches:  # sum of token losses and token count, so ranks with more tokens weigh more
        with ctx:
            n = (b.targets != -100).sum()
            tot += torch.stack([model(b).double() * n, n.double()])
    if world > 1:
        dist.all_reduce(tot)
    return (tot[0] / tot[1].clamp(min=1)).item()


def train(cfg: Config) -> dict:
    """Train (single process or one torchrun rank); returns the run's history and final val loss."""
    validate(cfg)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    cuda = torch.cuda.is_available()
    if world > 1 and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    master = rank == 0
    log = (lambda *a: tqdm.write(" ".join(map(str, a)))) if master else (lambda *a: None)
    log(f"torch {torch.__version__}, triton {triton.__version__}, flamia recipes {flamia.RECIPES}; device: "
        + (torch.cuda.get_device_name(device) if cuda else "no GPU -- running on the CPU (tiny config; attention "
           "through flamia's PyTorch oracle, the same function the kernels compute)")
        + (f"; {world} ranks" if world > 1 else ""))
    if not cuda and kernels_run(device):
        log("note: TRITON_INTERPRET=1 -- the kernels run in Triton's interpreter (exact, but ~100x slower)")
    if cfg.unsafe_leaky_attention:
        log("!" * 100 + "\n!!! WARNING: --unsafe_leaky_attention: mxfp8 with 32-token K/V scale blocks and NO causal "
            "safeguard.\n!!! Attention LEAKS FUTURE TOKENS through shared scales. For the leak demo only.\n" + "!" * 100)

    train_set, val_set, cfg.vocab_size = load_documents(cfg)
    if len(train_set) < world or len(val_set) < 1:
        die(f"too few documents ({len(train_set)} train, {len(val_set)} val) for {world} ranks")
    packer = Packer(train_set, cfg.tokens_per_batch, cfg.max_doc_len, rank, world, cfg.seed)
    val_packer = Packer(val_set, cfg.tokens_per_batch, cfg.max_doc_len, rank, world, cfg.seed, loop=False)
    val_batches = [b for b in (val_packer.next_batch() for _ in range(cfg.eval_batches)) if b is not None]
    val_batches = [to_device(b, device) for b in val_batches]
    log(f"data: {len(train_set)} train / {len(val_set)} val documents (pieces of <= {cfg.max_doc_len} tokens), "
        f"{int((train_set.ends - train_set.starts).sum()):,} train tokens, vocab {cfg.vocab_size}")

    torch.manual_seed(cfg.seed)  # same init on every rank (DDP also broadcasts rank 0's weights)
    model = Llama(cfg).to(device)
    n_matmul = sum(p.numel() for p in model.parameters() if p.dim() == 2)  # 6 FLOPs/token each (tied head once)
    log(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters, attention {cfg.attn}, "
        f"global batch {cfg.tokens_per_batch * world:,} tokens")
    # Weight decay on matmul weights only: decaying norm gains pulls them toward 0, not toward "simple".
    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=cuda)

    os.makedirs(cfg.out_dir, exist_ok=True)
    ckpt_path, csv_path = os.path.join(cfg.out_dir, "ckpt.pt"), os.path.join(cfg.out_dir, "log.csv")
    step, rows = 0, []
    if cfg.resume:
        if not os.path.isfile(ckpt_path):
            die(f"--resume: no checkpoint at {ckpt_path}")
        ck = torch.load(ckpt_path, map_location=device, weights_only=False)
        bad = [f for f in MODEL_FIELDS if ck["config"][f] != getattr(cfg, f)]
        if bad or len(ck["packers"]) != world:
            die(f"--resume: checkpoint differs in {bad or 'world size'}; use the same model flags and world size")
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        packer.load_state_dict(ck["packers"][rank])
        torch.set_rng_state(ck["rng"]["cpu"])
        if cuda and ck["rng"]["cuda"] is not None:
            torch.cuda.set_rng_state(ck["rng"]["cuda"])
        step = ck["step"]
        if os.path.isfile(csv_path):  # keep only rows up to the checkpoint: later ones are redone
            with open(csv_path) as fh:
                rows = [r for r in csv.DictReader(fh) if int(r["step"]) <= step]
        log(f"resumed from {ckpt_path} at step {step}")
    raw = model
    if cfg.compile:
        model = torch.compile(model)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if cuda else None)
    # bf16 autocast on the GPU (weights and optimizer stay fp32); fp32 on the CPU, where bf16 is slow
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()

    def save(step):
        packers = [None] * world
        if world > 1:
            dist.all_gather_object(packers, packer.state_dict())  # every rank's data position
        else:
            packers = [packer.state_dict()]
        if master:
            ck = {"model": raw.state_dict(), "optimizer": opt.state_dict(), "step": step, "packers": packers,
                  "config": asdict(cfg), "rng": {"cpu": torch.get_rng_state(),
                                                 "cuda": torch.cuda.get_rng_state() if cuda else None}}
            torch.save(ck, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)  # atomic: a crash mid-save keeps the old one

    history = {"train_loss": [], "val_loss": [], "final_val": None}
    stop = min(cfg.stop_at or cfg.max_steps, cfg.max_steps)
    bar = tqdm(total=stop, initial=step, disable=not master, desc="train", dynamic_ncols=True)
    val = None
    while step < stop:
        t0 = time.time()
        lr = lr_at(cfg, step)
        for g in opt.param_groups:
            g["lr"] = lr
        b = to_device(packer.next_batch(), device)
        with ctx:
            loss = model(b)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        stats = torch.stack([loss.detach().float(), torch.tensor(float(b.n_real), device=device)])
        if world > 1:  # report the mean loss over ranks and the tokens of all ranks
            dist.all_reduce(stats)
            stats[0] /= world
        loss_v, n_tok = stats.tolist()  # also a sync, so dt below is real time
        dt = time.time() - t0
        step += 1
        tok_s = n_tok / dt
        history["train_loss"].append((step, loss_v))
        mfu = train_flops(cfg, n_matmul, b) / dt / (cfg.peak_tflops * 1e12) if cfg.peak_tflops else 0  # per GPU
        bar.set_postfix_str(f"loss {loss_v:.3f} | {tok_s / 1e3:.1f}k tok/s" + (f" | MFU {mfu:.1%}" if mfu else ""))
        bar.update(1)
        val = evaluate(raw, val_batches, ctx, world, device) if step % cfg.eval_interval == 0 or step == stop else None
        if val is not None:
            history["val_loss"].append((step, val))
            log(f"step {step}: train loss {loss_v:.4f}, val loss {val:.4f}")
        if step % cfg.log_interval == 0 or val is not None:
            rows.append({"step": step, "train_loss": f"{loss_v:.6f}", "val_loss": "" if val is None else f"{val:.6f}",
                         "lr": f"{lr:.6g}", "tokens_per_s": f"{tok_s:.1f}"})
        if step % cfg.ckpt_interval == 0 or step == stop:
            save(step)
    bar.close()
    if step == stop and val is None:  # e.g. --resume at the last step: still report a val loss
        val = evaluate(raw, val_batches, ctx, world, device)
        history["val_loss"].append((step, val))
    history["final_val"] = val
    if master:
        with open(csv_path, "w", newline="") as fh:
            w = csv.DictWriter(fh, ["step", "train_loss", "val_loss", "lr", "tokens_per_s"])
            w.writeheader()
            w.writerows(rows)
        plot(rows, os.path.join(cfg.out_dir, "loss.png"), cfg)
        log(f"done: step {step}, final val loss {val:.4f}; wrote {ckpt_path}, {csv_path}, loss.png")
    if cfg.eval_leak:
        if master:  # rank 0 alone, on the unwrapped model: the probe is a fixed, small job
            tf, ar = leak_probe(raw, cfg, val_set, device, ctx)
            history["leak"] = (tf, ar)
            log(f"leak probe ({cfg.attn}{', UNSAFE leaky' if cfg.unsafe_leaky_attention else ''}): teacher-forced "
                f"val loss {tf:.4f}, autoregressive {ar:.4f}, gap (AR - TF) {ar - tf:+.4f} "
                "(~0 for causal attention; > 0 means the future leaked into teacher forcing)")
        if world > 1:
            dist.barrier()
    return history


def plot(rows, path, cfg):
    import matplotlib
    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([int(r["step"]) for r in rows], [float(r["train_loss"]) for r in rows], label="train")
    v = [r for r in rows if r["val_loss"]]
    ax.plot([int(r["step"]) for r in v], [float(r["val_loss"]) for r in v], "o-", label="val")
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=f"Llama {cfg.d_model}x{cfg.n_layers}, attn={cfg.attn}")
    ax.legend()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)


def main(argv=None):
    cfg = parse_config(argv)
    try:
        train(cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
