// TCP socket helpers for the store: owning descriptor, listen, connect, I/O with deadlines.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>

namespace dptrain {

using SteadyTime = std::chrono::steady_clock::time_point;

// Owns one file descriptor and closes it.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept;
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  int release();
  void reset(int fd = -1);

 private:
  int fd_ = -1;
};

// A listening, non-blocking TCP socket on host:port (port 0 picks a free port). Throws Error(comm).
UniqueFd listen_tcp(const std::string& host, uint16_t port);

// The port a bound socket got.
uint16_t local_port(int fd);

// One connection attempt to host:port that gives up at `deadline`. On failure the result holds no
// descriptor and `failure` says why ("Connection refused").
struct ConnectAttempt {
  UniqueFd fd;
  std::string failure;
  bool refused = false;  // every address answered "connection refused": nothing listens there
};
ConnectAttempt connect_tcp(const std::string& host, uint16_t port, SteadyTime deadline);

void set_nonblocking(int fd);
void set_no_delay(int fd);

// Blocking-style I/O on a non-blocking socket, bounded by `deadline`. Throw Error(comm) saying what
// went wrong ("timed out", "connection closed by peer", strerror); callers add which store and
// request.
void send_all(int fd, std::string_view data, SteadyTime deadline);
void recv_exact(int fd, char* data, size_t size, SteadyTime deadline);

}  // namespace dptrain
