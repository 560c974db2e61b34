#include "core/comm/start_agreement.hpp"

#include <doctest/doctest.h>
#include <fmt/format.h>

#include <unistd.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "core/comm/tcp_store.hpp"
#include "core/error.hpp"

namespace dptrain {
namespace {

using namespace std::chrono_literals;

struct Outcome {
  BackendChoice choice;
  std::string error;  // empty: it chose
  ErrorKind kind = ErrorKind::internal;
};

// One thread per rank, each with its world size and its reason not to use NCCL ("" = it can); a
// rank with a `refusals` entry cannot start and posts that instead.
std::vector<Outcome> agree(const std::vector<int>& worlds, const std::vector<std::string>& why_not,
                           bool required, std::chrono::milliseconds timeout = 20s,
                           const std::vector<std::optional<Error>>& refusals = {}) {
  TcpStoreServer server;
  std::vector<Outcome> out(worlds.size());
  std::vector<std::thread> ranks;
  for (size_t r = 0; r < worlds.size(); ++r) {
    ranks.emplace_back([&, r] {
      TcpStoreClient client("127.0.0.1", server.port(), 10s);
      PrefixStore store("gen1", client);
      try {
        if (r < refusals.size() && refusals[r]) {
          refuse_to_start(store, static_cast<int>(r), worlds[r], *refusals[r]);
          throw *refusals[r];
        }
        out[r].choice =
            agree_to_start(store, static_cast<int>(r), worlds[r], required, why_not[r], timeout);
      } catch (const Error& e) {
        out[r].error = e.what();
        out[r].kind = e.kind();
      }
    });
  }
  for (auto& t : ranks)
    t.join();
  return out;
}

TEST_CASE("start agreement: nccl when every rank can use it") {
  for (const bool required : {false, true}) {
    for (const Outcome& o : agree({3, 3, 3}, {"", "", ""}, required)) {
      CHECK(o.error.empty());
      CHECK(o.choice.backend == "nccl");
    }
  }
}

TEST_CASE("start agreement: one rank without NCCL moves every rank to gloo, naming it") {
  for (const Outcome& o : agree({3, 3, 3}, {"", "", "no libnccl.so.2"}, false)) {
    CHECK(o.error.empty());
    CHECK(o.choice.backend == "gloo");
    CHECK(o.choice.rank == 2);
    CHECK(o.choice.why_not == "no libnccl.so.2");
  }
  // The first of several is named.
  for (const Outcome& o : agree({3, 3, 3}, {"", "no GPU", "no libnccl.so.2"}, false)) {
    CHECK(o.choice.rank == 1);
    CHECK(o.choice.why_not == "no GPU");
  }
}

TEST_CASE("start agreement: with nccl required, a rank without it fails every rank, naming it") {
  const auto out = agree({3, 3, 3}, {"", "no libnccl.so.2", ""}, true);
  for (const Outcome& o : out)
    CHECK(o.kind == ErrorKind::comm);
  CHECK(out[0].error == "rank 0: backend nccl: rank 1 cannot use NCCL: no libnccl.so.2");
  CHECK(out[1].error == "rank 1: backend nccl: no libnccl.so.2");
  CHECK(out[2].error == "rank 2: backend nccl: rank 1 cannot use NCCL: no libnccl.so.2");
}

TEST_CASE("start agreement: with nccl required, rank 0 without it fails every rank at once") {
  const auto out = agree({3, 3, 3}, {"no GPU", "", ""}, true, 30s);
  CHECK(out[0].error == "rank 0: backend nccl: no GPU");
  CHECK(out[1].error == "rank 1: backend nccl: rank 0 cannot use NCCL: no GPU");
  CHECK(out[2].error == "rank 2: backend nccl: rank 0 cannot use NCCL: no GPU");
}

TEST_CASE("start agreement: ranks given different world sizes are told so") {
  const auto out = agree({2, 3, 3}, {"", "", ""}, false);
  for (const Outcome& o : out)
    CHECK(o.kind == ErrorKind::usage);
  CHECK(out[0].error ==
        "rank 0: rank 1 was started with another world size than this rank's 2 (it was given "
        "3): start every rank with the same world size");
  CHECK(out[1].error ==
        "rank 1: rank 0 was started with another world size than this rank's 3 (it was given "
        "2): start every rank with the same world size");
  CHECK(out[2].error == out[1].error.substr(0, 5) + "2" + out[1].error.substr(6));
  // Rank 0's larger world: rank 0 finds the first rank that differs.
  const auto larger = agree({3, 3, 2}, {"", "", ""}, false);
  CHECK(larger[0].error ==
        "rank 0: rank 2 was started with another world size than this rank's 3 (it was given "
        "2): start every rank with the same world size");
  CHECK(larger[1].error ==
        "rank 1: rank 2 was started with another world size than rank 0's 3 (it was given 2): "
        "start every rank with the same world size");
}

TEST_CASE("start agreement: a rank that never comes is named after the timeout, on every rank") {
  const auto out = agree({3, 3}, {"", ""}, false, 300ms);
  CHECK(out[0].kind == ErrorKind::comm);
  CHECK(out[0].error.starts_with(
      "rank 0: rank 2 of 3 did not join within 0.3s (nothing from it at store 127.0.0.1:"));
  // 0.3 s is shorter than a rank may take to start: the hint names the recipe's timeout too.
  CHECK(out[0].error.ends_with(
      "); start every rank with the same store and world size, or give "
      "them longer than 0.3s to start (distributed.timeout_s, or a worker's --timeout)"));
  CHECK(out[1].kind == ErrorKind::comm);
  CHECK(out[1].error.starts_with(
      "rank 1: rank 2 of 3 did not join within 0.3s (rank 0 waited for it at store 127.0.0.1:"));
}

TEST_CASE("start agreement: rank 0 says whom it waits for, every `every`, until the timeout") {
  // Of 4 ranks, 1 and 3 never come: rank 0 names them (and the 2 here) at each 200 ms, then
  // fails at its 700 ms timeout as it would have without.
  TcpStoreServer server;
  std::vector<JoinWait> told;
  std::string error0, error2;
  std::thread rank2([&] {
    TcpStoreClient client("127.0.0.1", server.port(), 10s);
    PrefixStore store("gen1", client);
    try {
      agree_to_start(store, 2, 4, false, "", 700ms);
    } catch (const Error& e) {
      error2 = e.what();
    }
  });
  {
    TcpStoreClient client("127.0.0.1", server.port(), 10s);
    PrefixStore store("gen1", client);
    store.get("backend/nccl/2", 10s);  // rank 2 has answered: every word counts it
    try {
      agree_to_start(
          store, 0, 4, false, "", 700ms, [&told](const JoinWait& w) { told.push_back(w); }, 200ms);
    } catch (const Error& e) {
      error0 = e.what();
    }
  }
  rank2.join();
  CHECK(error0.starts_with("rank 0: rank 1 of 4 did not join within 0.7s"));
  CHECK(error2.starts_with("rank 2: rank 1 of 4 did not join within 0.7s"));
  REQUIRE(told.size() == 3);
  for (size_t i = 0; i < told.size(); ++i) {
    CAPTURE(i);
    CHECK(told[i].missing == std::vector<int>{1, 3});
    CHECK(told[i].missing_count == 2);
    CHECK(told[i].joined == 2);
    CHECK(told[i].looked == 4);
    CHECK(told[i].waited >= std::chrono::milliseconds(200 * (i + 1) - 20));  // a clock tick
  }
}

TEST_CASE("start agreement: a rank that cannot start fails every rank at once, naming it") {
  // Rank 2 (its run directory holds checkpoints): the others learn it rather than wait for the
  // timeout, with its error's kind (exit 2).
  const Error held(ErrorKind::usage, "rank 2: --run-dir run: holds checkpoints");
  auto out = agree({3, 3, 3}, {"", "", ""}, false, 60s, {std::nullopt, std::nullopt, held});
  for (const int r : {0, 1}) {
    CHECK(out[r].kind == ErrorKind::usage);
    CHECK(out[r].error ==
          fmt::format("rank {}: rank 2 cannot start: --run-dir run: holds checkpoints", r));
  }
  // Rank 0's refusal is the choice: the others do not wait for any rank.
  const Error recipe(ErrorKind::recipe, "r.json: /train/steps: must be at least 1");
  out = agree({3, 3, 3}, {"", "", ""}, true, 60s, {recipe});
  for (const int r : {1, 2}) {
    CHECK(out[r].kind == ErrorKind::recipe);
    CHECK(out[r].error ==
          fmt::format("rank {}: rank 0 cannot start: r.json: /train/steps: must be at least 1", r));
  }
  // Every rank refusing (one recipe file for all): each says its own.
  out = agree({2, 2}, {"", ""}, false, 60s, {recipe, recipe});
  CHECK(out[0].error == recipe.what());
  CHECK(out[1].error == recipe.what());
}

TEST_CASE("start agreement: rank 0 serving the store waits for the others to be told, no longer") {
  TcpStoreServer server;
  TcpStoreClient client("127.0.0.1", server.port(), 10s);
  PrefixStore store("gen1", client);
  // Nobody else: it waits its bound, then goes.
  wait_until_told(store, 2, 200ms);
  refuse_to_start(store, 0, 2, Error(ErrorKind::usage, "no"));
  std::string told;
  std::thread rank1([&] {
    TcpStoreClient other("127.0.0.1", server.port(), 10s);
    PrefixStore gen("gen1", other);
    try {
      agree_to_start(gen, 1, 2, false, "", 10s);
    } catch (const Error& e) {
      told = e.what();
    }
  });
  // Once rank 1 has read why, rank 0 need not wait: well within the 60 s bound.
  wait_until_told(store, 2, 60s);
  rank1.join();
  CHECK(told == "rank 1: rank 0 cannot start: no");
  CHECK(store.check({"backend/told/1"}));
}

TEST_CASE("start agreement: a second process with one rank's number is told at once") {
  TcpStoreServer server;
  std::vector<std::string> errors(3);
  std::vector<std::thread> ranks;
  const auto start = [&](int rank, size_t i) {
    return std::thread([&, rank, i] {
      TcpStoreClient client("127.0.0.1", server.port(), 10s);
      PrefixStore store("gen1", client);
      try {
        agree_to_start(store, rank, 2, false, "", 20s);
      } catch (const Error& e) {
        errors[i] = e.kind() == ErrorKind::usage ? e.what() : std::string("wrong kind");
      }
    });
  };
  // Rank 1 started twice while rank 0 is not there yet (the first one stopped, say): no reason
  // to refuse either. Then rank 0.
  {
    TcpStoreClient client("127.0.0.1", server.port(), 10s);
    PrefixStore store("gen1", client);
    store.set("backend/nccl/1", "2 ok");  // an earlier rank 1's answer, left behind
  }
  ranks.push_back(start(1, 1));
  ranks.push_back(start(0, 0));
  for (auto& t : ranks)
    t.join();
  CHECK(errors[0].empty());
  CHECK(errors[1].empty());
  // Once rank 1 runs the job, another process given rank 1 is told at once.
  std::thread late = start(1, 2);
  late.join();
  CHECK(
      errors[2].starts_with("rank 1: another process (pid " + std::to_string(::getpid()) + " on "));
  CHECK(errors[2].find("joined this job as rank 1 already and runs it (at store 127.0.0.1:") !=
        std::string::npos);
}

TEST_CASE("peer failures: a rank's own failure is named to the peers it leaves") {
  TcpStoreServer server;
  TcpStoreClient client("127.0.0.1", server.port(), 10s);
  PrefixStore store("gen1", client);
  CHECK_FALSE(peer_failure(store, 0, 3, false));  // none posted
  CHECK(store.check({"heard/0"}));
  report_failure(store, 2, Error(ErrorKind::recipe, "rank 2: d.csv:402: 1 features"));
  // Before the first step: its kind, "cannot start"; after it: a communication error.
  auto before = peer_failure(store, 1, 3, false);
  REQUIRE(before);
  CHECK(before->kind() == ErrorKind::recipe);
  CHECK(std::string(before->what()) == "rank 1: rank 2 cannot start: d.csv:402: 1 features");
  auto after = peer_failure(store, 0, 3, true);
  REQUIRE(after);
  CHECK(after->kind() == ErrorKind::comm);
  CHECK(std::string(after->what()) == "rank 0: rank 2 failed: d.csv:402: 1 features");
  // Its own post is not a peer's.
  CHECK_FALSE(peer_failure(store, 2, 3, false));
  // Every other rank has looked: rank 0 need not wait.
  wait_until_heard(store, 3, 60s);
}

TEST_CASE("peer failures: rank 0 waits for no word from peers known to be gone") {
  TcpStoreServer server;
  TcpStoreClient client("127.0.0.1", server.port(), 10s);
  PrefixStore store("gen1", client);
  report_failure(store, 0, Error(ErrorKind::recipe, "rank 0: d.csv:402: 1 features"));
  CHECK(peer_failure(store, 2, 3, true));  // rank 2 looked; rank 1's heartbeat stood still
  // Bound against a hang: waiting for rank 1 would take the whole 120 s.
  const auto t0 = std::chrono::steady_clock::now();
  wait_until_heard(store, 3, 120s, {1});
  CHECK(std::chrono::steady_clock::now() - t0 < 60s);
}

TEST_CASE(
    "start agreement: rank 0 that waited out the answers waits only for ranks that gave one") {
  TcpStoreServer server;
  TcpStoreClient client("127.0.0.1", server.port(), 10s);
  PrefixStore store("gen1", client);
  // Of ranks 1 and 2, rank 2 answered and has been told; rank 1 never answered.
  store.set("backend/nccl/2", "3 ok");
  store.set("backend/told/2", "1");
  // Bound against a hang: waiting for rank 1 would take the whole 120 s.
  const auto t0 = std::chrono::steady_clock::now();
  wait_until_told(store, 3, 120s, /*answered_only=*/true);
  CHECK(std::chrono::steady_clock::now() - t0 < 60s);
}

TEST_CASE(
    "generations: a newer one is refused as a rank starts, an older one only once it waited") {
  TcpStoreServer server;
  TcpStoreClient root("127.0.0.1", server.port(), 10s);
  // Rank 0 of generation 2 serves the store; rank 1 came with generation 1, rank 2 with 3.
  say_generation(root, 0, 2);
  say_generation(root, 1, 1);
  // As it starts, rank 0 takes no older generation for a cause (a late rank of a dead one)...
  CHECK_FALSE(other_generation(root, 0, 2, 2, false));
  // ...but it does once its wait ran out; rank 1 sees rank 0's newer one at once.
  const auto waited = other_generation(root, 0, 2, 2, true);
  REQUIRE(waited);
  CHECK(waited->rank == 1);
  CHECK(waited->generation == 1);
  const auto newer = other_generation(root, 1, 2, 1, false);
  REQUIRE(newer);
  CHECK(newer->rank == 0);
  CHECK(newer->generation == 2);
  // Rank 0 looks at every rank's key, and the shared one (the last to come).
  say_generation(root, 2, 3);
  const auto found = other_generation(root, 0, 3, 2, false);
  REQUIRE(found);
  CHECK(found->rank == 2);
  CHECK(found->generation == 3);
  // Garbage under a key is no generation (the shared key holds rank 2's 3, this rank's here).
  root.set("generation/1", "x y");
  CHECK_FALSE(other_generation(root, 0, 2, 3, true));
}

TEST_CASE("generations: a refusal goes to its own generation, and to the other only if older") {
  TcpStoreServer server;
  TcpStoreClient root("127.0.0.1", server.port(), 10s);
  PrefixStore gen1("gen1", root), gen2("gen2", root);
  // Rank 1 of generation 1 found rank 0's newer 2: its own generation learns it, generation 2
  // (perhaps the live one, this rank a late one of a dead generation) does not.
  const Error refusal =
      refuse_other_generation(root, 1, 2, 1, "the default", {0, 2}, /*serves_store=*/false);
  CHECK(refusal.kind() == ErrorKind::usage);
  CHECK(std::string(refusal.what()) ==
        "rank 0 was started with generation 2, rank 1 with 1 (from the default): start every "
        "rank with the same generation");
  CHECK(gen1.check({"backend/nccl/1"}));
  CHECK_FALSE(gen2.check({"backend/nccl/1"}));
  // Rank 0 serving the store tells the other generation too, as does a rank of the newer one.
  refuse_other_generation(root, 0, 2, 1, "DPTRAIN_GENERATION", {1, 2}, /*serves_store=*/true);
  CHECK(gen2.check({"backend/choice"}));
  CHECK(gen1.check({"backend/choice"}));
}

}  // namespace
}  // namespace dptrain
