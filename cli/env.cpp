// The environment a rank reads its identity and settings from.
#include "cli/env.hpp"

#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <fstream>
#include <limits>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dptrain::cli {

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

std::optional<std::string> env_value(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr) return std::nullopt;
  if (*v == '\0') throw Error(ErrorKind::usage, fmt::format("{}: is empty; give a value", name));
  return std::string(v);
}

int env_int(const char* name, std::optional<int> fallback, const std::string& when_missing) {
  const auto v = env_value(name);
  if (!v) {
    if (fallback) return *fallback;
    throw Error(ErrorKind::usage,
                when_missing.empty() ? fmt::format("{} is not set", name) : when_missing);
  }
  int n = 0;
  // As stoi read them before: leading blanks and a '+' sign (a script's "+0", " 1").
  const char* begin = v->data();
  const char* end = v->data() + v->size();
  while (begin != end && (*begin == ' ' || *begin == '\t'))
    ++begin;
  if (end - begin > 1 && *begin == '+' && begin[1] != '-') ++begin;
  const auto [ptr, ec] = std::from_chars(begin, end, n);
  if (ptr == end && ec == std::errc::result_out_of_range) {
    // Every such setting is a count or an index (at least 0): the bound it is past.
    throw Error(
        ErrorKind::usage,
        *begin == '-'
            ? fmt::format("{}: '{}' is negative (a count or an index: at least 0)", name, *v)
            : fmt::format("{}: '{}' is too large (at most {})", name, *v,
                          std::numeric_limits<int>::max()));
  }
  if (ptr == end && ec == std::errc()) return n;
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

void raise_open_file_limit() {
  rlimit files{};
  if (::getrlimit(RLIMIT_NOFILE, &files) != 0 || files.rlim_cur >= files.rlim_max) return;
  // An unlimited hard limit is still bounded by the kernel's fs.nr_open (2^20 by default).
  uint64_t nr_open = 0;
  if (!(std::ifstream("/proc/sys/fs/nr_open") >> nr_open) || nr_open == 0) nr_open = 1 << 20;
  files.rlim_cur = std::min<rlim_t>(files.rlim_max, static_cast<rlim_t>(nr_open));
  ::setrlimit(RLIMIT_NOFILE, &files);
}

void fill_closed_std_descriptors() {
  for (int fd = 0; fd <= 2; ++fd) {
    if (::fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
    // The lowest free descriptor is `fd` itself, the lower ones being open by now.
    const int filler = ::open("/dev/null", O_RDONLY);
    if (filler >= 0 && filler != fd) ::close(filler);  // /dev/null missing: nothing to do
  }
}

}  // namespace dptrain::cli
