// The GPT model: exact parameter counts, initialisation, the whole model's gradient against
// finite differences, causality, weight-decay groups, and that it can learn.
#include "core/model/gpt.hpp"

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <span>

#include "core/error.hpp"
#include "core/optim/optimizer.hpp"
#include "core/tensor/cpu_ops.hpp"

namespace dptrain {
namespace {

GptConfig tiny_config() {
  GptConfig c;
  c.vocab = 11;
  c.context = 6;
  c.layers = 2;
  c.heads = 2;
  c.width = 8;
  c.mlp_ratio = 4;
  return c;
}

std::vector<int32_t> random_windows(int64_t sequences, const GptConfig& c, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> w(static_cast<size_t>(sequences * (c.context + 1)));
  for (auto& t : w)
    t = static_cast<int32_t>(rng() % static_cast<uint64_t>(c.vocab));
  return w;
}

double loss_at(Gpt& model, const std::vector<float>& params, const std::vector<int32_t>& windows,
               int64_t sequences) {
  std::vector<float> scratch(params.size(), 0.0f);
  return model.forward_backward(params, Batch{nullptr, windows.data(), sequences}, scratch, 0.0f);
}

// The tiny model on the CPU, its parameters initialised from `seed`.
struct TinyModel {
  GptConfig c = tiny_config();
  Gpt model{c, std::make_unique<CpuOps>()};
  std::vector<float> params;
  explicit TinyModel(uint64_t seed) : params(model.num_params()) {
    model.init_params(params, seed);
  }
};

double stddev(const float* v, int64_t n) {
  double sum = 0, sq = 0;
  for (int64_t i = 0; i < n; ++i) {
    sum += v[i];
    sq += double(v[i]) * v[i];
  }
  const double mean = sum / double(n);
  return std::sqrt(sq / double(n) - mean * mean);
}

}  // namespace

TEST_CASE("gpt: GPT-2 small has exactly 124,439,808 parameters with the tied head") {
  GptConfig c;
  c.vocab = 50257;
  c.context = 1024;
  c.layers = 12;
  c.heads = 12;
  c.width = 768;
  CHECK(gpt_layout(c).total == 124439808);
  ModelSpec spec;
  spec.type = "gpt";
  spec.vocab = 50257;
  spec.context = 1024;
  spec.layers = 12;
  spec.heads = 12;
  spec.width = 768;
  const auto model = make_model(spec);  // allocates no activations until it runs
  CHECK(model->num_params() == 124439808);
  CHECK(model->describe().find("124,439,808 parameters") != std::string::npos);
}

TEST_CASE("gpt: initialisation follows GPT-2 (0.02, residual projections scaled)") {
  GptConfig c = tiny_config();
  c.width = 64;
  c.layers = 3;
  Gpt model(c, std::make_unique<CpuOps>());
  std::vector<float> p(model.num_params());
  model.init_params(p, 5);
  const GptLayout& l = model.layout();
  CHECK(stddev(p.data() + l.wte, c.vocab * c.width) == doctest::Approx(0.02).epsilon(0.1));
  const GptLayerLayout& b = l.layers[1];
  CHECK(stddev(p.data() + b.fc_weight, 4 * c.width * c.width) ==
        doctest::Approx(0.02).epsilon(0.05));
  CHECK(stddev(p.data() + b.fc_proj_weight, 4 * c.width * c.width) ==
        doctest::Approx(0.02 / std::sqrt(6.0)).epsilon(0.05));
  CHECK(p[b.ln1_gamma] == 1.0f);
  CHECK(p[b.ln1_beta] == 0.0f);
  CHECK(p[b.qkv_bias] == 0.0f);
  std::vector<float> again(p.size());
  model.init_params(again, 5);
  CHECK(again == p);
}

TEST_CASE("gpt: weight decay skips exactly the biases and LayerNorm parameters") {
  const GptConfig c = tiny_config();
  Gpt model(c, std::make_unique<CpuOps>());
  size_t skipped = 0;
  size_t end = 0;
  for (const ParamRange& r : model.no_decay()) {
    CHECK(r.offset >= end);  // sorted, disjoint
    end = r.offset + r.size;
    skipped += r.size;
  }
  const auto w = static_cast<size_t>(c.width), mlp = static_cast<size_t>(4 * c.width);
  const size_t per_layer = 2 * w + 3 * w + w + 2 * w + mlp + w;  // ln1, qkv b, proj b, ln2, ...
  CHECK(skipped == static_cast<size_t>(c.layers) * per_layer + 2 * w);
}

TEST_CASE("gpt: the whole model's gradient matches finite differences") {
  const GptConfig c = tiny_config();
  Gpt model(c, std::make_unique<CpuOps>());
  std::vector<float> params(model.num_params());
  model.init_params(params, 3);
  // Larger weights than the init make every path matter to the loss.
  std::mt19937_64 rng(9);
  for (auto& v : params)
    v += static_cast<float>((double(rng() % 2001) / 1000.0 - 1.0) * 0.3);
  const int64_t sequences = 2;
  const auto windows = random_windows(sequences, c, 4);
  std::vector<float> grads(params.size(), 0.0f);
  model.forward_backward(params, Batch{nullptr, windows.data(), sequences}, grads, 1.0f);

  // A sample of parameters from every tensor of the model.
  const GptLayout& l = model.layout();
  std::vector<size_t> probe = {l.wte, l.wte + 17, l.wpe + 3, l.lnf_gamma + 1, l.lnf_beta + 2};
  for (const GptLayerLayout& b : l.layers) {
    for (size_t at :
         {b.ln1_gamma, b.ln1_beta + 1, b.qkv_weight + 5, b.qkv_weight + 70, b.qkv_weight + 150,
          b.qkv_bias + 9, b.proj_weight + 11, b.proj_bias, b.ln2_gamma + 3, b.ln2_beta,
          b.fc_weight + 40, b.fc_bias + 7, b.fc_proj_weight + 33, b.fc_proj_bias + 2}) {
      probe.push_back(at);
    }
  }
  int checked = 0;
  for (size_t i : probe) {
    CAPTURE(i);
    const float saved = params[i];
    const float eps = 1e-2f;
    params[i] = saved + eps;
    const double up = loss_at(model, params, windows, sequences);
    params[i] = saved - eps;
    const double down = loss_at(model, params, windows, sequences);
    params[i] = saved;
    const double numeric = (up - down) / (2.0 * eps);
    CHECK(grads[i] == doctest::Approx(numeric).epsilon(3e-2).scale(3e-3));
    ++checked;
  }
  CHECK(checked == 5 + 14 * c.layers);
}

TEST_CASE("gpt: a position sees only earlier tokens; shorter inputs give the same logits") {
  const GptConfig c = tiny_config();
  Gpt model(c, std::make_unique<CpuOps>());
  std::vector<float> params(model.num_params());
  model.init_params(params, 2);
  const std::vector<int32_t> tokens = {3, 1, 4, 1, 5, 9};
  const auto prefix = model.next_token_logits(params, std::span(tokens).first(3));
  std::vector<int32_t> changed = tokens;
  changed[4] = 2;  // after the prefix: must not matter to it
  const auto prefix_again = model.next_token_logits(params, std::span(changed).first(3));
  CHECK(prefix == prefix_again);
  const auto full = model.next_token_logits(params, tokens);
  CHECK(full.size() == static_cast<size_t>(c.vocab));
  CHECK(full != prefix);
  // Longer than the context: only the last `context` tokens count.
  std::vector<int32_t> longer = {7, 7};
  longer.insert(longer.end(), tokens.begin(), tokens.end());
  CHECK(model.next_token_logits(params, longer) == full);
}

TEST_CASE("gpt: the loss is the cross-entropy over the real vocabulary, not the padded head's") {
  // 11 classes, padded to 128 for the LM head's matmuls: were the 117 padding classes (logit 0)
  // in the softmax, the loss would be far larger than the one computed here from the logits.
  TinyModel tiny(5);
  const GptConfig& c = tiny.c;
  Gpt& model = tiny.model;
  const std::vector<float>& params = tiny.params;
  const auto window = random_windows(1, c, 6);
  double want = 0;
  for (int64_t t = 1; t <= c.context; ++t) {
    // Position t - 1 predicts token t; the logits for it come from the first t tokens.
    const auto logits = model.next_token_logits(params, std::span(window).first(size_t(t)));
    REQUIRE(logits.size() == static_cast<size_t>(c.vocab));
    double max = logits[0], sum = 0;
    for (float z : logits)
      max = std::max(max, double(z));
    for (float z : logits)
      sum += std::exp(z - max);
    want += std::log(sum) + max - logits[static_cast<size_t>(window[size_t(t)])];
  }
  want /= static_cast<double>(c.context);
  std::vector<float> grads(params.size(), 0.0f);
  CHECK(model.forward_backward(params, Batch{nullptr, window.data(), 1}, grads, 1.0f) ==
        doctest::Approx(want).epsilon(1e-5));
  const EvalStats eval = model.evaluate(params, Batch{nullptr, window.data(), 1});
  CHECK(eval.count == c.context);
  CHECK(eval.loss_sum / static_cast<double>(eval.count) == doctest::Approx(want).epsilon(1e-5));
}

TEST_CASE("gpt: gradients accumulate over calls, the padded LM head's too") {
  // Gradient accumulation calls forward_backward into the same gradients: the padded head's
  // weight gradient (computed into scratch, then added) must add up like every other.
  TinyModel tiny(8);
  Gpt& model = tiny.model;
  const std::vector<float>& params = tiny.params;
  const auto windows = random_windows(2, tiny.c, 9);
  const Batch batch{nullptr, windows.data(), 2};
  std::vector<float> once(params.size(), 0.0f);
  model.forward_backward(params, batch, once, 1.0f);
  std::vector<float> twice(params.size(), 0.0f);
  model.forward_backward(params, batch, twice, 1.0f);
  model.forward_backward(params, batch, twice, 1.0f);
  // Within rounding of the largest gradient (sums that cancel to about 0 differ in their
  // last bits); a gradient that did not add up is off by all of itself.
  double largest = 0;
  for (float g : once)
    largest = std::max(largest, std::fabs(double(g)));
  REQUIRE(largest > 0);
  size_t wrong = 0;
  for (size_t i = 0; i < once.size(); ++i)
    wrong += std::fabs(twice[i] - 2.0 * once[i]) > 1e-5 * largest;
  CHECK(wrong == 0);
  const GptLayout& l = model.layout();
  CHECK(twice[l.wte] != 0.0f);
}

TEST_CASE("gpt: a token outside the vocabulary is a recipe error naming it") {
  const GptConfig c = tiny_config();
  Gpt model(c, std::make_unique<CpuOps>());
  std::vector<float> params(model.num_params());
  model.init_params(params, 2);
  auto windows = random_windows(1, c, 1);
  windows[2] = 11;
  std::vector<float> grads(params.size());
  CHECK_THROWS_WITH_AS(
      model.forward_backward(params, Batch{nullptr, windows.data(), 1}, grads, 1.0f),
      doctest::Contains("11"), Error);
}

TEST_CASE("gpt: AdamW fits a repeating sequence far below chance") {
  GptConfig c = tiny_config();
  c.width = 16;
  auto cpu = std::make_shared<CpuOps>();
  CpuOps& cpu_ops = *cpu;
  Gpt model(c, cpu);
  std::vector<float> params(model.num_params()), grads(params.size());
  model.init_params(params, 1);
  OptimizerSpec spec;
  spec.lr = 1e-2;
  auto adam = make_optimizer(spec, params.size(), model.no_decay(), cpu_ops);
  // Windows of the cycle 0 1 2 ... 10 0 1 ...: every next token is determined.
  std::vector<int32_t> windows;
  for (int64_t s = 0; s < 4; ++s) {
    for (int64_t t = 0; t <= c.context; ++t)
      windows.push_back(static_cast<int32_t>((s * 3 + t) % c.vocab));
  }
  double first = 0, last = 0;
  for (int step = 0; step < 150; ++step) {
    std::fill(grads.begin(), grads.end(), 0.0f);
    last = model.forward_backward(params, Batch{nullptr, windows.data(), 4}, grads, 1.0f);
    if (step == 0) first = last;
    adam->step(params, grads, spec.lr);
  }
  CHECK(first > 2.0);  // about log(11) = 2.4 at the start
  CHECK(last < 0.1);
  const EvalStats stats = model.evaluate(params, Batch{nullptr, windows.data(), 4});
  CHECK(stats.count == 4 * c.context);
  CHECK(stats.correct == stats.count);
}

}  // namespace dptrain
