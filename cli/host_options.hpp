// Options every subcommand that reaches hosts over SSH shares: --hosts, keys, host keys, timeout.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "launch/hostfile.hpp"
#include "launch/ssh.hpp"

namespace dptrain::cli {

struct HostOptions {
  std::string hosts;                    // a hostfile or "a:2,b:2"
  std::vector<std::string> identities;  // --identity, repeatable
  std::string known_hosts;
  bool accept_new_host_keys = false;
  double connect_timeout_s = 10;

  SshOptions ssh() const;
  std::vector<HostSpec> load() const;  // Error(usage) when --hosts is missing or malformed
};

// `hosts_required`: --hosts must be given (provision, doctor); otherwise it is optional (launch).
void add_host_options(CLI::App& app, HostOptions& o, bool hosts_required);

}  // namespace dptrain::cli
