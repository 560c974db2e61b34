// The model interface the trainer drives: flat parameters in, loss and flat gradients out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/recipe.hpp"
#include "core/tensor/ops.hpp"

namespace dptrain {

// Host memory: x is row-major [size, features]; y holds size class labels, or for a token model
// size windows of context + 1 tokens (x unused). The model uploads what it needs.
struct Batch {
  const float* x;
  const int32_t* y;
  int64_t size;
};

struct EvalStats {
  double loss_sum = 0;  // summed over samples: divide by count for the mean
  int64_t correct = 0;
  int64_t count = 0;
};

// A model computes on its op table's device: the params and grads spans of forward_backward and
// evaluate are device memory of that table (never iterated on the host); init_params fills host
// memory. A 16-bit model (mixed precision) computes with a bf16/f16 copy of the f32 parameters
// and accumulates f32 gradients.
class Model {
 public:
  virtual ~Model() = default;
  virtual size_t num_params() const = 0;
  // Deterministic from the seed, identical on every platform.
  virtual void init_params(std::span<float> params, uint64_t seed) const = 0;
  // grads += scale * d(mean loss over batch)/d(params); returns the mean loss. Uses internal
  // workspaces, grown only when a larger batch than any before arrives.
  virtual double forward_backward(std::span<const float> params, const Batch& batch,
                                  std::span<float> grads, float scale) = 0;
  virtual EvalStats evaluate(std::span<const float> params, const Batch& batch) = 0;
  // One line, e.g. "mlp 784-256-256-10 relu, 269,322 parameters".
  virtual std::string describe() const = 0;
  // Parameters weight decay leaves alone (sorted, disjoint): every vector of tensors() (biases,
  // LayerNorm gains and shifts), so that only weight matrices and embeddings decay, in every
  // model (nanoGPT's and llm.c's rule; dptrain-recipe(5), weight_decay).
  std::vector<ParamRange> no_decay() const;
  // Every parameter tensor, by offset, covering [0, num_params()) without gaps.
  virtual std::vector<ParamTensor> tensors() const = 0;

  // Called during forward_backward, on the calling thread, each time the gradients from `from`
  // to the end are complete for the call (the backward pass finishes the last parameters first;
  // on a GPU "complete" means queued on the op table's stream). The trainer starts reducing a
  // bucket with it while the backward pass goes on. Null: no calls.
  void on_gradients_ready(std::function<void(size_t from)> hook) { ready_hook_ = std::move(hook); }

 protected:
  void gradients_ready(size_t from) const {
    if (ready_hook_) ready_hook_(from);
  }

 private:
  std::function<void(size_t)> ready_hook_;
};

// 269322 -> "269,322"
std::string with_thousands(size_t n);

// The model the spec names, on `ops` (the CPU op table when null), computing in `dtype`. Bad specs
// are Error(recipe) naming the field.
std::unique_ptr<Model> make_model(const ModelSpec& spec, std::shared_ptr<Ops> ops = nullptr,
                                  DType dtype = DType::f32);

// The parameters a model computes with: the f32 master copy itself, or a 16-bit copy of it, cast
// again on every call (the master changes after every optimizer step).
class ComputeParams {
 public:
  ComputeParams(Ops& ops, DType dtype) : ops_(ops), dtype_(dtype) {}
  const void* get(std::span<const float> params);
  DType dtype() const { return dtype_; }

 private:
  Ops& ops_;
  DType dtype_;
  Buffer copy_;
};

// Grows `buffer` to hold `count` elements of `dtype` (existing contents are not kept).
void ensure(Ops& ops, Buffer& buffer, int64_t count, DType dtype);

// Row i of a [rows, cols] block, widened to f32 on the host.
std::vector<float> download_row(Ops& ops, ConstMatrix m, int64_t i);

}  // namespace dptrain
