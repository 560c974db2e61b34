// Elastic world size: host selection by probing, and MIN:MAX ranges.
#include "launch/elastic.hpp"

#include <algorithm>
#include <atomic>
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

// A probe that has run this long without an answer is given up on once the wait is over.
constexpr auto kProbeGrace = std::chrono::seconds(1);

std::atomic<bool> g_probe_started{false};  // probe_thread_started()

// Probes of a fixed list of hosts, at most one in flight per host, each on a detached thread of
// its own: one host that hangs holds no other's probes. A probe no longer waited for runs on, on
// what it copied (the probe, its host), and its answer is dropped.
class Probes {
 public:
  struct Host {
    bool in_flight = false;
    Clock::time_point started{};
    std::optional<std::string> answer;  // of the last probe that ended: "" when the host answered
    Clock::time_point answered{};
    bool up() const { return answer && answer->empty(); }
    // Its answer is known, or it is taken as not answering for now (its probe ran too long).
    bool settled(Clock::time_point now, bool grace) const {
      return !in_flight || (grace && now - started >= kProbeGrace);
    }
  };

  Probes(std::vector<HostSpec> hosts, HostProbe probe)
      : shared_(std::make_shared<Shared>()), specs_(std::move(hosts)), probe_(std::move(probe)) {
    shared_->hosts.resize(specs_.size());
  }

  // Starts a probe of host i, unless one is in flight.
  void start(size_t i) {
    {
      std::lock_guard lock(shared_->mutex);
      Host& h = shared_->hosts[i];
      if (h.in_flight) return;
      h.in_flight = true;
      h.started = Clock::now();
    }
    g_probe_started = true;
    std::thread([shared = shared_, probe = probe_, host = specs_[i], i] {
      std::string why = probe(host);
      {
        std::lock_guard lock(shared->mutex);
        Host& h = shared->hosts[i];
        h.in_flight = false;
        h.answer = std::move(why);
        h.answered = Clock::now();
        shared->done.notify_all();
      }
    }).detach();
  }

  std::vector<Host> hosts() const {
    std::lock_guard lock(shared_->mutex);
    return shared_->hosts;
  }

  // Until a probe ends or `until`, 100 ms at most (the caller's stop is polled that often).
  void wait(Clock::time_point until) const {
    std::unique_lock lock(shared_->mutex);
    shared_->done.wait_until(lock, std::min(until, Clock::now() + std::chrono::milliseconds(100)));
  }

 private:
  struct Shared {
    std::mutex mutex;
    std::condition_variable done;
    std::vector<Host> hosts;
  };
  const std::shared_ptr<Shared> shared_;
  const std::vector<HostSpec> specs_;
  const HostProbe probe_;
};

// Whether the hosts chosen are known: walking the candidates in order, `max_nodes` are up before
// one whose answer is still awaited (a host earlier in the list is preferred to a later one, but
// not waited for past its grace).
bool chosen(const std::vector<Probes::Host>& hosts, int max_nodes, Clock::time_point now) {
  max_nodes = std::min(max_nodes, static_cast<int>(hosts.size()));  // all there are, at most
  int up = 0;
  for (const auto& h : hosts) {
    if (up >= max_nodes) break;
    if (h.up()) {
      ++up;
    } else if (!h.settled(now, true)) {
      return false;
    }
  }
  return up >= max_nodes;
}

}  // namespace

HostSelection select_hosts(
    const std::vector<HostSpec>& candidates, int max_nodes,
    std::optional<std::chrono::milliseconds> wait, const HostProbe& probe,
    const std::function<bool()>& should_stop, std::chrono::milliseconds interval,
    const std::function<void(const std::vector<std::string>& absent)>& waiting) {
  const bool bounded = wait.has_value();
  const auto deadline = Clock::now() + wait.value_or(std::chrono::milliseconds(0));
  const std::string late = fmt::format(
      "no answer within {:g} s (--rejoin-timeout)",
      static_cast<double>(wait.value_or(std::chrono::milliseconds(0)).count()) / 1000.0);
  Probes probes(candidates, probe);
  for (size_t i = 0; i < candidates.size(); ++i)
    probes.start(i);
  bool last = false;  // the last probes, at the deadline, are started
  bool told = false;  // `waiting`
  HostSelection out;
  std::vector<Probes::Host> hosts;
  for (;;) {
    if (should_stop && should_stop()) {
      out.stopped = true;
      return out;
    }
    const auto now = Clock::now();
    hosts = probes.hosts();
    if (chosen(hosts, max_nodes, now)) break;
    const auto settled = [&](bool grace) {
      return std::all_of(hosts.begin(), hosts.end(),
                         [&](const Probes::Host& h) { return h.settled(now, grace); });
    };
    if (!bounded) {
      if (settled(false)) break;
    } else if (last) {
      if (settled(true)) break;
    } else if (now >= deadline) {
      // The last probe at the deadline itself: a host that answers then is not missed.
      last = true;
      for (size_t i = 0; i < hosts.size(); ++i) {
        if (!hosts[i].up()) probes.start(i);
      }
      continue;
    } else {
      // A host that did not answer is probed again an interval after its last answer.
      for (size_t i = 0; i < hosts.size(); ++i) {
        if (!hosts[i].in_flight && !hosts[i].up() && now - hosts[i].answered >= interval)
          probes.start(i);
      }
      const bool all_heard = std::all_of(hosts.begin(), hosts.end(), [&](const Probes::Host& h) {
        return h.answer || h.settled(now, true);
      });
      if (waiting && !told && all_heard) {
        told = true;
        std::vector<std::string> absent;
        for (size_t i = 0; i < candidates.size(); ++i) {
          if (!hosts[i].up())
            absent.push_back(fmt::format("{}: {}", candidates[i].display(),
                                         hosts[i].answer.value_or("no answer yet")));
        }
        waiting(absent);
      }
    }
    probes.wait(bounded && !last ? deadline : Clock::time_point::max());
  }
  const auto end = Clock::now();
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (static_cast<int>(out.hosts.size()) >= max_nodes && hosts[i].in_flight) {
      continue;  // not needed, and not known not to answer
    } else if (!hosts[i].up()) {
      // A probe still going: the wait is over, or enough hosts earlier in the list answered.
      const std::string why =
          !hosts[i].in_flight ? hosts[i].answer.value_or(late)
          : last              ? late
                              : fmt::format("no answer within {:.1f} s",
                                            std::chrono::duration<double>(end - hosts[i].started).count());
      out.absent.push_back(fmt::format("{}: {}", candidates[i].display(), why));
    } else if (static_cast<int>(out.hosts.size()) < max_nodes) {
      out.hosts.push_back(candidates[i]);
      out.stood_in_for = out.absent.size();  // a later host took their places
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
  Probes probes(hosts_, probe_);
  const auto first = Clock::now() + interval_;
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      if (wake_.wait_for(
              lock, std::min<std::chrono::milliseconds>(interval_, std::chrono::milliseconds(100)),
              [this] { return stop_; }))
        return;
    }
    const auto now = Clock::now();
    const auto hosts = probes.hosts();
    std::vector<HostSpec> up;
    for (size_t i = 0; i < hosts.size(); ++i) {
      if (hosts[i].up()) up.push_back(hosts_[i]);
    }
    if (!up.empty()) {
      std::lock_guard lock(mutex_);
      answered_ = std::move(up);
      return;
    }
    // Each host every interval, the first time one interval after the start.
    for (size_t i = 0; i < hosts.size(); ++i) {
      const auto due = hosts[i].answer ? hosts[i].answered + interval_ : first;
      if (!hosts[i].in_flight && now >= due) probes.start(i);
    }
  }
}

bool probe_thread_started() {
  return g_probe_started.load();
}

}  // namespace dptrain
