// The GPU Communicator over NCCL (loaded at run time), with rendezvous through our Store.
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include "core/comm/communicator.hpp"
#include "core/comm/store.hpp"

namespace dptrain {

struct NcclOptions {
  // The rendezvous (the store get and NCCL's init) and every collective. A collective still
  // running at its deadline aborts the communicator: no rank hangs.
  std::chrono::milliseconds timeout{300000};
  int device = 0;  // the CUDA device this rank uses
  // The cudaStream_t of the op table the data comes from: each collective starts after the work
  // queued on it and work queued on it afterwards starts after the collective. Null: the legacy
  // default stream.
  void* compute_stream = nullptr;
};

// Why NCCL cannot be used in this process ("this build has no CUDA", "no CUDA device is visible",
// "libnccl.so.2 could not be loaded: <dlerror>", a library older than 2.18), or nullopt when it
// can. NCCL is loaded with dlopen: from env DPTRAIN_NCCL_LIBRARY when set, else libnccl.so.2 on
// the library path. Never throws; the library is looked for once per process.
std::optional<std::string> nccl_unavailable_reason();

// One rank's NCCL communicator on one device. Collectives take CUDA device pointers on that
// device, or host pointers (small values: a loss, a checksum), which are staged through a device
// buffer. Each call waits on the host until the collective is done (polling NCCL for errors):
// a failure or a timeout aborts the communicator and throws Error(comm) naming the rank, the
// operation and the cause; every later call then refuses to run. Not thread-safe, like every
// Communicator; any thread may call it (each call makes its device current on that thread).
class NcclCommunicator : public Communicator {
 public:
  // Rendezvous through `store` (a per-generation PrefixStore; it must outlive only this call):
  // rank 0 publishes NCCL's unique id, the others read it. Error(comm) naming this rank and the
  // cause when NCCL is unavailable (at once, see nccl_unavailable_reason), when the id does not
  // come within the timeout, or when NCCL's init fails or times out.
  NcclCommunicator(Store& store, int rank, int size, const NcclOptions& options);
  // Finalizes the communicator (waiting up to the timeout) or, after an error, aborts it.
  // Never throws.
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "nccl"; }
  bool device_memory() const override { return true; }
  // The next collective's stream waits for this cudaEvent_t (recorded on the compute stream)
  // instead of an event recorded on the compute stream when it is called. The event is the
  // caller's; a call that fails before the collective starts forgets it too.
  void start_after(void* marker) override;
  // "nccl 2.28.9 on cuda:0": the library that was loaded and the device.
  std::string describe() const;

  // ReduceOp::avg is NCCL's: each value is multiplied by 1/size() (rounded) before the sum, so
  // with a size that is not a power of two it can differ from sum / size() in the last places.
  void allreduce(float* data, size_t count, ReduceOp op) override;
  void allreduce(double* data, size_t count, ReduceOp op) override;
  void allreduce(Half* data, size_t count, ReduceOp op) override;
  void allreduce(BFloat16* data, size_t count, ReduceOp op) override;
  void reduce_scatter(const float* in, float* out, size_t count_per_rank, ReduceOp op) override;
  void reduce_scatter(const double* in, double* out, size_t count_per_rank, ReduceOp op) override;
  void reduce_scatter(const Half* in, Half* out, size_t count_per_rank, ReduceOp op) override;
  void reduce_scatter(const BFloat16* in, BFloat16* out, size_t count_per_rank,
                      ReduceOp op) override;
  void broadcast(void* data, size_t bytes, int root) override;
  void allgather(const void* in, size_t bytes_per_rank, void* out) override;
  void barrier() override;

  // Point to point, not (yet) in the Communicator interface: `bytes` from `data` to rank `peer`,
  // which must call recv with the same byte count. Each call completes before it returns, so two
  // ranks exchanging data must order their calls (one sends first, the other receives first).
  void send(const void* data, size_t bytes, int peer);
  void recv(void* data, size_t bytes, int peer);

 private:
  struct State;
  int rank_;
  int size_;
  std::unique_ptr<State> state_;
};

// A NcclCommunicator (see above), as the trainer's Communicator.
std::unique_ptr<Communicator> make_nccl_communicator(Store& store, int rank, int size,
                                                     const NcclOptions& options);

}  // namespace dptrain
