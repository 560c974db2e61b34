// SSH layer against a real loopback sshd: host keys, authentication, exec, streaming, uploads.
#include "launch/ssh.hpp"

#include <doctest/doctest.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "tests/scoped_env.hpp"
#include "tests/sshd.hpp"
#include "tests/temp_dir.hpp"

using namespace dptrain;
using dptrain::test::LoopbackSshd;
using dptrain::test::TempDir;
namespace fs = std::filesystem;
using namespace std::chrono_literals;

namespace {

// Each of these must come through a shell unchanged.
const std::vector<std::string> kNastyStrings = {
    "",
    "plain",
    "two words",
    "it's",
    "'",
    "''",
    "\"double\"",
    "$HOME",
    "$(touch /tmp/dptrain-quote-pwned)",
    "`id`",
    "a\\b\\",
    "line1\nline2",
    "tab\there",
    "semi;colon && ampersand | pipe > redirect < in",
    "*?[glob]",
    "~",
    "~root/x",
    "-n",
    "--flag=value",
    "#comment",
    "!bang",
    "{a,b}",
    "caf\xc3\xa9 \xe2\x9c\x93",
};

std::string slurp(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// What a local /bin/sh prints for `printf %s ARG` with the argument quoted by shell_quote.
std::string through_local_shell(const std::string& arg) {
  int pipe_fds[2];
  REQUIRE(::pipe(pipe_fds) == 0);
  const std::string script = "printf %s " + shell_quote(arg);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(pipe_fds[1], 1);
    ::close(pipe_fds[0]);
    ::execl("/bin/sh", "sh", "-c", script.c_str(), static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(pipe_fds[1]);
  std::string out;
  char buf[256];
  for (ssize_t n; (n = ::read(pipe_fds[0], buf, sizeof buf)) > 0;)
    out.append(buf, size_t(n));
  ::close(pipe_fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return out;
}

SshOptions fixture_options() {
  SshOptions options;
  options.known_hosts = LoopbackSshd::instance().known_hosts();
  options.connect_timeout = 5s;
  options.command_timeout = 20s;
  return options;
}

std::unique_ptr<SshSession> connect_to(const std::string& address,
                                       const SshOptions& options = fixture_options()) {
  return SshSession::connect(LoopbackSshd::instance().host(address), options);
}

std::string error_of(const std::function<void()>& action, ErrorKind expected = ErrorKind::ssh) {
  try {
    action();
  } catch (const Error& e) {
    CHECK(e.kind() == expected);
    return e.what();
  }
  FAIL("no error was thrown");
  return "";
}

// "SHA256:..." of a .pub file, as ssh-keygen -l prints it.
std::string fingerprint_of(const fs::path& pub) {
  const std::string command = "ssh-keygen -lf " + shell_quote(pub.string());
  std::FILE* p = ::popen(command.c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[512] = {};
  const size_t n = std::fread(buf, 1, sizeof buf - 1, p);
  ::pclose(p);
  std::istringstream fields(std::string(buf, n));
  std::string bits, fingerprint;
  fields >> bits >> fingerprint;
  return fingerprint;
}

}  // namespace

TEST_CASE("shell_quote: every nasty string comes through a local shell unchanged") {
  for (const auto& s : kNastyStrings) {
    CAPTURE(s);
    CHECK(through_local_shell(s) == s);
  }
  CHECK(shell_quote("plain/path-1.2_x") == "plain/path-1.2_x");
  CHECK(shell_quote("") == "''");
  CHECK(shell_quote("it's") == "'it'\\''s'");
  CHECK(shell_command({"echo", "a b", "c"}) == "echo 'a b' c");
  CHECK_FALSE(fs::exists("/tmp/dptrain-quote-pwned"));
}

TEST_CASE("run: exit status, stdout and stderr apart, stdin data") {
  auto session = connect_to("127.0.0.2");
  CHECK(session->host().host == "127.0.0.2");

  const auto r = session->run("echo out; echo err >&2; exit 3");
  CHECK(r.exit_status == 3);
  CHECK(r.out == "out\n");
  CHECK(r.err == "err\n");

  std::string big(300000, 'x');  // more than one SSH window and packet
  for (size_t i = 0; i < big.size(); i += 1000)
    big[i] = '\n';
  const auto echoed = session->run("cat", big);
  CHECK(echoed.exit_status == 0);
  CHECK(echoed.out == big);

  CHECK(session->run("kill -TERM $$").exit_status == 128 + 15);
  CHECK(session->run("true").exit_status == 0);  // the session is still usable
}

TEST_CASE("run: quoted nasty arguments arrive unchanged on the remote shell") {
  auto session = connect_to("127.0.0.3");
  std::vector<std::string> argv = {"printf", "%s\\0"};  // each argument, then a NUL
  argv.insert(argv.end(), kNastyStrings.begin(), kNastyStrings.end());
  const auto r = session->run(shell_command(argv));
  CHECK(r.exit_status == 0);
  std::string expected;
  for (const auto& s : kNastyStrings)
    expected += s + std::string(1, '\0');
  CHECK(r.out == expected);
  CHECK_FALSE(fs::exists("/tmp/dptrain-quote-pwned"));
}

TEST_CASE("run: a command past command_timeout is an error naming the host") {
  SshOptions options = fixture_options();
  options.command_timeout = 300ms;
  auto session = connect_to("127.0.0.2", options);
  const std::string message = error_of([&] { session->run("sleep 5"); });
  CHECK(message.find("did not finish within 0.3s") != std::string::npos);
  CHECK(message.find(session->host().display()) != std::string::npos);
}

TEST_CASE("start: output streams while the command runs; close_stdin ends it") {
  auto session = connect_to("127.0.0.2");
  auto channel = session->start("echo started; cat; echo 'eof seen' >&2; exit 7");
  std::string out, err;
  const auto sink = [&](std::string_view data, bool is_stderr) { (is_stderr ? err : out) += data; };
  // The command cannot end before stdin does, so anything read now was streamed.
  while (out.find("started\n") == std::string::npos)
    REQUIRE(channel->read(sink, 5s));
  channel->write("hello\n");
  while (out.find("hello\n") == std::string::npos)
    REQUIRE(channel->read(sink, 5s));
  CHECK(err.empty());
  CHECK_FALSE(channel->exit_status().has_value());

  channel->close_stdin();
  while (channel->read(sink, 5s)) {
  }
  CHECK(out == "started\nhello\n");
  CHECK(err == "eof seen\n");
  CHECK(channel->exit_status() == 7);
  channel->close();
  channel->close();  // idempotent
}

TEST_CASE("start: read returns after its timeout while the command is quiet; keepalives") {
  SshOptions options = fixture_options();
  options.keepalive_interval_s = 1;
  auto session = connect_to("127.0.0.3", options);
  auto channel = session->start("sleep 1.5; echo late");
  std::string out;
  const auto sink = [&](std::string_view data, bool) { out += data; };
  CHECK(channel->read(sink, 100ms));  // nothing yet, still running
  CHECK(out.empty());
  while (channel->read(sink, 5s)) {
  }
  CHECK(out == "late\n");
  CHECK(channel->exit_status() == 0);
}

TEST_CASE("start: a connection that drops mid-command is an error, not a hang") {
  auto session = connect_to("127.0.0.2");
  // The remote shell's parent is the sshd process serving this connection.
  auto channel = session->start("echo ready; sleep 0.2; kill -9 $PPID; sleep 30");
  const auto ignore = [](std::string_view, bool) {};
  const std::string message = error_of([&] {
    for (int i = 0; i < 100 && channel->read(ignore, 10s); ++i) {
    }
  });
  CHECK(message.find("lost the SSH connection") != std::string::npos);
  CHECK(message.find("127.0.0.2") != std::string::npos);
}

TEST_CASE("upload: content, permissions, atomic replacement, no temporary left behind") {
  TempDir dir;
  const fs::path local = dir / "payload.bin";
  std::string content(200000, '\0');
  for (size_t i = 0; i < content.size(); ++i)
    content[i] = static_cast<char>(i * 31 % 251);
  { std::ofstream(local, std::ios::binary) << content; }
  const fs::path remote = dir / "remote" / "payload";
  fs::create_directories(remote.parent_path());

  auto session = connect_to("127.0.0.2");
  session->upload(local, remote.string(), 0750);
  CHECK(slurp(remote) == content);
  CHECK((fs::status(remote).permissions() & fs::perms::all) ==
        (fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec));

  // A reader holding the old file keeps seeing it whole: the new one is renamed over it.
  std::ifstream old_reader(remote, std::ios::binary);
  { std::ofstream(local, std::ios::binary | std::ios::trunc) << "second version"; }
  session->upload(local, remote.string(), 0600);
  CHECK(slurp(remote) == "second version");
  CHECK((fs::status(remote).permissions() & fs::perms::all) ==
        (fs::perms::owner_read | fs::perms::owner_write));
  std::ostringstream old_content;
  old_content << old_reader.rdbuf();
  CHECK(old_content.str() == content);

  int entries = 0;
  for ([[maybe_unused]] const auto& e : fs::directory_iterator(remote.parent_path()))
    ++entries;
  CHECK(entries == 1);

  const std::string message =
      error_of([&] { session->upload(local, (dir / "missing" / "x").string(), 0644); });
  CHECK(message.find("no such directory: " + (dir / "missing").string()) != std::string::npos);
  CHECK(message.find(session->host().display()) != std::string::npos);
  // A directory in the file's place is refused, not moved into (and left there, a temporary).
  fs::create_directories(dir / "taken");
  CHECK(error_of([&] {
          session->upload(local, (dir / "taken").string(), 0644);
        }).find((dir / "taken").string() + " is a directory: move it away") != std::string::npos);
  CHECK(fs::is_empty(dir / "taken"));
  CHECK(error_of([&] { session->upload(dir / "nope", remote.string(), 0644); }, ErrorKind::io)
            .find("nope") != std::string::npos);
}

// Kills (SIGKILL) each `cat` on this machine that has a file whose name holds ".tmp-" in `dir`
// open: the host's side of an upload (its shell has the file open too). Returns whether there was
// one.
bool kill_upload_writer(const fs::path& dir) {
  bool killed = false;
  std::error_code ec;
  for (const auto& proc : fs::directory_iterator("/proc", ec)) {
    const std::string pid = proc.path().filename();
    if (pid.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream comm(proc.path() / "comm");
    std::string name;
    if (!std::getline(comm, name) || name != "cat") continue;
    for (const auto& fd : fs::directory_iterator(proc.path() / "fd", ec)) {
      const fs::path target = fs::read_symlink(fd.path(), ec);
      if (!ec && target.parent_path() == dir &&
          target.filename().string().find(".tmp-") != std::string::npos) {
        killed |= ::kill(std::stoi(pid), SIGKILL) == 0;
      }
    }
  }
  return killed;
}

TEST_CASE("upload: a write that fails on the host gives its reason and leaves nothing behind") {
  TempDir dir;
  const fs::path local = dir / "big.bin";
  {
    std::ofstream out(local, std::ios::binary);
    const std::string block(1 << 20, 'x');
    for (int i = 0; i < 64; ++i)
      out << block;
  }
  const fs::path remote_dir = dir / "remote";
  fs::create_directories(remote_dir);
  auto session = connect_to("127.0.0.2");
  bool killed = false;
  const std::string message = error_of([&] {
    session->upload(local, (remote_dir / "big").string(), 0644, [&](uint64_t sent) {
      // Past the host's window, so its cat has the file open; it dies as a full disk would fail.
      if (!killed && sent >= (8u << 20)) killed = kill_upload_writer(remote_dir);
    });
  });
  REQUIRE(killed);
  INFO(message);
  CHECK(message.find("cannot upload " + local.string()) != std::string::npos);
  CHECK(message.find(session->host().display()) != std::string::npos);
  CHECK(message.find("(cat exited with 137)") != std::string::npos);
  CHECK(fs::is_empty(remote_dir));

  // The session still works: the next upload goes through.
  { std::ofstream(local, std::ios::binary | std::ios::trunc) << "small"; }
  session->upload(local, (remote_dir / "big").string(), 0644);
  CHECK(slurp(remote_dir / "big") == "small");
}

TEST_CASE("connect: a key the host does not accept is refused, naming host and keys tried") {
  HostSpec host = LoopbackSshd::instance().host("127.0.0.3");
  host.key = LoopbackSshd::instance().wrong_key().string();
  const std::string message = error_of([&] { SshSession::connect(host, fixture_options()); });
  CHECK(message.find("authentication refused for " + host.display()) != std::string::npos);
  CHECK(message.find(host.key) != std::string::npos);

  // --identity after a refused key= still gets its turn.
  SshOptions options = fixture_options();
  options.identities = {LoopbackSshd::instance().client_key()};
  CHECK(SshSession::connect(host, options)->run("true").exit_status == 0);

  host.key = "/nonexistent/key";
  CHECK(error_of([&] {
          SshSession::connect(host, fixture_options());
        }).find("/nonexistent/key (missing)") != std::string::npos);
}

TEST_CASE("connect: a named key goes before an agent full of other keys") {
  // sshd drops a client after MaxAuthTries (6) refused keys: with the agent's 7 keys offered
  // first, the host's own key= would never get its turn.
  TempDir tmp;
  const fs::path socket = tmp.path() / "agent.sock";
  REQUIRE(std::system(("ssh-agent -a " + shell_quote(socket.string()) + " > " +
                       shell_quote((tmp.path() / "agent.env").string()))
                          .c_str()) == 0);
  const std::string agent_env = slurp(tmp.path() / "agent.env");
  const auto pid_at = agent_env.find("SSH_AGENT_PID=");
  REQUIRE(pid_at != std::string::npos);
  const pid_t agent_pid = std::stoi(agent_env.substr(pid_at + 14));
  struct KillAgent {
    pid_t pid;
    ~KillAgent() { ::kill(pid, SIGTERM); }
  } kill_agent{agent_pid};
  ScopedEnv sock("SSH_AUTH_SOCK", socket.string());
  for (int i = 0; i < 7; ++i) {
    const std::string key = shell_quote((tmp.path() / ("other" + std::to_string(i))).string());
    REQUIRE(std::system(("ssh-keygen -q -t ed25519 -N '' -f " + key + " && ssh-add -q " + key +
                         " 2>/dev/null")
                            .c_str()) == 0);
  }
  HostSpec host = LoopbackSshd::instance().host("127.0.0.2");
  REQUIRE(!host.key.empty());
  CHECK(SshSession::connect(host, fixture_options())->run("true").exit_status == 0);
  host.key.clear();
  SshOptions options = fixture_options();
  options.identities = {LoopbackSshd::instance().client_key()};
  CHECK(SshSession::connect(host, options)->run("true").exit_status == 0);
}

TEST_CASE("connect: a changed host key is refused naming both fingerprints and the line") {
  const auto& sshd = LoopbackSshd::instance();
  TempDir dir;
  SshOptions options = fixture_options();
  options.known_hosts = dir / "known_hosts";
  sshd.write_known_hosts_with_changed_key("127.0.0.2", options.known_hosts);
  options.accept_new_host_keys = true;  // never applies to a changed key
  const std::string message = error_of([&] { connect_to("127.0.0.2", options); });
  CAPTURE(message);
  CHECK(message.rfind("HOST KEY OF " + sshd.host("127.0.0.2").display() + " CHANGED", 0) == 0);
  const std::string known = fingerprint_of(sshd.changed_host_public_key());
  const std::string offered = fingerprint_of(sshd.host_public_key());
  CHECK(known != offered);
  CHECK(message.find("known_hosts has " + known) != std::string::npos);
  CHECK(message.find("the host offers " + offered) != std::string::npos);
  CHECK(message.find(options.known_hosts.string() + " line 2") != std::string::npos);
  // The other hosts in that file are still fine.
  CHECK(connect_to("127.0.0.3", options)->run("true").exit_status == 0);
}

TEST_CASE("connect: a key an @revoked line names is refused, even with accept_new_host_keys") {
  const auto& sshd = LoopbackSshd::instance();
  TempDir dir;
  SshOptions options = fixture_options();
  options.known_hosts = dir / "known_hosts";
  // The host's key revoked for every host, before the lines that trust it (OpenSSH refuses it).
  const std::string revoked = "@revoked * " + slurp(sshd.host_public_key());
  std::ofstream(options.known_hosts) << revoked << slurp(sshd.known_hosts());
  const std::string offered = fingerprint_of(sshd.host_public_key());
  const std::string message = error_of([&] { connect_to("127.0.0.2", options); });
  CAPTURE(message);
  CHECK(message == "HOST KEY OF " + sshd.host("127.0.0.2").display() +
                       " IS REVOKED: " + options.known_hosts.string() +
                       " line 1 revokes the key the host offers (" + offered +
                       "); refusing (possible man-in-the-middle, or a host still using a retired "
                       "key)");
  // Never recorded as trusted either.
  options.known_hosts = dir / "only-revoked";
  std::ofstream(options.known_hosts) << revoked;
  options.accept_new_host_keys = true;
  CHECK(error_of([&] { connect_to("127.0.0.3", options); }).find("IS REVOKED") !=
        std::string::npos);
  CHECK(slurp(options.known_hosts) == revoked);
}

TEST_CASE("connect: an unknown host is refused unless accept_new_host_keys, which records it") {
  TempDir dir;
  SshOptions options = fixture_options();
  options.known_hosts = dir / "ssh" / "known_hosts";  // neither file nor folder exists yet
  const std::string message = error_of([&] { connect_to("127.0.0.3", options); });
  CHECK(message.find("is not in known_hosts " + options.known_hosts.string()) != std::string::npos);
  CHECK(message.find("--accept-new-host-keys") != std::string::npos);

  options.accept_new_host_keys = true;
  CHECK(connect_to("127.0.0.3", options)->run("true").exit_status == 0);
  const std::string recorded = slurp(options.known_hosts);
  CHECK(recorded.find("[127.0.0.3]:" + std::to_string(LoopbackSshd::instance().port())) !=
        std::string::npos);

  options.accept_new_host_keys = false;  // now known
  CHECK(connect_to("127.0.0.3", options)->run("true").exit_status == 0);
}

TEST_CASE("connect: a closed port and a silent port are reported within the connect timeout") {
  SshOptions options = fixture_options();
  options.connect_timeout = 500ms;
  HostSpec host = LoopbackSshd::instance().host("127.0.0.1");
  host.port = test::unused_port();
  std::string message = error_of([&] { SshSession::connect(host, options); });
  // A refusal comes at once: no "within" the timeout.
  CHECK(message.find("cannot connect to " + host.display() + ": ") != std::string::npos);
  CHECK(message.find("refused") != std::string::npos);
  // Port 22, which a host's name leaves out, is named: a closed port is as likely the cause.
  HostSpec port22 = host;
  port22.host = "127.0.0.9";
  port22.port = 22;
  const int probe = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in ssh_port{};
  ssh_port.sin_family = AF_INET;
  ssh_port.sin_port = htons(22);
  ssh_port.sin_addr.s_addr = htonl(0x7f000009);
  const bool listening =
      ::connect(probe, reinterpret_cast<const sockaddr*>(&ssh_port), sizeof ssh_port) == 0;
  ::close(probe);
  if (!listening) {
    const std::string refused = error_of([&] { SshSession::connect(port22, options); });
    CHECK(refused.find("cannot connect to " + port22.display() + " (port 22): ") !=
          std::string::npos);
  }

  // Accepts TCP (the kernel completes the handshake) but never speaks SSH.
  const int listener = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof addr;
  REQUIRE(::bind(listener, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0);
  REQUIRE(::listen(listener, 4) == 0);
  REQUIRE(::getsockname(listener, reinterpret_cast<sockaddr*>(&addr), &length) == 0);
  host.port = ntohs(addr.sin_port);
  const auto start = std::chrono::steady_clock::now();
  message = error_of([&] { SshSession::connect(host, options); });
  // libssh says "Timeout connecting" either way; the port taking connections says which.
  CHECK(message.find("cannot connect to " + host.display() + ": its port " +
                     std::to_string(host.port) +
                     " takes TCP connections, but no SSH server answered there within 0.5s") !=
        std::string::npos);
  CHECK(std::chrono::steady_clock::now() - start < 10s);  // not the default 10 s, not forever
  // A timeout under a tenth of a second is given as it is, not as 0.0s.
  options.connect_timeout = 40ms;
  message = error_of([&] { SshSession::connect(host, options); });
  ::close(listener);
  CHECK(message.find(" within 0.04s") != std::string::npos);
}

TEST_CASE("for_each_host: every host at once, each with its own result or error") {
  const auto& sshd = LoopbackSshd::instance();
  std::vector<HostSpec> hosts = {sshd.host("127.0.0.1"), sshd.host("127.0.0.2"),
                                 sshd.host("127.0.0.3")};
  hosts[1].port = test::unused_port();
  const SshOptions options = fixture_options();
  const auto outcomes = for_each_host(hosts, [&](const HostSpec& host) {
    return SshSession::connect(host, options)->run("echo $SSH_CONNECTION").out;
  });
  REQUIRE(outcomes.size() == 3);
  CHECK(outcomes[0].ok());
  CHECK(outcomes[0].value->find(" 127.0.0.1 ") != std::string::npos);
  CHECK_FALSE(outcomes[1].ok());
  CHECK(outcomes[1].host.port == hosts[1].port);
  CHECK(std::string(outcomes[1].error->what()).find(hosts[1].display()) != std::string::npos);
  CHECK(outcomes[2].ok());
  CHECK(outcomes[2].value->find(" 127.0.0.3 ") != std::string::npos);

  const auto thrown = for_each_host(hosts, [](const HostSpec& host) -> int {
    if (host.host == "127.0.0.3") throw std::runtime_error("boom");
    return 1;
  });
  CHECK(thrown[0].value == 1);
  CHECK(thrown[2].error->kind() == ErrorKind::internal);
  CHECK(std::string(thrown[2].error->what()).find("boom") != std::string::npos);
}
