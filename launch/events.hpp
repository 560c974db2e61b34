// The events stream (--events FILE|-): one JSON object per line for every state change of a
// job, for CI pipelines and dashboards. Schema in dptrain-launch(1).
#pragma once

#include <cstdio>
#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

namespace dptrain {

// Whether an --events target is this process's standard output: "-", or a path to the file or
// pipe descriptor 1 is open on (/dev/stdout, /dev/fd/1, the file stdout was redirected to).
// Written through a second opening, its lines and stdout's would overwrite or mix with each
// other. (A terminal or /dev/null is not: nothing is overwritten there.)
bool names_standard_output(const std::string& target);

class EventLog {
 public:
  EventLog() = default;  // disabled: emit() does nothing
  // "-" (or another name of stdout, names_standard_output) is stdout; a file is appended to; a
  // FIFO once it has a reader: waited for, saying so (a stop signal ends the wait), or with
  // `wait_for_reader` false (only the end of a refused command to write) Error(usage) at once.
  // Error(usage) naming it when it cannot be opened.
  explicit EventLog(const std::string& target, bool wait_for_reader = true);
  ~EventLog();
  EventLog(const EventLog&) = delete;
  EventLog& operator=(const EventLog&) = delete;

  bool enabled() const { return out_ != nullptr; }
  bool to_stdout() const { return to_stdout_; }
  // The file it appends to; "" when disabled or on stdout.
  std::string path() const { return enabled() && !to_stdout() ? target_ : std::string(); }
  // Whether a run_finished event was written: every stream ends with one.
  bool finished() const { return finished_; }
  // Writes {"time": ISO-8601 UTC, "event": name, ...fields} and flushes it. A write that fails
  // (a full disk, a reader gone from the pipe) is warned about once on stderr and ends the
  // stream: a reader must not find a torn line followed by more events. The job goes on.
  void emit(const std::string& name, nlohmann::json fields = nlohmann::json::object());
  // That warning (without "dptrain: warning: "), for a --json outcome's "warnings"; "" when no
  // write failed.
  const std::string& write_failure() const { return write_failure_; }

 private:
  std::FILE* out_ = nullptr;
  std::string write_failure_;
  std::string target_;
  bool to_stdout_ = false;  // also once a failed write ended the stream
  bool finished_ = false;
};

}  // namespace dptrain
