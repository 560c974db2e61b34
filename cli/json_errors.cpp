// The failure fields every --json output carries when its command fails.
#include "cli/json_errors.hpp"

#include <cstdio>
#include <sstream>

namespace dptrain::cli {

namespace {

bool continuation(const std::string& line) {
  return !line.empty() && line[0] == ' ';
}

}  // namespace

void print_error_lines(const std::string& text) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    std::fprintf(stderr, "%s%s\n", continuation(line) ? "" : "dptrain: error: ", line.c_str());
  }
}

void add_failure(nlohmann::json& out, int exit_code, const std::vector<std::string>& errors) {
  if (!out.contains("status")) out["status"] = "error";
  out["exit_code"] = exit_code;
  if (!out.contains("error")) out["error"] = errors.empty() ? std::string() : errors.front();
  out["errors"] = errors;
}

void add_failure(nlohmann::json& out, int exit_code, const std::string& text) {
  // "error" is the first message with the lines below it (a failed rank's log excerpt).
  if (!out.contains("error")) {
    std::string main;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      if (!main.empty() && !continuation(line)) break;
      main += (main.empty() ? "" : "\n") + line;
    }
    out["error"] = main;
  }
  add_failure(out, exit_code, error_messages(text));
}

const char* failure_status(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::interrupted:
      return "interrupted";
    case ErrorKind::terminated:
      return "terminated";
    default:
      return "error";
  }
}

const char* run_failure_status(ErrorKind kind) {
  return is_stop_kind(kind) ? failure_status(kind) : "failed";
}

void add_success(nlohmann::json& out) {
  if (!out.contains("status")) out["status"] = "ok";
  out["exit_code"] = 0;
  out["errors"] = nlohmann::json::array();
}

}  // namespace dptrain::cli
