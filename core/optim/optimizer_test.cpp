// Tests of SGD, AdamW, the learning-rate schedule and clipping against hand-computed values.
#include "core/optim/optimizer.hpp"

#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "core/error.hpp"
#include "core/tensor/cpu_ops.hpp"

namespace dptrain {
namespace {

Ops& cpu_ops() {
  static CpuOps ops;
  return ops;
}

OptimizerSpec sgd_spec(double momentum, bool nesterov, double weight_decay) {
  OptimizerSpec spec;
  spec.type = "sgd";
  spec.momentum = momentum;
  spec.nesterov = nesterov;
  spec.weight_decay = weight_decay;
  return spec;
}

// Runs steps of a one-parameter optimizer from p = 1 with the given gradients at lr 0.1.
std::vector<float> trajectory(const OptimizerSpec& spec, const std::vector<float>& gradients) {
  auto optimizer = make_optimizer(spec, 1, {}, cpu_ops());
  std::vector<float> param = {1.0f};
  std::vector<float> out;
  for (float g : gradients) {
    optimizer->step(param, std::vector<float>{g}, 0.1);
    out.push_back(param[0]);
  }
  return out;
}

void check_close(const std::vector<float>& actual, const std::vector<double>& expected) {
  REQUIRE(actual.size() == expected.size());
  for (size_t i = 0; i < actual.size(); ++i) {
    CAPTURE(i);
    CHECK(actual[i] == doctest::Approx(expected[i]).epsilon(1e-6));
  }
}

}  // namespace

TEST_CASE("sgd: momentum, nesterov and decoupled weight decay, by hand") {
  // v = 0.9 v + g; p -= 0.1 v:  v = 0.5, 0.95, 1.355.
  check_close(trajectory(sgd_spec(0.9, false, 0.0), {0.5f, 0.5f, 0.5f}), {0.95, 0.855, 0.7195});
  // p -= 0.1 (g + 0.9 v).
  check_close(trajectory(sgd_spec(0.9, true, 0.0), {0.5f, 0.5f, 0.5f}), {0.905, 0.7695, 0.59755});
  // p = p (1 - 0.1 * 0.1) - 0.1 g.
  check_close(trajectory(sgd_spec(0.0, false, 0.1), {0.5f, 0.5f}), {0.94, 0.8806});
}

TEST_CASE("adamw: bias correction and decoupled weight decay, by hand") {
  OptimizerSpec spec;  // adamw, beta1 0.9, beta2 0.999, eps 1e-8
  // t=1: m = 0.05, v = 0.00025 -> the step is lr * sign(g).
  // t=2: m = 0.02, v = 0.00031225; p -= 0.1 (0.02/0.19) / (sqrt(0.00031225/0.001999) + eps).
  check_close(trajectory(spec, {0.5f, -0.25f}), {0.900000002, 0.8733662987078463});
  spec.weight_decay = 0.01;
  check_close(trajectory(spec, {0.5f, -0.25f}), {0.899000002, 0.8714672987058463});
}

TEST_CASE("optimizer state is one flat buffer and a resumed optimizer continues exactly") {
  OptimizerSpec spec;
  auto adam = make_optimizer(spec, 3, {}, cpu_ops());
  REQUIRE(adam->state().size() == 6);
  std::vector<float> params = {1, 2, 3};
  const std::vector<float> grads = {0.5f, -1.0f, 2.0f};
  adam->step(params, grads, 0.01);
  CHECK(adam->steps() == 1);
  CHECK(adam->state()[2] == doctest::Approx(0.2));        // m = 0.1 g
  CHECK(adam->state()[3 + 1] == doctest::Approx(0.001));  // v = 0.001 g^2
  CHECK(make_optimizer(sgd_spec(0.9, false, 0), 3, {}, cpu_ops())->state().size() == 3);

  auto resumed = make_optimizer(spec, 3, {}, cpu_ops());
  std::copy(adam->state().begin(), adam->state().end(), resumed->state().begin());
  resumed->set_steps(adam->steps());
  std::vector<float> resumed_params = params;
  adam->step(params, grads, 0.01);
  resumed->step(resumed_params, grads, 0.01);
  CHECK(params == resumed_params);

  // Without the restored step count the bias correction differs, and so does the result.
  auto forgetful = make_optimizer(spec, 3, {}, cpu_ops());
  std::copy(adam->state().begin(), adam->state().end(), forgetful->state().begin());
  std::vector<float> forgetful_params = params;
  adam->step(params, grads, 0.01);
  forgetful->step(forgetful_params, grads, 0.01);
  CHECK(params != forgetful_params);
}

TEST_CASE("learning rate: warm-up then constant, cosine or linear decay") {
  OptimizerSpec spec;
  spec.lr = 1.0;
  spec.schedule.warmup = 4;
  spec.schedule.min_lr_ratio = 0.1;
  spec.schedule.type = "cosine";
  // Warm-up: (step + 1) / (warmup + 1), the peak at step 4 only; the minimum at step 15 - 1.
  CHECK(learning_rate(spec, 0, 15) == doctest::Approx(0.2));
  CHECK(learning_rate(spec, 3, 15) == doctest::Approx(0.8));
  CHECK(learning_rate(spec, 4, 15) == doctest::Approx(1.0));
  CHECK(learning_rate(spec, 5, 15) < 1.0);
  CHECK(learning_rate(spec, 9, 15) == doctest::Approx(0.55));  // halfway: 0.1 + 0.9 * 0.5
  CHECK(learning_rate(spec, 14, 15) == doctest::Approx(0.1));
  CHECK(learning_rate(spec, 20, 15) == doctest::Approx(0.1));

  spec.schedule.type = "linear";
  CHECK(learning_rate(spec, 6, 15) == doctest::Approx(1.0 - 0.9 * 0.2));
  CHECK(learning_rate(spec, 14, 15) == doctest::Approx(0.1));

  spec.schedule.type = "constant";
  CHECK(learning_rate(spec, 1, 15) == doctest::Approx(0.4));
  CHECK(learning_rate(spec, 14, 15) == doctest::Approx(1.0));

  // Warm-up over every step: it never gets to lr.
  spec.schedule.warmup = 15;
  CHECK(learning_rate(spec, 14, 15) == doctest::Approx(15.0 / 16.0));

  spec.schedule.warmup = 0;
  spec.schedule.type = "cosine";
  CHECK(learning_rate(spec, 9, 10) == doctest::Approx(0.1));
  spec.schedule.min_lr_ratio = 0.0;
  CHECK(learning_rate(spec, 1, 3) == doctest::Approx(0.5));
  CHECK(learning_rate(spec, 2, 3) == doctest::Approx(0.0));
  CHECK(learning_rate(spec, 0, 1) == doctest::Approx(1.0));  // one step: no decay to follow
  CHECK(learning_rate(spec, 0, 10) == doctest::Approx(1.0));
}

TEST_CASE("gradient norm and clipping") {
  std::vector<float> grads = {3.0f, 4.0f};
  CHECK(clip_grad_norm(cpu_ops(), grads, 0.0) == doctest::Approx(5.0));
  CHECK(grads == std::vector<float>{3.0f, 4.0f});
  CHECK(clip_grad_norm(cpu_ops(), grads, 10.0) == doctest::Approx(5.0));
  CHECK(grads == std::vector<float>{3.0f, 4.0f});
  CHECK(clip_grad_norm(cpu_ops(), grads, 1.0) == doctest::Approx(5.0));
  CHECK(grads[0] == doctest::Approx(0.6));
  CHECK(grads[1] == doctest::Approx(0.8));

  // 19 entries: the vector lanes and the scalar tail both count.
  std::vector<float> ones(19, 1.0f);
  ones[18] = 2.0f;
  CHECK(grad_norm(cpu_ops(), ones) == doctest::Approx(std::sqrt(22.0)));
  CHECK(grad_norm(cpu_ops(), std::vector<float>{}) == 0.0);
}

TEST_CASE("unknown optimizer or schedule names the field") {
  OptimizerSpec spec;
  spec.type = "lion";
  CHECK_THROWS_WITH_AS(make_optimizer(spec, 1, {}, cpu_ops()), doctest::Contains("optimizer.type"),
                       Error);
  spec = OptimizerSpec{};
  spec.schedule.type = "step";
  CHECK_THROWS_WITH_AS(make_optimizer(spec, 1, {}, cpu_ops()),
                       doctest::Contains("optimizer.schedule.type"), Error);
  CHECK_THROWS_AS(learning_rate(spec, 0, 10), Error);
}

TEST_CASE("weight decay skips the no-decay ranges and only them") {
  for (const char* type : {"adamw", "sgd"}) {
    CAPTURE(type);
    OptimizerSpec spec = type == std::string("sgd") ? sgd_spec(0.0, false, 0.5) : OptimizerSpec{};
    spec.type = type;
    spec.weight_decay = 0.5;
    // Six parameters, all 1, zero gradients: only decay moves them.
    auto optimizer = make_optimizer(spec, 6, {{1, 2}, {5, 1}}, cpu_ops());
    std::vector<float> params(6, 1.0f);
    optimizer->step(params, std::vector<float>(6, 0.0f), 0.1);
    const float decayed = 1.0f - 0.1f * 0.5f;
    CHECK(params == std::vector<float>{decayed, 1.0f, 1.0f, decayed, decayed, 1.0f});
  }
  CHECK_THROWS_AS(make_optimizer(OptimizerSpec{}, 4, {{2, 1}, {1, 1}}, cpu_ops()),
                  Error);                                                           // unsorted
  CHECK_THROWS_AS(make_optimizer(OptimizerSpec{}, 4, {{3, 2}}, cpu_ops()), Error);  // past the end
}

TEST_CASE("loss scaler: halves and skips on overflow, doubles after clean steps, off = 1") {
  LossScaler off(false);
  CHECK(off.scale() == 1.0);
  CHECK(off.update(false));  // disabled: every step applies, even a non-finite one
  CHECK(off.scale() == 1.0);

  LossScaler scaler(true, 65536.0, 3);
  CHECK(scaler.scale() == 65536.0);
  CHECK_FALSE(scaler.update(false));
  CHECK(scaler.scale() == 32768.0);
  CHECK(scaler.update(true));
  CHECK(scaler.update(true));
  CHECK(scaler.scale() == 32768.0);
  CHECK(scaler.clean_steps() == 2);
  CHECK(scaler.update(true));  // the third clean step in a row
  CHECK(scaler.scale() == 65536.0);
  CHECK(scaler.clean_steps() == 0);
  CHECK(scaler.update(true));
  CHECK_FALSE(scaler.update(false));  // an overflow resets the count
  CHECK(scaler.clean_steps() == 0);
  CHECK(scaler.scale() == 32768.0);

  LossScaler floor(true, 2.0, 2000);
  CHECK_FALSE(floor.update(false));
  CHECK_FALSE(floor.update(false));
  CHECK(floor.scale() == 1.0);  // never below 1

  LossScaler resumed(true);
  resumed.restore(1024.0, 1999);
  CHECK(resumed.update(true));
  CHECK(resumed.scale() == 2048.0);
}

TEST_CASE("unscale_and_clip: takes the loss scale off, clips the true norm, flags overflow") {
  std::vector<float> grads = {3.0f * 1024, 4.0f * 1024};  // norm 5 under a scale of 1024
  CHECK(unscale_and_clip(cpu_ops(), grads, 1024.0, 0.0) == doctest::Approx(5.0));
  CHECK(grads[0] == doctest::Approx(3.0f));
  CHECK(grads[1] == doctest::Approx(4.0f));

  std::vector<float> clipped = {3.0f * 8, 4.0f * 8};
  CHECK(unscale_and_clip(cpu_ops(), clipped, 8.0, 1.0) == doctest::Approx(5.0));
  CHECK(clipped[0] == doctest::Approx(0.6f));
  CHECK(clipped[1] == doctest::Approx(0.8f));

  std::vector<float> overflow = {1.0f, std::numeric_limits<float>::infinity()};
  CHECK_FALSE(std::isfinite(unscale_and_clip(cpu_ops(), overflow, 65536.0, 1.0)));
  CHECK(overflow[0] == 1.0f);  // left alone: the step is skipped
}

}  // namespace dptrain
