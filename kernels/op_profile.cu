// Per-op GPU time for DPTRAIN_PROFILE: CUDA events around every op of a CudaOps, resolved at
// synchronisation points, written as JSON when the op table goes away. The span from the first
// op's start to the last op's end beside the ops' total says how much of the time the stream sat
// waiting for the host (launch overhead, host work between ops, synchronisations).
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/error.hpp"
#include "kernels/cuda_ops_impl.cuh"

namespace dptrain::kernels {

namespace {

constexpr size_t kMaxPending = 4096;  // event pairs held before they are resolved

}  // namespace

std::unique_ptr<OpProfile> OpProfile::from_environment(int device) {
  const char* dir = std::getenv("DPTRAIN_PROFILE");
  if (dir == nullptr || *dir == '\0') return nullptr;
  return std::unique_ptr<OpProfile>(
      new OpProfile(device, std::string(dir) + "/cuda-ops-" + std::to_string(device) + "-" +
                                std::to_string(::getpid()) + ".json"));
}

OpProfile::~OpProfile() {
  try {
    resolve(true);
    write();
  } catch (...) {
    // A profile is diagnostics: never a reason to fail the run at its end.
  }
  if (first_ != nullptr) cudaEventDestroy(first_);
  for (cudaEvent_t e : free_)
    cudaEventDestroy(e);
  for (const Pending& p : pending_) {
    cudaEventDestroy(p.start);
    cudaEventDestroy(p.end);
  }
  cudaGetLastError();
}

cudaEvent_t OpProfile::take() {
  if (!free_.empty()) {
    cudaEvent_t e = free_.back();
    free_.pop_back();
    return e;
  }
  cudaEvent_t e = nullptr;
  check_cuda(cudaEventCreate(&e), "DPTRAIN_PROFILE: cudaEventCreate");
  return e;
}

cudaEvent_t OpProfile::open(cudaStream_t stream) {
  std::lock_guard lock(mutex_);
  if (first_ == nullptr) {
    cudaEvent_t first = take();
    check_cuda(cudaEventRecord(first, stream), "DPTRAIN_PROFILE: cudaEventRecord");
    first_ = first;  // only once recorded: a failed record leaves no event to time from
  }
  cudaEvent_t start = take();
  check_cuda(cudaEventRecord(start, stream), "DPTRAIN_PROFILE: cudaEventRecord");
  return start;
}

void OpProfile::close(const char* op, cudaEvent_t start, cudaStream_t stream) {
  std::lock_guard lock(mutex_);
  cudaEvent_t end = take();
  check_cuda(cudaEventRecord(end, stream), "DPTRAIN_PROFILE: cudaEventRecord");
  pending_.push_back({op, start, end});
  if (pending_.size() >= kMaxPending) resolve_locked(true);
}

void OpProfile::resolve(bool wait) {
  std::lock_guard lock(mutex_);
  resolve_locked(wait);
}

void OpProfile::restart() {
  std::lock_guard lock(mutex_);
  resolve_locked(true);
  totals_.clear();
  span_ms_ = 0;
  if (first_ != nullptr) free_.push_back(first_);
  first_ = nullptr;  // the next op's open records it again
}

void OpProfile::resolve_locked(bool wait) {
  size_t done = 0;
  for (; done < pending_.size(); ++done) {
    const Pending& p = pending_[done];
    if (wait) {
      check_cuda(cudaEventSynchronize(p.end), "DPTRAIN_PROFILE: cudaEventSynchronize");
    } else if (cudaEventQuery(p.end) != cudaSuccess) {
      cudaGetLastError();  // "not ready" is no error for later checks
      break;
    }
    float ms = 0;
    check_cuda(cudaEventElapsedTime(&ms, p.start, p.end), "DPTRAIN_PROFILE: cudaEventElapsedTime");
    Total& t = totals_[p.op];
    ++t.calls;
    t.ms += ms;
    // (None after a restart that an op was open across, until the next op opens.)
    if (first_ != nullptr) {
      float span = 0;
      check_cuda(cudaEventElapsedTime(&span, first_, p.end),
                 "DPTRAIN_PROFILE: cudaEventElapsedTime");
      span_ms_ = std::max(span_ms_, static_cast<double>(span));
    }
    free_.push_back(p.start);
    free_.push_back(p.end);
  }
  pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(done));
}

void OpProfile::write() const {
  std::vector<std::pair<std::string, Total>> rows(totals_.begin(), totals_.end());
  std::sort(rows.begin(), rows.end(),
            [](const auto& a, const auto& b) { return a.second.ms > b.second.ms; });
  double total = 0;
  for (const auto& r : rows)
    total += r.second.ms;
  std::error_code ignored;
  std::filesystem::create_directories(std::filesystem::path(path_).parent_path(), ignored);
  std::ofstream out(path_);
  out << "{\"device\": \"cuda:" << device_ << "\", \"pid\": " << ::getpid()
      << ", \"total_ms\": " << total << ", \"span_ms\": " << span_ms_
      << ", \"busy_share\": " << (span_ms_ > 0 ? std::min(1.0, total / span_ms_) : 0.0)
      << ", \"ops\": [";
  for (size_t i = 0; i < rows.size(); ++i) {
    out << (i == 0 ? "" : ", ") << "{\"op\": \"" << rows[i].first
        << "\", \"calls\": " << rows[i].second.calls << ", \"ms\": " << rows[i].second.ms
        << ", \"share\": " << (total > 0 ? rows[i].second.ms / total : 0.0) << "}";
  }
  out << "]}\n";
}

}  // namespace dptrain::kernels
