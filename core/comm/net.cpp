// Small address helpers shared by workers and the launcher.
#include "core/comm/net.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <memory>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dptrain {

std::string this_host() {
  char name[256] = {};
  if (::gethostname(name, sizeof(name) - 1) != 0) return "localhost";
  return name;
}

bool is_loopback_host(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

std::string local_address_towards(const std::string& host, uint16_t port) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;  // an IPv6 store too (a --store [ADDR]:PORT)
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* res = nullptr;
  if (const int status = ::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res);
      status != 0 || !res) {
    throw Error(ErrorKind::comm, fmt::format("cannot resolve host '{}': {}", host,
                                             status != 0 ? ::gai_strerror(status) : "no address"));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, ::freeaddrinfo);
  // A datagram socket's connect sends nothing: it only asks the kernel which local address
  // routes there.
  const int fd = ::socket(res->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  sockaddr_storage local{};
  socklen_t len = sizeof local;
  const bool ok = fd >= 0 && ::connect(fd, res->ai_addr, res->ai_addrlen) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0;
  const int error = errno;
  if (fd >= 0) ::close(fd);
  if (!ok) {
    throw Error(ErrorKind::comm, fmt::format("no local address routes to host '{}': {}", host,
                                             std::strerror(error)));
  }
  char buf[INET6_ADDRSTRLEN] = {};
  const void* address =
      local.ss_family == AF_INET6
          ? static_cast<const void*>(&reinterpret_cast<const sockaddr_in6*>(&local)->sin6_addr)
          : static_cast<const void*>(&reinterpret_cast<const sockaddr_in*>(&local)->sin_addr);
  ::inet_ntop(local.ss_family, address, buf, sizeof buf);
  return buf;
}

void check_bind_address(const std::string& host, const std::string& what) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (const int status = ::getaddrinfo(host.c_str(), "0", &hints, &res); status != 0 || !res) {
    throw Error(ErrorKind::usage,
                fmt::format("{} '{}': cannot resolve it: {}", what, printable(host),
                            status != 0 ? ::gai_strerror(status) : "no address"));
  }
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(res, ::freeaddrinfo);
  // As Gloo takes it: the first of its addresses that binds ("localhost" may give ::1 first on
  // a machine without IPv6 on its loopback).
  bool bound = false;
  int error = 0;
  for (const addrinfo* a = res; a && !bound; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    bound = fd >= 0 && ::bind(fd, a->ai_addr, a->ai_addrlen) == 0;
    if (!bound && error == 0) error = errno;
    if (fd >= 0) ::close(fd);
  }
  if (!bound) {
    throw Error(
        ErrorKind::usage,
        fmt::format("{} '{}': {} ({}); give an address of this machine", what, printable(host),
                    error == EADDRNOTAVAIL ? "not an address of this machine" : "cannot bind there",
                    std::strerror(error)));
  }
}

}  // namespace dptrain
