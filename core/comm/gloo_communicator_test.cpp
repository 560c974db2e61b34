// Tests for the gloo Communicator: N ranks as threads over a real TcpStoreServer on 127.0.0.1.
#include <doctest/doctest.h>

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
    CHECK_MESSAGE(message.find("timed out after 0.5s waiting for key 'gen7/") != std::string::npos,
                  message);
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
  CHECK_MESSAGE(
      second_message.find("rank 0: cannot run barrier: the communicator failed earlier") == 0,
      second_message);
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
