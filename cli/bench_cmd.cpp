// `dptrain bench comm|train`: collective and training benchmarks.
#include "cli/commands.hpp"

namespace dptrain::cli {

void setup_bench(CLI::App& app, Outcome& outcome) {
  app.require_subcommand(1);
  setup_bench_comm(
      *app.add_subcommand("comm", "Collective bandwidth, nccl-tests style (allreduce, ...)"),
      outcome);
  setup_bench_train(
      *app.add_subcommand("train", "Training throughput and scaling of a recipe per world size"),
      outcome);
}

}  // namespace dptrain::cli
