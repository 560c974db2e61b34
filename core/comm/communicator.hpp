// Communicator: the collectives the trainer needs, implemented by the gloo and nccl backends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "core/error.hpp"
#include "core/tensor/half.hpp"

namespace dptrain {

// What a rank's communication error adds where a peer closed or reset its connection: it only
// followed a peer that had gone (the launcher ranks such a failure below the peer's own).
inline constexpr std::string_view kPeerGoneNote = "a peer rank has exited or was killed";

enum class ReduceOp { sum, avg, max, min };

// "sum", "avg", "max", "min".
const char* reduce_op_name(ReduceOp op);

// What ranks started with different world sizes (by hand, srun) are told, the same by every
// backend's rendezvous: "rank OTHER was started with another world size than WHOSE WORLD (it was
// given GIVEN): ...". GIVEN < 0: what OTHER posted (`posted`: "address", "answer") carries no
// world size, so it runs another version of dptrain.
std::string world_size_mismatch(int other, const char* whose, int world, int64_t given,
                                const char* posted);

// One rank's handle on a group of `size()` ranks. Every rank must call the same collectives in the
// same order with the same counts. Calls are not thread-safe: one thread at a time per
// communicator. Failures (a peer that died, a timeout) throw Error(ErrorKind::comm) naming the rank
// and operation; after one the communicator is unusable and must be rebuilt (a new generation).
// Results are bit-identical on every rank and on every run with the same inputs and size.
class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string backend() const = 0;  // "gloo" or "nccl"
  // Whether the collectives take device memory (NCCL: CUDA device pointers, and host pointers
  // too, staged through the device). Gloo takes host memory only.
  virtual bool device_memory() const { return false; }
  // A device communicator orders each collective after all the work queued on its op table's
  // stream when the collective is called. A caller on another thread, while that stream is still
  // being fed (the gradient exchange during the backward pass), names what its data waits for
  // instead: the next collective waits only for `marker`, an Ops::Marker's handle() recorded
  // after the data's producers. Null, or a host communicator: nothing changes.
  virtual void start_after(void* /*marker*/) {}
  // In place: on return every rank holds the reduction of all ranks' `data`.
  virtual void allreduce(float* data, size_t count, ReduceOp op) = 0;
  virtual void allreduce(double* data, size_t count, ReduceOp op) = 0;
  // The 16-bit floats, and reduce_scatter below, came after the first backend: one without them
  // throws Error(internal) naming the call.
  virtual void allreduce(Half*, size_t, ReduceOp) { unsupported("allreduce of half"); }
  virtual void allreduce(BFloat16*, size_t, ReduceOp) { unsupported("allreduce of bfloat16"); }
  // `in` holds size() * count_per_rank elements; on return `out` (count_per_rank elements, not
  // overlapping `in`) holds the reduction over every rank's `in` of the slice
  // [rank() * count_per_rank, (rank() + 1) * count_per_rank).
  virtual void reduce_scatter(const float*, float*, size_t, ReduceOp) {
    unsupported("reduce_scatter of float");
  }
  virtual void reduce_scatter(const double*, double*, size_t, ReduceOp) {
    unsupported("reduce_scatter of double");
  }
  virtual void reduce_scatter(const Half*, Half*, size_t, ReduceOp) {
    unsupported("reduce_scatter of half");
  }
  virtual void reduce_scatter(const BFloat16*, BFloat16*, size_t, ReduceOp) {
    unsupported("reduce_scatter of bfloat16");
  }
  // Point-to-point messages (the parameter-server mode), posted without blocking and completed by
  // Request::wait(). A send completes once `peer` has posted a receive with the same tag and the
  // bytes have moved; messages from one rank to another with one tag arrive in the order they
  // were posted. Sizes must match exactly. Tags are the caller's and never match a collective's.
  // The buffer belongs to the request until wait() returns; destroying a request that was not
  // waited for waits for it (ignoring errors), unless the communicator has failed already (then
  // the transfer is abandoned: it may never finish). wait() throws Error(comm) naming the peer when
  // the peer fails or the communicator's timeout passes. Host memory only.
  class Request {
   public:
    virtual ~Request() = default;
    virtual void wait() = 0;
  };
  virtual std::unique_ptr<Request> isend(const void*, size_t, int, uint32_t) {
    unsupported("isend");
  }
  virtual std::unique_ptr<Request> irecv(void*, size_t, int, uint32_t) { unsupported("irecv"); }
  // Blocks until a message with `tag` from one of `peers` has arrived in `data`; returns its
  // sender. Messages from one peer arrive in order.
  virtual int recv_any(void*, size_t, const std::vector<int>&, uint32_t) {
    unsupported("recv_any");
  }
  // Copies `bytes` at `data` on rank `root` into `data` on every rank.
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
  // `out` holds size() * bytes_per_rank bytes: rank r's `in` lands at offset r * bytes_per_rank.
  virtual void allgather(const void* in, size_t bytes_per_rank, void* out) = 0;
  virtual void barrier() = 0;

 private:
  // The collectives a backend added later may lack: a clear error rather than a wrong result.
  [[noreturn]] void unsupported(const char* what) const {
    throw Error(ErrorKind::internal,
                std::string(what) + " is not supported by the " + backend() + " communicator");
  }
};

}  // namespace dptrain
