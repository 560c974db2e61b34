// The CPU op table: OpenBLAS sgemm plus simple vectorizable loops.
#pragma once

#include "core/tensor/ops.hpp"

namespace dptrain {

class CpuOps final : public Ops {
 public:
  void gemm(ConstMatrix a, Transpose transpose_a, ConstMatrix b, Transpose transpose_b, Matrix c,
            float alpha, float beta) override;
  void add_bias_rows(Matrix x, const float* bias) override;
  void bias_grad(ConstMatrix dy, float* bias_grad) override;
  void activation_forward(Activation activation, ConstMatrix pre, Matrix out) override;
  void activation_backward(Activation activation, ConstMatrix pre, ConstMatrix dout,
                           Matrix dpre) override;
  double softmax_cross_entropy_forward(ConstMatrix logits, const int32_t* labels,
                                       Matrix probs) override;
  void softmax_cross_entropy_backward(ConstMatrix probs, const int32_t* labels, Matrix dlogits,
                                      float scale) override;
  int64_t count_correct(ConstMatrix scores, const int32_t* labels) override;
  void axpy(int64_t n, float alpha, const float* x, float* y) override;
  void scale(int64_t n, float alpha, float* x) override;
  void layernorm_forward(ConstMatrix x, const float* gamma, const float* beta, Matrix out,
                         float* mean, float* rstd) override;
  void layernorm_backward(ConstMatrix x, const float* gamma, const float* mean, const float* rstd,
                          ConstMatrix dout, Matrix dx, float* dgamma, float* dbeta) override;
  void attention_forward(ConstMatrix qkv, int64_t batch, int64_t seq, int64_t heads, Matrix out,
                         float* att) override;
  void attention_backward(ConstMatrix qkv, const float* att, ConstMatrix dout, int64_t batch,
                          int64_t seq, int64_t heads, Matrix dqkv) override;
  void embedding_forward(const int32_t* tokens, int64_t seq, int64_t vocab, const float* wte,
                         const float* wpe, Matrix out) override;
  void embedding_backward(const int32_t* tokens, int64_t seq, ConstMatrix dout, float* dwte,
                          float* dwpe) override;
};

// OpenBLAS threads for this process (a rank usually wants few: ranks already share the cores).
void set_blas_threads(int threads);

}  // namespace dptrain
