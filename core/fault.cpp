// Fault injection for tests, from DPTRAIN_FAULT.
#include "core/fault.hpp"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <set>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.hpp"

namespace dptrain {

namespace {

int64_t parse_int(const std::string& text, const std::string& context) {
  try {
    size_t used = 0;
    const long long v = std::stoll(text, &used);
    if (used == text.size()) return v;
  } catch (const std::exception&) {
  }
  throw Error(ErrorKind::usage,
              fmt::format("DPTRAIN_FAULT: '{}': not an integer in '{}'", text, context));
}

Fault parse_one(const std::string& text) {
  const auto at = text.find('@');
  const std::string kind = text.substr(0, at);
  Fault f;
  f.text = text;
  static constexpr std::pair<std::string_view, Fault::Kind> kinds[] = {
      {"crash", Fault::Kind::crash},
      {"exit", Fault::Kind::exit},
      {"hang", Fault::Kind::hang},
      {"freeze", Fault::Kind::freeze},
      {"slow", Fault::Kind::slow},
      {"crash-in-checkpoint", Fault::Kind::crash_in_checkpoint},
      {"freeze-before-join", Fault::Kind::freeze_before_join},
      {"slow-start", Fault::Kind::slow_start}};
  const auto known = [&](std::string_view name) {
    return std::find_if(std::begin(kinds), std::end(kinds),
                        [&](const auto& k) { return k.first == name; });
  };
  if (const auto found = known(kind); found != std::end(kinds)) {
    f.kind = found->second;
  } else if (const auto comma = kind.find(',');
             comma != std::string::npos && known(kind.substr(0, comma)) != std::end(kinds)) {
    // "freeze-before-join,rank=1": a kind without step= still takes its options after '@'.
    const std::string options = kind.substr(comma + 1);
    throw Error(ErrorKind::usage,
                fmt::format("DPTRAIN_FAULT: '{}': a fault's options follow '@' ({}@{}{})", text,
                            kind.substr(0, comma), options,
                            at == std::string::npos ? "" : "," + text.substr(at + 1)));
  } else {
    std::vector<std::string_view> names;
    for (const auto& k : kinds)
      names.push_back(k.first);
    throw Error(ErrorKind::usage, fmt::format("DPTRAIN_FAULT: unknown fault '{}' in '{}' ({})",
                                              kind, text, fmt::join(names, ", ")));
  }
  bool has_step = false;
  std::set<std::string> seen;
  std::istringstream fields(at == std::string::npos ? "" : text.substr(at + 1));
  for (std::string field; std::getline(fields, field, ',');) {
    const auto eq = field.find('=');
    const std::string key = field.substr(0, eq);
    const std::string value = eq == std::string::npos ? "" : field.substr(eq + 1);
    if (!seen.insert(key).second) {
      throw Error(ErrorKind::usage,
                  fmt::format("DPTRAIN_FAULT: '{}' is given twice in '{}'", key, text));
    }
    if (key == "step") {
      f.step = parse_int(value, text);
      has_step = true;
    } else if (key == "rank") {
      f.rank = static_cast<int>(parse_int(value, text));
    } else if (key == "gen") {
      f.generation = static_cast<int>(parse_int(value, text));
    } else if (key == "code") {
      f.code = static_cast<int>(parse_int(value, text));
    } else if (key == "ms") {
      f.ms = parse_int(value, text);
    } else {
      throw Error(ErrorKind::usage,
                  fmt::format("DPTRAIN_FAULT: unknown field '{}' in '{}' (step, rank, gen, "
                              "code, ms)",
                              key, text));
    }
  }
  // Before the first step there is no step.
  const bool at_start =
      f.kind == Fault::Kind::freeze_before_join || f.kind == Fault::Kind::slow_start;
  if (at_start && has_step) {
    throw Error(ErrorKind::usage,
                fmt::format("DPTRAIN_FAULT: '{}': {} takes no step=", text, kind));
  }
  if (!has_step && !at_start) {
    throw Error(ErrorKind::usage, fmt::format("DPTRAIN_FAULT: '{}' needs step=N", text));
  }
  const auto out_of_range = [&text](const char* field, int64_t value, const char* range) {
    return Error(ErrorKind::usage,
                 fmt::format("DPTRAIN_FAULT: {}={} in '{}' is not {}", field, value, text, range));
  };
  if (f.step < 0) throw out_of_range("step", f.step, "a step (0 or more)");
  if (f.code < 0 || f.code > 255) throw out_of_range("code", f.code, "an exit code (0 to 255)");
  if (seen.count("ms") && f.ms < 1) throw out_of_range("ms", f.ms, "a pause (1 ms or more)");
  if (seen.count("rank") && f.rank < 0) throw out_of_range("rank", f.rank, "a rank (0 or more)");
  if (seen.count("gen") && f.generation < 1) {
    throw out_of_range("gen", f.generation, "a generation (1 or more)");
  }
  // A field its kind does not read would pass for a fault it is not; a slow with no pause does
  // nothing, so a test of it would pass without its fault.
  if (seen.count("code") && f.kind != Fault::Kind::exit) {
    throw Error(ErrorKind::usage,
                fmt::format("DPTRAIN_FAULT: code= in '{}' is only for exit faults", text));
  }
  const bool pauses = f.kind == Fault::Kind::slow || f.kind == Fault::Kind::slow_start;
  if (seen.count("ms") && !pauses) {
    throw Error(
        ErrorKind::usage,
        fmt::format("DPTRAIN_FAULT: ms= in '{}' is only for slow and slow-start faults", text));
  }
  if (pauses && !seen.count("ms")) {
    throw Error(
        ErrorKind::usage,
        fmt::format("DPTRAIN_FAULT: '{}' needs ms=M, its pause {}", text,
                    f.kind == Fault::Kind::slow ? "before every step" : "before the first step"));
  }
  return f;
}

}  // namespace

std::vector<Fault> parse_faults(const std::string& text) {
  std::vector<Fault> faults;
  std::istringstream parts(text);
  for (std::string part; std::getline(parts, part, ';');) {
    if (!part.empty()) faults.push_back(parse_one(part));
  }
  return faults;
}

std::vector<std::string> unreachable_faults(const std::vector<Fault>& faults, int64_t steps,
                                            int world, int64_t checkpoint_every,
                                            const std::vector<int>& writers, int64_t first_step,
                                            int first_generation, bool one_generation) {
  std::vector<std::string> out;
  for (const auto& f : faults) {
    if (f.generation >= 0 && f.generation < first_generation) {
      out.push_back(
          fmt::format("DPTRAIN_FAULT '{}' never fires: this invocation starts at "
                      "generation {}",
                      f.text, first_generation));
    } else if (one_generation && f.generation > first_generation) {
      out.push_back(fmt::format(
          "DPTRAIN_FAULT '{}' never fires: a benchmark's run is generation {} alone (no restart)",
          f.text, first_generation));
    } else if (f.kind == Fault::Kind::slow_start) {
      if (f.rank >= world) {
        out.push_back(fmt::format("DPTRAIN_FAULT '{}' never fires: there are ranks 0 to {}", f.text,
                                  world - 1));
      }
    } else if (f.kind == Fault::Kind::freeze_before_join) {
      if (f.rank >= world) {
        out.push_back(fmt::format("DPTRAIN_FAULT '{}' never fires: there are ranks 0 to {}", f.text,
                                  world - 1));
      } else if (world < 2 || f.rank < 0) {
        // Nothing then beats for a launcher to compare: the job waits until it is killed.
        out.push_back(
            fmt::format("DPTRAIN_FAULT '{}' freezes every rank: no rank is left to "
                        "notice it; give rank=R of 2 or more ranks",
                        f.text));
      }
    } else if (f.kind != Fault::Kind::slow && f.step < first_step) {
      out.push_back(fmt::format("DPTRAIN_FAULT '{}' never fires: the run continues from step {}",
                                f.text, first_step));
    } else if (f.rank >= world) {
      out.push_back(fmt::format("DPTRAIN_FAULT '{}' never fires: there are ranks 0 to {}", f.text,
                                world - 1));
    } else if (f.kind == Fault::Kind::crash_in_checkpoint && checkpoint_every == kNoCheckpoints) {
      out.push_back(
          fmt::format("DPTRAIN_FAULT '{}' never fires: these ranks write no checkpoints", f.text));
    } else if (f.kind == Fault::Kind::crash_in_checkpoint && f.rank >= 0 &&
               std::find(writers.begin(), writers.end(), f.rank) == writers.end()) {
      out.push_back(fmt::format(
          "DPTRAIN_FAULT '{}' never fires: rank {} writes no checkpoints (rank{} {} do{})", f.text,
          f.rank, writers.size() == 1 ? "" : "s", fmt::join(writers, ", "),
          writers.size() == 1 ? "es" : ""));
    } else if (f.kind == Fault::Kind::crash_in_checkpoint) {
      const bool scheduled = f.step == steps || (checkpoint_every > 0 && f.step > 0 &&
                                                 f.step < steps && f.step % checkpoint_every == 0);
      if (!scheduled) {
        out.push_back(fmt::format(
            "DPTRAIN_FAULT '{}' fires only if a stop writes a checkpoint there: step {} is not "
            "one of the run's checkpoint steps (every {}, and {})",
            f.text, f.step, checkpoint_every, steps));
      }
    } else if (f.step < 0 || f.step >= steps) {
      // Faults fire before a step, when `step` steps are done.
      out.push_back(
          fmt::format("DPTRAIN_FAULT '{}' never fires: step {} is past the run's steps (0 to {})",
                      f.text, f.step, steps - 1));
    }
  }
  return out;
}

FaultInjector::FaultInjector(std::vector<Fault> faults, int rank, int generation) {
  for (const auto& f : faults) {
    if ((f.rank < 0 || f.rank == rank) && (f.generation < 0 || f.generation == generation)) {
      faults_.push_back(f);
    }
  }
}

void FaultInjector::before_step(int64_t step, const std::function<void()>& before_fault) const {
  for (const auto& f : faults_) {
    if (f.kind == Fault::Kind::freeze_before_join || f.kind == Fault::Kind::slow_start) continue;
    if (f.kind == Fault::Kind::slow && step >= f.step) {
      std::this_thread::sleep_for(std::chrono::milliseconds(f.ms));
      continue;
    }
    if (step != f.step) continue;
    if (before_fault && f.kind != Fault::Kind::crash_in_checkpoint) before_fault();
    switch (f.kind) {
      case Fault::Kind::crash:
        ::kill(::getpid(), SIGKILL);
        break;
      case Fault::Kind::exit:
        std::fflush(nullptr);
        std::_Exit(f.code);
      case Fault::Kind::hang:
        for (;;)
          std::this_thread::sleep_for(std::chrono::hours(1));
      case Fault::Kind::freeze:
        // As a debugger or a swapping host would: every thread stops until SIGCONT.
        ::kill(::getpid(), SIGSTOP);
        break;
      case Fault::Kind::slow:
      case Fault::Kind::crash_in_checkpoint:
      case Fault::Kind::freeze_before_join:
      case Fault::Kind::slow_start:
        break;
    }
  }
}

void FaultInjector::before_join() const {
  for (const auto& f : faults_) {
    if (f.kind == Fault::Kind::freeze_before_join) ::kill(::getpid(), SIGSTOP);
  }
}

void FaultInjector::after_join() const {
  for (const auto& f : faults_) {
    if (f.kind == Fault::Kind::slow_start)
      std::this_thread::sleep_for(std::chrono::milliseconds(f.ms));
  }
}

void FaultInjector::before_checkpoint_commit(int64_t step) const {
  for (const auto& f : faults_) {
    if (f.kind == Fault::Kind::crash_in_checkpoint && f.step == step) ::kill(::getpid(), SIGKILL);
  }
}

}  // namespace dptrain
