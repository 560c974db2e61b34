// What every model promises the trainer: its tensors tile the flat buffer, the gradients-ready
// hook fires only for gradients the backward pass is done with, and weight decay follows one
// rule (weight matrices and embeddings decay, biases and LayerNorm parameters do not).
#include "core/model/model.hpp"

#include <doctest/doctest.h>

#include <random>
#include <vector>

namespace dptrain {
namespace {

ModelSpec mlp_spec() {
  ModelSpec spec;
  spec.input = 5;
  spec.hidden = {7, 4};
  spec.classes = 3;
  return spec;
}

ModelSpec gpt_spec() {
  ModelSpec spec;
  spec.type = "gpt";
  spec.vocab = 11;
  spec.context = 6;
  spec.layers = 2;
  spec.heads = 2;
  spec.width = 8;
  return spec;
}

// A batch of 3 samples either model can take: 5 features and a label, or a window of
// context + 1 tokens.
struct Data {
  std::vector<float> x;
  std::vector<int32_t> y;
};

Data batch_for(const ModelSpec& spec) {
  std::mt19937 rng(5);
  Data d;
  if (spec.type == "gpt") {
    for (int64_t i = 0; i < 3 * (spec.context + 1); ++i)
      d.y.push_back(static_cast<int32_t>(rng() % static_cast<uint32_t>(spec.vocab)));
  } else {
    for (int64_t i = 0; i < 3 * spec.input; ++i)
      d.x.push_back(static_cast<float>(rng() % 100) / 50.0f - 1.0f);
    d.y = {0, 1, 2};
  }
  return d;
}

}  // namespace

TEST_CASE("model tensors tile the flat buffer: the MLP's weights and biases") {
  const auto model = make_model(mlp_spec());
  const std::vector<ParamTensor> expected = {{0, 7, 5},  ParamTensor::vector(35, 7),
                                             {42, 4, 7}, ParamTensor::vector(70, 4),
                                             {74, 3, 4}, ParamTensor::vector(86, 3)};
  CHECK(model->tensors() == expected);
  CHECK(model->num_params() == 89);
}

TEST_CASE("model tensors tile the flat buffer: the GPT's, matrices with their shapes") {
  const ModelSpec spec = gpt_spec();
  const auto model = make_model(spec);
  const auto tensors = model->tensors();
  REQUIRE(tensors.size() == 2 + 12 * 2 + 2);
  size_t at = 0;
  for (const ParamTensor& t : tensors) {
    CHECK(t.offset == at);
    at += t.size();
  }
  CHECK(at == model->num_params());
  CHECK(tensors[0] == ParamTensor{0, 11, 8});  // token embedding (and the tied head)
  CHECK(tensors[1] == ParamTensor{88, 6, 8});  // positions
  CHECK(tensors[4].rows == 24);                // qkv: 3 x width outputs of width inputs
  CHECK(tensors[10] == ParamTensor{tensors[10].offset, 32, 8});  // fc: 4 x width outputs
  CHECK(tensors[12] == ParamTensor{tensors[12].offset, 8, 32});  // fc_proj back to width
}

TEST_CASE("the gradients-ready hook fires, last tensors first, only for finished gradients") {
  for (const ModelSpec& spec : {mlp_spec(), gpt_spec()}) {
    CAPTURE(spec.type);
    const auto model = make_model(spec);
    std::vector<float> params(model->num_params());
    model->init_params(params, 3);
    std::vector<float> grads(params.size(), 0.0f);
    // At each call, a copy of the gradients it declares final.
    std::vector<std::pair<size_t, std::vector<float>>> calls;
    model->on_gradients_ready([&](size_t from) {
      calls.push_back(
          {from, std::vector<float>(grads.begin() + static_cast<ptrdiff_t>(from), grads.end())});
    });
    const Data d = batch_for(spec);
    model->forward_backward(params, Batch{d.x.data(), d.y.data(), 3}, grads, 1.0f);
    REQUIRE(!calls.empty());
    CHECK(calls.back().first == 0);  // in the end everything is final
    const auto tensors = model->tensors();
    for (size_t i = 0; i < calls.size(); ++i) {
      const size_t from = calls[i].first;
      CAPTURE(from);
      if (i > 0) CHECK(from < calls[i - 1].first);  // each call covers more
      // A tensor boundary, and nothing there changed afterwards.
      CHECK(std::any_of(tensors.begin(), tensors.end(),
                        [&](const ParamTensor& t) { return t.offset == from; }));
      CHECK(calls[i].second ==
            std::vector<float>(grads.begin() + static_cast<ptrdiff_t>(from), grads.end()));
    }
    // Evaluation is not a backward pass.
    calls.clear();
    model->evaluate(params, Batch{d.x.data(), d.y.data(), 3});
    CHECK(calls.empty());
  }
}

TEST_CASE("weight decay skips exactly the vectors (biases, LayerNorm), in every model") {
  const auto mlp = make_model(mlp_spec());
  const std::vector<std::pair<size_t, size_t>> biases = {{35, 7}, {70, 4}, {86, 3}};
  std::vector<std::pair<size_t, size_t>> skipped;
  for (const ParamRange& r : mlp->no_decay())
    skipped.emplace_back(r.offset, r.size);
  CHECK(skipped == biases);

  // A layer one unit wide has a weight matrix of one row: a matrix still, and decayed.
  ModelSpec narrow = mlp_spec();
  narrow.hidden = {1};
  const auto thin = make_model(narrow);
  REQUIRE(thin->tensors().at(0) == ParamTensor{0, 1, 5});
  skipped.clear();
  for (const ParamRange& r : thin->no_decay())
    skipped.emplace_back(r.offset, r.size);
  CHECK(skipped == std::vector<std::pair<size_t, size_t>>{{5, 1}, {9, 3}});

  // The GPT's neighbours (a LayerNorm's gain and shift, a bias and the next LayerNorm) merge.
  const auto gpt = make_model(gpt_spec());
  size_t end = 0, gpt_skipped = 0;
  for (const ParamRange& r : gpt->no_decay()) {
    CHECK(r.offset > end);  // sorted, disjoint, and never two ranges that touch
    end = r.offset + r.size;
    gpt_skipped += r.size;
  }
  size_t vectors = 0;
  for (const ParamTensor& t : gpt->tensors())
    vectors += t.is_vector ? t.size() : 0;
  CHECK(gpt_skipped == vectors);
  CHECK(vectors == 2 * (2 * 8 + 3 * 8 + 8 + 2 * 8 + 32 + 8) + 2 * 8);  // 2 layers, then lnf
}

}  // namespace dptrain
