// Stable 64-bit content checksums.
#include "core/checksum.hpp"

#include <cstring>

#include <fmt/format.h>

namespace dptrain {

namespace {
constexpr uint64_t kOffset = 14695981039346656037ull;
constexpr uint64_t kPrime = 1099511628211ull;
}  // namespace

uint64_t checksum64(const void* data, size_t bytes, uint64_t seed) {
  const auto* p = static_cast<const unsigned char*>(data);
  // Four independent lanes keep the multiply chain from serialising the loop.
  uint64_t lane[4] = {kOffset ^ seed, kOffset ^ (seed + 1), kOffset ^ (seed + 2),
                      kOffset ^ (seed + 3)};
  size_t i = 0;
  for (; i + 32 <= bytes; i += 32) {
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      lane[k] = (lane[k] ^ w) * kPrime;
    }
  }
  uint64_t h = kOffset ^ static_cast<uint64_t>(bytes);
  for (uint64_t l : lane)
    h = (h ^ l) * kPrime;
  for (; i < bytes; ++i)
    h = (h ^ p[i]) * kPrime;
  // Final avalanche so nearby inputs give distant outputs.
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return h;
}

std::string checksum_hex(uint64_t value) {
  return fmt::format("{:016x}", value);
}

}  // namespace dptrain
