// `dptrain ckpt list|verify` on real runs: healthy, damaged, set aside, `latest` moved, bad input.
#include <doctest/doctest.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <fstream>
#include <sstream>
#include <thread>
#include <tuple>
#include <vector>

#include <fmt/format.h>

#include "core/checkpoint.hpp"
#include "tests/damage.hpp"
#include "tests/harness.hpp"
#include "tests/strings.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;

namespace {

// A finished 2-rank run with checkpoints at steps 20, 40 and 60; `latest` names step-000060.
fs::path make_run(const TempDir& tmp) {
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const fs::path run_dir = tmp / "run";
  auto r = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string()});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return run_dir;
}

// `count` copies of the run's checkpoint of step 20, as steps 100 on: a run with many checkpoints.
void add_checkpoint_copies(const fs::path& run, int count) {
  for (int step = 100; step < 100 + count; ++step) {
    fs::copy(
        run / "checkpoints/step-000020",
        run / "checkpoints" /
            ("step-" + std::string(6 - std::to_string(step).size(), '0') + std::to_string(step)),
        fs::copy_options::recursive);
  }
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
  CHECK(list["incomplete"] == nlohmann::json::array());
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
  CHECK(verify.err.empty());  // in a pipe, quick work shows no progress
  // On a terminal, which checkpoint it checksums and how far it is, erased before the table.
  auto shown = run_dptrain_on_terminal({"ckpt", "verify", run.string(), "--all"});
  INFO(shown.out);
  CHECK(shown.exit_code == 0);
  // Of the blobs' bytes (11540 + 23080), not the directory's.
  CHECK(contains(shown.out, "\r\033[Kverifying step-000060 (1 of 3): "));
  CHECK(contains(shown.out, " of 33.8 KiB ("));
  CHECK(contains(shown.out, "\r\033[Kverifying step-000020 (3 of 3): "));
  CHECK(contains(shown.out, "\r\033[Kstep-000060 (latest): ok"));

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

  // What a rank killed mid-write leaves is shown (it takes room), not listed as a checkpoint.
  const fs::path partial = run / "checkpoints/.tmp-step-000080-4242";
  fs::create_directories(partial);
  write_text(partial / "params.bin", std::string(5000, 'x'));
  auto with_partial = run_dptrain({"ckpt", "list", run.string()});
  CHECK(contains(with_partial.out,
                 "incomplete: .tmp-step-000080-4242 (4.9 KiB): a checkpoint write or prune cut "
                 "short, or one going on now; the next resume or restart removes it\n"));
  const auto partial_json = list_json(run);
  CHECK(partial_json["checkpoints"].size() == 3);
  REQUIRE(partial_json["incomplete"].size() == 1);
  CHECK(partial_json["incomplete"][0]["name"] == ".tmp-step-000080-4242");
  CHECK(partial_json["incomplete"][0]["bytes"].get<int64_t>() >= 5000);
}

TEST_CASE("ckpt verify checks blobs larger than its memory, and sizes before reading") {
  // A 17M-parameter model: optimizer.bin is 135 MB, more than the verify may hold under its
  // 100 MB address-space limit. Blobs are checksummed a piece at a time (one read whole once
  // stopped short where memory ran out, and was reported as truncated: exit 5 for a good one).
  TempDir tmp;
  auto recipe = small_recipe();
  recipe["model"]["hidden"] = {4096, 4096};
  recipe["train"]["steps"] = 1;
  recipe["optimizer"]["schedule"] = {{"type", "constant"}};
  recipe["checkpoint"] = {{"every", 1}, {"keep", 1}};
  recipe["eval"]["every"] = 0;
  const fs::path run_dir = tmp / "run";
  const auto launched = run_dptrain({"launch", write_recipe(tmp.path(), recipe).string(), "--nproc",
                                     "1", "--run-dir", run_dir.string()});
  INFO(launched.err);
  REQUIRE(launched.exit_code == 0);
  const fs::path blob = run_dir / "checkpoints/step-000001/optimizer.bin";
  REQUIRE(fs::file_size(blob) > 100'000'000);
  const auto verify_limited = [&] {
    const std::string command = "ulimit -v 100000; exec timeout -k 5 120 '" + binary() +
                                "' ckpt verify '" + run_dir.string() + "' --json > '" +
                                (tmp / "out").string() + "' 2> '" + (tmp / "err").string() + "'";
    const int status = std::system(("bash -c \"" + command + "\"").c_str());
    INFO(read_text(tmp / "err"));
    REQUIRE(WIFEXITED(status));
    return std::make_pair(WEXITSTATUS(status), parse_json(read_text(tmp / "out")));
  };
  {
    const auto [code, j] = verify_limited();
    CHECK(code == 0);
    CHECK(j["status"] == "ok");
  }
  // A blob of another size is not read at all: a 10 GB one (sparse) is named at once, by the
  // size on disk, and gets no checksum.
  const uintmax_t recorded = fs::file_size(blob);
  fs::resize_file(blob, 10'000'000'000);
  {
    const auto [code, j] = verify_limited();
    CHECK(code == 5);
    const std::string text = j.dump();
    INFO(text);
    CHECK(contains(text, fmt::format("optimizer.bin: truncated or wrong size: 10000000000 bytes, "
                                     "expected {}",
                                     recorded)));
    bool found = false;
    for (const auto& c : j["checkpoints"]) {
      for (const auto& b : c["blobs"]) {
        if (b["file"] != "optimizer.bin") continue;
        found = true;
        CHECK(b["actual_bytes"] == 10'000'000'000);
        CHECK(b["actual_checksum"].is_null());
      }
    }
    CHECK(found);
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

TEST_CASE("ckpt verifies the newest checkpoint when `latest` lags, and shows those set aside") {
  TempDir tmp;
  const fs::path run = make_run(tmp);
  const fs::path ck = run / "checkpoints";

  // `latest` behind the newest checkpoint (a rank stopped between a commit and its update):
  // verify, status and report name the one a resume continues from, as the launcher does.
  write_text(ck / "latest", "step-000040\n");
  auto moved = run_dptrain({"ckpt", "verify", run.string()});
  INFO(moved.out, moved.err);
  CHECK(moved.exit_code == 0);
  CHECK(contains(moved.out, "step-000060: ok"));
  CHECK(parse_json(run_dptrain({"status", run.string(), "--json"}).out)["last_checkpoint"]
            .get<std::string>()
            .ends_with("step-000060"));
  CHECK(parse_json(run_dptrain({"report", run.string(), "--json"}).out)["last_checkpoint"]
            .get<std::string>()
            .ends_with("step-000060"));
  auto list = list_json(run);
  CHECK(list["latest"] == "step-000040");
  CHECK(list["checkpoints"][0]["latest"] == false);
  CHECK(list["checkpoints"][1]["latest"] == true);

  // A newer directory that is no checkpoint a resume would use (an empty one left behind, a
  // checkpoint copied under another step's name): status and report pass over it alike, and
  // count only those a resume may use.
  fs::create_directory(ck / "step-000099");
  fs::copy(ck / "step-000040", ck / "step-000080", fs::copy_options::recursive);
  const auto s = parse_json(run_dptrain({"status", run.string(), "--json"}).out);
  const auto r = parse_json(run_dptrain({"report", run.string(), "--json"}).out);
  CHECK(s["last_checkpoint"].get<std::string>().ends_with("step-000060"));
  CHECK(r["last_checkpoint"] == s["last_checkpoint"]);
  CHECK(s["checkpoints"] == r["checkpoints"]);
  CHECK(r["checkpoints_failed"] == 2);
  fs::remove_all(ck / "step-000099");
  fs::remove_all(ck / "step-000080");

  fs::remove(ck / "latest");
  auto newest = run_dptrain({"ckpt", "verify", run.string()});
  CHECK(newest.exit_code == 0);  // resume copes: not damage, but said
  CHECK(contains(newest.out, "step-000060: ok"));
  CHECK(contains(newest.out, "checkpoints/latest: missing"));
  CHECK(contains(newest.err, "warning: " + (ck / "latest").string() + ": missing; resume"));
  const auto missing = parse_json(run_dptrain({"ckpt", "verify", run.string(), "--json"}).out);
  CHECK(missing["ok"] == true);
  REQUIRE(missing["warnings"].size() == 1);
  CHECK(contains(missing["warnings"][0].get<std::string>(), "latest: missing"));
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

  // A name as a shell completes it, with a slash after.
  CHECK(run_dptrain({"ckpt", "verify", run.string(), "step-000060/"}).exit_code == 0);
  auto missing = run_dptrain({"ckpt", "verify", run.string(), "999"});
  INFO(missing.err);
  CHECK(missing.exit_code == 2);
  REQUIRE(error_lines(missing.err).size() == 1);
  CHECK(contains(missing.err, "no checkpoint 999"));
  CHECK(contains(missing.err, "step-000060"));  // and what there is instead

  // "latest": the one checkpoints/latest names; why not, where it cannot be followed.
  REQUIRE(read_text(run / "checkpoints/latest") == "step-000060\n");
  auto latest = run_dptrain({"ckpt", "verify", run.string(), "latest"});
  CHECK(latest.exit_code == 0);
  CHECK(contains(latest.out, "step-000060"));
  write_text(run / "checkpoints/latest", "step-000999\n");
  auto dangling = run_dptrain({"ckpt", "verify", run.string(), "latest"});
  CHECK(dangling.exit_code == 2);
  CHECK(dangling.err == "dptrain: error: " + run.string() +
                            ": no checkpoint latest (checkpoints/latest names step-000999, which "
                            "does not exist)\n");
  fs::remove(run / "checkpoints/latest");
  auto no_latest = run_dptrain({"ckpt", "verify", run.string(), "latest"});
  CHECK(no_latest.exit_code == 2);
  CHECK(contains(no_latest.err, ": no checkpoint latest (there is no checkpoints/latest)"));
  write_text(run / "checkpoints/latest", "step-000060\n");

  auto json = run_dptrain({"ckpt", "verify", run.string(), "step-000999", "--json"});
  CHECK(json.exit_code == 2);
  const auto out = parse_json(json.out);
  CHECK(out["status"] == "error");
  CHECK(contains(out["errors"][0].get<std::string>(), "step-000999"));
  CHECK(out["ok"] == false);  // on every answer, as recipe validate's "valid"
  const auto usage = parse_json(run_dptrain({"ckpt", "verify", "--json"}).out);
  CHECK(usage["ok"] == false);
  CHECK(usage["exit_code"] == 2);

  for (const char* sub : {"list", "verify"}) {
    auto not_run = run_dptrain({"ckpt", sub, tmp.path().string()});
    CAPTURE(sub);
    CHECK(not_run.exit_code == 2);
    CHECK(contains(not_run.err, tmp.path().string() + ": not a run directory"));
    CHECK_FALSE(contains(not_run.err, "it lies in the run directory"));
    // A directory of a run (its checkpoints/) names the run to give instead.
    auto inside = run_dptrain({"ckpt", sub, (run / "checkpoints").string()});
    CHECK(inside.exit_code == 2);
    CHECK(contains(inside.err, (run / "checkpoints").string() +
                                   ": not a run directory (no readable run.json); it lies in "
                                   "the run directory " +
                                   run.string() + ": give that\n"));
  }
  CHECK(run_dptrain({"ckpt", "verify", run.string(), "20", "--all"}).exit_code == 2);
  CHECK(run_dptrain({"ckpt"}).exit_code == 2);

  // A run.json torn by a crash: the checkpoints are still checked, with a warning, not refused.
  const std::string info = read_text(run / "run.json");
  write_text(run / "run.json", info.substr(0, info.size() / 2));
  for (const char* sub : {"list", "verify"}) {
    auto torn = run_dptrain({"ckpt", sub, run.string(), "--json"});
    CAPTURE(sub);
    INFO(torn.err);
    CHECK(torn.exit_code == 0);
    CHECK(contains(
        torn.err, "dptrain: warning: " + (run / "run.json").string() + ": not valid JSON at line"));
    CHECK(contains(torn.err, "checking its checkpoints/ all the same"));
    const auto doc = parse_json(torn.out);
    CHECK_FALSE(doc["checkpoints"].empty());
    // A script that reads the JSON sees the warning too.
    REQUIRE(doc["warnings"].size() == 1);
    CHECK(contains(torn.err, "dptrain: warning: " + doc["warnings"][0].get<std::string>() + "\n"));
  }
  // Said also when the command then fails (a step the run lacks).
  const auto failed = run_dptrain({"ckpt", "verify", run.string(), "999"});
  CHECK(failed.exit_code != 0);
  CHECK(contains(failed.err, "checking its checkpoints/ all the same"));
  // ... and in its JSON error, as on success.
  const auto failed_json = run_dptrain({"ckpt", "verify", run.string(), "999", "--json"});
  CHECK(failed_json.exit_code == failed.exit_code);
  const auto failure = parse_json(failed_json.out);
  CHECK(failure["status"] == "error");
  REQUIRE(failure["warnings"].size() == 1);
  CHECK(contains(failure["warnings"][0].get<std::string>(),
                 "checking its checkpoints/ all the same"));
  write_text(run / "run.json", info);

  // A run that never reached its first checkpoint has nothing to verify.
  fs::remove_all(run / "checkpoints");
  fs::create_directories(run / "checkpoints");
  CHECK(contains(run_dptrain({"ckpt", "list", run.string()}).out, "no checkpoints"));
  auto none = run_dptrain({"ckpt", "verify", run.string()});
  CHECK(none.exit_code == 5);
  CHECK(contains(none.err, "no checkpoints to verify"));
}

TEST_CASE("ckpt verify refuses a blob file entry outside the checkpoint; resume falls back") {
  TempDir tmp;
  const fs::path run = make_run(tmp);
  const fs::path ck = run / "checkpoints";
  // A byte-for-byte copy outside the checkpoint: a reader that followed the entry would find
  // nothing wrong, so only refusing the entry itself fails it.
  fs::copy_file(ck / "step-000060/params.bin", run / "copy.bin");
  edit_meta(
      ck / "step-000060",
      [](nlohmann::json& m) { m["blobs"]["params"]["file"] = "../../copy.bin"; }, Seal::recompute);

  auto verify = run_dptrain({"ckpt", "verify", run.string()});
  INFO(verify.out, verify.err);
  CHECK(verify.exit_code == 5);
  CHECK(contains(verify.out, "step-000060 (latest): FAILED"));
  auto errors = error_lines(verify.err);
  REQUIRE(errors.size() == 1);
  CHECK(contains(errors[0],
                 "step-000060/meta.json: field 'blobs.params.file' is "
                 "\"../../copy.bin\": refused"));
  CHECK_FALSE(contains(verify.err, "json.exception"));

  // An absolute entry, as in a checkpoint older than meta.json's own checksum.
  edit_meta(
      ck / "step-000040",
      [&](nlohmann::json& m) { m["blobs"]["params"]["file"] = (run / "copy.bin").string(); },
      Seal::remove);
  auto absolute = run_dptrain({"ckpt", "verify", run.string(), "40", "--json"});
  INFO(absolute.out, absolute.err);
  CHECK(absolute.exit_code == 5);
  CHECK(contains(absolute.err, "step-000040/meta.json: field 'blobs.params.file'"));
  CHECK(contains(absolute.err, "is an absolute path"));
  const auto out = parse_json(absolute.out);
  CHECK(out["ok"] == false);
  CHECK(out["checkpoints"][0]["blobs"].empty());  // nothing it names was read
  CHECK(out["checkpoints"][0]["meta"]["ok"] == false);

  auto table = run_dptrain({"ckpt", "list", run.string()});
  INFO(table.out);
  CHECK(table.exit_code == 0);
  CHECK(contains(table_row(table.out, "step-000060"), "FAILED: meta.json: field 'blobs.params"));
  CHECK(contains(table_row(table.out, "step-000020"), " ok"));

  // A resume skips both as it skips corrupt ones, sets them aside and continues from 20.
  auto info = parse_json(read_text(run / "run.json"));
  info["status"] = "failed";
  write_text(run / "run.json", info.dump());
  auto resumed = run_dptrain({"resume", run.string()});
  INFO(resumed.out, resumed.err);
  REQUIRE(resumed.exit_code == 0);
  CHECK(contains(resumed.err, "dptrain: warning: skipping checkpoint step-000060"));
  CHECK(contains(resumed.err, "dptrain: warning: skipping checkpoint step-000040"));
  CHECK(contains(resumed.err, "blobs.params.file"));
  CHECK(contains(resumed.out, "from step-000020"));
  CHECK(fs::exists(ck / "step-000060.corrupt"));
  CHECK(run_dptrain({"ckpt", "verify", run.string(), "--all"}).exit_code == 0);
}

TEST_CASE("ckpt verify detects an edited meta.json; an older one without a checksum is unchecked") {
  TempDir tmp;
  const fs::path run = make_run(tmp);
  const fs::path ck = run / "checkpoints";

  auto healthy = run_dptrain({"ckpt", "verify", run.string(), "--all", "--json"});
  REQUIRE(healthy.exit_code == 0);
  const nlohmann::json checked = parse_json(healthy.out)["checkpoints"];
  REQUIRE_FALSE(checked.empty());
  for (const auto& c : checked) {
    CHECK(c["meta"]["checked"] == true);
    CHECK(c["meta"]["ok"] == true);
    CHECK(c["meta"]["checksum"] == c["meta"]["actual_checksum"]);
  }

  // A field edited by hand (here the epoch, which is where the sampler resumes).
  edit_meta(ck / "step-000060", [](nlohmann::json& m) { m["epoch"] = m["epoch"].get<int>() + 1; });
  auto edited = run_dptrain({"ckpt", "verify", run.string()});
  INFO(edited.out, edited.err);
  CHECK(edited.exit_code == 5);
  CHECK(contains(edited.out, "step-000060 (latest): FAILED"));
  auto errors = error_lines(edited.err);
  REQUIRE(errors.size() == 1);
  CHECK(contains(errors[0], "step-000060/meta.json: checksum mismatch (edited or corrupted)"));
  // ckpt list shows none of the edited meta.json's fields (its epoch would be the edit's).
  const auto listed = run_dptrain({"ckpt", "list", run.string(), "--json"});
  for (const auto& c : parse_json(listed.out)["checkpoints"]) {
    CAPTURE(c["name"]);
    CHECK(c["epoch"].is_null() == (c["step"] == 60));
    CHECK(c["world_size"].is_null() == (c["step"] == 60));
  }
  const auto table = run_dptrain({"ckpt", "list", run.string()});
  for (const auto& line : lines_of(table.out)) {
    if (!line.starts_with("step-000060")) continue;
    const auto w = words_of(line);
    REQUIRE(w.size() > 3);
    CHECK(w[2] == "-");  // EPOCH, after the name and the step
    CHECK(w[3] == "-");  // WORLD
  }

  const auto position = parse_json(read_text(ck / "step-000040/meta.json"));
  // Its checksum taken out along with an edit: the dptrain that records the data's fingerprint
  // always records one, so it cannot be an older checkpoint.
  edit_meta(
      ck / "step-000040", [](nlohmann::json& m) { m["samples_in_epoch"] = 0; }, Seal::remove);
  auto unsealed = run_dptrain({"ckpt", "verify", run.string(), "40"});
  CHECK(unsealed.exit_code == 5);
  CHECK(contains(unsealed.err,
                 "step-000040/meta.json: field 'meta_checksum' is missing, which "
                 "the dptrain that wrote it always records (edited?)"));
  // One written before meta.json recorded a checksum of itself (nor the data's fingerprint)
  // still verifies, and says so.
  edit_meta(
      ck / "step-000040",
      [&](nlohmann::json& m) {
        m["samples_in_epoch"] = position["samples_in_epoch"];
        m.erase("data_fingerprint");
      },
      Seal::remove);
  auto older = run_dptrain({"ckpt", "verify", run.string(), "40"});
  INFO(older.out, older.err);
  CHECK(older.exit_code == 0);
  CHECK(contains(older.out, "step-000040: ok"));
  CHECK(contains(older.out, "not checked: it records no checksum of itself"));
  CHECK(older.err.empty());
  auto older_json = parse_json(run_dptrain({"ckpt", "verify", run.string(), "40", "--json"}).out);
  CHECK(older_json["ok"] == true);
  CHECK(older_json["checkpoints"][0]["meta"]["checked"] == false);
  CHECK(older_json["checkpoints"][0]["meta"]["checksum"].is_null());
  CHECK(contains(table_row(run_dptrain({"ckpt", "list", run.string()}).out, "step-000040"),
                 "ok (meta.json not checked)"));

  // Its step is still held to the directory's name; a missing field is named plainly.
  edit_meta(
      ck / "step-000040", [](nlohmann::json& m) { m["step"] = 45; }, Seal::remove);
  auto step = run_dptrain({"ckpt", "verify", run.string(), "40"});
  CHECK(step.exit_code == 5);
  CHECK(contains(step.err, "step-000040/meta.json: step 45 does not match the directory's name"));
  edit_meta(
      ck / "step-000020", [](nlohmann::json& m) { m.erase("step"); }, Seal::remove);
  auto missing = run_dptrain({"ckpt", "verify", run.string(), "20"});
  INFO(missing.err);
  CHECK(missing.exit_code == 5);
  errors = error_lines(missing.err);
  REQUIRE(errors.size() == 1);
  CHECK(errors[0].ends_with("step-000020/meta.json: missing field 'step'"));
  CHECK_FALSE(contains(missing.err, "json.exception"));
}

TEST_CASE("ckpt of a run whose rank 0 checkpointed on another host points there") {
  TempDir tmp;
  const fs::path run = make_run(tmp);
  // As run.json records it when rank 0 ran remotely: the checkpoints are on that host.
  fs::remove_all(run / "checkpoints");
  // Rank 0 ran here: its checkpoints are gone (a benchmark deletes them), not elsewhere.
  auto info = parse_json(read_text(run / "run.json"));
  CHECK(info["last_checkpoint"]["host"].is_null());
  const auto here = parse_json(run_dptrain({"status", run.string(), "--json"}).out);
  CHECK(here["last_checkpoint"].is_null());
  CHECK(here["last_checkpoint_host"].is_null());
  CHECK_FALSE(contains(run_dptrain({"ckpt", "verify", run.string()}).err, "rank 0 ran"));
  info["last_checkpoint"] = {{"path", "/srv/w/runs/x/checkpoints/step-000060"},
                             {"host", "trainer@10.0.0.2:22"},
                             {"step", 60}};
  write_text(run / "run.json", info.dump());
  const std::string there =
      "its newest checkpoint, /srv/w/runs/x/checkpoints/step-000060, is on trainer@10.0.0.2:22, "
      "where rank 0 ran";
  auto verify = run_dptrain({"ckpt", "verify", run.string()});
  CHECK(verify.exit_code == 5);
  CHECK(contains(verify.err, "no checkpoints to verify (" + there));
  auto list = run_dptrain({"ckpt", "list", run.string()});
  CHECK(list.exit_code == 0);
  CHECK(contains(list.out, "no checkpoints (" + there));
  const auto status = parse_json(run_dptrain({"status", run.string(), "--json"}).out);
  CHECK(status["last_checkpoint_host"] == "trainer@10.0.0.2:22");
  CHECK(status["checkpoints"].is_null());  // not counted here, not 0
  CHECK(here["checkpoints"] == 0);         // rank 0 ran here: none is none
  CHECK(contains(run_dptrain({"report", run.string(), "--out", (tmp / "r.html").string()}).out,
                 "checkpoints on rank 0's host, not counted here"));
  CHECK_FALSE(fs::exists(run / "checkpoints"));  // list and verify change nothing, make nothing
  // A file in its place is named as such: a checkpoint error.
  write_text(run / "checkpoints", "");
  for (const char* command : {"list", "verify"}) {
    auto r = run_dptrain({"ckpt", command, run.string()});
    CHECK(r.exit_code == 5);
    CHECK(contains(r.err, (run / "checkpoints").string() + ": not a directory"));
  }
}

TEST_CASE("ckpt list and verify report a dangling `latest`") {
  TempDir tmp;
  const fs::path run = make_run(tmp);
  const fs::path ck = run / "checkpoints";
  write_text(ck / "latest", "step-000099\n");

  auto verify = run_dptrain({"ckpt", "verify", run.string()});
  INFO(verify.out, verify.err);
  CHECK(verify.exit_code == 5);
  CHECK(contains(verify.out, "step-000060: ok"));  // the newest is still verified
  CHECK(
      contains(verify.out, "checkpoints/latest: FAILED: names step-000099, which does not exist"));
  auto errors = error_lines(verify.err);
  REQUIRE(errors.size() == 1);
  CHECK(contains(errors[0], "checkpoints/latest: names step-000099, which does not exist"));

  CHECK(run_dptrain({"ckpt", "verify", run.string(), "--all"}).exit_code == 5);
  CHECK(run_dptrain({"ckpt", "verify", run.string(), "40"}).exit_code == 0);  // named: not latest
  const auto verify_json = parse_json(run_dptrain({"ckpt", "verify", run.string(), "--json"}).out);
  CHECK(verify_json["ok"] == false);
  CHECK(verify_json["latest"] == "step-000099");
  CHECK(contains(verify_json["latest_problem"].get<std::string>(), "does not exist"));
  CHECK(verify_json["latest_checked"] == true);
  // A STEP named: the same keys, `latest` as it stands, not part of "ok".
  const auto named_json =
      parse_json(run_dptrain({"ckpt", "verify", run.string(), "40", "--json"}).out);
  CHECK(named_json["ok"] == true);
  CHECK(named_json["latest"] == "step-000099");
  CHECK(named_json["latest_problem"] == verify_json["latest_problem"]);
  CHECK(named_json["latest_checked"] == false);

  auto table = run_dptrain({"ckpt", "list", run.string()});
  INFO(table.out);
  CHECK(table.exit_code == 0);
  CHECK(contains(table_row(table.out, "step-000020"), " ok"));  // the rest is still listed
  CHECK(contains(table.out, "checkpoints/latest: FAILED: names step-000099, which does not exist"));
  auto list = list_json(run);
  CHECK(list["checkpoints"].size() == 3);
  CHECK(list["latest"] == "step-000099");
  CHECK(contains(list["latest_problem"].get<std::string>(), "does not exist"));
  for (const auto& c : list["checkpoints"])
    CHECK(c["latest"] == false);

  // What a resume leaves when it set the checkpoint `latest` names aside.
  fs::rename(ck / "step-000060", ck / "step-000060.corrupt");
  write_text(ck / "latest", "step-000060\n");
  auto aside = run_dptrain({"ckpt", "verify", run.string()});
  CHECK(aside.exit_code == 5);
  CHECK(contains(aside.err, "set it aside as step-000060.corrupt"));

  write_text(ck / "latest", "../../etc\n");
  auto garbage = run_dptrain({"ckpt", "verify", run.string(), "--all"});
  CHECK(garbage.exit_code == 5);
  CHECK(contains(garbage.err, "not the name of a checkpoint directory"));

  // A healthy `latest` is no problem at all.
  write_text(ck / "latest", "step-000040\n");
  auto fine = run_dptrain({"ckpt", "verify", run.string(), "--json"});
  CHECK(fine.exit_code == 0);
  CHECK(parse_json(fine.out)["latest_problem"].is_null());
  CHECK(list_json(run)["latest_problem"].is_null());
}

namespace {

// `ckpt verify RUN --all --json` sent SIGINT `after` its handler is in place (in dptrain itself,
// rather than in the test's fork): its JSON object, once it exited 130 saying "interrupted".
nlohmann::json verify_interrupted(const fs::path& run, std::chrono::milliseconds after) {
  Background verify({"ckpt", "verify", run.string(), "--all", "--json"});
  REQUIRE(
      eventually([&] { return catches_signal(verify.pid(), SIGINT); }, std::chrono::seconds(30)));
  std::this_thread::sleep_for(after);
  ::kill(verify.pid(), SIGINT);
  const int code = verify.wait();
  INFO(verify.out(), verify.err());
  REQUIRE(code == 130);
  auto out = parse_json(verify.out());
  CHECK(out["status"] == "interrupted");
  return out;
}

}  // namespace

TEST_CASE("ckpt verify --json stopped by SIGINT still prints its object: interrupted, exit 130") {
  TempDir tmp;
  const fs::path run = make_run(tmp);
  // Enough checkpoints that the verification is still going when the signal comes.
  add_checkpoint_copies(run, 1500);
  const auto out = verify_interrupted(run, std::chrono::milliseconds(0));
  CHECK(out["exit_code"] == 130);
  CHECK(out["ok"] == false);
  CHECK(contains(out["error"].get<std::string>(), "ckpt verify stopped by SIGINT after"));
  CHECK(out["checkpoints"].size() < 1503);
}

TEST_CASE("ckpt verify stopped inside a large checkpoint ends there, reporting none half-read") {
  TempDir tmp;
  const fs::path run = make_run(tmp);
  // The newest checkpoint (verified first) holds a 64 GiB params.bin, as its meta.json says
  // (sparse: it takes no room): checksumming it all takes seconds.
  const fs::path ck = run / "checkpoints/step-000060";
  const uint64_t big = uint64_t{64} << 30;
  fs::resize_file(ck / "params.bin", big);
  auto meta = parse_json(read_text(ck / "meta.json"));
  meta["blobs"]["params"]["bytes"] = big;
  meta.erase("meta_checksum");
  meta["meta_checksum"] = dptrain::meta_json_checksum(meta.dump());
  write_text(ck / "meta.json", meta.dump(2));
  const auto out = verify_interrupted(run, std::chrono::milliseconds(300));
  // Stopped inside step-000060: not reported as checked (nor as damaged), and nothing after it.
  CHECK(out["checkpoints"].empty());
  CHECK(contains(out["error"].get<std::string>(), "ckpt verify stopped by SIGINT after 0 "));
}

TEST_CASE("status, report and ckpt list --json stopped by a signal print their object: 130/143") {
  TempDir tmp;
  const fs::path run = make_run(tmp);
  // Enough checkpoints and metrics lines that each command still reads when the signal comes.
  add_checkpoint_copies(run, 1500);
  {
    std::ofstream metrics(run / "metrics.jsonl", std::ios::app);
    for (int step = 100; step < 300100; ++step)
      metrics << R"({"step":)" << step << R"(,"loss":1.25,"lr":0.001,"samples_per_s":1000.5})"
              << '\n';
  }
  const auto report_before = fs::exists(run / "report.html");
  for (const auto& [args, sig, says] :
       std::vector<std::tuple<std::vector<std::string>, int, std::string>>{
           {{"status", run.string(), "--json"}, SIGINT, "stopped by SIGINT while status read"},
           {{"report", run.string(), "--json"},
            SIGTERM,
            "stopped by SIGTERM before the report was written"},
           {{"ckpt", "list", run.string(), "--json"},
            SIGINT,
            "stopped by SIGINT while ckpt list read"}}) {
    CAPTURE(args[0]);
    Background command(args);
    // The signal once its handler is in place, in dptrain itself rather than in the test's fork.
    REQUIRE(
        eventually([&] { return catches_signal(command.pid(), sig); }, std::chrono::seconds(30)));
    ::kill(command.pid(), sig);
    const int code = command.wait();
    INFO(command.out(), command.err());
    REQUIRE(code == 128 + sig);
    const auto out = parse_json(command.out());
    CHECK(out["status"] == (sig == SIGINT ? "interrupted" : "terminated"));
    CHECK(out["exit_code"] == 128 + sig);
    CHECK(contains(out["error"].get<std::string>(), says));
  }
  CHECK(fs::exists(run / "report.html") == report_before);  // a stopped report writes nothing
}

TEST_CASE("ckpt checks the recipe from run.json, its data not read; an unreadable one is warned") {
  TempDir tmp;
  std::string rows;
  for (int i = 0; i < 200; ++i)
    rows += fmt::format("{},{},{},{}\n", i % 3, i % 7, i % 5, i % 3);
  write_text(tmp / "data.csv", rows);
  auto recipe = small_recipe();
  recipe["model"] = {{"type", "mlp"}, {"input", 3}, {"hidden", {8}}, {"classes", 3}};
  recipe["data"] = {{"type", "csv"}, {"path", "data.csv"}};
  recipe["train"]["steps"] = 40;
  const fs::path run = tmp / "run";
  auto launched = run_dptrain({"launch", write_recipe(tmp.path(), recipe).string(), "--nproc", "2",
                               "--run-dir", run.string()});
  INFO(launched.err);
  REQUIRE(launched.exit_code == 0);
  // Another recipe's checkpoint, sealed as it would be; then the dataset moves away (and the
  // copy in recipe.json is broken, as run.json's is the one resume reads).
  edit_meta(
      run / "checkpoints/step-000040",
      [](nlohmann::json& m) { m["recipe_hash"] = "0123456789abcdef"; }, Seal::recompute);
  fs::rename(tmp / "data.csv", tmp / "moved.csv");
  write_text(run / "recipe.json", "{");

  const auto verify = run_dptrain({"ckpt", "verify", run.string(), "step-000040"});
  CHECK(verify.exit_code == 5);
  CHECK_MESSAGE(contains(verify.err, (run / "checkpoints/step-000040/meta.json").string() +
                                         ": written by a different recipe (hash 0123456789abcdef"),
                verify.err);
  CHECK_FALSE(contains(verify.err, "warning"));
  // Copied in under another step's name as well: the table's meta.json line gives both reasons,
  // as the error lines do.
  fs::copy(run / "checkpoints/step-000040", run / "checkpoints/step-000060",
           fs::copy_options::recursive);
  const auto twice_wrong = run_dptrain({"ckpt", "verify", run.string(), "step-000060"});
  const auto twice_json = run_dptrain({"ckpt", "verify", run.string(), "step-000060", "--json"});
  fs::remove_all(run / "checkpoints/step-000060");
  CHECK(twice_wrong.exit_code == 5);
  CHECK(count_occurrences(twice_wrong.err, "step-000060/meta.json: ") == 2);
  std::string meta_line;
  for (const auto& line : lines_of(twice_wrong.out)) {
    if (line.starts_with("  meta.json")) meta_line = line;
  }
  CAPTURE(twice_wrong.out);
  CHECK(contains(meta_line, "; written by a different recipe (hash 0123456789abcdef"));
  // Its JSON says the same of meta.json: not ok, for both reasons.
  const auto foreign_meta = parse_json(twice_json.out)["checkpoints"][0]["meta"];
  CAPTURE(foreign_meta.dump());
  CHECK(foreign_meta["ok"] == false);
  const std::string meta_problem = foreign_meta["problem"].get<std::string>();
  CHECK(contains(meta_line, meta_problem));  // the table's words
  CHECK(contains(meta_problem, "; written by a different recipe (hash 0123456789abcdef"));
  // By default the newest of this recipe is verified, and the one `latest` names as well.
  const auto by_default = run_dptrain({"ckpt", "verify", run.string(), "--json"});
  CHECK(by_default.exit_code == 5);
  CHECK_MESSAGE(contains(by_default.err, (run / "checkpoints/step-000040/meta.json").string() +
                                             ": written by a different recipe"),
                by_default.err);
  const auto verified = parse_json(by_default.out);
  REQUIRE(verified["checkpoints"].size() == 2);
  CHECK(verified["checkpoints"][0]["name"] == "step-000040");
  CHECK(verified["checkpoints"][0]["ok"] == false);
  CHECK(verified["checkpoints"][1]["ok"] == true);
  const auto listed = list_json(run);
  for (const auto& row : listed["checkpoints"]) {
    CAPTURE(row["name"]);
    CHECK(row["ok"] == (row["name"] != "step-000040"));
  }

  // A run.json whose recipe no longer parses: one warning line, and the files are still checked.
  auto info = parse_json(read_text(run / "run.json"));
  info["recipe"]["model"]["hidden"] = "wide";
  write_text(run / "run.json", info.dump());
  const auto unchecked = run_dptrain({"ckpt", "verify", run.string(), "step-000040"});
  CHECK(unchecked.exit_code == 0);
  CHECK_MESSAGE(
      contains(unchecked.err, "dptrain: warning: the run's recipe cannot be read (" +
                                  (run / "run.json").string() + ": /recipe/model/hidden: "),
      unchecked.err);
  CHECK(std::count(unchecked.err.begin(), unchecked.err.end(), '\n') == 1);
  // Nor is a run whose recipe is nowhere to be found checked in silence.
  info.erase("recipe");
  write_text(run / "run.json", info.dump());
  fs::remove(run / "recipe.json");
  const auto none = run_dptrain({"ckpt", "verify", run.string(), "step-000020"});
  CHECK(none.exit_code == 0);
  CHECK(none.err == "dptrain: warning: the run's recipe cannot be read (neither " +
                        (run / "run.json").string() + " nor " + (run / "recipe.json").string() +
                        " holds one): its checkpoints are checked as files, not for which recipe "
                        "wrote them\n");
  const auto none_json = run_dptrain({"ckpt", "verify", run.string(), "step-000020", "--json"});
  CHECK(none_json.exit_code == 0);
  CHECK(parse_json(none_json.out)["warnings"] ==
        nlohmann::json::array({none.err.substr(18, none.err.size() - 19)}));
  // A run.json that reads but records nothing (an empty object) is not called unreadable.
  write_text(run / "run.json", "{}");
  const auto empty = run_dptrain({"ckpt", "list", run.string()});
  CHECK(empty.exit_code == 0);
  CHECK(contains(empty.err, "the run's recipe cannot be read (neither " +
                                (run / "run.json").string() + " nor "));
}
