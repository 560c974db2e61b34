// The launcher's side of one remote host: SSH connection, agent start, output relay.
#include "launch/relay.hpp"

#include <unistd.h>

#include <atomic>
#include <charconv>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <optional>
#include <random>
#include <string_view>

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/json_error.hpp"
#include "core/suggest.hpp"
#include "launch/provision.hpp"
#include "launch/supervisor.hpp"

namespace dptrain {

using nlohmann::json;

namespace {

// The launcher's stop signals, in order: each SIGTERM or SIGINT is passed on to the agent, and
// SIGUSR1 (the launcher's kill: its hang watch, a grace that ran out) as "kill".
std::atomic<int> g_terms{0};
std::atomic<int> g_interrupts{0};
std::atomic<bool> g_kill{false};
// After "kill": how long the agent has to end before the relay kills it there (by its mark), and
// how long that may take, within the launcher's wait for this relay.
constexpr std::chrono::milliseconds kKillAnswerWait{1500};
constexpr std::chrono::milliseconds kKillSweepWait{2000};
// A sweep that found none of its processes: how long the relay then watches for the agent's end
// (it may have ended during the sweep) before it warns.
constexpr std::chrono::milliseconds kKillEndedWait{500};
static_assert(kKillAnswerWait + kKillSweepWait + kKillEndedWait + std::chrono::milliseconds(1000) <=
              kEndWait);
// Whether the agent has its plan: before, no rank runs on the host for this relay (it is still
// connecting, which may take the whole connect timeout, or the program there has not yet said it
// is this build's agent; an agent without a plan ends as the connection closes), and a stop
// signal ends it at once.
std::atomic<bool> g_plan_sent{false};
static_assert(std::atomic<bool>::is_always_lock_free);

void on_stop(int sig) {
  if (!g_plan_sent.load()) ::_exit(128 + sig);
  if (sig == kRelayEndSignal) {
    g_kill.store(true);
  } else {
    (sig == SIGINT ? g_interrupts : g_terms).fetch_add(1);
  }
}

// The end signal is the launcher's (this relay's parent) alone: from anyone else (a stray
// `pkill -USR1`) it would kill the host's ranks for nothing, and is ignored.
void on_end(int sig, siginfo_t* info, void*) {
  if (info != nullptr && info->si_pid != ::getppid()) return;
  on_stop(sig);
}

// The remote shell's status when it could not run the binary (127: not found, 126: not
// executable) means a host that was not provisioned: a set-up problem, not a rank's failure.
// The dynamic loader exits 127 too, for a library the binary needs that the host lacks: its line
// (the host's last) says which, and provisioning again would not help.
std::optional<std::string> not_runnable(int status, const RelayPlan& plan,
                                        const std::string& last_line) {
  if (status != 127 && status != 126) return std::nullopt;
  if (const std::string loader = loader_failure(last_line); !loader.empty()) {
    return fmt::format(
        "{}: '{}' cannot start there: {} (install the libraries it needs on the host: 'ldd {}' "
        "there lists them)",
        plan.host.display(), plan.remote_binary, loader, plan.remote_binary);
  }
  // A file where a directory of its path should be (a --workdir that is a file): provision
  // would fail on it too.
  if (lowercase(last_line).find("not a directory") != std::string::npos) {
    return fmt::format(
        "{}: cannot run '{}' there: a part of its path is a file, not a directory (the host "
        "said: {}): give a --workdir (or --remote-binary) whose directories are directories there",
        plan.host.display(), plan.remote_binary, printable_excerpt(last_line, 80));
  }
  return fmt::format(
      "{}: cannot run '{}' there ({}): install it with 'dptrain provision' (see "
      "dptrain-provision(1)) or name it with --remote-binary",
      plan.host.display(), plan.remote_binary,
      status == 127 ? "no such file or command" : "not executable");
}

// Whether `line` is one of the lines an agent of any protocol writes (a login's start-up files
// may print others, even ones that start with '@').
bool is_agent_line(std::string_view line) {
  return line.starts_with(kAgentHelloPrefix) || line == kAgentAliveLine ||
         line == kAgentStartedLine || line == kAgentDoneLine ||
         line.starts_with(kAgentRankPrefix) || line.starts_with(kAgentFailurePrefix) ||
         line.starts_with("@event ");
}

// The agent protocol an agent's first line says it speaks: N for "@agent N", 1 for an agent from
// before it said so (its first line is another of the protocol's: "@alive"), 0 for a number that
// cannot be read.
int protocol_of_first_line(std::string_view line) {
  if (!line.starts_with(kAgentHelloPrefix)) return 1;
  const std::string_view digits = line.substr(std::string_view(kAgentHelloPrefix).size());
  int n = 0;
  const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), n);
  return ec == std::errc() && end == digits.data() + digits.size() && n > 0 ? n : 0;
}

// The advice after a program at the binary's path that is not this dptrain's agent.
constexpr const char* kNotAnAgentFix =
    "'dptrain doctor' checks it, 'dptrain provision' installs this one (or name the right one "
    "with --remote-binary)";

// " (its last line: X)" after a refusal of the program at the binary's path, or nothing where it
// printed nothing.
std::string last_line_note(const std::string& last_line) {
  return last_line.empty() ? std::string()
                           : fmt::format(" (its last line: {})", printable_excerpt(last_line, 80));
}

// For a host where another build of dptrain runs, whose agent speaks protocol `said` (its number,
// or its text where that is not one), or does not say (an older build: nullopt). A restart would
// meet it again.
std::string another_build(const RelayPlan& plan, const std::optional<std::string>& said) {
  const std::string which =
      said ? fmt::format(
                 "another build of dptrain (its agent speaks protocol {}, this "
                 "launcher's {})",
                 *said, kAgentProtocol)
           : fmt::format(
                 "an older build of dptrain (its agent does not say which protocol it "
                 "speaks; this launcher's speaks {})",
                 kAgentProtocol);
  return fmt::format(
      "{}: '{}' there is {}: install this build there with 'dptrain provision' "
      "(see dptrain-provision(1)) or name it with --remote-binary",
      plan.host.display(), plan.remote_binary, which);
}

// What an agent's first line (`first`) says of its protocol, for another_build.
std::optional<std::string> protocol_said(std::string_view first) {
  if (!first.starts_with(kAgentHelloPrefix)) return std::nullopt;
  const int protocol = protocol_of_first_line(first);
  return protocol != 0
             ? std::to_string(protocol)
             : printable(std::string(first.substr(std::string_view(kAgentHelloPrefix).size())));
}

// An agent says "@agent N" as it starts; one that has said nothing this long may be an older
// build's (those say nothing until they have read a plan): its --version says which.
constexpr std::chrono::seconds kAgentHelloWait{5};

std::string host_and_ranks(const RelayPlan& plan) {
  return host_and_ranks(plan.host, plan.agent.ranks);
}

}  // namespace

std::string host_and_ranks(const HostSpec& host, const std::vector<int>& ranks) {
  if (ranks.empty()) return host.display();
  if (ranks.size() == 1) return fmt::format("{} (rank {})", host.display(), ranks.front());
  return fmt::format("{} (ranks {}-{})", host.display(), ranks.front(), ranks.back());
}

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

void install_relay_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop;
  // A relayed line being written when a signal comes is written, not lost to EINTR.
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  ::sigaction(SIGTERM, &sa, nullptr);
  ::sigaction(SIGINT, &sa, nullptr);
  struct sigaction end {};
  end.sa_sigaction = on_end;
  end.sa_flags = SA_RESTART | SA_SIGINFO;
  sigemptyset(&end.sa_mask);
  ::sigaction(kRelayEndSignal, &end, nullptr);
}

int run_relay(const RelayPlan& plan) {
  install_relay_signal_handlers();
  std::unique_ptr<SshSession> session;
  try {
    session = SshSession::connect(plan.host, plan.ssh);
  } catch (const SshRefused& e) {
    write_host_failure(stdout, e.what(), true);
    return 4;
  } catch (const SshUnreachable& e) {
    write_host_failure(stdout, e.what(), false, 0, /*unreachable=*/true);
    return 4;
  } catch (const Error& e) {
    write_host_failure(stdout, e.what());
    return 4;
  }
  // The agent's lines go on to the launcher, but for its "@agent N" and "@alive" ones: what
  // these say is its protocol and that the host answers (when anything was last heard). "@done"
  // says every rank there exited 0: the host is complete, whatever becomes of the connection after
  // it.
  auto last_heard = std::chrono::steady_clock::now();
  bool done = false;
  // The agent's first line of its protocol, on stdout ("@agent N", or from an agent before it
  // said its number, "@alive"): another number than this launcher's means another build there,
  // which would misread its plan or be misread: exit 4, naming both, and whatever it started is
  // killed (or stops as the connection ends).
  std::string first_agent_line;
  bool heard_agent = false;  // a line of the agent's protocol on stdout: it is an agent
  const auto other_build = [&] {
    return heard_agent && protocol_of_first_line(first_agent_line) != kAgentProtocol;
  };
  const auto refuse_other_build = [&] {
    write_host_failure(stdout, another_build(plan, protocol_said(first_agent_line)),
                       /*refused=*/true);
    return 4;
  };
  std::string partial[2];  // stdout's and stderr's unfinished lines: never glued together
  const auto flush_partial = [&partial] {
    for (const std::string& rest : partial) {  // each its own line: never glued together
      if (!rest.empty()) std::fprintf(stdout, "%s\n", rest.c_str());
    }
  };
  std::string last_line;  // the host's last line of output, for not_runnable
  const auto sink = [&](std::string_view data, bool is_stderr) {
    last_heard = std::chrono::steady_clock::now();
    std::string& pending = partial[is_stderr ? 1 : 0];
    pending.append(data);
    std::string lines;
    size_t start = 0;
    for (size_t end; (end = pending.find('\n', start)) != std::string::npos; start = end + 1) {
      const std::string_view line = std::string_view(pending).substr(start, end - start);
      if (!is_stderr && !heard_agent && is_agent_line(line)) {
        first_agent_line = line;
        heard_agent = true;
      }
      // Nothing an agent of another protocol says is passed on: it would be misread.
      if (other_build()) continue;
      if (line.starts_with(kAgentHelloPrefix)) continue;  // said; nothing to pass on
      if (line == kAgentDoneLine) {
        done = true;
      } else if (line != kAgentAliveLine) {
        lines.append(pending, start, end + 1 - start);
        last_line = line;
      }
    }
    pending.erase(0, start);
    std::fwrite(lines.data(), 1, lines.size(), stdout);
    std::fflush(stdout);
  };
  // A host that stops answering without closing the connection (its sshd or agent frozen, a
  // network that drops packets while the kernel still acknowledges) is lost after this long.
  const auto silence_limit = std::chrono::seconds(3 * plan.ssh.keepalive_interval_s);
  // This relay's own (random) mark in the agent's environment: see kill_there.
  const std::string relay_mark = [] {
    std::random_device random;
    return fmt::format("DPTRAIN_RELAY_MARK={:08x}{:08x}{:08x}", random(), random(), random());
  }();
  std::unique_ptr<SshChannel> channel;
  try {
    // Through env(1) (a command in any login shell; it execs the agent, which keeps its pid),
    // with this relay's mark in its environment: what kill_there sweeps for, the agent and what it
    // starts, and nothing else there (not a login's daemons, not another connection's).
    channel =
        session->start("env " + relay_mark + " " + remote_path_word(plan.remote_binary) + " agent");
  } catch (const Error& e) {
    write_host_failure(
        stdout, fmt::format("{}: cannot start the agent: {}", plan.host.display(), e.what()));
    return 4;
  }
  // The plan (which holds the job's secret) goes to an agent that has said it speaks this
  // launcher's protocol: one of another build never reads it, so it starts nothing. An agent
  // still silent after kAgentHelloWait is asked its protocol through --version (an older build's
  // agent says nothing before its plan): another build's, or a program that is not dptrain, is
  // refused without ever being sent the plan; this build's, slow to start, is waited for.
  const auto started = std::chrono::steady_clock::now();
  bool asked_version = false;
  // Why the silent program at the binary's path cannot be this launcher's agent, as its
  // --version answers; nullopt where it can (or the answer says nothing for certain).
  const auto version_refusal = [&]() -> std::optional<std::string> {
    SshSession::Result answer;
    try {
      answer = session->run(version_command(remote_path_word(plan.remote_binary)), "",
                            std::chrono::seconds(version_probe_seconds() + 10));
    } catch (const Error&) {
      return std::nullopt;  // the silence limit decides
    }
    last_heard = std::chrono::steady_clock::now();  // the host answers
    const int protocol = agent_protocol_of(answer.out);
    if (protocol == kAgentProtocol) return std::nullopt;
    if (protocol == 1) return another_build(plan, std::nullopt);
    if (protocol > 1) return another_build(plan, std::to_string(protocol));
    // Silent as an agent, and --version says it is no (working) dptrain.
    const auto not_an_agent = [&](const std::string& answered) {
      return fmt::format(
          "{}: '{}' there has said nothing in the {} s since it was started, and {}; {}",
          plan.host.display(), plan.remote_binary, kAgentHelloWait.count(), answered,
          kNotAnAgentFix);
    };
    // Hung on --version: nothing dptrain does (a program that waits).
    if (answer.exit_status == kVersionTimedOut) {
      return not_an_agent(
          fmt::format("did not answer '--version --json' within {} s: it is not a working dptrain",
                      version_probe_seconds()));
    }
    if (answer.exit_status != 0) return std::nullopt;  // it failed otherwise: not certain
    return not_an_agent(
        "its answer to '--version --json' is not dptrain's: it is not this dptrain's agent");
  };
  // The host's end after "@done": completed, with a line saying what became of it.
  const auto completed_anyway = [&](const std::string& what) {
    std::fprintf(stdout,
                 "warning: %s after every rank there exited 0; its part of the job is taken as "
                 "completed\n",
                 what.c_str());
    std::fflush(stdout);
    return 0;
  };
  // Whatever this relay started there is killed: the program at the binary's path and what it
  // started (an agent's ranks). Through the SSH server's signal where it sends one (not for a
  // root login, with OpenSSH), and by a sweep of the host's processes that carry relay_mark:
  // how many it killed (nullopt: the sweep could not run). Where the host or the network is what
  // is stuck, it waits `within` and does nothing.
  const auto kill_there = [&](std::chrono::milliseconds within) {
    channel->send_signal("KILL");
    return session->kill_marked_processes(relay_mark, within);
  };
  // Reads what the agent says until its channel ends (true) or `within` passes (false).
  const auto read_until_end = [&](std::chrono::milliseconds within) {
    const auto until = std::chrono::steady_clock::now() + within;
    for (auto now = std::chrono::steady_clock::now(); now < until;
         now = std::chrono::steady_clock::now()) {
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - now);
      if (!channel->read(sink, std::min(left, std::chrono::milliseconds(100)))) return true;
    }
    return false;
  };
  // "stop" (SIGTERM): the agent's ranks checkpoint and stop; "interrupt" (SIGINT): they stop
  // without one, and a second kills them. The channel stays open: its end tells the agent that
  // this side is gone.
  // (After "@done" every rank there has exited 0, and the agent may have ended: a line it cannot
  // take is no loss.)
  const auto tell = [&](std::string_view line) {
    try {
      channel->write(line);
    } catch (const Error&) {
      if (!done) throw;
    }
  };
  int terms_sent = 0;
  int interrupts_sent = 0;
  bool kill_sent = false;
  auto kill_sent_at = std::chrono::steady_clock::time_point::max();
  try {
    last_heard = std::chrono::steady_clock::now();
    while (channel->read(sink, std::chrono::milliseconds(100))) {
      if (other_build()) {
        // It was not sent the plan, but it may have started something of its own.
        const int code = refuse_other_build();
        kill_there(std::chrono::seconds(5));
        return code;
      }
      if (!g_plan_sent.load() && heard_agent) {
        try {
          // Before the write: a stop that comes during it is passed on after it (the agent has
          // its plan then), not an _exit that leaves its ranks to notice the connection gone.
          g_plan_sent.store(true);
          channel->write(json_text(plan.agent.to_json()) + "\n");
        } catch (const Error&) {
          // It ended right after its first line: its end (below) says how.
          read_until_end(std::chrono::seconds(5));
          if (!channel->exit_status()) throw;
          break;
        }
      } else if (!g_plan_sent.load() && !asked_version &&
                 std::chrono::steady_clock::now() - started >= kAgentHelloWait) {
        asked_version = true;
        auto why = version_refusal();
        // What it said meanwhile goes first: a slow agent's "@agent N" came during the question.
        if (why) channel->read(sink, std::chrono::milliseconds(10));
        if (why && !heard_agent) {
          write_host_failure(stdout, *why, /*refused=*/true);
          kill_there(std::chrono::seconds(5));
          return 4;
        }
      }
      for (; terms_sent < g_terms.load(); ++terms_sent)
        tell("stop\n");
      for (; interrupts_sent < g_interrupts.load(); ++interrupts_sent)
        tell("interrupt\n");
      // The launcher's kill: the agent kills its ranks at once, and ends.
      if (g_kill.load() && !kill_sent) {
        kill_sent = true;
        kill_sent_at = std::chrono::steady_clock::now();
        tell("kill\n");
      }
      // An agent that does not end when told (stopped, in a debugger) is killed there with its
      // ranks, before the launcher gives up on this relay (kEndWait): none of them may run beside
      // the next generation. Said where the host does not answer that either.
      if (std::chrono::steady_clock::now() - kill_sent_at >= kKillAnswerWait) {
        flush_partial();
        const auto killed = kill_there(kKillSweepWait);
        // None found: ended meanwhile (its end comes on the channel), or out of the sweep's sight.
        const bool ended_meanwhile = killed == 0 && [&] {
          try {
            return read_until_end(kKillEndedWait);
          } catch (const Error&) {
            return false;  // the connection is gone as well: whether the agent ended is not known
          }
        }();
        if (!killed || (*killed == 0 && !ended_meanwhile)) {
          std::fprintf(stdout,
                       "warning: the agent on %s did not end its ranks when told, and %s: they "
                       "may still run there\n",
                       host_and_ranks(plan).c_str(),
                       killed ? "a sweep of the host's processes found none of them (the SSH "
                                "server may start commands where its processes cannot be seen, "
                                "as in another PID namespace)"
                              : "they could not be killed there (the host did not answer, or it "
                                "lacks /proc or grep -z for the sweep)");
          std::fflush(stdout);
        }
        return 128 + kRelayEndSignal;
      }
      // Before the plan, not until its --version was asked (a silence limit shorter than
      // kAgentHelloWait would take another build for a lost host).
      if (plan.ssh.keepalive_interval_s > 0 && (g_plan_sent.load() || asked_version) &&
          std::chrono::steady_clock::now() - last_heard > silence_limit) {
        if (done) {
          return completed_anyway(fmt::format("{} has not answered for {} s", host_and_ranks(plan),
                                              silence_limit.count()));
        }
        // Whatever runs there is not left behind where its host still listens: a frozen agent
        // (SIGSTOP, a debugger) would wait for ever with its ranks, a program that waits too.
        // SIGKILL reaches a stopped process. Briefly (the launcher takes the host as lost once
        // this relay ends): a host whose SSH server is what is stuck cannot be swept, and one
        // that was shows the agent is what is stuck.
        const auto killed = kill_there(std::chrono::seconds(1));
        const bool swept = killed.value_or(0) > 0;
        // An agent says its protocol as it starts and that it is alive every second after: a
        // program that never said a word may be no agent at all (a program that waits, or a
        // build that hangs).
        write_host_failure(
            stdout,
            heard_agent
                ? fmt::format("{} has not answered for {} s (its agent says it is alive every "
                              "second){}; its ranks are taken as lost",
                              host_and_ranks(plan), silence_limit.count(),
                              swept ? ": its SSH server answers, so its agent is stuck (stopped, "
                                      "or in a debugger): it was killed there, with its ranks"
                                    : ": the host, its SSH server or the network is stuck")
                : fmt::format("{} has not answered for {} s, and '{}' there has said nothing "
                              "since it was started: it may not be this dptrain's agent (a "
                              "program that waits, or a build that hangs: 'dptrain doctor' checks "
                              "it){}; its ranks are taken as lost",
                              host_and_ranks(plan), silence_limit.count(), plan.remote_binary,
                              swept ? " (its SSH server answers; it was killed there)"
                                    : ", or the host, its SSH server or the network is stuck"));
        return 3;
      }
    }
    if (other_build()) return refuse_other_build();
    flush_partial();
  } catch (const Error& e) {
    if (other_build()) return refuse_other_build();  // what it said is the cause
    if (done) {
      return completed_anyway(
          fmt::format("lost the SSH connection to {}: {}", host_and_ranks(plan), e.what()));
    }
    write_host_failure(
        stdout, fmt::format("lost the SSH connection to {}: {}", host_and_ranks(plan), e.what()));
    return 3;
  }
  const auto status = channel->exit_status();
  if (!status && done) {
    return completed_anyway(
        fmt::format("the agent on {} ended without an exit status", host_and_ranks(plan)));
  }
  if (!status) {
    write_host_failure(
        stdout, fmt::format("the agent on {} ended without an exit status (connection lost?)",
                            host_and_ranks(plan)));
    return 3;
  }
  // The signal that killed the agent: as its SSH server reports it, or (through a shell that did
  // not exec it) as 128 + N from a program that never spoke (an agent's stops exit 130 or 143).
  // An agent says "@agent N" as it starts, so one killed through such a shell shows as its code.
  int sig = channel->exit_signal();
  if (sig == 0 && !heard_agent && *status > 128 && *status < 128 + 65 && *status != 130 &&
      *status != 143) {
    sig = *status - 128;
  }
  // The agent stopped by a SIGINT on its host (by hand, say), not sent by this launcher: its
  // ranks stopped without a checkpoint. Named, with its host and ranks, not as an exit code.
  if (sig == 0 && *status == 130 && interrupts_sent == 0 && !kill_sent && !done) {
    write_host_failure(stdout,
                       fmt::format("the agent on {} was stopped by SIGINT on its host (not by this "
                                   "launcher): its ranks stopped without a checkpoint",
                                   host_and_ranks(plan)),
                       /*refused=*/false, SIGINT);
    return 130;
  }
  // A program that crashed as it started, before it said it is an agent (it says so first): the
  // binary there cannot run (damaged, cut short, built for another CPU), and a restart would meet
  // it again. Not a SIGKILL or a stop (the OOM killer, a user): those say nothing of the binary.
  const bool crash = sig == SIGSEGV || sig == SIGBUS || sig == SIGILL || sig == SIGABRT ||
                     sig == SIGFPE || sig == SIGSYS || sig == SIGTRAP;
  if (crash && !heard_agent && !done) {
    write_host_failure(
        stdout,
        fmt::format("{}: '{}' there was killed by {} as it started, before it said it is an "
                    "agent{}: that binary cannot run there (damaged, cut short, or built for "
                    "another machine?); {}",
                    plan.host.display(), plan.remote_binary, signal_name(sig),
                    last_line_note(last_line), kNotAnAgentFix),
        /*refused=*/true);
    return 4;
  }
  if (sig != 0) {
    // The agent itself killed (its ranks die with it): its SSH server says by what.
    const std::string what = fmt::format(
        "the agent on {} was killed by {}{}", host_and_ranks(plan), signal_name(sig),
        sig == SIGKILL ? " (by hand, the kernel's OOM killer or the node's scheduler)" : "");
    if (done) return completed_anyway(what);
    write_host_failure(stdout, what + "; its ranks are taken as lost", /*refused=*/false, sig);
    // As a process killed by it exits: the launcher takes such a death for the cause before the
    // communication errors it sets off in the ranks on other hosts.
    return 128 + sig;
  }
  // 126/127 from a program that never spoke: the shell could not run it. Not from an agent (it
  // says "@agent N" first): that is its rank's exit code passed on, the rank's failure.
  if (const auto why = heard_agent ? std::nullopt : not_runnable(*status, plan, last_line)) {
    write_host_failure(stdout, *why, /*refused=*/true);  // a restart would meet it again
    return 4;
  }
  // An agent speaks its protocol ("@agent N", "@rank N ...", "@failure ...") and says "@done"
  // before it exits 0. A program that did neither is not this dptrain's agent (another build, or
  // another program at that path: /bin/false), and its ranks never ran: a restart would meet it
  // again. Not an agent's own silent exits: 2 (it refused its plan), 128 + N (a stop before its
  // plan, or a signal through a shell that did not exec it), or one that failed before it spoke,
  // saying why on its own error line.
  const bool agents_silent_exit =
      *status == 2 || *status >= 128 || last_line.starts_with(kErrorLinePrefix);
  if (!done && !heard_agent && !agents_silent_exit) {
    write_host_failure(
        stdout,
        fmt::format("{}: '{}' there exited {} without running its ranks{}: it is not this "
                    "dptrain's agent (another version?); {}",
                    plan.host.display(), plan.remote_binary,
                    *status == 0 ? std::string("0") : fmt::format("with code {}", *status),
                    last_line_note(last_line), kNotAnAgentFix),
        /*refused=*/true);
    return 4;
  }
  return *status;
}

}  // namespace dptrain
