// GPU tests of the NCCL Communicator: every collective on device and host memory, in every element
// type and reduction, ordering against the op table's compute stream, and the deadlines (a rank
// that never comes, a collective a peer skips) that abort instead of hanging; and `dptrain bench
// comm --backend nccl`. World 1 on device 0; with two or more devices also 2 ranks (threads, or
// processes for the benchmark) on devices 0 and 1.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/comm/nccl_communicator.hpp"
#include "core/comm/tcp_store.hpp"
#include "core/ddp/reducer.hpp"
#include "tests/gpu/gpu_test.hpp"
#include "tests/harness.hpp"

extern char** environ;

namespace dptrain {
namespace {

using namespace std::chrono_literals;

// NCCL must load on the GPU machine (the run script puts it on the library path): a missing
// library fails here, with the reason, rather than skipping every test.
void require_nccl() {
  const auto reason = nccl_unavailable_reason();
  REQUIRE_MESSAGE(!reason.has_value(), "NCCL cannot be used: " << reason.value_or(""));
}

// Small integers, so every sum is exact in every type (|value| * ranks stays far below 2^8)
// and avg over a power of two ranks is exact too.
int pattern_value(int rank, size_t i) {
  return static_cast<int>((i * 7 + static_cast<size_t>(rank) * 13) % 101) - 50;
}

template <typename T>
T narrow(double value) {
  return Widened<T>::down(static_cast<decltype(Widened<T>::up(T{}))>(value));
}
template <typename T>
double wide(T value) {
  return static_cast<double>(Widened<T>::up(value));
}

template <typename T>
std::vector<T> pattern(int rank, size_t n, size_t first = 0) {
  std::vector<T> out(n);
  for (size_t i = 0; i < n; ++i)
    out[i] = narrow<T>(pattern_value(rank, first + i));
  return out;
}

double reduced_value(ReduceOp op, int size, size_t i) {
  double sum = 0;
  double max = pattern_value(0, i);
  double min = max;
  for (int rank = 0; rank < size; ++rank) {
    const double v = pattern_value(rank, i);
    sum += v;
    max = std::max(max, v);
    min = std::min(min, v);
  }
  switch (op) {
    case ReduceOp::sum:
      return sum;
    case ReduceOp::avg:
      return sum / size;
    case ReduceOp::max:
      return max;
    case ReduceOp::min:
      return min;
  }
  return 0;
}

template <typename T>
Buffer upload(Ops& ops, const std::vector<T>& host) {
  Buffer out = ops.allocate(host.size() * sizeof(T));
  ops.upload(host.data(), out.data(), host.size() * sizeof(T));
  return out;
}

template <typename T>
std::vector<T> download(Ops& ops, const void* device, size_t n) {
  std::vector<T> out(n);
  ops.download(device, out.data(), n * sizeof(T));
  return out;
}

// Elements of `got` that differ from `want` (exactly: the data are small integers), with the first
// one named.
template <typename T>
void check_equal(const std::vector<T>& got, const std::vector<double>& want,
                 const std::string& what) {
  REQUIRE_MESSAGE(got.size() == want.size(), what << ": sizes differ");
  size_t wrong = 0;
  size_t first = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (wide(got[i]) != wide(narrow<T>(want[i]))) {
      if (wrong++ == 0) first = i;
    }
  }
  CHECK_MESSAGE(wrong == 0, what << ": " << wrong << " wrong element(s), the first at " << first
                                 << ": " << wide(got[first]) << " instead of " << want[first]);
}

const char* op_name(ReduceOp op) {
  return reduce_op_name(op);
}

template <typename T>
void check_allreduce(NcclCommunicator& comm, Ops& ops, size_t n, const char* type) {
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
    Buffer data = upload(ops, pattern<T>(comm.rank(), n));
    comm.allreduce(data.as<T>(), n, op);
    std::vector<double> want(n);
    for (size_t i = 0; i < n; ++i)
      want[i] = reduced_value(op, comm.size(), i);
    check_equal(download<T>(ops, data.data(), n), want,
                std::string("device allreduce(") + op_name(op) + ") of " + type);
  }
}

template <typename T>
void check_reduce_scatter(NcclCommunicator& comm, Ops& ops, size_t count, const char* type) {
  const int size = comm.size();
  const size_t total = count * static_cast<size_t>(size);
  for (ReduceOp op : {ReduceOp::sum, ReduceOp::max}) {
    Buffer in = upload(ops, pattern<T>(comm.rank(), total));
    Buffer out = ops.allocate(count * sizeof(T));
    comm.reduce_scatter(in.as<const T>(), out.as<T>(), count, op);
    std::vector<double> want(count);
    const size_t first = static_cast<size_t>(comm.rank()) * count;
    for (size_t i = 0; i < count; ++i)
      want[i] = reduced_value(op, size, first + i);
    check_equal(download<T>(ops, out.data(), count), want,
                std::string("device reduce_scatter(") + op_name(op) + ") of " + type);
    // The input is left as it was.
    std::vector<double> input(total);
    for (size_t i = 0; i < total; ++i)
      input[i] = pattern_value(comm.rank(), i);
    check_equal(download<T>(ops, in.data(), total), input, "reduce_scatter's input");
  }
}

// What every test runs on each rank: every collective, on device memory and on host memory.
void exercise_collectives(NcclCommunicator& comm, Ops& ops) {
  const int size = comm.size();
  const int rank = comm.rank();
  CHECK(comm.backend() == "nccl");
  CHECK(comm.device_memory());
  const std::string described = comm.describe();
  CHECK_MESSAGE(described.rfind("nccl 2.", 0) == 0, described);
  CHECK_MESSAGE(described.find(" on cuda:") != std::string::npos, described);

  // Odd sizes, and one larger than NCCL's chunks.
  check_allreduce<float>(comm, ops, 1, "float");
  check_allreduce<float>(comm, ops, 4099, "float");
  check_allreduce<float>(comm, ops, (size_t{1} << 22) + 3, "float");
  check_allreduce<double>(comm, ops, 4099, "double");
  check_allreduce<Half>(comm, ops, 4099, "half");
  check_allreduce<BFloat16>(comm, ops, 4099, "bfloat16");

  // Host memory, staged through the device: a single value and a buffer larger than the
  // staging buffer's first size.
  double loss = 1.5 + rank;
  comm.allreduce(&loss, 1, ReduceOp::sum);
  CHECK(loss == 1.5 * size + size * (size - 1) / 2.0);
  std::vector<float> host = pattern<float>(rank, 100003);
  comm.allreduce(host.data(), host.size(), ReduceOp::max);
  std::vector<double> want(host.size());
  for (size_t i = 0; i < host.size(); ++i)
    want[i] = reduced_value(ReduceOp::max, size, i);
  check_equal(host, want, "host allreduce(max) of float");
  std::vector<Half> host_half = pattern<Half>(rank, 999);
  comm.allreduce(host_half.data(), host_half.size(), ReduceOp::avg);
  want.assign(host_half.size(), 0);
  for (size_t i = 0; i < host_half.size(); ++i)
    want[i] = reduced_value(ReduceOp::avg, size, i);
  check_equal(host_half, want, "host allreduce(avg) of half");

  check_reduce_scatter<float>(comm, ops, 1, "float");
  check_reduce_scatter<float>(comm, ops, 5003, "float");
  check_reduce_scatter<BFloat16>(comm, ops, 777, "bfloat16");
  check_reduce_scatter<Half>(comm, ops, 777, "half");
  check_reduce_scatter<double>(comm, ops, 777, "double");
  {  // host in, host out
    std::vector<float> in = pattern<float>(rank, 3 * static_cast<size_t>(size));
    std::vector<float> out(3, -1000.0f);
    comm.reduce_scatter(in.data(), out.data(), 3, ReduceOp::sum);
    std::vector<double> slice(3);
    for (size_t i = 0; i < 3; ++i)
      slice[i] = reduced_value(ReduceOp::sum, size, static_cast<size_t>(rank) * 3 + i);
    check_equal(out, slice, "host reduce_scatter(sum) of float");
  }

  // Broadcast from the last rank: the others start with zeros.
  const int root = size - 1;
  const size_t n = 10001;
  const std::vector<float> zeros(n, 0.0f);
  Buffer data = upload(ops, rank == root ? pattern<float>(root, n) : zeros);
  comm.broadcast(data.data(), n * sizeof(float), root);
  want.assign(n, 0);
  for (size_t i = 0; i < n; ++i)
    want[i] = pattern_value(root, i);
  check_equal(download<float>(ops, data.data(), n), want, "device broadcast");
  std::vector<float> host_broadcast = rank == root ? pattern<float>(root, 7) : zeros;
  host_broadcast.resize(7);
  comm.broadcast(host_broadcast.data(), 7 * sizeof(float), root);
  check_equal(host_broadcast, std::vector<double>(want.begin(), want.begin() + 7),
              "host broadcast");

  // Allgather: rank r's block at r * count, device to device and host to device.
  const size_t count = 3001;
  Buffer in = upload(ops, pattern<float>(rank, count));
  Buffer out = ops.allocate(count * static_cast<size_t>(size) * sizeof(float));
  comm.allgather(in.data(), count * sizeof(float), out.data());
  want.assign(count * static_cast<size_t>(size), 0);
  for (int q = 0; q < size; ++q) {
    for (size_t i = 0; i < count; ++i)
      want[static_cast<size_t>(q) * count + i] = pattern_value(q, i);
  }
  check_equal(download<float>(ops, out.data(), want.size()), want, "device allgather");
  const std::vector<float> host_in = pattern<float>(rank, count);
  ops.fill_zero(out.data(), want.size() * sizeof(float));
  comm.allgather(host_in.data(), count * sizeof(float), out.data());
  check_equal(download<float>(ops, out.data(), want.size()), want, "host-to-device allgather");
  std::vector<float> host_out(want.size(), -1.0f);
  comm.allgather(in.data(), count * sizeof(float), host_out.data());
  check_equal(host_out, want, "device-to-host allgather");

  for (int i = 0; i < 3; ++i)
    comm.barrier();

  // Zero counts are no-ops on every rank.
  comm.allreduce(static_cast<float*>(nullptr), 0, ReduceOp::sum);
  comm.allgather(nullptr, 0, nullptr);
  comm.broadcast(nullptr, 0, 0);
}

// A host function on `stream` that holds it (and everything queued after it) until open() is
// called, or until `limit` passes. Its state is shared with the function, which may outlive the
// gate: CUDA skips a host function whose context has failed, and then nothing would ever wake a
// destructor waiting for it (it waits `limit` and a little more, then leaves the state to the
// function, if it ever runs).
// CUDA asks that a host function not wait for work that is not ordered before it; this one waits
// for the test, which opens it once a collective on another stream has finished. That holds as
// long as nothing else in the process queues a host function meanwhile (the runtime may run them
// one at a time): NCCL with one rank does not. Should that change, the check it guards fails
// after `limit`, it does not hang.
class StreamGate {
 public:
  StreamGate(cudaStream_t stream, std::chrono::milliseconds limit)
      : state_(std::make_shared<State>()) {
    state_->limit = limit;
    // The function's own reference, released by it (or leaked, if it never runs).
    auto* held = new std::shared_ptr<State>(state_);
    if (cudaLaunchHostFunc(stream, &StreamGate::hold, held) != cudaSuccess) {
      delete held;
      FAIL("cudaLaunchHostFunc failed");
    }
  }
  ~StreamGate() {
    open();
    std::unique_lock lock(state_->mutex);
    state_->changed.wait_for(lock, state_->limit + 5s, [this] { return state_->returned; });
  }
  StreamGate(const StreamGate&) = delete;
  StreamGate& operator=(const StreamGate&) = delete;
  // Opens it: true when it was still holding (it had not given up on its own).
  bool open() {
    std::lock_guard lock(state_->mutex);
    state_->opened = true;
    state_->changed.notify_all();
    return !state_->gave_up;
  }

 private:
  struct State {
    std::chrono::milliseconds limit{};
    std::mutex mutex;
    std::condition_variable changed;
    bool opened = false;
    bool gave_up = false;
    bool returned = false;
  };
  static void CUDART_CB hold(void* data) {
    const std::unique_ptr<std::shared_ptr<State>> held(static_cast<std::shared_ptr<State>*>(data));
    State& state = **held;
    std::unique_lock lock(state.mutex);
    if (!state.changed.wait_for(lock, state.limit, [&state] { return state.opened; })) {
      state.gave_up = true;
    }
    state.returned = true;
    state.changed.notify_all();
  }
  std::shared_ptr<State> state_;
};

// Work queued on the compute stream comes before the collective: a chain of kernels doubles the
// buffer ten times, then an out-of-place collective reads it at once. Work queued after the
// collective sees its result.
void check_compute_stream_order(NcclCommunicator& comm, Ops& ops) {
  const size_t n = size_t{1} << 24;  // 64 MiB: the kernels take a while
  const std::vector<float> ones(n, 1.0f);
  Buffer in = upload(ops, ones);
  Buffer out = ops.allocate(n * static_cast<size_t>(comm.size()) * sizeof(float));
  for (int i = 0; i < 10; ++i)
    ops.scale(static_cast<int64_t>(n), 2.0f, in.as<float>());
  comm.allgather(in.data(), n * sizeof(float), out.data());
  ops.scale(static_cast<int64_t>(n), 0.5f, out.as<float>());  // queued after the collective
  const auto got = download<float>(ops, out.data(), n * static_cast<size_t>(comm.size()));
  size_t wrong = 0;
  for (float v : got)
    wrong += v != 512.0f;
  CHECK_MESSAGE(wrong == 0, wrong << " element(s) of the allgather did not see the compute "
                                     "stream's work before it or after it");
  // The same for an in-place allreduce(avg), which NCCL runs as a kernel even on one rank.
  Buffer data = upload(ops, ones);
  for (int i = 0; i < 10; ++i)
    ops.scale(static_cast<int64_t>(n), 2.0f, data.as<float>());
  comm.allreduce(data.as<float>(), n, ReduceOp::avg);
  ops.scale(static_cast<int64_t>(n), 0.25f, data.as<float>());
  const auto averaged = download<float>(ops, data.data(), n);
  wrong = 0;
  for (float v : averaged)
    wrong += v != 256.0f;
  CHECK_MESSAGE(wrong == 0, wrong << " element(s) of the allreduce were out of order");
  // start_after (the gradient reducer's thread): the collective waits for a marker recorded
  // after the work that made its data, and the next one for the whole stream again.
  Buffer marked = upload(ops, ones);
  for (int i = 0; i < 10; ++i)
    ops.scale(static_cast<int64_t>(n), 2.0f, marked.as<float>());
  const auto marker = ops.make_marker();
  REQUIRE(marker->handle() != nullptr);
  marker->record();
  comm.start_after(marker->handle());
  comm.allreduce(marked.as<float>(), n, ReduceOp::avg);
  ops.scale(static_cast<int64_t>(n), 2.0f, marked.as<float>());
  comm.allreduce(marked.as<float>(), n, ReduceOp::avg);
  ops.scale(static_cast<int64_t>(n), 0.25f, marked.as<float>());
  const auto after_marker = download<float>(ops, marked.data(), n);
  wrong = 0;
  for (float v : after_marker)
    wrong += v != 512.0f;
  CHECK_MESSAGE(wrong == 0, wrong << " element(s) of the allreduces after a marker were out of "
                                     "order");
  // And it does not wait for what was queued after the marker: a host function queued after it
  // holds the compute stream until the test opens it, after the gather has returned. Had the
  // gather waited for the whole stream, it could not return until the gate gave up on its own
  // (then the check fails, after 20 s, instead of hanging). A sign flip queued behind the gate
  // cannot have run before the gather copied its input.
  if (comm.size() == 1) {
    Buffer input = upload(ops, ones);
    Buffer gathered = ops.allocate(n * sizeof(float));
    marker->record();
    StreamGate gate(static_cast<cudaStream_t>(kernels::compute_stream(ops)), 20s);
    ops.scale(static_cast<int64_t>(n), -1.0f, input.as<float>());
    comm.start_after(marker->handle());
    comm.allgather(input.data(), n * sizeof(float), gathered.data());
    CHECK_MESSAGE(gate.open(),
                  "the gather waited for the work queued after its marker: it returned only when "
                  "the gate holding the compute stream gave up after 20 s");
    const auto snapshot = download<float>(ops, gathered.data(), n);
    CHECK(std::count(snapshot.begin(), snapshot.end(), 1.0f) == static_cast<ptrdiff_t>(n));
    const auto flipped = download<float>(ops, input.data(), n);
    CHECK(std::count(flipped.begin(), flipped.end(), -1.0f) == static_cast<ptrdiff_t>(n));
  }
}

NcclOptions options_for(Ops& ops, int device, std::chrono::milliseconds timeout = 60s) {
  NcclOptions options;
  options.device = device;
  options.timeout = timeout;
  options.compute_stream = kernels::compute_stream(ops);
  return options;
}

// A store on loopback for the ranks of this process: its server, a client, and the first
// generation's keys.
struct LoopbackStore {
  TcpStoreServer server{"127.0.0.1", 0};
  TcpStoreClient client{"127.0.0.1", server.port(), 10s};
  PrefixStore store{"gen1", client};
};

// Runs body on `size` ranks, rank r a thread on device r with its own op table and store
// client; fails the test with the first rank's error.
void run_ranks(int size, const std::function<void(NcclCommunicator&, Ops&)>& body,
               std::chrono::milliseconds timeout = 60s) {
  TcpStoreServer server("127.0.0.1", 0);
  std::mutex mutex;
  std::string failure;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < size; ++rank) {
    threads.emplace_back([&, rank] {
      try {
        auto ops = kernels::make_cuda_ops(rank);
        TcpStoreClient client("127.0.0.1", server.port(), 10s);
        PrefixStore store("gen1", client);
        NcclCommunicator comm(store, rank, size, options_for(*ops, rank, timeout));
        CHECK(comm.rank() == rank);
        CHECK(comm.size() == size);
        CHECK(comm.describe().find("on cuda:" + std::to_string(rank)) != std::string::npos);
        body(comm, *ops);
      } catch (const std::exception& error) {
        std::lock_guard lock(mutex);
        if (failure.empty()) failure = fmt::format("rank {}: {}", rank, error.what());
      }
    });
  }
  for (auto& thread : threads)
    thread.join();
  REQUIRE_MESSAGE(failure.empty(), failure);
}

TEST_CASE("nccl: world 1 on cuda:0, every collective and type, device and host memory") {
  require_nccl();
  LoopbackStore loopback;
  Ops& ops = gputest::gpu();
  auto comm = make_nccl_communicator(loopback.store, 0, 1, options_for(ops, 0));
  auto* nccl = dynamic_cast<NcclCommunicator*>(comm.get());
  REQUIRE(nccl != nullptr);
  MESSAGE(nccl->describe());
  exercise_collectives(*nccl, ops);
  check_compute_stream_order(*nccl, ops);
}

TEST_CASE("nccl: the gradient reducer on device memory, overlapped, in every wire format") {
  require_nccl();
  const int ranks = std::min(kernels::device_count(), 2);
  // Tensors [300 x 40][40][25 x 300][25]: buckets of whole tensors, the last first.
  std::vector<ParamTensor> tensors;
  size_t n = 0;
  for (const auto& [rows, cols] :
       std::vector<std::pair<size_t, size_t>>{{300, 40}, {1, 40}, {25, 300}, {1, 25}}) {
    tensors.push_back({n, rows, cols});
    n += rows * cols;
  }
  for (const char* wire : {"none", "bf16", "fp16", "int8"}) {
    for (const bool overlap : {true, false}) {
      CAPTURE(wire);
      CAPTURE(overlap);
      run_ranks(ranks, [&](NcclCommunicator& comm, Ops& ops) {
        std::vector<float> host(n + 1);
        for (size_t i = 0; i < n; ++i)
          host[i] = static_cast<float>(pattern_value(comm.rank(), i));
        host[n] = comm.rank() == 0 ? 1.0f : 0.0f;
        Buffer grads = upload(ops, host);
        ReducerOptions options;
        options.bucket_elems = 8000;
        options.overlap = overlap;
        options.compression.type = wire;
        GradientReducer reducer(comm, ops, std::span<float>(grads.as<float>(), n), tensors,
                                options);
        reducer.begin();
        // The backward pass queues kernels while buckets go: here, the tensors in reverse.
        for (size_t t = tensors.size(); t-- > 0;) {
          ops.scale(static_cast<int64_t>(tensors[t].size()), 1.0f,
                    grads.as<float>() + tensors[t].offset);
          reducer.ready(tensors[t].offset);
        }
        reducer.finish();
        const auto out = download<float>(ops, grads.data(), n + 1);
        CHECK(out[n] == 1.0f);
        size_t wrong = 0;
        for (size_t i = 0; i < n; ++i) {
          double expected = 0;
          for (int r = 0; r < ranks; ++r)
            expected += pattern_value(r, i);
          // Small integers are exact in 16 bits; int8 is within its blocks' scales (50 / 127).
          const double tolerance = std::string(wire) == "int8" ? 0.5 * ranks : 0.0;
          wrong += std::abs(out[i] - expected) > tolerance;
        }
        CHECK_MESSAGE(wrong == 0, wrong << " of " << n << " sums wrong");
      });
    }
  }
}

TEST_CASE("nccl: the legacy default stream as the compute stream") {
  require_nccl();
  LoopbackStore loopback;
  NcclOptions options;  // compute_stream null
  options.timeout = 60s;
  NcclCommunicator comm(loopback.store, 0, 1, options);
  Ops& ops = gputest::gpu();
  const std::vector<float> values = {1, -2, 3.5f};
  Buffer data = upload(ops, values);
  comm.allreduce(data.as<float>(), values.size(), ReduceOp::sum);
  CHECK(download<float>(ops, data.data(), values.size()) == values);
}

TEST_CASE("nccl: 2 ranks on cuda:0 and cuda:1 (needs two devices)") {
  require_nccl();
  if (kernels::device_count() < 2) {
    MESSAGE("one CUDA device: the 2-rank NCCL tests need two");
    return;
  }
  run_ranks(2, [](NcclCommunicator& comm, Ops& ops) {
    exercise_collectives(comm, ops);
    check_compute_stream_order(comm, ops);
    // Point to point: rank 0 sends first, rank 1 receives first, then the other way.
    const size_t n = 12345;
    const int peer = 1 - comm.rank();
    Buffer buffer = upload(ops, pattern<float>(comm.rank(), n));
    Buffer received = ops.allocate(n * sizeof(float));
    std::vector<float> host_received(n, 0.0f);
    if (comm.rank() == 0) {
      comm.send(buffer.data(), n * sizeof(float), peer);
      comm.recv(host_received.data(), n * sizeof(float), peer);
    } else {
      comm.recv(received.data(), n * sizeof(float), peer);
      const std::vector<float> host_send = pattern<float>(comm.rank(), n);
      comm.send(host_send.data(), n * sizeof(float), peer);
    }
    std::vector<double> want(n);
    for (size_t i = 0; i < n; ++i)
      want[i] = pattern_value(peer, i);
    if (comm.rank() == 0) {
      check_equal(host_received, want, "recv into host memory");
    } else {
      check_equal(download<float>(ops, received.data(), n), want, "recv into device memory");
    }
  });
}

// Set in the environment of the child process run_isolated starts: there, the test case runs its
// checks instead of starting another child.
constexpr const char* kIsolatedEnv = "DPTRAIN_GPU_TEST_ISOLATED";

struct Isolated {
  int exit_code = -1;  // 128 + signal when killed by one
  bool timed_out = false;
  std::string output;  // stdout and stderr
};

// Runs this test binary's test cases named by `filter` (a doctest name pattern, without commas)
// in a child process with kIsolatedEnv set, killed after `limit`: a hang there costs those tests,
// not the results of the rest of the file.
Isolated run_isolated(const std::string& filter, std::chrono::seconds limit) {
  char output_path[] = "/tmp/dptrain-gpu-isolated-XXXXXX";
  const int output = ::mkstemp(output_path);
  REQUIRE_MESSAGE(output >= 0, "mkstemp failed");
  // Everything the child needs is made before fork: after it, only exec.
  const std::string self = std::filesystem::read_symlink("/proc/self/exe").string();
  std::vector<std::string> args = {self, "--test-case=" + filter, "--no-intro"};
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e)
    env.emplace_back(*e);
  env.push_back(std::string(kIsolatedEnv) + "=1");
  std::vector<char*> argv, envp;
  for (std::string& a : args)
    argv.push_back(a.data());
  argv.push_back(nullptr);
  for (std::string& e : env)
    envp.push_back(e.data());
  envp.push_back(nullptr);
  const pid_t pid = ::fork();
  if (pid == 0) {
    ::dup2(output, 1);
    ::dup2(output, 2);
    ::execve(argv[0], argv.data(), envp.data());
    ::_exit(127);
  }
  ::close(output);
  Isolated result;
  if (pid < 0) {
    ::unlink(output_path);
    FAIL("fork failed");
  }
  const auto deadline = std::chrono::steady_clock::now() + limit;
  int status = 0;
  while (::waitpid(pid, &status, WNOHANG) != pid) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      result.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(20ms);
  }
  result.exit_code = WIFEXITED(status)     ? WEXITSTATUS(status)
                     : WIFSIGNALED(status) ? 128 + WTERMSIG(status)
                                           : -1;
  std::ifstream in(output_path);
  result.output.assign(std::istreambuf_iterator<char>(in), {});
  ::unlink(output_path);
  return result;
}

// True in the child process run_isolated started: the caller runs its checks there. Elsewhere,
// runs the test case `filter` names in such a child, checks that it passed within `limit`, and
// returns false.
bool isolated_here(const std::string& filter, std::chrono::seconds limit) {
  if (std::getenv(kIsolatedEnv) != nullptr) return true;
  const Isolated child = run_isolated(filter, limit);
  INFO("the test's own output:\n" << child.output);
  CHECK_MESSAGE(!child.timed_out, "the test hung: killed after " << limit.count() << " s");
  CHECK(child.exit_code == 0);
  // It ran, not a filter that matched nothing (which exits 0 as well).
  CHECK(child.output.find(" 1 passed") != std::string::npos);
  return false;
}

TEST_CASE("nccl: a rank that never comes -> NCCL init times out and aborts, naming the rank") {
  require_nccl();
  // The checks below rely on ncclCommAbort returning while NCCL's init waits in its bootstrap
  // for the missing rank. Should it hang instead, only this test is lost.
  if (!isolated_here("nccl: a rank that never comes*", 45s)) return;
  LoopbackStore loopback;
  Ops& ops = gputest::gpu();
  const auto start = std::chrono::steady_clock::now();
  // Rank 0 of 2 publishes the id and waits in NCCL's init for rank 1, which never comes.
  CHECK_THROWS_WITH_AS(NcclCommunicator(loopback.store, 0, 2, options_for(ops, 0, 3s)),
                       "rank 0: NCCL init of 2 rank(s) on cuda:0 timed out after 3s (NCCL); "
                       "communicator aborted",
                       Error);
  CHECK(std::chrono::steady_clock::now() - start < 60s);
  // Rank 1 of 2 in a generation where rank 0 never published its id: the store's deadline.
  PrefixStore later("gen2", loopback.client);
  CHECK_THROWS_WITH_AS(NcclCommunicator(later, 1, 2, options_for(ops, 0, 1s)),
                       doctest::Contains("rank 1: NCCL init of 2 rank(s) on cuda:0: no unique id "
                                         "from rank 0: timed out after 1s"),
                       Error);
  // The communicator still works afterwards in this process (aborting left NCCL usable).
  PrefixStore fresh("gen3", loopback.client);
  NcclCommunicator comm(fresh, 0, 1, options_for(ops, 0));
  double value = 2;
  comm.allreduce(&value, 1, ReduceOp::sum);
  CHECK(value == 2);
  // Rank 1 of 2 where rank 0 was started as a world of 1: told so at once, a usage error.
  try {
    NcclCommunicator wrong(fresh, 1, 2, options_for(ops, 0, 10s));
    FAIL("a rank of another world size joined");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::usage);
    CHECK(std::string(e.what()) ==
          "rank 1: rank 0 was started with another world size than this rank's 2 (it was given "
          "1): start every rank with the same world size");
  }
}

TEST_CASE(
    "nccl: a collective held past its deadline times out, aborts, later calls refuse (1 GPU)") {
  require_nccl();
  // What a collective a peer never joins does, on one device: the compute stream is held (a
  // gate) past the collective's deadline, and the collective starts only after the work queued
  // there. ncclCommAbort waits for the device's queued work (seen on an H200: the abort returned
  // only when the gate did), so a thread opens the gate 4 s after the deadline, as a finished
  // kernel would; the verdict was reached by then. Should the abort hang even so, only this test
  // is lost.
  if (!isolated_here("nccl: a collective held past its deadline*", 60s)) return;
  LoopbackStore loopback;
  Ops& ops = gputest::gpu();
  // 5 s: the communicator's init (in a fresh process) must fit in it too.
  NcclCommunicator comm(loopback.store, 0, 1, options_for(ops, 0, 5s));
  Buffer data = upload(ops, std::vector<float>(1024, 1.0f));
  ops.synchronize();
  std::string error;
  std::chrono::steady_clock::duration took{};
  {
    StreamGate gate(static_cast<cudaStream_t>(kernels::compute_stream(ops)), 30s);
    std::atomic<bool> held_until_opened{false};
    std::thread opener([&] {
      std::this_thread::sleep_for(9s);
      held_until_opened = gate.open();
    });
    const auto start = std::chrono::steady_clock::now();
    try {
      comm.allreduce(data.as<float>(), 1024, ReduceOp::sum);
    } catch (const Error& e) {
      error = e.what();
    }
    took = std::chrono::steady_clock::now() - start;
    opener.join();
    CHECK_MESSAGE(held_until_opened, "the gate gave up (30 s) before the opener opened it (9 s)");
  }
  CHECK_MESSAGE(took >= 5s, "the collective returned before its deadline");
  CHECK_MESSAGE(took < 25s, "the abort did not return once the stream could run");
  CHECK(error ==
        "rank 0: allreduce(sum) of 1024 floats timed out after 5s (NCCL); communicator aborted");
  std::string later;
  try {
    comm.barrier();
  } catch (const Error& e) {
    later = e.what();
  }
  CHECK_MESSAGE(
      later.rfind("rank 0: cannot run barrier: the communicator failed earlier: ", 0) == 0, later);
  // The op table goes on: the compute stream was not left waiting for the aborted collective.
  const auto back = download<float>(ops, data.data(), 1024);
  CHECK(std::count(back.begin(), back.end(), 1.0f) == 1024);
}

TEST_CASE("nccl: a collective a peer skips times out, aborts, and later calls refuse to run") {
  require_nccl();
  if (kernels::device_count() < 2) {
    MESSAGE("one CUDA device: the 2-rank NCCL tests need two");
    return;
  }
  std::atomic<bool> rank0_done{false};
  std::string rank0_error;
  std::string rank0_later;
  run_ranks(
      2,
      [&](NcclCommunicator& comm, Ops& ops) {
        Buffer data = ops.allocate(1024 * sizeof(float));
        if (comm.rank() == 0) {
          try {
            comm.allreduce(data.as<float>(), 1024, ReduceOp::sum);
          } catch (const Error& error) {
            rank0_error = error.what();
          }
          try {
            comm.barrier();
          } catch (const Error& error) {
            rank0_later = error.what();
          }
          rank0_done = true;
        } else {
          while (!rank0_done)
            std::this_thread::sleep_for(10ms);
        }
        // Rank 1's destructor then finalizes against an aborted peer: bounded by its deadline.
      },
      3s);
  CHECK(rank0_error ==
        "rank 0: allreduce(sum) of 1024 floats timed out after 3s (NCCL); communicator aborted");
  CHECK_MESSAGE(
      rank0_later.rfind("rank 0: cannot run barrier: the communicator failed earlier: ", 0) == 0,
      rank0_later);
}

// Runs `dptrain ARGS`, returning its exit status, stdout and stderr.
struct Command {
  int status = -1;
  std::string out;
  std::string err;
};
Command run_dptrain(const std::string& args) {
  char pattern[] = "/tmp/dptrain-nccl-test-XXXXXX";
  REQUIRE(mkdtemp(pattern) != nullptr);
  const std::filesystem::path dir = pattern;
  const std::string line =
      fmt::format("'{}' {} --runs-root '{}' > '{}' 2> '{}'", test::binary(), args,
                  (dir / "runs").string(), (dir / "out").string(), (dir / "err").string());
  Command c;
  const int raw = std::system(line.c_str());
  c.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : -1;
  const auto read = [](const std::filesystem::path& path) {
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  c.out = read(dir / "out");
  c.err = read(dir / "err");
  std::filesystem::remove_all(dir);
  return c;
}

TEST_CASE("nccl: dptrain bench comm --backend nccl, every collective and type, checked exactly") {
  require_nccl();
  const int ranks = std::min(kernels::device_count(), 2);
  for (const auto& [dtype, redop] : {std::pair{"float", "sum"}, std::pair{"half", "avg"},
                                     std::pair{"bf16", "max"}, std::pair{"float", "min"}}) {
    CAPTURE(dtype);
    const Command c = run_dptrain(fmt::format(
        "bench comm --backend nccl --nproc {} --op all -d {} --redop {} -b 8 -e 4M -f 16 -w 2 "
        "-n 5 --json",
        ranks, dtype, redop));
    REQUIRE_MESSAGE(c.status == 0, c.err);
    const auto j = nlohmann::json::parse(c.out);
    CHECK(j["backend"] == "nccl");
    CHECK(j["ranks"] == ranks);
    CHECK(j["status"] == "ok");
    CHECK(j["wrong"] == 0);
    CHECK(j["rows"].size() == 4 * 5);  // 8 B to 512 KiB
    for (const auto& row : j["rows"]) {
      CAPTURE(row.dump());
      CHECK(row["wrong"] == 0);
      if (row["size"].get<uint64_t>() > 0) CHECK(row["time_us"].get<double>() > 0);
    }
    // Rank 0 said which NCCL it loaded.
    CHECK_MESSAGE(c.err.find("bench comm: nccl 2.") != std::string::npos, c.err);
  }
}

}  // namespace
}  // namespace dptrain
