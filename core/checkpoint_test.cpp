// Checkpoint format: round trip, verification, pruning, and the fallback order on resume.
#include "core/checkpoint.hpp"

#include <doctest/doctest.h>
#include <unistd.h>

#include <fstream>

#include "core/error.hpp"
#include "core/fs.hpp"
#include "tests/temp_dir.hpp"

namespace fs = std::filesystem;
using namespace dptrain;
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
  return p;
}

std::vector<float> values(size_t n, float base) {
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = base + static_cast<float>(i) * 0.25f;
  return v;
}

void flip_byte(const fs::path& file, std::streamoff offset) {
  std::fstream f(file, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(offset);
  char c = 0;
  f.get(c);
  f.seekp(offset);
  f.put(static_cast<char>(c ^ 0x5a));
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
  // No temporary directory is left behind.
  for (const auto& e : fs::directory_iterator(tmp.path())) {
    CHECK(e.path().filename().string().rfind(".tmp", 0) != 0);
  }
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
