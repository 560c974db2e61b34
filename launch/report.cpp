// A run directory read back for `dptrain status` and `dptrain report`, and the HTML report.
#include "launch/report.hpp"

#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <fstream>
#include <limits>
#include <optional>
#include <set>
#include <sstream>
#include <system_error>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/bench/comm_bench.hpp"
#include "core/checkpoint.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"
#include "core/recipe.hpp"
#include "launch/bench_train.hpp"
#include "launch/run_dir.hpp"
#include "launch/ssh.hpp"
#include "launch/status.hpp"
#include "launch/svg_chart.hpp"

namespace dptrain {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// A generation that recorded no pids yet is starting for this long at most.
constexpr int64_t kStartingGraceS = 60;
// Between a failed generation and the next one the launcher waits (backoff, at most 30 s), then
// places the next generation, waiting up to the rejoin timeout for lost hosts.
constexpr int64_t kMaxBackoffS = 30;
constexpr int64_t kPlacementMarginS = 60;

// j[key] when it is a whole number an int64 holds (exactly: not through a double); none when it
// is missing or anything else (run.json edited by hand: "forty", 1e300, -0.5).
std::optional<int64_t> integer_at(const json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end()) return std::nullopt;
  if (it->is_number_integer() && !it->is_number_unsigned()) return it->get<int64_t>();
  if (it->is_number_unsigned()) {
    const auto v = it->get<uint64_t>();
    if (v <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      return static_cast<int64_t>(v);
    return std::nullopt;
  }
  if (it->is_number_float()) {
    const double v = it->get<double>();
    if (std::isfinite(v) && v == std::floor(v) && std::abs(v) < 9.2e18)
      return static_cast<int64_t>(v);
  }
  return std::nullopt;
}

int64_t integer(const json& j, const char* key, int64_t otherwise) {
  return integer_at(j, key).value_or(otherwise);
}

// A count (a world size) as text; none where it is not an integer (JSON's null there).
std::optional<std::string> count_text(const json& j, const char* key) {
  const auto v = integer_at(j, key);
  if (!v) return std::nullopt;
  return std::to_string(*v);
}

json integer_or_null(const json& j, const char* key) {
  const auto v = integer_at(j, key);
  return v ? json(*v) : json(nullptr);
}

std::string text(const json& j, const char* key) {
  const auto it = j.find(key);
  if (it == j.end() || it->is_null()) return {};
  return it->is_string() ? it->get<std::string>() : it->dump();
}

const json& array_at(const json& j, const char* key) {
  static const json empty = json::array();
  const auto it = j.find(key);
  return it != j.end() && it->is_array() ? *it : empty;
}

// Seconds since a utc_timestamp() string; none when it does not parse.
std::optional<int64_t> age_s(const std::string& stamp) {
  return seconds_since(stamp);
}

// The arguments of live process `pid` on this machine; none when it is gone or a zombie.
std::optional<std::vector<std::string>> live_process_args(int64_t pid) {
  if (pid <= 0 || !process_alive(pid)) return std::nullopt;
  // Reaped between the two reads, its cmdline reads as an error (ESRCH): gone.
  std::string cmdline;
  try {
    cmdline = read_file(fmt::format("/proc/{}/cmdline", pid));
  } catch (const Error&) {
    return std::nullopt;
  }
  std::vector<std::string> args;
  std::istringstream in(cmdline);
  for (std::string arg; std::getline(in, arg, '\0');)
    args.push_back(arg);
  return args;
}

// A rank's command line: a worker, a relay, or a collective benchmark's rank ("bench comm
// --worker").
bool rank_args(const std::vector<std::string>& args) {
  if (args.size() < 2) return false;
  if (args[1] == "worker" || args[1] == "_relay") return true;
  return args.size() >= 4 && args[1] == "bench" && args[2] == "comm" && args[3] == "--worker";
}

// A live dptrain rank (rank_args), not a zombie and not another program that got the pid since.
bool rank_process_alive(int pid) {
  const auto args = live_process_args(pid);
  return args && rank_args(*args);
}

// The process run.json names as the launcher: on this machine, a live dptrain process (not a
// zombie, not a worker); on another, one that stamped the run within kAliveStaleS.
bool launcher_alive(const json& info) {
  if (!info.contains("launcher") || !info["launcher"].is_object()) return false;
  const json& launcher = info["launcher"];
  const std::string host = text(launcher, "host");
  if (!host.empty() && host != this_host()) {
    const auto alive = age_s(text(info, "alive_at"));
    // A stamp far in the future (clocks that disagree) tells nothing: not alive.
    return alive && *alive<kAliveStaleS&& * alive> - kAliveStaleS;
  }
  const auto args = live_process_args(integer(launcher, "pid", -1));
  return args && args->size() >= 2 &&
         fs::path((*args)[0]).filename().string().find("dptrain") != std::string::npos &&
         !rank_args(*args);
}

// A run whose launcher is between two generations: after a resize, or after a failure with a
// restart pending or recorded. Only while the launcher lives: otherwise what run.json recorded
// stands.
RunState between_generations(const json& info, const json& generations, RunState state) {
  // run.json written before launchers recorded themselves: the timing alone tells.
  const bool launcher_gone = info.contains("launcher") && !launcher_alive(info);
  const auto stale_resize = [&] {
    state.status = "stale";
    state.note = fmt::format(
        "generation {} stopped for hosts that answer again, but no generation followed it: the "
        "launcher is gone",
        generations.size());
  };
  if ((state.recorded_status == "failed" || state.recorded_status == "resized") && launcher_gone) {
    if (state.recorded_status == "failed") {
      state.note = "the launcher has exited: no generation follows";
    } else {
      stale_resize();
    }
    return state;
  }
  const json& restarts = array_at(info, "restarts");
  // In the back-off after a failure: the restart is recorded once the next generation is placed.
  if (state.recorded_status == "failed" && info.contains("pending_restart") &&
      integer(info["pending_restart"], "after_generation", -1) ==
          static_cast<int64_t>(generations.size())) {
    const auto since = age_s(text(info["pending_restart"], "at"));
    state.status = "restarting";
    state.note = fmt::format(
        "generation {} failed {} s ago; restart {} is waiting out its back-off, then generation "
        "{} is placed",
        generations.size(), since ? std::max<int64_t>(*since, 0) : 0, restarts.size() + 1,
        generations.size() + 1);
    return state;
  }
  const json last = generations.empty() ? json::object() : generations.back();
  // Between a generation stopped for hosts that answer again and the next one.
  if (state.recorded_status == "resized") {
    const auto since = age_s(text(last, "ended_at"));
    if (since && *since < kPlacementMarginS) {
      state.status = "resizing";
      state.note = fmt::format(
          "generation {} stopped at a checkpoint for hosts that answer "
          "again; generation {} is being placed",
          generations.size(), generations.size() + 1);
    } else {
      stale_resize();
    }
  }
  // Between a failed generation and the next one, run.json says failed and lists the restart.
  if (state.recorded_status == "failed" && !restarts.empty() &&
      integer(restarts.back(), "after_generation", -1) ==
          static_cast<int64_t>(generations.size())) {
    const json& restart = restarts.back();
    double rejoin_s = 60;
    if (info.contains("recipe") && info["recipe"].contains("fault_tolerance")) {
      const double recorded = json_number(info["recipe"]["fault_tolerance"], "rejoin_timeout_s");
      if (std::isfinite(recorded)) rejoin_s = recorded;
    }
    const auto since = age_s(text(restart, "at"));
    const int64_t restart_number = integer(restart, "restart", 0);
    if (since && *since < kMaxBackoffS + static_cast<int64_t>(rejoin_s) + kPlacementMarginS) {
      state.status = "restarting";
      state.note = fmt::format("restart {} recorded {} s ago; generation {} is being placed",
                               restart_number, *since, generations.size() + 1);
    } else {
      state.note = fmt::format(
          "restart {} was recorded but no generation followed it: its hosts could not be "
          "placed, or the launcher is gone",
          restart_number);
    }
  }
  return state;
}

}  // namespace

RunState run_state(const json& info, const fs::path& dir) {
  RunState state;
  state.recorded_status = text(info, "status");
  state.status = state.recorded_status;
  // What launchers write; anything else (an edited or foreign run.json) is not echoed as if it
  // were a status.
  static const std::set<std::string> recorded = {"running",     "completed",  "failed",
                                                 "interrupted", "terminated", "resized"};
  if (const auto it = info.find("status");
      it == info.end() || !it->is_string() || recorded.count(state.recorded_status) == 0) {
    state.status = "unknown";
    state.note = it == info.end() ? "run.json records no status"
                                  : fmt::format("run.json's status is {}, not one dptrain records",
                                                printable_excerpt(it->dump()));
    return state;
  }
  const json& generations = array_at(info, "generations");
  const json last = generations.empty() ? json::object() : generations.back();
  // Launched on another machine (seen over a shared filesystem): its processes are not this
  // machine's to check, but its launcher renews "alive_at" while it runs.
  const std::string launcher_host =
      info.contains("launcher") ? text(info["launcher"], "host") : std::string();
  if (!launcher_host.empty() && launcher_host != this_host()) {
    if (state.recorded_status == "running") {
      const auto alive = age_s(text(info, "alive_at"));
      if (alive && *alive <= -kAliveStaleS) {
        // Neither running nor stale, and no hint to resume it: its launcher may well live.
        state.status = "unknown";
        state.note = fmt::format(
            "launched on {}, whose stamp is {} s in the future: its clock and this machine's "
            "disagree, so whether its launcher lives cannot be told from here",
            launcher_host, -*alive);
      } else if (alive && *alive < kAliveStaleS) {
        state.note = fmt::format("launched on {}, which stamped the run {} s ago", launcher_host,
                                 std::max<int64_t>(*alive, 0));
      } else if (alive) {
        state.status = "stale";
        state.note = fmt::format(
            "launched on {}, which has not stamped the run for {} s (over {} s): the launcher is "
            "gone",
            launcher_host, *alive, kAliveStaleS);
      } else {
        state.status = "stale";
        state.note = fmt::format(
            "launched on {}, but run.json has no readable stamp of its launcher (alive_at), which "
            "a live one renews every {} s: the launcher is gone",
            launcher_host, kAliveEveryS);
      }
    }
    return between_generations(info, generations, std::move(state));
  }
  // Hand-started workers record rank 0's pid: only its own machine can check it.
  if (started_by_workers(info) && state.recorded_status == "running") {
    const json& hosts = array_at(last, "hosts");
    const std::string rank0_host =
        hosts.empty() || !hosts[0].is_string() ? std::string() : hosts[0].get<std::string>();
    if (!rank0_host.empty() && rank0_host != this_host()) {
      state.note = fmt::format(
          "its rank 0 runs on {} (workers started without a launcher): whether it lives cannot "
          "be checked from here",
          rank0_host);
      return state;
    }
  }
  for (const auto& pid : array_at(last, "pids")) {
    if (pid.is_number_integer() && rank_process_alive(pid.get<int>())) {
      state.live_pids.push_back(pid.get<int>());
    }
  }
  if (state.recorded_status == "running" && state.live_pids.empty()) {
    const auto started = age_s(text(last, "started_at"));
    // Until its ranks are recorded, a generation is starting while its launcher lives (which
    // also keeps a job whose run.json could not take the pids running); one recorded before
    // launchers recorded themselves, for a while.
    const bool recorded_launcher = !started_by_workers(info) && info.contains("launcher");
    // So is a job whose launcher is placing its first generation (waiting for its hosts): the
    // last generation is an earlier invocation's.
    const bool placing = recorded_launcher && info.contains("placing");
    const bool starting =
        (placing || !last.contains("pids")) &&
        (recorded_launcher ? launcher_alive(info) : started && *started < kStartingGraceS);
    if (starting) {
      // Its ranks are not recorded yet, or the launcher waits for its hosts: as recorded.
    } else if (recorded_launcher && launcher_alive(info) && run_locked_by_another(dir)) {
      // The ranks have exited and the launcher, alive and holding the run's lock, is recording
      // how the generation ended (completed, failed, restarting): running until it says. (The
      // lock tells the run's launcher from a process that only took its pid.)
      state.note = fmt::format(
          "no rank of generation {} is alive; its launcher is recording how "
          "the generation ended",
          generations.size());
    } else {
      state.status = "stale";
      state.note = (started_by_workers(info) ? "its rank 0 is gone" : "the launcher is gone") +
                   std::string(": no rank of generation ") + std::to_string(generations.size()) +
                   " is alive";
    }
  }
  return between_generations(info, generations, std::move(state));
}

namespace {

// The step reached: the last logged, or further where the generation that ended last got beyond
// it (a failure between two log steps), as the launcher's --json says, or where a checkpoint the
// run holds is (a launcher killed before it recorded how far its ranks got, checkpointing more
// often than they log). Null when none is known.
json step_reached(const RunView& run) {
  json step = run.metrics.steps.empty() ? json(nullptr) : json(run.metrics.steps.back().step);
  if (const json& gens = array_at(run.info, "generations"); !gens.empty()) {
    // A benchmark's generation records -1: it has no steps.
    if (const json& reached = gens.back().value("step", json());
        reached.is_number_integer() && reached.get<int64_t>() >= 0) {
      if (step.is_null() || reached.get<int64_t>() > step.get<int64_t>()) step = reached;
    }
  }
  for (const auto& c : run.checkpoints) {
    if (!c.set_aside && !c.foreign && c.problems.empty() &&
        (step.is_null() || c.step > step.get<int64_t>())) {
      step = c.step;
    }
  }
  return step;
}

// The JSON object in `file`; null when it is missing, and also when it is damaged, which
// `damaged` then says why ("FILE: not valid JSON at line 1, column 9: ...").
json read_json_object(const fs::path& file, std::string& damaged) {
  std::error_code ec;
  if (!fs::exists(file, ec)) return nullptr;
  std::string text;
  try {
    text = read_file(file);
    json j = parse_json(text);
    if (j.is_object()) return j;
    damaged = file.string() + ": not a JSON object";
  } catch (const json::exception& e) {
    damaged = json_parse_problem(file.string(), text, e);
  } catch (const Error& e) {
    damaged = first_line(e.what());
  }
  return nullptr;
}

std::vector<CheckpointSummary> summarize_checkpoints(const fs::path& checkpoints_dir, bool verify,
                                                     const std::function<bool()>& stopped) {
  std::vector<CheckpointSummary> out;
  std::error_code ec;
  if (!fs::is_directory(checkpoints_dir, ec)) return out;
  fs::path latest;
  try {
    latest = latest_checkpoint(checkpoints_dir);
  } catch (const Error&) {
  }
  for (const auto& dir : list_checkpoints(checkpoints_dir, SetAside::include)) {
    if (stopped && stopped()) break;
    CheckpointSummary c;
    c.name = dir.filename().string();
    c.step = checkpoint_step(dir);
    c.latest = !latest.empty() && dir == latest;
    c.set_aside = c.name.find(".corrupt") != std::string::npos;
    c.bytes = size_on_disk(dir);
    if (verify) {
      const CheckpointStatus status = verify_checkpoint(dir);
      if (status.gone) continue;  // pruned by the run meanwhile
      c.verified = true;
      c.step = status.step;
      c.problems = status.problems();
      c.denied = status.denied();
      if (status.position) {
        c.epoch = status.position->epoch;
        c.world_size = status.position->world_size;
      }
    } else if (std::string problem; const auto position = checkpoint_position(dir, &problem)) {
      // Unverified, its meta.json still says what it is (cheap): one that does not read (an
      // empty directory, a copy under another step's name) is no checkpoint a resume uses.
      c.epoch = position->epoch;
      c.world_size = position->world_size;
    } else {
      std::error_code gone;
      if (!fs::exists(dir, gone)) continue;  // pruned by the run meanwhile
      c.problems.push_back(problem);
      c.denied =
          ::access((dir / "meta.json").c_str(), R_OK) != 0 && (errno == EACCES || errno == EPERM);
    }
    out.push_back(std::move(c));
  }
  return out;
}

// The step a generation resumed at: its "resumed_from" (step-000100, "step 0"), else what the
// restart before it says; none when neither tells.
std::optional<int64_t> resumed_step(const json& info, int64_t generation) {
  const json& generations = array_at(info, "generations");
  std::vector<std::string> candidates;
  if (generation >= 1 && generation <= static_cast<int64_t>(generations.size())) {
    candidates.push_back(text(generations[generation - 1], "resumed_from"));
  }
  for (const auto& r : array_at(info, "restarts")) {
    if (integer(r, "after_generation", -1) == generation - 1) candidates.push_back(text(r, "from"));
  }
  if (generation == 1) candidates.push_back("step 0");
  for (const auto& c : candidates) {
    if (c == "step 0") return 0;
    const int64_t step = checkpoint_step(c);
    if (step >= 0) return step;
  }
  return std::nullopt;
}

std::vector<ChartMarker> timeline_markers(const json& info) {
  std::vector<ChartMarker> markers;
  for (const auto& r : array_at(info, "restarts")) {
    const int64_t step = integer(r, "failed_after_step", -1);
    if (step < 0) continue;
    markers.push_back({static_cast<double>(step),
                       fmt::format("restart {} after step {}", integer(r, "restart", 0), step),
                       "#d62728"});
  }
  for (const auto& c : array_at(info, "world_size_changes")) {
    const auto step = resumed_step(info, integer(c, "generation", -1));
    if (!step) continue;
    markers.push_back(
        {static_cast<double>(*step),
         fmt::format("world size {}\u2192{}", integer(c, "from", 0), integer(c, "to", 0)),
         "#9467bd"});
  }
  // Labels stay short: the causes are in the timeline's tables.
  return markers;
}

std::string html(const std::string& s) {
  return xml_escape(s);
}

std::string num(double v, int significant = 4) {
  if (!std::isfinite(v)) return "-";
  if (std::fabs(v) >= 1e5) return fmt::format("{:.0f}", v);
  return fmt::format("{:.{}g}", v, significant);
}

std::string loss_num(double v) {
  return std::isfinite(v) ? loss_text(v) : num(v);
}

std::string rate(double v) {
  if (!std::isfinite(v)) return "-";
  return v >= 100 ? fmt::format("{:.0f}", v) : fmt::format("{:.3g}", v);
}

std::string model_summary(const json& model) {
  const std::string type = text(model, "type");
  if (type == "mlp") {
    std::string layers = text(model, "input");
    for (const auto& h : array_at(model, "hidden"))
      layers += "-" + h.dump();
    return fmt::format("mlp {}-{}, {}", layers, text(model, "classes"), text(model, "activation"));
  }
  if (type == "gpt") {
    return fmt::format("gpt: {} layers, {} heads, width {}, context {}, vocab {}",
                       text(model, "layers"), text(model, "heads"), text(model, "width"),
                       text(model, "context"), text(model, "vocab"));
  }
  return type.empty() ? "-" : type;
}

// How the ranks train together, from the recipe's levers: "all-reduce of 25 MiB buckets,
// overlapped; ZeRO-1; gradients compressed topk (ratio 0.01); bf16; 2 micro-batches a step".
std::string training_summary(const json& recipe) {
  const json& d = recipe.value("distributed", json::object());
  const json& t = recipe.value("train", json::object());
  const std::string sync = text(d, "sync").empty() ? "allreduce" : text(d, "sync");
  std::vector<std::string> parts;
  if (sync == "local_sgd") {
    std::string part = fmt::format("local SGD, averaging every {} steps", text(d, "period"));
    if (integer(d, "start", 0) > 0) part += fmt::format(" after {} synchronous", text(d, "start"));
    parts.push_back(part);
  } else if (sync == "ps") {
    parts.push_back(fmt::format("parameter servers: {}, staleness {}", text(d, "servers"),
                                text(d, "staleness").empty() ? "0" : text(d, "staleness")));
  } else if (integer(d, "zero", 0) == 1) {
    // (On NCCL a reduce-scatter after the backward pass, on Gloo the bucketed all-reduce.)
    parts.push_back("ZeRO-1 (sharded optimizer state)");
  } else {
    const double mib = json_number(d, "bucket_mb");
    parts.push_back(fmt::format("all-reduce{}{}",
                                std::isfinite(mib) ? fmt::format(" of {:g} MiB buckets", mib) : "",
                                d.value("overlap", true) == true ? ", overlapped" : ""));
  }
  const json& c = d.value("compression", json::object());
  if (const std::string type = text(c, "type"); !type.empty() && type != "none") {
    std::string part = "gradients compressed " + type;
    if (c.contains("ratio")) part += fmt::format(" (ratio {:g})", json_number(c, "ratio"));
    if (!text(c, "rank").empty()) part += " (rank " + text(c, "rank") + ")";
    parts.push_back(part);
  }
  if (const std::string precision = text(t, "precision"); !precision.empty()) {
    parts.push_back(precision);
  }
  if (integer(t, "grad_accum", 1) > 1) {
    parts.push_back(fmt::format("{} micro-batches a step", text(t, "grad_accum")));
  }
  return fmt::format("{}", fmt::join(parts, "; "));
}

// "2 -> 1 -> 2": the world size of each generation, repeats folded (ASCII: a terminal in the C
// locale shows it too).
std::string world_sizes(const json& info) {
  std::vector<int64_t> sizes;
  for (const auto& g : array_at(info, "generations")) {
    const int64_t w = integer(g, "world_size", -1);
    if (w > 0 && (sizes.empty() || sizes.back() != w)) sizes.push_back(w);
  }
  if (sizes.empty()) return count_text(info, "world_size").value_or("unknown");
  return fmt::format("{}", fmt::join(sizes, " -> "));
}

// The job's size as its flag gave it ("--nnodes 1:2", "--nproc 2:3"); empty when none was
// recorded (a fixed local world).
std::string job_size_flag(const json& info) {
  const json size = info.value("job_size", json());
  if (!size.is_object()) return {};
  const int64_t least = integer(size, "min", 0), most = integer(size, "max", 0);
  if (least <= 0 || most <= 0) return {};
  return fmt::format("{} {}", text(size, "of") == "hosts" ? "--nnodes" : "--nproc",
                     least == most ? std::to_string(least) : fmt::format("{}:{}", least, most));
}

// "1 (nominal 2; per generation: 2 -> 1; --nproc 1:2)", the parts that say something.
std::string world_size_text(const json& info) {
  const std::string current = count_text(info, "world_size").value_or("");
  const std::string size = job_size_flag(info);
  if (current.empty()) {
    // Waiting for its first hosts.
    return size.empty() ? "unknown" : fmt::format("not placed yet ({})", size);
  }
  std::string out = current;
  const std::string nominal = count_text(info, "nominal_world_size").value_or("");
  std::vector<std::string> notes;
  if (!nominal.empty() && nominal != current) notes.push_back("nominal " + nominal);
  const std::string sizes = world_sizes(info);
  if (sizes != current) notes.push_back("per generation: " + sizes);
  if (!size.empty()) notes.push_back(size);
  if (!notes.empty()) out += fmt::format(" ({})", fmt::join(notes, "; "));
  return out;
}

// The backend as asked ("auto", kept for a resume) and as the ranks of the latest generation that
// met used it: "gloo (auto)"; the one asked for alone where they agree or none met yet.
std::string backend_text(const json& info, const json& generations) {
  const std::string asked = text(info, "backend");
  for (auto g = generations.rbegin(); g != generations.rend(); ++g) {
    const std::string used = text(*g, "backend");
    if (used.empty()) continue;
    return used == asked || asked.empty() ? used : fmt::format("{} ({})", used, asked);
  }
  return asked;
}

// The checkpoint a resume continues from, as the launcher names it: the newest that is not set
// aside nor another recipe's (and verifies, where verification ran). `latest` can lag behind it (a
// rank stopped between a checkpoint's commit and `latest`'s update), and resume does not follow it
// then.
std::string last_checkpoint_name(const RunView& run) {
  for (const auto& c : run.checkpoints) {
    if (!c.set_aside && !c.foreign && c.problems.empty()) return c.name;
  }
  return {};
}

// The rank logs an error names, where the run lies now: a run moved or copied since names its own
// logs/, not those of the directory it ran in (gone, or another run's). A log's path follows one
// of the launcher's leads and ends in ".log".
std::string logs_where_run_lies(std::string error, const fs::path& dir) {
  for (const std::string_view lead : {"(log: ", "; log: ", "(full log: "}) {
    for (size_t at = error.find(lead); at != std::string::npos; at = error.find(lead, at + 1)) {
      const size_t start = at + lead.size();
      // The ".log" the path ends with, at the end of the text or a line or before the lead's
      // ')': not one inside a directory's name (runs/x.log-2026...).
      size_t end = error.find(".log", start);
      while (end != std::string::npos && end + 4 < error.size() && error[end + 4] != ')' &&
             error[end + 4] != '\n') {
        end = error.find(".log", end + 1);
      }
      if (end == std::string::npos) break;
      const fs::path named = error.substr(start, end + 4 - start);
      const fs::path here = dir / "logs" / named.filename();
      std::error_code ec;
      if (named.parent_path().filename() != "logs" || named == here || !fs::exists(here, ec)) {
        continue;
      }
      error.replace(start, end + 4 - start, here.string());
    }
  }
  return error;
}

// The error the run ended with: the run's own, or the newest generation's once it has ended (an
// older generation's is history: the newest one may be running, or its launcher gone).
std::string run_error(const RunView& run) {
  const json& info = run.info;
  // How the run ended after its last generation (too few hosts left, stopped between two).
  if (const std::string error = text(info, "error"); !error.empty()) {
    return logs_where_run_lies(error, run.dir);
  }
  const json& generations = array_at(info, "generations");
  if (generations.empty() || !generations.back().contains("ended_at")) return {};
  return logs_where_run_lies(text(generations.back(), "error"), run.dir);
}

// The median of the finite values (of an even count, the mean of the two middle ones, as bench
// train takes it); kNoValue when none is.
double finite_median(std::vector<double> values) {
  values.erase(
      std::remove_if(values.begin(), values.end(), [](double v) { return !std::isfinite(v); }),
      values.end());
  return values.empty() ? kNoValue : median(std::move(values));
}

struct Throughput {
  double value = kNoValue;
  std::string unit;
};

// result.json's figure when the run finished, else the median of the logged ones.
Throughput throughput(const RunView& run) {
  // A token model's rate is in tokens/s also before any is logged (a run that diverged, or was
  // stopped, before its first log line).
  // (Whatever a hand-edited run.json holds there.)
  const nlohmann::json::json_pointer type("/recipe/model/type");
  const bool token_model = run.info.contains(type) && run.info.at(type) == "gpt";
  const bool tokens = token_model || run.metrics.has_tokens() ||
                      (run.result.is_object() && run.result.contains("tokens_per_s"));
  Throughput t{kNoValue, tokens ? "tokens/s" : "samples/s"};
  const char* key = tokens ? "tokens_per_s" : "samples_per_s";
  if (run.result.is_object()) t.value = json_number(run.result, key);
  if (!std::isfinite(t.value)) {
    std::vector<double> logged;
    for (const auto& s : run.metrics.steps)
      logged.push_back(tokens ? s.tokens_per_s : s.samples_per_s);
    t.value = finite_median(logged);
  }
  return t;
}

const EvalMetrics* last_eval(const RunView& run) {
  return run.metrics.evals.empty() ? nullptr : &run.metrics.evals.back();
}

json or_null(double v) {
  return std::isfinite(v) ? json(v) : json(nullptr);
}

json or_null(const std::string& s) {
  return s.empty() ? json(nullptr) : json(s);
}

// The checkpoint run.json records committed in this run directory (rank 0 here) when the run's
// checkpoints/ does not hold it as a usable one (removed, or out of reach): a resume refuses
// then. Empty otherwise.
std::string recorded_but_absent(const RunView& run) {
  const std::string recorded = recorded_local_checkpoint(run.info);
  if (recorded.empty()) return {};
  // Any live one, damaged too, is a resume's to handle (it falls back to an older one); set-aside
  // ones are not (the resume's own rule: require_recorded_checkpoint).
  if (!run.checkpoints_unread &&
      std::any_of(run.checkpoints.begin(), run.checkpoints.end(),
                  [](const CheckpointSummary& c) { return !c.set_aside; })) {
    return {};
  }
  return recorded;
}

}  // namespace

std::string status_hint(const RunView& run) {
  if (run.state.status == "stale" || run.state.status == "failed" ||
      run.state.status == "interrupted" || run.state.status == "terminated") {
    // A benchmark's ranks train nothing: there is nothing to resume, only to run again.
    if (!run.info.contains("recipe") || run.info.contains("bench")) {
      return "a benchmark's run: run the benchmark again";
    }
    const json generations = run.info.value("generations", json::array());
    const json last =
        generations.is_array() && !generations.empty() && generations.back().is_object()
            ? generations.back()
            : json::object();
    const bool hand = started_by_workers(run.info);
    if (run.state.status == "failed" && last.value("would_repeat", json()) == true) {
      return fmt::format(
          "a resume would meet its error again (the recipe, its data or a setting: see the "
          "error); fix that first: data or a setting, then {}; a changed recipe, {} into a new "
          "run directory",
          hand ? fmt::format("start the workers again with '{}'", hand_resume_flag(run.dir))
               : "resume",
          hand ? "started" : "launched");
    }
    if (hand) {
      return fmt::format(
          "its workers were started without a launcher: start them again with '{}' to continue "
          "it",
          hand_resume_flag(run.dir));
    }
    if (run.state.status == "failed") {
      // The last attempt could not reach a host: that, not an earlier row of failures.
      if (last.value("host_unreachable", json()) == true) {
        return "a host could not be reached (the error says which): once it answers, continue "
               "it with " +
               resume_command(run.dir);
      }
      if (const RepeatedFailure repeated = repeated_failure(run.info);
          repeated.times >= kSameStepLimit) {
        return fmt::format(
            "it failed {} times in a row at step {}: once the cause is fixed (see the error), "
            "continue it with {}",
            repeated.times, repeated.step, resume_command(run.dir));
      }
      // What a resume would meet again unless it is fixed first: a host that refused the SSH
      // connection, or checkpoints that could not be used or written.
      if (last.value("host_refused", json()) == true) {
        return "a host refused the SSH connection or cannot run dptrain (the error says which "
               "and why): once that is fixed, continue it with " +
               resume_command(run.dir);
      }
      if (last.value("exit_code", json()) == 5) {
        return fmt::format(
            "a checkpoint problem (see the error; 'dptrain ckpt verify {} --all' checks every "
            "checkpoint): once it is fixed, continue it with {}",
            shell_quote(run.dir.string()), resume_command(run.dir));
      }
    }
    if (const std::string absent = recorded_but_absent(run); !absent.empty()) {
      return fmt::format(
          "run.json records {} committed in {}, which {}: a resume refuses until it is back; "
          "then continue it with {}",
          absent, (run.dir / "checkpoints").string(),
          run.checkpoints_unread ? "cannot be read" : "holds no checkpoint",
          resume_command(run.dir));
    }
    return "continue it with " + resume_command(run.dir);
  }
  return {};
}

namespace {

// ---- the HTML report ----

constexpr const char* kStyle = R"(
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;margin:0 auto;
  max-width:1180px;padding:16px 24px 48px;line-height:1.4}
h1{font-size:22px;margin:8px 0 2px}h3{font-size:15px;margin:16px 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd;
  padding-bottom:4px}
.sub{color:#666;font-size:13px}
.badge{display:inline-block;padding:1px 9px;border-radius:10px;font-size:13px;font-weight:600;
  vertical-align:middle;background:#eee;color:#333}
.badge.completed{background:#e3f4e1;color:#1b5e20}.badge.failed,.badge.stale{background:#fde3e1;
  color:#a31515}.badge.running,.badge.restarting{background:#e2edfc;color:#0d47a1}
.badge.interrupted,.badge.terminated{background:#fff2cc;color:#6b4f00}
table{border-collapse:collapse;font-size:13px;margin:4px 0 8px}
th,td{padding:3px 10px;border-bottom:1px solid #eee;text-align:left;vertical-align:top}
thead th{background:#f5f5f5;border-bottom:1px solid #ddd}
table.facts th{font-weight:600;color:#555;background:none;width:190px}
td.num{text-align:right;font-variant-numeric:tabular-nums}
.charts{display:flex;flex-wrap:wrap;gap:14px}
figure{margin:0;border:1px solid #e3e3e3;border-radius:6px;padding:4px;background:#fff}
figure svg{display:block;max-width:100%;height:auto}
.ok{color:#1b5e20}.bad{color:#a31515;font-weight:600}
.note{color:#666;font-size:13px}
pre{background:#f7f7f7;border:1px solid #e5e5e5;padding:8px;font-size:12px;overflow-x:auto;
  white-space:pre-wrap}
pre.error{background:#fff5f5;border-color:#f0c4c4}
details summary{cursor:pointer;color:#444}
)";

std::string fact(const std::string& name, const std::string& value_html) {
  return fmt::format("<tr><th>{}</th><td>{}</td></tr>\n", html(name), value_html);
}

// The run's facts; a collective benchmark's (`bench`, comm_benchmark's, not null) without the
// training rows, as its ranks train nothing (its figures are in the Benchmark section).
std::string facts_table(const RunView& run, const json& bench) {
  const json& info = run.info;
  const json recipe = info.value("recipe", json::object());
  const json& generations = array_at(info, "generations");
  const bool trains = bench.is_null();
  std::string rows;
  rows += fact("Run directory", "<code>" + html(run.dir.string()) + "</code>");
  rows += trains ? fact("Recipe", html(text(recipe, "name"))) : fact("Benchmark", "bench comm");
  if (recipe.contains("model")) rows += fact("Model", html(model_summary(recipe["model"])));
  if (recipe.contains("data")) {
    const json& data = recipe["data"];
    std::string d = text(data, "type");
    if (!text(data, "path").empty()) d += " " + text(data, "path");
    rows += fact("Data", html(d));
  }
  std::string status = fmt::format("<span class=\"badge {0}\">{0}</span>", html(run.state.status));
  if (!run.state.note.empty())
    status += " <span class=\"note\">" + html(run.state.note) + "</span>";
  rows += fact("Status", status);
  const int64_t target = recipe.contains("train") ? integer(recipe["train"], "steps", -1) : -1;
  // The step reached, as status and the summary say it (further than the last logged one where
  // the run failed or checkpointed between two log steps).
  const json reached = step_reached(run);
  const std::string last_step = reached.is_null() ? "none logged yet" : reached.dump();
  if (trains) {
    rows +=
        fact("Steps", html(target > 0 ? fmt::format("{} of {}", last_step, target) : last_step));
  }
  rows += fact("World size", html(world_size_text(info)));
  if (const std::string backend = backend_text(info, generations); !backend.empty())
    rows += fact("Backend", html(backend));
  if (recipe.contains("distributed") || recipe.contains("train")) {
    rows += fact("Training", html(training_summary(recipe)));
  }
  std::vector<std::string> hosts;
  for (const auto& h : array_at(info, "hosts"))
    hosts.push_back(fmt::format("{} ({} slots)", text(h, "host"), text(h, "slots")));
  if (!hosts.empty()) rows += fact("Hosts", html(fmt::format("{}", fmt::join(hosts, ", "))));
  rows += fact("Generations", std::to_string(generations.size()));
  rows += fact("Restarts", std::to_string(array_at(info, "restarts").size()));
  rows += fact("Created", html(text(info, "created_at")));
  if (!generations.empty() && generations.back().contains("ended_at")) {
    rows += fact("Ended", html(text(generations.back(), "ended_at")));
  }
  if (!text(info, "id").empty()) rows += fact("Run id", html(text(info, "id")));
  if (trains && run.result.is_object()) {
    const json& r = run.result;
    rows += fact("Final loss", loss_num(json_number(r, "final_loss")));
    rows += fact("Eval loss", loss_num(json_number(r, "eval_loss")));
    if (std::isfinite(json_number(r, "eval_accuracy"))) {
      rows += fact("Eval accuracy", fmt::format("{:.2f}%", 100 * json_number(r, "eval_accuracy")));
    }
    rows += fact("Throughput",
                 html(fmt::format("{} samples/s", rate(json_number(r, "samples_per_s")))) +
                     (r.contains("tokens_per_s")
                          ? html(fmt::format(", {} tokens/s", rate(json_number(r, "tokens_per_s"))))
                          : ""));
    // No split where the run timed none of its steps (all of them warm-up): no row of dashes.
    const json& p = r.value("phases_ms", json());
    if (p.is_object() && std::any_of(p.begin(), p.end(), [](const json& v) {
          return v.is_number() && std::isfinite(v.get<double>());
        })) {
      rows += fact(
          "Step time split",
          html(fmt::format("data {} ms, compute {} ms, comm {} ms, optimizer {} ms",
                           num(json_number(p, "data"), 3), num(json_number(p, "compute"), 3),
                           num(json_number(p, "comm"), 3), num(json_number(p, "optimizer"), 3))));
    }
    if (std::isfinite(json_number(r, "peak_rss_mib"))) {
      // The trainer's figure is the largest of any rank's (reduced with max over the ranks).
      rows +=
          fact("Peak memory (largest rank)", html(num(json_number(r, "peak_rss_mib")) + " MiB"));
    }
    if (!text(r, "params_checksum").empty()) {
      rows += fact("Parameters checksum", "<code>" + html(text(r, "params_checksum")) + "</code>");
    }
  }
  return "<table class=\"facts\">\n" + rows + "</table>\n";
}

ChartSeries series(std::string name, std::vector<std::pair<double, double>> points,
                   std::string color = {}) {
  ChartSeries s;
  s.name = std::move(name);
  s.points = std::move(points);
  s.color = std::move(color);
  return s;
}

template <typename Row, typename Field>
std::vector<std::pair<double, double>> points_of(const std::vector<Row>& rows, Field field) {
  std::vector<std::pair<double, double>> out;
  for (const auto& r : rows) {
    const double v = field(r);
    if (std::isfinite(v)) out.emplace_back(static_cast<double>(r.step), v);
  }
  return out;
}

std::string figure(const std::vector<ChartSeries>& s, const ChartOptions& o) {
  return "<figure>" + svg_line_chart(s, o) + "</figure>\n";
}

std::string charts(const RunView& run) {
  const RunMetrics& m = run.metrics;
  ChartOptions base;
  base.x_label = "step";
  base.width = 560;
  base.height = 300;
  base.markers = timeline_markers(run.info);
  std::string out = "<div class=\"charts\">\n";

  auto train_loss = points_of(m.steps, [](const StepMetrics& s) { return s.loss; });
  auto eval_loss = points_of(m.evals, [](const EvalMetrics& e) { return e.loss; });
  ChartOptions loss = base;
  loss.title = "Loss";
  loss.y_label = "loss";
  double lo = std::numeric_limits<double>::infinity(), hi = 0;
  for (const auto* points : {&train_loss, &eval_loss}) {
    for (const auto& [x, y] : *points) {
      if (y > 0) lo = std::min(lo, y);
      hi = std::max(hi, y);
    }
  }
  loss.log_y = lo > 0 && hi / lo > 30;  // losses spanning decades read better on a log axis
  ChartSeries validation = series("validation loss", eval_loss, "#ff7f0e");
  validation.markers = true;
  out += figure({series("training loss", train_loss, "#1f77b4"), validation}, loss);

  ChartOptions lr = base;
  lr.title = "Learning rate";
  lr.y_label = "lr";
  out += figure({series("learning rate",
                        points_of(m.steps, [](const StepMetrics& s) { return s.lr; }), "#2ca02c")},
                lr);

  ChartOptions tput = base;
  const bool tokens = m.has_tokens();
  tput.title = tokens ? "Throughput (tokens/s)" : "Throughput (samples/s)";
  tput.y_label = tokens ? "tokens/s" : "samples/s";
  out += figure({series(tput.y_label,
                        points_of(m.steps,
                                  [tokens](const StepMetrics& s) {
                                    return tokens ? s.tokens_per_s : s.samples_per_s;
                                  }),
                        "#8c564b")},
                tput);

  if (m.has_phases()) {
    ChartOptions split = base;
    split.title = "Step time split";
    split.y_label = "ms per step";
    ChartSeries total =
        series("step", points_of(m.steps, [](const StepMetrics& s) { return s.step_ms; }), "#444");
    total.dashed = true;
    out += figure(
        {total,
         series("data", points_of(m.steps, [](const StepMetrics& s) { return s.data_ms; }),
                "#17becf"),
         series("compute", points_of(m.steps, [](const StepMetrics& s) { return s.compute_ms; }),
                "#1f77b4"),
         series("comm", points_of(m.steps, [](const StepMetrics& s) { return s.comm_ms; }),
                "#d62728"),
         series("optimizer",
                points_of(m.steps, [](const StepMetrics& s) { return s.optimizer_ms; }),
                "#e377c2")},
        split);
  }

  ChartOptions norm = base;
  norm.title = "Gradient norm";
  norm.y_label = "norm (before clipping)";
  out += figure(
      {series("gradient norm", points_of(m.steps, [](const StepMetrics& s) { return s.grad_norm; }),
              "#9467bd")},
      norm);

  const auto accuracy = points_of(m.evals, [](const EvalMetrics& e) { return e.accuracy; });
  if (!accuracy.empty()) {
    ChartOptions acc = base;
    acc.title = "Validation accuracy";
    acc.y_label = "accuracy";
    ChartSeries a = series("validation accuracy", accuracy, "#ff7f0e");
    a.markers = true;
    out += figure({a}, acc);
  }
  return out + "</div>\n";
}

// Where a generation began: its checkpoint, "start", or "-" where its ranks never met (one that
// failed as it started: a --resume that does not fit, a rank that did not come).
std::string resumed_from_text(const json& generation) {
  if (const std::string from = text(generation, "resumed_from"); !from.empty()) return from;
  // (A record from before met_at was kept has the backend of ranks that met.)
  const bool never_met = generation.contains("ended_at") && !generation.contains("met_at") &&
                         !generation.contains("backend") &&
                         text(generation, "status") != "completed";
  return never_met ? "-" : "start";
}

std::string generations_table(const RunView& run) {
  const json& info = run.info;
  const json& generations = array_at(info, "generations");
  if (generations.empty()) return "<p class=\"note\">No generation started.</p>\n";
  std::string rows;
  for (const auto& g : generations) {
    const std::string error = logs_where_run_lies(text(g, "error"), run.dir);
    const std::string status = text(g, "status").empty() ? "running" : text(g, "status");
    std::vector<std::string> hosts;
    for (const auto& h : array_at(g, "hosts"))
      hosts.push_back(h.is_string() ? h.get<std::string>() : h.dump());
    rows += fmt::format(
        "<tr><td class=\"num\">{}</td><td>{}</td><td>{}</td><td class=\"num\">{}</td><td>{}</td>"
        "<td>{}</td><td>{}</td><td>{}</td></tr>\n",
        integer(g, "generation", 0), html(text(g, "started_at")), html(text(g, "ended_at")),
        html(count_text(g, "world_size").value_or("-")),
        html(fmt::format("{}", fmt::join(hosts, ", "))), html(resumed_from_text(g)), html(status),
        html(error_headline(error)));
  }
  return "<table><thead><tr><th>#</th><th>Started</th><th>Ended</th><th>World size</th>"
         "<th>Hosts</th><th>Resumed from</th><th>Status</th><th>Error</th></tr></thead>\n<tbody>" +
         rows + "</tbody></table>\n";
}

std::string restarts_table(const json& info) {
  const json& restarts = array_at(info, "restarts");
  if (restarts.empty()) return "<p class=\"note\">No restarts.</p>\n";
  std::string rows;
  for (const auto& r : restarts) {
    rows += fmt::format(
        "<tr class=\"restart\"><td class=\"num\">{}</td><td>{}</td><td class=\"num\">{}</td>"
        "<td class=\"num\">{}</td><td>{}</td><td>{}</td></tr>\n",
        integer(r, "restart", 0), html(text(r, "at")), integer(r, "after_generation", 0),
        integer(r, "failed_after_step", -1), html(text(r, "from")), html(text(r, "cause")));
  }
  return "<table><thead><tr><th>Restart</th><th>At</th><th>After generation</th>"
         "<th>Failed after step</th><th>Resumed from</th><th>Cause</th></tr></thead>\n<tbody>" +
         rows + "</tbody></table>\n";
}

std::string world_size_table(const json& info) {
  const json& changes = array_at(info, "world_size_changes");
  if (changes.empty()) return "";
  std::string rows;
  for (const auto& c : changes) {
    const auto step = resumed_step(info, integer(c, "generation", -1));
    std::vector<std::string> lost;
    for (const auto& l : array_at(c, "lost"))
      lost.push_back(l.is_string() ? l.get<std::string>() : l.dump());
    rows += fmt::format(
        "<tr class=\"world-size-change\"><td>{}</td><td class=\"num\">{} \u2192 {}</td>"
        "<td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td>"
        "</tr>\n",
        html(text(c, "at")), integer(c, "from", 0), integer(c, "to", 0),
        integer(c, "generation", 0), step ? std::to_string(*step) : "\u2013",
        html(text(c, "global_batch")), html(fmt::format("{}", fmt::join(lost, "; "))));
  }
  return "<h3>World-size changes</h3>\n<table><thead><tr><th>At</th><th>World size</th>"
         "<th>Generation</th><th>Resumed at step</th><th>Global batch</th><th>Without</th></tr>"
         "</thead>\n<tbody>" +
         rows + "</tbody></table>\n";
}

std::string checkpoints_table(const RunView& run) {
  if (run.checkpoints.empty()) return "<p class=\"note\">No checkpoints.</p>\n";
  std::string rows;
  for (const auto& c : run.checkpoints) {
    std::string verdict;
    if (c.problems.empty()) {
      verdict = c.verified ? "<span class=\"ok\">ok</span>" : "not verified";
    } else if (c.denied) {  // out of reach, maybe intact (as ckpt verify says)
      verdict = "<span class=\"bad\">UNREADABLE: " +
                html(fmt::format("{}", fmt::join(c.problems, "; "))) + "</span>";
    } else {
      verdict =
          "<span class=\"bad\">FAILED: " + html(fmt::format("{}", fmt::join(c.problems, "; "))) +
          "</span>";
    }
    const auto known = [](int64_t v) { return v >= 0 ? std::to_string(v) : "\u2013"; };
    rows += fmt::format(
        "<tr class=\"checkpoint\"><td><code>{}</code>{}</td><td class=\"num\">{}</td>"
        "<td class=\"num\">{}</td><td class=\"num\">{}</td><td class=\"num\">{}</td><td>{}</td>"
        "<td>{}</td></tr>\n",
        html(c.name), c.set_aside ? " (set aside)" : "", known(c.step), known(c.epoch),
        known(c.world_size), human_size(c.bytes), c.latest ? "latest" : "", verdict);
  }
  return "<table><thead><tr><th>Checkpoint</th><th>Step</th><th>Epoch</th><th>World size</th>"
         "<th>Size</th><th></th><th>Verified</th></tr></thead>\n<tbody>" +
         rows + "</tbody></table>\n";
}

}  // namespace

bool RunMetrics::has_tokens() const {
  return std::any_of(steps.begin(), steps.end(),
                     [](const StepMetrics& s) { return std::isfinite(s.tokens_per_s); });
}

bool RunMetrics::has_phases() const {
  return std::any_of(steps.begin(), steps.end(), [](const StepMetrics& s) {
    return std::isfinite(s.data_ms) || std::isfinite(s.compute_ms) || std::isfinite(s.comm_ms) ||
           std::isfinite(s.optimizer_ms);
  });
}

RunMetrics read_metrics(const fs::path& file, const std::function<bool()>& stopped) {
  RunMetrics m;
  std::error_code ec;
  if (!fs::exists(file, ec)) return m;
  std::istringstream in(read_file(file));
  uint64_t lines = 0;
  for (std::string line; std::getline(in, line);) {
    if (stopped && ++lines % 4096 == 0 && stopped()) break;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const json j = parse_json(line, false);
    if (j.is_discarded() || !j.is_object() || !j.contains("step") || !j["step"].is_number()) {
      ++m.skipped_lines;
      continue;
    }
    const int64_t step = integer(j, "step", 0);
    // A loss is a number, or null (not finite: a diverged step); anything else is not a line
    // the trainer wrote.
    const auto loss_field = [&j](const char* key) {
      return j.contains(key) && (j[key].is_number() || j[key].is_null());
    };
    if (j.contains("eval_loss")) {
      if (!loss_field("eval_loss")) {
        ++m.skipped_lines;
        continue;
      }
      EvalMetrics e;
      e.step = step;
      e.loss = json_number(j, "eval_loss");
      e.accuracy = json_number(j, "eval_accuracy");
      while (!m.evals.empty() && m.evals.back().step >= step)
        m.evals.pop_back();
      m.evals.push_back(e);
      continue;
    }
    if (!loss_field("loss")) {
      ++m.skipped_lines;
      continue;
    }
    StepMetrics s;
    s.step = step;
    s.epoch = integer(j, "epoch", 0);
    s.loss = json_number(j, "loss");
    s.lr = json_number(j, "lr");
    s.grad_norm = json_number(j, "grad_norm");
    s.samples_per_s = json_number(j, "samples_per_s");
    s.tokens_per_s = json_number(j, "tokens_per_s");
    s.step_ms = json_number(j, "step_ms");
    s.data_ms = json_number(j, "data_ms");
    s.compute_ms = json_number(j, "compute_ms");
    s.comm_ms = json_number(j, "comm_ms");
    s.optimizer_ms = json_number(j, "optimizer_ms");
    // A step logged again: a restart went back to a checkpoint; what came after it is gone.
    while (!m.steps.empty() && m.steps.back().step >= step)
      m.steps.pop_back();
    m.steps.push_back(s);
  }
  return m;
}

// Marks the checkpoints another recipe than the run's wrote (by their meta.json's recipe hash),
// as resume skips them, with the mismatch as one of their problems: they fail verification as
// `ckpt list` and `ckpt verify` say. Nothing is marked where the run's recipe cannot be read.
void mark_foreign(const fs::path& dir, const json& info, std::vector<CheckpointSummary>& list) {
  CheckpointFilter unusable;
  try {
    if (!info.contains("recipe")) return;
    unusable = written_by(parse_recorded_recipe(info, dir, DataCheck::none));
  } catch (const Error&) {
    return;
  }
  for (auto& c : list) {
    if (c.set_aside) continue;
    if (const auto position = checkpoint_position(dir / "checkpoints" / c.name)) {
      if (std::string why = unusable(*position); !why.empty()) {
        c.foreign = true;
        c.problems.push_back(std::move(why));
      }
    }
  }
}

RunView load_run(const fs::path& dir, bool verify_checkpoints,
                 const std::function<bool()>& stopped) {
  RunView run;
  run.dir = resolved_path(dir);
  run.info = read_run_json(dir);
  check_record_types(run.info, dir / "run.json", RecordCheck::lists);
  // The parts below are named by absolute path (as run_dir is), whatever the caller's cwd.
  const fs::path& at = run.dir;
  // A part that is there but cannot be read is named, not fatal; a pipe is never opened (its
  // reader would wait for a writer), nor a directory where a file belongs taken for an empty
  // part. `blocked` is false for a part that is missing.
  const auto blocked = [&run](const fs::path& file, fs::file_type expected) {
    std::error_code ec;
    const fs::file_status st = fs::status(file, ec);
    if (st.type() == fs::file_type::not_found) return false;
    std::string why;
    if (ec) {
      why = ec.message();
    } else if (st.type() != expected) {
      const char* kind = fs::is_regular_file(st) ? "a regular file" : non_regular_kind(st);
      why = fmt::format("is {}, not {}", kind,
                        expected == fs::file_type::directory ? "a directory" : "a regular file");
    } else if (::access(file.c_str(), fs::is_directory(st) ? R_OK | X_OK : R_OK) != 0) {
      why = std::strerror(errno);
    }
    if (why.empty()) return false;
    run.unreadable.push_back(fmt::format("{}: {}", file.string(), why));
    return true;
  };
  if (!blocked(at / "result.json", fs::file_type::regular)) {
    std::string damaged;
    run.result = read_json_object(at / "result.json", damaged);
    if (!damaged.empty()) {
      const bool copy = run.info.contains("result") && run.info["result"].is_object();
      run.unreadable.push_back(damaged + (copy ? "; run.json's copy of the result is used"
                                               : "; run.json holds no copy of it"));
    }
  }
  if (!run.result.is_object() && run.info.contains("result")) run.result = run.info["result"];
  if (!run.result.is_object()) run.result = nullptr;
  try {
    if (!blocked(at / "metrics.jsonl", fs::file_type::regular))
      run.metrics = read_metrics(at / "metrics.jsonl", stopped);
  } catch (const Error& e) {
    run.unreadable.push_back(e.what());
  }
  run.state = run_state(run.info, dir);
  try {
    run.checkpoints_unread = blocked(at / "checkpoints", fs::file_type::directory);
    if (!run.checkpoints_unread) {
      // A `latest` that cannot be read is named; the checkpoints are still listed (none is
      // taken for latest, as summarize_checkpoints never opens a pipe there).
      blocked(at / "checkpoints" / "latest", fs::file_type::regular);
      run.checkpoints = summarize_checkpoints(at / "checkpoints", verify_checkpoints, stopped);
      mark_foreign(run.dir, run.info, run.checkpoints);
      for (const auto& c : run.checkpoints) {
        if (c.denied && !c.problems.empty()) {
          run.unreadable.push_back(
              fmt::format("{}/{}", (at / "checkpoints" / c.name).string(), c.problems.front()));
        }
      }
    }
  } catch (const Error& e) {
    run.unreadable.push_back(e.what());
    run.checkpoints_unread = true;
  }
  return run;
}

// The fields `status --json` and `report --json` share, with one meaning in both (and in
// launch's --json where it has them): step reached and steps planned, the last logged training
// loss, the result's final loss (null until the run completes), the newest checkpoint's path.
// A bench comm run's outcome, from the result run.json keeps (null for any other run): what
// status and report show in place of training steps.
// One that ended before its result (stopped, failed) has its options' ops and sizes (run.json's
// "benchmark"), which hold no figures: those are null.
json comm_benchmark(const RunView& run) {
  const json& info = run.info;
  const json result = info.value("result", json());
  const bool finished = result.is_object() && result.value("benchmark", "") == "comm";
  const json from = finished ? result : info.value("benchmark", json());
  if (!from.is_object()) return nullptr;
  // The sizes' range is its sweep's: -e need not be one of them (to 64 KiB by a factor of 4 from
  // 8 B ends at 32 KiB). Options this dptrain cannot read: the range as recorded.
  json smallest = from.value("min_bytes", json());
  json largest = from.value("max_bytes", json());
  try {
    if (const auto sizes = CommBenchOptions::from_json(from).sizes(); !sizes.empty()) {
      smallest = sizes.front();
      largest = sizes.back();
    }
  } catch (const Error&) {
  }
  // One that measured nothing has no figures at all: null, as avg_busbw; its status is the run's
  // as status(1) judges it (its options hold none): running, or what ended it.
  return {{"benchmark", "comm"},
          {"status", from.value("status", json(run.state.status))},
          {"ops", from.value("ops", json::array())},
          // -b and -e as given, as bench comm --json has them; the sizes measured between.
          {"min_bytes", from.value("min_bytes", json())},
          {"max_bytes", from.value("max_bytes", json())},
          {"smallest_size", smallest},
          {"largest_size", largest},
          {"avg_busbw", from.value("avg_busbw", json())},
          {"avg_busbw_by_op", from.value("avg_busbw_by_op", json())},
          {"wrong", from.value("wrong", json())},
          // Ended early (stopped, a rank failed): the figures are those of the sizes it measured.
          {"partial", from.value("partial", false)}};
}

// "allreduce, broadcast from 8 B to 64.0 MiB: avg busbw 1.23 GB/s, 0 wrong elements".
std::string comm_benchmark_text(const json& b) {
  std::vector<std::string> ops;
  for (const auto& op : b["ops"])
    ops.push_back(op.is_string() ? op.get<std::string>() : op.dump());
  const auto bytes = [](const json& v) {
    return v.is_number() ? human_size(v.get<uint64_t>()) : std::string("?");
  };
  const std::string what = fmt::format("bench comm {} from {} to {}", fmt::join(ops, ", "),
                                       bytes(b["smallest_size"]), bytes(b["largest_size"]));
  // While it runs, run.json holds its options only (its rows come at the end).
  if (!b["avg_busbw"].is_number()) {
    return what + (b["status"] == "running" ? ": running, no result yet"
                                            : ": no result (it did not finish)");
  }
  return fmt::format(
      "{}: {}avg busbw {:.3g} GB/s, {} wrong element(s)", what,
      b.value("partial", false) ? "it did not finish; over the sizes it measured, " : "",
      b["avg_busbw"].get<double>(), b["wrong"].dump());
}

json summary_fields(const RunView& run) {
  const json recipe = run.info.value("recipe", json::object());
  const StepMetrics* last = run.metrics.steps.empty() ? nullptr : &run.metrics.steps.back();
  const json step = step_reached(run);
  const EvalMetrics* eval = last_eval(run);
  double eval_loss = eval ? eval->loss : kNoValue;
  double eval_accuracy = eval ? eval->accuracy : kNoValue;
  json eval_step = eval ? json(eval->step) : json(nullptr);
  // The final evaluation's, at the run's last step (also where metrics.jsonl lost its line).
  if (run.result.is_object() && std::isfinite(json_number(run.result, "eval_loss"))) {
    eval_loss = json_number(run.result, "eval_loss");
    eval_accuracy = json_number(run.result, "eval_accuracy");
    eval_step = integer_or_null(run.result, "steps");
  }
  const std::string checkpoint = last_checkpoint_name(run);
  json last_checkpoint =
      checkpoint.empty() ? json(nullptr) : json((run.dir / "checkpoints" / checkpoint).string());
  json checkpoint_host = nullptr;
  // None here, but rank 0 on another host committed one: run.json's record of it.
  if (const auto remote = remote_last_checkpoint(run.info); checkpoint.empty() && remote) {
    last_checkpoint = remote->path;
    checkpoint_host = remote->host;
  }
  const auto usable =
      std::count_if(run.checkpoints.begin(), run.checkpoints.end(),
                    [](const auto& c) { return !c.set_aside && !c.foreign && c.problems.empty(); });
  return {{"run_dir", run.dir.string()},
          {"unreadable", run.unreadable},
          {"name", or_null(text(recipe, "name"))},
          {"status", run.state.status},
          {"step", step},
          {"steps", recipe.contains("train") && recipe["train"].is_object()
                        ? integer_or_null(recipe["train"], "steps")
                        : json(nullptr)},
          {"loss", last ? or_null(last->loss) : json(nullptr)},
          {"final_loss",
           run.result.is_object() ? or_null(json_number(run.result, "final_loss")) : json(nullptr)},
          {"eval_loss", or_null(eval_loss)},
          {"eval_accuracy", or_null(eval_accuracy)},
          {"eval_step", eval_step},
          {"last_checkpoint", last_checkpoint},
          {"last_checkpoint_host", checkpoint_host},
          // Those a resume may use (not another recipe's); the ones it set aside (they failed
          // verification) apart.
          // Null where rank 0 kept them on another host and none is here: not counted, not 0.
          {"checkpoints", (usable == 0 && !checkpoint_host.is_null()) || run.checkpoints_unread
                              ? json(nullptr)
                              : json(usable)},
          {"checkpoints_set_aside", std::count_if(run.checkpoints.begin(), run.checkpoints.end(),
                                                  [](const auto& c) { return c.set_aside; })},
          // As run.json holds them (the last generation's, and the one the batch is defined by).
          {"world_size", integer_or_null(run.info, "world_size")},
          {"nominal_world_size", integer_or_null(run.info, "nominal_world_size")},
          {"restarts", array_at(run.info, "restarts").size()},
          {"world_size_changes", array_at(run.info, "world_size_changes").size()},
          {"benchmark", comm_benchmark(run)}};
}

// A running generation whose ranks have not met yet (no met_at in its record).
bool ranks_meeting(const RunView& run) {
  const json& gens = array_at(run.info, "generations");
  if (run.state.status != "running" || gens.empty() || !gens.back().is_object()) return false;
  return !gens.back().contains("ended_at") && !gens.back().contains("met_at");
}

// A running resume or restart whose ranks have not met yet (no met_at in its record): the step
// and loss shown (metrics.jsonl's last lines) are the generation before it's.
bool generation_starting(const RunView& run) {
  return array_at(run.info, "generations").size() >= 2 && ranks_meeting(run);
}

json status_json(const RunView& run) {
  const json& info = run.info;
  const json& restarts = array_at(info, "restarts");
  const StepMetrics* last = run.metrics.steps.empty() ? nullptr : &run.metrics.steps.back();
  json last_restart = nullptr;
  if (!restarts.empty()) {
    const json& r = restarts.back();
    last_restart = {{"restart", integer(r, "restart", 0)},
                    {"cause", or_null(text(r, "cause"))},
                    {"failed_after_step", integer(r, "failed_after_step", -1)},
                    {"from", or_null(text(r, "from"))},
                    {"at", or_null(text(r, "at"))}};
  }
  json j = summary_fields(run);
  // As run.json holds it (a hand-edited 5 stays a number).
  j.update(json{{"recorded_status", info.value("status", json(nullptr))},
                {"note", or_null(run.state.note)},
                {"live_pids", run.state.live_pids},
                {"epoch", last ? json(last->epoch) : json(nullptr)},
                {"job_size", info.value("job_size", json(nullptr))},
                {"generations", array_at(info, "generations").size()},
                {"generation_starting", generation_starting(run)},
                {"last_restart", last_restart},
                {"error", or_null(run_error(run))},
                {"hint", or_null(status_hint(run))}});
  return j;
}

std::string status_text(const RunView& run) {
  const json s = status_json(run);
  // A name with a control character in it (a newline, an escape) must not break the lines.
  std::string out = fmt::format("{}: {}", printable(run.dir.string()), run.state.status);
  if (!run.state.note.empty()) out += " (" + run.state.note + ")";
  out += "\n";
  const auto row = [&out](const char* name, const std::string& value) {
    out += fmt::format("  {:<12} {}\n", name, value);
  };
  if (!s["benchmark"].is_null()) {
    row("benchmark", comm_benchmark_text(s["benchmark"]));
    // One that did not finish: the measurement it reached (each is a step).
    if (!s["step"].is_null())
      row("step", fmt::format("{} (a step is one measurement)", s["step"].dump()));
  } else if (s["step"].is_null()) {
    // Not hung: rank 0 (or the launcher) waits for its peers to come.
    row("step", ranks_meeting(run) ? "no steps logged yet: the ranks have not all met"
                                   : "no steps logged yet");
  } else {
    row("step", fmt::format("{}{}{}{}", s["step"].get<int64_t>(),
                            s["steps"].is_null() ? "" : fmt::format(" of {}", s["steps"].dump()),
                            s["epoch"].is_null() ? "" : " (epoch " + s["epoch"].dump() + ")",
                            s["generation_starting"] == true
                                ? "; the last generation's: this one is starting, from its "
                                  "newest valid checkpoint"
                                : ""));
    std::string loss = s["loss"].is_null() ? "-" : loss_num(s["loss"].get<double>());
    if (!s["eval_loss"].is_null()) {
      loss += fmt::format(" (eval {}{})", loss_num(s["eval_loss"].get<double>()),
                          s["eval_step"].is_null() ? "" : " at step " + s["eval_step"].dump());
    }
    row("loss", loss);
  }
  const std::string checkpoint = last_checkpoint_name(run);
  if (const std::string absent = recorded_but_absent(run); checkpoint.empty() && !absent.empty()) {
    row("checkpoint",
        fmt::format("unknown: run.json records {} committed, and checkpoints/ {}", absent,
                    run.checkpoints_unread ? "cannot be read" : "holds none"));
  } else if (!checkpoint.empty() || s["last_checkpoint_host"].is_null()) {
    // Only listed, not read through (a large one takes seconds): said so, with those a resume
    // set aside.
    const size_t aside = s["checkpoints_set_aside"].get<size_t>();
    row("checkpoint", fmt::format("{}{}{}", checkpoint.empty() ? "none" : checkpoint,
                                  checkpoint.empty() ? "" : " (the newest; checksums not checked)",
                                  aside == 0 ? ""
                                             : fmt::format("; {} set aside by a resume: {} failed "
                                                           "verification",
                                                           aside, aside == 1 ? "it" : "they")));
  } else {
    row("checkpoint", fmt::format("{} on {} (recorded in run.json; not checked from here)",
                                  text(s, "last_checkpoint"), text(s, "last_checkpoint_host")));
  }
  row("world size", world_size_text(run.info));
  std::string restarts = fmt::format("{} restart(s) in {} generation(s)", s["restarts"].dump(),
                                     s["generations"].dump());
  if (!s["last_restart"].is_null()) {
    const json& r = s["last_restart"];
    restarts += fmt::format("; the last after step {}: {}", r["failed_after_step"].dump(),
                            text(r, "cause"));
  }
  row("restarts", restarts);
  if (!run.state.live_pids.empty()) {
    row("pids", fmt::format("{}", fmt::join(run.state.live_pids, " ")));
  }
  if (!s["error"].is_null()) {
    std::istringstream lines(text(s, "error"));
    std::string line;
    std::getline(lines, line);
    row("error", line);
    while (std::getline(lines, line))
      out += fmt::format("  {:<12} {}\n", "", line);
  }
  if (!s["hint"].is_null()) row("hint", text(s, "hint"));
  for (const std::string& part : run.unreadable)
    row("unreadable", part);
  return out;
}

std::string report_html(const RunView& run) {
  const json& info = run.info;
  const json recipe = info.value("recipe", json::object());
  const std::string name =
      text(recipe, "name").empty() ? run.dir.filename().string() : text(recipe, "name");
  std::string body;
  body += fmt::format("<h1>{} <span class=\"badge {}\">{}</span></h1>\n", html(name),
                      html(run.state.status), html(run.state.status));
  body += fmt::format("<div class=\"sub\">{} \u00b7 report written {} by dptrain {}</div>\n",
                      html(run.dir.filename().string()), html(utc_timestamp()), DPTRAIN_VERSION);
  const std::string error = run_error(run);
  if (!error.empty() && run.state.status != "completed" && run.state.status != "running") {
    body += "<pre class=\"error\">" + html(error) + "</pre>\n";
  }
  const json bench = comm_benchmark(run);
  body += "<h2>Run</h2>\n" + facts_table(run, bench);

  if (!bench.is_null()) {
    // The benchmark's own table (nccl-tests' format), as it printed it.
    std::string table;
    try {
      table = read_file(run.dir / "table.txt");
    } catch (const Error&) {
      table = run.state.status == "running" ? "(the table is written when the benchmark ends)"
                                            : "(table.txt is missing)";
    }
    body += "<h2>Benchmark</h2>\n<p>" + html(comm_benchmark_text(bench)) + "</p>\n<pre>" +
            html(table) + "</pre>\n";
  }
  // A benchmark's ranks train nothing: no training section for one.
  if (bench.is_null() || !run.metrics.steps.empty()) {
    body += "<h2>Training</h2>\n";
    if (run.metrics.steps.empty() && run.metrics.evals.empty()) {
      body += "<p class=\"note no-steps\">No steps logged yet (" +
              html((run.dir / "metrics.jsonl").string()) + " is empty or missing).</p>\n";
    } else {
      body += charts(run);
      const auto markers = timeline_markers(info);
      if (!markers.empty()) {
        body +=
            "<p class=\"note\">Dashed vertical lines: <span "
            "style=\"color:#d62728\">restarts</span> "
            "at the last step logged before the failure, <span style=\"color:#9467bd\">world-size "
            "changes</span> at the step the next generation resumed from.</p>\n";
      }
    }
  }
  if (run.metrics.skipped_lines > 0) {
    body += fmt::format(
        "<p class=\"note\">{} unreadable line(s) of metrics.jsonl skipped (a crash can tear "
        "the last line).</p>\n",
        run.metrics.skipped_lines);
  }

  body += "<h2>Timeline</h2>\n<h3>Generations</h3>\n" + generations_table(run);
  body += "<h3>Restarts</h3>\n" + restarts_table(info) + world_size_table(info);
  body += "<h2>Checkpoints</h2>\n" + checkpoints_table(run);
  if (!recipe.empty()) {
    body += "<h2>Recipe</h2>\n<details><summary>The resolved recipe (JSON)</summary><pre>" +
            html(recipe.dump(2)) + "</pre></details>\n";
  }
  return std::string(kHtmlStart) +
         fmt::format(
             "\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
             "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
             "<title>{} \u2014 dptrain "
             "report</title>\n<style>{}</style>\n</head>\n<body>\n{}</body>\n"
             "</html>\n",
             html(name), kStyle, body);
}

json report_summary(const RunView& run, const fs::path& report_file) {
  const Throughput t = throughput(run);
  size_t failed = 0;
  for (const auto& c : run.checkpoints)
    failed += !c.set_aside && !c.problems.empty() && !c.denied;
  json j = summary_fields(run);
  j.update(json{{"report", report_file.string()},
                {"throughput", or_null(t.value)},
                // A collective benchmark moves bytes, not samples: its figures are "benchmark".
                {"throughput_unit", j["benchmark"].is_null() ? json(t.unit) : json(nullptr)},
                {"world_sizes", world_sizes(run.info)},
                {"checkpoints_failed", failed},
                {"metrics_lines_skipped", run.metrics.skipped_lines},
                {"error", or_null(error_headline(run_error(run)))}});
  return j;
}

std::string report_summary_text(const json& s) {
  std::string out = text(s, "status");
  if (!s["benchmark"].is_null()) {
    out += ": " + comm_benchmark_text(s["benchmark"]);
  } else if (s["step"].is_null()) {
    out += ": no steps logged yet";
  } else {
    out += fmt::format(": step {}{}", s["step"].dump(),
                       s["steps"].is_null() ? "" : " of " + s["steps"].dump());
    const json& loss = s["final_loss"].is_null() ? s["loss"] : s["final_loss"];
    if (!loss.is_null()) out += ", loss " + loss_num(loss.get<double>());
    if (!s["eval_loss"].is_null()) {
      out += ", eval loss " + loss_num(s["eval_loss"].get<double>());
      if (!s["eval_accuracy"].is_null()) {
        out += fmt::format(" (accuracy {:.1f}%)", 100 * s["eval_accuracy"].get<double>());
      }
    }
  }
  out += "\n";
  if (!s["throughput"].is_null()) {
    out += fmt::format("throughput {} {}; ", rate(s["throughput"].get<double>()),
                       text(s, "throughput_unit"));
  }
  out += fmt::format(
      "{} restart(s); world size {}; {}{}{}\n", s["restarts"].dump(), text(s, "world_sizes"),
      s["checkpoints"].is_null() ? std::string("checkpoints on rank 0's host, not counted here")
                                 : s["checkpoints"].dump() + " checkpoint(s)",
      s["checkpoints_failed"].get<size_t>() > 0
          ? fmt::format(", {} FAILED verification", s["checkpoints_failed"].dump())
          : "",
      s["checkpoints_set_aside"].get<size_t>() > 0
          ? fmt::format(" ({} more set aside by a resume: they failed verification)",
                        s["checkpoints_set_aside"].dump())
          : "");
  if (!s["last_checkpoint_host"].is_null()) {
    out += fmt::format("checkpoints on {}: the last recorded is {}\n",
                       text(s, "last_checkpoint_host"), printable(text(s, "last_checkpoint")));
  }
  if (!s["error"].is_null() && text(s, "status") != "completed") {
    out += "error: " + text(s, "error") + "\n";
  }
  for (const auto& part : s["unreadable"])
    out += "unreadable: " + part.get<std::string>() + "\n";
  if (s["metrics_lines_skipped"].get<int64_t>() > 0) {
    out += fmt::format("metrics.jsonl: {} unreadable line(s) skipped\n",
                       s["metrics_lines_skipped"].dump());
  }
  out +=
      "report: " + printable(text(s, "report")) + "\n";  // a path: its bytes as status shows them
  return out;
}

}  // namespace dptrain
