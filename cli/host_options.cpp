// Options every subcommand that reaches hosts over SSH shares.
#include "cli/host_options.hpp"
#include "cli/run_report.hpp"

#include <filesystem>

#include <fmt/format.h>

#include "core/comm/socket.hpp"
#include "core/comm/store.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "launch/elastic.hpp"

namespace dptrain::cli {

namespace {

// A path that cannot be the file it names: why, else "".
std::string not_a_file(const std::filesystem::path& path) {
  std::error_code ec;
  return std::filesystem::is_directory(path, ec)       ? "is a directory"
         : !std::filesystem::exists(path, ec)          ? "no such file"
         : !std::filesystem::is_regular_file(path, ec) ? "not a regular file"
                                                       : "";
}

}  // namespace

SshOptions HostOptions::ssh() const {
  SshOptions s;
  // "~/..." expanded, absolute and without "dir/../" (taken lexically, as a hostfile's key= is:
  // "link/../x" is the x beside the link, not beside its target), its links kept: what --dry-run
  // shows and run.json records works from any directory, and every reader of known_hosts (the
  // revoked-key check too) reads the same file.
  const auto absolute = [](const std::string& path) {
    return path.empty() ? path
                        : std::filesystem::absolute(expand_home(path)).lexically_normal().string();
  };
  for (const auto& id : identities)
    s.identities.emplace_back(absolute(id));
  s.known_hosts = absolute(known_hosts);
  s.accept_new_host_keys = accept_new_host_keys;
  s.connect_timeout = std::chrono::milliseconds(static_cast<int64_t>(connect_timeout_s * 1000));
  s.keepalive_interval_s = keepalive_s;
  return s;
}

std::vector<HostSpec> HostOptions::load() const {
  if (!given()) throw Error(ErrorKind::usage, "--hosts: required");
  std::vector<HostSpec> specs = hosts.empty() ? recorded : load_hosts(hosts);
  check_files();
  for (const auto& h : specs) {
    // A key under ~ is the connecting user's home's, expanded as it is read.
    if (h.key.empty() || h.key.starts_with("~")) continue;
    if (const std::string why = not_a_file(h.key); !why.empty()) {
      throw Error(ErrorKind::usage, fmt::format("{}: key={}: {}", h.origin, h.key, why));
    }
  }
  return specs;
}

void HostOptions::check_files() const {
  // Before any host is tried: a typo in a path is exit 2 here, not a key quietly left out
  // (--identity) or an authentication refused on every host.
  for (const auto& id : identities) {
    // "~/..." as the connection expands it.
    if (const std::string why = not_a_file(expand_home(id)); !why.empty()) {
      throw Error(ErrorKind::usage, fmt::format("--identity {}: {}", id, why));
    }
  }
  std::error_code ec;
  if (!known_hosts.empty() && std::filesystem::is_directory(expand_home(known_hosts), ec)) {
    throw Error(ErrorKind::usage,
                fmt::format("--known-hosts {}: is a directory; give the known_hosts file (it "
                            "need not exist yet with --accept-new-host-keys)",
                            known_hosts));
  }
}

std::vector<HostSpec> HostOptions::load_for_job(bool nproc_given) const {
  if (nproc_given) {
    throw Error(ErrorKind::usage,
                "--nproc: not with --hosts (each host's slots give its number of ranks)");
  }
  return load();
}

void place_ranks(JobSpec& spec, const HostOptions& hosts, const std::string& nproc,
                 const std::string& nnodes, int default_nproc) {
  if (hosts.given()) {
    spec.hosts = hosts.load_for_job(!nproc.empty());
    if (!nnodes.empty()) {
      spec.nodes = parse_size_range(nnodes, "--nnodes");
      if (spec.nodes.max > static_cast<int>(spec.hosts.size())) {
        throw Error(ErrorKind::usage,
                    fmt::format("--nnodes {}: only {} host(s) {}", nnodes, spec.hosts.size(),
                                hosts.hosts.empty() ? "recorded in " + hosts.recorded.front().origin
                                                    : std::string("given")));
      }
      // Hosts past the first MAX are spares: they stand in for lost ones.
      spec.candidates = spec.hosts;
      spec.all_hosts = spec.hosts;
      spec.hosts.resize(static_cast<size_t>(spec.nodes.max));
    }
    spec.world_size = total_slots(spec.hosts);
    return;
  }
  if (!nnodes.empty()) {
    throw Error(ErrorKind::usage, "--nnodes: only with --hosts (use --nproc MIN:MAX locally)");
  }
  hosts.check_files();
  spec.nodes = parse_size_range(nproc.empty() ? std::to_string(default_nproc) : nproc, "--nproc");
  spec.world_size = spec.nodes.max;
  if (!spec.nodes.elastic()) spec.nodes = {0, 0};
}

void add_host_options(CLI::App& app, HostOptions& o, bool hosts_required) {
  auto* hosts = app.add_option("--hosts", o.hosts,
                               "Hosts: a hostfile (host [slots=N] [user=U] [port=P] [key=PATH] "
                               "per line) or a list like a:2,b:2");
  if (hosts_required) hosts->required();
  // An empty value (an unset $HOSTS in a script) is not "no --hosts": that would run the job on
  // this machine alone.
  hosts->check(CLI::Validator(
      [](const std::string& value) {
        return value.find_first_not_of(" \t") == std::string::npos
                   ? std::string("empty: give a hostfile or a list such as a:2,b:2")
                   : std::string();
      },
      "", "not empty"));
  app.add_option("--identity", o.identities,
                 "SSH identity file, tried after a host's key= and before the agent (repeatable)")
      ->allow_extra_args(false);  // one file per --identity: a recipe after it is not a key
  app.add_option("--known-hosts", o.known_hosts, "known_hosts file (default ~/.ssh/known_hosts)");
  app.add_flag("--accept-new-host-keys", o.accept_new_host_keys,
               "Accept and record the keys of hosts not in known_hosts (a changed key is always "
               "refused)");
  app.add_option("--connect-timeout", o.connect_timeout_s, "Seconds to connect to a host")
      ->check(seconds_at_least(0.001))  // whole milliseconds reach libssh (0: its default)
      ->capture_default_str();
  app.add_option("--ssh-keepalive", o.keepalive_s,
                 "Seconds between SSH keepalives; a host silent for 3 of them is lost (0: never)")
      ->check(whole_number<int>("SECONDS", 3600))
      ->capture_default_str();
}

RemoteOptions RemoteJobOptions::get(const HostOptions& hosts) const {
  const std::string addr = unbracketed(master_addr);  // "[::1]" is ::1
  if (!addr.empty()) {
    // The store listens there: an address that is not this machine's (or no address at all)
    // would only show as every rank failing to reach it.
    try {
      listen_tcp(addr, 0);
    } catch (const Error& e) {
      throw Error(ErrorKind::usage,
                  fmt::format("--master-addr {}: the store cannot listen there ({}); give an "
                              "address of this machine that the hosts reach",
                              master_addr, first_line(e.what())));
    }
  }
  RemoteOptions r;
  r.ssh = hosts.ssh();
  r.workdir = workdir.empty() ? std::string(kDefaultWorkdir) : workdir;
  r.remote_binary = remote_binary;
  r.master_addr = addr;
  r.master_port = static_cast<uint16_t>(master_port);
  return r;
}

void add_remote_job_options(CLI::App& app, RemoteJobOptions& o) {
  app.add_option("--workdir", o.workdir,
                 "On remote hosts: where bin/dptrain is (see provision) and runs/ go")
      ->default_str(kDefaultWorkdir)
      ->check(remote_path());
  app.add_option("--remote-binary", o.remote_binary,
                 "dptrain on remote hosts (default: WORKDIR/bin/dptrain)")
      ->check(remote_path());
  app.add_option("--master-addr", o.master_addr,
                 "Address the store listens on and ranks dial (default: 127.0.0.1 on one "
                 "machine, else the address this machine reaches the first remote host from)");
  app.add_option("--master-port", o.master_port, "Store port (default: a free port)")
      ->check(whole_number<int>("PORT", 65535));
  app.add_option("--env", o.env,
                 "NAME=VALUE: set NAME for every rank on every host; NAME: pass this "
                 "environment's NAME (its value is neither printed nor recorded). Repeatable")
      ->allow_extra_args(false);  // one setting per --env: a recipe after it is not a setting
}

}  // namespace dptrain::cli
