// Running a model once on an op table, for tests that compare op tables (the CUDA one, the
// 16-bit-storage CPU one) against the f32 CPU reference.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <vector>

#include "core/model/gpt.hpp"
#include "core/model/model.hpp"

namespace dptrain::test {

struct Gradients {
  double loss = 0;
  std::vector<float> grads;
  EvalStats eval;
};

// One forward_backward (scale 0.5) and one evaluate of `model` from host parameters.
inline Gradients run_model(Model& model, Ops& ops, const std::vector<float>& params,
                           const Batch& batch) {
  const size_t n = params.size();
  Buffer p = ops.allocate(n * sizeof(float));
  Buffer g = ops.allocate(n * sizeof(float));
  ops.upload(params.data(), p.data(), n * sizeof(float));
  const std::span<float> ps(p.as<float>(), n), gs(g.as<float>(), n);
  Gradients out;
  out.loss = model.forward_backward(ps, batch, gs, 0.5f);
  out.grads.resize(n);
  ops.download(gs.data(), out.grads.data(), n * sizeof(float));
  out.eval = model.evaluate(ps, batch);
  return out;
}

// A 2-layer GPT with head size 32 and a context that is not a multiple of the attention tile.
inline GptConfig tiny_gpt() {
  GptConfig c;
  c.vocab = 96;
  c.context = 40;
  c.layers = 2;
  c.heads = 2;
  c.width = 64;
  return c;
}

inline std::vector<int32_t> random_windows(int64_t count, int64_t length, int64_t vocab,
                                           uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<int32_t> out(static_cast<size_t>(count * length));
  for (int32_t& t : out)
    t = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab));
  return out;
}

}  // namespace dptrain::test
