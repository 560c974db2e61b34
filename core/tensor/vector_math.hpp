// Elementwise math written so that the loops calling it vectorise: std::exp and std::tanh stay
// scalar libm calls without -ffast-math, and these are branch-free (range checks are integer
// masks) and deterministic.
#pragma once

#include <bit>
#include <cstdint>

namespace dptrain {

// exp(x) for the softmax's x = score - row max <= 0, written so that the loop calling it
// vectorises: std::exp is a scalar libm call without -ffast-math, and the range checks are
// integer masks, not branches. exp(x) = 2^k e^r with k = round(x / ln 2), |r| <= ln(2) / 2, e^r
// by its degree-7 Taylor polynomial: within 1.3 ulp of the true value. x below -87 (about the
// last normal result) gives 0; NaN stays NaN.
[[gnu::always_inline]] inline float exp_nonpositive(float x) {
  constexpr int32_t kMinMagnitude = std::bit_cast<int32_t>(87.0f);
  constexpr int32_t kInfMagnitude = 0x7f800000;
  constexpr float kLog2e = 1.44269504088896341f;
  constexpr float kLn2High = 0.693145751953125f;     // ln 2 with its low mantissa bits cleared:
  constexpr float kLn2Low = 1.428606765330187e-06f;  // k * kLn2High is exact for |k| <= 126
  const int32_t bits = std::bit_cast<int32_t>(x);
  const int32_t magnitude = bits & 0x7fffffff;
  const int32_t below_mask = (kMinMagnitude - magnitude) >> 31;  // all ones: |x| > 87 or NaN
  const int32_t nan_mask = (kInfMagnitude - magnitude) >> 31;
  const float clamped =
      std::bit_cast<float>((bits & ~below_mask) | (std::bit_cast<int32_t>(-87.0f) & below_mask));
  const int32_t k = static_cast<int32_t>(clamped * kLog2e - 0.5f);  // rounds: the value is < 0
  const float kf = static_cast<float>(k);
  const float r = (clamped - kf * kLn2High) - kf * kLn2Low;
  float p = 1.0f / 5040.0f;
  p = p * r + 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float two_k = std::bit_cast<float>((k + 127) << 23);  // k in [-126, 0]
  const int32_t value = std::bit_cast<int32_t>(p * two_k) & ~below_mask;
  return std::bit_cast<float>((value & ~nan_mask) | (bits & nan_mask));
}

// tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|): within a few ulp of 1 in absolute
// terms (what GELU needs); +-1 for large |x|.
[[gnu::always_inline]] inline float tanh_fast(float x) {
  const int32_t bits = std::bit_cast<int32_t>(x);
  const float magnitude = std::bit_cast<float>(bits & 0x7fffffff);
  const float e = exp_nonpositive(-2.0f * magnitude);
  const float t = (1.0f - e) / (1.0f + e);
  return std::bit_cast<float>(std::bit_cast<int32_t>(t) |
                              (bits & static_cast<int32_t>(0x80000000)));
}

}  // namespace dptrain
