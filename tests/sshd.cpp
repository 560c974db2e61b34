// The loopback sshd test fixture: config, keys and known_hosts in a temp dir, sshd as a child.
#include "tests/sshd.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <pwd.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <system_error>
#include <thread>

#include "tests/temp_dir.hpp"

namespace dptrain::test {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

constexpr const char* kSshd = "/usr/sbin/sshd";

std::string read_all(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

void write_all(const fs::path& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << text;
  if (!out) throw std::runtime_error("sshd fixture: cannot write " + path.string());
}

// Runs argv with output into `log` (appended); returns the exit code (-1 when it did not exit).
int run_logged(const std::vector<std::string>& argv, const fs::path& log) {
  std::vector<char*> args;  // built before fork: the child of a threaded process must not allocate
  for (const auto& a : argv)
    args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid < 0) throw std::runtime_error("sshd fixture: fork failed");
  if (pid == 0) {
    const int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
    const int in = ::open("/dev/null", O_RDONLY);
    if (out >= 0) {
      ::dup2(out, 1);
      ::dup2(out, 2);
    }
    if (in >= 0) ::dup2(in, 0);
    ::execvp(args[0], args.data());
    ::_exit(127);
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

void install_sshd_if_missing(const fs::path& log) {
  if (fs::exists(kSshd)) return;
  // Quietly; an update first only if the package lists are too old to know it.
  run_logged({"sh", "-c",
              "export DEBIAN_FRONTEND=noninteractive; "
              "apt-get install -y -qq --no-install-recommends openssh-server || "
              "{ apt-get update -qq && apt-get install -y -qq --no-install-recommends "
              "openssh-server; }"},
             log);
  if (!fs::exists(kSshd)) {
    throw std::runtime_error("sshd fixture: " + std::string(kSshd) +
                             " is missing and apt-get could not install openssh-server:\n" +
                             read_all(log));
  }
}

void generate_key(const fs::path& path, const fs::path& log) {
  if (run_logged({"ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dptrain-test", "-f",
                  path.string()},
                 log) != 0) {
    throw std::runtime_error("sshd fixture: ssh-keygen failed for " + path.string() + ":\n" +
                             read_all(log));
  }
}

// "ssh-ed25519 AAAA..." from a .pub file (type and key, without the comment).
std::string public_key(const fs::path& private_key) {
  std::istringstream pub(read_all(private_key.string() + ".pub"));
  std::string type, key;
  pub >> type >> key;
  return type + " " + key;
}

bool accepts_connections(const std::string& address, uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  ::inet_pton(AF_INET, address.c_str(), &addr.sin_addr);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  ::close(fd);
  return ok;
}

std::string current_user() {
  const passwd* pw = ::getpwuid(::getuid());
  if (!pw) throw std::runtime_error("sshd fixture: the current user has no passwd entry");
  return pw->pw_name;
}

}  // namespace

uint16_t unused_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof addr;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &length) != 0) {
    if (fd >= 0) ::close(fd);
    throw std::runtime_error("sshd fixture: cannot find a free port");
  }
  ::close(fd);
  return ntohs(addr.sin_port);
}

LoopbackSshd& LoopbackSshd::instance() {
  // Never destroyed by static destruction: stop_at_exit stops sshd and removes the temp dir.
  static LoopbackSshd* sshd = [] {
    auto* created = new LoopbackSshd();
    std::atexit(&LoopbackSshd::stop_at_exit);
    return created;
  }();
  return *sshd;
}

void LoopbackSshd::stop_at_exit() {
  instance().stop();
}

LoopbackSshd::LoopbackSshd()
    : dir_(TempDir::unique_path("dptrain-sshd")),
      addresses_{"127.0.0.1", "127.0.0.2", "127.0.0.3"},
      user_(current_user()) {
  try {
    start();
  } catch (...) {
    stop();
    throw;
  }
}

LoopbackSshd::~LoopbackSshd() {
  stop();
}

void LoopbackSshd::start() {
  fs::create_directories(dir_);
  log_ = dir_ / "sshd.log";
  install_sshd_if_missing(log_);
  std::error_code ec;
  fs::create_directories("/run/sshd", ec);  // sshd's privilege separation directory
  client_key_ = dir_ / "client_ed25519";
  wrong_key_ = dir_ / "wrong_ed25519";
  other_host_key_ = dir_ / "other_host_ed25519";
  host_key_ = dir_ / "host_ed25519";
  const fs::path& host_key = host_key_;
  for (const auto& key : {client_key_, wrong_key_, other_host_key_, host_key_}) {
    generate_key(key, log_);
  }
  host_public_key_ = host_key.string() + ".pub";
  for (const auto& address : addresses_)
    write_all(authorized_keys(address), public_key(client_key_) + "\n");

  const fs::path config = dir_ / "sshd_config";
  for (int attempt = 0; attempt < 5; ++attempt) {
    port_ = unused_port();
    std::ostringstream text;
    for (const auto& address : addresses_)
      text << "ListenAddress " << address << ":" << port_ << "\n";
    text << "HostKey " << host_key.string() << "\n"
         << "PidFile " << (dir_ / "sshd.pid").string() << "\n"
         << "PermitRootLogin prohibit-password\n"
         << "StrictModes no\n"
         << "UsePAM no\n"
         << "PasswordAuthentication no\n"
         << "KbdInteractiveAuthentication no\n"
         << "PubkeyAuthentication yes\n"
         // No SFTP subsystem: nothing in dptrain may need one.
         // Tests open many connections at once; the default drops some beyond 10 unauthenticated.
         << "MaxStartups 500\n"
         << "MaxSessions 100\n"
         << "X11Forwarding no\n"
         << "PrintMotd no\n"
         << "LogLevel INFO\n";
    // Each address has its own home, so "~" differs between the "hosts" as between machines.
    std::ostringstream homes;
    for (const auto& address : addresses_) {
      fs::create_directories(home(address));
      homes << "Match LocalAddress " << address << "\n  SetEnv HOME=" << home(address).string()
            << "\n  AuthorizedKeysFile " << authorized_keys(address).string() << "\n";
    }
    // Newer OpenSSH (9.8+) blocks a source address after failed logins; tests fail logins on
    // purpose. Older versions do not know the option and refuse the config with it.
    write_all(config, text.str() + "PerSourcePenalties no\n" + homes.str());
    if (run_logged({kSshd, "-t", "-f", config.string()}, log_) != 0) {
      write_all(config, text.str() + homes.str());
    }

    const pid_t parent = ::getpid();
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("sshd fixture: fork failed");
    if (pid_ == 0) {
      ::prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (::getppid() != parent) ::_exit(1);  // the test process is already gone
      const int out = ::open(log_.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
      const int in = ::open("/dev/null", O_RDONLY);
      ::dup2(out, 1);
      ::dup2(out, 2);
      ::dup2(in, 0);
      ::execl(kSshd, kSshd, "-D", "-e", "-f", config.c_str(), static_cast<char*>(nullptr));
      ::_exit(127);
    }
    const auto deadline = Clock::now() + std::chrono::seconds(15);
    bool exited = false;
    while (Clock::now() < deadline) {
      int status = 0;
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        exited = true;
        pid_ = -1;
        break;
      }
      bool all = true;
      for (const auto& address : addresses_)
        all = all && accepts_connections(address, port_);
      if (all) {
        known_hosts_ = dir_ / "known_hosts";
        std::string lines;
        for (const auto& address : addresses_) {
          lines += "[" + address + "]:" + std::to_string(port_) + " " + public_key(host_key) + "\n";
        }
        write_all(known_hosts_, lines);
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    const std::string log = read_all(log_);
    if (!exited) {
      stop();
      throw std::runtime_error("sshd fixture: sshd did not accept connections within 15 s:\n" +
                               log);
    }
    if (log.find("Address already in use") == std::string::npos) {
      throw std::runtime_error("sshd fixture: sshd exited at start:\n" + log);
    }
    // Another process took the port between our check and sshd's bind: try another one.
  }
  throw std::runtime_error("sshd fixture: no free port for sshd after 5 attempts");
}

fs::path LoopbackSshd::authorized_keys(const std::string& address) const {
  return dir_ / ("authorized_keys-" + address);
}

void LoopbackSshd::set_logins_refused(const std::string& address, bool refused) const {
  if (refused) {
    fs::remove(authorized_keys(address));
  } else {
    write_all(authorized_keys(address), public_key(client_key_) + "\n");
  }
}

void LoopbackSshd::stop() {
  if (pid_ > 0) {
    ::kill(pid_, SIGTERM);
    const auto deadline = Clock::now() + std::chrono::seconds(3);
    int status = 0;
    while (::waitpid(pid_, &status, WNOHANG) == 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    if (::waitpid(pid_, &status, WNOHANG) == 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, &status, 0);
    }
    pid_ = -1;
  }
  std::error_code ec;
  if (!dir_.empty()) fs::remove_all(dir_, ec);
}

void LoopbackSshd::write_known_hosts_with_changed_key(const std::string& address,
                                                      const fs::path& path) const {
  std::string lines;
  for (const auto& a : addresses_) {
    const fs::path& key = a == address ? other_host_key_ : host_key_;
    lines += "[" + a + "]:" + std::to_string(port_) + " " + public_key(key) + "\n";
  }
  write_all(path, lines);
}

fs::path LoopbackSshd::home(const std::string& address) const {
  return dir_ / ("home-" + address);
}

HostSpec LoopbackSshd::host(const std::string& address) const {
  HostSpec spec;
  spec.host = address;
  spec.user = user_;
  spec.port = port_;
  spec.key = client_key_.string();
  spec.origin = "sshd fixture";
  return spec;
}

void LoopbackSshd::write_hostfile(const fs::path& path, const std::vector<std::string>& addresses,
                                  int slots) const {
  std::string lines;
  for (const auto& address : addresses) {
    lines += address + " slots=" + std::to_string(slots) + " user=" + user_ +
             " port=" + std::to_string(port_) + " key=" + client_key_.string() + "\n";
  }
  write_all(path, lines);
}

}  // namespace dptrain::test
