// A run directory read back for `dptrain status` and `dptrain report`: where the run stands,
// its metrics and checkpoints, and the self-contained HTML report built from them.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace dptrain {

inline constexpr double kNoValue = std::numeric_limits<double>::quiet_NaN();

// One training line of metrics.jsonl; a value the line lacks is NaN.
struct StepMetrics {
  int64_t step = 0;
  int64_t epoch = 0;
  double loss = kNoValue, lr = kNoValue, grad_norm = kNoValue;
  double samples_per_s = kNoValue, tokens_per_s = kNoValue;
  double step_ms = kNoValue, data_ms = kNoValue, compute_ms = kNoValue, comm_ms = kNoValue,
         optimizer_ms = kNoValue;
};

// One evaluation line: {"step", "eval_loss", "eval_accuracy"}.
struct EvalMetrics {
  int64_t step = 0;
  double loss = kNoValue, accuracy = kNoValue;
};

struct RunMetrics {
  std::vector<StepMetrics> steps;  // ascending
  std::vector<EvalMetrics> evals;  // ascending
  int64_t skipped_lines = 0;       // not JSON objects with a step (a crash tears the last line)
  bool has_tokens() const;         // a token model: throughput in tokens/s
  bool has_phases() const;         // the step-time split is logged
};

// metrics.jsonl: torn or foreign lines are skipped and counted; a step logged again (a restart
// that rewound) replaces what was logged from that step on. No file: no metrics. Once `stopped`
// (looked at every few thousand lines) says so, the rest is left unread.
RunMetrics read_metrics(const std::filesystem::path& file,
                        const std::function<bool()>& stopped = {});

// Where a run stands, from run.json and, for one marked running, whether its ranks still live.
struct RunState {
  std::string status;           // running, restarting, resizing, completed, failed,
                                // interrupted, terminated, or stale (its launcher is gone)
  std::string recorded_status;  // as run.json says
  std::vector<int> live_pids;   // the newest generation's workers (or relays) still alive
  std::string note;             // why it is stale, restarting or resizing; empty otherwise
};

// Where the run in `dir` that `info` (its run.json) records stands now: for one marked running,
// whether its launcher or (workers started without one) its rank 0 lives.
RunState run_state(const nlohmann::json& info, const std::filesystem::path& dir);

// One checkpoint of the run, verified (every blob's size and checksum) or only listed.
struct CheckpointSummary {
  std::string name;
  int64_t step = -1;
  int64_t epoch = -1;       // -1 when meta.json cannot be read
  int64_t world_size = -1;  // -1 when meta.json cannot be read
  uint64_t bytes = 0;
  bool latest = false;
  bool set_aside = false;
  // Written by another recipe than the run's (copied in): resume skips it, as it does one set
  // aside; from its meta.json, whether or not verification ran.
  bool foreign = false;
  bool verified = false;              // verification ran
  std::vector<std::string> problems;  // empty: it verifies (when verified)
  // Only a permission stops its reads: out of reach, maybe intact (named as unreadable, not
  // counted as failed).
  bool denied = false;
};

struct RunView {
  std::filesystem::path dir;
  nlohmann::json info;    // run.json
  nlohmann::json result;  // result.json, else run.json's "result"; null when neither
  RunMetrics metrics;
  RunState state;
  std::vector<CheckpointSummary> checkpoints;  // newest first
  // checkpoints/ exists but could not be listed (a permission, not a directory): how many it
  // holds is unknown, not 0.
  bool checkpoints_unread = false;
  // What could not be read besides run.json (a permission, a pipe where a file should be): the
  // view shows the rest, and says what it left out.
  std::vector<std::string> unreadable;
};

// Reads RUN_DIR: Error(usage) naming it when it has no readable run.json (nothing is created
// or changed there); any other part it cannot read is left out and named in `unreadable`. `verify`:
// check every checkpoint's checksums (the report does; status only lists them). `stopped` (a
// stop signal came) is looked at between metrics lines and checkpoints: once it says so, the rest
// is left unread, for the caller to end with the stop.
RunView load_run(const std::filesystem::path& dir, bool verify_checkpoints,
                 const std::function<bool()>& stopped = {});

// `dptrain status --json`: status, step, last checkpoint, restarts, world size, generations,
// error, hint.
nlohmann::json status_json(const RunView& run);
// The same for people: a few aligned lines.
std::string status_text(const RunView& run);
// What to do next with a run that ended short of completing (its status's "hint": continue it
// with 'dptrain resume', or what to fix first); empty for one that needs nothing.
std::string status_hint(const RunView& run);

// The report: one HTML file with inline CSS and SVG, no script and nothing fetched.
std::string report_html(const RunView& run);
// How the report's HTML starts: a file that does not is not one to replace (report --out).
constexpr std::string_view kHtmlStart = "<!DOCTYPE html>";
// `dptrain report --json` (and the text summary's facts): status, steps, losses, throughput,
// restarts, world-size changes, checkpoints, and where the report was written.
nlohmann::json report_summary(const RunView& run, const std::filesystem::path& report_file);
std::string report_summary_text(const nlohmann::json& summary);

}  // namespace dptrain
