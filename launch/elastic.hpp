// Elastic world size: which hosts (or how many local ranks) the next generation of a job runs on
// when nodes are lost, come back, or were spares from the start.
#pragma once

#include <chrono>
#include <functional>
#include <string>
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
};

// The hosts of the next generation: the first `max_nodes` candidates that answer. Probes every
// candidate (all at once) and again each `interval` until max_nodes answer or `wait` has passed;
// returns what it has then. `should_stop` is polled between rounds (a stop signal).
HostSelection select_hosts(const std::vector<HostSpec>& candidates, int max_nodes,
                           std::chrono::milliseconds wait, const HostProbe& probe,
                           const std::function<bool()>& should_stop,
                           std::chrono::milliseconds interval = std::chrono::milliseconds(1000));

}  // namespace dptrain
