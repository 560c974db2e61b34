// What the three implementations of causal attention share: the SIMT kernels for every dtype
// (attention.cu, which also holds CudaOps' attention methods) and two tensor-core versions for
// 16-bit inputs (attention_tc.cu through WMMA, attention_mma.cu through mma.sync). All cut the work
// into kTile x kTile tiles of one (sequence, head), keep one log-sum-exp per query row, and sum in
// a fixed order (bit-identical runs).
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <string>

#include "kernels/cuda_ops_impl.cuh"

namespace dptrain::kernels {

constexpr int kTile = 64;         // query rows = key rows of a tile
constexpr int kMaxTiles = 65535;  // grid y limit: tiles per sequence

// The same total in every lane (butterfly order: deterministic).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2)
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Where block (b * heads + h, y) works: head h of sequence b, whose rows start at row b * seq
// of qkv, dout, out and dqkv, at column head.
template <typename T, int HD>
struct HeadBlock {
  int seq, bh, b, h;
  int width;     // heads * HD: columns of out and dout
  int64_t ld;    // 3 * width: columns of qkv and dqkv
  int64_t head;  // h * HD
  const T* q;    // the head's column 0 of the sequence's row 0 in qkv
  const T* k;
  const T* v;

  __device__ __forceinline__ HeadBlock(const T* qkv, int seq_len, int heads)
      : seq(seq_len),
        bh(static_cast<int>(blockIdx.x)),
        b(bh / heads),
        h(bh % heads),
        width(heads * HD),
        ld(3 * static_cast<int64_t>(width)),
        head(static_cast<int64_t>(h) * HD),
        q(qkv + static_cast<int64_t>(b) * seq * ld + head),
        k(q + width),
        v(q + 2 * width) {}

  // The head's column 0 of the sequence's row `row` in a matrix with `columns` columns.
  template <typename U>
  __device__ __forceinline__ U* at(U* matrix, int64_t columns, int row) const {
    return matrix + (static_cast<int64_t>(b) * seq + row) * columns + head;
  }
};

// ---- Host side.

inline std::string shape(int64_t rows, int64_t cols) {
  return "[" + std::to_string(rows) + ", " + std::to_string(cols) + "]";
}

// Checks what both passes share and returns the head size (32, 64 or 128).
int64_t check_attention(const char* op, ConstMatrix qkv, int64_t batch, int64_t seq, int64_t heads,
                        ConstMatrix out);

// Calls f.template operator()<HD>() for a head size check_attention accepted.
template <typename F>
void dispatch_head_size(int64_t hd, F&& f) {
  switch (hd) {
    case 32:
      f.template operator()<32>();
      return;
    case 64:
      f.template operator()<64>();
      return;
    case 128:
      f.template operator()<128>();
      return;
    default:
      precondition_failed("attention", "head size " + std::to_string(hd) + " is not supported");
  }
}

// Calls f.template operator()<T>() with T the CUDA type of a 16-bit dtype (the tensor-core
// kernels' inputs).
template <typename F>
void dispatch_16bit(DType dtype, F&& f) {
  if (dtype == DType::bf16) {
    f.template operator()<__nv_bfloat16>();
  } else if (dtype == DType::f16) {
    f.template operator()<__half>();
  } else {
    precondition_failed("attention (tensor cores)", "takes bf16 or f16 only");
  }
}

// Every implementation's grid: block (b * heads + h, y) for tile y of one (sequence, head).
inline dim3 attention_grid(int64_t batch, int64_t seq, int64_t heads) {
  return dim3(static_cast<unsigned>(batch * heads),
              static_cast<unsigned>((seq + kTile - 1) / kTile));
}

// Kernels over 48 KB of dynamic shared memory must opt in, per kernel.
template <typename Kernel>
void allow_shared_memory(Kernel* kernel, size_t bytes, const char* name) {
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                  static_cast<int>(bytes)),
             name);
}

inline float attention_scale(int64_t hd) {
  return 1.0f / std::sqrt(static_cast<float>(hd));
}

// Which kernels compute a call. DPTRAIN_ATTENTION picks: "auto" (or unset) the WMMA kernels
// for 16-bit inputs, "wmma" the same, "mma" the register-resident mma.sync kernels
// (attention_mma.cu: opt-in until they have run on a GPU), "simt" the f32-math kernels (the
// fallback, and the reference the GPU tests compare with). f32 inputs, and 16-bit inputs with a
// buffer not 16-byte aligned, always take the SIMT kernels.
enum class AttentionKernels { simt, wmma, mma };
AttentionKernels attention_kernels(DType dtype, std::initializer_list<const void*> buffers);

// attention_tc.cu. The forward writes out and the log-sum-exp of every query row (lse); the
// backward needs the forward's lse and delta (dout . out per row and head, from the SIMT
// delta kernel) and writes all of dqkv. Preconditions are the callers' (check_attention).
void attention_forward_tc(cudaStream_t stream, ConstMatrix qkv, int64_t batch, int64_t seq,
                          int64_t heads, int64_t hd, Matrix out, float* lse);
void attention_backward_tc(cudaStream_t stream, ConstMatrix qkv, const float* lse,
                           const float* delta, ConstMatrix dout, int64_t batch, int64_t seq,
                           int64_t heads, int64_t hd, Matrix dqkv);

// attention_mma.cu: the same contract as the two above.
void attention_forward_mma(cudaStream_t stream, ConstMatrix qkv, int64_t batch, int64_t seq,
                           int64_t heads, int64_t hd, Matrix out, float* lse);
void attention_backward_mma(cudaStream_t stream, ConstMatrix qkv, const float* lse,
                            const float* delta, ConstMatrix dout, int64_t batch, int64_t seq,
                            int64_t heads, int64_t hd, Matrix dqkv);

}  // namespace dptrain::kernels
