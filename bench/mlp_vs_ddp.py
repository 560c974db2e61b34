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
import os
import shutil
import sys

import benchlib
from benchlib import BENCH_DIR, REPO_DIR


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default=os.path.join(BENCH_DIR, "mlp-784-256-256-10.json"),
                        help="dptrain recipe both sides train (default: %(default)s)")
    benchlib.add_binary_arguments(parser)
    benchlib.add_repetition_arguments(parser, reps=5)
    parser.add_argument("--steps", type=int, help="override the recipe's /train/steps")
    benchlib.add_output_arguments(parser)
    args = parser.parse_args()
    benchlib.check_repetition_arguments(parser, args)
    return args


def run_once(side, world, args, recipe_path, scratch, rep):
    what = f"{side} on {world} rank(s)"
    if side == "dptrain":
        run_dir = os.path.join(scratch, f"dptrain-w{world}-r{rep}")
        result = benchlib.run_json(benchlib.launch_command(args, recipe_path, world, run_dir),
                                   what, args.timeout)
        shutil.rmtree(run_dir, ignore_errors=True)  # a checkpoint per run adds up
    else:
        result = benchlib.run_json(
            benchlib.peer_command(args, "mlp_ddp_peer.py", recipe_path, world), what,
            args.timeout)
    return benchlib.check_result(result, what, world)


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
    return benchlib.fmt_or_dash(loss, ".3g")


def print_table(report):
    setup = report["setup"]
    print(f"# dptrain vs PyTorch DDP (Gloo, CPU): MLP {setup['model']}, batch "
          f"{setup['batch_per_rank']}/rank, {setup['optimizer']}, {setup['steps']} steps "
          f"(first {setup['warmup_steps']} untimed), median of {report['reps']}")
    benchlib.print_machine(report)
    print("#")
    print(f"# {'world':>5} {'dptrain':>11} {'pytorch':>11} {'ratio':>7} {'ratio':>7} "
          f"{'dptrain':>8} {'pytorch':>8} {'dptrain':>9} {'pytorch':>9}")
    print(f"# {'':>5} {'samples/s':>11} {'samples/s':>11} {'median':>7} {'best':>7} "
          f"{'spread':>8} {'spread':>8} {'loss':>9} {'loss':>9}")
    for row in report["results"]:
        print(f"  {row['world_size']:>5} {row['dptrain_samples_per_s']:>11.1f} "
              f"{row['pytorch_samples_per_s']:>11.1f} "
              f"{row['ratio']:>7.2f} {row['ratio_best']:>7.2f} "
              f"{benchlib.fmt_spread(row['dptrain_spread']):>8} "
              f"{benchlib.fmt_spread(row['pytorch_spread']):>8} "
              f"{fmt_loss(row['dptrain_final_loss']):>9} {fmt_loss(row['pytorch_final_loss']):>9}")


def main():
    args = parse_args()

    def work(scratch):
        # Run directories and any recipe copy live in scratch.
        recipe_path, recipe = benchlib.recipe_with_steps(args.recipe, args.steps, scratch)
        runs = benchlib.measure(
            args, lambda side, world, rep: run_once(side, world, args, recipe_path, scratch, rep),
            lambda result: f"{result['samples_per_s']:10.1f} samples/s")
        return recipe, runs

    status, versions, box, outcome = benchlib.run_driver("mlp_vs_ddp", args, work,
                                                         "dptrain-bench-")
    if status != 0:
        return status
    recipe, runs = outcome
    results = benchlib.summarize(runs, args.world_sizes, "samples_per_s",
                                 lambda results, world: {"final_loss":
                                                         results[-1].get("final_loss")})
    report = {"benchmark": "mlp_vs_ddp", "recipe": os.path.relpath(args.recipe, REPO_DIR),
              "setup": describe(recipe), "reps": args.reps, "machine": box,
              "versions": versions, "results": results}
    benchlib.emit(report, args.json, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
