// Hang attribution from heartbeats: who is behind, who waits.
#include "launch/hang_watch.hpp"

#include <doctest/doctest.h>

using namespace dptrain;
using nlohmann::json;

TEST_CASE("hang verdict: the rank behind is named with its step and phase, the waiters too") {
  const std::map<int, json> beats = {
      {0, {{"step", 50}, {"phase", "data"}, {"seq", 101}, {"progress", 7}}},
      {1, {{"step", 50}, {"phase", "allreduce"}, {"seq", 102}, {"progress", 9}}},
      {2, {{"step", 50}, {"phase", "allreduce"}, {"seq", 102}, {"progress", 9}}}};
  const std::string v = HangWatch::describe(beats, std::chrono::seconds(7));
  CHECK(v.find("no progress for 7s") != std::string::npos);
  CHECK(v.find("stuck: rank 0 at step 50 in phase data (after collective #101)") !=
        std::string::npos);
  CHECK(v.find("waiting for it in collective #102: rank 1, rank 2") != std::string::npos);
}

TEST_CASE("hang verdict: everyone inside the same collective points at the transport") {
  const std::map<int, json> beats = {
      {0, {{"step", 3}, {"phase", "allreduce"}, {"seq", 8}, {"progress", 1}}},
      {1, {{"step", 3}, {"phase", "allreduce"}, {"seq", 8}, {"progress", 1}}}};
  CHECK(HangWatch::describe(beats, std::chrono::seconds(5)).find("every rank waits") !=
        std::string::npos);
}
