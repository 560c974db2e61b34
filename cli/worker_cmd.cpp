// `dptrain worker RECIPE`: one rank. Identity comes from flags or the environment (RANK,
// WORLD_SIZE, LOCAL_RANK, DPTRAIN_STORE or MASTER_ADDR/MASTER_PORT), so it also runs under srun or
// mpirun without the launcher.
#include <fcntl.h>
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/commands.hpp"
#include "cli/env.hpp"
#include "cli/run_report.hpp"
#include "core/checkpoint.hpp"
#include "core/comm/auth.hpp"
#include "core/comm/gloo_communicator.hpp"
#include "core/comm/nccl_communicator.hpp"
#include "core/comm/net.hpp"
#include "core/comm/start_agreement.hpp"
#include "core/comm/store.hpp"
#include "core/comm/tcp_store.hpp"
#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/fs.hpp"
#include "core/heartbeat.hpp"
#include "core/json_error.hpp"
#include "core/recipe.hpp"
#include "core/tensor/device.hpp"
#include "core/trainer.hpp"
#include "launch/hang_watch.hpp"
#include "launch/job.hpp"
#include "launch/run_dir.hpp"
#include "launch/status.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

namespace {

// Far above any job (and what the store's per-rank keys can hold in memory): a world size past it
// is a slip (2147483647), not one to allocate a key per rank for while rank 0 waits.
constexpr int kMaxWorld = 1 << 20;

struct WorkerOptions {
  std::string recipe;
  std::string run_dir;
  std::string resume;
  int rank = -1;
  int world_size = -1;
  int local_rank = -1;
  int nominal_world = -1;
  std::string store;
  // Where `store` came from, for its errors: "--store", "DPTRAIN_STORE" or
  // "MASTER_ADDR/MASTER_PORT".
  std::string store_from = "--store";
  bool host_store = false;
  std::string host_store_from = "--host-store";
  int generation = -1;
  std::string generation_from = "--generation";
  std::string bind;
  double timeout_s = 0;
};

// Whether a launcher started this rank (it sets DPTRAIN_LAUNCHED=1 for every rank it starts).
bool started_by_launcher() {
  return env(kLaunchedEnv) == "1";
}

// Flags win over the environment; every missing piece is named.
void fill_from_env(WorkerOptions& o) {
  if (o.rank < 0) o.rank = env_int("RANK", std::nullopt, "--rank not given and RANK is not set");
  if (o.world_size < 0)
    o.world_size =
        env_int("WORLD_SIZE", std::nullopt, "--world-size not given and WORLD_SIZE is not set");
  if (o.local_rank < 0) {
    // torchrun's and ours, then what Slurm (srun), Open MPI and MPICH (Hydra) set: the first
    // one set wins, and it alone is read (set to nothing: named, as RANK is, not taken as unset),
    // so that an empty one after it (inherited from a scheduler) stops nothing.
    o.local_rank = o.rank;
    for (const char* name :
         {"LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"}) {
      if (std::getenv(name) != nullptr) {
        o.local_rank = env_int(name, o.rank);
        break;
      }
    }
  }
  // Set to nothing, a variable is named (env_value), not taken as unset.
  if (o.store.empty()) {
    if (auto s = env_value("DPTRAIN_STORE")) {
      o.store = *s;
      o.store_from = "DPTRAIN_STORE";
    } else {
      const auto addr = env_value("MASTER_ADDR");
      const auto port = env_value("MASTER_PORT");
      if (!addr || !port) {
        throw Error(ErrorKind::usage,
                    fmt::format("--store not given and neither DPTRAIN_STORE nor {} is set",
                                addr   ? "MASTER_PORT"
                                : port ? "MASTER_ADDR"
                                       : "MASTER_ADDR/MASTER_PORT"));
      }
      o.store_from = "MASTER_ADDR/MASTER_PORT";
      // torchrun's variables, each named: a bad port is MASTER_PORT's, not an address's.
      const auto port_number = parse_port(*port);
      if (!port_number) {
        throw Error(
            ErrorKind::usage,
            fmt::format("MASTER_PORT: '{}' is not a port number (1 to 65535)", printable(*port)));
      }
      // An IPv6 address bare (as torchrun takes it) or in brackets; a port belongs in
      // MASTER_PORT.
      const auto bad_addr = [&addr](std::string_view why) {
        return Error(ErrorKind::usage, fmt::format("MASTER_ADDR: '{}' {}", printable(*addr), why));
      };
      if (addr->find_first_of(" \t\r\n") != std::string::npos) throw bad_addr("holds white space");
      const size_t close = addr->find(']');
      if (addr->starts_with('[') && close == std::string::npos) {
        throw bad_addr("has no closing bracket");
      }
      if (!addr->starts_with('[') && close != std::string::npos) {
        throw bad_addr("has a closing bracket without an opening one");
      }
      const bool holds_port = addr->starts_with('[')
                                  ? close + 1 < addr->size()
                                  : std::count(addr->begin(), addr->end(), ':') == 1;
      if (holds_port) {
        throw bad_addr("holds a port: give the host alone, and the port in MASTER_PORT");
      }
      o.store = format_host_port(unbracketed(*addr), *port_number);
    }
  }
  if (o.nominal_world < 0) {
    o.nominal_world = env_int("DPTRAIN_NOMINAL_WORLD", 0);
  }
  if (o.generation < 0) {
    o.generation = env_int("DPTRAIN_GENERATION", 1);
    o.generation_from = env_value("DPTRAIN_GENERATION") ? "DPTRAIN_GENERATION" : "the default";
  }
  if (o.run_dir.empty()) o.run_dir = env_value("DPTRAIN_RUN_DIR").value_or("");
  if (o.run_dir.empty()) {
    throw Error(ErrorKind::usage, "--run-dir not given and DPTRAIN_RUN_DIR is not set");
  }
  // Read only by ranks started without a launcher: a launcher's ranks inherit its environment,
  // where such a variable means nothing to them.
  if (!o.host_store && !started_by_launcher()) {
    if (const auto hosting = env_value("DPTRAIN_HOST_STORE")) {
      if (*hosting != "0" && *hosting != "1") {
        throw Error(ErrorKind::usage,
                    fmt::format("DPTRAIN_HOST_STORE: '{}' is neither 1 (rank 0 serves the store) "
                                "nor 0",
                                *hosting));
      }
      o.host_store = *hosting == "1";
      o.host_store_from = "DPTRAIN_HOST_STORE=1";
    }
  }
  if (o.bind.empty()) {
    o.bind = (started_by_launcher() ? env("DPTRAIN_BIND_ADDR") : env_value("DPTRAIN_BIND_ADDR"))
                 .value_or("");
  }
  // Flags were checked by CLI11; values from the environment are checked here, before any
  // connection, naming the variable.
  const auto at_least = [](const char* name, int value, int least) {
    if (value < least) {
      throw Error(ErrorKind::usage,
                  fmt::format("{}: must be at least {}, got {}", name, least, value));
    }
  };
  at_least("rank (--rank or RANK)", o.rank, 0);
  at_least("world size (--world-size or WORLD_SIZE)", o.world_size, 1);
  for (const auto& [name, value] :
       {std::pair<const char*, int>{"world size (--world-size or WORLD_SIZE)", o.world_size},
        {"nominal world (--nominal-world or DPTRAIN_NOMINAL_WORLD)", o.nominal_world}}) {
    if (value > kMaxWorld) {
      throw Error(ErrorKind::usage,
                  fmt::format("{}: at most {} ranks, got {}", name, kMaxWorld, value));
    }
  }
  at_least("local rank (--local-rank or LOCAL_RANK)", o.local_rank, 0);
  at_least("nominal world (--nominal-world or DPTRAIN_NOMINAL_WORLD)", o.nominal_world, 0);
  at_least("generation (--generation or DPTRAIN_GENERATION)", o.generation, 1);
}

// Said after "cannot reach store ..." to a rank started by hand: who serves the store.
std::string no_store_hint(const WorkerOptions& o) {
  if (started_by_launcher() || (o.rank == 0 && o.host_store)) return "";
  if (o.rank == 0) {
    return "; nothing serves it: rank 0 serves the store when started with --host-store "
           "(DPTRAIN_HOST_STORE=1)";
  }
  if (o.host_store) {
    return fmt::format(
        "; {} is for rank 0, which then serves the store: this rank only connects "
        "to it, so start rank 0 with it",
        o.host_store_from);
  }
  return "; is rank 0 running, started with --host-store (DPTRAIN_HOST_STORE=1) to serve it?";
}

std::atomic<bool> g_stop_requested{false};
// The stop signals' bytes, for the StopWatcher thread; a 0 byte tells it to end.
int g_signal_pipe[2] = {-1, -1};
// Who answers a stop signal: 0 the StopWatcher, at once, for SIGTERM only before the training
// loop began (ProgressTracker::stepping; after it the trainer checkpoints at a step's end);
// 2 the StopWatcher took one (the process is ending); 3 training is over (what is left is
// recording how it ended: signals wait for the exit).
std::atomic<int> g_stop_answer{0};

void on_stop_signal(int sig) {
  const int saved = errno;
  if (sig == SIGTERM) g_stop_requested = true;
  const char byte = static_cast<char>(sig);
  if (g_signal_pipe[1] >= 0) (void)!::write(g_signal_pipe[1], &byte, 1);
  errno = saved;
}

void catch_signal(int sig) {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  ::sigaction(sig, &sa, nullptr);
}

// The backend every rank uses, as the ranks agree to start (agree_to_start, which also finds
// world sizes that differ and a rank that could not start). "auto" is nccl when every rank
// computes on a GPU and can load NCCL, gloo otherwise. "nccl" where NCCL cannot work is
// Error(comm) naming the rank and the reason.
std::string choose_backend(Store& store, int rank, int world, const std::string& requested,
                           Ops& ops, std::chrono::milliseconds timeout) {
  const bool gpu = ops.device() != "cpu";
  // Rank 0 of ranks started without a launcher (whose own lines say how the hosts start) says
  // every 10 s whom it still waits for, rather than nothing until the timeout.
  std::function<void(const JoinWait&)> waiting;
  if (rank == 0 && !started_by_launcher()) {
    waiting = [timeout, world](const JoinWait& w) {
      std::string names = fmt::format("{}", fmt::join(w.missing, ", "));
      if (w.missing_count > static_cast<int>(w.missing.size()))
        names += fmt::format(" and {} more", w.missing_count - static_cast<int>(w.missing.size()));
      std::printf("waiting for rank%s %s to join: %d of %s%d here after %s (the timeout is %s)\n",
                  w.missing_count == 1 ? "" : "s", names.c_str(), w.joined,
                  w.looked < world ? "the first " : "", w.looked,
                  fmt::format("{}s", (w.waited.count() + 500) / 1000).c_str(),
                  format_timeout(timeout).c_str());
      std::fflush(stdout);
    };
  }
  const BackendChoice choice = agree_to_start(store, rank, world, requested == "nccl",
                                              requested == "gloo" ? "the backend asked for is gloo"
                                              : !gpu              ? "it computes on the CPU"
                                                     : nccl_unavailable_reason().value_or(""),
                                              timeout, waiting);
  if (choice.backend == "gloo" && choice.rank == rank && requested == "auto" && gpu) {
    std::printf("warning: backend auto uses gloo: rank %d cannot use NCCL: %s\n", rank,
                choice.why_not.c_str());
    std::fflush(stdout);
  }
  return choice.backend;
}

}  // namespace

void install_worker_signal_handlers() {
  // A peer that dies mid-collective must surface as a communication error naming it, not as
  // this rank dying of SIGPIPE on the broken socket.
  std::signal(SIGPIPE, SIG_IGN);
  // SIGTERM (the launcher stopping the job, a spot instance going away) stops every rank at
  // the next step boundary, after a checkpoint; before the first one, at once (StopWatcher).
  if (g_signal_pipe[0] < 0 && ::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
    g_signal_pipe[0] = g_signal_pipe[1] = -1;
  }
  catch_signal(SIGTERM);
}

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// A job of workers started by hand or by another scheduler (srun, mpirun) has no launcher to
// record it: rank 0 keeps run.json instead, so that status, report, ckpt and sample read the run
// as they read a launcher's. Each such start is a generation; its pid is rank 0's, so status
// tells a running job from one whose rank 0 is gone. A run.json a launcher wrote (or one that
// cannot be read) is left alone.
class HandRunRecord {
 public:
  HandRunRecord(const WorkerOptions& o, const Recipe& recipe) {
    if (o.rank != 0 || started_by_launcher()) return;
    const fs::path dir = o.run_dir;
    std::error_code ec;
    if (fs::exists(fs::symlink_status(dir / "run.json", ec))) {
      try {
        info_ = read_run_json(dir);
      } catch (const Error& e) {
        std::fprintf(stderr, "dptrain: warning: %s: this run is not recorded there\n", e.what());
        return;
      }
      // Continued (--resume) without --nominal-world: the job's, as the run records it (a
      // launcher's run too), and not this start's world size, which would change the global
      // batch.
      if (o.nominal_world == 0 && !o.resume.empty()) {
        const json recorded = info_.value("nominal_world_size", json());
        if (recorded.is_number_integer() && recorded.get<int64_t>() > 0 &&
            recorded.get<int64_t>() <= kMaxWorld) {
          nominal_world_ = recorded.get<int>();
        }
      }
      if (!started_by_workers(info_)) return;
      // Continued with another recipe: none of the checkpoints is this recipe's, and the record
      // would take the new recipe, under which `ckpt verify` finds every one of them foreign.
      // (data.path aside: each host may keep the data elsewhere.) Refused before anything is
      // written, as the other ranks then fail to meet rank 0.
      const std::string recorded = recorded_recipe_hash(dir);
      if (!o.resume.empty() && !recorded.empty() && recorded != recipe_hash(recipe)) {
        throw Error(ErrorKind::usage,
                    fmt::format("--run-dir {}: its run.json records the run of another recipe "
                                "('{}', hash {}; {} has hash {}): continue it with the recipe "
                                "it records, or give a new --run-dir",
                                o.run_dir, info_["recipe"].value("name", std::string("?")),
                                recorded, o.recipe, recipe_hash(recipe)));
      }
      // Started again to continue a run that completed: nothing to train, nothing to record.
      // (A recorded recipe this build cannot read must at least be the very one given.)
      if (info_.value("status", json()) == "completed" &&
          (o.resume == "newest" || o.resume == "newest-or-start") &&
          (!recorded.empty() || info_.value("recipe", json()) == to_json(recipe))) {
        completed_ = true;
        return;
      }
    } else {
      info_ = new_run_info();
      info_["started_by"] = kStartedByWorkers;
    }
    file_ = dir / "run.json";
    info_["dptrain_version"] = DPTRAIN_VERSION;
    info_["name"] = recipe.name;
    info_["recipe"] = to_json(recipe);
    info_["world_size"] = o.world_size;
    if (o.nominal_world > 0) nominal_world_ = o.nominal_world;
    info_["nominal_world_size"] = nominal_world_ > 0 ? nominal_world_ : o.world_size;
    info_["status"] = "running";
    info_.erase("error");
    if (!info_["generations"].is_array()) info_["generations"] = json::array();
    // The one before, which no rank 0 closed (killed, as a crash in a checkpoint is): lost, as
    // a launcher records it.
    // Its end as the run's files last changed (no launcher kept an alive_at): the newer of
    // run.json (not yet rewritten here) and metrics.jsonl.
    close_lost_generation(
        info_, "its rank 0",
        std::max(utc_timestamp_of(file_), utc_timestamp_of(dir / "metrics.jsonl")));
    json gen = {{"generation", info_["generations"].size() + 1},
                {"started_at", utc_timestamp()},
                {"world_size", o.world_size},
                {"hosts", json::array({this_host()})},
                {"pids", json::array({::getpid()})}};
    // A checkpoint named; "newest" and "newest-or-start" find theirs as the ranks meet.
    if (!o.resume.empty() && o.resume != "newest" && o.resume != "newest-or-start") {
      gen["resumed_from"] = fs::path(o.resume).filename().string();
    }
    // Started again on another number of ranks: a change of world size, recorded once the
    // ranks have met (a start that fails first changed nothing).
    const json& before = info_["generations"].empty() ? json() : info_["generations"].back();
    if (before.is_object() && before.value("world_size", o.world_size) != o.world_size) {
      change_ = world_size_change(before.value("world_size", 0), o.world_size,
                                  json::array({this_host()}), json::array(), json::array(),
                                  global_batch(recipe, o.world_size, nominal_world_),
                                  static_cast<int64_t>(info_["generations"].size()) + 1);
    }
    info_["generations"].push_back(std::move(gen));
    save();
  }

  // The hash of the recipe run.json records (recipe_hash); empty where it has none that reads.
  std::string recorded_recipe_hash(const fs::path& dir) const {
    try {
      if (!info_.contains("recipe")) return {};
      return recipe_hash(parse_recorded_recipe(info_, dir, DataCheck::none));
    } catch (const Error&) {
      return {};
    }
  }

  // Whether this process keeps the run's record (rank 0 of workers started without a launcher).
  bool active() const { return !file_.empty(); }
  // Rank 0's nominal world size: --nominal-world, else the one the run records; 0 for neither
  // (the world size) and on other ranks, which take rank 0's (TrainerOptions::nominal_world).
  int nominal_world() const { return nominal_world_; }
  // Whether the record says the run completed, and this start would continue it: it has nothing
  // to do (and keeps no record).
  bool completed() const { return completed_; }

  // Once the ranks met: their backend, store and hosts (`hosts`: each rank's host name, by rank;
  // empty where one did not say), as a launcher records them: hosts with their slots and ranks.
  // The generation's hosts start with rank 0's, whose pid it records.
  void met(const std::string& backend, const std::string& store,
           const std::vector<std::string>& hosts) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (file_.empty() || closed_) return;
    info_["backend"] = backend;
    info_["store"] = store;
    json by_host = json::array(), names = json::array();
    for (size_t r = 0; r < hosts.size(); ++r) {
      if (hosts[r].empty()) continue;
      auto same = std::find_if(by_host.begin(), by_host.end(),
                               [&](const json& h) { return h["host"] == hosts[r]; });
      if (same == by_host.end()) {
        by_host.push_back({{"host", hosts[r]}, {"slots", 0}, {"ranks", json::array()}});
        names.push_back(hosts[r]);
        same = by_host.end() - 1;
      }
      (*same)["slots"] = (*same)["slots"].get<int>() + 1;
      (*same)["ranks"].push_back(r);
    }
    info_["hosts"] = std::move(by_host);
    if (!names.empty()) {
      if (change_.is_object()) change_["hosts"] = names;  // a change of size, still to record
      info_["generations"].back()["hosts"] = std::move(names);
    }
    save();
  }

  // Where the ranks found their checkpoint (rank 0's "rendezvous" event), as a launcher records
  // it: a checkpoint's name, or "step 0" when a search found none.
  void rendezvous(const json& event, const std::string& resume) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (file_.empty() || closed_) return;
    json& gen = info_["generations"].back();
    // When the ranks met (status: generation_starting until then, as for a launcher's).
    gen["met_at"] = utc_timestamp();
    if (event.contains("backend")) gen["backend"] = event["backend"];
    if (event.contains("resumed_from")) {
      gen["resumed_from"] = event["resumed_from"];
    } else if (!resume.empty()) {
      gen["resumed_from"] = "step 0";
    }
    step_ = event.value("step", int64_t{0});
    if (change_.is_object()) {
      json& changes = info_["world_size_changes"];
      if (!changes.is_array()) changes = json::array();
      changes.push_back(std::move(change_));
      change_ = nullptr;
    }
    save();
  }
  void reached(int64_t step) {
    const std::lock_guard<std::mutex> lock(mutex_);
    step_ = std::max(step_, step);
  }

  // How the generation ended: completed, terminated (SIGTERM), interrupted (SIGINT) or failed,
  // with rank 0's exit code, as a launcher records the failed rank's (2: a recipe or data problem
  // or a diverged training, which a resume would meet again). The first end is the record's: the
  // StopWatcher may end it while the ranks still work.
  void finish(const std::string& status, const std::string& error = {}, int exit_code = 0) {
    const std::lock_guard<std::mutex> lock(mutex_);
    if (file_.empty() || closed_) return;
    closed_ = true;
    info_["status"] = status;
    json& gen = info_["generations"].back();
    gen["ended_at"] = utc_timestamp();
    gen["status"] = status;
    if (step_ >= 0) gen["step"] = step_;
    if (!error.empty()) info_["error"] = gen["error"] = error;
    gen["exit_code"] = exit_code;
    if (exit_code == 2) gen["would_repeat"] = true;
    save();
  }

 private:
  void save() {
    try {
      write_file_atomic(file_, json_text(info_, 2) + "\n");
    } catch (const Error& e) {
      // The run's record, not the run: training goes on without it.
      std::fprintf(stderr, "dptrain: warning: %s\n", e.what());
      file_.clear();
    }
  }

  fs::path file_;  // empty: nothing to keep
  json info_;
  std::mutex mutex_;
  bool closed_ = false;
  bool completed_ = false;
  int nominal_world_ = 0;
  int64_t step_ = -1;  // the step the generation started from, then the furthest logged
  json change_;        // a change of world size to record when the ranks meet
};

// Posts a stop to the job's store before the rank exits (workers started without a launcher,
// whose peers are not stopped with it): a peer waiting for it to start, or whose collective then
// fails, names the stop, with its exit code, instead of a peer gone silent. Quick to give up:
// nothing to tell without a store.
using TellPeers = std::function<void(const Error&)>;

// Stop signals, answered from a thread of their own. A rank answers SIGTERM at a step boundary,
// with a checkpoint; one still meeting its peers (waiting for the store or the other ranks, up
// to distributed.timeout_s) or reading its checkpoint has none to write and stops at once, exit
// 143. SIGINT, caught only by rank 0 of workers started without a launcher, stops it at once
// (exit 130) after recording the run as interrupted: dying of the signal left run.json
// "running".
class StopWatcher {
 public:
  StopWatcher(int rank, HandRunRecord* record, const ProgressTracker& progress,
              std::filesystem::path run_dir, TellPeers tell_peers)
      : thread_([rank, record, &progress, run_dir = std::move(run_dir),
                 tell_peers = std::move(tell_peers)] {
          watch(rank, record, progress, run_dir, tell_peers);
        }) {}
  ~StopWatcher() {
    const char end = 0;
    (void)!::write(g_signal_pipe[1], &end, 1);
    thread_.join();
  }

 private:
  static void watch(int rank, HandRunRecord* record, const ProgressTracker& progress,
                    const std::filesystem::path& run_dir, const TellPeers& tell_peers) {
    for (;;) {
      pollfd fd{g_signal_pipe[0], POLLIN, 0};
      if (::poll(&fd, 1, -1) < 0 && errno != EINTR) return;
      char byte = 0;
      if (::read(g_signal_pipe[0], &byte, 1) != 1) continue;
      if (byte == 0) return;
      int answer = 0;
      if (byte == SIGINT && g_stop_answer.compare_exchange_strong(answer, 2)) {
        // newest-or-start before the first checkpoint: "newest" would find none. (A directory
        // that cannot be listed now says the one that works either way.)
        std::string how = "--resume newest-or-start";
        try {
          how = hand_resume_flag(run_dir);
        } catch (const std::exception&) {
        }
        stop(rank, record, 130, "interrupted",
             fmt::format("stopped by SIGINT (no checkpoint is written for it: the workers "
                         "started again with '{}' continue the run)",
                         how));
      }
      answer = 0;
      if (byte == SIGTERM && !progress.stepping() &&
          g_stop_answer.compare_exchange_strong(answer, 2)) {
        // Before its first step a rank stops alone (mid-run the ranks agree on a stop): its
        // peers are told, where no launcher stops them too.
        const std::string why =
            "stopped by SIGTERM before its first step (nothing to checkpoint yet)";
        if (tell_peers) tell_peers(Error(ErrorKind::terminated, why));
        stop(rank, record, 143, "terminated", why);
      }
    }
  }

  [[noreturn]] static void stop(int rank, HandRunRecord* record, int code, const char* status,
                                const std::string& why) {
    const std::string error = fmt::format("rank {}: {}", rank, why);
    if (record != nullptr) record->finish(status, error, code);
    // Under a launcher the stop is the launcher's doing, and its own error says why: the rank's
    // line, shown among the launcher's output, is no second error (a host that failed to
    // connect would otherwise be preceded by a healthy rank's "error").
    const std::string line = fmt::format(
        "{}{}\n", started_by_launcher() ? std::string_view("dptrain: ") : kErrorLinePrefix, error);
    (void)!::write(STDERR_FILENO, line.data(), line.size());
    ::_exit(code);
  }

  std::thread thread_;
};

// The exit code of a worker waiting in its Farewell: a stop signal then ends the wait, with the
// code its error chose.
volatile std::sig_atomic_t g_farewell_code = 1;

void on_signal_in_farewell(int) {
  ::_exit(g_farewell_code);
}

// A stop signal now ends the process at once with `code`, the one its error chose (nothing
// answers the worker's stop any more); one that came since the StopWatcher ended: at once.
void exit_on_stop_signals(int code) {
  g_farewell_code = code;
  for (const int sig : {SIGINT, SIGTERM}) {
    struct sigaction sa {};
    if (::sigaction(sig, nullptr, &sa) == 0 && sa.sa_handler == on_stop_signal) {
      sa.sa_handler = on_signal_in_farewell;
      sigemptyset(&sa.sa_mask);
      sa.sa_flags = 0;
      ::sigaction(sig, &sa, nullptr);
    }
  }
  // (A 0 byte is the StopWatcher's own end.)
  for (char byte = 0; g_signal_pipe[0] >= 0 && ::read(g_signal_pipe[0], &byte, 1) == 1;) {
    if (byte != 0) ::_exit(code);
  }
}

// Rank 0's refusal of a run directory whose lock another dptrain holds.
Error run_dir_locked(const std::string& run_dir) {
  return Error(ErrorKind::usage,
               fmt::format("--run-dir {}: another dptrain is running a run there (a launcher, "
                           "or workers started without one: it holds {}); give another "
                           "--run-dir",
                           run_dir, (fs::path(run_dir) / ".lock").lexically_normal().string()));
}

// What a worker that failed leaves for after its error is printed (main runs it just before the
// worker exits). Where it could not start, its peers learn why through the store and fail at once
// naming it, rather than wait for it until their timeout; where rank 0 serves the store, the store
// stays up until the others have read why the start failed (a few seconds at most).
struct Farewell {
  static constexpr std::chrono::seconds kWait{5};
  // How long it waits for the store and for the peers: kWait, or the rank's --timeout (or
  // distributed.timeout_s) when that is shorter.
  std::chrono::milliseconds wait = kWait;
  std::unique_ptr<TcpStoreServer> server;
  // The store, once known (and, with --host-store, rank 0's started): nothing is told before.
  std::string host;
  uint16_t port = 0;
  std::string secret;
  std::string prefix;
  int rank = -1;
  int world = 0;
  bool at_start = false;  // it went to the store to start: a failure since is not a refusal
  // The ranks agreed to start: a failure since may be its own. (Read by the StopWatcher's
  // thread too.)
  std::atomic<bool> met = false;
  bool from_peer = false;  // its error is a peer's failure, which that peer posted
  bool stopped = false;    // by a signal: the peers stop too, and look for nothing
  // Rank 0 waited its whole timeout for the peers' answers: one that gave none by then is not
  // there to be told anything.
  bool waited_out = false;
  std::vector<int> gone;  // peers whose heartbeats stood still: none will look either
  std::optional<Error> refusal;
  // Refused as the run's lock is another's (run_dir_locked): without a store of its own, the
  // store it would tell is most likely the live job's (this rank 0 started again by mistake),
  // whose ranks must not take its refusal for their rank 0's.
  bool lock_refused = false;
  // A failure of its own once the ranks met (not a communication error: a peer's exit causes
  // those; nor a stop), for the peers whose collectives fail as it leaves (peer_failure).
  std::optional<Error> failure;
  int exit_code = 1;  // the one its error chose

  // Reaches the store within `within` and posts `refused` (its answer to the start, for peers
  // still meeting) and `failed` (for peers in a collective with it); then `after` uses the store.
  // Throws where there is no store to reach.
  void post(const Error* refused, const Error* failed, std::chrono::milliseconds within,
            const std::function<void(Store&)>& after = {}) const {
    TcpStoreClient client(host, port, within, secret, within);
    PrefixStore store(prefix, client);
    if (refused) refuse_to_start(store, rank, world, *refused);
    if (failed) report_failure(store, rank, *failed);
    if (after) after(store);
  }

  void operator()() const {
    // A launcher stops every rank as soon as one exits, naming that one: the others are told
    // nothing (they would fail with its code, and could be taken for the cause).
    // (A rank other than 0 always has rank 0 to tell, even given a world size of 1 by mistake.)
    if ((world < 2 && rank < 1) || host.empty() || (!refusal && !failure && !server) ||
        started_by_launcher() || (lock_refused && !server)) {
      return;
    }
    exit_on_stop_signals(exit_code);
    try {
      post(refusal ? &*refusal : nullptr, failure ? &*failure : nullptr, wait, [&](Store& store) {
        if (!server) return;
        wait_until_told(store, world, wait, waited_out);
        // Once the ranks met, whoever failed: the peers look for a failure posted (their own
        // collectives may fail seconds apart, and with the store they would lose the answer).
        if (met && !stopped) wait_until_heard(store, world, wait, gone);
      });
    } catch (const std::exception&) {
      // A store that is not there (rank 0 did not start it): nobody to tell.
    }
  }
};

// `o` is the command line's: filled from the environment here, so that the caller names the rank.
// `lock`: the run's lock, held by rank 0 of workers started without a launcher; the caller
// keeps it until the record is finished, so that a rank 0 started again at once cannot read the
// record before this one has written how its generation ended.
int run_worker(WorkerOptions& o, std::optional<HandRunRecord>& record, Farewell& farewell,
               std::shared_ptr<const int>& lock) {
  install_worker_signal_handlers();  // again: main installs them first, for `dptrain worker`
  fill_from_env(o);
  const auto [host, port] = [&o] {
    try {
      return parse_host_port(o.store);
    } catch (const Error& e) {
      throw Error(e.kind(), fmt::format("{}: {}", o.store_from, e.what()));
    }
  }();
  // The job secret comes through the environment only; "" means an open store (by hand).
  const std::string secret = env(kStoreSecretEnv).value_or("");
  // Rank 0 serving the store starts it first: the other ranks learn through it why this one
  // cannot start (Farewell).
  if (o.host_store && o.rank == 0) {
    // A store name that does not resolve is a setting to fix, said at once: not a port open on
    // every interface while the ranks wait for the store they cannot reach.
    try {
      local_address_towards(host, port);
    } catch (const Error& e) {
      if (std::string_view(e.what()).starts_with("cannot resolve")) {
        throw Error(ErrorKind::usage, fmt::format("{}: {}", o.store_from, e.what()));
      }
    }
    // A loopback store address keeps the store on this machine: nothing beyond it can reach
    // it (a store started by hand has no secret unless DPTRAIN_STORE_SECRET gives one).
    // "localhost" as 127.0.0.1: a name binds only the first address it resolves to.
    const std::string bind = host == "localhost"      ? "127.0.0.1"
                             : is_loopback_host(host) ? host
                                                      : "0.0.0.0";
    try {
      farewell.server = std::make_unique<TcpStoreServer>(bind, port, secret);
    } catch (const Error& e) {
      // Most likely the very job that runs in this directory (started again by mistake): that
      // is what to say.
      if (!started_by_launcher() && run_locked_by_another(o.run_dir)) {
        farewell.lock_refused = true;
        throw run_dir_locked(o.run_dir);
      }
      // The ranks' settings, not the network: exit 2, as a launcher's --master-port in use.
      const std::string cause = e.what();
      throw Error(ErrorKind::usage,
                  fmt::format("--host-store: the store cannot listen on port {} ({}); give the "
                              "store (--store, DPTRAIN_STORE or MASTER_PORT) a free port",
                              port,
                              cause.starts_with("cannot listen on ")
                                  ? cause.substr(std::string("cannot listen on ").size())
                                  : cause));
    }
  }
  farewell.host = host;
  farewell.port = port;
  farewell.secret = secret;
  farewell.prefix = generation_prefix(o.generation);
  farewell.rank = o.rank;
  farewell.world = o.world_size;
  if (o.timeout_s > 0) {
    farewell.wait = std::min<std::chrono::milliseconds>(
        Farewell::kWait, std::chrono::milliseconds(static_cast<int64_t>(1000.0 * o.timeout_s)));
  }
  // Checked once the farewell knows the store: rank 0 (of the job's true world size) learns at
  // once that this rank was given another one, rather than wait for it until its timeout.
  if (o.rank >= o.world_size) {
    throw Error(ErrorKind::usage, fmt::format("rank {}: outside world size {} (ranks are 0 to {})",
                                              o.rank, o.world_size, o.world_size - 1));
  }
  // A node holds at most the whole world (on cuda the local rank picks the GPU).
  if (o.local_rank >= o.world_size) {
    throw Error(ErrorKind::usage,
                fmt::format("rank {}: local rank (--local-rank or LOCAL_RANK) {} is outside world "
                            "size {} (a node's ranks are 0 to {})",
                            o.rank, o.local_rank, o.world_size, o.world_size - 1));
  }
  const FaultInjector faults(parse_faults(env("DPTRAIN_FAULT").value_or("")), o.rank, o.generation);
  const Recipe recipe = load_recipe(o.recipe);
  // The parameter-server mode's messages go through Gloo (the recipe refuses "nccl" with it).
  const std::string requested = recipe.distributed.sync == "ps"
                                    ? "gloo"
                                    : env("DPTRAIN_BACKEND").value_or(recipe.distributed.backend);
  if (requested != "auto" && requested != "gloo" && requested != "nccl") {
    throw Error(ErrorKind::usage,
                fmt::format("backend '{}' is unknown (use auto, gloo or nccl)", requested));
  }
  // The op table first: NCCL orders its stream after the op table's. With one GPU visible (the
  // launcher gives each rank its own) that one; else the local rank's.
  const int gpu = recipe.train.device == "cuda" && cuda_device_count() != 1 ? o.local_rank : 0;
  const std::shared_ptr<Ops> ops = make_ops(recipe.train.device, gpu);
  const auto timeout = std::chrono::milliseconds(static_cast<int64_t>(
      1000.0 * (o.timeout_s > 0 ? o.timeout_s : recipe.distributed.timeout_s)));
  farewell.wait = std::min<std::chrono::milliseconds>(Farewell::kWait, timeout);
  // The recipe is the same on every rank: they all say so, as the launcher does (exit 2).
  if (requested == "nccl" && ops->device() == "cpu") {
    throw Error(
        ErrorKind::usage,
        fmt::format("rank {}: backend nccl ({}): this rank computes on the CPU "
                    "(train.device \"{}\"); NCCL needs \"cuda\": use gloo or auto",
                    o.rank, env("DPTRAIN_BACKEND") ? "DPTRAIN_BACKEND" : "distributed.backend",
                    recipe.train.device));
  }

  // A checkpoint named that is none: rank 0, which reads it, refuses before the ranks meet (the
  // others learn why from the store) rather than fail at its meta.json once they have.
  if (o.rank == 0 && !o.resume.empty() && o.resume != "newest" && o.resume != "newest-or-start") {
    std::error_code ec;
    const fs::path dir = o.resume;
    if (!fs::is_directory(dir, ec)) {
      throw Error(ErrorKind::checkpoint,
                  fmt::format("--resume {}: {}", o.resume,
                              fs::exists(fs::symlink_status(dir, ec))
                                  ? "not a directory (a checkpoint is a run's "
                                    "checkpoints/step-NNNNNN directory)"
                                  : "no such checkpoint directory"));
    }
    if (!fs::exists(dir / "meta.json", ec)) {
      throw Error(
          ErrorKind::checkpoint,
          fmt::format("--resume {}: not a checkpoint directory (it holds no meta.json)", o.resume));
    }
    // Without a launcher (which verified it before it started the ranks), its checksums too:
    // a damaged one is refused before the run's record takes a generation that could not start.
    if (!started_by_launcher()) {
      if (const CheckpointStatus checked = verify_checkpoint(dir); !checked.ok()) {
        throw Error(ErrorKind::checkpoint,
                    fmt::format("--resume {}: {}", o.resume, fmt::join(checked.problems(), "; ")));
      }
    }
  }

  {
    // The directory's problems named as the launcher names them (exit 2), not as the first file
    // a rank fails to write there.
    std::error_code ec;
    std::filesystem::create_directories(o.run_dir, ec);
    if (!std::filesystem::is_directory(o.run_dir)) {
      throw Error(ErrorKind::usage, fmt::format("--run-dir {}: {}", o.run_dir,
                                                std::filesystem::exists(o.run_dir) || !ec
                                                    ? std::string("not a directory")
                                                    : "cannot create it: " + ec.message()));
    }
    if (::access(o.run_dir.c_str(), W_OK | X_OK) != 0) {
      throw Error(ErrorKind::usage,
                  fmt::format("--run-dir {}: not writable: {}", o.run_dir, std::strerror(errno)));
    }
  }
  // A fresh start writes its checkpoints over any that the directory holds (a requeued job, a
  // run directory reused by mistake): refused before any rank connects. Only the node's
  // checkpoint writer looks; the others fail as their peer leaves.
  if (o.resume.empty() && o.local_rank == 0) {
    const auto held = list_checkpoints(std::filesystem::path(o.run_dir) / "checkpoints");
    if (!held.empty()) {
      throw Error(ErrorKind::usage,
                  fmt::format("--run-dir {}: holds checkpoints (the newest {}), which a fresh "
                              "start would write over; continue them with --resume newest, or "
                              "give a new --run-dir",
                              o.run_dir, held.front().filename().string()));
    }
  }
  // Another dptrain drives a run in this directory (a launcher, or the rank 0 of another job of
  // workers started without one): this job's metrics and checkpoints would mix with that run's.
  // Rank 0 of workers started without a launcher holds the run's lock, as a launcher does.
  if (o.rank == 0 && !started_by_launcher() && !(lock = try_lock_run(o.run_dir))) {
    farewell.lock_refused = true;
    throw run_dir_locked(o.run_dir);
  }
  // A pipe or a directory where rank 0 writes the run's files: exit 2 before any rank meets,
  // as resume says it, not a failed write steps later.
  if (o.rank == 0) check_run_files(o.run_dir);
  // And the run's record, which rank 0 keeps without a launcher: one it cannot write would
  // leave the run unrecorded, for status, report and resume to refuse.
  if (o.rank == 0 && !started_by_launcher()) {
    try {
      check_regular_or_missing(fs::path(o.run_dir) / "run.json");
    } catch (const Error& e) {
      throw Error(ErrorKind::usage, e.what());
    }
  }
  record.emplace(o, recipe);
  if (g_signal_pipe[0] < 0) throw Error(ErrorKind::internal, "cannot make the signal pipe");
  ProgressTracker progress;
  const TellPeers tell_peers = [&farewell](const Error& stopped) {
    // Not from the rank that serves the store: it goes with the rank, and the peers find it gone.
    if (started_by_launcher() || farewell.world < 2 || farewell.server) return;
    try {
      // For the peers still meeting (its answer, in place of one it may not have given) and
      // for those in a collective with it.
      farewell.post(farewell.met.load() ? nullptr : &stopped, &stopped, std::chrono::seconds(1));
    } catch (const std::exception&) {
      // No store to reach (rank 0's is gone): the peers find this rank silent.
    }
  };
  const StopWatcher watcher(o.rank, record->active() ? &*record : nullptr, progress, o.run_dir,
                            tell_peers);
  // Not where the worker was started ignoring it (`worker ... &` from a script): it stays so.
  if (struct sigaction sa{};
      record->active() && ::sigaction(SIGINT, nullptr, &sa) == 0 && sa.sa_handler != SIG_IGN) {
    catch_signal(SIGINT);
  }

  // Gloo connects every rank to every other (a full mesh): a connection to each, and room for
  // the rank's own files. Where Gloo is the only choice this is found before the rank goes to
  // the store to start: a refusal, which its peers learn at once (Farewell).
  const bool gloo_only = requested == "gloo" || ops->device() == "cpu";
  const auto require_mesh_files = [&] {
    require_open_files(
        static_cast<uint64_t>(o.world_size) - 1 + 32,
        fmt::format("rank {}: the connections to {} other rank(s)", o.rank, o.world_size - 1),
        "start fewer ranks in the job");
  };
  if (gloo_only) require_mesh_files();
  // One it cannot bind is its own refusal, which the others learn at once (Gloo crashed on a
  // name that does not resolve, and left them waiting for one it cannot bind).
  if (!o.bind.empty()) check_bind_address(o.bind, "--bind (DPTRAIN_BIND_ADDR)");
  farewell.at_start = true;
  faults.before_join();
  std::optional<TcpStoreClient> reached;
  try {
    reached.emplace(host, port, timeout, secret);
  } catch (const StoreUnreachable& e) {
    throw Error(e.kind(), e.what() + no_store_hint(o));
  }
  TcpStoreClient& client = *reached;
  PrefixStore store(farewell.prefix, client);
  if (started_by_launcher()) {
    store.set_join_advice(launched_join_advice("distributed.timeout_s"));
  } else if (o.generation != 1 || env_value("DPTRAIN_GENERATION")) {
    // Each generation's keys are its own: ranks given different ones never see each other.
    store.set_join_advice({.check = fmt::format("start every rank with the same store, world size "
                                                "and generation (this rank's: {}, from {})",
                                                o.generation, o.generation_from)});
  }
  // Beating from here on, before the ranks meet, where a launcher started the rank: its
  // --hang-timeout then also names a rank that froze (or cannot reach the store) while the others
  // wait for it to join, counted from when the rank was started (HangWatch::started). Not a
  // process given a rank that ran the job already (started again by hand, refused as the ranks
  // agree to start): its beats would hide that rank's silence.
  BeatStore beats(host, port, secret, o.generation, store);
  Store& beat_store = beats.store();
  std::optional<HeartbeatSender> heartbeat;
  const auto start_beating = [&] {
    if (!heartbeat) heartbeat.emplace(beat_store, o.rank, progress, std::chrono::seconds(1));
  };
  if (started_by_launcher() && !rank_met(store, o.rank)) start_beating();

  // Workers without a launcher say their host, for rank 0's record of the run (posted before
  // the answer rank 0 waits for, so it is there once the ranks agree).
  if (!started_by_launcher()) {
    store.set(fmt::format("host/{}", o.rank), this_host());
    // Ranks of different generations would never meet: refused at once, naming both.
    say_generation(client, o.rank, o.generation);
    if (const auto other = other_generation(client, o.rank, o.world_size, o.generation, false)) {
      throw refuse_other_generation(client, o.rank, o.world_size, o.generation, o.generation_from,
                                    *other, farewell.server != nullptr);
    }
  }
  std::unique_ptr<Communicator> comm;
  const std::string backend = [&] {
    try {
      return choose_backend(store, o.rank, o.world_size, requested, *ops, timeout);
    } catch (const KeyTimeout&) {
      farewell.waited_out = true;
      if (!started_by_launcher()) {
        // Why they never came, where that was another generation (a store gone meanwhile: the
        // timeout is the answer).
        std::optional<OtherGeneration> other;
        try {
          other = other_generation(client, o.rank, o.world_size, o.generation, true);
        } catch (const Error&) {
        }
        if (other) {
          throw refuse_other_generation(client, o.rank, o.world_size, o.generation,
                                        o.generation_from, *other, farewell.server != nullptr);
        }
      }
      throw;
    }
  }();
  if (backend == "nccl") {
    NcclOptions nccl;
    nccl.timeout = timeout;
    nccl.device = gpu;
    nccl.compute_stream = compute_stream(*ops);
    comm = make_nccl_communicator(store, o.rank, o.world_size, nccl);
  } else {
    GlooOptions gloo;
    gloo.hostname = !o.bind.empty() ? o.bind
                                    : (is_loopback_host(host) ? "127.0.0.1"
                                                              : local_address_towards(host, port));
    gloo.timeout = timeout;
    if (!gloo_only) require_mesh_files();  // moved to Gloo: the others learn it as it fails
    comm = make_gloo_communicator(store, o.rank, o.world_size, gloo);
  }
  farewell.met = true;
  start_beating();
  faults.after_join();  // slow-start: a long start, the heartbeat going on
  if (record->active()) {
    // Rank 0's (this process's) first: status checks its pid only on the generation's first host.
    std::vector<std::string> hosts(static_cast<size_t>(o.world_size));
    hosts[0] = this_host();
    for (int r = 1; r < o.world_size; ++r) {
      try {
        hosts[static_cast<size_t>(r)] =
            store.get(fmt::format("host/{}", r), std::chrono::milliseconds(500));
      } catch (const std::exception&) {
      }
    }
    record->met(backend, format_host_port(host, port), hosts);
  }

  const bool events = env("DPTRAIN_EVENTS").value_or("0") == "1";
  StatusPrinter status(stdout, !events && StatusPrinter::is_terminal(stdout));
  TrainerOptions topts;
  topts.ops = ops;
  topts.device_index = gpu;
  // Absolute, as a launcher gives it: result.json's last_checkpoint is a path to it.
  topts.run_dir = std::filesystem::absolute(o.run_dir).lexically_normal();
  topts.resume_from = o.resume;
  topts.node_leader = o.local_rank == 0;
  topts.nominal_world = o.nominal_world > 0 ? o.nominal_world : record->nominal_world();
  topts.run_completed = record->completed();
  topts.debug_step_delay_ms = std::atoll(env("DPTRAIN_DEBUG_STEP_DELAY_MS").value_or("0").c_str());
  topts.on_event = [&](const nlohmann::json& e) {
    const std::string kind = e.value("event", "");
    // The result is rank 0's last act of training: a signal from here on waits for the record
    // of how the run ended and the exit (a run that completed, not one interrupted).
    if (kind == "result") {
      int answer = 0;
      g_stop_answer.compare_exchange_strong(answer, 3);
    }
    if (kind == "rendezvous") record->rendezvous(e, o.resume);
    if (kind == "progress") record->reached(e.value("step", int64_t{0}));
    if (events) {
      std::printf("@event %s\n", json_text(e).c_str());
      std::fflush(stdout);
    } else {
      status.event(e);
    }
  };
  topts.progress = &progress;
  if (!started_by_launcher())
    topts.resume_how = "starting the workers again with '--resume newest'";
  // The store through the heartbeats' quick connection: a store slow to answer must not hold
  // the stop for the job's timeout.
  // Where a rank takes the stop: synchronous ranks at a step's end; local SGD at its next averaging
  // or within local_stop_wait_ms; parameter servers' at the step the servers choose, within
  // staleness + 2 steps of the request (the trainer's choose_ps_stop).
  const std::string stops_at =
      recipe.distributed.sync == "ps"
          ? fmt::format("the step the parameter servers choose (within {} steps)",
                        recipe.distributed.staleness + 2)
      : recipe.distributed.sync == "local_sgd"
          ? fmt::format(
                "the next averaging where that comes within {0} s, else within about {0} "
                "s (an early averaging)",
                topts.local_stop_wait_ms / 1000)
          : std::string("the end of this step (or of the next, where steps are short)");
  topts.stop_requested = [rank = o.rank, &store = beat_store, announced = false,
                          stops_at]() mutable {
    // In the training loop the trainer answers SIGTERM, unless the StopWatcher took one that
    // came before (the process is ending).
    if (g_stop_answer.load() == 2) {
      for (;;)
        ::pause();
    }
    if (!g_stop_requested.load()) return false;
    if (!announced) {
      // The launcher stopping the ranks for a peer that failed: the step under way cannot
      // complete, nor can a checkpoint.
      bool peer_failed = false;
      try {
        peer_failed = store.check({peer_failed_key()});
      } catch (const std::exception&) {
      }
      if (peer_failed) {
        std::printf(
            "received SIGTERM: a peer rank failed; rank %d stops (the step under way "
            "cannot complete: no checkpoint)\n",
            rank);
      } else {
        std::printf("received SIGTERM: rank %d checkpoints at %s and stops\n", rank,
                    stops_at.c_str());
      }
      std::fflush(stdout);
      announced = true;
      try {
        store.set(sigterm_key(rank), "1");  // for the launcher's account of the stop
      } catch (const std::exception&) {
      }
    }
    return true;
  };
  if (!faults.empty()) {
    topts.before_step = [&faults, &heartbeat](int64_t step) {
      faults.before_step(step, [&heartbeat] { heartbeat->flush(); });
    };
    topts.before_checkpoint_commit = [&faults](int64_t step) {
      faults.before_checkpoint_commit(step);
    };
  }
  TrainResult result;
  try {
    result = train(recipe, *comm, topts);
  } catch (const Error& e) {
    if (int answer = 0; !g_stop_answer.compare_exchange_strong(answer, 3) && answer != 3) {
      for (;;)  // the StopWatcher is ending the process
        ::pause();
    }
    // Asked to stop, and a peer left a collective: it stopped before its first step, as this
    // rank would have (each rank decides that alone) - the stop, not a failure.
    if (e.kind() == ErrorKind::comm && g_stop_requested.load()) {
      throw Error(ErrorKind::terminated,
                  fmt::format("stopped by SIGTERM; a peer left a collective meanwhile{}: {}",
                              progress.stepping() ? " (stopped too, or gone)"
                                                  : " (one stops at once before its first step)",
                              e.what()));
    }
    // A collective failed because a peer is gone: a launcher names it; without one the
    // heartbeats do (2.5 s, over two of their intervals).
    if (e.kind() != ErrorKind::comm || started_by_launcher() || o.world_size < 2) throw;
    // Through the heartbeats' connection, quick to give up: the job's waits up to the timeout
    // for a store that is gone with the peer.
    const std::string who = silent_peers(beat_store, o.rank, o.world_size,
                                         std::chrono::milliseconds(2500), &farewell.gone);
    // A peer that failed of itself (its data, say) posted why as it left: that, not the
    // connection it closed.
    if (auto told = peer_failure(beat_store, o.rank, o.world_size, progress.stepping())) {
      farewell.from_peer = true;
      throw *told;
    }
    if (!who.empty()) {
      throw Error(e.kind(), fmt::format("{}; {}{}", e.what(),
                                        who.starts_with("rank ") ? "silent: " : "", who));
    }
    // Every peer still beats, and the collective timed out: one is stuck outside it (its data,
    // say). Where each rank is, as a launcher says it.
    const std::string what = e.what();
    if (!HangWatch::timed_out(what)) throw;
    std::map<int, json> last_beats;
    bool store_gone = false;
    try {
      auto heard = read_heartbeats(beat_store, o.world_size);
      for (int r = 0; r < o.world_size; ++r) {
        auto& beat = heard[static_cast<size_t>(r)];
        if (r == o.rank) {
          last_beats[r] = progress.snapshot();
        } else if (beat) {
          last_beats[r] = std::move(*beat);
        }
      }
    } catch (const std::exception&) {
      store_gone = true;  // the error as it was
    }
    if (store_gone || last_beats.size() < 2) throw;
    throw Error(e.kind(), fmt::format("{}; by the ranks' last heartbeats, {}", what,
                                      HangWatch::positions(last_beats)));
  }
  // Training is over: a signal now waits for the record of how it ended, and the exit.
  if (int answer = 0; !g_stop_answer.compare_exchange_strong(answer, 3) && answer != 3) {
    for (;;)
      ::pause();
  }
  if (result.already_completed) {
    if (o.rank == 0) {
      std::printf("%s: the run already completed; nothing to resume\n", o.run_dir.c_str());
    }
    return 0;
  }
  if (result.stopped) {
    record->finish("terminated", "stopped by SIGTERM after a checkpoint", 143);
    return 143;
  }
  record->finish("completed");
  status.finish();
  return 0;
}

}  // namespace

void setup_worker(CLI::App& app, Outcome& outcome) {
  auto o = std::make_shared<WorkerOptions>();
  app.add_option("recipe", o->recipe, "Recipe JSON file")->required();
  app.add_option("--run-dir", o->run_dir, "Run directory (env DPTRAIN_RUN_DIR)");
  app.add_option("--resume", o->resume,
                 "Checkpoint directory to continue from; \"newest\": the newest valid one any "
                 "node holds; \"newest-or-start\": that, or step 0 when there is none");
  // Negative values are refused here: inside, -1 stands for "not given".
  app.add_option("--rank", o->rank, "This rank (env RANK)")->check(whole_number<int>("RANK"));
  app.add_option("--world-size", o->world_size, "Number of ranks (env WORLD_SIZE)")
      ->check(whole_number<int>("SIZE"));
  app.add_option("--local-rank", o->local_rank,
                 "Rank on this node (env LOCAL_RANK); local rank 0 writes the node's checkpoints")
      ->check(whole_number<int>("RANK"));
  app.add_option("--nominal-world", o->nominal_world,
                 "World size the job's global batch is defined by (env DPTRAIN_NOMINAL_WORLD; "
                 "default and 0: rank 0's, else the run's recorded one, else the world size)")
      ->check(whole_number<int>("SIZE"));
  app.add_option("--store", o->store,
                 "Store HOST:PORT (env DPTRAIN_STORE, or MASTER_ADDR and MASTER_PORT)");
  app.add_flag("--host-store", o->host_store,
               "Rank 0 serves the store itself on the store's port (env DPTRAIN_HOST_STORE=1)");
  app.add_option("--generation", o->generation, "Restart generation (env DPTRAIN_GENERATION)")
      ->check(whole_number<int>("N"));
  app.add_option("--bind", o->bind, "Address for this rank's transport (env DPTRAIN_BIND_ADDR)");
  app.add_option("--timeout", o->timeout_s,
                 "Seconds for store and collective waits (default and 0: distributed.timeout_s)")
      ->check(seconds());
  app.callback([o, &outcome] {
    std::shared_ptr<const int> lock;  // released after the record is finished
    std::optional<HandRunRecord> record;
    auto farewell = std::make_shared<Farewell>();
    const auto leave = [&] { outcome.finally = [farewell] { (*farewell)(); }; };
    try {
      outcome.exit_code = run_worker(*o, record, *farewell, lock);
    } catch (const Error& e) {
      if (!farewell->at_start) {
        farewell->refusal = e;
      } else if (farewell->met && !farewell->from_peer && e.kind() != ErrorKind::comm &&
                 !is_stop_kind(e.kind())) {
        farewell->failure = e;
      }
      farewell->exit_code = exit_code(kind_after_stop(e.kind()));
      // (Stopped because a peer was, alone: the other peers still look for why at the store.)
      farewell->stopped = is_stop_kind(kind_after_stop(e.kind())) && !farewell->from_peer;
      leave();
      // Name the rank: many ranks' errors end up interleaved in one terminal. Some name it
      // themselves (the trainer's, for a launcher that reads only that line).
      const std::string own = fmt::format("rank {}: ", o->rank);
      const std::string what = e.what();
      const std::string named = o->rank >= 0 && !what.starts_with(own) ? own + what : what;
      if (record) {
        // As its exit code says it: a failure while a stop signal was pending is the stop's.
        const ErrorKind kind = kind_after_stop(e.kind());
        record->finish(kind == ErrorKind::terminated    ? "terminated"
                       : kind == ErrorKind::interrupted ? "interrupted"
                                                        : "failed",
                       named, farewell->exit_code);
      }
      // Stopped under a launcher (a peer failed, or the job was stopped): the launcher's own
      // error says why, and this rank's line among its output is no second error (the first
      // "error" on the screen would be a healthy rank's), as the StopWatcher's stops say it.
      // (A real failure while a stop was pending keeps its "error"; a collective that failed
      // then is the stop's: a peer that stopped at once left it.)
      const ErrorKind stop_kind =
          e.kind() == ErrorKind::comm ? kind_after_stop(e.kind()) : e.kind();
      if (started_by_launcher() && is_stop_kind(stop_kind)) {
        std::fprintf(stderr, "dptrain: %s\n", named.c_str());
        outcome.exit_code = farewell->exit_code;
        return;
      }
      throw Error(e.kind(), named);
    } catch (const std::exception& e) {
      // Not dptrain's own (out of memory, a filesystem error): main says what; the record ends.
      if (!farewell->at_start) {
        farewell->refusal = Error(ErrorKind::internal, e.what());
      } else if (farewell->met) {
        farewell->failure = Error(ErrorKind::internal, e.what());
      }
      leave();
      if (record) record->finish("failed", fmt::format("rank {}: {}", o->rank, e.what()), 1);
      throw;
    }
  });
}

}  // namespace dptrain::cli
