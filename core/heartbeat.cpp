// Hang attribution: per-rank progress published to the store.
#include "core/heartbeat.hpp"

#include <algorithm>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.hpp"

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
    case Phase::measure:
      return "measure";
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
          {"collective", index >= 0 ? fmt::format("{} {}", what, index) : std::string(what)},
          {"stepping", stepping()}};
}

std::string heartbeat_key(int rank) {
  return fmt::format("heartbeat/{}", rank);
}

std::vector<std::optional<nlohmann::json>> read_heartbeats(Store& store, int world) {
  std::vector<std::optional<nlohmann::json>> beats;
  for (const auto& said : store.peek(rank_keys(heartbeat_key, 0, world))) {
    nlohmann::json beat = said ? nlohmann::json::parse(*said, nullptr, false) : nlohmann::json();
    beats.push_back(beat.is_object() ? std::optional(std::move(beat)) : std::nullopt);
  }
  return beats;
}

std::string sigterm_key(int rank) {
  return fmt::format("sigterm/{}", rank);
}

std::string peer_failed_key() {
  return "peer_failed";
}

std::string silent_peers(Store& store, int rank, int world, std::chrono::milliseconds apart,
                         std::vector<int>* silent_ranks) {
  // Each peer's beat count; -1 where it has published none (it never started).
  const auto beats = [&] {
    std::vector<int64_t> out(static_cast<size_t>(world), -1);
    const auto all = read_heartbeats(store, world);
    for (int r = 0; r < world; ++r) {
      const auto& beat = all[static_cast<size_t>(r)];
      if (r != rank && beat) out[static_cast<size_t>(r)] = beat->value("beat", int64_t{-1});
    }
    return out;
  };
  std::vector<int64_t> before, after;
  try {
    before = beats();
    std::this_thread::sleep_for(apart);
    after = beats();
  } catch (const std::exception&) {
    return fmt::format(
        "the {} does not answer either: the process serving it (rank 0 "
        "with --host-store) has likely exited or was killed",
        store.describe());
  }
  std::vector<std::string> silent;
  for (size_t r = 0; r < before.size(); ++r) {
    if (before[r] >= 0 && before[r] == after[r]) {
      silent.push_back(fmt::format("rank {}", r));
      if (silent_ranks != nullptr) silent_ranks->push_back(static_cast<int>(r));
    }
  }
  if (silent.empty()) return "";
  return fmt::format("{} (no heartbeat for {:.1f}s: exited, killed or frozen)",
                     fmt::join(silent, ", "), std::chrono::duration<double>(apart).count());
}

BeatStore::BeatStore(const std::string& host, uint16_t port, const std::string& secret,
                     int generation, Store& fallback)
    : fallback_(fallback) {
  try {
    client_.emplace(host, port, std::chrono::seconds(2), secret, std::chrono::seconds(2));
    // A beat is sent again a second later: one the store does not take within 2 s is dropped,
    // not waited for (holding the rank's reads of its peers' heartbeats with it).
    client_->set_request_timeout(std::chrono::seconds(2));
    prefix_.emplace(generation_prefix(generation), *client_);
  } catch (const Error&) {
    client_.reset();
  }
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
  const std::lock_guard lock(publish_mutex_);
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
