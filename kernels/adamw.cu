// Fused AdamW on the GPU: one pass reads param, grad, m, v and writes param, m, v.
#include <cuda_runtime.h>

#include <cmath>

#include "kernels/kernels.hpp"

namespace dptrain::kernels {

namespace {

__global__ void adamw_kernel(float* __restrict__ params, const float* __restrict__ grads,
                             float* __restrict__ m, float* __restrict__ v, size_t n, float lr,
                             float beta1, float beta2, float eps, float weight_decay, float bias1,
                             float bias2) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const float g = grads[i];
    const float mi = beta1 * m[i] + (1.0f - beta1) * g;
    const float vi = beta2 * v[i] + (1.0f - beta2) * g * g;
    m[i] = mi;
    v[i] = vi;
    const float update = (mi / bias1) / (sqrtf(vi / bias2) + eps);
    params[i] -= lr * (update + weight_decay * params[i]);
  }
}

}  // namespace

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return 0;
  }
  return n;
}

const char* adamw_step(float* params, const float* grads, float* m, float* v, size_t n, float lr,
                       float beta1, float beta2, float eps, float weight_decay, long long t,
                       void* stream) {
  if (n == 0) return nullptr;
  if (t < 1) return "adamw_step: step must be >= 1";
  const float bias1 = 1.0f - std::pow(beta1, static_cast<float>(t));
  const float bias2 = 1.0f - std::pow(beta2, static_cast<float>(t));
  constexpr int kThreads = 256;
  const size_t wanted = (n + kThreads - 1) / kThreads;
  const int blocks = static_cast<int>(wanted < 65535 ? wanted : 65535);
  adamw_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      params, grads, m, v, n, lr, beta1, beta2, eps, weight_decay, bias1, bias2);
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

}  // namespace dptrain::kernels
