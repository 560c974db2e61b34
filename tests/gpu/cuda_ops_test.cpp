// GPU tests of kernels/cuda_ops.cu: memory, casts, gemm and linear through cuBLASLt, the flat
// f32 buffer ops and the optimizer updates, each against the CPU op table or exact host values.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "core/tensor/cpu_ops.hpp"
#include "tests/gpu/gpu_test.hpp"
#include "tests/harness.hpp"
#include "tests/scoped_env.hpp"
#include "tests/temp_dir.hpp"

namespace dptrain::gputest {
namespace {

constexpr DType kDtypes[] = {DType::f32, DType::bf16, DType::f16};

std::string name_of(Transpose t) {
  return t == Transpose::yes ? "T" : "N";
}

// The host value x rounded to nearest even with `bits` significant bits, the smallest normal
// 2^min_exponent and the largest finite `max` (bf16: 8, -126, 0x7F7F; f16: 11, -14, 65504).
double round_to(double x, int bits, int min_exponent, double max) {
  if (!std::isfinite(x) || x == 0) return x;
  int e = 0;
  std::frexp(x, &e);  // x = f 2^e, 0.5 <= |f| < 1
  const double quantum = std::ldexp(1.0, std::max(e, min_exponent + 1) - bits);
  const double r = std::nearbyint(x / quantum) * quantum;  // the default rounding mode: even
  return std::fabs(r) > max ? std::copysign(INFINITY, x) : r;
}

double host_round(double x, DType dtype) {
  switch (dtype) {
    case DType::f32:
      return static_cast<float>(x);
    case DType::bf16:
      return round_to(x, 8, -126, 3.3895313892515355e38);
    case DType::f16:
      return round_to(x, 11, -14, 65504.0);
  }
  return x;
}

// The raw 16-bit patterns of n bf16/f16 values on the device.
std::vector<uint16_t> bits16(const void* data, size_t n) {
  std::vector<uint16_t> out(n);
  gpu().download(data, out.data(), n * sizeof(uint16_t));
  return out;
}

// Every element within tol relative to itself (stricter than check_close, whose allowance is set
// by the largest reference value).
void check_relative(const std::vector<float>& got, const std::vector<float>& want, double tol,
                    const std::string& what) {
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(static_cast<double>(got[i]) - want[i]);
    if (!(err <= tol * std::max(std::fabs(static_cast<double>(want[i])), 1e-30))) {
      FAIL_CHECK(what << ": element " << i << " is " << got[i] << ", the CPU reference "
                      << want[i]);
      return;
    }
  }
}

TEST_CASE("cuda_ops: device, allocation and copies") {
  Ops& ops = gpu();
  CHECK(ops.device() == "cuda:0");
  CHECK(kernels::compute_stream(ops) != nullptr);
  CHECK(kernels::device_count() >= 1);
  CHECK_FALSE(kernels::device_name(0).empty());
  CpuOps cpu;
  try {
    kernels::compute_stream(cpu);
    FAIL("compute_stream accepted a CPU op table");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::internal);
  }

  const Buffer empty = ops.allocate(0);
  CHECK(empty.data() == nullptr);
  CHECK(empty.bytes() == 0);

  const size_t n = 1001;
  Buffer zeroed = ops.allocate(n * sizeof(float));
  CHECK(zeroed.bytes() == n * sizeof(float));
  CHECK(to_host(zeroed.data(), n) == std::vector<float>(n, 0.0f));

  // Round trips are exact; copy and fill_zero run in stream order.
  const std::vector<float> host = random_vector(n, 1);
  ops.upload(host.data(), zeroed.data(), n * sizeof(float));
  CHECK(to_host(zeroed.data(), n) == host);
  Buffer other = ops.allocate(n * sizeof(float));
  ops.copy(zeroed.data(), other.data(), n * sizeof(float));
  ops.fill_zero(zeroed.data(), n * sizeof(float));
  CHECK(to_host(other.data(), n) == host);
  CHECK(to_host(zeroed.data(), n) == std::vector<float>(n, 0.0f));

  // Far more than any GPU has: Error(cuda) naming the size and the device.
  const size_t huge = size_t{1} << 50;
  try {
    ops.allocate(huge);
    FAIL("allocating 1 PiB succeeded");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::cuda);
    CHECK(std::string(e.what()).find(std::to_string(huge)) != std::string::npos);
    CHECK(std::string(e.what()).find("cuda:0") != std::string::npos);
  }
  // The failed allocation leaves no error behind for the next kernel to trip over.
  ops.scale(static_cast<int64_t>(n), 2.0f, other.as<float>());
  ops.synchronize();
  CHECK(to_host(other.data(), 1)[0] == host[0] * 2.0f);

  CHECK_THROWS_AS(kernels::make_cuda_ops(kernels::device_count()), Error);
}

TEST_CASE("cuda_ops: bf16 and f16 casts round to nearest even") {
  Ops& ops = gpu();
  const float one = 1.0f;
  const std::vector<float> values = {
      one,
      one + std::ldexp(1.0f, -8),                          // halfway: even is 1
      one + 3 * std::ldexp(1.0f, -8),                      // halfway: even is 1 + 2^-6
      one + std::ldexp(1.0f, -8) + std::ldexp(1.0f, -20),  // above halfway
      -2.5f,
      INFINITY,
      one + std::ldexp(1.0f, -11),      // f16 halfway: 1
      one + 3 * std::ldexp(1.0f, -11),  // f16 halfway: 1 + 2^-9
      65504.0f,                         // the largest f16
      65520.0f,                         // halfway to 65536: overflows to inf in f16
      std::ldexp(1.0f, -24),            // the smallest f16 subnormal
  };
  const Buffer src = to_device(values);
  Buffer bf = ops.allocate(values.size() * 2);
  Buffer hf = ops.allocate(values.size() * 2);
  ops.cast(src.data(), DType::f32, bf.data(), DType::bf16, static_cast<int64_t>(values.size()));
  ops.cast(src.data(), DType::f32, hf.data(), DType::f16, static_cast<int64_t>(values.size()));
  const std::vector<uint16_t> b = bits16(bf.data(), values.size());
  const std::vector<uint16_t> h = bits16(hf.data(), values.size());
  CHECK(b[0] == 0x3F80);
  CHECK(b[1] == 0x3F80);
  CHECK(b[2] == 0x3F82);
  CHECK(b[3] == 0x3F81);
  CHECK(b[4] == 0xC020);
  CHECK(b[5] == 0x7F80);
  CHECK(h[0] == 0x3C00);
  CHECK(h[6] == 0x3C00);
  CHECK(h[7] == 0x3C02);
  CHECK(h[8] == 0x7BFF);
  CHECK(h[9] == 0x7C00);
  CHECK(h[10] == 0x0001);

  // NaN stays NaN.
  const Buffer nan = to_device(std::vector<float>{NAN});
  ops.cast(nan.data(), DType::f32, bf.data(), DType::bf16, 1);
  ops.cast(nan.data(), DType::f32, hf.data(), DType::f16, 1);
  CHECK(std::isnan(to_host(bf.data(), 1, DType::bf16)[0]));
  CHECK(std::isnan(to_host(hf.data(), 1, DType::f16)[0]));

  // Every pair of dtypes: f32 -> from -> to -> f32 gives the host's rounding of each step.
  const size_t n = 5003;
  std::vector<float> host = random_vector(n, 2, 300.0f);
  host[0] = std::ldexp(1.0f, -20);  // an f16 subnormal
  host[1] = -std::ldexp(3.0f, -26);
  for (DType from : kDtypes) {
    for (DType to : kDtypes) {
      CAPTURE(dtype_name(from));
      CAPTURE(dtype_name(to));
      const Buffer a = to_device(host, from);
      Buffer b2 = ops.allocate(n * dtype_size(to));
      ops.cast(a.data(), from, b2.data(), to, static_cast<int64_t>(n));
      const std::vector<float> got = to_host(b2.data(), n, to);
      size_t wrong = 0;
      for (size_t i = 0; i < n; ++i) {
        const double want = host_round(host_round(host[i], from), to);
        if (static_cast<double>(got[i]) != want) ++wrong;
      }
      CHECK(wrong == 0);
    }
  }
}

// Padding at the end of each row of a, b and c (elements): rows `cols + pad` apart.
struct Pads {
  int64_t a = 0, b = 0, c = 0;
};

// c = alpha op(a) op(b) + beta c for an [m, k] x [k, n] product; `offset` elements shift every
// device pointer off cudaMalloc's alignment; with `pads`, the padding holds 768 (exact in every
// dtype), the result equals the CPU's on the same padded layout, and no padding of c changes.
void check_gemm(int64_t m, int64_t n, int64_t k, Transpose ta, Transpose tb, DType dtype,
                DType c_dtype, float alpha, float beta, size_t offset, uint64_t seed,
                Pads pads = {}) {
  CAPTURE(m);
  CAPTURE(n);
  CAPTURE(k);
  CAPTURE(name_of(ta));
  CAPTURE(name_of(tb));
  CAPTURE(std::string(dtype_name(dtype)));
  CAPTURE(std::string(dtype_name(c_dtype)));
  CAPTURE(beta);
  CAPTURE(offset);
  CAPTURE(pads.a);
  CAPTURE(pads.b);
  CAPTURE(pads.c);
  constexpr float kGap = 768.0f;
  const int64_t ar = ta == Transpose::no ? m : k, ac = ta == Transpose::no ? k : m;
  const int64_t br = tb == Transpose::no ? k : n, bc = tb == Transpose::no ? n : k;
  // `offset` values, then rows x (cols + pad) random values with kGap in each row's padding.
  const auto matrix = [&](int64_t rows, int64_t cols, int64_t pad, uint64_t s, DType t) {
    std::vector<float> v = random_vector(static_cast<size_t>(rows * (cols + pad)) + offset, s);
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = cols; j < cols + pad; ++j)
        v[offset + static_cast<size_t>(i * (cols + pad) + j)] = kGap;
    }
    return rounded(v, t);
  };
  const std::vector<float> a = matrix(ar, ac, pads.a, seed, dtype);
  const std::vector<float> b = matrix(br, bc, pads.b, seed + 1, dtype);
  const std::vector<float> c0 = matrix(m, n, pads.c, seed + 2, c_dtype);
  const int64_t lda = ac + pads.a, ldb = bc + pads.b, ldc = n + pads.c;

  CpuOps cpu;
  std::vector<float> want(c0.begin() + static_cast<ptrdiff_t>(offset), c0.end());
  cpu.gemm(ConstMatrix{a.data() + offset, ar, ac, DType::f32, lda}, ta,
           ConstMatrix{b.data() + offset, br, bc, DType::f32, ldb}, tb,
           Matrix{want.data(), m, n, DType::f32, ldc}, alpha, beta);

  const Buffer da = to_device(a, dtype), db = to_device(b, dtype);
  Buffer dc = to_device(c0, c_dtype);
  const auto at = [offset](const Buffer& buf, DType t) {
    return static_cast<char*>(buf.data()) + offset * dtype_size(t);
  };
  gpu().gemm(ConstMatrix{at(da, dtype), ar, ac, dtype, lda}, ta,
             ConstMatrix{at(db, dtype), br, bc, dtype, ldb}, tb,
             Matrix{at(dc, c_dtype), m, n, c_dtype, ldc}, alpha, beta);
  const std::vector<float> got = to_host(at(dc, c_dtype), want.size(), c_dtype);
  std::vector<float> got_values, want_values;
  size_t gaps_changed = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (static_cast<int64_t>(i) % ldc < n) {
      got_values.push_back(got[i]);
      want_values.push_back(want[i]);
    } else {
      gaps_changed += got[i] != kGap;
    }
  }
  // An f32 c holds f32 sums of exact products of the rounded inputs: f32 accuracy.
  check_close(got_values, want_values, tolerance(c_dtype), "gemm");
  CHECK_MESSAGE(gaps_changed == 0, gaps_changed << " padding element(s) of c were written");
}

TEST_CASE("cuda_ops: gemm, every transpose, dtype and beta") {
  uint64_t seed = 100;
  for (Transpose ta : {Transpose::no, Transpose::yes}) {
    for (Transpose tb : {Transpose::no, Transpose::yes}) {
      for (DType dtype : kDtypes) {
        std::vector<DType> c_dtypes = {dtype};
        if (dtype != DType::f32) c_dtypes.push_back(DType::f32);
        for (DType c_dtype : c_dtypes) {
          for (float beta : {0.0f, 1.0f}) {
            check_gemm(17, 7, 33, ta, tb, dtype, c_dtype, 0.75f, beta, 0, seed += 3);
          }
          check_gemm(1, 3, 1, ta, tb, dtype, c_dtype, 1.0f, 0.5f, 0, seed += 3);
          // Pointers one element off cudaMalloc's alignment.
          check_gemm(3, 1, 65, ta, tb, dtype, c_dtype, 1.0f, 1.0f, 1, seed += 3);
          check_gemm(17, 7, 33, ta, tb, dtype, c_dtype, 1.0f, 0.0f, 1, seed += 3);
        }
      }
    }
  }
}

TEST_CASE("cuda_ops: a large gemm") {
  // [512, 768] x [768, 3072]: the shape of a GPT-2 MLP layer, forward and weight gradient.
  check_gemm(512, 3072, 768, Transpose::no, Transpose::yes, DType::f32, DType::f32, 1.0f, 0.0f, 0,
             7);
  check_gemm(512, 3072, 768, Transpose::no, Transpose::yes, DType::bf16, DType::bf16, 1.0f, 0.0f, 0,
             8);
  check_gemm(768, 3072, 512, Transpose::yes, Transpose::no, DType::bf16, DType::f32, 1.0f, 1.0f, 0,
             9);
  check_gemm(512, 768, 3072, Transpose::no, Transpose::no, DType::f16, DType::f16, 1.0f, 0.0f, 0,
             10);
}

TEST_CASE("cuda_ops: the GPT-2 LM head's gemms, vocabulary 50257") {
  // The tied head's three products (core/model/gpt.cpp) at 512 rows, width 768 and GPT-2's
  // vocabulary: 50257 is an odd leading dimension, so in 16 bits every row after the first is
  // only 2-byte aligned (4-byte in f32). Forward: logits = lnf wte^T.
  check_gemm(512, 50257, 768, Transpose::no, Transpose::yes, DType::bf16, DType::bf16, 1.0f, 0.0f,
             0, 11);
  check_gemm(512, 50257, 768, Transpose::no, Transpose::yes, DType::f32, DType::f32, 1.0f, 0.0f, 0,
             12);
  // Backward: wte's f32 gradient += dlogits^T lnf, and dlnf = dlogits wte.
  check_gemm(50257, 768, 512, Transpose::yes, Transpose::no, DType::bf16, DType::f32, 1.0f, 1.0f, 0,
             13);
  check_gemm(512, 768, 50257, Transpose::no, Transpose::no, DType::bf16, DType::bf16, 1.0f, 0.0f, 0,
             14);
}

TEST_CASE("cuda_ops: gemm with padded rows, and the LM head's gemms on logits 50304 apart") {
  uint64_t seed = 900;
  for (Transpose ta : {Transpose::no, Transpose::yes}) {
    for (Transpose tb : {Transpose::no, Transpose::yes}) {
      for (DType dtype : kDtypes) {
        check_gemm(17, 7, 33, ta, tb, dtype, dtype, 1.0f, 0.0f, 0, seed += 3, {1, 2, 1});
        check_gemm(17, 7, 33, ta, tb, dtype, DType::f32, 1.0f, 1.0f, 0, seed += 3, {9, 0, 9});
      }
    }
  }
  // The tied head's three products (core/model/gpt.cpp) with only the logits' rows padded, from
  // 50257 to 50304 elements: the forward into them, then wte's f32 gradient += dlogits^T lnf and
  // dlnf = dlogits wte from them.
  check_gemm(512, 50257, 768, Transpose::no, Transpose::yes, DType::bf16, DType::bf16, 1.0f, 0.0f,
             0, seed += 3, {0, 0, 47});
  check_gemm(50257, 768, 512, Transpose::yes, Transpose::no, DType::bf16, DType::f32, 1.0f, 1.0f, 0,
             seed += 3, {47, 0, 0});
  check_gemm(512, 768, 50257, Transpose::no, Transpose::no, DType::bf16, DType::bf16, 1.0f, 0.0f, 0,
             seed += 3, {47, 0, 0});
  // Rows closer together than their columns, and an empty product into padded rows: bugs.
  const Buffer x = to_device(random_vector(64, 3), DType::f32);
  Buffer y = gpu().allocate(64 * sizeof(float));
  CHECK_THROWS_WITH_AS(
      gpu().gemm(ConstMatrix{x.data(), 4, 4, DType::f32, 3}, Transpose::no,
                 ConstMatrix{x.data(), 4, 4}, Transpose::no, Matrix{y.data(), 4, 4}, 1.0f, 0.0f),
      "gemm: a has rows 3 elements apart for 4 columns", Error);
  CHECK_THROWS_WITH_AS(
      gpu().gemm(ConstMatrix{x.data(), 4, 0}, Transpose::no, ConstMatrix{x.data(), 0, 4},
                 Transpose::no, Matrix{y.data(), 4, 4, DType::f32, 8}, 1.0f, 0.0f),
      "gemm: an empty product into padded rows of c", Error);
}

TEST_CASE("cuda_ops: gemm edge cases and bad calls") {
  Ops& ops = gpu();
  // An empty inner dimension: c = beta c.
  const std::vector<float> c0 = {1, 2, 3, 4, 5, 6};
  for (DType dtype : kDtypes) {
    Buffer c = to_device(c0, dtype);
    ops.gemm(ConstMatrix{c.data(), 2, 0, dtype}, Transpose::no, ConstMatrix{c.data(), 0, 3, dtype},
             Transpose::no, Matrix{c.data(), 2, 3, dtype}, 1.0f, 0.5f);
    CHECK(to_host(c.data(), 6, dtype) == std::vector<float>{0.5f, 1, 1.5f, 2, 2.5f, 3});
    ops.gemm(ConstMatrix{c.data(), 2, 0, dtype}, Transpose::no, ConstMatrix{c.data(), 0, 3, dtype},
             Transpose::no, Matrix{c.data(), 2, 3, dtype}, 1.0f, 0.0f);
    CHECK(to_host(c.data(), 6, dtype) == std::vector<float>(6, 0.0f));
  }

  const Buffer x = to_device(random_vector(64, 3), DType::f32);
  Buffer y = ops.allocate(64 * sizeof(float));
  const auto kind_of = [](auto&& call) -> std::optional<ErrorKind> {
    try {
      call();
    } catch (const Error& e) {
      return e.kind();
    }
    return std::nullopt;
  };
  // a and b in different dtypes; f16 inputs into bf16 c; inner dimensions that differ.
  CHECK(kind_of([&] {
          ops.gemm(ConstMatrix{x.data(), 4, 4, DType::f32}, Transpose::no,
                   ConstMatrix{x.data(), 4, 4, DType::bf16}, Transpose::no,
                   Matrix{y.data(), 4, 4, DType::f32}, 1.0f, 0.0f);
        }) == ErrorKind::internal);
  CHECK(kind_of([&] {
          ops.gemm(ConstMatrix{x.data(), 4, 4, DType::f16}, Transpose::no,
                   ConstMatrix{x.data(), 4, 4, DType::f16}, Transpose::no,
                   Matrix{y.data(), 4, 4, DType::bf16}, 1.0f, 0.0f);
        }) == ErrorKind::internal);
  CHECK(kind_of([&] {
          ops.gemm(ConstMatrix{x.data(), 4, 5}, Transpose::no, ConstMatrix{x.data(), 4, 4},
                   Transpose::no, Matrix{y.data(), 4, 4}, 1.0f, 0.0f);
        }) == ErrorKind::internal);
  CHECK(kind_of([&] {
          ops.gemm(ConstMatrix{x.data(), 4, 5}, Transpose::yes, ConstMatrix{x.data(), 4, 4},
                   Transpose::no, Matrix{y.data(), 5, 4}, 1.0f, 0.0f);
        }) == std::nullopt);
}

struct LinearShape {
  int64_t rows, in, out;
};
constexpr LinearShape kLinearShapes[] = {{17, 33, 7}, {64, 128, 96}, {1, 768, 2304}};

// Runs `check` twice: with cuBLASLt's epilogues where it has an algorithm for them, and with
// DPTRAIN_EPILOGUES=off (the steps one by one, as where it has none), so that each path is
// compared with the CPU whichever cuBLASLt takes at a shape.
template <typename F>
void with_and_without_epilogues(F&& check) {
  for (const char* epilogues : {"on", "off"}) {
    CAPTURE(epilogues);
    const ScopedEnv env("DPTRAIN_EPILOGUES", epilogues);
    check();
  }
}

// What linear adds to x W^T + bias: nothing, y itself (accumulate in place), or another matrix
// (a residual connection: cuBLASLt's C, with y as D).
enum class Residual { none, in_place, separate };

TEST_CASE("cuda_ops: linear with and without bias, overwrite, accumulate and a residual") {
  uint64_t seed = 500;
  for (DType dtype : kDtypes) {
    for (bool with_bias : {false, true}) {
      for (Residual residual : {Residual::none, Residual::in_place, Residual::separate}) {
        // Offset 1 puts the bias off the 16-byte alignment the fused epilogue wants.
        for (size_t bias_offset : {size_t{0}, size_t{1}}) {
          if (!with_bias && bias_offset != 0) continue;
          for (const LinearShape& shape : kLinearShapes) {
            const int64_t rows = shape.rows, in = shape.in, out = shape.out;
            CAPTURE(dtype_name(dtype));
            CAPTURE(with_bias);
            CAPTURE(static_cast<int>(residual));
            CAPTURE(bias_offset);
            CAPTURE(rows);
            CAPTURE(in);
            CAPTURE(out);
            const auto count = [](int64_t r, int64_t c) { return static_cast<size_t>(r * c); };
            const std::vector<float> x = rounded(random_vector(count(rows, in), seed++), dtype);
            const std::vector<float> w = rounded(random_vector(count(out, in), seed++), dtype);
            const std::vector<float> bias =
                rounded(random_vector(static_cast<size_t>(out) + bias_offset, seed++), dtype);
            const std::vector<float> y0 = rounded(random_vector(count(rows, out), seed++), dtype);
            const std::vector<float> r0 = rounded(random_vector(count(rows, out), seed++), dtype);

            CpuOps cpu;
            std::vector<float> want = y0;
            const void* cpu_residual = residual == Residual::in_place   ? want.data()
                                       : residual == Residual::separate ? r0.data()
                                                                        : nullptr;
            cpu.linear(ConstMatrix{x.data(), rows, in}, w.data(),
                       with_bias ? bias.data() + bias_offset : nullptr,
                       Matrix{want.data(), rows, out}, cpu_residual);

            with_and_without_epilogues([&] {
              const Buffer dx = to_device(x, dtype), dw = to_device(w, dtype);
              const Buffer db = to_device(bias, dtype), dr = to_device(r0, dtype);
              Buffer dy = to_device(y0, dtype);
              const void* bias_ptr =
                  with_bias ? static_cast<const char*>(db.data()) + bias_offset * dtype_size(dtype)
                            : nullptr;
              const void* gpu_residual = residual == Residual::in_place   ? dy.data()
                                         : residual == Residual::separate ? dr.data()
                                                                          : nullptr;
              gpu().linear(ConstMatrix{dx.data(), rows, in, dtype}, dw.data(), bias_ptr,
                           Matrix{dy.data(), rows, out, dtype}, gpu_residual);
              check_close(to_host(dy.data(), count(rows, out), dtype), want, tolerance(dtype),
                          "linear");
              // A separate residual is read, never written.
              if (residual == Residual::separate) {
                CHECK(to_host(dr.data(), r0.size(), dtype) == r0);
              }
            });
          }
        }
      }
    }
  }
}

TEST_CASE("cuda_ops: a linear layer and its activation, pre-activation kept") {
  // linear_activation (GELU_AUX_BIAS epilogue for GELU in 16 bits with a 16-byte aligned bias)
  // against the CPU's linear + activation_forward: both outputs. [17, 33, 7] fits no epilogue;
  // a bias off the alignment takes the unfused path too; GPT-2's fc is the last shape.
  constexpr LinearShape kShapes[] = {{17, 33, 7}, {64, 128, 96}, {512, 768, 3072}};
  uint64_t seed = 800;
  for (DType dtype : kDtypes) {
    for (const LinearShape& shape : kShapes) {
      for (Activation activation : {Activation::gelu, Activation::relu}) {
        for (size_t bias_offset : {size_t{0}, size_t{1}}) {
          const int64_t rows = shape.rows, in = shape.in, out = shape.out;
          CAPTURE(dtype_name(dtype));
          CAPTURE(rows);
          CAPTURE(in);
          CAPTURE(out);
          CAPTURE(activation == Activation::gelu ? "gelu" : "relu");
          CAPTURE(bias_offset);
          const auto count = [](int64_t r, int64_t c) { return static_cast<size_t>(r * c); };
          const std::vector<float> x = rounded(random_vector(count(rows, in), seed++), dtype);
          const std::vector<float> w = rounded(random_vector(count(out, in), seed++), dtype);
          const std::vector<float> bias =
              rounded(random_vector(static_cast<size_t>(out) + 1, seed++), dtype);
          CpuOps cpu;
          std::vector<float> want_pre(count(rows, out)), want_out(count(rows, out));
          cpu.linear_activation(
              ConstMatrix{x.data(), rows, in}, w.data(), bias.data() + bias_offset, activation,
              Matrix{want_pre.data(), rows, out}, Matrix{want_out.data(), rows, out});
          with_and_without_epilogues([&] {
            const Buffer dx = to_device(x, dtype), dw = to_device(w, dtype);
            const Buffer db = to_device(bias, dtype);
            Buffer pre = gpu().allocate(count(rows, out) * dtype_size(dtype));
            Buffer post = gpu().allocate(count(rows, out) * dtype_size(dtype));
            gpu().linear_activation(
                ConstMatrix{dx.data(), rows, in, dtype}, dw.data(),
                static_cast<const char*>(db.data()) + bias_offset * dtype_size(dtype), activation,
                Matrix{pre.data(), rows, out, dtype}, Matrix{post.data(), rows, out, dtype});
            check_close(to_host(pre.data(), want_pre.size(), dtype), want_pre, tolerance(dtype),
                        "linear_activation: pre");
            check_close(to_host(post.data(), want_out.size(), dtype), want_out, tolerance(dtype),
                        "linear_activation: out");
          });
        }
      }
    }
  }
}

TEST_CASE("cuda_ops: a linear layer's weight, bias and activation gradients") {
  // linear_weight_grad (BGRADB epilogue where cuBLASLt has one) and linear_activation_grad
  // (DGELU epilogue for GELU in 16 bits) against the CPU's gemm + bias_grad and gemm +
  // activation_backward, each with and without the epilogues. [17, 33, 7] has widths DGELU does
  // not take; GPT-2's fc_proj is the last.
  constexpr LinearShape kShapes[] = {{17, 33, 7}, {64, 128, 96}, {512, 3072, 768}};
  uint64_t seed = 700;
  for (DType dtype : kDtypes) {
    for (const LinearShape& shape : kShapes) {
      const int64_t rows = shape.rows, in = shape.in, out = shape.out;
      CAPTURE(dtype_name(dtype));
      CAPTURE(rows);
      CAPTURE(in);
      CAPTURE(out);
      const auto count = [](int64_t r, int64_t c) { return static_cast<size_t>(r * c); };
      const std::vector<float> dy = rounded(random_vector(count(rows, out), seed++), dtype);
      const std::vector<float> x = rounded(random_vector(count(rows, in), seed++), dtype);
      const std::vector<float> w = rounded(random_vector(count(out, in), seed++), dtype);
      const std::vector<float> pre = rounded(random_vector(count(rows, in), seed++, 3.0f), dtype);
      // Gradients accumulate: start from values already there.
      const std::vector<float> dw0 = random_vector(count(out, in), seed++);
      const std::vector<float> db0 = random_vector(static_cast<size_t>(out), seed++);

      CpuOps cpu;
      std::vector<float> want_dw = dw0, want_db = db0;
      cpu.linear_weight_grad(ConstMatrix{dy.data(), rows, out}, ConstMatrix{x.data(), rows, in},
                             want_dw.data(), want_db.data());
      std::vector<float> want_dpre(count(rows, in));
      for (Activation activation : {Activation::gelu, Activation::relu}) {
        CAPTURE(activation == Activation::gelu ? "gelu" : "relu");
        cpu.linear_activation_grad(ConstMatrix{dy.data(), rows, out}, w.data(), activation,
                                   ConstMatrix{pre.data(), rows, in},
                                   Matrix{want_dpre.data(), rows, in});
        with_and_without_epilogues([&] {
          const Buffer ddy = to_device(dy, dtype), dwt = to_device(w, dtype);
          const Buffer dpre_in = to_device(pre, dtype);
          Buffer dpre = gpu().allocate(count(rows, in) * dtype_size(dtype));
          gpu().linear_activation_grad(ConstMatrix{ddy.data(), rows, out, dtype}, dwt.data(),
                                       activation, ConstMatrix{dpre_in.data(), rows, in, dtype},
                                       Matrix{dpre.data(), rows, in, dtype});
          check_close(to_host(dpre.data(), count(rows, in), dtype), want_dpre, tolerance(dtype),
                      "linear_activation_grad");
        });
      }

      with_and_without_epilogues([&] {
        const Buffer ddy = to_device(dy, dtype), dx = to_device(x, dtype);
        Buffer ddw = to_device(dw0), ddb = to_device(db0);
        gpu().linear_weight_grad(ConstMatrix{ddy.data(), rows, out, dtype},
                                 ConstMatrix{dx.data(), rows, in, dtype}, ddw.as<float>(),
                                 ddb.as<float>());
        check_close(to_host(ddw.data(), want_dw.size()), want_dw, tolerance(dtype),
                    "linear_weight_grad: weight");
        check_close(to_host(ddb.data(), want_db.size()), want_db, tolerance(dtype),
                    "linear_weight_grad: bias");
        // Without a bias gradient, only the weight's.
        Buffer ddw2 = to_device(dw0);
        gpu().linear_weight_grad(ConstMatrix{ddy.data(), rows, out, dtype},
                                 ConstMatrix{dx.data(), rows, in, dtype}, ddw2.as<float>(),
                                 nullptr);
        check_close(to_host(ddw2.data(), want_dw.size()), want_dw, tolerance(dtype),
                    "linear_weight_grad without a bias");
      });
    }
  }
}

TEST_CASE("cuda_ops: axpy and scale") {
  CpuOps cpu;
  for (size_t n : {size_t{1}, size_t{1000}, size_t{100003}}) {
    CAPTURE(n);
    const std::vector<float> x = random_vector(n, 11);
    const std::vector<float> y0 = random_vector(n, 12);
    std::vector<float> want = y0;
    cpu.axpy(static_cast<int64_t>(n), -0.37f, x.data(), want.data());
    cpu.scale(static_cast<int64_t>(n), 1.7f, want.data());
    const Buffer dx = to_device(x);
    Buffer dy = to_device(y0);
    gpu().axpy(static_cast<int64_t>(n), -0.37f, dx.as<float>(), dy.as<float>());
    gpu().scale(static_cast<int64_t>(n), 1.7f, dy.as<float>());
    check_relative(to_host(dy.data(), n), want, 1e-6, "axpy then scale");
  }
}

TEST_CASE(
    "cuda_ops: sum_squares matches a double sum, is deterministic and propagates inf and NaN") {
  Ops& ops = gpu();
  for (size_t n : {size_t{1}, size_t{17}, size_t{1000}, size_t{(1 << 20) + 3}}) {
    CAPTURE(n);
    const std::vector<float> x = random_vector(n, 21, 3.0f);
    double want = 0;
    for (float v : x)
      want += static_cast<double>(v) * v;
    const Buffer dx = to_device(x);
    const double got = ops.sum_squares(dx.as<float>(), static_cast<int64_t>(n));
    CHECK(std::fabs(got - want) <= 1e-10 * want);  // only the summation orders differ
    const double again = ops.sum_squares(dx.as<float>(), static_cast<int64_t>(n));
    CHECK(std::memcmp(&got, &again, sizeof(got)) == 0);
  }
  CHECK(ops.sum_squares(nullptr, 0) == 0.0);

  std::vector<float> x = random_vector(100000, 22);
  x[77777] = INFINITY;
  const Buffer inf = to_device(x);
  const double with_inf = ops.sum_squares(inf.as<float>(), static_cast<int64_t>(x.size()));
  CHECK((std::isinf(with_inf) && with_inf > 0));
  x[5] = NAN;
  const Buffer nan = to_device(x);
  CHECK(std::isnan(ops.sum_squares(nan.as<float>(), static_cast<int64_t>(x.size()))));
}

TEST_CASE("cuda_ops: adamw_update matches the CPU over several steps") {
  const size_t n = 10007;
  const auto count = static_cast<int64_t>(n);
  CpuOps cpu;
  std::vector<float> p = random_vector(n, 31), m(n, 0.0f), v(n, 0.0f);
  Buffer dp = to_device(p), dm = to_device(m), dv = to_device(v);
  const double lr = 1e-3, b1 = 0.9, b2 = 0.999, wd = 0.01;
  for (int t = 1; t <= 5; ++t) {
    AdamWCoefficients k;
    k.step_size = static_cast<float>(lr / (1.0 - std::pow(b1, t)));
    k.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(b2, t)));
    k.b1 = static_cast<float>(b1);
    k.b2 = static_cast<float>(b2);
    k.eps = 1e-8f;
    k.decay = static_cast<float>(1.0 - lr * wd);
    const std::vector<float> g = random_vector(n, 40 + static_cast<uint64_t>(t), 0.1f);
    const Buffer dg = to_device(g);
    cpu.adamw_update(p.data(), g.data(), m.data(), v.data(), count, k);
    gpu().adamw_update(dp.as<float>(), dg.as<float>(), dm.as<float>(), dv.as<float>(), count, k);
  }
  check_relative(to_host(dp.data(), n), p, 1e-6, "adamw params");
  check_relative(to_host(dm.data(), n), m, 1e-6, "adamw m");
  check_relative(to_host(dv.data(), n), v, 1e-6, "adamw v");
}

TEST_CASE("cuda_ops: sgd_update matches the CPU over several steps") {
  const size_t n = 10007;
  const auto count = static_cast<int64_t>(n);
  CpuOps cpu;
  for (bool nesterov : {false, true}) {
    CAPTURE(nesterov);
    std::vector<float> p = random_vector(n, 51), vel(n, 0.0f);
    Buffer dp = to_device(p), dvel = to_device(vel);
    for (int t = 1; t <= 5; ++t) {
      const std::vector<float> g = random_vector(n, 60 + static_cast<uint64_t>(t), 0.1f);
      const Buffer dg = to_device(g);
      const float rate = 0.05f, decay = 1.0f - 0.05f * 0.01f;
      cpu.sgd_update(p.data(), g.data(), vel.data(), count, 0.9f, decay, rate, nesterov);
      gpu().sgd_update(dp.as<float>(), dg.as<float>(), dvel.as<float>(), count, 0.9f, decay, rate,
                       nesterov);
    }
    check_relative(to_host(dp.data(), n), p, 1e-6, "sgd params");
    check_relative(to_host(dvel.data(), n), vel, 1e-6, "sgd velocity");
  }
}

}  // namespace
}  // namespace dptrain::gputest

namespace dptrain::gputest {
namespace {

TEST_CASE("cuda ops: DPTRAIN_PROFILE writes every op's calls and GPU time when the table goes") {
  const test::TempDir tmp;
  const std::filesystem::path dir = tmp / "profile";
  {
    const ScopedEnv profile("DPTRAIN_PROFILE", dir.string());
    std::unique_ptr<Ops> ops = kernels::make_cuda_ops(0);
    const int64_t n = 256;
    Buffer a = ops->allocate(n * n * sizeof(float));
    Buffer c = ops->allocate(n * n * sizeof(float));
    for (int i = 0; i < 3; ++i) {
      ops->gemm(ConstMatrix{a.data(), n, n}, Transpose::no, ConstMatrix{a.data(), n, n},
                Transpose::no, Matrix{c.data(), n, n}, 1.0f, 0.0f);
    }
    ops->scale(n * n, 0.5f, c.as<float>());
    // A linear whose bias cannot go through the epilogue (4-byte aligned, not 16) adds it with
    // add_bias_rows inside linear: timed as linear only.
    ops->linear(ConstMatrix{a.data(), n, n}, a.data(), static_cast<const float*>(a.data()) + 1,
                Matrix{c.data(), n, n}, nullptr);
    ops->synchronize();
  }
  std::vector<std::filesystem::path> files;
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    files.push_back(entry.path());
  REQUIRE(files.size() == 1);
  CHECK(files[0].filename().string().rfind("cuda-ops-0-", 0) == 0);
  const nlohmann::json profile = nlohmann::json::parse(test::read_text(files[0]));
  std::map<std::string, nlohmann::json> ops;
  for (const auto& op : profile["ops"])
    ops[op["op"].get<std::string>()] = op;
  REQUIRE(ops.count("gemm") == 1);
  CHECK(ops["gemm"]["calls"] == 3);
  CHECK(ops["gemm"]["ms"].get<double>() > 0);
  CHECK(ops["scale"]["calls"] == 1);
  CHECK(ops["allocate"]["calls"] == 2);
  // The span from the first op's start to the last one's end holds every op's time (and the
  // gaps between them): busy_share is their ratio.
  const double total = profile["total_ms"].get<double>();
  const double span = profile["span_ms"].get<double>();
  CHECK(total > 0);
  CHECK(span >= 0.99 * total);
  CHECK(profile["busy_share"].get<double>() == doctest::Approx(std::min(1.0, total / span)));
  // The bias off the epilogue's alignment was added on its own: filed as unfused.
  REQUIRE(ops.count("linear (unfused)") == 1);
  CHECK(ops["linear (unfused)"]["calls"] == 1);
  CHECK(ops.count("linear") == 0);
  CHECK(ops.count("add_bias_rows") == 0);  // an op inside another counts as the outer one
}

// The ops of one profiled op table, by name, after `run` used the table.
template <typename F>
std::map<std::string, nlohmann::json> profiled_ops(F&& run) {
  const test::TempDir tmp;
  const std::filesystem::path dir = tmp / "profile";
  {
    const ScopedEnv profile("DPTRAIN_PROFILE", dir.string());
    std::unique_ptr<Ops> ops = kernels::make_cuda_ops(0);
    run(*ops);
    ops->synchronize();
  }
  std::map<std::string, nlohmann::json> out;
  for (const auto& entry : std::filesystem::directory_iterator(dir)) {
    const nlohmann::json profile = nlohmann::json::parse(test::read_text(entry.path()));
    for (const auto& op : profile["ops"])
      out[op["op"].get<std::string>()] = op;
  }
  return out;
}

TEST_CASE("cuda ops: restart_profile forgets the ops before it (the trainer's warm-up)") {
  const int64_t n = 256;
  const auto ops = profiled_ops([&](Ops& table) {
    Buffer a = table.allocate(n * n * sizeof(float));
    Buffer c = table.allocate(n * n * sizeof(float));
    table.gemm(ConstMatrix{a.data(), n, n}, Transpose::no, ConstMatrix{a.data(), n, n},
               Transpose::no, Matrix{c.data(), n, n}, 1.0f, 0.0f);
    table.restart_profile();  // the gemm may still run: waited for, then forgotten
    table.scale(n * n, 0.5f, c.as<float>());
    table.scale(n * n, 0.5f, c.as<float>());
  });
  CHECK(ops.count("gemm") == 0);
  CHECK(ops.count("allocate") == 0);
  REQUIRE(ops.count("scale") == 1);
  CHECK(ops.at("scale")["calls"] == 2);
}

TEST_CASE("cuda ops: the GPT's bf16 matmul epilogues apply, and equal the ops one by one") {
  // The speed of the fused linear ops rests on cuBLASLt having an algorithm for each epilogue
  // at the GPT's shapes; without one they fall back, correct but slower, and say so in the
  // profile. GPT-2 small's four linear layers at the benchmark's 16 x 1024 rows, in bf16, as
  // the GPT calls them, on random values: once with the epilogues (none may be filed as
  // unfused), once with DPTRAIN_EPILOGUES=off (each is), and every output of the two alike (an
  // operand, bias or aux laid out wrong would not be, at these shapes).
  const int64_t rows = 16 * 1024, c = 768;
  const DType t = DType::bf16;
  uint64_t seed = 900;
  const auto input = [&](int64_t n, float scale = 1.0f) {
    return to_device(random_vector(static_cast<size_t>(n), seed++, scale), t);
  };
  const Buffer x = input(rows * c), residual = input(rows * c), h = input(rows * 4 * c);
  const Buffer w = input(4 * c * c, 0.05f), bias = input(4 * c);
  const Buffer dy3 = input(rows * 3 * c), dy4 = input(rows * 4 * c), dy1 = input(rows * c);
  const Buffer pre_in = input(rows * 4 * c, 3.0f);
  // Every output of one pass, on the host.
  struct Outputs {
    std::map<std::string, std::vector<float>> values;
    std::map<std::string, nlohmann::json> ops;
  };
  const auto pass = [&](const char* epilogues) {
    const ScopedEnv env("DPTRAIN_EPILOGUES", epilogues);
    const auto bf16 = [&](int64_t n) { return gpu().allocate(static_cast<size_t>(n) * 2); };
    Buffer qkv = bf16(rows * 3 * c), pre = bf16(rows * 4 * c), fc = bf16(rows * 4 * c);
    Buffer proj = bf16(rows * c), fc_proj = bf16(rows * c), dpre = bf16(rows * 4 * c);
    std::vector<Buffer> dws, dbs;
    for (int i = 0; i < 4; ++i) {
      dws.push_back(to_device(std::vector<float>(static_cast<size_t>(4 * c * c), 0.0f)));
      dbs.push_back(to_device(std::vector<float>(static_cast<size_t>(4 * c), 1000.0f)));
    }
    gpu().synchronize();
    Outputs o;
    o.ops = profiled_ops([&](Ops& ops) {
      // Forward: qkv, fc (with its GELU), proj and fc_proj (each onto the residual).
      ops.linear(ConstMatrix{x.data(), rows, c, t}, w.data(), bias.data(),
                 Matrix{qkv.data(), rows, 3 * c, t}, nullptr);
      ops.linear_activation(ConstMatrix{x.data(), rows, c, t}, w.data(), bias.data(),
                            Activation::gelu, Matrix{pre.data(), rows, 4 * c, t},
                            Matrix{fc.data(), rows, 4 * c, t});
      ops.linear(ConstMatrix{x.data(), rows, c, t}, w.data(), bias.data(),
                 Matrix{proj.data(), rows, c, t}, residual.data());
      ops.linear(ConstMatrix{h.data(), rows, 4 * c, t}, w.data(), bias.data(),
                 Matrix{fc_proj.data(), rows, c, t}, residual.data());
      // Backward: each layer's weight and bias gradients, and fc_proj's through the GELU.
      ops.linear_weight_grad(ConstMatrix{dy3.data(), rows, 3 * c, t},
                             ConstMatrix{x.data(), rows, c, t}, dws[0].as<float>(),
                             dbs[0].as<float>());
      ops.linear_weight_grad(ConstMatrix{dy4.data(), rows, 4 * c, t},
                             ConstMatrix{x.data(), rows, c, t}, dws[1].as<float>(),
                             dbs[1].as<float>());
      ops.linear_weight_grad(ConstMatrix{dy1.data(), rows, c, t}, ConstMatrix{x.data(), rows, c, t},
                             dws[2].as<float>(), dbs[2].as<float>());
      ops.linear_weight_grad(ConstMatrix{dy1.data(), rows, c, t},
                             ConstMatrix{h.data(), rows, 4 * c, t}, dws[3].as<float>(),
                             dbs[3].as<float>());
      ops.linear_activation_grad(ConstMatrix{dy1.data(), rows, c, t}, w.data(), Activation::gelu,
                                 ConstMatrix{pre_in.data(), rows, 4 * c, t},
                                 Matrix{dpre.data(), rows, 4 * c, t});
    });
    const auto n = [](int64_t v) { return static_cast<size_t>(v); };
    o.values["qkv"] = to_host(qkv.data(), n(rows * 3 * c), t);
    o.values["fc pre"] = to_host(pre.data(), n(rows * 4 * c), t);
    o.values["fc"] = to_host(fc.data(), n(rows * 4 * c), t);
    o.values["proj"] = to_host(proj.data(), n(rows * c), t);
    o.values["fc_proj"] = to_host(fc_proj.data(), n(rows * c), t);
    o.values["dpre"] = to_host(dpre.data(), n(rows * 4 * c), t);
    for (size_t i = 0; i < dws.size(); ++i) {
      o.values["dw" + std::to_string(i)] = to_host(dws[i].data(), n(4 * c * c));
      o.values["db" + std::to_string(i)] = to_host(dbs[i].data(), n(4 * c));
    }
    return o;
  };
  const Outputs fused = pass("on"), apart = pass("off");
  const std::map<std::string, int> calls = {{"linear", 3},
                                            {"linear_activation", 1},
                                            {"linear_weight_grad", 4},
                                            {"linear_activation_grad", 1}};
  for (const auto& [op, n] : calls) {
    INFO(op);
    REQUIRE(fused.ops.count(op) == 1);
    CHECK(fused.ops.at(op)["calls"] == n);
    CHECK(fused.ops.count(op + " (unfused)") == 0);
    REQUIRE(apart.ops.count(op + " (unfused)") == 1);
    CHECK(apart.ops.at(op + " (unfused)")["calls"] == n);
  }
  for (const auto& [name, values] : apart.values) {
    // The bias gradients start at 1000, well above the sums (a few hundred) and the tolerance
    // they set: a fused one written over dbias (not added to it) fails.
    check_close(fused.values.at(name), values, tolerance(t), "fused against one by one: " + name);
  }
}

}  // namespace
}  // namespace dptrain::gputest
