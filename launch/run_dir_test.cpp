// The run directory's lock as this process and another see it.
#include "launch/run_dir.hpp"

#include <doctest/doctest.h>
#include <sys/file.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <string>

#include "core/error.hpp"
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
  CHECK(resume_command("/runs/exp1") == "'dptrain resume /runs/exp1'");
  CHECK(resume_command("/runs/my run") == "dptrain resume '/runs/my run'");
  CHECK(resume_command("/runs/it's") == "dptrain resume '/runs/it'\\''s'");
  CHECK(resume_command("/runs/$HOME") == "dptrain resume '/runs/$HOME'");
}

TEST_CASE("recorded_remote_hosts: the hosts a resume goes on, as a hostfile gives them") {
  nlohmann::json info = {{"hosts", nlohmann::json::array({
                                       {{"host", "alice@10.0.0.1:2222"}, {"slots", 2}},
                                       {{"host", "[fd00::2]:2200"}, {"slots", 1}, {"key", "/k/id"}},
                                   })}};
  CHECK(recorded_host_lines(info) ==
        std::vector<std::string>{"10.0.0.1 slots=2 user=alice port=2222",
                                 "fd00::2 slots=1 port=2200 key=/k/id"});
  const auto hosts = recorded_remote_hosts(info, "/runs/a/run.json");
  REQUIRE(hosts.size() == 2);
  CHECK(hosts[0].host == "10.0.0.1");
  CHECK(hosts[0].user == "alice");
  CHECK(hosts[0].port == 2222);
  CHECK(hosts[0].slots == 2);
  CHECK(hosts[0].origin == "/runs/a/run.json");
  CHECK(hosts[1].host == "fd00::2");
  CHECK(hosts[1].key == "/k/id");
  // An elastic job's every candidate, not only the last generation's.
  info["job_hosts"] =
      nlohmann::json::array({{{"host", "node3"}, {"slots", 4}}, {{"host", "node4"}, {"slots", 4}}});
  CHECK(recorded_remote_hosts(info, "run.json").size() == 2);
  // A run on this machine alone records none.
  CHECK(recorded_remote_hosts({{"hosts", nlohmann::json::array({{{"host", "localhost"}}})}},
                              "run.json")
            .empty());
  // An edited record that is no host: one line naming run.json.
  info["job_hosts"][1]["slots"] = 0;
  try {
    recorded_remote_hosts(info, "/runs/a/run.json");
    FAIL("expected an error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::usage);
    CHECK(std::string(e.what()).rfind("/runs/a/run.json: recorded host 'node4 slots=0': ", 0) == 0);
  }
}
