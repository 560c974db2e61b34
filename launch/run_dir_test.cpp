// The run directory's lock as this process and another see it.
#include "launch/run_dir.hpp"

#include <doctest/doctest.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "tests/temp_dir.hpp"

using namespace dptrain;

namespace {

// Whether another process (util-linux's flock(1), on a file it opens itself) finds the lock of
// `dir` held.
bool held_as_another_sees_it(const std::filesystem::path& dir) {
  const std::string command =
      "flock --nonblock --conflict-exit-code 7 '" + (dir / ".lock").string() + "' true";
  const int status = std::system(command.c_str());
  REQUIRE(WIFEXITED(status));
  return WEXITSTATUS(status) == 7;
}

}  // namespace

TEST_CASE("run_locked_by_another: held by another process, never by this one's own lock") {
  test::TempDir tmp;
  CHECK_FALSE(run_locked_by_another(tmp.path()));  // no lock file: nothing to tell
  {
    const auto lock = try_lock_run(tmp.path());
    REQUIRE(lock != nullptr);
    // This process's own lock is not another's (a resume that probes the run it locked must
    // not find it driven by someone else).
    CHECK_FALSE(run_locked_by_another(tmp.path()));
    CHECK(held_as_another_sees_it(tmp.path()));
    // Nor does this process take it twice.
    CHECK(try_lock_run(tmp.path()) == nullptr);
    CHECK_FALSE(run_locked_by_another(tmp.path()));  // the refused try forgot nothing
  }
  // Released with the last copy: free for everyone.
  CHECK_FALSE(run_locked_by_another(tmp.path()));
  CHECK_FALSE(held_as_another_sees_it(tmp.path()));
}

TEST_CASE("resume_command: a command to paste, the directory quoted for the shell where needed") {
  const nlohmann::json local = nlohmann::json::object();
  CHECK(resume_command("/runs/exp1", local) == "'dptrain resume /runs/exp1'");
  CHECK(resume_command("/runs/my run", local) == "dptrain resume '/runs/my run'");
  CHECK(resume_command("/runs/it's", local) == "dptrain resume '/runs/it'\\''s'");
  CHECK(resume_command("/runs/$HOME", local) == "dptrain resume '/runs/$HOME'");
}
