// --env: variables a job gives every rank on every host, on top of the environment the rank's
// host gives it (like `mpirun -x`). NCCL_SOCKET_IFNAME, a tracker's key, a library's switch:
// whatever the job's ranks need that the launcher's automatic forwarding (OPENBLAS_*, OMP_*,
// ...; see job.cpp) leaves alone.
#pragma once

#include <map>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace dptrain {

// The names every rank's environment gets from its launcher or agent (RANK, DPTRAIN_STORE, ...),
// which --env may not change: worker_specs sets exactly these, and CUDA_VISIBLE_DEVICES.
bool set_for_each_rank(std::string_view name);

struct RankEnv {
  std::map<std::string, std::string> values;  // what every rank gets
  // Names given as `--env NAME`: their values came from the launcher's environment, and are
  // neither written to run.json nor printed (a token stays where the user put it).
  std::set<std::string> from_launcher;

  // --env values as given: "NAME=VALUE" sets NAME (VALUE may be empty or hold '='), "NAME" takes
  // this process's value. A later setting of a name replaces an earlier one. Error(usage) "--env
  // ...: " for a name that is not an environment variable's, one the launcher sets itself, or a
  // NAME not set here.
  static RankEnv parse(const std::vector<std::string>& settings);

  // What run.json records: {"NAME": "VALUE", ...}, with null for a name from the launcher's
  // environment.
  nlohmann::json record() const;
  // The environment a resumed run's ranks get: what the launch recorded (`record`, from `file`),
  // with `given` (resume's own --env) replacing names it sets; a recorded null takes this
  // process's value now. Error(usage) naming `file` for a malformed record, or for a null whose
  // name is not set here (the message says to export it, or to give --env NAME=VALUE).
  static RankEnv resumed(const nlohmann::json& record, const std::string& file,
                         const RankEnv& given);

  // CUDA_VISIBLE_DEVICES given with --env is the list each host's ranks take one GPU from, in
  // order: Error(usage) when it names fewer than `ranks_per_host` devices.
  void check_gpu_list(int ranks_per_host) const;
};

}  // namespace dptrain
