// Which op table a rank computes on.
#include "core/tensor/device.hpp"

#include <fmt/format.h>

#include "core/error.hpp"
#include "core/tensor/cpu_ops.hpp"
#ifdef DPTRAIN_HAVE_CUDA
#include "kernels/cuda_ops.hpp"
#endif

namespace dptrain {

bool built_with_cuda() {
#ifdef DPTRAIN_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

int cuda_device_count() {
#ifdef DPTRAIN_HAVE_CUDA
  return kernels::device_count();
#else
  return 0;
#endif
}

std::string cuda_device_name(int index) {
#ifdef DPTRAIN_HAVE_CUDA
  if (index >= 0 && index < cuda_device_count()) return kernels::device_name(index);
#else
  (void)index;
#endif
  return "";
}

std::optional<std::string> gpus_missing(int needed) {
  if (needed <= 0) return std::nullopt;
  if (!built_with_cuda()) return "this dptrain was built without CUDA";
  const int visible = cuda_device_count();
  if (visible >= needed) return std::nullopt;
  if (visible == 0) return "no CUDA device is visible (check the driver and CUDA_VISIBLE_DEVICES)";
  return fmt::format("only {} CUDA device(s) are visible", visible);
}

std::shared_ptr<Ops> make_ops(const std::string& device, int index) {
  if (device == "cpu") return std::make_shared<CpuOps>();
  if (device != "cuda") {
    throw Error(ErrorKind::recipe,
                "train.device: unknown device '" + device + "' (expected cpu or cuda)");
  }
  // A rank uses visible GPU `index`: there must be index + 1 of them.
  if (const auto why = gpus_missing(index + 1)) {
    throw Error(ErrorKind::cuda,
                fmt::format("train.device \"cuda\": GPU {} for this rank: {}", index, *why));
  }
#ifdef DPTRAIN_HAVE_CUDA
  return kernels::make_cuda_ops(index);
#else
  return nullptr;
#endif
}

void* compute_stream(Ops& ops) {
#ifdef DPTRAIN_HAVE_CUDA
  if (ops.device() != "cpu") return kernels::compute_stream(ops);
#else
  (void)ops;
#endif
  return nullptr;
}

}  // namespace dptrain
