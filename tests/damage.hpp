// Damaging files on purpose, for the tests of everything that must notice.
#pragma once

#include <filesystem>
#include <fstream>

namespace dptrain::test {

// XORs one byte of `file` at `offset`, in place.
inline void flip_byte(const std::filesystem::path& file, std::streamoff offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.get(c);
  f.seekp(offset);
  f.put(static_cast<char>(c ^ 0x5a));
}

}  // namespace dptrain::test
