// The one status printer: a rewritten progress line on a terminal, plain lines in a pipe.
#include "launch/status.hpp"

#include <unistd.h>

#include <cmath>

#include <fmt/format.h>

#include "core/json_error.hpp"

namespace dptrain {

std::string loss_text(double loss) {
  return loss != 0 && std::fabs(loss) < 1e-3 ? fmt::format("{:.4g}", loss)
                                             : fmt::format("{:.4f}", loss);
}

std::string format_losses(const nlohmann::json& result) {
  // null: no step ran, or no held-out data.
  const auto has = [&result](const char* key) {
    return result.contains(key) && result[key].is_number();
  };
  const std::string final_loss =
      has("final_loss") ? loss_text(result["final_loss"].get<double>()) : "none";
  const std::string eval = has("eval_loss")
                               ? fmt::format("eval loss {}  eval accuracy {:.2f}%",
                                             loss_text(result["eval_loss"].get<double>()),
                                             100.0 * result.value("eval_accuracy", 0.0))
                               : "eval none (no held-out data)";
  return fmt::format("final loss {}  {}", final_loss, eval);
}

std::string format_event(const nlohmann::json& e) {
  const std::string kind = e.value("event", "");
  if (kind == "progress") {
    std::string eta;
    if (e.contains("eta_s")) {
      const auto secs = static_cast<int64_t>(e.value("eta_s", 0.0) + 0.5);
      eta = fmt::format("  eta {}:{:02d}:{:02d}", secs / 3600, secs / 60 % 60, secs % 60);
    }
    const std::string rate = e.contains("tokens_per_s")
                                 ? fmt::format("{:.0f} tokens/s", e.value("tokens_per_s", 0.0))
                                 : fmt::format("{:.0f} samples/s", e.value("samples_per_s", 0.0));
    return fmt::format(
        "step {}/{}  loss {}  lr {:.3g}  grad_norm {:.3g}  {}  step {:.2f} ms  comm {:.2f} "
        "ms{}",
        e.value("step", int64_t{0}), e.value("steps", int64_t{0}), loss_text(e.value("loss", 0.0)),
        e.value("lr", 0.0), e.value("grad_norm", 0.0), rate, e.value("step_ms", 0.0),
        e.value("comm_ms", 0.0), eta);
  }
  if (kind == "eval") {
    return fmt::format("eval at step {}: loss {}  accuracy {:.2f}%", e.value("step", int64_t{0}),
                       loss_text(e.value("eval_loss", 0.0)), 100.0 * e.value("eval_accuracy", 0.0));
  }
  if (kind == "rendezvous") {
    return fmt::format("all {} ranks met; starting at step {}", e.value("world_size", 0),
                       e.value("step", int64_t{0}));
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
  return ::isatty(::fileno(f)) == 1;
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

void StatusPrinter::event(const nlohmann::json& e) {
  const std::string text = format_event(e);
  if (!tty_ || e.value("event", "") != "progress") {
    line(text);
    return;
  }
  progress(text);
}

void StatusPrinter::progress(const std::string& text) {
  if (!tty_) return;
  std::lock_guard lock(mutex_);
  std::fputs("\r\033[K", out_);
  std::fputs(text.c_str(), out_);
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
