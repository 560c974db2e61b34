// Checksums are stable across runs and machines and see every byte.
#include "core/checksum.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

using namespace dptrain;

TEST_CASE("checksum64: golden values and sensitivity") {
  // Golden values: a change here breaks every existing checkpoint.
  CHECK(checksum_hex(checksum64(nullptr, 0)) == "636aa0165dc44131");
  const std::string text = "dptrain checkpoints carry a checksum per blob";
  CHECK(checksum_hex(checksum64(text.data(), text.size())) == "c1a934b770673a96");
  std::vector<unsigned char> bytes(1000);
  for (size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<unsigned char>(i * 31);
  const uint64_t whole = checksum64(bytes.data(), bytes.size());
  for (size_t i : {size_t{0}, size_t{7}, size_t{31}, size_t{32}, size_t{500}, size_t{999}}) {
    CAPTURE(i);
    auto copy = bytes;
    copy[i] ^= 1;
    CHECK(checksum64(copy.data(), copy.size()) != whole);
  }
  CHECK(checksum64(bytes.data(), 999) != whole);              // length matters
  CHECK(checksum64(bytes.data(), bytes.size(), 1) != whole);  // seed matters
  CHECK(checksum64(bytes.data(), bytes.size()) == whole);     // and it is a function
}

TEST_CASE("Checksum64: the bytes in pieces, however cut, give checksum64 of them all") {
  std::vector<unsigned char> bytes(1000);
  for (size_t i = 0; i < bytes.size(); ++i)
    bytes[i] = static_cast<unsigned char>(i * 7 + 3);
  for (uint64_t seed : {uint64_t{0}, uint64_t{5}}) {
    const uint64_t whole = checksum64(bytes.data(), bytes.size(), seed);
    // Pieces of one size (shorter than a 32-byte block, across blocks, longer than several),
    // and pieces of every length 0, 1, 2, ... in turn.
    for (size_t piece : {size_t{1}, size_t{5}, size_t{31}, size_t{32}, size_t{33}, size_t{100},
                         size_t{999}, size_t{1000}}) {
      CAPTURE(piece);
      Checksum64 sum(seed);
      for (size_t at = 0; at < bytes.size(); at += piece)
        sum.update(bytes.data() + at, std::min(piece, bytes.size() - at));
      CHECK(sum.value() == whole);
    }
    Checksum64 growing(seed);
    size_t at = 0;
    for (size_t n = 0; at < bytes.size(); ++n) {
      const size_t take = std::min(n, bytes.size() - at);
      growing.update(bytes.data() + at, take);
      at += take;
    }
    CHECK(growing.value() == whole);
  }
  CHECK(Checksum64().value() == checksum64(nullptr, 0));
}
