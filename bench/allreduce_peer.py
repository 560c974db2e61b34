#!/usr/bin/python3
"""PyTorch (Gloo, CPU) peer of `dptrain bench comm`: torch.distributed.all_reduce bandwidth.

Usage:
  /usr/bin/python3 bench/allreduce_peer.py --nproc 2 [-b 1M] [-e 64M] [-f 2] [-w 5] [-n 20] [--json]
  /usr/bin/python3 bench/allreduce_peer.py --nproc 2 --sizes 1048576,2097152 [...]

It measures the way `dptrain bench comm` does (core/bench/comm_bench.cpp), so the two tables can
be compared row by row. For each size: a float32 tensor of size/4 elements filled with a
rank-dependent pattern; -w untimed in-place sum all_reduce calls; a barrier; -n timed calls. The
time of one call is the elapsed time / n, the slowest rank's. algbw = size / time (GB/s of 1e9
bytes), busbw = algbw x 2(n-1)/n (the nccl-tests factor for allreduce). Then the tensor is filled
again, reduced once more and every element checked: `wrong` counts the elements, over all
ranks, that do not hold the exact sum.

Like the training peers, it spawns one process per rank itself with MASTER_ADDR, MASTER_PORT,
RANK and WORLD_SIZE in the environment and one thread per rank; --worker is one rank.
"""

import argparse
import json
import os
import sys
import time

import benchlib
from benchlib import PeerError

PATTERN_PERIOD = 17  # small integers: every sum over the ranks is exact in float32
UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text):
    """nccl-tests' sizes: a byte count with an optional K, M or G suffix (powers of 1024)."""
    text = text.strip().upper().removesuffix("B")
    unit = text[-1] if text and text[-1] in "KMG" else ""
    try:
        value = int(text[:len(text) - len(unit)]) * UNITS[unit]
    except ValueError as e:
        raise PeerError(f"{text!r}: not a size (a byte count, optionally with K, M or G)") from e
    if value < 4 or value % 4 != 0:
        raise PeerError(f"{text}: a size must be a positive multiple of 4 bytes (float32)")
    return value


def sizes_from(args):
    if args.sizes:
        return [parse_size(s) for s in args.sizes.split(",")]
    low, high = parse_size(args.minbytes), parse_size(args.maxbytes)
    if high < low or args.stepfactor < 2:
        raise PeerError("-e must not be below -b, and -f must be at least 2")
    sizes = []
    while low <= high:
        sizes.append(low)
        low *= args.stepfactor
    return sizes


def bus_factor(world):
    return 2.0 * (world - 1) / world


def run_rank(sizes, warmup, iters):
    """One rank: measures every size; rank 0 prints the rows as one JSON line."""
    torch, dist, rank, world = benchlib.init_rank(1, 300.0)

    def fill(count):
        return (torch.arange(count, dtype=torch.float32) % PATTERN_PERIOD) + (rank + 1)

    rows = []
    for size in sizes:
        count = size // 4
        tensor = fill(count)
        for _ in range(warmup):
            dist.all_reduce(tensor)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor)
        seconds = (time.perf_counter() - start) / iters
        tensor = fill(count)
        dist.all_reduce(tensor)
        expected = ((torch.arange(count, dtype=torch.float32) % PATTERN_PERIOD) * world
                    + world * (world + 1) // 2)
        wrong = torch.tensor([float((tensor != expected).sum())], dtype=torch.float64)
        slowest = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        dist.all_reduce(wrong)
        seconds = slowest.item()
        algbw = size / 1e9 / seconds
        rows.append({"op": "allreduce", "size": size, "count": count, "type": "float",
                     "redop": "sum", "time_us": seconds * 1e6, "algbw": algbw,
                     "busbw": algbw * bus_factor(world), "wrong": int(wrong.item())})
    if rank == 0:
        print(json.dumps({"benchmark": "comm", "ranks": world,
                          "backend": "gloo (torch.distributed)", "ops": ["allreduce"],
                          "dtype": "float32", "redop": "sum", "warmup": warmup, "iters": iters,
                          "rows": rows, "torch_version": torch.__version__}), flush=True)
    dist.destroy_process_group()
    benchlib.end_rank()


def print_table(result):
    print(f"# torch.distributed.all_reduce, Gloo, {result['ranks']} rank(s), float32 sum, "
          f"{result['warmup']} warm-up + {result['iters']} timed calls per size")
    print(f"# {'size':>10} {'count':>10} {'type':>6} {'redop':>6} {'time':>9} {'algbw':>7} "
          f"{'busbw':>7} {'#wrong':>7}")
    print(f"# {'(B)':>10} {'(elements)':>10} {'':>6} {'':>6} {'(us)':>9} {'(GB/s)':>7} "
          f"{'(GB/s)':>7} {'':>7}")
    for row in result["rows"]:
        print(f"  {row['size']:>10} {row['count']:>10} {row['type']:>6} {row['redop']:>6} "
              f"{row['time_us']:>9.1f} {row['algbw']:>7.3f} {row['busbw']:>7.3f} "
              f"{row['wrong']:>7}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=2, help="local ranks (default 2)")
    parser.add_argument("-b", "--minbytes", default="1M", help="smallest size (default 1M)")
    parser.add_argument("-e", "--maxbytes", default="64M", help="largest size (default 64M)")
    parser.add_argument("-f", "--stepfactor", type=int, default=2,
                        help="each size is the previous one times this (default 2)")
    parser.add_argument("--sizes", help="comma-separated sizes in bytes, instead of -b/-e/-f")
    parser.add_argument("-w", "--warmup", type=int, default=5,
                        help="untimed calls per size (default 5)")
    parser.add_argument("-n", "--iters", type=int, default=20,
                        help="timed calls per size (default 20)")
    benchlib.add_peer_arguments(parser)
    args = parser.parse_args()

    def prepare():
        if args.warmup < 0 or args.iters < 1:
            raise PeerError("-w must be at least 0 and -n at least 1")
        return sizes_from(args)

    return benchlib.run_peer(
        "allreduce_peer", args, prepare, lambda sizes: run_rank(sizes, args.warmup, args.iters),
        lambda sizes: [os.path.abspath(__file__), "--sizes", ",".join(map(str, sizes)), "-w",
                       str(args.warmup), "-n", str(args.iters)],
        print_table)


if __name__ == "__main__":
    sys.exit(main())
