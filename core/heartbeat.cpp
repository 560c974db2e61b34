// Hang attribution: per-rank progress published to the store.
#include "core/heartbeat.hpp"

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
    case Phase::allreduce:
      return "allreduce";
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
  return {{"step", step_.load(std::memory_order_relaxed)},
          {"phase", phase_name(static_cast<Phase>(phase_.load(std::memory_order_relaxed)))},
          {"seq", seq_.load(std::memory_order_relaxed)},
          {"progress", progress_.load(std::memory_order_relaxed)}};
}

std::string heartbeat_key(int rank) {
  return fmt::format("heartbeat/{}", rank);
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

void HeartbeatSender::loop() {
  std::unique_lock lock(mutex_);
  while (!stop_) {
    lock.unlock();
    try {
      store_.set(heartbeat_key(rank_), tracker_.snapshot().dump());
    } catch (const std::exception&) {
    }
    lock.lock();
    wake_.wait_for(lock, interval_, [this] { return stop_; });
  }
}

}  // namespace dptrain
