// How the ranks of a job on GPUs agree on their backend (NCCL or Gloo) through the store.
#pragma once

#include <chrono>
#include <string>

#include "core/comm/store.hpp"

namespace dptrain {

struct BackendChoice {
  std::string backend;  // "nccl" or "gloo"
  // With "gloo": the first rank that cannot use NCCL, and why.
  int rank = -1;
  std::string why_not;
};

// Every rank posts its world size and whether it can use NCCL (`why_not` empty) or why not; rank
// 0 reads them all and posts the choice, which the others read (one store read each besides rank
// 0's answer). NCCL when every rank can use it; else Gloo, so that one node without NCCL moves
// the whole job rather than splitting it; with `required` (the recipe asks for nccl) a rank that
// cannot fails the job instead: Error(comm) on every rank naming it and why. Ranks started with
// different world sizes (by hand, srun) are Error(usage) naming the rank and both sizes; a rank
// that never posts is Error(comm) naming it, after `timeout`.
BackendChoice agree_on_backend(Store& store, int rank, int world, bool required,
                               const std::string& why_not, std::chrono::milliseconds timeout);

}  // namespace dptrain
