// One generation of a job on this machine: store, rank processes, supervision, run.json updates.
#pragma once

#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

#include "core/recipe.hpp"
#include "launch/run_dir.hpp"
#include "launch/status.hpp"

namespace dptrain {

struct JobSpec {
  Recipe recipe;
  int world_size = 1;
  std::string backend = "auto";
  std::filesystem::path resume_from;    // a verified checkpoint, or empty
  std::filesystem::path worker_binary;  // this executable
};

struct JobOutcome {
  int exit_code = 0;
  std::string status;     // completed | failed | interrupted | terminated
  std::string error;      // empty on success; the first line names the failed rank
  nlohmann::json result;  // the trainer's result.json on success
  nlohmann::json to_json(const RunDirectory& run) const;
};

// Resolves "auto" to the backend this build and machine use.
std::string resolve_backend(const std::string& requested);

// Runs one generation to its end, recording it in run.json. Never throws for a rank's failure:
// that is an outcome with exit code 3.
JobOutcome run_local_job(RunDirectory& run, const JobSpec& spec, StatusPrinter& status);

// The path of the running executable (to start workers with).
std::filesystem::path self_executable();

}  // namespace dptrain
