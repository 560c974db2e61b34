// Tests of the distributed sampler: rank slices, epochs, determinism and world-size invariance.
#include "core/data/sampler.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>

#include "core/error.hpp"

namespace dptrain {
namespace {

// The samples rank r takes in micro-batch m of a step, as the trainer asks for them.
std::vector<int64_t> rank_slice(const DistributedSampler& sampler, int64_t step, int64_t world,
                                int64_t rank, int64_t micro_batch, int64_t batch_per_rank) {
  const int64_t epoch = step / sampler.steps_per_epoch();
  const int64_t batch = step % sampler.steps_per_epoch();
  return sampler.indices(epoch, batch, (micro_batch * world + rank) * batch_per_rank,
                         batch_per_rank);
}

std::multiset<int64_t> step_samples(int64_t world, int64_t batch_per_rank, int64_t grad_accum,
                                    int64_t step) {
  const DistributedSampler sampler(1000, world * batch_per_rank * grad_accum, 5);
  std::multiset<int64_t> samples;
  for (int64_t m = 0; m < grad_accum; ++m) {
    for (int64_t r = 0; r < world; ++r) {
      for (int64_t i : rank_slice(sampler, step, world, r, m, batch_per_rank))
        samples.insert(i);
    }
  }
  return samples;
}

}  // namespace

TEST_CASE("rank slices of a step are disjoint and an epoch covers each kept sample once") {
  const int64_t n = 103, world = 3, batch = 4, accum = 2;  // G = 24: 4 steps, tail of 7 dropped
  const DistributedSampler sampler(n, world * batch * accum, 11);
  REQUIRE(sampler.steps_per_epoch() == 4);
  std::vector<int64_t> epoch_samples;
  for (int64_t step = 0; step < sampler.steps_per_epoch(); ++step) {
    std::set<int64_t> in_step;
    for (int64_t m = 0; m < accum; ++m) {
      for (int64_t r = 0; r < world; ++r) {
        const auto slice = rank_slice(sampler, step, world, r, m, batch);
        CHECK(slice.size() == static_cast<size_t>(batch));
        for (int64_t i : slice) {
          CHECK(i >= 0);
          CHECK(i < n);
          CHECK(in_step.insert(i).second);  // no sample twice in one step
          epoch_samples.push_back(i);
        }
      }
    }
  }
  std::sort(epoch_samples.begin(), epoch_samples.end());
  CHECK(std::adjacent_find(epoch_samples.begin(), epoch_samples.end()) == epoch_samples.end());
  CHECK(epoch_samples.size() == 96);

  std::vector<int64_t> perm = sampler.permutation(0);
  std::sort(perm.begin(), perm.end());
  std::vector<int64_t> identity(n);
  std::iota(identity.begin(), identity.end(), int64_t{0});
  CHECK(perm == identity);
}

TEST_CASE("epochs differ; the same seed gives the same order, another seed another") {
  const DistributedSampler a(50, 10, 1), b(50, 10, 1), c(50, 10, 2);
  CHECK(a.permutation(0) != a.permutation(1));
  CHECK(a.indices(1, 2, 3, 5) == b.indices(1, 2, 3, 5));
  CHECK(a.indices(0, 0, 0, 10) != c.indices(0, 0, 0, 10));
  // The cache must not leak one epoch into another, in either direction.
  const auto first = a.indices(0, 4, 0, 10);
  a.indices(7, 0, 0, 10);
  CHECK(a.indices(0, 4, 0, 10) == first);
  // Golden values: they change only if the permutation or its keys change.
  CHECK(a.indices(0, 0, 0, 4) == std::vector<int64_t>{18, 29, 0, 5});
}

TEST_CASE("epoch permutations are bijections for every size, and look shuffled") {
  for (int64_t n = 1; n <= 300; ++n) {
    CAPTURE(n);
    const EpochPermutation perm(n, static_cast<uint64_t>(n) * 7919);
    std::vector<char> hit(static_cast<size_t>(n), 0);
    for (int64_t i = 0; i < n; ++i) {
      const int64_t p = perm(i);
      REQUIRE(p >= 0);
      REQUIRE(p < n);
      CHECK(hit[static_cast<size_t>(p)] == 0);
      hit[static_cast<size_t>(p)] = 1;
    }
  }
  // Shuffled: the rank correlation of position and sample is near 0, and neighbours in the
  // order are rarely neighbours in the data.
  const int64_t n = 100000;
  const DistributedSampler sampler(n, 100, 3);
  const std::vector<int64_t> order = sampler.permutation(0);
  double mean = (n - 1) / 2.0, cov = 0, var = 0;
  int64_t adjacent = 0;
  for (int64_t i = 0; i < n; ++i) {
    const auto p = static_cast<double>(order[static_cast<size_t>(i)]);
    cov += (static_cast<double>(i) - mean) * (p - mean);
    var += (static_cast<double>(i) - mean) * (static_cast<double>(i) - mean);
    if (i > 0 && std::abs(order[static_cast<size_t>(i)] - order[static_cast<size_t>(i - 1)]) == 1) {
      ++adjacent;
    }
  }
  CHECK(std::abs(cov / var) < 0.02);
  CHECK(adjacent < 20);  // about 2 expected
  // Each tenth of the data is about a tenth of the first 10000 samples drawn.
  std::vector<int> tenths(10, 0);
  for (size_t i = 0; i < 10000; ++i)
    ++tenths[static_cast<size_t>(order[i] / (n / 10))];
  for (const int t : tenths)
    CHECK(std::abs(t - 1000) < 150);
}

TEST_CASE("a sampler over 10^12 samples (a token dataset's windows) costs no memory up front") {
  const int64_t n = 1000000000000;
  const DistributedSampler sampler(n, 512, 7);
  CHECK(sampler.steps_per_epoch() == n / 512);
  std::set<int64_t> seen;
  for (const int64_t batch : {int64_t{0}, int64_t{1}, n / 512 - 1}) {
    for (int64_t i : sampler.indices(3, batch, 0, 512)) {
      CHECK(i >= 0);
      CHECK(i < n);
      CHECK(seen.insert(i).second);
    }
  }
}

TEST_CASE("2 ranks x B, 1 rank x 2B and 1 rank x B x 2 micro-batches see the same samples") {
  for (int64_t step : {0, 1, 40, 83}) {
    CAPTURE(step);
    const auto two_ranks = step_samples(2, 6, 1, step);
    CHECK(two_ranks.size() == 12);
    CHECK(two_ranks == step_samples(1, 12, 1, step));
    CHECK(two_ranks == step_samples(1, 6, 2, step));
    CHECK(two_ranks == step_samples(4, 3, 1, step));
  }
}

TEST_CASE("a dataset smaller than one global batch names both sizes") {
  CHECK_THROWS_WITH_AS(DistributedSampler(10, 16, 1),
                       doctest::Contains("/train/batch_per_rank: the training split has 10 "
                                         "samples, fewer than one global batch"),
                       Error);
  CHECK_THROWS_WITH_AS(DistributedSampler(10, 16, 1), doctest::Contains("= 16"), Error);
  const DistributedSampler sampler(10, 4, 1);
  CHECK_THROWS_AS(sampler.indices(0, 2, 0, 4), Error);  // only 2 batches per epoch
  CHECK_THROWS_AS(sampler.indices(0, 0, 2, 3), Error);  // past the global batch
}

TEST_CASE("a position saved under one global batch continues under another without repeats") {
  const int64_t n = 100;
  const DistributedSampler big(n, 24, 9), small(n, 10, 9);
  std::set<int64_t> seen;
  const auto take = [&seen](const DistributedSampler& s, DataPosition at, int64_t count) {
    std::vector<int64_t> out(static_cast<size_t>(count));
    s.indices(at, 0, out);
    for (int64_t i : out)
      CHECK(seen.insert(i).second);  // never twice in the epoch
  };
  DataPosition at;
  for (int i = 0; i < 2; ++i) {  // two steps of 24: 48 samples
    take(big, at, 24);
    at = big.advance(at);
  }
  CHECK(at == DataPosition{0, 48});
  at = small.normalize(at);  // the job continues with a global batch of 10
  CHECK(at == DataPosition{0, 48});
  while (at.epoch == 0) {
    take(small, at, 10);
    at = small.advance(at);
  }
  CHECK(seen.size() == 98);  // 48 + 5 x 10: only the tail of 2 is dropped
  CHECK(at == DataPosition{1, 0});
  // A position where a whole batch no longer fits moves to the next epoch.
  CHECK(big.normalize({3, 90}) == DataPosition{4, 0});
  CHECK(small.normalize({3, 90}) == DataPosition{3, 90});
}

}  // namespace dptrain
