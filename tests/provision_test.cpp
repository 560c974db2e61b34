// `dptrain provision` through the real binary against the loopback sshd (127.0.0.2 and .3).
#include <doctest/doctest.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>

#include "launch/provision.hpp"
#include "tests/harness.hpp"
#include "tests/sshd.hpp"
#include "tests/strings.hpp"

using namespace dptrain::test;
using dptrain::sha256_file;
using dptrain::shell_quote;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

const std::vector<std::string> kFiles = {"bin/dptrain", "data/train.csv", "recipe.json",
                                         "notes.txt", "run.sh"};

// A csv recipe, its data and two extra files in `dir`; the provision arguments that upload them.
std::vector<std::string> upload_args(const fs::path& dir) {
  fs::create_directories(dir);
  std::ofstream csv(dir / "train.csv");
  csv << "label,f0,f1\n";
  for (int i = 0; i < 200; ++i)
    csv << i % 2 << "," << (i % 2) * 2.0 << "," << std::sin(i) << "\n";
  auto recipe = small_recipe();
  recipe["model"] = {{"type", "mlp"}, {"input", 2}, {"hidden", {8}}, {"classes", 2}};
  recipe["data"] = {{"type", "csv"}, {"path", "train.csv"}};
  write_recipe(dir, recipe);
  write_text(dir / "notes.txt", "notes\n");
  fs::permissions(dir / "notes.txt",
                  fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read);
  write_text(dir / "run.sh", "#!/bin/sh\necho hi\n");
  fs::permissions(dir / "run.sh", fs::perms::owner_all | fs::perms::group_read |
                                      fs::perms::group_exec | fs::perms::others_read |
                                      fs::perms::others_exec);
  return {"--recipe", (dir / "recipe.json").string(), "--upload", (dir / "notes.txt").string(),
          (dir / "run.sh").string()};
}

std::vector<std::string> provision_args(const fs::path& hostfile, const fs::path& known_hosts,
                                        std::vector<std::string> extra = {}) {
  std::vector<std::string> args = {
      "provision",         "--hosts", hostfile.string(), "--known-hosts", known_hosts.string(),
      "--connect-timeout", "5"};
  args.insert(args.end(), extra.begin(), extra.end());
  return args;
}

std::string status_of(const json& host, const std::string& file) {
  for (const auto& u : host["uploads"]) {
    if (u["file"] == file) return u["status"];
  }
  return "(not listed)";
}

std::string fingerprint_of(const fs::path& pub) {
  std::FILE* p = ::popen(("ssh-keygen -lf " + shell_quote(pub.string())).c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[512] = {};
  const size_t n = std::fread(buf, 1, sizeof buf - 1, p);
  ::pclose(p);
  std::string bits, fingerprint;
  std::istringstream(std::string(buf, n)) >> bits >> fingerprint;
  return fingerprint;
}

fs::perms mode_of(const fs::path& path) {
  return fs::status(path).permissions() & fs::perms::all;
}

std::string this_hostname() {
  char name[256] = {};
  ::gethostname(name, sizeof name - 1);
  return name;
}

// `provision` of upload_args' files (made in TMP/src) to the two loopback hosts (TMP/hosts).
std::vector<std::string> two_host_provision(const TempDir& tmp) {
  const auto& sshd = LoopbackSshd::instance();
  const fs::path hostfile = tmp / "hosts";
  sshd.write_hostfile(hostfile, {"127.0.0.2", "127.0.0.3"});
  return provision_args(hostfile, sshd.known_hosts(), upload_args(tmp / "src"));
}

}  // namespace

TEST_CASE("provision: facts and uploads on two hosts; a second run uploads nothing") {
  const auto& sshd = LoopbackSshd::instance();
  TempDir tmp;
  const auto plain = two_host_provision(tmp);
  auto args = plain;
  args.push_back("--json");

  auto first = run_dptrain(args);
  INFO(first.err);
  REQUIRE(first.exit_code == 0);
  const json report = parse_json(first.out);
  CHECK(report["ok"] == true);
  REQUIRE(report["hosts"].size() == 2);
  // In a pipe, a plain line as each upload starts (no progress line, no escapes).
  for (const char* address : {"127.0.0.2", "127.0.0.3"}) {
    CHECK(first.err.find(sshd.host(address).display() + ": uploading bin/dptrain (") !=
          std::string::npos);
  }
  CHECK(first.err.find('\r') == std::string::npos);
  for (size_t i = 0; i < 2; ++i) {
    const std::string address = i == 0 ? "127.0.0.2" : "127.0.0.3";
    const json& host = report["hosts"][i];
    CAPTURE(host.dump());
    CHECK(host["host"] == sshd.host(address).display());
    CHECK(host["ok"] == true);
    CHECK(host["error"].is_null());
    const json& facts = host["facts"];
    // The default workdir: ~/.dptrain in that host's own home.
    const fs::path workdir = fs::canonical(sshd.home(address)) / ".dptrain";
    CHECK(facts["workdir"] == workdir.string());
    CHECK(facts["hostname"] == this_hostname());
    CHECK(facts["os"].get<std::string>() != "");
    CHECK(facts["cpus"].get<int>() == static_cast<int>(::sysconf(_SC_NPROCESSORS_ONLN)));
    CHECK(facts["memory_bytes"].get<uint64_t>() > 0);
    CHECK(facts["disk_free_bytes"].get<uint64_t>() > 0);
    CHECK(facts["gpus"].is_array());
    CHECK(facts["dptrain_version"] == DPTRAIN_VERSION);
    for (const auto& file : kFiles) {
      CAPTURE(file);
      CHECK(status_of(host, file) == "uploaded");
    }
    for (const auto& u : host["uploads"])
      CHECK(u["seconds"].get<double>() > 0);
    CHECK(sha256_file(workdir / "bin/dptrain") == sha256_file(binary()));
    CHECK(mode_of(workdir / "bin/dptrain") ==
          (fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
           fs::perms::others_read | fs::perms::others_exec));
    CHECK(read_text(workdir / "data/train.csv") == read_text(tmp / "src/train.csv"));
    CHECK(mode_of(workdir / "notes.txt") == mode_of(tmp / "src/notes.txt"));
    CHECK(mode_of(workdir / "run.sh") == mode_of(tmp / "src/run.sh"));
    // The uploaded recipe points at the uploaded data and validates where it is.
    CHECK(parse_json(read_text(workdir / "recipe.json"))["data"]["path"] == "data/train.csv");
    CHECK(run_dptrain({"recipe", "validate", (workdir / "recipe.json").string()}).exit_code == 0);
  }

  // The table, this time: nothing to upload anywhere.
  auto second = run_dptrain(plain);
  INFO(second.err);
  REQUIRE(second.exit_code == 0);
  for (const char* address : {"127.0.0.2", "127.0.0.3"}) {
    const std::string display = sshd.host(address).display();
    const auto row = second.out.find(display);
    REQUIRE(row != std::string::npos);
    const std::string line = second.out.substr(row, second.out.find('\n', row) - row);
    CHECK(line.find(" ok ") != std::string::npos);
    CHECK(line.find("0 uploaded (0 B), 5 skipped") != std::string::npos);
  }
  CHECK(second.err.find("uploading") == std::string::npos);
}

TEST_CASE("provision on a terminal: one progress line whose total is fixed and share only grows") {
  TempDir tmp;
  // A new workdir on each host (relative: in that host's home), so that every file goes.
  auto args = two_host_provision(tmp);
  args.insert(args.end(), {"--workdir", "wd-" + tmp.path().filename().string()});
  const auto r = run_dptrain_on_terminal(args);
  INFO(r.out);
  REQUIRE(r.exit_code == 0);
  const std::regex shown(R"(uploading: ([0-9.]+ [A-Za-z]+) of ([0-9.]+ [A-Za-z]+) \(([0-9]+)%\))");
  std::vector<std::string> totals;
  std::vector<int> shares;
  for (auto it = std::sregex_iterator(r.out.begin(), r.out.end(), shown);
       it != std::sregex_iterator(); ++it) {
    totals.push_back((*it)[2].str());
    shares.push_back(std::stoi((*it)[3].str()));
  }
  REQUIRE_FALSE(shares.empty());
  CHECK(std::all_of(totals.begin(), totals.end(), [&](const auto& t) { return t == totals[0]; }));
  CHECK(std::is_sorted(shares.begin(), shares.end()));
}

TEST_CASE("provision: a refused key is exit 4 naming that host; the other host is provisioned") {
  const auto& sshd = LoopbackSshd::instance();
  TempDir tmp;
  const fs::path hostfile = tmp / "hosts";
  sshd.write_hostfile(hostfile, {"127.0.0.2"});
  const std::string bad = "127.0.0.3 port=" + std::to_string(sshd.port()) + " user=" + sshd.user() +
                          " key=" + sshd.wrong_key().string() + "\n";
  write_text(hostfile, read_text(hostfile) + bad);
  auto r = run_dptrain(provision_args(hostfile, sshd.known_hosts(),
                                      {"--workdir", (tmp / "work").string(), "--json"}));
  CHECK(r.exit_code == 4);
  const std::string display = sshd.host("127.0.0.3").display();
  CHECK(r.err.find("dptrain: error: authentication refused for " + display + " (tried: ") !=
        std::string::npos);
  CHECK(r.err.find(sshd.wrong_key().string()) != std::string::npos);
  // Only the failed host is an error (the other shows only in its upload lines).
  CHECK(r.err.find("dptrain: error: " + sshd.host("127.0.0.2").display()) == std::string::npos);
  CHECK(r.err.find("error: 127.0.0.2") == std::string::npos);
  const json report = parse_json(r.out);
  CHECK(report["ok"] == false);
  CHECK(report["hosts"][0]["ok"] == true);
  CHECK(report["hosts"][1]["ok"] == false);
  CHECK(report["hosts"][1]["facts"].is_null());
  CHECK(report["hosts"][1]["error"].get<std::string>().find(display) != std::string::npos);
}

TEST_CASE("provision: a changed host key is refused, naming both fingerprints") {
  const auto& sshd = LoopbackSshd::instance();
  TempDir tmp;
  const fs::path hostfile = tmp / "hosts";
  sshd.write_hostfile(hostfile, {"127.0.0.2"});
  sshd.write_known_hosts_with_changed_key("127.0.0.2", tmp / "known_hosts");
  auto r =
      run_dptrain(provision_args(hostfile, tmp / "known_hosts",
                                 {"--workdir", (tmp / "work").string(), "--accept-new-host-keys"}));
  CHECK(r.exit_code == 4);
  CAPTURE(r.err);
  CHECK(r.err.find("HOST KEY OF " + sshd.host("127.0.0.2").display() + " CHANGED") !=
        std::string::npos);
  CHECK(r.err.find(fingerprint_of(sshd.changed_host_public_key())) != std::string::npos);
  CHECK(r.err.find(fingerprint_of(sshd.host_public_key())) != std::string::npos);
  CHECK(r.out.find("FAILED") != std::string::npos);
  CHECK_FALSE(fs::exists(tmp / "work"));
}

TEST_CASE("provision: an unreachable port is reported within the connect timeout") {
  const auto& sshd = LoopbackSshd::instance();
  TempDir tmp;
  // One port refuses; the other accepts TCP but never speaks SSH.
  std::optional<HeldPort> silent(std::in_place, false);
  const uint16_t silent_port = silent->port();
  const uint16_t closed_port = unused_port();
  write_text(tmp / "hosts", "127.0.0.1 port=" + std::to_string(closed_port) + "\n" +
                                "127.0.0.1 port=" + std::to_string(silent_port) + "\n");
  auto r = run_dptrain({"provision", "--hosts", (tmp / "hosts").string(), "--known-hosts",
                        sshd.known_hosts().string(), "--connect-timeout", "1", "--json"});
  silent.reset();
  CHECK(r.exit_code == 4);
  CAPTURE(r.err);
  // The refusal at once; the silent port once the timeout ran out.
  CHECK(r.err.find("cannot connect to 127.0.0.1:" + std::to_string(closed_port) +
                   ": Connection refused") != std::string::npos);
  CHECK(r.err.find("cannot connect to 127.0.0.1:" + std::to_string(silent_port) + ": its port " +
                   std::to_string(silent_port) +
                   " takes TCP connections, but no SSH server answered there within 1s") !=
        std::string::npos);
  CHECK(r.seconds < 15);  // both hosts in parallel, each bounded by the 1 s timeout: no hang
  // The failure fields of every --json command, and each host lists what it did not get.
  const auto report = parse_json(r.out);
  CHECK(report["ok"] == false);
  CHECK(report["status"] == "error");
  CHECK(report["exit_code"] == 4);
  REQUIRE(report["errors"].size() == 2);
  CHECK(report["error"] == report["errors"][0]);
  for (const auto& host : report["hosts"]) {
    REQUIRE(host["uploads"].size() == 1);
    CHECK(host["uploads"][0]["file"] == "bin/dptrain");
    CHECK(host["uploads"][0]["status"] == "pending");
  }
}

// Whether some socket here has a TCP connection made to 127.0.0.1:`port` (/proc/net/tcp: a
// client's end, ESTABLISHED), as a connect under way to a port that accepts and never speaks.
bool connected_to(uint16_t port) {
  std::ifstream table("/proc/net/tcp");
  std::string line;
  std::getline(table, line);  // the header
  const std::string remote = fmt::format("0100007F:{:04X}", port);
  while (std::getline(table, line)) {
    std::istringstream fields(line);
    std::string slot, local, peer, state;
    fields >> slot >> local >> peer >> state;
    if (peer == remote && state == "01") return true;
  }
  return false;
}

TEST_CASE("provision and doctor: SIGINT while a host is being connected to ends it at once") {
  const auto& sshd = LoopbackSshd::instance();
  TempDir tmp;
  // The port accepts TCP and never speaks SSH: the connection would wait its whole minute.
  std::optional<HeldPort> silent(std::in_place, false);
  write_text(tmp / "hosts", "127.0.0.1 port=" + std::to_string(silent->port()) + "\n");
  for (const char* command : {"provision", "doctor"}) {
    CAPTURE(command);
    Background run({command, "--hosts", (tmp / "hosts").string(), "--known-hosts",
                    sshd.known_hosts().string(), "--connect-timeout", "60", "--json"});
    // Once the connection is made, waiting for the server's greeting.
    REQUIRE(eventually([&] { return connected_to(silent->port()); }));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    const auto sent = std::chrono::steady_clock::now();
    REQUIRE(::kill(run.pid(), SIGINT) == 0);
    CHECK(run.wait(std::chrono::seconds(90)) == 130);
    // A bound against waiting out the connection (60 s), not a speed assertion.
    CHECK(std::chrono::steady_clock::now() - sent < std::chrono::seconds(30));
    INFO(run.err());
    const auto report = parse_json(run.out());
    CHECK(report["status"] == "interrupted");
    CHECK(report["ok"] == false);
    // What the stop cut short is said, and the host is not blamed for it.
    const std::string cut_short = "stopped by SIGINT while connecting (no SSH answer yet after ";
    if (std::string(command) == "provision") {
      const std::string error = report["hosts"][0]["error"];
      CHECK(contains(error, cut_short));
      CHECK(contains(error, "of --connect-timeout 60s; nothing was done there)"));
    } else {
      json ssh;
      for (const auto& check : report["checks"]) {
        if (check["check"] == "ssh") ssh = check;
      }
      REQUIRE(ssh.is_object());
      CHECK(ssh["skipped"] == true);
      CHECK(ssh["fix"].is_null());
      CHECK(contains(ssh["detail"].get<std::string>(), cut_short));
      CHECK_FALSE(contains(run.out(), "check the host is up"));
      // Every check listed was skipped: none had run.
      CHECK(report["error"] == "doctor stopped by SIGINT after 0 check(s)");
    }
  }
  // A table's line for a host stopped so says so, not that it failed.
  Background plain({"provision", "--hosts", (tmp / "hosts").string(), "--known-hosts",
                    sshd.known_hosts().string(), "--connect-timeout", "60"});
  REQUIRE(eventually([&] { return connected_to(silent->port()); }));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  REQUIRE(::kill(plain.pid(), SIGINT) == 0);
  CHECK(plain.wait(std::chrono::seconds(90)) == 130);
  CHECK(contains(plain.out(), "STOPPED"));
  CHECK_FALSE(contains(plain.out(), "FAILED"));
}

TEST_CASE("provision: SIGINT mid-upload stops it: exit 130, the report so far, nothing partial") {
  const auto& sshd = LoopbackSshd::instance();
  TempDir tmp;
  const std::string address = sshd.addresses()[1];
  sshd.write_hostfile(tmp / "hosts", {address});
  // Large enough that the upload is under way when the signal comes (a sparse file: no disk).
  const fs::path big = tmp / "big.bin";
  {
    std::ofstream out(big, std::ios::binary);
    out.seekp((std::streamoff{1} << 30) - 1);
    out.put('\0');
  }
  const fs::path workdir = tmp / "work";
  Background p(provision_args(tmp / "hosts", sshd.known_hosts(),
                              {"--workdir", workdir.string(), "--upload", big.string(), "--json"}));
  REQUIRE(eventually([&] { return p.err().find("uploading big.bin") != std::string::npos; }));
  REQUIRE(::kill(p.pid(), SIGINT) == 0);
  const int code = p.wait(std::chrono::seconds(60));
  INFO(p.err());
  CHECK(code == 130);
  const json report = parse_json(p.out());
  CHECK(report["status"] == "interrupted");
  CHECK(report["exit_code"] == 130);
  CHECK(report["ok"] == false);
  CHECK(report["error"] == "provision stopped by SIGINT");
  REQUIRE(report["hosts"].size() == 1);
  const json& host = report["hosts"][0];
  CHECK(host["ok"] == false);
  CHECK(host["error"].get<std::string>().find("stopped by SIGINT while uploading big.bin") !=
        std::string::npos);
  CHECK(status_of(host, "big.bin") == "pending");
  CHECK(status_of(host, "bin/dptrain") == "uploaded");
  CHECK(p.err().find("dptrain: error: provision stopped by SIGINT") != std::string::npos);
  // Nothing partial is left: neither the file nor its temporary (the remote shell removes it).
  CHECK(eventually([&] {
    for (const auto& e : fs::directory_iterator(workdir)) {
      if (e.path().filename().string().rfind("big.bin", 0) == 0) return false;
    }
    return true;
  }));
}

TEST_CASE("provision: an unknown host is refused; --accept-new-host-keys accepts and records") {
  const auto& sshd = LoopbackSshd::instance();
  TempDir tmp;
  const fs::path hostfile = tmp / "hosts";
  sshd.write_hostfile(hostfile, {"127.0.0.2", "127.0.0.3"});
  const fs::path known_hosts = tmp / "known_hosts";
  write_text(known_hosts, "");
  const std::vector<std::string> workdir = {"--workdir", (tmp / "work").string()};
  auto refused = run_dptrain(provision_args(hostfile, known_hosts, workdir));
  CHECK(refused.exit_code == 4);
  for (const char* address : {"127.0.0.2", "127.0.0.3"}) {
    CHECK(refused.err.find("host key of " + sshd.host(address).display() +
                           " is not in known_hosts " + known_hosts.string()) != std::string::npos);
  }
  CHECK(read_text(known_hosts).empty());

  auto w = workdir;
  w.push_back("--accept-new-host-keys");
  auto accepted = run_dptrain(provision_args(hostfile, known_hosts, w));
  INFO(accepted.err);
  CHECK(accepted.exit_code == 0);
  const std::string recorded = read_text(known_hosts);
  for (const char* address : {"127.0.0.2", "127.0.0.3"}) {
    CHECK(recorded.find(std::string("[") + address + "]:" + std::to_string(sshd.port())) !=
          std::string::npos);
  }
  CHECK(run_dptrain(provision_args(hostfile, known_hosts, workdir)).exit_code == 0);
}

TEST_CASE("provision: localhost is provisioned in-process, without SSH") {
  TempDir tmp;
  const auto uploads = upload_args(tmp / "src");
  std::vector<std::string> args = {
      "provision", "--hosts", "localhost", "--known-hosts", (tmp / "none").string(), "--json"};
  args.insert(args.end(), uploads.begin(), uploads.end());
  const Env env = {{"HOME", (tmp / "home").string()}, {"SSH_AUTH_SOCK", ""}};
  fs::create_directories(tmp / "home");
  auto first = run_dptrain(args, env);
  INFO(first.err);
  REQUIRE(first.exit_code == 0);
  const json host = parse_json(first.out)["hosts"][0];
  const fs::path workdir = fs::canonical(tmp / "home") / ".dptrain";
  CHECK(host["ok"] == true);
  CHECK(host["facts"]["workdir"] == workdir.string());
  CHECK(host["facts"]["dptrain_version"] == DPTRAIN_VERSION);
  for (const auto& file : kFiles)
    CHECK(status_of(host, file) == "uploaded");
  CHECK(sha256_file(workdir / "bin/dptrain") == sha256_file(binary()));
  CHECK(mode_of(workdir / "run.sh") == mode_of(tmp / "src/run.sh"));

  const json again = parse_json(run_dptrain(args, env).out)["hosts"][0];
  for (const auto& file : kFiles)
    CHECK(status_of(again, file) == "skipped");
  CHECK(again["uploads"][2]["local"] == (tmp / "src/recipe.json").string());  // not a temp copy

  // Same content with other permissions (a lost exec bit): repaired without an upload.
  const auto binary_mode = mode_of(workdir / "bin/dptrain");
  fs::permissions(workdir / "bin/dptrain", fs::perms::owner_read | fs::perms::owner_write);
  fs::permissions(workdir / "run.sh", fs::perms::owner_read);
  const json repaired = parse_json(run_dptrain(args, env).out)["hosts"][0];
  CHECK(repaired["ok"] == true);
  for (const auto& file : kFiles)
    CHECK(status_of(repaired, file) == "skipped");
  CHECK(mode_of(workdir / "bin/dptrain") == binary_mode);
  CHECK(mode_of(workdir / "run.sh") == mode_of(tmp / "src/run.sh"));

  // An upload cut off without its cleanup (killed outright) leaves a temporary file: removed
  // by a later provision once an hour old; a recent one may be another provision's, kept.
  const fs::path stale = workdir / "bin/dptrain.tmp-0123456789ab";
  const fs::path recent = workdir / "bin/dptrain.tmp-ba9876543210";
  write_text(stale, "partial");
  write_text(recent, "partial");
  fs::last_write_time(stale, fs::last_write_time(stale) - std::chrono::hours(2));
  CHECK(parse_json(run_dptrain(args, env).out)["hosts"][0]["ok"] == true);
  CHECK_FALSE(fs::exists(stale));
  CHECK(fs::exists(recent));

  // A relative workdir is the home directory's, as on a host over SSH (not the current
  // directory's).
  const auto relative =
      run_dptrain({"provision", "--hosts", "localhost", "--workdir", "relative-wd", "--json"}, env);
  INFO(relative.err);
  CHECK(relative.exit_code == 0);
  CHECK(fs::exists(tmp / "home/relative-wd/bin/dptrain"));
  CHECK_FALSE(fs::exists(fs::current_path() / "relative-wd"));

  auto unwritable = run_dptrain({"provision", "--hosts", "localhost", "--workdir", "/proc/nope"});
  CHECK(unwritable.exit_code == 4);
  CHECK(unwritable.err.find("cannot use the workdir /proc/nope on localhost") != std::string::npos);
}

TEST_CASE("provision: a token dataset's relative data.path is absolute in the uploaded recipe") {
  TempDir tmp;
  fs::create_directories(tmp / "src");
  std::string text;
  for (int i = 0; i < 200; ++i)
    text += "the quick brown fox jumps over the lazy dog " + std::to_string(i) + "\n";
  write_text(tmp / "src/text.txt", text);
  REQUIRE(run_dptrain({"data", "prepare", "--text", (tmp / "src/text.txt").string(), "--out",
                       (tmp / "src/ds").string(), "--tokenizer", "char"})
              .exit_code == 0);
  json recipe = small_recipe();
  recipe["model"] = {{"type", "gpt"}, {"vocab", 64}, {"context", 16},
                     {"layers", 1},   {"heads", 2},  {"width", 16}};
  recipe["data"] = {{"type", "tokens"}, {"path", "ds"}};  // beside the recipe, not the workdir
  write_recipe(tmp / "src", recipe);
  const fs::path workdir = tmp / "work";
  const auto r = run_dptrain({"provision", "--hosts", "localhost", "--workdir", workdir.string(),
                              "--recipe", (tmp / "src/recipe.json").string()});
  INFO(r.err);
  REQUIRE(r.exit_code == 0);
  const json uploaded = parse_json(read_text(workdir / "recipe.json"));
  CHECK(uploaded["data"]["path"] == fs::canonical(tmp / "src/ds").string());
  CHECK(uploaded["model"] == recipe["model"]);
  // As it stands there, it finds the dataset.
  CHECK(run_dptrain({"recipe", "validate", (workdir / "recipe.json").string()}).exit_code == 0);
}

TEST_CASE("provision: a missing upload or a bad recipe is a usage error before any host") {
  TempDir tmp;
  // The host is unreachable: an exit 2 shows the local problem was found first.
  write_text(tmp / "hosts", "127.0.0.1 port=" + std::to_string(unused_port()) + "\n");
  auto missing = run_dptrain(
      {"provision", "--hosts", (tmp / "hosts").string(), "--upload", (tmp / "nope.txt").string()});
  CHECK(missing.exit_code == 2);
  CHECK(missing.err.find("dptrain: error: --upload " + (tmp / "nope.txt").string() +
                         ": no such file") != std::string::npos);
  fs::create_directories(tmp / "dir");
  auto dir = run_dptrain(
      {"provision", "--hosts", (tmp / "hosts").string(), "--upload", (tmp / "dir").string()});
  CHECK(dir.exit_code == 2);
  CHECK(dir.err.find("dir: is a directory; name the files in it") != std::string::npos);
  // A file named as one of the workdir's directories would land inside it, not be installed.
  for (const char* name : {"bin", "runs"}) {
    CAPTURE(name);
    fs::create_directories(tmp / "files");
    write_text(tmp / "files" / name, "x\n");
    auto taken = run_dptrain({"provision", "--hosts", (tmp / "hosts").string(), "--upload",
                              (tmp / "files" / name).string()});
    CHECK(taken.exit_code == 2);
    CHECK(taken.err == "dptrain: error: --upload " + (tmp / "files" / name).string() +
                           ": WORKDIR/" + name +
                           " is a directory dptrain uses there; upload the file under another "
                           "name\n");
  }
  // A name the host's one-a-line listing cannot hold: refused, not uploaded again every time.
  write_text(tmp / "files" / "two\nlines.txt", "x\n");
  auto newline = run_dptrain({"provision", "--hosts", (tmp / "hosts").string(), "--upload",
                              (tmp / "files" / "two\nlines.txt").string()});
  CHECK(newline.exit_code == 2);
  CHECK_MESSAGE(newline.err == "dptrain: error: --upload " + (tmp / "files").string() +
                                   "/two\\x0alines.txt: its name holds a control character (a "
                                   "line break?); rename the file\n",
                newline.err);
  // SSH files named that are not there: exit 2 naming the flag or the line, before any host.
  auto identity = run_dptrain(
      {"provision", "--hosts", (tmp / "hosts").string(), "--identity", (tmp / "nokey").string()});
  CHECK(identity.exit_code == 2);
  CHECK(identity.err ==
        "dptrain: error: --identity " + (tmp / "nokey").string() + ": no such file\n");
  write_text(tmp / "keyed", "127.0.0.1 key=nokey port=" + std::to_string(unused_port()) + "\n");
  auto key = run_dptrain({"provision", "--hosts", (tmp / "keyed").string()});
  CHECK(key.exit_code == 2);
  CHECK(key.err == "dptrain: error: " + (tmp / "keyed").string() +
                       ":1: key=" + (tmp / "nokey").string() + ": no such file\n");
  auto known = run_dptrain(
      {"provision", "--hosts", (tmp / "hosts").string(), "--known-hosts", tmp.path().string()});
  CHECK(known.exit_code == 2);
  CHECK(known.err.starts_with("dptrain: error: --known-hosts " + tmp.path().string() +
                              ": is a directory"));
  write_text(tmp / "bad.json", "{\"model\": 3}");
  auto bad = run_dptrain(
      {"provision", "--hosts", (tmp / "hosts").string(), "--recipe", (tmp / "bad.json").string()});
  CHECK(bad.exit_code == 2);
  CHECK(bad.err.find("bad.json") != std::string::npos);
  // --json: "ok" on every answer, as ckpt verify's, the arguments' refusal included (doctor's
  // too).
  auto bad_json = run_dptrain({"provision", "--hosts", (tmp / "hosts").string(), "--recipe",
                               (tmp / "bad.json").string(), "--json"});
  CHECK(bad_json.exit_code == 2);
  CHECK(parse_json(bad_json.out)["ok"] == false);
  for (const char* command : {"provision", "doctor"}) {
    CAPTURE(command);
    const auto usage = run_dptrain({command, "--hosts", "localhost", "--bogus", "--json"});
    CHECK(usage.exit_code == 2);
    const auto out = parse_json(usage.out);
    CHECK(out["ok"] == false);
    CHECK(out["status"] == "error");
  }
}

TEST_CASE("provision: not enough free disk in the workdir is reported as disk full") {
  TempDir tmp;
  // A df that reports 4 KiB available, found first on the PATH of the in-process "host".
  fs::create_directories(tmp / "bin");
  write_text(tmp / "bin/df",
             "#!/bin/sh\necho 'Filesystem 1024-blocks Used Available Capacity Mounted on'\n"
             "echo 'fake 100 96 4 96% /'\n");
  fs::permissions(tmp / "bin/df", fs::perms::owner_all);
  const Env env = {{"PATH", (tmp / "bin").string() + ":" + std::getenv("PATH")}};
  auto r = run_dptrain(
      {"provision", "--hosts", "localhost", "--workdir", (tmp / "work").string(), "--json"}, env);
  CHECK(r.exit_code == 4);
  CAPTURE(r.err);
  CHECK(r.err.find("disk full on localhost") != std::string::npos);
  CHECK(r.err.find("has 4.0 KiB free") != std::string::npos);
  const json host = parse_json(r.out)["hosts"][0];
  CHECK(host["facts"]["disk_free_bytes"] == 4096);
  CHECK(status_of(host, "bin/dptrain") == "pending");
  CHECK_FALSE(fs::exists(tmp / "work/bin/dptrain"));
}

TEST_CASE("facts and nvidia-smi lines parse; no GPU is a fact") {
  // A login banner (a start-up file's echo) before `dptrain --version`'s line is passed over.
  CHECK(dptrain::version_line("Welcome to node b\n\ndptrain 0.1.0\n") == "dptrain 0.1.0");
  CHECK(dptrain::version_line("dptrain 0.1.0\n") == "dptrain 0.1.0");
  CHECK(dptrain::version_line("  something else \n") == "something else");
  // What `--version --json` prints: the version as the line says it, and the agent protocol
  // (1 where the build does not say it; 0, not known, where it printed neither).
  const std::string answer =
      "Welcome\n{\"version\":\"0.1.0\",\"cuda\":false,\"agent_protocol\":7,\"status\":\"ok\"}\n";
  CHECK(dptrain::version_line(answer) == "dptrain 0.1.0");
  CHECK(dptrain::agent_protocol_of(answer) == 7);
  CHECK(dptrain::agent_protocol_of("{\"version\":\"0.1.0\",\"cuda\":false}\n") == 1);
  CHECK(dptrain::agent_protocol_of("Welcome\ndptrain 0.1.0\n") == 1);  // before --json
  CHECK(dptrain::agent_protocol_of("something else\n") == 0);
  CHECK(dptrain::agent_protocol_of("{\"version\":\"0.1.0\",\"agent_protocol\":\"x\"}") == 0);
  // The loader's complaint wherever it is among the lines (a banner first, on stderr too).
  CHECK(dptrain::loader_failure("Welcome\n/x/dptrain: error while loading shared libraries: "
                                "libgloo.so.0: cannot open shared object file\n") ==
        "error while loading shared libraries: libgloo.so.0: cannot open shared object file");
  CHECK(dptrain::loader_failure("sh: 1: dptrain: not found\n").empty());
  const auto gpus = dptrain::parse_gpus(
      "NVIDIA H200, 143771 MiB, 550.54.15\nNVIDIA H200, 143771 MiB, 550.54.15\n\n");
  REQUIRE(gpus.size() == 2);
  CHECK(gpus[1].name == "NVIDIA H200");
  CHECK(gpus[1].memory == "143771 MiB");
  CHECK(gpus[1].driver == "550.54.15");

  const auto facts = dptrain::parse_facts(
      "workdir=/home/u/.dptrain\nhostname=node-1\nos=Debian GNU/Linux 12 (bookworm)\ncpus=64\n"
      "memory_kb=2048\ndisk_free_kb=10\ngpu=Tesla T4, 15360 MiB, 535.1\n"
      "sha256=abc bin/dptrain\nnoise without equals\n");
  CHECK(facts.workdir == "/home/u/.dptrain");
  CHECK(facts.hostname == "node-1");
  CHECK(facts.os == "Debian GNU/Linux 12 (bookworm)");
  CHECK(facts.cpus == 64);
  CHECK(facts.memory_bytes == 2048 * 1024);
  CHECK(facts.disk_free_bytes == 10 * 1024);
  REQUIRE(facts.gpus.size() == 1);
  CHECK(facts.driver_version == "535.1");

  const auto none = dptrain::parse_facts("cpus=oops\ngpu_note=no nvidia-smi\n");
  CHECK(none.cpus == 0);
  CHECK(none.gpus.empty());
  CHECK(none.gpu_note == "no nvidia-smi");
  CHECK(none.driver_version.empty());
  CHECK(dptrain::human_bytes(17) == "17 B");
  CHECK(dptrain::human_bytes(3 * 1024 * 1024 / 2) == "1.5 MiB");
}
