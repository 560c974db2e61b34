// The CPU op table: OpenBLAS sgemm plus simple vectorizable loops.
#include "core/tensor/cpu_ops.hpp"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "core/error.hpp"
#include "core/tensor/blas.hpp"
#include "core/tensor/half.hpp"
#include "core/tensor/vector_math.hpp"

namespace dptrain {
namespace {

using Mat = MatrixView<float>;
using CMat = MatrixView<const float>;

constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;

std::string shape(int64_t rows, int64_t cols) {
  return "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
}

void require_same_shape(const char* op, CMat a, CMat b) {
  if (a.rows != b.rows || a.cols != b.cols) {
    throw Error(ErrorKind::internal, std::string(op) + ": shapes " + shape(a.rows, a.cols) +
                                         " and " + shape(b.rows, b.cols) + " differ");
  }
}

void require_label(int32_t label, int64_t classes) {
  if (label < 0 || label >= classes) {
    throw Error(ErrorKind::recipe, "label " + std::to_string(label) + " is outside [0, " +
                                       std::to_string(classes) + ") (model.classes)");
  }
}

}  // namespace

static void gemm_f32(CMat a, Transpose transpose_a, CMat b, Transpose transpose_b, Mat c,
                     float alpha, float beta) {
  const bool ta = transpose_a == Transpose::yes;
  const bool tb = transpose_b == Transpose::yes;
  const int64_t m = ta ? a.cols : a.rows;
  const int64_t k = ta ? a.rows : a.cols;
  const int64_t kb = tb ? b.cols : b.rows;
  const int64_t n = tb ? b.rows : b.cols;
  if (k != kb || c.rows != m || c.cols != n) {
    throw Error(ErrorKind::internal, "gemm: op(a) " + shape(m, k) + " times op(b) " + shape(kb, n) +
                                         " does not fit c " + shape(c.rows, c.cols));
  }
  if (m == 0 || n == 0) return;
  // cblas rejects a leading dimension of 0, which an empty operand would have.
  blas_sgemm(ta, tb, m, n, k, alpha, a.data, std::max<int64_t>(a.row_stride(), 1), b.data,
             std::max<int64_t>(b.row_stride(), 1), beta, c.data, c.row_stride());
}

static void add_bias_rows_f32(Mat x, const float* bias) {
  for (int64_t i = 0; i < x.rows; ++i) {
    float* row = x.row(i);
    for (int64_t j = 0; j < x.cols; ++j)
      row[j] += bias[j];
  }
}

static void bias_grad_f32(CMat dy, float* bias_grad) {
  for (int64_t i = 0; i < dy.rows; ++i) {
    const float* row = dy.row(i);
    for (int64_t j = 0; j < dy.cols; ++j)
      bias_grad[j] += row[j];
  }
}

static void activation_forward_f32(Activation activation, CMat pre, Mat out) {
  require_same_shape("activation_forward", pre, out);
  const int64_t n = pre.size();
  const float* x = pre.data;
  float* y = out.data;
  if (activation == Activation::relu) {
    for (int64_t i = 0; i < n; ++i)
      y[i] = x[i] > 0.0f ? x[i] : 0.0f;
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float t = tanh_fast(kGeluScale * (v + kGeluCubic * v * v * v));
    y[i] = 0.5f * v * (1.0f + t);
  }
}

static void activation_backward_f32(Activation activation, CMat pre, CMat dout, Mat dpre) {
  require_same_shape("activation_backward", pre, dout);
  require_same_shape("activation_backward", pre, dpre);
  const int64_t n = pre.size();
  const float* x = pre.data;
  const float* dy = dout.data;
  float* dx = dpre.data;
  if (activation == Activation::relu) {
    for (int64_t i = 0; i < n; ++i)
      dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
    return;
  }
  for (int64_t i = 0; i < n; ++i) {
    const float v = x[i];
    const float t = tanh_fast(kGeluScale * (v + kGeluCubic * v * v * v));
    const float dt = kGeluScale * (1.0f + 3.0f * kGeluCubic * v * v) * (1.0f - t * t);
    dx[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * v * dt);
  }
}

static double softmax_cross_entropy_forward_f32(CMat logits, const int32_t* labels, Mat probs) {
  require_same_shape("softmax_cross_entropy_forward", logits, probs);
  if (logits.rows == 0) return 0.0;
  double loss_sum = 0.0;
  for (int64_t i = 0; i < logits.rows; ++i) {
    require_label(labels[i], logits.cols);
    const float* z = logits.row(i);
    float* p = probs.row(i);
    float max_z = z[0];
    for (int64_t j = 1; j < logits.cols; ++j)
      max_z = std::max(max_z, z[j]);
    const float target_shifted = z[labels[i]] - max_z;  // read before p (maybe z) is overwritten
    for (int64_t j = 0; j < logits.cols; ++j)
      p[j] = exp_nonpositive(z[j] - max_z);  // vectorises; the sum below keeps its order
    float sum = 0.0f;
    for (int64_t j = 0; j < logits.cols; ++j)
      sum += p[j];
    const float inv_sum = 1.0f / sum;
    for (int64_t j = 0; j < logits.cols; ++j)
      p[j] *= inv_sum;
    loss_sum += std::log(static_cast<double>(sum)) - static_cast<double>(target_shifted);
  }
  return loss_sum / static_cast<double>(logits.rows);
}

static void softmax_cross_entropy_backward_f32(CMat probs, const int32_t* labels, Mat dlogits,
                                               float scale) {
  require_same_shape("softmax_cross_entropy_backward", probs, dlogits);
  if (probs.rows == 0) return;
  const float row_scale = scale / static_cast<float>(probs.rows);
  for (int64_t i = 0; i < probs.rows; ++i) {
    require_label(labels[i], probs.cols);
    const float* p = probs.row(i);
    float* d = dlogits.row(i);
    for (int64_t j = 0; j < probs.cols; ++j)
      d[j] = row_scale * p[j];
    d[labels[i]] -= row_scale;
  }
}

static int64_t count_correct_f32(CMat scores, const int32_t* labels) {
  int64_t correct = 0;
  for (int64_t i = 0; i < scores.rows; ++i) {
    const float* s = scores.row(i);
    int64_t best = 0;
    for (int64_t j = 1; j < scores.cols; ++j) {
      if (s[j] > s[best]) best = j;
    }
    if (best == labels[i]) ++correct;
  }
  return correct;
}

// Plain loops (no std::sqrt errno: -fno-math-errno) vectorise; the order of operations matches the
// CUDA kernels so both agree within rounding.
static void adamw_f32(float* p, const float* g, float* m, float* v, int64_t n,
                      const AdamWCoefficients& k) {
  const float b1 = k.b1, b2 = k.b2, eps = k.eps, step_size = k.step_size;
  const float inv_sqrt_bc2 = k.inv_sqrt_bc2, decay = k.decay;
  for (int64_t i = 0; i < n; ++i) {
    m[i] = b1 * m[i] + (1.0f - b1) * g[i];
    v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
    p[i] = p[i] * decay - step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bc2 + eps);
  }
}

static void sgd_f32(float* p, const float* g, float* v, int64_t n, float momentum, float decay,
                    float rate, bool nesterov) {
  if (nesterov) {
    for (int64_t i = 0; i < n; ++i) {
      v[i] = momentum * v[i] + g[i];
      p[i] = p[i] * decay - rate * (g[i] + momentum * v[i]);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      v[i] = momentum * v[i] + g[i];
      p[i] = p[i] * decay - rate * v[i];
    }
  }
}

// ---- The op table: f32 views of the dtype-tagged matrices, then the loops above.

std::string CpuOps::device() const {
  return "cpu";
}

Buffer CpuOps::allocate(size_t bytes) {
  if (bytes == 0) return {};
  // 64-byte alignment suits AVX-512 loads; calloc's pages come zeroed at no cost.
  void* data = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (data == nullptr) {
    throw Error(ErrorKind::internal,
                "out of memory allocating " + std::to_string(bytes) + " bytes");
  }
  std::memset(data, 0, bytes);
  return Buffer(data, bytes, [](void* p) { std::free(p); });
}

void CpuOps::upload(const void* host, void* device, size_t bytes) {
  if (bytes > 0 && host != device) std::memcpy(device, host, bytes);
}

void CpuOps::download(const void* device, void* host, size_t bytes) {
  if (bytes > 0 && host != device) std::memcpy(host, device, bytes);
}

void CpuOps::copy(const void* src, void* dst, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, src, bytes);
}

void CpuOps::fill_zero(void* data, size_t bytes) {
  if (bytes > 0) std::memset(data, 0, bytes);
}

void CpuOps::synchronize() {}

// The CPU computes in f32, but gradients travel in 16 bits when compressed: casts go both ways.
template <typename T>
static void widen(const void* src, float* dst, int64_t n) {
  const T* in = static_cast<const T*>(src);
  if constexpr (std::is_same_v<T, Half>) {
    to_float(in, dst, static_cast<size_t>(n));
  } else {
    for (int64_t i = 0; i < n; ++i)
      dst[i] = Widened<T>::up(in[i]);
  }
}

template <typename T>
static void narrow(const float* src, void* dst, int64_t n) {
  T* out = static_cast<T*>(dst);
  if constexpr (std::is_same_v<T, Half>) {
    to_half(src, out, static_cast<size_t>(n));
  } else {
    for (int64_t i = 0; i < n; ++i)
      out[i] = Widened<T>::down(src[i]);
  }
}

void CpuOps::cast(const void* src, DType from, void* dst, DType to, int64_t n) {
  if (from == to) {
    copy(src, dst, static_cast<size_t>(n) * dtype_size(from));
  } else if (from == DType::f32) {
    const auto* in = static_cast<const float*>(src);
    to == DType::bf16 ? narrow<BFloat16>(in, dst, n) : narrow<Half>(in, dst, n);
  } else if (to == DType::f32) {
    auto* out = static_cast<float*>(dst);
    from == DType::bf16 ? widen<BFloat16>(src, out, n) : widen<Half>(src, out, n);
  } else {
    throw Error(ErrorKind::internal, std::string("cast: ") + dtype_name(from) + " to " +
                                         dtype_name(to) + " goes through f32");
  }
}

void CpuOps::gemm(ConstMatrix a, Transpose transpose_a, ConstMatrix b, Transpose transpose_b,
                  Matrix c, float alpha, float beta) {
  gemm_f32(f32_strided(a), transpose_a, f32_strided(b), transpose_b, f32_strided(c), alpha, beta);
}

void CpuOps::add_bias_rows(Matrix x, const void* bias) {
  add_bias_rows_f32(f32(x), static_cast<const float*>(bias));
}

void CpuOps::bias_grad(ConstMatrix dy, float* grad) {
  bias_grad_f32(f32(dy), grad);
}

void CpuOps::activation_forward(Activation activation, ConstMatrix pre, Matrix out) {
  activation_forward_f32(activation, f32(pre), f32(out));
}

void CpuOps::activation_backward(Activation activation, ConstMatrix pre, ConstMatrix dout,
                                 Matrix dpre) {
  activation_backward_f32(activation, f32(pre), f32(dout), f32(dpre));
}

double CpuOps::softmax_cross_entropy_forward(ConstMatrix logits, const int32_t* labels,
                                             Matrix probs) {
  return softmax_cross_entropy_forward_f32(f32_strided(logits), labels, f32_strided(probs));
}

void CpuOps::softmax_cross_entropy_backward(ConstMatrix probs, const int32_t* labels,
                                            Matrix dlogits, float scale) {
  softmax_cross_entropy_backward_f32(f32_strided(probs), labels, f32_strided(dlogits), scale);
}

int64_t CpuOps::count_correct(ConstMatrix scores, const int32_t* labels) {
  return count_correct_f32(f32_strided(scores), labels);
}

void CpuOps::add(ConstMatrix x, Matrix y) {
  require_same_shape("add", f32(x), f32(y));
  axpy(x.size(), 1.0f, f32(x).data, f32(y).data);
}

void CpuOps::axpy(int64_t n, float alpha, const float* x, float* y) {
  for (int64_t i = 0; i < n; ++i)
    y[i] += alpha * x[i];
}

void CpuOps::scale(int64_t n, float alpha, float* x) {
  for (int64_t i = 0; i < n; ++i)
    x[i] *= alpha;
}

double CpuOps::sum_squares(const float* x, int64_t n) {
  // Fixed lanes keep the sum deterministic yet let the compiler vectorize it.
  constexpr int64_t kSumLanes = 8;
  double lanes[kSumLanes] = {};
  const int64_t full = n / kSumLanes * kSumLanes;
  for (int64_t i = 0; i < full; i += kSumLanes) {
    for (int64_t k = 0; k < kSumLanes; ++k) {
      const double g = x[i + k];
      lanes[k] += g * g;
    }
  }
  double sum = 0.0;
  for (int64_t i = full; i < n; ++i)
    sum += static_cast<double>(x[i]) * x[i];
  for (double lane : lanes)
    sum += lane;
  return sum;
}

void CpuOps::adamw_update(float* params, const float* grads, float* m, float* v, int64_t n,
                          const AdamWCoefficients& k) {
  adamw_f32(params, grads, m, v, n, k);
}

void CpuOps::sgd_update(float* params, const float* grads, float* velocity, int64_t n,
                        float momentum, float decay, float rate, bool nesterov) {
  sgd_f32(params, grads, velocity, n, momentum, decay, rate, nesterov);
}

}  // namespace dptrain
