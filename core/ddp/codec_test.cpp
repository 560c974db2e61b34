// Tests for the error-feedback gradient codecs, on real Gloo ranks (threads over a TCP store).
#include "core/ddp/codec.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "core/error.hpp"
#include "tests/gloo_ranks.hpp"

namespace dptrain {
namespace {

using test::run_ranks;

CompressionSpec int8_spec(int64_t block) {
  CompressionSpec spec;
  spec.type = "int8";
  spec.block = block;
  return spec;
}

CompressionSpec topk_spec(double ratio) {
  CompressionSpec spec;
  spec.type = "topk";
  spec.ratio = ratio;
  return spec;
}

CompressionSpec powersgd_spec(int64_t rank) {
  CompressionSpec spec;
  spec.type = "powersgd";
  spec.rank = rank;
  return spec;
}

// Reproducible values in [-scale, scale), the same with every standard library.
std::vector<float> random_values(size_t count, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 generator(seed);
  std::vector<float> values(count);
  for (float& value : values) {
    const double unit = static_cast<double>(generator() >> 11) * 0x1.0p-53;
    value = static_cast<float>((2.0 * unit - 1.0) * scale);
  }
  return values;
}

double norm(std::span<const float> values) {
  double sum = 0.0;
  for (float value : values)
    sum += static_cast<double>(value) * value;
  return std::sqrt(sum);
}

double distance(std::span<const float> a, std::span<const float> b) {
  double sum = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - b[i];
    sum += d * d;
  }
  return std::sqrt(sum);
}

bool same_bits(std::span<const float> a, std::span<const float> b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

std::vector<float> copy_of(std::span<const float> values) {
  return {values.begin(), values.end()};
}

// The reference top-k: indices by |x| descending, ties by the lower index.
std::vector<size_t> top_indices(std::span<const float> x, size_t k) {
  std::vector<size_t> order(x.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return std::fabs(x[a]) > std::fabs(x[b]); });
  order.resize(k);
  std::sort(order.begin(), order.end());
  return order;
}

// The matrix view powersgd uses: rows x cols, cols = ceil(sqrt(count)).
struct Shape {
  size_t rows, cols;
};
Shape powersgd_shape(size_t count) {
  size_t cols = 1;
  while (cols * cols < count)
    ++cols;
  return {(count + cols - 1) / cols, cols};
}

// sum over terms of u_t v_t^T, row-major rows x cols.
std::vector<float> low_rank_matrix(size_t rows, size_t cols, size_t terms, uint64_t seed) {
  std::vector<float> m(rows * cols, 0.0f);
  for (size_t t = 0; t < terms; ++t) {
    const auto u = random_values(rows, seed * 100 + t * 2);
    const auto v = random_values(cols, seed * 100 + t * 2 + 1);
    for (size_t i = 0; i < rows; ++i)
      for (size_t c = 0; c < cols; ++c)
        m[i * cols + c] += u[i] * v[c];
  }
  return m;
}

TEST_CASE("codec: make_codec rejects other types, empty buckets and bad parameters") {
  for (const char* type : {"fp16", "bf16", "none", "", "INT8"}) {
    CAPTURE(type);
    CompressionSpec spec;
    spec.type = type;
    CHECK_FALSE(is_error_feedback_codec(type));
    try {
      make_codec(spec, 100, 1);
      FAIL("no error");
    } catch (const Error& error) {
      CHECK(error.kind() == ErrorKind::internal);
      CHECK(std::string(error.what()).find(std::string("'") + type + "'") != std::string::npos);
    }
  }
  for (const auto& spec : {int8_spec(256), topk_spec(0.01), powersgd_spec(4)}) {
    CAPTURE(spec.type);
    CHECK(is_error_feedback_codec(spec.type));
    CHECK_THROWS_AS(make_codec(spec, 0, 1), Error);
    CHECK(make_codec(spec, 1, 1)->name() == spec.type);
  }
  CHECK_THROWS_AS(make_codec(int8_spec(0), 10, 1), Error);
  CHECK_THROWS_AS(make_codec(topk_spec(0.0), 10, 1), Error);
  CHECK_THROWS_AS(make_codec(topk_spec(1.5), 10, 1), Error);
  CHECK_THROWS_AS(make_codec(topk_spec(std::nan("")), 10, 1), Error);
  CHECK_THROWS_AS(make_codec(powersgd_spec(0), 10, 1), Error);
}

TEST_CASE("codec: payload_bytes and state sizes follow the formulas") {
  struct Case {
    CompressionSpec spec;
    size_t count;
    size_t bytes;
    size_t state;
  };
  const Case cases[] = {
      {int8_spec(256), 1024, 1024 + 4 * 4, 1024},  // (1 + 4/256) / 4 of f32
      {int8_spec(256), 1000, 1000 + 4 * 4, 1000},  // a partial last block has a scale too
      {int8_spec(1), 3, 3 + 3 * 4, 3},
      {int8_spec(1000000), 5, 5 + 4, 5},
      {topk_spec(0.01), 1000, 8 * 10, 1000},
      {topk_spec(0.07), 100, 8 * 7, 100},   // 0.07 * 100 is 7.000000000000001 in doubles
      {topk_spec(0.29), 100, 8 * 29, 100},  // and 0.29 * 100 is 28.999999999999996
      {topk_spec(0.015), 100, 8 * 2, 100},  // 1.5 rounds up
      {topk_spec(1e-9), 100, 8 * 1, 100},   // at least one value
      {topk_spec(1.0), 100, 8 * 100, 100},  // everything
      {powersgd_spec(4), 1000, (32 + 32) * 4 * 4, 1000 + 32 * 4},  // 32 x 32, padded
      {powersgd_spec(4), 930, (30 + 31) * 4 * 4, 930 + 31 * 4},    // 30 x 31 exactly
      {powersgd_spec(8), 10, (3 + 4) * 3 * 4, 10 + 4 * 3},         // rank limited to 3 rows
      {powersgd_spec(4), 1, (1 + 1) * 1 * 4, 1 + 1},
      {powersgd_spec(1), 1000000, (1000 + 1000) * 4, 1000000 + 1000},
  };
  for (const auto& c : cases) {
    CAPTURE(c.spec.type);
    CAPTURE(c.count);
    auto codec = make_codec(c.spec, c.count, 7);
    CHECK(codec->payload_bytes() == c.bytes);
    CHECK(codec->state().size() == c.state);
    const auto residual = codec->state().first(c.count);
    CHECK(std::all_of(residual.begin(), residual.end(), [](float value) { return value == 0.0f; }));
  }
  // The ratios against f32 the docs quote.
  const size_t big = 1 << 20;
  auto ratio = [&](const CompressionSpec& spec) {
    return static_cast<double>(make_codec(spec, big, 1)->payload_bytes()) /
           (4.0 * static_cast<double>(big));
  };
  CHECK(ratio(int8_spec(256)) == doctest::Approx((1.0 + 4.0 / 256) / 4));
  CHECK(ratio(topk_spec(0.01)) == doctest::Approx(8.0 * 10486 / (4.0 * big)));
  CHECK(ratio(powersgd_spec(4)) == doctest::Approx((1024.0 + 1024.0) * 4 / big));

  // reduce() returns the same number, on one rank and on three.
  for (int size : {1, 3}) {
    run_ranks(size, [](Communicator& comm) {
      for (const auto& spec : {int8_spec(64), topk_spec(0.05), powersgd_spec(2)}) {
        auto codec = make_codec(spec, 1000, 3);
        auto grads = random_values(1000, 11 + static_cast<uint64_t>(comm.rank()));
        CHECK(codec->reduce(grads, comm) == codec->payload_bytes());
      }
    });
  }
}

TEST_CASE("codec int8: one rank, every value within half its block's scale") {
  const size_t count = 1000;
  const size_t block = 64;  // 15 full blocks and one of 40
  auto x = random_values(count, 5);
  // Magnitudes that differ per block, and one block of zeros.
  for (size_t i = 0; i < count; ++i)
    x[i] *= std::pow(10.0f, static_cast<float>(static_cast<int>(i / block % 7) - 3));
  std::fill(x.begin() + 128, x.begin() + 192, 0.0f);

  std::vector<float> result;
  std::vector<float> residual;
  run_ranks(1, [&](Communicator& comm) {
    auto codec = make_codec(int8_spec(block), count, 1);
    result = x;
    codec->reduce(result, comm);
    residual = copy_of(codec->state());
  });
  for (size_t begin = 0; begin < count; begin += block) {
    const size_t end = std::min(begin + block, count);
    float max_abs = 0.0f;
    for (size_t i = begin; i < end; ++i)
      max_abs = std::max(max_abs, std::fabs(x[i]));
    const float scale = max_abs / 127.0f;
    for (size_t i = begin; i < end; ++i) {
      CAPTURE(i);
      REQUIRE(std::fabs(result[i] - x[i]) <= scale * 0.5f * (1.0f + 1e-5f));
      REQUIRE(residual[i] == x[i] - result[i]);
    }
  }
  for (size_t i = 128; i < 192; ++i)
    REQUIRE(result[i] == 0.0f);
}

TEST_CASE("codec int8: values on the quantization grid sum exactly over 1, 2 and 3 ranks") {
  // Integers in [-127, 127] with a +-127 in every block: scale 1, nothing lost.
  const size_t count = 500;
  const size_t block = 32;
  auto values_of = [&](int rank) {
    std::vector<float> x(count);
    for (size_t i = 0; i < count; ++i)
      x[i] = static_cast<float>(static_cast<int>((i * 37 + static_cast<size_t>(rank) * 11) % 255) -
                                127);
    for (size_t begin = 0; begin < count; begin += block)
      x[begin] = rank % 2 == 0 ? 127.0f : -127.0f;
    return x;
  };
  for (int size = 1; size <= 3; ++size) {
    CAPTURE(size);
    std::vector<std::vector<float>> results(static_cast<size_t>(size));
    std::vector<std::vector<float>> residuals(static_cast<size_t>(size));
    run_ranks(size, [&](Communicator& comm) {
      auto codec = make_codec(int8_spec(block), count, 1);
      auto grads = values_of(comm.rank());
      codec->reduce(grads, comm);
      results[static_cast<size_t>(comm.rank())] = grads;
      residuals[static_cast<size_t>(comm.rank())] = copy_of(codec->state());
    });
    for (size_t i = 0; i < count; ++i) {
      float expected = 0.0f;
      for (int rank = 0; rank < size; ++rank)
        expected += values_of(rank)[i];
      REQUIRE(results[0][i] == expected);
    }
    for (int rank = 0; rank < size; ++rank) {
      CHECK(same_bits(results[static_cast<size_t>(rank)], results[0]));
      CHECK(norm(residuals[static_cast<size_t>(rank)]) == 0.0);
    }
  }
}

TEST_CASE("codec topk: one rank sends exactly the k largest |x|, ties to the lower index") {
  SUBCASE("many ties") {
    // |x| in 0..10: the 50th largest falls inside a run of equal magnitudes.
    const size_t count = 1000;
    std::vector<float> x(count);
    for (size_t i = 0; i < count; ++i)
      x[i] = static_cast<float>(static_cast<int>(i * 37 % 21) - 10);
    std::vector<float> result = x;
    std::vector<float> residual;
    run_ranks(1, [&](Communicator& comm) {
      auto codec = make_codec(topk_spec(0.05), count, 1);
      codec->reduce(result, comm);
      residual = copy_of(codec->state());
    });
    const auto sent = top_indices(x, 50);
    std::vector<bool> is_sent(count, false);
    for (size_t i : sent)
      is_sent[i] = true;
    for (size_t i = 0; i < count; ++i) {
      CAPTURE(i);
      REQUIRE(result[i] == (is_sent[i] ? x[i] : 0.0f));
      REQUIRE(residual[i] == (is_sent[i] ? 0.0f : x[i]));
    }
  }
  SUBCASE("a million values") {
    const size_t count = 1 << 20;
    const auto x = random_values(count, 9);
    std::vector<float> result = x;
    std::vector<float> residual;
    run_ranks(1, [&](Communicator& comm) {
      auto codec = make_codec(topk_spec(0.001), count, 1);
      codec->reduce(result, comm);
      residual = copy_of(codec->state());
    });
    // k = ceil(1048.576): every sent |x| is at least every kept one.
    size_t sent = 0;
    size_t wrong = 0;
    float smallest_sent = std::numeric_limits<float>::infinity();
    float largest_kept = 0.0f;
    for (size_t i = 0; i < count; ++i) {
      if (result[i] != 0.0f) {
        ++sent;
        wrong += result[i] != x[i] || residual[i] != 0.0f;
        smallest_sent = std::min(smallest_sent, std::fabs(x[i]));
      } else {
        wrong += residual[i] != x[i];
        largest_kept = std::max(largest_kept, std::fabs(x[i]));
      }
    }
    CHECK(wrong == 0);
    CHECK(sent == 1049);
    CHECK(smallest_sent >= largest_kept);
  }
}

TEST_CASE("codec topk: 1, 2 and 3 ranks add every rank's values in rank order") {
  const size_t count = 777;
  const double ratio = 0.03;  // k = 24
  for (int size = 1; size <= 3; ++size) {
    CAPTURE(size);
    std::vector<std::vector<float>> results(static_cast<size_t>(size));
    run_ranks(size, [&](Communicator& comm) {
      auto codec = make_codec(topk_spec(ratio), count, 1);
      auto grads = random_values(count, 100 + static_cast<uint64_t>(comm.rank()));
      codec->reduce(grads, comm);
      results[static_cast<size_t>(comm.rank())] = grads;
    });
    std::vector<float> expected(count, 0.0f);
    for (int rank = 0; rank < size; ++rank) {
      const auto x = random_values(count, 100 + static_cast<uint64_t>(rank));
      for (size_t i : top_indices(x, 24))
        expected[i] += x[i];
    }
    for (int rank = 0; rank < size; ++rank)
      CHECK(same_bits(results[static_cast<size_t>(rank)], expected));
  }
}

TEST_CASE("codec powersgd: a matrix of rank <= r is recovered, any other approximated") {
  SUBCASE("exact rank 2 of a 30 x 31 matrix, rank 4, warm start") {
    const size_t count = 930;
    const auto shape = powersgd_shape(count);
    REQUIRE(shape.rows * shape.cols == count);
    const auto m = low_rank_matrix(shape.rows, shape.cols, 2, 3);
    std::vector<double> errors;
    run_ranks(1, [&](Communicator& comm) {
      auto codec = make_codec(powersgd_spec(4), count, 1);
      for (int call = 0; call < 3; ++call) {
        auto grads = m;
        codec->reduce(grads, comm);
        errors.push_back(distance(grads, m) / norm(m));
      }
    });
    for (double error : errors)
      CHECK(error < 1e-4);
  }
  SUBCASE("random matrices: ||M - P Q^T|| <= ||M||, the residual is the difference") {
    for (size_t count : {size_t{1}, size_t{2}, size_t{10}, size_t{1000}, size_t{4099}}) {
      CAPTURE(count);
      const auto m = random_values(count, count);
      std::vector<float> result = m;
      std::vector<float> residual;
      run_ranks(1, [&](Communicator& comm) {
        auto codec = make_codec(powersgd_spec(2), count, 5);
        codec->reduce(result, comm);
        residual = copy_of(codec->state().first(count));
      });
      const double error = distance(result, m);
      CHECK(error <= norm(m) * (1.0 + 1e-6));
      if (count >= 1000) CHECK(error < norm(m));  // rank 2 of a 32 x 32 noise matrix
      std::vector<float> sum(count);
      for (size_t i = 0; i < count; ++i)
        sum[i] = result[i] + residual[i];
      CHECK(distance(sum, m) <= 1e-5 * norm(m));
    }
  }
  SUBCASE("all-zero gradients do not kill the warm start") {
    const size_t count = 930;
    const auto m = low_rank_matrix(30, 31, 1, 8);
    double error = 1.0;
    run_ranks(1, [&](Communicator& comm) {
      auto codec = make_codec(powersgd_spec(2), count, 1);
      std::vector<float> zeros(count, 0.0f);
      codec->reduce(zeros, comm);
      for (float value : zeros)
        REQUIRE(value == 0.0f);
      auto grads = m;
      codec->reduce(grads, comm);
      error = distance(grads, m) / norm(m);
    });
    CHECK(error < 1e-4);
  }
  SUBCASE("2 and 3 ranks: the sum of rank-1 matrices") {
    const size_t count = 930;
    for (int size = 2; size <= 3; ++size) {
      CAPTURE(size);
      std::vector<std::vector<float>> results(static_cast<size_t>(size));
      run_ranks(size, [&](Communicator& comm) {
        auto codec = make_codec(powersgd_spec(4), count, 2);
        auto grads = low_rank_matrix(30, 31, 1, 20 + static_cast<uint64_t>(comm.rank()));
        codec->reduce(grads, comm);
        results[static_cast<size_t>(comm.rank())] = grads;
      });
      std::vector<float> expected(count, 0.0f);
      for (int rank = 0; rank < size; ++rank) {
        const auto m = low_rank_matrix(30, 31, 1, 20 + static_cast<uint64_t>(rank));
        for (size_t i = 0; i < count; ++i)
          expected[i] += m[i];
      }
      CHECK(distance(results[0], expected) / norm(expected) < 1e-4);
      for (int rank = 1; rank < size; ++rank)
        CHECK(same_bits(results[static_cast<size_t>(rank)], results[0]));
    }
  }
}

TEST_CASE("codec powersgd with tensor shapes: each matrix factorised, vectors sent exactly") {
  // A bucket of [20 x 12 matrix of rank 2][7-vector][3 x 2 matrix, too small to gain].
  const std::vector<ParamTensor> tensors = {{0, 20, 12}, {240, 1, 7}, {247, 3, 2}};
  const size_t count = 253;
  auto matrix = low_rank_matrix(20, 12, 2, 4);
  std::vector<float> grads(count);
  std::copy(matrix.begin(), matrix.end(), grads.begin());
  for (size_t i = 240; i < count; ++i)
    grads[i] = 0.1f * static_cast<float>(i);
  run_ranks(2, [&](Communicator& comm) {
    auto codec = make_codec(powersgd_spec(4), count, 1, tensors);
    // P (20 x 4) and Q (12 x 4) of the matrix; the vector and the small matrix as they are.
    CHECK(codec->payload_bytes() == ((20 + 12) * 4 + 7 + 6) * sizeof(float));
    CHECK(codec->state().size() == count + 12 * 4);
    std::vector<float> result;
    for (int call = 0; call < 3; ++call) {
      result = grads;
      codec->reduce(result, comm);
    }
    // Both ranks sent the same: the sum is twice it, the matrix recovered from rank 2.
    for (size_t i = 240; i < count; ++i)
      CHECK(result[i] == 2 * grads[i]);
    for (size_t i = 0; i < 240; ++i)
      CHECK(result[i] == doctest::Approx(2 * grads[i]).epsilon(1e-3).scale(1e-3));
  });
  // Shapes that do not tile the bucket are a bug in the caller.
  CHECK_THROWS_AS(make_codec(powersgd_spec(4), count + 1, 1, tensors), Error);
}

TEST_CASE("codec: error feedback loses nothing over 50 steps, on 1, 2 and 3 ranks") {
  const size_t count = 1000;
  const int steps = 50;
  // Bounds on the residual's RMS. Gradients are uniform in [-1, 1) (RMS 0.577): a codec that
  // sent nothing would reach 0.577 * sqrt(50) = 4.1; these level off near 0.0023, 1.05 and 1.9.
  struct Case {
    CompressionSpec spec;
    double max_residual_rms;
  };
  const std::vector<Case> cases = {
      {int8_spec(64), 1.0 / 254},  // half a scale at most, per value
      {topk_spec(0.05), 1.5},
      {powersgd_spec(2), 2.5},
  };
  struct RankRecord {
    std::vector<std::vector<float>> results;  // every step's result
    std::vector<double> sent_total;           // sum over steps of the result
    std::vector<double> true_total;           // sum over steps of this rank's gradients
    std::vector<float> residual;
    double max_residual_rms = 0.0;
  };
  for (int size = 1; size <= 3; ++size) {
    CAPTURE(size);
    // records[case][rank]
    std::vector<std::vector<RankRecord>> records(
        cases.size(), std::vector<RankRecord>(static_cast<size_t>(size)));
    run_ranks(size, [&](Communicator& comm) {
      for (size_t n = 0; n < cases.size(); ++n) {
        auto& record = records[n][static_cast<size_t>(comm.rank())];
        record.sent_total.assign(count, 0.0);
        record.true_total.assign(count, 0.0);
        auto codec = make_codec(cases[n].spec, count, 42);
        for (int step = 0; step < steps; ++step) {
          auto grads = random_values(count, static_cast<uint64_t>(step * 10 + comm.rank()) + 1000);
          for (size_t i = 0; i < count; ++i)
            record.true_total[i] += grads[i];
          codec->reduce(grads, comm);
          for (size_t i = 0; i < count; ++i)
            record.sent_total[i] += grads[i];
          record.results.push_back(grads);
          const double rms =
              norm(codec->state().first(count)) / std::sqrt(static_cast<double>(count));
          record.max_residual_rms = std::max(record.max_residual_rms, rms);
        }
        record.residual = copy_of(codec->state().first(count));
      }
    });

    for (size_t n = 0; n < cases.size(); ++n) {
      CAPTURE(cases[n].spec.type);
      const auto& ranks = records[n];
      double worst = 0.0;
      double scale = 0.0;
      for (size_t i = 0; i < count; ++i) {
        double truth = 0.0;
        double kept = 0.0;
        for (const auto& record : ranks) {
          truth += record.true_total[i];
          kept += record.residual[i];
        }
        worst = std::max(worst, std::fabs(ranks[0].sent_total[i] + kept - truth));
        scale = std::max(scale, std::fabs(truth));
      }
      CHECK(worst <= 2e-5 * std::max(1.0, scale));
      for (const auto& record : ranks) {
        CHECK(record.max_residual_rms <= cases[n].max_residual_rms);
        for (int step = 0; step < steps; ++step)
          REQUIRE(same_bits(record.results[static_cast<size_t>(step)],
                            ranks[0].results[static_cast<size_t>(step)]));
      }
    }
  }
}

TEST_CASE("codec: a restored state makes the next reduce identical (checkpoint and resume)") {
  const size_t count = 600;
  run_ranks(2, [&](Communicator& comm) {
    const auto rank = static_cast<uint64_t>(comm.rank());
    for (const auto& spec : {int8_spec(100), topk_spec(0.02), powersgd_spec(3)}) {
      auto original = make_codec(spec, count, 9);
      for (uint64_t step = 0; step < 5; ++step) {
        auto grads = random_values(count, step * 2 + rank);
        original->reduce(grads, comm);
      }
      const auto saved = copy_of(original->state());
      auto resumed = make_codec(spec, count, 9);
      auto fresh = make_codec(spec, count, 9);
      std::copy(saved.begin(), saved.end(), resumed->state().begin());

      const auto next = random_values(count, 77 + rank);
      auto a = next;
      auto b = next;
      auto c = next;
      original->reduce(a, comm);
      resumed->reduce(b, comm);
      fresh->reduce(c, comm);
      CHECK_MESSAGE(same_bits(a, b), spec.type);
      CHECK_MESSAGE(same_bits(original->state(), resumed->state()), spec.type);
      CHECK_MESSAGE(!same_bits(a, c), spec.type, ": the state made no difference");
    }
  });
}

TEST_CASE("codec: a step whose sum is not finite leaves every rank's state as it was") {
  // The loss scaler skips such a step; its gradients must not land in (or poison) the residual.
  const size_t count = 300;
  run_ranks(2, [&](Communicator& comm) {
    const auto rank = static_cast<uint64_t>(comm.rank());
    for (const auto& spec : {int8_spec(64), topk_spec(0.1), powersgd_spec(2)}) {
      for (float bad :
           {std::numeric_limits<float>::quiet_NaN(), std::numeric_limits<float>::infinity()}) {
        auto codec = make_codec(spec, count, 4);
        auto skipped = make_codec(spec, count, 4);  // never sees the bad step
        for (auto* each : {codec.get(), skipped.get()}) {
          auto grads = random_values(count, 10 + rank);
          each->reduce(grads, comm);
        }
        const auto before = copy_of(codec->state());
        auto grads = random_values(count, 20 + rank);
        if (comm.rank() == 1) grads[123] = bad;  // only one rank overflowed
        codec->reduce(grads, comm);
        CHECK_MESSAGE(!std::all_of(grads.begin(), grads.end(),
                                   [](float value) { return std::isfinite(value); }),
                      spec.type, " ", bad);
        CHECK_MESSAGE(same_bits(codec->state(), before), spec.type, " ", bad);

        auto a = random_values(count, 30 + rank);
        auto b = a;
        codec->reduce(a, comm);
        skipped->reduce(b, comm);
        CHECK_MESSAGE(same_bits(a, b), spec.type, " ", bad);
      }
    }
  });
}

}  // namespace
}  // namespace dptrain
