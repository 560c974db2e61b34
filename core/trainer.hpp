// The training loop: data-parallel steps over a Communicator, evaluation, metrics, checkpoints.
// The gradient exchange itself (buckets, overlap, codecs) is core/ddp's; the sync modes that
// change what a step is (ZeRO-1's sharded update, local SGD's averaging, the parameter servers'
// push and pull) live here, since they own the optimizer, the parameters and the checkpoint.
#pragma once

#include <array>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "core/comm/communicator.hpp"
#include "core/heartbeat.hpp"
#include "core/recipe.hpp"
#include "core/tensor/ops.hpp"

namespace dptrain {

struct TrainerOptions {
  // The op table to compute on; null = one for recipe.train.device on GPU device_index. The
  // worker makes it first when the communicator needs its stream (NCCL).
  std::shared_ptr<Ops> ops;
  int device_index = 0;
  std::filesystem::path run_dir;  // rank 0 writes metrics.jsonl, checkpoints/, result.json here
  // A checkpoint directory; empty = fresh start. Two words search every node instead: the
  // newest valid checkpoint any node leader holds in its run_dir ("newest": Error(checkpoint)
  // when there is none; "newest-or-start": step 0 then).
  std::filesystem::path resume_from;
  // The first rank of every node writes checkpoints to its own run_dir (rank 0 always does), so
  // a lost node never takes the only copy with it.
  bool node_leader = false;
  // The world size that defines the job's global batch (an elastic job's full size); 0 = rank
  // 0's, or (0 there too) this world. On another world size, recipe.distributed.resize says what
  // changes.
  int nominal_world = 0;
  // Receives {"event": "progress"|"eval"|"checkpoint"|"info", ...} on rank 0 only.
  std::function<void(const nlohmann::json&)> on_event;
  int64_t debug_step_delay_ms = 0;  // tests slow a run down to kill it mid-way
  // A synchronous rank's stop request rides the next step's gradient exchange, so a stop asked
  // for during a step is taken after the one after it; log steps take it at their end. Steps at
  // least this long (the ranks' mean, agreed at the last log step; every step before the first
  // log step) also sum the stop at their end, so a long step's stop is its own checkpoint within
  // the launcher's grace. (A shorter step's extra all-reduce would cost more than the step it
  // saves.)
  double stop_check_step_ms = 200;
  // Local SGD: a stop between averagings waits for the next scheduled one (the resume is then
  // bit-identical to a run never stopped) where that comes within this long at the ranks' mean
  // step time; else the stop is taken at the step's end (short steps: within about this long)
  // with an early averaging, so that a launcher's or a scheduler's grace is not spent waiting.
  double local_stop_wait_ms = 10000;
  // Polled on every rank, at least once a step: when any rank says yes (SIGTERM, a spot instance
  // going away), all ranks finish that step (or, where the steps are short, the next), checkpoint
  // it, and train() returns with `stopped`. Local SGD takes it at an averaging or within
  // local_stop_wait_ms; parameter servers at the step the servers choose, within staleness + 2.
  std::function<bool()> stop_requested;
  // Rank 0: the run's record says it completed (workers started without a launcher, started
  // again with --resume newest or newest-or-start). Every rank learns it as they meet, and
  // train() returns at once with `already_completed`, touching nothing in the run directory.
  bool run_completed = false;
  // How the run is continued, for the message after such a stop, where the rank's own line is
  // what its user reads (workers started without a launcher: "starting the workers again with
  // '--resume newest'"). Empty under a launcher, which says what comes next: a resume, or a
  // generation of its own (an elastic job stopped to take a host back).
  std::string resume_how;
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
  // NaN when there is none (null in to_json): final_loss when no loss was ever logged (no step
  // ran, here or before the checkpoint resumed from), eval_loss and eval_accuracy when there is
  // no held-out data.
  double final_loss = std::numeric_limits<double>::quiet_NaN();
  double eval_loss = std::numeric_limits<double>::quiet_NaN();
  double eval_accuracy = std::numeric_limits<double>::quiet_NaN();
  // Steady state: the first warm-up steps of this process are excluded. NaN (null) when this
  // process measured no step (a resume from the final step's checkpoint), unless the run's
  // result.json of that very state holds the measurements (they are kept, as are phases_ms,
  // comm_total_ms, bytes_per_step and peak_rss_mib).
  double samples_per_s = std::numeric_limits<double>::quiet_NaN();
  int64_t tokens_per_sample = 0;  // a token model's context (tokens/s = samples/s x this); else 0
  // Mean ms per steady-state step in data, compute (forward + backward), comm (exposed gradient
  // all-reduce) and optimizer, on rank 0.
  std::array<double, 4> phases_ms{};
  static constexpr std::array<const char*, 4> kPhaseNames = {"data", "compute", "comm",
                                                             "optimizer"};
  // Steady-state means per step: all communication (overlapped or not; phases_ms' comm is the
  // exposed part) and the bytes each rank put on the wire.
  double comm_total_ms = 0;
  double bytes_per_step = 0;
  double optimizer_state_mib = 0;  // on each rank (ZeRO-1: its shard)
  double peak_rss_mib = 0;         // the largest peak resident memory of any rank
  std::string params_checksum;
  std::filesystem::path last_checkpoint;
  bool stopped = false;            // stopped early on request, after checkpointing `steps`
  bool already_completed = false;  // nothing ran: rank 0's record says the run completed
  nlohmann::json to_json() const;
};

// The first steps of a process's run left out of its steady-state means (allocation, caches,
// the first collectives): min(10, steps / 5) of the `steps` it runs.
int64_t warmup_steps(int64_t steps);

// training_samples of the recipe's data, where each problem of a CSV file's rows (starting with
// the file's path) is /data/path's, one a line, as `recipe validate` words them: Error(recipe).
int64_t recipe_training_samples(const Recipe& recipe);

// What a rank would find wrong only after it started: the data (a bad CSV row, a split smaller
// than one global batch), and check_levers. Reads a CSV file once and token files whole (their
// checksums); synthetic data is only counted, not generated. Error(recipe) naming the file, line
// or fields; with `origin` (the recipe's file, or the run.json that holds it) first:
// "FILE: /data/path: ..." ("RUN/run.json: /recipe/data/path: ..."), as every recipe error.
void check_runnable(const Recipe& recipe, int world_size, int nominal_world = 0,
                    const RecipeSource& origin = {});

// What the recipe's communication settings cannot do with its model, found from the model's
// tensors (a PowerSGD rank that would factorise no weight matrix): Error(recipe) naming the field.
void check_levers(const Recipe& recipe);

// The global batch of a step on world_size ranks of a job sized for nominal_world (0: the same):
// nominal_world x batch_per_rank x grad_accum, unless distributed.resize is "scale_lr".
int64_t global_batch(const Recipe& recipe, int world_size, int nominal_world = 0);

// Drops the lines of a metrics.jsonl after `step` (and torn ones): a resumed run repeats them.
void truncate_metrics_after(const std::filesystem::path& metrics_file, int64_t step);

// Runs the recipe's training to completion on this rank. Every rank calls it with its own
// Communicator. Throws Error on failure (comm when a peer fails or ranks diverge).
TrainResult train(const Recipe& recipe, Communicator& comm, const TrainerOptions& options);

}  // namespace dptrain
