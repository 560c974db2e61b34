// A GPT-style decoder-only transformer over the op table.
#include "core/model/gpt.hpp"

#include <algorithm>
#include <cmath>
#include <random>

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/tensor/random.hpp"

namespace dptrain {
namespace {

constexpr uint64_t kInitStream = 0x697074;  // derive_seed stream of the parameter init
constexpr int64_t kEvalChunkSequences = 8;  // bounds the workspace evaluate() needs
// The LM head works on a vocabulary padded to a multiple of this many classes (as llm.c pads
// it): with GPT-2's 50257, cuBLASLt falls back to slow kernels for the head's three matmuls
// (measured on an H200, GPT-2 124M in bf16: 84.5 ms a step; 74.8 with only the logits' rows
// padded; 54.1 with the vocabulary itself 50304). The padding classes have zero weights, so
// their logits are 0; the loss ignores them, their gradient stays 0, and the parameters, the
// checkpoint and the sampled distribution keep the real vocabulary.
constexpr int64_t kVocabAlign = 128;

size_t take(size_t& offset, int64_t count) {
  const size_t at = offset;
  offset += static_cast<size_t>(count);
  return at;
}

void fill_normal(std::mt19937_64& rng, float* out, int64_t count, double std) {
  std::span<float> span(out, static_cast<size_t>(count));
  fill_standard_normal(rng, span);
  for (float& v : span)
    v = static_cast<float>(v * std);
}

}  // namespace

GptLayout gpt_layout(const GptConfig& c) {
  GptLayout l;
  size_t at = 0;
  const int64_t mlp = c.mlp_ratio * c.width;
  l.wte = take(at, c.vocab * c.width);
  l.wpe = take(at, c.context * c.width);
  for (int64_t i = 0; i < c.layers; ++i) {
    GptLayerLayout b{};
    b.ln1_gamma = take(at, c.width);
    b.ln1_beta = take(at, c.width);
    b.qkv_weight = take(at, 3 * c.width * c.width);
    b.qkv_bias = take(at, 3 * c.width);
    b.proj_weight = take(at, c.width * c.width);
    b.proj_bias = take(at, c.width);
    b.ln2_gamma = take(at, c.width);
    b.ln2_beta = take(at, c.width);
    b.fc_weight = take(at, mlp * c.width);
    b.fc_bias = take(at, mlp);
    b.fc_proj_weight = take(at, c.width * mlp);
    b.fc_proj_bias = take(at, c.width);
    l.layers.push_back(b);
  }
  l.lnf_gamma = take(at, c.width);
  l.lnf_beta = take(at, c.width);
  l.total = at;
  return l;
}

Gpt::Gpt(GptConfig config, std::shared_ptr<Ops> ops, DType dtype)
    : config_(config),
      layout_(gpt_layout(config)),
      mlp_(config.mlp_ratio * config.width),
      ops_(std::move(ops)),
      dtype_(dtype),
      compute_(*ops_, dtype) {
  if (config_.width % config_.heads != 0) {
    throw Error(ErrorKind::internal, "gpt: width must be a multiple of heads");
  }
}

void Gpt::init_params(std::span<float> params, uint64_t seed) const {
  require_size("init_params: params", params.size());
  std::fill(params.begin(), params.end(), 0.0f);
  std::mt19937_64 rng(derive_seed(seed, kInitStream));
  const int64_t c = config_.width;
  const double residual_std = 0.02 / std::sqrt(2.0 * static_cast<double>(config_.layers));
  float* p = params.data();
  fill_normal(rng, p + layout_.wte, config_.vocab * c, 0.02);
  fill_normal(rng, p + layout_.wpe, config_.context * c, 0.02);
  for (const GptLayerLayout& b : layout_.layers) {
    std::fill_n(p + b.ln1_gamma, c, 1.0f);
    fill_normal(rng, p + b.qkv_weight, 3 * c * c, 0.02);
    fill_normal(rng, p + b.proj_weight, c * c, residual_std);
    std::fill_n(p + b.ln2_gamma, c, 1.0f);
    fill_normal(rng, p + b.fc_weight, mlp_ * c, 0.02);
    fill_normal(rng, p + b.fc_proj_weight, c * mlp_, residual_std);
  }
  std::fill_n(p + layout_.lnf_gamma, c, 1.0f);
}

std::vector<ParamTensor> Gpt::tensors() const {
  const auto c = static_cast<size_t>(config_.width);
  const auto wide = static_cast<size_t>(mlp_);
  std::vector<ParamTensor> out = {{layout_.wte, static_cast<size_t>(config_.vocab), c},
                                  {layout_.wpe, static_cast<size_t>(config_.context), c}};
  for (const GptLayerLayout& b : layout_.layers) {
    out.insert(out.end(), {ParamTensor::vector(b.ln1_gamma, c),
                           ParamTensor::vector(b.ln1_beta, c),
                           {b.qkv_weight, 3 * c, c},
                           ParamTensor::vector(b.qkv_bias, 3 * c),
                           {b.proj_weight, c, c},
                           ParamTensor::vector(b.proj_bias, c),
                           ParamTensor::vector(b.ln2_gamma, c),
                           ParamTensor::vector(b.ln2_beta, c),
                           {b.fc_weight, wide, c},
                           ParamTensor::vector(b.fc_bias, wide),
                           {b.fc_proj_weight, c, wide},
                           ParamTensor::vector(b.fc_proj_bias, c)});
  }
  out.push_back(ParamTensor::vector(layout_.lnf_gamma, c));
  out.push_back(ParamTensor::vector(layout_.lnf_beta, c));
  return out;
}

void Gpt::require_size(const char* what, size_t size) const {
  if (size != layout_.total) {
    throw Error(ErrorKind::internal, fmt::format("{} has {} floats, the model has {} parameters",
                                                 what, size, layout_.total));
  }
}

void Gpt::reserve(int64_t sequences, int64_t seq) {
  const int64_t rows = sequences * seq;
  const int64_t layers = config_.layers;
  const int64_t c = config_.width;
  Ops& ops = *ops_;
  ws_.rows = rows;
  ws_.sequences = sequences;
  ws_.seq = seq;
  ws_.host_inputs.resize(static_cast<size_t>(rows));
  ws_.host_targets.resize(static_cast<size_t>(rows));
  ws_.att_floats = ops.attention_state_floats(sequences, seq, config_.heads);
  if (ws_.inputs.bytes() < static_cast<size_t>(rows) * sizeof(int32_t)) {
    ws_.inputs = ops.allocate(static_cast<size_t>(rows) * sizeof(int32_t));
    ws_.targets = ops.allocate(static_cast<size_t>(rows) * sizeof(int32_t));
  }
  ensure(ops, ws_.residual, (layers + 1) * rows * c, dtype_);
  ensure(ops, ws_.mid, layers * rows * c, dtype_);
  ensure(ops, ws_.ln1, layers * rows * c, dtype_);
  ensure(ops, ws_.ln2, layers * rows * c, dtype_);
  ensure(ops, ws_.ln_stats, (2 * layers + 1) * 2 * rows, DType::f32);
  ensure(ops, ws_.qkv, layers * rows * 3 * c, dtype_);
  ensure(ops, ws_.att, layers * static_cast<int64_t>(ws_.att_floats), DType::f32);
  ensure(ops, ws_.att_out, layers * rows * c, dtype_);
  ensure(ops, ws_.fc, layers * rows * mlp_, dtype_);
  ensure(ops, ws_.gelu, layers * rows * mlp_, dtype_);
  ensure(ops, ws_.lnf, rows * c, dtype_);
  ensure(ops, ws_.logits, rows * logits_stride(), dtype_);
}

const void* Gpt::at(const void* params, size_t offset) const {
  return static_cast<const char*>(params) + offset * dtype_size(dtype_);
}

Matrix Gpt::rows_of(const Buffer& buffer, int64_t index, int64_t cols) const {
  const size_t offset = static_cast<size_t>(index * ws_.rows * cols) * dtype_size(dtype_);
  return {buffer.as<char>() + offset, ws_.rows, cols, dtype_};
}

int64_t Gpt::logits_stride() const {
  return (config_.vocab + kVocabAlign - 1) / kVocabAlign * kVocabAlign;
}

const void* Gpt::compute_params(std::span<const float> params) {
  const void* p = compute_.get(params);
  const int64_t padded = logits_stride();
  if (padded == config_.vocab) return p;
  const size_t row_bytes = static_cast<size_t>(config_.width) * dtype_size(dtype_);
  if (head_.bytes() < static_cast<size_t>(padded) * row_bytes) {
    head_ = ops_->allocate(static_cast<size_t>(padded) * row_bytes);  // zeroed: the padding
  }
  ops_->copy(at(p, layout_.wte), head_.data(), static_cast<size_t>(config_.vocab) * row_bytes);
  return p;
}

const void* Gpt::head_weight(const void* p) const {
  return logits_stride() == config_.vocab ? at(p, layout_.wte) : head_.data();
}

Matrix Gpt::logits() const {
  return {ws_.logits.data(), ws_.rows, config_.vocab, dtype_, logits_stride()};
}

float* Gpt::stats(int64_t which, int64_t kind) {
  return ws_.ln_stats.as<float>() + (which * 2 + kind) * ws_.rows;
}

void Gpt::load_windows(const int32_t* windows, int64_t sequences, int64_t seq) {
  reserve(sequences, seq);
  for (int64_t b = 0; b < sequences; ++b) {
    const int32_t* w = windows + b * (seq + 1);
    std::copy(w, w + seq, ws_.host_inputs.begin() + b * seq);
    std::copy(w + 1, w + seq + 1, ws_.host_targets.begin() + b * seq);
  }
  const size_t bytes = static_cast<size_t>(ws_.rows) * sizeof(int32_t);
  ops_->upload(ws_.host_inputs.data(), ws_.inputs.data(), bytes);
  ops_->upload(ws_.host_targets.data(), ws_.targets.data(), bytes);
}

Matrix Gpt::forward(const void* p) {
  const int64_t c = config_.width;
  Matrix x = rows_of(ws_.residual, 0, c);
  ops_->embedding_forward(ws_.inputs.as<int32_t>(), ws_.seq, config_.vocab, at(p, layout_.wte),
                          at(p, layout_.wpe), x);
  for (int64_t l = 0; l < config_.layers; ++l) {
    const GptLayerLayout& b = layout_.layers[static_cast<size_t>(l)];
    // Attention: mid = x + proj(attention(ln1(x)))
    const Matrix ln1 = rows_of(ws_.ln1, l, c);
    ops_->layernorm_forward(x, at(p, b.ln1_gamma), at(p, b.ln1_beta), ln1, stats(2 * l, 0),
                            stats(2 * l, 1));
    const Matrix qkv = rows_of(ws_.qkv, l, 3 * c);
    linear(ln1, at(p, b.qkv_weight), at(p, b.qkv_bias), qkv, nullptr);
    const Matrix att_out = rows_of(ws_.att_out, l, c);
    ops_->attention_forward(qkv, ws_.sequences, ws_.seq, config_.heads, att_out,
                            ws_.att.as<float>() + static_cast<size_t>(l) * ws_.att_floats);
    const Matrix mid = rows_of(ws_.mid, l, c);
    linear(att_out, at(p, b.proj_weight), at(p, b.proj_bias), mid, x.data);
    // MLP: next = mid + fc_proj(gelu(fc(ln2(mid))))
    const Matrix ln2 = rows_of(ws_.ln2, l, c);
    ops_->layernorm_forward(mid, at(p, b.ln2_gamma), at(p, b.ln2_beta), ln2, stats(2 * l + 1, 0),
                            stats(2 * l + 1, 1));
    const Matrix fc = rows_of(ws_.fc, l, mlp_);
    const Matrix gelu = rows_of(ws_.gelu, l, mlp_);
    ops_->linear_activation(ln2, at(p, b.fc_weight), at(p, b.fc_bias), Activation::gelu, fc, gelu);
    const Matrix next = rows_of(ws_.residual, l + 1, c);
    linear(gelu, at(p, b.fc_proj_weight), at(p, b.fc_proj_bias), next, mid.data);
    x = next;
  }
  const Matrix lnf = rows_of(ws_.lnf, 0, c);
  ops_->layernorm_forward(x, at(p, layout_.lnf_gamma), at(p, layout_.lnf_beta), lnf,
                          stats(2 * config_.layers, 0), stats(2 * config_.layers, 1));
  // Over the padded vocabulary: the padding classes' logits are 0 (their weights are).
  const int64_t padded = logits_stride();
  ops_->gemm(lnf, Transpose::no, ConstMatrix{head_weight(p), padded, c, dtype_}, Transpose::yes,
             Matrix{ws_.logits.data(), ws_.rows, padded, dtype_}, 1.0f, 0.0f);
  return logits();
}

void Gpt::linear(ConstMatrix x, const void* weight, const void* bias, Matrix y,
                 const void* residual) {
  ops_->linear(x, weight, bias, y, residual);
}

void Gpt::linear_backward(ConstMatrix dy, ConstMatrix x, const void* weight, float* weight_grad,
                          float* bias_grad, Matrix dx) {
  ops_->linear_weight_grad(dy, x, weight_grad, bias_grad);
  ops_->gemm(dy, Transpose::no, ConstMatrix{weight, dy.cols, x.cols, dtype_}, Transpose::no, dx,
             1.0f, 0.0f);
}

// Expects ws_.logits to hold d(loss)/d(logits), with 0 in the padding classes' columns.
void Gpt::backward(const void* p, float* g) {
  const int64_t c = config_.width;
  const int64_t rows = ws_.rows;
  Ops& ops = *ops_;
  ensure(ops, d_residual_, rows * c, dtype_);
  ensure(ops, d_mid_, rows * c, dtype_);
  ensure(ops, d_tmp_, rows * c, dtype_);
  ensure(ops, d_wide_, rows * mlp_, dtype_);
  ensure(ops, d_qkv_, rows * 3 * c, dtype_);
  const Matrix dx{d_residual_.data(), rows, c, dtype_};
  const Matrix dmid{d_mid_.data(), rows, c, dtype_};
  const Matrix dtmp{d_tmp_.data(), rows, c, dtype_};
  const Matrix dwide{d_wide_.data(), rows, mlp_, dtype_};
  const Matrix dqkv{d_qkv_.data(), rows, 3 * c, dtype_};

  // The tied head: logits = lnf wte^T, over the padded vocabulary, whose padding classes have a
  // gradient of 0 (the loss writes only the real classes' columns; the forward left 0 in the
  // others). wte's gradient takes the real classes' rows.
  const int64_t vocab = config_.vocab;
  const int64_t padded = logits_stride();
  const ConstMatrix dlogits{ws_.logits.data(), rows, padded, dtype_};
  const ConstMatrix lnf = rows_of(ws_.lnf, 0, c);
  if (padded == vocab) {
    ops.gemm(dlogits, Transpose::yes, lnf, Transpose::no, Matrix{g + layout_.wte, vocab, c}, 1.0f,
             1.0f);
  } else {
    ensure(ops, head_grad_, padded * c, DType::f32);
    ops.gemm(dlogits, Transpose::yes, lnf, Transpose::no, Matrix{head_grad_.data(), padded, c},
             1.0f, 0.0f);
    ops.axpy(vocab * c, 1.0f, head_grad_.as<float>(), g + layout_.wte);
  }
  ops.gemm(dlogits, Transpose::no, ConstMatrix{head_weight(p), padded, c, dtype_}, Transpose::no,
           dtmp, 1.0f, 0.0f);
  ops.layernorm_backward(rows_of(ws_.residual, config_.layers, c), at(p, layout_.lnf_gamma),
                         stats(2 * config_.layers, 0), stats(2 * config_.layers, 1), dtmp, dx,
                         g + layout_.lnf_gamma, g + layout_.lnf_beta);
  gradients_ready(layout_.lnf_gamma);

  for (int64_t l = config_.layers; l-- > 0;) {
    const GptLayerLayout& b = layout_.layers[static_cast<size_t>(l)];
    // next = mid + fc_proj(gelu(fc)): dx flows to mid unchanged and into the MLP, where dwide =
    // d(loss)/d(fc), through fc_proj and the GELU.
    ops.linear_weight_grad(dx, rows_of(ws_.gelu, l, mlp_), g + b.fc_proj_weight,
                           g + b.fc_proj_bias);
    ops.linear_activation_grad(dx, at(p, b.fc_proj_weight), Activation::gelu,
                               rows_of(ws_.fc, l, mlp_), dwide);
    linear_backward(dwide, rows_of(ws_.ln2, l, c), at(p, b.fc_weight), g + b.fc_weight,
                    g + b.fc_bias, dtmp);
    ops.layernorm_backward(rows_of(ws_.mid, l, c), at(p, b.ln2_gamma), stats(2 * l + 1, 0),
                           stats(2 * l + 1, 1), dtmp, dmid, g + b.ln2_gamma, g + b.ln2_beta);
    ops.add(dx, dmid);
    // mid = x + proj(attention): dmid flows to x unchanged and into the attention.
    linear_backward(dmid, rows_of(ws_.att_out, l, c), at(p, b.proj_weight), g + b.proj_weight,
                    g + b.proj_bias, dtmp);
    ops.attention_backward(rows_of(ws_.qkv, l, 3 * c), rows_of(ws_.att_out, l, c),
                           ws_.att.as<float>() + static_cast<size_t>(l) * ws_.att_floats, dtmp,
                           ws_.sequences, ws_.seq, config_.heads, dqkv);
    linear_backward(dqkv, rows_of(ws_.ln1, l, c), at(p, b.qkv_weight), g + b.qkv_weight,
                    g + b.qkv_bias, dtmp);
    ops.layernorm_backward(rows_of(ws_.residual, l, c), at(p, b.ln1_gamma), stats(2 * l, 0),
                           stats(2 * l, 1), dtmp, dx, g + b.ln1_gamma, g + b.ln1_beta);
    ops.add(dmid, dx);
    gradients_ready(b.ln1_gamma);
  }
  ops.embedding_backward(ws_.inputs.as<int32_t>(), ws_.seq, dx, g + layout_.wte, g + layout_.wpe);
  gradients_ready(0);
}

double Gpt::forward_backward(std::span<const float> params, const Batch& batch,
                             std::span<float> grads, float scale) {
  require_size("forward_backward: params", params.size());
  require_size("forward_backward: grads", grads.size());
  if (batch.size <= 0) return 0.0;
  load_windows(batch.y, batch.size, config_.context);
  const void* p = compute_params(params);
  const Matrix logits = forward(p);
  const int32_t* targets = ws_.targets.as<int32_t>();
  const double loss = ops_->softmax_cross_entropy(logits, targets, logits, scale);
  backward(p, grads.data());
  return loss;
}

EvalStats Gpt::evaluate(std::span<const float> params, const Batch& batch) {
  require_size("evaluate: params", params.size());
  EvalStats stats;
  const int64_t seq = config_.context;
  const void* p = compute_params(params);
  for (int64_t begin = 0; begin < batch.size; begin += kEvalChunkSequences) {
    const int64_t sequences = std::min(kEvalChunkSequences, batch.size - begin);
    load_windows(batch.y + begin * (seq + 1), sequences, seq);
    const Matrix logits = forward(p);
    const int32_t* targets = ws_.targets.as<int32_t>();
    stats.correct += ops_->count_correct(logits, targets);
    stats.loss_sum += ops_->softmax_cross_entropy_forward(logits, targets, logits) *
                      static_cast<double>(ws_.rows);
    stats.count += ws_.rows;
  }
  return stats;
}

std::vector<float> Gpt::next_token_logits(std::span<const float> params,
                                          std::span<const int32_t> tokens) {
  require_size("next_token_logits: params", params.size());
  if (tokens.empty()) throw Error(ErrorKind::internal, "next_token_logits: no tokens");
  const auto seq = std::min<int64_t>(static_cast<int64_t>(tokens.size()), config_.context);
  reserve(1, seq);
  std::copy(tokens.end() - seq, tokens.end(), ws_.host_inputs.begin());
  ops_->upload(ws_.host_inputs.data(), ws_.inputs.data(),
               static_cast<size_t>(seq) * sizeof(int32_t));
  const Matrix logits = forward(compute_params(params));
  return download_row(*ops_, logits, seq - 1);
}

std::string Gpt::describe() const {
  return fmt::format("gpt {} layers, {} heads, width {}, context {}, vocab {}, {} parameters",
                     config_.layers, config_.heads, config_.width, config_.context, config_.vocab,
                     with_thousands(layout_.total));
}

GptConfig gpt_config(const ModelSpec& spec) {
  GptConfig c;
  c.vocab = spec.vocab;
  c.context = spec.context;
  c.layers = spec.layers;
  c.heads = spec.heads;
  c.width = spec.width;
  c.mlp_ratio = spec.mlp_ratio;
  return c;
}

std::unique_ptr<Model> make_gpt(const ModelSpec& spec, std::shared_ptr<Ops> ops, DType dtype) {
  if (spec.width % spec.heads != 0) {
    throw Error(ErrorKind::recipe, fmt::format("model.width: must be a multiple of model.heads "
                                               "({}), got {}",
                                               spec.heads, spec.width));
  }
  return std::make_unique<Gpt>(gpt_config(spec), std::move(ops), dtype);
}

}  // namespace dptrain
