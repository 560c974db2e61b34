// dptrain's entry point: dispatches to a subcommand and maps errors to exit codes.
#include <algorithm>
#include <cstdio>
#include <sstream>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "core/error.hpp"
#include "core/suggest.hpp"

namespace {

void print_error(const std::string& message, int code, bool json) {
  std::istringstream lines(message);
  std::string line;
  nlohmann::json errors = nlohmann::json::array();
  while (std::getline(lines, line)) {
    // Continuation lines (indented log excerpts) are printed as they are.
    if (!line.empty() && line[0] == ' ') {
      std::fprintf(stderr, "%s\n", line.c_str());
    } else {
      std::fprintf(stderr, "dptrain: error: %s\n", line.c_str());
      errors.push_back(line);
    }
  }
  if (json) {
    const nlohmann::json out = {{"status", "error"}, {"exit_code", code}, {"errors", errors}};
    std::printf("%s\n", out.dump().c_str());
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "dptrain: data-parallel training from a JSON recipe, on CPU ranks (Gloo) or one NVIDIA GPU\n"
      "per rank (NCCL), on this machine or across hosts over SSH.\n"
      "Exit codes: 0 ok, 1 internal, 2 usage/recipe, 3 rank failed, 4 ssh, 5 checkpoint,\n"
      "6 benchmark below threshold, 130 SIGINT, 143 SIGTERM. See dptrain(1).",
      "dptrain"};
  app.set_version_flag("-V,--version", "dptrain " DPTRAIN_VERSION);
  app.require_subcommand(1);
  app.fallthrough(false);
  dptrain::cli::Outcome outcome;
  for (const auto& cmd : dptrain::cli::subcommands()) {
    CLI::App* sub = app.add_subcommand(cmd.name, cmd.summary);
    cmd.setup(*sub, outcome);
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // The callbacks that set outcome.json have not run: a script that asked for JSON gets it.
    bool json = false;
    for (int i = 1; i < argc; ++i)
      json = json || std::string_view(argv[i]) == "--json";
    std::string message = e.what();
    std::string help = "dptrain --help";
    if (argc > 1 && argv[1][0] != '-') {
      std::vector<std::string> known;
      for (const auto& cmd : dptrain::cli::subcommands())
        known.emplace_back(cmd.name);
      if (std::find(known.begin(), known.end(), argv[1]) == known.end()) {
        const auto close = dptrain::closest_match(argv[1], known);
        message = fmt::format("unknown command '{}'{}", argv[1],
                              close ? fmt::format(" (did you mean '{}'?)", *close) : "");
      } else {
        help = fmt::format("dptrain {} --help", argv[1]);
      }
    }
    print_error(message, 2, json);
    std::fprintf(stderr, "dptrain: see '%s'\n", help.c_str());
    return 2;
  } catch (const dptrain::Error& e) {
    const int code = dptrain::exit_code(e.kind());
    print_error(e.what(), code, outcome.json);
    return code;
  } catch (const std::exception& e) {
    print_error(fmt::format("internal error: {}", e.what()), 1, outcome.json);
    return 1;
  }
  return outcome.exit_code;
}
