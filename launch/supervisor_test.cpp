// The supervisor with real child processes: output relay, failure attribution, stopping the rest.
#include "launch/supervisor.hpp"

#include "tests/scoped_env.hpp"
#include "tests/temp_dir.hpp"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <thread>

#include <fmt/format.h>

namespace fs = std::filesystem;
using namespace dptrain;

namespace {

struct Fixture {
  test::TempDir tmp;
  const fs::path& dir = tmp.path();
  std::map<std::string, std::vector<std::string>> lines;
  std::vector<pid_t> pids;
  std::mutex mutex;
  SupervisorOptions options;

  Fixture() {
    options.grace = std::chrono::milliseconds(300);
    options.on_line = [this](const ProcessSpec& p, const std::string& line) {
      std::lock_guard lock(mutex);
      lines[p.label].push_back(line);
    };
    options.on_started = [this](const std::vector<pid_t>& started) { pids = started; };
  }

  ProcessSpec shell(int rank, const std::string& script) {
    ProcessSpec p;
    p.rank = rank;
    p.label = "rank " + std::to_string(rank);
    p.argv = {"/bin/sh", "-c", script};
    p.env = {{"MY_RANK", std::to_string(rank)}};
    p.log_file = dir / ("rank" + std::to_string(rank) + ".log");
    return p;
  }
};

bool alive(pid_t pid) {
  return ::kill(pid, 0) == 0;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

TEST_CASE("supervisor: all succeed; output is relayed per process and logged") {
  Fixture f;
  const auto result = supervise({f.shell(0, "echo hello from $MY_RANK; echo second >&2"),
                                 f.shell(1, "printf 'no newline at end'")},
                                f.options);
  CHECK(result.ok());
  CHECK(f.pids.size() == 2);
  CHECK(f.lines["rank 0"] == std::vector<std::string>{"hello from 0", "second"});
  CHECK(f.lines["rank 1"] == std::vector<std::string>{"no newline at end"});
  CHECK(slurp(f.dir / "rank0.log") == "hello from 0\nsecond\n");
}

TEST_CASE("supervisor: a failing process stops the others and is named with its last lines") {
  Fixture f;
  const auto result =
      supervise({f.shell(0, "sleep 30"),
                 f.shell(1,
                         "echo one; echo '@event {}'; echo '@event {\"event\":\"info\",\"message\":"
                         "\"hello\"}'; echo two; exit 7")},
                f.options);
  REQUIRE(result.failure);
  CHECK(result.failure->rank == 1);
  CHECK(result.failure->exit_code == 7);
  CHECK(result.failure->describe().find("rank 1") != std::string::npos);
  CHECK(result.failure->describe().find("exited with code 7") != std::string::npos);
  // A trainer event is quoted as the launcher shows it; anything else of the protocol is not.
  CHECK(result.failure->last_lines == std::vector<std::string>{"one", "hello", "two"});
  // And so does its log.
  CHECK(slurp(f.dir / "rank1.log") == "one\nhello\ntwo\n");
  for (pid_t p : f.pids)
    CHECK_FALSE(alive(p));
}

TEST_CASE("supervisor: death by signal is named; a peer's later exit 3 is not the cause") {
  Fixture f;
  // Rank 0 "notices" the dead peer first and exits 3 like a worker whose collective failed;
  // rank 1's SIGKILL, though found later, is the cause.
  const auto result =
      supervise({f.shell(0, "sleep 0.1; exit 3"), f.shell(1, "sleep 0.4; kill -9 $$")}, f.options);
  REQUIRE(result.failure);
  CHECK(result.failure->rank == 1);
  CHECK(result.failure->signal == SIGKILL);
  CHECK(result.failure->describe().find("SIGKILL") != std::string::npos);
}

TEST_CASE("supervisor: an exit 3 that only followed a gone peer yields to the peer's own exit 3") {
  Fixture f;
  // Rank 0 exits 3 first saying a peer closed its connection; rank 1, which timed out waiting
  // for a frozen rank, exits 3 a moment later: its failure is the cause.
  const auto result = supervise(
      {f.shell(0,
               "echo 'dptrain: error: rank 0: gloo allreduce failed: Connection closed by "
               "peer (a peer rank has exited or was killed: its own exit or log says why)' >&2; "
               "exit 3"),
       f.shell(1,
               "sleep 0.3; echo 'dptrain: error: rank 1: gloo allreduce failed: Timed out "
               "waiting 15000ms for recv' >&2; exit 3")},
      f.options);
  REQUIRE(result.failure);
  CHECK(result.failure->rank == 1);
  CHECK(result.failure->exit_code == 3);
  REQUIRE_FALSE(result.failure->last_lines.empty());
  CHECK(result.failure->last_lines.back().find("Timed out") != std::string::npos);
}

TEST_CASE("supervisor: a host's relay with one rank's own timeout is a cause beside a follower") {
  Fixture f;
  // Process 1 relays two ranks: one timed out (a cause), the other then followed it; process 0
  // only followed. Process 1, though it exits later, is named.
  const std::string follower =
      "dptrain: error: rank 0: gloo allreduce failed: Connection reset by peer (a peer rank has "
      "exited or was killed: its own exit or log says why)";
  const auto result = supervise(
      {f.shell(0, "echo '[a:0] " + follower + "' >&2; exit 3"),
       f.shell(1,
               "sleep 0.3; echo '[b:2] dptrain: error: rank 2: gloo allreduce failed: Timed "
               "out waiting 15000ms for recv' >&2; echo '[b:3] " +
                   follower + "' >&2; exit 3")},
      f.options);
  REQUIRE(result.failure);
  CHECK(result.failure->rank == 1);
}

TEST_CASE("supervisor: a process that ignores SIGTERM is killed after the grace period") {
  Fixture f;
  const auto t0 = std::chrono::steady_clock::now();
  const auto result = supervise(
      {f.shell(0, "trap '' TERM; while :; do sleep 0.05; done"), f.shell(1, "sleep 0.1; exit 1")},
      f.options);
  REQUIRE(result.failure);
  CHECK(result.failure->rank == 1);
  for (pid_t p : f.pids)
    CHECK_FALSE(alive(p));
  // Bound against a hang, far above the 300 ms grace.
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));
}

TEST_CASE("supervisor: a stopped process (SIGSTOP) is let run to act on its SIGTERM") {
  Fixture f;
  // Rank 0 stops itself, as a debugger or `kill -STOP` would leave it; rank 1 then fails. The
  // SIGTERM that follows reaches rank 0's handler (with a SIGCONT), not the grace's SIGKILL.
  const std::string pid_file = (f.dir / "rank0.pid").string();
  const auto result = supervise(
      {f.shell(0, "trap 'echo got TERM; exit 7' TERM; echo $$ > " + pid_file + ".tmp; mv " +
                      pid_file + ".tmp " + pid_file + "; kill -STOP $$; sleep 30"),
       // Fails once rank 0 is stopped (state T in its stat), not before.
       f.shell(1, "until [ -s " + pid_file + " ] && grep -q ') T' /proc/$(cat " + pid_file +
                      ")/stat; do sleep 0.02; done; exit 1")},
      f.options);
  REQUIRE(result.failure);
  CHECK(result.failure->rank == 1);
  bool reported = false;
  for (const auto& e : result.exits) {
    if (e.label != "rank 0") continue;
    reported = true;
    CHECK(e.signal == 0);
    CHECK(e.exit_code == 7);
  }
  CHECK(reported);
  std::lock_guard lock(f.mutex);
  CHECK(f.lines["rank 0"] == std::vector<std::string>{"got TERM"});
}

TEST_CASE("supervisor: a grandchild holding the output open does not keep it waiting") {
  Fixture f;
  const auto result = supervise({f.shell(0, "(sleep 30 &) ; echo started; exit 5")}, f.options);
  REQUIRE(result.failure);
  CHECK(result.failure->exit_code == 5);
}

TEST_CASE("supervisor: a stop request stops every process with SIGTERM, given stop_grace") {
  Fixture f;
  f.options.stop_grace = std::chrono::seconds(20);
  int polls = 0;
  f.options.stop_request = [&polls]() -> std::optional<std::string> {
    if (++polls < 3) return std::nullopt;
    return "a host answers again";
  };
  // Like ranks that checkpoint on SIGTERM: they take a moment longer than `grace`, then exit 143.
  const std::string rank =
      "trap 'sleep 0.6; echo saved; exit 143' TERM; while :; do sleep 0.05; done";
  const auto result = supervise({f.shell(0, rank), f.shell(1, rank)}, f.options);
  CHECK_FALSE(result.failure);
  CHECK(result.stop_signal == 0);
  CHECK(result.requested == "a host answers again");
  CHECK_FALSE(result.ok());
  // Each finished its "checkpoint": not killed after the 300 ms grace.
  // (The shell may first say its `sleep` was terminated: the signal goes to the process group.)
  for (const char* label : {"rank 0", "rank 1"}) {
    REQUIRE_FALSE(f.lines[label].empty());
    CHECK(f.lines[label].back() == "saved");
  }
  for (pid_t p : f.pids)
    CHECK_FALSE(alive(p));
}

TEST_CASE("supervisor: while stopping, the watchdog ends the stop grace; every exit is reported") {
  Fixture f;
  f.options.stop_grace = std::chrono::seconds(60);
  bool stop_asked = false;
  int polls_after = 0;
  f.options.stop_request = [&stop_asked]() -> std::optional<std::string> {
    stop_asked = true;
    return "a host answers again";
  };
  // Only once the stop began, and a few polls later: a rank that cannot checkpoint (it hangs).
  f.options.watchdog = [&]() -> std::optional<std::string> {
    if (!stop_asked || ++polls_after < 3) return std::nullopt;
    return "hang: rank 1 is stuck";
  };
  const auto t0 = std::chrono::steady_clock::now();
  const auto result =
      supervise({f.shell(0, "trap 'sleep 0.2; exit 143' TERM; while :; do sleep 0.05; done"),
                 f.shell(1, "trap '' TERM; while :; do sleep 0.05; done")},
                f.options);
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));  // not stop_grace
  CHECK(result.watchdog == "hang: rank 1 is stuck");
  REQUIRE(result.exits.size() == 2);
  CHECK(result.exits[1].rank == 1);
  CHECK(result.exits[1].signal == SIGKILL);
  CHECK(result.exits[1].describe() == "rank 1 was killed by SIGKILL");
  for (pid_t p : f.pids)
    CHECK_FALSE(alive(p));
}

// Waits (up to 20 s) until process `label` printed `text`; polled from a test thread.
bool printed(Fixture& f, const std::string& label, const std::string& text) {
  for (int i = 0; i < 400; ++i) {
    {
      std::lock_guard lock(f.mutex);
      const auto& l = f.lines[label];
      if (std::find(l.begin(), l.end(), text) != l.end()) return true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

// The agent's end of the SSH channel: the launcher's stop signals arrive as lines on stop_fd.
struct StopPipe {
  int fds[2] = {-1, -1};
  // Close-on-exec: a child holding the write end would keep the end from coming.
  StopPipe() { REQUIRE(::pipe2(fds, O_CLOEXEC) == 0); }
  ~StopPipe() {
    close_write();
    ::close(fds[0]);
  }
  void send(const std::string& line) const {
    const std::string text = line + "\n";
    REQUIRE(::write(fds[1], text.data(), text.size()) == static_cast<ssize_t>(text.size()));
  }
  void close_write() {
    if (fds[1] >= 0) ::close(fds[1]);
    fds[1] = -1;
  }
};

TEST_CASE("supervisor: \"interrupt\" on stop_fd stops the ranks with SIGINT, no checkpoint") {
  Fixture f;
  StopPipe stop;
  f.options.stop_fd = stop.fds[0];
  f.options.stop_grace = std::chrono::seconds(60);
  const std::string rank =
      "trap 'echo saved; exit 143' TERM; trap 'echo interrupted; exit 130' "
      "INT; echo up; while :; do sleep 0.05; done";
  std::thread ctrl_c([&] {
    // Once both are up (their traps set), the launcher passes on a Ctrl-C.
    printed(f, "rank 0", "up");
    printed(f, "rank 1", "up");
    stop.send("interrupt");
  });
  const auto result = supervise({f.shell(0, rank), f.shell(1, rank)}, f.options);
  ctrl_c.join();
  CHECK(result.stop_signal == SIGINT);
  for (const char* label : {"rank 0", "rank 1"}) {
    REQUIRE_FALSE(f.lines[label].empty());
    CHECK(f.lines[label].back() == "interrupted");
  }
  for (pid_t p : f.pids)
    CHECK_FALSE(alive(p));
}

TEST_CASE("supervisor: \"stop\" on stop_fd is a SIGTERM; a second \"interrupt\" kills at once") {
  Fixture f;
  StopPipe stop;
  f.options.stop_fd = stop.fds[0];
  f.options.stop_grace = std::chrono::seconds(60);
  // A rank busy with its checkpoint: it does not end on SIGTERM or SIGINT.
  const std::string rank =
      "trap 'echo checkpointing' TERM; trap 'echo busy' INT; echo up; "
      "while :; do sleep 0.05; done";
  std::thread signals([&] {
    printed(f, "rank 0", "up");
    stop.send("stop");
    // Once the rank saw the SIGTERM, the user presses Ctrl-C: the launcher passes it on.
    printed(f, "rank 0", "checkpointing");
    stop.send("interrupt");
  });
  const auto t0 = std::chrono::steady_clock::now();
  const auto result = supervise({f.shell(0, rank)}, f.options);
  signals.join();
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));  // not stop_grace
  CHECK(result.stop_signal == SIGTERM);
  REQUIRE(result.exits.size() == 1);
  CHECK(result.exits[0].signal == SIGKILL);
  for (pid_t p : f.pids)
    CHECK_FALSE(alive(p));
}

TEST_CASE("supervisor: \"kill\" on stop_fd kills the ranks at once, as a stop without checkpoint") {
  Fixture f;
  StopPipe stop;
  f.options.stop_fd = stop.fds[0];
  f.options.stop_grace = std::chrono::seconds(60);
  // A rank that would take its time over SIGTERM and SIGINT alike.
  const std::string rank = "trap 'echo busy' TERM INT; echo up; while :; do sleep 0.05; done";
  std::thread kill([&] {
    printed(f, "rank 0", "up");
    printed(f, "rank 1", "up");
    stop.send("kill");  // the launcher's hang watch
  });
  const auto t0 = std::chrono::steady_clock::now();
  const auto result = supervise({f.shell(0, rank), f.shell(1, rank)}, f.options);
  kill.join();
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));  // not stop_grace
  CHECK(result.stop_signal == SIGINT);
  CHECK(result.killed_at_once);
  CHECK(result.killed_why == "the launcher ended the job at once");
  CHECK_FALSE(result.failure);
  REQUIRE(result.exits.size() == 2);
  for (const ProcessExit& e : result.exits)
    CHECK(e.signal == SIGKILL);
  // Neither saw a SIGTERM or SIGINT first.
  for (const char* label : {"rank 0", "rank 1"})
    CHECK(std::find(f.lines[label].begin(), f.lines[label].end(), "busy") == f.lines[label].end());
  for (pid_t p : f.pids)
    CHECK_FALSE(alive(p));
}

TEST_CASE("supervisor: a kill sends a process's end_signal first, SIGKILL only kEndWait later") {
  Fixture f;
  bool fired = false;
  f.options.watchdog = [&]() -> std::optional<std::string> {
    std::lock_guard lock(f.mutex);
    if (fired || f.lines["host a"].empty() || f.lines["host b"].empty()) return std::nullopt;
    fired = true;
    return "hang: rank 2 is stuck";
  };
  // A relay ends its host's ranks on its end_signal and exits; one that cannot (it is stuck on
  // its connection) is killed once kEndWait has passed. A rank is killed at once.
  auto a = f.shell(0, "trap 'echo ending; exit 138' USR1; echo up; while :; do sleep 0.05; done");
  a.label = "host a";
  a.end_signal = SIGUSR1;
  auto b = f.shell(1, "trap 'echo stuck' USR1; echo up; while :; do sleep 0.05; done");
  b.label = "host b";
  b.end_signal = SIGUSR1;
  const auto t0 = std::chrono::steady_clock::now();
  const auto result = supervise({a, b, f.shell(2, "while :; do sleep 0.05; done")}, f.options);
  const auto took = std::chrono::steady_clock::now() - t0;
  CHECK(result.watchdog == "hang: rank 2 is stuck");
  CHECK_FALSE(result.failure);
  REQUIRE(result.exits.size() == 3);
  CHECK(result.exits[0].exit_code == 138);
  CHECK(f.lines["host a"].back() == "ending");
  CHECK(result.exits[1].signal == SIGKILL);
  CHECK(f.lines["host b"].back() == "stuck");
  CHECK(took >= kEndWait);  // the stuck one had its time
  CHECK(result.exits[2].signal == SIGKILL);
  for (pid_t p : f.pids)
    CHECK_FALSE(alive(p));
}

TEST_CASE("supervisor: a Ctrl-C after the kill does not wait kEndWait for an end_signal") {
  Fixture f;
  StopPipe stop;
  f.options.stop_fd = stop.fds[0];
  auto stuck = f.shell(0,
                       "trap 'echo stuck' USR1; trap '' INT; echo up; "
                       "while :; do sleep 0.05; done");
  stuck.label = "host a";
  stuck.end_signal = SIGUSR1;
  std::thread presses([&] {
    printed(f, "host a", "up");
    stop.send("interrupt");
    stop.send("interrupt");  // the second: the kill, its end_signal first
    printed(f, "host a", "stuck");
    stop.send("interrupt");  // the third: SIGKILL now
  });
  const auto t0 = std::chrono::steady_clock::now();
  const auto result = supervise({stuck}, f.options);
  const auto took = std::chrono::steady_clock::now() - t0;
  presses.join();
  CHECK(took < kEndWait);
  REQUIRE(result.exits.size() == 1);
  CHECK(result.exits[0].signal == SIGKILL);
  for (pid_t p : f.pids)
    CHECK_FALSE(alive(p));
}

TEST_CASE("supervisor: the end of stop_fd while stopping kills at once: no rank outlives it") {
  Fixture f;
  StopPipe stop;
  f.options.stop_fd = stop.fds[0];
  f.options.stop_grace = std::chrono::seconds(60);
  const std::string rank =
      "trap 'echo checkpointing' TERM; echo up; "
      "while :; do sleep 0.05; done";
  std::thread gone([&] {
    printed(f, "rank 0", "up");
    stop.send("stop");
    printed(f, "rank 0", "checkpointing");
    stop.close_write();  // the launcher's relay was killed: the SSH channel ends
  });
  const auto t0 = std::chrono::steady_clock::now();
  const auto result = supervise({f.shell(0, rank)}, f.options);
  gone.join();
  CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));  // not stop_grace
  REQUIRE(result.exits.size() == 1);
  CHECK(result.exits[0].signal == SIGKILL);
  for (pid_t p : f.pids)
    CHECK_FALSE(alive(p));
}

TEST_CASE("supervisor: the end of stop_fd alone stops the ranks with the short grace") {
  Fixture f;
  StopPipe stop;
  f.options.stop_fd = stop.fds[0];
  f.options.stop_grace = std::chrono::seconds(60);
  const std::string rank =
      "trap 'echo terminated; exit 143' TERM; echo up; "
      "while :; do sleep 0.05; done";
  std::thread gone([&] {
    printed(f, "rank 0", "up");
    stop.close_write();
  });
  const auto result = supervise({f.shell(0, rank)}, f.options);
  gone.join();
  CHECK(result.stop_signal == SIGTERM);
  REQUIRE_FALSE(f.lines["rank 0"].empty());
  CHECK(f.lines["rank 0"].back() == "terminated");
  for (pid_t p : f.pids)
    CHECK_FALSE(alive(p));
}

// A script that says whether `sig` is blocked in it: "blocked" or "open".
std::string says_whether_blocked(int sig) {
  return fmt::format(
      "mask=$(sed -n 's/^SigBlk:[[:space:]]*//p' /proc/self/status); "
      "[ $(( 0x$mask & {:#x} )) -ne 0 ] && echo blocked || echo open",
      1ull << (sig - 1));
}

TEST_CASE("supervisor: hold_sigterm starts a process with SIGTERM blocked, others without") {
  Fixture f;
  const std::string script = says_whether_blocked(SIGTERM);
  ProcessSpec held = f.shell(0, script);
  held.hold_sigterm = true;
  const auto result = supervise({held, f.shell(1, script)}, f.options);
  CHECK(result.ok());
  CHECK(f.lines["rank 0"] == std::vector<std::string>{"blocked"});
  CHECK(f.lines["rank 1"] == std::vector<std::string>{"open"});
}

TEST_CASE("supervisor: with hold_sigterm, a process's end_signal is held while it loads too") {
  Fixture f;
  const std::string script = says_whether_blocked(SIGUSR1);
  ProcessSpec relay = f.shell(0, script);
  relay.hold_sigterm = true;
  relay.end_signal = SIGUSR1;
  ProcessSpec rank = f.shell(1, script);
  rank.hold_sigterm = true;
  const auto result = supervise({relay, rank}, f.options);
  CHECK(result.ok());
  CHECK(f.lines["rank 0"] == std::vector<std::string>{"blocked"});
  CHECK(f.lines["rank 1"] == std::vector<std::string>{"open"});
}

namespace {
void ignore_in_test(int) {}
}  // namespace

TEST_CASE("supervisor: a SIGTERM sent as a process starts is not lost to the launcher's handler") {
  // The launcher catches SIGTERM; its child runs that handler until it resets it. One sent to
  // the child in that window (held open here for 300 ms) must still stop it, at once.
  struct sigaction mine {
  }, was{};
  mine.sa_handler = ignore_in_test;
  sigemptyset(&mine.sa_mask);
  ::sigaction(SIGTERM, &mine, &was);
  sigset_t mask_before, mask_after;
  ::pthread_sigmask(SIG_SETMASK, nullptr, &mask_before);
  {
    ScopedEnv pause("DPTRAIN_TEST_SPAWN_PAUSE_MS", "300");
    Fixture f;
    f.options.on_started = [](const std::vector<pid_t>& started) {
      for (pid_t p : started)
        ::kill(p, SIGTERM);
    };
    const auto t0 = std::chrono::steady_clock::now();
    const auto result = supervise({f.shell(0, "sleep 30")}, f.options);
    REQUIRE(result.failure);
    CHECK(result.failure->signal == SIGTERM);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(20));  // not the sleep
  }
  // The launcher's own mask is as it was.
  ::pthread_sigmask(SIG_SETMASK, nullptr, &mask_after);
  for (int sig : {SIGTERM, SIGINT, SIGCHLD})
    CHECK(sigismember(&mask_after, sig) == sigismember(&mask_before, sig));
  ::sigaction(SIGTERM, &was, nullptr);
}
