// The environment a rank reads its identity and settings from (RANK, WORLD_SIZE, DPTRAIN_*).
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace dptrain::cli {

// The variable's value; nullopt when it is unset or empty.
std::optional<std::string> env(const char* name);

// The variable's value; nullopt when it is unset. Set to nothing (an unset variable in a script,
// quoted) is Error(usage) "NAME: is empty; give a value", as an empty option value is: never the
// default.
std::optional<std::string> env_value(const char* name);

// The integer in the variable. Unset: `fallback`, or without one Error(usage) with
// `when_missing`; set to nothing, Error(usage) as env_value says. Error(usage) "NAME: not an
// integer: 'x'" for anything else.
int env_int(const char* name, std::optional<int> fallback, const std::string& when_missing = "");

// MemAvailable of /proc/meminfo in bytes (DPTRAIN_TEST_MEMINFO names another file, for tests);
// 0 when it cannot be read.
uint64_t available_memory();

// Raises this process's soft limit on open files (ulimit -n) to its hard limit, as its children
// inherit. A launcher holds a few descriptors per local rank and a Gloo rank one per peer, so
// the usual soft limit of 1024 stopped a job of a few hundred ranks on one machine with "Too
// many open files", where the hard limit (often 524288) allows it. Failure changes nothing.
void raise_open_file_limit();

// Fills a closed standard descriptor (`dptrain ... >&-`) with /dev/null opened read-only, so
// that the first file this process opens (a run's .lock, a rank's log) does not become its
// "stdout" and take its output; writes to it fail with EBADF as to the closed one, so the exit
// check in main still finds the output lost. Children inherit the placeholder, not a file.
void fill_closed_std_descriptors();

}  // namespace dptrain::cli
