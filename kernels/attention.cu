// Causal multi-head attention on the GPU, flash-attention style: the forward keeps one
// log-sum-exp per query row instead of the [seq, seq] probabilities, and the backward
// (FlashAttention-2's split) recomputes the probabilities tile by tile.
//
// Work is cut into square tiles of kTile query rows x kTile key rows of one (sequence, head).
// A block of kWarps warps owns one tile row of the output: warp w owns tile rows
// [w * kRows, (w + 1) * kRows); in score products lane l owns tile columns l and l + 32, in
// head-dimension sums lane l owns dimensions l, l + 32, ... . Tiles are staged in shared memory
// as f32 (loads convert from T), all math is f32 (SIMT FMAs), every sum runs in a fixed order:
// results are bit-identical from run to run (no atomics).
//
// Backward: a small kernel computes D_t = dout_t . out_t; one kernel per key tile accumulates dK
// and dV over the query tiles at or after it; one kernel per query tile accumulates dQ over the
// key tiles at or before it (recomputing P and dP: the price of a deterministic dQ without a
// [key tiles, seq, hd] scratch, which would be as large as the probabilities).
//
// These kernels are the f32 path, and for 16-bit inputs the fallback and reference of the
// tensor-core kernels (attention_tc.cu; DPTRAIN_ATTENTION=simt selects these). Not tuned: scalar
// shared-memory loads (no float4), f32 staging even for 16-bit inputs (hd 128 needs 165 KB of
// shared memory in the dK/dV kernel: one block per SM), fixed 64 x 64 tiles for every head size,
// and no split of long sequences across blocks.
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string>

#include "kernels/attention.cuh"

namespace dptrain::kernels {
namespace {

constexpr int kWarps = 8;              // warps of a block
constexpr int kThreads = kWarps * 32;  // threads of a block
constexpr int kRows = kTile / kWarps;  // tile rows a warp owns
constexpr int kCols = kTile / 32;      // tile columns a lane owns in score products
static_assert(kTile % kWarps == 0 && kTile % 32 == 0);

// ---- Device helpers.

// This thread's lane, and the first of the kRows tile rows its warp owns.
__device__ __forceinline__ int lane_index() {
  return static_cast<int>(threadIdx.x) % 32;
}
__device__ __forceinline__ int first_row() {
  return static_cast<int>(threadIdx.x) / 32 * kRows;
}

// Rows [row0, row0 + kTile) of one head's HD columns (src points at the head's column 0 of
// row 0; rows are ld elements apart) into dst [kTile][stride] as f32. Rows at or past seq read
// as 0, so tail tiles need no bounds checks in the products (the masks zero their
// probabilities). All threads of the block take part.
template <typename T, int HD>
__device__ __forceinline__ void load_tile(float* dst, int stride, const T* src, int64_t ld,
                                          int row0, int seq) {
  for (int idx = threadIdx.x; idx < kTile * HD; idx += kThreads) {
    const int r = idx / HD;
    const int d = idx % HD;
    const int row = row0 + r;
    dst[r * stride + d] = row < seq ? to_f32(src[static_cast<int64_t>(row) * ld + d]) : 0.0f;
  }
}

// acc = 0.
template <int N, int X>
__device__ __forceinline__ void zero(float (&acc)[N][kRows][X]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int r = 0; r < kRows; ++r)
#pragma unroll
      for (int x = 0; x < X; ++x)
        acc[n][r][x] = 0.0f;
}

// The warp's part of N matrix products acc[n] += A[n] B[n], summed over k = 0, 1, ..., K - 1 in
// order: acc[n][r][x] += a[n][(r0 + r) * a_row + k] * b[n][k * b_k + (lane + 32 x) * b_col]
// (r0 = first_row(), lane = lane_index(): passed in, computed once per kernel). The lanes read a
// by broadcast (the same address), b each at its own column. N > 1 interleaves independent
// products in one pass over k.
template <int K, int N, int X>
__device__ __forceinline__ void warp_products(float (&acc)[N][kRows][X], const float* const (&a)[N],
                                              int a_row, const float* const (&b)[N], int b_k,
                                              int b_col, int r0, int lane) {
#pragma unroll 4
  for (int k = 0; k < K; ++k) {
    float b_k_x[N][X];
#pragma unroll
    for (int x = 0; x < X; ++x)
#pragma unroll
      for (int n = 0; n < N; ++n)
        b_k_x[n][x] = b[n][k * b_k + (lane + 32 * x) * b_col];
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      float a_r_k[N];
#pragma unroll
      for (int n = 0; n < N; ++n)
        a_r_k[n] = a[n][(r0 + r) * a_row + k];
#pragma unroll
      for (int x = 0; x < X; ++x)
#pragma unroll
        for (int n = 0; n < N; ++n)
          acc[n][r][x] = fmaf(a_r_k[n], b_k_x[n][x], acc[n][r][x]);
    }
  }
}

// One tile pair of the backward, shared by the dK/dV kernel (kKeyRows: warp rows are keys, lane
// columns queries) and the dQ kernel (the transpose): S = A0 B0^T and dP = A1 B1^T (a[n]
// [kTile][HD] read by broadcast, b[n] [kTile][HD + 1] read per lane), then
// P = exp(S scale - lse), 0 where the causal mask removes the pair (as the forward normalized
// it), and dS = P (dP - D). Warp row r0 + r is sequence row row0 + r0 + r, lane column
// i = lane + 32 c is sequence row col0 + i; lse[x] and delta[x] belong to the pair's query
// (x = i with key rows, else r). dS goes to dss[(r0 + r) * kTile + i]; with key rows P also
// goes to ps (dV needs P^T dO), else ps is not used.
template <int HD, bool kKeyRows, typename Stats>
__device__ __forceinline__ void probability_grads(const float* const (&a)[2],
                                                  const float* const (&b)[2], const Stats& lse,
                                                  const Stats& delta, float scale, int row0,
                                                  int col0, int seq, float* ps, float* dss, int r0,
                                                  int lane) {
  float sdp[2][kRows][kCols];  // S, dP
  zero(sdp);
  warp_products<HD>(sdp, a, HD, b, 1, HD + 1, r0, lane);
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
#pragma unroll
    for (int c = 0; c < kCols; ++c) {
      const int i = lane + 32 * c;
      const int query = kKeyRows ? col0 + i : row0 + r0 + r;
      const int key = kKeyRows ? row0 + r0 + r : col0 + i;
      const int x = kKeyRows ? i : r;
      // Keys past seq get no query (query >= key >= seq fails query < seq).
      const float p = query < seq && key <= query ? expf(sdp[0][r][c] * scale - lse[x]) : 0.0f;
      if constexpr (kKeyRows) ps[(r0 + r) * kTile + i] = p;
      dss[(r0 + r) * kTile + i] = p * (sdp[1][r][c] - delta[x]);
    }
  }
}

// Writes the warp's rows of a backward result: sequence row row0 + r0 + r (none past seq) gets
// acc[n][r][x] * factor[n] at column lane + 32 x of part part0 + n of dqkv (0 dQ, 1 dK, 2 dV).
template <typename T, int HD, int N>
__device__ __forceinline__ void store_grads(const HeadBlock<T, HD>& hb, T* dqkv, int row0,
                                            int part0, const float (&acc)[N][kRows][HD / 32],
                                            const float (&factor)[N], int r0, int lane) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = row0 + r0 + r;
    if (row >= hb.seq) continue;
    T* g = hb.at(dqkv, hb.ld, row);
#pragma unroll
    for (int n = 0; n < N; ++n)
#pragma unroll
      for (int x = 0; x < HD / 32; ++x)
        g[(part0 + n) * hb.width + lane + 32 * x] = from_f32<T>(acc[n][r][x] * factor[n]);
  }
}

// Shared memory of each kernel, in floats. Arrays read with lane = row get a padded row
// stride (HD + 1, odd) so the 32 lanes hit 32 different banks.
template <int HD>
constexpr int forward_smem_floats() {
  return 2 * kTile * HD + kTile * (HD + 1) + kTile * kTile;
}
template <int HD>
constexpr int dkdv_smem_floats() {
  return 2 * kTile * HD + 2 * kTile * (HD + 1) + 2 * kTile * kTile + 2 * kTile;
}
template <int HD>
constexpr int dq_smem_floats() {
  return 2 * kTile * HD + 2 * kTile * (HD + 1) + kTile * kTile;
}

// ---- Forward. Block (b * heads + h, tile y): query tile gridDim.y - 1 - y (the longest rows
// start first), keys tile by tile up to the diagonal with the online softmax.
template <typename T, int HD>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(const T* __restrict__ qkv, T* __restrict__ out,
                             float* __restrict__ lse, int seq, int heads, float scale) {
  constexpr int kPad = HD + 1;
  constexpr int kDims = HD / 32;  // head dimensions a lane owns
  extern __shared__ float smem[];
  float* qs = smem;               // [kTile][HD]: read by broadcast
  float* ks = qs + kTile * HD;    // [kTile][kPad]: lane l reads key rows l, l + 32
  float* vs = ks + kTile * kPad;  // [kTile][HD]: lanes read consecutive columns
  float* ps = vs + kTile * HD;    // [kTile][kTile]: this key tile's p, one row per query

  const HeadBlock<T, HD> hb(qkv, seq, heads);
  const int tile = static_cast<int>(gridDim.y - 1 - blockIdx.y);
  const int q0 = tile * kTile;
  const int r0 = first_row();
  const int lane = lane_index();

  load_tile<T, HD>(qs, HD, hb.q, hb.ld, q0, seq);

  float m[kRows], l[kRows], acc[1][kRows][kDims];  // [1]: one product for warp_products
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
  }
  zero(acc);

  for (int kt = 0; kt <= tile; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // the previous key tile (ks, vs, ps) is no longer read
    load_tile<T, HD>(ks, kPad, hb.k, hb.ld, k0, seq);
    load_tile<T, HD>(vs, HD, hb.v, hb.ld, k0, seq);
    __syncthreads();

    float s[1][kRows][kCols];  // [1]: one product for warp_products
    zero(s);
    warp_products<HD>(s, {qs}, HD, {ks}, 1, kPad, r0, lane);  // S = Q K^T

#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      // Rows past seq are never written; they see the keys of row seq - 1 so that their
      // arithmetic stays finite.
      const int last = min(q0 + r0 + r, seq - 1);
      float tile_max = -INFINITY;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const int key = k0 + lane + 32 * c;
        s[0][r][c] = key <= last ? s[0][r][c] * scale : -INFINITY;
        tile_max = fmaxf(tile_max, s[0][r][c]);
      }
      // Finite: every key tile visited holds key k0 <= q0 <= last, so m_new is too, and
      // exp(m - m_new) is 0 on the first tile (m = -inf), never NaN.
      const float m_new = fmaxf(m[r], warp_max(tile_max));
      const float alpha = expf(m[r] - m_new);
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < kCols; ++c) {
        const float p = expf(s[0][r][c] - m_new);
        ps[(r0 + r) * kTile + lane + 32 * c] = p;
        sum += p;
      }
      l[r] = l[r] * alpha + warp_sum(sum);
      m[r] = m_new;
#pragma unroll
      for (int i = 0; i < kDims; ++i)
        acc[0][r][i] *= alpha;
    }
    __syncwarp();  // ps rows are written and read by their own warp only

    warp_products<kTile>(acc, {ps}, kTile, {vs}, HD, 1, r0, lane);  // acc += P V
  }

#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = q0 + r0 + r;
    if (row >= seq) continue;
    const float inv = 1.0f / l[r];
    T* o = hb.at(out, hb.width, row);
#pragma unroll
    for (int i = 0; i < kDims; ++i)
      o[lane + 32 * i] = from_f32<T>(acc[0][r][i] * inv);
    if (lane == 0) lse[static_cast<int64_t>(hb.bh) * seq + row] = m[r] + logf(l[r]);
  }
}

// ---- Backward.

// delta[(b * heads + h) * seq + t] = dout_t . out_t over head h's columns: one warp per
// (row, head).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    attention_delta_kernel(const T* __restrict__ out, const T* __restrict__ dout,
                           float* __restrict__ delta, int64_t rows, int seq, int heads, int hd) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  if (item >= rows * heads) return;  // the whole warp leaves: only warp shuffles follow
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t row = item / heads;
  const int h = static_cast<int>(item % heads);
  const int64_t offset = row * heads * hd + static_cast<int64_t>(h) * hd;
  float sum = 0.0f;
  for (int d = lane; d < hd; d += 32)
    sum = fmaf(to_f32(dout[offset + d]), to_f32(out[offset + d]), sum);
  sum = warp_sum(sum);
  const int64_t b = row / seq;
  const int64_t t = row % seq;
  if (lane == 0) delta[(b * heads + h) * seq + t] = sum;
}

// dK and dV of one key tile (block (b * heads + h, key tile y)), summed over the query tiles
// y, y + 1, ...: P = exp(S - lse), dV += P^T dO, dP = dO V^T, dS = P (dP - D),
// dK += scale dS^T Q. Warp rows are keys here, lane columns queries.
template <typename T, int HD>
__global__ void __launch_bounds__(kThreads)
    attention_dkdv_kernel(const T* __restrict__ qkv, const T* __restrict__ dout,
                          const float* __restrict__ lse, const float* __restrict__ delta,
                          T* __restrict__ dqkv, int seq, int heads, float scale) {
  constexpr int kPad = HD + 1;
  constexpr int kDims = HD / 32;
  extern __shared__ float smem[];
  float* ks = smem;                    // [kTile][HD]: read by broadcast
  float* vs = ks + kTile * HD;         // [kTile][HD]: read by broadcast
  float* qs = vs + kTile * HD;         // [kTile][kPad]: lane l reads query rows l, l + 32
  float* dos = qs + kTile * kPad;      // [kTile][kPad]: likewise
  float* ps = dos + kTile * kPad;      // [kTile keys][kTile queries]
  float* dss = ps + kTile * kTile;     // [kTile keys][kTile queries]
  float* lse_s = dss + kTile * kTile;  // [kTile]
  float* delta_s = lse_s + kTile;      // [kTile]

  const HeadBlock<T, HD> hb(qkv, seq, heads);
  const int tiles = static_cast<int>(gridDim.y);
  const int kt = static_cast<int>(blockIdx.y);  // tile 0 has the most work: it starts first
  const int k0 = kt * kTile;
  const T* dO = hb.at(dout, hb.width, 0);
  const float* lse_bh = lse + static_cast<int64_t>(hb.bh) * seq;
  const float* delta_bh = delta + static_cast<int64_t>(hb.bh) * seq;
  const int lane = lane_index();
  const int r0 = first_row();

  load_tile<T, HD>(ks, HD, hb.k, hb.ld, k0, seq);
  load_tile<T, HD>(vs, HD, hb.v, hb.ld, k0, seq);

  float dkv[2][kRows][kDims];  // dK, dV
  zero(dkv);

  for (int qt = kt; qt < tiles; ++qt) {
    const int q0 = qt * kTile;
    __syncthreads();  // the previous query tile is no longer read
    load_tile<T, HD>(qs, kPad, hb.q, hb.ld, q0, seq);
    load_tile<T, HD>(dos, kPad, dO, hb.width, q0, seq);
    for (int i = static_cast<int>(threadIdx.x); i < kTile; i += kThreads) {
      const int row = q0 + i;
      lse_s[i] = row < seq ? lse_bh[row] : 0.0f;
      delta_s[i] = row < seq ? delta_bh[row] : 0.0f;
    }
    __syncthreads();

    probability_grads<HD, true>({ks, vs}, {qs, dos}, lse_s, delta_s, scale, k0, q0, seq, ps, dss,
                                r0, lane);
    __syncwarp();  // ps and dss rows are written and read by their own warp only

    warp_products<kTile>(dkv, {dss, ps}, kTile, {qs, dos}, kPad, 1, r0, lane);  // dS^T Q, P^T dO
  }

  // dK = scale dS^T Q, dV = P^T dO as summed.
  store_grads(hb, dqkv, k0, 1, dkv, {scale, 1.0f}, r0, lane);
}

// dQ of one query tile (block (b * heads + h, tile y), query tile gridDim.y - 1 - y), summed
// over the key tiles up to the diagonal: dQ += scale dS K, with P and dP recomputed. Warp rows
// are queries, lane columns keys, as in the forward.
template <typename T, int HD>
__global__ void __launch_bounds__(kThreads)
    attention_dq_kernel(const T* __restrict__ qkv, const T* __restrict__ dout,
                        const float* __restrict__ lse, const float* __restrict__ delta,
                        T* __restrict__ dqkv, int seq, int heads, float scale) {
  constexpr int kPad = HD + 1;
  constexpr int kDims = HD / 32;
  extern __shared__ float smem[];
  float* qs = smem;                // [kTile][HD]: read by broadcast
  float* dos = qs + kTile * HD;    // [kTile][HD]: read by broadcast
  float* ks = dos + kTile * HD;    // [kTile][kPad]: lane l reads key rows l, l + 32, then columns
  float* vs = ks + kTile * kPad;   // [kTile][kPad]: lane l reads key rows l, l + 32
  float* dss = vs + kTile * kPad;  // [kTile queries][kTile keys]

  const HeadBlock<T, HD> hb(qkv, seq, heads);
  const int tile = static_cast<int>(gridDim.y - 1 - blockIdx.y);
  const int q0 = tile * kTile;
  const int lane = lane_index();
  const int r0 = first_row();

  load_tile<T, HD>(qs, HD, hb.q, hb.ld, q0, seq);
  load_tile<T, HD>(dos, HD, hb.at(dout, hb.width, 0), hb.width, q0, seq);

  float row_lse[kRows], row_delta[kRows], dq[1][kRows][kDims];  // dq[1]: one product
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int row = q0 + r0 + r;
    row_lse[r] = row < seq ? lse[static_cast<int64_t>(hb.bh) * seq + row] : 0.0f;
    row_delta[r] = row < seq ? delta[static_cast<int64_t>(hb.bh) * seq + row] : 0.0f;
  }
  zero(dq);

  for (int kt = 0; kt <= tile; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // the previous key tile is no longer read
    load_tile<T, HD>(ks, kPad, hb.k, hb.ld, k0, seq);
    load_tile<T, HD>(vs, kPad, hb.v, hb.ld, k0, seq);
    __syncthreads();

    probability_grads<HD, false>({qs, dos}, {ks, vs}, row_lse, row_delta, scale, q0, k0, seq,
                                 nullptr, dss, r0, lane);
    __syncwarp();  // dss rows are written and read by their own warp only

    warp_products<kTile>(dq, {dss}, kTile, {ks}, kPad, 1, r0, lane);  // dQ += dS K
  }

  store_grads(hb, dqkv, q0, 0, dq, {scale}, r0, lane);
}

// ---- Host side.

}  // namespace

int64_t check_attention(const char* op, ConstMatrix qkv, int64_t batch, int64_t seq, int64_t heads,
                        ConstMatrix out) {
  if (batch < 0 || seq < 0 || heads <= 0) {
    precondition_failed(op, "batch " + std::to_string(batch) + ", seq " + std::to_string(seq) +
                                ", heads " + std::to_string(heads) + " are not valid");
  }
  const int64_t width = out.cols;
  if (width <= 0 || width % heads != 0) {
    precondition_failed(op, "width " + std::to_string(width) +
                                " is not a positive multiple of heads " + std::to_string(heads));
  }
  if (qkv.cols != 3 * width || qkv.rows != batch * seq || out.rows != batch * seq) {
    precondition_failed(op, "qkv " + shape(qkv.rows, qkv.cols) + " and out " +
                                shape(out.rows, out.cols) + " do not fit batch " +
                                std::to_string(batch) + " x seq " + std::to_string(seq) +
                                " with width " + std::to_string(width));
  }
  if (qkv.dtype != out.dtype) {
    precondition_failed(op, std::string("qkv is ") + dtype_name(qkv.dtype) + " but out is " +
                                dtype_name(out.dtype));
  }
  require_contiguous(op, qkv, "qkv");
  require_contiguous(op, out, "out");
  const int64_t hd = width / heads;
  if (hd != 32 && hd != 64 && hd != 128) {
    precondition_failed(op, "head size " + std::to_string(hd) +
                                " is not supported (the kernels take 32, 64 or 128)");
  }
  if ((seq + kTile - 1) / kTile > kMaxTiles || batch * heads > INT32_MAX) {
    precondition_failed(op, "batch " + std::to_string(batch) + " x heads " + std::to_string(heads) +
                                " x seq " + std::to_string(seq) + " exceeds the kernels' grid");
  }
  return hd;
}

AttentionKernels attention_kernels(DType dtype, std::initializer_list<const void*> buffers) {
  const char* how = std::getenv("DPTRAIN_ATTENTION");
  const std::string choice = how == nullptr ? "auto" : how;
  if (choice == "simt") return AttentionKernels::simt;
  if (choice != "auto" && choice != "wmma" && choice != "mma") {
    precondition_failed("attention",
                        "DPTRAIN_ATTENTION=" + choice + ": use auto, simt, wmma or mma");
  }
  if (dtype == DType::f32) return AttentionKernels::simt;
  for (const void* p : buffers) {
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return AttentionKernels::simt;
  }
  return choice == "mma" ? AttentionKernels::mma : AttentionKernels::wmma;
}

size_t CudaOps::attention_state_floats(int64_t batch, int64_t seq, int64_t heads) const {
  // One log-sum-exp per (sequence, head, query row).
  return static_cast<size_t>(batch) * static_cast<size_t>(heads) * static_cast<size_t>(seq);
}

void CudaOps::attention_forward(ConstMatrix qkv, int64_t batch, int64_t seq, int64_t heads,
                                Matrix out, float* state) {
  const OpTimer timer(*this, "attention_forward");
  const int64_t hd = check_attention("attention_forward", qkv, batch, seq, heads, out);
  if (batch == 0 || seq == 0) return;
  switch (attention_kernels(qkv.dtype, {qkv.data, out.data})) {
    case AttentionKernels::wmma:
      attention_forward_tc(stream(), qkv, batch, seq, heads, hd, out, state);
      return;
    case AttentionKernels::mma:
      attention_forward_mma(stream(), qkv, batch, seq, heads, hd, out, state);
      return;
    case AttentionKernels::simt:
      break;
  }
  const dim3 grid = attention_grid(batch, seq, heads);
  dispatch_dtype(qkv.dtype, [&]<typename T>() {
    dispatch_head_size(hd, [&]<int HD>() {
      constexpr int floats = forward_smem_floats<HD>();
      allow_shared_memory(attention_forward_kernel<T, HD>, floats * sizeof(float),
                          "attention_forward: cudaFuncSetAttribute");
      attention_forward_kernel<T, HD><<<grid, kThreads, floats * sizeof(float), stream()>>>(
          static_cast<const T*>(qkv.data), static_cast<T*>(out.data), state, static_cast<int>(seq),
          static_cast<int>(heads), attention_scale(HD));
      check_launch("attention_forward_kernel");
    });
  });
}

void CudaOps::attention_backward(ConstMatrix qkv, ConstMatrix out, const float* state,
                                 ConstMatrix dout, int64_t batch, int64_t seq, int64_t heads,
                                 Matrix dqkv) {
  const OpTimer timer(*this, "attention_backward");
  const char* op = "attention_backward";
  const int64_t hd = check_attention(op, qkv, batch, seq, heads, out);
  if (dout.rows != out.rows || dout.cols != out.cols || dout.dtype != out.dtype) {
    precondition_failed(op, "dout " + shape(dout.rows, dout.cols) + " " + dtype_name(dout.dtype) +
                                " differs from out " + shape(out.rows, out.cols) + " " +
                                dtype_name(out.dtype));
  }
  if (dqkv.rows != qkv.rows || dqkv.cols != qkv.cols || dqkv.dtype != qkv.dtype) {
    precondition_failed(op, "dqkv " + shape(dqkv.rows, dqkv.cols) + " " + dtype_name(dqkv.dtype) +
                                " differs from qkv " + shape(qkv.rows, qkv.cols) + " " +
                                dtype_name(qkv.dtype));
  }
  require_contiguous(op, dout, "dout");
  require_contiguous(op, dqkv, "dqkv");
  if (batch == 0 || seq == 0) return;
  const int64_t rows = batch * seq;
  float* delta = static_cast<float*>(scratch(static_cast<size_t>(rows * heads) * sizeof(float)));
  const dim3 grid = attention_grid(batch, seq, heads);
  const auto delta_blocks = static_cast<unsigned>((rows * heads + kWarps - 1) / kWarps);
  dispatch_dtype(qkv.dtype, [&]<typename T>() {
    attention_delta_kernel<T><<<delta_blocks, kThreads, 0, stream()>>>(
        static_cast<const T*>(out.data), static_cast<const T*>(dout.data), delta, rows,
        static_cast<int>(seq), static_cast<int>(heads), static_cast<int>(hd));
    check_launch("attention_delta_kernel");
    switch (attention_kernels(qkv.dtype, {qkv.data, dout.data, dqkv.data})) {
      case AttentionKernels::wmma:
        attention_backward_tc(stream(), qkv, state, delta, dout, batch, seq, heads, hd, dqkv);
        return;
      case AttentionKernels::mma:
        attention_backward_mma(stream(), qkv, state, delta, dout, batch, seq, heads, hd, dqkv);
        return;
      case AttentionKernels::simt:
        break;
    }
    dispatch_head_size(hd, [&]<int HD>() {
      const auto* q = static_cast<const T*>(qkv.data);
      const auto* dy = static_cast<const T*>(dout.data);
      auto* g = static_cast<T*>(dqkv.data);
      const float scale = attention_scale(HD);
      // Both kernels take the same arguments and grid; each opts in to its shared memory.
      const auto launch = [&](auto* kernel, int floats, const char* attribute, const char* name) {
        allow_shared_memory(kernel, static_cast<size_t>(floats) * sizeof(float), attribute);
        kernel<<<grid, kThreads, static_cast<size_t>(floats) * sizeof(float), stream()>>>(
            q, dy, state, delta, g, static_cast<int>(seq), static_cast<int>(heads), scale);
        check_launch(name);
      };
      launch(attention_dkdv_kernel<T, HD>, dkdv_smem_floats<HD>(),
             "attention_backward: cudaFuncSetAttribute (dK, dV)", "attention_dkdv_kernel");
      launch(attention_dq_kernel<T, HD>, dq_smem_floats<HD>(),
             "attention_backward: cudaFuncSetAttribute (dQ)", "attention_dq_kernel");
    });
  });
}

}  // namespace dptrain::kernels
