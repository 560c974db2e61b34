// Tests for the NCCL Communicator that need no GPU: where NCCL cannot be used it says why, at
// once, and tells the other ranks through the store. (tests/gpu/nccl_test.cpp runs collectives.)
#include <doctest/doctest.h>

#include <chrono>
#include <filesystem>
#include <string>

#include "core/comm/nccl_communicator.hpp"
#include "core/comm/tcp_store.hpp"
#include "core/error.hpp"

namespace dptrain {
namespace {

using namespace std::chrono_literals;

// No NVIDIA device nodes: no CUDA device can be visible, whatever the build.
bool machine_has_no_gpu() {
  return !std::filesystem::exists("/dev/nvidiactl") && !std::filesystem::exists("/dev/nvidia0");
}

TEST_CASE("nccl_unavailable_reason: on a machine without a GPU it says why, the same each time") {
  if (!machine_has_no_gpu()) {
    MESSAGE("this machine has NVIDIA devices: the GPU tests cover NCCL here");
    return;
  }
  const auto reason = nccl_unavailable_reason();
  REQUIRE(reason.has_value());
  CHECK_MESSAGE(
      (reason->find("no CUDA device is visible") == 0 || *reason == "this build has no CUDA"),
      *reason);
  CHECK(nccl_unavailable_reason() == reason);
}

TEST_CASE(
    "make_nccl_communicator: without NCCL, Error(comm) naming the rank and the reason, at "
    "once") {
  const auto reason = nccl_unavailable_reason();
  if (!reason) {
    MESSAGE("NCCL is usable here: the GPU tests cover it");
    return;
  }
  TcpStoreServer server;
  TcpStoreClient client("127.0.0.1", server.port(), 10s);
  for (int rank : {0, 1}) {
    CAPTURE(rank);
    PrefixStore store("gen1", client);
    NcclOptions options;  // the default 300 s timeout: nothing may wait for it
    const auto start = std::chrono::steady_clock::now();
    try {
      make_nccl_communicator(store, rank, 2, options);
      FAIL("a communicator was made");
    } catch (const Error& error) {
      CHECK(error.kind() == ErrorKind::comm);
      const std::string message = error.what();
      CHECK_MESSAGE(
          message.rfind("rank " + std::to_string(rank) + ": NCCL cannot be used: ", 0) == 0,
          message);
      CHECK_MESSAGE(message.find(*reason) != std::string::npos, message);
    }
    CHECK(std::chrono::steady_clock::now() - start < 5s);
  }
  // Rank 0 left the reason where the others look for NCCL's id, so none of them waits for it.
  const std::string published = client.get("gen1/nccl/unique_id", 1s);
  CHECK(published.rfind("error:", 0) == 0);
  CHECK(published.find(*reason) != std::string::npos);
}

TEST_CASE("make_nccl_communicator: a rank outside the world is a usage error") {
  TcpStoreServer server;
  TcpStoreClient client("127.0.0.1", server.port(), 10s);
  PrefixStore store("gen1", client);
  CHECK_THROWS_WITH_AS(make_nccl_communicator(store, 2, 2, NcclOptions{}),
                       doctest::Contains("rank 2 does not fit a world of size 2"), Error);
  CHECK_THROWS_WITH_AS(make_nccl_communicator(store, 0, 0, NcclOptions{}),
                       doctest::Contains("does not fit a world of size 0"), Error);
}

}  // namespace
}  // namespace dptrain
