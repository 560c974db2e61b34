// One generation of a job: store, each host's ranks, supervision, run.json updates.
#include "launch/job.hpp"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string_view>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/checkpoint.hpp"
#include "core/comm/auth.hpp"
#include "core/comm/communicator.hpp"
#include "core/comm/net.hpp"
#include "core/comm/socket.hpp"
#include "core/comm/tcp_store.hpp"
#include "core/data/tokens.hpp"
#include "core/error.hpp"
#include "core/fault.hpp"
#include "core/fs.hpp"
#include "core/heartbeat.hpp"
#include "core/json_error.hpp"
#include "core/tensor/device.hpp"
#include "core/trainer.hpp"
#include "launch/hang_watch.hpp"
#include "launch/provision.hpp"
#include "launch/relay.hpp"
#include "launch/supervisor.hpp"

namespace dptrain {

namespace fs = std::filesystem;
using nlohmann::json;

fs::path self_executable() {
  return fs::read_symlink("/proc/self/exe");
}

// "auto" stays for the ranks to settle: nccl when every rank has a GPU and NCCL, gloo otherwise.
std::string resolve_backend(const std::string& requested) {
  if (requested == "auto" || requested == "gloo" || requested == "nccl") return requested;
  throw Error(ErrorKind::usage,
              fmt::format("--backend: unknown backend '{}' (use auto, gloo or nccl)", requested));
}

JoinAdvice launched_join_advice(std::string longer) {
  return {
      "the launcher started every rank with the same store and world size: the log of each "
      "rank that did not join says where it stopped (frozen, or still starting)",
      std::move(longer)};
}

void require_local_gpus(const std::vector<HostSpec>& hosts, int world, const std::string& who) {
  int local = hosts.empty() ? world : 0;
  for (const HostSpec& h : hosts) {
    if (h.is_local()) local += h.slots;
  }
  if (const auto why = gpus_missing(local)) {
    throw Error(
        ErrorKind::cuda,
        fmt::format("{}: {} rank(s) on this machine need a GPU each, but {}", who, local, *why));
  }
}

void check_local_gpus(const JobSpec& spec) {
  if (!spec.one_gpu_per_rank && spec.recipe.train.device != "cuda") return;
  int ranks_per_host = spec.hosts.empty() ? spec.world_size : 0;
  for (const HostSpec& h : spec.candidates.empty() ? spec.hosts : spec.candidates)
    ranks_per_host = std::max(ranks_per_host, h.slots);
  spec.env.check_gpu_list(ranks_per_host);
  require_local_gpus(
      spec.hosts, spec.world_size,
      spec.recipe.train.device == "cuda" ? "train.device \"cuda\"" : "--backend nccl");
}

json JobOutcome::to_json(const RunDirectory& run) const {
  const auto remote = remote_last_checkpoint(run.info());  // rank 0's, when on another host
  json j = {{"status", status},
            {"exit_code", exit_code},
            {"run_dir", run.path().string()},
            {"restarts", restarts}};
  // Null where no ranks met (a resume of a completed run, one refused before a rank started).
  j["began_at_step"] = began_at_step >= 0 ? json(began_at_step) : json(nullptr);
  j["resumed_from"] = began_at_step >= 0 ? resumed_from : json(nullptr);
  j["warnings"] = warnings;
  // As every command's --json has them: [] for a run that did not fail.
  j["errors"] = error.empty() ? json::array() : json(error_messages(error));
  if (!error.empty()) j["error"] = error;
  if (result.is_null() || !result.is_object()) {
    // A generation that failed as it started (its heartbeats at step 0, say) still reached the
    // step it continued from.
    j["step"] = std::max({failed_step, last_step, start_step});
    j["world_size"] = world_size > 0 ? json(world_size) : json(nullptr);
    // A path, as the trainer's result has it; for a rank 0 on another host, where it wrote its
    // newest (run.json's record, as status and report name it).
    j["last_checkpoint"] = last_checkpoint.empty()
                               ? json(nullptr)
                               : json((run.checkpoints() / last_checkpoint).string());
    if (remote && last_checkpoint.empty()) j["last_checkpoint"] = remote->path;
  }
  for (const auto& [k, v] : result.items())
    j[k] = v;
  // The trainer's result names the checkpoint where the run lay then: a run moved or copied since
  // (resume of a completed one reads it back) names it where it lies now, as status does.
  if (const json& path = j.value("last_checkpoint", json());
      path.is_string() && !(remote && path == remote->path)) {
    std::error_code ec;
    const fs::path here = run.checkpoints() / fs::path(path.get<std::string>()).filename();
    if (fs::is_directory(here, ec)) j["last_checkpoint"] = here.string();
  }
  // The host it lies on when that is not this one (null: here, or none).
  j["last_checkpoint_host"] = remote && j.value("last_checkpoint", json()) == remote->path
                                  ? json(remote->host)
                                  : json(nullptr);
  // As in status and report: the step reached, the steps planned (a completed run's result
  // counts the steps it did, which are all of them).
  if (result.is_object()) j["step"] = result.value("steps", json(nullptr));
  const json& recipe = run.info().value("recipe", json::object());
  j["steps"] = recipe.contains("train") ? recipe["train"].value("steps", json(nullptr))
                                        : j.value("step", json(nullptr));
  return j;
}

std::string host_tag(const JobSpec& spec, const HostSpec& host) {
  const auto& all = spec.all_hosts.empty() ? spec.hosts : spec.all_hosts;
  const auto same_name =
      std::count_if(all.begin(), all.end(), [&](const HostSpec& h) { return h.host == host.host; });
  return same_name > 1 ? fmt::format("{}-{}", host.host, host.port) : host.host;
}

namespace {

// What the launcher's environment passes on to ranks on other hosts (local ones inherit all of
// it): the test and debugging settings a rank reads, and what chooses the BLAS kernels and
// threads (OPENBLAS_CORETYPE, OMP_NUM_THREADS, ...), so that every rank computes alike
// (bit-identical results) wherever it runs. A name that ends in '_' is a prefix.
constexpr std::string_view kForwardedEnv[] = {
    "DPTRAIN_FAULT", "DPTRAIN_DEBUG_STEP_DELAY_MS", "OPENBLAS_", "GOTO_", "OMP_", "GOMP_", "MKL_"};

bool forwarded(std::string_view name) {
  return std::any_of(std::begin(kForwardedEnv), std::end(kForwardedEnv), [&](std::string_view f) {
    return f.ends_with('_') ? name.starts_with(f) : name == f;
  });
}

// The error a rank printed last ("dptrain: error: MESSAGE"), without a "rank N: " its message
// starts with, taken out of `lines`: what a failure's first line says after the exit, rather
// than twice. Empty when it printed none.
std::string take_rank_error(std::vector<std::string>& lines, int rank) {
  for (auto it = lines.rbegin(); it != lines.rend(); ++it) {
    std::string_view line = *it;
    if (const auto at = line.find(kErrorLinePrefix); at != std::string_view::npos) {
      line.remove_prefix(at + kErrorLinePrefix.size());
      const std::string own = fmt::format("rank {}: ", rank);
      if (rank >= 0 && line.starts_with(own)) line.remove_prefix(own.size());
      std::string message(line);
      lines.erase(std::next(it).base());
      return message;
    }
  }
  return {};
}

std::vector<HostSpec> job_hosts(const JobSpec& spec) {
  if (!spec.hosts.empty()) return spec.hosts;
  HostSpec local;
  local.host = "localhost";
  local.slots = spec.world_size;
  local.origin = "--nproc";
  return {local};
}

bool all_local(const std::vector<HostSpec>& hosts) {
  for (const auto& h : hosts) {
    if (!h.is_local()) return false;
  }
  return true;
}

std::string remote_binary(const JobSpec& spec) {
  return spec.remote.remote_binary.empty() ? spec.remote.workdir + "/bin/dptrain"
                                           : spec.remote.remote_binary;
}

RelayPlan relay_plan(const JobSpec& spec, const HostSpec& host, const AgentPlan& agent) {
  RelayPlan r;
  r.host = host;
  r.ssh = spec.remote.ssh;
  r.remote_binary = remote_binary(spec);
  r.agent = agent;
  return r;
}

ProcessSpec relay_spec(const JobSpec& spec, const RelayPlan& plan, const fs::path& logs) {
  ProcessSpec p;
  p.label = fmt::format("host {}", plan.host.display());
  p.rank = plan.agent.ranks.empty() ? 0 : plan.agent.ranks.front();
  p.argv = {spec.worker_binary.string(), "_relay"};
  p.hold_sigterm = true;  // a stop while it loads is answered by its handler (main installs it)
  p.end_signal = kRelayEndSignal;  // the launcher's kill reaches the host's ranks at once
  p.env = {{kRelayPlanEnv, json_text(plan.to_json())}};
  p.log_file = logs / (host_tag(spec, plan.host) + "-agent.log");
  return p;
}

// A worker's environment as a plan shows it: without the store's secret or the values --env took
// from the launcher's environment.
json redacted_env(const std::vector<std::pair<std::string, std::string>>& env,
                  const RankEnv& job_env) {
  json out = json::object();
  for (const auto& [k, v] : env) {
    const bool hidden =
        k == kStoreSecretEnv || (job_env.from_launcher.count(k) != 0 && job_env.values.at(k) == v);
    out[k] = hidden ? std::string("<redacted>") : v;
  }
  return out;
}

// Per-rank log files kept by the launcher for ranks on other hosts.
class RemoteRankLogs {
 public:
  explicit RemoteRankLogs(fs::path dir) : dir_(std::move(dir)) {}
  std::ofstream& open(const std::string& host, int rank) {
    auto& f = files_[{host, rank}];
    if (!f) {
      f = std::make_unique<std::ofstream>(dir_ / fmt::format("{}-rank{}.log", host, rank),
                                          std::ios::app);
    }
    return *f;
  }
  void append(const std::string& host, int rank, const std::string& line) {
    auto& f = open(host, rank);
    f << line << '\n';
    f.flush();
  }

 private:
  fs::path dir_;
  std::map<std::pair<std::string, int>, std::unique_ptr<std::ofstream>> files_;
};

// The newest checkpoint in this run directory that verifies (nothing is set aside or changed),
// or nothing; `unreachable` says why when a newer one is out of reach (a permission).
std::optional<std::string> newest_valid_checkpoint(const RunDirectory& run, const Recipe& recipe,
                                                   std::string& unreachable) {
  try {
    const auto found = try_find_valid_checkpoint(
        run.checkpoints(), [](const std::string&) {}, written_by(recipe));
    if (found) return found->filename().string();
  } catch (const Error& e) {
    unreachable = e.what();
  }
  return std::nullopt;
}

// What the ranks left in the generation's store: the furthest step any rank's heartbeat reached
// (the step a failure came at: the ranks that wait for a dead one stay at its step; -1 when no
// rank began a step), and the ranks that received SIGTERM themselves.
struct GenerationTrace {
  int64_t step = -1;
  std::vector<int> sigterm_ranks;
  std::map<int, json> beats;  // each rank's last heartbeat, once it began a step
};

// Calls `use` with generation `generation`'s keys in the store at host:port, over a connection of
// its own whose requests time out in 2 s (a failure's or a stop's path: a store slow to answer
// must not hold it); false when the store cannot be reached or a request fails.
bool with_generation_store(const std::string& host, uint16_t port, const std::string& secret,
                           int generation, const std::function<void(PrefixStore&)>& use) {
  try {
    TcpStoreClient client(host, port, std::chrono::seconds(2), secret);
    PrefixStore store(generation_prefix(generation), client);
    use(store);
    return true;
  } catch (const std::exception&) {
    return false;
  }
}

// Fills `trace` as it reads (a request that fails leaves what was read before it): the ranks that
// received SIGTERM, then the heartbeats, a request each.
void read_trace(PrefixStore& store, int world, GenerationTrace& trace) {
  const auto sigterms = store.peek(rank_keys(sigterm_key, 0, world));
  for (int r = 0; r < world; ++r) {
    if (sigterms[static_cast<size_t>(r)]) trace.sigterm_ranks.push_back(r);
  }
  const auto beats = read_heartbeats(store, world);
  for (int r = 0; r < world; ++r) {
    const auto& beat = beats[static_cast<size_t>(r)];
    if (!beat || beat->value("phase", "") == "starting") continue;
    // A rank still starting (a resume's, before its checkpoint is loaded) says step 0, which is
    // not where the run is; its beat still tells where it waits.
    if (beat->value("stepping", true)) {
      trace.step = std::max(trace.step, beat->value("step", int64_t{-1}));
    }
    trace.beats[r] = *beat;
  }
}

// The trace, or an empty one (as far as it was read) when the store cannot be read.
GenerationTrace read_generation_trace(const std::string& addr, uint16_t port,
                                      const std::string& secret, int generation, int world) {
  GenerationTrace trace;
  with_generation_store(addr, port, secret, generation,
                        [&](PrefixStore& store) { read_trace(store, world, trace); });
  return trace;
}

}  // namespace

int smallest_world(const JobSpec& spec) {
  if (!spec.nodes.elastic()) return spec.world_size;
  if (spec.candidates.empty()) return spec.nodes.min;
  std::vector<int> slots;
  for (const auto& h : spec.candidates)
    slots.push_back(h.slots);
  std::sort(slots.begin(), slots.end());
  int least = 0;
  for (size_t i = 0; i < slots.size() && i < static_cast<size_t>(spec.nodes.min); ++i)
    least += slots[i];
  return least;
}

void check_smallest_world(const JobSpec& spec, const RecipeSource& origin) {
  const int least = smallest_world(spec);
  if (least >= spec.world_size) return;
  try {
    check_has_workers(spec.recipe, least);
  } catch (const Error& e) {
    throw Error(ErrorKind::recipe,
                fmt::format("{} (the elastic job may shrink to {} rank(s), its minimum: give a "
                            "minimum that leaves a worker)",
                            origin.place(e.what()), least));
  }
}

bool mark_peer_failed(const std::string& store, const std::string& secret, int generation) {
  try {
    const auto [host, port] = parse_host_port(store);
    return with_generation_store(host, port, secret, generation, [](PrefixStore& prefixed) {
      prefixed.set(peer_failed_key(), "1");
    });
  } catch (const std::exception&) {
    return false;
  }
}

std::map<std::string, std::string> forwarded_environment() {
  std::map<std::string, std::string> out;
  for (char** e = environ; *e != nullptr; ++e) {
    const std::string_view entry(*e);
    const auto eq = entry.find('=');
    if (eq != std::string_view::npos && forwarded(entry.substr(0, eq))) {
      out.emplace(std::string(entry.substr(0, eq)), std::string(entry.substr(eq + 1)));
    }
  }
  return out;
}

namespace {

// The ranks of `generation` found the newest checkpoint on their nodes (JobSpec::resume_from
// "newest") at `step`: the warning when that is older than the last one recorded (committed on
// another host), whose later steps are trained again; empty otherwise. Its host is not among this
// generation's (it did not answer, or a resume left it out), or its copy there was passed over.
std::string resumed_behind(const json& info, int64_t step, const std::vector<HostSpec>& hosts,
                           const JobSpec& spec, int generation) {
  const auto recorded = remote_last_checkpoint(info);
  if (!recorded || step < 0) return {};
  const int64_t last = info["last_checkpoint"].value("step", int64_t{-1});
  if (last <= step) return {};
  const bool placed = std::any_of(hosts.begin(), hosts.end(),
                                  [&](const HostSpec& h) { return names_host(recorded->host, h); });
  if (!placed && recorded->host == spec.left_out_holder_said) return {};
  return fmt::format(
      "the ranks of generation {} continue from step {}, older than the last recorded checkpoint "
      "(step {}, {} on {}){}: steps {} to {} are trained again",
      generation, step, last, recorded->path, recorded->host,
      placed ? ", whose copy there could not be used (damaged, removed or another recipe's)"
             : fmt::format(", as {} is not among this generation's hosts", recorded->host),
      step + 1, last);
}

// This machine's address towards `h`; a name that does not resolve (or no route) is the host's
// problem, as an SSH failure is: Error(ssh) naming it.
std::string address_towards(const HostSpec& h) {
  try {
    return local_address_towards(h.host, h.port);
  } catch (const Error& e) {
    throw Error(ErrorKind::ssh,
                fmt::format("{} (--hosts): {}; check the name", h.display(), e.what()));
  }
}

}  // namespace

std::string resolve_master_addr(const JobSpec& spec) {
  if (!spec.remote.master_addr.empty()) return spec.remote.master_addr;
  const auto hosts = job_hosts(spec);
  if (all_local(hosts)) return "127.0.0.1";
  // Any remote host shows the way out; the first that can, so that a bad spare holds up nothing.
  std::optional<Error> first;
  for (const auto& h : hosts) {
    if (h.is_local()) continue;
    try {
      return address_towards(h);
    } catch (const Error& e) {
      if (!first) first = e;
    }
  }
  throw *first;
}

void check_hosts_resolve(const JobSpec& spec) {
  // An elastic job, or one with spares, goes on without a host that does not answer.
  if (!spec.candidates.empty()) return;
  for (const auto& h : spec.hosts) {
    if (!h.is_local()) address_towards(h);
  }
}

void check_store_port(const JobSpec& spec) {
  const uint16_t port = spec.remote.master_port;
  if (port == 0) return;
  std::string addr;
  try {
    addr = resolve_master_addr(spec);
  } catch (const Error&) {
    return;  // the hosts' own checks say why
  }
  try {
    listen_tcp(addr, port);  // closed at once; the store listens there again when it starts
  } catch (const Error& e) {
    throw Error(ErrorKind::usage,
                fmt::format("--master-port {}: the store cannot listen there ({}); choose another "
                            "port, or leave --master-port out for a free one",
                            port, first_line(e.what())));
  }
}

namespace {

// DPTRAIN_FAULT as the ranks will read it: the job's --env, else the launcher's own.
std::vector<Fault> job_faults(const JobSpec& spec) {
  const auto given = spec.env.values.find("DPTRAIN_FAULT");
  const char* text =
      given != spec.env.values.end() ? given->second.c_str() : std::getenv("DPTRAIN_FAULT");
  return text == nullptr ? std::vector<Fault>{} : parse_faults(text);
}

}  // namespace

void check_fault_syntax(const JobSpec& spec) {
  static_cast<void>(job_faults(spec));
}

std::vector<std::string> check_fault_injection(const JobSpec& spec, int64_t first_step,
                                               int first_generation, bool one_generation) {
  // Rank 0 and the first rank of every further host write checkpoints.
  std::vector<int> writers;
  int rank = 0;
  for (const auto& h : job_hosts(spec)) {
    writers.push_back(rank);
    rank += h.slots;
  }
  return unreachable_faults(job_faults(spec), spec.recipe.train.steps, spec.world_size,
                            spec.recipe.checkpoint.every, writers, first_step, first_generation,
                            one_generation);
}

std::vector<std::string> check_benchmark_fault_injection(const JobSpec& spec, int64_t steps) {
  return unreachable_faults(job_faults(spec), steps, spec.world_size, kNoCheckpoints, {0}, 0, 1,
                            true);
}

void close_lost_generation(json& info, const std::string& recorder, const std::string& last_seen) {
  if (json& gens = info["generations"]; gens.is_array() && !gens.empty() &&
                                        gens.back().is_object() &&
                                        !gens.back().contains("ended_at")) {
    json& lost = gens.back();
    lost["status"] = "lost";
    const json alive = info.value("alive_at", json());
    const std::string stamp =
        alive.is_string() ? std::max(alive.get<std::string>(), last_seen) : last_seen;
    lost["ended_at"] = stamp.empty() ? json(nullptr) : json(stamp);
    lost["error"] = recorder +
                    " ended without recording how the generation ended (killed, or its machine "
                    "went down)";
  }
}

void record_job_settings(json& info, const JobSpec& spec, bool remote) {
  // How remote hosts were reached, for `dptrain resume` to default to: their run directories
  // are under this workdir, reached with these SSH files (--identity, --known-hosts, absolute).
  if (remote) {
    info["remote"] = {{"workdir", spec.remote.workdir},
                      {"remote_binary", spec.remote.remote_binary}};
    // Both always (none: [] and null, the default file): a record without them predates this.
    json identities = json::array();
    for (const auto& id : spec.remote.ssh.identities)
      identities.push_back(id.string());
    info["remote"]["identities"] = identities;
    info["remote"]["known_hosts"] = spec.remote.ssh.known_hosts.empty()
                                        ? json(nullptr)
                                        : json(spec.remote.ssh.known_hosts.string());
  }
  // What --env gave the ranks, for `dptrain resume` to give them again (a value taken from the
  // launcher's environment is null: it is taken from resume's then).
  info["env"] = spec.env.record();
  // The job's size as --nnodes (hosts) or an elastic --nproc (local ranks) gave it, for
  // `dptrain resume` to continue as it was launched; without either, an earlier invocation's is
  // dropped.
  if (spec.nodes.elastic() || !spec.candidates.empty()) {
    info["job_size"] = {{"min", spec.nodes.min},
                        {"max", spec.nodes.max},
                        {"of", spec.candidates.empty() ? "ranks" : "hosts"}};
  } else {
    info.erase("job_size");
  }
}

namespace {
constexpr std::array<const char*, 7> kPlacementKeys = {"hosts",    "job_hosts",  "remote", "env",
                                                       "job_size", "world_size", "backend"};
}  // namespace

json placement_of(const json& info) {
  if (!info.contains("hosts")) return nullptr;
  json placement = json::object();
  for (const char* key : kPlacementKeys) {
    if (info.contains(key)) placement[key] = info[key];
  }
  return placement;
}

void restore_placement(json& info, const json& placement) {
  if (!placement.is_object()) return;
  for (const char* key : kPlacementKeys) {
    if (placement.contains(key)) {
      info[key] = placement[key];
    } else {
      info.erase(key);
    }
  }
}

JobPlan plan_job(const JobSpec& spec, const fs::path& run_path, const std::string& remote_name,
                 int generation, const std::string& store_addr, uint16_t store_port,
                 const std::string& secret) {
  JobPlan plan;
  plan.store = format_host_port(store_addr, store_port);  // [v6]:port for an IPv6 address
  plan.secret = secret;
  plan.hosts = job_hosts(spec);
  int next_rank = 0;
  const int world = total_slots(plan.hosts);
  // The launcher's CSV file, hashed once, for remote hosts to check their copy against.
  std::optional<std::string> data_sha256;
  const auto launcher_data_sha256 = [&]() -> std::string {
    if (!data_sha256) {
      std::error_code ec;
      const bool csv = spec.worker_args.empty() && spec.recipe.data.type == "csv" &&
                       fs::is_regular_file(spec.recipe.data.path, ec);
      data_sha256 = csv ? sha256_file(spec.recipe.data.path) : std::string();
    }
    return *data_sha256;
  };
  // The launcher's token dataset, from its headers, for remote hosts to check theirs against;
  // none when the launcher cannot read it (it may exist on the hosts only).
  std::optional<std::string> data_fingerprint;
  const auto launcher_data_fingerprint = [&]() -> std::string {
    if (!data_fingerprint) {
      data_fingerprint.emplace();
      if (spec.worker_args.empty() && spec.recipe.data.type == "tokens") {
        try {
          *data_fingerprint = token_data_fingerprint(spec.recipe.data);
        } catch (const Error&) {
        }
      }
    }
    return *data_fingerprint;
  };
  for (const auto& h : plan.hosts) {
    AgentPlan a;
    a.host = h.is_local() ? "localhost" : h.host;
    a.display = h.is_local() ? "localhost" : h.display();
    a.run_dir = h.is_local() ? run_path : fs::path(spec.remote.workdir) / "runs" / remote_name;
    a.recipe = to_json(spec.recipe);
    a.store = plan.store;
    a.secret = secret;
    a.generation = generation;
    a.world_size = world;
    a.nominal_world = spec.nominal_world;
    a.backend = resolve_backend(spec.backend);
    a.one_gpu_per_rank = spec.one_gpu_per_rank || spec.recipe.train.device == "cuda";
    a.resume_from = spec.resume_from.string();
    for (int i = 0; i < h.slots; ++i)
      a.ranks.push_back(next_rank++);
    a.env = spec.env.values;
    a.worker_args = spec.worker_args;
    a.benchmark = spec.benchmark;
    if (!h.is_local()) {
      // Local ranks inherit the launcher's environment; remote ones get these passed on.
      a.env.merge(forwarded_environment());
    }
    if (!h.is_local()) {
      a.data_dir = spec.remote.workdir + "/data";
      a.data_sha256 = launcher_data_sha256();
      a.data_fingerprint = launcher_data_fingerprint();
    }
    plan.agents.push_back(std::move(a));
  }
  return plan;
}

json JobPlan::to_json(const JobSpec& spec) const {
  json hosts_json = json::array();
  for (size_t i = 0; i < hosts.size(); ++i) {
    const HostSpec& h = hosts[i];
    const AgentPlan& a = agents[i];
    json workers = json::array();
    for (const auto& w :
         worker_specs(a, h.is_local() ? spec.worker_binary : fs::path(remote_binary(spec)))) {
      workers.push_back({{"rank", w.rank},
                         {"local_rank", workers.size()},
                         {"command", w.argv},
                         {"env", redacted_env(w.env, spec.env)}});
    }
    json host = {{"host", h.display()},
                 {"slots", h.slots},
                 {"ranks", a.ranks},
                 {"run_dir", a.run_dir.string()},
                 {"workers", workers}};
    if (h.is_local()) {
      host["via"] = "local";
    } else {
      host["via"] = "ssh";
      // As an OpenSSH client would reach it with the launcher's options: the key files it names
      // (the hostfile's key=, then each --identity), --known-hosts, how an unknown host key is
      // taken, never a prompt, and the remote command the launcher sends, word for word.
      json command = {"ssh", "-p", std::to_string(h.port)};
      for (const auto& [file, named] : identity_files(h, spec.remote.ssh)) {
        if (named) command.insert(command.end(), {"-i", file.string()});
      }
      if (!spec.remote.ssh.known_hosts.empty()) {
        command.insert(command.end(),
                       {"-o", "UserKnownHostsFile=" + spec.remote.ssh.known_hosts.string()});
      }
      command.insert(command.end(),
                     {"-o",
                      std::string("StrictHostKeyChecking=") +
                          (spec.remote.ssh.accept_new_host_keys ? "accept-new" : "yes"),
                      "-o", "BatchMode=yes"});
      command.push_back(h.user.empty() ? h.host : h.user + "@" + h.host);
      command.push_back(remote_path_word(remote_binary(spec)) + " agent");
      host["command"] = command;
    }
    hosts_json.push_back(host);
  }
  return {{"store", store}, {"world_size", total_slots(hosts)}, {"hosts", hosts_json}};
}

int local_rank_count(const JobSpec& spec) {
  if (spec.hosts.empty()) return spec.world_size;
  int local = 0;
  for (const HostSpec& h : spec.hosts)
    local += h.is_local() ? h.slots : 0;
  return local;
}

void check_open_files(const JobSpec& spec) {
  // Each local rank's output pipe and log file, each remote host's relay, and every rank's two
  // connections to the store (requests, heartbeats), with room for the launcher's own. At least
  // what a Gloo rank of the job needs itself (world - 1 connections + 32, as the worker checks), so
  // that a launch is refused here rather than by its ranks.
  const auto local_ranks = static_cast<size_t>(local_rank_count(spec));
  size_t relays = 0;
  for (const HostSpec& h : spec.hosts)
    relays += h.is_local() ? 0 : 1;
  const auto world = static_cast<size_t>(spec.world_size);
  require_open_files(2 * local_ranks + 2 * relays + 2 * world + 32,
                     local_ranks == world
                         ? fmt::format("{} rank(s) on this machine", local_ranks)
                         : fmt::format("{} rank(s) ({} on this machine)", world, local_ranks));
}

JobOutcome run_job(RunDirectory& run, const JobSpec& spec, StatusPrinter& status) {
  json& info = run.info();
  const int generation = static_cast<int>(info["generations"].size()) + 1;
  const std::string addr = resolve_master_addr(spec);
  const std::string secret = generate_job_secret();
  check_open_files(spec);  // a generation of another size (an elastic job's) is checked again
  TcpStoreServer store(addr, spec.remote.master_port, secret);
  const JobPlan plan =
      plan_job(spec, run.path(), run.remote_name(), generation, addr, store.port(), secret);
  const bool multi_host = plan.hosts.size() > 1 || !plan.hosts.front().is_local();
  const bool rank0_remote = !plan.hosts.front().is_local();
  // "rank 3", or "rank 3 on HOST" when the job spans hosts: how messages name a rank.
  const HangWatch::RankName rank_name = [&plan, multi_host](int rank) {
    if (multi_host) {
      for (size_t i = 0; i < plan.hosts.size(); ++i) {
        const auto& ranks = plan.agents[i].ranks;
        if (std::find(ranks.begin(), ranks.end(), rank) != ranks.end()) {
          return fmt::format("rank {} on {}", rank, plan.hosts[i].display());
        }
      }
    }
    return fmt::format("rank {}", rank);
  };
  // A benchmark's ranks run their own command: there is no recipe to record.
  const bool trains = spec.worker_args.empty();

  std::vector<ProcessSpec> procs;
  // A remote host's relay process, by its label: the host, its ranks, and its lines' tag.
  struct Relay {
    HostSpec host;
    std::vector<int> ranks;
    std::string tag;  // host_tag
  };
  std::map<std::string, Relay> relays;
  std::vector<int> local_ranks;
  for (size_t i = 0; i < plan.hosts.size(); ++i) {
    const HostSpec& h = plan.hosts[i];
    if (h.is_local()) {
      for (auto& w : worker_specs(plan.agents[i], spec.worker_binary)) {
        if (multi_host) w.label = fmt::format("rank {} on localhost", w.rank);
        local_ranks.push_back(w.rank);
        procs.push_back(std::move(w));
      }
    } else {
      ProcessSpec p = relay_spec(spec, relay_plan(spec, h, plan.agents[i]), run.logs());
      relays[p.label] = {h, plan.agents[i].ranks, host_tag(spec, h)};
      procs.push_back(std::move(p));
    }
  }
  const int world = plan.agents.front().world_size;
  // How the job was placed and reached before this generation (a resume's or a restart's): put
  // back if it failed or was stopped before its ranks joined.
  const json placed_before = placement_of(info);
  bool ranks_joined = false;
  if (trains) info["recipe"] = to_json(spec.recipe);
  info["world_size"] = world;
  info["nominal_world_size"] = spec.nominal_world > 0 ? spec.nominal_world : world;
  info["backend"] = plan.agents.front().backend;
  info["store"] = plan.store;
  json hosts_json = json::array();
  for (size_t i = 0; i < plan.hosts.size(); ++i) {
    hosts_json.push_back({{"host", plan.hosts[i].display()},
                          {"slots", plan.hosts[i].slots},
                          {"ranks", plan.agents[i].ranks},
                          {"run_dir", plan.agents[i].run_dir.string()}});
    // The hostfile's key= (a path, not the key): a resume's hint gives the host back with it.
    if (!plan.hosts[i].key.empty()) hosts_json.back()["key"] = plan.hosts[i].key;
  }
  info["hosts"] = hosts_json;
  record_job_settings(info, spec, multi_host);
  close_lost_generation(info, "its launcher", utc_timestamp_of(run.path() / "metrics.jsonl"));
  info.erase("placing");  // the hosts are placed
  info["status"] = "running";
  info.erase("error");  // an earlier invocation's end, between generations
  // Who runs the job, and a stamp renewed while it does: how `dptrain status` on another machine
  // (a shared filesystem) tells a running job from one whose launcher is gone.
  info["launcher"] = {{"host", this_host()}, {"pid", ::getpid()}};
  info["alive_at"] = utc_timestamp();
  json gen = {{"generation", generation},
              {"started_at", utc_timestamp()},
              {"world_size", world},
              {"hosts", json::array()}};
  for (const auto& h : plan.hosts)
    gen["hosts"].push_back(h.display());
  // Where this generation continues from: a checkpoint's name, "step 0" (none on this machine,
  // which holds rank 0's), or null (not resumed, or the ranks find the newest on their nodes:
  // rendezvous_done says which, and run.json is updated then).
  json resumed_from = nullptr;
  if (spec.resume_from == "newest-or-start") {
    if (!rank0_remote) resumed_from = "step 0";
  } else if (!spec.resume_from.empty() && spec.resume_from != "newest") {
    resumed_from = spec.resume_from.filename().string();
  }
  if (!resumed_from.is_null()) gen["resumed_from"] = resumed_from;
  info["generations"].push_back(gen);
  // A restart that was pending is this generation, or was cut short (a launcher killed in its
  // back-off) and is not coming.
  info.erase("pending_restart");
  // The run's first run.json must be written before any rank starts (without it there is no
  // run: record_launcher_failure then leaves the directory as a launch takes it again); later
  // generations' are records of a job that goes on, as every write while it runs.
  const bool first_record = !run.has_record();
  if (first_record) {
    run.save();
  } else {
    run.record();
  }
  // After run.json: a launch killed before it leaves no recipe.json, which would make the
  // directory the user's (not a failed start's) to the next launch. One that cannot be written (a
  // full disk) fails the start: the first run.json goes too, so that the directory takes a
  // launch again (record_launcher_failure).
  if (trains) {
    try {
      write_file_atomic(run.path() / "recipe.json", json_text(to_json(spec.recipe), 2) + "\n");
    } catch (const Error&) {
      std::error_code ec;
      if (first_record) fs::remove(run.path() / "run.json", ec);
      throw;
    }
  }

  EventLog no_events;
  EventLog& events = spec.events ? *spec.events : no_events;
  events.emit("generation_started", {{"generation", generation},
                                     {"world_size", world},
                                     {"hosts", gen["hosts"]},
                                     {"resumed_from", resumed_from}});
  json result;
  // Relay label -> its agent's "@failure" report (by label: two hosts may share a name, on two
  // ports).
  std::map<std::string, json> agent_failures;
  bool event_write_failed = false;  // said once: the job goes on
  RemoteRankLogs remote_logs(run.logs());
  int64_t last_step = -1;
  // The step this generation started from: the resumed checkpoint's, or 0.
  int64_t start_step = -1;
  // Where the ranks said they began (their rendezvous): the step and checkpoint's name.
  int64_t met_at_step = -1;
  json met_from;
  if (spec.resume_from.empty()) {
    start_step = 0;  // a new run
  } else if (spec.resume_from != "newest-or-start" && spec.resume_from != "newest") {
    start_step = checkpoint_step(spec.resume_from);
  } else if (info.value("last_checkpoint", json()).is_object()) {
    // The ranks find it on their nodes; until they say (the rendezvous), the newest one recorded.
    start_step = info["last_checkpoint"].value("step", start_step);
  } else if (spec.resume_from == "newest-or-start") {
    start_step = 0;
  }
  const auto handle_event = [&](const json& event) {
    const std::string kind = event.value("event", "");
    if (spec.on_event) spec.on_event(event);
    if (kind == "progress") last_step = event.value("step", int64_t{-1});
    if (kind == "rendezvous") {
      start_step = event.value("step", start_step);
      ranks_joined = true;
      met_at_step = start_step;
      met_from = event.value("resumed_from", json(nullptr));
    }
    if (kind == "rendezvous" || kind == "checkpoint") {
      json fields = event;
      fields.erase("event");
      events.emit(kind == "checkpoint" ? "checkpoint_committed" : "rendezvous_done", fields);
    }
    if (kind == "checkpoint") {
      // Where rank 0 wrote it: for a rank 0 on another host, the only record of it here.
      const fs::path path = event.value("path", std::string());
      const HostSpec& rank0 = plan.hosts.front();
      info["last_checkpoint"] = {{"name", path.filename().string()},
                                 {"step", event.value("step", int64_t{-1})},
                                 {"host", rank0.is_local() ? json(nullptr) : json(rank0.display())},
                                 {"path", path.string()}};
      run.record();
    }
    if (kind == "rendezvous") {
      if (spec.resume_from == "newest") {
        const std::string behind =
            resumed_behind(info, event.value("step", int64_t{-1}), plan.hosts, spec, generation);
        if (!behind.empty()) status.warning(behind);
      }
      // When the ranks met: until then a status shows the generation before's step (dptrain
      // status: generation_starting).
      info["generations"].back()["met_at"] = utc_timestamp();
      // The backend the ranks settled on: "auto" (run.json's "backend", kept for a resume) is
      // nccl or gloo by the hosts of each generation.
      if (event.contains("backend")) info["generations"].back()["backend"] = event["backend"];
      // Where the ranks found their checkpoint (it may be on another node).
      if (event.contains("resumed_from")) {
        info["generations"].back()["resumed_from"] = event["resumed_from"];
      } else if (!spec.resume_from.empty()) {
        info["generations"].back()["resumed_from"] = "step 0";  // no checkpoint on any node
      }
      run.record();
      // Rank 0 keeps its own metrics in order; a remote rank 0's are mirrored here.
      if (rank0_remote) {
        truncate_metrics_after(run.path() / "metrics.jsonl", event.value("step", int64_t{0}));
      }
      // "all N ranks met; starting at step S", as hand-started workers say; the printer starts
      // the generation's progress afresh (no loss carried over a restart).
      status.event(event);
      return;
    }
    if (kind == "result") {
      result = event;
      result.erase("event");
      write_file_atomic(run.path() / "result.json", json_text(result, 2) + "\n");
      return;
    }
    if (rank0_remote && (kind == "progress" || kind == "eval")) {
      json line = event;
      for (const char* k : {"event", "steps", "eta_s"})
        line.erase(k);
      append_line(run.path() / "metrics.jsonl", json_text(line));
    }
    status.event(event);
  };
  SupervisorOptions options;
  // Tests: a shorter grace for the ranks' checkpoint after a SIGTERM, so that the path where it
  // runs out is tested without waiting the minute it gives.
  // Whole milliseconds from 1 on; anything else is left out (the minute stands).
  if (const char* grace = std::getenv("DPTRAIN_TEST_STOP_GRACE_MS")) {
    char* end = nullptr;
    errno = 0;
    const long ms = std::strtol(grace, &end, 10);
    if (end != grace && *end == '\0' && errno == 0 && ms >= 1)
      options.stop_grace = std::chrono::milliseconds(ms);
  }
  for (size_t i = 0; i < plan.hosts.size(); ++i) {
    if (plan.hosts[i].is_local()) continue;
    for (int rank : plan.agents[i].ranks)
      remote_logs.open(plan.hosts[i].host, rank);
  }
  std::unique_ptr<TcpStoreClient> watch_client;
  std::unique_ptr<PrefixStore> watch_store;
  std::unique_ptr<HangWatch> hang_watch;  // made below, told of ranks as they start
  bool hang_found = false;                // its verdict came: the ranks are being killed
  RepeatedRankLines repeated;             // a stop's or failure's lines alike from many ranks
  options.on_line = [&](const ProcessSpec& p, const std::string& line) {
    const auto relay = relays.find(p.label);
    if (line.rfind("@event ", 0) == 0) {
      // Only rank 0 sends events: kept in its log as a local rank 0's are, as the launcher
      // shows them.
      const json event = json::parse(line.substr(7), nullptr, false);
      if (event.is_discarded()) return;
      if (relay != relays.end() && event.is_object() && event.contains("event") &&
          !terminal_only(event)) {
        remote_logs.append(relay->second.host.host, 0, format_event(event));
      }
      try {
        handle_event(event);
      } catch (const Error& e) {
        // A file of the run that cannot be written here (a full disk: metrics.jsonl, result.json
        // of a remote rank 0) must not bring the job down with it: its ranks train on.
        if (!event_write_failed)
          status.warning(first_line(e.what()) + "; the job goes on without it");
        event_write_failed = true;
      }
      return;
    }
    // Once the launcher was stopped (Ctrl-C stops the ranks at once, host by host), or killed
    // them for a hang, a rank whose peer went first fails its collective: said in its log, not on
    // the terminal.
    const bool after_stop =
        (pending_stop_signal() != 0 || hang_found) && line.find(kPeerGoneNote) != std::string::npos;
    if (relay == relays.end()) {
      if (after_stop || !repeated.show(line)) return;  // the rank's log has it
      const std::string who =
          multi_host ? fmt::format("localhost:{}", p.rank) : fmt::format("rank {}", p.rank);
      return status.line(fmt::format("[{}] {}", who, line));
    }
    const std::string& host = relay->second.host.host;
    if (line == kAgentStartedLine) {
      if (hang_watch) hang_watch->started(relay->second.ranks);
      return;
    }
    if (line.rfind(kAgentFailurePrefix, 0) == 0) {
      const json report =
          json::parse(line.substr(std::string(kAgentFailurePrefix).size()), nullptr, false);
      if (!report.is_discarded() && !agent_failures.count(p.label)) {
        agent_failures[p.label] = report;
      }
      return;
    }
    if (line.rfind(kAgentRankPrefix, 0) == 0) {
      const std::string rest = line.substr(std::string(kAgentRankPrefix).size());
      const auto space = rest.find(' ');
      const std::string rank = rest.substr(0, space);
      const std::string text = space == std::string::npos ? "" : rest.substr(space + 1);
      remote_logs.append(host, std::atoi(rank.c_str()), text);
      if (after_stop || !repeated.show(text)) return;
      return status.line(fmt::format("[{}:{}] {}", relays.at(p.label).tag, rank, text));
    }
    // The relay's own warning (a host that fell silent once its ranks were done): the job's.
    if (!status.warning_if_one(line))
      status.line(fmt::format("[{}] {}", relays.at(p.label).tag, line));
  };
  options.on_started = [&](const std::vector<pid_t>& pids) {
    info["generations"].back()["pids"] = pids;
    run.record();
    if (hang_watch) hang_watch->started(local_ranks);
  };
  // Without --hang-timeout the watch only listens: a rank that froze is then named when a peer's
  // collective times out waiting for it. One rank alone beats too: with --hang-timeout, nothing
  // else would ever end its hang.
  {
    watch_client =
        std::make_unique<TcpStoreClient>(addr, store.port(), std::chrono::seconds(10), secret);
    watch_store = std::make_unique<PrefixStore>(generation_prefix(generation), *watch_client);
    hang_watch = std::make_unique<HangWatch>(*watch_store, world, spec.hang_timeout, rank_name);
    options.watchdog = [&]() -> std::optional<std::string> {
      auto verdict = hang_watch->check();
      if (verdict) {
        hang_found = true;
        status.line("dptrain: " + *verdict + "; stopping every rank");
        events.emit("hang_detected", {{"message", *verdict}});
      }
      return verdict;
    };
  }
  // An elastic job below its maximum size takes back hosts that answer again: every rank
  // checkpoints at the next step boundary and stops, and the next generation has them.
  std::unique_ptr<HostWatch> host_watch;
  if (trains && spec.nodes.elastic() && !spec.candidates.empty() &&
      static_cast<int>(plan.hosts.size()) < spec.nodes.max) {
    std::vector<HostSpec> missing;
    for (const auto& c : spec.candidates) {
      const bool used = std::any_of(plan.hosts.begin(), plan.hosts.end(),
                                    [&](const HostSpec& h) { return h.display() == c.display(); });
      if (!used) missing.push_back(c);
    }
    host_watch = std::make_unique<HostWatch>(missing, ssh_probe(spec.remote.ssh),
                                             rejoin_probe_interval(spec.rejoin_timeout));
    options.stop_request = [&]() -> std::optional<std::string> {
      const std::vector<HostSpec> back = host_watch->answered();
      if (back.empty()) return std::nullopt;
      json names = json::array();
      std::string list;
      for (const auto& h : back) {
        names.push_back(h.display());
        list += (list.empty() ? "" : ", ") + h.display();
      }
      const std::string message = fmt::format(
          "{} answer{} again: every rank checkpoints at the next step, then the job continues "
          "on up to {} host(s)",
          list, back.size() == 1 ? "s" : "", spec.nodes.max);
      status.line("dptrain: " + message);
      events.emit("host_rejoined", {{"generation", generation}, {"hosts", names}});
      return message;
    };
  }
  auto stamped = std::chrono::steady_clock::now();
  // The ranks' heartbeats as the first rank failed: a straggler that wakes up within the stop's
  // grace would read afterwards as one more rank waiting in the collective.
  std::optional<GenerationTrace> at_failure;
  options.on_first_failure = [&] {
    // One connection: the failure is marked for the ranks' stop checks, then their beats read.
    with_generation_store(addr, store.port(), secret, generation, [&](PrefixStore& prefixed) {
      try {
        prefixed.set(peer_failed_key(), "1");
      } catch (const std::exception&) {  // the beats may still be read
      }
      read_trace(prefixed, world, at_failure.emplace());
    });
  };
  options.tick = [&] {
    const auto now = std::chrono::steady_clock::now();
    if (now - stamped < std::chrono::seconds(kAliveEveryS)) return;
    stamped = now;
    info["alive_at"] = utc_timestamp();
    run.record();
  };
  const SupervisionResult sup = supervise(procs, options);
  host_watch.reset();
  for (const auto& more : repeated.summary())
    status.line("dptrain: " + more);
  status.finish();

  JobOutcome out;
  out.last_step = last_step;
  out.start_step = std::max<int64_t>(start_step, 0);
  out.began_at_step = met_at_step;
  out.resumed_from = met_from;
  out.world_size = world;
  GenerationTrace trace;
  int64_t measured = -1;  // a benchmark's: the measurement its ranks reached (dptrain-bench(1))
  if (sup.failure || !sup.watchdog.empty() || sup.stop_signal != 0) {
    trace = read_generation_trace(addr, store.port(), secret, generation, world);
    if (sup.failure && at_failure && at_failure->beats.size() >= 2) {
      trace.beats = at_failure->beats;
      trace.step = at_failure->step;
    }
    if (hang_watch) {
      for (const auto& [rank, ms] : hang_watch->silent()) {
        if (trace.beats.count(rank)) trace.beats[rank]["silent_ms"] = ms;
      }
    }
    // A benchmark's steps are its measurements: the heartbeats name who is behind, but there is
    // no training step to report or resume from.
    if (trains) {
      out.failed_step = std::max(last_step, trace.step);
    } else {
      measured = trace.step;
      trace.step = -1;
    }
  }
  // Whether every process took its own SIGTERM path (a checkpoint of its last step, exit 143);
  // one that finished the run first exited 0.
  const auto all_checkpointed = [&] {
    bool any = false;
    for (const auto& e : sup.exits) {
      if (e.exit_code == 143) {
        any = true;
      } else if (e.exit_code != 0) {
        return false;
      }
    }
    return any;
  };
  // A benchmark keeps no checkpoint, so a stop names none: its ranks stop, or do not. One killed
  // by the SIGTERM it was sent (a collective benchmark's ranks take its default action) stopped
  // as asked.
  const bool benchmark = !trains || spec.benchmark;
  const auto stopped_as_asked = [&](const ProcessExit& e) {
    return e.exit_code == 143 || e.exit_code == 0 || (benchmark && e.signal == SIGTERM);
  };
  // For a relay's failure: the report its agent sent ("@failure": the rank, its exit, its last
  // lines), or null when none came (the relay itself failed, or the connection dropped).
  const auto report_of = [&](const std::string& label) -> const json* {
    const auto report = agent_failures.find(label);
    return report == agent_failures.end() ? nullptr : &report->second;
  };
  // The rank a host's relay stands for in a stop: the one its agent reported (its exit, on that
  // host), or null for a local rank, or a relay with no report of a rank.
  const auto reported_rank = [&](const ProcessExit& e) -> const json* {
    const json* r = report_of(e.label);
    return r != nullptr && r->value("rank", -1) >= 0 && relays.contains(e.label) ? r : nullptr;
  };
  // A process's exit as a stop's error names it: a host's relay by the rank its agent reported,
  // not by the relay's own exit code.
  const auto exit_text = [&](const ProcessExit& e) {
    const json* r = reported_rank(e);
    if (r == nullptr) return e.describe();
    return fmt::format("{} on host {}", r->value("description", e.describe()),
                       relays.at(e.label).host.display());
  };
  // Its exit as the cause: a relay's (not itself killed) that of the rank its agent reported.
  const auto rank_exit = [&](const ProcessExit& e) {
    ProcessExit rank = e;
    if (const json* r = reported_rank(e); r != nullptr && e.signal == 0) {
      rank.exit_code = r->value("exit_code", e.exit_code);
      rank.signal = r->value("signal", 0);
    }
    return rank;
  };
  const auto not_checkpointed = [&] {
    std::string list;
    for (const auto& e : sup.exits) {
      if (!stopped_as_asked(e)) list += (list.empty() ? "" : ", ") + exit_text(e);
    }
    // Killed by this launcher, not by the OOM killer or another's hand.
    if (!sup.killed_why.empty()) list += " (the launcher's SIGKILL: " + sup.killed_why + ")";
    return list;
  };
  const auto agent_report = [&](const ProcessFailure& f) { return report_of(f.label); };
  // A host lost by its relay (the SSH connection dropped, or the host went silent; not refused):
  // its agent then stops its ranks with SIGTERM, and the others checkpoint and stop with them,
  // which would look like a preemption. The relay's exit, when one reported so.
  const auto lost_host = [&]() -> std::optional<ProcessExit> {
    for (const auto& e : sup.exits) {
      const json* r = report_of(e.label);
      if (r != nullptr && r->value("rank", -1) < 0 && !r->value("refused", false)) return e;
    }
    return std::nullopt;
  };
  // Only where the first exit looks like a preemption: a relay that failed first says itself.
  const std::optional<ProcessExit> lost =
      sup.stop_signal == 0 && sup.failure && sup.failure->exit_code == 143 ? lost_host()
                                                                           : std::nullopt;
  std::optional<std::string> newest;
  std::string unreachable;
  if (trains && !rank0_remote && !sup.ok())
    newest = newest_valid_checkpoint(run, spec.recipe, unreachable);
  if (newest) out.last_checkpoint = *newest;
  const auto checkpoint_note = [&]() -> std::string {
    if (benchmark) return "";
    if (rank0_remote) {
      const json& recorded = info.value("last_checkpoint", json());
      return recorded.is_object()
                 ? fmt::format("; the newest checkpoint recorded is {} on {}",
                               recorded.value("name", std::string()),
                               recorded.value("host", std::string()))
                 : std::string("; no checkpoint was recorded: a resume starts from step 0");
    }
    if (!unreachable.empty()) return "; " + unreachable;
    return newest
               ? fmt::format("; the newest checkpoint is {}: a resume continues from it", *newest)
               : std::string("; no checkpoint exists: a resume starts from step 0");
  };
  const auto checkpointed_note = [&]() -> std::string {
    // Stopped while meeting (no heartbeat past "starting", no step logged), or after meeting but
    // before any rank finished a step of this generation (a rank still loading its data, the
    // others waiting for it at the step they started from): nothing was trained here, so
    // nothing was checkpointed (a resumed run's newest is the one it started from).
    const int64_t reached = std::max(trace.step, last_step);
    if (reached < 0 || (start_step >= 0 && reached <= start_step)) {
      return "every rank stopped before its first step (nothing to checkpoint)" + checkpoint_note();
    }
    if (spec.benchmark) return "every rank stopped at the end of its step";
    return newest ? fmt::format("every rank checkpointed its last step ({}) and stopped", *newest)
                  : std::string("every rank checkpointed its last step and stopped");
  };
  // A SIGTERM during the last step: the ranks agree on the stop after it, when nothing is left to
  // stop, and finish the run (exit 0, a result): that is a completed run. So is one a SIGINT
  // reached after rank 0 reported the result (its last act): only the ranks' exits were cut
  // short, and a resume would have nothing to train.
  const bool finished_first = (sup.stop_signal == SIGTERM || sup.stop_signal == SIGINT) &&
                              !sup.failure && sup.watchdog.empty() && !result.is_null() &&
                              std::none_of(sup.exits.begin(), sup.exits.end(),
                                           [](const ProcessExit& e) { return e.exit_code == 143; });
  // A host whose relay failed (not refused: the connection lost, the host silent) after rank 0
  // reported the result.
  const bool host_lost_after_result =
      !result.is_null() && sup.failure && sup.stop_signal == 0 && sup.watchdog.empty() && [&] {
        const json* r = report_of(sup.failure->label);
        return r != nullptr && r->value("rank", -1) < 0 && !r->value("refused", false);
      }();
  // The event for a process that exited on its own account: its exit code, or the signal.
  const auto rank_exited = [&events](const std::string& process, int exit_code, int signal,
                                     const std::string& message) {
    events.emit("rank_exited",
                {{"process", process},
                 {"exit_code", exit_code >= 0 && signal == 0 ? json(exit_code) : json(nullptr)},
                 {"signal", signal != 0 ? json(signal) : json(nullptr)},
                 {"message", message}});
  };
  std::optional<ProcessExit> early_exit;  // a rank that exited 0 before the end: the cause
  if (sup.stop_signal == SIGTERM && !sup.failure && !finished_first) {
    out.exit_code = 143;
    out.status = "terminated";
    if (!sup.watchdog.empty()) {
      out.error =
          benchmark ? fmt::format("stopped by SIGTERM, but {}; every rank was killed", sup.watchdog)
                    : fmt::format(
                          "stopped by SIGTERM, but {}; every rank was killed (a "
                          "hung rank cannot checkpoint){}",
                          sup.watchdog, checkpoint_note());
    } else if (benchmark ? not_checkpointed().empty() : all_checkpointed()) {
      out.error = benchmark ? std::string("stopped by SIGTERM; every rank was stopped")
                            : "stopped by SIGTERM; " + checkpointed_note();
    } else {
      out.error = benchmark
                      ? fmt::format(
                            "stopped by SIGTERM, but not every rank stopped as "
                            "asked: {}",
                            not_checkpointed())
                      : fmt::format("stopped by SIGTERM, but not every rank checkpointed: {}{}",
                                    not_checkpointed(), checkpoint_note());
      // A rank that could not stop as asked (hung, with no --hang-timeout to name it): the
      // ranks' last heartbeats say which, when the others wait for it in a collective. Not where
      // a rank was killed by a signal of its own (not the launcher's): that is what happened,
      // and its last heartbeat is only where it was when it died.
      // (A remote one as its agent reported it.)
      // Nor where a rank failed of itself (its exit code: a checkpoint it could not write, say):
      // its error is the cause, and the others' heartbeats only show them waiting for it.
      const bool killed_on_its_own =
          sup.killed_why.empty() &&
          (std::any_of(
               sup.exits.begin(), sup.exits.end(),
               [&](const ProcessExit& e) { return e.signal != 0 && !stopped_as_asked(e); }) ||
           std::any_of(agent_failures.begin(), agent_failures.end(),
                       [](const auto& f) { return f.second.value("signal", 0) != 0; }));
      // (Not where the launcher had to kill the ranks, a hang's mark.)
      const bool failed_of_itself =
          sup.killed_why.empty() &&
          std::any_of(sup.exits.begin(), sup.exits.end(),
                      [&](const ProcessExit& e) { return rank_exit(e).failed_of_itself(); });
      if (trace.beats.size() >= 2 && !killed_on_its_own && !failed_of_itself) {
        std::string where = HangWatch::positions(trace.beats, rank_name);
        if (where.find("; waiting for it in collective") != std::string::npos ||
            where.find("; waiting for them in collective") != std::string::npos) {
          // Killed at once as asked (Ctrl-C after the SIGTERM), a rank behind may only have been
          // busy (writing its checkpoint): where each was, not a verdict that it was stuck.
          if (sup.killed_at_once && where.starts_with("stuck: ")) {
            out.error +=
                "; when they were killed, by the ranks' last heartbeats (behind, not "
                "necessarily stuck): " +
                where.substr(7);
          } else {
            out.error += "; by the ranks' last heartbeats, " + where;
          }
        }
      }
      // Each rank that did not stop as asked exited on its own account: an event each.
      for (const auto& e : sup.exits) {
        if (!stopped_as_asked(e)) rank_exited(e.label, e.exit_code, e.signal, e.describe());
      }
    }
  } else if (sup.stop_signal == SIGINT && !finished_first) {
    out.exit_code = 130;
    out.status = "interrupted";
    out.error = "stopped by SIGINT; every rank was stopped" + checkpoint_note();
  } else if (!sup.watchdog.empty()) {
    out.exit_code = 3;
    out.status = "failed";
    out.error = sup.watchdog;
  } else if (host_lost_after_result) {
    // Rank 0 reported the result (its last act, after every rank took the last step) before a
    // host stopped answering: the run is complete, and a resume would have nothing to train.
    out.status = "completed";
    out.result = result;
    status.warning(
        fmt::format("{} (after rank 0 reported the result: the run is complete)",
                    report_of(sup.failure->label)->value("description", sup.failure->describe())));
  } else if (lost) {
    // Not a preemption but a lost host, which a restart may cure (the host answers again, or an
    // elastic job goes on without it).
    out.exit_code = 3;
    out.status = "failed";
    out.error = report_of(lost->label)->value("description", std::string()) + checkpoint_note();
  } else if (sup.failure && sup.failure->exit_code == 143) {
    // A rank got SIGTERM itself (a node being preempted): every rank checkpoints and stops. The
    // first process to exit is any of them; the store says which got the signal.
    std::string who;
    for (int r : trace.sigterm_ranks)
      who += (who.empty() ? "" : ", ") + rank_name(r);
    if (who.empty()) who = sup.failure->label;
    const char* was = trace.sigterm_ranks.size() > 1 ? "were" : "was";
    out.exit_code = 143;
    out.status = "terminated";
    out.error =
        benchmark ? (not_checkpointed().empty()
                         ? fmt::format("{} {} stopped by SIGTERM; every rank was stopped", who, was)
                         : fmt::format("{} {} stopped by SIGTERM, but not every rank stopped "
                                       "as asked: {}",
                                       who, was, not_checkpointed()))
        : all_checkpointed()
            ? fmt::format("{} {} stopped by SIGTERM; {}", who, was, checkpointed_note())
            : fmt::format("{} {} stopped by SIGTERM, but not every rank checkpointed: {}{}", who,
                          was, not_checkpointed(), checkpoint_note());
  } else if (sup.failure) {
    const ProcessFailure& f = *sup.failure;
    out.exit_code = 3;
    out.status = "failed";
    std::vector<std::string> last_lines = f.last_lines;
    int failed_rank = f.rank;  // a remote one's as its agent reported it
    bool rank_failed = true;   // not an agent that failed without a report
    std::string log_hint;
    bool protocol_only = false;  // an agent's lines were all of its protocol
    const auto relay = relays.find(f.label);
    if (relay != relays.end()) {
      const std::string& host = relay->second.host.host;
      if (const json* report = agent_report(f)) {
        const json& r = *report;
        const int rank = r.value("rank", -1);
        failed_rank = rank;
        // The rank's exit, or for a failure of the host (rank -1) its agent's, which the relay
        // exits with (4: it could not reach the host or run dptrain there; 2: the agent refused
        // its plan, say the host's data differs).
        const int code = rank >= 0 ? r.value("exit_code", -1) : f.exit_code;
        if (rank < 0 && code == 4) out.exit_code = 4;
        out.host_refused = rank < 0 && r.value("refused", false);
        if (out.host_refused) out.refused_host = relay->second.host.display();
        out.host_unreachable = rank < 0 && code == 4 && r.value("unreachable", false);
        if (code == 5) out.exit_code = 5;
        out.repeats = code == 2;
        // The host as the hostfile gives it (user@host:port): hosts may share a name.
        out.error = rank >= 0 ? fmt::format("{} on host {}", r.value("description", ""),
                                            relay->second.host.display())
                              : r.value("description", std::string());
        last_lines = r.value("last_lines", std::vector<std::string>{});
        if (rank >= 0) {
          log_hint = (run.logs() / fmt::format("{}-rank{}.log", host, rank)).string();
        }
      } else {
        rank_failed = false;
        // The relay itself killed (it runs here, not on the host): named as what it is.
        out.error = f.signal != 0
                        ? fmt::format(
                              "the relay to {} (pid {} on this machine: the launcher's end of its "
                              "SSH connection) was killed by signal {} ({}){}",
                              host_and_ranks(relay->second.host, relay->second.ranks), f.pid,
                              f.signal, signal_name(f.signal), f.note.empty() ? "" : "; " + f.note)
                        : fmt::format("the agent on {} failed: {}", relay->second.host.display(),
                                      f.describe());
        // An agent that exits 2 with no report refused what it was given (a plan it cannot
        // read, a dptrain there without the agent command): the next generation meets the same.
        out.repeats = f.exit_code == 2;
        log_hint = procs[0].log_file.string();
        for (const auto& p : procs) {
          if (p.label == f.label) log_hint = p.log_file.string();
        }
        // The agent's protocol lines ("@agent N", "@started") say nothing of what went wrong.
        protocol_only = !last_lines.empty();
        std::erase_if(last_lines, [](const std::string& l) {
          return l == kAgentStartedLine || l == kAgentDoneLine || l.starts_with(kAgentHelloPrefix);
        });
        protocol_only = protocol_only && last_lines.empty();
      }
    } else {
      out.error = f.describe();
      // A checkpoint that cannot be written (a full disk) is not cured by a restart.
      if (f.exit_code == 5) out.exit_code = 5;
      out.repeats = f.exit_code == 2;
      if (f.signal == SIGKILL) {
        for (const auto& k : sup.killed) {
          if (relays.find(k.label) == relays.end()) out.killed_ranks.push_back(k.rank);
        }
      }
      for (const auto& p : procs) {
        if (p.label == f.label) log_hint = p.log_file.string();
      }
    }
    const std::string own = take_rank_error(last_lines, failed_rank);
    if (!own.empty()) out.error += ": " + own;
    // A collective that timed out names the rank that gave up waiting, not the one it waited
    // for (without --hang-timeout nothing else named it): the heartbeats the ranks left say.
    const bool placed =
        f.exit_code == 3 && trace.beats.size() >= 2 && HangWatch::timed_out(out.error);
    if (placed) {
      out.error +=
          "; by the ranks' last heartbeats, " + HangWatch::positions(trace.beats, rank_name);
    }
    if (last_lines.empty()) {
      // No lines to show (a rank killed, or one that exits before it prints, or only its error
      // line): where the rank was, by its last heartbeat, and where its log is.
      const auto beat = trace.beats.find(failed_rank);
      if (!placed && rank_failed && beat != trace.beats.end()) {
        out.error += "; its last heartbeat: " + HangWatch::position(beat->second);
      }
      if (!log_hint.empty()) {
        out.error += !own.empty()    ? fmt::format("; log: {}", log_hint)
                     : protocol_only ? fmt::format(
                                           "; it printed nothing but the agent's protocol "
                                           "lines (log: {})",
                                           log_hint)
                                     : fmt::format("; it printed nothing (log: {})", log_hint);
      }
    }
    // A rank that exited 0 before the run ended (no result) leaves its peers to fail in their
    // next collective (exit 3; a relay exits with its rank's status): it is the cause, and the
    // peer's failure what followed. A local rank's own exit; a host's relay that exited 0 (each
    // of its ranks did: its agent says no more); or one a failing host's agent listed.
    if (f.exit_code == 3 && result.is_null()) {
      std::string who;
      for (const ProcessExit& e : sup.exits) {
        if (e.pid == f.pid || e.exit_code != 0 || e.signal != 0) continue;
        early_exit = e;
        who = fmt::format("{} (pid {})", e.label, e.pid);
        if (const auto remote = relays.find(e.label); remote != relays.end()) {
          const std::vector<int>& ranks = remote->second.ranks;
          early_exit->rank = ranks.front();
          early_exit->label = fmt::format("{} {} on {}", ranks.size() == 1 ? "rank" : "ranks",
                                          fmt::join(ranks, ", "), remote->second.host.display());
          who = early_exit->label;
        }
        break;
      }
      for (auto report = agent_failures.begin(); !early_exit && report != agent_failures.end();
           ++report) {
        if (!report->second.is_object()) continue;
        const json clean = report->second.value("clean_exits", json::array());
        if (!clean.is_array() || clean.empty() || !clean[0].is_object()) continue;
        const int rank = clean[0].value("rank", -1);
        early_exit = ProcessExit{.label = rank_name(rank),
                                 .rank = rank,
                                 .pid = clean[0].value("pid", 0),
                                 .exit_code = 0};
        who = fmt::format("{} (pid {})", early_exit->label, early_exit->pid);
      }
      if (early_exit) {
        out.error = fmt::format(
            "{} exited with code 0 before the run ended{}; then {}", who,
            trace.step >= 0 ? fmt::format(" (the ranks had reached step {})", trace.step) : "",
            out.error);
      }
    }
    if (sup.stop_signal != 0) {
      out.error +=
          fmt::format("; then the launcher got {}{}",
                      sup.stop_signal == SIGTERM ? "SIGTERM" : "SIGINT", checkpoint_note());
    }
    if (!last_lines.empty()) {
      out.error += log_excerpt_lead(log_hint);
      for (const auto& l : last_lines)
        out.error += "\n  " + l;
    }
  } else if (!sup.requested.empty() && result.is_null()) {
    // Every rank checkpointed and stopped for the hosts that came back (a rank that finished
    // the run first reported its result: that is a completed run).
    out.status = "resized";
    out.resized = true;
  } else {
    out.status = "completed";
    out.result = result;
    if (out.result.is_null()) {
      out.exit_code = 1;
      out.status = "failed";
      out.error = "all ranks exited 0 but rank 0 reported no result";
    }
  }
  if (sup.failure && !host_lost_after_result) {
    const ProcessFailure& f = *sup.failure;
    out.failed_rank = early_exit ? early_exit->rank : f.rank;
    // A remote rank's own exit, as its agent reported it (the relay only carries a status):
    // named and typed as a local rank's is.
    std::string process = early_exit ? early_exit->label : f.label;
    int exit_code = early_exit ? 0 : f.exit_code;
    int signal = early_exit ? 0 : f.signal;
    if (const json* r = agent_report(f); r != nullptr && r->value("rank", -1) >= 0 && !early_exit) {
      process = rank_name(r->value("rank", -1));
      exit_code = r->value("exit_code", -1);
      signal = r->value("signal", 0);
    }
    // A rank stopped by its own SIGTERM: every rank checkpoints and exits 143, and the first to
    // exit is any of them; the rank that got the signal is the one that exited, as the message
    // says.
    if (exit_code == 143 && !trace.sigterm_ranks.empty() && !lost) {
      out.failed_rank = trace.sigterm_ranks.front();
      process = rank_name(out.failed_rank);
    }
    if (lost) {  // the host, as its relay reported it
      out.failed_rank = -1;
      process = lost->label;
      exit_code = lost->exit_code;
      signal = lost->signal;
    }
    // A host's agent killed by a signal: its relay exited 128 + N saying so, and the signal is the
    // host's exit.
    if (const json* r = agent_report(f); r != nullptr && r->value("rank", -1) < 0 &&
                                         r->value("signal", 0) != 0 && !early_exit && !lost) {
      signal = r->value("signal", 0);
    }
    rank_exited(process, exit_code, signal, error_headline(out.error));
    // Local ranks SIGKILLed beside it before the launcher killed any (the OOM killer took two):
    // each exited on its own account too.
    for (const ProcessExit& k : sup.killed) {
      if (k.label != f.label && relays.find(k.label) == relays.end())
        rank_exited(k.label, k.exit_code, k.signal, k.describe());
    }
  }
  events.emit("generation_ended",
              {{"generation", generation}, {"status", out.status}, {"exit_code", out.exit_code}});
  info["status"] = out.status;
  info["generations"].back()["ended_at"] = utc_timestamp();
  info["generations"].back()["status"] = out.status;
  // The step it reached (steps done), which status and report show for a run that ended here; a
  // benchmark's, the measurement it reached (-1: none, or one that completed: its result says).
  info["generations"].back()["step"] =
      out.result.is_object() ? out.result.value("steps", out.last_step)
      : trains               ? std::max({out.failed_step, out.last_step, out.start_step})
                             : measured;
  if (!out.error.empty()) info["generations"].back()["error"] = out.error;
  // A recipe or data problem, or a diverged training: status and report do not offer a resume.
  info["generations"].back()["exit_code"] = out.exit_code;
  if (out.repeats) info["generations"].back()["would_repeat"] = true;
  if (out.host_refused) info["generations"].back()["host_refused"] = true;
  if (out.host_unreachable) info["generations"].back()["host_unreachable"] = true;
  if (out.resized) info["generations"].back()["stopped_for"] = sup.requested;
  if (!out.result.is_null()) info["result"] = out.result;
  // After a stop too (a resume on another -n, stopped before its ranks met): what trained last is
  // what the next resume defaults to, not settings no rank ever ran with.
  if (!ranks_joined && out.exit_code != 0) restore_placement(info, placed_before);
  run.record();
  return out;
}

}  // namespace dptrain
