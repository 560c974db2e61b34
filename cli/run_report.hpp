// Shared ending of launch and resume: print a job's outcome for people or scripts.
#pragma once

#include "launch/job.hpp"
#include "launch/run_dir.hpp"

namespace dptrain::cli {

// Prints the outcome (a summary on stdout, or one JSON object with --json; errors on stderr)
// and returns the exit code.
int report_outcome(const RunDirectory& run, const JobOutcome& outcome, bool json);

}  // namespace dptrain::cli
