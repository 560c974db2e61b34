// Checkpoints: atomic, checksummed, verified before `latest` moves.
#include "core/checkpoint.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <set>
#include <string_view>
#include <system_error>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/checksum.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"

namespace dptrain {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr int kFormatVersion = 1;
constexpr const char* kMetaFile = "meta.json";
constexpr const char* kLatestFile = "latest";
// A pruned checkpoint's name while it is deleted (not a step-N name: no list shows it).
const std::string kPrunedPrefix = ".pruned-";
constexpr const char* kMetaChecksumKey = "meta_checksum";

[[noreturn]] void fail(const fs::path& where, const std::string& what) {
  throw Error(ErrorKind::checkpoint, fmt::format("{}: {}", printable(where.string()), what));
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

// What is wrong with meta.json's content, thrown while its fields are read; the message is for
// the user ("missing field 'step'"), never the JSON library's own text.
struct MetaProblem {
  std::string what;
};

[[noreturn]] void meta_problem(std::string what) {
  throw MetaProblem{std::move(what)};
}

// Untrusted text for a message: quoted as JSON (control characters escaped), cut to `max` bytes.
std::string as_quoted(std::string_view text, size_t max = 200) {
  std::string out =
      json(std::string(text.substr(0, max))).dump(-1, ' ', false, json::error_handler_t::replace);
  if (text.size() > max) out += "...";
  return out;
}

const json& member(const json& object, const std::string& prefix, const char* key) {
  const auto it = object.find(key);
  if (it == object.end()) meta_problem(fmt::format("missing field '{}{}'", prefix, key));
  return *it;
}

const json& object_field(const json& object, const std::string& prefix, const char* key) {
  const json& value = member(object, prefix, key);
  if (!value.is_object()) meta_problem(fmt::format("field '{}{}' is not an object", prefix, key));
  return value;
}

std::string string_field(const json& object, const std::string& prefix, const char* key) {
  const json& value = member(object, prefix, key);
  if (!value.is_string()) meta_problem(fmt::format("field '{}{}' is not a string", prefix, key));
  return value.get<std::string>();
}

// A non-negative integer field; `fallback` when it is absent (fields older checkpoints lack).
int64_t int_field(const json& object, const char* key, std::optional<int64_t> fallback = {}) {
  if (fallback && !object.contains(key)) return *fallback;
  const json& value = member(object, "", key);
  if (!value.is_number_integer()) meta_problem(fmt::format("field '{}' is not an integer", key));
  if (value.is_number_unsigned() &&
      value.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
    meta_problem(fmt::format("field '{}' is out of range", key));
  }
  const auto number = value.get<int64_t>();
  if (number < 0) meta_problem(fmt::format("field '{}' is negative ({})", key, number));
  return number;
}

// Why `file` may not be a blob's file entry: a checkpoint only ever names plain files inside its
// own directory, so an edited entry can never make a reader open something elsewhere.
std::string unsafe_file_reason(const std::string& file) {
  if (file.empty()) return "it is empty";
  if (file.front() == '/') return "it is an absolute path";
  if (file.find('/') != std::string::npos) return "it contains '/'";
  if (file.find("..") != std::string::npos) return "it contains '..'";
  if (file == ".") return "it names the checkpoint directory itself";
  if (file.find('\0') != std::string::npos) return "it contains a NUL character";
  return {};
}

Meta parse_meta(const json& meta) {
  if (!meta.is_object()) meta_problem("not a JSON object");
  const json& format = member(meta, "", "format");
  if (!format.is_number_integer() || format.get<int64_t>() != kFormatVersion) {
    meta_problem(fmt::format(
        "unsupported format {} (this dptrain reads format {})",
        format.dump(-1, ' ', false, json::error_handler_t::replace).substr(0, 40), kFormatVersion));
  }
  Meta out;
  auto& p = out.position;
  p.step = int_field(meta, "step");
  p.epoch = int_field(meta, "epoch");
  p.samples_in_epoch = int_field(meta, "samples_in_epoch");
  p.world_size = int_field(meta, "world_size");
  p.global_batch = int_field(meta, "global_batch");
  p.optimizer_steps = int_field(meta, "optimizer_steps");
  p.recipe_hash = string_field(meta, "", "recipe_hash");
  p.rng_state = string_field(meta, "", "rng_state");
  if (meta.contains("model")) {  // absent before it was recorded
    if (!meta["model"].is_object()) meta_problem("field 'model' is not an object");
    p.model = meta["model"].dump();
  }
  if (meta.contains("data_fingerprint")) {  // absent before it was recorded
    p.data_fingerprint = string_field(meta, "", "data_fingerprint");
  }
  // Both absent before mixed precision existed.
  if (meta.contains("loss_scale")) {
    if (!meta["loss_scale"].is_number()) meta_problem("field 'loss_scale' is not a number");
    p.loss_scale = meta["loss_scale"].get<double>();
  }
  p.loss_scale_clean_steps = int_field(meta, "loss_scale_clean_steps", 0);
  // Absent before it was recorded; null when no loss had been logged.
  if (meta.contains("loss") && !meta["loss"].is_null()) {
    if (!meta["loss"].is_number()) meta_problem("field 'loss' is not a number");
    p.loss = meta["loss"].get<double>();
  }
  const json& blobs = object_field(meta, "", "blobs");
  for (size_t i = 0; i < kBlobNames.size(); ++i) {
    const char* name = kBlobNames[i];
    if (i >= kFirstOptionalBlob && !blobs.contains(name)) continue;
    const std::string prefix = fmt::format("blobs.{}.", name);
    const json& entry = object_field(blobs, "blobs.", name);
    BlobStatus blob;
    blob.name = name;
    blob.file = string_field(entry, prefix, "file");
    if (const std::string why = unsafe_file_reason(blob.file); !why.empty()) {
      meta_problem(fmt::format(
          "field '{}file' is {}: refused, {}; a checkpoint may only name plain files inside its "
          "own directory",
          prefix, as_quoted(blob.file), why));
    }
    const json& bytes = member(entry, prefix, "bytes");
    if (!bytes.is_number_unsigned()) {
      meta_problem(fmt::format("field '{}bytes' is not a non-negative integer", prefix));
    }
    blob.bytes = bytes.get<uint64_t>();
    blob.checksum = string_field(entry, prefix, "checksum");
    out.blobs.push_back(std::move(blob));
  }
  return out;
}

// The checksum of meta.json's content without its own checksum field, over a canonical text
// (compact, keys sorted: nlohmann::json keeps objects sorted), so layout does not matter.
std::string content_checksum(json meta) {
  meta.erase(kMetaChecksumKey);
  const std::string canonical = meta.dump();
  return checksum_hex(checksum64(canonical.data(), canonical.size()));
}

bool is_checksum_text(const json& value) {
  if (!value.is_string()) return false;
  const auto& text = value.get_ref<const std::string&>();
  return text.size() == 16 && std::all_of(text.begin(), text.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

// Why `path` cannot be read: "cannot read: REASON"; `denied` when a permission stops it (the
// file may be intact, only out of this process's reach: not damage).
std::string access_problem(int error, bool& denied) {
  denied = error == EACCES || error == EPERM;
  return fmt::format("cannot read: {}", std::strerror(error));
}

// Why `path` is not a regular file that may be read (missing, out of reach, a symbolic link, a
// device...); empty when it is one.
std::string not_a_plain_file(const fs::path& path, bool& denied) {
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(path, ec);
  if (st.type() == fs::file_type::not_found) return "missing";
  if (ec) return access_problem(ec.value(), denied);
  if (st.type() == fs::file_type::symlink) {
    return "a symbolic link: refused, a checkpoint's files must be regular files";
  }
  if (st.type() != fs::file_type::regular) return "not a regular file";
  return {};
}

// Why reading a checkpoint file failed with `e`: a permission (and `denied`), or the read's own
// error ("cannot read: Input/output error", without the path the caller puts in front).
std::string read_problem(const fs::path& file, const Error& e, bool& denied) {
  if (::faccessat(AT_FDCWD, file.c_str(), R_OK, AT_EACCESS) != 0)
    return access_problem(errno, denied);
  const std::string what = e.what();
  const std::string prefix = file.string() + ": ";
  return what.starts_with(prefix) ? what.substr(prefix.size()) : what;
}

// A checkpoint file's bytes, or none with `problem` (and `denied`) saying why not.
std::optional<std::string> read_part(const fs::path& file, std::string& problem, bool& denied) {
  if (problem = not_a_plain_file(file, denied); !problem.empty()) return std::nullopt;
  try {
    return read_file(file);
  } catch (const Error& e) {
    problem = read_problem(file, e, denied);
    return std::nullopt;
  }
}

// meta.json checked: parsed (`meta`, none when unusable), its own checksum compared and its step
// compared with the directory's name. `problem` says why it is unusable or cannot be trusted.
struct MetaCheck {
  std::optional<Meta> meta;
  std::string problem;
  std::string checksum;         // recorded; empty when there is none (older checkpoints)
  std::string actual_checksum;  // of the content read; empty when unusable
  bool denied = false;          // a permission stops the read (see access_problem)
};

MetaCheck check_meta(const fs::path& dir) {
  MetaCheck out;
  const fs::path file = dir / kMetaFile;
  if (out.problem = not_a_plain_file(file, out.denied); !out.problem.empty()) return out;
  // A meta.json holds a position and a line per blob: far below this. A bigger one is damage
  // (a tail of zeros after a crash), not worth reading whole.
  constexpr uintmax_t kMaxMetaBytes = 16u << 20;
  std::error_code size_error;
  if (const uintmax_t size = fs::file_size(file, size_error); !size_error && size > kMaxMetaBytes) {
    out.problem = fmt::format("{} bytes, more than any meta.json holds (damaged?)", size);
    return out;
  }
  const std::optional<std::string> text = read_part(file, out.problem, out.denied);
  if (!text) return out;
  // The JSON parser stops at a NUL byte: what follows would go unchecked.
  if (const auto nul = text->find('\0'); nul != std::string::npos) {
    out.problem = fmt::format("not valid JSON (a NUL byte at offset {})", nul);
    return out;
  }
  json meta;
  try {
    meta = parse_json(*text);
  } catch (const json::exception&) {
    out.problem = "not valid JSON (truncated?)";
    return out;
  }
  try {
    Meta parsed = parse_meta(meta);
    if (meta.contains(kMetaChecksumKey)) {
      if (!is_checksum_text(meta[kMetaChecksumKey])) {
        meta_problem(fmt::format("field '{}' is not a checksum (16 hex digits)", kMetaChecksumKey));
      }
      out.checksum = meta[kMetaChecksumKey].get<std::string>();
    }
    out.actual_checksum = content_checksum(meta);
    std::vector<std::string> problems;
    if (!out.checksum.empty() && out.checksum != out.actual_checksum) {
      problems.push_back(fmt::format(
          "checksum mismatch (edited or corrupted): {} computed from its content, {} recorded",
          out.actual_checksum, out.checksum));
    } else if (out.checksum.empty() && meta.contains("data_fingerprint")) {
      // Every dptrain that records the data's fingerprint checksums meta.json too: without the
      // checksum, its content cannot be trusted (an edit that took it out along).
      problems.push_back(fmt::format(
          "field '{}' is missing, which the dptrain that wrote it always records (edited?)",
          kMetaChecksumKey));
    }
    if (const int64_t named = checkpoint_step(dir); named >= 0 && named != parsed.position.step) {
      problems.push_back(fmt::format("step {} does not match the directory's name {}",
                                     parsed.position.step, dir.filename().string()));
    }
    out.problem = fmt::format("{}", fmt::join(problems, "; "));
    out.meta = std::move(parsed);
  } catch (const MetaProblem& p) {
    out.problem = p.what;
    out.checksum.clear();
    out.actual_checksum.clear();
  } catch (const json::exception&) {
    // Every field is checked before it is used; this only keeps library text out of messages.
    out.problem = "malformed";
    out.checksum.clear();
    out.actual_checksum.clear();
  }
  return out;
}

// Checks one blob against its record, filling in what is on disk and any problem: its size
// first (one of another size is not read), then its checksum, read a piece at a time so that a
// blob of any size is checked in little memory. With `into`, its content as floats too; their
// room is taken before the read, so a shortage of memory is std::bad_alloc (out of memory),
// never a blob that reads short.
// `progress`, when given, is told the bytes read of the checkpoint's blobs so far (`done` before
// this one) of `total`.
void check_blob(const fs::path& dir, BlobStatus& blob, std::vector<float>* into = nullptr,
                const ReadProgress& progress = {}, uint64_t done = 0, uint64_t total = 0) {
  const fs::path file = dir / blob.file;
  if (blob.problem = not_a_plain_file(file, blob.denied); !blob.problem.empty()) return;
  std::error_code ec;
  const uintmax_t size = fs::file_size(file, ec);
  if (ec) {
    blob.problem = access_problem(ec.value(), blob.denied);
    return;
  }
  const auto wrong_size = [&](uint64_t bytes) {
    blob.problem = fmt::format("truncated or wrong size: {} bytes, expected {}", bytes, blob.bytes);
  };
  blob.actual_bytes = size;
  if (size != blob.bytes || blob.bytes % sizeof(float) != 0) return wrong_size(size);
  if (into != nullptr) into->assign(blob.bytes / sizeof(float), 0.0f);
  Checksum64 sum;
  uint64_t read = 0;
  try {
    read_file_pieces(file, [&](const char* data, size_t n) {
      if (into != nullptr && read + n <= blob.bytes)
        std::memcpy(reinterpret_cast<char*>(into->data()) + read, data, n);
      sum.update(data, n);
      read += n;
      if (progress) progress(done + read, total);
    });
  } catch (const Error& e) {
    blob.actual_bytes.reset();
    blob.problem = read_problem(file, e, blob.denied);
    return;
  }
  // A file that changed size while it was read.
  blob.actual_bytes = read;
  if (read != blob.bytes) return wrong_size(read);
  blob.actual_checksum = checksum_hex(sum.value());
  if (blob.actual_checksum != blob.checksum) {
    blob.problem = fmt::format("checksum mismatch (corrupted): {} on disk, {} recorded",
                               blob.actual_checksum, blob.checksum);
  }
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

// The name's step-N part when it is a set-aside name (step-N.corrupt, or step-N.corrupt-K where
// that was taken), else "".
std::string set_aside_base(const std::string& name) {
  const size_t at = name.rfind(kSetAsideSuffix);
  if (at == std::string::npos) return {};
  const std::string_view tail = std::string_view(name).substr(at + kSetAsideSuffix.size());
  if (!tail.empty() &&
      (tail.size() < 2 || tail[0] != '-' ||
       !std::all_of(tail.begin() + 1, tail.end(), [](char c) { return c >= '0' && c <= '9'; }))) {
    return {};
  }
  return name.substr(0, at);
}

bool is_set_aside(const fs::path& dir) {
  return !set_aside_base(dir.filename().string()).empty();
}

}  // namespace

fs::path set_aside_path(const fs::path& dir) {
  fs::path aside = dir;
  aside += kSetAsideSuffix;
  std::error_code ec;
  for (int k = 2; fs::exists(fs::symlink_status(aside, ec)); ++k) {
    aside = dir;
    aside += fmt::format("{}-{}", kSetAsideSuffix, k);
  }
  return aside;
}

std::string checkpoint_name(int64_t step) {
  return fmt::format("step-{:06d}", step);
}

int64_t checkpoint_step(const fs::path& dir) {
  const std::string base = set_aside_base(dir.filename().string());
  return step_of(base.empty() ? dir : fs::path(base));
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
                 {"data_fingerprint", pos.data_fingerprint},
                 {"rng_state", pos.rng_state},
                 {"loss_scale", pos.loss_scale},
                 {"loss_scale_clean_steps", pos.loss_scale_clean_steps},
                 {"loss", std::isfinite(pos.loss) ? json(pos.loss) : json(nullptr)},
                 {"blobs", blobs}};
    if (!pos.model.empty()) meta["model"] = json::parse(pos.model);
    meta[kMetaChecksumKey] = content_checksum(meta);
    const std::string text = meta.dump(2) + "\n";
    write_file_synced(tmp_dir / kMetaFile, std::as_bytes(std::span(text.data(), text.size())));
    fsync_directory(tmp_dir);
    // What landed on disk is verified before it takes the step's name: one that does not read
    // back is never committed, and the commit that follows (rename, `latest`, pruning) is short,
    // so that a rank stopped by a signal rarely leaves `latest` behind the newest checkpoint.
    read_checkpoint(tmp_dir);
    // A checkpoint of the same step (a resumed run repeating it) is replaced whole.
    if (fs::exists(final_dir)) fs::remove_all(final_dir);
    if (before_commit) before_commit();
    fs::rename(tmp_dir, final_dir);
    fsync_directory(checkpoints_dir);
  } catch (const fs::filesystem_error& e) {
    std::error_code ignored;
    fs::remove_all(tmp_dir, ignored);
    fail(final_dir, fmt::format("cannot write: {}", e.code().message()));
  } catch (const json::exception&) {
    std::error_code ignored;
    fs::remove_all(tmp_dir, ignored);
    fail(final_dir, fmt::format("cannot write {}: the recipe hash or RNG state is not valid UTF-8",
                                kMetaFile));
  } catch (const Error& e) {
    std::error_code ignored;
    fs::remove_all(tmp_dir, ignored);
    // Name the checkpoint, not the temporary directory just removed:
    // ".../step-000060/optimizer.bin: cannot write: No space left on device".
    const std::string what = e.what();
    const std::string tmp_name = printable(tmp_dir.string());  // as the message shows it
    if (what.starts_with(tmp_name + "/")) {
      throw Error(ErrorKind::checkpoint,
                  printable(final_dir.string()) + what.substr(tmp_name.size()));
    }
    fail(final_dir, fmt::format("cannot write: {}", what));
  }
  try {
    point_latest_at(checkpoints_dir, final_dir);
  } catch (const Error& e) {
    // Its message names the file already: "DIR/latest: cannot write: ...", as a checkpoint error.
    throw Error(ErrorKind::checkpoint, e.what());
  }
  const auto all = list_checkpoints(checkpoints_dir);
  for (size_t i = static_cast<size_t>(std::max<int64_t>(keep, 1)); i < all.size(); ++i) {
    // Renamed out of the list first: a reader (ckpt verify, report) sees the whole checkpoint or
    // none of it, never one half deleted.
    const fs::path doomed = checkpoints_dir / (kPrunedPrefix + all[i].filename().string());
    std::error_code renamed;
    fs::rename(all[i], doomed, renamed);
    std::error_code ignored;
    fs::remove_all(renamed ? all[i] : doomed, ignored);
  }
  return final_dir;
}

std::vector<fs::path> incomplete_checkpoints(const fs::path& checkpoints_dir) {
  std::vector<fs::path> out;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(checkpoints_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with(".tmp-") || name.starts_with(kPrunedPrefix)) out.push_back(entry.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

void remove_incomplete_checkpoints(const fs::path& checkpoints_dir) {
  for (const auto& dir : incomplete_checkpoints(checkpoints_dir)) {
    std::error_code ignored;
    fs::remove_all(dir, ignored);
  }
}

CheckpointData read_checkpoint(const fs::path& dir, CheckpointBlobs which) {
  MetaCheck checked = check_meta(dir);
  if (!checked.problem.empty()) fail(dir / kMetaFile, checked.problem);
  std::optional<Meta>& meta = checked.meta;
  std::array<std::vector<float>, kBlobNames.size()> blobs;
  for (BlobStatus& blob : meta->blobs) {
    if (which == CheckpointBlobs::params && blob.name != kBlobNames[0]) continue;
    const auto index = std::find(kBlobNames.begin(), kBlobNames.end(), blob.name);
    check_blob(dir, blob, &blobs[static_cast<size_t>(index - kBlobNames.begin())]);
    if (!blob.ok()) fail(dir / blob.file, blob.problem);
  }
  return {std::move(meta->position), std::move(blobs[0]), std::move(blobs[1]), std::move(blobs[2])};
}

bool CheckpointStatus::ok() const {
  return meta_problem.empty() && unusable.empty() &&
         std::all_of(blobs.begin(), blobs.end(), [](const BlobStatus& b) { return b.ok(); });
}

bool CheckpointStatus::denied() const {
  return !ok() && unusable.empty() && (meta_problem.empty() || meta_denied) &&
         std::all_of(blobs.begin(), blobs.end(),
                     [](const BlobStatus& b) { return b.ok() || b.denied; });
}

std::optional<TrainingPosition> checkpoint_position(const fs::path& dir, std::string* problem) {
  MetaCheck checked = check_meta(dir);
  if (!checked.problem.empty() || !checked.meta) {
    if (problem != nullptr) *problem = fmt::format("{}: {}", kMetaFile, checked.problem);
    return std::nullopt;
  }
  return checked.meta->position;
}

std::vector<std::string> CheckpointStatus::problems() const {
  std::vector<std::string> out;
  if (!meta_problem.empty()) out.push_back(fmt::format("{}: {}", kMetaFile, meta_problem));
  if (!unusable.empty()) out.push_back(fmt::format("{}: {}", kMetaFile, unusable));
  for (const auto& blob : blobs) {
    if (!blob.ok()) out.push_back(fmt::format("{}: {}", blob.file, blob.problem));
  }
  return out;
}

namespace {

CheckpointStatus verify_in_place(const fs::path& dir, const ReadProgress& progress) {
  CheckpointStatus status;
  status.dir = dir;
  status.step = checkpoint_step(dir);
  status.set_aside = is_set_aside(dir);
  MetaCheck checked = check_meta(dir);
  status.meta_problem = std::move(checked.problem);
  status.meta_denied = checked.denied;
  status.meta_checksum = std::move(checked.checksum);
  status.meta_actual_checksum = std::move(checked.actual_checksum);
  std::optional<Meta>& meta = checked.meta;
  if (!meta) return status;
  // A meta.json that cannot be trusted does not get to say which step this is.
  if (status.meta_problem.empty() || status.step < 0) status.step = meta->position.step;
  status.position = std::move(meta->position);
  status.blobs = std::move(meta->blobs);
  uint64_t done = 0, total = 0;
  for (const auto& blob : status.blobs)
    total += blob.bytes;
  for (auto& blob : status.blobs) {
    check_blob(dir, blob, nullptr, progress, done, total);
    done += blob.bytes;
  }
  return status;
}

}  // namespace

CheckpointStatus verify_checkpoint(const fs::path& dir, const ReadProgress& progress) {
  CheckpointStatus status = verify_in_place(dir, progress);
  std::error_code ec;
  if (!status.ok() && !fs::exists(dir, ec) && !ec) status.gone = true;
  return status;
}

std::string meta_json_checksum(const std::string& meta_text) {
  json meta;
  try {
    meta = parse_json(meta_text);
  } catch (const json::exception&) {
    throw Error(ErrorKind::checkpoint, fmt::format("{}: not valid JSON", kMetaFile));
  }
  if (!meta.is_object()) {
    throw Error(ErrorKind::checkpoint, fmt::format("{}: not a JSON object", kMetaFile));
  }
  return content_checksum(std::move(meta));
}

std::vector<fs::path> list_checkpoints(const fs::path& checkpoints_dir, SetAside set_aside) {
  struct Found {
    int64_t step;
    bool set_aside;
    fs::path dir;
  };
  std::vector<Found> found;
  std::error_code ec;
  fs::directory_iterator entries(checkpoints_dir, ec);
  // Missing is "none yet"; out of reach (a permission) is not: starting over would lose them.
  // Nor is a file (or a link loop) where the directory belongs: said so, not "no checkpoint".
  if (ec && ec != std::errc::no_such_file_or_directory) {
    throw Error(ErrorKind::checkpoint,
                fmt::format("{}: cannot list the checkpoints: {}",
                            printable(checkpoints_dir.string()), ec.message()));
  }
  for (const auto& entry : entries) {
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

fs::path checkpoint_named(const fs::path& checkpoints_dir, const std::string& given) {
  // Newest first, a live checkpoint before a set-aside one of the same step.
  const auto all = list_checkpoints(checkpoints_dir, SetAside::include);
  // "step-000030/", as a shell completes a directory's name.
  std::string name = given;
  while (name.size() > 1 && name.back() == '/')
    name.pop_back();
  if (name == kLatestFile) {
    const LatestStatus latest = check_latest(checkpoints_dir);
    if (latest.exists && latest.ok() && !latest.dir.empty()) return latest.dir;
    throw Error(ErrorKind::usage,
                fmt::format("{}: no checkpoint {} ({})",
                            printable(checkpoints_dir.parent_path().string()), name,
                            latest.exists ? "checkpoints/latest " + printable(latest.problem)
                                          : std::string("there is no checkpoints/latest")));
  }
  std::optional<int64_t> number;
  int64_t step = 0;
  const char* end = name.data() + name.size();
  const auto [ptr, ec] = std::from_chars(name.data(), end, step);
  if (!name.empty() && ec == std::errc() && ptr == end && step >= 0) number = step;
  const auto found = std::find_if(all.begin(), all.end(), [&](const fs::path& dir) {
    return number ? checkpoint_step(dir) == *number : dir.filename() == name;
  });
  if (found != all.end()) return *found;
  std::vector<std::string> names;
  for (const auto& dir : all)
    names.push_back(dir.filename().string());
  throw Error(ErrorKind::usage,
              fmt::format("{}: no checkpoint {} (it has {})",
                          printable(checkpoints_dir.parent_path().string()), name,
                          names.empty() ? "none" : fmt::format("{}", fmt::join(names, ", "))));
}

bool set_aside_newer(const fs::path& checkpoints_dir, int64_t step,
                     const std::function<void(const std::string&)>& warn) {
  bool moved = false;
  for (const auto& dir : list_checkpoints(checkpoints_dir)) {
    if (checkpoint_step(dir) <= step) break;  // newest first
    const fs::path aside = set_aside_path(dir);
    std::error_code ec;
    fs::rename(dir, aside, ec);
    if (!ec) {
      moved = true;
      warn(fmt::format("set aside {} as {}", dir.filename().string(), aside.filename().string()));
    } else {
      warn(
          fmt::format("cannot set aside {} as {}: {}; it stays, and the run writes its own "
                      "checkpoint of that step over it",
                      dir.filename().string(), aside.filename().string(), ec.message()));
    }
  }
  return moved;
}

void point_latest_at(const fs::path& checkpoints_dir, const fs::path& checkpoint) {
  write_file_atomic(checkpoints_dir / kLatestFile, checkpoint.filename().string() + "\n");
}

fs::path latest_checkpoint(const fs::path& checkpoints_dir) {
  std::error_code ec;
  // Missing, or not a file (a pipe would block the reader): no `latest`.
  if (!fs::is_regular_file(fs::symlink_status(checkpoints_dir / kLatestFile, ec))) return {};
  std::string name = read_file(checkpoints_dir / kLatestFile);
  while (!name.empty() && (name.back() == '\n' || name.back() == ' '))
    name.pop_back();
  // Only a plain name inside checkpoints/: `latest` must never lead elsewhere.
  if (name.find('/') != std::string::npos || step_of(name) < 0) return {};
  return checkpoints_dir / name;
}

LatestStatus check_latest(const fs::path& checkpoints_dir) {
  LatestStatus out;
  const fs::path file = checkpoints_dir / kLatestFile;
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(file, ec))) return out;
  out.exists = true;
  // Never followed elsewhere, nor echoed from elsewhere in a message.
  bool denied = false;
  std::optional<std::string> read = read_part(file, out.problem, denied);
  if (!read) return out;
  std::string text = std::move(*read);
  while (!text.empty() && (text.back() == '\n' || text.back() == ' '))
    text.pop_back();
  if (text.empty()) {
    out.problem = "is empty; it should name a checkpoint directory (step-NNNNNN)";
    return out;
  }
  if (text.find('/') != std::string::npos || step_of(text) < 0) {
    out.problem = fmt::format("holds {}, not the name of a checkpoint directory (step-NNNNNN)",
                              as_quoted(text, 60));
    return out;
  }
  out.name = text;
  out.dir = checkpoints_dir / text;
  if (fs::is_directory(out.dir, ec)) return out;
  fs::path aside = out.dir;
  aside += kSetAsideSuffix;
  if (fs::is_directory(aside, ec)) {
    out.problem = fmt::format(
        "names {}, which does not exist: resume set it aside as {} (it failed verification)", text,
        aside.filename().string());
  } else if (fs::exists(fs::symlink_status(out.dir, ec))) {
    out.problem = fmt::format("names {}, which is not a directory", text);
  } else {
    out.problem = fmt::format("names {}, which does not exist", text);
  }
  return out;
}

namespace {

// One pass of try_find_valid_checkpoint over the checkpoints listed now; `pruned` set when one
// was gone by the time it was read.
std::optional<fs::path> find_in_listing(const fs::path& checkpoints_dir,
                                        const std::function<void(const std::string&)>& warn,
                                        const CheckpointFilter& unusable,
                                        const std::function<void()>& check_stop, bool& pruned) {
  std::vector<fs::path> candidates;
  // `latest` first; one that cannot be followed is said to be (the step-* directories are
  // tried all the same).
  if (const LatestStatus latest = check_latest(checkpoints_dir); !latest.ok()) {
    warn(fmt::format("{}: {}", printable((checkpoints_dir / "latest").string()), latest.problem));
  } else if (!latest.dir.empty()) {
    candidates.push_back(latest.dir);
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
    if (check_stop) check_stop();
    const CheckpointStatus checked = verify_checkpoint(dir);
    if (checked.gone) {
      pruned = true;  // not damage: the run removed it after the listing
      continue;
    }
    if (checked.ok()) {
      const std::string why =
          unusable && checked.position ? unusable(*checked.position) : std::string();
      if (why.empty()) return dir;
      warn(fmt::format("skipping checkpoint {}: {}", dir.filename().string(), why));
      continue;
    }
    const std::string problems = fmt::format("{}", fmt::join(checked.problems(), "; "));
    if (checked.denied()) {
      // Not damage: skipping it would throw away its steps, and resume would set it aside.
      throw Error(ErrorKind::checkpoint,
                  fmt::format("{}: {}: the checkpoint is out of reach, not damaged; give dptrain "
                              "read access to it (or move it away) and try again",
                              printable(dir.string()), problems));
    }
    warn(fmt::format("skipping checkpoint {}: {}", dir.filename().string(), problems));
  }
  return std::nullopt;
}

}  // namespace

std::optional<fs::path> try_find_valid_checkpoint(
    const fs::path& checkpoints_dir, const std::function<void(const std::string&)>& warn,
    const CheckpointFilter& unusable, const std::function<void()>& check_stop) {
  // A run that trains on while this reads (sample, a copy) prunes what it read: the search
  // starts again from the newer ones, a few times, each warning said once.
  std::set<std::string> said;
  const auto warn_once = [&](const std::string& w) {
    if (said.insert(w).second) warn(w);
  };
  for (int search = 1;; ++search) {
    bool pruned = false;
    if (auto found = find_in_listing(checkpoints_dir, warn_once, unusable, check_stop, pruned)) {
      return found;
    }
    if (!pruned || search == 5) return std::nullopt;
  }
}

void PassedOver::tell() const {
  if (!warn) return;
  for (const auto& why : said)
    warn(why);
}

std::optional<fs::path> PassedOver::search(const fs::path& checkpoints_dir,
                                           const CheckpointFilter& unusable,
                                           const std::function<void()>& check_stop) {
  try {
    return try_find_valid_checkpoint(checkpoints_dir, std::ref(*this), unusable, check_stop);
  } catch (...) {
    tell();
    throw;
  }
}

std::string PassedOver::lines() const {
  constexpr size_t kShown = 8;
  std::string out;
  for (size_t i = 0; i < said.size() && i < kShown; ++i)
    out += "\n  " + said[i];
  if (said.size() > kShown) {
    out += fmt::format("\n  ... and {} more", said.size() - kShown);
  }
  return out;
}

fs::path find_valid_checkpoint(const fs::path& checkpoints_dir,
                               const std::function<void(const std::string&)>& warn,
                               const CheckpointFilter& unusable,
                               const std::function<void()>& check_stop) {
  PassedOver passed{warn, {}};
  if (auto found = passed.search(checkpoints_dir, unusable, check_stop)) {
    passed.tell();
    return std::move(*found);
  }
  throw Error(ErrorKind::checkpoint,
              fmt::format("{}: no valid checkpoint to resume from{}",
                          printable(checkpoints_dir.string()), passed.lines()));
}

}  // namespace dptrain
