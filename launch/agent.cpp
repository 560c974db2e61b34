// The ranks of one node: plan, worker process specs, and the agent loop.
#include "launch/agent.hpp"

#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <mutex>
#include <stop_token>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "core/comm/auth.hpp"
#include "core/data/tokens.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"
#include "launch/job.hpp"
#include "launch/provision.hpp"
#include "launch/run_dir.hpp"

namespace dptrain {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr const char* kBlasThreadsEnv = "OPENBLAS_NUM_THREADS";

// Whether the job's variables or this process's environment size OpenBLAS's pool (an empty
// value counts as unset, as OpenBLAS takes it).
bool blas_threads_given(const std::map<std::string, std::string>& job_env) {
  for (const char* name : {kBlasThreadsEnv, "GOTO_NUM_THREADS", "OMP_NUM_THREADS"}) {
    const auto in_job = job_env.find(name);
    const char* here = std::getenv(name);
    if ((in_job != job_env.end() && !in_job->second.empty()) ||
        (here != nullptr && *here != '\0')) {
      return true;
    }
  }
  return false;
}

}  // namespace

json AgentPlan::to_json(bool redact_secret) const {
  return {{"host", host},
          {"display", display},
          {"run_dir", run_dir.string()},
          {"recipe", recipe},
          {"store", store},
          {"secret", redact_secret ? std::string("<redacted>") : secret},
          {"generation", generation},
          {"world_size", world_size},
          {"nominal_world", nominal_world},
          {"one_gpu_per_rank", one_gpu_per_rank},
          {"backend", backend},
          {"resume_from", resume_from},
          {"ranks", ranks},
          {"env", env},
          {"worker_args", worker_args},
          {"data_dir", data_dir},
          {"data_sha256", data_sha256},
          {"data_fingerprint", data_fingerprint},
          {"benchmark", benchmark},
          {"protocol", kAgentProtocol}};
}

AgentPlan AgentPlan::from_json(const json& j) {
  try {
    // A plan of another protocol may lack the fields this build reads, or mean other things by
    // them: refused first. Plans from before the number was sent (protocol 1) are known by all
    // their fields being there, else they are only malformed.
    const auto refuse = [&](int protocol) {
      const std::string host = j.value("display", j.value("host", std::string()));
      return Error(
          ErrorKind::ssh,
          fmt::format("{}the launching host runs another build of dptrain than this one: its "
                      "plan speaks agent protocol {}, {} than this build's {}; install one build "
                      "on every host ('dptrain provision' installs the launcher's), or name it "
                      "with --remote-binary",
                      host.empty() ? std::string() : printable(host) + ": ", protocol,
                      protocol < kAgentProtocol ? "older" : "newer", kAgentProtocol));
    };
    const bool said = j.contains("protocol");
    if (said && j.at("protocol").get<int>() != kAgentProtocol) {
      throw refuse(j.at("protocol").get<int>());
    }
    AgentPlan p;
    p.host = j.at("host").get<std::string>();
    p.display = j.value("display", std::string());
    p.run_dir = j.at("run_dir").get<std::string>();
    p.recipe = j.at("recipe");
    p.store = j.at("store").get<std::string>();
    p.secret = j.at("secret").get<std::string>();
    p.generation = j.at("generation").get<int>();
    p.world_size = j.at("world_size").get<int>();
    p.nominal_world = j.value("nominal_world", 0);
    p.one_gpu_per_rank = j.value("one_gpu_per_rank", false);
    p.backend = j.at("backend").get<std::string>();
    p.resume_from = j.at("resume_from").get<std::string>();
    p.ranks = j.at("ranks").get<std::vector<int>>();
    p.env = j.at("env").get<std::map<std::string, std::string>>();
    p.data_dir = j.value("data_dir", std::string());
    p.data_sha256 = j.value("data_sha256", std::string());
    p.data_fingerprint = j.value("data_fingerprint", std::string());
    p.benchmark = j.value("benchmark", false);
    p.worker_args = j.value("worker_args", std::vector<std::string>{});
    if (!said) throw refuse(1);
    return p;
  } catch (const json::exception& e) {
    throw Error(ErrorKind::usage, fmt::format("malformed agent plan: {} (is dptrain the same "
                                              "version here and on the launching host?)",
                                              without_json_tag(e.what())));
  }
}

std::string gpu_of_local_rank(int local_rank, const std::map<std::string, std::string>& job_env) {
  const auto given = job_env.find("CUDA_VISIBLE_DEVICES");
  const char* visible =
      given != job_env.end() ? given->second.c_str() : std::getenv("CUDA_VISIBLE_DEVICES");
  if (visible == nullptr || *visible == '\0') {
    // The job's empty list names no GPU; the host's empty one means none was chosen.
    return given != job_env.end() ? "-1" : std::to_string(local_rank);
  }
  std::vector<std::string> devices;
  std::string current;
  for (const char* c = visible;; ++c) {
    if (*c == ',' || *c == '\0') {
      devices.push_back(current);
      current.clear();
      if (*c == '\0') break;
    } else {
      current += *c;
    }
  }
  // More ranks than devices: the rank's op table says that no device is visible to it.
  if (static_cast<size_t>(local_rank) >= devices.size()) return "-1";
  return devices[static_cast<size_t>(local_rank)];
}

std::vector<ProcessSpec> worker_specs(const AgentPlan& plan, const fs::path& worker_binary) {
  const fs::path recipe_file = plan.run_dir / "recipe.json";
  std::vector<ProcessSpec> specs;
  const int local_world = static_cast<int>(plan.ranks.size());
  for (int local = 0; local < local_world; ++local) {
    const int rank = plan.ranks[static_cast<size_t>(local)];
    ProcessSpec p;
    p.label = fmt::format("rank {}", rank);
    p.rank = rank;
    p.hold_sigterm = true;  // a preemption while the rank loads is a stop, not a failure
    p.argv = {worker_binary.string(), "worker", recipe_file.string(), "--run-dir",
              plan.run_dir.string()};
    if (!plan.worker_args.empty()) {
      p.argv = {worker_binary.string()};
      p.argv.insert(p.argv.end(), plan.worker_args.begin(), plan.worker_args.end());
    } else if (!plan.resume_from.empty()) {
      p.argv.push_back("--resume");
      p.argv.push_back(plan.resume_from);
    }
    p.env = {{"RANK", std::to_string(rank)},
             {"WORLD_SIZE", std::to_string(plan.world_size)},
             {"LOCAL_RANK", std::to_string(local)},
             {"LOCAL_WORLD_SIZE", std::to_string(local_world)},
             {"DPTRAIN_STORE", plan.store},
             {"DPTRAIN_GENERATION", std::to_string(plan.generation)},
             {"DPTRAIN_BACKEND", plan.backend},
             {"DPTRAIN_EVENTS", "1"},
             {kLaunchedEnv, "1"}};
    if (plan.nominal_world > 0) {
      p.env.emplace_back("DPTRAIN_NOMINAL_WORLD", std::to_string(plan.nominal_world));
    }
    if (plan.one_gpu_per_rank) {
      p.env.emplace_back("CUDA_VISIBLE_DEVICES", gpu_of_local_rank(local, plan.env));
    }
    if (!plan.secret.empty()) p.env.emplace_back(kStoreSecretEnv, plan.secret);
    // OpenBLAS makes its thread pool as it loads, one thread per core unless told: a rank uses
    // the recipe's threads_per_rank of them. A count the user gives (here or on the launcher,
    // in any of the variables OpenBLAS reads) wins.
    if (!blas_threads_given(plan.env)) {
      const json train =
          plan.recipe.is_object() ? plan.recipe.value("train", json::object()) : json::object();
      p.env.emplace_back(kBlasThreadsEnv, std::to_string(train.value("threads_per_rank", 1)));
    }
    for (const auto& [k, v] : plan.env) {
      // The job's GPU list is where the rank's one GPU came from, above.
      if (!(plan.one_gpu_per_rank && k == "CUDA_VISIBLE_DEVICES")) p.env.emplace_back(k, v);
    }
    p.log_file = plan.run_dir / "logs" / fmt::format("{}-rank{}.log", plan.host, rank);
    specs.push_back(std::move(p));
  }
  return specs;
}

// A CSV file named by the launcher's path is found where provision put it when that path does
// not exist on this host (no shared filesystem).
void prepare_data(AgentPlan& plan) {
  auto& data = plan.recipe["data"];
  if (data.value("type", "") == "tokens" && !plan.data_fingerprint.empty()) {
    DataSpec tokens;
    tokens.type = "tokens";
    tokens.path = data.value("path", std::string());
    std::string here;
    try {
      here = token_data_fingerprint(tokens);
    } catch (const Error&) {
      return;  // missing or damaged: the ranks say so, naming the file
    }
    if (here != plan.data_fingerprint) {
      throw Error(ErrorKind::usage,
                  fmt::format("{} on {} is not the launcher's dataset ({} there, the launcher's "
                              "{}): its ranks would train on other data; prepare it there from "
                              "the same text with the same options, or copy the launcher's",
                              tokens.path, plan.named(), here, plan.data_fingerprint));
    }
    return;
  }
  if (plan.data_dir.empty() || data.value("type", "") != "csv") return;
  fs::path path = data.value("path", std::string());
  std::error_code ec;
  if (!fs::exists(path, ec)) {
    const fs::path provisioned = expand_home(plan.data_dir) / path.filename();
    if (!fs::exists(provisioned, ec)) return;  // the ranks say it is missing, naming both
    path = provisioned;
    data["path"] = provisioned.string();
  }
  if (plan.data_sha256.empty()) return;
  if (const std::string here = sha256_file(path); here != plan.data_sha256) {
    throw Error(ErrorKind::usage,
                fmt::format("{} on {} is not the launcher's data file (sha256 {}..., the "
                            "launcher's {}...): its ranks would train on other data; run "
                            "'dptrain provision --recipe' again, or put the same file there",
                            path.string(), plan.named(), here.substr(0, 12),
                            plan.data_sha256.substr(0, 12)));
  }
}

void write_host_failure(std::FILE* out, const std::string& description, bool refused, int signal,
                        bool unreachable) {
  json report = {{"rank", -1},         {"exit_code", -1},
                 {"signal", signal},   {"description", description},
                 {"refused", refused}, {"last_lines", json::array()}};
  if (unreachable) report["unreachable"] = true;
  std::fprintf(out, "%s%s\n", kAgentFailurePrefix, json_text(report).c_str());
  std::fflush(out);
}

int run_agent(const AgentPlan& given, std::FILE* out, int stop_fd) {
  AgentPlan plan = given;
  plan.run_dir = expand_home(plan.run_dir.string());
  std::error_code ec;
  fs::create_directories(plan.run_dir / "logs", ec);
  if (ec) {
    // A host that cannot hold the run (a file where its directory goes, a workdir it may not
    // write) meets the same in every generation: it cannot run this job, as a host without
    // dptrain cannot (exit 4, not restarted; an elastic job leaves it out).
    write_host_failure(out,
                       fmt::format("{}: cannot create run directory on {}: {}",
                                   printable(plan.run_dir.string()), plan.named(), ec.message()),
                       /*refused=*/true);
    return exit_code(ErrorKind::ssh);
  }
  std::mutex out_mutex;
  const auto say_alive = [&] {
    std::lock_guard lock(out_mutex);
    std::fprintf(out, "%s\n", kAgentAliveLine);
    std::fflush(out);
  };
  if (plan.worker_args.empty()) {  // the trainer's ranks read it; a benchmark's do not
    // Checking the host's data (hashing a large CSV) may take longer than the relay waits for
    // a word: the agent says it is alive meanwhile, as its supervision does once ranks run.
    std::mutex wait_mutex;
    std::condition_variable_any wake;
    std::jthread alive([&](std::stop_token stop) {
      std::unique_lock lock(wait_mutex);
      while (!wake.wait_for(lock, stop, kAgentAliveInterval, [] { return false; })) {
        if (stop.stop_requested()) return;
        say_alive();
      }
    });
    prepare_data(plan);
    write_file_atomic(plan.run_dir / "recipe.json", json_text(plan.recipe, 2) + "\n");
  }
  SupervisorOptions options;
  options.stop_fd = stop_fd;
  // Inside the launcher's own grace periods, so the agent reports before it is cut off.
  options.grace = std::chrono::milliseconds(3000);
  options.stop_grace = std::chrono::milliseconds(50000);
  // Its ranks that the agent stops for one that failed say so (as the launcher's do).
  options.on_first_failure = [&plan] {
    mark_peer_failed(plan.store, plan.secret, plan.generation);
  };
  auto last_alive = std::chrono::steady_clock::now();
  options.tick = [&] {
    const auto now = std::chrono::steady_clock::now();
    if (now - last_alive < kAgentAliveInterval) return;
    last_alive = now;
    say_alive();
  };
  options.on_line = [&](const ProcessSpec& p, const std::string& line) {
    std::lock_guard lock(out_mutex);
    if (line.rfind("@event ", 0) == 0) {
      std::fprintf(out, "%s\n", line.c_str());
    } else {
      std::fprintf(out, "%s%d %s\n", kAgentRankPrefix, p.rank, line.c_str());
    }
    std::fflush(out);
  };
  // The launcher's hang watch counts a rank that never beats from here.
  options.on_started = [&](const std::vector<pid_t>&) {
    std::lock_guard lock(out_mutex);
    std::fprintf(out, "%s\n", kAgentStartedLine);
    std::fflush(out);
  };
  const auto specs = worker_specs(plan, self_executable());
  const SupervisionResult result = supervise(specs, options);
  if (plan.benchmark) remove_checkpoints(plan.run_dir);
  // The failed rank, for the launcher to name (its pid, its last lines), with its ranks that
  // exited 0 (before the run ended, as the launcher can tell): one that left early is the cause
  // of its peers' exit 3, the failure reported here among them.
  const auto report_failure = [&](const ProcessFailure& f) {
    json clean_exits = json::array();
    for (const ProcessExit& e : result.exits) {
      if (e.exit_code == 0 && e.signal == 0)
        clean_exits.push_back({{"rank", e.rank}, {"pid", e.pid}});
    }
    const json report = {{"rank", f.rank},
                         {"pid", f.pid},
                         {"exit_code", f.exit_code},
                         {"signal", f.signal},
                         {"description", f.describe()},
                         {"last_lines", f.last_lines},
                         {"clean_exits", clean_exits}};
    std::fprintf(out, "%s%s\n", kAgentFailurePrefix, json_text(report).c_str());
    std::fflush(out);
  };
  if (result.failure) {
    const auto& f = *result.failure;
    report_failure(f);
    // The launcher ranks causes by exit status (a signal outranks a peer's exit 3), so the
    // agent's own status carries its rank's.
    return f.signal != 0 ? 128 + f.signal : f.exit_code;
  }
  if (result.stop_signal == SIGINT) return 130;
  const bool all_finished =
      std::all_of(result.exits.begin(), result.exits.end(),
                  [](const ProcessExit& e) { return e.signal == 0 && e.exit_code == 0; });
  // A stop that came during the last step: the ranks finished the run instead (exit 0), and the
  // host is done like any other.
  if (!all_finished && (result.stop_signal != 0 || !result.requested.empty())) {
    // 143 says every rank checkpointed and stopped: only when each did. Otherwise the first one
    // that did not, as its own status, for the launcher to report. Never 0, which says every
    // rank finished (the launcher would name them all as having left early): a rank that
    // exited 0 is passed over.
    // A rank killed (after the stop's grace, say) first, with no report: the launcher's verdict
    // from the heartbeats stands. Else the rank that failed of itself (a checkpoint it could not
    // write: ProcessExit::failed_of_itself) before one with a communication error (3, what a
    // peer's end causes) or a shell's 128 + N, reported so that the launcher names it as it names
    // its own ranks.
    const ProcessExit* failed = nullptr;
    for (const ProcessExit& e : result.exits) {
      if (e.signal != 0) return 128 + e.signal;
      if (e.exit_code == 143 || e.exit_code == 0) continue;
      if (failed == nullptr || (!failed->failed_of_itself() && e.failed_of_itself())) failed = &e;
    }
    if (failed != nullptr) {
      ProcessFailure f;
      static_cast<ProcessExit&>(f) = *failed;
      report_failure(f);
      return failed->exit_code;
    }
    return 143;
  }
  // For tests: a host that stops answering once its ranks are done, after saying so or (with
  // "before-done") before. Nothing more is said until the launcher's side has gone (its end of
  // the connection closes).
  const char* silent = std::getenv("DPTRAIN_TEST_AGENT_SILENT_AT_END");
  const auto fall_silent = [stop_fd] {
    char c;
    while (::read(stop_fd, &c, 1) > 0) {
    }
  };
  if (silent != nullptr && std::string_view(silent) == "before-done") {
    fall_silent();
    return 0;
  }
  std::fprintf(out, "%s\n", kAgentDoneLine);
  std::fflush(out);
  if (silent != nullptr) fall_silent();
  return 0;
}

}  // namespace dptrain
