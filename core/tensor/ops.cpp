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

DType parse_precision(const std::string& precision) {
  if (precision == "fp32") return DType::f32;
  if (precision == "bf16") return DType::bf16;
  if (precision == "fp16") return DType::f16;
  throw Error(ErrorKind::recipe, "train.precision: unknown precision '" + precision +
                                     "' (expected fp32, bf16 or fp16)");
}

const char* activation_name(Activation activation) {
  return activation == Activation::relu ? "relu" : "gelu";
}

}  // namespace dptrain
