// The CUDA side of the op table; compiled only when the toolkit is found (DPTRAIN_HAVE_CUDA).
#pragma once

#include <cstddef>

namespace dptrain::kernels {

// Number of visible CUDA devices; 0 when there is no driver or device.
int device_count();

// Fused AdamW step over flat fp32 buffers on the device (decoupled weight decay, bias
// correction for step t >= 1). Returns a CUDA error string, or nullptr on success.
const char* adamw_step(float* params, const float* grads, float* m, float* v, size_t n, float lr,
                       float beta1, float beta2, float eps, float weight_decay, long long t,
                       void* stream);

}  // namespace dptrain::kernels
