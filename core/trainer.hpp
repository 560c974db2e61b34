// The training loop: data-parallel steps over a Communicator, evaluation, metrics, checkpoints.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/comm/communicator.hpp"
#include "core/heartbeat.hpp"
#include "core/recipe.hpp"

namespace dptrain {

struct TrainerOptions {
  std::filesystem::path run_dir;      // rank 0 writes metrics.jsonl, checkpoints/, result.json here
  std::filesystem::path resume_from;  // a checkpoint directory; empty = fresh start
  // Receives {"event": "progress"|"eval"|"checkpoint"|"info", ...} on rank 0 only.
  std::function<void(const nlohmann::json&)> on_event;
  int64_t debug_step_delay_ms = 0;  // tests slow a run down to kill it mid-way
  // Polled once a step on every rank: when any rank says yes (SIGTERM, a spot instance going
  // away), all ranks finish that step, checkpoint it, and train() returns with `stopped`.
  std::function<bool()> stop_requested;
  // Where this rank is, for hang attribution (published by a HeartbeatSender); may be null.
  ProgressTracker* progress = nullptr;
  // Called at the start of every step with the step about to run (fault injection in tests).
  std::function<void(int64_t step)> before_step;
  // Called by rank 0 with the step of a checkpoint about to be committed (fault injection).
  std::function<void(int64_t step)> before_checkpoint_commit;
};

struct TrainResult {
  int64_t steps = 0;
  int64_t world_size = 1;
  double final_loss = 0;
  double eval_loss = 0;
  double eval_accuracy = 0;
  double samples_per_s = 0;  // steady state: the first warm-up steps of this process are excluded
  std::string params_checksum;
  std::filesystem::path last_checkpoint;
  bool stopped = false;  // stopped early on request, after checkpointing `steps`
  nlohmann::json to_json() const;
};

// What a rank would find wrong only after it started: the data (a bad CSV row, a split smaller
// than one global batch). Loads the data once; Error(recipe) naming the file, line or fields.
void check_runnable(const Recipe& recipe, int world_size);

// Runs the recipe's training to completion on this rank. Every rank calls it with its own
// Communicator. Throws Error on failure (comm when a peer fails or ranks diverge).
TrainResult train(const Recipe& recipe, Communicator& comm, const TrainerOptions& options);

}  // namespace dptrain
