// Tests for the gloo Communicator: N ranks as threads over a real TcpStoreServer on 127.0.0.1.
#include <doctest/doctest.h>
#include <gloo/common/error.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <mutex>
#include <random>
#include <thread>
#include <type_traits>

#include "core/comm/gloo_communicator.hpp"
#include "core/comm/tcp_store.hpp"
#include "core/error.hpp"
#include "tests/gloo_ranks.hpp"

namespace dptrain {
namespace {

using namespace std::chrono_literals;
using test::run_ranks;

GlooOptions test_options(std::chrono::milliseconds timeout = 30s) {
  GlooOptions options;
  options.timeout = timeout;
  return options;
}

// Small integers, so sums are exact whatever the order and the expected value is easy to state.
template <typename T>
T input_value(int rank, size_t i) {
  return static_cast<T>(static_cast<int>((i * 7 + static_cast<size_t>(rank) * 13) % 101) - 50);
}

template <typename T>
T expected_value(ReduceOp op, int size, size_t i) {
  T sum = 0;
  T max = input_value<T>(0, i);
  T min = max;
  for (int rank = 0; rank < size; ++rank) {
    const T value = input_value<T>(rank, i);
    sum += value;
    max = std::max(max, value);
    min = std::min(min, value);
  }
  switch (op) {
    case ReduceOp::sum:
      return sum;
    case ReduceOp::avg:
      return sum / static_cast<T>(size);
    case ReduceOp::max:
      return max;
    case ReduceOp::min:
      return min;
  }
  return 0;
}

template <typename T>
void check_allreduce(Communicator& communicator, size_t count, ReduceOp op) {
  std::vector<T> data(count);
  for (size_t i = 0; i < count; ++i)
    data[i] = input_value<T>(communicator.rank(), i);
  communicator.allreduce(data.data(), count, op);
  size_t wrong = 0;
  for (size_t i = 0; i < count; ++i) {
    if (data[i] != expected_value<T>(op, communicator.size(), i)) ++wrong;
  }
  CHECK_MESSAGE(wrong == 0, "rank ", communicator.rank(), " ", reduce_op_name(op), " count ", count,
                ": ", wrong, " wrong");
}

TEST_CASE("gloo: allreduce sum/avg/max/min over 1..4 ranks and many counts") {
  for (int size = 1; size <= 4; ++size) {
    CAPTURE(size);
    run_ranks(size, [](Communicator& communicator) {
      for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{4099}}) {
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
          check_allreduce<float>(communicator, count, op);
          check_allreduce<double>(communicator, count, op);
        }
      }
      check_allreduce<float>(communicator, 1000003, ReduceOp::sum);
      check_allreduce<float>(communicator, 1000003, ReduceOp::avg);
    });
  }
}

// The same check for the 16-bit formats and for reduce_scatter: expected values are computed in
// float from the small integers of input_value, then rounded like the communicator rounds.
template <typename T>
using Wide = decltype(Widened<T>::up(T{}));
template <typename T>
Wide<T> widen(T value) {
  return Widened<T>::up(value);
}
template <typename T>
T narrow(Wide<T> value) {
  return Widened<T>::down(value);
}
template <typename T>
Wide<T> expected_narrow(ReduceOp op, int size, size_t i) {
  const auto exact = expected_value<Wide<T>>(op == ReduceOp::avg ? ReduceOp::sum : op, size, i);
  return widen(narrow<T>(op == ReduceOp::avg ? exact / static_cast<Wide<T>>(size) : exact));
}

template <typename T>
void check_allreduce_16(Communicator& communicator, size_t count, ReduceOp op) {
  std::vector<T> data(count);
  for (size_t i = 0; i < count; ++i)
    data[i] = narrow<T>(input_value<Wide<T>>(communicator.rank(), i));
  communicator.allreduce(data.data(), count, op);
  size_t wrong = 0;
  for (size_t i = 0; i < count; ++i)
    wrong += widen(data[i]) != expected_narrow<T>(op, communicator.size(), i);
  CHECK_MESSAGE(wrong == 0, "rank ", communicator.rank(), " ", reduce_op_name(op), " count ", count,
                ": ", wrong, " wrong");
}

template <typename T>
void check_reduce_scatter(Communicator& communicator, size_t per_rank, ReduceOp op) {
  const auto ranks = static_cast<size_t>(communicator.size());
  const auto rank = static_cast<size_t>(communicator.rank());
  std::vector<T> in(per_rank * ranks);
  for (size_t i = 0; i < in.size(); ++i)
    in[i] = narrow<T>(input_value<Wide<T>>(communicator.rank(), i));
  const std::vector<T> before = in;
  std::vector<T> out(per_rank, narrow<T>(999));
  communicator.reduce_scatter(in.data(), out.data(), per_rank, op);
  size_t wrong = 0;
  for (size_t i = 0; i < per_rank; ++i)
    wrong += widen(out[i]) != expected_narrow<T>(op, communicator.size(), rank * per_rank + i);
  CHECK_MESSAGE(wrong == 0, "rank ", rank, " ", reduce_op_name(op), " per rank ", per_rank, ": ",
                wrong, " wrong");
  CHECK(std::memcmp(in.data(), before.data(), in.size() * sizeof(T)) == 0);  // input untouched
}

TEST_CASE("gloo: half and bfloat16 convert to and from float, rounding to nearest even") {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const Half h{static_cast<uint16_t>(bits)};
    const BFloat16 b{static_cast<uint16_t>(bits)};
    const bool half_nan = (bits & 0x7c00) == 0x7c00 && (bits & 0x3ff) != 0;
    const bool bf16_nan = (bits & 0x7f80) == 0x7f80 && (bits & 0x7f) != 0;
    if (half_nan) {
      CHECK(std::isnan(to_float(h)));
      CHECK(std::isnan(to_float(to_half(to_float(h)))));
    } else {
      REQUIRE(to_half(to_float(h)).bits == bits);  // every finite half and both infinities
    }
    if (bf16_nan) {
      CHECK(std::isnan(to_float(to_bfloat16(to_float(b)))));
    } else {
      REQUIRE(to_bfloat16(to_float(b)).bits == bits);
    }
  }
  CHECK(to_float(Half{0x3c00}) == 1.0f);
  CHECK(to_float(Half{0x7bff}) == 65504.0f);
  CHECK(to_float(Half{0x0001}) == std::ldexp(1.0f, -24));  // the smallest subnormal
  CHECK(to_half(65519.0f).bits == 0x7bff);
  CHECK(to_half(65520.0f).bits == 0x7c00);  // halfway to 65536: ties to even = infinity
  CHECK(to_half(-1e9f).bits == 0xfc00);
  CHECK(to_half(2049.0f).bits == to_half(2048.0f).bits);  // tie: down to the even mantissa
  CHECK(to_half(2051.0f).bits == to_half(2052.0f).bits);  // tie: up to the even mantissa
  CHECK(to_half(std::ldexp(1.0f, -25)).bits == 0);        // tie with zero
  CHECK(to_half(std::ldexp(1.5f, -25)).bits == 0x0001);
  CHECK(to_half(std::ldexp(3.0f, -25)).bits == 0x0002);            // 1.5 units: tie, up to even 2
  CHECK(to_half(std::ldexp(1023.5f, -24)).bits == 0x0400);         // rounds up into the normals
  CHECK(to_bfloat16(1.0f + std::ldexp(1.0f, -8)).bits == 0x3f80);  // tie, down to even
  CHECK(to_bfloat16(1.0f + 3 * std::ldexp(1.0f, -8)).bits == 0x3f82);    // tie, up to even
  CHECK(to_bfloat16(std::numeric_limits<float>::max()).bits == 0x7f80);  // rounds to infinity
  CHECK(std::isnan(to_float(to_bfloat16(std::numeric_limits<float>::quiet_NaN()))));
  CHECK(to_float(to_bfloat16(-2.5f)) == -2.5f);
}

TEST_CASE("gloo: allreduce of half and bfloat16 over 1..4 ranks") {
  for (int size = 1; size <= 4; ++size) {
    CAPTURE(size);
    run_ranks(size, [](Communicator& communicator) {
      for (size_t count : {size_t{0}, size_t{1}, size_t{7}, size_t{4099}}) {
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
          check_allreduce_16<Half>(communicator, count, op);
          check_allreduce_16<BFloat16>(communicator, count, op);
        }
      }
    });
  }
}

TEST_CASE("gloo: reduce_scatter of every type over 1..5 ranks and many counts") {
  for (int size = 1; size <= 5; ++size) {
    CAPTURE(size);
    run_ranks(size, [](Communicator& communicator) {
      for (size_t per_rank : {size_t{0}, size_t{1}, size_t{3}, size_t{7}, size_t{1001}}) {
        for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
          check_reduce_scatter<float>(communicator, per_rank, op);
          check_reduce_scatter<double>(communicator, per_rank, op);
          check_reduce_scatter<Half>(communicator, per_rank, op);
          check_reduce_scatter<BFloat16>(communicator, per_rank, op);
        }
      }
      // The same shape again (a reused plan), between other collectives.
      for (int repeat = 0; repeat < 3; ++repeat) {
        check_reduce_scatter<float>(communicator, 100003, ReduceOp::sum);
        check_allreduce<float>(communicator, 1000, ReduceOp::sum);
      }
    });
  }
}

TEST_CASE("gloo: allreduce of arbitrary floats is bit-identical on every rank and every run") {
  constexpr int kSize = 3;
  constexpr size_t kCount = 1000003;
  // results[run][rank]
  std::vector<std::vector<std::vector<float>>> results(2, std::vector<std::vector<float>>(kSize));
  for (int run = 0; run < 2; ++run) {
    run_ranks(kSize, [&](Communicator& communicator) {
      std::mt19937 random(static_cast<unsigned>(communicator.rank() + 1));
      std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
      std::vector<float> data(kCount);
      for (auto& value : data)
        value = uniform(random) * std::pow(10.0f, uniform(random) * 6.0f);
      communicator.allreduce(data.data(), kCount, ReduceOp::avg);
      results[static_cast<size_t>(run)][static_cast<size_t>(communicator.rank())] = std::move(data);
    });
  }
  const auto& reference = results[0][0];
  REQUIRE(reference.size() == kCount);
  for (const auto& run : results) {
    for (const auto& rank_result : run) {
      CHECK(std::memcmp(rank_result.data(), reference.data(), kCount * sizeof(float)) == 0);
    }
  }
}

TEST_CASE("gloo: max and min propagate NaN") {
  run_ranks(3, [](Communicator& communicator) {
    std::vector<double> data{1.0, 2.0};
    if (communicator.rank() == 1) data[0] = NAN;
    std::vector<double> minimum = data;
    communicator.allreduce(data.data(), data.size(), ReduceOp::max);
    communicator.allreduce(minimum.data(), minimum.size(), ReduceOp::min);
    CHECK(std::isnan(data[0]));
    CHECK(std::isnan(minimum[0]));
    CHECK(data[1] == 2.0);
  });
}

TEST_CASE("gloo: broadcast from a non-zero root") {
  for (int size = 1; size <= 4; ++size) {
    CAPTURE(size);
    run_ranks(size, [](Communicator& communicator) {
      const int root = communicator.size() - 1;
      for (size_t bytes : {size_t{0}, size_t{1}, size_t{13}, size_t{1} << 20}) {
        std::vector<uint8_t> data(bytes);
        for (size_t i = 0; i < bytes; ++i) {
          data[i] = static_cast<uint8_t>(communicator.rank() == root ? i * 31 + 5 : 0xee);
        }
        communicator.broadcast(data.data(), bytes, root);
        size_t wrong = 0;
        for (size_t i = 0; i < bytes; ++i)
          wrong += data[i] != static_cast<uint8_t>(i * 31 + 5);
        CHECK_MESSAGE(wrong == 0, "rank ", communicator.rank(), " bytes ", bytes);
      }
      int bad_root = communicator.size();
      CHECK_THROWS_AS(communicator.broadcast(&bad_root, sizeof(bad_root), bad_root), Error);
    });
  }
}

TEST_CASE("gloo: allgather, separate and in place") {
  for (int size = 1; size <= 4; ++size) {
    CAPTURE(size);
    run_ranks(size, [](Communicator& communicator) {
      const auto ranks = static_cast<size_t>(communicator.size());
      const auto rank = static_cast<size_t>(communicator.rank());
      for (size_t bytes : {size_t{0}, size_t{1}, size_t{5}, size_t{100003}}) {
        std::vector<uint8_t> in(bytes);
        for (size_t i = 0; i < bytes; ++i)
          in[i] = static_cast<uint8_t>(rank * 50 + i);
        std::vector<uint8_t> out(bytes * ranks, 0xee);
        communicator.allgather(in.data(), bytes, out.data());

        std::vector<uint8_t> in_place(bytes * ranks, 0xee);
        std::copy(in.begin(), in.end(), in_place.begin() + static_cast<ptrdiff_t>(rank * bytes));
        communicator.allgather(in_place.data() + rank * bytes, bytes, in_place.data());

        size_t wrong = 0;
        for (size_t r = 0; r < ranks; ++r) {
          for (size_t i = 0; i < bytes; ++i) {
            const auto expected = static_cast<uint8_t>(r * 50 + i);
            wrong += out[r * bytes + i] != expected;
            wrong += in_place[r * bytes + i] != expected;
          }
        }
        CHECK_MESSAGE(wrong == 0, "rank ", rank, " bytes ", bytes);
      }
    });
  }
}

TEST_CASE("gloo: barrier") {
  constexpr int kSize = 4;
  std::atomic<int> arrived{0};
  run_ranks(kSize, [&](Communicator& communicator) {
    // The last rank dawdles: nobody may leave the barrier before it arrives.
    if (communicator.rank() == kSize - 1) std::this_thread::sleep_for(100ms);
    ++arrived;
    communicator.barrier();
    CHECK(arrived.load() == kSize);
    communicator.barrier();
  });
}

TEST_CASE("gloo: a rank whose peer never shows up fails with a comm error naming the rank") {
  TcpStoreServer server;
  TcpStoreClient client("127.0.0.1", server.port(), 10s);
  PrefixStore store("gen7", client);
  try {
    make_gloo_communicator(store, 0, 2, test_options(500ms));
    FAIL("rendezvous without a peer succeeded");
  } catch (const Error& error) {
    const std::string message = error.what();
    CHECK(error.kind() == ErrorKind::comm);
    CHECK_MESSAGE(message.find("rank 0: gloo rendezvous of 2 ranks") == 0, message);
    CHECK_MESSAGE(
        message.find(
            "failed: rank 1 of 2 did not join within 0.5s (nothing from it "
            "at store 127.0.0.1:" +
            std::to_string(server.port()) +
            "); start every rank with the same store and world size, or give them "
            "longer than 0.5s to start (distributed.timeout_s, or a worker's --timeout)") !=
            std::string::npos,
        message);
  }
}

TEST_CASE("gloo: two processes given one rank number are named when the rendezvous fails") {
  TcpStoreServer server;
  std::vector<std::string> messages(2);
  std::vector<std::thread> twins;
  for (size_t i = 0; i < 2; ++i) {
    twins.emplace_back([&, i] {
      TcpStoreClient client("127.0.0.1", server.port(), 10s);
      PrefixStore store("gen1", client);
      try {
        make_gloo_communicator(store, 0, 2, test_options(1000ms));
      } catch (const Error& error) {
        messages[i] = error.what();
      }
    });
  }
  for (auto& t : twins)
    t.join();
  // Each waited for rank 1; the one that gave up after both had joined also says why.
  const bool named = messages[0].find(
                         "; and 2 processes joined as rank 0: each rank number must "
                         "be given to one process") != std::string::npos ||
                     messages[1].find("; and 2 processes joined as rank 0") != std::string::npos;
  CHECK_MESSAGE(named, messages[0], " | ", messages[1]);
  for (const auto& m : messages)
    CHECK_MESSAGE(m.find("rank 1 of 2 did not join within 1s") != std::string::npos, m);
}

TEST_CASE("gloo: ranks given different world sizes are told so, as a usage error") {
  TcpStoreServer server;
  const std::array<int, 2> sizes = {2, 3};
  std::array<std::string, 2> messages;
  std::array<ErrorKind, 2> kinds{};
  std::vector<std::thread> ranks;
  for (size_t r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      TcpStoreClient client("127.0.0.1", server.port(), 10s);
      PrefixStore store("gen1", client);
      try {
        make_gloo_communicator(store, static_cast<int>(r), sizes[r], test_options(20s));
      } catch (const Error& error) {
        messages[r] = error.what();
        kinds[r] = error.kind();
      }
    });
  }
  for (auto& t : ranks)
    t.join();
  CHECK(kinds[0] == ErrorKind::usage);
  CHECK(kinds[1] == ErrorKind::usage);
  CHECK(messages[0] ==
        "rank 0: rank 1 was started with another world size than this rank's 2 (it was given "
        "3): start every rank with the same world size");
  CHECK(messages[1] ==
        "rank 1: rank 0 was started with another world size than this rank's 3 (it was given "
        "2): start every rank with the same world size");
}

TEST_CASE("gloo: a peer whose address carries no world size runs another dptrain") {
  TcpStoreServer server;
  TcpStoreClient client("127.0.0.1", server.port(), 10s);
  PrefixStore store("gen1", client);
  store.set("1", std::string(64, 'x'));  // an address as an older dptrain posts it
  CHECK_THROWS_WITH_AS(make_gloo_communicator(store, 0, 2, test_options(5s)),
                       "rank 0: rank 1 runs another version of dptrain (its address carries no "
                       "world size): run the same dptrain on every rank",
                       Error);
}

// Runs `body` in a child process with the Gloo terminate handler of rank 5 installed and its
// stderr in a pipe: its wait status and what it wrote.
std::pair<int, std::string> in_child_with_terminate_handler(const std::function<void()>& body) {
  int fds[2];
  REQUIRE(::pipe(fds) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::dup2(fds[1], STDERR_FILENO);
    ::close(fds[0]);
    ::signal(SIGABRT, SIG_DFL);  // not the test framework's crash report, in this process
    ::alarm(30);                 // a child that hangs fails the test instead of blocking it
    install_gloo_terminate_handler(5);
    body();
    std::_Exit(0);
  }
  ::close(fds[1]);
  std::string text;
  char buffer[512];
  for (ssize_t n; (n = ::read(fds[0], buffer, sizeof buffer)) > 0;)
    text.append(buffer, static_cast<size_t>(n));
  ::close(fds[0]);
  int status = 0;
  ::waitpid(pid, &status, 0);
  return {status, text};
}

TEST_CASE("gloo: an exception escaping a Gloo thread is a communication failure, exit 3") {
  SUBCASE("Gloo's own errors: one error line naming the rank, exit 3") {
    const auto [status, text] = in_child_with_terminate_handler([] {
      std::thread([] {
        throw gloo::IoException(
            "[/build/gloo/pair.cc:12] getpeername: Transport endpoint is not "
            "connected");
      }).join();
    });
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 3);
    CHECK(text ==
          "dptrain: error: rank 5: gloo communication failed in Gloo's transport thread: "
          "getpeername: Transport endpoint is not connected\n");
  }
  SUBCASE("any other exception still terminates the way it did") {
    const auto [status, text] = in_child_with_terminate_handler(
        [] { std::thread([] { throw std::logic_error("a bug"); }).join(); });
    REQUIRE(WIFSIGNALED(status));
    CHECK(WTERMSIG(status) == SIGABRT);
    CHECK(text.find("a bug") != std::string::npos);  // the runtime's own report
  }
}

TEST_CASE("gloo: a peer that leaves makes the next collective fail, not hang") {
  TcpStoreServer server;
  std::string message;
  std::string second_message;
  auto rank_thread = [&](int rank) {
    TcpStoreClient client("127.0.0.1", server.port(), 10s);
    PrefixStore store("gen0", client);
    auto communicator = make_gloo_communicator(store, rank, 2, test_options(2s));
    communicator->barrier();
    if (rank == 1) return;  // destroys its communicator: its connections close
    std::vector<float> data(1000, 1.0f);
    try {
      communicator->allreduce(data.data(), data.size(), ReduceOp::sum);
    } catch (const Error& error) {
      CHECK(error.kind() == ErrorKind::comm);
      message = error.what();
    }
    try {
      communicator->barrier();
    } catch (const Error& error) {
      second_message = error.what();
    }
  };
  std::thread rank0(rank_thread, 0);
  std::thread rank1(rank_thread, 1);
  rank0.join();
  rank1.join();
  CHECK_MESSAGE(message.find("rank 0: gloo allreduce(sum) of 1000 elements failed: ") == 0,
                message);
  // The socket error of a peer that went away (reset, closed, a broken pipe) says that it did.
  CHECK_MESSAGE(message.ends_with(" (a peer rank has exited or was killed: its own exit or log "
                                  "says why)"),
                message);
  CHECK_MESSAGE(
      second_message.find("rank 0: cannot run barrier: the communicator failed earlier") == 0,
      second_message);
}

TEST_CASE("gloo: a failure's cause is explained where the socket error alone would mislead") {
  CHECK(gloo_cause_note("Read error [127.0.0.1]:4242: Connection reset by peer", 4) ==
        " (a peer rank has exited or was killed: its own exit or log says why)");
  // Gloo's listen for a pair, bound to port 0, with the ephemeral range used up.
  const std::string ports = gloo_cause_note("bind: Address already in use", 300);
  CHECK(ports.starts_with(" (this machine ran out of ephemeral ports: "));
  CHECK(ports.find("each of its 299 peers") != std::string::npos);
  CHECK(ports.find("net.ipv4.ip_local_port_range") != std::string::npos);
  CHECK(gloo_cause_note("connect [127.0.0.1]:4242: Cannot assign requested address", 300) == ports);
  CHECK(gloo_cause_note("Timed out waiting 2000ms for recv operation to complete", 4).empty());
}

TEST_CASE("gloo: a collective a live peer never joins times out") {
  TcpStoreServer server;
  std::atomic<bool> rank0_done{false};
  std::string message;
  auto rank_thread = [&](int rank) {
    TcpStoreClient client("127.0.0.1", server.port(), 10s);
    PrefixStore store("gen0", client);
    auto communicator = make_gloo_communicator(store, rank, 2, test_options(300ms));
    if (rank == 1) {
      // Alive and connected, but never enters the collective.
      while (!rank0_done)
        std::this_thread::sleep_for(10ms);
      return;
    }
    std::vector<double> data(10, 1.0);
    try {
      communicator->allreduce(data.data(), data.size(), ReduceOp::max);
    } catch (const Error& error) {
      message = error.what();
    }
    rank0_done = true;
  };
  std::thread rank0(rank_thread, 0);
  std::thread rank1(rank_thread, 1);
  rank0.join();
  rank1.join();
  CHECK_MESSAGE(message.find("rank 0: gloo allreduce(max) of 10 elements failed: ") == 0, message);
}

// Point-to-point messages. Payloads are filled from (sender, message index) so that a message
// delivered to the wrong receive, or out of order, shows up as wrong data.
std::vector<uint32_t> message_payload(int sender, uint32_t index, size_t words) {
  std::vector<uint32_t> payload(words);
  for (size_t i = 0; i < words; ++i)
    payload[i] =
        static_cast<uint32_t>(sender) * 1000003u + index * 7919u + static_cast<uint32_t>(i);
  return payload;
}

TEST_CASE("gloo: isend/irecv ring exchange on 3 ranks") {
  run_ranks(3, [](Communicator& communicator) {
    const int rank = communicator.rank();
    const int right = (rank + 1) % 3;
    const int left = (rank + 2) % 3;
    uint32_t index = 0;
    for (size_t words : {size_t{0}, size_t{1}, size_t{1001}, size_t{1} << 18}) {
      CAPTURE(words);
      const auto out = message_payload(rank, index, words);
      std::vector<uint32_t> in(words, 0xeeeeeeee);
      auto receive = communicator.irecv(in.data(), words * 4, left, 3);
      auto send = communicator.isend(out.data(), words * 4, right, 3);
      send->wait();
      receive->wait();
      receive->wait();  // a second wait returns at once
      CHECK(in == message_payload(left, index, words));
      ++index;
    }
  });
}

TEST_CASE("gloo: messages with one tag between two ranks arrive in the order posted") {
  constexpr uint32_t kMessages = 8;
  run_ranks(2, [](Communicator& communicator) {
    std::vector<std::vector<uint32_t>> payloads;
    for (uint32_t i = 0; i < kMessages; ++i)
      payloads.push_back(message_payload(0, i, 257));
    if (communicator.rank() == 0) {
      // Every send is posted before the receiver posts anything; the last is not waited for:
      // its destructor waits.
      std::vector<std::unique_ptr<Communicator::Request>> sends;
      for (const auto& payload : payloads)
        sends.push_back(communicator.isend(payload.data(), payload.size() * 4, 1, 9));
      for (uint32_t i = 0; i + 1 < kMessages; ++i)
        sends[i]->wait();
    } else {
      std::this_thread::sleep_for(50ms);
      for (uint32_t i = 0; i < kMessages; ++i) {
        std::vector<uint32_t> in(257);
        communicator.irecv(in.data(), in.size() * 4, 0, 9)->wait();
        CHECK_MESSAGE(in == payloads[i], "message ", i);
      }
    }
  });
}

TEST_CASE("gloo: two tags between the same pair do not mix") {
  run_ranks(2, [](Communicator& communicator) {
    constexpr size_t kWords = 100;
    if (communicator.rank() == 0) {
      // Interleaved: tag 1 gets even indices, tag 2 odd ones.
      std::vector<std::vector<uint32_t>> out;
      std::vector<std::unique_ptr<Communicator::Request>> sends;
      for (uint32_t i = 0; i < 6; ++i)
        out.push_back(message_payload(0, i, kWords));
      for (uint32_t i = 0; i < 6; ++i)
        sends.push_back(communicator.isend(out[i].data(), kWords * 4, 1, 1 + i % 2));
      for (auto& send : sends)
        send->wait();
    } else {
      // Tag 2's messages are received first, all posted at once, then tag 1's.
      std::vector<std::vector<uint32_t>> in(6, std::vector<uint32_t>(kWords));
      std::vector<std::unique_ptr<Communicator::Request>> receives;
      for (uint32_t i : {1u, 3u, 5u})
        receives.push_back(communicator.irecv(in[i].data(), kWords * 4, 0, 2));
      for (auto& receive : receives)
        receive->wait();
      for (uint32_t i : {0u, 2u, 4u})
        communicator.irecv(in[i].data(), kWords * 4, 0, 1)->wait();
      for (uint32_t i = 0; i < 6; ++i)
        CHECK_MESSAGE(in[i] == message_payload(0, i, kWords), "message ", i);
    }
  });
}

TEST_CASE("gloo: recv_any serves workers in whatever order their messages come") {
  constexpr uint32_t kPerWorker = 5;
  constexpr size_t kWords = 64;
  run_ranks(4, [](Communicator& communicator) {
    const int rank = communicator.rank();
    if (rank != 0) {
      // Workers pace themselves differently, so arrivals interleave.
      for (uint32_t i = 0; i < kPerWorker; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(((rank * 7 + i * 3) % 5) * 4));
        const auto out = message_payload(rank, i, kWords);
        communicator.isend(out.data(), kWords * 4, 0, 11)->wait();
      }
      return;
    }
    std::vector<uint32_t> next(4, 0);  // per worker: the index its next message must carry
    for (uint32_t n = 0; n < 3 * kPerWorker; ++n) {
      std::vector<uint32_t> in(kWords, 0xeeeeeeee);
      const int sender = communicator.recv_any(in.data(), kWords * 4, {1, 2, 3}, 11);
      REQUIRE(sender >= 1);
      REQUIRE(sender <= 3);
      const auto s = static_cast<size_t>(sender);
      CHECK_MESSAGE(in == message_payload(sender, next[s], kWords), "from rank ", sender);
      ++next[s];
    }
    CHECK(next == std::vector<uint32_t>{0, kPerWorker, kPerWorker, kPerWorker});
  });
}

TEST_CASE("gloo: messages interleaved with collectives use their own slots") {
  run_ranks(3, [](Communicator& communicator) {
    const int rank = communicator.rank();
    const int right = (rank + 1) % 3;
    const int left = (rank + 2) % 3;
    // User tags 0, 1, 2... are the very numbers the collectives take as their Gloo tags.
    for (uint32_t tag = 0; tag < 6; ++tag) {
      const auto out = message_payload(rank, tag, 1000);
      std::vector<uint32_t> in(1000);
      auto receive = communicator.irecv(in.data(), in.size() * 4, left, tag);
      auto send = communicator.isend(out.data(), out.size() * 4, right, tag);
      // A collective with both messages still in flight.
      check_allreduce<float>(communicator, 1000, ReduceOp::sum);
      std::vector<uint8_t> everyone(3);
      const auto mine = static_cast<uint8_t>(rank + 10);
      communicator.allgather(&mine, 1, everyone.data());
      CHECK(everyone == std::vector<uint8_t>{10, 11, 12});
      send->wait();
      receive->wait();
      CHECK(in == message_payload(left, tag, 1000));
    }
    communicator.barrier();
  });
}

TEST_CASE("gloo: a receive whose sender never sends times out naming the peer and tag") {
  std::atomic<bool> receiver_done{false};
  std::string message;
  std::string later_message;
  run_ranks(
      2,
      [&](Communicator& communicator) {
        if (communicator.rank() == 1) {
          // Alive and connected, but never sends.
          while (!receiver_done)
            std::this_thread::sleep_for(10ms);
          return;
        }
        std::vector<uint32_t> in(1024);
        auto receive = communicator.irecv(in.data(), in.size() * 4, 1, 7);
        const auto start = std::chrono::steady_clock::now();
        try {
          receive->wait();
        } catch (const Error& error) {
          CHECK(error.kind() == ErrorKind::comm);
          message = error.what();
        }
        CHECK(std::chrono::steady_clock::now() - start >= 900ms);
        CHECK_THROWS_WITH_AS(receive->wait(), doctest::Contains("timed out"), Error);
        try {
          communicator.isend(in.data(), 4, 1, 7);
        } catch (const Error& error) {
          later_message = error.what();
        }
        receiver_done = true;
      },
      {}, 1s);
  CHECK_MESSAGE(message ==
                    "rank 0: gloo recv of 4096 bytes from rank 1 (tag 7) failed: timed out "
                    "after 1s (the communicator's timeout): no send of the same size and "
                    "tag from rank 1",
                message);
  CHECK_MESSAGE(later_message.find("rank 0: cannot run send of 4 bytes to rank 1 (tag 7): the "
                                   "communicator failed earlier: timed out") == 0,
                later_message);
}

TEST_CASE("gloo: a message of the wrong size is never delivered: the receive times out") {
  std::atomic<bool> receiver_done{false};
  std::string receive_message;
  std::string send_message;
  run_ranks(
      2,
      [&](Communicator& communicator) {
        std::vector<uint32_t> data(4);
        if (communicator.rank() == 0) {
          auto send = communicator.isend(data.data(), 8, 1, 3);
          while (!receiver_done)
            std::this_thread::sleep_for(10ms);
          // The receiver's timeout closed its connections: this fails without waiting it out.
          try {
            send->wait();
          } catch (const Error& error) {
            send_message = error.what();
          }
          return;
        }
        try {
          communicator.irecv(data.data(), 16, 0, 3)->wait();
        } catch (const Error& error) {
          receive_message = error.what();
        }
        receiver_done = true;
      },
      {}, 300ms);
  CHECK_MESSAGE(receive_message.find("rank 1: gloo recv of 16 bytes from rank 0 (tag 3) failed: "
                                     "timed out after 0.3s") == 0,
                receive_message);
  CHECK_MESSAGE(send_message.find("rank 0: gloo send of 8 bytes to rank 1 (tag 3) failed: ") == 0,
                send_message);
}

TEST_CASE("gloo: messages to bad peers are refused") {
  run_ranks(2, [](Communicator& communicator) {
    const int rank = communicator.rank();
    uint32_t word = 0;
    auto is_internal = [](const std::function<void()>& call, const char* expected) {
      try {
        call();
        FAIL("no error; expected ", expected);
      } catch (const Error& error) {
        CHECK(error.kind() == ErrorKind::internal);
        CHECK_MESSAGE(std::string(error.what()).find(expected) != std::string::npos, error.what());
      }
    };
    is_internal([&] { communicator.isend(&word, 4, rank, 1); }, "cannot message itself");
    is_internal([&] { communicator.irecv(&word, 4, rank, 1); }, "cannot message itself");
    is_internal([&] { communicator.isend(&word, 4, 2, 1); }, "outside 0..1");
    is_internal([&] { communicator.irecv(&word, 4, -1, 1); }, "outside 0..1");
    is_internal([&] { communicator.recv_any(&word, 4, {}, 1); }, "empty list");
    is_internal(
        [&] {
          communicator.recv_any(&word, 4, {1 - rank, rank}, 1);
        },
        "cannot message itself");
    is_internal([&] { communicator.recv_any(&word, 4, {1 - rank, 5}, 1); }, "outside 0..1");
    // Still usable: refusals are not communication failures.
    const uint32_t out = 40u + static_cast<uint32_t>(rank);
    auto receive = communicator.irecv(&word, 4, 1 - rank, 1);
    communicator.isend(&out, 4, 1 - rank, 1)->wait();
    receive->wait();
    CHECK(word == 40u + static_cast<uint32_t>(1 - rank));
  });
  // A group of one has nobody to message.
  run_ranks(1, [](Communicator& communicator) {
    uint32_t word = 0;
    CHECK_THROWS_WITH_AS(communicator.isend(&word, 4, 0, 1), doctest::Contains("not supported"),
                         Error);
  });
}

TEST_CASE("gloo: rank and size are validated") {
  TcpStoreServer server;
  TcpStoreClient client("127.0.0.1", server.port(), 10s);
  for (auto [rank, size] : {std::pair{0, 0}, std::pair{2, 2}, std::pair{-1, 3}}) {
    CHECK_THROWS_WITH_AS(make_gloo_communicator(client, rank, size, test_options()),
                         doctest::Contains("does not fit a world"), Error);
  }
}

}  // namespace
}  // namespace dptrain
