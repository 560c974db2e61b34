// `dptrain report` and `dptrain status` on real runs: a run with a restart and a world-size
// change (markers, checkpoints, the summary), the HTML rendered by headless Chromium, a run
// whose launcher was killed (running, then stale), torn and empty metrics, and bad run dirs.
#include <doctest/doctest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <memory>
#include <regex>
#include <sstream>

#include <fmt/format.h>

#include "tests/harness.hpp"
#include "tests/strings.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// The report must stand alone: no script, and nothing it would fetch (the SVG namespace URI
// is a name, not a fetch).
void check_self_contained(const std::string& html) {
  CHECK_FALSE(contains(html, "<script"));
  CHECK_FALSE(contains(html, "<link"));
  CHECK_FALSE(contains(html, "<img"));
  CHECK_FALSE(contains(html, "<iframe"));
  CHECK_FALSE(contains(html, " src="));
  CHECK_FALSE(contains(html, "href="));
  CHECK_FALSE(contains(html, "url("));
  CHECK_FALSE(contains(html, "@import"));
  CHECK_FALSE(contains(html,
                       " on"
                       "load="));
  std::string without_ns = html;
  for (size_t pos;
       (pos = without_ns.find("xmlns=\"http://www.w3.org/2000/svg\"")) != std::string::npos;)
    without_ns.erase(pos, 34);
  CHECK_FALSE(contains(without_ns, "http://"));
  CHECK_FALSE(contains(without_ns, "https://"));
}

// Runs a shell command, its output in files under `dir`; returns the exit code.
int shell(const std::string& command, const fs::path& dir, std::string* out = nullptr,
          std::string* err = nullptr) {
  const fs::path o = dir / "shell.out", e = dir / "shell.err";
  const std::string full = "(" + command + ") >'" + o.string() + "' 2>'" + e.string() + "'";
  const int status = std::system(full.c_str());
  if (out) *out = fs::exists(o) ? read_text(o) : "";
  if (err) *err = fs::exists(e) ? read_text(e) : "";
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

std::string tail(const std::string& text, size_t chars) {
  return text.size() <= chars ? text : text.substr(text.size() - chars);
}

constexpr const char* kChromium = "/usr/bin/chromium";

// Debian's chromium, installed when missing (the tests run as root). A failure says why.
void require_chromium(const fs::path& dir) {
  if (fs::exists(kChromium)) return;
  std::string out, err;
  const std::string install =
      "DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y --no-install-recommends "
      "chromium";
  int rc = shell(install, dir, &out, &err);
  if (rc != 0 || !fs::exists(kChromium)) {
    // The package lists may be missing or stale.
    rc = shell("DEBIAN_FRONTEND=noninteractive timeout 300 apt-get update && " + install, dir, &out,
               &err);
  }
  INFO("apt-get output: " << tail(out, 1500) << tail(err, 1500));
  if (!fs::exists(kChromium)) {
    FAIL(
        "headless Chromium is needed to check the report renders, and "
        "'apt-get install -y chromium' did not install /usr/bin/chromium (exit "
        << rc << "); install Debian's chromium package and run again");
  }
}

// One headless Chromium invocation on a local file, its console messages logged to stderr.
std::string chromium_command(const fs::path& html, const fs::path& profile,
                             const std::string& args) {
  return std::string("timeout 120 ") + kChromium +
         " --headless --no-sandbox --disable-gpu --disable-dev-shm-usage --no-first-run "
         "--enable-logging=stderr --v=0 --user-data-dir='" +
         profile.string() + "' " + args + " 'file://" + html.string() + "'";
}

struct Rendered {
  int exit_code = -1;
  std::string dom;
  std::string log;  // chromium's stderr, with the page's console messages
};

// Loads a file in headless Chromium: the DOM after loading, and what the page logged.
Rendered render(const fs::path& html, const fs::path& dir, const std::string& extra = "") {
  Rendered r;
  const fs::path profile = dir / "chromium-profile";
  r.exit_code = shell(chromium_command(html, profile, "--dump-dom " + extra), dir, &r.dom, &r.log);
  return r;
}

}  // namespace

TEST_CASE(
    "report and status of a run with a restart and a world-size change; Chromium renders it") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const fs::path run_dir = tmp / "run";
  // Rank 1 is killed at step 70 of generation 1; with --nproc 1:2 its capacity counts as lost,
  // so generation 2 resumes from step-000060 on one rank.
  auto launch = run_dptrain({"launch", recipe.string(), "--nproc", "1:2", "--run-dir",
                             run_dir.string(), "--max-restarts", "1", "--restart-backoff", "0.1"},
                            {{"DPTRAIN_FAULT", "crash@step=70,rank=1,gen=1"}});
  INFO(launch.err);
  REQUIRE(launch.exit_code == 0);
  const json info = parse_json(read_text(run_dir / "run.json"));
  REQUIRE(info["restarts"].size() == 1);
  REQUIRE(info["world_size_changes"].size() == 1);
  const int64_t failed_after = info["restarts"][0]["failed_after_step"].get<int64_t>();
  // The backend asked for stays for a resume; each generation records the one its ranks used.
  CHECK(info["backend"] == "auto");
  CHECK(info["generations"][0]["backend"] == "gloo");
  CHECK(info["generations"][1]["backend"] == "gloo");

  auto report = run_dptrain({"report", run_dir.string()});
  INFO(report.out << report.err);
  REQUIRE(report.exit_code == 0);
  const fs::path html_file = run_dir / "report.html";
  CHECK(contains(report.out, "completed: step 120 of 120"));
  CHECK(contains(report.out, "1 restart(s); world size 2 -> 1"));
  CHECK(contains(report.out, "samples/s"));
  CHECK(contains(report.out, "report: " + html_file.string()));
  REQUIRE(fs::exists(html_file));
  const std::string html = read_text(html_file);

  SUBCASE("the HTML: charts, markers, checkpoints, facts, escaped text, nothing external") {
    CHECK(html.rfind("<!DOCTYPE html>", 0) == 0);
    check_self_contained(html);
    // Loss, learning rate, throughput, step-time split, gradient norm, validation accuracy.
    CHECK(count_occurrences(html, "<svg ") == 6);
    CHECK(contains(html, "<title>Loss</title>"));
    CHECK(contains(html, "<title>Learning rate</title>"));
    CHECK(contains(html, "<title>Throughput (samples/s)</title>"));
    CHECK(contains(html, "<title>Step time split</title>"));
    CHECK(count_occurrences(html, "<path class=\"series\"") >= 6 + 4);  // the split has five lines
    CHECK(contains(html, ">validation loss</text>"));
    // Every chart carries both markers: the restart at the last step logged before the
    // crash, the world-size change at the step generation 2 resumed from.
    CHECK(count_occurrences(html, "<g class=\"marker\"><title>restart 1 after step " +
                                      std::to_string(failed_after) + "</title>") == 6);
    CHECK(count_occurrences(html, "<g class=\"marker\"><title>world size 2\u21921</title>") == 6);
    // Checkpoints (keep 3: steps 80, 100, 120), each verified.
    CHECK(count_occurrences(html, "<tr class=\"checkpoint\">") == 3);
    CHECK(contains(html, "<code>step-000120</code>"));
    CHECK(count_occurrences(html, "<span class=\"ok\">ok</span>") == 3);
    CHECK(contains(html, "latest"));
    // The timeline tables and the facts.
    CHECK(count_occurrences(html, "<tr class=\"restart\">") == 1);
    CHECK(count_occurrences(html, "<tr class=\"world-size-change\">") == 1);
    CHECK(contains(html, "step-000060"));
    CHECK(contains(html, "mlp 32-48-24-5"));
    CHECK(contains(html, "<tr><th>Backend</th><td>gloo (auto)</td></tr>"));
    CHECK(contains(html, "<span class=\"badge completed\">completed</span>"));
    CHECK_FALSE(contains(html, "No steps logged yet"));
  }

  SUBCASE("--json summary and --out") {
    const fs::path other = tmp / "elsewhere.html";
    auto r = run_dptrain({"report", run_dir.string(), "--json", "--out", other.string()});
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    const json s = parse_json(r.out);
    CHECK(s["report"] == other.string());
    CHECK(s["status"] == "completed");
    CHECK(s["step"] == 120);
    CHECK(s["steps"] == 120);
    CHECK(s["restarts"] == 1);
    CHECK(s["world_size_changes"] == 1);
    // The world size as a number (world_sizes is text), as status has it.
    const json st = parse_json(run_dptrain({"status", run_dir.string(), "--json"}).out);
    CHECK(s["world_size"] == 1);
    CHECK(s["world_size"] == st["world_size"]);
    CHECK(s["nominal_world_size"] == st["nominal_world_size"]);
    CHECK(s["throughput_unit"] == "samples/s");
    CHECK(s["throughput"].get<double>() > 0);
    CHECK(s["final_loss"].is_number());
    CHECK(s["loss"].is_number());
    CHECK(s["eval_loss"].is_number());
    CHECK(s["last_checkpoint"] == (run_dir / "checkpoints/step-000120").string());
    CHECK(s["checkpoints"] == 3);
    CHECK(s["checkpoints_failed"] == 0);
    CHECK(fs::exists(other));
    CHECK(count_occurrences(read_text(other), "<svg ") == 6);
  }

  SUBCASE("status --json and the text form") {
    auto r = run_dptrain({"status", run_dir.string(), "--json"});
    INFO(r.err);
    REQUIRE(r.exit_code == 0);
    const json s = parse_json(r.out);
    CHECK(s["status"] == "completed");
    CHECK(s["step"] == 120);
    CHECK(s["steps"] == 120);
    CHECK(s["last_checkpoint"] == (run_dir / "checkpoints/step-000120").string());
    CHECK(s["final_loss"].is_number());
    CHECK(s["loss"] == s["final_loss"]);
    CHECK(s["eval_accuracy"].is_number());
    CHECK(s["restarts"] == 1);
    CHECK(s["generations"] == 2);
    CHECK(s["world_size"] == 1);
    CHECK(s["nominal_world_size"] == 2);
    CHECK(s["world_size_changes"] == 1);
    CHECK(s["last_restart"]["failed_after_step"] == failed_after);
    CHECK(s["error"].is_null());
    CHECK(s["hint"].is_null());
    auto text = run_dptrain({"status", run_dir.string()});
    REQUIRE(text.exit_code == 0);
    CHECK(contains(text.out, run_dir.string() + ": completed"));
    CHECK(contains(text.out, "step-000120"));
    CHECK(contains(text.out, "1 restart(s) in 2 generation(s)"));
  }

  SUBCASE("headless Chromium renders every chart without a console error") {
    require_chromium(tmp.path());
    // The console check must be able to fail: a page whose script throws is caught by it.
    write_text(tmp / "control.html",
               "<!DOCTYPE html><p>x</p><script>throw new Error('c1')</script>");
    const Rendered control = render(tmp / "control.html", tmp.path());
    INFO("control log: " << tail(control.log, 3000));
    REQUIRE(control.exit_code == 0);
    REQUIRE(contains(control.log, "Uncaught Error: c1"));

    const Rendered page = render(html_file, tmp.path());
    INFO("chromium log: " << tail(page.log, 3000));
    REQUIRE(page.exit_code == 0);
    CHECK_FALSE(contains(page.log, "Uncaught"));
    CHECK_FALSE(contains(page.log, "CONSOLE"));
    CHECK_FALSE(contains(page.log, "Not allowed to load"));
    CHECK_FALSE(contains(page.log, "ERR_FILE_NOT_FOUND"));
    // The parsed DOM holds each chart as an SVG element of its own figure, with its lines and
    // markers: a stray unclosed tag would have nested or dropped some.
    const std::regex figure_svg("<figure><svg [^>]*class=\"chart\"");
    const auto figures = std::distance(
        std::sregex_iterator(page.dom.begin(), page.dom.end(), figure_svg), std::sregex_iterator());
    CHECK(figures == 6);
    CHECK(count_occurrences(page.dom, "</svg></figure>") == 6);
    CHECK(count_occurrences(page.dom, "<path class=\"series\"") ==
          count_occurrences(html, "<path class=\"series\""));
    CHECK(count_occurrences(page.dom, "<g class=\"marker\">") == 12);
    CHECK(count_occurrences(page.dom, "<tr class=\"checkpoint\">") == 3);

    // And it paints: a screenshot of the page is an image of some substance.
    const fs::path png = tmp / "report.png";
    std::string out, err;
    const int rc =
        shell(chromium_command(html_file, tmp / "chromium-profile",
                               "--screenshot='" + png.string() + "' --window-size=1280,2400"),
              tmp.path(), &out, &err);
    INFO(tail(err, 2000));
    CHECK(rc == 0);
    REQUIRE(fs::exists(png));
    const std::string image = read_text(png);
    CHECK(image.substr(1, 3) == "PNG");
    CHECK(image.size() > 40000);
  }
}

TEST_CASE("status of a running run, then of one whose launcher was killed: stale, resume it") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), resumable_recipe());
  const fs::path run_dir = tmp / "run";
  Background job({"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string()},
                 {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "100"}});
  REQUIRE(eventually([&] {
    return worker_pids(run_dir).size() == 2 && fs::exists(run_dir / "metrics.jsonl") &&
           read_jsonl(run_dir / "metrics.jsonl").size() >= 2;
  }));
  auto running = run_dptrain({"status", run_dir.string(), "--json"});
  REQUIRE(running.exit_code == 0);
  json s = parse_json(running.out);
  CHECK(s["status"] == "running");
  CHECK(s["live_pids"].size() == 2);
  CHECK(s["step"].get<int64_t>() >= 5);
  CHECK(s["loss"].is_number());      // the last logged
  CHECK(s["final_loss"].is_null());  // until the run completes
  CHECK(s["hint"].is_null());

  // The launcher dies without a word (its ranks follow it): run.json still says running.
  REQUIRE(::kill(job.pid(), SIGKILL) == 0);
  job.wait();
  const auto pids = worker_pids(run_dir);
  REQUIRE(eventually([&] {
    return std::none_of(pids.begin(), pids.end(), [](pid_t p) { return process_alive(p); });
  }));
  CHECK(parse_json(read_text(run_dir / "run.json"))["status"] == "running");
  auto stale = run_dptrain({"status", run_dir.string(), "--json"});
  REQUIRE(stale.exit_code == 0);
  s = parse_json(stale.out);
  CHECK(s["status"] == "stale");
  CHECK(s["recorded_status"] == "running");
  CHECK(s["live_pids"].empty());
  CHECK(contains(s["note"].get<std::string>(), "launcher is gone"));
  CHECK(contains(s["hint"].get<std::string>(), "dptrain resume " + run_dir.string()));
  auto text = run_dptrain({"status", run_dir.string()});
  CHECK(contains(text.out, ": stale (the launcher is gone"));
  CHECK(contains(text.out, "dptrain resume"));
  // One of bench train's runs is not resumed but run again, as its benchmark is.
  json info = parse_json(read_text(run_dir / "run.json"));
  info["bench"] = {{"benchmark", "train"}, {"world", 2}, {"label", "w2"}};
  write_text(run_dir / "run.json", info.dump());
  CHECK(parse_json(run_dptrain({"status", run_dir.string(), "--json"}).out)["hint"] ==
        "a benchmark's run: run the benchmark again");

  // A crash can tear the last metrics line: it is skipped, and said so.
  {
    std::ofstream metrics(run_dir / "metrics.jsonl", std::ios::app);
    metrics << "{\"step\": 97, \"loss\": \"x\"}\n{\"step\": 98, \"eval_loss\": [1]}\n";
    metrics << "{\"step\": 99, \"epo";
  }
  auto report = run_dptrain({"report", run_dir.string(), "--json"});
  INFO(report.err);
  REQUIRE(report.exit_code == 0);
  const json summary = parse_json(report.out);
  CHECK(summary["status"] == "stale");
  // So is a line whose loss is not a number (nor null: the trainer's NaN).
  CHECK(summary["metrics_lines_skipped"] == 3);
  CHECK(summary["step"].get<int64_t>() < 99);
  const std::string html = read_text(run_dir / "report.html");
  CHECK(contains(html, "<span class=\"badge stale\">stale</span>"));
  CHECK(contains(html, "3 unreadable line(s) of metrics.jsonl skipped"));
  CHECK(count_occurrences(html, "<svg ") >= 4);
  CHECK(count_occurrences(html, "<g class=\"marker\">") == 0);
  check_self_contained(html);
  // The summary for people says it too, and names a torn result.json it could not use.
  write_text(run_dir / "result.json", "{\"final_loss\": 1.2,");
  auto plain = run_dptrain({"report", run_dir.string()});
  REQUIRE(plain.exit_code == 0);
  CHECK(contains(plain.out, "metrics.jsonl: 3 unreadable line(s) skipped\n"));
  CHECK(contains(plain.out, "unreadable: " + (run_dir / "result.json").string() +
                                ": not valid JSON at line 1, column"));
  const json torn = parse_json(run_dptrain({"report", run_dir.string(), "--json"}).out);
  CHECK(contains(torn["unreadable"].dump(), "result.json: not valid JSON"));
  // A killed run's run.json has no result to fall back on: not said to be used.
  CHECK(contains(torn["unreadable"].dump(), "; run.json holds no copy of it"));
}

TEST_CASE("a run with no steps logged yet: the report says so instead of failing") {
  TempDir tmp;
  const fs::path run_dir = tmp / "empty";
  fs::create_directories(run_dir / "checkpoints");
  json recipe = small_recipe();
  recipe["name"] = "<b>x</b> & 'y'";  // launch forbids such a name; the report escapes it anyway
  write_text(run_dir / "run.json",
             json{{"id", "abc"},
                  {"status", "failed"},
                  {"world_size", 2},
                  {"nominal_world_size", 2},
                  {"recipe", recipe},
                  {"generations",
                   {{{"generation", 1},
                     {"started_at", "2026-01-01T00:00:00Z"},
                     {"ended_at", "2026-01-01T00:00:05Z"},
                     {"status", "failed"},
                     {"world_size", 2},
                     {"error", "rank 1 exited with code 3\n  its last line"}}}}}
                 .dump());
  write_text(run_dir / "metrics.jsonl", "");
  auto r = run_dptrain({"report", run_dir.string()});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(contains(r.out, "failed: no steps logged yet"));
  CHECK(contains(r.out, "error: rank 1 exited with code 3"));
  const std::string html = read_text(run_dir / "report.html");
  CHECK(contains(html, "No steps logged yet"));
  CHECK(count_occurrences(html, "<svg ") == 0);
  CHECK(contains(html, "No checkpoints."));
  CHECK(contains(html, "rank 1 exited with code 3"));
  // Its ranks never met: it resumed from nothing, not from the start.
  CHECK(contains(html, "<td>-</td><td>failed</td>"));
  CHECK(contains(html,
                 "<title>&lt;b&gt;x&lt;/b&gt; &amp; &#39;y&#39; \u2014 dptrain report</title>"));
  CHECK_FALSE(contains(html, "<b>x</b>"));
  check_self_contained(html);

  auto s = run_dptrain({"status", run_dir.string(), "--json"});
  REQUIRE(s.exit_code == 0);
  const json status = parse_json(s.out);
  CHECK(status["status"] == "failed");
  CHECK(status["step"].is_null());
  CHECK(status["last_checkpoint"].is_null());
  CHECK(status["error"] == "rank 1 exited with code 3\n  its last line");
  CHECK(contains(status["hint"].get<std::string>(), "dptrain resume"));
  CHECK(contains(run_dptrain({"status", run_dir.string()}).out, "no steps logged yet"));
}

TEST_CASE("report of a run that trained no steps: no step time split of dashes") {
  TempDir tmp;
  json recipe = small_recipe();
  recipe["train"]["steps"] = 0;
  recipe["optimizer"]["schedule"]["warmup"] = 0;
  const auto file = write_recipe(tmp.path(), recipe);
  const fs::path run_dir = tmp / "run";
  REQUIRE(run_dptrain({"launch", file.string(), "--run-dir", run_dir.string()}).exit_code == 0);
  // It timed no step: its phases are null.
  CHECK(parse_json(read_text(run_dir / "result.json"))["phases_ms"]["compute"].is_null());
  const auto r = run_dptrain({"report", run_dir.string()});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const std::string html = read_text(run_dir / "report.html");
  CHECK(contains(html, "Throughput"));
  CHECK_FALSE(contains(html, "Step time split"));
}

TEST_CASE("status: the step reached is at least that of the newest checkpoint the run holds") {
  TempDir tmp;
  auto recipe = small_recipe();
  recipe["checkpoint"] = {{"every", 20}};
  const fs::path run_dir = tmp / "run";
  REQUIRE(run_dptrain(
              {"launch", write_recipe(tmp.path(), recipe).string(), "--run-dir", run_dir.string()})
              .exit_code == 0);
  // The final evaluation's line lost from metrics.jsonl: result.json's eval loss is said at the
  // run's last step, not at the step of the last eval line left (30).
  std::string metrics = read_text(run_dir / "metrics.jsonl");
  const size_t last_line = metrics.rfind('\n', metrics.size() - 2);
  REQUIRE(contains(metrics.substr(last_line), "\"eval_loss\""));
  write_text(run_dir / "metrics.jsonl", metrics.substr(0, last_line + 1));
  const json done = parse_json(run_dptrain({"status", run_dir.string(), "--json"}).out);
  CHECK(done["eval_step"] == 60);
  const std::string said = run_dptrain({"status", run_dir.string()}).out;
  CHECK(contains(said, " at step 60)"));
  CHECK_FALSE(contains(said, " at step 30)"));

  // As a launcher killed at once leaves a run that checkpoints more often than it logs: no step
  // logged nor recorded, a checkpoint of step 60.
  json info = parse_json(read_text(run_dir / "run.json"));
  info["status"] = "failed";
  info.erase("result");
  info["generations"][0].erase("step");
  write_text(run_dir / "run.json", info.dump());
  write_text(run_dir / "metrics.jsonl", "");
  fs::remove(run_dir / "result.json");
  const json status = parse_json(run_dptrain({"status", run_dir.string(), "--json"}).out);
  CHECK(status["step"] == 60);
  CHECK(status["last_checkpoint"] == (run_dir / "checkpoints/step-000060").string());
  CHECK(contains(run_dptrain({"status", run_dir.string()}).out, "step         60 of 60"));
  // The report's facts say the same.
  REQUIRE(run_dptrain({"report", run_dir.string()}).exit_code == 0);
  CHECK(contains(read_text(run_dir / "report.html"), "<th>Steps</th><td>60 of 60</td>"));
}

namespace {

// A time as run.json records it (utc_timestamp()).
std::string utc(std::time_t t) {
  std::tm tm{};
  ::gmtime_r(&t, &tm);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
  return std::string(buf);
}

}  // namespace

TEST_CASE("status between a failed generation and the next: restarting, then failed") {
  TempDir tmp;
  const auto run_json = [&](std::time_t restart_at) {
    return json{{"status", "failed"},
                {"world_size", 2},
                {"recipe", resumable_recipe()},
                {"generations",
                 {{{"generation", 1},
                   {"started_at", utc(restart_at - 10)},
                   {"ended_at", utc(restart_at)},
                   {"status", "failed"},
                   {"world_size", 2},
                   {"pids", {999999}},
                   {"error", "rank 1 was killed by signal 9 (SIGKILL)"}}}},
                {"restarts",
                 {{{"restart", 1},
                   {"after_generation", 1},
                   {"cause", "rank 1 was killed by signal 9 (SIGKILL)"},
                   {"failed_after_step", 45},
                   {"from", "step-000040"},
                   {"at", utc(restart_at)}}}}}
        .dump();
  };
  fs::create_directories(tmp / "run");
  write_text(tmp / "run/run.json", run_json(std::time(nullptr) - 2));
  json s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "restarting");
  CHECK(s["recorded_status"] == "failed");
  CHECK(contains(s["note"].get<std::string>(), "generation 2 is being placed"));

  // Long past the backoff and the rejoin timeout: no generation followed, the run failed.
  write_text(tmp / "run/run.json", run_json(std::time(nullptr) - 3600));
  s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "failed");
  CHECK(contains(s["note"].get<std::string>(), "no generation followed it"));
  CHECK(s["last_restart"]["failed_after_step"] == 45);
  CHECK(s["error"] == "rank 1 was killed by signal 9 (SIGKILL)");
}

TEST_CASE(
    "status of a generation with no pids yet: starting while its launcher lives, else stale") {
  TempDir tmp;
  char host[256] = {};
  REQUIRE(::gethostname(host, sizeof host - 1) == 0);
  const std::time_t now = std::time(nullptr);
  json info = {
      {"status", "running"},
      {"world_size", 2},
      {"recipe", resumable_recipe()},
      {"generations", {{{"generation", 1}, {"started_at", utc(now - 5)}, {"world_size", 2}}}}};
  fs::create_directories(tmp / "run");
  // Recorded before launchers recorded themselves: the timing alone tells.
  write_text(tmp / "run/run.json", info.dump());
  json s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "running");
  // Its launcher on this machine has exited (killed, or failed before its ranks started): no
  // minute of "running" that a resume would be refused for.
  info["launcher"] = {{"host", host}, {"pid", 999999}};
  info["alive_at"] = utc(now - 5);
  write_text(tmp / "run/run.json", info.dump());
  s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "stale");
  CHECK(s["note"] == "the launcher is gone: no rank of generation 1 is alive");
}

TEST_CASE("status: an earlier generation's error is not the newest one's, running or stale") {
  TempDir tmp;
  const std::time_t now = std::time(nullptr);
  json info = {{"status", "running"},
               {"world_size", 2},
               {"recipe", resumable_recipe()},
               {"launcher", {{"host", "elsewhere.invalid"}, {"pid", 999999}}},
               {"alive_at", utc(now)},
               {"generations",
                {{{"generation", 1},
                  {"started_at", utc(now - 60)},
                  {"ended_at", utc(now - 30)},
                  {"status", "terminated"},
                  {"world_size", 2},
                  {"error", "rank 1 was stopped by SIGTERM; every rank checkpointed"}},
                 {{"generation", 2},
                  {"started_at", utc(now - 20)},
                  {"world_size", 2},
                  {"pids", {999999}}}}}};
  fs::create_directories(tmp / "run");
  write_text(tmp / "run/run.json", info.dump());
  json s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "running");  // stamped just now by a launcher on another machine
  CHECK(s["error"].is_null());
  // Its launcher gone (no stamp for an hour): stale, and still not generation 1's error.
  info["alive_at"] = utc(now - 3600);
  write_text(tmp / "run/run.json", info.dump());
  s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "stale");
  CHECK(s["error"].is_null());
  CHECK(
      parse_json(run_dptrain({"report", (tmp / "run").string(), "--json"}).out)["error"].is_null());
}

TEST_CASE("status between a generation stopped to grow and the next: resizing, then stale") {
  TempDir tmp;
  const auto run_json = [&](std::time_t ended_at) {
    return json{{"status", "resized"},
                {"world_size", 1},
                {"nominal_world_size", 2},
                {"recipe", resumable_recipe()},
                {"generations",
                 {{{"generation", 1},
                   {"started_at", utc(ended_at - 10)},
                   {"ended_at", utc(ended_at)},
                   {"status", "resized"},
                   {"world_size", 1},
                   {"pids", {999999}},
                   {"stopped_for", "hostb answers again"}}}},
                {"resizes",
                 {{{"after_generation", 1},
                   {"after_step", 47},
                   {"from", "step-000047"},
                   {"at", utc(ended_at)}}}}}
        .dump();
  };
  fs::create_directories(tmp / "run");
  write_text(tmp / "run/run.json", run_json(std::time(nullptr) - 2));
  json s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "resizing");
  CHECK(s["recorded_status"] == "resized");
  CHECK(contains(s["note"].get<std::string>(), "generation 2 is being placed"));

  write_text(tmp / "run/run.json", run_json(std::time(nullptr) - 3600));
  s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "stale");
  CHECK(contains(s["note"].get<std::string>(), "the launcher is gone"));
}

TEST_CASE("status of a resume waiting for its first hosts: running while its launcher lives") {
  TempDir tmp;
  // A live dptrain that is no rank stands for the launcher: one blocked opening a FIFO.
  const fs::path fifo = tmp / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  Background launcher({"recipe", "validate", fifo.string()});
  char host[256] = {};
  REQUIRE(::gethostname(host, sizeof host - 1) == 0);
  const auto run_json = [&](bool placing) {
    json info{{"status", "running"},
              {"world_size", 2},
              {"nominal_world_size", 2},
              {"recipe", resumable_recipe()},
              {"launcher", {{"host", host}, {"pid", launcher.pid()}}},
              {"alive_at", utc(std::time(nullptr))},
              // The earlier invocation's generation, its ranks long gone.
              {"generations",
               {{{"generation", 1},
                 {"started_at", utc(std::time(nullptr) - 3600)},
                 {"ended_at", utc(std::time(nullptr) - 3000)},
                 {"status", "terminated"},
                 {"world_size", 2},
                 {"pids", {999999}}}}}};
    if (placing) info["placing"] = {{"at", utc(std::time(nullptr))}};
    return info.dump();
  };
  fs::create_directories(tmp / "run");
  write_text(tmp / "run/run.json", run_json(true));
  json s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "running");
  // Without the mark, the last generation's processes tell: gone.
  write_text(tmp / "run/run.json", run_json(false));
  s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "stale");
  {
    // Unless the run's lock is held too, as the launcher holds it from its start to its end:
    // its ranks have exited and it is recording how they ended (a window at the end of every
    // generation, which a script polling status must not read as stale).
    const int fd = ::open((tmp / "run/.lock").c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    REQUIRE(fd >= 0);
    REQUIRE(::flock(fd, LOCK_EX | LOCK_NB) == 0);
    s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
    CHECK(s["status"] == "running");
    CHECK(s["note"] ==
          "no rank of generation 1 is alive; its launcher is recording how the generation ended");
    ::close(fd);
  }
  s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "stale");
  std::ofstream(fifo) << "{}";  // lets the stand-in end
  launcher.wait(std::chrono::seconds(30));
}

TEST_CASE("status of a run launched on another machine: its launcher's stamp tells") {
  // Seen over a shared filesystem: the pids are not this machine's to check.
  TempDir tmp;
  const auto run_json = [&](std::time_t alive_at) {
    return json{{"status", "running"},
                {"world_size", 2},
                {"recipe", resumable_recipe()},
                {"launcher", {{"host", "login-node-that-is-not-this-one"}, {"pid", 4242}}},
                {"alive_at", utc(alive_at)},
                {"generations",
                 {{{"generation", 1},
                   {"started_at", utc(alive_at - 100)},
                   {"world_size", 2},
                   {"pids", {999999}}}}}}
        .dump();
  };
  fs::create_directories(tmp / "run");
  write_text(tmp / "run/run.json", run_json(std::time(nullptr) - 3));
  json s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "running");
  CHECK(contains(s["note"].get<std::string>(), "launched on login-node-that-is-not-this-one"));

  write_text(tmp / "run/run.json", run_json(std::time(nullptr) - 600));
  s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "stale");
  CHECK(contains(s["note"].get<std::string>(), "has not stamped the run for"));

  // No stamp it can read: stale, saying so, not "for ever".
  json garbled = parse_json(run_json(std::time(nullptr)));
  garbled["alive_at"] = "yesterday";
  write_text(tmp / "run/run.json", garbled.dump());
  s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "stale");
  CHECK(contains(s["note"].get<std::string>(),
                 "run.json has no readable stamp of its launcher (alive_at)"));

  // A stamp an hour ahead (clocks that disagree) tells nothing: never "running" forever, nor
  // "stale" with a hint to resume what may still run.
  write_text(tmp / "run/run.json", run_json(std::time(nullptr) + 3600));
  s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "unknown");
  CHECK(contains(s["note"].get<std::string>(), "s in the future: its clock and this machine's"));
  CHECK(s["hint"].is_null());
  CHECK_FALSE(contains(run_dptrain({"status", (tmp / "run").string()}).out, "resume"));
  // Nor does resume go ahead: two launchers would drive the run.
  const std::string before = read_text(tmp / "run/run.json");
  auto resumed = run_dptrain({"resume", (tmp / "run").string()});
  CHECK(resumed.exit_code == 2);
  CHECK(contains(resumed.err,
                 "the run may still be running (launched on "
                 "login-node-that-is-not-this-one, whose stamp is "));
  CHECK(read_text(tmp / "run/run.json") == before);
}

TEST_CASE("status of a run.json whose status dptrain never writes: unknown, saying what it is") {
  TempDir tmp;
  fs::create_directories(tmp / "run");
  const std::vector<std::pair<json, std::string>> cases = {
      {5, "run.json's status is 5, not one dptrain records"},
      {"sleeping", "run.json's status is \"sleeping\", not one dptrain records"},
      {json::object(), "run.json's status is {}, not one dptrain records"},
      {nullptr, "run.json records no status"}};
  for (const auto& [status, note] : cases) {
    json info = {{"world_size", 1}, {"recipe", resumable_recipe()}};
    if (!status.is_null()) info["status"] = status;
    write_text(tmp / "run/run.json", info.dump());
    const auto r = run_dptrain({"status", (tmp / "run").string(), "--json"});
    CAPTURE(status.dump());
    CHECK(r.exit_code == 0);
    const json s = parse_json(r.out);
    CHECK(s["status"] == "unknown");
    CHECK(s["note"] == note);
    CHECK(s["recorded_status"] == status);  // as run.json holds it: 5 stays a number
    const auto text = run_dptrain({"status", (tmp / "run").string()});
    CHECK(contains(text.out, "unknown"));
    CHECK(contains(text.out, note));
  }
}

TEST_CASE("status of a run.json whose numbers were edited into words: null, not 0 or a string") {
  TempDir tmp;
  fs::create_directories(tmp / "run");
  json recipe = resumable_recipe();
  for (const json& steps : {json("forty"), json(1e300), json(-0.5), json(18446744073709551615u)}) {
    CAPTURE(steps.dump());
    recipe["train"]["steps"] = steps;
    const json info = {{"status", "completed"},
                       {"world_size", steps},
                       {"nominal_world_size", "two"},
                       {"recipe", recipe}};
    write_text(tmp / "run/run.json", info.dump());
    const json s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
    CHECK(s["steps"].is_null());
    CHECK(s["world_size"].is_null());
    CHECK(s["nominal_world_size"].is_null());
    // The text says as much, not the words or numbers the JSON leaves out.
    const auto text = run_dptrain({"status", (tmp / "run").string()});
    CHECK(contains(text.out, "world size   unknown\n"));
    CHECK_FALSE(contains(text.out, "two"));
  }
  recipe["train"]["steps"] = 9007199254740993;  // not through a double: exactly this
  write_text(tmp / "run/run.json",
             json{{"status", "completed"}, {"world_size", 1}, {"recipe", recipe}}.dump());
  const json s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["steps"] == 9007199254740993);
}

TEST_CASE("status of workers started without a launcher: judged by rank 0 on its own machine") {
  TempDir tmp;
  fs::create_directories(tmp / "run");
  const auto hand_run = [&](const std::string& host) {
    return json{{"status", "running"},
                {"started_by", "dptrain worker"},
                {"world_size", 2},
                {"recipe", resumable_recipe()},
                {"generations",
                 {{{"generation", 1},
                   {"started_at", "2026-01-01T00:00:00Z"},
                   {"world_size", 2},
                   {"hosts", {host}},
                   {"pids", {999999}}}}}}
        .dump();
  };
  // Elsewhere (a shared filesystem): its pid is not this machine's to check.
  write_text(tmp / "run/run.json", hand_run("a-node-that-is-not-this-one"));
  json s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "running");
  CHECK(s["note"] ==
        "its rank 0 runs on a-node-that-is-not-this-one (workers started without a "
        "launcher): whether it lives cannot be checked from here");
  // Here, with rank 0 gone: stale, and the hint says how its workers continue it.
  json info = parse_json(hand_run("x"));
  char name[256] = {};
  REQUIRE(::gethostname(name, sizeof name - 1) == 0);
  info["generations"][0]["hosts"] = {std::string(name)};
  write_text(tmp / "run/run.json", info.dump());
  s = parse_json(run_dptrain({"status", (tmp / "run").string(), "--json"}).out);
  CHECK(s["status"] == "stale");
  CHECK(s["note"] == "its rank 0 is gone: no rank of generation 1 is alive");
  CHECK(s["hint"] ==
        "its workers were started without a launcher: start them again with "
        "'--resume newest-or-start' to continue it");
}

TEST_CASE("a running launch stamps run.json with its host and a renewed alive_at") {
  TempDir tmp;
  auto recipe = resumable_recipe();
  const auto file = write_recipe(tmp.path(), recipe);
  const fs::path run_dir = tmp / "run";
  Background job({"launch", file.string(), "--nproc", "1", "--run-dir", run_dir.string()},
                 {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "150"}});
  REQUIRE(eventually([&] {
    std::error_code ec;
    if (!fs::exists(run_dir / "run.json", ec)) return false;
    const json info = json::parse(read_text(run_dir / "run.json"), nullptr, false);
    return !info.is_discarded() && info.contains("alive_at");
  }));
  const json first = parse_json(read_text(run_dir / "run.json"));
  CHECK(first["launcher"]["pid"] == job.pid());
  CHECK_FALSE(first["launcher"]["host"].get<std::string>().empty());
  // Renewed while it runs (every 10 s).
  const std::string stamp = first["alive_at"];
  CHECK(eventually(
      [&] {
        const json info = json::parse(read_text(run_dir / "run.json"), nullptr, false);
        return !info.is_discarded() && info.value("alive_at", stamp) != stamp;
      },
      std::chrono::seconds(25)));
  ::kill(job.pid(), SIGINT);
  job.wait();
}

TEST_CASE("report and status of what is not a run: exit 2 naming it") {
  TempDir tmp;
  // An empty RUN_DIR names no directory, for every command that takes one.
  for (const std::vector<std::string>& args : {std::vector<std::string>{"status", ""},
                                               {"report", ""},
                                               {"ckpt", "list", ""},
                                               {"ckpt", "verify", ""},
                                               {"resume", ""},
                                               {"sample", ""}}) {
    CAPTURE(args[0]);
    auto empty = run_dptrain(args);
    CHECK(empty.exit_code == 2);
    CHECK(empty.err.starts_with("dptrain: error: run_dir: is empty; name a run directory"));
  }
  for (const char* cmd : {"report", "status"}) {
    CAPTURE(cmd);
    auto missing = run_dptrain({cmd, (tmp / "nope").string()});
    CHECK(missing.exit_code == 2);
    CHECK(contains(missing.err, (tmp / "nope").string() + ": no such run directory"));

    auto no_run_json = run_dptrain({cmd, tmp.path().string(), "--json"});
    CHECK(no_run_json.exit_code == 2);
    CHECK(contains(no_run_json.err, tmp.path().string() + ": not a run directory"));
    CHECK(parse_json(no_run_json.out)["exit_code"] == 2);
    CHECK_FALSE(fs::exists(tmp / "checkpoints"));  // nothing created where there is no run

    fs::create_directories(tmp / "bad");
    write_text(tmp / "bad/run.json", "{\"status\": ");
    auto bad = run_dptrain({cmd, (tmp / "bad").string()});
    CHECK(bad.exit_code == 2);
    CHECK(contains(bad.err, (tmp / "bad/run.json").string() + ": not valid JSON"));

    // Nested deeper than any run.json (writing it back would overflow the stack): one line.
    write_text(tmp / "bad/run.json",
               "{\"status\": \"completed\", \"recipe\": {\"name\": " + std::string(100000, '[') +
                   std::string(100000, ']') + "}}");
    auto deep = run_dptrain({cmd, (tmp / "bad").string(), "--json"});
    CHECK(deep.exit_code == 2);
    CHECK(deep.err == "dptrain: error: " + (tmp / "bad/run.json").string() +
                          ": not valid JSON at line 1, column 170: nested more than 128 levels "
                          "deep\n");
    CHECK(parse_json(deep.out)["exit_code"] == 2);
  }
  fs::create_directories(tmp / "ok");
  write_text(tmp / "ok/run.json", "{\"status\": \"completed\"}");
  auto out_dir =
      run_dptrain({"report", (tmp / "ok").string(), "--out", (tmp / "no/such.html").string()});
  CHECK(out_dir.exit_code == 2);
  CHECK(contains(out_dir.err, "--out"));
  auto empty = run_dptrain({"report", (tmp / "ok").string(), "--out", ""});
  CHECK(empty.exit_code == 2);
  CHECK(contains(empty.err, "--out: is empty; give a value"));
  CHECK_FALSE(fs::exists(tmp / "ok/report.html"));
  // Without --out, a directory where the report goes is a report that cannot be written.
  fs::create_directories(tmp / "ok/report.html");
  auto in_the_way = run_dptrain({"report", (tmp / "ok").string()});
  CHECK(in_the_way.exit_code == 1);
  CHECK(contains(in_the_way.err, (tmp / "ok/report.html").string() + ": is a directory"));
  CHECK_FALSE(contains(in_the_way.err, "error: --out"));
  fs::remove(tmp / "ok/report.html");

  // --out never replaces the run's own files, a link, or what is not a plain file; the run's
  // report.html, named by any path, is still the report's to replace.
  const std::string run_json = read_text(tmp / "ok/run.json");
  for (const fs::path& inside :
       {tmp / "ok/run.json", tmp / "ok/new.html", tmp / "ok/../ok/run.json"}) {
    CAPTURE(inside);
    auto refused = run_dptrain({"report", (tmp / "ok").string(), "--out", inside.string()});
    CHECK(refused.exit_code == 2);
    CHECK(refused.err == "dptrain: error: --out " + inside.string() +
                             ": inside the run directory " + (tmp / "ok").string() +
                             ", whose files a report must not replace; name a file elsewhere "
                             "(without --out the report is " +
                             (tmp / "ok/report.html").string() + ")\n");
  }
  CHECK(read_text(tmp / "ok/run.json") == run_json);
  CHECK_FALSE(fs::exists(tmp / "ok/new.html"));
  // Nor another run's files, at any depth (its report.html too: that one is its own report's).
  fs::create_directories(tmp / "other/checkpoints");
  fs::copy_file(tmp / "ok/run.json", tmp / "other/run.json");
  for (const fs::path& inside :
       {tmp / "other/run.json", tmp / "other/report.html", tmp / "other/checkpoints/x.html"}) {
    CAPTURE(inside);
    auto refused = run_dptrain({"report", (tmp / "ok").string(), "--out", inside.string()});
    CHECK(refused.exit_code == 2);
    CHECK(refused.err == "dptrain: error: --out " + inside.string() +
                             ": inside the run directory " + (tmp / "other").string() +
                             ", another run's, whose files a report must not replace; name a "
                             "file outside every run directory\n");
  }
  CHECK(read_text(tmp / "other/run.json") == run_json);
  CHECK_FALSE(fs::exists(tmp / "other/report.html"));
  write_text(tmp / "target.html", "kept");
  fs::create_symlink(tmp / "target.html", tmp / "link.html");
  auto link = run_dptrain({"report", (tmp / "ok").string(), "--out", (tmp / "link.html").string()});
  CHECK(link.exit_code == 2);
  CHECK(contains(link.err, "link.html: is a symbolic link, not a regular file"));
  CHECK(fs::is_symlink(tmp / "link.html"));
  CHECK(read_text(tmp / "target.html") == "kept");
  // So is one where the report goes without --out.
  fs::remove(tmp / "ok/report.html");
  fs::create_symlink(tmp / "target.html", tmp / "ok/report.html");
  auto default_link = run_dptrain({"report", (tmp / "ok").string()});
  CHECK(default_link.exit_code == 2);
  CHECK(contains(default_link.err, "report.html: is a symbolic link, not a regular file"));
  CHECK(fs::is_symlink(tmp / "ok/report.html"));
  CHECK(read_text(tmp / "target.html") == "kept");
  fs::remove(tmp / "ok/report.html");
  // Pipes where a run's files belong are never opened (a reader would wait for a writer).
  REQUIRE(::mkfifo((tmp / "ok/metrics.jsonl").c_str(), 0600) == 0);
  fs::create_directories(tmp / "ok/checkpoints/step-000010");
  REQUIRE(::mkfifo((tmp / "ok/checkpoints/latest").c_str(), 0600) == 0);
  for (const char* cmd : {"status", "report"}) {
    auto piped = run_dptrain({cmd, (tmp / "ok").string(), "--json"}, {}, std::chrono::seconds(30));
    CHECK(piped.exit_code == 0);
    // The checkpoints are still looked at, without a `latest` to mark: the empty one is none a
    // resume may use (report names it as failed).
    CHECK(parse_json(piped.out)["checkpoints"] == 0);
    if (std::string(cmd) == "report") CHECK(parse_json(piped.out)["checkpoints_failed"] == 1);
    CHECK(parse_json(piped.out)["unreadable"] ==
          json{(tmp / "ok/metrics.jsonl").string() + ": is a pipe, not a regular file",
               (tmp / "ok/checkpoints/latest").string() + ": is a pipe, not a regular file"});
  }
  auto listed = run_dptrain({"ckpt", "list", (tmp / "ok").string()}, {}, std::chrono::seconds(30));
  CHECK(listed.exit_code == 0);
  fs::remove(tmp / "ok/metrics.jsonl");
  fs::remove_all(tmp / "ok/checkpoints");
  // Nor is a directory there taken for a run with nothing logged.
  fs::create_directories(tmp / "ok/metrics.jsonl");
  fs::create_directories(tmp / "ok/checkpoints/latest");
  for (const char* cmd : {"status", "report"}) {
    auto dirs = run_dptrain({cmd, (tmp / "ok").string(), "--json"});
    CHECK(dirs.exit_code == 0);
    CHECK(parse_json(dirs.out)["unreadable"] ==
          json{(tmp / "ok/metrics.jsonl").string() + ": is a directory, not a regular file",
               (tmp / "ok/checkpoints/latest").string() + ": is a directory, not a regular file"});
  }
  fs::remove(tmp / "ok/metrics.jsonl");
  fs::remove_all(tmp / "ok/checkpoints");
  fs::create_directories(tmp / "piped");
  REQUIRE(::mkfifo((tmp / "piped/run.json").c_str(), 0600) == 0);
  auto piped_run = run_dptrain({"status", (tmp / "piped").string()}, {}, std::chrono::seconds(30));
  CHECK(piped_run.exit_code == 2);
  CHECK(contains(piped_run.err, "piped/run.json: is a pipe, not a regular file: " +
                                    (tmp / "piped").string() + " is not a run directory"));
  REQUIRE(::mkfifo((tmp / "pipe").c_str(), 0600) == 0);
  auto pipe = run_dptrain({"report", (tmp / "ok").string(), "--out", (tmp / "pipe").string()});
  CHECK(pipe.exit_code == 2);
  CHECK(contains(pipe.err, "pipe: is a pipe, not a regular file"));
  auto own = run_dptrain(
      {"report", (tmp / "ok").string(), "--out", (tmp / "ok/../ok/report.html").string()});
  CHECK(own.exit_code == 0);
  CHECK(fs::is_regular_file(tmp / "ok/report.html"));
  auto outside =
      run_dptrain({"report", (tmp / "ok").string(), "--out", (tmp / "outside.html").string()});
  CHECK(outside.exit_code == 0);
  CHECK(read_text(tmp / "outside.html").starts_with("<!DOCTYPE html>"));
  // An earlier report there is replaced; a file that holds something else (the recipe, a
  // dataset, named by a slip; the "kept" above) is not, and stays as it was.
  CHECK(run_dptrain({"report", (tmp / "ok").string(), "--out", (tmp / "outside.html").string()})
            .exit_code == 0);
  CHECK(run_dptrain({"report", (tmp / "ok").string(), "--out", (tmp / "target.html").string()})
            .exit_code == 2);
  CHECK(read_text(tmp / "target.html") == "kept");
  write_text(tmp / "data.csv", "x,label\n1,0\n");
  auto slip = run_dptrain(
      {"report", (tmp / "ok").string(), "--out", (tmp / "data.csv").string(), "--json"});
  CHECK(slip.exit_code == 2);
  CHECK(parse_json(slip.out)["error"] ==
        "--out " + (tmp / "data.csv").string() +
            ": holds something else than an HTML page (it does not start with <!DOCTYPE html>), "
            "so it is not replaced; name another file, or remove it first");
  CHECK(read_text(tmp / "data.csv") == "x,label\n1,0\n");
}

TEST_CASE("status: a run that failed on a checkpoint problem (exit 5) says to fix it first") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  const fs::path run_dir = tmp / "run";
  auto r = run_dptrain({"launch", recipe.string(), "--run-dir", run_dir.string()},
                       {{"DPTRAIN_FAULT", "exit@step=3,rank=0,code=5"}});
  CHECK(r.exit_code == 5);
  const json info = parse_json(read_text(run_dir / "run.json"));
  CHECK(info["generations"].back()["exit_code"] == 5);
  const json s = parse_json(run_dptrain({"status", run_dir.string(), "--json"}).out);
  CHECK(s["hint"] == fmt::format("a checkpoint problem (see the error; 'dptrain ckpt verify {} "
                                 "--all' checks every checkpoint): once it is fixed, continue it "
                                 "with 'dptrain resume {}'",
                                 run_dir.string(), run_dir.string()));
}

namespace {

// A 2-rank run of 30 steps in tmp/run that failed at step 25, after its checkpoint of step 20: a
// resume would continue from it.
fs::path run_failed_after_checkpoint(const TempDir& tmp) {
  auto recipe_json = resumable_recipe();
  recipe_json["train"]["steps"] = 30;
  const auto recipe = write_recipe(tmp.path(), recipe_json);
  const fs::path run_dir = tmp / "run";
  auto r = run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string()},
                       {{"DPTRAIN_FAULT", "exit@step=25,rank=1,code=9"}});
  REQUIRE(r.exit_code == 3);
  REQUIRE(fs::exists(run_dir / "checkpoints/step-000020"));
  return run_dir;
}

}  // namespace

TEST_CASE("status: a checkpoints directory gone or out of reach is not 'none': the hint says so") {
  TempDir tmp;
  const fs::path run_dir = run_failed_after_checkpoint(tmp);
  const auto status = [&] { return run_dptrain({"status", run_dir.string(), "--json"}); };
  CHECK(parse_json(status().out)["hint"] ==
        "continue it with 'dptrain resume " + run_dir.string() + "'");

  fs::remove_all(run_dir / "checkpoints");
  auto gone = status();
  CHECK(parse_json(gone.out)["checkpoints"] == 0);
  CHECK(parse_json(gone.out)["hint"] ==
        fmt::format("run.json records step-000020 committed in {}/checkpoints, which holds no "
                    "checkpoint: a resume refuses until it is back; then continue it with "
                    "'dptrain resume {}'",
                    run_dir.string(), run_dir.string()));
  auto text = run_dptrain({"status", run_dir.string()});
  CHECK(contains(text.out,
                 "checkpoint   unknown: run.json records step-000020 committed, and "
                 "checkpoints/ holds none\n"));
  // The resume refuses indeed; its JSON error names the run directory, as its events do.
  const auto refused = run_dptrain({"resume", run_dir.string(), "--json"});
  CHECK(refused.exit_code == 5);
  CHECK(parse_json(refused.out)["run_dir"] == run_dir.string());

  // Out of reach (not a directory here; a permission likewise): how many it holds is unknown.
  fs::remove_all(run_dir / "checkpoints");
  write_text(run_dir / "checkpoints", "");
  auto blocked = status();
  CHECK(parse_json(blocked.out)["checkpoints"].is_null());
  CHECK(contains(parse_json(blocked.out)["hint"].get<std::string>(),
                 "/checkpoints, which cannot be read: a resume refuses until it is back"));
}

// `dptrain resume RUN_DIR` in the background, once its second generation's two ranks run; rank 1
// takes 30 s to load, so they do not meet while a test looks.
std::unique_ptr<Background> resume_not_meeting(const fs::path& run_dir) {
  auto resume = std::make_unique<Background>(std::vector<std::string>{"resume", run_dir.string()},
                                             Env{{"DPTRAIN_FAULT", "slow-start@rank=1,ms=30000"}});
  REQUIRE(eventually([&] {
    return parse_json(read_text(run_dir / "run.json"))["generations"].size() == 2 &&
           worker_pids(run_dir).size() == 2;
  }));
  return resume;
}

TEST_CASE("status of a resume whose ranks have not met: the step shown is the last generation's") {
  TempDir tmp;
  const fs::path run_dir = run_failed_after_checkpoint(tmp);
  CHECK_FALSE(
      parse_json(run_dptrain({"status", run_dir.string(), "--json"}).out)["generation_starting"]
          .get<bool>());
  const auto resume = resume_not_meeting(run_dir);
  const json s = parse_json(run_dptrain({"status", run_dir.string(), "--json"}).out);
  CHECK(s["status"] == "running");
  CHECK(s["generation_starting"] == true);
  const auto text = run_dptrain({"status", run_dir.string()}).out;
  CHECK(contains(text,
                 "; the last generation's: this one is starting, from its newest valid "
                 "checkpoint\n"));
  REQUIRE(::kill(resume->pid(), SIGTERM) == 0);
  CHECK(resume->wait(std::chrono::seconds(60)) == 143);
}

TEST_CASE("status of a resume from step 0 whose ranks have not met: the last generation's step") {
  TempDir tmp;
  auto recipe_json = resumable_recipe();
  recipe_json["train"]["steps"] = 30;
  const auto recipe = write_recipe(tmp.path(), recipe_json);
  const fs::path run_dir = tmp / "run";
  auto failed =
      run_dptrain({"launch", recipe.string(), "--nproc", "2", "--run-dir", run_dir.string()},
                  {{"DPTRAIN_FAULT", "exit@step=12,rank=1,code=9"}});
  REQUIRE(failed.exit_code == 3);
  REQUIRE_FALSE(fs::exists(run_dir / "checkpoints/latest"));  // (every 20 steps)
  const json before = parse_json(run_dptrain({"status", run_dir.string(), "--json"}).out);
  REQUIRE(before["step"].is_number());
  REQUIRE(before["loss"].is_number());
  const auto resume = resume_not_meeting(run_dir);
  const json s = parse_json(run_dptrain({"status", run_dir.string(), "--json"}).out);
  CHECK(s["generation_starting"] == true);
  // Its last logged step (the failed one was logged or not), and that step's loss.
  REQUIRE(s["step"].is_number());
  CHECK(s["step"].get<int64_t>() > 0);
  CHECK(s["step"].get<int64_t>() <= before["step"].get<int64_t>());
  CHECK(s["loss"] == before["loss"]);
  REQUIRE(::kill(resume->pid(), SIGTERM) == 0);
  CHECK(resume->wait(std::chrono::seconds(60)) == 143);
}
