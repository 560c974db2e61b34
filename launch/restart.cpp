// The restart policy: after a rank or host failure, a new generation from the newest valid
// checkpoint, with back-off, until the job completes or the failure looks deterministic; and
// for elastic jobs, the hosts or ranks of every generation.
#include <unistd.h>

#include <algorithm>
#include <charconv>
#include <csignal>
#include <system_error>

#include <fmt/format.h>

#include "core/checkpoint.hpp"
#include "core/comm/net.hpp"
#include "core/error.hpp"
#include "core/trainer.hpp"
#include "launch/job.hpp"
#include "launch/run_dir.hpp"
#include "launch/supervisor.hpp"

namespace dptrain {

namespace fs = std::filesystem;
using nlohmann::json;

void set_aside_newer(const fs::path& checkpoints, const fs::path& chosen, StatusPrinter& status) {
  if (set_aside_newer(checkpoints, checkpoint_step(chosen),
                      [&status](const std::string& w) { status.warning(w); })) {
    point_latest_at(checkpoints, chosen);
  }
}

std::string missing_recorded_checkpoints(const fs::path& checkpoints, const json& info) {
  const std::string recorded = recorded_local_checkpoint(info);
  if (recorded.empty() || !list_checkpoints(checkpoints).empty()) return "";
  std::error_code ec;
  const bool there = fs::exists(fs::symlink_status(checkpoints, ec));
  return fmt::format(
      "{}: {}, but run.json records {} committed there: were they moved away, or "
      "is their filesystem not mounted?",
      checkpoints.string(), there ? "holds no checkpoint" : "is not there", recorded);
}

void require_recorded_checkpoint(const RunDirectory& run, std::string_view then) {
  const std::string missing = missing_recorded_checkpoints(run.checkpoints(), run.info());
  if (!missing.empty()) throw Error(ErrorKind::checkpoint, fmt::format("{} {}", missing, then));
}

namespace {

bool restartable(const JobOutcome& outcome) {
  return outcome.exit_code == 3 || outcome.exit_code == 4;
}

bool rank0_local(const JobSpec& spec) {
  return spec.hosts.empty() || spec.hosts.front().is_local();
}

std::string join(const std::vector<std::string>& parts, const std::string& sep) {
  std::string out;
  for (const auto& p : parts)
    out += (out.empty() ? "" : sep) + p;
  return out;
}

// Why a generation is being placed: the job's first, after a failure (`failed`), or after the
// ranks stopped for hosts that answer again (`grow`).
enum class Placement { first, after_failure, grow };

// Where the next generation goes: an error message when fewer than the minimum hosts or ranks
// are left; otherwise a change of world size to record (null when the size stays). `stopped`: a
// stop signal ended the wait for hosts, and nothing was placed.
struct Placed {
  std::string error;
  json change;
  bool stopped = false;
};

// Says and records a change of world size (the event, run.json's world_size_changes).
void record_world_size_change(RunDirectory& run, const JobSpec& spec, StatusPrinter& status,
                              const json& change) {
  if (change.is_null()) return;
  // A job that shrinks goes on with less than it had: a warning (stderr, --json's warnings).
  if (change.at("to").get<int>() < change.at("from").get<int>()) {
    status.warning(change.at("line").get<std::string>());
  } else {
    status.line(change.at("line").get<std::string>());
  }
  json record = change;
  record.erase("line");
  if (spec.events) spec.events->emit("world_size_changed", record);
  json& changes = run.info()["world_size_changes"];
  if (!changes.is_array()) changes = json::array();
  changes.push_back(record);
  run.record();
}

// Why an elastic job of local ranks cannot go on after `failed` took a rank's capacity (killed by
// SIGKILL) and fewer than its minimum would remain; empty when it can. Known at once: no wait
// brings the rank back.
std::string too_few_after_lost_rank(const JobSpec& spec, const JobOutcome* failed) {
  if (!spec.candidates.empty() || failed == nullptr || !failed->rank_killed() ||
      !spec.nodes.elastic()) {
    return {};
  }
  const int lost = static_cast<int>(failed->killed_ranks.size());
  if (spec.world_size - lost >= spec.nodes.min) return {};
  return fmt::format(
      "{} lost (killed by SIGKILL) and only {} would remain, fewer than the minimum of {} "
      "(--nproc {}:{})",
      lost == 1 ? "a rank was" : fmt::format("{} ranks were", lost), spec.world_size - lost,
      spec.nodes.min, spec.nodes.min, spec.nodes.max);
}

// Chooses the hosts (or local ranks) of the next generation of an elastic job.
Placed place_generation(RunDirectory& run, JobSpec& spec, StatusPrinter& status, Placement why,
                        const JobOutcome* failed = nullptr) {
  // A fixed-size job changes size only when resumed on other ranks or hosts.
  if (spec.nodes.max == 0 && why != Placement::first) return {};
  // The first generation of this invocation: the size the run last ran at (a resume), or for a
  // new run the nominal size.
  const int before = why == Placement::first ? run.info().value("world_size", spec.nominal_world)
                                             : spec.world_size;
  const std::vector<HostSpec> hosts_before = spec.hosts;
  std::vector<std::string> absent;
  std::vector<std::string> stood_in_for;  // hosts a spare took the place of, at the start
  if (!spec.candidates.empty()) {
    // A lost host gets rejoin_timeout to come back; so do a job's first hosts (--nnodes N or
    // MIN:MAX: nodes still booting, as a rendezvous waits for them). Hosts that just answered
    // again are taken as they answer now.
    const bool waits = why == Placement::after_failure || why == Placement::first;
    const std::optional<std::chrono::milliseconds> wait =
        waits ? std::optional(spec.rejoin_timeout) : std::nullopt;
    // While it waits, the launcher says it is alive, as it does while a generation runs.
    auto stamped = std::chrono::steady_clock::now();
    const HostSelection sel = select_hosts(
        spec.candidates, spec.nodes.max, wait, ssh_probe(spec.remote.ssh),
        [&run, &stamped] {
          if (std::chrono::steady_clock::now() - stamped >= std::chrono::seconds(kAliveEveryS)) {
            stamped = std::chrono::steady_clock::now();
            run.info()["alive_at"] = utc_timestamp();
            run.record();
          }
          return pending_stop_signal() != 0;
        },
        std::chrono::milliseconds(1000),
        [&](const std::vector<std::string>& missing) {
          status.line(fmt::format("waiting up to {:g} s (--rejoin-timeout) for hosts to answer: {}",
                                  static_cast<double>(wait->count()) / 1000.0,
                                  join(missing, "; ")));
        });
    if (sel.stopped) return {"", json(), true};
    // At the start, the hosts that did not answer and that later ones stood in for (spares past
    // the last host taken were not needed, and are not said).
    if (why == Placement::first) {
      stood_in_for.assign(sel.absent.begin(),
                          sel.absent.begin() + static_cast<std::ptrdiff_t>(sel.stood_in_for));
    }
    absent = sel.absent;
    absent.insert(absent.end(), spec.left_out.begin(), spec.left_out.end());
    if (static_cast<int>(sel.hosts.size()) < spec.nodes.min) {
      return {fmt::format("only {} of the {} host(s) this job needs at least answered{}: {}",
                          sel.hosts.size(), spec.nodes.min,
                          waits ? fmt::format(" within {:g} s (--rejoin-timeout)",
                                              static_cast<double>(wait->count()) / 1000.0)
                                : std::string(),
                          join(absent, "; ")),
              json()};
    }
    spec.hosts = sel.hosts;
    spec.world_size = total_slots(spec.hosts);
  } else if (failed != nullptr && failed->rank_killed() && spec.nodes.elastic()) {
    if (std::string too_few = too_few_after_lost_rank(spec, failed); !too_few.empty()) {
      return {std::move(too_few), json()};
    }
    spec.world_size -= static_cast<int>(failed->killed_ranks.size());
    for (const int rank : failed->killed_ranks) {
      absent.push_back(fmt::format(
          "rank {}: killed by SIGKILL (the OOM killer, a cgroup limit or a scheduler): its "
          "capacity is taken as lost",
          rank));
    }
  }
  if (spec.world_size == before) {
    // Hosts later in the list took their places (more candidates than --nnodes' MAX): said all
    // the same, once (a shrink says its own; a restart names what it lost).
    if (!stood_in_for.empty()) status.warning("passed over: " + join(stood_in_for, "; "));
    return {};
  }
  const int64_t batch = global_batch(spec.recipe, spec.world_size, spec.nominal_world);
  json hosts = json::array(), joined = json::array();
  if (spec.hosts.empty()) hosts.push_back("localhost");  // as generation_started names them
  for (const auto& h : spec.hosts) {
    hosts.push_back(h.display());
    const bool before_too =
        std::any_of(hosts_before.begin(), hosts_before.end(),
                    [&](const HostSpec& b) { return b.display() == h.display(); });
    if (why != Placement::first && !before_too) joined.push_back(h.display());
  }
  json change = world_size_change(before, spec.world_size, hosts, absent, joined, batch,
                                  static_cast<int64_t>(run.info()["generations"].size()) + 1);
  change["line"] = fmt::format(
      "world size {} -> {}{}; global batch {}{}", before, spec.world_size,
      spec.hosts.empty() ? std::string() : fmt::format(" ({} host(s))", spec.hosts.size()), batch,
      absent.empty() ? "" : "; without " + join(absent, "; "));
  return {"", change};
}

// Where the next generation continues from (its JobSpec::resume_from): the newest valid
// checkpoint when rank 0's node is this machine (named in `name`); otherwise "newest" (the ranks
// find the newest any node holds) once a checkpoint was committed, else "newest-or-start". With
// no checkpoint yet the job starts over, and its metrics with it; with checkpoints of which none
// verifies it does not (a restart would write over them and lose their steps, silently):
// Error(checkpoint), as a resume would meet.
fs::path next_generation_source(RunDirectory& run, const JobSpec& spec, StatusPrinter& status,
                                std::string& name) {
  name = "the newest checkpoint on the nodes";
  if (!rank0_local(spec)) {
    // One was committed: the ranks finding none is a checkpoint error (exit 5), not a start over.
    return run.info().value("last_checkpoint", json()).is_object() ? fs::path("newest")
                                                                   : fs::path("newest-or-start");
  }
  // One out of reach (a permission) is an error, not "none": starting over would lose its steps.
  // A stop while checkpoints are verified ends the search, setting nothing aside.
  const auto check_stop = [] {
    throw_if_stopped(" while checkpoints were verified (nothing was set aside)");
  };
  PassedOver passed{[&status](const std::string& w) { status.warning(w); }, {}};
  if (auto from = passed.search(run.checkpoints(), written_by(spec.recipe), check_stop)) {
    passed.tell();
    name = from->filename().string();
    check_stop();
    set_aside_newer(run.checkpoints(), *from, status);
    return std::move(*from);
  }
  if (const auto all = list_checkpoints(run.checkpoints()); !all.empty()) {
    throw Error(ErrorKind::checkpoint,
                fmt::format("{}: none of its {} checkpoint(s) is usable, and starting over would "
                            "write over them; repair them, then 'dptrain resume'; to start over, "
                            "launch the recipe into a new run directory{}",
                            run.checkpoints().string(), all.size(), passed.lines()));
  }
  require_recorded_checkpoint(run);
  name = "step 0";
  // metrics.jsonl starts over as the ranks meet (rank 0 truncates it, or the launcher for a
  // remote rank 0): until then status shows the last generation's steps, as for a checkpoint.
  return "newest-or-start";
}

// An elastic job's host that refused its generation (it cannot run this dptrain) is no longer a
// candidate in this invocation; a resume tries it again. False, leaving it, when it is the last
// candidate: no host is left to place (an empty list would read as a job of fixed hosts).
bool leave_out(JobSpec& spec, const JobOutcome& refused) {
  const auto it =
      std::find_if(spec.candidates.begin(), spec.candidates.end(),
                   [&](const HostSpec& h) { return h.display() == refused.refused_host; });
  if (it == spec.candidates.end()) return true;
  if (spec.candidates.size() == 1) return false;
  spec.candidates.erase(it);
  // The headline names the host.
  spec.left_out.push_back(
      fmt::format("{} (left out of this invocation's generations)", error_headline(refused.error)));
  return true;
}

// Too few hosts or ranks are left for the next generation.
JobOutcome failed_placement(RunDirectory& run, JobOutcome outcome, const std::string& error,
                            const std::string& cause) {
  outcome.exit_code = outcome.rank_killed() ? 3 : 4;
  outcome.status = "failed";
  outcome.resized = false;
  outcome.error = cause.empty() ? error : error + "\n  (the failure before: " + cause + ")";
  run.info()["status"] = "failed";
  run.info()["error"] = outcome.error;  // the run's, after its last generation's
  run.record();
  return outcome;
}

// SIGTERM or SIGINT between two generations.
// A job stopped by `sig` (SIGTERM or SIGINT) outside a generation: its exit code and status;
// returns the signal's name.
const char* mark_stopped(JobOutcome& outcome, int sig) {
  outcome.exit_code = sig == SIGTERM ? 143 : 130;
  outcome.status = sig == SIGTERM ? "terminated" : "interrupted";
  return sig == SIGTERM ? "SIGTERM" : "SIGINT";
}

JobOutcome stopped_waiting(RunDirectory& run, JobOutcome outcome, int sig) {
  const char* name = mark_stopped(outcome, sig);
  // The failure the restart was for stays in the message: which rank, and where a resume starts.
  if (outcome.resized) {
    outcome.error =
        fmt::format("stopped by {} between generations (every rank had checkpointed)", name);
  } else {
    const std::string from =
        outcome.last_checkpoint.empty()
            ? std::string()
            : fmt::format(" (a resume continues from {})", outcome.last_checkpoint);
    outcome.error = fmt::format("stopped by {} while waiting to restart{} after: {}", name, from,
                                outcome.error);
  }
  outcome.resized = false;
  run.info()["status"] = outcome.status;
  run.info()["error"] = outcome.error;
  run.record();
  return outcome;
}

}  // namespace

JobOutcome run_job_with_restarts(RunDirectory& run, JobSpec spec, StatusPrinter& status,
                                 const RestartPolicy& policy) {
  // The budget is this invocation's; the numbering continues from the restarts run.json already
  // lists (an earlier launch or resume of the same run).
  int restarts = 0;
  const auto listed = run.info().find("restarts");
  const int numbered_before =
      listed != run.info().end() && listed->is_array() ? static_cast<int>(listed->size()) : 0;
  // Where this invocation began training: its first generation whose ranks met.
  int64_t began_at_step = -1;
  json began_from;
  // How an earlier invocation placed and reached the job, put back if none of this one's ranks
  // ever met, whether it failed or was stopped (run_job does so for each generation; an elastic
  // job records its hosts and settings here before its first one).
  const json placed_before = placement_of(run.info());
  const auto finish = [&](JobOutcome outcome) {
    if (began_at_step < 0 && outcome.exit_code != 0 && !placed_before.is_null() &&
        placement_of(run.info()) != placed_before) {
      restore_placement(run.info(), placed_before);
      run.record();
    }
    outcome.restarts = numbered_before + restarts;
    outcome.began_at_step = began_at_step;
    outcome.resumed_from = began_from;
    // The run's end, where it says more than its last generation's failure (stopped as
    // deterministic, restarts exhausted, not restarted and why): run.json's error, which status
    // and report give, is what the launch said. (A new generation erases it.)
    if (outcome.exit_code != 0 && !outcome.error.empty()) {
      const auto generations = run.info().find("generations");
      const std::string last =
          generations != run.info().end() && generations->is_array() && !generations->empty()
              ? generations->back().value("error", std::string())
              : std::string();
      if (outcome.error != last && run.info().value("error", std::string()) != outcome.error) {
        run.info()["error"] = outcome.error;
        run.record();
      }
    }
    return outcome;
  };
  {
    // Where this invocation starts: a resume continues from a checkpoint, in the next generation.
    const json& generations = run.info().value("generations", json::array());
    int64_t first_step = 0;
    const std::string from = spec.resume_from.filename().string();  // step-NNNNNN, newest, ...
    // "newest": the ranks find it on their nodes, maybe older than the one recorded (its host
    // left out, its copy damaged): no fault is said to be before the start.
    if (from.rfind("step-", 0) == 0) {
      std::from_chars(from.data() + 5, from.data() + from.size(), first_step);
    }
    for (const auto& warning :
         check_fault_injection(spec, first_step, static_cast<int>(generations.size()) + 1))
      status.warning(warning);
  }
  // "1/3", or after an earlier invocation's restarts "4 of the run (1/3 of this invocation)":
  // numbered as run.json numbers them; the budget is this invocation's.
  const auto restart_label = [&](int attempt) {
    return numbered_before == 0
               ? fmt::format("{}/{}", attempt, policy.max_restarts)
               : fmt::format("{} of the run ({}/{} of this invocation)", numbered_before + attempt,
                             attempt, policy.max_restarts);
  };
  // Failures in a row at one step, counted over the run, not this invocation: the failed
  // generations an earlier launch or resume ended with count (a CI loop that resumes a run
  // whose failure repeats stops as early as one launch would).
  const RepeatedFailure before = repeated_failure(run.info());
  int same_step = before.times;
  int64_t previous_step = before.times > 0 ? before.step : -2;
  if (!spec.candidates.empty() && spec.worker_args.empty()) {
    // The first generation waits for its hosts (up to the rejoin timeout): the run is recorded
    // as this launcher's from now on (status says running, resume refuses it), with what a resume
    // needs should it end before a generation ran (the recipe, the hosts, how they are reached,
    // the job's size).
    json& info = run.info();
    json hosts = json::array();
    for (const auto& h : spec.candidates) {
      hosts.push_back({{"host", h.display()}, {"slots", h.slots}});
      if (!h.key.empty()) hosts.back()["key"] = h.key;
    }
    // Every host it chooses among, for a resume's hint: a generation records only its own.
    info["job_hosts"] = hosts;
    if (!info.contains("recipe")) {
      info["recipe"] = to_json(spec.recipe);
      info["nominal_world_size"] = spec.nominal_world > 0 ? spec.nominal_world : spec.world_size;
      info["backend"] = spec.backend;
      info["hosts"] = hosts;
    }
    record_job_settings(info, spec, true);
    // By the last stamp (before this launcher's) or the last metrics line, whichever is newer.
    close_lost_generation(info, "its launcher", utc_timestamp_of(run.path() / "metrics.jsonl"));
    info["status"] = "running";
    info.erase("error");
    // Placing its first generation: status asks whether this launcher lives, as it does for a
    // generation not started yet, rather than look at the last generation's processes.
    info["placing"] = {{"at", utc_timestamp()}};
    info["launcher"] = {{"host", this_host()}, {"pid", ::getpid()}};
    info["alive_at"] = utc_timestamp();
    run.record();
  } else {
    run.info().erase("job_hosts");  // an earlier invocation's choice, not this one's hosts
  }
  const Placed first = place_generation(run, spec, status, Placement::first);
  record_world_size_change(run, spec, status, first.change);
  if (!first.error.empty() || first.stopped) {
    JobOutcome out;
    if (first.stopped) {
      out.error =
          fmt::format("stopped by {} while waiting for the hosts to answer; no rank started",
                      mark_stopped(out, pending_stop_signal()));
    } else {
      out.exit_code = 4;
      out.status = "failed";
      out.error = first.error;
    }
    // No generation ran, but the run is one to resume once the hosts answer: recorded so above.
    json& info = run.info();
    info.erase("placing");
    info["status"] = out.status;
    info["error"] = out.error;
    info.erase("pending_restart");  // a launcher killed in its back-off left it: not coming
    run.record();
    return finish(out);
  }
  for (;;) {
    JobOutcome outcome = run_job(run, spec, status);
    if (began_at_step < 0 && outcome.began_at_step >= 0) {
      began_at_step = outcome.began_at_step;
      began_from = outcome.resumed_from;
    }
    if (outcome.resized) {
      // Not a failure and not a restart: the next generation continues from the checkpoint the
      // ranks just wrote, with the hosts that answer now.
      std::string from_name;
      const fs::path from = next_generation_source(run, spec, status, from_name);
      json& resizes = run.info()["resizes"];
      if (!resizes.is_array()) resizes = json::array();
      resizes.push_back({{"after_generation", run.info()["generations"].size()},
                         {"after_step", outcome.last_step},
                         {"from", from_name},
                         {"at", utc_timestamp()}});
      run.record();
      const Placed grown = place_generation(run, spec, status, Placement::grow);
      if (!grown.error.empty()) return finish(failed_placement(run, outcome, grown.error, ""));
      if (const int sig = pending_stop_signal()) return finish(stopped_waiting(run, outcome, sig));
      record_world_size_change(run, spec, status, grown.change);
      spec.resume_from = from;
      continue;
    }
    // A stop asked for (SIGTERM, Ctrl-C) is never answered with a restart; nor, in a job of
    // fixed hosts, a host that refused the connection (an elastic job leaves it out instead:
    // it answers SSH, so a probe alone would place it again, to refuse again).
    const bool refused =
        outcome.host_refused && (spec.candidates.empty() || !leave_out(spec, outcome));
    if (!restartable(outcome) || outcome.repeats || refused || policy.max_restarts == 0 ||
        pending_stop_signal() != 0) {
      if (refused && policy.max_restarts > 0) {
        outcome.error +=
            "\n  (not restarted: the host would fail the same way again; fix what it says, "
            "then 'dptrain resume')";
      } else if (outcome.exit_code == 5 && policy.max_restarts > 0) {
        outcome.error +=
            "\n  (not restarted: a checkpoint or run file that cannot be written would meet the "
            "next generation too; fix what it says, then 'dptrain resume')";
      } else if (outcome.repeats && policy.max_restarts > 0) {
        outcome.error +=
            "\n  (not restarted: the rank's error is one a restart from a checkpoint would meet "
            "again)";
      }
      return finish(outcome);
    }
    // Where the failure came: its step, or (before the generation's first step) the step it
    // started from.
    const bool step_known = outcome.failed_step >= 0;
    const int64_t failed_at = step_known ? outcome.failed_step : outcome.start_step;
    // No step of this generation completed (a failure at start-up, or in its first step).
    const bool before_first_step = failed_at <= outcome.start_step;
    // Of the failures in a row only the last is known to have come before its generation did a
    // step: the step says where they all came.
    const std::string where =
        before_first_step
            ? fmt::format("at step {} (the last of them before its generation completed a step)",
                          failed_at)
            : fmt::format("at step {}", failed_at);
    // A host that could not be reached fails every attempt at the step it starts from, however
    // briefly it is down: that is no sign of a deterministic failure (and leaves the count of
    // the training's own failures as it was).
    if (!outcome.host_unreachable) {
      same_step = failed_at == previous_step ? same_step + 1 : 1;
      previous_step = failed_at;
    }
    if (!outcome.host_unreachable && same_step >= policy.same_step_limit) {
      outcome.error = fmt::format(
          "the job failed {} times in a row {}: this looks deterministic (a bad batch, a bug, a "
          "broken host), so it is not restarted again; the last failure: {}",
          same_step, where, outcome.error);
      outcome.deterministic = true;
      return finish(outcome);
    }
    if (restarts >= policy.max_restarts) {
      outcome.error += fmt::format("\n  (restarts exhausted: {} of {} for this invocation)",
                                   restarts, policy.max_restarts);
      return finish(outcome);
    }
    // Too few local ranks left for another generation: said now, not after a back-off that
    // announced a restart which cannot come.
    if (const std::string too_few = too_few_after_lost_rank(spec, &outcome); !too_few.empty()) {
      return finish(failed_placement(run, outcome, too_few, error_headline(outcome.error)));
    }
    const int attempt = restarts + 1;
    const auto backoff = std::min<std::chrono::milliseconds>(
        policy.backoff * (int64_t{1} << std::min(attempt - 1, 15)), std::chrono::seconds(30));
    const std::string cause = error_headline(outcome.error);
    // Nothing is recorded as a restart until one happens: the back-off may be cut short by a
    // stop, and an elastic job may find too few hosts or ranks for another generation.
    // Seen by `dptrain status` as restarting (while this launcher lives).
    run.info()["pending_restart"] = {{"after_generation", run.info()["generations"].size()},
                                     {"cause", cause},
                                     {"backoff_s", static_cast<double>(backoff.count()) / 1000.0},
                                     {"at", utc_timestamp()}};
    run.info()["alive_at"] = utc_timestamp();
    run.record();
    // Said before the wait (up to 30 s): which rank failed, and that a restart is to come (it
    // may not: a stop, or an elastic job left with too few hosts or ranks).
    status.line(fmt::format("{}; waiting {:g}s to restart (attempt {})", cause,
                            static_cast<double>(backoff.count()) / 1000.0, restart_label(attempt)));
    if (spec.events) {
      spec.events->emit("restart_pending",
                        {{"attempt", attempt},
                         {"max_restarts", policy.max_restarts},
                         {"cause", cause},
                         {"backoff_s", static_cast<double>(backoff.count()) / 1000.0}});
    }
    int sig = sleep_unless_stopped(backoff);
    Placed placed;  // its change of world size is recorded after the restart it belongs to
    if (sig == 0) {
      placed = place_generation(run, spec, status, Placement::after_failure, &outcome);
      if (!placed.error.empty()) {
        run.info().erase("pending_restart");
        return finish(failed_placement(run, outcome, placed.error, cause));
      }
      sig = pending_stop_signal();
    }
    run.info().erase("pending_restart");
    if (sig != 0) return finish(stopped_waiting(run, outcome, sig));
    std::string from_name;
    fs::path from;
    try {
      from = next_generation_source(run, spec, status, from_name);
    } catch (const Error& e) {
      // A stop while the checkpoints were verified: stopped as during the back-off.
      if (const int stop = pending_stop_signal(); stop != 0 && is_stop_kind(e.kind())) {
        return finish(stopped_waiting(run, outcome, stop));
      }
      // The newest checkpoint is out of reach: the generation's failure stays the message's
      // first line, and why there is no restart follows it.
      // (Its own lines below it, why each checkpoint was passed over, after the parenthesis.)
      const std::string why = e.what();
      const size_t end = why.find('\n');  // (first_line trims: not a split point)
      outcome.error += fmt::format("\n  (not restarted: {}){}", why.substr(0, end),
                                   end == std::string::npos ? "" : why.substr(end));
      outcome.exit_code = exit_code(e.kind());
      return finish(outcome);
    }
    restarts = attempt;
    const int number = numbered_before + restarts;
    // The cause was said in full before the back-off: its first clause (who failed, how) only.
    status.line(fmt::format("restart {} after {:g}s from {}: {}", restart_label(restarts),
                            static_cast<double>(backoff.count()) / 1000.0, from_name,
                            cause.substr(0, cause.find("; "))));
    if (spec.events) {
      spec.events->emit("restart", {{"restart", number},
                                    {"attempt", restarts},
                                    {"max_restarts", policy.max_restarts},
                                    {"cause", cause},
                                    // run.json's name; failed_at_step kept for readers of old
                                    {"failed_after_step", failed_at},
                                    {"failed_at_step", failed_at},
                                    {"failed_before_first_step", before_first_step},
                                    {"backoff_s", static_cast<double>(backoff.count()) / 1000.0},
                                    {"from", from_name}});
    }
    json& restarts_json = run.info()["restarts"];
    if (!restarts_json.is_array()) restarts_json = json::array();
    restarts_json.push_back({{"restart", number},
                             {"after_generation", run.info()["generations"].size()},
                             {"cause", cause},
                             {"failed_after_step", failed_at},
                             {"failed_before_first_step", before_first_step},
                             {"from", from_name},
                             {"at", utc_timestamp()}});
    run.record();
    record_world_size_change(run, spec, status, placed.change);
    // A checkpoint on this machine is named when rank 0 still runs here; otherwise the ranks
    // find the newest any node holds (rank 0 may be on another host now).
    spec.resume_from = from;
  }
}

}  // namespace dptrain
