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
  std::string host;   // the host(s) it is about; "" for a check not about a host (JSON null)
  bool ok = false;    // passed (false on a skipped check, which is not a failure either)
  std::string detail;    // what was found, or why it was not run
  std::string fix;       // what to try, on failure
  bool skipped = false;  // not run: held back by an earlier failure, or not needed (detail says)
  bool failed() const { return !ok && !skipped; }
  std::string line() const;  // one line for people
  // {"check", "host", "ok", "skipped", "detail", "fix"}: "ok" is true only for a check that
  // passed and null for a skipped one; "host" and "fix" are null when there is none.
  nlohmann::json to_json() const;
};

std::vector<DoctorCheck> run_doctor(const std::vector<HostSpec>& hosts,
                                    const DoctorOptions& options);

// doctor's exit code for its checks: 2 when the recipe (or its data, as this machine loads it) is
// wrong, as every command exits for a bad recipe; else 4 when any other check failed; else 0.
int doctor_exit_code(const std::vector<DoctorCheck>& checks);

// The hidden probes doctor runs on hosts: `dptrain _probe listen` (prints "port N", accepts
// until its stdin ends) and `dptrain _probe connect HOST:PORT SECONDS` (exit 0 when it connects).
int run_probe_listen(std::FILE* out);
int run_probe_connect(const std::string& address, double seconds);

}  // namespace dptrain
