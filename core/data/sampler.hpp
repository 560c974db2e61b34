// The deterministic distributed sampler: which samples each rank and micro-batch takes at each
// step.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace dptrain {

// Each epoch has a permutation of [0, n) derived only from (seed, epoch). Global batch b of an
// epoch is perm[b*G, (b+1)*G), G = world * batch_per_rank * grad_accum. Rank r's micro-batch m
// takes the slice at offset (m*world + r) * batch_per_rank, so 2 ranks x batch B and 1 rank x batch
// 2B see exactly the same samples per step.
class DistributedSampler {
 public:
  // Error(recipe) if dataset_size < global_batch, naming both.
  DistributedSampler(int64_t dataset_size, int64_t global_batch, uint64_t seed);

  int64_t steps_per_epoch() const { return steps_per_epoch_; }  // floor(n / G): the tail is dropped

  // Slice [offset, offset + count) of global batch batch_in_epoch of epoch. Caches the epoch's
  // permutation, so consecutive calls within an epoch are cheap; not safe to call concurrently.
  std::vector<int64_t> indices(int64_t epoch, int64_t batch_in_epoch, int64_t offset,
                               int64_t count) const;
  // The same slice written to out (count = out.size()), for a caller that reuses its buffer.
  void indices(int64_t epoch, int64_t batch_in_epoch, int64_t offset, std::span<int64_t> out) const;

  // The epoch's permutation of [0, n), as indices() uses it.
  std::vector<int64_t> permutation(int64_t epoch) const;

 private:
  int64_t dataset_size_;
  int64_t global_batch_;
  uint64_t seed_;
  int64_t steps_per_epoch_;
  mutable int64_t cached_epoch_ = -1;
  mutable std::vector<int64_t> cached_permutation_;
};

}  // namespace dptrain
