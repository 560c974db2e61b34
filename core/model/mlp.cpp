// A multi-layer perceptron over the op table: Linear layers with an activation between them.
#include "core/model/mlp.hpp"

#include <algorithm>
#include <cmath>
#include <random>

#include "core/error.hpp"
#include "core/tensor/cpu_ops.hpp"
#include "core/tensor/random.hpp"

namespace dptrain {
namespace {

constexpr uint64_t kInitStream = 0x1a17;  // derive_seed stream of the parameter init
constexpr int64_t kEvalChunkRows = 512;   // bounds the workspace evaluate() needs

void require_positive(const char* field, int64_t value, int64_t minimum) {
  if (value < minimum) {
    throw Error(ErrorKind::recipe, std::string(field) + ": must be at least " +
                                       std::to_string(minimum) + ", got " + std::to_string(value));
  }
}

}  // namespace

Mlp::Mlp(std::vector<int64_t> widths, Activation activation, std::unique_ptr<Ops> ops)
    : widths_(std::move(widths)), activation_(activation), ops_(std::move(ops)) {
  if (widths_.size() < 2) throw Error(ErrorKind::internal, "mlp: needs input and output widths");
  size_t offset = 0;
  int64_t column = 0;
  for (size_t l = 0; l + 1 < widths_.size(); ++l) {
    LinearLayout layer;
    layer.in = widths_[l];
    layer.out = widths_[l + 1];
    layer.weight_offset = offset;
    offset += static_cast<size_t>(layer.in * layer.out);
    layer.bias_offset = offset;
    offset += static_cast<size_t>(layer.out);
    layers_.push_back(layer);

    pre_offset_.push_back(column);
    column += layer.out;
    const bool hidden = l + 2 < widths_.size();
    post_offset_.push_back(hidden ? column : -1);
    if (hidden) column += layer.out;
  }
  num_params_ = offset;
  workspace_width_ = column;
}

void Mlp::init_params(std::span<float> params, uint64_t seed) const {
  require_size("init_params: params", params.size());
  std::mt19937_64 rng(derive_seed(seed, kInitStream));
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LinearLayout& layer = layers_[l];
    // He-uniform (variance 2/in) keeps activations' scale through relu/gelu; the output layer,
    // with no activation after it, gets variance 1/in so the first logits are O(1).
    const bool output = l + 1 == layers_.size();
    const double bound = std::sqrt((output ? 3.0 : 6.0) / static_cast<double>(layer.in));
    float* w = params.data() + layer.weight_offset;
    for (int64_t i = 0; i < layer.in * layer.out; ++i) {
      w[i] = static_cast<float>(bound * (2.0 * uniform01(rng) - 1.0));
    }
    std::fill_n(params.data() + layer.bias_offset, layer.out, 0.0f);
  }
}

void Mlp::require_size(const char* what, size_t size) const {
  if (size != num_params_) {
    throw Error(ErrorKind::internal, std::string(what) + " has " + std::to_string(size) +
                                         " floats, the model has " + std::to_string(num_params_) +
                                         " parameters");
  }
}

void Mlp::reserve_rows(int64_t rows) {
  if (rows <= capacity_rows_) return;
  capacity_rows_ = rows;
  workspace_.assign(static_cast<size_t>(rows * workspace_width_), 0.0f);
}

Matrix Mlp::pre_activation(size_t layer, int64_t rows) {
  return {workspace_.data() + capacity_rows_ * pre_offset_[layer], rows, layers_[layer].out};
}

Matrix Mlp::post_activation(size_t layer, int64_t rows) {
  return {workspace_.data() + capacity_rows_ * post_offset_[layer], rows, layers_[layer].out};
}

Matrix Mlp::forward(const float* params, const float* x, int64_t rows) {
  ConstMatrix input{x, rows, widths_.front()};
  Matrix pre;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LinearLayout& layer = layers_[l];
    const ConstMatrix weight{params + layer.weight_offset, layer.out, layer.in};
    pre = pre_activation(l, rows);
    ops_->gemm(input, Transpose::no, weight, Transpose::yes, pre, 1.0f, 0.0f);
    ops_->add_bias_rows(pre, params + layer.bias_offset);
    if (l + 1 < layers_.size()) {
      const Matrix post = post_activation(l, rows);
      ops_->activation_forward(activation_, pre, post);
      input = post;
    }
  }
  return pre;
}

double Mlp::forward_backward(std::span<const float> params, const Batch& batch,
                             std::span<float> grads, float scale) {
  require_size("forward_backward: params", params.size());
  require_size("forward_backward: grads", grads.size());
  if (batch.size <= 0) return 0.0;
  reserve_rows(batch.size);
  const int64_t rows = batch.size;

  // Softmax, loss gradient and the gradient of every layer's output overwrite the activations in
  // place, once nothing later reads them: the backward pass needs no memory of its own.
  Matrix delta = forward(params.data(), batch.x, rows);
  const double loss = ops_->softmax_cross_entropy_forward(delta, batch.y, delta);
  ops_->softmax_cross_entropy_backward(delta, batch.y, delta, scale);

  for (size_t l = layers_.size(); l-- > 0;) {
    const LinearLayout& layer = layers_[l];
    const ConstMatrix input =
        l == 0 ? ConstMatrix{batch.x, rows, layer.in} : ConstMatrix(post_activation(l - 1, rows));
    const Matrix weight_grad{grads.data() + layer.weight_offset, layer.out, layer.in};
    ops_->gemm(delta, Transpose::yes, input, Transpose::no, weight_grad, 1.0f, 1.0f);
    ops_->bias_grad(delta, grads.data() + layer.bias_offset);
    if (l == 0) break;
    const ConstMatrix weight{params.data() + layer.weight_offset, layer.out, layer.in};
    const Matrix input_grad = post_activation(l - 1, rows);  // its values were used just above
    ops_->gemm(delta, Transpose::no, weight, Transpose::no, input_grad, 1.0f, 0.0f);
    ops_->activation_backward(activation_, pre_activation(l - 1, rows), input_grad, input_grad);
    delta = input_grad;
  }
  return loss;
}

EvalStats Mlp::evaluate(std::span<const float> params, const Batch& batch) {
  require_size("evaluate: params", params.size());
  EvalStats stats;
  const int64_t chunk = std::max(capacity_rows_, kEvalChunkRows);
  for (int64_t begin = 0; begin < batch.size; begin += chunk) {
    const int64_t rows = std::min(chunk, batch.size - begin);
    reserve_rows(rows);
    const float* x = batch.x + begin * widths_.front();
    const int32_t* y = batch.y + begin;
    const Matrix logits = forward(params.data(), x, rows);
    stats.correct += ops_->count_correct(logits, y);
    stats.loss_sum +=
        ops_->softmax_cross_entropy_forward(logits, y, logits) * static_cast<double>(rows);
    stats.count += rows;
  }
  return stats;
}

std::string Mlp::describe() const {
  std::string shape;
  for (int64_t width : widths_)
    shape += (shape.empty() ? "" : "-") + std::to_string(width);
  return "mlp " + shape + " " + activation_name(activation_) + ", " + with_thousands(num_params_) +
         " parameters";
}

std::unique_ptr<Model> make_mlp(const ModelSpec& spec) {
  require_positive("model.input", spec.input, 1);
  std::vector<int64_t> widths{spec.input};
  for (size_t i = 0; i < spec.hidden.size(); ++i) {
    require_positive(("model.hidden[" + std::to_string(i) + "]").c_str(), spec.hidden[i], 1);
    widths.push_back(spec.hidden[i]);
  }
  require_positive("model.classes", spec.classes, 2);
  widths.push_back(spec.classes);
  return std::make_unique<Mlp>(std::move(widths), parse_activation(spec.activation),
                               std::make_unique<CpuOps>());
}

}  // namespace dptrain
