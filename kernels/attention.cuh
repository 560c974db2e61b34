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

// A tensor-core implementation's three kernels for one 16-bit type and head size, with the
// dynamic shared memory each takes: what the host side below launches.
template <typename T>
struct TcKernels {
  void (*forward)(const T*, T*, float*, int, int, float);
  size_t forward_bytes;
  void (*dkdv)(const T*, const T*, const float*, const float*, T*, int, int, float);
  size_t dkdv_bytes;
  void (*dq)(const T*, const T*, const float*, const float*, T*, int, int, float);
  size_t dq_bytes;
};

// The host side both tensor-core implementations share. `pick` is a generic lambda:
// pick.template operator()<T, HD>() returns the TcKernels<T> for head size HD; `threads` is
// their block size and `variant` completes their names in errors ("tc":
// attention_forward_tc_kernel, "mma": attention_forward_mma_kernel, and so on).
template <typename Pick>
void launch_tc_forward(const char* variant, int threads, Pick&& pick, cudaStream_t stream,
                       ConstMatrix qkv, int64_t batch, int64_t seq, int64_t heads, int64_t hd,
                       Matrix out, float* lse) {
  const dim3 grid = attention_grid(batch, seq, heads);
  dispatch_16bit(qkv.dtype, [&]<typename T>() {
    dispatch_head_size(hd, [&]<int HD>() {
      const TcKernels<T> k = pick.template operator()<T, HD>();
      const std::string what = std::string("attention_forward_") + variant + "_kernel";
      allow_shared_memory(k.forward, k.forward_bytes, (what + ": cudaFuncSetAttribute").c_str());
      k.forward<<<grid, threads, k.forward_bytes, stream>>>(
          static_cast<const T*>(qkv.data), static_cast<T*>(out.data), lse, static_cast<int>(seq),
          static_cast<int>(heads), attention_scale(HD));
      check_launch(what.c_str());
    });
  });
}

// The backward's dK/dV kernel, then its dQ kernel (the same arguments and grid).
template <typename Pick>
void launch_tc_backward(const char* variant, int threads, Pick&& pick, cudaStream_t stream,
                        ConstMatrix qkv, const float* lse, const float* delta, ConstMatrix dout,
                        int64_t batch, int64_t seq, int64_t heads, int64_t hd, Matrix dqkv) {
  const dim3 grid = attention_grid(batch, seq, heads);
  dispatch_16bit(qkv.dtype, [&]<typename T>() {
    dispatch_head_size(hd, [&]<int HD>() {
      const TcKernels<T> k = pick.template operator()<T, HD>();
      const auto launch = [&](auto* kernel, size_t bytes, const char* part) {
        const std::string what = std::string("attention_") + part + "_" + variant + "_kernel";
        allow_shared_memory(kernel, bytes, (what + ": cudaFuncSetAttribute").c_str());
        kernel<<<grid, threads, bytes, stream>>>(static_cast<const T*>(qkv.data),
                                                 static_cast<const T*>(dout.data), lse, delta,
                                                 static_cast<T*>(dqkv.data), static_cast<int>(seq),
                                                 static_cast<int>(heads), attention_scale(HD));
        check_launch(what.c_str());
      };
      launch(k.dkdv, k.dkdv_bytes, "dkdv");
      launch(k.dq, k.dq_bytes, "dq");
    });
  });
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
