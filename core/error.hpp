// dptrain::Error: the one exception type library code throws; main maps its kind to an exit code.
#pragma once

#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace dptrain {

enum class ErrorKind {
  internal,     // a bug or an unexpected system failure: exit 1
  usage,        // bad command line: exit 2
  recipe,       // bad recipe or data named by it: exit 2
  io,           // a file or directory could not be read or written: exit 1
  comm,         // store or collective failure, timeout: exit 3
  rank_failed,  // a rank or node failed and restarts are exhausted: exit 3
  ssh,          // SSH or provisioning failure: exit 4
  checkpoint,   // no valid checkpoint, or one could not be written: exit 5
  cuda,         // CUDA or NCCL failure: exit 1
  bench,        // a benchmark fell below its --min-* threshold: exit 6
  interrupted,  // SIGINT: exit 130
  terminated,   // SIGTERM after a final checkpoint: exit 143
};

// What starts the line main prints for an error on stderr ("dptrain: error: MESSAGE"), which
// the launcher and doctor read back from ranks and probes.
inline constexpr std::string_view kErrorLinePrefix = "dptrain: error: ";

// The exit code DESIGN.md and dptrain(1) document for each kind.
int exit_code(ErrorKind kind);
const char* kind_name(ErrorKind kind);
// Whether `kind` is a stop's (SIGINT's interrupted or SIGTERM's terminated), not a failure's.
inline bool is_stop_kind(ErrorKind kind) {
  return kind == ErrorKind::interrupted || kind == ErrorKind::terminated;
}

// `text` with `prefix(line)` before each of its lines (a message's lines placed in a file, under a
// field).
std::string prefix_lines(std::string_view text,
                         const std::function<std::string(std::string_view line)>& prefix);
// The messages in an error's text: its lines, less the indented continuation lines (a log
// excerpt) that belong to the message above them.
std::vector<std::string> error_messages(const std::string& text);
// The first line of a message that holds text (another program's stderr), without the
// whitespace around it; "" when there is none.
std::string first_line(const std::string& text);
// The same, of its last line that holds text (a command's one line after a login shell's
// greeting).
std::string last_line(const std::string& text);
// The lead-in of a log excerpt that ends a failure's first line, "; its last lines (full log:
// LOG):", before the excerpt's indented lines.
std::string log_excerpt_lead(const std::string& log);
// A failure's first line, complete on its own (a restart's cause, an event, a summary): a log
// excerpt's lead-in at its end becomes "; full log: LOG".
std::string error_headline(const std::string& text);
// Untrusted text (a field of a data file) for a one-line message: control characters and NUL
// as \xNN, cut to `max` bytes with "..." after.
std::string printable_excerpt(std::string_view text, size_t max = 60);
// The same, whole: a name from a file (a JSON key, a path) that must not break a message's line.
inline std::string printable(std::string_view text) {
  return printable_excerpt(text, std::string_view::npos);
}

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message) : std::runtime_error(message), kind_(kind) {}
  ErrorKind kind() const { return kind_; }

 private:
  ErrorKind kind_;
};

}  // namespace dptrain
