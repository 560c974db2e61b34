// How the ranks of a job agree to start, through the store: on their world size, on every rank
// being able to start at all, and on their backend (NCCL or Gloo).
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "core/comm/store.hpp"
#include "core/error.hpp"

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
// that never posts is Error(comm) naming it, after `timeout`; a rank that could not start
// (refuse_to_start) fails every rank with its error's kind, naming it and why.
// While rank 0 waits for the others to join: `waiting`, when given (and `every` > 0), is told
// every `every` of the wait which ranks have not yet (the first few of them, in order) and how
// many have, of the first `looked` ranks (at most 1024).
struct JoinWait {
  std::vector<int> missing;  // at most 8, the lowest first
  int missing_count = 0;
  int joined = 0;  // rank 0 included
  int looked = 0;  // the world size, or the first 1024 ranks of a larger one
  std::chrono::milliseconds waited{0};
};
BackendChoice agree_to_start(Store& store, int rank, int world, bool required,
                             const std::string& why_not, std::chrono::milliseconds timeout,
                             const std::function<void(const JoinWait&)>& waiting = {},
                             std::chrono::milliseconds every = std::chrono::seconds(10));

// Whether a process has joined this store's job as `rank` already (agree_to_start refuses
// another).
bool rank_met(Store& store, int rank);

// A rank that cannot start (a recipe it cannot read, a run directory it must not write over)
// posts why in place of its answer, so that the ranks at agree_to_start fail at once naming it
// instead of waiting for it until their timeout. Rank 0's post is the choice itself. A leading
// "rank R: " of the error's text is left out (the others name the rank).
void refuse_to_start(Store& store, int rank, int world, const Error& error);

// A rank that failed once the ranks met (its data, its BLAS library, a checkpoint it reads; not
// a communication failure, which is what a peer's exit causes, nor a stop) posts why, for the
// peers whose collectives then fail: peer_failure names it to them.
void report_failure(Store& store, int rank, const Error& error);

// After a collective failed: the first other rank that posted a failure (report_failure), as
// this rank's error: "rank R: rank P cannot start: ..." with P's kind before the first step
// (`stepping` false), "rank R: rank P failed: ..." (comm) after it; none when no peer posted
// one. Either way this rank says it looked (for wait_until_heard).
std::optional<Error> peer_failure(Store& store, int rank, int world, bool stepping);

// For rank 0 serving the store itself, after it posted a failure: waits (up to `bound`) until
// every other rank has looked (peer_failure), but for those in `gone` (known to have exited:
// their heartbeats stood still), which never will.
void wait_until_heard(Store& store, int world, std::chrono::milliseconds bound,
                      const std::vector<int>& gone = {});

// For rank 0 serving the store itself, before it exits with a failure at or before the start:
// waits until every other rank has read the choice or refused (up to `bound`), so that they learn
// why rather than lose the store. Returns at once where they all have. With `answered_only`
// (rank 0 already waited its whole timeout for the answers) not for a rank that gave none.
void wait_until_told(Store& store, int world, std::chrono::milliseconds bound,
                     bool answered_only = false);

// Ranks started without a launcher and given different generations (DPTRAIN_GENERATION) would
// never meet: each says "RANK GENERATION" at the store's root (`root`: not prefixed), under its
// own key and, but for rank 0, a shared one (the last to come wins).
void say_generation(Store& root, int rank, int generation);

// Another rank's generation found at the store's root: the rank, its generation.
struct OtherGeneration {
  int rank = -1;
  int generation = 0;
};

// As a rank starts (`waited_out` false): a rank of a newer generation than this one's (rank 0
// looks at every rank's key, the first 1024, and the shared one, in one request; the others at
// rank 0's). Not an older one then: a late rank of a dead generation must not stop a newer one.
// Once its wait ran out: any other generation, every key looked at. Every rank writes its key
// before it looks, so of two ranks of different generations one sees the other. Store errors
// pass on.
std::optional<OtherGeneration> other_generation(Store& root, int rank, int world, int generation,
                                                bool waited_out);

// This rank's refusal to start for `other` (Error(usage) naming both generations and where this
// rank's came from), posted (refuse_to_start) in its own generation and, where this rank serves
// the store or the other's generation is the older, in that one too, so that the ranks of both
// learn it at once. A store gone meanwhile is passed over.
Error refuse_other_generation(Store& root, int rank, int world, int generation,
                              const std::string& generation_from, const OtherGeneration& other,
                              bool serves_store);

}  // namespace dptrain
