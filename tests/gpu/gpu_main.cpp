// The GPU tests' main: without a visible CUDA device every test file is skipped (exit 77, which
// ctest reports as skipped), saying so, rather than failed.
#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "kernels/cuda_ops.hpp"

int main(int argc, char** argv) {
  if (dptrain::kernels::device_count() == 0) {
    std::printf("skipped: no CUDA device is visible (the GPU tests need one)\n");
    return 77;
  }
  doctest::Context context(argc, argv);
  return context.run();
}
