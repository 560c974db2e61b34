// The GPT trainer end to end: gpt-tiny learns generated text well below its unigram entropy on 2
// ranks, data parallelism is equivalent to a bigger batch, a crashed run resumes bit-exactly,
// `dptrain sample` writes text, and GPT-2 small's recipe validates with its exact size.
#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <fstream>

#include "tests/harness.hpp"
#include "tests/text_corpus.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct TextDataset {
  TempDir tmp;
  fs::path dir = tmp / "dataset";
  double entropy_nats = 0;  // of the bytes of the text

  TextDataset(size_t bytes, const std::string& tokenizer = "byte") {
    const std::string text = synthetic_text(11, bytes);
    entropy_nats = unigram_entropy_bits(text) * std::log(2.0);
    write_text(tmp / "text.txt", text);
    const auto r = run_dptrain({"data", "prepare", "--text", (tmp / "text.txt").string(), "--out",
                                dir.string(), "--tokenizer", tokenizer});
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
  }
};

// A smaller gpt for the tests that compare runs.
json small_gpt(const fs::path& dataset) {
  json r = gpt_recipe(dataset, 2, 32);
  r["train"] = {{"steps", 24}, {"batch_per_rank", 4}};
  r["optimizer"]["schedule"] = {{"type", "cosine"}, {"warmup", 4}};
  r["checkpoint"] = {{"every", 8}, {"keep", 3}};
  r["eval"] = {{"every", 0}, {"max_samples", 64}};
  r["log"] = {{"every", 4}};
  r["distributed"]["check_every"] = 8;
  return r;
}

std::vector<float> final_params(const fs::path& run_dir) {
  return read_floats(latest_params(run_dir));
}

}  // namespace

TEST_CASE("gpt-tiny on 2 ranks learns generated text well below its unigram entropy") {
  TextDataset data(400000);
  const auto recipe = write_recipe(data.tmp.path(), gpt_recipe(data.dir));
  const auto run_dir = data.tmp / "run";
  const auto r = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string(), "--json"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json out = parse_json(r.out);
  CHECK(out["world_size"] == 2);
  CHECK(out["tokens_per_s"].get<double>() > 0);
  const double loss = out["eval_loss"].get<double>();
  MESSAGE("held-out loss " << loss << " nats/token; unigram entropy " << data.entropy_nats);
  // A model of single-byte frequencies gets the unigram entropy; the grammar's structure lets a
  // transformer do far better.
  CHECK(loss < 0.6 * data.entropy_nats);

  // What it writes: the same seed gives the same text, and greedy text is the grammar's words.
  const auto a = run_dptrain(
      {"sample", run_dir.string(), "--prompt", "the ", "--tokens", "80", "--seed", "3", "--json"});
  const auto b = run_dptrain(
      {"sample", run_dir.string(), "--prompt", "the ", "--tokens", "80", "--seed", "3", "--json"});
  INFO(a.err);
  REQUIRE(a.exit_code == 0);
  const json sa = parse_json(a.out);
  CHECK(sa["text"] == parse_json(b.out)["text"]);
  CHECK(sa["text"].get<std::string>().size() == 80);
  const auto greedy = run_dptrain(
      {"sample", run_dir.string(), "--prompt", "the ", "--tokens", "40", "--temperature", "0"});
  REQUIRE(greedy.exit_code == 0);
  CHECK(greedy.out.rfind("the ", 0) == 0);
  for (char ch : greedy.out)
    CHECK(((ch >= 'a' && ch <= 'z') || ch == ' ' || ch == '.' || ch == '?' || ch == '\n'));
}

TEST_CASE("gpt: 2 ranks x B and 1 rank x 2B train the same model") {
  TextDataset data(60000);
  json two = small_gpt(data.dir);
  json one = two;
  one["train"]["batch_per_rank"] = 8;
  const auto r2 = run_dptrain({"launch", write_recipe(data.tmp.path(), two, "two.json").string(),
                               "--nproc", "2", "--run-dir", (data.tmp / "two").string(), "--json"});
  const auto r1 = run_dptrain({"launch", write_recipe(data.tmp.path(), one, "one.json").string(),
                               "--nproc", "1", "--run-dir", (data.tmp / "one").string(), "--json"});
  INFO(r2.err, r1.err);
  REQUIRE(r2.exit_code == 0);
  REQUIRE(r1.exit_code == 0);
  const auto p2 = final_params(data.tmp / "two"), p1 = final_params(data.tmp / "one");
  REQUIRE(p1.size() == p2.size());
  double worst = 0;
  for (size_t i = 0; i < p1.size(); ++i) {
    worst =
        std::max(worst, std::abs(double(p1[i]) - p2[i]) / std::max(1e-2, std::abs(double(p1[i]))));
  }
  CHECK(worst < 1e-3);
  CHECK(parse_json(r2.out)["eval_loss"].get<double>() ==
        doctest::Approx(parse_json(r1.out)["eval_loss"].get<double>()).epsilon(1e-4));
}

TEST_CASE("gpt: a run killed mid-way restarts from its checkpoint and ends bit-identical") {
  TextDataset data(60000);
  const auto recipe = write_recipe(data.tmp.path(), small_gpt(data.dir));
  const auto clean = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (data.tmp / "clean").string()});
  REQUIRE(clean.exit_code == 0);
  const auto faulty = run_dptrain(
      {"launch", recipe.string(), "--nproc", "2", "--run-dir", (data.tmp / "faulty").string(),
       "--max-restarts", "1", "--restart-backoff", "0.1"},
      {{"DPTRAIN_FAULT", "crash@step=13,rank=1,gen=1"}});
  INFO(faulty.err);
  REQUIRE(faulty.exit_code == 0);
  CHECK(faulty.out.find("from step-000008") != std::string::npos);
  CHECK(read_text(latest_params(data.tmp / "faulty")) ==
        read_text(latest_params(data.tmp / "clean")));
}

TEST_CASE("gpt: sample refuses what it cannot do, with one line") {
  TextDataset data(20000, "char");
  json r = small_gpt(data.dir);
  r["train"]["steps"] = 4;
  r["model"]["vocab"] = 64;
  const auto recipe = write_recipe(data.tmp.path(), r);
  REQUIRE(run_dptrain({"launch", recipe.string(), "--run-dir", (data.tmp / "run").string()})
              .exit_code == 0);
  const auto unknown = run_dptrain({"sample", (data.tmp / "run").string(), "--prompt", "XYZ"});
  CHECK(unknown.exit_code == 2);
  CHECK(unknown.err.find("X") != std::string::npos);
  const auto bad = run_dptrain({"sample", (data.tmp / "run").string(), "--temperature", "-1"});
  CHECK(bad.exit_code == 2);
  CHECK(bad.err.find("--temperature") != std::string::npos);

  const auto mlp = write_recipe(data.tmp.path(), small_recipe(), "mlp.json");
  REQUIRE(
      run_dptrain({"launch", mlp.string(), "--run-dir", (data.tmp / "mlp").string()}).exit_code ==
      0);
  const auto wrong = run_dptrain({"sample", (data.tmp / "mlp").string()});
  CHECK(wrong.exit_code == 2);
  CHECK(wrong.err.find("needs a gpt run") != std::string::npos);

  // A dataset whose vocabulary the model cannot hold is refused before any rank starts.
  r["model"]["vocab"] = 8;
  const auto small_vocab = write_recipe(data.tmp.path(), r, "small-vocab.json");
  const auto refused =
      run_dptrain({"launch", small_vocab.string(), "--run-dir", (data.tmp / "no").string()});
  CHECK(refused.exit_code == 2);
  CHECK(refused.err.find("/model/vocab") != std::string::npos);
  CHECK_FALSE(fs::exists(data.tmp / "no"));

  // So is a token file damaged after its header was written (one bit of one token): the launch
  // reads it as the ranks will, checksum and all, and names the file.
  {
    std::fstream f(data.dir / "train.bin", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(64 + 1000);
    f.put('\x01');
  }
  const auto damaged =
      run_dptrain({"launch", recipe.string(), "--run-dir", (data.tmp / "damaged").string()});
  CHECK(damaged.exit_code == 2);
  // The recipe first, as every recipe error names it.
  CHECK(damaged.err.starts_with("dptrain: error: " + recipe.string() +
                                ": /data/path: " + (data.dir / "train.bin").string() +
                                ": checksum mismatch (the header says "));
  CHECK(std::count(damaged.err.begin(), damaged.err.end(), '\n') == 1);
  CHECK_FALSE(fs::exists(data.tmp / "damaged"));
}

TEST_CASE("recipes/gpt2-124m.json validates with GPT-2 small's exact parameter count") {
  const auto r = run_dptrain(
      {"recipe", "validate", (source_dir() / "recipes/gpt2-124m.json").string(), "--json"});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json out = parse_json(r.out);
  CHECK(out["parameters"] == 124439808);
  CHECK(out["model"].get<std::string>().find("124,439,808 parameters") != std::string::npos);
  const auto shown =
      run_dptrain({"recipe", "show", (source_dir() / "recipes/gpt2-124m.json").string()});
  REQUIRE(shown.exit_code == 0);
  CHECK(parse_json(shown.out)["model"]["width"] == 768);
  CHECK(shown.err.find("124,439,808 parameters") != std::string::npos);
}
