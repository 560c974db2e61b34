// `dptrain data prepare` stopped part-way: SIGINT / SIGTERM remove its temporary dataset (exit 130
// / 143), the next prepare cleans up after a SIGKILLed one, and a terminal shows its progress.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include "core/data/tokens.hpp"
#include "tests/harness.hpp"
#include "tests/strings.hpp"
#include "tests/text_corpus.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// `mib` MiB of text: a seeded corpus repeated, written fast.
void write_big_text(const fs::path& path, int mib) {
  const std::string block = synthetic_text(11, 1 << 20);
  std::ofstream out(path, std::ios::binary);
  for (int i = 0; i < mib; ++i)
    out.write(block.data(), static_cast<std::streamsize>(block.size()));
  REQUIRE(out.good());
}

// The names in dir starting with `prefix`.
std::vector<std::string> entries_starting(const fs::path& dir, const std::string& prefix) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    const std::string name = e.path().filename().string();
    if (name.starts_with(prefix)) found.push_back(name);
  }
  return found;
}

// A prepare of `text` into `out`, caught (SIGSTOP) while its temporary `.NAME.tmp-PID` exists, and
// then sent `sig` (and SIGCONT). The text doubles until the prepare is slow enough to be caught
// in that window. Returns the prepare, already signalled.
std::unique_ptr<Background> prepare_caught_writing(const fs::path& dir, const fs::path& out,
                                                   int sig, std::vector<std::string> extra = {}) {
  for (int mib = 32; mib <= 512; mib *= 2) {
    const fs::path text = dir / "big.txt";
    write_big_text(text, mib);
    std::vector<std::string> args = {"data",        "prepare", "--text",
                                     text.string(), "--out",   out.string()};
    args.insert(args.end(), extra.begin(), extra.end());
    auto p = std::make_unique<Background>(args);
    const fs::path tmp =
        out.parent_path() / ("." + out.filename().string() + ".tmp-" + std::to_string(p->pid()));
    const auto deadline = Clock::now() + std::chrono::seconds(120);
    bool caught = false;
    while (Clock::now() < deadline && process_alive(p->pid())) {
      if (::access(tmp.c_str(), F_OK) == 0) {
        ::kill(p->pid(), SIGSTOP);
        // Still there once stopped: the prepare had not renamed it into place yet.
        caught = ::access(tmp.c_str(), F_OK) == 0 && process_alive(p->pid());
        if (!caught) ::kill(p->pid(), SIGCONT);
        break;
      }
    }
    if (caught) {
      ::kill(p->pid(), sig);
      ::kill(p->pid(), SIGCONT);
      return p;
    }
    INFO(p->err());
    REQUIRE(p->wait() == 0);  // too quick to catch: more text
    std::error_code ec;
    fs::remove_all(out, ec);
  }
  FAIL("a data prepare of 512 MiB of text was never caught while writing");
  return nullptr;
}

// Runs dptrain with stderr on a pseudo-terminal (stdout to a file); returns what the terminal got.
std::string stderr_on_terminal(const std::vector<std::string>& args, const fs::path& out_file,
                               int& exit_code) {
  int master = -1, slave = -1;
  REQUIRE(::openpty(&master, &slave, nullptr, nullptr, nullptr) == 0);
  std::vector<std::string> argv_s = {binary()};
  argv_s.insert(argv_s.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_s)
    argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    const int out = ::open(out_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(out, 1);
    ::dup2(slave, 2);
    ::close(master);
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ::close(slave);
  std::string got;
  char buf[4096];
  for (;;) {
    const ssize_t n = ::read(master, buf, sizeof buf);
    if (n > 0) {
      got.append(buf, static_cast<size_t>(n));
    } else if (n < 0 && errno == EINTR) {
      continue;
    } else {
      break;  // EIO: the last holder of the terminal closed it
    }
  }
  ::close(master);
  int status = 0;
  ::waitpid(pid, &status, 0);
  exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  return got;
}

void check_stopped(Background& p, int expected_code, const std::string& signal_name) {
  const int code = p.wait(std::chrono::seconds(120));
  const std::string err = p.err();
  INFO(err);
  CHECK(code == expected_code);
  CHECK(p.out().empty());
  const auto lines = lines_of(err);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].starts_with("dptrain: error: data prepare stopped by " + signal_name +
                             ": nothing was written"));
}

}  // namespace

TEST_CASE("data prepare: SIGINT while writing removes the temporary dataset and exits 130") {
  TempDir tmp;
  const fs::path out = tmp / "sets/ds";
  fs::create_directories(out.parent_path());
  auto p = prepare_caught_writing(tmp.path(), out, SIGINT);
  check_stopped(*p, 130, "SIGINT");
  CHECK(contains(p->err(), out.string() + " was not made"));
  CHECK(fs::is_empty(out.parent_path()));  // no dataset, no .ds.tmp-PID
}

TEST_CASE("data prepare --force: SIGTERM while writing keeps the old dataset and exits 143") {
  TempDir tmp;
  const fs::path out = tmp / "sets/ds";
  write_text(tmp / "small.txt", synthetic_text(12, 5000));
  auto first = run_dptrain(
      {"data", "prepare", "--text", (tmp / "small.txt").string(), "--out", out.string()});
  REQUIRE(first.exit_code == 0);
  const std::string before = read_text(out / "train.bin");

  auto p = prepare_caught_writing(tmp.path(), out, SIGTERM, {"--force"});
  check_stopped(*p, 143, "SIGTERM");
  CHECK(contains(p->err(), out.string() + " is as it was"));
  CHECK(read_text(out / "train.bin") == before);
  CHECK(dptrain::read_token_file(out / "train.bin").tokens.size() == 4500);
  CHECK(entries_starting(out.parent_path(), "") == std::vector<std::string>{"ds"});
}

TEST_CASE("data prepare: SIGINT while it waits to read a pipe stops it at once, exit 130") {
  TempDir tmp;
  const fs::path fifo = tmp / "text.fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  Background p({"data", "prepare", "--text", fifo.string(), "--out", (tmp / "ds").string()});
  // Keep a writer open so the prepare blocks in read(), not in open() (which a signal also ends).
  const int writer = ::open(fifo.c_str(), O_WRONLY);
  REQUIRE(writer >= 0);
  const std::string some = "some text that never ends\n";
  REQUIRE(::write(writer, some.data(), some.size()) == static_cast<ssize_t>(some.size()));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  REQUIRE(process_alive(p.pid()));
  ::kill(p.pid(), SIGINT);
  check_stopped(p, 130, "SIGINT");
  ::close(writer);
  CHECK_FALSE(fs::exists(tmp / "ds"));
  CHECK(entries_starting(tmp.path(), ".ds").empty());
}

TEST_CASE("data prepare: SIGTERM while it waits for a pipe's writer stops it, exit 143") {
  TempDir tmp;
  const fs::path fifo = tmp / "text.fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  // No writer: the prepare waits in open().
  Background p({"data", "prepare", "--text", fifo.string(), "--out", (tmp / "ds").string()});
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  REQUIRE(process_alive(p.pid()));
  ::kill(p.pid(), SIGTERM);
  check_stopped(p, 143, "SIGTERM");
  CHECK_FALSE(fs::exists(tmp / "ds"));
}

TEST_CASE("data prepare refuses a text file that changes while it is read") {
  TempDir tmp;
  const fs::path text = tmp / "growing.txt";
  write_big_text(text, 64);
  // A writer appends to it all the while (a log still being written, a download not done).
  std::atomic<bool> done{false};
  std::atomic<int64_t> appended{0};
  std::thread writer([&] {
    const int fd = ::open(text.c_str(), O_WRONLY | O_APPEND | O_CLOEXEC);
    while (fd >= 0 && !done.load()) {
      if (::write(fd, "x", 1) == 1) ++appended;
    }
    if (fd >= 0) ::close(fd);
  });
  REQUIRE(eventually([&] { return appended.load() > 0; }));
  auto r =
      run_dptrain({"data", "prepare", "--text", text.string(), "--out", (tmp / "ds").string()});
  done = true;
  writer.join();
  INFO(r.err);
  CHECK(r.exit_code == 2);
  CHECK(r.err.starts_with("dptrain: error: " + text.string() + ": changed while it was read ("));
  CHECK(contains(r.err, "; prepare it once nothing writes to it\n"));
  CHECK_FALSE(fs::exists(tmp / "ds"));
  CHECK(entries_starting(tmp.path(), ".ds").empty());
}

TEST_CASE("data prepare cleans up after a prepare that was killed with SIGKILL") {
  TempDir tmp;
  const fs::path out = tmp / "sets/ds";
  fs::create_directories(out.parent_path());
  auto killed = prepare_caught_writing(tmp.path(), out, SIGKILL);
  CHECK(killed->wait() == 128 + SIGKILL);
  const std::string stale = ".ds.tmp-" + std::to_string(killed->pid());
  REQUIRE(entries_starting(out.parent_path(), ".ds.tmp-") == std::vector<std::string>{stale});

  // A temporary of a prepare still running (this process stands in for it) is not touched.
  const std::string running = ".ds.tmp-" + std::to_string(::getpid());
  fs::create_directories(out.parent_path() / running);
  write_text(tmp / "small.txt", synthetic_text(13, 3000));
  auto r = run_dptrain(
      {"data", "prepare", "--text", (tmp / "small.txt").string(), "--out", out.string(), "--json"});
  INFO(r.err);
  CHECK(r.exit_code == 0);
  const std::string removed = "removed " + (out.parent_path() / stale).string() +
                              ": left by a data prepare (pid " + std::to_string(killed->pid()) +
                              ") that was killed";
  CHECK(r.err == "dptrain: warning: " + removed + "\n");
  // A script reads it too.
  CHECK(parse_json(r.out)["warnings"] == nlohmann::json::array({removed}));
  CHECK(dptrain::read_token_file(out / "train.bin").tokens.size() == 2700);
  std::vector<std::string> left = entries_starting(out.parent_path(), "");
  std::sort(left.begin(), left.end());
  CHECK(left == std::vector<std::string>{running, "ds"});
}

TEST_CASE("data prepare puts back the dataset a killed --force prepare was replacing") {
  TempDir tmp;
  write_text(tmp / "small.txt", synthetic_text(14, 3000));
  write_text(tmp / "other.txt", synthetic_text(15, 2000));
  const fs::path out = tmp / "ds";
  REQUIRE(run_dptrain(
              {"data", "prepare", "--text", (tmp / "small.txt").string(), "--out", out.string()})
              .exit_code == 0);
  // A --force prepare killed between its two renames: the old dataset set aside, no new one yet.
  // Its pid: a child that has exited and been reaped.
  const pid_t gone = gone_pid();
  const fs::path old = tmp / (".ds.old-" + std::to_string(gone));
  fs::rename(out, old);
  fs::create_directories(tmp / (".ds.tmp-" + std::to_string(gone)));

  // Put back, so a prepare without --force refuses to replace it, and it is intact.
  auto r = run_dptrain(
      {"data", "prepare", "--text", (tmp / "other.txt").string(), "--out", out.string()});
  INFO(r.err);
  CHECK(r.exit_code == 2);
  CHECK(contains(r.err, "put back " + out.string() + " from " + old.string()));
  CHECK(contains(r.err, "exists and is not empty (use --force to replace it)"));
  CHECK(dptrain::read_token_file(out / "train.bin").tokens.size() == 2700);
  CHECK(entries_starting(tmp.path(), ".ds").empty());
}

TEST_CASE("data prepare shows its progress on a terminal; in a pipe, lines for slow parts only") {
  TempDir tmp;
  write_big_text(tmp / "big.txt", 24);
  int code = -1;
  const std::string terminal = stderr_on_terminal(
      {"data", "prepare", "--text", (tmp / "big.txt").string(), "--out", (tmp / "ds").string()},
      tmp / "out.txt", code);
  INFO(terminal);
  CHECK(code == 0);
  CHECK(contains(terminal, "\r\033[Kreading big.txt: "));
  CHECK(contains(terminal, " of 24.0 MiB"));
  CHECK(contains(terminal, "\r\033[Ktokenizing: "));
  CHECK(contains(terminal, "\r\033[Kwriting train.bin: "));
  CHECK(contains(terminal, " tokens ("));
  CHECK(terminal.ends_with("\r\033[K"));  // erased before the summary
  CHECK(contains(read_text(tmp / "out.txt"), "tokens        25165824\n"));

  auto piped = run_dptrain(
      {"data", "prepare", "--text", (tmp / "big.txt").string(), "--out", (tmp / "ds2").string()});
  CHECK(piped.exit_code == 0);
  // Plain lines only (none at all unless a part of the work took 5 s: a loaded machine).
  CHECK_FALSE(contains(piped.err, "\r"));
  CHECK_FALSE(contains(piped.err, "\033"));
  for (const std::string& line : lines_of(piped.err))
    CHECK(contains(line, " of "));
  CHECK(contains(piped.out, "tokens        25165824\n"));

  // A file name's control bytes reach the terminal escaped (a colour code would stay on).
  const fs::path odd = tmp / "a\033[31mred\nb.txt";
  fs::copy_file(tmp / "big.txt", odd);
  const std::string shown = stderr_on_terminal(
      {"data", "prepare", "--text", odd.string(), "--out", (tmp / "ds3").string()},
      tmp / "out3.txt", code);
  INFO(shown);
  CHECK(code == 0);
  CHECK(contains(shown, "\r\033[Kreading a\\x1b[31mred\\x0ab.txt: "));
  CHECK_FALSE(contains(shown, "\033[31m"));

  // A part that goes on for a while (a pipe's writer that pauses) gets a plain line in a pipe.
  const fs::path fifo = tmp / "slow.fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  Background slow({"data", "prepare", "--text", fifo.string(), "--out", (tmp / "ds4").string()});
  const int writer = ::open(fifo.c_str(), O_WRONLY);
  REQUIRE(writer >= 0);
  const std::string some = "text that comes slowly\n";
  REQUIRE(::write(writer, some.data(), some.size()) == static_cast<ssize_t>(some.size()));
  std::this_thread::sleep_for(std::chrono::milliseconds(6500));
  REQUIRE(::write(writer, some.data(), some.size()) == static_cast<ssize_t>(some.size()));
  ::close(writer);
  CHECK(slow.wait(std::chrono::seconds(60)) == 0);
  INFO(slow.err());
  CHECK(slow.err().starts_with("reading slow.fifo: 46 B of 46 B (100%)\n"));
  CHECK_FALSE(contains(slow.err(), "\r"));
  CHECK_FALSE(contains(slow.err(), "\033"));
}
