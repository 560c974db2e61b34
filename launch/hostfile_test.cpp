// Tests for hostfiles and --hosts lists: real files in a temp dir, every error message checked.
#include "launch/hostfile.hpp"

#include <doctest/doctest.h>
#include <pwd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <functional>
#include <optional>

#include "core/error.hpp"
#include "tests/scoped_env.hpp"
#include "tests/temp_dir.hpp"

namespace dptrain {
namespace {

std::filesystem::path write_file(const test::TempDir& dir, const std::string& name,
                                 const std::string& text) {
  const std::filesystem::path path = dir / name;
  std::ofstream(path) << text;
  return path;
}

std::string usage_error(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& error) {
    CHECK(error.kind() == ErrorKind::usage);
    return error.what();
  }
  FAIL("expected an Error");
  return {};
}

// The error a hostfile holding `text` gives, with the temp dir's path replaced by "DIR".
std::string hostfile_error(const std::string& text) {
  test::TempDir dir;
  const auto path = write_file(dir, "hosts", text);
  std::string message = usage_error([&] { parse_hostfile(path); });
  const std::string prefix = path.string();
  if (message.starts_with(prefix)) message.replace(0, prefix.size(), "hosts");
  return message;
}

TEST_CASE("hostfile: hosts, attributes, comments and blank lines") {
  test::TempDir dir;
  ScopedEnv home("HOME", "/home/tester");
  const auto path =
      write_file(dir, "hosts.txt",
                 "# the cluster\n"
                 "\n"
                 "node1 slots=4\n"
                 "   node2\tslots=2 user=alice port=2222 key=~/.ssh/id_node  # gpu box\n"
                 "bob@node3 key=/etc/keys/k\r\n"
                 "localhost slots=2\n"
                 "10.0.0.7 port=22\n"
                 "::1 port=2200\n"
                 "[fe80::1]\n"
                 "node1 port=2022\n"
                 "   # indented comment\n");
  const std::vector<HostSpec> hosts = parse_hostfile(path);
  REQUIRE(hosts.size() == 8);
  const std::string name = path.string();

  CHECK(hosts[0].host == "node1");
  CHECK(hosts[0].slots == 4);
  CHECK(hosts[0].user.empty());
  CHECK(hosts[0].port == 22);
  CHECK(hosts[0].key.empty());
  CHECK(hosts[0].origin == name + ":3");
  CHECK_FALSE(hosts[0].is_local());

  CHECK(hosts[1].host == "node2");
  CHECK(hosts[1].slots == 2);
  CHECK(hosts[1].user == "alice");
  CHECK(hosts[1].port == 2222);
  CHECK(hosts[1].key == "/home/tester/.ssh/id_node");
  CHECK(hosts[1].origin == name + ":4");

  CHECK(hosts[2].host == "node3");
  CHECK(hosts[2].user == "bob");
  CHECK(hosts[2].slots == 1);
  CHECK(hosts[2].key == "/etc/keys/k");

  CHECK(hosts[3].is_local());
  CHECK(hosts[3].slots == 2);
  CHECK(hosts[4].host == "10.0.0.7");
  CHECK(hosts[5].host == "::1");
  CHECK(hosts[5].port == 2200);
  CHECK(hosts[6].host == "fe80::1");
  // Same name, another port: another sshd, so another host.
  CHECK(hosts[7].host == "node1");
  CHECK(hosts[7].port == 2022);
  CHECK(hosts[7].origin == name + ":10");
}

TEST_CASE("hostfile: localhost with a user, port or key is refused (they would be ignored)") {
  const std::string why =
      "localhost runs its ranks directly, without SSH: a user, port or key does not apply (to "
      "reach this machine over SSH, name it 127.0.0.1)";
  CHECK(hostfile_error("localhost slots=2 port=2222\n") == "hosts:1: " + why);
  CHECK(hostfile_error("localhost user=alice\n") == "hosts:1: " + why);
  CHECK(hostfile_error("localhost port=22\n") == "hosts:1: " + why);  // the default, written
  CHECK(hostfile_error("LOCALHOST user=alice\n") == "hosts:1: " + why);
  {
    test::TempDir dir;
    CHECK(parse_hostfile(write_file(dir, "hosts", "LOCALHOST slots=2\n")).front().host ==
          "localhost");
  }
  CHECK(usage_error([] { parse_hosts_list("alice@localhost:2"); }) ==
        "--hosts entry 'alice@localhost:2': " + why);
  CHECK(parse_hosts_list("localhost:2").front().slots == 2);
}

TEST_CASE("hostfile: a byte order mark before the first host is passed over") {
  test::TempDir dir;
  const auto hosts = parse_hostfile(write_file(dir, "hosts", "\xEF\xBB\xBFnode1 slots=2\nnode2\n"));
  REQUIRE(hosts.size() == 2);
  CHECK(hosts[0].host == "node1");
  CHECK(hosts[0].slots == 2);
}

TEST_CASE("hostfile: a recorded host as a hostfile line parses back to the same host") {
  CHECK(recorded_host_line("alice@10.0.0.1:2222", 2) == "10.0.0.1 slots=2 user=alice port=2222");
  CHECK(recorded_host_line("[fd00::2]:2200", 1) == "fd00::2 slots=1 port=2200");
  CHECK(recorded_host_line("node3", 4) == "node3 slots=4");
  CHECK(recorded_host_line("node3", 4, "/keys/id") == "node3 slots=4 key=/keys/id");
  HostSpec h;
  h.host = "10.0.0.1";
  h.user = "alice";
  h.port = 2222;
  h.slots = 2;
  test::TempDir dir;
  const auto back =
      parse_hostfile(write_file(dir, "hosts", recorded_host_line(h.display(), h.slots) + "\n"));
  REQUIRE(back.size() == 1);
  CHECK(back[0].display() == h.display());
  CHECK(back[0].slots == 2);
}

TEST_CASE("hostfile: a relative key is the hostfile directory's; ~user/ is kept as written") {
  test::TempDir dir;
  const auto path = write_file(dir, "hosts", "a key=keys/id\nb key=~other/id\nc key=../k\n");
  const auto hosts = parse_hostfile(path);
  CHECK(hosts[0].key == (dir.path() / "keys/id").string());
  CHECK(hosts[1].key == "~other/id");
  CHECK(hosts[2].key == (dir.path().parent_path() / "k").string());
}

TEST_CASE("hostfile: every error names the file and line") {
  CHECK(hostfile_error("a\nb slot=2\n") ==
        "hosts:2: unknown attribute 'slot'; did you mean 'slots'?");
  CHECK(hostfile_error("a usr=x\n") == "hosts:1: unknown attribute 'usr'; did you mean 'user'?");
  CHECK(hostfile_error("a prot=22\n") == "hosts:1: unknown attribute 'prot'; did you mean 'port'?");
  CHECK(hostfile_error("a gpus=8\n") ==
        "hosts:1: unknown attribute 'gpus' (known: slots, user, port, key)");
  CHECK(hostfile_error("a slots=0\n") ==
        "hosts:1: slots must be a whole number from 1 to 1048576, got '0'");
  CHECK(hostfile_error("a slots=-1\n").starts_with("hosts:1: slots must be"));
  CHECK(hostfile_error("a slots=two\n").ends_with("got 'two'"));
  CHECK(hostfile_error("a slots=2.5\n").ends_with("got '2.5'"));
  CHECK(hostfile_error("a slots=\n").ends_with("got ''"));
  CHECK(hostfile_error("a slots=99999999999999999999\n").starts_with("hosts:1: slots must be"));
  CHECK(hostfile_error("a port=0\n") == "hosts:1: port must be a number from 1 to 65535, got '0'");
  CHECK(hostfile_error("a port=65536\n").ends_with("got '65536'"));
  CHECK(hostfile_error("a port=ssh\n").ends_with("got 'ssh'"));
  CHECK(hostfile_error("a key=\n") == "hosts:1: key= needs the path of an identity file");
  CHECK(hostfile_error("a user=\n") == "hosts:1: empty user name");
  CHECK(hostfile_error("a slots=2 slots=3\n") == "hosts:1: slots is given twice");
  CHECK(hostfile_error("bob@a user=alice\n") == "hosts:1: user is given twice");
  CHECK(hostfile_error("a\n\nslots=2 user=x\n") ==
        "hosts:3: no host before 'slots=2' (a line is: host [slots=N] [user=U] [port=P] "
        "[key=PATH])");
  CHECK(hostfile_error("a 4\n") ==
        "hosts:1: '4' is not an attribute: write slots=N, user=U, port=P or key=PATH");
  CHECK(hostfile_error("a:4\n") ==
        "hosts:1: 'a:4': a hostfile gives slots as slots=N and the SSH port as port=P "
        "('host:slots' is the --hosts form)");
  CHECK(hostfile_error("-oProxyCommand=x\n").starts_with("hosts:1: no host before"));
  CHECK(hostfile_error("-a\n") == "hosts:1: host '-a' starts with '-'");
  CHECK(hostfile_error("a/b\n") == "hosts:1: host 'a/b' contains '/'");
  CHECK(hostfile_error("@a\n") == "hosts:1: empty user name");
}

TEST_CASE("hostfile: a host listed twice is refused, naming both lines") {
  CHECK(hostfile_error("a\nb\n# c\na slots=2\n") ==
        "hosts:4: a port 22 is already listed on line 1");
  CHECK(hostfile_error("a port=2222\nA port=2222 user=other\n") ==
        "hosts:2: A port 2222 is already listed on line 1");
}

TEST_CASE("hostfile: no hosts, or a file that cannot be read") {
  CHECK(hostfile_error("") == "hosts: no hosts (every line is blank or a comment)");
  CHECK(hostfile_error("# only\n\n   \n# comments\n") ==
        "hosts: no hosts (every line is blank or a comment)");

  test::TempDir dir;
  const auto missing = dir / "missing";
  CHECK(usage_error([&] { parse_hostfile(missing); }) ==
        "cannot read hostfile " + missing.string() + ": No such file or directory");
  CHECK(usage_error([&] { parse_hostfile(dir.path()); }) ==
        "cannot read hostfile " + dir.path().string() + ": it is a directory");
  // --hosts naming a directory without a '/': a hostfile given wrongly, not a host name.
  const auto cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir.path());
  std::filesystem::create_directories("hostdir");
  const std::string said = usage_error([] { load_hosts("hostdir"); });
  std::filesystem::current_path(cwd);
  CHECK(said == "cannot read hostfile hostdir: it is a directory");
  if (geteuid() != 0) {  // root reads any file
    const auto locked = write_file(dir, "locked", "a\n");
    chmod(locked.c_str(), 0);
    CHECK(usage_error([&] { parse_hostfile(locked); }) ==
          "cannot read hostfile " + locked.string() + ": Permission denied");
  }
}

TEST_CASE("hosts list: hosts, slots, users and IPv6") {
  const std::vector<HostSpec> hosts =
      parse_hosts_list("a:2,b:2,user@c:4,d, e:3 ,[::1]:2,[fe80::2]");
  REQUIRE(hosts.size() == 7);
  CHECK(hosts[0].host == "a");
  CHECK(hosts[0].slots == 2);
  CHECK(hosts[0].origin == "--hosts");
  CHECK(hosts[1].host == "b");
  CHECK(hosts[2].host == "c");
  CHECK(hosts[2].user == "user");
  CHECK(hosts[2].slots == 4);
  CHECK(hosts[3].host == "d");
  CHECK(hosts[3].slots == 1);
  CHECK(hosts[4].host == "e");
  CHECK(hosts[4].slots == 3);
  CHECK(hosts[5].host == "::1");
  CHECK(hosts[5].slots == 2);
  CHECK(hosts[6].host == "fe80::2");
  CHECK(hosts[6].slots == 1);
  for (const auto& host : hosts) {
    CHECK(host.port == 22);
    CHECK(host.key.empty());
  }
  CHECK(parse_hosts_list("localhost:4").front().is_local());
  // Host names ignore case: LocalHost is this machine too, not a host reached over SSH.
  CHECK(parse_hosts_list("LocalHost:4").front().is_local());
  CHECK(parse_hosts_list("LocalHost:4").front().host == "localhost");  // as run.json records it
  CHECK_FALSE(parse_hosts_list("localhost2:4").front().is_local());
}

TEST_CASE("hosts list: every error names the entry") {
  const auto error = [](const std::string& text) {
    return usage_error([&] { parse_hosts_list(text); });
  };
  CHECK(error("a:2,b:0") ==
        "--hosts entry 'b:0': slots must be a whole number from 1 to 1048576, got '0'");
  CHECK(error("a:x") ==
        "--hosts entry 'a:x': slots must be a whole number from 1 to 1048576, "
        "got 'x'");
  CHECK(error("a:").ends_with("got ''"));
  CHECK(error("a,,b") == "--hosts 'a,,b' has an empty entry");
  CHECK(error("a,") == "--hosts 'a,' has an empty entry");
  CHECK(error("") == "--hosts is empty: give a hostfile or a list like a:2,b:2");
  CHECK(error(":2") == "--hosts entry ':2': empty host name");
  CHECK(error("@a:2") == "--hosts entry '@a:2': empty user name");
  CHECK(error("::1:2") ==
        "--hosts entry '::1:2': write an IPv6 address in brackets, as in [::1]:2");
  CHECK(error("[::1:2") == "--hosts entry '[::1:2': no ']' after the IPv6 address");
  CHECK(error("[::1]2") == "--hosts entry '[::1]2': expected ':SLOTS' after ']'");
  CHECK(error("a:2,b,A:3") == "--hosts entry 'A:3': A is listed twice");
  CHECK(error("-oProxyCommand:2") ==
        "--hosts entry '-oProxyCommand:2': host '-oProxyCommand' "
        "starts with '-'");
}

TEST_CASE("load_hosts: a file is a hostfile, anything else a list") {
  test::TempDir dir;
  const auto path = write_file(dir, "hosts", "node1 slots=3\n");
  const auto from_file = load_hosts(path.string());
  REQUIRE(from_file.size() == 1);
  CHECK(from_file[0].host == "node1");
  CHECK(from_file[0].slots == 3);
  CHECK(from_file[0].origin == path.string() + ":1");

  const auto from_list = load_hosts("node1:3,node2");
  REQUIRE(from_list.size() == 2);
  CHECK(from_list[1].host == "node2");

  // A value with '/' can only be a file: a missing one is reported as such, not as a host name.
  const std::string missing = (dir / "nope").string();
  CHECK(usage_error([&] { load_hosts(missing); }) ==
        "cannot read hostfile " + missing + ": No such file or directory");

  // A single name that reads like a file is a mistyped hostfile, not a host for SSH to fail on.
  CHECK(usage_error([&] { load_hosts("nohostsfile.txt"); }) ==
        "cannot read hostfile nohostsfile.txt: no such file (a host name does not end in .txt)");
  CHECK(usage_error([&] { load_hosts("cluster.TXT"); }) ==
        "cannot read hostfile cluster.TXT: no such file (a host name does not end in .TXT)");
  const std::filesystem::path cwd = std::filesystem::current_path();
  std::filesystem::current_path(dir.path());
  write_file(dir, "gpus.hosts", "node1\n");
  const std::string typo = usage_error([&] { load_hosts("gpus.hostss"); });
  // A name that ends like a file and is near one names that file, not only the ending.
  write_file(dir, "hosts.txt", "node1\n");
  const std::string near_file = usage_error([&] { load_hosts("host.txt"); });
  // Host names with dots, not near a file's name, are hosts.
  const auto fine = load_hosts("node1.cluster");
  std::filesystem::current_path(cwd);
  CHECK(typo == "cannot read hostfile gpus.hostss: no such file (did you mean gpus.hosts?)");
  CHECK(near_file == "cannot read hostfile host.txt: no such file (did you mean hosts.txt?)");
  REQUIRE(fine.size() == 1);
  CHECK(fine.front().host == "node1.cluster");
}

TEST_CASE("HostSpec::display") {
  HostSpec spec;
  spec.host = "node1";
  CHECK(spec.display() == "node1");
  spec.user = "alice";
  CHECK(spec.display() == "alice@node1");
  spec.port = 2222;
  CHECK(spec.display() == "alice@node1:2222");
  spec.user.clear();
  CHECK(spec.display() == "node1:2222");
  spec.host = "::1";
  CHECK(spec.display() == "[::1]:2222");
  spec.port = 22;
  CHECK(spec.display() == "::1");
}

TEST_CASE("names_host: a user left out is the current one") {
  const passwd* pw = ::getpwuid(::geteuid());
  if (pw == nullptr) {
    MESSAGE("skipped: this user has no passwd entry");
    return;
  }
  const std::string me = pw->pw_name;
  HostSpec spec;
  spec.host = "node1";
  spec.port = 2291;
  CHECK(names_host("node1:2291", spec));
  CHECK(names_host(me + "@node1:2291", spec));
  CHECK_FALSE(names_host("someone-else@node1:2291", spec));
  CHECK_FALSE(names_host("node1", spec));  // port 22
  CHECK_FALSE(names_host("node2:2291", spec));
  spec.user = me;
  CHECK(names_host("node1:2291", spec));
  spec.user = "someone-else";
  CHECK_FALSE(names_host("node1:2291", spec));
  CHECK(names_host("someone-else@node1:2291", spec));
  CHECK_FALSE(names_host("not a host line", spec));
}

}  // namespace
}  // namespace dptrain
