// String helpers the tests share.
#pragma once

#include <cstddef>
#include <string>

namespace dptrain::test {

// How many times `what` occurs in `text`, overlapping occurrences included.
inline size_t count_occurrences(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t pos = text.find(what); pos != std::string::npos; pos = text.find(what, pos + 1))
    ++n;
  return n;
}

}  // namespace dptrain::test
