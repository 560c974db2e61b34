// Shared ending of launch and resume: print a job's outcome for people or scripts.
#pragma once

#include <CLI/CLI.hpp>

#include "launch/job.hpp"
#include "launch/run_dir.hpp"

namespace dptrain::cli {

struct RestartOptions {
  int max_restarts = 0;
  double backoff_s = 1.0;
  double hang_timeout_s = 0;
  RestartPolicy policy() const;  // Error(usage) for negative values
  std::chrono::milliseconds hang_timeout() const;
};
// --max-restarts, --restart-backoff and --hang-timeout, shared by launch and resume.
void add_restart_options(CLI::App& app, RestartOptions& o);

// Prints the outcome (a summary on stdout, or one JSON object with --json; errors on stderr)
// and returns the exit code.
int report_outcome(const RunDirectory& run, const JobOutcome& outcome, bool json);

}  // namespace dptrain::cli
