// A full disk during a checkpoint write, on a real small filesystem: a tmpfs mounted in a user +
// mount namespace (`unshare -Urm`, no real root needed, nothing left mounted) that holds two
// checkpoints of the run but not a third.
#include <doctest/doctest.h>

#include <sys/wait.h>

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
  CHECK(contains(launch_err, "not restarted: a checkpoint error would meet the next generation"));
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
