#!/usr/bin/python3
"""PyTorch peer of `dptrain launch RECIPE --json`: the recipe's GPT, with DDP (Gloo) on N CPU
ranks, or on one GPU.

Usage:
  /usr/bin/python3 bench/gpt_ddp_peer.py RECIPE --nproc N [--json]
  python3 bench/gpt_ddp_peer.py RECIPE --device cuda [--precision fp32|bf16] [--steps N]
      [--batch-per-rank N] [--compile] [--json]

It reads the same recipe and the same token dataset directory (/data/path, written by `dptrain
data prepare`) as dptrain, and builds the model of core/model/gpt.cpp layer for layer: token and
learned position embeddings, pre-LayerNorm blocks of causal multi-head attention (one fused qkv
Linear, an output Linear) and a GELU (tanh) MLP, a final LayerNorm and an LM head tied to the
token embedding; the same initialisation scale, AdamW with weight decay on 2-D weights and
embeddings only, the recipe's learning-rate schedule and gradient clipping. It answers with the
fields dptrain's launcher prints: samples_per_s, world_size, steps, final_loss (plus params,
tokens_per_s, step_ms, per-phase milliseconds, the device and versions).

--device cpu (the default): Gloo DDP, one compute thread per rank (/train/threads_per_rank),
fp32, attention as a masked softmax. The launcher mode spawns one process per rank itself
(torchrun does not work under Debian's Python 3.11) with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE
in the environment; with --worker the script is one rank and reads those variables, so it also
runs under an external launcher.

--device cuda: one process on one GPU, no process group (--nproc 1 only), what a PyTorch user
would write: attention with scaled_dot_product_attention(is_causal=True) (flash attention where
it applies), fused AdamW, fp32 master weights; /train/precision fp32 is IEEE fp32 (TF32 off in
cuBLAS and cuDNN, as dptrain's fp32), bf16 is torch.autocast(bfloat16) around the forward pass.
The token dataset is copied to the GPU and each step gathers random windows there. Steps are
timed between torch.cuda.synchronize() calls; the per-phase times are CUDA events. --compile
wraps the model in torch.compile (off by default). Needs a CUDA build of PyTorch 2.x.

--precision, --steps and --batch-per-rank replace the recipe's /train fields, as `dptrain bench
train` does (--steps also caps the schedule's warm-up at the steps, as it does).
"""

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import struct
import sys
import time

import benchlib
from benchlib import PeerError

NAME = "gpt_ddp_peer"

# Recipe defaults the peer relies on; they mirror core/recipe.hpp.
DEFAULTS = {
    "seed": 1,
    "model": {"type": "gpt", "vocab": 256, "context": 128, "layers": 4, "heads": 4,
              "width": 128, "mlp_ratio": 4, "dropout": 0.0},
    "data": {"type": "tokens", "path": ""},
    "train": {"steps": 500, "batch_per_rank": 64, "grad_accum": 1, "precision": "fp32",
              "threads_per_rank": 1},
    "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.0, "beta1": 0.9,
                  "beta2": 0.999, "eps": 1e-8,
                  "schedule": {"type": "cosine", "warmup": 0, "min_lr_ratio": 0.0},
                  "clip_grad_norm": 0.0},
    "distributed": {"sync": "allreduce", "compression": {"type": "none"}, "timeout_s": 300.0},
}

TOKEN_MAGIC = b"DPTOKENS"
TOKEN_HEADER_BYTES = 64


def supported(recipe):
    return [
        ("/model/type", recipe["model"]["type"], {"gpt"}),
        ("/model/dropout", recipe["model"]["dropout"], {0, 0.0}),
        ("/data/type", recipe["data"]["type"], {"tokens"}),
        ("/train/grad_accum", recipe["train"]["grad_accum"], {1}),
        # Which of these a device takes: PRECISIONS, after the command line's overrides.
        # fp16 too: --precision may replace it; PRECISIONS refuses what is left after that.
        ("/train/precision", recipe["train"]["precision"], {"fp32", "bf16", "fp16"}),
        ("/optimizer/type", recipe["optimizer"]["type"], {"adamw"}),
        ("/optimizer/schedule/type", recipe["optimizer"]["schedule"]["type"],
         {"constant", "cosine", "linear"}),
        ("/distributed/sync", recipe["distributed"]["sync"], {"allreduce"}),
        ("/distributed/compression/type", recipe["distributed"]["compression"]["type"], {"none"}),
    ]


# What each device computes in: the CPU peer in fp32 only (as dptrain on the CPU), the GPU in
# fp32 (IEEE) or bf16 autocast. fp16 (dptrain's dynamic loss scaling) is not mirrored.
PRECISIONS = {"cpu": ("fp32",), "cuda": ("fp32", "bf16")}


def load_recipe(path, args):
    """The recipe with DEFAULTS, checked, with the command line's /train overrides applied."""
    recipe = benchlib.load_peer_recipe(path, DEFAULTS, supported)
    train = recipe["train"]
    if args.steps is not None:
        if args.steps < 1:
            raise PeerError(f"--steps: must be at least 1, not {args.steps}")
        train["steps"] = args.steps
        # As `dptrain bench train --steps`: the learning-rate warm-up is at most the steps.
        schedule = recipe["optimizer"]["schedule"]
        schedule["warmup"] = min(int(schedule["warmup"]), args.steps)
    if args.batch_per_rank is not None:
        if args.batch_per_rank < 1:
            raise PeerError(f"--batch-per-rank: must be at least 1, not {args.batch_per_rank}")
        train["batch_per_rank"] = args.batch_per_rank
    if args.precision is not None:
        train["precision"] = args.precision
    allowed = PRECISIONS[args.device]
    if train["precision"] not in allowed:
        where = "--precision" if args.precision is not None else f"{path}: /train/precision"
        if args.device == "cpu":
            raise PeerError(f"{where}: {train['precision']!r} needs --device cuda (the CPU peer "
                            f"computes in fp32)")
        raise PeerError(f"{where}: the peer supports only {list(allowed)} on {args.device}, "
                        f"not {train['precision']!r}")
    if args.compile and args.device != "cuda":
        raise PeerError("--compile: only with --device cuda (the CPU peer runs eagerly)")
    model = recipe["model"]
    if model["width"] % model["heads"] != 0:
        raise PeerError(f"{path}: /model/width: {model['width']} is not a multiple of "
                        f"/model/heads ({model['heads']})")
    if not recipe["data"]["path"]:
        raise PeerError(f"{path}: /data/path: no token dataset directory given")
    # Like dptrain, a relative data path resolves against the recipe's folder.
    recipe["data"]["path"] = os.path.normpath(
        os.path.join(os.path.dirname(os.path.abspath(path)), recipe["data"]["path"]))
    return recipe


def read_token_body(path, model_vocab):
    """DIR/train.bin (format: core/data/tokens.hpp), its header checked: returns (the token
    bytes, bytes per token, vocabulary)."""
    try:
        with open(path, "rb") as f:
            header = f.read(TOKEN_HEADER_BYTES)
            body = f.read()
    except OSError as e:
        raise PeerError(f"{path}: cannot read the token file: {e}") from e
    if len(header) < TOKEN_HEADER_BYTES or header[:8] != TOKEN_MAGIC:
        raise PeerError(f"{path}: not a dptrain token file (no DPTOKENS header)")
    version, dtype_bytes, vocab, count, _checksum = struct.unpack_from("<IIQQQ", header, 8)
    if version != 1:
        raise PeerError(f"{path}: token file version {version}, the peer reads version 1")
    if dtype_bytes not in (2, 4):
        raise PeerError(f"{path}: token dtype of {dtype_bytes} bytes (expected 2 or 4)")
    if len(body) != count * dtype_bytes:
        raise PeerError(f"{path}: truncated: the header says {count} tokens of {dtype_bytes} "
                        f"bytes, the file holds {len(body)} bytes after the header")
    if vocab > model_vocab:
        raise PeerError(f"{path}: vocabulary {vocab} is larger than /model/vocab {model_vocab}")
    return body, dtype_bytes, vocab


def read_token_file(path, model_vocab):
    """DIR/train.bin as a numpy int64 array (the CPU ranks)."""
    import numpy as np

    body, dtype_bytes, vocab = read_token_body(path, model_vocab)
    tokens = np.frombuffer(body, dtype="<u2" if dtype_bytes == 2 else "<u4").astype(np.int64)
    if len(tokens) and int(tokens.max()) >= vocab:
        raise PeerError(f"{path}: a token is >= the vocabulary {vocab}")
    return tokens


def read_token_tensor(torch, path, model_vocab):
    """DIR/train.bin as a torch int64 tensor, with torch alone: PyTorch's wheels do not bring
    numpy (the GPU peer). Unsigned little-endian tokens, read as signed and masked."""
    if sys.byteorder != "little":
        raise PeerError(f"{path}: the GPU peer reads token files on little-endian machines only")
    body, dtype_bytes, vocab = read_token_body(path, model_vocab)
    if not body:
        return torch.zeros(0, dtype=torch.int64)
    signed = torch.int16 if dtype_bytes == 2 else torch.int32
    tokens = torch.frombuffer(bytearray(body), dtype=signed).to(torch.int64)
    tokens &= (1 << (8 * dtype_bytes)) - 1
    if int(tokens.max()) >= vocab:
        raise PeerError(f"{path}: a token is >= the vocabulary {vocab}")
    return tokens


def optimizer_step(torch, model, optimizer, opt_spec, i, steps, clip):
    """Step i's update, as dptrain's: the schedule's learning rate, clipping, then AdamW."""
    lr = learning_rate(opt_spec, i, steps)
    for group in optimizer.param_groups:
        group["lr"] = lr
    if clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optimizer.step()


def learning_rate(spec, step, total):
    """core/optim/optimizer.cpp's learning_rate(), step 0-based."""
    schedule = spec["schedule"]
    warmup = int(schedule["warmup"])
    if step < warmup:
        return spec["lr"] * (step + 1) / warmup
    decay_steps = total - warmup
    if schedule["type"] == "constant" or decay_steps <= 0:
        return spec["lr"]
    progress = min(1.0, (step - warmup) / decay_steps)
    if schedule["type"] == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        remaining = 1.0 - progress
    min_lr = spec["lr"] * schedule["min_lr_ratio"]
    return min_lr + (spec["lr"] - min_lr) * remaining


def make_model_class(torch, sdpa=False):
    """The GPT of core/model/gpt.cpp; a function so that torch is imported only in the ranks.
    sdpa: attention with F.scaled_dot_product_attention (torch 2.x; the GPU peer) instead of the
    masked softmax written out (the CPU peer); the same function of the inputs."""
    from torch import nn
    import torch.nn.functional as F

    class Block(nn.Module):
        def __init__(self, width, heads, mlp_ratio, context):
            super().__init__()
            self.heads = heads
            self.ln1 = nn.LayerNorm(width, eps=1e-5)
            self.qkv = nn.Linear(width, 3 * width)
            self.proj = nn.Linear(width, width)
            self.ln2 = nn.LayerNorm(width, eps=1e-5)
            self.fc = nn.Linear(width, mlp_ratio * width)
            self.fc_proj = nn.Linear(mlp_ratio * width, width)
            # A plain attribute, not a buffer: DDP would broadcast a buffer, and Gloo has no bool.
            # SDPA makes its own causal mask (is_causal).
            if not sdpa:
                mask = torch.tril(torch.ones(context, context, dtype=torch.bool))
                self.causal = mask.view(1, 1, context, context)

        def attention(self, x):
            batch, seq, width = x.shape
            head_dim = width // self.heads
            q, k, v = self.qkv(x).split(width, dim=2)
            q = q.view(batch, seq, self.heads, head_dim).transpose(1, 2)  # [B, H, T, hd]
            k = k.view(batch, seq, self.heads, head_dim).transpose(1, 2)
            v = v.view(batch, seq, self.heads, head_dim).transpose(1, 2)
            if sdpa:
                # Its default scale is 1 / sqrt(head_dim), as below; flash attention where the
                # dtype and shapes allow (bf16), another fused kernel or the math one otherwise.
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_dim))
                scores = scores.masked_fill(~self.causal[:, :, :seq, :seq], float("-inf"))
                out = torch.softmax(scores, dim=-1) @ v
            return self.proj(out.transpose(1, 2).contiguous().view(batch, seq, width))

        def forward(self, x):
            x = x + self.attention(self.ln1(x))
            return x + self.fc_proj(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class Gpt(nn.Module):
        def __init__(self, vocab, context, layers, heads, width, mlp_ratio):
            super().__init__()
            self.wte = nn.Parameter(torch.empty(vocab, width))
            self.wpe = nn.Parameter(torch.empty(context, width))
            self.blocks = nn.ModuleList(Block(width, heads, mlp_ratio, context)
                                        for _ in range(layers))
            self.lnf = nn.LayerNorm(width, eps=1e-5)
            # gpt.cpp's init: N(0, 0.02) weights and embeddings, the two projections into the
            # residual stream N(0, 0.02 / sqrt(2 * layers)), zero biases, LayerNorm 1 and 0.
            residual_std = 0.02 / math.sqrt(2.0 * layers)
            with torch.no_grad():
                nn.init.normal_(self.wte, std=0.02)
                nn.init.normal_(self.wpe, std=0.02)
                for block in self.blocks:
                    for linear, std in ((block.qkv, 0.02), (block.proj, residual_std),
                                        (block.fc, 0.02), (block.fc_proj, residual_std)):
                        nn.init.normal_(linear.weight, std=std)
                        nn.init.zeros_(linear.bias)

        def forward(self, inputs, targets):
            seq = inputs.shape[1]
            x = F.embedding(inputs, self.wte) + self.wpe[:seq]
            for block in self.blocks:
                x = block(x)
            logits = self.lnf(x) @ self.wte.t()  # the head tied to the token embedding
            return F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))

    return Gpt


def run_rank(recipe):
    """One rank: trains, and rank 0 prints one JSON line with the global throughput."""
    threads = int(recipe["train"]["threads_per_rank"])
    torch, dist, rank, _ = benchlib.init_rank(threads, recipe["distributed"]["timeout_s"])
    from torch.nn.parallel import DistributedDataParallel

    spec = recipe["model"]
    context = int(spec["context"])
    tokens = torch.from_numpy(read_token_file(os.path.join(recipe["data"]["path"], "train.bin"),
                                              int(spec["vocab"])))
    # dptrain's training windows start at every position 0 .. n - context - 1.
    window_count = tokens.numel() - context
    if window_count < 1:
        raise PeerError(f"{recipe['data']['path']}/train.bin: {tokens.numel()} tokens, fewer "
                        f"than one window of {context + 1}")

    torch.manual_seed(int(recipe["seed"]))  # the same initial weights on every rank
    model = make_model_class(torch)(int(spec["vocab"]), context, int(spec["layers"]),
                                    int(spec["heads"]), int(spec["width"]),
                                    int(spec["mlp_ratio"]))
    params = sum(p.numel() for p in model.parameters())
    ddp = DistributedDataParallel(model)
    opt_spec = recipe["optimizer"]
    # Weight decay on the 2-D weights and the embeddings only, as dptrain (its no_decay()).
    groups = benchlib.decay_groups(model.parameters(), opt_spec["weight_decay"])
    optimizer = torch.optim.AdamW(groups, lr=opt_spec["lr"],
                                  betas=(opt_spec["beta1"], opt_spec["beta2"]),
                                  eps=opt_spec["eps"])
    clip = float(opt_spec["clip_grad_norm"])
    batch_gen = torch.Generator().manual_seed(int(recipe["seed"]) * 1000003 + rank)
    offsets = torch.arange(context + 1)
    steps, batch = int(recipe["train"]["steps"]), int(recipe["train"]["batch_per_rank"])
    phases = dict.fromkeys(("data", "forward", "backward", "optimizer"), 0.0)

    def step(i):
        t0 = time.perf_counter()
        starts = torch.randint(window_count, (batch,), generator=batch_gen)
        windows = tokens[starts.unsqueeze(1) + offsets]  # [batch, context + 1]
        inputs, targets = windows[:, :-1], windows[:, 1:]
        t1 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = ddp(inputs, targets)
        t2 = time.perf_counter()
        loss.backward()  # DDP's gradient all-reduce runs inside, overlapped with the backward
        t3 = time.perf_counter()
        optimizer_step(torch, model, optimizer, opt_spec, i, steps, clip)
        t4 = time.perf_counter()
        for name, seconds in (("data", t1 - t0), ("forward", t2 - t1), ("backward", t3 - t2),
                              ("optimizer", t4 - t3)):
            phases[name] += seconds * 1000.0
        return loss

    # Only the timed steps count towards the phase times.
    loss, warmup, timed_s = benchlib.timed_loop(
        dist, steps, step, on_start=lambda: phases.update(dict.fromkeys(phases, 0.0)))
    timed_steps = steps - warmup
    benchlib.finish_rank(
        torch, dist, loss, steps, warmup, batch, timed_s,
        rates=lambda samples_per_s: {"tokens_per_s": samples_per_s * context},
        extra={"params": params,
               "step_ms": 1000.0 * timed_s / timed_steps,
               "phase_ms": {name: total / timed_steps for name, total in phases.items()},
               "threads_per_rank": threads, "device": "cpu", "device_name": benchlib.machine()["cpu_model"],
               "precision": "fp32"})


def disable_tf32(torch):
    """fp32 as IEEE fp32, as dptrain's fp32 GEMMs are: no TF32 in cuBLAS nor cuDNN. torch 2.9
    replaced the allow_tf32 flags with fp32_precision and refuses a mix of the two APIs, so each
    torch gets only its own. Returns how it was set, for the result."""
    backends = torch.backends
    try:
        new_api = isinstance(getattr(backends.cuda.matmul, "fp32_precision"), str)
    except (AttributeError, AssertionError):  # torch < 2.9 asserts on an unknown attribute
        new_api = False
    if not new_api:
        backends.cuda.matmul.allow_tf32 = False
        backends.cudnn.allow_tf32 = False
        return "allow_tf32 False (cuBLAS, cuDNN)"
    backends.cuda.matmul.fp32_precision = "ieee"
    # cuDNN's conv and rnn flags both, so that the legacy getter still sees one value. The model
    # has no convolution nor RNN: a torch that refuses these is noted, not fatal.
    try:
        for flags in (backends.cudnn, getattr(backends.cudnn, "conv", None),
                      getattr(backends.cudnn, "rnn", None)):
            if flags is not None:
                flags.fp32_precision = "ieee"
    except (AttributeError, RuntimeError, ValueError) as e:
        return f"fp32_precision ieee (cuBLAS; cuDNN left as it was: {e})"
    return "fp32_precision ieee (cuBLAS, cuDNN)"


def check_cuda(torch, recipe):
    """One line saying why this PyTorch cannot run the recipe on a GPU, as a PeerError."""
    if not torch.cuda.is_available():
        if torch.version.cuda is None:
            why = "this build of PyTorch has no CUDA"
        else:
            why = (f"it is built with CUDA {torch.version.cuda} but sees no GPU (check the "
                   f"driver and CUDA_VISIBLE_DEVICES)")
        raise PeerError(f"--device cuda: no CUDA device for torch {torch.__version__} "
                        f"({sys.executable}): {why}")
    if not hasattr(torch.nn.functional, "scaled_dot_product_attention"):
        raise PeerError(f"--device cuda: torch {torch.__version__} has no "
                        f"scaled_dot_product_attention; the GPU peer needs torch 2.0 or newer")
    if recipe["train"]["precision"] == "bf16" and not torch.cuda.is_bf16_supported():
        raise PeerError(f"--precision bf16: {torch.cuda.get_device_name()} does not support "
                        f"bfloat16")


def train_cuda(torch, recipe, compile_model):
    """The recipe on one GPU, no process group; returns the result object (the fields
    finish_rank() prints for the CPU ranks, plus the GPU's)."""
    device = torch.device("cuda")
    tf32 = disable_tf32(torch)
    spec, opt_spec = recipe["model"], recipe["optimizer"]
    context, seed = int(spec["context"]), int(recipe["seed"])
    precision = recipe["train"]["precision"]
    steps, batch = int(recipe["train"]["steps"]), int(recipe["train"]["batch_per_rank"])
    warmup = benchlib.warmup_steps(steps)
    if steps <= warmup or steps < 1:
        raise PeerError(f"/train/steps: {steps} leaves no timed steps after {warmup} warm-up "
                        f"steps")
    host_tokens = read_token_tensor(torch, os.path.join(recipe["data"]["path"], "train.bin"),
                                    int(spec["vocab"]))
    # dptrain's training windows start at every position 0 .. n - context - 1.
    window_count = host_tokens.numel() - context
    if window_count < 1:
        raise PeerError(f"{recipe['data']['path']}/train.bin: {host_tokens.numel()} tokens, "
                        f"fewer than one window of {context + 1}")
    tokens = host_tokens.to(device)
    del host_tokens

    torch.manual_seed(seed)  # built on the CPU: the CPU peer's initial weights
    model = make_model_class(torch, sdpa=True)(
        int(spec["vocab"]), context, int(spec["layers"]), int(spec["heads"]),
        int(spec["width"]), int(spec["mlp_ratio"])).to(device)
    params = sum(p.numel() for p in model.parameters())
    groups = benchlib.decay_groups(model.parameters(), opt_spec["weight_decay"])
    # The parameters stay fp32 (the master weights) in either precision; fused: one kernel for
    # the update of every tensor, as dptrain's own fused AdamW.
    optimizer = torch.optim.AdamW(groups, lr=opt_spec["lr"],
                                  betas=(opt_spec["beta1"], opt_spec["beta2"]),
                                  eps=opt_spec["eps"], fused=True)
    clip = float(opt_spec["clip_grad_norm"])
    forward = model
    if compile_model:
        if not hasattr(torch, "compile"):
            raise PeerError(f"--compile: torch {torch.__version__} has no torch.compile")
        forward = torch.compile(model)  # compiled at the first step, a warm-up step

    def autocast():
        if precision == "bf16":
            return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # Batches drawn on the GPU: a host generator would need a copy to the device, a
    # synchronising one from pageable memory, every step.
    batch_gen = torch.Generator(device=device)
    batch_gen.manual_seed(seed * 1000003)
    offsets = torch.arange(context + 1, device=device)
    marks = []  # per timed step: CUDA events before data, forward, backward, optimizer, after

    def step(i, timed):
        events = [torch.cuda.Event(enable_timing=True) for _ in range(5)] if timed else []

        def mark(k):
            if events:
                events[k].record()

        mark(0)
        starts = torch.randint(window_count, (batch,), generator=batch_gen, device=device)
        windows = tokens[starts.unsqueeze(1) + offsets]  # [batch, context + 1]
        inputs, targets = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        mark(1)
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = forward(inputs, targets)
        mark(2)
        loss.backward()
        mark(3)
        optimizer_step(torch, model, optimizer, opt_spec, i, steps, clip)
        mark(4)
        if events:
            marks.append(events)
        return loss

    started, loss = None, None
    for i in range(steps):
        if i == warmup:
            torch.cuda.synchronize()  # the warm-up's queued work is not timed
            started = time.perf_counter()
        loss = step(i, i >= warmup)
    torch.cuda.synchronize()  # every timed step has run on the GPU, not only been queued
    timed_s = time.perf_counter() - started
    timed_steps = steps - warmup
    phase_ms = {name: sum(events[k].elapsed_time(events[k + 1]) for events in marks)
                / timed_steps
                for k, name in enumerate(("data", "forward", "backward", "optimizer"))}
    samples_per_s = batch * timed_steps / timed_s
    return {
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * context,
        "world_size": 1,
        "steps": steps,
        "warmup_steps": warmup,
        "timed_s": timed_s,
        "final_loss": loss.item(),
        "params": params,
        "step_ms": 1000.0 * timed_s / timed_steps,
        # GPU time between events recorded around each phase (idle gaps included).
        "phase_ms": phase_ms,
        "device": "cuda",
        "device_name": torch.cuda.get_device_name(),
        "precision": precision,
        "batch_per_rank": batch,
        "attention": "scaled_dot_product_attention",
        "optimizer": "AdamW fused",
        "compile": bool(compile_model),
        "fp32_matmul": tf32,
        "peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20,
        "torch_version": torch.__version__,
        "cuda_version": torch.version.cuda,
        "python_version": platform.python_version(),
    }


def run_cuda(args):
    """--device cuda: this process is the one rank; prints the result. Returns the exit status."""
    try:
        if args.nproc != 1:
            raise PeerError(f"--nproc: --device cuda runs one process on one GPU, not "
                            f"{args.nproc}")
        recipe = load_recipe(args.recipe, args)
        import torch

        check_cuda(torch, recipe)

        def out_of_time(signum, frame):
            raise PeerError(f"did not finish within --timeout {args.timeout:g} s")

        signal.signal(signal.SIGALRM, out_of_time)
        signal.setitimer(signal.ITIMER_REAL, args.timeout)
        result = train_cuda(torch, recipe, args.compile)
        signal.setitimer(signal.ITIMER_REAL, 0)
    except PeerError as e:
        print(f"{NAME}: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"{NAME}: {sys.executable} cannot import PyTorch ({e}); run it with a python3 "
              f"that has a CUDA build of PyTorch 2.x", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result), flush=True)
    else:
        print(summary(result), flush=True)
    return 0


def summary(result):
    if result.get("device") == "cuda":
        return (f"PyTorch on {result['device_name']}, {result['precision']}"
                f"{', compiled' if result['compile'] else ''}: "
                f"{result['tokens_per_s']:.0f} tokens/s ({result['samples_per_s']:.1f} "
                f"samples/s, {result['step_ms']:.1f} ms a step), {result['params']} parameters, "
                f"final loss {result['final_loss']:.4f}")
    return (f"PyTorch DDP, {result['world_size']} rank(s): "
            f"{result['tokens_per_s']:.0f} tokens/s ({result['samples_per_s']:.1f} samples/s), "
            f"{result['params']} parameters, final loss {result['final_loss']:.4f}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe", help="dptrain JSON recipe (the fields in DEFAULTS are mirrored)")
    parser.add_argument("--nproc", type=int, default=1,
                        help="local ranks (default 1; 1 with --device cuda)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: Gloo DDP ranks (default); cuda: one process on one GPU")
    parser.add_argument("--precision", choices=("fp32", "bf16"),
                        help="replaces /train/precision (bf16 with --device cuda only)")
    parser.add_argument("--steps", type=int,
                        help="replaces /train/steps (and caps the schedule's warm-up at it)")
    parser.add_argument("--batch-per-rank", type=int, help="replaces /train/batch_per_rank")
    parser.add_argument("--compile", action="store_true",
                        help="--device cuda: torch.compile the model (default: eager)")
    benchlib.add_peer_arguments(parser)
    return parser.parse_args()


def worker_argv(args):
    """This script's arguments for one CPU rank (run_peer adds --worker)."""
    argv = [os.path.abspath(__file__), args.recipe]
    for flag, value in (("--precision", args.precision), ("--steps", args.steps),
                        ("--batch-per-rank", args.batch_per_rank)):
        if value is not None:
            argv += [flag, str(value)]
    return argv


def main():
    args = parse_args()
    if args.device == "cuda":
        return run_cuda(args)
    # The CPU ranks, as benchlib.peer_main() runs every CPU peer.
    return benchlib.run_peer(NAME, args, lambda: load_recipe(args.recipe, args), run_rank,
                             lambda recipe: worker_argv(args),
                             lambda result: print(summary(result)), needs="PyTorch or numpy")


if __name__ == "__main__":
    sys.exit(main())
