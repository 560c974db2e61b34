// `dptrain ckpt list|verify` on real runs: healthy, damaged, set aside, `latest` moved, bad input.
#include <doctest/doctest.h>

#include <fstream>
#include <sstream>

#include "core/checkpoint.hpp"
#include "tests/damage.hpp"
#include "tests/harness.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;

namespace {

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

// A finished 2-rank run with checkpoints at steps 20, 40 and 60; `latest` names step-000060.
fs::path make_run(const TempDir& tmp) {
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const fs::path run_dir = tmp / "run";
  auto r = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string()});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return run_dir;
}

nlohmann::json list_json(const fs::path& run_dir) {
  auto r = run_dptrain({"ckpt", "list", run_dir.string(), "--json"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return parse_json(r.out);
}

// The line of the list table for one checkpoint directory.
std::string table_row(const std::string& table, const std::string& name) {
  std::istringstream lines(table);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind(name + " ", 0) == 0) return line;
  }
  return {};
}

// Each stderr line is one error, prefixed as every dptrain error is.
std::vector<std::string> error_lines(const std::string& err) {
  std::vector<std::string> out;
  std::istringstream lines(err);
  for (std::string line; std::getline(lines, line);) {
    CHECK(line.rfind("dptrain: error: ", 0) == 0);
    out.push_back(line);
  }
  return out;
}

}  // namespace

TEST_CASE("ckpt list and verify on a healthy run") {
  TempDir tmp;
  const fs::path run = make_run(tmp);

  auto table = run_dptrain({"ckpt", "list", run.string()});
  INFO(table.out, table.err);
  CHECK(table.exit_code == 0);
  const auto newest = table.out.find("step-000060");
  const auto middle = table.out.find("step-000040");
  const auto oldest = table.out.find("step-000020");
  REQUIRE(oldest != std::string::npos);
  CHECK(newest < middle);
  CHECK(middle < oldest);
  CHECK(contains(table_row(table.out, "step-000060"), "yes"));
  CHECK_FALSE(contains(table_row(table.out, "step-000040"), "yes"));
  CHECK(contains(table_row(table.out, "step-000020"), " ok"));

  const auto list = list_json(run);
  CHECK(list["latest"] == "step-000060");
  REQUIRE(list["checkpoints"].size() == 3);
  int64_t expected_step = 60;
  for (const auto& c : list["checkpoints"]) {
    CHECK(c["step"] == expected_step);
    CHECK(c["name"] == dptrain::checkpoint_name(expected_step));
    CHECK(c["world_size"] == 2);
    CHECK(c["epoch"].is_number_integer());
    CHECK(c["bytes_on_disk"].get<int64_t>() > 0);
    CHECK(c["written"].get<std::string>().size() == 20);  // 2026-11-30T08:43:38Z
    CHECK(c["latest"] == (expected_step == 60));
    CHECK(c["set_aside"] == false);
    CHECK(c["ok"] == true);
    CHECK(c["problems"].empty());
    expected_step -= 20;
  }

  auto verify = run_dptrain({"ckpt", "verify", run.string()});
  INFO(verify.out, verify.err);
  CHECK(verify.exit_code == 0);
  CHECK(contains(verify.out, "step-000060 (latest): ok"));
  CHECK(contains(verify.out, "params.bin"));
  CHECK(contains(verify.out, "optimizer.bin"));
  CHECK(verify.err.empty());

  auto all = run_dptrain({"ckpt", "verify", run.string(), "--all", "--json"});
  INFO(all.err);
  CHECK(all.exit_code == 0);
  const auto out = parse_json(all.out);
  CHECK(out["ok"] == true);
  REQUIRE(out["checkpoints"].size() == 3);
  for (const auto& blob : out["checkpoints"][0]["blobs"]) {
    CHECK(blob["ok"] == true);
    CHECK(blob["checksum"] == blob["actual_checksum"]);
    CHECK(blob["bytes"] == blob["actual_bytes"]);
    CHECK(blob["checksum"].get<std::string>().size() == 16);
  }
}

TEST_CASE("ckpt verify exits 5 naming a corrupted and a truncated blob; list marks them") {
  TempDir tmp;
  const fs::path run = make_run(tmp);
  const fs::path ck = run / "checkpoints";
  flip_byte(ck / "step-000060/params.bin", 17);
  fs::resize_file(ck / "step-000040/optimizer.bin", 10);

  auto latest = run_dptrain({"ckpt", "verify", run.string()});
  INFO(latest.out, latest.err);
  CHECK(latest.exit_code == 5);
  CHECK(contains(latest.out, "step-000060 (latest): FAILED"));
  auto errors = error_lines(latest.err);
  REQUIRE(errors.size() == 1);
  CHECK(contains(errors[0], "step-000060/params.bin: checksum mismatch"));

  auto truncated = run_dptrain({"ckpt", "verify", run.string(), "40"});
  INFO(truncated.out, truncated.err);
  CHECK(truncated.exit_code == 5);
  errors = error_lines(truncated.err);
  REQUIRE(errors.size() == 1);
  CHECK(contains(errors[0], "step-000040/optimizer.bin: truncated"));
  CHECK(contains(errors[0], "10 bytes"));

  CHECK(run_dptrain({"ckpt", "verify", run.string(), "step-000020"}).exit_code == 0);

  auto all = run_dptrain({"ckpt", "verify", run.string(), "--all", "--json"});
  INFO(all.out, all.err);
  CHECK(all.exit_code == 5);
  CHECK(error_lines(all.err).size() == 2);
  const auto out = parse_json(all.out);
  CHECK(out["ok"] == false);
  REQUIRE(out["checkpoints"].size() == 3);
  const auto& params = out["checkpoints"][0]["blobs"][0];
  CHECK(params["file"] == "params.bin");
  CHECK(params["ok"] == false);
  CHECK(params["checksum"] != params["actual_checksum"]);
  CHECK(contains(params["problem"].get<std::string>(), "checksum mismatch"));
  const auto& optimizer = out["checkpoints"][1]["blobs"][1];
  CHECK(optimizer["file"] == "optimizer.bin");
  CHECK(optimizer["actual_bytes"] == 10);
  CHECK(out["checkpoints"][2]["ok"] == true);

  auto table = run_dptrain({"ckpt", "list", run.string()});
  INFO(table.out);
  CHECK(table.exit_code == 0);  // listing damage is not a failure of list
  CHECK(contains(table_row(table.out, "step-000060"), "FAILED: params.bin: checksum mismatch"));
  CHECK(contains(table_row(table.out, "step-000040"), "FAILED: optimizer.bin: truncated"));
  CHECK(contains(table_row(table.out, "step-000020"), " ok"));
  const auto list = list_json(run);
  CHECK(list["checkpoints"][0]["ok"] == false);
  CHECK(list["checkpoints"][1]["ok"] == false);
  CHECK(list["checkpoints"][2]["ok"] == true);

  // Torn metadata is named too, as meta.json.
  fs::resize_file(ck / "step-000020/meta.json", 30);
  auto torn = run_dptrain({"ckpt", "verify", run.string(), "20"});
  CHECK(torn.exit_code == 5);
  CHECK(contains(torn.err, "step-000020/meta.json: not valid JSON"));
  CHECK(list_json(run)["checkpoints"][2]["step"] == 20);  // from the directory's name
}

TEST_CASE("ckpt follows `latest` and shows checkpoints that resume set aside") {
  TempDir tmp;
  const fs::path run = make_run(tmp);
  const fs::path ck = run / "checkpoints";

  write_text(ck / "latest", "step-000040\n");
  auto moved = run_dptrain({"ckpt", "verify", run.string()});
  INFO(moved.out, moved.err);
  CHECK(moved.exit_code == 0);
  CHECK(contains(moved.out, "step-000040 (latest): ok"));
  auto list = list_json(run);
  CHECK(list["latest"] == "step-000040");
  CHECK(list["checkpoints"][0]["latest"] == false);
  CHECK(list["checkpoints"][1]["latest"] == true);

  fs::remove(ck / "latest");
  auto newest = run_dptrain({"ckpt", "verify", run.string()});
  CHECK(contains(newest.out, "step-000060: ok"));
  CHECK(list_json(run)["latest"].is_null());

  // What resume does with a damaged newest checkpoint: rename it, never delete it.
  flip_byte(ck / "step-000060/params.bin", 5);
  fs::rename(ck / "step-000060", ck / "step-000060.corrupt");
  list = list_json(run);
  REQUIRE(list["checkpoints"].size() == 3);
  CHECK(list["checkpoints"][0]["name"] == "step-000060.corrupt");
  CHECK(list["checkpoints"][0]["set_aside"] == true);
  CHECK(list["checkpoints"][0]["ok"] == false);
  // --all is about the checkpoints a resume could use; a set-aside one is checked when named.
  CHECK(run_dptrain({"ckpt", "verify", run.string(), "--all"}).exit_code == 0);
  auto aside = run_dptrain({"ckpt", "verify", run.string(), "60"});
  CHECK(aside.exit_code == 5);
  CHECK(contains(aside.err, "step-000060.corrupt/params.bin"));
}

TEST_CASE("ckpt: a missing step or a directory that is not a run is a usage error") {
  TempDir tmp;
  const fs::path run = make_run(tmp);

  auto missing = run_dptrain({"ckpt", "verify", run.string(), "999"});
  INFO(missing.err);
  CHECK(missing.exit_code == 2);
  REQUIRE(error_lines(missing.err).size() == 1);
  CHECK(contains(missing.err, "no checkpoint 999"));
  CHECK(contains(missing.err, "step-000060"));  // and what there is instead

  auto json = run_dptrain({"ckpt", "verify", run.string(), "step-000999", "--json"});
  CHECK(json.exit_code == 2);
  const auto out = parse_json(json.out);
  CHECK(out["status"] == "error");
  CHECK(contains(out["errors"][0].get<std::string>(), "step-000999"));

  for (const char* sub : {"list", "verify"}) {
    auto not_run = run_dptrain({"ckpt", sub, tmp.path().string()});
    CAPTURE(sub);
    CHECK(not_run.exit_code == 2);
    CHECK(contains(not_run.err, tmp.path().string() + ": not a run directory"));
  }
  CHECK(run_dptrain({"ckpt", "verify", run.string(), "20", "--all"}).exit_code == 2);
  CHECK(run_dptrain({"ckpt"}).exit_code == 2);

  // A run that never reached its first checkpoint has nothing to verify.
  fs::remove_all(run / "checkpoints");
  fs::create_directories(run / "checkpoints");
  CHECK(contains(run_dptrain({"ckpt", "list", run.string()}).out, "no checkpoints"));
  auto none = run_dptrain({"ckpt", "verify", run.string()});
  CHECK(none.exit_code == 5);
  CHECK(contains(none.err, "no checkpoints to verify"));
}
