// The run directory: run.json (recipe, world size, generations, status), logs/, checkpoints/.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/comm/net.hpp"  // this_host
#include "launch/hostfile.hpp"

namespace dptrain {

// How much of run.json's types a reader checks (check_record_types below): every field a resume
// reads, or only that its lists hold objects.
enum class RecordCheck { all, lists };

class RunDirectory {
 public:
  // `dir` empty: runs_root/<name>-<UTC time>, made exclusively (a suffix keeps two runs started
  // in one second apart, even two launches racing). `dir` given: used as it is; it must not hold
  // a run (Error(usage) pointing at resume) nor anything else (another run's checkpoints would
  // be taken for this one's) but the empty logs/ and checkpoints/ a failed start leaves.
  // Either way the new run directory is lock()ed. Error(usage) naming it when it cannot be made.
  static RunDirectory create(const std::filesystem::path& dir,
                             const std::filesystem::path& runs_root, const std::string& name);
  // What create refuses a given `dir` for, checked without making anything (launch --dry-run).
  static void check_new(const std::filesystem::path& dir);
  // What create refuses a `runs_root` for (inside another run's checkpoints/ or logs/).
  static void check_runs_root(const std::filesystem::path& runs_root);
  // An existing run: Error(usage) as read_run_json says when its run.json cannot be used, or
  // as check_record_types(`what`) says of a field's type.
  // Nothing is created or changed there (a reader, or a resume with nothing to do).
  static RunDirectory open(const std::filesystem::path& dir, RecordCheck what = RecordCheck::all);
  // Makes logs/ and checkpoints/ where they are missing (a run about to start ranks): Error(usage)
  // naming the directory when it cannot.
  void make_layout() const;

  // Takes this machine's lock on the run (an flock on .lock, held while this object or a copy
  // lives and released when the process ends however it ends), so that two launchers on this
  // machine never drive one run. Error(usage) naming the directory, and the pid run.json
  // records, when another process holds it. (A launcher on another machine holds no lock here:
  // `dptrain status`'s view of the run, from its alive_at stamp, tells whether it lives.)
  // `for_new_run`: a launch's new directory, which another launch took first ("give another
  // --run-dir"); else a resume's ("stop it first ... or wait for it").
  void lock(bool for_new_run = false);
  // Removes the temporaries a dptrain killed while it wrote the run's files left beside them
  // (run.json.tmp-PID, ... of a process gone from this machine). Only once the lock is held and
  // no launcher elsewhere drives the run (a shared filesystem): one there writes its own.
  void remove_dead_temporaries() const;

  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path logs() const { return path_ / "logs"; }
  std::filesystem::path checkpoints() const { return path_ / "checkpoints"; }
  nlohmann::json& info() { return info_; }
  const nlohmann::json& info() const { return info_; }
  // The run's directory name on other hosts (WORKDIR/runs/NAME): this one's name and the run's
  // id, so two runs that share a name never share a directory there.
  std::string remote_name() const;
  void save() const;  // run.json, atomically
  // Whether run.json exists: false until a new run's first save(), before which there is no run.
  bool has_record() const;
  // save() while a job runs, where run.json only records it: a write that fails (a full disk)
  // must not stop ranks that are training, nor hide why they stop. Warned about on stderr, once
  // until a write succeeds again; false when it failed. status(1) then finds the launcher gone
  // by its pid or stamp as for any run.json left behind.
  bool record();

 private:
  RunDirectory(std::filesystem::path path, nlohmann::json info)
      : path_(std::move(path)), info_(std::move(info)) {}

  std::filesystem::path path_;
  nlohmann::json info_;
  std::shared_ptr<const int> lock_;  // the locked descriptor, closed with the last copy
  bool behind_ = false;              // record() failed and no save has succeeded since
};

// The variable a launcher sets ("1") for every rank it starts: such a rank belongs to the run
// whose lock its launcher holds. `dptrain worker` started otherwise refuses such a directory.
constexpr const char* kLaunchedEnv = "DPTRAIN_LAUNCHED";

// run.json's "started_by" when no launcher started the run: workers started by hand or by
// another scheduler, whose rank 0 keeps run.json (dptrain-worker(1)).
constexpr const char* kStartedByWorkers = "dptrain worker";
bool started_by_workers(const nlohmann::json& info);
// What such a run's workers are started again with to continue it: "--resume newest", or
// "--resume newest-or-start" when it holds no checkpoint yet (newest would find none: exit 5).
std::string hand_resume_flag(const std::filesystem::path& run_dir);
// The recorded hosts of a run that used remote ones, as hostfile lines ('host slots=N user=U
// port=P key=PATH'): all those its launch was given when it chose among them (job_hosts: --nnodes
// with spares, hosts lost), else its last generation's; none for a run on this machine alone, nor
// for one whose workers were started by hand.
std::vector<std::string> recorded_host_lines(const nlohmann::json& info);
// Those hosts as a hostfile gives them (origin: `run_json`), for a resume without --hosts;
// Error(usage) naming run.json for a record that does not read as a host.
std::vector<HostSpec> recorded_remote_hosts(const nlohmann::json& info,
                                            const std::filesystem::path& run_json);
// How a launched run is continued, as a hint says it: "'dptrain resume DIR'" (a run on remote
// hosts is resumed on them, reached with the SSH files its launch recorded).
std::string resume_command(const std::filesystem::path& run_dir);

// Removes every checkpoint in RUN_DIR/checkpoints (and its latest pointer), as far as it can: a
// benchmark's run is never resumed, and a large model's checkpoints would only fill the disk.
void remove_checkpoints(const std::filesystem::path& run_dir);

// Takes DIR's lock (an flock on DIR/.lock, made when missing), held while the result or a copy
// lives and released when the process ends however it ends; null when another process holds
// it (a launcher driving the run, or the rank 0 of workers started without one).
// Error(usage) naming the file when it cannot be opened or locked otherwise. The holder writes
// its "PID HOST" into the file (not a probe: `record_holder` false), for another's refusal.
std::shared_ptr<const int> try_lock_run(const std::filesystem::path& dir,
                                        bool record_holder = true);
// Whether another process holds DIR's lock now (false where DIR has no lock file, or it cannot
// be opened); makes no lock file.
bool run_locked_by_another(const std::filesystem::path& dir);

// Error(usage) naming the first of the files a run's launcher and ranks write in place
// (recipe.json, metrics.jsonl, result.json, checkpoints/latest) that is a directory, a pipe or
// a device: found before a resume starts ranks, not by rank 0 steps later, again at each restart.
void check_run_files(const std::filesystem::path& run_dir);

// The run directory that holds `file` (the nearest directory above it with dptrain's run.json:
// an object with a status, generations, recipe or dptrain_version; or one too damaged to tell),
// as weakly_canonical gives it; none outside every run. For the files
// a command writes of its own (--events, report's --out): never among a run's files.
std::optional<std::filesystem::path> run_dir_holding(const std::filesystem::path& file);

// Error(usage) naming `flag` when `file` (for the events stream a launch or resume of `own`
// appends to) lies in a run directory: any but `own`, or in `own` anywhere but a file of its own
// next to run.json that the run does not use (own/events.jsonl is one). `own` may not exist yet.
void check_events_place(const std::string& flag, const std::filesystem::path& file,
                        const std::filesystem::path& own);
// Whether `file` lies directly in `dir` (made or not yet; "dir/" and "dir/." are dir).
bool lies_in(const std::filesystem::path& file, const std::filesystem::path& dir);

// This many failures in a row at one step look deterministic: the launcher stops restarting.
constexpr int kSameStepLimit = 3;
// The failures in a row at one step that end run.json's generations (the newest failed ones, all
// at the same step), counted over the run; step -1 where the newest generation did not fail.
// Generations that failed for a host that could not be reached ("host_unreachable") are passed
// over: neither counted nor the end of the row.
struct RepeatedFailure {
  int times = 0;
  int64_t step = -1;
};
RepeatedFailure repeated_failure(const nlohmann::json& info);

// A new run's run.json before anything else is known of it: its id, created_at,
// dptrain_version and no generations.
nlohmann::json new_run_info();

// DIR/run.json as a JSON object; Error(usage) naming the file or directory when DIR holds none,
// when it is not a file, not valid JSON (at line L, column C) or not an object.
nlohmann::json read_run_json(const std::filesystem::path& dir);
// Error(usage) "FILE: /POINTER: expected KIND, got VALUE" for the first field of run.json that a
// resume reads and that is not of its type (a record edited by hand, or damaged): named, before
// anything is started or written, not a JSON library's type error from deep inside (which, once
// the launch had begun, was even recorded as the run's failure). `lists` (RecordCheck above)
// checks only that the entries of its lists (generations, hosts, restarts, ...) are objects:
// status and report show what else is wrong as unknown or null.
void check_record_types(const nlohmann::json& info, const std::filesystem::path& file,
                        RecordCheck what = RecordCheck::all);

// run.json's record of the newest checkpoint when rank 0 committed it on another host: the
// only trace of it on this machine. None when rank 0 ran here (its checkpoints/ says all).
struct RemoteCheckpoint {
  std::string path;
  std::string host;
};
std::optional<RemoteCheckpoint> remote_last_checkpoint(const nlohmann::json& info);
// The name of the checkpoint run.json records committed in this run directory (rank 0 here), or
// "" when it records none or one on another host. With no live checkpoint in checkpoints/ (none,
// or only set-aside ones), a resume refuses: they were moved away, or their filesystem is not
// mounted (require_recorded_checkpoint; status says so).
std::string recorded_local_checkpoint(const nlohmann::json& info);

// Records `error` as the run's outcome in `info` (run.json): status failed, and its newest
// generation's too when that one had not ended or had completed (a benchmark whose verdict
// failed); a generation's own failure stays as it was recorded.
void record_run_failure(nlohmann::json& info, const std::string& error);
// One entry of run.json's world_size_changes: the world size `from` -> `to` as `generation`
// starts on `hosts`, with the hosts or ranks lost and the hosts joined, and its global batch.
nlohmann::json world_size_change(int64_t from, int64_t to, nlohmann::json hosts,
                                 nlohmann::json lost, nlohmann::json joined, int64_t global_batch,
                                 int64_t generation);

std::string utc_timestamp();  // 2026-11-30T08:43:38Z
// When `file` was last modified, as utc_timestamp writes it; "" when it cannot be read.
std::string utc_timestamp_of(const std::filesystem::path& file);
// Seconds from a utc_timestamp() to now; none when it does not parse.
std::optional<int64_t> seconds_since(const std::string& stamp);

// How often a running launcher stamps run.json's "alive_at", and how old that stamp may get
// before a run seen from another machine counts as stale.
constexpr int kAliveEveryS = 10;
constexpr int kAliveStaleS = 60;

}  // namespace dptrain
