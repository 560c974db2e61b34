// Two loopback SSH "hosts" (127.0.0.2 and .3) with a hostfile, for tests that launch across hosts.
#pragma once

#include <filesystem>
#include <string>
#include <system_error>
#include <vector>

#include "tests/harness.hpp"
#include "tests/sshd.hpp"

namespace dptrain::test {

struct TwoHostCluster {
  LoopbackSshd& sshd = LoopbackSshd::instance();
  TempDir tmp;
  std::filesystem::path hostfile = tmp / "hosts.txt";

  explicit TwoHostCluster(int slots) {
    sshd.write_hostfile(hostfile, {sshd.addresses()[1], sshd.addresses()[2]}, slots);
  }

  // `dptrain launch RECIPE --hosts HOSTFILE ...` with this build as the remote binary.
  std::vector<std::string> launch_args(const std::filesystem::path& recipe,
                                       const std::filesystem::path& run_dir) const {
    return {"launch",          recipe.string(), "--hosts",
            hostfile.string(), "--known-hosts", sshd.known_hosts().string(),
            "--remote-binary", binary(),        "--run-dir",
            run_dir.string()};
  }

  // `dptrain resume RUN_DIR --hosts ... --json`, with the SSH options launch_args gives.
  std::vector<std::string> resume_args(const std::filesystem::path& run_dir) const {
    return {"resume",          run_dir.string(), "--hosts",
            hostfile.string(), "--known-hosts",  sshd.known_hosts().string(),
            "--remote-binary", binary(),         "--json"};
  }

  // The run directory a host's ranks use (under the default --workdir in that host's $HOME);
  // empty until the launcher has written run.json.
  std::filesystem::path remote_run(const std::string& address,
                                   const std::filesystem::path& run_dir) const {
    std::error_code ec;
    if (!std::filesystem::exists(run_dir / "run.json", ec)) return {};
    const auto info = parse_json(read_text(run_dir / "run.json"));
    return sshd.home(address) / ".dptrain/runs" /
           (run_dir.filename().string() + "-" + info["id"].get<std::string>());
  }
};

}  // namespace dptrain::test
