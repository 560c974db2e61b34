// Stable 64-bit content checksums.
#include "core/checksum.hpp"

#include <algorithm>
#include <cstring>

#include <fmt/format.h>

namespace dptrain {

namespace {
constexpr uint64_t kOffset = 14695981039346656037ull;
constexpr uint64_t kPrime = 1099511628211ull;
}  // namespace

Checksum64::Checksum64(uint64_t seed)
    : lane_{kOffset ^ seed, kOffset ^ (seed + 1), kOffset ^ (seed + 2), kOffset ^ (seed + 3)},
      pending_{} {}

void Checksum64::update(const void* data, size_t bytes) {
  if (bytes == 0) return;
  const auto* p = static_cast<const unsigned char*>(data);
  total_ += bytes;
  // Four independent lanes keep the multiply chain from serialising the loop; each takes one
  // 8-byte word of every 32-byte block.
  const auto block = [this](const unsigned char* b) {
    for (int k = 0; k < 4; ++k) {
      uint64_t w;
      std::memcpy(&w, b + 8 * k, 8);
      lane_[k] = (lane_[k] ^ w) * kPrime;
    }
  };
  if (pending_bytes_ > 0) {
    const size_t take = std::min(bytes, sizeof pending_ - pending_bytes_);
    std::memcpy(pending_ + pending_bytes_, p, take);
    pending_bytes_ += take;
    p += take;
    bytes -= take;
    if (pending_bytes_ < sizeof pending_) return;
    block(pending_);
    pending_bytes_ = 0;
  }
  for (; bytes >= 32; p += 32, bytes -= 32)
    block(p);
  std::memcpy(pending_, p, bytes);
  pending_bytes_ = bytes;
}

uint64_t Checksum64::value() const {
  uint64_t h = kOffset ^ total_;
  for (uint64_t l : lane_)
    h = (h ^ l) * kPrime;
  // The tail bytes past the last whole block, one at a time.
  for (size_t i = 0; i < pending_bytes_; ++i)
    h = (h ^ pending_[i]) * kPrime;
  // Final avalanche so nearby inputs give distant outputs.
  h ^= h >> 33;
  h *= 0xff51afd7ed558ccdull;
  h ^= h >> 33;
  return h;
}

uint64_t checksum64(const void* data, size_t bytes, uint64_t seed) {
  Checksum64 sum(seed);
  sum.update(data, bytes);
  return sum.value();
}

std::string checksum_hex(uint64_t value) {
  return fmt::format("{:016x}", value);
}

}  // namespace dptrain
