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
  Sgd(const OptimizerSpec& spec, size_t num_params, std::vector<Segment> segments)
      : momentum_(static_cast<float>(spec.momentum)),
        weight_decay_(spec.weight_decay),
        nesterov_(spec.nesterov),
        segments_(std::move(segments)),
        velocity_(num_params, 0.0f) {}

  void step(std::span<float> params, std::span<const float> grads, double lr) override {
    require_sizes(velocity_.size(), params, grads);
    for (const Segment& s : segments_) {
      const float decay = s.decay ? static_cast<float>(1.0 - lr * weight_decay_) : 1.0f;
      update(params.data() + s.begin, grads.data() + s.begin, velocity_.data() + s.begin,
             s.end - s.begin, decay, static_cast<float>(lr));
    }
    ++steps_;
  }

  std::span<float> state() override { return velocity_; }
  int64_t steps() const override { return steps_; }
  void set_steps(int64_t steps) override { steps_ = steps; }

 private:
  void update(float* p, const float* g, float* v, size_t n, float decay, float rate) const {
    const float momentum = momentum_;
    if (nesterov_) {
      for (size_t i = 0; i < n; ++i) {
        v[i] = momentum * v[i] + g[i];
        p[i] = p[i] * decay - rate * (g[i] + momentum * v[i]);
      }
    } else {
      for (size_t i = 0; i < n; ++i) {
        v[i] = momentum * v[i] + g[i];
        p[i] = p[i] * decay - rate * v[i];
      }
    }
  }

  float momentum_;
  double weight_decay_;
  bool nesterov_;
  std::vector<Segment> segments_;
  std::vector<float> velocity_;
  int64_t steps_ = 0;
};

// PyTorch's AdamW: p *= 1 - lr*wd; p -= (lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps),
// with bc = 1 - beta^t for the 1-based step t.
class AdamW final : public Optimizer {
 public:
  AdamW(const OptimizerSpec& spec, size_t num_params, std::vector<Segment> segments)
      : beta1_(spec.beta1),
        beta2_(spec.beta2),
        eps_(spec.eps),
        weight_decay_(spec.weight_decay),
        num_params_(num_params),
        segments_(std::move(segments)),
        moments_(2 * num_params, 0.0f) {}

  void step(std::span<float> params, std::span<const float> grads, double lr) override {
    require_sizes(num_params_, params, grads);
    ++steps_;
    const double t = static_cast<double>(steps_);
    Coefficients k;
    k.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1_, t)));
    k.inv_sqrt_bc2 = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(beta2_, t)));
    k.b1 = static_cast<float>(beta1_);
    k.b2 = static_cast<float>(beta2_);
    k.eps = static_cast<float>(eps_);
    for (const Segment& s : segments_) {
      const float decay = s.decay ? static_cast<float>(1.0 - lr * weight_decay_) : 1.0f;
      update(params.data() + s.begin, grads.data() + s.begin, moments_.data() + s.begin,
             moments_.data() + num_params_ + s.begin, s.end - s.begin, decay, k);
    }
  }

  std::span<float> state() override { return moments_; }
  int64_t steps() const override { return steps_; }
  void set_steps(int64_t steps) override { steps_ = steps; }

 private:
  struct Coefficients {
    float step_size, inv_sqrt_bc2, b1, b2, eps;
  };
  static void update(float* p, const float* g, float* m, float* v, size_t n, float decay,
                     const Coefficients& k) {
    const float b1 = k.b1, b2 = k.b2, eps = k.eps, step_size = k.step_size;
    const float inv_sqrt_bc2 = k.inv_sqrt_bc2;
    for (size_t i = 0; i < n; ++i) {
      m[i] = b1 * m[i] + (1.0f - b1) * g[i];
      v[i] = b2 * v[i] + (1.0f - b2) * g[i] * g[i];
      p[i] = p[i] * decay - step_size * m[i] / (std::sqrt(v[i]) * inv_sqrt_bc2 + eps);
    }
  }

  double beta1_;
  double beta2_;
  double eps_;
  double weight_decay_;
  size_t num_params_;
  std::vector<Segment> segments_;
  std::vector<float> moments_;  // m then v
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
                                          const std::vector<ParamRange>& no_decay) {
  parse_decay_shape(spec.schedule);  // a bad schedule fails here, not at the first step
  auto segments = decay_segments(num_params, no_decay);
  if (spec.type == "sgd") return std::make_unique<Sgd>(spec, num_params, std::move(segments));
  if (spec.type == "adamw") return std::make_unique<AdamW>(spec, num_params, std::move(segments));
  throw Error(ErrorKind::recipe,
              "optimizer.type: unknown optimizer '" + spec.type + "' (expected adamw or sgd)");
}

double learning_rate(const OptimizerSpec& spec, int64_t step, int64_t total_steps) {
  const ScheduleSpec& schedule = spec.schedule;
  const DecayShape shape = parse_decay_shape(schedule);
  const int64_t warmup = schedule.warmup;
  if (step < warmup) {
    return spec.lr * static_cast<double>(step + 1) / static_cast<double>(warmup);
  }
  const int64_t decay_steps = total_steps - warmup;
  if (shape == DecayShape::constant || decay_steps <= 0) return spec.lr;
  const double progress =
      std::min(1.0, static_cast<double>(step - warmup) / static_cast<double>(decay_steps));
  const double remaining = shape == DecayShape::cosine
                               ? 0.5 * (1.0 + std::cos(std::numbers::pi * progress))
                               : 1.0 - progress;
  const double min_lr = spec.lr * schedule.min_lr_ratio;
  return min_lr + (spec.lr - min_lr) * remaining;
}

double grad_norm(std::span<const float> grads) {
  // Fixed lanes keep the sum deterministic yet let the compiler vectorize it.
  constexpr size_t kLanes = 8;
  double lanes[kLanes] = {};
  const size_t full = grads.size() / kLanes * kLanes;
  for (size_t i = 0; i < full; i += kLanes) {
    for (size_t k = 0; k < kLanes; ++k) {
      const double g = grads[i + k];
      lanes[k] += g * g;
    }
  }
  double sum = 0.0;
  for (size_t i = full; i < grads.size(); ++i)
    sum += static_cast<double>(grads[i]) * grads[i];
  for (double lane : lanes)
    sum += lane;
  return std::sqrt(sum);
}

double clip_grad_norm(std::span<float> grads, double max_norm) {
  const double norm = grad_norm(grads);
  if (max_norm > 0.0 && std::isfinite(norm) && norm > max_norm) {
    const float factor = static_cast<float>(max_norm / norm);
    for (float& g : grads)
      g *= factor;
  }
  return norm;
}

}  // namespace dptrain
