// Elastic world size: which hosts (or how many local ranks) the next generation of a job runs on
// when nodes are lost, come back, or were spares from the start.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "launch/hostfile.hpp"
#include "launch/ssh.hpp"

namespace dptrain {

// "N" or "MIN:MAX" (--nnodes, --nproc). Error(usage) naming `flag` when it is not 1 <= MIN <=
// MAX.
struct SizeRange {
  int min = 1;
  int max = 1;
  bool elastic() const { return min < max; }
};
SizeRange parse_size_range(const std::string& text, const std::string& flag);

// Whether a host answers now: an SSH login (the launcher's own host always answers). Returns ""
// when it does, else why not.
using HostProbe = std::function<std::string(const HostSpec&)>;
HostProbe ssh_probe(const SshOptions& options);

struct HostSelection {
  std::vector<HostSpec> hosts;      // in the order of the candidates, at most max_nodes
  std::vector<std::string> absent;  // "HOST: why" for each candidate not taken as unreachable
  bool stopped = false;             // `should_stop` ended the wait: hosts and absent are partial
};

// The hosts of the next generation: the first `max_nodes` candidates that answer. Probes every
// candidate (all at once) and again each `interval` until max_nodes answer or `wait` has passed;
// returns what it has then. A probe still going when `wait` has passed (a host that takes the
// connection but does not speak SSH holds one for the whole connect timeout) is given up on, a
// second after its round began at the earliest; with no wait, each round waits for every probe.
// `should_stop` is polled every 100 ms, during probes too (a stop signal): it ends the wait at
// once, `stopped` set; `waiting`, when given, is told once, before the first wait, which
// candidates did not answer ("HOST: why").
HostSelection select_hosts(
    const std::vector<HostSpec>& candidates, int max_nodes, std::chrono::milliseconds wait,
    const HostProbe& probe, const std::function<bool()>& should_stop,
    std::chrono::milliseconds interval = std::chrono::milliseconds(1000),
    const std::function<void(const std::vector<std::string>& absent)>& waiting = {});

// How often a running elastic job probes the hosts it lacks: every rejoin timeout, at least 1 s
// and at most 30 s apart.
std::chrono::milliseconds rejoin_probe_interval(std::chrono::milliseconds rejoin_timeout);

// Watches, while a generation runs below its job's maximum size, for hosts that answer again: a
// thread probes `hosts` every `interval` (all at once, the first round after one interval) until
// at least one answers. The destructor stops it at once, leaving a probe in flight (an SSH login
// attempt) to end on its own.
class HostWatch {
 public:
  HostWatch(std::vector<HostSpec> hosts, HostProbe probe, std::chrono::milliseconds interval);
  ~HostWatch();
  HostWatch(const HostWatch&) = delete;
  HostWatch& operator=(const HostWatch&) = delete;
  // Those that answered in the round where the first did; empty until then.
  std::vector<HostSpec> answered() const;

 private:
  void run();

  const std::vector<HostSpec> hosts_;
  const HostProbe probe_;
  const std::chrono::milliseconds interval_;
  mutable std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::vector<HostSpec> answered_;
  std::thread thread_;
};

}  // namespace dptrain
