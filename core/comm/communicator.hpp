// Communicator: the collectives the trainer needs, implemented by the gloo and nccl backends.
#pragma once

#include <cstddef>
#include <string>

namespace dptrain {

enum class ReduceOp { sum, avg, max, min };

// "sum", "avg", "max", "min".
const char* reduce_op_name(ReduceOp op);

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
  virtual std::string backend() const = 0;  // "gloo"
  // In place: on return every rank holds the reduction of all ranks' `data`.
  virtual void allreduce(float* data, size_t count, ReduceOp op) = 0;
  virtual void allreduce(double* data, size_t count, ReduceOp op) = 0;
  // Copies `bytes` at `data` on rank `root` into `data` on every rank.
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
  // `out` holds size() * bytes_per_rank bytes: rank r's `in` lands at offset r * bytes_per_rank.
  virtual void allgather(const void* in, size_t bytes_per_rank, void* out) = 0;
  virtual void barrier() = 0;
};

}  // namespace dptrain
