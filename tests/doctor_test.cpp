// `dptrain doctor` against the loopback sshd: all green, then one line per planted problem.
#include <doctest/doctest.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "core/data/dataset.hpp"
#include "launch/agent.hpp"
#include "tests/harness.hpp"
#include "tests/sshd.hpp"
#include "tests/strings.hpp"

using namespace dptrain::test;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

struct DoctorFixture {
  LoopbackSshd& sshd = LoopbackSshd::instance();
  TempDir tmp;
  fs::path hostfile = tmp / "hosts.txt";
  DoctorFixture() {
    sshd.write_hostfile(hostfile, {sshd.addresses()[1], sshd.addresses()[2]}, 2);
    auto p = run_dptrain(
        {"provision", "--hosts", hostfile.string(), "--known-hosts", sshd.known_hosts().string()});
    REQUIRE(p.exit_code == 0);
  }
  CommandResult doctor(std::vector<std::string> extra, const Env& env = {}) const {
    std::vector<std::string> args = {"doctor", "--hosts", hostfile.string(), "--known-hosts",
                                     sshd.known_hosts().string()};
    args.insert(args.end(), extra.begin(), extra.end());
    return run_dptrain(args, env);
  }
  // doctor with `extra` in a user and mount namespace of its own, after the shell commands
  // `setup` there (a mount the loopback hosts do not see): its exit status and output.
  std::pair<int, std::string> doctor_in_namespace(const std::string& setup,
                                                  const std::vector<std::string>& extra) const {
    std::string command = setup + " && exec '" + binary() + "' doctor --hosts '" +
                          hostfile.string() + "' --known-hosts '" + sshd.known_hosts().string() +
                          "'";
    for (const std::string& arg : extra)
      command += " '" + arg + "'";
    write_text(tmp / "doctor.sh", command + "\n");
    const int status =
        std::system(("timeout -s KILL 120 unshare -Urm bash '" + (tmp / "doctor.sh").string() +
                     "' >'" + (tmp / "out").string() + "' 2>&1")
                        .c_str());
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, read_text(tmp / "out")};
  }
};

// How a skip line of `check` starts: "skip CHECK      " (the check padded to 10).
std::string fmt_skip(const std::string& check) {
  return "skip " + check + std::string(check.size() < 10 ? 10 - check.size() : 0, ' ') + " ";
}

std::vector<std::string> failure_lines(const std::string& out) {
  std::vector<std::string> lines;
  std::istringstream in(out);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("FAIL", 0) == 0) lines.push_back(line);
  }
  return lines;
}

}  // namespace

TEST_CASE("doctor: all green on the loopback hosts, with a recipe and the all-reduce") {
  DoctorFixture f;
  const auto recipe = write_recipe(f.tmp.path(), small_recipe());
  auto r = f.doctor({recipe.string(), "--json"});
  INFO(r.out, r.err);
  CHECK(r.exit_code == 0);
  const json j = parse_json(r.out);
  CHECK(j["ok"] == true);
  std::set<std::string> seen;
  for (const auto& c : j["checks"])
    seen.insert(c["check"].get<std::string>());
  for (const char* c : {"ssh", "workdir", "version", "blas", "store-port", "peer-port", "recipe",
                        "data", "allreduce"}) {
    CAPTURE(c);
    CHECK(seen.count(c) == 1);
  }
  auto table = f.doctor({"--no-allreduce"});
  CHECK(table.exit_code == 0);
  CHECK(table.out.find("all checks passed") != std::string::npos);
  // A check left out is said to be, never dropped.
  CHECK(table.out.find("skip allreduce  not run: --no-allreduce") != std::string::npos);
}

TEST_CASE("doctor: a workdir that exists but cannot be written fails its check, saying why") {
  DoctorFixture f;
  // /proc/self exists on every host (mkdir -p passes) and takes no new file.
  auto r = f.doctor({"--workdir", "/proc/self"});
  INFO(r.out, r.err);
  CHECK(r.exit_code == 4);
  const auto fails = failure_lines(r.out);
  REQUIRE_FALSE(fails.empty());
  CHECK(fails.front().starts_with("FAIL workdir"));
  CHECK(fails.front().find("cannot use the workdir /proc/self on ") != std::string::npos);
  CHECK(fails.front().find(": cannot write in /proc/") != std::string::npos);
  CHECK(r.out.find("is writable") == std::string::npos);
  // A file where the run directories go (WORKDIR/runs) fails every launch: the check's too.
  const fs::path workdir = f.tmp / "wd";
  fs::create_directories(workdir);
  write_text(workdir / "runs", "x");
  auto runs = f.doctor({"--workdir", workdir.string(), "--no-allreduce"});
  INFO(runs.out);
  CHECK(runs.exit_code == 4);
  const auto runs_fails = failure_lines(runs.out);
  REQUIRE_FALSE(runs_fails.empty());
  CHECK(runs_fails.front().starts_with("FAIL workdir"));
  CHECK(contains(runs_fails.front(), (workdir / "runs").string() +
                                         " is not a directory (a job's run directories go there)"));
}

TEST_CASE("doctor: a GPU job on remote hosts alone needs no GPU on this machine") {
  DoctorFixture f;
  json gpu = small_recipe();
  gpu["train"]["device"] = "cuda";
  const auto recipe = write_recipe(f.tmp.path(), gpu, "gpu.json");
  // (No device visible here, also where the tests run on a GPU machine.)
  auto r = f.doctor({recipe.string(), "--no-allreduce", "--json"}, {{"CUDA_VISIBLE_DEVICES", ""}});
  INFO(r.out, r.err);
  bool remote_gpus = false;
  const json checks = parse_json(r.out)["checks"];
  for (const auto& c : checks) {
    CAPTURE(c.dump());
    CHECK(c["host"] != "localhost");  // no check of this machine's GPUs
    if (c["check"] == "gpus") remote_gpus = true;
  }
  CHECK(remote_gpus);  // the hosts' own are checked
}

TEST_CASE("doctor: the same version built otherwise passes, and says it is another build") {
  DoctorFixture f;
  // This build with one byte more: the same version, another file (provision would replace it).
  const fs::path other = f.tmp / "other build";
  fs::copy_file(binary(), other);
  { std::ofstream(other, std::ios::app) << '\n'; }
  fs::permissions(other, fs::perms::owner_all);
  auto r = f.doctor({"--remote-binary", other.string(), "--no-allreduce", "--json"});
  INFO(r.out, r.err);
  CHECK(r.exit_code == 0);
  int versions = 0;
  const json j = parse_json(r.out);
  for (const auto& c : j["checks"]) {
    if (c["check"] != "version") continue;
    ++versions;
    CHECK(c["ok"] == true);
    const auto detail = c["detail"].get<std::string>();
    CHECK(detail.starts_with("dptrain "));
    CHECK(contains(detail, ", another build than this machine's (sha256 "));
    CHECK(contains(detail, "... there, "));
  }
  CHECK(versions == 2);
  // The very file this machine runs: no such words.
  r = f.doctor({"--no-allreduce", "--json"});
  INFO(r.out, r.err);
  CHECK(r.exit_code == 0);
  CHECK_FALSE(contains(r.out, "another build"));
}

TEST_CASE("doctor: another build there fails the version check and holds back the probes") {
  DoctorFixture f;
  const fs::path fake = f.tmp / "old-dptrain";
  write_text(fake, "#!/bin/sh\necho 'dptrain 0.0.9'\n");
  fs::permissions(fake, fs::perms::owner_all);
  auto r = f.doctor({"--remote-binary", fake.string()});
  INFO(r.out, r.err);
  CHECK(r.exit_code == 4);
  const auto fails = failure_lines(r.out);
  REQUIRE(fails.size() == 2);  // one version line per host, nothing the old build answered
  for (const auto& line : fails) {
    CHECK(line.starts_with("FAIL version"));
    // provision would not put anything at --remote-binary's path: the fix says so.
    CHECK(line.ends_with("-- fix: install this build there, or name it with --remote-binary"));
  }
  CHECK(r.out.find(fmt_skip("peer-port")) != std::string::npos);
  CHECK(r.out.find("not run: its dptrain is another build") != std::string::npos);
}

TEST_CASE("doctor: one version whose agent speaks another protocol fails the version check") {
  DoctorFixture f;
  // What a build of this version from before agents said their protocol answers.
  const fs::path older = f.tmp / "older-build";
  write_script(older, "#!/bin/sh\necho '{\"version\":\"" DPTRAIN_VERSION
                      "\",\"cuda\":false,\"status\":\"ok\"}'\n");
  auto r = f.doctor({"--remote-binary", older.string()});
  INFO(r.out, r.err);
  CHECK(r.exit_code == 4);
  const auto fails = failure_lines(r.out);
  REQUIRE(fails.size() == 2);  // one version line per host
  for (const auto& line : fails) {
    CHECK(line.starts_with("FAIL version"));
    CHECK(contains(line, "dptrain " DPTRAIN_VERSION
                         " there is another build, whose agent speaks protocol 1 (this build's " +
                             std::to_string(dptrain::kAgentProtocol) +
                             "): it cannot run this machine's jobs"));
    CHECK(line.ends_with("-- fix: install this build there, or name it with --remote-binary"));
  }
  CHECK(r.out.find("not run: its dptrain is another build") != std::string::npos);
}

TEST_CASE("doctor: no dptrain in a --workdir: the fix provisions that workdir") {
  DoctorFixture f;
  // Provision installs WORKDIR/bin/dptrain: a fix without the doctor's --workdir would install
  // it in the default one, and the check would fail again.
  fs::path workdir = f.tmp / "empty work";
  bool made = true;
  SUBCASE("there, empty") {
    fs::create_directories(workdir);
  }
  SUBCASE("not there yet: doctor creates nothing") {
    workdir = f.tmp / "new work" / "below";
    made = false;
  }
  auto r = f.doctor({"--workdir", workdir.string(), "--no-allreduce"});
  INFO(r.out, r.err);
  CHECK(r.exit_code == 4);
  const auto fails = failure_lines(r.out);
  REQUIRE(fails.size() == 2);
  for (const auto& line : fails) {
    CHECK(line.starts_with("FAIL version"));
    CHECK(line.ends_with("-- fix: install it: dptrain provision --hosts ... --workdir '" +
                         workdir.string() + "'"));
  }
  CHECK(fs::exists(workdir) == made);
  CHECK(fs::exists(f.tmp / "new work") == false);
  CHECK(contains(r.out, made ? workdir.string() + " is writable"
                             : workdir.string() + " is not there yet (provision makes it); where "
                                                  "it goes takes writes"));
}

TEST_CASE("doctor: a trial all-reduce in a workdir not there yet leaves no directory behind") {
  DoctorFixture f;
  const fs::path workdir = f.tmp / "fresh" / "work";
  auto r = f.doctor({"--workdir", workdir.string(), "--remote-binary", binary()});
  INFO(r.out, r.err);
  CHECK(r.exit_code == 0);
  CHECK(contains(r.out, "met and all-reduced"));
  CHECK_FALSE(fs::exists(f.tmp / "fresh"));
}

TEST_CASE("doctor: a file where a workdir not there yet would go fails the workdir check") {
  DoctorFixture f;
  write_text(f.tmp / "plain", "x");
  const fs::path workdir = f.tmp / "plain" / "work";
  auto r = f.doctor({"--workdir", workdir.string(), "--no-allreduce"});
  INFO(r.out, r.err);
  CHECK(r.exit_code == 4);
  const auto fails = failure_lines(r.out);
  REQUIRE_FALSE(fails.empty());
  CHECK(fails.front().starts_with("FAIL workdir"));
  CHECK(contains(fails.front(),
                 (f.tmp / "plain").string() + " is not a directory (the workdir goes under it)"));
}

TEST_CASE("doctor: a binary there that lacks a library says so, not to provision it") {
  DoctorFixture f;
  const fs::path nolib = f.tmp / "nolib";
  write_text(nolib,
             "#!/bin/sh\necho \"$0: error while loading shared libraries: libgloo.so.0: cannot "
             "open shared object file: No such file or directory\" >&2\nexit 127\n");
  fs::permissions(nolib, fs::perms::owner_all);
  auto r = f.doctor({"--remote-binary", nolib.string()});
  INFO(r.out, r.err);
  CHECK(r.exit_code == 4);
  const auto fails = failure_lines(r.out);
  REQUIRE_FALSE(fails.empty());
  CHECK(fails.front().starts_with("FAIL version"));
  CHECK(fails.front().find("cannot start: error while loading shared libraries: libgloo.so.0") !=
        std::string::npos);
  CHECK(fails.front().find("install the libraries it needs on the host ('ldd ") !=
        std::string::npos);
  CHECK(r.out.find("dptrain provision") == std::string::npos);
}

TEST_CASE("doctor: a binary there that hangs fails the version check, not the workdir's") {
  DoctorFixture f;
  const fs::path hangs = f.tmp / "hangs";
  // It ignores timeout(1)'s SIGTERM as well: killed 5 s later, still named a hang.
  write_text(hangs, "#!/bin/sh\ntrap '' TERM\nsleep 600\n");
  fs::permissions(hangs, fs::perms::owner_all);
  // The probe's limit (30 s) shortened for the test.
  auto r = f.doctor({"--remote-binary", hangs.string()}, {{"DPTRAIN_TEST_VERSION_PROBE_S", "2"}});
  INFO(r.out, r.err);
  CHECK(r.exit_code == 4);
  const auto fails = failure_lines(r.out);
  REQUIRE(fails.size() == 2);  // one per host, and only the version check
  for (const auto& line : fails) {
    CHECK(line.starts_with("FAIL version"));
    CHECK(contains(line, "dptrain at " + hangs.string() +
                             " did not answer --version within 2 s (it hangs as it starts)"));
  }
  CHECK(contains(r.out, "not run: its dptrain does not answer"));
  CHECK(r.out.find("FAIL workdir") == std::string::npos);
}

TEST_CASE("doctor: a port probe that says no port in time is a slow host, not a refusal") {
  DoctorFixture f;
  // This build, except that '_probe listen' starts too slowly to say its port in time.
  const fs::path slow = f.tmp / "slow-listen";
  write_text(slow,
             "#!/bin/sh\nif [ \"$1\" = _probe ] && [ \"$2\" = listen ]; then sleep 8; fi\n"
             "exec '" +
                 binary() + "' \"$@\"\n");
  fs::permissions(slow, fs::perms::owner_all);
  auto r = f.doctor({"--remote-binary", slow.string(), "--no-allreduce"},
                    {{"DPTRAIN_TEST_VERSION_PROBE_S", "2"}});
  INFO(r.out, r.err);
  CHECK(r.exit_code == 4);
  const auto fails = failure_lines(r.out);
  REQUIRE(fails.size() == 2);  // one per host: its port probe
  for (const auto& line : fails) {
    CHECK(line.starts_with("FAIL peer-port"));
    CHECK(contains(line,
                   "no answer from the port probe: 'dptrain _probe listen' said no port "
                   "within 2 s -- fix: see what slows the host (its load, its disk), then "
                   "run doctor again"));
    CHECK_FALSE(contains(line, "cannot listen"));
  }
}

TEST_CASE("doctor: a binary that answers --version but hangs in a probe fails that probe") {
  DoctorFixture f;
  const fs::path hangs = f.tmp / "hangs-later";
  write_text(hangs, "#!/bin/sh\nif [ \"$1\" = --version ]; then exec '" + binary() +
                        "' \"$@\"; fi\nexec sleep 600\n");
  fs::permissions(hangs, fs::perms::owner_all);
  auto r = f.doctor({"--remote-binary", hangs.string()}, {{"DPTRAIN_TEST_VERSION_PROBE_S", "2"}});
  INFO(r.out, r.err);
  CHECK(r.exit_code == 4);
  const auto fails = failure_lines(r.out);
  REQUIRE(fails.size() == 2);  // one per host: the blas probe, not the host's ssh
  for (const auto& line : fails) {
    CHECK(line.starts_with("FAIL blas"));
    CHECK(contains(line, "dptrain at " + hangs.string() +
                             " did not finish '_probe blas' within 2 s (it hangs)"));
  }
  CHECK(contains(r.out, "ok   ssh"));
  CHECK(contains(r.out, "ok   version"));
  CHECK(contains(r.out, "not run: its dptrain does not answer"));
  // Ctrl-C while such a probe is waited for (at its full 30 s) stops doctor at once, exit 130.
  Background p({"doctor", "--hosts", f.hostfile.string(), "--known-hosts",
                f.sshd.known_hosts().string(), "--remote-binary", hangs.string()});
  REQUIRE(eventually([&] { return catches_signal(p.pid(), SIGINT); }));
  std::this_thread::sleep_for(std::chrono::seconds(3));  // the probes under way
  REQUIRE(::kill(p.pid(), SIGINT) == 0);
  const int code = p.wait(std::chrono::seconds(10));
  INFO(p.out(), p.err());
  CHECK(code == 130);
  CHECK(contains(p.err(), "dptrain: error: doctor stopped by SIGINT after "));
  // Past the version check: the stop came while the blas probe was waited for.
  CHECK(contains(p.out(), "ok   version"));
  CHECK_FALSE(contains(p.out(), "FAIL"));
}

TEST_CASE("doctor: a store port that cannot be used is one line naming it") {
  DoctorFixture f;
  // Hold a port on every address so doctor's store cannot listen there.
  std::optional<HeldPort> held(std::in_place, true);
  const std::string port = std::to_string(held->port());
  auto r = f.doctor({"--master-port", port});
  held.reset();
  INFO(r.out);
  CHECK(r.exit_code == 4);
  const auto lines = failure_lines(r.out);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].find("store-port") != std::string::npos);
  CHECK(lines[0].find(port) != std::string::npos);
  CHECK(lines[0].find("fix:") != std::string::npos);
  CHECK(r.out.find("skip allreduce") != std::string::npos);  // held back, not a second failure
}

TEST_CASE("doctor: a missing data file is one line naming it") {
  DoctorFixture f;
  auto recipe = small_recipe();
  recipe["model"] = {{"type", "mlp"}, {"input", 2}, {"hidden", {4}}, {"classes", 2}};
  recipe["data"] = {{"type", "csv"}, {"path", "missing.csv"}};
  const auto path = write_recipe(f.tmp.path(), recipe);
  auto r = f.doctor({path.string(), "--no-allreduce"});
  INFO(r.out);
  CHECK(r.exit_code == 2);  // missing here: the recipe is wrong, as launch would say
  const auto lines = failure_lines(r.out);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].find("missing.csv") != std::string::npos);
  CHECK(lines[0].find("/data/path") != std::string::npos);
}

TEST_CASE("doctor: the ssh check's fix fits the failure: a host key, or the key refused") {
  DoctorFixture f;
  const std::string address = f.sshd.addresses()[1];
  // Nothing in known_hosts: the host's key is unknown.
  write_text(f.tmp / "empty_known_hosts", "");
  write_text(f.tmp / "one.txt", address + " port=" + std::to_string(f.sshd.port()) + " user=" +
                                    f.sshd.user() + " key=" + f.sshd.client_key().string() + "\n");
  auto unknown = run_dptrain({"doctor", "--hosts", (f.tmp / "one.txt").string(), "--known-hosts",
                              (f.tmp / "empty_known_hosts").string(), "--no-allreduce"});
  CHECK(unknown.exit_code == 4);
  auto lines = failure_lines(unknown.out);
  REQUIRE(lines.size() == 1);
  CHECK_MESSAGE(lines[0].find("-- fix: put the host's key in known_hosts (ssh-keyscan), or give "
                              "--accept-new-host-keys for a new host") != std::string::npos,
                lines[0]);
  // Accepted, but not recorded: the known_hosts file cannot be made (not in /proc). The fix is
  // not the flag already given.
  auto unrecorded =
      run_dptrain({"doctor", "--hosts", (f.tmp / "one.txt").string(), "--known-hosts",
                   "/proc/self/dptrain_known_hosts", "--accept-new-host-keys", "--no-allreduce"});
  CHECK(unrecorded.exit_code == 4);
  lines = failure_lines(unrecorded.out);
  REQUIRE(lines.size() == 1);
  CHECK_MESSAGE(contains(lines[0], "cannot record the host key of "), lines[0]);
  CHECK_MESSAGE(contains(lines[0],
                         "-- fix: make the known_hosts file (and its directory) "
                         "writable, or give another --known-hosts"),
                lines[0]);
  // A changed key, which --accept-new-host-keys never takes: the fix does not offer it.
  f.sshd.write_known_hosts_with_changed_key(address, f.tmp / "changed_known_hosts");
  auto changed = run_dptrain({"doctor", "--hosts", (f.tmp / "one.txt").string(), "--known-hosts",
                              (f.tmp / "changed_known_hosts").string(), "--no-allreduce"});
  CHECK(changed.exit_code == 4);
  lines = failure_lines(changed.out);
  REQUIRE(lines.size() == 1);
  CHECK_MESSAGE(lines[0].find("CHANGED") != std::string::npos, lines[0]);
  CHECK_MESSAGE(lines[0].find("-- fix: find out why the host's key changed") != std::string::npos,
                lines[0]);
  CHECK(lines[0].find("--accept-new-host-keys") == std::string::npos);
  // A key the host does not authorize.
  write_text(f.tmp / "wrong.txt", address + " port=" + std::to_string(f.sshd.port()) + " user=" +
                                      f.sshd.user() + " key=" + f.sshd.wrong_key().string() + "\n");
  auto refused = run_dptrain({"doctor", "--hosts", (f.tmp / "wrong.txt").string(), "--known-hosts",
                              f.sshd.known_hosts().string(), "--no-allreduce"});
  CHECK(refused.exit_code == 4);
  lines = failure_lines(refused.out);
  REQUIRE(lines.size() == 1);
  CHECK_MESSAGE(lines[0].find("-- fix: authorize the key on the host (ssh-copy-id), or name the "
                              "right one") != std::string::npos,
                lines[0]);
  // A key file that cannot be used at all (the .pub given for the private key, one with a
  // passphrase, not a key): each says why, and the fix is not ssh-copy-id.
  const fs::path pub = f.tmp / "id.pub";
  write_text(pub, "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIJ0000000000000000000000000000 me@there\n");
  const fs::path locked = f.tmp / "locked";
  REQUIRE(std::system(("ssh-keygen -q -t ed25519 -N secret -f " + locked.string()).c_str()) == 0);
  const fs::path junk = f.tmp / "junk";
  write_text(junk, "not a key\n");
  fs::create_directories(f.tmp / "home");
  for (const auto& [key, why] : std::vector<std::pair<fs::path, std::string>>{
           {pub, "a public key, not a private key"},
           {locked, "passphrase-protected: load it into ssh-agent"},
           {junk, "not a private key file"}}) {
    write_text(f.tmp / "key.txt", address + " port=" + std::to_string(f.sshd.port()) +
                                      " user=" + f.sshd.user() + " key=" + key.string() + "\n");
    auto unusable = run_dptrain({"doctor", "--hosts", (f.tmp / "key.txt").string(), "--known-hosts",
                                 f.sshd.known_hosts().string(), "--no-allreduce"},
                                {{"HOME", (f.tmp / "home").string()}, {"SSH_AUTH_SOCK", ""}});
    CHECK(unusable.exit_code == 4);
    lines = failure_lines(unusable.out);
    REQUIRE(lines.size() == 1);
    CHECK_MESSAGE(contains(lines[0], key.string() + " (" + why + ")"), lines[0]);
    CHECK_MESSAGE(contains(lines[0],
                           "-- fix: name a private key file (not its .pub) that needs "
                           "no passphrase"),
                  lines[0]);
  }
  // A host key the known_hosts file revokes: no new key to accept.
  std::istringstream known(read_text(f.sshd.known_hosts()));
  std::string host_patterns, type, base64;
  known >> host_patterns >> type >> base64;
  REQUIRE_FALSE(base64.empty());
  write_text(f.tmp / "revoking",
             "@revoked * " + type + " " + base64 + "\n" + read_text(f.sshd.known_hosts()));
  auto revoked = run_dptrain({"doctor", "--hosts", (f.tmp / "one.txt").string(), "--known-hosts",
                              (f.tmp / "revoking").string(), "--no-allreduce"});
  CHECK(revoked.exit_code == 4);
  lines = failure_lines(revoked.out);
  REQUIRE(lines.size() == 1);
  CHECK_MESSAGE(contains(lines[0], "IS REVOKED"), lines[0]);
  CHECK_MESSAGE(contains(lines[0], "-- fix: find out why the host offers a revoked key"), lines[0]);
  CHECK_FALSE(contains(lines[0], "--accept-new-host-keys"));
}

TEST_CASE("doctor: an unreachable host is named, the others still checked") {
  DoctorFixture f;
  write_text(f.tmp / "mixed.txt",
             f.sshd.addresses()[1] + " port=" + std::to_string(f.sshd.port()) +
                 " user=" + f.sshd.user() + " key=" + f.sshd.client_key().string() + "\n" +
                 f.sshd.addresses()[2] + " port=" + std::to_string(unused_port()) + "\n");
  auto r = run_dptrain({"doctor", "--hosts", (f.tmp / "mixed.txt").string(), "--known-hosts",
                        f.sshd.known_hosts().string(), "--connect-timeout", "3"});
  INFO(r.out);
  CHECK(r.exit_code == 4);
  const auto lines = failure_lines(r.out);
  REQUIRE(lines.size() == 1);  // the rest is held back, not failed
  CHECK(lines[0].find("FAIL ssh") == 0);
  CHECK(lines[0].find(f.sshd.addresses()[2]) != std::string::npos);
  // The fix for a connection that is refused: the host and its sshd, not keys.
  CHECK(lines[0].ends_with(
      "-- fix: check the host is up and sshd listens on its port (port= in the hostfile)"));
  CHECK(r.out.find("ok   version") != std::string::npos);  // the good host was checked
  // The bad host's other checks are skip lines saying why, not missing.
  for (const char* check : {"workdir", "version", "blas", "store-port", "peer-port"}) {
    CAPTURE(check);
    bool found = false;
    std::istringstream in(r.out);
    for (std::string line; std::getline(in, line);) {
      found = found || (line.starts_with(fmt_skip(check)) &&
                        line.find(f.sshd.addresses()[2]) != std::string::npos &&
                        line.ends_with("not run: its ssh check failed"));
    }
    CHECK(found);
  }
  CHECK(r.out.find("skip allreduce  not run: fix the failures above first") != std::string::npos);

  // In JSON: ok null and skipped true on those, so `.ok == true` counts only what passed.
  auto j = run_dptrain({"doctor", "--hosts", (f.tmp / "mixed.txt").string(), "--known-hosts",
                        f.sshd.known_hosts().string(), "--connect-timeout", "3", "--json"});
  CHECK(j.exit_code == 4);
  int passed = 0, failed = 0, skipped = 0;
  const json report = parse_json(j.out);
  for (const auto& c : report["checks"]) {
    CAPTURE(c.dump());
    CHECK(c["skipped"] == c["ok"].is_null());
    passed += c["ok"] == true ? 1 : 0;
    failed += c["ok"] == false ? 1 : 0;
    skipped += c["skipped"] == true ? 1 : 0;
  }
  CHECK(failed == 1);
  CHECK(skipped == 8);  // recipe, data, workdir, version, blas, store-port, peer-port, allreduce
  CHECK(passed >= 4);   // the good host's ssh, workdir, version, store-port
  // The failure fields every command's JSON has.
  CHECK(report["exit_code"] == 4);
  CHECK(report["status"] == "error");
  REQUIRE(report["errors"].size() == 1);
  CHECK(report["errors"][0].get<std::string>().starts_with("ssh "));
  CHECK(report["errors"][0].get<std::string>().find(" -- fix:") == std::string::npos);
  CHECK(report["error"] == report["errors"][0]);
}

TEST_CASE("doctor: SIGINT stops it with exit 130 and the checks done so far, as --json says") {
  DoctorFixture f;
  Background p({"doctor", "--hosts", f.hostfile.string(), "--known-hosts",
                f.sshd.known_hosts().string(), "--json"});
  REQUIRE(eventually([&] { return catches_signal(p.pid(), SIGINT); }));
  REQUIRE(::kill(p.pid(), SIGINT) == 0);
  SUBCASE("once") {}
  SUBCASE("twice at once by one process, as timeout -s INT sends it: one stop") {
    // (Apart, so that the second is taken on its own: it is not a second Ctrl-C, which would
    // end doctor at once, without its report.)
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ::kill(p.pid(), SIGINT);
  }
  const int code = p.wait(std::chrono::seconds(60));
  INFO(p.err());
  CHECK(code == 130);
  const json out = parse_json(p.out());
  CHECK(out["status"] == "interrupted");
  CHECK(out["exit_code"] == 130);
  CHECK(out["ok"] == false);
  CHECK(out["checks"].is_array());
  CHECK(out["error"].get<std::string>().rfind("doctor stopped by SIGINT after ", 0) == 0);
  CHECK(p.err().find("dptrain: error: doctor stopped by SIGINT after ") != std::string::npos);
}

TEST_CASE("doctor: SIGINT during its trial job stops it and removes the job's directory") {
  // On this machine, with each step slowed, so that the trial job is under way when the
  // signal comes.
  TempDir tmp;  // the doctor's TMPDIR, where its trial run's directory appears
  Background p({"doctor", "--hosts", "localhost:2", "--json"},
               {{"DPTRAIN_DEBUG_STEP_DELAY_MS", "1000"}, {"TMPDIR", tmp.path().string()}});
  fs::path trial;
  REQUIRE(eventually([&] {
    std::error_code ec;
    for (const auto& entry : fs::directory_iterator(tmp.path(), ec)) {
      if (entry.path().filename().string().starts_with("dptrain-doctor-") &&
          fs::exists(entry.path() / "logs", ec)) {
        trial = entry.path();
        return true;
      }
    }
    return false;
  }));
  REQUIRE(::kill(p.pid(), SIGINT) == 0);
  CHECK(p.wait(std::chrono::seconds(60)) == 130);
  INFO(p.err());
  const json out = parse_json(p.out());
  CHECK(out["status"] == "interrupted");
  for (const auto& c : out["checks"])
    CHECK(c["check"] != "allreduce");  // stopped, not failed: no line for it
  CHECK_FALSE(fs::exists(trial));
}

TEST_CASE("doctor removes its trial run's directories on every host when it passes") {
  DoctorFixture f;
  fs::create_directories(f.tmp / "t");
  auto r = run_dptrain(
      {"doctor", "--hosts", f.hostfile.string(), "--known-hosts", f.sshd.known_hosts().string()},
      {{"TMPDIR", (f.tmp / "t").string()}});
  INFO(r.out, r.err);
  REQUIRE(r.exit_code == 0);
  CHECK(r.out.find("ok   allreduce") != std::string::npos);
  CHECK(fs::is_empty(f.tmp / "t"));
  for (const auto& address : {f.sshd.addresses()[1], f.sshd.addresses()[2]}) {
    CAPTURE(address);
    const fs::path runs = f.sshd.home(address) / ".dptrain/runs";
    CHECK(fs::is_directory(runs));  // the trial ran there
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(runs, ec)) {
      CAPTURE(e.path());
      CHECK(e.path().filename().string().find("dptrain-doctor-") == std::string::npos);
    }
  }
}

namespace {

// Doctor on this machine alone (two local slots, no SSH, no all-reduce): the recipe and data
// checks, as JSON. Only the recipe or its data can fail here: exit 2 then, else 0.
json local_doctor(const TempDir& tmp, const json& recipe) {
  const auto path = write_recipe(tmp.path(), recipe);
  auto r = run_dptrain({"doctor", "--hosts", "localhost:2", "--workdir", (tmp / "work").string(),
                        "--no-allreduce", "--json", path.string()});
  INFO(r.out, r.err);
  const json report = parse_json(r.out);
  CHECK(r.exit_code == (report["ok"] == true ? 0 : 2));
  CHECK(report["exit_code"] == r.exit_code);
  CHECK_FALSE(fs::exists(tmp / "work"));  // this machine's ranks use no workdir
  return report;
}

// A small gpt recipe whose token dataset is `path` (relative to the recipe).
json gpt_recipe_reading(const std::string& path) {
  auto recipe = small_recipe();
  recipe["model"] = {{"type", "gpt"}, {"vocab", 256}, {"context", 8},
                     {"layers", 1},   {"heads", 2},   {"width", 16}};
  recipe["data"] = {{"type", "tokens"}, {"path", path}};
  return recipe;
}

// The one check named `name` about this machine's view of the recipe (host null).
json check_named(const json& report, const std::string& name) {
  json found;
  for (const auto& c : report["checks"]) {
    if (c["check"] == name && c["host"].is_null()) {
      CHECK(found.is_null());
      found = c;
    }
  }
  REQUIRE_FALSE(found.is_null());
  return found;
}

json csv_recipe(const TempDir& tmp, const std::string& rows) {
  write_text(tmp / "d.csv", rows);
  auto recipe = small_recipe();
  recipe["model"] = {{"type", "mlp"}, {"input", 2}, {"hidden", {4}}, {"classes", 3}};
  recipe["data"] = {{"type", "csv"}, {"path", "d.csv"}, {"header", "no"}};
  recipe["train"]["batch_per_rank"] = 2;
  return recipe;
}

std::string many_rows(int n) {
  std::string rows;
  for (int i = 0; i < n; ++i)
    rows += std::to_string(i % 3) + "," + std::to_string(i) + ",1\n";
  return rows;
}

}  // namespace

TEST_CASE("doctor: the data check's fix fits what is wrong with the data") {
  TempDir tmp;
  const std::string more_data = "more data";
  SUBCASE("a label outside [0, classes) on a later row") {
    const json data =
        check_named(local_doctor(tmp, csv_recipe(tmp, many_rows(40) + "7,1,1\n")), "data");
    CAPTURE(data.dump());
    CHECK(data["ok"] == false);
    CHECK(data["detail"].get<std::string>().find(":41: label 7 is outside [0, 3)") !=
          std::string::npos);
    CHECK(data["fix"].get<std::string>().find("model.classes") != std::string::npos);
    CHECK(data["fix"].get<std::string>().find(more_data) == std::string::npos);
    // The recipe's own fields are right: its check says that much, not that all is valid.
    const json recipe =
        check_named(local_doctor(tmp, csv_recipe(tmp, many_rows(40) + "7,1,1\n")), "recipe");
    CHECK(recipe["ok"] == true);
    CHECK(recipe["detail"].get<std::string>().ends_with(": its fields are valid"));
  }
  SUBCASE("several wrong rows: a failed data line each") {
    const json report = local_doctor(tmp, csv_recipe(tmp, many_rows(40) + "7,1,1\n1,1,x\n"));
    std::vector<std::string> details, fixes;
    for (const auto& c : report["checks"]) {
      if (c["check"] == "data" && c["ok"] == false) {
        details.push_back(c["detail"]);
        fixes.push_back(c["fix"]);
      }
    }
    CAPTURE(report.dump());
    REQUIRE(details.size() == 2);
    CHECK(details[0].find(":41: label 7 is outside [0, 3)") != std::string::npos);
    CHECK(details[1].find(":42: column 3 'x' is not a finite number") != std::string::npos);
    // Each row's own fix.
    CHECK(fixes[0].find("model.classes") != std::string::npos);
    CHECK(fixes[1].find("model.classes") == std::string::npos);
    CHECK(fixes[1].find("fix the data file") != std::string::npos);
    // One host: the peer-port check cannot run, and says so rather than being left out.
    bool peer_port_skipped = false;
    for (const auto& c : report["checks"])
      peer_port_skipped = peer_port_skipped || (c["check"] == "peer-port" && c["skipped"] == true);
    CHECK(peer_port_skipped);
  }
  SUBCASE("more wrong rows than are listed: the last listed says how many more") {
    std::string wrong;
    for (int i = 0; i < 25; ++i)
      wrong += "7,1,1\n";
    const json report = local_doctor(tmp, csv_recipe(tmp, many_rows(40) + wrong));
    std::vector<std::string> details;
    for (const auto& c : report["checks"]) {
      if (c["check"] == "data" && c["ok"] == false) details.push_back(c["detail"]);
    }
    CAPTURE(report.dump());
    // One failed check per listed row, not one for the count.
    REQUIRE(details.size() == dptrain::kMostCsvProblems);
    CHECK(contains(details.back(), ":60: label 7 is outside [0, 3)"));
    CHECK(details.back().ends_with("; and 5 more row(s) with a problem, not listed"));
  }
  SUBCASE("a row with fewer columns than the first") {
    const json data =
        check_named(local_doctor(tmp, csv_recipe(tmp, many_rows(40) + "1,1\n")), "data");
    CAPTURE(data.dump());
    CHECK(data["ok"] == false);
    CHECK(data["detail"].get<std::string>().find("1 features, but model.input is 2") !=
          std::string::npos);
    CHECK(data["fix"].get<std::string>().find("model.input") != std::string::npos);
    CHECK(data["fix"].get<std::string>().find(more_data) == std::string::npos);
  }
  SUBCASE("a token dataset that is not there") {
    const json data = check_named(local_doctor(tmp, gpt_recipe_reading("no-such-dataset")), "data");
    CAPTURE(data.dump());
    CHECK(data["ok"] == false);
    CHECK(data["detail"].get<std::string>().find("no-such-dataset") != std::string::npos);
    CHECK(data["fix"].get<std::string>().find("dptrain data prepare") != std::string::npos);
    CHECK(data["fix"].get<std::string>().find("--force") == std::string::npos);
    CHECK(data["fix"].get<std::string>().find(more_data) == std::string::npos);
  }
  SUBCASE("a damaged token dataset, or a directory that holds something else") {
    // data prepare replaces a dataset only with --force, and writes into no other directory
    // that holds files: each fix says what works there.
    fs::create_directories(tmp / "damaged");
    write_text(tmp / "damaged" / "train.bin", "x");
    json data = check_named(local_doctor(tmp, gpt_recipe_reading("damaged")), "data");
    CAPTURE(data.dump());
    CHECK(data["ok"] == false);
    CHECK(data["fix"].get<std::string>().find("damaged --force'") != std::string::npos);
    fs::create_directories(tmp / "not-a-dataset");
    write_text(tmp / "not-a-dataset" / "notes.txt", "x\n");
    data = check_named(local_doctor(tmp, gpt_recipe_reading("not-a-dataset")), "data");
    CHECK(data["ok"] == false);
    const auto fix = data["fix"].get<std::string>();
    CHECK(fix.find("prepare a token dataset with 'dptrain data prepare --text FILE... --out "
                   "NEW_DIR' and point data.path at it (") != std::string::npos);
    CHECK(fix.find("not-a-dataset: not a token dataset") != std::string::npos);
    CHECK(fix.find(" --force'") == std::string::npos);  // not offered as the command's flag
  }
  SUBCASE("too few samples for one global batch") {
    const json data = check_named(local_doctor(tmp, csv_recipe(tmp, many_rows(3))), "data");
    CAPTURE(data.dump());
    CHECK(data["ok"] == false);
    CHECK(data["detail"].get<std::string>().find("fewer than one global batch") !=
          std::string::npos);
    CHECK(data["fix"].get<std::string>().find(more_data) != std::string::npos);
    auto synthetic = small_recipe();
    synthetic["data"]["samples"] = 20;
    const json small = check_named(local_doctor(tmp, synthetic), "data");
    CHECK(small["ok"] == false);
    CHECK(small["fix"].get<std::string>().find("raise data.samples") != std::string::npos);
  }
  SUBCASE("a first row that does not match model.input is a recipe problem") {
    const json report = local_doctor(tmp, csv_recipe(tmp, "0,1,2,3\n" + many_rows(40)));
    const json recipe = check_named(report, "recipe");
    CAPTURE(recipe.dump());
    CHECK(recipe["ok"] == false);
    CHECK(recipe["detail"].get<std::string>().find("/model/input: must match the 3 feature") !=
          std::string::npos);
    CHECK(recipe["fix"].get<std::string>().find("dptrain recipe validate") != std::string::npos);
  }
}

TEST_CASE("doctor --json: a fix only on the checks that failed; ok is null on a skipped one") {
  TempDir tmp;
  const json good = local_doctor(tmp, small_recipe());
  CHECK(good["ok"] == true);
  REQUIRE(good["checks"].size() >= 4);
  for (const auto& c : good["checks"]) {
    CAPTURE(c.dump());
    CHECK(c["fix"].is_null());
    if (c["skipped"] == true) {
      // Only the workdir, which this machine does not use, the peer ports, which one host
      // does not need, and the all-reduce left out; not counted as passed.
      CHECK(c["ok"].is_null());
      if (c["check"] == "workdir") {
        CHECK(c["detail"] == "not run: this machine starts its ranks directly and uses no workdir");
      } else if (c["check"] == "allreduce") {
        CHECK(c["detail"] == "not run: --no-allreduce");
      } else {
        CHECK(c["check"] == "peer-port");
        CHECK(c["detail"] == "not run: one host: no rank connects to another host");
      }
    } else {
      CHECK(c["ok"] == true);
    }
  }
  auto few = small_recipe();
  few["data"]["samples"] = 20;
  const json bad = local_doctor(tmp, few);
  CHECK(bad["ok"] == false);
  for (const auto& c : bad["checks"]) {
    CAPTURE(c.dump());
    CHECK(c["fix"].is_null() == (c["ok"] != false));
    if (c["ok"] == false) CHECK_FALSE(c["fix"].get<std::string>().empty());
    // A host-less check has host null, never "".
    CHECK((c["host"].is_null() || !c["host"].get<std::string>().empty()));
  }
}

TEST_CASE("doctor: a missing or invalid recipe exits 2, the data check a skip line naming why") {
  TempDir tmp;
  for (const bool missing : {true, false}) {
    CAPTURE(missing);
    fs::path recipe = tmp / "missing.json";
    if (!missing) {
      auto bad = small_recipe();
      bad["train"]["steps"] = -3;
      recipe = write_recipe(tmp.path(), bad, "bad.json");
    }
    auto r = run_dptrain(
        {"doctor", "--hosts", "localhost:2", "--no-allreduce", "--json", recipe.string()});
    INFO(r.out, r.err);
    CHECK(r.exit_code == 2);
    const json report = parse_json(r.out);
    CHECK(report["ok"] == false);
    const json recipe_check = check_named(report, "recipe");
    CHECK(recipe_check["ok"] == false);
    CHECK(recipe_check["detail"].get<std::string>().find(
              missing ? "missing.json" : "/train/steps") != std::string::npos);
    // A file that cannot be read is a path to fix, not a recipe to validate.
    CHECK(recipe_check["fix"] == (missing ? "give the recipe's right path (this file cannot be "
                                            "read)"
                                          : "correct the recipe ('dptrain recipe validate " +
                                                recipe.string() + "' lists every problem)"));
    const json data = check_named(report, "data");
    CHECK(data["ok"].is_null());
    CHECK(data["skipped"] == true);
    CHECK(data["detail"] == "not run: the recipe is not valid");
    CHECK(data["fix"].is_null());
    // On stderr too, as every command's errors: each of the JSON's errors on its line.
    std::string said;
    for (const auto& e : report["errors"])
      said += "dptrain: error: " + e.get<std::string>() + "\n";
    CHECK(r.err == said);
  }
  // And as lines: the recipe's FAIL, the data check's skip.
  auto table = run_dptrain(
      {"doctor", "--hosts", "localhost:2", "--no-allreduce", (tmp / "missing.json").string()});
  CHECK(table.exit_code == 2);
  CHECK(table.out.find("FAIL recipe") != std::string::npos);
  CHECK(table.out.find("skip data       not run: the recipe is not valid") != std::string::npos);
  // Bad usage is 2 as well.
  CHECK(run_dptrain({"doctor", "--hosts", "localhost:2", "--master-port", "70000"}).exit_code == 2);
}

TEST_CASE("doctor: a name that does not resolve is one FAIL whose fix is the name") {
  // A host: its ssh check fails, and the store's address, which would come from its name, is a
  // skip line rather than a second failure.
  auto host = run_dptrain({"doctor", "--hosts", "nosuch.invalid:1", "--connect-timeout", "3"});
  INFO(host.out);
  CHECK(host.exit_code == 4);
  auto lines = failure_lines(host.out);
  REQUIRE(lines.size() == 1);
  CHECK(lines[0].starts_with("FAIL ssh        nosuch.invalid: "));
  CHECK(
      lines[0].ends_with("-- fix: check the host's name: this machine cannot resolve it (a "
                         "typo, or a name DNS or /etc/hosts does not know)"));
  CHECK(contains(host.out,
                 "skip store-port nosuch.invalid: not run: no store address: it would "
                 "be nosuch.invalid's, whose ssh check failed"));
  // No recipe: its checks are skip lines, never left out.
  CHECK(contains(host.out,
                 "skip recipe     not run: no recipe given: give one to check it and "
                 "its data"));
  CHECK(contains(host.out, "skip data       not run: no recipe given"));
  // --master-addr: the fix is that address, not the port: one that does not resolve, and one
  // that resolves but is not this machine's, with any free port (the default).
  const std::vector<std::pair<std::string, std::string>> addresses = {
      {"nosuch.invalid",
       "correct --master-addr: give an address of this machine, or a name it resolves"},
      {"192.0.2.1", "give --master-addr an address of this machine"}};
  for (const auto& [address, fix] : addresses) {
    const auto addr = run_dptrain(
        {"doctor", "--hosts", "localhost:1", "--master-addr", address, "--no-allreduce"});
    INFO(addr.out);
    CHECK(addr.exit_code == 4);
    lines = failure_lines(addr.out);
    REQUIRE(lines.size() == 1);
    CHECK(lines[0].starts_with("FAIL store-port cannot listen on " + address + ":"));
    CHECK(lines[0].ends_with("-- fix: " + fix));
  }
}

TEST_CASE("doctor on this machine creates no workdir in $HOME and leaves no run directory") {
  TempDir tmp;
  fs::create_directories(tmp / "home");
  fs::create_directories(tmp / "t");
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  auto r = run_dptrain({"doctor", "--hosts", "localhost:2", recipe.string()},
                       {{"HOME", (tmp / "home").string()}, {"TMPDIR", (tmp / "t").string()}});
  INFO(r.out, r.err);
  CHECK(r.exit_code == 0);
  CHECK(r.out.find("skip workdir    localhost: not run: this machine starts its ranks directly") !=
        std::string::npos);
  CHECK(r.out.find("ok   allreduce") != std::string::npos);
  CHECK(r.out.find("all checks passed, 2 not run") != std::string::npos);
  CHECK(fs::is_empty(tmp / "home"));  // no ~/.dptrain
  CHECK(fs::is_empty(tmp / "t"));     // no dptrain-doctor-PID
}

TEST_CASE("doctor: a host where OpenBLAS cannot be loaded fails the blas check, naming the file") {
  TempDir tmp;
  const auto recipe = write_recipe(tmp.path(), small_recipe());
  auto good = run_dptrain({"doctor", "--hosts", "localhost:1", recipe.string(), "--no-allreduce"});
  INFO(good.out, good.err);
  CHECK(good.exit_code == 0);
  CHECK(good.out.find("ok   blas       localhost: OpenBLAS ") != std::string::npos);
  CHECK(good.out.find("libopenblas") != std::string::npos);  // the file it loaded

  const std::string missing = (tmp / "nowhere" / "libopenblas.so.0").string();
  const Env bad = {{"DPTRAIN_OPENBLAS_LIBRARY", missing}};
  auto r = run_dptrain({"doctor", "--hosts", "localhost:1", recipe.string(), "--json"}, bad);
  INFO(r.out, r.err);
  CHECK(r.exit_code == 4);
  const json j = parse_json(r.out);
  bool found = false;
  for (const auto& c : j["checks"]) {
    if (c["check"] != "blas") continue;
    found = true;
    CHECK(c["ok"] == false);
    CHECK(c["host"] == "localhost");
    const std::string detail = c["detail"];
    CHECK(detail.rfind(missing + " could not be loaded: ", 0) == 0);
    CHECK(c["fix"].get<std::string>().find("libopenblas0") != std::string::npos);
  }
  CHECK(found);
  CHECK(j["errors"][0].get<std::string>().rfind("blas localhost: " + missing, 0) == 0);

  // A launch there fails as its ranks start, naming the library and the setting.
  auto launch = run_dptrain({"launch", recipe.string(), "--nproc", "1", "--max-restarts", "0",
                             "--run-dir", (tmp / "run").string()},
                            bad);
  CHECK(launch.exit_code == 3);
  CHECK(launch.err.find(missing + " could not be loaded: ") != std::string::npos);
  CHECK(launch.err.find("or correct DPTRAIN_OPENBLAS_LIBRARY") != std::string::npos);

  // GPU ranks do not use OpenBLAS: no blas check.
  json gpu = small_recipe();
  gpu["train"]["device"] = "cuda";
  const auto gpu_recipe = write_recipe(tmp.path(), gpu, "gpu.json");
  auto g = run_dptrain(
      {"doctor", "--hosts", "localhost:1", gpu_recipe.string(), "--no-allreduce", "--json"}, bad);
  // (Named first: a range-for over a member of a temporary would read a destroyed object.)
  const json gpu_checks = parse_json(g.out)["checks"];
  REQUIRE_FALSE(gpu_checks.empty());
  for (const auto& c : gpu_checks)
    CHECK(c["check"] != "blas");

  // No GPU here: the gpu check fails, once; this machine's gpus check (GPUs per slot, for any
  // backend: each local rank gets one) is a skip line naming it.
  for (const std::string backend : {"auto", "nccl"}) {
    CAPTURE(backend);
    gpu["distributed"]["backend"] = backend;
    const auto file = write_recipe(tmp.path(), gpu, "gpu-" + backend + ".json");
    // (No device visible, also where the tests run on a GPU machine.)
    const auto checked =
        run_dptrain({"doctor", "--hosts", "localhost:2", file.string(), "--no-allreduce", "--json"},
                    {{"CUDA_VISIBLE_DEVICES", ""}});
    CHECK(checked.exit_code != 0);
    int failed = 0;
    bool gpus_skipped = false;
    const json checks = parse_json(checked.out)["checks"];
    for (const auto& c : checks) {
      CAPTURE(c.dump());
      if (c["ok"] == false) {
        ++failed;
        CHECK(c["check"] == "gpu");
      }
      if (c["check"] == "gpus") {
        gpus_skipped = c["ok"].is_null() && contains(c["detail"].get<std::string>(),
                                                     "the gpu check found no CUDA device");
      }
    }
    CHECK(failed == 1);
    CHECK(gpus_skipped);
  }
}

TEST_CASE(
    "doctor: a host whose copy of the CSV data is not the launcher's fails, as launch would") {
  // Namespaces unavailable is a broken test machine, said plainly, not a misleading failure.
  REQUIRE_MESSAGE(std::system("unshare -Urm true >/dev/null 2>&1") == 0,
                  "this test needs user and mount namespaces (unshare -Urm)");
  DoctorFixture f;
  const fs::path recipe = write_recipe(f.tmp.path(), csv_recipe(f.tmp, many_rows(40)));
  // The launcher sees other rows at the recipe's path (bound over it in a mount namespace of its
  // own); the loopback hosts see the file as written.
  write_text(f.tmp / "mine.csv", many_rows(41));
  const auto [status, out] = f.doctor_in_namespace(
      "mount --bind '" + (f.tmp / "mine.csv").string() + "' '" + (f.tmp / "d.csv").string() + "'",
      {recipe.string(), "--no-allreduce"});
  INFO(out);
  CHECK(status == 4);
  const auto lines = failure_lines(out);
  REQUIRE(lines.size() == 2);  // one per host
  for (const auto& line : lines) {
    CHECK(contains(line, (f.tmp / "d.csv").string() + " is not the launcher's data file (sha256 "));
    CHECK(contains(line,
                   "-- fix: put the same file there, or copy the launcher's again: dptrain "
                   "provision --hosts ... --recipe "));
  }
}

TEST_CASE("doctor: data a host lacks is named, and the fix keeps the doctor's --workdir") {
  REQUIRE_MESSAGE(std::system("unshare -Urm true >/dev/null 2>&1") == 0,
                  "this test needs user and mount namespaces (unshare -Urm)");
  DoctorFixture f;
  // The launcher sees the recipe and its data in a tmpfs of its own mount namespace; the
  // loopback hosts see that directory empty.
  const fs::path hidden = f.tmp / "hidden";
  fs::create_directories(hidden);
  write_recipe(f.tmp.path(), csv_recipe(f.tmp, many_rows(40)));
  const fs::path workdir = f.tmp / "my work";
  const auto [status, out] = f.doctor_in_namespace(
      "mount -t tmpfs none '" + hidden.string() + "' && cp '" + (f.tmp / "recipe.json").string() +
          "' '" + (f.tmp / "d.csv").string() + "' '" + hidden.string() + "/'",
      {(hidden / "recipe.json").string(), "--no-allreduce", "--workdir", workdir.string(),
       "--remote-binary", binary()});
  INFO(out);
  CHECK(status == 4);
  const auto lines = failure_lines(out);
  REQUIRE(lines.size() == 2);  // one per host
  for (const auto& line : lines) {
    CHECK(contains(line, "data file d.csv not found (looked at " + (hidden / "d.csv").string()));
    CHECK(contains(line, "-- fix: copy it there: dptrain provision --hosts ... --workdir '" +
                             workdir.string() + "' --recipe " + (hidden / "recipe.json").string()));
  }
}
