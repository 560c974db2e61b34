// Hang attribution: each rank publishes where it is (step, phase, collectives entered) to the
// store, at once when its step changes and at least once an interval; the launcher compares them
// when progress stops, and takes the step a failure came at from them.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/comm/store.hpp"
#include "core/comm/tcp_store.hpp"

namespace dptrain {

// `measure`: a benchmark's own work between its collectives (filling and checking buffers).
enum class Phase : int {
  starting,
  data,
  compute,
  collective,
  optimizer,
  eval,
  checkpoint,
  done,
  measure
};
const char* phase_name(Phase phase);

// Written by the training loop (cheap atomics), read by the heartbeat thread.
class ProgressTracker {
 public:
  // Called as each step begins: from the first on, the rank is in its training loop.
  void set_step(int64_t step) {
    step_.store(step, std::memory_order_relaxed);
    stepping_.store(true, std::memory_order_release);
  }
  // Whether the training loop has begun (the first step started), not only the meeting.
  bool stepping() const { return stepping_.load(std::memory_order_acquire); }
  void enter(Phase phase) {
    phase_.store(static_cast<int>(phase), std::memory_order_relaxed);
    progress_.fetch_add(1, std::memory_order_relaxed);
  }
  // Before each collective: its sequence number tells who is waiting for whom, and `what` (a
  // string literal: "allreduce of the loss") which collective it is; `index` >= 0 numbers one of
  // several ("allreduce of gradient bucket 3").
  void enter_collective(const char* what, int64_t index = -1) {
    what_.store(what, std::memory_order_relaxed);
    index_.store(index, std::memory_order_relaxed);
    seq_.fetch_add(1, std::memory_order_relaxed);
    enter(Phase::collective);
  }
  // {"step", "phase", "seq", "progress", "collective", "stepping"}: the last collective entered,
  // by name; "stepping" false while the rank starts (its step is not yet the run's: a resume's
  // rank says 0 until it has loaded its checkpoint).
  nlohmann::json snapshot() const;
  int64_t step() const { return step_.load(std::memory_order_relaxed); }
  // What the sender publishes at once when it changes: the step, and the long phases a step
  // boundary leads into (eval, checkpoint, done), each a number.
  int64_t milestone() const {
    const auto phase = static_cast<Phase>(phase_.load(std::memory_order_relaxed));
    const bool long_phase = phase == Phase::eval || phase == Phase::checkpoint ||
                            phase == Phase::done || phase == Phase::starting;
    return step() * 8 + (long_phase ? static_cast<int64_t>(phase) : 0);
  }

 private:
  std::atomic<int64_t> step_{0};
  std::atomic<int> phase_{0};
  std::atomic<int64_t> seq_{0};
  std::atomic<const char*> what_{""};
  std::atomic<int64_t> index_{-1};
  std::atomic<int64_t> progress_{0};
  std::atomic<bool> stepping_{false};
};

std::string heartbeat_key(int rank);  // "heartbeat/<rank>", under the generation's prefix
// Each of `world` ranks' last heartbeat (a JSON object), in one store request: nullopt where it
// has published none or it does not parse. Store errors propagate.
std::vector<std::optional<nlohmann::json>> read_heartbeats(Store& store, int world);
// Set by a rank that received SIGTERM itself (a node being preempted), so the launcher can name
// it: every rank then stops, and the first to exit is not necessarily the one signalled.
std::string sigterm_key(int rank);  // "sigterm/<rank>", under the generation's prefix
// Set by the launcher as it learns that a rank failed, before it stops the others: a rank that
// then receives SIGTERM says it stops for a peer's failure (the step under way cannot complete,
// so no checkpoint comes), not that it checkpoints. "peer_failed", under the generation's prefix.
std::string peer_failed_key();

// After a collective failed on `rank` (a peer gone, without a launcher to say which): the other
// ranks whose heartbeat stood still over `apart` (longer than a sender's interval), as
// "rank 1 (no heartbeat for 2.5s: exited, killed or frozen)"; or that the store
// itself stopped answering (the process serving it is gone, e.g. rank 0 with --host-store).
// "" when every peer still beats or the heartbeats say nothing. Never throws. `silent`, when
// given, gets those ranks.
std::string silent_peers(Store& store, int rank, int world, std::chrono::milliseconds apart,
                         std::vector<int>* silent = nullptr);

// The heartbeats' own connection to the store at host:port (under the generation's prefix), quick
// to give up: a store gone with its process (rank 0 with --host-store) would otherwise hold each
// beat, and the rank's exit, for the job's whole timeout. Where the store has no room for it (or
// is slow to answer now), `fallback`, the job's connection, carries them.
class BeatStore {
 public:
  BeatStore(const std::string& host, uint16_t port, const std::string& secret, int generation,
            Store& fallback);
  Store& store() { return prefix_ ? static_cast<Store&>(*prefix_) : fallback_; }

 private:
  std::optional<TcpStoreClient> client_;
  std::optional<PrefixStore> prefix_;
  Store& fallback_;
};

// Sends the tracker's snapshot to the store every `interval`, and within kStepPoll of a step
// change or of entering eval or a checkpoint, until destroyed; a last one as it is destroyed (a
// rank that fails unwinds through it, so the store holds the step it failed at). Each carries
// "beat", counting the sends: a launcher that sees it stand still knows the rank's process is
// frozen or gone, not merely waiting. Store errors are ignored: the heartbeat must never be what
// fails a run.
class HeartbeatSender {
 public:
  HeartbeatSender(Store& store, int rank, const ProgressTracker& tracker,
                  std::chrono::milliseconds interval);
  ~HeartbeatSender();
  HeartbeatSender(const HeartbeatSender&) = delete;
  HeartbeatSender& operator=(const HeartbeatSender&) = delete;

  // How often the step is looked at: a failure's step is known to the launcher this soon, at a
  // cost of at most 1/kStepPoll store writes a second.
  static constexpr std::chrono::milliseconds kStepPoll{20};

  // Sends the snapshot now, from the caller's thread (what a failure about to happen leaves).
  void flush() { publish(); }

 private:
  void publish();
  void loop();

  Store& store_;
  const int rank_;
  const ProgressTracker& tracker_;
  const std::chrono::milliseconds interval_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::mutex publish_mutex_;  // flush() publishes from another thread
  int64_t beats_ = 0;         // under publish_mutex_
  std::thread thread_;
};

}  // namespace dptrain
