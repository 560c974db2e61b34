// Helpers for error messages: first_line, printable_excerpt, error_messages.
#include "core/error.hpp"

#include <doctest/doctest.h>

#include <string>

using namespace dptrain;

TEST_CASE("first_line: the first line that holds text, trimmed") {
  CHECK(first_line("") == "");
  CHECK(first_line("\n  \n") == "");
  CHECK(first_line("one\ntwo\n") == "one");
  CHECK(first_line("\n  cat: write error: No space left on device\r\nmore") ==
        "cat: write error: No space left on device");
}

TEST_CASE("printable_excerpt: control bytes escaped, long text cut") {
  CHECK(printable_excerpt("plain text") == "plain text");
  CHECK(printable_excerpt(std::string("a\0b", 3)) == "a\\x00b");
  CHECK(printable_excerpt("tab\there\x7f") == "tab\\x09here\\x7f");
  CHECK(printable_excerpt("caf\xc3\xa9") == "caf\xc3\xa9");  // UTF-8 stays as it is
  CHECK(printable_excerpt(std::string(100, 'x'), 10) == std::string(10, 'x') + "...");
}

TEST_CASE("error_messages: lines, less indented continuations") {
  CHECK(error_messages("first\n  excerpt\nsecond\n") ==
        std::vector<std::string>{"first", "second"});
}
