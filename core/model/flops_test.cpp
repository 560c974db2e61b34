// Model FLOPs for MFU: GPT-2 small's figures by hand, the mlp's 6 x weights, refusals.
#include "core/model/flops.hpp"

#include <doctest/doctest.h>

#include <string>

#include "core/error.hpp"
#include "core/model/gpt.hpp"

using namespace dptrain;

namespace {

ModelSpec gpt2_small() {
  ModelSpec s;
  s.type = "gpt";
  s.vocab = 50257;
  s.context = 1024;
  s.layers = 12;
  s.heads = 12;
  s.width = 768;
  s.mlp_ratio = 4;
  return s;
}

}  // namespace

TEST_CASE("GPT-2 small: 6N + 6LCT with N every parameter, embeddings included") {
  const ModelSpec s = gpt2_small();
  GptConfig c;
  c.vocab = 50257;
  c.context = 1024;
  c.layers = 12;
  c.heads = 12;
  c.width = 768;
  REQUIRE(gpt_layout(c).total == 124439808);  // GPT-2 small's published count
  const double n = 124439808.0;
  const double per_token = 6 * n + 6 * 12.0 * 768 * 1024;
  CHECK(training_flops_per_token(s) == per_token);
  CHECK(training_flops_per_token(s) == 803261952.0);
  CHECK(training_flops_per_sample(s) == per_token * 1024);
  // Batch 16 x 1024 tokens at 989 TFLOP/s: the tokens/s that MFU 40% means (~492k).
  const double tokens_at_40 = 0.4 * 989e12 / per_token;
  CHECK(tokens_at_40 == doctest::Approx(492492).epsilon(1e-6));
  const std::string f = training_flops_formula(s);
  CAPTURE(f);
  CHECK(f.find("6N + 6LCT per token") != std::string::npos);
  CHECK(f.find("N 124,439,808, L 12, C 768, T 1024") != std::string::npos);
  CHECK(f.find("0.8033 GFLOP per token") != std::string::npos);
}

TEST_CASE("the attention term grows with the context, the 6N term with the parameters") {
  ModelSpec a = gpt2_small();
  a.context = 2048;  // wpe doubles too: N grows by 1024 x 768
  const double n = 124439808.0 + 1024.0 * 768;
  CHECK(training_flops_per_token(a) == 6 * n + 6 * 12.0 * 768 * 2048);
  CHECK(training_flops_per_sample(a) == training_flops_per_token(a) * 2048);
}

TEST_CASE("mlp: 6 x its weights per sample, biases left out; no tokens") {
  ModelSpec m;  // 784-256-256-10
  const double weights = 784.0 * 256 + 256.0 * 256 + 256.0 * 10;
  CHECK(training_flops_per_sample(m) == 6 * weights);
  m.hidden = {};
  m.input = 8;
  m.classes = 3;
  CHECK(training_flops_per_sample(m) == 6 * 24.0);
  CHECK(training_flops_formula(m).find("6 x weights per sample (24 weights)") != std::string::npos);
  CHECK_THROWS_WITH_AS(training_flops_per_token(m), doctest::Contains("has no tokens"), Error);
  m.type = "cnn";
  CHECK_THROWS_AS(training_flops_per_sample(m), Error);
}
