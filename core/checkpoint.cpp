// Checkpoints: atomic, checksummed, verified before `latest` moves.
#include "core/checkpoint.hpp"

#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <system_error>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/checksum.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"

namespace dptrain {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr int kFormatVersion = 1;
constexpr const char* kMetaFile = "meta.json";
constexpr const char* kLatestFile = "latest";

[[noreturn]] void fail(const fs::path& where, const std::string& what) {
  throw Error(ErrorKind::checkpoint, fmt::format("{}: {}", where.string(), what));
}

json blob_entry(const char* file, std::span<const float> data) {
  return {{"file", file},
          {"bytes", data.size_bytes()},
          {"checksum", checksum_hex(checksum64(data.data(), data.size_bytes()))}};
}

std::vector<float> read_blob(const fs::path& dir, const json& entry) {
  const fs::path path = dir / entry.at("file").get<std::string>();
  const auto bytes = entry.at("bytes").get<size_t>();
  std::string raw;
  try {
    raw = read_file(path);
  } catch (const Error& e) {
    fail(path, "missing or unreadable");
  }
  if (raw.size() != bytes || bytes % sizeof(float) != 0) {
    fail(path, fmt::format("truncated or wrong size: {} bytes, expected {}", raw.size(), bytes));
  }
  if (checksum_hex(checksum64(raw.data(), raw.size())) != entry.at("checksum").get<std::string>()) {
    fail(path, "checksum mismatch (corrupted)");
  }
  std::vector<float> out(bytes / sizeof(float));
  std::memcpy(out.data(), raw.data(), bytes);
  return out;
}

int64_t step_of(const fs::path& dir) {
  const std::string name = dir.filename().string();
  if (name.rfind("step-", 0) != 0 || name.size() <= 5) return -1;
  int64_t step = 0;
  for (char c : name.substr(5)) {
    if (c < '0' || c > '9') return -1;
    step = step * 10 + (c - '0');
  }
  return step;
}

}  // namespace

std::string checkpoint_name(int64_t step) {
  return fmt::format("step-{:06d}", step);
}

fs::path write_checkpoint(const fs::path& checkpoints_dir, const TrainingPosition& pos,
                          std::span<const float> params, std::span<const float> optimizer_state,
                          int64_t keep) {
  const fs::path final_dir = checkpoints_dir / checkpoint_name(pos.step);
  const fs::path tmp_dir =
      checkpoints_dir / fmt::format(".tmp-{}-{}", checkpoint_name(pos.step), ::getpid());
  try {
    fs::create_directories(checkpoints_dir);
    fs::remove_all(tmp_dir);
    fs::create_directory(tmp_dir);
    write_file_synced(tmp_dir / "params.bin", std::as_bytes(params));
    write_file_synced(tmp_dir / "optimizer.bin", std::as_bytes(optimizer_state));
    json meta = {{"format", kFormatVersion},
                 {"step", pos.step},
                 {"epoch", pos.epoch},
                 {"samples_in_epoch", pos.samples_in_epoch},
                 {"world_size", pos.world_size},
                 {"global_batch", pos.global_batch},
                 {"optimizer_steps", pos.optimizer_steps},
                 {"recipe_hash", pos.recipe_hash},
                 {"rng_state", pos.rng_state},
                 {"blobs",
                  {{"params", blob_entry("params.bin", params)},
                   {"optimizer", blob_entry("optimizer.bin", optimizer_state)}}}};
    const std::string text = meta.dump(2) + "\n";
    write_file_synced(tmp_dir / kMetaFile, std::as_bytes(std::span(text.data(), text.size())));
    fsync_directory(tmp_dir);
    // A checkpoint of the same step (a resumed run repeating it) is replaced whole.
    if (fs::exists(final_dir)) fs::remove_all(final_dir);
    fs::rename(tmp_dir, final_dir);
    fsync_directory(checkpoints_dir);
  } catch (const fs::filesystem_error& e) {
    std::error_code ignored;
    fs::remove_all(tmp_dir, ignored);
    fail(final_dir, fmt::format("cannot write: {}", e.code().message()));
  } catch (const Error& e) {
    std::error_code ignored;
    fs::remove_all(tmp_dir, ignored);
    fail(final_dir, fmt::format("cannot write: {}", e.what()));
  }
  read_checkpoint(final_dir);  // verify what landed on disk before `latest` moves
  try {
    write_file_atomic(checkpoints_dir / kLatestFile, final_dir.filename().string() + "\n");
  } catch (const Error& e) {
    fail(checkpoints_dir / kLatestFile, e.what());
  }
  const auto all = list_checkpoints(checkpoints_dir);
  for (size_t i = static_cast<size_t>(std::max<int64_t>(keep, 1)); i < all.size(); ++i) {
    std::error_code ignored;
    fs::remove_all(all[i], ignored);
  }
  return final_dir;
}

CheckpointData read_checkpoint(const fs::path& dir) {
  json meta;
  try {
    meta = json::parse(read_file(dir / kMetaFile));
  } catch (const Error&) {
    fail(dir / kMetaFile, "missing or unreadable");
  } catch (const json::exception&) {
    fail(dir / kMetaFile, "not valid JSON (truncated?)");
  }
  try {
    if (meta.at("format").get<int>() != kFormatVersion) {
      fail(dir / kMetaFile, fmt::format("unsupported format {}", meta.at("format").dump()));
    }
    CheckpointData out;
    auto& p = out.position;
    p.step = meta.at("step").get<int64_t>();
    p.epoch = meta.at("epoch").get<int64_t>();
    p.samples_in_epoch = meta.at("samples_in_epoch").get<int64_t>();
    p.world_size = meta.at("world_size").get<int64_t>();
    p.global_batch = meta.at("global_batch").get<int64_t>();
    p.optimizer_steps = meta.at("optimizer_steps").get<int64_t>();
    p.recipe_hash = meta.at("recipe_hash").get<std::string>();
    p.rng_state = meta.at("rng_state").get<std::string>();
    out.params = read_blob(dir, meta.at("blobs").at("params"));
    out.optimizer_state = read_blob(dir, meta.at("blobs").at("optimizer"));
    return out;
  } catch (const json::exception& e) {
    fail(dir / kMetaFile, fmt::format("malformed: {}", e.what()));
  }
}

std::vector<fs::path> list_checkpoints(const fs::path& checkpoints_dir) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(checkpoints_dir, ec)) {
    const int64_t step = step_of(entry.path());
    if (step >= 0 && entry.is_directory()) found.emplace_back(step, entry.path());
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  std::vector<fs::path> out;
  for (auto& f : found)
    out.push_back(std::move(f.second));
  return out;
}

fs::path find_valid_checkpoint(const fs::path& checkpoints_dir,
                               const std::function<void(const std::string&)>& warn) {
  std::vector<fs::path> candidates;
  std::error_code ec;
  if (fs::exists(checkpoints_dir / kLatestFile, ec)) {
    std::string name;
    try {
      name = read_file(checkpoints_dir / kLatestFile);
    } catch (const Error& e) {
      warn(e.what());
    }
    while (!name.empty() && (name.back() == '\n' || name.back() == ' '))
      name.pop_back();
    if (step_of(name) >= 0) candidates.push_back(checkpoints_dir / name);
  }
  for (auto& dir : list_checkpoints(checkpoints_dir)) {
    if (std::find(candidates.begin(), candidates.end(), dir) == candidates.end()) {
      candidates.push_back(dir);
    }
  }
  // The newest step wins even when `latest` lags (a crash between rename and `latest`).
  std::stable_sort(candidates.begin(), candidates.end(),
                   [](const fs::path& a, const fs::path& b) { return step_of(a) > step_of(b); });
  for (const auto& dir : candidates) {
    try {
      read_checkpoint(dir);
      return dir;
    } catch (const Error& e) {
      warn(fmt::format("skipping checkpoint {}: {}", dir.filename().string(), e.what()));
    }
  }
  throw Error(ErrorKind::checkpoint,
              fmt::format("{}: no valid checkpoint to resume from", checkpoints_dir.string()));
}

}  // namespace dptrain
