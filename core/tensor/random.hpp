// Platform-stable random numbers: every value is derived from raw std::mt19937_64 output by our own
// code, because the standard distributions and std::shuffle differ between standard libraries.
#pragma once

#include <cmath>
#include <cstdint>
#include <random>
#include <span>

namespace dptrain {

// SplitMix64 finalizer: a bijective mix so nearby seeds give unrelated streams.
inline uint64_t mix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

// A seed for one independent stream (`stream` names what it is for) of the run seed.
inline uint64_t derive_seed(uint64_t seed, uint64_t stream) {
  return mix64(seed ^ mix64(stream));
}

// Uniform in [0, 1) with 53 random bits.
inline double uniform01(std::mt19937_64& rng) {
  return static_cast<double>(rng() >> 11) * 0x1.0p-53;
}

// Uniform integer in [0, bound), bound > 0, without modulo bias (rejects the short last range).
inline uint64_t uniform_below(std::mt19937_64& rng, uint64_t bound) {
  const uint64_t threshold = (0 - bound) % bound;  // 2^64 mod bound
  for (;;) {
    const uint64_t r = rng();
    if (r >= threshold) return r % bound;
  }
}

// Standard normals by Marsaglia's polar method, in float: each 64-bit output gives the two 24-bit
// uniforms of one attempt, and no trigonometry is needed, which makes data generation several times
// faster than double Box-Muller. Fills out completely (an odd tail wastes one value).
inline void fill_standard_normal(std::mt19937_64& rng, std::span<float> out) {
  constexpr float kUnit = 0x1.0p-23f;  // 24-bit uniform in [0, 1), times 2
  for (size_t i = 0; i < out.size(); i += 2) {
    float u = 0, v = 0, s = 0;
    do {
      const uint64_t bits = rng();
      u = static_cast<float>(bits >> 40) * kUnit - 1.0f;  // in [-1, 1), exact
      v = static_cast<float>((bits >> 8) & 0xffffff) * kUnit - 1.0f;
      s = u * u + v * v;
    } while (s >= 1.0f || s == 0.0f);
    const float factor = std::sqrt(-2.0f * std::log(s) / s);
    out[i] = u * factor;
    if (i + 1 < out.size()) out[i + 1] = v * factor;
  }
}

// Fisher-Yates from the back.
template <typename T>
void shuffle(std::mt19937_64& rng, std::span<T> values) {
  for (size_t i = values.size(); i > 1; --i) {
    const size_t j = static_cast<size_t>(uniform_below(rng, i));
    std::swap(values[i - 1], values[j]);
  }
}

}  // namespace dptrain
