#!/usr/bin/env python3
"""Compares dptrain with PyTorch DDP (Gloo, CPU) on the same tiny GPT, on 1 and 2 local ranks.

Usage:
  python3 bench/gpt_vs_ddp.py [--reps 3] [--world-sizes 1,2] [--steps 60] [--json]

It writes a byte-level text corpus (the license texts Debian ships in /usr/share/common-licenses,
or --corpus FILE...), turns it into a token dataset with `dptrain data prepare --tokenizer byte`,
derives a recipe from recipes/gpt-tiny.json (that dataset, --steps steps, no periodic evaluation
or checkpoints), and trains it with `dptrain launch` and with bench/gpt_ddp_peer.py, the same
model in PyTorch. Each repetition runs every (world size, side) pair once, alternating which side
goes first; the table reports the median steady-state tokens/s of each side and the ratio
dptrain / PyTorch, and a second table where each side's step time goes. Needs a dptrain binary
with the gpt model (`make build`) and Debian's python3-torch for /usr/bin/python3. Only the
standard library is used here, so any python3 can run the driver. See bench/README.md.
"""

import argparse
import glob
import json
import os
import shutil
import statistics
import sys

import benchlib
from benchlib import REPO_DIR, BenchError

LICENSES_DIR = "/usr/share/common-licenses"


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipe", default=os.path.join(REPO_DIR, "recipes", "gpt-tiny.json"),
                        help="the GPT recipe the benchmark recipe is derived from "
                             "(default: %(default)s)")
    benchlib.add_binary_arguments(parser)
    parser.add_argument("--corpus", nargs="+", metavar="FILE",
                        help=f"text files to train on, concatenated in the order given "
                             f"(default: every file in {LICENSES_DIR}, sorted, links followed "
                             f"once)")
    benchlib.add_repetition_arguments(parser, reps=3)
    parser.add_argument("--steps", type=int, default=60,
                        help="training steps per run, the first min(10, steps/5) untimed "
                             "(default: %(default)s)")
    benchlib.add_output_arguments(parser)
    args = parser.parse_args()
    benchlib.check_repetition_arguments(parser, args)
    if args.steps < 2 or args.steps <= min(10, args.steps // 5):
        parser.error(f"--steps: {args.steps} leaves no timed steps")
    return args


def corpus_files(given):
    """The corpus, in a fixed order: the files given, or Debian's license texts."""
    if given:
        missing = [path for path in given if not os.path.isfile(path)]
        if missing:
            raise BenchError(f"--corpus: {missing[0]}: no such file", exit_code=2)
        return list(given)
    # GPL -> GPL-3 and the like are links: each text once, by its real path, sorted.
    files = sorted({os.path.realpath(p) for p in glob.glob(os.path.join(LICENSES_DIR, "*"))
                    if os.path.isfile(p)})
    if not files:
        raise BenchError(f"{LICENSES_DIR}: no license texts to train on; pass --corpus FILE...",
                         exit_code=2)
    return files


def prepare(args, scratch):
    """Writes the corpus, the token dataset and the recipe. Returns a description of them."""
    files = corpus_files(args.corpus)
    corpus = os.path.join(scratch, "corpus.txt")
    with open(corpus, "wb") as out:
        for path in files:
            with open(path, "rb") as f:
                out.write(f.read())
    data_dir = os.path.join(scratch, "data")
    command = [args.dptrain, "data", "prepare", "--text", corpus, "--out", data_dir,
               "--tokenizer", "byte", "--json"]
    stdout, _ = benchlib.run_command(command, "dptrain data prepare", args.timeout)
    dataset = benchlib.last_json(stdout, "dptrain data prepare", command)

    recipe = benchlib.read_recipe(args.recipe)
    if recipe.get("model", {}).get("type") != "gpt":
        raise BenchError(f"{args.recipe}: /model/type: the benchmark needs a gpt recipe",
                         exit_code=2)
    recipe["data"] = {"type": "tokens", "path": data_dir}
    recipe.setdefault("train", {})["steps"] = args.steps
    schedule = recipe.setdefault("optimizer", {}).setdefault("schedule", {})
    if schedule.get("warmup", 0) > args.steps:  # dptrain refuses a warm-up past the last step
        schedule["warmup"] = args.steps
    recipe.setdefault("eval", {})["every"] = 0
    recipe.setdefault("checkpoint", {})["every"] = 0
    recipe.setdefault("log", {})["every"] = 10
    recipe_path = benchlib.write_json(os.path.join(scratch, "gpt-bench.json"), recipe, indent=2)

    # The peer reads the recipe as dptrain resolved it, every default filled in, so that the two
    # sides cannot disagree on a default (AdamW's beta1 and eps, the schedule's warm-up, ...).
    command = [args.dptrain, "recipe", "show", recipe_path]
    stdout, _ = benchlib.run_command(command, "dptrain recipe show", args.timeout)
    resolved = benchlib.last_json(stdout, "dptrain recipe show", command)
    resolved_path = benchlib.write_json(os.path.join(scratch, "gpt-bench.resolved.json"),
                                        resolved, indent=2)

    command = [args.dptrain, "recipe", "validate", recipe_path, "--json"]
    stdout, _ = benchlib.run_command(command, "dptrain recipe validate", args.timeout)
    validated = benchlib.last_json(stdout, "dptrain recipe validate", command)
    if "parameters" not in validated:
        raise BenchError(f"dptrain recipe validate --json: no parameter count: {validated}")
    return {"recipe_path": recipe_path, "resolved_path": resolved_path, "recipe": resolved,
            "dataset": dataset, "corpus_files": len(files),
            "corpus_bytes": os.path.getsize(corpus),
            "dptrain_params": int(validated["parameters"])}


def dptrain_phases(run_dir, warmup):
    """Mean step_ms and comm_ms of dptrain's logged steps past the warm-up (metrics.jsonl)."""
    step_ms, comm_ms = [], []
    try:
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
            for line in f:
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue
                if entry.get("step", 0) > warmup and "step_ms" in entry:
                    step_ms.append(float(entry["step_ms"]))
                    comm_ms.append(float(entry.get("comm_ms", 0.0)))
    except OSError:
        return None
    if not step_ms:
        return None
    # step_ms and comm_ms are each the mean of their logging window.
    return {"step": statistics.fmean(step_ms), "comm": statistics.fmean(comm_ms)}


def run_once(side, world, args, setup, scratch, rep):
    context = int(setup["recipe"]["model"]["context"])
    what = f"{side} on {world} rank(s)"
    if side == "dptrain":
        run_dir = os.path.join(scratch, f"dptrain-w{world}-r{rep}")
        result = benchlib.run_json(
            benchlib.launch_command(args, setup["recipe_path"], world, run_dir), what,
            args.timeout)
        result["phase_ms"] = dptrain_phases(run_dir, min(10, args.steps // 5))
        shutil.rmtree(run_dir, ignore_errors=True)  # the final checkpoint adds up
    else:
        # The peer stops its own ranks at --timeout; the extra 30 s leave it time to.
        result = benchlib.run_json(
            benchlib.peer_command(args, "gpt_ddp_peer.py", setup["resolved_path"], world), what,
            args.timeout + 30)
        if result.get("params") != setup["dptrain_params"]:
            raise BenchError(f"the PyTorch model has {result.get('params')} parameters, "
                             f"dptrain's {setup['dptrain_params']}: the two sides do not build "
                             f"the same GPT", exit_code=1)
    benchlib.check_result(result, what, world)
    # tokens/s = samples/s x context on both sides (a sample is one window of context tokens).
    result["tokens_per_s"] = result["samples_per_s"] * context
    return result


def mean_phases(results):
    phases = [r["phase_ms"] for r in results if r.get("phase_ms")]
    if not phases:
        return None
    return {key: statistics.fmean(p[key] for p in phases) for key in phases[0]}


def side_fields(results, world, batch_per_rank):
    return {
        "final_loss": statistics.median(
            r["final_loss"] for r in results if isinstance(r.get("final_loss"), (int, float))),
        # Milliseconds one step takes, from the median throughput: every rank does one
        # batch_per_rank batch a step, so this is the time per rank's step.
        "step_ms": (1000.0 * world * batch_per_rank
                    / statistics.median(r["samples_per_s"] for r in results)),
        "phase_ms": mean_phases(results)}


def describe(setup, args, runs):
    recipe = setup["recipe"]
    model, train, optimizer = recipe["model"], recipe["train"], recipe["optimizer"]
    return {"model": (f"gpt {model['layers']} layers, {model['heads']} heads, width "
                      f"{model['width']}, context {model['context']}, vocab {model['vocab']}, "
                      f"mlp x{model['mlp_ratio']}"),
            "params_dptrain": setup["dptrain_params"],
            # run_once() already refused a run whose count differs; shown so the reader sees it.
            "params_pytorch": next(r["params"] for (side, _), results in runs.items()
                                   if side == "pytorch" for r in results),
            "batch_per_rank": train["batch_per_rank"], "context": model["context"],
            "threads_per_rank": train.get("threads_per_rank", 1),
            "steps": args.steps, "warmup_steps": min(10, args.steps // 5),
            "optimizer": (f"{optimizer['type']} lr {optimizer['lr']} wd "
                          f"{optimizer.get('weight_decay', 0)} clip "
                          f"{optimizer.get('clip_grad_norm', 0)}"),
            "corpus_files": setup["corpus_files"], "corpus_bytes": setup["corpus_bytes"],
            # The dataset's counts; its path named a temporary folder, gone by now.
            "dataset": {k: v for k, v in setup["dataset"].items() if k != "path"}}


def fmt_loss(loss):
    return benchlib.fmt_or_dash(loss, ".4g")


def fmt_ms(value):
    return benchlib.fmt_or_dash(value, ".1f")


def print_table(report):
    setup = report["setup"]
    print(f"# dptrain vs PyTorch DDP (Gloo, CPU): {setup['model']}; parameters: dptrain "
          f"{setup['params_dptrain']}, pytorch {setup['params_pytorch']}")
    print(f"# batch {setup['batch_per_rank']}/rank x {setup['context']} tokens, "
          f"{setup['threads_per_rank']} thread/rank, {setup['optimizer']}, {setup['steps']} steps "
          f"(first {setup['warmup_steps']} untimed), median of {report['reps']}")
    print(f"# data: {setup['corpus_bytes']} bytes of text from {setup['corpus_files']} file(s), "
          f"byte tokenizer")
    benchlib.print_machine(report)
    print("#")
    print(f"# {'world':>5} {'dptrain':>10} {'pytorch':>10} {'ratio':>7} {'ratio':>7} "
          f"{'dptrain':>8} {'pytorch':>8} {'dptrain':>8} {'pytorch':>8}")
    print(f"# {'':>5} {'tokens/s':>10} {'tokens/s':>10} {'median':>7} {'best':>7} "
          f"{'spread':>8} {'spread':>8} {'loss':>8} {'loss':>8}")
    for row in report["results"]:
        print(f"  {row['world_size']:>5} {row['dptrain_tokens_per_s']:>10.0f} "
              f"{row['pytorch_tokens_per_s']:>10.0f} "
              f"{row['ratio']:>7.2f} {row['ratio_best']:>7.2f} "
              f"{benchlib.fmt_spread(row['dptrain_spread']):>8} "
              f"{benchlib.fmt_spread(row['pytorch_spread']):>8} "
              f"{fmt_loss(row['dptrain_final_loss']):>8} {fmt_loss(row['pytorch_final_loss']):>8}")
    print("#")
    print("# where a step goes, ms per rank (step: from the median tokens/s; dptrain all-reduce:")
    print("# mean comm_ms of metrics.jsonl, the rest is forward + backward + clip + AdamW; "
          "pytorch:")
    print("# forward, backward with DDP's overlapped all-reduce, clip + AdamW, timed on rank 0)")
    print(f"# {'world':>5} {'dptrain':>8} {'dptrain':>8} {'dptrain':>8} {'pytorch':>8} "
          f"{'pytorch':>8} {'pytorch':>8} {'pytorch':>8}")
    print(f"# {'':>5} {'step':>8} {'allred.':>8} {'rest':>8} {'step':>8} {'forward':>8} "
          f"{'backward':>8} {'optim.':>8}")
    for row in report["results"]:
        dp = row["dptrain_phase_ms"] or {}
        pt = row["pytorch_phase_ms"] or {}
        rest = row["dptrain_step_ms"] - dp["comm"] if "comm" in dp else None
        print(f"  {row['world_size']:>5} {fmt_ms(row['dptrain_step_ms']):>8} "
              f"{fmt_ms(dp.get('comm')):>8} {fmt_ms(rest):>8} {fmt_ms(row['pytorch_step_ms']):>8} "
              f"{fmt_ms(pt.get('forward')):>8} {fmt_ms(pt.get('backward')):>8} "
              f"{fmt_ms(pt.get('optimizer')):>8}")


def main():
    args = parse_args()

    def work(scratch):
        # The corpus, dataset, recipes and run directories live in scratch.
        setup = prepare(args, scratch)
        print(f"dataset: {setup['corpus_bytes']} bytes -> {scratch}/data; model: "
              f"{setup['dptrain_params']} parameters", file=sys.stderr, flush=True)
        runs = benchlib.measure(
            args, lambda side, world, rep: run_once(side, world, args, setup, scratch, rep),
            lambda result: (f"{result['tokens_per_s']:10.1f} tokens/s, loss "
                            f"{fmt_loss(result.get('final_loss'))}"))
        return setup, runs

    status, versions, box, outcome = benchlib.run_driver(
        "gpt_vs_ddp", args, work, "dptrain-gpt-bench-", modules=("numpy",))
    if status != 0:
        return status
    setup, runs = outcome
    batch = int(setup["recipe"]["train"]["batch_per_rank"])
    results = benchlib.summarize(runs, args.world_sizes, "tokens_per_s",
                                 lambda results, world: side_fields(results, world, batch))
    report = {"benchmark": "gpt_vs_ddp", "recipe": os.path.relpath(args.recipe, REPO_DIR),
              "setup": describe(setup, args, runs), "reps": args.reps, "machine": box,
              "versions": versions, "results": results}
    benchlib.emit(report, args.json, print_table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
