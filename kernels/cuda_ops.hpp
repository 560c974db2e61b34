// The CUDA op table: the GPU implementation of core/tensor/ops.hpp. Plain C++ (no CUDA headers),
// so core can include it; compiled only when the toolkit is found (DPTRAIN_HAVE_CUDA).
// kernels/ includes from core only the op-table interface (core/tensor/ops.hpp, tensor.hpp),
// core/error.hpp, whose Error (header-only) the op table's contract says it throws, and
// core/dynamic_library.hpp (header-only), which loads cuBLASLt.
#pragma once

#include <memory>
#include <string>

#include "core/tensor/ops.hpp"

namespace dptrain::kernels {

// Visible CUDA devices; 0 when there is no driver or no device (never throws).
int device_count();
// "NVIDIA H200" for a device index; Error(cuda) when it does not exist.
std::string device_name(int device);

// The op table on `device` (made current on this thread), with its own compute stream, cuBLASLt
// handle and workspace. Error(cuda) naming the device when it cannot be used.
std::unique_ptr<Ops> make_cuda_ops(int device);

// Loads cuBLASLt now, as the first op table would: Error(cuda) naming the library, or the entry
// point it lacks, when it cannot be used. Needs no GPU.
void load_cublaslt();

// The compute stream (a cudaStream_t) of an op table made by make_cuda_ops, for a communicator to
// order its own stream after; Error(internal) for another op table.
void* compute_stream(Ops& ops);

}  // namespace dptrain::kernels
