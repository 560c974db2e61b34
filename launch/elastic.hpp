// Elastic world size: which hosts (or how many local ranks) the next generation of a job runs on
// when nodes are lost, come back, or were spares from the start.
#pragma once

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
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
  size_t stood_in_for = 0;  // the first this many of absent: earlier in the list than a host taken
  bool stopped = false;     // `should_stop` ended the wait: hosts and absent are partial
};

// The hosts of the next generation: the first `max_nodes` candidates that answer, in the order of
// the list. Probes every candidate at once, each on its own, and one that did not answer again
// each `interval` after its answer, until max_nodes answer or `wait` has passed, then once more
// at the deadline; returns what it has then. A probe that has run a second without an answer
// (a host that takes the connection but does not speak SSH holds one for the whole connect
// timeout) holds up no other host's probes, nor the choice of hosts later in the list once it is
// over its second, nor the end of the wait (a wait of 0 included); with no wait (nullopt) it waits
// for every probe to end. Fewer candidates than max_nodes that all answered end the wait too.
// `should_stop` is polled every 100 ms, during probes too (a stop signal): it ends the wait at
// once, `stopped` set; `waiting`, when given, is told once, when every candidate has answered
// or its probe has gone a second (never, where the selection ends first), which candidates have
// not answered ("HOST: why", "no answer yet" for a probe still going).
HostSelection select_hosts(
    const std::vector<HostSpec>& candidates, int max_nodes,
    std::optional<std::chrono::milliseconds> wait, const HostProbe& probe,
    const std::function<bool()>& should_stop,
    std::chrono::milliseconds interval = std::chrono::milliseconds(1000),
    const std::function<void(const std::vector<std::string>& absent)>& waiting = {});

// How often a running elastic job probes the hosts it lacks: every rejoin timeout, at least 1 s
// and at most 30 s apart.
std::chrono::milliseconds rejoin_probe_interval(std::chrono::milliseconds rejoin_timeout);

// Watches, while a generation runs below its job's maximum size, for hosts that answer again: a
// thread probes each of `hosts` every `interval` (the first time one interval after the start),
// one probe in flight per host, until at least one answers. The destructor stops it at once,
// leaving a probe in flight (an SSH login attempt) to end on its own.
class HostWatch {
 public:
  HostWatch(std::vector<HostSpec> hosts, HostProbe probe, std::chrono::milliseconds interval);
  ~HostWatch();
  HostWatch(const HostWatch&) = delete;
  HostWatch& operator=(const HostWatch&) = delete;
  // Those that had answered when the first was seen to; empty until then.
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

// Whether a host probe was started on a thread nobody waits for (an elastic placement does not
// wait out a host that hangs). A process that ends after one must not run its exit handlers: they
// would tear down the SSH library under a probe still running, or under its thread's own teardown
// just after it ended (a window no counter closes), a crash in place of the exit code.
bool probe_thread_started();

}  // namespace dptrain
