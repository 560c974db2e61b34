// `dptrain launch --hosts` against the loopback sshd: 2 hosts x 2 slots, failures, containment.
#include <doctest/doctest.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <optional>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "core/comm/communicator.hpp"
#include "launch/agent.hpp"
#include "launch/supervisor.hpp"
#include "tests/cluster.hpp"
#include "tests/damage.hpp"
#include "tests/frozen_join.hpp"
#include "tests/strings.hpp"
#include "tests/text_corpus.hpp"

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

// The environment of a running process.
std::map<std::string, std::string> environ_of(pid_t pid) {
  std::map<std::string, std::string> env;
  std::istringstream text(read_text(fs::path("/proc") / std::to_string(pid) / "environ"));
  for (std::string var; std::getline(text, var, '\0');) {
    const auto eq = var.find('=');
    if (eq != std::string::npos) env[var.substr(0, eq)] = var.substr(eq + 1);
  }
  return env;
}

json quick_recipe() {
  auto r = small_recipe();
  r["train"]["steps"] = 200;
  r["checkpoint"]["every"] = 50;
  return r;
}

// The agent that runs a remote worker: its parent (a host's ranks are its agent's children).
pid_t agent_of(pid_t worker) {
  std::ifstream stat("/proc/" + std::to_string(worker) + "/stat");
  std::string pid, name, state;
  pid_t parent = 0;
  stat >> pid >> name >> state >> parent;
  return parent;
}

// The quick recipe launched across the cluster into c.tmp/NAME, each step slowed (30 ms) so that
// a test can act mid-run: its 4 workers by rank once they all run (and, with `stepping`, have
// logged a step).
std::map<int, pid_t> start_slowed(Cluster& c, const std::string& name,
                                  std::optional<Background>& launcher, bool stepping,
                                  const std::vector<std::string>& extra = {}) {
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  auto args = c.launch_args(recipe, c.tmp / name);
  args.insert(args.end(), extra.begin(), extra.end());
  args.push_back("--json");
  launcher.emplace(args, Env{{"DPTRAIN_DEBUG_STEP_DELAY_MS", "30"}});
  std::map<int, pid_t> workers;
  REQUIRE(eventually([&] {
    workers = workers_of(name);
    return workers.size() == 4 && (!stepping || fs::exists(c.tmp / name / "metrics.jsonl"));
  }));
  return workers;
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
  args.push_back("--json");
  auto remote = run_dptrain(args);
  INFO(remote.err, remote.out);
  REQUIRE(remote.exit_code == 0);
  // Rank 0's newest checkpoint lies on the first host, and the launch's output says so.
  const json out = parse_json(remote.out);
  CHECK(out["last_checkpoint"].get<std::string>().ends_with("/checkpoints/step-000200"));
  CHECK(out["last_checkpoint_host"] == c.sshd.host(c.sshd.addresses()[1]).display());
  const json result = parse_json(read_text(c.tmp / "remote/result.json"));
  CHECK(result["world_size"] == 4);
  CHECK(result["params_checksum"] == parse_json(local.out)["params_checksum"]);
  // Output came back prefixed with host and rank; every rank has a log in the launcher's run.
  CHECK(remote.err.find("run directory") != std::string::npos);
  for (int rank = 0; rank < 4; ++rank) {
    const std::string host = c.sshd.addresses()[rank < 2 ? 1 : 2];
    CAPTURE(rank);
    CHECK(fs::exists(c.tmp / "remote/logs" / (host + "-rank" + std::to_string(rank) + ".log")));
  }
  const json info = parse_json(read_text(c.tmp / "remote/run.json"));
  CHECK(info["status"] == "completed");
  CHECK(info["hosts"].size() == 2);
  CHECK(read_jsonl(c.tmp / "remote/metrics.jsonl").size() > 10);  // rank 0 was remote
  // Rank 0's checkpoints are on the first host: status names the last one from run.json.
  auto status = run_dptrain({"status", (c.tmp / "remote").string(), "--json"});
  REQUIRE(status.exit_code == 0);
  const json s = parse_json(status.out);
  CHECK(s["last_checkpoint_host"] == c.sshd.host(c.sshd.addresses()[1]).display());
  CHECK(s["last_checkpoint"].get<std::string>().ends_with("/checkpoints/step-000200"));
  // The store secret never shows: not in the logs, run.json or output.
  for (const auto& e : fs::recursive_directory_iterator(c.tmp / "remote")) {
    if (e.is_regular_file())
      CHECK(read_text(e.path()).find("DPTRAIN_STORE_SECRET=") == std::string::npos);
  }
}

// launch of quick_recipe() into `run_dir` (with `extra` arguments), failed by rank 1's crash at
// `step` (exit 3).
CommandResult crashed_launch(const Cluster& c, const fs::path& run_dir, int step,
                             const std::vector<std::string>& extra = {}) {
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  auto args = c.launch_args(recipe, run_dir);
  args.insert(args.end(), extra.begin(), extra.end());
  auto failed = run_dptrain(args, {{"DPTRAIN_FAULT", fmt::format("crash@step={},rank=1", step)}});
  INFO(failed.err);
  REQUIRE(failed.exit_code == 3);
  return failed;
}

TEST_CASE("a multi-host run that failed before its first checkpoint resumes from step 0") {
  Cluster c;
  const fs::path run_dir = c.tmp / "early";
  // The second host is reached with --identity (its line has no key=): the resume below reaches
  // it only if the launch recorded that file.
  const std::string first = lines_of(read_text(c.hostfile))[0];
  const std::string second = lines_of(read_text(c.hostfile))[1];
  REQUIRE(contains(second, " key="));
  write_text(c.hostfile, first + "\n" + second.substr(0, second.find(" key=")) + "\n");
  const auto failed =
      crashed_launch(c, run_dir, 5, {"--identity", fs::relative(c.sshd.client_key()).string()});
  // The host named as the hostfile gives it (several may share an address).
  CHECK(contains(failed.err, " on host " + c.sshd.host(c.sshd.addresses()[1]).display()));
  // How to continue it: the run alone. It recorded its hosts (with the key each was reached
  // with) and the SSH files its launch used, and a resume goes on on them.
  const std::string how = fmt::format("'dptrain resume {}'", run_dir.string());
  CHECK_MESSAGE(failed.err.find("(continue with " + how + ")") != std::string::npos, failed.err);
  const json status = parse_json(run_dptrain({"status", run_dir.string(), "--json"}).out);
  CHECK(status["hint"] == "continue it with " + how);
  const json launched = parse_json(read_text(run_dir / "run.json"));
  CHECK(launched["remote"]["known_hosts"] == c.sshd.known_hosts().string());
  CHECK(launched["hosts"][0]["key"] == c.sshd.client_key().string());
  CHECK_FALSE(launched["hosts"][1].contains("key"));
  CHECK(launched["remote"]["identities"] == json::array({c.sshd.client_key().string()}));
  auto resumed = run_dptrain({"resume", run_dir.string(), "--json"});
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  CHECK(parse_json(resumed.out)["step"] == 200);
  CHECK(contains(resumed.err, "on 4 rank(s) on 2 host(s), the hosts run.json records"));
  const json info = parse_json(read_text(run_dir / "run.json"));
  CHECK(info["status"] == "completed");
  CHECK(info["generations"].back()["resumed_from"] == "step 0");
}

TEST_CASE("resume reaches the hosts through the workdir and binary the launch used") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  const fs::path run_dir = c.tmp / "elsewhere";
  const fs::path workdir = c.tmp / "remote work";
  auto args = c.launch_args(recipe, run_dir);
  args.insert(args.end(), {"--workdir", workdir.string()});
  auto failed = run_dptrain(args, {{"DPTRAIN_FAULT", "crash@step=60,rank=1"}});
  INFO(failed.err);
  REQUIRE(failed.exit_code == 3);
  const json info = parse_json(read_text(run_dir / "run.json"));
  CHECK(info["remote"]["workdir"] == workdir.string());
  CHECK(info["remote"]["remote_binary"] == binary());
  REQUIRE(info["last_checkpoint"]["step"] == 50);
  // A resume whose ranks never got together (a mistyped --workdir: no checkpoint there) leaves
  // the record of how the job is reached as it was: the next resume defaults to what last ran.
  const fs::path typo = c.tmp / "remote typo";
  auto mistyped =
      run_dptrain({"resume", run_dir.string(), "--hosts", c.hostfile.string(), "--known-hosts",
                   c.sshd.known_hosts().string(), "--workdir", typo.string(), "--nnodes", "2"});
  CHECK(mistyped.exit_code == 5);
  // Every rank finds none and says where rank 0 looked, whichever the launcher names.
  CHECK_MESSAGE(contains(mistyped.err,
                         "no valid checkpoint on any node of this run (4 rank(s); "
                         "rank 0 looked in "),
                mistyped.err);
  CHECK_MESSAGE(contains(mistyped.err, " looked in " + typo.string()), mistyped.err);
  const json kept = parse_json(read_text(run_dir / "run.json"));
  CHECK(kept["remote"] == info["remote"]);
  CHECK(kept["hosts"] == info["hosts"]);
  // (--nnodes made it choose among its hosts: that choice is not where a resume goes now.)
  CHECK(kept.value("job_hosts", json()) == info.value("job_hosts", json()));
  CHECK(kept["generations"].size() == info["generations"].size() + 1);  // its try is history
  // Nothing again: the hosts, SSH files, workdir and binary are the launch's; the checkpoint is
  // under the launch's workdir, and no dptrain was provisioned to the default one.
  auto resumed = run_dptrain({"resume", run_dir.string(), "--json"});
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  const json out = parse_json(resumed.out);
  CHECK(out["step"] == 200);
  const json after = parse_json(read_text(run_dir / "run.json"));
  CHECK(after["generations"].back()["resumed_from"] == "step-000050");
  CHECK(after["hosts"][0]["run_dir"].get<std::string>().starts_with(workdir.string()));
}

TEST_CASE("a remote rank's warnings are the launcher's: on stderr and in --json's warnings") {
  Cluster c;
  const fs::path run_dir = c.tmp / "damaged";
  crashed_launch(c, run_dir, 110);
  // step-000100 damaged on both nodes: the ranks pass over it, rank 0 saying so.
  for (const std::string& address : {c.sshd.addresses()[1], c.sshd.addresses()[2]}) {
    const fs::path copy = c.remote_run(address, run_dir) / "checkpoints" / "step-000100";
    REQUIRE(fs::exists(copy / "params.bin"));
    flip_byte(copy / "params.bin", 8);
  }
  const auto resumed = run_dptrain(c.resume_args(run_dir));
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  const json out = parse_json(resumed.out);
  CHECK(out["resumed_from"] == "step-000050");
  bool warned = false;
  for (const auto& w : out["warnings"]) {
    const std::string text = w.get<std::string>();
    if (!text.starts_with("skipping checkpoint step-000100: ")) continue;
    warned = true;
    CHECK(contains(resumed.err, "dptrain: warning: " + text + "\n"));
  }
  CHECK_MESSAGE(warned, out["warnings"].dump());
}

TEST_CASE("--dry-run --json prints the plan and starts nothing") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  auto args = c.launch_args(recipe, c.tmp / "dry");
  args.insert(args.end(), {"--dry-run", "--json", "--env", "MKL_NUM_THREADS=3", "--env",
                           "DPTRAIN_TEST_TOKEN", "--env", "NCCL_SOCKET_IFNAME=lo"});
  // The BLAS settings go to remote ranks with the job (local ones inherit them): every rank
  // picks the same kernels. Other variables stay here unless --env names them; --env wins, and
  // a value it takes from here is not shown.
  auto r = run_dptrain(args, {{"OPENBLAS_CORETYPE", "Haswell"},
                              {"OMP_NUM_THREADS", "1"},
                              {"MKL_NUM_THREADS", "1"},
                              {"UNRELATED_SETTING", "1"},
                              {"NCCL_SOCKET_IFNAME", "eth0"},
                              {"DPTRAIN_TEST_TOKEN", "s3cret"}});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("s3cret") == std::string::npos);
  const json plan = parse_json(r.out);
  for (const auto& host : plan["hosts"]) {
    const json& env = host["workers"][0]["env"];
    CHECK(env["OPENBLAS_CORETYPE"] == "Haswell");
    CHECK(env["OMP_NUM_THREADS"] == "1");
    CHECK(env["MKL_NUM_THREADS"] == "3");
    CHECK(env["NCCL_SOCKET_IFNAME"] == "lo");
    CHECK(env["DPTRAIN_TEST_TOKEN"] == "<redacted>");
    CHECK_FALSE(env.contains("UNRELATED_SETTING"));
  }
  CHECK(plan["world_size"] == 4);
  REQUIRE(plan["hosts"].size() == 2);
  CHECK(plan["hosts"][0]["ranks"] == json({0, 1}));
  CHECK(plan["hosts"][1]["ranks"] == json({2, 3}));
  CHECK(plan["hosts"][0]["via"] == "ssh");
  // The exact command: with the hostfile's key and --known-hosts, the remote command as sent.
  const json& command = plan["hosts"][0]["command"];
  CHECK(command.front() == "ssh");
  CHECK(command.back() == binary() + " agent");
  const auto has_pair = [&command](const std::string& flag, const std::string& value) {
    for (size_t i = 0; i + 1 < command.size(); ++i) {
      if (command[i] == flag && command[i + 1] == value) return true;
    }
    return false;
  };
  CHECK(has_pair("-i", c.sshd.client_key().string()));
  CHECK(has_pair("-o", "UserKnownHostsFile=" + c.sshd.known_hosts().string()));
  CHECK(has_pair("-o", "StrictHostKeyChecking=yes"));  // the launcher refuses unknown keys
  CHECK(has_pair("-o", "BatchMode=yes"));              // and never prompts
  // The default binary, and --identity after the hostfile's key=: as the launcher tries them.
  auto defaults = c.launch_args(recipe, c.tmp / "dry");
  const auto binary_flag = std::find(defaults.begin(), defaults.end(), "--remote-binary");
  REQUIRE(binary_flag != defaults.end());
  defaults.erase(binary_flag, binary_flag + 2);
  fs::copy_file(c.sshd.client_key(), c.tmp / "other_key");
  // Relative (to this test's directory): shown absolute, a command that runs from anywhere, and
  // without the "../" the relative path climbed with.
  defaults.insert(defaults.end(),
                  {"--identity", fs::relative(c.tmp / "other_key").string(), "--dry-run"});
  auto as_run = run_dptrain(defaults);
  INFO(as_run.err);
  REQUIRE(as_run.exit_code == 0);
  // The table's command line runs in a shell as it is: the host's $HOME, quoted for this one.
  CHECK_MESSAGE(contains(as_run.out, "-i " + c.sshd.client_key().string() + " -i " +
                                         (c.tmp / "other_key").string() + " "),
                as_run.out);
  CHECK_MESSAGE(contains(as_run.out, " '\"$HOME\"/.dptrain/bin/dptrain agent'"), as_run.out);
  CHECK(plan["hosts"][1]["workers"][1]["env"]["RANK"] == "3");
  CHECK(plan["hosts"][1]["workers"][1]["env"]["LOCAL_RANK"] == "1");
  CHECK(plan["hosts"][1]["workers"][1]["env"]["DPTRAIN_STORE_SECRET"] == "<redacted>");
  // A host's run directory is named after --run-dir's, as the launch names it.
  CHECK(plan["hosts"][1]["run_dir"] == "~/.dptrain/runs/dry-<id>");
  CHECK_FALSE(fs::exists(c.tmp / "dry"));
  auto slash = c.launch_args(recipe, (c.tmp / "dry").string() + "/");
  slash.insert(slash.end(), {"--dry-run", "--json"});
  const auto slashed = run_dptrain(slash);
  REQUIRE(slashed.exit_code == 0);
  CHECK(parse_json(slashed.out)["hosts"][1]["run_dir"] == "~/.dptrain/runs/dry-<id>");
  auto table =
      run_dptrain({"launch", recipe.string(), "--hosts", c.hostfile.string(), "--dry-run"});
  CHECK(table.exit_code == 0);
  CHECK(table.out.find(c.sshd.addresses()[2]) != std::string::npos);
}

TEST_CASE("--env reaches every rank on every host, and resume gives it again") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  const fs::path run_dir = c.tmp / "passes-env";
  // The ranks of a running job, each with its environment, once all 4 have started.
  const auto rank_envs = [](const std::string& run_name) {
    std::map<int, std::map<std::string, std::string>> envs;
    REQUIRE(eventually([&] {
      const auto workers = workers_of(run_name);
      envs.clear();
      for (const auto& [rank, pid] : workers)
        envs[rank] = environ_of(pid);
      return envs.size() == 4;
    }));
    return envs;
  };
  auto args = c.launch_args(recipe, run_dir);
  args.insert(args.end(), {"--env", "DPTRAIN_TEST_SETTING=a b=c", "--env", "DPTRAIN_TEST_KEPT=1",
                           "--env", "DPTRAIN_TEST_TOKEN"});
  {
    Background launcher(args,
                        {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "30"}, {"DPTRAIN_TEST_TOKEN", "s3cret"}});
    for (const auto& [rank, env] : rank_envs("passes-env")) {
      CAPTURE(rank);
      CHECK(env.at("DPTRAIN_TEST_SETTING") == "a b=c");
      CHECK(env.at("DPTRAIN_TEST_KEPT") == "1");
      CHECK(env.at("DPTRAIN_TEST_TOKEN") == "s3cret");
    }
    REQUIRE(::kill(launcher.pid(), SIGINT) == 0);
    REQUIRE(launcher.wait(std::chrono::seconds(60)) == 130);
  }
  // The agents stop their ranks once the launcher has gone: none is left to be taken for one of
  // the resumed run's.
  REQUIRE(eventually([] { return workers_of("passes-env").empty(); }, std::chrono::seconds(15)));
  // run.json keeps what resume needs, and not the value taken from the launcher's environment.
  const std::string recorded = read_text(run_dir / "run.json");
  CHECK(recorded.find("s3cret") == std::string::npos);
  CHECK(parse_json(recorded)["env"] == json({{"DPTRAIN_TEST_SETTING", "a b=c"},
                                             {"DPTRAIN_TEST_KEPT", "1"},
                                             {"DPTRAIN_TEST_TOKEN", nullptr}}));
  std::vector<std::string> resume = {"resume",        run_dir.string(),
                                     "--hosts",       c.hostfile.string(),
                                     "--known-hosts", c.sshd.known_hosts().string()};
  // Where the launch took a value from its environment, resume needs it there too.
  auto refused = run_dptrain(resume);
  CHECK(refused.exit_code == 2);
  CHECK_MESSAGE(refused.err.find("the launch passed DPTRAIN_TEST_TOKEN from its environment "
                                 "(--env DPTRAIN_TEST_TOKEN), but DPTRAIN_TEST_TOKEN is not set") !=
                    std::string::npos,
                refused.err);
  CHECK(read_text(run_dir / "run.json") == recorded);
  resume.insert(resume.end(), {"--env", "DPTRAIN_TEST_SETTING=changed"});
  Background resumed(resume,
                     {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "30"}, {"DPTRAIN_TEST_TOKEN", "again"}});
  for (const auto& [rank, env] : rank_envs("passes-env")) {
    CAPTURE(rank);
    CHECK(env.at("DPTRAIN_TEST_SETTING") == "changed");
    CHECK(env.at("DPTRAIN_TEST_KEPT") == "1");
    CHECK(env.at("DPTRAIN_TEST_TOKEN") == "again");
  }
  // Once its ranks met, the resume's settings are the run's (a resume stopped before leaves the
  // record as it was).
  REQUIRE(eventually([&] {
    return parse_json(read_text(run_dir / "run.json"))["generations"].back().contains("met_at");
  }));
  REQUIRE(::kill(resumed.pid(), SIGINT) == 0);
  CHECK(resumed.wait(std::chrono::seconds(60)) == 130);
  CHECK(parse_json(read_text(run_dir / "run.json"))["env"]["DPTRAIN_TEST_SETTING"] == "changed");
}

// The parent of a process, from /proc.
pid_t parent_of(pid_t pid) {
  std::istringstream stat(read_text(fs::path("/proc") / std::to_string(pid) / "stat"));
  std::string field;
  for (int i = 0; i < 4 && stat >> field; ++i) {
  }
  return static_cast<pid_t>(std::stol(field));
}

std::string comm_of(pid_t pid) {
  std::string comm = read_text(fs::path("/proc") / std::to_string(pid) / "comm");
  return comm.substr(0, comm.find('\n'));
}

// The SSH server process of the connection that serves a remote worker's host: up from the
// worker, past its agent.
pid_t sshd_serving(pid_t worker) {
  pid_t sshd = worker;
  while (sshd > 1 && comm_of(sshd) != "sshd")
    sshd = parent_of(sshd);
  REQUIRE(sshd > 1);
  return sshd;
}

TEST_CASE("a host that stops answering (its sshd frozen) is lost within 3 keepalives, named") {
  Cluster c;
  std::optional<Background> launcher;
  const auto workers = start_slowed(c, "frozen", launcher, false, {"--ssh-keepalive", "1"});
  const pid_t sshd = sshd_serving(workers.at(2));
  REQUIRE(::kill(sshd, SIGSTOP) == 0);
  const int code = launcher->wait(std::chrono::seconds(60));
  ::kill(sshd, SIGCONT);
  INFO(launcher->err());
  CHECK(code == 3);
  const std::string error = parse_json(launcher->out())["error"];
  CHECK(error.find(c.sshd.addresses()[2]) != std::string::npos);
  CHECK(error.find(c.sshd.host(c.sshd.addresses()[2]).display() +
                   " (ranks 2-3) has not answered for 3 s") != std::string::npos);
  CHECK(contains(error, ": the host, its SSH server or the network is stuck"));
  // Once the server answers again, the connection's end stops that host's ranks too.
  for (const auto& [rank, pid] : workers) {
    CAPTURE(rank);
    CHECK(eventually([pid] { return !process_alive(pid); }, std::chrono::seconds(20)));
  }
}

TEST_CASE("a host whose agent freezes is lost, and its agent is killed there (a root login too)") {
  Cluster c;
  std::optional<Background> launcher;
  const auto workers = start_slowed(c, "stopped", launcher, false, {"--ssh-keepalive", "1"});
  const pid_t agent = parent_of(workers.at(2));
  REQUIRE(comm_of(agent) == comm_of(workers.at(2)));  // dptrain, not a shell between
  REQUIRE(::kill(agent, SIGSTOP) == 0);
  const int code = launcher->wait(std::chrono::seconds(60));
  INFO(launcher->err());
  CHECK(code == 3);
  CHECK(contains(parse_json(launcher->out())["error"].get<std::string>(),
                 " (ranks 2-3) has not answered for 3 s (its agent says it is alive every "
                 "second): its SSH server answers, so its agent is stuck (stopped, or in a "
                 "debugger): it was killed there, with its ranks; its ranks are taken as lost"));
  // A stopped process ends only by SIGKILL: the relay's sweep of the processes its connection
  // started (OpenSSH refuses channel signals for root, as the tests log in).
  const bool killed =
      eventually([agent] { return !process_alive(agent); }, std::chrono::seconds(10));
  if (!killed) ::kill(agent, SIGCONT);
  CHECK(killed);
}

TEST_CASE("a dropped SSH connection is a lost host, not a SIGTERM stop: --max-restarts restarts") {
  Cluster c;
  std::optional<Background> launcher;
  const auto workers =
      start_slowed(c, "dropped", launcher, true, {"--max-restarts", "1", "--restart-backoff", "0"});
  // Killed, the connection drops. The host's agent then stops its ranks with SIGTERM, and every
  // rank checkpoints: not a preemption.
  REQUIRE(::kill(sshd_serving(workers.at(2)), SIGKILL) == 0);
  const int code = launcher->wait(std::chrono::seconds(120));
  INFO(launcher->err());
  CHECK(code == 0);
  const json out = parse_json(launcher->out());
  CHECK(out["status"] == "completed");
  CHECK(out["restarts"] == 1);
  const json run = parse_json(read_text(c.tmp / "dropped" / "run.json"));
  REQUIRE(run["generations"].size() == 2);
  CHECK(run["generations"][0]["status"] == "failed");
  // As the relay saw the drop: a failed read, or the channel's end without an exit status.
  const std::string host = c.sshd.host(c.sshd.addresses()[2]).display();
  const std::string err = launcher->err();
  CHECK_MESSAGE((err.find("lost the SSH connection to " + host) != std::string::npos ||
                 err.find("the agent on " + host) != std::string::npos),
                err);
  CHECK(err.find("was stopped by SIGTERM") == std::string::npos);
  // The agent's command is named by its program, not by the relay's random mark before it.
  CHECK_FALSE(contains(err, "DPTRAIN_RELAY_MARK"));
}

// launch --json of quick_recipe() into `run_dir` with --ssh-keepalive 2, the hosts running this
// dptrain through a script whose shell lines `setup` come first (a test setting for an agent).
CommandResult launch_through_script(const Cluster& c, const fs::path& run_dir,
                                    const std::string& setup) {
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  const fs::path wrapper = c.tmp / (run_dir.filename().string() + ".sh");
  write_script(wrapper, "#!/bin/sh\n" + setup + "\nexec '" + binary() + "' \"$@\"\n");
  auto args = c.launch_args(recipe, run_dir);
  *(std::find(args.begin(), args.end(), "--remote-binary") + 1) = wrapper.string();
  args.insert(args.end(), {"--ssh-keepalive", "2", "--json"});
  return run_dptrain(args, {}, std::chrono::seconds(120));
}

TEST_CASE("a host that stops answering once its ranks completed leaves the run completed") {
  Cluster c;
  // The test setting that makes an agent fall silent after "@done".
  const auto r =
      launch_through_script(c, c.tmp / "silent", "export DPTRAIN_TEST_AGENT_SILENT_AT_END=1");
  INFO(r.err);
  CHECK(r.exit_code == 0);
  const json out = parse_json(r.out);
  CHECK(out["status"] == "completed");
  for (const std::string& address : {c.sshd.addresses()[1], c.sshd.addresses()[2]}) {
    CAPTURE(address);
    CHECK(r.err.find(c.sshd.host(address).display() + " (ranks ") != std::string::npos);
    CHECK(r.err.find("has not answered for 6 s after every rank there exited 0; its part of the "
                     "job is taken as completed") != std::string::npos);
  }
  // Warnings, as every other: one per host, on stderr and in --json's.
  CHECK(out["warnings"].size() == 2);
  for (const auto& w : out["warnings"])
    CHECK(contains(r.err, "dptrain: warning: " + w.get<std::string>() + "\n"));
  CHECK(parse_json(read_text(c.tmp / "silent" / "run.json"))["status"] == "completed");
}

TEST_CASE("a host lost after rank 0 reported the result leaves the run completed, warned of") {
  Cluster c;
  // The second host's agent falls silent once its ranks exited 0, before it says "@done": the
  // launcher cannot tell that host from a lost one, but rank 0 (on the first) reported the
  // result, so every rank took the last step.
  const std::string second = c.sshd.addresses()[2];
  const auto r =
      launch_through_script(c, c.tmp / "lost-late",
                            "case \"$SSH_CONNECTION\" in *\" " + second +
                                " \"*) export DPTRAIN_TEST_AGENT_SILENT_AT_END=before-done;; esac");
  INFO(r.err);
  CHECK(r.exit_code == 0);
  const json out = parse_json(r.out);
  CHECK(out["status"] == "completed");
  CHECK(out["final_loss"].is_number());
  REQUIRE(out["warnings"].size() == 1);
  const std::string warning = out["warnings"][0];
  CHECK_MESSAGE(
      warning.starts_with(c.sshd.host(second).display() + " (ranks 2-3) has not answered for 6 s"),
      warning);
  CHECK(warning.ends_with("(after rank 0 reported the result: the run is complete)"));
  CHECK(contains(r.err, "dptrain: warning: " + warning));
  const json info = parse_json(read_text(c.tmp / "lost-late" / "run.json"));
  CHECK(info["status"] == "completed");
  CHECK(info["generations"].size() == 1);
}

TEST_CASE("an agent that exits 2 without a report (it refused its plan) is not restarted") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  // The hosts' dptrain as an older one without the agent command would answer: a usage error.
  const fs::path wrapper = c.tmp / "no-agent.sh";
  write_script(wrapper,
               "#!/bin/sh\nif [ \"$1\" = agent ]; then echo \"dptrain: error: unknown "
               "command 'agent'\" >&2; exit 2; fi\nexec '" +
                   binary() + "' \"$@\"\n");
  auto args = c.launch_args(recipe, c.tmp / "old");
  *(std::find(args.begin(), args.end(), "--remote-binary") + 1) = wrapper.string();
  args.insert(args.end(), {"--max-restarts", "2", "--restart-backoff", "0.1"});
  const auto r = run_dptrain(args, {}, std::chrono::seconds(120));
  INFO(r.out, r.err);
  CHECK(r.exit_code != 0);
  CHECK(contains(r.err, "the agent on "));
  CHECK_FALSE(contains(r.out + r.err, "restart 1/2"));
  CHECK(contains(r.err, "(not restarted: "));
  CHECK(parse_json(read_text(c.tmp / "old" / "run.json"))["generations"].size() == 1);
}

TEST_CASE("a GPT on a token dataset trains across hosts, theirs checked against the launcher's") {
  TwoHostCluster c(1);
  write_text(c.tmp / "text.txt", synthetic_text(3, 20000));
  const auto prepared = run_dptrain({"data", "prepare", "--text", (c.tmp / "text.txt").string(),
                                     "--out", (c.tmp / "dataset").string()});
  REQUIRE(prepared.exit_code == 0);
  json r = gpt_recipe(c.tmp / "dataset", 1, 32);
  r["train"] = {{"steps", 10}, {"batch_per_rank", 4}};
  r["optimizer"]["schedule"] = {{"type", "cosine"}, {"warmup", 2}};
  r["checkpoint"] = {{"every", 5}, {"keep", 2}};
  r["eval"] = {{"every", 0}, {"max_samples", 16}};
  r["distributed"]["check_every"] = 5;
  const auto recipe = write_recipe(c.tmp.path(), r);
  auto args = c.launch_args(recipe, c.tmp / "gpt");
  args.push_back("--json");
  const auto launched = run_dptrain(args);
  INFO(launched.err);
  REQUIRE(launched.exit_code == 0);
  CHECK(parse_json(launched.out)["status"] == "completed");
  // Each host's agent compared its dataset with the launcher's fingerprint: the same files here
  // (a host with others is refused, as the agent's unit test shows), so no false refusal.
  CHECK(parse_json(read_text(c.tmp / "gpt" / "run.json"))["status"] == "completed");
}

TEST_CASE("killing one remote worker tears down all 4 ranks and names it") {
  Cluster c;
  std::optional<Background> launcher;
  auto workers = start_slowed(c, "killremote", launcher, true);
  REQUIRE(::kill(workers[3], SIGKILL) == 0);
  const int code = launcher->wait(std::chrono::seconds(60));
  const std::string err = launcher->err();
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

TEST_CASE("a remote rank's own failure is the cause, not its local peer's exit 3 that follows") {
  Cluster c;
  // Rank 0 here, rank 1 on a host: rank 0 sees its peer go at once (a communication error, exit
  // 3), while the host's agent reports its rank's exit a moment later, after its own wait.
  c.sshd.write_hostfile(c.hostfile, {c.sshd.addresses()[1]}, 1);
  write_text(c.hostfile, "localhost slots=1\n" + read_text(c.hostfile));
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  // 127 and 126 too: the codes of a command the host's shell cannot run, but from a rank that
  // ran, passed on by an agent that spoke: the rank's failure, not "cannot run dptrain there".
  for (const int code : {7, 127, 126}) {
    CAPTURE(code);
    auto args = c.launch_args(recipe, c.tmp / ("cause" + std::to_string(code)));
    args.push_back("--json");
    const auto r =
        run_dptrain(args, {{"DPTRAIN_FAULT", "exit@step=20,rank=1,code=" + std::to_string(code)}});
    INFO(r.err);
    CHECK(r.exit_code == 3);
    const std::string error = parse_json(r.out)["error"];
    CHECK(error.rfind("rank 1", 0) == 0);
    CHECK(error.find("exited with code " + std::to_string(code)) != std::string::npos);
    CHECK(error.find(c.sshd.addresses()[1]) != std::string::npos);
    CHECK(r.err.find("cannot run") == std::string::npos);
  }
}

TEST_CASE("a remote rank that exits 0 before the end is the cause, not the peers it leaves") {
  // Alone on its host (its relay exits 0: the host's ranks all did), or beside a rank that then
  // fails (its agent lists it with that failure): named either way, with its host.
  for (const int slots : {1, 2}) {
    CAPTURE(slots);
    Cluster c;
    c.sshd.write_hostfile(c.hostfile, {c.sshd.addresses()[1], c.sshd.addresses()[2]}, slots);
    const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
    const int rank = slots;  // the first rank on the second host
    const fs::path events = c.tmp / "events.jsonl";
    auto args = c.launch_args(recipe, c.tmp / "early");
    args.insert(args.end(), {"--json", "--events", events.string()});
    const auto r =
        run_dptrain(args, {{"DPTRAIN_FAULT", fmt::format("exit@step=20,rank={},code=0", rank)}});
    INFO(r.err);
    CHECK(r.exit_code == 3);
    const std::string error = parse_json(r.out)["error"];
    CHECK_MESSAGE(error.rfind(fmt::format("rank {} ", rank), 0) == 0, error);
    const auto cause = error.find(" exited with code 0 before the run ended");
    REQUIRE(cause != std::string::npos);
    CHECK(error.find(c.sshd.addresses()[2]) < cause);  // its host
    bool named = false;
    for (const json& e : read_jsonl(events)) {
      if (e["event"] != "rank_exited") continue;
      CHECK(e["process"].get<std::string>().rfind(fmt::format("rank {} on ", rank), 0) == 0);
      CHECK(e["exit_code"] == 0);
      named = true;
    }
    CHECK(named);
  }
}

TEST_CASE("SIGTERM to a host's agent (a node shutting down) checkpoints every rank, exit 143") {
  Cluster c;
  std::optional<Background> launcher;
  auto workers = start_slowed(c, "agentterm", launcher, true);
  const pid_t agent = agent_of(workers[3]);
  REQUIRE(agent > 1);
  REQUIRE(::kill(agent, SIGTERM) == 0);
  CHECK(launcher->wait(std::chrono::seconds(90)) == 143);
  INFO(launcher->err());
  // Both ranks of that host got it from their agent.
  CHECK(launcher->err().find("were stopped by SIGTERM; every rank checkpointed its last step") !=
        std::string::npos);
  // Rank 0 ran on the first host: the checkpoint it committed there is named with its host.
  const json out = parse_json(launcher->out());
  CHECK(out["exit_code"] == 143);
  CHECK(out["last_checkpoint"].get<std::string>().find("/checkpoints/step-") != std::string::npos);
  CHECK(out["last_checkpoint_host"] == c.sshd.host(c.sshd.addresses()[1]).display());
}

TEST_CASE("SIGKILL of a host's agent: exit 3 naming the host, its ranks and the signal") {
  Cluster c;
  std::optional<Background> launcher;
  const fs::path events = c.tmp / "events.jsonl";
  auto workers = start_slowed(c, "agentkill", launcher, true, {"--events", events.string()});
  const pid_t agent = agent_of(workers[3]);
  REQUIRE(agent > 1);
  REQUIRE(::kill(agent, SIGKILL) == 0);
  CHECK(launcher->wait(std::chrono::seconds(60)) == 3);
  const std::string error = parse_json(launcher->out())["error"];
  INFO(launcher->err());
  CHECK(contains(error, "the agent on " + c.sshd.host(c.sshd.addresses()[2]).display() +
                            " (ranks 2-3) was killed by SIGKILL"));
  CHECK_FALSE(contains(error, "code 137"));
  json exited;
  for (const auto& e : read_jsonl(events)) {
    if (e["event"] == "rank_exited") exited = e;
  }
  CHECK(exited["signal"] == SIGKILL);
  CHECK(exited["exit_code"].is_null());
  for (const auto& [rank, worker] : workers) {
    CAPTURE(rank);
    CHECK(eventually([worker] { return !process_alive(worker); }, std::chrono::seconds(15)));
  }
}

TEST_CASE("SIGKILL of a relay (here, not on the host): named as the relay, with its pid here") {
  Cluster c;
  std::optional<Background> launcher;
  start_slowed(c, "relaykill", launcher, true);
  // A relay is the launcher's child that runs `dptrain _relay`.
  pid_t relay = 0;
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const pid_t pid = std::stoi(name);
    if (agent_of(pid) != launcher->pid()) continue;
    std::string cmdline = read_text(entry.path() / "cmdline");
    std::replace(cmdline.begin(), cmdline.end(), '\0', ' ');
    if (contains(cmdline, " _relay")) relay = pid;
  }
  REQUIRE(relay > 1);
  REQUIRE(::kill(relay, SIGKILL) == 0);
  CHECK(launcher->wait(std::chrono::seconds(60)) == 3);
  const std::string error = parse_json(launcher->out())["error"];
  INFO(launcher->err());
  CHECK(contains(error, fmt::format(" (pid {} on this machine: the launcher's end of its SSH "
                                    "connection) was killed by signal 9 (SIGKILL)",
                                    relay)));
  CHECK(error.starts_with("the relay to "));
  CHECK(contains(error, " (ranks "));
  CHECK_FALSE(contains(error, "it printed nothing (log"));
}

TEST_CASE("SIGTERM whose checkpoint a remote rank cannot write: that rank is named, on its host") {
  Cluster c;
  std::optional<Background> launcher;
  auto workers = start_slowed(c, "remotefull", launcher, true);
  // Rank 2's run directory on its host, from its command line.
  std::vector<std::string> argv;
  std::istringstream cmdline(read_text(fs::path("/proc") / std::to_string(workers[2]) / "cmdline"));
  for (std::string arg; std::getline(cmdline, arg, '\0');)
    argv.push_back(arg);
  const auto flag = std::find(argv.begin(), argv.end(), "--run-dir");
  REQUIRE(flag != argv.end());
  REQUIRE(flag + 1 != argv.end());
  const fs::path there = *(flag + 1);
  // Where its checkpoints go is a file now (as a full disk there: the write fails, exit 5).
  // (A host's first checkpoint makes the directory.)
  if (fs::exists(there / "checkpoints")) fs::rename(there / "checkpoints", there / "moved");
  write_text(there / "checkpoints", "x");
  REQUIRE(::kill(launcher->pid(), SIGTERM) == 0);
  CHECK(launcher->wait(std::chrono::seconds(90)) == 143);
  const std::string error = parse_json(launcher->out())["error"];
  INFO(launcher->err());
  CHECK(contains(error, fmt::format("rank 2 (pid {}) exited with code 5 on host {}", workers[2],
                                    c.sshd.host(c.sshd.addresses()[2]).display())));
  CHECK_FALSE(contains(error, "stuck:"));
}

TEST_CASE("SIGINT to a host's agent: exit 3 naming the host, its ranks and SIGINT") {
  Cluster c;
  std::optional<Background> launcher;
  auto workers = start_slowed(c, "agentint", launcher, true);
  const pid_t agent = agent_of(workers[3]);
  REQUIRE(agent > 1);
  REQUIRE(::kill(agent, SIGINT) == 0);
  CHECK(launcher->wait(std::chrono::seconds(60)) == 3);
  const std::string error = parse_json(launcher->out())["error"];
  INFO(launcher->err());
  CHECK(contains(error, "the agent on " + c.sshd.host(c.sshd.addresses()[2]).display() +
                            " (ranks 2-3) was stopped by SIGINT on its host"));
  CHECK_FALSE(contains(error, "code 130"));
  for (const auto& [rank, worker] : workers) {
    CAPTURE(rank);
    CHECK(eventually([worker] { return !process_alive(worker); }, std::chrono::seconds(15)));
  }
}

TEST_CASE("killing the launcher leaves no worker behind on any host") {
  Cluster c;
  std::optional<Background> launcher;
  auto workers = start_slowed(c, "orphans", launcher, false);
  REQUIRE(::kill(launcher->pid(), SIGKILL) == 0);
  launcher->wait(std::chrono::seconds(10));
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
  // A rank whose peer on the other host stopped first fails its collective: in its log, not on
  // the terminal, which says the stop alone.
  INFO(launcher.out() << launcher.err());
  CHECK(launcher.out().find(dptrain::kPeerGoneNote) == std::string::npos);
  CHECK(launcher.err().find(dptrain::kPeerGoneNote) == std::string::npos);
}

// The checkpoints rank 0's host holds for a run.
std::vector<std::string> remote_checkpoints(const Cluster& c, const fs::path& run_dir) {
  std::vector<std::string> names;
  const fs::path dir = c.remote_run(c.sshd.addresses()[1], run_dir) / "checkpoints";
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().filename().string().rfind("step-", 0) == 0) {
      names.push_back(e.path().filename().string());
    }
  }
  std::sort(names.begin(), names.end());
  return names;
}

TEST_CASE("Ctrl-C with a hung rank: no rank outlives the launcher, and no checkpoint is written") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  const fs::path run_dir = c.tmp / "ctrlc-hung";
  // Rank 2 (on the second host) hangs at step 20: its peers wait in a collective, where a
  // SIGTERM's checkpoint could never come.
  Background launcher(c.launch_args(recipe, run_dir), {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "30"},
                                                       {"DPTRAIN_FAULT", "hang@step=20,rank=2"}});
  std::map<int, pid_t> workers;
  REQUIRE(eventually([&] {
    workers = workers_of("ctrlc-hung");
    return workers.size() == 4 && fs::exists(run_dir / "metrics.jsonl") &&
           !read_jsonl(run_dir / "metrics.jsonl").empty() &&
           read_jsonl(run_dir / "metrics.jsonl").back().value("step", 0) >= 20;
  }));
  const auto before = remote_checkpoints(c, run_dir);
  REQUIRE(::kill(launcher.pid(), SIGINT) == 0);
  CHECK(launcher.wait(std::chrono::seconds(60)) == 130);
  // The launcher has exited: the agents stopped their ranks without a checkpoint (SIGINT), and
  // within their 3 s grace, not the 50 s a checkpointing stop may take.
  for (const auto& [rank, pid] : workers) {
    CAPTURE(rank);
    CHECK(eventually([pid] { return !process_alive(pid); }, std::chrono::seconds(8)));
  }
  CHECK(remote_checkpoints(c, run_dir) == before);
}

TEST_CASE("a hang found by --hang-timeout: the remote ranks are gone when the launcher exits") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  const fs::path run_dir = c.tmp / "hung-remote";
  auto args = c.launch_args(recipe, run_dir);
  args.insert(args.end(), {"--hang-timeout", "3"});
  // Rank 2 (on the second host) hangs at step 20: the launcher's hang watch kills the job.
  Background launcher(
      args, {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "30"}, {"DPTRAIN_FAULT", "hang@step=20,rank=2"}});
  std::map<int, pid_t> workers;
  REQUIRE(eventually([&] {
    workers = workers_of("hung-remote");
    return workers.size() == 4;
  }));
  // Its agent stuck as well (stopped, in a debugger): told to kill, it cannot; its relay kills
  // it there, with its ranks, before the launcher gives up waiting.
  pid_t stuck_agent = 0;
  SUBCASE("the agents answer") {}
  SUBCASE("the hung rank's agent is stopped") {
    stuck_agent = parent_of(workers.at(2));
    REQUIRE(comm_of(stuck_agent) == "dptrain");
    REQUIRE(::kill(stuck_agent, SIGSTOP) == 0);
  }
  CHECK(launcher.wait(std::chrono::seconds(90)) == 3);
  INFO(launcher.out());
  CHECK(contains(launcher.out(), "stuck: rank 2 on " +
                                     c.sshd.host(c.sshd.addresses()[2]).display() + " at step 20"));
  // The ranks that followed their killed peers say so in their logs, not after the verdict.
  CHECK_FALSE(contains(launcher.out() + launcher.err(), "a peer rank has exited or was killed"));
  // Killed with the job, not 3 s later as their agents notice the launcher's side gone (with
  // --max-restarts, beside the next generation's ranks).
  // (Those of a stopped agent were killed by the relay's sweep, a moment before it ended: SIGKILL
  // is delivered as it returns, the exit may take a few milliseconds more.)
  const auto grace = std::chrono::milliseconds(stuck_agent != 0 ? 2000 : 0);
  for (const auto& [rank, pid] : workers) {
    CAPTURE(rank);
    CHECK(eventually([pid] { return !process_alive(pid); }, grace));
  }
  CHECK(eventually([] { return workers_of("hung-remote").empty(); }, grace));
  if (stuck_agent != 0) {
    CHECK(eventually([&] { return !process_alive(stuck_agent); }, std::chrono::seconds(5)));
    CHECK_FALSE(contains(launcher.out() + launcher.err(), "they may still run"));
  }
}

TEST_CASE("an agent that ignores the kill and that the sweep cannot see: the launcher warns") {
  // As root, OpenSSH ignores the relay's channel signal (its killpg of the session would end
  // the fake agent for a user's login, and with it the case): the sweep is all there is.
  if (::geteuid() != 0) {
    MESSAGE("skipped: needs root logins (the suite runs as root)");
    return;
  }
  Cluster c;
  // An agent that takes its plan and then neither starts ranks nor ends when told (its
  // protocol's "kill" unread), out of the relay's sweep: it sheds the relay's mark from its
  // environment, as a process in another PID namespace would be out of sight.
  const fs::path agent = c.tmp / "unseen-agent";
  const fs::path pids = c.tmp / "unseen-agent.pids";
  write_script(agent,
               fmt::format("#!/bin/sh\n[ \"$1\" = --version ] && exit 1\n"
                           "exec env -u DPTRAIN_RELAY_MARK sh -c 'echo \"@agent {}\"; read -r "
                           "plan; echo $$ >> {}; while :; do echo @alive; sleep 1; done'\n",
                           dptrain::kAgentProtocol, pids.string()));
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  auto args = c.launch_args(recipe, c.tmp / "unseen");
  const auto flag = std::find(args.begin(), args.end(), "--remote-binary");
  REQUIRE(flag != args.end());
  *(flag + 1) = agent.string();
  Background launcher(args);
  std::vector<pid_t> agents;
  REQUIRE(eventually([&] {
    std::istringstream lines(fs::exists(pids) ? read_text(pids) : "");
    agents.clear();
    for (std::string line; std::getline(lines, line);)
      agents.push_back(std::stoi(line));
    return agents.size() == 2;
  }));
  // Ctrl-C twice: the second kills at once, the relays tell their agents "kill". (Apart by more
  // than kSameSignalWindow: one process's two SIGINTs within it are one request.)
  REQUIRE(::kill(launcher.pid(), SIGINT) == 0);
  std::this_thread::sleep_for(dptrain::kSameSignalWindow + std::chrono::milliseconds(200));
  REQUIRE(::kill(launcher.pid(), SIGINT) == 0);
  CHECK(launcher.wait(std::chrono::seconds(60)) == 130);
  const std::string said = launcher.out() + launcher.err();
  INFO(said);
  CHECK(contains(said,
                 "did not end its ranks when told, and a sweep of the host's processes found none "
                 "of them (the SSH server may start commands where its processes cannot be seen, "
                 "as in another PID namespace): they may still run there"));
  for (const pid_t pid : agents)
    ::kill(pid, SIGKILL);
}

TEST_CASE("bench train across hosts leaves no checkpoint on them, as none is kept here") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  const fs::path runs = c.tmp / "bench-runs";
  const auto r =
      run_dptrain({"bench", "train", recipe.string(), "--hosts", c.hostfile.string(),
                   "--known-hosts", c.sshd.known_hosts().string(), "--remote-binary", binary(),
                   "--nnodes", "2", "--steps", "20", "--runs-root", runs.string(), "--json"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  int seen = 0;
  for (const auto& entry : fs::recursive_directory_iterator(runs)) {
    if (entry.path().filename() != "run.json") continue;
    for (const std::string& address : {c.sshd.addresses()[1], c.sshd.addresses()[2]}) {
      const fs::path there = c.remote_run(address, entry.path().parent_path());
      CAPTURE(there);
      REQUIRE(fs::exists(there / "logs"));  // the host's copy of the run
      ++seen;
      CHECK((!fs::exists(there / "checkpoints") || fs::is_empty(there / "checkpoints")));
    }
  }
  CHECK(seen == 2);
}

TEST_CASE("a relay's end signal from anyone but its launcher is ignored") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  const fs::path run_dir = c.tmp / "stray";
  auto args = c.launch_args(recipe, run_dir);
  args.push_back("--json");
  Background launcher(args, {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "30"}});
  REQUIRE(eventually([&] { return workers_of("stray").size() == 4; }));
  const std::vector<pid_t> relays = worker_pids(run_dir);  // the launcher's children
  REQUIRE(relays.size() == 2);
  for (const pid_t relay : relays)
    REQUIRE(::kill(relay, SIGUSR1) == 0);  // a stray `pkill -USR1`, not the launcher's kill
  CHECK(launcher.wait(std::chrono::seconds(90)) == 0);
  INFO(launcher.err());
  CHECK(parse_json(launcher.out())["status"] == "completed");
}

TEST_CASE("a remote rank frozen before the ranks meet is named by --hang-timeout, not timeout_s") {
  Cluster c;
  auto recipe_json = quick_recipe();
  recipe_json["distributed"]["timeout_s"] = 120;  // the wait the others would otherwise sit out
  const auto recipe = write_recipe(c.tmp.path(), recipe_json);
  // Rank 2: the second host's first.
  const std::string verdict =
      frozen_join_verdict(c.launch_args(recipe, c.tmp / "join"), "freeze-before-join@rank=2,gen=1",
                          c.tmp / "events.jsonl");
  CAPTURE(verdict);
  CHECK(contains(verdict, "stuck: rank 2 on " + c.sshd.host(c.sshd.addresses()[2]).display() +
                              " (no heartbeat in the "));
  CHECK(contains(verdict, "frozen, or unable to reach the store, before it joined)"));
  CHECK(contains(verdict, "; waiting for it to join: rank 0 on "));
}

// The quick recipe launched across the cluster into c.tmp/NAME with `binary` as the hosts'
// dptrain, to its end (--json).
CommandResult launch_with_remote_binary(Cluster& c, const std::string& name, const fs::path& binary,
                                        const std::vector<std::string>& extra = {},
                                        const Env& env = {}) {
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  auto args = c.launch_args(recipe, c.tmp / name);
  const auto flag = std::find(args.begin(), args.end(), "--remote-binary");
  REQUIRE(flag != args.end());
  *(flag + 1) = binary.string();
  args.insert(args.end(), extra.begin(), extra.end());
  args.push_back("--json");
  return run_dptrain(args, env);
}

TEST_CASE("a host without the binary fails the launch with exit 4 and says how to install it") {
  Cluster c;
  auto r = launch_with_remote_binary(c, "nobinary", c.tmp / "not-installed/dptrain");
  INFO(r.err);
  CHECK(r.exit_code == 4);
  CHECK(r.err.find("not-installed/dptrain' there (no such file or command): install it with "
                   "'dptrain provision'") != std::string::npos);
  CHECK(parse_json(r.out)["exit_code"] == 4);
  // A file where a directory of the path should be (a --workdir that is a file): provision
  // would not help; the error says what is wrong there.
  write_text(c.tmp / "a-file", "x");
  auto file = launch_with_remote_binary(c, "filepath", c.tmp / "a-file/bin/dptrain");
  INFO(file.err);
  CHECK(file.exit_code == 4);
  CHECK(file.err.find("a-file/bin/dptrain' there: a part of its path is a file, not a directory "
                      "(the host said: ") != std::string::npos);
  CHECK(file.err.find("dptrain provision") == std::string::npos);
}

TEST_CASE("a program at --remote-binary that is not this dptrain's agent: exit 4 naming it") {
  Cluster c;
  const fs::path fake = c.tmp / "old-dptrain";
  // It says what it is and exits 0 (no plan is sent to a program that has not said it is an
  // agent).
  write_text(fake, "#!/bin/sh\necho 'dptrain 0.0.9'\n");
  fs::permissions(fake, fs::perms::owner_all);
  auto r = launch_with_remote_binary(c, "fake", fake);
  INFO(r.err);
  CHECK(r.exit_code == 4);
  CHECK(r.err.find("old-dptrain' there exited 0 without running its ranks (its last line: "
                   "dptrain 0.0.9): it is not this dptrain's agent") != std::string::npos);
  CHECK(r.err.find("reported no result") == std::string::npos);
  CHECK(parse_json(r.out)["exit_code"] == 4);

  // One that fails without a word (/bin/false): the same, and not restarted.
  const auto silent = launch_with_remote_binary(c, "false", "/bin/false", {"--max-restarts", "2"});
  INFO(silent.err);
  CHECK(silent.exit_code == 4);
  CHECK(contains(silent.err,
                 "'/bin/false' there exited with code 1 without running its ranks: "
                 "it is not this dptrain's agent"));
  CHECK(contains(silent.err, "(not restarted: the host would fail the same way again"));
  CHECK(parse_json(silent.out)["restarts"] == 0);

  // One that crashes as it starts (a binary cut short, built for another CPU): the host cannot
  // run this dptrain, as above; not an agent killed with its ranks, restarted to crash again.
  const fs::path crashing = c.tmp / "crashing";
  write_script(crashing, "#!/bin/sh\necho 'starting' >&2\nkill -SEGV $$\n");
  const auto crash = launch_with_remote_binary(c, "crash", crashing, {"--max-restarts", "2"});
  INFO(crash.err);
  CHECK(crash.exit_code == 4);
  CHECK(contains(crash.err,
                 "crashing' there was killed by SIGSEGV as it started, before it said "
                 "it is an agent (its last line: starting): that binary cannot run "
                 "there (damaged, cut short, or built for another machine?); 'dptrain "
                 "doctor' checks it"));
  CHECK_FALSE(contains(crash.err, "taken as lost"));
  CHECK(parse_json(crash.out)["restarts"] == 0);

  // One that waits without a word (it reads its stdin to the end, which the launcher's end
  // closes), and whose --version fails (so that says nothing for certain): not said to be an
  // agent that went quiet; what runs there is killed (it would wait for ever).
  const fs::path mute_binary = c.tmp / "mute-binary";
  write_script(mute_binary, "#!/bin/sh\n[ \"$1\" = --version ] && exit 1\necho $$ > '" +
                                mute_binary.string() + ".pid'\nsleep 120\n");
  const auto mute = launch_with_remote_binary(c, "mute", mute_binary, {"--ssh-keepalive", "1"});
  INFO(mute.err);
  CHECK(mute.exit_code == 3);
  CHECK(contains(mute.err, "has not answered for 3 s, and '" + mute_binary.string() +
                               "' there has said nothing since it was started: it may not be "
                               "this dptrain's agent (a program that waits, or a build that "
                               "hangs: 'dptrain doctor' checks it) (its SSH server answers; it "
                               "was killed there); its ranks are taken as lost"));
  CHECK_FALSE(contains(mute.err, "says it is alive every second"));
  const pid_t mute_pid = std::stoi(read_text(mute_binary.string() + ".pid"));
  CHECK(eventually([mute_pid] { return !process_alive(mute_pid); }, std::chrono::seconds(10)));
  const fs::path waits = c.tmp / "waits";
  write_text(waits, "#!/bin/sh\ncat >/dev/null\n");
  fs::permissions(waits, fs::perms::owner_all);
  // Silent 5 s under the default keepalive (45 s of silence): asked --version, it answers
  // nothing dptrain would (cat of an empty input), and is refused then, not restarted.
  const auto asked = launch_with_remote_binary(c, "asked", waits, {"--max-restarts", "2"});
  INFO(asked.err);
  CHECK(asked.exit_code == 4);
  CHECK(contains(asked.err, "'" + waits.string() +
                                "' there has said nothing in the 5 s since it was started, and "
                                "its answer to '--version --json' is not dptrain's: it is not "
                                "this dptrain's agent"));
  CHECK(contains(asked.err, "(not restarted: "));
  CHECK(asked.seconds < 40);
  // One that hangs on --version too: refused once that times out, as doctor says it.
  const fs::path sleeper = c.tmp / "sleeper";
  write_script(sleeper, "#!/bin/sh\nsleep 120\n");
  const auto hung =
      launch_with_remote_binary(c, "hung", sleeper, {}, {{"DPTRAIN_TEST_VERSION_PROBE_S", "2"}});
  INFO(hung.err);
  CHECK(hung.exit_code == 4);
  CHECK(contains(hung.err, "'" + sleeper.string() +
                               "' there has said nothing in the 5 s since it was started, and did "
                               "not answer '--version --json' within 2 s: it is not a working "
                               "dptrain"));
}

// A fake agent at c.tmp/NAME: says `said` (shell lines), records its pid (NAME.pid), keeps what
// it is sent on standard input (the plan, for an agent) in NAME.plan, to its end, then waits
// without a word (it outlives its connection unless it is killed).
fs::path fake_agent(const Cluster& c, const std::string& name, const std::string& said) {
  const fs::path path = c.tmp / name;
  // Its pid and an empty NAME.plan first: the relay may kill it as soon as it has spoken.
  write_script(path, "#!/bin/sh\n[ \"$1\" = --version ] || { echo $$ > '" + path.string() +
                         ".pid'; : > '" + path.string() + ".plan'; }\n" + said + "\ncat >> '" +
                         path.string() + ".plan'\nsleep 120\n");
  return path;
}

// The fake agent at `path` was never sent the plan (which holds the job's secret), and was
// killed as it was refused (not left to outlive its connection: a root login too).
void check_never_planned(const fs::path& path) {
  const fs::path plan = path.string() + ".plan";
  REQUIRE(fs::exists(plan));
  CHECK(read_text(plan).empty());
  const pid_t pid = std::stoi(read_text(path.string() + ".pid"));
  CHECK(eventually([pid] { return !process_alive(pid); }, std::chrono::seconds(10)));
}

TEST_CASE("an agent that fails without its report: the error quotes none of its protocol lines") {
  Cluster c;
  // It speaks this launcher's protocol, takes its plan, says it started, then exits 7 (an agent
  // that crashed before it could report).
  const fs::path agent = c.tmp / "crashing-agent";
  write_script(agent, fmt::format("#!/bin/sh\necho '@agent {}'\nread -r plan\necho '@started'\n"
                                  "exit 7\n",
                                  dptrain::kAgentProtocol));
  const auto r = launch_with_remote_binary(c, "crashing", agent);
  INFO(r.err);
  CHECK(r.exit_code == 3);
  CHECK(contains(r.err, "failed: host "));
  CHECK(contains(r.err, "exited with code 7"));
  CHECK_FALSE(contains(r.err, "@started"));
  CHECK_FALSE(contains(r.err, "@agent"));
}

TEST_CASE("a host whose agent speaks another protocol (another build): exit 4 naming both") {
  Cluster c;
  // An agent from before agents said their protocol: nothing until it has read a plan. Asked
  // --version after 5 s, it says an older dptrain: refused, never sent the plan (which holds the
  // job's secret), and not restarted.
  const fs::path older = fake_agent(
      c, "older-agent", "if [ \"$1\" = --version ]; then echo 'dptrain 0.1.0'; exit 0; fi");
  const auto old = launch_with_remote_binary(c, "older", older, {"--max-restarts", "2"});
  INFO(old.err);
  CHECK(old.exit_code == 4);
  const std::string older_build =
      "' there is an older build of dptrain (its agent does not say which protocol it speaks; "
      "this launcher's speaks " +
      std::to_string(dptrain::kAgentProtocol) +
      "): install this build there with 'dptrain provision'";
  CHECK(contains(old.err, "'" + older.string() + older_build));
  CHECK(contains(old.err, "(not restarted: "));
  CHECK(parse_json(old.out)["restarts"] == 0);
  check_never_planned(older);
  // One whose --version answers JSON of another protocol, silent too: named by that number.
  const fs::path other = fake_agent(c, "other-agent",
                                    "if [ \"$1\" = --version ]; then echo "
                                    "'{\"version\":\"0.1.0\",\"agent_protocol\":9}'; exit 0; fi");
  const auto silent_other = launch_with_remote_binary(c, "other", other);
  INFO(silent_other.err);
  CHECK(silent_other.exit_code == 4);
  CHECK(contains(silent_other.err,
                 "there is another build of dptrain (its agent speaks protocol "
                 "9, this launcher's"));
  check_never_planned(other);
  // One that says "@alive" first (a line of the protocol, not its number): refused at once.
  const fs::path alive = fake_agent(c, "alive-agent", "echo @alive");
  const auto said_alive = launch_with_remote_binary(c, "alive", alive);
  CHECK(said_alive.exit_code == 4);
  CHECK(contains(said_alive.err, "'" + alive.string() + older_build));
  CHECK_FALSE(contains(said_alive.err, "@alive"));
  check_never_planned(alive);

  // One that says a number this launcher does not speak: a newer build, say. What it says
  // after is not taken for a report (it would be misread).
  const fs::path newer = fake_agent(c, "newer-agent", "echo '@agent 999'\necho '@rank 0 hello'");
  const auto nr = launch_with_remote_binary(c, "newer", newer);
  INFO(nr.err);
  CHECK(nr.exit_code == 4);
  CHECK(contains(nr.err, "'" + newer.string() +
                             "' there is another build of dptrain (its agent speaks protocol "
                             "999, this launcher's " +
                             std::to_string(dptrain::kAgentProtocol) + ")"));
  CHECK_FALSE(contains(nr.err, "hello"));
  check_never_planned(newer);
  // One that says protocol 1 outright: named by the number it said.
  const fs::path one = fake_agent(c, "one-agent", "echo '@agent 1'");
  const auto said_one = launch_with_remote_binary(c, "one", one);
  CHECK(said_one.exit_code == 4);
  CHECK(contains(said_one.err,
                 "' there is another build of dptrain (its agent speaks protocol 1, "
                 "this launcher's " +
                     std::to_string(dptrain::kAgentProtocol) + ")"));
  check_never_planned(one);
}

TEST_CASE("a login's start-up output before the agent (an '@' line, stderr without a line end)") {
  Cluster c;
  // What a login's start-up files may print before the agent runs: neither is taken for the
  // agent's first line, and the job runs.
  const fs::path noisy = c.tmp / "noisy.sh";
  write_script(noisy, "#!/bin/sh\necho '@home is mounted'\nprintf 'no line end' >&2\nexec '" +
                          binary() + "' \"$@\"\n");
  const auto r = launch_with_remote_binary(c, "noisy", noisy);
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK_FALSE(contains(r.err, "another build"));
}

TEST_CASE("an agent that refuses its plan (exit 2, its host's data differs) is not restarted") {
  Cluster c;
  // What an agent says when its host's copy of the data is not the launcher's: a failure of
  // the host (rank -1), exit 2. It says its protocol first, as every agent does.
  const fs::path refusing = c.tmp / "refusing-agent";
  write_text(refusing,
             "#!/bin/sh\n"
             "echo '@agent " +
                 std::to_string(dptrain::kAgentProtocol) +
                 "'\n"
                 "echo '@failure {\"rank\":-1,\"exit_code\":-1,\"signal\":0,\"description\":"
                 "\"data/train.csv on this host is not the launcher'\"'\"'s\",\"refused\":false,"
                 "\"last_lines\":[]}'\n"
                 "exit 2\n");
  fs::permissions(refusing, fs::perms::owner_all);
  auto r = launch_with_remote_binary(c, "refusing", refusing, {"--max-restarts", "2"});
  INFO(r.err);
  CHECK(r.exit_code == 3);
  CHECK(r.err.find("data/train.csv on this host is not the launcher's") != std::string::npos);
  CHECK(r.err.find("(not restarted: the rank's error is one a restart from a checkpoint would "
                   "meet again)") != std::string::npos);
  CHECK(parse_json(r.out)["restarts"] == 0);
}

TEST_CASE("a host that cannot make the run directory fails with exit 4, not restarted") {
  Cluster c;
  // A file where the hosts' runs/ goes: every generation would meet it again.
  fs::create_directories(c.tmp / "workdir");
  write_text(c.tmp / "workdir/runs", "");
  auto r = launch_with_remote_binary(c, "nodir", binary(),
                                     {"--workdir", (c.tmp / "workdir").string(), "--max-restarts",
                                      "2", "--restart-backoff", "0.1"});
  INFO(r.err);
  CHECK(r.exit_code == 4);
  // Named as the launcher names the host, with its SSH port: hosts sharing a name differ by it.
  // (Whichever host fails first is the one named.)
  bool named = false;
  for (const auto& address : {c.sshd.addresses()[1], c.sshd.addresses()[2]}) {
    const std::string display = c.sshd.host(address).display();
    CHECK(display.find(':') != std::string::npos);
    named = named || contains(r.err, ": cannot create run directory on " + display + ": ");
  }
  CHECK(named);
  const json out = parse_json(r.out);
  CHECK(out["exit_code"] == 4);
  CHECK(out["restarts"] == 0);
}

TEST_CASE("a host whose binary lacks a library fails the launch with exit 4 naming it") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  // What the dynamic loader prints, and its exit status 127, for a library the host lacks.
  const fs::path nolib = c.tmp / "nolib.sh";
  write_script(nolib,
               "#!/bin/sh\necho \"$0: error while loading shared libraries: libgloo.so.0: cannot "
               "open shared object file: No such file or directory\" >&2\nexit 127\n");
  auto args = c.launch_args(recipe, c.tmp / "nolib");
  *(std::find(args.begin(), args.end(), "--remote-binary") + 1) = nolib.string();
  auto r = run_dptrain(args);
  INFO(r.err);
  CHECK(r.exit_code == 4);
  CHECK(r.err.find("nolib.sh' cannot start there: error while loading shared libraries: "
                   "libgloo.so.0: cannot open shared object file: No such file or directory "
                   "(install the libraries it needs on the host: 'ldd ") != std::string::npos);
  CHECK(r.err.find("no such file or command") == std::string::npos);
}

TEST_CASE("SIGTERM while a host is still connecting stops the launch at once") {
  TempDir tmp;
  // A port that accepts connections and never says a word: the SSH connection to it waits for
  // the whole connect timeout (100 s here), which a stop signal does not.
  const HeldPort silent(false);
  write_text(tmp / "hosts",
             "localhost slots=1\n127.0.0.1 slots=1 port=" + std::to_string(silent.port()) + "\n");
  const auto recipe = write_recipe(tmp.path(), quick_recipe());
  Background launcher({"launch", recipe.string(), "--hosts", (tmp / "hosts").string(),
                       "--connect-timeout", "100", "--run-dir", (tmp / "run").string()});
  CHECK(eventually([&] { return fs::exists(tmp / "run" / "run.json"); }, std::chrono::seconds(30)));
  std::this_thread::sleep_for(std::chrono::seconds(1));
  ::kill(launcher.pid(), SIGTERM);
  CHECK(launcher.wait(std::chrono::seconds(40)) == 143);
  INFO(launcher.err());
  CHECK(launcher.err().find("dptrain: error: stopped by SIGTERM; every rank stopped before its "
                            "first step (nothing to checkpoint)") != std::string::npos);
  CHECK(launcher.err().find("exited with code 4") == std::string::npos);
}

TEST_CASE("SIGTERM as the relays start is a stop before the first step, not hosts killed") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  const fs::path run_dir = c.tmp / "early-term";
  // Each process the launcher starts waits 3 s before it takes its own signal handlers: the
  // SIGTERM passed on to the relays meanwhile must wait for theirs (it is a stop, not a death).
  Background launcher(c.launch_args(recipe, run_dir), {{"DPTRAIN_TEST_SPAWN_PAUSE_MS", "3000"}});
  REQUIRE(eventually([&] { return fs::exists(run_dir / "run.json"); }, std::chrono::seconds(30)));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ::kill(launcher.pid(), SIGTERM);
  CHECK(launcher.wait(std::chrono::seconds(60)) == 143);
  INFO(launcher.err());
  CHECK(contains(launcher.err(),
                 "dptrain: error: stopped by SIGTERM; every rank stopped before "
                 "its first step (nothing to checkpoint)"));
  CHECK_FALSE(contains(launcher.err(), "killed by SIGTERM"));
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

  // Two hosts of one name (one machine, two ports): each connection keeps its own log.
  const auto p1 = std::to_string(unused_port()), p2 = std::to_string(unused_port());
  const std::string& address = c.sshd.addresses()[1];
  write_text(c.tmp / "two-ports.txt",
             address + " slots=1 port=" + p1 + "\n" + address + " slots=1 port=" + p2 + "\n");
  auto two = run_dptrain({"launch", recipe.string(), "--hosts", (c.tmp / "two-ports.txt").string(),
                          "--known-hosts", c.sshd.known_hosts().string(), "--connect-timeout", "3",
                          "--run-dir", (c.tmp / "two").string()});
  CHECK(two.exit_code == 4);
  for (const auto& port : {p1, p2}) {
    const fs::path log = c.tmp / "two/logs" / (address + "-" + port + "-agent.log");
    CAPTURE(log);
    REQUIRE(fs::exists(log));
    CHECK(read_text(log).find(":" + port) != std::string::npos);
  }
  // So in an elastic job whose generation has only one of them: its log is named as it would be
  // in a generation with both, so that no two hosts ever write one log.
  c.sshd.write_hostfile(c.tmp / "one-up.txt", {address}, 1);
  write_text(c.tmp / "one-up.txt",
             read_text(c.tmp / "one-up.txt") + address + " slots=1 port=" + p2 + "\n");
  auto args = c.launch_args(recipe, c.tmp / "one");
  *(std::find(args.begin(), args.end(), c.hostfile.string())) = (c.tmp / "one-up.txt").string();
  for (const char* a : {"--nnodes", "1:2", "--rejoin-timeout", "0", "--connect-timeout", "3"})
    args.push_back(a);
  auto one = run_dptrain(args);
  INFO(one.err);
  CHECK(one.exit_code == 0);
  CHECK(fs::exists(c.tmp / "one/logs" /
                   (address + "-" + std::to_string(c.sshd.port()) + "-agent.log")));
}

TEST_CASE(
    "a host that cannot be reached is retried as --max-restarts allows, not 'deterministic'") {
  // Every attempt fails at the step it starts from: three in a row at one step once ended the
  // job as deterministic after two restarts, however many --max-restarts allowed (a host down
  // for a reboot ended the job).
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  write_text(c.tmp / "down.txt",
             c.sshd.addresses()[1] + " slots=1 port=" + std::to_string(unused_port()) + "\n");
  auto args = c.launch_args(recipe, c.tmp / "down");
  args[3] = (c.tmp / "down.txt").string();  // --hosts
  for (const char* more :
       {"--max-restarts", "4", "--restart-backoff", "0", "--connect-timeout", "3", "--json"})
    args.emplace_back(more);
  auto r = run_dptrain(args);
  INFO(r.err);
  CHECK(r.exit_code == 4);
  CHECK(r.err.find("looks deterministic") == std::string::npos);
  CHECK(r.err.find("(restarts exhausted: 4 of 4 for this invocation)") != std::string::npos);
  const json out = parse_json(r.out);
  CHECK(out["restarts"] == 4);
  const json run = parse_json(read_text(c.tmp / "down/run.json"));
  REQUIRE(run["generations"].size() == 5);
  for (const auto& g : run["generations"])
    CHECK(g["host_unreachable"] == true);
  const json status = parse_json(run_dptrain({"status", (c.tmp / "down").string(), "--json"}).out);
  CHECK(status["hint"].get<std::string>().starts_with(
      "a host could not be reached (the error says which): once it answers, continue it with "));
  // A resume, too, tries again rather than count the earlier attempts as a deterministic row.
  auto resumed =
      run_dptrain({"resume", (c.tmp / "down").string(), "--hosts", (c.tmp / "down.txt").string(),
                   "--known-hosts", c.sshd.known_hosts().string(), "--remote-binary", binary(),
                   "--max-restarts", "1", "--restart-backoff", "0", "--connect-timeout", "3"});
  INFO(resumed.err);
  CHECK(resumed.exit_code == 4);
  CHECK(resumed.err.find("looks deterministic") == std::string::npos);
  CHECK(resumed.err.find("(restarts exhausted: 1 of 1 for this invocation)") != std::string::npos);
}

TEST_CASE("a host that refuses the key is not restarted: --max-restarts would meet it again") {
  Cluster c;
  const auto recipe = write_recipe(c.tmp.path(), quick_recipe());
  const std::string& refusing = c.sshd.addresses()[2];
  c.sshd.write_hostfile(c.tmp / "refusing.txt", {c.sshd.addresses()[1]}, 2);
  write_text(c.tmp / "refusing.txt", read_text(c.tmp / "refusing.txt") + refusing +
                                         " slots=1 port=" + std::to_string(c.sshd.port()) +
                                         " user=" + c.sshd.user() +
                                         " key=" + c.sshd.wrong_key().string() + "\n");
  auto args = c.launch_args(recipe, c.tmp / "refused");
  args[3] = (c.tmp / "refusing.txt").string();  // --hosts
  for (const char* more : {"--max-restarts", "3", "--json"})
    args.emplace_back(more);
  auto r = run_dptrain(args);
  INFO(r.err);
  CHECK(r.exit_code == 4);
  CHECK(r.err.find("authentication refused for " + c.sshd.host(refusing).display()) !=
        std::string::npos);
  CHECK(r.err.find("(not restarted: the host would fail the same way again; fix what it says, "
                   "then 'dptrain resume')") != std::string::npos);
  CHECK(r.err.find("restart 1") == std::string::npos);
  const json out = parse_json(r.out);
  CHECK(out["restarts"] == 0);
  CHECK(parse_json(read_text(c.tmp / "refused/run.json"))["generations"].size() == 1);
  // status: a resume would be refused too until the host accepts the connection.
  const json s = parse_json(run_dptrain({"status", (c.tmp / "refused").string(), "--json"}).out);
  CHECK(s["hint"].get<std::string>().rfind(
            "a host refused the SSH connection or cannot run dptrain (the error says which and "
            "why): once that is fixed, continue it with 'dptrain resume ",
            0) == 0);
}

TEST_CASE("a host name that does not resolve fails with exit 4 before anything is created") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), quick_recipe());
  for (const bool dry_run : {false, true}) {
    CAPTURE(dry_run);
    std::vector<std::string> args = {
        "launch",    recipe.string(),          "--hosts", "no-such-host.invalid:1",
        "--run-dir", (tmp / "never").string(), "--json"};
    if (dry_run) args.push_back("--dry-run");
    auto r = run_dptrain(args);
    CHECK(r.exit_code == 4);
    CHECK(r.err.find("no-such-host.invalid (--hosts): cannot resolve") != std::string::npos);
    CHECK(r.err.find("warning") == std::string::npos);  // one error line, even in a dry run
    CHECK(parse_json(r.out)["exit_code"] == 4);
    CHECK_FALSE(fs::exists(tmp / "never"));
  }
  // A plan drafted where the cluster's names mean nothing (the store's address given): shown,
  // with a warning.
  auto drafted = run_dptrain({"launch", recipe.string(), "--hosts", "no-such-host.invalid:1",
                              "--master-addr", "127.0.0.1", "--dry-run", "--json"});
  CHECK(drafted.exit_code == 0);
  CHECK(
      drafted.err.starts_with("dptrain: warning: no-such-host.invalid (--hosts): cannot resolve"));
  CHECK(parse_json(drafted.out)["hosts"][0]["host"] == "no-such-host.invalid");
  CHECK(parse_json(drafted.out)["warnings"].size() == 1);
  // The benchmarks too, and a second host that does not resolve as well as a first.
  const std::vector<std::vector<std::string>> others = {
      {"bench", "comm", "--hosts", "no-such-host.invalid:1", "--runs-root", (tmp / "bc").string()},
      {"bench", "train", recipe.string(), "--hosts", "no-such-host.invalid:1", "--runs-root",
       (tmp / "bt").string()},
      {"launch", recipe.string(), "--hosts", "localhost:1,also-not.invalid:1", "--run-dir",
       (tmp / "second").string()}};
  for (const auto& args : others) {
    CAPTURE(args[1]);
    auto r = run_dptrain(args);
    CHECK(r.exit_code == 4);
    CHECK(r.err.find(".invalid (--hosts): cannot resolve") != std::string::npos);
  }
  for (const char* dir : {"bc", "bt", "second"})
    CHECK_FALSE(fs::exists(tmp / dir));
  // A DPTRAIN_FAULT that does not parse is refused by a dry run as by a launch.
  auto dry =
      run_dptrain({"launch", recipe.string(), "--dry-run"}, {{"DPTRAIN_FAULT", "crash@step=x"}});
  CHECK(dry.exit_code == 2);
}
