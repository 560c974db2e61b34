// The failure fields every --json output carries when its command fails (dptrain(1), JSON OUTPUT).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.hpp"

namespace dptrain::cli {

// Prints `text` on stderr: "dptrain: error: " before each message, continuation lines as they are.
void print_error_lines(const std::string& text);

// Adds "exit_code" and "errors" (every message of `text`), and "error" (the first message, with
// the indented lines below it: a failed rank's log excerpt) and "status" ("error") unless `out`
// has them.
void add_failure(nlohmann::json& out, int exit_code, const std::string& text);
void add_failure(nlohmann::json& out, int exit_code, const std::vector<std::string>& errors);

// The "status" of a command stopped by an Error of this kind: "interrupted", "terminated" or
// "error".
const char* failure_status(ErrorKind kind);
// The "status" of a job (a run, a benchmark's) that ended with an Error of this kind:
// "interrupted" or "terminated" for a stop, else "failed".
const char* run_failure_status(ErrorKind kind);

// Adds what every --json object carries on success (dptrain(1), JSON OUTPUT): "exit_code" 0,
// "errors" [], and "status" "ok" unless `out` has one of its own ("completed", "planned", a run's).
void add_success(nlohmann::json& out);

}  // namespace dptrain::cli
