// Token datasets for the gpt model: the token file format, tokenizers, and the windows a run
// trains on.
//
// A token dataset is a DIRECTORY that `dptrain data prepare` writes:
//   train.bin, val.bin  token files (below); val.bin may hold no tokens (no evaluation)
//   tokenizer.json      {"type":"byte"} or {"type":"char","chars":[code points in id order]}
//   meta.json           how it was made: sources, counts, dtype, created_at, and the
//                       tokenizer's checksum (Tokenizer::checksum; absent in older datasets)
//
// A token file is a 64-byte little-endian header, then the tokens:
//   offset  size  field
//        0     8  magic "DPTOKENS"
//        8     4  format version, u32 (= 1)
//       12     4  token dtype, u32: bytes per token, 2 (uint16) or 4 (uint32)
//       16     8  vocab, u64: every token is < vocab
//       24     8  token count, u64
//       32     8  checksum64 (core/checksum.hpp) of the token bytes as stored
//       40    24  zero
//       64        count tokens, little-endian, dtype bytes each
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/data/dataset.hpp"
#include "core/recipe.hpp"

namespace dptrain {

inline constexpr char kTokenFileMagic[8] = {'D', 'P', 'T', 'O', 'K', 'E', 'N', 'S'};
inline constexpr uint32_t kTokenFileVersion = 1;
inline constexpr size_t kTokenHeaderBytes = 64;

// Called now and then during long work (about every kWorkProgressEvery units) with how much is
// done: bytes of text, or tokens. It may throw to abandon the work (an interrupted `data
// prepare`), which then leaves nothing half-written behind.
using WorkProgress = std::function<void(uint64_t done)>;
inline constexpr uint64_t kWorkProgressEvery = uint64_t{1} << 22;

struct TokenFile {
  int64_t vocab = 0;
  std::vector<int32_t> tokens;
  int dtype_bytes = 2;
};

// What the header of a token file says, checked against the file's size (not the checksum).
struct TokenFileHeader {
  int64_t vocab = 0;
  int64_t count = 0;
  int dtype_bytes = 2;
  uint64_t checksum = 0;
};

// The largest vocabulary a dtype holds: 65536 for 2 bytes, 2^31 for 4 (ids are int32).
int64_t dtype_capacity(int dtype_bytes);
// "uint16" | "uint32".
std::string dtype_name(int dtype_bytes);

// Error(recipe), one line naming the file and the problem: missing or unreadable, not a dptrain
// token file (bad magic), unknown version or dtype, truncated (expected N bytes, got M).
TokenFileHeader read_token_header(const std::filesystem::path& path);
// A token file's tokens where they lie: the file is mapped read-only, so the ranks of a node
// share one copy in the page cache however large it is, and nothing is converted up front.
// Construction checks what read_token_header does, then the checksum and that every token is
// below the vocab (one pass over the file): a mapping is only ever handed out whole and sound.
// The file must not be rewritten in place while mapped (`data prepare` replaces files by rename,
// which leaves a mapped one as it was).
class MappedTokens {
 public:
  explicit MappedTokens(const std::filesystem::path& path);
  ~MappedTokens();
  MappedTokens(const MappedTokens&) = delete;
  MappedTokens& operator=(const MappedTokens&) = delete;

  const TokenFileHeader& header() const { return header_; }
  int64_t size() const { return header_.count; }
  int64_t vocab() const { return header_.vocab; }
  // Tokens [start, start + n) as ids; Error(internal) for a range outside the file.
  void copy(int64_t start, int64_t n, int32_t* out) const;

 private:
  std::filesystem::path path_;
  TokenFileHeader header_;
  void* map_ = nullptr;
  size_t map_bytes_ = 0;
};

// MappedTokens' checks, then every token in memory (for tools and tests; a run maps them).
TokenFile read_token_file(const std::filesystem::path& path);
// Atomic and fsynced (temporary name, rename, directory fsync). Error(usage) when vocab does not
// fit the dtype; Error(internal) for a token outside [0, vocab) or a dtype other than 2 or 4.
// `progress` counts the tokens converted, before the file is written.
void write_token_file(const std::filesystem::path& path, int64_t vocab,
                      std::span<const int32_t> tokens, int dtype_bytes,
                      const WorkProgress& progress = {});

// UTF-8 -> code points. Error(usage) "invalid UTF-8 at byte offset N (...)": stray or missing
// continuation bytes, overlong forms, surrogates, values above U+10FFFF.
std::vector<char32_t> decode_utf8(std::string_view text);
void append_utf8(std::string& out, char32_t code_point);

// Text <-> token ids. "byte": each byte is its own id (vocab 256). "char": one id per Unicode
// code point of a fixed list.
class Tokenizer {
 public:
  static Tokenizer byte();
  // The distinct code points of text, ids in ascending code-point order. `progress` counts bytes.
  static Tokenizer chars_of(std::string_view text, const WorkProgress& progress = {});
  // DIR/tokenizer.json; Error(recipe) naming the file when it is missing or malformed.
  static Tokenizer load(const std::filesystem::path& dataset_dir);
  // Writes DIR/tokenizer.json (atomic).
  void save(const std::filesystem::path& dataset_dir) const;
  // checksum_hex of its canonical tokenizer.json (what save writes): the same for the same ids
  // however the file is laid out. meta.json's "tokenizer_checksum" records it, so that a
  // tokenizer.json of another dataset with as many ids is told from the dataset's own.
  std::string checksum() const;

  int64_t vocab() const;
  std::string type() const { return char_mode_ ? "char" : "byte"; }
  // The code point of each id ("char"; empty for "byte").
  const std::vector<char32_t>& chars() const { return chars_; }

  // Error(usage) naming a character that has no id (char), or invalid UTF-8 (char). `progress`
  // counts bytes.
  std::vector<int32_t> encode(std::string_view text, const WorkProgress& progress = {}) const;
  // Error(usage) for an id outside [0, vocab).
  std::string decode(std::span<const int32_t> ids) const;

 private:
  Tokenizer() = default;
  static Tokenizer from_chars(std::vector<char32_t> chars);
  int32_t id_of(char32_t code_point) const;  // -1 when absent

  bool char_mode_ = false;
  std::vector<char32_t> chars_;      // id -> code point
  std::vector<int32_t> low_ids_;     // code point -> id for code points below its size, else -1
  std::vector<char32_t> sorted_;     // the code points in ascending order ...
  std::vector<int32_t> sorted_ids_;  // ... and their ids, for the rest
};

// Samples of a token stream: window i is the context + 1 tokens starting at i * stride (inputs
// are its first context tokens, next-token targets its last context). Windows that would run
// past the end are not samples. gather() writes each window to y, row after row; x is unused.
class TokenWindows final : public Dataset {
 public:
  TokenWindows(std::shared_ptr<const MappedTokens> tokens, int64_t context, int64_t stride);

  int64_t size() const override { return size_; }
  int64_t features() const override { return 0; }
  int64_t classes() const override { return vocab_; }
  int64_t labels_per_sample() const override { return context_ + 1; }
  void gather(std::span<const int64_t> indices, float* x, int32_t* y) const override;

  int64_t context() const { return context_; }
  int64_t stride() const { return stride_; }

 private:
  std::shared_ptr<const MappedTokens> tokens_;
  int64_t vocab_, context_, stride_, size_;
};

// How many windows of context + 1 tokens start at multiples of stride in n tokens.
int64_t token_window_count(int64_t n, int64_t context, int64_t stride);

// DIR/train.bin: every window start 0 .. n - context - 1 (n - context samples); DIR/val.bin:
// non-overlapping windows at i * context (floor((n_val - 1) / context) samples; none when val.bin
// is empty). classes() is the dataset's vocabulary. Error(recipe), naming /data/path or
// /model/vocab and the file: a missing directory or file, a damaged file, a vocabulary larger
// than model.vocab, train.bin (or a non-empty val.bin) shorter than one window.
DataSplits load_token_data(const DataSpec& data, const ModelSpec& model);
// What load_token_data checks before it reads a token: the two files there, their headers, and
// the model against them (vocabulary, whole windows). Error(recipe) "POINTER: ..." as it.
void check_token_data(const DataSpec& data, const ModelSpec& model);
// The dataset's DataSplits::fingerprint, from the files' headers (their recorded checksums).
std::string token_data_fingerprint(const DataSpec& data);
// The size of the training split, with every check load_token_data makes (the checksums too:
// one read of the files, which leaves them in the page cache for the ranks that map them). Kept
// for the process while the files' sizes and modification times stay the same.
int64_t token_training_samples(const DataSpec& data, const ModelSpec& model);

// Before `data prepare` reads any text: OUT must be new, empty, or (with `force`) a dataset to
// replace, holding only a dataset's files. Error(usage) saying why not, with what to do.
void check_dataset_output(const std::filesystem::path& out, bool force);

}  // namespace dptrain
