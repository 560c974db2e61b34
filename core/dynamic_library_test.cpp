// Tests of DynamicLibrary (NCCL and cuBLASLt are loaded with it), and that cuBLASLt loads where
// this build has CUDA, though no GPU is needed for that.
#include "core/dynamic_library.hpp"

#include <doctest/doctest.h>

#include <cmath>

#ifdef DPTRAIN_HAVE_CUDA
#include "kernels/cuda_ops.hpp"
#endif

namespace dptrain {

TEST_CASE("DynamicLibrary binds entry points, and names what is missing") {
  DynamicLibrary libm("libm.so.6");
  REQUIRE(libm.loaded());
  double (*cosine)(double) = nullptr;
  libm.bind("cos", cosine);
  REQUIRE((cosine != nullptr));
  CHECK(cosine(0.0) == 1.0);
  CHECK(libm.problem().empty());
  int (*nothing)() = nullptr;
  libm.bind("dptrain_no_such_symbol", nothing);
  libm.bind("dptrain_nor_this", nothing);
  CHECK((nothing == nullptr));
  CHECK(libm.problem() == "libm.so.6 has no dptrain_no_such_symbol");  // the first missing

  DynamicLibrary absent("libdptrain-absent.so.1");
  CHECK_FALSE(absent.loaded());
  absent.bind("cos", cosine);
  CHECK((cosine == nullptr));
  CHECK(absent.problem().starts_with("libdptrain-absent.so.1 could not be loaded: "));
  CHECK(absent.problem().find("No such file") != std::string::npos);
}

#ifdef DPTRAIN_HAVE_CUDA
TEST_CASE("cuBLASLt is found and has every entry point the CUDA op table calls") {
  CHECK_NOTHROW(kernels::load_cublaslt());
}
#endif

}  // namespace dptrain
