// The run view's figures (launch/report.cpp) from a run held in memory.
#include "launch/report.hpp"

#include <doctest/doctest.h>

using namespace dptrain;

TEST_CASE("report: an unfinished run's throughput is the median of the logged rates") {
  RunView run;
  run.dir = "/no-such-run";
  run.info = nlohmann::json::object();
  run.state.status = "failed";
  int64_t step = 0;
  for (const double rate : {5075.7, 10616.6, 8127.5, 10216.1}) {
    StepMetrics s;
    s.step = step += 10;
    s.samples_per_s = rate;
    run.metrics.steps.push_back(s);
  }
  // An even count: the mean of the two middle values, as bench train takes its median.
  nlohmann::json j = report_summary(run, "/no-such-run/report.html");
  CHECK(j["throughput"].get<double>() == doctest::Approx((8127.5 + 10216.1) / 2));
  CHECK(j["throughput_unit"] == "samples/s");
  // An odd count: the middle one.
  run.metrics.steps.pop_back();
  j = report_summary(run, "/no-such-run/report.html");
  CHECK(j["throughput"].get<double>() == 8127.5);
  // A finished run: result.json's figure, whatever was logged.
  run.result = {{"samples_per_s", 1234.5}};
  j = report_summary(run, "/no-such-run/report.html");
  CHECK(j["throughput"].get<double>() == 1234.5);
}

TEST_CASE("report: a token model's throughput is in tokens/s before any rate is logged") {
  RunView run;
  run.dir = "/no-such-run";
  run.info = {{"recipe", {{"model", {{"type", "gpt"}}}}}};
  run.state.status = "failed";  // diverged before its first log line
  nlohmann::json j = report_summary(run, "/no-such-run/report.html");
  CHECK(j["throughput"].is_null());
  CHECK(j["throughput_unit"] == "tokens/s");
  // Any other model, or a run.json edited by hand (not a string, no model): samples/s.
  for (const auto& model : {nlohmann::json{{"type", "mlp"}}, nlohmann::json{{"type", 5}},
                            nlohmann::json{{"type", nullptr}}, nlohmann::json("gpt")}) {
    CAPTURE(model.dump());
    run.info["recipe"]["model"] = model;
    j = report_summary(run, "/no-such-run/report.html");
    CHECK(j["throughput_unit"] == "samples/s");
  }
  run.info["recipe"] = 7;
  CHECK(report_summary(run, "/no-such-run/report.html")["throughput_unit"] == "samples/s");
}
