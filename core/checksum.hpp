// Stable 64-bit content checksums for checkpoint blobs and cross-rank parameter comparison.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dptrain {

// FNV-1a over 8-byte words (then the tail bytes): stable across machines and runs, fast enough for
// parameter buffers. Not cryptographic.
uint64_t checksum64(const void* data, size_t bytes, uint64_t seed = 0);
// checksum64 of bytes that come in pieces (a file read a piece at a time): update() with each,
// in order, then value() is checksum64 of them all, however they were cut.
class Checksum64 {
 public:
  explicit Checksum64(uint64_t seed = 0);
  void update(const void* data, size_t bytes);
  uint64_t value() const;

 private:
  uint64_t lane_[4];
  unsigned char pending_[32];  // the start of a 32-byte block still to come
  size_t pending_bytes_ = 0;
  uint64_t total_ = 0;
};
std::string checksum_hex(uint64_t value);  // 16 lower-case hex digits

}  // namespace dptrain
