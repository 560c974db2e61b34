#!/usr/bin/python3
"""PyTorch (Gloo, CPU) peer of ddp_levers.py: the recipe's MLP with and without overlap.

Usage:
  /usr/bin/python3 bench/overlap_ddp_peer.py RECIPE --nproc 2 --mode ddp|sequential [--json]

Both modes train the MLP of `mlp_ddp_peer.py` (same data, model and optimizer) with gradients in
buckets of the recipe's /distributed/bucket_mb (MiB of float32 values):

- ddp: DistributedDataParallel with bucket_cap_mb = bucket_mb, and the first bucket capped at the
  same size (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES; DDP's own 1 MiB default would put all
  of a 1 MiB model into one bucket and leave nothing to overlap). A bucket's all-reduce starts
  from an autograd hook as soon as the backward pass has produced its gradients.
- sequential: the same model without DDP: the whole backward pass first, then per bucket (the
  buckets dptrain makes: whole tensors, last layers first, a bucket closes once it holds
  bucket_mb or more) flatten, dist.all_reduce, divide by the world size, copy back; then the
  optimizer step.

The result is the JSON line of `dptrain launch --json` (samples_per_s, world_size, steps,
final_loss) plus the mode, the bucket sizes in values, and the mean milliseconds per step on
rank 0 of forward, backward (with DDP: including its overlapped all-reduce), the separate
all-reduce (sequential only) and the optimizer step. Like the other peers it spawns one process
per rank with MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE in the environment and one thread
per rank; --worker is one rank.
"""

import argparse
import os
import sys
import time

import benchlib
import mlp_ddp_peer

MODES = ("ddp", "sequential")
DEFAULTS = benchlib.with_defaults(mlp_ddp_peer.DEFAULTS,
                                  {"distributed": {"bucket_mb": 25.0, "overlap": True}})


def load_recipe(path):
    return benchlib.load_peer_recipe(path, DEFAULTS, mlp_ddp_peer.supported)


def bucket_elements(bucket_mb):
    """dptrain's bucket_elements(): bucket_mb MiB of float32 values, at least 1."""
    values = bucket_mb * 1024 * 1024 / 4
    return 1 if values < 1 else round(values)


def make_buckets(params, bucket_elems):
    """dptrain's make_buckets(): whole tensors from the last one back; a bucket closes once it
    holds bucket_elems values or more. Returns lists of parameters, the first bucket first."""
    buckets, bucket, size = [], [], 0
    for param in reversed(params):
        bucket.append(param)
        size += param.numel()
        if size >= bucket_elems:
            buckets.append(bucket)
            bucket, size = [], 0
    if bucket:
        buckets.append(bucket)
    return buckets


def run_rank(recipe, mode):
    torch, dist, rank, world = benchlib.init_rank(recipe["train"]["threads_per_rank"],
                                                  recipe["distributed"]["timeout_s"])
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(int(recipe["seed"]))  # the same initial weights on every rank
    features, labels = mlp_ddp_peer.make_dataset(recipe, torch)
    module = mlp_ddp_peer.make_model(recipe, nn)
    bucket_mb = float(recipe["distributed"]["bucket_mb"])
    bucket_elems = bucket_elements(bucket_mb)
    buckets = make_buckets(list(module.parameters()), bucket_elems)
    if mode == "ddp":
        # DDP rebuilds its buckets after the first step with [first bucket, bucket_cap] limits;
        # the first bucket's limit is read once, when the Reducer is made.
        dist._DEFAULT_FIRST_BUCKET_BYTES = bucket_elems * 4
        model = DistributedDataParallel(module, bucket_cap_mb=bucket_mb)
    else:
        model = module
        for param in module.parameters():  # what DDP does at construction
            dist.broadcast(param.data, 0)
    optimizer = mlp_ddp_peer.make_optimizer(recipe, model.parameters(), torch)
    loss_fn = nn.CrossEntropyLoss()
    clip = float(recipe["optimizer"]["clip_grad_norm"])
    batch_gen = torch.Generator().manual_seed(int(recipe["seed"]) * 1000003 + rank)
    steps, batch = int(recipe["train"]["steps"]), int(recipe["train"]["batch_per_rank"])
    totals = {"forward": 0.0, "backward": 0.0, "allreduce": 0.0, "optimizer": 0.0}
    timing = [False]

    def allreduce_buckets():
        for bucket in buckets:
            grads = [p.grad for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat /= world
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def step(_):
        t0 = time.perf_counter()
        index = torch.randint(features.shape[0], (batch,), generator=batch_gen)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(features[index]), labels[index])
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if mode == "sequential":
            allreduce_buckets()
        t3 = time.perf_counter()
        if clip > 0:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        t4 = time.perf_counter()
        if timing[0]:
            totals["forward"] += (t1 - t0) * 1e3
            totals["backward"] += (t2 - t1) * 1e3
            totals["allreduce"] += (t3 - t2) * 1e3
            totals["optimizer"] += (t4 - t3) * 1e3
        return loss

    def start_timing():
        timing[0] = True

    loss, warmup, timed_s = benchlib.timed_loop(dist, steps, step, start_timing)
    timed = steps - warmup
    extra = {"mode": mode, "bucket_mb": bucket_mb,
             "buckets": [sum(p.numel() for p in b) for b in buckets],
             **{f"{key}_ms": value / timed for key, value in totals.items()}}
    if mode == "ddp":
        # The buckets DDP settled on when it rebuilt them after the first step (bytes).
        sizes = str(model._get_ddp_logging_data().get("rebuilt_bucket_sizes", ""))
        extra["buckets"] = [int(s) // 4 for s in sizes.split(",") if s.strip()]
    benchlib.finish_rank(torch, dist, loss, steps, warmup, batch, timed_s, extra=extra)


def summary(result):
    return (f"PyTorch {result['mode']}, {result['world_size']} rank(s), buckets "
            f"{result['buckets']}: {result['samples_per_s']:.0f} samples/s, "
            f"final loss {result['final_loss']:.4f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("recipe", help="dptrain JSON recipe (the fields in DEFAULTS are mirrored)")
    parser.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    parser.add_argument("--mode", choices=MODES, default="ddp",
                        help="ddp: DDP's overlapped buckets; sequential: backward, then the "
                             "buckets' all-reduce (default: %(default)s)")
    benchlib.add_peer_arguments(parser)
    args = parser.parse_args()
    return benchlib.run_peer(
        "overlap_ddp_peer", args, lambda: load_recipe(args.recipe),
        lambda recipe: run_rank(recipe, args.mode),
        lambda recipe: [os.path.abspath(__file__), args.recipe, "--mode", args.mode],
        lambda result: print(summary(result)))


if __name__ == "__main__":
    sys.exit(main())
