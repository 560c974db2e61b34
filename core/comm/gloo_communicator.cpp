// GlooCommunicator: rendezvous through our Store, collectives through Gloo's algorithms.
#include "core/comm/gloo_communicator.hpp"

#include <gloo/allgather.h>
#include <gloo/allreduce.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <optional>
#include <string_view>
#include <system_error>
#include <type_traits>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.hpp"

namespace dptrain {

namespace {

// Presents our Store to Gloo's rendezvous. Gloo also calls the timeout-less get/wait, expecting
// them to block until the key appears, so those wait up to the communicator's timeout. Gloo's
// keys are the ranks' numbers (each rank sets its own address under it): a wait that times out
// names the ranks that never joined rather than the keys, and a rank number taken twice. Each
// rank's address carries the world size it was given (an 8-byte trailer, taken off before Gloo
// reads it): ranks started with different sizes (by hand, srun) are told so, Error(usage),
// instead of failing on Gloo's "136 vs 272" of the addresses' lengths.
class GlooStoreAdapter : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(dptrain::Store& store, int rank, int size, std::chrono::milliseconds timeout)
      : store_(store), rank_(rank), size_(size), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    std::string value(data.begin(), data.end());
    const bool address = key == std::to_string(rank_);
    if (address) value += size_trailer(size_);
    store_.set(key, value);
    if (address) store_.add(joins_key(rank_), 1);
  }
  std::vector<char> get(const std::string& key) override {
    std::string value;
    waiting({key}, timeout_, [&] { value = store_.get(key, timeout_); });
    if (const int peer = rank_of(key); peer >= 0) {
      const std::string trailer = size_trailer(size_);
      if (!value.ends_with(trailer)) {
        const std::optional<uint32_t> given = peer_size(value);
        throw Error(ErrorKind::usage, world_size_mismatch(peer, "this rank's", size_,
                                                          given ? int64_t{*given} : -1, "address"));
      }
      value.resize(value.size() - trailer.size());
    }
    return std::vector<char>(value.begin(), value.end());
  }
  void wait(const std::vector<std::string>& keys) override {
    waiting(keys, timeout_, [&] { store_.wait(keys, timeout_); });
  }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    waiting(keys, timeout, [&] { store_.wait(keys, timeout); });
  }

 private:
  static std::string joins_key(int rank) { return fmt::format("joins/{}", rank); }

  // "dpws" and the world size, 4 bytes little-endian.
  static constexpr std::string_view kSizeTag = "dpws";
  static std::string size_trailer(int size) {
    const auto n = static_cast<uint32_t>(size);
    return std::string(kSizeTag) +
           std::string{static_cast<char>(n & 0xff), static_cast<char>((n >> 8) & 0xff),
                       static_cast<char>((n >> 16) & 0xff), static_cast<char>((n >> 24) & 0xff)};
  }
  // The world size a peer's address carries; none from a dptrain without the trailer.
  static std::optional<uint32_t> peer_size(const std::string& value) {
    const size_t length = kSizeTag.size() + 4;
    if (value.size() < length ||
        value.compare(value.size() - length, kSizeTag.size(), kSizeTag) != 0)
      return std::nullopt;
    uint32_t n = 0;
    for (size_t i = 0; i < 4; ++i)
      n |= static_cast<uint32_t>(static_cast<unsigned char>(value[value.size() - 4 + i]))
           << (8 * i);
    return n;
  }
  // The rank whose address `key` names, or -1 for another of Gloo's keys.
  int rank_of(const std::string& key) const {
    int r = -1;
    const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), r);
    return ec == std::errc() && end == key.data() + key.size() && r >= 0 && r < size_ ? r : -1;
  }

  template <typename Wait>
  void waiting(const std::vector<std::string>& keys, std::chrono::milliseconds timeout, Wait wait) {
    try {
      wait();
    } catch (const KeyTimeout&) {
      // Only a wait that timed out asks the store which ranks are missing: after a lost
      // connection (a store that is gone) the question would wait to reconnect, and blame them.
      std::vector<int> missing;
      const auto present = store_.peek(keys);
      for (size_t i = 0; i < keys.size(); ++i) {
        if (const int r = rank_of(keys[i]); r >= 0 && !present[i]) missing.push_back(r);
      }
      if (missing.empty()) throw;
      std::string twice;
      if (const int64_t joins = store_.add(joins_key(rank_), 0); joins > 1) {
        twice = fmt::format(
            "; and {} processes joined as rank {}: each rank number must be "
            "given to one process",
            joins, rank_);
      }
      throw Error(
          ErrorKind::comm,
          fmt::format("rank{} {} of {} did not join within {} (nothing from {} at {}){}; {}",
                      missing.size() == 1 ? "" : "s", fmt::join(missing, ", "), size_,
                      format_timeout(timeout), missing.size() == 1 ? "it" : "them",
                      store_.describe(), twice, join_hint(timeout, store_.join_advice())));
    }
  }

  dptrain::Store& store_;
  int rank_, size_;
  std::chrono::milliseconds timeout_;
};

// Gloo prefixes messages with "[/build/…/file.cc:123] "; the source location means nothing to
// users.
std::string without_source_location(const std::string& message) {
  if (message.empty() || message.front() != '[') return message;
  const auto end = message.find("] ");
  return end == std::string::npos ? message : message.substr(end + 2);
}

// A failed GLOO_ENFORCE reads "[enforce fail at file:line] condition. message"; keep the message.
std::string enforce_message(const std::string& message) {
  const std::string rest = without_source_location(message);
  const auto end = rest.find(". ");
  return end == std::string::npos ? rest : rest.substr(end + 2);
}

// Gloo's TCP transport runs a thread of its own (the device's event loop). An error it meets
// there, typically a peer that has already left ("getpeername: Transport endpoint is not
// connected"), is thrown in that thread where nothing can catch it: std::terminate, SIGABRT. That
// reads as a crash of this rank and outranks the peer's own exit 3 as the job's cause. The
// process-wide terminate handler says what it is instead, a communication failure, and exits 3.
std::atomic<int> g_terminate_rank{-1};
std::terminate_handler g_previous_terminate = nullptr;

[[noreturn]] void on_terminate() {
  if (const std::exception_ptr current = std::current_exception()) {
    std::string cause;
    try {
      std::rethrow_exception(current);
    } catch (const gloo::EnforceNotMet& error) {
      cause = enforce_message(error.what());
    } catch (const gloo::Exception& error) {
      cause = without_source_location(error.what());
    } catch (...) {
    }
    if (!cause.empty()) {
      const std::string line = fmt::format(
          "dptrain: error: rank {}: gloo communication failed in Gloo's transport thread: {}\n",
          g_terminate_rank.load(), cause);
      // Straight to the descriptor, no stdio: the main thread may hold its locks. (Ranks flush
      // their stdout after every line they print.)
      [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, line.data(), line.size());
      std::_Exit(exit_code(ErrorKind::comm));
    }
  }
  if (g_previous_terminate != nullptr) g_previous_terminate();
  std::abort();
}

// NaN-propagating, so the result does not depend on which operand the ring hands in first.
template <typename T>
T max_of(T a, T b) {
  return (a > b || std::isnan(a)) ? a : b;
}
template <typename T>
T min_of(T a, T b) {
  return (a < b || std::isnan(a)) ? a : b;
}

template <typename T, ReduceOp Op>
void combine(T* out, const T* a, const T* b, size_t count) {
  using W = Widened<T>;
  if constexpr (std::is_same_v<T, Half> && (Op == ReduceOp::sum || Op == ReduceOp::avg)) {
    // Halves in chunks, converted many at once (F16C): the same sums, several times faster.
    constexpr size_t kChunk = 256;
    float left[kChunk], right[kChunk];
    for (size_t begin = 0; begin < count; begin += kChunk) {
      const size_t n = std::min(kChunk, count - begin);
      to_float(a + begin, left, n);
      to_float(b + begin, right, n);
      for (size_t i = 0; i < n; ++i)
        left[i] += right[i];
      to_half(left, out + begin, n);
    }
    return;
  }
  for (size_t i = 0; i < count; ++i) {
    const auto left = W::up(a[i]);
    const auto right = W::up(b[i]);
    if constexpr (Op == ReduceOp::max) {
      out[i] = W::down(max_of(left, right));
    } else if constexpr (Op == ReduceOp::min) {
      out[i] = W::down(min_of(left, right));
    } else {  // sum, and avg: summed here, divided afterwards
      out[i] = W::down(left + right);
    }
  }
}

// Gloo's allreduce takes untyped functions; its reduce-scatter a typed accumulate-in-place one.
template <typename T, ReduceOp Op>
void combine_untyped(void* out, const void* a, const void* b, size_t count) {
  combine<T, Op>(static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), count);
}
template <typename T, ReduceOp Op>
void accumulate(T* into, const T* other, size_t count) {
  combine<T, Op>(into, into, other, count);
}

template <typename T>
gloo::AllreduceOptions::Func reduce_function(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return combine_untyped<T, ReduceOp::sum>;
    case ReduceOp::max:
      return combine_untyped<T, ReduceOp::max>;
    case ReduceOp::min:
      return combine_untyped<T, ReduceOp::min>;
  }
  throw Error(ErrorKind::internal, "unknown ReduceOp");
}

template <typename T>
typename gloo::ReductionFunction<T>::Function* accumulate_function(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg:
      return accumulate<T, ReduceOp::sum>;
    case ReduceOp::max:
      return accumulate<T, ReduceOp::max>;
    case ReduceOp::min:
      return accumulate<T, ReduceOp::min>;
  }
  throw Error(ErrorKind::internal, "unknown ReduceOp");
}

template <typename T>
void divide_by_size(T* data, size_t count, int size) {
  using W = Widened<T>;
  const auto divisor = static_cast<decltype(W::up(T{}))>(size);
  for (size_t i = 0; i < count; ++i)
    data[i] = W::down(W::up(data[i]) / divisor);
}

void check_broadcast_root(int rank, int size, int root) {
  if (root < 0 || root >= size) {
    throw Error(ErrorKind::internal,
                fmt::format("rank {}: broadcast root {} is outside 0..{}", rank, root, size - 1));
  }
}

// Point-to-point slots. Gloo's collectives match messages by slot: Slot::build(prefix, tag) is
// prefix << 56 | tag << 24, plus a per-step delta in the low 8 bits, with prefixes 0x01..0x08
// (gloo/types.h; the legacy algorithms, unused here, take small slots from Context::nextSlot).
// User messages take prefix 0xd7, which Gloo does not use, so no user tag can ever meet a
// collective's slot, whatever next_tag() has reached. Under the prefix: the user's 32-bit tag,
// then 24 bits hashed from the byte count, so a receive matches only a send of the same size
// (or, with odds of one in 16 million, of a size whose hash is the same: a multiplicative hash, so
// that sizes apart by a power of two, the likely mistakes, do not share one as a fold would).
// Gloo itself would complete a shorter message into a longer buffer as a success (the rest left
// stale), and a longer one fails an assertion on its event-loop thread, which ends the process;
// with the size in the slot either mistake becomes a timeout naming the peer and tag.
constexpr uint64_t kMessageSlotPrefix = 0xd7;

uint64_t message_slot(uint32_t tag, size_t bytes) {
  const auto b = static_cast<uint64_t>(bytes);
  const uint64_t size_bits = (b * 0x9e3779b97f4a7c15ULL) >> 40;  // the top 24 bits
  return kMessageSlotPrefix << 56 | uint64_t{tag} << 24 | size_bits;
}

// One point-to-point transfer, as error messages name it.
struct Transfer {
  bool send;
  size_t bytes;
  std::vector<int> peers;  // the peer, or every candidate sender of a recv_any
  uint32_t tag;

  std::string peer_names() const {
    return peers.size() == 1 ? fmt::format("rank {}", peers.front())
                             : fmt::format("any of ranks {}", fmt::join(peers, ", "));
  }
  // "send of 4096 bytes to rank 2 (tag 7)"
  std::string describe() const {
    return fmt::format("{} of {} bytes {} {} (tag {})", send ? "send" : "recv", bytes,
                       send ? "to" : "from", peer_names(), tag);
  }
};

// Waits for a posted transfer and returns the rank it went to or came from. On failure records
// the cause in `failure` (the communicator's, if it has none yet) and throws Error(comm) the way
// GlooCommunicator::fail does.
int complete(gloo::transport::UnboundBuffer& buffer, const Transfer& transfer, int rank,
             std::chrono::milliseconds timeout, std::string& failure) {
  std::string cause;
  try {
    int peer = -1;
    const bool done =
        transfer.send ? buffer.waitSend(&peer, timeout) : buffer.waitRecv(&peer, timeout);
    if (done) return peer;
    cause = "aborted";
  } catch (const gloo::EnforceNotMet& error) {
    cause = enforce_message(error.what());
  } catch (const gloo::IoException& error) {
    cause = without_source_location(error.what());
    // Gloo's own words ("Timed out waiting 1000ms for recv operation to complete") do not say
    // what was missing. Gloo has also closed every connection of the context by now.
    if (cause.rfind("Timed out waiting", 0) == 0) {
      cause = fmt::format(
          "timed out after {} (the communicator's timeout): no {} of the same size "
          "and tag {} {}",
          format_timeout(timeout), transfer.send ? "receive" : "send",
          transfer.send ? "posted by" : "from", transfer.peer_names());
    }
  } catch (const std::exception& error) {
    cause = without_source_location(error.what());
  }
  if (failure.empty()) failure = cause;
  throw Error(ErrorKind::comm,
              fmt::format("rank {}: gloo {} failed: {}", rank, transfer.describe(), cause));
}

// A posted isend or irecv. It shares the communicator's failure record, not the communicator, so
// it may outlive it (a failed communicator is replaced while its requests are still around).
class GlooRequest : public Communicator::Request {
 public:
  GlooRequest(std::unique_ptr<gloo::transport::UnboundBuffer> buffer, Transfer transfer, int rank,
              std::chrono::milliseconds timeout, std::shared_ptr<std::string> failure)
      : buffer_(std::move(buffer)),
        transfer_(std::move(transfer)),
        rank_(rank),
        timeout_(timeout),
        failure_(std::move(failure)) {}

  // Gloo keeps only a weak reference to the buffer, so releasing it early never lets Gloo write
  // to the caller's memory, but a message then arriving for it wedges that connection: wait.
  // Not on a failed communicator, though: the transfer may never finish there, and the
  // communicator is unusable anyway.
  ~GlooRequest() override {
    if (waited_ || !failure_->empty()) return;
    try {
      wait();
    } catch (...) {  // a destructor must not throw; wait() has recorded the failure
    }
  }

  void wait() override {
    if (error_) std::rethrow_exception(error_);
    if (waited_) return;
    waited_ = true;
    try {
      complete(*buffer_, transfer_, rank_, timeout_, *failure_);
    } catch (...) {
      error_ = std::current_exception();
      throw;
    }
  }

 private:
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer_;
  Transfer transfer_;
  int rank_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<std::string> failure_;
  bool waited_ = false;
  std::exception_ptr error_;  // a failed wait() fails again when repeated
};

// A group of one: every collective is the identity (or a copy), no transport needed.
class SoloCommunicator : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string backend() const override { return "gloo"; }
  void allreduce(float*, size_t, ReduceOp) override {}
  void allreduce(double*, size_t, ReduceOp) override {}
  void allreduce(Half*, size_t, ReduceOp) override {}
  void allreduce(BFloat16*, size_t, ReduceOp) override {}
  void reduce_scatter(const float* in, float* out, size_t count, ReduceOp) override {
    copy(in, out, count);
  }
  void reduce_scatter(const double* in, double* out, size_t count, ReduceOp) override {
    copy(in, out, count);
  }
  void reduce_scatter(const Half* in, Half* out, size_t count, ReduceOp) override {
    copy(in, out, count);
  }
  void reduce_scatter(const BFloat16* in, BFloat16* out, size_t count, ReduceOp) override {
    copy(in, out, count);
  }
  void broadcast(void*, size_t, int root) override { check_broadcast_root(0, 1, root); }
  void allgather(const void* in, size_t bytes_per_rank, void* out) override {
    if (in != out && bytes_per_rank > 0) std::memmove(out, in, bytes_per_rank);
  }
  void barrier() override {}

 private:
  template <typename T>
  static void copy(const T* in, T* out, size_t count) {
    if (count > 0) std::memmove(out, in, count * sizeof(T));
  }
};

class GlooCommunicator : public Communicator {
 public:
  GlooCommunicator(Store& store, int rank, int size, const GlooOptions& options);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string backend() const override { return "gloo"; }
  void allreduce(float* data, size_t count, ReduceOp op) override {
    allreduce_typed(data, count, op);
  }
  void allreduce(double* data, size_t count, ReduceOp op) override {
    allreduce_typed(data, count, op);
  }
  void allreduce(Half* data, size_t count, ReduceOp op) override {
    allreduce_typed(data, count, op);
  }
  void allreduce(BFloat16* data, size_t count, ReduceOp op) override {
    allreduce_typed(data, count, op);
  }
  void reduce_scatter(const float* in, float* out, size_t count, ReduceOp op) override {
    reduce_scatter_typed(in, out, count, op);
  }
  void reduce_scatter(const double* in, double* out, size_t count, ReduceOp op) override {
    reduce_scatter_typed(in, out, count, op);
  }
  void reduce_scatter(const Half* in, Half* out, size_t count, ReduceOp op) override {
    reduce_scatter_typed(in, out, count, op);
  }
  void reduce_scatter(const BFloat16* in, BFloat16* out, size_t count, ReduceOp op) override {
    reduce_scatter_typed(in, out, count, op);
  }
  std::unique_ptr<Request> isend(const void* data, size_t bytes, int peer, uint32_t tag) override;
  std::unique_ptr<Request> irecv(void* data, size_t bytes, int peer, uint32_t tag) override;
  int recv_any(void* data, size_t bytes, const std::vector<int>& peers, uint32_t tag) override;
  void broadcast(void* data, size_t bytes, int root) override;
  void allgather(const void* in, size_t bytes_per_rank, void* out) override;
  void barrier() override;

 private:
  // Throws Error(internal) unless `peer` is another rank of this group.
  void check_peer(const char* operation, int peer, uint32_t tag) const;
  // Posts a send or receive of `transfer` on a new Gloo buffer over `data`.
  std::unique_ptr<gloo::transport::UnboundBuffer> post(void* data, const Transfer& transfer);
  template <typename T>
  void allreduce_typed(T* data, size_t count, ReduceOp op);
  template <typename T>
  void reduce_scatter_typed(const T* in, T* out, size_t count_per_rank, ReduceOp op);
  // Runs a Gloo call, turning whatever it throws into Error(comm) naming rank and operation.
  // `describe` names the operation for messages; called only on failure, so no collective pays
  // for formatting it.
  template <typename Describe, typename Body>
  void guarded(Describe&& describe, Body&& body);
  [[noreturn]] void fail(const std::string& operation, const std::string& cause);
  // Every collective gets its own tag so a fast rank's next message never matches a slow rank's
  // current receive; all ranks call collectives in the same order, so the tags agree.
  uint32_t next_tag() { return next_tag_++; }

  int rank_;
  int size_;
  std::vector<unsigned char> scratch_;  // reduce_scatter's copy of its input
  std::chrono::milliseconds timeout_;
  std::shared_ptr<gloo::rendezvous::Context> context_;
  uint32_t next_tag_ = 0;
  // Set by the first failed call; later calls refuse to run. Shared with the point-to-point
  // requests, which may outlive the communicator.
  std::shared_ptr<std::string> failure_ = std::make_shared<std::string>();
};

template <typename Describe, typename Body>
void GlooCommunicator::guarded(Describe&& describe, Body&& body) {
  if (!failure_->empty()) {
    throw Error(ErrorKind::comm,
                fmt::format("rank {}: cannot run {}: the communicator failed earlier: {}", rank_,
                            describe(), *failure_));
  }
  try {
    body();
  } catch (const gloo::EnforceNotMet& error) {
    fail(describe(), enforce_message(error.what()));
  } catch (const Error& error) {
    // The ranks' own mistakes (a world size that differs) stay theirs; the rest is comm.
    if (error.kind() != ErrorKind::comm) {
      throw Error(error.kind(), fmt::format("rank {}: {}", rank_, error.what()));
    }
    fail(describe(), error.what());
  } catch (const std::exception& error) {
    fail(describe(), without_source_location(error.what()));
  }
}

void GlooCommunicator::fail(const std::string& operation, const std::string& cause) {
  *failure_ = cause;
  throw Error(ErrorKind::comm, fmt::format("rank {}: gloo {} failed: {}{}", rank_, operation, cause,
                                           gloo_cause_note(cause, size_)));
}

GlooCommunicator::GlooCommunicator(Store& store, int rank, int size, const GlooOptions& options)
    : rank_(rank), size_(size), timeout_(options.timeout) {
  install_gloo_terminate_handler(rank);
  guarded(
      [&] {
        return fmt::format("rendezvous of {} ranks via {} on '{}'", size, store.describe(),
                           options.hostname);
      },
      [&] {
        gloo::transport::tcp::attr attributes;
        attributes.hostname = options.hostname;
        auto device = gloo::transport::tcp::CreateDevice(attributes);
        auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
        context->setTimeout(options.timeout);
        GlooStoreAdapter adapter(store, rank, size, options.timeout);
        context->connectFullMesh(adapter, device);
        context_ = std::move(context);
      });
}

template <typename T>
void GlooCommunicator::allreduce_typed(T* data, size_t count, ReduceOp op) {
  if (count == 0) return;
  guarded([&] { return fmt::format("allreduce({}) of {} elements", reduce_op_name(op), count); },
          [&] {
            gloo::AllreduceOptions options(context_);
            options.setOutput(data, count);
            options.setReduceFunction(reduce_function<T>(op));
            // Ring reduces each slice on exactly one rank and then copies it to all: bit-identical
            // everywhere.
            options.setAlgorithm(gloo::AllreduceOptions::Algorithm::RING);
            options.setTag(next_tag());
            options.setTimeout(timeout_);
            gloo::allreduce(options);
          });
  if (op == ReduceOp::avg) divide_by_size(data, count, size_);
}

// An allreduce of the whole input, then this rank's slice. Gloo's own reduce-scatter
// (ReduceScatterHalvingDoubling) returned wrong elements intermittently for 3 and 5 ranks in
// our tests, so it is not used; this moves twice the bytes of a ring reduce-scatter.
template <typename T>
void GlooCommunicator::reduce_scatter_typed(const T* in, T* out, size_t count_per_rank,
                                            ReduceOp op) {
  if (count_per_rank == 0) return;
  const size_t total = count_per_rank * static_cast<size_t>(size_);
  // The whole input is copied into a scratch buffer kept between calls (benchmarks and
  // training repeat the same call; the input is const).
  scratch_.resize(std::max(scratch_.size(), total * sizeof(T)));
  T* work = reinterpret_cast<T*>(scratch_.data());
  std::memcpy(work, in, total * sizeof(T));
  allreduce_typed(work, total, op);
  std::memcpy(out, work + static_cast<size_t>(rank_) * count_per_rank, count_per_rank * sizeof(T));
}

void GlooCommunicator::broadcast(void* data, size_t bytes, int root) {
  check_broadcast_root(rank_, size_, root);
  if (bytes == 0) return;
  guarded([&] { return fmt::format("broadcast of {} bytes from rank {}", bytes, root); },
          [&] {
            gloo::BroadcastOptions options(context_);
            options.setOutput(static_cast<uint8_t*>(data), bytes);
            options.setRoot(root);
            options.setTag(next_tag());
            options.setTimeout(timeout_);
            gloo::broadcast(options);
          });
}

void GlooCommunicator::allgather(const void* in, size_t bytes_per_rank, void* out) {
  if (bytes_per_rank == 0) return;
  guarded([&] { return fmt::format("allgather of {} bytes per rank", bytes_per_rank); },
          [&] {
            auto* output = static_cast<uint8_t*>(out);
            gloo::AllgatherOptions options(context_);
            // Without an input Gloo takes this rank's slice of the output as it is.
            if (in != output + static_cast<size_t>(rank_) * bytes_per_rank) {
              options.setInput(static_cast<uint8_t*>(const_cast<void*>(in)), bytes_per_rank);
            }
            options.setOutput(output, bytes_per_rank * static_cast<size_t>(size_));
            options.setTag(next_tag());
            options.setTimeout(timeout_);
            gloo::allgather(options);
          });
}

void GlooCommunicator::barrier() {
  guarded([] { return std::string("barrier"); },
          [&] {
            gloo::BarrierOptions options(context_);
            options.setTag(next_tag());
            options.setTimeout(timeout_);
            gloo::barrier(options);
          });
}

void GlooCommunicator::check_peer(const char* operation, int peer, uint32_t tag) const {
  const char* direction = std::strcmp(operation, "isend") == 0 ? "to" : "from";
  if (peer == rank_) {
    throw Error(ErrorKind::internal,
                fmt::format("rank {}: {} {} rank {} (tag {}): a rank cannot message itself", rank_,
                            operation, direction, peer, tag));
  }
  if (peer < 0 || peer >= size_) {
    throw Error(ErrorKind::internal,
                fmt::format("rank {}: {} {} rank {} (tag {}): the rank is outside 0..{}", rank_,
                            operation, direction, peer, tag, size_ - 1));
  }
}

std::unique_ptr<gloo::transport::UnboundBuffer> GlooCommunicator::post(void* data,
                                                                       const Transfer& transfer) {
  std::unique_ptr<gloo::transport::UnboundBuffer> buffer;
  guarded([&] { return transfer.describe(); },
          [&] {
            buffer = context_->createUnboundBuffer(data, transfer.bytes);
            const uint64_t slot = message_slot(transfer.tag, transfer.bytes);
            // The byte count is always explicit: Gloo's default rejects an empty recv-from-any.
            if (transfer.send) {
              buffer->send(transfer.peers.front(), slot, 0, transfer.bytes);
            } else if (transfer.peers.size() == 1) {
              buffer->recv(transfer.peers.front(), slot, 0, transfer.bytes);
            } else {
              buffer->recv(transfer.peers, slot, 0, transfer.bytes);
            }
          });
  return buffer;
}

std::unique_ptr<Communicator::Request> GlooCommunicator::isend(const void* data, size_t bytes,
                                                               int peer, uint32_t tag) {
  check_peer("isend", peer, tag);
  Transfer transfer{true, bytes, {peer}, tag};
  // Gloo's buffer is not const-correct; a send only reads it.
  auto buffer = post(const_cast<void*>(data), transfer);
  return std::make_unique<GlooRequest>(std::move(buffer), std::move(transfer), rank_, timeout_,
                                       failure_);
}

std::unique_ptr<Communicator::Request> GlooCommunicator::irecv(void* data, size_t bytes, int peer,
                                                               uint32_t tag) {
  check_peer("irecv", peer, tag);
  Transfer transfer{false, bytes, {peer}, tag};
  auto buffer = post(data, transfer);
  return std::make_unique<GlooRequest>(std::move(buffer), std::move(transfer), rank_, timeout_,
                                       failure_);
}

int GlooCommunicator::recv_any(void* data, size_t bytes, const std::vector<int>& peers,
                               uint32_t tag) {
  if (peers.empty()) {
    throw Error(ErrorKind::internal,
                fmt::format("rank {}: recv_any (tag {}) from an empty list of ranks", rank_, tag));
  }
  for (int peer : peers)
    check_peer("recv_any", peer, tag);
  const Transfer transfer{false, bytes, peers, tag};
  auto buffer = post(data, transfer);
  return complete(*buffer, transfer, rank_, timeout_, *failure_);
}

}  // namespace

std::string gloo_cause_note(const std::string& cause, int world_size) {
  // A connection a peer closed or reset means the peer is gone (it exited or was killed): say
  // so, as the socket error alone reads like a network fault.
  if (cause.find("Connection reset by peer") != std::string::npos ||
      cause.find("Connection closed by peer") != std::string::npos ||
      cause.find("Broken pipe") != std::string::npos) {
    return fmt::format(" ({}: its own exit or log says why)", kPeerGoneNote);
  }
  // Gloo's transport listens on a port of its own for each peer (bound to port 0: the kernel's
  // ephemeral range) until the peer connects, so a machine running many ranks of a large job
  // can run out of them as the ranks meet (a connect that finds none says the second).
  if (cause.find("bind: Address already in use") != std::string::npos ||
      cause.find("Cannot assign requested address") != std::string::npos) {
    return fmt::format(
        " (this machine ran out of ephemeral ports: as the ranks meet, each rank's Gloo listens on "
        "a port of its own for each of its {} peers; run fewer ranks on this machine, or widen "
        "net.ipv4.ip_local_port_range)",
        world_size - 1);
  }
  return "";
}

void install_gloo_terminate_handler(int rank) {
  g_terminate_rank.store(rank);
  static std::once_flag installed;
  std::call_once(installed, [] { g_previous_terminate = std::set_terminate(on_terminate); });
}

std::unique_ptr<Communicator> make_gloo_communicator(Store& store, int rank, int size,
                                                     const GlooOptions& options) {
  if (size < 1 || rank < 0 || rank >= size) {
    throw Error(
        ErrorKind::usage,
        fmt::format("rank {} does not fit a world of size {} (need 0 <= rank < size)", rank, size));
  }
  if (size == 1) return std::make_unique<SoloCommunicator>();
  return std::make_unique<GlooCommunicator>(store, rank, size, options);
}

}  // namespace dptrain
