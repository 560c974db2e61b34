// The subcommand table: each cli/*_cmd.cpp binds its options to a CLI11 subcommand.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

namespace dptrain::cli {

// What the chosen subcommand's callback reports back to main.
struct Outcome {
  int exit_code = 0;
  bool json = false;  // errors are also printed as a JSON object on stdout
  // Run by main after it printed the outcome (an error's line), just before it exits: a worker
  // that failed to start tells its peers why, out of the way of its own message.
  std::function<void()> finally;
  // The run directory a failed command made (launch's, whose name it chose): its JSON error
  // names it, as the events stream's run_finished does.
  std::string run_dir;
  // The warnings a command gave (on stderr) before it failed: its JSON error carries them, as
  // its JSON would have on success.
  std::vector<std::string> warnings;
};

struct Subcommand {
  const char* name;
  const char* summary;
  void (*setup)(CLI::App& app, Outcome& outcome);
};

void setup_launch(CLI::App& app, Outcome& outcome);
void setup_resume(CLI::App& app, Outcome& outcome);
void setup_ckpt(CLI::App& app, Outcome& outcome);
void setup_recipe(CLI::App& app, Outcome& outcome);
void setup_data(CLI::App& app, Outcome& outcome);
void setup_sample(CLI::App& app, Outcome& outcome);
void setup_bench(CLI::App& app, Outcome& outcome);
void setup_bench_comm(CLI::App& app, Outcome& outcome);   // bench comm (cli/bench_comm.cpp)
void setup_bench_train(CLI::App& app, Outcome& outcome);  // bench train (cli/bench_train.cpp)
void setup_report(CLI::App& app, Outcome& outcome);
void setup_status(CLI::App& app, Outcome& outcome);
void setup_worker(CLI::App& app, Outcome& outcome);
// A rank's SIGTERM (stop at the next step boundary, after a checkpoint) and SIGPIPE handling:
// installed by main before anything else for `dptrain worker`, so that a SIGTERM in a rank's
// first milliseconds is a stop like any other, not its death.
void install_worker_signal_handlers();
void setup_provision(CLI::App& app, Outcome& outcome);
void setup_agent(CLI::App& app, Outcome& outcome);
void setup_relay(CLI::App& app, Outcome& outcome);
void setup_doctor(CLI::App& app, Outcome& outcome);
void setup_probe(CLI::App& app, Outcome& outcome);

// Marks an option whose command handles an empty value itself: it means something (sample's
// --prompt '') or gets a message of its own (data prepare's --text ''). main refuses an empty
// value for every other option, which CLI11 would read as 0, or as not given.
inline constexpr const char* kHandlesEmpty = "handles-empty";
inline CLI::Validator handles_empty() {
  return CLI::Validator([](std::string&) { return std::string(); }, "", kHandlesEmpty);
}

inline const std::vector<Subcommand>& subcommands() {
  static const std::vector<Subcommand> table = {
      {"launch", "Start a training run from a recipe on local ranks or on hosts over SSH",
       setup_launch},
      {"resume", "Continue a run from its newest valid checkpoint", setup_resume},
      {"ckpt", "List a run's checkpoints, or verify their checksums", setup_ckpt},
      {"recipe", "Validate a recipe or show it with every default filled in", setup_recipe},
      {"data", "Prepare a token dataset from text files for the gpt model", setup_data},
      {"sample", "Generate text from a gpt run's checkpoint", setup_sample},
      {"status", "Where a run stands: running or ended, step, checkpoint, restarts", setup_status},
      {"report", "Write a run's HTML report (loss, throughput, restarts) and a summary",
       setup_report},
      {"bench", "Benchmark collectives (nccl-tests style) or a recipe's training scaling",
       setup_bench},
      {"worker", "Run one rank (started by launch, or by hand / another scheduler)", setup_worker},
      {"provision", "Check hosts over SSH and install dptrain, a recipe and files on them",
       setup_provision},
      {"agent", "Run the ranks of one node for a launcher (started over SSH)", setup_agent},
      {"doctor", "Check hosts (and a recipe) before a job; one line per problem, with a fix",
       setup_doctor},
      {"_probe", "Internal: the network probes doctor runs on hosts", setup_probe},
      {"_relay", "Internal: the launcher's end of one host's SSH connection", setup_relay},
  };
  return table;
}

}  // namespace dptrain::cli
