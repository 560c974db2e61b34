// OpenBLAS, opened with dlopen at the first product rather than linked. OpenBLAS starts its thread
// pool (one thread per core, each with a buffer) as it loads: linked, every dptrain process had
// it, also the launcher, the agent and status. Opened here, only processes that multiply (ranks,
// benchmarks, tests) load it, and the launcher sizes their pool (OPENBLAS_NUM_THREADS) to the
// threads they use. Under a tight `ulimit -v` a pool thread retries its buffer's allocation for
// ever, and OpenBLAS joins it at fork and at exit: a launcher without it neither hangs there nor
// spins a core.
#pragma once

#include <cstdint>
#include <string>

namespace dptrain {

// C = alpha op(A) op(B) + beta C, row-major (cblas_sgemm). Error(internal) when a dimension does
// not fit BLAS's int, or OpenBLAS cannot be loaded.
void blas_sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                int64_t ldc);

// OpenBLAS threads for this process (a rank usually wants few: ranks already share the cores).
void set_blas_threads(int threads);

// The OpenBLAS this process computes with, loaded and checked as for the first product, for
// doctor: "OpenBLAS 0.3.21 DYNAMIC_ARCH NO_AFFINITY Haswell MAX_THREADS=64 at PATH". Error(io) as
// blas_sgemm's.
std::string blas_description();

// The library's file name, as dlopen looks for it; env DPTRAIN_OPENBLAS_LIBRARY, when set, names
// another (a path, or a file name the loader searches for).
inline constexpr const char* kOpenBlasLibrary = "libopenblas.so.0";
inline constexpr const char* kOpenBlasLibraryEnv = "DPTRAIN_OPENBLAS_LIBRARY";

}  // namespace dptrain
