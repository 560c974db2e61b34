// Elastic world size: host selection by probing, and MIN:MAX ranges.
#include "launch/elastic.hpp"

#include <algorithm>
#include <future>
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

// Probes every host at once; "" for each that answers, else why not.
std::vector<std::string> probe_all(const std::vector<HostSpec>& hosts, const HostProbe& probe) {
  std::vector<std::future<std::string>> answers;
  for (const auto& h : hosts)
    answers.push_back(std::async(std::launch::async, probe, h));
  std::vector<std::string> why;
  for (auto& a : answers)
    why.push_back(a.get());
  return why;
}

}  // namespace

HostSelection select_hosts(
    const std::vector<HostSpec>& candidates, int max_nodes, std::chrono::milliseconds wait,
    const HostProbe& probe, const std::function<bool()>& should_stop,
    std::chrono::milliseconds interval,
    const std::function<void(const std::vector<std::string>& absent)>& waiting) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  std::vector<std::string> why(candidates.size());
  bool told = false;  // `waiting`
  for (;;) {
    why = probe_all(candidates, probe);
    const auto up = std::count_if(why.begin(), why.end(), [](const auto& w) { return w.empty(); });
    const auto now = std::chrono::steady_clock::now();
    if (up >= max_nodes || now >= deadline || (should_stop && should_stop())) break;
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
    std::this_thread::sleep_for(
        std::min<std::chrono::steady_clock::duration>(interval, deadline - now));
  }
  HostSelection out;
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
    const std::vector<std::string> why = probe_all(hosts_, probe_);
    std::lock_guard lock(mutex_);
    for (size_t i = 0; i < hosts_.size(); ++i) {
      if (why[i].empty()) answered_.push_back(hosts_[i]);
    }
    if (!answered_.empty() || stop_) return;
  }
}

}  // namespace dptrain
