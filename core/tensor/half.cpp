// Batch conversions between float and IEEE half, with F16C where the CPU has it.
#include "core/tensor/half.hpp"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace dptrain {

namespace {

#if defined(__x86_64__)
bool has_f16c() {
  static const bool yes = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return yes;
}

// vcvtps2ph rounds to nearest even, keeps NaNs quiet with the top of their payload and turns
// overflow into infinity, as to_half() does; MXCSR's flush-to-zero is off in this process.
__attribute__((target("avx,f16c"))) void to_half_f16c(const float* in, Half* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), h);
  }
  for (; i < n; ++i)
    out[i] = to_half(in[i]);
}

__attribute__((target("avx,f16c"))) void to_float_f16c(const Half* in, float* out, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + i));
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i)
    out[i] = to_float(in[i]);
}
#endif

}  // namespace

void to_float(const Half* in, float* out, size_t n) {
#if defined(__x86_64__)
  if (has_f16c()) {
    to_float_f16c(in, out, n);
    return;
  }
#endif
  for (size_t i = 0; i < n; ++i)
    out[i] = to_float(in[i]);
}

void to_half(const float* in, Half* out, size_t n) {
#if defined(__x86_64__)
  if (has_f16c()) {
    to_half_f16c(in, out, n);
    return;
  }
#endif
  for (size_t i = 0; i < n; ++i)
    out[i] = to_half(in[i]);
}

}  // namespace dptrain
