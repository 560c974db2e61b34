// Starts local rank processes, relays their output, and stops them all when one fails.
#include "launch/supervisor.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fstream>
#include <string>
#include <string_view>

#include <fmt/format.h>

#include "core/comm/communicator.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "launch/status.hpp"

extern char** environ;

namespace dptrain {

namespace {

// A line of a process as its log and a failure's excerpt show it: as printed, or a trainer event
// (rank 0's progress, which it prints as events only) as the launcher shows it; none for any
// other protocol line, nor for a terminal's alone (a tick).
std::optional<std::string> shown_line(const std::string& line) {
  if (!line.starts_with("@event ")) return line;
  const auto event = nlohmann::json::parse(line.substr(7), nullptr, false);
  if (event.is_object() && event.contains("event") && !terminal_only(event))
    return format_event(event);
  return std::nullopt;
}

// What waitpid's `status` says of a process (nothing yet when it has not `exited`).
ProcessExit process_exit(const ProcessSpec& spec, pid_t pid, bool exited, int status) {
  ProcessExit e;
  e.label = spec.label;
  e.rank = spec.rank;
  e.pid = pid;
  if (exited && WIFEXITED(status)) e.exit_code = WEXITSTATUS(status);
  if (exited && WIFSIGNALED(status)) e.signal = WTERMSIG(status);
  return e;
}

std::atomic<int> g_stop_signal{0};
std::atomic<int> g_sigint_count{0};
std::atomic<bool> g_second_interrupt_exits{false};
int g_wake_pipe[2] = {-1, -1};

// The sender (high 32 bits; 0: none, or the terminal) and time (low 32 bits: CLOCK_MONOTONIC
// milliseconds, wrapping) of the last SIGINT: one word, exchanged at once, as two threads may
// each take one of two signals sent together.
std::atomic<uint64_t> g_last_sigint{0};
static_assert(std::atomic<uint64_t>::is_always_lock_free);

// Whether this SIGINT repeats one request: `timeout -s INT` signals its command and then the
// command's process group, two signals from one sender within a moment. A terminal's Ctrl-C
// comes from the kernel (si_code > 0), and each press counts.
bool repeated_sigint(const siginfo_t* info) {
  const pid_t from = info != nullptr && info->si_code <= 0 ? info->si_pid : 0;
  timespec now{};
  ::clock_gettime(CLOCK_MONOTONIC, &now);
  const auto ms = static_cast<uint32_t>(static_cast<uint64_t>(now.tv_sec) * 1000 +
                                        static_cast<uint64_t>(now.tv_nsec) / 1000000);
  const uint64_t last =
      g_last_sigint.exchange((static_cast<uint64_t>(static_cast<uint32_t>(from)) << 32) | ms);
  return from != 0 && static_cast<uint32_t>(last >> 32) == static_cast<uint32_t>(from) &&
         ms - static_cast<uint32_t>(last) < static_cast<uint32_t>(kSameSignalWindow.count());
}

void on_stop_signal(int sig, siginfo_t* info, void*) {
  const int saved_errno = errno;  // the code it interrupted may look at errno next
  // A hangup (the terminal or SSH session closed) is a stop like SIGTERM: every rank checkpoints.
  if (sig == SIGHUP) sig = SIGTERM;
  int expected = 0;
  g_stop_signal.compare_exchange_strong(expected, sig);
  // Schedulers send SIGTERM more than once (`timeout` signals the child and its group): that is
  // one stop request. Only a second Ctrl-C means "now"; one SIGINT sent twice at once is one.
  if (sig == SIGINT && !repeated_sigint(info) && g_sigint_count.fetch_add(1) >= 1 &&
      g_second_interrupt_exits.load()) {
    ::_exit(130);
  }
  if (g_wake_pipe[1] >= 0) {
    const char c = 1;
    [[maybe_unused]] auto n = ::write(g_wake_pipe[1], &c, 1);
  }
  errno = saved_errno;
}

constexpr size_t kTailLines = 20;

struct Child {
  const ProcessSpec* spec;
  pid_t pid = -1;
  int out_fd = -1;
  bool exited = false;
  int status = 0;
  std::string partial;
  std::deque<std::string> tail;  // its last lines as its log shows them (shown_line)
  std::ofstream log;
  // Once its end_signal was sent: when SIGKILL follows if it is still running.
  std::optional<std::chrono::steady_clock::time_point> end_by;
  bool killed = false;  // SIGKILL followed (once)
};

std::vector<std::string> build_env(const ProcessSpec& spec) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string entry(*e);
    const std::string key = entry.substr(0, entry.find('='));
    bool overridden = false;
    for (const auto& [k, v] : spec.env)
      overridden = overridden || k == key;
    if (!overridden) env.push_back(entry);
  }
  for (const auto& [k, v] : spec.env)
    env.push_back(k + "=" + v);
  return env;
}

pid_t spawn(const ProcessSpec& spec, int out_fd) {
  // Everything the child needs is prepared before fork: only async-signal-safe calls after it.
  std::vector<std::string> env = build_env(spec);
  std::vector<char*> argv_p, env_p;
  for (const auto& a : spec.argv)
    argv_p.push_back(const_cast<char*>(a.c_str()));
  argv_p.push_back(nullptr);
  for (auto& e : env)
    env_p.push_back(e.data());
  env_p.push_back(nullptr);
  // Every signal is blocked across fork until the child has put the launcher's handlers back
  // to the default: one sent to the child in between (the launcher forwarding a SIGTERM just
  // after it started the rank) would otherwise run the launcher's handler in the child and be
  // lost, leaving a rank that never stops. Blocked, it waits for the default action, or, with
  // hold_sigterm, for the rank's own handler after exec.
  sigset_t all, before;
  sigfillset(&all);
  ::pthread_sigmask(SIG_SETMASK, &all, &before);
  sigset_t child_mask = before;
  if (spec.hold_sigterm) sigaddset(&child_mask, SIGTERM);
  if (spec.hold_sigterm && spec.end_signal != 0) sigaddset(&child_mask, spec.end_signal);
  // Tests: the child waits this long before it resets the handlers, so that a signal can be
  // sent to it in that window on purpose.
  const char* pause_env = std::getenv("DPTRAIN_TEST_SPAWN_PAUSE_MS");
  const long pause_ms = pause_env != nullptr ? std::atol(pause_env) : 0;
  const timespec pause{pause_ms / 1000, (pause_ms % 1000) * 1000000};
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) {
    const int fork_errno = errno;
    ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
    throw Error(ErrorKind::internal,
                fmt::format("cannot start {}: fork: {}", spec.label, std::strerror(fork_errno)));
  }
  if (pid == 0) {
    ::setpgid(0, 0);  // Ctrl-C reaches the launcher only; it stops the ranks in order
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);  // the launcher died before prctl took effect
    if (pause_ms > 0) ::nanosleep(&pause, nullptr);
    for (int sig = 1; sig < NSIG; ++sig) {
      struct sigaction was {};
      if (sig == SIGKILL || sig == SIGSTOP || ::sigaction(sig, nullptr, &was) != 0) continue;
      // Caught ones (SIGHUP...), and SIGINT, SIGTERM and SIGPIPE even where the launcher
      // ignores them: a rank stops as the launcher tells it.
      const bool always = sig == SIGINT || sig == SIGTERM || sig == SIGPIPE;
      if (was.sa_handler != SIG_DFL && (was.sa_handler != SIG_IGN || always)) {
        ::signal(sig, SIG_DFL);
      }
    }
    ::sigprocmask(SIG_SETMASK, &child_mask, nullptr);
    ::dup2(out_fd, STDOUT_FILENO);
    ::dup2(out_fd, STDERR_FILENO);
    ::close(out_fd);
    const int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, STDIN_FILENO);
    ::execve(argv_p[0], argv_p.data(), env_p.data());
    const char msg[] = "dptrain: cannot exec the worker binary\n";
    [[maybe_unused]] auto n = ::write(STDERR_FILENO, msg, sizeof msg - 1);
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also from the parent, so the group exists before we might signal it
  ::pthread_sigmask(SIG_SETMASK, &before, nullptr);
  return pid;
}

// How many processes the kernel's OOM killer has killed since boot (oom_kill in /proc/vmstat,
// which counts cgroup limits too); -1 when unknown. DPTRAIN_TEST_VMSTAT names another file
// (tests: an OOM kill cannot be provoked on demand).
int64_t oom_kills() {
  const char* other = std::getenv("DPTRAIN_TEST_VMSTAT");
  std::ifstream in(other != nullptr && *other != '\0' ? other : "/proc/vmstat");
  std::string key;
  int64_t value = 0;
  while (in >> key >> value) {
    if (key == "oom_kill") return value;
  }
  return -1;
}

// For a process killed by SIGKILL: whether the OOM killer struck since `before` (a count from
// oom_kills()), as a clause for its failure message; empty when it did not or that is unknown.
std::string oom_note(int64_t before) {
  const int64_t now = before < 0 ? -1 : oom_kills();
  if (now <= before) return {};
  return fmt::format(
      "the kernel's OOM killer killed {} since the ranks started (oom_kill in /proc/vmstat): "
      "likely out of memory; see dmesg, and lower the batch or the ranks per host",
      now - before == 1 ? std::string("a process") : fmt::format("{} processes", now - before));
}

}  // namespace

std::string signal_name(int sig) {
  const char* abbrev = ::sigabbrev_np(sig);
  return abbrev ? fmt::format("SIG{}", abbrev) : fmt::format("signal {}", sig);
}

namespace {

class Supervision {
 public:
  Supervision(const std::vector<ProcessSpec>& specs, const SupervisorOptions& options)
      : options_(options), children_(specs.size()) {
    for (size_t i = 0; i < specs.size(); ++i)
      children_[i].spec = &specs[i];
  }

  ~Supervision() {
    // Whatever happened, no child outlives this object.
    for (auto& c : children_) {
      if (c.pid > 0 && !c.exited) {
        ::kill(-c.pid, SIGKILL);
        ::waitpid(c.pid, nullptr, 0);
      }
      if (c.out_fd >= 0) ::close(c.out_fd);
    }
  }

  SupervisionResult run() {
    oom_kills_at_start_ = oom_kills();
    start_all();
    SupervisionResult result;
    bool stopping = false;
    constexpr auto kNever = std::chrono::steady_clock::time_point::max();
    auto stop_deadline = kNever;
    std::chrono::milliseconds granted{0};  // the grace stop_deadline gives, for the message
    while (!all_done()) {
      const bool stop_fd_was_open = !stop_fd_closed_;
      poll_output(100);
      const bool gone_while_stopping = stopping && stop_fd_was_open && stop_fd_closed_;
      reap(result);
      if (options_.tick) options_.tick();
      // A Ctrl-C after the kill does not wait for a process's end_signal (a relay whose host
      // does not answer): SIGKILL now.
      kill_overdue(kill_sent_ && interrupts() > interrupts_at_kill_);
      if (stop_fd_kill_ && !kill_sent_) {
        // The launcher's side ends the job at once (its hang watch, its grace ran out): no
        // checkpoint, as after a SIGINT.
        if (result.stop_signal == 0) result.stop_signal = SIGINT;
        result.killed_why = "the launcher ended the job at once";
        result.killed_at_once = true;
        stopping = true;
        signal_all(SIGKILL);
        stop_deadline = kNever;
        continue;
      }
      if (!stopping) {
        const int sig = stop_fd_signal_ != 0 ? stop_fd_signal_
                        : stop_fd_closed_    ? SIGTERM
                                             : g_stop_signal.load();
        if (sig != 0) result.stop_signal = sig;
        if (sig == 0 && !result.failure && options_.watchdog) {
          if (auto reason = options_.watchdog()) {
            result.watchdog = *reason;
            stopping = true;
            signal_all(SIGKILL);
            continue;
          }
        }
        if (sig == 0 && !result.failure && !candidate_ && options_.stop_request) {
          if (auto reason = options_.stop_request()) {
            result.requested = *reason;
            stopping = true;
            signal_all(SIGTERM);
            granted = options_.stop_grace;
            stop_deadline = std::chrono::steady_clock::now() + granted;
            continue;
          }
        }
        if (result.failure || result.stop_signal != 0) {
          stopping = true;
          // SIGTERM lets ranks checkpoint at the next step boundary, which takes longer than
          // stopping; SIGINT stops them without one.
          // A vanished launcher (end of stop_fd) waits for nothing: the short grace.
          const bool checkpointing = result.stop_signal == SIGTERM && !stop_fd_closed_;
          signal_all(result.stop_signal == SIGINT ? SIGINT : SIGTERM);
          granted = checkpointing ? options_.stop_grace : options_.grace;
          stop_deadline = std::chrono::steady_clock::now() + granted;
        }
      } else if (stop_deadline != kNever &&
                 (interrupts() > (result.stop_signal == SIGINT ? 1 : 0) || gone_while_stopping)) {
        // A second Ctrl-C (or one after a SIGTERM): at once. So too when the launcher that asked
        // for the stop is gone: nobody waits for the checkpoint, and ranks left running would
        // outlive it.
        result.killed_why = gone_while_stopping ? "the launcher that asked for the stop is gone"
                            : result.stop_signal == SIGINT
                                ? "a second SIGINT (Ctrl-C) asked for an end at once"
                                : "a SIGINT (Ctrl-C) after the SIGTERM asked for an end at once";
        result.killed_at_once = true;
        signal_all(SIGKILL);
        stop_deadline = kNever;
      } else if (stop_deadline != kNever && result.watchdog.empty() && options_.watchdog &&
                 (result.stop_signal != 0 || !result.requested.empty())) {
        // A hung rank cannot checkpoint: the hang watch ends the stop grace early.
        if (auto reason = options_.watchdog()) {
          result.watchdog = *reason;
          signal_all(SIGKILL);
          stop_deadline = kNever;
        } else if (std::chrono::steady_clock::now() >= stop_deadline) {
          result.killed_why = grace_ran_out(granted);
          signal_all(SIGKILL);
          stop_deadline = kNever;
        }
      } else if (std::chrono::steady_clock::now() >= stop_deadline) {
        result.killed_why = grace_ran_out(granted);
        signal_all(SIGKILL);
        stop_deadline = kNever;
      }
    }
    drain();
    // A process that failed on its own before a stop signal came is still the failure.
    if (!result.failure && result.requested.empty() &&
        (result.stop_signal != 0 || result.watchdog.empty())) {
      result.failure = candidate_;
    }
    for (const auto& c : children_) {
      result.exits.push_back(process_exit(*c.spec, c.pid, c.exited, c.status));
    }
    if (result.failure) {
      for (auto& c : children_) {
        if (c.pid == result.failure->pid) {
          result.failure->last_lines.assign(c.tail.begin(), c.tail.end());
        }
      }
    }
    return result;
  }

 private:
  void start_all() {
    std::vector<pid_t> pids;
    for (auto& c : children_) {
      int fds[2];
      if (::pipe2(fds, O_CLOEXEC) != 0) {
        throw Error(ErrorKind::internal, fmt::format("pipe: {}", std::strerror(errno)));
      }
      errno = 0;
      c.log.open(c.spec->log_file, std::ios::app);
      if (!c.log) {
        const int why = errno;  // the open's (ofstream keeps it): ENAMETOOLONG, EMFILE, ...
        ::close(fds[0]);
        ::close(fds[1]);
        throw Error(ErrorKind::io, fmt::format("{}: cannot open log file for writing: {}",
                                               printable(c.spec->log_file.string()),
                                               why != 0 ? std::strerror(why) : "unknown error"));
      }
      try {
        c.pid = spawn(*c.spec, fds[1]);
      } catch (...) {
        ::close(fds[0]);
        ::close(fds[1]);
        throw;
      }
      ::close(fds[1]);
      c.out_fd = fds[0];
      ::fcntl(c.out_fd, F_SETFL, O_NONBLOCK);
      pids.push_back(c.pid);
    }
    if (options_.on_started) options_.on_started(pids);
  }

  bool all_done() const {
    for (const auto& c : children_) {
      if (!c.exited || c.out_fd >= 0) return false;
    }
    return true;
  }

  void poll_output(int timeout_ms) {
    std::vector<pollfd> fds;
    std::vector<Child*> owners;
    for (auto& c : children_) {
      if (c.out_fd >= 0) {
        fds.push_back({c.out_fd, POLLIN, 0});
        owners.push_back(&c);
      }
    }
    const size_t stop_index = fds.size();
    if (options_.stop_fd >= 0 && !stop_fd_closed_) fds.push_back({options_.stop_fd, POLLIN, 0});
    if (g_wake_pipe[0] >= 0) fds.push_back({g_wake_pipe[0], POLLIN, 0});
    const int n = ::poll(fds.data(), fds.size(), timeout_ms);
    if (n <= 0) return;
    if (options_.stop_fd >= 0 && !stop_fd_closed_ && fds[stop_index].revents != 0) {
      char buf[4096];
      const ssize_t got = ::read(options_.stop_fd, buf, sizeof buf);
      // "stop" asks for a checkpoint first, "interrupt" does not; the end means the other side
      // is gone (stop now).
      if (got > 0) read_stop_requests(std::string_view(buf, static_cast<size_t>(got)));
      if (got == 0 || (got < 0 && errno != EAGAIN && errno != EINTR)) stop_fd_closed_ = true;
    }
    for (size_t i = 0; i < owners.size(); ++i) {
      if (fds[i].revents != 0) read_from(*owners[i]);
    }
    if (g_wake_pipe[0] >= 0 && fds.back().revents != 0) {
      char buf[64];
      while (::read(g_wake_pipe[0], buf, sizeof buf) > 0) {
      }
    }
  }

  void read_stop_requests(std::string_view data) {
    stop_fd_partial_.append(data);
    size_t end;
    while ((end = stop_fd_partial_.find('\n')) != std::string::npos) {
      const std::string line = stop_fd_partial_.substr(0, end);
      stop_fd_partial_.erase(0, end + 1);
      if (line == "interrupt") {
        ++stop_fd_interrupts_;
        if (stop_fd_signal_ == 0) stop_fd_signal_ = SIGINT;
      } else if (line == "kill") {
        stop_fd_kill_ = true;
      } else if (stop_fd_signal_ == 0) {
        stop_fd_signal_ = SIGTERM;  // "stop", and anything else a polite stop request
      }
    }
  }

  // At most kReadsPerRound reads of a child a round: one that writes faster than its lines
  // are handled cannot keep the loop from reaping, watching and stopping. A line longer than
  // kMaxLine is cut into pieces of that size rather than held whole. Returns whether more may be
  // waiting (the round ended at its limit).
  static constexpr int kReadsPerRound = 16;
  static constexpr size_t kMaxLine = size_t{1} << 20;

  bool read_from(Child& c) {
    char buf[65536];
    for (int round = 0; round < kReadsPerRound; ++round) {
      const ssize_t n = ::read(c.out_fd, buf, sizeof buf);
      if (n > 0) {
        c.partial.append(buf, static_cast<size_t>(n));
        size_t pos;
        while ((pos = c.partial.find('\n')) != std::string::npos) {
          emit_line(c, c.partial.substr(0, pos));
          c.partial.erase(0, pos + 1);
        }
        while (c.partial.size() >= kMaxLine) {
          emit_line(c, c.partial.substr(0, kMaxLine));
          c.partial.erase(0, kMaxLine);
        }
        continue;
      }
      if (n < 0 && (errno == EAGAIN || errno == EINTR)) return false;
      // EOF: the process and everything it started closed their output.
      if (!c.partial.empty()) emit_line(c, c.partial);
      c.partial.clear();
      ::close(c.out_fd);
      c.out_fd = -1;
      return false;
    }
    return true;
  }

  void emit_line(Child& c, const std::string& line) {
    // Formatted once, for the log and the tail a failure quotes.
    if (auto text = shown_line(line)) {
      c.log << *text << '\n';
      c.log.flush();
      c.tail.push_back(std::move(*text));
      if (c.tail.size() > kTailLines) c.tail.pop_front();
    }
    if (options_.on_line) options_.on_line(*c.spec, line);
  }

  void reap(SupervisionResult& result) {
    for (auto& c : children_) {
      if (c.exited) continue;
      int status = 0;
      const pid_t r = ::waitpid(c.pid, &status, WNOHANG);
      // ECHILD: reaped by someone else (never here: main restores SIGCHLD's default), its
      // status lost; taken as a failure rather than waited for.
      const bool lost = r < 0 && errno == ECHILD;
      if (r != c.pid && !lost) continue;
      if (lost) status = 255 << 8;
      c.exited = true;
      c.status = status;
      const bool clean = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      // Ranks stopped by our own SIGTERM/SIGKILL are casualties, not the cause. One killed by
      // SIGKILL before this sent any was not (the OOM killer, a scheduler), also when it died a
      // moment after the failure that began the stop (two ranks struck at once).
      if (!clean && !kill_sent_ && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) {
        result.killed.push_back(process_exit(*c.spec, c.pid, true, status));
      }
      if (!clean && !stopping_signalled_ && result.stop_signal == 0) {
        ProcessFailure f;
        static_cast<ProcessExit&>(f) = process_exit(*c.spec, c.pid, true, status);
        if (f.signal == SIGKILL) f.note = oom_note(oom_kills_at_start_);
        // Its last words, which say whether it only followed a peer that was gone: what is in
        // the pipe, its own children killed first (one that writes on would hold the reads).
        ::kill(-c.pid, SIGKILL);
        for (int round = 0; round < 16 && c.out_fd >= 0 && read_from(c); ++round) {
        }
        f.last_lines.assign(c.tail.begin(), c.tail.end());
        consider_failure(f);
      }
      // Whatever a dead rank's children still hold open must not keep us waiting for EOF.
      ::kill(-c.pid, SIGKILL);
    }
    if (candidate_ && (candidate_rank_ == 0 || std::chrono::steady_clock::now() >= decide_by_)) {
      result.failure = candidate_;
    }
  }

  // When a rank dies, its peers soon fail too with a communication error (exit 3). Such a failure
  // waits a moment for the real cause, which outranks it: a signal, another exit code, then an
  // exit 3 of its own (a collective that timed out waiting for a frozen rank), then one that
  // says a peer closed its connection (it followed one that had gone). A host's relay exits with
  // its rank's status, after the lines of each of its ranks: it only followed when every error
  // line among them says so (one rank's timeout beside another's note is a cause).
  static int rank_of_cause(const ProcessFailure& f) {
    if (f.signal != 0) return 0;
    if (f.exit_code != 3) return 1;
    bool any_error = false;
    bool all_followed = true;
    for (const std::string& line : f.last_lines) {
      if (line.find(kErrorLinePrefix) == std::string::npos) continue;
      any_error = true;
      all_followed = all_followed && line.find(kPeerGoneNote) != std::string::npos;
    }
    return any_error && all_followed ? 3 : 2;
  }

  void consider_failure(const ProcessFailure& f) {
    const int r = rank_of_cause(f);
    if (!candidate_ && options_.on_first_failure) options_.on_first_failure();
    if (!candidate_ || r < candidate_rank_) {
      if (!candidate_) decide_by_ = std::chrono::steady_clock::now() + kCauseWindow;
      candidate_ = f;
      candidate_rank_ = r;
    }
  }

  static std::string grace_ran_out(std::chrono::milliseconds grace) {
    return fmt::format("still running {:g} s after the request to stop",
                       static_cast<double>(grace.count()) / 1000.0);
  }

  int interrupts() const { return g_sigint_count.load() + stop_fd_interrupts_; }

  void signal_all(int sig) {
    stopping_signalled_ = true;
    if (sig == SIGKILL && !kill_sent_) {
      kill_sent_ = true;
      interrupts_at_kill_ = interrupts();
    }
    for (auto& c : children_) {
      if (c.exited) continue;
      if (sig == SIGKILL && c.spec->end_signal != 0) {
        // Asked to end with what it started; SIGKILL once kEndWait has passed (kill_overdue).
        if (!c.end_by) {
          ::kill(-c.pid, c.spec->end_signal);
          ::kill(-c.pid, SIGCONT);
          c.end_by = std::chrono::steady_clock::now() + kEndWait;
        }
        continue;
      }
      ::kill(-c.pid, sig);
      // A stopped rank (SIGSTOP, a debugger let go of) acts on a SIGTERM or SIGINT only once it
      // runs again, as a shell's kill does for a stopped job: else its grace would pass in vain
      // and SIGKILL end it, with nothing said.
      if (sig != SIGKILL) ::kill(-c.pid, SIGCONT);
    }
  }

  // SIGKILL to a process that its end_signal did not end in time (or, `now_for_all`, not yet).
  void kill_overdue(bool now_for_all) {
    const auto now = std::chrono::steady_clock::now();
    for (auto& c : children_) {
      if (c.exited || !c.end_by || c.killed || (now < *c.end_by && !now_for_all)) continue;
      ::kill(-c.pid, SIGKILL);
      c.killed = true;
    }
  }

  void drain() {
    for (auto& c : children_) {
      while (c.out_fd >= 0 && read_from(c)) {
      }
    }
  }

  static constexpr std::chrono::milliseconds kCauseWindow{1000};

  int64_t oom_kills_at_start_ = -1;

  const SupervisorOptions& options_;
  std::vector<Child> children_;
  bool stopping_signalled_ = false;
  bool kill_sent_ = false;      // SIGKILL sent to the processes (a stop's end)
  int interrupts_at_kill_ = 0;  // interrupts() when it was sent
  bool stop_fd_closed_ = false;
  int stop_fd_signal_ = 0;  // the stop the first line on stop_fd asked for
  int stop_fd_interrupts_ = 0;
  bool stop_fd_kill_ = false;  // "kill" came on stop_fd
  std::string stop_fd_partial_;
  std::optional<ProcessFailure> candidate_;
  int candidate_rank_ = 0;
  std::chrono::steady_clock::time_point decide_by_;
};

}  // namespace

std::string ProcessExit::describe() const {
  if (signal != 0) return fmt::format("{} was killed by {}", label, signal_name(signal));
  return fmt::format("{} exited with code {}", label, exit_code);
}

std::string ProcessFailure::describe() const {
  if (signal != 0) {
    return fmt::format("{} (pid {}) was killed by signal {} ({}){}", label, pid, signal,
                       signal_name(signal), note.empty() ? "" : "; " + note);
  }
  return fmt::format("{} (pid {}) exited with code {}", label, pid, exit_code);
}

void install_stop_signal_handlers() {
  if (g_wake_pipe[0] < 0) {
    if (::pipe2(g_wake_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
      throw Error(ErrorKind::internal, fmt::format("pipe: {}", std::strerror(errno)));
    }
  }
  set_stop_check(&pending_stop_signal);  // a read waiting on a pipe looks at it
  struct sigaction sa {};
  sa.sa_sigaction = on_stop_signal;
  sa.sa_flags = SA_SIGINFO;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
  // A signal this process was started ignoring stays ignored, as shells and other programs keep
  // it: SIGHUP under nohup (the job outlives the session), SIGINT in a script's background job
  // (`dptrain ... &`, which a Ctrl-C meant for the script must not stop).
  for (const int sig : {SIGINT, SIGHUP}) {
    struct sigaction was {};
    if (::sigaction(sig, nullptr, &was) == 0 && was.sa_handler != SIG_IGN) {
      ::sigaction(sig, &sa, nullptr);
    }
  }
  ::signal(SIGPIPE, SIG_IGN);
}

void exit_on_second_interrupt() {
  g_second_interrupt_exits.store(true);
}

Error stop_error(int sig, std::string_view before, std::string_view after) {
  return Error(
      sig == SIGTERM ? ErrorKind::terminated : ErrorKind::interrupted,
      fmt::format("{}stopped by {}{}", before, sig == SIGTERM ? "SIGTERM" : "SIGINT", after));
}

void throw_if_stopped(std::string_view after) {
  if (const int sig = pending_stop_signal()) throw stop_error(sig, "", after);
}

int pending_stop_signal() {
  return g_stop_signal.load();
}

ErrorKind kind_after_stop(ErrorKind kind) {
  const int sig = pending_stop_signal();
  if (sig == 0 || is_stop_kind(kind)) return kind;
  return sig == SIGINT ? ErrorKind::interrupted : ErrorKind::terminated;
}

int sleep_unless_stopped(std::chrono::milliseconds duration) {
  const auto deadline = std::chrono::steady_clock::now() + duration;
  while (std::chrono::steady_clock::now() < deadline) {
    if (const int sig = pending_stop_signal()) return sig;
    pollfd fd{g_wake_pipe[0], POLLIN, 0};
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    ::poll(&fd, g_wake_pipe[0] >= 0 ? 1 : 0, static_cast<int>(std::max<int64_t>(left.count(), 0)));
  }
  return pending_stop_signal();
}

int wait_readable_unless_stopped(int fd) {
  for (;;) {
    if (const int sig = pending_stop_signal()) return sig;
    // The wake pipe ends the wait at once; the slice is for a pipe another wait has drained.
    pollfd fds[2] = {{fd, POLLIN, 0}, {g_wake_pipe[0], POLLIN, 0}};
    const int ready = ::poll(fds, g_wake_pipe[0] >= 0 ? 2 : 1, 200);
    if (ready > 0 && fds[0].revents != 0) return pending_stop_signal();
  }
}

SupervisionResult supervise(const std::vector<ProcessSpec>& specs,
                            const SupervisorOptions& options) {
  Supervision s(specs, options);
  return s.run();
}

}  // namespace dptrain
