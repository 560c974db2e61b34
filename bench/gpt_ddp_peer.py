#!/usr/bin/python3
"""PyTorch DDP (Gloo, CPU) peer of `dptrain launch RECIPE --json`: the recipe's GPT on N ranks.

Usage:
  /usr/bin/python3 bench/gpt_ddp_peer.py RECIPE --nproc N [--json]

It reads the same recipe and the same token dataset directory (/data/path, written by `dptrain
data prepare`) as dptrain, and builds the model of core/model/gpt.cpp layer for layer: token and
learned position embeddings, pre-LayerNorm blocks of causal multi-head attention (one fused qkv
Linear, an output Linear) and a GELU (tanh) MLP, a final LayerNorm and an LM head tied to the
token embedding; the same initialisation scale, AdamW with weight decay on 2-D weights and
embeddings only, the recipe's learning-rate schedule and gradient clipping. It answers with the
fields dptrain's launcher prints: samples_per_s, world_size, steps, final_loss (plus params,
tokens_per_s, per-phase milliseconds and versions).

The launcher mode spawns one process per rank itself (torchrun does not work under Debian's
Python 3.11) with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE in the environment; with --worker the
script is one rank and reads those variables, so it also runs under an external launcher.
"""

import math
import os
import struct
import sys
import time

import benchlib
from benchlib import PeerError

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
        ("/train/precision", recipe["train"]["precision"], {"fp32"}),
        ("/optimizer/type", recipe["optimizer"]["type"], {"adamw"}),
        ("/optimizer/schedule/type", recipe["optimizer"]["schedule"]["type"],
         {"constant", "cosine", "linear"}),
        ("/distributed/sync", recipe["distributed"]["sync"], {"allreduce"}),
        ("/distributed/compression/type", recipe["distributed"]["compression"]["type"], {"none"}),
    ]


def load_recipe(path):
    recipe = benchlib.load_peer_recipe(path, DEFAULTS, supported)
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


def read_token_file(path, model_vocab):
    """DIR/train.bin (format: core/data/tokens.hpp) as a numpy int64 array; checks the header."""
    import numpy as np

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
    tokens = np.frombuffer(body, dtype="<u2" if dtype_bytes == 2 else "<u4").astype(np.int64)
    if count and int(tokens.max()) >= vocab:
        raise PeerError(f"{path}: a token is >= the vocabulary {vocab}")
    return tokens


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


def make_model_class(torch):
    """The GPT of core/model/gpt.cpp; a function so that torch is imported only in the ranks."""
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
            mask = torch.tril(torch.ones(context, context, dtype=torch.bool))
            self.causal = mask.view(1, 1, context, context)

        def attention(self, x):
            batch, seq, width = x.shape
            head_dim = width // self.heads
            q, k, v = self.qkv(x).split(width, dim=2)
            q = q.view(batch, seq, self.heads, head_dim).transpose(1, 2)  # [B, H, T, hd]
            k = k.view(batch, seq, self.heads, head_dim).transpose(1, 2)
            v = v.view(batch, seq, self.heads, head_dim).transpose(1, 2)
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
        lr = learning_rate(opt_spec, i, steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
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
               "phase_ms": {name: total / timed_steps for name, total in phases.items()},
               "threads_per_rank": threads})


def summary(result):
    return (f"PyTorch DDP, {result['world_size']} rank(s): "
            f"{result['tokens_per_s']:.0f} tokens/s ({result['samples_per_s']:.1f} samples/s), "
            f"{result['params']} parameters, final loss {result['final_loss']:.4f}")


if __name__ == "__main__":
    sys.exit(benchlib.peer_main("gpt_ddp_peer", __file__, __doc__, load_recipe, run_rank,
                                summary, needs="PyTorch or numpy"))
