// A multi-layer perceptron over the op table: Linear layers with an activation between them.
#pragma once

#include <memory>
#include <vector>

#include "core/model/model.hpp"
#include "core/tensor/ops.hpp"

namespace dptrain {

// Where one Linear layer lives in the flat parameter (and gradient) buffer. Layers follow each
// other in order, each as its weight W, row-major [out, in] (PyTorch's nn.Linear layout), then its
// bias b [out]; the layer computes y = x W^T + b.
struct LinearLayout {
  int64_t in = 0;
  int64_t out = 0;
  size_t weight_offset = 0;
  size_t bias_offset = 0;
};

class Mlp final : public Model {
 public:
  // widths: input, hidden..., classes (at least two entries, all positive).
  Mlp(std::vector<int64_t> widths, Activation activation, std::shared_ptr<Ops> ops,
      DType dtype = DType::f32);

  size_t num_params() const override { return num_params_; }
  void init_params(std::span<float> params, uint64_t seed) const override;
  double forward_backward(std::span<const float> params, const Batch& batch, std::span<float> grads,
                          float scale) override;
  EvalStats evaluate(std::span<const float> params, const Batch& batch) override;
  std::string describe() const override;

  const std::vector<LinearLayout>& layers() const { return layers_; }
  std::vector<ParamTensor> tensors() const override;

 private:
  void require_size(const char* what, size_t size) const;
  void reserve_rows(int64_t rows);
  // Runs the layers on rows of x and returns the logits; every pre- and post-activation stays in
  // the workspace for the backward pass.
  Matrix forward(const void* params, ConstMatrix x);
  // Uploads rows of host x (cast to the compute dtype) and their labels; returns x on the device.
  ConstMatrix load(const float* x, const int32_t* y, int64_t rows);
  const void* at(const void* params, size_t offset) const;
  Matrix pre_activation(size_t layer, int64_t rows);
  Matrix post_activation(size_t layer, int64_t rows);  // hidden layers only

  std::vector<int64_t> widths_;
  Activation activation_;
  std::shared_ptr<Ops> ops_;
  DType dtype_;
  ComputeParams compute_;
  std::vector<LinearLayout> layers_;
  size_t num_params_ = 0;

  // One block holding, per layer, its pre-activation [rows, out] and (hidden layers) its
  // post-activation [rows, out]; offsets count floats per workspace row.
  std::vector<int64_t> pre_offset_;
  std::vector<int64_t> post_offset_;
  int64_t workspace_width_ = 0;
  int64_t capacity_rows_ = 0;
  Buffer workspace_;          // compute dtype
  Buffer input_, input_f32_;  // the batch's x on the device: compute dtype, f32 staging
  Buffer labels_;             // int32 [rows]
};

// The MLP a recipe names; Error(recipe) naming a bad field.
std::unique_ptr<Model> make_mlp(const ModelSpec& spec, std::shared_ptr<Ops> ops,
                                DType dtype = DType::f32);

}  // namespace dptrain
