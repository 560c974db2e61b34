// `dptrain ckpt list|verify RUN_DIR`: a run's checkpoints, and the checksums of their blobs.
#include <sys/stat.h>

#include <algorithm>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <system_error>

#include <fmt/chrono.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/json_errors.hpp"
#include "cli/run_report.hpp"
#include "core/checkpoint.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"
#include "core/recipe.hpp"
#include "launch/job.hpp"
#include "launch/run_dir.hpp"
#include "launch/status.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct CkptOptions {
  std::string run_dir;
  std::string step;  // verify: a step number or a directory name; empty: `latest`, else newest
  bool all = false;
  bool json = false;
};

// One checkpoint as ckpt shows it: its verification and what the directory itself tells.
struct CheckpointRow {
  CheckpointStatus status;
  uint64_t bytes_on_disk = 0;
  std::string written;  // the directory's mtime, UTC; empty when it cannot be read
  bool latest = false;
};

std::string written_time(const fs::path& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) return {};
  return fmt::format("{:%Y-%m-%dT%H:%M:%SZ}", fmt::gmtime(st.st_mtime));
}

// What `latest` names when it can be followed; empty otherwise (its problem is reported apart).
fs::path followable(const LatestStatus& latest) {
  return latest.ok() ? latest.dir : fs::path();
}

// "checkpoints/latest: FAILED: names step-000099, which does not exist", for the tables.
std::string latest_line(const LatestStatus& latest) {
  return fmt::format("checkpoints/latest: FAILED: {}", latest.problem);
}

CheckpointRow inspect(const fs::path& dir, const fs::path& latest, const CheckpointFilter& unusable,
                      const ReadProgress& progress = {}) {
  CheckpointRow row;
  row.status = verify_checkpoint(dir, progress);
  if (unusable && row.status.position) row.status.unusable = unusable(*row.status.position);
  row.bytes_on_disk = size_on_disk(dir);
  row.written = written_time(dir);
  row.latest = dir == latest;
  return row;
}

std::string name_of(const CheckpointRow& row) {
  return row.status.dir.filename().string();
}

json or_null(const std::string& text) {
  return text.empty() ? json(nullptr) : json(text);
}

json blob_json(const BlobStatus& blob) {
  return {{"name", blob.name},
          {"file", blob.file},
          {"bytes", blob.bytes},
          {"checksum", blob.checksum},
          {"actual_bytes", blob.actual_bytes ? json(*blob.actual_bytes) : json(nullptr)},
          {"actual_checksum", or_null(blob.actual_checksum)},
          {"ok", blob.ok()},
          {"unreadable", blob.denied},
          {"problem", or_null(blob.problem)}};
}

// Every reason meta.json fails, as its error lines say: damaged (its checksum, a field), and
// written by another recipe (the run cannot use it). Empty when it is fine.
std::string meta_problems(const CheckpointStatus& status) {
  if (!status.meta_problem.empty() && !status.unusable.empty())
    return status.meta_problem + "; " + status.unusable;
  return status.meta_problem.empty() ? status.unusable : status.meta_problem;
}

// meta.json's own checksum: "checked" is false for older checkpoints that record none. Not ok,
// as the table's line is not, for either reason meta_problems gives.
json meta_json(const CheckpointStatus& status) {
  const std::string problem = meta_problems(status);
  return {{"file", "meta.json"},
          {"checksum", or_null(status.meta_checksum)},
          {"actual_checksum", or_null(status.meta_actual_checksum)},
          {"checked", status.meta_checked()},
          {"ok", problem.empty()},
          {"problem", or_null(problem)}};
}

// The epoch and world size meta.json records, unless meta.json failed its own checksum (edited
// or damaged): then its fields are not shown, as for one that cannot be read.
const std::optional<TrainingPosition>& shown_position(const CheckpointStatus& status) {
  static const std::optional<TrainingPosition> none;
  return status.meta_problem.empty() ? status.position : none;
}

json row_json(const CheckpointRow& row) {
  const auto& position = shown_position(row.status);
  json blobs = json::array();
  for (const auto& blob : row.status.blobs)
    blobs.push_back(blob_json(blob));
  return {{"name", name_of(row)},
          {"path", row.status.dir.string()},
          {"step", row.status.step},
          {"epoch", position ? json(position->epoch) : json(nullptr)},
          {"world_size", position ? json(position->world_size) : json(nullptr)},
          {"bytes_on_disk", row.bytes_on_disk},
          {"written", or_null(row.written)},
          {"latest", row.latest},
          {"set_aside", row.status.set_aside},
          {"ok", row.status.ok()},
          {"unreadable", row.status.denied()},
          {"problems", row.status.problems()},
          {"meta", meta_json(row.status)},
          {"blobs", blobs}};
}

// "FAILED", or "UNREADABLE" when only a permission stops its reads (it may be intact).
const char* failed(const CheckpointStatus& status) {
  return status.denied() ? "UNREADABLE" : "FAILED";
}

std::string verdict(const CheckpointRow& row) {
  if (row.status.ok()) return row.status.meta_checked() ? "ok" : "ok (meta.json not checked)";
  return fmt::format("{}: {}", failed(row.status), fmt::join(row.status.problems(), "; "));
}

size_t name_width(const std::vector<CheckpointRow>& rows) {
  size_t width = std::string_view("CHECKPOINT").size();
  for (const auto& row : rows)
    width = std::max(width, name_of(row).size());
  return width;
}

void print_list_table(const fs::path& run_dir, const std::vector<CheckpointRow>& rows,
                      const LatestStatus& latest, const std::string& elsewhere) {
  if (rows.empty()) {
    std::printf("%s: no checkpoints%s\n", run_dir.c_str(), elsewhere.c_str());
    if (!latest.ok()) std::printf("%s\n", latest_line(latest).c_str());
    return;
  }
  const size_t w = name_width(rows);
  std::printf(
      "%s", fmt::format("{:<{}}  {:>8}  {:>6}  {:>5}  {:>10}  {:<20}  {:<6}  {}\n", "CHECKPOINT", w,
                        "STEP", "EPOCH", "WORLD", "SIZE", "WRITTEN", "LATEST", "VERIFIED")
                .c_str());
  for (const auto& row : rows) {
    const auto& position = shown_position(row.status);
    std::printf(
        "%s", fmt::format("{:<{}}  {:>8}  {:>6}  {:>5}  {:>10}  {:<20}  {:<6}  {}\n", name_of(row),
                          w, row.status.step, position ? fmt::format("{}", position->epoch) : "-",
                          position ? fmt::format("{}", position->world_size) : "-",
                          human_size(row.bytes_on_disk), row.written.empty() ? "-" : row.written,
                          row.latest ? "yes" : "", verdict(row))
                  .c_str());
  }
  if (!latest.ok()) std::printf("%s\n", latest_line(latest).c_str());
}

// meta.json's line: its own checksum, and whether its content matches it; every reason it
// fails (meta_problems).
std::string meta_verdict(const CheckpointStatus& status) {
  if (std::string problem = meta_problems(status); !problem.empty()) return problem;
  if (!status.meta_checked()) {
    return "not checked: it records no checksum of itself (written by an older dptrain)";
  }
  return "ok";
}

// Per file: the size and checksum meta.json records for it, and whether the file matches them.
void print_verify_table(const std::vector<CheckpointRow>& rows, const LatestStatus* latest) {
  for (const auto& row : rows) {
    std::printf("%s%s: %s\n", name_of(row).c_str(), row.latest ? " (latest)" : "",
                row.status.ok() ? "ok" : failed(row.status));
    std::printf("%s", fmt::format("  {:<14}  {:>12}  {:<16}  {}\n", "meta.json", "-",
                                  row.status.meta_checksum.empty() ? "-" : row.status.meta_checksum,
                                  meta_verdict(row.status))
                          .c_str());
    for (const auto& blob : row.status.blobs) {
      std::printf("%s", fmt::format("  {:<14}  {:>12}  {:<16}  {}\n", blob.file,
                                    fmt::format("{} B", blob.bytes), blob.checksum,
                                    blob.ok() ? "ok" : blob.problem)
                            .c_str());
    }
  }
  if (latest && !latest->ok()) std::printf("%s\n", latest_line(*latest).c_str());
  if (latest && !latest->exists && !rows.empty()) std::printf("checkpoints/latest: missing\n");
}

json latest_json(const LatestStatus& latest) {
  return latest.name.empty() ? json(nullptr) : json(latest.name);
}

// The run directory RUN_DIR names: one that 'dptrain launch' made (run.json), or a node's copy of
// one on another host (WORKDIR/runs/NAME-ID), which holds checkpoints/ only. Nothing is created.
struct CheckedRun {
  fs::path path;
  // Where run.json says rank 0 committed the newest checkpoint when that was another host:
  // " (its newest checkpoint, PATH, is on HOST, where rank 0 ran)"; empty otherwise.
  std::string elsewhere;
  // Checkpoints the run's recipe did not write, as resume skips them (written_by); none when
  // the run has no recipe to read (then only the files are checked).
  CheckpointFilter unusable;
  // What was passed over to read it (a torn run.json, a recipe that cannot be read): printed on
  // stderr as open_run finds them, and in --json's warnings.
  std::vector<std::string> warnings;
  fs::path checkpoints() const { return path / "checkpoints"; }
};

// The recipe whose hash the run's ranks wrote into their checkpoints: run.json's copy (the one
// resume reads), else recipe.json. Its data is not read: a dataset moved since, or a hung mount,
// must not keep the checkpoints from being checked. None where the run holds no recipe (a node's
// copy of a run, which holds checkpoints/ only, `recorded` false); one that cannot be read, or a
// run.json (torn, `info` null, or whole) with no recipe to be found, is warned about in
// `warnings`.
CheckpointFilter recipe_filter(const fs::path& run, const json& info, bool recorded,
                               std::vector<std::string>& warnings) {
  try {
    if (info.contains("recipe")) {
      return written_by(parse_recorded_recipe(info, run, DataCheck::none));
    }
    std::error_code ec;
    const fs::path copy = run / "recipe.json";
    if (!fs::exists(fs::symlink_status(copy, ec))) {
      // A benchmark's run has no recipe to check against.
      if (!recorded || info.contains("benchmark") || info.contains("bench")) return {};
      throw Error(
          ErrorKind::recipe,
          info.is_null()
              ? fmt::format("run.json cannot be read, and there is no {}", printable(copy.string()))
              : fmt::format("neither {} nor {} holds one", printable((run / "run.json").string()),
                            printable(copy.string())));
    }
    if (!fs::is_regular_file(copy, ec)) {
      throw Error(ErrorKind::recipe,
                  fmt::format("{}: not a regular file", printable(copy.string())));
    }
    return written_by(load_recipe(copy, DataCheck::none));
  } catch (const Error& e) {
    warnings.push_back(
        fmt::format("the run's recipe cannot be read ({}): its checkpoints are checked as files, "
                    "not for which recipe wrote them",
                    printable(first_line(e.what()))));
    return {};
  }
}

// run.json's record of a checkpoint rank 0 committed on another host.
std::string recorded_elsewhere(const json& info) {
  const auto remote = remote_last_checkpoint(info);
  if (!remote) return {};
  return fmt::format(" (its newest checkpoint, {}, is on {}, where rank 0 ran: check it there)",
                     remote->path, remote->host);
}

// The run's warnings on stderr, before anything else is done with it (whatever fails later).
CheckedRun said(CheckedRun run) {
  for (const auto& warning : run.warnings)
    std::fprintf(stderr, "dptrain: warning: %s\n", warning.c_str());
  return run;
}

// Reads the run, changing nothing in it (not even a missing checkpoints/ is made).
CheckedRun open_run(const std::string& dir) {
  std::error_code ec;
  const fs::path p(dir);
  const fs::path absolute = resolved_path(p);
  const bool has_checkpoints = fs::is_directory(p / "checkpoints", ec);
  if (!has_checkpoints && fs::exists(fs::symlink_status(p / "checkpoints", ec))) {
    throw Error(ErrorKind::checkpoint,
                fmt::format("{}: not a directory", printable((absolute / "checkpoints").string())));
  }
  CheckedRun run{absolute, "", {}, {}};
  if (!fs::exists(p / "run.json", ec) && has_checkpoints) {
    run.unusable = recipe_filter(absolute, json::object(), false, run.warnings);
    return said(std::move(run));
  }
  json info;
  try {
    info = read_run_json(p);
  } catch (const Error& e) {
    // Only checkpoints/ is read: a run.json torn by a crash does not keep them from being checked.
    if (!has_checkpoints || e.kind() != ErrorKind::usage) throw;
    run.warnings.push_back(
        fmt::format("{}; checking its checkpoints/ all the same", first_line(e.what())));
    run.unusable = recipe_filter(absolute, json(), true, run.warnings);
    return said(std::move(run));
  }
  run.elsewhere = recorded_elsewhere(info);
  run.unusable = recipe_filter(absolute, info, true, run.warnings);
  // Checkpoints run.json records committed here, gone (moved, a filesystem not mounted): not
  // "no checkpoints" alone.
  if (std::string missing = missing_recorded_checkpoints(run.checkpoints(), info); !missing.empty())
    run.warnings.push_back(printable(missing));
  return said(std::move(run));
}

// Each of `dirs` of the run verified, in order; when `stop` says so (a SIGINT or SIGTERM came),
// the rest are left out.
std::vector<CheckpointRow> inspect_all(const CheckedRun& run, const std::vector<fs::path>& dirs,
                                       const fs::path& latest,
                                       const std::function<bool()>& stop = {}) {
  std::vector<CheckpointRow> rows;
  // Checksumming a large model's checkpoints takes a while: where it is, on stderr. A stop ends
  // it at once, also inside a checkpoint (tens of GB), which is then left out of what is
  // reported (not verified, not damaged).
  struct Stopped {};
  WorkStatus status(stderr, StatusPrinter::is_terminal(stderr));
  for (size_t i = 0; i < dirs.size(); ++i) {
    if (stop && stop()) break;
    const fs::path& dir = dirs[i];
    const std::string what = fmt::format("verifying {} ({} of {})",
                                         printable(dir.filename().string()), i + 1, dirs.size());
    try {
      CheckpointRow row = inspect(dir, latest, run.unusable, [&](uint64_t done, uint64_t total) {
        if (stop && stop()) throw Stopped{};
        status.show(what, done, std::max(done, total));  // a blob that grew as it was read
      });
      if (!row.status.gone) rows.push_back(std::move(row));  // pruned by the run meanwhile
    } catch (const Stopped&) {
      break;
    }
  }
  status.erase();
  return rows;
}

int run_list(const CkptOptions& o, Outcome& outcome) {
  // A stop ends the listing at once (inside a checkpoint too), as a stop (130 or 143, with its
  // JSON).
  install_stop_signal_handlers();
  const CheckedRun run = open_run(o.run_dir);
  outcome.warnings = run.warnings;
  const LatestStatus latest = check_latest(run.checkpoints());
  const auto rows = inspect_all(run, list_checkpoints(run.checkpoints(), SetAside::include),
                                followable(latest), [] { return pending_stop_signal() != 0; });
  throw_if_stopped(" while ckpt list read the checkpoints");
  // Not checkpoints, but room on the disk: a write or prune cut short (or one going on now).
  json incomplete = json::array();
  for (const auto& dir : incomplete_checkpoints(run.checkpoints()))
    incomplete.push_back({{"name", dir.filename().string()}, {"bytes", size_on_disk(dir)}});
  if (!o.json) {
    print_list_table(run.path, rows, latest, run.elsewhere);
    for (const auto& i : incomplete) {
      std::printf(
          "incomplete: %s (%s): a checkpoint write or prune cut short, or one going on "
          "now; the next resume or restart removes it\n",
          printable(i["name"].get<std::string>()).c_str(),
          human_size(i["bytes"].get<uint64_t>()).c_str());
    }
    return 0;
  }
  json out = {{"run_dir", run.path.string()},
              {"latest", latest_json(latest)},
              {"latest_problem", or_null(latest.problem)},
              {"checkpoints", json::array()},
              {"incomplete", incomplete},
              {"warnings", run.warnings}};
  for (const auto& row : rows)
    out["checkpoints"].push_back(row_json(row));
  add_success(out);
  std::printf("%s\n", json_text(out).c_str());
  return 0;
}

// Empty when there is none (a failed verification, reported with the others' results).
std::vector<fs::path> checkpoints_to_verify(const CheckedRun& run, const CkptOptions& o,
                                            const fs::path& latest) {
  if (!o.step.empty()) return {checkpoint_named(run.checkpoints(), o.step)};
  // Set-aside checkpoints are known to be damaged and never used again: --all leaves them out.
  // By default the newest that is the run's recipe's (resume skips another's), which a resume
  // continues from: normally the one `latest` names, which can lag behind it (a rank stopped
  // between a checkpoint's commit and `latest`'s update). The one `latest` names is verified as
  // well: one another recipe wrote (copied in) fails, as `latest` is part of what is checked.
  const auto live = list_checkpoints(run.checkpoints());
  if (live.empty() || o.all) return live;
  fs::path chosen = live.front();
  for (const auto& dir : live) {
    const auto position = run.unusable ? checkpoint_position(dir) : std::nullopt;
    if (!position || run.unusable(*position).empty()) {
      chosen = dir;
      break;
    }
  }
  std::vector<fs::path> dirs;
  for (const auto& dir : live) {
    if (dir == chosen || (!latest.empty() && dir.filename() == latest.filename()))
      dirs.push_back(dir);
  }
  return dirs;
}

int run_verify(const CkptOptions& o, Outcome& outcome) {
  // A stop signal ends the verification at once (inside a checkpoint too, which is left out), and
  // the checkpoints checked by then are still reported.
  install_stop_signal_handlers();
  const CheckedRun run = open_run(o.run_dir);
  outcome.warnings = run.warnings;
  const LatestStatus latest = check_latest(run.checkpoints());
  const auto dirs = checkpoints_to_verify(run, o, followable(latest));
  const auto rows =
      inspect_all(run, dirs, followable(latest), [] { return pending_stop_signal() != 0; });
  // `latest` is part of what is verified unless a STEP names the checkpoint to check.
  const bool check_latest_too = o.step.empty();
  std::vector<std::string> errors;
  if (dirs.empty()) {
    errors.push_back(fmt::format("{}: no checkpoints to verify{}",
                                 printable(run.checkpoints().string()), run.elsewhere));
  }
  for (const auto& row : rows) {
    for (const auto& problem : row.status.problems())
      errors.push_back(fmt::format("{}/{}", printable(row.status.dir.string()), problem));
  }
  if (check_latest_too && !latest.ok()) {
    errors.push_back(
        fmt::format("{}: {}", printable((run.checkpoints() / "latest").string()), latest.problem));
  }
  int code = errors.empty() ? 0 : exit_code(ErrorKind::checkpoint);
  const char* status = errors.empty() ? "ok" : "error";
  // No `latest` beside checkpoints is not damage (a rank stopped between a checkpoint's commit
  // and `latest`'s first write, or it was removed by hand): resume takes the newest valid one.
  // Said, so that a check before copying the run does not pass over it in silence.
  std::vector<std::string> warnings = run.warnings;
  std::string missing_latest;
  if (check_latest_too && !latest.exists && !dirs.empty()) {
    missing_latest =
        fmt::format("{}: missing; resume continues from the newest checkpoint that verifies",
                    printable((run.checkpoints() / "latest").string()));
    warnings.push_back(missing_latest);
  }
  if (const int sig = pending_stop_signal(); sig != 0) {
    const bool term = sig == SIGTERM;
    code = exit_code(term ? ErrorKind::terminated : ErrorKind::interrupted);
    status = term ? "terminated" : "interrupted";
    errors.insert(errors.begin(), fmt::format("ckpt verify stopped by {} after {} checkpoint(s)",
                                              term ? "SIGTERM" : "SIGINT", rows.size()));
  }
  if (o.json) {
    // One shape whatever was named: `latest` as it stands; with a STEP it is not part of "ok"
    // ("latest_checked" false), as the table then leaves its line out.
    json out = {{"run_dir", run.path.string()},
                {"ok", code == 0},
                {"latest", latest_json(latest)},
                {"latest_problem", or_null(latest.problem)},
                {"latest_checked", check_latest_too}};
    out["warnings"] = warnings;
    out["checkpoints"] = json::array();
    for (const auto& row : rows)
      out["checkpoints"].push_back(row_json(row));
    out["status"] = status;
    if (code == 0) {
      add_success(out);
    } else {
      add_failure(out, code, errors);
    }
    std::printf("%s\n", json_text(out).c_str());
  } else {
    print_verify_table(rows, check_latest_too ? &latest : nullptr);
  }
  std::fflush(stdout);
  if (!missing_latest.empty()) {
    std::fprintf(stderr, "dptrain: warning: %s\n", missing_latest.c_str());
  }
  for (const auto& line : errors)
    std::fprintf(stderr, "dptrain: error: %s\n", line.c_str());
  return code;
}

}  // namespace

void setup_ckpt(CLI::App& app, Outcome& outcome) {
  app.require_subcommand(1);
  auto o = std::make_shared<CkptOptions>();

  CLI::App* list = app.add_subcommand(
      "list", "Every checkpoint, newest first: step, epoch, world size, size, time, verified");
  list->add_option("run_dir", o->run_dir, "Run directory made by 'dptrain launch'")
      ->required()
      ->check(run_directory());
  list->add_flag("--json", o->json, "Print one JSON object on stdout");
  list->callback([o, &outcome] {
    outcome.json = o->json;
    outcome.exit_code = run_list(*o, outcome);
  });

  CLI::App* verify = app.add_subcommand(
      "verify", "Check every blob's size and checksum; exit 5 naming any that fails");
  verify->add_option("run_dir", o->run_dir, "Run directory made by 'dptrain launch'")
      ->required()
      ->check(run_directory());
  CLI::Option* step = verify->add_option(
      "step", o->step,
      "Step number, directory name, or \"latest\" (default: the newest of the run's recipe, "
      "which a resume continues from)");
  verify->add_flag("--all", o->all, "Verify every checkpoint (not those set aside as .corrupt)")
      ->excludes(step);
  verify->add_flag("--json", o->json, "Print one JSON object on stdout");
  verify->callback([o, &outcome] {
    outcome.json = o->json;
    outcome.exit_code = run_verify(*o, outcome);
  });
}

}  // namespace dptrain::cli
