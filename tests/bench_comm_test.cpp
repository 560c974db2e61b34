// `dptrain bench comm` end to end: real rank processes over real sockets, the nccl-tests table,
// JSON, the data check, --min-busbw and bad flags.
#include <doctest/doctest.h>

#include <csignal>
#include <sstream>

#include "core/comm/nccl_communicator.hpp"
#include "core/fs.hpp"
#include "tests/cluster.hpp"
#include "tests/harness.hpp"
#include "tests/strings.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

CommandResult bench(TempDir& tmp, std::vector<std::string> args, const Env& env = {}) {
  std::vector<std::string> full = {"bench", "comm", "--runs-root", (tmp / "runs").string()};
  full.insert(full.end(), args.begin(), args.end());
  return run_dptrain(full, env, std::chrono::seconds(60));
}

// The rows of a --json result after the checks every row must pass.
void check_rows(const json& j, int ranks, const std::string& type) {
  for (const auto& row : j["rows"]) {
    CAPTURE(row.dump());
    CHECK(row["wrong"] == 0);
    CHECK(row["type"] == type);
    const std::string op = row["op"];
    const double n = ranks;
    const double factor = op == "allreduce"   ? 2 * (n - 1) / n
                          : op == "broadcast" ? 1.0
                                              : (n - 1) / n;
    const double time_us = row["time_us"];
    const double size = row["size"];
    CHECK(time_us >= 0);
    if (size > 0) CHECK(time_us > 0);
    if (size > 0) CHECK(row["algbw"].get<double>() == doctest::Approx(size / 1e3 / time_us));
    CHECK(row["busbw"].get<double>() == doctest::Approx(row["algbw"].get<double>() * factor));
  }
}

}  // namespace

TEST_CASE("bench comm --nproc 2 --json: rows from 1K to 64K, checked, busbw = algbw x factor") {
  TempDir tmp;
  const auto r = bench(tmp, {"--nproc", "2", "-b", "1K", "-e", "64K", "-f", "4", "--json"});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const json j = parse_json(r.out);  // exactly one JSON object on stdout
  CHECK(j["status"] == "completed");
  CHECK(j["exit_code"] == 0);
  CHECK(j["ranks"] == 2);
  CHECK(j["hosts"] == 1);
  CHECK(j["backend"] == "gloo");
  CHECK(j["dtype"] == "float");
  CHECK(j["ops"] == json({"allreduce"}));
  CHECK(j["wrong"] == 0);
  REQUIRE(j["rows"].size() == 4);
  uint64_t size = 1024;
  for (const auto& row : j["rows"]) {
    CHECK(row["op"] == "allreduce");
    CHECK(row["size"] == size);
    CHECK(row["count"] == size / 4);
    CHECK(row["redop"] == "sum");
    CHECK(row["root"] == -1);
    size *= 4;
  }
  check_rows(j, 2, "float");
  double sum = 0;
  for (const auto& row : j["rows"])
    sum += row["busbw"].get<double>();
  CHECK(j["avg_busbw"].get<double>() == doctest::Approx(sum / 4));
  // The run directory: each rank's log, rank 0's result, the table.
  const fs::path run = j["run_dir"].get<std::string>();
  CHECK(run.parent_path() == fs::absolute(tmp / "runs"));
  CHECK(run.filename().string().rfind("bench-comm-", 0) == 0);
  CHECK(fs::exists(run / "logs" / "localhost-rank0.log"));
  CHECK(fs::exists(run / "logs" / "localhost-rank1.log"));
  CHECK_FALSE(fs::exists(run / "checkpoints"));  // its ranks write none
  CHECK(contains(read_text(run / "logs" / "localhost-rank0.log"),
                 "\nbench comm finished: 4 row(s) on 2 rank(s), average busbw "));
  CHECK(parse_json(read_text(run / "result.json")) == j);
  CHECK(read_text(run / "table.txt").find("# Avg bus bandwidth    : ") != std::string::npos);
  const json info = parse_json(read_text(run / "run.json"));
  CHECK(info["status"] == "completed");
  CHECK(info["result"] == j);
}

TEST_CASE("bench comm --hosts: 2 loopback SSH hosts x 2 slots, like a job") {
  TwoHostCluster cluster(2);
  const auto r =
      run_dptrain({"bench", "comm", "--hosts", cluster.hostfile.string(), "--known-hosts",
                   cluster.sshd.known_hosts().string(), "--remote-binary", binary(), "--runs-root",
                   (cluster.tmp / "runs").string(), "--op", "allreduce,allgather", "-b", "4K", "-e",
                   "64K", "-f", "16", "--json"},
                  {}, std::chrono::seconds(60));
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  const json j = parse_json(r.out);
  CHECK(j["ranks"] == 4);
  CHECK(j["hosts"] == 2);
  REQUIRE(j["rows"].size() == 4);
  check_rows(j, 4, "float");
  // Rank 0 is remote: the launcher still keeps its result.
  CHECK(fs::exists(fs::path(j["run_dir"].get<std::string>()) / "result.json"));
}

TEST_CASE("bench comm --op all: an nccl-tests table per collective on stdout, nothing else") {
  TempDir tmp;
  const auto r = bench(tmp, {"--nproc", "3", "--op", "all", "-b", "64", "-e", "16K", "-f", "16",
                             "-w", "1", "-n", "3"});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  CHECK(r.err.find("dptrain bench comm: 3 rank(s) on this machine, run directory ") !=
        std::string::npos);
  // Three ranks on fewer CPUs (CI's two): said, as the times then carry CPU contention.
  const std::string crowded = "bench comm: note: 3 ranks exceed this machine's " +
                              std::to_string(dptrain::online_cpus()) +
                              " CPUs: the times measure CPU contention as well as communication\n";
  CHECK_MESSAGE(contains(r.err, crowded) == (dptrain::online_cpus() < 3), r.err);
  const auto lines = lines_of(r.out);
  int headers = 0;
  int units = 0;
  int averages = 0;
  std::map<std::string, int> rows;  // collective -> rows
  std::string op;
  for (const auto& line : lines) {
    CAPTURE(line);
    if (line.rfind("# dptrain bench comm: ", 0) == 0) op = line.substr(22);
    if (line ==
        "#       size         count      type   redop    root     time   algbw   busbw "
        "#wrong") {
      ++headers;
    } else if (line ==
               "#        (B)    (elements)                               (us)  (GB/s)  (GB/s)") {
      ++units;
    } else if (line.rfind("# Avg bus bandwidth    : ", 0) == 0) {
      ++averages;
    } else if (line.front() != '#') {
      // size count type redop root time algbw busbw #wrong, right-aligned like nccl-tests'.
      const auto w = words_of(line);
      REQUIRE(w.size() == 9);
      CHECK(line.size() == 84);
      CHECK(w[2] == "float");
      CHECK(w[3] == (op == "allreduce" || op == "reduce_scatter" ? "sum" : "none"));
      CHECK(w[4] == (op == "broadcast" ? "0" : "-1"));
      CHECK(w[8] == "0");
      ++rows[op];
    }
  }
  CHECK(headers == 4);
  CHECK(units == 4);
  CHECK(averages == 4);
  CHECK(rows == std::map<std::string, int>{
                    {"allgather", 3}, {"allreduce", 3}, {"broadcast", 3}, {"reduce_scatter", 3}});
  CHECK(r.out.find("# Out of bounds values : 0 OK") != std::string::npos);
  // allgather and reduce_scatter: the whole buffer, the count per rank (16384 B / 3 ranks).
  CHECK(r.out.find("       16380          1365     float    none      -1") != std::string::npos);
  CHECK(r.out.find("       16380          1365     float     sum      -1") != std::string::npos);
}

TEST_CASE("bench comm: half and bf16, every collective, checked exactly") {
  TempDir tmp;
  for (const auto& [dtype, type, redop] :
       {std::tuple{"half", "half", "avg"}, std::tuple{"bf16", "bfloat16", "max"},
        std::tuple{"float", "float", "min"}}) {
    CAPTURE(dtype);
    const auto r = bench(tmp, {"--nproc", "2", "-d", dtype, "--redop", redop, "--op", "all", "-b",
                               "2", "-e", "8K", "-f", "64", "-w", "1", "-n", "2", "--json"});
    REQUIRE_MESSAGE(r.exit_code == 0, r.err);
    const json j = parse_json(r.out);
    CHECK(j["dtype"] == dtype);
    CHECK(j["redop"] == redop);
    REQUIRE(j["rows"].size() == 4 * 3);
    check_rows(j, 2, type);
  }
}

TEST_CASE("bench comm --min-busbw: below it at the largest size exits 6 naming op and size") {
  TempDir tmp;
  const auto r = bench(tmp, {"--nproc", "2", "-b", "1K", "-e", "64K", "-f", "4", "--op",
                             "allreduce,allgather", "--min-busbw", "1234567"});
  CHECK(r.exit_code == 6);
  CHECK(r.out.find("# Avg bus bandwidth") != std::string::npos);  // the table still comes
  CHECK_MESSAGE(r.err.find("dptrain: error: allreduce at 65536 bytes: busbw ") != std::string::npos,
                r.err);
  // As given, not rounded to six digits.
  CHECK_MESSAGE(r.err.find(" GB/s is below --min-busbw 1234567 GB/s") != std::string::npos, r.err);
  CHECK(r.err.find("dptrain: error: allgather at 65536 bytes: busbw ") != std::string::npos);

  const auto j =
      bench(tmp, {"--nproc", "2", "-b", "1K", "-e", "4K", "--min-busbw", "1e9", "--json"});
  CHECK(j.exit_code == 6);
  const json out = parse_json(j.out);
  CHECK(out["status"] == "below_threshold");
  CHECK(out["exit_code"] == 6);
  // The run's record says so too: a script reading status sees no success.
  const json recorded =
      parse_json(run_dptrain({"status", out["run_dir"].get<std::string>(), "--json"}).out);
  CHECK(recorded["status"] == "failed");
  CHECK(recorded["error"].get<std::string>().find("below --min-busbw") != std::string::npos);
  CHECK(out["min_busbw"].get<double>() == 1e9);
  REQUIRE(out["errors"].size() == 1);
  CHECK(out["errors"][0].get<std::string>().rfind("allreduce at 4096 bytes: busbw ", 0) == 0);

  const auto pass = bench(tmp, {"--nproc", "2", "-b", "1K", "-e", "4K", "--min-busbw", "0"});
  CHECK_MESSAGE(pass.exit_code == 0, pass.err);
}

TEST_CASE("bench comm: wrong data exits 3 after the table, naming the collective and sizes") {
  TempDir tmp;
  // Rank 1 spoils one element of its output before every check.
  const Env corrupt = {{"DPTRAIN_BENCH_CORRUPT", "1"}};
  const auto r = bench(tmp,
                       {"--nproc", "2", "-b", "1K", "-e", "4K", "-f", "4", "--op",
                        "allreduce,allgather", "--min-busbw", "1e9"},
                       corrupt);
  CHECK(r.exit_code == 3);  // wrong data wins over a low busbw
  CHECK(r.out.find("# Out of bounds values : 2 FAILED") != std::string::npos);
  int wrong_rows = 0;
  for (const auto& line : lines_of(r.out)) {
    if (line.front() != '#') wrong_rows += words_of(line).back() == "1";
  }
  CHECK(wrong_rows == 4);
  CHECK_MESSAGE(r.err.find("dptrain: error: allreduce: 2 wrong element(s) in the data check "
                           "(sizes 1024, 4096 bytes)") != std::string::npos,
                r.err);
  CHECK(r.err.find("dptrain: error: allgather: 2 wrong element(s)") != std::string::npos);

  const auto j = bench(tmp, {"--nproc", "2", "-b", "1K", "-e", "1K", "--json"}, corrupt);
  CHECK(j.exit_code == 3);
  const json out = parse_json(j.out);
  CHECK(out["status"] == "wrong_data");
  CHECK(out["exit_code"] == 3);
  const json recorded = parse_json(read_text(out["run_dir"].get<std::string>() + "/run.json"));
  CHECK(recorded["status"] == "failed");
  CHECK(recorded["generations"].back()["status"] == "failed");
  CHECK(out["wrong"] == 1);
  CHECK(out["rows"][0]["wrong"] == 1);
}

TEST_CASE("bench comm: a rank that fails exits 3 naming it, with its last lines") {
  TempDir tmp;
  // Every rank refuses this setting before it connects.
  const auto r = bench(tmp, {"--nproc", "2", "-b", "1K", "-e", "1K", "--json"},
                       {{"DPTRAIN_BENCH_CORRUPT", "x"}});
  CHECK(r.exit_code == 3);
  CHECK_MESSAGE(r.err.find("rank ") != std::string::npos, r.err);
  CHECK_MESSAGE(r.err.find("DPTRAIN_BENCH_CORRUPT: not an integer: 'x'") != std::string::npos,
                r.err);
  const json j = parse_json(r.out);
  CHECK(j["status"] == "failed");  // a job whose rank failed, as launch says
  CHECK(j["exit_code"] == 3);
}

TEST_CASE("bench comm: DPTRAIN_FAULT counts each measurement as a step") {
  TempDir tmp;
  SUBCASE("a rank that exits after two of three measurements") {
    const auto r = bench(tmp,
                         {"--nproc", "2", "-b", "1K", "-e", "4K", "-n", "1", "-w", "0", "--timeout",
                          "5", "--run-dir", (tmp / "run").string(), "--json"},
                         {{"DPTRAIN_FAULT", "exit@step=2,rank=1,code=7"}});
    CHECK(r.exit_code == 3);
    const json j = parse_json(r.out);
    CHECK(j["errors"][0].get<std::string>().find("rank 1 (pid ") == 0);
    // (7 outranks the exit 3 rank 0 makes as its peer leaves.)
    CHECK(j["errors"][0].get<std::string>().find("exited with code 7") != std::string::npos);
    // What was measured before the end is kept: in the JSON, in result.json and table.txt.
    CHECK(j["partial"] == true);
    CHECK(j["warnings"].is_array());
    CHECK(j["run_dir"] == fs::absolute(tmp / "run").string());
    REQUIRE(j["rows"].size() == 2);
    CHECK(j["rows"][1]["size"] == 2048);
    CHECK(parse_json(read_text(tmp / "run" / "result.json"))["rows"] == j["rows"]);
    CHECK(contains(read_text(tmp / "run" / "table.txt"),
                   "# Partial: 2 of 3 measurements before the end (see the error)"));
    // Rank 0 measured the first two sizes, not the third.
    const std::string log = read_text(tmp / "run" / "logs" / "localhost-rank0.log");
    CAPTURE(log);
    CHECK(log.find("bench comm: allreduce 2048 bytes (2/3)") != std::string::npos);
    CHECK(log.find("(3/3)") == std::string::npos);
    // run.json keeps it too: status and report give its figures, saying they are partial.
    CHECK(parse_json(read_text(tmp / "run" / "run.json"))["result"]["rows"] == j["rows"]);
    const json s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
    CHECK(s["status"] == "failed");
    CHECK(s["benchmark"]["partial"] == true);
    CHECK(s["benchmark"]["avg_busbw"] == j["avg_busbw"]);
    CHECK(contains(run_dptrain({"status", (tmp / "run").string()}).out,
                   "it did not finish; over the sizes it measured, avg busbw "));
  }
  SUBCASE("a rank that exits before the first measurement: no figures, null, status failed") {
    const auto r = bench(tmp,
                         {"--nproc", "2", "-b", "1K", "-e", "4K", "-n", "1", "-w", "0", "--timeout",
                          "5", "--run-dir", (tmp / "run0").string(), "--json"},
                         {{"DPTRAIN_FAULT", "exit@step=0,rank=1,code=7"}});
    CHECK(r.exit_code == 3);
    // Nothing measured, still named: a script tells which benchmark failed.
    const json out = parse_json(r.out);
    CHECK(out["benchmark"] == "comm");
    CHECK_FALSE(out.contains("rows"));
    const json s = parse_json(run_dptrain({"status", (tmp / "run0").string(), "--json"}).out);
    CHECK(s["status"] == "failed");
    CHECK(s["benchmark"]["status"] == "failed");
    CHECK(s["benchmark"]["avg_busbw"].is_null());
    CHECK(s["benchmark"]["avg_busbw_by_op"].is_null());
    CHECK(s["benchmark"]["partial"] == false);
  }
  SUBCASE("a rank that exits with 5, a job's checkpoint code: still a failed rank, exit 3") {
    const auto r = bench(tmp,
                         {"--nproc", "2", "-b", "1K", "-e", "4K", "-n", "1", "-w", "0", "--timeout",
                          "5", "--run-dir", (tmp / "run5").string(), "--json"},
                         {{"DPTRAIN_FAULT", "exit@step=2,rank=1,code=5"}});
    CHECK(r.exit_code == 3);
    const json j = parse_json(r.out);
    CHECK(j["exit_code"] == 3);
    CHECK(j["errors"][0].get<std::string>().find("exited with code 5") != std::string::npos);
  }
  SUBCASE("a rank that never joins: the hint names bench comm's --timeout, live and at the end") {
    const auto r = bench(tmp,
                         {"--nproc", "2", "-b", "1K", "-e", "4K", "-n", "1", "-w", "0", "--timeout",
                          "3", "--run-dir", (tmp / "run").string()},
                         {{"DPTRAIN_FAULT", "freeze-before-join@rank=1"}});
    CHECK(r.exit_code == 3);
    const std::string hint =
        "rank 1 of 2 did not join within 3s (nothing from it at store 127.0.0.1:";
    const std::string advice =
        "; the launcher started every rank with the same store and world size: the log of each "
        "rank that did not join says where it stopped (frozen, or still starting), or give them "
        "longer than 3s to start (bench comm's --timeout)";
    CHECK_MESSAGE(contains(r.err, "[rank 0] dptrain: error: rank 0: "), r.err);
    CHECK(contains(r.err, "dptrain: error: rank 0 (pid "));
    CHECK(count_occurrences(r.err, hint) == 2);
    CHECK(count_occurrences(r.err, advice) == 2);
    CHECK_FALSE(contains(r.err, "distributed.timeout_s"));
  }
  SUBCASE("a rank that hangs before the second: the timeout names it, not the one waiting") {
    const auto r = bench(tmp,
                         {"--nproc", "2", "-b", "1K", "-e", "4K", "-n", "1", "-w", "0", "--timeout",
                          "3", "--run-dir", (tmp / "run").string()},
                         {{"DPTRAIN_FAULT", "hang@step=1,rank=1"}});
    CHECK(r.exit_code == 3);
    CHECK_MESSAGE(r.err.find("by the ranks' last heartbeats, stuck: rank 1 at step 1 in phase "
                             "measure (after collective #5 (allreduce of the checks)); waiting "
                             "for it in collective #6 (barrier): rank 0") != std::string::npos,
                  r.err);
    // status says the step (the measurement) the error names, not 0.
    const json s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
    CHECK(s["status"] == "failed");
    CHECK(s["step"] == 1);
  }
  SUBCASE("while a rank hangs, status and report say running, with both ranks' pids") {
    const fs::path run = tmp / "run";
    Background launcher({"bench", "comm", "--nproc", "2", "-b", "1K", "-e", "4K", "-n", "1", "-w",
                         "0", "--timeout", "120", "--run-dir", run.string()},
                        {{"DPTRAIN_FAULT", "hang@step=1,rank=1"}});
    json s;
    REQUIRE(eventually(
        [&] {
          const auto r = run_dptrain({"status", run.string(), "--json"});
          if (r.exit_code != 0) return false;
          s = parse_json(r.out);
          return s["live_pids"].size() == 2;
        },
        std::chrono::seconds(60)));
    CHECK(s["status"] == "running");
    // The first size measured (and its row sent to the launcher) before the stop.
    REQUIRE(eventually([&] {
      return contains(read_text(run / "logs" / "localhost-rank0.log"),
                      "bench comm: allreduce 1024 bytes (1/3)");
    }));
    const auto report = run_dptrain({"report", run.string(), "--json"});
    CHECK(parse_json(report.out)["status"] == "running");
    // Running: not "did not finish" (what a partial result says once the benchmark has ended).
    const auto running = run_dptrain({"status", run.string()});
    CHECK_MESSAGE(contains(running.out, "bench comm allreduce from 1.0 KiB to 4.0 KiB: running"),
                  running.out);
    CHECK_FALSE(contains(running.out, "did not finish"));
    kill(launcher.pid(), SIGTERM);
    CHECK(launcher.wait(std::chrono::seconds(60)) == 143);
    // The one size measured before the hang is printed, as a partial table.
    CHECK(contains(launcher.out(), "# Partial: 1 of 3 measurements before the end"));
    CHECK(contains(launcher.out(), "        1024           256     float     sum      -1"));
    // Its ranks take SIGTERM's default action: killed by the signal they were sent, they
    // stopped as asked (not "not every rank stopped as asked: rank 0 was killed by SIGTERM").
    CHECK_MESSAGE(contains(launcher.err(),
                           "dptrain: error: stopped by SIGTERM; every rank was "
                           "stopped\n"),
                  launcher.err());
    // Stopped before its result: still a collective benchmark, of the sizes it was given, with
    // the figures of the one it measured, said to be partial.
    s = parse_json(run_dptrain({"status", run.string(), "--json"}).out);
    CHECK(s["status"] == "terminated");
    CHECK(s["benchmark"]["benchmark"] == "comm");
    CHECK(s["benchmark"]["ops"] == json({"allreduce"}));
    CHECK(s["benchmark"]["max_bytes"] == 4096);
    CHECK(s["benchmark"]["avg_busbw"].is_number());
    CHECK(s["benchmark"]["partial"] == true);
    const json r = parse_json(run_dptrain({"report", run.string(), "--json"}).out);
    CHECK(r["throughput_unit"].is_null());
    CHECK(r["benchmark"]["wrong"] == 0);
    const auto text = run_dptrain({"status", run.string()});
    CHECK_MESSAGE(contains(text.out,
                           "bench comm allreduce from 1.0 KiB to 4.0 KiB: it did not finish; "
                           "over the sizes it measured, avg busbw "),
                  text.out);
  }
  SUBCASE("faults that can never fire are warned about; the benchmark runs") {
    const auto r =
        bench(tmp, {"--nproc", "2", "-b", "1K", "-e", "4K", "-n", "1", "-w", "0", "--json"},
              {{"DPTRAIN_FAULT", "crash@step=3;crash-in-checkpoint@step=1"}});
    CHECK_MESSAGE(r.exit_code == 0, r.err);
    // In --json too, as said.
    const json warnings = parse_json(r.out)["warnings"];
    REQUIRE(warnings.size() == 2);
    CHECK(contains(r.err, "dptrain: warning: " + warnings[0].get<std::string>() + "\n"));
    CHECK(contains(r.err, "dptrain: warning: " + warnings[1].get<std::string>() + "\n"));
    CHECK(r.err.find("warning: DPTRAIN_FAULT 'crash@step=3' never fires: step 3 is past the "
                     "run's steps (0 to 2)") != std::string::npos);
    CHECK(r.err.find("warning: DPTRAIN_FAULT 'crash-in-checkpoint@step=1' never fires: these "
                     "ranks write no checkpoints") != std::string::npos);
  }
  SUBCASE("one that does not parse: exit 2, nothing created") {
    const auto r = bench(tmp, {"--nproc", "2"}, {{"DPTRAIN_FAULT", "crash@step=x"}});
    CHECK(r.exit_code == 2);
    CHECK_MESSAGE(
        r.err.find("DPTRAIN_FAULT: 'x': not an integer in 'crash@step=x'") != std::string::npos,
        r.err);
    CHECK_FALSE(fs::exists(tmp / "runs"));
  }
}

TEST_CASE("bench comm --nproc 1: nothing leaves the one rank, so every busbw is 0") {
  TempDir tmp;
  const auto r = bench(tmp, {"-b", "4K", "-e", "4K", "--op", "allreduce,broadcast", "--json"});
  REQUIRE_MESSAGE(r.exit_code == 0, r.err);
  // The default of one rank is said (-n is --iters here, not a rank count).
  CHECK(contains(r.err,
                 "bench comm: note: 1 rank (--nproc's default): no collective moves data "
                 "between ranks, so every busbw is 0; give --nproc N for N ranks"));
  const json j = parse_json(r.out);
  CHECK(j["ranks"] == 1);
  // In --json's notes too, without the prefix.
  REQUIRE(j["notes"].size() == 1);
  CHECK(contains(r.err, "bench comm: note: " + j["notes"][0].get<std::string>() + "\n"));
  REQUIRE(j["rows"].size() == 2);
  CHECK(j["rows"][0]["busbw"] == 0.0);
  CHECK(j["rows"][1]["busbw"] == 0.0);  // nccl-tests' factor 1 would show the call's overhead
  CHECK(j["rows"][1]["algbw"].get<double>() > 0);
  // A benchmark's run has no steps: status says so, with no sentinel.
  auto status = run_dptrain({"status", j["run_dir"].get<std::string>(), "--json"});
  REQUIRE_MESSAGE(status.exit_code == 0, status.err);
  const json s = parse_json(status.out);
  CHECK(s["step"].is_null());
  // Its outcome instead, in status and report.
  CHECK(s["benchmark"]["benchmark"] == "comm");
  CHECK(s["benchmark"]["ops"] == json({"allreduce", "broadcast"}));
  CHECK(s["benchmark"]["avg_busbw"] == j["avg_busbw"]);
  CHECK(s["benchmark"]["wrong"] == 0);
  const std::string run_dir = j["run_dir"];
  const auto text = run_dptrain({"status", run_dir});
  CHECK(text.out.find("benchmark    bench comm allreduce, broadcast from 4.0 KiB to 4.0 KiB: avg "
                      "busbw ") != std::string::npos);
  REQUIRE(run_dptrain({"report", run_dir}).exit_code == 0);
  const std::string html = read_text(fs::path(run_dir) / "report.html");
  CHECK(html.find("<h2>Benchmark</h2>") != std::string::npos);
  CHECK(html.find("# Avg bus bandwidth") != std::string::npos);  // its table
  CHECK(html.find("<h2>Training</h2>") == std::string::npos);
  // Its facts name the benchmark, without a training run's rows (steps, losses, samples/s).
  CHECK(html.find("<tr><th>Benchmark</th><td>bench comm</td></tr>") != std::string::npos);
  for (const char* training_row : {"<th>Recipe</th>", "<th>Steps</th>", "<th>Final loss</th>",
                                   "<th>Eval loss</th>", "<th>Throughput</th>"}) {
    CAPTURE(training_row);
    CHECK(html.find(training_row) == std::string::npos);
  }
  const auto table = bench(tmp, {"-b", "4K", "-e", "4K"});
  REQUIRE(table.exit_code == 0);
  const auto rows = lines_of(table.out);
  bool found = false;
  for (const auto& line : rows) {
    if (line.front() == '#') continue;
    const auto w = words_of(line);
    REQUIRE(w.size() == 9);
    CHECK(w[7] == "0.00");
    found = true;
  }
  CHECK(found);
  // The range status gives is the sweep's: by a factor of 4 from 1 KiB, -e 6K ends at 4 KiB.
  const auto swept = bench(tmp, {"-b", "1K", "-e", "6K", "-f", "4", "--json"});
  REQUIRE(swept.exit_code == 0);
  const std::string swept_dir = parse_json(swept.out)["run_dir"];
  const json swept_status = parse_json(run_dptrain({"status", swept_dir, "--json"}).out);
  CHECK(swept_status["benchmark"]["largest_size"] == 4096);
  CHECK(swept_status["benchmark"]["smallest_size"] == 1024);
  // -b and -e as bench comm --json has them: one name, one meaning.
  CHECK(swept_status["benchmark"]["max_bytes"] == 6144);
  CHECK(swept_status["benchmark"]["max_bytes"] == parse_json(swept.out)["max_bytes"]);
  CHECK(swept_status["benchmark"]["min_bytes"] == parse_json(swept.out)["min_bytes"]);
  CHECK(contains(run_dptrain({"status", swept_dir}).out, "allreduce from 1.0 KiB to 4.0 KiB: "));
}

TEST_CASE("bench comm: a bad flag exits 2 naming it and creates nothing") {
  TempDir tmp;
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"-b", "1X"}, "-b/--minbytes: not a size: '1X'"},
      {{"-e", "1.5M"}, "-e/--maxbytes: not a size: '1.5M'"},
      {{"-b", "8K", "-e", "4K"}, "-e/--maxbytes: 4096 is below -b/--minbytes 8192"},
      {{"-f", "1"}, "--stepfactor: '1' must be a whole number >= 2"},
      {{"-f", "-2"}, "--stepfactor: '-2' must be a whole number >= 2"},
      {{"-d", "fp8"}, "-d/--dtype: unknown element type 'fp8'"},
      {{"--op", "allreduc"}, "-o/--op: unknown collective 'allreduc'"},
      {{"--redop", "prod"}, "--redop: unknown reduction 'prod'"},
      {{"--backend", "mpi"}, "--backend: unknown backend 'mpi'"},
      {{"--nproc", "0"}, "--nproc: must be at least 1, got 0"},
      {{"--nproc", "2", "--op", "broadcast", "--root", "2"}, "--root: 2 is not a rank (0..1)"},
      {{"-n", "0"}, "--iters: '0' must be a whole number >= 1"},
      {{"-w", "-1"}, "--warmup: '-1' must be a whole number >= 0"},
      {{"--min-busbw", "-1"}, "--min-busbw: '-1' must be a finite number >= 0"},
      {{"--min-busbw", "inf"}, "--min-busbw: 'inf' must be a finite number >= 0"},
      {{"--op", "broadcast", "--min-busbw", "1"},
       "--min-busbw: with 1 rank no collective moves data between ranks (busbw is 0): use 2 or "
       "more ranks, or leave out --min-busbw"},
      {{"--timeout", "0"}, "--timeout: '0' must be a number of seconds > 0"},
      {{"--timeout", "-1"}, "--timeout: '-1' must be a number of seconds > 0"},
      {{"--timeout", "1e-9"}, "--timeout: '1e-9' must be at least 0.001 seconds"},
      {{"-f", "99999999999999999999"}, "--stepfactor: '99999999999999999999' is out of range"},
      {{"--nproc", "2", "--op", "allgather", "-b", "4", "-e", "4", "--min-busbw", "0.1"},
       "--min-busbw: allgather moves no data at its largest size, 4 bytes, on 2 ranks"},
      {{"--hosts", "localhost:2", "--nproc", "2"}, "--nproc: not with --hosts"},
      {{"--iters", "x"}, "--iters"},
      {{"--bogus"}, "--bogus"},
      {{"--nproc", "2", "-e", "1T"},
       "-e/--maxbytes: 1099511627776 bytes would take about 4096.0 GiB on 2 local rank(s)"},
      // An allgather's size is its gathered output: each rank holds it and its own half.
      {{"--nproc", "2", "-e", "1T", "-o", "allgather"},
       "-e/--maxbytes: 1099511627776 bytes would take about 3072.0 GiB on 2 local rank(s)"},
      // A reduce-scatter's size is its input: each rank holds it, the copy it all-reduces and
      // its half of the output; with every collective, that largest need counts.
      // (Gloo's reduce-scatter takes at most 2 GiB: many ranks make a need no machine has.)
      {{"--nproc", "4096", "-e", "2047M", "-o", "reduce_scatter"},
       "-e/--maxbytes: 2146435072 bytes would take about 16378.0 GiB on 4096 local rank(s)"},
      {{"--nproc", "4096", "-e", "2047M", "-o", "all"},
       "-e/--maxbytes: 2146435072 bytes would take about 16378.0 GiB on 4096 local rank(s)"},
      {{"--nproc", "4096", "-e", "2047M"},
       "-e/--maxbytes: 2146435072 bytes would take about 16376.0 GiB on 4096 local rank(s)"},
  };
  for (const auto& [args, message] : cases) {
    CAPTURE(message);
    const auto r = bench(tmp, args);
    CHECK(r.exit_code == 2);
    CHECK_MESSAGE(r.err.find(message) != std::string::npos, r.err);
    CHECK(r.out.empty());
  }
  CHECK_FALSE(fs::exists(tmp / "runs"));
  const auto j = bench(tmp, {"--backend", "mpi", "--json"});
  CHECK(j.exit_code == 2);
  CHECK(parse_json(j.out)["exit_code"] == 2);  // errors are JSON too with --json
  // A threshold of 0 can never fail: allowed where there is nothing to judge, as with one rank.
  const auto zero = bench(tmp, {"--nproc", "2", "--op", "allgather", "-b", "4", "-e", "4",
                                "--min-busbw", "0", "--json"});
  INFO(zero.err);
  CHECK(zero.exit_code == 0);
  CHECK(parse_json(zero.out)["status"] == "completed");
}

TEST_CASE("bench comm --backend nccl where NCCL cannot be used: exit 1, one line with the reason") {
  const auto reason = dptrain::nccl_unavailable_reason();
  if (!reason) {
    MESSAGE("NCCL is usable here: the GPU tests run bench comm over it");
    return;
  }
  TempDir tmp;
  const auto r = bench(tmp, {"--backend", "nccl", "--nproc", "2", "-e", "1K"});
  CHECK(r.exit_code == 1);
  CHECK(r.out.empty());
  CHECK_MESSAGE(r.err == "dptrain: error: --backend nccl: NCCL cannot be used: " + *reason + "\n",
                r.err);
  CHECK_FALSE(fs::exists(tmp / "runs"));  // nothing was started
  const auto j = bench(tmp, {"--backend", "nccl", "--json"});
  CHECK(j.exit_code == 1);
  const json out = parse_json(j.out);
  CHECK(out["exit_code"] == 1);
  REQUIRE(out["errors"].size() == 1);
  CHECK(out["errors"][0] == "--backend nccl: NCCL cannot be used: " + *reason);
}
