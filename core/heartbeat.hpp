// Hang attribution: each rank publishes where it is (step, phase, collectives entered) to the
// store once a second; the launcher compares them when progress stops.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/comm/store.hpp"

namespace dptrain {

enum class Phase : int { starting, data, compute, allreduce, optimizer, eval, checkpoint, done };
const char* phase_name(Phase phase);

// Written by the training loop (cheap atomics), read by the heartbeat thread.
class ProgressTracker {
 public:
  void set_step(int64_t step) { step_.store(step, std::memory_order_relaxed); }
  void enter(Phase phase) {
    phase_.store(static_cast<int>(phase), std::memory_order_relaxed);
    progress_.fetch_add(1, std::memory_order_relaxed);
  }
  // Before each collective: its sequence number tells who is waiting for whom.
  void enter_collective() {
    seq_.fetch_add(1, std::memory_order_relaxed);
    enter(Phase::allreduce);
  }
  nlohmann::json snapshot() const;  // {"step", "phase", "seq", "progress"}

 private:
  std::atomic<int64_t> step_{0};
  std::atomic<int> phase_{0};
  std::atomic<int64_t> seq_{0};
  std::atomic<int64_t> progress_{0};
};

std::string heartbeat_key(int rank);  // "heartbeat/<rank>", under the generation's prefix

// Sends the tracker's snapshot to the store every `interval` until destroyed. Store errors are
// ignored: the heartbeat must never be what fails a run.
class HeartbeatSender {
 public:
  HeartbeatSender(Store& store, int rank, const ProgressTracker& tracker,
                  std::chrono::milliseconds interval);
  ~HeartbeatSender();
  HeartbeatSender(const HeartbeatSender&) = delete;
  HeartbeatSender& operator=(const HeartbeatSender&) = delete;

 private:
  void loop();

  Store& store_;
  const int rank_;
  const ProgressTracker& tracker_;
  const std::chrono::milliseconds interval_;
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace dptrain
