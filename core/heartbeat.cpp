// Hang attribution: per-rank progress published to the store.
#include "core/heartbeat.hpp"

#include <algorithm>

#include <fmt/format.h>

namespace dptrain {

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::starting:
      return "starting";
    case Phase::data:
      return "data";
    case Phase::compute:
      return "forward/backward";
    case Phase::collective:
      return "collective";
    case Phase::optimizer:
      return "optimizer";
    case Phase::eval:
      return "eval";
    case Phase::checkpoint:
      return "checkpoint";
    case Phase::done:
      return "done";
  }
  return "unknown";
}

nlohmann::json ProgressTracker::snapshot() const {
  const int64_t index = index_.load(std::memory_order_relaxed);
  const char* what = what_.load(std::memory_order_relaxed);
  return {{"step", step_.load(std::memory_order_relaxed)},
          {"phase", phase_name(static_cast<Phase>(phase_.load(std::memory_order_relaxed)))},
          {"seq", seq_.load(std::memory_order_relaxed)},
          {"progress", progress_.load(std::memory_order_relaxed)},
          {"collective", index >= 0 ? fmt::format("{} {}", what, index) : std::string(what)}};
}

std::string heartbeat_key(int rank) {
  return fmt::format("heartbeat/{}", rank);
}

std::string sigterm_key(int rank) {
  return fmt::format("sigterm/{}", rank);
}

HeartbeatSender::HeartbeatSender(Store& store, int rank, const ProgressTracker& tracker,
                                 std::chrono::milliseconds interval)
    : store_(store), rank_(rank), tracker_(tracker), interval_(interval) {
  thread_ = std::thread([this] { loop(); });
}

HeartbeatSender::~HeartbeatSender() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void HeartbeatSender::publish() {
  try {
    nlohmann::json beat = tracker_.snapshot();
    beat["beat"] = ++beats_;
    store_.set(heartbeat_key(rank_), beat.dump());
  } catch (const std::exception&) {
  }
}

void HeartbeatSender::loop() {
  std::unique_lock lock(mutex_);
  while (!stop_) {
    const int64_t milestone = tracker_.milestone();
    lock.unlock();
    publish();
    lock.lock();
    const auto due = std::chrono::steady_clock::now() + interval_;
    while (!stop_ && std::chrono::steady_clock::now() < due && tracker_.milestone() == milestone) {
      wake_.wait_for(lock, std::min(kStepPoll, interval_), [this] { return stop_; });
    }
  }
  lock.unlock();
  publish();
}

}  // namespace dptrain
