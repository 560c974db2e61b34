// Tests for the recipe layer: defaults, round trip, validation messages, files and the hash.
#include "core/recipe.hpp"

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <set>
#include <string>
#include <vector>

#include <doctest/doctest.h>

#include "core/checkpoint.hpp"
#include "core/error.hpp"
#include "core/model/model.hpp"
#include "tests/strings.hpp"
#include "tests/temp_dir.hpp"

namespace dptrain {
namespace {

using nlohmann::json;
namespace fs = std::filesystem;

using test::lines_of;
using test::TempDir;

// The message of the Error(recipe) that parsing `text` throws; fails the test if none is thrown.
std::string problems_of(const std::string& text, const fs::path& base_dir = fs::path("/")) {
  try {
    parse_recipe(json::parse(text), "test.json", base_dir);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::recipe);
    return e.what();
  }
  FAIL("no error for " << text);
  return "";
}

// True when one line of `message` is about `pointer` and says `phrase`.
bool has_problem(const std::string& message, const std::string& pointer,
                 const std::string& phrase) {
  for (const auto& line : lines_of(message)) {
    if (line.starts_with("test.json: " + pointer + ": ") &&
        line.find(phrase) != std::string::npos) {
      return true;
    }
  }
  return false;
}

struct BadRecipe {
  const char* text;
  const char* pointer;
  const char* phrase;
};

// A recipe where every field differs from its default, so a field that is not read or not
// written shows up as a difference after the round trip.
Recipe everything_changed(const fs::path& csv_file) {
  Recipe r;
  r.name = "all-fields_1.0";
  r.seed = 18446744073709551615ULL;
  r.model = {"mlp", 32, {7, 5, 3}, 4, "gelu"};
  r.data = {"csv", 1234, 0.5, csv_file.string(), "yes", 0.25};
  r.train = {40, 8, 2, "cpu", "fp32", 3};
  r.optimizer.type = "sgd";
  r.optimizer.lr = 0.05;
  r.optimizer.weight_decay = 0.01;
  r.optimizer.momentum = 0.8;
  r.optimizer.nesterov = true;
  r.optimizer.beta1 = 0.85;
  r.optimizer.beta2 = 0.95;
  r.optimizer.eps = 1e-6;
  r.optimizer.schedule = {"linear", 5, 0.1};
  r.optimizer.clip_grad_norm = 2.5;
  r.distributed.backend = "gloo";
  r.distributed.sync = "local_sgd";
  r.distributed.period = 3;
  r.distributed.start = 2;
  r.distributed.bucket_mb = 4.5;
  r.distributed.overlap = false;
  r.distributed.compression.block = 128;
  r.distributed.compression.ratio = 0.05;
  r.distributed.compression.rank = 2;
  r.distributed.check_every = 7;
  r.distributed.timeout_s = 12.5;
  r.checkpoint = {20, 2};
  r.eval = {10, 500};
  r.log = {5};
  return r;
}

TEST_CASE("recipe: an empty object gives the documented defaults") {
  Recipe r = parse_recipe(json::object(), "test.json", "/");
  const Recipe defaults;
  CHECK(r == defaults);
  CHECK(r.name == "run");
  CHECK(r.seed == 1);
  CHECK(r.model.hidden == std::vector<int64_t>{256, 256});
  CHECK(r.data.type == "synthetic-classification");
  CHECK(r.train.steps == 500);
  CHECK(r.optimizer.lr == doctest::Approx(1e-3));
  CHECK(r.optimizer.schedule.type == "cosine");
  CHECK(r.distributed.compression.type == "none");
  CHECK(r.log.every == 10);
}

TEST_CASE("problems: at most 50 listed, then how many more") {
  std::string hidden = "[-1";
  for (int i = 1; i < 60; ++i)
    hidden += ", -1";
  const auto lines = lines_of(problems_of(R"({"model": {"hidden": )" + hidden + "]}}"));
  REQUIRE(lines.size() == 51);
  CHECK(lines[0] == "test.json: /model/hidden/0: must be >= 1, got -1");
  CHECK(lines[49] == "test.json: /model/hidden/49: must be >= 1, got -1");
  CHECK(lines[50] == "test.json: 10 more problem(s), not listed");
}

TEST_CASE("recipe: the DESIGN.md example parses into the values it names") {
  Recipe r = parse_recipe(json::parse(R"({
    "name": "mlp-synthetic", "seed": 1,
    "model": {"type": "mlp", "input": 784, "hidden": [256, 128], "classes": 10},
    "data": {"type": "synthetic-classification", "samples": 60000},
    "train": {"steps": 500, "batch_per_rank": 64, "grad_accum": 1, "precision": "fp32"},
    "optimizer": {"type": "adamw", "lr": 1e-3, "weight_decay": 0.01,
                  "schedule": {"type": "cosine", "warmup": 50}, "clip_grad_norm": 1.0},
    "distributed": {"backend": "auto", "sync": "allreduce", "bucket_mb": 25, "overlap": true,
                    "compression": {"type": "none"}},
    "checkpoint": {"every": 100, "keep": 3},
    "log": {"every": 10}
  })"),
                          "test.json", "/");
  CHECK(r.name == "mlp-synthetic");
  CHECK(r.model.hidden == std::vector<int64_t>{256, 128});
  CHECK(r.optimizer.weight_decay == doctest::Approx(0.01));
  CHECK(r.optimizer.schedule.warmup == 50);
  CHECK(r.optimizer.clip_grad_norm == doctest::Approx(1.0));
  CHECK(r.distributed.bucket_mb == doctest::Approx(25.0));
}

TEST_CASE("recipe: to_json writes every field that applies at its JSON path") {
  const Recipe defaults;
  json j = to_json(defaults);
  CHECK(j.at(json::json_pointer("/optimizer/schedule/warmup")) == 0);
  CHECK(j.at(json::json_pointer("/distributed/compression/type")) == "none");
  CHECK(j.at(json::json_pointer("/model/hidden")) == json::array({256, 256}));
  CHECK(j.at(json::json_pointer("/eval/max_samples")) == 0);
  CHECK(j.at(json::json_pointer("/seed")) == 1);
  CHECK(j.at(json::json_pointer("/optimizer/beta2")) == 0.999);
  // Not for an mlp on synthetic data with AdamW and no compression.
  for (const char* absent :
       {"/model/vocab", "/data/path", "/data/header", "/optimizer/momentum", "/optimizer/nesterov",
        "/distributed/period", "/distributed/servers", "/distributed/compression/ratio"}) {
    INFO(absent);
    CHECK_FALSE(j.contains(json::json_pointer(absent)));
  }
}

// The JSON pointers of every leaf of `j` (arrays count as one value).
void leaves(const json& j, const std::string& at, std::set<std::string>& out) {
  if (!j.is_object()) {
    out.insert(at);
    return;
  }
  for (const auto& [key, value] : j.items())
    leaves(value, at + "/" + key, out);
}

TEST_CASE("recipe: parse_recipe(to_json(r)) round-trips every field that applies") {
  TempDir dir;
  // everything_changed's mlp reads 32 features.
  std::string row = "0";
  for (int i = 0; i < 32; ++i)
    row += "," + std::to_string(i);
  fs::path csv = dir.write("train.csv", "label,features...\n" + row + "\n");
  SUBCASE("defaults") {
    Recipe r;
    CHECK(parse_recipe(to_json(r), "test.json", dir.path()) == r);
  }
  SUBCASE("every field changed, in kinds that between them use every field") {
    struct Kinds {
      const char *model, *data, *optimizer, *schedule, *sync, *compression;
    };
    const Kinds kinds[] = {
        {"mlp", "csv", "sgd", "linear", "local_sgd", "none"},
        {"gpt", "tokens", "adamw", "cosine", "allreduce", "topk"},
        {"mlp", "synthetic-classification", "adamw", "constant", "ps", "none"},
        {"mlp", "csv", "sgd", "cosine", "allreduce", "int8"},
        {"mlp", "csv", "sgd", "cosine", "allreduce", "powersgd"},
    };
    // The fields that apply to some kinds only.
    const std::set<std::string> conditional = {"/model/input",
                                               "/model/hidden",
                                               "/model/classes",
                                               "/model/activation",
                                               "/model/vocab",
                                               "/model/context",
                                               "/model/layers",
                                               "/model/heads",
                                               "/model/width",
                                               "/model/mlp_ratio",
                                               "/data/samples",
                                               "/data/noise",
                                               "/data/path",
                                               "/data/header",
                                               "/data/eval_fraction",
                                               "/optimizer/momentum",
                                               "/optimizer/nesterov",
                                               "/optimizer/beta1",
                                               "/optimizer/beta2",
                                               "/optimizer/eps",
                                               "/optimizer/schedule/min_lr_ratio",
                                               "/distributed/period",
                                               "/distributed/start",
                                               "/distributed/servers",
                                               "/distributed/staleness",
                                               "/distributed/compression/block",
                                               "/distributed/compression/ratio",
                                               "/distributed/compression/rank"};
    std::set<std::string> written;
    for (const Kinds& k : kinds) {
      Recipe r = everything_changed(csv);
      r.model.type = k.model;
      r.data.type = k.data;
      if (r.data.type == "tokens") r.data.path = dir.path().string();
      r.optimizer.type = k.optimizer;
      r.optimizer.schedule.type = k.schedule;
      r.distributed.sync = k.sync;
      r.distributed.compression.type = k.compression;
      r.model.vocab = 300;
      r.model.context = 16;
      r.model.layers = 3;
      r.model.heads = 2;
      r.model.width = 24;
      r.model.mlp_ratio = 2;
      r.distributed.servers = 2;
      r.distributed.staleness = 3;
      INFO(k.model, " ", k.data, " ", k.optimizer, " ", k.schedule, " ", k.sync, " ",
           k.compression);
      // No field that does not apply is written: a user's file may hold all of them.
      const json j = to_json(r);
      const Recipe back = parse_recipe(j, "test.json", dir.path());
      CHECK(to_json(back) == j);
      CHECK(recipe_hash(parse_recipe(to_json(back), "test.json", dir.path())) == recipe_hash(back));
      // Each written field differs from its default, so one that is not read shows up above.
      Recipe defaults;
      defaults.model.type = k.model;
      defaults.data.type = k.data;
      defaults.optimizer.type = k.optimizer;
      defaults.optimizer.schedule.type = k.schedule;
      defaults.distributed.sync = k.sync;
      defaults.distributed.compression.type = k.compression;
      const json d = to_json(defaults);
      std::set<std::string> here;
      leaves(j, "", here);
      for (const auto& pointer : here) {
        if (conditional.count(pointer) == 0) continue;  // dropout: only 0
        INFO(pointer);
        CHECK(j.at(json::json_pointer(pointer)) != d.value(json::json_pointer(pointer), json()));
      }
      written.insert(here.begin(), here.end());
    }
    // Between them, every field of the schema.
    std::set<std::string> all = conditional;
    all.insert("/model/dropout");
    const Recipe plain;
    const json plain_json = to_json(plain);
    leaves(plain_json, "", all);
    for (const auto& pointer : all) {
      INFO(pointer);
      CHECK(written.count(pointer) == 1);
    }
  }
}

TEST_CASE("recipe: a field that does not apply to the kind chosen is refused, naming both") {
  const BadRecipe cases[] = {
      {R"({"optimizer": {"type": "adamw", "momentum": 0.9}})", "/optimizer/momentum",
       R"(applies only when /optimizer/type is "sgd" (it is "adamw"); remove it)"},
      {R"({"optimizer": {"nesterov": true}})", "/optimizer/nesterov",
       R"(/optimizer/type is "sgd")"},
      {R"({"optimizer": {"type": "sgd", "beta2": 0.99}})", "/optimizer/beta2",
       R"(applies only when /optimizer/type is "adamw" (it is "sgd"))"},
      {R"({"optimizer": {"schedule": {"type": "constant", "min_lr_ratio": 0.1}}})",
       "/optimizer/schedule/min_lr_ratio",
       R"(/optimizer/schedule/type is "cosine" or "linear" (it is "constant"))"},
      {R"({"distributed": {"compression": {"type": "int8", "ratio": 0.01}}})",
       "/distributed/compression/ratio", R"(/distributed/compression/type is "topk")"},
      {R"({"distributed": {"compression": {"block": 64}}})", "/distributed/compression/block",
       R"(/distributed/compression/type is "int8" (it is "none"))"},
      {R"({"distributed": {"compression": {"type": "topk", "rank": 4}}})",
       "/distributed/compression/rank", R"(/distributed/compression/type is "powersgd")"},
      {R"({"distributed": {"period": 4}})", "/distributed/period",
       R"(/distributed/sync is "local_sgd" (it is "allreduce"))"},
      {R"({"distributed": {"sync": "local_sgd", "servers": 2}})", "/distributed/servers",
       R"(/distributed/sync is "ps" (it is "local_sgd"))"},
      {R"({"model": {"type": "gpt", "hidden": [64]}, "data": {"type": "tokens", "path": "d"}})",
       "/model/hidden", R"(/model/type is "mlp" (it is "gpt"))"},
      {R"({"model": {"layers": 2}})", "/model/layers", R"(/model/type is "gpt" (it is "mlp"))"},
      {R"({"model": {"type": "gpt"}, "data": {"samples": 100, "type": "tokens", "path": "d"}})",
       "/data/samples", R"(/data/type is "synthetic-classification" (it is "tokens"))"},
      {R"({"data": {"path": "x.csv"}})", "/data/path",
       R"(/data/type is "csv" or "tokens" (it is "synthetic-classification"))"},
      {R"({"model": {"type": "gpt"}, "data": {"type": "tokens", "path": "d", "header": "yes"}})",
       "/data/header", R"(/data/type is "csv")"},
      {R"({"model": {"type": "gpt"}, "data": {"type": "tokens", "path": "d",
          "eval_fraction": 0.2}})",
       "/data/eval_fraction", R"(/data/type is "synthetic-classification" or "csv")"},
  };
  for (const auto& c : cases) {
    INFO(c.text);
    const std::string message = problems_of(c.text);
    CHECK_MESSAGE(has_problem(message, c.pointer, c.phrase), message);
    CHECK(lines_of(message).size() == 1);
  }
  // A kind that is itself wrong is the one problem: its fields are not judged against it.
  const std::string message =
      problems_of(R"({"optimizer": {"type": "adam", "beta1": 0.8, "momentum": 0.5}})");
  CHECK(has_problem(message, "/optimizer/type", R"(must be "adamw" or "sgd", got "adam")"));
  CHECK(lines_of(message).size() == 1);
}

TEST_CASE("recipe: a stored recipe with every field (run.json of an earlier version) is read") {
  json stored = json::parse(R"({"optimizer": {"type": "adamw", "momentum": 0.5, "nesterov":
      false}, "data": {"path": "", "header": "auto"}, "distributed": {"period": 1}})");
  CHECK_THROWS_AS(parse_recipe(stored, "run.json", "/"), Error);
  const Recipe r = parse_recipe(stored, "run.json", "/", RecipeOrigin::stored);
  CHECK(r.optimizer.momentum == 0.5);
  CHECK(r.distributed.period == 1);
  CHECK_FALSE(to_json(r)["optimizer"].contains("momentum"));
}

TEST_CASE("recipe: a run.json's recipe is read with its problems' pointers under /recipe") {
  json info = {{"status", "failed"},
               {"recipe", json::parse(R"({"train": {"steps": -5}, "model": {"hiden": 3}})")}};
  const auto message = [&] {
    try {
      parse_recorded_recipe(info, "/runs/r", DataCheck::none);
    } catch (const Error& e) {
      CHECK(e.kind() == ErrorKind::recipe);
      return std::string(e.what());
    }
    return std::string();
  };
  std::string text = message();
  CHECK(text.find("/runs/r/run.json: /recipe/train/steps: must be >= 0, got -5") !=
        std::string::npos);
  CHECK(text.find("/runs/r/run.json: /recipe/model/hiden: unknown key 'hiden'") !=
        std::string::npos);
  info["recipe"] = "x";
  CHECK(message() == "/runs/r/run.json: /recipe: the recipe must be a JSON object, got \"x\"");
  info.erase("recipe");
  CHECK(message() == "/runs/r/run.json: /recipe: the recipe must be a JSON object, got null");
  info["recipe"] = to_json(parse_recipe(json::object(), "r.json", "/"));
  CHECK(parse_recorded_recipe(info, "/runs/r", DataCheck::none).train.steps ==
        parse_recipe(json::object(), "r.json", "/").train.steps);
}

TEST_CASE("recipe: a source places each problem line in its file, under the recipe's pointer") {
  const RecipeSource run_json("/runs/r/run.json", "/recipe");
  CHECK(run_json.place("/data/path: gone\n/train/steps: bad\nno pointer here") ==
        "/runs/r/run.json: /recipe/data/path: gone\n/runs/r/run.json: /recipe/train/steps: "
        "bad\n/runs/r/run.json: no pointer here");
  CHECK(RecipeSource("r.json").place("/seed: bad") == "r.json: /seed: bad");
  CHECK(RecipeSource().place("/seed: bad") == "/seed: bad");
  CHECK(recorded_recipe_source("/runs/r").place("/x: y") == "/runs/r/run.json: /recipe/x: y");
}

TEST_CASE("recipe: integral numbers written as floats count as integers") {
  Recipe r = parse_recipe(json::parse(R"({"train": {"steps": 1e3, "batch_per_rank": 32.0}})"),
                          "test.json", "/");
  CHECK(r.train.steps == 1000);
  CHECK(r.train.batch_per_rank == 32);
  // Below 2^53, where a double is still the integer written; from there on refused, not rounded.
  CHECK(parse_recipe(json::parse(R"({"seed": 9007199254740991.0})"), "test.json", "/").seed ==
        9007199254740991u);
  for (const char* text :
       {R"({"seed": 9007199254740993.0})", R"({"seed": 1e19})", R"({"train": {"steps": 1e17}})"}) {
    CAPTURE(text);
    const std::string message = problems_of(text);
    CHECK(lines_of(message).size() == 1);
    CHECK(message.find("an integer written with a fraction or an exponent is exact only below "
                       "2^53") != std::string::npos);
  }
  // Digits alone are exact to the type's end.
  CHECK(parse_recipe(json::parse(R"({"seed": 18446744073709551615})"), "test.json", "/").seed ==
        18446744073709551615u);
}

TEST_CASE("recipe: each bad recipe is rejected naming its JSON path") {
  const BadRecipe cases[] = {
      {R"([1, 2])", "/", "must be a JSON object, got an array"},
      {R"({"train": {"steps": "ten"}})", "/train/steps", R"(expected an integer, got "ten")"},
      {R"({"train": {"steps": 3.5}})", "/train/steps", "expected an integer, got 3.5"},
      {R"({"train": {"steps": true}})", "/train/steps", "expected an integer, got true"},
      {R"({"train": {"steps": -1}})", "/train/steps", "must be >= 0, got -1"},
      {R"({"train": {"steps": 10000000000000000000}})", "/train/steps",
       "out of range of a 64-bit integer (-2^63 to 2^63-1), got 10000000000000000000"},
      {R"({"seed": 18446744073709551616})", "/seed",
       "out of range of an unsigned 64-bit integer (0 to 2^64-1), got 1.8446744073709552e+19"},
      {R"({"train": {"batch_per_rank": 0}})", "/train/batch_per_rank", "must be >= 1, got 0"},
      {R"({"train": {"grad_accum": 0}})", "/train/grad_accum", "must be >= 1, got 0"},
      {R"({"train": {"threads_per_rank": 0}})", "/train/threads_per_rank", "must be >= 1"},
      {R"({"train": {"precision": "bf16"}})", "/train/precision",
       R"("bf16" needs /train/device "cuda" (the CPU computes in fp32))"},
      {R"({"train": {"precision": "fp64"}})", "/train/precision",
       R"(must be "fp32", "bf16" or "fp16", got "fp64")"},
      {R"({"train": {"device": "tpu"}})", "/train/device", R"(must be "cpu" or "cuda", got "tpu")"},
      {R"({"train": {"device": "cuda"}, "model": {"type": "gpt", "width": 96, "heads": 2},
          "data": {"type": "tokens", "path": "."}})",
       "/model/heads",
       "on \"cuda\" the head size (width / heads) must be 32, 64 or 128, got 96 / 2 = 48"},
      {R"({"train": {"device": "cuda", "precision": "fp16"},
          "distributed": {"compression": {"type": "topk"}}})",
       "/distributed/compression/type",
       R"("topk" (error feedback) is not supported with /train/precision "fp16" (use "bf16", or )"
       R"(the "fp16" or "bf16" wire format))"},
      {R"({"model": []})", "/model", "expected an object, got an array"},
      {R"({"model": {"type": "transformer"}})", "/model/type",
       R"(must be "mlp" or "gpt", got "transformer")"},
      {R"({"model": {"type": "gpt"}})", "/data/type",
       R"(the gpt model trains on "tokens" data, got "synthetic-classification")"},
      {R"({"data": {"type": "tokens", "path": "d"}})", "/data/type",
       R"("tokens" data needs the gpt model, got "mlp")"},
      {R"({"model": {"type": "gpt", "width": 30, "heads": 4}, "data": {"type": "tokens",
          "path": "d"}})",
       "/model/width", "must be a multiple of /model/heads (4), got 30"},
      {R"({"model": {"type": "gpt", "dropout": 0.1}, "data": {"type": "tokens", "path": "d"}})",
       "/model/dropout", "must be 0"},
      {R"({"model": {"type": "gpt", "context": 0}, "data": {"type": "tokens", "path": "d"}})",
       "/model/context", "must be >= 1"},
      {R"({"model": {"type": "gpt"}, "data": {"type": "tokens"}})", "/data/path",
       R"(required when /data/type is "tokens")"},
      {R"({"model": {"type": "gpt"}, "data": {"type": "tokens", "path": ""}})", "/data/path",
       R"(must name the data (from the recipe's folder, or absolute), got "")"},
      {R"({"model": {"input": 0}})", "/model/input", "must be >= 1, got 0"},
      {R"({"model": {"hidden": 256}})", "/model/hidden", "expected an array, got 256"},
      {R"({"model": {"hidden": [256, 0]}})", "/model/hidden/1", "must be >= 1, got 0"},
      {R"({"model": {"hidden": [64, "x"]}})", "/model/hidden/1", "expected an integer"},
      {R"({"model": {"classes": 1}})", "/model/classes", "must be >= 2, got 1"},
      {R"({"model": {"activation": "tanh"}})", "/model/activation",
       R"(must be "relu" or "gelu", got "tanh")"},
      {R"({"data": {"type": "parquet"}})", "/data/type",
       R"(must be "synthetic-classification", "csv" or "tokens", got "parquet")"},
      {R"({"data": {"samples": 1}})", "/data/samples", "must be >= 2, got 1"},
      {R"({"data": {"noise": -0.5}})", "/data/noise", "must be >= 0, got -0.5"},
      {R"({"data": {"noise": 1e39}})", "/data/noise", "must be <= 1000000 (10^6)"},
      {R"({"data": {"eval_fraction": 1}})", "/data/eval_fraction", "must be in [0, 1), got 1"},
      {R"({"data": {"type": "csv", "path": "/dev/null", "header": "maybe"}})", "/data/header",
       R"(must be "auto", "yes" or "no")"},
      {R"({"data": {"type": "csv"}})", "/data/path", R"(required when /data/type is "csv")"},
      {R"({"data": {"type": "csv", "path": "~/data/x.csv"}})", "/data/path",
       R"("~/data/x.csv": a leading ~ is not expanded; give the path from the recipe's folder, or an absolute one)"},
      {R"({"optimizer": {"lr": -1}})", "/optimizer/lr", "must be > 0, got -1"},
      {R"({"optimizer": {"lr": 0}})", "/optimizer/lr", "must be > 0, got 0"},
      {R"({"optimizer": {"lr": "0.1"}})", "/optimizer/lr", R"(expected a number, got "0.1")"},
      {R"({"optimizer": {"lr": false}})", "/optimizer/lr", "expected a number, got false"},
      {R"({"optimizer": {"type": "adam"}})", "/optimizer/type",
       R"(must be "adamw" or "sgd", got "adam")"},
      {R"({"optimizer": {"weight_decay": -0.1}})", "/optimizer/weight_decay", "must be >= 0"},
      {R"({"optimizer": {"type": "sgd", "momentum": 1}})", "/optimizer/momentum",
       "must be in [0, 1), got 1"},
      {R"({"optimizer": {"beta1": -0.1}})", "/optimizer/beta1", "must be in [0, 1)"},
      {R"({"optimizer": {"beta2": 1.5}})", "/optimizer/beta2", "must be in [0, 1), got 1.5"},
      {R"({"optimizer": {"eps": 0}})", "/optimizer/eps", "must be > 0"},
      {R"({"optimizer": {"type": "sgd", "nesterov": "yes"}})", "/optimizer/nesterov",
       "expected true or false"},
      {R"({"optimizer": {"clip_grad_norm": -1}})", "/optimizer/clip_grad_norm", "must be >= 0"},
      {R"({"optimizer": {"schedule": {"type": "step"}}})", "/optimizer/schedule/type",
       R"(must be "constant", "cosine" or "linear")"},
      {R"({"optimizer": {"schedule": {"warmup": -1}}})", "/optimizer/schedule/warmup",
       "must be >= 0"},
      {R"({"optimizer": {"schedule": {"warmup": 600}}})", "/optimizer/schedule/warmup",
       "must be <= /train/steps (500), got 600"},
      {R"({"optimizer": {"schedule": {"min_lr_ratio": 1.5}}})", "/optimizer/schedule/min_lr_ratio",
       "must be in [0, 1], got 1.5"},
      {R"({"distributed": {"backend": "mpi"}})", "/distributed/backend",
       R"(must be "auto", "gloo" or "nccl", got "mpi")"},
      {R"({"distributed": {"backend": "nccl"}})", "/distributed/backend",
       R"("nccl" needs /train/device "cuda")"},
      {R"({"distributed": {"sync": "local-sgd"}})", "/distributed/sync",
       R"(must be "allreduce", "local_sgd" or "ps", got "local-sgd")"},
      {R"({"distributed": {"sync": "local_sgd", "period": 0}})", "/distributed/period",
       "must be >= 1, got 0"},
      {R"({"distributed": {"sync": "ps", "servers": 0}})", "/distributed/servers",
       "must be >= 1, got 0"},
      {R"({"distributed": {"sync": "ps", "staleness": -2}})", "/distributed/staleness",
       "must be >= 0, got -2"},
      {R"({"distributed": {"sync": "ps", "zero": 1}})", "/distributed/zero",
       R"(1 needs /distributed/sync "allreduce", got "ps")"},
      {R"({"distributed": {"sync": "local_sgd", "start": -1}})", "/distributed/start",
       "must be >= 0, got -1"},
      {R"({"distributed": {"zero": 2}})", "/distributed/zero", "must be in [0, 1], got 2"},
      {R"({"distributed": {"zero": 1, "sync": "local_sgd"}})", "/distributed/zero",
       R"(1 needs /distributed/sync "allreduce", got "local_sgd")"},
      {R"({"distributed": {"zero": 1, "compression": {"type": "int8"}}})",
       "/distributed/compression/type",
       R"("int8" is not supported with /distributed/zero 1 (compression applies to )"
       R"(/distributed/sync "allreduce" without /distributed/zero only))"},
      {R"({"distributed": {"sync": "local_sgd", "compression": {"type": "topk"}}})",
       "/distributed/compression/type",
       R"("topk" is not supported with /distributed/sync "local_sgd" (compression applies to )"
       R"(/distributed/sync "allreduce" without /distributed/zero only))"},
      {R"({"distributed": {"compression": {"type": "topk", "ratio": 0}}})",
       "/distributed/compression/ratio", "must be in (0, 1], got 0"},
      {R"({"distributed": {"compression": {"type": "int8", "block": 0}}})",
       "/distributed/compression/block", "must be >= 1, got 0"},
      {R"({"distributed": {"compression": {"type": "powersgd", "rank": 0}}})",
       "/distributed/compression/rank", "must be >= 1, got 0"},
      {R"({"distributed": {"resize": "grow"}})", "/distributed/resize",
       R"(must be "keep_global_batch" or "scale_lr", got "grow")"},
      {R"({"fault_tolerance": {"rejoin_timeout_s": -1}})", "/fault_tolerance/rejoin_timeout_s",
       "must be >= 0"},
      {R"({"distributed": {"compression": {"type": "int4"}}})", "/distributed/compression/type",
       R"(must be "none", "fp16", "bf16", "int8", "topk" or "powersgd", got "int4")"},
      {R"({"distributed": {"bucket_mb": 0}})", "/distributed/bucket_mb", "must be > 0, got 0"},
      {R"({"distributed": {"overlap": 1}})", "/distributed/overlap",
       "expected true or false, got 1"},
      {R"({"distributed": {"check_every": -1}})", "/distributed/check_every", "must be >= 0"},
      {R"({"distributed": {"timeout_s": 0}})", "/distributed/timeout_s", "must be >= 0.001, got 0"},
      {R"({"distributed": {"timeout_s": 1e-9}})", "/distributed/timeout_s",
       "must be >= 0.001, got 1e-09"},
      {R"({"distributed": {"timeout_s": null}})", "/distributed/timeout_s",
       "expected a number, got null"},
      {R"({"checkpoint": {"every": -1}})", "/checkpoint/every", "must be >= 0, got -1"},
      {R"({"checkpoint": {"keep": 0}})", "/checkpoint/keep", "must be >= 1, got 0"},
      {R"({"eval": {"every": -1}})", "/eval/every", "must be >= 0, got -1"},
      {R"({"eval": {"max_samples": -5}})", "/eval/max_samples", "must be >= 0, got -5"},
      {R"({"log": {"every": 0}})", "/log/every", "must be >= 1, got 0"},
      {R"({"name": ""})", "/name", "must not be empty"},
      {R"({"name": "my run/1"})", "/name", "may only contain"},
      {R"({"name": ".."})", "/name", "must not be"},
      {R"({"name": 7})", "/name", "expected a string, got 7"},
      {R"({"seed": -1})", "/seed", "must be >= 0, got -1"},
      {R"({"seed": 1.5})", "/seed", "expected an integer, got 1.5"},
      // Upper bounds: past them a value is a mistake, and what is computed from it overflows.
      {R"({"train": {"batch_per_rank": 16777217}})", "/train/batch_per_rank",
       "must be <= 16777216 (2^24), got 16777217"},
      {R"({"train": {"batch_per_rank": 4, "grad_accum": 4611686018427387905}})",
       "/train/grad_accum", "must be <= 1048576 (2^20), got 4611686018427387905"},
      {R"({"train": {"batch_per_rank": 16777216, "grad_accum": 1048576}})", "/train/grad_accum",
       "/train/batch_per_rank x /train/grad_accum must be <= 2147483648 (2^31 samples per rank "
       "and step), got 16777216 x 1048576 = 17592186044416"},
      {R"({"train": {"threads_per_rank": 1000}})", "/train/threads_per_rank",
       "must be <= 256 (BLAS threads per rank), got 1000"},
      // Counts of steps: a warm-up of 2^63 - 1 made the learning rate negative.
      {R"({"train": {"steps": 9223372036854775807}})", "/train/steps",
       "must be <= 1000000000000 (10^12 steps), got 9223372036854775807"},
      {R"({"optimizer": {"schedule": {"warmup": 1000000000001}}})", "/optimizer/schedule/warmup",
       "must be <= 1000000000000 (10^12 steps)"},
      {R"({"checkpoint": {"every": 1e13}})", "/checkpoint/every", "must be <= 1000000000000"},
      {R"({"eval": {"every": 1e13}})", "/eval/every", "must be <= 1000000000000"},
      {R"({"log": {"every": 1e13}})", "/log/every", "must be <= 1000000000000"},
      {R"({"distributed": {"check_every": 1e13}})", "/distributed/check_every",
       "must be <= 1000000000000"},
      {R"({"distributed": {"sync": "local_sgd", "period": 1e13}})", "/distributed/period",
       "must be <= 1000000000000"},
      {R"({"distributed": {"bucket_mb": 1e300}})", "/distributed/bucket_mb",
       "must be <= 1048576 (1 TiB), got 1e+300"},
      {R"({"distributed": {"compression": {"type": "int8", "block": 1e10}}})",
       "/distributed/compression/block", "must be <= 2147483647 (2^31 - 1)"},
      {R"({"model": {"input": 9999999999}})", "/model/input",
       "must be <= 2147483647 (2^31 - 1), got 9999999999"},
      {R"({"model": {"hidden": [64, 2147483648]}})", "/model/hidden/1",
       "must be <= 2147483647 (2^31 - 1), got 2147483648"},
      {R"({"model": {"classes": 2147483648}})", "/model/classes", "must be <= 2147483647"},
      // Cast to int by the launcher: 2^32 + 1 restarts became one.
      {R"({"fault_tolerance": {"max_restarts": 4294967297}})", "/fault_tolerance/max_restarts",
       "must be <= 2147483647 (2^31 - 1), got 4294967297"},
      {R"({"model": {"type": "gpt", "vocab": 1e10}, "data": {"type": "tokens", "path": "d"}})",
       "/model/vocab", "must be <= 2147483647 (2^31 - 1)"},
      {R"({"model": {"type": "gpt", "context": 2147483648}, "data": {"type": "tokens",
          "path": "d"}})",
       "/model/context", "must be <= 2147483647"},
      {R"({"model": {"type": "gpt", "layers": 2147483648}, "data": {"type": "tokens",
          "path": "d"}})",
       "/model/layers", "must be <= 2147483647"},
      {R"({"model": {"type": "gpt", "heads": 2147483648}, "data": {"type": "tokens",
          "path": "d"}})",
       "/model/heads", "must be <= 2147483647"},
      {R"({"model": {"type": "gpt", "width": 2147483648}, "data": {"type": "tokens",
          "path": "d"}})",
       "/model/width", "must be <= 2147483647"},
      {R"({"model": {"type": "gpt", "mlp_ratio": 2147483648}, "data": {"type": "tokens",
          "path": "d"}})",
       "/model/mlp_ratio", "must be <= 2147483647"},
      {R"({"model": {"input": 2147483647, "hidden": [2147483647]}})", "/model/input",
       "the mlp would have 4,611,686,037,754,740,736 parameters, more than the "
       "1,099,511,627,776 (2^40) allowed"},
      {R"({"model": {"input": 1000000, "hidden": [2000000]}})", "/model/hidden/0",
       "the mlp would have 2,000,022,000,010 parameters, more than the 1,099,511,627,776 (2^40) "
       "allowed"},
      {R"({"model": {"type": "gpt", "width": 1048576}, "data": {"type": "tokens", "path": "d"}})",
       "/model/width",
       "the gpt would have 52,777,017,409,536 parameters, more than the 1,099,511,627,776"},
      {R"({"model": {"type": "gpt", "layers": 2147483647}, "data": {"type": "tokens",
          "path": "d"}})",
       "/model/layers", "the gpt would have 425,785,877,707,392 parameters"},
      {R"({"model": {"type": "gpt", "vocab": 2147483647, "width": 1024}, "data": {"type":
          "tokens", "path": "d"}})",
       "/model/vocab", "more than the 1,099,511,627,776 (2^40) allowed"},
      {R"({"model": {"type": "gpt", "layers": 2147483647, "width": 2147483647, "heads": 1,
          "mlp_ratio": 1}, "data": {"type": "tokens", "path": "d"}})",
       "/model/width",
       "the gpt would have more than 18,446,744,073,709,551,615 parameters, more than the "
       "1,099,511,627,776 (2^40) allowed"},
      {R"({"model": {"type": "gpt", "width": 1073741824, "mlp_ratio": 4}, "data": {"type":
          "tokens", "path": "d"}})",
       "/model/mlp_ratio",
       "the MLP's width, /model/mlp_ratio x /model/width = 4 x 1073741824 = 4294967296, must be "
       "<= 2147483647 (2^31 - 1)"},
      {R"({"data": {"samples": 10000000000}})", "/data/samples",
       "/data/samples x /model/input = 10000000000 x 784 = 7,840,000,000,000 values, more than "
       "the 1,099,511,627,776 (2^40) synthetic data may hold"},
      {R"({"distributed": {"timeout_s": 1e300}})", "/distributed/timeout_s",
       "must be <= 1000000 (about 11.6 days), got 1e+300"},
      {R"({"distributed": {"timeout_s": 9300000000}})", "/distributed/timeout_s",
       "must be <= 1000000 (about 11.6 days), got 9300000000"},
      {R"({"fault_tolerance": {"hang_timeout_s": 1000000.5}})", "/fault_tolerance/hang_timeout_s",
       "must be <= 1000000 (about 11.6 days)"},
      {R"({"fault_tolerance": {"rejoin_timeout_s": 1e12}})", "/fault_tolerance/rejoin_timeout_s",
       "must be <= 1000000 (about 11.6 days), got 1000000000000.0"},
      {R"({"fault_tolerance": {"restart_backoff_s": 1e18}})", "/fault_tolerance/restart_backoff_s",
       "must be <= 1000000 (about 11.6 days)"},
      {R"({"name": "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"})",
       "/name",
       "must be at most 100 characters long (it becomes a directory name, with the time after "
       "it), is 101, got \"aaaa"},
      {R"({"extra": 1})", "/extra", "unknown key 'extra'"},
      {R"({"log": {"a/b": 1}})", "/log/a~1b", "unknown key 'a/b'"},
  };
  for (const auto& bad : cases) {
    std::string text = bad.text;
    CAPTURE(text);
    std::string message = problems_of(text);
    CAPTURE(message);
    CHECK(has_problem(message, bad.pointer, bad.phrase));
    CHECK(lines_of(message).size() == 1);
  }
}

TEST_CASE("recipe: all problems are reported together, one line each") {
  std::string message = problems_of(R"({
    "seed": "x",
    "model": {"hidden": [0, 8], "classes": 1},
    "optimizer": {"lr": -1, "schedule": {"warmupp": 1}},
    "log": {"every": 0}
  })");
  CAPTURE(message);
  CHECK(lines_of(message).size() == 6);
  CHECK(has_problem(message, "/seed", "expected an integer"));
  CHECK(has_problem(message, "/model/hidden/0", "must be >= 1"));
  CHECK(has_problem(message, "/model/classes", "must be >= 2"));
  CHECK(has_problem(message, "/optimizer/lr", "must be > 0"));
  CHECK(has_problem(message, "/optimizer/schedule/warmupp", "did you mean 'warmup'?"));
  CHECK(has_problem(message, "/log/every", "must be >= 1"));
}

TEST_CASE("recipe: a bad value keeps the warm-up cross-check quiet") {
  // steps is wrong on its own; comparing warmup with the default would add a misleading line.
  std::string message = problems_of(R"({"train": {"steps": -3},
                                        "optimizer": {"schedule": {"warmup": 600}}})");
  CHECK(lines_of(message).size() == 1);
  CHECK(has_problem(message, "/train/steps", "must be >= 0"));
}

TEST_CASE("recipe: a long unknown key is shown cut, in the pointer and the message") {
  const std::string key(100000, 'k');
  const std::string shown = std::string(60, 'k') + "...";
  const std::string message = problems_of(json{{key, 1}}.dump());
  CHECK(has_problem(message, "/" + shown, "unknown key '" + shown + "'"));
  CHECK(message.size() < 200);
}

TEST_CASE("recipe: unknown keys suggest a close known key") {
  CHECK(has_problem(problems_of(R"({"model": {"hiden": [8]}})"), "/model/hiden",
                    "unknown key 'hiden'; did you mean 'hidden'?"));
  CHECK(has_problem(problems_of(R"({"optimizer": {"lr ": 0.1}})"), "/optimizer/lr ",
                    "did you mean 'lr'?"));
  CHECK(
      has_problem(problems_of(R"({"optimiser": {}})"), "/optimiser", "did you mean 'optimizer'?"));
  CHECK(has_problem(problems_of(R"({"optimizer": {"schedule": {"warmup_steps": 5}}})"),
                    "/optimizer/schedule/warmup_steps", "did you mean 'warmup'?"));
  CHECK(has_problem(problems_of(R"({"train": {"batch": 5}})"), "/train/batch",
                    "did you mean 'batch_per_rank'?"));

  // A field of another section, in the wrong one: that field's pointer, not a near spelling here
  // ('log', 'eps'); several when the name is in several sections; this section's own field
  // spelled another way first.
  CHECK(has_problem(problems_of(R"({"lr": 0.1})"), "/lr", "did you mean '/optimizer/lr'?"));
  CHECK(has_problem(problems_of(R"({"optimizer": {"steps": 3}})"), "/optimizer/steps",
                    "did you mean '/train/steps'?"));
  CHECK(has_problem(problems_of(R"({"optimizer": {"warmup": 3}})"), "/optimizer/warmup",
                    "did you mean '/optimizer/schedule/warmup'?"));
  CHECK(has_problem(problems_of(R"({"train": {"every": 3}})"), "/train/every",
                    "did you mean '/checkpoint/every', '/eval/every' or '/log/every'?"));
  CHECK(has_problem(problems_of(R"({"train": {"batchPerRank": 4}})"), "/train/batchPerRank",
                    "did you mean 'batch_per_rank'?"));
  CHECK(has_problem(problems_of(R"({"train": {"Seed": 4}})"), "/train/Seed",
                    "did you mean '/seed'?"));
  // Not the run's name for a section's "name", nor five fields for a "type".
  CHECK(problems_of(R"({"model": {"name": "gpt"}})").find("'/name'") == std::string::npos);
  CHECK(problems_of(R"({"type": "gpt"})").find("'/model/type'") == std::string::npos);

  std::string far = problems_of(R"({"optimizer": {"learning_rate": 0.1}})");
  CHECK(has_problem(far, "/optimizer/learning_rate", "unknown key 'learning_rate'"));
  CHECK(far.find("did you mean") == std::string::npos);
}

TEST_CASE("recipe: csv paths resolve against the recipe's folder and must be readable") {
  TempDir dir;
  fs::path csv = dir.write("data/train.csv", "label,x\n0,1\n");

  SUBCASE("a relative path is stored absolute") {
    Recipe r = parse_recipe(json::parse(R"({"model": {"input": 1},
                                            "data": {"type": "csv", "path": "data/train.csv"}})"),
                            "test.json", dir.path());
    CHECK(fs::path(r.data.path).is_absolute());
    CHECK(fs::equivalent(r.data.path, csv));
  }
  SUBCASE("load_recipe resolves against the file's parent directory") {
    fs::path recipe = dir.write("recipes/r.json", R"({"model": {"input": 1},
        "data": {"type": "csv", "path": "../data/train.csv"}})");
    Recipe r = load_recipe(recipe);
    CHECK(fs::equivalent(r.data.path, csv));
    CHECK(r.data.path == csv.lexically_normal().string());
  }
  SUBCASE("a missing file names the resolved path") {
    std::string message =
        problems_of(R"({"data": {"type": "csv", "path": "nope.csv"}})", dir.path());
    CHECK(has_problem(message, "/data/path", (dir.path() / "nope.csv").string()));
    CHECK(has_problem(message, "/data/path", "No such file or directory"));
  }
  SUBCASE("a control character, or a folder named in another encoding, is refused up front") {
    CHECK(has_problem(
        problems_of("{\"data\": {\"type\": \"tokens\", \"path\": \"ds\\n\"}}", dir.path()),
        "/data/path", "\"ds\\x0a\": a control character in a path"));
    CHECK(has_problem(
        problems_of("{\"data\": {\"type\": \"csv\", \"path\": \"d.csv\\u0000x\"}}", dir.path()),
        "/data/path", "\"d.csv\\x00x\": a control character in a path"));
    // The name is found (it exists), but a run's recipe.json could not name it.
    const fs::path latin1 = dir.path() / "lat\xe9";
    fs::create_directories(latin1 / "ds");
    const std::string message =
        problems_of(R"({"data": {"type": "tokens", "path": "ds"}})", latin1);
    CHECK(has_problem(message, "/data/path", "is not UTF-8 (a name in another encoding)"));
  }
  SUBCASE("a directory is not a data file") {
    std::string message = problems_of(R"({"data": {"type": "csv", "path": "data"}})", dir.path());
    CHECK(has_problem(message, "/data/path", "is a directory"));
  }
  SUBCASE("an unreadable file is refused") {
    if (geteuid() == 0) return;  // root reads through any permission bits
    fs::permissions(csv, fs::perms::none);
    std::string message =
        problems_of(R"({"model": {"input": 1}, "data": {"type": "csv", "path": "data/train.csv"}})",
                    dir.path());
    CHECK(has_problem(message, "/data/path", "Permission denied"));
  }
}

// The message of the Error(recipe) that load_recipe(file) throws; fails the test if none is thrown.
std::string load_problems(const fs::path& file) {
  try {
    load_recipe(file);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::recipe);
    return e.what();
  }
  FAIL("no error for " << file);
  return "";
}

TEST_CASE("recipe: a key given twice in one object is refused, each repeat named") {
  TempDir dir;
  const fs::path file = dir.write("dup.json", R"({
    "optimizer": {"lr": 0.1, "type": "sgd", "lr": 0.2},
    "model": {"hidden": [8], "hidden": [16]},
    "list": [{"a": 1}, {"b": 1, "b": 2}],
    "train": {"steps": 5}, "distributed": {"compression": {"type": "none"}}
  })");
  try {
    load_recipe(file);
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::recipe);
    const std::string prefix = file.string() + ": ";
    CHECK(lines_of(e.what()) ==
          std::vector<std::string>{
              prefix + "/optimizer/lr: duplicate key 'lr': the object sets it twice",
              prefix + "/model/hidden: duplicate key 'hidden': the object sets it twice",
              prefix + "/list/1/b: duplicate key 'b': the object sets it twice",
              // and what else is wrong, as for any recipe
              prefix + "/list: unknown key 'list'"});
  }
  // The same keys in different objects are no repeat.
  const fs::path fine = dir.write(
      "fine.json", R"({"train": {"steps": 5}, "eval": {"every": 0}, "log": {"every": 1}})");
  CHECK(load_recipe(fine).train.steps == 5);
}

TEST_CASE("recipe: an integer field written with a fraction its double loses is refused") {
  TempDir dir;
  // 4503599627370495.2 and 1.0000000000000001 read as integral doubles; the text tells.
  const fs::path file = dir.write("frac.json", R"({
    "seed": 4503599627370495.2, "train": {"steps": 1.0000000000000001, "batch_per_rank": 2.50e0},
    "optimizer": {"lr": 1.0000000000000001}
  })");
  const std::string prefix = file.string() + ": ";
  CHECK(lines_of(load_problems(file)) ==
        std::vector<std::string>{
            prefix + "/seed: expected an integer, got 4503599627370495.2 (a fraction that would "
                     "be lost: it reads as 4503599627370495)",
            prefix + "/train/steps: expected an integer, got 1.0000000000000001 (a fraction that "
                     "would be lost: it reads as 1)",
            prefix + "/train/batch_per_rank: expected an integer, got 2.5"});
  // Alone, as read from a recipe whose fields are otherwise right.
  const fs::path one = dir.write("one.json", R"({"train": {"steps": 1.0000000000000001},
    "optimizer": {"lr": 1.0000000000000001}})");
  CHECK(load_problems(one) == one.string() +
                                  ": /train/steps: expected an integer, got 1.0000000000000001 (a "
                                  "fraction that would be lost: it reads as 1)");
  // A float field takes the nearest double, as always; integers with a zero fraction or an
  // exponent that moves the point past every digit stay integers.
  const fs::path exact = dir.write("exact.json", R"({"seed": 4503599627370495.000,
    "train": {"steps": 100e-2, "batch_per_rank": 1.5e1}, "optimizer": {"lr": 1.0000000000000001}})");
  // A key given twice keeps its last value: the first one's fraction is no field's.
  for (const char* text : {R"({"train": {"steps": 1.0000000000000001}, "train": {}})",
                           R"({"seed": 1.0000000000000001, "seed": "x"})",
                           R"({"seed": 1.0000000000000001, "seed": 3})"}) {
    CAPTURE(text);
    const auto said = lines_of(load_problems(dir.write("twice.json", text)));
    REQUIRE_FALSE(said.empty());
    CHECK(said[0].find(": duplicate key '") != std::string::npos);
    for (const auto& line : said)
      CHECK(line.find("a fraction that would be lost") == std::string::npos);
  }
  // Fields that apply to other kinds than the default's (a gpt model's) are known while other
  // fields are wrong; so are an array's elements past the default's.
  const auto has_line = [](const std::vector<std::string>& lines, const std::string& part) {
    return std::count_if(lines.begin(), lines.end(), [&](const std::string& line) {
             return line.find(part) != std::string::npos;
           }) == 1;
  };
  const auto gpt = lines_of(load_problems(dir.write(
      "gpt.json", R"({"seed": -1, "model": {"type": "gpt", "layers": 4.0000000000000001}})")));
  CHECK(has_line(gpt, "/model/layers: expected an integer, got 4.0000000000000001"));
  CHECK(has_line(gpt, "/seed: "));
  const auto mlp = lines_of(load_problems(dir.write(
      "mlp.json", R"({"seed": -1, "model": {"hidden": [8, 8, 8, 8.0000000000000001]}})")));
  CHECK(has_line(mlp, "/model/hidden/3: expected an integer, got 8.0000000000000001"));
  const Recipe r = load_recipe(exact);
  CHECK(r.seed == 4503599627370495u);
  CHECK(r.train.steps == 1);
  CHECK(r.train.batch_per_rank == 15);
  CHECK(r.optimizer.lr == 1.0);
}

TEST_CASE("recipe: nesting no recipe has is refused at once, however deep") {
  TempDir dir;
  // 64 levels are a (wrong, but checked) recipe; 65 are refused while parsing: a million would
  // otherwise cost time and memory quadratic in the depth.
  const auto nested = [](size_t depth) {
    return "{\"x\": " + std::string(depth - 1, '[') + std::string(depth - 1, ']') + "}";
  };
  CHECK(load_problems(dir.write("64.json", nested(64))).find("unknown key 'x'") !=
        std::string::npos);
  CHECK(load_problems(dir.write("65.json", nested(65))) ==
        (dir.path() / "65.json").string() +
            ": nested more than 64 levels deep (at /x/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0/0...); a "
            "recipe is a few levels of objects");
  CHECK(load_problems(dir.write("deep.json", nested(1000000))).find("nested more than 64 levels") !=
        std::string::npos);
}

TEST_CASE("recipe: load_recipe reports unreadable files and invalid JSON with a location") {
  TempDir dir;
  SUBCASE("missing file") {
    fs::path missing = dir.path() / "missing.json";
    CHECK(load_problems(missing) == missing.string() + ": cannot read: No such file or directory");
  }
  SUBCASE("a directory") {
    CHECK(load_problems(dir.path()) == dir.path().string() + ": cannot read: Is a directory");
  }
  SUBCASE("invalid JSON") {
    fs::path file = dir.write("bad.json", "{\n  \"name\": \"x\",\n  \"seed\": ,\n}\n");
    std::string message = load_problems(file);
    CAPTURE(message);
    CHECK(message.starts_with(file.string() + ": not valid JSON at line 3, column 11: "));
    CHECK(message.find("json.exception") == std::string::npos);
  }
  SUBCASE("a NUL byte: UTF-16 text, or junk after a recipe, is not read as the text before it") {
    fs::path cut = dir.write("nul.json", std::string("{\"seed\": 5}\0garbage", 20));
    CHECK(load_problems(cut) == cut.string() +
                                    ": not valid JSON at line 1, column 12: a NUL byte, which JSON "
                                    "text never holds (UTF-16 text, or a binary file?)");
    fs::path utf16 = dir.write("u16.json", std::string("{\0}\0", 4));
    CHECK(load_problems(utf16).find(": not valid JSON at line 1, column 2: a NUL byte") !=
          std::string::npos);
  }
  SUBCASE("an empty file") {
    fs::path file = dir.write("empty.json", "");
    CHECK(load_problems(file) == file.string() + ": empty file, not valid JSON");
  }
  SUBCASE("validation problems name the file") {
    fs::path file = dir.write("r.json", R"({"optimizer": {"lr": -1}})");
    CHECK(load_problems(file) == file.string() + ": /optimizer/lr: must be > 0, got -1");
  }
}

TEST_CASE("recipe: values at the upper bounds are accepted") {
  const std::string name(100, 'n');
  // (A batch of 2^31 samples per rank needs as many training samples: 2^31 x 512 inputs is
  // what synthetic data may hold at most.)
  CHECK(parse_recipe(json::parse(R"({"model": {"input": 2147483647, "hidden": [256],
      "classes": 2}, "data": {"samples": 512}})"),
                     "test.json", "/")
            .model.input == 2147483647);
  const Recipe r = parse_recipe(json::parse(R"({"name": ")" + name + R"(",
      "model": {"input": 512, "hidden": [256], "classes": 2},
      "data": {"samples": 2147483648, "eval_fraction": 0},
      "train": {"batch_per_rank": 2048, "grad_accum": 1048576, "threads_per_rank": 256},
      "distributed": {"timeout_s": 1e6},
      "fault_tolerance": {"hang_timeout_s": 1e6, "rejoin_timeout_s": 1e6,
                          "restart_backoff_s": 1e6}})"),
                                "test.json", "/");
  CHECK(r.name == name);
  CHECK(r.train.batch_per_rank * r.train.grad_accum == int64_t{1} << 31);
  CHECK(r.train.threads_per_rank == 256);
  CHECK(r.distributed.timeout_s == 1e6);
  CHECK(r.fault_tolerance.restart_backoff_s == 1e6);
  // batch_per_rank at its own bound, with a grad_accum that keeps the product in range.
  CHECK(parse_recipe(json::parse(R"({"train": {"batch_per_rank": 16777216, "grad_accum": 128},
      "model": {"input": 512}, "data": {"samples": 2147483648, "eval_fraction": 0}})"),
                     "test.json", "/")
            .train.batch_per_rank == 16777216);
  // An mlp input -> 2^20 -> 2 has (input + 3) x 2^20 + 2 parameters: input 2^20 - 4 is the
  // largest within 2^40, one more passes it.
  CHECK_NOTHROW(parse_recipe(json::parse(R"({"model": {"input": 1048572, "hidden": [1048576],
      "classes": 2}, "data": {"samples": 1000}})"),
                             "test.json", "/"));
  CHECK(has_problem(problems_of(R"({"model": {"input": 1048573, "hidden": [1048576],
      "classes": 2}, "data": {"samples": 1000}})"),
                    "/model/hidden/0", "the mlp would have 1,099,511,627,778 parameters"));
}

TEST_CASE("recipe: synthetic data's split leaves training samples for one rank's batch") {
  CHECK(problems_of(R"({"data": {"samples": 10, "eval_fraction": 0.99}})") ==
        "test.json: /data/eval_fraction: 0.99 of 10 samples leaves none for training");
  CHECK(problems_of(R"({"data": {"samples": 10}, "train": {"batch_per_rank": 5,
      "grad_accum": 2}})") ==
        "test.json: /train/batch_per_rank: 9 training samples (/data/samples less the "
        "/data/eval_fraction share) are fewer than one rank's batch (5 x 2 train.grad_accum), "
        "even on one rank");
  CHECK_NOTHROW(
      parse_recipe(json::parse(R"({"data": {"samples": 10}, "train": {"batch_per_rank": 9}})"),
                   "test.json", "/"));
}

TEST_CASE("recipe: -0 is the integer 0") {
  const Recipe r = parse_recipe(
      json::parse(R"({"seed": -0, "train": {"steps": -0, "grad_accum": 1}})"), "test.json", "/");
  CHECK(r.seed == 0);
  CHECK(r.train.steps == 0);
  CHECK(parse_recipe(json::parse(R"({"seed": -0.0})"), "test.json", "/").seed == 0);
  CHECK(parse_recipe(json::parse(R"({"seed": -0e5})"), "test.json", "/").seed == 0);
  // Below 0 it is still refused.
  CHECK(has_problem(problems_of(R"({"seed": -1})"), "/seed", "must be >= 0, got -1"));
  CHECK(has_problem(problems_of(R"({"seed": -1.0})"), "/seed", "must be >= 0, got -1.0"));
}

TEST_CASE("recipe: parameter_count is what the model builds") {
  std::vector<ModelSpec> specs(5);
  specs[1].input = 3;
  specs[1].hidden = {5, 7};
  specs[1].classes = 4;
  specs[2].hidden = {};  // a linear classifier
  specs[3].type = "gpt";
  specs[3].vocab = 300;
  specs[3].context = 16;
  specs[3].layers = 3;
  specs[3].heads = 2;
  specs[3].width = 24;
  specs[3].mlp_ratio = 2;
  specs[4].type = "gpt";
  for (const ModelSpec& spec : specs) {
    INFO(spec.type, " ", spec.input, " ", spec.width);
    CHECK(parameter_count(spec) == make_model(spec)->num_params());
  }
  ModelSpec gpt2;  // GPT-2 small, as the README and dptrain-recipe(5) give it
  gpt2.type = "gpt";
  gpt2.vocab = 50257;
  gpt2.context = 1024;
  gpt2.layers = 12;
  gpt2.heads = 12;
  gpt2.width = 768;
  CHECK(parameter_count(gpt2) == 124439808);
  ModelSpec huge;
  huge.input = 9999999999;
  huge.hidden = {9999999999};
  CHECK(parameter_count(huge) == std::nullopt);  // past 2^64, not wrapped
}

TEST_CASE("recipe: a CSV file's columns must match model.input") {
  TempDir dir;
  const fs::path csv = dir.write("d.csv", "label,a,b\n1,2,3\n0,4,5\n");
  const auto recipe = [](int64_t input, const std::string& file, const std::string& header) {
    return json({{"model", {{"input", input}}},
                 {"data", {{"type", "csv"}, {"path", file}, {"header", header}}}})
        .dump();
  };
  CHECK(
      parse_recipe(json::parse(recipe(2, "d.csv", "auto")), "test.json", dir.path()).model.input ==
      2);
  SUBCASE("more features in the recipe than in the file") {
    const std::string message = problems_of(recipe(5, "d.csv", "auto"), dir.path());
    CHECK(lines_of(message).size() == 1);
    CHECK(has_problem(message, "/model/input",
                      "must match the 2 feature column(s) of \"" + csv.string() +
                          "\" (line 2 has 3 column(s): the label, then the features), got 5"));
  }
  SUBCASE("fewer") {
    CHECK(has_problem(problems_of(recipe(1, "d.csv", "yes"), dir.path()), "/model/input",
                      "must match the 2 feature column(s)"));
  }
  SUBCASE("the header setting picks the row that counts") {
    const fs::path ragged = dir.write("r.csv", "\n\nlabel,a,b,c\n1,2,3\n");
    CHECK(has_problem(problems_of(recipe(3, "r.csv", "auto"), dir.path()), "/model/input",
                      "(line 4 has 3 column(s)"));
    CHECK(has_problem(problems_of(recipe(2, "r.csv", "no"), dir.path()), "/model/input",
                      "must match the 3 feature column(s) of \"" + ragged.string() +
                          "\" (line 3 has 4 column(s)"));
  }
  SUBCASE("a file without data rows") {
    const fs::path empty = dir.write("e.csv", "label,a,b\n\n");
    CHECK(has_problem(problems_of(recipe(2, "e.csv", "yes"), dir.path()), "/data/path",
                      "\"" + empty.string() + "\" has no data rows (after the header row)"));
    dir.write("one.csv", "label,a,b\n");
    CHECK(has_problem(problems_of(recipe(2, "one.csv", "auto"), dir.path()), "/data/path",
                      "has no data rows (its one row, line 1, was taken for a header row"));
    dir.write("blank.csv", "");
    CHECK(has_problem(problems_of(recipe(2, "blank.csv", "no"), dir.path()), "/data/path",
                      "has no data rows"));
  }
  SUBCASE("a bad header setting is the one problem") {
    const std::string message = problems_of(recipe(5, "d.csv", "maybe"), dir.path());
    CHECK(lines_of(message).size() == 1);
    CHECK(has_problem(message, "/data/header", "must be"));
  }
}

TEST_CASE("recipe: every CSV row is checked when asked (recipe validate), not on every load") {
  TempDir dir;
  const fs::path csv = dir.write("d.csv", "label,a,b\n1,2,3\n3,4,5\n0.5,1,1\n2,x,1\n0,1,1\n");
  const json recipe = {{"model", {{"input", 2}, {"classes", 3}}},
                       {"data", {{"type", "csv"}, {"path", "d.csv"}}},
                       {"optimizer", {{"lr", -1}}}};
  // A load reads the first data row only (the columns): the labels wait for the launch.
  const std::string cheap = problems_of(recipe.dump(), dir.path());
  CHECK(lines_of(cheap).size() == 1);
  CHECK(has_problem(cheap, "/optimizer/lr", "must be > 0"));

  // What parsing with every row checked finds in `j`, or "" when nothing.
  const auto every_row_problems = [&](const json& j) -> std::string {
    try {
      parse_recipe(j, "test.json", dir.path(), RecipeOrigin::user, DataCheck::every_row);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  // Every wrong row, one line each naming file, line and field, beside the other problems.
  const std::string full = every_row_problems(recipe);
  CAPTURE(full);
  CHECK(lines_of(full).size() == 4);
  CHECK(has_problem(full, "/optimizer/lr", "must be > 0"));
  CHECK(has_problem(full, "/data/path",
                    csv.string() + ":3: label 3 is outside [0, 3) (model.classes is 3)"));
  CHECK(has_problem(full, "/data/path", csv.string() + ":4: label '0.5' is not an integer"));
  CHECK(has_problem(full, "/data/path", csv.string() + ":5: column 2 'x' is not a finite number"));

  json fine = recipe;
  fine["optimizer"]["lr"] = 0.1;
  // A column count that differs from model.input is said once, for the first row, not per row.
  json wide = fine;
  wide["model"]["input"] = 3;
  const std::string columns = every_row_problems(wide);
  CHECK(lines_of(columns).size() == 1);
  CHECK(has_problem(columns, "/model/input", "must match the 2 feature column(s)"));
  // A bad model.classes is its own problem: no label is checked against it.
  json no_classes = fine;
  no_classes["model"]["classes"] = 1;
  const std::string classes = every_row_problems(no_classes);
  CHECK(lines_of(classes).size() == 1);
  CHECK(has_problem(classes, "/model/classes", ""));

  dir.write("d.csv", "label,a,b\n1,2,3\n2,4,5\n");
  // Two rows split as a launch splits them: fewer training rows than one rank's batch...
  CHECK(has_problem(every_row_problems(fine), "/train/batch_per_rank",
                    "2 training samples (the 2 data row(s) of \"" + csv.string() +
                        "\" less the /data/eval_fraction share) are fewer than one rank's batch"));
  // ...or a held-out share that leaves none.
  fine["train"]["batch_per_rank"] = 1;
  fine["data"]["eval_fraction"] = 0.9;
  CHECK(has_problem(every_row_problems(fine), "/data/eval_fraction",
                    "0.9 of 2 samples leaves none for training"));
  fine["data"].erase("eval_fraction");
  CHECK(every_row_problems(fine).empty());
  CHECK(load_recipe(dir.write("ok.json", fine.dump()), DataCheck::every_row).data.type == "csv");
}

// FNV-1a 64 as published (isthe.com/chongo/tech/comp/fnv), to pin the hash to a definition that
// does not depend on the platform or the standard library.
uint64_t reference_fnv1a(const std::string& bytes) {
  uint64_t hash = 0xcbf29ce484222325ULL;
  for (unsigned char byte : bytes)
    hash = (hash ^ byte) * 0x100000001b3ULL;
  return hash;
}

TEST_CASE("recipe: the hash is a stable digest of the resolved recipe") {
  REQUIRE(reference_fnv1a("a") == 0xaf63dc4c8601ec8cULL);  // published test vector
  Recipe r;
  std::string hash = recipe_hash(r);
  CHECK(hash.size() == 16);
  CHECK(hash.find_first_not_of("0123456789abcdef") == std::string::npos);
  // Checkpoints record it: these values must not change, or earlier runs no longer resume.
  CHECK(hash == "99fc399d25d440bc");
  CHECK(recipe_hash(parse_recipe(json::parse(R"({"optimizer": {"type": "sgd", "momentum": 0.5},
      "distributed": {"compression": {"type": "topk", "ratio": 0.05}},
      "data": {"samples": 1000}})"),
                                 "test.json", "/")) == "2e69322ee8c3f347");

  // Key order and spelled-out defaults in the source do not matter; values do.
  Recipe reordered =
      parse_recipe(json::parse(R"({"log": {"every": 10}, "name": "run"})"), "test.json", "/");
  CHECK(recipe_hash(reordered) == hash);
  Recipe changed = r;
  changed.optimizer.lr = 2e-3;
  CHECK(recipe_hash(changed) != hash);
  changed = r;
  changed.model.hidden = {256, 255};
  CHECK(recipe_hash(changed) != hash);
}

TEST_CASE("recipe: the hash leaves out where the data lies; checkpoints of earlier builds match") {
  Recipe r;
  r.data.type = "csv";
  r.data.path = "/a/data.csv";
  Recipe moved = r;
  moved.data.path = "/b/copy.csv";
  CHECK(recipe_hash(moved) == recipe_hash(r));
  CHECK(recipe_mismatch(r, recipe_hash(moved)).empty());
  // Earlier builds hashed data.path too: the hash they recorded is recognised, for this path.
  CHECK(recipe_mismatch(r, "20c553d9ba052533").empty());
  CHECK_FALSE(recipe_mismatch(moved, "20c553d9ba052533").empty());
  const std::string earlier = "a6d3c1ba2f0b1e5c";  // no recipe has it
  CHECK(recipe_mismatch(r, earlier) ==
        "written by a different recipe (hash a6d3c1ba2f0b1e5c, "
        "this run's " +
            recipe_hash(r) + ")");
  CHECK(recipe_mismatch(r, "").starts_with("written by a different recipe (hash none, "));
  Recipe other = r;
  other.optimizer.lr *= 2;
  CHECK_FALSE(recipe_mismatch(r, recipe_hash(other)).empty());
  TrainingPosition p;
  p.recipe_hash = recipe_hash(other);
  CHECK(written_by(other)(p).empty());
  CHECK(written_by(r)(p) == recipe_mismatch(r, p.recipe_hash));
}

}  // namespace
}  // namespace dptrain
