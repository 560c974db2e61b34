// Shared ending of launch and resume: print a job's outcome for people or scripts.
#pragma once

#include <CLI/CLI.hpp>

#include <charconv>
#include <exception>
#include <limits>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "launch/events.hpp"
#include "launch/job.hpp"
#include "launch/run_dir.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

// Unset flags (negative) take the recipe's fault_tolerance section.
struct RestartOptions {
  int max_restarts = -1;
  double backoff_s = -1;
  double hang_timeout_s = -1;
  double rejoin_timeout_s = -1;
  std::string events;     // --events FILE|-
  void validate() const;  // Error(usage) naming a bad flag
  RestartPolicy policy(const FaultToleranceSpec& recipe) const;
  std::chrono::milliseconds hang_timeout(const FaultToleranceSpec& recipe) const;
  std::chrono::milliseconds rejoin_timeout(const FaultToleranceSpec& recipe) const;
};
// --max-restarts, --restart-backoff, --hang-timeout, --rejoin-timeout and --events, shared by
// launch and resume.
void add_restart_options(CLI::App& app, RestartOptions& o);

// Error(recipe) naming /model when the CPU ranks this machine would run cannot hold the model's
// state (parameters, gradients and the optimizer's, in f32: a floor, activations come on top)
// and their synthetic data (each rank generates it whole; /data/samples is named where it is the
// larger part) in the memory it has available: refused before anything starts, not left to the
// ranks' allocation failures; `origin` (the recipe's file) leads the message. Nothing for a GPU
// recipe or where the memory is not known.
void check_local_memory(const JobSpec& spec, const RecipeSource& origin);

// A CLI11 check for a finite number >= 0 that says what is wrong in plain words (CLI11's own
// range check prints DBL_MAX in full, lets "nan" through, and unsigned options wrap "-1").
const CLI::Validator& non_negative_number();
// The same, > 0.
const CLI::Validator& positive_number();
// A non_negative_number at most `most`, which `unit` explains ("a fraction: 0.8 for 80%").
CLI::Validator number_at_most(double most, const char* description, const char* unit);
// A number of seconds: non_negative_number, at most kMaxSeconds.
const CLI::Validator& seconds();
// A number of seconds more than 0 and at least `floor` (a wait that must last some time;
// "SECONDS>=0.001": the finest a wait can be given at): seconds(), and not 0.
CLI::Validator seconds_at_least(double floor);
// A CLI11 check for a path on the remote hosts (--workdir, --remote-binary): ~ and ~/... are the
// login's home there; ~user/... is refused (it would be taken as a directory named "~user").
const CLI::Validator& remote_path();
// A CLI11 check for a run directory argument: not empty (an empty path names no directory, and
// would fail deep inside as "cannot make absolute path").
const CLI::Validator& run_directory();

// A CLI11 check that the value is a whole number T holds, at least `least` (0 or more) and at
// most `most`, so that the conversion cannot wrap or saturate one too large; the help shows
// `description` with the least when it is not 0 ("N>=1").
template <typename T>
CLI::Validator whole_number(const char* description, T most = std::numeric_limits<T>::max(),
                            T least = T{0}) {
  return CLI::Validator(
      [most, least](std::string& value) -> std::string {
        if (value.empty()) return "is empty; give a value";  // as every option says it
        T parsed{};
        const char* end = value.data() + value.size();
        const auto [ptr, ec] = std::from_chars(value.data(), end, parsed);
        const std::string at_least = fmt::format("'{}' must be a whole number >= {}", value, least);
        if (value.empty() || ptr != end ||
            (ec != std::errc() && ec != std::errc::result_out_of_range)) {
          return value.starts_with('-') ? at_least : "'" + value + "' is not a whole number";
        }
        if (ec == std::errc() && parsed < least) return at_least;
        if (ec == std::errc::result_out_of_range || parsed > most) {
          return fmt::format("'{}' is out of range [{}, {}]", value, least, most);
        }
        return {};
      },
      least == T{0} ? std::string(description) : fmt::format("{}>={}", description, least));
}

// Error(usage) when --events would share stdout with --json, lies among a run's files
// (check_events_place; `run_dir` is the command's own run, "" when it has none yet), or is an
// existing file that holds something else than events (its first line is not one), which the
// appended lines would corrupt.
void check_events(const RestartOptions& o, bool json, const std::filesystem::path& run_dir);
// Whether the --events file lies in `run_dir` itself (RUN_DIR/events.jsonl): a launch opens it
// once it has made the directory.
bool events_in_run_dir(const RestartOptions& o, const std::filesystem::path& run_dir);
// The --events stream (disabled when not asked for); check_events first.
std::unique_ptr<EventLog> open_events(const RestartOptions& o, bool json,
                                      const std::filesystem::path& run_dir);
// Ends the events stream of a command that failed outside its job (a launch or resume that did
// not start, the launcher's own failure) with run_finished, its error "WHAT: ...", unless it
// ended already: a pipeline reads every stream to its run_finished. Its status: the --json
// outcome's for a command that did not start (`started` false: "error", or a stop's), the run's
// (failure_end) for a launcher that failed.
void finish_events_with_failure(EventLog& events, const std::exception& e,
                                const std::string& run_dir, const std::string& what, bool started);
// The same for a stream not opened yet (a launch or resume refused before that: its recipe, an
// option, a host, a run directory that holds a run or is being run): opened and ended with
// run_finished, its run_dir the `resumed` run's `run_dir` (absolute) as the command was given
// it, or null for a launch (which made none). Not a stream in
// the run directory (a launch made nothing there; another launcher may be writing it), nor one
// for a run another process drives (the stream may be its own), nor one whose path is itself
// what is refused.
void end_unopened_events(const RestartOptions& o, bool json, const std::string& run_dir,
                         bool resumed, const std::exception& e, const std::string& what);
// How a failure (an exception out of a command's work) ends a run: the kind main exits with (a
// stop signal's, when one came meanwhile; internal for what is not a dptrain::Error), its exit
// code, and the run's status for run.json and run_finished ("failed", "interrupted",
// "terminated").
struct FailureEnd {
  ErrorKind kind;
  int exit_code;
  std::string status;
};
FailureEnd failure_end(const std::exception& e);
// Where progress goes: stderr when stdout carries JSON (the outcome or the events).
std::FILE* status_stream(bool json, const EventLog& events);

// For a run in `dir` whose workers, started without a launcher (by hand, srun, mpirun), are
// running it now: "DIR: its workers (started without a launcher: ...) are running it (NOTE)".
// Empty for any other run, or where there is none.
std::string running_hand_run(const std::filesystem::path& dir);
// For a run in `dir` that its record says a launcher drives now (running, restarting or
// resizing, that launcher alive), whether or not it holds the lock here (its lock file removed,
// a launcher on another machine): "DIR: the run is STATUS (NOTE)". Empty otherwise.
std::string driven_run(const std::filesystem::path& dir);

// read(), which reads the recipe `file`, where a stop signal that cut the read short (a recipe
// from a FIFO that waits for its writer: "Interrupted system call", or half a recipe that does
// not parse) is what happened: stop_error(sig, "FILE: ", after), exit 130 or 143.
template <typename Read>
auto read_or_stop(const std::string& file, std::string_view after, Read&& read) {
  try {
    return read();
  } catch (const Error&) {
    if (const int sig = pending_stop_signal()) throw stop_error(sig, printable(file) + ": ", after);
    throw;
  }
}

// Prints the outcome (a summary on stdout, or one JSON object with --json; errors on stderr)
// and returns the exit code.
// The human summary goes to `summary`.
int report_outcome(const RunDirectory& run, const JobOutcome& outcome, bool json,
                   std::FILE* summary = stdout);
// Runs the job with the restart policy and hang timeout of `o`, emits "run_finished" and
// reports the outcome; returns the exit code.
int run_to_end(RunDirectory& run, JobSpec spec, const RestartOptions& o, bool json,
               EventLog& events, StatusPrinter& status);

// What a run's launcher warned of: `status`'s warnings, then the events stream's write failure
// (which the stream says on stderr itself).
std::vector<std::string> run_warnings(const StatusPrinter& status, const EventLog& events);

// Where a command fails by an exception, what it warned of before (run_warnings) goes into
// `warned` (Outcome::warnings: its JSON error carries them). Declared after the printer, in its
// scope.
class KeepWarningsOnFailure {
 public:
  KeepWarningsOnFailure(const StatusPrinter& status, const EventLog& events,
                        std::vector<std::string>& warned)
      : status_(status),
        events_(events),
        warned_(warned),
        exceptions_(std::uncaught_exceptions()) {}
  ~KeepWarningsOnFailure() {
    if (std::uncaught_exceptions() > exceptions_) {
      const std::vector<std::string> said = run_warnings(status_, events_);
      warned_.insert(warned_.end(), said.begin(), said.end());
    }
  }
  KeepWarningsOnFailure(const KeepWarningsOnFailure&) = delete;
  KeepWarningsOnFailure& operator=(const KeepWarningsOnFailure&) = delete;

 private:
  const StatusPrinter& status_;
  const EventLog& events_;
  std::vector<std::string>& warned_;
  int exceptions_;
};

}  // namespace dptrain::cli
