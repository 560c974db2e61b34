// The command line itself: help, version, recipe validate/show, bad input and exit codes.
#include <doctest/doctest.h>

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <csignal>
#include <cstdlib>
#include <fstream>
#include <thread>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "launch/agent.hpp"
#include "tests/harness.hpp"
#include "tests/sshd.hpp"
#include "tests/strings.hpp"
#include "tests/text_corpus.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;

TEST_CASE("--version and --help for dptrain and every subcommand") {
  auto v = run_dptrain({"--version"});
  CHECK(v.exit_code == 0);
  CHECK(v.out.find("dptrain ") != std::string::npos);
  // A script's check: the version as JSON, whichever side of --version --json is.
  for (const auto& args : {std::vector<std::string>{"--version", "--json"},
                           std::vector<std::string>{"--json", "--version"}}) {
    auto j = run_dptrain(args);
    CHECK(j.exit_code == 0);
    const auto doc = nlohmann::json::parse(j.out);
    CHECK(doc.at("version").get<std::string>() == DPTRAIN_VERSION);
    CHECK(doc.at("cuda").is_boolean());
    CHECK(doc.at("agent_protocol") == dptrain::kAgentProtocol);
    // With the fields of every --json success.
    CHECK(doc.at("status") == "ok");
    CHECK(doc.at("exit_code") == 0);
    CHECK(doc.at("errors") == nlohmann::json::array());
  }
  // Anything else with it is refused, not passed over (CLI11 answers --version at once).
  for (const auto& args :
       {std::vector<std::string>{"--version", "--foo"}, std::vector<std::string>{"-V", "launch"}}) {
    auto bad = run_dptrain(args);
    CHECK(bad.exit_code == 2);
    CHECK(bad.out.empty());
    CHECK(bad.err == "dptrain: error: --version takes no other arguments than --json, got '" +
                         args[1] + "' (see 'dptrain --help')\n");
  }
  auto bad_json = run_dptrain({"--json", "--version", "--foo"});
  CHECK(bad_json.exit_code == 2);
  CHECK(nlohmann::json::parse(bad_json.out)["exit_code"] == 2);
  auto h = run_dptrain({"--help"});
  CHECK(h.exit_code == 0);
  for (const char* cmd : {"launch", "resume", "recipe", "worker"}) {
    CAPTURE(cmd);
    CHECK(h.out.find(cmd) != std::string::npos);
    auto sub = run_dptrain({cmd, "--help"});
    CHECK(sub.exit_code == 0);
    CHECK(sub.out.find("Usage") != std::string::npos);
  }
  for (const char* cmd : {"validate", "show"}) {
    CAPTURE(cmd);
    CHECK(run_dptrain({"recipe", cmd, "--help"}).exit_code == 0);
  }
}

TEST_CASE("output that cannot be written (a full disk) is exit 1, not a silent success") {
  TempDir tmp;
  const std::string recipe = (source_dir() / "recipes/quickstart.json").string();
  const auto to_full = [&](const std::string& args) {
    const int status = std::system(
        ("'" + binary() + "' " + args + " > /dev/full 2> '" + (tmp / "err").string() + "'")
            .c_str());
    REQUIRE(WIFEXITED(status));
    return WEXITSTATUS(status);
  };
  for (const std::string& args : {"recipe show '" + recipe + "'", std::string("--help"),
                                  "recipe validate '" + recipe + "' --json"}) {
    CAPTURE(args);
    CHECK(to_full(args) == 1);
    CHECK(
        read_text(tmp / "err")
            .ends_with("dptrain: error: standard output: cannot write: No space left on device\n"));
  }
  // A failure keeps its own exit code and message.
  CHECK(to_full("recipe show '" + (tmp / "missing.json").string() + "'") == 2);
  CHECK(read_text(tmp / "err") == "dptrain: error: " + (tmp / "missing.json").string() +
                                      ": cannot read: No such file or "
                                      "directory\n");
}

TEST_CASE("a closed stdout is exit 1, and no file the command opens takes its output") {
  TempDir tmp;
  const fs::path run = tmp / "run";
  const auto closed = [&](const std::string& args) {
    const int status = std::system(
        ("'" + binary() + "' " + args + " >&- 2> '" + (tmp / "err").string() + "'").c_str());
    REQUIRE(WIFEXITED(status));
    return WEXITSTATUS(status);
  };
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  // The first file a launch opens (its lock, a rank's log) would otherwise be descriptor 1.
  CHECK(closed("launch '" + recipe.string() + "' --nproc 2 --run-dir '" + run.string() +
               "' --json") == 1);
  CHECK(read_text(tmp / "err")
            .ends_with("dptrain: error: standard output: cannot write: Bad file descriptor\n"));
  // The lock file holds only its holder's "PID HOST".
  const std::string lock = read_text(run / ".lock");
  CHECK(lock.find_first_not_of("0123456789") == lock.find(' '));
  CHECK_FALSE(contains(lock, "{"));
  CHECK(parse_json(read_text(run / "run.json"))["status"] == "completed");
  for (const auto& log : fs::directory_iterator(run / "logs"))
    CHECK_FALSE(contains(read_text(log.path()), "\"exit_code\""));
  for (const std::string& args :
       {"ckpt verify '" + run.string() + "'", "ckpt verify '" + run.string() + "' --json",
        "status '" + run.string() + "'"}) {
    CAPTURE(args);
    CHECK(closed(args) == 1);
    CHECK(read_text(tmp / "err") ==
          "dptrain: error: standard output: cannot write: Bad file descriptor\n");
  }
}

TEST_CASE("output to a pipe whose reader has gone ends as SIGPIPE does, or exit 1 if ignored") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  // The reader (`true`) has gone before the command writes; the command's status goes to a file.
  const auto into_gone_pipe = [&](const std::string& args, bool ignore_sigpipe) {
    const std::string script =
        fmt::format("{}{{ sleep 0.5; '{}' {} 2> '{}'; echo \\$? > '{}'; }} | true",
                    ignore_sigpipe ? "trap '' PIPE; " : "", binary(), args, (tmp / "err").string(),
                    (tmp / "status").string());
    REQUIRE(std::system(("bash -c \"" + script + "\"").c_str()) == 0);
    return std::stoi(read_text(tmp / "status"));
  };
  const std::string run = (tmp / "run").string();
  // A launch ignores SIGPIPE while it runs its ranks, and wrote its JSON at the end: it ends as
  // a command that met SIGPIPE as it wrote does, not as a success whose output went nowhere.
  CHECK(into_gone_pipe("launch '" + recipe.string() + "' --run-dir '" + run + "' --json", false) ==
        141);
  CHECK(read_text(tmp / "err").find("error") == std::string::npos);
  CHECK(parse_json(read_text(tmp / "run/run.json"))["status"] == "completed");
  for (const std::string& args : {"status '" + run + "' --json", "ckpt verify '" + run + "'"}) {
    CAPTURE(args);
    CHECK(into_gone_pipe(args, false) == 141);
    // Whoever ignores SIGPIPE hears of it as of any other write that failed.
    CHECK(into_gone_pipe(args, true) == 1);
    CHECK(read_text(tmp / "err") == "dptrain: error: standard output: cannot write: Broken pipe\n");
  }
}

TEST_CASE("recipe validate/show stopped while reading a pipe that never writes: 130/143, JSON") {
  TempDir tmp;
  const fs::path fifo = tmp / "recipe.json";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  // Held open for writing, never written: the command's read waits.
  const int writer = ::open(fifo.c_str(), O_RDWR | O_CLOEXEC);
  REQUIRE(writer >= 0);
  for (const auto& [cmd, sig] : {std::pair{"validate", SIGTERM}, std::pair{"show", SIGINT}}) {
    CAPTURE(cmd);
    Background b({"recipe", cmd, fifo.string(), "--json"});
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    REQUIRE(::kill(b.pid(), sig) == 0);
    const int code = b.wait(std::chrono::seconds(20));
    CHECK(code == (sig == SIGTERM ? 143 : 130));
    const nlohmann::json out = parse_json(b.out());
    CHECK(out["status"] == (sig == SIGTERM ? "terminated" : "interrupted"));
    CHECK(out["exit_code"] == code);
    CHECK(out["error"] ==
          fifo.string() + ": stopped by " + (sig == SIGTERM ? "SIGTERM" : "SIGINT"));
    if (std::string_view(cmd) == "validate") {
      CHECK(out["valid"] == false);
      CHECK(out["warnings"] == nlohmann::json::array());
    }
  }
  ::close(writer);
}

TEST_CASE("an IPv6 --master-addr (::1 or [::1]) reaches the ranks as [::1]:PORT") {
  // Only where this machine has an IPv6 loopback (some containers have none).
  const int probe = ::socket(AF_INET6, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in6 loopback{};
  loopback.sin6_family = AF_INET6;
  loopback.sin6_addr = in6addr_loopback;
  const bool has_v6 =
      probe >= 0 && ::bind(probe, reinterpret_cast<sockaddr*>(&loopback), sizeof loopback) == 0;
  if (probe >= 0) ::close(probe);
  if (!has_v6) {
    MESSAGE("skipped: no IPv6 loopback here");
    return;
  }
  TempDir tmp;
  auto recipe = small_recipe();
  recipe["train"]["steps"] = 10;
  const auto file = write_recipe(tmp.path(), recipe);
  for (const std::string addr : {"::1", "[::1]"}) {
    CAPTURE(addr);
    const auto plan = run_dptrain(
        {"launch", file.string(), "--nproc", "2", "--master-addr", addr, "--dry-run", "--json"});
    REQUIRE_MESSAGE(plan.exit_code == 0, plan.err);
    CHECK(parse_json(plan.out)["store"].get<std::string>().starts_with("[::1]:"));
    const auto run = run_dptrain({"launch", file.string(), "--nproc", "2", "--master-addr", addr,
                                  "--runs-root", (tmp / "runs").string(), "--json"});
    CHECK_MESSAGE(run.exit_code == 0, run.err);
    CHECK(parse_json(run.out)["status"] == "completed");
    // A rank started by hand with torchrun's variables: MASTER_ADDR as torchrun takes it.
    const auto by_hand = run_dptrain({"worker", file.string(), "--run-dir",
                                      (tmp / ("hand" + std::to_string(addr.size()))).string()},
                                     {{"RANK", "0"},
                                      {"WORLD_SIZE", "1"},
                                      {"MASTER_ADDR", addr},
                                      {"MASTER_PORT", std::to_string(unused_port())},
                                      {"DPTRAIN_HOST_STORE", "1"}});
    CHECK_MESSAGE(by_hand.exit_code == 0, by_hand.err);
  }
}

TEST_CASE("usage errors exit 2") {
  CHECK(run_dptrain({}).exit_code == 2);
  auto unknown = run_dptrain({"lanuch"});
  CHECK(unknown.exit_code == 2);
  CHECK_MESSAGE(
      unknown.err.find("unknown command 'lanuch' (did you mean 'launch'?)") != std::string::npos,
      unknown.err);
  // A script that asked for JSON gets one object even when the arguments do not parse.
  auto bad_flag = run_dptrain({"launch", "x.json", "--json", "--bogus"});
  CHECK(bad_flag.exit_code == 2);
  CHECK(parse_json(bad_flag.out)["status"] == "error");
  CHECK(bad_flag.err.find("--bogus") != std::string::npos);
  CHECK(run_dptrain({"launch"}).exit_code == 2);
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  auto r = run_dptrain(
      {"launch", recipe.string(), "--nproc", "0", "--runs-root", (tmp / "runs").string()});
  CHECK(r.exit_code == 2);
  CHECK(r.err.find("--nproc") != std::string::npos);
  CHECK_FALSE(fs::exists(tmp / "runs"));
  auto b = run_dptrain(
      {"launch", recipe.string(), "--backend", "mpi", "--runs-root", (tmp / "runs").string()});
  CHECK(b.exit_code == 2);
  CHECK(b.err.find("--backend") != std::string::npos);
  // NCCL for a recipe that computes on the CPU: refused before any rank starts.
  auto nccl = run_dptrain(
      {"launch", recipe.string(), "--backend", "nccl", "--runs-root", (tmp / "runs").string()});
  CHECK(nccl.exit_code == 2);
  CHECK_MESSAGE(nccl.err.find("--backend nccl: " + recipe.string() + " computes on the CPU") !=
                    std::string::npos,
                nccl.err);
  CHECK_FALSE(fs::exists(tmp / "runs"));
  // And a rank started by hand that is told to (DPTRAIN_BACKEND): the same usage error, exit 2.
  auto nccl_rank =
      run_dptrain({"worker", recipe.string(), "--rank", "0", "--world-size", "1", "--store",
                   "127.0.0.1:9", "--run-dir", (tmp / "nccl-rank").string()},
                  {{"DPTRAIN_BACKEND", "nccl"}});
  CHECK(nccl_rank.exit_code == 2);
  CHECK_MESSAGE(nccl_rank.err ==
                    "dptrain: error: rank 0: backend nccl (DPTRAIN_BACKEND): this "
                    "rank computes on the CPU (train.device \"cpu\"); NCCL needs "
                    "\"cuda\": use gloo or auto\n",
                nccl_rank.err);
  // A world size no job has: refused before anything waits for its ranks.
  auto huge = run_dptrain({"worker", recipe.string(), "--run-dir", (tmp / "by-env").string()},
                          {{"RANK", "0"},
                           {"WORLD_SIZE", "2147483647"},
                           {"MASTER_ADDR", "127.0.0.1"},
                           {"MASTER_PORT", "9"}});
  CHECK(huge.exit_code == 2);
  CHECK(huge.err ==
        "dptrain: error: rank 0: world size (--world-size or WORLD_SIZE): at most 1048576 "
        "ranks, got 2147483647\n");
  // The identity from the environment: a value past int names the bound it is past.
  for (const auto& [value, says] : std::vector<std::pair<std::string, std::string>>{
           {"2147483648", "RANK: '2147483648' is too large (at most 2147483647)"},
           {"-99999999999", "RANK: '-99999999999' is negative (a count or an index: at least 0)"},
           {"1x", "RANK: not an integer: '1x'"}}) {
    auto bad = run_dptrain(
        {"worker", recipe.string(), "--run-dir", (tmp / "by-env").string()},
        {{"RANK", value}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "9"}});
    CHECK(bad.exit_code == 2);
    CHECK(bad.err == "dptrain: error: " + says + "\n");
  }
  // A local rank set to nothing is named, as RANK is (it was taken as unset: the rank's own
  // number, and a node that keeps no checkpoint copy).
  for (const char* name : {"LOCAL_RANK", "SLURM_LOCALID"}) {
    auto empty = run_dptrain({"worker", recipe.string(), "--run-dir", (tmp / "by-env").string()},
                             {{"RANK", "1"},
                              {"WORLD_SIZE", "2"},
                              {"MASTER_ADDR", "127.0.0.1"},
                              {"MASTER_PORT", "9"},
                              {name, ""}});
    CHECK(empty.exit_code == 2);
    CHECK(empty.err == fmt::format("dptrain: error: rank 1: {}: is empty; give a value\n", name));
  }
  // The store's address by the variable it came from: torchrun's MASTER_PORT, DPTRAIN_STORE.
  for (const auto& [vars, says] : std::vector<std::pair<Env, std::string>>{
           {{{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "70000"}},
            "MASTER_PORT: '70000' is not a port number (1 to 65535)"},
           {{{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "0"}},
            "MASTER_PORT: '0' is not a port number (1 to 65535)"},
           {{{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "29500x"}},
            "MASTER_PORT: '29500x' is not a port number (1 to 65535)"},
           {{{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "-1"}},
            "MASTER_PORT: '-1' is not a port number (1 to 65535)"},
           {{{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "99999999999999999999"}},
            "MASTER_PORT: '99999999999999999999' is not a port number (1 to 65535)"},
           {{{"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", ""}},
            "MASTER_PORT: is empty; give a value"},
           {{{"MASTER_ADDR", "127.0.0.1:5555"}, {"MASTER_PORT", "1234"}},
            "MASTER_ADDR: '127.0.0.1:5555' holds a port: give the host alone, and the port in "
            "MASTER_PORT"},
           {{{"MASTER_ADDR", "127.0.0.1 "}, {"MASTER_PORT", "1234"}},
            "MASTER_ADDR: '127.0.0.1 ' holds white space"},
           {{{"MASTER_ADDR", "[::1]:5555"}, {"MASTER_PORT", "1234"}},
            "MASTER_ADDR: '[::1]:5555' holds a port: give the host alone, and the port in "
            "MASTER_PORT"},
           {{{"MASTER_ADDR", "[::1"}, {"MASTER_PORT", "1234"}},
            "MASTER_ADDR: '[::1' has no closing bracket"},
           {{{"MASTER_ADDR", "::1]"}, {"MASTER_PORT", "1234"}},
            "MASTER_ADDR: '::1]' has a closing bracket without an opening one"},
           // Rank 0 serving the store on a name that does not resolve: at once, not after the
           // ranks' wait with the store's port open.
           {{{"MASTER_ADDR", "nosuchhost.invalid"},
             {"MASTER_PORT", "1234"},
             {"DPTRAIN_HOST_STORE", "1"}},
            "MASTER_ADDR/MASTER_PORT: cannot resolve host 'nosuchhost.invalid'"},
           {{{"DPTRAIN_STORE", "127.0.0.1"}}, "DPTRAIN_STORE: invalid address '127.0.0.1'"}}) {
    Env all = vars;
    all.insert({{"RANK", "0"}, {"WORLD_SIZE", "1"}});
    auto bad =
        run_dptrain({"worker", recipe.string(), "--run-dir", (tmp / "by-env").string()}, all);
    CHECK(bad.exit_code == 2);
    CHECK_MESSAGE(contains(bad.err, "dptrain: error: rank 0: " + says), bad.err);
  }
  // Inside another run's checkpoints/ (or logs/): its resume would set the new run aside as a
  // damaged checkpoint. Beside them (the run directory itself) is no such place.
  fs::create_directories(tmp / "outer/checkpoints");
  write_text(tmp / "outer/run.json", "{}");
  for (const auto& [args, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--run-dir", (tmp / "outer/checkpoints/step-000999").string()},
            "--run-dir " + (tmp / "outer/checkpoints/step-000999").string() +
                ": inside checkpoints/ of the run " + (tmp / "outer").string()},
           {{"--run-dir", (tmp / "outer/logs").string()},
            "--run-dir " + (tmp / "outer/logs").string() + ": inside logs/ of the run " +
                (tmp / "outer").string()},
           {{"--runs-root", (tmp / "outer/checkpoints").string()},
            "--runs-root " + (tmp / "outer/checkpoints").string() +
                ": inside checkpoints/ of the run " + (tmp / "outer").string()}}) {
    std::vector<std::string> all = {"launch", recipe.string()};
    all.insert(all.end(), args.begin(), args.end());
    auto inside = run_dptrain(all);
    CHECK(inside.exit_code == 2);
    CHECK_MESSAGE(inside.err.starts_with("dptrain: error: " + says + ", whose resume"), inside.err);
    all.push_back("--dry-run");  // the plan is refused as the launch is
    CHECK(run_dptrain(all).exit_code == 2);
  }
  CHECK(fs::is_empty(tmp / "outer/checkpoints"));
  // A run whose checkpoints/ is a link to scratch space: a path through the link is inside it.
  fs::create_directories(tmp / "scratch");
  fs::create_directories(tmp / "linked");
  write_text(tmp / "linked/run.json", "{}");
  fs::create_directory_symlink(tmp / "scratch", tmp / "linked/checkpoints");
  auto linked = run_dptrain(
      {"launch", recipe.string(), "--run-dir", (tmp / "linked/checkpoints/new").string()});
  CHECK(linked.exit_code == 2);
  CHECK_MESSAGE(linked.err.starts_with("dptrain: error: --run-dir " +
                                       (tmp / "linked/checkpoints/new").string() +
                                       ": inside checkpoints/ of the run " +
                                       (tmp / "linked").string() + ", whose resume"),
                linked.err);
  CHECK(fs::is_empty(tmp / "scratch"));
  // A run directory that cannot be made is the caller's to fix: a usage error naming it.
  write_text(tmp / "afile", "x");
  auto unwritable =
      run_dptrain({"launch", recipe.string(), "--run-dir", (tmp / "afile/run").string()});
  CHECK(unwritable.exit_code == 2);
  CHECK_MESSAGE(unwritable.err.find((tmp / "afile/run").string() +
                                    ": cannot create run directory") != std::string::npos,
                unwritable.err);
  // Bad numbers say what is wrong with them, and NaN does not turn the hang watch off.
  for (const auto& [flag, value, says] : std::vector<std::array<std::string, 3>>{
           {"--hang-timeout", "nan", "must be a finite number"},
           {"--max-restarts", "-1", "must be a whole number >= 0"},
           {"--restart-backoff", "soon", "is not a number"},
           {"--hang-timeout", "0x10", "is not a number"},
           {"--restart-backoff", " 1", "is not a number"},
           {"--hang-timeout", "1e9", "is more than 1000000 seconds"},
           {"--rejoin-timeout", "1e300", "is more than"},
           {"--connect-timeout", "2e6", "is more than"},
           {"--connect-timeout", "0", "must be a number of seconds > 0"},
           {"--connect-timeout", "0.0001", "must be at least 0.001 seconds"}}) {
    CAPTURE(flag);
    auto bad = run_dptrain(
        {"launch", recipe.string(), flag, value, "--runs-root", (tmp / "runs").string()});
    CHECK(bad.exit_code == 2);
    CHECK_MESSAGE(bad.err.find(flag) != std::string::npos, bad.err);
    CHECK_MESSAGE(bad.err.find("'" + value + "' " + says) != std::string::npos, bad.err);
    CHECK(bad.err.find("179769") == std::string::npos);
  }
  CHECK_FALSE(fs::exists(tmp / "runs"));
  // The help gives the floor the check holds to.
  CHECK(contains(run_dptrain({"launch", "--help"}).out, "--connect-timeout FLOAT:SECONDS>=0.001"));
  // --env: a setting that is not a variable, one the launcher owns, or a name not set here.
  for (const auto& [setting, says] : std::vector<std::array<std::string, 2>>{
           {"9LIVES=1", "--env '9LIVES=1': '9LIVES' is not a variable name"},
           {"WORLD_SIZE=8", "--env WORLD_SIZE: the launcher sets WORLD_SIZE for each rank"},
           {"DPTRAIN_TEST_NOT_SET", "--env DPTRAIN_TEST_NOT_SET is not set in this environment"}}) {
    CAPTURE(setting);
    auto bad = run_dptrain({"launch", recipe.string(), "--env", setting, "--runs-root",
                            (tmp / "runs").string(), "--json"});
    CHECK(bad.exit_code == 2);
    CHECK(lines_of(bad.err).size() == 1);
    CHECK_MESSAGE(bad.err.find(says) != std::string::npos, bad.err);
    CHECK(parse_json(bad.out)["exit_code"] == 2);
  }
  CHECK_FALSE(fs::exists(tmp / "runs"));
  // One file per --identity: the recipe after it is the recipe, not a second key.
  write_text(tmp / "id_test", "not a key; a dry run reads none\n");
  auto identity = run_dptrain(
      {"launch", "--identity", (tmp / "id_test").string(), recipe.string(), "--dry-run", "--json"});
  CHECK_MESSAGE(identity.exit_code == 0, identity.err);
  CHECK(parse_json(identity.out)["world_size"] == 1);
  // SSH files that cannot be what they say are refused on this machine alone too, where they
  // are not used: a typo in a script's flags is found wherever it runs.
  const std::string no_key = (tmp / "no_key").string();
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"launch", recipe.string(), "--identity", no_key, "--dry-run"},
        std::vector<std::string>{"launch", recipe.string(), "--known-hosts", tmp.path().string(),
                                 "--dry-run"},
        std::vector<std::string>{"bench", "comm", "--identity", no_key, "-e", "64"},
        std::vector<std::string>{"bench", "train", recipe.string(), "--identity", no_key}}) {
    CAPTURE(args);
    const auto refused = run_dptrain(args);
    CHECK(refused.exit_code == 2);
    CHECK_MESSAGE(
        (contains(refused.err, "dptrain: error: --identity " + no_key + ": no such file") ||
         contains(refused.err,
                  "dptrain: error: --known-hosts " + tmp.path().string() + ": is a directory")),
        refused.err);
  }
  // A --master-addr the store cannot listen on is the caller's to fix, found before anything runs.
  auto elsewhere = run_dptrain({"launch", recipe.string(), "--master-addr", "192.0.2.1",
                                "--runs-root", (tmp / "runs").string()});
  CHECK(elsewhere.exit_code == 2);
  CHECK(elsewhere.err.find("--master-addr 192.0.2.1: the store cannot listen there") !=
        std::string::npos);
  CHECK_FALSE(fs::exists(tmp / "runs"));
  // An option given twice, in the words of the other usage errors.
  auto twice = run_dptrain({"data", "prepare", "--out", "a", "--out", "b"});
  CHECK(twice.exit_code == 2);
  CHECK(twice.err ==
        "dptrain: error: --out: given 2 times; give it once (see 'dptrain data prepare --help')\n");
  // So is a --master-port another process listens on: not every rank failing with exit 3.
  const int holder = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  REQUIRE(holder >= 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  REQUIRE(::bind(holder, reinterpret_cast<sockaddr*>(&address), sizeof(address)) == 0);
  REQUIRE(::listen(holder, 1) == 0);
  REQUIRE(::getsockname(holder, reinterpret_cast<sockaddr*>(&address), &length) == 0);
  const std::string held = std::to_string(ntohs(address.sin_port));
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"launch", recipe.string(), "--nproc", "2"},
        std::vector<std::string>{"bench", "comm", "--nproc", "2", "-e", "1K"}}) {
    std::vector<std::string> all = args;
    all.insert(all.end(), {"--master-port", held, "--runs-root", (tmp / "runs").string()});
    auto busy = run_dptrain(all);
    CAPTURE(args[0]);
    CHECK(busy.exit_code == 2);
    CHECK(busy.err == "dptrain: error: --master-port " + held +
                          ": the store cannot listen there (cannot listen on 127.0.0.1:" + held +
                          ": Address already in use); choose another port, or leave "
                          "--master-port out for a free one\n");
    CHECK_FALSE(fs::exists(tmp / "runs"));
  }
  // And a worker that would host the store on it.
  auto hosting =
      run_dptrain({"worker", recipe.string(), "--rank", "0", "--world-size", "1", "--host-store",
                   "--store", "127.0.0.1:" + held, "--run-dir", (tmp / "hand").string()});
  CHECK(hosting.exit_code == 2);
  CHECK(hosting.err == "dptrain: error: rank 0: --host-store: the store cannot listen on port " +
                           held + " (127.0.0.1:" + held +
                           ": Address already in use); give the store (--store, DPTRAIN_STORE or "
                           "MASTER_PORT) a free port\n");
  CHECK_FALSE(fs::exists(tmp / "hand/run.json"));  // a start that failed first records nothing
  ::close(holder);
  // --dry-run refuses what the launch would: events and JSON both on stdout.
  auto dry = run_dptrain({"launch", recipe.string(), "--dry-run", "--events", "-", "--json"});
  CHECK(dry.exit_code == 2);
  CHECK(dry.err.find("--events -: not with --json") != std::string::npos);
  // A dry run refused at its options writes no events (it would write none at all), however
  // --dry-run is spelled; a launch that is no dry run ends its stream.
  for (const auto& [flag, writes] : std::vector<std::pair<std::string, bool>>{
           {"--dry-run", false}, {"--dry-run=true", false}, {"--dry-run=false", true}}) {
    CAPTURE(flag);
    const fs::path stream = tmp / "dry-events.jsonl";
    fs::remove(stream);
    auto refused = run_dptrain(
        {"launch", recipe.string(), flag, "--events", stream.string(), "--no-such-option"});
    CHECK(refused.exit_code == 2);
    CHECK(fs::exists(stream) == writes);
  }
  // An empty --hosts (an unset variable in a script) is refused, not a job on this machine alone.
  auto no_hosts = run_dptrain(
      {"launch", recipe.string(), "--hosts", "", "--runs-root", (tmp / "runs").string()});
  CHECK(no_hosts.exit_code == 2);
  CHECK(no_hosts.err.find("--hosts: empty") != std::string::npos);
  CHECK_FALSE(fs::exists(tmp / "runs"));
  // Every command's numbers are plain decimals: no hex, no values out of the option's range.
  const std::string nothing = (tmp / "nothing-here").string();
  for (const auto& [args, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"sample", nothing, "--temperature", "0x10"}, "--temperature: '0x10' is not a number"},
           {{"sample", nothing, "--temperature", "-1"},
            "--temperature: '-1' must be a finite number >= 0"},
           {{"bench", "train", recipe.string(), "--peak-tflops", "0x10"},
            "--peak-tflops: '0x10' is not a number"},
           {{"bench", "train", recipe.string(), "--peak-tflops", "0"},
            "--peak-tflops: '0' must be a finite number > 0"},
           {{"bench", "train", recipe.string(), "--min-efficiency", "1.5"},
            "--min-efficiency: '1.5' is more than 1 (it is a fraction: 0.8 for 80%)"},
           {{"bench", "train", recipe.string(), "--repeats", "-1"},
            "--repeats: '-1' must be a whole number >= 1"},
           {{"bench", "train", recipe.string(), "--repeats", "0x2"},
            "--repeats: '0x2' is not a whole number"},
           {{"bench", "train", recipe.string(), "--batch-per-rank", "0x1"},
            "--batch-per-rank: '0x1' is not a whole number"},
           {{"bench", "comm", "--root", "0x1"}, "--root: '0x1' is not a whole number"},
           {{"sample", nothing, "--tokens", "0x10"}, "--tokens: '0x10' is not a whole number"},
           {{"sample", nothing, "--top-k", "0b11"}, "--top-k: '0b11' is not a whole number"},
           {{"bench", "comm", "-w", "-1"}, "--warmup: '-1' must be a whole number >= 0"},
           {{"bench", "comm", "-n", "0x1"}, "--iters: '0x1' is not a whole number"},
           {{"launch", recipe.string(), "--master-port", "0x10"},
            "--master-port: '0x10' is not a whole number"},
           {{"doctor", "--master-port", "70000"},
            "--master-port: '70000' is out of range [0, "
            "65535]"}}) {
    std::vector<std::string> all = args;
    all.insert(all.end(), {"--runs-root", (tmp / "runs").string()});
    if (args[0] == "sample" || args[0] == "doctor") all.resize(args.size());
    auto bad = run_dptrain(all);
    CAPTURE(args);
    CHECK(bad.exit_code == 2);
    CHECK_MESSAGE(bad.err.find(says) != std::string::npos, bad.err);
  }
  CHECK_FALSE(fs::exists(tmp / "runs"));
  // A leading zero is decimal, not octal: 010 is ten, 09 nine (CLI11 alone reads 8 and refuses).
  auto zeros = run_dptrain({"launch", recipe.string(), "--master-port", "010", "--max-restarts",
                            "09", "--dry-run", "--json"});
  CHECK(zeros.exit_code == 0);
  const auto planned = parse_json(zeros.out);
  CHECK(planned["store"] == "127.0.0.1:10");
  // Without --master-port the launch picks a free port: the plan says so, not a store at port 0.
  auto free_port = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--dry-run", "--json"});
  CHECK(free_port.exit_code == 0);
  const auto chosen = parse_json(free_port.out);
  CHECK(chosen["store"] == "127.0.0.1:<port>");
  CHECK(chosen["hosts"][0]["workers"][1]["env"]["DPTRAIN_STORE"] == "127.0.0.1:<port>");
  CHECK(chosen["warnings"] == nlohmann::json::array());
  // A fault injection that would never fire: warned of on stderr and in the plan's JSON.
  auto never = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--dry-run", "--json"},
                           {{"DPTRAIN_FAULT", "crash@step=3,rank=5"}});
  CHECK(never.exit_code == 0);
  REQUIRE(parse_json(never.out)["warnings"].size() == 1);
  CHECK(contains(parse_json(never.out)["warnings"][0].get<std::string>(), "never fires"));
  CHECK(contains(never.err, "dptrain: warning: DPTRAIN_FAULT"));
  auto free_text = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--dry-run"});
  CHECK(free_text.out.starts_with("store 127.0.0.1:<port>, 2 rank(s) on 1 host(s)"));
  auto top_k = run_dptrain({"sample", nothing, "--top-k", "09", "--tokens", "010"});
  CHECK_MESSAGE(top_k.err == "dptrain: error: " + nothing + ": no such run directory\n", top_k.err);
  // Unsigned options do not wrap a negative value around.
  auto seed = run_dptrain({"sample", (tmp / "nothing-here").string(), "--seed", "-1"});
  CHECK(seed.exit_code == 2);
  CHECK_MESSAGE(seed.err.find("'-1' must be a whole number >= 0") != std::string::npos, seed.err);
  // A file where a run directory should be is named as such.
  auto file = run_dptrain({"status", (tmp / "afile").string()});
  CHECK(file.exit_code == 2);
  CHECK_MESSAGE(
      file.err.find((tmp / "afile").string() + ": not a run directory") != std::string::npos,
      file.err);
  auto resume = run_dptrain({"resume", (tmp / "nothing-here").string()});
  CHECK(resume.exit_code == 2);
  CHECK(resume.err.find("nothing-here: no such run directory") != std::string::npos);
}

TEST_CASE("an empty option value, or an option in its place, is refused, not read as 0 or a name") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const std::string runs = (tmp / "runs").string();
  // An unset variable in a script ("--run-dir $DIR"): one line naming the option, exit 2, and
  // nothing made or run with a default in its place.
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"launch", recipe.string(), "--run-dir", "", "--runs-root", runs},
           {"launch", recipe.string(), "--nproc", "", "--runs-root", runs},
           {"launch", recipe.string(), "--events", "", "--runs-root", runs},
           {"launch", "", "--runs-root", runs},
           {"bench", "comm", "--iters", "", "--runs-root", runs},
           {"data", "prepare", "--text", recipe.string(), "--out", (tmp / "ds").string(),
            "--val-fraction", ""},
           // Options with checks of their own (a whole number, a number >= 0, seconds).
           {"launch", recipe.string(), "--max-restarts", "", "--runs-root", runs},
           {"launch", recipe.string(), "--hang-timeout", "", "--runs-root", runs},
           {"sample", runs, "--tokens", ""},
           {"worker", recipe.string(), "--rank", "", "--run-dir", runs}}) {
    const auto named = std::find(args.begin(), args.end(), "");
    const std::string option = named[-1].starts_with("-") ? named[-1] : std::string("recipe");
    CAPTURE(option);
    auto r = run_dptrain(args);
    CHECK(r.exit_code == 2);
    CHECK_MESSAGE(r.err.starts_with("dptrain: error: " + option + ": is empty; give a value (see"),
                  r.err);
    CHECK(lines_of(r.err).size() == 1);
  }
  CHECK_FALSE(fs::exists(tmp / "runs"));
  CHECK_FALSE(fs::exists(tmp / "ds"));
  // An option left without its value at the end.
  auto last = run_dptrain({"launch", recipe.string(), "--runs-root", runs, "--run-dir"});
  CHECK(last.exit_code == 2);
  CHECK(last.err == "dptrain: error: --run-dir: no value given (see 'dptrain launch --help')\n");
  // "--run-dir=" (a script's --run-dir="$DIR"): an empty value, wherever it stands; the argument
  // after it is not taken for the value.
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"launch", recipe.string(), "--runs-root", runs, "--run-dir="},
           {"launch", recipe.string(), "--run-dir=", "--nproc", "1", "--runs-root", runs},
           {"launch", recipe.string(), "--run-dir=", (tmp / "taken").string(), "--runs-root",
            runs}}) {
    auto r = run_dptrain(args);
    CHECK(r.exit_code == 2);
    CHECK_MESSAGE(
        r.err.starts_with("dptrain: error: --run-dir: is empty; give a value (see 'dptrain "
                          "launch --help')\n"),
        r.err);
  }
  CHECK_FALSE(fs::exists(tmp / "taken"));
  // A flag written "--json=" is the flag given (not split into it and an empty argument).
  auto flag_attached = run_dptrain({"status", "--json=", (tmp / "none").string()});
  CHECK(flag_attached.exit_code == 2);
  CHECK(
      contains(parse_json(flag_attached.out)["error"].get<std::string>(), (tmp / "none").string()));
  // Arguments left over are named in the order given.
  auto extra = run_dptrain({"status", (tmp / "none").string(), "extra1", "extra 2"});
  CHECK(extra.exit_code == 2);
  CHECK(extra.err ==
        "dptrain: error: unexpected arguments 'extra1', 'extra 2' (see 'dptrain "
        "status --help')\n");
  // Also where "--" hands the rest back to the command's parent.
  auto after_dashes = run_dptrain({"status", (tmp / "none").string(), "extra1", "--", "extra2"});
  CHECK(after_dashes.exit_code == 2);
  CHECK(after_dashes.err ==
        "dptrain: error: unexpected arguments 'extra1', 'extra2' (see "
        "'dptrain status --help')\n");
  // "--json" after "--" is such an argument, not the flag: no JSON.
  auto json_after_dashes = run_dptrain({"status", (tmp / "none").string(), "--", "--json"});
  CHECK(json_after_dashes.exit_code == 2);
  CHECK(json_after_dashes.out.empty());
  CHECK(json_after_dashes.err ==
        "dptrain: error: unexpected argument '--json' (see 'dptrain status --help')\n");
  auto one_extra = run_dptrain({"launch", recipe.string(), "--runs-root", runs, "extra"});
  CHECK(one_extra.exit_code == 2);
  CHECK(one_extra.err ==
        "dptrain: error: unexpected argument 'extra' (see 'dptrain launch --help')\n");
  // An internal option (not in --help) is named too, not as ''.
  auto hidden = run_dptrain({"bench", "comm", "--worker"});
  CHECK(hidden.exit_code == 2);
  CHECK(hidden.err ==
        "dptrain: error: --worker: no value given (see 'dptrain bench comm --help')\n");
  CHECK_FALSE(fs::exists(tmp / "runs"));
  // An unquoted empty $OUT: "--out --json" is not a file named --json and no JSON asked for.
  auto swallowed = run_dptrain({"report", (tmp / "none").string(), "--out", "--json"});
  CHECK(swallowed.exit_code == 2);
  CHECK(swallowed.err ==
        "dptrain: error: --out: got the option --json where its value belongs; give --out a value "
        "(see 'dptrain report --help')\n");
  CHECK(parse_json(swallowed.out)["exit_code"] == 2);
  auto short_name = run_dptrain({"launch", recipe.string(), "--nproc", "-h", "--runs-root", runs});
  CHECK(short_name.exit_code == 2);
  CHECK(contains(short_name.err, "--nproc: got the option -h where its value belongs"));
  CHECK_FALSE(fs::exists(tmp / "runs"));
  // An option that takes '' (sample's empty prompt) still refuses an option as its value.
  auto prompt = run_dptrain({"sample", (tmp / "none").string(), "--prompt", "--json"});
  CHECK(prompt.exit_code == 2);
  CHECK(contains(prompt.err, "--prompt: got the option --json where its value belongs"));
  // A number's option says so too (not that '--json' is not a number).
  for (const char* option : {"--tokens", "--temperature"}) {
    auto number = run_dptrain({"sample", (tmp / "none").string(), option, "--json"});
    CHECK(number.exit_code == 2);
    CHECK_MESSAGE(contains(number.err,
                           std::string(option) + ": got the option --json where its value belongs"),
                  number.err);
  }
  // "--prompt=" is the empty prompt that option takes: the command goes on, and --json after it
  // is --json (it meets the run that is not there).
  auto empty_prompt =
      run_dptrain({"sample", (tmp / "none").string(), "--tokens", "3", "--prompt=", "--json"});
  CHECK(empty_prompt.exit_code == 2);
  CHECK_FALSE(contains(empty_prompt.err, "where its value belongs"));
  CHECK(
      contains(parse_json(empty_prompt.out)["error"].get<std::string>(), (tmp / "none").string()));
  // Written attached, the value is the one meant: the command goes on (and meets the run that
  // is not there).
  auto attached = run_dptrain({"sample", (tmp / "none").string(), "--prompt=--json"});
  CHECK(attached.exit_code == 2);
  CHECK_FALSE(contains(attached.err, "where its value belongs"));
  CHECK(contains(attached.err, (tmp / "none").string()));
}

TEST_CASE("a remote path under ~user is refused: only ~ and ~/ are the login's home") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  for (const std::vector<std::string>& args : std::vector<std::vector<std::string>>{
           {"launch", recipe.string(), "--hosts", "localhost", "--workdir", "~root/x"},
           {"resume", (tmp / "none").string(), "--remote-binary", "~root/bin/dptrain"},
           {"doctor", "--hosts", "localhost", "--workdir", "~root/x"},
           {"provision", "--hosts", "localhost", "--workdir", "~root/x"}}) {
    CAPTURE(args[0]);
    auto r = run_dptrain(args);
    CHECK(r.exit_code == 2);
    CHECK_MESSAGE(contains(r.err, "'~root/"), r.err);
    CHECK_MESSAGE(contains(r.err,
                           ": only ~ and ~/ (the login's home on each host) are "
                           "expanded; give an absolute path or one under ~/"),
                  r.err);
    CHECK(lines_of(r.err).size() == 1);
  }
}

TEST_CASE("paths through a symbolic link and '..' mean what the kernel makes of them") {
  // sub -> a/b, so sub/../x is a/x, not ./x: a run there never touches ./x, an existing run.
  TempDir tmp;
  fs::create_directories(tmp / "a/b");
  fs::create_directory_symlink(tmp / "a/b", tmp / "sub");
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  REQUIRE(run_dptrain({"launch", recipe.string(), "--run-dir", (tmp / "x").string()}).exit_code ==
          0);
  const std::string kept = read_text(tmp / "x/run.json");
  auto through = run_dptrain({"launch", recipe.string(), "--run-dir", (tmp / "sub/../x").string()});
  INFO(through.err);
  CHECK(through.exit_code == 0);
  CHECK(read_text(tmp / "x/run.json") == kept);
  CHECK(parse_json(read_text(tmp / "a/x/run.json"))["status"] == "completed");
  // A recipe's relative data.path too: from sub/r.json, ../d.csv is a/d.csv.
  write_text(tmp / "a/d.csv", "f0,label\n1,0\n");
  write_text(tmp / "d.csv", "f0,label\n1,0\n");
  write_text(tmp / "a/b/r.json",
             R"({"model": {"input": 1}, "data": {"type": "csv", "path": "../d.csv"}})");
  auto shown = run_dptrain({"recipe", "show", (tmp / "sub/r.json").string()});
  INFO(shown.err);
  REQUIRE(shown.exit_code == 0);
  CHECK(parse_json(shown.out)["data"]["path"] == fs::canonical(tmp / "a/d.csv").string());
}

TEST_CASE("a run.json that is a directory or not JSON is named plainly, without parser internals") {
  TempDir tmp;
  fs::create_directories(tmp / "dir/run.json");
  fs::create_directories(tmp / "cut");
  fs::create_directories(tmp / "empty");
  write_text(tmp / "cut/run.json", "{\"status\":\n");
  write_text(tmp / "empty/run.json", "");
  for (const char* cmd : {"status", "resume", "report"}) {
    CAPTURE(cmd);
    auto dir = run_dptrain({cmd, (tmp / "dir").string()});
    CHECK(dir.exit_code == 2);
    CHECK_MESSAGE(dir.err.find((tmp / "dir/run.json").string() +
                               ": is a directory, not a regular file") != std::string::npos,
                  dir.err);
    auto cut = run_dptrain({cmd, (tmp / "cut").string()});
    CHECK(cut.exit_code == 2);
    CHECK_MESSAGE(cut.err.find((tmp / "cut/run.json").string() +
                               ": not valid JSON at line 2, column 1: ") != std::string::npos,
                  cut.err);
    auto empty = run_dptrain({cmd, (tmp / "empty").string()});
    CHECK(empty.exit_code == 2);
    CHECK_MESSAGE(
        empty.err.find((tmp / "empty/run.json").string() + ": empty file") != std::string::npos,
        empty.err);
    for (const auto& err : {dir.err, cut.err, empty.err})
      CHECK(err.find("json.exception") == std::string::npos);
  }
}

TEST_CASE("resume, status, report: a run.json field of the wrong type is named, nothing changed") {
  using nlohmann::json;
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const fs::path run = tmp / "run";
  auto failed = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", run.string()},
                            Env{{"DPTRAIN_FAULT", "exit@step=3,rank=1,code=7"}});
  REQUIRE(failed.exit_code == 3);
  const json good = parse_json(read_text(run / "run.json"));
  const std::vector<std::pair<std::string, json>> edits = {
      {"/world_size", "two"},       {"/id", 5},
      {"/generations", "x"},        {"/hosts", "localhost"},
      {"/generations/0/status", 9}, {"/hosts/0", "localhost"},
      {"/generations/0", nullptr},  {"/world_size", 0}};
  for (const auto& [pointer, value] : edits) {
    json edited = good;
    edited[json::json_pointer(pointer)] = value;
    const std::string text = edited.dump(2);
    write_text(run / "run.json", text);
    // status and report show a field of another type as unknown or null; an entry of a list
    // that is not an object they name, as resume does.
    const bool entry = pointer == "/generations/0" || pointer == "/hosts/0";
    for (const std::string command : {"resume", "status", "report"}) {
      if (command != "resume" && !entry) continue;
      CAPTURE(pointer);
      CAPTURE(command);
      auto r = run_dptrain({command, run.string(), "--json"});
      CHECK(r.exit_code == 2);
      CHECK_MESSAGE(r.err.starts_with("dptrain: error: " + (run / "run.json").string() + ": " +
                                      pointer + ": expected "),
                    r.err);
      CHECK(r.err.find("json.exception") == std::string::npos);
      CHECK(parse_json(r.out)["exit_code"] == 2);
      CHECK(read_text(run / "run.json") == text);  // not rewritten as a failed launch
    }
  }
}

TEST_CASE("a current directory that was deleted is named as the cause of a relative path's error") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const fs::path gone = tmp / "gone";
  const auto in_deleted_cwd = [&](const std::string& args) {
    fs::create_directory(gone);
    const std::string command = "cd '" + gone.string() + "' && rmdir '" + gone.string() +
                                "' && exec '" + binary() + "' " + args + " 2> '" +
                                (tmp / "err").string() + "' > /dev/null";
    const int status = std::system(("bash -c \"" + command + "\"").c_str());
    REQUIRE(WIFEXITED(status));
    return std::make_pair(WEXITSTATUS(status), read_text(tmp / "err"));
  };
  const auto [status_code, status_err] = in_deleted_cwd("status runs/x");
  CHECK(status_code == 1);
  CHECK(status_err ==
        "dptrain: error: runs/x: cannot make absolute path: No such file or directory (the current "
        "directory no longer exists)\n");
  const auto [launch_code, launch_err] = in_deleted_cwd("launch '" + recipe.string() + "'");
  CHECK(launch_code == 2);
  CHECK(launch_err ==
        "dptrain: error: runs: cannot create run directory: No such file or "
        "directory (the current directory no longer exists)\n");
}

TEST_CASE("recipe validate: what is not a recipe's size or shape is refused, not read for ever") {
  // /dev/zero (or a log named by mistake) is refused at 16 MiB, not read until memory runs out.
  auto zero = run_dptrain({"recipe", "validate", "/dev/zero"}, {}, std::chrono::seconds(60));
  CHECK(zero.exit_code == 2);
  CHECK(zero.err ==
        "dptrain: error: /dev/zero: more than 16 MiB; a recipe is a JSON file of a few KiB (is "
        "this the recipe?)\n");
  // A million objects under an unknown key: named at once. Parsing took time quadratic in their
  // number (hours for these) while the duplicate-key check used json::parse's callback.
  TempDir tmp;
  std::string notes = R"({"name": "many", "notes": [{})";
  for (int i = 1; i < 1000000; ++i)
    notes += ",{}";
  write_text(tmp / "many.json", notes + "]}");
  auto many = run_dptrain({"recipe", "validate", (tmp / "many.json").string()}, {},
                          std::chrono::seconds(60));
  CHECK(many.exit_code == 2);
  CHECK(many.err ==
        "dptrain: error: " + (tmp / "many.json").string() + ": /notes: unknown key 'notes'\n");
}

TEST_CASE("recipe validate: a key or file name with a newline or escape stays on its line") {
  TempDir tmp;
  const fs::path file = tmp / "odd\nname.json";
  write_text(file, R"({"train": {"st\neps": 1, "a\u001b[31mb": 2}, "x": 1, "x": 2})");
  const std::string shown = (tmp / "odd\\x0aname.json").string();
  auto r = run_dptrain({"recipe", "validate", file.string(), "--json"});
  CHECK(r.exit_code == 2);
  const std::vector<std::string> expected = {
      shown + ": /x: duplicate key 'x': the object sets it twice",
      shown + ": /train/a\\x1b[31mb: unknown key 'a\\x1b[31mb'",
      shown + ": /train/st\\x0aeps: unknown key 'st\\x0aeps'; did you mean 'steps'?",
      shown + ": /x: unknown key 'x'"};
  CHECK(parse_json(r.out)["errors"] == nlohmann::json(expected));
  std::string lines;
  for (const auto& line : expected)
    lines += "dptrain: error: " + line + "\n";
  CHECK(r.err == lines);
}

TEST_CASE("text output: a path with a control character stays on its line, as status shows it") {
  TempDir tmp;
  nlohmann::json recipe = small_recipe();
  recipe["train"]["steps"] = 3;
  recipe["optimizer"]["schedule"]["warmup"] = 1;
  const fs::path file = tmp / "odd\nname.json";
  write_text(file, recipe.dump());
  auto validated = run_dptrain({"recipe", "validate", file.string()});
  REQUIRE_MESSAGE(validated.exit_code == 0, validated.err);
  CHECK(validated.out.starts_with((tmp / "odd\\x0aname.json").string() + ": ok (recipe '"));
  // A run directory so named: report's last line names report.html in it as status names it.
  const fs::path run = tmp / "run\tx";
  auto launched = run_dptrain({"launch", file.string(), "--run-dir", run.string()});
  REQUIRE_MESSAGE(launched.exit_code == 0, launched.err);
  const std::string shown = (tmp / "run\\x09x").string();
  CHECK(run_dptrain({"status", run.string()}).out.starts_with(shown + ": completed"));
  auto reported = run_dptrain({"report", run.string()});
  REQUIRE_MESSAGE(reported.exit_code == 0, reported.err);
  CHECK(contains(reported.out, "\nreport: " + shown + "/report.html\n"));
  // A dataset prepared into such a directory.
  write_text(tmp / "text.txt", synthetic_text(1, 20000));
  auto prepared = run_dptrain({"data", "prepare", "--text", (tmp / "text.txt").string(), "--out",
                               (tmp / "ds\x01x").string()});
  REQUIRE_MESSAGE(prepared.exit_code == 0, prepared.err);
  CHECK(contains(prepared.out, "path          " + (tmp / "ds\\x01x").string() + "\n"));
}

TEST_CASE("recipe validate: a number beyond a double is invalid JSON, exit 2, in JSON too") {
  TempDir tmp;
  write_text(tmp / "inf.json", R"({"optimizer": {"lr": 1e400}})");
  auto plain = run_dptrain({"recipe", "validate", (tmp / "inf.json").string()});
  CHECK(plain.exit_code == 2);
  CHECK_MESSAGE(plain.err.find((tmp / "inf.json").string() +
                               ": not valid JSON at line 1, column 22: ") != std::string::npos,
                plain.err);
  CHECK(plain.err.find("1e400") != std::string::npos);
  auto json = run_dptrain({"recipe", "validate", (tmp / "inf.json").string(), "--json"});
  CHECK(json.exit_code == 2);
  CHECK(parse_json(json.out)["valid"] == false);
  // A recipe file that cannot be read still answers with one JSON object naming it.
  auto missing = run_dptrain({"recipe", "validate", (tmp / "none.json").string(), "--json"});
  CHECK(missing.exit_code == 2);
  const auto missing_out = parse_json(missing.out);
  CHECK(missing_out["valid"] == false);
  CHECK(missing_out["errors"][0].get<std::string>().find((tmp / "none.json").string() +
                                                         ": cannot read") == 0);
  // Its usage errors too: "valid" is on every answer.
  auto usage = run_dptrain({"recipe", "validate", "--json"});
  CHECK(usage.exit_code == 2);
  const auto usage_out = parse_json(usage.out);
  CHECK(usage_out["valid"] == false);
  CHECK(usage_out["warnings"] == nlohmann::json::array());
  CHECK(usage_out["status"] == "error");
  CHECK(usage_out["exit_code"] == 2);
}

TEST_CASE("recipe validate and show") {
  TempDir tmp;
  const auto good = write_recipe(tmp.path(), small_recipe());
  auto ok = run_dptrain({"recipe", "validate", good.string()});
  CHECK(ok.exit_code == 0);
  CHECK(ok.out.find("ok") != std::string::npos);

  auto shown = run_dptrain({"recipe", "show", good.string()});
  REQUIRE(shown.exit_code == 0);
  const auto resolved = parse_json(shown.out);
  CHECK(resolved["model"]["hidden"] == nlohmann::json({48, 24}));
  CHECK(resolved["optimizer"]["beta2"].get<double>() == doctest::Approx(0.999));  // a default
  CHECK(resolved["distributed"]["bucket_mb"].get<double>() == doctest::Approx(25.0));
  // --json: one object, the same recipe in it, with what validate --json says of it.
  auto shown_json = run_dptrain({"recipe", "show", good.string(), "--json"});
  REQUIRE(shown_json.exit_code == 0);
  const auto object = parse_json(shown_json.out);
  CHECK(object["recipe"] == resolved);
  CHECK(object["status"] == "ok");
  CHECK(object["exit_code"] == 0);
  CHECK(object["parameters"].get<int64_t>() > 0);
  const auto validated =
      parse_json(run_dptrain({"recipe", "validate", good.string(), "--json"}).out);
  CHECK(object["hash"] == validated["hash"]);
  CHECK(object["model"] == validated["model"]);
  CHECK(std::count(shown_json.out.begin(), shown_json.out.end(), '\n') == 1);

  auto bad_json = small_recipe();
  bad_json["optimizer"]["lr"] = -1;
  bad_json["train"]["batch_per_rank"] = 0;
  bad_json["model"]["hiden"] = {3};
  const auto bad = write_recipe(tmp.path(), bad_json, "bad.json");
  auto v = run_dptrain({"recipe", "validate", bad.string()});
  CHECK(v.exit_code == 2);
  CHECK(v.err.find("/optimizer/lr") != std::string::npos);
  CHECK(v.err.find("/train/batch_per_rank") != std::string::npos);
  CHECK(v.err.find("did you mean 'hidden'") != std::string::npos);
  auto vj = run_dptrain({"recipe", "validate", bad.string(), "--json"});
  CHECK(vj.exit_code == 2);
  const auto j = parse_json(vj.out);
  CHECK(j["valid"] == false);
  CHECK(j["errors"].size() == 3);
  auto sj = run_dptrain({"recipe", "show", bad.string(), "--json"});
  CHECK(sj.exit_code == 2);
  const auto shown_bad = parse_json(sj.out);
  CHECK(shown_bad["status"] == "error");
  CHECK(shown_bad["errors"].size() == 3);

  // What the model says of the other settings: a PowerSGD rank that factorises no matrix (the
  // small recipe's 32-48-24-5 MLP gains up to rank 19).
  auto lever_json = small_recipe();
  lever_json["distributed"]["compression"] = {{"type", "powersgd"}, {"rank", 40}};
  const auto lever = write_recipe(tmp.path(), lever_json, "lever.json");
  auto l = run_dptrain({"recipe", "validate", lever.string()});
  CHECK(l.exit_code == 2);
  CHECK(l.err.find(lever.string() + ": /distributed/compression/rank: 40 compresses none") !=
        std::string::npos);
  auto launched = run_dptrain({"launch", lever.string(), "--run-dir", (tmp / "lever").string()});
  CHECK(launched.exit_code == 2);
  CHECK_FALSE(fs::exists(tmp / "lever"));
}

TEST_CASE("a recipe from process substitution finds relative data from the current directory") {
  TempDir tmp;
  write_text(tmp / "data.csv", "0,1,2\n1,3,4\n2,5,6\n");
  auto recipe = small_recipe();
  recipe["model"] = {{"type", "mlp"}, {"input", 2}, {"hidden", {8}}, {"classes", 3}};
  recipe["data"] = {{"type", "csv"}, {"path", "data.csv"}};
  const auto path = write_recipe(tmp.path(), recipe);
  // <(...) is /dev/fd/63, a link into /proc/PID/fd: no folder of its own to start from.
  const std::string command = "cd '" + tmp.path().string() + "' && exec '" + binary() +
                              "' recipe show <(cat '" + path.string() + "') > out 2> err";
  const int status = std::system(("bash -c \"" + command + "\"").c_str());
  INFO(read_text(tmp / "err"));
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
  CHECK(parse_json(read_text(tmp / "out"))["data"]["path"] == (tmp / "data.csv").string());
}

TEST_CASE("recipe validate: every wrong row of a CSV dataset, one line each, as launch finds it") {
  TempDir tmp;
  write_text(tmp / "data.csv",
             "label,f0,f1\n0,1,2\n1,3,4\n5,1,1\n-1,1,1\n1.5,1,1\none,1,1\n2,1,x\n");
  auto recipe = small_recipe();
  recipe["model"] = {{"type", "mlp"}, {"input", 2}, {"hidden", {8}}, {"classes", 3}};
  recipe["data"] = {{"type", "csv"}, {"path", "data.csv"}};
  const auto path = write_recipe(tmp.path(), recipe);
  const std::string csv = (tmp / "data.csv").string();
  const std::vector<std::string> expected = {
      csv + ":4: label 5 is outside [0, 3) (model.classes is 3)",
      csv + ":5: label -1 is outside [0, 3) (model.classes is 3)",
      csv + ":6: label '1.5' is not an integer", csv + ":7: label 'one' is not a number",
      csv + ":8: column 3 'x' is not a finite number"};

  auto v = run_dptrain({"recipe", "validate", path.string()});
  CHECK(v.exit_code == 2);
  for (const auto& line : expected) {
    CHECK_MESSAGE(v.err.find(path.string() + ": /data/path: " + line + "\n") != std::string::npos,
                  v.err);
  }
  auto vj = run_dptrain({"recipe", "validate", path.string(), "--json"});
  CHECK(vj.exit_code == 2);
  const auto j = parse_json(vj.out);
  CHECK(j["valid"] == false);
  CHECK(j["exit_code"] == 2);
  REQUIRE(j["errors"].size() == expected.size());
  for (size_t i = 0; i < expected.size(); ++i)
    CHECK(j["errors"][i] == path.string() + ": /data/path: " + expected[i]);

  // The launch refuses the file for the same rows, before anything runs, in the same words.
  auto launched = run_dptrain({"launch", path.string(), "--run-dir", (tmp / "run").string()});
  CHECK(launched.exit_code == 2);
  for (const auto& line : expected) {
    CHECK_MESSAGE(
        contains(launched.err, "dptrain: error: " + path.string() + ": /data/path: " + line + "\n"),
        launched.err);
  }
  CHECK_FALSE(fs::exists(tmp / "run"));

  // Its rows' split too, as the launch splits them: a held-out share that leaves none, or fewer
  // training rows than one rank's batch (one line naming the field, not /data/path as well).
  write_text(tmp / "data.csv", "label,f0,f1\n0,1,2\n1,3,4\n2,1,1\n");
  recipe["data"]["eval_fraction"] = 0.9;
  write_recipe(tmp.path(), recipe);
  const std::string none = path.string() +
                           ": /data/eval_fraction: 0.9 of 3 samples leaves none "
                           "for training\n";
  auto split = run_dptrain({"recipe", "validate", path.string()});
  CHECK(split.exit_code == 2);
  CHECK(split.err == "dptrain: error: " + none);
  auto split_launch = run_dptrain({"launch", path.string(), "--run-dir", (tmp / "run").string()});
  CHECK(split_launch.exit_code == 2);
  CHECK_MESSAGE(contains(split_launch.err, "dptrain: error: " + none), split_launch.err);
  recipe["data"].erase("eval_fraction");
  write_recipe(tmp.path(), recipe);
  auto small = run_dptrain({"recipe", "validate", path.string()});
  CHECK(small.exit_code == 2);
  CHECK_MESSAGE(contains(small.err, path.string() +
                                        ": /train/batch_per_rank: 3 training samples (the 3 "
                                        "data row(s) of \"" +
                                        csv +
                                        "\" less the "
                                        "/data/eval_fraction share) are fewer than one rank's "
                                        "batch (16 x 1 train.grad_accum), even on one rank"),
                small.err);
  CHECK(run_dptrain({"launch", path.string(), "--run-dir", (tmp / "run").string()}).exit_code == 2);
  CHECK_FALSE(fs::exists(tmp / "run"));
  recipe["train"]["batch_per_rank"] = 1;
  write_recipe(tmp.path(), recipe);
  auto ok = run_dptrain({"recipe", "validate", path.string()});
  CHECK_MESSAGE(ok.exit_code == 0, ok.err);
}

TEST_CASE("a bad recipe runs nothing: exit 2, one line per problem, no run directory") {
  TempDir tmp;
  struct Case {
    const char* pointer;
    nlohmann::json value;
  };
  const std::vector<Case> cases = {
      {"/train/steps", -5},       {"/train/batch_per_rank", 0},   {"/model/classes", 1},
      {"/model/hidden", {64, 0}}, {"/optimizer/type", "adagrad"}, {"/data/type", "imagenet"},
  };
  for (const auto& c : cases) {
    CAPTURE(c.pointer);
    auto recipe = small_recipe();
    recipe[nlohmann::json::json_pointer(c.pointer)] = c.value;
    const auto path = write_recipe(tmp.path(), recipe);
    auto r = run_dptrain({"launch", path.string(), "--nproc", "2", "--runs-root",
                          (tmp / "runs").string(), "--json"});
    CHECK(r.exit_code == 2);
    CHECK(r.err.find(c.pointer) != std::string::npos);
    CHECK(parse_json(r.out)["exit_code"] == 2);
    CHECK_FALSE(fs::exists(tmp / "runs"));
  }
  auto missing = run_dptrain({"launch", (tmp / "absent.json").string()});
  CHECK(missing.exit_code == 2);
  CHECK(missing.err.find("absent.json") != std::string::npos);
}

TEST_CASE("a model this machine's memory cannot hold is refused before anything starts") {
  TempDir tmp;
  // 2 ranks of quickstart's MLP (269,322 parameters) with AdamW: 4.1 MiB each, at the least,
  // and 300 synthetic samples (0.9 MiB).
  nlohmann::json small_data = parse_json(read_text(source_dir() / "recipes/quickstart.json"));
  small_data["data"]["samples"] = 300;
  const fs::path recipe = write_recipe(tmp.path(), small_data);
  write_text(tmp / "meminfo", "MemTotal: 1000000 kB\nMemAvailable: 6000 kB\n");
  const Env small = {{"DPTRAIN_TEST_MEMINFO", (tmp / "meminfo").string()}};
  auto r = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--runs-root", (tmp / "runs").string(), "--json"},
      small);
  CHECK(r.exit_code == 2);
  CHECK_MESSAGE(r.err == "dptrain: error: " + recipe.string() +
                             ": /model: its 269322 parameters take at least 4.1 MiB a rank "
                             "(parameters, gradients and the AdamW state, in f32, before any "
                             "activation), 10.0 MiB for the 2 rank(s) on this machine with their "
                             "synthetic data (922.3 KiB a rank), which has 5.9 MiB available "
                             "(MemAvailable): a smaller model, or fewer ranks here\n",
                r.err);
  CHECK(parse_json(r.out)["exit_code"] == 2);
  CHECK_FALSE(fs::exists(tmp / "runs"));
  // One rank fits.
  auto one = run_dptrain({"launch", recipe.string(), "--nproc", "1", "--dry-run"}, small);
  CHECK_MESSAGE(one.exit_code == 0, one.err);
  // Synthetic data every rank generates whole, larger than the model: named.
  auto data = run_dptrain(
      {"launch", (source_dir() / "recipes/quickstart.json").string(), "--nproc", "1", "--dry-run"},
      small);
  CHECK(data.exit_code == 2);
  CHECK(contains(data.err,
                 "quickstart.json: /data/samples: its 20000 samples of 784 features "
                 "take 60.0 MiB a rank (every rank generates the whole synthetic set, "
                 "in f32), 64.2 MiB for the 1 rank(s) on this machine"));
}

TEST_CASE("a run directory too deep for its files, or a dangling link, is refused up front") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  // Below the system's limit itself, but with no room for a checkpoint's files under it.
  fs::path deep = tmp / "deep";
  while (deep.string().size() < 4000)
    deep /= std::string(200, 'd');
  for (const auto& [option, path] :
       std::vector<std::pair<std::string, fs::path>>{{"--run-dir", deep}, {"--runs-root", deep}}) {
    CAPTURE(option);
    auto r = run_dptrain({"launch", recipe.string(), option, path.string()});
    CHECK(r.exit_code == 2);
    CHECK(r.err.rfind("dptrain: error: " + option + ": " + (tmp / "deep").string(), 0) == 0);
    CHECK(contains(r.err, "bytes on a path; choose a shorter one\n"));
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
    CHECK_FALSE(fs::exists(tmp / "deep"));
  }
  fs::create_symlink("missing", tmp / "link");
  auto r = run_dptrain({"launch", recipe.string(), "--run-dir", (tmp / "link").string()});
  CHECK(r.exit_code == 2);
  CHECK(r.err == "dptrain: error: " + (tmp / "link").string() +
                     ": a symbolic link to missing, which does not exist: create the directory it "
                     "names, or choose another --run-dir\n");
}

TEST_CASE("train.device cuda where no GPU is visible: exit 1, one line, no run directory") {
  TempDir tmp;
  auto recipe = small_recipe();
  recipe["train"]["device"] = "cuda";
  const auto path = write_recipe(tmp.path(), recipe);
  auto r =
      run_dptrain({"launch", path.string(), "--nproc", "2", "--runs-root", (tmp / "runs").string()},
                  {{"CUDA_VISIBLE_DEVICES", ""}});
  CHECK(r.exit_code == 1);
  CHECK(r.err.find("train.device \"cuda\": 2 rank(s) on this machine need a GPU each") !=
        std::string::npos);
  CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  CHECK_FALSE(fs::exists(tmp / "runs"));

  // The plan still shows what each rank would get: its own GPU.
  auto plan = run_dptrain({"launch", path.string(), "--nproc", "2", "--dry-run", "--json"},
                          {{"CUDA_VISIBLE_DEVICES", "3,1"}});
  REQUIRE(plan.exit_code == 0);
  // A plan may be drafted away from the GPUs: what the launch would refuse here is a warning.
  CHECK(plan.err.find("dptrain: warning: train.device \"cuda\": 2 rank(s) on this machine need "
                      "a GPU each") != std::string::npos);
  CHECK(plan.err.find("(the plan is shown all the same)") != std::string::npos);
  CHECK(std::count(plan.out.begin(), plan.out.end(), '\n') == 1);  // one line, as every --json
  CHECK(parse_json(plan.out)["status"] == "planned");
  // Its JSON carries the warning, as a launch's does its own.
  REQUIRE(parse_json(plan.out)["warnings"].size() == 1);
  CHECK(plan.err ==
        "dptrain: warning: " + parse_json(plan.out)["warnings"][0].get<std::string>() + "\n");
  const auto workers = parse_json(plan.out)["hosts"][0]["workers"];
  // The exact command: the run directory (under the relative --runs-root) as the ranks get it.
  CHECK(fs::path(workers[0]["command"][2].get<std::string>()).is_absolute());
  CHECK(workers[0]["env"]["CUDA_VISIBLE_DEVICES"] == "3");
  CHECK(workers[1]["env"]["CUDA_VISIBLE_DEVICES"] == "1");

  // 16-bit compute needs the GPU: the recipe says so before anything starts.
  recipe["train"]["device"] = "cpu";
  recipe["train"]["precision"] = "bf16";
  auto bf16 = run_dptrain({"launch", write_recipe(tmp.path(), recipe).string(), "--nproc", "1"});
  CHECK(bf16.exit_code == 2);
  CHECK(bf16.err.find("/train/precision") != std::string::npos);
}

TEST_CASE("agent: a stop signal while it waits for its plan ends it, no rank started") {
  TempDir tmp;
  for (const int sig : {SIGTERM, SIGINT}) {
    CAPTURE(sig);
    // Its stdin a pipe kept open and empty, as an SSH channel before the launcher writes.
    int feed[2];
    REQUIRE(::pipe(feed) == 0);
    const fs::path err = tmp / "agent.err";
    const std::string bin = binary();  // nothing but system calls after the fork
    const pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {
      ::dup2(feed[0], 0);
      const int e = ::open(err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(e, 2);
      ::close(feed[1]);
      ::execl(bin.c_str(), bin.c_str(), "agent", static_cast<char*>(nullptr));
      ::_exit(127);
    }
    ::close(feed[0]);
    REQUIRE(eventually([&] { return catches_signal(pid, sig); }));
    REQUIRE(::kill(pid, sig) == 0);
    // Bounded: a signal handled just before the agent began its wait once left it waiting for
    // ever (a blocking read), and the suite with it.
    int status = 0;
    const bool ended = eventually([&] { return ::waitpid(pid, &status, WNOHANG) == pid; },
                                  std::chrono::seconds(30));
    if (!ended) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
    }
    REQUIRE(ended);
    ::close(feed[1]);
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == (sig == SIGINT ? 130 : 143));
    CHECK(read_text(err) == std::string("dptrain: error: dptrain agent: stopped by ") +
                                (sig == SIGINT ? "SIGINT" : "SIGTERM") +
                                " before its plan came; no rank was started\n");
  }
}

TEST_CASE("agent: a plan of another protocol (another build launched it) is refused, exit 4") {
  TempDir tmp;
  // A plan as an older launcher wrote it (no protocol number) and one from a newer.
  for (const std::string& protocol : {std::string(), std::string(",\"protocol\":999")}) {
    CAPTURE(protocol);
    write_text(tmp / "plan", "{\"host\":\"node7\",\"run_dir\":\"" + (tmp / "run").string() +
                                 "\",\"recipe\":{},\"store\":\"127.0.0.1:1\",\"secret\":\"s\","
                                 "\"generation\":1,\"world_size\":1,\"backend\":\"gloo\","
                                 "\"resume_from\":\"\",\"ranks\":[0],\"env\":{}" +
                                 protocol + "}\n");
    const int status =
        std::system(("'" + binary() + "' agent < '" + (tmp / "plan").string() + "' > '" +
                     (tmp / "out").string() + "' 2> '" + (tmp / "err").string() + "'")
                        .c_str());
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 4);
    const std::string said = protocol.empty() ? "1, older" : "999, newer";
    const std::string why =
        "node7: the launching host runs another build of dptrain than this "
        "one: its plan speaks agent protocol " +
        said + " than this build's " + std::to_string(dptrain::kAgentProtocol) +
        "; install one build on every host";
    CAPTURE(read_text(tmp / "err"));
    CHECK(read_text(tmp / "err").starts_with("dptrain: error: " + why));
    // Its first line says the protocol it speaks; then the refusal, as a host's failure that a
    // restart would meet again. No rank started, no run directory made.
    const auto lines = lines_of(read_text(tmp / "out"));
    REQUIRE(lines.size() == 2);
    CHECK(lines[0] == "@agent " + std::to_string(dptrain::kAgentProtocol));
    REQUIRE(lines[1].starts_with("@failure "));
    const auto report = parse_json(lines[1].substr(9));
    CHECK(report["rank"] == -1);
    CHECK(report["refused"] == true);
    CHECK(report["description"].get<std::string>().starts_with(why));
    CHECK_FALSE(fs::exists(tmp / "run"));
  }
}

TEST_CASE("a stop signal while the recipe is read from a pipe: the signal's exit code") {
  TempDir tmp;
  const fs::path fifo = tmp / "recipe.fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  for (const int sig : {SIGINT, SIGTERM}) {
    CAPTURE(sig);
    // Nothing ever writes the pipe: launch waits in its open until the signal comes.
    Background launch({"launch", fifo.string(), "--run-dir", (tmp / "run").string(), "--json"});
    // Once the handler is in place the stop ends the wait, whether it comes before the wait
    // for the pipe began or during it.
    REQUIRE(eventually([&] { return catches_signal(launch.pid(), sig); }));
    REQUIRE(::kill(launch.pid(), sig) == 0);
    const int expected = sig == SIGINT ? 130 : 143;
    CHECK(launch.wait(std::chrono::seconds(30)) == expected);
    INFO(launch.out(), launch.err());
    const auto out = parse_json(launch.out());
    CHECK(out["exit_code"] == expected);
    CHECK(out["status"] == (sig == SIGINT ? "interrupted" : "terminated"));
    // The stop is what happened, not the read it cut short ("Interrupted system call").
    CHECK(out["error"] == fifo.string() + ": stopped by " + (sig == SIGINT ? "SIGINT" : "SIGTERM") +
                              " before the launch made anything");
    CHECK_FALSE(fs::exists(tmp / "run"));
  }
  // So for bench train and doctor, which read a recipe too: not a recipe "cannot read" to fix.
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"bench", "train", fifo.string(), "--run-dir",
                                 (tmp / "bench").string(), "--json"},
        std::vector<std::string>{"doctor", fifo.string(), "--hosts", "localhost:1",
                                 "--no-allreduce", "--json"}}) {
    CAPTURE(args[0]);
    Background command(args);
    REQUIRE(eventually([&] { return catches_signal(command.pid(), SIGTERM); }));
    REQUIRE(::kill(command.pid(), SIGTERM) == 0);
    CHECK(command.wait(std::chrono::seconds(30)) == 143);
    INFO(command.out(), command.err());
    const auto out = parse_json(command.out());
    CHECK(out["status"] == "terminated");
    CHECK_FALSE(contains(command.out() + command.err(), "Interrupted system call"));
    CHECK_FALSE(contains(command.out() + command.err(), "cannot read"));
    CHECK_FALSE(fs::exists(tmp / "bench"));
  }
}

TEST_CASE("a command started ignoring SIGINT (a script's background job) keeps ignoring it") {
  TempDir tmp;
  const fs::path fifo = tmp / "recipe.fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0644) == 0);
  // Nothing ever writes the pipe: launch waits in its open until a signal it takes comes.
  Background launch({"launch", fifo.string(), "--run-dir", (tmp / "run").string(), "--json"}, {},
                    StartWith::sigint_ignored);
  REQUIRE(eventually([&] { return catches_signal(launch.pid(), SIGTERM); }));
  CHECK_FALSE(catches_signal(launch.pid(), SIGINT));
  REQUIRE(::kill(launch.pid(), SIGINT) == 0);
  REQUIRE(::kill(launch.pid(), SIGTERM) == 0);
  // Had SIGINT been taken, it would have been the stop (130): it was not, SIGTERM was.
  CHECK(launch.wait(std::chrono::seconds(30)) == 143);
  INFO(launch.err());
  CHECK(parse_json(launch.out())["status"] == "terminated");
}

TEST_CASE("a launch started with SIGCHLD ignored still sees its ranks exit") {
  // An ignored SIGCHLD survives exec and makes the kernel reap children itself: a launcher that
  // waited for them by pid would wait for ever.
  TempDir tmp;
  auto recipe = small_recipe();
  recipe["train"]["steps"] = 20;
  const auto file = write_recipe(tmp.path(), recipe);
  Background launch(
      {"launch", file.string(), "--nproc", "2", "--run-dir", (tmp / "run").string(), "--json"}, {},
      StartWith::sigchld_ignored);
  CHECK(launch.wait(std::chrono::seconds(120)) == 0);
  INFO(launch.err());
  CHECK(parse_json(launch.out())["status"] == "completed");
}
