"""Code shared by the bench/ drivers and their PyTorch peers.

Driver side (any python3, standard library only): arguments, prerequisites, versions, machine
facts, recipes, running dptrain and a peer, interleaved repetitions, medians and spreads, the
shared table lines, a driver's main. Peer side (Debian's /usr/bin/python3 with python3-torch):
recipe defaults and checks, one Gloo rank from MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, the timed
training loop, the result line, spawning the ranks, a peer's main. torch is imported only inside
the functions a rank calls, so that the drivers can import this module without it.
"""

import argparse
import datetime
import importlib.util
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_DIR = os.path.dirname(BENCH_DIR)
SIDES = ("dptrain", "pytorch")
DEFAULT_DPTRAIN = os.path.join(REPO_DIR, "build", "dptrain")
DEFAULT_TORCH_PYTHON = "/usr/bin/python3"


# ---------------------------------------------------------------------------------------------
# Driver side
# ---------------------------------------------------------------------------------------------


class BenchError(Exception):
    """A one-line reason the benchmark cannot run or finish; `exit_code` says which."""

    def __init__(self, message, exit_code=1):
        super().__init__(message)
        self.exit_code = exit_code


def add_binary_arguments(parser):
    parser.add_argument("--dptrain", default=DEFAULT_DPTRAIN,
                        help="the dptrain binary (default: %(default)s)")
    parser.add_argument("--torch-python", default=DEFAULT_TORCH_PYTHON,
                        help="interpreter that has PyTorch (default: %(default)s)")


def add_repetition_arguments(parser, reps):
    parser.add_argument("--world-sizes", default="1,2", help="comma-separated (default: 1,2)")
    parser.add_argument("--reps", type=int, default=reps,
                        help="repetitions; the median is reported (default: %(default)s)")


def add_output_arguments(parser):
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds for one run")
    parser.add_argument("--json", action="store_true", help="print one JSON object, not a table")


def check_repetition_arguments(parser, args):
    """Turns --world-sizes into a list of integers; stops with a usage error on a bad value."""
    try:
        args.world_sizes = [int(w) for w in args.world_sizes.split(",")]
    except ValueError:
        parser.error(f"--world-sizes: expected comma-separated integers, not {args.world_sizes!r}")
    if args.reps < 1 or any(w < 1 for w in args.world_sizes):
        parser.error("--reps and every world size must be at least 1")


def check_prerequisites(args, modules=()):
    """Fails early with what to do, rather than halfway through the runs. Returns versions.

    `modules`: what the peer imports besides torch (numpy for the GPT peer)."""
    if not os.path.isfile(args.dptrain) or not os.access(args.dptrain, os.X_OK):
        raise BenchError(f"{args.dptrain}: no dptrain binary; build it with `make build` at the "
                         f"repo root (or pass --dptrain PATH)", exit_code=2)
    imports = ", ".join(["platform", *modules, "torch", "torch.distributed as d"])
    probe = subprocess.run(
        [args.torch_python, "-c",
         f"import {imports}; assert d.is_gloo_available(), "
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


def load_average():
    return os.getloadavg()[0]


def read_recipe(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise BenchError(f"{path}: cannot read the recipe: {e}", exit_code=2) from e


def write_json(path, value, indent=None):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(value, f, indent=indent)
    return path


def recipe_with_steps(path, steps_override, scratch):
    """Returns (path both sides should read, recipe as parsed); writes a copy only to override."""
    recipe = read_recipe(path)
    if steps_override is None:
        return path, recipe
    recipe.setdefault("train", {})["steps"] = steps_override
    return write_json(os.path.join(scratch, os.path.basename(path)), recipe), recipe


def stop(proc):
    """SIGTERM first: both launchers then stop their own ranks instead of orphaning them."""
    proc.terminate()
    try:
        proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()


def run_command(command, what, timeout_s, pass_stderr=False):
    """Runs a command; returns (stdout, stderr). Stops it on timeout; fails on a bad status.
    pass_stderr: the command's stderr (its progress) goes to ours instead of being kept."""
    with subprocess.Popen(command, stdout=subprocess.PIPE,
                          stderr=None if pass_stderr else subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            stop(proc)
            raise BenchError(f"{what}: did not finish within {timeout_s:.0f} s: "
                             f"{' '.join(command)}") from e
    if proc.returncode != 0:
        tail = "\n".join(((stderr or "").strip() or stdout.strip()).splitlines()[-20:])
        raise BenchError(f"{what}: exited with status {proc.returncode}: "
                         f"{' '.join(command)}\n{tail}")
    return stdout, stderr


def last_json(text, what, command):
    """The JSON object a command printed last (the contract is "ends with one object")."""
    text = text.strip()
    try:
        return json.loads(text)
    except ValueError:
        # Tolerate stray lines before the result.
        lines = text.splitlines()
        try:
            return json.loads(lines[-1])
        except (ValueError, IndexError) as e:
            raise BenchError(f"{what}: printed no JSON result: {' '.join(command)}") from e


def run_json(command, what, timeout_s, pass_stderr=False):
    """Runs a command whose stdout ends with one JSON object; stderr is kept for failures only
    (or passed on)."""
    stdout, _ = run_command(command, what, timeout_s, pass_stderr)
    return last_json(stdout, what, command)


def launch_command(args, recipe_path, world, run_dir):
    return [args.dptrain, "launch", recipe_path, "--nproc", str(world), "--run-dir", run_dir,
            "--json"]


def peer_command(args, script, recipe_path, world):
    return [args.torch_python, os.path.join(BENCH_DIR, script), recipe_path, "--nproc",
            str(world), "--json", "--timeout", str(args.timeout)]


def check_result(result, what, world):
    if not result.get("samples_per_s") or result.get("world_size") != world:
        raise BenchError(f"{what}: result lacks samples_per_s or has the wrong world_size: "
                         f"{result}")
    return result


def measure(args, run_once, progress):
    """Runs run_once(side, world, rep) for every repetition, world size and side; returns
    {(side, world): [result, ...]}. Which side goes first alternates, so a burst of load from
    other users falls on both. progress(result) describes a run on stderr."""
    runs = {(side, world): [] for side in SIDES for world in args.world_sizes}
    total, done = args.reps * len(runs), 0
    for rep in range(args.reps):
        for world in args.world_sizes:
            order = SIDES if (rep + world) % 2 == 0 else tuple(reversed(SIDES))
            for side in order:
                result = run_once(side, world, rep)
                runs[(side, world)].append(result)
                done += 1
                print(f"[{done}/{total}] {side:7} world {world}: {progress(result)}",
                      file=sys.stderr, flush=True)
    return runs


def spread(values):
    """Half the min-max range relative to the median: how far to trust a ratio of medians."""
    return (max(values) - min(values)) / (2 * statistics.median(values))


def summarize(runs, world_sizes, metric, side_fields):
    """One row per world size: each side's median `metric`, spread and runs, then the fields
    side_fields(results, world) adds, then the ratio of the medians and of the best runs."""
    rows = []
    for world in world_sizes:
        row = {"world_size": world}
        for side in SIDES:
            results = runs[(side, world)]
            rates = [r[metric] for r in results]
            row[f"{side}_{metric}"] = statistics.median(rates)
            row[f"{side}_spread"] = spread(rates)
            row[f"{side}_runs"] = rates
            for key, value in side_fields(results, world).items():
                row[f"{side}_{key}"] = value
        row["ratio"] = row[f"dptrain_{metric}"] / row[f"pytorch_{metric}"]
        # The least disturbed run of each side: a second opinion when the machine is busy.
        row["ratio_best"] = max(row["dptrain_runs"]) / max(row["pytorch_runs"])
        rows.append(row)
    return rows


def fmt_spread(value):
    return "±" + format(value, ".0%")


def fmt_or_dash(value, spec):
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def print_machine(report):
    """The header lines every table shares: the machine with its load, and the versions."""
    box, versions = report["machine"], report["versions"]
    print(f"# machine: {box['nproc']} cores, {box['cpu_model']}, Linux {box['kernel']}, "
          f"1-min load average {box['loadavg_1min_before']:.2f} before, "
          f"{box['loadavg_1min_after']:.2f} after")
    print(f"# versions: dptrain {versions['dptrain']}, torch {versions['torch']} "
          f"(Python {versions['torch_python']})")


def run_driver(name, args, work, scratch_prefix, modules=()):
    """A driver's frame: checks the prerequisites, calls work(scratch) with a temporary folder
    that goes away afterwards (even on failure), notes the load before and after. Returns
    (exit status, versions, machine facts, what work returned); on a BenchError prints its one
    line and returns its status with the rest None."""
    try:
        versions = check_prerequisites(args, modules)
        load_before = load_average()
        with tempfile.TemporaryDirectory(prefix=scratch_prefix) as scratch:
            outcome = work(scratch)
    except BenchError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return e.exit_code, None, None, None
    # Other users' load is the main source of noise on a shared machine; the reader should see it.
    box = dict(machine(), loadavg_1min_before=load_before, loadavg_1min_after=load_average())
    return 0, versions, box, outcome


def emit(report, as_json, print_table):
    if as_json:
        print(json.dumps(report, indent=2))
    else:
        print_table(report)


# ---------------------------------------------------------------------------------------------
# Peer side
# ---------------------------------------------------------------------------------------------


class PeerError(Exception):
    """A problem the user can fix (bad recipe, bad data, bad arguments); printed as one line."""


def with_defaults(defaults, given):
    merged = dict(defaults)
    for key, value in given.items():
        if isinstance(value, dict) and isinstance(defaults.get(key), dict):
            merged[key] = with_defaults(defaults[key], value)
        else:
            merged[key] = value
    return merged


def load_peer_recipe(path, defaults, supported):
    """The recipe with `defaults` filled in. supported(recipe) lists (JSON pointer, value,
    allowed values): a peer mirrors only what its benchmark needs, and anything else would
    silently compare different work, so it is refused."""
    try:
        with open(path, encoding="utf-8") as f:
            recipe = with_defaults(defaults, json.load(f))
    except (OSError, ValueError) as e:
        raise PeerError(f"{path}: cannot read the recipe: {e}") from e
    problems = [f"{path}: {pointer}: the PyTorch peer supports only {sorted(allowed, key=str)}, "
                f"not {value!r}"
                for pointer, value, allowed in supported(recipe) if value not in allowed]
    if problems:
        raise PeerError("\n".join(problems))
    return recipe


def decay_groups(parameters, weight_decay):
    """Parameter groups for torch.optim with dptrain's weight-decay rule (dptrain-recipe(5),
    weight_decay; Model::no_decay() in core/model/model.hpp): the tensors of two or more
    dimensions (weight matrices, embeddings) decay, the others (biases, LayerNorm gains and
    shifts) do not, in every model."""
    parameters = list(parameters)
    return [{"params": [p for p in parameters if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in parameters if p.dim() < 2], "weight_decay": 0.0}]


def warmup_steps(steps):
    # The same rule as dptrain's samples_per_s: the first min(10, steps/5) steps are excluded.
    return min(10, steps // 5)


def init_rank(threads, timeout_s):
    """Joins the Gloo group that MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE describe, with
    `threads` compute threads. Returns (torch, torch.distributed, rank, world size)."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(threads))
    torch.set_num_interop_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=float(timeout_s)))
    return torch, dist, dist.get_rank(), dist.get_world_size()


def timed_loop(dist, steps, step, on_start=None):
    """Runs step(i) for i in 0..steps-1; the clock starts after a barrier at the first step past
    the warm-up (on_start() is called then) and stops after a barrier at the end.
    Returns (the last step's loss, warm-up steps, timed seconds)."""
    warmup = warmup_steps(steps)
    if steps <= warmup or steps < 1:
        raise PeerError(f"/train/steps: {steps} leaves no timed steps after {warmup} warm-up steps")
    started, loss = None, None
    for i in range(steps):
        if i == warmup:
            dist.barrier()
            started = time.perf_counter()
            if on_start:
                on_start()
        loss = step(i)
    dist.barrier()
    return loss, warmup, time.perf_counter() - started


def finish_rank(torch, dist, loss, steps, warmup, batch, timed_s, rates=None, extra=None):
    """Averages the last loss over the ranks; rank 0 prints the result as one JSON line:
    samples_per_s, then rates(samples_per_s)'s fields, the run's figures, then `extra`'s.
    Then the process ends (end_rank())."""
    rank, world = dist.get_rank(), dist.get_world_size()
    final_loss = loss.detach().clone()
    dist.all_reduce(final_loss)
    if rank == 0:
        samples_per_s = world * batch * (steps - warmup) / timed_s
        print(json.dumps({
            "samples_per_s": samples_per_s,
            **(rates(samples_per_s) if rates else {}),
            "world_size": world,
            "steps": steps,
            "warmup_steps": warmup,
            "timed_s": timed_s,
            "final_loss": final_loss.item() / world,
            **(extra or {}),
            "torch_version": torch.__version__,
            "python_version": platform.python_version(),
        }), flush=True)
    dist.destroy_process_group()
    end_rank()


def end_rank():
    """Ends a rank's process once its result is out, without tearing torch down. torch 1.13 can
    deadlock when DDP's Reducer is freed: ~ProcessGroupGloo joins its worker thread while
    holding the GIL, and that thread waits for the GIL to free a tensor (seen in about one GPT
    run in seven on a busy machine: the result printed, then the rank hung until the timeout)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def free_port():
    # The port is free now; the tiny window before rank 0 binds it is acceptable on a test box.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(rank, world, port):
    """What a rank reads: where rank 0 listens, its rank and the world size; one thread."""
    return dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")


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


def spawn_ranks(command, nproc, timeout_s):
    """Runs `command` (a script's --worker mode) as nproc ranks; returns rank 0's last JSON line.
    Stops them all on failure. Only rank 0's stdout carries the result; the others' goes to
    stderr with the logs."""
    port = free_port()
    ranks = []
    with tempfile.TemporaryFile(mode="w+") as result_file:
        try:
            for rank in range(nproc):
                ranks.append(subprocess.Popen(
                    command, env=rank_environment(rank, nproc, port),
                    stdout=result_file if rank == 0 else sys.stderr))
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


def add_peer_arguments(parser):
    """The arguments every peer takes after its own: --json, --timeout, --worker."""
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole run")
    parser.add_argument("--worker", action="store_true",
                        help="be one rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT in env)")


def run_peer(name, args, prepare, work, worker_argv, show, needs="PyTorch"):
    """A peer's frame. prepare() checks the arguments and returns what a rank needs; with
    --worker, work(it) is this process's rank; otherwise spawns --nproc ranks of
    worker_argv(it) (this script's arguments for one rank) and prints rank 0's result as JSON
    or with show(result). Problems the user can fix are one line and status 2."""
    try:
        prepared = prepare()
        if args.worker:
            work(prepared)
            return 0
        if importlib.util.find_spec("torch") is None:
            raise ImportError("No module named 'torch'")
        # Turn SIGTERM into an exception so spawn_ranks() still stops the ranks it started.
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        if args.nproc < 1:
            raise PeerError(f"--nproc: must be at least 1, not {args.nproc}")
        result = spawn_ranks([sys.executable, *worker_argv(prepared), "--worker"], args.nproc,
                             args.timeout)
    except PeerError as e:
        print(f"{name}: {e}", file=sys.stderr)
        return 2
    except ImportError as e:
        print(f"{name}: {sys.executable} cannot import {needs} ({e}); "
              "run it with /usr/bin/python3 (Debian's python3-torch)", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    else:
        show(result)
    return 0


def peer_main(name, script, doc, load_recipe, run_rank, summary, needs="PyTorch"):
    """A training peer's command line: RECIPE --nproc N [--json] [--timeout S] spawns the ranks
    (torchrun does not work under Debian's Python 3.11); --worker is one rank, reading
    MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE, so the script also runs under an external launcher.
    summary(result) is the line printed without --json. Returns the exit status."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("recipe", help="dptrain JSON recipe (the fields in DEFAULTS are mirrored)")
    parser.add_argument("--nproc", type=int, default=1, help="local ranks (default 1)")
    add_peer_arguments(parser)
    args = parser.parse_args()
    return run_peer(name, args, lambda: load_recipe(args.recipe), run_rank,
                    lambda recipe: [os.path.abspath(script), args.recipe],
                    lambda result: print(summary(result)), needs)
