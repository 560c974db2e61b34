// Runs code on N Gloo ranks in threads of this process, over a real TcpStoreServer on 127.0.0.1:
// the harness of the communicator and collective-benchmark unit tests.
#pragma once

#include <doctest/doctest.h>

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/comm/gloo_communicator.hpp"
#include "core/comm/tcp_store.hpp"

namespace dptrain::test {

// Passes every collective on to `inner`: tests derive from it and override what they corrupt.
class ForwardingCommunicator : public Communicator {
 public:
  explicit ForwardingCommunicator(std::unique_ptr<Communicator> inner) : inner_(std::move(inner)) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string backend() const override { return inner_->backend(); }
  void allreduce(float* data, size_t count, ReduceOp op) override {
    inner_->allreduce(data, count, op);
  }
  void allreduce(double* data, size_t count, ReduceOp op) override {
    inner_->allreduce(data, count, op);
  }
  void allreduce(Half* data, size_t count, ReduceOp op) override {
    inner_->allreduce(data, count, op);
  }
  void allreduce(BFloat16* data, size_t count, ReduceOp op) override {
    inner_->allreduce(data, count, op);
  }
  void reduce_scatter(const float* in, float* out, size_t count, ReduceOp op) override {
    inner_->reduce_scatter(in, out, count, op);
  }
  void reduce_scatter(const double* in, double* out, size_t count, ReduceOp op) override {
    inner_->reduce_scatter(in, out, count, op);
  }
  void reduce_scatter(const Half* in, Half* out, size_t count, ReduceOp op) override {
    inner_->reduce_scatter(in, out, count, op);
  }
  void reduce_scatter(const BFloat16* in, BFloat16* out, size_t count, ReduceOp op) override {
    inner_->reduce_scatter(in, out, count, op);
  }
  std::unique_ptr<Request> isend(const void* data, size_t bytes, int peer, uint32_t tag) override {
    return inner_->isend(data, bytes, peer, tag);
  }
  std::unique_ptr<Request> irecv(void* data, size_t bytes, int peer, uint32_t tag) override {
    return inner_->irecv(data, bytes, peer, tag);
  }
  int recv_any(void* data, size_t bytes, const std::vector<int>& peers, uint32_t tag) override {
    return inner_->recv_any(data, bytes, peers, tag);
  }
  void broadcast(void* data, size_t bytes, int root) override {
    inner_->broadcast(data, bytes, root);
  }
  void allgather(const void* in, size_t bytes, void* out) override {
    inner_->allgather(in, bytes, out);
  }
  void barrier() override { inner_->barrier(); }
  void start_after(void* marker) override { inner_->start_after(marker); }

 private:
  std::unique_ptr<Communicator> inner_;
};

// Puts a communicator in front of Gloo's (a corrupting one, for tests of the checks).
using WrapCommunicator =
    std::function<std::unique_ptr<Communicator>(std::unique_ptr<Communicator>)>;

// Runs body(communicator) on `size` ranks, each a thread with its own store client, and fails
// the test with the first rank's error.
inline void run_ranks(int size, const std::function<void(Communicator&)>& body,
                      const WrapCommunicator& wrap = {},
                      std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
  TcpStoreServer server;
  std::mutex failure_mutex;
  std::string failure;
  std::vector<std::thread> ranks;
  for (int rank = 0; rank < size; ++rank) {
    ranks.emplace_back([&, rank] {
      try {
        TcpStoreClient client("127.0.0.1", server.port(), std::chrono::seconds(10));
        PrefixStore store("gen1", client);
        GlooOptions options;
        options.timeout = timeout;
        auto comm = make_gloo_communicator(store, rank, size, options);
        CHECK(comm->rank() == rank);
        CHECK(comm->size() == size);
        if (wrap) comm = wrap(std::move(comm));
        body(*comm);
      } catch (const std::exception& error) {
        std::lock_guard lock(failure_mutex);
        if (failure.empty()) failure = error.what();
      }
    });
  }
  for (auto& rank : ranks)
    rank.join();
  REQUIRE_MESSAGE(failure.empty(), failure);
}

}  // namespace dptrain::test
