// GradientReducer: buckets of the flat gradient buffer reduced on a communication thread.
#include "core/ddp/reducer.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <utility>

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/tensor/ops.hpp"

namespace dptrain {

namespace {

using Clock = std::chrono::steady_clock;

double ms_since(Clock::time_point t0) {
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

DType wire_type(const CompressionSpec& spec) {
  if (spec.type == "fp16" || spec.type == "bf16") return parse_precision(spec.type);
  return DType::f32;
}

}  // namespace

void allreduce_device(Communicator& comm, Ops& ops, float* data, size_t count, ReduceOp op,
                      bool staged, std::vector<float>& staging) {
  if (!staged) {
    comm.allreduce(data, count, op);
    return;
  }
  staging.resize(count);
  ops.download(data, staging.data(), count * sizeof(float));
  comm.allreduce(staging.data(), count, op);
  ops.upload(staging.data(), data, count * sizeof(float));
}

std::vector<Bucket> make_buckets(std::span<const ParamTensor> tensors, size_t bucket_elems) {
  if (tensors.empty()) throw Error(ErrorKind::internal, "make_buckets: no tensors to bucket");
  size_t expected = 0;
  for (const ParamTensor& t : tensors) {
    if (t.offset != expected || t.size() == 0) {
      throw Error(ErrorKind::internal,
                  fmt::format("make_buckets: a tensor at {} of {} values, expected one at {}",
                              t.offset, t.size(), expected));
    }
    expected += t.size();
  }
  std::vector<Bucket> out;
  Bucket bucket;
  bucket.end = expected;
  for (size_t i = tensors.size(); i-- > 0;) {
    // Gathered last first, put in order as the bucket closes (inserting each at the front took
    // time quadratic in the tensors: minutes for a model of many small layers).
    bucket.tensors.push_back(tensors[i]);
    bucket.begin = tensors[i].offset;
    if (bucket.size() >= bucket_elems || i == 0) {
      std::reverse(bucket.tensors.begin(), bucket.tensors.end());
      for (ParamTensor& t : bucket.tensors)
        t.offset -= bucket.begin;
      out.push_back(std::move(bucket));
      bucket = Bucket{};
      bucket.end = tensors[i].offset;
    }
  }
  return out;
}

size_t bucket_elements(double bucket_mb) {
  const double values = bucket_mb * 1024.0 * 1024.0 / static_cast<double>(sizeof(float));
  return values < 1.0 ? 1 : static_cast<size_t>(std::llround(values));
}

GradientReducer::GradientReducer(Communicator& comm, Ops& ops, std::span<float> grads,
                                 std::span<const ParamTensor> tensors,
                                 const ReducerOptions& options)
    : comm_(comm),
      ops_(ops),
      grads_(grads),
      options_(options),
      wire_(wire_type(options.compression)),
      codec_(is_error_feedback_codec(options.compression.type)),
      alone_(comm.size() == 1 && !codec_ && wire_ == DType::f32),
      device_casts_(!codec_ && wire_ != DType::f32 && options.overlap && ops.device() != "cpu"),
      buckets_(make_buckets(tensors, options.bucket_elems)) {
  const size_t count = grads.size();
  if (buckets_.front().end != count) {
    throw Error(ErrorKind::internal, fmt::format("GradientReducer: tensors of {} values for {} "
                                                 "gradients",
                                                 buckets_.front().end, count));
  }
  if (codec_) {
    for (size_t i = 0; i < buckets_.size(); ++i) {
      // Each bucket its own starting Q: the same on every rank, different between buckets.
      codecs_.push_back(make_codec(options.compression, buckets_[i].size(), options.seed + i,
                                   buckets_[i].tensors));
      bytes_per_step_ += codecs_.back()->payload_bytes();
    }
    bytes_per_step_ += sizeof(float);  // the flag
  } else {
    bytes_per_step_ = (count + 1) * dtype_size(wire_);
  }
  if (wire_ != DType::f32) wire_buffer_ = ops_.allocate((count + 1) * dtype_size(wire_));
  if (options_.overlap && !alone_) {
    for (size_t i = 0; i < buckets_.size(); ++i)
      markers_.push_back(ops_.make_marker());
    thread_ = std::thread([this] { comm_loop(); });
  }
}

GradientReducer::~GradientReducer() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    shutdown_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void GradientReducer::begin() {
  if (alone_) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (open_) throw Error(ErrorKind::internal, "GradientReducer::begin: the last step is open");
  open_ = true;
  next_ = 0;
  completed_ = 0;
  comm_ms_ = 0;
  failure_ = nullptr;
}

void GradientReducer::ready(size_t from) {
  if (!options_.overlap || alone_) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!open_) return;  // an accumulation micro-batch: nothing moves until the last one
    // Counted once launched: a device error launching one (its cast, its marker) leaves it
    // not started, for finish() to start or the failed step to drop.
    while (next_ < buckets_.size() && buckets_[next_].begin >= from) {
      launch(next_);
      ++next_;
    }
  }
  wake_.notify_one();
}

void GradientReducer::launch(size_t bucket) {
  if (device_casts_) {
    const size_t begin = buckets_[bucket].begin;
    ops_.cast(grads_.data() + begin, DType::f32, wire_buffer_.as<uint16_t>() + begin, wire_,
              static_cast<int64_t>(bucket_count(bucket)));
  }
  markers_[bucket]->record();
  queue_.push_back(bucket);
}

size_t GradientReducer::bucket_count(size_t bucket) const {
  // Bucket 0 ends where the gradients end: the flag rides along unless a codec would mangle it.
  return buckets_[bucket].size() + (bucket == 0 && !codec_ ? 1 : 0);
}

ExchangeStats GradientReducer::finish() {
  ExchangeStats stats;
  if (alone_) {
    stats.bytes = bytes_per_step_;  // the payload, which one rank moves nowhere
    return stats;
  }
  const auto t0 = Clock::now();
  if (options_.overlap) {
    std::unique_lock<std::mutex> lock(mutex_);
    while (next_ < buckets_.size()) {
      launch(next_);
      ++next_;
    }
    wake_.notify_one();
    done_.wait(lock, [this] { return completed_ == buckets_.size(); });
    open_ = false;
    stats.comm_ms = comm_ms_;
    if (failure_) std::rethrow_exception(std::exchange(failure_, nullptr));
    if (device_casts_) {
      ops_.cast(wire_buffer_.data(), wire_, grads_.data(), DType::f32,
                static_cast<int64_t>(grads_.size() + 1));
    }
  } else {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      open_ = false;
    }
    for (size_t i = 0; i < buckets_.size(); ++i)
      run_bucket(i);
  }
  if (codec_) {
    const auto tf = Clock::now();
    float* flag = grads_.data() + grads_.size();
    if (options_.progress) options_.progress->enter_collective("allreduce of the stop flag");
    reduce_plain(flag, 1);
    stats.comm_ms += ms_since(tf);
  }
  const double waited = ms_since(t0);
  if (options_.overlap) {
    // The wait includes handing the last buckets to the communication thread and its wake-up:
    // what the step waited for is communication only as far as there was any.
    stats.exposed_ms = std::min(waited, stats.comm_ms);
  } else {
    stats.comm_ms = stats.exposed_ms = waited;
  }
  stats.bytes = bytes_per_step_;
  return stats;
}

void GradientReducer::comm_loop() {
  std::exception_ptr unbound;
  try {
    ops_.bind_thread();
  } catch (...) {
    unbound = std::current_exception();  // every bucket of the first step fails with it
  }
  for (;;) {
    size_t bucket = 0;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      wake_.wait(lock, [this] { return shutdown_ || !queue_.empty(); });
      // Shutting down mid-step (the step failed elsewhere): buckets not started never will be,
      // so a rank that is going away does not wait on peers that may be gone too.
      if (shutdown_) return;
      bucket = queue_.front();
      queue_.erase(queue_.begin());
    }
    const auto t0 = Clock::now();
    std::exception_ptr failure;
    try {
      // After one bucket failed the communicator is unusable: the rest only count as done.
      bool failed = false;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        failed = failure_ != nullptr;
      }
      if (unbound) std::rethrow_exception(unbound);
      if (!failed) run_bucket(bucket);
    } catch (...) {
      failure = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      comm_ms_ += ms_since(t0);
      if (failure && !failure_) failure_ = failure;
      ++completed_;
    }
    done_.notify_all();
  }
}

void GradientReducer::run_bucket(size_t bucket) {
  const Bucket& b = buckets_[bucket];
  if (options_.progress) {
    options_.progress->enter_collective("allreduce of gradient bucket",
                                        static_cast<int64_t>(bucket));
  }
  const size_t count = bucket_count(bucket);
  float* data = grads_.data() + b.begin;
  // Issued from the communication thread: the collective waits for the bucket's own marker.
  if (!markers_.empty() && !codec_ && !options_.staged) {
    comm_.start_after(markers_[bucket]->handle());
  }
  if (codec_) {
    reduce_codec(bucket, data, count);
  } else if (wire_ != DType::f32) {
    reduce_wire(data, count, b.begin);
  } else {
    reduce_plain(data, count);
  }
}

void GradientReducer::reduce_plain(float* data, size_t count) {
  allreduce_device(comm_, ops_, data, count, ReduceOp::sum, options_.staged, staging_);
}

// fp16/bf16: cast, sum in 16 bits, cast back: half the bytes.
void GradientReducer::reduce_wire(float* data, size_t count, size_t offset) {
  void* wire = wire_buffer_.as<uint16_t>() + offset;
  const auto n = static_cast<int64_t>(count);
  if (!device_casts_) ops_.cast(data, DType::f32, wire, wire_, n);
  void* host = wire;
  if (options_.staged) {
    wire_staging_.resize(count);
    ops_.download(wire, wire_staging_.data(), count * sizeof(uint16_t));
    host = wire_staging_.data();
  }
  if (wire_ == DType::bf16) {
    comm_.allreduce(static_cast<BFloat16*>(host), count, ReduceOp::sum);
  } else {
    comm_.allreduce(static_cast<Half*>(host), count, ReduceOp::sum);
  }
  if (options_.staged) ops_.upload(wire_staging_.data(), wire, count * sizeof(uint16_t));
  if (!device_casts_) ops_.cast(wire, wire_, data, DType::f32, n);
}

// The codecs work on host memory: on a GPU the bucket goes down and back up.
void GradientReducer::reduce_codec(size_t bucket, float* data, size_t count) {
  GradientCodec& codec = *codecs_[bucket];
  if (ops_.device() == "cpu") {
    codec.reduce({data, count}, comm_);
    return;
  }
  staging_.resize(count);
  ops_.download(data, staging_.data(), count * sizeof(float));
  codec.reduce(staging_, comm_);
  ops_.upload(staging_.data(), data, count * sizeof(float));
}

size_t GradientReducer::state_size() const {
  size_t n = 0;
  for (const auto& codec : codecs_)
    n += codec->state().size();
  return n;
}

std::vector<float> GradientReducer::state() const {
  std::vector<float> out;
  out.reserve(state_size());
  for (const auto& codec : codecs_) {
    const auto s = codec->state();
    out.insert(out.end(), s.begin(), s.end());
  }
  return out;
}

void GradientReducer::restore_state(std::span<const float> state) {
  if (state.size() != state_size()) {
    throw Error(ErrorKind::internal,
                fmt::format("GradientReducer: a state of {} values, expected {}", state.size(),
                            state_size()));
  }
  size_t at = 0;
  for (auto& codec : codecs_) {
    const auto s = codec->state();
    std::copy_n(state.begin() + static_cast<std::ptrdiff_t>(at), s.size(), s.begin());
    at += s.size();
  }
}

}  // namespace dptrain
