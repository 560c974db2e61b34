// The deterministic distributed sampler: which samples each rank and micro-batch takes at each
// step.
#include "core/data/sampler.hpp"

#include <algorithm>
#include <numeric>
#include <random>
#include <span>
#include <string>

#include "core/error.hpp"
#include "core/tensor/random.hpp"

namespace dptrain {
namespace {

constexpr uint64_t kSamplerStream = 0x5a3b;  // derive_seed stream of the epoch permutations

}  // namespace

DistributedSampler::DistributedSampler(int64_t dataset_size, int64_t global_batch, uint64_t seed)
    : dataset_size_(dataset_size), global_batch_(global_batch), seed_(seed), steps_per_epoch_(0) {
  if (global_batch <= 0) {
    throw Error(ErrorKind::recipe,
                "global batch (world x train.batch_per_rank x train.grad_accum) must be positive, "
                "got " +
                    std::to_string(global_batch));
  }
  if (dataset_size < global_batch) {
    throw Error(ErrorKind::recipe,
                "the training split has " + std::to_string(dataset_size) +
                    " samples, fewer than one global batch (world x train.batch_per_rank x "
                    "train.grad_accum = " +
                    std::to_string(global_batch) + ")");
  }
  steps_per_epoch_ = dataset_size / global_batch;
}

std::vector<int64_t> DistributedSampler::permutation(int64_t epoch) const {
  std::vector<int64_t> perm(static_cast<size_t>(dataset_size_));
  std::iota(perm.begin(), perm.end(), int64_t{0});
  std::mt19937_64 rng(
      derive_seed(derive_seed(seed_, kSamplerStream), static_cast<uint64_t>(epoch)));
  shuffle(rng, std::span<int64_t>(perm));
  return perm;
}

std::vector<int64_t> DistributedSampler::indices(int64_t epoch, int64_t batch_in_epoch,
                                                 int64_t offset, int64_t count) const {
  std::vector<int64_t> out(static_cast<size_t>(std::max<int64_t>(count, 0)));
  indices(epoch, batch_in_epoch, offset, std::span<int64_t>(out));
  return out;
}

void DistributedSampler::indices(int64_t epoch, int64_t batch_in_epoch, int64_t offset,
                                 std::span<int64_t> out) const {
  if (batch_in_epoch < 0 || batch_in_epoch >= steps_per_epoch_) {
    throw Error(ErrorKind::internal, "sampler: batch " + std::to_string(batch_in_epoch) +
                                         " is outside " + std::to_string(steps_per_epoch_) +
                                         " batches of an epoch");
  }
  indices(DataPosition{epoch, batch_in_epoch * global_batch_}, offset, out);
}

DataPosition DistributedSampler::advance(DataPosition at) const {
  return normalize({at.epoch, at.sample + global_batch_});
}

DataPosition DistributedSampler::normalize(DataPosition at) const {
  if (at.sample < 0 || at.sample + global_batch_ > dataset_size_) return {at.epoch + 1, 0};
  return at;
}

void DistributedSampler::indices(DataPosition at, int64_t offset, std::span<int64_t> out) const {
  const auto count = static_cast<int64_t>(out.size());
  if (at.epoch < 0 || at.sample < 0 || at.sample + global_batch_ > dataset_size_ || offset < 0 ||
      count < 0 || offset + count > global_batch_) {
    throw Error(ErrorKind::internal,
                "sampler: epoch " + std::to_string(at.epoch) + " position " +
                    std::to_string(at.sample) + " slice [" + std::to_string(offset) + ", " +
                    std::to_string(offset + count) + ") is outside batches of " +
                    std::to_string(global_batch_) + " in " + std::to_string(dataset_size_) +
                    " samples");
  }
  if (at.epoch != cached_epoch_) {
    cached_permutation_ = permutation(at.epoch);
    cached_epoch_ = at.epoch;
  }
  const auto begin = cached_permutation_.begin() + at.sample + offset;
  std::copy(begin, begin + count, out.begin());
}

}  // namespace dptrain
