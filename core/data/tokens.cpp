// Token files, tokenizers and token-window datasets (see tokens.hpp for the formats).
#include "core/data/tokens.hpp"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <system_error>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/checksum.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"

namespace dptrain {

namespace fs = std::filesystem;

namespace {

// ---- little-endian fields, whatever the host order ----

void put_le(std::string& buf, size_t offset, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i)
    buf[offset + static_cast<size_t>(i)] = static_cast<char>((value >> (8 * i)) & 0xff);
}

uint64_t get_le(const unsigned char* p, int bytes) {
  uint64_t value = 0;
  for (int i = 0; i < bytes; ++i)
    value |= static_cast<uint64_t>(p[i]) << (8 * i);
  return value;
}

// Token files are little-endian, and so is every host this builds for: tokens are read as they
// lie, without a per-byte decode (a run's data can be many gigabytes).
static_assert(std::endian::native == std::endian::little, "token files are read as little-endian");

template <class Stored>
void decode_tokens(const unsigned char* p, size_t n, int32_t* out) {
  for (size_t i = 0; i < n; ++i) {
    Stored token;
    std::memcpy(&token, p + i * sizeof(Stored), sizeof(Stored));
    out[i] = static_cast<int32_t>(token);
  }
}

template <class Stored>
std::optional<size_t> first_at_least(const unsigned char* p, size_t count, uint64_t limit) {
  // The largest of each block first (a loop that vectorises), the index only in a block that
  // holds one.
  constexpr size_t kBlock = size_t{1} << 16;
  for (size_t begin = 0; begin < count; begin += kBlock) {
    const size_t end = std::min(count, begin + kBlock);
    Stored largest = 0;
    for (size_t i = begin; i < end; ++i) {
      Stored token;
      std::memcpy(&token, p + i * sizeof(Stored), sizeof(Stored));
      largest = std::max(largest, token);
    }
    if (largest < limit) continue;
    for (size_t i = begin; i < end; ++i) {
      Stored token;
      std::memcpy(&token, p + i * sizeof(Stored), sizeof(Stored));
      if (token >= limit) return i;
    }
  }
  return std::nullopt;
}

// The index of the first of `count` tokens of `width` bytes that is not below `limit`.
std::optional<size_t> first_token_at_least(const unsigned char* p, size_t count, int width,
                                           uint64_t limit) {
  return width == 2 ? first_at_least<uint16_t>(p, count, limit)
                    : first_at_least<uint32_t>(p, count, limit);
}

[[noreturn]] void bad_file(const fs::path& path, const std::string& what) {
  throw Error(ErrorKind::recipe, fmt::format("{}: {}", path.string(), what));
}

// The file's size, or Error(recipe) "PATH: cannot read: reason".
uint64_t regular_file_size(const fs::path& path) {
  std::error_code ec;
  const fs::file_status status = fs::status(path, ec);
  if (ec || !fs::exists(status)) {
    bad_file(path, fmt::format("cannot read: {}",
                               ec ? ec.message() : std::string(std::strerror(ENOENT))));
  }
  if (!fs::is_regular_file(status)) bad_file(path, "cannot read: not a regular file");
  const uintmax_t size = fs::file_size(path, ec);
  if (ec) bad_file(path, fmt::format("cannot read: {}", ec.message()));
  return size;
}

std::string code_point_name(char32_t cp) {
  return fmt::format("U+{:04X}", static_cast<uint32_t>(cp));
}

// 'é' (U+00E9), or only U+000A for a control character, so a message stays one line.
std::string describe_char(char32_t cp) {
  if (cp < 0x20 || cp == 0x7f || (cp >= 0x80 && cp < 0xa0)) return code_point_name(cp);
  std::string printable;
  append_utf8(printable, cp);
  return fmt::format("'{}' ({})", printable, code_point_name(cp));
}

[[noreturn]] void bad_utf8(size_t offset, unsigned char byte, const char* what) {
  throw Error(ErrorKind::usage, fmt::format("invalid UTF-8 at byte offset {} (byte 0x{:02x}: {})",
                                            offset, byte, what));
}

constexpr char32_t kMaxCodePoint = 0x10ffff;

// Decodes the code point starting at text[i] and advances i past it.
char32_t next_code_point(std::string_view text, size_t& i) {
  const auto lead = static_cast<unsigned char>(text[i]);
  if (lead < 0x80) {
    ++i;
    return lead;
  }
  int length = 0;
  char32_t cp = 0, minimum = 0;
  if ((lead & 0xe0) == 0xc0) {
    length = 2, cp = lead & 0x1f, minimum = 0x80;
  } else if ((lead & 0xf0) == 0xe0) {
    length = 3, cp = lead & 0x0f, minimum = 0x800;
  } else if ((lead & 0xf8) == 0xf0) {
    length = 4, cp = lead & 0x07, minimum = 0x10000;
  } else if ((lead & 0xc0) == 0x80) {
    bad_utf8(i, lead, "a continuation byte without a lead byte");
  } else {
    bad_utf8(i, lead, "not a UTF-8 lead byte");
  }
  for (int k = 1; k < length; ++k) {
    // What cuts it short first: a byte that does not continue it, or the end of the text.
    if (i + static_cast<size_t>(k) >= text.size()) {
      bad_utf8(i, lead, "the sequence is cut short by the end of the text");
    }
    const auto next = static_cast<unsigned char>(text[i + static_cast<size_t>(k)]);
    if ((next & 0xc0) != 0x80) bad_utf8(i, lead, "the sequence is cut short");
    cp = (cp << 6) | (next & 0x3f);
  }
  if (cp < minimum) bad_utf8(i, lead, "an overlong encoding");
  if (cp >= 0xd800 && cp <= 0xdfff) bad_utf8(i, lead, "a UTF-16 surrogate");
  if (cp > kMaxCodePoint) bad_utf8(i, lead, "above U+10FFFF");
  i += static_cast<size_t>(length);
  return cp;
}

// Ids below this code point are looked up in a dense table.
constexpr char32_t kDenseLimit = 0x10000;

}  // namespace

// ---- token files ----

int64_t dtype_capacity(int dtype_bytes) {
  if (dtype_bytes == 2) return int64_t{1} << 16;
  if (dtype_bytes == 4) return int64_t{1} << 31;
  throw Error(ErrorKind::internal, fmt::format("token dtype of {} bytes", dtype_bytes));
}

std::string dtype_name(int dtype_bytes) {
  if (dtype_bytes == 2) return "uint16";
  if (dtype_bytes == 4) return "uint32";
  throw Error(ErrorKind::internal, fmt::format("token dtype of {} bytes", dtype_bytes));
}

TokenFileHeader read_token_header(const fs::path& path) {
  const uint64_t size = regular_file_size(path);
  std::string raw(kTokenHeaderBytes, '\0');
  {
    std::ifstream in(path, std::ios::binary);
    if (!in) bad_file(path, fmt::format("cannot read: {}", std::strerror(errno)));
    in.read(raw.data(), static_cast<std::streamsize>(raw.size()));
    raw.resize(static_cast<size_t>(in.gcount()));
  }
  if (raw.size() < sizeof(kTokenFileMagic) ||
      std::memcmp(raw.data(), kTokenFileMagic, sizeof(kTokenFileMagic)) != 0) {
    bad_file(path, "not a dptrain token file (bad magic)");
  }
  if (raw.size() < kTokenHeaderBytes) {
    bad_file(path, fmt::format("truncated: expected at least {} bytes (the header), got {}",
                               kTokenHeaderBytes, size));
  }
  const auto* p = reinterpret_cast<const unsigned char*>(raw.data());
  const uint64_t version = get_le(p + 8, 4);
  if (version != kTokenFileVersion) {
    bad_file(path, fmt::format("unknown format version {} (this dptrain reads version {})", version,
                               kTokenFileVersion));
  }
  const uint64_t dtype = get_le(p + 12, 4);
  if (dtype != 2 && dtype != 4) {
    bad_file(path,
             fmt::format("unknown token dtype {} (expected 2 = uint16 or 4 = uint32)", dtype));
  }
  TokenFileHeader header;
  header.dtype_bytes = static_cast<int>(dtype);
  const uint64_t vocab = get_le(p + 16, 8);
  if (vocab < 1) bad_file(path, "vocab 0: a vocabulary holds at least 1 token");
  if (vocab > static_cast<uint64_t>(dtype_capacity(header.dtype_bytes))) {
    bad_file(path, fmt::format("vocab {} does not fit its dtype {}", vocab,
                               dtype_name(header.dtype_bytes)));
  }
  header.vocab = static_cast<int64_t>(vocab);
  const uint64_t count = get_le(p + 24, 8);
  const uint64_t max_count = (std::numeric_limits<uint64_t>::max() - kTokenHeaderBytes) / dtype;
  if (count > max_count) {
    bad_file(path, fmt::format("the header's token count {} is impossible (no file holds more "
                               "than {} {} tokens)",
                               count, max_count, dtype_name(header.dtype_bytes)));
  }
  const uint64_t expected = kTokenHeaderBytes + count * dtype;
  if (expected < size) {
    bad_file(path,
             fmt::format("size mismatch: the header's {} tokens take {} bytes, the file has {}",
                         count, expected, size));
  }
  if (expected > size) {
    bad_file(path, fmt::format("truncated: expected {} bytes, got {}", expected, size));
  }
  header.count = static_cast<int64_t>(count);
  header.checksum = get_le(p + 32, 8);
  // Bytes 40-63 are zero in version 1: others are a file damaged there, or one whose writer
  // means something by them that this reader would ignore.
  for (size_t at = 40; at < kTokenHeaderBytes; ++at) {
    if (p[at] != 0) {
      bad_file(path, fmt::format("header byte {} is {:#04x}, where version 1 has zero (bytes "
                                 "40-63): damaged, or not written by dptrain",
                                 at, static_cast<unsigned>(p[at])));
    }
  }
  return header;
}

MappedTokens::MappedTokens(const fs::path& path) : path_(path), header_(read_token_header(path)) {
  const auto width = static_cast<size_t>(header_.dtype_bytes);
  const auto count = static_cast<size_t>(header_.count);
  const size_t bytes = kTokenHeaderBytes + count * width;
  if (count > 0) {
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) bad_file(path, fmt::format("cannot read: {}", std::strerror(errno)));
    struct stat st {};
    const bool sized = ::fstat(fd, &st) == 0;
    // The header was read from the file as it was; one replaced or cut since is read again.
    if (!sized || static_cast<uint64_t>(st.st_size) != bytes) {
      ::close(fd);
      bad_file(path, sized ? fmt::format("changed while it was read: {} bytes, the header says {}",
                                         st.st_size, bytes)
                           : fmt::format("cannot read: {}", std::strerror(errno)));
    }
    void* map = ::mmap(nullptr, bytes, PROT_READ, MAP_SHARED, fd, 0);
    const int map_errno = errno;
    ::close(fd);
    if (map == MAP_FAILED) {
      bad_file(path, fmt::format("cannot map {} bytes: {}", bytes, std::strerror(map_errno)));
    }
    map_ = map;
    map_bytes_ = bytes;
  }
  try {
    const unsigned char* tokens = nullptr;
    if (map_ != nullptr) {
      tokens = static_cast<const unsigned char*>(map_) + kTokenHeaderBytes;
      ::madvise(map_, map_bytes_, MADV_SEQUENTIAL);
    }
    const uint64_t actual = checksum64(tokens, count * width);
    if (actual != header_.checksum) {
      bad_file(path, fmt::format("checksum mismatch (the header says {}, the tokens give {})",
                                 checksum_hex(header_.checksum), checksum_hex(actual)));
    }
    if (const auto bad = first_token_at_least(tokens, count, header_.dtype_bytes,
                                              static_cast<uint64_t>(header_.vocab))) {
      bad_file(path, fmt::format("token {} at index {} is not below the vocab {}",
                                 get_le(tokens + *bad * width, header_.dtype_bytes), *bad,
                                 header_.vocab));
    }
    // Windows are read where the sampler puts them, not in order.
    if (map_ != nullptr) ::madvise(map_, map_bytes_, MADV_NORMAL);
  } catch (...) {
    if (map_ != nullptr) ::munmap(map_, map_bytes_);
    throw;
  }
}

MappedTokens::~MappedTokens() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
}

void MappedTokens::copy(int64_t start, int64_t n, int32_t* out) const {
  if (start < 0 || n < 0 || start > header_.count - n) {
    throw Error(ErrorKind::internal, fmt::format("{}: tokens [{}, {}) outside [0, {})",
                                                 path_.string(), start, start + n, header_.count));
  }
  if (n == 0) return;
  const auto* p = static_cast<const unsigned char*>(map_) + kTokenHeaderBytes +
                  static_cast<size_t>(start) * static_cast<size_t>(header_.dtype_bytes);
  if (header_.dtype_bytes == 2) {
    decode_tokens<uint16_t>(p, static_cast<size_t>(n), out);
  } else {
    decode_tokens<uint32_t>(p, static_cast<size_t>(n), out);
  }
}

TokenFile read_token_file(const fs::path& path) {
  const MappedTokens mapped(path);
  TokenFile file;
  file.vocab = mapped.vocab();
  file.dtype_bytes = mapped.header().dtype_bytes;
  file.tokens.resize(static_cast<size_t>(mapped.size()));
  mapped.copy(0, mapped.size(), file.tokens.data());
  return file;
}

void write_token_file(const fs::path& path, int64_t vocab, std::span<const int32_t> tokens,
                      int dtype_bytes, const WorkProgress& progress) {
  const int64_t capacity = dtype_capacity(dtype_bytes);
  if (vocab < 1 || vocab > capacity) {
    throw Error(ErrorKind::usage,
                fmt::format("{}: a vocabulary of {} does not fit {} (it holds {} ids)",
                            path.string(), vocab, dtype_name(dtype_bytes), capacity));
  }
  const auto width = static_cast<size_t>(dtype_bytes);
  std::string buf(kTokenHeaderBytes + tokens.size() * width, '\0');
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (progress && i % kWorkProgressEvery == 0) progress(i);
    if (tokens[i] < 0 || tokens[i] >= vocab) {
      throw Error(ErrorKind::internal, fmt::format("{}: token {} at index {} is outside [0, {})",
                                                   path.string(), tokens[i], i, vocab));
    }
    put_le(buf, kTokenHeaderBytes + i * width, static_cast<uint64_t>(tokens[i]), dtype_bytes);
  }
  std::memcpy(buf.data(), kTokenFileMagic, sizeof(kTokenFileMagic));
  put_le(buf, 8, kTokenFileVersion, 4);
  put_le(buf, 12, width, 4);
  put_le(buf, 16, static_cast<uint64_t>(vocab), 8);
  put_le(buf, 24, tokens.size(), 8);
  put_le(buf, 32, checksum64(buf.data() + kTokenHeaderBytes, buf.size() - kTokenHeaderBytes), 8);
  write_file_atomic(path, buf);
}

// ---- UTF-8 ----

std::vector<char32_t> decode_utf8(std::string_view text) {
  std::vector<char32_t> out;
  out.reserve(text.size());
  for (size_t i = 0; i < text.size();)
    out.push_back(next_code_point(text, i));
  return out;
}

void append_utf8(std::string& out, char32_t cp) {
  const auto byte = [&](uint32_t b) { out.push_back(static_cast<char>(b)); };
  const auto c = static_cast<uint32_t>(cp);
  if (c < 0x80) {
    byte(c);
  } else if (c < 0x800) {
    byte(0xc0 | (c >> 6));
    byte(0x80 | (c & 0x3f));
  } else if (c < 0x10000) {
    byte(0xe0 | (c >> 12));
    byte(0x80 | ((c >> 6) & 0x3f));
    byte(0x80 | (c & 0x3f));
  } else {
    byte(0xf0 | (c >> 18));
    byte(0x80 | ((c >> 12) & 0x3f));
    byte(0x80 | ((c >> 6) & 0x3f));
    byte(0x80 | (c & 0x3f));
  }
}

// ---- tokenizers ----

Tokenizer Tokenizer::byte() {
  return Tokenizer();
}

Tokenizer Tokenizer::from_chars(std::vector<char32_t> chars) {
  Tokenizer t;
  t.char_mode_ = true;
  t.chars_ = std::move(chars);
  char32_t dense_end = 0;
  for (char32_t cp : t.chars_) {
    if (cp < kDenseLimit) dense_end = std::max<char32_t>(dense_end, cp + 1);
  }
  t.low_ids_.assign(dense_end, -1);
  std::vector<std::pair<char32_t, int32_t>> high;
  for (size_t id = 0; id < t.chars_.size(); ++id) {
    const char32_t cp = t.chars_[id];
    if (cp < kDenseLimit) {
      t.low_ids_[cp] = static_cast<int32_t>(id);
    } else {
      high.emplace_back(cp, static_cast<int32_t>(id));
    }
  }
  std::sort(high.begin(), high.end());
  for (const auto& [cp, id] : high) {
    t.sorted_.push_back(cp);
    t.sorted_ids_.push_back(id);
  }
  return t;
}

Tokenizer Tokenizer::chars_of(std::string_view text, const WorkProgress& progress) {
  std::vector<bool> seen(kMaxCodePoint + 1);
  for (size_t i = 0, next_report = 0; i < text.size();) {
    if (progress && i >= next_report) {
      progress(i);
      next_report = i + kWorkProgressEvery;
    }
    seen[next_code_point(text, i)] = true;
  }
  std::vector<char32_t> chars;
  for (char32_t cp = 0; cp <= kMaxCodePoint; ++cp) {
    if (seen[cp]) chars.push_back(cp);
  }
  return from_chars(std::move(chars));
}

Tokenizer Tokenizer::load(const fs::path& dataset_dir) {
  const fs::path file = dataset_dir / "tokenizer.json";
  // A pipe would block the read until something writes to it: refused, as the other files.
  std::error_code st_error;
  if (const fs::file_status st = fs::status(file, st_error);
      fs::exists(st) && !fs::is_regular_file(st)) {
    bad_file(file, "cannot read: not a regular file");
  }
  std::string text;
  try {
    text = read_file(file);
  } catch (const Error&) {
    std::error_code ec;
    const bool exists = fs::exists(file, ec);
    bad_file(file, exists ? "cannot read"
                   : ec   ? "cannot read: " + ec.message()
                          : std::string("missing"));
  }
  nlohmann::json j;
  try {
    j = parse_json(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(ErrorKind::recipe, json_parse_problem(file.string(), text, e));
  }
  if (!j.is_object()) bad_file(file, "not a JSON object");
  if (!j.contains("type") || !j["type"].is_string()) bad_file(file, "no \"type\" string");
  const std::string type = j["type"].get<std::string>();
  if (type == "byte") return byte();
  if (type != "char") {
    bad_file(file, fmt::format("unknown tokenizer type \"{}\" (expected byte or char)", type));
  }
  if (!j.contains("chars") || !j["chars"].is_array() || j["chars"].empty()) {
    bad_file(file, "\"chars\" must be a non-empty array of code points");
  }
  std::vector<char32_t> chars;
  for (const auto& value : j["chars"]) {
    if (!value.is_number_unsigned() || value.get<uint64_t>() > kMaxCodePoint ||
        (value.get<uint64_t>() >= 0xd800 && value.get<uint64_t>() <= 0xdfff)) {
      bad_file(file, fmt::format("\"chars\": {} is not a Unicode code point",
                                 printable_excerpt(json_text(value), 40)));
    }
    chars.push_back(static_cast<char32_t>(value.get<uint64_t>()));
  }
  std::vector<char32_t> sorted = chars;
  std::sort(sorted.begin(), sorted.end());
  const auto repeated = std::adjacent_find(sorted.begin(), sorted.end());
  if (repeated != sorted.end()) {
    bad_file(file, fmt::format("\"chars\": {} appears twice", code_point_name(*repeated)));
  }
  return from_chars(std::move(chars));
}

namespace {

// What tokenizer.json holds for `tokenizer`, as save writes it.
std::string tokenizer_text(const Tokenizer& tokenizer) {
  nlohmann::json j = {{"type", tokenizer.type()}};
  if (tokenizer.type() == "char") {
    nlohmann::json chars = nlohmann::json::array();
    for (char32_t cp : tokenizer.chars())
      chars.push_back(static_cast<uint32_t>(cp));
    j["chars"] = std::move(chars);
  }
  return j.dump() + "\n";
}

}  // namespace

void Tokenizer::save(const fs::path& dataset_dir) const {
  write_file_atomic(dataset_dir / "tokenizer.json", tokenizer_text(*this));
}

std::string Tokenizer::checksum() const {
  const std::string text = tokenizer_text(*this);
  return checksum_hex(checksum64(text.data(), text.size()));
}

int64_t Tokenizer::vocab() const {
  return char_mode_ ? static_cast<int64_t>(chars_.size()) : 256;
}

int32_t Tokenizer::id_of(char32_t cp) const {
  if (cp < low_ids_.size()) return low_ids_[cp];
  const auto at = std::lower_bound(sorted_.begin(), sorted_.end(), cp);
  if (at == sorted_.end() || *at != cp) return -1;
  return sorted_ids_[static_cast<size_t>(at - sorted_.begin())];
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, const WorkProgress& progress) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size());
  if (!char_mode_) {
    for (size_t i = 0; i < text.size(); ++i) {
      if (progress && i % kWorkProgressEvery == 0) progress(i);
      ids.push_back(static_cast<unsigned char>(text[i]));
    }
    return ids;
  }
  for (size_t i = 0, next_report = 0; i < text.size();) {
    if (progress && i >= next_report) {
      progress(i);
      next_report = i + kWorkProgressEvery;
    }
    const size_t offset = i;
    const char32_t cp = next_code_point(text, i);
    const int32_t id = id_of(cp);
    if (id < 0) {
      throw Error(ErrorKind::usage,
                  fmt::format("character {} at byte offset {} is not in the tokenizer's "
                              "vocabulary of {} characters",
                              describe_char(cp), offset, chars_.size()));
    }
    ids.push_back(id);
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids) const {
  std::string text;
  text.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const int32_t id = ids[i];
    if (id < 0 || id >= vocab()) {
      throw Error(ErrorKind::usage, fmt::format("token {} at index {} is outside the {} "
                                                "tokenizer's vocabulary [0, {})",
                                                id, i, type(), vocab()));
    }
    if (char_mode_) {
      append_utf8(text, chars_[static_cast<size_t>(id)]);
    } else {
      text.push_back(static_cast<char>(static_cast<unsigned char>(id)));
    }
  }
  return text;
}

// ---- windows ----

int64_t token_window_count(int64_t n, int64_t context, int64_t stride) {
  if (n < context + 1) return 0;
  return (n - context - 1) / stride + 1;
}

TokenWindows::TokenWindows(std::shared_ptr<const MappedTokens> tokens, int64_t context,
                           int64_t stride)
    : tokens_(std::move(tokens)),
      vocab_(tokens_->vocab()),
      context_(context),
      stride_(stride),
      size_(0) {
  if (context_ < 1 || stride_ < 1) {
    throw Error(
        ErrorKind::internal,
        fmt::format("token windows: context {} and stride {} must be >= 1", context_, stride_));
  }
  size_ = token_window_count(tokens_->size(), context_, stride_);
}

void TokenWindows::gather(std::span<const int64_t> indices, float* /*x*/, int32_t* y) const {
  const auto window = static_cast<size_t>(context_ + 1);
  for (size_t i = 0; i < indices.size(); ++i) {
    const int64_t index = indices[i];
    if (index < 0 || index >= size_) {
      throw Error(ErrorKind::internal,
                  fmt::format("token windows gather: index {} outside [0, {})", index, size_));
    }
    tokens_->copy(index * stride_, context_ + 1, y + i * window);
  }
}

// ---- datasets ----

namespace {

struct TokenDatasetFiles {
  fs::path train, val;
};

TokenDatasetFiles dataset_files(const DataSpec& data) {
  if (data.path.empty()) {
    throw Error(ErrorKind::recipe, "/data/path: required for \"tokens\" data");
  }
  const fs::path dir = data.path;
  std::error_code ec;
  // A path that cannot be looked at (a directory on the way without search permission) says so,
  // not that it is missing.
  if (!fs::is_directory(dir, ec)) {
    if (ec && ec != std::errc::no_such_file_or_directory) {
      throw Error(ErrorKind::recipe,
                  fmt::format("/data/path: {}: cannot read: {}", dir.string(), ec.message()));
    }
    throw Error(
        ErrorKind::recipe,
        fmt::format("/data/path: {}: {} (make a dataset with 'dptrain data prepare')", dir.string(),
                    fs::exists(dir, ec) ? "not a directory" : "no such directory"));
  }
  TokenDatasetFiles files{dir / "train.bin", dir / "val.bin"};
  for (const fs::path& file : {files.train, files.val}) {
    if (!fs::exists(file, ec)) {
      if (ec) {
        throw Error(ErrorKind::recipe,
                    fmt::format("/data/path: {}: cannot read: {}", file.string(), ec.message()));
      }
      throw Error(ErrorKind::recipe,
                  fmt::format("/data/path: {}: missing (is {} a dataset that 'dptrain data "
                              "prepare' wrote?)",
                              file.string(), dir.string()));
    }
  }
  return files;
}

// A file's problems, named as the data of /data/path.
template <class Read>
auto read_as_data(const fs::path& file, Read read) {
  try {
    return read(file);
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::recipe) throw;
    throw Error(ErrorKind::recipe, fmt::format("/data/path: {}", e.what()));
  }
}

// What a model needs of the two files: one vocabulary that fits it, and whole windows.
void check_against_model(const TokenDatasetFiles& files, const TokenFileHeader& train,
                         const TokenFileHeader& val, const ModelSpec& model) {
  if (model.context < 1) {
    throw Error(ErrorKind::recipe,
                fmt::format("/model/context: must be at least 1, got {}", model.context));
  }
  if (val.vocab != train.vocab) {
    throw Error(ErrorKind::recipe,
                fmt::format("/data/path: {} has a vocabulary of {} but {} has {}: not one dataset",
                            files.val.string(), val.vocab, files.train.string(), train.vocab));
  }
  if (train.vocab > model.vocab) {
    throw Error(ErrorKind::recipe,
                fmt::format("/model/vocab: {} is smaller than the vocabulary of {} ({})",
                            model.vocab, files.train.string(), train.vocab));
  }
  const int64_t window = model.context + 1;
  if (train.count < window) {
    throw Error(ErrorKind::recipe,
                fmt::format("/data/path: {} has {} tokens, fewer than one window of /model/context "
                            "+ 1 = {}",
                            files.train.string(), train.count, window));
  }
  if (val.count > 0 && val.count < window) {
    throw Error(ErrorKind::recipe,
                fmt::format("/data/path: {} has {} tokens, fewer than one window of /model/context "
                            "+ 1 = {} (prepare more validation text, or --val-fraction 0 for none)",
                            files.val.string(), val.count, window));
  }
}

std::string token_fingerprint(const TokenFileHeader& train, const TokenFileHeader& val) {
  return fmt::format("train.bin {} val.bin {}", checksum_hex(train.checksum),
                     checksum_hex(val.checksum));
}

}  // namespace

namespace {

struct CheckedHeaders {
  TokenDatasetFiles files;
  TokenFileHeader train, val;
};

// The dataset's two headers, checked against the model: a model that cannot use the data fails
// before any token is read.
CheckedHeaders checked_headers(const DataSpec& data, const ModelSpec& model) {
  CheckedHeaders out{dataset_files(data), {}, {}};
  const auto header = [](const fs::path& f) { return read_token_header(f); };
  out.train = read_as_data(out.files.train, header);
  out.val = read_as_data(out.files.val, header);
  check_against_model(out.files, out.train, out.val, model);
  return out;
}

}  // namespace

void check_token_data(const DataSpec& data, const ModelSpec& model) {
  checked_headers(data, model);
}

DataSplits load_token_data(const DataSpec& data, const ModelSpec& model) {
  const auto [files, train_header, val_header] = checked_headers(data, model);
  const auto map = [](const fs::path& f) { return std::make_shared<const MappedTokens>(f); };
  auto train = read_as_data(files.train, map);
  auto val = read_as_data(files.val, map);
  // The mappings checked the tokens against the headers' checksums and the vocab.
  return {std::make_shared<TokenWindows>(std::move(train), model.context, 1),
          std::make_shared<TokenWindows>(std::move(val), model.context, model.context),
          token_fingerprint(train_header, val_header)};
}

std::string token_data_fingerprint(const DataSpec& data) {
  const TokenDatasetFiles files = dataset_files(data);
  const auto header = [](const fs::path& f) { return read_token_header(f); };
  return token_fingerprint(read_as_data(files.train, header), read_as_data(files.val, header));
}

int64_t token_training_samples(const DataSpec& data, const ModelSpec& model) {
  // Loaded as a rank loads it: a damaged token is found before any rank starts. Once per
  // process for files that have not changed since (a benchmark checks each world size).
  const TokenDatasetFiles files = dataset_files(data);
  const auto stamp = [](const fs::path& f) {
    std::error_code ec;
    const auto size = fs::file_size(f, ec);
    const auto time = fs::last_write_time(f, ec).time_since_epoch().count();
    return fmt::format("{}:{}:{}", f.string(), ec ? 0 : size, ec ? 0 : time);
  };
  const std::string key =
      fmt::format("{} {} {} {}", stamp(files.train), stamp(files.val), model.context, model.vocab);
  static std::mutex mutex;
  static std::map<std::string, int64_t> checked;
  {
    const std::lock_guard<std::mutex> lock(mutex);
    if (const auto found = checked.find(key); found != checked.end()) return found->second;
  }
  const int64_t samples = load_token_data(data, model).train->size();
  const std::lock_guard<std::mutex> lock(mutex);
  checked[key] = samples;
  return samples;
}

namespace {

bool looks_like_dataset(const fs::path& dir) {
  std::error_code ec;
  return fs::exists(dir / "meta.json", ec) || fs::exists(dir / "train.bin", ec);
}

// One line, whatever the paths in it hold (a file name with a newline).
[[noreturn]] void refuse(const std::string& message) {
  throw Error(ErrorKind::usage, printable(message));
}

}  // namespace

void check_dataset_output(const fs::path& out, bool force) {
  std::error_code ec;
  const fs::file_status status = fs::symlink_status(out, ec);
  if (!fs::exists(status)) return;
  if (fs::is_symlink(status)) {
    // The dataset would replace the link, not what it points to: name the real place instead.
    // A dangling link has no canonical form: its own text, as from its directory.
    const bool dangling = !fs::exists(out, ec);
    fs::path target = dangling ? fs::read_symlink(out, ec) : fs::weakly_canonical(out, ec);
    if (!ec && target.is_relative()) target = (out.parent_path() / target).lexically_normal();
    refuse(fmt::format("{}: is a symbolic link{}{}; give the directory itself as --out",
                       out.string(), ec ? "" : " to " + target.string(),
                       dangling ? " (which does not exist)" : ""));
  }
  if (!fs::is_directory(status))
    refuse(fmt::format("{}: exists and is not a directory", out.string()));
  if (fs::is_empty(out, ec)) return;
  if (!force) {
    refuse(fmt::format("{}: exists and is not empty (use --force to replace it)", out.string()));
  }
  if (!looks_like_dataset(out)) {
    refuse(
        fmt::format("{}: not a token dataset (no meta.json or train.bin); --force replaces "
                    "only a dataset",
                    out.string()));
  }
  // A file of the user's there would go with the dataset: a dataset's files are plain files (a
  // directory or a link of one's name is the user's, with whatever it holds).
  static const std::set<std::string> dataset_files = {"meta.json", "train.bin", "val.bin",
                                                      "tokenizer.json"};
  if (const auto other = unclaimed_entry(out, [](const fs::directory_entry& e) {
        std::error_code type_ec;
        return dataset_files.count(e.path().filename().string()) != 0 &&
               e.symlink_status(type_ec).type() == fs::file_type::regular;
      })) {
    const fs::file_status kind = fs::symlink_status(out / *other, ec);
    const std::string what = !dataset_files.count(*other) ? ""
                             : fs::is_directory(kind)     ? " (a directory)"
                             : fs::is_symlink(kind)       ? " (a symbolic link)"
                                                          : " (not a plain file)";
    refuse(
        fmt::format("{}: holds {}{}, which is not part of a token dataset; --force replaces only "
                    "a dataset's own files: move it away first",
                    out.string(), printable_excerpt(*other), what));
  }
}

}  // namespace dptrain
