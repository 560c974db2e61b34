// The one status printer: a rewritten progress line on a terminal, plain lines in a pipe.
#include "launch/status.hpp"

#include <sys/ioctl.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <string_view>

#include <fmt/format.h>

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

std::string format_event(const nlohmann::json& e) {
  const std::string kind = e.value("event", "");
  // A number, or NaN (printed "nan") for a null: a diverged loss or norm is written as one.
  const auto num = [&e](const char* key) { return json_number(e, key); };
  if (kind == "progress") {
    std::string eta;
    if (const double eta_s = num("eta_s"); std::isfinite(eta_s) && eta_s >= 0) {
      const auto secs = static_cast<int64_t>(eta_s + 0.5);
      eta = fmt::format("  eta {}:{:02d}:{:02d}", secs / 3600, secs / 60 % 60, secs % 60);
    }
    const std::string rate = e.contains("tokens_per_s")
                                 ? fmt::format("{:.0f} tokens/s", num("tokens_per_s"))
                                 : fmt::format("{:.0f} samples/s", num("samples_per_s"));
    return fmt::format(
        "step {}/{}  loss {}  lr {:.3g}  grad_norm {:.3g}  {}  step {:.2f} ms  comm {:.2f} "
        "ms{}",
        e.value("step", int64_t{0}), e.value("steps", int64_t{0}), loss_text(num("loss")),
        num("lr"), num("grad_norm"), rate, num("step_ms"), num("comm_ms"), eta);
  }
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
  const std::string text = format_event(e);
  const std::string kind = e.value("event", "");
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
  progress(text);
}

std::string fit_columns(const std::string& text, int columns) {
  if (columns <= 0) return text;
  const auto keep = static_cast<size_t>(columns - 1);
  size_t shown = 0;  // characters so far (UTF-8 continuation bytes are part of one)
  for (size_t i = 0; i < text.size(); ++i) {
    if ((static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) continue;
    if (shown++ == keep) return text.substr(0, i);
  }
  return text;
}

void StatusPrinter::progress(const std::string& text) {
  if (!tty_) return;
  std::lock_guard lock(mutex_);
  // A line wider than the terminal would wrap, and "\r\033[K" clears only its last row: each
  // update would leave a row behind. It is cut to the terminal's width (as it is now: resized
  // terminals too), short of the last column.
  winsize size{};
  const int columns = ::ioctl(::fileno(out_), TIOCGWINSZ, &size) == 0 ? size.ws_col : 0;
  std::fputs("\r\033[K", out_);
  std::fputs(fit_columns(text, columns).c_str(), out_);
  std::fflush(out_);
  progress_shown_ = true;
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
