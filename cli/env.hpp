// The environment a rank reads its identity and settings from (RANK, WORLD_SIZE, DPTRAIN_*).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace dptrain::cli {

// The variable's value; nullopt when it is unset or empty.
std::optional<std::string> env(const char* name);

// The integer in the variable. Unset: `fallback`, or without one Error(usage) with
// `when_missing`. Error(usage) "NAME: not an integer: 'x'" for anything else.
int env_int(const char* name, std::optional<int> fallback, const std::string& when_missing = "");

// MemAvailable of /proc/meminfo in bytes (DPTRAIN_TEST_MEMINFO names another file, for tests);
// 0 when it cannot be read.
uint64_t available_memory();

}  // namespace dptrain::cli
