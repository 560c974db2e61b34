// The one status printer: a rewritten progress line on a terminal, plain lines in a pipe.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

namespace dptrain {

// A loss as progress lines, status and reports show it: 4 decimals ("1.9997"), or 4 significant
// digits for one below 0.001 or from a million up ("2.5e-05", "1.764e+32"); "nan" for NaN.
std::string loss_text(double loss);

// A progress event's line: "step 10/300  loss 2.4065  lr 0.0003  grad_norm 1.2  5120 tokens/s
// step 12.50 ms  comm 1.20 ms  eta 0:01:02". With `columns` (> 0, a terminal's width) the fields
// that matter least (comm, step ms, lr, grad_norm, then the rate and the eta) are left out until
// it fits; the step and the loss always stay.
std::string format_progress(const nlohmann::json& event, int columns);
// Whether a trainer event is for a terminal's progress line alone (kept from logs and pipes):
// {"event": "tick", "step", "steps", "eta_s"}, which rank 0 sends at most once a second between
// log steps.
bool terminal_only(const nlohmann::json& event);
// A tick's line: "step 17/300  loss 2.4065 (step 10)  eta 0:00:58", the loss of `last_progress`
// (the last progress event, or null: none yet).
std::string format_tick(const nlohmann::json& tick, const nlohmann::json& last_progress);
// One human-readable line for a trainer event ({"event": "progress"|"eval"|"checkpoint"|"info"}).
std::string format_event(const nlohmann::json& event);
// "final loss 1.2345  eval loss 1.3456  eval accuracy 61.25%" from a result, "none" for what it
// lacks (no step ran, no held-out data).
std::string format_losses(const nlohmann::json& result);

// `text` cut to fit a terminal `columns` wide, short of its last column (where the cursor would
// wrap to the next row); as it is for 0 (not known). Counts columns, not UTF-8 bytes: a wide
// character (CJK) takes two, a combining mark none.
std::string fit_columns(const std::string& text, int columns);

// Lines that every rank prints alike at a stop or a failure: "received SIGTERM: ..." and a
// collective that failed as a peer left (kPeerGoneNote). The first kShown of each kind reach the
// console; the rest are counted (each rank's log keeps its own), and summary() says how many were
// left out, so that 64 ranks do not make a wall of 64 near-identical lines.
class RepeatedRankLines {
 public:
  static constexpr int kShown = 4;
  // Whether a rank's line is shown: false for one of a kind already shown kShown times.
  bool show(const std::string& line);
  // "12 more ranks received SIGTERM (each rank's log has its line)", a line per kind left out.
  std::vector<std::string> summary() const;

 private:
  int seen_[2] = {0, 0};  // lines of each kind: received SIGTERM, failed as a peer left
};

class StatusPrinter {
 public:
  // `tty`: rewrite one progress line in place; otherwise every line is printed as it comes.
  StatusPrinter(std::FILE* out, bool tty) : out_(out), tty_(tty) {}
  ~StatusPrinter() { finish(); }
  StatusPrinter(const StatusPrinter&) = delete;
  StatusPrinter& operator=(const StatusPrinter&) = delete;

  static bool is_terminal(std::FILE* f);

  void line(const std::string& text);  // a permanent line
  // "dptrain: warning: TEXT" on stderr, as every warning: apart from the lines a script reads
  // on stdout (a pending progress line is cleared first). A printer to a file also writes it
  // there, and one that mirrors its progress to a terminal's printer has that one say it.
  void warning(const std::string& text);
  // A line a rank or a host's relay wrote as "warning: TEXT" is said as warning(TEXT): true;
  // false (nothing said) for any other line.
  bool warning_if_one(const std::string& line);
  // The warnings said so far (the first kKeptWarnings), for a --json outcome's "warnings".
  std::vector<std::string> warnings() const;
  static constexpr size_t kKeptWarnings = 100;
  void event(const nlohmann::json& event);  // progress rewrites in place on a terminal
  // A progress line for a long step: rewritten in place on a terminal, dropped in a pipe (where
  // the permanent lines say what was done).
  void progress(const std::string& text);
  void erase_progress();  // removes a pending progress line, e.g. before a summary on stdout
  // Progress events also go to `terminal`'s progress line, after `prefix`: a printer whose lines
  // go to a file (a benchmark run's console.log) still shows on a terminal how far it is.
  // `terminal` must outlive this printer.
  void mirror_progress(StatusPrinter* terminal, std::string prefix) {
    mirror_ = terminal;
    mirror_prefix_ = std::move(prefix);
  }
  void finish();  // ends a pending progress line

 private:
  void clear_progress();
  int terminal_columns() const;  // 0 where not known (not a terminal)

  std::FILE* out_;
  bool tty_;
  bool progress_shown_ = false;
  nlohmann::json last_progress_;  // the last progress event, for the ticks after it
  StatusPrinter* mirror_ = nullptr;
  std::string mirror_prefix_;
  std::vector<std::string> warnings_;
  mutable std::mutex mutex_;
};

// Long work's progress, "WHAT: DONE of TOTAL UNIT (N%)": on a terminal the progress line, at most
// ten times a second but at once when WHAT changes; in a pipe a plain line once WHAT has gone on
// for 5 s, and every 10 s after (short work prints nothing).
class WorkStatus {
 public:
  WorkStatus(std::FILE* out, bool tty) : printer_(out, tty), tty_(tty) {}

  // `unit` follows the numbers ("tokens"); none: they are bytes, shown as sizes ("1.5 MiB").
  void show(const std::string& what, uint64_t done, uint64_t total, std::string_view unit = {});
  void line(const std::string& text) { printer_.line(text); }
  void erase() { printer_.erase_progress(); }

 private:
  StatusPrinter printer_;
  bool tty_;
  std::string shown_;
  std::chrono::steady_clock::time_point last_;
};

}  // namespace dptrain
