// Model construction from a recipe, and helpers every model shares.
#include "core/model/model.hpp"

#include "core/error.hpp"
#include "core/model/gpt.hpp"
#include "core/model/mlp.hpp"

namespace dptrain {

std::string with_thousands(size_t n) {
  const std::string digits = std::to_string(n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

std::unique_ptr<Model> make_model(const ModelSpec& spec) {
  if (spec.type == "mlp") return make_mlp(spec);
  if (spec.type == "gpt") return make_gpt(spec);
  throw Error(ErrorKind::recipe,
              "model.type: unknown model '" + spec.type + "' (expected mlp or gpt)");
}

}  // namespace dptrain
