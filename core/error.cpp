// Exit codes and names for dptrain::Error kinds.
#include "core/error.hpp"

#include <sstream>
#include <string_view>

#include <fmt/format.h>

namespace dptrain {

int exit_code(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::usage:
    case ErrorKind::recipe:
      return 2;
    case ErrorKind::comm:
    case ErrorKind::rank_failed:
      return 3;
    case ErrorKind::ssh:
      return 4;
    case ErrorKind::checkpoint:
      return 5;
    case ErrorKind::bench:
      return 6;
    case ErrorKind::interrupted:
      return 130;
    case ErrorKind::terminated:
      return 143;
    case ErrorKind::internal:
    case ErrorKind::io:
    case ErrorKind::cuda:
      break;
  }
  return 1;
}

const char* kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::internal:
      return "internal error";
    case ErrorKind::usage:
      return "usage error";
    case ErrorKind::recipe:
      return "recipe error";
    case ErrorKind::io:
      return "i/o error";
    case ErrorKind::comm:
      return "communication error";
    case ErrorKind::rank_failed:
      return "rank failed";
    case ErrorKind::ssh:
      return "ssh error";
    case ErrorKind::checkpoint:
      return "checkpoint error";
    case ErrorKind::cuda:
      return "cuda error";
    case ErrorKind::bench:
      return "benchmark below threshold";
    case ErrorKind::interrupted:
      return "interrupted";
    case ErrorKind::terminated:
      return "terminated";
  }
  return "error";
}

std::vector<std::string> error_messages(const std::string& text) {
  std::vector<std::string> messages;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.empty() || line[0] != ' ') messages.push_back(line);
  }
  return messages;
}

namespace {

// Its lines that hold text, without the whitespace around them.
std::vector<std::string> text_lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const auto begin = line.find_first_not_of(" \t\r");
    if (begin == std::string::npos) continue;
    out.push_back(line.substr(begin, line.find_last_not_of(" \t\r") - begin + 1));
  }
  return out;
}

}  // namespace

std::string prefix_lines(std::string_view text,
                         const std::function<std::string(std::string_view line)>& prefix) {
  std::string out;
  size_t start = 0;
  for (;;) {
    const size_t end = text.find('\n', start);
    const std::string_view line =
        text.substr(start, end == std::string_view::npos ? end : end - start);
    out += prefix(line);
    out += line;
    if (end == std::string_view::npos) return out;
    out += '\n';
    start = end + 1;
  }
}

std::string first_line(const std::string& text) {
  const auto lines = text_lines(text);
  return lines.empty() ? "" : lines.front();
}

std::string last_line(const std::string& text) {
  const auto lines = text_lines(text);
  return lines.empty() ? "" : lines.back();
}

namespace {
constexpr std::string_view kExcerptLead = "; its last lines (full log: ";
constexpr std::string_view kExcerptLeadEnd = "):";
}  // namespace

std::string log_excerpt_lead(const std::string& log) {
  return fmt::format("{}{}{}", kExcerptLead, log, kExcerptLeadEnd);
}

std::string error_headline(const std::string& text) {
  std::string line = first_line(text);
  const size_t lead = line.rfind(kExcerptLead);
  if (lead != std::string::npos && line.ends_with(kExcerptLeadEnd)) {
    const size_t log = lead + kExcerptLead.size();
    line = fmt::format("{}; full log: {}", line.substr(0, lead),
                       line.substr(log, line.size() - kExcerptLeadEnd.size() - log));
  }
  return line;
}

std::string printable_excerpt(std::string_view text, size_t max) {
  std::string out;
  for (const char c : text.substr(0, max)) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x20 || byte == 0x7f) {
      static constexpr char kHex[] = "0123456789abcdef";
      out += {'\\', 'x', kHex[byte >> 4], kHex[byte & 15]};
    } else {
      out += c;
    }
  }
  if (text.size() > max) out += "...";
  return out;
}

}  // namespace dptrain
