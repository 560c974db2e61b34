// The gradient exchange of a data-parallel step: the flat gradient buffer in buckets, reduced in
// the order the backward pass finishes them, on a communication thread while the backward pass
// goes on (overlap), in distributed.compression's wire format.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "core/comm/communicator.hpp"
#include "core/ddp/codec.hpp"
#include "core/heartbeat.hpp"
#include "core/recipe.hpp"
#include "core/tensor/ops.hpp"

namespace dptrain {

// A contiguous slice [begin, end) of the flat gradient buffer: whole parameter tensors.
struct Bucket {
  size_t begin = 0;
  size_t end = 0;
  std::vector<ParamTensor> tensors;  // its tensors, offsets relative to `begin`, by offset
  size_t size() const { return end - begin; }
  bool operator==(const Bucket&) const = default;
};

// The tensors (by offset, covering [0, n) without gaps) grouped into buckets, last tensors first,
// the order the backward pass finishes them: a bucket closes once it holds `bucket_elems` values
// or more (a tensor larger than that is a bucket of its own), so bucket 0 ends at n and the last
// bucket starts at 0. Error(internal) when the tensors are empty or leave gaps.
std::vector<Bucket> make_buckets(std::span<const ParamTensor> tensors, size_t bucket_elems);

// bucket_mb in values of f32 gradients, at least 1.
size_t bucket_elements(double bucket_mb);

// `count` floats of `ops`' memory reduced over the ranks in place: directly when the communicator
// takes that memory (NCCL, or any communicator on the CPU), else through `staging`, host memory
// (`staged`: Gloo with a GPU).
void allreduce_device(Communicator& comm, Ops& ops, float* data, size_t count, ReduceOp op,
                      bool staged, std::vector<float>& staging);

// One step's exchange, on this rank.
struct ExchangeStats {
  double comm_ms = 0;  // the collectives and codecs, start to end of each bucket, summed
  // How long finish() waited, at most comm_ms: the communication the backward did not hide.
  double exposed_ms = 0;
  uint64_t bytes = 0;  // this rank's payload (what it put on the wire)
};

struct ReducerOptions {
  size_t bucket_elems = 1;
  bool overlap = true;
  CompressionSpec compression;
  bool staged = false;                  // device memory that the communicator cannot take (Gloo
                                        // with a GPU): each bucket goes through host memory
  uint64_t seed = 1;                    // powersgd's starting Q
  ProgressTracker* progress = nullptr;  // one collective per bucket, for hang attribution
};

// Sums every rank's gradients in place. `grads` is device memory of `ops` holding the gradients
// of `tensors` (a model's, covering `grads`) and, after them, one more float: a flag (the trainer's
// stop request) that is summed exactly with them at no extra collective where the wire format
// allows, or by one small all-reduce. Buckets are the same on every rank, so ranks issue the same
// collectives in the same order; the result is the same with overlap on or off (bit for bit on the
// CPU).
//
// A step: begin(), then ready() as the backward pass completes gradients (the model's hook),
// then finish(). Only finish() may throw a failed bucket's error; ready() and finish() also throw
// a device's error (Error(cuda)) as they queue a bucket's work on a GPU. While a step is open the
// communicator belongs to the reducer: call no other collective on it until finish() returns.
class GradientReducer {
 public:
  GradientReducer(Communicator& comm, Ops& ops, std::span<float> grads,
                  std::span<const ParamTensor> tensors, const ReducerOptions& options);
  ~GradientReducer();
  GradientReducer(const GradientReducer&) = delete;
  GradientReducer& operator=(const GradientReducer&) = delete;

  const std::vector<Bucket>& buckets() const { return buckets_; }
  // The step's gradients are about to be completed (its last micro-batch on this rank): from now
  // on ready() starts buckets. Without overlap nothing starts before finish().
  void begin();
  // The gradients from `from` to the end are final: every bucket inside them may start.
  void ready(size_t from);
  // Starts what has not started, waits for all of it, and sums the flag.
  ExchangeStats finish();

  // This rank's payload per step, in bytes.
  uint64_t bytes_per_step() const { return bytes_per_step_; }
  // The error-feedback state of this rank (the codecs' residuals; empty for none, fp16, bf16),
  // for checkpoints: state_size() floats, copied out or restored in place.
  size_t state_size() const;
  std::vector<float> state() const;
  void restore_state(std::span<const float> state);

 private:
  void launch(size_t bucket);                // under mutex_
  size_t bucket_count(size_t bucket) const;  // its values, and the flag's with bucket 0
  void run_bucket(size_t bucket);
  void reduce_plain(float* data, size_t count);
  void reduce_wire(float* data, size_t count, size_t offset);
  void reduce_codec(size_t bucket, float* data, size_t count);
  void comm_loop();

  Communicator& comm_;
  Ops& ops_;
  const std::span<float> grads_;  // the gradients (the flag follows them)
  const ReducerOptions options_;
  const DType wire_;
  const bool codec_;  // an error-feedback codec: the flag travels alone
  // One rank, gradients sent as they are: the sum over the ranks is the rank's own, so nothing is
  // started (no thread, no hand-off whose wake-up would count as communication waited for). A
  // codec or a wire type still runs: its rounding is part of the training.
  const bool alone_;
  // A device's gradients overlapped in a 16-bit wire type: the casts run on the training thread
  // in stream order with the backward pass (to the wire type as each bucket is launched, back
  // once in finish()). Queued from the communication thread they would run after all the
  // backward work queued by then, and the bucket's collective with them.
  const bool device_casts_;
  std::vector<Bucket> buckets_;
  std::vector<std::unique_ptr<GradientCodec>> codecs_;  // one per bucket when codec_
  uint64_t bytes_per_step_ = 0;
  Buffer wire_buffer_;                  // the gradients cast to wire_, on the device
  std::vector<float> staging_;          // host copies for staged or codec buckets
  std::vector<uint16_t> wire_staging_;  // and of the 16-bit wire buffer
  // Per bucket (overlap only): recorded on the op table's stream when the bucket is launched, so
  // its collective waits for the backward work that produced it and not for what came after.
  std::vector<std::unique_ptr<Ops::Marker>> markers_;

  // The communication thread (overlap only) and the step's state, under mutex_.
  std::mutex mutex_;
  std::condition_variable wake_;  // the thread: work queued or shutting down
  std::condition_variable done_;  // finish(): a bucket completed
  std::vector<size_t> queue_;     // buckets launched, not yet taken by the thread
  size_t next_ = 0;               // the next bucket to launch (they launch in order)
  size_t completed_ = 0;
  bool open_ = false;  // between begin() and finish()
  bool shutdown_ = false;
  double comm_ms_ = 0;
  std::exception_ptr failure_;
  std::thread thread_;
};

}  // namespace dptrain
