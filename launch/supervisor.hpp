// Starts local rank processes, relays their output, and stops them all when one fails.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <deque>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.hpp"

namespace dptrain {

struct ProcessSpec {
  std::string label;  // "rank 3": prefixes its output lines and names it in errors
  int rank = 0;
  std::vector<std::string> argv;                         // argv[0] is the executable path
  std::vector<std::pair<std::string, std::string>> env;  // added to the launcher's environment
  std::filesystem::path log_file;                        // every line the process prints
  // Starts the program with SIGTERM blocked (the mask survives exec): a SIGTERM that comes while
  // it loads waits until the program unblocks it, once its handler is in place, instead of
  // killing it. dptrain's main does that, so every dptrain subcommand may be started this way.
  bool hold_sigterm = false;
  // When not 0: the signal that asks the process to end at once with whatever it started (a
  // relay: its host's agent and ranks, which a SIGKILL of the relay would leave running until
  // the agent notices its connection gone). Where the supervisor kills, it sends this one, and
  // SIGKILL only to a process still running kEndWait later (or at a Ctrl-C after the kill). With
  // hold_sigterm it is held while the program loads as SIGTERM is (dptrain's main unblocks SIGUSR1
  // too).
  int end_signal = 0;
};

// How long a process with an end_signal has to end before SIGKILL.
constexpr std::chrono::milliseconds kEndWait{5000};

// How one process ended.
struct ProcessExit {
  std::string label;
  int rank = 0;
  pid_t pid = 0;
  int exit_code = -1;            // when it exited
  int signal = 0;                // when a signal killed it
  std::string describe() const;  // "rank 1 was killed by SIGKILL", "rank 0 exited with code 143"
  // Failed of itself: an exit code of its own (a checkpoint it could not write, a bad setting),
  // not 0, not a stop's 143, not a communication error (3: what a peer's end causes), and no
  // signal (nor a shell's 128 + N for one).
  bool failed_of_itself() const {
    return signal == 0 && exit_code > 0 && exit_code != 3 && exit_code != 143 && exit_code < 128;
  }
};

// A process that failed on its own, with its last output lines.
struct ProcessFailure : ProcessExit {
  std::vector<std::string> last_lines;
  // What else is known of the cause: for SIGKILL, that the kernel's OOM killer struck meanwhile.
  std::string note;
  // "rank 1 (pid 123) was killed by signal 9 (SIGKILL)", then "; " and the note when there is one
  std::string describe() const;
};

struct SupervisionResult {
  // The first process that failed on its own (also when a stop signal came after it).
  std::optional<ProcessFailure> failure;
  int stop_signal = 0;    // SIGINT / SIGTERM received by the launcher
  std::string watchdog;   // the watchdog's message, when it stopped the run
  std::string requested;  // the stop request's message, when it stopped the run
  // Why the processes got SIGKILL during a stop, when they did: a second Ctrl-C, the grace
  // running out, the side that asked for the stop gone (so that a rank killed then is not
  // taken for one the OOM killer struck).
  std::string killed_why;
  // That SIGKILL was asked for at once (a second Ctrl-C, the asking side gone), not the grace
  // running out: where the ranks were then says nothing of a rank that could not stop.
  bool killed_at_once = false;
  std::vector<ProcessExit> exits;  // every process, in the order given
  // The processes killed by SIGKILL before the launcher sent any (the OOM killer, a scheduler),
  // in the order they were reaped; `failure`'s among them when it was one.
  std::vector<ProcessExit> killed;
  bool ok() const { return !failure && stop_signal == 0 && watchdog.empty() && requested.empty(); }
};

struct SupervisorOptions {
  std::chrono::milliseconds grace{5000};  // between SIGTERM and SIGKILL when stopping the others
  // After a SIGTERM to the launcher: ranks finish their step and checkpoint before SIGKILL.
  std::chrono::milliseconds stop_grace{60000};
  // Each output line of a process, without its newline. Lines starting with "@event " carry a
  // trainer event as JSON; the callback decides how to show them.
  std::function<void(const ProcessSpec&, const std::string&)> on_line;
  // Called once all processes are started, with their pids (for run.json).
  std::function<void(const std::vector<pid_t>&)> on_started;
  // When >= 0: lines on this descriptor stop everything as the launcher's own signals do:
  // "stop" like a SIGTERM (ranks checkpoint first, `stop_grace`), "interrupt" like a SIGINT (no
  // checkpoint; a second one kills at once), "kill" kills at once (the other side's end_signal:
  // the launcher's hang watch, or its stop's grace ran out). Its end (or an error) means the other
  // side is gone: the ranks get the short `grace`, or are killed at once when they were already
  // stopping. An agent passes its stdin, the SSH channel from the launcher: when that goes, so do
  // its ranks.
  int stop_fd = -1;
  // Polled every loop: a message stops everything at once (SIGKILL: a hung rank cannot
  // checkpoint) and is reported as the cause.
  std::function<std::optional<std::string>()> watchdog;
  // Polled every loop too: a message stops everything as a SIGTERM to the launcher does (ranks
  // checkpoint at the next step boundary, `stop_grace`), and is reported as `requested`. The
  // launcher asks this way when an elastic job can grow.
  std::function<std::optional<std::string>()> stop_request;
  // Called every loop (about ten times a second) while the processes run.
  std::function<void()> tick;
  // Called once, as the first process fails on its own, before the others are stopped: what
  // they are doing then (their heartbeats) is where the failure found them.
  std::function<void()> on_first_failure;
};

// "SIGKILL" (or "signal 99" for a number without a name).
std::string signal_name(int sig);

// Installs SIGINT/SIGTERM handlers that the supervisor loop observes; call once from main.
// A SIGINT that one process sends again within kSameSignalWindow (`timeout -s INT` signals the
// command, then its process group) is the same request, not a second Ctrl-C.
void install_stop_signal_handlers();
constexpr std::chrono::milliseconds kSameSignalWindow{500};
// For a command that stops only between steps it cannot cut short (an SSH connection being
// made, a remote command): a second Ctrl-C ends the process at once, exit 130, as a second one
// ends a launch's ranks at once.
void exit_on_second_interrupt();
// The SIGINT or SIGTERM received since the handlers were installed, or 0.
int pending_stop_signal();
// The error a command stopped by `sig` (SIGTERM or SIGINT) ends with: "BEFOREstopped by SIGTERM
// AFTER", of kind terminated (143) or interrupted (130).
Error stop_error(int sig, std::string_view before, std::string_view after);
// Throws stop_error(sig, "", after) when SIGINT or SIGTERM came (pending_stop_signal).
void throw_if_stopped(std::string_view after);
// The kind a failure ends with: when SIGINT or SIGTERM came while the command worked, the failure
// is the stop's doing (a read interrupted, a wait cut short), so it is the signal's kind
// (interrupted, terminated), as any stopped command's; otherwise `kind`.
ErrorKind kind_after_stop(ErrorKind kind);
// Sleeps up to `duration`, returning early (with the signal) when SIGINT or SIGTERM arrives.
int sleep_unless_stopped(std::chrono::milliseconds duration);
// Waits until `fd` has something to read (or its end, or an error) and returns 0, or returns the
// SIGINT or SIGTERM that came, also one that came before the wait began (a plain blocking read
// would miss a signal handled just before it started, and wait for ever).
int wait_readable_unless_stopped(int fd);

// Runs the processes to completion. Each runs in its own process group with a parent-death signal,
// so none outlives the launcher. When one exits non-zero or by a signal, the others get SIGTERM,
// then SIGKILL after `grace`. A SIGINT to the launcher is passed on as SIGINT (SIGKILL after
// `grace`; a second SIGINT kills at once); a SIGTERM as SIGTERM (SIGKILL after `stop_grace`;
// more SIGTERMs are the same request, a SIGINT after it kills at once). While stopping, the
// watchdog still runs: when it fires (a hung rank cannot checkpoint) every process is killed at
// once and its message is the result's `watchdog`.
SupervisionResult supervise(const std::vector<ProcessSpec>& specs,
                            const SupervisorOptions& options);

}  // namespace dptrain
