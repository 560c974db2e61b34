// Elastic world size and runs whose rank 0 is on another host: a lost node (its SSH connection
// killed, its logins refused) with --nnodes 1:2, a local rank lost with --nproc MIN:MAX, and
// restarts that find their checkpoint on the surviving nodes.
#include <doctest/doctest.h>
#include <signal.h>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "tests/cluster.hpp"
#include "tests/strings.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json elastic_recipe() {
  auto r = small_recipe();
  r["train"]["steps"] = 150;
  r["checkpoint"] = {{"every", 25}, {"keep", 3}};
  r["eval"] = {{"every", 0}};
  return r;
}

std::vector<json> events_named(const fs::path& events, const std::string& name) {
  std::vector<json> out;
  for (const auto& e : read_jsonl(events)) {
    if (e["event"] == name) out.push_back(e);
  }
  return out;
}

double eval_loss(const fs::path& run_dir) {
  return parse_json(read_text(run_dir / "result.json"))["eval_loss"].get<double>();
}

// Refuses logins to one loopback host while alive.
class LostHost {
 public:
  LostHost(const LoopbackSshd& sshd, std::string address)
      : sshd_(sshd), address_(std::move(address)) {
    sshd_.set_logins_refused(address_, true);
  }
  ~LostHost() { sshd_.set_logins_refused(address_, false); }
  LostHost(const LostHost&) = delete;
  LostHost& operator=(const LostHost&) = delete;

 private:
  const LoopbackSshd& sshd_;
  std::string address_;
};

struct TwoHosts : TwoHostCluster {
  TwoHosts() : TwoHostCluster(1) {}
};

// A run on both hosts (rank 0 remote) with `extra` flags, whose rank 1 crashes at step 70 once:
// it restarts from the step-50 checkpoint the nodes hold and ends bit-identical to a clean run.
CommandResult crash_once_and_restart(TwoHosts& c, const std::vector<std::string>& extra) {
  const auto recipe = write_recipe(c.tmp.path(), elastic_recipe());
  auto clean = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir",
                            (c.tmp / "clean").string(), "--json"});
  REQUIRE(clean.exit_code == 0);
  auto args = c.launch_args(recipe, c.tmp / "remote");
  args.insert(args.end(), extra.begin(), extra.end());
  for (const char* a : {"--max-restarts", "1", "--restart-backoff", "0.1", "--json"})
    args.push_back(a);
  auto r = run_dptrain(args, {{"DPTRAIN_FAULT", "crash@step=70,rank=1,gen=1"}});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json out = parse_json(r.out);
  CHECK(out["restarts"] == 1);
  CHECK(out["params_checksum"] == parse_json(clean.out)["params_checksum"]);
  const json info = parse_json(read_text(c.tmp / "remote/run.json"));
  CHECK(info["generations"][1]["resumed_from"] == "step-000050");
  return r;
}

}  // namespace

TEST_CASE("a lost node with --nnodes 1:2: the survivor finishes from its own checkpoint copy") {
  TwoHosts c;
  const auto recipe = write_recipe(c.tmp.path(), elastic_recipe());
  auto clean = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (c.tmp / "clean").string()});
  REQUIRE(clean.exit_code == 0);

  // Rank 0 runs on the first host: losing it also loses the checkpoints written there.
  const std::string lost = c.sshd.addresses()[1], survivor = c.sshd.addresses()[2];
  const fs::path run_dir = c.tmp / "elastic", events = c.tmp / "events.jsonl";
  auto args = c.launch_args(recipe, run_dir);
  for (const char* a : {"--nnodes", "1:2", "--rejoin-timeout", "2", "--max-restarts", "2",
                        "--restart-backoff", "0.2", "--events"}) {
    args.push_back(a);
  }
  args.push_back(events.string());
  Background job(args, {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "25"}});
  REQUIRE(eventually([&] {
    return fs::exists(c.remote_run(survivor, run_dir) / "checkpoints/step-000050/meta.json");
  }));
  std::vector<pid_t> pids = worker_pids(run_dir);  // the two relays, in host order
  REQUIRE(pids.size() == 2);
  std::optional<LostHost> gone;
  gone.emplace(c.sshd, lost);
  ::kill(pids[0], SIGKILL);  // the launcher's SSH connection to the first host dies
  const int code = job.wait();
  gone.reset();
  INFO(job.out(), job.err());
  REQUIRE(code == 0);

  const json result = parse_json(read_text(run_dir / "result.json"));
  CHECK(result["world_size"] == 1);
  CHECK(result["steps"] == 150);
  const auto changes = events_named(events, "world_size_changed");
  REQUIRE(changes.size() == 1);
  CHECK(changes[0]["from"] == 2);
  CHECK(changes[0]["to"] == 1);
  CHECK(changes[0]["hosts"] == json::array({c.sshd.host(survivor).display()}));
  REQUIRE(changes[0]["lost"].size() == 1);
  CHECK(changes[0]["lost"][0].get<std::string>().find(lost) != std::string::npos);
  // The survivor continued from the checkpoint its own node wrote, not from step 0.
  const json info = parse_json(read_text(run_dir / "run.json"));
  REQUIRE(info["generations"].size() == 2);
  const std::string resumed = info["generations"][1]["resumed_from"];
  CHECK(resumed.rfind("step-0000", 0) == 0);
  CHECK(resumed != "step-000000");
  CHECK(info["generations"][1]["world_size"] == 1);
  CHECK(info["world_size_changes"].size() == 1);
  CHECK(info["nominal_world_size"] == 2);
  // The global batch stayed the same: the held-out loss is that of a fault-free run.
  const double clean_loss = eval_loss(c.tmp / "clean"), loss = eval_loss(run_dir);
  CHECK(std::abs(loss - clean_loss) / clean_loss < 0.02);
  // The launcher's metrics were mirrored from a remote rank 0 and rewound on the restart.
  int64_t previous = 0;
  for (const auto& m : read_jsonl(run_dir / "metrics.jsonl")) {
    if (!m.contains("loss")) continue;  // eval lines repeat their step
    CHECK(m["step"].get<int64_t>() > previous);
    previous = m["step"].get<int64_t>();
  }
  CHECK(previous == 150);
}

TEST_CASE("a host that answers again rejoins: the job grows back to --nnodes MAX at a checkpoint") {
  TwoHosts c;
  const auto recipe = write_recipe(c.tmp.path(), elastic_recipe());
  auto clean = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (c.tmp / "clean").string()});
  REQUIRE(clean.exit_code == 0);

  // The first host (rank 0's) refuses logins at the start: the job starts on the second alone.
  const std::string away = c.sshd.addresses()[1], there = c.sshd.addresses()[2];
  std::optional<LostHost> gone;
  gone.emplace(c.sshd, away);
  const fs::path run_dir = c.tmp / "grow", events = c.tmp / "events.jsonl";
  auto args = c.launch_args(recipe, run_dir);
  for (const char* a : {"--nnodes", "1:2", "--rejoin-timeout", "1", "--events"})
    args.push_back(a);
  args.push_back(events.string());
  Background job(args, {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "40"}});
  REQUIRE(eventually([&] {
    return fs::exists(c.remote_run(there, run_dir) / "checkpoints/step-000025/meta.json");
  }));
  gone.reset();  // it answers again
  const int code = job.wait();
  INFO(job.out(), job.err());
  REQUIRE(code == 0);
  CHECK(job.out().find(c.sshd.host(away).display() + " answers again") != std::string::npos);
  // The ranks' stop for the resize is not one a user must act on: no "dptrain resume" advice.
  CHECK(job.out().find("stopped on request after step ") != std::string::npos);
  CHECK(job.out().find("dptrain resume") == std::string::npos);

  const json result = parse_json(read_text(run_dir / "result.json"));
  CHECK(result["world_size"] == 2);
  CHECK(result["steps"] == 150);
  const auto changes = events_named(events, "world_size_changed");
  REQUIRE(changes.size() == 2);
  CHECK(changes[0]["from"] == 2);
  CHECK(changes[0]["to"] == 1);
  CHECK(changes[1]["from"] == 1);
  CHECK(changes[1]["to"] == 2);
  CHECK(changes[1]["joined"] == json::array({c.sshd.host(away).display()}));
  const auto rejoined = events_named(events, "host_rejoined");
  REQUIRE(rejoined.size() == 1);
  CHECK(rejoined[0]["hosts"] == json::array({c.sshd.host(away).display()}));
  CHECK(events_named(events, "restart").empty());

  // Not a restart: a resize, continuing from the checkpoint the ranks wrote when they stopped.
  const json info = parse_json(read_text(run_dir / "run.json"));
  REQUIRE(info["generations"].size() == 2);
  CHECK(info["generations"][0]["status"] == "resized");
  CHECK(info["generations"][0]["world_size"] == 1);
  CHECK(info["generations"][1]["world_size"] == 2);
  CHECK_FALSE(info.contains("restarts"));
  REQUIRE(info["resizes"].size() == 1);
  const int64_t stopped_after = info["resizes"][0]["after_step"].get<int64_t>();
  CHECK(stopped_after > 25);
  CHECK(stopped_after < 150);
  const std::string resumed = info["generations"][1]["resumed_from"];
  CHECK(resumed == fmt::format("step-{:06d}", stopped_after));
  // The global batch stayed the job's: the held-out loss is that of a fault-free run.
  const double clean_loss = eval_loss(c.tmp / "clean"), loss = eval_loss(run_dir);
  CHECK(std::abs(loss - clean_loss) / clean_loss < 0.02);
}

TEST_CASE("a lost node does not leave a job below --nnodes MIN: exit 4 naming the host") {
  TwoHosts c;
  const auto recipe = write_recipe(c.tmp.path(), elastic_recipe());
  const std::string lost = c.sshd.addresses()[2];
  std::optional<LostHost> gone;
  gone.emplace(c.sshd, lost);
  auto args = c.launch_args(recipe, c.tmp / "short");
  for (const char* a : {"--nnodes", "2:2", "--rejoin-timeout", "1", "--json"})
    args.push_back(a);
  const auto r = run_dptrain(args);
  CHECK(r.exit_code == 4);
  CHECK(r.err.find("only 1 of the 2 host(s) this job needs at least answered") !=
        std::string::npos);
  CHECK(r.err.find(lost) != std::string::npos);
  CHECK(parse_json(r.out)["steps"] == 150);  // planned
  // No generation ran; the run resumes once the host answers, from step 0.
  auto status = run_dptrain({"status", (c.tmp / "short").string(), "--json"});
  REQUIRE(status.exit_code == 0);
  CHECK(parse_json(status.out)["error"].get<std::string>().find("only 1 of the 2") !=
        std::string::npos);
  gone.reset();
  auto resume = c.launch_args(recipe, c.tmp / "short");
  resume[0] = "resume";
  resume.erase(resume.begin() + 1);  // run.json has the recipe
  resume.erase(std::find(resume.begin(), resume.end(), "--run-dir"));
  resume.push_back("--json");
  // The run's --nnodes holds without the flag: fewer hosts than its MIN are refused.
  const fs::path one_host = c.tmp / "one-host";
  c.sshd.write_hostfile(one_host, {c.sshd.addresses()[1]}, 1);
  auto too_few = resume;
  *std::next(std::find(too_few.begin(), too_few.end(), "--hosts")) = one_host.string();
  const auto refused = run_dptrain(too_few);
  CHECK(refused.exit_code == 2);
  CHECK(contains(refused.err,
                 "--hosts: 1 host(s) given, and the run was launched with --nnodes "
                 "2:2 (run.json job_size): give at least 2"));
  const auto resumed = run_dptrain(resume);
  INFO(resumed.err);
  CHECK(resumed.exit_code == 0);
  CHECK(parse_json(resumed.out)["world_size"] == 2);
}

TEST_CASE("--nnodes N waits up to --rejoin-timeout for a host still booting at the start") {
  TwoHosts c;
  const auto recipe = write_recipe(c.tmp.path(), small_recipe());
  std::optional<LostHost> booting;
  booting.emplace(c.sshd, c.sshd.addresses()[2]);
  auto args = c.launch_args(recipe, c.tmp / "late");
  for (const char* a : {"--nnodes", "2:2", "--rejoin-timeout", "60", "--json"})
    args.push_back(a);
  Background job(args);
  std::this_thread::sleep_for(std::chrono::seconds(2));
  booting.reset();  // it is up now
  const int code = job.wait();
  INFO(job.err());
  REQUIRE(code == 0);
  CHECK(job.err().find("waiting up to 60 s (--rejoin-timeout) for hosts to answer: " +
                       c.sshd.host(c.sshd.addresses()[2]).display()) != std::string::npos);
  const json info = parse_json(read_text(c.tmp / "late/run.json"));
  CHECK(info["generations"].size() == 1);
  CHECK(info["generations"][0]["hosts"].size() == 2);
}

TEST_CASE("a host that takes the connection but never speaks SSH holds up neither wait nor stop") {
  TwoHosts c;
  const auto recipe = write_recipe(c.tmp.path(), small_recipe());
  const HeldPort silent(false);  // listens, never accepts: a login waits for its banner
  const std::string silent_host = "127.0.0.1:" + std::to_string(silent.port());
  write_text(c.hostfile, "127.0.0.1 slots=1 port=" + std::to_string(silent.port()) + "\n" +
                             read_text(c.hostfile));
  const auto t0 = std::chrono::steady_clock::now();
  SUBCASE("the wait for it ends at --rejoin-timeout, not at --connect-timeout") {
    // With --rejoin-timeout 0 too: a second after its probe began.
    for (const std::string rejoin : {"2", "0"}) {
      CAPTURE(rejoin);
      const auto started = std::chrono::steady_clock::now();
      auto args = c.launch_args(recipe, c.tmp / ("late" + rejoin));
      for (const std::string& a :
           {std::string("--nnodes"), std::string("1:2"), std::string("--rejoin-timeout"), rejoin,
            std::string("--connect-timeout"), std::string("120")})
        args.push_back(a);
      const auto r = run_dptrain(args);
      INFO(r.out, r.err);
      REQUIRE(r.exit_code == 0);
      CHECK(std::chrono::steady_clock::now() - started < std::chrono::seconds(100));  // not 120
      const json hosts =
          parse_json(read_text(c.tmp / ("late" + rejoin) / "run.json"))["generations"][0]["hosts"];
      CHECK(hosts.size() == 2);
      CHECK_FALSE(contains(hosts.dump(), silent_host));
    }
  }
  SUBCASE("a stop while waiting for it is the stop's, at once: 130, the run interrupted") {
    auto args = c.launch_args(recipe, c.tmp / "stopped");
    for (const char* a :
         {"--nnodes", "3", "--rejoin-timeout", "110", "--connect-timeout", "120", "--json"})
      args.push_back(a);
    Background job(args);
    // Into the probes: its run directory is made, and its first generation not started. The run
    // is this launcher's already: status says running, as a resume would be refused.
    REQUIRE(eventually([&] { return fs::exists(c.tmp / "stopped/run.json"); }));
    const auto waiting = run_dptrain({"status", (c.tmp / "stopped").string(), "--json"});
    CHECK(waiting.exit_code == 0);
    CHECK(parse_json(waiting.out)["status"] == "running");
    CHECK(parse_json(waiting.out)["job_size"] == json{{"min", 3}, {"max", 3}, {"of", "hosts"}});
    const auto text = run_dptrain({"status", (c.tmp / "stopped").string()});
    CHECK(contains(text.out, "world size   not placed yet (--nnodes 3)"));
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    ::kill(job.pid(), SIGINT);
    const int code = job.wait(std::chrono::seconds(60));
    INFO(job.out(), job.err());
    CHECK(code == 130);
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(100));  // not 110 s
    const json out = parse_json(job.out());
    CHECK(out["status"] == "interrupted");
    CHECK(contains(out["error"].get<std::string>(),
                   "stopped by SIGINT while waiting for the hosts to answer; no rank started"));
    const json info = parse_json(read_text(c.tmp / "stopped/run.json"));
    CHECK(info["status"] == "interrupted");
    // What a resume needs to reach the hosts as this launch did.
    const auto given = std::find(args.begin(), args.end(), "--remote-binary");
    REQUIRE(given != args.end());
    CHECK(info["remote"]["remote_binary"] == *(given + 1));
    CHECK(info["env"].is_object());
  }
}

// launch --nnodes 1 --json of small_recipe() on two hosts, the one at `unreachable` refusing
// logins, into RUN_DIR/`name`.
CommandResult launch_one_of_two(TwoHosts& c, const std::string& unreachable,
                                const std::string& name) {
  const auto recipe = write_recipe(c.tmp.path(), small_recipe());
  const LostHost gone(c.sshd, unreachable);
  auto args = c.launch_args(recipe, c.tmp / name);
  for (const char* a : {"--nnodes", "1", "--json"})
    args.push_back(a);
  return run_dptrain(args);
}

TEST_CASE("a spare host stands in for an unreachable one: --nnodes 1 of 2 hosts") {
  TwoHosts c;
  const auto r = launch_one_of_two(c, c.sshd.addresses()[1], "spare");
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json info = parse_json(read_text(c.tmp / "spare/run.json"));
  CHECK(info["generations"][0]["hosts"] ==
        json::array({c.sshd.host(c.sshd.addresses()[2]).display()}));
  // Both hosts it chose among, for a resume's hint.
  CHECK(info["job_hosts"].size() == 2);
  // The host passed over is a warning: on stderr and in --json's.
  const json out = parse_json(r.out);
  REQUIRE(out["warnings"].size() == 1);
  const std::string warning = out["warnings"][0];
  CHECK_MESSAGE(warning.starts_with("passed over: " + c.sshd.host(c.sshd.addresses()[1]).display()),
                warning);
  CHECK(contains(r.err, "dptrain: warning: " + warning + "\n"));
}

TEST_CASE("a spare past the hosts taken is not said to be passed over: --nnodes 1 of 2 hosts") {
  TwoHosts c;
  const auto r = launch_one_of_two(c, c.sshd.addresses()[2], "unneeded");  // the spare: unneeded
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(parse_json(r.out)["warnings"].empty());
  CHECK_FALSE(contains(r.err, "passed over"));
}

TEST_CASE("--nnodes 1:2: a host that answers SSH but cannot run dptrain is left out, not retried") {
  TwoHosts c;
  const auto recipe = write_recipe(c.tmp.path(), small_recipe());
  // "~/" is each host's own home: the binary is installed on the second host only.
  const std::string bare = c.sshd.addresses()[1], installed = c.sshd.addresses()[2];
  fs::create_directories(c.sshd.home(installed) / "bin");
  fs::create_symlink(binary(), c.sshd.home(installed) / "bin/dptrain");
  auto args = c.launch_args(recipe, c.tmp / "bare");
  *(std::find(args.begin(), args.end(), "--remote-binary") + 1) = "~/bin/dptrain";
  for (const char* a : {"--nnodes", "1:2", "--rejoin-timeout", "1", "--max-restarts", "3",
                        "--restart-backoff", "0.1", "--json"})
    args.push_back(a);
  const auto r = run_dptrain(args);
  fs::remove_all(c.sshd.home(installed) / "bin");
  INFO(r.out, r.err);
  REQUIRE(r.exit_code == 0);
  // One restart: the next generation runs without the host, which a probe alone would place
  // again (it answers SSH), to fail the same way until the restarts ran out.
  CHECK(parse_json(r.out)["restarts"] == 1);
  const std::string bare_host = c.sshd.host(bare).display();
  CHECK(r.err.find("without " + bare_host +
                   ": cannot run '~/bin/dptrain' there (no such file or "
                   "command)") != std::string::npos);
  CHECK(r.err.find("(left out of this invocation's generations)") != std::string::npos);
  const json info = parse_json(read_text(c.tmp / "bare/run.json"));
  REQUIRE(info["generations"].size() == 2);
  CHECK(info["generations"][0]["host_refused"] == true);
  CHECK(info["generations"][1]["hosts"] == json::array({c.sshd.host(installed).display()}));

  // Neither host has it (the binary is gone since): the last candidate is not left out (no host
  // would remain) nor placed again: the job ends, saying a restart would meet the same.
  *(std::find(args.begin(), args.end(), "--run-dir") + 1) = (c.tmp / "none").string();
  const auto none = run_dptrain(args);
  INFO(none.err);
  CHECK(none.exit_code == 4);
  CHECK(parse_json(none.out)["restarts"] == 1);
  CHECK(none.err.find("(not restarted: the host would fail the same way again") !=
        std::string::npos);
}

TEST_CASE("with --nnodes, a host name that does not resolve is a host that does not answer") {
  TwoHosts c;
  const auto recipe = write_recipe(c.tmp.path(), small_recipe());
  // First in the hostfile, so it would be the one the store's address is found towards.
  write_text(c.hostfile, "no-such-host.invalid slots=1\n" + read_text(c.hostfile));
  auto args = c.launch_args(recipe, c.tmp / "spare");
  for (const char* a : {"--nnodes", "1:3", "--rejoin-timeout", "1"})
    args.push_back(a);
  const auto r = run_dptrain(args);
  INFO(r.out, r.err);
  REQUIRE(r.exit_code == 0);
  CHECK((r.out + r.err).find("without no-such-host.invalid") != std::string::npos);
  CHECK(parse_json(read_text(c.tmp / "spare/run.json"))["generations"][0]["hosts"].size() == 2);
  // Without --nnodes every host is needed: refused before anything is made.
  auto fixed = c.launch_args(recipe, c.tmp / "fixed");
  const auto r2 = run_dptrain(fixed);
  CHECK(r2.exit_code == 4);
  CHECK(r2.err.find("no-such-host.invalid (--hosts): cannot resolve") != std::string::npos);
  CHECK_FALSE(fs::exists(c.tmp / "fixed"));
}

TEST_CASE("a crash on a run whose rank 0 is remote restarts from the nodes' checkpoint") {
  TwoHosts c;
  const auto r = crash_once_and_restart(c, {});
  CHECK(r.err.find("from the newest checkpoint on the nodes") != std::string::npos);
}

TEST_CASE("node leaders whose run directories are one: only the lower rank writes checkpoints") {
  // Both hosts' --workdir is one directory, as on a shared filesystem: two node leaders writing,
  // verifying and pruning the same checkpoint at once would spoil each other's.
  TwoHosts c;
  const fs::path shared = c.tmp / "shared";
  const auto r = crash_once_and_restart(c, {"--workdir", shared.string()});
  CHECK(r.err.find("node leaders share a run directory (rank 1 with rank 0)") != std::string::npos);
  const json info = parse_json(read_text(c.tmp / "remote/run.json"));
  // One run directory holds every checkpoint, each whole, and no marker or partial write is left.
  const fs::path run_dir = shared / "runs" / ("remote-" + info["id"].get<std::string>());
  const auto verify = run_dptrain({"ckpt", "verify", run_dir.string(), "--all"});
  CHECK_MESSAGE(verify.exit_code == 0, verify.err);
  for (const auto& entry : fs::recursive_directory_iterator(run_dir)) {
    const std::string name = entry.path().filename().string();
    CHECK_MESSAGE(name.rfind(".writer-", 0) != 0, name);
    CHECK_MESSAGE(name.rfind(".tmp-", 0) != 0, name);
  }
}

TEST_CASE("--nproc 1:2: a rank killed by SIGKILL is capacity lost; the job goes on with one") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), elastic_recipe());
  auto clean = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "clean").string()});
  REQUIRE(clean.exit_code == 0);
  const auto r =
      run_dptrain({"launch", recipe.string(), "--nproc", "1:2", "--run-dir",
                   (tmp / "elastic").string(), "--max-restarts", "2", "--restart-backoff", "0.1",
                   "--events", (tmp / "events.jsonl").string()},
                  {{"DPTRAIN_FAULT", "crash@step=60,rank=1,gen=1"}});
  INFO(r.err, r.out);
  REQUIRE(r.exit_code == 0);
  CHECK(r.err.find("dptrain: warning: world size 2 -> 1; global batch 32") != std::string::npos);
  const auto changes = events_named(tmp / "events.jsonl", "world_size_changed");
  REQUIRE(changes.size() == 1);
  CHECK(changes[0]["to"] == 1);
  const auto rendezvous = events_named(tmp / "events.jsonl", "rendezvous_done");
  REQUIRE(rendezvous.size() == 2);
  CHECK(rendezvous[1]["world_size"] == 1);
  CHECK(rendezvous[1]["global_batch"] == 32);
  CHECK(rendezvous[1]["resumed_from"] == "step-000050");
  const double clean_loss = eval_loss(tmp / "clean"), loss = eval_loss(tmp / "elastic");
  CHECK(std::abs(loss - clean_loss) / clean_loss < 0.02);

  // Below the minimum it stops, naming why.
  const auto floor =
      run_dptrain({"launch", recipe.string(), "--nproc", "2:3", "--run-dir",
                   (tmp / "floor").string(), "--max-restarts", "3", "--restart-backoff", "0.1"},
                  {{"DPTRAIN_FAULT", "crash@step=30,rank=1"}});
  CHECK(floor.exit_code == 3);
  CHECK(floor.err.find("only 1 would remain, fewer than the minimum of 2 (--nproc 2:3)") !=
        std::string::npos);
  // Said as the second rank is lost, not after a back-off that announced a restart which could
  // not come: the first loss waited to restart, the second did not.
  CHECK(contains(floor.out + floor.err, "(attempt 1/3)"));
  CHECK_FALSE(contains(floor.out + floor.err, "(attempt 2/3)"));
  const json size = parse_json(read_text(tmp / "floor/run.json"))["job_size"];
  CHECK(size == json{{"min", 2}, {"max", 3}, {"of", "ranks"}});
  CHECK(contains(run_dptrain({"status", (tmp / "floor").string()}).out, "--nproc 2:3)"));

  // A resume without --nproc is as elastic as the launch was, back at its MAX.
  const auto resumed = run_dptrain({"resume", (tmp / "floor").string(), "--json"});
  INFO(resumed.err);
  CHECK(resumed.exit_code == 0);
  CHECK(contains(resumed.err, "on 3 local rank(s) (ranks 2:3)"));
  CHECK(parse_json(resumed.out)["world_size"] == 3);
}

TEST_CASE("two ranks killed by SIGKILL at once are two ranks' capacity lost") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), elastic_recipe());
  // Both die at step 30's start; whichever the launcher reaps first, the other is no casualty of
  // its stop (the launcher sent no SIGKILL).
  const std::map<std::string, std::string> fault = {
      {"DPTRAIN_FAULT", "crash@step=30,rank=1,gen=1;crash@step=30,rank=2,gen=1"}};
  const auto r = run_dptrain({"launch", recipe.string(), "--nproc", "1:3", "--run-dir",
                              (tmp / "one").string(), "--max-restarts", "2", "--restart-backoff",
                              "0.1", "--events", (tmp / "events.jsonl").string()},
                             fault);
  INFO(r.err, r.out);
  REQUIRE(r.exit_code == 0);
  CHECK(contains(r.err, "dptrain: warning: world size 3 -> 1; global batch"));
  const auto changes = events_named(tmp / "events.jsonl", "world_size_changed");
  REQUIRE(changes.size() == 1);
  CHECK(changes[0]["to"] == 1);
  REQUIRE(changes[0]["lost"].size() == 2);
  for (const auto& lost : changes[0]["lost"]) {
    CHECK(contains(lost.get<std::string>(), "killed by SIGKILL"));
  }
  CHECK(contains(changes[0]["lost"].dump(), "rank 1: "));
  CHECK(contains(changes[0]["lost"].dump(), "rank 2: "));
  // An event for each.
  std::set<std::string> exited;
  for (const auto& e : events_named(tmp / "events.jsonl", "rank_exited")) {
    CHECK(e["signal"] == SIGKILL);
    CHECK(e["exit_code"].is_null());
    exited.insert(e["process"].get<std::string>());
  }
  CHECK(exited == std::set<std::string>{"rank 1", "rank 2"});

  // With a minimum of 2 that leaves too few: said at once, naming both.
  const auto floor =
      run_dptrain({"launch", recipe.string(), "--nproc", "2:3", "--run-dir",
                   (tmp / "floor").string(), "--max-restarts", "2", "--restart-backoff", "0.1"},
                  fault);
  INFO(floor.err);
  CHECK(floor.exit_code == 3);
  CHECK(contains(floor.err,
                 "2 ranks were lost (killed by SIGKILL) and only 1 would remain, fewer "
                 "than the minimum of 2 (--nproc 2:3)"));
  CHECK_FALSE(contains(floor.out + floor.err, "(attempt 1/2)"));
}

TEST_CASE("--nproc and --nnodes ranges are checked") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  for (const auto& [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--nproc", "3:2"}, {"--nproc", "0"}, {"--nproc", "1:x"}, {"--nnodes", "1:2"}}) {
    CAPTURE(value);
    const auto r = run_dptrain({"launch", recipe.string(), flag, value, "--dry-run"});
    CHECK(r.exit_code == 2);
    CHECK(r.err.find(flag) != std::string::npos);
  }
}

TEST_CASE("SIGTERM and resume of a run whose rank 0 is remote continue bit-identically") {
  TwoHosts c;
  const auto recipe = write_recipe(c.tmp.path(), elastic_recipe());
  auto clean = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir",
                            (c.tmp / "clean").string(), "--json"});
  REQUIRE(clean.exit_code == 0);
  const fs::path run_dir = c.tmp / "remote";
  Background job(c.launch_args(recipe, run_dir), {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "20"}});
  const bool checkpointed = eventually([&] {
    return fs::exists(c.remote_run(c.sshd.addresses()[1], run_dir) / "checkpoints/step-000025");
  });
  ::kill(job.pid(), SIGTERM);
  const int code = job.wait();
  INFO(job.out(), job.err());
  REQUIRE(checkpointed);
  REQUIRE(code == 143);

  auto args = c.launch_args(recipe, run_dir);
  args.erase(args.begin(), args.begin() + 2);  // "launch RECIPE"
  const auto run_flag = std::find(args.begin(), args.end(), "--run-dir");
  args.erase(run_flag, run_flag + 2);

  // On this machine alone, which holds no checkpoint of it: never "from step 0" unawares. The
  // ranks look for the newest on their nodes, the holder is named, and finding none is exit 5.
  const auto here = run_dptrain({"resume", run_dir.string(), "--hosts", "localhost:1"});
  INFO(here.out, here.err);
  CHECK(here.exit_code == 5);
  CHECK_FALSE(contains(here.out + here.err, "from step 0"));
  CHECK(contains(here.out + here.err, "from the newest checkpoint on its hosts"));
  CHECK(contains(here.err, "which is not among this resume's hosts"));

  // Rank 0 moved here, the holder of the last checkpoint the other host: the ranks continue from
  // its copy, and the records say so (never "step 0").
  const std::string last =
      parse_json(read_text(run_dir / "run.json"))["last_checkpoint"]["name"].get<std::string>();
  SUBCASE("the hosts it ran on, as run.json records them (no --hosts, no SSH flags)") {
    args.clear();
  }
  SUBCASE("rank 0 here") {
    const std::string holder = c.sshd.addresses()[1];
    const fs::path mixed = c.tmp / "mixed.txt", events = c.tmp / "events.jsonl";
    c.sshd.write_hostfile(mixed, {holder});
    write_text(mixed, "localhost slots=1\n" + read_text(mixed));
    const auto hostfile = std::find(args.begin(), args.end(), c.hostfile.string());
    REQUIRE(hostfile != args.end());
    *hostfile = mixed.string();
    args.insert(args.end(), {"--events", events.string()});
  }
  args.insert(args.begin(), {"resume", run_dir.string()});
  args.push_back("--json");
  const auto resumed = run_dptrain(args);
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  CHECK(resumed.err.find("from the newest checkpoint on its hosts") != std::string::npos);
  CHECK(parse_json(resumed.out)["params_checksum"] == parse_json(clean.out)["params_checksum"]);
  const json info = parse_json(read_text(run_dir / "run.json"));
  CHECK(info["generations"].back()["resumed_from"] == last);
  if (fs::exists(c.tmp / "events.jsonl")) {
    const auto started = events_named(c.tmp / "events.jsonl", "generation_started");
    REQUIRE(started.size() == 1);
    CHECK(started[0]["resumed_from"].is_null());
    const auto met = events_named(c.tmp / "events.jsonl", "rendezvous_done");
    REQUIRE(met.size() == 1);
    CHECK(met[0]["resumed_from"] == last);
  }
}

TEST_CASE("an elastic resume stopped while it waits for its hosts leaves the run's settings") {
  TwoHosts c;
  const auto recipe = write_recipe(c.tmp.path(), elastic_recipe());
  const fs::path run_dir = c.tmp / "remote";
  Background job(c.launch_args(recipe, run_dir), {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "20"}});
  const bool checkpointed = eventually([&] {
    return fs::exists(c.remote_run(c.sshd.addresses()[2], run_dir) / "checkpoints/step-000050");
  });
  ::kill(job.pid(), SIGTERM);
  REQUIRE(job.wait() == 143);
  REQUIRE(checkpointed);
  const json before = parse_json(read_text(run_dir / "run.json"));
  // Both hosts needed, one refusing logins: it waits for it, with an --env of its own, and is
  // stopped there. What the next resume defaults to is what ran.
  const LostHost gone(c.sshd, c.sshd.addresses()[1]);
  auto args = c.launch_args(recipe, run_dir);
  args.erase(args.begin(), args.begin() + 2);  // "launch RECIPE"
  const auto run_flag = std::find(args.begin(), args.end(), "--run-dir");
  args.erase(run_flag, run_flag + 2);
  args.insert(args.begin(), {"resume", run_dir.string()});
  for (const char* a : {"--nnodes", "2", "--rejoin-timeout", "120", "--env", "DPTRAIN_TEST_NEW=1"})
    args.push_back(a);
  Background resume(args);
  REQUIRE(
      eventually([&] { return parse_json(read_text(run_dir / "run.json")).contains("placing"); }));
  ::kill(resume.pid(), SIGTERM);
  CHECK(resume.wait() == 143);
  INFO(resume.out(), resume.err());
  const json after = parse_json(read_text(run_dir / "run.json"));
  for (const char* key : {"hosts", "job_hosts", "remote", "env", "job_size", "world_size"}) {
    CAPTURE(key);
    CHECK(after.value(key, json()) == before.value(key, json()));
  }
}

TEST_CASE("resume --nnodes 1:2 with a host gone continues on the other from its checkpoint copy") {
  TwoHosts c;
  const auto recipe = write_recipe(c.tmp.path(), elastic_recipe());
  auto clean = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (c.tmp / "clean").string()});
  REQUIRE(clean.exit_code == 0);
  const fs::path run_dir = c.tmp / "remote", events = c.tmp / "events.jsonl";
  Background job(c.launch_args(recipe, run_dir), {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "20"}});
  const bool checkpointed = eventually([&] {
    return fs::exists(c.remote_run(c.sshd.addresses()[2], run_dir) / "checkpoints/step-000050");
  });
  ::kill(job.pid(), SIGTERM);
  const int code = job.wait();
  INFO(job.out(), job.err());
  REQUIRE(checkpointed);
  REQUIRE(code == 143);

  // The ranges are checked as launch checks them (--nnodes without --hosts: among the hosts
  // run.json records).
  for (const auto& [flag, value] :
       std::vector<std::pair<std::string, std::string>>{{"--nproc", "3:2"}, {"--nnodes", "3:2"}}) {
    CAPTURE(value);
    const auto bad = run_dptrain({"resume", run_dir.string(), flag, value});
    CHECK(bad.exit_code == 2);
    CHECK(bad.err.find(flag) != std::string::npos);
  }

  // The other host's copy of the last checkpoint is gone: the newest it holds is older.
  const json stopped = parse_json(read_text(run_dir / "run.json"));
  const std::string last = stopped["last_checkpoint"]["name"];
  const int64_t last_step = stopped["last_checkpoint"]["step"];
  const std::string holder = c.sshd.host(c.sshd.addresses()[1]).display();
  REQUIRE(stopped["last_checkpoint"]["host"] == holder);
  fs::remove_all(c.remote_run(c.sshd.addresses()[2], run_dir) / "checkpoints" / last);

  // Rank 0's host (and its checkpoints) is gone, or left out of the resume's hosts: the other
  // continues from its own older copy, and the user is told so (left out: as the resume starts,
  // that it may be older), or both answer and the holder's copy is gone too.
  std::optional<LostHost> gone;
  bool left_out = false, removed = false;
  SUBCASE("gone") {
    gone.emplace(c.sshd, c.sshd.addresses()[1]);
  }
  SUBCASE("left out") {
    left_out = true;
    c.sshd.write_hostfile(c.hostfile, {c.sshd.addresses()[2]}, 1);
  }
  SUBCASE("its copy on its host removed") {
    removed = true;
    fs::remove_all(c.remote_run(c.sshd.addresses()[1], run_dir) / "checkpoints" / last);
  }
  auto args = c.launch_args(recipe, run_dir);
  args.erase(args.begin(), args.begin() + 2);  // "launch RECIPE"
  const auto run_flag = std::find(args.begin(), args.end(), "--run-dir");
  args.erase(run_flag, run_flag + 2);
  args.insert(args.begin(), {"resume", run_dir.string()});
  for (const std::string& a :
       std::vector<std::string>{"--rejoin-timeout", "1", "--events", events.string()})
    args.push_back(a);
  if (!left_out) args.insert(args.end(), {"--nnodes", "1:2"});
  const auto resumed = run_dptrain(args);
  INFO(resumed.out, resumed.err);
  REQUIRE(resumed.exit_code == 0);
  CHECK(contains(resumed.out, "(hosts 1:2)") != left_out);
  CHECK(contains(resumed.err, "dptrain: warning: the last recorded checkpoint (step ") == left_out);
  CHECK(contains(resumed.err, "is on " + holder + ", which is not among this resume's hosts") ==
        left_out);
  // Once the ranks met: from which step, and the steps trained again (said once).
  const json info = parse_json(read_text(run_dir / "run.json"));
  const std::string from = info["generations"].back()["resumed_from"];
  CHECK(from.rfind("step-0000", 0) == 0);
  CHECK(from != "step-000000");
  const int64_t from_step = std::stoll(from.substr(5));
  CHECK(from_step < last_step);
  const std::string behind = fmt::format(
      "dptrain: warning: the ranks of generation {} continue from step {}, older than the last "
      "recorded checkpoint (step {}, ",
      info["generations"].back()["generation"].get<int>(), from_step, last_step);
  CHECK(contains(resumed.err, behind) != left_out);
  CHECK(contains(resumed.err, fmt::format("{}), as {} is not among this generation's hosts: "
                                          "steps {} to {} are trained again",
                                          holder, holder, from_step + 1, last_step)) == bool(gone));
  CHECK(contains(resumed.err,
                 holder + "), whose copy there could not be used (damaged, removed or another "
                          "recipe's): steps ") == removed);
  const auto changes = events_named(events, "world_size_changed");
  REQUIRE(changes.size() == (removed ? 0 : 1));
  if (!removed) {
    CHECK(changes[0]["from"] == 2);
    CHECK(changes[0]["to"] == 1);
  }
  const json result = parse_json(read_text(run_dir / "result.json"));
  CHECK(result["world_size"] == (removed ? 2 : 1));
  CHECK(result["steps"] == 150);
  CHECK(info["nominal_world_size"] == 2);
  const double clean_loss = eval_loss(c.tmp / "clean"), loss = eval_loss(run_dir);
  CHECK(std::abs(loss - clean_loss) / clean_loss < 0.02);
}
