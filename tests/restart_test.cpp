// Automatic restarts with injected faults: crashes at several steps and ranks, a failure before
// the first checkpoint, and a deterministic failure that must not be retried forever.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <memory>
#include <sstream>
#include <thread>

#include <fmt/format.h>

#include "tests/frozen_join.hpp"
#include "tests/harness.hpp"
#include "tests/strings.hpp"

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
  // A cause is one line complete in itself: where the rank left lines, it names its log, with
  // no excerpt to follow.
  int naming_log = 0;
  for (const auto& restart : info["restarts"]) {
    const std::string cause = restart["cause"];
    CAPTURE(cause);
    CHECK(cause.find('\n') == std::string::npos);
    CHECK_FALSE(cause.ends_with(":"));
    if (cause.find("; full log: " + (tmp / "faulty/logs").string()) != std::string::npos) {
      ++naming_log;
    }
  }
  CHECK(naming_log >= 1);  // rank 0's crash: its progress lines
  CHECK(info["restarts"][1]["from"] == "step-000040");
  CHECK(info["restarts"][2]["cause"].get<std::string>().find("exited with code 9") !=
        std::string::npos);
  CHECK(info["generations"].size() == 4);
  CHECK(info["status"] == "completed");
  // Each generation says when its ranks met, and where they began (the first three checked).
  for (const int step : {0, 20, 40})
    CHECK(contains(r.err, fmt::format("all 2 ranks met; starting at step {}\n", step)));
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

TEST_CASE("a failure in a generation's first step is recorded as before it; status has the step") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const fs::path run_dir = tmp / "first";
  // Generation 2 resumes from step 20 and fails before its first step is done; generation 3
  // fails at step 32, between two log lines (every 5), and is the last (restarts exhausted).
  auto r = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string(),
                        "--max-restarts", "2", "--restart-backoff", "0.1", "--json"},
                       {{"DPTRAIN_FAULT",
                         "crash@step=27,rank=1,gen=1;crash@step=20,rank=1,gen=2;"
                         "crash@step=32,rank=1,gen=3"}});
  INFO(r.err);
  REQUIRE(r.exit_code == 3);
  const json info = parse_json(read_text(run_dir / "run.json"));
  REQUIRE(info["restarts"].size() == 2);
  CHECK(info["restarts"][0]["failed_after_step"] == 27);
  CHECK(info["restarts"][0]["failed_before_first_step"] == false);
  CHECK(info["restarts"][1]["failed_after_step"] == 20);
  CHECK(info["restarts"][1]["failed_before_first_step"] == true);
  CHECK(info["generations"].back()["step"] == 32);
  // The step reached is the launcher's in launch, status and report alike, not the last logged.
  CHECK(parse_json(r.out)["step"] == 32);
  for (const char* command : {"status", "report"}) {
    CAPTURE(command);
    auto shown = run_dptrain({command, run_dir.string(), "--json"});
    REQUIRE(shown.exit_code == 0);
    CHECK(parse_json(shown.out)["step"] == 32);
  }
}

TEST_CASE("the same failure three times at one step stops with exit 3: looks deterministic") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  // One rank that fails, the other left waiting at its step; or every rank killed at once, right
  // at a step boundary, which no rank's heartbeat is left waiting at.
  std::string fault = "exit@step=33,rank=1,code=1";
  SUBCASE("one rank") {}
  SUBCASE("every rank at once") {
    fault = "crash@step=33";
  }
  auto r = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir",
                        (tmp / "det").string(), "--max-restarts", "10", "--restart-backoff", "0.1"},
                       {{"DPTRAIN_FAULT", fault}});
  INFO(r.err);
  CHECK(r.exit_code == 3);
  CHECK(r.err.find("deterministic") != std::string::npos);
  CHECK(contains(r.err, "dptrain: run directory: " + (tmp / "det").string() +
                            " (once the cause is fixed, continue with 'dptrain resume "));
  const json info = parse_json(read_text(tmp / "det/run.json"));
  CHECK(info["restarts"].size() == 2);
  CHECK(info["generations"].size() == 3);
  // status says as much, and its error (report's too) is the launch's, not the last
  // generation's alone.
  const json status = parse_json(run_dptrain({"status", (tmp / "det").string(), "--json"}).out);
  CHECK(status["hint"] ==
        "it failed 3 times in a row at step 33: once the cause is fixed (see the error), continue "
        "it with 'dptrain resume " +
            (tmp / "det").string() + "'");
  CHECK(status["error"].get<std::string>().starts_with(
      "the job failed 3 times in a row at step 33: this looks deterministic"));
  CHECK(parse_json(run_dptrain({"report", (tmp / "det").string(), "--json"}).out)["error"]
            .get<std::string>()
            .starts_with("the job failed 3 times in a row at step 33: this looks deterministic"));
  // Each failure was said before its back-off, naming the rank, then the restart after it.
  INFO(r.out);
  const auto said = r.out.find("; waiting 0.1s to restart (attempt 1/10)");
  CHECK(said != std::string::npos);
  CHECK(said < r.out.find("restart 1/10 after 0.1s from "));
  // The restart's line names where it starts from, and of the cause its first clause only (the
  // rank that failed first: either, where both are killed at once).
  const size_t restart_at = r.out.find("restart 1/10 after 0.1s from step-000020: rank ");
  REQUIRE(restart_at != std::string::npos);
  const std::string restart_line =
      r.out.substr(restart_at, r.out.find('\n', restart_at) - restart_at);
  CHECK_FALSE(contains(restart_line, "; "));
}

TEST_CASE("failures in a row at one step count over the run: a resume loop stops as early") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const Env fault = {{"DPTRAIN_FAULT", "exit@step=33,rank=1,code=1"}};
  auto first =
      run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "loop").string(),
                   "--max-restarts", "1", "--restart-backoff", "0.1"},
                  fault);
  CHECK(first.exit_code == 3);
  CHECK(first.err.find("restarts exhausted: 1 of 1") != std::string::npos);
  // Two failures at step 33 so far: the third, in the resume, is the last.
  auto resumed = run_dptrain(
      {"resume", (tmp / "loop").string(), "--max-restarts", "5", "--restart-backoff", "0.1"},
      fault);
  INFO(resumed.err);
  CHECK(resumed.exit_code == 3);
  CHECK(resumed.err.find("the job failed 3 times in a row at step 33: this looks deterministic") !=
        std::string::npos);
  const json info = parse_json(read_text(tmp / "loop/run.json"));
  CHECK(info["generations"].size() == 3);
}

namespace {

// A 2-rank launch of resumable_recipe() (written beside run_dir) whose rank 1 crashes at step 25
// (in generation 1 only with `first_only`), waiting `backoff` seconds to restart; returns once it
// waits.
std::unique_ptr<Background> launch_until_restart_wait(const fs::path& run_dir,
                                                      const std::string& backoff, bool first_only) {
  const auto recipe = write_recipe(run_dir.parent_path(), resumable_recipe());
  auto launcher = std::make_unique<Background>(
      std::vector<std::string>{"launch", recipe.string(), "--nproc", "2", "--run-dir",
                               run_dir.string(), "--max-restarts", "2", "--restart-backoff",
                               backoff, "--json"},
      Env{{"DPTRAIN_FAULT", first_only ? "crash@step=25,rank=1,gen=1" : "crash@step=25,rank=1"}});
  REQUIRE(eventually([&] {
    return fs::exists(run_dir / "run.json") &&
           parse_json(read_text(run_dir / "run.json")).contains("pending_restart");
  }));
  return launcher;
}

}  // namespace

TEST_CASE("a stop while waiting to restart keeps the failure it was for in the message") {
  TempDir tmp;
  const fs::path run_dir = tmp / "waiting";
  const auto waiting = launch_until_restart_wait(run_dir, "30", false);
  Background& launcher = *waiting;
  REQUIRE(::kill(launcher.pid(), SIGTERM) == 0);
  CHECK(launcher.wait(std::chrono::seconds(20)) == 143);
  const std::string error = parse_json(launcher.out())["error"];
  CHECK(
      error.starts_with("stopped by SIGTERM while waiting to restart (a resume continues from "
                        "step-000020) after: rank 1 "));
  CHECK(parse_json(read_text(run_dir / "run.json"))["error"] == error);
}

TEST_CASE("a launcher killed while waiting to restart: resume leaves no pending restart behind") {
  TempDir tmp;
  const fs::path run_dir = tmp / "killed";
  const auto waiting = launch_until_restart_wait(run_dir, "30", true);
  REQUIRE(::kill(waiting->pid(), SIGKILL) == 0);
  waiting->wait(std::chrono::seconds(20));
  auto resumed = run_dptrain({"resume", run_dir.string(), "--json"});
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  const json info = parse_json(read_text(run_dir / "run.json"));
  CHECK(info["status"] == "completed");
  CHECK_FALSE(info.contains("pending_restart"));
}

TEST_CASE("a restart with no checkpoint that verifies stops with exit 5, writing over none") {
  TempDir tmp;
  const fs::path run_dir = tmp / "spoiled";
  const auto waiting = launch_until_restart_wait(run_dir, "3", true);
  Background& launcher = *waiting;
  // Every checkpoint is damaged while the launcher waits to restart.
  std::vector<fs::path> blobs;
  for (const auto& entry : fs::directory_iterator(run_dir / "checkpoints")) {
    if (entry.path().filename().string().starts_with("step-")) {
      blobs.push_back(entry.path() / "params.bin");
      std::ofstream(blobs.back(), std::ios::app | std::ios::binary) << 'x';
    }
  }
  REQUIRE_FALSE(blobs.empty());
  std::vector<std::string> damaged;
  for (const auto& b : blobs)
    damaged.push_back(read_text(b));
  CHECK(launcher.wait(std::chrono::seconds(60)) == 5);
  const json out = parse_json(launcher.out());
  const std::string error = out["error"];
  INFO(error, launcher.err());
  CHECK(error.starts_with("rank 1 "));  // the failure first, then why it was not restarted
  // A resume would meet the damaged checkpoints too: the hint says to fix them first.
  CHECK(launcher.err().find("(once the cause is fixed, continue with 'dptrain resume ") !=
        std::string::npos);
  CHECK(error.find(fmt::format("(not restarted: {}: none of its {} checkpoint(s) is usable",
                               (run_dir / "checkpoints").string(), blobs.size())) !=
        std::string::npos);
  // Why each was passed over, on the lines after that parenthesis (in the JSON error too).
  CHECK(error.find("new run directory)\n  skipping checkpoint step-") != std::string::npos);
  // Nothing started over: the damaged checkpoints are as they were, and no restart is recorded.
  for (size_t i = 0; i < blobs.size(); ++i)
    CHECK(read_text(blobs[i]) == damaged[i]);
  const json info = parse_json(read_text(run_dir / "run.json"));
  CHECK(info["status"] == "failed");
  CHECK(info.value("restarts", json::array()).empty());
  // Said once, under the error: not also as warnings before it.
  CHECK(contains(launcher.err(), "\n  skipping checkpoint step-000020: params.bin"));
  CHECK_FALSE(contains(launcher.err(), "warning: skipping checkpoint step-000020"));
}

TEST_CASE("a restart skips a checkpoint of another recipe copied into the run") {
  TempDir tmp;
  // Another run's checkpoints, of a recipe that differs in its learning rate only.
  auto other = resumable_recipe();
  other["optimizer"]["lr"] = other["optimizer"].value("lr", 0.01) * 2;
  const auto other_recipe = write_recipe(tmp.path(), other, "other.json");
  REQUIRE(run_dptrain({"launch", other_recipe.string(), "--nproc", "2", "--run-dir",
                       (tmp / "other").string()})
              .exit_code == 0);
  const fs::path foreign = tmp / "other/checkpoints/step-000120";
  const std::string foreign_params = read_text(foreign / "params.bin");

  const fs::path run_dir = tmp / "run";
  const auto waiting = launch_until_restart_wait(run_dir, "3", true);
  Background& launcher = *waiting;
  // Copied in, newer than any of the run's, and named by `latest`, while the launcher waits.
  fs::copy(foreign, run_dir / "checkpoints/step-000120");
  write_text(run_dir / "checkpoints/latest", "step-000120\n");
  CHECK(launcher.wait(std::chrono::seconds(120)) == 0);
  INFO(launcher.err());
  CHECK(launcher.err().find("warning: skipping checkpoint step-000120: written by a different "
                            "recipe (hash ") != std::string::npos);
  const json info = parse_json(read_text(run_dir / "run.json"));
  CHECK(info["status"] == "completed");
  REQUIRE(info["restarts"].size() == 1);
  CHECK(info["restarts"][0]["from"] == "step-000020");
  // Set aside, not written over: the run wrote its own step 120 in the end.
  CHECK(launcher.err().find("warning: set aside step-000120 as step-000120.corrupt") !=
        std::string::npos);
  CHECK(read_text(run_dir / "checkpoints/step-000120.corrupt/params.bin") == foreign_params);
  CHECK(read_text(latest_params(run_dir)) != foreign_params);
  CHECK(run_dptrain({"ckpt", "verify", run_dir.string()}).exit_code == 0);
  fs::remove_all(run_dir / "checkpoints/step-000120.corrupt");

  // resume skips it too, and sets it aside as it does a damaged one.
  json failed = info;
  failed["status"] = "failed";  // as if it had died after its last checkpoint
  write_text(run_dir / "run.json", failed.dump());
  const std::string own_params = read_text(latest_params(run_dir));
  fs::remove_all(run_dir / "checkpoints/step-000120");
  fs::copy(foreign, run_dir / "checkpoints/step-000120");
  // ckpt makes the check resume makes: its files verify, but this run cannot use it.
  const auto verify = run_dptrain({"ckpt", "verify", run_dir.string(), "step-000120"});
  CHECK(verify.exit_code == 5);
  CHECK_MESSAGE(verify.err.find((run_dir / "checkpoints/step-000120/meta.json").string() +
                                ": written by a different recipe (hash ") != std::string::npos,
                verify.err);
  const json listed = parse_json(run_dptrain({"ckpt", "list", run_dir.string(), "--json"}).out);
  for (const auto& row : listed["checkpoints"]) {
    CAPTURE(row["name"]);
    CHECK(row["ok"] == (row["name"] != "step-000120"));
  }
  // Newer than the run's own, it is still not what status and report name: they name the one
  // resume continues from. A plain verify checks that one, and the one `latest` names: this.
  const auto plain = run_dptrain({"ckpt", "verify", run_dir.string()});
  CHECK(plain.exit_code == 5);
  CHECK(plain.out.find("step-000100") != std::string::npos);
  CHECK(plain.err.find((run_dir / "checkpoints/step-000120/meta.json").string() +
                       ": written by a different recipe (hash ") != std::string::npos);
  for (const char* command : {"status", "report"}) {
    CAPTURE(command);
    const json seen = parse_json(run_dptrain({command, run_dir.string(), "--json"}).out);
    CHECK(seen["last_checkpoint"].get<std::string>().ends_with("step-000100"));
    // Nor is it counted among those a resume may use.
    CHECK(seen["checkpoints"] ==
          parse_json(run_dptrain({"ckpt", "list", run_dir.string(), "--json"}).out)["checkpoints"]
                  .size() -
              1);
  }
  // report counts it among those that fail verification, saying why, as ckpt list does.
  const json report = parse_json(
      run_dptrain({"report", run_dir.string(), "--json", "--out", (tmp / "report.html").string()})
          .out);
  CHECK(report["checkpoints_failed"] == 1);
  CHECK(read_text(tmp / "report.html").find("FAILED: written by a different recipe (hash ") !=
        std::string::npos);
  const auto resumed = run_dptrain({"resume", run_dir.string()});
  INFO(resumed.out, resumed.err);
  CHECK(resumed.exit_code == 0);
  CHECK(resumed.err.find("skipping checkpoint step-000120: written by a different recipe") !=
        std::string::npos);
  CHECK(resumed.out.find("from step-000100") != std::string::npos);
  CHECK(fs::exists(run_dir / "checkpoints/step-000120.corrupt"));
  CHECK(read_text(latest_params(run_dir)) == own_params);
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
  // status gives the whole of it, as the launch said it.
  CHECK(contains(parse_json(run_dptrain({"status", (tmp / "once").string(), "--json"}).out)["error"]
                     .get<std::string>(),
                 "(restarts exhausted: 1 of 1 for this invocation)"));
  CHECK(run_dptrain({"launch", recipe.string(), "--max-restarts", "-1"}).exit_code == 2);
}

TEST_CASE("a diverging run is not restarted: its error names the step, events and run.json end") {
  TempDir tmp;
  auto recipe_json = resumable_recipe();
  recipe_json["optimizer"] = {{"type", "sgd"}, {"lr", 1e4}, {"momentum", 0.9}};
  recipe_json["checkpoint"] = {{"every", 2}, {"keep", 2}};
  recipe_json["log"]["every"] = 1;
  const auto recipe = write_recipe(tmp.path(), recipe_json);
  const fs::path run_dir = tmp / "div", events = tmp / "events.jsonl";
  auto r = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string(),
                        "--max-restarts", "3", "--restart-backoff", "0.1", "--events",
                        events.string(), "--json"});
  INFO(r.out, r.err);
  CHECK(r.exit_code == 3);
  const json out = parse_json(r.out);
  const std::string first = out["errors"][0];
  CHECK(first.find("exited with code 2: the training diverged at step ") != std::string::npos);
  CHECK(out["error"].get<std::string>().find("(not restarted") != std::string::npos);
  CHECK(out["restarts"] == 0);
  CHECK(r.err.find("dptrain resume") == std::string::npos);  // it would diverge again
  // Nor does status offer one.
  CHECK(parse_json(run_dptrain({"status", run_dir.string(), "--json"}).out)["hint"] ==
        "a resume would meet its error again (the recipe, its data or a setting: see the error); "
        "fix that first: data or a setting, then resume; a changed recipe, launched into a new "
        "run directory");
  const json info = parse_json(read_text(run_dir / "run.json"));
  CHECK(info["status"] == "failed");
  CHECK(info["generations"].size() == 1);
  CHECK(info["generations"][0]["status"] == "failed");
  CHECK_FALSE(info.contains("restarts"));
  const auto lines = read_jsonl(events);
  REQUIRE_FALSE(lines.empty());
  CHECK(lines.back()["event"] == "run_finished");
  CHECK(std::any_of(lines.begin(), lines.end(),
                    [](const json& e) { return e["event"] == "generation_ended"; }));
  // What was checkpointed is finite and verifies.
  CHECK(run_dptrain({"ckpt", "verify", run_dir.string()}).exit_code == 0);
}

TEST_CASE("a hang of a job of one rank is detected too (no peer would ever time out)") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const auto r = run_dptrain({"launch", recipe.string(), "--nproc", "1", "--run-dir",
                              (tmp / "one").string(), "--hang-timeout", "2", "--json"},
                             {{"DPTRAIN_FAULT", "hang@step=5"}}, std::chrono::seconds(90));
  INFO(r.err);
  CHECK(r.exit_code == 3);
  CHECK(contains(r.err, "hang: "));
  CHECK(contains(r.err, "stuck: rank 0 at step 5"));
  CHECK(parse_json(r.out)["exit_code"] == 3);
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
  CHECK(seconds < 3 + 5);  // the issue's bound: detected within hang-timeout + 5 s
  CHECK(launcher.wait(std::chrono::seconds(120)) == 0);
  const std::string out = launcher.out();
  INFO(out);
  CHECK(out.find("stuck: rank 0 at step 50 in phase data") != std::string::npos);
  CHECK(out.find("waiting for it in collective #") != std::string::npos);
  CHECK(out.find("(allreduce of gradient bucket ") != std::string::npos);
  CHECK(out.find("rank 1") != std::string::npos);
  CHECK(out.find("restart 1/1") != std::string::npos);
  const json info = parse_json(read_text(tmp / "hang/run.json"));
  CHECK(info["status"] == "completed");
  CHECK(info["restarts"][0]["cause"].get<std::string>().find("hang:") != std::string::npos);
}

TEST_CASE("an eval longer than --hang-timeout that makes progress is not a hang") {
  TempDir tmp;
  auto j = small_recipe();
  // About 225,000 held-out samples through a 64-2048-2048-4 MLP: seconds of eval on each rank,
  // in chunks that take a fraction of one.
  j["model"] = {{"type", "mlp"}, {"input", 64}, {"hidden", {2048, 2048}}, {"classes", 4}};
  j["data"] = {{"type", "synthetic-classification"}, {"samples", 250000}, {"eval_fraction", 0.9}};
  j["train"]["steps"] = 4;
  j["log"] = {{"every", 1}};
  j["eval"] = {{"every", 4}};
  j["optimizer"]["schedule"] = {{"type", "cosine"}, {"warmup", 1}};
  const auto recipe = write_recipe(tmp.path(), j);
  const fs::path run = tmp / "eval";
  constexpr int kTimeout = 4;
  Background launcher({"launch", recipe.string(), "--nproc", "2", "--run-dir", run.string(),
                       "--hang-timeout", std::to_string(kTimeout), "--json"});
  // The eval's length: from the last step's metrics line to the eval's.
  const auto logged = [&](const char* key) {
    if (!fs::exists(run / "metrics.jsonl")) return false;
    for (const auto& m : read_jsonl(run / "metrics.jsonl")) {
      if (m.contains(key) && m.value("step", 0) == 4) return true;
    }
    return false;
  };
  REQUIRE(eventually([&] { return logged("loss"); }, std::chrono::seconds(120)));
  const auto t0 = std::chrono::steady_clock::now();
  const bool evaluated = eventually([&] { return logged("eval_loss"); }, std::chrono::seconds(120));
  const double eval_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int code = launcher.wait(std::chrono::seconds(120));
  INFO(launcher.err(), eval_s);
  CHECK(evaluated);
  CHECK(code == 0);
  CHECK(launcher.err().find("hang:") == std::string::npos);
  // Else the eval was too short to have tested anything (a faster machine: raise the samples).
  CHECK(eval_s > kTimeout);
}

TEST_CASE("a start longer than --hang-timeout (a long data load) is not a hang") {
  TempDir tmp;
  auto j = small_recipe();
  j["train"]["steps"] = 20;
  const auto recipe = write_recipe(tmp.path(), j);
  const fs::path events = tmp / "events.jsonl";
  // Rank 1 takes three times the hang timeout between meeting the others and its first step;
  // its heartbeat goes on. Rank 0 waits for it.
  const auto t0 = std::chrono::steady_clock::now();
  const auto r =
      run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "slow").string(),
                   "--hang-timeout", "2", "--events", events.string(), "--json"},
                  {{"DPTRAIN_FAULT", "slow-start@rank=1,ms=6000"}});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(r.err);
  CHECK(seconds > 6);  // the pause was there
  CHECK(r.exit_code == 0);
  CHECK(parse_json(r.out)["restarts"] == 0);
  for (const auto& e : read_jsonl(events))
    CHECK(e["event"] != "hang_detected");
}

TEST_CASE("a rank frozen before the ranks meet is named within hang-timeout + 5 s, not timeout_s") {
  TempDir tmp;
  auto recipe_json = resumable_recipe();
  recipe_json["distributed"]["timeout_s"] = 120;  // the wait the others would otherwise sit out
  const auto recipe = write_recipe(tmp.path(), recipe_json);
  const std::string verdict = frozen_join_verdict(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "join").string()},
      "freeze-before-join@rank=1,gen=1", tmp / "events.jsonl");
  CAPTURE(verdict);
  CHECK(contains(verdict, "stuck: rank 1 (no heartbeat in the "));
  CHECK(contains(verdict, "frozen, or unable to reach the store, before it joined)"));
  CHECK(contains(verdict, "; waiting for it to join: rank 0"));
}

TEST_CASE(
    "without --hang-timeout, a rank that never joined: the hint fits launcher-started ranks") {
  TempDir tmp;
  auto recipe_json = resumable_recipe();
  recipe_json["distributed"]["timeout_s"] = 3;
  const auto recipe = write_recipe(tmp.path(), recipe_json);
  const auto r = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "join").string(), "--json"},
      {{"DPTRAIN_FAULT", "freeze-before-join@rank=1"}});
  INFO(r.err);
  CHECK(r.exit_code == 3);
  const std::string error = parse_json(r.out)["error"];
  CHECK(contains(error, "rank 1 of 2 did not join within 3s"));
  // Not "start every rank with the same store": the launcher did.
  CHECK(contains(error,
                 "; the launcher started every rank with the same store and world size: "
                 "the log of each rank that did not join says where it stopped (frozen, "
                 "or still starting), or give them longer than 3s to start "
                 "(distributed.timeout_s)"));
  CHECK_FALSE(contains(error, "; start every rank"));
  // The rank's own line, shown live, says the same.
  CHECK(contains(r.err, "[rank 0] dptrain: error: rank 0: rank 1 of 2 did not join within 3s"));
  CHECK_FALSE(contains(r.err, "; start every rank"));
}

TEST_CASE("without --hang-timeout, a collective that times out names the rank it waited for") {
  TempDir tmp;
  auto recipe_json = resumable_recipe();
  recipe_json["distributed"]["timeout_s"] = 5;
  const auto recipe = write_recipe(tmp.path(), recipe_json);
  // A rank stuck in its step is named where its heartbeat puts it; a frozen one's last heartbeat
  // may put it in the collective its peer waits in: its silence is what names it.
  std::string fault, named;
  SUBCASE("stuck") {
    fault = "hang@step=15,rank=1";
    named = "; by the ranks' last heartbeats, stuck: rank 1 at step 15";
  }
  SUBCASE("frozen") {
    fault = "freeze@step=15,rank=1";
    named = "; by the ranks' last heartbeats, stuck: rank 1 (its heartbeat stopped ";
  }
  SUBCASE("a straggler that catches up within the stop's grace") {
    // Behind by 8 s, past the 5 s timeout: it enters the collective after its peer gave up, and
    // the heartbeats as the peer failed, not as it then is, name it.
    fault = "slow@step=15,rank=1,ms=8000";
    named = "; by the ranks' last heartbeats, stuck: rank 1 at step 15 in phase data";
  }
  auto r = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "timeout").string()},
      {{"DPTRAIN_FAULT", fault}});
  INFO(r.err);
  CHECK(r.exit_code == 3);
  // Rank 0 gave up waiting; rank 1, which it waited for, is the one named stuck.
  CHECK(contains(r.err, "rank 0 (pid "));
  CHECK(contains(r.err, named));
  CHECK(contains(r.err, "; waiting for it in collective #"));
}

TEST_CASE("--events to a FIFO: the wait for its reader is said, and a stop ends it") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const fs::path fifo = tmp / "events.fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  const std::string waiting = "dptrain: --events: waiting for a reader of the FIFO " +
                              fifo.string() + " (the launch goes on once one opens it";
  // No reader yet: said, and nothing made; a stop ends the wait with the signal's exit code.
  {
    Background launch({"launch", recipe.string(), "--run-dir", (tmp / "stopped").string(),
                       "--events", fifo.string(), "--json"});
    REQUIRE(eventually([&] { return contains(launch.err(), waiting); }));
    REQUIRE(::kill(launch.pid(), SIGTERM) == 0);
    CHECK(launch.wait(std::chrono::seconds(30)) == 143);
    INFO(launch.err());
    CHECK(parse_json(launch.out())["error"] ==
          "stopped by SIGTERM while waiting for a reader of the --events FIFO (no rank started)");
    CHECK_FALSE(fs::exists(tmp / "stopped"));
  }
  // A launch refused before it opened the stream (its recipe cannot be read) does not wait for
  // a reader to end it: the refusal is said at once.
  {
    const auto refused =
        run_dptrain({"launch", (tmp / "missing.json").string(), "--run-dir",
                     (tmp / "refused").string(), "--events", fifo.string(), "--json"});
    CHECK(refused.exit_code == 2);
    CHECK_FALSE(contains(refused.err, "waiting for a reader"));
    CHECK(parse_json(refused.out)["exit_code"] == 2);
  }
  // Nor one refused for its run directory (it holds a completed run), found after the recipe
  // was read: refused without a wait, with its own exit code.
  {
    const fs::path done = tmp / "done";
    REQUIRE(run_dptrain({"launch", recipe.string(), "--run-dir", done.string()}).exit_code == 0);
    const auto refused = run_dptrain({"launch", recipe.string(), "--run-dir", done.string(),
                                      "--events", fifo.string(), "--json"},
                                     {}, std::chrono::seconds(60));
    INFO(refused.err);
    CHECK(refused.exit_code == 2);
    CHECK_FALSE(contains(refused.err, "waiting for a reader"));
    CHECK(contains(refused.err, done.string()));
    CHECK(parse_json(refused.out)["exit_code"] == 2);
  }
  // A reader that comes later gets the whole stream.
  Background launch(
      {"launch", recipe.string(), "--run-dir", (tmp / "read").string(), "--events", fifo.string()});
  REQUIRE(eventually([&] { return contains(launch.err(), waiting); }));
  const std::string stream = read_text(fifo);  // to the writer's end
  CHECK(launch.wait(std::chrono::seconds(120)) == 0);
  std::istringstream lines(stream);
  std::vector<std::string> names;
  for (std::string line; std::getline(lines, line);)
    names.push_back(parse_json(line)["event"].get<std::string>());
  REQUIRE_FALSE(names.empty());
  CHECK(names.front() == "generation_started");
  CHECK(names.back() == "run_finished");
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
  CHECK(first("rank_exited") < first("restart_pending"));
  CHECK(first("restart_pending") < first("restart"));
  CHECK(std::count(names.begin(), names.end(), "generation_started") == 2);
  // Said before the back-off, which it announces.
  const auto pending = read_jsonl(events_file)[static_cast<size_t>(first("restart_pending"))];
  CHECK(pending["attempt"] == 1);
  CHECK(pending["max_restarts"] == 1);
  CHECK(pending["backoff_s"] == 0.1);
  CHECK(contains(pending["cause"].get<std::string>(), "rank 1"));
  CHECK(read_jsonl(events_file).back()["status"] == "completed");
  CHECK(read_jsonl(events_file).back()["errors"] == json::array());  // as --json has it
  const auto restart = read_jsonl(events_file)[static_cast<size_t>(first("restart"))];
  CHECK(restart["from"] == "step-000020");
  CHECK(restart["cause"].get<std::string>().find("rank 1") != std::string::npos);
  // The same names as run.json's record of it.
  CHECK(restart["failed_after_step"] == 30);
  CHECK(restart["failed_at_step"] == 30);
  CHECK(restart["failed_before_first_step"] == false);
  CHECK(parse_json(read_text(tmp / "ev/run.json"))["restarts"][0]["failed_after_step"] == 30);

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

  // Beside the run's own files (made with the directory), the stream is the run's; among another
  // run's files (or the run's own), it is refused before anything is written.
  const fs::path own = tmp / "own";
  auto beside = run_dptrain({"launch", recipe.string(), "--run-dir", own.string(), "--events",
                             (own / "events.jsonl").string()});
  INFO(beside.err);
  REQUIRE(beside.exit_code == 0);
  CHECK(read_jsonl(own / "events.jsonl").back()["event"] == "run_finished");
  CHECK(run_dptrain({"status", own.string()}).exit_code == 0);
  // Named with a trailing separator, the run directory is the same one.
  CHECK(run_dptrain({"launch", recipe.string(), "--run-dir", (tmp / "own2").string() + "/",
                     "--events", (tmp / "own2/events.jsonl").string()})
            .exit_code == 0);
  CHECK(read_jsonl(tmp / "own2/events.jsonl").back()["status"] == "completed");
  // Below the run directory's top (its logs/, made already): refused, nothing written.
  fs::create_directories(tmp / "own3/logs");
  auto below = run_dptrain({"launch", recipe.string(), "--run-dir", (tmp / "own3").string(),
                            "--events", (tmp / "own3/logs/e.jsonl").string()});
  CHECK(below.exit_code == 2);
  CHECK(contains(below.err, ": inside the run directory " + (tmp / "own3").string()));
  CHECK_FALSE(fs::exists(tmp / "own3/logs/e.jsonl"));
  const std::string ev_run = read_text(tmp / "ev/run.json");
  const std::string ev_meta = read_text(tmp / "ev/checkpoints/step-000120/meta.json");
  for (const fs::path& target :
       {tmp / "ev/run.json", tmp / "ev/checkpoints/step-000120/meta.json", tmp / "ev/x.jsonl"}) {
    auto refused = run_dptrain({"launch", recipe.string(), "--run-dir", (tmp / "ev5").string(),
                                "--events", target.string()});
    CHECK(refused.exit_code == 2);
    CHECK(refused.err == "dptrain: error: --events " + target.string() +
                             ": inside the run directory " + (tmp / "ev").string() +
                             ", whose files the events must not mix with; name a file outside "
                             "every run directory, or one of its own next to run.json in the "
                             "run's directory (such as " +
                             (tmp / "ev5/events.jsonl").string() + ")\n");
    CHECK_FALSE(fs::exists(tmp / "ev5"));
  }
  auto own_file = run_dptrain({"launch", recipe.string(), "--run-dir", (tmp / "ev6").string(),
                               "--events", (tmp / "ev6/metrics.jsonl").string()});
  CHECK(own_file.exit_code == 2);
  CHECK(contains(own_file.err, ": one of the files of the run directory "));
  CHECK_FALSE(fs::exists(tmp / "ev6"));
  CHECK(read_text(tmp / "ev/run.json") == ev_run);
  CHECK(read_text(tmp / "ev/checkpoints/step-000120/meta.json") == ev_meta);
  // A file that holds something else than events (the recipe itself, named by a slip): refused
  // by a launch and a resume alike, nothing appended to it, nothing made.
  const std::string recipe_text = read_text(recipe);
  for (const std::vector<std::string>& command :
       {std::vector<std::string>{"launch", recipe.string(), "--run-dir", (tmp / "ev7").string()},
        std::vector<std::string>{"resume", (tmp / "ev").string()}}) {
    CAPTURE(command[0]);
    auto args = command;
    args.insert(args.end(), {"--events", recipe.string(), "--json"});
    auto slip = run_dptrain(args);
    CHECK(slip.exit_code == 2);
    CHECK(parse_json(slip.out)["error"] ==
          "--events " + recipe.string() +
              ": holds something else than events (its first line is not an event's JSON "
              "object), so nothing is appended to it; name another file, or remove it first");
    CHECK(read_text(recipe) == recipe_text);
  }
  CHECK_FALSE(fs::exists(tmp / "ev7"));
  CHECK(read_text(tmp / "ev/run.json") == ev_run);
  // A launch refused at its run directory still ends the stream it opened.
  const fs::path refused_events = tmp / "refused.jsonl";
  CHECK(run_dptrain({"launch", recipe.string(), "--run-dir", (tmp / "ev").string(), "--events",
                     refused_events.string()})
            .exit_code == 2);
  const auto refused_stream = read_jsonl(refused_events);
  REQUIRE(refused_stream.size() == 1);
  CHECK(refused_stream[0]["event"] == "run_finished");
  CHECK(refused_stream[0]["exit_code"] == 2);
  CHECK(refused_stream[0]["status"] == "error");  // as the --json outcome's: not a failed run
  CHECK(refused_stream[0]["run_dir"].is_null());  // this launch made none
  CHECK(refused_stream[0]["error"].get<std::string>().starts_with(
      "the launch did not start: " + (tmp / "ev").string() + ": already holds a run"));
  // So does one refused before that: its recipe missing, no run directory made yet (the one it
  // was given is not named: it does not exist).
  const fs::path early_events = tmp / "early.jsonl";
  CHECK(run_dptrain({"launch", (tmp / "missing.json").string(), "--run-dir",
                     (tmp / "early").string(), "--events", early_events.string()})
            .exit_code == 2);
  CHECK_FALSE(fs::exists(tmp / "early"));
  const auto early_stream = read_jsonl(early_events);
  REQUIRE(early_stream.size() == 1);
  CHECK(early_stream[0]["event"] == "run_finished");
  CHECK(early_stream[0]["exit_code"] == 2);
  CHECK(early_stream[0]["run_dir"].is_null());
  CHECK(early_stream[0]["error"].get<std::string>().starts_with(
      "the launch did not start: " + (tmp / "missing.json").string() + ": cannot read"));
  // Its messages as the --json object on stdout has them.
  const auto early_json = run_dptrain(
      {"launch", (tmp / "missing.json").string(), "--run-dir", (tmp / "early").string(), "--json"});
  CHECK(early_stream[0]["errors"] == parse_json(early_json.out)["errors"]);
  CHECK(early_stream[0]["status"] == parse_json(early_json.out)["status"]);
  // And one refused at an option's value, whichever option it is.
  for (const std::string command : {"launch", "resume"}) {
    CAPTURE(command);
    const fs::path option_events = tmp / (command + "-option.jsonl");
    CHECK(run_dptrain({command, (tmp / "x").string(), "--events", option_events.string(),
                       "--max-restarts", "abc"})
              .exit_code == 2);
    const auto option_stream = read_jsonl(option_events);
    REQUIRE(option_stream.size() == 1);
    CHECK(option_stream[0]["event"] == "run_finished");
    CHECK(option_stream[0]["exit_code"] == 2);
    CHECK(option_stream[0]["error"] == "the " + command +
                                           " did not start: --max-restarts: 'abc' is not a whole "
                                           "number (see 'dptrain " +
                                           command + " --help')");
  }

  // Another name of stdout is stdout: refused with --json, else the events alone go there.
  const auto named = run_dptrain({"launch", recipe.string(), "--run-dir", (tmp / "ev5").string(),
                                  "--events", "/dev/stdout", "--json"});
  CHECK(named.exit_code == 2);
  CHECK(contains(named.err, "dptrain: error: --events /dev/stdout: not with --json"));
  CHECK_FALSE(fs::exists(tmp / "ev5"));
  const auto plain = run_dptrain(
      {"launch", recipe.string(), "--run-dir", (tmp / "ev6").string(), "--events", "/dev/stdout"});
  CHECK(plain.exit_code == 0);
  std::istringstream plain_lines(plain.out);
  std::string line, last_event;
  while (std::getline(plain_lines, line)) {
    CAPTURE(line);
    const json event = parse_json(line);
    last_event = event["event"];
  }
  CHECK(last_event == "run_finished");
  CHECK(contains(plain.err, "run directory " + (tmp / "ev6").string()));

  // /dev/null as both is not stdout shared: nothing is overwritten there.
  const int null_status = std::system(
      ("'" + binary() + "' launch '" + recipe.string() + "' --run-dir '" + (tmp / "ev7").string() +
       "' --events /dev/null --json > /dev/null 2> '" + (tmp / "ev7.err").string() + "'")
          .c_str());
  CHECK(WIFEXITED(null_status));
  CHECK(WEXITSTATUS(null_status) == 0);
  CHECK_FALSE(contains(read_text(tmp / "ev7.err"), "not with --json"));

  // A stream that cannot be written (a full disk) is warned about once; the run goes on.
  if (!fs::exists("/dev/full")) return;
  auto full = run_dptrain(
      {"launch", recipe.string(), "--run-dir", (tmp / "ev3").string(), "--events", "/dev/full"});
  INFO(full.err);
  CHECK(full.exit_code == 0);
  CHECK(full.err.find("dptrain: warning: --events: cannot write /dev/full: No space left on "
                      "device; the events from here on are lost\n") != std::string::npos);
  CHECK(std::count(full.err.begin(), full.err.end(), '\n') == 1);
  CHECK(parse_json(read_text(tmp / "ev3/run.json"))["status"] == "completed");
  // With --json, its outcome's "warnings" says it too: the stream cannot.
  auto full_json = run_dptrain({"launch", recipe.string(), "--run-dir", (tmp / "ev3j").string(),
                                "--events", "/dev/full", "--json"});
  CHECK(full_json.exit_code == 0);
  CHECK(parse_json(full_json.out)["warnings"] ==
        json::array({"--events: cannot write /dev/full: No space left on device; the events "
                     "from here on are lost"}));
  // On stdout, the warning is the one word about it: the job's exit code stands.
  const int status = std::system(
      ("'" + binary() + "' launch '" + recipe.string() + "' --run-dir '" + (tmp / "ev4").string() +
       "' --events - > /dev/full 2> '" + (tmp / "ev4.err").string() + "'")
          .c_str());
  const std::string err = read_text(tmp / "ev4.err");
  INFO(err);
  CHECK(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(contains(err,
                 "dptrain: warning: --events: cannot write stdout: No space left on device; "
                 "the events from here on are lost\n"));
  CHECK_FALSE(contains(err, "standard output"));
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

namespace {

// The step of the checkpoint `latest` names in run_dir.
int64_t latest_step(const fs::path& run_dir) {
  const std::string latest = read_text(run_dir / "checkpoints/latest");
  return parse_json(read_text(run_dir / "checkpoints" / latest.substr(0, latest.find('\n')) /
                              "meta.json"))["step"]
      .get<int64_t>();
}

bool logged_step(const fs::path& run_dir, int64_t step) {
  if (!fs::exists(run_dir / "metrics.jsonl")) return false;
  for (const auto& m : read_jsonl(run_dir / "metrics.jsonl")) {
    if (m.value("step", int64_t{0}) >= step) return true;
  }
  return false;
}

}  // namespace

TEST_CASE("SIGTERM with a hung rank: the hang watch ends the wait; no checkpoint is claimed") {
  TempDir tmp;
  auto j = small_recipe();
  j["checkpoint"] = {{"every", 10}, {"keep", 3}};
  const auto recipe = write_recipe(tmp.path(), j);
  const fs::path dir = tmp / "hung";
  Background launcher(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", dir.string(), "--hang-timeout", "5"},
      {{"DPTRAIN_FAULT", "hang@step=15,rank=1"}});
  // Step 15 is logged just before rank 1 hangs.
  REQUIRE(eventually([&] { return logged_step(dir, 15); }, std::chrono::seconds(60)));
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  const auto t0 = std::chrono::steady_clock::now();
  REQUIRE(::kill(launcher.pid(), SIGTERM) == 0);
  const int code = launcher.wait(std::chrono::seconds(60));
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string err = launcher.err();
  INFO(err, launcher.out());
  CHECK(code == 143);
  CHECK(seconds < 5 + 10);  // not the 60 s stop grace
  CHECK(err.find("every rank checkpointed") == std::string::npos);
  CHECK(err.find("stopped by SIGTERM") != std::string::npos);
  CHECK(err.find("hang:") != std::string::npos);
  CHECK(err.find("rank 1 at step 15") != std::string::npos);
  CHECK(err.find("the newest checkpoint is step-000010") != std::string::npos);
  const json info = parse_json(read_text(dir / "run.json"));
  CHECK(info["status"] == "terminated");
}

TEST_CASE("two SIGTERMs are one stop: every rank checkpoints, exit 143, resume finishes") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const fs::path dir = tmp / "twice";
  Background launcher({"launch", recipe.string(), "--nproc", "2", "--run-dir", dir.string()},
                      {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "30"}});
  REQUIRE(eventually([&] { return logged_step(dir, 25); }, std::chrono::seconds(60)));
  REQUIRE(::kill(launcher.pid(), SIGTERM) == 0);
  std::this_thread::sleep_for(std::chrono::milliseconds(5));
  REQUIRE(::kill(launcher.pid(), SIGTERM) == 0);
  const int code = launcher.wait(std::chrono::seconds(60));
  INFO(launcher.err());
  CHECK(code == 143);
  CHECK(launcher.err().find("every rank checkpointed its last step") != std::string::npos);
  const int64_t stopped_at = latest_step(dir);
  CHECK(stopped_at > 20);
  CHECK(stopped_at % 20 != 0);  // the stop wrote it
  auto resumed = run_dptrain({"resume", dir.string()});
  INFO(resumed.err);
  CHECK(resumed.exit_code == 0);
}

TEST_CASE("crashes at three different steps between two log lines are not deterministic") {
  TempDir tmp;
  auto j = resumable_recipe();
  j["train"]["steps"] = 40;
  j["log"] = {{"every", 20}};  // every failure comes after the same logged step, 20
  const auto recipe = write_recipe(tmp.path(), j);
  auto r =
      run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "three").string(),
                   "--max-restarts", "5", "--restart-backoff", "0.1", "--json"},
                  {{"DPTRAIN_FAULT",
                    "slow@step=20,ms=300;crash@step=23,rank=1,gen=1;crash@step=28,rank=1,gen=2;"
                    "crash@step=33,rank=1,gen=3"}});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(parse_json(r.out)["restarts"] == 3);
  const json info = parse_json(read_text(tmp / "three/run.json"));
  REQUIRE(info["restarts"].size() == 3);
  const int64_t crashed_at[] = {23, 28, 33};
  for (size_t i = 0; i < 3; ++i) {
    const int64_t step = info["restarts"][i]["failed_after_step"].get<int64_t>();
    CHECK(step <= crashed_at[i]);
    CHECK(step > (i == 0 ? 19 : crashed_at[i - 1]));
  }
}

TEST_CASE("an elastic job left below its minimum records no restart it does not make") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const fs::path events_file = tmp / "events.jsonl";
  // 3 ranks, then 2 after the first SIGKILL (a real restart), then 1 would be below 2: no
  // second restart.
  // The kernel's OOM kill count as the launcher reads it: unchanged (the machine's own may move).
  write_text(tmp / "vmstat", "oom_kill 3\n");
  const auto r = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2:3", "--run-dir", (tmp / "floor").string(),
       "--max-restarts", "3", "--restart-backoff", "0.1", "--events", events_file.string()},
      {{"DPTRAIN_FAULT", "crash@step=30,rank=1"},
       {"DPTRAIN_TEST_VMSTAT", (tmp / "vmstat").string()}});
  INFO(r.err, r.out);
  CHECK(r.exit_code == 3);
  CHECK(r.out.find("restart 1/3") != std::string::npos);
  CHECK(r.out.find("restart 2/3") == std::string::npos);
  CHECK(r.err.find("fewer than the minimum of 2") != std::string::npos);
  CHECK(r.err.find("OOM killer killed") == std::string::npos);  // the kernel's count is unchanged
  const json info = parse_json(read_text(tmp / "floor/run.json"));
  CHECK(info["restarts"].size() == 1);
  CHECK(info["generations"].size() == 2);
  const auto events = read_jsonl(events_file);
  CHECK(std::count_if(events.begin(), events.end(),
                      [](const json& e) { return e["event"] == "restart"; }) == 1);
  const auto changes = std::find_if(events.begin(), events.end(), [](const json& e) {
    return e["event"] == "world_size_changed";
  });
  REQUIRE(changes != events.end());
  CHECK((*changes)["lost"][0].get<std::string>().rfind("rank 1: ", 0) == 0);
  // The change belongs to the restart: it comes after it.
  CHECK(std::find_if(events.begin(), changes,
                     [](const json& e) { return e["event"] == "restart"; }) != changes);
  REQUIRE_FALSE(events.empty());
  CHECK(events.back()["event"] == "run_finished");
  CHECK(events.back()["restarts"] == 1);
  CHECK(events.back()["status"] == "failed");
  CHECK(events.back()["world_size"] == 2);
  CHECK(events.back()["last_checkpoint"] == (tmp / "floor/checkpoints/step-000020").string());
  CHECK(events.back()["step"].get<int64_t>() >= 25);
  CHECK(events.back()["steps"] == 120);  // planned, as in status and report
  const auto started = std::find_if(events.begin(), events.end(), [](const json& e) {
    return e["event"] == "generation_started";
  });
  REQUIRE(started != events.end());
  CHECK((*started)["hosts"] == json::array({"localhost"}));
  // The launcher is gone: status tells the failure, not a restart in progress.
  const json status = parse_json(run_dptrain({"status", (tmp / "floor").string(), "--json"}).out);
  CHECK(status["status"] == "failed");
  CHECK(status["error"].get<std::string>().find("fewer than the minimum") != std::string::npos);
}

TEST_CASE("restarts are numbered over the run: a resume continues the numbering") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const fs::path dir = tmp / "numbered";
  auto first =
      run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", dir.string(),
                   "--max-restarts", "1", "--restart-backoff", "0.1"},
                  {{"DPTRAIN_FAULT", "crash@step=25,rank=1,gen=1;crash@step=45,rank=1,gen=2"}});
  INFO(first.err);
  REQUIRE(first.exit_code == 3);
  auto resumed = run_dptrain(
      {"resume", dir.string(), "--max-restarts", "1", "--restart-backoff", "0.1", "--json"},
      {{"DPTRAIN_FAULT", "crash@step=65,rank=1,gen=3"}});
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  CHECK(parse_json(resumed.out)["restarts"] == 2);
  // Printed as run.json numbers it (the run's second), with this resume's budget.
  CHECK(contains(resumed.err, "restart 2 of the run (1/1 of this invocation) after 0.1s"));
  const json info = parse_json(read_text(dir / "run.json"));
  REQUIRE(info["restarts"].size() == 2);
  CHECK(info["restarts"][0]["restart"] == 1);
  CHECK(info["restarts"][1]["restart"] == 2);
  CHECK(info["restarts"][1]["failed_after_step"].get<int64_t>() <= 65);
  CHECK(info["restarts"][1]["failed_after_step"].get<int64_t>() > 45);
}

TEST_CASE("a rank that exits 0 before the end is the cause, not the peer it leaves behind") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const fs::path events = tmp / "events.jsonl";
  auto r = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir",
                        (tmp / "early").string(), "--events", events.string()},
                       {{"DPTRAIN_FAULT", "exit@step=10,rank=1,code=0"}});
  INFO(r.err);
  CHECK(r.exit_code == 3);
  CHECK(r.err.find("error: rank 1 (pid ") != std::string::npos);
  CHECK(r.err.find(" exited with code 0 before the run ended (the ranks had reached step 10); "
                   "then rank 0 (pid ") != std::string::npos);
  bool named = false;
  for (const json& e : read_jsonl(events)) {
    if (e["event"] != "rank_exited") continue;
    CHECK(e["process"] == "rank 1");
    CHECK(e["exit_code"] == 0);
    named = true;
  }
  CHECK(named);
}

TEST_CASE("DPTRAIN_FAULT: a fault that can never fire is warned about; a bad one is refused") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  auto r = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "never").string()},
      {{"DPTRAIN_FAULT", "crash@step=60,rank=1"}});
  INFO(r.err);
  CHECK(r.exit_code == 0);
  CHECK((r.out + r.err).find("warning: DPTRAIN_FAULT 'crash@step=60,rank=1' never fires") !=
        std::string::npos);
  // A dry run warns as the launch would: a checkpoint crash on a rank that writes none.
  r = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--dry-run"},
                  {{"DPTRAIN_FAULT", "crash-in-checkpoint@step=20,rank=1"}});
  CHECK(r.exit_code == 0);
  CHECK(r.err ==
        "dptrain: warning: DPTRAIN_FAULT 'crash-in-checkpoint@step=20,rank=1' never fires: rank 1 "
        "writes no checkpoints (rank 0 does)\n");
  r = run_dptrain({"launch", recipe.string(), "--run-dir", (tmp / "bad").string()},
                  {{"DPTRAIN_FAULT", "boom@step=3"}});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("DPTRAIN_FAULT: unknown fault 'boom'") != std::string::npos);
  CHECK_FALSE(fs::exists(tmp / "bad"));
  // A resume refuses it as the launch does, before run.json changes (it recorded the failed
  // run as failed by this launcher, which it was not).
  const fs::path failed = tmp / "failed";
  r = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", failed.string()},
                  {{"DPTRAIN_FAULT", "crash@step=3,rank=1"}});
  REQUIRE(r.exit_code == 3);
  const std::string before = read_text(failed / "run.json");
  r = run_dptrain({"resume", failed.string()}, {{"DPTRAIN_FAULT", "boom@step=3"}});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("DPTRAIN_FAULT: unknown fault 'boom'") != std::string::npos);
  CHECK(read_text(failed / "run.json") == before);
}
