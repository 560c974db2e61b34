// Optimizers (SGD with momentum, AdamW), the learning-rate schedule and gradient clipping.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "core/recipe.hpp"
#include "core/tensor/tensor.hpp"

namespace dptrain {

class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One update of params from grads at learning rate lr; weight decay is decoupled (p -= lr*wd*p).
  virtual void step(std::span<float> params, std::span<const float> grads, double lr) = 0;
  // ONE flat buffer, for checkpoints: sgd holds the momentum [n]; adamw holds m [n] then v [n].
  virtual std::span<float> state() = 0;
  virtual int64_t steps() const = 0;          // steps taken (adam's bias correction depends on it)
  virtual void set_steps(int64_t steps) = 0;  // on resume, with state() restored
};

// Error(recipe) naming optimizer.type or optimizer.schedule.type when either is unknown. Weight
// decay skips the `no_decay` ranges (sorted, disjoint: a model's biases and norms).
std::unique_ptr<Optimizer> make_optimizer(const OptimizerSpec& spec, size_t num_params,
                                          const std::vector<ParamRange>& no_decay = {});

// The rate for a 0-based step: linear warm-up from lr/warmup at step 0 to lr at step `warmup`,
// then the schedule (constant, cosine or linear) down to lr*min_lr_ratio at step total_steps.
double learning_rate(const OptimizerSpec& spec, int64_t step, int64_t total_steps);

// The L2 norm of grads, accumulated in double.
double grad_norm(std::span<const float> grads);
// Scales grads so their norm is at most max_norm (max_norm <= 0: never) and returns the norm
// before clipping. A non-finite norm leaves grads untouched, for the caller to detect.
double clip_grad_norm(std::span<float> grads, double max_norm);

}  // namespace dptrain
