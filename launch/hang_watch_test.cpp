// Hang attribution from heartbeats: who is behind, who waits.
#include "launch/hang_watch.hpp"

#include <doctest/doctest.h>

#include <functional>
#include <map>
#include <optional>
#include <thread>

#include "core/comm/tcp_store.hpp"
#include "core/heartbeat.hpp"
#include "tests/strings.hpp"

using namespace dptrain;
using dptrain::test::contains;
using nlohmann::json;

namespace {

// Every 100 ms, for 20 s at most: sets the heartbeats that `beats(n)` gives for round n (rank ->
// heartbeat; n counts from `first`), then asks the watch. Returns its first verdict that `wanted`
// takes (any, when none is given), or none.
std::optional<std::string> beat_until_verdict(
    TcpStoreClient& store, HangWatch& watch, int64_t first,
    const std::function<std::map<int, std::string>(int64_t)>& beats,
    const std::function<bool(const std::string&)>& wanted = {}) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (int64_t n = first; std::chrono::steady_clock::now() < until; ++n) {
    for (const auto& [rank, beat] : beats(n))
      store.set(heartbeat_key(rank), beat);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    const auto verdict = watch.check();
    if (verdict && (!wanted || wanted(*verdict))) return verdict;
  }
  return std::nullopt;
}

// The heartbeat of a rank that has not met the others yet, its `beats`-th.
std::string starting(int64_t beats) {
  return json{{"step", 0}, {"phase", "starting"}, {"seq", 0}, {"progress", 0}, {"beat", beats}}
      .dump();
}

}  // namespace

TEST_CASE("hang verdict: the rank behind is named with its step and phase, the waiters too") {
  const std::map<int, json> beats = {{0,
                                      {{"step", 50},
                                       {"phase", "data"},
                                       {"seq", 101},
                                       {"progress", 7},
                                       {"collective", "allreduce of the loss"}}},
                                     {1,
                                      {{"step", 50},
                                       {"phase", "collective"},
                                       {"seq", 102},
                                       {"progress", 9},
                                       {"collective", "allreduce of gradient bucket 3"}}},
                                     {2,
                                      {{"step", 50},
                                       {"phase", "collective"},
                                       {"seq", 102},
                                       {"progress", 9},
                                       {"collective", "allreduce of gradient bucket 3"}}}};
  const std::string v = HangWatch::describe(beats, std::chrono::seconds(7));
  CHECK(v.find("no progress for 7s") != std::string::npos);
  CHECK(v.find("stuck: rank 0 at step 50 in phase data (after collective #101 (allreduce of the "
               "loss))") != std::string::npos);
  CHECK(v.find("waiting for it in collective #102 (allreduce of gradient bucket 3): rank 1, "
               "rank 2") != std::string::npos);
}

TEST_CASE("hang verdict: one rank's position, as a failed rank's message gives it") {
  CHECK(HangWatch::position({{"step", 5},
                             {"phase", "data"},
                             {"seq", 8},
                             {"collective", "allreduce of gradient bucket 0"}}) ==
        "step 5 in phase data (after collective #8 (allreduce of gradient bucket 0))");
  CHECK(HangWatch::position({{"step", 7}, {"phase", "collective"}, {"seq", 12}}) ==
        "step 7 in collective #12");
  // Still starting (a resume's rank before its checkpoint is loaded): its 0 is not the run's step.
  CHECK(HangWatch::position({{"step", 0},
                             {"phase", "collective"},
                             {"seq", 3},
                             {"collective", "allgather of the shared-directory verdicts"},
                             {"stepping", false}}) ==
        "start-up, in collective #3 (allgather of the shared-directory verdicts)");
}

TEST_CASE("hang verdict: a rank stuck in an earlier collective is named in it") {
  const std::map<int, json> beats = {
      {0, {{"step", 9}, {"phase", "collective"}, {"seq", 40}, {"collective", "barrier"}}},
      {1, {{"step", 9}, {"phase", "collective"}, {"seq", 41}, {"collective", "allgather"}}}};
  const std::string v = HangWatch::describe(beats, std::chrono::seconds(3));
  CHECK(v.find("stuck: rank 0 at step 9 in collective #40 (barrier); waiting for it in "
               "collective #41 (allgather): rank 1") != std::string::npos);
}

TEST_CASE("hang verdict: everyone inside the same collective points at the transport") {
  const std::map<int, json> beats = {
      {0, {{"step", 3}, {"phase", "collective"}, {"seq", 8}, {"progress", 1}}},
      {1, {{"step", 3}, {"phase", "collective"}, {"seq", 8}, {"progress", 1}}}};
  CHECK(HangWatch::describe(beats, std::chrono::seconds(5))
            .find("every rank waits in collective #8 (a network") != std::string::npos);
}

TEST_CASE("hang verdict: in a multi-host job the ranks are named with their host") {
  const std::map<int, json> beats = {
      {0, {{"step", 7}, {"phase", "data"}, {"seq", 20}, {"collective", "barrier"}}},
      {1, {{"step", 7}, {"phase", "collective"}, {"seq", 21}, {"collective", "allgather"}}}};
  const auto on_host = [](int rank) {
    return "rank " + std::to_string(rank) + " on node" + std::to_string(rank + 1);
  };
  const std::string v = HangWatch::describe(beats, std::chrono::seconds(4), on_host);
  CHECK(v.find("stuck: rank 0 on node1 at step 7 in phase data") != std::string::npos);
  CHECK(v.find("waiting for it in collective #21 (allgather): rank 1 on node2") !=
        std::string::npos);
}

TEST_CASE("hang verdict: a rank whose heartbeat stopped is named as frozen, with its last word") {
  const std::map<int, json> beats = {{0,
                                      {{"step", 10},
                                       {"phase", "collective"},
                                       {"seq", 17},
                                       {"collective",
                                        "allreduce of the "
                                        "eval sums"}}},
                                     {1,
                                      {{"step", 9},
                                       {"phase", "forward/backward"},
                                       {"seq", 13},
                                       {"collective", "allreduce of gradient bucket 0"},
                                       {"silent_ms", 4200}}}};
  const std::string v = HangWatch::describe(beats, std::chrono::seconds(4));
  CHECK(v.find("stuck: rank 1 (its heartbeat stopped 4s ago: frozen or unreachable; it last said "
               "step 9, phase forward/backward after collective #13 (allreduce of gradient "
               "bucket 0))") != std::string::npos);
  CHECK(v.find("waiting for it in collective #17 (allreduce of the eval sums): rank 0") !=
        std::string::npos);
}

TEST_CASE("hang verdict: with a rank frozen, the live ranks in any collective wait for it") {
  // Rank 3 froze in collective #128; of its peers, the ring let ranks 0 and 1 finish #128 and
  // enter #129, while ranks 2 and 4 still wait in #128: all wait for rank 3, none is stuck.
  const auto in = [](int64_t seq, const char* what) {
    return json{{"step", 94}, {"phase", "collective"}, {"seq", seq}, {"collective", what}};
  };
  json frozen = in(128, "allreduce of gradient bucket 0");
  frozen["silent_ms"] = 5000;
  const std::map<int, json> beats = {{0, in(129, "allreduce of gradient bucket 1")},
                                     {1, in(129, "allreduce of gradient bucket 1")},
                                     {2, in(128, "allreduce of gradient bucket 0")},
                                     {3, frozen},
                                     {4, in(128, "allreduce of gradient bucket 0")}};
  const std::string v = HangWatch::describe(beats, std::chrono::seconds(5));
  INFO(v);
  CHECK(contains(v,
                 "stuck: rank 3 (its heartbeat stopped 5s ago: frozen or unreachable; it last "
                 "said step 94, in collective #128 (allreduce of gradient bucket 0)); waiting "
                 "for it in collective #129 (allreduce of gradient bucket 1): rank 0, rank 1; "
                 "and in collective #128 (allreduce of gradient bucket 0): rank 2, rank 4"));
  CHECK_FALSE(contains(v, "rank 2 at"));
  // A live rank in a collective before the frozen rank's last one is held up by something else:
  // the frozen rank had entered it, and left it.
  std::map<int, json> earlier = beats;
  earlier[3]["seq"] = 129;
  earlier[3]["collective"] = "allreduce of gradient bucket 1";
  const std::string e = HangWatch::describe(earlier, std::chrono::seconds(5));
  INFO(e);
  CHECK(contains(e, "stuck: rank 2 at step 94 in collective #128"));
  CHECK(contains(e, "rank 4 at step 94 in collective #128"));
  CHECK(contains(e,
                 "waiting for them in collective #129 (allreduce of gradient bucket 1): "
                 "rank 0, rank 1"));
  // With none frozen, a rank a collective behind the others is the one they wait for.
  std::map<int, json> live = beats;
  live[3] = in(128, "allreduce of gradient bucket 0");
  const std::string w = HangWatch::describe(live, std::chrono::seconds(5));
  INFO(w);
  CHECK(contains(w, "stuck: rank 2 at step 94 in collective #128"));
  CHECK(contains(w,
                 "waiting for them in collective #129 (allreduce of gradient bucket 1): "
                 "rank 0, rank 1"));
}

TEST_CASE("hang watch: a heartbeat that stands still is told from one that waits") {
  // Rank 0 waits in a collective (its heartbeat thread still sends); rank 1 was frozen.
  TcpStoreServer server;
  TcpStoreClient store("127.0.0.1", server.port(), std::chrono::seconds(5));
  const auto beat = [](int64_t seq, int64_t beats) {
    return json{{"step", 5},
                {"phase", "collective"},
                {"seq", seq},
                {"progress", 3},
                {"collective", "allreduce of the loss"},
                {"beat", beats}}
        .dump();
  };
  store.set(heartbeat_key(1), beat(11, 40));
  HangWatch watch(store, 2, std::chrono::milliseconds(500));
  // Before rank 1's silence passes kSilentAfter the verdict names it plainly; wait for more.
  const auto verdict = beat_until_verdict(
      store, watch, 1,
      [&](int64_t n) {
        return std::map<int, std::string>{{0, beat(12, n)}};
      },
      [](const std::string& v) { return v.find("heartbeat stopped") != std::string::npos; });
  REQUIRE(verdict.has_value());
  CHECK(verdict->find("rank 1 (its heartbeat stopped") != std::string::npos);
  CHECK(verdict->find("rank 0 (its heartbeat") == std::string::npos);
  CHECK(verdict->find("waiting for it in collective #12 (allreduce of the loss): rank 0") !=
        std::string::npos);
}

TEST_CASE("hang watch: a rank waiting in a collective while another progresses is no hang") {
  // A parameter server waits in the eval's all-reduce while the workers evaluate chunk after
  // chunk: past the timeout, no verdict. When the worker stops progressing (outside any
  // collective), the verdict comes.
  TcpStoreServer server;
  TcpStoreClient store("127.0.0.1", server.port(), std::chrono::seconds(5));
  const auto beat = [](const char* phase, int64_t progress, int64_t beats) {
    return json{{"step", 4},        {"phase", phase}, {"seq", 10}, {"progress", progress},
                {"collective", ""}, {"beat", beats}}
        .dump();
  };
  store.set(heartbeat_key(1), beat("collective", 7, 1));
  HangWatch watch(store, 2, std::chrono::milliseconds(1500));
  for (int64_t n = 1; n <= 30; ++n) {  // 3 s of eval chunks: twice the timeout
    store.set(heartbeat_key(0), beat("eval", 100 + n, n));
    store.set(heartbeat_key(1), beat("collective", 7, n));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    CHECK_FALSE(watch.check().has_value());
  }
  const auto verdict = beat_until_verdict(store, watch, 31, [&](int64_t n) {
    // Rank 0 is stuck in its chunk now.
    return std::map<int, std::string>{{0, beat("eval", 130, n)}, {1, beat("collective", 7, n)}};
  });
  REQUIRE(verdict.has_value());
  CHECK(verdict->find("rank 0 at step 4 in phase eval") != std::string::npos);
}

TEST_CASE("hang watch: a rank still starting is no hang while it beats; frozen, it counts") {
  // Rank 1 loads a large dataset (phase starting, heartbeat going on) for three times the
  // timeout while rank 0 waits for it in a collective: no verdict. Then rank 1 freezes: named.
  TcpStoreServer server;
  TcpStoreClient store("127.0.0.1", server.port(), std::chrono::seconds(5));
  const auto beat = [](const char* phase, int64_t beats) {
    return json{{"step", 0},     {"phase", phase},   {"seq", 1},
                {"progress", 0}, {"collective", ""}, {"beat", beats}}
        .dump();
  };
  HangWatch watch(store, 2, std::chrono::milliseconds(1000));
  for (int64_t n = 1; n <= 30; ++n) {
    store.set(heartbeat_key(0), beat("collective", n));
    store.set(heartbeat_key(1), beat("starting", n));
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    CHECK_FALSE(watch.check().has_value());
  }
  // Rank 1's beat stands still.
  const auto verdict = beat_until_verdict(store, watch, 31, [&](int64_t n) {
    return std::map<int, std::string>{{0, beat("collective", n)}};
  });
  REQUIRE(verdict.has_value());
  INFO(*verdict);
  CHECK(verdict->find("rank 1 (its heartbeat stopped") != std::string::npos);
  // Counted from its silence (over 3 s), not from its start (over 6 s before).
  REQUIRE(verdict->starts_with("hang: no progress for "));
  CHECK(std::stoi(verdict->substr(22)) < 6);
}

TEST_CASE("hang watch: ranks that all start, none waiting for another, count as any phase") {
  // Every rank loads from a filesystem that hangs (or there is one rank): no collective's
  // timeout bounds the start, so the hang timeout does.
  TcpStoreServer server;
  TcpStoreClient store("127.0.0.1", server.port(), std::chrono::seconds(5));
  const auto beat = [](int64_t beats) {
    return json{{"step", 0},     {"phase", "starting"}, {"seq", 0},
                {"progress", 0}, {"collective", ""},    {"beat", beats}}
        .dump();
  };
  HangWatch watch(store, 2, std::chrono::milliseconds(1000));
  const auto verdict = beat_until_verdict(store, watch, 1, [&](int64_t n) {
    return std::map<int, std::string>{{0, beat(n)}, {1, beat(n)}};
  });
  REQUIRE(verdict.has_value());
  CHECK(verdict->find("in phase starting") != std::string::npos);
}

TEST_CASE("hang verdict: several ranks behind are waited for as them") {
  const std::map<int, json> beats = {
      {0, {{"step", 9}, {"phase", "data"}, {"seq", 40}}},
      {1, {{"step", 9}, {"phase", "data"}, {"seq", 40}}},
      {2, {{"step", 9}, {"phase", "collective"}, {"seq", 41}, {"collective", "allgather"}}}};
  const std::string v = HangWatch::describe(beats, std::chrono::seconds(3));
  CHECK(v.find("; waiting for them in collective #41 (allgather): rank 2") != std::string::npos);
}

TEST_CASE("hang watch: a rank that never beats while the others wait to meet is named") {
  TcpStoreServer server;
  TcpStoreClient store("127.0.0.1", server.port(), std::chrono::seconds(5));
  HangWatch watch(store, 3, std::chrono::milliseconds(1500), {});
  watch.started({0, 1, 2});
  // Nobody has beaten yet: no verdict however long (the ranks may still be starting).
  for (int i = 0; i < 5; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(400));
    CHECK_FALSE(watch.check());
  }
  const auto verdict = beat_until_verdict(store, watch, 1, [&](int64_t n) {
    return std::map<int, std::string>{{0, starting(n)}, {2, starting(n)}};
  });
  REQUIRE(verdict.has_value());
  INFO(*verdict);
  // Read once a second: 1 or 2 s past the first beat.
  CHECK(verdict->find("stuck: rank 1 (no heartbeat in the ") != std::string::npos);
  CHECK(verdict->find("s the others waited: frozen, or unable to reach the store, before it "
                      "joined); waiting for it to join: rank 0, rank 2") != std::string::npos);
}

TEST_CASE("hang watch: a rank not yet started is not waited for; once started, from then") {
  TcpStoreServer server;
  TcpStoreClient store("127.0.0.1", server.port(), std::chrono::seconds(5));
  // Ranks 0 and 1 on hosts whose agents started them; rank 2's host is still being reached.
  HangWatch watch(store, 3, std::chrono::milliseconds(1500), {});
  watch.started({0, 1});
  int64_t n = 0;
  for (int i = 0; i < 12; ++i, ++n) {
    store.set(heartbeat_key(0), starting(n));
    store.set(heartbeat_key(1), starting(n));
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    CHECK_FALSE(watch.check());
  }
  // Its agent starts it 3 s after the others first beat: the wait counts from now.
  const auto started = std::chrono::steady_clock::now();
  watch.started({2});
  const auto verdict = beat_until_verdict(store, watch, n, [&](int64_t beat) {
    return std::map<int, std::string>{{0, starting(beat)}, {1, starting(beat)}};
  });
  REQUIRE(verdict.has_value());
  INFO(*verdict);
  CHECK(std::chrono::steady_clock::now() - started >= std::chrono::milliseconds(1500));
  CHECK(verdict->find("stuck: rank 2 (no heartbeat in the ") != std::string::npos);
  CHECK(verdict->find("waiting for it to join: rank 0, rank 1") != std::string::npos);
}
