// SSH over libssh: connect, verify the host key, authenticate, exec with streamed output, SFTP.
#include "launch/ssh.hpp"

#include <fcntl.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <random>
#include <set>
#include <sstream>
#include <thread>
#include <utility>

#include <fmt/format.h>
#include <libssh/callbacks.h>
#include <libssh/libssh.h>
#include <libssh/server.h>  // ssh_send_keepalive, which a client may send as well

#include "core/comm/socket.hpp"
#include "core/fs.hpp"

namespace dptrain {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

// ---- shell quoting ----

std::string shell_quote(std::string_view arg) {
  const auto safe = [](char c) {
    return std::isalnum(static_cast<unsigned char>(c)) || std::strchr("@%+=:,./-_", c) != nullptr;
  };
  if (!arg.empty() && std::all_of(arg.begin(), arg.end(), safe)) return std::string(arg);
  std::string quoted = "'";
  for (const char c : arg) {
    if (c == '\'') {
      quoted += "'\\''";  // close the quotes, an escaped quote, reopen
    } else {
      quoted += c;
    }
  }
  quoted += '\'';
  return quoted;
}

std::string remote_path_word(const std::string& path) {
  if (path == "~") return "\"$HOME\"";
  if (path.rfind("~/", 0) == 0) return "\"$HOME\"/" + shell_quote(path.substr(2));
  return shell_quote(path);
}

std::string shell_command(const std::vector<std::string>& argv) {
  std::string line;
  for (const auto& arg : argv) {
    if (!line.empty()) line += ' ';
    line += shell_quote(arg);
  }
  return line;
}

// ---- helpers ----

namespace {

std::string seconds_text(milliseconds ms) {
  // To the millisecond, without trailing zeros: 0.04s (not 0.0s), 1000000s (not 1e+06s).
  std::string text = fmt::format("{}.{:03d}", ms.count() / 1000, ms.count() % 1000);
  while (text.back() == '0')
    text.pop_back();
  if (text.back() == '.') text.pop_back();
  return text + "s";
}

// Commands can be long scripts; a message shows their start.
std::string command_excerpt(const std::string& command) {
  std::string line = command.substr(0, command.find('\n'));
  bool cut = line.size() < command.size();
  // "env NAME=VALUE... PROGRAM": the program is what names the command (the relay's mark, a
  // random value, says nothing to a reader).
  if (line.starts_with("env ")) {
    size_t at = 4;
    for (size_t end = 0; (end = line.find(' ', at)) != std::string::npos &&
                         line.substr(at, end - at).find('=') != std::string::npos;)
      at = end + 1;
    line.erase(0, at);
  }
  if (line.size() > 60) {
    line.resize(60);
    cut = true;
  }
  return "`" + line + (cut ? "..." : "") + "`";
}

struct KeyDeleter {
  void operator()(ssh_key key) const { ssh_key_free(key); }
};
using KeyPtr = std::unique_ptr<std::remove_pointer_t<ssh_key>, KeyDeleter>;

struct KnownHostsEntryDeleter {
  void operator()(ssh_knownhosts_entry* entry) const { ssh_knownhosts_entry_free(entry); }
};

std::string sha256_fingerprint(ssh_key key) {
  unsigned char* hash = nullptr;
  size_t length = 0;
  if (ssh_get_publickey_hash(key, SSH_PUBLICKEY_HASH_SHA256, &hash, &length) != SSH_OK) {
    return "(unknown fingerprint)";
  }
  char* text = ssh_get_fingerprint_hash(SSH_PUBLICKEY_HASH_SHA256, hash, length);
  ssh_clean_pubkey_hash(&hash);
  std::string fingerprint = text ? text : "(unknown fingerprint)";
  ssh_string_free_char(text);
  return fingerprint;
}

// Several sessions may record new host keys in one file at once, and a check must not read a
// half-written line: every known_hosts access of this process goes through this lock.
std::mutex& known_hosts_mutex() {
  static std::mutex mutex;
  return mutex;
}

// libssh's messages carry prefixes that say nothing to a user.
std::string clean_reason(std::string reason) {
  for (const char* prefix : {"Failed to connect: ", "Socket error: ", "Connection failed: "}) {
    if (reason.rfind(prefix, 0) == 0) reason = reason.substr(std::strlen(prefix));
  }
  while (!reason.empty() && (reason.back() == '\n' || reason.back() == '.'))
    reason.pop_back();
  return reason.empty() ? "unknown error" : reason;
}

// Refuses to prompt for a key's passphrase: dptrain runs unattended; such keys belong in the agent.
// `asked` (a bool*) records that one was asked for.
int no_passphrase(const char*, char*, size_t, int, int, void* asked) {
  if (asked != nullptr) *static_cast<bool*>(asked) = true;
  return -1;
}

// Why libssh could not take `path` as a private key, for the list of what was tried.
std::string unusable_key(const fs::path& path, bool passphrase_asked) {
  if (passphrase_asked) return "passphrase-protected: load it into ssh-agent";
  std::ifstream in(path, std::ios::binary);
  if (!in) return fmt::format("cannot be read: {}", std::strerror(errno));
  std::string head(256, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(in.gcount()));
  for (const char* type : {"ssh-", "ecdsa-", "sk-ssh-", "sk-ecdsa-"}) {
    if (head.starts_with(type)) return "a public key, not a private key";
  }
  if (head.find("PUBLIC KEY") != std::string::npos) return "a public key, not a private key";
  if (head.find("PRIVATE KEY") == std::string::npos) return "not a private key file";
  return "a private key libssh cannot read";
}

int signal_number(const std::string& name) {
  static const std::array<std::pair<const char*, int>, 15> table = {{{"HUP", 1},
                                                                     {"INT", 2},
                                                                     {"QUIT", 3},
                                                                     {"ILL", 4},
                                                                     {"TRAP", 5},
                                                                     {"ABRT", 6},
                                                                     {"BUS", 7},
                                                                     {"FPE", 8},
                                                                     {"KILL", 9},
                                                                     {"USR1", 10},
                                                                     {"SEGV", 11},
                                                                     {"USR2", 12},
                                                                     {"PIPE", 13},
                                                                     {"ALRM", 14},
                                                                     {"TERM", 15}}};
  for (const auto& [signal_name, number] : table) {
    if (name == signal_name) return number;
  }
  return 0;
}

}  // namespace

fs::path default_known_hosts() {
  return home_directory() / ".ssh" / "known_hosts";
}

// ---- the session handle ----

struct SessionHandle {
  ssh_session session = nullptr;
  ssh_event event = nullptr;  // lets one wait serve both output streams of every channel
  std::string display;
  milliseconds request_timeout{0};  // --connect-timeout: libssh applies it to every blocking call

  ~SessionHandle() {
    if (event) {
      ssh_event_remove_session(event, session);
      ssh_event_free(event);
    }
    if (session) {
      ssh_disconnect(session);
      ssh_free(session);
    }
  }
  std::string error() const { return clean_reason(ssh_get_error(session)); }
  bool connected() const {
    return ssh_is_connected(session) &&
           !(ssh_get_status(session) & (SSH_CLOSED | SSH_CLOSED_ERROR));
  }
  // Handles what arrives within `timeout` (callbacks run); false when the connection failed.
  bool wait(milliseconds timeout) {
    if (!event) {
      event = ssh_event_new();
      if (!event || ssh_event_add_session(event, session) != SSH_OK) {
        throw Error(ErrorKind::internal, "cannot create a libssh event for " + display);
      }
    }
    const int rc = ssh_event_dopoll(event, static_cast<int>(std::max<int64_t>(timeout.count(), 0)));
    return rc != SSH_ERROR && connected();
  }
  // Without waiting for the reply: the reply (a refusal) only matters as traffic, and a dead peer
  // shows up as a TCP error (see enable_tcp_keepalive).
  void send_keepalive() {
    ssh_set_blocking(session, 0);
    ssh_send_keepalive(session);
    ssh_set_blocking(session, 1);
  }
};

namespace {

// A peer that vanished without closing the connection (power loss, a cable, a NAT that forgot us)
// is declared dead by the kernel: after `interval` idle, probes every `interval`, three missed;
// and data (a keepalive) unacknowledged for three intervals drops the connection.
void enable_tcp_keepalive(ssh_session session, int interval_s) {
  if (interval_s <= 0) return;
  const int fd = ssh_get_fd(session);
  if (fd < 0) return;
  const int on = 1, count = 3;
  const unsigned user_timeout_ms = static_cast<unsigned>(interval_s) * 3000u;
  ::setsockopt(fd, SOL_SOCKET, SO_KEEPALIVE, &on, sizeof on);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPIDLE, &interval_s, sizeof interval_s);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPINTVL, &interval_s, sizeof interval_s);
  ::setsockopt(fd, IPPROTO_TCP, TCP_KEEPCNT, &count, sizeof count);
  ::setsockopt(fd, IPPROTO_TCP, TCP_USER_TIMEOUT, &user_timeout_ms, sizeof user_timeout_ms);
}

// The limit libssh gives each blocking step of the session (connecting, a channel's opening).
bool set_step_timeout(ssh_session session, milliseconds step) {
  const long whole = static_cast<long>(step.count() / 1000);
  const long micro = static_cast<long>(step.count() % 1000) * 1000;
  return ssh_options_set(session, SSH_OPTIONS_TIMEOUT, &whole) == SSH_OK &&
         ssh_options_set(session, SSH_OPTIONS_TIMEOUT_USEC, &micro) == SSH_OK;
}

void set_options(ssh_session session, const HostSpec& host, const SshOptions& options,
                 const fs::path& known_hosts) {
  const unsigned port = host.port;
  const int nodelay = 1;
  // ~/.ssh/config is not read: the hostfile and the command line say everything, the same way
  // on every machine that runs the launcher.
  const bool process_config = false;
  bool ok = ssh_options_set(session, SSH_OPTIONS_HOST, host.host.c_str()) == SSH_OK &&
            ssh_options_set(session, SSH_OPTIONS_PORT, &port) == SSH_OK &&
            ssh_options_set(session, SSH_OPTIONS_KNOWNHOSTS, known_hosts.c_str()) == SSH_OK &&
            set_step_timeout(session, options.connect_timeout) &&
            ssh_options_set(session, SSH_OPTIONS_NODELAY, &nodelay) == SSH_OK &&
            ssh_options_set(session, SSH_OPTIONS_PROCESS_CONFIG, &process_config) == SSH_OK;
  if (ok && !host.user.empty()) {
    ok = ssh_options_set(session, SSH_OPTIONS_USER, host.user.c_str()) == SSH_OK;
  }
  if (!ok) {
    throw Error(ErrorKind::ssh, fmt::format("invalid SSH settings for {}: {}", host.display(),
                                            clean_reason(ssh_get_error(session))));
  }
}

// The host port the way known_hosts writes it: "host" for port 22, else "[host]:port".
std::string known_hosts_name(const HostSpec& host) {
  if (host.port == 22) return host.host;
  return fmt::format("[{}]:{}", host.host, host.port);
}

struct KnownEntry {
  fs::path file;
  int line = 0;
  std::string fingerprint;
};

// The first line of `file` for this host whose key is not `offered` (the entry a changed key
// contradicts), preferring one of the offered key's type. Call with known_hosts_mutex held.
std::optional<KnownEntry> conflicting_entry(const fs::path& file, const std::string& name,
                                            ssh_key offered) {
  std::ifstream in(file);
  std::optional<KnownEntry> found;
  int number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    const auto start = line.find_first_not_of(" \t");
    if (start == std::string::npos || line[start] == '#' || line[start] == '@') continue;
    ssh_knownhosts_entry* raw = nullptr;
    if (ssh_known_hosts_parse_line(name.c_str(), line.c_str() + start, &raw) != SSH_OK) continue;
    std::unique_ptr<ssh_knownhosts_entry, KnownHostsEntryDeleter> entry(raw);
    if (!entry->publickey || ssh_key_cmp(entry->publickey, offered, SSH_KEY_CMP_PUBLIC) == 0) {
      continue;
    }
    KnownEntry candidate{file, number, sha256_fingerprint(entry->publickey)};
    if (ssh_key_type(entry->publickey) == ssh_key_type(offered)) return candidate;
    if (!found) found = candidate;
  }
  return found;
}

// The first "@revoked" line of `file` whose key is `offered`, whatever its host patterns (a key
// revoked is trusted nowhere), as OpenSSH refuses it; libssh reads no markers. Call with
// known_hosts_mutex held.
std::optional<KnownEntry> revoking_entry(const fs::path& file, ssh_key offered) {
  std::ifstream in(file);
  int number = 0;
  for (std::string line; std::getline(in, line);) {
    ++number;
    std::istringstream fields(line);
    std::string marker, patterns, type, base64;
    if (!(fields >> marker >> patterns >> type >> base64) || marker != "@revoked") continue;
    ssh_key raw = nullptr;
    if (ssh_pki_import_pubkey_base64(base64.c_str(), ssh_key_type_from_name(type.c_str()), &raw) !=
        SSH_OK) {
      continue;
    }
    const KeyPtr key(raw);
    if (ssh_key_cmp(key.get(), offered, SSH_KEY_CMP_PUBLIC) == 0) {
      return KnownEntry{file, number, sha256_fingerprint(offered)};
    }
  }
  return std::nullopt;
}

void verify_host_key(ssh_session session, const HostSpec& host, const fs::path& known_hosts,
                     bool accept_new) {
  ssh_key raw_key = nullptr;
  if (ssh_get_server_publickey(session, &raw_key) != SSH_OK) {
    throw Error(ErrorKind::ssh, fmt::format("{} sent no host key", host.display()));
  }
  const KeyPtr offered(raw_key);
  const std::string offered_fingerprint = sha256_fingerprint(offered.get());
  const std::lock_guard lock(known_hosts_mutex());
  for (const fs::path& file : {known_hosts, fs::path("/etc/ssh/ssh_known_hosts")}) {
    if (const auto revoked = revoking_entry(file, offered.get())) {
      throw SshRefused(
          fmt::format("HOST KEY OF {} IS REVOKED: {} line {} revokes the key the host "
                      "offers ({}); refusing (possible man-in-the-middle, or a host "
                      "still using a retired key)",
                      host.display(), revoked->file.string(), revoked->line, offered_fingerprint));
    }
  }
  switch (ssh_session_is_known_server(session)) {
    case SSH_KNOWN_HOSTS_OK:
      return;
    case SSH_KNOWN_HOSTS_CHANGED:
    case SSH_KNOWN_HOSTS_OTHER: {
      const std::string name = known_hosts_name(host);
      auto entry = conflicting_entry(known_hosts, name, offered.get());
      if (!entry) entry = conflicting_entry("/etc/ssh/ssh_known_hosts", name, offered.get());
      const KnownEntry known = entry.value_or(KnownEntry{known_hosts, 0, "another key"});
      throw SshRefused(fmt::format(
          "HOST KEY OF {} CHANGED: known_hosts has {}, the host offers {}; "
          "refusing (possible man-in-the-middle; fix {} line {} if the "
          "change is expected)",
          host.display(), known.fingerprint, offered_fingerprint, known.file.string(), known.line));
    }
    case SSH_KNOWN_HOSTS_UNKNOWN:
    case SSH_KNOWN_HOSTS_NOT_FOUND:
      if (!accept_new) {
        throw SshRefused(
            fmt::format("host key of {} is not in known_hosts {} (the host offers {}); "
                        "verify it and add it, or pass --accept-new-host-keys",
                        host.display(), known_hosts.string(), offered_fingerprint));
      }
      if (ssh_session_update_known_hosts(session) != SSH_OK) {
        throw Error(ErrorKind::ssh,
                    fmt::format("cannot record the host key of {} in {}: {}", host.display(),
                                known_hosts.string(), clean_reason(ssh_get_error(session))));
      }
      return;
    case SSH_KNOWN_HOSTS_ERROR:
      break;
  }
  throw Error(ErrorKind::ssh,
              fmt::format("cannot check the host key of {} against {}: {}", host.display(),
                          known_hosts.string(), clean_reason(ssh_get_error(session))));
}

void authenticate(ssh_session session, const HostSpec& host, const SshOptions& options) {
  std::vector<std::string> tried;
  std::string ended;  // why the server stopped listening, if it did
  const auto accepted = [&](int rc) {
    if (rc == SSH_AUTH_ERROR && !ssh_is_connected(session)) {
      ended = "; the server closed the connection: " + clean_reason(ssh_get_error(session));
    }
    return rc == SSH_AUTH_SUCCESS;
  };
  // A key named for the host goes first: an agent holding many keys would otherwise use up the
  // server's MaxAuthTries (6 by default) before it is offered.
  const auto offer_file = [&](const fs::path& path, bool explicit_file) {
    std::error_code ec;
    if (!fs::exists(path, ec)) {
      if (explicit_file) tried.push_back(path.string() + " (missing)");
      return false;
    }
    ssh_key raw = nullptr;
    bool asked = false;
    if (ssh_pki_import_privkey_file(path.c_str(), nullptr, no_passphrase, &asked, &raw) != SSH_OK) {
      tried.push_back(fmt::format("{} ({})", path.string(), unusable_key(path, asked)));
      return false;
    }
    const KeyPtr key(raw);
    tried.push_back(path.string());
    return accepted(ssh_userauth_publickey(session, nullptr, key.get()));
  };
  const auto files = identity_files(host, options);
  for (const auto& [path, explicit_file] : files) {
    if (explicit_file && ended.empty() && offer_file(path, true)) return;
  }
  if (const char* agent = std::getenv("SSH_AUTH_SOCK"); agent && *agent && ended.empty()) {
    tried.emplace_back("agent");
    if (accepted(ssh_userauth_agent(session, nullptr))) return;
  }
  for (const auto& [path, explicit_file] : files) {
    if (!explicit_file && ended.empty() && offer_file(path, false)) return;
  }
  const std::string list =
      tried.empty() ? "no agent and no identity file" : fmt::format("{}", fmt::join(tried, ", "));
  std::string message =
      fmt::format("authentication refused for {} (tried: {}){}", host.display(), list, ended);
  // The server that closed the connection mid-way (a network drop, LoginGraceTime under load)
  // may take the next try: only a refusal it answered is settled.
  if (!ended.empty()) throw Error(ErrorKind::ssh, message);
  throw SshRefused(message);
}

}  // namespace

std::vector<std::pair<fs::path, bool>> identity_files(const HostSpec& host,
                                                      const SshOptions& options) {
  std::vector<std::pair<fs::path, bool>> files;  // path, named explicitly
  std::set<std::string> seen;
  const auto add = [&](const fs::path& path, bool explicit_file) {
    if (seen.insert(path.lexically_normal().string()).second)
      files.emplace_back(path, explicit_file);
  };
  if (!host.key.empty()) add(expand_home(host.key), true);
  for (const auto& identity : options.identities)
    add(expand_home(identity.string()), true);
  for (const char* name : {"id_ed25519", "id_ecdsa", "id_rsa"}) {
    add(home_directory() / ".ssh" / name, false);
  }
  return files;
}

// ---- SshChannel ----

struct SshChannel::Handle {
  ssh_channel channel = nullptr;
  ssh_channel_callbacks_struct callbacks{};
  std::vector<std::pair<std::string, bool>> chunks;  // arrived, not yet delivered; in order
  bool eof = false;
  bool closed = false;
  std::optional<int> exit_status;
  int exit_signal = 0;

  ~Handle() {
    if (channel) ssh_channel_free(channel);
  }

  static int on_data(ssh_session, ssh_channel, void* data, uint32_t len, int is_stderr,
                     void* self) {
    auto& chunks = static_cast<Handle*>(self)->chunks;
    const std::string_view bytes(static_cast<const char*>(data), len);
    const bool err = is_stderr != 0;
    if (!chunks.empty() && chunks.back().second == err) {
      chunks.back().first += bytes;
    } else {
      chunks.emplace_back(std::string(bytes), err);
    }
    return static_cast<int>(len);
  }
  static void on_eof(ssh_session, ssh_channel, void* self) {
    static_cast<Handle*>(self)->eof = true;
  }
  static void on_close(ssh_session, ssh_channel, void* self) {
    static_cast<Handle*>(self)->closed = true;
  }
  static void on_exit_status(ssh_session, ssh_channel, int status, void* self) {
    static_cast<Handle*>(self)->exit_status = status;
  }
  static void on_exit_signal(ssh_session, ssh_channel, const char* signal, int, const char*,
                             const char*, void* self) {
    Handle& h = *static_cast<Handle*>(self);
    h.exit_signal = signal_number(signal ? signal : "");
    h.exit_status = 128 + h.exit_signal;
  }
};

SshChannel::SshChannel(std::shared_ptr<SessionHandle> session, std::string command, int keepalive_s,
                       std::chrono::milliseconds write_timeout)
    : session_(std::move(session)),
      handle_(std::make_unique<Handle>()),
      command_(std::move(command)),
      keepalive_s_(keepalive_s),
      write_timeout_(write_timeout),
      last_keepalive_(Clock::now()) {
  Handle& h = *handle_;
  h.channel = ssh_channel_new(session_->session);
  const auto asked = Clock::now();
  if (!h.channel || ssh_channel_open_session(h.channel) != SSH_OK) {
    // libssh leaves a request that ran out of time (it bounds each by the connect timeout)
    // without a reason: said so where the time did run out.
    if (h.channel && session_->error() == "unknown error" &&
        Clock::now() - asked >= session_->request_timeout) {
      throw Error(ErrorKind::ssh, fmt::format("cannot open a channel {} on {}: no answer within {} "
                                              "(--connect-timeout, which bounds each SSH request)",
                                              command_excerpt(command_), session_->display,
                                              seconds_text(session_->request_timeout)));
    }
    fail("cannot open a channel");
  }
  h.callbacks.userdata = &h;
  h.callbacks.channel_data_function = &Handle::on_data;
  h.callbacks.channel_eof_function = &Handle::on_eof;
  h.callbacks.channel_close_function = &Handle::on_close;
  h.callbacks.channel_exit_status_function = &Handle::on_exit_status;
  h.callbacks.channel_exit_signal_function = &Handle::on_exit_signal;
  ssh_callbacks_init(&h.callbacks);
  if (ssh_set_channel_callbacks(h.channel, &h.callbacks) != SSH_OK) {
    fail("cannot set channel callbacks");
  }
  if (ssh_channel_request_exec(h.channel, command_.c_str()) != SSH_OK) {
    fail("cannot start the command");
  }
}

SshChannel::~SshChannel() {
  close();
}

void SshChannel::fail(const std::string& what) const {
  throw Error(ErrorKind::ssh, fmt::format("{} {} on {}: {}", what, command_excerpt(command_),
                                          session_->display, session_->error()));
}

void SshChannel::write(std::string_view data) {
  if (!handle_->channel) fail("write to a closed channel of");
  auto moved = Clock::now();  // when the host last took some
  while (!data.empty()) {
    const auto chunk = static_cast<uint32_t>(std::min<size_t>(data.size(), 1u << 20));
    const int written = ssh_channel_write(handle_->channel, data.data(), chunk);
    if (written < 0) fail("cannot write to the stdin of");
    if (written == 0) {
      // libssh gave up waiting for the host to take more (the session's timeout, which is the
      // connect timeout): a host that reads slowly (a busy disk, a shared file system) is waited
      // for while its channel stays open, up to the command timeout without progress.
      if (!ssh_channel_is_open(handle_->channel) || !session_->connected()) {
        fail("cannot write to the stdin of");
      }
      if (Clock::now() - moved > write_timeout_) {
        throw Error(ErrorKind::ssh,
                    fmt::format("cannot write to the stdin of {} on {}: the host took no more of "
                                "it for {}",
                                command_excerpt(command_), session_->display,
                                seconds_text(write_timeout_)));
      }
      continue;
    }
    moved = Clock::now();
    data.remove_prefix(static_cast<size_t>(written));
  }
}

void SshChannel::close_stdin() {
  if (handle_->channel && ssh_channel_send_eof(handle_->channel) != SSH_OK) {
    fail("cannot close the stdin of");
  }
}

bool SshChannel::drain(const std::function<void(std::string_view, bool)>& sink) {
  if (handle_->chunks.empty()) return false;
  // Taken out first: the sink may call back into this channel (write, close).
  auto chunks = std::exchange(handle_->chunks, {});
  for (const auto& [data, is_stderr] : chunks)
    sink(data, is_stderr);
  return true;
}

// The command has ended: the remote closed the channel, or sent EOF and its exit status.
bool SshChannel::finished() {
  const Handle& h = *handle_;
  if (!h.channel) return true;  // closed on this side
  return h.closed || (h.eof && h.exit_status.has_value());
}

bool SshChannel::read(const std::function<void(std::string_view data, bool is_stderr)>& sink,
                      milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    if (drain(sink)) return true;
    if (finished()) {
      exit_status_ = handle_->exit_status;
      exit_signal_ = handle_->exit_signal;
      return false;
    }
    const auto now = Clock::now();
    if (now >= deadline) return true;
    auto slice = std::chrono::duration_cast<milliseconds>(deadline - now);
    if (keepalive_s_ > 0) {
      const auto next_keepalive = last_keepalive_ + std::chrono::seconds(keepalive_s_);
      if (now >= next_keepalive) {
        session_->send_keepalive();
        last_keepalive_ = now;
        continue;
      }
      slice = std::min(
          slice, std::chrono::duration_cast<milliseconds>(next_keepalive - now) + milliseconds(1));
    }
    if (!session_->wait(slice) && handle_->chunks.empty() && !finished()) {
      fail("lost the SSH connection while running");
    }
  }
}

bool SshChannel::send_signal(const char* name) noexcept {
  if (!handle_ || !handle_->channel || !ssh_channel_is_open(handle_->channel) ||
      !session_->connected()) {
    return false;
  }
  return ssh_channel_request_send_signal(handle_->channel, name) == SSH_OK;
}

void SshChannel::close() {
  if (!handle_ || !handle_->channel) return;
  if (ssh_channel_is_open(handle_->channel) && session_->connected()) {
    ssh_channel_close(handle_->channel);
  }
  ssh_channel_free(handle_->channel);
  handle_->channel = nullptr;
}

// ---- SshSession ----

namespace {

// ssh_connect, cut short by options.check_stop (which throws) where it is set: a host slow to
// answer (a silent port, a stuck server) is not waited out after a Ctrl-C. libssh's non-blocking
// connect then runs step by step, with connect_timeout as this loop's own limit (`timed_out`).
int connect_stoppable(ssh_session session, const SshOptions& options, bool& timed_out) {
  if (!options.check_stop) return ssh_connect(session);
  ssh_set_blocking(session, 0);
  struct Blocking {
    ssh_session session;
    ~Blocking() { ssh_set_blocking(session, 1); }
  } restore{session};
  const auto began = Clock::now();
  const auto deadline = began + options.connect_timeout;
  int rc = SSH_AGAIN;
  while ((rc = ssh_connect(session)) == SSH_AGAIN) {
    try {
      options.check_stop();
    } catch (const Error& e) {
      if (!is_stop_kind(e.kind())) throw;
      // What the stop cut short, and how long the host had been given: a host that never
      // answers reads apart from one stopped a moment after the start.
      throw Error(
          e.kind(),
          fmt::format("{} while connecting (no SSH answer yet after {} of "
                      "--connect-timeout {}; nothing was done there)",
                      e.what(),
                      seconds_text(std::chrono::duration_cast<milliseconds>(Clock::now() - began)),
                      seconds_text(options.connect_timeout)));
    }
    if (Clock::now() >= deadline) {
      timed_out = true;
      return SSH_ERROR;
    }
    // What comes from the server, or a short pause (a TCP connect in progress shows as
    // writable, which would not wait).
    if (struct pollfd p{ssh_get_fd(session), POLLIN, 0}; p.fd >= 0) {
      ::poll(&p, 1, 20);
    } else {
      std::this_thread::sleep_for(milliseconds(20));
    }
  }
  return rc;
}

}  // namespace

SshSession::SshSession(HostSpec host, SshOptions options, std::shared_ptr<SessionHandle> session)
    : host_(std::move(host)), options_(std::move(options)), session_(std::move(session)) {}

SshSession::~SshSession() = default;

std::unique_ptr<SshSession> SshSession::connect(const HostSpec& host, const SshOptions& options) {
  auto handle = std::make_shared<SessionHandle>();
  handle->display = host.display();
  handle->request_timeout = options.connect_timeout;
  handle->session = ssh_new();
  if (!handle->session) throw Error(ErrorKind::internal, "cannot create an SSH session");
  const fs::path known_hosts =
      options.known_hosts.empty() ? default_known_hosts() : options.known_hosts;
  set_options(handle->session, host, options, known_hosts);
  const auto started = std::chrono::steady_clock::now();
  bool timed_out = false;  // connect_stoppable's own limit ran out
  if (connect_stoppable(handle->session, options, timed_out) != SSH_OK) {
    // "within" only where the time (most likely) ran out: a refusal comes at once. A guess from
    // the time taken: libssh does not say which it was.
    const bool waited = std::chrono::steady_clock::now() - started >= options.connect_timeout / 2;
    // libssh says "Timeout connecting" whether the TCP connection or the SSH server's greeting
    // never came, and "disconnected" for a service that closed it: a port that takes
    // connections says which.
    if (ssh_get_serverbanner(handle->session) == nullptr &&
        connect_tcp(host.host, host.port, Clock::now() + std::chrono::seconds(1)).fd) {
      throw Error(
          ErrorKind::ssh,
          waited ? fmt::format("cannot connect to {}: its port {} takes TCP connections, but no "
                               "SSH server answered there within {} (another service on that "
                               "port, or an SSH server that is stuck)",
                               host.display(), host.port, seconds_text(options.connect_timeout))
                 : fmt::format("cannot connect to {}: its port {} takes TCP connections, but "
                               "what answers there spoke no SSH ({}: another service on that "
                               "port, or an SSH server turning connections away, MaxStartups)",
                               host.display(), host.port, handle->error()));
    }
    const std::string why = timed_out ? "Timeout connecting to " + host.host : handle->error();
    // The port too where the host's name leaves it out (22): a refused or silent port is the
    // cause as often as the host.
    const std::string where = host.port == kDefaultSshPort
                                  ? fmt::format("{} (port {})", host.display(), host.port)
                                  : host.display();
    throw SshUnreachable(fmt::format(
        "cannot connect to {}{}: {}", where,
        waited ? " within " + seconds_text(options.connect_timeout) : std::string(), why));
  }
  enable_tcp_keepalive(handle->session, options.keepalive_interval_s);
  verify_host_key(handle->session, host, known_hosts, options.accept_new_host_keys);
  authenticate(handle->session, host, options);
  return std::unique_ptr<SshSession>(new SshSession(host, options, std::move(handle)));
}

std::unique_ptr<SshChannel> SshSession::start(const std::string& command) {
  return std::unique_ptr<SshChannel>(
      new SshChannel(session_, command, options_.keepalive_interval_s, options_.command_timeout));
}

// How often run() asks SshOptions::check_stop while it waits.
constexpr milliseconds kStopPoll{250};

SshSession::Result SshSession::run(const std::string& command, const std::string& stdin_data,
                                   std::optional<milliseconds> timeout) {
  const milliseconds limit = timeout.value_or(options_.command_timeout);
  const auto deadline = Clock::now() + limit;
  auto channel = start(command);
  if (!stdin_data.empty()) channel->write(stdin_data);
  channel->close_stdin();
  Result result;
  const auto collect = [&](std::string_view data, bool is_stderr) {
    (is_stderr ? result.err : result.out) += data;
  };
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) {
      channel->close();
      throw Error(ErrorKind::ssh,
                  fmt::format("{} on {} did not finish within {}", command_excerpt(command),
                              host_.display(), seconds_text(limit)));
    }
    if (!options_.check_stop) {
      if (!channel->read(collect, left)) break;
      continue;
    }
    if (!channel->read(collect, std::min(left, kStopPoll))) break;
    try {
      options_.check_stop();
    } catch (...) {
      channel->send_signal("KILL");
      channel->close();
      throw;
    }
  }
  result.exit_status = channel->exit_status().value_or(-1);
  return result;
}

std::optional<int> SshSession::kill_marked_processes(const std::string& mark,
                                                     milliseconds timeout) noexcept {
  try {
    // Every process whose environment holds the mark (this sweep's own shell does not), then how
    // many; exit 3 where /proc or grep -z is missing (its own environment must be found).
    const std::string script =
        "c=" + shell_quote(mark) +
        "; [ -r /proc/self/environ ] && printf 'x' | grep -qz x 2>/dev/null || exit 3; n=0; "
        "for f in $(grep -lzxF -e \"$c\" /proc/[0-9]*/environ 2>/dev/null); do p=${f#/proc/}; "
        "p=${p%/environ}; kill -KILL \"$p\" 2>/dev/null && n=$((n+1)); done; echo \"$n\"";
    // Each blocking step (the channel's opening, the command's start) within a third of
    // `timeout`, and the whole within `timeout`: a host that stopped answering holds the caller
    // no longer than that.
    set_step_timeout(session_->session, std::min(timeout / 3, session_->request_timeout));
    std::optional<int> killed;
    try {
      const Result r = run("sh -c " + shell_quote(script), "", timeout);
      // Its last line (a login's start-up files may print before it).
      std::string_view out = r.out;
      while (!out.empty() && std::isspace(static_cast<unsigned char>(out.back())))
        out.remove_suffix(1);
      if (const size_t newline = out.rfind('\n'); newline != std::string_view::npos)
        out.remove_prefix(newline + 1);
      int n = 0;
      const auto [end, ec] = std::from_chars(out.data(), out.data() + out.size(), n);
      if (r.exit_status == 0 && ec == std::errc() && end == out.data() + out.size()) killed = n;
    } catch (...) {
    }
    set_step_timeout(session_->session, session_->request_timeout);
    return killed;
  } catch (...) {
    return std::nullopt;
  }
}

namespace {

std::string random_suffix() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  return fmt::format("{:012x}", rng() & 0xffffffffffffull);
}

// The remote half of an upload: sh -c UPLOAD_SCRIPT sh TEMP BYTES MODE DEST, the file on stdin.
// A directory at DEST is refused, before and after the transfer (mv would move TEMP into it).
// It writes stdin to TEMP (a new file, only the user's), checks that every byte arrived, sets the
// mode and renames TEMP over DEST: rename(2) is atomic, so a reader sees the old file or the new
// one. On any failure TEMP is removed and stderr's first line says why; so too when the upload is
// cut off (the client stopped, the connection dropped): the signals that brings (a hangup, a
// write to the closed stderr) end the script through its EXIT trap rather than past it.
constexpr const char* kUploadScript = R"sh(t=$1 n=$2 m=$3 dest=$4
d=$(dirname -- "$dest")
[ -d "$d" ] || { echo "no such directory: $d" >&2; exit 1; }
[ -w "$d" ] || { echo "permission denied: cannot write in $d" >&2; exit 1; }
isdir() { [ -d "$dest" ] && { echo "$dest is a directory: move it away" >&2; exit 1; }; }
isdir
trap 'rm -f -- "$t"' EXIT
trap 'exit 1' HUP INT TERM PIPE
set -C
umask 077
cat >"$t" || { s=$?; echo "writing $t failed (cat exited with $s)" >&2; exit 1; }
got=$(wc -c <"$t") || exit 1
[ "$got" -eq "$n" ] || { echo "received $got of $n bytes" >&2; exit 1; }
isdir
chmod "$m" "$t" && mv -f -- "$t" "$dest" || exit 1
trap - EXIT)sh";

}  // namespace

void SshSession::upload(const fs::path& local, const std::string& remote_path, int mode,
                        const std::function<void(uint64_t sent)>& sent) {
  std::ifstream in(local, std::ios::binary);
  std::error_code ec;
  const uint64_t bytes = in ? fs::file_size(local, ec) : 0;
  if (!in || ec) {
    throw Error(ErrorKind::io, fmt::format("{}: cannot read: {}", printable(local.string()),
                                           ec ? ec.message() : std::strerror(errno)));
  }
  const auto failure = [&](const std::string& reason) {
    return Error(ErrorKind::ssh, fmt::format("cannot upload {} to {}:{}: {}", local.string(),
                                             host_.display(), remote_path, reason));
  };
  const std::string temp = remote_path + ".tmp-" + random_suffix();
  auto channel = start(shell_command({"sh", "-c", kUploadScript, "sh", temp, std::to_string(bytes),
                                      fmt::format("{:o}", mode & 07777), remote_path}));
  // Streamed, not SFTP: libssh's SFTP writes wait for each packet's reply (64 KiB a round trip),
  // a channel keeps the host's whole window (2 MiB for OpenSSH) in flight.
  std::string err;
  const auto collect = [&](std::string_view data, bool is_stderr) {
    if (is_stderr) err += data;
  };
  // The host's stderr on one line: cat's own complaint ("No space left on device"), the shell's
  // ("Killed"), then the script's account.
  const auto reason = [&](const std::optional<int>& status) {
    std::string line;
    for (const auto& message : error_messages(err)) {
      const std::string part = first_line(message);
      if (!part.empty()) line += (line.empty() ? "" : "; ") + part;
    }
    if (!line.empty()) return line.substr(0, 400);
    return status ? fmt::format("the remote shell exited with {}", *status)
                  : std::string("the remote shell ended without an exit status");
  };
  // After the remote side failed, its stderr and exit status say why; wait for them a while.
  const auto finish = [&](std::chrono::milliseconds limit) {
    const auto deadline = Clock::now() + limit;
    for (;;) {
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now());
      if (left.count() <= 0) return false;
      if (!channel->read(collect, left)) return true;
    }
  };
  std::vector<char> buffer(256 * 1024);
  uint64_t total = 0;
  try {
    while (total < bytes) {
      in.read(buffer.data(), static_cast<std::streamsize>(buffer.size()));
      const auto count = static_cast<size_t>(in.gcount());
      if (count == 0) break;
      channel->write(std::string_view(buffer.data(), count));
      total += count;
      if (sent) sent(total);
    }
    // A file that shrank while it was read: the remote shell counts the bytes and refuses it.
    if (total == bytes) channel->close_stdin();
  } catch (const Error& e) {
    if (e.kind() != ErrorKind::ssh || !session_->connected()) throw;
    // The write failed because the command ended: its own message is the one to give.
    if (finish(options_.connect_timeout)) throw failure(reason(channel->exit_status()));
    throw;
  }
  if (total != bytes) {
    channel->close();  // EOF-less: the remote shell is stopped and removes the partial file
    throw failure(
        fmt::format("reading {} failed after {} of {} bytes", local.string(), total, bytes));
  }
  if (!finish(options_.command_timeout)) {
    channel->close();
    throw failure(fmt::format("the host did not confirm the upload within {}",
                              seconds_text(options_.command_timeout)));
  }
  if (channel->exit_status() != 0) throw failure(reason(channel->exit_status()));
}

}  // namespace dptrain
