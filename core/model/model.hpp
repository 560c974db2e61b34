// The model interface the trainer drives: flat parameters in, loss and flat gradients out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/recipe.hpp"
#include "core/tensor/tensor.hpp"

namespace dptrain {

// x is row-major [size, features]; y holds size class labels, or for a token model size
// windows of context + 1 tokens (x unused).
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
  // Parameters weight decay leaves alone (sorted, disjoint); by default none.
  virtual std::vector<ParamRange> no_decay() const { return {}; }
};

// 269322 -> "269,322"
std::string with_thousands(size_t n);

// The model the spec names, on the CPU op table. Bad specs are Error(recipe) naming the field.
std::unique_ptr<Model> make_model(const ModelSpec& spec);

}  // namespace dptrain
