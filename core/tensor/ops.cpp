// Names of the op table's enums, shared by every device implementation.
#include "core/tensor/ops.hpp"

#include "core/error.hpp"

namespace dptrain {

Activation parse_activation(const std::string& name) {
  if (name == "relu") return Activation::relu;
  if (name == "gelu") return Activation::gelu;
  throw Error(ErrorKind::recipe,
              "model.activation: unknown activation '" + name + "' (expected relu or gelu)");
}

const char* activation_name(Activation activation) {
  return activation == Activation::relu ? "relu" : "gelu";
}

}  // namespace dptrain
