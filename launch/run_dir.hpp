// The run directory: run.json (recipe, world size, generations, status), logs/, checkpoints/.
#pragma once

#include <filesystem>
#include <string>

#include <nlohmann/json.hpp>

namespace dptrain {

class RunDirectory {
 public:
  // `dir` empty: runs_root/<name>-<UTC time> (a suffix keeps two runs in one second apart).
  // `dir` given: used as it is; it must not already hold a run (Error(usage) pointing at resume).
  static RunDirectory create(const std::filesystem::path& dir,
                             const std::filesystem::path& runs_root, const std::string& name);
  // An existing run: Error(usage) naming the directory when it has no readable run.json.
  static RunDirectory open(const std::filesystem::path& dir);

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path logs() const { return path_ / "logs"; }
  std::filesystem::path checkpoints() const { return path_ / "checkpoints"; }
  nlohmann::json& info() { return info_; }
  // The run's directory name on other hosts (WORKDIR/runs/NAME): this one's name and the run's
  // id, so two runs that share a name never share a directory there.
  std::string remote_name() const;
  void save() const;  // run.json, atomically

 private:
  RunDirectory(std::filesystem::path path, nlohmann::json info)
      : path_(std::move(path)), info_(std::move(info)) {}

  std::filesystem::path path_;
  nlohmann::json info_;
};

std::string utc_timestamp();  // 2026-11-30T08:43:38Z
std::string this_host();      // this machine's host name (run.json's "launcher")

// How often a running launcher stamps run.json's "alive_at", and how old that stamp may get
// before a run seen from another machine counts as stale.
constexpr int kAliveEveryS = 10;
constexpr int kAliveStaleS = 60;

}  // namespace dptrain
