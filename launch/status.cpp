// The one status printer: a rewritten progress line on a terminal, plain lines in a pipe.
#include "launch/status.hpp"

#include <locale.h>
#include <sys/ioctl.h>
#include <unistd.h>
#include <wchar.h>

#include <cmath>
#include <cstdlib>
#include <string_view>

#include <fmt/format.h>

#include "core/comm/communicator.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"

namespace dptrain {

std::string loss_text(double loss) {
  if (std::isnan(loss)) return "nan";
  const double size = std::fabs(loss);
  return loss != 0 && (size < 1e-3 || size >= 1e6) ? fmt::format("{:.4g}", loss)
                                                   : fmt::format("{:.4f}", loss);
}

std::string format_losses(const nlohmann::json& result) {
  // null: no step ran, no held-out data, or not finite.
  const auto shown = [&result](const char* key) {
    return result.contains(key) && !result[key].is_null();
  };
  const std::string final_loss =
      shown("final_loss") ? loss_text(json_number(result, "final_loss")) : "none";
  const std::string eval = shown("eval_loss")
                               ? fmt::format("eval loss {}  eval accuracy {:.2f}%",
                                             loss_text(json_number(result, "eval_loss")),
                                             100.0 * json_number(result, "eval_accuracy"))
                               : "eval none (no held-out data)";
  return fmt::format("final loss {}  {}", final_loss, eval);
}

namespace {

// The columns a terminal gives the UTF-8 character at text[i] (its first byte): 2 for the wide
// ones (CJK, fullwidth forms, most emoji), 0 for combining marks, else 1; wcwidth's, in C.UTF-8,
// whatever this process's locale. `bytes` gets its length in bytes.
int columns_at(const std::string& text, size_t i, size_t& bytes) {
  const auto byte = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char lead = byte(i);
  bytes = lead < 0x80 ? 1 : lead >> 5 == 0x6 ? 2 : lead >> 4 == 0xE ? 3 : lead >> 3 == 0x1E ? 4 : 1;
  if (bytes == 1 || i + bytes > text.size()) {
    bytes = 1;
    return 1;
  }
  char32_t c = lead & (0x7F >> bytes);
  for (size_t k = 1; k < bytes; ++k) {
    if ((byte(i + k) & 0xC0) != 0x80) {  // not UTF-8: one column a byte, as it is shown
      bytes = 1;
      return 1;
    }
    c = (c << 6) | (byte(i + k) & 0x3F);
  }
  static const locale_t utf8 = ::newlocale(LC_CTYPE_MASK, "C.UTF-8", nullptr);
  if (utf8 == nullptr) return 1;
  const locale_t before = ::uselocale(utf8);
  const int width = ::wcwidth(static_cast<wchar_t>(c));
  ::uselocale(before);
  return width < 0 ? 1 : width;
}

// How many of text's leading bytes fit in `room` columns on a terminal (whole characters only).
size_t bytes_within(const std::string& text, size_t room) {
  size_t used = 0;
  for (size_t i = 0; i < text.size();) {
    size_t bytes = 1;
    const auto width = static_cast<size_t>(columns_at(text, i, bytes));
    if (used + width > room) return i;
    used += width;
    i += bytes;
  }
  return text.size();
}

// Whether `text` takes more than `room` columns on a terminal.
bool wider_than(const std::string& text, size_t room) {
  return bytes_within(text, room) < text.size();
}

// "eta H:MM:SS" from an event's eta_s, or "" where it has none.
std::string eta_text(const nlohmann::json& e) {
  const double eta_s = json_number(e, "eta_s");
  if (!std::isfinite(eta_s) || eta_s < 0) return "";
  const auto secs = static_cast<int64_t>(eta_s + 0.5);
  return fmt::format("eta {}:{:02d}:{:02d}", secs / 3600, secs / 60 % 60, secs % 60);
}

}  // namespace

std::string format_progress(const nlohmann::json& e, int columns) {
  const auto num = [&e](const char* key) { return json_number(e, key); };
  // Each field, and the order a narrow terminal gives them up in (the highest first): the step
  // and the loss stay; the time left and the throughput go last.
  std::vector<std::pair<std::string, int>> fields = {
      {fmt::format("step {}/{}", e.value("step", int64_t{0}), e.value("steps", int64_t{0})), 0},
      {"loss " + loss_text(num("loss")), 0},
      {fmt::format("lr {:.3g}", num("lr")), 4},
      {fmt::format("grad_norm {:.3g}", num("grad_norm")), 3},
      {e.contains("tokens_per_s") ? fmt::format("{:.0f} tokens/s", num("tokens_per_s"))
                                  : fmt::format("{:.0f} samples/s", num("samples_per_s")),
       2},
      {fmt::format("step {:.2f} ms", num("step_ms")), 5},
      {fmt::format("comm {:.2f} ms", num("comm_ms")), 6}};
  if (auto eta = eta_text(e); !eta.empty()) fields.emplace_back(std::move(eta), 1);
  const auto joined = [&fields](int up_to) {
    std::string text;
    for (const auto& [field, drop] : fields) {
      if (drop > up_to) continue;
      if (!text.empty()) text += "  ";
      text += field;
    }
    return text;
  };
  int up_to = 6;
  while (up_to > 0 && columns > 0 && wider_than(joined(up_to), static_cast<size_t>(columns - 1)))
    --up_to;
  return joined(up_to);
}

bool terminal_only(const nlohmann::json& event) {
  return event.is_object() && event.value("event", "") == "tick";
}

std::string format_tick(const nlohmann::json& tick, const nlohmann::json& last_progress) {
  std::string text =
      fmt::format("step {}/{}", tick.value("step", int64_t{0}), tick.value("steps", int64_t{0}));
  if (last_progress.is_object()) {
    text += fmt::format("  loss {} (step {})", loss_text(json_number(last_progress, "loss")),
                        last_progress.value("step", int64_t{0}));
  }
  if (const auto eta = eta_text(tick); !eta.empty()) text += "  " + eta;
  return text;
}

std::string format_event(const nlohmann::json& e) {
  const std::string kind = e.value("event", "");
  // A number, or NaN (printed "nan") for a null: a diverged loss or norm is written as one.
  const auto num = [&e](const char* key) { return json_number(e, key); };
  if (kind == "progress") return format_progress(e, 0);
  if (kind == "tick") return format_tick(e, nlohmann::json());
  if (kind == "eval") {
    return fmt::format("eval at step {}: loss {}  accuracy {:.2f}%", e.value("step", int64_t{0}),
                       loss_text(num("eval_loss")), 100.0 * num("eval_accuracy"));
  }
  if (kind == "rendezvous") {
    return fmt::format("all {} ranks met; starting at step {}", e.value("world_size", 0),
                       e.value("step", int64_t{0}));
  }
  if (kind == "result" && e.value("benchmark", std::string()) == "comm") {
    const size_t rows = e.contains("rows") && e["rows"].is_array() ? e["rows"].size() : 0;
    return fmt::format(
        "bench comm finished: {} row(s) on {} rank(s), average busbw {:.2f} GB/s, "
        "{} wrong element(s)",
        rows, e.value("ranks", 0), num("avg_busbw"), e.value("wrong", uint64_t{0}));
  }
  if (kind == "result") {
    return fmt::format("finished {} steps on {} rank(s): {}  parameters {}",
                       e.value("steps", int64_t{0}), e.value("world_size", int64_t{0}),
                       format_losses(e), e.value("params_checksum", std::string()));
  }
  if (kind == "checkpoint") {
    return fmt::format("checkpoint at step {}: {}", e.value("step", int64_t{0}),
                       e.value("path", std::string()));
  }
  return e.value("message", json_text(e));
}

bool StatusPrinter::is_terminal(std::FILE* f) {
  // TERM=dumb (an editor's shell): a terminal that cannot rewrite a line; plain lines there.
  const char* term = std::getenv("TERM");
  return ::isatty(::fileno(f)) == 1 && (term == nullptr || std::string_view(term) != "dumb");
}

void StatusPrinter::clear_progress() {
  if (progress_shown_) {
    std::fputs("\r\033[K", out_);
    progress_shown_ = false;
  }
}

void StatusPrinter::line(const std::string& text) {
  std::lock_guard lock(mutex_);
  clear_progress();
  std::fputs(text.c_str(), out_);
  std::fputc('\n', out_);
  std::fflush(out_);
}

void StatusPrinter::warning(const std::string& text) {
  // A printer to a file (a benchmark run's console.log) keeps the line there too; the terminal's
  // printer it mirrors to says it on stderr, its progress line cleared first.
  if (mirror_ != nullptr) mirror_->warning(mirror_prefix_ + text);
  std::lock_guard lock(mutex_);
  clear_progress();
  const bool to_file = out_ != stdout && out_ != stderr;
  if (to_file) std::fprintf(out_, "dptrain: warning: %s\n", text.c_str());
  std::fflush(out_);
  if (mirror_ == nullptr) {
    std::fprintf(stderr, "dptrain: warning: %s\n", text.c_str());
    std::fflush(stderr);
  }
  if (warnings_.size() < kKeptWarnings) warnings_.push_back(text);
}

bool StatusPrinter::warning_if_one(const std::string& line) {
  constexpr std::string_view kWarning = "warning: ";
  if (!line.starts_with(kWarning)) return false;
  warning(line.substr(kWarning.size()));
  return true;
}

std::vector<std::string> StatusPrinter::warnings() const {
  std::lock_guard lock(mutex_);
  return warnings_;
}

void StatusPrinter::event(const nlohmann::json& e) {
  const std::string kind = e.value("event", "");
  // A step between log steps: a terminal's progress line moves; nothing anywhere else.
  if (kind == "tick") {
    if (!tty_) return;
    nlohmann::json last;
    {
      std::lock_guard lock(mutex_);
      last = last_progress_;
    }
    progress(format_tick(e, last));
    return;
  }
  if (kind == "progress" || kind == "rendezvous") {
    // A new generation (a restart, bench train's next world size) starts without a loss.
    std::lock_guard lock(mutex_);
    last_progress_ = kind == "progress" ? e : nlohmann::json();
  }
  const std::string text = format_event(e);
  // A rank's warning (a checkpoint passed over, a batch that changes) is a warning here too: on
  // stderr, and among the ones --json reports, wherever the rank runs.
  if (kind == "info" && warning_if_one(text)) return;
  if (mirror_ != nullptr && (kind == "progress" || kind == "bench_progress")) {
    mirror_->progress(mirror_prefix_ + text);
  }
  // A benchmark's step by step progress: a terminal's only (in a pipe, other lines say what runs).
  if (kind == "bench_progress") {
    progress(text);
    return;
  }
  if (!tty_ || kind != "progress") {
    line(text);
    return;
  }
  // A narrow terminal gets the fields that matter most, not the line's start.
  progress(format_progress(e, terminal_columns()));
}

void WorkStatus::show(const std::string& what, uint64_t done, uint64_t total,
                      std::string_view unit) {
  const auto now = std::chrono::steady_clock::now();
  if (what != shown_) {
    shown_ = what;
    last_ = tty_ ? now - std::chrono::hours(1) : now - std::chrono::seconds(5);
  }
  if (now - last_ < (tty_ ? std::chrono::milliseconds(100) : std::chrono::seconds(10))) return;
  last_ = now;
  const auto amount = [unit](uint64_t n) {
    return unit.empty() ? human_size(n) : fmt::format("{}", n);
  };
  const std::string text = fmt::format("{}: {} of {}{}{}", what, amount(done), amount(total),
                                       unit.empty() ? "" : " " + std::string(unit),
                                       total > 0 ? fmt::format(" ({}%)", done * 100 / total) : "");
  if (tty_) {
    printer_.progress(text);
  } else {
    printer_.line(text);
  }
}

bool RepeatedRankLines::show(const std::string& line) {
  const int kind = line.starts_with("received SIGTERM:")           ? 0
                   : line.find(kPeerGoneNote) != std::string::npos ? 1
                                                                   : -1;
  return kind < 0 || ++seen_[kind] <= kShown;
}

std::vector<std::string> RepeatedRankLines::summary() const {
  std::vector<std::string> lines;
  const char* what[2] = {"received SIGTERM", "failed as a peer left"};
  for (int kind = 0; kind < 2; ++kind) {
    if (const int more = seen_[kind] - kShown; more > 0) {
      lines.push_back(fmt::format("{} more rank{} {} (each rank's log has its line)", more,
                                  more == 1 ? "" : "s", what[kind]));
    }
  }
  return lines;
}

std::string fit_columns(const std::string& text, int columns) {
  if (columns <= 0) return text;
  return text.substr(0, bytes_within(text, static_cast<size_t>(columns - 1)));
}

void StatusPrinter::progress(const std::string& text) {
  if (!tty_) return;
  std::lock_guard lock(mutex_);
  // A line wider than the terminal would wrap, and "\r\033[K" clears only its last row: each
  // update would leave a row behind. It is cut to the terminal's width (as it is now: resized
  // terminals too), short of the last column.
  std::fputs("\r\033[K", out_);
  std::fputs(fit_columns(text, terminal_columns()).c_str(), out_);
  std::fflush(out_);
  progress_shown_ = true;
}

int StatusPrinter::terminal_columns() const {
  winsize size{};
  return ::ioctl(::fileno(out_), TIOCGWINSZ, &size) == 0 ? size.ws_col : 0;
}

void StatusPrinter::erase_progress() {
  std::lock_guard lock(mutex_);
  clear_progress();
  std::fflush(out_);
}

void StatusPrinter::finish() {
  std::lock_guard lock(mutex_);
  if (progress_shown_) {
    std::fputc('\n', out_);
    std::fflush(out_);
    progress_shown_ = false;
  }
}

}  // namespace dptrain
