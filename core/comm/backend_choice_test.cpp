#include "core/comm/backend_choice.hpp"

#include <doctest/doctest.h>

#include <functional>
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

// One thread per rank, each with its world size and its reason not to use NCCL ("" = it can).
std::vector<Outcome> agree(const std::vector<int>& worlds, const std::vector<std::string>& why_not,
                           bool required, std::chrono::milliseconds timeout = 20s) {
  TcpStoreServer server;
  std::vector<Outcome> out(worlds.size());
  std::vector<std::thread> ranks;
  for (size_t r = 0; r < worlds.size(); ++r) {
    ranks.emplace_back([&, r] {
      TcpStoreClient client("127.0.0.1", server.port(), 10s);
      PrefixStore store("gen1", client);
      try {
        out[r].choice =
            agree_on_backend(store, static_cast<int>(r), worlds[r], required, why_not[r], timeout);
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

TEST_CASE("backend choice: nccl when every rank can use it") {
  for (const bool required : {false, true}) {
    for (const Outcome& o : agree({3, 3, 3}, {"", "", ""}, required)) {
      CHECK(o.error.empty());
      CHECK(o.choice.backend == "nccl");
    }
  }
}

TEST_CASE("backend choice: one rank without NCCL moves every rank to gloo, naming it") {
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

TEST_CASE("backend choice: with nccl required, a rank without it fails every rank, naming it") {
  const auto out = agree({3, 3, 3}, {"", "no libnccl.so.2", ""}, true);
  for (const Outcome& o : out)
    CHECK(o.kind == ErrorKind::comm);
  CHECK(out[0].error == "rank 0: backend nccl: rank 1 cannot use NCCL: no libnccl.so.2");
  CHECK(out[1].error == "rank 1: backend nccl: no libnccl.so.2");
  CHECK(out[2].error == "rank 2: backend nccl: rank 1 cannot use NCCL: no libnccl.so.2");
}

TEST_CASE("backend choice: with nccl required, rank 0 without it fails every rank at once") {
  const auto out = agree({3, 3, 3}, {"no GPU", "", ""}, true, 30s);
  CHECK(out[0].error == "rank 0: backend nccl: no GPU");
  CHECK(out[1].error == "rank 1: backend nccl: rank 0 cannot use NCCL: no GPU");
  CHECK(out[2].error == "rank 2: backend nccl: rank 0 cannot use NCCL: no GPU");
}

TEST_CASE("backend choice: ranks given different world sizes are told so") {
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

TEST_CASE("backend choice: a rank that never comes is named after the timeout, on every rank") {
  const auto out = agree({3, 3}, {"", ""}, false, 300ms);
  CHECK(out[0].kind == ErrorKind::comm);
  CHECK(out[0].error.starts_with(
      "rank 0: rank 2 of 3 did not join within 0.3s (nothing from it at store 127.0.0.1:"));
  CHECK(out[0].error.ends_with("); start every rank with the same store and world size"));
  CHECK(out[1].kind == ErrorKind::comm);
  CHECK(out[1].error.starts_with(
      "rank 1: rank 2 of 3 did not join within 0.3s (rank 0 waited for it at store 127.0.0.1:"));
}

}  // namespace
}  // namespace dptrain
