// The events stream: one JSON object per line for every state change of a job.
#include "launch/events.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/json_error.hpp"
#include "launch/run_dir.hpp"
#include "launch/supervisor.hpp"

namespace dptrain {

namespace {

// A FIFO opens for writing only once something reads it: the wait is said (once) rather than
// spent without a word, and a stop signal ends it (nothing has started yet).
std::FILE* open_fifo(const std::string& target, bool wait_for_reader) {
  for (bool said = false;;) {
    const int fd = ::open(target.c_str(), O_WRONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd >= 0) {
      // Writes wait for a slow reader, as they do on any pipe.
      ::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
      if (std::FILE* f = ::fdopen(fd, "a")) return f;
      ::close(fd);
    }
    if (fd >= 0 || errno != ENXIO || !wait_for_reader) {
      throw Error(ErrorKind::usage, fmt::format("--events: cannot open {}: {}", printable(target),
                                                std::strerror(errno)));
    }
    if (!said) {
      std::fprintf(stderr,
                   "dptrain: --events: waiting for a reader of the FIFO %s (the launch goes on "
                   "once one opens it: 'cat %s', say)\n",
                   printable(target).c_str(), printable(target).c_str());
      said = true;
    }
    throw_if_stopped(" while waiting for a reader of the --events FIFO (no rank started)");
    sleep_unless_stopped(std::chrono::milliseconds(100));
  }
}

}  // namespace

bool names_standard_output(const std::string& target) {
  if (target == "-") return true;
  // A file or a pipe: a terminal or /dev/null opened again overwrites nothing, and a terminal's
  // other name may be stderr's.
  struct stat named {};
  struct stat out {};
  return ::stat(target.c_str(), &named) == 0 && ::fstat(STDOUT_FILENO, &out) == 0 &&
         named.st_dev == out.st_dev && named.st_ino == out.st_ino &&
         (S_ISREG(named.st_mode) || S_ISFIFO(named.st_mode) || S_ISSOCK(named.st_mode));
}

EventLog::EventLog(const std::string& target, bool wait_for_reader) : target_(target) {
  if (names_standard_output(target)) {
    out_ = stdout;
    to_stdout_ = true;
    return;
  }
  struct stat named {};
  if (::stat(target.c_str(), &named) == 0 && S_ISFIFO(named.st_mode)) {
    out_ = open_fifo(target, wait_for_reader);
    return;
  }
  out_ = std::fopen(target.c_str(), "a");
  if (out_ == nullptr) {
    throw Error(ErrorKind::usage,
                fmt::format("--events: cannot open {}: {}", target, std::strerror(errno)));
  }
}

EventLog::~EventLog() {
  if (out_ != nullptr && out_ != stdout) std::fclose(out_);
}

void EventLog::emit(const std::string& name, nlohmann::json fields) {
  if (out_ == nullptr) return;
  if (name == "run_finished") finished_ = true;
  nlohmann::json line = {{"time", utc_timestamp()}, {"event", name}};
  for (auto& [k, v] : fields.items())
    line[k] = std::move(v);
  errno = 0;
  const bool written = std::fprintf(out_, "%s\n", json_text(line).c_str()) >= 0;
  if (std::fflush(out_) == 0 && written) return;
  const std::string why = errno != 0 ? std::strerror(errno) : "write failed";
  write_failure_ = fmt::format("--events: cannot write {}: {}; the events from here on are lost",
                               to_stdout() ? "stdout" : printable(target_), why);
  std::fprintf(stderr, "dptrain: warning: %s\n", write_failure_.c_str());
  if (out_ != stdout) {
    std::fclose(out_);
  } else {
    std::clearerr(stdout);  // said above: not "standard output: cannot write" again at exit
  }
  out_ = nullptr;
}

}  // namespace dptrain
