// One wording for JSON that nlohmann::json refuses, for every file the project reads, and one way
// to write JSON that never refuses.
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

// nlohmann::json::parse(text) for a file the project reads, refusing nesting deeper than
// kMaxJsonNesting objects and arrays (json::parse_error at the bracket past it, which
// json_parse_problem words as "...: not valid JSON at line L, column C: nested more than 128
// levels deep"): the parser builds any depth, but writing the value (dump) recurses, so a
// damaged or hostile run.json, tokenizer.json or meta.json would end the process on a stack
// overflow instead of an error naming the file. A NUL byte is refused as refuse_nul_byte does.
// `allow_exceptions` false: a discarded value for any problem, as json::parse gives.
constexpr size_t kMaxJsonNesting = 128;
// json::parse_error at the first NUL byte of `text`, if any ("a NUL byte, which JSON text never
// holds (UTF-16 text, or a binary file?)"): nlohmann's parser takes one for the end of the text,
// so "{}\0junk" would pass as {}.
void refuse_nul_byte(std::string_view text);
nlohmann::json parse_json(std::string_view text, bool allow_exceptions = true);

// A JSON library message without its "[json.exception.out_of_range.403] " tag: "key 'host' not
// found".
std::string without_json_tag(const std::string& what);

// `j` as JSON text (`indent` as for dump()), for output, events and the files the project
// writes. A string that is not UTF-8 (a path whose name is in another encoding, bytes given on
// the command line) has each bad byte written as U+FFFD instead of failing: a --json output is
// then still one JSON document, and an error still gets reported.
std::string json_text(const nlohmann::json& j, int indent = -1);

// Whether `text` is UTF-8 (json_text writes it as it is, byte for byte).
bool is_utf8(std::string_view text);

// `j[key]` as a double; NaN when it is absent or not a number (a NaN or an infinity is written as
// null, as a diverged loss is).
double json_number(const nlohmann::json& j, const char* key);

}  // namespace dptrain
