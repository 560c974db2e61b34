// OpenBLAS through dlopen: see blas.hpp.
#include "core/tensor/blas.hpp"

#include <cblas.h>  // the types and constants; nothing of it is linked

#include <dlfcn.h>
#include <sys/mman.h>
#include <sys/resource.h>

#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/dynamic_library.hpp"
#include "core/error.hpp"

namespace dptrain {

namespace {

std::string openblas_library_name() {
  const char* configured = std::getenv(kOpenBlasLibraryEnv);
  return configured != nullptr && *configured != '\0' ? configured : kOpenBlasLibrary;
}

struct OpenBlas {
  DynamicLibrary library{openblas_library_name()};
  decltype(&cblas_sgemm) sgemm = nullptr;
  decltype(&openblas_set_num_threads) set_num_threads = nullptr;
  decltype(&openblas_get_config) get_config = nullptr;
  OpenBlas() {
    library.bind("cblas_sgemm", sgemm);
    library.bind("openblas_set_num_threads", set_num_threads);
    library.bind_optional("openblas_get_config", get_config);  // for doctor's line only
  }
};

// This process's address-space limit (ulimit -v) in KiB, or 0 where there is none.
uint64_t address_space_limit_kib() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_AS, &limit) != 0 || limit.rlim_cur == RLIM_INFINITY) return 0;
  return limit.rlim_cur / 1024;
}

// OpenBLAS allocates a work buffer of about 128 MiB at its first product (and keeps it), and
// when that fails (an address-space limit, ulimit -v) it retries for ever: the rank would hang.
// So, once: whether one fits is tried (mapped and unmapped, never touched), and at once a first
// product (large enough not to take OpenBLAS's small-matrix path) makes OpenBLAS take its buffer,
// before anything else can use up the room. Later allocations that fail are then ours, which
// fail cleanly. The problem, or empty.
std::string take_work_buffer(const OpenBlas& blas) {
  constexpr int kSide = 128;
  std::vector<float> operand(kSide * kSide, 0.0f), product(kSide * kSide);
  if (const uint64_t limit_kib = address_space_limit_kib(); limit_kib > 0) {
    constexpr size_t kWorkBuffer = size_t{136} << 20;
    void* probe = ::mmap(nullptr, kWorkBuffer, PROT_READ | PROT_WRITE,
                         MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (probe == MAP_FAILED) {
      return fmt::format(
          "out of memory: OpenBLAS's work buffer (about 128 MiB) does not fit under this "
          "process's address-space limit (ulimit -v {} KiB): raise the limit",
          limit_kib);
    }
    ::munmap(probe, kWorkBuffer);
  }
  blas.sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, kSide, kSide, kSide, 1.0f, operand.data(),
             kSide, operand.data(), kSide, 0.0f, product.data(), kSide);
  return {};
}

// The thread count set_blas_threads asked for (0: none yet), applied as the library loads.
std::atomic<int> g_threads{0};

// The library loaded, checked and holding its work buffer; Error(io) when it cannot be.
const OpenBlas& load_openblas() {
  static const OpenBlas blas;
  if (const std::string problem = blas.library.problem(); !problem.empty()) {
    // Present but not mappable: the address space is used up (ulimit -v), not the install.
    if (const uint64_t limit_kib = address_space_limit_kib();
        limit_kib > 0 && !blas.library.loaded() &&
        (problem.find("failed to map segment") != std::string::npos ||
         problem.find("annot allocate memory") != std::string::npos)) {
      throw Error(ErrorKind::io,
                  fmt::format("out of memory: {} (under this process's address-space limit, "
                              "ulimit -v {} KiB): raise the limit",
                              problem, limit_kib));
    }
    throw Error(ErrorKind::io,
                fmt::format("{} (dptrain computes on the CPU with OpenBLAS: install its runtime, "
                            "Debian's libopenblas0{})",
                            problem,
                            openblas_library_name() != kOpenBlasLibrary
                                ? fmt::format(", or correct {}", kOpenBlasLibraryEnv)
                                : ""));
  }
  // The products' threads are the ones asked for from the first on.
  if (const int threads = g_threads.load(); threads > 0) blas.set_num_threads(threads);
  if (const std::string no_room = take_work_buffer(blas); !no_room.empty()) {
    throw Error(ErrorKind::io, no_room);
  }
  return blas;
}

// Loaded once: an initialisation that throws is tried again at the next call (and throws again).
const OpenBlas& openblas() {
  static const OpenBlas& blas = load_openblas();
  return blas;
}

blasint blas_dim(int64_t n) {
  if (n < 0 || n > std::numeric_limits<blasint>::max()) {
    throw Error(ErrorKind::internal, fmt::format("gemm: dimension {} out of range", n));
  }
  return static_cast<blasint>(n);
}

}  // namespace

void blas_sgemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                int64_t ldc) {
  openblas().sgemm(CblasRowMajor, trans_a ? CblasTrans : CblasNoTrans,
                   trans_b ? CblasTrans : CblasNoTrans, blas_dim(m), blas_dim(n), blas_dim(k),
                   alpha, a, blas_dim(lda), b, blas_dim(ldb), beta, c, blas_dim(ldc));
}

std::string blas_description() {
  const OpenBlas& blas = openblas();
  void* symbol = nullptr;
  std::memcpy(&symbol, &blas.sgemm, sizeof symbol);  // function pointer -> object pointer (POSIX)
  Dl_info info{};
  const bool found = ::dladdr(symbol, &info) != 0 && info.dli_fname != nullptr;
  std::string config = blas.get_config != nullptr ? blas.get_config() : "OpenBLAS";
  while (!config.empty() && config.back() == ' ')
    config.pop_back();
  return fmt::format("{} at {}", config, found ? info.dli_fname : blas.library.name());
}

void set_blas_threads(int threads) {
  g_threads = threads < 1 ? 1 : threads;
  openblas().set_num_threads(g_threads.load());
}

}  // namespace dptrain
