#!/usr/bin/python3
"""PyTorch DDP (Gloo, CPU) peer of `dptrain launch RECIPE --json`: the recipe's MLP on N ranks.

Usage:
  /usr/bin/python3 bench/mlp_ddp_peer.py RECIPE --nproc N [--json]

It reads the same recipe file as dptrain, so both sides train the same model on the same kind of
data with the same optimizer, and it answers with the same JSON fields dptrain's launcher prints:
samples_per_s, world_size, steps, final_loss (plus warmup_steps, timed_s and versions).

The launcher mode spawns one process per rank itself (torchrun does not work under Debian's
Python 3.11) with MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE in the environment; with --worker the
script is one rank and reads those variables, so it also runs under an external launcher.
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time

# Recipe defaults the peer relies on; they mirror core/recipe.hpp.
DEFAULTS = {
    "seed": 1,
    "model": {"type": "mlp", "input": 784, "hidden": [256, 256], "classes": 10,
              "activation": "relu"},
    "data": {"type": "synthetic-classification", "samples": 60000, "noise": 1.0,
             "eval_fraction": 0.1},
    "train": {"steps": 500, "batch_per_rank": 64, "grad_accum": 1, "precision": "fp32",
              "threads_per_rank": 1},
    "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.0, "momentum": 0.9,
                  "nesterov": False, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8,
                  "schedule": {"type": "cosine"}, "clip_grad_norm": 0.0},
    "distributed": {"sync": "allreduce", "compression": {"type": "none"}, "timeout_s": 300.0},
}


class PeerError(Exception):
    """A problem the user can fix (bad recipe, bad arguments); printed as one line."""


def with_defaults(defaults, given):
    merged = dict(defaults)
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            merged[key] = with_defaults(defaults[key], value)
        else:
            merged[key] = value
    return merged


def load_recipe(path):
    try:
        with open(path, encoding="utf-8") as f:
            recipe = with_defaults(DEFAULTS, json.load(f))
    except (OSError, ValueError) as e:
        raise PeerError(f"{path}: cannot read the recipe: {e}") from e
    # The peer mirrors only what this benchmark needs; anything else would silently compare
    # different work, so it is refused.
    supported = [
        ("/model/type", recipe["model"]["type"], {"mlp"}),
        ("/model/activation", recipe["model"]["activation"], {"relu", "gelu"}),
        ("/data/type", recipe["data"]["type"], {"synthetic-classification"}),
        ("/train/grad_accum", recipe["train"]["grad_accum"], {1}),
        ("/train/precision", recipe["train"]["precision"], {"fp32"}),
        ("/optimizer/type", recipe["optimizer"]["type"], {"adamw", "sgd"}),
        ("/optimizer/schedule/type", recipe["optimizer"]["schedule"]["type"], {"constant"}),
        ("/distributed/sync", recipe["distributed"]["sync"], {"allreduce"}),
        ("/distributed/compression/type", recipe["distributed"]["compression"]["type"], {"none"}),
    ]
    problems = [f"{path}: {pointer}: the PyTorch peer supports only {sorted(allowed)}, "
                f"not {value!r}"
                for pointer, value, allowed in supported if value not in allowed]
    if problems:
        raise PeerError("\n".join(problems))
    return recipe


def warmup_steps(steps):
    # The same rule as dptrain's samples_per_s: the first min(10, steps/5) steps are excluded.
    return min(10, steps // 5)


def make_dataset(recipe, torch):
    """Gaussian class clusters; all in memory so indexing is the only data cost."""
    data, model = recipe["data"], recipe["model"]
    gen = torch.Generator().manual_seed(int(recipe["seed"]))
    # Centres spread like dptrain's (core/data/dataset.cpp): ~3.5 noise units apart whatever the
    # feature count, so the task is as hard on both sides and the final losses are comparable.
    centres = torch.randn(model["classes"], model["input"], generator=gen)
    centres *= 3.5 / model["input"] ** 0.5
    labels = torch.randint(model["classes"], (data["samples"],), generator=gen)
    features = centres[labels] + data["noise"] * torch.randn(data["samples"], model["input"],
                                                             generator=gen)
    train_count = data["samples"] - round(data["samples"] * data["eval_fraction"])
    return features[:train_count].contiguous(), labels[:train_count].contiguous()


def make_model(recipe, nn):
    spec = recipe["model"]
    activation = nn.ReLU if spec["activation"] == "relu" else nn.GELU
    layers, width = [], spec["input"]
    for hidden in spec["hidden"]:
        layers += [nn.Linear(width, hidden), activation()]
        width = hidden
    layers.append(nn.Linear(width, spec["classes"]))
    return nn.Sequential(*layers)


def make_optimizer(recipe, params, torch):
    spec = recipe["optimizer"]
    if spec["type"] == "adamw":
        # Pass weight_decay explicitly: torch's AdamW default (0.01) differs from the recipe's (0).
        return torch.optim.AdamW(params, lr=spec["lr"], betas=(spec["beta1"], spec["beta2"]),
                                 eps=spec["eps"], weight_decay=spec["weight_decay"])
    return torch.optim.SGD(params, lr=spec["lr"], momentum=spec["momentum"],
                           nesterov=spec["nesterov"], weight_decay=spec["weight_decay"])


def run_rank(recipe):
    """One rank: trains, and rank 0 prints one JSON line with the global throughput."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(int(recipe["train"]["threads_per_rank"]))
    torch.set_num_interop_threads(1)
    timeout = datetime.timedelta(seconds=float(recipe["distributed"]["timeout_s"]))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(int(recipe["seed"]))  # the same initial weights on every rank
    features, labels = make_dataset(recipe, torch)
    model = DistributedDataParallel(make_model(recipe, nn))
    optimizer = make_optimizer(recipe, model.parameters(), torch)
    loss_fn = nn.CrossEntropyLoss()
    clip = float(recipe["optimizer"]["clip_grad_norm"])
    batch_gen = torch.Generator().manual_seed(int(recipe["seed"]) * 1000003 + rank)

    steps, batch = int(recipe["train"]["steps"]), int(recipe["train"]["batch_per_rank"])
    warmup = warmup_steps(steps)
    if steps <= warmup or steps < 1:
        raise PeerError(f"/train/steps: {steps} leaves no timed steps after {warmup} warm-up steps")
    started = None
    for step in range(steps):
        if step == warmup:
            dist.barrier()
            started = time.perf_counter()
        index = torch.randint(features.shape[0], (batch,), generator=batch_gen)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(features[index]), labels[index])
        loss.backward()
        if clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
    dist.barrier()
    timed_s = time.perf_counter() - started

    final_loss = loss.detach().clone()
    dist.all_reduce(final_loss)
    if rank == 0:
        print(json.dumps({
            "samples_per_s": world * batch * (steps - warmup) / timed_s,
            "world_size": world,
            "steps": steps,
            "warmup_steps": warmup,
            "timed_s": timed_s,
            "final_loss": final_loss.item() / world,
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
        }), flush=True)
    dist.destroy_process_group()


def free_port():
    # The port is free now; the tiny window before rank 0 binds it is acceptable on a test box.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_all(ranks, timeout_s, port):
    """Waits for every rank; the first one to fail stops the others rather than leave them hung."""
    deadline = time.monotonic() + timeout_s
    while True:
        codes = [proc.poll() for proc in ranks]
        failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            rank, code = failed[0]
            raise PeerError(f"rank {rank} of {len(ranks)} exited with status {code} (port {port})")
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            raise PeerError(f"the {len(ranks)} ranks did not finish within {timeout_s:.0f} s "
                            f"(port {port})")
        time.sleep(0.05)


def launch(recipe_path, nproc, timeout_s):
    """Spawns nproc ranks of this script; returns rank 0's JSON result. Stops all on failure."""
    port = free_port()
    ranks = []
    with tempfile.TemporaryFile(mode="w+") as result_file:
        try:
            for rank in range(nproc):
                env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           RANK=str(rank), WORLD_SIZE=str(nproc), LOCAL_RANK=str(rank),
                           OMP_NUM_THREADS="1")
                # Only rank 0's stdout carries the result; the others' goes to stderr with the logs.
                ranks.append(subprocess.Popen(
                    [sys.executable, os.path.abspath(__file__), recipe_path, "--worker"],
                    env=env, stdout=result_file if rank == 0 else sys.stderr))
            wait_all(ranks, timeout_s, port)
        finally:
            for proc in ranks:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        result_file.seek(0)
        lines = [line for line in result_file.read().splitlines() if line.strip()]
    if not lines:
        raise PeerError(f"rank 0 of {nproc} printed no result")
    return json.loads(lines[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe", help="dptrain JSON recipe (the fields in DEFAULTS are mirrored)")
    parser.add_argument("--nproc", type=int, default=1, help="local ranks (default 1)")
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--worker", action="store_true",
                        help="be one rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)")
    args = parser.parse_args()
    try:
        recipe = load_recipe(args.recipe)
        if args.worker:
            run_rank(recipe)
            return 0
        if importlib.util.find_spec("torch") is None:
            raise ImportError("No module named 'torch'")
        # Turn SIGTERM into an exception so launch() still stops the ranks it started.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        if args.nproc < 1:
            raise PeerError(f"--nproc: must be at least 1, not {args.nproc}")
        result = launch(args.recipe, args.nproc, args.timeout)
    except PeerError as e:
        print(f"mlp_ddp_peer: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"mlp_ddp_peer: {sys.executable} cannot import PyTorch ({e}); "
              "run it with /usr/bin/python3 (Debian's python3-torch)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        print(f"PyTorch DDP, {result['world_size']} rank(s): "
              f"{result['samples_per_s']:.0f} samples/s, final loss {result['final_loss']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
