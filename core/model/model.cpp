// Model construction from a recipe, and helpers every model shares.
#include "core/model/model.hpp"

#include "core/error.hpp"
#include "core/model/gpt.hpp"
#include "core/model/mlp.hpp"
#include "core/tensor/cpu_ops.hpp"

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

std::vector<ParamRange> Model::no_decay() const {
  std::vector<ParamRange> out;
  for (const ParamTensor& t : tensors()) {
    if (!t.is_vector) continue;
    if (!out.empty() && out.back().offset + out.back().size == t.offset) {
      out.back().size += t.size();  // neighbours (LayerNorm gain and shift) as one range
    } else {
      out.push_back({t.offset, t.size()});
    }
  }
  return out;
}

std::unique_ptr<Model> make_model(const ModelSpec& spec, std::shared_ptr<Ops> ops, DType dtype) {
  if (!ops) ops = std::make_shared<CpuOps>();
  if (spec.type == "mlp") return make_mlp(spec, std::move(ops), dtype);
  if (spec.type == "gpt") return make_gpt(spec, std::move(ops), dtype);
  throw Error(ErrorKind::recipe,
              "model.type: unknown model '" + spec.type + "' (expected mlp or gpt)");
}

const void* ComputeParams::get(std::span<const float> params) {
  if (dtype_ == DType::f32) return params.data();
  ensure(ops_, copy_, static_cast<int64_t>(params.size()), dtype_);
  ops_.cast(params.data(), DType::f32, copy_.data(), dtype_, static_cast<int64_t>(params.size()));
  return copy_.data();
}

void ensure(Ops& ops, Buffer& buffer, int64_t count, DType dtype) {
  const size_t bytes = static_cast<size_t>(count) * dtype_size(dtype);
  if (buffer.bytes() < bytes) buffer = ops.allocate(bytes);
}

std::vector<float> download_row(Ops& ops, ConstMatrix m, int64_t i) {
  std::vector<float> out(static_cast<size_t>(m.cols));
  if (m.dtype == DType::f32) {
    ops.download(m.row(i), out.data(), out.size() * sizeof(float));
    return out;
  }
  Buffer wide = ops.allocate(out.size() * sizeof(float));
  ops.cast(m.row(i), m.dtype, wide.data(), DType::f32, m.cols);
  ops.download(wide.data(), out.data(), out.size() * sizeof(float));
  return out;
}

}  // namespace dptrain
