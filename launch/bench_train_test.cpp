// bench train's model: world lists, the benchmark recipe, medians, efficiency, table, JSON, sweep.
#include "launch/bench_train.hpp"

#include <doctest/doctest.h>

#include <fstream>
#include <sstream>

#include "core/error.hpp"
#include "core/trainer.hpp"
#include "tests/temp_dir.hpp"

using namespace dptrain;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

Recipe small_recipe() {
  return parse_recipe(json::parse(R"({
    "name": "small",
    "model": {"type": "mlp", "input": 8, "hidden": [8], "classes": 3},
    "data": {"type": "synthetic-classification", "samples": 400, "eval_fraction": 0.1},
    "train": {"steps": 300, "batch_per_rank": 12, "grad_accum": 2},
    "optimizer": {"schedule": {"type": "cosine", "warmup": 30}},
    "distributed": {"check_every": 50},
    "checkpoint": {"every": 100},
    "eval": {"every": 100},
    "log": {"every": 100}
  })"),
                      "small.json", ".");
}

json result(double samples_per_s, double data, double compute, double comm, double optimizer,
            double peak, const std::string& run_dir = "") {
  json r = {{"samples_per_s", samples_per_s},
            {"phases_ms",
             {{"data", data}, {"compute", compute}, {"comm", comm}, {"optimizer", optimizer}}},
            {"peak_rss_mib", peak}};
  if (!run_dir.empty()) r["run_dir"] = run_dir;
  return r;
}

BenchTrainReport report_with_rows(bool tokens) {
  BenchTrainReport report;
  report.recipe_name = "small";
  report.recipe_file = "recipes/small.json";
  report.options.steps = 20;
  report.tokens = tokens;
  report.machine.cpus = 8;
  report.machine.cpu_model = "Test CPU <fast> & cheap";
  report.machine.backend = "gloo";
  BenchTrainRow one = row_from_results({result(1000, 0.1, 40, 0.01, 2, 90)}, 1, 64, 64);
  BenchTrainRow two = row_from_results({result(1500, 0.1, 40, 20, 2, 95)}, 2, 64, 128);
  if (tokens) {
    one.tokens_per_s = 128000;
    two.tokens_per_s = 192000;
  }
  report.rows = {one, two};
  fill_efficiency(report.rows);
  return report;
}

}  // namespace

TEST_CASE("a world list is positive integers, sorted, each once") {
  CHECK(parse_world_list("1,2,4", "--nproc") == std::vector<int>{1, 2, 4});
  CHECK(parse_world_list("4, 1", "--nproc") == std::vector<int>{1, 4});
  CHECK(parse_world_list("3", "--nproc") == std::vector<int>{3});
  for (const char* bad : {"", "0", "1,x", "1,,2", "1,2,", "-1", "1.5", "99999999999", ","}) {
    CAPTURE(bad);
    try {
      parse_world_list(bad, "--nproc");
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::usage);
      CHECK(std::string(e.what()).find("--nproc") != std::string::npos);
    }
  }
  CHECK_THROWS_WITH_AS(parse_world_list("1,2,1", "--nnodes"), doctest::Contains("listed twice"),
                       Error);
  // --nnodes counts hosts, --nproc ranks: each says which.
  CHECK_THROWS_WITH_AS(parse_world_list("0", "--nnodes"),
                       "--nnodes 0: '0' is not a number of hosts (a list of positive integers, "
                       "e.g. 1,2,4)",
                       Error);
  CHECK_THROWS_WITH_AS(parse_world_list("0", "--nproc"),
                       "--nproc 0: '0' is not a world size (a list of positive integers, e.g. "
                       "1,2,4)",
                       Error);
}

TEST_CASE("default host counts double up to every host") {
  CHECK(default_node_counts(1) == std::vector<int>{1});
  CHECK(default_node_counts(2) == std::vector<int>{1, 2});
  CHECK(default_node_counts(3) == std::vector<int>{1, 2, 3});
  CHECK(default_node_counts(6) == std::vector<int>{1, 2, 4, 6});
  CHECK(default_node_counts(8) == std::vector<int>{1, 2, 4, 8});
}

TEST_CASE("the benchmark recipe times only training") {
  const Recipe base = small_recipe();
  BenchTrainOptions o;
  o.steps = 20;
  const Recipe r = bench_recipe(base, 2, 1, o);
  CHECK(r.train.steps == 20);
  CHECK(r.checkpoint.every == 0);
  CHECK(r.eval.every == 0);
  CHECK(r.distributed.check_every == 0);
  CHECK(r.log.every == 20);                  // at most the steps
  CHECK(r.optimizer.schedule.warmup == 20);  // fits the run
  CHECK(r.train.batch_per_rank == 12);       // weak scaling: unchanged
  CHECK(r.eval.max_samples == 2 * 12 * 2);   // one global batch of the final evaluation
  CHECK(r.model == base.model);
  // Still a valid recipe.
  CHECK(parse_recipe(to_json(r), "bench", ".") == r);

  o.steps = 500;
  CHECK(bench_recipe(base, 1, 1, o).log.every == 100);
  CHECK(bench_recipe(base, 1, 1, o).optimizer.schedule.warmup == 30);
}

TEST_CASE("strong scaling keeps the smallest world's global batch or names the world") {
  const Recipe base = small_recipe();  // batch_per_rank 12, grad_accum 2
  BenchTrainOptions o;
  o.scaling = BatchScaling::strong;
  CHECK(bench_recipe(base, 1, 1, o).train.batch_per_rank == 12);
  CHECK(bench_recipe(base, 2, 1, o).train.batch_per_rank == 6);
  CHECK(bench_recipe(base, 4, 1, o).train.batch_per_rank == 3);
  CHECK(bench_recipe(base, 12, 1, o).train.batch_per_rank == 1);
  CHECK(global_batch(bench_recipe(base, 4, 1, o), 4) == global_batch(base, 1));
  CHECK(bench_recipe(base, 4, 2, o).train.batch_per_rank == 6);  // base world 2: 24 per micro
  CHECK(bench_recipe(base, 4, 1, o).train.grad_accum == 2);
  for (int world : {5, 8, 24}) {
    CAPTURE(world);
    try {
      bench_recipe(base, world, 1, o);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::usage);
      CHECK(std::string(e.what()).find("--strong: world size " + std::to_string(world)) !=
            std::string::npos);
    }
  }
}

TEST_CASE("with parameter servers, batches and efficiency are the worker ranks'") {
  Recipe base = small_recipe();  // batch_per_rank 12, grad_accum 2
  base.distributed.sync = "ps";
  base.distributed.servers = 1;
  BenchTrainOptions o;
  o.scaling = BatchScaling::strong;
  // World 2 is 1 worker: its global batch of 24 over 2 workers (world 3), 4 (world 5).
  CHECK(bench_recipe(base, 3, 2, o).train.batch_per_rank == 6);
  CHECK(bench_recipe(base, 5, 2, o).train.batch_per_rank == 3);
  CHECK(global_batch(bench_recipe(base, 5, 2, o), 5) == global_batch(base, 2));
  // No worker at all, in the measured world or in the base one: the recipe's problem, named.
  for (const auto& [world, base_world] : {std::pair{1, 1}, std::pair{3, 1}}) {
    CAPTURE(world);
    try {
      bench_recipe(base, world, base_world, o);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::recipe);
      CHECK(std::string(e.what()) ==
            "/distributed/servers: 1 parameter server(s) leave no worker among 1 rank(s); the "
            "servers are the last ranks, the workers the others");
    }
  }
  // Efficiency per worker: 2 workers at twice 1 worker's throughput is linear.
  std::vector<BenchTrainRow> rows(2);
  rows[0].world = 2;
  rows[0].workers = 1;
  rows[0].samples_per_s = 1000;
  rows[1].world = 3;
  rows[1].workers = 2;
  rows[1].samples_per_s = 2000;
  fill_efficiency(rows);
  CHECK(rows[1].efficiency == doctest::Approx(1.0));
  CHECK(rows[1].to_json()["workers"] == 2);
}

TEST_CASE("scaling efficiency is throughput per rank against the smallest world") {
  CHECK(scaling_efficiency(1000, 1, 1000, 1) == 1.0);
  CHECK(scaling_efficiency(2000, 2, 1000, 1) == 1.0);
  CHECK(scaling_efficiency(1500, 2, 1000, 1) == doctest::Approx(0.75));
  CHECK(scaling_efficiency(1000, 4, 1000, 1) == doctest::Approx(0.25));
  CHECK(scaling_efficiency(3000, 4, 2000, 2) == doctest::Approx(0.75));  // base world 2
  CHECK(scaling_efficiency(1000, 2, 0, 1) == 0);
}

TEST_CASE("median of odd and even counts") {
  CHECK(median({3}) == 3);
  CHECK(median({5, 1, 3}) == 3);
  CHECK(median({4, 1, 3, 2}) == 2.5);
  CHECK_THROWS_AS(median({}), Error);
}

TEST_CASE("a row takes the median of every field over repeats") {
  const BenchTrainRow row =
      row_from_results({result(900, 0.3, 30, 3, 1, 100, "a"), result(1000, 0.1, 10, 1, 3, 120, "b"),
                        result(1100, 0.2, 20, 2, 2, 110, "c")},
                       2, 32, 64);
  CHECK(row.world == 2);
  CHECK(row.batch_per_rank == 32);
  CHECK(row.global_batch == 64);
  CHECK(row.samples_per_s == 1000);
  CHECK(row.step_ms == doctest::Approx(64.0));  // 1000 ms x 64 samples / 1000 samples/s
  CHECK(row.phases_ms[0] == doctest::Approx(0.2));
  CHECK(row.phases_ms[1] == 20);
  CHECK(row.phases_ms[2] == 2);
  CHECK(row.phases_ms[3] == 2);
  CHECK(row.peak_rss_mib == 110);
  CHECK(row.tokens_per_s == 0);
  CHECK_FALSE(row.mfu.has_value());
  CHECK(row.run_dirs == std::vector<std::string>{"a", "b", "c"});
  // Of two runs, each field's median on its own: the step time's is the mean of the two runs'
  // step times, not the step time of the mean throughput.
  const BenchTrainRow two = row_from_results(
      {result(1000, 0.3, 30, 3, 1, 100, "a"), result(3000, 0.1, 10, 1, 3, 120, "b")}, 2, 32, 64);
  CHECK(two.samples_per_s == 2000);
  CHECK(two.step_ms == doctest::Approx((64.0 + 64.0 / 3) / 2));

  json with_tokens = result(10, 1, 1, 1, 1, 1);
  with_tokens["tokens_per_s"] = 1280.0;
  CHECK(row_from_results({with_tokens}, 1, 1, 1).tokens_per_s == 1280);

  CHECK_THROWS_WITH_AS(row_from_results({result(0, 1, 1, 1, 1, 1)}, 4, 1, 4),
                       doctest::Contains("world size 4"), Error);
  CHECK_THROWS_AS(row_from_results({}, 1, 1, 1), Error);
}

TEST_CASE("efficiency of the first row is exactly 1") {
  std::vector<BenchTrainRow> rows = {row_from_results({result(1234.5, 1, 1, 1, 1, 1)}, 1, 8, 8),
                                     row_from_results({result(2000, 1, 1, 1, 1, 1)}, 2, 8, 16),
                                     row_from_results({result(3000, 1, 1, 1, 1, 1)}, 4, 8, 32)};
  fill_efficiency(rows);
  CHECK(rows[0].efficiency == 1.0);
  CHECK(rows[1].efficiency == doctest::Approx(2000.0 / (2 * 1234.5)));
  CHECK(rows[2].efficiency == doctest::Approx(3000.0 / (4 * 1234.5)));
}

TEST_CASE("the CPU model comes from /proc/cpuinfo") {
  CHECK(cpu_model_from_cpuinfo("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) "
                               "Xeon(R) Gold 6248 CPU @ 2.50GHz\nmodel name\t: other\n") ==
        "Intel(R) Xeon(R) Gold 6248 CPU @ 2.50GHz");
  CHECK(cpu_model_from_cpuinfo("processor\t: 0\nCPU part\t: 0xd0c\n") == "0xd0c");
  CHECK(cpu_model_from_cpuinfo("") == "unknown CPU");
  const MachineInfo m = local_machine("gloo", 2);
  CHECK(m.cpus >= 1);
  CHECK_FALSE(m.cpu_model.empty());
  CHECK(m.device == "cpu");
  CHECK(m.threads_per_rank == 2);
}

TEST_CASE("the JSON report has one object per row with every field") {
  const json j = report_with_rows(false).to_json();
  CHECK(j["benchmark"] == "train");
  CHECK(j["recipe"] == "small");
  CHECK(j["steps"] == 20);
  CHECK(j["scaling"] == "weak");
  CHECK(j["throughput_unit"] == "samples/s");
  CHECK(j["baseline_world"] == 1);
  CHECK(j["machine"]["cpus"] == 8);
  CHECK(j["machine"]["device"] == "cpu");
  REQUIRE(j["rows"].size() == 2);
  const json& r = j["rows"][1];
  CHECK(r["world"] == 2);
  CHECK(r["global_batch"] == 128);
  CHECK(r["samples_per_s"] == 1500.0);
  CHECK(r["step_ms"].get<double>() == doctest::Approx(1000.0 * 128 / 1500));
  CHECK(r["phases_ms"]["comm"] == 20.0);
  CHECK(r["phases_ms"]["compute"] == 40.0);
  CHECK(r["efficiency"].get<double>() == doctest::Approx(0.75));
  CHECK(r["mfu"].is_null());
  CHECK(r["peak_rss_mib"] == 95.0);
  CHECK_FALSE(r.contains("tokens_per_s"));
  CHECK(j["rows"][0]["efficiency"] == 1.0);

  const json t = report_with_rows(true).to_json();
  CHECK(t["throughput_unit"] == "tokens/s");
  CHECK(t["rows"][1]["tokens_per_s"] == 192000.0);
}

TEST_CASE("the table names recipe, steps, machine, scaling, and has one line per world") {
  BenchTrainReport report = report_with_rows(false);
  report.notes.push_back("a note");
  const std::string table = report.table();
  CAPTURE(table);
  CHECK(table.find("recipe small (recipes/small.json), 20 steps per run") != std::string::npos);
  CHECK(table.find("8 CPUs (Test CPU <fast> & cheap)") != std::string::npos);
  CHECK(table.find("# weak scaling: batch_per_rank 64 stays") != std::string::npos);
  CHECK(table.find("throughput(W) / (W x throughput(1))") != std::string::npos);
  CHECK(table.find("# MFU: n/a (CPU)") != std::string::npos);
  CHECK(table.find("# note: a note") != std::string::npos);
  CHECK(table.find("samples/s") != std::string::npos);
  CHECK(table.find("fwd+bwd") != std::string::npos);
  // Header lines start with '#'; the two rows follow, world first and peak MiB last.
  std::vector<std::string> rows;
  std::istringstream in(table);
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] != '#') rows.push_back(line);
  REQUIRE(rows.size() == 2);
  std::istringstream second(rows[1]);
  std::vector<std::string> cells;
  for (std::string cell; second >> cell;)
    cells.push_back(cell);
  REQUIRE(cells.size() == 10);
  CHECK(cells[0] == "2");       // world
  CHECK(cells[1] == "128");     // global batch
  CHECK(cells[2] == "1500.0");  // samples/s
  CHECK(cells[4] == "0.10");    // data
  CHECK(cells[6] == "20.00");   // comm
  CHECK(cells[8] == "75.0");    // efficiency %
  CHECK(cells[9] == "95.0");    // peak MiB
  CHECK(rows[0].find("100.0") != std::string::npos);

  BenchTrainReport tokens = report_with_rows(true);
  tokens.options.scaling = BatchScaling::strong;
  const std::string t = tokens.table();
  CHECK(t.find("tokens/s") != std::string::npos);
  CHECK(t.find("192000.0") != std::string::npos);
  CHECK(t.find("# strong scaling: the global batch stays 64") != std::string::npos);

  BenchTrainReport gpu = report_with_rows(false);
  gpu.machine.device = "cuda";
  gpu.rows[0].mfu = 0.42;
  gpu.rows[1].mfu = 0.40;
  const std::string g = gpu.table();
  CHECK(g.find("MFU: n/a") == std::string::npos);
  CHECK(g.find("42.0") != std::string::npos);
}

TEST_CASE("the chart has the measured series and the ideal linear one") {
  const std::string svg = report_with_rows(false).svg();
  CHECK(svg.rfind("<svg", 0) == 0);
  CHECK(svg.find("</svg>") != std::string::npos);
  CHECK(svg.find("measured") != std::string::npos);
  CHECK(svg.find("ideal (linear scaling)") != std::string::npos);
  CHECK(svg.find("stroke-dasharray") != std::string::npos);
}

TEST_CASE("the sweep runs every world and repeat in order and reports medians") {
  const Recipe recipe = small_recipe();
  std::vector<std::string> labels;
  std::vector<int64_t> batches;
  const BenchRunner fake = [&](const Recipe& r, const BenchWorld& w, const std::string& label) {
    labels.push_back(label);
    batches.push_back(r.train.batch_per_rank);
    CHECK(r.train.steps == 10);
    // World 1 runs at 100 samples/s per repeat index; world 2 at 150, 170, 160.
    const double rate = w.world == 1 ? 100.0 * static_cast<double>(labels.size())
                                     : 150.0 + 10.0 * static_cast<double>(labels.size() % 3);
    return result(rate, 1, 2, 3, 4, 5, label);
  };
  BenchTrainReport report;
  report.options.steps = 10;
  report.options.repeats = 3;
  std::vector<std::string> progress;
  run_bench_train(
      recipe, {{1, {}}, {2, {}}}, fake, [&](const std::string& line) { progress.push_back(line); },
      report);
  CHECK(labels == std::vector<std::string>{"w1-r1", "w1-r2", "w1-r3", "w2-r1", "w2-r2", "w2-r3"});
  CHECK(batches == std::vector<int64_t>(6, 12));
  REQUIRE(report.rows.size() == 2);
  CHECK(report.rows[0].samples_per_s == 200);  // median of 100, 200, 300
  CHECK(report.rows[1].samples_per_s == 160);  // median of 160, 170, 150
  CHECK(report.rows[0].efficiency == 1.0);
  CHECK(report.rows[1].efficiency == doctest::Approx(160.0 / 400.0));
  CHECK(report.rows[1].run_dirs.size() == 3);
  CHECK_FALSE(report.tokens);
  // A start line, one per run, one per world measured.
  CHECK(progress.size() == 1 + 6 + 2);
  CHECK(progress[1].find("world 1 (run 1 of 6)") != std::string::npos);
  CHECK(progress.back().find("world 2: 160.0 samples/s") != std::string::npos);
}

TEST_CASE("a strong-scaling refusal comes before any run; a failed run stops the sweep") {
  const Recipe recipe = small_recipe();
  int runs = 0;
  const BenchRunner counting = [&](const Recipe&, const BenchWorld&, const std::string&) {
    ++runs;
    return result(100, 1, 1, 1, 1, 1);
  };
  BenchTrainReport report;
  report.options.scaling = BatchScaling::strong;
  CHECK_THROWS_WITH_AS(
      run_bench_train(
          recipe, {{1, {}}, {2, {}}, {5, {}}}, counting, [](const std::string&) {}, report),
      doctest::Contains("world size 5"), Error);
  CHECK(runs == 0);

  BenchTrainReport weak;
  const BenchRunner failing = [&](const Recipe&, const BenchWorld& w, const std::string&) {
    ++runs;
    if (w.world == 2) throw Error(ErrorKind::rank_failed, "rank 1 exited with code 7");
    return result(100, 1, 1, 1, 1, 1);
  };
  try {
    run_bench_train(
        recipe, {{1, {}}, {2, {}}, {4, {}}}, failing, [](const std::string&) {}, weak);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::rank_failed);
  }
  CHECK(runs == 2);  // world 4 never started
}

TEST_CASE("a world whose global batch the data cannot hold is refused, naming it") {
  const Recipe recipe = small_recipe();  // 360 training samples, 24 per rank and step
  BenchTrainOptions o;
  CHECK_NOTHROW(check_bench_worlds(recipe, {{1, {}}, {15, {}}}, o, "--nproc", "recipe.json"));
  try {
    check_bench_worlds(recipe, {{1, {}}, {2, {}}, {16, {}}}, o, "--nproc", "recipe.json");
    FAIL("accepted");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::recipe);
    CHECK(std::string(e.what()).rfind("--nproc: world size 16: ", 0) == 0);
  }
  o.scaling = BatchScaling::strong;
  CHECK_THROWS_WITH_AS(check_bench_worlds(recipe, {{1, {}}, {7, {}}}, o, "--nproc", "recipe.json"),
                       doctest::Contains("--strong: world size 7"), Error);
}

TEST_CASE("the sweep directory is fresh: given and empty, or new under the runs root") {
  test::TempDir tmp;
  const fs::path a = create_sweep_dir("", tmp.path());
  const fs::path b = create_sweep_dir("", tmp.path());
  CHECK(a != b);
  CHECK(a.filename().string().rfind("bench-train-", 0) == 0);
  CHECK(fs::is_directory(a));
  CHECK(fs::is_directory(create_sweep_dir(tmp / "given", "unused")));
  CHECK(fs::is_directory(create_sweep_dir(tmp / "given", "unused")));  // still empty
  std::ofstream(tmp / "given" / "file") << "x";
  CHECK_THROWS_WITH_AS(create_sweep_dir(tmp / "given", "unused"),
                       doctest::Contains("not an empty directory"), Error);
}

TEST_CASE("a precision list keeps its order, each of fp32, bf16, fp16 once") {
  CHECK(parse_precision_list("bf16,fp32", "--precision") ==
        std::vector<std::string>{"bf16", "fp32"});
  CHECK(parse_precision_list("fp32", "--precision") == std::vector<std::string>{"fp32"});
  CHECK(parse_precision_list(" fp16 , bf16,fp32", "--precision") ==
        std::vector<std::string>{"fp16", "bf16", "fp32"});
  for (const char* bad : {"", ",", "bf16,", "fp8", "BF16", "bf16,,fp32", "fp32;bf16", "tf32"}) {
    CAPTURE(bad);
    try {
      parse_precision_list(bad, "--precision");
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::usage);
      CHECK(std::string(e.what()).rfind("--precision", 0) == 0);
    }
  }
  CHECK_THROWS_WITH_AS(parse_precision_list("bf16,fp32,bf16", "--precision"),
                       doctest::Contains("bf16 is listed twice"), Error);
}

TEST_CASE("--device and --precision override the recipe, which is validated again") {
  const Recipe base = small_recipe();
  const Recipe cuda = with_device_and_precision(base, "cuda", "bf16", "small.json with flags");
  CHECK(cuda.train.device == "cuda");
  CHECK(cuda.train.precision == "bf16");
  CHECK(cuda.model == base.model);
  CHECK(with_device_and_precision(base, "cuda", "fp16", "s").train.precision == "fp16");
  CHECK(with_device_and_precision(base, "cpu", "fp32", "s") == base);
  for (const char* precision : {"bf16", "fp16"}) {
    CAPTURE(precision);
    try {
      with_device_and_precision(base, "cpu", precision, "small.json with --precision x");
      FAIL("accepted");
    } catch (const Error& e) {
      const std::string what = e.what();
      CHECK(e.kind() == ErrorKind::recipe);
      CHECK(what.find('\n') == std::string::npos);  // one line
      CHECK(what.rfind("small.json with --precision x: /train/precision: ", 0) == 0);
      CHECK(what.find("needs /train/device \"cuda\"") != std::string::npos);
    }
  }
  // The recipe's other device rules hold too: nccl needs cuda.
  Recipe nccl = with_device_and_precision(base, "cuda", "fp32", "s");
  nccl.distributed.backend = "nccl";
  CHECK_THROWS_WITH_AS(with_device_and_precision(nccl, "cpu", "fp32", "s"),
                       doctest::Contains("/distributed/backend"), Error);
}

TEST_CASE("MFU is throughput x model FLOPs over world x peak") {
  // GPT-2 small (803,261,952 FLOPs a token) at 492,492 tokens/s on one 989 TFLOP/s GPU: 40%.
  const double per_token = 803261952.0;
  CHECK(*model_flops_utilization(492492, per_token, 1, 989) == doctest::Approx(0.4).epsilon(1e-5));
  // The same tokens/s over two devices is half the utilisation.
  CHECK(*model_flops_utilization(492492, per_token, 2, 989) == doctest::Approx(0.2).epsilon(1e-5));
  CHECK(*model_flops_utilization(1000, 1e9, 1, 1) == doctest::Approx(1.0));  // 1e12 / 1e12
  CHECK(*model_flops_utilization(0, 1e9, 1, 1) == 0);
  CHECK_FALSE(model_flops_utilization(1000, 1e9, 1, 0).has_value());
  CHECK_FALSE(model_flops_utilization(1000, 0, 1, 989).has_value());
  CHECK_FALSE(model_flops_utilization(1000, 1e9, 0, 989).has_value());
}

TEST_CASE("a precision sweep runs each precision over every world, with MFU and the ratio") {
  const Recipe recipe = small_recipe();  // mlp 8-8-3: 6 x (64 + 24) = 528 FLOPs a sample
  std::vector<std::string> labels, precisions;
  const BenchRunner fake = [&](const Recipe& r, const BenchWorld& w, const std::string& label) {
    labels.push_back(label);
    precisions.push_back(r.train.precision);
    // bf16 is 2.5x fp32's 1000 samples/s per rank; world 2 scales perfectly.
    const double rate = (r.train.precision == "bf16" ? 2500.0 : 1000.0) * w.world;
    return result(rate, 1, 2, 3, 4, 5, label);
  };
  BenchTrainReport report;
  report.options.steps = 10;
  report.options.precisions = {"bf16", "fp32"};
  report.peak_tflops = 1e-6;  // 1 MFLOP/s: MFU = samples/s x 528 / (world x 1e6)
  report.peak_source = "--peak-tflops";
  std::vector<std::string> progress;
  run_bench_train(
      recipe, {{1, {}}, {2, {}}}, fake, [&](const std::string& line) { progress.push_back(line); },
      report);
  CHECK(labels == std::vector<std::string>{"w1-bf16", "w2-bf16", "w1-fp32", "w2-fp32"});
  CHECK(precisions == std::vector<std::string>{"bf16", "bf16", "fp32", "fp32"});
  CHECK(report.precisions == std::vector<std::string>{"bf16", "fp32"});
  CHECK(report.flops_per_unit == 528);
  REQUIRE(report.rows.size() == 4);
  CHECK(report.rows[0].precision == "bf16");
  CHECK(report.rows[3].precision == "fp32");
  for (const auto& row : report.rows) {
    CAPTURE(row.precision);
    CAPTURE(row.world);
    CHECK(row.efficiency == doctest::Approx(1.0));  // each precision against its own world 1
    REQUIRE(row.mfu.has_value());
    CHECK(*row.mfu == doctest::Approx(row.samples_per_s * 528 / (row.world * 1e6)));
  }
  CHECK(*report.rows[2].mfu == doctest::Approx(0.528));  // fp32 world 1: 1000 x 528 / 1e6
  const auto ratios = report.precision_ratios();
  REQUIRE(ratios.size() == 2);
  CHECK(ratios[0].world == 1);
  CHECK(ratios[0].precision == "bf16");
  CHECK(ratios[0].baseline == "fp32");
  CHECK(ratios[0].ratio == doctest::Approx(2.5));
  CHECK(ratios[1].world == 2);
  CHECK(progress[1].find("bench train: bf16 world 1 (run 1 of 4)") != std::string::npos);
  // bf16 world 1: 2500 x 528 / 1e6, over 100%: the peak is too low, a note (once) says so.
  CHECK(progress[2].find("MFU 132.0%") == std::string::npos);
  CHECK(progress[2].starts_with("bench train: note: MFU above 100% (132.0% at world 1)"));
  CHECK(progress[3].find("MFU 132.0%") != std::string::npos);
  CHECK(std::count_if(progress.begin(), progress.end(), [](const std::string& line) {
          return line.find("MFU above 100%") != std::string::npos;
        }) == 1);
  REQUIRE(report.notes.size() == 1);

  const json j = report.to_json();
  CHECK(j["precisions"] == json({"bf16", "fp32"}));
  REQUIRE(j["precision_ratios"].size() == 2);
  CHECK(j["precision_ratios"][0]["ratio"].get<double>() == doctest::Approx(2.5));
  CHECK(j["precision_ratios"][0]["baseline"] == "fp32");
  CHECK(j["mfu_basis"]["peak_tflops"] == 1e-6);
  CHECK(j["mfu_basis"]["flops_per_sample"] == 528.0);
  CHECK(j["rows"][0]["precision"] == "bf16");
  CHECK(j["rows"][2]["mfu"].get<double>() == doctest::Approx(0.528));

  const std::string table = report.table();
  CAPTURE(table);
  CHECK(table.find("# precision: bf16, fp32: one sweep each") != std::string::npos);
  CHECK(table.find("# MFU: samples/s x model FLOPs / (world x peak); peak 1e-06 TFLOP/s per "
                   "device (--peak-tflops)") != std::string::npos);
  CHECK(table.find("# model FLOPs: 6 x weights per sample (88 weights)") != std::string::npos);
  CHECK(table.find("# bf16 / fp32 throughput: 2.50x (world 1)") != std::string::npos);
  CHECK(table.find("# bf16 / fp32 throughput: 2.50x (world 2)") != std::string::npos);
  std::vector<std::string> rows;
  std::istringstream in(table);
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] != '#') rows.push_back(line);
  REQUIRE(rows.size() == 4);
  std::istringstream first(rows[0]);
  std::vector<std::string> cells;
  for (std::string cell; first >> cell;)
    cells.push_back(cell);
  REQUIRE(cells.size() == 12);  // precision, world, ... MFU, peak
  CHECK(cells[0] == "bf16");
  CHECK(cells[1] == "1");
  CHECK(cells[10] == "132.0%");

  // The SVG has a measured and an ideal line per precision.
  const std::string svg = report.svg();
  CHECK(svg.find("bf16 ideal (linear scaling)") != std::string::npos);
  CHECK(svg.find("fp32 ideal (linear scaling)") != std::string::npos);
}

TEST_CASE(
    "with a peak, a row without MFU shows n/a; without fp32 the first precision is the base") {
  BenchTrainReport report = report_with_rows(false);
  report.machine.device = "cuda";
  report.peak_tflops = 989;
  report.peak_source = "H100/H200 dense bf16";
  report.rows[0].mfu = 0.412;
  const std::string t = report.table();
  CAPTURE(t);
  CHECK(t.find("41.2%") != std::string::npos);
  CHECK(t.find("n/a") != std::string::npos);  // row 2
  CHECK(t.find("peak 989 TFLOP/s per device (H100/H200 dense bf16)") != std::string::npos);
  CHECK(t.find("throughput:") == std::string::npos);  // one precision: no ratio
  CHECK(report.precision_ratios().empty());

  BenchTrainReport halves = report_with_rows(false);
  halves.rows[0].precision = "fp16";
  halves.rows[1].precision = "bf16";
  halves.rows[1].world = 1;
  halves.precisions = {"fp16", "bf16"};
  const auto ratios = halves.precision_ratios();
  REQUIRE(ratios.size() == 1);
  CHECK(ratios[0].precision == "bf16");
  CHECK(ratios[0].baseline == "fp16");
  CHECK(ratios[0].ratio == doctest::Approx(1.5));
}

TEST_CASE("thresholds: each shortfall is one line naming precision, world, figure and option") {
  // World 1: 1000 samples/s; world 2: 1500 (efficiency 0.75).
  BenchTrainReport report = report_with_rows(false);
  CHECK(report.shortfalls({}).empty());
  BenchThresholds min;
  min.efficiency = 0.8;
  min.throughput = 1400;  // the largest world's 1500 passes; world 1's 1000 is not checked
  CHECK(report.shortfalls(min) ==
        std::vector<std::string>{"fp32 at world 2: scaling efficiency 0.75 is below "
                                 "--min-efficiency 0.8"});
  min.efficiency = 0.75;
  min.throughput = 2000;
  CHECK(report.shortfalls(min) ==
        std::vector<std::string>{"fp32 at world 2: 1500 samples/s is below --min-throughput 2000"});
  // Token models are judged in tokens/s; MFU on the largest world, as a percentage.
  BenchTrainReport tokens = report_with_rows(true);
  tokens.rows.back().mfu = 0.395;
  BenchThresholds lm;
  lm.throughput = 192000;
  lm.mfu_percent = 40;
  CHECK(tokens.shortfalls(lm) ==
        std::vector<std::string>{"fp32 at world 2: MFU 39.5% is below --min-mfu 40%"});
  // Small figures keep their digits: a 0.00 or a 0 would say nothing of what was measured.
  BenchTrainReport slow = report_with_rows(false);
  slow.rows.back().efficiency = 0.00497;
  slow.rows.back().samples_per_s = 0.25;
  BenchThresholds strict;
  strict.efficiency = 0.05;
  strict.throughput = 1;
  CHECK(slow.shortfalls(strict) ==
        std::vector<std::string>{
            "fp32 at world 2: scaling efficiency 0.00497 is below --min-efficiency 0.05",
            "fp32 at world 2: 0.25 samples/s is below --min-throughput 1"});
  tokens.rows.back().mfu = 0.000412;
  CHECK(tokens.shortfalls(lm) ==
        std::vector<std::string>{"fp32 at world 2: MFU 0.0412% is below --min-mfu 40%"});
  // Every precision's largest world is checked.
  BenchTrainReport two = report_with_rows(false);
  for (BenchTrainRow row : report_with_rows(false).rows) {
    row.precision = "bf16";
    row.samples_per_s *= 3;
    two.rows.push_back(row);
  }
  BenchThresholds fast;
  fast.throughput = 3000;
  CHECK(two.shortfalls(fast) ==
        std::vector<std::string>{"fp32 at world 2: 1500 samples/s is below --min-throughput 3000"});
}
