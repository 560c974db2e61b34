#!/usr/bin/env python3
"""Compares dptrain's communication levers on 2 local CPU ranks (Gloo), and its overlap gain with
PyTorch DDP's on the same MLP.

Usage:
  python3 bench/ddp_levers.py [--reps 5] [--steps N] [--batch 256] [--bucket-mb 0.25] [--json]

dptrain trains the recipe (by default bench/mlp-784-256-256-10.json with 256 samples per rank and
0.25 MiB buckets) once per variant: the all-reduce without and with overlap, the compressions
fp16, bf16, int8, topk 1% and 5%, powersgd rank 4, local SGD every 8 steps, and ZeRO-1. PyTorch
trains the same MLP with DDP (overlapped buckets of the same size) and without it (backward
pass, then the same buckets all-reduced one after another: bench/overlap_ddp_peer.py). Every
repetition runs every variant once, in an order that rotates between repetitions, so load from
other users of a shared machine falls on all of them; the table has each variant's medians and
its speed against "allreduce, no overlap" of the same benchmark, then each side's overlap gain.
Needs a dptrain binary and Debian's python3-torch for /usr/bin/python3; only the standard library
is used here. See bench/README.md.
"""

import argparse
import datetime
import os
import shutil
import statistics
import sys

import benchlib
from benchlib import BENCH_DIR, REPO_DIR, BenchError

WORLD = 2
BASELINE = "allreduce"
# (id, label, what the variant sets under /distributed). Overlap stays on (the default) wherever
# it is not named: the compressions run on the communication thread too.
VARIANTS = [
    ("allreduce", "allreduce, no overlap", {"overlap": False}),
    ("overlap", "allreduce, overlap", {"overlap": True}),
    ("fp16", "fp16", {"compression": {"type": "fp16"}}),
    ("bf16", "bf16", {"compression": {"type": "bf16"}}),
    ("int8", "int8 (block 256)", {"compression": {"type": "int8", "block": 256}}),
    ("topk1", "topk 1%", {"compression": {"type": "topk", "ratio": 0.01}}),
    ("topk5", "topk 5%", {"compression": {"type": "topk", "ratio": 0.05}}),
    ("powersgd", "powersgd rank 4", {"compression": {"type": "powersgd", "rank": 4}}),
    ("localsgd", "local SGD period 8", {"sync": "local_sgd", "period": 8, "start": 0}),
    ("zero1", "ZeRO-1", {"zero": 1}),
]
# The PyTorch runs: (id, label, overlap_ddp_peer.py --mode).
PEERS = [
    ("torch-sequential", "PyTorch, no overlap", "sequential"),
    ("torch-ddp", "PyTorch DDP, overlap", "ddp"),
]
LABELS = {key: label for key, label, _ in VARIANTS + PEERS}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default=os.path.join(BENCH_DIR, "mlp-784-256-256-10.json"),
                        help="dptrain MLP recipe both sides train (default: %(default)s)")
    benchlib.add_binary_arguments(parser)
    parser.add_argument("--reps", type=int, default=5,
                        help="repetitions; medians are reported (default: %(default)s)")
    parser.add_argument("--steps", type=int, help="override the recipe's /train/steps")
    parser.add_argument("--batch", type=int, default=256,
                        help="/train/batch_per_rank (default: %(default)s)")
    parser.add_argument("--bucket-mb", type=float, default=0.25,
                        help="/distributed/bucket_mb, MiB, both sides (default: %(default)s)")
    every = ",".join(LABELS)
    parser.add_argument("--variants", default=every,
                        help=f"comma-separated subset of {every} (default: all); "
                             f"{BASELINE} is always run")
    benchlib.add_output_arguments(parser)
    parser.add_argument("--markdown", action="store_true",
                        help="print the tables as Markdown (for a README), not as text")
    args = parser.parse_args()
    chosen = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in chosen if v not in LABELS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; choose from {every}")
    args.variants = [key for key in LABELS if key in chosen or key == BASELINE]
    if args.reps < 1 or args.batch < 1 or args.bucket_mb <= 0:
        parser.error("--reps and --batch must be at least 1, --bucket-mb above 0")
    if args.steps is not None and args.steps < 5:
        parser.error("--steps must be at least 5 (the first steps/5, at most 10, are untimed)")
    return args


def base_recipe(args):
    """The recipe every run starts from: the file's, with the benchmark's batch, buckets and
    steps, evaluation only at the end, no checkpoints on the way."""
    recipe = benchlib.read_recipe(args.recipe)
    if recipe.get("model", {}).get("type", "mlp") != "mlp":
        raise BenchError(f"{args.recipe}: /model/type: the benchmark needs an mlp recipe (the "
                         f"PyTorch side mirrors only the MLP)", exit_code=2)
    train = recipe.setdefault("train", {})
    train["batch_per_rank"] = args.batch
    if args.steps is not None:
        train["steps"] = args.steps
    train.setdefault("threads_per_rank", 1)
    recipe["distributed"] = {**recipe.get("distributed", {}), "bucket_mb": args.bucket_mb,
                             "sync": "allreduce", "zero": 0, "overlap": True,
                             "compression": {"type": "none"}}
    recipe["eval"] = {**recipe.get("eval", {}), "every": 0}
    recipe["checkpoint"] = {**recipe.get("checkpoint", {}), "every": 0, "keep": 1}
    return recipe


def variant_recipe(recipe, changes):
    variant = dict(recipe)
    variant["distributed"] = {**recipe["distributed"], **changes}
    return variant


def write_recipes(args, recipe, scratch):
    """One recipe file per variant; the PyTorch side reads the baseline's (no compression)."""
    paths = {}
    for key, _, changes in VARIANTS:
        if key in args.variants:
            paths[key] = benchlib.write_json(os.path.join(scratch, f"{key}.json"),
                                             variant_recipe(recipe, changes), indent=2)
    for key, _, _ in PEERS:
        paths[key] = paths[BASELINE]
    return paths


def mlp_buckets(recipe, bucket_mb):
    """The buckets (values) dptrain makes of the MLP: whole tensors from the last layer back, a
    bucket closing at bucket_mb MiB or more (core/ddp/reducer.cpp)."""
    model = recipe.get("model", {})
    dims = [model.get("input", 784), *model.get("hidden", [256, 256]), model.get("classes", 10)]
    tensors = []
    for fan_in, fan_out in zip(dims, dims[1:]):
        tensors += [fan_in * fan_out, fan_out]
    limit = max(1, round(bucket_mb * 1024 * 1024 / 4))
    buckets, size = [], 0
    for count in reversed(tensors):
        size += count
        if size >= limit:
            buckets.append(size)
            size = 0
    if size:
        buckets.append(size)
    return buckets


def order_for(rep, reps, keys):
    """The variants of one repetition: rotated by a share of the list per repetition, reversed
    on odd ones, so no variant always runs first, last or after the same neighbour."""
    shift = rep * len(keys) // reps
    order = keys[shift:] + keys[:shift]
    return order[::-1] if rep % 2 else order


def run_once(key, args, paths, scratch, rep, global_batch):
    what = f"{LABELS[key]} (repetition {rep + 1})"
    if key.startswith("torch-"):
        mode = dict((k, m) for k, _, m in PEERS)[key]
        command = [*benchlib.peer_command(args, "overlap_ddp_peer.py", paths[key], WORLD),
                   "--mode", mode]
        result = benchlib.check_result(benchlib.run_json(command, what, args.timeout), what,
                                       WORLD)
        return {"step_ms": 1000.0 * global_batch / result["samples_per_s"],
                "samples_per_s": result["samples_per_s"], "final_loss": result["final_loss"],
                "forward_ms": result["forward_ms"], "backward_ms": result["backward_ms"],
                "allreduce_ms": result["allreduce_ms"], "optimizer_ms": result["optimizer_ms"],
                "buckets": result.get("buckets")}
    run_dir = os.path.join(scratch, f"run-{key}-r{rep}")
    result = benchlib.check_result(
        benchlib.run_json(benchlib.launch_command(args, paths[key], WORLD, run_dir), what,
                          args.timeout), what, WORLD)
    shutil.rmtree(run_dir, ignore_errors=True)
    phases = result.get("phases_ms", {})
    return {"step_ms": 1000.0 * global_batch / result["samples_per_s"],
            "samples_per_s": result["samples_per_s"],
            "data_ms": phases.get("data"), "compute_ms": phases.get("compute"),
            "comm_exposed_ms": phases.get("comm"), "optimizer_ms": phases.get("optimizer"),
            "comm_total_ms": result.get("comm_total_ms"),
            "bytes_per_step": result.get("bytes_per_step"),
            "optimizer_state_mib": result.get("optimizer_state_mib"),
            "peak_rss_mib": result.get("peak_rss_mib"),
            "eval_loss": result.get("eval_loss"), "final_loss": result.get("final_loss")}


def describe_run(run):
    text = f"step {run['step_ms']:6.2f} ms"
    if "comm_total_ms" in run:
        text += (f", compute {run['compute_ms']:.2f}, comm {run['comm_total_ms']:.2f} "
                 f"(exposed {run['comm_exposed_ms']:.2f}), eval loss {run['eval_loss']:.4f}")
    else:
        text += (f", backward {run['backward_ms']:.2f}, separate all-reduce "
                 f"{run['allreduce_ms']:.2f}, loss {run['final_loss']:.4f}")
    return text


def measure(args, paths, scratch, global_batch):
    runs = {key: [] for key in args.variants}
    total, done = args.reps * len(args.variants), 0
    for rep in range(args.reps):
        for key in order_for(rep, args.reps, args.variants):
            run = run_once(key, args, paths, scratch, rep, global_batch)
            runs[key].append(run)
            done += 1
            print(f"[{done}/{total}] {LABELS[key]:22} {describe_run(run)}", file=sys.stderr,
                  flush=True)
    return runs


def median_of(results, field):
    values = [r[field] for r in results if isinstance(r.get(field), (int, float))]
    return statistics.median(values) if values else None


def summarize(runs):
    """One row per variant: the median of every figure over the repetitions, the spread of the
    step time, and speed and bytes against the baseline's medians."""
    rows = {}
    for key, results in runs.items():
        row = {"variant": key, "label": LABELS[key]}
        for field in results[0]:
            if field != "buckets":
                row[field] = median_of(results, field)
        row["step_ms_spread"] = benchlib.spread([r["step_ms"] for r in results])
        row["step_ms_runs"] = [r["step_ms"] for r in results]
        if results[0].get("buckets"):
            row["buckets"] = results[0]["buckets"]
        rows[key] = row
    base = rows[BASELINE]
    for key, row in rows.items():
        if key.startswith("torch-"):
            continue  # PyTorch's speed is in the overlap gain, against its own sequential run
        row["speed_vs_baseline"] = base["step_ms"] / row["step_ms"]
        if row.get("bytes_per_step") and base.get("bytes_per_step"):
            row["bytes_vs_baseline"] = row["bytes_per_step"] / base["bytes_per_step"]
    return rows


def overlap_gains(rows):
    """Each side's step time without overlap / with overlap (> 1: overlap pays)."""
    gains = []
    for side, off, on in (("dptrain", "allreduce", "overlap"),
                          ("pytorch", "torch-sequential", "torch-ddp")):
        if off in rows and on in rows:
            gains.append({"side": side, "no_overlap_step_ms": rows[off]["step_ms"],
                          "overlap_step_ms": rows[on]["step_ms"],
                          "gain": rows[off]["step_ms"] / rows[on]["step_ms"],
                          "no_overlap_spread": rows[off]["step_ms_spread"],
                          "overlap_spread": rows[on]["step_ms_spread"]})
    return gains


def describe(recipe, args):
    model, train = recipe.get("model", {}), recipe["train"]
    optimizer = recipe.get("optimizer", {})
    dims = [model.get("input", 784), *model.get("hidden", [256, 256]), model.get("classes", 10)]
    steps = int(train.get("steps", 500))
    params = sum(a * b + b for a, b in zip(dims, dims[1:]))
    return {"model": "-".join(str(d) for d in dims) + " " + model.get("activation", "relu"),
            "parameters": params, "batch_per_rank": args.batch, "world_size": WORLD,
            "steps": steps, "warmup_steps": min(10, steps // 5), "bucket_mb": args.bucket_mb,
            "buckets": mlp_buckets(recipe, args.bucket_mb),
            "threads_per_rank": train.get("threads_per_rank", 1),
            "optimizer": f"{optimizer.get('type', 'adamw')} lr {optimizer.get('lr', 1e-3)}"}


# --- output ------------------------------------------------------------------------------------

def fmt(value, spec):
    return benchlib.fmt_or_dash(value, spec)


def fmt_bytes(value):
    if not isinstance(value, (int, float)):
        return "-"
    return f"{value / 1024:.0f} KiB" if value < 1024 * 1024 else f"{value / 1048576:.2f} MiB"


def lever_cells(row):
    return [row["label"], fmt(row["step_ms"], ".2f"), fmt(row["speed_vs_baseline"], ".2f"),
            benchlib.fmt_spread(row["step_ms_spread"]), fmt(row.get("compute_ms"), ".2f"),
            fmt(row.get("comm_total_ms"), ".2f"), fmt(row.get("comm_exposed_ms"), ".2f"),
            fmt(row.get("optimizer_ms"), ".2f"), fmt_bytes(row.get("bytes_per_step")),
            fmt(row.get("bytes_vs_baseline"), ".3f"), fmt(row.get("optimizer_state_mib"), ".2f"),
            fmt(row.get("eval_loss"), ".4f")]


LEVER_HEADER = ["variant", "step ms", "speed", "spread", "compute ms", "all comm ms",
                "exposed comm ms", "optimizer ms", "bytes/step", "bytes ratio",
                "opt. state MiB", "held-out loss"]
GAIN_HEADER = ["side", "no overlap: step ms", "overlap: step ms", "overlap gain"]


def gain_cells(gain):
    return [gain["side"], fmt(gain["no_overlap_step_ms"], ".2f"),
            fmt(gain["overlap_step_ms"], ".2f"), fmt(gain["gain"], ".2f")]


def header_lines(report):
    setup, box, versions = report["setup"], report["machine"], report["versions"]
    return [
        f"dptrain's communication levers, {setup['world_size']} local CPU ranks (Gloo), "
        f"{report['date']}: MLP {setup['model']} ({setup['parameters']} parameters), batch "
        f"{setup['batch_per_rank']}/rank, {setup['optimizer']}, {setup['steps']} steps (first "
        f"{setup['warmup_steps']} untimed), {setup['threads_per_rank']} compute thread/rank, "
        f"bucket_mb {setup['bucket_mb']:g} (buckets of {', '.join(map(str, setup['buckets']))} "
        f"values), median of {report['reps']}",
        f"machine: {box['nproc']} cores, {box['cpu_model']}, Linux {box['kernel']}, 1-min load "
        f"average {box['loadavg_1min_before']:.2f} before, {box['loadavg_1min_after']:.2f} after; "
        f"dptrain {versions['dptrain']}, torch {versions['torch']} "
        f"(Python {versions['torch_python']})",
        "step ms: per step, from samples/s; speed: step ms of \"allreduce, no overlap\" / this "
        "row's (> 1: faster); spread: (max - min) / 2 median of step ms; compute, comm, "
        "optimizer: dptrain's phases_ms (exposed comm: what the step waited for) and "
        "comm_total_ms; bytes/step: one rank's payload; held-out loss: eval_loss after the "
        "last step",
    ]


def print_text(report):
    for line in header_lines(report):
        print(f"# {line}")
    print("#")
    widths = [22, 8, 6, 7, 8, 8, 8, 8, 11, 7, 7, 8]
    top = ["", "step", "speed", "spread", "compute", "all", "exposed", "optim.", "bytes/step",
           "bytes", "state", "held-out"]
    bottom = ["variant", "ms", "", "", "ms", "comm ms", "comm ms", "ms", "", "ratio", "MiB",
              "loss"]
    for names in (top, bottom):
        print("# " + " ".join(f"{n:<{w}}" if i == 0 else f"{n:>{w}}"
                             for i, (n, w) in enumerate(zip(names, widths))))
    for key, row in report["levers"].items():
        if not key.startswith("torch-"):
            cells = lever_cells(row)
            print("  " + " ".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}"
                                  for i, (c, w) in enumerate(zip(cells, widths))))
    if report["overlap_gain"]:
        print("#")
        print("# overlap gain = step ms without overlap / with overlap (> 1: overlap pays); "
              "pytorch: the same buckets all-reduced after the backward pass, against DDP")
        print(f"# {'side':<8} {'no overlap':>11} {'overlap':>9} {'gain':>6}")
        print(f"# {'':<8} {'step ms':>11} {'step ms':>9} {'':>6}")
        for gain in report["overlap_gain"]:
            cells = gain_cells(gain)
            print(f"  {cells[0]:<8} {cells[1]:>11} {cells[2]:>9} {cells[3]:>6}")
    torch_rows = [report["levers"][k] for k, _, _ in PEERS if k in report["levers"]]
    if torch_rows:
        print("#")
        print("# pytorch, ms per step on rank 0 (backward: with DDP including its overlapped "
              "all-reduce); buckets in values, DDP's as it rebuilt them after the first step")
        print(f"# {'mode':<22} {'step':>7} {'forward':>8} {'backward':>9} {'all-reduce':>11} "
              f"{'optim.':>7} {'loss':>8}  buckets")
        for row in torch_rows:
            buckets = ",".join(map(str, row.get("buckets") or [])) or "-"
            print(f"  {row['label']:<22} {row['step_ms']:>7.2f} {row['forward_ms']:>8.2f} "
                  f"{row['backward_ms']:>9.2f} {row['allreduce_ms']:>11.2f} "
                  f"{row['optimizer_ms']:>7.2f} {row['final_loss']:>8.4f}  {buckets}")


def markdown_row(cells):
    return "| " + " | ".join(cells) + " |"


def print_markdown(report):
    for line in header_lines(report):
        print(f"{line}.  ")
    print()
    print(markdown_row(LEVER_HEADER))
    print(markdown_row(["---"] + ["---:"] * (len(LEVER_HEADER) - 1)))
    for key, row in report["levers"].items():
        if not key.startswith("torch-"):
            print(markdown_row(lever_cells(row)))
    if report["overlap_gain"]:
        print()
        print("Overlap gain = step ms without overlap / with overlap (> 1: overlap pays). PyTorch "
              "without overlap: the same buckets all-reduced after the backward pass; with: DDP.")
        print()
        print(markdown_row(GAIN_HEADER))
        print(markdown_row(["---", "---:", "---:", "---:"]))
        for gain in report["overlap_gain"]:
            print(markdown_row(gain_cells(gain)))


def main():
    args = parse_args()

    def work(scratch):
        recipe = base_recipe(args)
        paths = write_recipes(args, recipe, scratch)
        global_batch = WORLD * args.batch
        return recipe, measure(args, paths, scratch, global_batch)

    status, versions, box, outcome = benchlib.run_driver("ddp_levers", args, work,
                                                         "dptrain-levers-")
    if status != 0:
        return status
    recipe, runs = outcome
    rows = summarize(runs)
    expected = mlp_buckets(recipe, args.bucket_mb)
    for key, _, _ in PEERS:
        if key in rows and rows[key].get("buckets") not in (None, expected):
            print(f"ddp_levers: warning: {LABELS[key]} used buckets of {rows[key]['buckets']} "
                  f"values, dptrain {expected}", file=sys.stderr)
    report = {"benchmark": "ddp_levers", "recipe": os.path.relpath(args.recipe, REPO_DIR),
              "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "setup": describe(recipe, args), "reps": args.reps, "machine": box,
              "versions": versions, "levers": rows, "overlap_gain": overlap_gains(rows)}
    if args.json:
        benchlib.emit(report, True, None)
    else:
        (print_markdown if args.markdown else print_text)(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
