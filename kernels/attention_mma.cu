// Causal attention on tensor cores with the scores in registers (DPTRAIN_ATTENTION=mma): the
// same flash-style algorithm, tiles and grids as attention_tc.cu (kTile x kTile tiles of one
// (sequence, head), one natural log-sum-exp per query row, the backward split into a dK/dV kernel
// per key tile and a dQ kernel per query tile so that every sum runs in a fixed order; rounded
// differently: base-2 exponentials of pre-scaled scores, so not bit for bit the same), written
// the way FlashAttention-2 is: PTX mma.sync m16n8k16 (16-bit inputs, f32 accumulators) fed by
// ldmatrix, the tiles brought in by cp.async one tile ahead of their use, and no round trip
// through shared memory between the products. The WMMA kernels store every score tile to an f32
// scratch and read it back for the softmax; here a product's accumulators are the next
// product's operand.
//
// Fragment layouts (PTX ISA, "mma.m16n8k16", 16-bit A/B, f32 C/D; g = lane / 4, t = lane % 4):
//   A [16][16] row-major, 4 registers of 2 elements: a0 (row g, cols 2t, 2t+1), a1 (row g + 8,
//     same cols), a2 (row g, cols 2t + 8, 2t + 9), a3 (row g + 8, cols 2t + 8, 2t + 9);
//   B [16][8] ("col": element (k, n) of B^T stored row-major), 2 registers: b0 (k 2t, 2t+1,
//     col g), b1 (k 2t + 8, 2t + 9, col g);
//   C/D [16][8]: c0, c1 (row g, cols 2t, 2t+1), c2, c3 (row g + 8, same cols).
// So the accumulators of two neighbouring 8-column blocks of a product, rounded to 16 bits and
// paired, are the A fragment of those 16 columns (as FlashAttention-2 feeds P to P V).
// ldmatrix .x4 loads four 8 x 8 matrices whose row addresses lanes 0-7, 8-15, 16-23 and 24-31
// give; lane l receives row l / 4, elements 2 (l % 4) and 2 (l % 4) + 1 of each (with .trans,
// column l / 4, rows 2 (l % 4) and 2 (l % 4) + 1: the transposed 8 x 8).
//
// A block has four warps; warp w owns the 16 tile rows [16 w, 16 w + 16) (queries in the forward
// and the dQ kernel, keys in the dK/dV kernel). Each thread holds rows g and g + 8 of its warp's
// rows. Tiles are staged in shared memory as [kTile][HD + 8] (rows 16 bytes longer than the
// head: ldmatrix's eight row addresses fall in distinct banks).
//
// Not yet run on a GPU (see README "GPUs"): opt-in until the GPU tests and the benchmark have
// passed with it; DPTRAIN_ATTENTION=auto keeps the WMMA kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kernels/attention.cuh"

namespace dptrain::kernels {
namespace {

constexpr int kMmaWarps = kTile / 16;
constexpr int kMmaThreads = kMmaWarps * 32;
constexpr int kKeyBlocks = kTile / 8;  // 8-column blocks of a [16][kTile] score product
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
static_assert(kTile % 16 == 0 && kMmaWarps * 16 == kTile && kMmaThreads >= 2 * kTile);

template <int HD>
constexpr int row_ld() {  // elements between rows of a staged tile
  return HD + 8;
}
template <int HD>
constexpr int tile_elems() {
  return kTile * row_ld<HD>();
}

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- Asynchronous copies global -> shared. A copy whose `valid` is false reads nothing and
// writes zeros (src-size 0); its source must still be a mapped address, so callers pass one.
__device__ __forceinline__ void copy16_async(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void copy4_async(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(dst)),
               "l"(__cvta_generic_to_global(src)), "r"(valid ? 4 : 0)
               : "memory");
}
__device__ __forceinline__ void commit_copies() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most `Pending` committed groups are still in flight.
template <int Pending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}

// Rows [row0, row0 + kTile) of one head's HD columns (src: the head's column 0 of row 0; rows
// ld elements apart) into dst [kTile][row_ld], 16 bytes a copy; rows at or past seq become 0.
// All threads of the block take part; the caller commits the group.
template <typename T, int HD>
__device__ __forceinline__ void stage_async(T* dst, const T* src, int64_t ld, int row0, int seq) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  constexpr int kPerRow = HD / kVec;
  for (int idx = static_cast<int>(threadIdx.x); idx < kTile * kPerRow; idx += kMmaThreads) {
    const int r = idx / kPerRow;
    const int c = idx % kPerRow * kVec;
    const int row = row0 + r;
    const bool valid = row < seq;
    copy16_async(dst + r * row_ld<HD>() + c, src + static_cast<int64_t>(valid ? row : 0) * ld + c,
                 valid);
  }
}

// ---- Fragments.
using FragA = uint32_t[4];
using Acc = float[4];

__device__ __forceinline__ void load_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p))
               : "memory");
}
__device__ __forceinline__ void load_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p))
               : "memory");
}

// d += a b for one m16n8k16 step.
template <typename T>
__device__ __forceinline__ void mma(Acc& d, const FragA& a, uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, "
        "{%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
}

// Two floats rounded to T and paired (lo in the low half: the lower column).
template <typename T>
__device__ __forceinline__ uint32_t pack(float lo, float hi) {
  uint32_t u;
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    memcpy(&u, &v, sizeof u);
  } else {
    const __half2 v = __floats2half2_rn(lo, hi);
    memcpy(&u, &v, sizeof u);
  }
  return u;
}

// Where a lane points ldmatrix within a 16 x 16 block of a row-major tile: for an A operand (and
// for a B operand read .trans: the blocks [k][n] of a [K][N] row-major B) matrices 0-3 are
// (rows 0-7, cols 0-7), (rows 8-15, cols 0-7), (rows 0-7, cols 8-15), (rows 8-15, cols 8-15);
// for a B operand stored as B^T ([N][K] row-major, read without .trans) they are (n 0-7, k 0-7),
// (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15, k 8-15): registers b0, b1 of the first 8 columns
// of the product, then b0, b1 of the next 8.
struct LaneOffsets {
  int a_row, a_col;    // A, and B .trans
  int bt_row, bt_col;  // B^T without .trans
  __device__ __forceinline__ explicit LaneOffsets(int lane)
      : a_row(lane % 8 + 8 * (lane / 8 % 2)),
        a_col(8 * (lane / 16)),
        bt_row(lane % 8 + 8 * (lane / 16)),
        bt_col(8 * (lane / 8 % 2)) {}
};

// acc[j] (8 blocks of 8 columns: a [16][kTile] tile) += A B^T over K = HD, where A is the
// warp's 16 rows of a staged tile (a: its row 0) and B^T is a whole staged tile (bt: [kTile][HD]).
template <typename T, int HD>
__device__ __forceinline__ void scores(Acc (&acc)[kKeyBlocks], const T* a, const T* bt,
                                       const LaneOffsets& lo) {
  constexpr int LD = row_ld<HD>();
#pragma unroll
  for (int kk = 0; kk < HD / 16; ++kk) {
    FragA fa;
    load_x4(fa, a + lo.a_row * LD + kk * 16 + lo.a_col);
#pragma unroll
    for (int np = 0; np < kKeyBlocks / 2; ++np) {
      uint32_t b[4];
      load_x4(b, bt + (np * 16 + lo.bt_row) * LD + kk * 16 + lo.bt_col);
      mma<T>(acc[2 * np], fa, b[0], b[1]);
      mma<T>(acc[2 * np + 1], fa, b[2], b[3]);
    }
  }
}

// acc[n] (HD / 8 blocks: a [16][HD] tile) += P B, where P [16][kTile] is in accumulators (p,
// rounded to T here) and B is a staged [kTile][HD] tile (b).
template <typename T, int HD>
__device__ __forceinline__ void accumulate(Acc (&acc)[HD / 8], const Acc (&p)[kKeyBlocks],
                                           const T* b, const LaneOffsets& lo) {
  constexpr int LD = row_ld<HD>();
#pragma unroll
  for (int kk = 0; kk < kTile / 16; ++kk) {
    const FragA fa = {pack<T>(p[2 * kk][0], p[2 * kk][1]), pack<T>(p[2 * kk][2], p[2 * kk][3]),
                      pack<T>(p[2 * kk + 1][0], p[2 * kk + 1][1]),
                      pack<T>(p[2 * kk + 1][2], p[2 * kk + 1][3])};
#pragma unroll
    for (int np = 0; np < HD / 16; ++np) {
      uint32_t r[4];
      load_x4_trans(r, b + (kk * 16 + lo.a_row) * LD + np * 16 + lo.a_col);
      mma<T>(acc[2 * np], fa, r[0], r[1]);
      mma<T>(acc[2 * np + 1], fa, r[2], r[3]);
    }
  }
}

template <int N>
__device__ __forceinline__ void zero(Acc (&acc)[N]) {
#pragma unroll
  for (int n = 0; n < N; ++n)
    acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.0f;
}

// The thread's two rows (r = 0: row g, r = 1: row g + 8) of a warp's [16][HD] accumulator tile
// times `factor`, into the first HD columns of sequence rows row0 + g (+ 8) of `dst` (the
// head's column 0 of the sequence's row 0; rows ld elements apart), rows at or past seq left.
template <typename T, int HD>
__device__ __forceinline__ void write_rows(T* dst, int64_t ld, int row0, int seq,
                                           const Acc (&acc)[HD / 8], const float (&factor)[2],
                                           int lane) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = row0 + lane / 4 + 8 * r;
    if (row >= seq) continue;
    T* d = dst + static_cast<int64_t>(row) * ld + 2 * (lane % 4);
#pragma unroll
    for (int n = 0; n < HD / 8; ++n)
      *reinterpret_cast<uint32_t*>(d + 8 * n) =
          pack<T>(acc[n][2 * r] * factor[r], acc[n][2 * r + 1] * factor[r]);
  }
}

// ---- Forward. Block (b * heads + h, tile y): query tile gridDim.y - 1 - y (the longest rows
// start first), key tiles 0 .. the diagonal with the online softmax (in base 2: the scores are
// scaled by scale * log2(e) so that exp2 does the exponentials).
template <typename T, int HD>
__global__ void __launch_bounds__(kMmaThreads)
    attention_forward_mma_kernel(const T* __restrict__ qkv, T* __restrict__ out,
                                 float* __restrict__ lse, int seq, int heads, float scale) {
  constexpr int kTileElems = tile_elems<HD>();
  extern __shared__ __align__(128) unsigned char mma_smem[];
  T* qs = reinterpret_cast<T*>(mma_smem);
  T* ks = qs + kTileElems;      // two buffers
  T* vs = ks + 2 * kTileElems;  // two buffers

  const HeadBlock<T, HD> hb(qkv, seq, heads);
  const int tile = static_cast<int>(gridDim.y - 1 - blockIdx.y);
  const int q0 = tile * kTile;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const LaneOffsets lo(lane);
  const T* qw = qs + warp * 16 * row_ld<HD>();
  const float scale2 = scale * kLog2e;

  stage_async<T, HD>(qs, hb.q, hb.ld, q0, seq);
  stage_async<T, HD>(ks, hb.k, hb.ld, 0, seq);
  stage_async<T, HD>(vs, hb.v, hb.ld, 0, seq);
  commit_copies();

  Acc o[HD / 8];
  zero(o);
  float m[2] = {-INFINITY, -INFINITY};  // running max of the row's base-2 scores
  float l[2] = {0.0f, 0.0f};            // this thread's part of the row's running sum

  for (int kt = 0; kt <= tile; ++kt) {
    const int buffer = kt % 2;
    if (kt < tile) {  // the next key tile, into the other buffer, while this one is used
      stage_async<T, HD>(ks + (buffer ^ 1) * kTileElems, hb.k, hb.ld, (kt + 1) * kTile, seq);
      stage_async<T, HD>(vs + (buffer ^ 1) * kTileElems, hb.v, hb.ld, (kt + 1) * kTile, seq);
      commit_copies();
      wait_copies<1>();
    } else {
      wait_copies<0>();
    }
    __syncthreads();
    const T* kb = ks + buffer * kTileElems;
    const T* vb = vs + buffer * kTileElems;

    Acc s[kKeyBlocks];
    zero(s);
    scores<T, HD>(s, qw, kb, lo);  // S = Q K^T

    if (kt == tile) {
      // The diagonal tile (the only one with keys past a row, or past seq): mask. Rows past seq
      // see the keys of row seq - 1 so that their arithmetic stays finite; they are not written.
#pragma unroll
      for (int j = 0; j < kKeyBlocks; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int query = min(q0 + warp * 16 + lane / 4 + 8 * (e / 2), seq - 1);
          const int key = kt * kTile + 8 * j + 2 * (lane % 4) + e % 2;
          if (key > query) s[j][e] = -INFINITY;
        }
    }

#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float top = -INFINITY;
#pragma unroll
      for (int j = 0; j < kKeyBlocks; ++j)
        top = fmaxf(top, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
      // The four lanes of a quad hold the row's 64 columns between them.
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 1));
      top = fmaxf(top, __shfl_xor_sync(0xffffffffu, top, 2));
      // Finite: every key tile visited holds key kt * kTile <= q0 <= the row (or seq - 1).
      const float m_new = fmaxf(m[r], top * scale2);
      const float alpha = exp2f(m[r] - m_new);  // 0 on the first tile (m = -inf)
      m[r] = m_new;
      float sum = 0.0f;
#pragma unroll
      for (int j = 0; j < kKeyBlocks; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const float p = exp2f(fmaf(s[j][2 * r + c], scale2, -m_new));
          s[j][2 * r + c] = p;
          sum += p;
        }
      l[r] = l[r] * alpha + sum;
#pragma unroll
      for (int n = 0; n < HD / 8; ++n) {
        o[n][2 * r] *= alpha;
        o[n][2 * r + 1] *= alpha;
      }
    }

    accumulate<T, HD>(o, s, vb, lo);  // O += P V
    __syncthreads();                  // this buffer is refilled two tiles on
  }

  float inv[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 1);
    l[r] += __shfl_xor_sync(0xffffffffu, l[r], 2);
    inv[r] = 1.0f / l[r];
    const int row = q0 + warp * 16 + lane / 4 + 8 * r;
    if (row < seq && lane % 4 == 0)
      lse[static_cast<int64_t>(hb.bh) * seq + row] = (m[r] + log2f(l[r])) * kLn2;
  }
  write_rows<T, HD>(hb.at(out, hb.width, 0), hb.width, q0 + warp * 16, seq, o, inv, lane);
}

// ---- Backward.

// Whether a thread's element e of 8-column block j of a [16][kTile] product (rows row0 + ...,
// columns col0 + ...) is a (query, key) pair the causal mask keeps; `rows_are_keys` for the
// dK/dV kernel's transposed products.
template <bool RowsAreKeys>
__device__ __forceinline__ bool kept(int row0, int col0, int j, int e, int lane, int seq) {
  const int row = row0 + lane / 4 + 8 * (e / 2);
  const int col = col0 + 8 * j + 2 * (lane % 4) + e % 2;
  const int query = RowsAreKeys ? col : row;
  const int key = RowsAreKeys ? row : col;
  return query < seq && key <= query;
}

// dK and dV of one key tile (block (b * heads + h, key tile y)), summed over the query tiles
// y, y + 1, ...: S^T = K Q^T, P^T = exp(S^T scale - lse), dV += P^T dO, dP^T = V dO^T,
// dS^T = P^T (dP^T - D), dK += scale dS^T Q. Warp rows are keys.
template <typename T, int HD>
__global__ void __launch_bounds__(kMmaThreads)
    attention_dkdv_mma_kernel(const T* __restrict__ qkv, const T* __restrict__ dout,
                              const float* __restrict__ lse, const float* __restrict__ delta,
                              T* __restrict__ dqkv, int seq, int heads, float scale) {
  constexpr int kTileElems = tile_elems<HD>();
  extern __shared__ __align__(128) unsigned char mma_smem[];
  T* ks = reinterpret_cast<T*>(mma_smem);
  T* vs = ks + kTileElems;
  T* qs = vs + kTileElems;                                       // two buffers
  T* dos = qs + 2 * kTileElems;                                  // two buffers
  auto* lse_s = reinterpret_cast<float*>(dos + 2 * kTileElems);  // two buffers
  float* delta_s = lse_s + 2 * kTile;                            // two buffers

  const HeadBlock<T, HD> hb(qkv, seq, heads);
  const int tiles = static_cast<int>(gridDim.y);
  const int kt = static_cast<int>(blockIdx.y);  // tile 0 has the most work: it starts first
  const int k0 = kt * kTile;
  const T* dO = hb.at(dout, hb.width, 0);
  const float* lse_bh = lse + static_cast<int64_t>(hb.bh) * seq;
  const float* delta_bh = delta + static_cast<int64_t>(hb.bh) * seq;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int tid = static_cast<int>(threadIdx.x);
  const LaneOffsets lo(lane);
  const float scale2 = scale * kLog2e;

  // Query tile qt's Q, dO, log-sum-exp and D into buffer `buffer` (one committed group).
  const auto stage_queries = [&](int qt, int buffer) {
    const int q0 = qt * kTile;
    stage_async<T, HD>(qs + buffer * kTileElems, hb.q, hb.ld, q0, seq);
    stage_async<T, HD>(dos + buffer * kTileElems, dO, hb.width, q0, seq);
    if (tid < 2 * kTile) {
      const int i = tid % kTile;
      const int row = q0 + i;
      const bool valid = row < seq;
      const float* src = tid < kTile ? lse_bh : delta_bh;
      float* dst = (tid < kTile ? lse_s : delta_s) + buffer * kTile;
      copy4_async(dst + i, src + (valid ? row : 0), valid);
    }
    commit_copies();
  };

  stage_async<T, HD>(ks, hb.k, hb.ld, k0, seq);
  stage_async<T, HD>(vs, hb.v, hb.ld, k0, seq);
  stage_queries(kt, 0);  // one group with K and V

  Acc dk[HD / 8], dv[HD / 8];
  zero(dk);
  zero(dv);
  const T* kw = ks + warp * 16 * row_ld<HD>();
  const T* vw = vs + warp * 16 * row_ld<HD>();

  for (int qt = kt; qt < tiles; ++qt) {
    const int buffer = (qt - kt) % 2;
    if (qt + 1 < tiles) {
      stage_queries(qt + 1, buffer ^ 1);
      wait_copies<1>();
    } else {
      wait_copies<0>();
    }
    __syncthreads();
    const T* qb = qs + buffer * kTileElems;
    const T* dob = dos + buffer * kTileElems;
    const float* lse_b = lse_s + buffer * kTile;
    const float* delta_b = delta_s + buffer * kTile;
    const int q0 = qt * kTile;

    Acc p[kKeyBlocks], ds[kKeyBlocks];
    zero(p);
    zero(ds);
    scores<T, HD>(p, kw, qb, lo);    // S^T = K Q^T
    scores<T, HD>(ds, vw, dob, lo);  // dP^T = V dO^T
    const bool edge = qt == kt || q0 + kTile > seq;
#pragma unroll
    for (int j = 0; j < kKeyBlocks; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = 8 * j + 2 * (lane % 4) + e % 2;  // the query within the tile
        const float pe = !edge || kept<true>(k0 + warp * 16, q0, j, e, lane, seq)
                             ? exp2f(fmaf(p[j][e], scale2, -lse_b[i] * kLog2e))
                             : 0.0f;
        p[j][e] = pe;
        ds[j][e] = pe * (ds[j][e] - delta_b[i]);
      }
    accumulate<T, HD>(dv, p, dob, lo);  // dV += P^T dO
    accumulate<T, HD>(dk, ds, qb, lo);  // dK += dS^T Q
    __syncthreads();                    // this buffer is refilled two tiles on
  }

  T* rows = hb.at(dqkv, hb.ld, 0);
  write_rows<T, HD>(rows + hb.width, hb.ld, k0 + warp * 16, seq, dk, {scale, scale}, lane);
  write_rows<T, HD>(rows + 2 * hb.width, hb.ld, k0 + warp * 16, seq, dv, {1.0f, 1.0f}, lane);
}

// dQ of one query tile (block (b * heads + h, tile y), query tile gridDim.y - 1 - y), summed
// over the key tiles up to the diagonal: S = Q K^T, dP = dO V^T, dS = P (dP - D),
// dQ += scale dS K. Warp rows are queries.
template <typename T, int HD>
__global__ void __launch_bounds__(kMmaThreads)
    attention_dq_mma_kernel(const T* __restrict__ qkv, const T* __restrict__ dout,
                            const float* __restrict__ lse, const float* __restrict__ delta,
                            T* __restrict__ dqkv, int seq, int heads, float scale) {
  constexpr int kTileElems = tile_elems<HD>();
  extern __shared__ __align__(128) unsigned char mma_smem[];
  T* qs = reinterpret_cast<T*>(mma_smem);
  T* dos = qs + kTileElems;
  T* ks = dos + kTileElems;     // two buffers
  T* vs = ks + 2 * kTileElems;  // two buffers

  const HeadBlock<T, HD> hb(qkv, seq, heads);
  const int tile = static_cast<int>(gridDim.y - 1 - blockIdx.y);
  const int q0 = tile * kTile;
  const int warp = static_cast<int>(threadIdx.x) / 32;
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const LaneOffsets lo(lane);
  const float scale2 = scale * kLog2e;

  stage_async<T, HD>(qs, hb.q, hb.ld, q0, seq);
  stage_async<T, HD>(dos, hb.at(dout, hb.width, 0), hb.width, q0, seq);
  stage_async<T, HD>(ks, hb.k, hb.ld, 0, seq);
  stage_async<T, HD>(vs, hb.v, hb.ld, 0, seq);
  commit_copies();

  // The thread's two rows' log-sum-exp (base 2) and D; rows past seq are masked out below.
  float lse2[2], row_delta[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int row = q0 + warp * 16 + lane / 4 + 8 * r;
    const int64_t at = static_cast<int64_t>(hb.bh) * seq + row;
    lse2[r] = row < seq ? lse[at] * kLog2e : 0.0f;
    row_delta[r] = row < seq ? delta[at] : 0.0f;
  }

  Acc dq[HD / 8];
  zero(dq);
  const T* qw = qs + warp * 16 * row_ld<HD>();
  const T* dow = dos + warp * 16 * row_ld<HD>();
  const bool last_rows = q0 + kTile > seq;

  for (int kt = 0; kt <= tile; ++kt) {
    const int buffer = kt % 2;
    if (kt < tile) {
      stage_async<T, HD>(ks + (buffer ^ 1) * kTileElems, hb.k, hb.ld, (kt + 1) * kTile, seq);
      stage_async<T, HD>(vs + (buffer ^ 1) * kTileElems, hb.v, hb.ld, (kt + 1) * kTile, seq);
      commit_copies();
      wait_copies<1>();
    } else {
      wait_copies<0>();
    }
    __syncthreads();
    const T* kb = ks + buffer * kTileElems;
    const T* vb = vs + buffer * kTileElems;

    Acc p[kKeyBlocks], ds[kKeyBlocks];
    zero(p);
    zero(ds);
    scores<T, HD>(p, qw, kb, lo);    // S = Q K^T
    scores<T, HD>(ds, dow, vb, lo);  // dP = dO V^T
    const bool edge = kt == tile || last_rows;
#pragma unroll
    for (int j = 0; j < kKeyBlocks; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int r = e / 2;
        const float pe = !edge || kept<false>(q0 + warp * 16, kt * kTile, j, e, lane, seq)
                             ? exp2f(fmaf(p[j][e], scale2, -lse2[r]))
                             : 0.0f;
        p[j][e] = pe;
        ds[j][e] = pe * (ds[j][e] - row_delta[r]);
      }
    accumulate<T, HD>(dq, ds, kb, lo);  // dQ += dS K
    __syncthreads();                    // this buffer is refilled two tiles on
  }

  write_rows<T, HD>(hb.at(dqkv, hb.ld, 0), hb.ld, q0 + warp * 16, seq, dq, {scale, scale}, lane);
}

template <typename T, int HD>
constexpr size_t forward_bytes() {  // Q, two K, two V
  return 5 * static_cast<size_t>(tile_elems<HD>()) * sizeof(T);
}
template <typename T, int HD>
constexpr size_t dkdv_bytes() {  // K, V, two Q, two dO, two lse, two D
  return 6 * static_cast<size_t>(tile_elems<HD>()) * sizeof(T) + 4 * kTile * sizeof(float);
}
template <typename T, int HD>
constexpr size_t dq_bytes() {  // Q, dO, two K, two V
  return 6 * static_cast<size_t>(tile_elems<HD>()) * sizeof(T);
}
static_assert(dkdv_bytes<__half, 128>() <= 227 * 1024, "over Hopper's shared memory per block");
// Every piece starts 16-byte aligned (cp.async, ldmatrix).
static_assert(tile_elems<32>() * sizeof(__half) % 16 == 0 &&
              tile_elems<64>() * sizeof(__half) % 16 == 0 &&
              tile_elems<128>() * sizeof(__half) % 16 == 0);

// The kernels above for T and HD, for the shared host side (attention.cuh).
template <typename T, int HD>
TcKernels<T> mma_kernels() {
  return {attention_forward_mma_kernel<T, HD>, forward_bytes<T, HD>(),
          attention_dkdv_mma_kernel<T, HD>,    dkdv_bytes<T, HD>(),
          attention_dq_mma_kernel<T, HD>,      dq_bytes<T, HD>()};
}

}  // namespace

void attention_forward_mma(cudaStream_t stream, ConstMatrix qkv, int64_t batch, int64_t seq,
                           int64_t heads, int64_t hd, Matrix out, float* lse) {
  launch_tc_forward(
      "mma", kMmaThreads, [&]<typename T, int HD>() { return mma_kernels<T, HD>(); }, stream, qkv,
      batch, seq, heads, hd, out, lse);
}

void attention_backward_mma(cudaStream_t stream, ConstMatrix qkv, const float* lse,
                            const float* delta, ConstMatrix dout, int64_t batch, int64_t seq,
                            int64_t heads, int64_t hd, Matrix dqkv) {
  launch_tc_backward(
      "mma", kMmaThreads, [&]<typename T, int HD>() { return mma_kernels<T, HD>(); }, stream, qkv,
      lse, delta, dout, batch, seq, heads, hd, dqkv);
}

}  // namespace dptrain::kernels
