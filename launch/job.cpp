// One generation of a job on this machine: store, rank processes, supervision, run.json updates.
#include "launch/job.hpp"

#include <csignal>

#include <fmt/format.h>

#include "core/comm/tcp_store.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "launch/supervisor.hpp"

namespace dptrain {

namespace fs = std::filesystem;
using nlohmann::json;

fs::path self_executable() {
  return fs::read_symlink("/proc/self/exe");
}

std::string resolve_backend(const std::string& requested) {
  if (requested == "auto" || requested == "gloo") return "gloo";
  throw Error(
      ErrorKind::usage,
      fmt::format("--backend: '{}' is not available in this build (use gloo or auto)", requested));
}

json JobOutcome::to_json(const RunDirectory& run) const {
  json j = {{"status", status}, {"exit_code", exit_code}, {"run_dir", run.path().string()}};
  if (!error.empty()) j["error"] = error;
  for (const auto& [k, v] : result.items())
    j[k] = v;
  return j;
}

JobOutcome run_local_job(RunDirectory& run, const JobSpec& spec, StatusPrinter& status) {
  const std::string backend = resolve_backend(spec.backend);
  TcpStoreServer store("127.0.0.1", 0);
  const fs::path recipe_file = run.path() / "recipe.json";
  write_file_atomic(recipe_file, to_json(spec.recipe).dump(2) + "\n");

  json& info = run.info();
  const int generation = static_cast<int>(info["generations"].size()) + 1;
  info["recipe"] = to_json(spec.recipe);
  info["world_size"] = spec.world_size;
  info["backend"] = backend;
  info["hosts"] = json::array({{{"host", "localhost"}, {"slots", spec.world_size}}});
  info["status"] = "running";
  json gen = {
      {"generation", generation}, {"started_at", utc_timestamp()}, {"world_size", spec.world_size}};
  if (!spec.resume_from.empty()) gen["resumed_from"] = spec.resume_from.filename().string();
  info["generations"].push_back(gen);
  run.save();

  std::vector<ProcessSpec> procs;
  for (int r = 0; r < spec.world_size; ++r) {
    ProcessSpec p;
    p.label = fmt::format("rank {}", r);
    p.rank = r;
    p.argv = {spec.worker_binary.string(), "worker", recipe_file.string(), "--run-dir",
              run.path().string()};
    if (!spec.resume_from.empty()) {
      p.argv.push_back("--resume");
      p.argv.push_back(spec.resume_from.string());
    }
    p.env = {{"RANK", std::to_string(r)},
             {"WORLD_SIZE", std::to_string(spec.world_size)},
             {"LOCAL_RANK", std::to_string(r)},
             {"LOCAL_WORLD_SIZE", std::to_string(spec.world_size)},
             {"DPTRAIN_STORE", fmt::format("127.0.0.1:{}", store.port())},
             {"DPTRAIN_GENERATION", std::to_string(generation)},
             {"DPTRAIN_BACKEND", backend},
             {"DPTRAIN_EVENTS", "1"}};
    p.log_file = run.logs() / fmt::format("localhost-rank{}.log", r);
    procs.push_back(std::move(p));
  }

  SupervisorOptions options;
  options.on_line = [&status](const ProcessSpec& p, const std::string& line) {
    if (line.rfind("@event ", 0) == 0) {
      const json event = json::parse(line.substr(7), nullptr, false);
      if (!event.is_discarded()) {
        status.event(event);
        return;
      }
    }
    status.line(fmt::format("[{}] {}", p.label, line));
  };
  options.on_started = [&](const std::vector<pid_t>& pids) {
    info["generations"].back()["pids"] = pids;
    run.save();
  };
  const SupervisionResult sup = supervise(procs, options);
  status.finish();

  JobOutcome out;
  if (sup.stop_signal != 0) {
    out.exit_code = sup.stop_signal == SIGTERM ? 143 : 130;
    out.status = sup.stop_signal == SIGTERM ? "terminated" : "interrupted";
    out.error = fmt::format("stopped by {}; all ranks were stopped",
                            sup.stop_signal == SIGTERM ? "SIGTERM" : "SIGINT");
  } else if (sup.failure) {
    out.exit_code = 3;
    out.status = "failed";
    out.error = sup.failure->describe();
    if (!sup.failure->last_lines.empty()) {
      out.error += fmt::format("; its last lines (full log: {}):",
                               procs[static_cast<size_t>(sup.failure->rank)].log_file.string());
      for (const auto& l : sup.failure->last_lines)
        out.error += "\n  " + l;
    }
  } else {
    out.status = "completed";
    try {
      out.result = json::parse(read_file(run.path() / "result.json"));
    } catch (const std::exception& e) {
      out.exit_code = 1;
      out.status = "failed";
      out.error = fmt::format("all ranks exited 0 but {} is missing or unreadable",
                              (run.path() / "result.json").string());
    }
  }
  info["status"] = out.status;
  info["generations"].back()["ended_at"] = utc_timestamp();
  info["generations"].back()["status"] = out.status;
  if (!out.error.empty()) info["generations"].back()["error"] = out.error;
  if (!out.result.is_null()) info["result"] = out.result;
  run.save();
  return out;
}

}  // namespace dptrain
