// Tests of what an agent starts: each rank's GPU when the job runs on CUDA.
#include "launch/agent.hpp"

#include <doctest/doctest.h>

#include <string>

#include "tests/scoped_env.hpp"

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

}  // namespace dptrain
