// One wording for JSON that nlohmann::json refuses, for every file the project reads.
#include "core/json_error.hpp"

#include <algorithm>
#include <limits>
#include <utility>

#include <fmt/format.h>

namespace dptrain {

std::string without_json_tag(const std::string& what) {
  if (const size_t tag = what.find("] ");
      what.rfind("[json.exception.", 0) == 0 && tag != std::string::npos) {
    return what.substr(tag + 2);
  }
  return what;
}

namespace {

// nlohmann reports the 1-based byte position of the offending character; people want line:column.
std::pair<size_t, size_t> line_and_column(std::string_view text, size_t byte) {
  const size_t offset = std::min(byte == 0 ? 0 : byte - 1, text.size());
  size_t line = 1;
  size_t line_start = 0;
  for (size_t i = 0; i < offset; ++i) {
    if (text[i] == '\n') {
      ++line;
      line_start = i + 1;
    }
  }
  return {line, offset - line_start + 1};
}

// The explanation in nlohmann's message, less its tag and the "parse error at line L, column
// C: " that json_parse_problem words itself.
std::string explanation(const std::string& what) {
  std::string rest = without_json_tag(what);
  if (rest.rfind("parse error", 0) == 0) {
    if (const size_t colon = rest.find(": "); colon != std::string::npos) rest.erase(0, colon + 2);
  }
  return rest;
}

// nlohmann gives no position for a number too large for a double ("number overflow parsing
// '1e400'", out_of_range 406): the 1-based byte where that number first stands in the text as
// a token of its own, or 0.
size_t overflow_byte(std::string_view text, const std::string& what) {
  const size_t open = what.find("parsing '");
  const size_t close = open == std::string::npos ? open : what.find('\'', open + 9);
  if (close == std::string::npos) return 0;
  const std::string token = what.substr(open + 9, close - open - 9);
  if (token.empty()) return 0;
  constexpr std::string_view kBefore = " \t\r\n:,[";
  constexpr std::string_view kAfter = " \t\r\n,]}";
  for (size_t at = text.find(token); at != std::string_view::npos; at = text.find(token, at + 1)) {
    const size_t end = at + token.size();
    if ((at == 0 || kBefore.find(text[at - 1]) != std::string_view::npos) &&
        (end == text.size() || kAfter.find(text[end]) != std::string_view::npos)) {
      return at + 1;
    }
  }
  return 0;
}

}  // namespace

std::string json_parse_problem(const std::string& file, std::string_view text,
                               const nlohmann::json::exception& e) {
  if (text.empty()) return fmt::format("{}: empty file, not valid JSON", file);
  const std::string problem = explanation(e.what());
  const auto* parse = dynamic_cast<const nlohmann::json::parse_error*>(&e);
  const size_t byte = parse != nullptr ? parse->byte
                      : dynamic_cast<const nlohmann::json::out_of_range*>(&e) != nullptr
                          ? overflow_byte(text, problem)
                          : 0;
  if (byte > 0) {
    const auto [line, column] = line_and_column(text, byte);
    return fmt::format("{}: not valid JSON at line {}, column {}: {}", file, line, column, problem);
  }
  return fmt::format("{}: not valid JSON: {}", file, problem);
}

void refuse_nul_byte(std::string_view text) {
  if (const size_t at = text.find('\0'); at != std::string_view::npos) {
    throw nlohmann::json::parse_error::create(
        101, at + 1, "a NUL byte, which JSON text never holds (UTF-16 text, or a binary file?)",
        static_cast<const nlohmann::json*>(nullptr));
  }
}

nlohmann::json parse_json(std::string_view text, bool allow_exceptions) {
  size_t depth = 0;
  bool in_string = false;
  if (text.find('\0') != std::string_view::npos) {
    if (!allow_exceptions) return nlohmann::json(nlohmann::json::value_t::discarded);
    refuse_nul_byte(text);
  }
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (c == '\\') {
        ++i;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > kMaxJsonNesting) {
        if (!allow_exceptions) return nlohmann::json(nlohmann::json::value_t::discarded);
        throw nlohmann::json::parse_error::create(
            101, i + 1, fmt::format("nested more than {} levels deep", kMaxJsonNesting),
            static_cast<const nlohmann::json*>(nullptr));
      }
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return nlohmann::json::parse(text, nullptr, allow_exceptions);
}

std::string json_text(const nlohmann::json& j, int indent) {
  return j.dump(indent, ' ', false, nlohmann::json::error_handler_t::replace);
}

bool is_utf8(std::string_view text) {
  // The strict dump refuses exactly what json_text would replace.
  try {
    (void)nlohmann::json(std::string(text)).dump();
    return true;
  } catch (const nlohmann::json::type_error&) {
    return false;
  }
}

double json_number(const nlohmann::json& j, const char* key) {
  if (!j.is_object()) return std::numeric_limits<double>::quiet_NaN();
  const auto it = j.find(key);
  if (it == j.end() || !it->is_number()) return std::numeric_limits<double>::quiet_NaN();
  return it->get<double>();
}

}  // namespace dptrain
