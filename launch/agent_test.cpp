// Tests of what an agent starts: each rank's GPU when the job runs on CUDA, and its environment.
#include "launch/agent.hpp"

#include <doctest/doctest.h>

#include <string>

#include "core/data/tokens.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "launch/provision.hpp"
#include "launch/rank_env.hpp"
#include "launch/run_dir.hpp"
#include "tests/scoped_env.hpp"
#include "tests/temp_dir.hpp"

namespace dptrain {
namespace {

std::string env_of(const ProcessSpec& p, const std::string& name) {
  for (const auto& [k, v] : p.env) {
    if (k == name) return v;
  }
  return "<unset>";
}

AgentPlan two_rank_plan() {
  AgentPlan plan;
  plan.host = "localhost";
  plan.run_dir = "/tmp/run";
  plan.store = "127.0.0.1:1";
  plan.world_size = 2;
  plan.ranks = {0, 1};
  return plan;
}

}  // namespace

TEST_CASE("agent: one GPU per local rank, following the node's CUDA_VISIBLE_DEVICES") {
  {
    ScopedEnv unset("CUDA_VISIBLE_DEVICES", "");
    CHECK(gpu_of_local_rank(0) == "0");
    CHECK(gpu_of_local_rank(3) == "3");
  }
  {
    ScopedEnv visible("CUDA_VISIBLE_DEVICES", "2,5,GPU-8f3e");
    CHECK(gpu_of_local_rank(0) == "2");
    CHECK(gpu_of_local_rank(1) == "5");
    CHECK(gpu_of_local_rank(2) == "GPU-8f3e");
    CHECK(gpu_of_local_rank(3) == "-1");  // more ranks than GPUs: this rank sees none
  }
}

TEST_CASE("agent: workers get CUDA_VISIBLE_DEVICES only when the job runs on GPUs") {
  ScopedEnv visible("CUDA_VISIBLE_DEVICES", "1,0");
  AgentPlan plan = two_rank_plan();
  auto specs = worker_specs(plan, "/bin/dptrain");
  REQUIRE(specs.size() == 2);
  CHECK(env_of(specs[0], "CUDA_VISIBLE_DEVICES") == "<unset>");
  // A SIGTERM while a rank loads waits for its handler (dptrain's main unblocks it).
  CHECK(specs[0].hold_sigterm);
  CHECK(specs[1].hold_sigterm);

  plan.one_gpu_per_rank = true;
  specs = worker_specs(plan, "/bin/dptrain");
  CHECK(env_of(specs[0], "CUDA_VISIBLE_DEVICES") == "1");
  CHECK(env_of(specs[1], "CUDA_VISIBLE_DEVICES") == "0");

  // The flag travels to remote agents with the plan.
  CHECK(AgentPlan::from_json(plan.to_json()).one_gpu_per_rank);
}

TEST_CASE("agent: a GPU list the job gives (--env) is the one each host's ranks take from") {
  ScopedEnv visible("CUDA_VISIBLE_DEVICES", "0,1,2,3");
  const std::map<std::string, std::string> job = {{"CUDA_VISIBLE_DEVICES", "6,7"}};
  CHECK(gpu_of_local_rank(0, job) == "6");
  CHECK(gpu_of_local_rank(1, job) == "7");
  CHECK(gpu_of_local_rank(2, job) == "-1");
  CHECK(gpu_of_local_rank(0, {{"CUDA_VISIBLE_DEVICES", ""}}) == "-1");  // names none

  AgentPlan plan = two_rank_plan();
  plan.env = {{"CUDA_VISIBLE_DEVICES", "6,7"}, {"NCCL_SOCKET_IFNAME", "eth1"}};
  plan.one_gpu_per_rank = true;
  auto specs = worker_specs(plan, "/bin/dptrain");
  for (size_t i = 0; i < 2; ++i) {
    CAPTURE(i);
    // One entry per name: the rank's own GPU, not the list as well.
    int count = 0;
    for (const auto& [k, v] : specs[i].env)
      count += k == "CUDA_VISIBLE_DEVICES";
    CHECK(count == 1);
    CHECK(env_of(specs[i], "CUDA_VISIBLE_DEVICES") == (i == 0 ? "6" : "7"));
    CHECK(env_of(specs[i], "NCCL_SOCKET_IFNAME") == "eth1");
  }
  // On CPU ranks the list is passed as it is.
  plan.one_gpu_per_rank = false;
  specs = worker_specs(plan, "/bin/dptrain");
  CHECK(env_of(specs[1], "CUDA_VISIBLE_DEVICES") == "6,7");
}

TEST_CASE("agent: a host's copy of the CSV data must be the launcher's") {
  dptrain::test::TempDir tmp;
  const auto launcher_file = tmp / "launcher/train.csv";
  std::filesystem::create_directories(tmp / "launcher");
  std::filesystem::create_directories(tmp / "host/data");
  write_file_atomic(launcher_file, "label,x\n0,1\n1,2\n");
  AgentPlan plan = two_rank_plan();
  plan.host = "node-2";
  plan.data_dir = (tmp / "host/data").string();
  plan.recipe = {{"data", {{"type", "csv"}, {"path", (tmp / "elsewhere/train.csv").string()}}}};
  plan.data_sha256 = sha256_file(launcher_file);
  // The launcher's path does not exist on the host: provision's copy is used, when it matches.
  write_file_atomic(tmp / "host/data/train.csv", "label,x\n0,1\n1,2\n");
  AgentPlan same = plan;
  CHECK_NOTHROW(prepare_data(same));
  CHECK(same.recipe["data"]["path"] == (tmp / "host/data/train.csv").string());
  // A stale copy (the launcher's file changed since provision) is refused, naming host and file.
  write_file_atomic(tmp / "host/data/train.csv", "label,x\n0,1\n");
  AgentPlan stale = plan;
  CHECK_THROWS_WITH_AS(prepare_data(stale),
                       doctest::Contains(((tmp / "host/data/train.csv").string() +
                                          " on node-2 is not the launcher's data file")
                                             .c_str()),
                       Error);
  // A plan from a launcher that sends no hash is not checked.
  stale.data_sha256.clear();
  CHECK_NOTHROW(prepare_data(stale));
  CHECK(AgentPlan::from_json(plan.to_json()).data_sha256 == plan.data_sha256);
}

TEST_CASE("agent: a host's token dataset must hold the launcher's tokens") {
  dptrain::test::TempDir tmp;
  const auto make_dataset = [&](const std::string& name, int32_t first) {
    const auto dir = tmp / name;
    std::filesystem::create_directories(dir);
    const std::vector<int32_t> tokens = {first, 1, 2, 3, 4, 5, 6, 7};
    write_token_file(dir / "train.bin", 16, tokens, 2);
    write_token_file(dir / "val.bin", 16, tokens, 2);
    DataSpec spec;
    spec.type = "tokens";
    spec.path = dir.string();
    return spec;
  };
  const DataSpec launcher = make_dataset("launcher", 0);
  const DataSpec other = make_dataset("other", 9);
  AgentPlan plan = two_rank_plan();
  plan.host = "node-2";
  plan.data_fingerprint = token_data_fingerprint(launcher);
  plan.recipe = {{"data", {{"type", "tokens"}, {"path", launcher.path}}}};
  CHECK_NOTHROW(prepare_data(plan));
  plan.recipe["data"]["path"] = other.path;
  CHECK_THROWS_WITH_AS(
      prepare_data(plan),
      doctest::Contains(
          (other.path + " on node-2 is not the launcher's dataset (train.bin ").c_str()),
      Error);
  // Missing there: the ranks say so, naming the file; a plan without the fingerprint: no check.
  plan.recipe["data"]["path"] = (tmp / "missing").string();
  CHECK_NOTHROW(prepare_data(plan));
  plan.recipe["data"]["path"] = other.path;
  plan.data_fingerprint.clear();
  CHECK_NOTHROW(prepare_data(plan));
  plan.data_fingerprint = token_data_fingerprint(launcher);
  CHECK(AgentPlan::from_json(plan.to_json()).data_fingerprint == plan.data_fingerprint);
}

TEST_CASE("agent: every variable it sets for a rank is one --env may not change") {
  AgentPlan plan = two_rank_plan();
  plan.secret = "s";
  plan.nominal_world = 4;
  plan.one_gpu_per_rank = true;
  const auto specs = worker_specs(plan, "/bin/dptrain");
  for (const auto& [k, v] : specs.front().env) {
    CAPTURE(k);
    // The two a job may set itself: its GPU list, and its BLAS threads (defaults only).
    CHECK((set_for_each_rank(k) || k == "CUDA_VISIBLE_DEVICES" || k == "OPENBLAS_NUM_THREADS"));
  }
}

TEST_CASE("agent: ranks' OpenBLAS pool is the recipe's threads_per_rank unless the job sets one") {
  ScopedEnv unset("OPENBLAS_NUM_THREADS", std::nullopt);
  AgentPlan plan = two_rank_plan();
  plan.recipe = {{"train", {{"threads_per_rank", 3}}}};
  const auto threads = [](const ProcessSpec& p) {
    std::vector<std::string> values;
    for (const auto& [k, v] : p.env)
      if (k == "OPENBLAS_NUM_THREADS") values.push_back(v);
    return values;
  };
  CHECK(threads(worker_specs(plan, "/bin/dptrain").front()) == std::vector<std::string>{"3"});
  plan.recipe = nlohmann::json::object();  // the default
  CHECK(threads(worker_specs(plan, "/bin/dptrain").front()) == std::vector<std::string>{"1"});
  plan.env["OPENBLAS_NUM_THREADS"] = "8";  // --env, or forwarded from the launcher's environment
  CHECK(threads(worker_specs(plan, "/bin/dptrain").front()) == std::vector<std::string>{"8"});
  plan.env.erase("OPENBLAS_NUM_THREADS");
  ScopedEnv mine("OPENBLAS_NUM_THREADS", "2");  // this host's own: the ranks inherit it
  CHECK(threads(worker_specs(plan, "/bin/dptrain").front()).empty());
}

TEST_CASE("agent: every rank is told a launcher started it (it beats before the ranks meet)") {
  // Whatever the launcher's own environment says.
  ScopedEnv leaked(kLaunchedEnv, "0");
  const auto specs = worker_specs(two_rank_plan(), "/bin/dptrain");
  REQUIRE(specs.size() == 2);
  for (const auto& spec : specs)
    CHECK(env_of(spec, kLaunchedEnv) == "1");
}

}  // namespace dptrain
