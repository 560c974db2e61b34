// SSH to the hosts of a job (libssh): verified host keys, key authentication, commands with
// streamed output and exit status, uploads, and running one task per host in parallel.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

#include "core/error.hpp"
#include "launch/hostfile.hpp"

namespace dptrain {

struct SshOptions {
  // --identity files, tried after the agent and HostSpec::key, before ~/.ssh/id_*.
  std::vector<std::filesystem::path> identities;
  std::filesystem::path known_hosts;  // empty: ~/.ssh/known_hosts
  bool accept_new_host_keys = false;  // like OpenSSH accept-new: record unknown hosts
  // Also the limit of each blocking step inside a session (channel open, SFTP request).
  std::chrono::milliseconds connect_timeout{10000};
  std::chrono::milliseconds command_timeout{120000};  // SshSession::run
  int keepalive_interval_s = 15;                      // 0: none
  // When set, called while a command of run() is waited for (every 250 ms): it throws to stop
  // waiting (a stop signal), and the command is sent SIGKILL (where the server allows) and its
  // channel closed before the exception passes on. While connecting too (every 20 ms): the
  // connection is then dropped.
  std::function<void()> check_stop;
};

// One argument for a POSIX shell: unchanged when it holds only safe characters, else in single
// quotes (a ' inside becomes '\''). Every command sent over SSH is built from these.
std::string shell_quote(std::string_view arg);
// argv as one shell command line, each argument quoted.
std::string shell_command(const std::vector<std::string>& argv);
// A path on the remote host as one shell word: a leading "~" or "~/" expands to that host's
// $HOME there; everything else stays literal.
std::string remote_path_word(const std::string& path);
// The key files a connection to `host` tries, in order: HostSpec::key, then the --identity files
// (each once), then the usual default keys (~/.ssh/id_*; flagged false: not named by the user).
std::vector<std::pair<std::filesystem::path, bool>> identity_files(const HostSpec& host,
                                                                   const SshOptions& options);

// The known_hosts file used when SshOptions::known_hosts is empty: $HOME/.ssh/known_hosts.
std::filesystem::path default_known_hosts();

struct SessionHandle;  // the libssh session, shared by a session and its channels

// One remote command with streamed output. Used from one thread (libssh sessions are not
// thread-safe): the thread that owns the SshSession.
class SshChannel {
 public:
  ~SshChannel();
  SshChannel(const SshChannel&) = delete;
  SshChannel& operator=(const SshChannel&) = delete;

  void write(std::string_view data);  // to the command's stdin
  void close_stdin();                 // EOF: the remote `dptrain agent` stops its ranks on EOF
  // Waits up to `timeout` for output and delivers what arrived (stdout and stderr chunks). Returns
  // false once the command ended and all of its output was delivered; true otherwise (also when
  // the timeout passed with nothing to deliver). Sends keepalives while it waits. Error(ssh) when
  // the connection is lost.
  bool read(const std::function<void(std::string_view data, bool is_stderr)>& sink,
            std::chrono::milliseconds timeout);
  // Known after read() returned false: the exit status, or 128 + N when signal N killed the
  // command; nullopt when the remote side reported neither.
  std::optional<int> exit_status() const { return exit_status_; }
  // The signal that killed the command, as the server named it (SIGKILL: 9); 0 when it exited.
  int exit_signal() const { return exit_signal_; }
  // Asks the host's SSH server to send signal `name` ("KILL") to the command's process group
  // (OpenSSH 7.9 and later do for a plain command; others ignore it). Best effort, without
  // waiting for an answer: false when it could not even be sent.
  bool send_signal(const char* name) noexcept;
  void close();  // idempotent; the destructor does it too

 private:
  friend class SshSession;
  struct Handle;
  SshChannel(std::shared_ptr<SessionHandle> session, std::string command, int keepalive_s,
             std::chrono::milliseconds write_timeout);
  bool drain(const std::function<void(std::string_view, bool)>& sink);
  bool finished();
  [[noreturn]] void fail(const std::string& what) const;

  std::shared_ptr<SessionHandle> session_;
  std::unique_ptr<Handle> handle_;
  std::string command_;  // for messages
  int keepalive_s_;
  std::chrono::milliseconds write_timeout_;  // a write that makes no progress this long fails
  std::chrono::steady_clock::time_point last_keepalive_;
  std::optional<int> exit_status_;
  int exit_signal_ = 0;
};

// The host answered and refused this client: authentication, or its host key (unknown, changed
// or revoked). Unlike an unreachable host, a retry meets the same refusal until someone changes a
// key or known_hosts.
class SshRefused : public Error {
 public:
  explicit SshRefused(const std::string& message) : Error(ErrorKind::ssh, message) {}
};

// No connection could be made to the host at all (refused, timed out, no route, a name that
// does not resolve): unlike a refusal, the host may answer a later attempt (a reboot).
class SshUnreachable : public Error {
 public:
  explicit SshUnreachable(const std::string& message) : Error(ErrorKind::ssh, message) {}
};

class SshSession {
 public:
  // Connects, verifies the host key against known_hosts, authenticates (agent, then HostSpec::key,
  // then options.identities, then ~/.ssh/id_ed25519, id_ecdsa, id_rsa). Error(ssh) with a one-line
  // message naming host.display() and the reason (unreachable, auth refused, host key unknown or
  // changed); SshRefused for a refusal.
  static std::unique_ptr<SshSession> connect(const HostSpec& host, const SshOptions& options);
  ~SshSession();
  SshSession(const SshSession&) = delete;
  SshSession& operator=(const SshSession&) = delete;

  struct Result {
    int exit_status = -1;  // 128 + N when signal N killed it
    std::string out, err;
  };
  // Runs a command to its end within options.command_timeout, or `timeout` where given (Error(ssh)
  // naming the host and the command when it takes longer); stdin_data is written to its stdin,
  // then EOF.
  Result run(const std::string& command, const std::string& stdin_data = "",
             std::optional<std::chrono::milliseconds> timeout = std::nullopt);
  // SIGKILL to every process on the host whose environment holds the line `mark` (NAME=VALUE: a
  // program started through `env NAME=VALUE ...` and what it started), found in /proc: what
  // SshChannel::send_signal asks for, also where the SSH server refuses that (OpenSSH does for a
  // root login). Within `timeout` (each blocking step too). How many it killed; nullopt where the
  // sweep could not run (the host or the connection stuck, a host without /proc or grep -z).
  std::optional<int> kill_marked_processes(const std::string& mark,
                                           std::chrono::milliseconds timeout) noexcept;
  // Starts a command and returns at once; its output comes through SshChannel::read.
  std::unique_ptr<SshChannel> start(const std::string& command);
  // Streams `local` to remote_path + ".tmp-<random>" through `sh` and `cat` on the host (a channel
  // keeps the host's whole window in flight: no round trip per packet, as SFTP has), checks that
  // every byte arrived, sets `mode`, and renames it over remote_path (atomic on the remote: a
  // reader sees the old file or the new one). On failure nothing is left behind. Give an absolute
  // remote_path. Error(ssh) naming host, path and the host's reason; Error(io) when `local`
  // cannot be read. `sent`, when given, is told the bytes sent so far as they go.
  void upload(const std::filesystem::path& local, const std::string& remote_path, int mode,
              const std::function<void(uint64_t sent)>& sent = {});

  const HostSpec& host() const { return host_; }
  const SshOptions& options() const { return options_; }

 private:
  SshSession(HostSpec host, SshOptions options, std::shared_ptr<SessionHandle> session);

  HostSpec host_;
  SshOptions options_;
  std::shared_ptr<SessionHandle> session_;
};

// What a task gave for one host: its value, or the error that stopped it.
template <typename T>
struct HostOutcome {
  HostSpec host;
  std::optional<T> value;
  std::optional<Error> error;
  bool ok() const { return !error.has_value(); }
};

// Runs fn(host) for every host at once, one thread each, and returns one outcome per host in the
// order of `hosts`. An exception from fn becomes that host's error (an Error keeps its kind;
// anything else is ErrorKind::internal); the other hosts go on.
template <typename Fn>
auto for_each_host(const std::vector<HostSpec>& hosts, Fn&& fn)
    -> std::vector<HostOutcome<std::invoke_result_t<Fn&, const HostSpec&>>> {
  using T = std::invoke_result_t<Fn&, const HostSpec&>;
  std::vector<HostOutcome<T>> outcomes(hosts.size());
  std::vector<std::jthread> threads;
  threads.reserve(hosts.size());
  for (size_t i = 0; i < hosts.size(); ++i) {
    outcomes[i].host = hosts[i];
    threads.emplace_back([&fn, &outcome = outcomes[i]] {
      try {
        outcome.value.emplace(fn(outcome.host));
      } catch (const Error& e) {
        outcome.error.emplace(e);
      } catch (const std::exception& e) {
        outcome.error.emplace(ErrorKind::internal, outcome.host.display() + ": " + e.what());
      }
    });
  }
  threads.clear();  // joins
  return outcomes;
}

}  // namespace dptrain
