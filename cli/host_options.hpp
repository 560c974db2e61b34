// Options every subcommand that reaches hosts over SSH shares: --hosts, keys, host keys, timeout.
#pragma once

#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "launch/hostfile.hpp"
#include "launch/job.hpp"
#include "launch/ssh.hpp"

namespace dptrain::cli {

struct HostOptions {
  std::string hosts;                    // a hostfile or "a:2,b:2"
  std::vector<std::string> identities;  // --identity, repeatable
  std::string known_hosts;
  bool accept_new_host_keys = false;
  double connect_timeout_s = 10;
  int keepalive_s = 15;  // --ssh-keepalive: seconds between keepalives; 3 unanswered: lost
  // A resume without --hosts: the hosts run.json records (their origin names it).
  std::vector<HostSpec> recorded;

  // Whether the job runs on hosts: --hosts, or the recorded ones.
  bool given() const { return !hosts.empty() || !recorded.empty(); }

  SshOptions ssh() const;
  std::vector<HostSpec> load() const;  // Error(usage) when no hosts are given or one is malformed
  // The SSH files named (--identity, --known-hosts): Error(usage) for one that cannot be what it
  // says. load() checks them; a job on this machine alone too, where they are not used: a typo
  // in a CI template's flags is exit 2 wherever it runs, not found on the first remote job.
  void check_files() const;
  // load() for a job, whose world is the hosts' slots: Error(usage) when --nproc was given too.
  std::vector<HostSpec> load_for_job(bool nproc_given) const;
};

// Where a job's ranks run (launch, resume). With --hosts: every host's slots, or with --nnodes N
// or MIN:MAX the first hosts that answer (those after the first MAX are spares). Without: --nproc
// N or MIN:MAX local ranks, `default_nproc` when it is not given. Sets spec.hosts, candidates,
// nodes and world_size; Error(usage) naming the flag that does not fit.
void place_ranks(JobSpec& spec, const HostOptions& hosts, const std::string& nproc,
                 const std::string& nnodes, int default_nproc);

// `hosts_required`: --hosts must be given (provision, doctor); otherwise it is optional (launch).
void add_host_options(CLI::App& app, HostOptions& o, bool hosts_required);

// How a job reaches its remote hosts and they reach it back, and what its ranks get in their
// environment (launch, resume, bench).
struct RemoteJobOptions {
  std::string workdir;  // empty: kDefaultWorkdir, or on resume the one the run recorded
  std::string remote_binary;
  std::string master_addr;
  int master_port = 0;
  std::vector<std::string> env;  // --env NAME[=VALUE], repeatable
  RemoteOptions get(const HostOptions& hosts) const;
  // --env as the ranks get it; Error(usage) naming a bad setting.
  RankEnv rank_env() const { return RankEnv::parse(env); }
};
void add_remote_job_options(CLI::App& app, RemoteJobOptions& o);

}  // namespace dptrain::cli
