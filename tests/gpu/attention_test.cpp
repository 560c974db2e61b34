// GPU tests of the flash-style causal attention (kernels/attention.cu): forward and backward
// against the CPU op table, the log-sum-exp state, determinism, memory at long sequences and the
// precondition errors.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "tests/gpu/gpu_test.hpp"
#include "tests/scoped_env.hpp"

namespace dptrain::gputest {
namespace {

struct Shape {
  int64_t batch, seq, heads, hd;
  int64_t width() const { return heads * hd; }
  int64_t rows() const { return batch * seq; }
  std::string name() const {
    return "batch " + std::to_string(batch) + " seq " + std::to_string(seq) + " heads " +
           std::to_string(heads) + " hd " + std::to_string(hd);
  }
};

size_t count(int64_t n) {
  return static_cast<size_t>(n);
}

// Columns [begin, end) of a row-major [rows, cols] host matrix.
std::vector<float> columns(const std::vector<float>& m, int64_t rows, int64_t cols, int64_t begin,
                           int64_t end) {
  std::vector<float> out;
  out.reserve(count(rows * (end - begin)));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = begin; j < end; ++j)
      out.push_back(m[count(i * cols + j)]);
  return out;
}

// The log-sum-exp of each (b, h, t) row of scaled causal scores, in double: what the device's
// state should hold.
std::vector<float> reference_lse(const std::vector<float>& qkv, const Shape& s) {
  const int64_t width = s.width();
  const int64_t ld = 3 * width;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.hd));
  std::vector<float> lse(count(s.batch * s.heads * s.seq));
  std::vector<double> scores(count(s.seq));
  for (int64_t b = 0; b < s.batch; ++b)
    for (int64_t h = 0; h < s.heads; ++h)
      for (int64_t t = 0; t < s.seq; ++t) {
        const float* q = &qkv[count((b * s.seq + t) * ld + h * s.hd)];
        double top = -INFINITY;
        for (int64_t u = 0; u <= t; ++u) {
          const float* k = &qkv[count((b * s.seq + u) * ld + width + h * s.hd)];
          double dot = 0;
          for (int64_t d = 0; d < s.hd; ++d)
            dot += static_cast<double>(q[d]) * k[d];
          scores[count(u)] = dot * scale;
          top = std::max(top, scores[count(u)]);
        }
        double sum = 0;
        for (int64_t u = 0; u <= t; ++u)
          sum += std::exp(scores[count(u)] - top);
        lse[count((b * s.heads + h) * s.seq + t)] = static_cast<float>(top + std::log(sum));
      }
  return lse;
}

// Device buffers of one attention forward and backward.
struct DeviceAttention {
  Shape shape;
  DType dtype;
  Buffer qkv, dout, out, state, dqkv;

  DeviceAttention(const Shape& s, DType t, const std::vector<float>& qkv_host,
                  const std::vector<float>& dout_host)
      : shape(s), dtype(t) {
    Ops& ops = gpu();
    qkv = to_device(qkv_host, dtype);
    dout = to_device(dout_host, dtype);
    out = ops.allocate(count(s.rows() * s.width()) * dtype_size(dtype));
    state = ops.allocate(ops.attention_state_floats(s.batch, s.seq, s.heads) * sizeof(float));
    dqkv = ops.allocate(count(s.rows() * 3 * s.width()) * dtype_size(dtype));
  }
  ConstMatrix qkv_matrix() const { return {qkv.data(), shape.rows(), 3 * shape.width(), dtype}; }
  Matrix out_matrix() const { return {out.data(), shape.rows(), shape.width(), dtype}; }
  ConstMatrix dout_matrix() const { return {dout.data(), shape.rows(), shape.width(), dtype}; }
  Matrix dqkv_matrix() const { return {dqkv.data(), shape.rows(), 3 * shape.width(), dtype}; }

  void forward() {
    gpu().attention_forward(qkv_matrix(), shape.batch, shape.seq, shape.heads, out_matrix(),
                            state.as<float>());
  }
  void backward() {
    gpu().attention_backward(qkv_matrix(), out_matrix(), state.as<float>(), dout_matrix(),
                             shape.batch, shape.seq, shape.heads, dqkv_matrix());
  }
  std::vector<char> raw(const Buffer& b) const {
    std::vector<char> bytes(b.bytes());
    gpu().download(b.data(), bytes.data(), bytes.size());
    return bytes;
  }
};

// Random inputs as the device sees them in `dtype`. Scores get a spread of about 1.3 (qkv in
// (-2, 2)), so the softmax is neither flat nor one-hot.
std::vector<float> random_qkv(const Shape& s, DType dtype, uint64_t seed) {
  return rounded(random_vector(count(s.rows() * 3 * s.width()), seed, 2.0f), dtype);
}
std::vector<float> random_dout(const Shape& s, DType dtype, uint64_t seed) {
  return rounded(random_vector(count(s.rows() * s.width()), seed + 1), dtype);
}

// Forward and backward on the GPU against the CPU op table (same rounded inputs).
void check_against_cpu(const Shape& s, DType dtype, uint64_t seed) {
  const std::string what = s.name() + " " + dtype_name(dtype);
  INFO(what);
  const int64_t width = s.width();
  const int64_t rows = s.rows();
  const std::vector<float> qkv = random_qkv(s, dtype, seed);
  const std::vector<float> dout = random_dout(s, dtype, seed);

  CpuOps cpu;
  std::vector<float> out_cpu(count(rows * width));
  std::vector<float> state_cpu(cpu.attention_state_floats(s.batch, s.seq, s.heads));
  std::vector<float> dqkv_cpu(count(rows * 3 * width));
  cpu.attention_forward(ConstMatrix{qkv.data(), rows, 3 * width}, s.batch, s.seq, s.heads,
                        Matrix{out_cpu.data(), rows, width}, state_cpu.data());
  cpu.attention_backward(ConstMatrix{qkv.data(), rows, 3 * width},
                         ConstMatrix{out_cpu.data(), rows, width}, state_cpu.data(),
                         ConstMatrix{dout.data(), rows, width}, s.batch, s.seq, s.heads,
                         Matrix{dqkv_cpu.data(), rows, 3 * width});

  DeviceAttention dev(s, dtype, qkv, dout);
  REQUIRE(gpu().attention_state_floats(s.batch, s.seq, s.heads) ==
          count(s.batch * s.heads * s.seq));
  dev.forward();
  dev.backward();

  const double tol = tolerance(dtype);
  check_close(to_host(dev.out.data(), out_cpu.size(), dtype), out_cpu, tol, what + " out");
  if (s.seq <= 256) {
    // The state is the f32 log-sum-exp of exactly the inputs: f32 accuracy in every dtype, in
    // absolute terms below 1 (a log's error is relative in what it is the log of).
    check_close_unit_floor(to_host(dev.state.data(), count(s.batch * s.heads * s.seq)),
                           reference_lse(qkv, s), tolerance(DType::f32),
                           what + " log-sum-exp state");
  }
  const std::vector<float> dqkv = to_host(dev.dqkv.data(), dqkv_cpu.size(), dtype);
  // dq, dk and dv come out of the same sums: each is held to the scale of the largest of them
  // (with one position, dq and dk are 0 up to rounding, which their own scale would not allow).
  const double scale = max_abs(dqkv_cpu);
  const char* parts[] = {"dq", "dk", "dv"};
  for (int64_t p = 0; p < 3; ++p) {
    check_close_scaled(columns(dqkv, rows, 3 * width, p * width, (p + 1) * width),
                       columns(dqkv_cpu, rows, 3 * width, p * width, (p + 1) * width), tol, scale,
                       what + " " + parts[p]);
  }
}

const DType kAllTypes[] = {DType::f32, DType::bf16, DType::f16};

// The message of the Error f throws, or "" when it throws none.
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::internal);
    return e.what();
  }
  return "";
}

TEST_CASE("attention: one position, one head of 32") {
  for (DType t : kAllTypes)
    check_against_cpu({1, 1, 1, 32}, t, 11);
}

TEST_CASE("attention: short sequences below one tile") {
  for (DType t : kAllTypes)
    check_against_cpu({2, 17, 2, 64}, t, 12);
}

TEST_CASE("attention: sequences that are not a multiple of the tile") {
  for (DType t : kAllTypes) {
    check_against_cpu({1, 130, 3, 64}, t, 13);
    check_against_cpu({3, 100, 2, 32}, t, 14);
  }
}

TEST_CASE("attention: head size 128 over several tiles") {
  for (DType t : kAllTypes)
    check_against_cpu({2, 256, 4, 128}, t, 15);
}

TEST_CASE("attention: GPT-2 small heads at 1024 positions") {
  check_against_cpu({1, 1024, 12, 64}, DType::f32, 16);
  check_against_cpu({1, 1024, 12, 64}, DType::bf16, 17);
}

// A forward and backward run twice on the same inputs (every result cleared in between, so that
// one never written fails too) give the same bits.
void check_bit_identical(const Shape& s, DType dtype, uint64_t seed) {
  INFO(s.name() << " " << dtype_name(dtype));
  DeviceAttention dev(s, dtype, random_qkv(s, dtype, seed), random_dout(s, dtype, seed));
  dev.forward();
  dev.backward();
  const std::vector<char> out = dev.raw(dev.out), state = dev.raw(dev.state),
                          dqkv = dev.raw(dev.dqkv);
  for (Buffer* b : {&dev.out, &dev.state, &dev.dqkv})
    gpu().fill_zero(b->data(), b->bytes());
  dev.forward();
  dev.backward();
  CHECK(dev.raw(dev.out) == out);
  CHECK(dev.raw(dev.state) == state);
  CHECK(dev.raw(dev.dqkv) == dqkv);
}

TEST_CASE("attention: forward and backward are bit-identical from run to run") {
  check_bit_identical({2, 256, 4, 128}, DType::bf16, 21);
  check_bit_identical({1, 130, 3, 64}, DType::f32, 21);
}

TEST_CASE("attention: 4096 positions keep O(seq) state and allocate nothing quadratic") {
  const Shape s{1, 4096, 4, 64};
  const DType dtype = DType::bf16;
  const size_t quadratic_bytes = count(s.heads * s.seq * s.seq) * sizeof(float);
  CHECK(gpu().attention_state_floats(s.batch, s.seq, s.heads) == count(s.heads * s.seq));

  // A short warm-up loads the kernels and sizes the backward's scratch for small inputs, so the
  // measurement below sees only what a long sequence adds.
  const Shape small{1, 64, 4, 64};
  DeviceAttention warm(small, dtype, random_qkv(small, dtype, 30), random_dout(small, dtype, 30));
  warm.forward();
  warm.backward();

  DeviceAttention dev(s, dtype, random_qkv(s, dtype, 31), random_dout(s, dtype, 31));
  gpu().synchronize();
  size_t free_before = 0, free_after = 0, total = 0;
  REQUIRE(cudaMemGetInfo(&free_before, &total) == cudaSuccess);
  const auto start = std::chrono::steady_clock::now();
  dev.forward();
  gpu().synchronize();
  const auto mid = std::chrono::steady_clock::now();
  dev.backward();
  gpu().synchronize();
  const auto end = std::chrono::steady_clock::now();
  REQUIRE(cudaMemGetInfo(&free_after, &total) == cudaSuccess);
  const size_t grown = free_before > free_after ? free_before - free_after : 0;
  INFO("device memory grew by " << grown << " bytes; [heads, seq, seq] f32 is " << quadratic_bytes);
  CHECK(grown < quadratic_bytes / 8);
  using Ms = std::chrono::duration<double, std::milli>;
  MESSAGE("attention " << s.name() << " bf16: forward " << Ms(mid - start).count()
                       << " ms, backward " << Ms(end - mid).count() << " ms (first call)");

  // And the results still match the CPU at this length.
  check_against_cpu(s, dtype, 32);
}

TEST_CASE("attention: the SIMT kernels take 16-bit inputs too (DPTRAIN_ATTENTION=simt)") {
  // 16-bit inputs go to the tensor-core kernels by default (every test above); these are their
  // fallback and reference.
  const ScopedEnv simt("DPTRAIN_ATTENTION", "simt");
  for (DType t : {DType::bf16, DType::f16}) {
    check_against_cpu({1, 130, 3, 64}, t, 41);
    check_against_cpu({2, 256, 4, 128}, t, 42);
  }
}

TEST_CASE("attention: the mma.sync kernels (DPTRAIN_ATTENTION=mma) against the CPU") {
  // Every shape the default kernels meet above: one position, short, ragged, head sizes 32 and
  // 128, several tiles, GPT-2 small's heads.
  const ScopedEnv mma("DPTRAIN_ATTENTION", "mma");
  for (DType t : {DType::bf16, DType::f16}) {
    check_against_cpu({1, 1, 1, 32}, t, 71);
    check_against_cpu({2, 17, 2, 64}, t, 72);
    check_against_cpu({1, 130, 3, 64}, t, 73);
    check_against_cpu({3, 100, 2, 32}, t, 74);
    check_against_cpu({2, 256, 4, 128}, t, 75);
    check_against_cpu({1, 65, 2, 128}, t, 79);  // one row in the last tile, the largest head
  }
  check_against_cpu({1, 1024, 12, 64}, DType::bf16, 76);
  // f32 inputs take the SIMT kernels whatever the variable says.
  check_against_cpu({1, 130, 3, 64}, DType::f32, 77);
}

TEST_CASE("attention: the mma.sync kernels are bit-identical from run to run") {
  const ScopedEnv mma("DPTRAIN_ATTENTION", "mma");
  check_bit_identical({2, 256, 4, 128}, DType::bf16, 78);
  check_bit_identical({1, 130, 3, 64}, DType::bf16, 78);
}

TEST_CASE("attention: DPTRAIN_ATTENTION=wmma is what auto picks for 16-bit inputs") {
  const Shape s{1, 130, 3, 64};
  const std::vector<float> qkv = random_qkv(s, DType::bf16, 81),
                           dout = random_dout(s, DType::bf16, 81);
  DeviceAttention by_default(s, DType::bf16, qkv, dout), chosen(s, DType::bf16, qkv, dout);
  by_default.forward();
  by_default.backward();
  {
    const ScopedEnv wmma("DPTRAIN_ATTENTION", "wmma");
    chosen.forward();
    chosen.backward();
  }
  CHECK(chosen.raw(chosen.out) == by_default.raw(by_default.out));
  CHECK(chosen.raw(chosen.dqkv) == by_default.raw(by_default.dqkv));
}

TEST_CASE("attention: tensor cores against the SIMT kernels on GPT-2 small's shape") {
  // Times both on the same inputs (a report, not an assertion) and compares their outputs.
  const Shape s{16, 1024, 12, 64};
  const DType dtype = DType::bf16;
  const std::vector<float> qkv = random_qkv(s, dtype, 51), dout = random_dout(s, dtype, 51);
  using Ms = std::chrono::duration<double, std::milli>;
  const auto timed = [&](DeviceAttention& dev, double& forward_ms, double& backward_ms) {
    dev.forward();  // warm-up: loads the kernels, sizes the scratch
    dev.backward();
    gpu().synchronize();
    const auto t0 = std::chrono::steady_clock::now();
    dev.forward();
    gpu().synchronize();
    const auto t1 = std::chrono::steady_clock::now();
    dev.backward();
    gpu().synchronize();
    const auto t2 = std::chrono::steady_clock::now();
    forward_ms = Ms(t1 - t0).count();
    backward_ms = Ms(t2 - t1).count();
  };
  DeviceAttention tc(s, dtype, qkv, dout), mma(s, dtype, qkv, dout);
  double tc_fwd = 0, tc_bwd = 0, mma_fwd = 0, mma_bwd = 0, simt_fwd = 0, simt_bwd = 0;
  timed(tc, tc_fwd, tc_bwd);
  {
    const ScopedEnv choice("DPTRAIN_ATTENTION", "mma");
    timed(mma, mma_fwd, mma_bwd);
  }
  DeviceAttention reference(s, dtype, qkv, dout);
  {
    const ScopedEnv simt("DPTRAIN_ATTENTION", "simt");
    timed(reference, simt_fwd, simt_bwd);
  }
  MESSAGE("attention " << s.name() << " bf16: WMMA forward " << tc_fwd << " ms, backward " << tc_bwd
                       << " ms; mma.sync forward " << mma_fwd << " ms, backward " << mma_bwd
                       << " ms; SIMT forward " << simt_fwd << " ms, backward " << simt_bwd
                       << " ms");
  const size_t n = count(s.rows() * s.width());
  // Evidence that DPTRAIN_ATTENTION=mma reached other kernels than the default: the two round
  // differently (exp2 of prescaled scores against exp), so some of 12 million outputs differ.
  CHECK(mma.raw(mma.out) != tc.raw(tc.out));
  CHECK(mma.raw(mma.out) != reference.raw(reference.out));  // nor did they fall back to SIMT
  for (const DeviceAttention* dev : {&tc, &mma}) {
    const std::string name = dev == &tc ? "WMMA" : "mma.sync";
    check_close(to_host(dev->out.data(), n, dtype), to_host(reference.out.data(), n, dtype),
                tolerance(dtype), "out: " + name + " vs SIMT");
    check_close(to_host(dev->dqkv.data(), 3 * n, dtype),
                to_host(reference.dqkv.data(), 3 * n, dtype), tolerance(dtype),
                "dqkv: " + name + " vs SIMT");
  }
}

TEST_CASE("attention: DPTRAIN_ATTENTION other than auto, simt, wmma or mma is an error naming it") {
  const ScopedEnv bad("DPTRAIN_ATTENTION", "fast");
  const Shape s{1, 64, 1, 64};
  DeviceAttention dev(s, DType::bf16, random_qkv(s, DType::bf16, 61),
                      random_dout(s, DType::bf16, 61));
  std::string message;
  try {
    dev.forward();
  } catch (const Error& e) {
    message = e.what();
  }
  CHECK(message.find("DPTRAIN_ATTENTION=fast") != std::string::npos);
}

TEST_CASE("attention: broken preconditions are Error(internal) naming the op") {
  Ops& ops = gpu();
  Buffer qkv = ops.allocate(4 * 3 * 96 * sizeof(float));
  Buffer out = ops.allocate(4 * 96 * sizeof(float));
  Buffer state = ops.allocate(4 * 2 * sizeof(float));
  Buffer dqkv = ops.allocate(4 * 3 * 96 * sizeof(float));
  // Head size 48 (width 96, 2 heads) has no kernel.
  std::string message = error_of([&] {
    ops.attention_forward(ConstMatrix{qkv.data(), 4, 3 * 96}, 1, 4, 2, Matrix{out.data(), 4, 96},
                          state.as<float>());
  });
  CHECK(message.find("attention_forward") != std::string::npos);
  CHECK(message.find("head size 48") != std::string::npos);
  message = error_of([&] {
    ops.attention_backward(ConstMatrix{qkv.data(), 4, 3 * 96}, ConstMatrix{out.data(), 4, 96},
                           state.as<float>(), ConstMatrix{out.data(), 4, 96}, 1, 4, 2,
                           Matrix{dqkv.data(), 4, 3 * 96});
  });
  CHECK(message.find("attention_backward") != std::string::npos);
  CHECK(message.find("head size 48") != std::string::npos);
  // qkv narrower than 3 * width.
  message = error_of([&] {
    ops.attention_forward(ConstMatrix{qkv.data(), 4, 2 * 64}, 1, 4, 1, Matrix{out.data(), 4, 64},
                          state.as<float>());
  });
  CHECK(message.find("attention_forward") != std::string::npos);
  // Rows that do not match batch * seq.
  message = error_of([&] {
    ops.attention_forward(ConstMatrix{qkv.data(), 4, 3 * 64}, 1, 3, 1, Matrix{out.data(), 4, 64},
                          state.as<float>());
  });
  CHECK(message.find("attention_forward") != std::string::npos);
  // Width not a multiple of heads.
  message = error_of([&] {
    ops.attention_forward(ConstMatrix{qkv.data(), 4, 3 * 96}, 1, 4, 5, Matrix{out.data(), 4, 96},
                          state.as<float>());
  });
  CHECK(message.find("attention_forward") != std::string::npos);
  // qkv bf16, out f32.
  message = error_of([&] {
    ops.attention_forward(ConstMatrix{qkv.data(), 4, 3 * 64, DType::bf16}, 1, 4, 1,
                          Matrix{out.data(), 4, 64}, state.as<float>());
  });
  CHECK(message.find("attention_forward") != std::string::npos);
  // dqkv of another shape than qkv.
  message = error_of([&] {
    ops.attention_backward(ConstMatrix{qkv.data(), 4, 3 * 64}, ConstMatrix{out.data(), 4, 64},
                           state.as<float>(), ConstMatrix{out.data(), 4, 64}, 1, 4, 1,
                           Matrix{dqkv.data(), 4, 64});
  });
  CHECK(message.find("attention_backward") != std::string::npos);
}

}  // namespace
}  // namespace dptrain::gputest
