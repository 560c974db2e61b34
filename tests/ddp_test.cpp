// Communication efficiency end to end on real ranks: bucketed overlap, the error-feedback codecs,
// ZeRO-1 and local SGD, each with crashes and resumes where its state must survive them.
#include <doctest/doctest.h>

#include <signal.h>

#include <cmath>
#include <map>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "tests/harness.hpp"
#include "tests/strings.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// `dptrain launch RECIPE --nproc N --run-dir DIR --json` plus `extra`; the result JSON.
json launch(const fs::path& tmp, const json& recipe, int nproc, const std::string& run,
            const std::vector<std::string>& extra = {},
            const std::map<std::string, std::string>& env = {}) {
  std::vector<std::string> args = {"launch",    write_recipe(tmp, recipe).string(),
                                   "--nproc",   std::to_string(nproc),
                                   "--run-dir", (tmp / run).string(),
                                   "--json"};
  args.insert(args.end(), extra.begin(), extra.end());
  auto r = run_dptrain(args, env);
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return parse_json(r.out);
}

// The step lines of a run's metrics.jsonl (not the evaluations').
std::vector<json> step_lines(const fs::path& run_dir) {
  std::vector<json> out;
  for (const auto& line : read_jsonl(run_dir / "metrics.jsonl")) {
    if (line.contains("grad_bytes")) out.push_back(line);
  }
  return out;
}

// `recipe` run cleanly and with the injected `faults` (each one a restart; `restarts` of them)
// on `nproc` ranks ends with the same parameters, bit for bit.
void check_restarts_bit_identical(const fs::path& tmp, const json& recipe, int nproc,
                                  const std::string& faults, int restarts) {
  launch(tmp, recipe, nproc, "clean");
  const json out = launch(tmp, recipe, nproc, "faulty",
                          {"--max-restarts", std::to_string(restarts), "--restart-backoff", "0.1"},
                          {{"DPTRAIN_FAULT", faults}});
  CHECK(out["restarts"] == restarts);  // every fault fired
  CHECK(read_text(latest_params(tmp / "faulty")) == read_text(latest_params(tmp / "clean")));
}

// The quickstart MLP (784-256-256-10): its matrices and vectors, for the expected wire bytes.
struct Shape {
  int64_t rows, cols;
};
const std::vector<Shape> kQuickstartTensors = {{256, 784}, {1, 256},  {256, 256},
                                               {1, 256},   {10, 256}, {1, 10}};

int64_t quickstart_params() {
  int64_t n = 0;
  for (const Shape& s : kQuickstartTensors)
    n += s.rows * s.cols;
  return n;
}

}  // namespace

TEST_CASE("overlap on and off: bit-identical parameters; the metrics split exposed communication") {
  TempDir tmp;
  json recipe = resumable_recipe();
  // Several buckets (the model has 2,885 parameters), three ranks, and two micro-batches a step
  // per rank: communication only after the second.
  recipe["distributed"]["bucket_mb"] = 0.002;
  recipe["train"]["grad_accum"] = 2;
  recipe["distributed"]["overlap"] = true;
  const json on = launch(tmp.path(), recipe, 3, "on");
  recipe["distributed"]["overlap"] = false;
  const json off = launch(tmp.path(), recipe, 3, "off");
  CHECK(on["params_checksum"] == off["params_checksum"]);
  // A new run began at step 0 from no checkpoint, warned of nothing.
  CHECK(on["began_at_step"] == 0);
  CHECK(on["resumed_from"].is_null());
  CHECK(on["warnings"] == json::array());
  CHECK(read_text(latest_params(tmp / "on")) == read_text(latest_params(tmp / "off")));
  const int64_t params = 32 * 48 + 48 + 48 * 24 + 24 + 24 * 5 + 5;
  for (const char* run : {"on", "off"}) {
    CAPTURE(run);
    const auto lines = step_lines(tmp / run);
    REQUIRE(lines.size() == 24);  // 120 steps, one line every 5
    for (const json& line : lines) {
      CHECK(line["grad_bytes"] == (params + 1) * 4);
      // Exposed communication is part of all communication (its mean over the same window).
      CHECK(line["comm_ms"].get<double>() >= 0.0);
      CHECK(line["comm_ms"].get<double>() <= line["comm_total_ms"].get<double>() * (1 + 1e-9));
    }
  }
  // One rank: nothing to communicate, so nothing waited for (no hand-off to a thread either).
  const json alone = launch(tmp.path(), recipe, 1, "alone");
  for (const json& line : step_lines(tmp / "alone")) {
    CHECK(line["comm_ms"].get<double>() == 0.0);
    CHECK(line["comm_total_ms"].get<double>() == 0.0);
    CHECK(line["grad_bytes"] == (params + 1) * 4);
  }
  CHECK(alone["phases_ms"]["comm"].get<double>() == 0.0);
  const auto off_lines = step_lines(tmp / "off");
  for (const json& line : off_lines) {
    // Without overlap every bucket is waited for: all communication is exposed.
    CHECK(line["comm_ms"].get<double>() == doctest::Approx(line["comm_total_ms"].get<double>()));
  }
  CHECK(on["bytes_per_step"] == (params + 1) * 4);
}

TEST_CASE("int8, topk and powersgd: held-out loss within 2% of none, the bytes they promise") {
  TempDir tmp;
  json recipe = parse_json(read_text(source_dir() / "recipes/quickstart.json"));
  const int64_t n = quickstart_params();
  const json none = launch(tmp.path(), recipe, 2, "none");
  const double none_loss = none["eval_loss"].get<double>();
  CHECK(none["bytes_per_step"] == (n + 1) * 4);

  // int8: a byte per value and a 4-byte scale per block of 256 (one bucket), plus the flag.
  recipe["distributed"]["compression"] = {{"type", "int8"}};
  const json int8 = launch(tmp.path(), recipe, 2, "int8");
  CHECK(int8["bytes_per_step"] == n + 4 * ((n + 255) / 256) + 4);

  // topk 5%: ceil(0.05 n) (index, value) pairs of 8 bytes.
  recipe["distributed"]["compression"] = {{"type", "topk"}, {"ratio", 0.05}};
  const json topk = launch(tmp.path(), recipe, 2, "topk");
  CHECK(topk["bytes_per_step"] ==
        8 * static_cast<int64_t>(std::ceil(0.05 * static_cast<double>(n))) + 4);

  // powersgd rank 4: each matrix as P (rows x 4) and Q (cols x 4); vectors as they are.
  recipe["distributed"]["compression"] = {{"type", "powersgd"}, {"rank", 4}};
  const json powersgd = launch(tmp.path(), recipe, 2, "powersgd");
  int64_t expected = 4;  // the flag
  for (const Shape& s : kQuickstartTensors) {
    expected += s.rows == 1 ? 4 * s.cols : 4 * 4 * (s.rows + s.cols);
  }
  CHECK(powersgd["bytes_per_step"] == expected);

  MESSAGE("held-out loss: none " << none_loss << ", int8 " << int8["eval_loss"] << ", topk "
                                 << topk["eval_loss"] << ", powersgd " << powersgd["eval_loss"]);
  MESSAGE("bytes per step vs none: int8 "
          << int8["bytes_per_step"].get<double>() / none["bytes_per_step"].get<double>()
          << ", topk "
          << topk["bytes_per_step"].get<double>() / none["bytes_per_step"].get<double>()
          << ", powersgd "
          << powersgd["bytes_per_step"].get<double>() / none["bytes_per_step"].get<double>());
  for (const json* run : {&int8, &topk, &powersgd}) {
    CHECK((*run)["eval_loss"].get<double>() == doctest::Approx(none_loss).epsilon(0.02));
  }
}

TEST_CASE("error feedback survives crashes: the residuals are in checkpoints, results identical") {
  TempDir tmp;
  json recipe = resumable_recipe();
  recipe["distributed"]["compression"] = {{"type", "int8"}, {"block", 64}};
  check_restarts_bit_identical(tmp.path(), recipe, 2,
                               "crash@step=25,rank=1,gen=1;crash@step=67,rank=0,gen=2", 2);
  // Both ranks' residuals: 2 x the gradients, next to the parameters, checksummed.
  const fs::path ckpt = latest_params(tmp / "faulty").parent_path();
  const json meta = parse_json(read_text(ckpt / "meta.json"));
  const int64_t params = 32 * 48 + 48 + 48 * 24 + 24 + 24 * 5 + 5;
  CHECK(meta["blobs"]["comm"]["bytes"] == 2 * params * 4);
  auto verify = run_dptrain({"ckpt", "verify", (tmp / "faulty").string()});
  CHECK(verify.exit_code == 0);
}

TEST_CASE("ZeRO-1: the same training as all-reduce with half the optimizer state per rank") {
  TempDir tmp;
  json recipe = resumable_recipe();
  const json plain = launch(tmp.path(), recipe, 2, "plain");
  recipe["distributed"]["zero"] = 1;
  const json zero = launch(tmp.path(), recipe, 2, "zero");
  CHECK(zero["eval_loss"].get<double>() ==
        doctest::Approx(plain["eval_loss"].get<double>()).epsilon(1e-5));
  // AdamW's m and v of 2,885 parameters: a shard of 1,443, padded to 1,472 (a multiple of 64
  // floats, for aligned device access), of each per rank.
  const double mib = 1024.0 * 1024.0;
  CHECK(plain["optimizer_state_mib"].get<double>() == doctest::Approx(2 * 2885 * 4 / mib));
  CHECK(zero["optimizer_state_mib"].get<double>() == doctest::Approx(2 * 1472 * 4 / mib));
  // The info line says so in a unit that shows it (not "0.0 MiB").
  CHECK(contains(read_text(tmp / "zero/logs/localhost-rank0.log"),
                 "; ZeRO-1: optimizer state 11.5 KiB per rank (22.5 KiB unsharded)"));
  // The report's facts name the levers the run trained with.
  REQUIRE(run_dptrain({"report", (tmp / "zero").string(), "--out", (tmp / "zero.html").string()})
              .exit_code == 0);
  CHECK(contains(read_text(tmp / "zero.html"),
                 "<tr><th>Training</th><td>ZeRO-1 (sharded optimizer state); fp32</td></tr>"));
  // The checkpoint holds the whole state, as an all-reduce run's does: the same size.
  const auto meta = [&](const char* run) {
    return parse_json(read_text(latest_params(tmp / run).parent_path() / "meta.json"));
  };
  CHECK(meta("zero")["blobs"]["optimizer"]["bytes"] ==
        meta("plain")["blobs"]["optimizer"]["bytes"]);
}

TEST_CASE("ZeRO-1 resumes bit-identically after crashes, and on another world size") {
  TempDir tmp;
  json recipe = resumable_recipe();
  recipe["distributed"]["zero"] = 1;
  check_restarts_bit_identical(tmp.path(), recipe, 3, "crash@step=45,rank=2,gen=1", 1);

  // Stopped at step 50 on 3 ranks (checkpoint at 40), resumed on 2: every shard reassembled.
  auto stopped = run_dptrain({"launch", write_recipe(tmp.path(), recipe).string(), "--nproc", "3",
                              "--run-dir", (tmp / "resized").string()},
                             {{"DPTRAIN_FAULT", "exit@step=50,rank=0,code=1"}});
  REQUIRE(stopped.exit_code != 0);
  auto resumed = run_dptrain({"resume", (tmp / "resized").string(), "--nproc", "2", "--json"});
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  const json out = parse_json(resumed.out);
  CHECK(out["steps"] == 120);
  CHECK(out["world_size"] == 2);
  const json clean = parse_json(read_text(tmp / "clean/result.json"));
  CHECK(out["eval_loss"].get<double>() ==
        doctest::Approx(clean["eval_loss"].get<double>()).epsilon(0.02));
}

TEST_CASE("local SGD: averages every period, a fraction of the bytes, resumes bit-identically") {
  TempDir tmp;
  json recipe = resumable_recipe();
  const json plain = launch(tmp.path(), recipe, 2, "plain");
  recipe["distributed"]["sync"] = "local_sgd";
  recipe["distributed"]["period"] = 4;
  recipe["distributed"]["start"] = 8;
  recipe["distributed"]["check_every"] = 20;
  const json local = launch(tmp.path(), recipe, 2, "local");
  // The replicas agree at the end (the final check compares checksums across ranks) and
  // learned about as much as synchronous training.
  CHECK(local["eval_loss"].get<double>() ==
        doctest::Approx(plain["eval_loss"].get<double>()).epsilon(0.1));
  // Parameters every 4 steps (and the optimizer state at the 6 checkpoints) instead of
  // gradients every step.
  CHECK(local["bytes_per_step"].get<double>() < 0.5 * plain["bytes_per_step"].get<double>());
  check_restarts_bit_identical(tmp.path(), recipe, 2, "crash@step=53,rank=1,gen=1", 1);
}

TEST_CASE("local SGD and ZeRO-1 refuse what they cannot combine, naming the field") {
  TempDir tmp;
  json recipe = small_recipe();
  recipe["distributed"]["zero"] = 1;
  recipe["distributed"]["sync"] = "local_sgd";
  auto r = run_dptrain({"launch", write_recipe(tmp.path(), recipe).string(), "--nproc", "2"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("/distributed/zero") != std::string::npos);
  CHECK(!fs::exists(tmp / "runs"));
}

TEST_CASE("parameter servers, synchronous: the same training as all-reduce, sharded over 2") {
  TempDir tmp;
  json recipe = resumable_recipe();
  const json plain = launch(tmp.path(), recipe, 2, "plain");
  // 2 workers (ranks 0, 1) and 2 servers (ranks 2, 3), each holding half the parameters and
  // their AdamW state; clipping needs the norm over both servers' shards.
  recipe["distributed"]["sync"] = "ps";
  recipe["distributed"]["servers"] = 2;
  const json ps = launch(tmp.path(), recipe, 4, "ps");
  CHECK(ps["eval_loss"].get<double>() ==
        doctest::Approx(plain["eval_loss"].get<double>()).epsilon(1e-4));
  CHECK(ps["steps"] == 120);
  // A worker pushes its gradients and pulls the parameters: a shard (half the parameters,
  // padded to a multiple of 64 floats) and a 24-byte header to and from each server.
  const int64_t params = 32 * 48 + 48 + 48 * 24 + 24 + 24 * 5 + 5;
  const int64_t shard = ((params + 1) / 2 + 63) / 64 * 64;
  CHECK(ps["bytes_per_step"] == 2 * (24 + 4 * shard));
  // The optimizer state a server holds (AdamW's two values for its shard), not rank 0's (a
  // worker's: none).
  const double mib = 1024.0 * 1024.0;
  CHECK(ps["optimizer_state_mib"].get<double>() ==
        doctest::Approx(static_cast<double>(2 * 4 * shard) / mib));
  // The checkpoint is the same as an all-reduce run's: the whole optimizer state, gathered.
  const auto meta = [&](const char* run) {
    return parse_json(read_text(latest_params(tmp / run).parent_path() / "meta.json"));
  };
  CHECK(meta("ps")["blobs"]["optimizer"]["bytes"] == meta("plain")["blobs"]["optimizer"]["bytes"]);
  // Resumed at its final step (as if it died after that checkpoint), the servers and workers
  // agree that nothing is left to do: the run completes at once, as it was.
  auto info = parse_json(read_text(tmp / "ps/run.json"));
  info["status"] = "failed";
  write_text(tmp / "ps/run.json", info.dump());
  const std::string metrics = read_text(tmp / "ps/metrics.jsonl");
  auto resumed = run_dptrain({"resume", (tmp / "ps").string()});
  INFO(resumed.err);
  CHECK(resumed.exit_code == 0);
  CHECK(read_text(tmp / "ps/metrics.jsonl") == metrics);
  CHECK(parse_json(read_text(tmp / "ps/result.json"))["samples_per_s"] == ps["samples_per_s"]);
}

TEST_CASE("parameter servers with staleness: workers run ahead, and the run still converges") {
  TempDir tmp;
  json recipe = resumable_recipe();
  recipe["log"]["every"] = 20;  // the sync points; between them workers may run 3 steps ahead
  const json plain = launch(tmp.path(), recipe, 2, "plain");
  recipe["distributed"]["sync"] = "ps";
  recipe["distributed"]["staleness"] = 3;
  const json ps = launch(tmp.path(), recipe, 3, "stale");
  CHECK(ps["steps"] == 120);
  CHECK(ps["eval_loss"].get<double>() ==
        doctest::Approx(plain["eval_loss"].get<double>()).epsilon(0.05));
}

TEST_CASE("parameter servers: a crashed server or worker restarts, bit-identical at staleness 0") {
  TempDir tmp;
  json recipe = resumable_recipe();
  recipe["distributed"]["sync"] = "ps";
  recipe["distributed"]["servers"] = 2;
  check_restarts_bit_identical(tmp.path(), recipe, 4,
                               "crash@step=33,rank=3,gen=1;crash@step=71,rank=0,gen=2", 2);
}

TEST_CASE(
    "parameter servers: SIGTERM between log steps is taken at the servers' step, checkpointed") {
  // SIGTERM between sync points is answered at a step the servers choose, by every rank, with a
  // checkpoint, not by a server that leaves at once.
  TempDir tmp;
  json recipe = resumable_recipe();
  recipe["distributed"]["sync"] = "ps";
  recipe["log"]["every"] = 60;
  const auto path = write_recipe(tmp.path(), recipe);
  Background launch({"launch", path.string(), "--nproc", "2", "--run-dir", (tmp / "run").string()},
                    Env{{"DPTRAIN_DEBUG_STEP_DELAY_MS", "50"}});
  REQUIRE(eventually([&] { return fs::exists(tmp / "run/checkpoints/step-000020"); },
                     std::chrono::seconds(120)));
  ::kill(launch.pid(), SIGTERM);
  CHECK(launch.wait(std::chrono::seconds(120)) == 143);
  INFO(launch.out(), launch.err());
  CHECK(contains(launch.err(), "stopped by SIGTERM; every rank checkpointed its last step"));
  // Each rank says where it stops: not at the end of its step, as synchronous ranks do.
  CHECK(contains(launch.out(),
                 "[rank 1] received SIGTERM: rank 1 checkpoints at the step the parameter "
                 "servers choose (within 2 steps) and stops"));
  CHECK_FALSE(contains(launch.out(), "checkpoints at the end of this step"));
  CHECK(run_dptrain({"resume", (tmp / "run").string()}).exit_code == 0);
}

TEST_CASE("parameter servers: a stop far from any sync point is taken within staleness + 2 steps") {
  // No sync point (log step, checkpoint) for the whole run, whose steps outlast the stop's grace:
  // the servers choose a step to stop after, from the requests the pushes carry, and every rank
  // checkpoints it. Two servers (they agree on the step); at staleness 0 the resume ends where an
  // uninterrupted run does, bit for bit.
  for (const int staleness : {0, 2}) {
    CAPTURE(staleness);
    TempDir tmp;
    json recipe = resumable_recipe();
    recipe["distributed"]["sync"] = "ps";
    recipe["distributed"]["servers"] = 2;
    recipe["distributed"]["staleness"] = staleness;
    recipe["distributed"]["check_every"] = 0;
    recipe["train"]["steps"] = 300;
    recipe["log"]["every"] = 1000;
    recipe["checkpoint"]["every"] = 0;
    recipe["eval"]["every"] = 0;
    if (staleness == 0) launch(tmp.path(), recipe, 4, "clean");
    const auto path = write_recipe(tmp.path(), recipe);
    Background stopped(
        {"launch", path.string(), "--nproc", "4", "--run-dir", (tmp / "run").string()},
        Env{{"DPTRAIN_DEBUG_STEP_DELAY_MS", "20"}, {"DPTRAIN_TEST_STOP_GRACE_MS", "3000"}});
    REQUIRE(eventually(
        [&] {
          return fs::exists(tmp / "run/run.json") &&
                 parse_json(read_text(tmp / "run/run.json"))["generations"].back().contains(
                     "met_at");
        },
        std::chrono::seconds(120)));
    std::this_thread::sleep_for(std::chrono::seconds(1));
    ::kill(stopped.pid(), SIGTERM);
    CHECK(stopped.wait(std::chrono::seconds(120)) == 143);
    INFO(stopped.out(), stopped.err());
    CHECK(contains(stopped.err(), "stopped by SIGTERM; every rank checkpointed its last step"));
    CHECK(contains(stopped.out(), fmt::format("rank 0 checkpoints at the step the parameter "
                                              "servers choose (within {} steps) and stops",
                                              staleness + 2)));
    // The one checkpoint is the stop's, well before the end (300 steps of 20 ms and more).
    std::vector<std::string> checkpoints;
    for (const auto& entry : fs::directory_iterator(tmp / "run/checkpoints")) {
      if (entry.path().filename().string().starts_with("step-"))
        checkpoints.push_back(entry.path().filename().string());
    }
    REQUIRE(checkpoints.size() == 1);
    CHECK(checkpoints[0] < "step-000300");
    const auto resumed = run_dptrain({"resume", (tmp / "run").string()});
    INFO(resumed.err);
    REQUIRE(resumed.exit_code == 0);
    if (staleness == 0) {
      CHECK(read_text(latest_params(tmp / "run")) == read_text(latest_params(tmp / "clean")));
    }
  }
}

TEST_CASE("parameter servers: too many servers, or NCCL, is one clear error") {
  TempDir tmp;
  json recipe = small_recipe();
  recipe["distributed"]["sync"] = "ps";
  recipe["distributed"]["servers"] = 2;
  const auto path = write_recipe(tmp.path(), recipe);
  auto r = run_dptrain({"launch", path.string(), "--nproc", "2"});
  CHECK(r.exit_code == 2);
  CHECK(r.err == "dptrain: error: " + path.string() +
                     ": /distributed/servers: 2 parameter server(s) leave no worker among 2 "
                     "rank(s); the servers are the last ranks, the workers the others\n");
  // An elastic job that may shrink to as few ranks as servers: refused before it starts (a
  // plan too), not met once a rank is lost; nothing is made.
  for (const bool dry_run : {false, true}) {
    CAPTURE(dry_run);
    std::vector<std::string> args = {"launch", path.string(), "--nproc",
                                     "2:3",    "--run-dir",   (tmp / "elastic").string()};
    if (dry_run) args.push_back("--dry-run");
    r = run_dptrain(args);
    CHECK(r.exit_code == 2);
    CHECK(r.err == "dptrain: error: " + path.string() +
                       ": /distributed/servers: 2 parameter server(s) leave no worker among 2 "
                       "rank(s); the servers are the last ranks, the workers the others (the "
                       "elastic job may shrink to 2 rank(s), its minimum: give a minimum that "
                       "leaves a worker)\n");
    CHECK_FALSE(fs::exists(tmp / "elastic"));
  }
  recipe["distributed"]["servers"] = 1;
  recipe["distributed"]["backend"] = "nccl";
  r = run_dptrain({"launch", write_recipe(tmp.path(), recipe).string(), "--nproc", "2"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("/distributed/backend") != std::string::npos);
}

TEST_CASE("every sync mode resumes on another world size") {
  struct Mode {
    std::string name;
    json distributed;
    int before, after;  // ranks
  };
  const std::vector<Mode> modes = {
      {"local_sgd", {{"sync", "local_sgd"}, {"period", 4}}, 2, 3},
      {"ps", {{"sync", "ps"}, {"servers", 1}}, 3, 2},
      {"int8", {{"compression", {{"type", "int8"}}}}, 3, 2},
  };
  for (const Mode& mode : modes) {
    CAPTURE(mode.name);
    TempDir tmp;
    json recipe = resumable_recipe();
    recipe["distributed"].update(mode.distributed);
    const json clean = launch(tmp.path(), recipe, mode.before, "clean");
    // Stopped at step 50 (the checkpoint at 40 survives), resumed on another number of ranks.
    auto stopped =
        run_dptrain({"launch", write_recipe(tmp.path(), recipe).string(), "--nproc",
                     std::to_string(mode.before), "--run-dir", (tmp / "resized").string()},
                    {{"DPTRAIN_FAULT", "exit@step=50,rank=0,code=1"}});
    REQUIRE(stopped.exit_code != 0);
    auto resumed = run_dptrain(
        {"resume", (tmp / "resized").string(), "--nproc", std::to_string(mode.after), "--json"});
    INFO(resumed.err);
    REQUIRE(resumed.exit_code == 0);
    const json out = parse_json(resumed.out);
    CHECK(out["steps"] == 120);
    CHECK(out["world_size"] == mode.after);
    CHECK(out["eval_loss"].get<double>() ==
          doctest::Approx(clean["eval_loss"].get<double>()).epsilon(0.05));
  }
}
