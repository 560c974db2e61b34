// Tests of the token file format, the tokenizers, token windows and token datasets, on real files.
#include "core/data/tokens.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <numeric>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/checksum.hpp"
#include "core/error.hpp"
#include "tests/temp_dir.hpp"
#include "tests/text_corpus.hpp"

namespace dptrain {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

std::string bytes_of(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void overwrite(const fs::path& path, size_t offset, const std::string& bytes) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

uint64_t le_at(const std::string& raw, size_t offset, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i)
    v |= uint64_t(static_cast<unsigned char>(raw[offset + size_t(i)])) << (8 * i);
  return v;
}

// The message of the Error(recipe) reading `path` throws, without the path prefix it must have.
std::string read_error(const fs::path& path) {
  try {
    read_token_file(path);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::recipe);
    const std::string message = e.what();
    REQUIRE(message.starts_with(path.string() + ": "));
    CHECK(message.find('\n') == std::string::npos);
    return message.substr(path.string().size() + 2);
  }
  return "no error";
}

std::vector<int32_t> iota_mod(size_t n, int32_t mod) {
  std::vector<int32_t> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = static_cast<int32_t>((i * 7919) % static_cast<size_t>(mod));
  return v;
}

// A dataset directory as `dptrain data prepare` writes it (the parts a run reads).
fs::path make_dataset(const TempDir& tmp, const std::vector<int32_t>& train,
                      const std::vector<int32_t>& val, int64_t vocab = 256) {
  const fs::path dir = tmp / "ds";
  fs::create_directories(dir);
  write_token_file(dir / "train.bin", vocab, train, 2);
  write_token_file(dir / "val.bin", vocab, val, 2);
  Tokenizer::byte().save(dir);
  return dir;
}

DataSpec tokens_at(const fs::path& dir) {
  DataSpec data;
  data.type = "tokens";
  data.path = dir.string();
  return data;
}

ModelSpec gpt(int64_t vocab, int64_t context) {
  ModelSpec model;
  model.type = "gpt";
  model.vocab = vocab;
  model.context = context;
  return model;
}

std::vector<int32_t> gather_all(const Dataset& d) {
  std::vector<int64_t> idx(static_cast<size_t>(d.size()));
  std::iota(idx.begin(), idx.end(), int64_t{0});
  std::vector<int32_t> y(idx.size() * static_cast<size_t>(d.labels_per_sample()));
  d.gather(idx, nullptr, y.data());
  return y;
}

}  // namespace

TEST_CASE("token files round-trip in uint16 and uint32 with the documented header") {
  TempDir tmp;
  for (const int dtype : {2, 4}) {
    CAPTURE(dtype);
    const int64_t vocab = dtype == 2 ? 65536 : 100003;
    const auto tokens = iota_mod(1001, static_cast<int32_t>(vocab));
    const fs::path file = tmp / ("t" + std::to_string(dtype) + ".bin");
    write_token_file(file, vocab, tokens, dtype);

    const TokenFile back = read_token_file(file);
    CHECK(back.vocab == vocab);
    CHECK(back.dtype_bytes == dtype);
    CHECK(back.tokens == tokens);

    const std::string raw = bytes_of(file);
    REQUIRE(raw.size() == 64 + tokens.size() * size_t(dtype));
    CHECK(raw.substr(0, 8) == "DPTOKENS");
    CHECK(le_at(raw, 8, 4) == 1);
    CHECK(le_at(raw, 12, 4) == uint64_t(dtype));
    CHECK(le_at(raw, 16, 8) == uint64_t(vocab));
    CHECK(le_at(raw, 24, 8) == tokens.size());
    CHECK(le_at(raw, 32, 8) == checksum64(raw.data() + 64, raw.size() - 64));
    CHECK(raw.substr(40, 24) == std::string(24, '\0'));
    for (size_t i : {size_t{0}, size_t{1}, size_t{500}, size_t{1000}})
      CHECK(le_at(raw, 64 + i * size_t(dtype), dtype) == uint64_t(tokens[i]));

    const TokenFileHeader header = read_token_header(file);
    CHECK(header.count == 1001);
    CHECK(header.vocab == vocab);
    CHECK(header.dtype_bytes == dtype);
  }
  const fs::path empty = tmp / "empty.bin";
  write_token_file(empty, 2, {}, 2);
  CHECK(read_token_file(empty).tokens.empty());
  CHECK(fs::file_size(empty) == 64);
  // No temporary left beside the files.
  CHECK(std::distance(fs::directory_iterator(tmp.path()), fs::directory_iterator()) == 3);
}

TEST_CASE("write_token_file refuses a vocabulary its dtype cannot hold and tokens outside it") {
  TempDir tmp;
  const std::vector<int32_t> tokens = {1, 2};
  CHECK_THROWS_WITH_AS(write_token_file(tmp / "a.bin", 65537, tokens, 2),
                       doctest::Contains("a vocabulary of 65537 does not fit uint16"), Error);
  try {
    write_token_file(tmp / "b.bin", 2, tokens, 4);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::internal);
    CHECK(std::string(e.what()).find("token 2 at index 1 is outside [0, 2)") != std::string::npos);
  }
  CHECK_FALSE(fs::exists(tmp / "a.bin"));
  CHECK_FALSE(fs::exists(tmp / "b.bin"));
}

TEST_CASE("each kind of damage to a token file is one recipe error naming the file") {
  TempDir tmp;
  const std::vector<int32_t> tokens = {3, 1, 4, 1, 5, 9, 2, 6};
  const auto fresh = [&](const std::string& name, int dtype = 2) {
    const fs::path f = tmp / name;
    write_token_file(f, 10, tokens, dtype);
    return f;
  };

  CHECK(read_error(tmp / "absent.bin") == "cannot read: No such file or directory");
  fs::create_directories(tmp / "dir.bin");
  CHECK(read_error(tmp / "dir.bin") == "cannot read: not a regular file");

  const fs::path text = tmp / "text.bin";
  std::ofstream(text) << "hello, this is not a token file at all, just text............";
  CHECK(read_error(text) == "not a dptrain token file (bad magic)");
  std::ofstream(tmp / "tiny.bin") << "DP";
  CHECK(read_error(tmp / "tiny.bin") == "not a dptrain token file (bad magic)");

  const fs::path version = fresh("version.bin");
  overwrite(version, 8, std::string("\x02\0\0\0", 4));
  CHECK(read_error(version) == "unknown format version 2 (this dptrain reads version 1)");

  const fs::path dtype = fresh("dtype.bin");
  overwrite(dtype, 12, std::string("\x03\0\0\0", 4));
  CHECK(read_error(dtype) == "unknown token dtype 3 (expected 2 = uint16 or 4 = uint32)");

  const fs::path vocab = fresh("vocab.bin");
  overwrite(vocab, 16, std::string("\x01\0\x01\0\0\0\0\0", 8));  // 65537
  CHECK(read_error(vocab) == "vocab 65537 does not fit its dtype uint16");
  const fs::path no_vocab = fresh("no-vocab.bin");
  overwrite(no_vocab, 16, std::string(8, '\0'));
  CHECK(read_error(no_vocab) == "vocab 0: a vocabulary holds at least 1 token");

  const fs::path reserved = fresh("reserved.bin");
  overwrite(reserved, 50, std::string("\x07", 1));
  CHECK(read_error(reserved) ==
        "header byte 50 is 0x07, where version 1 has zero (bytes 40-63): damaged, or not written "
        "by dptrain");

  const fs::path truncated = fresh("truncated.bin", 4);
  fs::resize_file(truncated, 64 + 4 * 8 - 3);
  CHECK(read_error(truncated) == "truncated: expected 96 bytes, got 93");
  const fs::path header_only = fresh("header.bin");
  fs::resize_file(header_only, 40);
  CHECK(read_error(header_only) == "truncated: expected at least 64 bytes (the header), got 40");

  const fs::path longer = fresh("longer.bin");
  std::ofstream(longer, std::ios::app | std::ios::binary) << "xx";
  CHECK(read_error(longer) ==
        "size mismatch: the header's 8 tokens take 80 bytes, the file has 82");

  // A count whose bytes no file can hold (2^63 + 8 uint16 tokens) is not a size of 0 bytes.
  const fs::path huge = fresh("huge.bin");
  overwrite(huge, 24, std::string("\x08\0\0\0\0\0\0\x80", 8));
  CHECK(read_error(huge) ==
        "the header's token count 9223372036854775816 is impossible (no file holds more than "
        "9223372036854775775 uint16 tokens)");

  const fs::path flipped = fresh("flipped.bin");
  overwrite(flipped, 64 + 2, std::string("\x05", 1));  // token 4 -> 5: still in the vocab
  const std::string mismatch = read_error(flipped);
  CHECK(mismatch.starts_with("checksum mismatch (the header says "));
  // The header alone still reads: only the tokens are damaged.
  CHECK(read_token_header(flipped).count == 8);

  // A header whose vocab was lowered under the tokens: the checksum still matches.
  const fs::path lowered = fresh("lowered.bin");
  overwrite(lowered, 16, std::string("\x05\0\0\0\0\0\0\0", 8));
  CHECK(read_error(lowered) == "token 5 at index 4 is not below the vocab 5");

  // Tokens are checked a block of 65536 at a time: one past the first block is found and named.
  for (const int width : {2, 4}) {
    std::vector<int32_t> many(70000, 3);
    many[69001] = 9;
    const fs::path file = tmp / fmt::format("many{}.bin", width);
    write_token_file(file, 10, many, width);
    CHECK(read_token_file(file).tokens == many);
    overwrite(file, 16, std::string("\x09\0\0\0\0\0\0\0", 8));
    CHECK(read_error(file) == "token 9 at index 69001 is not below the vocab 9");
  }
}

TEST_CASE("byte tokenizer: every byte is its own id, and back") {
  const Tokenizer t = Tokenizer::byte();
  CHECK(t.type() == "byte");
  CHECK(t.vocab() == 256);
  std::string all;
  for (int b = 0; b < 256; ++b)
    all.push_back(static_cast<char>(b));
  all += "h\xc3\xa9llo";
  const auto ids = t.encode(all);
  REQUIRE(ids.size() == all.size());
  for (int b = 0; b < 256; ++b)
    CHECK(ids[size_t(b)] == b);
  CHECK(t.decode(ids) == all);
  const std::vector<int32_t> bad = {1, 256};
  CHECK_THROWS_WITH_AS(t.decode(bad), doctest::Contains("token 256 at index 1"), Error);
}

TEST_CASE("char tokenizer: code points in ascending order, multi-byte UTF-8 round-trips") {
  // a (1 byte), é (2 bytes), € (3 bytes), 𝄞 (4 bytes), newline.
  const std::string text = "ca\xc3\xa9 \xe2\x82\xac\xf0\x9d\x84\x9e\na\xc3\xa9";
  const Tokenizer t = Tokenizer::chars_of(text);
  CHECK(t.type() == "char");
  CHECK(t.vocab() == 7);
  CHECK(t.chars() ==
        std::vector<char32_t>{U'\n', U' ', U'a', U'c', U'\u00e9', U'\u20ac', U'\U0001d11e'});
  const auto ids = t.encode(text);
  CHECK(ids == std::vector<int32_t>{3, 2, 4, 1, 5, 6, 0, 2, 4});
  CHECK(t.decode(ids) == text);

  // A character outside the vocabulary is named, with where it is.
  try {
    t.encode("ab");
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::usage);
    CHECK(std::string(e.what()) ==
          "character 'b' (U+0062) at byte offset 1 is not in the tokenizer's vocabulary of 7 "
          "characters");
  }
  CHECK_THROWS_WITH_AS(t.encode("a\t"), doctest::Contains("character U+0009 at byte offset 1"),
                       Error);
  CHECK_THROWS_WITH_AS(t.decode(std::vector<int32_t>{7}), doctest::Contains("token 7"), Error);

  // Ids stay the code point order whatever order the text shows them in.
  CHECK(Tokenizer::chars_of("zyx").encode("xyz") == std::vector<int32_t>{0, 1, 2});
  CHECK(Tokenizer::chars_of("").vocab() == 0);
}

TEST_CASE("invalid UTF-8 is an error naming the byte offset") {
  const auto offset_error = [](const std::string& text) -> std::string {
    try {
      Tokenizer::chars_of(text);
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::usage);
      return e.what();
    }
    return "no error";
  };
  CHECK(offset_error("ab\xff") ==
        "invalid UTF-8 at byte offset 2 (byte 0xff: not a UTF-8 lead byte)");
  CHECK(offset_error("a\x80") ==
        "invalid UTF-8 at byte offset 1 (byte 0x80: a continuation byte without a lead byte)");
  CHECK(offset_error("abc\xc3") ==
        "invalid UTF-8 at byte offset 3 (byte 0xc3: the sequence is cut short by the end of the "
        "text)");
  CHECK(offset_error("\xe2\x82x") ==
        "invalid UTF-8 at byte offset 0 (byte 0xe2: the sequence is "
        "cut short)");
  // A byte that does not continue it comes before the end of the text: that is what is said.
  CHECK(offset_error("xy\xe9z") ==
        "invalid UTF-8 at byte offset 2 (byte 0xe9: the sequence is cut short)");
  CHECK(offset_error("xy\xe9\x82") ==
        "invalid UTF-8 at byte offset 2 (byte 0xe9: the sequence is cut short by the end of the "
        "text)");
  CHECK(offset_error("\xc0\xaf") ==
        "invalid UTF-8 at byte offset 0 (byte 0xc0: an overlong encoding)");
  CHECK(offset_error("x\xed\xa0\x80") ==
        "invalid UTF-8 at byte offset 1 (byte 0xed: a UTF-16 surrogate)");
  CHECK(offset_error("\xf4\x90\x80\x80") ==
        "invalid UTF-8 at byte offset 0 (byte 0xf4: above U+10FFFF)");
  const Tokenizer t = Tokenizer::chars_of("abc");
  CHECK_THROWS_WITH_AS(t.encode("a\xff"),
                       "invalid UTF-8 at byte offset 1 (byte 0xff: not a UTF-8 lead byte)", Error);

  // Every code point survives the encoder and decoder, at each length boundary.
  std::string all;
  const std::vector<char32_t> edges = {0,      0x7f,   0x80,   0x7ff,   0x800,
                                       0xd7ff, 0xe000, 0xffff, 0x10000, 0x10ffff};
  for (char32_t cp : edges)
    append_utf8(all, cp);
  CHECK(decode_utf8(all) == edges);
}

TEST_CASE("long token work reports its progress, and a callback that throws abandons it") {
  TempDir tmp;
  const std::string text(3 * kWorkProgressEvery + 5, 'a');
  for (const bool chars : {false, true}) {
    CAPTURE(chars);
    std::vector<uint64_t> seen;
    const WorkProgress record = [&seen](uint64_t done) { seen.push_back(done); };
    const Tokenizer t = chars ? Tokenizer::chars_of(text, record) : Tokenizer::byte();
    if (chars) {
      CHECK(seen == std::vector<uint64_t>{0, kWorkProgressEvery, 2 * kWorkProgressEvery,
                                          3 * kWorkProgressEvery});
    }
    seen.clear();
    const auto ids = t.encode(text, record);
    CHECK(ids.size() == text.size());
    CHECK(seen == std::vector<uint64_t>{0, kWorkProgressEvery, 2 * kWorkProgressEvery,
                                        3 * kWorkProgressEvery});
  }

  const std::vector<int32_t> tokens(2 * kWorkProgressEvery + 1, 7);
  std::vector<uint64_t> seen;
  write_token_file(tmp / "ok.bin", 256, tokens, 2,
                   [&seen](uint64_t done) { seen.push_back(done); });
  CHECK(seen == std::vector<uint64_t>{0, kWorkProgressEvery, 2 * kWorkProgressEvery});
  CHECK(read_token_file(tmp / "ok.bin").tokens == tokens);

  // A stop part-way: the error comes through and no file (nor temporary) is left.
  const WorkProgress stop = [](uint64_t done) {
    if (done > 0) throw Error(ErrorKind::interrupted, "stopped");
  };
  CHECK_THROWS_WITH_AS(write_token_file(tmp / "stopped.bin", 256, tokens, 2, stop), "stopped",
                       Error);
  CHECK_THROWS_WITH_AS(Tokenizer::byte().encode(text, stop), "stopped", Error);
  CHECK_THROWS_WITH_AS(Tokenizer::chars_of(text, stop), "stopped", Error);
  CHECK(std::distance(fs::directory_iterator(tmp.path()), fs::directory_iterator()) == 1);
}

TEST_CASE("tokenizers save to and load from tokenizer.json") {
  TempDir tmp;
  Tokenizer::byte().save(tmp.path());
  CHECK(nlohmann::json::parse(bytes_of(tmp / "tokenizer.json")) ==
        nlohmann::json{{"type", "byte"}});
  CHECK(Tokenizer::load(tmp.path()).type() == "byte");

  const std::string text = "h\xc3\xa9llo \xf0\x9f\x99\x82 world";
  const Tokenizer chars = Tokenizer::chars_of(text);
  chars.save(tmp.path());
  const auto j = nlohmann::json::parse(bytes_of(tmp / "tokenizer.json"));
  CHECK(j["type"] == "char");
  CHECK(j["chars"][0] == 32);
  CHECK(j["chars"].back() == 0x1f642);
  const Tokenizer loaded = Tokenizer::load(tmp.path());
  CHECK(loaded.chars() == chars.chars());
  CHECK(loaded.encode(text) == chars.encode(text));
  CHECK(loaded.decode(chars.encode(text)) == text);

  // A hand-written list in any order: ids are its order.
  std::ofstream(tmp / "tokenizer.json") << R"({"type":"char","chars":[98,97]})";
  CHECK(Tokenizer::load(tmp.path()).encode("ab") == std::vector<int32_t>{1, 0});

  const auto load_error = [&](const std::string& contents) -> std::string {
    std::ofstream(tmp / "tokenizer.json") << contents;
    try {
      Tokenizer::load(tmp.path());
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::recipe);
      const std::string prefix = (tmp / "tokenizer.json").string() + ": ";
      REQUIRE(std::string(e.what()).starts_with(prefix));
      return std::string(e.what()).substr(prefix.size());
    }
    return "no error";
  };
  CHECK(load_error("{") ==
        "not valid JSON at line 1, column 2: syntax error while parsing object key - unexpected "
        "end of input; expected string literal");
  // Nesting no tokenizer has (writing it back would overflow the stack): refused at the bracket.
  CHECK(load_error(std::string(200000, '[') + std::string(200000, ']')) ==
        "not valid JSON at line 1, column 129: nested more than 128 levels deep");
  CHECK(load_error("[]") == "not a JSON object");
  // A long wrong element is cut short in the line.
  CHECK(load_error(R"({"type":"char","chars":[")" + std::string(1000, 'x') + R"("]})") ==
        "\"chars\": \"" + std::string(39, 'x') + "... is not a Unicode code point");
  CHECK(load_error(R"({"type":"bpe"})") ==
        "unknown tokenizer type \"bpe\" (expected byte or char)");
  CHECK(load_error(R"({"type":"char"})") == "\"chars\" must be a non-empty array of code points");
  CHECK(load_error(R"({"type":"char","chars":[97,-1]})") ==
        "\"chars\": -1 is not a Unicode code point");
  CHECK(load_error(R"({"type":"char","chars":[55296]})") ==
        "\"chars\": 55296 is not a Unicode code point");
  CHECK(load_error(R"({"type":"char","chars":[97,98,97]})") == "\"chars\": U+0061 appears twice");
  fs::remove(tmp / "tokenizer.json");
  CHECK_THROWS_WITH_AS(Tokenizer::load(tmp.path()), doctest::Contains("tokenizer.json: missing"),
                       Error);
}

TEST_CASE("token windows: sizes for both strides, gathered contents, bad indices") {
  TempDir tmp;
  std::vector<int32_t> values(20);
  std::iota(values.begin(), values.end(), 100);
  // Windows read the mapped files, in both token widths.
  write_token_file(tmp / "u16.bin", 300, values, 2);
  write_token_file(tmp / "u32.bin", 300, values, 4);
  const auto u16 = std::make_shared<const MappedTokens>(tmp / "u16.bin");
  const auto u32 = std::make_shared<const MappedTokens>(tmp / "u32.bin");

  const TokenWindows train(u16, 4, 1);
  CHECK(train.size() == 16);  // n - context
  CHECK(train.features() == 0);
  CHECK(train.classes() == 300);
  CHECK(train.labels_per_sample() == 5);
  const std::vector<int64_t> picks = {15, 0, 7};
  std::vector<int32_t> y(15);
  train.gather(picks, nullptr, y.data());
  CHECK(y == std::vector<int32_t>{115, 116, 117, 118, 119, 100, 101, 102, 103, 104, 107, 108, 109,
                                  110, 111});
  const std::vector<int64_t> past = {16};
  CHECK_THROWS_AS(train.gather(past, nullptr, y.data()), Error);
  const std::vector<int64_t> negative = {-1};
  CHECK_THROWS_AS(train.gather(negative, nullptr, y.data()), Error);

  const TokenWindows eval(u32, 4, 4);
  CHECK(eval.size() == 4);  // floor((20 - 1) / 4)
  const auto windows = gather_all(eval);
  REQUIRE(windows.size() == 20);
  for (size_t w = 0; w < 4; ++w) {
    for (size_t j = 0; j < 5; ++j)
      CHECK(windows[w * 5 + j] == 100 + int32_t(w * 4 + j));  // next window starts at its last
  }

  CHECK(token_window_count(0, 4, 4) == 0);
  CHECK(token_window_count(4, 4, 1) == 0);
  CHECK(token_window_count(5, 4, 1) == 1);
  CHECK(token_window_count(5, 4, 4) == 1);
  CHECK(token_window_count(8, 4, 4) == 1);
  CHECK(token_window_count(9, 4, 4) == 2);
  CHECK(token_window_count(100, 1, 1) == 99);
}

TEST_CASE("load_token_data: train windows at every start, eval windows apart, vocab as classes") {
  TempDir tmp;
  const auto train = iota_mod(1000, 200);
  const auto val = iota_mod(101, 200);
  const fs::path dir = make_dataset(tmp, train, val, 200);

  const DataSplits splits = load_token_data(tokens_at(dir), gpt(256, 32));
  CHECK(splits.train->size() == 1000 - 32);
  CHECK(splits.eval->size() == (101 - 1) / 32);
  CHECK(splits.train->classes() == 200);
  CHECK(splits.eval->classes() == 200);
  CHECK(splits.train->labels_per_sample() == 33);
  CHECK(splits.train->features() == 0);
  std::vector<int32_t> y(33);
  const std::vector<int64_t> last = {1000 - 33};
  splits.train->gather(last, nullptr, y.data());
  CHECK(std::equal(y.begin(), y.end(), train.end() - 33));
  const std::vector<int64_t> second = {1};
  splits.eval->gather(second, nullptr, y.data());
  CHECK(std::equal(y.begin(), y.end(), val.begin() + 32));

  // Through the generic entry points, with the same sizes.
  const DataSplits same = load_data(tokens_at(dir), gpt(256, 32), 123);
  CHECK(same.train->size() == splits.train->size());
  CHECK(gather_all(*same.eval) == gather_all(*splits.eval));
  CHECK(training_samples(tokens_at(dir), gpt(256, 32), 1) == 968);
  CHECK(token_training_samples(tokens_at(dir), gpt(200, 100)) == 900);

  // No validation tokens: no evaluation samples, not an error.
  TempDir tmp2;
  const fs::path no_val = make_dataset(tmp2, train, {});
  CHECK(load_token_data(tokens_at(no_val), gpt(256, 8)).eval->size() == 0);
}

TEST_CASE("load_token_data: a model that cannot use the data, and missing or damaged files") {
  TempDir tmp;
  const fs::path dir = make_dataset(tmp, iota_mod(100, 256), iota_mod(20, 256));
  const std::string train_bin = (dir / "train.bin").string();
  const auto message = [](const DataSpec& data, const ModelSpec& model) -> std::string {
    std::string from_headers;
    try {
      token_training_samples(data, model);
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::recipe);
      from_headers = e.what();
    }
    try {
      load_token_data(data, model);
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::recipe);
      CHECK(std::string(e.what()) == from_headers);  // the same verdict either way
      return e.what();
    }
    return "no error";
  };

  CHECK(message(tokens_at(dir), gpt(200, 8)) ==
        "/model/vocab: 200 is smaller than the vocabulary of " + train_bin + " (256)");
  CHECK(message(tokens_at(dir), gpt(256, 100)) ==
        "/data/path: " + train_bin +
            " has 100 tokens, fewer than one window of /model/context + "
            "1 = 101");
  CHECK(message(tokens_at(dir), gpt(256, 20)) ==
        "/data/path: " + (dir / "val.bin").string() +
            " has 20 tokens, fewer than one window of /model/context + 1 = 21 (prepare more "
            "validation text, or --val-fraction 0 for none)");
  CHECK(message(tokens_at(dir), gpt(256, 19)) == "no error");

  CHECK(message(tokens_at(tmp / "nowhere"), gpt(256, 8)) ==
        "/data/path: " + (tmp / "nowhere").string() +
            ": no such directory (make a dataset with 'dptrain data prepare')");
  CHECK(message(tokens_at(dir / "tokenizer.json"), gpt(256, 8)).find(": not a directory") !=
        std::string::npos);
  CHECK(message(tokens_at(""), gpt(256, 8)) == "/data/path: required for \"tokens\" data");

  write_token_file(dir / "val.bin", 300, iota_mod(20, 300), 2);
  CHECK(message(tokens_at(dir), gpt(512, 8)).find("has a vocabulary of 300 but") !=
        std::string::npos);

  fs::remove(dir / "val.bin");
  CHECK(message(tokens_at(dir), gpt(256, 8)) ==
        "/data/path: " + (dir / "val.bin").string() + ": missing (is " + dir.string() +
            " a dataset that 'dptrain data prepare' wrote?)");

  // Damage only the tokens show: load_token_data reads them, and so does the launch's count
  // (the fingerprint of the headers does not).
  write_token_file(dir / "val.bin", 256, iota_mod(20, 256), 2);
  CHECK(token_training_samples(tokens_at(dir), gpt(256, 8)) == 92);
  const std::string fingerprint = token_data_fingerprint(tokens_at(dir));
  overwrite(dir / "train.bin", 64 + 10, std::string("\x07", 1));
  // A change is known by size and modification time (the count is kept for files that did not
  // change): one within the same clock tick is made visible.
  fs::last_write_time(dir / "train.bin",
                      fs::last_write_time(dir / "train.bin") + std::chrono::seconds(2));
  CHECK(token_data_fingerprint(tokens_at(dir)) == fingerprint);
  CHECK_THROWS_WITH_AS(token_training_samples(tokens_at(dir), gpt(256, 8)),
                       doctest::Contains("train.bin: checksum mismatch"), Error);
  try {
    load_token_data(tokens_at(dir), gpt(256, 8));
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::recipe);
    CHECK(std::string(e.what()).starts_with("/data/path: " + train_bin + ": checksum mismatch"));
  }
  fs::resize_file(dir / "train.bin", 70);
  CHECK(message(tokens_at(dir), gpt(256, 8)) ==
        "/data/path: " + train_bin + ": truncated: expected 264 bytes, got 70");
}

TEST_CASE(
    "synthetic text is deterministic, exact in length, and far more predictable than its "
    "unigram entropy") {
  const std::string a = test::synthetic_text(1, 200000);
  CHECK(a.size() == 200000);
  CHECK(a == test::synthetic_text(1, 200000));
  CHECK(test::synthetic_text(1, 1000) == a.substr(0, 1000));
  CHECK(test::synthetic_text(2, 1000) != a.substr(0, 1000));
  CHECK(a.find("the ") != std::string::npos);
  CHECK(a.find(" .\n") != std::string::npos);
  CHECK(a.find("an apple") != std::string::npos);
  CHECK(a.find("a apple") == std::string::npos);
  CHECK(a.find("the dogs sees") == std::string::npos);  // agreement
  CHECK(a.find("does the dogs") == std::string::npos);

  const double unigram = test::unigram_entropy_bits(a);
  CHECK(unigram > 3.5);
  CHECK(unigram < 4.5);
  CHECK(test::unigram_entropy_bits("aaaa") == 0.0);
  CHECK(test::unigram_entropy_bits("abab") == doctest::Approx(1.0));

  // An order-4 character model counted on the first 90% predicts the rest at well under half
  // the unigram entropy: there is structure for a small model to learn.
  const size_t order = 4, split = a.size() * 9 / 10;
  std::map<std::string, std::map<char, double>> counts;
  for (size_t i = order; i < split; ++i)
    counts[a.substr(i - order, order)][a[i]] += 1.0;
  double bits = 0;
  for (size_t i = split; i < a.size(); ++i) {
    const auto& next = counts[a.substr(i - order, order)];
    double total = 0;
    for (const auto& [c, n] : next)
      total += n;
    const auto it = next.find(a[i]);
    const double hits = it == next.end() ? 0.0 : it->second;
    bits -= std::log2((hits + 0.01) / (total + 0.01 * 256));  // add-0.01 over 256 bytes
  }
  const double conditional = bits / double(a.size() - split);
  MESSAGE("unigram ", unigram, " bits/byte, order-4 held-out ", conditional, " bits/byte");
  CHECK(conditional < 0.5 * unigram);
}

}  // namespace dptrain
