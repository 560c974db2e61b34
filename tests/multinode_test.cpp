// `dptrain launch --hosts` against the loopback sshd: 2 hosts x 2 slots, failures, containment.
#include <doctest/doctest.h>
#include <signal.h>

#include <fstream>
#include <sstream>

#include "tests/cluster.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct Cluster : TwoHostCluster {
  Cluster() : TwoHostCluster(2) {}
};

// Workers whose command line names this run (by its directory name), and their RANK.
std::map<int, pid_t> workers_of(const std::string& run_name) {
  std::map<int, pid_t> found;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string pid = e.path().filename();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string cmdline = read_text(e.path() / "cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    if (cmdline.find(" worker ") == std::string::npos ||
        cmdline.find(run_name) == std::string::npos) {
      continue;
    }
    std::istringstream env(read_text(e.path() / "environ"));
    for (std::string var; std::getline(env, var, '\0');) {
      if (var.rfind("RANK=", 0) == 0 && process_alive(std::stoi(pid))) {
        found[std::stoi(var.substr(5))] = std::stoi(pid);
      }
    }
  }
  return found;
}

json quick_recipe() {
  auto r = small_recipe();
  r["train"]["steps"] = 200;
  r["checkpoint"]["every"] = 50;
  return r;
}

}  // namespace

TEST_CASE("2 hosts x 2 slots train to the same parameters as 4 local ranks") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  auto local = run_dptrain({"launch", recipe.string(), "--nproc", "4", "--run-dir",
                            (c.tmp / "local").string(), "--json"});
  REQUIRE(local.exit_code == 0);
  // The way a user would: provision puts dptrain in ~/.dptrain/bin on each host, and launch
  // starts it from there (no --remote-binary).
  auto provisioned = run_dptrain({"provision", "--hosts", c.hostfile.string(), "--known-hosts",
                                  c.sshd.known_hosts().string()});
  REQUIRE(provisioned.exit_code == 0);
  auto args = c.launch_args(recipe, c.tmp / "remote");
  const auto flag = std::find(args.begin(), args.end(), "--remote-binary");
  args.erase(flag, flag + 2);
  auto remote = run_dptrain(args);
  INFO(remote.err, remote.out);
  REQUIRE(remote.exit_code == 0);
  const json result = parse_json(read_text(c.tmp / "remote/result.json"));
  CHECK(result["world_size"] == 4);
  CHECK(result["params_checksum"] == parse_json(local.out)["params_checksum"]);
  // Output came back prefixed with host and rank; every rank has a log in the launcher's run.
  CHECK(remote.out.find("run directory") != std::string::npos);
  for (int rank = 0; rank < 4; ++rank) {
    const std::string host = c.sshd.addresses()[rank < 2 ? 1 : 2];
    CAPTURE(rank);
    CHECK(fs::exists(c.tmp / "remote/logs" / (host + "-rank" + std::to_string(rank) + ".log")));
  }
  const json info = parse_json(read_text(c.tmp / "remote/run.json"));
  CHECK(info["status"] == "completed");
  CHECK(info["hosts"].size() == 2);
  CHECK(read_jsonl(c.tmp / "remote/metrics.jsonl").size() > 10);  // rank 0 was remote
  // The store secret never shows: not in the logs, run.json or output.
  for (const auto& e : fs::recursive_directory_iterator(c.tmp / "remote")) {
    if (e.is_regular_file())
      CHECK(read_text(e.path()).find("DPTRAIN_STORE_SECRET=") == std::string::npos);
  }
}

TEST_CASE("--dry-run --json prints the plan and starts nothing") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  auto args = c.launch_args(recipe, c.tmp / "dry");
  args.push_back("--dry-run");
  args.push_back("--json");
  auto r = run_dptrain(args);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json plan = parse_json(r.out);
  CHECK(plan["world_size"] == 4);
  REQUIRE(plan["hosts"].size() == 2);
  CHECK(plan["hosts"][0]["ranks"] == json({0, 1}));
  CHECK(plan["hosts"][1]["ranks"] == json({2, 3}));
  CHECK(plan["hosts"][0]["via"] == "ssh");
  CHECK(plan["hosts"][1]["workers"][1]["env"]["RANK"] == "3");
  CHECK(plan["hosts"][1]["workers"][1]["env"]["LOCAL_RANK"] == "1");
  CHECK(plan["hosts"][1]["workers"][1]["env"]["DPTRAIN_STORE_SECRET"] == "<redacted>");
  CHECK_FALSE(fs::exists(c.tmp / "dry"));
  auto table =
      run_dptrain({"launch", recipe.string(), "--hosts", c.hostfile.string(), "--dry-run"});
  CHECK(table.exit_code == 0);
  CHECK(table.out.find(c.sshd.addresses()[2]) != std::string::npos);
}

TEST_CASE("killing one remote worker tears down all 4 ranks and names it") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  auto args = c.launch_args(recipe, c.tmp / "killremote");
  Background launcher(args, {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "30"}});
  std::map<int, pid_t> workers;
  REQUIRE(eventually([&] {
    workers = workers_of("killremote");
    return workers.size() == 4 && fs::exists(c.tmp / "killremote/metrics.jsonl");
  }));
  REQUIRE(::kill(workers[3], SIGKILL) == 0);
  const int code = launcher.wait(std::chrono::seconds(60));
  const std::string err = launcher.err();
  INFO(err);
  CHECK(code == 3);
  CHECK(err.find("rank 3") != std::string::npos);
  CHECK(err.find(c.sshd.addresses()[2]) != std::string::npos);
  CHECK(err.find("SIGKILL") != std::string::npos);
  for (const auto& [rank, pid] : workers) {
    CAPTURE(rank);
    CHECK(eventually([pid] { return !process_alive(pid); }, std::chrono::seconds(15)));
  }
}

TEST_CASE("killing the launcher leaves no worker behind on any host") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  Background launcher(c.launch_args(recipe, c.tmp / "orphans"),
                      {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "30"}});
  std::map<int, pid_t> workers;
  REQUIRE(eventually([&] {
    workers = workers_of("orphans");
    return workers.size() == 4;
  }));
  REQUIRE(::kill(launcher.pid(), SIGKILL) == 0);
  launcher.wait(std::chrono::seconds(10));
  for (const auto& [rank, pid] : workers) {
    CAPTURE(rank);
    CHECK(eventually([pid] { return !process_alive(pid); }, std::chrono::seconds(20)));
  }
}

TEST_CASE("Ctrl-C stops every rank on every host and exits 130") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  Background launcher(c.launch_args(recipe, c.tmp / "ctrlc"),
                      {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "30"}});
  std::map<int, pid_t> workers;
  REQUIRE(eventually([&] {
    workers = workers_of("ctrlc");
    return workers.size() == 4;
  }));
  REQUIRE(::kill(launcher.pid(), SIGINT) == 0);
  CHECK(launcher.wait(std::chrono::seconds(60)) == 130);
  for (const auto& [rank, pid] : workers) {
    CAPTURE(rank);
    CHECK(eventually([pid] { return !process_alive(pid); }, std::chrono::seconds(15)));
  }
}

TEST_CASE("an unreachable host fails the launch with exit 4 naming it") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  write_text(c.tmp / "bad-hosts.txt",
             c.sshd.addresses()[1] + " slots=1 port=" + std::to_string(unused_port()) + "\n");
  auto r = run_dptrain({"launch", recipe.string(), "--hosts", (c.tmp / "bad-hosts.txt").string(),
                        "--known-hosts", c.sshd.known_hosts().string(), "--connect-timeout", "3",
                        "--run-dir", (c.tmp / "bad").string()});
  CHECK(r.exit_code == 4);
  CHECK(r.err.find(c.sshd.addresses()[1]) != std::string::npos);
}
