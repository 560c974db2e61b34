// One failure shape for every --json command (dptrain(1), JSON OUTPUT): status, exit_code, error
// and errors, whatever failed and whenever; and usage hints that name the command's own help.
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include "tests/damage.hpp"
#include "tests/harness.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The failure fields of `r`'s one JSON object, checked against its exit code; returns the object.
json check_failure(const CommandResult& r, int code) {
  INFO(r.out, r.err);
  CHECK(r.exit_code == code);
  const json out = parse_json(r.out);
  CHECK(out["exit_code"] == code);
  CHECK(out["status"].is_string());
  CHECK(out["status"] != "ok");
  CHECK(out["status"] != "completed");
  REQUIRE(out["error"].is_string());
  REQUIRE(out["errors"].is_array());
  REQUIRE(!out["errors"].empty());
  for (const auto& e : out["errors"])
    CHECK(e.is_string());
  // "error" is the main message: the first of "errors", with a run's log excerpt below it.
  CHECK(out["error"].get<std::string>().rfind(out["errors"][0].get<std::string>(), 0) == 0);
  return out;
}

// The success fields of `r`'s one JSON object (dptrain(1), JSON OUTPUT): exit_code 0, no errors,
// and `status`.
json check_success(const CommandResult& r, const std::string& status) {
  INFO(r.out, r.err);
  CHECK(r.exit_code == 0);
  const json out = parse_json(r.out);
  CHECK(out["exit_code"] == 0);
  CHECK(out["errors"] == json::array());
  CHECK(out["status"] == status);
  return out;
}

}  // namespace

TEST_CASE("--json successes carry exit_code 0, errors [] and a status, in every command") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const fs::path run = tmp / "run";
  check_success(
      run_dptrain({"launch", recipe.string(), "--nproc", "1", "--run-dir", run.string(), "--json"}),
      "completed");
  check_success(run_dptrain({"launch", recipe.string(), "--nproc", "2", "--dry-run", "--run-dir",
                             (tmp / "planned").string(), "--json"}),
                "planned");
  check_success(run_dptrain({"resume", run.string(), "--json"}), "completed");
  // status's is the run's; a command that reads a failed run succeeds as well (below).
  check_success(run_dptrain({"status", run.string(), "--json"}), "completed");
  check_success(
      run_dptrain({"report", run.string(), "--out", (tmp / "report.html").string(), "--json"}),
      "completed");
  for (const auto& args :
       std::vector<std::vector<std::string>>{{"recipe", "validate", recipe.string()},
                                             {"recipe", "show", recipe.string()},
                                             {"ckpt", "list", run.string()},
                                             {"ckpt", "verify", run.string()}}) {
    std::vector<std::string> full = args;
    full.push_back("--json");
    CAPTURE(full[0]);
    CAPTURE(full[1]);
    check_success(run_dptrain(full), "ok");
  }
  // A benchmark that completed says so, as bench train and a run do.
  check_success(run_dptrain({"bench", "comm", "--nproc", "1", "-b", "8", "-e", "8", "-n", "1", "-w",
                             "0", "--runs-root", (tmp / "runs").string(), "--json"}),
                "completed");
  write_text(tmp / "text.txt", "a small text to count tokens in, twice over: a small text.\n");
  check_success(run_dptrain({"data", "prepare", "--text", (tmp / "text.txt").string(), "--out",
                             (tmp / "tokens").string(), "--val-fraction", "0.5", "--json"}),
                "ok");
  check_success(run_dptrain({"bench", "train", recipe.string(), "--nproc", "1", "--steps", "3",
                             "--runs-root", (tmp / "runs").string(), "--json"}),
                "completed");
  // A failed run's status: "failed", and the status command itself succeeded.
  const fs::path failed = tmp / "failed";
  const auto f = run_dptrain(
      {"launch", recipe.string(), "--nproc", "1", "--run-dir", failed.string(), "--json"},
      {{"DPTRAIN_FAULT", "exit@step=2,code=7"}});
  REQUIRE(f.exit_code == 3);
  check_success(run_dptrain({"status", failed.string(), "--json"}), "failed");
}

TEST_CASE("--json failures carry status, exit_code, error and errors for every failure class") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const std::string runs = (tmp / "runs").string();

  SUBCASE("a bad option") {
    auto out = check_failure(run_dptrain({"launch", recipe.string(), "--bogus", "--json"}), 2);
    CHECK(out["status"] == "error");
    CHECK(out["error"].get<std::string>().find("--bogus") != std::string::npos);
  }
  SUBCASE("a bad recipe, before any run") {
    auto bad = small_recipe();
    bad["optimizer"]["lr"] = -1;
    bad["train"]["batch_per_rank"] = 0;
    const auto file = write_recipe(tmp.path(), bad, "bad.json");
    auto out = check_failure(
        run_dptrain({"launch", file.string(), "--nproc", "1", "--runs-root", runs, "--json"}), 2);
    CHECK(out["status"] == "error");
    CHECK(out["errors"].size() == 2);
    CHECK_FALSE(fs::exists(tmp / "runs"));
  }
  SUBCASE("a path with a newline stays on the message's one line") {
    const std::string odd = (tmp / "no\nsuch").string();
    const std::string shown = (tmp / "no\\x0asuch").string();
    const std::vector<std::vector<std::string>> commands = {
        {"data", "prepare", "--text", odd, "--out", (tmp / "ds").string(), "--json"},
        {"ckpt", "list", odd, "--json"},
        {"ckpt", "verify", odd, "--json"},
        {"sample", odd, "--json"},
        {"resume", odd, "--json"}};
    for (const auto& command : commands) {
      auto out = check_failure(run_dptrain(command), 2);
      CHECK(out["errors"].size() == 1);
      CHECK(out["error"].get<std::string>().rfind(shown + ": ", 0) == 0);
    }
  }
  SUBCASE("a run directory with a newline in its path: its refusals stay on one line") {
    const std::string odd = (tmp / "run\nx").string();
    const std::string shown = (tmp / "run\\x0ax").string();
    const auto file = write_recipe(tmp.path(), small_recipe(), "small.json");
    const auto first = run_dptrain({"launch", file.string(), "--nproc", "1", "--run-dir", odd});
    REQUIRE_MESSAGE(first.exit_code == 0, first.err);
    CHECK(first.out.find("run directory " + shown + "\n") != std::string::npos);
    const std::vector<std::vector<std::string>> commands = {
        {"launch", file.string(), "--nproc", "1", "--run-dir", odd, "--json"},
        {"ckpt", "verify", odd, "99", "--json"}};
    for (const auto& command : commands) {
      CAPTURE(command[0]);
      auto out = check_failure(run_dptrain(command), 2);
      CHECK(out["errors"].size() == 1);
      CHECK(out["error"].get<std::string>().rfind(shown + ": ", 0) == 0);
    }
    // One that failed: the refusal that says to resume it, on one line too.
    json info = parse_json(read_text(fs::path(odd) / "run.json"));
    info["status"] = "failed";
    write_text(fs::path(odd) / "run.json", info.dump());
    auto out = check_failure(
        run_dptrain({"launch", file.string(), "--nproc", "1", "--run-dir", odd, "--json"}), 2);
    CHECK(out["errors"].size() == 1);
    CHECK(out["error"].get<std::string>().rfind(shown + ": already holds a run; ", 0) == 0);
  }
  SUBCASE("recipe validate keeps valid, and says why") {
    auto out = check_failure(
        run_dptrain({"recipe", "validate", (tmp / "nope.json").string(), "--json"}), 2);
    CHECK(out["valid"] == false);
    CHECK(out["status"] == "error");
    CHECK(out["error"].get<std::string>().find((tmp / "nope.json").string()) == 0);
    auto ok = run_dptrain({"recipe", "validate", recipe.string(), "--json"});
    CHECK(ok.exit_code == 0);
    const json good = parse_json(ok.out);
    CHECK(good["valid"] == true);
    CHECK(good["status"] == "ok");
    CHECK(good["exit_code"] == 0);
    CHECK(good["errors"].empty());
  }
  SUBCASE("ckpt verify of a corrupt checkpoint keeps ok, and names the file") {
    const fs::path run = tmp / "run";
    auto launched =
        run_dptrain({"launch", recipe.string(), "--nproc", "1", "--run-dir", run.string()});
    REQUIRE(launched.exit_code == 0);
    flip_byte(run / "checkpoints/step-000060/params.bin", 17);
    auto out = check_failure(run_dptrain({"ckpt", "verify", run.string(), "--json"}), 5);
    CHECK(out["ok"] == false);
    CHECK(out["status"] == "error");
    CHECK(out["error"].get<std::string>().find("step-000060/params.bin: checksum mismatch") !=
          std::string::npos);
    CHECK(out["checkpoints"].size() == 1);
  }
  SUBCASE("a rank failure keeps the run's fields and its log excerpt in error") {
    auto r = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir",
                          (tmp / "failed").string(), "--json"},
                         {{"DPTRAIN_FAULT", "exit@step=3,rank=1,code=7"}});
    auto out = check_failure(r, 3);
    CHECK(out["status"] == "failed");
    CHECK(out["run_dir"] == (tmp / "failed").string());
    CHECK(out.contains("restarts"));
    CHECK(out["errors"][0].get<std::string>().find("rank 1") != std::string::npos);
    for (const auto& e : out["errors"])
      CHECK(e.get<std::string>().rfind(" ", 0) != 0);  // log lines stay in "error" only
    // An injected exit prints nothing: no excerpt, but where the rank was and where its log is.
    const std::string error = out["error"];
    CAPTURE(error);
    CHECK(error.find(" exited with code 7; its last heartbeat: step 3 in phase ") !=
          std::string::npos);
    CHECK(error.ends_with("; it printed nothing (log: " +
                          (tmp / "failed" / "logs" / "localhost-rank1.log").string() + ")"));
    // A copy of the run names its own log, not the one of the directory it was copied from.
    fs::copy(tmp / "failed", tmp / "copy", fs::copy_options::recursive);
    const auto copied = parse_json(run_dptrain({"status", (tmp / "copy").string(), "--json"}).out);
    CHECK(copied["error"].get<std::string>().ends_with(
        "(log: " + (tmp / "copy" / "logs" / "localhost-rank1.log").string() + ")"));
  }
  SUBCASE("a rank that printed only its progress: the progress is the excerpt") {
    // Rank 0 reports progress as events only; their lines stand for it.
    auto r = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir",
                          (tmp / "crashed").string(), "--json"},
                         {{"DPTRAIN_FAULT", "crash@step=12,rank=0"}});
    auto out = check_failure(r, 3);
    const std::string error = out["error"];
    CHECK(error.find("its last lines (full log: ") != std::string::npos);
    CHECK(error.find("\n  step 10/60  loss ") != std::string::npos);
    CHECK(error.find("@event") == std::string::npos);
  }
  SUBCASE("a rank failure in a benchmark keeps its log excerpt in error too") {
    // Rank 1 stops after the first measurement; rank 0 times out in the barrier that starts the
    // second.
    auto r = run_dptrain({"bench", "comm", "--nproc", "2", "-b", "1K", "-e", "2K", "-n", "1", "-w",
                          "0", "--timeout", "3", "--run-dir", (tmp / "bench").string(), "--json"},
                         {{"DPTRAIN_FAULT", "hang@step=1,rank=1"}});
    auto out = check_failure(r, 3);
    const std::string error = out["error"];
    CAPTURE(error);
    const std::string first = out["errors"][0];
    CHECK(first.rfind("rank 0 (pid ", 0) == 0);
    CHECK(first.find(" exited with code 3: gloo barrier failed: ") != std::string::npos);
    CHECK(error.rfind(first, 0) == 0);
    CHECK(error.find("; its last lines (full log: " +
                     (tmp / "bench" / "logs" / "localhost-rank0.log").string() + "):\n") !=
          std::string::npos);
    CHECK(error.find("\n  bench comm: allreduce on 2 rank(s), 2 size(s) from 1024 to 2048 bytes") !=
          std::string::npos);
    CHECK(error.find("\n  bench comm: allreduce 1024 bytes (1/2): ") != std::string::npos);
    // The failed rank's error line is the first line's cause (in "errors" too), not repeated in
    // the excerpt.
    CHECK(error.find("\n  dptrain: error: ") == std::string::npos);
  }
  SUBCASE("a run directory that cannot be read") {
    auto out = check_failure(run_dptrain({"status", (tmp / "none").string(), "--json"}), 2);
    CHECK(out["status"] == "error");
  }
}

TEST_CASE("resume --json of a completed run has the fields of launch --json") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const fs::path run = tmp / "run";
  auto launched =
      run_dptrain({"launch", recipe.string(), "--nproc", "1", "--run-dir", run.string(), "--json"});
  REQUIRE(launched.exit_code == 0);
  const json launch = parse_json(launched.out);
  auto resumed = run_dptrain({"resume", run.string(), "--json"});
  INFO(resumed.err);
  REQUIRE(resumed.exit_code == 0);
  const json resume = parse_json(resumed.out);
  CHECK(resume["resumed"] == false);
  for (const auto& [key, value] : launch.items()) {
    CAPTURE(key);
    REQUIRE(resume.contains(key));
    // Where this invocation began training: it trained nothing.
    if (key == "began_at_step") {
      CHECK(resume[key].is_null());
      continue;
    }
    if (key != "peak_rss_mib") CHECK(resume[key] == value);
  }
}

TEST_CASE("a usage error points at the help of the command given, sub-subcommands too") {
  const std::vector<std::vector<std::string>> commands = {
      {"ckpt", "verify"},  {"ckpt", "list"},  {"recipe", "show"}, {"recipe", "validate"},
      {"data", "prepare"}, {"bench", "comm"}, {"bench", "train"}};
  for (const auto& command : commands) {
    std::vector<std::string> args = command;
    args.insert(args.end(), {"--bogus", "x"});
    auto r = run_dptrain(args);
    CAPTURE(r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("see 'dptrain " + command[0] + " " + command[1] + " --help'") !=
          std::string::npos);
  }
  // A misspelt subcommand or option is named, with the one meant.
  for (const auto& [args, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"ckpt", "verfy", "run"}, "unknown command 'ckpt verfy' (did you mean 'ckpt verify'?)"},
           {{"recipe", "valdate", "x.json"},
            "unknown command 'recipe valdate' (did you mean 'recipe validate'?)"},
           // A file where the command belongs: the command comes first.
           {{"recipe", "x.json"},
            "'x.json' is not a command of 'dptrain recipe', which takes one first (validate, "
            "show): 'dptrain recipe validate x.json', say"},
           {{"bench", "x.json"},
            "'x.json' is not a command of 'dptrain bench', which takes one first (comm, train): "
            "'dptrain bench train x.json', say"},
           // None at all: the ones there are, in words like every other error's.
           {{"recipe"}, "'dptrain recipe' needs a command: validate, show"},
           // An option of its commands, without one: the command is what is missing.
           {{"ckpt", "--json"}, "'dptrain ckpt' needs a command before '--json': list, verify"},
           {{"bench", "--nproc", "2"},
            "'dptrain bench' needs a command before '--nproc': comm, train"},
           {{"status", "--jsn", "run"}, "status: unknown option '--jsn' (did you mean '--json'?)"},
           {{"report", "--ot", "x.html", "run"},
            "report: unknown option '--ot' (did you mean '--out'?)"},
           {{"bench", "comm", "--nprc=2"},
            "bench comm: unknown option '--nprc' (did you mean '--nproc'?)"},
           {{"launch", "--hlp"}, "launch: unknown option '--hlp' (did you mean '--help'?)"}}) {
    auto r = run_dptrain(args);
    CAPTURE(r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("dptrain: error: " + says + " (see 'dptrain ") == 0);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);  // one line
  }
  // A value of the wrong type says what was expected, in one line.
  for (const auto& [args, says] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"bench", "comm", "--iters", "abc"}, "--iters: 'abc' is not a whole number"},
           {{"bench", "comm", "--iters", "99999999999"},
            "--iters: '99999999999' is out of range [1, 2147483647]"},
           {{"launch", "x.json", "--ssh-keepalive", ""}, "--ssh-keepalive: is empty; give a value"},
           {{"launch", "x.json", "--ssh-keepalive", "3601"},
            "--ssh-keepalive: '3601' is out of range [0, 3600]"},
           {{"launch", "x.json", "--ssh-keepalive", "abc"},
            "--ssh-keepalive: 'abc' is not a whole number"},
           {{"bench", "train", "x.json", "--peak-tflops", "fast"},
            "--peak-tflops: 'fast' is not a number"}}) {
    auto r = run_dptrain(args);
    CAPTURE(r.err);
    CHECK(r.exit_code == 2);
    CHECK(r.err.find("dptrain: error: " + says + " (see 'dptrain ") == 0);
    CHECK(std::count(r.err.begin(), r.err.end(), '\n') == 1);
  }
  // A negative number is a value, not an option.
  auto negative = run_dptrain({"sample", "run", "--seed", "-1"});
  CHECK(negative.err.find("'-1' must be a whole number >= 0") != std::string::npos);
  auto top = run_dptrain({"ckpt", "--bogus"});
  CHECK(top.err.find("see 'dptrain ckpt --help'") != std::string::npos);
  auto launch = run_dptrain({"launch", "x.json", "--bogus"});
  CHECK(launch.err.find("see 'dptrain launch --help'") != std::string::npos);
}

TEST_CASE(
    "bytes that are not UTF-8 in a path or a file: one JSON object, the documented exit code") {
  TempDir tmp;
  const std::string latin1 = "caf\xe9";  // "café" in Latin-1: not UTF-8
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  // Nothing there: exit 2 naming the path, its bad byte shown as U+FFFD in the JSON.
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"status", (tmp / latin1).string(), "--json"},
        {"ckpt", "verify", (tmp / latin1).string(), "--json"},
        {"report", (tmp / latin1).string(), "--json"}}) {
    CAPTURE(args[0]);
    const json out = check_failure(run_dptrain(args), 2);
    CHECK(out["error"].get<std::string>().find("caf\xef\xbf\xbd") != std::string::npos);
  }
  // A recipe file that is not UTF-8 is a bad recipe (exit 2), not a crash.
  write_text(tmp / "latin1.json", "{\"name\": \"" + latin1 + "\"}");
  check_failure(run_dptrain({"recipe", "validate", (tmp / "latin1.json").string(), "--json"}), 2);
  check_failure(run_dptrain({"launch", (tmp / "latin1.json").string(), "--json"}), 2);
  // A run directory named in Latin-1 works like any other.
  const fs::path run = tmp / latin1;
  auto launched =
      run_dptrain({"launch", recipe.string(), "--nproc", "1", "--run-dir", run.string(), "--json"});
  INFO(launched.err);
  REQUIRE(launched.exit_code == 0);
  CHECK(parse_json(launched.out)["status"] == "completed");
  CHECK(parse_json(read_text(run / "run.json"))["status"] == "completed");
  for (const std::vector<std::string>& args :
       {std::vector<std::string>{"status", run.string(), "--json"},
        {"ckpt", "list", run.string(), "--json"},
        {"ckpt", "verify", run.string(), "--json"}}) {
    CAPTURE(args[0]);
    auto r = run_dptrain(args);
    CHECK(r.exit_code == 0);
    CHECK_NOTHROW(parse_json(r.out));
  }
  // So does a dataset written there.
  write_text(tmp / "text.txt", std::string(4000, 'a') + "\n" + std::string(4000, 'b'));
  auto prepared = run_dptrain({"data", "prepare", "--text", (tmp / "text.txt").string(), "--out",
                               (tmp / ("data-" + latin1)).string(), "--json"});
  INFO(prepared.err);
  CHECK(prepared.exit_code == 0);
  CHECK_NOTHROW(parse_json(prepared.out));
}

TEST_CASE("data too large for memory is refused by the launcher, and said to be by a rank") {
  TempDir tmp;
  // About 4 TB of synthetic samples: within the recipe's bounds, beyond any machine's memory.
  auto r = small_recipe();
  r["model"]["input"] = 1024;
  r["data"]["samples"] = 1000000000;
  const auto recipe = write_recipe(tmp.path(), r);
  // The launcher counts it (every rank generates it whole): refused before anything starts.
  auto out = check_failure(run_dptrain({"launch", recipe.string(), "--nproc", "1", "--run-dir",
                                        (tmp / "huge").string(), "--json"}),
                           2);
  CHECK(out["error"].get<std::string>().find(
            "/data/samples: its 1000000000 samples of 1024 features take ") != std::string::npos);
  CHECK_FALSE(fs::exists(tmp / "huge"));
  // A rank started by hand, with no launcher to count it, says what ran out.
  uint16_t port = 0;
  {
    const HeldPort free(false);
    port = free.port();
  }
  const auto worker = run_dptrain({"worker", recipe.string(), "--rank", "0", "--world-size", "1",
                                   "--host-store", "--store", "127.0.0.1:" + std::to_string(port),
                                   "--run-dir", (tmp / "hand").string()});
  INFO(worker.err);
  CHECK(worker.exit_code == 1);
  CHECK(worker.err.find("out of memory: an allocation failed (data or a model too large") !=
        std::string::npos);
}
