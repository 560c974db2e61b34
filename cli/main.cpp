// dptrain's entry point: dispatches to a subcommand and maps errors to exit codes.
#include <poll.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <new>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/env.hpp"
#include "cli/json_errors.hpp"
#include "cli/run_report.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"
#include "core/suggest.hpp"
#include "launch/agent.hpp"
#include "launch/elastic.hpp"
#include "launch/relay.hpp"
#include "launch/supervisor.hpp"

namespace {

namespace fs = std::filesystem;

void print_error(const std::string& message, int code, const char* status, bool json,
                 const std::string& run_dir = "", nlohmann::json out = nlohmann::json::object()) {
  dptrain::cli::print_error_lines(message);
  if (json) {
    out["status"] = status;
    if (!run_dir.empty()) out["run_dir"] = run_dir;
    dptrain::cli::add_failure(out, code, message);
    std::printf("%s\n", dptrain::json_text(out).c_str());
  }
}

// The deepest subcommand named at the start of the arguments ("dptrain ckpt verify"), and the
// index of the first argument after its name.
struct Command {
  const CLI::App* app;
  std::string name;
  int next;
};

Command named_command(const CLI::App& app, int argc, char** argv) {
  Command c{&app, "dptrain", 1};
  for (; c.next < argc; ++c.next) {
    const auto subs = c.app->get_subcommands([](const CLI::App*) { return true; });
    const auto named = std::find_if(
        subs.begin(), subs.end(), [&](const CLI::App* s) { return s->get_name() == argv[c.next]; });
    if (named == subs.end()) break;
    c.name += " " + (*named)->get_name();
    c.app = *named;
  }
  return c;
}

// A launch or resume refused at its options (one CLI11 could not convert) still ends the
// --events stream it was given with run_finished, as one refused later does.
void end_refused_events(const Command& c, int argc, char** argv, bool json,
                        const std::string& message) {
  if (c.name != "dptrain launch" && c.name != "dptrain resume") return;
  dptrain::cli::RestartOptions restart;
  bool dry_run = false;
  for (int i = c.next; i < argc; ++i) {
    const std::string_view arg = argv[i];
    if (arg == "--") break;  // what follows is no option
    if (arg == "--events" && i + 1 < argc) restart.events = argv[i + 1];
    if (arg.starts_with("--events=")) restart.events = std::string(arg.substr(9));
    // --dry-run, or CLI11's --dry-run=VALUE (the last one given counts).
    if (arg == "--dry-run") dry_run = true;
    if (arg.starts_with("--dry-run=")) {
      // As CLI11 reads a flag's value (false, off, no, disable, 0, f, n, -... are off); one it
      // cannot read counts as given.
      try {
        dry_run = CLI::detail::to_flag_value(std::string(arg.substr(10))) > 0;
      } catch (const std::exception&) {
        dry_run = true;
      }
    }
  }
  // A launch's plan only writes no events; a resume has no --dry-run (unknown, refused).
  if (dry_run && c.name == "dptrain launch") return;
  // A resume's run, where its name was read before the refusal: not a stream another launcher
  // of that run may be writing.
  std::string run_dir;
  if (const CLI::Option* dir = c.app->get_option_no_throw("run_dir");
      c.name == "dptrain resume" && dir != nullptr && !dir->results().empty()) {
    run_dir = dir->results().front();
  }
  dptrain::cli::end_unopened_events(
      restart, json, run_dir, c.name == "dptrain resume",
      dptrain::Error(dptrain::ErrorKind::usage, message),
      c.name == "dptrain launch" ? "the launch did not start" : "the resume did not start");
}

// What a parse error is about, in the words of the command line: an unknown subcommand or
// option, with the closest known one ("did you mean ...?"); empty when it is neither (CLI11's
// own message says it then).
std::string unknown_word(const Command& c, int argc, char** argv) {
  const auto suggest = [](std::string_view word, const std::vector<std::string>& known) {
    const auto close = dptrain::closest_match(word, known);
    return close ? fmt::format(" (did you mean '{}'?)", *close) : std::string();
  };
  // "ckpt verify", or empty for dptrain itself.
  const std::string words = c.name.size() > 8 ? c.name.substr(8) : std::string();
  const auto subs = c.app->get_subcommands([](const CLI::App*) { return true; });
  if (!subs.empty() && c.next < argc && argv[c.next][0] != '-') {
    const std::string prefix = words.empty() ? "" : words + " ";
    std::vector<std::string> known;
    std::vector<std::string> names;
    std::string takes_it;  // the first command that takes a positional argument, for the example
    for (const CLI::App* s : subs) {
      known.push_back(prefix + s->get_name());
      if (s->get_group().empty()) continue;  // not the hidden ones
      names.push_back(s->get_name());
      const auto positionals =
          s->get_options([](const CLI::Option* o) { return o->get_positional(); });
      if (takes_it.empty() && !positionals.empty()) takes_it = s->get_name();
    }
    const std::string given = prefix + argv[c.next];
    // A file where the command belongs ("dptrain recipe r.json"): the command comes first.
    const std::string_view word(argv[c.next]);
    if (!words.empty() && !names.empty() &&
        (word.find_first_of("/.") != std::string_view::npos || fs::exists(std::string(word)))) {
      return fmt::format("'{}' is not a command of 'dptrain {}', which takes one first ({}){}",
                         word, words, fmt::join(names, ", "),
                         takes_it.empty()
                             ? std::string()
                             : fmt::format(": 'dptrain {} {} {}', say", words, takes_it, word));
    }
    return fmt::format("unknown command '{}'{}", given, suggest(given, known));
  }
  std::vector<std::string> known;
  for (const CLI::Option* o : c.app->get_options()) {
    for (const auto& l : o->get_lnames())
      known.push_back("--" + l);
    for (const auto& n : o->get_snames())
      known.push_back("-" + n);
  }
  for (int i = c.next; i < argc; ++i) {
    const std::string_view arg(argv[i]);
    if (arg == "--") break;
    // An option's name ("--out=x" names --out); "-1" is a number, not an option.
    const bool option = arg.starts_with("--") || (arg.size() > 1 && arg[0] == '-' &&
                                                  std::isalpha(static_cast<unsigned char>(arg[1])));
    if (!option) continue;
    const std::string name(arg.substr(0, arg.find('=')));
    const bool short_group = !arg.starts_with("--") && name.size() > 2;  // -abc: CLI11's to judge
    if (short_group || std::find(known.begin(), known.end(), name) != known.end()) continue;
    // An option of its commands ("dptrain ckpt --json"): the command is what is missing.
    std::vector<std::string> takers;
    for (const CLI::App* s : subs) {
      if (!s->get_group().empty() && s->get_option_no_throw(name) != nullptr)
        takers.push_back(s->get_name());
    }
    if (!takers.empty()) {
      return fmt::format("'{}' needs a command before '{}': {}", c.name, name,
                         fmt::join(takers, ", "));
    }
    return fmt::format("{}unknown option '{}'{}", words.empty() ? "" : words + ": ", name,
                       suggest(name, known));
  }
  return {};
}

// CLI11's "Could not convert: --nproc = abc" in the words of the other usage errors:
// "--nproc: 'abc' is not an integer", its "--tokens: At Most 1 required but received 2" as
// "--tokens: given 2 times; give it once", and its "--run-dir: 1 required TEXT missing" (the
// last argument) as "--run-dir: no value given". Other messages as they are.
std::string plain_parse_error(const Command& c, const std::string& what, int argc, char** argv) {
  if (what == "A subcommand is required") {
    std::vector<std::string> names;
    for (const CLI::App* s : c.app->get_subcommands([](const CLI::App*) { return true; })) {
      if (!s->get_group().empty()) names.push_back(s->get_name());  // not the hidden ones
    }
    return fmt::format("'{}' needs a command: {}", c.name, fmt::join(names, ", "));
  }
  // Arguments left over (a second run directory, a value after a flag): named in the order given
  // (CLI11's message lists them backwards, and after "--" a command's parent may hold them).
  if (what.starts_with("The following argument")) {
    const CLI::App* root = c.app;
    while (root->get_parent() != nullptr)
      root = root->get_parent();
    std::vector<std::string> left = root->remaining(true);
    std::erase(left, "--");
    const auto position = [argc, argv](const std::string& word) {
      for (int i = 1; i < argc; ++i) {
        if (word == argv[i]) return i;
      }
      return argc;
    };
    std::stable_sort(left.begin(), left.end(), [&](const std::string& a, const std::string& b) {
      return position(a) < position(b);
    });
    std::vector<std::string> extras;
    for (const std::string& extra : left)
      extras.push_back("'" + dptrain::printable(extra) + "'");
    if (!extras.empty()) {
      return fmt::format("unexpected argument{} {}", extras.size() == 1 ? "" : "s",
                         fmt::join(extras, ", "));
    }
  }
  constexpr std::string_view kRepeated = ": At Most 1 required but received ";
  if (const auto at = what.find(kRepeated); at != std::string::npos) {
    return fmt::format("{}: given {} times; give it once", what.substr(0, at),
                       what.substr(at + kRepeated.size()));
  }
  if (what.ends_with(" missing")) {
    const auto colon = what.find(": ");
    const auto required = what.find(" required ");
    if (colon != std::string::npos && required != std::string::npos && colon < required &&
        what.find_first_not_of("0123456789", colon + 2) == required) {
      std::string name = what.substr(0, colon);
      // CLI11 names a hidden option (group "") as "": the command's hidden one that takes a
      // value is the one.
      for (const CLI::Option* o : c.app->get_options()) {
        if (name.empty() && o->get_group().empty() && o->get_expected_max() != 0 &&
            !o->get_lnames().empty()) {
          name = "--" + o->get_lnames().front();
        }
      }
      return fmt::format("{}: no value given", name);
    }
  }
  constexpr std::string_view kPrefix = "Could not convert: ";
  const auto equals = what.find(" = ");
  if (!what.starts_with(kPrefix) || equals == std::string::npos) return what;
  const std::string name = what.substr(kPrefix.size(), equals - kPrefix.size());
  const std::string value = what.substr(equals + 3);
  std::string expected = "a valid value";
  for (const CLI::Option* o : c.app->get_options()) {
    if (o->check_name(name)) {
      const std::string type = o->get_type_name();
      if (type.starts_with("UINT")) {
        expected = "a whole number >= 0";
      } else if (type.starts_with("INT")) {
        expected = "an integer";
      } else if (type.starts_with("FLOAT")) {
        expected = "a number";
      }
    }
  }
  // Digits that did not convert: a number too large for the option's type.
  const size_t digits = value.starts_with('-') || value.starts_with('+') ? 1 : 0;
  if (expected != "a number" && value.size() > digits &&
      value.find_first_not_of("0123456789", digits) == std::string::npos) {
    return fmt::format("{}: '{}' is out of range (too {})", name, value,
                       value.starts_with('-') ? "small" : "large");
  }
  return fmt::format("{}: '{}' is not {}", name, value, expected);
}

// Every option's value is checked for two slips of a script:
// - an empty value ("--run-dir ''"), which CLI11 would take as 0 for a number and as not given
//   (the default) for text, so an unset variable would pass unnoticed (unless the command
//   handles an empty one itself: kHandlesEmpty);
// - another of the command's options where the value belongs ("--out --json", from an unquoted
//   empty $OUT), which CLI11 would take as the value, and the option it names as not given.
//   Written attached ("--prompt=--json", one of `attached`: the arguments of that form), the
//   value is the one meant, and taken. ("--prompt=", empty, reaches CLI11 as "--prompt" and ""
//   (cli_arguments): an empty value, as meant.)
void check_option_values(CLI::App& app,
                         const std::shared_ptr<const std::set<std::string>>& attached) {
  auto names = std::make_shared<std::vector<std::string>>();
  for (const CLI::Option* o : app.get_options()) {
    for (const auto& l : o->get_lnames())
      names->push_back("--" + l);
    for (const auto& n : o->get_snames())
      names->push_back("-" + n);
  }
  for (CLI::Option* o : app.get_options()) {
    if (o->get_expected_max() == 0) continue;  // a flag
    // CLI11 converts an integer as strtoll does with base 0: "010" would be 8 and "09" refused
    // as too large. Every integer option is decimal: leading zeros go before it converts.
    if (const std::string type = o->get_type_name();
        type.starts_with("INT") || type.starts_with("UINT")) {
      o->transform(CLI::Validator(
          [](std::string& value) -> std::string {
            const size_t sign = value.starts_with('-') || value.starts_with('+') ? 1 : 0;
            // CLI11 would read 0x10 as 16 (and 0b, 0o likewise): decimal only.
            if (value.size() > sign + 2 && value[sign] == '0' &&
                std::string_view("xXbBoO").find(value[sign + 1]) != std::string_view::npos) {
              return fmt::format("'{}' is not a whole number", value);
            }
            // Not a plain decimal: the option's own check says what it is.
            if (value.size() > sign + 1 &&
                value.find_first_not_of("0123456789", sign) == std::string::npos) {
              const size_t first = std::min(value.find_first_not_of('0', sign), value.size() - 1);
              value.erase(sign, first - sign);
            }
            return std::string();
          },
          ""));
    }
    bool empty_ok = true;
    try {
      o->get_validator(dptrain::cli::kHandlesEmpty);
    } catch (const CLI::OptionNotFound&) {
      empty_ok = false;
    }
    const std::string name = !o->get_lnames().empty()   ? "--" + o->get_lnames().front()
                             : !o->get_snames().empty() ? "-" + o->get_snames().front()
                                                        : o->get_name();
    // An option where a value belongs is said before the option's own checks (a transform goes
    // first): "--tokens --json" is that, not a value that is not a number. An empty value is
    // said after them (an option's own check may say more: "--hosts: empty: give a hostfile").
    o->transform(CLI::Validator(
        [names, name, attached](std::string& value) -> std::string {
          if (std::find(names->begin(), names->end(), value) == names->end()) return {};
          if (attached->contains(name + "=" + value)) return {};
          return fmt::format("got the option {} where its value belongs; give {} a value", value,
                             name);
        },
        ""));
    o->check(CLI::Validator(
        [empty_ok](std::string& value) -> std::string {
          return value.empty() && !empty_ok ? "is empty; give a value" : "";
        },
        ""));
  }
  for (CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    check_option_values(*sub, attached);
}

int run(int argc, char** argv);

}  // namespace

int main(int argc, char** argv) {
  dptrain::cli::fill_closed_std_descriptors();  // before anything opens a file
  dptrain::cli::raise_open_file_limit();
  // Whether whoever started us ignores SIGPIPE (commands that run processes ignore it from here
  // on): it decides how output to a pipe whose reader has gone ends, below.
  struct sigaction sigpipe_at_start {};
  const bool sigpipe_ignored = ::sigaction(SIGPIPE, nullptr, &sigpipe_at_start) == 0 &&
                               sigpipe_at_start.sa_handler == SIG_IGN;
  // Every command that starts a process waits for it by pid (ranks, provision's and doctor's
  // local commands): SIGCHLD ignored (SIG_IGN or SA_NOCLDWAIT, inherited across exec) would
  // have the kernel reap them unseen, and a launcher wait for ever. signal() clears both.
  std::signal(SIGCHLD, SIG_DFL);
  int code = run(argc, argv);
  // What was written to standard output must have arrived: a full disk or a closed descriptor
  // behind `dptrain ... > FILE` is a failure, not a silent success (as coreutils' close_stdout).
  const bool flushed = std::fflush(stdout) == 0;
  int error = flushed ? 0 : errno;
  if ((!flushed || std::ferror(stdout)) && code == 0) {
    // A write that failed earlier left no errno: a write of nothing still fails on a closed
    // descriptor (EBADF); a pipe whose reader has gone polls as an error; a full disk then only
    // shows as the earlier failure.
    pollfd out{STDOUT_FILENO, POLLOUT, 0};
    if (error == 0 && ::poll(&out, 1, 0) == 1 && (out.revents & POLLERR) != 0) error = EPIPE;
    if (error == 0 && ::write(STDOUT_FILENO, "", 0) != 0) error = errno;
    // The reader of a pipe has gone (`dptrain ... | head -1`): the end every command meets,
    // whether it wrote as it went or at its end, is SIGPIPE's (exit 141 to a shell), unless the
    // caller ignores that signal (then an error, as coreutils give).
    if (error == EPIPE && !sigpipe_ignored) {
      std::signal(SIGPIPE, SIG_DFL);
      std::raise(SIGPIPE);
      return 128 + SIGPIPE;
    }
    std::fprintf(stderr, "dptrain: error: standard output: cannot write%s%s\n", error ? ": " : "",
                 error ? std::strerror(error) : "");
    code = 1;
  }
  // Any run whose elastic placement or host watch probed a host: a probe on a thread of its own
  // may still run (a host that hangs) or be ending, and the exit handlers would tear down the SSH
  // library under it, a crash (SIGSEGV) in place of `code`. Ended without them, output written.
  if (dptrain::probe_thread_started()) {
    std::fflush(nullptr);
    std::_Exit(code);
  }
  return code;
}

namespace {

// The long names of the options of `app` and its commands: those that take a value, and flags.
void long_names(CLI::App& app, std::set<std::string>& values, std::set<std::string>& flags) {
  for (const CLI::Option* o : app.get_options()) {
    for (const auto& l : o->get_lnames())
      (o->get_expected_max() == 0 ? flags : values).insert("--" + l);
  }
  for (CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; }))
    long_names(*sub, values, flags);
}

// The arguments as CLI11 is to read them: "--opt=" (an empty value written attached, a script's
// --prompt="$PROMPT" with nothing in it) of an option that takes a value as "--opt" and "":
// CLI11 would take the argument after it as the value. (Not a flag's: "--json=" is the flag
// given, as CLI11 takes it; nor after "--": positional from there.)
std::vector<std::string> cli_arguments(CLI::App& app, int argc, char** argv) {
  std::set<std::string> values, flags;
  long_names(app, values, flags);
  std::vector<std::string> args;
  bool options = true;
  for (int i = 0; i < argc; ++i) {
    const std::string_view arg(argv[i]);
    if (i > 0 && arg == "--") options = false;
    const std::string name(arg.substr(0, arg.size() - 1));
    if (options && i > 0 && arg.size() > 3 && arg.starts_with("--") &&
        arg.find('=') == arg.size() - 1 && values.contains(name) && !flags.contains(name)) {
      args.emplace_back(arg.substr(0, arg.size() - 1));
      args.emplace_back();
    } else {
      args.emplace_back(arg);
    }
  }
  return args;
}

int run(int argc, char** argv) {
  if (argc > 1 && std::string_view(argv[1]) == "worker")
    dptrain::cli::install_worker_signal_handlers();
  if (argc > 1 && std::string_view(argv[1]) == "_relay") dptrain::install_relay_signal_handlers();
  // A launch or resume stopped while it still loads and reads its options (a pipeline's timeout
  // at once) is answered as a stop, with its JSON, not a death by the signal. (Only these: a
  // command that never looks for the stop would ignore the signal.)
  if (argc > 1 &&
      (std::string_view(argv[1]) == "launch" || std::string_view(argv[1]) == "resume")) {
    try {
      dptrain::install_stop_signal_handlers();
    } catch (const dptrain::Error&) {
      // No pipe to wake on (no descriptor free): the command installs them again, and says so.
    }
  }
  // A launcher starts its ranks with SIGTERM blocked (ProcessSpec::hold_sigterm), and its relays
  // with their end signal (SIGUSR1) too: one that came while this process loaded is delivered
  // now, to the handler just installed.
  sigset_t held;
  sigemptyset(&held);
  sigaddset(&held, SIGTERM);
  sigaddset(&held, SIGUSR1);
  sigprocmask(SIG_UNBLOCK, &held, nullptr);
  CLI::App app{
      "dptrain: data-parallel training from a JSON recipe, on CPU ranks (Gloo) or one NVIDIA GPU\n"
      "per rank (NCCL), on this machine or across hosts over SSH.\n"
      "Exit codes: 0 ok, 1 internal/CUDA/out of memory, 2 usage/recipe/data, 3 rank failed,\n"
      "4 ssh/host, 5 checkpoint, "
      "6 benchmark below threshold, 130 SIGINT, 143 SIGTERM. See dptrain(1).",
      "dptrain"};
  app.set_version_flag("-V,--version", "dptrain " DPTRAIN_VERSION,
                       "Print the version and exit (with --json: {version, cuda, ...} for a "
                       "script)");
  app.require_subcommand(1);
  app.fallthrough(false);
  dptrain::cli::Outcome outcome;
  // After the outcome is printed, whichever way this function returns.
  struct Finally {
    dptrain::cli::Outcome& outcome;
    ~Finally() {
      if (!outcome.finally) return;
      try {
        outcome.finally();
      } catch (...) {
      }
    }
  } finally{outcome};
  for (const auto& cmd : dptrain::cli::subcommands()) {
    CLI::App* sub = app.add_subcommand(cmd.name, cmd.summary);
    cmd.setup(*sub, outcome);
  }
  std::vector<std::string> arguments = cli_arguments(app, argc, argv);
  std::vector<char*> pointers;
  for (auto& a : arguments)
    pointers.push_back(a.data());
  pointers.push_back(nullptr);
  argc = static_cast<int>(arguments.size());
  argv = pointers.data();
  auto attached = std::make_shared<std::set<std::string>>();
  for (int i = 1; i < argc; ++i) {
    if (std::string_view(argv[i]).starts_with("--") &&
        std::string_view(argv[i]).find('=') != std::string_view::npos) {
      attached->insert(argv[i]);
    }
  }
  check_option_values(app, attached);
  // What a JSON error carries besides its four fields, whatever failed: the warnings the command
  // gave before it failed, and the answer a script reads on every one of its answers
  // (dptrain(1)): recipe validate's "valid" (with its "warnings"); ckpt verify's, provision's and
  // doctor's "ok".
  const auto warned = [&] {
    nlohmann::json fields = nlohmann::json::object();
    if (!outcome.warnings.empty()) fields["warnings"] = outcome.warnings;
    const std::string name = named_command(app, argc, argv).name;
    if (name == "dptrain recipe validate") {
      fields["valid"] = false;
      if (!fields.contains("warnings")) fields["warnings"] = nlohmann::json::array();
    } else if (name == "dptrain ckpt verify" || name == "dptrain provision" ||
               name == "dptrain doctor") {
      fields["ok"] = false;
    }
    return fields;
  };
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    const bool json = std::find(argv + 1, argv + argc, std::string_view("--json")) != argv + argc;
    // CLI11 answers --version as soon as it meets it: anything else given with it is a slip
    // ("dptrain --version --foo"), refused as any unknown argument is.
    for (int i = 1; i < argc; ++i) {
      const std::string_view arg = argv[i];
      if (arg != "--version" && arg != "-V" && arg != "--json") {
        print_error(fmt::format("--version takes no other arguments than --json, got '{}' (see "
                                "'dptrain --help')",
                                dptrain::printable(arg)),
                    2, "error", json);
        return 2;
      }
    }
    // `dptrain --version --json`: what a script checks before it relies on the binary.
    if (json) {
#ifdef DPTRAIN_HAVE_CUDA
      constexpr bool cuda = true;
#else
      constexpr bool cuda = false;
#endif
      nlohmann::json out = {{"version", DPTRAIN_VERSION},
                            {"cuda", cuda},
                            {"agent_protocol", dptrain::kAgentProtocol}};
      dptrain::cli::add_success(out);
      fmt::print("{}\n", out.dump());
      return 0;
    }
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    // The callbacks that set outcome.json have not run: a script that asked for JSON gets it.
    // After "--" every word is an argument, not an option ("-- --json" is not asking for it).
    bool json = false;
    for (int i = 1; i < argc && std::string_view(argv[i]) != "--"; ++i)
      json = json || std::string_view(argv[i]) == "--json";
    const Command command = named_command(app, argc, argv);
    std::string message = unknown_word(command, argc, argv);
    if (message.empty()) message = plain_parse_error(command, e.what(), argc, argv);
    // One line: what is wrong, and where the options are told.
    const std::string line = fmt::format("{} (see '{} --help')", message, command.name);
    print_error(line, 2, "error", json, "", warned());
    end_refused_events(command, argc, argv, json, line);
    return 2;
  } catch (const dptrain::Error& e) {
    // A stop signal that came while the command worked (a recipe read from a pipe that never
    // wrote, interrupted) made this failure: the signal's exit code, as any stopped command's.
    const dptrain::ErrorKind kind = dptrain::kind_after_stop(e.kind());
    const int code = dptrain::exit_code(kind);
    print_error(e.what(), code, dptrain::cli::failure_status(kind), outcome.json, outcome.run_dir,
                warned());
    return code;
  } catch (const std::filesystem::filesystem_error& e) {
    // Not a bug: a path that cannot be used ("runs/x: cannot make absolute path: No such file or
    // directory"), without the library's "filesystem error: " and "[path]".
    std::string what = e.what();
    if (what.starts_with("filesystem error: ")) what.erase(0, 18);
    if (const auto bracket = what.find(" ["); bracket != std::string::npos) what.erase(bracket);
    std::string path = e.path1().string();
    if (!e.path2().empty()) path += " -> " + e.path2().string();
    print_error(path.empty()
                    ? what
                    : fmt::format("{}: {}{}", path, what, dptrain::cwd_gone_note(e.path1())),
                1, "error", outcome.json, outcome.run_dir, warned());
    return 1;
  } catch (const std::bad_alloc&) {
    // Not a bug: the machine (or its limits) has less memory than the job asked for.
    print_error(
        "out of memory: an allocation failed (data or a model too large for this machine's "
        "memory or its limits: ulimit -v, a cgroup)",
        1, "error", outcome.json, outcome.run_dir, warned());
    return 1;
  } catch (const std::exception& e) {
    print_error(fmt::format("internal error: {}", e.what()), 1, "error", outcome.json,
                outcome.run_dir, warned());
    return 1;
  }
  return outcome.exit_code;
}

}  // namespace
