// Which op table a rank computes on: the CPU, or one CUDA device (when the build has CUDA).
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "core/tensor/ops.hpp"

namespace dptrain {

// CUDA devices this process can see; 0 without a driver, a device, or a CUDA build.
int cuda_device_count();
// "NVIDIA H200"; empty when there is no such device.
std::string cuda_device_name(int index);
// Whether this binary was built with the CUDA kernels.
bool built_with_cuda();
// Why `needed` GPUs cannot be had here ("this dptrain was built without CUDA", "no CUDA device is
// visible (...)", "only N CUDA device(s) are visible"), or nullopt when they can.
std::optional<std::string> gpus_missing(int needed);

// The op table for train.device: "cpu" -> CpuOps; "cuda" -> the CUDA op table on visible device
// `index` (a rank's local rank, or 0 when the launcher gave it one device). Error(cuda) naming
// the reason when CUDA cannot be used (no CUDA build, no device, index out of range).
std::shared_ptr<Ops> make_ops(const std::string& device, int index);

// The CUDA stream an op table computes on (a cudaStream_t), for a communicator to order itself
// after; null for the CPU op table.
void* compute_stream(Ops& ops);

}  // namespace dptrain
