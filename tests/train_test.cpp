// End-to-end training with real rank processes: accuracy, equivalence, metrics, workers by hand.
#include <doctest/doctest.h>

#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>

#include <fmt/format.h>

#include "launch/run_dir.hpp"
#include "tests/damage.hpp"
#include "tests/harness.hpp"
#include "tests/sshd.hpp"
#include "tests/strings.hpp"
#include "tests/text_corpus.hpp"

using namespace dptrain::test;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

// The environments of two workers started by hand into `run_dir`, rank 0 serving the store on
// 127.0.0.1:`port`.
std::pair<Env, Env> hand_worker_envs(const fs::path& run_dir, const std::string& port) {
  const Env base = {{"WORLD_SIZE", "2"},
                    {"MASTER_ADDR", "127.0.0.1"},
                    {"MASTER_PORT", port},
                    {"DPTRAIN_RUN_DIR", run_dir.string()}};
  Env env0 = base, env1 = base;
  env0["RANK"] = "0";
  env0["DPTRAIN_HOST_STORE"] = "1";
  env1["RANK"] = "1";
  return {env0, env1};
}

double max_relative_difference(const std::vector<float>& a, const std::vector<float>& b) {
  double max_abs = 0, max_diff = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    max_abs = std::max(max_abs, static_cast<double>(std::fabs(a[i])));
    max_diff = std::max(max_diff, static_cast<double>(std::fabs(a[i] - b[i])));
  }
  return max_diff / max_abs;
}

// A worker started by hand into `run_dir`, from the environment (rank 0 serving the store).
Env hand_env(int rank, int world, const std::string& port, const fs::path& run_dir) {
  Env e = {{"RANK", std::to_string(rank)},
           {"WORLD_SIZE", std::to_string(world)},
           {"MASTER_ADDR", "127.0.0.1"},
           {"MASTER_PORT", port},
           {"DPTRAIN_RUN_DIR", run_dir.string()}};
  if (rank == 0) e["DPTRAIN_HOST_STORE"] = "1";
  return e;
}

}  // namespace

TEST_CASE("quickstart on 2 ranks learns well above chance and ranks agree") {
  TempDir tmp;
  const fs::path run_dir = tmp / "run";
  auto r = run_dptrain({"launch", (source_dir() / "recipes/quickstart.json").string(), "--nproc",
                        "2", "--run-dir", run_dir.string(), "--json"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const auto out = parse_json(r.out);
  CHECK(out["status"] == "completed");
  CHECK(out["world_size"] == 2);
  CHECK(out["steps"] == 300);
  CHECK(out["step"] == 300);
  // 10 classes: chance is 10%. The threshold leaves room for seed changes, not for a broken
  // trainer.
  CHECK(out["eval_accuracy"].get<double>() > 0.80);
  CHECK(out["final_loss"].get<double>() < 1.0);
  CHECK(out["samples_per_s"].get<double>() > 0);
  // Every rank's checksum was compared at the end (a mismatch fails the run); the final
  // checkpoint holds exactly those parameters.
  const auto params = read_text(latest_params(run_dir));
  const auto meta = parse_json(read_text(latest_params(run_dir).parent_path() / "meta.json"));
  CHECK(meta["step"] == 300);
  CHECK(meta["world_size"] == 2);
  CHECK(meta["blobs"]["params"]["bytes"].get<size_t>() == params.size());

  const auto metrics = read_jsonl(run_dir / "metrics.jsonl");
  int progress = 0, evals = 0;
  for (const auto& m : metrics) {
    if (m.contains("loss")) {
      ++progress;
      for (const char* k :
           {"step", "epoch", "loss", "lr", "grad_norm", "samples_per_s", "step_ms", "comm_ms"}) {
        CAPTURE(k);
        CHECK(m.contains(k));
      }
      // The epoch the step's batch came from: 18,000 training samples make 140 global batches
      // of 128, so steps 1-140 are epoch 0 (step 140 its last), 141-280 epoch 1.
      CAPTURE(m["step"]);
      CHECK(m["epoch"] == (m["step"].get<int64_t>() - 1) / 140);
    }
    if (m.contains("eval_accuracy")) ++evals;
  }
  CHECK(progress == 30);
  CHECK(evals == 3);  // steps 100, 200 and the end
  CHECK(fs::exists(run_dir / "logs/localhost-rank0.log"));
  CHECK(fs::exists(run_dir / "logs/localhost-rank1.log"));
  const auto info = parse_json(read_text(run_dir / "run.json"));
  CHECK(info["status"] == "completed");
  CHECK(info["world_size"] == 2);
  CHECK(info["generations"].size() == 1);
  // keep = 3: steps 100, 200, 300
  int kept = 0;
  for (const auto& e : fs::directory_iterator(run_dir / "checkpoints")) {
    kept += e.path().filename().string().rfind("step-", 0) == 0;
  }
  CHECK(kept == 3);
}

TEST_CASE("slow steps between log steps: ticks reach neither a pipe nor the rank's log") {
  // Rank 0 sends a tick a second between log steps, for a terminal's progress line (tested in
  // status_test); a pipe and the logs keep one line per log step.
  TempDir tmp;
  json recipe = small_recipe();
  recipe["train"]["steps"] = 8;
  recipe["log"]["every"] = 4;
  const auto path = write_recipe(tmp.path(), recipe);
  const auto r =
      run_dptrain({"launch", path.string(), "--nproc", "1", "--run-dir", (tmp / "run").string()},
                  Env{{"DPTRAIN_DEBUG_STEP_DELAY_MS", "500"}});
  INFO(r.out, r.err);
  REQUIRE(r.exit_code == 0);
  const std::string log = read_text(tmp / "run/logs/localhost-rank0.log");
  // (That ticks were sent at this pace is the trainer test's: a pipe cannot see them.)
  CHECK(contains(r.out, "step 4/8  loss "));
  CHECK(contains(log, "step 4/8  loss "));
  for (const std::string& text : {r.out, r.err, log}) {
    for (const char* tick : {"step 2/8", "step 3/8", "step 6/8", "step 7/8"})
      CHECK_FALSE(contains(text, tick));
  }
}

TEST_CASE("2 ranks x batch B equal 1 rank x batch 2B after 20 steps") {
  TempDir tmp;
  for (const char* opt : {"sgd", "adamw"}) {
    CAPTURE(opt);
    auto recipe = small_recipe();
    recipe["train"]["steps"] = 20;
    recipe["optimizer"]["type"] = opt;
    recipe["optimizer"]["lr"] = std::string(opt) == "sgd" ? 0.05 : 0.001;
    recipe["optimizer"]["clip_grad_norm"] = 0.0;
    recipe["train"]["batch_per_rank"] = 16;
    const auto two = write_recipe(tmp.path(), recipe, std::string("two-") + opt + ".json");
    recipe["train"]["batch_per_rank"] = 32;
    const auto one = write_recipe(tmp.path(), recipe, std::string("one-") + opt + ".json");
    const fs::path run2 = tmp / (std::string("run2-") + opt);
    const fs::path run1 = tmp / (std::string("run1-") + opt);
    auto a = run_dptrain({"launch", two.string(), "--nproc", "2", "--run-dir", run2.string()});
    auto b = run_dptrain({"launch", one.string(), "--nproc", "1", "--run-dir", run1.string()});
    INFO(a.err, b.err);
    REQUIRE(a.exit_code == 0);
    REQUIRE(b.exit_code == 0);
    const auto pa = read_floats(latest_params(run2));
    const auto pb = read_floats(latest_params(run1));
    REQUIRE(pa.size() == pb.size());
    REQUIRE(!pa.empty());
    CHECK(max_relative_difference(pa, pb) < 1e-5);
    // ... and training moved them at all (identical untrained models would pass the comparison).
    recipe["train"]["steps"] = 0;
    recipe["optimizer"]["schedule"]["warmup"] = 0;
    const auto zero = write_recipe(tmp.path(), recipe, std::string("zero-") + opt + ".json");
    const fs::path run0 = tmp / (std::string("run0-") + opt);
    REQUIRE(run_dptrain({"launch", zero.string(), "--run-dir", run0.string()}).exit_code == 0);
    CHECK(max_relative_difference(pa, read_floats(latest_params(run0))) > 1e-3);
  }
}

TEST_CASE("the same recipe and world size give bit-identical parameters") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  auto a =
      run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "a").string()});
  auto b =
      run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", (tmp / "b").string()});
  REQUIRE(a.exit_code == 0);
  REQUIRE(b.exit_code == 0);
  CHECK(read_text(latest_params(tmp / "a")) == read_text(latest_params(tmp / "b")));
}

TEST_CASE("csv data trains end to end; a bad row names file and line") {
  TempDir tmp;
  {
    std::ofstream csv(tmp / "train.csv");
    csv << "label,f0,f1,f2,f3\n";
    for (int i = 0; i < 600; ++i) {
      const int label = i % 3;
      csv << label;
      for (int f = 0; f < 4; ++f) {
        const double v = (f == label ? 3.0 : 0.0) + 0.3 * std::sin(i * 7.0 + f);
        csv << "," << v;
      }
      csv << "\n";
    }
  }
  auto recipe = small_recipe();
  recipe["model"] = {{"type", "mlp"}, {"input", 4}, {"hidden", {16}}, {"classes", 3}};
  recipe["data"] = {{"type", "csv"}, {"path", "train.csv"}, {"eval_fraction", 0.2}};
  recipe["train"]["steps"] = 80;
  const auto path = write_recipe(tmp.path(), recipe);
  auto r = run_dptrain(
      {"launch", path.string(), "--nproc", "2", "--run-dir", (tmp / "run").string(), "--json"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(parse_json(r.out)["eval_accuracy"].get<double>() > 0.9);

  write_text(tmp / "train.csv", "label,f0,f1,f2,f3\n0,1,2,3,4\n1,1,2,x,4\n");
  auto bad = run_dptrain(
      {"launch", path.string(), "--nproc", "2", "--run-dir", (tmp / "run-bad").string()});
  // Found before any rank starts: a recipe error, and no run directory.
  CHECK(bad.exit_code == 2);
  CHECK(bad.err.find("train.csv:3") != std::string::npos);
  CHECK_FALSE(fs::exists(tmp / "run-bad"));
}

TEST_CASE("a dataset smaller than one global batch is refused before anything runs") {
  TempDir tmp;
  auto recipe = small_recipe();
  recipe["data"]["samples"] = 100;  // 90 for training
  recipe["train"]["batch_per_rank"] = 32;
  const auto path = write_recipe(tmp.path(), recipe);
  CHECK(run_dptrain({"launch", path.string(), "--nproc", "2", "--run-dir", (tmp / "a").string()})
            .exit_code == 0);
  auto r =
      run_dptrain({"launch", path.string(), "--nproc", "4", "--run-dir", (tmp / "b").string()});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("128") != std::string::npos);  // the global batch
  CHECK_FALSE(fs::exists(tmp / "b"));
}

TEST_CASE("a --bind a rank cannot bind is its refusal (exit 2), which the other learns at once") {
  TempDir tmp;
  auto recipe_json = small_recipe();
  recipe_json["distributed"]["timeout_s"] = 120;  // the wait it would otherwise sit out
  const auto recipe = write_recipe(tmp.path(), recipe_json);
  for (const std::string bind : {"no-such-host.invalid", "192.0.2.1"}) {
    CAPTURE(bind);
    const std::string port = std::to_string(unused_port());
    auto [env0, env1] = hand_worker_envs(tmp / ("run-" + bind), port);
    env1["DPTRAIN_BIND_ADDR"] = bind;
    const auto t0 = std::chrono::steady_clock::now();
    Background r0({"worker", recipe.string()}, env0);
    Background r1({"worker", recipe.string()}, env1);
    const int c1 = r1.wait(std::chrono::seconds(60));
    const int c0 = r0.wait(std::chrono::seconds(60));
    INFO(r0.err(), r1.err());
    CHECK(c1 == 2);
    CHECK(contains(r1.err(), "--bind (DPTRAIN_BIND_ADDR) '" + bind + "': "));
    CHECK(c0 == 2);
    CHECK(contains(r0.err(), "rank 1"));
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60));  // not the 120 s
  }
}

TEST_CASE("workers started by hand from the environment, rank 0 hosting the store") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const std::string port = std::to_string(unused_port());
  auto [env0, env1] = hand_worker_envs(tmp / "run", port);
  Background r0({"worker", recipe.string()}, env0);
  Background r1({"worker", recipe.string()}, env1);
  const int c1 = r1.wait(std::chrono::seconds(120));
  const int c0 = r0.wait(std::chrono::seconds(120));
  INFO(r0.err(), r1.err());
  CHECK(c0 == 0);
  CHECK(c1 == 0);
  CHECK(fs::exists(tmp / "run/result.json"));
  CHECK(fs::exists(tmp / "run/metrics.jsonl"));
  // With no launcher, rank 0 keeps run.json: status and report read the run as a launcher's.
  const json info = parse_json(read_text(tmp / "run/run.json"));
  CHECK(info["started_by"] == "dptrain worker");
  CHECK(info["status"] == "completed");
  CHECK(info["world_size"] == 2);
  // What the ranks met with, as a launcher records it: the backend, the store, the hosts.
  CHECK(info["backend"] == "gloo");
  CHECK(info["store"] == "127.0.0.1:" + port);
  REQUIRE(info["hosts"].size() == 1);
  CHECK(info["hosts"][0]["slots"] == 2);
  CHECK(info["hosts"][0]["ranks"] == json::array({0, 1}));
  REQUIRE(info["generations"].size() == 1);
  CHECK(info["generations"][0]["status"] == "completed");
  CHECK(info["generations"][0]["pids"] == json::array({r0.pid()}));
  const auto status = run_dptrain({"status", (tmp / "run").string(), "--json"});
  CHECK(status.exit_code == 0);
  CHECK(parse_json(status.out)["status"] == "completed");
  CHECK(parse_json(status.out)["step"] == small_recipe()["train"]["steps"]);
  CHECK(run_dptrain({"report", (tmp / "run").string(), "--json"}).exit_code == 0);
  // resume would start the ranks itself, which the workers' scheduler does: it says how instead.
  json failed = info;
  failed["status"] = "failed";
  write_text(tmp / "run/run.json", failed.dump());
  const auto resumed = run_dptrain({"resume", (tmp / "run").string()});
  CHECK(resumed.exit_code == 2);
  CHECK(contains(resumed.err,
                 ": its workers were started without a launcher (by hand, srun, "
                 "mpirun): start them again with '--resume newest' to continue it"));
  const auto relaunch =
      run_dptrain({"launch", recipe.string(), "--run-dir", (tmp / "run").string()});
  CHECK(relaunch.exit_code == 2);
  CHECK(contains(relaunch.err,
                 "already holds a run; its workers were started without a launcher: "
                 "start them again with '--resume newest' to continue it, or "
                 "choose another --run-dir"));
  CHECK(parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out)["hint"] ==
        "its workers were started without a launcher: start them again with '--resume newest' "
        "to continue it");
  write_text(tmp / "run/run.json", info.dump());
  // Started again to continue it once it completed: nothing to do, and the run is left alone
  // (its final checkpoint, metrics and record), as resume leaves it.
  const auto snapshot = [&] {
    std::string all = read_text(tmp / "run/run.json") + read_text(tmp / "run/metrics.jsonl") +
                      read_text(tmp / "run/result.json");
    for (const auto& entry : fs::recursive_directory_iterator(tmp / "run/checkpoints")) {
      all += entry.path().string() + " " +
             std::to_string(entry.last_write_time().time_since_epoch().count()) + "\n";
    }
    return all;
  };
  {
    const std::string before = snapshot();
    Env again0 = env0, again1 = env1;
    again0["MASTER_PORT"] = again1["MASTER_PORT"] = std::to_string(unused_port());
    Background a0({"worker", recipe.string(), "--resume", "newest"}, again0);
    Background a1({"worker", recipe.string(), "--resume", "newest"}, again1);
    CHECK(a1.wait(std::chrono::seconds(60)) == 0);
    CHECK(a0.wait(std::chrono::seconds(60)) == 0);
    INFO(a0.err(), a1.err());
    CHECK(contains(a0.out(),
                   (tmp / "run").string() + ": the run already completed; nothing to resume\n"));
    CHECK(snapshot() == before);
    // resume and launch say as much, as of a launcher's run.
    const auto resumed_done = run_dptrain({"resume", (tmp / "run").string()});
    CHECK(resumed_done.exit_code == 0);
    CHECK(contains(resumed_done.out,
                   (tmp / "run").string() + ": the run already completed; nothing to resume"));
    CHECK_FALSE(fs::exists(tmp / "run/logs"));  // nothing made there either
    // A bad option is refused all the same: a script's broken flag does not pass unseen.
    for (const auto& [flag, value] :
         {std::pair{"--nproc", "abc"}, std::pair{"--env", "RANK=3"}, std::pair{"--nnodes", "2"}}) {
      CAPTURE(flag);
      const auto bad = run_dptrain({"resume", (tmp / "run").string(), flag, value});
      CHECK(bad.exit_code == 2);
      CHECK(contains(bad.err, std::string("dptrain: error: ") + flag));
    }
    // With --json, the outcome's fields from the run's result.json.
    const auto resumed_json = run_dptrain({"resume", (tmp / "run").string(), "--json"});
    CHECK(resumed_json.exit_code == 0);
    const json outcome = parse_json(resumed_json.out);
    CHECK(outcome["status"] == "completed");
    CHECK(outcome["resumed"] == false);
    CHECK(outcome["step"] == 60);
    CHECK(outcome["final_loss"].is_number());
    CHECK(outcome["params_checksum"] ==
          parse_json(read_text(tmp / "run/result.json"))["params_checksum"]);
    CHECK(outcome["last_checkpoint"] == (tmp / "run/checkpoints/step-000060").string());
    // Moved elsewhere, its checkpoint is named where it lies now, as status names it.
    fs::copy(tmp / "run", tmp / "moved", fs::copy_options::recursive);
    const json moved = parse_json(run_dptrain({"resume", (tmp / "moved").string(), "--json"}).out);
    CHECK(moved["last_checkpoint"] == (tmp / "moved/checkpoints/step-000060").string());
    CHECK(moved["last_checkpoint"] ==
          parse_json(
              run_dptrain({"status", (tmp / "moved").string(), "--json"}).out)["last_checkpoint"]);
    const auto launched_done =
        run_dptrain({"launch", recipe.string(), "--run-dir", (tmp / "run").string()});
    CHECK(launched_done.exit_code == 2);
    CHECK(launched_done.err == "dptrain: error: " + (tmp / "run").string() +
                                   ": already holds a run, which completed; choose another "
                                   "--run-dir\n");
    // A dry run is refused as the launch is: a plan for it is no preflight otherwise.
    const auto planned =
        run_dptrain({"launch", recipe.string(), "--run-dir", (tmp / "run").string(), "--dry-run"});
    CHECK(planned.exit_code == 2);
    CHECK(planned.err == launched_done.err);
    CHECK(snapshot() == before);
  }
  // Continued on one rank without --nominal-world (a run that failed after its last
  // checkpoint): the job's nominal world of 2 comes from run.json, and the global batch stays.
  const auto fail_run = [&] {
    json unfinished = parse_json(read_text(tmp / "run/run.json"));
    unfinished["status"] = "failed";
    write_text(tmp / "run/run.json", unfinished.dump());
  };
  fail_run();
  Env one_rank = env0;
  one_rank["WORLD_SIZE"] = "1";
  one_rank["MASTER_PORT"] = std::to_string(unused_port());
  const auto kept = run_dptrain({"worker", recipe.string(), "--resume", "newest"}, one_rank,
                                std::chrono::seconds(60));
  INFO(kept.out, kept.err);
  CHECK(kept.exit_code == 0);
  CHECK(contains(kept.out,
                 "resumed from step-000060 at step 60 on 1 rank(s), global batch 32 "
                 "(the job's nominal world size is 2)"));
  CHECK_FALSE(contains(kept.err, "warning"));
  CHECK(parse_json(read_text(tmp / "run/run.json"))["nominal_world_size"] == 2);
  // run.json counts the change of world size, as a launcher's does.
  const json changes = parse_json(read_text(tmp / "run/run.json"))["world_size_changes"];
  REQUIRE(changes.size() == 1);
  CHECK(changes[0]["from"] == 2);
  CHECK(changes[0]["to"] == 1);
  CHECK(changes[0]["global_batch"] == 32);
  // Told a nominal world of 1, the global batch halves, and it says so.
  fail_run();
  one_rank["MASTER_PORT"] = std::to_string(unused_port());
  const auto halved =
      run_dptrain({"worker", recipe.string(), "--resume", "newest", "--nominal-world", "1"},
                  one_rank, std::chrono::seconds(60));
  CHECK(halved.exit_code == 0);
  CHECK(contains(halved.err,
                 "dptrain: warning: the global batch changes from the checkpoint's 32 to 16 "
                 "(distributed.resize is \"keep_global_batch\"; the nominal world "
                 "size here is 1): workers keep the batch of 32 with --nominal-world 2"));
  CHECK(parse_json(read_text(tmp / "run/run.json"))["nominal_world_size"] == 1);
  CHECK(parse_json(
            run_dptrain({"status", (tmp / "run").string(), "--json"}).out)["world_size_changes"] ==
        1);

  // Started again into the same directory without --resume (a requeued job), rank 0 refuses
  // before it connects rather than write a fresh start over the checkpoints; rank 1 learns why
  // through rank 0's store at once (its timeout is the recipe's 60 s), not as a store that
  // never answers.
  const std::string metrics = read_text(tmp / "run/metrics.jsonl");
  const std::string latest = read_text(tmp / "run/checkpoints/latest");
  const std::string held = "--run-dir " + (tmp / "run").string() +
                           ": holds checkpoints (the newest step-000060), which a fresh start "
                           "would write over; continue them with --resume newest, or give a new "
                           "--run-dir\n";
  {
    Background again0({"worker", recipe.string()}, env0);
    Background again1({"worker", recipe.string()}, env1);
    CHECK(again1.wait(std::chrono::seconds(60)) == 2);
    CHECK(again0.wait(std::chrono::seconds(60)) == 2);
    CHECK(again0.err() == "dptrain: error: rank 0: " + held);
    CHECK(again1.err() == "dptrain: error: rank 1: rank 0 cannot start: " + held);
  }
  // The same of rank 1 (the checkpoint writer of its own node's copy of the run): rank 0 learns
  // why, at once.
  {
    Env node0 = env0, node1 = env1;
    node0["MASTER_PORT"] = node1["MASTER_PORT"] = std::to_string(unused_port());
    node0["DPTRAIN_RUN_DIR"] = (tmp / "node0").string();
    node1["LOCAL_RANK"] = "0";
    Background again0({"worker", recipe.string()}, node0);
    Background again1({"worker", recipe.string()}, node1);
    CHECK(again1.wait(std::chrono::seconds(60)) == 2);
    CHECK(again0.wait(std::chrono::seconds(60)) == 2);
    CHECK(again1.err() == "dptrain: error: rank 1: " + held);
    CHECK(again0.err() == "dptrain: error: rank 0: rank 1 cannot start: " + held);
    CHECK_FALSE(fs::exists(tmp / "node0/checkpoints"));
  }
  // Both ranks started with --resume CHECKPOINT on a fresh store port; their stderr once both
  // exited with `code`.
  const auto resume_both = [&](const fs::path& checkpoint, int code) {
    Env e0 = env0, e1 = env1;
    e0["MASTER_PORT"] = e1["MASTER_PORT"] = std::to_string(unused_port());
    Background resume0({"worker", recipe.string(), "--resume", checkpoint.string()}, e0);
    Background resume1({"worker", recipe.string(), "--resume", checkpoint.string()}, e1);
    CHECK(resume1.wait(std::chrono::seconds(60)) == code);
    CHECK(resume0.wait(std::chrono::seconds(60)) == code);
    return std::pair(resume0.err(), resume1.err());
  };
  // A --resume checkpoint that is none: rank 0 refuses before the ranks meet (exit 5), and
  // rank 1 says why with the same code.
  for (const fs::path& named :
       {tmp / "run/checkpoints/step-000099", tmp / "run/run.json", tmp / "run/checkpoints"}) {
    CAPTURE(named);
    const auto [err0, err1] = resume_both(named, 5);
    const std::string why =
        "--resume " + named.string() + ": " +
        (named.filename() == "step-000099" ? "no such checkpoint directory"
         : named.filename() == "run.json"
             ? "not a directory (a checkpoint is a run's checkpoints/step-NNNNNN directory)"
             : "not a checkpoint directory (it holds no meta.json)") +
        "\n";
    CHECK(err0 == "dptrain: error: rank 0: " + why);
    CHECK(err1 == "dptrain: error: rank 1: rank 0 cannot start: " + why);
  }
  // A damaged one likewise, by its checksums: the completed run's record keeps its status and
  // takes no generation that could not start.
  {
    const std::string record = read_text(tmp / "run/run.json");
    const fs::path damaged = tmp / "damaged" / "step-000060";
    fs::create_directories(damaged.parent_path());
    fs::copy(tmp / "run/checkpoints/step-000060", damaged);
    flip_byte(damaged / "params.bin", 5);
    const auto [err0, err1] = resume_both(damaged, 5);
    const std::string why = "--resume " + damaged.string() + ": params.bin: checksum mismatch";
    CHECK_MESSAGE(err0.starts_with("dptrain: error: rank 0: " + why), err0);
    CHECK_MESSAGE(err1.starts_with("dptrain: error: rank 1: rank 0 cannot start: " + why), err1);
    CHECK(read_text(tmp / "run/run.json") == record);
  }
  CHECK(read_text(tmp / "run/metrics.jsonl") == metrics);
  CHECK(read_text(tmp / "run/checkpoints/latest") == latest);

  // Ranks given different recipes (here only the learning rate differs) stop at once, each
  // naming the difference, instead of training apart until a checksum notices.
  auto other = small_recipe();
  other["optimizer"]["lr"] = other["optimizer"].value("lr", 0.01) * 2;
  const auto other_path = write_recipe(tmp.path(), other, "other.json");
  // Continued with another recipe: rank 0 refuses before anything is written, as run.json
  // records another (it would take this one, under which ckpt verify finds every checkpoint
  // foreign).
  {
    Env alone = env0;
    alone["WORLD_SIZE"] = "1";
    alone["MASTER_PORT"] = std::to_string(unused_port());
    const std::string run_json = read_text(tmp / "run/run.json");
    auto foreign = run_dptrain({"worker", other_path.string(), "--resume", "newest-or-start"},
                               alone, std::chrono::seconds(60));
    CAPTURE(foreign.err);
    CHECK(foreign.exit_code == 2);
    CHECK(contains(foreign.err, "dptrain: error: rank 0: --run-dir " + (tmp / "run").string() +
                                    ": its run.json records the run of another recipe ("));
    CHECK(contains(foreign.err, "continue it with the recipe it records, or give a new --run-dir"));
    CHECK(read_text(tmp / "run/run.json") == run_json);
    CHECK(read_text(tmp / "run/metrics.jsonl") == metrics);
    CHECK(read_text(tmp / "run/checkpoints/latest") == latest);
    // Without the record (a node's copy of the run holds its checkpoints only): none of them is
    // this recipe's, and starting over would write over them: exit 5, nothing touched.
    fs::rename(tmp / "run/run.json", tmp / "run.json.aside");
    foreign = run_dptrain({"worker", other_path.string(), "--resume", "newest-or-start"}, alone,
                          std::chrono::seconds(60));
    CHECK(foreign.exit_code == 5);
    CHECK(contains(foreign.err,
                   "rank 0's run directory holds checkpoints, but none this run can "
                   "use: starting over would write over them"));
    // Why, under its error, and not also as warnings before it.
    const std::string why = "\n  skipping checkpoint step-000060: written by a different recipe";
    CHECK(contains(foreign.err, why));
    CHECK_FALSE(contains(foreign.out + foreign.err, "warning: skipping checkpoint step-000060"));
    CHECK(read_text(tmp / "run/metrics.jsonl") == metrics);
    CHECK(read_text(tmp / "run/checkpoints/latest") == latest);
    // Two nodes, the other's copy of the run empty: its rank's error says why too (the launcher
    // shows whichever rank's error came first).
    {
      Env e0 = env0, e1 = env1;
      e0["MASTER_PORT"] = e1["MASTER_PORT"] = std::to_string(unused_port());
      e1["LOCAL_RANK"] = "0";
      e1["DPTRAIN_RUN_DIR"] = (tmp / "other-node").string();
      Background n0({"worker", other_path.string(), "--resume", "newest-or-start"}, e0);
      Background n1({"worker", other_path.string(), "--resume", "newest-or-start"}, e1);
      CHECK(n1.wait(std::chrono::seconds(60)) == 5);
      CHECK(n0.wait(std::chrono::seconds(60)) == 5);
      for (const std::string& err : {n0.err(), n1.err()}) {
        CAPTURE(err);
        CHECK(contains(err, "rank 0's run directory holds checkpoints, but none this run can use"));
        CHECK(contains(err, why));
      }
      CHECK(read_text(tmp / "run/checkpoints/latest") == latest);
    }
    fs::rename(tmp / "run.json.aside", tmp / "run/run.json");
  }
  env0["DPTRAIN_RUN_DIR"] = env1["DPTRAIN_RUN_DIR"] = (tmp / "mixed").string();
  env0["MASTER_PORT"] = env1["MASTER_PORT"] = std::to_string(unused_port());
  Background m0({"worker", recipe.string()}, env0);
  Background m1({"worker", other_path.string()}, env1);
  CHECK(m1.wait(std::chrono::seconds(120)) == 2);
  CHECK(m0.wait(std::chrono::seconds(120)) == 2);
  for (const std::string& err : {m0.err(), m1.err()}) {
    CAPTURE(err);
    CHECK(err.find("the ranks were given different recipes: rank 1 (") != std::string::npos);
    CHECK(err.find("start every rank with the same recipe") != std::string::npos);
  }
  CHECK_FALSE(fs::exists(tmp / "mixed/checkpoints/latest"));
  const json mixed = parse_json(read_text(tmp / "mixed/run.json"));
  CHECK(mixed["status"] == "failed");
  CHECK(contains(mixed["error"].get<std::string>(), "the ranks were given different recipes"));

  // A launch running in a directory (here before its first checkpoint) keeps ranks it did not
  // start out: their metrics would be interleaved with its ranks'.
  const fs::path live = tmp / "live";
  Background launch({"launch", recipe.string(), "--nproc", "1", "--run-dir", live.string()},
                    Env{{"DPTRAIN_DEBUG_STEP_DELAY_MS", "200"}});
  REQUIRE(eventually([&] { return fs::exists(live / "metrics.jsonl"); }));
  env0["DPTRAIN_RUN_DIR"] = live.string();
  env0["MASTER_PORT"] = std::to_string(unused_port());
  auto intruder = run_dptrain({"worker", recipe.string()}, env0, std::chrono::seconds(60));
  CHECK(intruder.exit_code == 2);
  const std::string refused = "dptrain: error: rank 0: --run-dir " + live.string() +
                              ": another dptrain is running a run there (a launcher, or workers "
                              "started without one: it holds " +
                              live.string() + "/.lock); give another --run-dir\n";
  CHECK(intruder.err == refused);
  REQUIRE(::kill(launch.pid(), SIGINT) == 0);
  CHECK(launch.wait(std::chrono::seconds(60)) == 130);
  const std::string launched = read_text(live / "run.json");
  const std::string launched_metrics = read_text(live / "metrics.jsonl");
  // Once the launcher is gone the lock is free: a worker may continue the run by hand. Its rank
  // 0 holds the lock meanwhile: neither a second job of workers nor a resume gets in.
  env0["WORLD_SIZE"] = "1";
  env0["DPTRAIN_DEBUG_STEP_DELAY_MS"] = "100";
  Background continued({"worker", recipe.string(), "--resume", "newest-or-start"}, env0);
  REQUIRE(eventually(
      [&] { return read_text(live / "metrics.jsonl").size() > launched_metrics.size(); }));
  Env second = env0;
  second["MASTER_PORT"] = std::to_string(unused_port());
  auto twice = run_dptrain({"worker", recipe.string(), "--resume", "newest-or-start"}, second,
                           std::chrono::seconds(60));
  CHECK(twice.exit_code == 2);
  CHECK(twice.err == refused);
  // The same job started again as it was (its port too): the directory in use is what is said,
  // not the port.
  auto same = run_dptrain({"worker", recipe.string(), "--resume", "newest-or-start"}, env0,
                          std::chrono::seconds(60));
  CHECK(same.exit_code == 2);
  CHECK(same.err == refused);
  auto resumed_too = run_dptrain({"resume", live.string()});
  CHECK(resumed_too.exit_code == 2);
  INFO(resumed_too.err);
  CHECK(contains(resumed_too.err, "another dptrain is still running it"));
  CHECK(continued.wait(std::chrono::seconds(120)) == 0);
  INFO(continued.err());
  CHECK(read_text(live / "run.json") == launched);  // the launcher's record, left alone
}

TEST_CASE("workers by hand: a rank 0 started again by mistake is refused, and the job goes on") {
  TempDir tmp;
  auto recipe = small_recipe();
  recipe["train"]["steps"] = 30;
  const auto path = write_recipe(tmp.path(), recipe);
  auto [env0, env1] = hand_worker_envs(tmp / "run", std::to_string(unused_port()));
  Background r0({"worker", path.string()}, env0);
  // Rank 0 holds the run's lock and waits for rank 1 at its store.
  REQUIRE(eventually([&] { return dptrain::run_locked_by_another(tmp / "run"); }));
  // The same rank 0 again, without a store of its own: refused, and its refusal is not posted
  // to the live job's store, where rank 1 would take it for its rank 0's.
  Env again = env0;
  again.erase("DPTRAIN_HOST_STORE");
  const auto duplicate = run_dptrain({"worker", path.string()}, again, std::chrono::seconds(60));
  CHECK(duplicate.exit_code == 2);
  CHECK(contains(duplicate.err, "another dptrain is running a run there"));
  Background r1({"worker", path.string()}, env1);
  CHECK(r1.wait(std::chrono::seconds(120)) == 0);
  CHECK(r0.wait(std::chrono::seconds(120)) == 0);
  INFO(r0.err(), r1.err());
  CHECK(parse_json(read_text(tmp / "run/run.json"))["status"] == "completed");
}

TEST_CASE("workers by hand: status says the ranks have not met while rank 0 waits alone") {
  TempDir tmp;
  const auto path = write_recipe(tmp.path(), small_recipe());
  const fs::path run = tmp / "run";
  auto [env0, env1] = hand_worker_envs(run, std::to_string(unused_port()));
  Background r0({"worker", path.string(), "--timeout", "120"}, env0);
  // (run.json is written a moment after the lock is taken.)
  REQUIRE(eventually([&] {
    return contains(run_dptrain({"status", run.string()}).out,
                    "no steps logged yet: the ranks have not all met");
  }));
  CHECK(contains(run_dptrain({"status", run.string()}).out, ": running"));
  Background r1({"worker", path.string(), "--timeout", "120"}, env1);
  CHECK(r1.wait(std::chrono::seconds(120)) == 0);
  CHECK(r0.wait(std::chrono::seconds(120)) == 0);
  INFO(r0.err(), r1.err());
  // When they met, as a launcher records it (status's generation_starting reads it).
  const json info = parse_json(read_text(run / "run.json"));
  CHECK(info["generations"][0].contains("met_at"));
  CHECK(contains(run_dptrain({"status", run.string()}).out, "  step "));
}

TEST_CASE("workers by hand: SIGTERM to one rank before its first step stops its peers, 143") {
  TempDir tmp;
  const auto path = write_recipe(tmp.path(), small_recipe());
  auto [env0, env1] = hand_worker_envs(tmp / "run", std::to_string(unused_port()));
  // Rank 0 is slow to take its first step (its data, say): rank 1 waits for it in a collective
  // when the scheduler stops rank 1 alone.
  env0["DPTRAIN_FAULT"] = env1["DPTRAIN_FAULT"] = "slow-start@ms=8000,rank=0";
  Background r0({"worker", path.string()}, env0);
  Background r1({"worker", path.string()}, env1);
  // (Met by then: the ranks start and meet in well under a second.)
  std::this_thread::sleep_for(std::chrono::seconds(3));
  REQUIRE(::kill(r1.pid(), SIGTERM) == 0);
  CHECK(r1.wait(std::chrono::seconds(60)) == 143);
  CHECK(r0.wait(std::chrono::seconds(60)) == 143);
  INFO(r0.err(), r1.err());
  CHECK(contains(r0.err(), "rank 0: rank 1 stopped by SIGTERM before its first step"));
  CHECK(parse_json(read_text(tmp / "run/run.json"))["status"] == "terminated");
}

TEST_CASE("workers by hand: a training that diverged is one a resume would meet again") {
  TempDir tmp;
  json recipe = small_recipe();
  recipe["optimizer"] = {{"type", "sgd"}, {"lr", 1e30}, {"momentum", 0.9}};
  const auto path = write_recipe(tmp.path(), recipe);
  const std::string port = std::to_string(unused_port());
  auto [env0, env1] = hand_worker_envs(tmp / "run", port);
  Background r0({"worker", path.string()}, env0);
  Background r1({"worker", path.string()}, env1);
  const int c1 = r1.wait(std::chrono::seconds(120));
  const int c0 = r0.wait(std::chrono::seconds(120));
  INFO(r0.err(), r1.err());
  CHECK(c0 == 2);
  CHECK(c1 == 2);
  const json info = parse_json(read_text(tmp / "run/run.json"));
  CHECK(info["status"] == "failed");
  CHECK(info["generations"][0]["exit_code"] == 2);
  CHECK(info["generations"][0]["would_repeat"] == true);
  // Not the hint to start them again as they were: they would diverge again.
  const auto status = run_dptrain({"status", (tmp / "run").string(), "--json"});
  CHECK(parse_json(status.out)["hint"] ==
        "a resume would meet its error again (the recipe, its data or a setting: see the error); "
        "fix that first: data or a setting, then start the workers again with '--resume "
        "newest-or-start'; a changed recipe, started into a new run directory");
}

TEST_CASE("workers given different data, --resume or nominal world stop at once, naming it") {
  TempDir tmp;
  // Two tables of one shape that differ in one value: the recipes' hashes (data.path aside)
  // agree, the data does not.
  std::string rows = "label,f0,f1\n";
  for (int i = 0; i < 400; ++i)
    rows += fmt::format("{},{},{}\n", i % 2, i % 2 == 0 ? 1.0 : -1.0, 0.01 * i);
  write_text(tmp / "a.csv", rows);
  rows.replace(rows.rfind(",3.99"), 5, ",3.98");
  write_text(tmp / "b.csv", rows);
  auto recipe = small_recipe();
  recipe["model"] = {{"type", "mlp"}, {"input", 2}, {"hidden", {8}}, {"classes", 2}};
  recipe["data"] = {{"type", "csv"}, {"path", "a.csv"}};
  recipe["train"]["steps"] = 20;
  const auto a = write_recipe(tmp.path(), recipe, "a.json");
  recipe["data"]["path"] = "b.csv";
  const auto b = write_recipe(tmp.path(), recipe, "b.json");
  struct Rank {
    fs::path recipe;
    std::vector<std::string> args;
    Env env;
  };
  // Both ranks' exit codes and stderr.
  const auto pair = [&](const std::string& run, Rank r0, Rank r1) {
    const std::string port = std::to_string(unused_port());
    r0.env.insert({{"RANK", "0"}, {"DPTRAIN_HOST_STORE", "1"}});
    r1.env["RANK"] = "1";
    std::vector<std::unique_ptr<Background>> ranks;
    for (Rank* r : {&r0, &r1}) {
      r->env.insert({{"WORLD_SIZE", "2"},
                     {"MASTER_ADDR", "127.0.0.1"},
                     {"MASTER_PORT", port},
                     {"DPTRAIN_RUN_DIR", (tmp / run).string()}});
      std::vector<std::string> argv = {"worker", r->recipe.string()};
      argv.insert(argv.end(), r->args.begin(), r->args.end());
      ranks.push_back(std::make_unique<Background>(argv, r->env));
    }
    std::vector<std::pair<int, std::string>> out;
    for (auto& r : ranks) {
      const int code = r->wait(std::chrono::seconds(120));
      out.emplace_back(code, r->err());
    }
    return out;
  };
  const auto data = pair("data", {a, {}, {}}, {b, {}, {}});
  for (const auto& [code, err] : data) {
    CAPTURE(err);
    CHECK(code == 2);
    CHECK(contains(err, "the ranks were given different data: rank 1 ("));
    CHECK(contains(err, "give every rank the same data"));
  }
  CHECK(contains(data[1].second, "data.path " + (tmp / "b.csv").string()));
  CHECK_FALSE(fs::exists(tmp / "data/checkpoints/latest"));
  CHECK(parse_json(read_text(tmp / "data/run.json"))["status"] == "failed");
  // Data that one rank cannot read once the ranks met (a bad row): its peer says why, with its
  // code, rather than name the connection it closed. Either rank.
  write_text(tmp / "bad.csv", read_text(tmp / "a.csv") + "1,abc\n");
  recipe["data"]["path"] = "bad.csv";
  const auto bad = write_recipe(tmp.path(), recipe, "bad.json");
  const std::string unreadable = (tmp / "bad.csv").string() + ":402: ";
  for (const int broken : {0, 1}) {
    CAPTURE(broken);
    const auto out = pair(fmt::format("bad{}", broken), {broken == 0 ? bad : a, {}, {}},
                          {broken == 1 ? bad : a, {}, {}});
    for (int r = 0; r < 2; ++r) {
      CAPTURE(out[r].second);
      CHECK(out[r].first == 2);
      CHECK(out[r].second.starts_with(
          r == broken ? fmt::format("dptrain: error: rank {}: {}", r, unreadable)
                      : fmt::format("dptrain: error: rank {}: rank {} cannot start: {}", r, broken,
                                    unreadable)));
    }
  }
  // Nothing to resume from is no matter: one rank would search every node's checkpoints (a
  // collective), the other not.
  for (const auto& [code, err] :
       pair("resume", {a, {"--resume", "newest-or-start"}, {}}, {a, {}, {}})) {
    CAPTURE(err);
    CHECK(code == 2);
    CHECK(contains(err,
                   "the ranks were started with different --resume: rank 1 (no --resume) "
                   "differs from rank 0's (--resume newest-or-start)"));
  }
  for (const auto& [code, err] :
       pair("nominal", {a, {}, {}}, {a, {}, {{"DPTRAIN_NOMINAL_WORLD", "4"}}})) {
    CAPTURE(err);
    CHECK(code == 2);
    CHECK(contains(err,
                   "different nominal world sizes (--nominal-world, DPTRAIN_NOMINAL_WORLD; a "
                   "rank given none takes rank 0's): rank 1 (4) differs from rank 0's (2): give "
                   "every rank the same, or none but rank 0"));
  }
  // A world size that differs is found as the ranks connect, before these checks can run.
  const auto sizes = pair("sizes", {a, {}, {}}, {a, {}, {{"WORLD_SIZE", "3"}}});
  CHECK(sizes[0].first == 2);
  CHECK(sizes[1].first == 2);
  CHECK(sizes[0].second ==
        "dptrain: error: rank 0: rank 1 was started with another world size than this rank's 2 "
        "(it was given 3): start every rank with the same world size\n");
  CHECK(sizes[1].second ==
        "dptrain: error: rank 1: rank 0 was started with another world size than this rank's 3 "
        "(it was given 2): start every rank with the same world size\n");
  // Every difference is named at once.
  for (const auto& [code, err] :
       pair("both", {a, {"--resume", "newest-or-start"}, {}}, {b, {}, {}})) {
    CAPTURE(err);
    CHECK(code == 2);
    CHECK(contains(err, "the ranks were given different data: rank 1 ("));
    CHECK(contains(err, "; the ranks were started with different --resume: rank 1 (no --resume)"));
  }
  // The same data under two names trains.
  fs::copy_file(tmp / "a.csv", tmp / "b.csv", fs::copy_options::overwrite_existing);
  for (const auto& [code, err] : pair("same", {a, {}, {}}, {b, {}, {}})) {
    CAPTURE(err);
    CHECK(code == 0);
  }
}

TEST_CASE("a second process given a rank another is joining with is refused at once") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const std::string port = std::to_string(unused_port());
  const auto env_of = [&](int rank) { return hand_env(rank, 3, port, tmp / "run"); };
  // Both given rank 1 while rank 2 is not there yet: whichever joins second is refused (they
  // would pair in Gloo's rendezvous as one rank, and the job hang or lose the first); the other
  // goes on, and the job completes once rank 2 comes.
  Background r0({"worker", recipe.string()}, env_of(0));
  Background first({"worker", recipe.string()}, env_of(1));
  Background second({"worker", recipe.string()}, env_of(1));
  REQUIRE(eventually([&] { return !process_alive(first.pid()) || !process_alive(second.pid()); },
                     std::chrono::seconds(60)));
  Background r2({"worker", recipe.string()}, env_of(2));
  const int a = first.wait(std::chrono::seconds(120));
  const int b = second.wait(std::chrono::seconds(120));
  INFO(first.err(), second.err());
  CHECK(r0.wait(std::chrono::seconds(120)) == 0);
  CHECK(r2.wait(std::chrono::seconds(120)) == 0);
  CHECK(std::min(a, b) == 0);
  CHECK(std::max(a, b) == 2);
  const std::string refused = a == 2 ? first.err() : second.err();
  CHECK(refused.starts_with("dptrain: error: rank 1: another process (pid " +
                            std::to_string(a == 2 ? second.pid() : first.pid()) + " on "));
  CHECK(contains(refused, "is joining this job as rank 1 already"));
  CHECK(parse_json(read_text(tmp / "run/run.json"))["status"] == "completed");
}

TEST_CASE("workers stopped before their first step, or rank 0 by SIGINT, record how they ended") {
  TempDir tmp;
  auto r = resumable_recipe();
  const auto recipe = write_recipe(tmp.path(), r);
  const auto env_of = [&](int rank, const std::string& port) {
    return hand_env(rank, 2, port, tmp / "run");
  };
  // Rank 0 waits for a rank 1 that never comes (distributed.timeout_s is 60): SIGTERM stops it
  // at once, as there is nothing to checkpoint.
  {
    const int port = unused_port();
    Background alone({"worker", recipe.string()}, env_of(0, std::to_string(port)));
    REQUIRE(eventually([&] { return catches_signal(alone.pid(), SIGTERM); }));
    REQUIRE(eventually([&] { return fs::exists(tmp / "run/run.json"); }));
    // Its store, at a loopback MASTER_ADDR, listens on loopback only (state 0A: listening).
    const std::string listening = fmt::format(":{:04X} 00000000:0000 0A", port);
    REQUIRE(eventually([&] { return contains(read_text("/proc/net/tcp"), listening); }));
    CHECK(contains(read_text("/proc/net/tcp"), "0100007F" + listening));
    const auto busy = run_dptrain({"resume", (tmp / "run").string()});
    CHECK(busy.exit_code == 2);
    CHECK(contains(busy.err,
                   "its workers (started without a launcher: by hand, srun, mpirun) "
                   "are running it; nothing to resume while they do"));
    // Nor does a launch start ranks of its own into it.
    const auto launched =
        run_dptrain({"launch", recipe.string(), "--run-dir", (tmp / "run").string()});
    CHECK(launched.exit_code == 2);
    CHECK(launched.err == "dptrain: error: " + (tmp / "run").string() +
                              ": its workers (started without a launcher: by hand, srun, mpirun) "
                              "are running it; choose another --run-dir\n");
    ::kill(alone.pid(), SIGTERM);
    CHECK(alone.wait(std::chrono::seconds(20)) == 143);
    CHECK(alone.err() ==
          "dptrain: error: rank 0: stopped by SIGTERM before its first step "
          "(nothing to checkpoint yet)\n");
    const json info = parse_json(read_text(tmp / "run/run.json"));
    CHECK(info["status"] == "terminated");
    CHECK(info["generations"][0]["status"] == "terminated");
  }
  // SIGINT to rank 0 mid-run: no checkpoint, exit 130, and the run reads as interrupted, not as
  // running until status finds rank 0 gone.
  const std::string port = std::to_string(unused_port());
  Env slow0 = env_of(0, port), slow1 = env_of(1, port);
  slow0["DPTRAIN_DEBUG_STEP_DELAY_MS"] = slow1["DPTRAIN_DEBUG_STEP_DELAY_MS"] = "50";
  {
    Background r0({"worker", recipe.string(), "--resume", "newest-or-start"}, slow0);
    Background r1({"worker", recipe.string(), "--resume", "newest-or-start"}, slow1);
    REQUIRE(eventually([&] { return fs::exists(tmp / "run/checkpoints/step-000040"); },
                       std::chrono::seconds(120)));
    REQUIRE(catches_signal(r0.pid(), SIGINT));
    ::kill(r0.pid(), SIGINT);
    CHECK(r0.wait(std::chrono::seconds(30)) == 130);
    CHECK(contains(r0.err(),
                   "dptrain: error: rank 0: stopped by SIGINT (no checkpoint is written "
                   "for it: the workers started again with '--resume newest'"));
    CHECK(r1.wait(std::chrono::seconds(90)) == 3);
  }
  const json stopped = parse_json(read_text(tmp / "run/run.json"));
  CHECK(stopped["status"] == "interrupted");
  REQUIRE(stopped["generations"].size() == 2);
  CHECK(stopped["generations"][1]["status"] == "interrupted");
  CHECK(stopped["generations"][1]["resumed_from"] == "step 0");  // a search that found none
  CHECK(stopped["generations"][1]["step"].get<int64_t>() >= 40);
  CHECK(parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out)["status"] ==
        "interrupted");
  // Started again, they continue from the newest checkpoint, and run.json says which.
  slow0["MASTER_PORT"] = slow1["MASTER_PORT"] = std::to_string(unused_port());
  slow0.erase("DPTRAIN_DEBUG_STEP_DELAY_MS");
  slow1.erase("DPTRAIN_DEBUG_STEP_DELAY_MS");
  Background again0({"worker", recipe.string(), "--resume", "newest"}, slow0);
  Background again1({"worker", recipe.string(), "--resume", "newest"}, slow1);
  CHECK(again1.wait(std::chrono::seconds(120)) == 0);
  CHECK(again0.wait(std::chrono::seconds(120)) == 0);
  const json done = parse_json(read_text(tmp / "run/run.json"));
  CHECK(done["status"] == "completed");
  REQUIRE(done["generations"].size() == 3);
  CHECK(done["generations"][2]["resumed_from"].get<std::string>().starts_with("step-0000"));
  CHECK(done["generations"][2]["step"] == r["train"]["steps"]);
}

TEST_CASE("without a launcher, a generation whose rank 0 was killed is closed as lost, with when") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  std::string port = std::to_string(unused_port());
  Env e0 = hand_env(0, 2, port, tmp / "run"), e1 = hand_env(1, 2, port, tmp / "run");
  e0["DPTRAIN_DEBUG_STEP_DELAY_MS"] = e1["DPTRAIN_DEBUG_STEP_DELAY_MS"] = "50";
  {
    Background r0({"worker", recipe.string(), "--resume", "newest-or-start"}, e0);
    Background r1({"worker", recipe.string(), "--resume", "newest-or-start"}, e1);
    REQUIRE(eventually([&] { return fs::exists(tmp / "run/checkpoints/step-000020"); },
                       std::chrono::seconds(120)));
    ::kill(r0.pid(), SIGKILL);  // nothing recorded how generation 1 ended
    CHECK(r0.wait(std::chrono::seconds(30)) == 128 + SIGKILL);
    CHECK(r1.wait(std::chrono::seconds(120)) == 3);
  }
  port = std::to_string(unused_port());
  e0 = hand_env(0, 2, port, tmp / "run");
  e1 = hand_env(1, 2, port, tmp / "run");
  Background again0({"worker", recipe.string(), "--resume", "newest"}, e0);
  Background again1({"worker", recipe.string(), "--resume", "newest"}, e1);
  CHECK(again1.wait(std::chrono::seconds(120)) == 0);
  CHECK(again0.wait(std::chrono::seconds(120)) == 0);
  const json info = parse_json(read_text(tmp / "run/run.json"));
  REQUIRE(info["generations"].size() == 2);
  const json& lost = info["generations"][0];
  CHECK(lost["status"] == "lost");
  CHECK(contains(lost["error"].get<std::string>(), "its rank 0 ended without recording"));
  // When the run's files last changed: after it started, no later than the next one started.
  REQUIRE(lost["ended_at"].is_string());
  CHECK(lost["ended_at"].get<std::string>() >= lost["started_at"].get<std::string>());
  CHECK(lost["ended_at"].get<std::string>() <=
        info["generations"][1]["started_at"].get<std::string>());
  CHECK(info["status"] == "completed");
}

TEST_CASE("without a launcher, a rank whose peer is killed names it from the heartbeats") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  for (const int victim : {1, 0}) {
    CAPTURE(victim);
    const std::string port = std::to_string(unused_port());
    std::vector<std::unique_ptr<Background>> ranks;
    for (int r = 0; r < 2; ++r) {
      Env e = hand_env(r, 2, port, tmp / fmt::format("run{}", victim));
      e["DPTRAIN_DEBUG_STEP_DELAY_MS"] = "50";
      ranks.push_back(
          std::make_unique<Background>(std::vector<std::string>{"worker", recipe.string()}, e));
    }
    REQUIRE(eventually([&] {
      return contains(read_text(tmp / fmt::format("run{}/metrics.jsonl", victim)), "\"step\":10");
    }));
    ::kill(ranks[static_cast<size_t>(victim)]->pid(), SIGKILL);
    Background& survivor = *ranks[static_cast<size_t>(1 - victim)];
    CHECK(survivor.wait(std::chrono::seconds(60)) == 3);
    CAPTURE(survivor.err());
    // Rank 1 gone: its heartbeat stands still. Rank 0 gone: the store it served with it.
    CHECK(contains(survivor.err(), victim == 1
                                       ? "; silent: rank 1 (no heartbeat for 2.5s: exited, killed "
                                         "or frozen)"
                                       : "does not answer either: the process serving it (rank 0 "
                                         "with --host-store) has likely exited or was killed"));
    ranks[static_cast<size_t>(victim)]->wait(std::chrono::seconds(10));
  }
}

TEST_CASE("without a launcher, a rank started again after the job started is told it failed") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const std::string port = std::to_string(unused_port());
  // Rank 0 hangs in its own work at step 12, serving the store all the while: rank 1 waits in a
  // collective for it, is killed there, and is started again (by hand, by a scheduler).
  Env e0 = hand_env(0, 2, port, tmp / "run");
  Env e1 = hand_env(1, 2, port, tmp / "run");
  e0["DPTRAIN_FAULT"] = e1["DPTRAIN_FAULT"] = "hang@step=12,rank=0";
  Background r0({"worker", recipe.string()}, e0);
  Background r1({"worker", recipe.string()}, e1);
  REQUIRE(
      eventually([&] { return contains(read_text(tmp / "run/metrics.jsonl"), "\"step\":10"); }));
  const pid_t killed = r1.pid();
  ::kill(killed, SIGKILL);
  r1.wait(std::chrono::seconds(10));
  // The job has failed with it: a failure (exit 3), not a second rank 1 (exit 2).
  Background again({"worker", recipe.string()}, e1);
  CHECK(again.wait(std::chrono::seconds(60)) == 3);
  CHECK_MESSAGE(contains(again.err(), fmt::format("rank 1: this job (at store 127.0.0.1:{}) "
                                                  "started already, and its rank 1 (pid {}) is "
                                                  "gone: a started job takes no rank back",
                                                  port, killed)),
                again.err());
  CHECK(contains(again.err(), "start every rank again (with --resume newest"));
  ::kill(r0.pid(), SIGKILL);
  r0.wait(std::chrono::seconds(10));
}

TEST_CASE("without a launcher, a collective that times out names the rank stuck outside it") {
  TempDir tmp;
  auto r = resumable_recipe();
  r["distributed"]["timeout_s"] = 3;
  const auto recipe = write_recipe(tmp.path(), r);
  const std::string port = std::to_string(unused_port());
  // Rank 1 hangs in its own work at step 5 (its heartbeat goes on): rank 0 waits in the next
  // collective until the timeout, then says where each rank was.
  Env e0 = hand_env(0, 2, port, tmp / "run");
  Env e1 = hand_env(1, 2, port, tmp / "run");
  e0["DPTRAIN_FAULT"] = e1["DPTRAIN_FAULT"] = "hang@step=5,rank=1";
  Background r0({"worker", recipe.string()}, e0);
  Background r1({"worker", recipe.string()}, e1);
  CHECK(r0.wait(std::chrono::seconds(120)) == 3);
  CAPTURE(r0.err());
  CHECK(contains(r0.err(), "; by the ranks' last heartbeats, stuck: rank 1 at step 5 in phase "));
  CHECK(contains(r0.err(), "; waiting for it in collective #"));
  ::kill(r1.pid(), SIGKILL);
  r1.wait(std::chrono::seconds(10));
}

TEST_CASE("a worker started by srun takes its local rank from SLURM_LOCALID") {
  // Rank 1 is the first rank of a second node: a node leader, it keeps its own checkpoints.
  TempDir tmp;
  auto recipe_json = small_recipe();
  recipe_json["checkpoint"] = {{"every", recipe_json["train"]["steps"]}};
  const auto recipe = write_recipe(tmp.path(), recipe_json);
  const std::string port = std::to_string(unused_port());
  Env base = {{"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}};
  Env env0 = base, env1 = base;
  env0["RANK"] = "0";
  env0["DPTRAIN_HOST_STORE"] = "1";
  env0["DPTRAIN_RUN_DIR"] = (tmp / "node0").string();
  env1["RANK"] = "1";
  env1["SLURM_LOCALID"] = "0";
  env1["DPTRAIN_RUN_DIR"] = (tmp / "node1").string();
  Background r0({"worker", recipe.string()}, env0);
  Background r1({"worker", recipe.string()}, env1);
  const int c1 = r1.wait(std::chrono::seconds(120));
  const int c0 = r0.wait(std::chrono::seconds(120));
  INFO(r0.err(), r1.err());
  REQUIRE(c0 == 0);
  REQUIRE(c1 == 0);
  CHECK(fs::exists(tmp / "node0/checkpoints/latest"));
  CHECK(fs::exists(tmp / "node1/checkpoints/latest"));
}

TEST_CASE("a worker that cannot reach the store fails within its timeout naming the address") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const std::string addr = "127.0.0.1:" + std::to_string(unused_port());
  auto r = run_dptrain({"worker", recipe.string(), "--rank", "1", "--world-size", "2", "--store",
                        addr, "--timeout", "2", "--run-dir", (tmp / "run").string()},
                       {}, std::chrono::seconds(60));
  CHECK(r.exit_code == 3);
  CHECK(r.err.find(addr) != std::string::npos);
  CHECK(r.err.find("rank 1") != std::string::npos);
  CHECK(r.seconds < 30);  // a bound against hanging, not a speed assertion
  CHECK(contains(r.err,
                 "; is rank 0 running, started with --host-store (DPTRAIN_HOST_STORE=1) "
                 "to serve it?"));
  // Who serves the store, where the rank's own settings say otherwise.
  const auto alone = [&](const std::string& rank, const Env& env) {
    return run_dptrain({"worker", recipe.string(), "--rank", rank, "--world-size", "2", "--store",
                        addr, "--timeout", "1", "--run-dir", (tmp / "run").string()},
                       env, std::chrono::seconds(60));
  };
  const auto hosting = alone("1", {{"DPTRAIN_HOST_STORE", "1"}});
  CHECK(hosting.exit_code == 3);
  CHECK(contains(hosting.err,
                 "; DPTRAIN_HOST_STORE=1 is for rank 0, which then serves the "
                 "store: this rank only connects to it, so start rank 0 with it"));
  const auto rank0 = alone("0", {});
  CHECK(rank0.exit_code == 3);
  CHECK(contains(rank0.err,
                 "; nothing serves it: rank 0 serves the store when started with "
                 "--host-store (DPTRAIN_HOST_STORE=1)"));
}

TEST_CASE("workers by hand given different generations refuse, naming both") {
  TempDir tmp;
  const auto path = write_recipe(tmp.path(), small_recipe());
  auto [env0, env1] = hand_worker_envs(tmp / "run", std::to_string(unused_port()));
  // Each generation's keys are its own: without the check they would wait out their timeout and
  // say nothing of generations. The older one's rank refuses as it starts; the newer one's when
  // its wait runs out (3 s here), unless it serves the store and finds the newer one first.
  const std::vector<std::string> args = {"worker", path.string(), "--timeout", "3"};
  // Whichever rank finds the other's generation first says so: either way round.
  std::vector<std::string> said;
  SUBCASE("rank 0's newer") {
    env0["DPTRAIN_GENERATION"] = "2";
    said = {"rank 0 was started with generation 2, rank 1 with 1 (from the default)",
            "rank 1 was started with generation 1, rank 0 with 2 (from DPTRAIN_GENERATION)"};
  }
  SUBCASE("rank 1's newer") {
    env1["DPTRAIN_GENERATION"] = "3";
    said = {"rank 0 was started with generation 1, rank 1 with 3 (from DPTRAIN_GENERATION)",
            "rank 1 was started with generation 3, rank 0 with 1 (from the default)"};
  }
  Background r0(args, env0);
  REQUIRE(eventually([&] { return dptrain::run_locked_by_another(tmp / "run"); }));
  Background r1(args, env1);
  const int c1 = r1.wait(std::chrono::seconds(120));
  const int c0 = r0.wait(std::chrono::seconds(120));
  INFO(r0.err(), r1.err());
  CHECK(c0 == 2);
  CHECK(c1 == 2);
  for (const std::string& err : {r0.err(), r1.err()}) {
    CHECK(contains(err, ": start every rank with the same generation"));
    CHECK((contains(err, said[0]) || contains(err, said[1])));
  }
}

TEST_CASE("a worker missing its identity says which variable is missing") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  auto r = run_dptrain({"worker", recipe.string()}, {{"RANK", ""}, {"WORLD_SIZE", ""}});
  CHECK(r.exit_code == 2);
  CHECK(r.err == "dptrain: error: RANK: is empty; give a value\n");
  // One past what a rank number holds: out of range, not "not an integer".
  auto huge =
      run_dptrain({"worker", recipe.string()}, {{"RANK", "0"}, {"WORLD_SIZE", "2147483648"}});
  CHECK(huge.exit_code == 2);
  CHECK(huge.err.find("WORLD_SIZE: '2147483648' is too large (at most 2147483647)") !=
        std::string::npos);
  auto unset = run_dptrain({"worker", recipe.string()}, {{"WORLD_SIZE", "2"}});
  CHECK(unset.exit_code == 2);
  CHECK(unset.err == "dptrain: error: --rank not given and RANK is not set\n");
  // No other variable set to nothing is taken as unset, nor a value it does not understand as
  // its default.
  const Env store = {{"DPTRAIN_STORE", "127.0.0.1:1"}};
  const Env dir = {{"DPTRAIN_STORE", "127.0.0.1:1"}, {"DPTRAIN_RUN_DIR", (tmp / "r").string()}};
  for (const auto& [given, message] : std::vector<std::pair<Env, std::string>>{
           {{{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", ""}}, "MASTER_PORT: is empty"},
           {{{"MASTER_ADDR", "127.0.0.1"}},
            "--store not given and neither DPTRAIN_STORE nor MASTER_PORT is set"},
           {{{"DPTRAIN_STORE", ""}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1"}},
            "DPTRAIN_STORE: is empty"},
           {{{"DPTRAIN_RUN_DIR", ""}}, "DPTRAIN_RUN_DIR: is empty"},
           {{{"DPTRAIN_NOMINAL_WORLD", ""}}, "DPTRAIN_NOMINAL_WORLD: is empty"},
           {{{"DPTRAIN_HOST_STORE", "yes"}},
            "DPTRAIN_HOST_STORE: 'yes' is neither 1 (rank 0 serves the store) nor 0"},
           {{{"DPTRAIN_BIND_ADDR", ""}}, "DPTRAIN_BIND_ADDR: is empty"}}) {
    Env all = {{"RANK", "0"}, {"WORLD_SIZE", "1"}};
    const bool own_store = given.count("MASTER_ADDR") > 0;
    for (const auto& [name, value] : own_store                        ? Env{}
                                     : given.count("DPTRAIN_RUN_DIR") ? store
                                                                      : dir)
      all[name] = value;
    for (const auto& [name, value] : given)
      all[name] = value;
    auto bad = run_dptrain({"worker", recipe.string()}, all, std::chrono::seconds(60));
    CAPTURE(message);
    CHECK(bad.exit_code == 2);
    CHECK(bad.err == "dptrain: error: rank 0: " + message +
                         (message.ends_with("is empty") ? "; give a value\n" : "\n"));
  }
  // A run.json rank 0 cannot keep (a directory there) is refused before it connects.
  fs::create_directories(tmp / "held/run.json");
  auto held = run_dptrain({"worker", recipe.string(), "--rank", "0", "--world-size", "1", "--store",
                           "127.0.0.1:1", "--run-dir", (tmp / "held").string()});
  CHECK(held.exit_code == 2);
  CHECK(contains(held.err, "dptrain: error: rank 0: " + (tmp / "held/run.json").string() +
                               ": is a directory"));

  // Values out of range are refused before any connection (no store listens here), naming the
  // flag or variable.
  const std::vector<std::string> base = {
      "worker", recipe.string(), "--run-dir", (tmp / "run").string(), "--store", "127.0.0.1:1"};
  for (const auto& [extra, env, message] :
       std::vector<std::tuple<std::vector<std::string>, Env, std::string>>{
           {{"--rank", "-1", "--world-size", "2"}, {}, "--rank: '-1' must be a whole number >= 0"},
           {{"--rank", "0", "--world-size", "99999999999"},
            {},
            "--world-size: '99999999999' is out of range [0, 2147483647]"},
           {{"--rank", "0", "--world-size", "0"},
            {},
            "world size (--world-size or WORLD_SIZE): must be at least 1, got 0"},
           {{"--rank", "0", "--world-size", "2", "--generation", "0"},
            {},
            "generation (--generation or DPTRAIN_GENERATION): must be at least 1, got 0"},
           {{"--world-size", "2"}, {{"RANK", "-1"}}, "rank (--rank or RANK): must be at least 0"},
           {{"--rank", "3", "--world-size", "2"},
            {},
            "dptrain: error: rank 3: outside world size 2 (ranks are 0 to 1)\n"},
           {{"--rank", "0", "--world-size", "2"},
            {{"LOCAL_RANK", "-3"}},
            "local rank (--local-rank or LOCAL_RANK): must be at least 0, got -3"},
           {{"--rank", "0", "--world-size", "1"},
            {{"LOCAL_RANK", "5"}},
            "dptrain: error: rank 0: local rank (--local-rank or LOCAL_RANK) 5 is outside world "
            "size 1 (a node's ranks are 0 to 0)\n"}}) {
    std::vector<std::string> args = base;
    args.insert(args.end(), extra.begin(), extra.end());
    auto bad = run_dptrain(args, env, std::chrono::seconds(60));
    CAPTURE(bad.err);
    CHECK(bad.exit_code == 2);
    CHECK(bad.err.find(message) != std::string::npos);
    CHECK(std::count(bad.err.begin(), bad.err.end(), '\n') == 1);
  }
  CHECK_FALSE(fs::exists(tmp / "run"));
  // A rank given a world size below its rank tells rank 0, which serves the store, at once:
  // rank 0 names the other world size rather than wait its timeout for a rank that left.
  {
    const std::string port = std::to_string(unused_port());
    Background rank0({"worker", recipe.string(), "--rank", "0", "--world-size", "2", "--store",
                      "127.0.0.1:" + port, "--host-store", "--timeout", "120", "--run-dir",
                      (tmp / "world0").string()});
    auto rank1 =
        run_dptrain({"worker", recipe.string(), "--rank", "1", "--world-size", "1", "--store",
                     "127.0.0.1:" + port, "--run-dir", (tmp / "world1").string()},
                    {}, std::chrono::seconds(60));
    CHECK(rank1.exit_code == 2);
    CHECK(rank1.err == "dptrain: error: rank 1: outside world size 1 (ranks are 0 to 0)\n");
    CHECK(rank0.wait(std::chrono::seconds(60)) == 2);
    CHECK(rank0.err() ==
          "dptrain: error: rank 0: rank 1 was started with another world size than this rank's 2 "
          "(it was given 1): start every rank with the same world size\n");
  }

  // Its farewell (telling the others why it stops) waits no longer than the rank's --timeout:
  // not for a store that is not there (--timeout 1 s, where it waited 5 s), nor, on rank 0, for a
  // peer that never came (--timeout 3 s, and as long again after it). The bound is below the old
  // waits, well above the new.
  for (const auto& [rank, timeout, code, says] :
       std::vector<std::tuple<std::string, std::string, int, std::string>>{
           {"3", "1", 2, "rank 3: outside world size 2"},
           {"0", "3", 3, "rank 0: rank 1 of 2 did not join within 3s"}}) {
    CAPTURE(rank);
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::string> args = {"worker",       recipe.string(),
                                     "--rank",       rank,
                                     "--world-size", "2",
                                     "--store",      "127.0.0.1:" + std::to_string(unused_port()),
                                     "--timeout",    timeout,
                                     "--run-dir",    (tmp / ("alone" + rank)).string()};
    if (rank == "0") args.push_back("--host-store");
    auto alone = run_dptrain(args, {}, std::chrono::seconds(60));
    CHECK(alone.exit_code == code);
    CHECK(contains(alone.err, says));
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
  }

  // A --run-dir that is a file is refused as the launcher refuses it (exit 2).
  write_text(tmp / "afile", "");
  auto file = run_dptrain({"worker", recipe.string(), "--run-dir", (tmp / "afile").string(),
                           "--store", "127.0.0.1:1", "--rank", "0", "--world-size", "1"});
  CHECK(file.exit_code == 2);
  CHECK(file.err ==
        "dptrain: error: rank 0: --run-dir " + (tmp / "afile").string() + ": not a directory\n");
  // A pipe where rank 0 writes its metrics: exit 2 before it meets any rank, as resume says it.
  fs::create_directories(tmp / "piped");
  REQUIRE(::mkfifo((tmp / "piped/metrics.jsonl").c_str(), 0600) == 0);
  auto piped = run_dptrain({"worker", recipe.string(), "--run-dir", (tmp / "piped").string(),
                            "--store", "127.0.0.1:1", "--rank", "0", "--world-size", "1"});
  CHECK(piped.exit_code == 2);
  CHECK(contains(piped.err, (tmp / "piped/metrics.jsonl").string() +
                                ": is a pipe, not a regular file: dptrain writes this file "
                                "itself; move it away"));
}

TEST_CASE("fp16 and bf16 gradient compression: half the bytes, the held-out loss within 2%") {
  TempDir tmp;
  auto recipe = parse_json(read_text(source_dir() / "recipes/quickstart.json"));
  std::map<std::string, double> loss;
  for (const char* type : {"none", "fp16", "bf16"}) {
    CAPTURE(type);
    recipe["distributed"]["compression"] = {{"type", type}};
    const fs::path run_dir = tmp / type;
    auto r = run_dptrain({"launch", write_recipe(tmp.path(), recipe).string(), "--nproc", "2",
                          "--run-dir", run_dir.string(), "--json"});
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    loss[type] = parse_json(r.out)["eval_loss"].get<double>();
    // The bytes each rank puts into a step's gradient all-reduce: every gradient and the stop
    // flag, 4 bytes each uncompressed, 2 compressed.
    const int64_t params = 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10;
    int steps_logged = 0;
    for (const auto& line : read_jsonl(run_dir / "metrics.jsonl")) {
      if (!line.contains("grad_bytes")) continue;  // an evaluation's line
      ++steps_logged;
      CHECK(line["grad_bytes"] == (params + 1) * (std::string(type) == "none" ? 4 : 2));
    }
    CHECK(steps_logged > 0);
  }
  MESSAGE("held-out loss: none " << loss["none"] << ", fp16 " << loss["fp16"] << ", bf16 "
                                 << loss["bf16"]);
  CHECK(loss["fp16"] == doctest::Approx(loss["none"]).epsilon(0.02));
  CHECK(loss["bf16"] == doctest::Approx(loss["none"]).epsilon(0.02));
}

TEST_CASE("no held-out data: eval loss and accuracy are null, not 0, everywhere they show") {
  TempDir tmp;
  auto recipe = small_recipe();
  recipe["data"]["eval_fraction"] = 0;
  recipe["train"]["steps"] = 10;
  recipe["eval"]["every"] = 5;
  const fs::path file = write_recipe(tmp.path(), recipe);
  const fs::path run_dir = tmp / "run";
  auto r = run_dptrain(
      {"launch", file.string(), "--nproc", "2", "--run-dir", run_dir.string(), "--json"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const auto out = parse_json(r.out);
  CHECK(out["eval_loss"].is_null());
  CHECK(out["eval_accuracy"].is_null());
  CHECK(out["final_loss"].is_number());  // steps ran: their loss is there
  const auto result = parse_json(read_text(run_dir / "result.json"));
  CHECK(result["eval_loss"].is_null());
  CHECK(result["eval_accuracy"].is_null());
  CHECK(result["final_loss"].get<double>() == out["final_loss"].get<double>());
  for (const auto& line : read_jsonl(run_dir / "metrics.jsonl"))
    CHECK_FALSE(line.contains("eval_loss"));  // nothing was evaluated, nothing logged
  const auto report = run_dptrain({"report", run_dir.string(), "--json"});
  INFO(report.err);
  REQUIRE(report.exit_code == 0);
  CHECK(parse_json(report.out)["eval_loss"].is_null());
  CHECK(parse_json(report.out)["eval_accuracy"].is_null());

  // The console summary says there was none instead of printing zeros.
  r = run_dptrain({"launch", file.string(), "--nproc", "2", "--run-dir", (tmp / "text").string()});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::string console = r.out + r.err;
  CHECK(console.find("eval none") != std::string::npos);
  CHECK(console.find("eval loss") == std::string::npos);
  CHECK(console.find("final loss none") == std::string::npos);
}

TEST_CASE("a token dataset prepared with --val-fraction 0 reports a null eval loss") {
  TempDir tmp;
  write_text(tmp / "text.txt", synthetic_text(3, 20000));
  const auto prepared = run_dptrain({"data", "prepare", "--text", (tmp / "text.txt").string(),
                                     "--out", (tmp / "data").string(), "--val-fraction", "0"});
  INFO(prepared.err);
  REQUIRE(prepared.exit_code == 0);
  auto recipe = gpt_recipe(tmp / "data", 1, 16);
  recipe["train"] = {{"steps", 4}, {"batch_per_rank", 4}};
  recipe["optimizer"]["schedule"] = {{"type", "cosine"}, {"warmup", 1}};
  recipe["checkpoint"] = {{"every", 0}, {"keep", 1}};
  recipe["eval"] = {{"every", 2}, {"max_samples", 32}};
  recipe["log"] = {{"every", 2}};
  const fs::path run_dir = tmp / "run";
  const auto r = run_dptrain({"launch", write_recipe(tmp.path(), recipe).string(), "--run-dir",
                              run_dir.string(), "--json"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const auto out = parse_json(r.out);
  CHECK(out["eval_loss"].is_null());
  CHECK(out["eval_accuracy"].is_null());
  CHECK(out["final_loss"].get<double>() > 0);
  CHECK(parse_json(read_text(run_dir / "result.json"))["eval_loss"].is_null());
}

TEST_CASE("a run of 0 steps reports a null final loss, and still evaluates") {
  TempDir tmp;
  auto recipe = small_recipe();
  recipe["train"]["steps"] = 0;
  recipe["optimizer"]["schedule"]["warmup"] = 0;
  const fs::path file = write_recipe(tmp.path(), recipe);
  const fs::path run_dir = tmp / "run";
  auto r = run_dptrain(
      {"launch", file.string(), "--nproc", "2", "--run-dir", run_dir.string(), "--json"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const auto out = parse_json(r.out);
  CHECK(out["steps"] == 0);
  CHECK(out["final_loss"].is_null());
  // The initial parameters on held-out data: 5 classes, a loss near ln 5.
  CHECK(out["eval_loss"].get<double>() > 1.0);
  CHECK(out["eval_accuracy"].is_number());
  CHECK(parse_json(read_text(run_dir / "result.json"))["final_loss"].is_null());
  const auto report = run_dptrain({"report", run_dir.string(), "--json"});
  INFO(report.err);
  REQUIRE(report.exit_code == 0);
  CHECK(parse_json(report.out)["final_loss"].is_null());

  r = run_dptrain({"launch", file.string(), "--nproc", "2", "--run-dir", (tmp / "text").string()});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::string console = r.out + r.err;
  CHECK(console.find("final loss none") != std::string::npos);
  CHECK(console.find("eval loss") != std::string::npos);
}

TEST_CASE("a CPU run never loads the GPU libraries, in the launcher or in a rank") {
  TempDir tmp;
  auto r = small_recipe();
  r["train"]["steps"] = 400;
  const auto recipe = write_recipe(tmp.path(), r);
  const fs::path run_dir = tmp / "cpu";
  Background launcher({"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string()},
                      {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "30"}});
  // The ranks train: every library they will use is loaded.
  REQUIRE(eventually([&] {
    return fs::exists(run_dir / "metrics.jsonl") &&
           read_jsonl(run_dir / "metrics.jsonl").size() > 1;
  }));
  std::vector<pid_t> pids = {launcher.pid()};
  std::istringstream children(read_text(fs::path("/proc") / std::to_string(launcher.pid()) /
                                        "task" / std::to_string(launcher.pid()) / "children"));
  for (pid_t child = 0; children >> child;)
    pids.push_back(child);
  CHECK(pids.size() == 3);
  for (const pid_t pid : pids) {
    CAPTURE(pid);
    const std::string maps = read_text(fs::path("/proc") / std::to_string(pid) / "maps");
    CHECK(maps.find("libgloo") != std::string::npos);  // what a rank does load
    CHECK(maps.find("libcublas") == std::string::npos);
    CHECK(maps.find("libnccl") == std::string::npos);
  }
  REQUIRE(::kill(launcher.pid(), SIGINT) == 0);
  CHECK(launcher.wait(std::chrono::seconds(60)) == 130);
}
