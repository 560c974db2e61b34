// Tests of the durable file helpers, on real files.
#include "core/fs.hpp"

#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <doctest/doctest.h>

#include <cerrno>
#include <chrono>
#include <csignal>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>

#include "core/error.hpp"
#include "core/trainer.hpp"
#include "tests/scoped_env.hpp"
#include "tests/temp_dir.hpp"

using namespace dptrain;
namespace fs = std::filesystem;

TEST_CASE("make_temp_directory: a new, private, empty directory each time; a bad TMPDIR named") {
  test::TempDir tmp;
  const ScopedEnv tmpdir("TMPDIR", tmp.path().string());
  // One that a killed process left behind with files in it is never handed out again.
  fs::create_directories(tmp / "stale-000000");
  std::ofstream(tmp / "stale-000000" / "left.bin") << "x";
  const fs::path a = make_temp_directory("stale");
  const fs::path b = make_temp_directory("stale");
  CHECK(a != b);
  for (const fs::path& d : {a, b}) {
    CAPTURE(d);
    CHECK(d.parent_path() == tmp.path());
    CHECK(d.filename().string().starts_with("stale-"));
    CHECK(fs::is_directory(d));
    CHECK(fs::is_empty(d));
    CHECK((fs::status(d).permissions() & fs::perms::all) == fs::perms::owner_all);
  }

  const std::string missing = (tmp / "no-such-folder").string();
  const ScopedEnv unusable("TMPDIR", missing);
  const std::string expected = missing + ": not a usable temporary folder";
  CHECK_THROWS_WITH_AS(make_temp_directory("x"), doctest::Contains(expected.c_str()), Error);
}

TEST_CASE("write_file_atomic: replaces the file whole; an error names it, not its temporary") {
  test::TempDir tmp;
  write_file_atomic(tmp / "a.json", "first");
  write_file_atomic(tmp / "a.json", "second");
  CHECK(read_file(tmp / "a.json") == "second");
  for (const auto& entry : fs::directory_iterator(tmp.path()))
    CHECK(entry.path().filename() == "a.json");  // no temporary left behind

  const fs::path nowhere = tmp / "no-such-dir" / "b.json";
  try {
    write_file_atomic(nowhere, "x");
    FAIL("wrote into a directory that does not exist");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::io);
    CHECK(std::string(e.what()) == nowhere.string() + ": cannot create: No such file or directory");
  }
}

TEST_CASE("append_line and truncate_metrics_after refuse a pipe instead of blocking on it") {
  test::TempDir tmp;
  const fs::path metrics = tmp / "metrics.jsonl";
  append_line(metrics, R"({"step": 1})");
  append_line(metrics, R"({"step": 2})");
  truncate_metrics_after(metrics, 1);
  CHECK(read_file(metrics) == "{\"step\": 1}\n");

  fs::remove(metrics);
  REQUIRE(::mkfifo(metrics.c_str(), 0644) == 0);
  const std::string expected =
      metrics.string() +
      ": is a pipe, not a regular file: dptrain writes this file itself; move "
      "it away";
  for (int i = 0; i < 2; ++i) {
    CAPTURE(i);
    try {
      if (i == 0) append_line(metrics, "{}");
      if (i == 1) truncate_metrics_after(metrics, 0);
      FAIL("used a pipe as the metrics file");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::io);
      CHECK(std::string(e.what()) == expected);
    }
  }
  fs::remove(metrics);
  fs::create_directory(metrics);
  CHECK_THROWS_WITH_AS(append_line(metrics, "{}"),
                       (metrics.string() + ": is a directory, not a regular file: dptrain writes "
                                           "this file itself; move it away")
                           .c_str(),
                       Error);
  // A symbolic link to a directory is named as one.
  const fs::path link = tmp / "linked.jsonl";
  fs::create_directory_symlink(metrics, link);
  CHECK_THROWS_WITH_AS(append_line(link, "{}"),
                       (link.string() + ": is a symbolic link to a directory, not a regular "
                                        "file: dptrain writes this file itself; move it away")
                           .c_str(),
                       Error);
}

TEST_CASE("require_open_files: refused past the soft limit, counting those open, naming both") {
  rlimit saved{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &saved) == 0);
  size_t open_now = 0;
  for (const auto& e : fs::directory_iterator("/proc/self/fd")) {
    (void)e;
    ++open_now;
  }
  rlimit lowered = saved;
  lowered.rlim_cur = open_now + 20;
  if (saved.rlim_max != RLIM_INFINITY && lowered.rlim_cur > saved.rlim_max) return;
  REQUIRE(::setrlimit(RLIMIT_NOFILE, &lowered) == 0);
  CHECK_NOTHROW(require_open_files(10, "ten"));
  std::string message;
  try {
    require_open_files(40, "4 rank(s) on this machine");
  } catch (const Error& e) {
    message = e.what();
    CHECK(e.kind() == ErrorKind::usage);
  }
  ::setrlimit(RLIMIT_NOFILE, &saved);
  CHECK(
      message.starts_with("4 rank(s) on this machine need about 40 open files here, more than "
                          "the " +
                          std::to_string(open_now + 20) + " this process may open"));
  CHECK(message.find("ulimit -n") != std::string::npos);
}

TEST_CASE("truncate_metrics_after keeps the steps up to the checkpoint's, passing over odd lines") {
  test::TempDir tmp;
  const fs::path metrics = tmp / "metrics.jsonl";
  write_file_atomic(metrics,
                    "{\"step\":1,\"loss\":2}\n{\"step\":\"x\",\"loss\":2}\n[1,2]\n{\"loss\":1}\n"
                    "{\"step\":2,\"loss\":1.5}\n{\"step\":3,\"loss\":1}\n{\"step\":4,\"lo");
  truncate_metrics_after(metrics, 2);
  CHECK(read_file(metrics) == "{\"step\":1,\"loss\":2}\n{\"step\":2,\"loss\":1.5}\n");
}

namespace {
int g_pretend_stop = 0;
int pretend_stop() {
  return g_pretend_stop;
}
}  // namespace

TEST_CASE("read_stoppable: a pipe is read to its end, and a stop ends a wait for a writer") {
  dptrain::test::TempDir dir;
  const auto fifo = dir / "recipe.fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  set_stop_check(&pretend_stop);
  // A writer that comes later: the read waits for it and takes all it writes.
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    std::ofstream(fifo) << std::string(100000, 'x');
  });
  std::string text;
  bool too_long = true;
  CHECK(read_stoppable(fifo, size_t{1} << 20, text, too_long) == 0);
  writer.join();
  CHECK(text == std::string(100000, 'x'));
  CHECK_FALSE(too_long);
  // A stop that came before the wait began (no signal arrives during it): EINTR, not a wait for
  // ever for a writer that never comes.
  g_pretend_stop = 15;
  text.clear();
  CHECK(read_stoppable(fifo, size_t{1} << 20, text, too_long) == -1);
  CHECK(errno == EINTR);
  g_pretend_stop = 0;
  set_stop_check(nullptr);
  // A regular file past the limit: too long, the rest left.
  write_file_atomic(dir / "big", std::string(5000, 'y'));
  CHECK(read_stoppable(dir / "big", 1000, text, too_long) == 0);
  CHECK(too_long);
}

TEST_CASE("resolved_path: absolute and normal, without a trailing separator") {
  test::TempDir tmp;
  fs::create_directories(tmp.path() / "runs" / "x");
  for (const char* given : {"runs/x", "runs/x/", "runs/x/.", "runs/./x//", "runs/y/../x"}) {
    CAPTURE(given);
    const fs::path p = resolved_path(tmp.path() / given);
    CHECK(p.filename() == "x");
    CHECK(p.is_absolute());
  }
  // Not made yet: the lexical form, as a name all the same.
  CHECK(resolved_path(tmp.path() / "runs" / "new" / "").filename() == "new");
  CHECK(resolved_path("/") == fs::path("/"));
}

TEST_CASE("named_path: the directory resolved, the last name kept, no trailing separator") {
  test::TempDir tmp;
  const fs::path base = resolved_path(tmp.path());
  fs::create_directories(base / "deep" / "target");
  fs::create_directories(base / "deep" / "other");
  fs::create_directory_symlink(base / "deep" / "target", base / "link");
  CHECK(named_path(base / "link" / ".") == base / "link");
  CHECK(named_path(base / "link" / "") == base / "link");
  CHECK(resolved_path(base / "link" / "").filename() == "target");
  // ".." after a link goes up from the link's target, as a read of the path would.
  CHECK(named_path(base / "link" / ".." / "other") == base / "deep" / "other");
  CHECK(named_path(base / "deep" / "target" / "..") == base / "deep");
  CHECK(named_path("/") == fs::path("/"));
}

TEST_CASE(
    "process_alive: this process and a running child are; a zombie and a reaped one are not") {
  CHECK(process_alive(::getpid()));
  CHECK_FALSE(process_alive(0));
  const pid_t sleeper = ::fork();
  REQUIRE(sleeper >= 0);
  if (sleeper == 0) {
    ::pause();
    ::_exit(0);
  }
  CHECK(process_alive(sleeper));
  ::kill(sleeper, SIGKILL);
  // Exited, not yet reaped: a zombie, which kill(pid, 0) still reaches.
  for (int i = 0; i < 200 && process_alive(sleeper); ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  CHECK(::kill(sleeper, 0) == 0);
  CHECK_FALSE(process_alive(sleeper));
  int status = 0;
  REQUIRE(::waitpid(sleeper, &status, 0) == sleeper);
  CHECK_FALSE(process_alive(sleeper));
}
