// Encoding and decoding of the TCP store's frames (see store_protocol.hpp).
#include "core/comm/store_protocol.hpp"

#include <fmt/format.h>

#include "core/error.hpp"

namespace dptrain::store_protocol {

namespace {

[[noreturn]] void malformed(const std::string& why) {
  throw Error(ErrorKind::comm, "malformed store message: " + why);
}

uint32_t checked_u32(size_t size) {
  if (size > kMaxFrameBytes) {
    throw Error(ErrorKind::comm,
                fmt::format("store message field of {} bytes exceeds the {} byte limit", size,
                            kMaxFrameBytes));
  }
  return static_cast<uint32_t>(size);
}

}  // namespace

FrameWriter& FrameWriter::u8(uint8_t value) {
  bytes_.push_back(static_cast<char>(value));
  return *this;
}

FrameWriter& FrameWriter::unsigned_le(uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i)
    bytes_.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
  return *this;
}

FrameWriter& FrameWriter::str(std::string_view value) {
  u32(checked_u32(value.size()));
  bytes_.append(value);
  return *this;
}

FrameWriter& FrameWriter::strs(const std::vector<std::string>& values) {
  u32(checked_u32(values.size()));
  for (const auto& value : values)
    str(value);
  return *this;
}

std::string FrameWriter::finish() {
  const uint32_t length = checked_u32(bytes_.size() - kLengthBytes);
  for (size_t i = 0; i < kLengthBytes; ++i)
    bytes_[i] = static_cast<char>((length >> (8 * i)) & 0xff);
  return std::move(bytes_);
}

std::string_view FrameReader::take(size_t size) {
  if (size > rest_.size()) {
    malformed(fmt::format("field of {} bytes but only {} left", size, rest_.size()));
  }
  const std::string_view field = rest_.substr(0, size);
  rest_.remove_prefix(size);
  return field;
}

uint64_t FrameReader::unsigned_le(int bytes) {
  const std::string_view field = take(static_cast<size_t>(bytes));
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i) {
    value |= static_cast<uint64_t>(static_cast<unsigned char>(field[i])) << (8 * i);
  }
  return value;
}

std::string FrameReader::str() {
  return std::string(take(u32()));
}

std::vector<std::string> FrameReader::strs() {
  const uint32_t count = u32();
  // Each string needs at least its length field, so a bogus count fails here, before allocating.
  if (count > rest_.size() / kLengthBytes) malformed(fmt::format("{} strings cannot fit", count));
  std::vector<std::string> values;
  values.reserve(count);
  for (uint32_t i = 0; i < count; ++i)
    values.push_back(str());
  return values;
}

void FrameReader::expect_end() const {
  if (!rest_.empty()) malformed(fmt::format("{} unexpected trailing bytes", rest_.size()));
}

uint32_t frame_length(std::string_view header) {
  FrameReader reader(header.substr(0, kLengthBytes));
  return reader.u32();
}

}  // namespace dptrain::store_protocol
