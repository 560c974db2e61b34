// The restart policy: after a rank or host failure, a new generation from the newest valid
// checkpoint, with back-off, until the job completes or the failure looks deterministic.
#include <algorithm>
#include <csignal>
#include <system_error>

#include <fmt/format.h>

#include "core/checkpoint.hpp"
#include "core/error.hpp"
#include "launch/job.hpp"
#include "launch/supervisor.hpp"

namespace dptrain {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

bool restartable(const JobOutcome& outcome) {
  return outcome.exit_code == 3 || outcome.exit_code == 4;
}

std::string first_line(const std::string& text) {
  return text.substr(0, text.find('\n'));
}

}  // namespace

JobOutcome run_job_with_restarts(RunDirectory& run, JobSpec spec, StatusPrinter& status,
                                 const RestartPolicy& policy) {
  int restarts = 0;
  int same_step = 0;
  int64_t previous_step = -2;
  for (;;) {
    JobOutcome outcome = run_job(run, spec, status);
    outcome.restarts = restarts;
    if (!restartable(outcome) || policy.max_restarts == 0) return outcome;
    same_step = outcome.last_step == previous_step ? same_step + 1 : 1;
    previous_step = outcome.last_step;
    if (same_step >= policy.same_step_limit) {
      outcome.error = fmt::format(
          "the job failed {} times in a row after step {}: this looks deterministic (a bad "
          "batch, a bug, a broken host), so it is not restarted again; the last failure: {}",
          same_step, outcome.last_step, outcome.error);
      return outcome;
    }
    if (restarts >= policy.max_restarts) {
      outcome.error +=
          fmt::format("\n  (restarts exhausted: {} of {})", restarts, policy.max_restarts);
      return outcome;
    }
    ++restarts;
    fs::path from;
    try {
      from = find_valid_checkpoint(
          run.checkpoints(), [&status](const std::string& w) { status.line("warning: " + w); });
    } catch (const Error&) {
      // No checkpoint yet: start over, with metrics to match.
      std::error_code ignored;
      fs::remove(run.path() / "metrics.jsonl", ignored);
    }
    const auto backoff = std::min<std::chrono::milliseconds>(
        policy.backoff * (int64_t{1} << std::min(restarts - 1, 15)), std::chrono::seconds(30));
    const std::string cause = first_line(outcome.error);
    status.line(fmt::format("restart {}/{} in {:.1f}s from {}: {}", restarts, policy.max_restarts,
                            static_cast<double>(backoff.count()) / 1000.0,
                            from.empty() ? std::string("step 0") : from.filename().string(),
                            cause));
    if (spec.events) {
      spec.events->emit(
          "restart", {{"restart", restarts},
                      {"max_restarts", policy.max_restarts},
                      {"cause", cause},
                      {"backoff_s", static_cast<double>(backoff.count()) / 1000.0},
                      {"from", from.empty() ? std::string("step 0") : from.filename().string()}});
    }
    json& restarts_json = run.info()["restarts"];
    if (!restarts_json.is_array()) restarts_json = json::array();
    restarts_json.push_back(
        {{"restart", restarts},
         {"after_generation", run.info()["generations"].size()},
         {"cause", cause},
         {"failed_after_step", outcome.last_step},
         {"from", from.empty() ? std::string("step 0") : from.filename().string()},
         {"at", utc_timestamp()}});
    run.save();
    if (const int sig = sleep_unless_stopped(backoff)) {
      outcome.exit_code = sig == SIGTERM ? 143 : 130;
      outcome.status = sig == SIGTERM ? "terminated" : "interrupted";
      outcome.error = "stopped while waiting to restart";
      run.info()["status"] = outcome.status;
      run.save();
      return outcome;
    }
    spec.resume_from = from;
  }
}

}  // namespace dptrain
