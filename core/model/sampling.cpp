#include "core/model/sampling.hpp"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "core/tensor/random.hpp"

namespace dptrain {

int32_t draw_token(std::vector<float> logits, int64_t vocab, double temperature, int64_t top_k,
                   std::mt19937_64& rng) {
  if (vocab < static_cast<int64_t>(logits.size())) logits.resize(static_cast<size_t>(vocab));
  // A NaN (a diverged model) is never drawn, and would break the ordering below.
  for (float& v : logits) {
    if (std::isnan(v)) v = -INFINITY;
  }
  const auto n = static_cast<int64_t>(logits.size());
  if (temperature <= 0.0) {
    return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  }
  if (top_k > 0 && top_k < n) {
    std::vector<size_t> ids(logits.size());
    std::iota(ids.begin(), ids.end(), size_t{0});
    std::nth_element(ids.begin(), ids.begin() + top_k, ids.end(), [&](size_t a, size_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    for (auto out = ids.begin() + top_k; out != ids.end(); ++out)
      logits[*out] = -INFINITY;
  }
  const float top = *std::max_element(logits.begin(), logits.end());
  std::vector<double> weights(logits.size());
  double total = 0;
  for (size_t i = 0; i < logits.size(); ++i) {
    weights[i] = std::exp((static_cast<double>(logits[i]) - top) / temperature);
    total += weights[i];
  }
  double r = uniform01(rng) * total;
  for (size_t i = 0; i < weights.size(); ++i) {
    r -= weights[i];
    if (r < 0 && weights[i] > 0) return static_cast<int32_t>(i);
  }
  // Rounding left r at the very end: the last id with any weight.
  for (size_t i = weights.size(); i-- > 0;) {
    if (weights[i] > 0) return static_cast<int32_t>(i);
  }
  return 0;
}

}  // namespace dptrain
