// Hosts of a job: a hostfile ("host [slots=N] [user=U] [port=P] [key=PATH]") or --hosts a:2,b:2.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

namespace dptrain {

// The work directory on remote hosts when none is given (provision, launch, doctor): bin/dptrain,
// data/ and runs/ go there; a leading "~/" is that host's home.
inline constexpr const char* kDefaultWorkdir = "~/.dptrain";

// The port a host's name leaves out (HostSpec::display).
inline constexpr uint16_t kDefaultSshPort = 22;

struct HostSpec {
  std::string host;  // name or address; "localhost" is spawned directly, every other over SSH
  int slots = 1;     // ranks on this host
  std::string user;  // empty: the current user
  uint16_t port = kDefaultSshPort;
  std::string
      key;  // identity file (absolute from a hostfile); empty: --identity, the agent, ~/.ssh/id_*
  std::string origin;  // where it was declared, for messages: "hosts.txt:3" or "--hosts"

  // (The parsers spell "LocalHost" and any other case of it "localhost".)
  bool is_local() const { return host == "localhost"; }
  // "user@host:port" with the parts that are set; the name used in every message.
  std::string display() const;
};

// The ranks the hosts hold: the sum of their slots.
int total_slots(const std::vector<HostSpec>& hosts);

// Error(usage) "FILE:LINE: what is wrong" for a bad line; `#` starts a comment; blank lines are
// skipped; a host may not appear twice (same host and port); at least one host.
std::vector<HostSpec> parse_hostfile(const std::filesystem::path& path);
// "a:2,b:2,user@c:4,d" (slots default 1; "[::1]:2" for IPv6). Error(usage) naming the entry.
std::vector<HostSpec> parse_hosts_list(const std::string& text);
// A host as run.json records it (its display(), its slots, and its hostfile key= when it had one)
// as a hostfile line: "host slots=N user=U port=P key=PATH", the form that gives it again
// unambiguously (in the --hosts list form, "host:N" is a slot count, not a port).
std::string recorded_host_line(const std::string& display, int slots, const std::string& key = "");
// One hostfile line ("host [slots=N] [user=U] [port=P] [key=PATH]", no comment); Error(usage)
// saying what is wrong (a blank one included).
HostSpec parse_hostfile_line(std::string_view line);
// Whether `display` (a host as run.json records it) names `h`: the same host, port and user, a
// user left out being the current one (as SSH takes it): "root@node" is "node" for root.
bool names_host(const std::string& display, const HostSpec& h);
// The value of --hosts: an existing file is a hostfile, anything else a list.
std::vector<HostSpec> load_hosts(const std::string& value);

}  // namespace dptrain
