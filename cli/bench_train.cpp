// `dptrain bench train RECIPE`: training throughput and scaling of a recipe per world size.
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string_view>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "cli/host_options.hpp"
#include "cli/json_errors.hpp"
#include "cli/run_report.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"
#include "core/recipe.hpp"
#include "core/tensor/device.hpp"
#include "core/trainer.hpp"
#include "launch/bench_train.hpp"
#include "launch/job.hpp"
#include "launch/run_dir.hpp"
#include "launch/status.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

namespace {

// The fewest steps per run whose steady-state means dptrain-bench-train(1) vouches for.
constexpr int64_t kBenchSteadySteps = 20;

namespace fs = std::filesystem;

struct BenchTrainCliOptions {
  std::string recipe;
  std::string nproc = "1,2";  // on cuda, unless given: 1, 2, 4, ... up to the visible GPUs
  bool nproc_given = false;
  std::string nnodes;  // with --hosts; 1, 2, 4, ... and every host unless given
  bool nnodes_given = false;
  std::string run_dir;
  std::string runs_root = "runs";
  std::string backend;
  std::string device;  // the recipe's train.device unless given
  bool device_given = false;
  std::string precision;  // the recipe's train.precision unless given; a list
  bool precision_given = false;
  double peak_tflops = 0;
  bool peak_given = false;
  int64_t batch_per_rank = 0;  // the recipe's train.batch_per_rank unless given
  bool batch_given = false;
  HostOptions hosts;
  RemoteJobOptions remote;
  BenchTrainOptions bench;
  bool strong = false;
  bool json = false;
  std::string svg;
  // --min-*: exit 6 when a row falls short (`min` holds those given).
  double min_throughput = 0, min_efficiency = 0, min_mfu = 0;
  BenchThresholds min;
};

// The points of the sweep: local world sizes, or the first N hosts for each N of --nnodes.
std::vector<BenchWorld> sweep_worlds(const BenchTrainCliOptions& o,
                                     const std::vector<HostSpec>& hosts,
                                     const std::string& device) {
  std::vector<BenchWorld> worlds;
  if (hosts.empty()) {
    if (o.nnodes_given) {
      throw Error(ErrorKind::usage, "--nnodes: only with --hosts (use --nproc LIST locally)");
    }
    // One GPU per rank: by default as many ranks as this machine has GPUs (one on one H200),
    // rather than a world of 2 that one GPU cannot run.
    const std::vector<int> sizes = device == "cuda" && !o.nproc_given
                                       ? default_node_counts(cuda_device_count())
                                       : parse_world_list(o.nproc, "--nproc");
    for (int n : sizes)
      worlds.push_back({n, {}});
    return worlds;
  }
  if (o.nproc_given) {
    throw Error(ErrorKind::usage,
                "--nproc: not with --hosts (each host's slots give its ranks; choose how many "
                "hosts with --nnodes LIST)");
  }
  const std::vector<int> counts = o.nnodes_given
                                      ? parse_world_list(o.nnodes, "--nnodes")
                                      : default_node_counts(static_cast<int>(hosts.size()));
  for (int n : counts) {
    if (n > static_cast<int>(hosts.size())) {
      throw Error(ErrorKind::usage, fmt::format("--nnodes {}: {} host(s) asked for, only {} given",
                                                o.nnodes, n, hosts.size()));
    }
    BenchWorld w;
    w.hosts.assign(hosts.begin(), hosts.begin() + n);
    w.world = total_slots(w.hosts);
    worlds.push_back(w);
  }
  return worlds;
}

// "RECIPE", or "RECIPE with --device cuda --precision bf16": the source a recipe error names.
std::string override_source(const BenchTrainCliOptions& o, const std::string& precision) {
  std::string flags;
  if (o.batch_given) flags += fmt::format(" --batch-per-rank {}", o.batch_per_rank);
  if (!o.backend.empty()) flags += " --backend " + o.backend;
  if (o.device_given) flags += " --device " + o.device;
  if (o.precision_given) flags += " --precision " + precision;
  return flags.empty() ? o.recipe : o.recipe + " with" + flags;
}

// Ranks on this machine that train on cuda need a GPU each: refused before anything is created,
// naming the option (or the recipe field) that asked for cuda.
void check_local_gpus_for(const BenchTrainCliOptions& o, const BenchWorld& largest) {
  require_local_gpus(
      largest.hosts, largest.world,
      fmt::format("{} (world size {})",
                  o.device_given ? "--device cuda" : "train.device \"cuda\" (the recipe's)",
                  largest.world));
}

// --svg's file is replaced by the chart (a rename), found before any run: never a file in a run
// directory, and never one that holds something else (the recipe benchmarked, a dataset's
// tokens): a file there already is replaced only when it is a chart itself (or empty).
void check_svg_output(const std::string& given) {
  check_output_file("--svg", given, "the SVG file");
  if (const auto run = run_dir_holding(std::filesystem::absolute(given))) {
    throw Error(ErrorKind::usage,
                fmt::format("--svg {}: inside the run directory {}, whose files a chart must not "
                            "replace; name a file outside every run directory",
                            given, run->string()));
  }
  check_replaceable("--svg", given, "<svg", "a chart");
}

// A sweep a failed or stopped run ended: the rows measured before it are kept (SWEEP/bench.json
// with "partial": true) and printed, as bench comm keeps its sizes, then the error and the failed
// run's directory; with --json, one object with them, the sweep's directory and the failure's
// fields.
int report_unfinished(const BenchTrainCliOptions& o, const BenchTrainReport& report,
                      const fs::path& sweep_dir, const fs::path& failed_run, const Error& e,
                      const std::vector<std::string>& warnings) {
  const ErrorKind kind = kind_after_stop(e.kind());
  const int code = exit_code(kind);
  nlohmann::json out = report.rows.empty() ? nlohmann::json::object() : report.to_json();
  if (!report.rows.empty()) out["partial"] = true;
  out["benchmark"] = "train";  // which benchmark, before any row too
  // A run that failed is "failed", as launch says; a refusal before any run (a world's recipe)
  // or a stop between runs is the command's own.
  out["status"] = failed_run.empty() ? failure_status(kind) : run_failure_status(kind);
  out["run_dir"] = sweep_dir.string();
  out["failed_run_dir"] = failed_run.empty() ? nlohmann::json() : nlohmann::json(failed_run);
  out["warnings"] = warnings;
  add_failure(out, code, e.what());
  if (!report.rows.empty()) {
    try {
      write_file_atomic(sweep_dir / "bench.json", json_text(out, 2) + "\n");
    } catch (const Error& unwritten) {
      // A full disk must not hide the benchmark's own end.
      std::fprintf(stderr, "dptrain: warning: %s (the partial result is not kept)\n",
                   unwritten.what());
    }
  }
  if (o.json) {
    std::printf("%s\n", json_text(out).c_str());
  } else if (!report.rows.empty()) {
    std::fputs(report.table().c_str(), stdout);
    std::printf("# Partial: %zu row(s) measured before the end (see the error)\n",
                report.rows.size());
  }
  std::fflush(stdout);
  print_error_lines(e.what());
  if (!failed_run.empty()) {
    std::fprintf(stderr, "dptrain: run directory: %s (console.log, logs/)\n",
                 printable(failed_run.string()).c_str());
  }
  return code;
}

int run_bench_train_cmd(const BenchTrainCliOptions& o) {
  install_stop_signal_handlers();
  if (!o.svg.empty()) check_svg_output(o.svg);  // before any run
  BenchTrainOptions bench = o.bench;
  bench.scaling = o.strong ? BatchScaling::strong : BatchScaling::weak;

  if (o.device_given && o.device != "cpu" && o.device != "cuda") {
    throw Error(ErrorKind::usage,
                fmt::format("--device {}: unknown device (use cpu or cuda)", o.device));
  }
  Recipe loaded = read_or_stop(o.recipe, "", [&] { return load_recipe(o.recipe); });
  if (o.batch_given) loaded.train.batch_per_rank = o.batch_per_rank;
  // Validated with the recipe below: nccl on a CPU recipe is the recipe's error, exit 2.
  if (!o.backend.empty()) loaded.distributed.backend = o.backend;
  const std::string device = o.device_given ? o.device : loaded.train.device;
  bench.precisions = o.precision_given ? parse_precision_list(o.precision, "--precision")
                                       : std::vector<std::string>{loaded.train.precision};
  // Each precision with the device, validated as the ranks will parse it (bf16 on the CPU is the
  // recipe's own error naming /train/precision).
  JobSpec spec;
  for (const auto& precision : bench.precisions) {
    Recipe r = with_device_and_precision(loaded, device, precision, override_source(o, precision));
    if (precision == bench.precisions.front()) spec.recipe = std::move(r);
  }
  if (o.hosts.hosts.empty()) o.hosts.check_files();
  const std::vector<HostSpec> hosts =
      o.hosts.hosts.empty() ? std::vector<HostSpec>{} : o.hosts.load();
  const std::vector<BenchWorld> worlds = sweep_worlds(o, hosts, device);
  if (device == "cuda") check_local_gpus_for(o, worlds.back());
  spec.remote = o.remote.get(o.hosts);
  spec.env = o.remote.rank_env();
  spec.backend = resolve_backend(spec.recipe.distributed.backend);
  spec.worker_binary = self_executable();
  // Every refusal (a world size the data or --strong cannot take, a host name that does not
  // resolve, a DPTRAIN_FAULT that does not parse) before anything is made.
  // The data first, whatever the world size: a dataset that is not there is the recipe's
  // problem, named by its file, not by the world-size flag.
  try {
    recipe_training_samples(spec.recipe);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::recipe) throw;
    throw Error(ErrorKind::recipe, RecipeSource(o.recipe).place(e.what()));
  }
  check_bench_worlds(spec.recipe, worlds, bench, hosts.empty() ? "--nproc" : "--nnodes",
                     override_source(o, bench.precisions.front()));
  std::vector<std::string> fault_warnings;  // faults that fire in no run of the sweep
  {
    JobSpec largest = spec;
    largest.recipe.train.steps = bench.steps;  // as every run has it (bench_recipe)
    largest.recipe.checkpoint.every = 0;
    largest.hosts = worlds.back().hosts;
    largest.world_size = worlds.back().world;
    check_hosts_resolve(largest);
    check_store_port(largest);
    // As launch refuses it: a model whose ranks cannot fit in this machine's memory.
    check_local_memory(largest, o.recipe);
    fault_warnings = check_fault_injection(largest, 0, 1, true);
  }

  BenchTrainReport report;
  report.recipe_name = spec.recipe.name;
  report.recipe_file = fs::absolute(o.recipe).string();  // as every path the JSON holds
  report.options = bench;
  // "auto" on CPU ranks is always Gloo (NCCL needs every rank on a GPU): the header says which.
  report.machine = local_machine(device == "cpu" && spec.backend == "auto" ? "gloo" : spec.backend,
                                 spec.recipe.train.threads_per_rank, device);
  for (const auto& h : hosts)
    report.hosts.push_back(fmt::format("{}:{}", h.display(), h.slots));
  if (o.peak_given) {
    report.peak_tflops = o.peak_tflops;
    report.peak_source = "--peak-tflops";
  } else if (device == "cuda") {
    report.peak_tflops = kDefaultCudaPeakTflops;
    report.peak_source =
        "H100/H200 dense bf16, the default on cuda; the same peak for every precision";
    const std::string& gpu = report.machine.gpu_model;
    if (!gpu.empty() && gpu.find("H100") == std::string::npos &&
        gpu.find("H200") == std::string::npos) {
      report.notes.push_back(fmt::format(
          "MFU is against the H100/H200's {:g} TFLOP/s, not the {}'s: give --peak-tflops for it",
          kDefaultCudaPeakTflops, gpu));
    }
  }
  if (hosts.empty() && device == "cpu") {
    const int64_t busiest = worlds.back().world * spec.recipe.train.threads_per_rank;
    if (report.machine.cpus > 0 && busiest > report.machine.cpus) {
      report.notes.push_back(fmt::format(
          "{} ranks x {} BLAS thread(s) exceed this machine's {} CPUs: past {} ranks the "
          "efficiency measures CPU contention, not communication",
          worlds.back().world, spec.recipe.train.threads_per_rank, report.machine.cpus,
          report.machine.cpus / spec.recipe.train.threads_per_rank));
    }
  }
  // Fewer steps than the man page asks for: the first steps' set-up weighs on the means.
  if (bench.steps < kBenchSteadySteps) {
    report.notes.push_back(fmt::format(
        "--steps {}: the means leave out only the first {} step(s) (min(10, steps/5)), so "
        "allocation and the first collectives weigh on them; give --steps {} or more",
        bench.steps, warmup_steps(bench.steps), kBenchSteadySteps));
  }
  if (o.min.mfu_percent && !report.peak_tflops) {
    throw Error(ErrorKind::usage,
                "--min-mfu: MFU needs a peak: give --peak-tflops (on cuda it defaults to 989)");
  }
  const fs::path sweep_dir = create_sweep_dir(o.run_dir, o.runs_root);
  report.run_dir = sweep_dir.string();

  std::vector<std::string> warnings;  // what stderr warned of, for --json
  {
    // A line per run; on a terminal also the running one's progress, rewritten in place.
    StatusPrinter terminal(stderr, StatusPrinter::is_terminal(stderr));
    for (const auto& warning : fault_warnings)
      terminal.warning(warning);
    fs::path failed_run;
    try {
      run_bench_train(
          spec.recipe, worlds, job_runner(spec, sweep_dir, &terminal, &failed_run),
          [&terminal](const std::string& line) { terminal.line(line); }, report);
    } catch (const Error& e) {
      terminal.finish();
      return report_unfinished(o, report, sweep_dir, failed_run, e, terminal.warnings());
    }
    warnings = terminal.warnings();
  }

  nlohmann::json out = report.to_json();
  out["warnings"] = warnings;
  const std::vector<std::string> shortfalls = report.shortfalls(o.min);
  const int exit_code = shortfalls.empty() ? 0 : 6;
  out["status"] = shortfalls.empty() ? "completed" : "below_threshold";
  // In the rows' units: a fraction for MFU (the option is in percent).
  if (o.min.throughput) out["min_throughput"] = *o.min.throughput;
  if (o.min.efficiency) out["min_efficiency"] = *o.min.efficiency;
  if (o.min.mfu_percent) out["min_mfu"] = *o.min.mfu_percent / 100.0;
  if (exit_code != 0) {
    add_failure(out, exit_code, shortfalls);
  } else {
    add_success(out);
  }
  write_file_atomic(sweep_dir / "bench.json", json_text(out, 2) + "\n");
  if (!o.svg.empty()) {
    write_file_atomic(o.svg, report.svg());
    std::fprintf(stderr, "bench train: chart written to %s\n", o.svg.c_str());
  }
  if (o.json) {
    std::printf("%s\n", json_text(out).c_str());
  } else {
    std::fputs(report.table().c_str(), stdout);
  }
  std::fflush(stdout);
  for (const auto& line : shortfalls)
    std::fprintf(stderr, "dptrain: error: %s\n", line.c_str());
  return exit_code;
}

}  // namespace

void setup_bench_train(CLI::App& app, Outcome& outcome) {
  auto o = std::make_shared<BenchTrainCliOptions>();
  app.add_option("recipe", o->recipe, "Recipe JSON file")->required();
  auto* nproc = app.add_option("-n,--nproc", o->nproc,
                               "World sizes to run on this machine, a comma-separated list (on "
                               "cuda the default is 1, 2, 4, ... up to the visible GPUs)")
                    ->capture_default_str();
  auto* nnodes =
      app.add_option("--nnodes", o->nnodes,
                     "With --hosts: numbers of hosts to run on, a list (the first N hosts each "
                     "time; default 1, 2, 4, ... and all of them)");
  app.add_option("--steps", o->bench.steps,
                 "Training steps per run (the recipe's train.steps is overridden)")
      ->check(whole_number<int64_t>("N", kMaxSteps, 1))
      ->capture_default_str();
  app.add_option("--repeats", o->bench.repeats,
                 "Runs per world size; every number reported is their median")
      ->check(whole_number<int>("N", std::numeric_limits<int>::max(), 1))
      ->capture_default_str();
  app.add_flag("--strong", o->strong,
               "Strong scaling: keep the smallest world's global batch (batch_per_rank shrinks "
               "as the world grows); default weak scaling: batch_per_rank stays");
  app.add_option("--run-dir", o->run_dir,
                 "Directory for the sweep, one run directory per world size in it (default: "
                 "RUNS_ROOT/bench-train-<UTC time>); must be absent or empty");
  app.add_option("--runs-root", o->runs_root, "Where the sweep's directory is made")
      ->capture_default_str();
  app.add_option("--backend", o->backend,
                 "Collective backend: auto, gloo or nccl (default: the recipe's "
                 "distributed.backend)");
  auto* device = app.add_option(
      "--device", o->device, "cpu or cuda (one GPU per rank); default: the recipe's train.device");
  auto* precision =
      app.add_option("--precision", o->precision,
                     "fp32, bf16, fp16, or a list such as bf16,fp32: one sweep per precision, and "
                     "their throughput ratio (default: the recipe's train.precision)");
  auto* batch = app.add_option("--batch-per-rank", o->batch_per_rank,
                               "Samples (sequences) per rank and micro-batch (default: the "
                               "recipe's train.batch_per_rank)")
                    ->check(whole_number<int64_t>("N", std::numeric_limits<int64_t>::max(), 1));
  auto* peak = app.add_option("--peak-tflops", o->peak_tflops,
                              "One device's peak TFLOP/s for MFU (default on cuda: 989, the "
                              "H100/H200 dense bf16 peak; on cpu MFU is n/a without it)")
                   ->check(positive_number());
  add_host_options(app, o->hosts, false);
  add_remote_job_options(app, o->remote);
  app.add_flag("--json", o->json, "Print one JSON object with every row on stdout");
  app.add_option("--svg", o->svg,
                 "Write a chart of throughput by world size, with ideal linear scaling, to FILE");
  // For CI: a throughput, scaling or MFU regression fails the job (exit 6).
  auto* throughput = app.add_option("--min-throughput", o->min_throughput,
                                    "Exit 6 when a precision's largest world measures fewer "
                                    "tokens/s (samples/s for models without tokens)")
                         ->check(non_negative_number());
  auto* efficiency =
      app.add_option("--min-efficiency", o->min_efficiency,
                     "Exit 6 when a world's scaling efficiency (a fraction) is below this")
          ->check(number_at_most(1, "FRACTION", "it is a fraction: 0.8 for 80%"));
  auto* mfu = app.add_option("--min-mfu", o->min_mfu,
                             "Exit 6 when a precision's largest world's MFU is below this "
                             "percentage (needs a peak: cuda, or --peak-tflops)")
                  ->check(number_at_most(100, "PERCENT", "a percentage"));
  app.callback(
      [o, &outcome, nproc, nnodes, peak, batch, device, precision, throughput, efficiency, mfu] {
        if (throughput->count() > 0) o->min.throughput = o->min_throughput;
        if (efficiency->count() > 0) o->min.efficiency = o->min_efficiency;
        if (mfu->count() > 0) o->min.mfu_percent = o->min_mfu;
        o->nproc_given = nproc->count() > 0;
        o->nnodes_given = nnodes->count() > 0;
        o->peak_given = peak->count() > 0;
        o->batch_given = batch->count() > 0;
        o->device_given = device->count() > 0;
        o->precision_given = precision->count() > 0;
        outcome.json = o->json;
        outcome.exit_code = run_bench_train_cmd(*o);
      });
}

}  // namespace dptrain::cli
