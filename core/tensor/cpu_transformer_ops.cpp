// The CPU op table's transformer ops: LayerNorm, causal multi-head attention, embeddings.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "core/tensor/blas.hpp"
#include "core/tensor/cpu_ops.hpp"
#include "core/tensor/vector_math.hpp"

namespace dptrain {
namespace {

using Mat = MatrixView<float>;
using CMat = MatrixView<const float>;

constexpr float kLayerNormEps = 1e-5f;
// Attention works on causal row blocks of this many positions: block i's scores need keys
// [0, end of block i) only, so the T x T products skip most of the masked upper triangle while
// each sgemm stays large enough for OpenBLAS to run at speed (48 measured best from T = 64 to
// 1024 on a 2-core AVX-512 machine; 32 and 64 were within 5-30%).
constexpr int64_t kAttentionBlock = 48;
// Reductions keep kLanes partial sums in a GCC vector (one AVX register, two SSE ones; wider
// vectors get spilled by GCC's lowering) and add them up in a fixed order at the end: they
// vectorise, and results stay bit-stable (one float accumulator would pin the order and run
// scalar without -ffast-math).
constexpr int kLanes = 8;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

std::string shape(int64_t rows, int64_t cols) {
  return "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
}

[[noreturn]] void shape_error(const char* op, const std::string& what) {
  throw Error(ErrorKind::internal, std::string(op) + ": " + what);
}

void require_same_shape(const char* op, CMat a, CMat b) {
  if (a.rows != b.rows || a.cols != b.cols) {
    shape_error(op,
                "shapes " + shape(a.rows, a.cols) + " and " + shape(b.rows, b.cols) + " differ");
  }
}

// Unaligned loads; the vector travels by reference (returning one by value changes the ABI with
// the target and GCC warns).
[[gnu::always_inline]] inline void load(Lanes& v, const float* p) {
  std::memcpy(&v, p, sizeof v);
}

// Halves added pairwise down to one value: vector adds, where summing the elements one by one
// would go through memory.
[[gnu::always_inline]] inline float lane_total(const Lanes& acc) {
  typedef float Half __attribute__((vector_size(4 * sizeof(float))));
  static_assert(kLanes == 8);
  const Half half =
      __builtin_shufflevector(acc, acc, 0, 1, 2, 3) + __builtin_shufflevector(acc, acc, 4, 5, 6, 7);
  return (half[0] + half[2]) + (half[1] + half[3]);
}

[[gnu::always_inline]] inline float sum(const float* a, int64_t n) {
  Lanes acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Lanes v;
    load(v, a + i);
    acc += v;
  }
  float total = lane_total(acc);
  for (; i < n; ++i)
    total += a[i];
  return total;
}

// Sums of d and d^2 for d = a[i] - shift: the second pass of the corrected two-pass variance.
[[gnu::always_inline]] inline void deviation_sums(const float* a, float shift, int64_t n,
                                                  float& sum_d, float& sum_d2) {
  Lanes acc = {}, acc2 = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Lanes d;
    load(d, a + i);
    d -= shift;
    acc += d;
    acc2 += d * d;
  }
  sum_d = lane_total(acc);
  sum_d2 = lane_total(acc2);
  for (; i < n; ++i) {
    const float d = a[i] - shift;
    sum_d += d;
    sum_d2 += d * d;
  }
}

[[gnu::always_inline]] inline float dot(const float* a, const float* b, int64_t n) {
  Lanes acc = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Lanes va, vb;
    load(va, a + i);
    load(vb, b + i);
    acc += va * vb;
  }
  float total = lane_total(acc);
  for (; i < n; ++i)
    total += a[i] * b[i];
  return total;
}

// Floats as ints that order like the floats (NaN above +inf): an int max loop vectorises, a float
// one does not (GCC will not if-convert float compares under the default -ftrapping-math).
[[gnu::always_inline]] inline int32_t order_key(float f) {
  const int32_t bits = std::bit_cast<int32_t>(f);
  return bits ^ ((bits >> 31) & 0x7fffffff);
}

[[gnu::always_inline]] inline float max_of(const float* a, int64_t n) {  // n >= 1
  int32_t best = order_key(a[0]);
  for (int64_t i = 1; i < n; ++i) {
    const int32_t key = order_key(a[i]);
    best = key > best ? key : best;
  }
  return std::bit_cast<float>(best ^ ((best >> 31) & 0x7fffffff));
}

// Row blocks [begin, end) of the causal attention.
int64_t block_end(int64_t begin, int64_t seq) {
  return std::min(begin + kAttentionBlock, seq);
}

void sgemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha, const float* a,
           int64_t lda, const float* b, int64_t ldb, float* c, int64_t ldc) {
  blas_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, 0.0f, c, ldc);
}

// Checks the attention shapes and returns the width.
int64_t attention_width(const char* op, CMat qkv, int64_t batch, int64_t seq, int64_t heads,
                        CMat out) {
  const int64_t width = out.cols;
  if (batch < 0 || seq < 0 || heads <= 0) {
    shape_error(op, "batch " + std::to_string(batch) + ", seq " + std::to_string(seq) + ", heads " +
                        std::to_string(heads) + " are not valid");
  }
  if (width <= 0 || width % heads != 0) {
    shape_error(op, "width " + std::to_string(width) + " is not a positive multiple of heads " +
                        std::to_string(heads));
  }
  if (qkv.cols != 3 * width || qkv.rows != batch * seq || out.rows != batch * seq) {
    shape_error(op, "qkv " + shape(qkv.rows, qkv.cols) + " and out " + shape(out.rows, out.cols) +
                        " do not fit batch " + std::to_string(batch) + " x seq " +
                        std::to_string(seq) + " with width " + std::to_string(width));
  }
  return width;
}

// The attention backward's per-call scratch (dP, then dS, of one head): grown, never shrunk.
std::vector<float>& attention_scratch(int64_t size) {
  thread_local std::vector<float> scratch;
  if (scratch.size() < static_cast<size_t>(size)) scratch.resize(static_cast<size_t>(size));
  return scratch;
}

// ---- Row kernels. The build targets baseline x86-64 (SSE2); these loops are most of the time
// outside BLAS, so on x86-64 each also gets AVX2 and AVX-512 clones, picked once at load time
// (about 1.5x faster attention softmax, 2x faster LayerNorm). The AVX-512 clone may fuse a
// multiply and add where the others round twice, so results can differ in the last bit between
// CPU models, as OpenBLAS's per-CPU kernels already do; one machine always computes the same bits.
#if defined(__x86_64__)
#define DPTRAIN_VECTOR_CLONES [[gnu::target_clones("avx512f", "avx2", "default")]]
#else
#define DPTRAIN_VECTOR_CLONES
#endif

DPTRAIN_VECTOR_CLONES
void layernorm_forward_rows(CMat x, const float* gamma, const float* beta, Mat out, float* mean,
                            float* rstd) {
  const int64_t n = x.cols;
  const float inv_n = 1.0f / static_cast<float>(n);
  for (int64_t i = 0; i < x.rows; ++i) {
    const float* xi = x.row(i);
    float* yi = out.row(i);
    // Two passes, the second also correcting the mean by the rounding error left from the first
    // (sum d is 0 in exact arithmetic): rows far from 0 keep their variance and an accurate mean.
    const float rough_mean = sum(xi, n) * inv_n;
    float sum_d = 0.0f, sum_d2 = 0.0f;
    deviation_sums(xi, rough_mean, n, sum_d, sum_d2);
    const float m = rough_mean + sum_d * inv_n;
    const float var = std::max((sum_d2 - sum_d * sum_d * inv_n) * inv_n, 0.0f);
    const float r = 1.0f / std::sqrt(var + kLayerNormEps);
    for (int64_t j = 0; j < n; ++j)
      yi[j] = (xi[j] - m) * r * gamma[j] + beta[j];
    mean[i] = m;
    rstd[i] = r;
  }
}

DPTRAIN_VECTOR_CLONES
void layernorm_backward_rows(CMat x, const float* gamma, const float* mean, const float* rstd,
                             CMat dout, Mat dx, float* dgamma, float* dbeta) {
  const int64_t n = x.cols;
  const float inv_n = 1.0f / static_cast<float>(n);
  for (int64_t i = 0; i < x.rows; ++i) {
    const float* xi = x.row(i);
    const float* dyi = dout.row(i);
    float* dxi = dx.row(i);
    const float m = mean[i];
    const float r = rstd[i];
    // dx = r * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma. dx is scratch for xhat
    // (it may not alias the inputs) so the two means need one pass.
    Lanes acc_g = {}, acc_gx = {};
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) {
      Lanes xhat, g, gamma_j;
      load(xhat, xi + j);
      xhat = (xhat - m) * r;
      load(g, dyi + j);
      load(gamma_j, gamma + j);
      g *= gamma_j;
      std::memcpy(dxi + j, &xhat, sizeof xhat);
      acc_g += g;
      acc_gx += g * xhat;
    }
    float sum_g = lane_total(acc_g);
    float sum_gx = lane_total(acc_gx);
    for (; j < n; ++j) {
      const float xhat = (xi[j] - m) * r;
      const float g = dyi[j] * gamma[j];
      dxi[j] = xhat;
      sum_g += g;
      sum_gx += g * xhat;
    }
    const float mean_g = sum_g * inv_n;
    const float mean_gx = sum_gx * inv_n;
    for (j = 0; j < n; ++j) {
      const float xhat = dxi[j];
      dgamma[j] += dyi[j] * xhat;
      dbeta[j] += dyi[j];
      dxi[j] = r * (dyi[j] * gamma[j] - mean_g - xhat * mean_gx);
    }
  }
}

// Rows [begin, end) of one head's [seq, seq] scores, filled for s < end: the causal softmax in
// place, s > t set to 0 up to seq.
DPTRAIN_VECTOR_CLONES
void causal_softmax_rows(float* p, int64_t seq, int64_t begin, int64_t end) {
  for (int64_t t = begin; t < end; ++t) {
    float* row = p + t * seq;
    const int64_t n = t + 1;
    const float row_max = max_of(row, n);
    for (int64_t s = 0; s < n; ++s)
      row[s] = exp_nonpositive(row[s] - row_max);
    const float inv_sum = 1.0f / sum(row, n);
    for (int64_t s = 0; s < n; ++s)
      row[s] *= inv_sum;
    std::fill(row + n, row + seq, 0.0f);
  }
}

// Rows [begin, end) of ds, holding dP for s < end, become dS = scale * P (dP - rowsum(dP P)) for
// s <= t and 0 for t < s < end.
DPTRAIN_VECTOR_CLONES
void causal_softmax_backward_rows(const float* p, float* ds, int64_t seq, int64_t begin,
                                  int64_t end, float scale) {
  for (int64_t t = begin; t < end; ++t) {
    const float* p_row = p + t * seq;
    float* ds_row = ds + t * seq;
    const int64_t n = t + 1;
    const float p_dot_dp = dot(p_row, ds_row, n);
    for (int64_t s = 0; s < n; ++s)
      ds_row[s] = scale * p_row[s] * (ds_row[s] - p_dot_dp);
    std::fill(ds_row + n, ds_row + end, 0.0f);
  }
}

#undef DPTRAIN_VECTOR_CLONES

}  // namespace

static void layernorm_forward_f32(CMat x, const float* gamma, const float* beta, Mat out,
                                  float* mean, float* rstd) {
  require_same_shape("layernorm_forward", x, out);
  if (x.rows > 0 && x.cols == 0) shape_error("layernorm_forward", "rows have no columns");
  layernorm_forward_rows(x, gamma, beta, out, mean, rstd);
}

static void layernorm_backward_f32(CMat x, const float* gamma, const float* mean, const float* rstd,
                                   CMat dout, Mat dx, float* dgamma, float* dbeta) {
  require_same_shape("layernorm_backward", x, dout);
  require_same_shape("layernorm_backward", x, dx);
  if (x.rows > 0 && x.cols == 0) shape_error("layernorm_backward", "rows have no columns");
  layernorm_backward_rows(x, gamma, mean, rstd, dout, dx, dgamma, dbeta);
}

static void attention_forward_f32(CMat qkv, int64_t batch, int64_t seq, int64_t heads, Mat out,
                                  float* att) {
  const int64_t width = attention_width("attention_forward", qkv, batch, seq, heads, out);
  const int64_t hd = width / heads;
  const int64_t ld = 3 * width;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (int64_t b = 0; b < batch; ++b) {
    const float* qkv_b = qkv.row(b * seq);
    float* out_b = out.row(b * seq);
    for (int64_t h = 0; h < heads; ++h) {
      const float* q = qkv_b + h * hd;
      const float* k = q + width;
      const float* v = q + 2 * width;
      float* p = att + (b * heads + h) * seq * seq;
      for (int64_t begin = 0; begin < seq; begin = block_end(begin, seq)) {
        const int64_t end = block_end(begin, seq);
        // Scores of rows [begin, end) against keys [0, end).
        sgemm(false, true, end - begin, end, hd, scale, q + begin * ld, ld, k, ld, p + begin * seq,
              seq);
        causal_softmax_rows(p, seq, begin, end);
        sgemm(false, false, end - begin, hd, end, 1.0f, p + begin * seq, seq, v, ld,
              out_b + begin * width + h * hd, width);
      }
    }
  }
}

static void attention_backward_f32(CMat qkv, const float* att, CMat dout, int64_t batch,
                                   int64_t seq, int64_t heads, Mat dqkv) {
  const int64_t width = attention_width("attention_backward", qkv, batch, seq, heads, dout);
  require_same_shape("attention_backward", qkv, dqkv);
  const int64_t hd = width / heads;
  const int64_t ld = 3 * width;
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  // ds holds dP = dout_h v^T, then in place dS = scale * P (dP - rowsum(dP P)): the gradient of
  // the scaled scores. Only the causal blocks are written and read; s > t inside them is 0.
  float* ds = attention_scratch(seq * seq).data();
  for (int64_t b = 0; b < batch; ++b) {
    const float* qkv_b = qkv.row(b * seq);
    const float* dout_b = dout.row(b * seq);
    float* dqkv_b = dqkv.row(b * seq);
    for (int64_t h = 0; h < heads; ++h) {
      const float* q = qkv_b + h * hd;
      const float* k = q + width;
      const float* v = q + 2 * width;
      const float* dy = dout_b + h * hd;
      float* dq = dqkv_b + h * hd;
      float* dk = dq + width;
      float* dv = dq + 2 * width;
      const float* p = att + (b * heads + h) * seq * seq;
      for (int64_t begin = 0; begin < seq; begin = block_end(begin, seq)) {
        const int64_t end = block_end(begin, seq);
        sgemm(false, true, end - begin, end, hd, 1.0f, dy + begin * width, width, v, ld,
              ds + begin * seq, seq);
        causal_softmax_backward_rows(p, ds, seq, begin, end, scale);
        // dq[t] = sum_{s <= t} dS[t, s] k_s.
        sgemm(false, false, end - begin, hd, end, 1.0f, ds + begin * seq, seq, k, ld,
              dq + begin * ld, ld);
      }
      // dk[s] = sum_{t >= s} dS[t, s] q_t and dv[s] = sum_{t >= s} P[t, s] dout_t: column block
      // [begin, end) needs rows [begin, seq), all written above (and P's zeros above the diagonal,
      // which the forward wrote).
      for (int64_t begin = 0; begin < seq; begin = block_end(begin, seq)) {
        const int64_t end = block_end(begin, seq);
        const int64_t rows = seq - begin;
        sgemm(true, false, end - begin, hd, rows, 1.0f, ds + begin * seq + begin, seq,
              q + begin * ld, ld, dk + begin * ld, ld);
        sgemm(true, false, end - begin, hd, rows, 1.0f, p + begin * seq + begin, seq,
              dy + begin * width, width, dv + begin * ld, ld);
      }
    }
  }
}

static void embedding_forward_f32(const int32_t* tokens, int64_t seq, int64_t vocab,
                                  const float* wte, const float* wpe, Mat out) {
  if (seq <= 0 || out.rows % seq != 0) {
    shape_error("embedding_forward", std::to_string(out.rows) + " rows are not a multiple of seq " +
                                         std::to_string(seq));
  }
  const int64_t width = out.cols;
  for (int64_t i = 0; i < out.rows; ++i) {
    const int32_t token = tokens[i];
    if (token < 0 || token >= vocab) {
      throw Error(ErrorKind::recipe, "token " + std::to_string(token) + " is outside [0, " +
                                         std::to_string(vocab) +
                                         "): the data's vocabulary exceeds model.vocab");
    }
    const float* te = wte + static_cast<int64_t>(token) * width;
    const float* pe = wpe + (i % seq) * width;
    float* y = out.row(i);
    for (int64_t j = 0; j < width; ++j)
      y[j] = te[j] + pe[j];
  }
}

static void embedding_backward_f32(const int32_t* tokens, int64_t seq, CMat dout, float* dwte,
                                   float* dwpe) {
  if (seq <= 0 || dout.rows % seq != 0) {
    shape_error("embedding_backward", std::to_string(dout.rows) +
                                          " rows are not a multiple of seq " + std::to_string(seq));
  }
  const int64_t width = dout.cols;
  for (int64_t i = 0; i < dout.rows; ++i) {
    if (tokens[i] < 0)
      shape_error("embedding_backward", "negative token " + std::to_string(tokens[i]));
    float* te = dwte + static_cast<int64_t>(tokens[i]) * width;
    float* pe = dwpe + (i % seq) * width;
    const float* dy = dout.row(i);
    for (int64_t j = 0; j < width; ++j) {
      te[j] += dy[j];
      pe[j] += dy[j];
    }
  }
}

// ---- The op table: f32 views of the dtype-tagged matrices, then the code above.

void CpuOps::layernorm_forward(ConstMatrix x, const void* gamma, const void* beta, Matrix out,
                               float* mean, float* rstd) {
  layernorm_forward_f32(f32(x), static_cast<const float*>(gamma), static_cast<const float*>(beta),
                        f32(out), mean, rstd);
}

void CpuOps::layernorm_backward(ConstMatrix x, const void* gamma, const float* mean,
                                const float* rstd, ConstMatrix dout, Matrix dx, float* dgamma,
                                float* dbeta) {
  layernorm_backward_f32(f32(x), static_cast<const float*>(gamma), mean, rstd, f32(dout), f32(dx),
                         dgamma, dbeta);
}

size_t CpuOps::attention_state_floats(int64_t batch, int64_t seq, int64_t heads) const {
  return static_cast<size_t>(batch * heads * seq * seq);  // the probabilities
}

void CpuOps::attention_forward(ConstMatrix qkv, int64_t batch, int64_t seq, int64_t heads,
                               Matrix out, float* state) {
  attention_forward_f32(f32(qkv), batch, seq, heads, f32(out), state);
}

void CpuOps::attention_backward(ConstMatrix qkv, ConstMatrix out, const float* state,
                                ConstMatrix dout, int64_t batch, int64_t seq, int64_t heads,
                                Matrix dqkv) {
  f32(out);  // unused (the probabilities are kept), but an f32 contiguous matrix like the rest
  attention_backward_f32(f32(qkv), state, f32(dout), batch, seq, heads, f32(dqkv));
}

void CpuOps::embedding_forward(const int32_t* tokens, int64_t seq, int64_t vocab, const void* wte,
                               const void* wpe, Matrix out) {
  embedding_forward_f32(tokens, seq, vocab, static_cast<const float*>(wte),
                        static_cast<const float*>(wpe), f32(out));
}

void CpuOps::embedding_backward(const int32_t* tokens, int64_t seq, ConstMatrix dout, float* dwte,
                                float* dwpe) {
  embedding_backward_f32(tokens, seq, f32(dout), dwte, dwpe);
}

}  // namespace dptrain
