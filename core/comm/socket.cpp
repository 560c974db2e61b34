// TCP socket helpers for the store (see socket.hpp).
#include "core/comm/socket.hpp"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include <fmt/format.h>

#include "core/comm/store.hpp"
#include "core/error.hpp"

namespace dptrain {

namespace {

struct AddrInfoDeleter {
  void operator()(addrinfo* info) const { freeaddrinfo(info); }
};
using AddrInfoList = std::unique_ptr<addrinfo, AddrInfoDeleter>;

// Resolves host:port; on failure returns null and sets `failure`.
AddrInfoList resolve(const std::string& host, uint16_t port, int flags, std::string& failure) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = flags;
  addrinfo* found = nullptr;
  const std::string service = std::to_string(port);
  const int status =
      getaddrinfo(host.empty() ? nullptr : host.c_str(), service.c_str(), &hints, &found);
  if (status != 0) {
    failure = fmt::format("cannot resolve '{}': {}", host, gai_strerror(status));
    return nullptr;
  }
  return AddrInfoList(found);
}

std::string errno_text(int error) {
  return std::strerror(error);
}

// Milliseconds left until `deadline` for poll(2), at least 0.
int poll_timeout_ms(SteadyTime deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
      deadline - std::chrono::steady_clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, 1 << 30));
}

// Waits until `fd` is ready for `events`; throws Error(comm) "timed out" at the deadline.
void wait_ready(int fd, short events, SteadyTime deadline) {
  while (true) {
    pollfd entry{fd, events, 0};
    const int ready = poll(&entry, 1, poll_timeout_ms(deadline));
    if (ready > 0) return;
    if (ready == 0) throw Error(ErrorKind::comm, "timed out");
    if (errno != EINTR) throw Error(ErrorKind::comm, "poll failed: " + errno_text(errno));
  }
}

// Connects one resolved address, waiting for the non-blocking connect up to `deadline`.
// `refused`: whether the address answered "connection refused".
UniqueFd connect_address(const addrinfo& address, SteadyTime deadline, std::string& failure,
                         bool& refused) {
  refused = false;
  UniqueFd fd(socket(address.ai_family, address.ai_socktype | SOCK_CLOEXEC, address.ai_protocol));
  if (!fd) {
    failure = errno_text(errno);
    return {};
  }
  set_nonblocking(fd.get());
  if (connect(fd.get(), address.ai_addr, address.ai_addrlen) != 0) {
    if (errno != EINPROGRESS) {
      refused = errno == ECONNREFUSED;
      failure = errno_text(errno);
      return {};
    }
    pollfd entry{fd.get(), POLLOUT, 0};
    int ready;
    do {
      ready = poll(&entry, 1, poll_timeout_ms(deadline));
    } while (ready < 0 && errno == EINTR);
    if (ready <= 0) {
      failure = ready == 0 ? "connect timed out" : errno_text(errno);
      return {};
    }
    int error = 0;
    socklen_t length = sizeof(error);
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &error, &length);
    if (error != 0) {
      refused = error == ECONNREFUSED;
      failure = errno_text(error);
      return {};
    }
  }
  set_no_delay(fd.get());
  return fd;
}

}  // namespace

UniqueFd& UniqueFd::operator=(UniqueFd&& other) noexcept {
  if (this != &other) reset(other.release());
  return *this;
}

int UniqueFd::release() {
  const int fd = fd_;
  fd_ = -1;
  return fd;
}

void UniqueFd::reset(int fd) {
  if (fd_ >= 0) close(fd_);
  fd_ = fd;
}

void set_nonblocking(int fd) {
  const int flags = fcntl(fd, F_GETFL, 0);
  if (flags < 0 || fcntl(fd, F_SETFL, flags | O_NONBLOCK) < 0) {
    throw Error(ErrorKind::comm, "cannot make a socket non-blocking: " + errno_text(errno));
  }
}

void set_no_delay(int fd) {
  // Store requests are small and synchronous; Nagle's algorithm would only add latency.
  const int enable = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &enable, sizeof(enable));
}

UniqueFd listen_tcp(const std::string& host, uint16_t port) {
  const std::string address = format_host_port(host, port);
  std::string failure;
  const AddrInfoList addresses = resolve(host, port, AI_PASSIVE, failure);
  for (const addrinfo* entry = addresses.get(); entry != nullptr; entry = entry->ai_next) {
    UniqueFd fd(socket(entry->ai_family, entry->ai_socktype | SOCK_CLOEXEC, entry->ai_protocol));
    if (!fd) {
      failure = errno_text(errno);
      continue;
    }
    const int enable = 1;
    setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &enable, sizeof(enable));
    if (bind(fd.get(), entry->ai_addr, entry->ai_addrlen) != 0 ||
        listen(fd.get(), SOMAXCONN) != 0) {
      failure = errno_text(errno);
      continue;
    }
    set_nonblocking(fd.get());
    return fd;
  }
  throw Error(ErrorKind::comm, fmt::format("cannot listen on {}: {}", address, failure));
}

uint16_t local_port(int fd) {
  sockaddr_storage address{};
  socklen_t length = sizeof(address);
  if (getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    throw Error(ErrorKind::comm, "getsockname failed: " + errno_text(errno));
  }
  if (address.ss_family == AF_INET6) {
    return ntohs(reinterpret_cast<const sockaddr_in6*>(&address)->sin6_port);
  }
  return ntohs(reinterpret_cast<const sockaddr_in*>(&address)->sin_port);
}

ConnectAttempt connect_tcp(const std::string& host, uint16_t port, SteadyTime deadline) {
  ConnectAttempt attempt;
  const AddrInfoList addresses = resolve(host, port, 0, attempt.failure);
  bool every_refused = addresses != nullptr;
  for (const addrinfo* entry = addresses.get(); entry != nullptr; entry = entry->ai_next) {
    bool refused = false;
    attempt.fd = connect_address(*entry, deadline, attempt.failure, refused);
    if (attempt.fd) return attempt;
    every_refused = every_refused && refused;
  }
  attempt.refused = every_refused;
  return attempt;
}

void send_all(int fd, std::string_view data, SteadyTime deadline) {
  while (!data.empty()) {
    const ssize_t sent = send(fd, data.data(), data.size(), MSG_NOSIGNAL);
    if (sent > 0) {
      data.remove_prefix(static_cast<size_t>(sent));
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      wait_ready(fd, POLLOUT, deadline);
    } else if (errno != EINTR) {
      throw Error(ErrorKind::comm, "send failed: " + errno_text(errno));
    }
  }
}

void recv_exact(int fd, char* data, size_t size, SteadyTime deadline) {
  while (size > 0) {
    const ssize_t received = recv(fd, data, size, 0);
    if (received > 0) {
      data += received;
      size -= static_cast<size_t>(received);
    } else if (received == 0) {
      throw Error(ErrorKind::comm, "connection closed by peer");
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      wait_ready(fd, POLLIN, deadline);
    } else if (errno != EINTR) {
      throw Error(ErrorKind::comm, "receive failed: " + errno_text(errno));
    }
  }
}

}  // namespace dptrain
