// Tests of --env: parsing, what run.json records, and what a resume gives the ranks again.
#include "launch/rank_env.hpp"

#include <doctest/doctest.h>

#include <string>

#include "core/error.hpp"
#include "tests/scoped_env.hpp"

namespace dptrain {
namespace {

std::string usage_error(const std::vector<std::string>& settings) {
  try {
    RankEnv::parse(settings);
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::usage);
    return e.what();
  }
  return "<no error>";
}

}  // namespace

TEST_CASE("--env NAME=VALUE sets a value; NAME takes this environment's, never recorded") {
  ScopedEnv token("DPTRAIN_TEST_TOKEN", "s3cret");
  const RankEnv env = RankEnv::parse(
      {"NCCL_SOCKET_IFNAME=eth1", "EMPTY=", "EQUALS=a=b", "DPTRAIN_TEST_TOKEN", "X=1", "X=2"});
  CHECK(env.values.at("NCCL_SOCKET_IFNAME") == "eth1");
  CHECK(env.values.at("EMPTY").empty());
  CHECK(env.values.at("EQUALS") == "a=b");
  CHECK(env.values.at("DPTRAIN_TEST_TOKEN") == "s3cret");
  CHECK(env.values.at("X") == "2");  // the later setting wins
  CHECK(env.from_launcher == std::set<std::string>{"DPTRAIN_TEST_TOKEN"});
  const nlohmann::json record = env.record();
  CHECK(record["NCCL_SOCKET_IFNAME"] == "eth1");
  CHECK(record["DPTRAIN_TEST_TOKEN"].is_null());
  CHECK(record.dump().find("s3cret") == std::string::npos);

  // A name given both ways: the later form counts.
  const RankEnv both = RankEnv::parse({"DPTRAIN_TEST_TOKEN", "DPTRAIN_TEST_TOKEN=plain"});
  CHECK(both.from_launcher.empty());
  CHECK(both.record()["DPTRAIN_TEST_TOKEN"] == "plain");
}

TEST_CASE("--env refuses what is not a variable, what the launcher sets, and what is not set") {
  CHECK(usage_error({"1ABC=x"}).find("--env '1ABC=x': '1ABC' is not a variable name") == 0);
  CHECK(usage_error({"=x"}).find("--env '=x': '' is not a variable name") == 0);
  CHECK(usage_error({"A-B=1"}).find("'A-B' is not a variable name") != std::string::npos);
  CHECK(usage_error({"RANK=3"}) == "--env RANK: the launcher sets RANK for each rank itself");
  CHECK(usage_error({"DPTRAIN_STORE_SECRET"}).find("the launcher sets") != std::string::npos);
  CHECK(usage_error({"DPTRAIN_LAUNCHED=1"}).find("the launcher sets") != std::string::npos);
  unsetenv("DPTRAIN_TEST_UNSET");
  CHECK(usage_error({"DPTRAIN_TEST_UNSET"}) ==
        "--env DPTRAIN_TEST_UNSET is not set in this environment: export it, or give --env "
        "DPTRAIN_TEST_UNSET=VALUE");
}

TEST_CASE("resume gives the ranks what the launch recorded, its own --env over it") {
  const nlohmann::json record = {{"A", "1"}, {"B", "2"}, {"TOKEN", nullptr}};
  {
    ScopedEnv token("TOKEN", "now");
    const RankEnv env = RankEnv::resumed(record, "run/run.json", RankEnv::parse({"B=3", "C=4"}));
    CHECK(env.values ==
          std::map<std::string, std::string>{{"A", "1"}, {"B", "3"}, {"C", "4"}, {"TOKEN", "now"}});
    CHECK(env.from_launcher == std::set<std::string>{"TOKEN"});
    CHECK(env.record()["TOKEN"].is_null());  // and still not recorded
  }
  unsetenv("TOKEN");
  try {
    RankEnv::resumed(record, "run/run.json", RankEnv{});
    FAIL("a name the launch passed from its environment, unset now, is refused");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::usage);
    CHECK(std::string(e.what()) ==
          "run/run.json: the launch passed TOKEN from its environment (--env TOKEN), but TOKEN is "
          "not set in this environment: export it, or give --env TOKEN=VALUE");
  }
  // Given again on resume, it is not needed from the environment.
  CHECK(RankEnv::resumed(record, "r", RankEnv::parse({"TOKEN=x"})).values.at("TOKEN") == "x");
  // A run.json from before --env has none; a malformed one is named.
  CHECK(RankEnv::resumed(nlohmann::json::object(), "r", RankEnv{}).values.empty());
  for (const nlohmann::json& bad :
       {nlohmann::json::array(), nlohmann::json{{"A", 1}}, nlohmann::json{{"RANK", "0"}}}) {
    CAPTURE(bad.dump());
    CHECK_THROWS_WITH_AS(RankEnv::resumed(bad, "run/run.json", RankEnv{}),
                         doctest::Contains("run/run.json: \"env\""), Error);
  }
}

TEST_CASE("--env CUDA_VISIBLE_DEVICES must name a GPU for each of a host's ranks") {
  CHECK_NOTHROW(RankEnv{}.check_gpu_list(8));
  const RankEnv two = RankEnv::parse({"CUDA_VISIBLE_DEVICES=4,5"});
  CHECK_NOTHROW(two.check_gpu_list(2));
  CHECK_THROWS_WITH_AS(two.check_gpu_list(3),
                       "--env CUDA_VISIBLE_DEVICES=4,5: each host's ranks take one GPU of this "
                       "list, but a host runs 3 rank(s)",
                       Error);
}

}  // namespace dptrain
