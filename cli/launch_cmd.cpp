// `dptrain launch RECIPE`: start a run on local ranks, or across hosts over SSH.
#include <cstdio>
#include <memory>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "cli/host_options.hpp"
#include "cli/json_errors.hpp"
#include "cli/run_report.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"
#include "core/recipe.hpp"
#include "core/trainer.hpp"
#include "launch/job.hpp"
#include "launch/run_dir.hpp"
#include "launch/ssh.hpp"
#include "launch/status.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

namespace {

struct LaunchOptions {
  std::string recipe;
  std::string nproc;   // "N" or "MIN:MAX"; empty: 1 without --hosts
  std::string nnodes;  // with --hosts: "N" or "MIN:MAX"; empty: every host
  std::string run_dir;
  std::string runs_root = "runs";
  std::string backend;  // empty: the recipe's distributed.backend
  HostOptions hosts;
  RemoteJobOptions remote;
  bool dry_run = false;
  RestartOptions restart;
  bool json = false;
};

JobSpec job_spec(const LaunchOptions& o) {
  JobSpec spec;
  spec.recipe = load_recipe(o.recipe);
  place_ranks(spec, o.hosts, o.nproc, o.nnodes, 1);
  spec.nominal_world = spec.world_size;
  spec.remote = o.remote.get(o.hosts);
  spec.env = o.remote.rank_env();
  spec.backend = o.backend.empty() ? spec.recipe.distributed.backend : o.backend;
  resolve_backend(spec.backend);  // refuse an unavailable backend before creating anything
  if (spec.backend == "nccl" && spec.recipe.train.device != "cuda") {
    throw Error(ErrorKind::usage,
                fmt::format("--backend nccl: {} computes on the CPU (train.device \"{}\"); NCCL "
                            "needs \"cuda\": use --backend gloo or auto",
                            o.recipe, spec.recipe.train.device));
  }
  spec.worker_binary = self_executable();
  return spec;
}

void print_dry_run(const JobSpec& spec, const std::string& run_dir, bool json,
                   const std::vector<std::string>& warnings) {
  const std::string addr = resolve_master_addr(spec);
  // A host's run directory is named as RunDirectory::remote_name names it: this one's name (as
  // resolved, without a trailing '/') and the run's id (made by the launch).
  const std::filesystem::path named = resolved_path(run_dir);
  const JobPlan plan = plan_job(spec, run_dir, named.filename().string() + "-<id>", 1, addr,
                                spec.remote.master_port, "<redacted>");
  nlohmann::json j = plan.to_json(spec);
  // A port the launch chooses (--master-port 0, the default) is not known yet: "ADDR:<port>",
  // not a store at port 0, wherever the plan names the store.
  if (spec.remote.master_port == 0 && plan.store.ends_with(":0")) {
    const std::string chosen = plan.store.substr(0, plan.store.size() - 1) + "<port>";
    const std::function<void(nlohmann::json&)> fill = [&](nlohmann::json& v) {
      if (v.is_string() && v.get<std::string>() == plan.store) v = chosen;
      if (v.is_structured()) {
        for (auto& item : v)
          fill(item);
      }
    };
    fill(j);
  }
  if (json) {
    // One line, as every --json output, with the fields of a success, and what it warned of
    // (a launch would say the same, or refuse: the GPUs, a host's name).
    j["status"] = "planned";
    j["warnings"] = warnings;
    add_success(j);
    std::printf("%s\n", json_text(j).c_str());
    return;
  }
  std::printf(
      "store %s, %d rank(s) on %zu host(s); the store secret goes through the "
      "environment only\n",
      j["store"].get<std::string>().c_str(), j["world_size"].get<int>(), plan.hosts.size());
  std::printf("%-24s %-8s %-12s %s\n", "HOST", "VIA", "RANKS", "COMMAND");
  for (const auto& h : j["hosts"]) {
    const auto ranks = h["ranks"].get<std::vector<int>>();
    const std::string range = ranks.empty() ? "-"
                              : ranks.size() == 1
                                  ? std::to_string(ranks.front())
                                  : fmt::format("{}-{}", ranks.front(), ranks.back());
    // One line a shell runs as it is: each word quoted as needed ("$HOME" in the remote
    // command is the host's, not this shell's).
    std::string command = "(spawned directly)";
    if (h.contains("command"))
      command = shell_command(h["command"].get<std::vector<std::string>>());
    std::printf("%-24s %-8s %-12s %s\n", h["host"].get<std::string>().c_str(),
                h["via"].get<std::string>().c_str(), range.c_str(), command.c_str());
    for (const auto& w : h["workers"]) {
      std::string argv;
      for (const auto& part : w["command"])
        argv += part.get<std::string>() + " ";
      std::string env;
      for (const auto& [k, v] : w["env"].items())
        env += k + "=" + v.get<std::string>() + " ";
      std::printf("  rank %d (local %d): %s\n    env: %s\n", w["rank"].get<int>(),
                  w["local_rank"].get<int>(), argv.c_str(), env.c_str());
    }
  }
}

// Refuses a --run-dir (or --runs-root) the launch could not make its run directory in.
void check_run_dir_target(const LaunchOptions& o) {
  if (!o.run_dir.empty()) {
    RunDirectory::check_new(o.run_dir);
  } else {
    RunDirectory::check_runs_root(o.runs_root);
  }
}

int start_launch(const LaunchOptions& o, bool& events_opened, Outcome& outcome) {
  // A dry run's warnings: on stderr, in its JSON, and in a JSON error that follows them.
  const auto dry_run_warning = [&](const std::string& text) {
    std::fprintf(stderr, "dptrain: warning: %s\n", text.c_str());
    outcome.warnings.push_back(text);
  };
  JobSpec spec =
      read_or_stop(o.recipe, " before the launch made anything", [&] { return job_spec(o); });
  check_runnable(spec.recipe, spec.world_size, spec.nominal_world, o.recipe);
  check_smallest_world(spec, o.recipe);
  // A host name that does not resolve: exit 4, nothing created. A plan may be drafted where the
  // cluster's names mean nothing (a laptop): there it is a warning.
  try {
    check_hosts_resolve(spec);
  } catch (const Error& e) {
    // (Without the store's address, the plan needs a host's name resolved to make one.)
    if (!o.dry_run || spec.remote.master_addr.empty() || e.kind() != ErrorKind::ssh) throw;
    dry_run_warning(std::string(e.what()) + " (the plan is shown all the same)");
  }
  check_store_port(spec);  // a --master-port another process holds: exit 2
  // One that does not parse: exit 2, nothing created; the launch warns about the others.
  const auto fault_warnings = check_fault_injection(spec);
  check_events(o.restart, o.json,
               o.run_dir);  // the plan is refused for what the launch would refuse
  // Said before "already holds a run": its workers are not to be started again, nor is a resume
  // what to do while a launcher drives it without holding its lock here (the lock file removed,
  // or a launcher on another machine; one that holds it is named by "already holds a run").
  if (!o.run_dir.empty()) {
    std::string running = running_hand_run(o.run_dir);
    if (running.empty() && !run_locked_by_another(o.run_dir)) running = driven_run(o.run_dir);
    if (!running.empty()) throw Error(ErrorKind::usage, running + "; choose another --run-dir");
  }
  try {
    check_local_gpus(spec);
  } catch (const Error& e) {
    // A plan drafted on a machine without the GPUs (a login node) still shows each rank's.
    if (!o.dry_run) throw;
    dry_run_warning(std::string(e.what()) + " (the plan is shown all the same)");
  }
  check_open_files(spec);
  check_local_memory(spec, o.recipe);
  if (o.dry_run) {
    if (const int sig = pending_stop_signal()) {
      throw stop_error(sig, "", "");
    }
    // A plan for a directory the launch would refuse (one holding a run) is refused as well.
    check_run_dir_target(o);
    for (const auto& warning : fault_warnings)
      dry_run_warning(warning);
    // The directory a launch would create (its time is filled in then), absolute as the ranks
    // are given it.
    const std::string run_dir =
        std::filesystem::absolute(!o.run_dir.empty() ? std::filesystem::path(o.run_dir)
                                                     : std::filesystem::path(o.runs_root) /
                                                           (spec.recipe.name + "-<time>"))
            .lexically_normal()
            .string();
    print_dry_run(spec, run_dir, o.json, outcome.warnings);
    return 0;
  }
  // Stopped while it read and checked (a pipeline's timeout at once): nothing is made.
  if (const int sig = pending_stop_signal()) {
    throw stop_error(sig, "", " before the launch made anything");
  }
  // A run directory the launch would refuse is refused before --events is opened: a FIFO's
  // stream would wait for a reader only to say the refusal (RunDirectory::create checks again).
  check_run_dir_target(o);
  // A bad --events path: nothing created. One in the run directory (RUN_DIR/events.jsonl) is
  // opened once the directory is made.
  const bool events_in_run = events_in_run_dir(o.restart, o.run_dir);
  events_opened = true;
  auto events =
      events_in_run ? std::make_unique<EventLog>() : open_events(o.restart, o.json, o.run_dir);
  RunDirectory run = [&] {
    try {
      return RunDirectory::create(o.run_dir, o.runs_root, spec.recipe.name);
    } catch (const std::exception& e) {
      // It made no run directory (one that holds a run is another's): run_dir is null.
      finish_events_with_failure(*events, e, "", "the launch did not start", /*started=*/false);
      throw;
    }
  }();
  outcome.run_dir = run.path().string();
  if (events_in_run) events = open_events(o.restart, o.json, o.run_dir);
  run.info()["recipe_file"] = std::filesystem::absolute(o.recipe).string();
  std::FILE* status_out = status_stream(o.json, *events);
  StatusPrinter status(status_out, StatusPrinter::is_terminal(status_out));
  const KeepWarningsOnFailure keep(status, *events, outcome.warnings);
  status.line(fmt::format("dptrain {}: {} on {} rank(s){}, run directory {}", DPTRAIN_VERSION,
                          spec.recipe.name, spec.world_size,
                          spec.hosts.empty() ? std::string(" on this machine")
                                             : fmt::format(" across {} host(s)", spec.hosts.size()),
                          printable(run.path().string())));
  return run_to_end(run, spec, o.restart, o.json, *events, status);
}

int run_launch(const LaunchOptions& o, Outcome& outcome) {
  install_stop_signal_handlers();
  o.restart.validate();
  bool events_opened = false;
  try {
    return start_launch(o, events_opened, outcome);
  } catch (const std::exception& e) {
    if (!events_opened && !o.dry_run) {
      end_unopened_events(o.restart, o.json, o.run_dir, false, e, "the launch did not start");
    }
    throw;
  }
}

}  // namespace

void setup_launch(CLI::App& app, Outcome& outcome) {
  auto o = std::make_shared<LaunchOptions>();
  app.add_option("recipe", o->recipe, "Recipe JSON file")->required();
  app.add_option("-n,--nproc", o->nproc,
                 "Number of local ranks (default 1; not with --hosts); MIN:MAX makes the job "
                 "elastic: a rank killed by SIGKILL is capacity lost, and the job continues "
                 "(restarts, --max-restarts) with one rank fewer per rank so killed while at least "
                 "MIN remain");
  app.add_option("--nnodes", o->nnodes,
                 "With --hosts: use N hosts, or MIN:MAX for an elastic job that continues on "
                 "the hosts that answer (at least MIN) when a host is lost; hosts after the "
                 "first MAX are spares");
  app.add_option("--run-dir", o->run_dir,
                 "Run directory (default: RUNS_ROOT/<name>-<UTC time>); must not hold a run");
  app.add_option("--runs-root", o->runs_root, "Where new run directories are made")
      ->capture_default_str();
  app.add_option("--backend", o->backend,
                 "Collective backend: auto, gloo or nccl (default: the recipe's "
                 "distributed.backend)");
  add_host_options(app, o->hosts, false);
  add_remote_job_options(app, o->remote);
  app.add_flag("--dry-run", o->dry_run,
               "Print the plan (hosts, ranks, commands, environment) and start nothing");
  add_restart_options(app, o->restart);
  app.add_flag("--json", o->json, "Print one JSON object with the outcome (or plan) on stdout");
  app.callback([o, &outcome] {
    outcome.json = o->json;
    outcome.exit_code = run_launch(*o, outcome);
  });
}

}  // namespace dptrain::cli
