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

TEST_CASE("smallest_world: the fewest ranks an elastic job may run on") {
  JobSpec spec;
  spec.world_size = 3;
  CHECK(smallest_world(spec) == 3);  // a fixed size ({0, 0})
  spec.nodes = {1, 3};               // --nproc 1:3
  CHECK(smallest_world(spec) == 1);
  // --nnodes 2:3 over hosts of 4, 1 and 2 slots: the two smallest hold 3 ranks.
  spec.candidates = {host("a", 22), host("b", 22), host("c", 22)};
  spec.candidates[0].slots = 4;
  spec.candidates[2].slots = 2;
  spec.nodes = {2, 3};
  spec.world_size = 7;
  CHECK(smallest_world(spec) == 3);
  // Refused where that leaves parameter servers no worker, naming the minimum; not above it.
  spec.recipe.distributed.sync = "ps";
  spec.recipe.distributed.servers = 3;
  try {
    check_smallest_world(spec, "r.json");
    FAIL("not refused");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::recipe);
    CHECK(std::string(e.what()).starts_with("r.json: /distributed/servers: 3 parameter"));
    CHECK(
        std::string(e.what()).ends_with("(the elastic job may shrink to 3 rank(s), its "
                                        "minimum: give a minimum that leaves a worker)"));
  }
  spec.recipe.distributed.servers = 2;
  CHECK_NOTHROW(check_smallest_world(spec, "r.json"));
}

}  // namespace
}  // namespace dptrain
