// Optimizers (SGD with momentum, AdamW), the learning-rate schedule and gradient clipping.
#include "core/optim/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <numbers>
#include <string>
#include <vector>

#include "core/error.hpp"

namespace dptrain {
namespace {

void require_sizes(size_t state_size, std::span<float> params, std::span<const float> grads) {
  if (params.size() != state_size || grads.size() != state_size) {
    throw Error(ErrorKind::internal, "optimizer step: " + std::to_string(params.size()) +
                                         " params and " + std::to_string(grads.size()) +
                                         " grads for an optimizer of " +
                                         std::to_string(state_size));
  }
}

// [begin, end) runs of the parameters, each with weight decay on or off.
struct Segment {
  size_t begin, end;
  bool decay;
};

std::vector<Segment> decay_segments(size_t n, const std::vector<ParamRange>& no_decay) {
  std::vector<Segment> out;
  size_t at = 0;
  for (const ParamRange& r : no_decay) {
    if (r.offset < at || r.offset + r.size > n) {
      throw Error(ErrorKind::internal, "optimizer: no-decay ranges unsorted or out of bounds");
    }
    if (r.offset > at) out.push_back({at, r.offset, true});
    if (r.size > 0) out.push_back({r.offset, r.offset + r.size, false});
    at = r.offset + r.size;
  }
  if (at < n) out.push_back({at, n, true});
  return out;
}

// v = momentum * v + g;  p = p * (1 - lr*wd) - lr * (nesterov ? g + momentum * v : v)
class Sgd final : public Optimizer {
 public:
  Sgd(const OptimizerSpec& spec, size_t num_params, std::vector<Segment> segments, Ops& ops)
      : ops_(ops),
        momentum_(static_cast<float>(spec.momentum)),
        weight_decay_(spec.weight_decay),
        nesterov_(spec.nesterov),
        num_params_(num_params),
        segments_(std::move(segments)),
        velocity_(ops.allocate(num_params * sizeof(float))) {}

  void step(std::span<float> params, std::span<const float> grads, double lr) override {
    require_sizes(num_params_, params, grads);
    float* v = velocity_.as<float>();
    for (const Segment& s : segments_) {
      const float decay = s.decay ? static_cast<float>(1.0 - lr * weight_decay_) : 1.0f;
      ops_.sgd_update(params.data() + s.begin, grads.data() + s.begin, v + s.begin,
                      static_cast<int64_t>(s.end - s.begin), momentum_, decay,
                      static_cast<float>(lr), nesterov_);
    }
    ++steps_;
  }

  std::span<float> state() override { return {velocity_.as<float>(), num_params_}; }
  int64_t steps() const override { return steps_; }
  void set_steps(int64_t steps) override { steps_ = steps; }

 private:
  Ops& ops_;
  float momentum_;
  double weight_decay_;
  bool nesterov_;
  size_t num_params_;
  std::vector<Segment> segments_;
  Buffer velocity_;
  int64_t steps_ = 0;
};

// PyTorch's AdamW: p *= 1 - lr*wd; p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps),
// with bc = 1 - beta^t for the 1-based step t.
class AdamW final : public Optimizer {
 public:
  AdamW(const OptimizerSpec& spec, size_t num_params, std::vector<Segment> segments, Ops& ops)
      : ops_(ops),
        beta1_(spec.beta1),
        beta2_(spec.beta2),
        eps_(spec.eps),
        weight_decay_(spec.weight_decay),
        num_params_(num_params),
        segments_(std::move(segments)),
        moments_(ops.allocate(2 * num_params * sizeof(float))) {}

  void step(std::span<float> params, std::span<const float> grads, double lr) override {
    require_sizes(num_params_, params, grads);
    ++steps_;
    const double t = static_cast<double>(steps_);
    AdamWCoefficients k;
    k.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1_, t)));
    k.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2_, t)));
    k.b1 = static_cast<float>(beta1_);
    k.b2 = static_cast<float>(beta2_);
    k.eps = static_cast<float>(eps_);
    float* m = moments_.as<float>();
    float* v = m + num_params_;
    for (const Segment& s : segments_) {
      k.decay = s.decay ? static_cast<float>(1.0 - lr * weight_decay_) : 1.0f;
      ops_.adamw_update(params.data() + s.begin, grads.data() + s.begin, m + s.begin, v + s.begin,
                        static_cast<int64_t>(s.end - s.begin), k);
    }
  }

  std::span<float> state() override { return {moments_.as<float>(), 2 * num_params_}; }
  int64_t steps() const override { return steps_; }
  void set_steps(int64_t steps) override { steps_ = steps; }

 private:
  Ops& ops_;
  double beta1_;
  double beta2_;
  double eps_;
  double weight_decay_;
  size_t num_params_;
  std::vector<Segment> segments_;
  Buffer moments_;  // m then v
  int64_t steps_ = 0;
};

enum class DecayShape { constant, cosine, linear };

DecayShape parse_decay_shape(const ScheduleSpec& schedule) {
  if (schedule.type == "constant") return DecayShape::constant;
  if (schedule.type == "cosine") return DecayShape::cosine;
  if (schedule.type == "linear") return DecayShape::linear;
  throw Error(ErrorKind::recipe, "optimizer.schedule.type: unknown schedule '" + schedule.type +
                                     "' (expected constant, cosine or linear)");
}

}  // namespace

std::unique_ptr<Optimizer> make_optimizer(const OptimizerSpec& spec, size_t num_params,
                                          const std::vector<ParamRange>& no_decay, Ops& ops) {
  parse_decay_shape(spec.schedule);  // a bad schedule fails here, not at the first step
  auto segments = decay_segments(num_params, no_decay);
  if (spec.type == "sgd") return std::make_unique<Sgd>(spec, num_params, std::move(segments), ops);
  if (spec.type == "adamw")
    return std::make_unique<AdamW>(spec, num_params, std::move(segments), ops);
  throw Error(ErrorKind::recipe,
              "optimizer.type: unknown optimizer '" + spec.type + "' (expected adamw or sgd)");
}

size_t optimizer_state_per_param(const OptimizerSpec& spec) {
  return spec.type == "adamw" ? 2 : 1;
}

double learning_rate(const OptimizerSpec& spec, int64_t step, int64_t total_steps) {
  const ScheduleSpec& schedule = spec.schedule;
  const DecayShape shape = parse_decay_shape(schedule);
  const int64_t warmup = schedule.warmup;
  if (step < warmup) {
    return spec.lr * (static_cast<double>(step + 1) / static_cast<double>(warmup + 1));
  }
  // From lr at step `warmup` to the minimum at the last step, total_steps - 1.
  const int64_t decay_steps = total_steps - 1 - warmup;
  if (shape == DecayShape::constant || decay_steps <= 0) return spec.lr;
  const double progress =
      std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(decay_steps));
  const double remaining = shape == DecayShape::cosine
                               ? 0.5 * (1.0 + std::cos(std::numbers::pi * progress))
                               : 1.0 - progress;
  const double min_lr = spec.lr * schedule.min_lr_ratio;
  return min_lr + (spec.lr - min_lr) * remaining;
}

double grad_norm(Ops& ops, std::span<const float> grads) {
  return std::sqrt(ops.sum_squares(grads.data(), static_cast<int64_t>(grads.size())));
}

double clip_grad_norm(Ops& ops, std::span<float> grads, double max_norm) {
  return unscale_and_clip(ops, grads, 1.0, max_norm);
}

double unscale_and_clip(Ops& ops, std::span<float> grads, double loss_scale, double max_norm,
                        const std::function<double()>& sum_squares) {
  const double squares = sum_squares
                             ? sum_squares()
                             : ops.sum_squares(grads.data(), static_cast<int64_t>(grads.size()));
  const double norm = std::sqrt(squares) / loss_scale;
  if (!std::isfinite(norm)) return norm;
  const bool clip = max_norm > 0.0 && norm > max_norm;
  // One factor for both, so the gradients are read and written once.
  if (clip || loss_scale != 1.0) {
    const double factor = (clip ? max_norm / norm : 1.0) / loss_scale;
    ops.scale(static_cast<int64_t>(grads.size()), static_cast<float>(factor), grads.data());
  }
  return norm;
}

bool LossScaler::update(bool finite) {
  if (!enabled_) return true;
  if (!finite) {
    scale_ = std::max(scale_ / 2.0, 1.0);
    clean_steps_ = 0;
    return false;
  }
  if (++clean_steps_ >= growth_interval_) {
    scale_ = std::min(scale_ * 2.0, 16777216.0);  // 2^24 keeps the scaled loss far from overflow
    clean_steps_ = 0;
  }
  return true;
}

void LossScaler::restore(double scale, int64_t clean_steps) {
  if (!enabled_) return;
  scale_ = scale;
  clean_steps_ = clean_steps;
}

}  // namespace dptrain
