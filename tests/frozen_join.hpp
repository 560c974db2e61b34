// A job with a rank frozen before the ranks meet, for the tests of --hang-timeout's watch over
// ranks that never joined (one host, and across hosts).
#pragma once

#include <doctest/doctest.h>

#include <chrono>
#include <filesystem>
#include <string>
#include <vector>

#include "tests/harness.hpp"

namespace dptrain::test {

// Runs the launch `args` (its recipe's distributed.timeout_s 120, the wait the other ranks would
// otherwise sit out) with `fault` freezing one rank before it joins in generation 1, under
// --hang-timeout 3 and one restart: the watch names the frozen rank well before that wait ends,
// and generation 2 completes. Returns the hang_detected event's message, the verdict.
inline std::string frozen_join_verdict(std::vector<std::string> args, const std::string& fault,
                                       const std::filesystem::path& events) {
  args.insert(args.end(), {"--hang-timeout", "3", "--max-restarts", "1", "--restart-backoff", "0.1",
                           "--events", events.string(), "--json"});
  const auto t0 = std::chrono::steady_clock::now();
  const auto r = run_dptrain(args, {{"DPTRAIN_FAULT", fault}});
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  INFO(r.err);
  REQUIRE(r.exit_code == 0);  // found, stopped, and restarted: generation 2 has no fault
  CHECK(seconds < 60);        // not the 120 s the ranks' own wait takes
  CHECK(parse_json(r.out)["restarts"] == 1);
  return last_event_message(events, "hang_detected");
}

}  // namespace dptrain::test
