// The launcher's side of one remote host: a small local process that holds the SSH connection,
// starts `dptrain agent` there, and relays its output. Being a local child, it is supervised,
// logged and contained exactly like a local rank; when it dies, the connection drops and the
// remote agent stops its ranks.
#pragma once

#include <csignal>
#include <string>

#include <nlohmann/json.hpp>

#include "launch/agent.hpp"
#include "launch/hostfile.hpp"
#include "launch/ssh.hpp"

namespace dptrain {

struct RelayPlan {
  HostSpec host;
  SshOptions ssh;
  std::string remote_binary;  // dptrain on the remote host
  AgentPlan agent;

  nlohmann::json to_json(bool redact_secret = false) const;
  static RelayPlan from_json(const nlohmann::json& j);
};

// The environment variable the launcher passes the plan in (not the command line: it holds the
// job secret).
constexpr const char* kRelayPlanEnv = "DPTRAIN_RELAY_PLAN";

// The signal that asks a relay to end at once with its host's ranks (ProcessSpec::end_signal):
// the launcher's kill (its hang watch, a grace that ran out). A SIGKILL of the relay would leave
// them running until the agent noticed its connection gone (3 s): with --max-restarts, beside
// the next generation's.
constexpr int kRelayEndSignal = SIGUSR1;

// The relay's SIGTERM/SIGINT/kRelayEndSignal handlers: before the agent has its plan a stop ends
// the relay at once (exit 128 + the signal, nothing ran on the host); after, it is passed on to
// the agent ("stop", "interrupt", "kill": its ranks killed at once). main
// installs them first thing: the launcher starts a relay with SIGTERM held, and one that came
// while it loaded is a stop, not a death by the signal ("host ... was killed by SIGTERM").
void install_relay_signal_handlers();
// Connects, starts the agent, writes its plan, relays its output to stdout until it ends.
// SIGTERM, SIGINT or kRelayEndSignal is passed on to the agent, which stops its ranks. Returns the
// agent's exit code; 4 when the host cannot be reached or authenticated; 3 when the connection is
// lost (with an "@failure" line naming the host).
int run_relay(const RelayPlan& plan);

// "HOST (ranks 2-3)": a host lost in a run names the ranks that went with it (a host's ranks are
// one consecutive block: plan_job numbers them host by host).
std::string host_and_ranks(const HostSpec& host, const std::vector<int>& ranks);

nlohmann::json host_to_json(const HostSpec& host);
HostSpec host_from_json(const nlohmann::json& j);

}  // namespace dptrain
