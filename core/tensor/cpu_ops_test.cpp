// Tests of the CPU op table against straightforward double-precision references.
#include "core/tensor/cpu_ops.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <numbers>
#include <vector>

#include "core/error.hpp"
#include "core/tensor/emulated_ops.hpp"

namespace dptrain {
namespace {

std::vector<float> counting(int64_t n, float start, float step) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[static_cast<size_t>(i)] = start + step * static_cast<float>(i);
  return v;
}

float at(const std::vector<float>& m, int64_t cols, int64_t r, int64_t c, bool transposed) {
  // A transposed operand is stored [cols, rows] of its logical shape.
  return transposed ? m[static_cast<size_t>(c * cols + r)] : m[static_cast<size_t>(r * cols + c)];
}

double gelu_reference(double x) {
  return 0.5 * x *
         (1.0 + std::tanh(std::sqrt(2.0 / std::numbers::pi) * (x + 0.044715 * x * x * x)));
}

}  // namespace

TEST_CASE("gemm matches a reference for every transpose combination, with alpha and beta") {
  CpuOps ops;
  const int64_t m = 3, k = 4, n = 5;
  for (bool ta : {false, true}) {
    for (bool tb : {false, true}) {
      CAPTURE(ta);
      CAPTURE(tb);
      const std::vector<float> a = counting(m * k, -1.0f, 0.25f);
      const std::vector<float> b = counting(k * n, 0.5f, -0.125f);
      std::vector<float> c = counting(m * n, 1.0f, 1.0f);
      const std::vector<float> c0 = c;
      const ConstMatrix a_view{a.data(), ta ? k : m, ta ? m : k};
      const ConstMatrix b_view{b.data(), tb ? n : k, tb ? k : n};
      ops.gemm(a_view, ta ? Transpose::yes : Transpose::no, b_view,
               tb ? Transpose::yes : Transpose::no, Matrix{c.data(), m, n}, 2.0f, 0.5f);
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
          double sum = 0;
          for (int64_t p = 0; p < k; ++p) {
            sum += double(at(a, a_view.cols, i, p, ta)) * at(b, b_view.cols, p, j, tb);
          }
          const double expected = 2.0 * sum + 0.5 * c0[static_cast<size_t>(i * n + j)];
          CHECK(c[static_cast<size_t>(i * n + j)] == doctest::Approx(expected).epsilon(1e-5));
        }
      }
    }
  }
}

TEST_CASE("gemm rejects shapes that do not fit") {
  CpuOps ops;
  std::vector<float> a(6), b(6), c(4);
  try {
    ops.gemm(ConstMatrix{a.data(), 2, 3}, Transpose::no, ConstMatrix{b.data(), 2, 3}, Transpose::no,
             Matrix{c.data(), 2, 2}, 1.0f, 0.0f);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::internal);
    CHECK(std::string(e.what()).find("[2, 3]") != std::string::npos);
  }
}

TEST_CASE("gemm with an empty inner dimension scales c by beta") {
  CpuOps ops;
  std::vector<float> c = {1, 2, 3, 4};
  ops.gemm(ConstMatrix{nullptr, 2, 0}, Transpose::no, ConstMatrix{nullptr, 0, 2}, Transpose::no,
           Matrix{c.data(), 2, 2}, 1.0f, 0.0f);
  CHECK(c == std::vector<float>{0, 0, 0, 0});
}

TEST_CASE("bias rows are added and bias gradients accumulate column sums") {
  CpuOps ops;
  std::vector<float> x = {1, 2, 3, 4, 5, 6};
  const std::vector<float> bias = {10, 20, 30};
  ops.add_bias_rows(Matrix{x.data(), 2, 3}, bias.data());
  CHECK(x == std::vector<float>{11, 22, 33, 14, 25, 36});

  std::vector<float> grad = {1, 1, 1};
  ops.bias_grad(ConstMatrix{x.data(), 2, 3}, grad.data());
  CHECK(grad == std::vector<float>{26, 48, 70});
}

TEST_CASE("linear: x W^T plus a bias, plus y itself or a separate residual") {
  CpuOps ops;
  const std::vector<float> x = {1, 2, 3, 4};        // [2, 2]
  const std::vector<float> w = {1, 0, 0, 1, 1, 1};  // [3, 2]: x W^T = [[1, 2, 3], [3, 4, 7]]
  const std::vector<float> bias = {10, 20, 30};
  const std::vector<float> residual = {100, 200, 300, 400, 500, 600};
  std::vector<float> y(6, -1.0f);
  ops.linear(ConstMatrix{x.data(), 2, 2}, w.data(), bias.data(), Matrix{y.data(), 2, 3}, nullptr);
  CHECK(y == std::vector<float>{11, 22, 33, 13, 24, 37});
  // In place: y += x W^T + bias.
  ops.linear(ConstMatrix{x.data(), 2, 2}, w.data(), bias.data(), Matrix{y.data(), 2, 3}, y.data());
  CHECK(y == std::vector<float>{22, 44, 66, 26, 48, 74});
  // A residual connection: y's old values go, the residual is read and left as it was.
  ops.linear(ConstMatrix{x.data(), 2, 2}, w.data(), nullptr, Matrix{y.data(), 2, 3},
             residual.data());
  CHECK(y == std::vector<float>{101, 202, 303, 403, 504, 607});
  CHECK(residual == std::vector<float>{100, 200, 300, 400, 500, 600});
}

TEST_CASE("a linear layer with its activation keeps the pre-activation") {
  CpuOps ops;
  const std::vector<float> x = {1, 2, 3, 4};         // [2, 2]
  const std::vector<float> w = {1, 0, 0, -1, 1, 1};  // [3, 2]: x W^T = [[1, -2, 3], [3, -4, 7]]
  const std::vector<float> bias = {0, 1, -5};
  std::vector<float> pre(6), out(6);
  ops.linear_activation(ConstMatrix{x.data(), 2, 2}, w.data(), bias.data(), Activation::relu,
                        Matrix{pre.data(), 2, 3}, Matrix{out.data(), 2, 3});
  CHECK(pre == std::vector<float>{1, -1, -2, 3, -3, 2});
  CHECK(out == std::vector<float>{1, 0, 0, 3, 0, 2});
}

TEST_CASE("a linear layer's parameter gradients accumulate; its input gradient goes through f'") {
  CpuOps ops;
  const std::vector<float> dy = {1, 2, 3, 4};       // [2, 2]
  const std::vector<float> x = {1, 0, 2, 0, 1, 1};  // [2, 3]
  std::vector<float> dw(6, 1.0f), db = {10, 20};
  ops.linear_weight_grad(ConstMatrix{dy.data(), 2, 2}, ConstMatrix{x.data(), 2, 3}, dw.data(),
                         db.data());
  // dy^T x = [[1, 3, 5], [2, 4, 8]], plus the 1s there; column sums of dy: 4, 6.
  CHECK(dw == std::vector<float>{2, 4, 6, 3, 5, 9});
  CHECK(db == std::vector<float>{14, 26});
  ops.linear_weight_grad(ConstMatrix{dy.data(), 2, 2}, ConstMatrix{x.data(), 2, 3}, dw.data(),
                         nullptr);
  CHECK(dw == std::vector<float>{3, 7, 11, 5, 9, 17});

  // dy W with W [2, 3] = [[1, 0, -1], [0, 1, 1]]: [[1, 2, 1], [3, 4, 1]], times relu'(pre).
  const std::vector<float> w = {1, 0, -1, 0, 1, 1};
  const std::vector<float> pre = {1, -1, 1, -1, 1, 1};
  std::vector<float> dpre(6, 99.0f);
  ops.linear_activation_grad(ConstMatrix{dy.data(), 2, 2}, w.data(), Activation::relu,
                             ConstMatrix{pre.data(), 2, 3}, Matrix{dpre.data(), 2, 3});
  CHECK(dpre == std::vector<float>{1, 0, 1, 0, 4, 1});
}

TEST_CASE("relu and gelu forward and backward") {
  CpuOps ops;
  const std::vector<float> pre = {-2.0f, -0.5f, 0.0f, 0.3f, 1.0f, 3.0f};
  const int64_t n = static_cast<int64_t>(pre.size());
  std::vector<float> out(pre.size());
  std::vector<float> dout(pre.size(), 2.0f);
  std::vector<float> dpre(pre.size());

  ops.activation_forward(Activation::relu, ConstMatrix{pre.data(), 2, 3}, Matrix{out.data(), 2, 3});
  CHECK(out == std::vector<float>{0, 0, 0, 0.3f, 1, 3});
  ops.activation_backward(Activation::relu, ConstMatrix{pre.data(), 2, 3},
                          ConstMatrix{dout.data(), 2, 3}, Matrix{dpre.data(), 2, 3});
  CHECK(dpre == std::vector<float>{0, 0, 0, 2, 2, 2});

  ops.activation_forward(Activation::gelu, ConstMatrix{pre.data(), 1, n}, Matrix{out.data(), 1, n});
  CHECK(out[4] == doctest::Approx(0.8411920).epsilon(1e-6));  // gelu_tanh(1)
  ops.activation_backward(Activation::gelu, ConstMatrix{pre.data(), 1, n},
                          ConstMatrix{dout.data(), 1, n}, Matrix{dpre.data(), 1, n});
  for (size_t i = 0; i < pre.size(); ++i) {
    CAPTURE(pre[i]);
    const double x = pre[i];
    CHECK(out[i] == doctest::Approx(gelu_reference(x)).epsilon(1e-6));
    const double h = 1e-6;
    const double slope = (gelu_reference(x + h) - gelu_reference(x - h)) / (2 * h);
    CHECK(dpre[i] == doctest::Approx(2.0 * slope).epsilon(1e-5));
  }
}

TEST_CASE("softmax cross-entropy: known values, stability with huge logits, in-place gradient") {
  CpuOps ops;
  // Row 0: equal logits -> log 2. Row 1: a huge margin for the right class -> ~0.
  // Row 2: a huge margin against the label -> 1000 (a naive exp would overflow).
  std::vector<float> logits = {0.0f, 0.0f, 1000.0f, 0.0f, 0.0f, 1000.0f};
  const std::vector<int32_t> labels = {1, 0, 0};
  const Matrix z{logits.data(), 3, 2};
  const double loss = ops.softmax_cross_entropy_forward(z, labels.data(), z);
  CHECK(loss == doctest::Approx((std::log(2.0) + 0.0 + 1000.0) / 3.0));
  CHECK(logits[0] == doctest::Approx(0.5));
  CHECK(logits[2] == doctest::Approx(1.0));

  ops.softmax_cross_entropy_backward(z, labels.data(), z, 3.0f);
  // scale / rows = 1: gradient = probs - onehot.
  CHECK(logits == std::vector<float>{0.5f, -0.5f, 0.0f, 0.0f, -1.0f, 1.0f});
}

TEST_CASE("softmax cross-entropy rejects labels outside the classes") {
  CpuOps ops;
  std::vector<float> logits = {0.0f, 1.0f};
  const std::vector<int32_t> labels = {2};
  const Matrix z{logits.data(), 1, 2};
  CHECK_THROWS_AS(ops.softmax_cross_entropy_forward(z, labels.data(), z), Error);
}

TEST_CASE("count_correct takes the first maximum") {
  CpuOps ops;
  const std::vector<float> scores = {1, 3, 3, 5, 0, 0, 0, 0, 0};
  CHECK(ops.count_correct(ConstMatrix{scores.data(), 3, 3}, std::vector<int32_t>{1, 0, 0}.data()) ==
        3);
  CHECK(ops.count_correct(ConstMatrix{scores.data(), 3, 3}, std::vector<int32_t>{2, 1, 2}.data()) ==
        0);
}

namespace {

// `rows` rows of `cols` values from `values`, `stride` apart; the gaps hold `gap`.
std::vector<float> padded(const std::vector<float>& values, int64_t rows, int64_t cols,
                          int64_t stride, float gap) {
  std::vector<float> out(static_cast<size_t>(rows * stride), gap);
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j)
      out[static_cast<size_t>(i * stride + j)] = values[static_cast<size_t>(i * cols + j)];
  }
  return out;
}

// The rows of a padded f32 matrix of dtype `dtype` as contiguous floats, and whether every gap
// still holds `gap` (in `dtype`'s encoding).
struct Unpadded {
  std::vector<float> values;
  bool gaps_kept = true;
};
Unpadded unpadded(Ops& ops, const std::vector<char>& bytes, DType dtype, int64_t rows, int64_t cols,
                  int64_t stride, const std::vector<char>& gap_bytes) {
  const size_t size = dtype_size(dtype);
  std::vector<float> wide(static_cast<size_t>(rows * stride));
  ops.cast(bytes.data(), dtype, wide.data(), DType::f32, rows * stride);
  Unpadded out;
  for (int64_t i = 0; i < rows; ++i) {
    for (int64_t j = 0; j < stride; ++j) {
      const size_t at = static_cast<size_t>(i * stride + j);
      if (j < cols) {
        out.values.push_back(wide[at]);
      } else if (std::memcmp(bytes.data() + at * size, gap_bytes.data() + at * size, size) != 0) {
        out.gaps_kept = false;
      }
    }
  }
  return out;
}

// f32 values as `dtype` bytes.
std::vector<char> encoded(Ops& ops, const std::vector<float>& values, DType dtype) {
  std::vector<char> out(values.size() * dtype_size(dtype));
  ops.cast(values.data(), DType::f32, out.data(), dtype, static_cast<int64_t>(values.size()));
  return out;
}

}  // namespace

TEST_CASE("padded rows: gemm and the softmax cross-entropy ops use only each row's columns") {
  CpuOps cpu;
  EmulatedHalfOps emulated;
  const int64_t m = 3, k = 5, n = 7, stride = 8;
  const float gap = 768.0f;  // exact in bf16 and f16 (3 x 2^8)
  const std::vector<float> a = counting(m * k, -1.0f, 0.125f);
  const std::vector<float> b = counting(n * k, 0.5f, -0.0625f);  // [n, k], used transposed
  const std::vector<int32_t> labels = {0, 6, 3};
  for (const DType dtype : {DType::f32, DType::bf16}) {
    CAPTURE(dtype_name(dtype));
    Ops& ops = dtype == DType::f32 ? static_cast<Ops&>(cpu) : static_cast<Ops&>(emulated);
    const std::vector<char> ea = encoded(ops, a, dtype), eb = encoded(ops, b, dtype);
    // The same gemm into a contiguous c and into one padded to 8 per row (a padded too).
    std::vector<char> c = encoded(ops, std::vector<float>(m * n, 0.0f), dtype);
    ops.gemm(ConstMatrix{ea.data(), m, k, dtype}, Transpose::no,
             ConstMatrix{eb.data(), n, k, dtype}, Transpose::yes, Matrix{c.data(), m, n, dtype},
             1.0f, 0.0f);
    const std::vector<char> pa = encoded(ops, padded(a, m, k, stride, gap), dtype);
    const std::vector<char> gaps =
        encoded(ops, padded(std::vector<float>(m * n, 0.0f), m, n, stride, gap), dtype);
    std::vector<char> pc = gaps;
    ops.gemm(ConstMatrix{pa.data(), m, k, dtype, stride}, Transpose::no,
             ConstMatrix{eb.data(), n, k, dtype}, Transpose::yes,
             Matrix{pc.data(), m, n, dtype, stride}, 1.0f, 0.0f);
    std::vector<float> want(static_cast<size_t>(m * n));
    ops.cast(c.data(), dtype, want.data(), DType::f32, m * n);
    Unpadded got = unpadded(ops, pc, dtype, m, n, stride, gaps);
    CHECK(got.values == want);
    CHECK(got.gaps_kept);

    // Softmax cross-entropy over the padded logits: the loss, probs, gradient and the fused op
    // equal the contiguous ones; the gaps (768, far above every logit) are never read.
    const Matrix z{c.data(), m, n, dtype};
    const Matrix pz{pc.data(), m, n, dtype, stride};
    CHECK(ops.count_correct(pz, labels.data()) == ops.count_correct(z, labels.data()));
    std::vector<char> probs = c;
    const double loss =
        ops.softmax_cross_entropy_forward(z, labels.data(), Matrix{probs.data(), m, n, dtype});
    std::vector<char> pprobs = pc;
    const Matrix pp{pprobs.data(), m, n, dtype, stride};
    CHECK(ops.softmax_cross_entropy_forward(pz, labels.data(), pp) == loss);
    std::vector<float> want_probs(static_cast<size_t>(m * n));
    ops.cast(probs.data(), dtype, want_probs.data(), DType::f32, m * n);
    got = unpadded(ops, pprobs, dtype, m, n, stride, gaps);
    CHECK(got.values == want_probs);
    CHECK(got.gaps_kept);
    ops.softmax_cross_entropy_backward(Matrix{probs.data(), m, n, dtype}, labels.data(),
                                       Matrix{probs.data(), m, n, dtype}, 2.0f);
    ops.softmax_cross_entropy_backward(pp, labels.data(), pp, 2.0f);
    std::vector<float> want_grad(static_cast<size_t>(m * n));
    ops.cast(probs.data(), dtype, want_grad.data(), DType::f32, m * n);
    got = unpadded(ops, pprobs, dtype, m, n, stride, gaps);
    CHECK(got.values == want_grad);
    CHECK(got.gaps_kept);
    // The fused op: the same loss and gradient, in place.
    std::vector<char> fused = pc;
    const Matrix pf{fused.data(), m, n, dtype, stride};
    CHECK(ops.softmax_cross_entropy(pf, labels.data(), pf, 2.0f) == loss);
    got = unpadded(ops, fused, dtype, m, n, stride, gaps);
    CHECK(got.values == want_grad);
    CHECK(got.gaps_kept);
  }
  // The other ops take contiguous matrices only: a padded one is a bug, said so; rows closer
  // together than their columns are one everywhere.
  std::vector<float> x(16);
  const std::vector<float> w(36, 1.0f);
  CHECK_THROWS_WITH_AS(cpu.linear(ConstMatrix{x.data(), 2, 6, DType::f32, 8}, w.data(), nullptr,
                                  Matrix{x.data(), 2, 6}, nullptr),
                       "linear: x and y must be contiguous, not padded rows", Error);
  const std::vector<int32_t> two_labels = {0, 1};
  CHECK_THROWS_WITH_AS(
      cpu.count_correct(ConstMatrix{x.data(), 2, 6, DType::f32, 4}, two_labels.data()),
      "a matrix has rows 4 elements apart for 6 columns", Error);
  try {
    cpu.activation_forward(Activation::relu, ConstMatrix{x.data(), 2, 6, DType::f32, 8},
                           Matrix{x.data(), 2, 6, DType::f32, 8});
    FAIL("a padded matrix was taken");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::internal);
    CHECK(std::string(e.what()) ==
          "a contiguous matrix was expected, got rows 8 elements apart for 6 columns");
  }
}

TEST_CASE("axpy and scale") {
  CpuOps ops;
  std::vector<float> y = {1, 2, 3};
  const std::vector<float> x = {1, 1, 2};
  ops.axpy(3, 0.5f, x.data(), y.data());
  CHECK(y == std::vector<float>{1.5f, 2.5f, 4.0f});
  ops.scale(3, 2.0f, y.data());
  CHECK(y == std::vector<float>{3.0f, 5.0f, 8.0f});
}

TEST_CASE("parse_activation names the field on a bad value") {
  CHECK(parse_activation("gelu") == Activation::gelu);
  try {
    parse_activation("tanh");
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::recipe);
    CHECK(std::string(e.what()).find("model.activation") != std::string::npos);
  }
}

TEST_CASE("cast: f32 to bf16 and fp16 and back rounds to nearest even within half an ulp") {
  CpuOps ops;
  const std::vector<float> values = {
      0.0f, 1.0f, -2.5f, 1.0f + 1.0f / 256, 3.14159265f, 1e-3f, -7e-5f, 65504.0f, 1e30f, -1e-30f};
  for (DType dtype : {DType::bf16, DType::f16}) {
    CAPTURE(dtype_name(dtype));
    std::vector<uint16_t> wire(values.size());
    std::vector<float> back(values.size());
    const auto n = static_cast<int64_t>(values.size());
    ops.cast(values.data(), DType::f32, wire.data(), dtype, n);
    ops.cast(wire.data(), dtype, back.data(), DType::f32, n);
    // bf16 keeps 8 significant bits, fp16 11 (and flushes below its range, overflows above).
    const double ulp = dtype == DType::bf16 ? 1.0 / 128 : 1.0 / 1024;
    for (size_t i = 0; i < values.size(); ++i) {
      CAPTURE(values[i]);
      const double v = values[i];
      if (dtype == DType::f16 && std::fabs(v) > 65504.0) {
        CHECK(std::isinf(back[i]));
      } else if (dtype == DType::f16 && std::fabs(v) < 6.1e-5) {
        CHECK(std::fabs(back[i] - v) <= 6e-8);  // subnormal spacing 2^-24
      } else {
        CHECK(std::fabs(back[i] - v) <= 0.5 * ulp * std::fabs(v));
      }
    }
  }
  // 1 + 2^-8 is halfway between two bf16 values: it rounds to the even one, 1.
  std::vector<uint16_t> one(1);
  const float halfway = 1.0f + 1.0f / 256;
  ops.cast(&halfway, DType::f32, one.data(), DType::bf16, 1);
  CHECK(one[0] == 0x3f80);
  // 16-bit to 16-bit is not a cast the op table does.
  CHECK_THROWS_AS(ops.cast(one.data(), DType::bf16, one.data(), DType::f16, 1), Error);
}

}  // namespace dptrain
