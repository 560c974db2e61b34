// `dptrain bench train` end to end: real runs per world size, the JSON rows, the chart, the
// table, and every refusal before a run (bad lists, --strong, data too small) or after (exit 3).
#include <doctest/doctest.h>

#include <sstream>

#include "tests/harness.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

CommandResult bench(const TempDir& tmp, const std::vector<std::string>& recipe_and_args,
                    const Env& env = {}) {
  std::vector<std::string> full = {"bench", "train"};
  full.insert(full.end(), recipe_and_args.begin(), recipe_and_args.end());
  full.push_back("--runs-root");
  full.push_back((tmp / "runs").string());
  return run_dptrain(full, env, std::chrono::seconds(60));
}

std::string quickstart() {
  return (source_dir() / "recipes/quickstart.json").string();
}

// Nothing was started: no sweep directory under the runs root.
bool nothing_created(const TempDir& tmp) {
  return !fs::exists(tmp / "runs") || fs::is_empty(tmp / "runs");
}

}  // namespace

TEST_CASE("bench train quickstart --nproc 1,2 --json --svg: a row per world, all positive") {
  TempDir tmp;
  const fs::path svg = tmp / "out.svg";
  const auto r = bench(
      tmp, {quickstart(), "--nproc", "1,2", "--steps", "20", "--json", "--svg", svg.string()});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json j = parse_json(r.out);
  CHECK(j["status"] == "completed");
  CHECK(j["recipe"] == "quickstart");
  CHECK(j["steps"] == 20);
  CHECK(j["scaling"] == "weak");
  CHECK(j["throughput_unit"] == "samples/s");
  CHECK(j["machine"]["cpus"].get<int>() >= 1);
  CHECK_FALSE(j["machine"]["cpu_model"].get<std::string>().empty());
  REQUIRE(j["rows"].size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    const json& row = j["rows"][i];
    CAPTURE(row.dump());
    const int world = static_cast<int>(i) + 1;
    CHECK(row["world"] == world);
    CHECK(row["batch_per_rank"] == 64);
    CHECK(row["global_batch"] == 64 * world);  // weak scaling
    CHECK(row["samples_per_s"].get<double>() > 0);
    CHECK(row["step_ms"].get<double>() > 0);
    for (const char* phase : {"data", "compute", "comm", "optimizer"}) {
      CAPTURE(phase);
      CHECK(row["phases_ms"][phase].get<double>() > 0);
    }
    // The phases are a split of the step: together not more than its wall time.
    double phases = 0;
    for (const auto& [k, v] : row["phases_ms"].items())
      phases += v.get<double>();
    CHECK(phases <= row["step_ms"].get<double>() * 1.05);
    CHECK(row["efficiency"].get<double>() > 0);
    CHECK(row["peak_rss_mib"].get<double>() > 0);
    CHECK(row["mfu"].is_null());  // CPU
    REQUIRE(row["run_dirs"].size() == 1);
    const fs::path run = row["run_dirs"][0].get<std::string>();
    CHECK(run.filename() == "w" + std::to_string(world));
    CHECK(fs::exists(run / "result.json"));
    CHECK(fs::exists(run / "console.log"));
    CHECK(fs::is_empty(run / "checkpoints"));  // a benchmark keeps no checkpoint
    // The run trained exactly --steps, nothing else timed in it.
    const json recipe = parse_json(read_text(run / "recipe.json"));
    CHECK(recipe["train"]["steps"] == 20);
    CHECK(recipe["checkpoint"]["every"] == 0);
    CHECK(recipe["eval"]["every"] == 0);
  }
  CHECK(j["rows"][0]["efficiency"].get<double>() == 1.0);
  // The sweep's report is kept beside its runs.
  const json kept = parse_json(read_text(fs::path(j["run_dir"].get<std::string>()) / "bench.json"));
  CHECK(kept["rows"] == j["rows"]);

  REQUIRE(fs::exists(svg));
  const std::string chart = read_text(svg);
  CHECK(chart.rfind("<svg", 0) == 0);
  CHECK(chart.find("xmlns=\"http://www.w3.org/2000/svg\"") != std::string::npos);
  const std::string trimmed = chart.substr(0, chart.find_last_not_of(" \n") + 1);
  CHECK(trimmed.size() >= 6);
  CHECK(trimmed.substr(trimmed.size() - 6) == "</svg>");
  CHECK(chart.find("ideal (linear scaling)") != std::string::npos);
  // Progress for a CI log, on stderr.
  CHECK(r.err.find("bench train: world 1 (run 1 of 2)") != std::string::npos);
  CHECK(r.err.find("bench train: world 2 (run 2 of 2)") != std::string::npos);
}

TEST_CASE("bench train prints a table naming recipe, steps, machine and weak scaling") {
  TempDir tmp;
  const auto r = bench(tmp, {quickstart(), "--nproc", "1", "--steps", "5"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("recipe quickstart") != std::string::npos);
  CHECK(r.out.find("5 steps per run") != std::string::npos);
  CHECK(r.out.find("# machine: ") != std::string::npos);
  CHECK(r.out.find("# weak scaling") != std::string::npos);
  CHECK(r.out.find("# MFU: n/a (CPU)") != std::string::npos);
  std::vector<std::string> rows;
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] != '#') rows.push_back(line);
  REQUIRE(rows.size() == 1);
  std::istringstream cells(rows[0]);
  std::string world, batch, rate;
  cells >> world >> batch >> rate;
  CHECK(world == "1");
  CHECK(batch == "64");
  CHECK(std::stod(rate) > 0);
  CHECK(rows[0].find("100.0") != std::string::npos);  // efficiency of the baseline
}

TEST_CASE("a bad --nproc list exits 2 naming it, before anything is created") {
  TempDir tmp;
  for (const std::string bad : {"1,0", "1,x", "1,,2", "", "2,2"}) {
    CAPTURE(bad);
    const auto r = bench(tmp, {quickstart(), "--nproc", bad});
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("--nproc") != std::string::npos);
    CHECK(nothing_created(tmp));
  }
}

TEST_CASE("--strong refuses a world size that cannot share the global batch, naming it") {
  TempDir tmp;
  // quickstart: batch_per_rank 64 on world 1; 64 samples cannot be split over 3 ranks.
  const auto r = bench(tmp, {quickstart(), "--nproc", "1,2,3", "--strong", "--json"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--strong: world size 3") != std::string::npos);
  CHECK(parse_json(r.out)["exit_code"] == 2);
  CHECK(nothing_created(tmp));
}

TEST_CASE("a world size whose global batch the data cannot hold exits 2 naming it") {
  TempDir tmp;
  json recipe = small_recipe();     // 16 per rank
  recipe["data"]["samples"] = 200;  // 180 for training: up to 11 ranks
  const fs::path file = write_recipe(tmp.path(), recipe);
  const auto r = bench(tmp, {file.string(), "--nproc", "1,2,16"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--nproc: world size 16: ") != std::string::npos);
  CHECK(r.err.find("fewer than one global batch") != std::string::npos);
  CHECK(nothing_created(tmp));
}

TEST_CASE("a failed run exits 3 with its error and the world size") {
  TempDir tmp;
  const fs::path file = write_recipe(tmp.path(), small_recipe());
  // Rank 1 exists only at world size 2: world 1 completes, world 2 fails.
  const auto r = bench(tmp, {file.string(), "--nproc", "1,2", "--steps", "10"},
                       {{"DPTRAIN_FAULT", "exit@step=3,rank=1,code=7"}});
  CHECK(r.exit_code == 3);
  CHECK(r.err.find("the run at world size 2 failed") != std::string::npos);
  CHECK(r.err.find("rank 1") != std::string::npos);
  CHECK(r.err.find("bench train: world 1: ") != std::string::npos);  // measured before
  CHECK(r.out.empty());                                              // no table for a partial sweep
}
