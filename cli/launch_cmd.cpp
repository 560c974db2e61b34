// `dptrain launch RECIPE`: start a run on local ranks.
#include <cstdio>
#include <memory>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "cli/run_report.hpp"
#include "core/error.hpp"
#include "core/recipe.hpp"
#include "core/trainer.hpp"
#include "launch/job.hpp"
#include "launch/run_dir.hpp"
#include "launch/status.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

namespace {

struct LaunchOptions {
  std::string recipe;
  int nproc = 1;
  std::string run_dir;
  std::string runs_root = "runs";
  std::string backend;  // empty: the recipe's distributed.backend
  bool json = false;
};

int run_launch(const LaunchOptions& o) {
  install_stop_signal_handlers();
  JobSpec spec;
  spec.recipe = load_recipe(o.recipe);
  if (o.nproc < 1) {
    throw Error(ErrorKind::usage, fmt::format("--nproc: must be >= 1, got {}", o.nproc));
  }
  spec.world_size = o.nproc;
  spec.backend = o.backend.empty() ? spec.recipe.distributed.backend : o.backend;
  resolve_backend(spec.backend);  // refuse an unavailable backend before creating anything
  check_runnable(spec.recipe, spec.world_size);
  spec.worker_binary = self_executable();
  RunDirectory run = RunDirectory::create(o.run_dir, o.runs_root, spec.recipe.name);
  run.info()["recipe_file"] = std::filesystem::absolute(o.recipe).string();
  std::FILE* status_out = o.json ? stderr : stdout;
  StatusPrinter status(status_out, StatusPrinter::is_terminal(status_out));
  status.line(fmt::format("dptrain {}: {} on {} local rank(s), run directory {}", DPTRAIN_VERSION,
                          spec.recipe.name, spec.world_size, run.path().string()));
  const JobOutcome outcome = run_local_job(run, spec, status);
  return report_outcome(run, outcome, o.json);
}

}  // namespace

void setup_launch(CLI::App& app, Outcome& outcome) {
  auto o = std::make_shared<LaunchOptions>();
  app.add_option("recipe", o->recipe, "Recipe JSON file")->required();
  app.add_option("-n,--nproc", o->nproc, "Number of local ranks (processes)")
      ->capture_default_str();
  app.add_option("--run-dir", o->run_dir,
                 "Run directory (default: RUNS_ROOT/<name>-<UTC time>); must not hold a run");
  app.add_option("--runs-root", o->runs_root, "Where new run directories are made")
      ->capture_default_str();
  app.add_option("--backend", o->backend,
                 "Collective backend: auto or gloo (default: the recipe's distributed.backend)");
  app.add_flag("--json", o->json, "Print one JSON object with the outcome on stdout");
  app.callback([o, &outcome] {
    outcome.json = o->json;
    outcome.exit_code = run_launch(*o);
  });
}

}  // namespace dptrain::cli
