#include "core/suggest.hpp"

#include <doctest/doctest.h>

#include <string>
#include <vector>

using namespace dptrain;

TEST_CASE("closest_match: a typo within two edits, or the start of a longer name") {
  const std::vector<std::string> options = {"--help", "--temperature", "--top-k", "--seed"};
  CHECK(closest_match("--sed", options) == "--seed");
  CHECK(closest_match("--hepl", options) == "--help");
  // "--temp" is two edits from "--help", but it is how "--temperature" starts.
  CHECK(closest_match("--temp", options) == "--temperature");
  CHECK(closest_match("--top", options) == "--top-k");
  CHECK_FALSE(closest_match("--xyzzy", options));
  // Dashes alone, or one letter, start too many names to mean one.
  CHECK(closest_match("--", options) != "--temperature");
  const std::vector<std::string> keys = {"steps", "seed", "batch_per_rank"};
  CHECK(closest_match("batch", keys) == "batch_per_rank");
  CHECK(closest_match("step", keys) == "steps");
  CHECK(closest_match("stpes", keys) == "steps");
  // Regardless of case: "FP16" is fp16, not bf16 (two edits away in its own case); the word
  // comes as it is spelt.
  const std::vector<std::string> dtypes = {"bf16", "fp16", "fp32", "Int8"};
  CHECK(closest_match("FP16", dtypes) == "fp16");
  CHECK(closest_match("FP32", dtypes) == "fp32");
  CHECK(closest_match("int8", dtypes) == "Int8");
  CHECK(closest_match("SUM", std::vector<std::string>{"sum", "max", "min", "avg"}) == "sum");
}
