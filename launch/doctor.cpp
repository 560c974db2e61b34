// `dptrain doctor`: preflight checks of hosts and a recipe, one line per failure with a fix.
#include "launch/doctor.hpp"

#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <string_view>
#include <system_error>
#include <thread>

#include <fmt/format.h>

#include "core/comm/nccl_communicator.hpp"
#include "core/comm/net.hpp"
#include "core/comm/socket.hpp"
#include "core/comm/store.hpp"
#include "core/data/dataset.hpp"
#include "core/data/tokens.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/recipe.hpp"
#include "core/tensor/device.hpp"
#include "core/trainer.hpp"
#include "launch/agent.hpp"
#include "launch/job.hpp"
#include "launch/provision.hpp"
#include "launch/supervisor.hpp"

namespace dptrain {

namespace fs = std::filesystem;
using nlohmann::json;
using Clock = std::chrono::steady_clock;

std::string DoctorCheck::line() const {
  std::string text = fmt::format("{:<4} {:<10} {}",
                                 skipped ? "skip"
                                 : ok    ? "ok"
                                         : "FAIL",
                                 check, host.empty() ? detail : host + ": " + detail);
  if (failed() && !fix.empty()) text += " -- fix: " + fix;
  return text;
}

json DoctorCheck::to_json() const {
  // A fix is advice for a failure: null on a check that passed (or was skipped), as in line().
  // "ok" is true only for a check that ran and passed, so that `.ok == true` counts passes.
  const json advice = !failed() || fix.empty() ? json(nullptr) : json(fix);
  return {{"check", check},
          {"host", host.empty() ? json(nullptr) : json(host)},
          {"ok", skipped ? json(nullptr) : json(ok)},
          {"detail", detail},
          {"fix", advice},
          {"skipped", skipped}};
}

int doctor_exit_code(const std::vector<DoctorCheck>& checks) {
  bool recipe_failed = false, host_failed = false;
  for (const auto& c : checks) {
    if (!c.failed()) continue;
    // The recipe, and its data as this machine loads it: what launch refuses with exit 2.
    const bool about_recipe = c.check == "recipe" || (c.check == "data" && c.host.empty());
    (about_recipe ? recipe_failed : host_failed) = true;
  }
  return recipe_failed ? 2 : host_failed ? 4 : 0;
}

int run_probe_listen(std::FILE* out) {
  UniqueFd listener = listen_tcp("0.0.0.0", 0);
  std::fprintf(out, "port %u\n", static_cast<unsigned>(local_port(listener.get())));
  std::fflush(out);
  // The kernel completes connections for a listening socket; this only has to stay alive until
  // doctor closes our stdin (or gives up on us).
  char c;
  while (::read(STDIN_FILENO, &c, 1) > 0) {
  }
  return 0;
}

int run_probe_connect(const std::string& address, double seconds) {
  const auto [host, port] = parse_host_port(address);
  const auto deadline =
      Clock::now() + std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
  const ConnectAttempt attempt = connect_tcp(host, port, deadline);
  if (!attempt.fd) {
    std::fprintf(stderr, "%s\n", attempt.failure.c_str());
    return 1;
  }
  return 0;
}

namespace {

constexpr double kProbeSeconds = 5;

// What doctor learned about one host before the network checks.
struct HostSurvey {
  std::unique_ptr<HostShell> shell;
  HostFacts facts;
  std::string binary;  // dptrain there, empty when it has none that runs
  std::vector<DoctorCheck> checks;
  std::string held_back;  // why the checks that need dptrain there cannot run; "" when they can
};

DoctorCheck skipped_check(std::string check, std::string host, std::string why) {
  return {std::move(check), std::move(host), false, "not run: " + std::move(why), "", true};
}

class Doctor {
 public:
  Doctor(const std::vector<HostSpec>& hosts, const DoctorOptions& options)
      : hosts_(hosts), options_(options), world_(total_slots(hosts)), ssh_(options.ssh) {
    // The hosts' survey's commands (a probe that hangs) are cut short by a stop, not waited for;
    // the later steps' are bounded (the port probes, run in threads of their own) or must run
    // after a stop (the removal of the trial job's directories): not those.
    ssh_.check_stop = [this] {
      if (surveying_) throw_if_stopped("");
    };
  }

  std::vector<DoctorCheck> run() {
    // A stop signal ends the checks between steps (the trial job stops its own ranks): the
    // checks done by then are reported, and the command says it was stopped.
    for (const auto step :
         {&Doctor::check_recipe, &Doctor::check_local_gpus_for_recipe, &Doctor::survey_hosts,
          &Doctor::check_store_port, &Doctor::check_peer_ports, &Doctor::check_data_on_hosts,
          &Doctor::check_allreduce_unless_off}) {
      if (pending_stop_signal() != 0) break;
      (this->*step)();
    }
    return std::move(checks_);
  }

 private:
  void add(std::string check, std::string host, bool ok, std::string detail, std::string fix = "") {
    checks_.push_back({std::move(check), std::move(host), ok, std::move(detail), std::move(fix)});
  }
  void skip(std::string check, std::string host, std::string why) {
    checks_.push_back(skipped_check(std::move(check), std::move(host), std::move(why)));
  }
  bool any_failed() const {
    for (const auto& c : checks_) {
      if (c.failed()) return true;
    }
    return false;
  }
  // Ranks that compute on GPUs (one per local rank, whatever the backend).
  bool gpu_recipe() const { return recipe_ && recipe_->train.device == "cuda"; }
  // Ranks that compute on the CPU, with OpenBLAS: those of a CPU recipe, or of any without one.
  bool cpu_recipe() const { return !recipe_ || recipe_->train.device != "cuda"; }

  void check_recipe() {
    if (options_.recipe.empty()) {
      // Never left out: a reader of the list sees what was not checked.
      skip("recipe", "", "no recipe given: give one to check it and its data");
      skip("data", "", "no recipe given");
      return;
    }
    try {
      recipe_ = load_recipe(options_.recipe);
      // Its fields: what is wrong in the data it names is the data check's (recipe validate,
      // which stops at neither, counts both).
      add("recipe", "", true, fmt::format("{}: its fields are valid", options_.recipe.string()));
    } catch (const Error& e) {
      // A read a stop signal cut short (a recipe from a FIFO): not a recipe to fix; the command
      // says it was stopped.
      if (pending_stop_signal() != 0) return;
      std::istringstream lines(e.what());
      for (std::string line; std::getline(lines, line);) {
        const bool unreadable = line.starts_with(options_.recipe.string() + ": cannot read");
        add("recipe", "", false, line,
            unreadable ? std::string("give the recipe's right path (this file cannot be read)")
                       : fmt::format("correct the recipe ('dptrain recipe validate {}' lists "
                                     "every problem)",
                                     options_.recipe.string()));
      }
      skip("data", "", "the recipe is not valid");
      return;
    }
    try {
      check_runnable(*recipe_, world_);
      add("data", "", true,
          fmt::format("enough samples for {} rank(s) x batch {} x accumulation {}", world_,
                      recipe_->train.batch_per_rank, recipe_->train.grad_accum));
    } catch (const Error& e) {
      // One failed check per problem: each wrong row of a CSV file is a line of its own, with
      // the fix for what is wrong with that row.
      const std::vector<std::string> problems = error_messages(e.what());
      const std::string fix = data_fix(*recipe_);
      for (const std::string& problem : problems) {
        // How many more rows are wrong is not a check of its own (a script counts the failed
        // checks): the last listed row's line says it.
        if (problem.ends_with(kUnlistedCsvProblems) && !checks_.empty() &&
            checks_.back().check == "data") {
          checks_.back().detail += "; and " + problem.substr(problem.rfind(": ") + 2);
          continue;
        }
        add("data", "", false, problem,
            problems.size() > 1 && recipe_->data.type == "csv" ? load_fix(*recipe_, problem) : fix);
      }
    }
  }

  // The fix for what check_runnable refused, found by redoing its steps (only after a failure):
  // too few samples for a global batch is not the same problem as a file that does not fit the
  // model, nor as a dataset that is not there.
  std::string data_fix(const Recipe& r) const {
    if (server_ranks(r) >= world_) {
      return fmt::format("use fewer distributed.servers than the {} rank(s), or more ranks",
                         world_);
    }
    int64_t train_samples = 0;
    try {
      train_samples = training_samples(r.data, r.model, r.seed);
    } catch (const Error& e) {
      return load_fix(r, e.what());
    }
    if (train_samples < global_batch(r, world_)) {
      return r.data.type == "synthetic-classification"
                 ? "raise data.samples, or use a smaller train.batch_per_rank or "
                   "train.grad_accum, or fewer ranks"
                 : "use more data, a smaller train.batch_per_rank or train.grad_accum, or fewer "
                   "ranks";
    }
    return fmt::format("correct what the line says in {} or its data", options_.recipe.string());
  }

  // The data could not be loaded for this model: what to change, by what the error says.
  std::string load_fix(const Recipe& r, const std::string& error) const {
    const auto says = [&](std::string_view phrase) {
      return error.find(phrase) != std::string::npos;
    };
    if (says("leaves none for training")) {
      return "lower data.eval_fraction, or use more data";
    }
    if (r.data.type == "csv") {
      if (says("features, but model.input")) {
        return "set model.input to the file's feature count (every column but the first, the "
               "label), or fix the rows that differ";
      }
      if (says("is outside [0,")) {
        return "labels must be 0 to model.classes - 1: raise model.classes, or renumber the "
               "labels";
      }
      return "fix the data file: each row is an integer label, then model.input numbers "
             "(data.header says whether the first line is a header)";
    }
    if (r.data.type == "tokens") {
      if (says("/model/vocab")) return "raise model.vocab to the dataset's vocabulary";
      if (says("fewer than one window")) {
        return "use a smaller model.context, or prepare the dataset from more text";
      }
      // What data prepare would say of data.path as its --out: the fix that works there.
      std::string flag;
      try {
        check_dataset_output(r.data.path, false);
      } catch (const Error&) {
        try {
          check_dataset_output(r.data.path, true);
          flag = " --force";
        } catch (const Error& e) {
          return fmt::format(
              "prepare a token dataset with 'dptrain data prepare --text FILE... "
              "--out NEW_DIR' and point data.path at it ({})",
              e.what());
        }
      }
      return fmt::format(
          "prepare a token dataset with 'dptrain data prepare --text FILE... "
          "--out {}{}', or point data.path at one",
          r.data.path, flag);
    }
    return fmt::format("correct the recipe ('dptrain recipe validate {}' lists what it can see)",
                       options_.recipe.string());
  }

  // A cuda recipe needs GPUs (and, for NCCL, the library) where its ranks run. This machine's
  // are checked here where it runs ranks (a login node that starts them all on GPU hosts needs
  // none); a remote host's ranks check their own when they start.
  void check_local_gpus_for_recipe() {
    if (!gpu_recipe() ||
        std::none_of(hosts_.begin(), hosts_.end(), [](const HostSpec& h) { return h.is_local(); }))
      return;
    if (const auto why = gpus_missing(1)) {
      local_gpu_missing_ = true;
      add("gpu", "localhost", false, *why,
          built_with_cuda() ? "install the NVIDIA driver, or check CUDA_VISIBLE_DEVICES"
                            : "rebuild where the CUDA toolkit is installed");
      return;
    }
    add("gpu", "localhost", true,
        fmt::format("{} CUDA device(s), the first {}", cuda_device_count(), cuda_device_name(0)));
    if (recipe_->distributed.backend == "gloo") return;
    const auto why_not = nccl_unavailable_reason();
    add("nccl", "localhost", !why_not, why_not ? *why_not : "NCCL loads",
        "put libnccl.so.2 on the library path or set DPTRAIN_NCCL_LIBRARY");
  }

  static bool is_stop(const Error& e) { return is_stop_kind(e.kind()); }

  void survey_hosts() {
    // This executable's hash, for the hosts' version checks (read once, before they run in
    // parallel).
    if (std::any_of(hosts_.begin(), hosts_.end(),
                    [](const HostSpec& h) { return !h.is_local(); })) {
      try {
        local_sha256_ = sha256_file(options_.local_binary);
      } catch (const Error&) {
        // Unreadable (deleted since it started): the builds are not compared.
      }
    }
    surveying_ = true;
    auto outcomes = for_each_host(hosts_, [this](const HostSpec& h) {
      HostSurvey s;
      s.shell = open_host_shell(h, ssh_);
      s.checks.push_back(
          {"ssh", h.display(), true, h.is_local() ? "this machine" : "connected", ""});
      if (h.is_local()) {
        try {
          survey_this_machine(h, s);
        } catch (const Error& e) {
          if (!is_stop(e)) throw;
          s.held_back = "doctor was stopped";
        }
        return s;
      }
      try {
        s.facts = survey_host(*s.shell, h, options_.workdir);
        s.checks.push_back({"workdir", h.display(), true,
                            s.facts.workdir_base.empty()
                                ? fmt::format("{} is writable", s.facts.workdir)
                                : fmt::format("{} is not there yet (provision makes it); where it "
                                              "goes takes writes",
                                              s.facts.workdir),
                            ""});
      } catch (const Error& e) {
        if (is_stop(e)) {  // the checks not made are not listed; the stop is said
          s.held_back = "doctor was stopped";
          return s;
        }
        s.checks.push_back({"workdir", h.display(), false, e.what(),
                            "fix what it says there (a file where a directory goes, its "
                            "permissions, a full disk), or pass another --workdir"});
        s.held_back = "its workdir check failed";
        s.checks.push_back(skipped_check("version", h.display(), s.held_back));
        if (gpu_recipe()) s.checks.push_back(skipped_check("gpus", h.display(), s.held_back));
        if (cpu_recipe()) s.checks.push_back(skipped_check("blas", h.display(), s.held_back));
        return s;
      }
      try {
        check_version(h, s);
        check_gpus(h, s);
        check_blas(h, s);
      } catch (const Error& e) {
        if (!is_stop(e)) throw;
        s.held_back = "doctor was stopped";
      }
      return s;
    });
    surveying_ = false;
    for (size_t i = 0; i < outcomes.size(); ++i) {
      auto& outcome = outcomes[i];
      if (!outcome.ok() && is_stop(*outcome.error)) {
        // Stopped while it connected: nothing is known of the host, and nothing is wrong with it
        // that doctor saw. The checks not made are not listed; the stop is said.
        skip("ssh", hosts_[i].display(), outcome.error->what());
        HostSurvey stopped;
        stopped.held_back = "doctor was stopped";
        surveys_.push_back(std::move(stopped));
        continue;
      }
      if (!outcome.ok()) {
        const std::string host = hosts_[i].display();
        add("ssh", host, false, outcome.error->what(), ssh_fix(outcome.error->what()));
        HostSurvey unreachable;
        unreachable.held_back = "its ssh check failed";
        for (const char* check : {"workdir", "version"})
          skip(check, host, unreachable.held_back);
        if (gpu_recipe()) skip("gpus", host, unreachable.held_back);
        if (cpu_recipe()) skip("blas", host, unreachable.held_back);
        surveys_.push_back(std::move(unreachable));
        continue;
      }
      for (auto& c : outcome.value->checks)
        checks_.push_back(std::move(c));
      surveys_.push_back(std::move(*outcome.value));
    }
  }

  // The fix for what the SSH connection's failure says: a host key, an authentication, or the
  // connection itself.
  static std::string ssh_fix(std::string_view failure) {
    // A key the known_hosts file revokes: no new key to accept, a host to look into.
    if (failure.find("IS REVOKED") != std::string_view::npos) {
      return "find out why the host offers a revoked key (a retired key still in use, or another "
             "machine at its address); once it has a new key, put that in known_hosts";
    }
    // A changed key is never accepted (--accept-new-host-keys takes new hosts only): the line
    // names the known_hosts entry to fix once the change is known to be expected.
    if (failure.find(" CHANGED: ") != std::string_view::npos) {
      return "find out why the host's key changed (a reinstall, or another machine at its "
             "address); if that is expected, delete the line of the known_hosts file the error "
             "names, then add the new key (ssh-keyscan -p PORT HOST)";
    }
    // Accepted (--accept-new-host-keys), but the known_hosts file takes no writes.
    if (failure.find("cannot record the host key") != std::string_view::npos) {
      return "make the known_hosts file (and its directory) writable, or give another "
             "--known-hosts";
    }
    if (failure.find("host key") != std::string_view::npos ||
        failure.find("HOST KEY") != std::string_view::npos) {
      return "put the host's key in known_hosts (ssh-keyscan), or give --accept-new-host-keys "
             "for a new host";
    }
    if (failure.find("authentication refused") != std::string_view::npos) {
      // A key file named that could not be used at all: authorizing it would not help.
      for (const char* unusable : {"(a public key, not", "(passphrase-protected", "(cannot be read",
                                   "(not a private key", "libssh cannot read)", " (missing)"}) {
        if (failure.find(unusable) != std::string_view::npos) {
          return "name a private key file (not its .pub) that needs no passphrase, or load the "
                 "key into ssh-agent (--identity, key= in the hostfile)";
        }
      }
      return "authorize the key on the host (ssh-copy-id), or name the right one (--identity, "
             "key= in the hostfile)";
    }
    if (names_unresolved(failure)) {
      return "check the host's name: this machine cannot resolve it (a typo, or a name DNS or "
             "/etc/hosts does not know)";
    }
    return "check the host is up and sshd listens on its port (port= in the hostfile)";
  }

  // Whether a failure says a name does not resolve (getaddrinfo's and libssh's words).
  static bool names_unresolved(std::string_view failure) {
    for (const char* says : {"resolve", "Name or service not known",
                             "Temporary failure in name resolution", "No address associated"}) {
      if (failure.find(says) != std::string_view::npos) return true;
    }
    return false;
  }

  // Ranks on this machine are started directly, by this binary, in the run directory: no work
  // directory is made or used here (provision and agents are for remote hosts).
  void survey_this_machine(const HostSpec& h, HostSurvey& s) const {
    s.checks.push_back(skipped_check("workdir", h.display(),
                                     "this machine starts its ranks directly and uses no workdir"));
    check_version(h, s);
    check_blas(h, s);
    if (!gpu_recipe()) return;
    if (local_gpu_missing_) {
      // One cause, one failure: the gpu check above already says this machine has none.
      s.checks.push_back(skipped_check("gpus", h.display(), "the gpu check found no CUDA device"));
      return;
    }
    try {
      // The survey's directory only has to exist: the current one, so nothing is created.
      s.facts = survey_host(*s.shell, h, fs::current_path().string());
    } catch (const Error& e) {
      if (is_stop(e)) throw;
      s.checks.push_back({"gpus", h.display(), false, e.what(), "fix what the line says"});
      return;
    }
    check_gpus(h, s);
  }

  void check_version(const HostSpec& h, HostSurvey& s) const {
    const std::string mine = "dptrain " DPTRAIN_VERSION;
    if (h.is_local()) {
      s.binary = options_.local_binary.string();
      s.checks.push_back({"version", h.display(), true, mine, ""});
      return;
    }
    std::string binary =
        options_.remote_binary.empty() ? s.facts.workdir + "/bin/dptrain" : options_.remote_binary;
    std::string version;
    int protocol = 0;  // the agent protocol it says it speaks (0: not said)
    std::string why;   // the loader's complaint, where it did not run for a missing library
    try {
      const auto r = s.shell->run(version_command(remote_path_word(binary)));
      if (r.exit_status == kVersionTimedOut) {
        s.checks.push_back(
            {"version", h.display(), false,
             fmt::format("dptrain at {} did not answer --version within {} s (it hangs as it "
                         "starts)",
                         binary, version_probe_seconds()),
             fmt::format("run '{} --version' on the host to see where it stops; install a "
                         "build that starts there",
                         binary)});
        s.held_back = "its dptrain does not answer";
        return;
      }
      version = r.exit_status == 0 ? version_line(r.out) : "";
      protocol = r.exit_status == 0 ? agent_protocol_of(r.out) : 0;
      if (version.empty()) why = loader_failure(r.err + "\n" + r.out);
    } catch (const Error& e) {
      if (is_stop(e)) throw;
      // No answer within the SSH command timeout (a host without timeout(1), or the connection
      // lost): the version is not known.
      s.checks.push_back({"version", h.display(), false,
                          fmt::format("dptrain at {}: --version did not complete: {}", binary,
                                      first_line(e.what())),
                          fmt::format("run '{} --version' on the host to see where it stops; "
                                      "check the host is up",
                                      binary)});
      s.held_back = "its version check failed";
      return;
    }
    if (version.empty()) {
      // A binary that is there but lacks a library (the loader's message): provisioning it
      // again would not help.
      if (!why.empty()) {
        s.checks.push_back({"version", h.display(), false,
                            fmt::format("dptrain at {} cannot start: {}", binary, why),
                            fmt::format("install the libraries it needs on the host ('ldd {}' "
                                        "there lists them)",
                                        binary)});
      } else {
        s.checks.push_back(
            {"version", h.display(), false, fmt::format("no dptrain that runs at {}", binary),
             options_.remote_binary.empty()
                 ? "install it: " + provision_command()
                 : "install it there, or name the right one with --remote-binary ('dptrain "
                   "provision' installs WORKDIR/bin/dptrain, the default)"});
      }
      s.held_back = "it has no dptrain that runs";
      return;
    }
    s.binary = binary;
    // One version in builds whose launcher and agents speak other protocols (a build from
    // before, or after, a change of the agent's lines): a job would refuse the host.
    const bool other_protocol = protocol != 0 && protocol != kAgentProtocol;
    const bool same = version == mine && !other_protocol;
    s.checks.push_back({"version", h.display(), same,
                        same ? version + another_build(*s.shell, binary)
                        : version == mine
                            ? fmt::format("{} there is another build, whose agent speaks "
                                          "protocol {} (this build's {}): it cannot run this "
                                          "machine's jobs",
                                          version, protocol, kAgentProtocol)
                            : fmt::format("{} there, {} here", version, mine),
                        same ? ""
                        : options_.remote_binary.empty()
                            ? "install this build: " + provision_command()
                            : "install this build there, or name it with --remote-binary"});
    // The probes run that binary: another build's answers would be about the wrong program.
    if (!same) s.held_back = "its dptrain is another build";
  }

  // ", another build than this machine's (sha256 ... there, ... here)" when `binary` on the host
  // is not this executable, byte for byte: the same version, built elsewhere or from other
  // sources (a development build, or a CPU and a CUDA build), which provision would replace. Not
  // a failure: a host may need a build of its own. Empty when they are the same, or where either
  // cannot be hashed (no sha256sum on the host).
  std::string another_build(HostShell& shell, const std::string& binary) const {
    if (local_sha256_.empty()) return {};
    SshSession::Result r;
    try {
      r = shell.run("sh -c " + shell_quote("sha256sum <" + remote_path_word(binary) +
                                           " 2>/dev/null | cut -c1-64"));
    } catch (const Error& e) {
      if (is_stop(e)) throw;
      // No answer (the command timeout while a large build is hashed, the connection lost):
      // the builds are not compared, and the version check stands.
      return {};
    }
    // The last line: start-up files of the account may print before it.
    std::string sum;
    std::istringstream lines(r.out);
    for (std::string line; std::getline(lines, line);)
      sum = line;
    if (r.exit_status != 0 || sum.size() != 64 || sum == local_sha256_) return {};
    return fmt::format(", another build than this machine's (sha256 {}... there, {}... here)",
                       sum.substr(0, 12), local_sha256_.substr(0, 12));
  }

  // The provision command a fix line gives, with the doctor's --workdir where it is not the
  // default (provision's must be the same) and `more` options after it.
  std::string provision_command(const std::string& more = "") const {
    const std::string workdir = options_.workdir == kDefaultWorkdir
                                    ? std::string()
                                    : " --workdir " + shell_quote(options_.workdir);
    return "dptrain provision --hosts ..." + workdir + more;
  }

  void check_gpus(const HostSpec& h, HostSurvey& s) const {
    if (!gpu_recipe()) return;
    const int gpus = static_cast<int>(s.facts.gpus.size());
    s.checks.push_back({"gpus", h.display(), gpus >= h.slots,
                        fmt::format("{} GPU(s) for {} slot(s){}", gpus, h.slots,
                                    s.facts.gpu_note.empty() ? "" : " (" + s.facts.gpu_note + ")"),
                        "give the host slots=<its GPU count>, or fix its driver"});
  }

  // CPU ranks load OpenBLAS as they start (dlopen): a host without it passes the version check,
  // and its ranks would fail there. `_probe blas` loads it as a rank does, in a process of its
  // own (here too: doctor itself does not keep OpenBLAS's threads).
  void check_blas(const HostSpec& h, HostSurvey& s) const {
    if (!cpu_recipe()) return;
    if (!s.held_back.empty()) {
      s.checks.push_back(skipped_check("blas", h.display(), s.held_back));
      return;
    }
    // With what a rank there would get from the launcher's environment (OPENBLAS_CORETYPE, ...):
    // the line names the kernels its ranks would use. Bounded as --version is: a binary that
    // answers that but hangs here fails this check, not the host's ssh.
    std::string command = bounded_command(remote_path_word(s.binary), "_probe blas");
    if (!h.is_local()) {
      std::vector<std::string> env = {"env"};
      for (const auto& [name, value] : forwarded_environment())
        env.push_back(name + "=" + value);
      command = shell_command(env) + " " + command;
    }
    const std::string fix =
        fmt::format("run '{} _probe blas' on the host to see where it stops", s.binary);
    SshSession::Result r;
    try {
      r = s.shell->run(command);
    } catch (const Error& e) {
      if (is_stop(e)) throw;
      s.checks.push_back({"blas", h.display(), false,
                          fmt::format("'_probe blas' did not complete: {}", first_line(e.what())),
                          fix});
      s.held_back = "its blas check did not complete";
      return;
    }
    if (r.exit_status == kVersionTimedOut) {
      s.checks.push_back({"blas", h.display(), false,
                          fmt::format("dptrain at {} did not finish '_probe blas' within {} s (it "
                                      "hangs)",
                                      s.binary, version_probe_seconds()),
                          fix});
      s.held_back = "its dptrain does not answer";
      return;
    }
    const bool ok = r.exit_status == 0;
    // Its one line comes last: a login shell's greeting may come before it.
    std::string detail = last_line(ok || r.err.empty() ? r.out : r.err);
    if (detail.starts_with(kErrorLinePrefix)) detail.erase(0, kErrorLinePrefix.size());
    if (detail.empty()) detail = fmt::format("'_probe blas' exited with status {}", r.exit_status);
    s.checks.push_back({"blas", h.display(), ok, detail,
                        "install OpenBLAS's runtime there (Debian: libopenblas0), or point "
                        "DPTRAIN_OPENBLAS_LIBRARY at it (GPU ranks do not need it: give doctor "
                        "the cuda recipe)"});
  }

  // Runs `_probe connect` on host i (in-process for this machine); "" when it connected.
  std::string probe_from(size_t i, const std::string& address) {
    if (hosts_[i].is_local()) {
      const auto [host, port] = parse_host_port(address);
      const auto attempt = connect_tcp(
          host, port,
          Clock::now() + std::chrono::milliseconds(static_cast<int>(kProbeSeconds * 1000)));
      return attempt.fd ? "" : attempt.failure;
    }
    // The binary as the other checks run it (a leading ~ is the host's home).
    const auto r = surveys_[i].shell->run(
        remote_path_word(surveys_[i].binary) + " " +
        shell_command({"_probe", "connect", address, fmt::format("{}", kProbeSeconds)}));
    if (r.exit_status == 0) return "";
    return last_line(r.err.empty() ? r.out : r.err);  // its own line, after any greeting
  }

  bool can_probe(size_t i) const { return surveys_[i].held_back.empty(); }

  // A skip line for every host that cannot run a check, with the reason.
  void skip_held_back(const std::string& check) {
    for (size_t i = 0; i < hosts_.size(); ++i) {
      if (!can_probe(i)) skip(check, hosts_[i].display(), surveys_[i].held_back);
    }
  }

  void check_store_port() {
    const auto skip_all = [this](const std::string& why) {
      for (const auto& h : hosts_)
        skip("store-port", h.display(), why);
    };
    try {
      master_addr_ = resolve_master_addr_for(hosts_);
    } catch (const Error& e) {
      // The store's address comes from a host's name that its ssh check found unresolvable
      // already: one problem, one FAIL line.
      for (size_t i = 0; i < hosts_.size(); ++i) {
        if (options_.master_addr.empty() && !can_probe(i) &&
            std::string_view(e.what()).find("'" + hosts_[i].host + "'") != std::string::npos) {
          skip_all(fmt::format("no store address: it would be {}'s, whose ssh check failed",
                               hosts_[i].host));
          return;
        }
      }
      add("store-port", "", false, e.what(),
          options_.master_addr.empty() ? "pass --master-addr (an address of this machine the "
                                         "hosts reach)"
                                       : "correct --master-addr");
      skip_all("no store address (see the line above)");
      return;
    }
    UniqueFd listener;
    try {
      listener = listen_tcp(master_addr_, options_.master_port);
    } catch (const Error& e) {
      add("store-port", "", false, e.what(),
          names_unresolved(e.what())
              ? "correct --master-addr: give an address of this machine, or a name it resolves"
          : options_.master_port == 0
              // Any free port was asked for: the address is what cannot be used.
              ? "give --master-addr an address of this machine"
              : "choose another --master-port (or free that one), or another --master-addr");
      skip_all("the store cannot listen (see the line above)");
      return;
    }
    const std::string address = format_host_port(master_addr_, local_port(listener.get()));
    std::vector<std::string> failures(hosts_.size());
    {
      std::vector<std::jthread> probes;
      for (size_t i = 0; i < hosts_.size(); ++i) {
        if (!can_probe(i)) continue;
        probes.emplace_back([&, i] { failures[i] = probe_from(i, address); });
      }
    }
    skip_held_back("store-port");
    for (size_t i = 0; i < hosts_.size(); ++i) {
      if (!can_probe(i)) continue;
      const bool ok = failures[i].empty();
      add("store-port", hosts_[i].display(), ok,
          ok ? fmt::format("reaches the store address {}", address)
             : fmt::format("cannot reach the store at {}: {}", address, failures[i]),
          fmt::format("open TCP {} to {} (firewall), or pass a --master-addr it can reach", address,
                      hosts_[i].host));
    }
  }

  std::string resolve_master_addr_for(const std::vector<HostSpec>& hosts) const {
    JobSpec spec;
    spec.hosts = hosts;
    spec.remote.master_addr = options_.master_addr;
    return resolve_master_addr(spec);
  }

  // Each host listens on a free port; every other host must reach it (Gloo's transport uses such
  // ports between every pair of ranks).
  void check_peer_ports() {
    if (hosts_.size() < 2) {
      skip("peer-port", "", "one host: no rank connects to another host");
      return;
    }
    struct Listener {
      std::unique_ptr<SshSession> session;
      std::unique_ptr<SshChannel> channel;
      UniqueFd local;
      std::string address;
      std::string failure;     // why it does not listen
      bool timed_out = false;  // no port said in time: a slow start, not a refusal
    };
    std::vector<Listener> listeners(hosts_.size());
    // Each host's listener is started and waited for on a thread of its own: slow hosts wait
    // together, not one after another.
    const auto start_listener = [&](size_t j) {
      Listener& l = listeners[j];
      try {
        if (hosts_[j].is_local()) {
          l.local = listen_tcp("0.0.0.0", 0);
          l.address = format_host_port(master_addr_, local_port(l.local.get()));
          return;
        }
        l.session = SshSession::connect(hosts_[j], ssh_);
        l.channel = l.session->start(remote_path_word(surveys_[j].binary) + " _probe listen");
        // Its "port N" line, after whatever a login shell prints first.
        std::string out;
        unsigned port = 0;
        const auto said_port = [&] {
          std::istringstream lines(out);
          for (std::string line; std::getline(lines, line);) {
            if (!lines.eof() && std::sscanf(line.c_str(), "port %u", &port) == 1) return true;
          }
          return false;
        };
        // As long as --version may take there: a loaded host starts the binary slowly.
        const int wait_s = version_probe_seconds();
        const auto deadline = Clock::now() + std::chrono::seconds(wait_s);
        while (!said_port() && Clock::now() < deadline &&
               l.channel->read([&](std::string_view d, bool) { out.append(d); },
                               std::chrono::milliseconds(200))) {
        }
        if (said_port()) {
          l.address = format_host_port(hosts_[j].host, static_cast<uint16_t>(port));
        } else {
          l.timed_out = Clock::now() >= deadline;
          l.failure = l.timed_out
                          ? fmt::format("'dptrain _probe listen' said no port within {} s{}",
                                        wait_s, out.empty() ? "" : "; it said: " + last_line(out))
                      : out.empty() ? std::string("'dptrain _probe listen' ended saying nothing")
                                    : "'dptrain _probe listen' said: " + last_line(out);
        }
      } catch (const Error& e) {
        l.failure = e.what();
      }
    };
    {
      std::vector<std::jthread> starts;
      for (size_t j = 0; j < hosts_.size(); ++j) {
        if (can_probe(j)) starts.emplace_back(start_listener, j);
      }
    }
    std::vector<std::vector<std::string>> failures(hosts_.size(),
                                                   std::vector<std::string>(hosts_.size()));
    {
      std::vector<std::jthread> probes;
      for (size_t i = 0; i < hosts_.size(); ++i) {
        if (!can_probe(i)) continue;
        probes.emplace_back([&, i] {
          for (size_t j = 0; j < hosts_.size(); ++j) {
            if (i != j && !listeners[j].address.empty()) {
              failures[i][j] = probe_from(i, listeners[j].address);
            }
          }
        });
      }
    }
    for (auto& l : listeners) {
      if (l.channel) l.channel->close_stdin();
    }
    skip_held_back("peer-port");
    for (size_t j = 0; j < hosts_.size(); ++j) {
      if (can_probe(j) && listeners[j].address.empty()) {
        const Listener& l = listeners[j];
        add("peer-port", hosts_[j].display(), false,
            l.timed_out ? fmt::format("no answer from the port probe: {}", l.failure)
                        : fmt::format("cannot listen on a free port there: {}", l.failure),
            l.timed_out ? "see what slows the host (its load, its disk), then run doctor again"
                        : "check that the host lets a process listen on TCP ports");
      }
    }
    for (size_t i = 0; i < hosts_.size(); ++i) {
      for (size_t j = 0; j < hosts_.size(); ++j) {
        if (i == j || !can_probe(i) || listeners[j].address.empty()) continue;
        const std::string pair = hosts_[i].display() + " -> " + hosts_[j].display();
        const bool ok = failures[i][j].empty();
        add("peer-port", pair, ok,
            ok ? fmt::format("reaches {}", listeners[j].address)
               : fmt::format("cannot reach {}: {}", listeners[j].address, failures[i][j]),
            fmt::format("allow TCP on all ports from {} to {} (ranks connect on ephemeral ports)",
                        hosts_[i].host, hosts_[j].host));
      }
    }
  }

  void check_data_on_hosts() {
    if (!recipe_ || recipe_->data.type != "csv") return;
    const fs::path path = recipe_->data.path;
    // The launcher's file, as each host's agent checks its copy against it (none where this
    // machine lacks it: the hosts may hold the only copies).
    std::error_code ec;
    std::string here;
    try {
      if (fs::is_regular_file(path, ec)) here = sha256_file(path);
    } catch (const Error&) {
      // Unreadable here: the recipe check says so; the hosts' copies are not compared.
    }
    for (size_t i = 0; i < hosts_.size(); ++i) {
      if (hosts_[i].is_local()) continue;
      if (!surveys_[i].shell || surveys_[i].facts.workdir.empty()) {
        skip("data", hosts_[i].display(), surveys_[i].held_back);
        continue;
      }
      const std::string provisioned =
          surveys_[i].facts.workdir + "/data/" + path.filename().string();
      // The file the agent would use (the recipe's path, else the provisioned copy), then its
      // sha256 where the host has sha256sum (read from stdin: a name with a backslash would be
      // escaped in its output); in sh, whatever the user's login shell is.
      const std::string script = fmt::format(
          "for f in {} {}; do if test -r \"$f\"; then printf '%s\\n' \"$f\"; "
          "sha256sum <\"$f\" 2>/dev/null | cut -c1-64; exit 0; fi; done; exit 1",
          shell_quote(path.string()), shell_quote(provisioned));
      const auto r = surveys_[i].shell->run("sh -c " + shell_quote(script));
      const std::string provision =
          provision_command(" --recipe " + shell_quote(options_.recipe.string()));
      const std::string fix = "copy it there: " + provision;
      if (r.exit_status != 0) {
        add("data", hosts_[i].display(), false,
            fmt::format("data file {} not found (looked at {} and {})", path.filename().string(),
                        path.string(), provisioned),
            fix);
        continue;
      }
      // The last two lines: start-up files of the account may print before them.
      std::vector<std::string> out_lines;
      std::istringstream lines(r.out);
      for (std::string line; std::getline(lines, line);)
        out_lines.push_back(line);
      std::string found, sum;
      if (out_lines.size() >= 2 && out_lines.back().size() == 64) {
        found = out_lines[out_lines.size() - 2];
        sum = out_lines.back();
      } else if (!out_lines.empty()) {
        found = out_lines.back();  // no sha256sum there: the name alone
      }
      const bool differs = !here.empty() && sum.size() == 64 && sum != here;
      add("data", hosts_[i].display(), !differs,
          differs ? fmt::format("{} is not the launcher's data file (sha256 {}..., the "
                                "launcher's {}...): its ranks would refuse it",
                                found, sum.substr(0, 12), here.substr(0, 12))
          : sum.size() == 64 || here.empty()
              ? fmt::format("{} is there", path.filename().string())
              : fmt::format("{} is there (not compared with the launcher's: no sha256sum there)",
                            path.filename().string()),
          differs ? "put the same file there, or copy the launcher's again: " + provision : fix);
    }
  }

  void check_allreduce_unless_off() {
    if (options_.allreduce) {
      check_allreduce();
    } else {
      skip("allreduce", "", "--no-allreduce");
    }
  }

  void check_allreduce() {
    if (any_failed()) {
      skip("allreduce", "", "fix the failures above first");
      return;
    }
    JobSpec spec;
    spec.hosts = hosts_;
    spec.world_size = world_;
    spec.recipe = tiny_recipe();
    spec.backend = spec.recipe.distributed.backend;
    spec.worker_binary = options_.local_binary;
    spec.remote.ssh = options_.ssh;
    spec.remote.workdir = options_.workdir;
    spec.remote.remote_binary = options_.remote_binary;
    spec.remote.master_addr = options_.master_addr;
    const auto t0 = Clock::now();
    JobOutcome outcome;
    std::string remote_name;  // the run's directory on the remote hosts: WORKDIR/runs/NAME
    fs::path dir;  // the trial run's directory, new and empty: a failed trial's stays for its logs
    try {
      dir = make_temp_directory("dptrain-doctor");
      RunDirectory run = RunDirectory::create(dir, "", spec.recipe.name);
      remote_name = run.remote_name();
      std::FILE* sink = std::fopen("/dev/null", "w");
      {
        StatusPrinter quiet(sink, false);
        outcome = run_job(run, spec, quiet);
      }
      std::fclose(sink);
    } catch (const Error& e) {
      outcome.exit_code = exit_code(e.kind());
      outcome.error = e.what();
    }
    const bool ok = outcome.exit_code == 0;
    if (!ok && pending_stop_signal() != 0) {
      // Stopped, not failed: its directories say nothing worth keeping.
      remove_trial_run(dir, remote_name);
      return;
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
    std::string fix = "see the line above; 'dptrain launch --dry-run' shows what was started where";
    if (ok) {
      remove_trial_run(dir, remote_name);
    } else if (std::error_code ec; !dir.empty() && fs::exists(dir / "logs", ec)) {
      // The ranks' logs say why: the run directories stay for them (see dptrain-doctor(1)).
      fix += fmt::format("; the ranks' logs are in {}/logs", dir.string());
      const bool remote_hosts = std::any_of(hosts_.begin(), hosts_.end(),
                                            [](const HostSpec& h) { return !h.is_local(); });
      if (!remote_name.empty() && remote_hosts) {
        fix += fmt::format(" and, on each remote host, WORKDIR/runs/{}/logs", remote_name);
      }
    } else if (!dir.empty()) {
      fs::remove_all(dir, ec);  // failed before any rank logged: nothing worth keeping
    }
    add("allreduce", "", ok,
        ok ? fmt::format("{} rank(s) on {} host(s) met and all-reduced in {:.1f}s", world_,
                         hosts_.size(), seconds)
           : first_line(outcome.error),
        fix);
  }

  // The trial job's run directories: here, and WORKDIR/runs/NAME on every remote host.
  void remove_trial_run(const fs::path& dir, const std::string& remote_name) {
    std::error_code ec;
    fs::remove_all(dir, ec);
    if (remote_name.empty()) return;
    std::vector<std::jthread> removals;
    for (size_t i = 0; i < hosts_.size(); ++i) {
      if (hosts_[i].is_local() || !surveys_[i].shell) continue;
      removals.emplace_back([this, i, &remote_name] {
        try {
          const HostFacts& f = surveys_[i].facts;
          std::string command = "rm -rf " + shell_quote(f.workdir + "/runs/" + remote_name);
          // A workdir that was not there: the directories the trial made for it go too (each
          // left empty, up to the one that was there).
          if (!f.workdir_base.empty()) {
            command += "; d=" + shell_quote(f.workdir + "/runs") +
                       "; while [ \"$d\" != " + shell_quote(f.workdir_base) +
                       " ] && rmdir -- \"$d\" 2>/dev/null; do d=$(dirname -- \"$d\"); done";
          }
          surveys_[i].shell->run(command);
        } catch (const Error&) {
          // A host that went away keeps its directory; the check itself passed.
        }
      });
    }
  }

  Recipe tiny_recipe() const {
    Recipe r;
    r.name = "doctor";
    r.model.input = 4;
    r.model.hidden = {4};
    r.model.classes = 2;
    r.data.samples = std::max<int64_t>(64, 4 * world_);
    r.data.eval_fraction = 0.25;
    r.train.steps = 2;
    r.train.batch_per_rank = 1;
    r.checkpoint.every = 0;
    r.checkpoint.keep = 1;
    r.eval.every = 0;
    r.log.every = 1;
    r.distributed.timeout_s = 30;
    if (recipe_) r.distributed.backend = recipe_->distributed.backend;
    return r;
  }

  const std::vector<HostSpec>& hosts_;
  const DoctorOptions& options_;
  int world_ = 0;
  SshOptions ssh_;                       // the checks' own: a stop cuts their commands short
  std::atomic<bool> surveying_ = false;  // while the hosts are surveyed
  std::optional<Recipe> recipe_;
  bool local_gpu_missing_ = false;  // the gpu check failed: this machine has no CUDA device
  std::string local_sha256_;        // this executable's, when a host is remote ("" unreadable)
  std::vector<HostSurvey> surveys_;
  std::string master_addr_;
  std::vector<DoctorCheck> checks_;
};

}  // namespace

std::vector<DoctorCheck> run_doctor(const std::vector<HostSpec>& hosts,
                                    const DoctorOptions& options) {
  Doctor doctor(hosts, options);
  return doctor.run();
}

}  // namespace dptrain
