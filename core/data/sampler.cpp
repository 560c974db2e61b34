// The deterministic distributed sampler: which samples each rank and micro-batch takes at each
// step.
#include "core/data/sampler.hpp"

#include <bit>
#include <span>
#include <string>

#include "core/error.hpp"
#include "core/tensor/random.hpp"

namespace dptrain {
namespace {

constexpr uint64_t kSamplerStream = 0x5a3b;  // derive_seed stream of the epoch permutations

}  // namespace

EpochPermutation::EpochPermutation(int64_t n, uint64_t key) : n_(static_cast<uint64_t>(n)) {
  if (n < 1) {
    throw Error(ErrorKind::internal, "epoch permutation of " + std::to_string(n) + " samples");
  }
  // The smallest even number of bits (at least 2) whose range holds [0, n).
  int bits = n_ <= 1 ? 1 : static_cast<int>(std::bit_width(n_ - 1));
  bits += bits % 2;
  half_bits_ = bits / 2;
  half_mask_ = (uint64_t{1} << half_bits_) - 1;
  for (int r = 0; r < kRounds; ++r)
    round_keys_[static_cast<size_t>(r)] = derive_seed(key, static_cast<uint64_t>(r));
}

int64_t EpochPermutation::operator()(int64_t i) const {
  auto x = static_cast<uint64_t>(i);
  if (i < 0 || x >= n_) {
    throw Error(ErrorKind::internal, "epoch permutation: index " + std::to_string(i) +
                                         " outside [0, " + std::to_string(n_) + ")");
  }
  // Cycle walking: the network permutes [0, 2^bits); an index it maps past n is mapped again
  // until it lands inside, which restricts the permutation to [0, n).
  do {
    uint64_t left = x >> half_bits_, right = x & half_mask_;
    for (const uint64_t k : round_keys_) {
      const uint64_t next = left ^ (mix64(right ^ k) & half_mask_);
      left = right;
      right = next;
    }
    x = (left << half_bits_) | right;
  } while (x >= n_);
  return static_cast<int64_t>(x);
}

namespace {
// What a global batch is made of, as its errors say (parameter servers compute no gradients; the
// ranks are the job's nominal world under keep_global_batch).
constexpr const char* kGlobalBatchTerms =
    "the (nominal) ranks that compute gradients x train.batch_per_rank x train.grad_accum";
}  // namespace

DistributedSampler::DistributedSampler(int64_t dataset_size, int64_t global_batch, uint64_t seed)
    : dataset_size_(dataset_size), global_batch_(global_batch), seed_(seed), steps_per_epoch_(0) {
  if (global_batch <= 0) {
    throw Error(ErrorKind::recipe, "global batch (" + std::string(kGlobalBatchTerms) +
                                       ") must be positive, "
                                       "got " +
                                       std::to_string(global_batch));
  }
  if (dataset_size < global_batch) {
    throw Error(ErrorKind::recipe,
                "/train/batch_per_rank: the training split has " + std::to_string(dataset_size) +
                    " samples, fewer than one global batch (" + kGlobalBatchTerms + " = " +
                    std::to_string(global_batch) + ")");
  }
  steps_per_epoch_ = dataset_size / global_batch;
}

EpochPermutation DistributedSampler::epoch_permutation(int64_t epoch) const {
  return EpochPermutation(
      dataset_size_, derive_seed(derive_seed(seed_, kSamplerStream), static_cast<uint64_t>(epoch)));
}

std::vector<int64_t> DistributedSampler::permutation(int64_t epoch) const {
  const EpochPermutation perm = epoch_permutation(epoch);
  std::vector<int64_t> out(static_cast<size_t>(dataset_size_));
  for (int64_t i = 0; i < dataset_size_; ++i)
    out[static_cast<size_t>(i)] = perm(i);
  return out;
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
  const EpochPermutation perm = epoch_permutation(at.epoch);
  for (int64_t i = 0; i < count; ++i)
    out[static_cast<size_t>(i)] = perm(at.sample + offset + i);
}

}  // namespace dptrain
