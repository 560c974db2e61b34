// Elementwise activation-dtype ops of the CUDA op table: the residual add.
#include "kernels/cuda_ops_impl.cuh"

namespace dptrain::kernels {
namespace {

template <typename T>
__global__ void add_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    y[i] = from_f32<T>(to_f32(y[i]) + to_f32(x[i]));
  }
}

}  // namespace

void CudaOps::add(ConstMatrix x, Matrix y) {
  const OpTimer timer(*this, "add");
  if (x.rows != y.rows || x.cols != y.cols || x.dtype != y.dtype) {
    precondition_failed("add", "x and y differ in shape or dtype");
  }
  require_contiguous("add", x, "x");
  require_contiguous("add", y, "y");
  const int64_t n = x.size();
  if (n == 0) return;
  constexpr int kThreads = 256;
  const int64_t wanted = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 65535 ? wanted : 65535);
  dispatch_dtype(x.dtype, [&]<typename T>() {
    add_kernel<T><<<blocks, kThreads, 0, stream()>>>(static_cast<const T*>(x.data),
                                                     static_cast<T*>(y.data), n);
  });
  check_launch("add");
}

}  // namespace dptrain::kernels
