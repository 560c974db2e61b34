// One wording for JSON that nlohmann::json refuses, for every file the project reads.
#pragma once

#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

namespace dptrain {

// One line saying why `text`, read from `file`, did not parse, without nlohmann's
// "[json.exception.parse_error.101] parse error at ..." internals:
//   "FILE: not valid JSON at line L, column C: PROBLEM"  a syntax error (L and C 1-based)
//   "FILE: not valid JSON: PROBLEM"                      well-formed but refused (1e400)
//   "FILE: empty file, not valid JSON"                   nothing at all
std::string json_parse_problem(const std::string& file, std::string_view text,
                               const nlohmann::json::exception& e);

}  // namespace dptrain
