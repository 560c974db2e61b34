// Causal attention on tensor cores for bf16 and f16 inputs: the same flash-style algorithm and
// tiling as the SIMT kernels in attention.cu (kTile x kTile tiles of one (sequence, head), one
// log-sum-exp per query row, FlashAttention-2's backward split into a dK/dV kernel per key tile
// and a dQ kernel per query tile), with every product on tensor cores through WMMA (16 x 16 x 16
// fragments, 16-bit inputs, f32 accumulators).
//
// A block has kTcWarps warps; warp w owns the 16 tile rows [16 w, 16 w + 16) (queries in the
// forward and the dQ kernel, keys in the dK/dV kernel). Q, K, V and dO tiles are staged in
// shared memory in their own 16-bit type, rows padded by 8 elements (16 bytes) against bank
// conflicts. A warp's score tile (16 x 64) goes from its accumulators to a per-warp f32 scratch,
// where the lanes apply the mask and the softmax (lane l owns columns l and l + 32, as in the
// SIMT kernels), and the probabilities (or dS) go back to shared memory as 16-bit operands of
// the next product. The forward keeps its output rows in registers (lane l owns columns l,
// l + 32, ...) so that the online softmax can rescale them; the backward keeps dK, dV and dQ in
// accumulator fragments.
//
// Rounding: P and dS are rounded to the input type only as operands of their products (as
// FlashAttention does); the row sums add the f32 P, so the log-sum-exp state has f32 accuracy
// like the SIMT kernels' and the backward's recomputed P sums to 1. Every sum runs in a fixed
// order: results are bit-identical from run to run.
#include <mma.h>

#include <cstdint>

#include "kernels/attention.cuh"

namespace dptrain::kernels {
namespace {

namespace wmma = nvcuda::wmma;

constexpr int kM = 16;                // a fragment's edge
constexpr int kTcWarps = kTile / kM;  // one warp per 16 tile rows
constexpr int kTcThreads = kTcWarps * 32;
constexpr int kSub = kTile / kM;  // 16-wide sub-tiles across a tile
constexpr int kPld = kTile + 8;   // row stride of the 16-bit P / dS tiles (elements)
static_assert(kTile % kM == 0 && kTcWarps * kM == kTile);

// Row stride (elements) of a staged 16-bit [kTile][HD] tile, and of a warp's f32 scratch, which
// holds a [16][kTile] score tile or a [16][HD] result.
template <int HD>
constexpr int tile_ld() {
  return HD + 8;
}
template <int HD>
constexpr int scratch_ld() {
  return (HD > kTile ? HD : kTile) + 4;
}

template <typename T>
using FragA = wmma::fragment<wmma::matrix_a, kM, kM, kM, T, wmma::row_major>;
template <typename T, typename Layout>
using FragB = wmma::fragment<wmma::matrix_b, kM, kM, kM, T, Layout>;
using FragC = wmma::fragment<wmma::accumulator, kM, kM, kM, float>;

// Shared memory, carved in order; every piece starts 128-byte aligned (each size below is a
// multiple of 128 bytes for the head sizes 32, 64 and 128).
class Carve {
 public:
  explicit __device__ __forceinline__ Carve(unsigned char* base) : next_(base) {}
  template <typename U>
  __device__ __forceinline__ U* take(int count) {
    U* p = reinterpret_cast<U*>(next_);
    next_ += static_cast<size_t>(count) * sizeof(U);
    return p;
  }

 private:
  unsigned char* next_;
};

template <int HD, typename T>
constexpr size_t tile_bytes() {
  return static_cast<size_t>(kTile) * tile_ld<HD>() * sizeof(T);
}
template <int HD>
constexpr size_t scratch_bytes() {  // one f32 scratch for every warp
  return static_cast<size_t>(kTcWarps) * kM * scratch_ld<HD>() * sizeof(float);
}
template <typename T>
constexpr size_t operand_bytes() {  // one 16-bit [16][kTile] operand for every warp
  return static_cast<size_t>(kTcWarps) * kM * kPld * sizeof(T);
}
static_assert(scratch_bytes<32>() % 128 == 0 && scratch_bytes<64>() % 128 == 0 &&
              scratch_bytes<128>() % 128 == 0);
static_assert(operand_bytes<__half>() % 128 == 0);
static_assert(tile_bytes<32, __half>() % 128 == 0 && tile_bytes<64, __half>() % 128 == 0 &&
              tile_bytes<128, __half>() % 128 == 0);

template <typename T, int HD>
constexpr size_t forward_bytes() {  // Q, K, V, scratch, P
  return 3 * tile_bytes<HD, T>() + scratch_bytes<HD>() + operand_bytes<T>();
}
template <typename T, int HD>
constexpr size_t dkdv_bytes() {  // K, V, Q, dO, two scratches, P^T, dS^T, lse, delta
  return 4 * tile_bytes<HD, T>() + 2 * scratch_bytes<HD>() + 2 * operand_bytes<T>() +
         2 * kTile * sizeof(float);
}
template <typename T, int HD>
constexpr size_t dq_bytes() {  // Q, dO, K, V, two scratches, dS
  return 4 * tile_bytes<HD, T>() + 2 * scratch_bytes<HD>() + operand_bytes<T>();
}
static_assert(dkdv_bytes<__half, 128>() <= 227 * 1024, "over Hopper's shared memory per block");

// Rows [row0, row0 + kTile) of one head's HD columns (src: the head's column 0 of row 0; rows ld
// elements apart) into dst [kTile][tile_ld], 16 bytes at a time. Rows at or past seq read as 0.
// All threads of the block take part. The caller made sure src is 16-byte aligned (and HD, ld
// are multiples of 8).
template <typename T, int HD>
__device__ __forceinline__ void stage(T* dst, const T* src, int64_t ld, int row0, int seq) {
  constexpr int kVec = 16 / sizeof(T);
  constexpr int kPerRow = HD / kVec;
  for (int idx = static_cast<int>(threadIdx.x); idx < kTile * kPerRow; idx += kTcThreads) {
    const int r = idx / kPerRow;
    const int c = idx % kPerRow * kVec;
    const int row = row0 + r;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < seq) v = *reinterpret_cast<const uint4*>(src + static_cast<int64_t>(row) * ld + c);
    *reinterpret_cast<uint4*>(dst + r * tile_ld<HD>() + c) = v;
  }
}

// acc[n] (n < N) = the warp's 16 rows of A (a: [16][K] at row stride lda, row-major) times
// columns [16 n, 16 n + 16) of B^T, where B is [.][K] row-major at row stride ldb (b: its row 0):
// a [16][16 N] tile of A B^T, summed over K in order.
template <typename T, int K, int N>
__device__ __forceinline__ void products_abt(FragC (&acc)[N], const T* a, int lda, const T* b,
                                             int ldb) {
#pragma unroll
  for (int n = 0; n < N; ++n)
    wmma::fill_fragment(acc[n], 0.0f);
#pragma unroll
  for (int k = 0; k < K / kM; ++k) {
    FragA<T> fa;
    wmma::load_matrix_sync(fa, a + k * kM, lda);
#pragma unroll
    for (int n = 0; n < N; ++n) {
      // B^T's 16 x 16 block (k, n) is B's rows [16 n, 16 n + 16), columns [16 k, 16 k + 16),
      // read as a column-major matrix.
      FragB<T, wmma::col_major> fb;
      wmma::load_matrix_sync(fb, b + n * kM * ldb + k * kM, ldb);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

// acc[n] += A B[:, 16 n : 16 n + 16] for the warp's [16][kTile] operand A (a, row stride kPld)
// and B [kTile][.] row-major at row stride ldb (b: its row 0).
template <typename T, int N>
__device__ __forceinline__ void products_ab(FragC (&acc)[N], const T* a, const T* b, int ldb) {
#pragma unroll
  for (int k = 0; k < kSub; ++k) {
    FragA<T> fa;
    wmma::load_matrix_sync(fa, a + k * kM, kPld);
#pragma unroll
    for (int n = 0; n < N; ++n) {
      FragB<T, wmma::row_major> fb;
      wmma::load_matrix_sync(fb, b + k * kM * ldb + n * kM, ldb);
      wmma::mma_sync(acc[n], fa, fb, acc[n]);
    }
  }
}

template <int N>
__device__ __forceinline__ void store(float* scratch, int ld, const FragC (&acc)[N]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
    wmma::store_matrix_sync(scratch + n * kM, acc[n], ld, wmma::mem_row_major);
}

// Writes a warp's [16][HD] result from its scratch (row stride ld) times `factor` into part
// `part` of dqkv (0 dQ, 1 dK, 2 dV) at sequence rows row0 .. row0 + 15 (none past seq).
template <typename T, int HD>
__device__ __forceinline__ void write_part(const HeadBlock<T, HD>& hb, T* dqkv, int part, int row0,
                                           const float* scratch, int ld, float factor, int lane) {
#pragma unroll 4
  for (int r = 0; r < kM; ++r) {
    const int row = row0 + r;
    if (row >= hb.seq) break;
    T* g = hb.at(dqkv, hb.ld, row) + part * hb.width;
#pragma unroll
    for (int x = 0; x < HD / 32; ++x)
      g[lane + 32 * x] = from_f32<T>(scratch[r * ld + lane + 32 * x] * factor);
  }
}

// ---- Forward. Block (b * heads + h, tile y): query tile gridDim.y - 1 - y (the longest rows
// start first), key tiles up to the diagonal with the online softmax.
template <typename T, int HD>
__global__ void __launch_bounds__(kTcThreads)
    attention_forward_tc_kernel(const T* __restrict__ qkv, T* __restrict__ out,
                                float* __restrict__ lse, int seq, int heads, float scale) {
  constexpr int LD = tile_ld<HD>();
  constexpr int SLD = scratch_ld<HD>();
  constexpr int kDims = HD / 32;  // output columns a lane owns in each row
  extern __shared__ __align__(128) unsigned char tc_smem[];
  Carve carve(tc_smem);
  T* qs = carve.take<T>(kTile * LD);
  T* ks = carve.take<T>(kTile * LD);
  T* vs = carve.take<T>(kTile * LD);
  float* scratch = carve.take<float>(kTcWarps * kM * SLD);
  T* ps = carve.take<T>(kTcWarps * kM * kPld);

  const HeadBlock<T, HD> hb(qkv, seq, heads);
  const int tile = static_cast<int>(gridDim.y - 1 - blockIdx.y);
  const int q0 = tile * kTile;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int w0 = warp * kM;  // the warp's first tile row
  float* sw = scratch + warp * kM * SLD;
  T* pw = ps + warp * kM * kPld;

  stage<T, HD>(qs, hb.q, hb.ld, q0, seq);

  float m[kM], l[kM], o[kM][kDims];
#pragma unroll
  for (int r = 0; r < kM; ++r) {
    m[r] = -INFINITY;
    l[r] = 0.0f;
#pragma unroll
    for (int x = 0; x < kDims; ++x)
      o[r][x] = 0.0f;
  }

  for (int kt = 0; kt <= tile; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // the previous key tile (ks, vs) is no longer read
    stage<T, HD>(ks, hb.k, hb.ld, k0, seq);
    stage<T, HD>(vs, hb.v, hb.ld, k0, seq);
    __syncthreads();

    {
      FragC s[kSub];
      products_abt<T, HD, kSub>(s, qs + w0 * LD, LD, ks, LD);  // S = Q K^T
      store(sw, SLD, s);
    }
    __syncwarp();

#pragma unroll
    for (int r = 0; r < kM; ++r) {
      // Rows past seq are never written; they see the keys of row seq - 1 so that their
      // arithmetic stays finite.
      const int last = min(q0 + w0 + r, seq - 1);
      float sc[2];
      float tile_max = -INFINITY;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int key = k0 + lane + 32 * c;
        sc[c] = key <= last ? sw[r * SLD + lane + 32 * c] * scale : -INFINITY;
        tile_max = fmaxf(tile_max, sc[c]);
      }
      // Finite: every key tile visited holds key k0 <= q0 <= last, so m_new is too, and
      // exp(m - m_new) is 0 on the first tile (m = -inf), never NaN.
      const float m_new = fmaxf(m[r], warp_max(tile_max));
      const float alpha = expf(m[r] - m_new);
      float sum = 0.0f;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float p = expf(sc[c] - m_new);
        pw[r * kPld + lane + 32 * c] = from_f32<T>(p);
        sum += p;
      }
      l[r] = l[r] * alpha + warp_sum(sum);
      m[r] = m_new;
#pragma unroll
      for (int x = 0; x < kDims; ++x)
        o[r][x] *= alpha;
    }
    __syncwarp();  // pw is written, and sw read, by this warp only

    {
      FragC pv[HD / kM];
#pragma unroll
      for (int n = 0; n < HD / kM; ++n)
        wmma::fill_fragment(pv[n], 0.0f);
      products_ab<T, HD / kM>(pv, pw, vs, LD);  // P V
      store(sw, SLD, pv);
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < kM; ++r)
#pragma unroll
      for (int x = 0; x < kDims; ++x)
        o[r][x] += sw[r * SLD + lane + 32 * x];
  }

#pragma unroll
  for (int r = 0; r < kM; ++r) {
    const int row = q0 + w0 + r;
    if (row >= seq) break;
    const float inv = 1.0f / l[r];
    T* dst = hb.at(out, hb.width, row);
#pragma unroll
    for (int x = 0; x < kDims; ++x)
      dst[lane + 32 * x] = from_f32<T>(o[r][x] * inv);
    if (lane == 0) lse[static_cast<int64_t>(hb.bh) * seq + row] = m[r] + logf(l[r]);
  }
}

// ---- Backward.

// dK and dV of one key tile (block (b * heads + h, key tile y)), summed over the query tiles
// y, y + 1, ...: S^T = K Q^T, P^T = exp(S^T scale - lse), dV += P^T dO, dP^T = V dO^T,
// dS^T = P^T (dP^T - D), dK += scale dS^T Q. Warp rows are keys.
template <typename T, int HD>
__global__ void __launch_bounds__(kTcThreads)
    attention_dkdv_tc_kernel(const T* __restrict__ qkv, const T* __restrict__ dout,
                             const float* __restrict__ lse, const float* __restrict__ delta,
                             T* __restrict__ dqkv, int seq, int heads, float scale) {
  constexpr int LD = tile_ld<HD>();
  constexpr int SLD = scratch_ld<HD>();
  constexpr int kParts = HD / kM;
  extern __shared__ __align__(128) unsigned char tc_smem[];
  Carve carve(tc_smem);
  T* ks = carve.take<T>(kTile * LD);
  T* vs = carve.take<T>(kTile * LD);
  T* qs = carve.take<T>(kTile * LD);
  T* dos = carve.take<T>(kTile * LD);
  float* scratch_s = carve.take<float>(kTcWarps * kM * SLD);
  float* scratch_dp = carve.take<float>(kTcWarps * kM * SLD);
  T* pts = carve.take<T>(kTcWarps * kM * kPld);
  T* dsts = carve.take<T>(kTcWarps * kM * kPld);
  float* lse_s = carve.take<float>(kTile);
  float* delta_s = carve.take<float>(kTile);

  const HeadBlock<T, HD> hb(qkv, seq, heads);
  const int tiles = static_cast<int>(gridDim.y);
  const int kt = static_cast<int>(blockIdx.y);  // tile 0 has the most work: it starts first
  const int k0 = kt * kTile;
  const T* dO = hb.at(dout, hb.width, 0);
  const float* lse_bh = lse + static_cast<int64_t>(hb.bh) * seq;
  const float* delta_bh = delta + static_cast<int64_t>(hb.bh) * seq;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int w0 = warp * kM;
  float* sw = scratch_s + warp * kM * SLD;
  float* dpw = scratch_dp + warp * kM * SLD;
  T* ptw = pts + warp * kM * kPld;
  T* dstw = dsts + warp * kM * kPld;

  stage<T, HD>(ks, hb.k, hb.ld, k0, seq);
  stage<T, HD>(vs, hb.v, hb.ld, k0, seq);

  FragC dk[kParts], dv[kParts];
#pragma unroll
  for (int n = 0; n < kParts; ++n) {
    wmma::fill_fragment(dk[n], 0.0f);
    wmma::fill_fragment(dv[n], 0.0f);
  }

  for (int qt = kt; qt < tiles; ++qt) {
    const int q0 = qt * kTile;
    __syncthreads();  // the previous query tile is no longer read
    stage<T, HD>(qs, hb.q, hb.ld, q0, seq);
    stage<T, HD>(dos, dO, hb.width, q0, seq);
    for (int i = static_cast<int>(threadIdx.x); i < kTile; i += kTcThreads) {
      const int row = q0 + i;
      lse_s[i] = row < seq ? lse_bh[row] : 0.0f;
      delta_s[i] = row < seq ? delta_bh[row] : 0.0f;
    }
    __syncthreads();

    {
      FragC s[kSub];
      products_abt<T, HD, kSub>(s, ks + w0 * LD, LD, qs, LD);  // S^T = K Q^T
      store(sw, SLD, s);
      products_abt<T, HD, kSub>(s, vs + w0 * LD, LD, dos, LD);  // dP^T = V dO^T
      store(dpw, SLD, s);
    }
    __syncwarp();
#pragma unroll 4
    for (int r = 0; r < kM; ++r) {
      const int key = k0 + w0 + r;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int i = lane + 32 * c;
        const int query = q0 + i;
        // Keys past seq get no query (query >= key >= seq fails query < seq).
        const float p =
            query < seq && key <= query ? expf(sw[r * SLD + i] * scale - lse_s[i]) : 0.0f;
        ptw[r * kPld + i] = from_f32<T>(p);
        dstw[r * kPld + i] = from_f32<T>(p * (dpw[r * SLD + i] - delta_s[i]));
      }
    }
    __syncwarp();
    products_ab<T, kParts>(dv, ptw, dos, LD);  // dV += P^T dO
    products_ab<T, kParts>(dk, dstw, qs, LD);  // dK += dS^T Q
  }

  // dK = scale dS^T Q, dV = P^T dO as summed, through the warp's scratch.
  __syncwarp();
  store(sw, SLD, dk);
  __syncwarp();
  write_part(hb, dqkv, 1, k0 + w0, sw, SLD, scale, lane);
  __syncwarp();
  store(sw, SLD, dv);
  __syncwarp();
  write_part(hb, dqkv, 2, k0 + w0, sw, SLD, 1.0f, lane);
}

// dQ of one query tile (block (b * heads + h, tile y), query tile gridDim.y - 1 - y), summed
// over the key tiles up to the diagonal: S = Q K^T, dP = dO V^T, dS = P (dP - D),
// dQ += scale dS K. Warp rows are queries.
template <typename T, int HD>
__global__ void __launch_bounds__(kTcThreads)
    attention_dq_tc_kernel(const T* __restrict__ qkv, const T* __restrict__ dout,
                           const float* __restrict__ lse, const float* __restrict__ delta,
                           T* __restrict__ dqkv, int seq, int heads, float scale) {
  constexpr int LD = tile_ld<HD>();
  constexpr int SLD = scratch_ld<HD>();
  constexpr int kParts = HD / kM;
  extern __shared__ __align__(128) unsigned char tc_smem[];
  Carve carve(tc_smem);
  T* qs = carve.take<T>(kTile * LD);
  T* dos = carve.take<T>(kTile * LD);
  T* ks = carve.take<T>(kTile * LD);
  T* vs = carve.take<T>(kTile * LD);
  float* scratch_s = carve.take<float>(kTcWarps * kM * SLD);
  float* scratch_dp = carve.take<float>(kTcWarps * kM * SLD);
  T* dss = carve.take<T>(kTcWarps * kM * kPld);

  const HeadBlock<T, HD> hb(qkv, seq, heads);
  const int tile = static_cast<int>(gridDim.y - 1 - blockIdx.y);
  const int q0 = tile * kTile;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int w0 = warp * kM;
  float* sw = scratch_s + warp * kM * SLD;
  float* dpw = scratch_dp + warp * kM * SLD;
  T* dsw = dss + warp * kM * kPld;

  stage<T, HD>(qs, hb.q, hb.ld, q0, seq);
  stage<T, HD>(dos, hb.at(dout, hb.width, 0), hb.width, q0, seq);

  float row_lse[kM], row_delta[kM];
#pragma unroll
  for (int r = 0; r < kM; ++r) {
    const int row = q0 + w0 + r;
    row_lse[r] = row < seq ? lse[static_cast<int64_t>(hb.bh) * seq + row] : 0.0f;
    row_delta[r] = row < seq ? delta[static_cast<int64_t>(hb.bh) * seq + row] : 0.0f;
  }
  FragC dq[kParts];
#pragma unroll
  for (int n = 0; n < kParts; ++n)
    wmma::fill_fragment(dq[n], 0.0f);

  for (int kt = 0; kt <= tile; ++kt) {
    const int k0 = kt * kTile;
    __syncthreads();  // the previous key tile is no longer read
    stage<T, HD>(ks, hb.k, hb.ld, k0, seq);
    stage<T, HD>(vs, hb.v, hb.ld, k0, seq);
    __syncthreads();

    {
      FragC s[kSub];
      products_abt<T, HD, kSub>(s, qs + w0 * LD, LD, ks, LD);  // S = Q K^T
      store(sw, SLD, s);
      products_abt<T, HD, kSub>(s, dos + w0 * LD, LD, vs, LD);  // dP = dO V^T
      store(dpw, SLD, s);
    }
    __syncwarp();
#pragma unroll
    for (int r = 0; r < kM; ++r) {
      const int query = q0 + w0 + r;
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int i = lane + 32 * c;
        const int key = k0 + i;
        const float p =
            query < seq && key <= query ? expf(sw[r * SLD + i] * scale - row_lse[r]) : 0.0f;
        dsw[r * kPld + i] = from_f32<T>(p * (dpw[r * SLD + i] - row_delta[r]));
      }
    }
    __syncwarp();
    products_ab<T, kParts>(dq, dsw, ks, LD);  // dQ += dS K
  }

  __syncwarp();
  store(sw, SLD, dq);
  __syncwarp();
  write_part(hb, dqkv, 0, q0 + w0, sw, SLD, scale, lane);
}

// The kernels above for T and HD, for the shared host side (attention.cuh).
template <typename T, int HD>
TcKernels<T> tc_kernels() {
  return {attention_forward_tc_kernel<T, HD>, forward_bytes<T, HD>(),
          attention_dkdv_tc_kernel<T, HD>,    dkdv_bytes<T, HD>(),
          attention_dq_tc_kernel<T, HD>,      dq_bytes<T, HD>()};
}

}  // namespace

void attention_forward_tc(cudaStream_t stream, ConstMatrix qkv, int64_t batch, int64_t seq,
                          int64_t heads, int64_t hd, Matrix out, float* lse) {
  launch_tc_forward(
      "tc", kTcThreads, [&]<typename T, int HD>() { return tc_kernels<T, HD>(); }, stream, qkv,
      batch, seq, heads, hd, out, lse);
}

void attention_backward_tc(cudaStream_t stream, ConstMatrix qkv, const float* lse,
                           const float* delta, ConstMatrix dout, int64_t batch, int64_t seq,
                           int64_t heads, int64_t hd, Matrix dqkv) {
  launch_tc_backward(
      "tc", kTcThreads, [&]<typename T, int HD>() { return tc_kernels<T, HD>(); }, stream, qkv, lse,
      delta, dout, batch, seq, heads, hd, dqkv);
}

}  // namespace dptrain::kernels
