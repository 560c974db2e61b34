// The launcher's side of one remote host: SSH connection, agent start, output relay.
#include "launch/relay.hpp"

#include <atomic>
#include <csignal>
#include <cstdio>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dptrain {

using nlohmann::json;

namespace {

std::atomic<bool> g_stop_requested{false};

void on_stop(int) {
  g_stop_requested = true;
}

void report_failure(const std::string& description) {
  const json report = {{"rank", -1},
                       {"exit_code", -1},
                       {"signal", 0},
                       {"description", description},
                       {"last_lines", json::array()}};
  std::printf("%s%s\n", kAgentFailurePrefix, report.dump().c_str());
  std::fflush(stdout);
}

}  // namespace

json host_to_json(const HostSpec& h) {
  return {{"host", h.host}, {"slots", h.slots}, {"user", h.user},
          {"port", h.port}, {"key", h.key},     {"origin", h.origin}};
}

HostSpec host_from_json(const json& j) {
  HostSpec h;
  h.host = j.at("host").get<std::string>();
  h.slots = j.at("slots").get<int>();
  h.user = j.at("user").get<std::string>();
  h.port = j.at("port").get<uint16_t>();
  h.key = j.at("key").get<std::string>();
  h.origin = j.at("origin").get<std::string>();
  return h;
}

json RelayPlan::to_json(bool redact_secret) const {
  std::vector<std::string> identities;
  for (const auto& p : ssh.identities)
    identities.push_back(p.string());
  return {{"host", host_to_json(host)},
          {"ssh",
           {{"identities", identities},
            {"known_hosts", ssh.known_hosts.string()},
            {"accept_new_host_keys", ssh.accept_new_host_keys},
            {"connect_timeout_ms", ssh.connect_timeout.count()},
            {"keepalive_interval_s", ssh.keepalive_interval_s}}},
          {"remote_binary", remote_binary},
          {"agent", agent.to_json(redact_secret)}};
}

RelayPlan RelayPlan::from_json(const json& j) {
  try {
    RelayPlan p;
    p.host = host_from_json(j.at("host"));
    const json& s = j.at("ssh");
    for (const auto& id : s.at("identities"))
      p.ssh.identities.emplace_back(id.get<std::string>());
    p.ssh.known_hosts = s.at("known_hosts").get<std::string>();
    p.ssh.accept_new_host_keys = s.at("accept_new_host_keys").get<bool>();
    p.ssh.connect_timeout = std::chrono::milliseconds(s.at("connect_timeout_ms").get<int64_t>());
    p.ssh.keepalive_interval_s = s.at("keepalive_interval_s").get<int>();
    p.remote_binary = j.at("remote_binary").get<std::string>();
    p.agent = AgentPlan::from_json(j.at("agent"));
    return p;
  } catch (const json::exception& e) {
    throw Error(ErrorKind::usage, fmt::format("malformed relay plan: {}", e.what()));
  }
}

int run_relay(const RelayPlan& plan) {
  struct sigaction sa {};
  sa.sa_handler = on_stop;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  std::unique_ptr<SshSession> session;
  try {
    session = SshSession::connect(plan.host, plan.ssh);
  } catch (const Error& e) {
    report_failure(e.what());
    return 4;
  }
  std::unique_ptr<SshChannel> channel;
  try {
    channel = session->start(remote_path_word(plan.remote_binary) + " agent");
    channel->write(plan.agent.to_json().dump() + "\n");
  } catch (const Error& e) {
    report_failure(fmt::format("{}: cannot start the agent: {}", plan.host.display(), e.what()));
    return 4;
  }
  bool stdin_closed = false;
  try {
    const auto sink = [](std::string_view data, bool) {
      std::fwrite(data.data(), 1, data.size(), stdout);
      std::fflush(stdout);
    };
    while (channel->read(sink, std::chrono::milliseconds(100))) {
      if (g_stop_requested && !stdin_closed) {
        // "stop": the agent's ranks checkpoint and stop; the end of input follows.
        channel->write("stop\n");
        channel->close_stdin();
        stdin_closed = true;
      }
    }
  } catch (const Error& e) {
    report_failure(fmt::format("lost the SSH connection to {}: {}", plan.host.display(), e.what()));
    return 3;
  }
  const auto status = channel->exit_status();
  if (!status) {
    report_failure(fmt::format("the agent on {} ended without an exit status (connection lost?)",
                               plan.host.display()));
    return 3;
  }
  return *status;
}

}  // namespace dptrain
