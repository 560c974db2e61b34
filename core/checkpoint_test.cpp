// Checkpoint format: round trip, verification, pruning, and the fallback order on resume.
#include "core/checkpoint.hpp"

#include <doctest/doctest.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <functional>

#include <nlohmann/json.hpp>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "tests/damage.hpp"
#include "tests/temp_dir.hpp"

namespace fs = std::filesystem;
using namespace dptrain;
using dptrain::test::flip_byte;
using dptrain::test::TempDir;

namespace {

TrainingPosition position(int64_t step) {
  TrainingPosition p;
  p.step = step;
  p.epoch = 2;
  p.samples_in_epoch = 640;
  p.world_size = 2;
  p.global_batch = 128;
  p.optimizer_steps = step;
  p.recipe_hash = "0123456789abcdef";
  p.data_fingerprint = "values 0011223344556677";
  p.rng_state = "sampler seed=1 epoch=2";
  p.loss_scale = 32768.0;
  p.loss_scale_clean_steps = 17;
  p.loss = 1.25;
  return p;
}

std::vector<float> values(size_t n, float base) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = base + static_cast<float>(i) * 0.25f;
  return v;
}

}  // namespace

TEST_CASE("checkpoint: write, read back, latest") {
  TempDir tmp;
  const auto params = values(1001, 1.0f);
  const auto optim = values(2002, -3.0f);
  const fs::path dir = write_checkpoint(tmp.path(), position(100), params, optim, 3);
  CHECK(dir.filename() == "step-000100");
  CHECK(read_file(tmp.path() / "latest") == "step-000100\n");
  const CheckpointData back = read_checkpoint(dir);
  CHECK(back.params == params);
  CHECK(back.optimizer_state == optim);
  CHECK(back.position.step == 100);
  CHECK(back.position.epoch == 2);
  CHECK(back.position.samples_in_epoch == 640);
  CHECK(back.position.world_size == 2);
  CHECK(back.position.global_batch == 128);
  CHECK(back.position.recipe_hash == "0123456789abcdef");
  CHECK(back.position.data_fingerprint == "values 0011223344556677");
  CHECK(back.position.rng_state == "sampler seed=1 epoch=2");
  CHECK(back.position.loss_scale == 32768.0);  // fp16's scaler resumes where it was
  CHECK(back.position.loss_scale_clean_steps == 17);
  CHECK(back.position.loss == 1.25);
  // No temporary directory is left behind.
  for (const auto& e : fs::directory_iterator(tmp.path())) {
    CHECK(e.path().filename().string().rfind(".tmp", 0) != 0);
  }
}

TEST_CASE("checkpoint: the comm state is a blob of its own, only when there is one") {
  TempDir tmp;
  const auto params = values(10, 1.0f);
  const auto comm = values(40, 0.5f);
  const fs::path with = write_checkpoint(tmp.path(), position(10), params, {}, 3, {}, comm);
  CHECK(fs::exists(with / "comm.bin"));
  CHECK(read_checkpoint(with).comm_state == comm);
  const CheckpointStatus status = verify_checkpoint(with);
  CHECK(status.ok());
  CHECK(status.blobs.size() == 3);
  // Without one (and so in checkpoints older than it) there is no file and no entry.
  const fs::path without = write_checkpoint(tmp.path(), position(20), params, {}, 3);
  CHECK(!fs::exists(without / "comm.bin"));
  CHECK(read_file(without / "meta.json").find("comm") == std::string::npos);
  CHECK(read_checkpoint(without).comm_state.empty());
  CHECK(verify_checkpoint(without).blobs.size() == 2);
  // Damage to it is found like damage to any blob.
  flip_byte(with / "comm.bin", 7);
  CHECK_THROWS_WITH_AS(read_checkpoint(with), doctest::Contains("comm.bin: checksum mismatch"),
                       Error);
}

TEST_CASE("checkpoint: empty optimizer state and zero parameters round-trip") {
  TempDir tmp;
  const fs::path dir = write_checkpoint(tmp.path(), position(0), {}, {}, 1);
  const CheckpointData back = read_checkpoint(dir);
  CHECK(back.params.empty());
  CHECK(back.optimizer_state.empty());
}

TEST_CASE("checkpoint: keep prunes the oldest, newest first listing") {
  TempDir tmp;
  const auto p = values(10, 0.0f);
  for (int64_t s : {10, 20, 30, 40, 50})
    write_checkpoint(tmp.path(), position(s), p, p, 2);
  const auto all = list_checkpoints(tmp.path());
  REQUIRE(all.size() == 2);
  CHECK(all[0].filename() == "step-000050");
  CHECK(all[1].filename() == "step-000040");
  // Pruned checkpoints are renamed away before they are deleted; what a crash left of one then is
  // no checkpoint, and is cleaned up with interrupted writes.
  CHECK(fs::directory_iterator(tmp.path()) != fs::directory_iterator());
  for (const auto& e : fs::directory_iterator(tmp.path()))
    CHECK(e.path().filename().string().rfind(".pruned-", 0) != 0);
  fs::create_directories(tmp.path() / ".pruned-step-000030");
  write_file_atomic(tmp.path() / ".pruned-step-000030" / "params.bin", "x");
  CHECK(list_checkpoints(tmp.path()).size() == 2);
  remove_incomplete_checkpoints(tmp.path());
  CHECK_FALSE(fs::exists(tmp.path() / ".pruned-step-000030"));
}

TEST_CASE("verify_checkpoint: a checkpoint removed while it is read is gone, not damaged") {
  TempDir tmp;
  const auto p = values(10, 0.0f);
  const fs::path dir = write_checkpoint(tmp.path(), position(10), p, p, 2);
  CHECK_FALSE(verify_checkpoint(dir).gone);
  fs::remove(dir / "params.bin");
  const CheckpointStatus damaged = verify_checkpoint(dir);
  CHECK_FALSE(damaged.ok());
  CHECK_FALSE(damaged.gone);  // still there, so damaged
  fs::remove_all(dir);
  const CheckpointStatus gone = verify_checkpoint(dir);
  CHECK_FALSE(gone.ok());
  CHECK(gone.gone);
}

TEST_CASE("checkpoint: every kind of damage is detected and named") {
  TempDir tmp;
  const auto p = values(257, 2.0f);
  const fs::path dir = write_checkpoint(tmp.path(), position(7), p, p, 1);
  auto expect_error = [&](const char* phrase) {
    try {
      read_checkpoint(dir);
      FAIL("damage was not detected");
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::checkpoint);
      CHECK(std::string(e.what()).find(phrase) != std::string::npos);
    }
  };
  SUBCASE("a flipped bit") {
    flip_byte(dir / "params.bin", 100);
    expect_error("checksum mismatch");
  }
  SUBCASE("truncated") {
    fs::resize_file(dir / "optimizer.bin", 12);
    expect_error("truncated");
  }
  SUBCASE("a missing blob") {
    fs::remove(dir / "params.bin");
    expect_error("params.bin");
  }
  SUBCASE("torn metadata") {
    fs::resize_file(dir / "meta.json", 40);
    expect_error("meta.json");
  }
  SUBCASE("no metadata") {
    fs::remove(dir / "meta.json");
    expect_error("meta.json");
  }
}

TEST_CASE("find_valid_checkpoint: newest valid wins, damaged ones are reported") {
  TempDir tmp;
  const auto p = values(64, 5.0f);
  for (int64_t s : {10, 20, 30})
    write_checkpoint(tmp.path(), position(s), p, p, 5);
  std::vector<std::string> warnings;
  auto warn = [&](const std::string& w) { warnings.push_back(w); };
  CHECK(find_valid_checkpoint(tmp.path(), warn).filename() == "step-000030");
  CHECK(warnings.empty());

  flip_byte(tmp.path() / "step-000030/params.bin", 3);
  CHECK(find_valid_checkpoint(tmp.path(), warn).filename() == "step-000020");
  REQUIRE(warnings.size() == 1);
  CHECK(warnings[0].find("step-000030") != std::string::npos);

  // `latest` pointing at a directory that is gone, or holding garbage, is not fatal; the
  // warning says what is wrong with it.
  warnings.clear();
  write_file_atomic(tmp.path() / "latest", "step-000099\n");
  CHECK(find_valid_checkpoint(tmp.path(), warn).filename() == "step-000020");
  REQUIRE_FALSE(warnings.empty());
  CHECK(warnings[0] ==
        (tmp.path() / "latest").string() + ": names step-000099, which does not exist");
  write_file_atomic(tmp.path() / "latest", "../../etc\n");
  CHECK(find_valid_checkpoint(tmp.path(), warn).filename() == "step-000020");

  for (int64_t s : {10, 20})
    fs::remove(tmp.path() / checkpoint_name(s) / "meta.json");
  warnings.clear();
  CHECK_THROWS_AS(find_valid_checkpoint(tmp.path(), warn), Error);
  // Said once: under the error, not also as warnings first.
  CHECK(warnings.empty());
  try {
    find_valid_checkpoint(tmp.path(), warn);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::checkpoint);
    const std::string what = e.what();
    CHECK(what.find("no valid checkpoint") != std::string::npos);
    // Why each was passed over, on the lines below (a --json error carries them).
    CHECK(what.find("\n  skipping checkpoint step-000020: ") != std::string::npos);
    CHECK(what.find("\n  skipping checkpoint step-000010: ") != std::string::npos);
  }
  CHECK_THROWS_AS(find_valid_checkpoint(tmp.path() / "absent", warn), Error);
}

TEST_CASE("find_valid_checkpoint: a filter skips checkpoints that verify but cannot be used") {
  TempDir tmp;
  const auto p = values(64, 5.0f);
  for (int64_t s : {10, 20})
    write_checkpoint(tmp.path(), position(s), p, p, 5);
  TrainingPosition foreign = position(30);
  foreign.recipe_hash = "fedcba9876543210";
  write_checkpoint(tmp.path(), foreign, p, p, 5);  // `latest` names it
  std::vector<std::string> warnings;
  auto warn = [&](const std::string& w) { warnings.push_back(w); };
  const CheckpointFilter ours = [](const TrainingPosition& pos) {
    return pos.recipe_hash == "0123456789abcdef" ? std::string() : "another recipe's";
  };
  CHECK(find_valid_checkpoint(tmp.path(), warn, ours).filename() == "step-000020");
  CHECK(warnings == std::vector<std::string>{"skipping checkpoint step-000030: another recipe's"});
  // Without one, it is the newest valid one.
  CHECK(find_valid_checkpoint(tmp.path(), warn).filename() == "step-000030");
  // None usable is none valid.
  const CheckpointFilter none = [](const TrainingPosition&) { return std::string("no"); };
  CHECK_FALSE(try_find_valid_checkpoint(tmp.path(), warn, none));
}

TEST_CASE("checkpoint: a write that cannot happen leaves latest alone") {
  TempDir tmp;
  const auto p = values(8, 1.0f);
  write_checkpoint(tmp.path(), position(1), p, p, 3);
  // A regular file where the checkpoints directory should be.
  const fs::path blocked = tmp.path() / "blocked";
  std::ofstream(blocked) << "x";
  CHECK_THROWS_AS(write_checkpoint(blocked, position(2), p, p, 3), Error);
  CHECK(read_file(tmp.path() / "latest") == "step-000001\n");
}

TEST_CASE("checkpoint: a `latest` that cannot be written is named once, as a checkpoint error") {
  TempDir tmp;
  const auto p = values(8, 1.0f);
  fs::create_directories(tmp.path() / "latest/in-the-way");  // rename cannot replace it
  try {
    write_checkpoint(tmp.path(), position(1), p, p, 3);
    FAIL("moved latest over a directory");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::checkpoint);
    const std::string what = e.what();
    CHECK(what.starts_with((tmp.path() / "latest").string() + ": cannot "));
    CHECK(what.find("latest", what.find(':')) == std::string::npos);
  }
}

TEST_CASE("verify_checkpoint: reports every damaged blob, not just the first") {
  TempDir tmp;
  const auto p = values(100, 1.0f);
  const fs::path dir = write_checkpoint(tmp.path(), position(5), p, values(50, 2.0f), 1);
  CheckpointStatus ok = verify_checkpoint(dir);
  CHECK(ok.ok());
  CHECK(ok.step == 5);
  REQUIRE(ok.position);
  CHECK(ok.position->world_size == 2);
  REQUIRE(ok.blobs.size() == 2);
  CHECK(ok.blobs[0].file == "params.bin");
  CHECK(ok.blobs[0].bytes == 400);
  CHECK(ok.blobs[1].file == "optimizer.bin");
  CHECK(ok.blobs[1].actual_checksum == ok.blobs[1].checksum);

  flip_byte(dir / "params.bin", 9);
  fs::resize_file(dir / "optimizer.bin", 6);
  const CheckpointStatus bad = verify_checkpoint(dir);
  CHECK_FALSE(bad.ok());
  REQUIRE(bad.problems().size() == 2);
  CHECK(bad.problems()[0].find("params.bin: checksum mismatch") == 0);
  CHECK(bad.problems()[1].find("optimizer.bin: truncated or wrong size: 6 bytes") == 0);
  CHECK(*bad.blobs[1].actual_bytes == 6);

  fs::remove(dir / "meta.json");
  fs::rename(dir, tmp.path() / "step-000005.corrupt");
  const CheckpointStatus torn = verify_checkpoint(tmp.path() / "step-000005.corrupt");
  CHECK(torn.step == 5);  // from the name
  CHECK(torn.set_aside);
  CHECK_FALSE(torn.position);
  CHECK(torn.blobs.empty());
  REQUIRE(torn.problems().size() == 1);
  CHECK(torn.problems()[0] == "meta.json: missing");
}

TEST_CASE("list_checkpoints with set-aside ones, checkpoint_step, latest_checkpoint") {
  TempDir tmp;
  const auto p = values(4, 0.0f);
  for (int64_t s : {10, 20})
    write_checkpoint(tmp.path(), position(s), p, p, 5);
  fs::rename(tmp.path() / "step-000020", tmp.path() / "step-000020.corrupt");
  write_checkpoint(tmp.path(), position(20), p, p, 5);
  fs::create_directory(tmp.path() / "step-000030.old");  // not a checkpoint
  CHECK(list_checkpoints(tmp.path()).size() == 2);
  const auto all = list_checkpoints(tmp.path(), SetAside::include);
  REQUIRE(all.size() == 3);
  CHECK(all[0].filename() == "step-000020");
  CHECK(all[1].filename() == "step-000020.corrupt");
  CHECK(all[2].filename() == "step-000010");
  CHECK(checkpoint_step(all[1]) == 20);
  CHECK(checkpoint_step(tmp.path() / "step-000030.old") == -1);
  CHECK(checkpoint_step(tmp.path() / "latest") == -1);
  // Set aside again at that step: the next free name, none replaced.
  CHECK(set_aside_path(all[0]) == tmp.path() / "step-000020.corrupt-2");
  fs::rename(all[0], set_aside_path(all[0]));
  write_checkpoint(tmp.path(), position(20), p, p, 5);
  CHECK(set_aside_path(all[0]) == tmp.path() / "step-000020.corrupt-3");
  CHECK(set_aside_path(all[2]) == tmp.path() / "step-000010.corrupt");
  CHECK(checkpoint_step(tmp.path() / "step-000020.corrupt-2") == 20);
  CHECK(checkpoint_step(tmp.path() / "step-000020.corrupt-") == -1);
  CHECK(checkpoint_step(tmp.path() / "step-000020.corrupt-x") == -1);
  CHECK(list_checkpoints(tmp.path()).size() == 2);
  CHECK(list_checkpoints(tmp.path(), SetAside::include).size() == 4);

  CHECK(latest_checkpoint(tmp.path()) == tmp.path() / "step-000020");
  write_file_atomic(tmp.path() / "latest", "../step-000010\n");  // never outside checkpoints/
  CHECK(latest_checkpoint(tmp.path()).empty());
  fs::remove(tmp.path() / "latest");
  CHECK(latest_checkpoint(tmp.path()).empty());
}

TEST_CASE("checkpoint: a blob's file entry never leads outside the checkpoint directory") {
  TempDir tmp;
  const auto p = values(64, 5.0f);
  for (int64_t s : {10, 20})
    write_checkpoint(tmp.path(), position(s), p, p, 5);
  const fs::path dir = tmp.path() / "step-000020";
  const std::string original = read_file(dir / "meta.json");
  // Byte-for-byte copies of params.bin elsewhere: a reader that followed the entry would find
  // nothing wrong with it.
  fs::copy_file(dir / "params.bin", tmp.path() / "outside.bin");
  fs::create_directory(dir / "sub");
  fs::copy_file(dir / "params.bin", dir / "sub" / "params.bin");
  fs::copy_file(dir / "params.bin", dir / "..params.bin");
  struct Case {
    std::string entry;
    std::string why;
  };
  const std::vector<Case> cases = {
      {"../outside.bin", "contains '/'"},
      {"../../../../../../../../" + (tmp.path() / "outside.bin").string(), "contains '/'"},
      {(tmp.path() / "outside.bin").string(), "is an absolute path"},
      {"sub/params.bin", "contains '/'"},
      {"..params.bin", "contains '..'"},
      {"..", "contains '..'"},
      {".", "names the checkpoint directory itself"},
      {"", "is empty"},
  };
  for (const Case& c : cases) {
    for (const test::Seal seal : {test::Seal::recompute, test::Seal::remove}) {
      CAPTURE(c.entry);
      CAPTURE(static_cast<int>(seal));
      test::edit_meta(
          dir, [&](nlohmann::json& m) { m["blobs"]["params"]["file"] = c.entry; }, seal);
      const std::string named =
          "meta.json: field 'blobs.params.file' is " + nlohmann::json(c.entry).dump();
      try {
        read_checkpoint(dir);
        FAIL("a file entry outside the checkpoint was followed");
      } catch (const Error& e) {
        const std::string what = e.what();
        CHECK(e.kind() == ErrorKind::checkpoint);
        CHECK(what.find((dir / named).string()) == 0);  // the checkpoint and the entry
        CHECK(what.find(c.why) != std::string::npos);
        CHECK(what.find("refused") != std::string::npos);
      }
      const CheckpointStatus status = verify_checkpoint(dir);
      CHECK_FALSE(status.ok());
      CHECK_FALSE(status.position);
      CHECK(status.blobs.empty());  // nothing it names is read
      REQUIRE(status.problems().size() == 1);
      CHECK(status.problems()[0].find(named) == 0);
      // A resume treats it as it treats a corrupt one: the previous checkpoint is used.
      std::vector<std::string> warnings;
      CHECK(find_valid_checkpoint(tmp.path(), [&](const std::string& w) {
              warnings.push_back(w);
            }).filename() == "step-000010");
      REQUIRE(warnings.size() == 1);
      CHECK(warnings[0].find("skipping checkpoint step-000020") == 0);
      CHECK(warnings[0].find("blobs.params.file") != std::string::npos);
    }
  }
  // The entries of the other blobs are held to the same rule.
  write_file_atomic(dir / "meta.json", original);
  test::edit_meta(dir,
                  [](nlohmann::json& m) { m["blobs"]["optimizer"]["file"] = "/etc/hostname"; });
  CHECK_THROWS_WITH_AS(read_checkpoint(dir),
                       doctest::Contains("field 'blobs.optimizer.file' is \"/etc/hostname\""),
                       Error);

  // A plain name that is a symbolic link to a good copy elsewhere is refused too.
  write_file_atomic(dir / "meta.json", original);
  CHECK(verify_checkpoint(dir).ok());
  fs::remove(dir / "params.bin");
  fs::create_symlink(tmp.path() / "outside.bin", dir / "params.bin");
  CHECK_THROWS_WITH_AS(read_checkpoint(dir), doctest::Contains("params.bin: a symbolic link"),
                       Error);
  const CheckpointStatus linked = verify_checkpoint(dir);
  REQUIRE(linked.problems().size() == 1);
  CHECK(linked.problems()[0].find("params.bin: a symbolic link: refused") == 0);
  CHECK_FALSE(linked.blobs[0].actual_bytes);  // not read
}

TEST_CASE("checkpoint: meta.json records a checksum of its own content") {
  TempDir tmp;
  const auto p = values(64, 5.0f);
  for (int64_t s : {10, 20})
    write_checkpoint(tmp.path(), position(s), p, p, 5);
  const fs::path dir = tmp.path() / "step-000020";
  const std::string original = read_file(dir / "meta.json");
  const auto meta = nlohmann::json::parse(original);
  REQUIRE(meta.contains("meta_checksum"));
  CHECK(meta["meta_checksum"] == meta_json_checksum(original));
  CHECK(meta["meta_checksum"].get<std::string>().size() == 16);
  const CheckpointStatus fine = verify_checkpoint(dir);
  CHECK(fine.ok());
  CHECK(fine.meta_checked());
  CHECK(fine.meta_checksum == meta["meta_checksum"]);
  CHECK(fine.meta_actual_checksum == fine.meta_checksum);

  // The layout of the file is not its content: compact, it still verifies.
  write_file_atomic(dir / "meta.json", meta.dump());
  CHECK(verify_checkpoint(dir).ok());
  CHECK(meta_json_checksum(meta.dump()) == meta_json_checksum(original));

  auto expect_mismatch = [&](const std::function<void(nlohmann::json&)>& edit) {
    write_file_atomic(dir / "meta.json", original);
    test::edit_meta(dir, edit, test::Seal::keep);
    CHECK_THROWS_WITH_AS(read_checkpoint(dir),
                         doctest::Contains("step-000020/meta.json: checksum mismatch"), Error);
    const CheckpointStatus status = verify_checkpoint(dir);
    CHECK_FALSE(status.ok());
    CHECK(status.meta_checked());
    CHECK(status.meta_actual_checksum != status.meta_checksum);
    REQUIRE_FALSE(status.problems().empty());
    CHECK(status.problems()[0].find("meta.json: checksum mismatch (edited or corrupted)") == 0);
    CHECK(status.blobs.size() == 2);  // the blobs are still checked and shown
    std::vector<std::string> warnings;
    CHECK(find_valid_checkpoint(tmp.path(), [&](const std::string& w) {
            warnings.push_back(w);
          }).filename() == "step-000010");
    CHECK(warnings.size() == 1);
  };
  SUBCASE("epoch") {
    expect_mismatch([](nlohmann::json& m) { m["epoch"] = 3; });
  }
  SUBCASE("samples in the epoch") {
    expect_mismatch([](nlohmann::json& m) { m["samples_in_epoch"] = 0; });
  }
  SUBCASE("rng state") {
    expect_mismatch([](nlohmann::json& m) { m["rng_state"] = "sampler seed=1 epoch=3"; });
  }
  SUBCASE("a blob's recorded checksum") {
    expect_mismatch(
        [](nlohmann::json& m) { m["blobs"]["params"]["checksum"] = "0123456789abcdef"; });
  }
  SUBCASE("step: the directory's name says otherwise too") {
    expect_mismatch([](nlohmann::json& m) { m["step"] = 30; });
    CHECK(verify_checkpoint(dir).problems()[0].find(
              "; step 30 does not match the directory's name step-000020") != std::string::npos);
  }
  SUBCASE("the recorded checksum itself") {
    write_file_atomic(dir / "meta.json", original);
    test::edit_meta(dir, [](nlohmann::json& m) { m["meta_checksum"] = "0000000000000000"; });
    CHECK_FALSE(verify_checkpoint(dir).ok());
    test::edit_meta(dir, [](nlohmann::json& m) { m["meta_checksum"] = "not a checksum"; });
    CHECK(verify_checkpoint(dir).problems() ==
          std::vector<std::string>{
              "meta.json: field 'meta_checksum' is not a checksum (16 hex digits)"});
  }
  SUBCASE("older checkpoints record none: read, but not checked") {
    write_file_atomic(dir / "meta.json", original);
    // Older than the data's fingerprint too; with that field, the checksum is missing.
    test::edit_meta(
        dir, [](nlohmann::json&) {}, test::Seal::remove);
    CHECK(verify_checkpoint(dir).problems() ==
          std::vector<std::string>{"meta.json: field 'meta_checksum' is missing, which the "
                                   "dptrain that wrote it always records (edited?)"});
    test::edit_meta(
        dir, [](nlohmann::json& m) { m.erase("data_fingerprint"); }, test::Seal::remove);
    const CheckpointStatus older = verify_checkpoint(dir);
    CHECK(older.ok());
    CHECK_FALSE(older.meta_checked());
    CHECK(older.meta_checksum.empty());
    CHECK(read_checkpoint(dir).position.epoch == 2);
    // Its step is still held to the directory's name.
    test::edit_meta(
        dir, [](nlohmann::json& m) { m["step"] = 21; }, test::Seal::remove);
    REQUIRE_FALSE(nlohmann::json::parse(read_file(dir / "meta.json")).contains("data_fingerprint"));
    CHECK(verify_checkpoint(dir).problems() ==
          std::vector<std::string>{
              "meta.json: step 21 does not match the directory's name step-000020"});
    CHECK_THROWS_AS(read_checkpoint(dir), Error);
  }
  SUBCASE("an edit that records a new checksum is what the checksum cannot catch") {
    // It detects corruption and careless edits; it is not a signature.
    write_file_atomic(dir / "meta.json", original);
    test::edit_meta(
        dir, [](nlohmann::json& m) { m["epoch"] = 3; }, test::Seal::recompute);
    CHECK(verify_checkpoint(dir).ok());
  }
  CHECK_THROWS_AS(meta_json_checksum("[1, 2]"), Error);
  CHECK_THROWS_AS(meta_json_checksum("{"), Error);
}

TEST_CASE("checkpoint: a malformed meta.json is named plainly, field by field") {
  TempDir tmp;
  const auto p = values(16, 1.0f);
  const fs::path dir = write_checkpoint(tmp.path(), position(20), p, p, 5);
  const std::string original = read_file(dir / "meta.json");
  struct Case {
    std::function<void(nlohmann::json&)> edit;
    std::string problem;
  };
  const std::vector<Case> cases = {
      {[](nlohmann::json& m) { m.erase("step"); }, "missing field 'step'"},
      {[](nlohmann::json& m) { m.erase("rng_state"); }, "missing field 'rng_state'"},
      {[](nlohmann::json& m) { m["epoch"] = "two"; }, "field 'epoch' is not an integer"},
      {[](nlohmann::json& m) { m["epoch"] = 2.5; }, "field 'epoch' is not an integer"},
      {[](nlohmann::json& m) { m["world_size"] = -2; }, "field 'world_size' is negative (-2)"},
      {[](nlohmann::json& m) { m["recipe_hash"] = 7; }, "field 'recipe_hash' is not a string"},
      {[](nlohmann::json& m) { m["loss_scale"] = "big"; }, "field 'loss_scale' is not a number"},
      {[](nlohmann::json& m) { m["loss"] = "low"; }, "field 'loss' is not a number"},
      {[](nlohmann::json& m) { m["format"] = 2; },
       "unsupported format 2 (this dptrain reads format 1)"},
      {[](nlohmann::json& m) { m.erase("blobs"); }, "missing field 'blobs'"},
      {[](nlohmann::json& m) { m["blobs"] = 1; }, "field 'blobs' is not an object"},
      {[](nlohmann::json& m) { m["blobs"].erase("params"); }, "missing field 'blobs.params'"},
      {[](nlohmann::json& m) { m["blobs"]["params"].erase("checksum"); },
       "missing field 'blobs.params.checksum'"},
      {[](nlohmann::json& m) { m["blobs"]["optimizer"]["bytes"] = -4; },
       "field 'blobs.optimizer.bytes' is not a non-negative integer"},
      {[](nlohmann::json& m) { m["blobs"]["params"]["file"] = nullptr; },
       "field 'blobs.params.file' is not a string"},
      {[](nlohmann::json& m) {
         m = nlohmann::json::array({1, 2});
       },
       "not a JSON object"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.problem);
    write_file_atomic(dir / "meta.json", original);
    test::edit_meta(dir, c.edit, test::Seal::remove);
    try {
      read_checkpoint(dir);
      FAIL("a malformed meta.json was read");
    } catch (const Error& e) {
      CHECK(std::string(e.what()) == (dir / "meta.json").string() + ": " + c.problem);
    }
    const CheckpointStatus status = verify_checkpoint(dir);
    CHECK(status.problems() == std::vector<std::string>{"meta.json: " + c.problem});
    CHECK(status.step == 20);  // from the name
  }
  // Fields older checkpoints lack still default.
  write_file_atomic(dir / "meta.json", original);
  test::edit_meta(
      dir,
      [](nlohmann::json& m) {
        m.erase("loss_scale");
        m.erase("loss_scale_clean_steps");
        m.erase("loss");
        m.erase("data_fingerprint");
      },
      test::Seal::remove);
  CHECK(read_checkpoint(dir).position.loss_scale == 1.0);
  CHECK(read_checkpoint(dir).position.loss_scale_clean_steps == 0);
  CHECK(std::isnan(read_checkpoint(dir).position.loss));
  // Damage the parser would not see: a tail after a NUL byte (a crash's zeros), or a size no
  // meta.json has (not read whole).
  write_file_atomic(dir / "meta.json", original + std::string(1, '\0') + "{\"x\":1}");
  CHECK(verify_checkpoint(dir).problems() ==
        std::vector<std::string>{"meta.json: not valid JSON (a NUL byte at offset " +
                                 std::to_string(original.size()) + ")"});
  write_file_atomic(dir / "meta.json", original);
  fs::resize_file(dir / "meta.json", (16u << 20) + 1);
  CHECK(verify_checkpoint(dir).problems() ==
        std::vector<std::string>{
            "meta.json: 16777217 bytes, more than any meta.json holds (damaged?)"});
}

TEST_CASE("check_latest: missing, following, dangling, set aside, garbage") {
  TempDir tmp;
  const auto p = values(4, 0.0f);
  CHECK_FALSE(check_latest(tmp.path()).exists);
  CHECK(check_latest(tmp.path()).ok());
  for (int64_t s : {10, 20})
    write_checkpoint(tmp.path(), position(s), p, p, 5);
  LatestStatus latest = check_latest(tmp.path());
  CHECK(latest.exists);
  CHECK(latest.ok());
  CHECK(latest.name == "step-000020");
  CHECK(latest.dir == tmp.path() / "step-000020");

  write_file_atomic(tmp.path() / "latest", "step-000099\n");
  latest = check_latest(tmp.path());
  CHECK(latest.problem == "names step-000099, which does not exist");
  CHECK(latest.name == "step-000099");

  fs::rename(tmp.path() / "step-000020", tmp.path() / "step-000020.corrupt");
  write_file_atomic(tmp.path() / "latest", "step-000020\n");
  CHECK(check_latest(tmp.path()).problem ==
        "names step-000020, which does not exist: resume set it aside as step-000020.corrupt "
        "(it failed verification)");

  write_file_atomic(tmp.path() / "latest", "../../etc\n");
  latest = check_latest(tmp.path());
  CHECK(latest.problem ==
        "holds \"../../etc\", not the name of a checkpoint directory (step-NNNNNN)");
  CHECK(latest.name.empty());
  CHECK(latest.dir.empty());

  write_file_atomic(tmp.path() / "latest", "\n");
  CHECK(check_latest(tmp.path()).problem.find("is empty") == 0);

  // A link to a file elsewhere is neither followed nor quoted.
  std::ofstream(tmp.path() / "elsewhere") << "secret";
  fs::remove(tmp.path() / "latest");
  fs::create_symlink(tmp.path() / "elsewhere", tmp.path() / "latest");
  latest = check_latest(tmp.path());
  CHECK(latest.problem.find("a symbolic link: refused") == 0);
  CHECK(latest.problem.find("secret") == std::string::npos);
  fs::remove(tmp.path() / "latest");

  std::ofstream(tmp.path() / "step-000030") << "a file, not a checkpoint";
  write_file_atomic(tmp.path() / "latest", "step-000030\n");
  CHECK(check_latest(tmp.path()).problem == "names step-000030, which is not a directory");
}

TEST_CASE("find_valid_checkpoint: checkpoints pruned while they are read are passed over") {
  // A run that trains on while sample reads: it commits a newer checkpoint and prunes the ones
  // listed (keep 1) between the listing and their reading.
  TempDir tmp;
  const auto p = values(64, 5.0f);
  for (int64_t s : {10, 20})
    write_checkpoint(tmp.path(), position(s), p, p, 5);
  std::vector<std::string> warnings;
  auto warn = [&](const std::string& w) { warnings.push_back(w); };
  int calls = 0;
  const auto train_on = [&] {
    if (calls++ == 0) write_checkpoint(tmp.path(), position(30), p, p, 1);
  };
  const auto found = try_find_valid_checkpoint(tmp.path(), warn, {}, train_on);
  REQUIRE(found.has_value());
  CHECK(found->filename() == "step-000030");
  CHECK(warnings.empty());  // not damage
  CHECK(calls == 3);        // step-000020 and step-000010 gone, then step-000030
}

TEST_CASE("read_checkpoint: the parameters only, the optimizer state neither read nor checked") {
  TempDir tmp;
  const auto params = values(1001, 1.0f);
  const auto optim = values(2002, -3.0f);
  const fs::path dir = write_checkpoint(tmp.path(), position(100), params, optim, 3);
  flip_byte(dir / "optimizer.bin", 5);
  CHECK_THROWS_AS(read_checkpoint(dir), Error);
  const CheckpointData back = read_checkpoint(dir, CheckpointBlobs::params);
  CHECK(back.params == params);
  CHECK(back.optimizer_state.empty());
  CHECK(back.position.step == 100);
  // The parameters themselves are checked all the same.
  flip_byte(dir / "params.bin", 5);
  CHECK_THROWS_AS(read_checkpoint(dir, CheckpointBlobs::params), Error);
}
