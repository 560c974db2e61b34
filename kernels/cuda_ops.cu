// The CUDA op table's core: device handles, memory, casts, gemm/linear through cuBLASLt, flat
// f32 buffer ops (axpy, scale, a deterministic sum of squares) and the fused optimizer updates.
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>

#include "core/dynamic_library.hpp"
#include "kernels/cuda_ops_impl.cuh"

namespace dptrain::kernels {

namespace {

// ---- cuBLASLt, loaded on first use.

// The cuBLASLt entry points dptrain uses. Linked, the library (about 500 MB) would be loaded and
// initialised by every process at start (half a second and 200 MB of memory), CPU ranks and
// `dptrain --version` included, and the binary would not start where it is not installed. Loaded
// here, only a process that makes a CUDA op table pays for it.
struct CublasLt {
  decltype(&cublasLtCreate) create = nullptr;
  decltype(&cublasLtDestroy) destroy = nullptr;
  decltype(&cublasLtGetStatusName) get_status_name = nullptr;
  decltype(&cublasLtGetStatusString) get_status_string = nullptr;
  decltype(&cublasLtMatmul) matmul = nullptr;
  decltype(&cublasLtMatmulAlgoGetHeuristic) matmul_algo_get_heuristic = nullptr;
  decltype(&cublasLtMatmulDescCreate) matmul_desc_create = nullptr;
  decltype(&cublasLtMatmulDescDestroy) matmul_desc_destroy = nullptr;
  decltype(&cublasLtMatmulDescSetAttribute) matmul_desc_set_attribute = nullptr;
  decltype(&cublasLtMatmulPreferenceCreate) matmul_preference_create = nullptr;
  decltype(&cublasLtMatmulPreferenceDestroy) matmul_preference_destroy = nullptr;
  decltype(&cublasLtMatmulPreferenceSetAttribute) matmul_preference_set_attribute = nullptr;
  decltype(&cublasLtMatrixLayoutCreate) matrix_layout_create = nullptr;
  decltype(&cublasLtMatrixLayoutDestroy) matrix_layout_destroy = nullptr;
};

const CublasLt& cublaslt() {
  static const CublasLt api = [] {
    DynamicLibrary library("libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR));
    CublasLt loaded;
    library.bind("cublasLtCreate", loaded.create);
    library.bind("cublasLtDestroy", loaded.destroy);
    library.bind("cublasLtGetStatusName", loaded.get_status_name);
    library.bind("cublasLtGetStatusString", loaded.get_status_string);
    library.bind("cublasLtMatmul", loaded.matmul);
    library.bind("cublasLtMatmulAlgoGetHeuristic", loaded.matmul_algo_get_heuristic);
    library.bind("cublasLtMatmulDescCreate", loaded.matmul_desc_create);
    library.bind("cublasLtMatmulDescDestroy", loaded.matmul_desc_destroy);
    library.bind("cublasLtMatmulDescSetAttribute", loaded.matmul_desc_set_attribute);
    library.bind("cublasLtMatmulPreferenceCreate", loaded.matmul_preference_create);
    library.bind("cublasLtMatmulPreferenceDestroy", loaded.matmul_preference_destroy);
    library.bind("cublasLtMatmulPreferenceSetAttribute", loaded.matmul_preference_set_attribute);
    library.bind("cublasLtMatrixLayoutCreate", loaded.matrix_layout_create);
    library.bind("cublasLtMatrixLayoutDestroy", loaded.matrix_layout_destroy);
    if (const std::string problem = library.problem(); !problem.empty()) {
      throw Error(ErrorKind::cuda,
                  problem + " (cuBLASLt " + std::to_string(CUBLAS_VER_MAJOR) +
                      ", from the CUDA toolkit or a PyTorch wheel's nvidia-cublas, on "
                      "LD_LIBRARY_PATH or in the loader's cache)");
    }
    return loaded;
  }();
  return api;
}

}  // namespace

namespace {

constexpr int kThreads = 256;
// Grid-stride kernels need no more blocks than keep every SM busy; the cap keeps the grid legal
// for any n.
constexpr int64_t kMaxBlocks = 8192;
// sum_squares: at most this many partial sums (one per block), summed by one block.
constexpr int kReduceThreads = 256;
constexpr int kReduceBlocks = 1024;
static_assert(kReduceBlocks + 1 <= static_cast<int>(CudaOps::kReduceSlots),
              "sum_squares keeps its partial sums and the total in reduce_scratch()");
static_assert(sizeof(DeviceErrors) <= CudaOps::kPinnedBytes &&
                  sizeof(double) <= CudaOps::kPinnedBytes,
              "results come back to the host through pinned()");

unsigned grid_for(int64_t n) {
  return static_cast<unsigned>(std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks));
}

std::string device_label(int device) {
  return "cuda:" + std::to_string(device);
}

// ---- Kernels.

template <typename From, typename To>
__global__ void cast_kernel(const From* __restrict__ src, To* __restrict__ dst, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    dst[i] = from_f32<To>(to_f32(src[i]));
  }
}

// x *= alpha for a matrix of any dtype (gemm with an empty inner dimension: c = beta * c).
template <typename T>
__global__ void scale_elements_kernel(T* x, int64_t n, float alpha) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = from_f32<T>(to_f32(x[i]) * alpha);
  }
}

// The flat-buffer kernels round every operation separately (__fmul_rn, __fadd_rn: no fused
// multiply-add contraction), in the CPU code's order, so they give the CPU's bits.
__global__ void axpy_kernel(int64_t n, float alpha, const float* __restrict__ x,
                            float* __restrict__ y) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = __fadd_rn(y[i], __fmul_rn(alpha, x[i]));
  }
}

__global__ void scale_kernel(int64_t n, float alpha, float* x) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    x[i] = __fmul_rn(x[i], alpha);
  }
}

// Sums s[0, blockDim.x) into s[0] in a fixed tree order (blockDim.x a power of two).
__device__ void tree_sum(double* s) {
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) s[threadIdx.x] += s[threadIdx.x + stride];
    __syncthreads();
  }
}

// Pass 1: block b sums the squares of its grid-stride share into partial[b]. Which thread reads
// which element depends on n and the grid only, never on timing, so the sum is deterministic.
// A float's square is exact in double; inf and NaN propagate through the additions.
__global__ void sum_squares_partial_kernel(const float* __restrict__ x, int64_t n,
                                           double* __restrict__ partial) {
  __shared__ double s[kReduceThreads];
  double acc = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const double v = x[i];
    acc += v * v;
  }
  s[threadIdx.x] = acc;
  __syncthreads();
  tree_sum(s);
  if (threadIdx.x == 0) partial[blockIdx.x] = s[0];
}

// Pass 2 (one block): partial[0, count) summed in a fixed order into *total.
__global__ void sum_partials_kernel(const double* __restrict__ partial, int count,
                                    double* __restrict__ total) {
  __shared__ double s[kReduceThreads];
  double acc = 0;
  for (int i = static_cast<int>(threadIdx.x); i < count; i += static_cast<int>(blockDim.x))
    acc += partial[i];
  s[threadIdx.x] = acc;
  __syncthreads();
  tree_sum(s);
  if (threadIdx.x == 0) *total = s[0];
}

// ops.hpp's AdamW, term by term as core/optim/optimizer.cpp computes it (sqrt correctly rounded).
__global__ void adamw_kernel(float* __restrict__ params, const float* __restrict__ grads,
                             float* __restrict__ m, float* __restrict__ v, int64_t n,
                             AdamWCoefficients k) {
  const float one_minus_b1 = __fsub_rn(1.0f, k.b1);
  const float one_minus_b2 = __fsub_rn(1.0f, k.b2);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = grads[i];
    const float mi = __fadd_rn(__fmul_rn(k.b1, m[i]), __fmul_rn(one_minus_b1, g));
    const float vi = __fadd_rn(__fmul_rn(k.b2, v[i]), __fmul_rn(__fmul_rn(one_minus_b2, g), g));
    m[i] = mi;
    v[i] = vi;
    const float denom = __fadd_rn(__fmul_rn(__fsqrt_rn(vi), k.inv_sqrt_bc2), k.eps);
    params[i] =
        __fsub_rn(__fmul_rn(params[i], k.decay), __fdiv_rn(__fmul_rn(k.step_size, mi), denom));
  }
}

// v = momentum v + g; p = p * decay - rate * (nesterov ? g + momentum v : v).
__global__ void sgd_kernel(float* __restrict__ params, const float* __restrict__ grads,
                           float* __restrict__ velocity, int64_t n, float momentum, float decay,
                           float rate, bool nesterov) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float g = grads[i];
    const float vi = __fadd_rn(__fmul_rn(momentum, velocity[i]), g);
    velocity[i] = vi;
    const float step = nesterov ? __fadd_rn(g, __fmul_rn(momentum, vi)) : vi;
    params[i] = __fsub_rn(__fmul_rn(params[i], decay), __fmul_rn(rate, step));
  }
}

// ---- Resources.

// Frees what CudaOps holds (its destructor, or a constructor that failed half way). Never throws:
// errors here cannot be acted on, and an earlier one was already reported.
void release_resources(cudaStream_t& stream, cublasLtHandle_t& lt, void*& workspace,
                       DeviceErrors*& errors, double*& reduce, void*& pinned, void*& scratch) {
  if (stream != nullptr) cudaStreamSynchronize(stream);
  if (scratch != nullptr) cudaFree(scratch);
  if (reduce != nullptr) cudaFree(reduce);
  if (errors != nullptr) cudaFree(errors);
  if (workspace != nullptr) cudaFree(workspace);
  if (pinned != nullptr) cudaFreeHost(pinned);
  if (lt != nullptr) cublaslt().destroy(lt);
  if (stream != nullptr) cudaStreamDestroy(stream);
  scratch = reduce = nullptr;
  errors = nullptr;
  workspace = pinned = nullptr;
  lt = nullptr;
  stream = nullptr;
  cudaGetLastError();  // nothing sticky from the cleanup leaks into a later check
}

void free_device(void* data) {
  cudaFree(data);
}

// ---- cuBLASLt.

cudaDataType_t cuda_type(DType dtype) {
  switch (dtype) {
    case DType::f32:
      return CUDA_R_32F;
    case DType::bf16:
      return CUDA_R_16BF;
    case DType::f16:
      return CUDA_R_16F;
  }
  return CUDA_R_32F;
}

// The largest power of two (at most 256, what cuBLASLt assumes by default) dividing the address:
// the heuristic must only pick kernels that can load from it.
uint32_t alignment(const void* p) {
  const auto address = reinterpret_cast<uintptr_t>(p);
  if (address == 0) return 256;
  return static_cast<uint32_t>(std::min<uintptr_t>(address & (~address + 1), 256));
}

// op(a) [m, k] x op(b) [k, n] = c [m, n], row-major, with the shapes checked.
struct GemmShape {
  int64_t m, n, k;
};

GemmShape gemm_shape(const char* what, ConstMatrix a, Transpose transpose_a, ConstMatrix b,
                     Transpose transpose_b, Matrix c) {
  if (a.dtype != b.dtype) {
    precondition_failed(
        what, std::string("a is ") + dtype_name(a.dtype) + " but b is " + dtype_name(b.dtype));
  }
  if (c.dtype != a.dtype && c.dtype != DType::f32) {
    precondition_failed(what, std::string("c is ") + dtype_name(c.dtype) + " for " +
                                  dtype_name(a.dtype) + " inputs (expected " + dtype_name(a.dtype) +
                                  " or f32)");
  }
  if (a.rows < 0 || a.cols < 0 || b.rows < 0 || b.cols < 0 || c.rows < 0 || c.cols < 0) {
    precondition_failed(what, "a, b and c need sizes of at least 0");
  }
  require_stride(what, a, "a");
  require_stride(what, b, "b");
  require_stride(what, c, "c");
  const bool ta = transpose_a == Transpose::yes, tb = transpose_b == Transpose::yes;
  const GemmShape s{ta ? a.cols : a.rows, tb ? b.rows : b.cols, ta ? a.rows : a.cols};
  const int64_t kb = tb ? b.cols : b.rows;
  if (kb != s.k || c.rows != s.m || c.cols != s.n) {
    precondition_failed(what, "op(a) is [" + std::to_string(s.m) + ", " + std::to_string(s.k) +
                                  "], op(b) [" + std::to_string(kb) + ", " + std::to_string(s.n) +
                                  "], c [" + std::to_string(c.rows) + ", " +
                                  std::to_string(c.cols) + "]");
  }
  return s;
}

// What cuBLASLt does with a product on its way out (in row-major terms, c = op(a) op(b)):
// nothing; BIAS adds `vector` to every row of c; BGRADB writes the sums of op(a)'s rows over k
// into `vector` (dy's column sums when op(a) = dy^T: a linear layer's bias gradient, see
// linear_weight_grad); DGELU multiplies the product by gelu'(aux), aux a matrix of c's shape whose
// rows are aux_ld elements apart; GELU_AUX_BIAS adds the bias `vector`, writes that to aux
// (written, not read) and its GELU to c. `vector` and aux have c's dtype.
struct Epilogue {
  cublasLtEpilogue_t kind = CUBLASLT_EPILOGUE_DEFAULT;
  const void* vector = nullptr;
  const void* aux = nullptr;
  int64_t aux_ld = 0;
};

// What a plan depends on. The layouts follow from the shape and transposes; the alignments
// (and the epilogue's pointers') decide which kernels the heuristic may choose.
struct MatmulKey {
  int64_t m = 0, n = 0, k = 0;
  int64_t lda = 0, ldb = 0, ldc = 0;  // row strides (padded rows change the kernels that fit)
  int64_t aux_ld = 0;
  int32_t transpose_a = 0, transpose_b = 0;
  int32_t ab_type = 0, c_type = 0;
  int32_t epilogue = 0;
  uint32_t align_a = 0, align_b = 0, align_c = 0;
  uint32_t align_vector = 0, align_aux = 0;  // 0: no such pointer
  bool operator==(const MatmulKey&) const = default;
};

struct MatmulKeyHash {
  size_t operator()(const MatmulKey& key) const {
    size_t h = 0;
    const auto mix = [&h](uint64_t v) {
      h ^= std::hash<uint64_t>{}(v) + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
    };
    mix(static_cast<uint64_t>(key.m));
    mix(static_cast<uint64_t>(key.n));
    mix(static_cast<uint64_t>(key.k));
    mix(static_cast<uint64_t>(key.lda));
    mix(static_cast<uint64_t>(key.ldb));
    mix(static_cast<uint64_t>(key.ldc));
    mix(static_cast<uint64_t>(key.transpose_a) | static_cast<uint64_t>(key.transpose_b) << 1 |
        static_cast<uint64_t>(key.ab_type) << 8 | static_cast<uint64_t>(key.c_type) << 24);
    mix(static_cast<uint64_t>(key.align_a) | static_cast<uint64_t>(key.align_b) << 16 |
        static_cast<uint64_t>(key.align_c) << 32 | static_cast<uint64_t>(key.align_vector) << 48);
    mix(static_cast<uint64_t>(key.aux_ld));
    mix(static_cast<uint64_t>(key.epilogue) | static_cast<uint64_t>(key.align_aux) << 32);
    return h;
  }
};

// One cuBLASLt matmul, ready to run: its descriptors and the heuristic's algorithm (if any).
struct MatmulPlan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t first = nullptr, second = nullptr, out = nullptr;
  cublasLtMatmulAlgo_t algo{};
  bool has_algo = false;

  MatmulPlan() = default;
  MatmulPlan(const MatmulPlan&) = delete;
  MatmulPlan& operator=(const MatmulPlan&) = delete;
  ~MatmulPlan() {
    if (out != nullptr) cublaslt().matrix_layout_destroy(out);
    if (second != nullptr) cublaslt().matrix_layout_destroy(second);
    if (first != nullptr) cublaslt().matrix_layout_destroy(first);
    if (desc != nullptr) cublaslt().matmul_desc_destroy(desc);
  }
};

using PlanMap = std::unordered_map<MatmulKey, std::unique_ptr<MatmulPlan>, MatmulKeyHash>;

// Enough for every shape of a training run; a run that somehow exceeds it starts over rather
// than growing without bound.
constexpr size_t kMaxPlans = 1024;

struct PreferenceHandle {
  cublasLtMatmulPreference_t pref = nullptr;
  ~PreferenceHandle() {
    if (pref != nullptr) cublaslt().matmul_preference_destroy(pref);
  }
};

// cuBLASLt failures name the op that called it (gemm or linear) and the cuBLASLt call.
void check_lt(cublasStatus_t status, const char* op, const char* call) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  check_cublas(status, (std::string(op) + ": " + call).c_str());
}

template <typename V>
void set_desc(const char* op, cublasLtMatmulDesc_t desc, cublasLtMatmulDescAttributes_t attribute,
              const V& value) {
  check_lt(cublaslt().matmul_desc_set_attribute(desc, attribute, &value, sizeof(value)), op,
           "cublasLtMatmulDescSetAttribute");
}

template <typename V>
void set_pref(const char* op, cublasLtMatmulPreference_t pref,
              cublasLtMatmulPreferenceAttributes_t attribute, const V& value) {
  check_lt(cublaslt().matmul_preference_set_attribute(pref, attribute, &value, sizeof(value)), op,
           "cublasLtMatmulPreferenceSetAttribute");
}

// Row-major matrices are column-major ones transposed: c^T [n, m] = op(b)^T op(a)^T, so
// cuBLASLt's first operand is b's buffer (column-major [b.cols, b.rows]) with b's transpose, its
// second a's buffer with a's, and its output c's buffer as column-major [n, m]. A bias then has
// one entry per output row of cuBLASLt's D, i.e. per column of c: the broadcast linear() needs.
// BGRADB reduces cuBLASLt's B (a's buffer) over k into one entry per column of D (row of c); a
// GELU input (aux) has D's column-major layout, as c's row-major one.
std::unique_ptr<MatmulPlan> make_plan(const char* op, cublasLtHandle_t lt, const MatmulKey& key,
                                      ConstMatrix a, ConstMatrix b, Matrix c,
                                      const Epilogue& epilogue) {
  auto plan = std::make_unique<MatmulPlan>();
  const auto ab_type = static_cast<cudaDataType_t>(key.ab_type);
  const auto c_type = static_cast<cudaDataType_t>(key.c_type);
  check_lt(cublaslt().matmul_desc_create(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), op,
           "cublasLtMatmulDescCreate");
  const int32_t op_first = key.transpose_b != 0 ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int32_t op_second = key.transpose_a != 0 ? CUBLAS_OP_T : CUBLAS_OP_N;
  set_desc(op, plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, op_first);
  set_desc(op, plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, op_second);
  if (epilogue.kind != CUBLASLT_EPILOGUE_DEFAULT) {
    set_desc(op, plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, static_cast<uint32_t>(epilogue.kind));
  }
  if (epilogue.vector != nullptr) {
    // A bias has D's type (cuBLASLt's rule for non-integer, non-fp8 matmuls), said explicitly
    // as the GPU runs so far did; a bias gradient and a GELU input take D's type by default
    // (setting their types where a combination does not support it would fail in the matmul,
    // not in the heuristic, past the fallback).
    if (epilogue.kind == CUBLASLT_EPILOGUE_BIAS) {
      set_desc(op, plan->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, static_cast<int32_t>(c_type));
    }
    set_desc(op, plan->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, epilogue.vector);
  }
  if (epilogue.aux != nullptr) {
    set_desc(op, plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, epilogue.aux_ld);
    set_desc(op, plan->desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, epilogue.aux);
  }
  check_lt(cublaslt().matrix_layout_create(&plan->first, ab_type, static_cast<uint64_t>(b.cols),
                                           static_cast<uint64_t>(b.rows), key.ldb),
           op, "cublasLtMatrixLayoutCreate");
  check_lt(cublaslt().matrix_layout_create(&plan->second, ab_type, static_cast<uint64_t>(a.cols),
                                           static_cast<uint64_t>(a.rows), key.lda),
           op, "cublasLtMatrixLayoutCreate");
  check_lt(cublaslt().matrix_layout_create(&plan->out, c_type, static_cast<uint64_t>(c.cols),
                                           static_cast<uint64_t>(c.rows), key.ldc),
           op, "cublasLtMatrixLayoutCreate");

  PreferenceHandle pref;
  check_lt(cublaslt().matmul_preference_create(&pref.pref), op, "cublasLtMatmulPreferenceCreate");
  set_pref(op, pref.pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
           static_cast<uint64_t>(CudaOps::kLtWorkspaceBytes));
  set_pref(op, pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b);
  set_pref(op, pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a);
  set_pref(op, pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c);
  set_pref(op, pref.pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c);

  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t status =
      cublaslt().matmul_algo_get_heuristic(lt, plan->desc, plan->first, plan->second, plan->out,
                                           plan->out, pref.pref, 1, &result, &found);
  // NOT_SUPPORTED is the heuristic's "nothing fits this configuration"; with an epilogue, any
  // refusal is (the caller runs the steps one by one).
  if (status != CUBLAS_STATUS_NOT_SUPPORTED && key.epilogue == CUBLASLT_EPILOGUE_DEFAULT) {
    check_lt(status, op, "cublasLtMatmulAlgoGetHeuristic");
  }
  if (status == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS) {
    plan->algo = result.algo;
    plan->has_algo = true;
  }
  return plan;
}

// c = alpha op(a) op(b) + beta c_in (+ bias per column of c), shapes already checked and
// non-empty; c_in is c's buffer when null, or another matrix of c's shape and type (cuBLASLt's C,
// with c as D). False when cuBLASLt has no algorithm for it (the caller decides what that means).
bool lt_matmul(const char* op, PlanMap& plans, cublasLtHandle_t lt, void* workspace,
               cudaStream_t stream, const GemmShape& shape, ConstMatrix a, Transpose transpose_a,
               ConstMatrix b, Transpose transpose_b, Matrix c, float alpha, float beta,
               const Epilogue& epilogue = {}, const void* c_in = nullptr) {
  if (c_in == nullptr) c_in = c.data;
  MatmulKey key;
  key.m = shape.m;
  key.n = shape.n;
  key.k = shape.k;
  // cuBLASLt rejects a leading dimension of 0, which an empty operand would have.
  key.lda = std::max<int64_t>(a.row_stride(), 1);
  key.ldb = std::max<int64_t>(b.row_stride(), 1);
  key.ldc = std::max<int64_t>(c.row_stride(), 1);
  key.transpose_a = transpose_a == Transpose::yes ? 1 : 0;
  key.transpose_b = transpose_b == Transpose::yes ? 1 : 0;
  key.ab_type = static_cast<int32_t>(cuda_type(a.dtype));
  key.c_type = static_cast<int32_t>(cuda_type(c.dtype));
  key.align_a = alignment(a.data);
  key.align_b = alignment(b.data);
  key.align_c = std::min(alignment(c.data), alignment(c_in));
  key.epilogue = static_cast<int32_t>(epilogue.kind);
  key.align_vector = epilogue.vector != nullptr ? alignment(epilogue.vector) : 0;
  key.align_aux = epilogue.aux != nullptr ? alignment(epilogue.aux) : 0;
  key.aux_ld = epilogue.aux_ld;

  auto it = plans.find(key);
  if (it == plans.end()) {
    if (plans.size() >= kMaxPlans) plans.clear();
    it = plans.emplace(key, make_plan(op, lt, key, a, b, c, epilogue)).first;
  }
  MatmulPlan& plan = *it->second;
  if (!plan.has_algo) return false;
  // The plan is shared by every call of its key: this call's pointers.
  if (epilogue.vector != nullptr) {
    set_desc(op, plan.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, epilogue.vector);
  }
  if (epilogue.aux != nullptr) {
    set_desc(op, plan.desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, epilogue.aux);
  }
  // C and D share the layout: beta = 1 accumulates (in place when c_in is c).
  const cublasStatus_t status = cublaslt().matmul(
      lt, plan.desc, &alpha, b.data, plan.first, a.data, plan.second, &beta, c_in, plan.out, c.data,
      plan.out, &plan.algo, workspace, CudaOps::kLtWorkspaceBytes, stream);
  // An epilogue the matmul refuses for its arguments (cuBLASLt checks some only here, and then
  // launches nothing): the plan is marked unusable and the caller runs the steps one by one.
  if (status != CUBLAS_STATUS_SUCCESS && epilogue.kind != CUBLASLT_EPILOGUE_DEFAULT &&
      (status == CUBLAS_STATUS_INVALID_VALUE || status == CUBLAS_STATUS_NOT_SUPPORTED)) {
    plan.has_algo = false;
    return false;
  }
  check_lt(status, op, "cublasLtMatmul");
  return true;
}

}  // namespace

// ---- Shared helpers (cuda_ops_impl.cuh).

void check_cuda(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // the error is reported here; a later check must not see it again
  throw Error(ErrorKind::cuda, std::string(what) + ": " + cudaGetErrorString(err) + " (" +
                                   cudaGetErrorName(err) + ")");
}

void check_launch(const char* kernel) {
  const cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return;
  throw Error(ErrorKind::cuda, std::string(kernel) + ": the kernel launch failed: " +
                                   cudaGetErrorString(err) + " (" + cudaGetErrorName(err) + ")");
}

void check_cublas(cublasStatus_t status, const char* what) {
  if (status == CUBLAS_STATUS_SUCCESS) return;
  throw Error(ErrorKind::cuda, std::string(what) + ": " + cublaslt().get_status_name(status) +
                                   " (" + cublaslt().get_status_string(status) + ")");
}

void precondition_failed(const char* what, const std::string& reason) {
  throw Error(ErrorKind::internal, std::string(what) + ": " + reason);
}

void require_stride(const char* what, ConstMatrix m, const char* name) {
  if (m.row_stride() < m.cols) {
    precondition_failed(what, std::string(name) + " has rows " + std::to_string(m.row_stride()) +
                                  " elements apart for " + std::to_string(m.cols) + " columns");
  }
}

void require_same_shape(const char* what, ConstMatrix a, const char* a_name, ConstMatrix b,
                        const char* b_name) {
  if (a.rows != b.rows || a.cols != b.cols || a.dtype != b.dtype) {
    const auto text = [](ConstMatrix m) {
      return "[" + std::to_string(m.rows) + ", " + std::to_string(m.cols) + "] " +
             dtype_name(m.dtype);
    };
    precondition_failed(
        what, std::string(a_name) + " " + text(a) + " and " + b_name + " " + text(b) + " differ");
  }
  require_stride(what, a, a_name);
  require_stride(what, b, b_name);
}

void require_contiguous(const char* what, ConstMatrix m, const char* name) {
  if (!m.contiguous()) {
    precondition_failed(what, std::string(name) + " has padded rows (" +
                                  std::to_string(m.row_stride()) + " elements apart for " +
                                  std::to_string(m.cols) + " columns)");
  }
}

// ---- cuda_ops.hpp.

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the "no driver" / "no device" error
    return 0;
  }
  return n;
}

namespace {

// "13.0" for the CUDA version code 13000.
std::string cuda_version_text(int code) {
  return std::to_string(code / 1000) + "." + std::to_string(code % 1000 / 10);
}

// Why device_count() finds no device: cudaGetDeviceCount's error with the driver's and this
// binary's runtime's CUDA versions (a driver older than the runtime reads as "insufficient"),
// or "" when there are devices. Never throws.
std::string no_device_reason() {
  int n = 0;
  const cudaError_t error = cudaGetDeviceCount(&n);
  if (error == cudaSuccess) return n > 0 ? "" : "cudaGetDeviceCount found no device";
  cudaGetLastError();  // not sticky; leave no error behind for the next call
  int driver = 0;
  int runtime = 0;
  if (cudaDriverGetVersion(&driver) != cudaSuccess) driver = 0;
  if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) runtime = 0;
  cudaGetLastError();
  std::string reason = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorString(error) +
                       " (" + cudaGetErrorName(error) + "); ";
  // cudaDriverGetVersion gives 0 when no driver is installed.
  reason += driver == 0 ? std::string("no CUDA driver is installed")
                        : "the driver supports CUDA " + cuda_version_text(driver);
  return reason + ", this binary's runtime is CUDA " + cuda_version_text(runtime);
}

void require_device(int device) {
  const int count = device_count();
  if (device < 0 || device >= count) {
    std::string message = device_label(device) + " does not exist (" + std::to_string(count) +
                          " CUDA devices are visible)";
    if (count == 0) {
      if (const std::string why = no_device_reason(); !why.empty()) message += ": " + why;
    }
    throw Error(ErrorKind::cuda, message);
  }
}

}  // namespace

std::string device_name(int device) {
  require_device(device);
  cudaDeviceProp prop{};
  check_cuda(cudaGetDeviceProperties(&prop, device),
             (device_label(device) + ": cudaGetDeviceProperties").c_str());
  return prop.name;
}

std::unique_ptr<Ops> make_cuda_ops(int device) {
  require_device(device);
  return std::make_unique<CudaOps>(device);
}

void load_cublaslt() {
  static_cast<void>(cublaslt());
}

void* compute_stream(Ops& ops) {
  auto* cuda = dynamic_cast<CudaOps*>(&ops);
  if (cuda == nullptr) {
    throw Error(ErrorKind::internal,
                "compute_stream: the op table on " + ops.device() + " is not a CUDA one");
  }
  return cuda->stream();
}

// ---- CudaOps: construction and memory.

struct CudaOps::MatmulPlans {
  PlanMap plans;
};

CudaOps::CudaOps(int device) : device_(device) {
  const std::string where = device_label(device) + ": ";
  try {
    check_cuda(cudaSetDevice(device), (where + "cudaSetDevice").c_str());
    // Non-blocking: the legacy default stream (used by libraries we do not control) never
    // serialises against the compute stream.
    check_cuda(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
               (where + "cudaStreamCreateWithFlags").c_str());
    check_cublas(cublaslt().create(&lt_), (where + "cublasLtCreate").c_str());
    check_cuda(
        cudaMalloc(&lt_workspace_, kLtWorkspaceBytes),
        (where + "cuBLASLt workspace of " + std::to_string(kLtWorkspaceBytes) + " bytes").c_str());
    check_cuda(cudaMalloc(reinterpret_cast<void**>(&errors_), sizeof(DeviceErrors)),
               (where + "cudaMalloc of the device error record").c_str());
    check_cuda(cudaMemsetAsync(errors_, 0, sizeof(DeviceErrors), stream_),
               (where + "cudaMemsetAsync of the device error record").c_str());
    check_cuda(
        cudaMalloc(reinterpret_cast<void**>(&reduce_scratch_), kReduceSlots * sizeof(double)),
        (where + "cudaMalloc of the reduction scratch").c_str());
    check_cuda(cudaMallocHost(&pinned_, kPinnedBytes), (where + "cudaMallocHost").c_str());
    // Stream-ordered allocations (kernel scratch) keep their memory in the pool: with the default
    // threshold of 0 it would go back to the driver at every synchronisation, once a step.
    cudaMemPool_t pool = nullptr;
    check_cuda(cudaDeviceGetDefaultMemPool(&pool, device),
               (where + "cudaDeviceGetDefaultMemPool").c_str());
    uint64_t keep = UINT64_MAX;
    check_cuda(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep),
               (where + "cudaMemPoolSetAttribute (release threshold)").c_str());
    matmul_plans_ = std::make_unique<MatmulPlans>();
    profile_ = OpProfile::from_environment(device);
    check_cuda(cudaStreamSynchronize(stream_), (where + "cudaStreamSynchronize").c_str());
  } catch (...) {
    profile_.reset();
    matmul_plans_.reset();
    release_resources(stream_, lt_, lt_workspace_, errors_, reduce_scratch_, pinned_, scratch_);
    throw;
  }
}

CudaOps::~CudaOps() {
  if (stream_ != nullptr) cudaStreamSynchronize(stream_);  // no matmul still uses a plan
  profile_.reset();                                        // writes the profile
  matmul_plans_.reset();
  release_resources(stream_, lt_, lt_workspace_, errors_, reduce_scratch_, pinned_, scratch_);
}

std::string CudaOps::device() const {
  return device_label(device_);
}

Buffer CudaOps::allocate(size_t bytes) {
  const OpTimer timer(*this, "allocate");
  if (bytes == 0) return Buffer();
  void* data = nullptr;
  const cudaError_t err = cudaMalloc(&data, bytes);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw Error(ErrorKind::cuda, "allocate: cannot allocate " + std::to_string(bytes) +
                                     " bytes on " + device() + ": " + cudaGetErrorString(err));
  }
  Buffer buffer(data, bytes, free_device);
  // In stream order: everything later on the stream sees zeros.
  check_cuda(cudaMemsetAsync(data, 0, bytes, stream_), "allocate: cudaMemsetAsync");
  return buffer;
}

void CudaOps::upload(const void* host, void* device, size_t bytes) {
  const OpTimer timer(*this, "upload");
  if (bytes == 0) return;
  check_cuda(cudaMemcpyAsync(device, host, bytes, cudaMemcpyHostToDevice, stream_),
             "upload: cudaMemcpyAsync");
  check_cuda(cudaStreamSynchronize(stream_), "upload: cudaStreamSynchronize");
}

void CudaOps::bind_thread() {
  check_cuda(cudaSetDevice(device_), (device_label(device_) + ": cudaSetDevice").c_str());
}

namespace {

// An Ops::Marker of a CUDA table: an event (without timing) recorded on the table's stream.
class StreamMarker final : public Ops::Marker {
 public:
  StreamMarker(int device, cudaStream_t stream) : stream_(stream) {
    check_cuda(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming),
               (device_label(device) + ": cudaEventCreate of a stream marker").c_str());
  }
  ~StreamMarker() override { cudaEventDestroy(event_); }
  StreamMarker(const StreamMarker&) = delete;
  StreamMarker& operator=(const StreamMarker&) = delete;
  void record() override {
    check_cuda(cudaEventRecord(event_, stream_), "cudaEventRecord of a stream marker");
  }
  void* handle() const override { return event_; }

 private:
  cudaStream_t stream_;
  cudaEvent_t event_ = nullptr;
};

}  // namespace

std::unique_ptr<Ops::Marker> CudaOps::make_marker() {
  return std::make_unique<StreamMarker>(device_, stream_);
}

void CudaOps::download(const void* device, void* host, size_t bytes) {
  const OpTimer timer(*this, "download");
  if (bytes == 0) return;
  check_cuda(cudaMemcpyAsync(host, device, bytes, cudaMemcpyDeviceToHost, stream_),
             "download: cudaMemcpyAsync");
  check_cuda(cudaStreamSynchronize(stream_), "download: cudaStreamSynchronize");
}

void CudaOps::copy(const void* src, void* dst, size_t bytes) {
  const OpTimer timer(*this, "copy");
  if (bytes == 0) return;
  check_cuda(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_),
             "copy: cudaMemcpyAsync");
}

void CudaOps::fill_zero(void* data, size_t bytes) {
  const OpTimer timer(*this, "fill_zero");
  if (bytes == 0) return;
  check_cuda(cudaMemsetAsync(data, 0, bytes, stream_), "fill_zero: cudaMemsetAsync");
}

void CudaOps::synchronize() {
  check_device_errors();
  if (profile_ != nullptr) profile_->resolve(false);  // the stream is idle: every pair is done
}

void CudaOps::restart_profile() {
  if (profile_ != nullptr) profile_->restart();
}

void CudaOps::check_device_errors() {
  check_cuda(
      cudaMemcpyAsync(pinned_, errors_, sizeof(DeviceErrors), cudaMemcpyDeviceToHost, stream_),
      "synchronize: reading the device error record");
  check_cuda(cudaStreamSynchronize(stream_), "synchronize: cudaStreamSynchronize");
  DeviceErrors found{};
  std::memcpy(&found, pinned_, sizeof(found));
  if (found.kind == 0) return;
  // Cleared in stream order, so the next op starts with a clean record even after the throw.
  check_cuda(cudaMemsetAsync(errors_, 0, sizeof(DeviceErrors), stream_),
             "synchronize: clearing the device error record");
  switch (found.kind) {
    case 1:
      throw Error(ErrorKind::recipe, "token " + std::to_string(found.value) +
                                         " is outside the vocabulary (size " +
                                         std::to_string(found.limit) + ")");
    case 2:
      throw Error(ErrorKind::recipe, "label " + std::to_string(found.value) + " is outside [0, " +
                                         std::to_string(found.limit) + ")");
    default:
      throw Error(ErrorKind::internal,
                  "a kernel recorded an unknown device error kind " + std::to_string(found.kind));
  }
}

void* CudaOps::scratch(size_t bytes) {
  if (bytes <= scratch_bytes_) return scratch_;
  // Earlier kernels may still use the old block: free it only once they are done.
  check_cuda(cudaStreamSynchronize(stream_), "scratch: cudaStreamSynchronize");
  if (scratch_ != nullptr) {
    check_cuda(cudaFree(scratch_), "scratch: cudaFree");
    scratch_ = nullptr;
    scratch_bytes_ = 0;
  }
  check_cuda(
      cudaMalloc(&scratch_, bytes),
      ("scratch: cannot allocate " + std::to_string(bytes) + " bytes on " + device()).c_str());
  scratch_bytes_ = bytes;
  return scratch_;
}

void CudaOps::cast(const void* src, DType from, void* dst, DType to, int64_t n) {
  const OpTimer timer(*this, "cast");
  if (n < 0) precondition_failed("cast", "negative element count " + std::to_string(n));
  if (n == 0) return;
  if (from == to) {
    copy(src, dst, static_cast<size_t>(n) * dtype_size(from));
    return;
  }
  dispatch_dtype(from, [&]<typename From>() {
    dispatch_dtype(to, [&]<typename To>() {
      cast_kernel<From, To><<<grid_for(n), kThreads, 0, stream_>>>(static_cast<const From*>(src),
                                                                   static_cast<To*>(dst), n);
    });
  });
  check_launch("cast");
}

// ---- Dense layers.

void CudaOps::gemm(ConstMatrix a, Transpose transpose_a, ConstMatrix b, Transpose transpose_b,
                   Matrix c, float alpha, float beta) {
  const OpTimer timer(*this, "gemm");
  const GemmShape shape = gemm_shape("gemm", a, transpose_a, b, transpose_b, c);
  if (shape.m == 0 || shape.n == 0) return;
  if (shape.k == 0) {  // an empty product: c = beta c
    if (!c.contiguous()) precondition_failed("gemm", "an empty product into padded rows of c");
    if (beta == 0.0f) {
      fill_zero(c.data, c.bytes());
    } else if (beta != 1.0f) {
      dispatch_dtype(c.dtype, [&]<typename T>() {
        scale_elements_kernel<T>
            <<<grid_for(c.size()), kThreads, 0, stream_>>>(static_cast<T*>(c.data), c.size(), beta);
      });
      check_launch("gemm (scale by beta)");
    }
    return;
  }
  if (!lt_matmul("gemm", matmul_plans_->plans, lt_, lt_workspace_, stream_, shape, a, transpose_a,
                 b, transpose_b, c, alpha, beta)) {
    throw Error(ErrorKind::cuda, std::string("gemm: cuBLASLt has no algorithm for [") +
                                     std::to_string(shape.m) + ", " + std::to_string(shape.k) +
                                     "] x [" + std::to_string(shape.k) + ", " +
                                     std::to_string(shape.n) + "] in " + dtype_name(a.dtype) +
                                     " -> " + dtype_name(c.dtype));
  }
}

// DPTRAIN_EPILOGUES=off: the linear ops below run their steps one by one, as where cuBLASLt has
// no algorithm for an epilogue (to compare speed, and the GPU tests' way to test that path too).
// Read at each call, as DPTRAIN_ATTENTION is, first thing (a bad value is an error whatever the
// call would have fused).
namespace {
bool epilogues_allowed() {
  const char* how = std::getenv("DPTRAIN_EPILOGUES");
  const std::string choice = how == nullptr ? "on" : how;
  if (choice != "on" && choice != "off") {
    precondition_failed("linear", "DPTRAIN_EPILOGUES=" + choice + ": use on or off");
  }
  return choice == "on";
}

// GELU through cuBLASLt's epilogues (GELU_AUX_BIAS, DGELU) for 16-bit matmuls only: cuBLASLt
// does not document the accuracy of its GELU, and an f32 matmul keeps the f32 GELU kernels'
// (the CPU's to about 1e-6). Its GELU input (aux) 16-byte aligned, like the bias. (Where
// epilogues_allowed() too.)
bool gelu_epilogue_allowed(DType dtype, const void* aux) {
  return dtype != DType::f32 && alignment(aux) >= 16;
}
}  // namespace

void CudaOps::linear(ConstMatrix x, const void* weight, const void* bias, Matrix y,
                     const void* residual) {
  OpTimer timer(*this, "linear");
  const bool fuse = epilogues_allowed();
  require_contiguous("linear", x, "x");
  require_contiguous("linear", y, "y");
  const ConstMatrix w{weight, y.cols, x.cols, x.dtype};
  const GemmShape shape = gemm_shape("linear", x, Transpose::no, w, Transpose::yes, y);
  if (shape.m == 0 || shape.n == 0) return;
  const float beta = residual != nullptr ? 1.0f : 0.0f;
  // One cuBLASLt call where it can: the residual as C (read in place of a copy into y first),
  // and the bias through the epilogue when it has D's dtype (y's, which must then be x's) and is
  // 16-byte aligned (narrower bias pointers fail on some GPUs). With alpha = 1 the bias is added
  // once, wherever the epilogue puts it relative to beta * C.
  const auto matmul = [&](const void* epilogue_bias) {
    const Epilogue epilogue{
        epilogue_bias != nullptr ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT,
        epilogue_bias};
    return shape.k > 0 &&
           lt_matmul("linear", matmul_plans_->plans, lt_, lt_workspace_, stream_, shape, x,
                     Transpose::no, w, Transpose::yes, y, 1.0f, beta, epilogue, residual);
  };
  if (bias != nullptr && y.dtype == x.dtype && alignment(bias) >= 16 && fuse && matmul(bias)) {
    return;
  }
  // The bias on its own: not the epilogue's dtype or alignment, or no algorithm with it. (Here
  // and in the ops below, an op with work for an epilogue that ran without one is filed as
  // "(unfused)" in the profile, whatever the reason; an empty product is not.)
  if (bias != nullptr && shape.k > 0) timer.rename("linear (unfused)");
  if (!matmul(nullptr)) {
    // An empty product, or no algorithm even without an epilogue: gemm says which.
    if (residual != nullptr && residual != y.data) copy(residual, y.data, y.bytes());
    gemm(x, Transpose::no, w, Transpose::yes, y, 1.0f, beta);
  }
  if (bias != nullptr) add_bias_rows(y, bias);
}

void CudaOps::linear_activation(ConstMatrix x, const void* weight, const void* bias,
                                Activation activation, Matrix pre, Matrix out) {
  OpTimer timer(*this, "linear_activation");
  const bool fuse = epilogues_allowed();
  require_contiguous("linear_activation", x, "x");
  require_contiguous("linear_activation", pre, "pre");
  require_contiguous("linear_activation", out, "out");
  const ConstMatrix w{weight, pre.cols, x.cols, x.dtype};
  const GemmShape shape = gemm_shape("linear_activation", x, Transpose::no, w, Transpose::yes, out);
  require_same_shape("linear_activation", pre, "pre", out, "out");
  // cuBLASLt's GELU_AUX_BIAS epilogue (GELU's tanh approximation, as Activation::gelu) writes
  // gelu(x W^T + bias) as D and x W^T + bias as its GELU input (aux): no separate pass reading
  // pre back. The bias as in linear (D's dtype, 16-byte aligned); rows a multiple of 8 apart.
  const bool wanted = activation == Activation::gelu && bias != nullptr && shape.m > 0 &&
                      shape.n > 0 && shape.k > 0;
  if (wanted && out.dtype == x.dtype && alignment(bias) >= 16 && out.cols % 8 == 0 && fuse &&
      gelu_epilogue_allowed(out.dtype, pre.data) &&
      lt_matmul("linear_activation", matmul_plans_->plans, lt_, lt_workspace_, stream_, shape, x,
                Transpose::no, w, Transpose::yes, out, 1.0f, 0.0f,
                Epilogue{CUBLASLT_EPILOGUE_GELU_AUX_BIAS, bias, pre.data, pre.cols})) {
    return;
  }
  if (wanted) timer.rename("linear_activation (unfused)");
  linear(x, weight, bias, pre, nullptr);
  activation_forward(activation, pre, out);
}

void CudaOps::linear_weight_grad(ConstMatrix dy, ConstMatrix x, float* dweight, float* dbias) {
  OpTimer timer(*this, "linear_weight_grad");
  const bool fuse = epilogues_allowed();
  const Matrix dw{dweight, dy.cols, x.cols};
  const GemmShape shape =
      gemm_shape("linear_weight_grad", dy, Transpose::yes, x, Transpose::no, dw);
  // cuBLASLt's BGRADB epilogue writes dy's column sums (the bias gradient, in dweight's f32)
  // while it accumulates dy^T x: dy is read once, not again by bias_grad. It writes rather than
  // adds, so the sums go to scratch and are added to dbias after.
  const bool wanted = dbias != nullptr && shape.m > 0 && shape.n > 0 && shape.k > 0;
  if (wanted && dy.contiguous() && fuse) {
    float* sums = static_cast<float*>(scratch(static_cast<size_t>(dy.cols) * sizeof(float)));
    if (lt_matmul("linear_weight_grad", matmul_plans_->plans, lt_, lt_workspace_, stream_, shape,
                  dy, Transpose::yes, x, Transpose::no, dw, 1.0f, 1.0f,
                  Epilogue{CUBLASLT_EPILOGUE_BGRADB, sums})) {
      axpy(dy.cols, 1.0f, sums, dbias);
      return;
    }
  }
  if (wanted) timer.rename("linear_weight_grad (unfused)");
  // No bias, an empty product or no algorithm for the fused call: one op after the other.
  gemm(dy, Transpose::yes, x, Transpose::no, dw, 1.0f, 1.0f);
  if (dbias != nullptr) bias_grad(dy, dbias);
}

void CudaOps::linear_activation_grad(ConstMatrix dy, const void* weight, Activation activation,
                                     ConstMatrix pre, Matrix dpre) {
  OpTimer timer(*this, "linear_activation_grad");
  const bool fuse = epilogues_allowed();
  const ConstMatrix w{weight, dy.cols, dpre.cols, dy.dtype};
  const GemmShape shape =
      gemm_shape("linear_activation_grad", dy, Transpose::no, w, Transpose::no, dpre);
  require_same_shape("linear_activation_grad", pre, "pre", dpre, "dpre");
  // cuBLASLt's DGELU epilogue (GELU's tanh approximation, as Activation::gelu) multiplies the
  // product by gelu'(pre) on its way out, reading pre as its GELU input: no separate pass over
  // dpre. It wants the input's rows a multiple of 8 elements apart, like D's.
  const bool wanted = activation == Activation::gelu && shape.m > 0 && shape.n > 0 && shape.k > 0;
  if (wanted && pre.contiguous() && dpre.contiguous() && dpre.cols % 8 == 0 &&
      dpre.dtype == dy.dtype && fuse && gelu_epilogue_allowed(dpre.dtype, pre.data) &&
      lt_matmul("linear_activation_grad", matmul_plans_->plans, lt_, lt_workspace_, stream_, shape,
                dy, Transpose::no, w, Transpose::no, dpre, 1.0f, 0.0f,
                Epilogue{CUBLASLT_EPILOGUE_DGELU, nullptr, pre.data, pre.cols})) {
    return;
  }
  if (wanted) timer.rename("linear_activation_grad (unfused)");
  gemm(dy, Transpose::no, w, Transpose::no, dpre, 1.0f, 0.0f);
  activation_backward(activation, pre, dpre, dpre);
}

// ---- Flat f32 buffers.

void CudaOps::axpy(int64_t n, float alpha, const float* x, float* y) {
  const OpTimer timer(*this, "axpy");
  if (n <= 0) return;
  axpy_kernel<<<grid_for(n), kThreads, 0, stream_>>>(n, alpha, x, y);
  check_launch("axpy");
}

void CudaOps::scale(int64_t n, float alpha, float* x) {
  const OpTimer timer(*this, "scale");
  if (n <= 0) return;
  scale_kernel<<<grid_for(n), kThreads, 0, stream_>>>(n, alpha, x);
  check_launch("scale");
}

double CudaOps::sum_squares(const float* x, int64_t n) {
  const OpTimer timer(*this, "sum_squares");
  if (n <= 0) return 0.0;
  // The block count depends on n alone: the same n always sums in the same order.
  const int blocks =
      static_cast<int>(std::min<int64_t>((n + kReduceThreads - 1) / kReduceThreads, kReduceBlocks));
  double* partial = reduce_scratch_;
  double* total = reduce_scratch_ + kReduceBlocks;
  sum_squares_partial_kernel<<<blocks, kReduceThreads, 0, stream_>>>(x, n, partial);
  check_launch("sum_squares (partial sums)");
  sum_partials_kernel<<<1, kReduceThreads, 0, stream_>>>(partial, blocks, total);
  check_launch("sum_squares (total)");
  check_cuda(cudaMemcpyAsync(pinned_, total, sizeof(double), cudaMemcpyDeviceToHost, stream_),
             "sum_squares: cudaMemcpyAsync");
  check_cuda(cudaStreamSynchronize(stream_), "sum_squares: cudaStreamSynchronize");
  double result = 0;
  std::memcpy(&result, pinned_, sizeof(result));
  return result;
}

void CudaOps::adamw_update(float* params, const float* grads, float* m, float* v, int64_t n,
                           const AdamWCoefficients& k) {
  const OpTimer timer(*this, "adamw_update");
  if (n <= 0) return;
  adamw_kernel<<<grid_for(n), kThreads, 0, stream_>>>(params, grads, m, v, n, k);
  check_launch("adamw_update");
}

void CudaOps::sgd_update(float* params, const float* grads, float* velocity, int64_t n,
                         float momentum, float decay, float rate, bool nesterov) {
  const OpTimer timer(*this, "sgd_update");
  if (n <= 0) return;
  sgd_kernel<<<grid_for(n), kThreads, 0, stream_>>>(params, grads, velocity, n, momentum, decay,
                                                    rate, nesterov);
  check_launch("sgd_update");
}

}  // namespace dptrain::kernels
