// Tests for how a job names its hosts in logs and on the console.
#include "launch/job.hpp"

#include <doctest/doctest.h>

namespace dptrain {
namespace {

HostSpec host(const std::string& name, uint16_t port) {
  HostSpec h;
  h.host = name;
  h.port = port;
  return h;
}

TEST_CASE(
    "host tags: the name, and NAME-PORT where hosts share a name, over all an elastic job's") {
  JobSpec spec;
  spec.hosts = {host("a", 22), host("b", 2201)};
  CHECK(host_tag(spec, spec.hosts[0]) == "a");
  CHECK(host_tag(spec, spec.hosts[1]) == "b");
  // Two sshd ports of one machine (or one gateway's forwards).
  spec.hosts = {host("gw", 2201), host("gw", 2202), host("c", 22)};
  CHECK(host_tag(spec, spec.hosts[0]) == "gw-2201");
  CHECK(host_tag(spec, spec.hosts[1]) == "gw-2202");
  CHECK(host_tag(spec, spec.hosts[2]) == "c");
  // A generation with one of them keeps the tag the job's other generations give it.
  spec.all_hosts = spec.hosts;
  spec.hosts = {host("gw", 2202)};
  CHECK(host_tag(spec, spec.hosts[0]) == "gw-2202");
}

}  // namespace
}  // namespace dptrain
