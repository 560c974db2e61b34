// Tests of the MLP: layout, deterministic init, gradients against finite differences, evaluation.
#include "core/model/mlp.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "core/error.hpp"
#include "core/optim/optimizer.hpp"
#include "core/tensor/cpu_ops.hpp"
#include "core/tensor/random.hpp"

namespace dptrain {
namespace {

ModelSpec tiny_spec(const std::string& activation) {
  ModelSpec spec;
  spec.input = 5;
  spec.hidden = {7, 4};
  spec.classes = 3;
  spec.activation = activation;
  return spec;
}

std::vector<float> random_floats(size_t n, uint64_t seed, double low, double high) {
  std::mt19937_64 rng(seed);
  std::vector<float> v(n);
  for (float& f : v)
    f = static_cast<float>(low + (high - low) * uniform01(rng));
  return v;
}

struct Sample {
  std::vector<float> x;
  std::vector<int32_t> y;
  Batch batch() const { return {x.data(), y.data(), static_cast<int64_t>(y.size())}; }
};

Sample random_sample(int64_t rows, int64_t features, int32_t classes, uint64_t seed) {
  Sample s{random_floats(static_cast<size_t>(rows * features), seed, -2.0, 2.0), {}};
  for (int64_t i = 0; i < rows; ++i)
    s.y.push_back(static_cast<int32_t>(i % classes));
  return s;
}

// The documented layout and maths, written again in double without the op table: per layer W
// [out, in] row-major then b [out]; y = x W^T + b; activation between layers; mean cross-entropy.
struct Reference {
  std::vector<int64_t> widths;
  bool gelu;

  double activate(double v) const {
    if (!gelu) return v > 0 ? v : 0;
    return 0.5 * v * (1 + std::tanh(std::sqrt(2 / std::numbers::pi) * (v + 0.044715 * v * v * v)));
  }

  // Mean loss; counts rows whose argmax is the label into *correct when given.
  double loss(const std::vector<double>& params, const Sample& s,
              int64_t* correct = nullptr) const {
    const auto rows = static_cast<int64_t>(s.y.size());
    double total = 0;
    for (int64_t r = 0; r < rows; ++r) {
      std::vector<double> act(s.x.begin() + r * widths[0], s.x.begin() + (r + 1) * widths[0]);
      size_t offset = 0;
      for (size_t l = 0; l + 1 < widths.size(); ++l) {
        const int64_t in = widths[l], out = widths[l + 1];
        const double* w = params.data() + offset;
        const double* b = w + in * out;
        offset += static_cast<size_t>(in * out + out);
        std::vector<double> next(static_cast<size_t>(out));
        for (int64_t o = 0; o < out; ++o) {
          double sum = b[o];
          for (int64_t i = 0; i < in; ++i)
            sum += w[o * in + i] * act[static_cast<size_t>(i)];
          next[static_cast<size_t>(o)] = l + 2 < widths.size() ? activate(sum) : sum;
        }
        act = std::move(next);
      }
      const double top = *std::max_element(act.begin(), act.end());
      double sum_exp = 0;
      for (double z : act)
        sum_exp += std::exp(z - top);
      total += std::log(sum_exp) + top - act[static_cast<size_t>(s.y[static_cast<size_t>(r)])];
      if (correct != nullptr &&
          std::max_element(act.begin(), act.end()) - act.begin() == s.y[static_cast<size_t>(r)]) {
        ++*correct;
      }
    }
    return total / static_cast<double>(rows);
  }
};

void check_gradients(const std::string& activation) {
  CAPTURE(activation);
  const ModelSpec spec = tiny_spec(activation);
  auto model = make_model(spec);
  const size_t n = model->num_params();
  std::vector<float> params(n);
  model->init_params(params, 3);
  // Non-zero biases, so that their gradients and the activations' kinks are exercised too.
  const std::vector<float> jitter = random_floats(n, 99, -0.2, 0.2);
  for (size_t i = 0; i < n; ++i)
    params[i] += jitter[i];
  const Sample sample = random_sample(4, 5, 3, 7);

  std::vector<float> grads(n, 0.0f);
  const double loss = model->forward_backward(params, sample.batch(), grads, 1.0f);

  const Reference reference{{5, 7, 4, 3}, activation == "gelu"};
  std::vector<double> p(params.begin(), params.end());
  CHECK(loss == doctest::Approx(reference.loss(p, sample)).epsilon(1e-5));

  // Central differences in double; the analytic gradient is float, so the tolerance is float's:
  // |analytic - numeric| <= 1e-3 * max(|numeric|, 1e-3).
  const double h = 1e-6;
  for (size_t i = 0; i < n; ++i) {
    CAPTURE(i);
    const double saved = p[i];
    p[i] = saved + h;
    const double up = reference.loss(p, sample);
    p[i] = saved - h;
    const double down = reference.loss(p, sample);
    p[i] = saved;
    const double numeric = (up - down) / (2 * h);
    CHECK(std::abs(grads[i] - numeric) <= 1e-3 * std::max(std::abs(numeric), 1e-3));
  }
}

}  // namespace

TEST_CASE("the MLP's size, layout and description") {
  auto model = make_model(ModelSpec{});
  CHECK(model->num_params() == 784 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10);
  CHECK(model->describe() == "mlp 784-256-256-10 relu, 269,322 parameters");

  ModelSpec spec = tiny_spec("gelu");
  spec.hidden = {7};
  auto small = make_model(spec);
  const auto& mlp = dynamic_cast<const Mlp&>(*small);
  REQUIRE(mlp.layers().size() == 2);
  CHECK(mlp.layers()[0].weight_offset == 0);
  CHECK(mlp.layers()[0].bias_offset == 35);
  CHECK(mlp.layers()[1].weight_offset == 42);
  CHECK(mlp.layers()[1].bias_offset == 63);
  CHECK(mlp.num_params() == 66);
  CHECK(mlp.describe() == "mlp 5-7-3 gelu, 66 parameters");
}

TEST_CASE("AdamW's weight decay shrinks the MLP's weights and leaves its biases alone") {
  auto model = make_model(tiny_spec("relu"));
  const auto& mlp = dynamic_cast<const Mlp&>(*model);
  std::vector<float> params(mlp.num_params());
  mlp.init_params(params, 3);
  for (const LinearLayout& layer : mlp.layers())
    std::fill_n(params.begin() + static_cast<ptrdiff_t>(layer.bias_offset), layer.out, 0.5f);
  const std::vector<float> before = params;
  OptimizerSpec adamw;  // type adamw
  adamw.lr = 0.1;
  adamw.weight_decay = 0.5;
  CpuOps cpu;
  auto optimizer = make_optimizer(adamw, params.size(), mlp.no_decay(), cpu);
  // No gradient: Adam's own update is 0, so only the decay can move a parameter.
  optimizer->step(params, std::vector<float>(params.size(), 0.0f), adamw.lr);
  for (const LinearLayout& layer : mlp.layers()) {
    for (size_t i = layer.weight_offset; i < layer.bias_offset; ++i)
      REQUIRE(params[i] == doctest::Approx(before[i] * (1.0 - 0.1 * 0.5)));
    for (size_t i = layer.bias_offset; i < layer.bias_offset + static_cast<size_t>(layer.out); ++i)
      REQUIRE(params[i] == before[i]);
  }
}

TEST_CASE("init is deterministic, platform-stable, bounded, with zero biases") {
  const ModelSpec spec = tiny_spec("relu");
  auto model = make_model(spec);
  std::vector<float> a(model->num_params()), b(a.size()), c(a.size());
  model->init_params(a, 42);
  model->init_params(b, 42);
  model->init_params(c, 43);
  CHECK(a == b);
  CHECK(a != c);
  // Golden values: they change only if the generator, its seeding or the init rule changes.
  CHECK(a[0] == -0.721460223f);
  CHECK(a[1] == -0.52312237f);
  CHECK(a[a.size() - 4] == 0.167488605f);  // the output layer's last weight
  const auto& mlp = dynamic_cast<const Mlp&>(*model);
  for (size_t l = 0; l < mlp.layers().size(); ++l) {
    const LinearLayout& layer = mlp.layers()[l];
    const double bound = std::sqrt((l + 1 == mlp.layers().size() ? 3.0 : 6.0) / double(layer.in));
    for (int64_t i = 0; i < layer.in * layer.out; ++i) {
      CHECK(std::abs(a[layer.weight_offset + static_cast<size_t>(i)]) <= bound);
    }
    for (int64_t i = 0; i < layer.out; ++i)
      CHECK(a[layer.bias_offset + static_cast<size_t>(i)] == 0);
  }
}

TEST_CASE("relu MLP gradients match finite differences") {
  check_gradients("relu");
}

TEST_CASE("gelu MLP gradients match finite differences") {
  check_gradients("gelu");
}

TEST_CASE("forward_backward accumulates scale times the gradient") {
  auto model = make_model(tiny_spec("gelu"));
  const size_t n = model->num_params();
  std::vector<float> params(n);
  model->init_params(params, 5);
  const Sample sample = random_sample(6, 5, 3, 11);

  std::vector<float> plain(n, 0.0f);
  const double loss = model->forward_backward(params, sample.batch(), plain, 1.0f);
  std::vector<float> accumulated = random_floats(n, 12, -1.0, 1.0);
  const std::vector<float> before = accumulated;
  CHECK(model->forward_backward(params, sample.batch(), accumulated, 0.25f) == loss);
  for (size_t i = 0; i < n; ++i) {
    CHECK(accumulated[i] == doctest::Approx(before[i] + 0.25f * plain[i]).epsilon(1e-5));
  }
}

TEST_CASE("workspaces grown for a large batch give the same results on a small one") {
  auto fresh = make_model(tiny_spec("relu"));
  auto reused = make_model(tiny_spec("relu"));
  const size_t n = fresh->num_params();
  std::vector<float> params(n);
  fresh->init_params(params, 8);
  const Sample big = random_sample(64, 5, 3, 1);
  const Sample small = random_sample(3, 5, 3, 2);
  std::vector<float> scratch(n, 0.0f), a(n, 0.0f), b(n, 0.0f);
  reused->forward_backward(params, big.batch(), scratch, 1.0f);
  CHECK(fresh->forward_backward(params, small.batch(), a, 1.0f) ==
        reused->forward_backward(params, small.batch(), b, 1.0f));
  CHECK(a == b);
}

TEST_CASE("evaluate sums loss and correct predictions over chunks") {
  auto model = make_model(tiny_spec("gelu"));
  std::vector<float> params(model->num_params());
  model->init_params(params, 9);
  const Sample sample = random_sample(1100, 5, 3, 4);  // more than one evaluation chunk
  const EvalStats stats = model->evaluate(params, sample.batch());

  const Reference reference{{5, 7, 4, 3}, true};
  int64_t correct = 0;
  const double mean =
      reference.loss(std::vector<double>(params.begin(), params.end()), sample, &correct);
  CHECK(stats.count == 1100);
  CHECK(stats.correct == correct);
  CHECK(stats.loss_sum / 1100.0 == doctest::Approx(mean).epsilon(1e-5));
  CHECK(model->evaluate(params, Batch{nullptr, nullptr, 0}).count == 0);
}

TEST_CASE("make_model names the field at fault") {
  const auto message_of = [](const ModelSpec& spec) {
    try {
      make_model(spec);
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::recipe);
      return std::string(e.what());
    }
    return std::string("no error");
  };
  ModelSpec spec;
  spec.type = "cnn";
  CHECK(message_of(spec).find("model.type") != std::string::npos);
  spec = ModelSpec{};
  spec.hidden = {16, 0};
  CHECK(message_of(spec).find("model.hidden[1]") != std::string::npos);
  spec = ModelSpec{};
  spec.activation = "swish";
  CHECK(message_of(spec).find("model.activation") != std::string::npos);
  spec = ModelSpec{};
  spec.classes = 1;
  CHECK(message_of(spec).find("model.classes") != std::string::npos);
}

}  // namespace dptrain
