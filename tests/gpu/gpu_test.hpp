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

// Relative tolerance of a result computed in `dtype` against the f32 CPU reference.
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

// Every element of got within tol * max(1, max |want|) of want; the message names the worst.
inline void check_close(const std::vector<float>& got, const std::vector<float>& want, double tol,
                        const std::string& what) {
  REQUIRE_MESSAGE(got.size() == want.size(), what << ": sizes differ");
  double scale = 1.0;
  for (float w : want)
    scale = std::max(scale, static_cast<double>(std::fabs(w)));
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

}  // namespace dptrain::gputest
