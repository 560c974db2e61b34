// The op table: the device-neutral kernels models and optimizers are written against. CpuOps
// (core/tensor/cpu_ops.hpp) is the reference; CudaOps (kernels/cuda_ops.hpp) the GPU one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "core/tensor/tensor.hpp"

namespace dptrain {

enum class Transpose { no, yes };
enum class Activation { relu, gelu };  // gelu: the tanh approximation

// The compute type of a train.precision ("fp32", "bf16", "fp16"); Error(recipe) otherwise.
DType parse_precision(const std::string& precision);

// "relu" | "gelu"; anything else is Error(recipe) naming model.activation.
Activation parse_activation(const std::string& name);
const char* activation_name(Activation activation);

// The constants of one AdamW update (PyTorch's AdamW), for step t (1-based):
//   m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p = p * decay - step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps)
// with step_size = lr / (1 - b1^t), inv_sqrt_bc2 = 1 / sqrt(1 - b2^t), decay = 1 - lr * wd.
struct AdamWCoefficients {
  float step_size = 0, inv_sqrt_bc2 = 1, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, decay = 1;
};

// All pointers belong to the op table's device (host memory for CpuOps, device memory for
// CudaOps) unless a method says otherwise. Unless a method says otherwise, outputs must not alias
// inputs, and activations (every Matrix and the parameter pointers read with them: biases,
// LayerNorm gamma/beta, embeddings) share one dtype; parameter gradients, LayerNorm statistics
// and attention state are f32. Matrices are contiguous except where a method says it takes padded
// rows (a stride wider than cols). A CPU op table takes f32 only. Shape or dtype mismatches throw
// Error(internal): they are bugs in the caller. Device failures throw Error(cuda) naming the
// kernel. Ops run in order on the table's stream; results a method returns to the host (losses,
// counts, norms) wait for the work before them.
class Ops {
 public:
  virtual ~Ops() = default;

  // "cpu" or "cuda:N".
  virtual std::string device() const = 0;

  // ---- Memory.
  // `bytes` of zeroed device memory (host memory for CpuOps), freed with the Buffer.
  virtual Buffer allocate(size_t bytes) = 0;
  // Copies between host memory and the device; both wait until the copy is done.
  virtual void upload(const void* host, void* device, size_t bytes) = 0;
  virtual void download(const void* device, void* host, size_t bytes) = 0;
  // Device to device, in stream order. src and dst must not overlap.
  virtual void copy(const void* src, void* dst, size_t bytes) = 0;
  virtual void fill_zero(void* data, size_t bytes) = 0;
  // Waits for everything queued; a device error of an earlier op surfaces here at the latest.
  virtual void synchronize() = 0;
  // Makes the calling thread's ops (and CUDA libraries') go to this table's device: CUDA's current
  // device is per thread, so a thread other than the one that made the table (the gradient
  // exchange's) calls this first. Nothing to do on the CPU.
  virtual void bind_thread() {}
  // Called by the trainer where its steady steps begin (after the warm-up its throughput leaves
  // out: first calls' plans, lazily loaded kernels): an op table that profiles (DPTRAIN_PROFILE)
  // forgets what it measured so far, so that its profile shows the steady state. Nothing to do
  // on the CPU.
  virtual void restart_profile() {}
  // A point in this table's stream, for work another thread issues on its own stream (the
  // gradient exchange's collectives): record() marks the ops queued on the stream so far (by any
  // thread); handle() is what a device communicator's stream waits on (Communicator::start_after),
  // a cudaEvent_t for the CUDA table. Ops that run as they are called (the CPU's) have nothing to
  // mark: the default does nothing, and its handle is null.
  class Marker {
   public:
    virtual ~Marker() = default;
    virtual void record() {}
    virtual void* handle() const { return nullptr; }
  };
  virtual std::unique_ptr<Marker> make_marker() { return std::make_unique<Marker>(); }
  // dst[i] = src[i] converted (round to nearest even), n elements; between f32 and a 16-bit type
  // (the CPU op table too: gradients travel compressed), or a copy when the types are equal.
  virtual void cast(const void* src, DType from, void* dst, DType to, int64_t n) = 0;

  // ---- Dense layers.
  // c = alpha * op(a) * op(b) + beta * c, op = optional transpose. beta = 1 accumulates. a and b
  // share a dtype; c has it too, or is f32 (weight gradients accumulate in f32). a, b and c may
  // have padded rows.
  virtual void gemm(ConstMatrix a, Transpose transpose_a, ConstMatrix b, Transpose transpose_b,
                    Matrix c, float alpha, float beta) = 0;
  // y = x W^T + bias + residual, W [y.cols, x.cols] in x's dtype, bias y.cols entries or null,
  // residual a contiguous [y.rows, y.cols] matrix in y's dtype or null: y itself (y += ...), or
  // a matrix that does not overlap y (a residual connection). The default is a copy of the
  // residual, gemm and add_bias_rows; a device may fuse them.
  virtual void linear(ConstMatrix x, const void* weight, const void* bias, Matrix y,
                      const void* residual) {
    if (!x.contiguous() || !y.contiguous()) {
      throw Error(ErrorKind::internal, "linear: x and y must be contiguous, not padded rows");
    }
    if (residual != nullptr && residual != y.data) copy(residual, y.data, y.bytes());
    gemm(x, Transpose::no, ConstMatrix{weight, y.cols, x.cols, x.dtype}, Transpose::yes, y, 1.0f,
         residual != nullptr ? 1.0f : 0.0f);
    if (bias != nullptr) add_bias_rows(y, bias);
  }
  // A linear layer and the activation after it: pre = x W^T + bias (bias may be null), out =
  // f(pre); pre is kept for the backward (linear_activation_grad). pre and out are contiguous,
  // of one shape, and do not overlap. The default is linear then activation_forward; a device
  // may fuse them.
  virtual void linear_activation(ConstMatrix x, const void* weight, const void* bias,
                                 Activation activation, Matrix pre, Matrix out) {
    linear(x, weight, bias, pre, nullptr);
    activation_forward(activation, pre, out);
  }
  // A linear layer's parameter gradients: dweight [dy.cols, x.cols] (f32) += dy^T x and, unless
  // null, dbias += the column sums of dy. The default is gemm then bias_grad; a device may fuse
  // them.
  virtual void linear_weight_grad(ConstMatrix dy, ConstMatrix x, float* dweight, float* dbias) {
    gemm(dy, Transpose::yes, x, Transpose::no, Matrix{dweight, dy.cols, x.cols}, 1.0f, 1.0f);
    if (dbias != nullptr) bias_grad(dy, dbias);
  }
  // The gradient through a linear layer and the activation before it, for y = f(pre) W^T + b:
  // dpre = (dy W) * f'(pre), W [dy.cols, dpre.cols] in dy's dtype, pre and dpre of one shape
  // (dpre is overwritten and must not overlap pre or dy). The default is gemm then
  // activation_backward; a device may fuse them.
  virtual void linear_activation_grad(ConstMatrix dy, const void* weight, Activation activation,
                                      ConstMatrix pre, Matrix dpre) {
    gemm(dy, Transpose::no, ConstMatrix{weight, dy.cols, dpre.cols, dy.dtype}, Transpose::no, dpre,
         1.0f, 0.0f);
    activation_backward(activation, pre, dpre, dpre);
  }
  // x[i, :] += bias for every row i; bias has x.cols entries of x's dtype.
  virtual void add_bias_rows(Matrix x, const void* bias) = 0;
  // bias_grad[j] += sum_i dy[i, j] (f32): accumulates like the weight gradients.
  virtual void bias_grad(ConstMatrix dy, float* bias_grad) = 0;

  // out = f(pre). out may alias pre.
  virtual void activation_forward(Activation activation, ConstMatrix pre, Matrix out) = 0;
  // dpre = dout * f'(pre). dpre may alias dout.
  virtual void activation_backward(Activation activation, ConstMatrix pre, ConstMatrix dout,
                                   Matrix dpre) = 0;

  // probs = softmax(logits) row-wise; returns the mean over rows of -log probs[i, labels[i]],
  // computed with a stable log-sum-exp in f32 or better. probs may alias logits. labels are
  // int32 on the device. A label outside [0, cols) is Error(recipe).
  virtual double softmax_cross_entropy_forward(ConstMatrix logits, const int32_t* labels,
                                               Matrix probs) = 0;
  // dlogits = scale * (probs - onehot(labels)) / rows: the gradient of scale * mean loss.
  // dlogits may alias probs.
  virtual void softmax_cross_entropy_backward(ConstMatrix probs, const int32_t* labels,
                                              Matrix dlogits, float scale) = 0;
  // Both in one: returns the forward's mean loss and writes the backward's dlogits (which may
  // alias logits). A device may fuse them (one pass less over the logits, no probs).
  virtual double softmax_cross_entropy(ConstMatrix logits, const int32_t* labels, Matrix dlogits,
                                       float scale) {
    const double loss = softmax_cross_entropy_forward(logits, labels, dlogits);
    softmax_cross_entropy_backward(dlogits, labels, dlogits, scale);
    return loss;
  }
  // Rows whose largest score (first one on ties) is at the label's column.
  virtual int64_t count_correct(ConstMatrix scores, const int32_t* labels) = 0;
  // The softmax cross-entropy ops and count_correct take padded rows: the columns past cols are
  // not part of the matrix, and never enter a result (a 16-bit CPU table writes them back as
  // they were).

  // y += x elementwise, in the activation dtype (residual connections).
  virtual void add(ConstMatrix x, Matrix y) = 0;

  // ---- Flat f32 buffers (gradients, parameters, optimizer state).
  // y += alpha * x, over n elements.
  virtual void axpy(int64_t n, float alpha, const float* x, float* y) = 0;
  // x *= alpha, over n elements.
  virtual void scale(int64_t n, float alpha, float* x) = 0;
  // The sum of x[i]^2 in double, in an order fixed for a given n (deterministic); inf or NaN when
  // any element is not finite.
  virtual double sum_squares(const float* x, int64_t n) = 0;
  // One AdamW update of n parameters; m and v are the moments.
  virtual void adamw_update(float* params, const float* grads, float* m, float* v, int64_t n,
                            const AdamWCoefficients& k) = 0;
  // SGD with momentum: v = momentum v + g; p = p * decay - rate * (nesterov ? g + momentum v : v).
  virtual void sgd_update(float* params, const float* grads, float* velocity, int64_t n,
                          float momentum, float decay, float rate, bool nesterov) = 0;

  // ---- Transformer ops (the GPT model). Rows are tokens: row b * seq + t is position t of
  // sequence b.

  // out[i, :] = (x[i, :] - mean_i) * rstd_i * gamma + beta, rstd_i = 1 / sqrt(var_i + 1e-5)
  // (biased variance). mean and rstd (f32) get one value per row, for the backward pass.
  virtual void layernorm_forward(ConstMatrix x, const void* gamma, const void* beta, Matrix out,
                                 float* mean, float* rstd) = 0;
  // dx = the gradient through the normalisation (overwritten); dgamma and dbeta (f32)
  // ACCUMULATE (+=), like every parameter gradient. dx may not alias dout.
  virtual void layernorm_backward(ConstMatrix x, const void* gamma, const float* mean,
                                  const float* rstd, ConstMatrix dout, Matrix dx, float* dgamma,
                                  float* dbeta) = 0;

  // Causal multi-head self-attention. qkv is [batch * seq, 3 * width]: each row holds q, then
  // k, then v, each `width` wide; head h uses columns [h * hd, (h + 1) * hd) of each, hd = width
  // / heads. out [batch * seq, width] is the heads' outputs side by side:
  //   att[b, h, t, :] = softmax over s <= t of (q_t . k_s) / sqrt(hd)  (0 for s > t)
  //   out[b * seq + t, h * hd : (h + 1) * hd] = sum_s att[b, h, t, s] * v_s
  // The softmax is the stable one. `state` (attention_state_floats() f32s) keeps what the
  // backward pass needs: the CPU keeps the probabilities [batch, heads, seq, seq]; a device may
  // keep less (a flash-style kernel keeps one log-sum-exp per row and recomputes).
  virtual size_t attention_state_floats(int64_t batch, int64_t seq, int64_t heads) const = 0;
  virtual void attention_forward(ConstMatrix qkv, int64_t batch, int64_t seq, int64_t heads,
                                 Matrix out, float* state) = 0;
  // dqkv [batch * seq, 3 * width] = the gradient of the loss with respect to qkv, given dout
  // and the forward's qkv, out and state (overwritten, not accumulated).
  virtual void attention_backward(ConstMatrix qkv, ConstMatrix out, const float* state,
                                  ConstMatrix dout, int64_t batch, int64_t seq, int64_t heads,
                                  Matrix dqkv) = 0;

  // out[i, :] = wte[tokens[i], :] + wpe[i % seq, :], out is [n, width] (n a multiple of seq);
  // wte and wpe in out's dtype. A token outside [0, vocab) is Error(recipe) naming it and the
  // vocabulary size (a device may report it at the next synchronisation).
  virtual void embedding_forward(const int32_t* tokens, int64_t seq, int64_t vocab, const void* wte,
                                 const void* wpe, Matrix out) = 0;
  // dwte[tokens[i], :] += dout[i, :] and dwpe[i % seq, :] += dout[i, :] (f32).
  virtual void embedding_backward(const int32_t* tokens, int64_t seq, ConstMatrix dout, float* dwte,
                                  float* dwpe) = 0;
};

}  // namespace dptrain
