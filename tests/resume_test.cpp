// Failures and recovery with real processes: SIGKILL a rank, resume bit-identically, corrupt
// checkpoints, Ctrl-C, a killed launcher, and no orphans in any of these.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <thread>

#include <fmt/format.h>

#include "core/comm/communicator.hpp"
#include "tests/damage.hpp"
#include "tests/harness.hpp"
#include "tests/sshd.hpp"
#include "tests/strings.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;

namespace {

bool has_checkpoint(const fs::path& run_dir) {
  return fs::exists(run_dir / "checkpoints/latest");
}

void check_all_gone(const std::vector<pid_t>& pids) {
  for (pid_t p : pids) {
    CAPTURE(p);
    CHECK(eventually([p] { return !process_alive(p); }, std::chrono::seconds(10)));
  }
}

// Runs the recipe slowly in the background until it has a checkpoint and workers are known.
struct SlowRun {
  fs::path run_dir;
  Background launcher;
  std::vector<pid_t> pids;
  SlowRun(const fs::path& recipe, const fs::path& dir, const std::vector<std::string>& more = {},
          Env env = {})
      : run_dir(dir), launcher(launch_args(recipe, dir, more), slow(std::move(env))) {
    REQUIRE(eventually([&] { return has_checkpoint(run_dir); }));
    pids = worker_pids(run_dir);
    REQUIRE(pids.size() == 2);
  }
  static Env slow(Env env) {
    env["DPTRAIN_DEBUG_STEP_DELAY_MS"] = "30";
    return env;
  }
  static std::vector<std::string> launch_args(const fs::path& recipe, const fs::path& dir,
                                              const std::vector<std::string>& more) {
    std::vector<std::string> args = {"launch", recipe.string(), "--nproc",
                                     "2",      "--run-dir",     dir.string()};
    args.insert(args.end(), more.begin(), more.end());
    return args;
  }
};

// A finished 2-rank run of `recipe` in run_dir, recorded as failed after its last checkpoint (as
// if it had died then: resume leaves a completed run alone).
void launch_as_failed(const fs::path& recipe, const fs::path& run_dir) {
  REQUIRE(run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string()})
              .exit_code == 0);
  auto info = parse_json(read_text(run_dir / "run.json"));
  info["status"] = "failed";
  write_text(run_dir / "run.json", info.dump());
}

}  // namespace

TEST_CASE("a stop or a failure on 8 ranks shows a few ranks' alike lines and counts the rest") {
  TempDir tmp;
  auto r = resumable_recipe();
  r["train"]["steps"] = 400;
  r["train"]["batch_per_rank"] = 4;
  const auto recipe = write_recipe(tmp.path(), r);
  const auto run8 = [&](const std::string& dir) {
    return std::make_unique<Background>(
        std::vector<std::string>{"launch", recipe.string(), "--nproc", "8", "--run-dir",
                                 (tmp / dir).string()},
        Env{{"DPTRAIN_DEBUG_STEP_DELAY_MS", "30"}});
  };
  const auto logs_with = [&](const std::string& dir, std::string_view what) {
    int n = 0;
    for (int rank = 0; rank < 8; ++rank) {
      const auto log = read_text(tmp / dir / fmt::format("logs/localhost-rank{}.log", rank));
      n += contains(log, std::string(what)) ? 1 : 0;
    }
    return n;
  };
  // N of the summary line "dptrain: N more rank(s) WHAT (...)"; 0 where there is none.
  const auto more = [](const std::string& out, const std::string& what) {
    std::smatch m;
    const std::regex line("dptrain: ([0-9]+) more ranks? " + what + " \\(");
    return std::regex_search(out, m, line) ? std::stoi(m[1].str()) : 0;
  };
  SUBCASE("SIGTERM: every rank says it received it; four reach the console") {
    auto launch = run8("stopped");
    REQUIRE(eventually([&] { return read_jsonl(tmp / "stopped/metrics.jsonl").size() >= 2; }));
    ::kill(launch->pid(), SIGTERM);
    CHECK(launch->wait(std::chrono::seconds(120)) == 143);
    INFO(launch->out(), launch->err());
    CHECK(count_occurrences(launch->out(), "received SIGTERM: rank") == 4);
    CHECK(contains(launch->out(),
                   "dptrain: 4 more ranks received SIGTERM (each rank's log has its line)"));
    CHECK(logs_with("stopped", "received SIGTERM: rank") == 8);
    CHECK(contains(launch->err(), "stopped by SIGTERM; every rank checkpointed its last step"));
  }
  SUBCASE("a rank killed: its peers' failed collectives are shown four times at most") {
    auto launch = run8("failed");
    REQUIRE(eventually([&] { return read_jsonl(tmp / "failed/metrics.jsonl").size() >= 2; }));
    const auto pids = worker_pids(tmp / "failed");
    REQUIRE(pids.size() == 8);
    REQUIRE(::kill(pids[5], SIGKILL) == 0);
    CHECK(launch->wait(std::chrono::seconds(120)) == 3);
    INFO(launch->out(), launch->err());
    CHECK(contains(launch->err(), "rank 5 (pid "));
    const auto shown =
        static_cast<int>(count_occurrences(launch->out(), std::string(dptrain::kPeerGoneNote)));
    CHECK(shown <= 4);
    // None lost: each follower's line is on the console or counted there, and in its log; so
    // too each "received SIGTERM" of a rank the launcher stopped for it.
    CHECK(shown + more(launch->out(), "failed as a peer left") ==
          logs_with("failed", dptrain::kPeerGoneNote));
    const auto sigterms = static_cast<int>(count_occurrences(launch->out(), "received SIGTERM:"));
    CHECK(sigterms <= 4);
    CHECK(sigterms + more(launch->out(), "received SIGTERM") ==
          logs_with("failed", "received SIGTERM:"));
    check_all_gone(pids);
  }
}

TEST_CASE("SIGKILL of one rank: launcher exits 3 naming it; resume finishes bit-identically") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  auto straight = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "straight").string()});
  REQUIRE(straight.exit_code == 0);

  // The kernel's OOM kill counter, as the launcher reads it: the kill below comes with one.
  write_text(tmp / "vmstat", "pgfault 100\noom_kill 7\n");
  SlowRun run(recipe, tmp / "crashed", {}, {{"DPTRAIN_TEST_VMSTAT", (tmp / "vmstat").string()}});
  write_text(tmp / "vmstat", "pgfault 100\noom_kill 8\n");
  REQUIRE(::kill(run.pids[1], SIGKILL) == 0);
  const int code = run.launcher.wait(std::chrono::seconds(60));
  const std::string err = run.launcher.err();
  INFO(err);
  CHECK(code == 3);
  CHECK(err.find("rank 1") != std::string::npos);
  CHECK(err.find("SIGKILL); the kernel's OOM killer killed a process since the ranks started") !=
        std::string::npos);
  check_all_gone(run.pids);
  const auto info = parse_json(read_text(run.run_dir / "run.json"));
  CHECK(info["status"] == "failed");
  // It really stopped mid-run.
  CHECK_FALSE(fs::exists(run.run_dir / "checkpoints/step-000120"));

  auto resumed = run_dptrain({"resume", run.run_dir.string(), "--json"});
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  const auto out = parse_json(resumed.out);
  CHECK(out["status"] == "completed");
  CHECK(out["steps"] == 120);
  CHECK(read_text(latest_params(run.run_dir)) == read_text(latest_params(tmp / "straight")));
  const auto after = parse_json(read_text(run.run_dir / "run.json"));
  CHECK(after["generations"].size() == 2);
  CHECK(after["generations"][1].contains("resumed_from"));
  // metrics.jsonl holds each step once, whatever the crash had logged past the checkpoint.
  std::vector<int64_t> steps;
  for (const auto& m : read_jsonl(run.run_dir / "metrics.jsonl")) {
    if (m.contains("loss")) steps.push_back(m["step"].get<int64_t>());
  }
  CHECK(std::is_sorted(steps.begin(), steps.end()));
  CHECK(std::adjacent_find(steps.begin(), steps.end()) == steps.end());
}

TEST_CASE(
    "resume on data that changed since the checkpoint refuses, naming it; restored, it goes on") {
  TempDir tmp;
  // A CSV dataset: 5 classes of 32 features, separable.
  const auto csv_text = [](double shift) {
    std::string text = "label";
    for (int f = 0; f < 32; ++f)
      text += ",f" + std::to_string(f);
    text += "\n";
    for (int i = 0; i < 600; ++i) {
      const int label = i % 5;
      text += std::to_string(label);
      for (int f = 0; f < 32; ++f)
        text += "," + std::to_string((f % 5 == label ? 2.0 : 0.0) + 0.01 * ((i * 7 + f) % 13) +
                                     (i == 17 ? shift : 0.0));
      text += "\n";
    }
    return text;
  };
  write_text(tmp / "data.csv", csv_text(0.0));
  auto recipe = resumable_recipe();
  recipe["data"] = {{"type", "csv"}, {"path", "data.csv"}};
  const auto path = write_recipe(tmp.path(), recipe);
  const fs::path run = tmp / "run";
  auto failed = run_dptrain(
      {"launch", path.string(), "--nproc", "2", "--run-dir", run.string(), "--max-restarts", "0"},
      {{"DPTRAIN_FAULT", "exit@step=50,rank=1,code=7"}});
  REQUIRE(failed.exit_code == 3);
  REQUIRE(fs::exists(run / "checkpoints/step-000040"));
  const std::string meta = read_text(run / "checkpoints/step-000040/meta.json");
  CHECK(parse_json(meta)["data_fingerprint"].get<std::string>().rfind("values ", 0) == 0);

  // One value of one row changed: the run would no longer be the one it checkpointed.
  write_text(tmp / "data.csv", csv_text(0.5));
  auto refused = run_dptrain({"resume", run.string(), "--json"});
  INFO(refused.err);
  CHECK(refused.exit_code == 3);
  // It failed as it started: the step reached is the one it continued from, as status says.
  CHECK(parse_json(refused.out)["step"] == 40);
  CHECK(parse_json(run_dptrain({"status", run.string(), "--json"}).out)["step"].get<int>() >= 40);
  CHECK(refused.err.find("exited with code 2: " + (run / "checkpoints/step-000040").string() +
                         ": written while training on other data: values ") != std::string::npos);
  CHECK(refused.err.find("(data.path " + (tmp / "data.csv").string() +
                         "): a resume on it would not continue the same run") != std::string::npos);
  // Where it was: starting, not at a "step 0" a run at step 40 never went back to.
  CHECK(contains(refused.err, "; its last heartbeat: start-up, "));
  CHECK_FALSE(contains(refused.err, "heartbeat: step 0"));
  // Not restarted (an exit 2 would meet the same data again), nothing set aside.
  CHECK(parse_json(read_text(run / "run.json"))["generations"].size() == 2);
  CHECK(read_text(run / "checkpoints/step-000040/meta.json") == meta);

  // Moved away: the run's own data is to be put back, nothing is started.
  fs::remove(tmp / "data.csv");
  auto gone = run_dptrain({"resume", run.string(), "--json"});
  CHECK(gone.exit_code == 2);
  CHECK_MESSAGE(gone.err.find("\n  this is the run's own data: put it back where the run had it") !=
                    std::string::npos,
                gone.err);
  CHECK(parse_json(read_text(run / "run.json"))["generations"].size() == 2);
  // Back, but with a later row wrong (found as the ranks would read every row): named where
  // run.json holds the path, with the same hint.
  write_text(tmp / "data.csv", csv_text(0.0) + "1,2\n");
  auto bad_row = run_dptrain({"resume", run.string(), "--json"});
  CHECK(bad_row.exit_code == 2);
  CHECK_MESSAGE(contains(bad_row.err, (run / "run.json").string() + ": /recipe/data/path: "),
                bad_row.err);
  CHECK(contains(bad_row.err, "\n  this is the run's own data: put it back"));
  CHECK(parse_json(read_text(run / "run.json"))["generations"].size() == 2);

  write_text(tmp / "data.csv", csv_text(0.0));
  auto resumed = run_dptrain({"resume", run.string(), "--json"});
  INFO(resumed.err);
  CHECK(resumed.exit_code == 0);
  CHECK(parse_json(resumed.out)["status"] == "completed");
}

TEST_CASE("resume on another world size reshards and completes") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  SlowRun run(recipe, tmp / "run");
  ::kill(run.pids[0], SIGKILL);
  CHECK(run.launcher.wait(std::chrono::seconds(60)) == 3);
  {
    // A run on hosts, resumed with --nproc and no --hosts: refused (its checkpoints are on its
    // hosts), giving them as a hostfile's lines (their "user@host:port" pasted into the --hosts
    // list would make each port a slot count).
    const std::string kept = read_text(run.run_dir / "run.json");
    auto info = parse_json(kept);
    info["hosts"] = nlohmann::json::array({{{"host", "alice@10.0.0.1:2222"}, {"slots", 2}},
                                           {{"host", "[fd00::2]:2200"}, {"slots", 1}},
                                           {{"host", "node3.invalid"}, {"slots", 4}}});
    write_text(run.run_dir / "run.json", info.dump());
    auto hosts = run_dptrain({"resume", run.run_dir.string(), "--nproc", "2"});
    CHECK(hosts.exit_code == 2);
    CHECK(hosts.err == "dptrain: error: --nproc: " + run.run_dir.string() +
                           " used hosts: resume without --nproc to use them again, or give "
                           "--hosts FILE (they were, as a hostfile's lines: '10.0.0.1 slots=2 "
                           "user=alice port=2222', 'fd00::2 slots=1 port=2200', 'node3.invalid "
                           "slots=4')\n");
    // Without --nproc the resume goes on on them: here one does not resolve (exit 4, run.json
    // as it was).
    auto on_recorded = run_dptrain({"resume", run.run_dir.string()});
    CHECK(on_recorded.exit_code == 4);
    CHECK(contains(on_recorded.err, "node3.invalid"));
    // This record does not say which SSH files its launch used (as one of an older dptrain).
    CHECK(contains(on_recorded.err,
                   "dptrain: warning: " + (run.run_dir / "run.json").string() +
                       " does not say which --identity and --known-hosts its launch used"));
    // --nnodes chooses among the recorded hosts, and says so when it asks for more.
    const auto too_many = run_dptrain({"resume", run.run_dir.string(), "--nnodes", "4"});
    CHECK(too_many.exit_code == 2);
    CHECK(contains(too_many.err, "--nnodes 4: only 3 host(s) recorded in " +
                                     (run.run_dir / "run.json").string()));
    CHECK(read_text(run.run_dir / "run.json") == info.dump());
    // An elastic job's every host, those its last generation lost too.
    info["job_hosts"] = nlohmann::json::array(
        {{{"host", "node3"}, {"slots", 4}}, {{"host", "node4"}, {"slots", 4}}});
    write_text(run.run_dir / "run.json", info.dump());
    CHECK(contains(run_dptrain({"resume", run.run_dir.string(), "--nproc", "1"}).err,
                   "as a hostfile's lines: 'node3 slots=4', 'node4 slots=4')"));
    write_text(run.run_dir / "run.json", kept);
  }
  auto resumed = run_dptrain({"resume", run.run_dir.string(), "--nproc", "1", "--json"});
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  CHECK(parse_json(resumed.out)["world_size"] == 1);
  // The change of size is on record, as an elastic job's is.
  const auto info = parse_json(read_text(run.run_dir / "run.json"));
  REQUIRE(info["world_size_changes"].size() == 1);
  CHECK(info["world_size_changes"][0]["from"] == 2);
  CHECK(info["world_size_changes"][0]["to"] == 1);
  CHECK(resumed.err.find("world size 2 -> 1") != std::string::npos);
}

TEST_CASE("a corrupt or truncated newest checkpoint is skipped; none valid exits 5") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  auto straight = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "straight").string()});
  REQUIRE(straight.exit_code == 0);
  // Checkpoints 80, 100, 120 remain (keep 3). Corrupt 120 and truncate 100: resume must use 80.
  const fs::path ck = tmp / "straight/checkpoints";
  const std::string expected = read_text(ck / "step-000120/params.bin");
  {
    std::fstream f(ck / "step-000120/params.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(17);
    f.put('\x7f');
  }
  fs::resize_file(ck / "step-000100/optimizer.bin", 10);
  // As if the run had died after its last checkpoint (resume leaves a completed run alone).
  auto info = parse_json(read_text(tmp / "straight/run.json"));
  info["status"] = "failed";
  write_text(tmp / "straight/run.json", info.dump());
  auto resumed = run_dptrain({"resume", (tmp / "straight").string()});
  INFO(resumed.err, resumed.out);
  REQUIRE(resumed.exit_code == 0);
  CHECK(resumed.err.find("dptrain: warning: skipping checkpoint step-000120") != std::string::npos);
  CHECK(resumed.err.find("checksum mismatch") != std::string::npos);
  CHECK(resumed.err.find("dptrain: warning: skipping checkpoint step-000100") != std::string::npos);
  CHECK(resumed.out.find("resuming") != std::string::npos);
  CHECK(resumed.out.find("step-000080") != std::string::npos);
  // The corrupt ones were set aside, not deleted.
  CHECK(fs::exists(ck / "step-000120.corrupt"));
  CHECK(fs::exists(ck / "step-000100.corrupt"));
  CHECK(read_text(latest_params(tmp / "straight")) == expected);

  // Damaged again at a step set aside before: the first one set aside stays as it was, the new
  // one goes beside it.
  const std::string aside_before = read_text(ck / "step-000120.corrupt/params.bin");
  fs::resize_file(ck / "step-000120/params.bin", 10);
  info = parse_json(read_text(tmp / "straight/run.json"));
  info["status"] = "failed";
  write_text(tmp / "straight/run.json", info.dump());
  auto again = run_dptrain({"resume", (tmp / "straight").string(), "--json"});
  INFO(again.out, again.err);
  REQUIRE(again.exit_code == 0);
  CHECK(contains(again.err, "dptrain: warning: set aside step-000120 as step-000120.corrupt-2"));
  // Its JSON says where it continued from, and what it passed over on the way.
  const auto again_out = parse_json(again.out);
  CHECK(again_out["resumed_from"] == "step-000100");
  CHECK(again_out["began_at_step"] == 100);
  const auto warned = again_out["warnings"];
  REQUIRE(warned.is_array());
  CHECK(std::any_of(warned.begin(), warned.end(), [](const nlohmann::json& w) {
    return w.get<std::string>().starts_with("skipping checkpoint step-000120");
  }));
  CHECK(std::count(warned.begin(), warned.end(),
                   nlohmann::json("set aside step-000120 as step-000120.corrupt-2")) == 1);
  CHECK(read_text(ck / "step-000120.corrupt/params.bin") == aside_before);
  CHECK(fs::file_size(ck / "step-000120.corrupt-2/params.bin") == 10);
  CHECK(read_text(latest_params(tmp / "straight")) == expected);
  // Reports count them apart from the checkpoints a resume may use.
  const auto summary = parse_json(run_dptrain({"report", (tmp / "straight").string(), "--json",
                                               "--out", (tmp / "straight.html").string()})
                                      .out);
  CHECK(summary["checkpoints_set_aside"] == 3);
  // status's text says so too, beside the newest (whose checksums it does not check).
  CHECK(contains(run_dptrain({"status", (tmp / "straight").string()}).out,
                 "checkpoint   step-000120 (the newest; checksums not checked); 3 set aside by a "
                 "resume: they failed verification"));
  CHECK(summary["checkpoints"] == 3);
  CHECK(summary["checkpoints_failed"] == 0);
  const auto list = parse_json(
      run_dptrain({"ckpt", "list", (tmp / "straight").string(), "--json"}).out)["checkpoints"];
  CHECK(std::count_if(list.begin(), list.end(), [](const nlohmann::json& c) {
          return c["set_aside"] == true && c["step"] == 120;
        }) == 2);

  // Now break every checkpoint (of a run that again did not finish).
  info = parse_json(read_text(tmp / "straight/run.json"));
  info["status"] = "failed";
  write_text(tmp / "straight/run.json", info.dump());
  for (const auto& e : fs::directory_iterator(ck)) {
    if (e.is_directory()) fs::remove(e.path() / "meta.json");
  }
  const std::string run_json = read_text(tmp / "straight/run.json");
  auto none = run_dptrain({"resume", (tmp / "straight").string(), "--events",
                           (tmp / "events.jsonl").string(), "--json"});
  CHECK(none.exit_code == 5);
  CHECK(none.err.find("no valid checkpoint") != std::string::npos);
  // Its JSON error says why each checkpoint was passed over, not only on stderr.
  const auto none_error = parse_json(none.out)["error"].get<std::string>();
  CHECK(contains(none_error, "no valid checkpoint to resume from\n  skipping checkpoint step-"));
  CHECK(contains(none_error, "meta.json"));
  // Its events stream still ends with run_finished, for the pipeline that waits for one; the
  // run's record is as it was.
  const auto events = read_jsonl(tmp / "events.jsonl");
  REQUIRE_FALSE(events.empty());
  CHECK(events.back()["event"] == "run_finished");
  CHECK(events.back()["exit_code"] == 5);
  CHECK(events.back()["status"] == "error");  // as the --json outcome's: refused, not a failed run
  CHECK(events.back()["error"].get<std::string>().starts_with("the resume did not start: "));
  CHECK(read_text(tmp / "straight/run.json") == run_json);

  // So does one refused before its stream is opened: a run.json that does not read, a run
  // directory that is not there (named absolute, as the other events name it).
  fs::create_directory(tmp / "torn");
  write_text(tmp / "torn/run.json", run_json.substr(0, run_json.size() / 2));
  for (const fs::path& dir : {tmp / "torn", tmp / "missing"}) {
    CAPTURE(dir);
    const fs::path stream = tmp / (dir.filename().string() + ".jsonl");
    auto refused = run_dptrain({"resume", dir.string(), "--events", stream.string()});
    CHECK(refused.exit_code == 2);
    const auto ended = read_jsonl(stream);
    REQUIRE(ended.size() == 1);
    CHECK(ended[0]["event"] == "run_finished");
    CHECK(ended[0]["exit_code"] == 2);
    CHECK(ended[0]["run_dir"] == dir.string());
    CHECK(ended[0]["error"].get<std::string>().starts_with("the resume did not start: " +
                                                           dir.string()));
  }
  // launch's --dry-run is no resume option: refused as any unknown one, and the stream ended.
  const fs::path dry = tmp / "dry.jsonl";
  auto refused =
      run_dptrain({"resume", (tmp / "torn").string(), "--events", dry.string(), "--dry-run"});
  CHECK(refused.exit_code == 2);
  CHECK(contains(refused.err, "unknown option '--dry-run'"));
  const auto ended = read_jsonl(dry);
  REQUIRE(ended.size() == 1);
  CHECK(ended[0]["event"] == "run_finished");
}

TEST_CASE(
    "resume of a run that ended after its final checkpoint adds nothing, keeps its measures") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const fs::path run = tmp / "run";
  launch_as_failed(recipe, run);  // as if it died after its final checkpoint
  const std::string metrics = read_text(run / "metrics.jsonl");
  const nlohmann::json before = parse_json(read_text(run / "result.json"));
  const fs::path last = run / "checkpoints" / read_text(run / "checkpoints/latest").substr(0, 11);
  const auto written = fs::last_write_time(last / "meta.json");
  auto resumed = run_dptrain({"resume", run.string(), "--json"});
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  // No second evaluation line, no checkpoint written again, and the throughput the run
  // measured (this process trained no step) in result.json and the outcome.
  CHECK(read_text(run / "metrics.jsonl") == metrics);
  CHECK(fs::last_write_time(last / "meta.json") == written);
  const nlohmann::json after = parse_json(read_text(run / "result.json"));
  for (const char* key : {"samples_per_s", "phases_ms", "comm_total_ms", "bytes_per_step",
                          "params_checksum", "final_loss", "eval_loss", "steps"}) {
    CAPTURE(key);
    CHECK(after[key] == before[key]);
  }
  CHECK(after["samples_per_s"].is_number());
  CHECK(parse_json(resumed.out)["samples_per_s"] == before["samples_per_s"]);
  CHECK(parse_json(read_text(run / "run.json"))["status"] == "completed");

  // Without the run's result.json to keep them from, what no step here measured is null, not 0.
  launch_as_failed(recipe, tmp / "bare");
  fs::remove(tmp / "bare/result.json");
  auto info = parse_json(read_text(tmp / "bare/run.json"));
  info.erase("result");
  write_text(tmp / "bare/run.json", info.dump());
  auto bare = run_dptrain({"resume", (tmp / "bare").string(), "--json"});
  INFO(bare.err);
  REQUIRE(bare.exit_code == 0);
  const nlohmann::json measured = parse_json(bare.out);
  for (const char* key : {"samples_per_s", "comm_total_ms", "bytes_per_step"}) {
    CAPTURE(key);
    CHECK(measured[key].is_null());
  }
  for (const auto& [phase, ms] : measured["phases_ms"].items()) {
    CAPTURE(phase);
    CHECK(ms.is_null());
  }
  CHECK(measured["phases_ms"].size() == 4);
}

TEST_CASE("a directory or a pipe where a run's file belongs stops resume before any rank starts") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const fs::path run = tmp / "run";
  launch_as_failed(recipe, run);
  const std::string run_json = read_text(run / "run.json");
  for (const std::string name : {"metrics.jsonl", "recipe.json", "checkpoints/latest"}) {
    for (const bool pipe : {false, true}) {
      CAPTURE(name);
      CAPTURE(pipe);
      const fs::path file = run / name;
      fs::rename(file, tmp / "kept");
      if (pipe) {
        REQUIRE(::mkfifo(file.c_str(), 0644) == 0);
      } else {
        fs::create_directory(file);
      }
      const auto r = run_dptrain({"resume", run.string()});
      CHECK(r.exit_code == 2);
      CHECK(r.err == "dptrain: error: " + file.string() + ": is " +
                         (pipe ? "a pipe" : "a directory") +
                         ", not a regular file: dptrain writes this file itself; move it away\n");
      CHECK(r.out.empty());
      CHECK(read_text(run / "run.json") == run_json);
      fs::remove(file);
      fs::rename(tmp / "kept", file);
    }
  }
  // And a file where the run keeps a directory of its own.
  for (const std::string name : {"logs", "checkpoints"}) {
    CAPTURE(name);
    const fs::path dir = run / name;
    fs::rename(dir, tmp / "kept");
    write_text(dir, "");
    const auto r = run_dptrain({"resume", run.string()});
    CHECK(r.exit_code == 2);
    CHECK(contains(r.err, "dptrain: error: " + dir.string() +
                              ": not a directory, where the run "
                              "keeps its " +
                              name + "; move it away\n"));
    CHECK(read_text(run / "run.json") == run_json);
    fs::remove(dir);
    fs::rename(tmp / "kept", dir);
  }
}

TEST_CASE("a newest checkpoint out of reach (a permission) stops resume: nothing skipped or lost") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const fs::path run_dir = tmp / "run";
  launch_as_failed(recipe, run_dir);
  const fs::path ck = run_dir / "checkpoints";
  fs::permissions(ck / "step-000120/params.bin", fs::perms::none);
  // Root reads any file: as root, the commands run as the unprivileged owner of the run.
  // (A copy of the binary: the build tree may be where that user cannot reach.)
  std::string as_owner;
  fs::path program = binary();
  if (::geteuid() == 0 && std::system("command -v setpriv > /dev/null") != 0) {
    MESSAGE("skipped: running as root without setpriv, a permission cannot be denied");
    return;
  }
  if (::geteuid() == 0) {
    REQUIRE(std::system(("chown -R 65534:65534 '" + run_dir.string() + "'").c_str()) == 0);
    as_owner = "setpriv --reuid=65534 --regid=65534 --clear-groups ";
    program = tmp / "dptrain";
    fs::copy_file(binary(), program);
  }
  const auto run_as_owner = [&](const std::string& args) {
    const int status =
        std::system((as_owner + "'" + program.string() + "' " + args + " > '" +
                     (tmp / "out").string() + "' 2> '" + (tmp / "err").string() + "'")
                        .c_str());
    REQUIRE(WIFEXITED(status));
    return WEXITSTATUS(status);
  };
  CHECK(run_as_owner("resume '" + run_dir.string() + "'") == 5);
  const std::string err = read_text(tmp / "err");
  INFO(err, read_text(tmp / "out"));
  CHECK(err.find((ck / "step-000120").string() +
                 ": params.bin: cannot read: Permission denied: the checkpoint is out of reach, "
                 "not damaged") != std::string::npos);
  // Neither skipped (its steps would be trained again) nor set aside as corrupt.
  CHECK(read_text(tmp / "out").find("skipping") == std::string::npos);
  CHECK_FALSE(fs::exists(ck / "step-000120.corrupt"));
  CHECK(read_text(ck / "latest") == "step-000120\n");
  CHECK(run_as_owner("ckpt verify '" + run_dir.string() + "'") == 5);
  CHECK(read_text(tmp / "out").find("step-000120 (latest): UNREADABLE") != std::string::npos);
  CHECK(read_text(tmp / "out").find("cannot read: Permission denied") != std::string::npos);
  // Once it can be read, resume continues from it.
  fs::permissions(ck / "step-000120/params.bin", fs::perms::owner_read | fs::perms::owner_write);
  CHECK(run_as_owner("resume '" + run_dir.string() + "'") == 0);
  CHECK(read_text(tmp / "out").find("from step-000120") != std::string::npos);

  // checkpoints/ itself out of reach is not "no checkpoint yet" (a start over from step 0).
  auto done = parse_json(read_text(run_dir / "run.json"));
  done["status"] = "failed";
  write_text(run_dir / "run.json", done.dump());
  const std::string metrics = read_text(run_dir / "metrics.jsonl");
  fs::permissions(ck, fs::perms::none);
  CHECK(run_as_owner("resume '" + run_dir.string() + "'") == 5);
  fs::permissions(ck, fs::perms::owner_all);
  CHECK(read_text(tmp / "err")
            .find(ck.string() + ": cannot list the checkpoints: Permission denied") !=
        std::string::npos);
  CHECK(read_text(run_dir / "metrics.jsonl") == metrics);

  // status and report show what they can read, name what they cannot, and exit 0.
  fs::permissions(ck, fs::perms::none);
  fs::permissions(run_dir / "metrics.jsonl", fs::perms::none);
  CHECK(run_as_owner("status --json '" + run_dir.string() + "'") == 0);
  const nlohmann::json status = parse_json(read_text(tmp / "out"));
  CHECK(status["unreadable"] ==
        nlohmann::json{(run_dir / "metrics.jsonl").string() + ": Permission denied",
                       ck.string() + ": Permission denied"});
  CHECK(status["status"] == "failed");
  CHECK(run_as_owner("report '" + run_dir.string() + "'") == 0);
  CHECK(read_text(tmp / "out").find("unreadable: " + ck.string() + ": Permission denied\n") !=
        std::string::npos);
  fs::permissions(ck, fs::perms::owner_all);
  fs::permissions(run_dir / "metrics.jsonl", fs::perms::owner_read | fs::perms::owner_write);
  // A checkpoint whose meta.json is out of reach is named as unreadable (maybe intact), not
  // passed over in silence nor counted as failed; named by absolute path from a relative one.
  fs::permissions(ck / "step-000120/meta.json", fs::perms::none);
  const std::string unreadable_meta =
      (ck / "step-000120").string() + "/meta.json: cannot read: Permission denied";
  for (const std::string command : {"status", "report"}) {
    CAPTURE(command);
    const int code = std::system(("cd '" + tmp.path().string() + "' && " + as_owner + "'" +
                                  program.string() + "' " + command + " --json run > '" +
                                  (tmp / "out").string() + "' 2> '" + (tmp / "err").string() + "'")
                                     .c_str());
    CHECK(code == 0);
    const nlohmann::json seen = parse_json(read_text(tmp / "out"));
    INFO(seen.dump());
    CHECK(seen["unreadable"] == nlohmann::json{unreadable_meta});
    if (command == "report") CHECK(seen["checkpoints_failed"] == 0);
  }
  fs::permissions(ck / "step-000120/meta.json", fs::perms::owner_read | fs::perms::owner_write);

  // checkpoints/ that takes no writes is found before any step is trained in vain.
  const std::string before = read_text(run_dir / "run.json");
  fs::permissions(ck, fs::perms::owner_read | fs::perms::owner_exec);
  CHECK(run_as_owner("resume '" + run_dir.string() + "'") == 2);
  fs::permissions(ck, fs::perms::owner_all);
  CHECK(read_text(tmp / "err") == "dptrain: error: " + run_dir.string() +
                                      ": cannot resume it here: checkpoints/ takes no writes "
                                      "(Permission denied)\n");
  CHECK(read_text(run_dir / "run.json") == before);

  // A directory this user may not search is not "no such" run directory or --out directory.
  const fs::path closed = tmp / "closed";
  fs::create_directories(closed / "run");
  fs::permissions(closed, fs::perms::none);
  CHECK(run_as_owner("status '" + (closed / "run").string() + "'") == 2);
  CHECK(read_text(tmp / "err") ==
        "dptrain: error: " + (closed / "run").string() + ": cannot be read: Permission denied\n");
  CHECK(run_as_owner("report '" + run_dir.string() + "' --out '" +
                     (closed / "run/r.html").string() + "'") == 2);
  CHECK(read_text(tmp / "err") == "dptrain: error: --out " + (closed / "run/r.html").string() +
                                      ": cannot reach " + (closed / "run").string() +
                                      ": Permission denied\n");
  fs::permissions(closed, fs::perms::owner_all);
}

TEST_CASE("a restart that meets its checkpoint out of reach stops, keeping the failure's cause") {
  if (::geteuid() == 0 && std::system("command -v setpriv > /dev/null") != 0) {
    MESSAGE("skipped: running as root without setpriv, a permission cannot be denied");
    return;
  }
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const fs::path run_dir = tmp / "run";
  // Root reads any file: the launcher runs as an unprivileged owner of the run (a copy of the
  // binary: the build tree may be out of its reach).
  std::string as_owner;
  fs::path program = binary();
  if (::geteuid() == 0) {
    fs::create_directory(run_dir);
    REQUIRE(::chown(run_dir.c_str(), 65534, 65534) == 0);
    as_owner = "setpriv --reuid=65534 --regid=65534 --clear-groups ";
    program = tmp / "dptrain";
    fs::copy_file(binary(), program);
  }
  const std::string command =
      as_owner + "env DPTRAIN_DEBUG_STEP_DELAY_MS=200 DPTRAIN_FAULT=crash@step=25,rank=1 '" +
      program.string() + "' launch '" + recipe.string() + "' --nproc 2 --run-dir '" +
      run_dir.string() + "' --max-restarts 2 --restart-backoff 0.1 > /dev/null 2> '" +
      (tmp / "err").string() + "'";
  int status = -1;
  std::thread launcher([&] { status = std::system(command.c_str()); });
  // Checkpoint 20 is the one the restart would take; it goes out of reach before the crash at 25.
  const fs::path params = run_dir / "checkpoints/step-000020/params.bin";
  const bool written = eventually([&] { return fs::exists(run_dir / "checkpoints/latest"); });
  if (written) fs::permissions(params, fs::perms::none);
  launcher.join();
  REQUIRE(written);
  const std::string err = read_text(tmp / "err");
  INFO(err);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 5);
  CHECK(err.find("rank 1 (pid ") != std::string::npos);  // the cause, still first
  CHECK(err.find("(not restarted: " + params.parent_path().string() +
                 ": params.bin: cannot read: Permission denied: the checkpoint is out of reach") !=
        std::string::npos);
  CHECK(parse_json(read_text(run_dir / "run.json"))["status"] == "failed");
}

TEST_CASE("Ctrl-C stops every rank and exits 130") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  SlowRun run(recipe, tmp / "run");
  REQUIRE(::kill(run.launcher.pid(), SIGINT) == 0);
  CHECK(run.launcher.wait(std::chrono::seconds(60)) == 130);
  check_all_gone(run.pids);
  CHECK(parse_json(read_text(run.run_dir / "run.json"))["status"] == "interrupted");
}

TEST_CASE("SIGTERM whose checkpoint a rank cannot write: its exit is the cause, not a hang") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  SlowRun run(recipe, tmp / "run");
  // Where the checkpoints go is a file now (as a full disk, the write fails: exit 5).
  fs::rename(run.run_dir / "checkpoints", tmp / "moved");
  write_text(run.run_dir / "checkpoints", "x");
  REQUIRE(::kill(run.launcher.pid(), SIGTERM) == 0);
  CHECK(run.launcher.wait(std::chrono::seconds(60)) == 143);
  INFO(run.launcher.err());
  CHECK(contains(run.launcher.err(),
                 "stopped by SIGTERM, but not every rank checkpointed: rank 0 exited with code 5"));
  // Rank 1 waited for it after the checkpoint: no verdict from the heartbeats that it hung.
  CHECK_FALSE(contains(run.launcher.err(), "last heartbeats"));
  CHECK_FALSE(contains(run.launcher.err(), "stuck:"));
}

TEST_CASE("SIGTERM whose checkpoint fails on a rank: exit 143 says so, with that rank's event") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  // Rank 0 dies while writing whichever step's checkpoint the stop asks for.
  std::string faults;
  for (int step = 21; step < 120; ++step)
    faults += fmt::format("{}crash-in-checkpoint@step={},rank=0", faults.empty() ? "" : ";", step);
  const fs::path events = tmp / "events.jsonl";
  SlowRun run(recipe, tmp / "run", {"--events", events.string()}, {{"DPTRAIN_FAULT", faults}});
  REQUIRE(::kill(run.launcher.pid(), SIGTERM) == 0);
  CHECK(run.launcher.wait(std::chrono::seconds(60)) == 143);
  INFO(run.launcher.err());
  CHECK(run.launcher.err().find("stopped by SIGTERM, but not every rank checkpointed: rank 0 was "
                                "killed by SIGKILL") != std::string::npos);
  // Killed, not stuck: its last heartbeat (the barrier its peer waited in) is no verdict.
  CHECK(run.launcher.err().find("stuck:") == std::string::npos);
  // An event for each rank that did not stop as asked: rank 0, and rank 1 when its collective
  // with rank 0 then failed (rather than it stopping first).
  std::vector<nlohmann::json> exited;
  for (const nlohmann::json& e : read_jsonl(events)) {
    if (e["event"] == "rank_exited") exited.push_back(e);
  }
  REQUIRE_FALSE(exited.empty());
  CHECK(exited.size() <= 2);
  CHECK(exited[0]["process"] == "rank 0");
  CHECK(exited[0]["signal"] == SIGKILL);
  CHECK(exited[0]["exit_code"].is_null());
  if (exited.size() == 2) {
    CHECK(exited[1]["process"] == "rank 1");
    CHECK(exited[1]["exit_code"] == 3);
  }
}

TEST_CASE("SIGTERM: every rank checkpoints its step and stops, exit 143; resume is bit-identical") {
  TempDir tmp;
  // An evaluation every step: the stop's step has one due, which must not be lost.
  auto r = resumable_recipe();
  r["eval"]["every"] = 1;
  const auto recipe = write_recipe(tmp.path(), r);
  auto straight = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "straight").string()});
  REQUIRE(straight.exit_code == 0);
  SlowRun run(recipe, tmp / "run");
  // Past the first periodic checkpoint (20), so the stop's own checkpoint is a new one.
  REQUIRE(eventually([&] { return read_jsonl(run.run_dir / "metrics.jsonl").size() >= 6; }));
  REQUIRE(::kill(run.launcher.pid(), SIGTERM) == 0);
  CHECK(run.launcher.wait(std::chrono::seconds(60)) == 143);
  check_all_gone(run.pids);
  CHECK(parse_json(read_text(run.run_dir / "run.json"))["status"] == "terminated");
  const auto meta = parse_json(
      read_text(run.run_dir / "checkpoints" /
                read_text(run.run_dir / "checkpoints/latest").substr(0, 11) / "meta.json"));
  const int64_t stopped_at = meta["step"].get<int64_t>();
  CHECK(stopped_at > 20);
  CHECK(stopped_at < 120);
  CHECK(stopped_at % 20 != 0);  // not a periodic one: the stop wrote it
  // The rank's line says what it wrote; the launcher's last lines say how to go on.
  CHECK(contains(run.launcher.out(), fmt::format("stopped on request after step {}; checkpointed "
                                                 "as step-{:06d}",
                                                 stopped_at, stopped_at)));
  CHECK(contains(run.launcher.err(), "(continue with 'dptrain resume "));
  auto resumed = run_dptrain({"resume", run.run_dir.string()});
  INFO(resumed.out, resumed.err);
  REQUIRE(resumed.exit_code == 0);
  CHECK(resumed.out.find("step-" + std::string(6 - std::to_string(stopped_at).size(), '0') +
                         std::to_string(stopped_at)) != std::string::npos);
  CHECK(read_text(latest_params(run.run_dir)) == read_text(latest_params(tmp / "straight")));
  // The record is the uninterrupted run's: every evaluation, the stop's step's included.
  const auto evals = [](const fs::path& dir) {
    std::vector<std::pair<int64_t, double>> out;
    for (const auto& line : read_jsonl(dir / "metrics.jsonl")) {
      if (line.contains("eval_loss")) out.emplace_back(line["step"], line["eval_loss"]);
    }
    return out;
  };
  const auto straight_evals = evals(tmp / "straight");
  CHECK(straight_evals.size() == 120);
  CHECK(evals(run.run_dir) == straight_evals);
}

TEST_CASE("Ctrl-C after a SIGTERM kills the ranks at once, and the message says who killed them") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const fs::path run_dir = tmp / "run";
  // A pause after each step far longer than the test: the ranks, past their first step, reach
  // the boundary they would checkpoint at only after the Ctrl-C has come.
  Background launcher({"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string()},
                      {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "60000"}});
  REQUIRE(eventually([&] { return worker_pids(run_dir).size() == 2; }));
  std::this_thread::sleep_for(std::chrono::milliseconds(4000));
  REQUIRE(::kill(launcher.pid(), SIGTERM) == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  REQUIRE(::kill(launcher.pid(), SIGINT) == 0);
  CHECK(launcher.wait(std::chrono::seconds(60)) == 143);
  INFO(launcher.err());
  CHECK(contains(launcher.err(),
                 "stopped by SIGTERM, but not every rank checkpointed: rank 0 was killed by "
                 "SIGKILL, rank 1 was killed by SIGKILL (the launcher's SIGKILL: a SIGINT "
                 "(Ctrl-C) after the SIGTERM asked for an end at once)"));
}

namespace {

// resumable_recipe() logging every step, so that a test sees each step done in metrics.jsonl.
nlohmann::json every_step_logged() {
  auto r = resumable_recipe();
  r["log"]["every"] = 1;
  return r;
}

// Once rank 0 logged step 2 (rank 1, with DPTRAIN_FAULT hang@step=3,rank=1, then hangs before
// step 3), and a moment more for rank 0 to wait for it in step 3's first collective: not a fixed
// sleep from the start, which a loaded machine can outlast before the ranks get there.
void wait_for_hang_at_step_3(const fs::path& run_dir) {
  REQUIRE(eventually(
      [&] {
        if (!fs::exists(run_dir / "metrics.jsonl")) return false;
        for (const auto& m : read_jsonl(run_dir / "metrics.jsonl"))
          if (m.value("step", int64_t{0}) >= 2) return true;
        return false;
      },
      std::chrono::seconds(60)));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
}

}  // namespace

TEST_CASE("SIGTERM with a hung rank and no --hang-timeout: the heartbeats name the hung one") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), every_step_logged());
  const fs::path run_dir = tmp / "run";
  Background launcher({"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string()},
                      {{"DPTRAIN_FAULT", "hang@step=3,rank=1"}});
  wait_for_hang_at_step_3(run_dir);
  REQUIRE(::kill(launcher.pid(), SIGTERM) == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  REQUIRE(::kill(launcher.pid(), SIGINT) == 0);  // no need to wait out the stop's grace
  CHECK(launcher.wait(std::chrono::seconds(60)) == 143);
  INFO(launcher.err());
  CHECK(contains(launcher.err(), "stopped by SIGTERM, but not every rank checkpointed: "));
  // Killed at once by the Ctrl-C: where each was, not a verdict (a rank writing its checkpoint
  // was once called stuck so).
  CHECK(contains(launcher.err(),
                 "; when they were killed, by the ranks' last heartbeats (behind, "
                 "not necessarily stuck): rank 1 at step 3 "));
  CHECK(contains(launcher.err(), "; waiting for it in collective #"));
}

TEST_CASE("SIGTERM with a hung rank: when the stop's grace runs out, the heartbeats name it") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), every_step_logged());
  const fs::path run_dir = tmp / "run";
  // The grace for the checkpoint cut from a minute to 3 s: it runs out, and the launcher kills
  // the ranks itself; its verdict is then that the rank behind was stuck.
  Background launcher(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string()},
      {{"DPTRAIN_FAULT", "hang@step=3,rank=1"}, {"DPTRAIN_TEST_STOP_GRACE_MS", "3000"}});
  wait_for_hang_at_step_3(run_dir);
  REQUIRE(::kill(launcher.pid(), SIGTERM) == 0);
  CHECK(launcher.wait(std::chrono::seconds(60)) == 143);
  INFO(launcher.err());
  CHECK(contains(launcher.err(), "stopped by SIGTERM, but not every rank checkpointed: "));
  CHECK(contains(launcher.err(),
                 "(the launcher's SIGKILL: still running 3 s after the request to stop)"));
  CHECK(contains(launcher.err(), "; by the ranks' last heartbeats, stuck: rank 1 at step 3 "));
  CHECK(contains(launcher.err(), "; waiting for it in collective #"));
  CHECK_FALSE(contains(launcher.err(), "not necessarily stuck"));
}

TEST_CASE("SIGTERM during the last step: nothing is left to stop, the run completes") {
  TempDir tmp;
  auto j = small_recipe();
  j["train"]["steps"] = 20;
  const auto recipe = write_recipe(tmp.path(), j);
  const fs::path run_dir = tmp / "last";
  // Every step but the last is quick; the last waits 4 s before it starts (the ranks then see
  // the stop request and agree on it after that step).
  Background job(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string(), "--json"},
      {{"DPTRAIN_FAULT", "slow@step=19,ms=4000"}});
  REQUIRE(eventually([&] {
    const auto steps = read_jsonl(run_dir / "metrics.jsonl");
    return !steps.empty() && steps.back().value("step", 0) >= 15;
  }));
  std::this_thread::sleep_for(std::chrono::seconds(1));  // steps 16 to 18 take milliseconds
  REQUIRE(::kill(job.pid(), SIGTERM) == 0);
  const int code = job.wait(std::chrono::seconds(60));
  INFO(job.err());
  REQUIRE(code == 0);
  const nlohmann::json out = parse_json(job.out());
  CHECK(out["status"] == "completed");
  CHECK(out["step"] == 20);
  CHECK(out["final_loss"].is_number());
  CHECK(parse_json(read_text(run_dir / "run.json"))["status"] == "completed");
  CHECK(fs::exists(run_dir / "result.json"));
}

TEST_CASE("SIGINT once rank 0 reported the result: the run completed, not interrupted") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const fs::path run_dir = tmp / "done";
  Background job(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string(), "--json"});
  // As soon as the launcher has written result.json (the ranks are then leaving).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!fs::exists(run_dir / "result.json") && process_alive(job.pid()) &&
         std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  ::kill(job.pid(), SIGINT);
  const int code = job.wait(std::chrono::seconds(60));
  INFO(job.err());
  CHECK(code == 0);
  CHECK(parse_json(job.out())["status"] == "completed");
  CHECK(parse_json(read_text(run_dir / "run.json"))["status"] == "completed");
}

TEST_CASE("a rank that gets SIGTERM itself (preemption) stops the whole job after a checkpoint") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  SlowRun run(recipe, tmp / "run", {"--events", (tmp / "events.jsonl").string()});
  REQUIRE(::kill(run.pids[1], SIGTERM) == 0);
  const int code = run.launcher.wait(std::chrono::seconds(60));
  INFO(run.launcher.err());
  CHECK(code == 143);
  // Named from the store, whichever rank exited first, in the message and the event alike.
  CHECK(run.launcher.err().find("rank 1 was stopped by SIGTERM; every rank checkpointed") !=
        std::string::npos);
  int exits = 0;
  for (const auto& e : read_jsonl(tmp / "events.jsonl")) {
    if (e["event"] != "rank_exited") continue;
    ++exits;
    CHECK(e["process"] == "rank 1");
    CHECK(e["exit_code"] == 143);
    CHECK(e["message"].get<std::string>().starts_with("rank 1 was stopped by SIGTERM"));
  }
  CHECK(exits == 1);
  CHECK(run.launcher.out().find("[rank 1] received SIGTERM") != std::string::npos);
  check_all_gone(run.pids);
  CHECK(run_dptrain({"resume", run.run_dir.string()}).exit_code == 0);
}

TEST_CASE("a SIGTERM that reaches a launch while it loads stops it with its JSON, nothing made") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  Background launch({"launch", recipe.string(), "--run-dir", (tmp / "run").string(), "--json"}, {},
                    StartWith::pending_sigterm);
  CHECK(launch.wait(std::chrono::seconds(60)) == 143);
  INFO(launch.err());
  const auto out = parse_json(launch.out());
  CHECK(out["status"] == "terminated");
  CHECK(out["error"] == "stopped by SIGTERM before the launch made anything");
  CHECK_FALSE(fs::exists(tmp / "run"));
}

TEST_CASE("a stop while resume verifies checkpoints ends it there: nothing is set aside") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const fs::path run_dir = tmp / "run";
  launch_as_failed(recipe, run_dir);
  {
    // The newest is damaged: a resume would set it aside.
    std::fstream f(run_dir / "checkpoints/step-000120/params.bin",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(17);
    f.put('\x7f');
  }
  const std::string recorded = read_text(run_dir / "run.json");
  // SIGTERM already there when it starts: the search stops before the first checkpoint.
  Background resume({"resume", run_dir.string(), "--json"}, {}, StartWith::pending_sigterm);
  CHECK(resume.wait(std::chrono::seconds(60)) == 143);
  INFO(resume.err());
  const auto out = parse_json(resume.out());
  CHECK(out["status"] == "terminated");
  CHECK(out["error"] ==
        "stopped by SIGTERM while resume verified checkpoints (nothing was set aside)");
  CHECK(fs::exists(run_dir / "checkpoints/step-000120"));
  CHECK_FALSE(fs::exists(run_dir / "checkpoints/step-000120.corrupt"));
  CHECK(read_text(run_dir / "run.json") == recorded);
}

TEST_CASE("a resume on another -n stopped before its ranks met leaves the next on the last world") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const fs::path run_dir = tmp / "run";
  launch_as_failed(recipe, run_dir);
  // On 3 ranks, one of which never joins: stopped while the others wait for it (the frozen one
  // killed when a short grace ran out).
  Background resume(
      {"resume", run_dir.string(), "-n", "3", "--json"},
      {{"DPTRAIN_FAULT", "freeze-before-join@rank=2"}, {"DPTRAIN_TEST_STOP_GRACE_MS", "1000"}});
  REQUIRE(eventually([&] { return worker_pids(run_dir).size() == 3; }));
  REQUIRE(::kill(resume.pid(), SIGTERM) == 0);
  CHECK(resume.wait(std::chrono::seconds(60)) == 143);
  INFO(resume.err());
  const nlohmann::json info = parse_json(read_text(run_dir / "run.json"));
  // Its generation is history; the world a resume defaults to is the one that last trained.
  CHECK(info["generations"].size() == 2);
  CHECK(info["generations"].back()["world_size"] == 3);
  CHECK_FALSE(info["generations"].back().contains("met_at"));
  CHECK(info["world_size"] == 2);
  const auto again = run_dptrain({"resume", run_dir.string(), "--json"});
  CHECK(again.exit_code == 0);
  CHECK(parse_json(again.out)["world_size"] == 2);
}

TEST_CASE("a resume on more ranks than the global batch has micro-batches warns of the idle") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const fs::path run_dir = tmp / "run";
  launch_as_failed(recipe, run_dir);  // 2 ranks: 2 micro-batches a step (keep_global_batch)
  const auto resumed = run_dptrain({"resume", run_dir.string(), "-n", "3", "--json"});
  INFO(resumed.err);
  CHECK(resumed.exit_code == 0);
  const std::string idle =
      "3 ranks share 2 micro-batches a step: 1 rank(s) idle; distributed.resize \"scale_lr\" "
      "would use them";
  CHECK(contains(resumed.err, "dptrain: warning: " + idle));
  const auto warnings = parse_json(resumed.out)["warnings"];
  CHECK(std::find(warnings.begin(), warnings.end(), idle) != warnings.end());
}

TEST_CASE("a SIGTERM that reaches a rank while it loads is a stop, not a death") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const fs::path run_dir = tmp / "run";
  Background worker({"worker", recipe.string(), "--run-dir", run_dir.string()},
                    {{"RANK", "0"},
                     {"WORLD_SIZE", "1"},
                     {"MASTER_ADDR", "127.0.0.1"},
                     {"MASTER_PORT", std::to_string(unused_port())},
                     {"DPTRAIN_HOST_STORE", "1"}},
                    StartWith::pending_sigterm);
  const int code = worker.wait(std::chrono::seconds(120));
  const std::string log = worker.out() + worker.err();
  INFO(log);
  // Its handler answers it (a death by the signal would say nothing): before the first step
  // there is nothing to checkpoint, so it stops at once.
  CHECK(code == 143);
  CHECK(contains(log,
                 "rank 0: stopped by SIGTERM before its first step (nothing to checkpoint "
                 "yet)"));
  CHECK_FALSE(fs::exists(run_dir / "checkpoints/latest"));
  CHECK(parse_json(read_text(run_dir / "run.json"))["status"] == "terminated");
}

TEST_CASE("SIGTERM after the ranks met, before any finished a step: nothing is said checkpointed") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const fs::path run_dir = tmp / "run";
  // SIGTERM while rank 1 still loads (a slow start of 30 s, once the ranks have met) and rank 0
  // waits for it: a few seconds after the generation's ranks started (the launcher hears of the
  // meeting only once rank 1 is done; before they met, the message is the same).
  const auto stop_after_meeting = [&](std::vector<std::string> args) {
    args.push_back("--json");
    const size_t generations =
        fs::exists(run_dir / "run.json")
            ? parse_json(read_text(run_dir / "run.json"))["generations"].size()
            : 0;
    Background job(args, {{"DPTRAIN_FAULT", "slow-start@rank=1,ms=30000"}});
    REQUIRE(eventually([&] {
      return fs::exists(run_dir / "run.json") &&
             parse_json(read_text(run_dir / "run.json"))["generations"].size() > generations &&
             worker_pids(run_dir).size() == 2;
    }));
    std::this_thread::sleep_for(std::chrono::seconds(3));
    REQUIRE(::kill(job.pid(), SIGTERM) == 0);
    CHECK(job.wait(std::chrono::seconds(60)) == 143);
    INFO(job.err());
    CHECK_FALSE(contains(job.err(), "checkpointed its last step"));
    // A rank's own line says it stopped, not a second error beside the launcher's.
    const std::string log = read_text(run_dir / "logs/localhost-rank0.log");
    CHECK(contains(log, "dptrain: rank 0: stopped by SIGTERM before its first step"));
    CHECK_FALSE(contains(log, "error: rank 0: stopped"));
    CHECK_FALSE(contains(job.err(), "error: rank 0: stopped"));
    return parse_json(job.out())["error"].get<std::string>();
  };
  CHECK(stop_after_meeting(
            {"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string()}) ==
        "stopped by SIGTERM; every rank stopped before its first step (nothing to checkpoint); no "
        "checkpoint exists: a resume starts from step 0");
  // A resumed run's newest checkpoint is the one it started from, not one the stop wrote.
  const auto first =
      run_dptrain({"resume", run_dir.string()}, {{"DPTRAIN_FAULT", "exit@step=30,rank=1,code=9"}});
  REQUIRE(first.exit_code == 3);
  REQUIRE(fs::exists(run_dir / "checkpoints/step-000020"));
  CHECK(stop_after_meeting({"resume", run_dir.string()}) ==
        "stopped by SIGTERM; every rank stopped before its first step (nothing to checkpoint); the "
        "newest checkpoint is step-000020: a resume continues from it");
}

TEST_CASE("SIGKILL of the launcher leaves no worker behind") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  SlowRun run(recipe, tmp / "run");
  REQUIRE(::kill(run.launcher.pid(), SIGKILL) == 0);
  run.launcher.wait(std::chrono::seconds(10));
  check_all_gone(run.pids);
  // Nothing recorded how that generation ended: status blames no error on it, and a resume
  // closes it as lost.
  auto stale = run_dptrain({"status", run.run_dir.string(), "--json"});
  CHECK(parse_json(stale.out)["status"] == "stale");
  CHECK(parse_json(stale.out)["error"].is_null());
  // Its last alive stamp is seconds old when the launcher dies (here: long ago); the ranks
  // logged steps after it, so the lost generation ended when metrics.jsonl last changed.
  auto before = parse_json(read_text(run.run_dir / "run.json"));
  before["alive_at"] = "2000-01-01T00:00:00Z";
  write_text(run.run_dir / "run.json", before.dump());
  auto resumed = run_dptrain({"resume", run.run_dir.string()});
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  const nlohmann::json info = parse_json(read_text(run.run_dir / "run.json"));
  REQUIRE(info["generations"].size() == 2);
  CHECK(info["generations"][0]["status"] == "lost");
  REQUIRE(info["generations"][0]["ended_at"].is_string());
  CHECK(info["generations"][0]["ended_at"].get<std::string>() >=
        info["generations"][0]["started_at"].get<std::string>());
  CHECK(info["generations"][1]["status"] == "completed");
}

TEST_CASE("launching into a directory that holds a run is refused") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  write_text(tmp / "run.json", R"({"recipe": {}})");
  auto r = run_dptrain({"launch", recipe.string(), "--run-dir", tmp.path().string()});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("dptrain resume") != std::string::npos);
  // A benchmark's run has nothing to resume: only another directory will do.
  write_text(tmp / "run.json", R"({"benchmark": {}})");
  auto bench = run_dptrain({"bench", "comm", "--nproc", "1", "--run-dir", tmp.path().string()});
  CHECK(bench.exit_code == 2);
  CHECK(bench.err.find(": already holds a benchmark's run; choose another --run-dir") !=
        std::string::npos);
  CHECK(bench.err.find("resume") == std::string::npos);
  // A torn record: resume cannot read it either, so it is not sent there.
  write_text(tmp / "run.json", R"({"recipe": {"name": "x)");
  auto torn = run_dptrain({"launch", recipe.string(), "--run-dir", tmp.path().string()});
  CHECK(torn.exit_code == 2);
  CHECK(contains(torn.err, ": already holds a run whose record does not read (" +
                               (tmp / "run.json").string() + ": not valid JSON"));
  CHECK(contains(torn.err, "neither a resume nor a launch continues it; repair run.json"));
}

TEST_CASE("resume of a completed run changes nothing; of a running one it is refused") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const fs::path done = tmp / "done";
  REQUIRE(run_dptrain({"launch", recipe.string(), "--run-dir", done.string()}).exit_code == 0);
  const std::string run_json = read_text(done / "run.json");
  const std::string result_json = read_text(done / "result.json");
  const std::string metrics = read_text(done / "metrics.jsonl");
  auto again = run_dptrain({"resume", done.string(), "--json"});
  INFO(again.err);
  CHECK(again.exit_code == 0);
  CHECK(again.err.find("nothing to resume") != std::string::npos);
  CHECK(again.err.find("resuming") == std::string::npos);
  const auto out = parse_json(again.out);
  CHECK(out["status"] == "completed");
  CHECK(out["resumed"] == false);
  CHECK(out["final_loss"] == parse_json(result_json)["final_loss"]);
  CHECK(read_text(done / "run.json") == run_json);
  CHECK(read_text(done / "result.json") == result_json);
  CHECK(read_text(done / "metrics.jsonl") == metrics);
  // Its events stream ends as any does, with run_finished: the outcome --json gives.
  const fs::path events = tmp / "done.events";
  CHECK(run_dptrain({"resume", done.string(), "--events", events.string()}).exit_code == 0);
  const auto stream = read_jsonl(events);
  REQUIRE(stream.size() == 1);
  CHECK(stream[0]["event"] == "run_finished");
  CHECK(stream[0]["status"] == "completed");
  CHECK(stream[0]["resumed"] == false);
  CHECK(stream[0]["final_loss"] == out["final_loss"]);
  CHECK(read_text(done / "run.json") == run_json);

  // While a launcher drives a run, a resume (or a second launch into it) writes nothing.
  const fs::path live = tmp / "live", live_events = tmp / "live.jsonl";
  Background launcher(
      {"launch", recipe.string(), "--run-dir", live.string(), "--events", live_events.string()},
      {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "50"}});
  REQUIRE(eventually([&] { return fs::exists(live / "run.json"); }));
  // Given the live run's own events stream (a retry wrapper), it leaves the stream alone.
  auto refused = run_dptrain({"resume", live.string(), "--events", live_events.string()});
  CHECK(refused.exit_code == 2);
  CHECK_MESSAGE(refused.err.find(live.string() + ": ") != std::string::npos, refused.err);
  CHECK_MESSAGE(refused.err.find("is still running it") != std::string::npos, refused.err);
  // Named by the process that holds the lock (not a pid an earlier launcher left in run.json).
  CHECK_MESSAGE(
      refused.err.find("(pid " + std::to_string(launcher.pid()) + " on ") != std::string::npos,
      refused.err);
  // Given a stream of its own (a file it makes), the refusal ends that stream as any does.
  const fs::path own_events = tmp / "refused.jsonl";
  auto refused_own = run_dptrain({"resume", live.string(), "--events", own_events.string()});
  CHECK(refused_own.exit_code == 2);
  const auto own = read_jsonl(own_events);
  REQUIRE(own.size() == 1);
  CHECK(own[0]["event"] == "run_finished");
  CHECK(own[0]["status"] == "error");  // as the --json outcome's
  CHECK(own[0]["exit_code"] == 2);
  CHECK(contains(own[0]["error"].get<std::string>(), "the resume did not start: "));
  // A launch into it says it runs, not "resume it" (which is refused as long as it does).
  auto launched = run_dptrain({"launch", recipe.string(), "--run-dir", live.string()});
  CHECK(launched.exit_code == 2);
  CHECK(launched.err == "dptrain: error: " + live.string() +
                            ": already holds a run, which another dptrain is running now (a "
                            "launcher, or workers started without one: it holds " +
                            live.string() + "/.lock); choose another --run-dir\n");
  // With its lock file removed, the run's record still tells: not "resume it".
  fs::remove(live / ".lock");
  auto unlocked = run_dptrain({"launch", recipe.string(), "--run-dir", live.string()});
  CHECK(unlocked.exit_code == 2);
  CHECK_MESSAGE(contains(unlocked.err, "dptrain: error: " + live.string() + ": the run is running"),
                unlocked.err);
  CHECK_MESSAGE(contains(unlocked.err, "; choose another --run-dir"), unlocked.err);
  CHECK_FALSE(contains(unlocked.err, "dptrain resume"));
  REQUIRE(launcher.wait(std::chrono::seconds(60)) == 0);
  const auto live_stream = read_jsonl(live_events);
  CHECK(std::count_if(live_stream.begin(), live_stream.end(),
                      [](const nlohmann::json& e) { return e["event"] == "run_finished"; }) == 1);
  CHECK(live_stream.back()["status"] == "completed");
  const auto info = parse_json(read_text(live / "run.json"));
  CHECK(info["generations"].size() == 1);
  CHECK(info["status"] == "completed");
}

TEST_CASE("resume of a run stopped before its first checkpoint starts it over from step 0") {
  TempDir tmp;
  auto r = small_recipe();
  r["checkpoint"] = {{"every", 0}};
  const auto recipe = write_recipe(tmp.path(), r);
  const fs::path dir = tmp / "nock";
  Background launcher({"launch", recipe.string(), "--run-dir", dir.string()},
                      {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "40"}});
  REQUIRE(eventually([&] { return !worker_pids(dir).empty(); }));
  const auto pids = worker_pids(dir);
  REQUIRE(::kill(launcher.pid(), SIGKILL) == 0);
  launcher.wait(std::chrono::seconds(30));
  check_all_gone(pids);  // ranks outliving their launcher would make the run still running
  auto resumed = run_dptrain({"resume", dir.string()});
  INFO(resumed.err);
  CHECK(resumed.exit_code == 0);
  CHECK((resumed.out + resumed.err).find("from step 0 (it has no checkpoint)") !=
        std::string::npos);
  const auto info = parse_json(read_text(dir / "run.json"));
  CHECK(info["status"] == "completed");
  CHECK(info["result"]["steps"] == 60);
}

TEST_CASE("resume of a run whose checkpoints are gone (moved, not mounted) is refused, exit 5") {
  TempDir tmp;
  auto r = small_recipe();
  r["checkpoint"] = {{"every", 20}};
  const auto recipe = write_recipe(tmp.path(), r);
  const fs::path dir = tmp / "gone";
  REQUIRE(run_dptrain({"launch", recipe.string(), "--run-dir", dir.string()},
                      {{"DPTRAIN_FAULT", "exit@step=50,code=7"}})
              .exit_code == 3);
  // An empty directory in their place, as a mount point whose filesystem is not mounted.
  fs::rename(dir / "checkpoints", tmp / "elsewhere");
  fs::create_directory(dir / "checkpoints");
  const std::string recorded = read_text(dir / "run.json");
  auto resumed = run_dptrain({"resume", dir.string()});
  CHECK(resumed.exit_code == 5);
  CHECK(resumed.err == "dptrain: error: " + (dir / "checkpoints").string() +
                           ": holds no checkpoint, but run.json records step-000040 committed "
                           "there: were they moved away, or is their filesystem not mounted? Put "
                           "them back and resume; to start over, launch the recipe into a new "
                           "run directory\n");
  CHECK(read_text(dir / "run.json") == recorded);
  CHECK(fs::is_empty(dir / "checkpoints"));
  // With none in their place, the refusal makes no empty one (which would look like a mount
  // point), nor logs/.
  fs::remove(dir / "checkpoints");
  fs::rename(dir / "logs", tmp / "logs");
  auto none = run_dptrain({"resume", dir.string()});
  CHECK(none.exit_code == 5);
  CHECK(none.err == "dptrain: error: " + (dir / "checkpoints").string() +
                        ": is not there, but run.json records step-000040 committed there: were "
                        "they moved away, or is their filesystem not mounted? Put them back and "
                        "resume; to start over, launch the recipe into a new run directory\n");
  // ckpt list and verify, which only read them, say so too.
  const auto listed = run_dptrain({"ckpt", "list", dir.string(), "--json"});
  CHECK(listed.exit_code == 0);
  CHECK(parse_json(listed.out)["warnings"] ==
        nlohmann::json::array({(dir / "checkpoints").string() +
                               ": is not there, but run.json records step-000040 committed "
                               "there: were they moved away, or is their filesystem not "
                               "mounted?"}));
  const auto verified = run_dptrain({"ckpt", "verify", dir.string()});
  CHECK(verified.exit_code == 5);
  CHECK(contains(verified.err, "dptrain: warning: " + (dir / "checkpoints").string() +
                                   ": is not there, but run.json records step-000040"));
  CHECK(!fs::exists(dir / "checkpoints"));
  CHECK(!fs::exists(dir / "logs"));
  fs::rename(tmp / "logs", dir / "logs");
  // Put back, the run continues from its checkpoint.
  fs::rename(tmp / "elsewhere", dir / "checkpoints");
  auto back = run_dptrain({"resume", dir.string()});
  CHECK(back.exit_code == 0);
  CHECK(contains(back.out + back.err, "from step-000040"));
}

TEST_CASE("launch claims its run directory: no foreign files, and racing launches get their own") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  // Another run's checkpoints, without its run.json: refused before anything is written.
  const fs::path orphan = tmp / "orphan";
  fs::create_directories(orphan / "checkpoints/step-000300");
  auto refused = run_dptrain({"launch", recipe.string(), "--run-dir", orphan.string()});
  CHECK(refused.exit_code == 2);
  CHECK_MESSAGE(refused.err.find(orphan.string() + ": holds 'checkpoints' but no run.json") !=
                    std::string::npos,
                refused.err);
  CHECK_FALSE(fs::exists(orphan / "run.json"));
  CHECK_FALSE(fs::exists(orphan / "logs"));

  // The same seen by a launch that lost a race for one --run-dir: the winner holds the lock
  // and has not written run.json yet. The message says so, not that the files are foreign.
  const fs::path starting = tmp / "starting";
  fs::create_directories(starting);
  write_text(starting / "recipe.json.tmp-1", "{}");
  const int lock = ::open((starting / ".lock").c_str(), O_RDWR | O_CREAT, 0644);
  REQUIRE(lock >= 0);
  REQUIRE(::flock(lock, LOCK_EX) == 0);
  auto lost = run_dptrain({"launch", recipe.string(), "--run-dir", starting.string()});
  ::close(lock);
  CHECK(lost.exit_code == 2);
  CHECK(lost.err == "dptrain: error: " + starting.string() +
                        ": another dptrain is starting a run there (it holds " +
                        (starting / ".lock").string() + "); give another --run-dir\n");
  // Lost a moment later: the winner has made only the layout, which a launch may take (as one
  // killed there leaves it), and the lock tells the loser; not resume's "wait for it".
  const fs::path laid = tmp / "laid";
  fs::create_directories(laid / "logs");
  fs::create_directories(laid / "checkpoints");
  const int held = ::open((laid / ".lock").c_str(), O_RDWR | O_CREAT, 0644);
  REQUIRE(held >= 0);
  REQUIRE(::flock(held, LOCK_EX) == 0);
  const std::string holder = "4242 otherhost\n";
  REQUIRE(::write(held, holder.data(), holder.size()) == static_cast<ssize_t>(holder.size()));
  auto late = run_dptrain({"launch", recipe.string(), "--run-dir", laid.string()});
  ::close(held);
  CHECK(late.exit_code == 2);
  CHECK(late.err == "dptrain: error: " + laid.string() +
                        ": another dptrain is starting a run there (pid 4242 on otherhost); give "
                        "another --run-dir\n");

  // A bad --events path creates nothing; the retry finds the directory usable.
  const fs::path fresh = tmp / "fresh";
  auto bad_events = run_dptrain({"launch", recipe.string(), "--run-dir", fresh.string(), "--events",
                                 (tmp / "no/such/dir/e.jsonl").string()});
  CHECK(bad_events.exit_code == 2);
  CHECK_FALSE(fs::exists(fresh));
  fs::create_directories(fresh / "logs");  // what an older failed start left: still usable
  CHECK(run_dptrain({"launch", recipe.string(), "--run-dir", fresh.string()}).exit_code == 0);

  // A launch killed (SIGKILL) as it wrote its first run.json: its lock, empty logs/ and
  // checkpoints/, and its temporaries. The directory takes a launch, which removes them.
  const fs::path killed = tmp / "killed";
  fs::create_directories(killed / "logs");
  fs::create_directories(killed / "checkpoints");
  write_text(killed / ".lock", "");
  const std::string dead = std::to_string(gone_pid());
  write_text(killed / ("run.json.tmp-" + dead), "{}");
  write_text(killed / ("recipe.json.tmp-" + dead), "{}");
  // One whose process lives is another's (or a user's file): refused, naming it.
  const std::string live = "run.json.tmp-" + std::to_string(::getpid());
  write_text(killed / live, "{}");
  auto live_refused = run_dptrain({"launch", recipe.string(), "--run-dir", killed.string()});
  CHECK(live_refused.exit_code == 2);
  CHECK(contains(live_refused.err, "holds '" + live + "' but no run.json"));
  fs::remove(killed / live);
  // (Its run fails at step 50, for the resume below.)
  auto reused = run_dptrain({"launch", recipe.string(), "--run-dir", killed.string()},
                            {{"DPTRAIN_FAULT", "exit@step=50,code=7"}});
  INFO(reused.err);
  CHECK(reused.exit_code == 3);
  CHECK_FALSE(fs::exists(killed / ("run.json.tmp-" + dead)));
  CHECK_FALSE(fs::exists(killed / ("recipe.json.tmp-" + dead)));
  // A resume sweeps such leftovers too (a launcher killed between writing run.json and renaming
  // it, mid-run).
  write_text(killed / ("run.json.tmp-" + dead), "{}");
  write_text(killed / ("result.json.tmp-" + dead), "{}");
  CHECK(run_dptrain({"resume", killed.string()}).exit_code == 0);
  CHECK_FALSE(fs::exists(killed / ("run.json.tmp-" + dead)));
  CHECK_FALSE(fs::exists(killed / ("result.json.tmp-" + dead)));

  // Two launches of one recipe at once under one --runs-root: two run directories, two runs.
  const fs::path root = tmp / "race";
  Background first({"launch", recipe.string(), "--runs-root", root.string()});
  Background second({"launch", recipe.string(), "--runs-root", root.string()});
  CHECK(first.wait(std::chrono::seconds(90)) == 0);
  CHECK(second.wait(std::chrono::seconds(90)) == 0);
  std::vector<fs::path> runs;
  for (const auto& entry : fs::directory_iterator(root))
    runs.push_back(entry.path());
  REQUIRE(runs.size() == 2);
  for (const auto& run : runs) {
    CAPTURE(run);
    CHECK(parse_json(read_text(run / "run.json"))["status"] == "completed");
  }
}

TEST_CASE("too few file descriptors for the ranks: exit 2 naming the limit, the run as it was") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const fs::path run_dir = tmp / "fds";
  // 12 descriptors: too few for 2 ranks' output pipes, logs and store connections. Only 0-2 are
  // open when it starts, whatever this test process holds.
  write_text(tmp / "run.sh",
             "for fd in /proc/self/fd/*; do n=${fd##*/}; [ \"$n\" -gt 2 ] && eval \"exec $n>&-\"; "
             "done 2>/dev/null\nulimit -n 12\nexec \"$@\" 2> \"$ERR\"\n");
  const auto limited = [&](const std::string& args) {
    const std::string command = "ERR='" + (tmp / "err").string() + "' bash '" +
                                (tmp / "run.sh").string() + "' '" + binary() + "' " + args;
    const int status = std::system(command.c_str());
    REQUIRE(WIFEXITED(status));
    return WEXITSTATUS(status);
  };
  const std::string needs = "2 rank(s) on this machine need about ";
  CHECK(limited("launch '" + recipe.string() + "' --nproc 2 --run-dir '" + run_dir.string() +
                "'") == 2);
  std::string err = read_text(tmp / "err");
  CHECK(err.find("dptrain: error: " + needs) != std::string::npos);
  CHECK(err.find("more than the 12 this process may open") != std::string::npos);
  CHECK(err.find("Too many open files") == std::string::npos);
  // Found before any rank started: the directory takes a launch again.
  CHECK_FALSE(fs::exists(run_dir / "run.json"));
  // A dry run, a preflight check, refuses it as well.
  CHECK(limited("launch '" + recipe.string() + "' --nproc 2 --dry-run") == 2);
  CHECK(read_text(tmp / "err").find("dptrain: error: " + needs) != std::string::npos);

  // A run that stopped (recorded), resumed with too few: refused before run.json changes.
  auto failed =
      run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string()},
                  Env{{"DPTRAIN_FAULT", "exit@step=3,rank=1,code=7"}});
  REQUIRE(failed.exit_code == 3);
  const std::string recorded = read_text(run_dir / "run.json");
  CHECK(limited("resume '" + run_dir.string() + "'") == 2);
  err = read_text(tmp / "err");
  CHECK(err.find("dptrain: error: " + needs) != std::string::npos);
  CHECK(read_text(run_dir / "run.json") == recorded);

  // A resume that warned (its newest checkpoint damaged, passed over) and then failed: its JSON
  // error carries the warning, as stderr said it.
  const fs::path warned_dir = tmp / "warned";
  REQUIRE(run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", warned_dir.string()},
                      Env{{"DPTRAIN_FAULT", "exit@step=45,rank=1,code=7"}})
              .exit_code == 3);
  flip_byte(warned_dir / "checkpoints" / "step-000040" / "params.bin", 100);
  CHECK(limited("resume '" + warned_dir.string() + "' --json > '" + (tmp / "out").string() + "'") ==
        2);
  const auto j = parse_json(read_text(tmp / "out"));
  CHECK(j["exit_code"] == 2);
  INFO(j.dump());
  REQUIRE(j["warnings"].size() == 2);
  const std::string warning = j["warnings"][0].get<std::string>();
  CHECK(warning.starts_with("skipping checkpoint step-000040: params.bin"));
  CHECK(contains(read_text(tmp / "err"), "dptrain: warning: " + warning));
  CHECK(j["warnings"][1] == "set aside step-000040 as step-000040.corrupt");
}

TEST_CASE("a launcher that fails mid-job (its store's port taken) records the run as failed") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const fs::path run_dir = tmp / "run";
  const uint16_t port = unused_port();
  // Rank 1 fails in the first generation; during the restart's back-off another process takes
  // the fixed --master-port, and the next generation's store cannot listen.
  Background launcher({"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string(),
                       "--master-port", std::to_string(port), "--max-restarts", "1",
                       "--restart-backoff", "3", "--json", "--events", "/dev/full"},
                      {{"DPTRAIN_FAULT", "exit@step=3,rank=1,code=7,gen=1"}});
  REQUIRE(eventually([&] {
    return fs::exists(run_dir / "run.json") &&
           contains(read_text(run_dir / "run.json"), "\"pending_restart\"");
  }));
  const int holder = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(holder >= 0);
  // Past the first store's connections in TIME_WAIT; listening, it still keeps the port.
  const int on = 1;
  REQUIRE(::setsockopt(holder, SOL_SOCKET, SO_REUSEADDR, &on, sizeof(on)) == 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  address.sin_port = htons(port);
  REQUIRE(::bind(holder, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
  REQUIRE(::listen(holder, 1) == 0);
  const int code = launcher.wait(std::chrono::seconds(60));
  ::close(holder);
  INFO(launcher.err());
  CHECK(code == 3);  // the store's failure, a communication error
  const auto info = parse_json(read_text(run_dir / "run.json"));
  CHECK(info["status"] == "failed");
  CHECK(info["error"].get<std::string>().starts_with("the launcher failed: "));
  CHECK(contains(info["error"].get<std::string>(), std::to_string(port)));
  CHECK(parse_json(launcher.out())["exit_code"] == 3);
  // Its --json names the run directory, as the events stream's run_finished does, and carries
  // the warning that the events stream could not be written (which it cannot say itself).
  CHECK(parse_json(launcher.out())["run_dir"] == run_dir.string());
  CHECK(parse_json(launcher.out())["warnings"] ==
        nlohmann::json::array(
            {"--events: cannot write /dev/full: No space left on device; the events "
             "from here on are lost"}));
  const auto s = parse_json(run_dptrain({"status", run_dir.string(), "--json"}).out);
  CHECK(s["status"] == "failed");  // not "running", then "stale"
}

TEST_CASE("a low soft limit on open files (ulimit -Sn) is raised to the hard one for the ranks") {
  // 40 descriptors are too few for a launcher of 12 ranks (three each: output pipes, a log, a
  // store connection); the hard limit allows them, as a login's 1024 against 524288 does.
  rlimit files{};
  REQUIRE(::getrlimit(RLIMIT_NOFILE, &files) == 0);
  if (files.rlim_max < 256) {
    MESSAGE("skipped: this test's own hard limit on open files is below 256");
    return;
  }
  TempDir tmp;
  auto small = small_recipe();
  small["train"]["steps"] = 6;
  small["optimizer"]["schedule"]["warmup"] = 1;
  small["checkpoint"]["every"] = 6;
  small["eval"]["every"] = 6;
  const auto recipe = write_recipe(tmp.path(), small);
  const std::string command = "ulimit -Sn 40 && exec '" + binary() + "' launch '" +
                              recipe.string() + "' --nproc 12 --run-dir '" +
                              (tmp / "run").string() + "' > /dev/null 2> '" +
                              (tmp / "err").string() + "'";
  const int status = std::system(("bash -c \"" + command + "\"").c_str());
  INFO(read_text(tmp / "err"));
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(parse_json(read_text(tmp / "run/run.json"))["status"] == "completed");
}

TEST_CASE("under a tight address-space limit (ulimit -v) a launch fails saying so, not hangs") {
  // OpenBLAS retries a failed allocation of its work buffer for ever: a rank hung in its first
  // product, and a launcher that had loaded it hung in fork and at exit.
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const std::string command = "ulimit -v 200000; exec timeout -k 5 120 '" + binary() +
                              "' launch '" + recipe.string() + "' --nproc 2 --run-dir '" +
                              (tmp / "run").string() + "' > /dev/null 2> '" +
                              (tmp / "err").string() + "'";
  const int status = std::system(("bash -c \"" + command + "\"").c_str());
  const std::string err = read_text(tmp / "err");
  INFO(err);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 3);
  CHECK(err.find("exited with code 1: out of memory: ") != std::string::npos);
  CHECK(parse_json(read_text(tmp / "run/run.json"))["status"] == "failed");
}

TEST_CASE("SIGHUP (the terminal closed) is a stop like SIGTERM: a checkpoint, exit 143") {
  TempDir tmp;
  SlowRun run(write_recipe(tmp.path(), resumable_recipe()), tmp / "run");
  REQUIRE(::kill(run.launcher.pid(), SIGHUP) == 0);
  CHECK(run.launcher.wait(std::chrono::seconds(60)) == 143);
  check_all_gone(run.pids);
  CHECK(parse_json(read_text(run.run_dir / "run.json"))["status"] == "terminated");
  auto resumed = run_dptrain({"resume", run.run_dir.string()});
  CHECK(resumed.exit_code == 0);

  // Under nohup (SIGHUP ignored, as its children inherit) a hangup changes nothing.
  struct sigaction ignore {
  }, before{};
  ignore.sa_handler = SIG_IGN;
  ::sigaction(SIGHUP, &ignore, &before);
  SlowRun kept(write_recipe(tmp.path(), resumable_recipe()), tmp / "nohup");
  ::sigaction(SIGHUP, &before, nullptr);
  REQUIRE(::kill(kept.launcher.pid(), SIGHUP) == 0);
  CHECK(kept.launcher.wait(std::chrono::seconds(120)) == 0);
  CHECK(parse_json(read_text(kept.run_dir / "run.json"))["status"] == "completed");
}

TEST_CASE("a rank the launcher stops because a peer died says so, not that it checkpoints") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), every_step_logged());
  const fs::path run_dir = tmp / "run";
  // Long steps: rank 0 is inside one (not in a collective with rank 1) when rank 1 dies, and
  // reads the launcher's SIGTERM first.
  Background launcher(SlowRun::launch_args(recipe, run_dir, {}),
                      {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "3000"}});
  // Its first step logged, and a second into the next one's pause.
  REQUIRE(eventually([&] { return !read_text(run_dir / "metrics.jsonl").empty(); }));
  std::this_thread::sleep_for(std::chrono::milliseconds(1000));
  const auto pids = worker_pids(run_dir);
  REQUIRE(pids.size() == 2);
  REQUIRE(::kill(pids[1], SIGKILL) == 0);
  CHECK(launcher.wait(std::chrono::seconds(60)) == 3);
  INFO(launcher.out(), launcher.err());
  CHECK(contains(launcher.out(),
                 "[rank 0] received SIGTERM: a peer rank failed; rank 0 stops "
                 "(the step under way cannot complete: no checkpoint)"));
  CHECK_FALSE(contains(launcher.out(), "checkpoints at the end of this step"));
  CHECK(contains(launcher.err(), "rank 1 (pid "));
  check_all_gone(pids);
}
