// NcclCommunicator: NCCL loaded with dlopen, one non-blocking communicator per generation, a
// communication stream ordered after the compute stream with events, and a host-side wait that
// polls NCCL for errors and aborts the communicator at the deadline, so no rank hangs.
#include "core/comm/nccl_communicator.hpp"

#include <fmt/format.h>

#include "core/error.hpp"

#ifdef DPTRAIN_HAVE_CUDA
#include "core/dynamic_library.hpp"

#include <cuda_runtime.h>
#include <dlfcn.h>
#include <nccl.h>

#include <algorithm>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <thread>
#include <utility>
#endif

namespace dptrain {

namespace {

// The element types of the reducing collectives.
enum class Element { f32, f64, f16, bf16 };

void check_rank(int rank, int size) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw Error(
        ErrorKind::usage,
        fmt::format("rank {} does not fit a world of size {} (need 0 <= rank < size)", rank, size));
  }
}

// The store key rank 0 publishes the unique id under (in the caller's per-generation prefix),
// and the two forms of its value: the id, or why rank 0 could not start NCCL, so the other ranks
// fail at once instead of at their deadline.
constexpr const char* kUniqueIdKey = "nccl/unique_id";
constexpr const char* kErrorTag = "error:";

void publish_failure(Store& store, const std::string& reason) {
  try {
    store.set(kUniqueIdKey, kErrorTag + reason);
  } catch (const std::exception&) {
    // The store is gone too: the other ranks time out on their own.
  }
}

}  // namespace

#ifdef DPTRAIN_HAVE_CUDA

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kIdTag = "id:";

void check_peer(int rank, int size, int peer, const char* role) {
  if (peer < 0 || peer >= size) {
    throw Error(ErrorKind::internal,
                fmt::format("rank {}: {} {} is outside 0..{}", rank, role, peer, size - 1));
  }
}

// NCCL's version codes from 2.9 on: major * 10000 + minor * 100 + patch.
constexpr int kMinimumVersion = 21800;

std::string version_text(int code) {
  return fmt::format("{}.{}.{}", code / 10000, code / 100 % 100, code % 100);
}

// The NCCL entry points dptrain uses, bound by dlsym: the binary runs (on the CPU) where NCCL is
// not installed, and a GPU machine may provide it from elsewhere (PyTorch's wheel).
struct NcclLibrary {
  std::string name;  // as given to dlopen
  int version = 0;
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRankConfig) comm_init_rank_config = nullptr;
  decltype(&ncclCommGetAsyncError) comm_get_async_error = nullptr;
  decltype(&ncclCommFinalize) comm_finalize = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclGetErrorString) get_error_string = nullptr;
  decltype(&ncclGetLastError) get_last_error = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclReduceScatter) reduce_scatter = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclSend) send = nullptr;
  decltype(&ncclRecv) recv = nullptr;
};

struct LoadedNccl {
  std::optional<NcclLibrary> library;
  std::string reason;  // why not, when library is empty
};

LoadedNccl load_nccl() {
  LoadedNccl loaded;
  const char* configured = std::getenv("DPTRAIN_NCCL_LIBRARY");
  DynamicLibrary library(configured != nullptr && *configured != '\0' ? configured
                                                                      : "libnccl.so.2");
  NcclLibrary nccl;
  nccl.name = library.name();
  library.bind("ncclGetVersion", nccl.get_version);
  library.bind("ncclGetUniqueId", nccl.get_unique_id);
  library.bind("ncclCommInitRankConfig", nccl.comm_init_rank_config);
  library.bind("ncclCommGetAsyncError", nccl.comm_get_async_error);
  library.bind("ncclCommFinalize", nccl.comm_finalize);
  library.bind("ncclCommDestroy", nccl.comm_destroy);
  library.bind("ncclCommAbort", nccl.comm_abort);
  library.bind("ncclGetErrorString", nccl.get_error_string);
  library.bind("ncclGetLastError", nccl.get_last_error);
  library.bind("ncclAllReduce", nccl.all_reduce);
  library.bind("ncclReduceScatter", nccl.reduce_scatter);
  library.bind("ncclBroadcast", nccl.broadcast);
  library.bind("ncclAllGather", nccl.all_gather);
  library.bind("ncclSend", nccl.send);
  library.bind("ncclRecv", nccl.recv);
  if (std::string problem = library.problem(); !problem.empty()) {
    loaded.reason =
        library.loaded() ? problem + " (dptrain needs NCCL 2.18 or newer)" : std::move(problem);
    return loaded;
  }
  const std::string& name = nccl.name;
  int version = 0;
  const ncclResult_t result = nccl.get_version(&version);
  if (result != ncclSuccess) {
    loaded.reason =
        fmt::format("{}: ncclGetVersion failed: {}", name, nccl.get_error_string(result));
    return loaded;
  }
  if (version < kMinimumVersion) {
    loaded.reason = fmt::format("{} is NCCL {}; dptrain needs 2.18 or newer", name,
                                version < 10000 ? std::to_string(version) : version_text(version));
    return loaded;
  }
  nccl.version = version;
  loaded.library = std::move(nccl);
  return loaded;
}

// Loaded on first use, once per process (thread-safe static initialisation).
const LoadedNccl& loaded_nccl() {
  static const LoadedNccl loaded = load_nccl();
  return loaded;
}

// Visible devices, or why there are none.
int visible_devices(std::string* why) {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    cudaGetLastError();  // not sticky; leave no error behind for the next call
    if (why != nullptr) {
      // The runtime reports a missing driver as one too old for it: say which it is.
      const bool no_driver = error == cudaErrorInsufficientDriver &&
                             dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD) == nullptr;
      *why = no_driver ? "no CUDA driver (libcuda.so.1) is installed" : cudaGetErrorString(error);
    }
    return 0;
  }
  return count;
}

ncclDataType_t nccl_type(Element element) {
  switch (element) {
    case Element::f32:
      return ncclFloat32;
    case Element::f64:
      return ncclFloat64;
    case Element::f16:
      return ncclFloat16;
    case Element::bf16:
      return ncclBfloat16;
  }
  throw Error(ErrorKind::internal, "unknown element type");
}

size_t element_size(Element element) {
  return element == Element::f64 ? 8 : element == Element::f32 ? 4 : 2;
}

const char* element_plural(Element element) {
  switch (element) {
    case Element::f32:
      return "floats";
    case Element::f64:
      return "doubles";
    case Element::f16:
      return "halves";
    case Element::bf16:
      return "bfloat16s";
  }
  return "elements";
}

ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
      return ncclSum;
    case ReduceOp::avg:
      return ncclAvg;
    case ReduceOp::max:
      return ncclMax;
    case ReduceOp::min:
      return ncclMin;
  }
  throw Error(ErrorKind::internal, "unknown ReduceOp");
}

size_t align_up(size_t bytes) {
  constexpr size_t kAlignment = 256;
  return (bytes + kAlignment - 1) / kAlignment * kAlignment;
}

// Between polls: spin (yielding) while a collective is young, so short ones are timed and
// returned promptly; then sleep briefly, so a long one does not burn a core.
void pause(Clock::duration waited) {
  if (waited < std::chrono::milliseconds(20)) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(50));
  }
}

using Describe = std::function<std::string()>;

}  // namespace

struct NcclCommunicator::State {
  State(const NcclLibrary& library, int this_rank, int world_size, const NcclOptions& options)
      : nccl(library),
        rank(this_rank),
        size(world_size),
        device(options.device),
        timeout(options.timeout),
        compute(static_cast<cudaStream_t>(options.compute_stream)) {}
  ~State();
  State(const State&) = delete;
  State& operator=(const State&) = delete;

  // Rendezvous and NCCL's init; `published` tells whether rank 0 got as far as publishing the id.
  void init(Store& store);
  bool published = false;
  void allreduce(void* data, size_t count, Element element, ReduceOp op);
  void reduce_scatter(const void* in, void* out, size_t count, Element element, ReduceOp op);
  void broadcast(void* data, size_t bytes, int root);
  void allgather(const void* in, size_t bytes_per_rank, void* out);
  void barrier();
  void send(const void* data, size_t bytes, int peer);
  void recv(void* data, size_t bytes, int peer);
  void start_after(void* marker) { after = static_cast<cudaEvent_t>(marker); }
  // Clears start_after's marker as a call ends, however it ends (an early return for nothing to
  // move, a refusal): the next, unrelated call must not wait on it.
  struct ForgetMarker {
    cudaEvent_t& marker;
    ~ForgetMarker() { marker = nullptr; }
  };
  std::string describe() const {
    return fmt::format("nccl {} on cuda:{}", version_text(nccl.version), device);
  }

 private:
  // Runs one NCCL call: host operands staged through the scratch buffer, the communication
  // stream ordered after the compute stream, then a host wait for completion (polling NCCL for
  // errors, up to the deadline), then the compute stream ordered after it. `in`/`out` may be
  // null (send, recv, barrier) or equal (in place).
  void run(const Describe& what, const void* in, size_t in_bytes, void* out, size_t out_bytes,
           const std::function<ncclResult_t(const void*, void*)>& call);
  bool is_host(const void* pointer, const Describe& what);
  void ensure_scratch(size_t bytes, const Describe& what);
  void select_device(const Describe& what);
  // Waits until NCCL's state of the communicator is no longer ncclInProgress (a non-blocking
  // init or enqueue).
  void wait_ready(const Describe& what, Clock::time_point deadline);
  // Waits until the `done` event has completed.
  void wait_done(const Describe& what, Clock::time_point deadline);
  // Error(comm) when NCCL reports an error on the communicator (aborting it).
  void check_async(const Describe& what);
  void check_cuda(cudaError_t error, const Describe& what, const char* call);
  [[noreturn]] void fail_nccl(const Describe& what, ncclResult_t result);
  [[noreturn]] void fail_timeout(const Describe& what);
  void abort();

  const NcclLibrary& nccl;
  const int rank;
  const int size;
  const int device;
  const std::chrono::milliseconds timeout;
  cudaStream_t compute;           // the op table's; null: the legacy default stream
  cudaStream_t stream = nullptr;  // communication, non-blocking
  cudaEvent_t ready = nullptr;    // recorded on `compute` before each call, unless
  cudaEvent_t after = nullptr;    // the caller's event (start_after) orders the next one
  cudaEvent_t done = nullptr;     // recorded on `stream` after each call
  ncclComm_t comm = nullptr;
  void* scratch = nullptr;  // grow-only staging for host operands
  size_t scratch_bytes = 0;
  std::string failure;  // set by the first failure; later calls refuse to run
  // Exceptions in flight when this was made: more at destruction means an error is unwinding
  // through the communicator's owner.
  const int uncaught_at_start = std::uncaught_exceptions();
};

NcclCommunicator::State::~State() {
  // Never throws: a destructor may run while an error unwinds.
  cudaSetDevice(device);
  // Unwinding from an error that is not NCCL's (the data, a kernel, a checkpoint): the peers may
  // be waiting in a collective this rank will never join, and finalize would wait for them up to
  // the timeout. Abort at once instead; the peers fail at their own deadline either way.
  const bool unwinding = std::uncaught_exceptions() > uncaught_at_start;
  if (comm != nullptr && failure.empty() && !unwinding) {
    // Finalize flushes outstanding work and waits for the peers; it must end by the deadline,
    // or the communicator is aborted instead (a peer that died cannot hang this rank's exit).
    bool finalized = false;
    const ncclResult_t result = nccl.comm_finalize(comm);
    if (result == ncclSuccess || result == ncclInProgress) {
      const auto start = Clock::now();
      const auto deadline = start + timeout;
      while (true) {
        ncclResult_t state = ncclSuccess;
        if (nccl.comm_get_async_error(comm, &state) != ncclSuccess) break;
        if (state == ncclSuccess) {
          finalized = true;
          break;
        }
        if (state != ncclInProgress || Clock::now() >= deadline) break;
        pause(Clock::now() - start);
      }
    }
    if (finalized) {
      nccl.comm_destroy(comm);
      comm = nullptr;
    }
  }
  if (comm != nullptr) nccl.comm_abort(comm);
  comm = nullptr;
  if (done != nullptr) cudaEventDestroy(done);
  if (ready != nullptr) cudaEventDestroy(ready);
  if (stream != nullptr) cudaStreamDestroy(stream);
  if (scratch != nullptr) cudaFree(scratch);
  cudaGetLastError();
}

void NcclCommunicator::State::abort() {
  if (comm != nullptr) nccl.comm_abort(comm);
  comm = nullptr;
}

void NcclCommunicator::State::fail_nccl(const Describe& what, ncclResult_t result) {
  std::string cause = nccl.get_error_string(result);
  const char* last = comm != nullptr ? nccl.get_last_error(comm) : nullptr;
  if (last != nullptr && *last != '\0') cause += fmt::format(" ({})", last);
  abort();
  failure = cause;
  throw Error(ErrorKind::comm, fmt::format("rank {}: {} failed: {}", rank, what(), cause));
}

void NcclCommunicator::State::fail_timeout(const Describe& what) {
  abort();
  failure = fmt::format("timed out after {}", format_timeout(timeout));
  throw Error(ErrorKind::comm, fmt::format("rank {}: {} timed out after {} (NCCL); communicator "
                                           "aborted",
                                           rank, what(), format_timeout(timeout)));
}

void NcclCommunicator::State::check_cuda(cudaError_t error, const Describe& what,
                                         const char* call) {
  if (error == cudaSuccess) return;
  cudaGetLastError();
  const std::string cause = fmt::format("{} failed: {}", call, cudaGetErrorString(error));
  abort();
  failure = cause;
  throw Error(ErrorKind::cuda,
              fmt::format("rank {}: {} on cuda:{}: {}", rank, what(), device, cause));
}

void NcclCommunicator::State::check_async(const Describe& what) {
  ncclResult_t state = ncclSuccess;
  const ncclResult_t result = nccl.comm_get_async_error(comm, &state);
  if (result != ncclSuccess) fail_nccl(what, result);
  if (state != ncclSuccess && state != ncclInProgress) fail_nccl(what, state);
}

void NcclCommunicator::State::wait_ready(const Describe& what, Clock::time_point deadline) {
  const auto start = Clock::now();
  while (true) {
    ncclResult_t state = ncclSuccess;
    const ncclResult_t result = nccl.comm_get_async_error(comm, &state);
    if (result != ncclSuccess) fail_nccl(what, result);
    if (state == ncclSuccess) return;
    if (state != ncclInProgress) fail_nccl(what, state);
    const auto now = Clock::now();
    if (now >= deadline) fail_timeout(what);
    pause(now - start);
  }
}

void NcclCommunicator::State::wait_done(const Describe& what, Clock::time_point deadline) {
  const auto start = Clock::now();
  while (true) {
    const cudaError_t query = cudaEventQuery(done);
    if (query == cudaSuccess) return;
    if (query != cudaErrorNotReady) check_cuda(query, what, "cudaEventQuery");
    // The runtime keeps "not ready" as this thread's last error, and the op table's next
    // launch check (cudaGetLastError) would report it as a failed kernel: clear it.
    if (cudaPeekAtLastError() == cudaErrorNotReady) static_cast<void>(cudaGetLastError());
    check_async(what);
    const auto now = Clock::now();
    if (now >= deadline) fail_timeout(what);
    pause(now - start);
  }
}

void NcclCommunicator::State::select_device(const Describe& what) {
  check_cuda(cudaSetDevice(device), what, "cudaSetDevice");
}

bool NcclCommunicator::State::is_host(const void* pointer, const Describe& what) {
  cudaPointerAttributes attributes{};
  if (cudaPointerGetAttributes(&attributes, pointer) != cudaSuccess) {
    cudaGetLastError();  // runtimes before 11 reject plain host memory: it is host memory
    return true;
  }
  if (attributes.type == cudaMemoryTypeHost || attributes.type == cudaMemoryTypeUnregistered) {
    return true;
  }
  if (attributes.type == cudaMemoryTypeDevice && attributes.device != device) {
    throw Error(ErrorKind::internal,
                fmt::format("rank {}: {}: a buffer is on cuda:{} but the communicator is on "
                            "cuda:{}",
                            rank, what(), attributes.device, device));
  }
  return false;
}

// Staging for host operands kept between collectives; larger buffers are freed after use.
constexpr size_t kKeepScratchBytes = size_t{64} << 20;

void NcclCommunicator::State::ensure_scratch(size_t bytes, const Describe& what) {
  if (bytes <= scratch_bytes) return;
  // Every earlier call has completed (each one waits), so the old buffer is free.
  const size_t grown = std::max({bytes, size_t{4096}, 2 * scratch_bytes});
  if (scratch != nullptr) check_cuda(cudaFree(scratch), what, "cudaFree");
  scratch = nullptr;
  scratch_bytes = 0;
  check_cuda(cudaMalloc(&scratch, grown), what, "cudaMalloc of the staging buffer");
  scratch_bytes = grown;
  // On the communicator's stream: a plain cudaMemset runs on the legacy default stream, which
  // does not order against this non-blocking stream, and could land after the staged input.
  check_cuda(cudaMemsetAsync(scratch, 0, grown, stream), what, "cudaMemsetAsync");
}

void NcclCommunicator::State::init(Store& store) {
  const Describe what = [this] {
    return fmt::format("NCCL init of {} rank(s) on cuda:{}", size, device);
  };
  std::string why;
  const int devices = visible_devices(&why);
  if (device < 0 || device >= devices) {
    failure = "no such device";
    throw Error(ErrorKind::comm, fmt::format("rank {}: NCCL cannot use cuda:{}: {} CUDA device(s) "
                                             "are visible",
                                             rank, device, devices));
  }
  select_device(what);
  check_cuda(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), what,
             "cudaStreamCreateWithFlags");
  check_cuda(cudaEventCreateWithFlags(&ready, cudaEventDisableTiming), what, "cudaEventCreate");
  check_cuda(cudaEventCreateWithFlags(&done, cudaEventDisableTiming), what, "cudaEventCreate");

  ncclUniqueId id{};
  if (rank == 0) {
    const ncclResult_t result = nccl.get_unique_id(&id);
    if (result != ncclSuccess) {
      const std::string cause =
          fmt::format("ncclGetUniqueId failed: {}", nccl.get_error_string(result));
      failure = cause;
      throw Error(ErrorKind::comm, fmt::format("rank 0: {} failed: {}", what(), cause));
    }
    // With rank 0's world size after the id: ranks started with another one (by hand, srun)
    // are told so, instead of waiting in ncclCommInitRank until the deadline.
    store.set(kUniqueIdKey,
              kIdTag + std::string(id.internal, sizeof id.internal) + std::to_string(size));
    published = true;
  } else {
    std::string value;
    try {
      value = store.get(kUniqueIdKey, timeout);
    } catch (const Error& error) {
      failure = error.what();
      throw Error(error.kind(), fmt::format("rank {}: {}: no unique id from rank 0: {}", rank,
                                            what(), error.what()));
    }
    if (value.rfind(kErrorTag, 0) == 0) {
      failure = value;
      throw Error(ErrorKind::comm, fmt::format("rank {}: {}: rank 0 could not start NCCL: {}", rank,
                                               what(), value.substr(std::strlen(kErrorTag))));
    }
    const size_t tag = std::strlen(kIdTag);
    const size_t id_end = tag + sizeof id.internal;
    int rank0_size = 0;
    const char* const end = value.data() + value.size();
    if (value.size() <= id_end || value.rfind(kIdTag, 0) != 0 ||
        std::from_chars(value.data() + id_end, end, rank0_size).ptr != end) {
      failure = "bad unique id";
      throw Error(ErrorKind::comm,
                  fmt::format("rank {}: {}: the store's '{}' is not an NCCL unique id ({} bytes)",
                              rank, what(), kUniqueIdKey, value.size()));
    }
    if (rank0_size != size) {
      failure = "another world size";
      throw Error(ErrorKind::usage,
                  fmt::format("rank {}: {}", rank,
                              world_size_mismatch(0, "this rank's", size, rank0_size, "id")));
    }
    std::memcpy(id.internal, value.data() + tag, sizeof id.internal);
  }

  // Non-blocking: init (and every later call) returns at once and is polled, so a peer that
  // never arrives costs this rank its deadline, not a hang.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  const auto deadline = Clock::now() + timeout;
  const ncclResult_t result = nccl.comm_init_rank_config(&comm, size, id, rank, &config);
  if (result != ncclSuccess && result != ncclInProgress) fail_nccl(what, result);
  if (comm == nullptr) fail_nccl(what, ncclInternalError);
  wait_ready(what, deadline);
}

void NcclCommunicator::State::run(const Describe& what, const void* in, size_t in_bytes, void* out,
                                  size_t out_bytes,
                                  const std::function<ncclResult_t(const void*, void*)>& call) {
  const cudaEvent_t marker = std::exchange(after, nullptr);  // for this call only
  if (!failure.empty()) {
    throw Error(ErrorKind::comm,
                fmt::format("rank {}: cannot run {}: the communicator failed earlier: {}", rank,
                            what(), failure));
  }
  select_device(what);
  const bool in_place = in != nullptr && in == out;
  const bool stage_in = in != nullptr && is_host(in, what);
  const bool stage_out = out != nullptr && (in_place ? stage_in : is_host(out, what));
  // Staged operands share the scratch buffer: the input first, the output after it (or in the
  // same place when in place).
  const size_t in_region =
      stage_in ? align_up(in_place ? std::max(in_bytes, out_bytes) : in_bytes) : 0;
  const size_t out_offset = in_place ? 0 : in_region;
  ensure_scratch(stage_out && !in_place ? out_offset + out_bytes : in_region, what);
  auto* base = static_cast<unsigned char*>(scratch);
  const void* device_in = stage_in ? base : in;
  void* device_out = stage_out ? base + out_offset : out;
  if (stage_in) {
    check_cuda(cudaMemcpyAsync(base, in, in_bytes, cudaMemcpyHostToDevice, stream), what,
               "cudaMemcpyAsync to the device");
  }
  const auto deadline = Clock::now() + timeout;
  if (marker == nullptr) {
    check_cuda(cudaEventRecord(ready, compute), what, "cudaEventRecord on the compute stream");
  }
  check_cuda(cudaStreamWaitEvent(stream, marker != nullptr ? marker : ready, 0), what,
             "cudaStreamWaitEvent");
  const ncclResult_t result = call(device_in, device_out);
  if (result == ncclInProgress) {
    wait_ready(what, deadline);
  } else if (result != ncclSuccess) {
    fail_nccl(what, result);
  }
  check_cuda(cudaEventRecord(done, stream), what, "cudaEventRecord on the communication stream");
  wait_done(what, deadline);
  if (stage_out) {
    // After the wait: a copy into pageable memory blocks the host, which must never happen
    // behind a collective that may hang.
    check_cuda(cudaMemcpyAsync(out, device_out, out_bytes, cudaMemcpyDeviceToHost, stream), what,
               "cudaMemcpyAsync to the host");
    check_cuda(cudaStreamSynchronize(stream), what, "cudaStreamSynchronize");
  }
  // Later compute work comes after the collective. (The host wait already ensures it; this keeps
  // it so when collectives overlap compute.)
  check_cuda(cudaStreamWaitEvent(compute, done, 0), what, "cudaStreamWaitEvent");
  // A large host operand (a checkpoint's gathered optimizer state or codec residuals) staged
  // a buffer the run should not keep for good: give it back once the collective is done.
  if (scratch_bytes > kKeepScratchBytes) {
    check_cuda(cudaStreamSynchronize(stream), what, "cudaStreamSynchronize");
    check_cuda(cudaFree(scratch), what, "cudaFree of the staging buffer");
    scratch = nullptr;
    scratch_bytes = 0;
  }
}

void NcclCommunicator::State::allreduce(void* data, size_t count, Element element, ReduceOp op) {
  const ForgetMarker forget{after};  // start_after is for this call only, whatever it does
  if (count == 0) return;
  const size_t bytes = count * element_size(element);
  run(
      [&] {
        return fmt::format("allreduce({}) of {} {}", reduce_op_name(op), count,
                           element_plural(element));
      },
      data, bytes, data, bytes,
      [&](const void* in, void* out) {
        return nccl.all_reduce(in, out, count, nccl_type(element), nccl_op(op), comm, stream);
      });
}

void NcclCommunicator::State::reduce_scatter(const void* in, void* out, size_t count,
                                             Element element, ReduceOp op) {
  const ForgetMarker forget{after};  // start_after is for this call only, whatever it does
  if (count == 0) return;
  const size_t bytes = count * element_size(element);
  run(
      [&] {
        return fmt::format("reduce_scatter({}) of {} {} per rank", reduce_op_name(op), count,
                           element_plural(element));
      },
      in, bytes * static_cast<size_t>(size), out, bytes,
      [&](const void* device_in, void* device_out) {
        return nccl.reduce_scatter(device_in, device_out, count, nccl_type(element), nccl_op(op),
                                   comm, stream);
      });
}

void NcclCommunicator::State::broadcast(void* data, size_t bytes, int root) {
  const ForgetMarker forget{after};  // start_after is for this call only, whatever it does
  check_peer(rank, size, root, "broadcast root");
  if (bytes == 0) return;
  run([&] { return fmt::format("broadcast of {} bytes from rank {}", bytes, root); }, data, bytes,
      data, bytes,
      [&](const void* in, void* out) {
        return nccl.broadcast(in, out, bytes, ncclUint8, root, comm, stream);
      });
}

void NcclCommunicator::State::allgather(const void* in, size_t bytes_per_rank, void* out) {
  const ForgetMarker forget{after};  // start_after is for this call only, whatever it does
  if (bytes_per_rank == 0) return;
  run([&] { return fmt::format("allgather of {} bytes per rank", bytes_per_rank); }, in,
      bytes_per_rank, out, bytes_per_rank * static_cast<size_t>(size),
      [&](const void* device_in, void* device_out) {
        return nccl.all_gather(device_in, device_out, bytes_per_rank, ncclUint8, comm, stream);
      });
}

void NcclCommunicator::State::barrier() {
  const ForgetMarker forget{after};  // start_after is for this call only, whatever it does
  const Describe what = [] { return std::string("barrier"); };
  if (failure.empty()) {
    select_device(what);  // the scratch belongs on this communicator's GPU, whatever the thread's
    ensure_scratch(sizeof(int32_t), what);
  }
  // An allreduce of one int: no rank leaves before every rank has arrived.
  run(what, nullptr, 0, nullptr, 0, [&](const void*, void*) {
    return nccl.all_reduce(scratch, scratch, 1, ncclInt32, ncclSum, comm, stream);
  });
}

void NcclCommunicator::State::send(const void* data, size_t bytes, int peer) {
  const ForgetMarker forget{after};  // start_after is for this call only, whatever it does
  check_peer(rank, size, peer, "send peer");
  if (peer == rank) {
    throw Error(ErrorKind::internal, fmt::format("rank {}: send to itself", rank));
  }
  if (bytes == 0) return;
  run([&] { return fmt::format("send of {} bytes to rank {}", bytes, peer); }, data, bytes, nullptr,
      0,
      [&](const void* in, void*) { return nccl.send(in, bytes, ncclUint8, peer, comm, stream); });
}

void NcclCommunicator::State::recv(void* data, size_t bytes, int peer) {
  const ForgetMarker forget{after};  // start_after is for this call only, whatever it does
  check_peer(rank, size, peer, "recv peer");
  if (peer == rank) {
    throw Error(ErrorKind::internal, fmt::format("rank {}: receive from itself", rank));
  }
  if (bytes == 0) return;
  run([&] { return fmt::format("receive of {} bytes from rank {}", bytes, peer); }, nullptr, 0,
      data, bytes,
      [&](const void*, void* out) { return nccl.recv(out, bytes, ncclUint8, peer, comm, stream); });
}

std::optional<std::string> nccl_unavailable_reason() {
  std::string why;
  if (visible_devices(&why) == 0) {
    return why.empty() ? std::string("no CUDA device is visible")
                       : fmt::format("no CUDA device is visible: {}", why);
  }
  const LoadedNccl& loaded = loaded_nccl();
  if (!loaded.library) return loaded.reason;
  return std::nullopt;
}

NcclCommunicator::NcclCommunicator(Store& store, int rank, int size, const NcclOptions& options)
    : rank_(rank), size_(size) {
  check_rank(rank, size);
  if (const auto reason = nccl_unavailable_reason()) {
    if (rank == 0) publish_failure(store, *reason);
    throw Error(ErrorKind::comm, fmt::format("rank {}: NCCL cannot be used: {}", rank, *reason));
  }
  state_ = std::make_unique<State>(*loaded_nccl().library, rank, size, options);
  try {
    state_->init(store);
  } catch (const std::exception& error) {
    // Rank 0 failed before publishing the id: tell the others at once.
    if (rank == 0 && !state_->published) publish_failure(store, error.what());
    throw;
  }
}

#else  // no CUDA: nothing can be constructed, so the methods below never run.

struct NcclCommunicator::State {
  [[noreturn]] static void none() {
    throw Error(ErrorKind::internal, "NCCL communicator used in a build without CUDA");
  }
  void allreduce(void*, size_t, Element, ReduceOp) { none(); }
  void reduce_scatter(const void*, void*, size_t, Element, ReduceOp) { none(); }
  void broadcast(void*, size_t, int) { none(); }
  void allgather(const void*, size_t, void*) { none(); }
  void barrier() { none(); }
  void send(const void*, size_t, int) { none(); }
  void recv(void*, size_t, int) { none(); }
  void start_after(void*) { none(); }
  std::string describe() const { none(); }
};

std::optional<std::string> nccl_unavailable_reason() {
  return std::string("this build has no CUDA");
}

NcclCommunicator::NcclCommunicator(Store& store, int rank, int size, const NcclOptions&)
    : rank_(rank), size_(size) {
  check_rank(rank, size);
  const std::string reason = *nccl_unavailable_reason();
  if (rank == 0) publish_failure(store, reason);
  throw Error(ErrorKind::comm, fmt::format("rank {}: NCCL cannot be used: {}", rank, reason));
}

#endif  // DPTRAIN_HAVE_CUDA

NcclCommunicator::~NcclCommunicator() = default;

std::string NcclCommunicator::describe() const {
  return state_->describe();
}

void NcclCommunicator::allreduce(float* data, size_t count, ReduceOp op) {
  state_->allreduce(data, count, Element::f32, op);
}
void NcclCommunicator::allreduce(double* data, size_t count, ReduceOp op) {
  state_->allreduce(data, count, Element::f64, op);
}
void NcclCommunicator::allreduce(Half* data, size_t count, ReduceOp op) {
  state_->allreduce(data, count, Element::f16, op);
}
void NcclCommunicator::allreduce(BFloat16* data, size_t count, ReduceOp op) {
  state_->allreduce(data, count, Element::bf16, op);
}
void NcclCommunicator::reduce_scatter(const float* in, float* out, size_t count, ReduceOp op) {
  state_->reduce_scatter(in, out, count, Element::f32, op);
}
void NcclCommunicator::reduce_scatter(const double* in, double* out, size_t count, ReduceOp op) {
  state_->reduce_scatter(in, out, count, Element::f64, op);
}
void NcclCommunicator::reduce_scatter(const Half* in, Half* out, size_t count, ReduceOp op) {
  state_->reduce_scatter(in, out, count, Element::f16, op);
}
void NcclCommunicator::reduce_scatter(const BFloat16* in, BFloat16* out, size_t count,
                                      ReduceOp op) {
  state_->reduce_scatter(in, out, count, Element::bf16, op);
}
void NcclCommunicator::broadcast(void* data, size_t bytes, int root) {
  state_->broadcast(data, bytes, root);
}
void NcclCommunicator::allgather(const void* in, size_t bytes_per_rank, void* out) {
  state_->allgather(in, bytes_per_rank, out);
}
void NcclCommunicator::barrier() {
  state_->barrier();
}
void NcclCommunicator::start_after(void* marker) {
  state_->start_after(marker);
}
void NcclCommunicator::send(const void* data, size_t bytes, int peer) {
  state_->send(data, bytes, peer);
}
void NcclCommunicator::recv(void* data, size_t bytes, int peer) {
  state_->recv(data, bytes, peer);
}

std::unique_ptr<Communicator> make_nccl_communicator(Store& store, int rank, int size,
                                                     const NcclOptions& options) {
  return std::make_unique<NcclCommunicator>(store, rank, size, options);
}

}  // namespace dptrain
