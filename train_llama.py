"""
train_llama.py -- pretrain a small Llama on packed documents with FLAMIA attention, nanoGPT-style (README: "Train a
Llama"). Attention, RoPE positions and next-token targets never cross a document.

    python train_llama.py                              # 1 GPU: 25M-param Llama, 2,000 steps, ~2 minutes on an H200
    python train_llama.py                              # no GPU: tiny config (CPU_DEFAULTS), 600 steps
    python train_llama.py --help                       # every option: what it does, its GPU and CPU default
    python train_llama.py --attn bf16 --max_steps 200  # every Config field is a flag
    torchrun --nproc_per_node=2 train_llama.py         # DDP (nccl on GPUs, gloo on CPUs)
    python train_llama.py --data PATH                  # a real corpus (below)
    python train_llama.py --resume                     # continue out_train/ckpt.pt exactly
    python train_llama.py --resume --eval_leak         # leak probe of the trained checkpoint
    python train_llama.py --unsafe_leaky_attention --eval_leak   # the leak demo (mxfp8, no safeguard)

--data PATH (default: the standard library's *.py files, site-packages excluded, bytes as tokens) can be
  * a directory: every *.txt *.md *.rst *.py below it (recursive, sorted), one file = one document;
  * a text file: documents separated by two (or more) consecutive blank lines;
  * nanoGPT's train.bin / val.bin or one .bin file: uint16 token ids, --doc_sep_token ENDS a document (kept: the model
    learns to end documents); needs --vocab_size, e.g. 50304 ("HuggingFaceFW/fineweb-edu" via nanoGPT's prepare.py).
"""
import argparse
import csv
import functools
import inspect
import math
import os
import re
import sys
import textwrap
import time
from dataclasses import asdict, dataclass, fields, replace

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
    data: str = ""  # corpus: a directory of text files, a text file, or train.bin/val.bin ("" = the stdlib's *.py)
    vocab_size: int = 0  # 0 = 256 (byte tokens); required for .bin token ids (e.g. 50304 for GPT-2)
    doc_sep_token: int = 50256  # .bin only: the token that ends every document
    val_every: int = 20  # every N-th document is held out for validation (unless a val.bin exists)
    d_model: int = 512  # residual width
    n_layers: int = 8  # transformer blocks
    n_heads: int = 8  # query heads
    n_kv_heads: int = 4  # key/value heads (GQA: n_heads / n_kv_heads query heads share one)
    head_dim: int = 64  # FLAMIA's kernels take 64 or 128
    ffn_dim: int = 1536  # SwiGLU hidden width (~8/3 d_model, rounded up)
    tie_embeddings: bool = True  # share the input embedding and the output head (why: class Llama)
    rope_theta: float = 10000.0  # RoPE base
    attn: str = "mxfp8"  # a FLAMIA recipe; sdpa (plain SDPA per document: the reference); bf16:LETTERS (below)
    unsafe_leaky_attention: bool = False  # mxfp8 WITHOUT the causal safeguard: leaks the future (demo: out_train_leaky)
    rotate_qk: bool = False  # Hadamard-rotate Q and K before quantizing (flamia rotate_qk; same logits)
    eval_attn: str = ""  # diagnostic: after training, val loss again with each of these attentions (bf16,mxfp8,bf16:qk)
    block_tokens: int = flamia.DEFAULT_BLOCK_TOKENS  # tokens per K/V scale block (1: the fastest fwd+bwd measured)
    tokens_per_batch: int = 32768  # token budget per rank and step; global batch = this x world size
    max_doc_len: int = 2048  # context window: longer documents are cut into pieces this long
    lr: float = 2e-3  # peak learning rate
    min_lr: float = 2e-4  # end of the cosine decay
    warmup_steps: int = 100  # linear warmup
    max_steps: int = 2000  # training steps; the cosine schedule ends here
    weight_decay: float = 0.1  # AdamW, 2-D weights only
    beta1: float = 0.9  # AdamW momentum
    beta2: float = 0.95  # AdamW second moment (0.95: steadier than 0.999 at this batch size)
    grad_clip: float = 1.0  # max global grad norm (0 = off)
    seed: int = 1337  # model init and data order
    out_dir: str = "out_train"  # checkpoint, CSV log, loss plot
    resume: bool = False  # continue from out_dir/ckpt.pt: model, optimizer, step, data position, RNG
    stop_at: int = 0  # stop (and checkpoint) after this step, schedule unchanged (0 = max_steps)
    eval_interval: int = 250  # validate every N steps and at the end
    eval_batches: int = 16  # validation batches per rank (the same ones every time)
    log_interval: int = 10  # CSV row (loss, tokens/s over the interval) every N steps: the loop reads the GPU then
    ckpt_interval: int = 500  # checkpoint every N steps and at the end
    compile: bool = False  # torch.compile the model
    peak_tflops: float = 989.0  # MFU denominator per GPU in TFLOP/s: 989 = H200 dense bf16 (0 = no MFU)
    eval_leak: bool = False  # after training: teacher-forced vs autoregressive val loss (the leak probe)
    leak_docs: int = 8  # leak probe: validation documents
    leak_len: int = 256  # leak probe: tokens per document


# Without a GPU: small enough for a few minutes on 2 cores, big enough to show learning.
CPU_DEFAULTS = dict(d_model=128, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=384, tokens_per_batch=1024,
                    max_doc_len=256, lr=3e-3, min_lr=3e-4, warmup_steps=30, max_steps=600, eval_interval=100,
                    eval_batches=8, ckpt_interval=100, peak_tflops=0.0, leak_docs=4, leak_len=128)
MODEL_FIELDS = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "max_doc_len")
TEXT_EXTS = (".txt", ".md", ".rst", ".py")


def die(msg):  # bad input: one clear line on stderr and exit code 2 (argparse's convention), no traceback
    print(f"train_llama.py: error: {msg}", file=sys.stderr)
    sys.exit(2)


def parse_config(argv=None) -> Config:
    """A flag per Config field, its comment the --help line; unset flags (None) take the GPU or CPU defaults."""
    gpu, cpu, show = Config(), Config(**CPU_DEFAULTS), lambda x: '""' if x == "" else str(x)
    no_gpu = textwrap.fill(" ".join(f"--{k}\0{show(v)}" for k, v in CPU_DEFAULTS.items()), 96,  # \0: keep pairs
                           initial_indent="  ", subsequent_indent="  ").replace("\0", " ")
    outputs = ", ".join(os.path.join(gpu.out_dir, f) for f in ("ckpt.pt", "log.csv", "loss.png"))
    formatter = lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=40)
    p = argparse.ArgumentParser(
        usage="%(prog)s [-h] [--OPTION VALUE ...]", formatter_class=formatter,
        description="Pretrain a small Llama on packed documents with FLAMIA attention (examples: the module "
        "docstring).\nEvery option has a default; 'no GPU:' marks the tiny config used without CUDA.",
        epilog=f"without a CUDA GPU these defaults change (a tiny config for a CPU):\n{no_gpu}\n"
        f"boolean options: --compile, --compile 1, --compile false\noutputs (in --out_dir): {outputs}")
    p.error = die  # argparse would print the usage too; keep die()'s one-line contract
    try:  # the comments of class Config are the --help text (one source)
        helps = dict(re.findall(r"^ +(\w+): [^=]+=.*?  # (.*)$", inspect.getsource(Config), re.M))
    except (OSError, TypeError):  # no source file (e.g. a frozen build): flags without descriptions
        helps = {}
    metavars = {"attn": "{" + ",".join(flamia.RECIPES + ("sdpa",)) + "}", "data": "PATH", "out_dir": "DIR",
                "block_tokens": "{" + ",".join(map(str, flamia.BLOCK_TOKENS)) + "}", int: "N", float: "X", str: "S"}
    boolean = dict(nargs="?", const=True, type=lambda s: s.lower() in ("1", "true", "yes"), metavar="BOOL")
    for f in fields(Config):  # no argparse choices: validate() reports a bad --attn in its own words
        a, b = getattr(gpu, f.name), getattr(cpu, f.name)
        default = f"default {show(a)}" + (f"; no GPU: {show(b)}" if b != a else "")
        kw = boolean if f.type is bool else dict(type=f.type, metavar=metavars.get(f.name, metavars[f.type]))
        p.add_argument(f"--{f.name}", help=(helps.get(f.name, "") + f" ({default})").strip().replace("%", "%%"), **kw)
    cfg = Config(**({} if torch.cuda.is_available() else CPU_DEFAULTS))
    return replace(cfg, **{k: v for k, v in vars(p.parse_args(argv)).items() if v is not None})


def validate(cfg: Config):
    attns = flamia.RECIPES + ("sdpa",)
    # An attention is a recipe, or bf16:LETTERS: FLAMIA's bf16 kernels on those of q, k, v rounded to
    # per-token MXFP8 (P in bf16): which operand's rounding costs the loss (bf16:qkv is mxfp8 minus P's).
    bad = lambda attn, letters: attn not in attns or (letters and (attn != "bf16" or set(letters) - set("qkv")
                                                                  or cfg.block_tokens != 1))
    spec = f"choose one of {', '.join(attns)}, or bf16:LETTERS of 'qkv' (with --block_tokens 1)"
    if bad(*cfg.attn.partition(":")[::2]):
        die(f"--attn {cfg.attn!r}: {spec}")
    for item in filter(None, cfg.eval_attn.split(",")):
        if bad(*item.partition(":")[::2]) or cfg.compile:
            die(f"--eval_attn {item!r}: {spec}; not with --compile")
    if cfg.unsafe_leaky_attention and cfg.attn != "mxfp8":
        die("--unsafe_leaky_attention needs --attn mxfp8 (it switches mxfp8's causal safeguard off)")
    if cfg.block_tokens not in flamia.BLOCK_TOKENS:
        die(f"--block_tokens {cfg.block_tokens}: choose one of {', '.join(map(str, flamia.BLOCK_TOKENS))}")
    if min(cfg.tokens_per_batch, cfg.max_doc_len) < 2:
        die(f"--tokens_per_batch {cfg.tokens_per_batch} / --max_doc_len {cfg.max_doc_len}: "
            "need at least 2 tokens (one input and its next-token target)")
    if cfg.attn != "sdpa" and cfg.head_dim not in flamia.HEAD_DIMS:
        die(f"--head_dim {cfg.head_dim}: FLAMIA supports {flamia.HEAD_DIMS}")
    if cfg.head_dim % 2 or cfg.n_kv_heads < 1 or cfg.n_heads % cfg.n_kv_heads:
        die(f"need an even head_dim and n_heads ({cfg.n_heads}) a multiple of n_kv_heads ({cfg.n_kv_heads})")
    if min(cfg.max_steps, cfg.eval_interval, cfg.eval_batches, cfg.log_interval, cfg.ckpt_interval, cfg.val_every) < 1:
        die("max_steps, eval_interval, eval_batches, log_interval, ckpt_interval and val_every must be >= 1")
    cfg.max_doc_len = min(cfg.max_doc_len, cfg.tokens_per_batch)  # a document must fit in a batch
    if cfg.unsafe_leaky_attention and cfg.out_dir == Config.out_dir:  # never overwrite a normal run's files
        cfg.out_dir = Config.out_dir + "_leaky"


# ---------------------------------------------------------------------------------------------
# Data. A corpus is ONE flat token array plus [start, end) offsets: a 10B-token memmap costs two int64 arrays.
# ---------------------------------------------------------------------------------------------
class Corpus:
    def __init__(self, tokens, starts, ends):
        self.tokens, self.starts, self.ends = tokens, np.asarray(starts, np.int64), np.asarray(ends, np.int64)

    def __len__(self):
        return len(self.starts)

    def cut(self, max_len):
        """Each document longer than max_len becomes pieces of max_len (the last one shorter)."""
        n = -(-(self.ends - self.starts) // max_len)  # pieces per document
        starts = np.repeat(self.starts, n) + (np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)) * max_len
        return Corpus(self.tokens, starts, np.minimum(starts + max_len, np.repeat(self.ends, n)))


def _bytes_corpus(blobs):
    blobs = [b for b in blobs if b.strip()]  # skip empty documents (e.g. empty __init__.py)
    ends = np.cumsum([len(b) for b in blobs], dtype=np.int64)
    return Corpus(np.frombuffer(b"".join(blobs), np.uint8), ends - [len(b) for b in blobs], ends)


def _bin_corpus(path, sep, vocab_size):
    tok = np.memmap(path, dtype=np.uint16, mode="r")
    step, ends = 1 << 26, []  # scan in chunks: `tok == sep` over 10B tokens at once would need 10 GB
    for i in range(0, len(tok), step):
        chunk = tok[i:i + step]
        if (top := int(chunk.max())) >= vocab_size:  # the embedding would fail with an IndexError
            die(f"--data {path}: token id {top} at position {i + int(np.argmax(chunk >= vocab_size))} is >= "
                f"--vocab_size {vocab_size} (a .bin holds raw uint16 token ids: pass the tokenizer's vocab size)")
        ends.append(np.flatnonzero(chunk == sep) + i + 1)
    ends = np.concatenate(ends + [np.array([len(tok)], np.int64)])
    ends = np.unique(ends[ends > 0])  # the tail after the last separator is a document too
    return Corpus(tok, np.r_[0, ends[:-1]], ends)


def load_documents(cfg: Config):
    """-> (train Corpus, val Corpus, vocab_size), documents cut to at most cfg.max_doc_len tokens."""
    path, val, vocab = cfg.data or os.path.dirname(os.__file__), None, max(cfg.vocab_size, 256)
    if not os.path.exists(path):
        die(f"--data {path}: no such file or directory")
    binfile = os.path.join(path, "train.bin") if os.path.isdir(path) else path
    if binfile.endswith(".bin") and os.path.isfile(binfile):
        if cfg.vocab_size <= cfg.doc_sep_token:
            die(f"--data {path} holds token ids: pass --vocab_size (> --doc_sep_token {cfg.doc_sep_token}), "
                "e.g. 50304 for GPT-2 tokens")
        train, vocab = _bin_corpus(binfile, cfg.doc_sep_token, cfg.vocab_size), cfg.vocab_size
        if os.path.isfile(vfile := os.path.join(os.path.dirname(binfile), "val.bin")):
            val = _bin_corpus(vfile, cfg.doc_sep_token, cfg.vocab_size)
    elif os.path.isdir(path):
        files, skip = [], () if cfg.data else ("site-packages", "dist-packages")  # the stdlib only
        for root, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in skip)
            files += [os.path.join(root, n) for n in sorted(names) if n.endswith(TEXT_EXTS if cfg.data else ".py")]
        train = _bytes_corpus([open(f, "rb").read() for f in files])
    else:  # a text file; a binary one (NUL bytes, which text never holds) is refused
        if b"\0" in (text := open(path, "rb").read()):
            die(f"--data {path}: not a text file (it holds NUL bytes); for token ids give a .bin file "
                "(raw uint16, as nanoGPT's prepare.py writes) or a directory holding train.bin")
        train = _bytes_corpus(re.split(rb"\n(?:[ \t]*\n){2,}", text))
    if len(train) == 0:
        die(f"--data {path}: no documents found (empty, or no {'/'.join(TEXT_EXTS)} files)")
    if val is None:  # hold out whole documents BEFORE cutting, so no file is in both splits
        if len(train) < 2:
            die(f"--data {path}: need at least 2 documents (one to train on, one to validate)")
        is_val = np.arange(len(train)) % cfg.val_every == 0
        train, val = (Corpus(train.tokens, train.starts[m], train.ends[m]) for m in (~is_val, is_val))
    return train.cut(cfg.max_doc_len), val.cut(cfg.max_doc_len), vocab


class Batch:
    """One packed batch. A plain class (not a dataclass) so DDP passes it through untouched."""

    def __init__(self, tokens, targets, cu, lens, n_real):
        self.tokens, self.targets, self.cu, self.lens, self.n_real = tokens, targets, cu, lens, n_real
        self.max_len, self.plan = max(lens), None  # lens is a host list: max_len and FLOPs need no sync


def make_batch(corpus: Corpus, doc_ids, budget: int, max_len: int) -> Batch:
    """Concatenate whole documents and pad to exactly `budget` tokens (stable shapes for torch.compile and memory).
    Padding is short documents of its own: nothing attends to it, no targets, O(128^2) attention per piece."""
    parts = [np.asarray(corpus.tokens[corpus.starts[d]:corpus.ends[d]], np.int64) for d in doc_ids]
    lens, n_real, piece = [len(p) for p in parts], sum(len(p) for p in parts), min(128, max_len)
    lens += [piece] * ((budget - n_real) // piece) + [(budget - n_real) % piece] * ((budget - n_real) % piece > 0)
    tokens = torch.from_numpy(np.concatenate(parts + [np.zeros(budget - n_real, np.int64)]))
    cu = torch.tensor(np.cumsum([0] + lens), dtype=torch.int32)
    # Next-token targets INSIDE a document: none for its last token (next comes another document) nor for padding
    targets = torch.roll(tokens, -1)
    targets[cu[1:].long() - 1] = -100
    targets[n_real:] = -100
    return Batch(tokens, targets, cu, lens, n_real)


class Packer:
    """Deals this rank's documents (document i to rank i % world: never split or shared) into fixed-budget batches,
    reshuffled every epoch from (seed, rank, epoch); first-fit over a lookahead of documents keeps padding low without
    sorting the corpus. (epoch, cursor, pending) is the whole data position: a checkpoint saves it."""

    def __init__(self, corpus, budget, max_len, rank=0, world=1, seed=0, loop=True, lookahead=64):
        self.corpus, self.budget, self.max_len, self.loop = corpus, budget, max_len, loop
        self.seed, self.rank, self.mine = seed, rank, np.arange(rank, len(corpus), world)
        self.lens, self.lookahead = corpus.ends - corpus.starts, min(lookahead, len(self.mine))
        self.epoch, self.cursor, self.pending, self.order = 0, 0, [], None

    def state_dict(self):
        return {"epoch": self.epoch, "cursor": self.cursor, "pending": list(self.pending)}

    def load_state_dict(self, s):
        self.epoch, self.cursor, self.pending, self.order = s["epoch"], s["cursor"], list(s["pending"]), None

    def _next_doc(self):
        if self.cursor == len(self.mine):
            if not self.loop:
                return None
            self.epoch, self.cursor, self.order = self.epoch + 1, 0, None
        if self.order is None:
            perm = np.random.default_rng([self.seed, self.rank, self.epoch]).permutation(len(self.mine))
            self.order = self.mine[perm] if self.loop else self.mine  # validation: fixed order
        self.cursor += 1
        return int(self.order[self.cursor - 1])

    def next_batch(self):
        """The next packed batch, or None when a non-looping packer is exhausted."""
        take, used = [], 0
        while used < self.budget:
            while len(self.pending) < self.lookahead and (d := self._next_doc()) is not None:
                self.pending.append(d)
            fit = next((i for i, d in enumerate(self.pending) if self.lens[d] <= self.budget - used), None)
            if fit is None:
                break
            take.append(self.pending.pop(fit))
            used += int(self.lens[take[-1]])
        return make_batch(self.corpus, take, self.budget, self.max_len) if take else None


# ---------------------------------------------------------------------------------------------
# Model: Llama (RMSNorm, RoPE, SwiGLU, GQA, no biases) on packed (total_tokens, ...) tensors: cu_seqlens, no batch dim.
# ---------------------------------------------------------------------------------------------
def positions_from_cu(cu: torch.Tensor, total: int) -> torch.Tensor:
    """Each token's position in its own document: RoPE restarts at 0 at every document, wherever it was packed."""
    return torch.arange(total, device=cu.device) - torch.repeat_interleave(cu[:-1].long(), cu.diff().long(),
                                                                           output_size=total)


def apply_rope(x, cos, sin):  # x (T, H, D): rotate the two halves of the head dim (Llama's layout)
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


def round_mxfp8(x, cu):
    """x's per-token MXFP8 values (exact in bf16), with the identity gradient (straight-through)."""
    deq = flamia.quantize_mxfp8_reference(x.detach(), cu, 1).dequantize(cu).to(x.dtype)
    return deq + (x - x.detach())


def attend(q, k, v, b: Batch, cfg: Config):
    """Causal attention inside each document of the batch: q (T, H, D), k and v (T, Hk, D)."""
    if cfg.attn == "sdpa":  # the independent reference: a plain causal SDPA per document
        k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1).to(q.dtype) for x in (k, v))
        docs = zip(*(x.split(b.lens) for x in (q, k, v)))  # a Python loop: correct and simple, not fast
        return torch.cat([F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in d), is_causal=True)
                          .transpose(0, 1) for d in docs])
    # FLAMIA takes bf16/fp16: on the CPU the model computes in fp32, so cast here. K/V scales are per
    # --block_tokens, except in the leak demo: 32-token blocks without the safeguard.
    leaky, (recipe, _, rounded) = cfg.unsafe_leaky_attention, cfg.attn.partition(":")
    q, k, v = (x.bfloat16() for x in (q, k, v))
    q, k, v = (round_mxfp8(x, b.cu) if name in rounded else x for name, x in zip("qkv", (q, k, v)))
    return flamia.flamia_attn_varlen_func(q, k, v, b.cu, b.cu, b.max_len, b.max_len, recipe=recipe, causal=True,
                                          plan=b.plan, safeguard=not leaky, rotate_qk=cfg.rotate_qk,
                                          block_tokens=32 if leaky else cfg.block_tokens)


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg, d, D, H, Hk, f = cfg, cfg.d_model, cfg.head_dim, cfg.n_heads, cfg.n_kv_heads, cfg.ffn_dim
        self.attn_norm, self.mlp_norm = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.wq, self.wk, self.wv = (nn.Linear(d, h * D, bias=False) for h in (H, Hk, Hk))
        self.wo = nn.Linear(H * D, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, f, bias=False), nn.Linear(d, f, bias=False)  # gate, up
        self.w2 = nn.Linear(f, d, bias=False)

    def forward(self, x, cos, sin, b: Batch):
        T, c, h = x.shape[0], self.cfg, self.attn_norm(x)
        q, k, v = (w(h).view(T, -1, c.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        x = x + self.wo(attend(q, k, v, b, c).reshape(T, -1).to(q.dtype))
        h = self.mlp_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))  # SwiGLU


class Llama(nn.Module):
    """Embeddings tied by default: with GPT-2's 50k vocabulary an untied head alone would match the 25M trunk."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg, self.embed = cfg, nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm, self.head = nn.RMSNorm(cfg.d_model, eps=1e-5), nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.head.weight = self.embed.weight
        inv = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        ang = torch.outer(torch.arange(cfg.max_doc_len).float(), inv)  # positions stay < max_doc_len
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        for name, p in self.named_parameters():  # GPT-2 init; residual projections scaled by depth
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layers) if name.endswith(("wo.weight", "w2.weight"))
                                else 0.02)

    def hidden(self, b: Batch):
        pos = positions_from_cu(b.cu, b.tokens.shape[0])
        cos, sin, x = self.cos[pos][:, None], self.sin[pos][:, None], self.embed(b.tokens)
        for blk in self.blocks:
            x = blk(x, cos, sin, b)
        return self.norm(x)

    def forward(self, b: Batch):  # mean next-token loss over the batch's targets
        return F.cross_entropy(self.head(self.hidden(b)).float(), b.targets, ignore_index=-100)


def train_flops(cfg: Config, n_matmul: int, b: Batch) -> float:
    """Model FLOPs of one step: 6 per matmul weight per real token, plus causal attention per document: QK^T and
    PV, 2 * 2 * H * D per visible (query, key) pair, x3 for fwd + bwd; L (L + 1) / 2 pairs per L-token document."""
    pairs = sum(L * (L + 1) / 2 for L, e in zip(b.lens, np.cumsum(b.lens)) if e <= b.n_real)  # padding: no work
    return 6 * n_matmul * b.n_real + 12 * cfg.n_layers * cfg.n_heads * cfg.head_dim * pairs


def to_device(b: Batch, device) -> Batch:
    # ONE plan per batch, shared by every layer, fwd and bwd; built from the host offsets (no GPU sync)
    plan = flamia.flamia_plan(b.cu, device=device) if flamia.kernels_available(device) else None
    b = Batch(*(t.to(device, non_blocking=True) for t in (b.tokens, b.targets, b.cu)), b.lens, b.n_real)
    if plan is not None:  # the plan's own device copy of the offsets: calls pass it, nothing to compare
        b.cu, b.plan = plan.cu_seqlens_q, plan
    return b


# ---------------------------------------------------------------------------------------------
# Leak probe (MatX's method). Teacher forcing scores all positions of a document in one pass; the autoregressive
# score of position p runs the model on the prefix [0, p] ALONE (causal by construction, whatever the attention
# does; many prefixes share a packed call as separate documents). Teacher forcing scoring better = a leak.
# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def leak_probe(model, cfg, val: Corpus, device, ctx):
    """-> (teacher-forced loss, autoregressive loss, max |logit difference|) over the same (position, target) pairs,
    in nats/token. Causal attention: a logit difference of ~0 (summation order); a leak: the future is seen."""
    L, budget = min(cfg.leak_len, cfg.max_doc_len), cfg.tokens_per_batch

    def packed(seqs):  # batches of these sequences, each its own document, in order (a one-document lookahead)
        ends = np.cumsum(lens := [len(s) for s in seqs])
        p = Packer(Corpus(np.concatenate(seqs), ends - lens, ends), budget, L, loop=False, lookahead=1)
        return (to_device(b, device) for b in iter(p.next_batch, None))

    docs = [np.asarray(val.tokens[a:min(b, a + L)], np.int64) for a, b in zip(val.starts, val.ends) if b - a >= 2]
    docs = docs[:cfg.leak_docs]
    targets = torch.tensor([d[p + 1] for d in docs for p in range(len(d) - 1)], device=device)
    prefixes = [d[:p + 1] for d in docs for p in range(len(d) - 1)]  # d[:p + 1] alone predicts d[p + 1]
    with ctx:  # teacher forced, whole documents: the rows with a target are the predictions of d[1], d[2], ...
        tf = torch.cat([model.head(model.hidden(b)[b.targets != -100]).float() for b in packed(docs)])
        # autoregressive: a prefix's prediction is the logit row of its last token (padding ends after n_real)
        ar = torch.cat([model.head(model.hidden(b)[b.cu[1:][b.cu[1:] <= b.n_real].long() - 1]).float()
                        for b in packed(prefixes)])
    return F.cross_entropy(tf, targets).item(), F.cross_entropy(ar, targets).item(), (tf - ar).abs().max().item()


def attention_audit(cfg, device) -> list:
    """flamia.audit_causality of this run's attention call: it plants outliers, so it shows a leak even where the
    model has not learnt to exploit it (the loss gap of leak_probe needs that). [] = no leak."""
    leaky = cfg.unsafe_leaky_attention
    attn = functools.partial(flamia.flamia_attn_varlen_func, recipe=cfg.attn.partition(":")[0], safeguard=not leaky,
                             block_tokens=32 if leaky else cfg.block_tokens, rotate_qk=cfg.rotate_qk)
    return flamia.audit_causality(attn, heads=cfg.n_heads, kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim,
                                  device=device)


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------
def lr_at(cfg: Config, step: int) -> float:  # linear warmup, then cosine decay to min_lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    t = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * t))


@torch.no_grad()
def evaluate(model, batches, ctx, world, device):
    tot = torch.zeros(2, dtype=torch.float64, device=device)  # (sum of token losses, tokens)
    for b in batches:
        with ctx:
            n = (b.targets != -100).sum()
            tot += torch.stack([model(b).double() * n, n.double()])
    if world > 1:
        dist.all_reduce(tot)
    return (tot[0] / tot[1].clamp(min=1)).item()


def setup(cfg: Config):
    """Joins torchrun's process group, if any; -> (rank, world, device, log: prints on rank 0 only)."""
    rank, world, cuda = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)), torch.cuda.is_available()
    if world > 1 and not dist.is_initialized():
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device(f"cuda:{torch.cuda.current_device()}" if cuda else "cpu")
    log = tqdm.write if rank == 0 else (lambda msg: None)
    log(f"torch {torch.__version__}, triton {triton.__version__}; " + (
        f"GPU: {torch.cuda.get_device_name(device)}" if cuda else "no GPU: running on the CPU (tiny config; "
        "attention through flamia's PyTorch oracle: the recipe's quantization, P unrounded)") + f"; {world} rank(s)")
    if not cuda and flamia.kernels_available(device):
        log("note: TRITON_INTERPRET=1, so flamia runs its kernels in Triton's interpreter (slow)")
    if cfg.unsafe_leaky_attention:
        log("!" * 96 + "\n!!! WARNING --unsafe_leaky_attention: mxfp8 with 32-token K/V scale blocks and NO causal "
            "safeguard.\n!!! Attention LEAKS FUTURE TOKENS through shared scales. Only for the leak demo.\n" + "!" * 96)
    return rank, world, device, log


def resume(path, csv_path, cfg, model, opt, packer, rank, world, device, log):
    """Model, optimizer, data position and RNG from the checkpoint; -> (its step, the log rows up to it: no later)."""
    if not os.path.isfile(path):
        die(f"--resume: no checkpoint at {path}")
    ck = torch.load(path, map_location=device, weights_only=False)
    if any(ck["config"][f] != getattr(cfg, f) for f in MODEL_FIELDS) or len(ck["packers"]) != world:
        die(f"--resume: {path} has another model shape or world size ({', '.join(MODEL_FIELDS)})")
    model.load_state_dict(ck["model"])
    opt.load_state_dict(ck["optimizer"])
    packer.load_state_dict(ck["packers"][rank])
    torch.set_rng_state(ck["rng"][0].cpu())  # nothing draws random numbers after init here; dropout would
    if device.type == "cuda" and ck["rng"][1] is not None:
        torch.cuda.set_rng_state(ck["rng"][1].cpu())
    log(f"resumed from {path} at step {ck['step']}")
    if not os.path.isfile(csv_path):
        return ck["step"], []
    with open(csv_path) as fh:
        return ck["step"], [r for r in csv.DictReader(fh) if int(r["step"]) <= ck["step"]]


def save(path, step, cfg, model, opt, packer, rank, world):
    packers = [packer.state_dict()] * world  # every rank's data position goes into rank 0's checkpoint
    if world > 1:
        dist.all_gather_object(packers, packer.state_dict())
    if rank == 0:
        rng = (torch.get_rng_state(), torch.cuda.get_rng_state() if torch.cuda.is_available() else None)
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "packers": packers,
                    "config": asdict(cfg), "rng": rng}, path + ".tmp")
        os.replace(path + ".tmp", path)  # atomic: a crash while saving keeps the old one


def write_log(path, rows):  # the whole CSV, rewritten at every validation: a killed run keeps its curve
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, ["step", "train_loss", "val_loss", "lr", "tokens_per_s"])
        w.writeheader()
        w.writerows(rows)


def train(cfg: Config) -> dict:
    """Train (one process, or one torchrun rank); -> {"train_loss", "val_loss", "final_val"[, "eval_attn", ...]}."""
    validate(cfg)
    rank, world, device, log = setup(cfg)
    train_set, val_set, cfg.vocab_size = load_documents(cfg)
    if len(train_set) < world:
        die(f"{len(train_set)} training documents cannot be dealt to {world} ranks")
    packer = Packer(train_set, cfg.tokens_per_batch, cfg.max_doc_len, rank, world, cfg.seed)
    val_packer = Packer(val_set, cfg.tokens_per_batch, cfg.max_doc_len, rank, world, loop=False)
    val_batches = [to_device(b, device) for b in (val_packer.next_batch() for _ in range(cfg.eval_batches)) if b]
    log(f"data: {len(train_set)} train / {len(val_set)} val documents of <= {cfg.max_doc_len} tokens, "
        f"{int((train_set.ends - train_set.starts).sum()):,} train tokens, vocab {cfg.vocab_size}")
    torch.manual_seed(cfg.seed)  # the same init on every rank (DDP broadcasts rank 0's anyway)
    raw = Llama(cfg).to(device)
    n_matmul = sum(p.numel() for p in raw.parameters() if p.dim() == 2)  # the tied head counts once
    log(f"model: {sum(p.numel() for p in raw.parameters()) / 1e6:.2f}M parameters, attention {cfg.attn}, "
        f"global batch {cfg.tokens_per_batch * world:,} tokens")
    # Weight decay on matmul weights only: decaying RMSNorm gains pulls them toward 0, not toward "simple".
    groups = [{"params": [p for p in raw.parameters() if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in raw.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")
    os.makedirs(cfg.out_dir, exist_ok=True)
    ckpt_path, csv_path = os.path.join(cfg.out_dir, "ckpt.pt"), os.path.join(cfg.out_dir, "log.csv")
    step, rows = resume(ckpt_path, csv_path, cfg, raw, opt, packer, rank, world, device, log) if cfg.resume else (0, [])
    model = torch.compile(raw) if cfg.compile else raw
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model, device_ids=None if device.index is None else [device.index])
    ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")  # GPU: bf16; weights fp32

    hist, val, stop = {"train_loss": [], "val_loss": []}, None, min(cfg.stop_at or cfg.max_steps, cfg.max_steps)
    bar = tqdm(range(step, stop), initial=step, total=stop, disable=rank != 0, desc="train", mininterval=1.0)
    # The GPU is read (a sync) only at log, validation and checkpoint steps, as in nanoGPT: in the other steps the host
    # packs the next batch, builds its plan and queues its kernels while the GPU still runs this one.
    losses, tokens, flops, t0 = [], 0, 0.0, time.time()  # since the last read (validation, checkpoints: untimed)
    for i in bar:
        lr = lr_at(cfg, i)
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
        losses.append(loss.detach().double())  # float64: the token count beside it stays exact
        tokens, flops, step = tokens + b.n_real, flops + train_flops(cfg, n_matmul, b), i + 1
        if not ((evaluating := step % cfg.eval_interval == 0 or step == stop) or step % cfg.log_interval == 0
                or step % cfg.ckpt_interval == 0):
            continue
        stats = torch.stack(losses + [torch.full((), float(tokens), dtype=torch.float64, device=device)])
        if world > 1:  # the mean loss over ranks and the tokens of all ranks
            dist.all_reduce(stats)
            stats[:-1] /= world
        (*loss_vs, n_tok), dt = stats.tolist(), time.time() - t0  # .tolist() syncs: dt is real
        hist["train_loss"] += zip(range(step - len(loss_vs) + 1, step + 1), loss_vs)
        loss_v, mfu = loss_vs[-1], flops / dt / (cfg.peak_tflops * 1e12) if cfg.peak_tflops else 0
        bar.set_postfix_str(f"loss {loss_v:.3f} | {n_tok / dt / 1e3:.1f}k tok/s" + (f" | MFU {mfu:.1%}" if mfu else ""))
        val = evaluate(raw, val_batches, ctx, world, device) if evaluating else None
        if step % cfg.log_interval == 0 or val is not None:
            rows.append({"step": step, "train_loss": f"{loss_v:.6f}", "val_loss": "" if val is None else f"{val:.6f}",
                         "lr": f"{lr:.6g}", "tokens_per_s": f"{n_tok / dt:.1f}"})
        if val is not None:
            hist["val_loss"].append((step, val))
            log(f"step {step}: train loss {loss_v:.4f}, val loss {val:.4f}")
            if rank == 0:
                write_log(csv_path, rows)
        if step % cfg.ckpt_interval == 0 or step == stop:
            save(ckpt_path, step, cfg, raw, opt, packer, rank, world)
        losses, tokens, flops, t0 = [], 0, 0.0, time.time()
    if val is None:  # no step ran (e.g. --resume of a finished run): still report a val loss
        val = evaluate(raw, val_batches, ctx, world, device)
        hist["val_loss"].append((step, val))
    hist["final_val"] = val
    if rank == 0:
        write_log(csv_path, rows)
        compare_plot([cfg.out_dir], png := os.path.join(cfg.out_dir, "loss.png"),
                     f"Llama d{cfg.d_model} x {cfg.n_layers}, attn {cfg.attn}")
        log(f"done: step {step}, val loss {val:.4f}; wrote {ckpt_path}, {csv_path}, {png}")
    report(hist, cfg, raw, val_set, val_batches, ctx, rank, world, device, log)
    return hist


def report(hist, cfg, model, val_set, val_batches, ctx, rank, world, device, log):
    """After training: --eval_attn and --eval_leak, into hist and the log."""
    if cfg.eval_attn:  # the same weights and val batches, another attention: its cost free of training noise
        hist["eval_attn"] = {}
        for item in filter(None, cfg.eval_attn.split(",")):  # as validate() reads the list
            for blk in model.blocks:
                blk.cfg = replace(cfg, attn=item)
            hist["eval_attn"][item] = evaluate(model, val_batches, ctx, world, device)
        for blk in model.blocks:
            blk.cfg = cfg
        log("val loss of the trained weights with other attentions: " +
            ", ".join(f"{k} {v:.4f} ({v / hist['final_val'] - 1:+.2%})" for k, v in hist["eval_attn"].items()))
    if cfg.eval_leak and rank == 0:  # rank 0 alone, on the unwrapped model: a small, fixed job
        unsafe = ", UNSAFE: no safeguard" if cfg.unsafe_leaky_attention else ""
        if cfg.attn != "sdpa":  # the verdict first: does this run's attention call leak?
            found = hist["audit"] = attention_audit(cfg, device)
            log(f"attention audit ({cfg.attn}{unsafe}; outliers planted in q, k, v): " + (
                f"LEAKS: {len(found)} probes changed earlier rows bitwise ({sum(f['kind'] == 'future' for f in found)} "
                f"into the future, {sum(f['kind'] == 'document' for f in found)} across documents)" if found
                else "causal: no probe changed an earlier row or another document"))
        tf, ar, diff = hist["leak"] = leak_probe(model, cfg, val_set, device, ctx)
        log(f"leak probe ({cfg.attn}{unsafe}; has the model LEARNT to use a leak?): teacher-forced val loss "
            f"{tf:.6f}, autoregressive {ar:.6f}, gap {ar - tf:+.2e}, max |logit difference| {diff:.2e}. A model "
            "that reads the future scores better teacher-forced (gap > 0); a short or CPU run has not learnt "
            "to, so ~0 (below ~1e-5: summation order) says nothing about the attention: the audit does")
    if world > 1:  # every rank finishes (rank 0's probe and files too) before any tears the group down:
        dist.barrier()  # a gloo rank leaving early can abort its peer


def compare_plot(out_dirs, path="train_compare.png", title=""):
    """Train (log scale) and validation loss curves from the log.csv of each run in out_dirs: one run (its
    loss.png) or several, e.g. one per --attn: python -c "import train_llama as t; t.compare_plot(['a', 'b'])" """
    from matplotlib.figure import Figure  # no pyplot: files only, no display or GUI backend
    tr, va = (fig := Figure(figsize=(11, 4))).subplots(1, 2)
    for d in out_dirs:
        with open(os.path.join(d, "log.csv")) as fh:
            rows = list(csv.DictReader(fh))
        line, = tr.plot([int(r["step"]) for r in rows], [float(r["train_loss"]) for r in rows], lw=0.8,
                        label=os.path.basename(os.path.normpath(d)))
        v = [r for r in rows if r["val_loss"]]
        va.plot([int(r["step"]) for r in v], [float(r["val_loss"]) for r in v], "o-", color=line.get_color(),
                label=line.get_label())
    tr.set(xlabel="step", ylabel="train loss (nats/token)", yscale="log")
    va.set(xlabel="step", ylabel="validation loss (nats/token)")
    va.legend()
    fig.suptitle(title)
    fig.savefig(path, dpi=100, bbox_inches="tight")


def main(argv=None):
    try:
        return train(parse_config(argv))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
