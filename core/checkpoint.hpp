// Checkpoints: atomic, checksummed directories step-NNNNNN/ under a run's checkpoints/ folder.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace dptrain {

// Everything besides the tensors that a resume needs to continue bit-identically.
struct TrainingPosition {
  int64_t step = 0;              // optimizer steps completed
  int64_t epoch = 0;             // current epoch of the sampler
  int64_t samples_in_epoch = 0;  // samples of that epoch already consumed (reshards on resume)
  int64_t world_size = 1;
  int64_t global_batch = 1;
  int64_t optimizer_steps = 0;
  std::string recipe_hash;
  // The recipe's model section as JSON text (to_json's "model"): what the parameters are the
  // weights of, for a reader that loads them into another recipe's model (sample). Empty in older
  // checkpoints.
  std::string model;
  // What the data held when it was written (DataSplits::fingerprint): a resume on data that has
  // changed since would not continue the same run. Empty in older checkpoints.
  std::string data_fingerprint;
  std::string rng_state;               // the trainer's generator, as text
  double loss_scale = 1.0;             // fp16's dynamic loss scale
  int64_t loss_scale_clean_steps = 0;  // clean steps since it last changed
  // The loss last logged at or before this step (what a run resumed here reports as its final
  // loss when it has no step left to run); NaN when none was (and in older checkpoints).
  double loss = std::numeric_limits<double>::quiet_NaN();
};

struct CheckpointData {
  TrainingPosition position;
  std::vector<float> params;
  std::vector<float> optimizer_state;
  // What each rank carries between steps that no other holds (error-feedback residuals, or
  // local SGD's optimizer state of its replica): every rank's, rank after rank, each of the same
  // size. Empty when there is none (and in older checkpoints). Under local SGD optimizer_state
  // is the replicas' average, where a resume on another world size starts.
  std::vector<float> comm_state;
};

// One blob of a checkpoint checked against what meta.json records for it.
struct BlobStatus {
  std::string name;                      // its key in meta.json: "params", "optimizer", "comm"
  std::string file;                      // "params.bin": a plain name inside the checkpoint
  uint64_t bytes = 0;                    // recorded size
  std::string checksum;                  // recorded checksum
  std::optional<uint64_t> actual_bytes;  // on disk; none when missing or unreadable
  std::string actual_checksum;           // on disk; empty when missing, unreadable or of the
                                         // wrong size (not read then)
  std::string problem;                   // why it does not verify; empty when it does
  bool denied = false;                   // a permission stops the read: out of reach, maybe intact
  bool ok() const { return problem.empty(); }
};

// A whole checkpoint directory checked, every blob, without stopping at the first failure.
struct CheckpointStatus {
  std::filesystem::path dir;
  int64_t step = -1;                         // from meta.json, else from the directory's name
  bool set_aside = false;                    // a step-N.corrupt directory that resume set aside
  std::optional<TrainingPosition> position;  // none when meta.json is unusable
  // Why meta.json is unusable (then there is no position and no blobs are known: a blob `file`
  // entry that is not a plain name inside the checkpoint is never followed) or cannot be trusted
  // (its checksum does not match its content, or its step is not the directory's; the position
  // and blobs are then what it records). Empty when it is fine.
  std::string meta_problem;
  bool meta_denied = false;          // meta.json is out of reach (a permission), maybe intact
  std::string meta_checksum;         // what meta.json records of itself; empty when none (older)
  std::string meta_actual_checksum;  // of its content as read; empty when unusable
  std::vector<BlobStatus> blobs;
  // Why the run cannot use it although every file verifies (a checkpoint another recipe wrote,
  // copied in), as a CheckpointFilter says: set by a caller that knows the run's recipe (ckpt),
  // as resume and restarts skip such checkpoints. Empty otherwise.
  std::string unusable;
  // The directory was removed while it was read (pruned by a run that goes on, which renames a
  // checkpoint away before deleting it): not a damaged checkpoint, one that no longer exists.
  bool gone = false;
  bool ok() const;
  // Whether it fails only because a permission stops reads (of meta.json or blobs): out of
  // reach, and nothing read is wrong.
  bool denied() const;
  // Whether meta.json's own checksum was compared: false for checkpoints written before dptrain
  // recorded one (their meta.json is then not checked, only parsed), or when it is unusable.
  bool meta_checked() const { return !meta_checksum.empty() && !meta_actual_checksum.empty(); }
  // "params.bin: checksum mismatch ...", one per failed file; empty when ok().
  std::vector<std::string> problems() const;
};

// Checks meta.json (every field, each blob's `file` entry, its own checksum) and the size and
// checksum of every blob; never throws for a damaged checkpoint (that is what it reports).
// read_checkpoint applies the same checks. `progress`, when given, is told as the blobs are read
// the bytes read so far and the total meta.json records; it may throw to end the verification,
// with anything but an Error (that would be taken for the blob's read failing).
using ReadProgress = std::function<void(uint64_t done, uint64_t total)>;
CheckpointStatus verify_checkpoint(const std::filesystem::path& dir,
                                   const ReadProgress& progress = {});

// The position meta.json records when it reads and matches its own checksum, without reading the
// blobs (cheap: which recipe wrote a checkpoint, its step); none otherwise, and then `problem`
// (when given) says why, as verify_checkpoint does.
std::optional<TrainingPosition> checkpoint_position(const std::filesystem::path& dir,
                                                    std::string* problem = nullptr);

// The checksum meta.json records of itself in its "meta_checksum" field: checksum64 of the
// compact JSON text (no whitespace, keys sorted) of its content without that field, so the
// layout of the file does not matter. Error(checkpoint) when `meta_text` is not a JSON object.
std::string meta_json_checksum(const std::string& meta_text);

// "step-000100" for 100.
std::string checkpoint_name(int64_t step);
// The step a checkpoint directory's name says (step-000100, or step-000100.corrupt and
// step-000100.corrupt-2 set aside); -1 otherwise.
int64_t checkpoint_step(const std::filesystem::path& dir);
// Where resume sets aside a checkpoint that failed verification: DIR.corrupt, or DIR.corrupt-K
// (K = 2, 3, ...) where that name is taken (a step set aside before): none is ever replaced.
std::filesystem::path set_aside_path(const std::filesystem::path& dir);

// `before_commit` runs when every file is written and synced, just before the rename that
// commits it (fault injection: a crash there must leave `latest` on the previous checkpoint).
// Writes checkpoints/step-N atomically (temp dir, fsync files and dir, re-read and verify, rename,
// fsync parent), then points `latest` at it and removes all but the `keep` newest.
// Error(checkpoint) on any failure; a checkpoint that does not verify never takes its step's name,
// and `latest` is never touched unless the new one verified.
std::filesystem::path write_checkpoint(const std::filesystem::path& checkpoints_dir,
                                       const TrainingPosition& position,
                                       std::span<const float> params,
                                       std::span<const float> optimizer_state, int64_t keep,
                                       const std::function<void()>& before_commit = {},
                                       std::span<const float> comm_state = {});

// What interrupted writes and prunes left behind (.tmp-* and .pruned-* directories), or what a
// writer is writing now; in name order.
std::vector<std::filesystem::path> incomplete_checkpoints(
    const std::filesystem::path& checkpoints_dir);
// Removes them. Only when no writer runs: rank 0 calls it as a generation starts.
void remove_incomplete_checkpoints(const std::filesystem::path& checkpoints_dir);

// Which blobs read_checkpoint reads: all, or the parameters only (sample: read_checkpoint then
// neither reads nor checks the optimizer state, twice their size; CheckpointData holds none).
enum class CheckpointBlobs { all, params };

// Reads and verifies one checkpoint directory: Error(checkpoint) naming the file and what is wrong.
CheckpointData read_checkpoint(const std::filesystem::path& dir,
                               CheckpointBlobs which = CheckpointBlobs::all);

// Whether list_checkpoints also returns the step-N.corrupt directories that resume set aside.
enum class SetAside { exclude, include };

// step-* directories, newest first (a set-aside one after a live one of the same step); none when
// the directory does not exist. Error(checkpoint) when it cannot be read (a permission).
std::vector<std::filesystem::path> list_checkpoints(const std::filesystem::path& checkpoints_dir,
                                                    SetAside set_aside = SetAside::exclude);

// The checkpoint directory `latest` names (it may since have been removed); empty when there is
// no `latest` or it does not name a step-N. Error(io) when it exists but cannot be read.
std::filesystem::path latest_checkpoint(const std::filesystem::path& checkpoints_dir);
// The checkpoint a user names: a step number (20) names step-N, or step-N.corrupt when only that
// one is left; "latest" the one `latest` names; anything else is a directory name (step-000020).
// Error(usage) naming it and what there is when there is no such checkpoint (for "latest": why
// `latest` cannot be followed).
std::filesystem::path checkpoint_named(const std::filesystem::path& checkpoints_dir,
                                       const std::string& name);
// Points `latest` at `checkpoint` (a step-N directory in checkpoints_dir), atomically.
void point_latest_at(const std::filesystem::path& checkpoints_dir,
                     const std::filesystem::path& checkpoint);
// The checkpoints of steps after `step` (the one a run continues from), which the search for it
// skipped (damaged, or another recipe's): renamed as set_aside_path says, not deleted (they may
// hold something worth recovering by hand), so that the run neither trips over them nor writes
// its own checkpoints of those steps over them. Each is warned about ("set aside step-N as
// step-N.corrupt", or why it could not be); returns whether any was moved.
bool set_aside_newer(const std::filesystem::path& checkpoints_dir, int64_t step,
                     const std::function<void(const std::string&)>& warn);

// `checkpoints/latest` checked: the checkpoint directory it names, or why it cannot be followed.
struct LatestStatus {
  bool exists = false;        // there is a `latest` file
  std::string name;           // the step-N it holds; empty when none, unreadable or other text
  std::filesystem::path dir;  // as latest_checkpoint returns it; empty when it names no step-N
  // Why it cannot be followed: unreadable, a symbolic link, not a checkpoint name, or naming a
  // directory that does not exist. Empty when it can (or there is no `latest`).
  std::string problem;
  bool ok() const { return problem.empty(); }
};
// Never throws; no `latest` at all is not a problem (a run before its first checkpoint).
LatestStatus check_latest(const std::filesystem::path& checkpoints_dir);

// The newest checkpoint that verifies, trying `latest` first, then every step-* newest first;
// none when none does. Each skipped one is reported through `warn`. Error(checkpoint) when one
// newer than any valid one is out of reach (a permission): skipping it would lose its steps,
// which is not what "no checkpoint" (start over) means. `unusable`, when given, says why a
// checkpoint that verifies cannot be used all the same (written by another recipe: one copied
// in from another run); empty when it can. Such a one is skipped and reported as damaged ones
// are. `check_stop`, when given, is called before each checkpoint is verified (a large one takes
// seconds): it throws to stop the search. One removed while it is read (pruned by a run that
// trains on) is passed over in silence, and the search starts again (a few times) when that
// left none.
using CheckpointFilter = std::function<std::string(const TrainingPosition&)>;
std::optional<std::filesystem::path> try_find_valid_checkpoint(
    const std::filesystem::path& checkpoints_dir,
    const std::function<void(const std::string&)>& warn, const CheckpointFilter& unusable = {},
    const std::function<void()>& check_stop = {});
// What a search passed over, said once: given to `warn` (tell()) where it found one, or on the
// lines under the error that none could be used (lines(); a --json error carries them).
struct PassedOver {
  std::function<void(const std::string&)> warn;
  std::vector<std::string> said;
  void operator()(const std::string& why) { said.push_back(why); }
  void tell() const;
  // try_find_valid_checkpoint in `checkpoints_dir`, collecting here; where the search throws (a
  // checkpoint out of reach, a stop) what it passed over until then is told first.
  std::optional<std::filesystem::path> search(const std::filesystem::path& checkpoints_dir,
                                              const CheckpointFilter& unusable = {},
                                              const std::function<void()>& check_stop = {});
  // "\n  WHY" for each (at most 8, then how many more): the lines under such an error.
  std::string lines() const;
};

// The same, with Error(checkpoint) "no valid checkpoint to resume from" when none is valid, why
// each was passed over on the lines below (given to `warn` only where one was found).
std::filesystem::path find_valid_checkpoint(const std::filesystem::path& checkpoints_dir,
                                            const std::function<void(const std::string&)>& warn,
                                            const CheckpointFilter& unusable = {},
                                            const std::function<void()>& check_stop = {});

}  // namespace dptrain
