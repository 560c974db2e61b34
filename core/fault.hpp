// Fault injection for tests, from DPTRAIN_FAULT (documented in dptrain-worker(1)):
//   "crash@step=37,rank=1"            SIGKILL itself on rank 1 once 37 steps are done
//   "exit@step=20,rank=0,code=7"      exit with code 7
//   "hang@step=50,rank=0"             stop making progress (sleep until killed)
//   "freeze@step=50,rank=0"           SIGSTOP itself: the whole process stops, heartbeat too
//   "slow@step=10,rank=1,ms=200"      sleep 200 ms before every step from step 10 on
//   "crash-in-checkpoint@step=40"     SIGKILL itself while writing the checkpoint of step 40,
//                                     after its files are written, before it is committed
//   "freeze-before-join@rank=1"       SIGSTOP itself before it reaches the store (no step=): a
//                                     rank frozen, or cut off, before the ranks meet
//   "slow-start@rank=1,ms=5000"      sleep 5 s once the ranks have met, before the first step
//                                     (no step=), its heartbeat going on: a long data load
// Several faults are separated by ';'. Each may add "gen=N" to fire only in generation N
// (the first launch is generation 1, every restart or resume adds one); without it, it fires
// in every generation. rank may be omitted: every rank.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace dptrain {

struct Fault {
  enum class Kind {
    crash,
    exit,
    hang,
    freeze,
    slow,
    crash_in_checkpoint,
    freeze_before_join,
    slow_start
  };
  Kind kind = Kind::crash;
  int64_t step = 0;
  int rank = -1;        // -1: every rank
  int generation = -1;  // -1: every generation
  int code = 1;         // exit
  int64_t ms = 0;       // slow, slow-start
  std::string text;     // as written: "crash@step=37,rank=1"
};

// Error(usage) naming the part of the text that is wrong.
std::vector<Fault> parse_faults(const std::string& text);

// `checkpoint_every` of ranks that write no checkpoints at all (a benchmark's).
inline constexpr int64_t kNoCheckpoints = -1;

// Why each of `faults` can never fire in a run of `steps` steps on `world` ranks that
// checkpoints every `checkpoint_every` steps (0: only at the end; kNoCheckpoints: never) from
// the ranks `writers` (rank 0, and the first rank of each further host), continued from
// `first_step` in generation `first_generation` (a resume) and, with `one_generation` (a
// benchmark's run), in that generation alone, one message for each: a test whose fault never
// fires would pass without testing anything.
std::vector<std::string> unreachable_faults(const std::vector<Fault>& faults, int64_t steps,
                                            int world, int64_t checkpoint_every,
                                            const std::vector<int>& writers = {0},
                                            int64_t first_step = 0, int first_generation = 1,
                                            bool one_generation = false);

class FaultInjector {
 public:
  FaultInjector(std::vector<Fault> faults, int rank, int generation);
  // May not return (crash, exit, hang, freeze); `before_fault`, when given, is called first, as
  // one of those fires (the worker publishes its heartbeat: the step reached, as a failure in the
  // step's work would find it, not the one a heartbeat sent a moment before named).
  void before_step(int64_t step, const std::function<void()>& before_fault = {}) const;
  void before_checkpoint_commit(int64_t step) const;  // may not return
  void before_join() const;                           // may not return until a SIGCONT
  void after_join() const;                            // slow-start's pause
  bool empty() const { return faults_.empty(); }

 private:
  std::vector<Fault> faults_;  // only those for this rank and generation
};

}  // namespace dptrain
