// Heartbeats: what a rank publishes, and how soon the store has its step.
#include "core/heartbeat.hpp"

#include <doctest/doctest.h>

#include <optional>
#include <thread>

#include "core/comm/tcp_store.hpp"

using namespace dptrain;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

json beat_of(Store& store, int rank) {
  return json::parse(store.get(heartbeat_key(rank), 5s));
}

// The heartbeat of `rank` once its step is `step`, polling for up to `limit`.
std::optional<json> beat_at_step(Store& store, int rank, int64_t step,
                                 std::chrono::milliseconds limit) {
  const auto until = std::chrono::steady_clock::now() + limit;
  while (std::chrono::steady_clock::now() < until) {
    if (store.check({heartbeat_key(rank)})) {
      json beat = beat_of(store, rank);
      if (beat.value("step", int64_t{-1}) == step) return beat;
    }
    std::this_thread::sleep_for(5ms);
  }
  return std::nullopt;
}

}  // namespace

TEST_CASE("heartbeat: the snapshot names the phase and the last collective") {
  ProgressTracker tracker;
  CHECK(tracker.snapshot()["phase"] == "starting");
  CHECK(tracker.snapshot()["collective"] == "");
  CHECK(tracker.snapshot()["stepping"] == false);  // its step 0 is not the run's yet
  tracker.set_step(4);
  CHECK(tracker.snapshot()["stepping"] == true);
  tracker.enter(Phase::data);
  tracker.enter_collective("allreduce of gradient bucket", 2);
  json s = tracker.snapshot();
  CHECK(s["step"] == 4);
  CHECK(s["phase"] == "collective");
  CHECK(s["seq"] == 1);
  CHECK(s["progress"] == 2);
  CHECK(s["collective"] == "allreduce of gradient bucket 2");
  tracker.enter_collective("barrier after the checkpoint is written");
  tracker.enter(Phase::optimizer);
  s = tracker.snapshot();
  CHECK(s["phase"] == "optimizer");
  CHECK(s["seq"] == 2);
  CHECK(s["collective"] == "barrier after the checkpoint is written");
}

// The launcher takes the step a failure came at from the heartbeats: a step change must reach the
// store at once, not at the next interval (an hour here), and a sender that is destroyed (a rank
// unwinding from an error) leaves its last step behind.
TEST_CASE("heartbeat: a step change is published at once, and the last state at destruction") {
  TcpStoreServer server;
  TcpStoreClient store("127.0.0.1", server.port(), 5s);
  ProgressTracker tracker;
  {
    const HeartbeatSender sender(store, 3, tracker, std::chrono::hours(1));
    REQUIRE(beat_at_step(store, 3, 0, 10s).has_value());
    tracker.set_step(17);
    tracker.enter(Phase::compute);
    const auto beat = beat_at_step(store, 3, 17, 10s);
    REQUIRE(beat.has_value());
    CHECK((*beat)["phase"] == "forward/backward");
    tracker.set_step(18);
    tracker.enter_collective("allreduce of the loss");
  }
  const json last = beat_of(store, 3);
  CHECK(last["step"] == 18);
  CHECK(last["phase"] == "collective");
  CHECK(last["collective"] == "allreduce of the loss");
}

TEST_CASE("heartbeat: a store that is gone does not fail the rank or hold it up") {
  ProgressTracker tracker;
  std::optional<TcpStoreServer> server(std::in_place);
  TcpStoreClient store("127.0.0.1", server->port(), 5s);
  {
    const HeartbeatSender sender(store, 0, tracker, 10ms);
    server.reset();
    tracker.set_step(1);
    std::this_thread::sleep_for(50ms);
  }  // destroyed without an exception, although every publish fails
  CHECK(tracker.snapshot()["step"] == 1);
}

TEST_CASE("heartbeat: entering eval or a checkpoint is published at once; beats are counted") {
  TcpStoreServer server;
  TcpStoreClient store("127.0.0.1", server.port(), 5s);
  ProgressTracker tracker;
  const HeartbeatSender sender(store, 0, tracker, std::chrono::hours(1));
  REQUIRE(beat_at_step(store, 0, 0, 10s).has_value());
  const int64_t first = beat_of(store, 0)["beat"].get<int64_t>();
  tracker.set_step(10);
  tracker.enter(Phase::eval);
  const auto until = std::chrono::steady_clock::now() + 10s;
  json beat;
  while (std::chrono::steady_clock::now() < until) {
    beat = beat_of(store, 0);
    if (beat["phase"] == "eval") break;
    std::this_thread::sleep_for(5ms);
  }
  CHECK(beat["phase"] == "eval");
  CHECK(beat["step"] == 10);
  CHECK(beat["beat"].get<int64_t>() > first);
}

TEST_CASE("heartbeat: silent_peers names the ranks whose beats stand still, or a store gone") {
  ProgressTracker tracker;
  std::optional<TcpStoreServer> server(std::in_place);
  TcpStoreClient store("127.0.0.1", server->port(), 1s);
  const HeartbeatSender alive(store, 1, tracker, 10ms);
  { const HeartbeatSender gone(store, 2, tracker, 10ms); }  // beat, then stopped
  // Rank 3 never beat (it never started): nothing is said of it.
  // Over 1 s the sender beats (every 10 ms) even on a loaded machine.
  CHECK(silent_peers(store, 0, 4, 1s) ==
        "rank 2 (no heartbeat for 1.0s: exited, killed or frozen)");
  CHECK(silent_peers(store, 2, 3, 1s).empty());  // the rank asking is not its own peer
  server.reset();
  CHECK(silent_peers(store, 0, 4, 200ms) ==
        "the " + store.describe() +
            " does not answer either: the process serving it (rank 0 with --host-store) has "
            "likely exited or was killed");
}
