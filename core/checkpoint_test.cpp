// Checkpoint format: round trip, verification, pruning, and the fallback order on resume.
#include "core/checkpoint.hpp"

#include <doctest/doctest.h>
#include <unistd.h>

#include <fstream>

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
  p.rng_state = "sampler seed=1 epoch=2";
  p.loss_scale = 32768.0;
  p.loss_scale_clean_steps = 17;
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
  CHECK(back.position.rng_state == "sampler seed=1 epoch=2");
  CHECK(back.position.loss_scale == 32768.0);  // fp16's scaler resumes where it was
  CHECK(back.position.loss_scale_clean_steps == 17);
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

  // `latest` pointing at a directory that is gone, or holding garbage, is not fatal.
  write_file_atomic(tmp.path() / "latest", "step-000099\n");
  CHECK(find_valid_checkpoint(tmp.path(), warn).filename() == "step-000020");
  write_file_atomic(tmp.path() / "latest", "../../etc\n");
  CHECK(find_valid_checkpoint(tmp.path(), warn).filename() == "step-000020");

  for (int64_t s : {10, 20})
    fs::remove(tmp.path() / checkpoint_name(s) / "meta.json");
  CHECK_THROWS_AS(find_valid_checkpoint(tmp.path(), warn), Error);
  try {
    find_valid_checkpoint(tmp.path(), warn);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::checkpoint);
    CHECK(std::string(e.what()).find("no valid checkpoint") != std::string::npos);
  }
  CHECK_THROWS_AS(find_valid_checkpoint(tmp.path() / "absent", warn), Error);
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
  CHECK(torn.problems()[0] == "meta.json: missing or unreadable");
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

  CHECK(latest_checkpoint(tmp.path()) == tmp.path() / "step-000020");
  write_file_atomic(tmp.path() / "latest", "../step-000010\n");  // never outside checkpoints/
  CHECK(latest_checkpoint(tmp.path()).empty());
  fs::remove(tmp.path() / "latest");
  CHECK(latest_checkpoint(tmp.path()).empty());
}
