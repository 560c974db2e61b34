// `dptrain report RUN_DIR` (the HTML report and a summary) and `dptrain status RUN_DIR`.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/json_errors.hpp"
#include "cli/run_report.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"
#include "launch/report.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

namespace fs = std::filesystem;

namespace {

struct ReportOptions {
  std::string run_dir;
  std::string out;  // RUN_DIR/report.html when --out is not given (main refuses an empty one)
  bool json = false;
};

struct StatusOptions {
  std::string run_dir;
  bool json = false;
};

// A run directory a `bench train` sweep made: its run.json says so ("bench").
bool bench_train_run(const fs::path& dir) {
  std::error_code ec;
  if (!fs::is_regular_file(dir / "run.json", ec)) return false;  // never a pipe's open
  try {
    const nlohmann::json info = parse_json(read_file(dir / "run.json"), false);
    return info.is_object() && info.value("bench", nlohmann::json()).is_object() &&
           info["bench"].value("benchmark", nlohmann::json()) == "train";
  } catch (const Error&) {
    return false;  // unreadable: not known to be one
  }
}

// Whether `dir` is a `bench train` sweep's directory: its bench.json is the sweep's result, which
// names the sweep's directory as its run_dir (a copy of `bench train --json` kept elsewhere names
// another); before it has one (still running, or stopped in its first run), it holds no run.json
// and a run the sweep made.
bool bench_sweep_dir(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir / "bench.json", ec)) {
    if (ec || fs::exists(dir / "run.json", ec) || ec) return false;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      // Its runs are named w<WORLD>[-PRECISION][-rK]: nothing else is read.
      const std::string name = entry.path().filename().string();
      if (name.size() >= 2 && name[0] == 'w' && name[1] >= '0' && name[1] <= '9' &&
          bench_train_run(entry.path()))
        return true;
    }
    return false;
  }
  if (!fs::is_regular_file(dir / "bench.json", ec)) return false;
  try {
    const nlohmann::json j = parse_json(read_file(dir / "bench.json"), false);
    if (!j.is_object() || j.value("benchmark", nlohmann::json()) != "train") return false;
    const nlohmann::json run_dir = j.value("run_dir", nlohmann::json());
    if (!run_dir.is_string()) return false;
    std::error_code here_ec;
    const fs::path named = fs::weakly_canonical(run_dir.get<std::string>(), ec);
    const fs::path here = fs::weakly_canonical(dir, here_ec);
    return !ec && !here_ec && named == here;
  } catch (const Error&) {
    return false;  // unreadable: not known to be one
  }
}

// The report replaces the file --out names (by rename): never one of the run's own files, nor a
// file in another run's directory or a benchmark sweep's, never what is not a plain file, and
// never a file that holds something else than an HTML page (check_output_file,
// check_replaceable): a recipe or a dataset named by a slip.
void check_report_out(const std::string& given, const fs::path& out, const fs::path& run_dir) {
  check_output_file("--out", given, "the HTML file");
  std::error_code ec;
  const fs::path parent = fs::weakly_canonical(out.parent_path(), ec);
  const fs::path run = fs::weakly_canonical(run_dir, ec);
  const fs::path inside = (parent / out.filename()).lexically_relative(run);
  if (!inside.empty() && *inside.begin() != ".." && inside != "report.html") {
    throw Error(ErrorKind::usage,
                fmt::format("--out {}: inside the run directory {}, whose files a report must not "
                            "replace; name a file elsewhere (without --out the report is {})",
                            given, run_dir.string(), (run_dir / "report.html").string()));
  }
  if (const auto other = run_dir_holding(out); other && *other != run) {
    throw Error(ErrorKind::usage,
                fmt::format("--out {}: inside the run directory {}, another run's, whose files a "
                            "report must not replace; name a file outside every run directory",
                            given, other->string()));
  }
  if (bench_sweep_dir(parent)) {
    throw Error(ErrorKind::usage,
                fmt::format("--out {}: inside the bench train sweep {}, whose files a report must "
                            "not replace; name a file elsewhere",
                            given, parent.string()));
  }
  check_replaceable("--out", given, kHtmlStart, "an HTML page");
}

// A stop signal ends a status or report that reads a long metrics.jsonl or verifies large
// checkpoints at the next line batch or checkpoint, as a stop (130 or 143, with its JSON); a
// report is then not written.
bool stop_pending() {
  return pending_stop_signal() != 0;
}

// load_run, where a bench train sweep's directory (its runs' parent) is refused naming its runs:
// status and report read one run each.
RunView load_run_not_sweep(const fs::path& dir, bool verify_checkpoints) {
  if (bench_sweep_dir(dir)) {
    std::vector<std::string> runs;
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      if (fs::is_regular_file(entry.path() / "run.json", ec))
        runs.push_back(entry.path().filename().string());
    }
    std::sort(runs.begin(), runs.end());
    std::string named;
    for (const auto& r : runs)
      named += (named.empty() ? "" : ", ") + printable(r);
    const fs::path results = dir / "bench.json";
    throw Error(ErrorKind::usage,
                fmt::format("{}: a bench train sweep, not a run directory: {}; give one of its "
                            "runs ({})",
                            printable(dir.string()),
                            fs::exists(results, ec)
                                ? "its results are in " + printable(results.string())
                                : "it has no bench.json yet (still running, or stopped in its "
                                  "first run)",
                            named.empty() ? "none is left" : named));
  }
  return load_run(dir, verify_checkpoints, stop_pending);
}

int run_report(const ReportOptions& o) {
  install_stop_signal_handlers();
  const bool given = !o.out.empty();
  const RunView run = load_run_not_sweep(o.run_dir, /*verify_checkpoints=*/true);
  throw_if_stopped(" before the report was written");
  const fs::path out = given ? fs::absolute(o.out) : run.dir / "report.html";
  std::error_code ec;
  // A bad --out is the caller's to fix; RUN_DIR/report.html in the way is a report that cannot
  // be written.
  if (!given && fs::is_directory(out, ec)) {
    throw Error(ErrorKind::internal,
                fmt::format("{}: is a directory, so the report cannot be written there; give "
                            "--out FILE",
                            out.string()));
  }
  // A symbolic link (or a pipe) there would be replaced, not written through, as --out refuses.
  if (const char* kind = given ? nullptr : non_regular_kind(fs::symlink_status(out, ec))) {
    throw Error(ErrorKind::usage,
                fmt::format("{}: is {}, not a regular file; the report would replace it, not "
                            "write through it: remove it, or give --out FILE",
                            out.string(), kind));
  }
  if (given) check_report_out(o.out, out, run.dir);
  write_file_atomic(out, report_html(run));
  nlohmann::json summary = report_summary(run, out);
  add_success(summary);
  if (o.json) {
    std::printf("%s\n", json_text(summary).c_str());
  } else {
    std::printf("%s", report_summary_text(summary).c_str());
  }
  return 0;
}

int run_status(const StatusOptions& o) {
  install_stop_signal_handlers();
  const RunView run = load_run_not_sweep(o.run_dir, /*verify_checkpoints=*/false);
  throw_if_stopped(" while status read the run");
  if (o.json) {
    nlohmann::json out = status_json(run);
    add_success(out);
    std::printf("%s\n", json_text(out).c_str());
  } else {
    std::printf("%s", status_text(run).c_str());
  }
  return 0;
}

}  // namespace

void setup_report(CLI::App& app, Outcome& outcome) {
  auto o = std::make_shared<ReportOptions>();
  app.add_option("run_dir", o->run_dir, "Run directory made by 'dptrain launch'")
      ->required()
      ->check(run_directory());
  app.add_option("--out", o->out, "Write the HTML here instead of RUN_DIR/report.html");
  app.add_flag("--json", o->json, "Print the summary as one JSON object on stdout");
  app.callback([o, &outcome] {
    outcome.json = o->json;
    outcome.exit_code = run_report(*o);
  });
}

void setup_status(CLI::App& app, Outcome& outcome) {
  auto o = std::make_shared<StatusOptions>();
  app.add_option("run_dir", o->run_dir, "Run directory made by 'dptrain launch'")
      ->required()
      ->check(run_directory());
  app.add_flag("--json", o->json, "Print one JSON object on stdout");
  app.callback([o, &outcome] {
    outcome.json = o->json;
    outcome.exit_code = run_status(*o);
  });
}

}  // namespace dptrain::cli
