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
};

// OpenBLAS threads for this process (a rank usually wants few: ranks already share the cores).
void set_blas_threads(int threads);

}  // namespace dptrain
