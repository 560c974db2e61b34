#!/usr/bin/env python3
"""Numerical parity of dptrain's CPU models (MLP, GPT) and AdamW with an independent PyTorch
implementation.

dptrain's CPU op table is the reference its CUDA path is tested against, so its forward pass,
backward pass and optimizer must compute the right numbers. This script trains small models with
a built dptrain binary, reads back what it wrote, and recomputes the same steps with PyTorch
(Debian's python3-torch 1.13, CPU) written from the model's definition, not from dptrain's code:
nn.functional's layer_norm, gelu(approximate="tanh"), softmax, cross_entropy, autograd for every
gradient and torch.optim.AdamW for the update.

How the two sides see the same thing
------------------------------------
* Parameters: dptrain writes them. A run with `train.steps` 0 still writes its final checkpoint,
  `step-000000/params.bin`: the initial parameters (raw little-endian float32 in the model's flat
  layout, core/model/mlp.hpp and gpt.hpp). A second run of N steps with `checkpoint.every` 1
  writes step-000001 ... step-N, each with params.bin and optimizer.bin (AdamW's m then v, the
  same layout). The script splits the flat buffer into named tensors with the layout of
  core/model/*.hpp re-derived here.
* Batches: every step's batch is the WHOLE training split (`batch_per_rank` = its size, one
  rank, no gradient accumulation), so dptrain's sampler can only change the order of the samples
  inside a batch, which changes nothing but float rounding (the loss is a mean, the gradient a
  sum). The MLP trains on a CSV file the script writes (`eval_fraction` 0: every row is
  training data); the GPT on a char-tokenized text the script writes and turns into a token
  dataset with `dptrain data prepare --val-fraction 0`: its samples are every window of
  context + 1 tokens of train.bin (stride 1), read here from train.bin itself.
* Hyper-parameters: taken from `dptrain recipe show` (every default resolved), so the two sides
  cannot disagree on one. The learning-rate schedule (linear warm-up, cosine decay to
  lr * min_lr_ratio) is re-implemented from its documented formula; weight decay goes to the
  weights and embeddings, not to biases and LayerNorm parameters; gradients are clipped to
  `clip_grad_norm` by scaling them with max_norm / norm when norm > max_norm (dptrain's rule;
  torch.nn.utils.clip_grad_norm_ divides by norm + 1e-6 instead, a 1e-6 relative difference,
  so the script scales by hand).

What is compared (PyTorch in float64 is the reference; PyTorch in float32 runs the same
computations, to show the float32 rounding noise a correct implementation has)
-----------------
1. loss and gradient norm at every step k = 1..N: `metrics.jsonl` (`log.every` 1) against
   PyTorch's on dptrain's own parameters before that step (checkpoint k - 1): a check of the
   forward pass and of the gradient's size that does not accumulate over steps. The logged
   learning rate against the schedule's formula.
2. one step from dptrain's state, k = 1..N: PyTorch takes dptrain's parameters and AdamW state
   of checkpoint k - 1, does one step (forward, backward, clipping, torch.optim.AdamW at the
   step's learning rate) and compares, per tensor, m_k (after step 1 m is (1 - beta1) x the
   clipped gradient: the per-tensor gradient check, exact to float32 rounding), v_k and the
   update p_k - p_(k-1) with dptrain's checkpoint k. The default setups clip some steps and not
   others (clip_grad_norm 2; the table says which).
3. the AdamW update alone: dptrain's p_k against PyTorch's AdamW formula evaluated in float64 on
   dptrain's own p_(k-1), m_k and v_k, so that gradient rounding plays no part: the difference
   is measured in float32 roundings of the operands, |a - ref| / (2^-23 (|p_(k-1)| + |update|)),
   and a few units is what computing it in float32 leaves. This is what checks the weight-decay
   mask, the bias corrections and the learning rate to float32 precision.
4. N steps: PyTorch trains from the initial parameters on its own for N steps; the loss at each
   step and, per tensor, the total change p_N - p_0 are compared with dptrain's.

Every tensor difference is "max relative": max |a - ref| / max |ref| over the tensor (a relative
difference per element means nothing where the reference is ~0). The loss and norm differences
are |a - ref| / |ref|. Each check has a tolerance appropriate to float32 (see TOLERANCES); a
difference above it fails the check. The update of one Adam step, m / (sqrt(v) + eps), is about
+-lr wherever the gradient is well above eps, whatever its size, and an element whose gradient
is near eps (or is rounding noise: the gradient of the attention's key bias is 0 in exact
arithmetic) moves by an amount its rounding decides: the update and N-step tolerances are
therefore looser (PyTorch float32 itself reaches 4e-3 there on the GPT).

Weight decay: both models skip their biases (and the GPT its LayerNorm parameters): dptrain
decays the weight matrices and embeddings only (Model::no_decay(), dptrain-recipe(5)); the
script gives torch.optim.AdamW the same two parameter groups.

Usage: python3 bench/model_parity.py [--binary build/dptrain] [--models mlp,mlp-gelu,gpt]
[--steps N] [--json] [--keep DIR]. Prints a table (progress on stderr) or, with --json, one
object. Exit status 0 when every check passes, 1 when one fails (or a dptrain run fails), 2 when
a prerequisite (the binary, PyTorch) is missing. The interpreter needs torch and numpy; when the
one running the script lacks them it re-runs itself with --torch-python (default
/usr/bin/python3, Debian's python3-torch). A few seconds on 2 cores.
"""

import argparse
import json
import math
import os
import random
import shutil
import struct
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402

MODELS = ("mlp", "mlp-gelu", "gpt")

# Tolerances, each on a max relative difference of dptrain against PyTorch float64 (adamw: in
# float32 roundings), for the default setups and steps. They sit about 10x or more above what
# dptrain measured (bench/README.md), which is the size of PyTorch float32's own difference from
# float64 (update and traj: above PyTorch float32's too, see the docstring). The loss's relative
# difference grows as the loss falls (the MLP's after 20 steps: 4e-7). Checked to fail on a
# wrong GELU (erf instead of tanh: grad 9e-5 on the GPT, loss 6e-5 on the GELU MLP), a wrong
# LayerNorm eps (1e-6: loss 3e-4) and weight decay on the wrong tensors (adamw 8e3).
TOLERANCES = {
    "loss": 1e-5,         # loss at a step, from the same parameters
    "grad_norm": 5e-6,    # gradient norm at a step, from the same parameters
    "grad": 2e-5,         # m after one step from the same state: the clipped gradient per tensor
    "v": 4e-5,            # v after one step from the same state
    "lr": 1e-12,          # learning rate at a step, logged vs the schedule's formula
    "adamw": 8.0,         # p_k vs AdamW's formula on dptrain's own m_k, v_k: float32 roundings
    "update": 1e-2,       # p_k - p_{k-1} from the same state (Adam's sign-like update, see above)
    "loss_traj": 2e-5,    # loss at step k after k - 1 steps each side on its own
    "traj": 1e-2,         # p_N - p_0 after N steps each side on its own
}


class ParityError(Exception):
    def __init__(self, message, exit_code=1):
        super().__init__(message)
        self.exit_code = exit_code


def log(message):
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Models and data (the layouts of core/model/mlp.hpp and gpt.hpp, re-derived)
# ---------------------------------------------------------------------------------------------


def mlp_layout(widths):
    """[(name, shape, decay)] in flat-buffer order: per layer W [out, in], then b [out]. Weight
    decay goes to the weights, not the biases, as in the GPT."""
    out = []
    for i in range(len(widths) - 1):
        out.append((f"l{i}.weight", (widths[i + 1], widths[i]), True))
        out.append((f"l{i}.bias", (widths[i + 1],), False))
    return out


def gpt_layout(m):
    c, mlp = m["width"], m["mlp_ratio"] * m["width"]
    out = [("wte", (m["vocab"], c), True), ("wpe", (m["context"], c), True)]
    for i in range(m["layers"]):
        p = f"h{i}."
        out += [(p + "ln1.gamma", (c,), False), (p + "ln1.beta", (c,), False),
                (p + "qkv.weight", (3 * c, c), True), (p + "qkv.bias", (3 * c,), False),
                (p + "proj.weight", (c, c), True), (p + "proj.bias", (c,), False),
                (p + "ln2.gamma", (c,), False), (p + "ln2.beta", (c,), False),
                (p + "fc.weight", (mlp, c), True), (p + "fc.bias", (mlp,), False),
                (p + "fc_proj.weight", (c, mlp), True), (p + "fc_proj.bias", (c,), False)]
    out += [("lnf.gamma", (c,), False), ("lnf.beta", (c,), False)]
    return out


def layout_size(layout):
    return sum(math.prod(shape) for _, shape, _ in layout)


def split_flat(torch, flat, layout, dtype):
    """Named tensors (fresh leaves of `dtype`) from a flat float32 numpy buffer."""
    if flat.size != layout_size(layout):
        raise ParityError(f"a parameter buffer has {flat.size} floats, the layout "
                          f"{layout_size(layout)}")
    out, at = {}, 0
    for name, shape, _ in layout:
        n = math.prod(shape)
        out[name] = torch.from_numpy(flat[at:at + n].copy()).to(dtype).reshape(shape)
        at += n
    return out


def mlp_loss(torch, params, batch, widths, activation):
    import torch.nn.functional as F
    x, y = batch
    x = x.to(params["l0.weight"].dtype)
    layers = len(widths) - 1
    for i in range(layers):
        x = F.linear(x, params[f"l{i}.weight"], params[f"l{i}.bias"])
        if i + 1 < layers:
            x = F.relu(x) if activation == "relu" else F.gelu(x, approximate="tanh")
    return F.cross_entropy(x, y)


def gpt_loss(torch, params, batch, m):
    """GPT-2 as core/model/gpt.hpp describes it: token + learned position embeddings; pre-LN
    blocks x + proj(causal_attention(ln1(x))), then x + fc_proj(gelu_tanh(fc(ln2(x)))); a final
    LayerNorm; logits lnf(x) wte^T (tied head); mean cross-entropy over every position."""
    import torch.nn.functional as F
    inputs, targets = batch
    c, heads, eps = m["width"], m["heads"], 1e-5
    hd = c // heads
    b, t = inputs.shape
    x = params["wte"][inputs] + params["wpe"][:t]
    mask = torch.ones(t, t, dtype=torch.bool).triu(1)
    for i in range(m["layers"]):
        p = lambda name: params[f"h{i}.{name}"]  # noqa: E731
        h = F.layer_norm(x, (c,), p("ln1.gamma"), p("ln1.beta"), eps)
        q, k, v = F.linear(h, p("qkv.weight"), p("qkv.bias")).split(c, dim=-1)
        q, k, v = (z.view(b, t, heads, hd).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)
        att = torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, c)
        x = x + F.linear(y, p("proj.weight"), p("proj.bias"))
        h = F.layer_norm(x, (c,), p("ln2.gamma"), p("ln2.beta"), eps)
        h = F.gelu(F.linear(h, p("fc.weight"), p("fc.bias")), approximate="tanh")
        x = x + F.linear(h, p("fc_proj.weight"), p("fc_proj.bias"))
    x = F.layer_norm(x, (c,), params["lnf.gamma"], params["lnf.beta"], eps)
    logits = x @ params["wte"].t()
    return F.cross_entropy(logits.reshape(-1, m["vocab"]), targets.reshape(-1))


def write_csv(path, samples, features, classes, seed):
    """Gaussian clusters, one per class: learnable, so the loss moves over a few steps."""
    rng = random.Random(seed)
    centres = [[rng.gauss(0.0, 1.0) for _ in range(features)] for _ in range(classes)]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(samples):
            label = i % classes
            row = [centres[label][j] + rng.gauss(0.0, 1.0) for j in range(features)]
            f.write(",".join([str(label)] + [f"{v:.6f}" for v in row]) + "\n")


def read_csv(path):
    import numpy as np
    data = np.loadtxt(path, delimiter=",", dtype=np.float64, ndmin=2)
    # dptrain parses the text to float32; so does this.
    return data[:, 1:].astype(np.float32), data[:, 0].astype(np.int64)


GPT_ALPHABET = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,;:!?'-\n"


def write_text(path, length, seed):
    """Text over a fixed alphabet (every character at least once, so the char tokenizer's
    vocabulary is the alphabet): word-like runs of letters between punctuation."""
    rng = random.Random(seed)
    chars = list(GPT_ALPHABET)
    body = []
    while len(body) < length - len(chars):
        word = "".join(rng.choice(GPT_ALPHABET[:26]) for _ in range(rng.randint(1, 7)))
        body.extend(word + rng.choice(" .,;:!?'-\n" if rng.random() < 0.3 else " "))
    text = "".join(chars) + "".join(body)[:length - len(chars)]
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def read_token_file(path):
    """train.bin (format: core/data/tokens.hpp) as numpy int64."""
    import numpy as np
    with open(path, "rb") as f:
        header = f.read(64)
        if len(header) != 64 or header[:8] != b"DPTOKENS":
            raise ParityError(f"{path}: not a dptrain token file")
        _, dtype_bytes, vocab, count = struct.unpack("<IIQQ", header[8:32])
        data = np.frombuffer(f.read(), dtype={2: "<u2", 4: "<u4"}[dtype_bytes])
    if data.size != count:
        raise ParityError(f"{path}: header says {count} tokens, file holds {data.size}")
    return data.astype(np.int64), vocab


# ---------------------------------------------------------------------------------------------
# The setups: data, recipe, and the PyTorch side of each model
# ---------------------------------------------------------------------------------------------


def base_recipe(name, model, data, batch, steps, lr, clip):
    return {
        "name": f"parity-{name}",
        "seed": 7,
        "model": model,
        "data": data,
        "train": {"steps": steps, "batch_per_rank": batch, "grad_accum": 1,
                  "precision": "fp32", "threads_per_rank": 1},
        "optimizer": {"type": "adamw", "lr": lr, "weight_decay": 0.1, "beta1": 0.9,
                      "beta2": 0.99, "eps": 1e-8, "clip_grad_norm": clip,
                      "schedule": {"type": "cosine", "warmup": min(2, steps),
                                   "min_lr_ratio": 0.1}},
        "distributed": {"backend": "gloo", "check_every": 0},
        "checkpoint": {"every": 1, "keep": steps + 1},
        "eval": {"every": 0},
        "log": {"every": 1},
    }


def setup_mlp(args, scratch, name):
    """MLP 16-32-32-4 on 48 samples of Gaussian clusters (the whole set is each step's batch)."""
    torch = args.torch
    activation = "gelu" if name == "mlp-gelu" else "relu"
    samples, features, classes = 48, 16, 4
    csv = os.path.join(scratch, "data.csv")
    write_csv(csv, samples, features, classes, seed=11)
    model = {"type": "mlp", "input": features, "hidden": [32, 32], "classes": classes,
             "activation": activation}
    recipe = base_recipe(name, model, {"type": "csv", "path": csv, "header": "no",
                                       "eval_fraction": 0.0}, samples, args.steps, 1e-2,
                         clip=2.0)
    x, y = read_csv(csv)
    batch = (torch.from_numpy(x), torch.from_numpy(y))
    widths = [features, 32, 32, classes]
    return {
        "recipe": recipe,
        "layout": mlp_layout(widths),
        "batch": batch,
        "loss": lambda params: mlp_loss(torch, params, batch, widths, activation),
        "describe": f"mlp {'-'.join(map(str, widths))} {activation}, {samples} samples "
                    f"x {features} features (whole set each step)",
    }


def setup_gpt(args, scratch, name):
    """GPT 2 layers, width 64, 4 heads, context 32, vocab 72 (char tokenizer), on every window
    of a generated text (the whole set is each step's batch)."""
    torch = args.torch
    context, windows = 32, 48
    text = os.path.join(scratch, "text.txt")
    write_text(text, windows + context, seed=13)
    dataset = os.path.join(scratch, "tokens")
    prepared = benchlib.run_json(
        [args.dptrain, "data", "prepare", "--text", text, "--out", dataset, "--tokenizer",
         "char", "--val-fraction", "0", "--json"], "dptrain data prepare", args.timeout)
    tokens, vocab = read_token_file(os.path.join(dataset, "train.bin"))
    if vocab != prepared["vocab"] or tokens.size != windows + context:
        raise ParityError(f"{dataset}: vocab {vocab} / {tokens.size} tokens, expected "
                          f"{prepared['vocab']} / {windows + context}")
    model = {"type": "gpt", "vocab": int(vocab), "context": context, "layers": 2, "heads": 4,
             "width": 64, "mlp_ratio": 4}
    # Window i is tokens[i : i + context + 1]: inputs its first context, targets its last.
    starts = torch.arange(windows).unsqueeze(1) + torch.arange(context + 1).unsqueeze(0)
    win = torch.from_numpy(tokens)[starts]
    batch = (win[:, :-1].contiguous(), win[:, 1:].contiguous())
    recipe = base_recipe(name, model, {"type": "tokens", "path": dataset}, windows, args.steps,
                         3e-3, clip=2.0)
    return {
        "recipe": recipe,
        "layout": gpt_layout(model),
        "batch": batch,
        "loss": lambda params: gpt_loss(torch, params, batch, model),
        "describe": f"gpt 2 layers, 4 heads, width 64, context {context}, vocab {vocab}, mlp x4; "
                    f"{windows} windows of {context + 1} tokens (every window each step)",
    }


SETUPS = {"mlp": setup_mlp, "mlp-gelu": setup_mlp, "gpt": setup_gpt}


# ---------------------------------------------------------------------------------------------
# dptrain's side
# ---------------------------------------------------------------------------------------------


def run_dptrain(args, recipe, scratch, tag):
    """Runs the recipe on one rank; returns the run directory."""
    recipe_path = benchlib.write_json(os.path.join(scratch, f"{tag}.json"), recipe, indent=2)
    run_dir = os.path.join(scratch, f"run-{tag}")
    benchlib.run_json([args.dptrain, "launch", recipe_path, "--nproc", "1", "--run-dir", run_dir,
                       "--json"], f"dptrain launch ({tag})", args.timeout)
    return run_dir


def resolved(args, recipe, scratch):
    path = benchlib.write_json(os.path.join(scratch, "show.json"), recipe)
    command = [args.dptrain, "recipe", "show", path]
    stdout, _ = benchlib.run_command(command, "dptrain recipe show", args.timeout)
    return benchlib.last_json(stdout, "dptrain recipe show", command)


def read_blob(run_dir, step, blob, count):
    import numpy as np
    path = os.path.join(run_dir, "checkpoints", f"step-{step:06d}", blob)
    data = np.fromfile(path, dtype="<f4")
    if data.size != count:
        raise ParityError(f"{path}: {data.size} floats, expected {count}")
    return data


def read_metrics(run_dir, steps):
    by_step = {}
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                by_step[row["step"]] = row
    missing = [k for k in range(1, steps + 1) if k not in by_step]
    if missing:
        raise ParityError(f"{run_dir}/metrics.jsonl: no line for steps {missing}")
    return by_step


def dptrain_side(args, setup, scratch):
    """Initial parameters (a 0-step run), then N steps with a checkpoint after each."""
    n = layout_size(setup["layout"])
    init = dict(setup["recipe"])
    init["train"] = dict(init["train"], steps=0)
    init["optimizer"] = dict(init["optimizer"], schedule={"type": "constant", "warmup": 0})
    init["checkpoint"] = {"every": 0, "keep": 1}
    run0 = run_dptrain(args, init, scratch, "init")
    run = run_dptrain(args, setup["recipe"], scratch, "train")
    steps = args.steps
    params = [read_blob(run0, 0, "params.bin", n)]
    moments = [None]
    for k in range(1, steps + 1):
        params.append(read_blob(run, k, "params.bin", n))
        mv = read_blob(run, k, "optimizer.bin", 2 * n)
        moments.append((mv[:n], mv[n:]))
    return {"params": params, "moments": moments, "metrics": read_metrics(run, steps)}


# ---------------------------------------------------------------------------------------------
# PyTorch's side
# ---------------------------------------------------------------------------------------------


def learning_rate(opt, step, total):
    """core/optim/optimizer.hpp's learning_rate for the 0-based step."""
    sched = opt["schedule"]
    warmup, lr = sched.get("warmup", 0), opt["lr"]
    if step < warmup:
        return lr * (step + 1) / (warmup + 1)
    decay_steps = total - 1 - warmup  # lr at step `warmup`, the minimum at the last step
    if sched["type"] == "constant" or decay_steps <= 0:
        return lr
    progress = min(1.0, (step - warmup) / decay_steps)
    remaining = (0.5 * (1.0 + math.cos(math.pi * progress)) if sched["type"] == "cosine"
                 else 1.0 - progress)
    min_lr = lr * sched.get("min_lr_ratio", 0.0)
    return min_lr + (lr - min_lr) * remaining


class TorchTrainer:
    """The model's parameters as named leaves of one dtype, torch.optim.AdamW over them (weight
    decay on the weights and embeddings only), and one training step."""

    def __init__(self, torch, setup, opt, flat, dtype, moments=None, optimizer_steps=0):
        self.torch, self.setup, self.opt, self.dtype = torch, setup, opt, dtype
        self.params = split_flat(torch, flat, setup["layout"], dtype)
        for p in self.params.values():
            p.requires_grad_(True)
        decay = [self.params[name] for name, _, d in setup["layout"] if d]
        no_decay = [self.params[name] for name, _, d in setup["layout"] if not d]
        self.adamw = torch.optim.AdamW(
            [{"params": decay, "weight_decay": opt["weight_decay"]},
             {"params": no_decay, "weight_decay": 0.0}],
            lr=opt["lr"], betas=(opt["beta1"], opt["beta2"]), eps=opt["eps"], foreach=False)
        if moments is not None:
            m = split_flat(torch, moments[0], setup["layout"], dtype)
            v = split_flat(torch, moments[1], setup["layout"], dtype)
            for name, p in self.params.items():
                self.adamw.state[p] = {"step": torch.tensor(float(optimizer_steps)),
                                       "exp_avg": m[name], "exp_avg_sq": v[name]}

    def loss_and_grads(self):
        """The loss and the gradient norm (before clipping) at the current parameters."""
        for p in self.params.values():
            p.grad = None
        loss = self.setup["loss"](self.params)
        loss.backward()
        norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in self.params.values()))
        return float(loss), norm

    def step(self, lr):
        """One step at rate lr: returns (loss, gradient norm before clipping)."""
        loss, norm = self.loss_and_grads()
        max_norm = self.opt["clip_grad_norm"]
        if max_norm > 0 and norm > max_norm:  # dptrain's rule (no + 1e-6 as clip_grad_norm_)
            with self.torch.no_grad():
                for p in self.params.values():
                    p.grad.mul_(max_norm / norm)
        for group in self.adamw.param_groups:
            group["lr"] = lr
        self.adamw.step()
        return loss, norm

    def tensors(self, what):
        """{name: float64 tensor} of the parameters, or of AdamW's m or v."""
        if what == "params":
            return {n: p.detach().double() for n, p in self.params.items()}
        key = {"m": "exp_avg", "v": "exp_avg_sq"}[what]
        return {n: self.adamw.state[p][key].double() for n, p in self.params.items()}


def adamw_formula(opt, layout, p, m, v, lr, t):
    """{name: p_t} by PyTorch's AdamW (torch/optim/adamw.py, _single_tensor_adamw) in float64,
    from p_(t-1) and the moments m_t, v_t already updated with the step's gradient:
    p * (1 - lr * wd) - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)."""
    bc1, bc2 = 1.0 - opt["beta1"] ** t, 1.0 - opt["beta2"] ** t
    out = {}
    for name, _, decay in layout:
        wd = opt["weight_decay"] if decay else 0.0
        out[name] = (p[name] * (1.0 - lr * wd)
                     - (lr / bc1) * m[name] / (v[name].sqrt() / math.sqrt(bc2) + opt["eps"]))
    return out


F32_EPS = 2.0 ** -23


def f32_units(a, ref, before):
    """Max over elements of |a - ref| in float32 roundings of the operands of p_k = p_(k-1) *
    decay - update: |a - ref| / (2^-23 (|p_(k-1)| + |p_k - p_(k-1)|)). A few units is what
    computing the formula in float32 leaves."""
    scale = F32_EPS * ((before.abs() + (ref - before).abs()).clamp_min(1e-30))
    return float(((a - ref).abs() / scale).max()) if ref.numel() else 0.0


def rel(a, ref):
    """Max relative difference of a against ref: max |a - ref| / max |ref|."""
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    diff = float((a - ref).abs().max()) if ref.numel() else 0.0
    if scale == 0.0:
        return 0.0 if diff == 0.0 else math.inf
    return diff / scale


def rel_scalar(a, ref):
    return abs(a - ref) / abs(ref) if ref != 0 else (0.0 if a == ref else math.inf)


def named(torch, setup, flat):
    return split_flat(torch, flat, setup["layout"], torch.float64)


def compare_model(args, name):
    torch = args.torch
    with tempfile.TemporaryDirectory(prefix=f"dptrain-parity-{name}-") as scratch:
        if args.keep:
            scratch = os.path.join(args.keep, name)
            shutil.rmtree(scratch, ignore_errors=True)
            os.makedirs(scratch)
        setup = SETUPS[name](args, scratch, name)
        recipe = resolved(args, setup["recipe"], scratch)
        log(f"{name}: {setup['describe']}")
        dp = dptrain_side(args, setup, scratch)
    opt, steps = recipe["optimizer"], args.steps
    layout = setup["layout"]
    lrs = [learning_rate(opt, k, steps) for k in range(steps)]
    f64, f32 = torch.float64, torch.float32

    result = {"model": name, "describe": setup["describe"], "parameters": layout_size(layout),
              "steps": steps, "lr": lrs, "optimizer": opt, "checks": [], "tensors": []}

    # Which steps dptrain clipped (norm above clip_grad_norm): the one-step checks cover clipping
    # only if some did.
    result["clipped_steps"] = [k for k in range(1, steps + 1)
                               if 0 < opt["clip_grad_norm"] < dp["metrics"][k]["grad_norm"]]

    # 1 and 2: from dptrain's state before each step, one PyTorch step in float64 and float32.
    per_tensor = {n: {} for n, _, _ in layout}
    worst = {key: [0.0, 0.0] for key in ("loss", "grad_norm", "grad", "v", "update", "adamw")}
    worst_lr = max(rel_scalar(dp["metrics"][k + 1]["lr"], lrs[k]) for k in range(steps))

    def keep_worst(key, index, value):
        worst[key][index] = max(worst[key][index], value)

    for k in range(1, steps + 1):
        before = dp["params"][k - 1]
        state = dp["moments"][k - 1]
        dp_after = named(torch, setup, dp["params"][k])
        dp_before = named(torch, setup, before)
        dp_m = named(torch, setup, dp["moments"][k][0])
        dp_v = named(torch, setup, dp["moments"][k][1])
        logged = dp["metrics"][k]
        outcomes = {}
        for index, dtype in enumerate((f64, f32)):
            trainer = TorchTrainer(torch, setup, opt, before, dtype, state, k - 1)
            loss, norm = trainer.step(lrs[k - 1])
            outcomes[dtype] = (trainer, loss, norm)
        ref, ref_loss, ref_norm = outcomes[f64]
        t32, t32_loss, t32_norm = outcomes[f32]
        keep_worst("loss", 0, rel_scalar(logged["loss"], ref_loss))
        keep_worst("loss", 1, rel_scalar(t32_loss, ref_loss))
        keep_worst("grad_norm", 0, rel_scalar(logged["grad_norm"], ref_norm))
        keep_worst("grad_norm", 1, rel_scalar(t32_norm, ref_norm))
        if k == 1:
            result["loss_step1"] = {"dptrain": logged["loss"], "torch64": ref_loss,
                                    "torch32": t32_loss}
            result["grad_norm_step1"] = {"dptrain": logged["grad_norm"], "torch64": ref_norm,
                                         "torch32": t32_norm}
        ref_p, ref_m, ref_v = ref.tensors("params"), ref.tensors("m"), ref.tensors("v")
        formula = adamw_formula(opt, layout, dp_before, dp_m, dp_v, lrs[k - 1], k)
        t32_p, t32_m, t32_v = t32.tensors("params"), t32.tensors("m"), t32.tensors("v")
        for n, _, _ in layout:
            ref_update = ref_p[n] - dp_before[n]
            values = {
                "grad": (rel(dp_m[n], ref_m[n]), rel(t32_m[n], ref_m[n])),
                "v": (rel(dp_v[n], ref_v[n]), rel(t32_v[n], ref_v[n])),
                "update": (rel(dp_after[n] - dp_before[n], ref_update),
                           rel(t32_p[n] - dp_before[n], ref_update)),
            }
            values["adamw"] = (f32_units(dp_after[n], formula[n], dp_before[n]), 0.0)
            for key, (d, t) in values.items():
                keep_worst(key, 0, d)
                keep_worst(key, 1, t)
                row = per_tensor[n]
                row[key] = max(row.get(key, 0.0), d)
                row[key + "_torch32"] = max(row.get(key + "_torch32", 0.0), t)
                if k == 1:
                    row[key + "_step1"] = d

    # 3: PyTorch on its own for N steps from the initial parameters.
    traj = {}
    for dtype in (f64, f32):
        trainer = TorchTrainer(torch, setup, opt, dp["params"][0], dtype)
        losses = [trainer.step(lrs[k])[0] for k in range(steps)]
        traj[dtype] = (trainer.tensors("params"), losses)
    p0 = named(torch, setup, dp["params"][0])
    pn = named(torch, setup, dp["params"][steps])
    worst_traj, worst_traj32 = 0.0, 0.0
    for n, shape, decay in layout:
        ref_change = traj[f64][0][n] - p0[n]
        d = rel(pn[n] - p0[n], ref_change)
        t = rel(traj[f32][0][n] - p0[n], ref_change)
        per_tensor[n]["traj"], per_tensor[n]["traj_torch32"] = d, t
        worst_traj, worst_traj32 = max(worst_traj, d), max(worst_traj32, t)
    loss_traj = max(rel_scalar(dp["metrics"][k + 1]["loss"], traj[f64][1][k])
                    for k in range(steps))
    loss_traj32 = max(rel_scalar(traj[f32][1][k], traj[f64][1][k]) for k in range(steps))
    result["losses"] = {"dptrain": [dp["metrics"][k]["loss"] for k in range(1, steps + 1)],
                        "torch64": traj[f64][1], "torch32": traj[f32][1]}

    def check(key, what, dptrain_value, torch32_value):
        tol = TOLERANCES[key]
        result["checks"].append({"check": key, "what": what, "dptrain": dptrain_value,
                                 "torch32": torch32_value, "tolerance": tol,
                                 "ok": dptrain_value <= tol})

    check("loss", f"loss, steps 1-{steps}, from dptrain's parameters", *worst["loss"])
    check("grad_norm", f"gradient norm, steps 1-{steps}, from dptrain's parameters",
          *worst["grad_norm"])
    check("grad", "AdamW m (clipped gradient) after one step from dptrain's state, worst tensor",
          *worst["grad"])
    check("v", "AdamW v after one step from dptrain's state, worst tensor", *worst["v"])
    check("lr", f"learning rate, steps 1-{steps} (metrics.jsonl vs the schedule's formula)",
          worst_lr, None)
    check("adamw", "p_k vs AdamW's formula on dptrain's own p_(k-1), m_k, v_k, in float32 "
          "roundings", worst["adamw"][0], None)
    check("update", "update p_k - p_(k-1) from dptrain's state, worst tensor", *worst["update"])
    check("loss_traj", f"loss, steps 1-{steps}, each side training on its own", loss_traj,
          loss_traj32)
    check("traj", f"p_{steps} - p_0, each side training on its own, worst tensor", worst_traj,
          worst_traj32)
    for n, shape, decay in layout:
        result["tensors"].append({"tensor": n, "shape": list(shape), "decay": decay,
                                  **per_tensor[n]})
    result["ok"] = all(c["ok"] for c in result["checks"])
    return result


# ---------------------------------------------------------------------------------------------
# Output and main
# ---------------------------------------------------------------------------------------------


def fmt(value):
    if value is None:
        return "-"
    return f"{value:.1e}" if value else "0"


def print_table(report):
    print("# dptrain model parity against PyTorch (CPU): max relative differences, "
          "reference PyTorch float64")
    print(f"# versions: dptrain {report['versions']['dptrain']}, torch "
          f"{report['versions']['torch']} (Python {report['versions']['python']}); "
          f"{report['steps']} steps")
    for r in report["models"]:
        print("#")
        print(f"# {r['model']}: {r['describe']}, {r['parameters']} parameters")
        opt = r["optimizer"]
        print(f"#   adamw lr {opt['lr']} betas ({opt['beta1']}, {opt['beta2']}) eps {opt['eps']} "
              f"wd {opt['weight_decay']}, {opt['schedule']['type']} schedule warm-up "
              f"{opt['schedule']['warmup']} min_lr_ratio {opt['schedule']['min_lr_ratio']}, "
              f"clip {opt['clip_grad_norm']} (clipped at steps {r['clipped_steps'] or 'none'})")
        s1 = r["loss_step1"]
        print(f"#   loss at step 1: dptrain {s1['dptrain']:.9f}, torch f64 {s1['torch64']:.9f}; "
              f"losses step 1-{r['steps']} dptrain "
              + " ".join(f"{v:.5f}" for v in r["losses"]["dptrain"]))
        print(f"#   {'check':<10} {'dptrain':>9} {'torch f32':>9} {'tol':>8}  result  what")
        for c in r["checks"]:
            print(f"    {c['check']:<10} {fmt(c['dptrain']):>9} {fmt(c['torch32']):>9} "
                  f"{c['tolerance']:>8.0e}  {'ok' if c['ok'] else 'FAIL':<6}  {c['what']}")
        print(f"#   per tensor, dptrain vs torch f64 (grad, v, update: worst of the {r['steps']} "
              f"one-step checks; traj: p_N - p_0; t32: torch f32 vs f64)")
        print(f"#   {'tensor':<18} {'shape':<10} {'grad':>8} {'v':>8} {'update':>8} {'traj':>8}"
              f" {'grad t32':>8} {'traj t32':>8}")
        for t in r["tensors"]:
            shape = "x".join(map(str, t["shape"]))
            print(f"    {t['tensor']:<18} {shape:<10} {fmt(t['grad']):>8} {fmt(t['v']):>8} "
                  f"{fmt(t['update']):>8} {fmt(t['traj']):>8} {fmt(t['grad_torch32']):>8} "
                  f"{fmt(t['traj_torch32']):>8}")
    print("#")
    print(f"# {'PASS' if report['ok'] else 'FAIL'}")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--binary", "--dptrain", dest="dptrain", default=benchlib.DEFAULT_DPTRAIN,
                        help="the dptrain binary (default: %(default)s)")
    parser.add_argument("--torch-python", default=benchlib.DEFAULT_TORCH_PYTHON,
                        help="interpreter with torch and numpy, used when this one lacks them "
                             "(default: %(default)s)")
    parser.add_argument("--models", default=",".join(MODELS),
                        help="comma-separated, of " + ", ".join(MODELS) + " (default: all)")
    parser.add_argument("--steps", type=int, default=6, help="training steps (default: 6)")
    parser.add_argument("--keep", help="keep the data, recipes and runs under this folder")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per dptrain run")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    args.models = [m for m in args.models.split(",") if m]
    unknown = [m for m in args.models if m not in MODELS]
    if unknown or not args.models:
        parser.error(f"--models: unknown {unknown}; choose from {', '.join(MODELS)}")
    if args.steps < 1:
        parser.error("--steps: must be at least 1")
    return args


def import_torch(args):
    """torch and numpy, from this interpreter or by re-running under --torch-python."""
    try:
        import numpy  # noqa: F401  (needed by the loaders; imported here to check)
        import torch
        return torch
    except ImportError as e:
        same = os.path.realpath(sys.executable) == os.path.realpath(args.torch_python)
        if same or os.environ.get("DPTRAIN_PARITY_REEXEC") or not os.access(args.torch_python,
                                                                           os.X_OK):
            raise ParityError(f"{sys.executable} cannot import torch and numpy ({e}); install "
                              f"Debian's python3-torch or pass --torch-python PATH",
                              exit_code=2) from e
    os.environ["DPTRAIN_PARITY_REEXEC"] = "1"
    os.execv(args.torch_python, [args.torch_python, os.path.abspath(__file__), *sys.argv[1:]])
    return None  # not reached


def main():
    args = parse_args()
    try:
        if not os.path.isfile(args.dptrain) or not os.access(args.dptrain, os.X_OK):
            raise ParityError(f"{args.dptrain}: no dptrain binary; build it (make build) or pass "
                              f"--binary PATH", exit_code=2)
        if args.keep:
            os.makedirs(args.keep, exist_ok=True)
        torch = import_torch(args)
        torch.set_num_threads(1)
        torch.manual_seed(0)
        args.torch = torch
        import platform
        report = {"versions": {"dptrain": benchlib.dptrain_version(args.dptrain),
                               "torch": torch.__version__,
                               "python": platform.python_version()},
                  "machine": benchlib.machine(), "steps": args.steps, "tolerances": TOLERANCES,
                  "models": [compare_model(args, name) for name in args.models]}
    except (ParityError, benchlib.BenchError) as e:
        print(f"model_parity: {e}", file=sys.stderr)
        return e.exit_code
    report["ok"] = all(r["ok"] for r in report["models"])
    benchlib.emit(report, args.json, print_table)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
