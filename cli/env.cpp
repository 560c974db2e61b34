// The environment a rank reads its identity and settings from.
#include "cli/env.hpp"

#include <cstdlib>
#include <fstream>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dptrain::cli {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

int env_int(const char* name, std::optional<int> fallback, const std::string& when_missing) {
  const auto v = env(name);
  if (!v) {
    if (fallback) return *fallback;
    throw Error(ErrorKind::usage,
                when_missing.empty() ? fmt::format("{} is not set", name) : when_missing);
  }
  try {
    size_t used = 0;
    const int n = std::stoi(*v, &used);
    if (used == v->size()) return n;
  } catch (const std::exception&) {
  }
  throw Error(ErrorKind::usage, fmt::format("{}: not an integer: '{}'", name, *v));
}

uint64_t available_memory() {
  std::ifstream meminfo(env("DPTRAIN_TEST_MEMINFO").value_or("/proc/meminfo"));
  std::string key;
  uint64_t kib = 0;
  std::string unit;
  while (meminfo >> key >> kib >> unit) {
    if (key == "MemAvailable:") return kib * 1024;
  }
  return 0;
}

}  // namespace dptrain::cli
