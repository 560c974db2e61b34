// Inside the CUDA op table: the CudaOps class and the helpers its .cu files share. Each .cu file
// implements one group of methods: cuda_ops.cu (memory, casts, gemm, flat buffers, optimizers),
// nn_kernels.cu (bias, activations, softmax cross-entropy, LayerNorm, embedding), attention.cu.
#pragma once

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cuda_ops.hpp"

namespace dptrain::kernels {

// Throws Error(cuda) "WHAT: <CUDA's message>" unless err is cudaSuccess.
void check_cuda(cudaError_t err, const char* what);
// After a kernel launch: Error(cuda) naming the kernel when the launch failed.
void check_launch(const char* kernel);
// Throws Error(cuda) "WHAT: <cuBLAS status>" unless status is CUBLAS_STATUS_SUCCESS.
void check_cublas(cublasStatus_t status, const char* what);
// Error(internal) "WHAT: REASON" for a precondition a caller broke (shapes, dtypes, alignment).
[[noreturn]] void precondition_failed(const char* what, const std::string& reason);
// Matrices with padded rows: rows at least cols apart (the ops that take them), or none at all
// (require_contiguous: every other op). A broken one is precondition_failed naming `name`.
void require_stride(const char* what, ConstMatrix m, const char* name);
void require_contiguous(const char* what, ConstMatrix m, const char* name);
// a and b have one shape and dtype (else precondition_failed naming both), and legal strides.
void require_same_shape(const char* what, ConstMatrix a, const char* a_name, ConstMatrix b,
                        const char* b_name);

// Element types <-> DType, and float conversion in kernels.
template <typename T>
__device__ __forceinline__ float to_f32(T v) {
  return static_cast<float>(v);
}
template <>
__device__ __forceinline__ float to_f32<__nv_bfloat16>(__nv_bfloat16 v) {
  return __bfloat162float(v);
}
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) {
  return __half2float(v);
}
template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __nv_bfloat16 from_f32<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) {
  return __float2half_rn(v);
}

// Calls f.template operator()<T>() with T the element type of dtype (float, __nv_bfloat16,
// __half): one place maps DType to CUDA types.
template <typename F>
void dispatch_dtype(DType dtype, F&& f) {
  switch (dtype) {
    case DType::f32:
      f.template operator()<float>();
      return;
    case DType::bf16:
      f.template operator()<__nv_bfloat16>();
      return;
    case DType::f16:
      f.template operator()<__half>();
      return;
  }
  precondition_failed("dispatch_dtype", "not a dtype: " + std::to_string(static_cast<int>(dtype)));
}

// What kernels found wrong in their input (a token or label out of range); the host reads it
// at the next synchronisation point and throws.
struct DeviceErrors {
  int32_t kind;   // 0 none, 1 token out of range, 2 label out of range
  int32_t value;  // the offending token or label
  int32_t limit;  // the vocabulary size or class count
};

// DPTRAIN_PROFILE=DIR: every op's GPU time, measured with a pair of CUDA events around it on the
// op table's stream (an op that calls another counts once, as the outer op), summed per op and
// written to DIR/cuda-ops-DEVICE-PID.json ({"ops": [{"op", "calls", "ms", "share"}], sorted by
// time) when the op table is destroyed. Pairs are resolved at synchronisation points. Thread-safe:
// the gradient exchange's thread runs ops too.
class OpProfile {
 public:
  static std::unique_ptr<OpProfile> from_environment(int device);  // null when not asked for
  ~OpProfile();
  OpProfile(const OpProfile&) = delete;
  OpProfile& operator=(const OpProfile&) = delete;
  cudaEvent_t open(cudaStream_t stream);
  void close(const char* op, cudaEvent_t start, cudaStream_t stream);
  void resolve(bool wait);  // wait: for every pair; else those already done
  // Waits for the pairs still pending and forgets every op's time and the span: the profile
  // starts again from the next op.
  void restart();

 private:
  OpProfile(int device, std::string path) : device_(device), path_(std::move(path)) {}
  struct Pending {
    const char* op;
    cudaEvent_t start, end;
  };
  struct Total {
    int64_t calls = 0;
    double ms = 0;
  };
  cudaEvent_t take();
  void resolve_locked(bool wait);
  void write() const;

  const int device_;
  const std::string path_;
  std::mutex mutex_;
  std::vector<cudaEvent_t> free_;
  std::vector<Pending> pending_;
  std::map<std::string, Total> totals_;
  cudaEvent_t first_ = nullptr;  // recorded before the first op: the start of span_ms_
  double span_ms_ = 0;           // from first_ to the latest resolved op's end
};

class CudaOps final : public Ops {
 public:
  explicit CudaOps(int device);
  ~CudaOps() override;
  CudaOps(const CudaOps&) = delete;
  CudaOps& operator=(const CudaOps&) = delete;

  std::string device() const override;
  Buffer allocate(size_t bytes) override;
  void upload(const void* host, void* device, size_t bytes) override;
  void download(const void* device, void* host, size_t bytes) override;
  void copy(const void* src, void* dst, size_t bytes) override;
  void fill_zero(void* data, size_t bytes) override;
  void synchronize() override;
  void bind_thread() override;
  void restart_profile() override;
  std::unique_ptr<Marker> make_marker() override;
  void cast(const void* src, DType from, void* dst, DType to, int64_t n) override;

  void gemm(ConstMatrix a, Transpose transpose_a, ConstMatrix b, Transpose transpose_b, Matrix c,
            float alpha, float beta) override;
  void linear(ConstMatrix x, const void* weight, const void* bias, Matrix y,
              const void* residual) override;
  void linear_activation(ConstMatrix x, const void* weight, const void* bias, Activation activation,
                         Matrix pre, Matrix out) override;
  void linear_weight_grad(ConstMatrix dy, ConstMatrix x, float* dweight, float* dbias) override;
  void linear_activation_grad(ConstMatrix dy, const void* weight, Activation activation,
                              ConstMatrix pre, Matrix dpre) override;
  void add_bias_rows(Matrix x, const void* bias) override;
  void bias_grad(ConstMatrix dy, float* bias_grad) override;
  void activation_forward(Activation activation, ConstMatrix pre, Matrix out) override;
  void activation_backward(Activation activation, ConstMatrix pre, ConstMatrix dout,
                           Matrix dpre) override;
  double softmax_cross_entropy_forward(ConstMatrix logits, const int32_t* labels,
                                       Matrix probs) override;
  void softmax_cross_entropy_backward(ConstMatrix probs, const int32_t* labels, Matrix dlogits,
                                      float scale) override;
  double softmax_cross_entropy(ConstMatrix logits, const int32_t* labels, Matrix dlogits,
                               float scale) override;
  int64_t count_correct(ConstMatrix scores, const int32_t* labels) override;
  void add(ConstMatrix x, Matrix y) override;  // in elementwise.cu

  void axpy(int64_t n, float alpha, const float* x, float* y) override;
  void scale(int64_t n, float alpha, float* x) override;
  double sum_squares(const float* x, int64_t n) override;
  void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n,
                    const AdamWCoefficients& k) override;
  void sgd_update(float* params, const float* grads, float* velocity, int64_t n, float momentum,
                  float decay, float rate, bool nesterov) override;

  void layernorm_forward(ConstMatrix x, const void* gamma, const void* beta, Matrix out,
                         float* mean, float* rstd) override;
  void layernorm_backward(ConstMatrix x, const void* gamma, const float* mean, const float* rstd,
                          ConstMatrix dout, Matrix dx, float* dgamma, float* dbeta) override;
  size_t attention_state_floats(int64_t batch, int64_t seq, int64_t heads) const override;
  void attention_forward(ConstMatrix qkv, int64_t batch, int64_t seq, int64_t heads, Matrix out,
                         float* state) override;
  void attention_backward(ConstMatrix qkv, ConstMatrix out, const float* state, ConstMatrix dout,
                          int64_t batch, int64_t seq, int64_t heads, Matrix dqkv) override;
  void embedding_forward(const int32_t* tokens, int64_t seq, int64_t vocab, const void* wte,
                         const void* wpe, Matrix out) override;
  void embedding_backward(const int32_t* tokens, int64_t seq, ConstMatrix dout, float* dwte,
                          float* dwpe) override;

  cudaStream_t stream() const { return stream_; }
  OpProfile* profile() const { return profile_.get(); }

  static constexpr size_t kLtWorkspaceBytes = size_t{32} << 20;
  static constexpr size_t kReduceSlots = 4096;  // doubles in reduce_scratch()
  static constexpr size_t kPinnedBytes = 4096;
  DeviceErrors* device_errors() const { return errors_; }
  double* reduce_scratch() const { return reduce_scratch_; }
  void* pinned() const { return pinned_; }
  cublasLtHandle_t lt() const { return lt_; }
  void* lt_workspace() const { return lt_workspace_; }
  // Waits for the stream, then throws what a kernel recorded in device_errors() (and clears it).
  void check_device_errors();
  // Device scratch of at least `bytes` for one op's own use (attention_backward's D, the bias
  // gradient linear_weight_grad adds): grown in stream order, kept; the next op may reuse it.
  void* scratch(size_t bytes);

 private:
  // Threads: the table is used by one thread at a time, except that a gradient reducer's
  // communication thread (core/ddp/reducer.cpp) calls bind_thread, device, upload and download
  // (buckets staged through host memory), and reads its markers' handles, while the training
  // thread queues other ops. Those methods touch only the stream, the constant members and the
  // profile (which locks its own mutex), so the members below need no lock: the reduce scratch and
  // the pinned buffer (losses, counts, device errors), the matmul plans (gemm, linear) and the
  // scratch belong to the training thread. Calling any other method from a second thread
  // needs a lock here first.
  int device_ = 0;
  cudaStream_t stream_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  void* lt_workspace_ = nullptr;
  DeviceErrors* errors_ = nullptr;    // device memory, zeroed
  double* reduce_scratch_ = nullptr;  // device
  void* pinned_ = nullptr;            // host pinned
  void* scratch_ = nullptr;           // device
  size_t scratch_bytes_ = 0;

  // ---- cuda_ops.cu (gemm, linear): cuBLASLt plans (descriptors, layouts, the heuristic's
  // algorithm) by shape, dtypes, transposes and alignment, so a step asks the heuristic once.
  struct MatmulPlans;
  std::unique_ptr<MatmulPlans> matmul_plans_;
  std::unique_ptr<OpProfile> profile_;  // DPTRAIN_PROFILE; null without
};

// Times the op it lives in when the table profiles (DPTRAIN_PROFILE); nothing otherwise. The
// first line of every CudaOps op: `const OpTimer timer(*this, "gemm");`. An op called by another
// (linear's gemm, say) is part of the outer op's time, not timed again: the ops' shares add up to
// the whole.
class OpTimer {
 public:
  OpTimer(const CudaOps& ops, const char* op)
      : profile_(depth_ == 0 ? ops.profile() : nullptr), op_(op) {
    if (profile_ != nullptr) {
      stream_ = ops.stream();
      start_ = profile_->open(stream_);  // may throw: the depth is raised after
    }
    ++depth_;
  }
  ~OpTimer() {
    --depth_;
    if (profile_ == nullptr) return;
    try {
      profile_->close(op_, start_, stream_);
    } catch (...) {
      // Diagnostics only: an op's own error is the one to report.
    }
  }
  OpTimer(const OpTimer&) = delete;
  OpTimer& operator=(const OpTimer&) = delete;
  // Files the time under another name: a fused op that ran its steps one by one says so
  // ("linear (unfused)"), so a profile shows where an epilogue did not apply.
  void rename(const char* op) { op_ = op; }

 private:
  static thread_local inline int depth_ = 0;  // ops open on this thread
  OpProfile* profile_;
  const char* op_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr;
};

}  // namespace dptrain::kernels
