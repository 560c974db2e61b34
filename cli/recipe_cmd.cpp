// `dptrain recipe validate|show RECIPE`.
#include <cstdio>
#include <filesystem>
#include <memory>
#include <string>
#include <system_error>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.hpp"
#include "cli/json_errors.hpp"
#include "cli/run_report.hpp"
#include "core/error.hpp"
#include "core/json_error.hpp"
#include "core/model/model.hpp"
#include "core/recipe.hpp"
#include "core/trainer.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

namespace {

struct RecipeOptions {
  std::string recipe;
  bool json = false;
};

// load_recipe, answering a stop signal as a stop (130 or 143, with its JSON): one cuts short a
// read that waits (a recipe from a pipe that never writes), one that came as the recipe or its
// data was checked ends the command when that is done.
Recipe load_stoppable(const std::string& file, DataCheck check) {
  install_stop_signal_handlers();
  exit_on_second_interrupt();  // a scan of a large CSV file looks for the stop only at its end
  Recipe r = read_or_stop(file, "", [&] { return load_recipe(file, check); });
  if (const int sig = pending_stop_signal()) throw stop_error(sig, printable(file) + ": ", "");
  return r;
}

// load_recipe, every row of a CSV dataset checked as a launch would load it, then what the model
// says of the other settings (check_levers), named by file.
Recipe checked_recipe(const std::string& file) {
  Recipe r = load_stoppable(file, DataCheck::every_row);
  try {
    check_levers(r);
  } catch (const Error& e) {
    throw Error(e.kind(), file + ": " + e.what());
  }
  return r;
}

// What validate and show --json say of a valid recipe, with the fields of a success.
nlohmann::json recipe_facts(const Recipe& r) {
  const auto model = make_model(r.model);
  nlohmann::json out = {{"name", r.name},
                        {"hash", recipe_hash(r)},
                        {"model", model->describe()},
                        {"parameters", model->num_params()}};
  add_success(out);
  return out;
}

// What a valid recipe leaves to the launch to refuse: a token dataset that is not there (yet to
// be made, or on the training hosts only). Each is also printed on stderr. (validate and show.)
std::vector<std::string> validate_warnings(const std::string& file, const Recipe& r) {
  std::vector<std::string> warnings;
  std::error_code ec;
  if (r.data.type == "tokens" && !std::filesystem::exists(r.data.path, ec)) {
    // Not there, or not known to be (a folder above it this user may not search).
    warnings.push_back(printable(fmt::format(
        "{}: /data/path: \"{}\" {}: a launch needs it on every host that runs ranks (make it "
        "with `dptrain data prepare`)",
        file, r.data.path,
        ec ? "cannot be checked here (" + ec.message() + ")" : std::string("is not there"))));
  }
  for (const auto& w : warnings)
    std::fprintf(stderr, "dptrain: warning: %s\n", w.c_str());
  return warnings;
}

int run_validate(const RecipeOptions& o) {
  if (!o.json) {
    const Recipe r = checked_recipe(o.recipe);
    validate_warnings(o.recipe, r);
    std::printf("%s: ok (recipe '%s', hash %s)\nmodel: %s\n", printable(o.recipe).c_str(),
                printable(r.name).c_str(), recipe_hash(r).c_str(),
                make_model(r.model)->describe().c_str());
    return 0;
  }
  nlohmann::json out;
  int code = 0;
  try {
    const Recipe r = checked_recipe(o.recipe);
    out = recipe_facts(r);
    out["valid"] = true;
    out["warnings"] = validate_warnings(o.recipe, r);
  } catch (const Error& e) {
    // Not valid, whatever the kind (a file that cannot be read, a stop while a pipe is read):
    // a script reads "valid" on every answer.
    const ErrorKind kind = kind_after_stop(e.kind());
    code = exit_code(kind);
    out = {
        {"valid", false}, {"status", failure_status(kind)}, {"warnings", nlohmann::json::array()}};
    add_failure(out, code, e.what());
    print_error_lines(e.what());
  }
  std::printf("%s\n", json_text(out).c_str());
  return code;
}

}  // namespace

void setup_recipe(CLI::App& app, Outcome& outcome) {
  app.require_subcommand(1);
  auto o = std::make_shared<RecipeOptions>();
  CLI::App* validate =
      app.add_subcommand("validate", "Check a recipe; exit 2 listing every problem");
  validate->add_option("recipe", o->recipe, "Recipe JSON file")->required();
  validate->add_flag("--json", o->json, "Print {\"valid\", \"errors\", ...} on stdout");
  validate->callback([o, &outcome] {
    outcome.json = o->json;  // a file that cannot be read still answers in JSON
    outcome.exit_code = run_validate(*o);
  });

  CLI::App* show = app.add_subcommand("show", "Print the resolved recipe, every default filled in");
  show->add_option("recipe", o->recipe, "Recipe JSON file")->required();
  show->add_flag("--json", o->json,
                 "Print {\"recipe\", \"name\", \"hash\", \"model\", \"parameters\", ...} on stdout "
                 "as one line");
  show->callback([o, &outcome] {
    outcome.json = o->json;  // a recipe that does not load answers in JSON too
    const Recipe r = load_stoppable(o->recipe, DataCheck::first_row);
    const auto warnings = validate_warnings(o->recipe, r);  // as validate gives them
    if (o->json) {
      nlohmann::json out = recipe_facts(r);
      out["recipe"] = to_json(r);
      out["warnings"] = warnings;
      std::printf("%s\n", json_text(out).c_str());
      outcome.exit_code = 0;
      return;
    }
    std::printf("%s\n", json_text(to_json(r), 2).c_str());
    // stdout stays the resolved recipe alone (it parses back); the model's size goes beside it.
    std::fprintf(stderr, "model: %s\n", make_model(r.model)->describe().c_str());
    outcome.exit_code = 0;
  });
}

}  // namespace dptrain::cli
