// The CUDA op table's layer kernels: bias, activations, softmax cross-entropy, LayerNorm and
// embeddings (the CPU references are core/tensor/cpu_ops.cpp and cpu_transformer_ops.cpp).
#include <cub/device/device_radix_sort.cuh>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>

#include "kernels/cuda_ops_impl.cuh"

namespace dptrain::kernels {
namespace {

// The CPU's GELU (tanh approximation) and LayerNorm constants.
constexpr float kGeluScale = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluCubic = 0.044715f;
constexpr float kLayerNormEps = 1e-5f;

constexpr int kWarp = 32;
constexpr int kElementwiseThreads = 256;
constexpr int64_t kMaxElementwiseBlocks = 4096;
constexpr int64_t kMaxRowBlocks = int64_t{1} << 16;
// Column sums (bias_grad, LayerNorm's dgamma/dbeta): a block is a strip of kStripCols columns by
// kStripLanes row lanes; the grid splits the rows into chunks so that about kColumnSumBlocks
// blocks keep the SMs busy even for 768 columns. The split depends on the shape only, so the
// summation order (and the bits of the result) is the same on every run and every GPU.
constexpr int kStripCols = 32;
constexpr int kStripLanes = 16;
constexpr int64_t kColumnSumBlocks = 1024;
constexpr int64_t kMinChunkRows = 4 * kStripLanes;
constexpr int kTotalThreads = 256;

// 16 bytes of T: the middle of a row moves as one vector load or store per thread.
template <typename T>
inline constexpr int kPack = 16 / static_cast<int>(sizeof(T));
template <typename T>
struct alignas(16) Pack {
  T v[kPack<T>];
};

__device__ __forceinline__ unsigned misalignment(const void* p) {
  return static_cast<unsigned>(reinterpret_cast<uintptr_t>(p) % 16);
}

// Walks elements [0, n) of up to three rows a, b, c (kIn of them), thread `first` taking
// elements first, first + stride, ...: calls f(j, a[j], b[j], c[j]) (as floats; an input beyond
// kIn reads as 0) and, when kWrite, stores its result in out[j]. When every row sits at the same
// offset from a 16-byte boundary, the middle goes by 16-byte packs; otherwise element by element.
// out may alias an input: the thread that writes an element has read it just before.
template <int kIn, bool kWrite, typename T, typename F>
__device__ __forceinline__ void walk(int64_t n, int64_t first, int64_t stride, T* out, const T* a,
                                     const T* b, const T* c, F&& f) {
  const auto one = [&](int64_t j) {
    const float xa = to_f32(a[j]);
    float xb = 0.0f, xc = 0.0f;
    if constexpr (kIn >= 2) xb = to_f32(b[j]);
    if constexpr (kIn >= 3) xc = to_f32(c[j]);
    if constexpr (kWrite) {
      out[j] = from_f32<T>(f(j, xa, xb, xc));
    } else {
      f(j, xa, xb, xc);
    }
  };
  const unsigned offset = misalignment(a);
  bool together = offset % sizeof(T) == 0;
  if constexpr (kIn >= 2) together = together && misalignment(b) == offset;
  if constexpr (kIn >= 3) together = together && misalignment(c) == offset;
  if constexpr (kWrite) together = together && misalignment(out) == offset;
  int64_t head = n;
  if (together) {
    head = static_cast<int64_t>((16 - offset) % 16 / sizeof(T));
    if (head > n) head = n;
  }
  for (int64_t j = first; j < head; j += stride)
    one(j);
  constexpr int kP = kPack<T>;
  const int64_t packs = (n - head) / kP;
  // A thread's packs k, k + stride, ... go in groups of kGroup: the group's loads are all issued
  // before the first is used, so a row kernel's few threads keep several loads in flight each
  // (one at a time left them waiting on memory). f still sees the elements in the same order.
  constexpr int kGroup = kIn == 1 ? 4 : 2;
  const auto load = [](const T* row, int64_t j0) {
    return *reinterpret_cast<const Pack<T>*>(row + j0);
  };
  const auto use = [&](int64_t j0, const Pack<T>& pa, const Pack<T>& pb, const Pack<T>& pc) {
    Pack<T> po;
#pragma unroll
    for (int e = 0; e < kP; ++e) {
      const float xa = to_f32(pa.v[e]);
      const float xb = kIn >= 2 ? to_f32(pb.v[e]) : 0.0f;
      const float xc = kIn >= 3 ? to_f32(pc.v[e]) : 0.0f;
      if constexpr (kWrite) {
        po.v[e] = from_f32<T>(f(j0 + e, xa, xb, xc));
      } else {
        f(j0 + e, xa, xb, xc);
      }
    }
    if constexpr (kWrite) *reinterpret_cast<Pack<T>*>(out + j0) = po;
  };
  int64_t k = first;
  for (; k + (kGroup - 1) * stride < packs; k += kGroup * stride) {
    Pack<T> pa[kGroup], pb[kGroup], pc[kGroup];
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      const int64_t j0 = head + (k + g * stride) * kP;
      pa[g] = load(a, j0);
      pb[g] = kIn >= 2 ? load(b, j0) : pa[g];
      pc[g] = kIn >= 3 ? load(c, j0) : pa[g];
    }
#pragma unroll
    for (int g = 0; g < kGroup; ++g)
      use(head + (k + g * stride) * kP, pa[g], pb[g], pc[g]);
  }
  for (; k < packs; k += stride) {
    const int64_t j0 = head + k * kP;
    const Pack<T> pa = load(a, j0);
    use(j0, pa, kIn >= 2 ? load(b, j0) : pa, kIn >= 3 ? load(c, j0) : pa);
  }
  for (int64_t j = head + packs * kP + first; j < n; j += stride)
    one(j);
}

// A row spread over the block's threads.
template <int kIn, bool kWrite, typename T, typename F>
__device__ __forceinline__ void walk_row(int64_t n, T* out, const T* a, const T* b, const T* c,
                                         F&& f) {
  walk<kIn, kWrite>(n, threadIdx.x, blockDim.x, out, a, b, c, f);
}

struct Sum {
  template <typename V>
  __device__ V operator()(V x, V y) const {
    return x + y;
  }
};

// Lane (this lane ^ offset)'s v: a number, or a struct of 4-byte words moved word by word.
template <typename V>
__device__ __forceinline__ V shuffle_xor(V v, int offset) {
  if constexpr (std::is_arithmetic_v<V>) {
    return __shfl_xor_sync(0xffffffffu, v, offset);
  } else {
    static_assert(sizeof(V) % sizeof(int) == 0, "a struct of 4-byte words");
    int words[sizeof(V) / sizeof(int)];
    memcpy(words, &v, sizeof(V));
#pragma unroll
    for (int& word : words)
      word = __shfl_xor_sync(0xffffffffu, word, offset);
    memcpy(&v, words, sizeof(V));
    return v;
  }
}

// Butterfly over the warp: every lane ends with the same value (the ops are commutative), in an
// order fixed by the lane numbers.
template <typename V, typename Op>
__device__ __forceinline__ V warp_reduce(V v, Op op) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset /= 2)
    v = op(v, shuffle_xor(v, offset));
  return v;
}

// The block's values combined in a fixed order (warps, then the warps' results), returned to
// every thread. blockDim.x is a multiple of 32; every thread of the block must call it. V is
// trivially constructible (it lives in shared memory).
template <typename V, typename Op>
__device__ V block_reduce(V v, Op op, V identity) {
  __shared__ V partial[kWarp];
  v = warp_reduce(v, op);
  const int lane = static_cast<int>(threadIdx.x) % kWarp;
  const int warp = static_cast<int>(threadIdx.x) / kWarp;
  __syncthreads();  // the previous call's readers of `partial` are done
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  v = lane < static_cast<int>(blockDim.x) / kWarp ? partial[lane] : identity;
  return warp_reduce(v, op);
}

// The largest score and its column, the first one on ties.
struct Best {
  float value;
  int64_t index;
};

__device__ __forceinline__ Best better(Best a, Best b) {
  return b.value > a.value || (b.value == a.value && b.index < a.index) ? b : a;
}

__device__ Best block_argmax(Best v) {
  return block_reduce(
      v, [](Best a, Best b) { return better(a, b); },
      Best{-INFINITY, std::numeric_limits<int64_t>::max()});
}

// Records the first input error of the stream (the host throws it at the next synchronisation).
__device__ void record_error(DeviceErrors* errors, int32_t kind, int32_t value, int32_t limit) {
  if (atomicCAS(&errors->kind, 0, kind) == 0) {
    errors->value = value;
    errors->limit = limit;
  }
}

__device__ __forceinline__ float gelu_tanh(float v) {
  return tanhf(kGeluScale * (v + kGeluCubic * v * v * v));
}

// ---- Kernels.

template <typename T>
__global__ void add_bias_rows_kernel(T* x, const T* bias, int64_t rows, int64_t cols) {
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    T* row = x + i * cols;
    walk_row<2, true>(cols, row, row, bias, bias,
                      [](int64_t, float v, float b, float) { return v + b; });
  }
}

// Block (strip, chunk) sums its kStripCols columns over its chunk of rows: lane ty of column tx
// takes rows ty, ty + kStripLanes, ... in order, then the lanes add up in a fixed tree. With
// kLayerNorm, sum0 is of dy * xhat (dgamma) and sum1 of dy (dbeta); otherwise sum0 is of dy.
// `direct` (a single chunk) adds the sums into out0/out1; otherwise chunk k writes its partial
// sums to row k of out0/out1 ([chunks, cols]) for column_total_kernel.
template <typename T, bool kLayerNorm>
__global__ void column_sums_kernel(const T* dy, const T* x, const float* mean, const float* rstd,
                                   int64_t rows, int64_t cols, int64_t chunk_rows, bool direct,
                                   float* out0, float* out1) {
  __shared__ float lanes0[kStripLanes][kStripCols + 1];
  __shared__ float lanes1[kStripLanes][kStripCols + 1];
  const int tx = static_cast<int>(threadIdx.x);
  const int ty = static_cast<int>(threadIdx.y);
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kStripCols + tx;
  const int64_t begin = static_cast<int64_t>(blockIdx.y) * chunk_rows;
  const int64_t end = begin + chunk_rows < rows ? begin + chunk_rows : rows;
  float sum0 = 0.0f, sum1 = 0.0f;
  if (col < cols) {
    for (int64_t i = begin + ty; i < end; i += kStripLanes) {
      const float g = to_f32(dy[i * cols + col]);
      if constexpr (kLayerNorm) {
        const float xhat = (to_f32(x[i * cols + col]) - mean[i]) * rstd[i];
        sum0 += g * xhat;
        sum1 += g;
      } else {
        sum0 += g;
      }
    }
  }
  lanes0[ty][tx] = sum0;
  lanes1[ty][tx] = sum1;
  __syncthreads();
#pragma unroll
  for (int half = kStripLanes / 2; half > 0; half /= 2) {
    if (ty < half) {
      lanes0[ty][tx] += lanes0[ty + half][tx];
      if constexpr (kLayerNorm) lanes1[ty][tx] += lanes1[ty + half][tx];
    }
    __syncthreads();
  }
  if (ty != 0 || col >= cols) return;
  if (direct) {
    out0[col] += lanes0[0][tx];
    if constexpr (kLayerNorm) out1[col] += lanes1[0][tx];
  } else {
    out0[blockIdx.y * cols + col] = lanes0[0][tx];
    if constexpr (kLayerNorm) out1[blockIdx.y * cols + col] = lanes1[0][tx];
  }
}

// grad[c] += sum over chunks k, in order, of partial[k, c].
__global__ void column_total_kernel(const float* partial, int64_t chunks, int64_t cols,
                                    float* grad) {
  for (int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; c < cols;
       c += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float total = 0.0f;
    for (int64_t k = 0; k < chunks; ++k)
      total += partial[k * cols + c];
    grad[c] += total;
  }
}

template <typename T, Activation kActivation>
__global__ void activation_forward_kernel(const T* pre, T* out, int64_t n) {
  walk<1, true>(n, blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x,
                static_cast<int64_t>(gridDim.x) * blockDim.x, out, pre, pre, pre,
                [](int64_t, float v, float, float) {
                  if constexpr (kActivation == Activation::relu) {
                    return v > 0.0f ? v : 0.0f;
                  } else {
                    return 0.5f * v * (1.0f + gelu_tanh(v));
                  }
                });
}

template <typename T, Activation kActivation>
__global__ void activation_backward_kernel(const T* pre, const T* dout, T* dpre, int64_t n) {
  walk<2, true>(n, blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x,
                static_cast<int64_t>(gridDim.x) * blockDim.x, dpre, pre, dout, dout,
                [](int64_t, float v, float dy, float) {
                  if constexpr (kActivation == Activation::relu) {
                    return v > 0.0f ? dy : 0.0f;
                  } else {
                    const float t = gelu_tanh(v);
                    const float dt =
                        kGeluScale * (1.0f + 3.0f * kGeluCubic * v * v) * (1.0f - t * t);
                    return dy * (0.5f * (1.0f + t) + 0.5f * v * dt);
                  }
                });
}

// The running maximum m of a row and the sum s of exp(v - m) over its values, in one pass (the
// online softmax): a larger value rescales the sum so far. An empty part is no_values().
struct MaxSum {
  float max;
  float sum;
  __device__ __forceinline__ void add(float v) {
    if (v > max) {
      sum = sum * expf(max - v) + 1.0f;  // expf(-inf) = 0 for the first value
      max = v;
    } else if (v != -INFINITY) {  // -inf adds nothing (-inf - -inf would be NaN); NaN does
      sum += expf(v - max);       // (a NaN logit makes the loss NaN, as on the CPU)
    }
  }
};
__device__ __forceinline__ MaxSum no_values() {
  return MaxSum{-INFINITY, 0.0f};
}

__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float max = fmaxf(a.max, b.max);
  // Both empty or all -inf (fmaxf passes over NaN): nothing to rescale, but a NaN sum stays.
  if (max == -INFINITY) return MaxSum{max, a.sum + b.sum};
  return MaxSum{max, a.sum * expf(a.max - max) + b.sum * expf(b.max - max)};
}

// One block per row (rows blockIdx.x, + gridDim.x, ...): the row's max and sum of exp(z - max)
// in one pass, then a second that writes probs (kGradient false) or, fused with the backward,
// dlogits = row_scale * (probs - onehot(label)) (kGradient true). Each pass reads the whole row
// before the next writes it, so `out` may alias logits; the second pass mostly reads from L2.
// Thread 0 adds the block's row losses in row order into block_loss[blockIdx.x] (double); an
// out-of-range label is recorded instead of read, and its row's gradient has no -row_scale.
// Rows are `in_stride` and `out_stride` elements apart (padded logits).
template <typename T, bool kGradient>
__global__ void __launch_bounds__(1024)
    softmax_xent_forward_kernel(const T* logits, const int32_t* labels, T* out, int64_t rows,
                                int64_t cols, int64_t in_stride, int64_t out_stride,
                                float row_scale, DeviceErrors* errors, double* block_loss) {
  double loss = 0.0;
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* z = logits + i * in_stride;
    T* p = out + i * out_stride;
    const int32_t label = labels[i];
    const bool valid = label >= 0 && label < cols;
    const float target = valid && threadIdx.x == 0 ? to_f32(z[label]) : 0.0f;
    MaxSum part = no_values();
    walk_row<1, false>(cols, p, z, z, z, [&](int64_t, float v, float, float) { part.add(v); });
    const MaxSum row = block_reduce(
        part, [](MaxSum a, MaxSum b) { return combine(a, b); }, no_values());
    // A +inf logit makes the row NaN, as on the CPU (exp(inf - inf)); the online sum would
    // have counted a lone one as 1.
    const float sum = row.max == INFINITY ? NAN : row.sum;
    const float inv_sum = 1.0f / sum;
    if constexpr (kGradient) {
      walk_row<1, true>(cols, p, z, z, z, [&](int64_t j, float v, float, float) {
        const float d = row_scale * (expf(v - row.max) * inv_sum);
        return j == label ? d - row_scale : d;
      });
    } else {
      walk_row<1, true>(cols, p, z, z, z, [&](int64_t, float v, float, float) {
        return expf(v - row.max) * inv_sum;
      });
    }
    if (threadIdx.x == 0) {
      if (valid) {
        loss += log(static_cast<double>(sum)) - static_cast<double>(target - row.max);
      } else {
        record_error(errors, 2, label, static_cast<int32_t>(cols));
      }
    }
  }
  if (threadIdx.x == 0) block_loss[blockIdx.x] = loss;
}

// total = the sum of values[0, n) in a fixed order (thread strides, then the block tree).
__global__ void __launch_bounds__(1024)
    sum_doubles_kernel(const double* values, int64_t n, double* total) {
  double sum = 0.0;
  for (int64_t k = threadIdx.x; k < n; k += blockDim.x)
    sum += values[k];
  sum = block_reduce(sum, Sum{}, 0.0);
  if (threadIdx.x == 0) *total = sum;
}

// dlogits[i, j] = row_scale * probs[i, j], minus row_scale at the label (dlogits may alias
// probs). The label is only compared, never used as an address.
template <typename T>
__global__ void __launch_bounds__(1024)
    softmax_xent_backward_kernel(const T* probs, const int32_t* labels, T* dlogits, int64_t rows,
                                 int64_t cols, int64_t in_stride, int64_t out_stride,
                                 float row_scale, DeviceErrors* errors) {
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const int32_t label = labels[i];
    if (threadIdx.x == 0 && (label < 0 || label >= cols)) {
      record_error(errors, 2, label, static_cast<int32_t>(cols));
    }
    const T* p = probs + i * in_stride;
    walk_row<1, true>(cols, dlogits + i * out_stride, p, p, p,
                      [&](int64_t j, float v, float, float) {
                        const float d = row_scale * v;
                        return j == label ? d - row_scale : d;
                      });
  }
}

// Rows whose argmax (first column on ties) is the label, added to *correct. Like the CPU loop,
// a NaN never wins, and a row starting with NaN picks column 0.
template <typename T>
__global__ void __launch_bounds__(1024)
    count_correct_kernel(const T* scores, const int32_t* labels, int64_t rows, int64_t cols,
                         int64_t stride, unsigned long long* correct) {
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* s = scores + i * stride;
    Best best{-INFINITY, std::numeric_limits<int64_t>::max()};
    walk_row<1, false>(cols, static_cast<T*>(nullptr), s, s, s,
                       [&](int64_t j, float v, float, float) {
                         best = better(best, Best{v, j});
                       });
    best = block_argmax(best);
    if (threadIdx.x == 0) {
      const int64_t column = isnan(to_f32(s[0])) ? 0 : best.index;
      if (column == labels[i]) atomicAdd(correct, 1ull);  // integer: any order gives the count
    }
  }
}

// One block per row: mean and variance by two passes, the second correcting the mean by the
// rounding error left from the first (as the CPU does), then the normalised row.
template <typename T>
__global__ void layernorm_forward_kernel(const T* x, const T* gamma, const T* beta, T* out,
                                         float* mean, float* rstd, int64_t rows, int64_t cols) {
  const float inv_n = 1.0f / static_cast<float>(cols);
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* xi = x + i * cols;
    T* yi = out + i * cols;
    float sum = 0.0f;
    walk_row<1, false>(cols, yi, xi, xi, xi, [&](int64_t, float v, float, float) { sum += v; });
    const float rough_mean = block_reduce(sum, Sum{}, 0.0f) * inv_n;
    float sum_d = 0.0f, sum_d2 = 0.0f;
    walk_row<1, false>(cols, yi, xi, xi, xi, [&](int64_t, float v, float, float) {
      const float d = v - rough_mean;
      sum_d += d;
      sum_d2 += d * d;
    });
    sum_d = block_reduce(sum_d, Sum{}, 0.0f);
    sum_d2 = block_reduce(sum_d2, Sum{}, 0.0f);
    const float m = rough_mean + sum_d * inv_n;
    // Like the CPU's std::max(v, 0): a NaN variance (an Inf or NaN in the row) stays NaN.
    const float v = (sum_d2 - sum_d * sum_d * inv_n) * inv_n;
    const float var = v < 0.0f ? 0.0f : v;
    const float r = 1.0f / sqrtf(var + kLayerNormEps);
    walk_row<3, true>(cols, yi, xi, gamma, beta,
                      [&](int64_t, float v, float g, float b) { return (v - m) * r * g + b; });
    if (threadIdx.x == 0) {
      mean[i] = m;
      rstd[i] = r;
    }
  }
}

// dx = r * (g - mean(g) - xhat * mean(g * xhat)) with g = dy * gamma, one block per row.
template <typename T>
__global__ void layernorm_backward_dx_kernel(const T* x, const T* gamma, const float* mean,
                                             const float* rstd, const T* dout, T* dx, int64_t rows,
                                             int64_t cols) {
  const float inv_n = 1.0f / static_cast<float>(cols);
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const T* xi = x + i * cols;
    const T* dyi = dout + i * cols;
    T* dxi = dx + i * cols;
    const float m = mean[i];
    const float r = rstd[i];
    float sum_g = 0.0f, sum_gx = 0.0f;
    walk_row<3, false>(cols, dxi, xi, dyi, gamma, [&](int64_t, float v, float dy, float gm) {
      const float g = dy * gm;
      sum_g += g;
      sum_gx += g * ((v - m) * r);
    });
    const float mean_g = block_reduce(sum_g, Sum{}, 0.0f) * inv_n;
    const float mean_gx = block_reduce(sum_gx, Sum{}, 0.0f) * inv_n;
    walk_row<3, true>(cols, dxi, xi, dyi, gamma, [&](int64_t, float v, float dy, float gm) {
      const float xhat = (v - m) * r;
      return r * (dy * gm - mean_g - xhat * mean_gx);
    });
  }
}

// out[i, :] = wte[token_i, :] + wpe[i % seq, :]; a token outside [0, vocab) is recorded and its
// row written as zeros (never read out of bounds).
template <typename T>
__global__ void embedding_forward_kernel(const int32_t* tokens, int64_t seq, int64_t vocab,
                                         const T* wte, const T* wpe, T* out, int64_t rows,
                                         int64_t width, DeviceErrors* errors) {
  for (int64_t i = blockIdx.x; i < rows; i += gridDim.x) {
    const int32_t token = tokens[i];
    const T* pe = wpe + (i % seq) * width;
    T* y = out + i * width;
    if (token < 0 || token >= vocab) {
      if (threadIdx.x == 0) record_error(errors, 1, token, static_cast<int32_t>(vocab));
      walk_row<1, true>(width, y, pe, pe, pe, [](int64_t, float, float, float) { return 0.0f; });
      continue;
    }
    walk_row<2, true>(width, y, wte + static_cast<int64_t>(token) * width, pe, pe,
                      [](int64_t, float te, float p, float) { return te + p; });
  }
}

// dwpe[t, c] += dout[b * seq + t, c] for b = 0, 1, ... in order: one thread per (t, c), the same
// additions in the same order as the CPU loop.
template <typename T>
__global__ void embedding_backward_wpe_kernel(const T* dout, int64_t seq, int64_t batch,
                                              int64_t width, float* dwpe) {
  const int64_t c = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (c >= width) return;
  for (int64_t t = blockIdx.y; t < seq; t += gridDim.y) {
    float acc = dwpe[t * width + c];
    for (int64_t b = 0; b < batch; ++b)
      acc += to_f32(dout[(b * seq + t) * width + c]);
    dwpe[t * width + c] = acc;
  }
}

__global__ void iota_kernel(int32_t* values, int64_t n) {
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < n;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    values[k] = static_cast<int32_t>(k);
  }
}

// After a stable sort of (token, row) pairs, the rows of one token are a run of `order`, in
// increasing row order. The block at the start of a run adds those rows into dwte[token, :]
// one after the other, each thread owning columns: the CPU's additions in the CPU's order.
// Nothing is written when an earlier kernel recorded an input error (a token the forward found
// out of range would be out of bounds here too, and the step fails at the next synchronisation
// anyway); negative tokens, which the forward reports the same way, are skipped.
template <typename T>
__global__ void embedding_backward_wte_kernel(const int32_t* sorted_tokens, const int32_t* order,
                                              int64_t n, const T* dout, int64_t width, float* dwte,
                                              const DeviceErrors* errors) {
  if (errors->kind != 0) return;
  for (int64_t k = blockIdx.x; k < n; k += gridDim.x) {
    const int32_t token = sorted_tokens[k];
    if (token < 0 || (k > 0 && sorted_tokens[k - 1] == token)) continue;
    float* te = dwte + static_cast<int64_t>(token) * width;
    for (int64_t c = threadIdx.x; c < width; c += blockDim.x) {
      float acc = te[c];
      for (int64_t r = k; r < n && sorted_tokens[r] == token; ++r)
        acc += to_f32(dout[static_cast<int64_t>(order[r]) * width + c]);
      te[c] = acc;
    }
  }
}

// ---- Host helpers.

// The same for contiguous matrices.
void require_same(const char* op, ConstMatrix a, const char* a_name, ConstMatrix b,
                  const char* b_name) {
  require_same_shape(op, a, a_name, b, b_name);
  require_contiguous(op, a, a_name);
  require_contiguous(op, b, b_name);
}

void require_int32(const char* op, const char* what, int64_t value) {
  if (value > std::numeric_limits<int32_t>::max()) {
    precondition_failed(op, std::string(what) + " " + std::to_string(value) +
                                " exceeds the int32 range of tokens and labels");
  }
}

template <typename T>
const T* typed(const void* p) {
  return static_cast<const T*>(p);
}
template <typename T>
T* typed(void* p) {
  return static_cast<T*>(p);
}

// Threads for one block per row: enough 32-thread warps to give each thread about one 16-byte
// pack of the row, at most max_threads.
int row_threads(int64_t cols, size_t element_bytes, int max_threads) {
  const int64_t pack = 16 / static_cast<int64_t>(element_bytes);
  const int64_t wanted = ((cols + pack - 1) / pack + kWarp - 1) / kWarp * kWarp;
  return static_cast<int>(wanted < kWarp ? kWarp : wanted > max_threads ? max_threads : wanted);
}

// Threads for a block whose threads each own one column of `cols`, at most kTotalThreads.
int column_threads(int64_t cols) {
  const int64_t wanted = (cols + kWarp - 1) / kWarp * kWarp;
  return static_cast<int>(wanted > kTotalThreads ? kTotalThreads : wanted);
}

int row_blocks(int64_t rows) {
  return static_cast<int>(rows < kMaxRowBlocks ? rows : kMaxRowBlocks);
}

int elementwise_blocks(int64_t n, size_t element_bytes) {
  const int64_t per_block = kElementwiseThreads * (16 / static_cast<int64_t>(element_bytes));
  const int64_t wanted = (n + per_block - 1) / per_block;
  return static_cast<int>(wanted < kMaxElementwiseBlocks ? wanted : kMaxElementwiseBlocks);
}

// Device memory for one call's intermediate results, allocated and freed in stream order: the
// stream-ordered pool hands the same memory back on the next call without a device-wide
// synchronisation (cudaMalloc/cudaFree would synchronise the device every time).
class StreamScratch {
 public:
  StreamScratch(size_t bytes, cudaStream_t stream, const char* what) : stream_(stream) {
    check_cuda(cudaMallocAsync(&data_, bytes, stream), what);
  }
  StreamScratch(const StreamScratch&) = delete;
  StreamScratch& operator=(const StreamScratch&) = delete;
  // Only reached with data_ set when a launch threw: the error being thrown says more than a
  // second one from the free could.
  ~StreamScratch() {
    if (data_ != nullptr) static_cast<void>(cudaFreeAsync(data_, stream_));
  }
  char* bytes() const { return static_cast<char*>(data_); }
  void release(const char* what) {
    void* data = data_;
    data_ = nullptr;
    check_cuda(cudaFreeAsync(data, stream_), what);
  }

 private:
  cudaStream_t stream_;
  void* data_ = nullptr;
};

constexpr size_t round_up_256(size_t bytes) {
  return (bytes + 255) / 256 * 256;
}

// Column sums of dy (or, for LayerNorm, of dy * xhat and dy) added into grad0 (and grad1); the
// split into row chunks and every addition's order depend on the shape only.
template <typename T, bool kLayerNorm>
void column_sums(cudaStream_t stream, const char* op, const T* dy, const T* x, const float* mean,
                 const float* rstd, int64_t rows, int64_t cols, float* grad0, float* grad1) {
  if (rows == 0 || cols == 0) return;
  const int64_t strips = (cols + kStripCols - 1) / kStripCols;
  const int64_t max_chunks = (rows + kMinChunkRows - 1) / kMinChunkRows;
  int64_t chunks = (kColumnSumBlocks + strips - 1) / strips;
  if (chunks > max_chunks) chunks = max_chunks;
  if (chunks < 1) chunks = 1;
  const int64_t chunk_rows = (rows + chunks - 1) / chunks;
  chunks = (rows + chunk_rows - 1) / chunk_rows;  // no empty chunk
  const dim3 block(kStripCols, kStripLanes);
  const dim3 grid(static_cast<unsigned>(strips), static_cast<unsigned>(chunks));
  if (chunks == 1) {
    column_sums_kernel<T, kLayerNorm>
        <<<grid, block, 0, stream>>>(dy, x, mean, rstd, rows, cols, chunk_rows, true, grad0, grad1);
    check_launch(op);
    return;
  }
  const size_t outputs = kLayerNorm ? 2 : 1;
  const size_t partial_bytes = round_up_256(static_cast<size_t>(chunks * cols) * sizeof(float));
  StreamScratch scratch(partial_bytes * outputs, stream, op);
  float* partial0 = reinterpret_cast<float*>(scratch.bytes());
  float* partial1 =
      kLayerNorm ? reinterpret_cast<float*>(scratch.bytes() + partial_bytes) : nullptr;
  column_sums_kernel<T, kLayerNorm><<<grid, block, 0, stream>>>(
      dy, x, mean, rstd, rows, cols, chunk_rows, false, partial0, partial1);
  check_launch(op);
  const int64_t wanted = (cols + kTotalThreads - 1) / kTotalThreads;
  const int blocks =
      static_cast<int>(wanted < kMaxElementwiseBlocks ? wanted : kMaxElementwiseBlocks);
  column_total_kernel<<<blocks, kTotalThreads, 0, stream>>>(partial0, chunks, cols, grad0);
  check_launch(op);
  if constexpr (kLayerNorm) {
    column_total_kernel<<<blocks, kTotalThreads, 0, stream>>>(partial1, chunks, cols, grad1);
    check_launch(op);
  }
  scratch.release(op);
}

}  // namespace

void CudaOps::add_bias_rows(Matrix x, const void* bias) {
  const OpTimer timer(*this, "add_bias_rows");
  if (x.size() == 0) return;
  if (bias == nullptr) precondition_failed("add_bias_rows", "bias is null");
  require_contiguous("add_bias_rows", x, "x");
  dispatch_dtype(x.dtype, [&]<typename T>() {
    add_bias_rows_kernel<T>
        <<<row_blocks(x.rows), row_threads(x.cols, sizeof(T), 256), 0, stream()>>>(
            typed<T>(x.data), typed<T>(bias), x.rows, x.cols);
  });
  check_launch("add_bias_rows");
}

void CudaOps::bias_grad(ConstMatrix dy, float* bias_grad) {
  const OpTimer timer(*this, "bias_grad");
  if (dy.size() == 0) return;
  require_contiguous("bias_grad", dy, "dy");
  dispatch_dtype(dy.dtype, [&]<typename T>() {
    column_sums<T, false>(stream(), "bias_grad", typed<T>(dy.data), nullptr, nullptr, nullptr,
                          dy.rows, dy.cols, bias_grad, nullptr);
  });
}

void CudaOps::activation_forward(Activation activation, ConstMatrix pre, Matrix out) {
  const OpTimer timer(*this, "activation_forward");
  require_same("activation_forward", pre, "pre", out, "out");
  const int64_t n = pre.size();
  if (n == 0) return;
  dispatch_dtype(pre.dtype, [&]<typename T>() {
    const int blocks = elementwise_blocks(n, sizeof(T));
    if (activation == Activation::relu) {
      activation_forward_kernel<T, Activation::relu>
          <<<blocks, kElementwiseThreads, 0, stream()>>>(typed<T>(pre.data), typed<T>(out.data), n);
    } else {
      activation_forward_kernel<T, Activation::gelu>
          <<<blocks, kElementwiseThreads, 0, stream()>>>(typed<T>(pre.data), typed<T>(out.data), n);
    }
  });
  check_launch("activation_forward");
}

void CudaOps::activation_backward(Activation activation, ConstMatrix pre, ConstMatrix dout,
                                  Matrix dpre) {
  const OpTimer timer(*this, "activation_backward");
  require_same("activation_backward", pre, "pre", dout, "dout");
  require_same("activation_backward", pre, "pre", dpre, "dpre");
  const int64_t n = pre.size();
  if (n == 0) return;
  dispatch_dtype(pre.dtype, [&]<typename T>() {
    const int blocks = elementwise_blocks(n, sizeof(T));
    if (activation == Activation::relu) {
      activation_backward_kernel<T, Activation::relu><<<blocks, kElementwiseThreads, 0, stream()>>>(
          typed<T>(pre.data), typed<T>(dout.data), typed<T>(dpre.data), n);
    } else {
      activation_backward_kernel<T, Activation::gelu><<<blocks, kElementwiseThreads, 0, stream()>>>(
          typed<T>(pre.data), typed<T>(dout.data), typed<T>(dpre.data), n);
    }
  });
  check_launch("activation_backward");
}

namespace {

// The softmax cross-entropy forward over logits (padded rows allowed) into `out`: probs, or
// with kGradient the backward's dlogits as well (scaled by row_scale). Returns the mean loss;
// waits for the stream (the loss is read back) and throws what the kernel recorded.
template <bool kGradient>
double softmax_xent(CudaOps& ops, const char* op, ConstMatrix logits, const int32_t* labels,
                    Matrix out, float scale) {
  require_same_shape(op, logits, "logits", out, kGradient ? "dlogits" : "probs");
  if (logits.rows == 0) return 0.0;
  if (logits.cols == 0) precondition_failed(op, "logits have no columns");
  require_int32(op, "the class count", logits.cols);
  // Each block adds its rows' losses in row order into its own slot; one more block adds the
  // slots in a fixed order: the mean has the same bits on every run.
  const int64_t slots = static_cast<int64_t>(CudaOps::kReduceSlots) - 1;
  const int64_t blocks = logits.rows < slots ? logits.rows : slots;
  double* block_loss = ops.reduce_scratch();
  double* total = ops.reduce_scratch() + slots;
  const float row_scale = scale / static_cast<float>(logits.rows);
  dispatch_dtype(logits.dtype, [&]<typename T>() {
    softmax_xent_forward_kernel<T, kGradient>
        <<<static_cast<int>(blocks), row_threads(logits.cols, sizeof(T), 1024), 0, ops.stream()>>>(
            typed<T>(logits.data), labels, typed<T>(out.data), logits.rows, logits.cols,
            logits.row_stride(), out.row_stride(), row_scale, ops.device_errors(), block_loss);
  });
  check_launch(op);
  sum_doubles_kernel<<<1, 1024, 0, ops.stream()>>>(block_loss, blocks, total);
  check_launch((std::string(op) + " (loss sum)").c_str());
  check_cuda(
      cudaMemcpyAsync(ops.pinned(), total, sizeof(double), cudaMemcpyDeviceToHost, ops.stream()),
      (std::string(op) + ": reading the loss").c_str());
  check_cuda(cudaStreamSynchronize(ops.stream()), (std::string(op) + ": synchronising").c_str());
  double loss_sum = 0.0;
  std::memcpy(&loss_sum, ops.pinned(), sizeof(loss_sum));  // before check_device_errors reuses it
  ops.check_device_errors();
  return loss_sum / static_cast<double>(logits.rows);
}

}  // namespace

double CudaOps::softmax_cross_entropy_forward(ConstMatrix logits, const int32_t* labels,
                                              Matrix probs) {
  const OpTimer timer(*this, "softmax_cross_entropy_forward");
  return softmax_xent<false>(*this, "softmax_cross_entropy_forward", logits, labels, probs, 1.0f);
}

double CudaOps::softmax_cross_entropy(ConstMatrix logits, const int32_t* labels, Matrix dlogits,
                                      float scale) {
  const OpTimer timer(*this, "softmax_cross_entropy");
  return softmax_xent<true>(*this, "softmax_cross_entropy", logits, labels, dlogits, scale);
}

void CudaOps::softmax_cross_entropy_backward(ConstMatrix probs, const int32_t* labels,
                                             Matrix dlogits, float scale) {
  const OpTimer timer(*this, "softmax_cross_entropy_backward");
  constexpr const char* kOp = "softmax_cross_entropy_backward";
  require_same_shape(kOp, probs, "probs", dlogits, "dlogits");
  if (probs.rows == 0) return;
  if (probs.cols == 0) precondition_failed(kOp, "probs have no columns");
  require_int32(kOp, "the class count", probs.cols);
  const float row_scale = scale / static_cast<float>(probs.rows);
  dispatch_dtype(probs.dtype, [&]<typename T>() {
    softmax_xent_backward_kernel<T>
        <<<row_blocks(probs.rows), row_threads(probs.cols, sizeof(T), 1024), 0, stream()>>>(
            typed<T>(probs.data), labels, typed<T>(dlogits.data), probs.rows, probs.cols,
            probs.row_stride(), dlogits.row_stride(), row_scale, device_errors());
  });
  check_launch(kOp);
}

int64_t CudaOps::count_correct(ConstMatrix scores, const int32_t* labels) {
  const OpTimer timer(*this, "count_correct");
  constexpr const char* kOp = "count_correct";
  require_stride(kOp, scores, "scores");
  if (scores.rows == 0) return 0;
  if (scores.cols == 0) precondition_failed(kOp, "scores have no columns");
  auto* correct = reinterpret_cast<unsigned long long*>(reduce_scratch());
  check_cuda(cudaMemsetAsync(correct, 0, sizeof(*correct), stream()),
             "count_correct: cudaMemsetAsync");
  dispatch_dtype(scores.dtype, [&]<typename T>() {
    count_correct_kernel<T>
        <<<row_blocks(scores.rows), row_threads(scores.cols, sizeof(T), 1024), 0, stream()>>>(
            typed<T>(scores.data), labels, scores.rows, scores.cols, scores.row_stride(), correct);
  });
  check_launch(kOp);
  check_cuda(cudaMemcpyAsync(pinned(), correct, sizeof(*correct), cudaMemcpyDeviceToHost, stream()),
             "count_correct: reading the count");
  check_cuda(cudaStreamSynchronize(stream()), "count_correct: synchronising");
  unsigned long long count = 0;
  std::memcpy(&count, pinned(), sizeof(count));
  check_device_errors();
  return static_cast<int64_t>(count);
}

void CudaOps::layernorm_forward(ConstMatrix x, const void* gamma, const void* beta, Matrix out,
                                float* mean, float* rstd) {
  const OpTimer timer(*this, "layernorm_forward");
  constexpr const char* kOp = "layernorm_forward";
  require_same(kOp, x, "x", out, "out");
  if (x.rows == 0) return;
  if (x.cols == 0) precondition_failed(kOp, "rows have no columns");
  dispatch_dtype(x.dtype, [&]<typename T>() {
    layernorm_forward_kernel<T>
        <<<row_blocks(x.rows), row_threads(x.cols, sizeof(T), 256), 0, stream()>>>(
            typed<T>(x.data), typed<T>(gamma), typed<T>(beta), typed<T>(out.data), mean, rstd,
            x.rows, x.cols);
  });
  check_launch(kOp);
}

void CudaOps::layernorm_backward(ConstMatrix x, const void* gamma, const float* mean,
                                 const float* rstd, ConstMatrix dout, Matrix dx, float* dgamma,
                                 float* dbeta) {
  const OpTimer timer(*this, "layernorm_backward");
  constexpr const char* kOp = "layernorm_backward";
  require_same(kOp, x, "x", dout, "dout");
  require_same(kOp, x, "x", dx, "dx");
  if (x.rows == 0) return;
  if (x.cols == 0) precondition_failed(kOp, "rows have no columns");
  dispatch_dtype(x.dtype, [&]<typename T>() {
    layernorm_backward_dx_kernel<T>
        <<<row_blocks(x.rows), row_threads(x.cols, sizeof(T), 256), 0, stream()>>>(
            typed<T>(x.data), typed<T>(gamma), mean, rstd, typed<T>(dout.data), typed<T>(dx.data),
            x.rows, x.cols);
    check_launch(kOp);
    // dgamma and dbeta are column sums over the rows: a second, column-parallel pass over x and
    // dout (rather than float atomics across row blocks) keeps their bits the same on every run.
    column_sums<T, true>(stream(), kOp, typed<T>(dout.data), typed<T>(x.data), mean, rstd, x.rows,
                         x.cols, dgamma, dbeta);
  });
}

void CudaOps::embedding_forward(const int32_t* tokens, int64_t seq, int64_t vocab, const void* wte,
                                const void* wpe, Matrix out) {
  const OpTimer timer(*this, "embedding_forward");
  constexpr const char* kOp = "embedding_forward";
  if (seq <= 0 || out.rows % seq != 0) {
    precondition_failed(
        kOp, std::to_string(out.rows) + " rows are not a multiple of seq " + std::to_string(seq));
  }
  require_int32(kOp, "the vocabulary size", vocab);
  require_contiguous(kOp, out, "out");
  if (out.size() == 0) return;
  dispatch_dtype(out.dtype, [&]<typename T>() {
    embedding_forward_kernel<T>
        <<<row_blocks(out.rows), row_threads(out.cols, sizeof(T), 256), 0, stream()>>>(
            tokens, seq, vocab, typed<T>(wte), typed<T>(wpe), typed<T>(out.data), out.rows,
            out.cols, device_errors());
  });
  check_launch(kOp);
}

// dwte: a stable device radix sort of (token, row) pairs (cub) groups each token's rows, in row
// order; one block per distinct token then walks its rows adding into its own dwte row. Every
// dwte element is owned by one thread and gets the CPU's additions in the CPU's order (bitwise
// the CPU's result), with no float atomics. The alternative of one thread per column walking
// all rows serialises 16384 dependent read-modify-writes per column; the sort costs a few tens
// of microseconds for 16384 tokens.
void CudaOps::embedding_backward(const int32_t* tokens, int64_t seq, ConstMatrix dout, float* dwte,
                                 float* dwpe) {
  const OpTimer timer(*this, "embedding_backward");
  constexpr const char* kOp = "embedding_backward";
  if (seq <= 0 || dout.rows % seq != 0) {
    precondition_failed(
        kOp, std::to_string(dout.rows) + " rows are not a multiple of seq " + std::to_string(seq));
  }
  require_int32(kOp, "the token count", dout.rows);
  require_contiguous(kOp, dout, "dout");
  if (dout.size() == 0) return;
  const int64_t n = dout.rows;
  const int64_t width = dout.cols;
  const int num_items = static_cast<int>(n);

  size_t sort_bytes = 0;
  check_cuda(
      cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, tokens, static_cast<int32_t*>(nullptr),
                                      static_cast<const int32_t*>(nullptr),
                                      static_cast<int32_t*>(nullptr), num_items, 0, 32, stream()),
      "embedding_backward: sizing the token sort");
  const size_t ints = round_up_256(static_cast<size_t>(n) * sizeof(int32_t));
  StreamScratch scratch(3 * ints + round_up_256(sort_bytes), stream(), kOp);
  auto* sorted_tokens = reinterpret_cast<int32_t*>(scratch.bytes());
  auto* rows_in = reinterpret_cast<int32_t*>(scratch.bytes() + ints);
  auto* order = reinterpret_cast<int32_t*>(scratch.bytes() + 2 * ints);
  void* sort_temp = scratch.bytes() + 3 * ints;

  iota_kernel<<<elementwise_blocks(n, 1), kElementwiseThreads, 0, stream()>>>(rows_in, n);
  check_launch("embedding_backward (row indices)");
  check_cuda(cub::DeviceRadixSort::SortPairs(sort_temp, sort_bytes, tokens, sorted_tokens, rows_in,
                                             order, num_items, 0, 32, stream()),
             "embedding_backward: sorting the tokens");
  dispatch_dtype(dout.dtype, [&]<typename T>() {
    embedding_backward_wte_kernel<T><<<row_blocks(n), column_threads(width), 0, stream()>>>(
        sorted_tokens, order, n, typed<T>(dout.data), width, dwte, device_errors());
    check_launch(kOp);
    const int64_t column_blocks = (width + kTotalThreads - 1) / kTotalThreads;
    const dim3 grid(static_cast<unsigned>(column_blocks),
                    static_cast<unsigned>(seq < 65535 ? seq : 65535));
    embedding_backward_wpe_kernel<T>
        <<<grid, kTotalThreads, 0, stream()>>>(typed<T>(dout.data), seq, n / seq, width, dwpe);
    check_launch("embedding_backward (positions)");
  });
  scratch.release(kOp);
}

}  // namespace dptrain::kernels
