// Helpers of the GPU tests: move data between the host and a CUDA op table in any dtype, and
// compare a device result with the CPU op table's (the reference) within a per-dtype tolerance.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/tensor/cpu_ops.hpp"
#include "kernels/cuda_ops.hpp"

namespace dptrain::gputest {

// One CUDA op table per test process (device 0), made on first use.
inline Ops& gpu() {
  static std::unique_ptr<Ops> ops = kernels::make_cuda_ops(0);
  return *ops;
}

// n values ~ U(-scale, scale), reproducible from the seed.
inline std::vector<float> random_vector(size_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  std::vector<float> out(n);
  for (float& v : out)
    v = dist(rng);
  return out;
}

// The host values on the device as `dtype` (rounded on the device, as a model's casts are).
inline Buffer to_device(const std::vector<float>& host, DType dtype = DType::f32) {
  Ops& ops = gpu();
  Buffer f32 = ops.allocate(host.size() * sizeof(float));
  ops.upload(host.data(), f32.data(), host.size() * sizeof(float));
  if (dtype == DType::f32) return f32;
  Buffer out = ops.allocate(host.size() * dtype_size(dtype));
  ops.cast(f32.data(), DType::f32, out.data(), dtype, static_cast<int64_t>(host.size()));
  ops.synchronize();
  return out;
}

inline Buffer to_device(const std::vector<int32_t>& host) {
  Ops& ops = gpu();
  Buffer out = ops.allocate(host.size() * sizeof(int32_t));
  ops.upload(host.data(), out.data(), host.size() * sizeof(int32_t));
  return out;
}

// n elements of `dtype` at device `data`, widened to float on the host.
inline std::vector<float> to_host(const void* data, size_t n, DType dtype = DType::f32) {
  Ops& ops = gpu();
  std::vector<float> out(n);
  if (dtype == DType::f32) {
    ops.download(data, out.data(), n * sizeof(float));
    return out;
  }
  Buffer f32 = ops.allocate(n * sizeof(float));
  ops.cast(data, dtype, f32.data(), DType::f32, static_cast<int64_t>(n));
  ops.download(f32.data(), out.data(), n * sizeof(float));
  return out;
}

// The values a host vector takes after a round trip through `dtype` (what the device computes
// from), so CPU references start from the same inputs.
inline std::vector<float> rounded(const std::vector<float>& host, DType dtype) {
  if (dtype == DType::f32) return host;
  const Buffer d = to_device(host, dtype);
  return to_host(d.data(), host.size(), dtype);
}

// Tolerance of a kernel's result computed in `dtype` against the f32 CPU reference, relative to
// the reference's largest value (check_close).
inline double tolerance(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return 1e-4;
    case DType::bf16:
      return 3e-2;
    case DType::f16:
      return 5e-3;
  }
  return 0;
}

// The largest |value| of v (0 for an empty or all-zero v).
inline double max_abs(const std::vector<float>& v) {
  double m = 0;
  for (float x : v)
    m = std::max(m, static_cast<double>(std::fabs(x)));
  return m;
}

// Every element of got within tol * scale of want; the message names the worst.
inline void check_close_scaled(const std::vector<float>& got, const std::vector<float>& want,
                               double tol, double scale, const std::string& what) {
  REQUIRE_MESSAGE(got.size() == want.size(), what << ": sizes differ");
  if (got.empty()) return;
  double worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= worst)) {  // also catches NaN
      worst = std::isnan(err) ? INFINITY : err;
      at = i;
    }
  }
  CHECK_MESSAGE(worst <= tol * scale, what << ": element " << at << " is " << got[at]
                                           << ", the CPU reference " << want[at] << " (error "
                                           << worst << ", allowed " << tol * scale << ")");
}

// Every element of got within tol * max |want| of want: the allowance scales with the reference
// itself, however small its values are (softmax probabilities, gradients), so zeros or flipped
// signs fail. Elements near zero next to larger ones get the same absolute allowance.
inline void check_close(const std::vector<float>& got, const std::vector<float>& want, double tol,
                        const std::string& what) {
  check_close_scaled(got, want, tol, max_abs(want), what);
}

// Every element of got within tol * max(1, max |want|) of want: for values whose error is
// absolute below 1, such as a log-sum-exp (an error of 1e-4 there is a relative 1e-4 in the
// probabilities, whatever the value itself).
inline void check_close_unit_floor(const std::vector<float>& got, const std::vector<float>& want,
                                   double tol, const std::string& what) {
  check_close_scaled(got, want, tol, std::max(1.0, max_abs(want)), what);
}

// ||got - want|| within tol * ||want|| (Euclidean norms): how far the values are off as a whole,
// so a group of small values that is wrong counts even where check_close's allowance, set by the
// largest value, would hide it.
inline void check_norm_close(const std::vector<float>& got, const std::vector<float>& want,
                             double tol, const std::string& what) {
  REQUIRE_MESSAGE(got.size() == want.size(), what << ": sizes differ");
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - want[i];
    diff += d * d;
    norm += static_cast<double>(want[i]) * want[i];
  }
  diff = std::sqrt(diff);
  norm = std::sqrt(norm);
  CHECK_MESSAGE(diff <= tol * norm, what << ": ||got - want|| is " << diff << ", "
                                         << (norm > 0 ? diff / norm : INFINITY) << " of ||want|| ("
                                         << norm << "); allowed " << tol);
}

}  // namespace dptrain::gputest
