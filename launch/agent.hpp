// The ranks of one node: a plan (what the launcher decided for this host) and the agent that
// runs it, locally for the launcher's own host or as `dptrain agent` at the far end of SSH.
#pragma once

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "launch/supervisor.hpp"

namespace dptrain {

struct AgentPlan {
  std::string host;  // as the launcher names it, for labels: "127.0.0.2"
  // As messages name it, with its port where it has one ("127.0.0.2:2222"): hosts that share a
  // name differ by it. An older launcher's plan has none: `host` then (named()).
  std::string display;
  const std::string& named() const { return display.empty() ? host : display; }
  std::filesystem::path run_dir;  // on that host
  nlohmann::json recipe;          // resolved; written to run_dir/recipe.json there
  std::string store;              // HOST:PORT of the launcher's store
  std::string secret;             // the job's store secret: never printed
  int generation = 1;
  int world_size = 1;
  int nominal_world = 0;  // the world size the job's global batch is defined by; 0 = world_size
  std::string backend = "gloo";
  // Local rank i sees one GPU: the i-th of the node's CUDA_VISIBLE_DEVICES, or device i.
  bool one_gpu_per_rank = false;
  std::string resume_from;  // a checkpoint directory on that host, "newest[-or-start]", or empty
  std::vector<int> ranks;   // global ranks on this host; local rank = index
  // Extra environment for the workers: the job's --env, and on remote hosts what the launcher
  // forwards (job.cpp). Never a name the workers get from worker_specs (set_for_each_rank).
  std::map<std::string, std::string> env;
  // What each rank runs after the binary; empty: "worker RUN_DIR/recipe.json --run-dir RUN_DIR
  // [--resume FROM]". Benchmarks run their own worker command this way.
  std::vector<std::string> worker_args;
  std::string data_dir;  // where provision put data files on that host ("" on the launcher's)
  // The sha256 of the launcher's CSV data file (remote hosts; empty: not checked): the file a
  // host's ranks read must be the same, or they would train on other data than the rest.
  std::string data_sha256;
  // The launcher's token dataset as its headers record it (DataSplits::fingerprint; remote hosts;
  // empty: not checked): a host's dataset at the same path must hold the same tokens.
  std::string data_fingerprint;
  // A benchmark's run (bench train): its checkpoints on that host are removed once its ranks
  // have ended, however they ended, as the launcher removes its own.
  bool benchmark = false;

  nlohmann::json to_json(bool redact_secret = false) const;
  // Error(usage) on a malformed plan; Error(ssh) on one of another agent protocol than this
  // build's (the launching host runs another build: exit 4, as for a host without dptrain).
  static AgentPlan from_json(const nlohmann::json& j);
};

// The GPU local rank i gets: the i-th entry of the job's CUDA_VISIBLE_DEVICES (--env) when it
// has one, else of this process's when set ("-1", none, past its end), else "i".
std::string gpu_of_local_rank(int local_rank,
                              const std::map<std::string, std::string>& job_env = {});

// The data file a host's ranks read: the recipe's path when it exists there, else the copy
// provision put in data_dir (the recipe is pointed at it). Error(usage) naming the host and
// the file when it differs from the launcher's (data_sha256): provision again. A token dataset
// is read where the recipe says; Error(usage) when its headers' checksums are not the
// launcher's (data_fingerprint).
void prepare_data(AgentPlan& plan);

// The worker processes of a plan: argv, environment (the secret through the environment only),
// and log files under run_dir/logs.
std::vector<ProcessSpec> worker_specs(const AgentPlan& plan,
                                      const std::filesystem::path& worker_binary);

// Lines an agent writes to the launcher (one per line on stdout):
//   "@rank N TEXT"      a line rank N printed
//   "@event JSON"       a trainer event from rank 0
//   "@failure JSON"     {"rank", "pid", "exit_code", "signal", "description", "last_lines"}
//   "@agent N"          its first line: the agent protocol it speaks (kAgentProtocol)
//   "@alive"            every second: the agent runs and its host answers (the relay takes a
//                       host that sends nothing for 3 SSH keepalive intervals as lost, and drops
//                       these lines)
//   "@done"             every rank of the host exited 0 (the agent's last line then): the
//                       relay takes the host as completed even if it is not heard from again
// The launcher and its agents speak one protocol: the plan's fields and the lines above. Its
// number is in the plan ("protocol") and in the agent's first line ("@agent N"); it is raised
// when either side would misread the other's. An agent refuses a plan of another number, and the
// launcher a host whose agent says another, or none (1: every agent before "@agent"): it writes
// the plan only after the agent's first line ("@agent N" of its own number), and asks an agent
// silent for 5 s its --version (an older agent says nothing before its plan).
// Two builds of one version may differ in it: a host that runs another build than the
// launcher's fails with exit 4 at once, saying so, instead of misreading the other side.
constexpr int kAgentProtocol = 3;
constexpr const char* kAgentHelloPrefix = "@agent ";
constexpr const char* kAgentRankPrefix = "@rank ";
constexpr const char* kAgentFailurePrefix = "@failure ";
constexpr const char* kAgentAliveLine = "@alive";
// Said once the agent has started its ranks (they beat before they meet).
constexpr const char* kAgentStartedLine = "@started";
constexpr const char* kAgentDoneLine = "@done";
constexpr std::chrono::seconds kAgentAliveInterval{1};

// An "@failure" line for a failure of the host rather than of one of its ranks (rank -1): the
// agent could not start them, or the relay lost the host; `refused` when the host refused the
// launcher's SSH connection (SshRefused) or cannot run this dptrain there (none, a library
// missing, another program), which a retry would meet again; `signal`: the one that killed the
// host's agent itself, as its SSH server reported it; `unreachable` when no connection to it
// could be made at all (SshUnreachable), which a later attempt may not meet.
void write_host_failure(std::FILE* out, const std::string& description, bool refused = false,
                        int signal = 0, bool unreachable = false);

// Runs the plan's ranks to the end, writing the lines above to `out`. End of input on `stop_fd`
// (the SSH channel closing) stops the ranks. Returns the exit code: 0; when a rank failed, its
// exit code, or 128 + the signal that killed it; 143 when stopped.
int run_agent(const AgentPlan& plan, std::FILE* out, int stop_fd);

}  // namespace dptrain
