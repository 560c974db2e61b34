#include "launch/rank_env.hpp"

#include <algorithm>
#include <cstdlib>
#include <iterator>

#include <fmt/format.h>

#include "core/comm/auth.hpp"
#include "core/error.hpp"
#include "launch/agent.hpp"
#include "launch/run_dir.hpp"

namespace dptrain {

namespace {

constexpr std::string_view kSetForEachRank[] = {"RANK",
                                                "WORLD_SIZE",
                                                "LOCAL_RANK",
                                                "LOCAL_WORLD_SIZE",
                                                "DPTRAIN_STORE",
                                                "DPTRAIN_GENERATION",
                                                "DPTRAIN_BACKEND",
                                                "DPTRAIN_EVENTS",
                                                "DPTRAIN_NOMINAL_WORLD",
                                                kLaunchedEnv,
                                                kStoreSecretEnv};

bool is_variable_name(std::string_view name) {
  if (name.empty() || (name.front() >= '0' && name.front() <= '9')) return false;
  return std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'A' && c <= 'Z') || (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
}

std::string not_set_here(const std::string& name) {
  return fmt::format("{} is not set in this environment: export it, or give --env {}=VALUE", name,
                     name);
}

}  // namespace

bool set_for_each_rank(std::string_view name) {
  return std::find(std::begin(kSetForEachRank), std::end(kSetForEachRank), name) !=
         std::end(kSetForEachRank);
}

RankEnv RankEnv::parse(const std::vector<std::string>& settings) {
  RankEnv env;
  for (const std::string& setting : settings) {
    const auto eq = setting.find('=');
    const std::string name = setting.substr(0, eq);
    if (!is_variable_name(name)) {
      throw Error(ErrorKind::usage,
                  fmt::format("--env '{}': '{}' is not a variable name (letters, digits and '_', "
                              "not starting with a digit); give NAME=VALUE or NAME",
                              printable_excerpt(setting), printable_excerpt(name)));
    }
    if (set_for_each_rank(name)) {
      throw Error(ErrorKind::usage,
                  fmt::format("--env {}: the launcher sets {} for each rank itself", name, name));
    }
    if (eq != std::string::npos) {
      env.values[name] = setting.substr(eq + 1);
      env.from_launcher.erase(name);
      continue;
    }
    const char* value = std::getenv(name.c_str());
    if (value == nullptr) throw Error(ErrorKind::usage, "--env " + not_set_here(name));
    env.values[name] = value;
    env.from_launcher.insert(name);
  }
  return env;
}

nlohmann::json RankEnv::record() const {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [name, value] : values)
    j[name] = from_launcher.count(name) ? nlohmann::json(nullptr) : nlohmann::json(value);
  return j;
}

RankEnv RankEnv::resumed(const nlohmann::json& record, const std::string& file,
                         const RankEnv& given) {
  if (!record.is_object()) {
    throw Error(ErrorKind::usage, fmt::format("{}: \"env\" must be an object of NAME: VALUE "
                                              "(null: from the launcher's environment)",
                                              file));
  }
  RankEnv env;
  for (const auto& [name, value] : record.items()) {
    if (given.values.count(name)) continue;
    if (!is_variable_name(name) || set_for_each_rank(name) ||
        !(value.is_string() || value.is_null())) {
      throw Error(ErrorKind::usage,
                  fmt::format("{}: \"env\": \"{}\" is not a variable the ranks can be given a "
                              "string for",
                              file, printable_excerpt(name)));
    }
    if (value.is_string()) {
      env.values[name] = value.get<std::string>();
      continue;
    }
    const char* here = std::getenv(name.c_str());
    if (here == nullptr) {
      throw Error(ErrorKind::usage,
                  fmt::format("{}: the launch passed {} from its environment (--env {}), but {}",
                              file, name, name, not_set_here(name)));
    }
    env.values[name] = here;
    env.from_launcher.insert(name);
  }
  for (const auto& [name, value] : given.values)
    env.values[name] = value;
  env.from_launcher.insert(given.from_launcher.begin(), given.from_launcher.end());
  return env;
}

void RankEnv::check_gpu_list(int ranks_per_host) const {
  const auto list = values.find("CUDA_VISIBLE_DEVICES");
  if (list == values.end() || ranks_per_host <= 0) return;
  if (gpu_of_local_rank(ranks_per_host - 1, values) == "-1") {
    throw Error(ErrorKind::usage,
                fmt::format("--env CUDA_VISIBLE_DEVICES={}: each host's ranks take one GPU of "
                            "this list, but a host runs {} rank(s)",
                            list->second, ranks_per_host));
  }
}

}  // namespace dptrain
