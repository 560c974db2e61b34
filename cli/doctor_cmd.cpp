// `dptrain doctor --hosts H [RECIPE]`: preflight checks; and the hidden `_probe` it runs on hosts.
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "cli/host_options.hpp"
#include "cli/json_errors.hpp"
#include "cli/run_report.hpp"
#include "core/comm/store.hpp"
#include "core/error.hpp"
#include "core/json_error.hpp"
#include "core/tensor/blas.hpp"
#include "launch/doctor.hpp"
#include "launch/job.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

namespace {

struct DoctorCliOptions {
  HostOptions hosts;
  std::string recipe;
  std::string workdir = kDefaultWorkdir;
  std::string remote_binary;
  std::string master_addr;
  int master_port = 0;
  bool no_allreduce = false;
  bool json = false;
};

int run_doctor_cmd(const DoctorCliOptions& o) {
  DoctorOptions d;
  d.workdir = o.workdir;
  d.remote_binary = o.remote_binary;
  d.recipe = o.recipe;
  d.master_addr = unbracketed(o.master_addr);  // "[::1]" is ::1
  d.master_port = static_cast<uint16_t>(o.master_port);
  d.local_binary = self_executable();
  d.ssh = o.hosts.ssh();
  d.allreduce = !o.no_allreduce;
  // A stop ends the checks between steps: those done are shown, then the stop, as every
  // command's (exit 130 or 143; with --json in the one object).
  install_stop_signal_handlers();
  exit_on_second_interrupt();  // an SSH connection being made is not cut short by the first
  const auto checks = run_doctor(o.hosts.load(), d);
  int failed = 0, skipped = 0;
  nlohmann::json list = nlohmann::json::array();
  for (const auto& c : checks) {
    failed += c.failed() ? 1 : 0;
    skipped += c.skipped ? 1 : 0;
    list.push_back(c.to_json());
    if (!o.json) std::printf("%s\n", c.line().c_str());
  }
  const int sig = pending_stop_signal();
  if (sig != 0) {
    const Error stopped =
        stop_error(sig, "doctor ",
                   fmt::format(" after {} check(s)", checks.size() - static_cast<size_t>(skipped)));
    if (!o.json) throw stopped;
    nlohmann::json out = {
        {"ok", false}, {"checks", list}, {"status", failure_status(stopped.kind())}};
    add_failure(out, exit_code(stopped.kind()), std::vector<std::string>{stopped.what()});
    std::printf("%s\n", json_text(out).c_str());
    print_error_lines(stopped.what());
    return exit_code(stopped.kind());
  }
  const int code = doctor_exit_code(checks);
  // Each failed check, one plain message ("ssh node2: ..."; its fix stays in the check): the
  // common failure fields of --json (dptrain(1), JSON OUTPUT), and stderr's error lines, as
  // every command gives them (a CI log that keeps stderr shows why).
  std::vector<std::string> errors;
  for (const auto& c : checks) {
    if (c.failed()) {
      errors.push_back(c.host.empty() ? fmt::format("{}: {}", c.check, c.detail)
                                      : fmt::format("{} {}: {}", c.check, c.host, c.detail));
    }
  }
  if (o.json) {
    nlohmann::json out = {{"ok", failed == 0}, {"checks", list}};
    if (code == 0) {
      add_success(out);
    } else {
      add_failure(out, code, errors);
    }
    std::printf("%s\n", json_text(out).c_str());
  } else {
    const std::string not_run = skipped > 0 ? fmt::format(", {} not run", skipped) : "";
    std::printf("%s\n", failed == 0 ? ("all checks passed" + not_run).c_str()
                                    : fmt::format("{} check(s) failed{}", failed, not_run).c_str());
  }
  std::fflush(stdout);
  for (const auto& error : errors)
    print_error_lines(error);
  return code;
}

}  // namespace

void setup_doctor(CLI::App& app, Outcome& outcome) {
  auto o = std::make_shared<DoctorCliOptions>();
  add_host_options(app, o->hosts, true);
  app.add_option("recipe", o->recipe, "Recipe to check against the hosts (optional)");
  app.add_option("--workdir", o->workdir, "Work directory on the hosts, as for provision")
      ->capture_default_str()
      ->check(remote_path());
  app.add_option("--remote-binary", o->remote_binary,
                 "dptrain on the hosts (default: WORKDIR/bin/dptrain)")
      ->check(remote_path());
  app.add_option("--master-addr", o->master_addr, "The store address launch would use");
  app.add_option("--master-port", o->master_port, "The store port launch would use (0: any)")
      ->check(whole_number<int>("PORT", 65535));
  app.add_flag("--no-allreduce", o->no_allreduce, "Skip the tiny all-reduce job across all ranks");
  app.add_flag("--json", o->json,
               "Print {\"ok\", \"status\", \"exit_code\", \"checks\": [...]} on stdout (and "
               "\"error\", \"errors\" on failure, see dptrain(1))");
  app.callback([o, &outcome] {
    outcome.json = o->json;
    outcome.exit_code = run_doctor_cmd(*o);
  });
}

void setup_probe(CLI::App& app, Outcome& outcome) {
  app.group("");  // internal: doctor runs it on hosts
  app.require_subcommand(1);
  auto* listen = app.add_subcommand("listen", "Listen on a free port until stdin ends");
  listen->callback([&outcome] { outcome.exit_code = run_probe_listen(stdout); });
  auto address = std::make_shared<std::string>();
  auto seconds = std::make_shared<double>(5);
  auto* connect = app.add_subcommand("connect", "Connect to HOST:PORT");
  connect->add_option("address", *address)->required();
  connect->add_option("seconds", *seconds);
  connect->callback(
      [&outcome, address, seconds] { outcome.exit_code = run_probe_connect(*address, *seconds); });
  auto* blas = app.add_subcommand("blas", "Load OpenBLAS as a CPU rank does and say which");
  blas->callback([&outcome] {
    std::printf("%s\n", blas_description().c_str());
    outcome.exit_code = 0;
  });
}

}  // namespace dptrain::cli
