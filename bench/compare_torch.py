#!/usr/bin/env python3
"""Compares dptrain with PyTorch (Gloo, CPU): training, allreduce bandwidth, time to first step.

Usage:
  bash bench/compare_torch.sh [--world-sizes 1,2] [--parts train,comm,startup] [--json]

Three comparisons, each side measured in the same run, interleaved, with the ratio (every ratio
is > 1 where dptrain is faster):
  train    steady-state training throughput of the MLP and the tiny GPT: runs
           bench/mlp_vs_ddp.py and bench/gpt_vs_ddp.py with --json on the world sizes;
  comm     allreduce bus bandwidth on float32, 1 to 64 MiB: `dptrain bench comm` against
           torch.distributed.all_reduce over Gloo (bench/allreduce_peer.py), the same sizes,
           warm-up and timed calls, busbw = 2(n-1)/n x size / time (world sizes of 2 or more);
  startup  wall time from starting `dptrain launch` on a quickstart-like recipe until its first
           progress line, against starting the PyTorch DDP ranks by hand (MASTER_ADDR, ...)
           until rank 0 reports its first optimizer step done.
Needs a dptrain binary and Debian's python3-torch for /usr/bin/python3; only the standard library
is used here. About 4-5 minutes on a 2-core machine at a load of 4. See bench/README.md.
"""

import argparse
import datetime
import os
import queue
import statistics
import subprocess
import sys
import threading
import time

import benchlib
from benchlib import BENCH_DIR, REPO_DIR, SIDES, BenchError

PARTS = ("train", "comm", "startup")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    benchlib.add_binary_arguments(parser)
    parser.add_argument("--world-sizes", default="1,2",
                        help="comma-separated; comm uses those of 2 or more (default: 1,2)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="which comparisons, comma-separated (default: %(default)s)")
    parser.add_argument("--train-reps", type=int,
                        help="repetitions of each training run (default: the drivers' own, 5 "
                             "for the MLP and 3 for the GPT)")
    parser.add_argument("--mlp-steps", type=int, help="MLP steps per run (default: the recipe's)")
    parser.add_argument("--gpt-steps", type=int, help="GPT steps per run (default: 60)")
    parser.add_argument("--comm-reps", type=int, default=5,
                        help="runs of each side's allreduce sweep (default: %(default)s)")
    parser.add_argument("-b", "--minbytes", default="1M", help="smallest allreduce (default 1M)")
    parser.add_argument("-e", "--maxbytes", default="64M", help="largest allreduce (default 64M)")
    parser.add_argument("-f", "--stepfactor", type=int, default=2,
                        help="allreduce size factor between rows (default 2)")
    parser.add_argument("-w", "--warmup", type=int, default=5,
                        help="untimed allreduce calls per size (default 5)")
    parser.add_argument("-n", "--iters", type=int, default=20,
                        help="timed allreduce calls per size (default 20)")
    parser.add_argument("--startup-reps", type=int, default=5,
                        help="start-ups of each side per world size (default: %(default)s)")
    parser.add_argument("--startup-recipe", default=os.path.join(REPO_DIR, "recipes",
                                                                 "quickstart.json"),
                        help="recipe the start-up is measured on, run for one step with a "
                             "constant schedule (default: %(default)s)")
    benchlib.add_output_arguments(parser)
    args = parser.parse_args()
    args.reps = 1  # check_repetition_arguments() checks the world sizes with it
    benchlib.check_repetition_arguments(parser, args)
    args.parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown or not args.parts:
        parser.error(f"--parts: {', '.join(unknown) or 'none given'}: expected some of "
                     f"{', '.join(PARTS)}")
    if "comm" in args.parts and not any(w >= 2 for w in args.world_sizes):
        parser.error("--parts comm: needs a world size of 2 or more in --world-sizes")
    for name in ("train_reps", "mlp_steps", "gpt_steps", "comm_reps", "startup_reps"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}: must be at least 1, not {value}")
    return args


def note(text):
    print(f"compare_torch: {text}", file=sys.stderr, flush=True)


# ---- (a) training throughput: the two drivers ----

def run_training_driver(args, script, steps):
    command = [sys.executable, os.path.join(BENCH_DIR, script), "--json", "--dptrain",
               args.dptrain, "--torch-python", args.torch_python, "--world-sizes",
               ",".join(map(str, args.world_sizes)), "--timeout", str(args.timeout)]
    if args.train_reps:
        command += ["--reps", str(args.train_reps)]
    if steps:
        command += ["--steps", str(steps)]
    note(f"running {script}")
    # Each driver stops its own runs at --timeout; this bounds the whole of one driver.
    runs = len(args.world_sizes) * len(SIDES) * (args.train_reps or 5)
    return benchlib.run_json(command, script, args.timeout * runs + 120, pass_stderr=True)


def training(args):
    reports = {"mlp": run_training_driver(args, "mlp_vs_ddp.py", args.mlp_steps),
               "gpt": run_training_driver(args, "gpt_vs_ddp.py", args.gpt_steps)}
    rows = []
    for model, metric, unit in (("mlp", "samples_per_s", "samples/s"),
                                ("gpt", "tokens_per_s", "tokens/s")):
        report = reports[model]
        for row in report["results"]:
            rows.append({"model": model, "world_size": row["world_size"], "unit": unit,
                         "reps": report["reps"], "steps": report["setup"]["steps"],
                         "dptrain": row[f"dptrain_{metric}"], "pytorch": row[f"pytorch_{metric}"],
                         "ratio": row["ratio"], "ratio_best": row["ratio_best"],
                         "dptrain_spread": row["dptrain_spread"],
                         "pytorch_spread": row["pytorch_spread"]})
    return {"rows": rows, "mlp": reports["mlp"], "gpt": reports["gpt"]}


# ---- (b) allreduce bandwidth: dptrain bench comm vs torch.distributed.all_reduce ----

def comm_rows(result, what):
    rows = [row for row in result.get("rows", []) if row.get("op", "allreduce") == "allreduce"]
    if not rows:
        raise BenchError(f"{what}: no allreduce rows in its JSON: {result}")
    for row in rows:
        if not isinstance(row.get("time_us"), (int, float)) or row["time_us"] <= 0:
            raise BenchError(f"{what}: a row without a positive time_us: {row}")
    return rows


def run_comm(side, world, args, scratch, rep):
    what = f"{side} allreduce on {world} ranks"
    sweep = ["-b", args.minbytes, "-e", args.maxbytes, "-f", str(args.stepfactor), "-w",
             str(args.warmup), "-n", str(args.iters), "--json"]
    if side == "dptrain":
        command = [args.dptrain, "bench", "comm", "--nproc", str(world), *sweep, "--run-dir",
                   os.path.join(scratch, f"comm-w{world}-r{rep}")]
    else:
        command = [args.torch_python, os.path.join(BENCH_DIR, "allreduce_peer.py"), "--nproc",
                   str(world), *sweep, "--timeout", str(args.timeout)]
    result = benchlib.run_json(command, what, args.timeout + 30)
    for key, want in (("warmup", args.warmup), ("iters", args.iters)):
        if key in result and result[key] != want:
            raise BenchError(f"{what}: ran {result[key]} {key}, not the {want} asked for")
    return comm_rows(result, what)


def bus_factor(world):
    return 2.0 * (world - 1) / world


def allreduce(args, scratch):
    tables = []
    for world in [w for w in args.world_sizes if w >= 2]:
        runs = {side: [] for side in SIDES}
        for rep in range(args.comm_reps):
            order = SIDES if rep % 2 == 0 else tuple(reversed(SIDES))
            for side in order:
                note(f"allreduce sweep {rep + 1}/{args.comm_reps}, {side}, {world} ranks")
                runs[side].append(run_comm(side, world, args, scratch, rep))
        sizes = [row["size"] for row in runs["dptrain"][0]]
        for side in SIDES:
            for sweep in runs[side]:
                if [row["size"] for row in sweep] != sizes:
                    raise BenchError(f"comm: the two sides measured different sizes: {sizes} "
                                     f"and {[row['size'] for row in sweep]}")
        rows = []
        for i, size in enumerate(sizes):
            first = runs["dptrain"][0][i]
            row = {"size": size, "count": first.get("count", size // 4),
                   "type": first.get("type", "float"), "redop": first.get("redop", "sum")}
            for side in SIDES:
                times = [sweep[i]["time_us"] for sweep in runs[side]]
                median = statistics.median(times)
                row[f"{side}_time_us"] = median
                row[f"{side}_busbw"] = bus_factor(world) * size / 1e9 / (median / 1e6)
                row[f"{side}_spread"] = benchlib.spread(times)
                row[f"{side}_times_us"] = times
                row[f"{side}_wrong"] = max(int(sweep[i].get("wrong", 0)) for sweep in runs[side])
            row["ratio"] = row["dptrain_busbw"] / row["pytorch_busbw"]
            rows.append(row)
        avg = {side: statistics.fmean(r[f"{side}_busbw"] for r in rows) for side in SIDES}
        tables.append({"world_size": world, "rows": rows, "dptrain_avg_busbw": avg["dptrain"],
                       "pytorch_avg_busbw": avg["pytorch"],
                       "ratio_avg_busbw": avg["dptrain"] / avg["pytorch"]})
    return {"reps": args.comm_reps, "warmup": args.warmup, "iters": args.iters,
            "tables": tables}


# ---- (c) time to the first step: dptrain launch vs ranks started by hand ----

def startup_recipe(args, scratch):
    """The recipe for one step, logged, with nothing periodic and a schedule both sides run."""
    recipe = benchlib.read_recipe(args.startup_recipe)
    recipe.setdefault("train", {})["steps"] = 1
    recipe.setdefault("log", {})["every"] = 1
    recipe.setdefault("eval", {})["every"] = 0
    recipe.setdefault("checkpoint", {})["every"] = 0
    # The PyTorch peer mirrors only a constant schedule; over one step nothing else differs.
    recipe.setdefault("optimizer", {})["schedule"] = {"type": "constant"}
    return benchlib.write_json(os.path.join(scratch, "startup.json"), recipe, indent=2)


def time_to_line(commands, is_signal, what, timeout_s, log_path):
    """Starts the (command, env) pairs at once and watches the first one's stdout. Returns
    (seconds until a line is_signal(line), seconds until every process exited)."""
    lines = queue.Queue()
    procs = []
    with open(log_path, "w", encoding="utf-8") as log:
        start = time.perf_counter()
        deadline = time.monotonic() + timeout_s
        try:
            for i, (command, env) in enumerate(commands):
                procs.append(subprocess.Popen(
                    command, env=env, stdout=subprocess.PIPE if i == 0 else subprocess.DEVNULL,
                    stderr=log, text=True))

            def pump(stream):
                for line in stream:
                    lines.put((time.perf_counter(), line))
                lines.put((time.perf_counter(), None))

            threading.Thread(target=pump, args=(procs[0].stdout,), daemon=True).start()
            first = None
            while first is None:
                try:
                    when, line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
                except queue.Empty as e:
                    raise BenchError(f"{what}: no first step within {timeout_s:.0f} s") from e
                if line is None:
                    break
                if is_signal(line):
                    first = when - start
            for proc in procs:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            ended = time.perf_counter() - start
        except subprocess.TimeoutExpired as e:
            raise BenchError(f"{what}: did not end within {timeout_s:.0f} s") from e
        finally:
            for proc in procs:
                if proc.poll() is None:
                    benchlib.stop(proc)
    failed = [proc for proc in procs if proc.returncode != 0]
    if failed or first is None:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            tail = "\n".join(f.read().strip().splitlines()[-20:])
        reason = (f"exited with status {failed[0].returncode}" if failed
                  else "ended without a first step")
        raise BenchError(f"{what}: {reason}: {' '.join(commands[0][0])}\n{tail}")
    return first, ended


def run_startup(side, world, args, recipe, scratch, rep):
    what = f"{side} start-up on {world} rank(s)"
    log = os.path.join(scratch, f"startup-{side}-w{world}-r{rep}.log")
    if side == "dptrain":
        command = [args.dptrain, "launch", recipe, "--nproc", str(world), "--run-dir",
                   os.path.join(scratch, f"startup-w{world}-r{rep}")]
        # Without --json the launcher prints one plain line per logged step to a pipe.
        return time_to_line([(command, None)], lambda line: line.startswith("step "), what,
                            args.timeout, log)
    port = benchlib.free_port()
    command = [args.torch_python, os.path.join(BENCH_DIR, "mlp_ddp_peer.py"), recipe,
               "--worker"]
    # Rank 0 prints its JSON line after the step, a barrier and a one-float all-reduce.
    return time_to_line([(command, benchlib.rank_environment(rank, world, port))
                         for rank in range(world)],
                        lambda line: line.lstrip().startswith("{"), what, args.timeout, log)


def startup(args, scratch):
    recipe = startup_recipe(args, scratch)
    rows = []
    for world in args.world_sizes:
        runs = {side: [] for side in SIDES}
        for rep in range(args.startup_reps):
            order = SIDES if (rep + world) % 2 == 0 else tuple(reversed(SIDES))
            for side in order:
                first, ended = run_startup(side, world, args, recipe, scratch, rep)
                runs[side].append({"first_step_s": first, "exit_s": ended})
                note(f"start-up {rep + 1}/{args.startup_reps}, {side:7} on {world} rank(s): "
                     f"first step after {first:.2f} s, all exited after {ended:.2f} s")
        row = {"world_size": world}
        for side in SIDES:
            firsts = [r["first_step_s"] for r in runs[side]]
            row[f"{side}_first_step_s"] = statistics.median(firsts)
            row[f"{side}_exit_s"] = statistics.median(r["exit_s"] for r in runs[side])
            row[f"{side}_spread"] = benchlib.spread(firsts)
            row[f"{side}_runs_s"] = firsts
        # Times: pytorch / dptrain, so that > 1 means dptrain is faster, as everywhere here.
        row["ratio"] = row["pytorch_first_step_s"] / row["dptrain_first_step_s"]
        rows.append(row)
    return {"reps": args.startup_reps,
            "recipe": os.path.relpath(args.startup_recipe, REPO_DIR), "rows": rows}


# ---- output ----

def print_training(part):
    print("# (a) training throughput, steady state (bench/mlp_vs_ddp.py, bench/gpt_vs_ddp.py):")
    print("#     median of interleaved runs per side; ratio = dptrain / pytorch; ratio best = "
          "the fastest runs'")
    print(f"# {'model':>5} {'world':>5} {'reps':>4} {'steps':>5} {'unit':>9} {'dptrain':>10} "
          f"{'pytorch':>10} {'ratio':>6} {'ratio':>6} {'dptrain':>8} {'pytorch':>8}")
    print(f"# {'':>5} {'':>5} {'':>4} {'':>5} {'':>9} {'':>10} {'':>10} {'':>6} {'best':>6} "
          f"{'spread':>8} {'spread':>8}")
    for row in part["rows"]:
        print(f"  {row['model']:>5} {row['world_size']:>5} {row['reps']:>4} {row['steps']:>5} "
              f"{row['unit']:>9} {row['dptrain']:>10.0f} {row['pytorch']:>10.0f} "
              f"{row['ratio']:>6.2f} {row['ratio_best']:>6.2f} "
              f"{benchlib.fmt_spread(row['dptrain_spread']):>8} "
              f"{benchlib.fmt_spread(row['pytorch_spread']):>8}")


def print_allreduce(part):
    for table in part["tables"]:
        world = table["world_size"]
        print(f"# (b) allreduce, float32 sum, {world} ranks, {part['warmup']} warm-up + "
              f"{part['iters']} timed calls per size, median time over {part['reps']} sweep(s) "
              f"per side;")
        print(f"#     dptrain: `dptrain bench comm`; pytorch: torch.distributed.all_reduce "
              f"(Gloo); busbw = 2(n-1)/n x size / time = {bus_factor(world):g} x size / time;")
        print("#     ratio = dptrain busbw / pytorch busbw")
        print(f"# {'size':>10} {'dptrain':>9} {'pytorch':>9} {'dptrain':>7} {'pytorch':>7} "
              f"{'ratio':>6} {'dptrain':>8} {'pytorch':>8} {'#wrong':>6}")
        print(f"# {'(B)':>10} {'time(us)':>9} {'time(us)':>9} {'busbw':>7} {'busbw':>7} "
              f"{'':>6} {'spread':>8} {'spread':>8} {'':>6}")
        for row in table["rows"]:
            print(f"  {row['size']:>10} {row['dptrain_time_us']:>9.0f} "
                  f"{row['pytorch_time_us']:>9.0f} {row['dptrain_busbw']:>7.3f} "
                  f"{row['pytorch_busbw']:>7.3f} {row['ratio']:>6.2f} "
                  f"{benchlib.fmt_spread(row['dptrain_spread']):>8} "
                  f"{benchlib.fmt_spread(row['pytorch_spread']):>8} "
                  f"{row['dptrain_wrong'] + row['pytorch_wrong']:>6}")
        print(f"  {'avg busbw':>10} {'':>9} {'':>9} {table['dptrain_avg_busbw']:>7.3f} "
              f"{table['pytorch_avg_busbw']:>7.3f} {table['ratio_avg_busbw']:>6.2f}")


def print_startup(part):
    print(f"# (c) time to the first step, seconds, median of {part['reps']} per side "
          f"({part['recipe']}, one step):")
    print("#     dptrain: `dptrain launch RECIPE --nproc N` started -> its first progress line;")
    print("#     pytorch: N python3 ranks started by hand (MASTER_ADDR, RANK, ...) -> rank 0's "
          "first DDP step done;")
    print("#     ratio = pytorch / dptrain; exit: until every process has exited")
    print(f"# {'world':>5} {'dptrain':>8} {'pytorch':>8} {'ratio':>6} {'dptrain':>8} "
          f"{'pytorch':>8} {'dptrain':>8} {'pytorch':>8}")
    print(f"# {'':>5} {'first':>8} {'first':>8} {'':>6} {'spread':>8} {'spread':>8} "
          f"{'exit':>8} {'exit':>8}")
    for row in part["rows"]:
        print(f"  {row['world_size']:>5} {row['dptrain_first_step_s']:>8.2f} "
              f"{row['pytorch_first_step_s']:>8.2f} {row['ratio']:>6.2f} "
              f"{benchlib.fmt_spread(row['dptrain_spread']):>8} "
              f"{benchlib.fmt_spread(row['pytorch_spread']):>8} "
              f"{row['dptrain_exit_s']:>8.2f} {row['pytorch_exit_s']:>8.2f}")


def print_report(report):
    print(f"# dptrain vs PyTorch (Gloo, CPU, one thread per rank), {report['date']}; every "
          f"ratio > 1 means dptrain is faster")
    benchlib.print_machine(report)
    printers = {"train": print_training, "comm": print_allreduce, "startup": print_startup}
    for name in report["parts"]:
        part = report[name]
        print("#")
        if "error" in part:
            print(f"# ({name}) failed: {part['error'].splitlines()[0]}")
        else:
            part_load = part.get("loadavg_1min_before")
            printers[name](part)
            if part_load is not None:
                print(f"#     1-min load average {part_load:.2f} when it started")


def main():
    args = parse_args()
    steps = {"train": training, "comm": allreduce, "startup": startup}

    def work(scratch):
        parts = {}
        for name in args.parts:
            load = benchlib.load_average()
            try:
                parts[name] = steps[name](args) if name == "train" else steps[name](args, scratch)
            except BenchError as e:
                # One comparison failing leaves the others worth having; the status says so.
                note(f"{name}: {e}")
                parts[name] = {"error": str(e)}
            parts[name]["loadavg_1min_before"] = load
        return parts

    started = datetime.datetime.now(datetime.timezone.utc)
    status, versions, box, parts = benchlib.run_driver("compare_torch", args, work,
                                                       "dptrain-compare-", modules=("numpy",))
    if status != 0:
        return status
    report = {"benchmark": "compare_torch",
              "date": started.strftime("%Y-%m-%d %H:%M UTC"),
              "wall_s": (datetime.datetime.now(datetime.timezone.utc) - started).total_seconds(),
              "command": " ".join(["bash", "bench/compare_torch.sh", *sys.argv[1:]]),
              "machine": box, "versions": versions, "parts": args.parts, **parts}
    benchlib.emit(report, args.json, print_report)
    return 1 if any("error" in part for part in parts.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
