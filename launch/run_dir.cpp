// The run directory: run.json (recipe, world size, generations, status), logs/, checkpoints/.
#include "launch/run_dir.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <fstream>
#include <mutex>
#include <optional>
#include <set>
#include <system_error>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/checkpoint.hpp"
#include "core/comm/auth.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"
#include "launch/hostfile.hpp"
#include "launch/ssh.hpp"

namespace dptrain {

namespace fs = std::filesystem;

namespace {

std::string utc_format(const char* format) {
  const std::time_t now = std::time(nullptr);
  std::tm tm{};
  ::gmtime_r(&now, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, format, &tm);
  return buf;
}

void make_layout(const fs::path& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    throw Error(ErrorKind::usage,
                fmt::format("{}: cannot create run directory: {}{}", printable(dir.string()),
                            ec.message(), cwd_gone_note(dir)));
  }
  // Its parts, named where one is in the way (a file named logs).
  for (const char* part : {"logs", "checkpoints"}) {
    fs::create_directories(dir / part, ec);
    if (ec) {
      std::error_code type_ec;
      const bool blocked = fs::exists(fs::symlink_status(dir / part, type_ec)) &&
                           !fs::is_directory(dir / part, type_ec);
      throw Error(ErrorKind::usage,
                  blocked ? fmt::format("{}: not a directory, where the run keeps its {}; move it "
                                        "away",
                                        printable((dir / part).string()), part)
                          : fmt::format("{}: cannot make the run's {} directory: {}{}",
                                        printable((dir / part).string()), part, ec.message(),
                                        cwd_gone_note(dir)));
    }
  }
}

constexpr const char* kLockFile = ".lock";

// Room the run's own files need below its directory: the longest are a checkpoint blob's
// temporary file ("checkpoints/.tmp-step-1000000000000-PID/optimizer.bin.tmp-PID", 70 bytes)
// and a rank's log named by its host ("logs/HOST-rankN.log").
constexpr size_t kRoomForFiles = 160;

// A directory so deep that the files under it would pass the system's limit on a path is
// refused before anything is made, not found out by a rank at its first checkpoint.
void check_path_room(const fs::path& dir, const char* option) {
  std::string absolute;
  try {
    absolute = resolved_path(dir).string();
  } catch (const fs::filesystem_error&) {
    return;  // no absolute form (the current directory is gone): making it says why
  }
  if (absolute.size() + kRoomForFiles <= PATH_MAX) return;
  throw Error(ErrorKind::usage,
              fmt::format("{}: {}: a path of {} bytes leaves less than the {} a run's files need "
                          "below the system's limit of {} bytes on a path; choose a shorter one",
                          option, printable_excerpt(absolute, 80), absolute.size(), kRoomForFiles,
                          PATH_MAX));
}

// A temporary write_file_atomic left beside one of the run's own files ("run.json.tmp-PID") when
// its process was killed between writing and renaming it: that process is gone from this machine.
bool dead_run_temporary(const std::string& name) {
  for (const std::string_view own : {"run.json", "recipe.json", "result.json"}) {
    if (const long pid = temporary_pid(name, fmt::format("{}.tmp-", own))) {
      return !process_alive(pid);
    }
  }
  return false;
}

// Nothing in `dir` but what a start that failed before its run.json leaves: the lock, empty logs/
// and checkpoints/, and the temporaries of a launch killed as it wrote its first files. Anything
// else (another run's checkpoints, the user's files) is not ours.
std::optional<std::string> foreign_entry(const fs::path& dir) {
  return unclaimed_entry(dir, [](const fs::directory_entry& entry) {
    const std::string name = entry.path().filename().string();
    if (name == kLockFile || dead_run_temporary(name)) return true;
    if (name != "logs" && name != "checkpoints") return false;
    std::error_code ec;
    const bool empty = entry.is_directory(ec) && fs::is_empty(entry.path(), ec);
    // One that cannot be listed (no descriptor free, a permission) is not taken for full.
    if (ec) {
      throw Error(ErrorKind::usage, fmt::format("{}: cannot list: {}",
                                                printable(entry.path().string()), ec.message()));
    }
    return empty;
  });
}

}  // namespace

std::string RunDirectory::remote_name() const {
  const std::string base = path_.filename().string();
  const std::string id = info_.value("id", std::string());
  return id.empty() ? base : base + "-" + id;
}

nlohmann::json read_run_json(const fs::path& dir) {
  const fs::path file = dir / "run.json";
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    // A directory above it this user may not search (EACCES) is not "no such" one.
    const bool unreachable =
        ec && ec != std::errc::no_such_file_or_directory && ec != std::errc::not_a_directory;
    throw Error(ErrorKind::usage,
                fmt::format("{}: {}", printable(dir.string()),
                            unreachable           ? "cannot be read: " + ec.message()
                            : fs::exists(dir, ec) ? "not a run directory (not a directory)"
                                                  : "no such run directory"));
  }
  // A pipe would block the reader; a directory is no run's record.
  if (const char* kind = non_regular_kind(fs::status(file, ec))) {
    throw Error(ErrorKind::usage,
                fmt::format("{}: is {}, not a regular file: {} is not a run directory",
                            printable(file.string()), kind, printable(dir.string())));
  }
  std::string text;
  try {
    text = read_file(file);
  } catch (const Error&) {
    // Why, where it is more than a missing file (a directory or run.json this user may not
    // read): "... (no readable run.json: Permission denied)".
    const int why = ::access(file.c_str(), R_OK) == 0 ? 0 : errno;
    // A directory inside a run (its checkpoints/, one checkpoint): the run it belongs to.
    std::string above;
    if (why == ENOENT) {
      if (const auto run = run_dir_holding(fs::absolute(dir, ec))) {
        above =
            fmt::format("; it lies in the run directory {}: give that", printable(run->string()));
      }
    }
    throw Error(
        ErrorKind::usage,
        fmt::format("{}: not a run directory (no readable run.json{}){}", printable(dir.string()),
                    why == 0 || why == ENOENT ? "" : ": " + std::string(std::strerror(why)),
                    above));
  }
  nlohmann::json info;
  try {
    info = parse_json(text);
  } catch (const nlohmann::json::exception& e) {
    throw Error(ErrorKind::usage, json_parse_problem(printable(file.string()), text, e));
  }
  if (!info.is_object()) {
    throw Error(ErrorKind::usage, fmt::format("{}: not a JSON object", printable(file.string())));
  }
  return info;
}

std::optional<RemoteCheckpoint> remote_last_checkpoint(const nlohmann::json& info) {
  const auto it = info.find("last_checkpoint");
  if (it == info.end() || !it->is_object()) return std::nullopt;
  const auto host = it->find("host");
  const auto path = it->find("path");
  // Older launchers recorded a local rank 0's host as "localhost" too.
  if (host == it->end() || !host->is_string() || *host == "localhost" || path == it->end() ||
      !path->is_string()) {
    return std::nullopt;
  }
  return RemoteCheckpoint{path->get<std::string>(), host->get<std::string>()};
}

std::string recorded_local_checkpoint(const nlohmann::json& info) {
  const auto it = info.find("last_checkpoint");
  if (it == info.end() || !it->is_object() || remote_last_checkpoint(info)) return {};
  const std::string name = it->value("name", std::string());
  return name.empty() ? "a checkpoint" : name;
}

void record_run_failure(nlohmann::json& info, const std::string& error) {
  info["status"] = "failed";
  info["error"] = error;
  info.erase("pending_restart");
  const auto generations = info.find("generations");
  if (generations == info.end() || !generations->is_array() || generations->empty()) return;
  nlohmann::json& last = generations->back();
  if (last.contains("ended_at") && last.value("status", "") != "completed") return;
  if (!last.contains("ended_at")) last["ended_at"] = utc_timestamp();
  last["status"] = "failed";
  last["error"] = error;
}

nlohmann::json world_size_change(int64_t from, int64_t to, nlohmann::json hosts,
                                 nlohmann::json lost, nlohmann::json joined, int64_t global_batch,
                                 int64_t generation) {
  return {{"from", from},
          {"to", to},
          {"hosts", std::move(hosts)},
          {"lost", std::move(lost)},
          {"joined", std::move(joined)},
          {"global_batch", global_batch},
          {"generation", generation},
          {"at", utc_timestamp()}};
}

std::string utc_timestamp() {
  return utc_format("%Y-%m-%dT%H:%M:%SZ");
}

std::string utc_timestamp_of(const fs::path& file) {
  struct stat st {};
  if (::stat(file.c_str(), &st) != 0) return "";
  std::tm tm{};
  ::gmtime_r(&st.st_mtime, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return buf;
}

std::optional<int64_t> seconds_since(const std::string& stamp) {
  std::tm tm{};
  const char* end = ::strptime(stamp.c_str(), "%Y-%m-%dT%H:%M:%SZ", &tm);
  if (end == nullptr || *end != '\0') return std::nullopt;
  return static_cast<int64_t>(std::time(nullptr) - ::timegm(&tm));
}

namespace {

// Error(usage) when `p` holds a run a launch must not start over; `mine`: this launch holds the
// directory's lock (it made the layout).
void refuse_held_run(const fs::path& p, bool mine) {
  std::error_code exists_ec;
  if (!fs::exists(p / "run.json", exists_ec)) return;
  // Still running (its launcher, or its workers' rank 0, holds the lock): neither resume nor a
  // start of its workers is for now.
  if (!mine && run_locked_by_another(p)) {
    throw Error(ErrorKind::usage,
                fmt::format("{}: already holds a run, which another dptrain is running now (a "
                            "launcher, or workers started without one: it holds {}); choose "
                            "another --run-dir",
                            printable(p.string()), printable((p / kLockFile).string())));
  }
  // A benchmark's run (no recipe) or a completed one has nothing to resume; workers started
  // without a launcher continue theirs themselves.
  nlohmann::json info;
  try {
    info = read_run_json(p);
  } catch (const Error& e) {
    // Torn (a disk's or filesystem's damage): a resume cannot read it either.
    throw Error(ErrorKind::usage,
                fmt::format("{}: already holds a run whose record does not read ({}): neither a "
                            "resume nor a launch continues it; repair run.json (its checkpoints "
                            "and recipe.json are there), or choose another --run-dir",
                            printable(p.string()), first_line(e.what())));
  }
  std::string how = "continue it with " + resume_command(p);
  if (info.is_object() && !info.contains("recipe")) {
    throw Error(ErrorKind::usage,
                fmt::format("{}: already holds a benchmark's run; choose another --run-dir",
                            printable(p.string())));
  }
  if (info.is_object() && info.value("status", nlohmann::json()) == "completed") {
    throw Error(ErrorKind::usage,
                fmt::format("{}: already holds a run, which completed; choose another --run-dir",
                            printable(p.string())));
  }
  if (info.is_object() && started_by_workers(info)) {
    how = fmt::format(
        "its workers were started without a launcher: start them again with '{}' "
        "to continue it",
        hand_resume_flag(p));
  }
  throw Error(ErrorKind::usage, fmt::format("{}: already holds a run; {}, or choose another "
                                            "--run-dir",
                                            printable(p.string()), how));
}

// Error(usage) when a run directory made at `path` (or, with `is_parent`, in it) would lie in
// another run's checkpoints/ or logs/ (below a directory holding a run.json): that run's resume
// would take it for a damaged checkpoint and set it aside, and its pruning could remove it.
// Both the path as written and the one it resolves to are walked: a run's checkpoints/ may be a
// link to scratch space, and a path through the link is inside the run all the same.
void refuse_inside_run(const fs::path& path, const char* option, bool is_parent = false) {
  std::error_code ec;
  const fs::path absolute = fs::absolute(path.empty() ? "." : path, ec);
  if (ec) return;
  const fs::path real = fs::weakly_canonical(absolute, ec);
  if (ec) return;
  for (const fs::path& walked : {real, absolute.lexically_normal()}) {
    // The entry of `up` toward `walked`.
    fs::path below = is_parent ? fs::path() : walked.filename();
    for (fs::path up = is_parent ? walked : walked.parent_path(); !up.empty();
         up = up.parent_path()) {
      if ((below == "checkpoints" || below == "logs") && fs::is_regular_file(up / "run.json", ec)) {
        throw Error(
            ErrorKind::usage,
            fmt::format("{} {}: inside {}/ of the run {}, whose resume or pruning would "
                        "move or remove it; choose a directory outside it",
                        option, printable(path.string()), below.string(), printable(up.string())));
      }
      if (up == up.root_path()) break;
      below = up.filename();
    }
  }
}

}  // namespace

void RunDirectory::check_runs_root(const fs::path& runs_root) {
  refuse_inside_run(runs_root, "--runs-root", /*is_parent=*/true);
}

void RunDirectory::check_new(const fs::path& path) {
  std::error_code ec;
  check_path_room(path, "--run-dir");
  refuse_inside_run(path, "--run-dir");
  if (fs::is_symlink(fs::symlink_status(path, ec))) {
    // mkdir through a dangling link fails with a bare "File exists".
    std::error_code target_ec;
    const bool reached = fs::exists(path, target_ec);
    if (!reached) {
      const std::string target = printable(fs::read_symlink(path, ec).string());
      throw Error(ErrorKind::usage,
                  target_ec ? fmt::format("{}: a symbolic link to {}, which cannot be followed: "
                                          "{}; choose another --run-dir",
                                          printable(path.string()), target, target_ec.message())
                            : fmt::format("{}: a symbolic link to {}, which does not exist: "
                                          "create the directory it names, or choose another "
                                          "--run-dir",
                                          printable(path.string()), target));
    }
  }
  refuse_held_run(path, false);
  if (fs::exists(path, ec)) {
    if (!fs::is_directory(path, ec)) {
      throw Error(ErrorKind::usage, fmt::format("{}: is not a directory; choose another --run-dir",
                                                printable(path.string())));
    }
    if (const auto entry = foreign_entry(path)) {
      // A launch that made it a moment ago and holds it (its run.json not yet written).
      if (run_locked_by_another(path)) {
        throw Error(ErrorKind::usage,
                    fmt::format("{}: another dptrain is starting a run there (it holds {}); "
                                "give another --run-dir",
                                printable(path.string()), printable((path / ".lock").string())));
      }
      throw Error(ErrorKind::usage,
                  fmt::format("{}: holds '{}' but no run.json: not a run directory, and its "
                              "files would be taken for the run's; choose an empty or new "
                              "--run-dir",
                              printable(path.string()), printable(*entry)));
    }
  }
}

RunDirectory RunDirectory::create(const fs::path& dir, const fs::path& runs_root,
                                  const std::string& name) {
  fs::path path = dir;
  std::error_code ec;
  if (path.empty()) {
    // create_directory is the claim: of two launches racing for one name, one makes it and the
    // other moves on to the next suffix.
    const fs::path base = runs_root / fmt::format("{}-{}", name, utc_format("%Y%m%d-%H%M%S"));
    check_path_room(base.string() + "-99", "--runs-root");
    check_runs_root(runs_root);
    if (!runs_root.empty()) fs::create_directories(runs_root, ec);
    for (int i = 1; !ec; ++i) {
      path = i == 1 ? base : fs::path(fmt::format("{}-{}", base.string(), i));
      if (fs::create_directory(path, ec)) break;
    }
    if (ec) {
      // The runs root itself may be what could not be made.
      const fs::path where = path.empty() ? (runs_root.empty() ? base : runs_root) : path;
      throw Error(ErrorKind::usage,
                  fmt::format("{}: cannot create run directory: {}{}", printable(where.string()),
                              ec.message(), cwd_gone_note(where)));
    }
  } else {
    check_new(path);
  }
  dptrain::make_layout(path);
  RunDirectory run(resolved_path(path), nlohmann::json::object());
  run.lock(/*for_new_run=*/true);
  // A launch that won the race for this --run-dir and has finished already.
  refuse_held_run(path, true);
  // What a launch killed as it wrote its first files left (check_new took them for that).
  run.remove_dead_temporaries();
  run.info_ = new_run_info();
  return run;
}

void check_record_types(const nlohmann::json& info, const fs::path& file, RecordCheck what) {
  using nlohmann::json;
  struct Kind {
    const char* name;
    bool (*is)(const json&);
  };
  static constexpr Kind kString{"a string", [](const json& j) { return j.is_string(); }};
  static constexpr Kind kInteger{"an integer", [](const json& j) { return j.is_number_integer(); }};
  static constexpr Kind kPositive{"an integer >= 1", [](const json& j) {
                                    return j.is_number_integer() && j.get<int64_t>() >= 1;
                                  }};
  static constexpr Kind kArray{"an array", [](const json& j) { return j.is_array(); }};
  static constexpr Kind kObject{"an object", [](const json& j) { return j.is_object(); }};
  const auto check = [&](const json& parent, const std::string& pointer, const char* key,
                         const Kind& kind) {
    const auto it = parent.find(key);
    if (it == parent.end() || it->is_null() || kind.is(*it)) return;
    throw Error(
        ErrorKind::usage,
        fmt::format("{}: {}/{}: expected {}, got {} (the record was edited or damaged: "
                    "fix that field)",
                    file.string(), pointer, key, kind.name, printable_excerpt(json_text(*it))));
  };
  const bool all = what == RecordCheck::all;
  for (const char* key : {"id", "status", "backend", "recipe_file", "started_by", "error", "store",
                          "alive_at", "created_at"})
    if (all) check(info, "", key, kString);
  for (const char* key : {"world_size", "nominal_world_size"})
    if (all) check(info, "", key, kPositive);
  for (const char* key :
       {"generations", "hosts", "job_hosts", "restarts", "resizes", "world_size_changes"}) {
    if (all) check(info, "", key, kArray);
    if (!info.contains(key) || !info[key].is_array()) continue;
    for (size_t i = 0; i < info[key].size(); ++i) {
      const std::string at = fmt::format("/{}/{}", key, i);
      if (!info[key][i].is_object()) {
        throw Error(ErrorKind::usage,
                    fmt::format("{}: {}: expected an object, got {} (the record was edited or "
                                "damaged: fix that field)",
                                file.string(), at, printable_excerpt(json_text(info[key][i]))));
      }
    }
  }
  if (!all) return;
  for (size_t i = 0; i < info.value("generations", json::array()).size(); ++i) {
    const json& g = info["generations"][i];
    const std::string at = fmt::format("/generations/{}", i);
    for (const char* key : {"status", "started_at", "ended_at", "error", "backend"})
      check(g, at, key, kString);
    for (const char* key : {"world_size", "step"})
      check(g, at, key, kInteger);
  }
  for (const char* list : {"hosts", "job_hosts"}) {
    for (size_t i = 0; i < info.value(list, json::array()).size(); ++i) {
      const std::string at = fmt::format("/{}/{}", list, i);
      check(info[list][i], at, "host", kString);
      check(info[list][i], at, "key", kString);
      check(info[list][i], at, "slots", kInteger);
    }
  }
  for (const char* key : {"last_checkpoint", "launcher", "result", "pending_restart", "job_size"})
    check(info, "", key, kObject);
  if (info.contains("job_size")) {
    for (const char* key : {"min", "max"})
      check(info["job_size"], "/job_size", key, kPositive);
    check(info["job_size"], "/job_size", "of", kString);
  }
}

RunDirectory RunDirectory::open(const fs::path& dir, RecordCheck what) {
  nlohmann::json info = read_run_json(dir);
  check_record_types(info, dir / "run.json", what);
  return RunDirectory(resolved_path(dir), std::move(info));
}

void RunDirectory::make_layout() const {
  dptrain::make_layout(path_);
}

void check_run_files(const fs::path& run_dir) {
  for (const char* name : {"recipe.json", "metrics.jsonl", "result.json", "checkpoints/latest"}) {
    try {
      check_regular_or_missing(run_dir / name);
    } catch (const Error& e) {
      throw Error(ErrorKind::usage, e.what());
    }
  }
}

std::optional<fs::path> run_dir_holding(const fs::path& file) {
  std::error_code ec;
  const fs::path full = fs::weakly_canonical(fs::absolute(file, ec), ec);
  if (ec) return std::nullopt;
  for (fs::path dir = full.parent_path(); !dir.empty(); dir = dir.parent_path()) {
    // dptrain's run.json (another tool's may have that name too), or one too damaged to tell.
    if (fs::is_regular_file(dir / "run.json", ec)) {
      try {
        const nlohmann::json info = read_run_json(dir);
        for (const char* key : {"dptrain_version", "generations", "status", "recipe"}) {
          if (info.contains(key)) return dir;
        }
      } catch (const Error&) {
        return dir;
      }
    }
    if (dir == dir.root_path()) break;
  }
  return std::nullopt;
}

namespace {

// Absolute, with links resolved as far as the path exists, and without a trailing separator or
// "." ("runs/new/" and "runs/new/." are runs/new, made or not).
fs::path full_path(const fs::path& path) {
  std::error_code ec;
  fs::path full = fs::weakly_canonical(fs::absolute(path, ec), ec);
  while (!full.has_filename() && full.has_relative_path())
    full = full.parent_path();
  return full;
}

}  // namespace

bool lies_in(const fs::path& file, const fs::path& dir) {
  return full_path(file).parent_path() == full_path(dir);
}

void check_events_place(const std::string& flag, const fs::path& file, const fs::path& own) {
  const fs::path mine = own.empty() ? fs::path() : full_path(own);
  const fs::path full = full_path(file);
  const auto holder = run_dir_holding(file);
  // Where it lies in the run's own directory (made or not yet).
  fs::path within;
  if (!mine.empty()) {
    within = full.lexically_relative(mine);
    if (within.empty() || *within.begin() == ".." || within == ".") within.clear();
  }
  if (!holder && within.empty()) return;
  // The run's own names, and what a run directory may come to hold.
  static constexpr std::array kRunNames = {"run.json",    "metrics.jsonl", "result.json",
                                           "recipe.json", "report.html",   kLockFile,
                                           "logs",        "checkpoints"};
  const bool next_to_run_json = !within.empty() && !within.has_parent_path();
  const bool ours = !within.empty() && (!holder || *holder == mine);
  if (ours && next_to_run_json &&
      std::find(kRunNames.begin(), kRunNames.end(), within.string()) == kRunNames.end()) {
    return;
  }
  const fs::path run = ours ? mine : *holder;
  throw Error(
      ErrorKind::usage,
      fmt::format(
          "{} {}: {} the run directory {}, whose files the events must not mix "
          "with; name a file outside every run directory, or one of its own "
          "next to run.json in the run's directory (such as {})",
          flag, printable(file.string()),
          ours && next_to_run_json ? "one of the files of" : "inside", printable(run.string()),
          printable(((own.empty() ? fs::path("RUN_DIR") : own) / "events.jsonl").string())));
}

RepeatedFailure repeated_failure(const nlohmann::json& info) {
  RepeatedFailure out;
  if (!info.is_object()) return out;
  const nlohmann::json generations = info.value("generations", nlohmann::json::array());
  if (!generations.is_array()) return out;
  for (auto it = generations.rbegin(); it != generations.rend(); ++it) {
    if (!it->is_object()) break;
    // A host that could not be reached: not counted, and not the end of the row (as
    // run_job_with_restarts counts).
    if (it->value("host_unreachable", false)) continue;
    const nlohmann::json step = it->value("step", nlohmann::json());
    if (it->value("status", "") != "failed" || !step.is_number_integer()) break;
    if (out.times > 0 && step.get<int64_t>() != out.step) break;
    out.step = step.get<int64_t>();
    ++out.times;
  }
  return out;
}

nlohmann::json new_run_info() {
  return {{"id", generate_job_secret().substr(0, 12)},
          {"created_at", utc_timestamp()},
          {"dptrain_version", DPTRAIN_VERSION},
          {"generations", nlohmann::json::array()}};
}

namespace {

// The lock files (device, inode) this process holds: a probe of one of them from this process
// would take a second open file's flock for someone else's.
std::mutex g_held_mutex;
std::set<std::pair<dev_t, ino_t>> g_held;

std::optional<std::pair<dev_t, ino_t>> file_id(int fd) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return std::nullopt;
  return std::pair{st.st_dev, st.st_ino};
}

}  // namespace

std::shared_ptr<const int> try_lock_run(const fs::path& dir, bool record_holder) {
  const fs::path file = dir / kLockFile;
  // A probe only reads (a viewer may not write the run); a holder creates and writes it.
  const int fd = record_holder ? ::open(file.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)
                               : ::open(file.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw Error(ErrorKind::usage,
                fmt::format("{}: cannot open: {}", printable(file.string()), std::strerror(errno)));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int error = errno;
    ::close(fd);
    if (error == EWOULDBLOCK) return nullptr;
    throw Error(ErrorKind::usage,
                fmt::format("{}: cannot lock: {}", printable(file.string()), std::strerror(error)));
  }
  const auto id = file_id(fd);
  if (id) {
    std::lock_guard lock(g_held_mutex);
    g_held.insert(*id);
  }
  auto held = std::shared_ptr<const int>(new int(fd), [id](const int* p) {
    if (id) {
      std::lock_guard lock(g_held_mutex);
      g_held.erase(*id);
    }
    ::close(*p);  // releases the flock
    delete p;
  });
  // Who holds it, for the refusal another process meets ("PID HOST"): run.json names the run's
  // launcher only once it has written it, and an earlier one's until then.
  const std::string holder = fmt::format("{} {}\n", ::getpid(), this_host());
  if (record_holder && ::ftruncate(fd, 0) == 0) {
    [[maybe_unused]] const auto written = ::pwrite(fd, holder.data(), holder.size(), 0);
  }
  return held;
}

bool run_locked_by_another(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir / kLockFile, ec)) return false;
  if (struct stat st{}; ::stat((dir / kLockFile).c_str(), &st) == 0) {
    std::lock_guard lock(g_held_mutex);
    if (g_held.count({st.st_dev, st.st_ino}) > 0) return false;  // this process holds it
  }
  try {
    return try_lock_run(dir, false) == nullptr;  // held only while it looks
  } catch (const Error&) {
    return false;  // not lockable here: nothing to tell
  }
}

void RunDirectory::lock(bool for_new_run) {
  if (lock_) return;
  // `dptrain status` and a refused launch probe the lock by taking it for a moment: a few tries
  // over a quarter of a second tell such a probe from a process that runs the job.
  for (int attempt = 0; !lock_ && attempt < 25; ++attempt) {
    if (attempt > 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    lock_ = try_lock_run(path_);
  }
  if (lock_) return;
  // The process that holds the lock, as it wrote itself into the lock file: a launcher, a
  // resume, or the rank 0 of workers started by hand into it.
  std::string who;
  std::ifstream holder(path_ / kLockFile);
  long pid = 0;
  std::string host;
  if (holder >> pid >> host && pid > 0) who = fmt::format(" (pid {} on {})", pid, host);
  if (for_new_run) {
    throw Error(ErrorKind::usage,
                fmt::format("{}: another dptrain is starting a run there{}; give another "
                            "--run-dir",
                            printable(path_.string()), who));
  }
  throw Error(ErrorKind::usage,
              fmt::format("{}: another dptrain is still running it{}; stop it first (SIGTERM "
                          "checkpoints) or wait for it",
                          printable(path_.string()), who));
}

void RunDirectory::remove_dead_temporaries() const {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(path_, ec)) {
    if (dead_run_temporary(entry.path().filename().string())) {
      std::error_code rm_ec;
      fs::remove(entry.path(), rm_ec);
    }
  }
}

bool started_by_workers(const nlohmann::json& info) {
  return info.is_object() && info.value("started_by", nlohmann::json()) == kStartedByWorkers;
}

std::string hand_resume_flag(const fs::path& run_dir) {
  // A hint: checkpoints/ that cannot be listed (a file there) is for the resume to say.
  try {
    return list_checkpoints(run_dir / "checkpoints").empty() ? "--resume newest-or-start"
                                                             : "--resume newest";
  } catch (const Error&) {
    return "--resume newest";
  }
}

std::vector<std::string> recorded_host_lines(const nlohmann::json& info) {
  std::vector<std::string> lines;
  // Workers started by hand record the machines they ran on, which no launcher reaches.
  if (!info.is_object() || started_by_workers(info)) return lines;
  bool remote = false;
  // An elastic job's every host (spares, and those lost along the way), else the last
  // generation's.
  const nlohmann::json hosts =
      info.value("job_hosts", info.value("hosts", nlohmann::json::array()));
  for (const auto& h : hosts.is_array() ? hosts : nlohmann::json::array()) {
    if (!h.is_object()) continue;
    const std::string name = h.value("host", std::string("localhost"));
    remote = remote || name != "localhost";
    lines.push_back(recorded_host_line(name, h.value("slots", 1), h.value("key", std::string())));
  }
  return remote ? lines : std::vector<std::string>{};
}

std::vector<HostSpec> recorded_remote_hosts(const nlohmann::json& info, const fs::path& run_json) {
  std::vector<HostSpec> hosts;
  for (const auto& line : recorded_host_lines(info)) {
    try {
      hosts.push_back(parse_hostfile_line(line));
    } catch (const Error& e) {
      throw Error(ErrorKind::usage,
                  fmt::format("{}: recorded host '{}': {} (the record was edited or damaged: fix "
                              "it, or give --hosts)",
                              printable(run_json.string()), printable(line), e.what()));
    }
    hosts.back().origin = run_json.string();
  }
  return hosts;
}

void remove_checkpoints(const fs::path& run_dir) {
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(run_dir / "checkpoints", ec))
    fs::remove_all(entry.path(), ec);
}

std::string resume_command(const fs::path& run_dir) {
  // A command to paste: the directory quoted for the shell where it has to be (a space, a
  // quote, a '$'); then without quotes of its own around it, which would read as nested.
  const std::string dir = printable(run_dir.string());
  const std::string word = shell_quote(dir);
  const std::string_view mark = word == dir ? "'" : "";
  return fmt::format("{}dptrain resume {}{}", mark, word, mark);
}

void RunDirectory::save() const {
  write_file_atomic(path_ / "run.json", json_text(info_, 2) + "\n");
}

bool RunDirectory::has_record() const {
  std::error_code ec;
  return fs::exists(fs::symlink_status(path_ / "run.json", ec));
}

bool RunDirectory::record() {
  try {
    save();
  } catch (const Error& e) {
    if (!behind_) {
      std::fprintf(stderr,
                   "dptrain: warning: %s; run.json is behind until it can be written (this alone "
                   "does not stop the job)\n",
                   first_line(e.what()).c_str());
    }
    behind_ = true;
    return false;
  }
  behind_ = false;
  return true;
}

}  // namespace dptrain
