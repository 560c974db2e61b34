// A multi-layer perceptron over the op table: Linear layers with an activation between them.
#include "core/model/mlp.hpp"

#include <algorithm>
#include <cmath>
#include <random>

#include "core/error.hpp"
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

Mlp::Mlp(std::vector<int64_t> widths, Activation activation, std::shared_ptr<Ops> ops, DType dtype)
    : widths_(std::move(widths)),
      activation_(activation),
      ops_(std::move(ops)),
      dtype_(dtype),
      compute_(*ops_, dtype) {
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
  Ops& ops = *ops_;
  workspace_ = ops.allocate(static_cast<size_t>(rows * workspace_width_) * dtype_size(dtype_));
  input_ = ops.allocate(static_cast<size_t>(rows * widths_.front()) * dtype_size(dtype_));
  if (dtype_ != DType::f32) {
    input_f32_ = ops.allocate(static_cast<size_t>(rows * widths_.front()) * sizeof(float));
  }
  labels_ = ops.allocate(static_cast<size_t>(rows) * sizeof(int32_t));
}

Matrix Mlp::pre_activation(size_t layer, int64_t rows) {
  const size_t offset = static_cast<size_t>(capacity_rows_ * pre_offset_[layer]);
  return {workspace_.as<char>() + offset * dtype_size(dtype_), rows, layers_[layer].out, dtype_};
}

Matrix Mlp::post_activation(size_t layer, int64_t rows) {
  const size_t offset = static_cast<size_t>(capacity_rows_ * post_offset_[layer]);
  return {workspace_.as<char>() + offset * dtype_size(dtype_), rows, layers_[layer].out, dtype_};
}

const void* Mlp::at(const void* params, size_t offset) const {
  return static_cast<const char*>(params) + offset * dtype_size(dtype_);
}

ConstMatrix Mlp::load(const float* x, const int32_t* y, int64_t rows) {
  Ops& ops = *ops_;
  const int64_t n = rows * widths_.front();
  const size_t bytes = static_cast<size_t>(n) * sizeof(float);
  if (dtype_ == DType::f32) {
    ops.upload(x, input_.data(), bytes);
  } else {
    ops.upload(x, input_f32_.data(), bytes);
    ops.cast(input_f32_.data(), DType::f32, input_.data(), dtype_, n);
  }
  ops.upload(y, labels_.data(), static_cast<size_t>(rows) * sizeof(int32_t));
  return {input_.data(), rows, widths_.front(), dtype_};
}

Matrix Mlp::forward(const void* params, ConstMatrix x) {
  ConstMatrix input = x;
  Matrix pre;
  for (size_t l = 0; l < layers_.size(); ++l) {
    const LinearLayout& layer = layers_[l];
    pre = pre_activation(l, x.rows);
    if (l + 1 < layers_.size()) {
      const Matrix post = post_activation(l, x.rows);
      ops_->linear_activation(input, at(params, layer.weight_offset), at(params, layer.bias_offset),
                              activation_, pre, post);
      input = post;
    } else {
      ops_->linear(input, at(params, layer.weight_offset), at(params, layer.bias_offset), pre,
                   nullptr);
    }
  }
  return pre;
}

std::vector<ParamTensor> Mlp::tensors() const {
  std::vector<ParamTensor> out;
  for (const LinearLayout& layer : layers_) {
    out.push_back(
        {layer.weight_offset, static_cast<size_t>(layer.out), static_cast<size_t>(layer.in)});
    out.push_back(ParamTensor::vector(layer.bias_offset, static_cast<size_t>(layer.out)));
  }
  return out;
}

double Mlp::forward_backward(std::span<const float> params, const Batch& batch,
                             std::span<float> grads, float scale) {
  require_size("forward_backward: params", params.size());
  require_size("forward_backward: grads", grads.size());
  if (batch.size <= 0) return 0.0;
  reserve_rows(batch.size);
  const int64_t rows = batch.size;
  const ConstMatrix x = load(batch.x, batch.y, rows);
  const int32_t* labels = labels_.as<int32_t>();
  const void* p = compute_.get(params);

  // Softmax, loss gradient and the gradient of every layer's output overwrite the activations in
  // place, once nothing later reads them: the backward pass needs no memory of its own.
  Matrix delta = forward(p, x);
  const double loss = ops_->softmax_cross_entropy(delta, labels, delta, scale);

  for (size_t l = layers_.size(); l-- > 0;) {
    const LinearLayout& layer = layers_[l];
    const ConstMatrix input = l == 0 ? x : ConstMatrix(post_activation(l - 1, rows));
    ops_->linear_weight_grad(delta, input, grads.data() + layer.weight_offset,
                             grads.data() + layer.bias_offset);
    gradients_ready(layer.weight_offset);
    if (l == 0) break;
    const Matrix input_grad = post_activation(l - 1, rows);  // its values were used just above
    ops_->linear_activation_grad(delta, at(p, layer.weight_offset), activation_,
                                 pre_activation(l - 1, rows), input_grad);
    delta = input_grad;
  }
  return loss;
}

EvalStats Mlp::evaluate(std::span<const float> params, const Batch& batch) {
  require_size("evaluate: params", params.size());
  EvalStats stats;
  const int64_t chunk = std::max(capacity_rows_, kEvalChunkRows);
  const void* p = compute_.get(params);
  for (int64_t begin = 0; begin < batch.size; begin += chunk) {
    const int64_t rows = std::min(chunk, batch.size - begin);
    reserve_rows(rows);
    const ConstMatrix x = load(batch.x + begin * widths_.front(), batch.y + begin, rows);
    const int32_t* labels = labels_.as<int32_t>();
    const Matrix logits = forward(p, x);
    stats.correct += ops_->count_correct(logits, labels);
    stats.loss_sum +=
        ops_->softmax_cross_entropy_forward(logits, labels, logits) * static_cast<double>(rows);
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

std::unique_ptr<Model> make_mlp(const ModelSpec& spec, std::shared_ptr<Ops> ops, DType dtype) {
  require_positive("model.input", spec.input, 1);
  std::vector<int64_t> widths{spec.input};
  for (size_t i = 0; i < spec.hidden.size(); ++i) {
    require_positive(("model.hidden[" + std::to_string(i) + "]").c_str(), spec.hidden[i], 1);
    widths.push_back(spec.hidden[i]);
  }
  require_positive("model.classes", spec.classes, 2);
  widths.push_back(spec.classes);
  return std::make_unique<Mlp>(std::move(widths), parse_activation(spec.activation), std::move(ops),
                               dtype);
}

}  // namespace dptrain
