// Parsing of hostfiles and --hosts lists into HostSpecs (see hostfile.hpp).
#include "launch/hostfile.hpp"

#include <pwd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <string_view>

#include <fmt/format.h>

#include "core/comm/store.hpp"
#include "core/error.hpp"
#include "core/fs.hpp"
#include "core/suggest.hpp"

namespace dptrain {

namespace {

constexpr std::array<std::string_view, 4> kAttributes = {"slots", "user", "port", "key"};

[[noreturn]] void fail(const std::string& what) {
  throw Error(ErrorKind::usage, what);
}

// Runs `parse`, prefixing the message of any usage error it throws with `where`.
template <typename Parse>
auto located(const std::string& where, Parse&& parse) {
  try {
    return parse();
  } catch (const Error& error) {
    throw Error(ErrorKind::usage, where + ": " + error.what());
  }
}

std::string_view trim(std::string_view text) {
  const auto first = text.find_first_not_of(" \t\r\n");
  if (first == std::string_view::npos) return {};
  const auto last = text.find_last_not_of(" \t\r\n");
  return text.substr(first, last - first + 1);
}

std::vector<std::string_view> split(std::string_view text, std::string_view separators) {
  std::vector<std::string_view> parts;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t end = std::min(text.find_first_of(separators, start), text.size());
    parts.push_back(text.substr(start, end - start));
    start = end + 1;
  }
  return parts;
}

std::vector<std::string_view> words(std::string_view line) {
  std::vector<std::string_view> result;
  for (const auto word : split(line, " \t\r"))
    if (!word.empty()) result.push_back(word);
  return result;
}

// All of `text` as a decimal integer in [low, high], or nothing.
std::optional<long> whole_number(std::string_view text, long low, long high) {
  long value = 0;
  const char* end = text.data() + text.size();
  const auto [stop, error] = std::from_chars(text.data(), end, value);
  if (text.empty() || error != std::errc() || stop != end || value < low || value > high) {
    return std::nullopt;
  }
  return value;
}

std::string unknown_attribute(std::string_view name) {
  std::string message = fmt::format("unknown attribute '{}'", name);
  const std::vector<std::string> known(std::begin(kAttributes), std::end(kAttributes));
  if (const auto closest = closest_match(name, known)) {
    return message + fmt::format("; did you mean '{}'?", *closest);
  }
  return message + " (known: slots, user, port, key)";
}

// A name ssh could mistake for an option, or a character no host name or address has, is a typo
// or an injection; refuse it here rather than on the remote side.
void check_host(std::string_view host) {
  if (host.empty()) fail("empty host name");
  if (host.front() == '-') fail(fmt::format("host '{}' starts with '-'", host));
  for (const char c : host) {
    const bool allowed = std::isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '-' ||
                         c == '_' || c == ':' || c == '%';
    if (!allowed) fail(fmt::format("host '{}' contains '{}'", host, c));
  }
}

void check_user(std::string_view user) {
  if (user.empty()) fail("empty user name");
  if (user.front() == '-') fail(fmt::format("user '{}' starts with '-'", user));
  if (user.find_first_of("@:/ \t") != std::string_view::npos) {
    fail(fmt::format("user '{}' contains one of '@:/' or a space", user));
  }
}

// "[::1]" -> "::1"; other hosts unchanged.
std::string without_brackets(std::string_view host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    return std::string(host.substr(1, host.size() - 2));
  }
  return std::string(host);
}

// Takes "alice@" off the front of `text` and returns "alice"; empty if there is no '@'.
std::string take_user(std::string_view& text) {
  const size_t at = text.find('@');
  if (at == std::string_view::npos) return {};
  std::string user(text.substr(0, at));
  check_user(user);
  text.remove_prefix(at + 1);
  return user;
}

int parse_slots(std::string_view value) {
  const auto slots = whole_number(value, 1, 1 << 20);
  if (!slots) fail(fmt::format("slots must be a whole number from 1 to 1048576, got '{}'", value));
  return static_cast<int>(*slots);
}

void set_attribute(HostSpec& spec, std::string_view name, std::string_view value) {
  if (name == "slots") {
    spec.slots = parse_slots(value);
  } else if (name == "user") {
    check_user(value);
    spec.user = std::string(value);
  } else if (name == "port") {
    const auto port = parse_port(value);
    if (!port) fail(fmt::format("port must be a number from 1 to 65535, got '{}'", value));
    spec.port = *port;
  } else if (name == "key") {
    if (value.empty()) fail("key= needs the path of an identity file");
    spec.key = expand_home(std::string(value)).string();
  } else {
    fail(unknown_attribute(name));
  }
}

// "localhost" in any case is this machine (host names ignore case): spelled one way from here
// on, so that every later comparison (is_local, the run's record that resume reads) sees it.
void local_spelled_one_way(HostSpec& spec) {
  if (lowercase(spec.host) == "localhost") spec.host = "localhost";
}

// localhost's ranks are started directly, not over SSH: what only SSH uses would be ignored.
// `port_given`: a port= attribute was written, even the default one (22).
void check_local_attributes(const HostSpec& spec, bool port_given = false) {
  if (!spec.is_local()) return;
  if (!spec.user.empty() || port_given || spec.port != kDefaultSshPort || !spec.key.empty()) {
    fail(
        "localhost runs its ranks directly, without SSH: a user, port or key does not apply "
        "(to reach this machine over SSH, name it 127.0.0.1)");
  }
}

}  // namespace

HostSpec parse_hostfile_line(std::string_view line) {
  const std::vector<std::string_view> fields = words(line);
  if (fields.empty()) fail("no host on the line");
  if (fields.front().find('=') != std::string_view::npos) {
    fail(fmt::format("no host before '{}' (a line is: host [slots=N] [user=U] [port=P] [key=PATH])",
                     fields.front()));
  }
  HostSpec spec;
  std::string_view host = fields.front();
  spec.user = take_user(host);
  if (std::count(host.begin(), host.end(), ':') == 1) {
    fail(
        fmt::format("'{}': a hostfile gives slots as slots=N and the SSH port as port=P "
                    "('host:slots' is the --hosts form)",
                    fields.front()));
  }
  spec.host = without_brackets(host);
  check_host(spec.host);
  local_spelled_one_way(spec);
  const bool user_in_host = !spec.user.empty();
  std::vector<std::string_view> seen;
  for (size_t i = 1; i < fields.size(); ++i) {
    const size_t equals = fields[i].find('=');
    if (equals == std::string_view::npos) {
      fail(fmt::format("'{}' is not an attribute: write slots=N, user=U, port=P or key=PATH",
                       fields[i]));
    }
    const std::string_view name = fields[i].substr(0, equals);
    if (std::find(seen.begin(), seen.end(), name) != seen.end() ||
        (name == "user" && user_in_host)) {
      fail(fmt::format("{} is given twice", name));
    }
    seen.push_back(name);
    set_attribute(spec, name, fields[i].substr(equals + 1));
  }
  check_local_attributes(spec, std::find(seen.begin(), seen.end(), "port") != seen.end());
  return spec;
}

namespace {

// The host already in `hosts` that `spec` would connect to again (same name and port), if any.
const HostSpec* same_host(const std::vector<HostSpec>& hosts, const HostSpec& spec) {
  const auto found = std::find_if(hosts.begin(), hosts.end(), [&](const HostSpec& other) {
    return other.port == spec.port && lowercase(other.host) == lowercase(spec.host);
  });
  return found == hosts.end() ? nullptr : &*found;
}

// One --hosts entry: [user@]host[:slots], with brackets around an IPv6 address.
HostSpec parse_hosts_entry(std::string_view entry) {
  HostSpec spec;
  spec.origin = "--hosts";
  spec.user = take_user(entry);
  std::string_view host = entry;
  std::optional<std::string_view> slots;
  if (entry.starts_with('[')) {
    const size_t close = entry.find(']');
    if (close == std::string_view::npos) fail("no ']' after the IPv6 address");
    host = entry.substr(1, close - 1);
    const std::string_view after = entry.substr(close + 1);
    if (!after.empty() && !after.starts_with(':')) fail("expected ':SLOTS' after ']'");
    if (!after.empty()) slots = after.substr(1);
  } else if (const size_t colon = entry.find(':'); colon != std::string_view::npos) {
    if (entry.find(':', colon + 1) != std::string_view::npos) {
      fail("write an IPv6 address in brackets, as in [::1]:2");
    }
    host = entry.substr(0, colon);
    slots = entry.substr(colon + 1);
  }
  spec.host = std::string(host);
  check_host(spec.host);
  local_spelled_one_way(spec);
  if (slots) spec.slots = parse_slots(*slots);
  check_local_attributes(spec);
  return spec;
}

}  // namespace

int total_slots(const std::vector<HostSpec>& hosts) {
  int n = 0;
  for (const auto& h : hosts)
    n += h.slots;
  return n;
}

bool names_host(const std::string& display, const HostSpec& h) {
  if (display == h.display()) return true;
  HostSpec recorded;
  try {
    recorded = parse_hostfile_line(recorded_host_line(display, 1));
  } catch (const Error&) {
    return false;
  }
  const auto user_of = [](const HostSpec& s) -> std::string {
    if (!s.user.empty()) return s.user;
    const passwd* pw = ::getpwuid(::geteuid());
    return pw != nullptr && pw->pw_name != nullptr ? pw->pw_name : "";
  };
  return recorded.host == h.host && recorded.port == h.port && user_of(recorded) == user_of(h);
}

std::string HostSpec::display() const {
  std::string text = user.empty() ? "" : user + "@";
  return text + (port == kDefaultSshPort ? host : format_host_port(host, port));
}

std::string recorded_host_line(const std::string& display, int slots, const std::string& key) {
  std::string_view text = display;
  std::string user;
  if (const size_t at = text.find('@'); at != std::string_view::npos) {
    user = std::string(text.substr(0, at));
    text.remove_prefix(at + 1);
  }
  std::string_view host = text;
  std::string_view port;
  if (text.starts_with('[')) {  // "[v6]:port", as format_host_port writes an IPv6 address
    const size_t close = text.find(']');
    host = text.substr(1, close == std::string_view::npos ? text.size() - 1 : close - 1);
    if (close != std::string_view::npos && text.substr(close + 1).starts_with(':')) {
      port = text.substr(close + 2);
    }
  } else if (const size_t colon = text.find(':');
             colon != std::string_view::npos &&
             text.find(':', colon + 1) == std::string_view::npos) {
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
  }
  std::string line = fmt::format("{} slots={}", host, slots);
  if (!user.empty()) line += " user=" + user;
  if (!port.empty()) line += fmt::format(" port={}", port);
  if (!key.empty()) line += " key=" + key;
  return line;
}

std::vector<HostSpec> parse_hostfile(const std::filesystem::path& path) {
  const std::string name = path.string();
  std::error_code error;
  if (std::filesystem::is_directory(path, error)) {
    fail(fmt::format("cannot read hostfile {}: it is a directory", name));
  }
  std::ifstream in(path);
  if (!in) fail(fmt::format("cannot read hostfile {}: {}", name, std::strerror(errno)));
  std::vector<HostSpec> hosts;
  std::string line;
  for (int number = 1; std::getline(in, line); ++number) {
    // A byte order mark some editors write first is no part of the host's name.
    if (number == 1 && line.starts_with("\xEF\xBB\xBF")) line.erase(0, 3);
    const std::string_view content = trim(std::string_view(line).substr(0, line.find('#')));
    if (content.empty()) continue;
    const std::string where = fmt::format("{}:{}", name, number);
    HostSpec spec = located(where, [&] { return parse_hostfile_line(content); });
    spec.origin = where;
    // A relative key= is the hostfile's, as its other paths would be: the same file works from
    // any directory (a resume started elsewhere included).
    if (!spec.key.empty() && spec.key.front() != '~' &&
        std::filesystem::path(spec.key).is_relative()) {
      spec.key = named_path(std::filesystem::absolute(path).parent_path() / spec.key);
    }
    if (const HostSpec* earlier = same_host(hosts, spec)) {
      const std::string earlier_line = earlier->origin.substr(name.size() + 1);
      fail(fmt::format("{}: {} port {} is already listed on line {}", where, spec.host, spec.port,
                       earlier_line));
    }
    hosts.push_back(std::move(spec));
  }
  if (in.bad()) fail(fmt::format("cannot read hostfile {}: read error", name));
  if (hosts.empty()) fail(fmt::format("{}: no hosts (every line is blank or a comment)", name));
  return hosts;
}

std::vector<HostSpec> parse_hosts_list(const std::string& text) {
  if (trim(text).empty()) fail("--hosts is empty: give a hostfile or a list like a:2,b:2");
  std::vector<HostSpec> hosts;
  for (const auto part : split(text, ",")) {
    const std::string_view entry = trim(part);
    const std::string where = fmt::format("--hosts entry '{}'", entry);
    if (entry.empty()) fail(fmt::format("--hosts '{}' has an empty entry", text));
    HostSpec spec = located(where, [&] { return parse_hosts_entry(entry); });
    if (same_host(hosts, spec) != nullptr)
      fail(fmt::format("{}: {} is listed twice", where, spec.host));
    hosts.push_back(std::move(spec));
  }
  return hosts;
}

namespace {

// A single --hosts name that is no file but reads like one: it has a dot and is a typo (two edits
// at most) of such a file in the current directory (named in the reason, also for "host.txt"
// beside "hosts.txt"), or it ends like a file name (".txt").
// Taken as a host name, SSH would only fail later to resolve it. Returns why, or nothing.
std::optional<std::string> mistyped_hostfile(const std::string& value) {
  if (value.find_first_of(",:@[") != std::string::npos) return std::nullopt;
  static const std::array<std::string_view, 12> kFileEndings = {"txt",  "hosts", "hostfile", "list",
                                                                "lst",  "cfg",   "conf",     "ini",
                                                                "yaml", "yml",   "json",     "csv"};
  const auto file_like = [](const std::string& name) {
    const size_t dot = name.rfind('.');
    return dot != std::string::npos &&
           std::find(kFileEndings.begin(), kFileEndings.end(), lowercase(name.substr(dot + 1))) !=
               kFileEndings.end();
  };
  if (value.find('.') == std::string::npos) return std::nullopt;
  std::error_code error;
  for (const auto& entry : std::filesystem::directory_iterator(".", error)) {
    const std::string name = entry.path().filename().string();
    if (file_like(name) && entry.is_regular_file(error) && edit_distance(value, name) <= 2) {
      return fmt::format("no such file (did you mean {}?)", name);
    }
  }
  if (file_like(value)) {
    return fmt::format("no such file (a host name does not end in {})",
                       value.substr(value.rfind('.')));
  }
  return std::nullopt;
}

}  // namespace

std::vector<HostSpec> load_hosts(const std::string& value) {
  std::error_code error;
  // A list entry never contains '/', so such a value can only mean a file (maybe a missing one).
  if (std::filesystem::is_regular_file(value, error) || value.find('/') != std::string::npos) {
    return parse_hostfile(value);
  }
  if (std::filesystem::is_directory(value, error)) {
    fail(fmt::format("cannot read hostfile {}: it is a directory", value));
  }
  if (const auto why = mistyped_hostfile(value)) {
    fail(fmt::format("cannot read hostfile {}: {}", value, *why));
  }
  return parse_hosts_list(value);
}

}  // namespace dptrain
