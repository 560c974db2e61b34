// A full disk on a real small filesystem: a tmpfs mounted in a user + mount namespace
// (`unshare -Urm`, no real root needed, nothing left mounted) that holds two checkpoints of the
// run but not a third; one with no room for the run's first files; one that fills while the ranks
// train.
#include <doctest/doctest.h>

#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "tests/harness.hpp"
#include "tests/strings.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;

namespace {

constexpr int64_t kPage = 4096;

int64_t pages(int64_t bytes) {
  return (bytes + kPage - 1) / kPage * kPage;
}

// Parameters of the recipe's MLP: a weight matrix and a bias per layer.
int64_t mlp_params(const nlohmann::json& model) {
  std::vector<int64_t> widths = {model["input"].get<int64_t>()};
  for (const auto& h : model["hidden"])
    widths.push_back(h.get<int64_t>());
  widths.push_back(model["classes"].get<int64_t>());
  int64_t p = 0;
  for (size_t i = 0; i + 1 < widths.size(); ++i)
    p += widths[i] * widths[i + 1] + widths[i + 1];
  return p;
}

// Runs `bash script args...` as root of a new user + mount namespace; returns its exit code.
int run_in_namespace(const fs::path& script, const std::vector<std::string>& args,
                     const fs::path& log) {
  std::string command = "timeout -s KILL 120 unshare -Urm bash '" + script.string() + "'";
  for (const auto& a : args)
    command += " '" + a + "'";
  command += " >'" + log.string() + "' 2>&1";
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Runs inside the namespace and copies out to $out what the test reads: the tmpfs goes away
// with the namespace.
constexpr const char* kScript = R"(set -u
bin=$1 recipe=$2 out=$3 size=$4 bigger=$5
mnt=$out/mnt
mount -t tmpfs -o "size=$size" dptrain-disk-full "$mnt" || exit 90
run=$mnt/run
"$bin" launch "$recipe" --nproc 2 --run-dir "$run" --max-restarts 2 >"$out/launch.out" 2>"$out/launch.err"
echo $? >"$out/launch.rc"
"$bin" ckpt verify "$run" >"$out/verify.out" 2>"$out/verify.err"
echo $? >"$out/verify.rc"
"$bin" ckpt list "$run" --json >"$out/list.json" 2>"$out/list.err"
echo $? >"$out/list.rc"
ls -A "$run/checkpoints" >"$out/checkpoints.txt"
df -B1 "$mnt" >"$out/df.txt"
mount -o "remount,size=$bigger" "$mnt" || exit 91
"$bin" resume "$run" >"$out/resume.out" 2>"$out/resume.err"
echo $? >"$out/resume.rc"
ls -A "$run/checkpoints" >"$out/checkpoints-after.txt"
cp "$run/result.json" "$out/result.json" 2>/dev/null
exit 0
)";

int read_code(const fs::path& path) {
  const std::string text = read_text(path);
  return text.empty() ? -1 : std::stoi(text);
}

std::vector<std::string> nonempty_lines(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) out.push_back(line);
  }
  return out;
}

}  // namespace

TEST_CASE("a full disk during a checkpoint write: exit 5, one clear error, previous one usable") {
  TempDir tmp;
  // Namespaces unavailable (a container without user namespaces) is a broken test machine, said
  // plainly, not a silent pass.
  const fs::path probe_log = tmp / "probe.log";
  write_text(tmp / "probe.sh", "mount -t tmpfs -o size=64k probe \"$1\"\n");
  fs::create_directories(tmp / "probe");
  const int probe = run_in_namespace(tmp / "probe.sh", {(tmp / "probe").string()}, probe_log);
  INFO("unshare -Urm with a tmpfs mount: ", read_text(probe_log));
  REQUIRE_MESSAGE(probe == 0, "this test needs user namespaces (unshare -Urm)");

  // Checkpoints every 20 of 120 steps, all kept: 20 and 40 fit, 60 does not.
  auto recipe = resumable_recipe();
  recipe["model"]["hidden"] = {512, 512};  // checkpoints of MBs: logs are small beside them
  const int64_t p = mlp_params(recipe["model"]);
  const int64_t params_bytes = pages(4 * p);
  const int64_t optimizer_bytes = pages(8 * p);  // AdamW: two moments per parameter
  const int64_t checkpoint_bytes = params_bytes + optimizer_bytes + kPage;  // + meta.json
  // Two checkpoints, `latest`, and the third's params.bin with half its optimizer.bin: up to
  // 4P bytes of logs, metrics and run.json, and the third still fails in optimizer.bin.
  const int64_t size = 2 * checkpoint_bytes + kPage + params_bytes + optimizer_bytes / 2;
  REQUIRE(size < 3 * checkpoint_bytes);
  const int64_t bigger = 8 * checkpoint_bytes;  // resume keeps 3 and writes a 4th

  const auto recipe_path = write_recipe(tmp.path(), recipe);
  const fs::path out = tmp / "out";
  fs::create_directories(out / "mnt");
  write_text(tmp / "disk-full.sh", kScript);
  const int script = run_in_namespace(
      tmp / "disk-full.sh",
      {binary(), recipe_path.string(), out.string(), std::to_string(size), std::to_string(bigger)},
      tmp / "script.log");
  INFO("script: ", read_text(tmp / "script.log"));
  INFO("tmpfs of ", size, " bytes, checkpoints of ", checkpoint_bytes, ":\n",
       read_text(out / "df.txt"));
  REQUIRE(script == 0);

  // The launch fails with the checkpoint exit code and one line that says what and where.
  const std::string launch_err = read_text(out / "launch.err");
  INFO("launch stderr:\n", launch_err);
  INFO("launch stdout:\n", read_text(out / "launch.out"));
  CHECK(read_code(out / "launch.rc") == 5);
  std::vector<std::string> enospc;
  for (const auto& line : nonempty_lines(launch_err)) {
    if (contains(line, "No space left on device")) enospc.push_back(line);
  }
  REQUIRE(enospc.size() == 1);
  CHECK(launch_err.rfind("dptrain: error: ", 0) == 0);
  CHECK(contains(enospc[0], "dptrain: error: "));
  // The checkpoint and the blob, not the temporary directory that was removed.
  const std::string step60 = (out / "mnt/run/checkpoints/step-000060/").string();
  CHECK((contains(enospc[0], step60 + "params.bin: ") ||
         contains(enospc[0], step60 + "optimizer.bin: ")));
  CHECK_FALSE(contains(enospc[0], ".tmp-"));
  // Rank 1's broken barrier is a consequence, not a second error to read.
  CHECK_FALSE(contains(launch_err, "barrier"));
  // Not restarted, though restarts were allowed: the next generation would fill the disk too.
  CHECK(contains(launch_err,
                 "not restarted: a checkpoint or run file that cannot be written "
                 "would meet the next generation"));
  CHECK_FALSE(contains(read_text(out / "launch.out"), "restart 1/2"));

  // `latest` still names the previous checkpoint, and it verifies.
  INFO("verify:\n", read_text(out / "verify.out"), read_text(out / "verify.err"));
  CHECK(read_code(out / "verify.rc") == 0);
  CHECK(contains(read_text(out / "verify.out"), "step-000040 (latest): ok"));
  REQUIRE(read_code(out / "list.rc") == 0);
  const auto list = parse_json(read_text(out / "list.json"));
  CHECK(list["latest"] == "step-000040");
  REQUIRE(list["checkpoints"].size() == 2);
  for (const auto& c : list["checkpoints"]) {
    CHECK(c["ok"] == true);
  }

  // Nothing half-written is left behind.
  const std::string dir = read_text(out / "checkpoints.txt");
  INFO("checkpoints/ after the failure:\n", dir);
  CHECK(nonempty_lines(dir) == std::vector<std::string>{"latest", "step-000020", "step-000040"});
  CHECK_FALSE(contains(dir, ".tmp-"));

  // With room again, the run resumes from step 40 and completes.
  INFO("resume stderr:\n", read_text(out / "resume.err"));
  INFO("resume stdout:\n", read_text(out / "resume.out"));
  CHECK(read_code(out / "resume.rc") == 0);
  REQUIRE(fs::exists(out / "result.json"));
  const auto result = parse_json(read_text(out / "result.json"));
  CHECK(result["steps"] == 120);
  const std::string after = read_text(out / "checkpoints-after.txt");
  INFO("checkpoints/ after resume:\n", after);
  CHECK_FALSE(contains(after, ".tmp-"));
  CHECK(contains(after, "step-000120"));
}

namespace {

// A disk with no room for the run's first files at the start, then one that fills while the ranks
// train.
constexpr const char* kRunJsonScript = R"(set -u
bin=$1 short=$2 long=$3 out=$4
mnt=$out/mnt
mount -t tmpfs -o size=8k dptrain-run-json "$mnt" || exit 90
run=$mnt/run
"$bin" launch "$short" --nproc 2 --run-dir "$run" >"$out/first.out" 2>"$out/first.err"
echo $? >"$out/first.rc"
ls -A "$run" >"$out/first-ls.txt"
mount -o remount,size=64m "$mnt" || exit 91
"$bin" launch "$short" --nproc 2 --run-dir "$run" >"$out/again.out" 2>"$out/again.err"
echo $? >"$out/again.rc"
filled=$mnt/filled
"$bin" launch "$long" --nproc 2 --run-dir "$filled" --max-restarts 2 --restart-backoff 0.1 \
  >"$out/filled.out" 2>"$out/filled.err" &
launcher=$!
for i in $(seq 600); do grep -q '"pids"' "$filled/run.json" 2>/dev/null && break; sleep 0.1; done
head -c 100M /dev/zero >"$mnt/fill" 2>/dev/null
wait $launcher
echo $? >"$out/filled.rc"
"$bin" status "$filled" --json >"$out/filled-status.json" 2>"$out/filled-status.err"
rm -f "$mnt/fill"
mount -o remount,ro "$mnt" || exit 92
"$bin" resume "$filled" >"$out/ro.out" 2>"$out/ro.err"
echo $? >"$out/ro.rc"
exit 0
)";

}  // namespace

TEST_CASE(
    "no room for the run's first files: a start leaves a directory a launch takes again; mid-run, "
    "the "
    "ranks' error is the one reported") {
  TempDir tmp;
  auto long_recipe = small_recipe();
  long_recipe["name"] = "long";
  long_recipe["train"]["steps"] = 20000;
  long_recipe["checkpoint"] = {{"every", 10000}, {"keep", 1}};
  const fs::path out = tmp / "out";
  fs::create_directories(out / "mnt");
  fs::create_directories(tmp / "long");
  write_text(tmp / "run-json.sh", kRunJsonScript);
  const int script =
      run_in_namespace(tmp / "run-json.sh",
                       {binary(), write_recipe(tmp.path(), small_recipe()).string(),
                        write_recipe(tmp / "long", long_recipe).string(), out.string()},
                       tmp / "script.log");
  INFO("script: ", read_text(tmp / "script.log"));
  REQUIRE(script == 0);

  // Nothing started, no run recorded, and nothing left that a launch into it would refuse.
  const std::string run = (out / "mnt/run").string();
  const std::string first_err = read_text(out / "first.err");
  INFO("first launch:\n", first_err);
  CHECK(read_code(out / "first.rc") == 1);
  CHECK(nonempty_lines(first_err) ==
        std::vector<std::string>{
            "dptrain: run directory: " + run + " (nothing was started: a launch may use it again)",
            "dptrain: error: " + run + "/recipe.json: cannot write: No space left on device"});
  CHECK(nonempty_lines(read_text(out / "first-ls.txt")) ==
        std::vector<std::string>{".lock", "checkpoints", "logs"});
  INFO("again:\n", read_text(out / "again.err"));
  CHECK(read_code(out / "again.rc") == 0);

  // Filled mid-run: run.json cannot follow the job, which is said once; the error reported is
  // the rank's that could not write, with the exit code of a file that cannot be written (5: not
  // restarted), not the launcher's.
  const std::string filled_err = read_text(out / "filled.err");
  INFO("filled:\n", filled_err);
  CHECK(read_code(out / "filled.rc") == 5);
  CHECK(contains(filled_err, "(not restarted: a checkpoint or run file that cannot be written"));
  const auto lines = nonempty_lines(filled_err);
  const std::string warning =
      "dptrain: warning: " + (out / "mnt/filled/run.json").string() +
      ": cannot write: No space left on device; run.json is behind until it can be written";
  CHECK(std::count_if(lines.begin(), lines.end(),
                      [&](const std::string& l) { return l.rfind(warning, 0) == 0; }) == 1);
  const auto error = std::find_if(lines.begin(), lines.end(), [](const std::string& l) {
    return l.rfind("dptrain: error: ", 0) == 0;
  });
  REQUIRE(error != lines.end());
  CHECK(error->rfind("dptrain: error: rank 0 (pid ", 0) == 0);
  CHECK(contains(*error, "No space left on device"));
  // run.json still says running, but its launcher is gone: stale, so a resume may take it.
  INFO("status: ", read_text(out / "filled-status.err"));
  const auto status = parse_json(read_text(out / "filled-status.json"));
  CHECK(status["status"] == "stale");
  // A directory that takes no writes at all (read-only) is refused before anything is tried.
  CHECK(read_code(out / "ro.rc") == 2);
  CHECK(read_text(out / "ro.err") == "dptrain: error: " + (out / "mnt/filled").string() +
                                         ": cannot resume it here: the directory takes no writes "
                                         "(Read-only file system)\n");
  CHECK(read_text(out / "ro.out").empty());
}
