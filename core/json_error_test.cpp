// JSON that does not parse is named in one line: file, line and column, problem; no parser tags.
#include "core/json_error.hpp"

#include <doctest/doctest.h>

#include <string>

using namespace dptrain;

namespace {

// What json_parse_problem says about `text` as the file "f.json".
std::string problem_with(const std::string& text) {
  try {
    [[maybe_unused]] const auto parsed = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return json_parse_problem("f.json", text, e);
  }
  FAIL("parsed: " << text);
  return "";
}

}  // namespace

TEST_CASE("json_parse_problem: a syntax error names the line and column of the offending byte") {
  const std::string message = problem_with("{\n  \"name\": \"x\",\n  \"seed\": ,\n}\n");
  CAPTURE(message);
  CHECK(message.starts_with("f.json: not valid JSON at line 3, column 11: syntax error "));
  CHECK(message.find("unexpected ','") != std::string::npos);
  CHECK(message.find('\n') == std::string::npos);
  for (const char* internal : {"json.exception", "parse error", "parse_error"})
    CHECK(message.find(internal) == std::string::npos);

  // A cut file: the end of the input is where it stops.
  CHECK(problem_with("{\"status\":\n").starts_with("f.json: not valid JSON at line 2, column 1: "));
  CHECK(problem_with("[1, 2").starts_with("f.json: not valid JSON at line 1, column 6: "));
}

TEST_CASE("json_parse_problem: an empty file and well-formed text the parser refuses") {
  CHECK(problem_with("") == "f.json: empty file, not valid JSON");
  // A number beyond a double's range: the parser names no position, so the number's own place
  // is found (as a token, not inside a string or a longer number).
  const std::string overflow = problem_with(R"({"lr": 1e400})");
  CAPTURE(overflow);
  CHECK(overflow == "f.json: not valid JSON at line 1, column 8: number overflow parsing '1e400'");
  CHECK(problem_with("{\"note\": \"11e400\",\n \"lr\": 1e400}")
            .starts_with("f.json: not valid JSON at line 2, column 8: "));
  CHECK(problem_with("{\"a\": [2,\n\n  -1e999]}")
            .starts_with("f.json: not valid JSON at line 3, column 3: "));
}

TEST_CASE("json_text: bytes that are not UTF-8 become U+FFFD; the rest is dump()'s") {
  const nlohmann::json j = {{"path", "runs/caf\xe9/x"}, {"n", 3}, {"ok", "caf\xc3\xa9"}};
  const std::string text = json_text(j);
  CHECK(text == "{\"n\":3,\"ok\":\"caf\xc3\xa9\",\"path\":\"runs/caf\xef\xbf\xbd/x\"}");
  CHECK(nlohmann::json::parse(text)["path"] == "runs/caf\xef\xbf\xbd/x");
  CHECK(json_text({{"a", 1}}, 2) == nlohmann::json({{"a", 1}}).dump(2));
}

TEST_CASE("parse_json refuses nesting past kMaxJsonNesting, naming where; strings do not count") {
  const auto nested = [](size_t depth) {
    return std::string(depth, '[') + std::string(depth, ']');
  };
  CHECK(parse_json(nested(kMaxJsonNesting)).is_array());
  const std::string deep = "{\"a\": " + nested(kMaxJsonNesting) + "}";
  try {
    (void)parse_json(deep);
    FAIL("parsed");
  } catch (const nlohmann::json::exception& e) {
    CHECK(json_parse_problem("run.json", deep, e) == "run.json: not valid JSON at line 1, column " +
                                                         std::to_string(6 + kMaxJsonNesting) +
                                                         ": nested more than 128 levels deep");
  }
  CHECK(parse_json(deep, false).is_discarded());
  // A NUL byte is not the end of the text (UTF-16, a file cut into by binary junk).
  const std::string nul = std::string("{}\0{\"junk", 8);
  try {
    (void)parse_json(nul);
    FAIL("parsed");
  } catch (const nlohmann::json::exception& e) {
    CHECK(json_parse_problem("run.json", nul, e) ==
          "run.json: not valid JSON at line 1, column 3: a NUL byte, which JSON text never holds "
          "(UTF-16 text, or a binary file?)");
  }
  CHECK(parse_json(nul, false).is_discarded());
  CHECK(parse_json("{", false).is_discarded());
  // Brackets in strings, escaped quotes included, are text.
  const std::string in_string = "{\"a\": \"" + nested(500) + "\\\"[[[[\"}";
  CHECK(parse_json(in_string)["a"].get<std::string>().size() == 1005);
  // What it parses is what json::parse gives.
  CHECK(parse_json(R"({"x": [1, {"y": null}]})") ==
        nlohmann::json::parse(R"({"x": [1, {"y": null}]})"));
}
