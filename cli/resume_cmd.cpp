// `dptrain resume RUN_DIR`: continue a run from its newest valid checkpoint.
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <system_error>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/commands.hpp"
#include "cli/host_options.hpp"
#include "cli/json_errors.hpp"
#include "cli/run_report.hpp"
#include "core/checkpoint.hpp"
#include "core/error.hpp"
#include "core/json_error.hpp"
#include "core/recipe.hpp"
#include "core/trainer.hpp"
#include "launch/job.hpp"
#include "launch/report.hpp"
#include "launch/run_dir.hpp"
#include "launch/status.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

namespace fs = std::filesystem;

namespace {

struct ResumeOptions {
  std::string run_dir;
  std::string nproc;   // "N" or "MIN:MAX"; empty: the recorded world size
  std::string nnodes;  // with --hosts: "N" or "MIN:MAX"; empty: every host
  HostOptions hosts;
  RemoteJobOptions remote;
  RestartOptions restart;
  bool json = false;
};

// The hosts of this resume: --hosts, else those the run recorded (a run on remote hosts goes on
// on them), reached with the SSH files the launch recorded unless --identity or --known-hosts
// gives others. --nproc without --hosts on such a run is refused: its checkpoints are there.
HostOptions resume_hosts(const ResumeOptions& o, const RunDirectory& run, StatusPrinter& status) {
  HostOptions hosts = o.hosts;
  nlohmann::json recorded = run.info().value("remote", nlohmann::json::object());
  if (!recorded.is_object()) recorded = nlohmann::json::object();
  const std::string run_json = printable((run.path() / "run.json").string());
  if (hosts.identities.empty() && recorded.value("identities", nlohmann::json()).is_array()) {
    for (const auto& id : recorded["identities"]) {
      if (!id.is_string()) continue;
      // One since removed is said and left out: the host's own key= and the defaults remain.
      std::error_code ec;
      if (fs::is_regular_file(id.get<std::string>(), ec)) {
        hosts.identities.push_back(id.get<std::string>());
      } else {
        status.warning(
            fmt::format("{}: remote.identities: {} is no longer a file; resuming "
                        "without it (give --identity for another)",
                        run_json, printable(id.get<std::string>())));
      }
    }
  }
  if (hosts.known_hosts.empty() && recorded.value("known_hosts", nlohmann::json()).is_string())
    hosts.known_hosts = recorded["known_hosts"].get<std::string>();
  if (!o.hosts.hosts.empty()) return hosts;
  hosts.recorded = recorded_remote_hosts(run.info(), run.path() / "run.json");
  if (!hosts.recorded.empty() && !o.nproc.empty()) {
    // As a hostfile's lines: the form that gives each again as it was ("user@host:port" pasted
    // into --hosts would make the port a slot count).
    std::vector<std::string> lines;
    for (const auto& line : recorded_host_lines(run.info()))
      lines.push_back("'" + line + "'");
    throw Error(ErrorKind::usage,
                fmt::format("--nproc: {} used hosts: resume without --nproc to use them again, "
                            "or give --hosts FILE (they were, as a hostfile's lines: {})",
                            o.run_dir, fmt::join(lines, ", ")));
  }
  // A record from before the SSH files were kept: the launch's may have been others.
  if (!hosts.recorded.empty() && !recorded.contains("known_hosts") && o.hosts.known_hosts.empty() &&
      o.hosts.identities.empty()) {
    status.warning(
        fmt::format("{} does not say which --identity and --known-hosts its launch "
                    "used (written by an older dptrain): give them again if it used "
                    "any",
                    run_json));
  }
  return hosts;
}

// The --nproc and --nnodes of this resume: its own, else the run's recorded job size where it
// fits (an elastic local run stays elastic; a run on hosts keeps its --nnodes over the hosts
// given again, its MAX at most their number).
std::pair<std::string, std::string> job_size(const ResumeOptions& o, const HostOptions& hosts,
                                             const RunDirectory& run) {
  const nlohmann::json size = run.info().value("job_size", nlohmann::json());
  if (!o.nproc.empty() || !o.nnodes.empty() || !size.is_object()) return {o.nproc, o.nnodes};
  const int least = size.value("min", 1);
  const int most = size.value("max", 1);
  const std::string of = size.value("of", std::string());
  if (!hosts.given()) {
    return {of == "ranks" ? fmt::format("{}:{}", least, most) : std::string(), std::string()};
  }
  if (of != "hosts") return {o.nproc, o.nnodes};
  const int given = static_cast<int>(hosts.load().size());
  if (given < least) {
    throw Error(ErrorKind::usage,
                fmt::format("--hosts: {} host(s) given, and the run was launched with --nnodes "
                            "{}:{} (run.json job_size): give at least {}, or --nnodes for this "
                            "resume",
                            given, least, most, least));
  }
  const int upto = std::min(most, given);
  return {std::string(), least == upto ? std::to_string(least) : fmt::format("{}:{}", least, upto)};
}

// The resume once its events stream is open.
int resume_run(const ResumeOptions& o, RunDirectory& run, EventLog& events,
               std::vector<std::string>& warned) {
  std::FILE* status_out = status_stream(o.json, events);
  StatusPrinter status(status_out, StatusPrinter::is_terminal(status_out));
  const KeepWarningsOnFailure keep(status, events, warned);
  if (run.info().value("status", nlohmann::json()) == "completed") {
    status.line(fmt::format("{}: the run already completed; nothing to resume", o.run_dir));
    // The fields a launch's outcome has, from what the run recorded: the --json outcome, and the
    // events stream's run_finished.
    JobOutcome done;
    done.status = "completed";
    // result.json, else run.json's copy (a run whose result.json is gone): load_run's.
    done.result = load_run(run.path(), false).result;
    if (!done.result.is_object()) done.result = nlohmann::json::object();
    done.world_size = run.info().value("world_size", 0);
    done.restarts = static_cast<int>(run.info().value("restarts", nlohmann::json::array()).size());
    nlohmann::json out = done.to_json(run);
    out["resumed"] = false;
    events.emit("run_finished", out);
    if (o.json) {
      add_success(out);
      std::printf("%s\n", json_text(out).c_str());
    }
    return 0;
  }
  // Checkpoints run.json records, with no checkpoints/ at all (moved away, a mount point gone):
  // the resume is refused below (exit 5) without an empty one made in their place, nor logs/.
  // Else what is in the way of the layout (a file named logs) is said first.
  std::error_code gone_ec;
  if (fs::exists(fs::symlink_status(run.checkpoints(), gone_ec)) ||
      recorded_local_checkpoint(run.info()).empty()) {
    run.make_layout();
  }
  JobSpec spec;
  const HostOptions hosts = resume_hosts(o, run, status);
  const auto [nproc, nnodes] = job_size(o, hosts, run);
  place_ranks(spec, hosts, nproc, nnodes, run.info().value("world_size", 1));
  // Remote hosts are reached as the launch recorded, unless the flags say otherwise: a run's
  // directories there are under its workdir.
  RemoteJobOptions remote = o.remote;
  const nlohmann::json recorded_remote = run.info().value("remote", nlohmann::json::object());
  if (remote.workdir.empty()) remote.workdir = recorded_remote.value("workdir", std::string());
  if (remote.remote_binary.empty()) {
    remote.remote_binary = recorded_remote.value("remote_binary", std::string());
  }
  spec.remote = remote.get(hosts);
  // The ranks get what the launch gave them with --env, and what this resume gives.
  spec.env = RankEnv::resumed(run.info().value("env", nlohmann::json::object()),
                              (run.path() / "run.json").string(), o.remote.rank_env());
  check_hosts_resolve(spec);  // a host name that does not resolve: exit 4, run.json untouched
  check_fault_syntax(spec);   // a DPTRAIN_FAULT that does not parse: exit 2, run.json untouched
  check_store_port(spec);     // a --master-port another process holds: exit 2
  if (!run.info().contains("recipe")) {
    throw Error(ErrorKind::usage,
                fmt::format("{}: run.json has no recipe (a benchmark's run?): there is nothing "
                            "to resume",
                            o.run_dir));
  }
  spec.backend = run.info().value("backend", std::string("auto"));
  spec.worker_binary = self_executable();
  // The global batch stays the run's, whatever the world size now (distributed.resize).
  spec.nominal_world = run.info().value("nominal_world_size", run.info().value("world_size", 1));
  try {
    spec.recipe = parse_recorded_recipe(run.info(), run.path());
    check_runnable(spec.recipe, spec.world_size, spec.nominal_world,
                   recorded_recipe_source(run.path()));
    check_smallest_world(spec, recorded_recipe_source(run.path()));
  } catch (const Error& e) {
    // The recipe is the run's own: its data moved or changed, which a new dataset does not cure.
    if (e.kind() != ErrorKind::recipe ||
        std::string_view(e.what()).find(": /recipe/data/path: ") == std::string_view::npos) {
      throw;
    }
    throw Error(ErrorKind::recipe,
                std::string(e.what()) +
                    "\n  this is the run's own data: put it back where the run had it (the same "
                    "data: a checkpoint refuses other), or start a new run");
  }
  check_local_gpus(spec);
  std::string where = spec.hosts.empty() ? fmt::format("{} local rank(s)", spec.world_size)
                                         : fmt::format("{} rank(s) on {} host(s)", spec.world_size,
                                                       spec.hosts.size());
  if (spec.nodes.elastic()) {
    where += fmt::format(" ({} {}:{})", spec.hosts.empty() ? "ranks" : "hosts", spec.nodes.min,
                         spec.nodes.max);
  }
  if (o.hosts.hosts.empty() && !hosts.recorded.empty()) where += ", the hosts run.json records";
  // An elastic job's first generation takes the first candidates that answer; this machine
  // always does.
  const auto& placed = spec.candidates.empty() ? spec.hosts : spec.candidates;
  const bool rank0_here = placed.empty() || placed.front().is_local();
  const bool none_here = list_checkpoints(run.checkpoints()).empty();
  // Rank 0 here now, but the last checkpoint was committed where rank 0 ran before (another
  // host): the ranks look for the newest on their nodes, as when rank 0 is elsewhere, never
  // "from step 0" (or from an older copy here) unawares.
  const bool recorded_elsewhere = remote_last_checkpoint(run.info()).has_value();
  if (rank0_here && none_here && !recorded_elsewhere) {
    // Stopped before its first checkpoint (or with checkpoints off): it starts over, as a
    // restart would.
    require_recorded_checkpoint(run);
    spec.resume_from = "newest-or-start";
    status.line(fmt::format("dptrain {}: resuming {} from step 0 (it has no checkpoint) on {}",
                            DPTRAIN_VERSION, run.path().string(), where));
  } else if (rank0_here && !recorded_elsewhere) {
    // A stop while checkpoints are verified (a large one takes seconds) ends the search before
    // the next one, and sets nothing aside.
    const auto check_stop = [] {
      throw_if_stopped(" while resume verified checkpoints (nothing was set aside)");
    };
    spec.resume_from = find_valid_checkpoint(
        run.checkpoints(), [&status](const std::string& w) { status.warning(w); },
        written_by(spec.recipe), check_stop);
    check_stop();
    set_aside_newer(run.checkpoints(), spec.resume_from, status);
    status.line(fmt::format("dptrain {}: resuming {} from {} on {}", DPTRAIN_VERSION,
                            run.path().string(), spec.resume_from.filename().string(), where));
  } else if (const nlohmann::json& recorded = run.info().value("last_checkpoint", nlohmann::json());
             recorded.is_object()) {
    // Rank 0 runs elsewhere: the ranks find the newest valid checkpoint any node holds; one was
    // committed, so finding none is a checkpoint error (exit 5), not a reason to start over.
    spec.resume_from = "newest";
    // Its host: null where rank 0 was this machine's.
    const std::string holder = recorded.contains("host") && recorded["host"].is_string()
                                   ? recorded["host"].get<std::string>()
                                   : std::string("this machine");
    status.line(fmt::format(
        "dptrain {}: resuming {} from the newest checkpoint on its hosts (the last recorded: {} "
        "on {}), on {}",
        DPTRAIN_VERSION, run.path().string(), recorded.value("path", std::string()), holder,
        where));
    // Left out of this resume, its host cannot offer it: the ranks take the newest the others
    // hold, which may be older, and the steps after that are trained again.
    if (holder != "this machine" &&
        std::none_of(placed.begin(), placed.end(),
                     [&](const HostSpec& h) { return names_host(holder, h); })) {
      status.warning(fmt::format(
          "the last recorded checkpoint (step {}) is on {}, which is not among this resume's "
          "hosts: the ranks continue from the newest checkpoint these hosts hold, which may be "
          "older (its later steps are trained again); add {} to --hosts to continue from step {}",
          recorded.value("step", int64_t{0}), holder, holder, recorded.value("step", int64_t{0})));
      spec.left_out_holder_said = holder;
    }
  } else {
    // None was ever committed (stopped before its first checkpoint): it starts over, as a
    // restart would, unless a node holds one after all.
    spec.resume_from = "newest-or-start";
    status.line(
        fmt::format("dptrain {}: resuming {} on {}: it recorded no checkpoint, so from "
                    "step 0 unless a node holds one",
                    DPTRAIN_VERSION, run.path().string(), where));
  }
  // Made now where it was not above.
  run.make_layout();
  // Too few open files for the ranks: refused before run.json changes.
  check_open_files(spec);
  check_local_memory(spec, recorded_recipe_source(run.path()));
  // A stop that came while the checkpoints were checked (large ones take seconds): no rank is
  // started, and run.json stays as it was.
  if (const int sig = pending_stop_signal()) {
    status.finish();
    throw stop_error(sig, "", " before any rank started (run.json is as it was)");
  }
  return run_to_end(run, spec, o.restart, o.json, events, status);
}

int start_resume(const ResumeOptions& o, bool& events_opened, Outcome& outcome) {
  // A bad option is refused whatever the run, also one that completed (nothing is placed then).
  o.restart.validate();
  o.remote.rank_env();
  JobSpec unplaced;
  // --nnodes without --hosts is for the hosts the run recorded: checked once they are known.
  place_ranks(unplaced, o.hosts, o.nproc, o.hosts.hosts.empty() ? "" : o.nnodes, 1);
  RunDirectory run = RunDirectory::open(o.run_dir);
  // A run directory: a failure from here on names it in the JSON error, as its events'
  // run_finished does.
  outcome.run_dir = run.path().string();
  if (o.hosts.hosts.empty() && !o.nnodes.empty()) {
    if (recorded_host_lines(run.info()).empty()) {
      place_ranks(unplaced, o.hosts, o.nproc, o.nnodes, 1);  // "--nnodes: only with --hosts"
    } else {
      parse_size_range(o.nnodes, "--nnodes");
    }
  }
  // A benchmark's world (bench train): measured, not trained; a resume would train the rest of
  // its steps as if it were a run.
  if (const nlohmann::json& bench = run.info().value("bench", nlohmann::json());
      bench.is_object() && run.info().value("status", nlohmann::json()) != "completed") {
    throw Error(ErrorKind::usage,
                fmt::format("{}: a benchmark's run (bench {}, {} rank(s)): a benchmark is not "
                            "resumed: run it again",
                            o.run_dir, bench.value("benchmark", std::string("train")),
                            bench.value("world", 0)));
  }
  // A completed one (any run) has nothing to resume, which resume_run says, exit 0.
  if (started_by_workers(run.info()) &&
      run.info().value("status", nlohmann::json()) != "completed") {
    // Their scheduler starts the ranks, not dptrain: nothing here is to be written.
    if (const std::string running = running_hand_run(o.run_dir); !running.empty()) {
      throw Error(ErrorKind::usage, running + "; nothing to resume while they do");
    }
    throw Error(ErrorKind::usage,
                fmt::format("{}: its workers were started without a launcher (by hand, srun, "
                            "mpirun): start them again with '{}' to continue it",
                            o.run_dir, hand_resume_flag(run.path())));
  }
  // A completed run is left as it is: not even locked.
  if (run.info().value("status", nlohmann::json()) == "completed") {
    events_opened = true;
    const auto events = open_events(o.restart, o.json, o.run_dir);
    return resume_run(o, run, *events, outcome.warnings);
  }
  // Found before the resume announces itself and places ranks: every generation writes here,
  // its ranks' logs under logs/ and its checkpoints under checkpoints/ (found there only once a
  // rank first checkpoints, after the steps before it were trained in vain).
  for (const fs::path& dir : {run.path(), run.logs(), run.checkpoints()}) {
    std::error_code ec;
    if (dir != run.path() && !fs::is_directory(dir, ec)) continue;  // made by the resume
    // One that cannot even be listed is the checkpoint search's to say (exit 5, as it is).
    if (dir != run.path() && ::access(dir.c_str(), R_OK | X_OK) != 0) continue;
    if (::access(dir.c_str(), W_OK) != 0) {
      throw Error(
          ErrorKind::usage,
          fmt::format(
              "{}: cannot resume it here: {} takes no writes ({})", printable(run.path().string()),
              dir == run.path() ? std::string("the directory") : dir.filename().string() + "/",
              std::strerror(errno)));
    }
  }
  check_run_files(run.path());
  // A launcher still driving the run is refused before anything is written: one on this machine
  // holds the lock; one elsewhere (a shared filesystem) shows in status's view of the run.
  run.lock();
  if (const std::string driven = driven_run(o.run_dir); !driven.empty()) {
    throw Error(ErrorKind::usage, driven + "; stop its launcher first or wait for it");
  }
  if (const RunState state = load_run(run.path(), false).state;
      state.status == "unknown" && state.recorded_status == "running") {
    // Its launcher on another machine may live (a clock ahead of this one's): two launchers
    // would drive one run.
    throw Error(ErrorKind::usage,
                fmt::format("{}: the run may still be running ({}); resume it on that machine, or "
                            "here once its stamp is in the past and status calls it stale",
                            o.run_dir, state.note));
  }
  // No launcher drives it, here or elsewhere: what a killed one left half-written is no one's.
  run.remove_dead_temporaries();
  events_opened = true;
  const auto events = open_events(o.restart, o.json, o.run_dir);
  try {
    return resume_run(o, run, *events, outcome.warnings);
  } catch (const std::exception& e) {
    // A resume that cannot start (no valid checkpoint, hosts that are gone) still ends its
    // events stream, which a pipeline reads to its run_finished; run.json is left as it was.
    finish_events_with_failure(*events, e, run.path().string(), "the resume did not start",
                               /*started=*/false);
    throw;
  }
}

int run_resume(const ResumeOptions& o, Outcome& outcome) {
  install_stop_signal_handlers();
  bool events_opened = false;
  try {
    return start_resume(o, events_opened, outcome);
  } catch (const std::exception& e) {
    // Refused before its stream was opened (an option, a run being run, a run.json that does not
    // read): the stream still ends.
    if (!events_opened)
      end_unopened_events(o.restart, o.json, o.run_dir, true, e, "the resume did not start");
    throw;
  }
}

}  // namespace

void setup_resume(CLI::App& app, Outcome& outcome) {
  auto o = std::make_shared<ResumeOptions>();
  app.add_option("run_dir", o->run_dir, "Run directory made by 'dptrain launch'")
      ->required()
      ->check(run_directory());
  app.add_option("-n,--nproc", o->nproc,
                 "Local ranks, N or MIN:MAX for an elastic job (default: the run's MIN:MAX if "
                 "it was elastic, else its recorded world size); on another world size the "
                 "global batch stays the run's (see distributed.resize)");
  app.add_option("--nnodes", o->nnodes,
                 "With --hosts, or on the hosts run.json records: N hosts, or MIN:MAX "
                 "elastically; hosts after the first MAX are spares (default: the run's "
                 "--nnodes, MAX at most the hosts given; else every host)");
  add_host_options(app, o->hosts, false);
  add_remote_job_options(app, o->remote);
  add_restart_options(app, o->restart);
  app.add_flag("--json", o->json, "Print one JSON object with the outcome on stdout");
  app.callback([o, &outcome] {
    outcome.json = o->json;
    outcome.exit_code = run_resume(*o, outcome);
  });
}

}  // namespace dptrain::cli
