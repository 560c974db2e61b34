// `dptrain bench train RECIPE`: training throughput and scaling of a recipe per world size.
#include <cstdio>
#include <filesystem>
#include <memory>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "cli/host_options.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/recipe.hpp"
#include "launch/bench_train.hpp"
#include "launch/job.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

namespace {

namespace fs = std::filesystem;

struct BenchTrainCliOptions {
  std::string recipe;
  std::string nproc = "1,2";
  bool nproc_given = false;
  std::string nnodes;  // with --hosts; 1, 2, 4, ... and every host unless given
  bool nnodes_given = false;
  std::string run_dir;
  std::string runs_root = "runs";
  std::string backend;
  HostOptions hosts;
  RemoteJobOptions remote;
  BenchTrainOptions bench;
  bool strong = false;
  bool json = false;
  std::string svg;
};

// The points of the sweep: local world sizes, or the first N hosts for each N of --nnodes.
std::vector<BenchWorld> sweep_worlds(const BenchTrainCliOptions& o,
                                     const std::vector<HostSpec>& hosts) {
  std::vector<BenchWorld> worlds;
  if (hosts.empty()) {
    if (o.nnodes_given) {
      throw Error(ErrorKind::usage, "--nnodes: only with --hosts (use --nproc LIST locally)");
    }
    for (int n : parse_world_list(o.nproc, "--nproc"))
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

// Refuses an --svg path that could not be written before any run starts.
void check_output_path(const std::string& file, const std::string& flag) {
  if (file.empty()) return;
  const fs::path parent = fs::absolute(file).parent_path();
  std::error_code ec;
  if (!fs::is_directory(parent, ec)) {
    throw Error(ErrorKind::usage,
                fmt::format("{} {}: the directory {} does not exist", flag, file, parent.string()));
  }
}

int run_bench_train_cmd(const BenchTrainCliOptions& o) {
  install_stop_signal_handlers();
  if (o.bench.steps < 1) {
    throw Error(ErrorKind::usage, fmt::format("--steps: must be >= 1, got {}", o.bench.steps));
  }
  if (o.bench.repeats < 1) {
    throw Error(ErrorKind::usage, fmt::format("--repeats: must be >= 1, got {}", o.bench.repeats));
  }
  check_output_path(o.svg, "--svg");
  BenchTrainOptions bench = o.bench;
  bench.scaling = o.strong ? BatchScaling::strong : BatchScaling::weak;

  JobSpec spec;
  spec.recipe = load_recipe(o.recipe);
  const std::vector<HostSpec> hosts =
      o.hosts.hosts.empty() ? std::vector<HostSpec>{} : o.hosts.load();
  const std::vector<BenchWorld> worlds = sweep_worlds(o, hosts);
  spec.remote = o.remote.get(o.hosts);
  spec.backend = o.backend.empty() ? spec.recipe.distributed.backend : o.backend;
  spec.backend = resolve_backend(spec.backend);
  spec.worker_binary = self_executable();
  // Every refusal (a world size the data or --strong cannot take) before the first run.
  check_bench_worlds(spec.recipe, worlds, bench, hosts.empty() ? "--nproc" : "--nnodes");

  BenchTrainReport report;
  report.recipe_name = spec.recipe.name;
  report.recipe_file = o.recipe;
  report.options = bench;
  report.machine = local_machine(spec.backend, spec.recipe.train.threads_per_rank);
  for (const auto& h : hosts)
    report.hosts.push_back(fmt::format("{}:{}", h.display(), h.slots));
  if (hosts.empty()) {
    const int64_t busiest = worlds.back().world * spec.recipe.train.threads_per_rank;
    if (report.machine.cpus > 0 && busiest > report.machine.cpus) {
      report.notes.push_back(fmt::format(
          "{} ranks x {} BLAS thread(s) exceed this machine's {} CPUs: past {} ranks the "
          "efficiency measures CPU contention, not communication",
          worlds.back().world, spec.recipe.train.threads_per_rank, report.machine.cpus,
          report.machine.cpus / spec.recipe.train.threads_per_rank));
    }
  }
  const fs::path sweep_dir = create_sweep_dir(o.run_dir, o.runs_root);
  report.run_dir = sweep_dir.string();

  run_bench_train(
      spec.recipe, worlds, job_runner(spec, sweep_dir),
      [](const std::string& line) {
        std::fprintf(stderr, "%s\n", line.c_str());
        std::fflush(stderr);
      },
      report);

  nlohmann::json out = report.to_json();
  out["status"] = "completed";
  write_file_atomic(sweep_dir / "bench.json", out.dump(2) + "\n");
  if (!o.svg.empty()) {
    write_file_atomic(o.svg, report.svg());
    std::fprintf(stderr, "bench train: chart written to %s\n", o.svg.c_str());
  }
  if (o.json) {
    std::printf("%s\n", out.dump().c_str());
  } else {
    std::fputs(report.table().c_str(), stdout);
  }
  std::fflush(stdout);
  return 0;
}

}  // namespace

void setup_bench_train(CLI::App& app, Outcome& outcome) {
  auto o = std::make_shared<BenchTrainCliOptions>();
  app.add_option("recipe", o->recipe, "Recipe JSON file")->required();
  auto* nproc = app.add_option("-n,--nproc", o->nproc,
                               "World sizes to run on this machine, a comma-separated list")
                    ->capture_default_str();
  auto* nnodes =
      app.add_option("--nnodes", o->nnodes,
                     "With --hosts: numbers of hosts to run on, a list (the first N hosts each "
                     "time; default 1, 2, 4, ... and all of them)");
  app.add_option("--steps", o->bench.steps,
                 "Training steps per run (the recipe's train.steps is overridden)")
      ->capture_default_str();
  app.add_option("--repeats", o->bench.repeats,
                 "Runs per world size; every number reported is their median")
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
                 "Collective backend: auto or gloo (default: the recipe's distributed.backend)");
  add_host_options(app, o->hosts, false);
  add_remote_job_options(app, o->remote);
  app.add_flag("--json", o->json, "Print one JSON object with every row on stdout");
  app.add_option("--svg", o->svg,
                 "Write a chart of throughput by world size, with ideal linear scaling, to FILE");
  app.callback([o, &outcome, nproc, nnodes] {
    o->nproc_given = nproc->count() > 0;
    o->nnodes_given = nnodes->count() > 0;
    outcome.json = o->json;
    outcome.exit_code = run_bench_train_cmd(*o);
  });
}

}  // namespace dptrain::cli
