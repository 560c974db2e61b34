// `dptrain sample RUN_DIR`: text from a gpt run's checkpoint, to see what the model learned.
#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "cli/commands.hpp"
#include "cli/json_errors.hpp"
#include "cli/run_report.hpp"
#include "core/checkpoint.hpp"
#include "core/data/dataset.hpp"
#include "core/data/tokens.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/json_error.hpp"
#include "core/model/gpt.hpp"
#include "core/model/sampling.hpp"
#include "core/recipe.hpp"
#include "core/tensor/cpu_ops.hpp"
#include "core/tensor/random.hpp"
#include "launch/job.hpp"
#include "launch/report.hpp"
#include "launch/run_dir.hpp"
#include "launch/supervisor.hpp"

namespace dptrain::cli {

namespace fs = std::filesystem;
using nlohmann::json;

namespace {

constexpr uint64_t kSampleStream = 0x5a3f1e;  // derive_seed stream of the sampling

struct SampleOptions {
  std::string run_dir;
  std::string prompt;
  int64_t tokens = 200;
  double temperature = 1.0;
  int64_t top_k = 0;
  uint64_t seed = 1;
  std::string checkpoint;                          // a directory; empty: the newest valid one
  const CLI::Option* checkpoint_option = nullptr;  // given (possibly as "")
  bool ids = false;                                // prompt and output as token ids
  bool json = false;
};

// The dataset's tokenizer; none when the dataset has no tokenizer.json (token files made with
// another tokenizer) and --ids asks for ids, which need none. Without --ids its absence is named
// with the way out.
std::optional<Tokenizer> load_tokenizer(const DataSpec& data, bool ids) {
  std::error_code ec;
  const fs::path file = fs::path(data.path) / "tokenizer.json";
  if (ids && !fs::exists(file, ec) && !ec) return std::nullopt;
  // The whole dataset gone (moved, deleted, another machine's path): said as such, not as a
  // dataset made by another tokenizer.
  if (std::error_code dir_ec; !fs::exists(data.path, dir_ec) && !dir_ec) {
    throw Error(ErrorKind::recipe,
                fmt::format("data.path {}: no such directory (the dataset was moved or deleted): "
                            "the text needs its tokenizer.json; put the dataset back, or sample "
                            "token ids with --ids",
                            data.path));
  }
  try {
    return Tokenizer::load(data.path);
  } catch (const Error& e) {
    if (fs::exists(file, ec) || ec) throw;
    throw Error(e.kind(), fmt::format("{}; the dataset has no tokenizer (its token files were made "
                                      "by another one): sample token ids with --ids",
                                      e.what()));
  }
}

// A tokenizer.json put in from another dataset would decode the model's ids into other
// characters: its vocabulary must be the token files' (train.bin's header), and it must be the
// one meta.json records (its checksum), as data prepare wrote them together. What is wrong, or
// "" (also when the token files cannot be read, and for a dataset whose meta.json records no
// checksum: made before it was recorded, or a meta.json that cannot be read).
std::string tokenizer_misfit(const Tokenizer& tokenizer, const DataSpec& data) {
  const fs::path dir = data.path;
  int64_t vocab = 0;
  try {
    vocab = read_token_header(dir / "train.bin").vocab;
  } catch (const Error&) {
    return "";
  }
  if (vocab != tokenizer.vocab()) {
    return fmt::format(
        "{}: {} ids, but the tokens of {} have {} (its header): the tokenizer is "
        "another dataset's",
        (dir / "tokenizer.json").string(), tokenizer.vocab(), (dir / "train.bin").string(), vocab);
  }
  std::string recorded;
  try {
    std::error_code ec;
    if (fs::is_regular_file(dir / "meta.json", ec)) {
      const nlohmann::json meta = parse_json(read_file(dir / "meta.json"));
      if (meta.is_object() && meta.value("tokenizer_checksum", nlohmann::json()).is_string())
        recorded = meta["tokenizer_checksum"].get<std::string>();
    }
  } catch (const std::exception&) {
    return "";
  }
  if (recorded.empty() || recorded == tokenizer.checksum()) return "";
  return fmt::format(
      "{}: not the tokenizer these token files were made with (its checksum is {}; {} records "
      "{}): the tokenizer is another dataset's",
      (dir / "tokenizer.json").string(), tokenizer.checksum(), (dir / "meta.json").string(),
      recorded);
}

// The ids the model may draw: the tokenizer's vocabulary, or without one the dataset's (its
// training file's header), or else the model's.
int64_t drawable_vocab(const std::optional<Tokenizer>& tokenizer, const Recipe& recipe) {
  if (tokenizer) return tokenizer->vocab();
  try {
    return std::min(read_token_header(fs::path(recipe.data.path) / "train.bin").vocab,
                    recipe.model.vocab);
  } catch (const Error&) {
    return recipe.model.vocab;
  }
}

// --prompt under --ids: whole numbers separated by blanks or commas, each below `vocab`.
std::vector<int32_t> parse_prompt_ids(const std::string& text, int64_t vocab) {
  std::vector<int32_t> ids;
  // A comma separates two ids: one with none before it (",1", "1,,2") or after it ("1,") is an
  // id left out (a script's empty variable), not a separator to pass over.
  const auto empty_field = [&] {
    return Error(ErrorKind::usage,
                 fmt::format("--prompt: '{}' has an empty field between commas (with --ids, whole "
                             "numbers separated by spaces or commas)",
                             printable(text)));
  };
  bool comma_pending = true;  // the start reads as after a comma: ",1" is an empty field
  bool empty = false;
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] == ',') {
      empty = empty || comma_pending;
      comma_pending = true;
      ++i;
      continue;
    }
    if (text[i] == ' ' || text[i] == '\t' || text[i] == '\n') {
      ++i;
      continue;
    }
    comma_pending = false;
    size_t end = text.find_first_of(" ,\t\n", i);
    if (end == std::string::npos) end = text.size();
    const std::string word = text.substr(i, end - i);
    int64_t id = -1;
    const auto [ptr, ec] = std::from_chars(word.data(), word.data() + word.size(), id);
    const bool digits = word.find_first_not_of("0123456789") == std::string::npos;
    if (ec == std::errc::result_out_of_range && digits) {
      throw Error(ErrorKind::usage,
                  fmt::format("--prompt: token id {} is out of the vocabulary (ids 0 to {})", word,
                              vocab - 1));
    }
    if (ec != std::errc() || ptr != word.data() + word.size() || id < 0) {
      throw Error(ErrorKind::usage,
                  fmt::format("--prompt: '{}' is not a token id (with --ids, whole numbers "
                              "separated by spaces or commas)",
                              word));
    }
    if (id >= vocab) {
      throw Error(ErrorKind::usage,
                  fmt::format("--prompt: token id {} is out of the vocabulary (ids 0 to {})", id,
                              vocab - 1));
    }
    ids.push_back(static_cast<int32_t>(id));
    i = end;
  }
  if (ids.empty() && !text.empty()) {
    throw Error(ErrorKind::usage,
                fmt::format("--prompt: '{}' holds no token id (with --ids, whole numbers "
                            "separated by spaces or commas)",
                            printable(text)));
  }
  if (empty || (comma_pending && !ids.empty())) throw empty_field();  // ",1", "1,,2", "1,"
  return ids;
}

// The newest valid checkpoint of the run that its recipe wrote: the one a resume continues from
// (one copied in from another recipe is skipped with a warning; --checkpoint can name it).
// Error(checkpoint) saying there is nothing to sample from when the run has written none yet, or
// when none of them is valid (why each was passed over on the lines below, not as warnings);
// that they were moved away where run.json records one committed; or naming a newer one that is
// out of reach (a permission), as resume does.
fs::path newest_checkpoint(const RunDirectory& run, const Recipe& recipe,
                           const std::function<void(const std::string&)>& warn) {
  require_recorded_checkpoint(run, "Put them back to sample from them");
  if (list_checkpoints(run.checkpoints()).empty() && latest_checkpoint(run.checkpoints()).empty()) {
    // What comes of waiting: a run training now (as status tells it: its launcher, or its rank 0
    // on another machine, lives) writes its first; one that stopped before it writes none until
    // it is continued. Its first comes every N steps, or at its end when that is sooner.
    const int64_t every = recipe.checkpoint.every > 0
                              ? std::min(recipe.checkpoint.every, recipe.train.steps)
                              : recipe.train.steps;
    const std::string state = run_state(run.info(), run.path()).status;
    const std::string how =
        state == "running" || state == "restarting" || state == "resizing"
            ? fmt::format("it is training: wait for its first checkpoint, at step {}", every)
        : state == "completed"
            ? std::string("it completed, and holds none now")
            // What status advises: resume, or first fix what a resume would meet again.
            : fmt::format("it stopped before its first checkpoint (step {}): {}", every, [&] {
                const std::string advice = status_hint(load_run(run.path(), false));
                return advice.empty() ? "continue it with " + resume_command(run.path()) : advice;
              }());
    throw Error(ErrorKind::checkpoint,
                fmt::format("{}: no checkpoint yet, nothing to sample from ({})",
                            run.path().string(), how));
  }
  PassedOver passed{warn, {}};
  const auto found = passed.search(run.checkpoints(), written_by(recipe));
  if (!found) {
    throw Error(ErrorKind::checkpoint,
                fmt::format("{}: no valid checkpoint, nothing to sample from (see 'dptrain "
                            "ckpt list {}'; --checkpoint names one another recipe wrote){}",
                            run.path().string(), run.path().string(), passed.lines()));
  }
  passed.tell();
  return *found;
}

// A checkpoint written with other data, or by another recipe, than the run's as they are now.
// A dataset prepared again since: Error(recipe), as a resume refuses it (its tokenizer may not
// be the one the model learned). A dataset whose token files are gone (only its tokenizer kept
// with the run) is not checked. Another recipe with the same model: a warning.
void check_checkpoint_origin(const fs::path& from, const TrainingPosition& position,
                             const Recipe& recipe,
                             const std::function<void(const std::string&)>& warn) {
  if (!position.data_fingerprint.empty() && recipe.data.type == "tokens") {
    std::optional<std::string> now;
    try {
      now = token_data_fingerprint(recipe.data);
    } catch (const Error&) {
    }
    if (now) {
      require_same_data(from, position.data_fingerprint, *now, recipe.data,
                        "the checkpoint is another run's, or the dataset was prepared again "
                        "since; its tokenizer may not be the one the model learned: sample the "
                        "run that wrote it, or put the dataset back as it was");
    }
  }
  const std::string why = recipe_mismatch(recipe, position.recipe_hash);
  if (why.empty()) return;
  // Another recipe's weights load only into the same model: a shape that differs but holds as
  // many parameters (heads 4 or 8 of one width) would run them as something they are not. The
  // recorded section is read as a recipe's is (defaults filled in), then compared field by field.
  if (!position.model.empty()) {
    const json ours = to_json(recipe)["model"];
    json recorded;
    try {
      recorded = json::parse(position.model);
    } catch (const json::exception&) {
    }
    json theirs;
    std::vector<std::string> differ;
    if (const auto kind = recorded.is_object() ? recorded.find("type") : recorded.end();
        recorded.is_object() && kind != recorded.end() && *kind != ours["type"]) {
      // Another kind of model (an MLP's weights): its fields are not this kind's to compare.
      differ.push_back(fmt::format("model.type {} there, {} here",
                                   printable_excerpt(kind->dump(), 40), ours["type"].dump()));
    } else if (recorded.is_object()) {
      try {
        json whole = to_json(recipe);
        whole["model"] = recorded;
        Recipe other = recipe;
        other.model = parse_recipe(whole, (from / "meta.json").string(), from, RecipeOrigin::stored,
                                   DataCheck::none)
                          .model;
        theirs = to_json(other)["model"];
      } catch (const std::exception&) {
      }
    }
    if (theirs.is_object()) {
      for (const auto& [key, value] : ours.items()) {
        const auto there = theirs.find(key);
        if (there == theirs.end() || *there != value) {
          differ.push_back(fmt::format(
              "model.{} {} there, {} here", key,
              there == theirs.end() ? std::string("unset") : printable_excerpt(there->dump(), 40),
              printable_excerpt(value.dump(), 40)));
        }
      }
    }
    if (!theirs.is_object() || !differ.empty()) {
      throw Error(
          ErrorKind::checkpoint,
          fmt::format("{}: the weights of another model ({}): sample the run that wrote "
                      "it",
                      from.string(),
                      differ.empty() ? std::string("its model is not one this dptrain reads")
                                     : fmt::format("{}", fmt::join(differ, ", "))));
    }
  }
  warn(fmt::format("{}: {}{}", from.string(), why,
                   position.model.empty()
                       ? " (an older checkpoint, which does not say its model: only its "
                         "parameter count is checked)"
                       : ""));
}

int run_sample(const SampleOptions& o) {
  // A stop ends the text where it is, with the status (and the JSON) every command gives one.
  install_stop_signal_handlers();
  std::signal(SIGPIPE, SIG_DFL);  // `sample | head` ends it, as any filter's reader does
  // Each warning is said once, however often the checkpoint search makes it, on stderr and in
  // the --json "warnings".
  std::vector<std::string> warnings;
  const auto warn = [&warnings](const std::string& w) {
    if (std::find(warnings.begin(), warnings.end(), w) != warnings.end()) return;
    warnings.push_back(w);
    std::fprintf(stderr, "dptrain: warning: %s\n", w.c_str());
  };
  // Only the recipe is read: a field it does not use, edited into another type, stops nothing.
  RunDirectory run = RunDirectory::open(o.run_dir, RecordCheck::lists);
  if (!run.info().contains("recipe")) {
    throw Error(ErrorKind::usage, fmt::format("{}: run.json has no recipe", o.run_dir));
  }
  const Recipe recipe = parse_recorded_recipe(run.info(), run.path());
  if (recipe.model.type != "gpt") {
    throw Error(ErrorKind::usage, fmt::format("{}: sample needs a gpt run; this one trains an {}",
                                              o.run_dir, recipe.model.type));
  }
  std::optional<Tokenizer> tokenizer = load_tokenizer(recipe.data, o.ids);
  if (tokenizer) {
    if (const std::string misfit = tokenizer_misfit(*tokenizer, recipe.data); !misfit.empty()) {
      if (!o.ids) {
        throw Error(ErrorKind::recipe,
                    misfit +
                        ": put this dataset's tokenizer.json back, or sample token ids "
                        "with --ids");
      }
      // Ids need no tokenizer: the token files' vocabulary, and no text.
      warn(misfit + ": ids only, no text");
      tokenizer.reset();
    }
  }
  const int64_t vocab = drawable_vocab(tokenizer, recipe);
  // --checkpoint: a directory, or a name or step of the run's checkpoints (as ckpt verify takes).
  std::error_code ec;
  if (o.checkpoint_option->count() > 0 && o.checkpoint.empty()) {
    throw Error(ErrorKind::usage, "--checkpoint: empty (a directory, a name or a step)");
  }
  // A name or a step (no '/' but a trailing one, as a shell completes a directory) is one of the
  // run's, whatever directory of that name the current one holds; ./step-000200 is that one.
  std::string bare = o.checkpoint;
  while (bare.size() > 1 && bare.back() == '/')
    bare.pop_back();
  const bool run_s = !bare.empty() && bare.find('/') == std::string::npos &&
                     (checkpoint_step(bare) >= 0 || bare == "latest" ||
                      bare.find_first_not_of("0123456789") == std::string::npos);
  // Absolute and normal: "step-000200/." is step-000200 in the JSON (a link keeps its name).
  const auto choose = [&] {
    return named_path(o.checkpoint.empty() ? newest_checkpoint(run, recipe, warn)
                      : run_s || !fs::is_directory(o.checkpoint, ec)
                          ? checkpoint_named(run.checkpoints(), o.checkpoint)
                          : fs::path(o.checkpoint));
  };
  fs::path from = choose();
  if (!o.checkpoint.empty() && !fs::exists(from / "meta.json", ec) && checkpoint_step(from) < 0) {
    throw Error(ErrorKind::usage,
                fmt::format("--checkpoint {}: not a checkpoint directory (no meta.json, and not "
                            "named step-N)",
                            o.checkpoint));
  }
  // The newest valid one of a run that trains on may be pruned before it is read: then the
  // newest again.
  CheckpointData ckpt;
  for (int tries = 1;; ++tries) {
    try {
      ckpt = read_checkpoint(from, CheckpointBlobs::params);
      break;
    } catch (const Error& e) {
      std::error_code gone;
      if (!o.checkpoint.empty() || e.kind() != ErrorKind::checkpoint || tries == 5 ||
          fs::exists(from, gone) || gone) {
        throw;
      }
    }
    from = choose();
  }
  check_checkpoint_origin(from, ckpt.position, recipe, warn);
  auto model = make_gpt(recipe.model, std::make_shared<CpuOps>());
  auto& gpt = dynamic_cast<Gpt&>(*model);
  if (ckpt.params.size() != gpt.num_params()) {
    throw Error(ErrorKind::checkpoint,
                fmt::format("{}: holds {} parameters, the recipe's model has {}", from.string(),
                            ckpt.params.size(), gpt.num_params()));
  }
  std::vector<int32_t> context;
  if (o.ids) {
    context = parse_prompt_ids(o.prompt, vocab);
  } else {
    try {
      context = tokenizer->encode(o.prompt);
    } catch (const Error& e) {
      throw Error(e.kind(), fmt::format("--prompt: {}", e.what()));
    }
  }
  const bool given_prompt = !context.empty();
  if (context.empty()) {
    // No prompt: start from a newline (or token 0 when the vocabulary has none).
    try {
      context = tokenizer ? tokenizer->encode("\n") : std::vector<int32_t>{0};
    } catch (const Error&) {
      context = {0};
    }
  }
  const size_t prompt_tokens = context.size();
  std::mt19937_64 rng(derive_seed(o.seed, kSampleStream));
  const bool stream = !o.json;
  if (stream) {
    const std::string shown = !o.ids         ? o.prompt
                              : given_prompt ? fmt::format("{}", fmt::join(context, " "))
                                             : std::string();
    std::fputs(shown.c_str(), stdout);
    std::fflush(stdout);
  }
  // The text so far, as --json prints it (bytes that are not UTF-8, a byte model's output, are
  // replaced, so the JSON stays valid).
  const auto result = [&] {
    const auto generated = std::span(context).subspan(prompt_tokens);
    return json{{"checkpoint", from.filename().string()},
                {"checkpoint_path", from.string()},
                {"step", ckpt.position.step},
                {"prompt", o.prompt},
                {"tokens", o.tokens},
                {"tokens_generated", generated.size()},
                {"temperature", o.temperature},
                {"top_k", o.top_k},
                {"seed", o.seed},
                {"prompt_ids", std::span(context).first(prompt_tokens)},
                {"ids", generated},
                {"text", tokenizer ? json(tokenizer->decode(generated)) : json(nullptr)},
                {"warnings", warnings}};
  };
  for (int64_t i = 0; i < o.tokens; ++i) {
    if (const int sig = pending_stop_signal(); sig != 0) {
      if (stream) std::printf("\n");
      const Error stopped =
          stop_error(sig, "sample: ", fmt::format(" after {} of {} tokens", i, o.tokens));
      const ErrorKind kind = stopped.kind();
      const std::string why = stopped.what();
      if (!o.json) throw stopped;
      // One JSON object still, with what was generated before the stop.
      json out = result();
      out["status"] = failure_status(kind);
      add_failure(out, exit_code(kind), why);
      std::printf("%s\n", json_text(out).c_str());
      print_error_lines(why);
      return exit_code(kind);
    }
    const int32_t next =
        draw_token(gpt.next_token_logits(ckpt.params, context), vocab, o.temperature, o.top_k, rng);
    context.push_back(next);
    if (stream) {
      const bool first = context.size() == prompt_tokens + 1 && !given_prompt;
      const std::string piece = !o.ids  ? tokenizer->decode(std::span(&context.back(), 1))
                                : first ? std::to_string(next)
                                        : " " + std::to_string(next);
      // A reader that is gone (a full disk, a closed stdout) ends it at once, not after every
      // token has been drawn for nobody.
      if (std::fwrite(piece.data(), 1, piece.size(), stdout) != piece.size() ||
          std::fflush(stdout) != 0) {
        throw Error(ErrorKind::io,
                    fmt::format("standard output: cannot write: {}", std::strerror(errno)));
      }
    }
  }
  if (o.json) {
    json out = result();
    add_success(out);
    std::printf("%s\n", json_text(out).c_str());
  } else {
    std::printf("\n");
  }
  return 0;
}

}  // namespace

void setup_sample(CLI::App& app, Outcome& outcome) {
  auto o = std::make_shared<SampleOptions>();
  app.add_option("run_dir", o->run_dir, "Run directory of a gpt run")
      ->required()
      ->check(run_directory());
  app.add_option(
         "--prompt", o->prompt,
         "Text to continue, or with --ids token ids (default: none; the model is given a newline "
         "to start from, which is not printed)")
      ->check(handles_empty());
  app.add_option("--tokens", o->tokens, "Tokens to generate")
      ->capture_default_str()
      ->check(whole_number<int64_t>(""));
  app.add_option("--temperature", o->temperature,
                 "Softmax temperature; 0 takes the most likely token every time")
      ->capture_default_str()
      ->check(non_negative_number());
  app.add_option("--top-k", o->top_k, "Sample among the K most likely tokens only (0: all)")
      ->capture_default_str()
      ->check(whole_number<int64_t>(""));
  app.add_option("--seed", o->seed, "Seed of the sampling: the same seed, the same text")
      ->capture_default_str()
      ->check(whole_number<uint64_t>(""));
  app.add_flag("--ids", o->ids,
               "Token ids instead of text: --prompt as ids (separated by spaces or commas), the "
               "output as ids separated by spaces; needs no tokenizer.json");
  o->checkpoint_option =
      app.add_option("--checkpoint", o->checkpoint,
                     "Checkpoint: a directory, or one of the run's by name (step-000200), step "
                     "(200) or \"latest\" (default: the newest valid one)")
          ->check(handles_empty());
  app.add_flag(
      "--json", o->json,
      "Print {checkpoint, checkpoint_path, step, prompt, tokens, tokens_generated, temperature, "
      "top_k, seed, "
      "prompt_ids, ids, text, warnings} at the end "
      "instead of streaming the text");
  app.callback([o, &outcome] {
    outcome.json = o->json;
    outcome.exit_code = run_sample(*o);
  });
}

}  // namespace dptrain::cli
