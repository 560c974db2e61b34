// Checkpoints: atomic, checksummed, verified before `latest` moves.
#include "core/checkpoint.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <optional>
#include <string_view>
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

// The blobs a checkpoint holds, in the order CheckpointData lists them; those from
// kFirstOptionalBlob on are written only when not empty (and absent from older checkpoints).
constexpr std::array<const char*, 3> kBlobNames = {"params", "optimizer", "comm"};
constexpr std::array<const char*, 3> kBlobFiles = {"params.bin", "optimizer.bin", "comm.bin"};
constexpr size_t kFirstOptionalBlob = 2;
constexpr std::string_view kSetAsideSuffix = ".corrupt";

// What meta.json records: the position, and each blob's file, size and checksum.
struct Meta {
  TrainingPosition position;
  std::vector<BlobStatus> blobs;
};

// meta.json parsed, or nothing with `problem` saying why it cannot be used.
std::optional<Meta> read_meta(const fs::path& dir, std::string& problem) {
  json meta;
  try {
    meta = json::parse(read_file(dir / kMetaFile));
  } catch (const Error&) {
    problem = "missing or unreadable";
    return std::nullopt;
  } catch (const json::exception&) {
    problem = "not valid JSON (truncated?)";
    return std::nullopt;
  }
  try {
    if (meta.at("format").get<int>() != kFormatVersion) {
      problem = fmt::format("unsupported format {}", meta.at("format").dump());
      return std::nullopt;
    }
    Meta out;
    auto& p = out.position;
    p.step = meta.at("step").get<int64_t>();
    p.epoch = meta.at("epoch").get<int64_t>();
    p.samples_in_epoch = meta.at("samples_in_epoch").get<int64_t>();
    p.world_size = meta.at("world_size").get<int64_t>();
    p.global_batch = meta.at("global_batch").get<int64_t>();
    p.optimizer_steps = meta.at("optimizer_steps").get<int64_t>();
    p.recipe_hash = meta.at("recipe_hash").get<std::string>();
    p.rng_state = meta.at("rng_state").get<std::string>();
    p.loss_scale = meta.value("loss_scale", 1.0);  // absent before mixed precision existed
    p.loss_scale_clean_steps = meta.value("loss_scale_clean_steps", int64_t{0});
    for (size_t i = 0; i < kBlobNames.size(); ++i) {
      const char* name = kBlobNames[i];
      if (i >= kFirstOptionalBlob && !meta.at("blobs").contains(name)) continue;
      const json& entry = meta.at("blobs").at(name);
      BlobStatus blob;
      blob.name = name;
      blob.file = entry.at("file").get<std::string>();
      blob.bytes = entry.at("bytes").get<uint64_t>();
      blob.checksum = entry.at("checksum").get<std::string>();
      out.blobs.push_back(std::move(blob));
    }
    return out;
  } catch (const json::exception& e) {
    problem = fmt::format("malformed: {}", e.what());
    return std::nullopt;
  }
}

// Reads one blob and checks it against its record, filling in what is on disk and any problem.
// Returns the bytes read.
std::string check_blob(const fs::path& dir, BlobStatus& blob) {
  std::string raw;
  try {
    raw = read_file(dir / blob.file);
  } catch (const Error&) {
    blob.problem = "missing or unreadable";
    return raw;
  }
  blob.actual_bytes = raw.size();
  blob.actual_checksum = checksum_hex(checksum64(raw.data(), raw.size()));
  if (raw.size() != blob.bytes || blob.bytes % sizeof(float) != 0) {
    blob.problem =
        fmt::format("truncated or wrong size: {} bytes, expected {}", raw.size(), blob.bytes);
  } else if (blob.actual_checksum != blob.checksum) {
    blob.problem = fmt::format("checksum mismatch (corrupted): {} on disk, {} recorded",
                               blob.actual_checksum, blob.checksum);
  }
  return raw;
}

std::vector<float> as_floats(const std::string& raw) {
  std::vector<float> out(raw.size() / sizeof(float));
  std::memcpy(out.data(), raw.data(), out.size() * sizeof(float));
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

bool is_set_aside(const fs::path& dir) {
  return dir.filename().string().ends_with(kSetAsideSuffix);
}

}  // namespace

std::string checkpoint_name(int64_t step) {
  return fmt::format("step-{:06d}", step);
}

int64_t checkpoint_step(const fs::path& dir) {
  if (!is_set_aside(dir)) return step_of(dir);
  const std::string name = dir.filename().string();
  return step_of(name.substr(0, name.size() - kSetAsideSuffix.size()));
}

fs::path write_checkpoint(const fs::path& checkpoints_dir, const TrainingPosition& pos,
                          std::span<const float> params, std::span<const float> optimizer_state,
                          int64_t keep, const std::function<void()>& before_commit,
                          std::span<const float> comm_state) {
  const std::array<std::span<const float>, kBlobNames.size()> data = {params, optimizer_state,
                                                                      comm_state};
  const fs::path final_dir = checkpoints_dir / checkpoint_name(pos.step);
  const fs::path tmp_dir =
      checkpoints_dir / fmt::format(".tmp-{}-{}", checkpoint_name(pos.step), ::getpid());
  try {
    fs::create_directories(checkpoints_dir);
    fs::remove_all(tmp_dir);
    fs::create_directory(tmp_dir);
    json blobs = json::object();
    for (size_t i = 0; i < kBlobNames.size(); ++i) {
      if (i >= kFirstOptionalBlob && data[i].empty()) continue;
      write_file_synced(tmp_dir / kBlobFiles[i], std::as_bytes(data[i]));
      blobs[kBlobNames[i]] = blob_entry(kBlobFiles[i], data[i]);
    }
    json meta = {{"format", kFormatVersion},
                 {"step", pos.step},
                 {"epoch", pos.epoch},
                 {"samples_in_epoch", pos.samples_in_epoch},
                 {"world_size", pos.world_size},
                 {"global_batch", pos.global_batch},
                 {"optimizer_steps", pos.optimizer_steps},
                 {"recipe_hash", pos.recipe_hash},
                 {"rng_state", pos.rng_state},
                 {"loss_scale", pos.loss_scale},
                 {"loss_scale_clean_steps", pos.loss_scale_clean_steps},
                 {"blobs", blobs}};
    const std::string text = meta.dump(2) + "\n";
    write_file_synced(tmp_dir / kMetaFile, std::as_bytes(std::span(text.data(), text.size())));
    fsync_directory(tmp_dir);
    // A checkpoint of the same step (a resumed run repeating it) is replaced whole.
    if (fs::exists(final_dir)) fs::remove_all(final_dir);
    if (before_commit) before_commit();
    fs::rename(tmp_dir, final_dir);
    fsync_directory(checkpoints_dir);
  } catch (const fs::filesystem_error& e) {
    std::error_code ignored;
    fs::remove_all(tmp_dir, ignored);
    fail(final_dir, fmt::format("cannot write: {}", e.code().message()));
  } catch (const Error& e) {
    std::error_code ignored;
    fs::remove_all(tmp_dir, ignored);
    // Name the checkpoint, not the temporary directory just removed:
    // ".../step-000060/optimizer.bin: cannot write: No space left on device".
    const std::string what = e.what();
    const std::string tmp_name = tmp_dir.string();
    if (what.starts_with(tmp_name + "/")) {
      throw Error(ErrorKind::checkpoint, final_dir.string() + what.substr(tmp_name.size()));
    }
    fail(final_dir, fmt::format("cannot write: {}", what));
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

void remove_incomplete_checkpoints(const fs::path& checkpoints_dir) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(checkpoints_dir, ec)) {
    if (entry.path().filename().string().rfind(".tmp-", 0) == 0) {
      std::error_code ignored;
      fs::remove_all(entry.path(), ignored);
    }
  }
}

CheckpointData read_checkpoint(const fs::path& dir) {
  std::string problem;
  std::optional<Meta> meta = read_meta(dir, problem);
  if (!meta) fail(dir / kMetaFile, problem);
  std::array<std::vector<float>, kBlobNames.size()> blobs;
  for (BlobStatus& blob : meta->blobs) {
    const std::string raw = check_blob(dir, blob);
    if (!blob.ok()) fail(dir / blob.file, blob.problem);
    const auto index = std::find(kBlobNames.begin(), kBlobNames.end(), blob.name);
    blobs[static_cast<size_t>(index - kBlobNames.begin())] = as_floats(raw);
  }
  return {std::move(meta->position), std::move(blobs[0]), std::move(blobs[1]), std::move(blobs[2])};
}

bool CheckpointStatus::ok() const {
  return meta_problem.empty() &&
         std::all_of(blobs.begin(), blobs.end(), [](const BlobStatus& b) { return b.ok(); });
}

std::vector<std::string> CheckpointStatus::problems() const {
  std::vector<std::string> out;
  if (!meta_problem.empty()) out.push_back(fmt::format("{}: {}", kMetaFile, meta_problem));
  for (const auto& blob : blobs) {
    if (!blob.ok()) out.push_back(fmt::format("{}: {}", blob.file, blob.problem));
  }
  return out;
}

CheckpointStatus verify_checkpoint(const fs::path& dir) {
  CheckpointStatus status;
  status.dir = dir;
  status.step = checkpoint_step(dir);
  status.set_aside = is_set_aside(dir);
  std::optional<Meta> meta = read_meta(dir, status.meta_problem);
  if (!meta) return status;
  status.step = meta->position.step;
  status.position = std::move(meta->position);
  status.blobs = std::move(meta->blobs);
  for (auto& blob : status.blobs)
    check_blob(dir, blob);
  return status;
}

std::vector<fs::path> list_checkpoints(const fs::path& checkpoints_dir, SetAside set_aside) {
  struct Found {
    int64_t step;
    bool set_aside;
    fs::path dir;
  };
  std::vector<Found> found;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(checkpoints_dir, ec)) {
    const bool aside = is_set_aside(entry.path());
    if (aside && set_aside == SetAside::exclude) continue;
    const int64_t step = checkpoint_step(entry.path());
    if (step >= 0 && entry.is_directory()) found.push_back({step, aside, entry.path()});
  }
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) {
    return a.step != b.step ? a.step > b.step : a.set_aside < b.set_aside;
  });
  std::vector<fs::path> out;
  for (auto& f : found)
    out.push_back(std::move(f.dir));
  return out;
}

fs::path latest_checkpoint(const fs::path& checkpoints_dir) {
  std::error_code ec;
  if (!fs::exists(checkpoints_dir / kLatestFile, ec)) return {};
  std::string name = read_file(checkpoints_dir / kLatestFile);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' '))
    name.pop_back();
  // Only a plain name inside checkpoints/: `latest` must never lead elsewhere.
  if (name.find('/') != std::string::npos || step_of(name) < 0) return {};
  return checkpoints_dir / name;
}

fs::path find_valid_checkpoint(const fs::path& checkpoints_dir,
                               const std::function<void(const std::string&)>& warn) {
  std::vector<fs::path> candidates;
  try {
    if (fs::path latest = latest_checkpoint(checkpoints_dir); !latest.empty()) {
      candidates.push_back(std::move(latest));
    }
  } catch (const Error& e) {
    warn(e.what());
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
