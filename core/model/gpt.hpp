// A GPT-style decoder-only transformer over the op table: token and learned position embeddings,
// pre-LayerNorm blocks of causal multi-head self-attention and a GELU MLP with residuals, a final
// LayerNorm, and an LM head tied to the token embedding.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "core/model/model.hpp"
#include "core/tensor/ops.hpp"

namespace dptrain {

struct GptConfig {
  int64_t vocab = 256;
  int64_t context = 128;
  int64_t layers = 4;
  int64_t heads = 4;
  int64_t width = 128;
  int64_t mlp_ratio = 4;
};

// Where each tensor lives in the flat parameter (and gradient) buffer. Linear weights are
// [out, in] (PyTorch's layout; y = x W^T + b).
struct GptLayerLayout {
  size_t ln1_gamma, ln1_beta;
  size_t qkv_weight, qkv_bias;    // [3 * width, width], [3 * width]
  size_t proj_weight, proj_bias;  // [width, width], [width]
  size_t ln2_gamma, ln2_beta;
  size_t fc_weight, fc_bias;            // [mlp, width], [mlp]
  size_t fc_proj_weight, fc_proj_bias;  // [width, mlp], [width]
};

struct GptLayout {
  size_t wte = 0;  // [vocab, width], also the LM head
  size_t wpe = 0;  // [context, width]
  std::vector<GptLayerLayout> layers;
  size_t lnf_gamma = 0, lnf_beta = 0;
  size_t total = 0;
};

// The parameter layout of a configuration (its total is the exact parameter count).
GptLayout gpt_layout(const GptConfig& config);

class Gpt final : public Model {
 public:
  Gpt(GptConfig config, std::shared_ptr<Ops> ops, DType dtype = DType::f32);

  size_t num_params() const override { return layout_.total; }
  // Normal(0, 0.02) weights and embeddings; the projections into the residual stream (attention
  // output, MLP output) scaled by 1/sqrt(2 * layers); zero biases; LayerNorm gamma 1, beta 0.
  void init_params(std::span<float> params, uint64_t seed) const override;
  // batch.y holds batch.size windows of context + 1 tokens: position t predicts token t + 1.
  double forward_backward(std::span<const float> params, const Batch& batch, std::span<float> grads,
                          float scale) override;
  // Sums over the predicted tokens: count is tokens, correct the argmax hits.
  EvalStats evaluate(std::span<const float> params, const Batch& batch) override;
  std::string describe() const override;
  std::vector<ParamTensor> tensors() const override;

  // The logits [vocab] for the token after `tokens` (its last `context` tokens are used).
  std::vector<float> next_token_logits(std::span<const float> params,
                                       std::span<const int32_t> tokens);

  const GptConfig& config() const { return config_; }
  const GptLayout& layout() const { return layout_; }

 private:
  // Activations of one forward pass over `sequences` sequences of `seq` tokens, kept for the
  // backward pass, on the op table's device in the compute dtype (statistics in f32). Grown,
  // never shrunk.
  struct Workspace {
    int64_t rows = 0, sequences = 0, seq = 0;
    std::vector<int32_t> host_inputs, host_targets;  // [rows], staged for the device
    Buffer inputs, targets;                          // int32 [rows]
    Buffer residual;        // [layers + 1][rows, width]: each layer's input, then the final stream
    Buffer mid;             // [layers][rows, width]: after attention
    Buffer ln1, ln2;        // [layers][rows, width]
    Buffer ln_stats;        // f32 [2 * layers + 1][2][rows]: mean, rstd
    Buffer qkv;             // [layers][rows, 3 * width]
    Buffer att;             // f32 [layers][attention state]
    Buffer att_out;         // [layers][rows, width]
    Buffer fc, gelu;        // [layers][rows, mlp]
    Buffer lnf;             // [rows, width]
    Buffer logits;          // [rows, logits_stride()]: the padded vocabulary's logits
    size_t att_floats = 0;  // attention state per layer
  };
  void require_size(const char* what, size_t size) const;
  void reserve(int64_t sequences, int64_t seq);
  // Fills inputs and targets from windows of seq + 1 tokens and uploads them.
  void load_windows(const int32_t* windows, int64_t sequences, int64_t seq);
  // The forward pass over ws_.inputs with compute-dtype parameters; returns the logits.
  Matrix forward(const void* params);
  void backward(const void* params, float* grads);
  // y = x W^T + b (+ residual, which may be y), W [y.cols, x.cols]: Ops::linear.
  void linear(ConstMatrix x, const void* weight, const void* bias, Matrix y, const void* residual);
  // dW += dy^T x, db += the column sums of dy, dx = dy W (overwritten).
  void linear_backward(ConstMatrix dy, ConstMatrix x, const void* weight, float* weight_grad,
                       float* bias_grad, Matrix dx);

  // The compute-dtype parameter at `offset` of the flat buffer `params`.
  const void* at(const void* params, size_t offset) const;
  Matrix rows_of(const Buffer& buffer, int64_t index, int64_t cols) const;
  // The vocabulary padded for the LM head's matmuls, and the real classes' logits (rows that
  // far apart).
  int64_t logits_stride() const;
  Matrix logits() const;
  // The compute-dtype parameters for one call (forward_backward, evaluate, a sample), with head_
  // refreshed from them.
  const void* compute_params(std::span<const float> params);
  // The LM head's compute-dtype weight over the padded vocabulary: wte itself when no padding
  // is needed, else head_ (wte's rows as compute_params copied them, then zero rows).
  const void* head_weight(const void* params) const;
  float* stats(int64_t which, int64_t kind);  // which: 2l (ln1), 2l+1 (ln2), 2L (lnf)

  GptConfig config_;
  GptLayout layout_;
  int64_t mlp_ = 0;
  std::shared_ptr<Ops> ops_;
  DType dtype_;
  ComputeParams compute_;
  Workspace ws_;
  Buffer d_residual_, d_mid_, d_tmp_, d_wide_, d_qkv_;  // backward scratch
  Buffer head_;                                         // see head_weight
  Buffer head_grad_;  // f32 [logits_stride(), width]: the padded head's weight gradient
};

// The configuration a recipe's model spec names (no checks).
GptConfig gpt_config(const ModelSpec& spec);

// The GPT a recipe names; Error(recipe) naming a bad field.
std::unique_ptr<Model> make_gpt(const ModelSpec& spec, std::shared_ptr<Ops> ops,
                                DType dtype = DType::f32);

}  // namespace dptrain
