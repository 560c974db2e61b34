// Tests of the CPU transformer ops (LayerNorm, causal attention, embeddings): forwards against
// double-precision references, backwards against central finite differences of sum(out * R).
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/tensor/cpu_ops.hpp"
#include "core/tensor/random.hpp"

namespace dptrain {
namespace {

using Floats = std::vector<float>;

Floats random_floats(std::mt19937_64& rng, int64_t n, double lo = -1.0, double hi = 1.0) {
  Floats v(static_cast<size_t>(n));
  for (float& x : v)
    x = static_cast<float>(lo + (hi - lo) * uniform01(rng));
  return v;
}

double weighted_sum(const Floats& out, const Floats& weights) {
  double total = 0.0;
  for (size_t i = 0; i < out.size(); ++i)
    total += static_cast<double>(out[i]) * weights[i];
  return total;
}

bool close(double actual, double expected, double abs_tol, double rel_tol) {
  return std::abs(actual - expected) <= abs_tol + rel_tol * std::abs(expected);
}

// Compares analytic[i] with the central difference of loss() in param[i], for every i in
// indices (all of param when empty).
void check_gradient(const char* name, Floats& param, const Floats& analytic,
                    const std::function<double()>& loss, std::vector<size_t> indices = {}) {
  REQUIRE(param.size() == analytic.size());
  if (indices.empty()) {
    for (size_t i = 0; i < param.size(); ++i)
      indices.push_back(i);
  }
  constexpr float kStep = 1e-2f;
  int failures = 0;
  for (size_t i : indices) {
    const float saved = param[i];
    const float plus = saved + kStep;
    const float minus = saved - kStep;
    param[i] = plus;
    const double loss_plus = loss();
    param[i] = minus;
    const double loss_minus = loss();
    param[i] = saved;
    const double numeric = (loss_plus - loss_minus) / (static_cast<double>(plus) - minus);
    if (!close(analytic[i], numeric, 1e-3, 1e-2)) {
      ++failures;
      CAPTURE(name);
      CAPTURE(i);
      CAPTURE(numeric);
      CHECK(analytic[i] == doctest::Approx(numeric));
    }
  }
  CAPTURE(name);
  CHECK(failures == 0);
}

// ---- references in double

struct LayerNormReference {
  std::vector<double> out, mean, rstd;
};

LayerNormReference layernorm_reference(const Floats& x, int64_t rows, int64_t cols,
                                       const Floats& gamma, const Floats& beta) {
  LayerNormReference ref;
  for (int64_t i = 0; i < rows; ++i) {
    const float* xi = x.data() + i * cols;
    double mean = 0.0;
    for (int64_t j = 0; j < cols; ++j)
      mean += xi[j];
    mean /= static_cast<double>(cols);
    double var = 0.0;
    for (int64_t j = 0; j < cols; ++j)
      var += (xi[j] - mean) * (xi[j] - mean);
    var /= static_cast<double>(cols);
    const double rstd = 1.0 / std::sqrt(var + 1e-5);
    for (int64_t j = 0; j < cols; ++j)
      ref.out.push_back((xi[j] - mean) * rstd * gamma[static_cast<size_t>(j)] +
                        beta[static_cast<size_t>(j)]);
    ref.mean.push_back(mean);
    ref.rstd.push_back(rstd);
  }
  return ref;
}

struct AttentionReference {
  std::vector<double> out, att;
};

AttentionReference attention_reference(const Floats& qkv, int64_t batch, int64_t seq, int64_t heads,
                                       int64_t width) {
  const int64_t hd = width / heads;
  const auto value = [&](int64_t b, int64_t t, int64_t part, int64_t h, int64_t d) {
    return static_cast<double>(
        qkv[static_cast<size_t>((b * seq + t) * 3 * width + part * width + h * hd + d)]);
  };
  AttentionReference ref;
  ref.out.assign(static_cast<size_t>(batch * seq * width), 0.0);
  ref.att.assign(static_cast<size_t>(batch * heads * seq * seq), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t t = 0; t < seq; ++t) {
        std::vector<double> scores(static_cast<size_t>(t + 1));
        double max_score = -std::numeric_limits<double>::infinity();
        for (int64_t s = 0; s <= t; ++s) {
          double score = 0.0;
          for (int64_t d = 0; d < hd; ++d)
            score += value(b, t, 0, h, d) * value(b, s, 1, h, d);
          scores[static_cast<size_t>(s)] = score / std::sqrt(static_cast<double>(hd));
          max_score = std::max(max_score, scores[static_cast<size_t>(s)]);
        }
        double total = 0.0;
        for (double& score : scores) {
          score = std::exp(score - max_score);
          total += score;
        }
        for (int64_t s = 0; s <= t; ++s) {
          const double p = scores[static_cast<size_t>(s)] / total;
          ref.att[static_cast<size_t>(((b * heads + h) * seq + t) * seq + s)] = p;
          for (int64_t d = 0; d < hd; ++d)
            ref.out[static_cast<size_t>((b * seq + t) * width + h * hd + d)] +=
                p * value(b, s, 2, h, d);
        }
      }
    }
  }
  return ref;
}

// ---- attention fixtures

struct AttentionCase {
  int64_t batch, seq, heads, width;
  int64_t rows() const { return batch * seq; }
  int64_t att_size() const { return batch * heads * seq * seq; }
};

struct AttentionResult {
  Floats out, att;
};

AttentionResult run_attention(CpuOps& ops, const AttentionCase& c, const Floats& qkv) {
  // NaN-filled outputs: every element must be written.
  AttentionResult r{Floats(static_cast<size_t>(c.rows() * c.width), std::nanf("")),
                    Floats(static_cast<size_t>(c.att_size()), std::nanf(""))};
  ops.attention_forward(ConstMatrix{qkv.data(), c.rows(), 3 * c.width}, c.batch, c.seq, c.heads,
                        Matrix{r.out.data(), c.rows(), c.width}, r.att.data());
  return r;
}

void check_attention_forward(const AttentionCase& c, uint64_t seed, double qkv_scale) {
  CpuOps ops;
  std::mt19937_64 rng(seed);
  const Floats qkv = random_floats(rng, c.rows() * 3 * c.width, -qkv_scale, qkv_scale);
  const AttentionResult got = run_attention(ops, c, qkv);
  const AttentionReference ref = attention_reference(qkv, c.batch, c.seq, c.heads, c.width);
  int mismatches = 0;
  for (size_t i = 0; i < got.out.size(); ++i) {
    if (!std::isfinite(got.out[i]) || !close(got.out[i], ref.out[i], 1e-5, 1e-4)) ++mismatches;
  }
  CHECK(mismatches == 0);
  mismatches = 0;
  int nonzero_masked = 0;
  for (int64_t bh = 0; bh < c.batch * c.heads; ++bh) {
    for (int64_t t = 0; t < c.seq; ++t) {
      double row_sum = 0.0;
      for (int64_t s = 0; s < c.seq; ++s) {
        const size_t i = static_cast<size_t>((bh * c.seq + t) * c.seq + s);
        if (s > t) {
          if (got.att[i] != 0.0f) ++nonzero_masked;  // exactly 0, not merely small
        } else if (!std::isfinite(got.att[i]) || !close(got.att[i], ref.att[i], 1e-7, 1e-5)) {
          ++mismatches;
        }
        row_sum += got.att[i];
      }
      CHECK(row_sum == doctest::Approx(1.0).epsilon(1e-5));
    }
  }
  CHECK(mismatches == 0);
  CHECK(nonzero_masked == 0);
}

void check_attention_backward(const AttentionCase& c, uint64_t seed, size_t probes) {
  CpuOps ops;
  std::mt19937_64 rng(seed);
  Floats qkv = random_floats(rng, c.rows() * 3 * c.width);
  const Floats weights = random_floats(rng, c.rows() * c.width);
  const AttentionResult fwd = run_attention(ops, c, qkv);
  Floats dqkv(qkv.size(), std::nanf(""));  // overwritten, not accumulated
  ops.attention_backward(ConstMatrix{qkv.data(), c.rows(), 3 * c.width},
                         ConstMatrix{fwd.out.data(), c.rows(), c.width}, fwd.att.data(),
                         ConstMatrix{weights.data(), c.rows(), c.width}, c.batch, c.seq, c.heads,
                         Matrix{dqkv.data(), c.rows(), 3 * c.width});
  std::vector<size_t> indices;  // empty: every element
  if (probes < qkv.size()) {
    for (size_t i = 0; i < probes; ++i)
      indices.push_back(static_cast<size_t>(uniform_below(rng, qkv.size())));
  }
  check_gradient(
      "qkv", qkv, dqkv, [&] { return weighted_sum(run_attention(ops, c, qkv).out, weights); },
      indices);
}

}  // namespace

TEST_CASE("layernorm forward matches a double reference, also for rows with a large offset") {
  CpuOps ops;
  std::mt19937_64 rng(1);
  for (int64_t cols : {8, 13, 64}) {
    CAPTURE(cols);
    const int64_t rows = 6;
    Floats x = random_floats(rng, rows * cols, -2.0, 2.0);
    // Row 5 sits far from 0: a one-pass E[x^2] - E[x]^2 in float would lose its variance.
    for (int64_t j = 0; j < cols; ++j)
      x[static_cast<size_t>(5 * cols + j)] += 1000.0f;
    const Floats gamma = random_floats(rng, cols, 0.5, 1.5);
    const Floats beta = random_floats(rng, cols);
    Floats out(x.size()), mean(rows), rstd(rows);
    ops.layernorm_forward(ConstMatrix{x.data(), rows, cols}, gamma.data(), beta.data(),
                          Matrix{out.data(), rows, cols}, mean.data(), rstd.data());
    const LayerNormReference ref = layernorm_reference(x, rows, cols, gamma, beta);
    for (size_t i = 0; i < out.size(); ++i) {
      CAPTURE(i);
      CHECK(close(out[i], ref.out[i], 1e-4, 1e-3));
    }
    for (size_t i = 0; i < mean.size(); ++i) {
      // Within one float step of the exact mean (plus a little for the means near 0), also for
      // the offset row.
      const float exact = static_cast<float>(ref.mean[i]);
      const float step = std::nextafter(std::abs(exact), INFINITY) - std::abs(exact);
      CHECK(std::abs(mean[i] - exact) <= step + 1e-6f);
      CHECK(rstd[i] == doctest::Approx(ref.rstd[i]).epsilon(1e-5));
    }
  }
}

TEST_CASE("layernorm backward matches finite differences; parameter gradients accumulate") {
  CpuOps ops;
  std::mt19937_64 rng(2);
  const int64_t rows = 5, cols = 11;
  Floats x = random_floats(rng, rows * cols, -2.0, 2.0);
  Floats gamma = random_floats(rng, cols, 0.5, 1.5);
  Floats beta = random_floats(rng, cols);
  const Floats weights = random_floats(rng, rows * cols);
  Floats out(x.size()), mean(rows), rstd(rows);
  const auto loss = [&] {
    ops.layernorm_forward(ConstMatrix{x.data(), rows, cols}, gamma.data(), beta.data(),
                          Matrix{out.data(), rows, cols}, mean.data(), rstd.data());
    return weighted_sum(out, weights);
  };
  loss();
  Floats dx(x.size(), std::nanf(""));  // overwritten
  const Floats dgamma0 = random_floats(rng, cols), dbeta0 = random_floats(rng, cols);
  Floats dgamma = dgamma0, dbeta = dbeta0;
  ops.layernorm_backward(ConstMatrix{x.data(), rows, cols}, gamma.data(), mean.data(), rstd.data(),
                         ConstMatrix{weights.data(), rows, cols}, Matrix{dx.data(), rows, cols},
                         dgamma.data(), dbeta.data());
  for (size_t j = 0; j < dgamma.size(); ++j) {  // accumulated: strip what was there
    dgamma[j] -= dgamma0[j];
    dbeta[j] -= dbeta0[j];
  }
  check_gradient("x", x, dx, loss);
  check_gradient("gamma", gamma, dgamma, loss);
  check_gradient("beta", beta, dbeta, loss);
}

TEST_CASE("attention forward matches a double reference, with exact zeros above the diagonal") {
  SUBCASE("small") {
    check_attention_forward({2, 5, 2, 8}, 3, 1.0);
  }
  SUBCASE("several row blocks, the last one partial") {
    check_attention_forward({2, 133, 3, 12}, 4, 1.0);
  }
  SUBCASE("one head, one position") {
    check_attention_forward({3, 1, 1, 4}, 5, 1.0);
  }
}

TEST_CASE("attention backward matches finite differences") {
  SUBCASE("small, every element") {
    check_attention_backward({2, 5, 2, 8}, 6, 0);
  }
  SUBCASE("several row blocks, sampled elements") {
    check_attention_backward({1, 133, 2, 8}, 7, 300);
  }
}

TEST_CASE("attention is causal: a later position's q, k, v never change earlier outputs") {
  CpuOps ops;
  const AttentionCase c{2, 70, 2, 8};
  std::mt19937_64 rng(8);
  const Floats qkv = random_floats(rng, c.rows() * 3 * c.width);
  const AttentionResult base = run_attention(ops, c, qkv);
  for (int64_t t = 0; t + 1 < c.seq; ++t) {
    CAPTURE(t);
    Floats changed = qkv;
    const int64_t row = 1 * c.seq + t + 1;  // batch 1, position t + 1
    for (int64_t j = 0; j < 3 * c.width; ++j)
      changed[static_cast<size_t>(row * 3 * c.width + j)] += 5.0f;
    const AttentionResult got = run_attention(ops, c, changed);
    // Batch 0 entirely and batch 1 up to t: the same bits.
    const size_t same = static_cast<size_t>((c.seq + t + 1) * c.width);
    CHECK(std::memcmp(got.out.data(), base.out.data(), same * sizeof(float)) == 0);
    CHECK(std::memcmp(got.out.data() + same, base.out.data() + same, c.width * sizeof(float)) != 0);
  }
}

TEST_CASE("attention softmax is stable for huge logits and deterministic") {
  // q scaled by 1e3: scores around 1e5, where a naive exp overflows.
  CpuOps ops;
  const AttentionCase c{2, 5, 2, 8};
  std::mt19937_64 rng(9);
  Floats qkv = random_floats(rng, c.rows() * 3 * c.width);
  for (int64_t i = 0; i < c.rows(); ++i) {
    for (int64_t j = 0; j < c.width; ++j)
      qkv[static_cast<size_t>(i * 3 * c.width + j)] *= 1000.0f;
  }
  const AttentionResult first = run_attention(ops, c, qkv);
  const AttentionReference ref = attention_reference(qkv, c.batch, c.seq, c.heads, c.width);
  for (size_t i = 0; i < first.out.size(); ++i) {
    CAPTURE(i);
    REQUIRE(std::isfinite(first.out[i]));
    CHECK(close(first.out[i], ref.out[i], 1e-4, 1e-3));
  }
  for (size_t i = 0; i < first.att.size(); ++i)
    REQUIRE(std::isfinite(first.att[i]));

  const AttentionResult second = run_attention(ops, c, qkv);
  CHECK(std::memcmp(first.out.data(), second.out.data(), first.out.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(first.att.data(), second.att.data(), first.att.size() * sizeof(float)) == 0);
}

TEST_CASE("attention rejects shapes that do not fit") {
  CpuOps ops;
  Floats qkv(2 * 3 * 24 * 8), out(2 * 3 * 24 * 8), att(2 * 3 * 3 * 9 * 9);
  const auto forward_error = [&](ConstMatrix q, int64_t batch, int64_t seq, int64_t heads,
                                 Matrix o) {
    try {
      ops.attention_forward(q, batch, seq, heads, o, att.data());
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::internal);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  // qkv.cols != 3 * width
  CHECK(forward_error(ConstMatrix{qkv.data(), 6, 20}, 2, 3, 2, Matrix{out.data(), 6, 8})
            .find("[6, 20]") != std::string::npos);
  // width % heads != 0
  CHECK(forward_error(ConstMatrix{qkv.data(), 6, 24}, 2, 3, 3, Matrix{out.data(), 6, 8})
            .find("heads 3") != std::string::npos);
  // rows != batch * seq
  CHECK(forward_error(ConstMatrix{qkv.data(), 6, 24}, 2, 4, 2, Matrix{out.data(), 6, 8})
            .find("seq 4") != std::string::npos);
  CHECK(forward_error(ConstMatrix{qkv.data(), 6, 24}, 2, 3, 2, Matrix{out.data(), 5, 8}) !=
        "no error");

  Floats dqkv(qkv.size());
  CHECK_THROWS_AS(ops.attention_backward(
                      ConstMatrix{qkv.data(), 6, 24}, ConstMatrix{out.data(), 6, 8}, att.data(),
                      ConstMatrix{out.data(), 6, 8}, 2, 3, 2, Matrix{dqkv.data(), 6, 21}),
                  Error);
  CHECK_THROWS_AS(ops.attention_backward(
                      ConstMatrix{qkv.data(), 6, 24}, ConstMatrix{out.data(), 6, 8}, att.data(),
                      ConstMatrix{out.data(), 6, 8}, 2, 3, 5, Matrix{dqkv.data(), 6, 24}),
                  Error);
}

TEST_CASE("layernorm rejects shapes that do not fit") {
  CpuOps ops;
  Floats x(12), out(12), dx(12), gamma(4), beta(4), mean(3), rstd(3);
  try {
    ops.layernorm_forward(ConstMatrix{x.data(), 3, 4}, gamma.data(), beta.data(),
                          Matrix{out.data(), 4, 3}, mean.data(), rstd.data());
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::internal);
    CHECK(std::string(e.what()).find("[4, 3]") != std::string::npos);
  }
  CHECK_THROWS_AS(ops.layernorm_backward(ConstMatrix{x.data(), 3, 4}, gamma.data(), mean.data(),
                                         rstd.data(), ConstMatrix{out.data(), 3, 4},
                                         Matrix{dx.data(), 2, 4}, gamma.data(), beta.data()),
                  Error);
}

TEST_CASE("embedding forward adds token and position rows; backward accumulates both") {
  CpuOps ops;
  const int64_t vocab = 7, seq = 3, width = 5, rows = 6;
  std::mt19937_64 rng(10);
  const Floats wte = random_floats(rng, vocab * width);
  const Floats wpe = random_floats(rng, seq * width);
  const std::vector<int32_t> tokens = {6, 0, 6, 2, 2, 6};
  Floats out(static_cast<size_t>(rows * width));
  ops.embedding_forward(tokens.data(), seq, vocab, wte.data(), wpe.data(),
                        Matrix{out.data(), rows, width});
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < width; ++j) {
      const float expected = wte[static_cast<size_t>(tokens[static_cast<size_t>(i)] * width + j)] +
                             wpe[static_cast<size_t>((i % seq) * width + j)];
      CHECK(out[static_cast<size_t>(i * width + j)] == expected);
    }
  }

  const Floats dout = random_floats(rng, rows * width);
  const Floats dwte0 = random_floats(rng, vocab * width), dwpe0 = random_floats(rng, seq * width);
  Floats dwte = dwte0, dwpe = dwpe0;
  ops.embedding_backward(tokens.data(), seq, ConstMatrix{dout.data(), rows, width}, dwte.data(),
                         dwpe.data());
  std::vector<double> expected_te(dwte0.begin(), dwte0.end());
  std::vector<double> expected_pe(dwpe0.begin(), dwpe0.end());
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < width; ++j) {
      const double g = dout[static_cast<size_t>(i * width + j)];
      expected_te[static_cast<size_t>(tokens[static_cast<size_t>(i)] * width + j)] += g;
      expected_pe[static_cast<size_t>((i % seq) * width + j)] += g;
    }
  }
  for (size_t i = 0; i < dwte.size(); ++i)
    CHECK(dwte[i] == doctest::Approx(expected_te[i]).epsilon(1e-6));
  for (size_t i = 0; i < dwpe.size(); ++i)
    CHECK(dwpe[i] == doctest::Approx(expected_pe[i]).epsilon(1e-6));
  // Token 1 and 3..5 never occur: their rows are untouched.
  for (int64_t j = 0; j < width; ++j)
    CHECK(dwte[static_cast<size_t>(1 * width + j)] == dwte0[static_cast<size_t>(1 * width + j)]);
}

TEST_CASE("embedding rejects tokens outside the vocabulary and rows that are not whole sequences") {
  CpuOps ops;
  const Floats wte(4 * 2), wpe(2 * 2);
  Floats out(4 * 2);
  for (int32_t bad : {4, -1, 1000}) {
    CAPTURE(bad);
    const std::vector<int32_t> tokens = {0, 1, bad, 2};
    try {
      ops.embedding_forward(tokens.data(), 2, 4, wte.data(), wpe.data(), Matrix{out.data(), 4, 2});
      FAIL("no error");
    } catch (const Error& e) {
      const std::string message = e.what();
      CHECK(e.kind() == ErrorKind::recipe);
      CHECK(message.find("token " + std::to_string(bad)) != std::string::npos);
      CHECK(message.find("4)") != std::string::npos);
      CHECK(message.find("model.vocab") != std::string::npos);
    }
  }
  const std::vector<int32_t> tokens = {0, 1, 2, 3};
  try {
    ops.embedding_forward(tokens.data(), 3, 4, wte.data(), wpe.data(), Matrix{out.data(), 4, 2});
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::internal);
  }
  Floats dwte(8), dwpe(4);
  CHECK_THROWS_AS(ops.embedding_backward(tokens.data(), 3, ConstMatrix{out.data(), 4, 2},
                                         dwte.data(), dwpe.data()),
                  Error);
}

}  // namespace dptrain
