// Model FLOPs of one training step per token (gpt) or per sample (mlp, gpt): see flops.hpp.
#include "core/model/flops.hpp"

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/model/gpt.hpp"
#include "core/model/model.hpp"

namespace dptrain {

namespace {

// In doubles from the start: GPT-sized products overflow nothing, but stay exact up to 2^53.
double mlp_weights(const ModelSpec& spec) {
  double weights = 0;
  int64_t in = spec.input;
  for (const int64_t out : spec.hidden) {
    weights += static_cast<double>(in) * static_cast<double>(out);
    in = out;
  }
  return weights + static_cast<double>(in) * static_cast<double>(spec.classes);
}

}  // namespace

double training_flops_per_token(const ModelSpec& spec) {
  if (spec.type != "gpt") {
    throw Error(ErrorKind::internal,
                fmt::format("training_flops_per_token: model type '{}' has no tokens", spec.type));
  }
  const double n = static_cast<double>(gpt_layout(gpt_config(spec)).total);
  const double l = static_cast<double>(spec.layers);
  const double c = static_cast<double>(spec.width);
  const double t = static_cast<double>(spec.context);
  return 6 * n + 6 * l * c * t;
}

double training_flops_per_sample(const ModelSpec& spec) {
  if (spec.type == "gpt") {
    return training_flops_per_token(spec) * static_cast<double>(spec.context);
  }
  if (spec.type == "mlp") return 6 * mlp_weights(spec);
  throw Error(ErrorKind::internal,
              fmt::format("training_flops_per_sample: unknown model type '{}'", spec.type));
}

std::string training_flops_formula(const ModelSpec& spec) {
  if (spec.type == "gpt") {
    return fmt::format("6N + 6LCT per token (N {}, L {}, C {}, T {}): {:.4g} GFLOP per token",
                       with_thousands(gpt_layout(gpt_config(spec)).total), spec.layers, spec.width,
                       spec.context, training_flops_per_token(spec) / 1e9);
  }
  const double weights = mlp_weights(spec);
  return fmt::format("6 x weights per sample ({} weights): {:.4g} MFLOP per sample",
                     with_thousands(static_cast<size_t>(weights)),
                     training_flops_per_sample(spec) / 1e6);
}

}  // namespace dptrain
