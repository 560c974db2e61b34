// The status printer: plain lines in a pipe, one rewritten line on a terminal.
#include "launch/status.hpp"

#include <doctest/doctest.h>

#include <cstdio>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/comm/communicator.hpp"

using namespace dptrain;

namespace {

std::string printed(bool tty, const std::function<void(StatusPrinter&)>& use) {
  char* buf = nullptr;
  size_t size = 0;
  std::FILE* f = ::open_memstream(&buf, &size);
  {
    StatusPrinter p(f, tty);
    use(p);
  }
  std::fclose(f);
  std::string out(buf, size);
  std::free(buf);
  return out;
}

const nlohmann::json progress = {{"event", "progress"},
                                 {"step", 10},
                                 {"steps", 100},
                                 {"loss", 1.5},
                                 {"lr", 0.001},
                                 {"grad_norm", 2.0},
                                 {"samples_per_s", 1234.0},
                                 {"step_ms", 1.0},
                                 {"comm_ms", 0.5},
                                 {"eta_s", 3725.0}};

}  // namespace

TEST_CASE("status: events are formatted for people") {
  const std::string p = format_event(progress);
  CHECK(p.find("step 10/100") != std::string::npos);
  CHECK(p.find("loss 1.5000") != std::string::npos);
  CHECK(p.find("1234 samples/s") != std::string::npos);
  CHECK(p.find("eta 1:02:05") != std::string::npos);
  CHECK(format_event({{"event", "eval"}, {"step", 5}, {"eval_loss", 0.25}, {"eval_accuracy", 0.5}})
            .find("accuracy 50.00%") != std::string::npos);
  CHECK(format_event({{"event", "info"}, {"message", "hello"}}) == "hello");
  // A collective benchmark's result is not a training's.
  CHECK(format_event({{"event", "result"},
                      {"benchmark", "comm"},
                      {"ranks", 2},
                      {"rows", nlohmann::json::array({{{"size", 8}}, {{"size", 16}}})},
                      {"avg_busbw", 1.234},
                      {"wrong", 0}}) ==
        "bench comm finished: 2 row(s) on 2 rank(s), average busbw 1.23 GB/s, 0 wrong element(s)");
  // A NaN or infinity is written as null: shown as nan, never an exception.
  nlohmann::json nulls = progress;
  for (const char* key : {"loss", "lr", "grad_norm", "eta_s", "step_ms"})
    nulls[key] = nullptr;
  const std::string n = format_event(nulls);
  CHECK(n.find("loss nan  lr nan  grad_norm nan") != std::string::npos);
  CHECK(n.find("eta") == std::string::npos);
  CHECK(format_event({{"event", "eval"}, {"step", 5}, {"eval_loss", nullptr}}).find("loss nan") !=
        std::string::npos);
  CHECK(format_losses({{"final_loss", nullptr}, {"eval_loss", 1.5}, {"eval_accuracy", 0.5}}) ==
        "final loss none  eval loss 1.5000  eval accuracy 50.00%");
}

TEST_CASE("status: a loss keeps 4 decimals, or 4 significant digits when it is tiny") {
  CHECK(loss_text(1.9997182) == "1.9997");  // not "2"
  CHECK(loss_text(12.0) == "12.0000");
  CHECK(loss_text(0.0) == "0.0000");
  CHECK(loss_text(2.5e-05) == "2.5e-05");
  CHECK(loss_text(1.7643845538971e32) == "1.764e+32");
  CHECK(loss_text(std::nan("")) == "nan");
  CHECK(format_losses({{"final_loss", 1.9997182}, {"eval_loss", 2.0}, {"eval_accuracy", 0.5}}) ==
        "final loss 1.9997  eval loss 2.0000  eval accuracy 50.00%");
}

TEST_CASE("status: a pipe gets plain lines, no control characters") {
  const std::string out = printed(false, [](StatusPrinter& p) {
    p.event(progress);
    p.line("a line");
    p.event(progress);
  });
  CHECK(out.find('\r') == std::string::npos);
  CHECK(out.find('\033') == std::string::npos);
  CHECK(std::count(out.begin(), out.end(), '\n') == 3);
}

TEST_CASE("status: a terminal gets one progress line rewritten in place") {
  const std::string out = printed(true, [](StatusPrinter& p) {
    p.event(progress);
    p.event(progress);
    p.line("checkpoint");
    p.event(progress);
  });
  CHECK(out.find("\r\033[K") != std::string::npos);
  // Progress lines are not newline-terminated; the permanent line and the final finish() are.
  CHECK(std::count(out.begin(), out.end(), '\n') == 2);
  CHECK(out.find("checkpoint\n") != std::string::npos);
}

TEST_CASE("status: a progress line is cut to the terminal's width, by characters") {
  CHECK(fit_columns("step 10/100", 0) == "step 10/100");  // width not known
  CHECK(fit_columns("step 10/100", 12) == "step 10/100");
  CHECK(fit_columns("step 10/100", 6) == "step ");
  // "\u00d7" is two bytes, one column.
  CHECK(fit_columns("4 \u00d7 8 ranks", 6) == "4 \u00d7 8");
  // Wide characters take two columns each: a file name in CJK is cut at the screen's width, not
  // at its character count (which would wrap, and leave a row behind at each update).
  CHECK(fit_columns("\u6570\u636e\u6570\u636e.txt", 6) == "\u6570\u636e");
  CHECK(fit_columns("\u6570\u636e\u6570\u636e.txt", 7) == "\u6570\u636e\u6570");
  // A combining accent takes none; bytes that are not UTF-8 take one each.
  CHECK(fit_columns("e\u0301e\u0301e\u0301e", 4) == "e\u0301e\u0301e\u0301");
  CHECK(fit_columns("\xff\xfe\xfd"
                    "abc",
                    4) == "\xff\xfe\xfd");
}

TEST_CASE("status: a narrow terminal's progress line keeps the step, loss, rate and eta") {
  const nlohmann::json e = {{"event", "progress"}, {"step", 10},      {"steps", 300},
                            {"loss", 2.4065},      {"lr", 0.000323},  {"grad_norm", 1.5},
                            {"step_ms", 12.5},     {"comm_ms", 1.25}, {"tokens_per_s", 5120},
                            {"eta_s", 62}};
  const std::string full =
      "step 10/300  loss 2.4065  lr 0.000323  grad_norm 1.5  5120 tokens/s  step 12.50 ms  "
      "comm 1.25 ms  eta 0:01:02";
  CHECK(format_event(e) == full);
  CHECK(format_progress(e, 0) == full);
  CHECK(format_progress(e, 200) == full);
  // Short of the last column: comm goes first, then the step's time, the lr, the norm.
  CHECK(format_progress(e, static_cast<int>(full.size())) ==
        "step 10/300  loss 2.4065  lr 0.000323  grad_norm 1.5  5120 tokens/s  step 12.50 ms  "
        "eta 0:01:02");
  CHECK(format_progress(e, 60) == "step 10/300  loss 2.4065  5120 tokens/s  eta 0:01:02");
  CHECK(format_progress(e, 40) == "step 10/300  loss 2.4065  eta 0:01:02");
  // Too narrow even for those: the step and the loss, which the printer then cuts.
  CHECK(format_progress(e, 20) == "step 10/300  loss 2.4065");
}

TEST_CASE("status: a progress text is rewritten on a terminal and dropped in a pipe") {
  const auto use = [](StatusPrinter& p) {
    p.progress("reading a.txt: 1.0 MiB of 4.0 MiB");
    p.progress("reading a.txt: 2.0 MiB of 4.0 MiB");
    p.line("done");
    p.progress("writing");
    p.erase_progress();
  };
  const std::string pipe = printed(false, use);
  CHECK(pipe == "done\n");
  const std::string tty = printed(true, use);
  CHECK(tty ==
        "\r\033[Kreading a.txt: 1.0 MiB of 4.0 MiB\r\033[Kreading a.txt: 2.0 MiB of 4.0 MiB"
        "\r\033[Kdone\n\r\033[Kwriting\r\033[K");
}

TEST_CASE("status: a benchmark's progress event is rewritten on a terminal, dropped in a pipe") {
  const auto use = [](StatusPrinter& p) {
    p.event({{"event", "bench_progress"}, {"message", "bench comm: allreduce 8 bytes (1/2)"}});
    p.event({{"event", "info"}, {"message", "bench comm: broadcast on 2 rank(s)"}});
  };
  CHECK(printed(false, use) == "bench comm: broadcast on 2 rank(s)\n");
  CHECK(printed(true, use) ==
        "\r\033[Kbench comm: allreduce 8 bytes (1/2)\r\033[Kbench comm: broadcast on 2 rank(s)\n");
}

TEST_CASE("status: a tick moves a terminal's progress line, with the last logged loss") {
  const auto use = [](StatusPrinter& p) {
    p.event({{"event", "tick"}, {"step", 3}, {"steps", 300}, {"eta_s", 62}});
    p.event({{"event", "progress"},
             {"step", 10},
             {"steps", 300},
             {"loss", 2.4065},
             {"lr", 0.001},
             {"grad_norm", 1},
             {"samples_per_s", 50},
             {"step_ms", 900},
             {"comm_ms", 1}});
    p.event({{"event", "tick"}, {"step", 11}, {"steps", 300}, {"eta_s", 3725}});
    // A restart's ranks meet again: its ticks have no loss of their own yet.
    p.event({{"event", "rendezvous"}, {"world_size", 2}, {"step", 0}});
    p.event({{"event", "tick"}, {"step", 2}, {"steps", 300}});
  };
  // In a pipe (and a log) a tick is nothing; the progress event its line.
  CHECK(printed(false, use) ==
        "step 10/300  loss 2.4065  lr 0.001  grad_norm 1  50 samples/s  step 900.00 ms  comm 1.00 "
        "ms\nall 2 ranks met; starting at step 0\n");
  CHECK(printed(true, use) ==
        "\r\033[Kstep 3/300  eta 0:01:02"
        "\r\033[Kstep 10/300  loss 2.4065  lr 0.001  grad_norm 1  50 samples/s  step 900.00 ms  "
        "comm 1.00 ms"
        "\r\033[Kstep 11/300  loss 2.4065 (step 10)  eta 1:02:05"
        "\r\033[Kall 2 ranks met; starting at step 0\n\r\033[Kstep 2/300\n");
  CHECK(terminal_only({{"event", "tick"}, {"step", 3}}));
  CHECK_FALSE(terminal_only({{"event", "progress"}, {"step", 3}}));
}

TEST_CASE("status: a rank's warning event is a warning: kept for --json, not a status line") {
  std::vector<std::string> kept;
  const std::string out = printed(false, [&kept](StatusPrinter& p) {
    p.event({{"event", "info"}, {"message", "warning: skipping checkpoint step-000020: damaged"}});
    p.event({{"event", "info"}, {"message", "resumed from step-000010"}});
    kept = p.warnings();
  });
  // A printer to a file (here a memory stream) keeps the warning there too, as a warning line.
  CHECK(out ==
        "dptrain: warning: skipping checkpoint step-000020: damaged\nresumed from step-000010\n");
  CHECK(kept == std::vector<std::string>{"skipping checkpoint step-000020: damaged"});
}

TEST_CASE("status: a file printer's warning is kept there and said by the terminal it mirrors") {
  std::string console;
  std::vector<std::string> said;
  const std::string terminal = printed(true, [&console, &said](StatusPrinter& tty) {
    console = printed(false, [&tty](StatusPrinter& file) {
      file.mirror_progress(&tty, "bench train: w2: ");
      file.event(progress);
      file.warning("a checkpoint passed over");
    });
    said = tty.warnings();
  });
  const std::string step = format_event(progress);
  CHECK(console == step + "\ndptrain: warning: a checkpoint passed over\n");
  CHECK(said == std::vector<std::string>{"bench train: w2: a checkpoint passed over"});
  // The terminal's progress line is cleared before the warning, not run into it.
  CHECK(terminal == "\r\033[Kbench train: w2: " + step +
                        "\r\033[Kdptrain: warning: bench train: w2: a checkpoint passed over\n");
}

TEST_CASE("status: a printer to a file can mirror its progress on a terminal's progress line") {
  std::string console;
  const std::string terminal = printed(true, [&console](StatusPrinter& tty) {
    console = printed(false, [&tty](StatusPrinter& file) {
      file.mirror_progress(&tty, "bench train: w2: ");
      file.event(progress);
      file.line("rank 0: a line of its own");
    });
    tty.line("bench train: world 2: 1234.0 samples/s");
  });
  const std::string step = format_event(progress);
  // The file has every line; the terminal the progress in place, then the next line over it.
  CHECK(console == step + "\nrank 0: a line of its own\n");
  CHECK(terminal ==
        "\r\033[Kbench train: w2: " + step + "\r\033[Kbench train: world 2: 1234.0 samples/s\n");
}

TEST_CASE("status: lines every rank prints alike at a stop are shown a few times, then counted") {
  RepeatedRankLines repeated;
  const auto sigterm = [](int r) {
    return fmt::format("received SIGTERM: rank {} checkpoints at the end of this step", r);
  };
  const auto follower = [](int r) {
    return fmt::format("dptrain: error: rank {}: gloo allreduce failed: Connection closed ({})", r,
                       kPeerGoneNote);
  };
  CHECK(repeated.summary().empty());
  for (int r = 0; r < RepeatedRankLines::kShown; ++r) {
    CHECK(repeated.show(sigterm(r)));
    CHECK(repeated.show(follower(r)));
  }
  CHECK(repeated.summary().empty());  // nothing left out yet
  for (int r = RepeatedRankLines::kShown; r < 16; ++r)
    CHECK_FALSE(repeated.show(sigterm(r)));
  CHECK_FALSE(repeated.show(follower(5)));
  // Any other line, however often it comes, is shown.
  for (int i = 0; i < 10; ++i)
    CHECK(repeated.show("checkpoint at step 20: run/checkpoints/step-000020"));
  CHECK(
      repeated.summary() ==
      std::vector<std::string>{"12 more ranks received SIGTERM (each rank's log has its line)",
                               "1 more rank failed as a peer left (each rank's log has its line)"});
}

TEST_CASE(
    "status: long work's progress is a rewritten line on a terminal, none in a pipe at once") {
  const auto shown = [](bool tty) {
    char* buf = nullptr;
    size_t size = 0;
    std::FILE* f = ::open_memstream(&buf, &size);
    {
      WorkStatus work(f, tty);
      work.show("verifying step-000020 (1 of 2)", 512, 2048);
      work.show("verifying step-000020 (1 of 2)", 2048, 2048);  // within 0.1 s: not yet
      work.show("tokenizing", 3, 10, "tokens");                 // another part: at once
      work.erase();
    }
    std::fclose(f);
    std::string text(buf, size);
    std::free(buf);
    return text;
  };
  CHECK(shown(true) ==
        "\r\033[Kverifying step-000020 (1 of 2): 512 B of 2.0 KiB (25%)"
        "\r\033[Ktokenizing: 3 of 10 tokens (30%)\r\033[K");
  // A pipe gets a line only once a part has gone on for 5 s.
  CHECK(shown(false).empty());
}
