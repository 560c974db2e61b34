#!/usr/bin/env python3
"""Compares dptrain with PyTorch DDP (Gloo, CPU) on the same MLP recipe, on 1 and 2 local ranks.

Usage:
  python3 bench/mlp_vs_ddp.py [--reps 5] [--world-sizes 1,2] [--steps N] [--json]

Each repetition runs every (world size, side) pair once, alternating which side goes first, so
load from other users of a shared machine falls on both; the table reports the median
steady-state global samples/s of each side and the ratio dptrain / PyTorch. Needs build/dptrain
(`make build`) and Debian's python3-torch for /usr/bin/python3. Only the standard library is used
here, so any python3 can run the driver. See bench/README.md.
"""

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
SIDES = ("dptrain", "pytorch")


class BenchError(Exception):
    """A one-line reason the benchmark cannot run or finish; `exit_code` says which."""

    def __init__(self, message, exit_code=1):
        super().__init__(message)
        self.exit_code = exit_code


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default=os.path.join(BENCH_DIR, "mlp-784-256-256-10.json"),
                        help="dptrain recipe both sides train (default: %(default)s)")
    parser.add_argument("--dptrain", default=os.path.join(REPO_DIR, "build", "dptrain"),
                        help="the dptrain binary (default: %(default)s)")
    parser.add_argument("--torch-python", default="/usr/bin/python3",
                        help="interpreter that has PyTorch (default: %(default)s)")
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated (default: 1,2)")
    parser.add_argument("--reps", type=int, default=5,
                        help="repetitions; the median is reported (default: %(default)s)")
    parser.add_argument("--steps", type=int, help="override the recipe's /train/steps")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for one run")
    parser.add_argument("--json", action="store_true", help="print one JSON object, not a table")
    args = parser.parse_args()
    try:
        args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    except ValueError:
        parser.error(f"--world-sizes: expected comma-separated integers, not {args.world_sizes!r}")
    if args.reps < 1 or any(w < 1 for w in args.world_sizes):
        parser.error("--reps and every world size must be at least 1")
    return args


def check_prerequisites(args):
    """Fails early with what to do, rather than halfway through the runs. Returns versions."""
    if not os.path.isfile(args.dptrain) or not os.access(args.dptrain, os.X_OK):
        raise BenchError(f"{args.dptrain}: no dptrain binary; build it with `make build` at the "
                         f"repo root (or pass --dptrain PATH)", exit_code=2)
    probe = subprocess.run(
        [args.torch_python, "-c",
         "import platform, torch, torch.distributed as d; assert d.is_gloo_available(), "
         "'no Gloo backend'; print(torch.__version__, platform.python_version())"],
        capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        reason = (probe.stderr.strip().splitlines() or ["no output"])[-1]
        raise BenchError(f"{args.torch_python} cannot run PyTorch with Gloo ({reason}); install "
                         f"Debian's python3-torch or pass --torch-python PATH", exit_code=2)
    torch_version, python_version = probe.stdout.split()
    return {"dptrain": dptrain_version(args.dptrain), "torch": torch_version,
            "torch_python": python_version}


def dptrain_version(binary):
    try:
        out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30,
                             check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = out.stdout.strip() or out.stderr.strip()
    if out.returncode != 0 or not text:
        return "unknown"
    return text.splitlines()[0].removeprefix("dptrain ").strip()


def machine():
    cpu_model = "unknown"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu_model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {"nproc": len(os.sched_getaffinity(0)), "cpu_model": cpu_model,
            "kernel": platform.release()}


def load_recipe(path, steps_override, scratch):
    """Returns (path both sides should read, recipe as parsed); writes a copy only to override."""
    try:
        with open(path, encoding="utf-8") as f:
            recipe = json.load(f)
    except (OSError, ValueError) as e:
        raise BenchError(f"{path}: cannot read the recipe: {e}", exit_code=2) from e
    if steps_override is None:
        return path, recipe
    recipe.setdefault("train", {})["steps"] = steps_override
    copy = os.path.join(scratch, os.path.basename(path))
    with open(copy, "w", encoding="utf-8") as f:
        json.dump(recipe, f)
    return copy, recipe


def run_json(command, what, timeout_s):
    """Runs a command whose stdout ends with one JSON object; stderr is kept for failures only."""
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            # SIGTERM first: both launchers then stop their own ranks instead of orphaning them.
            proc.terminate()
            try:
                proc.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
            raise BenchError(f"{what}: did not finish within {timeout_s:.0f} s: "
                             f"{' '.join(command)}") from e
    if proc.returncode != 0:
        tail = "\n".join(stderr.strip().splitlines()[-20:])
        raise BenchError(f"{what}: exited with status {proc.returncode}: "
                         f"{' '.join(command)}\n{tail}")
    text = stdout.strip()
    try:
        return json.loads(text)
    except ValueError:
        # Tolerate stray lines before the result: the contract is only "ends with one object".
        lines = text.splitlines()
        try:
            return json.loads(lines[-1])
        except (ValueError, IndexError) as e:
            raise BenchError(f"{what}: printed no JSON result: {' '.join(command)}") from e


def run_once(side, world, args, recipe_path, scratch, rep):
    if side == "dptrain":
        run_dir = os.path.join(scratch, f"dptrain-w{world}-r{rep}")
        command = [args.dptrain, "launch", recipe_path, "--nproc", str(world), "--run-dir",
                   run_dir, "--json"]
    else:
        command = [args.torch_python, os.path.join(BENCH_DIR, "mlp_ddp_peer.py"), recipe_path,
                   "--nproc", str(world), "--json", "--timeout", str(args.timeout)]
    what = f"{side} on {world} rank(s)"
    result = run_json(command, what, args.timeout)
    if side == "dptrain":
        shutil.rmtree(run_dir, ignore_errors=True)  # a checkpoint per run adds up
    if "samples_per_s" not in result or result.get("world_size") != world:
        raise BenchError(f"{what}: result lacks samples_per_s or has the wrong world_size: "
                         f"{result}")
    return result


def measure(args, recipe_path, scratch):
    """Returns {(side, world): [result, ...]} over all repetitions."""
    runs = {(side, world): [] for side in SIDES for world in args.world_sizes}
    total, done = args.reps * len(runs), 0
    for rep in range(args.reps):
        for world in args.world_sizes:
            order = SIDES if (rep + world) % 2 == 0 else tuple(reversed(SIDES))
            for side in order:
                result = run_once(side, world, args, recipe_path, scratch, rep)
                runs[(side, world)].append(result)
                done += 1
                print(f"[{done}/{total}] {side:7} world {world}: "
                      f"{result['samples_per_s']:10.1f} samples/s", file=sys.stderr, flush=True)
    return runs


def summarize(runs, world_sizes):
    rows = []
    for world in world_sizes:
        row = {"world_size": world}
        for side in SIDES:
            rates = [r["samples_per_s"] for r in runs[(side, world)]]
            median = statistics.median(rates)
            row[f"{side}_samples_per_s"] = median
            # Half the min-max range relative to the median: how far to trust the ratio.
            row[f"{side}_spread"] = (max(rates) - min(rates)) / (2 * median)
            row[f"{side}_runs"] = rates
            row[f"{side}_final_loss"] = runs[(side, world)][-1].get("final_loss")
        row["ratio"] = row["dptrain_samples_per_s"] / row["pytorch_samples_per_s"]
        # The least disturbed run of each side: a second opinion when the machine is busy.
        row["ratio_best"] = max(row["dptrain_runs"]) / max(row["pytorch_runs"])
        rows.append(row)
    return rows


def describe(recipe):
    model, train = recipe.get("model", {}), recipe.get("train", {})
    optimizer = recipe.get("optimizer", {})
    dims = [model.get("input", 784), *model.get("hidden", [256, 256]), model.get("classes", 10)]
    steps = int(train.get("steps", 500))
    return {"model": "-".join(str(d) for d in dims) + " " + model.get("activation", "relu"),
            "batch_per_rank": train.get("batch_per_rank", 64), "steps": steps,
            "warmup_steps": min(10, steps // 5),
            "optimizer": f"{optimizer.get('type', 'adamw')} lr {optimizer.get('lr', 1e-3)}"}


def fmt_loss(loss):
    return f"{loss:.3g}" if isinstance(loss, (int, float)) else "-"


def print_table(report):
    setup, box, versions = report["setup"], report["machine"], report["versions"]
    print(f"# dptrain vs PyTorch DDP (Gloo, CPU): MLP {setup['model']}, batch "
          f"{setup['batch_per_rank']}/rank, {setup['optimizer']}, {setup['steps']} steps "
          f"(first {setup['warmup_steps']} untimed), median of {report['reps']}")
    print(f"# machine: {box['nproc']} cores, {box['cpu_model']}, Linux {box['kernel']}, "
          f"1-min load average {box['loadavg_1min_before']:.2f} before, "
          f"{box['loadavg_1min_after']:.2f} after")
    print(f"# versions: dptrain {versions['dptrain']}, torch {versions['torch']} "
          f"(Python {versions['torch_python']})")
    print("#")
    print(f"# {'world':>5} {'dptrain':>11} {'pytorch':>11} {'ratio':>7} {'ratio':>7} "
          f"{'dptrain':>8} {'pytorch':>8} {'dptrain':>9} {'pytorch':>9}")
    print(f"# {'':>5} {'samples/s':>11} {'samples/s':>11} {'median':>7} {'best':>7} "
          f"{'spread':>8} {'spread':>8} {'loss':>9} {'loss':>9}")
    for row in report["results"]:
        print(f"  {row['world_size']:>5} {row['dptrain_samples_per_s']:>11.1f} "
              f"{row['pytorch_samples_per_s']:>11.1f} "
              f"{row['ratio']:>7.2f} {row['ratio_best']:>7.2f} "
              f"{'±' + format(row['dptrain_spread'], '.0%'):>8} "
              f"{'±' + format(row['pytorch_spread'], '.0%'):>8} "
              f"{fmt_loss(row['dptrain_final_loss']):>9} {fmt_loss(row['pytorch_final_loss']):>9}")


def main():
    args = parse_args()
    try:
        versions = check_prerequisites(args)
        load_before = os.getloadavg()[0]
        # Run directories and any recipe copy live here and go away with it, even on failure.
        with tempfile.TemporaryDirectory(prefix="dptrain-bench-") as scratch:
            recipe_path, recipe = load_recipe(args.recipe, args.steps, scratch)
            runs = measure(args, recipe_path, scratch)
    except BenchError as e:
        print(f"mlp_vs_ddp: {e}", file=sys.stderr)
        return e.exit_code
    # Other users' load is the main source of noise on a shared machine; the reader should see it.
    box = dict(machine(), loadavg_1min_before=load_before, loadavg_1min_after=os.getloadavg()[0])
    report = {"benchmark": "mlp_vs_ddp", "recipe": os.path.relpath(args.recipe, REPO_DIR),
              "setup": describe(recipe), "reps": args.reps, "machine": box,
              "versions": versions, "results": summarize(runs, args.world_sizes)}
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
