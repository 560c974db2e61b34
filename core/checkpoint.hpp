// Checkpoints: atomic, checksummed directories step-NNNNNN/ under a run's checkpoints/ folder.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <span>
#include <string>
#include <vector>

namespace dptrain {

// Everything besides the tensors that a resume needs to continue bit-identically.
struct TrainingPosition {
  int64_t step = 0;              // optimizer steps completed
  int64_t epoch = 0;             // current epoch of the sampler
  int64_t samples_in_epoch = 0;  // samples of that epoch already consumed (reshards on resume)
  int64_t world_size = 1;
  int64_t global_batch = 1;
  int64_t optimizer_steps = 0;
  std::string recipe_hash;
  std::string rng_state;  // the trainer's generator, as text
};

struct CheckpointData {
  TrainingPosition position;
  std::vector<float> params;
  std::vector<float> optimizer_state;
};

// "step-000100" for 100.
std::string checkpoint_name(int64_t step);

// Writes checkpoints/step-N atomically (temp dir, fsync files and dir, rename, fsync parent),
// re-reads and verifies it, then points `latest` at it and removes all but the `keep` newest.
// Error(checkpoint) on any failure; `latest` is never touched unless the new one verified.
std::filesystem::path write_checkpoint(const std::filesystem::path& checkpoints_dir,
                                       const TrainingPosition& position,
                                       std::span<const float> params,
                                       std::span<const float> optimizer_state, int64_t keep);

// Reads and verifies one checkpoint directory: Error(checkpoint) naming the file and what is wrong.
CheckpointData read_checkpoint(const std::filesystem::path& dir);

// step-* directories, newest first.
std::vector<std::filesystem::path> list_checkpoints(const std::filesystem::path& checkpoints_dir);

// The newest checkpoint that verifies, trying `latest` first, then every step-* newest first.
// Each skipped one is reported through `warn`. Error(checkpoint) if none is valid.
std::filesystem::path find_valid_checkpoint(const std::filesystem::path& checkpoints_dir,
                                            const std::function<void(const std::string&)>& warn);

}  // namespace dptrain
