// Small address helpers shared by workers and the launcher.
#pragma once

#include <cstdint>
#include <string>

namespace dptrain {

bool is_loopback_host(const std::string& host);  // localhost, 127.x.y.z, ::1

// This machine's host name (run.json's "launcher", a rank's claim); "localhost" when it has none.
std::string this_host();

// The local address the kernel would use to reach host:port: the address peers on other nodes
// can reach this machine on. A UDP connect sends nothing. Error(comm) naming the host.
std::string local_address_towards(const std::string& host, uint16_t port);

// Error(usage) naming `what` (the option that gave it) when a rank cannot bind its transport to
// `host`: a name that does not resolve, or an address this machine does not have.
void check_bind_address(const std::string& host, const std::string& what);

}  // namespace dptrain
