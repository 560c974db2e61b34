// Tests of the bucketed gradient exchange: buckets, overlap on a communication thread, the flag,
// the wire formats and failures, on real Gloo ranks (threads over a TCP store on 127.0.0.1).
#include <doctest/doctest.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/ddp/reducer.hpp"
#include "core/error.hpp"
#include "core/tensor/cpu_ops.hpp"
#include "tests/device_check_ops.hpp"
#include "tests/gloo_ranks.hpp"

namespace dptrain {
namespace {

using test::run_ranks;

// A small model's tensors: [3 x 4 matrix][4-vector][5 x 2 matrix][2-vector][6 x 6 matrix].
std::vector<ParamTensor> sample_tensors() {
  std::vector<ParamTensor> out;
  size_t at = 0;
  for (const auto& [rows, cols] :
       std::vector<std::pair<size_t, size_t>>{{3, 4}, {1, 4}, {5, 2}, {1, 2}, {6, 6}}) {
    out.push_back({at, rows, cols});
    at += rows * cols;
  }
  return out;
}

size_t total_size(const std::vector<ParamTensor>& tensors) {
  return tensors.back().offset + tensors.back().size();
}

// Small integers: every sum is exact in any order and in fp16, so the expected value is plain.
float value(int rank, size_t i) {
  return static_cast<float>(static_cast<int>((i * 5 + static_cast<size_t>(rank) * 3) % 17) - 8);
}

// The backward pass of sample_tensors(): gradients complete from the last tensor to the first.
void backward(GradientReducer& reducer, const std::vector<ParamTensor>& tensors) {
  for (size_t i = tensors.size(); i-- > 0;)
    reducer.ready(tensors[i].offset);
}

}  // namespace

TEST_CASE("make_buckets: whole tensors, last first, closed once they reach the size") {
  const auto tensors = sample_tensors();  // sizes 12, 4, 10, 2, 36: 64 values
  const auto buckets = make_buckets(tensors, 14);
  REQUIRE(buckets.size() == 3);
  // The 36-value matrix is larger than a bucket: alone. Then 2 + 10 = 12 < 14, so the 4-vector
  // joins: 16. Then the 12-value matrix.
  CHECK(buckets[0].begin == 28);
  CHECK(buckets[0].end == 64);
  CHECK(buckets[1].begin == 12);
  CHECK(buckets[1].end == 28);
  CHECK(buckets[2].begin == 0);
  CHECK(buckets[2].end == 12);
  // Tensors are listed by offset, relative to their bucket.
  REQUIRE(buckets[1].tensors.size() == 3);
  CHECK(buckets[1].tensors[0] == ParamTensor{0, 1, 4});
  CHECK(buckets[1].tensors[1] == ParamTensor{4, 5, 2});
  CHECK(buckets[1].tensors[2] == ParamTensor{14, 1, 2});
  // One bucket for everything, or one per tensor.
  CHECK(make_buckets(tensors, 1000).size() == 1);
  CHECK(make_buckets(tensors, 1).size() == tensors.size());
  // A tensor larger than a bucket goes whole into the one being filled (as PyTorch DDP's
  // bucket_cap_mb groups them; dptrain-recipe(5)): the 1024-value weight after 164 values in a
  // bucket of 262 makes one bucket of 1188.
  const std::vector<ParamTensor> mlp = {{0, 32, 32}, {1024, 1, 32}, {1056, 4, 32}, {1184, 1, 4}};
  const auto joined = make_buckets(mlp, 262);
  REQUIRE(joined.size() == 1);
  CHECK(joined[0].size() == 1188);
}

TEST_CASE("make_buckets refuses tensors that leave a gap or overlap") {
  CHECK_THROWS_AS(make_buckets(std::vector<ParamTensor>{}, 4), Error);
  CHECK_THROWS_AS(make_buckets(std::vector<ParamTensor>{{0, 2, 2}, {5, 1, 3}}, 4), Error);
  CHECK_THROWS_AS(make_buckets(std::vector<ParamTensor>{{0, 2, 2}, {3, 1, 3}}, 4), Error);
}

TEST_CASE("bucket_elements: MiB of f32 values, at least one") {
  CHECK(bucket_elements(1.0) == 262144);
  CHECK(bucket_elements(25.0) == 25 * 262144);
  CHECK(bucket_elements(1e-9) == 1);
}

TEST_CASE("the reducer sums every rank's gradients and the flag, overlapped or not") {
  const auto tensors = sample_tensors();
  const size_t n = total_size(tensors);
  for (const char* wire : {"none", "fp16", "bf16"}) {
    for (const bool overlap : {true, false}) {
      for (const int size : {1, 3}) {
        CAPTURE(wire);
        CAPTURE(overlap);
        CAPTURE(size);
        run_ranks(size, [&](Communicator& comm) {
          CpuOps ops;
          std::vector<float> grads(n + 1);
          ReducerOptions options;
          options.bucket_elems = 14;
          options.overlap = overlap;
          options.compression.type = wire;
          GradientReducer reducer(comm, ops, std::span<float>(grads.data(), n), tensors, options);
          CHECK(reducer.buckets().size() == 3);
          CHECK(reducer.bytes_per_step() == (n + 1) * (std::string(wire) == "none" ? 4 : 2));
          CHECK(reducer.state_size() == 0);
          for (int step = 0; step < 3; ++step) {
            for (size_t i = 0; i < n; ++i)
              grads[i] = value(comm.rank(), i + static_cast<size_t>(step));
            grads[n] = comm.rank() == size - 1 ? 1.0f : 0.0f;  // one rank asks to stop
            reducer.begin();
            backward(reducer, tensors);
            const ExchangeStats stats = reducer.finish();
            CHECK(stats.bytes == reducer.bytes_per_step());
            CHECK(stats.comm_ms >= 0.0);
            CHECK(stats.exposed_ms >= 0.0);
            for (size_t i = 0; i < n; ++i) {
              float expected = 0;
              for (int r = 0; r < size; ++r)
                expected += value(r, i + static_cast<size_t>(step));
              REQUIRE(grads[i] == expected);
            }
            CHECK(grads[n] == 1.0f);
          }
        });
      }
    }
  }
}

TEST_CASE("ready() before begin() starts nothing: accumulation micro-batches do not communicate") {
  const auto tensors = sample_tensors();
  const size_t n = total_size(tensors);
  // Counts the collectives each rank issues.
  struct Counting : test::ForwardingCommunicator {
    using ForwardingCommunicator::ForwardingCommunicator;
    std::atomic<int> calls{0};
    void allreduce(float* data, size_t count, ReduceOp op) override {
      ++calls;
      ForwardingCommunicator::allreduce(data, count, op);
    }
  };
  run_ranks(
      2,
      [&](Communicator& comm) {
        auto& counting = dynamic_cast<Counting&>(comm);
        CpuOps ops;
        std::vector<float> grads(n + 1, 1.0f);
        ReducerOptions options;
        options.bucket_elems = 14;
        GradientReducer reducer(comm, ops, std::span<float>(grads.data(), n), tensors, options);
        backward(reducer, tensors);  // an accumulation micro-batch
        CHECK(counting.calls == 0);
        reducer.begin();
        backward(reducer, tensors);
        reducer.finish();
        CHECK(counting.calls == 3);  // one per bucket, the flag riding in bucket 0
        CHECK(grads[0] == 2.0f);
      },
      [](std::unique_ptr<Communicator> inner) -> std::unique_ptr<Communicator> {
        return std::make_unique<Counting>(std::move(inner));
      });
}

TEST_CASE("a bucket that fails on the communication thread fails finish(), naming the cause") {
  const auto tensors = sample_tensors();
  const size_t n = total_size(tensors);
  // The second all-reduce of every rank fails, as a dead peer would make it.
  struct Failing : test::ForwardingCommunicator {
    using ForwardingCommunicator::ForwardingCommunicator;
    int calls = 0;
    void allreduce(float* data, size_t count, ReduceOp op) override {
      if (++calls == 2) throw Error(ErrorKind::comm, "rank 1 is gone");
      ForwardingCommunicator::allreduce(data, count, op);
    }
  };
  run_ranks(
      2,
      [&](Communicator& comm) {
        CpuOps ops;
        std::vector<float> grads(n + 1, 1.0f);
        ReducerOptions options;
        options.bucket_elems = 14;
        GradientReducer reducer(comm, ops, std::span<float>(grads.data(), n), tensors, options);
        reducer.begin();
        backward(reducer, tensors);
        CHECK_THROWS_WITH_AS(reducer.finish(), "rank 1 is gone", Error);
      },
      [](std::unique_ptr<Communicator> inner) -> std::unique_ptr<Communicator> {
        return std::make_unique<Failing>(std::move(inner));
      });
}

TEST_CASE("on a device, each bucket's collective waits for its own marker, not the whole stream") {
  const auto tensors = sample_tensors();
  const size_t n = total_size(tensors);
  // What one rank did, in order, on either thread: "ready FROM" (the backward pass), "record B"
  // (a bucket's marker), "cast" (from the training thread; "cast elsewhere" from another),
  // "start B" (a collective told to wait for marker B), "allreduce".
  struct Log {
    std::mutex mutex;
    std::vector<std::string> lines;
    void add(std::string line) {
      std::lock_guard lock(mutex);
      lines.push_back(std::move(line));
    }
  };
  // A GPU's op table, as the trainer's device tests pose it, whose markers log their records.
  struct MarkingOps : test::DeviceCheckingOps {
    MarkingOps(Log& log, std::thread::id training)
        : DeviceCheckingOps(std::make_shared<CpuOps>()), log_(log), training_(training) {}
    struct Marker : Ops::Marker {
      Marker(Log& log, int id) : log_(log), id_(id) {}
      void record() override { log_.add("record " + std::to_string(id_)); }
      void* handle() const override { return const_cast<int*>(&id_); }
      Log& log_;
      const int id_;
    };
    std::unique_ptr<Ops::Marker> make_marker() override {
      return std::make_unique<Marker>(log_, markers_++);
    }
    void cast(const void* src, DType from, void* dst, DType to, int64_t count) override {
      log_.add(std::this_thread::get_id() == training_ ? "cast" : "cast elsewhere");
      DeviceCheckingOps::cast(src, from, dst, to, count);
    }
    Log& log_;
    const std::thread::id training_;
    int markers_ = 0;
  };
  struct Starting : test::ForwardingCommunicator {
    using ForwardingCommunicator::ForwardingCommunicator;
    Log log;
    void start_after(void* marker) override {
      log.add("start " + std::to_string(*static_cast<int*>(marker)));
    }
    void allreduce(float* data, size_t count, ReduceOp op) override {
      log.add("allreduce");
      ForwardingCommunicator::allreduce(data, count, op);
    }
    void allreduce(BFloat16* data, size_t count, ReduceOp op) override {
      log.add("allreduce");
      ForwardingCommunicator::allreduce(data, count, op);
    }
  };
  for (const char* wire : {"none", "bf16"}) {
    CAPTURE(wire);
    run_ranks(
        2,
        [&](Communicator& comm) {
          Log& log = dynamic_cast<Starting&>(comm).log;
          MarkingOps ops(log, std::this_thread::get_id());
          Buffer buffer = ops.allocate((n + 1) * sizeof(float));
          std::span<float> grads(buffer.as<float>(), n);
          ReducerOptions options;
          options.bucket_elems = 14;
          options.compression.type = wire;
          GradientReducer reducer(comm, ops, grads, tensors, options);
          const auto& buckets = reducer.buckets();
          for (int step = 0; step < 2; ++step) {
            log.lines.clear();
            for (size_t i = 0; i < n; ++i)
              grads[i] = value(comm.rank(), i + static_cast<size_t>(step));
            grads.data()[n] = 1.0f;  // both ranks ask to stop
            reducer.begin();
            for (size_t i = tensors.size(); i-- > 0;) {
              log.add("ready " + std::to_string(tensors[i].offset));
              reducer.ready(tensors[i].offset);
            }
            reducer.finish();
            for (size_t i = 0; i < n; ++i) {
              REQUIRE(grads[i] == value(0, i + static_cast<size_t>(step)) +
                                      value(1, i + static_cast<size_t>(step)));
            }
            CHECK(grads.data()[n] == 2.0f);
            // Each bucket's marker is recorded by the ready() call that completed it, and its
            // collective waits for that marker and nothing else.
            const std::vector<std::string> lines = log.lines;
            for (size_t b = 0; b < buckets.size(); ++b) {
              CAPTURE(b);
              const auto at = [&](const std::string& line) {
                return static_cast<size_t>(std::find(lines.begin(), lines.end(), line) -
                                           lines.begin());
              };
              const size_t record = at("record " + std::to_string(b));
              const size_t start = at("start " + std::to_string(b));
              REQUIRE(record < lines.size());
              REQUIRE(start < lines.size());
              CHECK(record < start);
              CHECK(std::count(lines.begin(), lines.end(), lines[start]) == 1);
              // The collective right after its start_after (casts run on the other thread).
              size_t next = start + 1;
              while (next < lines.size() && lines[next].rfind("allreduce", 0) != 0 &&
                     lines[next].rfind("start", 0) != 0) {
                ++next;
              }
              REQUIRE(next < lines.size());
              CHECK(lines[next] == "allreduce");
              size_t ready = record;
              while (ready > 0 && lines[ready].rfind("ready ", 0) != 0)
                --ready;
              CHECK(std::stoul(lines[ready].substr(6)) <= buckets[b].begin);
              for (size_t i = 0; i < ready; ++i) {
                if (lines[i].rfind("ready ", 0) == 0) {
                  CHECK(std::stoul(lines[i].substr(6)) > buckets[b].begin);
                }
              }
            }
            // The 16-bit casts run on the training thread: one per bucket, one back.
            const bool bf16 = std::string(wire) == "bf16";
            CHECK(std::count(lines.begin(), lines.end(), "cast") ==
                  (bf16 ? static_cast<long>(buckets.size()) + 1 : 0));
            CHECK(std::count(lines.begin(), lines.end(), "cast elsewhere") == 0);
            CHECK(std::count(lines.begin(), lines.end(), "allreduce") ==
                  static_cast<long>(buckets.size()));
          }
          CHECK(test::DeviceMemory::instance().take_violations().empty());
        },
        [](std::unique_ptr<Communicator> inner) -> std::unique_ptr<Communicator> {
          return std::make_unique<Starting>(std::move(inner));
        });
  }
}

TEST_CASE("an error-feedback codec per bucket: its state checkpoints, the flag travels alone") {
  const auto tensors = sample_tensors();
  const size_t n = total_size(tensors);
  for (const char* type : {"int8", "topk", "powersgd"}) {
    CAPTURE(type);
    run_ranks(2, [&](Communicator& comm) {
      CpuOps ops;
      // The flag, then a guard value that no codec may touch.
      std::vector<float> grads(n + 2);
      ReducerOptions options;
      options.bucket_elems = 14;
      options.compression.type = type;
      options.compression.block = 4;
      options.compression.ratio = 0.25;
      options.compression.rank = 1;
      GradientReducer reducer(comm, ops, std::span<float>(grads.data(), n), tensors, options);
      CHECK(reducer.state_size() >= n);  // at least a residual per gradient
      for (size_t i = 0; i < n; ++i)
        grads[i] = 0.01f * value(comm.rank(), i);
      grads[n] = comm.rank() == 0 ? 1.0f : 0.0f;
      grads[n + 1] = 42.0f;
      reducer.begin();
      backward(reducer, tensors);
      const ExchangeStats stats = reducer.finish();
      CHECK(grads[n] == 1.0f);
      CHECK(grads[n + 1] == 42.0f);
      CHECK(stats.bytes < (n + 1) * sizeof(float));
      if (std::string(type) == "int8") {
        // 4-value blocks: every sum within a few of its blocks' scales.
        for (size_t i = 0; i < n; ++i)
          CHECK(grads[i] == doctest::Approx(0.01f * (value(0, i) + value(1, i))).epsilon(0.02));
      }
      // The state round-trips.
      const std::vector<float> saved = reducer.state();
      GradientReducer other(comm, ops, std::span<float>(grads.data(), n), tensors, options);
      other.restore_state(saved);
      CHECK(other.state() == saved);
      CHECK_THROWS_AS(other.restore_state(std::vector<float>(3)), Error);
    });
  }
}

}  // namespace dptrain
