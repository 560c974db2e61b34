#include "core/model/sampling.hpp"

#include <doctest/doctest.h>

#include <limits>
#include <set>

namespace dptrain {

TEST_CASE("draw_token: top-k draws among exactly K ids, ties at the K-th going to the lower ids") {
  std::mt19937_64 rng(7);
  // Every logit equal (a model that has learnt nothing): --top-k 1 is greedy, id 0.
  const std::vector<float> flat(16, 0.0f);
  for (int i = 0; i < 50; ++i)
    CHECK(draw_token(flat, 16, 1.0, 1, rng) == 0);
  std::set<int32_t> drawn;
  for (int i = 0; i < 400; ++i)
    drawn.insert(draw_token(flat, 16, 1.0, 3, rng));
  CHECK(drawn == std::set<int32_t>{0, 1, 2});
  // Above a tie: the larger ones first, then the lower ids of the tie.
  const std::vector<float> logits = {0.0f, 1.0f, 0.5f, 1.0f, 0.5f, 2.0f};
  drawn.clear();
  for (int i = 0; i < 400; ++i)
    drawn.insert(draw_token(logits, 6, 1.0, 4, rng));
  CHECK(drawn == std::set<int32_t>{1, 2, 3, 5});
  // Temperature 0 is the largest, the first on ties; ids past `vocab` are never drawn.
  CHECK(draw_token(logits, 6, 0.0, 0, rng) == 5);
  CHECK(draw_token(logits, 4, 0.0, 0, rng) == 1);
  for (int i = 0; i < 100; ++i)
    CHECK(draw_token(logits, 3, 1.0, 0, rng) < 3);
  // A NaN (a diverged model) is never drawn, with or without top-k.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> with_nan = {nan, 0.5f, nan, 0.25f, nan};
  for (int i = 0; i < 200; ++i) {
    const int32_t all = draw_token(with_nan, 5, 1.0, 0, rng);
    const int32_t top = draw_token(with_nan, 5, 1.0, 2, rng);
    CHECK((all == 1 || all == 3));
    CHECK((top == 1 || top == 3));
  }
}

}  // namespace dptrain
