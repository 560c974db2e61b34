// dptrain's entry point: dispatches to a subcommand and maps errors to exit codes.
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/json_errors.hpp"
#include "core/error.hpp"
#include "core/suggest.hpp"

namespace {

void print_error(const std::string& message, int code, const char* status, bool json) {
  dptrain::cli::print_error_lines(message);
  if (json) {
    nlohmann::json out = {{"status", status}};
    dptrain::cli::add_failure(out, code, message);
    std::printf("%s\n", out.dump().c_str());
  }
}

// "dptrain ckpt verify --help" for the deepest subcommand named at the start of the arguments.
std::string help_command(const CLI::App& app, int argc, char** argv) {
  std::string command = "dptrain";
  const CLI::App* current = &app;
  for (int i = 1; i < argc; ++i) {
    const auto subs = current->get_subcommands([](const CLI::App*) { return true; });
    const auto named = std::find_if(subs.begin(), subs.end(),
                                    [&](const CLI::App* s) { return s->get_name() == argv[i]; });
    if (named == subs.end()) break;
    command += " " + (*named)->get_name();
    current = *named;
  }
  return command + " --help";
}

}  // namespace

int main(int argc, char** argv) {
  if (argc > 1 && std::string_view(argv[1]) == "worker")
    dptrain::cli::install_worker_signal_handlers();
  // A launcher starts its ranks with SIGTERM blocked (ProcessSpec::hold_sigterm): one that came
  // while this process loaded is delivered now, to the handler just installed.
  sigset_t held;
  sigemptyset(&held);
  sigaddset(&held, SIGTERM);
  sigprocmask(SIG_UNBLOCK, &held, nullptr);
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
    const std::string help = help_command(app, argc, argv);
    if (argc > 1 && argv[1][0] != '-') {
      std::vector<std::string> known;
      for (const auto& cmd : dptrain::cli::subcommands())
        known.emplace_back(cmd.name);
      if (std::find(known.begin(), known.end(), argv[1]) == known.end()) {
        const auto close = dptrain::closest_match(argv[1], known);
        message = fmt::format("unknown command '{}'{}", argv[1],
                              close ? fmt::format(" (did you mean '{}'?)", *close) : "");
      }
    }
    print_error(message, 2, "error", json);
    std::fprintf(stderr, "dptrain: see '%s'\n", help.c_str());
    return 2;
  } catch (const dptrain::Error& e) {
    const int code = dptrain::exit_code(e.kind());
    print_error(e.what(), code, dptrain::cli::failure_status(e.kind()), outcome.json);
    return code;
  } catch (const std::exception& e) {
    print_error(fmt::format("internal error: {}", e.what()), 1, "error", outcome.json);
    return 1;
  }
  return outcome.exit_code;
}
