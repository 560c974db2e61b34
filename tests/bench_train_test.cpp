// `dptrain bench train` end to end: real runs per world size, the JSON rows, the chart, the
// table, MFU and precision overrides, and every refusal before a run (bad lists, --strong, data
// too small, bf16 on the CPU, cuda without a GPU) or after (exit 3).
#include <doctest/doctest.h>

#include <sys/stat.h>

#include <algorithm>
#include <csignal>
#include <sstream>
#include <thread>

#include "core/tensor/device.hpp"
#include "tests/harness.hpp"
#include "tests/strings.hpp"

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

// stderr holds exactly one line, the error, and it starts as main prints errors.
bool one_error_line(const std::string& err) {
  return err.rfind("dptrain: error: ", 0) == 0 && std::count(err.begin(), err.end(), '\n') == 1;
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
  CHECK(j["machine"]["backend"] == "gloo");  // the recipe's "auto", as CPU ranks resolve it
  // 20 steps are enough (dptrain-bench-train(1)): no note says otherwise.
  for (const auto& note : j["notes"])
    CHECK_FALSE(note.get<std::string>().starts_with("--steps "));
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
    for (const char* phase : {"data", "compute", "optimizer"}) {
      CAPTURE(phase);
      CHECK(row["phases_ms"][phase].get<double>() > 0);
    }
    // One rank communicates nothing, and waits for nothing.
    if (world == 1) CHECK(row["phases_ms"]["comm"].get<double>() == 0.0);
    if (world > 1) CHECK(row["phases_ms"]["comm"].get<double>() > 0);
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
    // ... and names none: its result and run.json say so, as status does.
    CHECK(parse_json(read_text(run / "result.json"))["last_checkpoint"].is_null());
    const json info = parse_json(read_text(run / "run.json"));
    CHECK_FALSE(info.contains("last_checkpoint"));
    CHECK(info["result"]["last_checkpoint"].is_null());
    CHECK(parse_json(run_dptrain({"status", run.string(), "--json"}).out)["last_checkpoint"]
              .is_null());
    // The run trained exactly --steps, nothing else timed in it.
    const json recipe = parse_json(read_text(run / "recipe.json"));
    CHECK(recipe["train"]["steps"] == 20);
    CHECK(recipe["checkpoint"]["every"] == 0);
    CHECK(recipe["eval"]["every"] == 0);
  }
  CHECK(j["rows"][0]["efficiency"].get<double>() == 1.0);
  // The sweep's report is kept beside its runs.
  const fs::path sweep = j["run_dir"].get<std::string>();
  const json kept = parse_json(read_text(sweep / "bench.json"));
  CHECK(kept["rows"] == j["rows"]);
  // A report of one of its runs does not replace the sweep's files.
  const auto over =
      run_dptrain({"report", (sweep / "w1").string(), "--out", (sweep / "bench.json").string()});
  CHECK(over.exit_code == 2);
  CHECK(contains(over.err, "inside the bench train sweep " + sweep.string()));
  CHECK(parse_json(read_text(sweep / "bench.json")) == kept);
  // status and report read one run: given the sweep, they name its runs.
  for (const char* command : {"status", "report"}) {
    CAPTURE(command);
    const auto sweep_given = run_dptrain({command, sweep.string()});
    CHECK(sweep_given.exit_code == 2);
    CHECK(sweep_given.err == "dptrain: error: " + sweep.string() +
                                 ": a bench train sweep, not a run directory: its results are in " +
                                 (sweep / "bench.json").string() +
                                 "; give one of its runs (w1, w2)\n");
  }
  CHECK_FALSE(fs::exists(sweep / "report.html"));
  // Before its bench.json is written (the sweep still runs, or its first run failed), likewise.
  fs::rename(sweep / "bench.json", tmp / "bench.json.kept");
  const auto unfinished = run_dptrain({"status", sweep.string(), "--json"});
  fs::rename(tmp / "bench.json.kept", sweep / "bench.json");
  CHECK(unfinished.exit_code == 2);
  CHECK(parse_json(unfinished.out)["error"] ==
        sweep.string() +
            ": a bench train sweep, not a run directory: it has no bench.json yet (still running, "
            "or stopped in its first run); give one of its runs (w1, w2)");
  // A copy of the sweep's result kept elsewhere is no sweep.
  fs::create_directories(tmp / "results");
  write_text(tmp / "results/bench.json", r.out);
  CHECK(
      run_dptrain({"report", (sweep / "w1").string(), "--out", (tmp / "results/w1.html").string()})
          .exit_code == 0);

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

TEST_CASE("bench train on a terminal shows the running world's progress in place") {
  TempDir tmp;
  const auto r = run_dptrain_on_terminal({"bench", "train", quickstart(), "--nproc", "1,2",
                                          "--steps", "20", "--runs-root", (tmp / "runs").string()});
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  // Each run's steps, rewritten in place on the line below the run's own line...
  CHECK(r.out.find("\r\033[Kbench train: w1: step 20/20 ") != std::string::npos);
  CHECK(r.out.find("\r\033[Kbench train: w2: step 20/20 ") != std::string::npos);
  // ...and replaced by the run's result line.
  CHECK(r.out.find("\r\033[Kbench train: world 2: ") != std::string::npos);
  // On a narrow terminal each progress line is cut short of its width: a wrapped line would
  // leave a row behind at every update ("\r\033[K" clears only the last row).
  const auto narrow =
      run_dptrain_on_terminal({"bench", "train", quickstart(), "--nproc", "1", "--steps", "20",
                               "--runs-root", (tmp / "runs").string()},
                              {}, std::chrono::seconds(300), 40);
  INFO(narrow.out);
  REQUIRE(narrow.exit_code == 0);
  size_t progress_lines = 0;
  for (size_t at = narrow.out.find("\r\033[Kbench train: w1: step "); at != std::string::npos;
       at = narrow.out.find("\r\033[Kbench train: w1: step ", at + 1)) {
    const size_t start = at + 4;
    const size_t end = narrow.out.find('\r', start);
    CHECK((end == std::string::npos ? narrow.out.size() : end) - start <= 39);
    ++progress_lines;
  }
  CHECK(progress_lines > 0);
  // A pipe gets the plain lines only (the other tests read stderr through one).
  const auto piped = bench(tmp, {quickstart(), "--nproc", "1", "--steps", "20"});
  REQUIRE(piped.exit_code == 0);
  CHECK(piped.err.find('\033') == std::string::npos);
  CHECK(piped.err.find("step 20/20") == std::string::npos);
  // A terminal that says it cannot move the cursor (TERM=dumb: an editor's shell) gets the
  // plain lines too.
  const auto dumb =
      run_dptrain_on_terminal({"bench", "train", quickstart(), "--nproc", "1", "--steps", "20",
                               "--runs-root", (tmp / "runs").string()},
                              {{"TERM", "dumb"}});
  REQUIRE(dumb.exit_code == 0);
  CHECK(dumb.out.find('\033') == std::string::npos);
  CHECK(dumb.out.find("bench train: world 1: ") != std::string::npos);
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
  // A --runs-root that cannot be made is the caller's to fix, as for launch.
  write_text(tmp / "afile", "x");
  const auto root = run_dptrain({"bench", "train", quickstart(), "--nproc", "1", "--runs-root",
                                 (tmp / "afile/runs").string()});
  CHECK(root.exit_code == 2);
  CHECK_MESSAGE(root.err.find("cannot create the benchmark directory") != std::string::npos,
                root.err);
  fs::remove(tmp / "afile");
  // A --steps too large for a number is named as given, not as what it was clamped to.
  const auto r = bench(tmp, {quickstart(), "--nproc", "1", "--steps", "99999999999999999999"});
  CHECK(r.exit_code == 2);
  CHECK_MESSAGE(r.err.find("--steps: '99999999999999999999' is out of range") != std::string::npos,
                r.err);
  CHECK(nothing_created(tmp));
}

TEST_CASE(
    "an --svg that cannot be replaced by a file exits 2 before any run, and stays as it was") {
  TempDir tmp;
  REQUIRE(::mkfifo((tmp / "fifo").c_str(), 0600) == 0);
  fs::create_directory(tmp / "dir");
  write_text(tmp / "target.svg", "mine");
  fs::create_symlink(tmp / "target.svg", tmp / "link.svg");
  // The recipe benchmarked itself, and a file of a run (its record would be gone).
  fs::copy_file(quickstart(), tmp / "recipe.json");
  fs::create_directory(tmp / "run");
  write_text(tmp / "run/run.json", R"({"status": "completed", "generations": []})");
  write_text(tmp / "run/chart.svg", "<svg></svg>");
  const std::string recipe = read_text(tmp / "recipe.json");
  for (const auto& [name, says] : std::vector<std::pair<std::string, std::string>>{
           {"target.svg", "holds something else than a chart (it does not start with <svg)"},
           {"recipe.json", "holds something else than a chart"},
           {"run/chart.svg", "inside the run directory " + (tmp / "run").string()},
           {"fifo", "is a pipe, not a regular file"},
           {"link.svg", "is a symbolic link, not a regular file"},
           {"dir", "is a directory; name the SVG file to write"},
           {"no/such/chart.svg", "no such directory"},
           {"target.svg/chart.svg", (tmp / "target.svg").string() + " is not a directory"}}) {
    CAPTURE(name);
    auto r = bench(tmp, {(tmp / "recipe.json").string(), "--nproc", "1", "--steps", "2", "--svg",
                         (tmp / name).string()});
    CHECK(r.exit_code == 2);
    CHECK(one_error_line(r.err));
    CHECK_MESSAGE(r.err.find("--svg " + (tmp / name).string() + ": " + says) != std::string::npos,
                  r.err);
    CHECK(nothing_created(tmp));
  }
  CHECK(fs::is_fifo(tmp / "fifo"));
  CHECK(fs::is_symlink(tmp / "link.svg"));
  CHECK(read_text(tmp / "target.svg") == "mine");
  CHECK(read_text(tmp / "recipe.json") == recipe);
  CHECK(read_text(tmp / "run/run.json") == R"({"status": "completed", "generations": []})");
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
  // Data that is not there at all is the recipe's, named by its file, whatever the world size.
  json tokens = small_recipe();
  tokens["model"] = {{"type", "gpt"}, {"vocab", 64}, {"context", 16},
                     {"layers", 1},   {"heads", 2},  {"width", 16}};
  tokens["data"] = {{"type", "tokens"}, {"path", (tmp / "nodata").string()}};
  const fs::path missing = write_recipe(tmp.path(), tokens, "missing.json");
  const auto gone = bench(tmp, {missing.string(), "--nproc", "1,2"});
  CHECK(gone.exit_code == 2);
  CHECK_MESSAGE(gone.err.rfind("dptrain: error: " + missing.string() + ": /data/path: ", 0) == 0,
                gone.err);
  CHECK(gone.err.find("--nproc") == std::string::npos);
  CHECK(nothing_created(tmp));
  // A CSV file's bad rows: each /data/path's, on its line, as recipe validate and launch say.
  std::string rows;
  for (int i = 0; i < 200; ++i)
    rows += std::to_string(i == 50 ? 7 : i % 3) + ",0.5,0.25\n";
  rows += "1,nan,0.5\n";
  write_text(tmp / "d.csv", rows);
  const json csv = {{"model", {{"type", "mlp"}, {"input", 2}, {"hidden", {4}}, {"classes", 3}}},
                    {"data", {{"type", "csv"}, {"path", (tmp / "d.csv").string()}}},
                    {"train", {{"steps", 2}, {"batch_per_rank", 8}}}};
  const fs::path csv_file = write_recipe(tmp.path(), csv, "csv.json");
  const auto bad_rows = bench(tmp, {csv_file.string(), "--nproc", "1"});
  CHECK(bad_rows.exit_code == 2);
  const auto said = lines_of(bad_rows.err);
  REQUIRE(said.size() == 2);
  for (const auto& line : said) {
    CHECK_MESSAGE(line.starts_with("dptrain: error: " + csv_file.string() +
                                   ": /data/path: " + (tmp / "d.csv").string() + ":"),
                  line);
  }
  CHECK(nothing_created(tmp));
}

TEST_CASE("a failed run exits 3 with its error and the world size") {
  TempDir tmp;
  const fs::path file = write_recipe(tmp.path(), small_recipe());
  // Rank 1 exists only at world size 2: world 1 completes, world 2 fails.
  const auto r = bench(
      tmp,
      {file.string(), "--nproc", "1,2", "--steps", "10", "--run-dir", (tmp / "sweep").string()},
      {{"DPTRAIN_FAULT", "exit@step=3,rank=1,code=7"}});
  CHECK(r.exit_code == 3);
  CHECK(r.err.find("the run at world size 2 failed") != std::string::npos);
  CHECK(r.err.find("rank 1") != std::string::npos);
  CHECK(r.err.find("bench train: world 1: ") != std::string::npos);  // measured before
  // The failed run's directory, on a line of its own (not an error of its own).
  CHECK(contains(r.err, "\ndptrain: run directory: "));
  CHECK(contains(r.err, "/w2 (console.log, logs/)\n"));
  CHECK_FALSE(contains(r.err, "error: run directory"));
  // World 1's row is kept, said to be partial: printed, and in SWEEP/bench.json.
  CHECK(contains(r.out, "# Partial: 1 row(s) measured before the end (see the error)\n"));
  const fs::path sweep = tmp / "sweep";
  REQUIRE(fs::exists(sweep / "bench.json"));
  const json kept = parse_json(read_text(sweep / "bench.json"));
  CHECK(kept["partial"] == true);
  CHECK(kept["rows"].size() == 1);
  CHECK(kept["status"] == "failed");

  // With --json: the same object on stdout, a rank's failure as "failed" (as launch says).
  TempDir again;
  const auto j = bench(again,
                       {file.string(), "--nproc", "1,2", "--steps", "10", "--json", "--run-dir",
                        (again / "sweep").string()},
                       {{"DPTRAIN_FAULT", "exit@step=3,rank=1,code=7"}});
  CHECK(j.exit_code == 3);
  const json out = parse_json(j.out);
  CHECK(out["status"] == "failed");
  CHECK(out["exit_code"] == 3);
  CHECK(out["partial"] == true);
  REQUIRE(out["rows"].size() == 1);
  CHECK(out["rows"][0]["world"] == 1);
  CHECK(out["run_dir"] == (again / "sweep").string());
  CHECK(out["failed_run_dir"] == (again / "sweep" / "w2").string());
  CHECK(out["errors"].size() == 1);
  CHECK(contains(out["error"].get<std::string>(), "the run at world size 2 failed"));
}

TEST_CASE("a DPTRAIN_FAULT that fires in no run of the sweep is warned about") {
  TempDir tmp;
  const fs::path file = write_recipe(tmp.path(), small_recipe());
  // Past the runs' --steps (not the recipe's), and on a rank no world size of the sweep has.
  const auto r = bench(tmp, {file.string(), "--nproc", "1", "--steps", "3", "--json"},
                       {{"DPTRAIN_FAULT", "exit@step=5;exit@step=1,rank=1;exit@step=1,gen=2"}});
  INFO(r.err);
  CHECK(r.exit_code == 0);
  // In --json's warnings too, as bench comm has them.
  const json warnings = parse_json(r.out)["warnings"];
  REQUIRE(warnings.size() == 3);
  for (const auto& warning : warnings)
    CHECK(contains(r.err, "dptrain: warning: " + warning.get<std::string>() + "\n"));
  CHECK(contains(r.err,
                 "warning: DPTRAIN_FAULT 'exit@step=5' never fires: step 5 is past the "
                 "run's steps (0 to 2)"));
  CHECK(contains(r.err, "warning: DPTRAIN_FAULT 'exit@step=1,rank=1' never fires"));
  // Nor in a later generation: a benchmark's run has no restart.
  CHECK(contains(r.err,
                 "warning: DPTRAIN_FAULT 'exit@step=1,gen=2' never fires: a benchmark's "
                 "run is generation 1 alone (no restart)"));
}

TEST_CASE("--precision fp32 --peak-tflops 1 on the CPU: every row has an MFU, the JSON says how") {
  TempDir tmp;
  // quickstart: mlp 784-256-256-10, 6 x 268,800 weights = 1,612,800 FLOPs a sample.
  const auto r = bench(tmp, {quickstart(), "--nproc", "1", "--steps", "10", "--precision", "fp32",
                             "--peak-tflops", "1", "--json"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json j = parse_json(r.out);
  CHECK(j["precisions"] == json({"fp32"}));
  CHECK(j["precision_ratios"].empty());
  CHECK(j["mfu_basis"]["peak_tflops"] == 1.0);
  CHECK(j["mfu_basis"]["peak_source"] == "--peak-tflops");
  CHECK(j["mfu_basis"]["flops_per_sample"] == 6.0 * (784 * 256 + 256 * 256 + 256 * 10));
  REQUIRE(j["rows"].size() == 1);
  const json& row = j["rows"][0];
  CHECK(row["precision"] == "fp32");
  REQUIRE(row["mfu"].is_number());
  const double expected =
      row["samples_per_s"].get<double>() * j["mfu_basis"]["flops_per_sample"].get<double>() / 1e12;
  CHECK(row["mfu"].get<double>() == doctest::Approx(expected));
  CHECK(row["mfu"].get<double>() > 0);
  CHECK(r.err.find(", MFU ") != std::string::npos);  // the progress line has it too
}

TEST_CASE("--min-throughput, --min-efficiency and --min-mfu: below one exits 6 naming it") {
  TempDir tmp;
  const auto r = bench(tmp, {quickstart(), "--nproc", "1", "--steps", "10", "--peak-tflops", "1",
                             "--min-throughput", "1234567890123", "--min-mfu", "99.5", "--json"});
  CHECK(r.exit_code == 6);
  const json j = parse_json(r.out);  // the rows still come
  CHECK(j["status"] == "below_threshold");
  CHECK(j["exit_code"] == 6);
  CHECK(j["min_throughput"] == 1234567890123.0);
  // In the rows' units: a fraction, as "mfu" is (the option is in percent).
  CHECK(j["min_mfu"].get<double>() == doctest::Approx(0.995));
  CHECK(j["rows"][0]["mfu"].get<double>() < j["min_mfu"].get<double>());
  REQUIRE(j["errors"].size() == 2);
  CHECK(j["errors"][0].get<std::string>().find("fp32 at world 1: ") == 0);
  // Each threshold as given, not rounded to six digits.
  CHECK(r.err.find(" samples/s is below --min-throughput 1234567890123\n") != std::string::npos);
  CHECK(r.err.find("% is below --min-mfu 99.5%\n") != std::string::npos);
  CHECK(j["rows"].size() == 1);
  // MFU needs a peak: refused before anything runs.
  TempDir none;
  const auto no_peak = bench(none, {quickstart(), "--nproc", "1", "--min-mfu", "10"});
  CHECK(no_peak.exit_code == 2);
  CHECK(no_peak.err.find("--min-mfu: MFU needs a peak") != std::string::npos);
  CHECK(nothing_created(none));
}

TEST_CASE("an MFU above 100% says the peak is wrong") {
  TempDir tmp;
  const auto r =
      bench(tmp, {quickstart(), "--nproc", "1", "--steps", "5", "--peak-tflops", "1e-6", "--json"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json j = parse_json(r.out);
  REQUIRE(j["rows"].size() == 1);
  CHECK(j["rows"][0]["mfu"].get<double>() > 1.0);
  bool noted = false;
  for (const auto& note : j["notes"]) {
    const std::string text = note.get<std::string>();
    noted = noted || (text.starts_with("MFU above 100% (") &&
                      contains(text,
                               " at world 1): the peak of 1e-06 TFLOP/s per device is "
                               "below what it did; give its real peak with --peak-tflops"));
  }
  CHECK(noted);
  // Fewer than 20 steps: said, as the means then carry the first steps' set-up.
  CHECK(std::count(j["notes"].begin(), j["notes"].end(),
                   "--steps 5: the means leave out only the first 1 step(s) (min(10, "
                   "steps/5)), so allocation and the first collectives weigh on them; give "
                   "--steps 20 or more") == 1);
}

TEST_CASE("--peak-tflops on the CPU puts an MFU column in the table") {
  TempDir tmp;
  const auto r = bench(tmp, {quickstart(), "--nproc", "1", "--steps", "5", "--peak-tflops", "0.5"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("# precision: fp32") != std::string::npos);
  CHECK(r.out.find("peak 0.5 TFLOP/s per device (--peak-tflops)") != std::string::npos);
  CHECK(r.out.find("# model FLOPs: 6 x weights per sample") != std::string::npos);
  CHECK(r.out.find("MFU: n/a") == std::string::npos);
  std::vector<std::string> rows;
  std::istringstream in(r.out);
  for (std::string line; std::getline(in, line);)
    if (!line.empty() && line[0] != '#') rows.push_back(line);
  REQUIRE(rows.size() == 1);
  std::istringstream cells(rows[0]);
  std::vector<std::string> cell;
  for (std::string c; cells >> c;)
    cell.push_back(c);
  REQUIRE(cell.size() == 11);
  CHECK(cell[9].back() == '%');  // MFU, before peak MiB
}

TEST_CASE("--precision bf16 on the CPU is the recipe's own error, exit 2, nothing created") {
  TempDir tmp;
  for (const std::string list : {"bf16", "fp32,bf16", "fp16"}) {
    CAPTURE(list);
    const auto r = bench(tmp, {quickstart(), "--nproc", "1", "--precision", list});
    CHECK(r.exit_code == 2);
    CHECK(one_error_line(r.err));
    CHECK(r.err.find("quickstart.json with --precision") != std::string::npos);
    CHECK(r.err.find(": /train/precision: ") != std::string::npos);
    CHECK(r.err.find("needs /train/device \"cuda\"") != std::string::npos);
    CHECK(nothing_created(tmp));
  }
  // --device cpu says the same, naming both options.
  const auto r = bench(tmp, {quickstart(), "--device", "cpu", "--precision", "bf16", "--json"});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("with --device cpu --precision bf16: /train/precision") != std::string::npos);
  CHECK(parse_json(r.out)["exit_code"] == 2);
}

TEST_CASE("--backend nccl on a CPU recipe is the recipe's own error, exit 2, nothing created") {
  TempDir tmp;
  const auto r = bench(tmp, {quickstart(), "--nproc", "1", "--backend", "nccl"});
  CHECK(r.exit_code == 2);
  CHECK(one_error_line(r.err));
  CHECK(r.err.find("quickstart.json with --backend nccl: /distributed/backend: \"nccl\" needs "
                   "/train/device \"cuda\"") != std::string::npos);
  CHECK(nothing_created(tmp));
}

TEST_CASE(
    "a model the largest world's ranks cannot hold in memory: exit 2 as launch, nothing made") {
  TempDir tmp;
  // quickstart's synthetic data and MLP with AdamW take at least 64.2 MiB a rank: 1 rank fits in
  // 97.7 MiB, 2 do not.
  write_text(tmp / "meminfo", "MemTotal: 1000000 kB\nMemAvailable: 100000 kB\n");
  const Env small = {{"DPTRAIN_TEST_MEMINFO", (tmp / "meminfo").string()}};
  const auto r = bench(tmp, {quickstart(), "--nproc", "1,2", "--steps", "2", "--json"}, small);
  CHECK(r.exit_code == 2);
  CHECK(one_error_line(r.err));
  CHECK(r.err.find(quickstart() + ": /data/samples: its 20000 samples of 784 features take 60.0 "
                                  "MiB a rank") != std::string::npos);
  CHECK(r.err.find("128.3 MiB for the 2 rank(s) on this machine") != std::string::npos);
  CHECK(parse_json(r.out)["exit_code"] == 2);
  CHECK(nothing_created(tmp));
}

TEST_CASE("bad --precision, --device, --peak-tflops and --steps values exit 2 naming the option") {
  TempDir tmp;
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      // More steps than any recipe may have: the option's error, not the recipe's.
      {{"--steps", "10000000000000"}, "--steps: "},
      {{"--precision", "fp8"}, "--precision"},
      {{"--precision", "bf16,bf16"}, "--precision"},
      {{"--precision", ""}, "--precision"},
      {{"--device", "gpu"}, "--device gpu"},
      {{"--peak-tflops", "0"}, "--peak-tflops"},
      {{"--peak-tflops", "-5"}, "--peak-tflops"},
      {{"--peak-tflops", "inf"}, "--peak-tflops: 'inf' must be a finite number > 0"},
      {{"--peak-tflops", "1e400"}, "--peak-tflops"},
  };
  for (const auto& [args, named] : cases) {
    CAPTURE(named);
    std::vector<std::string> full = {quickstart()};
    full.insert(full.end(), args.begin(), args.end());
    const auto r = bench(tmp, full);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find(named) != std::string::npos);
    CHECK(nothing_created(tmp));
  }
}

TEST_CASE("--device cuda without a GPU exits 1 before anything starts, naming --device") {
  if (dptrain::cuda_device_count() > 0) {
    MESSAGE("skipped: this machine has a CUDA device (the GPU tests run bench train there)");
    return;
  }
  TempDir tmp;
  const auto r = bench(tmp, {quickstart(), "--nproc", "1,2", "--device", "cuda", "--json"});
  CHECK(r.exit_code == 1);
  CHECK(one_error_line(r.err));
  CHECK(r.err.find("--device cuda (world size 2): 2 rank(s) on this machine need a GPU each") !=
        std::string::npos);
  CHECK((r.err.find("no CUDA device is visible") != std::string::npos ||
         r.err.find("built without CUDA") != std::string::npos));
  CHECK(parse_json(r.out)["exit_code"] == 1);
  CHECK(nothing_created(tmp));

  // bf16 with it passes the recipe's validation and meets the same refusal; without --nproc the
  // sweep is as many ranks as there are GPUs, at least 1.
  const auto bf16 = bench(tmp, {quickstart(), "--device", "cuda", "--precision", "bf16,fp32"});
  CHECK(bf16.exit_code == 1);
  CHECK(bf16.err.find("--device cuda (world size 1): 1 rank(s) on this machine need a GPU each") !=
        std::string::npos);

  // A recipe that asks for cuda itself is named as such.
  json recipe = parse_json(read_text(source_dir() / "recipes/quickstart.json"));
  recipe["train"]["device"] = "cuda";
  const fs::path file = write_recipe(tmp.path(), recipe);
  const auto own = bench(tmp, {file.string(), "--nproc", "1"});
  CHECK(own.exit_code == 1);
  CHECK(own.err.find("train.device \"cuda\" (the recipe's) (world size 1): 1 rank(s)") !=
        std::string::npos);
}

TEST_CASE("--batch-per-rank overrides the recipe's batch for every run") {
  TempDir tmp;
  const auto r = bench(
      tmp, {quickstart(), "--nproc", "1", "--steps", "5", "--batch-per-rank", "16", "--json"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json j = parse_json(r.out);
  CHECK(j["rows"][0]["batch_per_rank"] == 16);
  CHECK(j["rows"][0]["global_batch"] == 16);
  const fs::path run = j["rows"][0]["run_dirs"][0].get<std::string>();
  CHECK(parse_json(read_text(run / "recipe.json"))["train"]["batch_per_rank"] == 16);
}

TEST_CASE("a stop during a run: exit 130 or 143, no checkpoint kept, no pointer at a resume") {
  for (const int sig : {SIGINT, SIGTERM}) {
    const std::string name = sig == SIGINT ? "SIGINT" : "SIGTERM";
    CAPTURE(name);
    TempDir tmp;
    json recipe = small_recipe();
    recipe["checkpoint"] = {{"every", 1000}, {"keep", 2}};  // none before the stop
    const fs::path file = write_recipe(tmp.path(), recipe);
    const fs::path sweep = tmp / "sweep";
    Background b({"bench", "train", file.string(), "--nproc", "1", "--steps", "2000", "--run-dir",
                  sweep.string(), "--json"},
                 {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "20"}});
    // The run has begun once rank 0 logged a step.
    REQUIRE(eventually([&] {
      std::error_code ec;
      return fs::file_size(sweep / "w1/metrics.jsonl", ec) > 0 && !ec;
    }));
    ::kill(b.pid(), sig);
    const int code = sig == SIGINT ? 130 : 143;
    CHECK(b.wait(std::chrono::seconds(60)) == code);
    INFO(b.err());
    CHECK(b.err().find("bench train: stopped by " + name +
                       " during the run at world size 1; a benchmark is not resumed") !=
          std::string::npos);
    CHECK(b.err().find("resume") == b.err().find("resumed"));  // no hint at 'dptrain resume'
    const json out = parse_json(b.out());
    CHECK(out["status"] == (sig == SIGINT ? "interrupted" : "terminated"));
    CHECK(out["exit_code"] == code);
    CHECK(out["errors"].size() == 1);  // the stop (the run directory is on a line of its own)
    CHECK(out["run_dir"] == fs::absolute(sweep).string());
    CHECK(out["failed_run_dir"] == (fs::absolute(sweep) / "w1").string());
    CHECK_FALSE(out.contains("partial"));  // nothing measured before it
    CHECK(out["benchmark"] == "train");    // which benchmark, all the same
    CHECK(contains(b.err(), "dptrain: run directory: " + (fs::absolute(sweep) / "w1").string()));
    // The checkpoint the ranks write as SIGTERM stops them is not kept: nothing resumes it.
    CHECK(fs::is_empty(sweep / "w1/checkpoints"));
    const json recorded = parse_json(read_text(sweep / "w1/run.json"));
    CHECK_FALSE(recorded.contains("last_checkpoint"));
    CHECK(recorded["status"] == out["status"]);
    // Nor does the error it records name one, or a resume (status shows it).
    const std::string error = recorded.value("error", "");
    const bool names_checkpoint =
        contains(error, "checkpoint") && !contains(error, "nothing to checkpoint");
    CHECK_MESSAGE(!names_checkpoint, error);
    CHECK_MESSAGE(!contains(error, "resume"), error);
    // Its world's directory is a benchmark's, not a run to train to its end: resume refuses it.
    const auto resumed = run_dptrain({"resume", (sweep / "w1").string()});
    CHECK(resumed.exit_code == 2);
    CHECK_MESSAGE(resumed.err.find("w1: a benchmark's run (bench train, 1 rank(s)): a benchmark "
                                   "is not resumed: run it again") != std::string::npos,
                  resumed.err);
  }
}

TEST_CASE("a stop that a hung rank does not obey: the run's error names it, and no checkpoint") {
  TempDir tmp;
  json recipe = small_recipe();
  recipe["log"] = {{"every", 1}};
  const fs::path file = write_recipe(tmp.path(), recipe);
  const fs::path sweep = tmp / "sweep";
  // Rank 1 hangs at step 3; the stop's grace is cut to 3 s, after which the launcher kills both.
  Background b({"bench", "train", file.string(), "--nproc", "2", "--steps", "2000", "--run-dir",
                sweep.string(), "--json"},
               {{"DPTRAIN_FAULT", "hang@step=3,rank=1"}, {"DPTRAIN_TEST_STOP_GRACE_MS", "3000"}});
  REQUIRE(eventually(
      [&] {
        std::error_code ec;
        if (fs::file_size(sweep / "w2/metrics.jsonl", ec) == 0 || ec) return false;
        for (const auto& m : read_jsonl(sweep / "w2/metrics.jsonl"))
          if (m.value("step", int64_t{0}) >= 2) return true;
        return false;
      },
      std::chrono::seconds(60)));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ::kill(b.pid(), SIGTERM);
  CHECK(b.wait(std::chrono::seconds(60)) == 143);
  INFO(b.err());
  CHECK(contains(b.err(), "bench train: stopped by SIGTERM during the run at world size 2"));
  // Not "every rank was stopped": the hung one was killed, and the heartbeats say where it was.
  const json recorded = parse_json(read_text(sweep / "w2/run.json"));
  const std::string error = recorded["generations"].back().value("error", "");
  CHECK_MESSAGE(error.starts_with("stopped by SIGTERM, but not every rank stopped as asked: "),
                error);
  CHECK_MESSAGE(contains(error, "(the launcher's SIGKILL: "), error);
  CHECK_MESSAGE(contains(error, "stuck: rank 1 at step 3"), error);
  CHECK_MESSAGE(!contains(error, "checkpoint"), error);
  CHECK(fs::is_empty(sweep / "w2/checkpoints"));
}
