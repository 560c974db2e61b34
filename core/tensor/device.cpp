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

std::shared_ptr<Ops> make_ops(const std::string& device, int index) {
  if (device == "cpu") return std::make_shared<CpuOps>();
  if (device != "cuda") {
    throw Error(ErrorKind::recipe,
                "train.device: unknown device '" + device + "' (expected cpu or cuda)");
  }
  if (!built_with_cuda()) {
    throw Error(ErrorKind::cuda,
                "train.device \"cuda\": this dptrain was built without CUDA (rebuild where the "
                "CUDA toolkit is installed, or use \"cpu\")");
  }
  const int count = cuda_device_count();
  if (count == 0) {
    throw Error(ErrorKind::cuda, "train.device \"cuda\": no CUDA device is visible to this rank" +
                                     std::string(" (check the driver and CUDA_VISIBLE_DEVICES)"));
  }
  if (index < 0 || index >= count) {
    throw Error(ErrorKind::cuda,
                fmt::format("train.device \"cuda\": this rank wants GPU {} but {} visible", index,
                            count == 1 ? "only 1 is" : fmt::format("only {} are", count)));
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
