// The op table: the device-neutral kernels models are written against (CPU now, CUDA later).
#pragma once

#include <cstdint>
#include <string>

#include "core/tensor/tensor.hpp"

namespace dptrain {

enum class Transpose { no, yes };
enum class Activation { relu, gelu };  // gelu: the tanh approximation

// "relu" | "gelu"; anything else is Error(recipe) naming model.activation.
Activation parse_activation(const std::string& name);
const char* activation_name(Activation activation);

// All pointers belong to the op table's device. Unless a method says otherwise, outputs must not
// alias inputs. Shape mismatches throw Error(internal): they are bugs in the caller.
class Ops {
 public:
  virtual ~Ops() = default;

  // c = alpha * op(a) * op(b) + beta * c, op = optional transpose. beta = 1 accumulates.
  virtual void gemm(ConstMatrix a, Transpose transpose_a, ConstMatrix b, Transpose transpose_b,
                    Matrix c, float alpha, float beta) = 0;
  // x[i, :] += bias for every row i; bias has x.cols entries.
  virtual void add_bias_rows(Matrix x, const float* bias) = 0;
  // bias_grad[j] += sum_i dy[i, j]: accumulates like the weight gradients.
  virtual void bias_grad(ConstMatrix dy, float* bias_grad) = 0;

  // out = f(pre). out may alias pre.
  virtual void activation_forward(Activation activation, ConstMatrix pre, Matrix out) = 0;
  // dpre = dout * f'(pre). dpre may alias dout.
  virtual void activation_backward(Activation activation, ConstMatrix pre, ConstMatrix dout,
                                   Matrix dpre) = 0;

  // probs = softmax(logits) row-wise; returns the mean over rows of -log probs[i, labels[i]],
  // computed with a stable log-sum-exp. probs may alias logits. A label outside [0, cols) is
  // Error(recipe).
  virtual double softmax_cross_entropy_forward(ConstMatrix logits, const int32_t* labels,
                                               Matrix probs) = 0;
  // dlogits = scale * (probs - onehot(labels)) / rows: the gradient of scale * mean loss.
  // dlogits may alias probs.
  virtual void softmax_cross_entropy_backward(ConstMatrix probs, const int32_t* labels,
                                              Matrix dlogits, float scale) = 0;
  // Rows whose largest score (first one on ties) is at the label's column.
  virtual int64_t count_correct(ConstMatrix scores, const int32_t* labels) = 0;

  // y += alpha * x, over n elements.
  virtual void axpy(int64_t n, float alpha, const float* x, float* y) = 0;
  // x *= alpha, over n elements.
  virtual void scale(int64_t n, float alpha, float* x) = 0;

  // ---- Transformer ops (the GPT model). Rows are tokens: row b * seq + t is position t of
  // sequence b.

  // out[i, :] = (x[i, :] - mean_i) * rstd_i * gamma + beta, rstd_i = 1 / sqrt(var_i + 1e-5)
  // (biased variance). mean and rstd get one value per row, for the backward pass.
  virtual void layernorm_forward(ConstMatrix x, const float* gamma, const float* beta, Matrix out,
                                 float* mean, float* rstd) = 0;
  // dx = the gradient through the normalisation (overwritten); dgamma and dbeta ACCUMULATE
  // (+=), like every parameter gradient. dx may not alias dout.
  virtual void layernorm_backward(ConstMatrix x, const float* gamma, const float* mean,
                                  const float* rstd, ConstMatrix dout, Matrix dx, float* dgamma,
                                  float* dbeta) = 0;

  // Causal multi-head self-attention. qkv is [batch * seq, 3 * width]: each row holds q, then
  // k, then v, each `width` wide; head h uses columns [h * hd, (h + 1) * hd) of each, hd = width
  // / heads. out [batch * seq, width] is the heads' outputs side by side:
  //   att[b, h, t, :] = softmax over s <= t of (q_t . k_s) / sqrt(hd)  (0 for s > t)
  //   out[b * seq + t, h * hd : (h + 1) * hd] = sum_s att[b, h, t, s] * v_s
  // att [batch, heads, seq, seq] keeps the probabilities for the backward pass. The softmax is
  // the stable one (the row maximum subtracted).
  virtual void attention_forward(ConstMatrix qkv, int64_t batch, int64_t seq, int64_t heads,
                                 Matrix out, float* att) = 0;
  // dqkv [batch * seq, 3 * width] = the gradient of the loss with respect to qkv, given dout
  // and the forward's qkv and att (overwritten, not accumulated).
  virtual void attention_backward(ConstMatrix qkv, const float* att, ConstMatrix dout,
                                  int64_t batch, int64_t seq, int64_t heads, Matrix dqkv) = 0;

  // out[i, :] = wte[tokens[i], :] + wpe[i % seq, :], out is [n, width] (n a multiple of seq).
  // A token outside [0, vocab) is Error(recipe) naming it and the vocabulary size.
  virtual void embedding_forward(const int32_t* tokens, int64_t seq, int64_t vocab,
                                 const float* wte, const float* wpe, Matrix out) = 0;
  // dwte[tokens[i], :] += dout[i, :] and dwpe[i % seq, :] += dout[i, :].
  virtual void embedding_backward(const int32_t* tokens, int64_t seq, ConstMatrix dout, float* dwte,
                                  float* dwpe) = 0;
};

}  // namespace dptrain
