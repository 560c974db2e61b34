// Stable 64-bit content checksums for checkpoint blobs and cross-rank parameter comparison.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace dptrain {

// FNV-1a over 8-byte words (then the tail bytes): stable across machines and runs, fast enough for
// parameter buffers. Not cryptographic.
uint64_t checksum64(const void* data, size_t bytes, uint64_t seed = 0);
std::string checksum_hex(uint64_t value);  // 16 lower-case hex digits

}  // namespace dptrain
