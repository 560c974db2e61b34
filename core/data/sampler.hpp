// The deterministic distributed sampler: which samples each rank and micro-batch takes at each
// step.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <vector>

namespace dptrain {

// Where training stands in the data: the epoch and how many of its samples were consumed.
struct DataPosition {
  int64_t epoch = 0;
  int64_t sample = 0;  // the next step's global batch starts at perm[sample]
  bool operator==(const DataPosition&) const = default;
};

// A keyed pseudo-random permutation of [0, n), computed index by index: an epoch of billions
// of samples (a token dataset has one per token) costs no memory and no time up front. A
// balanced Feistel network of 6 rounds (mix64 as the round function) on the smallest even
// number of bits that covers n, with cycle walking: an index the network maps past n is mapped
// again until it lands inside. As 2^bits < 4n that takes fewer than 4 passes on average.
class EpochPermutation {
 public:
  EpochPermutation(int64_t n, uint64_t key);  // n >= 1
  int64_t operator()(int64_t i) const;        // i in [0, n)

  static constexpr int kRounds = 6;

 private:
  uint64_t n_;
  int half_bits_ = 1;
  uint64_t half_mask_ = 1;
  std::array<uint64_t, kRounds> round_keys_{};
};

// Each epoch has a permutation of [0, n) derived only from (seed, epoch). A step's global batch
// is perm[s, s + G) from the position s, G = world * batch_per_rank * grad_accum (or the global
// batch an elastic job keeps). Micro-batch j of the step is the slice at offset j *
// batch_per_rank; rank r takes j = r, r + world, ..., so 2 ranks x batch B and 1 rank x batch 2B
// see exactly the same samples per step. Positions count samples, not batches, so a job whose
// global batch changes (a resize that scales the learning rate) continues where it was: no
// sample of the epoch is skipped or seen twice.
class DistributedSampler {
 public:
  // Error(recipe) if dataset_size < global_batch, naming both.
  DistributedSampler(int64_t dataset_size, int64_t global_batch, uint64_t seed);

  int64_t steps_per_epoch() const { return steps_per_epoch_; }  // floor(n / G): the tail is dropped

  // The position after a step from `at`; the next epoch once fewer than G samples remain (the
  // tail is dropped).
  DataPosition advance(DataPosition at) const;
  // `at` itself, or the start of the next epoch when a whole global batch no longer fits there
  // (a position saved under another global batch).
  DataPosition normalize(DataPosition at) const;
  // Slice [offset, offset + count) of the global batch that starts at position `at`.
  void indices(DataPosition at, int64_t offset, std::span<int64_t> out) const;

  // Slice [offset, offset + count) of global batch batch_in_epoch of epoch.
  std::vector<int64_t> indices(int64_t epoch, int64_t batch_in_epoch, int64_t offset,
                               int64_t count) const;
  // The same slice written to out (count = out.size()), for a caller that reuses its buffer.
  void indices(int64_t epoch, int64_t batch_in_epoch, int64_t offset, std::span<int64_t> out) const;

  // The epoch's permutation, as indices() uses it, and all of it (for tests: n values).
  EpochPermutation epoch_permutation(int64_t epoch) const;
  std::vector<int64_t> permutation(int64_t epoch) const;

 private:
  int64_t dataset_size_;
  int64_t global_batch_;
  uint64_t seed_;
  int64_t steps_per_epoch_;
};

}  // namespace dptrain
