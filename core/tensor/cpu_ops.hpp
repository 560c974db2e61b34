// The CPU op table: OpenBLAS sgemm plus simple vectorizable loops, f32 only. The reference every
// other op table is checked against.
#pragma once

#include "core/tensor/ops.hpp"

namespace dptrain {

class CpuOps final : public Ops {
 public:
  std::string device() const override;
  Buffer allocate(size_t bytes) override;
  void upload(const void* host, void* device, size_t bytes) override;
  void download(const void* device, void* host, size_t bytes) override;
  void copy(const void* src, void* dst, size_t bytes) override;
  void fill_zero(void* data, size_t bytes) override;
  void synchronize() override;
  void cast(const void* src, DType from, void* dst, DType to, int64_t n) override;

  void gemm(ConstMatrix a, Transpose transpose_a, ConstMatrix b, Transpose transpose_b, Matrix c,
            float alpha, float beta) override;
  void add_bias_rows(Matrix x, const void* bias) override;
  void bias_grad(ConstMatrix dy, float* bias_grad) override;
  void activation_forward(Activation activation, ConstMatrix pre, Matrix out) override;
  void activation_backward(Activation activation, ConstMatrix pre, ConstMatrix dout,
                           Matrix dpre) override;
  double softmax_cross_entropy_forward(ConstMatrix logits, const int32_t* labels,
                                       Matrix probs) override;
  void softmax_cross_entropy_backward(ConstMatrix probs, const int32_t* labels, Matrix dlogits,
                                      float scale) override;
  int64_t count_correct(ConstMatrix scores, const int32_t* labels) override;
  void add(ConstMatrix x, Matrix y) override;

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
};

}  // namespace dptrain
