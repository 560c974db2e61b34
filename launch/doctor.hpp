// `dptrain doctor`: preflight checks of hosts and a recipe before a job, each failure one line
// naming the host(s) and the fix to try.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "launch/hostfile.hpp"
#include "launch/ssh.hpp"

namespace dptrain {

struct DoctorOptions {
  std::string workdir = kDefaultWorkdir;
  std::string remote_binary;           // empty: WORKDIR/bin/dptrain
  std::filesystem::path recipe;        // optional
  std::string master_addr;             // as for launch
  uint16_t master_port = 0;            // 0: any free port
  std::filesystem::path local_binary;  // this executable
  SshOptions ssh;
  bool allreduce = true;  // finish with a tiny job across all ranks
};

struct DoctorCheck {
  std::string check;  // ssh, workdir, version, store-port, peer-port, recipe, data, gpus, allreduce
  std::string host;   // the host(s) it is about; "" for this machine
  bool ok = false;
  std::string detail;        // what was found
  std::string fix;           // what to try, on failure
  bool skipped = false;      // not run because an earlier check failed (not a failure itself)
  std::string line() const;  // one line for people
  nlohmann::json to_json() const;
};

std::vector<DoctorCheck> run_doctor(const std::vector<HostSpec>& hosts,
                                    const DoctorOptions& options);

// The hidden probes doctor runs on hosts: `dptrain _probe listen` (prints "port N", accepts
// until its stdin ends) and `dptrain _probe connect HOST:PORT SECONDS` (exit 0 when it connects).
int run_probe_listen(std::FILE* out);
int run_probe_connect(const std::string& address, double seconds);

}  // namespace dptrain
