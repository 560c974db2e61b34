// `dptrain agent`: the ranks of one node, started by the launcher over SSH; and the hidden
// `dptrain _relay`, the launcher-side end of that SSH connection.
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "core/error.hpp"
#include "launch/agent.hpp"
#include "launch/relay.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

namespace {

Error stopped_before_plan(int sig) {
  return Error(sig == SIGINT ? ErrorKind::interrupted : ErrorKind::terminated,
               fmt::format("dptrain agent: stopped by {} before its plan came; no rank was started",
                           sig == SIGINT ? "SIGINT" : "SIGTERM"));
}

// The plan is the first line of stdin. Read byte by byte: whatever follows must stay unread, as
// the end of stdin is the signal to stop.
std::string read_plan_line() {
  std::string line;
  char c;
  while (true) {
    // A stop signal while the plan is awaited ends the agent: no rank is started.
    if (const int sig = wait_readable_unless_stopped(STDIN_FILENO); sig != 0) {
      throw stopped_before_plan(sig);
    }
    const ssize_t n = ::read(STDIN_FILENO, &c, 1);
    if (n == 1) {
      if (c == '\n') return line;
      line.push_back(c);
      if (line.size() > (64u << 20)) throw Error(ErrorKind::usage, "agent plan too large");
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    throw Error(ErrorKind::usage,
                "dptrain agent: no plan on stdin (it is started by "
                "'dptrain launch --hosts', which writes one)");
  }
}

}  // namespace

void setup_agent(CLI::App& app, Outcome& outcome) {
  app.callback([&outcome] {
    // SIGTERM to the agent (a node shutting down signals every process) is a stop as the
    // launcher's "stop" is: its ranks checkpoint at the next step and exit 143; SIGINT stops them
    // without one. Left to the default, it killed the agent and its ranks with it.
    install_stop_signal_handlers();
    // Said at once: the launcher's end then knows an agent runs there, and which protocol it
    // speaks, before the plan is read (a program at that path that never speaks is named as
    // maybe not this dptrain's; an agent of another protocol, as another build).
    std::printf("%s%d\n", kAgentHelloPrefix, kAgentProtocol);
    std::fflush(stdout);
    const auto j = nlohmann::json::parse(read_plan_line(), nullptr, false);
    if (!j.is_object()) {
      throw Error(ErrorKind::usage,
                  "the agent's plan on standard input is not a JSON object (the agent is started "
                  "by 'dptrain launch --hosts', which writes one)");
    }
    const auto plan = [&] {
      try {
        return AgentPlan::from_json(j);
      } catch (const Error& e) {
        // A plan of another protocol: this host cannot run the launcher's job (exit 4, as a
        // host without dptrain), and a restart would meet the same. Said to the launcher.
        if (e.kind() == ErrorKind::ssh) write_host_failure(stdout, e.what(), /*refused=*/true);
        throw;
      }
    }();
    // A stop that came while the plan was awaited: no rank is started only to be stopped.
    if (const int sig = pending_stop_signal(); sig != 0) throw stopped_before_plan(sig);
    try {
      outcome.exit_code = run_agent(plan, stdout, STDIN_FILENO);
    } catch (const Error& e) {
      // Before any rank started (its data differs from the launcher's, say): the launcher's
      // message is this one.
      write_host_failure(stdout, e.what());
      throw;
    }
  });
}

void setup_relay(CLI::App& app, Outcome& outcome) {
  app.group("");  // internal: not listed in --help
  app.callback([&outcome] {
    const char* text = std::getenv(kRelayPlanEnv);
    if (text == nullptr) {
      throw Error(ErrorKind::usage, fmt::format("{} is not set", kRelayPlanEnv));
    }
    const auto j = nlohmann::json::parse(text, nullptr, false);
    if (j.is_discarded()) throw Error(ErrorKind::usage, fmt::format("{}: not JSON", kRelayPlanEnv));
    const RelayPlan plan = RelayPlan::from_json(j);
    ::unsetenv(kRelayPlanEnv);  // holds the job secret; nothing started from here needs it
    outcome.exit_code = run_relay(plan);
  });
}

}  // namespace dptrain::cli
