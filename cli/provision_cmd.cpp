// `dptrain provision --hosts H`: facts and uploads per host, as a table or JSON; exit 4 naming each
// host that failed.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "cli/host_options.hpp"
#include "cli/json_errors.hpp"
#include "cli/run_report.hpp"
#include "core/error.hpp"
#include "core/json_error.hpp"
#include "launch/provision.hpp"
#include "launch/status.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

namespace {

struct ProvisionCliOptions {
  HostOptions hosts;
  std::string workdir = kDefaultWorkdir;
  std::string recipe;
  std::vector<std::string> uploads;
  bool json = false;
};

// The uploads as they go, on stderr: a line as each file starts, and on a terminal one progress
// line rewritten in place: the bytes sent so far and held already (a file a host has is counted
// as done) of the planned total, every file to every host, so that it only grows. Called from
// the hosts' threads.
class UploadProgress {
 public:
  UploadProgress() : printer_(stderr, StatusPrinter::is_terminal(stderr)) {}

  void planned(uint64_t bytes) {
    std::lock_guard lock(mutex_);
    planned_ = bytes;
  }

  void operator()(const std::string& host, const std::string& file, uint64_t sent, uint64_t size) {
    std::lock_guard lock(mutex_);
    if (sent == 0) {
      printer_.line(fmt::format("{}: uploading {} ({})", host, file, human_bytes(size)));
      uploading_ = true;
    }
    uint64_t& done = uploads_[host + "\n" + file];
    all_done_ = all_done_ - done + sent;
    done = sent;
    const auto now = std::chrono::steady_clock::now();
    if (now - shown_ < std::chrono::milliseconds(100) && sent != size) return;
    shown_ = now;
    // Files held already are nothing to show until an upload starts.
    if (!uploading_ || all_done_ == 0) return;
    const uint64_t all = std::max(planned_, all_done_);
    printer_.progress(fmt::format("uploading: {} of {} ({}%)", human_bytes(all_done_),
                                  human_bytes(all), all_done_ * 100 / all));
  }
  void finish() {
    std::lock_guard lock(mutex_);
    printer_.erase_progress();
  }

 private:
  std::mutex mutex_;
  StatusPrinter printer_;
  uint64_t planned_ = 0;
  bool uploading_ = false;
  std::map<std::string, uint64_t> uploads_;  // bytes sent (or held already) of each
  uint64_t all_done_ = 0;                    // their sum
  std::chrono::steady_clock::time_point shown_;
};

// "2x NVIDIA H200 (143771 MiB), driver 550.54" or "none (no nvidia-smi)".
std::string gpu_summary(const HostFacts& f) {
  if (f.gpus.empty()) return f.gpu_note.empty() ? "none" : "none (" + f.gpu_note + ")";
  std::vector<std::string> groups;
  for (size_t i = 0; i < f.gpus.size();) {
    size_t same = i;
    while (same < f.gpus.size() && f.gpus[same].name == f.gpus[i].name)
      ++same;
    groups.push_back(fmt::format("{}x {} ({})", same - i, f.gpus[i].name, f.gpus[i].memory));
    i = same;
  }
  return fmt::format("{}, driver {}", fmt::join(groups, " + "), f.driver_version);
}

std::string upload_summary(const std::vector<UploadRecord>& uploads) {
  int uploaded = 0, skipped = 0;
  uint64_t bytes = 0;
  for (const auto& u : uploads) {
    if (u.status == UploadRecord::Status::uploaded) ++uploaded, bytes += u.bytes;
    if (u.status == UploadRecord::Status::skipped) ++skipped;
  }
  return fmt::format("{} uploaded ({}), {} skipped", uploaded, human_bytes(bytes), skipped);
}

void print_table(const std::vector<HostReport>& reports) {
  std::vector<std::vector<std::string>> rows = {{"HOST", "STATUS", "HOSTNAME", "OS", "CPUS",
                                                 "MEMORY", "DISK FREE", "DPTRAIN", "UPLOADS",
                                                 "GPUS"}};
  for (const auto& r : reports) {
    const HostFacts& f = r.facts;
    const auto fact = [&](const std::string& value) { return r.facts_known ? value : "-"; };
    rows.push_back({r.host.display(),
                    r.ok()      ? "ok"
                    : r.stopped ? "STOPPED"
                                : "FAILED",
                    fact(f.hostname), fact(f.os), fact(std::to_string(f.cpus)),
                    fact(human_bytes(f.memory_bytes)), fact(human_bytes(f.disk_free_bytes)),
                    fact(f.dptrain_version.empty() ? "-" : f.dptrain_version),
                    fact(upload_summary(r.uploads)), fact(gpu_summary(f))});
  }
  std::vector<size_t> widths(rows.front().size(), 0);
  for (const auto& row : rows) {
    for (size_t c = 0; c < row.size(); ++c)
      widths[c] = std::max(widths[c], row[c].size());
  }
  for (const auto& row : rows) {
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      line += c + 1 < row.size() ? fmt::format("{:<{}}  ", row[c], widths[c]) : row[c];
    }
    std::printf("%s\n", line.c_str());
  }
}

int run_provision(const ProvisionCliOptions& o) {
  // A stop ends each host's work between steps and upload chunks; the report still comes, with
  // what each host got by then.
  install_stop_signal_handlers();
  exit_on_second_interrupt();  // what cannot be cut short (an upload's last write) by the first
  ProvisionOptions options;
  options.workdir = o.workdir;
  options.recipe = o.recipe;
  options.uploads.assign(o.uploads.begin(), o.uploads.end());
  options.ssh = o.hosts.ssh();
  // A connection being made, and a command waited for (the host's survey, its dptrain's
  // version), end at a stop. (Uploads look for it between their chunks.)
  options.ssh.check_stop = [] { throw_if_stopped(""); };
  UploadProgress progress;
  options.on_upload = [&progress](const std::string& host, const std::string& file, uint64_t sent,
                                  uint64_t size) { progress(host, file, sent, size); };
  options.on_planned = [&progress](uint64_t bytes) { progress.planned(bytes); };
  const auto reports = provision(o.hosts.load(), options);
  progress.finish();

  std::vector<std::string> errors;
  for (const auto& r : reports) {
    if (!r.ok()) errors.push_back(r.error);
  }
  int code = errors.empty() ? 0 : exit_code(ErrorKind::ssh);
  std::string status = code == 0 ? "ok" : "error";
  if (const int sig = pending_stop_signal()) {
    const Error stopped = stop_error(sig, "provision ", "");
    errors.insert(errors.begin(), stopped.what());
    code = exit_code(stopped.kind());
    status = failure_status(stopped.kind());
  }
  if (o.json) {
    nlohmann::json hosts = nlohmann::json::array();
    for (const auto& r : reports)
      hosts.push_back(to_json(r));
    nlohmann::json out = {{"ok", code == 0}, {"hosts", hosts}};
    if (code == 0) {
      add_success(out);
    } else {
      add_failure(out, code, errors);
      out["status"] = status;
    }
    std::printf("%s\n", json_text(out).c_str());
  } else {
    print_table(reports);
  }
  std::fflush(stdout);  // the report first, then the failures below it on a terminal
  for (const auto& line : errors)
    std::fprintf(stderr, "dptrain: error: %s\n", line.c_str());
  return code;
}

}  // namespace

void setup_provision(CLI::App& app, Outcome& outcome) {
  auto o = std::make_shared<ProvisionCliOptions>();
  add_host_options(app, o->hosts, /*hosts_required=*/true);
  app.add_option("--workdir", o->workdir,
                 "Work directory on every host (~/ is the home there); dptrain goes to "
                 "WORKDIR/bin/dptrain")
      ->capture_default_str()
      ->check(remote_path());
  app.add_option("--recipe", o->recipe,
                 "Recipe to upload into the workdir, with its csv data file (as data/NAME)");
  app.add_option("--upload", o->uploads, "Extra files to upload into the workdir (repeatable)");
  app.add_flag("--json", o->json,
               "Print {\"ok\", \"status\", \"exit_code\", \"hosts\": [{\"host\", \"ok\", "
               "\"error\", \"facts\", \"uploads\"}]} on stdout (and \"error\", \"errors\" on "
               "failure, see dptrain(1))");
  app.callback([o, &outcome] {
    outcome.json = o->json;
    outcome.exit_code = run_provision(*o);
  });
}

}  // namespace dptrain::cli
