// A real sshd on loopback for SSH tests: one per test process, started on first use, stopped at
// exit (and killed with the process if that dies first). 127.0.0.1, .2 and .3 are three "hosts",
// each with its own $HOME.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "launch/hostfile.hpp"

namespace dptrain::test {

class LoopbackSshd {
 public:
  // Starts it on first use: installs openssh-server with apt-get when /usr/sbin/sshd is missing,
  // writes config, host key and client keys into a temp dir, and waits until every address
  // accepts connections. Throws std::runtime_error with sshd's log when it cannot. The first call
  // must come from a thread that lives as long as the tests (sshd gets a parent-death signal).
  static LoopbackSshd& instance();

  uint16_t port() const { return port_; }
  const std::vector<std::string>& addresses() const { return addresses_; }   // 127.0.0.1, .2, .3
  const std::filesystem::path& client_key() const { return client_key_; }    // authorized
  const std::filesystem::path& wrong_key() const { return wrong_key_; }      // not authorized
  const std::filesystem::path& known_hosts() const { return known_hosts_; }  // all three hosts
  const std::filesystem::path& host_public_key() const { return host_public_key_; }
  // The public key write_known_hosts_with_changed_key puts in place of the real one.
  std::filesystem::path changed_host_public_key() const {
    return other_host_key_.string() + ".pub";
  }
  const std::string& user() const { return user_; }  // the user the tests run as

  // A known_hosts at `path` listing every address with the real host key, except `address`,
  // which gets a different ed25519 key: connecting to it must look like a changed host key.
  void write_known_hosts_with_changed_key(const std::string& address,
                                          const std::filesystem::path& path) const;
  // $HOME and starting directory of SSH sessions to `address`.
  std::filesystem::path home(const std::string& address) const;
  // The host at `address` with this sshd's port, the test user and the authorized key.
  HostSpec host(const std::string& address) const;
  // While refused, every login to `address` fails (its authorized keys are gone): to the
  // launcher the host is lost. Sessions already open stay open.
  void set_logins_refused(const std::string& address, bool refused) const;
  // A hostfile with one line per address: "ADDRESS port=P user=U key=CLIENT_KEY slots=N".
  void write_hostfile(const std::filesystem::path& path, const std::vector<std::string>& addresses,
                      int slots = 1) const;

  LoopbackSshd(const LoopbackSshd&) = delete;
  LoopbackSshd& operator=(const LoopbackSshd&) = delete;

 private:
  LoopbackSshd();
  ~LoopbackSshd();
  void start();
  void stop();
  static void stop_at_exit();
  std::filesystem::path authorized_keys(const std::string& address) const;

  std::filesystem::path dir_;
  std::filesystem::path client_key_, wrong_key_, host_key_, other_host_key_, known_hosts_;
  std::filesystem::path host_public_key_;
  std::filesystem::path log_;
  std::vector<std::string> addresses_;
  std::string user_;
  uint16_t port_ = 0;
  pid_t pid_ = -1;
};

// A TCP port on 127.0.0.1 that nothing listens on right now.
uint16_t unused_port();

}  // namespace dptrain::test
