// Shared ending of launch and resume: print a job's outcome for people or scripts.
#include "cli/run_report.hpp"

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <system_error>

#include <fmt/format.h>

#include "cli/env.hpp"
#include "cli/json_errors.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"
#include "core/recipe.hpp"
#include "launch/report.hpp"
#include "launch/status.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

void RestartOptions::validate() const {
  // CLI11 checks the types; a negative value can only be the "unset" default or a typo'd flag.
  if (max_restarts < -1) {
    throw Error(ErrorKind::usage,
                fmt::format("--max-restarts: must be >= 0, got {}", max_restarts));
  }
}

RestartPolicy RestartOptions::policy(const FaultToleranceSpec& recipe) const {
  RestartPolicy p;
  p.max_restarts = static_cast<int>(max_restarts >= 0 ? max_restarts : recipe.max_restarts);
  const double backoff = backoff_s >= 0 ? backoff_s : recipe.restart_backoff_s;
  p.backoff = std::chrono::milliseconds(static_cast<int64_t>(backoff * 1000));
  return p;
}

std::chrono::milliseconds RestartOptions::hang_timeout(const FaultToleranceSpec& recipe) const {
  const double seconds = hang_timeout_s >= 0 ? hang_timeout_s : recipe.hang_timeout_s;
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

std::chrono::milliseconds RestartOptions::rejoin_timeout(const FaultToleranceSpec& recipe) const {
  const double seconds = rejoin_timeout_s >= 0 ? rejoin_timeout_s : recipe.rejoin_timeout_s;
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

void check_events(const RestartOptions& o, bool json, const std::filesystem::path& run_dir) {
  const bool to_stdout = !o.events.empty() && names_standard_output(o.events);
  if (to_stdout && json) {
    throw Error(ErrorKind::usage,
                fmt::format("--events {}: not with --json (both write to stdout{})", o.events,
                            o.events == "-" ? "" : ": it names standard output"));
  }
  if (o.events.empty() || to_stdout) return;
  check_events_place("--events", o.events, run_dir);
  // Events are appended: to a file that holds them already (an earlier job's stream), never to
  // one that holds something else (the recipe or its dataset, named by a slip), which the lines
  // would corrupt. A new or empty file is the stream's own; a pipe or a device is written to.
  std::error_code ec;
  if (!std::filesystem::is_regular_file(o.events, ec)) return;
  if (std::filesystem::file_size(o.events, ec) == 0 || ec) return;  // empty
  std::ifstream in(o.events, std::ios::binary);
  if (!in) {
    throw Error(ErrorKind::usage,
                fmt::format("--events {}: cannot be read to tell what it holds ({}), so nothing "
                            "is appended to it; name another file, or remove it first",
                            printable(o.events), std::strerror(errno)));
  }
  // Its first line, read no further than an event line goes (a file without line ends, a
  // dataset, is not read whole).
  constexpr std::streamsize kMostLine = 1 << 20;
  std::string first(static_cast<size_t>(kMostLine), '\0');
  in.getline(first.data(), kMostLine);
  first.resize(std::strlen(first.c_str()));  // what getline stored, before its terminator
  const auto event = nlohmann::json::parse(first, nullptr, false);
  if (!event.is_object() || !event.contains("event")) {
    throw Error(ErrorKind::usage,
                fmt::format("--events {}: holds something else than events (its first line is "
                            "not an event's JSON object), so nothing is appended to it; name "
                            "another file, or remove it first",
                            printable(o.events)));
  }
}

bool events_in_run_dir(const RestartOptions& o, const std::filesystem::path& run_dir) {
  return !o.events.empty() && !names_standard_output(o.events) && !run_dir.empty() &&
         lies_in(o.events, run_dir);
}

std::unique_ptr<EventLog> open_events(const RestartOptions& o, bool json,
                                      const std::filesystem::path& run_dir) {
  if (o.events.empty()) return std::make_unique<EventLog>();
  check_events(o, json, run_dir);
  return std::make_unique<EventLog>(o.events);
}

void finish_events_with_failure(EventLog& events, const std::exception& e,
                                const std::string& run_dir, const std::string& what, bool started) {
  if (events.finished()) return;
  const FailureEnd end = failure_end(e);
  try {
    events.emit("run_finished",
                {{"status", started ? end.status : std::string(failure_status(end.kind))},
                 {"exit_code", end.exit_code},
                 // None yet: a launch refused before it made one.
                 {"run_dir", run_dir.empty() ? nlohmann::json() : nlohmann::json(run_dir)},
                 {"error", fmt::format("{}: {}", what, e.what())},
                 // Its messages, as the --json object on stdout has them.
                 {"errors", error_messages(e.what())}});
  } catch (const std::exception&) {
  }
}

void end_unopened_events(const RestartOptions& o, bool json, const std::string& run_dir,
                         bool resumed, const std::exception& e, const std::string& what) {
  if (o.events.empty() || events_in_run_dir(o, run_dir)) return;
  // Refused because another process drives the run: a regular file that exists may be that
  // run's own stream, whose end is not this command's to write. This command's stdout (also as
  // /dev/stdout), a pipe it was handed, or a file it would create, is its own.
  std::error_code ec;
  const bool may_be_anothers =
      !names_standard_output(o.events) && std::filesystem::is_regular_file(o.events, ec);
  if (may_be_anothers && !run_dir.empty() &&
      (run_locked_by_another(run_dir) || !driven_run(run_dir).empty() ||
       !running_hand_run(run_dir).empty())) {
    return;
  }
  try {
    check_events(o, json, run_dir);
    // A FIFO nobody reads is not waited for: the refusal is said at once.
    const auto events = std::make_unique<EventLog>(o.events, /*wait_for_reader=*/false);
    // A launch's directory is not made yet (one that exists is another run's, which refused it).
    finish_events_with_failure(
        *events, e,
        resumed && !run_dir.empty() ? std::filesystem::absolute(run_dir).string() : std::string(),
        what, /*started=*/false);
  } catch (const std::exception&) {
    // The path is what was refused: there is no stream to end.
  }
}

FailureEnd failure_end(const std::exception& e) {
  const auto* error = dynamic_cast<const Error*>(&e);
  const ErrorKind kind = error != nullptr ? kind_after_stop(error->kind()) : ErrorKind::internal;
  return {kind, exit_code(kind), run_failure_status(kind)};
}

std::FILE* status_stream(bool json, const EventLog& events) {
  return json || events.to_stdout() ? stderr : stdout;
}

namespace {

// The run.json of `dir`, when there is one this can tell anything of (the callers say what they
// find otherwise).
std::optional<nlohmann::json> readable_run_json(const std::filesystem::path& dir) {
  std::error_code ec;
  if (!std::filesystem::exists(dir / "run.json", ec)) return std::nullopt;
  try {
    return read_run_json(dir);
  } catch (const Error&) {
    return std::nullopt;
  }
}

// " (NOTE)" of a state's note, or "".
std::string note_of(const RunState& state) {
  return state.note.empty() ? "" : " (" + state.note + ")";
}

}  // namespace

std::string running_hand_run(const std::filesystem::path& dir) {
  const auto info = readable_run_json(dir);
  if (!info || !started_by_workers(*info)) return {};
  const RunState state = run_state(*info, dir);
  if (state.status != "running") return {};
  return fmt::format(
      "{}: its workers (started without a launcher: by hand, srun, mpirun) are running it{}",
      printable(dir.string()), note_of(state));
}

std::string driven_run(const std::filesystem::path& dir) {
  const auto info = readable_run_json(dir);
  if (!info) return {};
  const RunState state = run_state(*info, dir);
  if (state.status != "running" && state.status != "restarting" && state.status != "resizing")
    return {};
  return fmt::format("{}: the run is {}{}", printable(dir.string()), state.status, note_of(state));
}

namespace {

using nlohmann::json;

// The launcher itself failed mid-job (too few file descriptors, a full disk under run.json, ...):
// the run is recorded as failed with that error, as far as the run directory still takes
// writes, instead of staying "running" until status calls it stale.
void record_launcher_failure(RunDirectory& run, EventLog& events, const std::exception& e) {
  const std::string error = fmt::format("the launcher failed: {}", e.what());
  // Stopped by SIGINT or SIGTERM: recorded as stopped runs are, with the code the command exits.
  const FailureEnd end = failure_end(e);
  // Failed before its first run.json (a full disk): there is no run to record, and the
  // directory, left as a failed start leaves it (without the recipe.json this start wrote),
  // takes a launch again.
  const bool recorded = run.has_record();
  std::error_code ec;
  if (!recorded) std::filesystem::remove(run.path() / "recipe.json", ec);
  try {
    record_run_failure(run.info(), error);
    run.info()["status"] = end.status;
    json& generations = run.info()["generations"];
    if (generations.is_array() && !generations.empty() &&
        generations.back().value("status", "") == "failed") {
      generations.back()["status"] = end.status;
    }
    if (recorded) run.save();
  } catch (const std::exception&) {
    // The directory takes no writes (a full disk): the error on stderr is all there is.
  }
  finish_events_with_failure(events, e, run.path().string(), "the launcher failed",
                             /*started=*/true);
  // Nor the events stream the launch kept in it (RUN_DIR/events.jsonl), once it has ended.
  if (!recorded && !events.path().empty() && lies_in(events.path(), run.path())) {
    std::filesystem::remove(events.path(), ec);
  }
  std::fprintf(stderr, "dptrain: run directory: %s%s\n", run.path().c_str(),
               recorded ? "" : " (nothing was started: a launch may use it again)");
}

}  // namespace

std::vector<std::string> run_warnings(const StatusPrinter& status, const EventLog& events) {
  std::vector<std::string> warnings = status.warnings();
  if (!events.write_failure().empty()) warnings.push_back(events.write_failure());
  return warnings;
}

int run_to_end(RunDirectory& run, JobSpec spec, const RestartOptions& o, bool json,
               EventLog& events, StatusPrinter& status) {
  spec.hang_timeout = o.hang_timeout(spec.recipe.fault_tolerance);
  spec.rejoin_timeout = o.rejoin_timeout(spec.recipe.fault_tolerance);
  spec.events = &events;
  JobOutcome outcome;
  try {
    outcome = run_job_with_restarts(run, spec, status, o.policy(spec.recipe.fault_tolerance));
  } catch (const std::exception& e) {
    status.finish();
    record_launcher_failure(run, events, e);
    throw;
  }
  outcome.warnings = run_warnings(status, events);
  events.emit("run_finished", outcome.to_json(run));
  return report_outcome(run, outcome, json, events.to_stdout() ? stderr : stdout);
}

void check_local_memory(const JobSpec& spec, const RecipeSource& origin) {
  const Recipe& r = spec.recipe;
  const int ranks = local_rank_count(spec);
  if (r.train.device != "cpu" || ranks < 1) return;
  const uint64_t available = available_memory();
  const auto params = parameter_count(r.model);
  if (available == 0 || !params) return;
  // f32 values a rank keeps per parameter: itself and its gradient, and the optimizer's state
  // (sharded over the ranks with ZeRO-1; on the servers, sharded, in parameter-server mode).
  double state = r.optimizer.type == "adamw" ? 2 : r.optimizer.momentum > 0 ? 1 : 0;
  if (r.distributed.zero == 1) state /= spec.world_size;
  if (r.distributed.sync == "ps") state = 0;
  const double model_bytes = static_cast<double>(*params) * 4.0 * (2.0 + state);
  // Every rank generates the whole synthetic set: f32 features, an int32 label and a 64-bit
  // index (its split's order) a sample.
  const double data_bytes =
      r.data.type == "synthetic-classification"
          ? static_cast<double>(r.data.samples) * (4.0 * static_cast<double>(r.model.input) + 12.0)
          : 0.0;
  const double per_rank = model_bytes + data_bytes;
  const double needed = per_rank * ranks;
  if (needed <= static_cast<double>(available)) return;
  const auto size = [](double bytes) { return human_size(static_cast<uint64_t>(bytes)); };
  if (data_bytes > model_bytes) {
    throw Error(ErrorKind::recipe,
                origin.place(fmt::format(
                    "/data/samples: its {} samples of {} features take {} a rank "
                    "(every rank generates the whole synthetic set, in f32), {} for the "
                    "{} rank(s) on this machine with the model's state ({} a rank), which "
                    "has {} available (MemAvailable): fewer samples, or fewer ranks here",
                    r.data.samples, r.model.input, size(data_bytes), size(needed), ranks,
                    size(model_bytes), size(static_cast<double>(available)))));
  }
  throw Error(
      ErrorKind::recipe,
      origin.place(fmt::format(
          "/model: its {} parameters take at least {} a rank (parameters, "
          "gradients and the {} state, in f32, before any activation), {} for "
          "the {} rank(s) on this machine{}, which has {} available (MemAvailable): "
          "a smaller model, or fewer ranks here",
          *params, size(model_bytes), r.optimizer.type == "adamw" ? "AdamW" : "SGD", size(needed),
          ranks,
          data_bytes > 0 ? fmt::format(" with their synthetic data ({} a rank)", size(data_bytes))
                         : std::string(),
          size(static_cast<double>(available)))));
}

namespace {

// `value` as a number in plain decimal (or exponent) notation, with a '+' if need be (strtod
// would also take leading blanks and hexadecimal: "0x10" seconds); a value too small for a
// double is 0. Else what is wrong with it, as a CLI11 check says it.
std::optional<double> plain_number(const std::string& value, std::string& wrong) {
  if (value.empty()) {
    wrong = "is empty; give a value";  // as every option says it
    return std::nullopt;
  }
  double v = 0;
  const char* begin = value.data() + (value.size() > 1 && value[0] == '+' ? 1 : 0);
  const char* end = value.data() + value.size();
  const auto [ptr, ec] = std::from_chars(begin, end, v);
  if (ptr != end || (*begin == '-' && begin != value.data()) ||
      (ec != std::errc() && ec != std::errc::result_out_of_range)) {
    wrong = "'" + value + "' is not a number";
    return std::nullopt;
  }
  if (ec == std::errc::result_out_of_range && std::isinf(std::strtod(begin, nullptr))) {
    wrong = "'" + value + "' is out of range";
    return std::nullopt;
  }
  return v;
}

}  // namespace

namespace {

// A CLI11 check for a finite number above 0 (`above`) or at least 0.
CLI::Validator finite_number(bool above) {
  return CLI::Validator(
      [above](std::string& value) -> std::string {
        std::string wrong;
        const auto v = plain_number(value, wrong);
        if (!v) return wrong;
        if (!std::isfinite(*v) || *v < 0 || (above && *v == 0)) {
          return "'" + value + "' must be a finite number " + (above ? "> 0" : ">= 0");
        }
        return {};
      },
      above ? "NUMBER>0" : "NUMBER>=0");
}

}  // namespace

const CLI::Validator& non_negative_number() {
  static const CLI::Validator check = finite_number(false);
  return check;
}

const CLI::Validator& positive_number() {
  static const CLI::Validator check = finite_number(true);
  return check;
}

CLI::Validator number_at_most(double most, const char* description, const char* unit) {
  return CLI::Validator(
      [most, unit](std::string& value) -> std::string {
        if (std::string wrong = non_negative_number()(value); !wrong.empty()) return wrong;
        if (std::strtod(value.c_str(), nullptr) > most) {
          return fmt::format("'{}' is more than {:g} ({})", value, most, unit);
        }
        return {};
      },
      description);
}

const CLI::Validator& seconds() {
  static const CLI::Validator check(
      [](std::string& value) -> std::string {
        if (std::string wrong = non_negative_number()(value); !wrong.empty()) return wrong;
        if (std::strtod(value.c_str(), nullptr) > kMaxSeconds) {
          return fmt::format("'{}' is more than {:.0f} seconds (about 11.6 days)", value,
                             kMaxSeconds);
        }
        return {};
      },
      "SECONDS");
  return check;
}

CLI::Validator seconds_at_least(double floor) {
  return CLI::Validator(
      [floor](std::string& value) -> std::string {
        std::string wrong;
        const auto v = plain_number(value, wrong);
        if (!v) return wrong;
        if (!std::isfinite(*v) || *v <= 0) return "'" + value + "' must be a number of seconds > 0";
        if (*v < floor) return fmt::format("'{}' must be at least {} seconds", value, floor);
        return seconds()(value);  // its upper bound
      },
      fmt::format("SECONDS>={}", floor));
}

const CLI::Validator& remote_path() {
  static const CLI::Validator check(
      [](std::string& value) -> std::string {
        if (!value.starts_with('~') || value == "~" || value.starts_with("~/")) return {};
        return fmt::format(
            "'{}': only ~ and ~/ (the login's home on each host) are expanded; "
            "give an absolute path or one under ~/",
            printable(value));
      },
      "PATH");
  return check;
}

const CLI::Validator& run_directory() {
  static const CLI::Validator check(
      [](std::string& value) -> std::string {
        return value.empty() ? "is empty; name a run directory" : "";
      },
      "RUN_DIR");
  return check;
}

void add_restart_options(CLI::App& app, RestartOptions& o) {
  app.add_option("--events", o.events,
                 "Write one JSON line per state change (generation, rendezvous, checkpoint, "
                 "rank exit, hang, restart, finish) to FILE, or '-' for stdout");
  app.add_option("--hang-timeout", o.hang_timeout_s,
                 "Seconds without progress on some rank before the job is stopped as hung, "
                 "naming the stuck rank and phase (0: off; default: the recipe's "
                 "fault_tolerance.hang_timeout_s)")
      ->check(seconds());
  app.add_option("--max-restarts", o.max_restarts,
                 "Restart after a rank or host failure from the newest valid checkpoint, at most "
                 "this many times per launch or resume, counted over all ranks and hosts "
                 "(default: the recipe's fault_tolerance.max_restarts, 0)")
      ->check(whole_number<int>(""));
  app.add_option("--rejoin-timeout", o.rejoin_timeout_s,
                 "Jobs on --hosts with --nnodes: seconds a host may take to answer at the start, "
                 "or again once lost, before the job continues without it (default: the "
                 "recipe's fault_tolerance.rejoin_timeout_s, 60)")
      ->check(seconds());
  app.add_option("--restart-backoff", o.backoff_s,
                 "Seconds before the first restart; doubled for each further one, at most 30 "
                 "(default: the recipe's fault_tolerance.restart_backoff_s, 1)")
      ->check(seconds());
}

namespace {

// "1234 samples/s" (or tokens/s) of a result; a result measured over no step has none.
std::string throughput_text(const nlohmann::json& r) {
  const bool tokens = r.contains("tokens_per_s");
  const nlohmann::json& v = r.value(tokens ? "tokens_per_s" : "samples_per_s", nlohmann::json());
  if (!v.is_number()) return "no step ran here to measure throughput";
  return fmt::format("{:.0f} {}/s", v.get<double>(), tokens ? "tokens" : "samples");
}

}  // namespace

int report_outcome(const RunDirectory& run, const JobOutcome& outcome, bool json,
                   std::FILE* summary) {
  if (!outcome.error.empty()) {
    std::istringstream lines(outcome.error);
    std::string line;
    bool first = true;
    while (std::getline(lines, line)) {
      std::fprintf(stderr, "%s%s\n", first ? "dptrain: error: " : "", line.c_str());
      first = false;
    }
    if (outcome.repeats) {  // a resume would meet the same error
      std::fprintf(stderr, "dptrain: run directory: %s\n", run.path().c_str());
    } else {
      // A deterministic failure, a checkpoint a resume cannot use (exit 5) or a host that refused
      // the connection would meet the resume as it is: first the fix.
      const bool fix_first =
          outcome.deterministic || outcome.exit_code == 5 || outcome.host_refused;
      std::fprintf(stderr, "dptrain: run directory: %s (%scontinue with %s)\n", run.path().c_str(),
                   fix_first ? "once the cause is fixed, " : "",
                   resume_command(run.path()).c_str());
    }
  }
  if (json) {
    nlohmann::json out = outcome.to_json(run);
    // "error" keeps the whole text (with its log excerpt); "errors" has its messages.
    if (!outcome.error.empty()) {
      add_failure(out, outcome.exit_code, outcome.error);
    } else if (outcome.exit_code == 0) {
      add_success(out);
    }
    std::printf("%s\n", json_text(out).c_str());
  } else if (outcome.exit_code == 0) {
    const auto& r = outcome.result;
    std::fprintf(summary, "run directory: %s\n", run.path().c_str());
    std::fprintf(summary, "%s\n",
                 fmt::format("{}  {}  ({} steps, {} rank(s))", format_losses(r), throughput_text(r),
                             r.value("steps", int64_t{0}), r.value("world_size", int64_t{0}))
                     .c_str());
  }
  std::fflush(stdout);
  return outcome.exit_code;
}

}  // namespace dptrain::cli
