// Automatic restarts with injected faults: crashes at several steps and ranks, a failure before
// the first checkpoint, and a deterministic failure that must not be retried forever.
#include <doctest/doctest.h>

#include <sstream>

#include "tests/harness.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;
using nlohmann::json;

TEST_CASE(
    "three crashes at different steps and ranks: --max-restarts 3 completes bit-identically") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  auto clean = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "clean").string()});
  REQUIRE(clean.exit_code == 0);
  auto r = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "faulty").string(),
       "--max-restarts", "3", "--restart-backoff", "0.1", "--json"},
      {{"DPTRAIN_FAULT",
        "crash@step=25,rank=1,gen=1;crash@step=47,rank=0,gen=2;"
        "exit@step=90,rank=1,code=9,gen=3"}});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json out = parse_json(r.out);
  CHECK(out["restarts"] == 3);
  CHECK(out["steps"] == 120);
  CHECK(read_text(latest_params(tmp / "faulty")) == read_text(latest_params(tmp / "clean")));
  const json info = parse_json(read_text(tmp / "faulty/run.json"));
  REQUIRE(info["restarts"].size() == 3);
  CHECK(info["restarts"][0]["from"] == "step-000020");
  CHECK(info["restarts"][0]["cause"].get<std::string>().find("rank 1") != std::string::npos);
  CHECK(info["restarts"][1]["from"] == "step-000040");
  CHECK(info["restarts"][2]["cause"].get<std::string>().find("exited with code 9") !=
        std::string::npos);
  CHECK(info["generations"].size() == 4);
  CHECK(info["status"] == "completed");
}

TEST_CASE("a failure before the first checkpoint restarts from step 0") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  auto clean = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "clean").string()});
  REQUIRE(clean.exit_code == 0);
  auto r =
      run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "early").string(),
                   "--max-restarts", "1", "--restart-backoff", "0.1"},
                  {{"DPTRAIN_FAULT", "crash@step=7,rank=0,gen=1"}});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("restart 1/1") != std::string::npos);
  CHECK(r.out.find("from step 0") != std::string::npos);
  CHECK(read_text(latest_params(tmp / "early")) == read_text(latest_params(tmp / "clean")));
}

TEST_CASE("the same failure three times at one step stops with exit 3: looks deterministic") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  auto r = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir",
                        (tmp / "det").string(), "--max-restarts", "10", "--restart-backoff", "0.1"},
                       {{"DPTRAIN_FAULT", "exit@step=33,rank=1,code=1"}});
  INFO(r.err);
  CHECK(r.exit_code == 3);
  CHECK(r.err.find("deterministic") != std::string::npos);
  const json info = parse_json(read_text(tmp / "det/run.json"));
  CHECK(info["restarts"].size() == 2);
  CHECK(info["generations"].size() == 3);
}

TEST_CASE("without --max-restarts a failure is final; with it exhausted the message says so") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  auto r =
      run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "once").string(),
                   "--max-restarts", "1", "--restart-backoff", "0.1"},
                  {{"DPTRAIN_FAULT", "crash@step=25,rank=1,gen=1;crash@step=65,rank=1,gen=2"}});
  CHECK(r.exit_code == 3);
  CHECK(r.err.find("restarts exhausted: 1 of 1") != std::string::npos);
  CHECK(run_dptrain({"launch", recipe.string(), "--max-restarts", "-1"}).exit_code == 2);
}

TEST_CASE("a hang is detected within hang-timeout + 5 s, named, and the run recovers") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  Background launcher(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "hang").string(),
       "--hang-timeout", "3", "--max-restarts", "1", "--restart-backoff", "0.1"},
      {{"DPTRAIN_FAULT", "hang@step=50,rank=0,gen=1"}});
  // Step 50 is logged as the step before the hang completes: the clock starts there, so a
  // slow start-up on a loaded machine does not count.
  const auto logged_50 = [&] {
    if (!fs::exists(tmp / "hang/metrics.jsonl")) return false;
    for (const auto& m : read_jsonl(tmp / "hang/metrics.jsonl")) {
      if (m.value("step", 0) == 50) return true;
    }
    return false;
  };
  REQUIRE(eventually(logged_50, std::chrono::seconds(60)));
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE(eventually([&] { return launcher.out().find("hang:") != std::string::npos; },
                     std::chrono::seconds(30)));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  CHECK(seconds < 3 + 5);  // the bound: detected within hang-timeout + 5 s
  CHECK(launcher.wait(std::chrono::seconds(120)) == 0);
  const std::string out = launcher.out();
  INFO(out);
  CHECK(out.find("stuck: rank 0 at step 50 in phase data") != std::string::npos);
  CHECK(out.find("waiting for it in collective") != std::string::npos);
  CHECK(out.find("rank 1") != std::string::npos);
  CHECK(out.find("restart 1/1") != std::string::npos);
  const json info = parse_json(read_text(tmp / "hang/run.json"));
  CHECK(info["status"] == "completed");
  CHECK(info["restarts"][0]["cause"].get<std::string>().find("hang:") != std::string::npos);
}

TEST_CASE("--events writes one JSON line per state change, restarts included") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const fs::path events_file = tmp / "events.jsonl";
  auto r = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "ev").string(),
       "--max-restarts", "1", "--restart-backoff", "0.1", "--events", events_file.string()},
      {{"DPTRAIN_FAULT", "crash@step=30,rank=1,gen=1"}});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  std::vector<std::string> names;
  for (const auto& e : read_jsonl(events_file)) {
    CHECK(e.contains("time"));
    names.push_back(e["event"].get<std::string>());
  }
  const auto first = [&](const std::string& name) {
    return std::find(names.begin(), names.end(), name) - names.begin();
  };
  CHECK(names.front() == "generation_started");
  CHECK(names.back() == "run_finished");
  CHECK(first("rendezvous_done") < first("checkpoint_committed"));
  CHECK(first("checkpoint_committed") < first("rank_exited"));
  CHECK(first("rank_exited") < first("restart"));
  CHECK(std::count(names.begin(), names.end(), "generation_started") == 2);
  CHECK(read_jsonl(events_file).back()["status"] == "completed");
  const auto restart = read_jsonl(events_file)[static_cast<size_t>(first("restart"))];
  CHECK(restart["from"] == "step-000020");
  CHECK(restart["cause"].get<std::string>().find("rank 1") != std::string::npos);

  auto stdout_events = run_dptrain(
      {"launch", recipe.string(), "--run-dir", (tmp / "ev2").string(), "--events", "-"});
  REQUIRE(stdout_events.exit_code == 0);
  std::istringstream lines(stdout_events.out);
  int parsed = 0;
  for (std::string line; std::getline(lines, line);) {
    CHECK(json::parse(line, nullptr, false).is_object());
    ++parsed;
  }
  CHECK(parsed >= 4);
  CHECK(run_dptrain({"launch", recipe.string(), "--events", "-", "--json"}).exit_code == 2);
}

TEST_CASE(
    "a crash while a checkpoint is written leaves latest on a verified one; restart finishes") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  auto clean = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "clean").string()});
  REQUIRE(clean.exit_code == 0);
  auto crashed =
      run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "torn").string()},
                  {{"DPTRAIN_FAULT", "crash-in-checkpoint@step=60,rank=0"}});
  CHECK(crashed.exit_code == 3);
  // The half-written step 60 never became a checkpoint: latest still names a verified one.
  CHECK(read_text(tmp / "torn/checkpoints/latest") == "step-000040\n");
  CHECK_FALSE(fs::exists(tmp / "torn/checkpoints/step-000060"));
  CHECK(run_dptrain({"ckpt", "verify", (tmp / "torn").string()}).exit_code == 0);
  auto resumed = run_dptrain({"resume", (tmp / "torn").string()});
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  CHECK(read_text(latest_params(tmp / "torn")) == read_text(latest_params(tmp / "clean")));
  for (const auto& e : fs::directory_iterator(tmp / "torn/checkpoints")) {
    CHECK(e.path().filename().string().rfind(".tmp", 0) != 0);  // the torn write was cleared
  }
}

TEST_CASE("the recipe's fault_tolerance section sets restarts when no flag does") {
  TempDir tmp;
  auto j = resumable_recipe();
  j["fault_tolerance"] = {{"max_restarts", 1}, {"restart_backoff_s", 0.1}};
  const auto recipe = write_recipe(tmp.path(), j);
  auto r = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "ft").string(), "--json"},
      {{"DPTRAIN_FAULT", "crash@step=30,rank=0,gen=1"}});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(parse_json(r.out)["restarts"] == 1);
  // A flag wins over the recipe.
  auto flag = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir",
                           (tmp / "ft0").string(), "--max-restarts", "0"},
                          {{"DPTRAIN_FAULT", "crash@step=30,rank=0,gen=1"}});
  CHECK(flag.exit_code == 3);
  j["fault_tolerance"]["max_restarts"] = -2;
  const auto bad = write_recipe(tmp.path(), j, "bad.json");
  auto b = run_dptrain({"recipe", "validate", bad.string()});
  CHECK(b.exit_code == 2);
  CHECK(b.err.find("/fault_tolerance/max_restarts") != std::string::npos);
}
