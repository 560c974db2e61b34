// One generation of a job: the store, each host's ranks (spawned directly on this host, through
// an SSH relay and `dptrain agent` elsewhere), supervision, and run.json updates.
#pragma once

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/comm/store.hpp"
#include "core/recipe.hpp"
#include "launch/agent.hpp"
#include "launch/elastic.hpp"
#include "launch/events.hpp"
#include "launch/hostfile.hpp"
#include "launch/rank_env.hpp"
#include "launch/run_dir.hpp"
#include "launch/ssh.hpp"
#include "launch/status.hpp"

namespace dptrain {

struct RemoteOptions {
  SshOptions ssh;
  std::string workdir = kDefaultWorkdir;  // on remote hosts: bin/dptrain and runs/<run>/
  std::string remote_binary;              // empty: WORKDIR/bin/dptrain
  std::string master_addr;                // empty: 127.0.0.1 if every host is local, else the
                                          // address this machine reaches the first remote host from
  uint16_t master_port = 0;               // 0: a free port
};

struct JobSpec {
  Recipe recipe;
  std::vector<HostSpec> hosts;  // this generation's; empty: `world_size` ranks on localhost
  int world_size = 1;           // with hosts: the sum of their slots
  // Elastic world size. With hosts: `nodes` counts hosts, chosen in order from `candidates`
  // (every host the job may use: later ones are spares); a lost host is dropped when it does
  // not answer within rejoin_timeout. While a generation runs below `nodes.max` hosts, the
  // others are probed every rejoin_probe_interval(rejoin_timeout); when one answers, the ranks
  // checkpoint and stop, and the next generation has it (not counted as a restart).
  // Locally: `nodes` counts ranks, and a rank killed by SIGKILL (the OOM killer, a cgroup
  // limit) is capacity lost: the next generation has one rank fewer. A fixed size: min == max.
  SizeRange nodes{0, 0};  // {0, 0}: every host given, or world_size ranks
  std::vector<HostSpec> candidates;
  // Every host given (candidates, before any is left out): what names each host's log alike in
  // every generation.
  std::vector<HostSpec> all_hosts;
  // Candidates taken out for the rest of this invocation, each as "HOST: why": a host that
  // refused its generation (it cannot run this dptrain) would refuse the next one too, though it
  // still answers SSH.
  std::vector<std::string> left_out;
  std::chrono::milliseconds rejoin_timeout{60000};
  int nominal_world = 0;  // the world size the global batch is defined by; 0: world_size
  std::string backend = "auto";
  // Every rank gets one GPU of its node (CUDA_VISIBLE_DEVICES); true when recipe.train.device is
  // "cuda" whatever this says (benchmarks of GPU collectives set it).
  bool one_gpu_per_rank = false;
  // A verified checkpoint, "newest-or-start" (the newest any node holds, or step 0), or empty.
  std::filesystem::path resume_from;
  // The host of the last recorded checkpoint, where a resume already warned that it is not
  // among its hosts: the ranks' start from an older one is not said again.
  std::string left_out_holder_said;
  std::filesystem::path worker_binary;  // this executable
  RemoteOptions remote;
  RankEnv env;  // --env: what every rank gets on top of its host's environment
  // What every rank runs after the binary instead of the trainer (AgentPlan::worker_args): a
  // benchmark. Rank 0 reports its outcome as a "result" event like the trainer's.
  std::vector<std::string> worker_args;
  // A benchmark's training run (bench train): never resumed, its checkpoints removed after it, so
  // its errors name no checkpoint and promise no resume.
  bool benchmark = false;
  std::chrono::milliseconds hang_timeout{0};  // 0: no hang detection
  EventLog* events = nullptr;                 // the --events stream, if any
  // Told every event of rank 0 as it comes (a benchmark keeps what it measured, for an end
  // before its result).
  std::function<void(const nlohmann::json&)> on_event;
};

struct JobOutcome {
  int exit_code = 0;
  std::string status;      // completed | failed | interrupted | terminated
  std::string error;       // empty on success; the first line names the failed host and rank
  nlohmann::json result;   // the trainer's result on success
  int64_t last_step = -1;  // the last step rank 0 reported before the end (-1: none)
  // The step a failure or stop came at, from the ranks' heartbeats and rank 0's progress (-1:
  // before any rank began a step).
  int64_t failed_step = -1;
  int64_t start_step = 0;  // the step the generation started from (its checkpoint's, or 0)
  int world_size = 0;      // the generation's
  // The newest valid checkpoint in the run directory after the generation (empty: none, or
  // unknown because rank 0 ran on another host).
  std::string last_checkpoint;
  // The local ranks killed by SIGKILL (not by the launcher), when the failure was one of them: each
  // one's capacity is taken as lost (an elastic job goes on without them).
  std::vector<int> killed_ranks;
  bool rank_killed() const { return !killed_ranks.empty(); }
  // The failed rank exited 2: a recipe or data problem, or a diverged training, which a restart
  // from a checkpoint would meet again.
  bool repeats = false;
  // A host refused the launcher's SSH connection (authentication, host key), or cannot run this
  // dptrain (none there, a library missing, another program): a restart to the same hosts would
  // meet it again.
  bool host_refused = false;
  std::string refused_host;  // that host (HostSpec::display)
  // No connection to a host could be made (refused, timed out, no route: SshUnreachable), no
  // rank's failure: not the training's to repeat, so not counted towards the failures in a row
  // at one step (RestartPolicy::same_step_limit); the restart budget and its back-off bound the
  // wait for the host to come back. (A connection that dropped or fell silent mid-run is a
  // lost host, exit 3, and counts as before: a host that dies at one step each time.)
  bool host_unreachable = false;
  // Stopped after kSameStepLimit failures in a row at one step (run_job_with_restarts).
  bool deterministic = false;
  int failed_rank = -1;  // the rank whose failure ended the generation, when one did
  // Not a failure: the ranks checkpointed and stopped so that hosts that answer again can join
  // (an elastic job below its maximum size); exit_code 0, status "resized".
  bool resized = false;
  int restarts = 0;  // generations started after failures (run_job_with_restarts)
  // Where this launch or resume began training, from its first generation whose ranks met: the
  // step, and the checkpoint's name (null: from step 0). Step -1: no ranks met (both null in
  // to_json).
  int64_t began_at_step = -1;
  nlohmann::json resumed_from;
  // What the launcher warned of (StatusPrinter::warnings), for the --json outcome.
  std::vector<std::string> warnings;
  // {status, exit_code, run_dir, restarts, error?} and the trainer's result; an outcome without
  // one (failed, terminated, interrupted) has steps (the step reached), world_size and
  // last_checkpoint (null when unknown) too.
  nlohmann::json to_json(const RunDirectory& run) const;
};

struct RestartPolicy {
  int max_restarts = 0;                     // for the job as a whole
  std::chrono::milliseconds backoff{1000};  // doubled after every restart, at most 30 s
  int same_step_limit = kSameStepLimit;     // failures in a row at one step: deterministic, stop
};

// Resolves "auto" to the backend this build and machine use.
std::string resolve_backend(const std::string& requested);

// What a launcher's rank that waited in vain for another to join is told (Store::join_advice):
// the launcher started every rank with the same store and world size, so the log of the one that
// did not join says where it stopped; `longer` names what gives the ranks longer to start.
JoinAdvice launched_join_advice(std::string longer);

// The ranks on this machine (those of the local hosts, or all `world` when hosts is empty) need a
// GPU each and must find that many visible: otherwise Error(cuda) "WHO: N rank(s) on this machine
// need a GPU each, but <reason>", before any rank starts, rather than every rank failing alike.
// Remote hosts are checked by their own ranks.
void require_local_gpus(const std::vector<HostSpec>& hosts, int world, const std::string& who);
// The same for a job: its ranks on this machine when train.device is "cuda" (or
// one_gpu_per_rank); and a GPU list given with --env must name a GPU for each of a host's ranks
// (Error(usage)).
void check_local_gpus(const JobSpec& spec);

// A generation whose launcher was killed (or whose machine went down) never recorded its end:
// closed in `info` (run.json) as lost, when it was last known alive: the newer of alive_at
// (stamped every few seconds; a new launcher must not have stamped it yet) and `last_seen` (a
// utc_timestamp: when the run's files last changed, as its metrics.jsonl; a run of workers
// started without a launcher keeps no alive_at).
void close_lost_generation(nlohmann::json& info, const std::string& recorder = "its launcher",
                           const std::string& last_seen = "");

// What run.json records of how the job's ranks are started, for `dptrain resume` to start them
// alike: "remote" (workdir, remote_binary) when `remote` (some host is not this machine), "env"
// (what --env gave).
void record_job_settings(nlohmann::json& info, const JobSpec& spec, bool remote);

// How run.json says the job was placed and reached (hosts, job_hosts, remote, env, job_size,
// world_size, backend), to be put back (restore_placement) when what replaced it failed before
// its ranks met (a mistyped --workdir or hostfile, a host that refused): the next resume then
// defaults to what last ran, not to what never started. Null for a record that has no hosts yet.
nlohmann::json placement_of(const nlohmann::json& info);
void restore_placement(nlohmann::json& info, const nlohmann::json& placement);

// The plan of a job: hosts in order, ranks assigned in blocks of their slots.
struct JobPlan {
  std::string store;   // HOST:PORT
  std::string secret;  // the store's per-job secret
  std::vector<HostSpec> hosts;
  std::vector<AgentPlan> agents;                      // one per host, same order
  nlohmann::json to_json(const JobSpec& spec) const;  // for --dry-run: commands, env, no secret
};
// Which ranks run where, with which command and environment. Starts nothing. Remote hosts use
// WORKDIR/runs/REMOTE_NAME (RunDirectory::remote_name).
JobPlan plan_job(const JobSpec& spec, const std::filesystem::path& run_path,
                 const std::string& remote_name, int generation, const std::string& store_addr,
                 uint16_t store_port, const std::string& secret);
// What ranks on other hosts get from the launcher's own environment (local ones inherit all of
// it): the test settings ranks read (DPTRAIN_FAULT, ...) and what chooses the BLAS kernels and
// threads (OPENBLAS_*, OMP_*, ...), so that every rank computes alike wherever it runs.
std::map<std::string, std::string> forwarded_environment();
// The address the store listens on and the workers dial. Error(ssh) when no remote host resolves.
std::string resolve_master_addr(const JobSpec& spec);

// Error(ssh) naming a host that does not resolve, for a job that needs every host it names (no
// --nnodes): found before anything is made for the run.
void check_hosts_resolve(const JobSpec& spec);

// The fewest ranks an elastic job may run on (spec.nodes.min ranks, or the slots of its
// nodes.min smallest hosts); spec.world_size for a fixed one.
int smallest_world(const JobSpec& spec);
// Error(recipe), prefixed with `origin`, when the recipe cannot run on the world an elastic job
// may shrink to (parameter servers that would leave no worker): refused before the job starts,
// not met after a rank is lost.
void check_smallest_world(const JobSpec& spec, const RecipeSource& origin);
// Sets generation `generation`'s peer_failed key in the store at `store` (HOST:PORT): a rank
// failed, and the others are about to be stopped (what they then say). Best effort: false when
// the store did not take it within 2 s.
bool mark_peer_failed(const std::string& store, const std::string& secret, int generation);
// Error(usage) when --master-port names a port the store cannot listen on (another process
// holds it): found before anything is made for the run, not as every rank failing. Nothing to
// check for a free port (0), or when the store's address cannot be told yet.
void check_store_port(const JobSpec& spec);

// Error(usage) when DPTRAIN_FAULT (the launcher's, or the job's --env) does not parse: what a
// resume checks before it touches run.json.
void check_fault_syntax(const JobSpec& spec);

// DPTRAIN_FAULT (fault injection for tests; the launcher's, or the job's --env) as the ranks
// will read it: Error(usage) when it does
// not parse; a warning for each fault that can never fire in this job, continued from
// `first_step` in generation `first_generation` (and no other, with `one_generation`).
std::vector<std::string> check_fault_injection(const JobSpec& spec, int64_t first_step = 0,
                                               int first_generation = 1,
                                               bool one_generation = false);
// The same for ranks that are not the trainer (`bench comm`'s): `steps` steps, no checkpoints.
std::vector<std::string> check_benchmark_fault_injection(const JobSpec& spec, int64_t steps);

// Runs one generation to its end, recording it in run.json. Never throws for a rank's failure:
// that is an outcome with exit code 3 (4 when a host cannot be reached over SSH).
// The checkpoints newer than `chosen` set aside (the core set_aside_newer, warned about on
// `status`); `latest` then names the chosen one. Resume and restarts both do this, and workers
// continuing from the newest.
void set_aside_newer(const std::filesystem::path& checkpoints, const std::filesystem::path& chosen,
                     StatusPrinter& status);

JobOutcome run_job(RunDirectory& run, const JobSpec& spec, StatusPrinter& status);
// Error(usage) when this process's limit on open files is too low for the job's ranks (their
// pipes, logs and store connections here): a launch and a resume check it before they make or
// change anything, run_job again for each generation.
void check_open_files(const JobSpec& spec);
// The ranks the job runs on this machine (those of local hosts, or all without hosts).
int local_rank_count(const JobSpec& spec);
// How a host is told apart in its agent log's name (TAG-agent.log) and its lines on the console
// ([TAG] and [TAG:RANK]): its name, and where hosts share one (a machine's sshd on two ports,
// hosts behind one forwarding gateway) NAME-PORT. Decided over all the hosts an elastic job
// chooses among (spec.all_hosts), so alike in every generation.
std::string host_tag(const JobSpec& spec, const HostSpec& host);

// run_job, and after a rank or host failure (exit 3 or 4) a new generation from the newest
// valid checkpoint (or from step 0 when there is none), with exponential back-off, until the
// job completes, restarts run out, or the failure repeats at one step. Every restart is
// recorded in run.json with its cause. An elastic job (spec.nodes) picks its hosts or ranks
// before every generation, and records every change of world size.
// Error(checkpoint) when run.json records a checkpoint committed on this machine (rank 0 ran
// here) and the run's checkpoints directory holds none: moved away, or its filesystem not
// mounted. A resume or restart would otherwise train from step 0 as if none had been written.
// `then`: what to do once they are back (a resume's by default).
// missing_recorded_checkpoints: that message without `then` ("" when they are there), for a
// command that only reads them (ckpt list and verify warn).
std::string missing_recorded_checkpoints(const std::filesystem::path& checkpoints,
                                         const nlohmann::json& info);
void require_recorded_checkpoint(
    const RunDirectory& run,
    std::string_view then =
        "Put them back and resume; to start over, launch the recipe into a "
        "new run directory");

JobOutcome run_job_with_restarts(RunDirectory& run, JobSpec spec, StatusPrinter& status,
                                 const RestartPolicy& policy);

// The path of the running executable (to start workers and relays with).
std::filesystem::path self_executable();

}  // namespace dptrain
