// Optimizers (SGD with momentum, AdamW), the learning-rate schedule and gradient clipping.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "core/recipe.hpp"
#include "core/tensor/ops.hpp"

namespace dptrain {

// Parameters, gradients and state live on the op table's device (spans of device memory: never
// iterated on the host); the update runs as op-table kernels.
class Optimizer {
 public:
  virtual ~Optimizer() = default;
  // One update of params from grads at learning rate lr; weight decay is decoupled (p -= lr*wd*p).
  virtual void step(std::span<float> params, std::span<const float> grads, double lr) = 0;
  // ONE flat buffer (device memory), for checkpoints: sgd holds the momentum [n]; adamw holds m [n]
  // then v [n].
  virtual std::span<float> state() = 0;
  virtual int64_t steps() const = 0;          // steps taken (adam's bias correction depends on it)
  virtual void set_steps(int64_t steps) = 0;  // on resume, with state() restored
};

// Error(recipe) naming optimizer.type or optimizer.schedule.type when either is unknown. Weight
// decay skips the `no_decay` ranges (sorted, disjoint: a model's biases and norms).
std::unique_ptr<Optimizer> make_optimizer(const OptimizerSpec& spec, size_t num_params,
                                          const std::vector<ParamRange>& no_decay, Ops& ops);

// Values of state() per parameter: sgd 1 (momentum), adamw 2 (m and v).
size_t optimizer_state_per_param(const OptimizerSpec& spec);

// The rate for a 0-based step: linear warm-up, lr*(step+1)/(warmup+1), to lr at step `warmup`
// (no step is wasted at 0, and the peak comes once), then the schedule (constant, cosine or
// linear) down to lr*min_lr_ratio at the last step, total_steps - 1.
double learning_rate(const OptimizerSpec& spec, int64_t step, int64_t total_steps);

// The L2 norm of grads (device memory of ops), accumulated in double.
double grad_norm(Ops& ops, std::span<const float> grads);
// Scales grads so their norm is at most max_norm (max_norm <= 0: never) and returns the norm
// before clipping. A non-finite norm leaves grads untouched, for the caller to detect.
double clip_grad_norm(Ops& ops, std::span<float> grads, double max_norm);

// Dynamic loss scaling (fp16): the loss, and so every gradient, is multiplied by scale(). A step
// whose reduced gradients are not finite is skipped and the scale halved; after growth_interval
// clean steps in a row it doubles. Disabled, the scale stays 1 and every step applies.
class LossScaler {
 public:
  explicit LossScaler(bool enabled, double initial = 65536.0, int64_t growth_interval = 2000)
      : enabled_(enabled), scale_(enabled ? initial : 1.0), growth_interval_(growth_interval) {}

  bool enabled() const { return enabled_; }
  double scale() const { return scale_; }
  int64_t clean_steps() const { return clean_steps_; }
  // Called once a step with whether its gradients were finite; returns whether to apply it.
  bool update(bool finite);
  // From a checkpoint.
  void restore(double scale, int64_t clean_steps);

 private:
  bool enabled_;
  double scale_;
  int64_t growth_interval_;
  int64_t clean_steps_ = 0;
};

// Unscales gradients multiplied by loss_scale and clips them to max_norm (<= 0: never) in one
// pass; returns the norm of the unscaled gradients (inf or NaN when they overflowed, in which case
// they are left alone). loss_scale 1 is clip_grad_norm. When grads are one shard of the
// gradients (ZeRO, parameter servers), `sum_squares` gives all shards' sum of squares (from
// the whole gradients, or this shard's combined with the others'); by default grads' own.
double unscale_and_clip(Ops& ops, std::span<float> grads, double loss_scale, double max_norm,
                        const std::function<double()>& sum_squares = {});

}  // namespace dptrain
