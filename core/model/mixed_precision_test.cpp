// The models' bf16 and fp16 paths without a GPU: on the 16-bit-storage CPU op table
// (EmulatedHalfOps), the GPT's and the MLP's loss and gradients match f32 on the CPU from the same
// (rounded) parameters, within what 16-bit activations allow. The GPU tests check the CUDA op
// table the same way.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/model/gpt.hpp"
#include "core/model/mlp.hpp"
#include "core/tensor/emulated_ops.hpp"
#include "tests/model_check.hpp"

namespace dptrain {
namespace {

using test::Gradients;
using test::random_windows;
using test::run_model;
using test::tiny_gpt;

// Values as a 16-bit copy holds them.
std::vector<float> rounded(const std::vector<float>& v, DType dtype) {
  CpuOps cpu;
  std::vector<uint16_t> half(v.size());
  std::vector<float> out(v.size());
  cpu.cast(v.data(), DType::f32, half.data(), dtype, static_cast<int64_t>(v.size()));
  cpu.cast(half.data(), dtype, out.data(), DType::f32, static_cast<int64_t>(v.size()));
  return out;
}

double tolerance(DType dtype) {
  return dtype == DType::bf16 ? 3e-2 : 5e-3;
}

void compare(const Gradients& got, const Gradients& want, DType dtype, const std::string& what) {
  CAPTURE(what);
  CAPTURE(dtype_name(dtype));
  const double tol = tolerance(dtype);
  CHECK(got.loss == doctest::Approx(want.loss).epsilon(tol));
  CHECK(got.eval.loss_sum == doctest::Approx(want.eval.loss_sum).epsilon(tol));
  CHECK(got.eval.count == want.eval.count);
  REQUIRE(got.grads.size() == want.grads.size());
  double largest = 0, worst = 0;
  size_t not_finite = 0;
  for (size_t i = 0; i < want.grads.size(); ++i) {
    if (!std::isfinite(got.grads[i])) ++not_finite;
    largest = std::max(largest, static_cast<double>(std::abs(want.grads[i])));
    worst = std::max(worst, static_cast<double>(std::abs(got.grads[i] - want.grads[i])));
  }
  CHECK(not_finite == 0);
  CHECK(largest > 0);
  // 16-bit activations round the gradients too: measured against the largest one.
  CHECK(worst <= 10 * tol * largest);
  // Not equal either: the activations really were stored in 16 bits.
  CHECK(worst > 0);
}

}  // namespace

TEST_CASE("mixed precision: the GPT's loss and gradients in bf16 and fp16 match f32") {
  const GptConfig c = tiny_gpt();
  Gpt f32_model(c, std::make_shared<CpuOps>());
  std::vector<float> params(f32_model.num_params());
  f32_model.init_params(params, 7);
  const auto windows = random_windows(3, c.context + 1, c.vocab, 11);
  const Batch batch{nullptr, windows.data(), 3};
  CpuOps cpu;
  for (DType dtype : {DType::bf16, DType::f16}) {
    // f32 from the parameters the 16-bit copy holds.
    const Gradients want = run_model(f32_model, cpu, rounded(params, dtype), batch);
    auto ops = std::make_shared<EmulatedHalfOps>();
    Gpt model(c, ops, dtype);
    compare(run_model(model, *ops, params, batch), want, dtype, "gpt");
  }
}

TEST_CASE("mixed precision: the MLP's loss and gradients in bf16 and fp16 match f32") {
  const std::vector<int64_t> widths = {20, 33, 17, 5};
  Mlp f32_model(widths, Activation::gelu, std::make_shared<CpuOps>());
  std::vector<float> params(f32_model.num_params());
  f32_model.init_params(params, 3);
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> x(9 * 20);
  for (float& v : x)
    v = uniform(rng);
  std::vector<int32_t> y(9);
  for (size_t i = 0; i < y.size(); ++i)
    y[i] = static_cast<int32_t>(i % 5);
  CpuOps cpu;
  for (DType dtype : {DType::bf16, DType::f16}) {
    std::vector<float> x16 = rounded(x, dtype);
    const Gradients want =
        run_model(f32_model, cpu, rounded(params, dtype), Batch{x16.data(), y.data(), 9});
    auto ops = std::make_shared<EmulatedHalfOps>();
    Mlp model(widths, Activation::gelu, ops, dtype);
    compare(run_model(model, *ops, params, Batch{x.data(), y.data(), 9}), want, dtype, "mlp");
  }
}

TEST_CASE("mixed precision: the emulated table rounds 16-bit outputs and passes f32 through") {
  EmulatedHalfOps ops;
  CpuOps cpu;
  // [2 x 3] x [3 x 2] in bf16: f32 products of the rounded inputs, rounded once.
  const std::vector<float> a = {1.001f, 2.0f, -3.0f, 0.5f, 0.25f, 7.0f};
  const std::vector<float> b = {1.0f, 0.1f, -0.3f, 2.0f, 0.7f, 1.5f};
  std::vector<uint16_t> a16(6), b16(6), c16(4);
  cpu.cast(a.data(), DType::f32, a16.data(), DType::bf16, 6);
  cpu.cast(b.data(), DType::f32, b16.data(), DType::bf16, 6);
  ops.gemm(ConstMatrix{a16.data(), 2, 3, DType::bf16}, Transpose::no,
           ConstMatrix{b16.data(), 3, 2, DType::bf16}, Transpose::no,
           Matrix{c16.data(), 2, 2, DType::bf16}, 1.0f, 0.0f);
  const std::vector<float> ar = rounded(a, DType::bf16), br = rounded(b, DType::bf16);
  std::vector<float> want(4);
  cpu.gemm(ConstMatrix{ar.data(), 2, 3}, Transpose::no, ConstMatrix{br.data(), 3, 2}, Transpose::no,
           Matrix{want.data(), 2, 2}, 1.0f, 0.0f);
  want = rounded(want, DType::bf16);
  std::vector<float> got(4);
  cpu.cast(c16.data(), DType::bf16, got.data(), DType::f32, 4);
  CHECK(got == want);
  // A 16-bit input with an f32 output (weight gradients): not rounded.
  std::vector<float> c32(4);
  ops.gemm(ConstMatrix{a16.data(), 2, 3, DType::bf16}, Transpose::no,
           ConstMatrix{b16.data(), 3, 2, DType::bf16}, Transpose::no, Matrix{c32.data(), 2, 2},
           1.0f, 0.0f);
  cpu.gemm(ConstMatrix{ar.data(), 2, 3}, Transpose::no, ConstMatrix{br.data(), 3, 2}, Transpose::no,
           Matrix{want.data(), 2, 2}, 1.0f, 0.0f);
  CHECK(c32 == want);
}

}  // namespace dptrain
