// Elastic world size: host selection by probing, and MIN:MAX ranges.
#include "launch/elastic.hpp"

#include <algorithm>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dptrain {

namespace {

// As many as a hostfile's slots allow (2^20).
constexpr int kMaxSize = 1 << 20;

bool parse_positive(const std::string& text, int& out) {
  if (text.empty() || text.size() > 7) return false;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
  }
  out = std::stoi(text);
  return out >= 1 && out <= kMaxSize;
}

}  // namespace

SizeRange parse_size_range(const std::string& text, const std::string& flag) {
  SizeRange r;
  const auto colon = text.find(':');
  const bool ok = colon == std::string::npos
                      ? parse_positive(text, r.min) && parse_positive(text, r.max)
                      : parse_positive(text.substr(0, colon), r.min) &&
                            parse_positive(text.substr(colon + 1), r.max);
  if (!ok || r.min > r.max) {
    throw Error(ErrorKind::usage,
                fmt::format("{}: expected N or MIN:MAX with 1 <= MIN <= MAX <= {}, got '{}'", flag,
                            kMaxSize, text));
  }
  return r;
}

HostProbe ssh_probe(const SshOptions& options) {
  return [options](const HostSpec& host) -> std::string {
    if (host.is_local()) return "";
    try {
      SshSession::connect(host, options);
      return "";
    } catch (const Error& e) {
      return e.what();
    }
  };
}

namespace {

using Clock = std::chrono::steady_clock;

// Probes every host at once, each on a thread of its own; "" for each that answers, else why
// not. Stops waiting when `should_stop` says so (nothing then) or at `until`, where a probe still
// going gives `late`. A probe waited for no longer runs on, on what it copied (the probe, its
// host), and its answer is dropped.
std::optional<std::vector<std::string>> probe_all(const std::vector<HostSpec>& hosts,
                                                  const HostProbe& probe,
                                                  const std::function<bool()>& should_stop,
                                                  Clock::time_point until,
                                                  const std::string& late) {
  struct Answers {
    std::mutex mutex;
    std::condition_variable done;
    std::vector<std::optional<std::string>> why;
    size_t left = 0;
  };
  const auto answers = std::make_shared<Answers>();
  answers->why.resize(hosts.size());
  answers->left = hosts.size();
  for (size_t i = 0; i < hosts.size(); ++i) {
    std::thread([answers, probe, host = hosts[i], i] {
      std::string why = probe(host);
      std::lock_guard lock(answers->mutex);
      answers->why[i] = std::move(why);
      --answers->left;
      answers->done.notify_all();
    }).detach();
  }
  std::unique_lock lock(answers->mutex);
  while (answers->left > 0 && Clock::now() < until) {
    if (should_stop && should_stop()) return std::nullopt;
    answers->done.wait_until(lock, std::min(until, Clock::now() + std::chrono::milliseconds(100)));
  }
  std::vector<std::string> why;
  for (const auto& w : answers->why)
    why.push_back(w.value_or(late));
  return why;
}

}  // namespace

HostSelection select_hosts(
    const std::vector<HostSpec>& candidates, int max_nodes, std::chrono::milliseconds wait,
    const HostProbe& probe, const std::function<bool()>& should_stop,
    std::chrono::milliseconds interval,
    const std::function<void(const std::vector<std::string>& absent)>& waiting) {
  const auto deadline = Clock::now() + wait;
  const std::string late = fmt::format("no answer within {:g} s (--rejoin-timeout)",
                                       static_cast<double>(wait.count()) / 1000.0);
  std::vector<std::string> why(candidates.size());
  bool told = false;  // `waiting`
  HostSelection out;
  for (;;) {
    const auto until = wait.count() > 0 ? std::max(deadline, Clock::now() + std::chrono::seconds(1))
                                        : Clock::time_point::max();
    auto round = probe_all(candidates, probe, should_stop, until, late);
    if (!round) {
      out.stopped = true;
      break;
    }
    why = std::move(*round);
    const auto up = std::count_if(why.begin(), why.end(), [](const auto& w) { return w.empty(); });
    const auto now = Clock::now();
    if (up >= max_nodes || now >= deadline) break;
    if (should_stop && should_stop()) {
      out.stopped = true;
      break;
    }
    if (waiting && !told) {
      told = true;
      std::vector<std::string> absent;
      for (size_t i = 0; i < candidates.size(); ++i) {
        if (!why[i].empty())
          absent.push_back(fmt::format("{}: {}", candidates[i].display(), why[i]));
      }
      waiting(absent);
    }
    // The last probe at the deadline itself: a host that answers then is not missed.
    const auto next = std::min<Clock::time_point>(now + interval, deadline);
    while (Clock::now() < next && !(should_stop && should_stop()))
      std::this_thread::sleep_for(
          std::min<Clock::duration>(std::chrono::milliseconds(100), next - Clock::now()));
  }
  if (out.stopped) return out;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (!why[i].empty()) {
      out.absent.push_back(fmt::format("{}: {}", candidates[i].display(), why[i]));
    } else if (static_cast<int>(out.hosts.size()) < max_nodes) {
      out.hosts.push_back(candidates[i]);
    }
  }
  return out;
}

std::chrono::milliseconds rejoin_probe_interval(std::chrono::milliseconds rejoin_timeout) {
  return std::clamp<std::chrono::milliseconds>(rejoin_timeout, std::chrono::seconds(1),
                                               std::chrono::seconds(30));
}

HostWatch::HostWatch(std::vector<HostSpec> hosts, HostProbe probe,
                     std::chrono::milliseconds interval)
    : hosts_(std::move(hosts)), probe_(std::move(probe)), interval_(interval) {
  thread_ = std::thread([this] { run(); });
}

HostWatch::~HostWatch() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

std::vector<HostSpec> HostWatch::answered() const {
  std::lock_guard lock(mutex_);
  return answered_;
}

void HostWatch::run() {
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      if (wake_.wait_for(lock, interval_, [this] { return stop_; })) return;
    }
    const auto why = probe_all(
        hosts_, probe_,
        [this] {
          std::lock_guard lock(mutex_);
          return stop_;
        },
        Clock::time_point::max(), "");
    if (!why) return;
    std::lock_guard lock(mutex_);
    for (size_t i = 0; i < hosts_.size(); ++i) {
      if ((*why)[i].empty()) answered_.push_back(hosts_[i]);
    }
    if (!answered_.empty() || stop_) return;
  }
}

}  // namespace dptrain
