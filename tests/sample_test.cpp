// `dptrain sample` end to end on real runs: a model vocabulary larger than the tokenizer's never
// yields an id the tokenizer cannot decode, numbers out of range are refused instead of wrapped,
// and a run with nothing to sample from says so.
#include <doctest/doctest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include <fmt/format.h>

#include "core/checkpoint.hpp"
#include "tests/harness.hpp"
#include "tests/strings.hpp"
#include "tests/text_corpus.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// A token dataset of generated text (lower-case ASCII), and the characters it holds.
struct Dataset {
  TempDir tmp;
  fs::path dir = tmp / "dataset";
  std::set<char> alphabet;
  int64_t vocab = 0;

  explicit Dataset(const std::string& tokenizer) {
    const std::string text = synthetic_text(5, 20000);
    alphabet.insert(text.begin(), text.end());
    write_text(tmp / "text.txt", text);
    const auto r = run_dptrain({"data", "prepare", "--text", (tmp / "text.txt").string(), "--out",
                                dir.string(), "--tokenizer", tokenizer, "--json"});
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    vocab = parse_json(r.out)["vocab"].get<int64_t>();
    if (tokenizer == "char") REQUIRE(vocab == static_cast<int64_t>(alphabet.size()));
  }
};

// A small gpt trained briefly: its logits are still close to uniform, so without the mask most
// draws would land on ids beyond the tokenizer's vocabulary.
json small_gpt(const fs::path& dataset, int64_t vocab) {
  json r = gpt_recipe(dataset, 2, 32, vocab);
  r["train"] = {{"steps", 6}, {"batch_per_rank", 4}};
  r["optimizer"]["schedule"] = {{"type", "cosine"}, {"warmup", 2}};
  r["checkpoint"] = {{"every", 3}, {"keep", 3}};
  r["eval"] = {{"every", 0}, {"max_samples", 32}};
  r["log"] = {{"every", 2}};
  r["distributed"]["check_every"] = 3;
  return r;
}

fs::path train(const fs::path& dir, const json& recipe, const std::string& nproc) {
  const auto file = write_recipe(dir, recipe);
  const fs::path run_dir = dir / "run";
  const auto r =
      run_dptrain({"launch", file.string(), "--nproc", nproc, "--run-dir", run_dir.string()});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  return run_dir;
}

CommandResult sample(const fs::path& run_dir, std::vector<std::string> args) {
  args.insert(args.begin(), {"sample", run_dir.string()});
  return run_dptrain(args);
}

}  // namespace

TEST_CASE("sample: a model vocabulary larger than the char tokenizer's draws only its characters") {
  Dataset data("char");
  REQUIRE(data.vocab < 64);  // the model's 256 ids are mostly beyond it
  const fs::path run_dir = train(data.tmp.path(), small_gpt(data.dir, 256), "2");
  for (const std::string seed : {"1", "2", "3", "4", "5", "6", "7", "8"}) {
    CAPTURE(seed);
    const auto r = sample(run_dir, {"--tokens", "150", "--seed", seed, "--json"});
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    const json out = parse_json(r.out);
    CHECK(out["status"] == "ok");  // the fields of every --json success
    CHECK(out["exit_code"] == 0);
    CHECK(out["errors"] == json::array());
    const std::string text = out["text"].get<std::string>();
    CHECK(text.size() == 150);  // ASCII: one byte a character
    for (char c : text)
      CHECK(data.alphabet.count(c) == 1);
  }
  // Streamed, greedy and top-k: the same restriction.
  const auto streamed = sample(run_dir, {"--prompt", "the ", "--tokens", "150", "--seed", "9"});
  INFO(streamed.err);
  CHECK(streamed.exit_code == 0);
  CHECK(streamed.out.size() == std::string("the ").size() + 150 + 1);  // and a newline
  for (const auto& options : std::vector<std::vector<std::string>>{
           {"--temperature", "0"}, {"--top-k", "3"}, {"--top-k", "200", "--temperature", "2"}}) {
    std::vector<std::string> args = options;
    args.insert(args.end(), {"--tokens", "100", "--json"});
    const auto r = sample(run_dir, args);
    CAPTURE(options.back());
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    for (char c : parse_json(r.out)["text"].get<std::string>())
      CHECK(data.alphabet.count(c) == 1);
  }
  // --checkpoint by step or by name, as ckpt verify takes them; one the run lacks is named.
  std::vector<fs::path> checkpoints;
  for (const auto& e : fs::directory_iterator(run_dir / "checkpoints")) {
    if (e.is_directory()) checkpoints.push_back(e.path());
  }
  REQUIRE_FALSE(checkpoints.empty());
  std::sort(checkpoints.begin(), checkpoints.end());
  const fs::path oldest = checkpoints.front();
  const std::string step = std::to_string(std::stoll(oldest.filename().string().substr(5)));
  for (const std::string& which : {step, oldest.filename().string()}) {
    CAPTURE(which);
    const auto r = sample(run_dir, {"--checkpoint", which, "--tokens", "5", "--json"});
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(parse_json(r.out)["checkpoint"] == oldest.filename().string());
    CHECK(parse_json(r.out)["checkpoint_path"] == oldest.string());
  }
  // Its directory as a shell completes it ("/") or with "/.": the same name in the JSON.
  for (const char* suffix : {"/", "/."}) {
    const auto r = sample(run_dir, {"--checkpoint", oldest.string() + std::string(suffix),
                                    "--tokens", "5", "--json"});
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(parse_json(r.out)["checkpoint"] == oldest.filename().string());
    CHECK(parse_json(r.out)["checkpoint_path"] == oldest.string());
  }
  // Through a link to the newest: ".." goes up from its target, as reading the path does.
  {
    const fs::path link = run_dir.parent_path() / "newest-link";
    fs::create_directory_symlink(checkpoints.back(), link);
    const auto r = sample(run_dir, {"--checkpoint", (link / ".." / oldest.filename()).string(),
                                    "--tokens", "5", "--json"});
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(parse_json(r.out)["checkpoint"] == oldest.filename().string());
    CHECK(parse_json(r.out)["checkpoint_path"] == oldest.string());
    fs::remove(link);
  }
  // A directory of that name where the command runs is not taken for the run's checkpoint (it
  // was, and sampled another run's weights); ./NAME names that one.
  {
    const fs::path here = run_dir.parent_path() / "elsewhere";
    fs::create_directories(here / oldest.filename());
    fs::create_directories(here / "latest");
    // Back to the test's own directory however this block ends.
    struct Restore {
      fs::path was = fs::current_path();
      ~Restore() { fs::current_path(was); }
    } restore;
    fs::current_path(here);
    const auto r =
        sample(run_dir, {"--checkpoint", oldest.filename().string(), "--tokens", "5", "--json"});
    const auto dotted =
        sample(run_dir, {"--checkpoint", "./" + oldest.filename().string(), "--tokens", "5"});
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(parse_json(r.out)["checkpoint_path"] == oldest.string());
    // That one, empty: a damaged checkpoint (exit 5), not the run's.
    CHECK(dotted.exit_code == 5);
    CHECK(contains(dotted.err, oldest.filename().string() + "/meta.json: missing"));
    // "latest": the one the run's checkpoints/latest names, not the directory here.
    const auto latest = sample(run_dir, {"--checkpoint", "latest", "--tokens", "5", "--json"});
    INFO(latest.err);
    REQUIRE(latest.exit_code == 0);
    CHECK(parse_json(latest.out)["checkpoint"] ==
          read_text(run_dir / "checkpoints/latest").substr(0, 11));
  }
  const auto missing = sample(run_dir, {"--checkpoint", "999999", "--tokens", "5"});
  CHECK(missing.exit_code == 2);
  CHECK(missing.err.find("no checkpoint 999999 (it has step-") != std::string::npos);
}

TEST_CASE("sample: a run without a checkpoint yet says whether to wait or to continue it") {
  Dataset data("char");
  json recipe_json = small_gpt(data.dir, data.vocab);
  // Its only checkpoint comes at its end (step 6), not at step 100.
  recipe_json["checkpoint"]["every"] = 100;
  const auto recipe = write_recipe(data.tmp.path(), recipe_json);
  const fs::path run_dir = data.tmp / "run";
  const auto failed =
      run_dptrain({"launch", recipe.string(), "--nproc", "1", "--run-dir", run_dir.string()},
                  {{"DPTRAIN_FAULT", "crash@step=2"}});
  REQUIRE(failed.exit_code == 3);
  const auto r = sample(run_dir, {"--tokens", "5"});
  CHECK(r.exit_code == 5);
  CHECK(r.err == "dptrain: error: " + run_dir.string() +
                     ": no checkpoint yet, nothing to sample from (it stopped before its first "
                     "checkpoint (step 6): continue it with 'dptrain resume " +
                     run_dir.string() + "')\n");
  // One whose training diverged: a resume would diverge again, and is not what it advises.
  json diverging = recipe_json;
  diverging["optimizer"]["lr"] = 1e30;
  const fs::path diverged = data.tmp / "diverged";
  REQUIRE(run_dptrain({"launch", write_recipe(data.tmp.path(), diverging).string(), "--nproc", "1",
                       "--run-dir", diverged.string()})
              .exit_code == 3);
  const auto d = sample(diverged, {"--tokens", "5"});
  CHECK(d.exit_code == 5);
  CHECK(contains(d.err,
                 ": no checkpoint yet, nothing to sample from (it stopped before its first "
                 "checkpoint (step 6): a resume would meet its error again"));
  // Training now (slowly): its first checkpoint is to be waited for.
  recipe_json["train"]["steps"] = 400;
  recipe_json["checkpoint"]["every"] = 200;
  const auto slow = write_recipe(data.tmp.path(), recipe_json);
  const fs::path live = data.tmp / "live";
  Background launcher({"launch", slow.string(), "--nproc", "1", "--run-dir", live.string()},
                      {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "200"}});
  REQUIRE(eventually([&] { return worker_pids(live).size() == 1; }));
  const auto waiting = sample(live, {"--tokens", "5"});
  CHECK(waiting.exit_code == 5);
  CHECK_MESSAGE(contains(waiting.err,
                         ": no checkpoint yet, nothing to sample from (it is "
                         "training: wait for its first checkpoint, at step 200)"),
                waiting.err);
  REQUIRE(::kill(launcher.pid(), SIGINT) == 0);
  CHECK(launcher.wait(std::chrono::seconds(60)) == 130);
}

TEST_CASE("sample: another model's weights of as many parameters are refused, not run") {
  Dataset data("char");
  const fs::path run_dir = train(data.tmp.path(), small_gpt(data.dir, 64), "1");
  // One head of width 32 instead of two: the same parameter count, another model.
  json heads = small_gpt(data.dir, 64);
  heads["model"]["heads"] = 1;
  fs::create_directories(data.tmp / "heads");
  const fs::path other = train(data.tmp / "heads", heads, "1") / "checkpoints/step-000006";
  const auto refused = sample(run_dir, {"--checkpoint", other.string(), "--tokens", "5", "--json"});
  CHECK(refused.exit_code == 5);
  CHECK(contains(refused.err, other.string() + ": the weights of another model (model.heads 1 "
                                               "there, 2 here): sample the run that wrote it"));
  // Another kind of model (an MLP's): the kind is what is said to differ.
  fs::create_directories(data.tmp / "mlp");
  const fs::path mlp_run = train(data.tmp / "mlp", small_recipe(), "1");
  const auto mlp_checkpoints = dptrain::list_checkpoints(mlp_run / "checkpoints");
  REQUIRE_FALSE(mlp_checkpoints.empty());
  const fs::path mlp = mlp_checkpoints.front();
  const auto mlp_refused = sample(run_dir, {"--checkpoint", mlp.string(), "--tokens", "5"});
  CHECK(mlp_refused.exit_code == 5);
  CHECK(contains(mlp_refused.err, mlp.string() + R"(: the weights of another model (model.type )"
                                                 R"("mlp" there, "gpt" here): sample the run)"));
  // The same model trained by another recipe (a learning rate): used, with a warning.
  json lr = small_gpt(data.dir, 64);
  lr["optimizer"]["lr"] = lr["optimizer"]["lr"].get<double>() / 2;
  fs::create_directories(data.tmp / "lr");
  const fs::path same = train(data.tmp / "lr", lr, "1") / "checkpoints/step-000006";
  const auto used = sample(run_dir, {"--checkpoint", same.string(), "--tokens", "5", "--json"});
  INFO(used.err);
  CHECK(used.exit_code == 0);
  CHECK(contains(used.err, "written by a different recipe"));
  // The JSON says so too, once, as stderr does.
  const json used_warnings = parse_json(used.out)["warnings"];
  REQUIRE(used_warnings.size() == 1);
  CHECK(contains(used_warnings[0].get<std::string>(), "written by a different recipe"));
  CHECK(contains(used.err, "dptrain: warning: " + used_warnings[0].get<std::string>() + "\n"));
  CHECK(parse_json(sample(run_dir, {"--tokens", "2", "--json"}).out)["warnings"] == json::array());
}

TEST_CASE("sample: a standard output that takes nothing ends it at once, exit 1") {
  Dataset data("char");
  const fs::path run_dir = train(data.tmp.path(), small_gpt(data.dir, 64), "1");
  const fs::path err = data.tmp / "err";
  // Far more tokens than the run would draw before the test's timeout: it stops at the first.
  for (const std::string& out : {std::string(">&-"), std::string("> /dev/full")}) {
    CAPTURE(out);
    const int status = std::system(("timeout 60 '" + binary() + "' sample '" + run_dir.string() +
                                    "' --tokens 100000000 " + out + " 2> '" + err.string() + "'")
                                       .c_str());
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 1);
    CHECK(contains(read_text(err), "dptrain: error: standard output: cannot write: "));
  }
}

TEST_CASE("sample: a byte model with a vocabulary above 256 samples with every seed") {
  Dataset data("byte");
  REQUIRE(data.vocab == 256);
  const fs::path run_dir = train(data.tmp.path(), small_gpt(data.dir, 320), "1");
  for (const std::string seed : {"1", "2", "3", "4", "5", "6"}) {
    CAPTURE(seed);
    const auto r = sample(run_dir, {"--tokens", "120", "--seed", seed, "--json"});
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    CHECK(parse_json(r.out)["tokens"] == 120);
  }
}

TEST_CASE("sample: numbers out of range are refused, not wrapped; a run without checkpoints") {
  Dataset data("char");
  const fs::path run_dir = train(data.tmp.path(), small_gpt(data.dir, 64), "1");

  // The largest seed is a seed; one more is refused, as are token counts beyond int64.
  const auto largest =
      sample(run_dir, {"--tokens", "5", "--seed", "18446744073709551615", "--json"});
  INFO(largest.err);
  REQUIRE(largest.exit_code == 0);
  CHECK(parse_json(largest.out)["seed"].get<uint64_t>() == 18446744073709551615ull);
  CHECK(parse_json(largest.out)["top_k"] == 0);
  // A field of run.json that sample does not read, edited into a wrong type, does not stop it
  // (a resume refuses such a record, naming the field).
  const std::string kept = read_text(run_dir / "run.json");
  auto edited = parse_json(kept);
  edited["world_size"] = "one";
  edited["status"] = 7;
  write_text(run_dir / "run.json", edited.dump());
  const auto despite = sample(run_dir, {"--tokens", "5", "--json"});
  write_text(run_dir / "run.json", kept);
  CHECK_MESSAGE(despite.exit_code == 0, despite.err);
  const auto refused = [&](const std::vector<std::string>& args, const std::string& option,
                           const std::string& says) {
    const auto r = sample(run_dir, args);
    CAPTURE(args.back());
    CHECK(r.exit_code == 2);
    CHECK(r.out.empty());
    CHECK(r.err.find(option) != std::string::npos);
    CHECK(r.err.find(says) != std::string::npos);
  };
  refused({"--seed", "18446744073709551616"}, "--seed", "out of range");
  refused({"--seed", "-1"}, "--seed", "'-1' must be a whole number >= 0");
  refused({"--seed", "1.5"}, "--seed", "not a whole number");
  refused({"--tokens", "ten"}, "--tokens", "not a whole number");
  refused({"--tokens", "18446744073709551617"}, "--tokens", "out of range");
  refused({"--tokens", "9223372036854775808"}, "--tokens", "out of range");
  refused({"--top-k", "99999999999999999999"}, "--top-k", "out of range");
  refused({"--temperature", "inf"}, "--temperature", "finite");
  refused({"--temperature", "nan"}, "--temperature", "finite");
  refused({"--temperature", "-1"}, "--temperature", ">= 0");

  // No checkpoint yet: nothing to sample from (resume has nothing to do with it).
  const fs::path bare = data.tmp / "bare";
  fs::copy(run_dir, bare, fs::copy_options::recursive);
  for (const auto& entry : fs::directory_iterator(bare / "checkpoints"))
    fs::remove_all(entry.path());
  // Where run.json records one committed there, they were moved away (or not mounted): said
  // so, not "train the run".
  const auto moved = sample(bare, {});
  CHECK(moved.exit_code == 5);
  CHECK(contains(moved.err, (bare / "checkpoints").string() +
                                ": holds no checkpoint, but run.json records step-"));
  CHECK(contains(moved.err, "Put them back to sample from them\n"));
  CHECK_FALSE(contains(moved.err, "first checkpoint"));
  json bare_info = parse_json(read_text(bare / "run.json"));
  bare_info.erase("last_checkpoint");
  write_text(bare / "run.json", bare_info.dump());
  const auto none = sample(bare, {});
  CHECK(none.exit_code == 5);
  CHECK(none.err.find("nothing to sample from") != std::string::npos);
  CHECK(none.err.find("it completed, and holds none now") != std::string::npos);
  CHECK(none.err.find("resume") == std::string::npos);
  // A file where the checkpoints directory belongs is said to be, not "no checkpoint yet".
  fs::remove_all(bare / "checkpoints");
  write_text(bare / "checkpoints", "");
  const auto file = sample(bare, {});
  CHECK(file.exit_code == 5);
  CHECK(file.err.find("checkpoints: cannot list the checkpoints: Not a directory") !=
        std::string::npos);

  // Checkpoints that are all damaged: the same, after a warning for each.
  const fs::path damaged = data.tmp / "damaged";
  fs::copy(run_dir, damaged, fs::copy_options::recursive);
  int broken = 0;
  for (const auto& entry : fs::directory_iterator(damaged / "checkpoints")) {
    if (fs::is_directory(entry.path()) && fs::exists(entry.path() / "params.bin")) {
      fs::resize_file(entry.path() / "params.bin", 8);
      ++broken;
    }
  }
  REQUIRE(broken == 2);  // step-000003 and step-000006
  const auto invalid = sample(damaged, {});
  CHECK(invalid.exit_code == 5);
  CHECK(invalid.err.find("no valid checkpoint, nothing to sample from") != std::string::npos);
  CHECK(invalid.err.find("resume") == std::string::npos);

  // Checkpoints another recipe wrote (here the run's recipe changed since): not taken by
  // default, as a resume would not take them; --checkpoint names one, with a warning.
  const fs::path other = data.tmp / "other";
  fs::copy(run_dir, other, fs::copy_options::recursive);
  json info = parse_json(read_text(other / "run.json"));
  info["recipe"]["optimizer"]["lr"] = info["recipe"]["optimizer"].value("lr", 0.01) * 2;
  write_text(other / "run.json", info.dump());
  const auto foreign = sample(other, {"--tokens", "5"});
  CHECK(foreign.exit_code == 5);
  CHECK(foreign.err.find("no valid checkpoint, nothing to sample from") != std::string::npos);
  // Why, under the error (once: not also as a warning before it).
  CHECK(contains(foreign.err,
                 "\n  skipping checkpoint step-000006: written by a different "
                 "recipe (hash "));
  CHECK_FALSE(contains(foreign.err, "warning: skipping checkpoint step-000006"));
  CHECK(foreign.err.find("--checkpoint names one another recipe wrote") != std::string::npos);
  const auto named = sample(other, {"--checkpoint", "6", "--tokens", "5", "--json"});
  INFO(named.err);
  CHECK(named.exit_code == 0);
  CHECK(named.err.find("step-000006: written by a different recipe (hash ") != std::string::npos);
}

TEST_CASE(
    "sample: a dataset prepared again since the checkpoint is refused; a stop gives its JSON") {
  Dataset data("char");
  const fs::path run_dir = train(data.tmp.path(), small_gpt(data.dir, 256), "1");
  // A stop while it draws: the status every command's --json has (here SIGTERM: 143).
  {
    Background p({"sample", run_dir.string(), "--tokens", "1000000000", "--json"});
    // Once it handles SIGTERM, which it does before it draws.
    REQUIRE(eventually([&p] { return catches_signal(p.pid(), SIGTERM); }));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    REQUIRE(::kill(p.pid(), SIGTERM) == 0);
    CHECK(p.wait(std::chrono::seconds(30)) == 143);
    const json out = parse_json(p.out());
    CHECK(out["status"] == "terminated");
    CHECK(out["exit_code"] == 143);
    CHECK(out["error"].get<std::string>().rfind("sample: stopped by SIGTERM after ", 0) == 0);
    // With the text drawn before the stop, as many tokens as it says.
    const int64_t drawn = out["tokens_generated"].get<int64_t>();
    CHECK(drawn > 0);
    CHECK(drawn < 1000000000);
    CHECK(out["text"].get<std::string>().size() == static_cast<size_t>(drawn));  // one char each
    CHECK(out["error"] ==
          fmt::format("sample: stopped by SIGTERM after {} of 1000000000 tokens", drawn));
    CHECK(p.err() == out["error"].get<std::string>().insert(0, "dptrain: error: ") + "\n");
  }
  // What it is given, named.
  for (const auto& [args, message] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--checkpoint", ""}, "--checkpoint: empty (a directory, a name or a step)"},
           {{"--checkpoint", data.tmp.path().string()},
            "--checkpoint " + data.tmp.path().string() + ": not a checkpoint directory"},
           {{"--prompt", "\xE2\x82\xAC"},
            "--prompt: character '\xE2\x82\xAC' (U+20AC) at byte offset 0"}}) {
    CAPTURE(message);
    std::vector<std::string> full = args;
    full.insert(full.end(), {"--tokens", "5"});
    const auto r = sample(run_dir, full);
    CHECK(r.exit_code == 2);
    CHECK_MESSAGE(r.err.find("dptrain: error: " + message) == 0, r.err);
  }
  // The same place, another text: other tokens, maybe another tokenizer.
  write_text(data.tmp / "other.txt", synthetic_text(11, 20000));
  const auto prepared = run_dptrain({"data", "prepare", "--text", (data.tmp / "other.txt").string(),
                                     "--out", data.dir.string(), "--tokenizer", "char", "--force"});
  REQUIRE(prepared.exit_code == 0);
  const auto r = sample(run_dir, {"--tokens", "5"});
  CHECK(r.exit_code == 2);
  CHECK(r.out.empty());
  CHECK_MESSAGE(
      r.err.find(": written while training on other data: train.bin ") != std::string::npos, r.err);
  CHECK(r.err.find("the checkpoint is another run's, or the dataset was prepared again since") !=
        std::string::npos);
}

TEST_CASE("sample --ids: ids in and out, the same draws as text; a dataset without a tokenizer") {
  Dataset data("char");
  const fs::path run_dir = train(data.tmp.path(), small_gpt(data.dir, data.vocab + 40), "1");
  const auto text =
      sample(run_dir, {"--prompt", "the ", "--tokens", "30", "--seed", "4", "--json"});
  const auto ids =
      sample(run_dir, {"--prompt", "the ", "--ids", "--tokens", "30", "--seed", "4", "--json"});
  // "the " as ids is not the same prompt: ids mode reads numbers. Give the same ids instead.
  CHECK(ids.exit_code == 2);
  CHECK_MESSAGE(ids.err.find("dptrain: error: --prompt: 'the' is not a token id") == 0, ids.err);
  REQUIRE(text.exit_code == 0);
  const json t = parse_json(text.out);
  const auto prompt_ids = t["prompt_ids"].get<std::vector<int32_t>>();
  REQUIRE(prompt_ids.size() == 4);
  const std::string as_ids =
      fmt::format("{},{} {}  {}", prompt_ids[0], prompt_ids[1], prompt_ids[2], prompt_ids[3]);
  const auto same =
      sample(run_dir, {"--prompt", as_ids, "--ids", "--tokens", "30", "--seed", "4", "--json"});
  INFO(same.err);
  REQUIRE(same.exit_code == 0);
  const json s = parse_json(same.out);
  CHECK(s["ids"] == t["ids"]);
  CHECK(s["prompt_ids"] == t["prompt_ids"]);
  CHECK(s["text"] == t["text"]);  // the tokenizer is there: the text comes too
  CHECK(t["ids"].size() == 30);

  // Another dataset's tokenizer.json (3 characters for this one's data.vocab): its text would be
  // other characters. Refused, naming both files; ids still come, without text.
  const std::string own = read_text(data.dir / "tokenizer.json");
  write_text(data.dir / "tokenizer.json", R"({"type": "char", "chars": [97, 98, 99]})");
  const auto misfit = sample(run_dir, {"--tokens", "5"});
  CHECK(misfit.exit_code == 2);
  CHECK(misfit.out.empty());
  CHECK_MESSAGE(contains(misfit.err, fmt::format("tokenizer.json: 3 ids, but the tokens of {} "
                                                 "have {} (its header): the tokenizer is another "
                                                 "dataset's: put this dataset's tokenizer.json "
                                                 "back, or sample token ids with --ids",
                                                 (data.dir / "train.bin").string(), data.vocab)),
                misfit.err);
  const auto misfit_ids =
      sample(run_dir, {"--prompt", as_ids, "--ids", "--tokens", "30", "--seed", "4", "--json"});
  REQUIRE(misfit_ids.exit_code == 0);
  CHECK(parse_json(misfit_ids.out)["ids"] == t["ids"]);
  CHECK(parse_json(misfit_ids.out)["text"].is_null());
  CHECK(contains(misfit_ids.err, "the tokenizer is another dataset's: ids only, no text"));
  // Another dataset's with as many ids (the same characters in another order): told by the
  // checksum meta.json records. The own one laid out otherwise is still the own one.
  json swapped = parse_json(own);
  REQUIRE(swapped["chars"].size() >= 2);
  std::swap(swapped["chars"][0], swapped["chars"][1]);
  write_text(data.dir / "tokenizer.json", swapped.dump());
  const auto same_size = sample(run_dir, {"--tokens", "5"});
  CHECK(same_size.exit_code == 2);
  CHECK_MESSAGE(
      contains(same_size.err, (data.dir / "tokenizer.json").string() +
                                  ": not the tokenizer these token files were made with (its "
                                  "checksum is "),
      same_size.err);
  CHECK(contains(same_size.err, (data.dir / "meta.json").string() + " records "));
  CHECK(contains(same_size.err,
                 "): the tokenizer is another dataset's: put this dataset's "
                 "tokenizer.json back, or sample token ids with --ids"));
  write_text(data.dir / "tokenizer.json", parse_json(own).dump(2));
  const auto own_again = sample(run_dir, {"--tokens", "5", "--json"});
  CHECK_MESSAGE(own_again.exit_code == 0, own_again.err);
  CHECK(parse_json(own_again.out)["text"].is_string());
  // A pipe in its place would block the read for ever: refused at once, naming it.
  fs::remove(data.dir / "tokenizer.json");
  REQUIRE(::mkfifo((data.dir / "tokenizer.json").c_str(), 0600) == 0);
  const auto pipe = sample(run_dir, {"--tokens", "5"});
  CHECK(pipe.exit_code == 2);
  CHECK_MESSAGE(contains(pipe.err, (data.dir / "tokenizer.json").string() +
                                       ": cannot read: not a regular file"),
                pipe.err);
  fs::remove(data.dir / "tokenizer.json");
  write_text(data.dir / "tokenizer.json", own);

  // Token files made by another tokenizer: no tokenizer.json. Text is refused with the way out.
  fs::remove(data.dir / "tokenizer.json");
  const auto refused = sample(run_dir, {"--tokens", "5"});
  CHECK(refused.exit_code == 2);
  CHECK(refused.out.empty());
  CHECK_MESSAGE(refused.err.find("tokenizer.json: missing; the dataset has no tokenizer") !=
                    std::string::npos,
                refused.err);
  CHECK(refused.err.find("sample token ids with --ids") != std::string::npos);
  const auto bare =
      sample(run_dir, {"--prompt", as_ids, "--ids", "--tokens", "30", "--seed", "4", "--json"});
  INFO(bare.err);
  REQUIRE(bare.exit_code == 0);
  const json b = parse_json(bare.out);
  CHECK(b["ids"] == t["ids"]);  // the vocabulary comes from train.bin's header: the same draws
  CHECK(b["text"].is_null());
  // Streamed: the prompt's ids, then each drawn id, separated by spaces, and a closing newline.
  const auto streamed =
      sample(run_dir, {"--prompt", as_ids, "--ids", "--tokens", "30", "--seed", "4"});
  REQUIRE(streamed.exit_code == 0);
  std::string expected;
  for (const auto& id : b["prompt_ids"])
    expected += std::to_string(id.get<int>()) + " ";
  for (const auto& id : b["ids"])
    expected += std::to_string(id.get<int>()) + " ";
  expected.back() = '\n';
  CHECK(streamed.out == expected);
  // Without a prompt the stream starts with the first drawn id.
  const auto unprompted = sample(run_dir, {"--ids", "--tokens", "3"});
  REQUIRE(unprompted.exit_code == 0);
  CHECK(unprompted.out.size() >= 6);
  CHECK(unprompted.out[0] != ' ');
  for (const auto& [prompt, message] : std::vector<std::pair<std::string, std::string>>{
           {"1 -2", "--prompt: '-2' is not a token id"},
           {"1 2x", "--prompt: '2x' is not a token id"},
           {" , ", "--prompt: ' , ' holds no token id"},
           {"1,,2", "--prompt: '1,,2' has an empty field between commas"},
           {",1", "--prompt: ',1' has an empty field between commas"},
           {"1, 2 ,", "--prompt: '1, 2 ,' has an empty field between commas"},
           {"99999999999999999999",
            "--prompt: token id 99999999999999999999 is out of the "
            "vocabulary (ids 0 to "},
           {std::to_string(data.vocab), fmt::format("--prompt: token id {} is out of the "
                                                    "vocabulary (ids 0 to {})",
                                                    data.vocab, data.vocab - 1)}}) {
    const auto r = sample(run_dir, {"--prompt", prompt, "--ids", "--tokens", "3"});
    CHECK(r.exit_code == 2);
    CHECK_MESSAGE(r.err.find("dptrain: error: " + message) == 0, r.err);
  }

  // The whole dataset gone: said as such, not as a dataset made by another tokenizer.
  fs::remove_all(data.dir);
  const auto gone = sample(run_dir, {"--tokens", "5"});
  CHECK(gone.exit_code == 2);
  CHECK_MESSAGE(gone.err == "dptrain: error: data.path " + data.dir.string() +
                                ": no such directory (the dataset was moved or deleted): the "
                                "text needs its tokenizer.json; put the dataset back, or sample "
                                "token ids with --ids\n",
                gone.err);
}
