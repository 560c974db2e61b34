// Shared ending of launch and resume: print a job's outcome for people or scripts.
#include "cli/run_report.hpp"

#include <cstdio>
#include <sstream>

#include <fmt/format.h>

namespace dptrain::cli {

int report_outcome(const RunDirectory& run, const JobOutcome& outcome, bool json) {
  if (!outcome.error.empty()) {
    std::istringstream lines(outcome.error);
    std::string line;
    bool first = true;
    while (std::getline(lines, line)) {
      std::fprintf(stderr, "%s%s\n", first ? "dptrain: error: " : "", line.c_str());
      first = false;
    }
    std::fprintf(stderr, "dptrain: run directory: %s (continue with 'dptrain resume %s')\n",
                 run.path().c_str(), run.path().c_str());
  }
  if (json) {
    std::printf("%s\n", outcome.to_json(run).dump().c_str());
  } else if (outcome.exit_code == 0) {
    const auto& r = outcome.result;
    std::printf("run directory: %s\n", run.path().c_str());
    std::printf("%s\n",
                fmt::format("final loss {:.4f}  eval loss {:.4f}  eval accuracy {:.2f}%  "
                            "{:.0f} samples/s  ({} steps, {} ranks)",
                            r.value("final_loss", 0.0), r.value("eval_loss", 0.0),
                            100.0 * r.value("eval_accuracy", 0.0), r.value("samples_per_s", 0.0),
                            r.value("steps", int64_t{0}), r.value("world_size", int64_t{0}))
                    .c_str());
  }
  std::fflush(stdout);
  return outcome.exit_code;
}

}  // namespace dptrain::cli
