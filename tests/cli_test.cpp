// The command line itself: help, version, recipe validate/show, bad input and exit codes.
#include <doctest/doctest.h>

#include <algorithm>

#include "tests/harness.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;

TEST_CASE("--version and --help for dptrain and every subcommand") {
  auto v = run_dptrain({"--version"});
  CHECK(v.exit_code == 0);
  CHECK(v.out.find("dptrain ") != std::string::npos);
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

TEST_CASE("usage errors exit 2") {
  CHECK(run_dptrain({}).exit_code == 2);
  CHECK(run_dptrain({"no-such-command"}).exit_code == 2);
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
  auto resume = run_dptrain({"resume", (tmp / "nothing-here").string()});
  CHECK(resume.exit_code == 2);
  CHECK(resume.err.find("not a run directory") != std::string::npos);
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
  const auto workers = parse_json(plan.out)["hosts"][0]["workers"];
  CHECK(workers[0]["env"]["CUDA_VISIBLE_DEVICES"] == "3");
  CHECK(workers[1]["env"]["CUDA_VISIBLE_DEVICES"] == "1");

  // 16-bit compute needs the GPU: the recipe says so before anything starts.
  recipe["train"]["device"] = "cpu";
  recipe["train"]["precision"] = "bf16";
  auto bf16 = run_dptrain({"launch", write_recipe(tmp.path(), recipe).string(), "--nproc", "1"});
  CHECK(bf16.exit_code == 2);
  CHECK(bf16.err.find("/train/precision") != std::string::npos);
}
