// Helpers for error messages: first_line, error_headline, printable_excerpt, error_messages.
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

TEST_CASE("error_headline: a failure's first line stands alone, naming the full log") {
  const std::string failure = "rank 1 (pid 5) was killed by signal 9 (SIGKILL)" +
                              log_excerpt_lead("/runs/a/logs/localhost-rank1.log") +
                              "\n  step 10/60  loss 1.2\n  step 20/60  loss 0.9";
  CHECK(
      failure.starts_with("rank 1 (pid 5) was killed by signal 9 (SIGKILL); its last lines "
                          "(full log: /runs/a/logs/localhost-rank1.log):\n  step 10"));
  CHECK(error_headline(failure) ==
        "rank 1 (pid 5) was killed by signal 9 (SIGKILL); full log: "
        "/runs/a/logs/localhost-rank1.log");
  CHECK(error_headline("stopped by SIGINT (a resume continues from step-000020):") ==
        "stopped by SIGINT (a resume continues from step-000020):");
  CHECK(error_headline("one line\n  (not restarted: why)") == "one line");
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
