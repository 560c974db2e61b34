// The GPU tests' main: without a visible CUDA device every test file is skipped (exit 77, which
// ctest reports as skipped), saying so and why (no driver, a driver too old for this binary's
// CUDA runtime, no device), rather than failed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>
#include <string>

#include "core/error.hpp"
#include "kernels/cuda_ops.hpp"

int main(int argc, char** argv) {
  if (dptrain::kernels::device_count() == 0) {
    // Asking for device 0 fails with the reason: cudaGetDeviceCount's error and the driver's and
    // the runtime's CUDA versions.
    std::string why = "cuda:0 does not exist";
    try {
      static_cast<void>(dptrain::kernels::device_name(0));
    } catch (const dptrain::Error& e) {
      why = e.what();
    }
    std::printf("skipped: no CUDA device is visible (the GPU tests need one): %s\n", why.c_str());
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
