// Elastic world size: host selection by probing, and MIN:MAX ranges.
#include "launch/elastic.hpp"

#include <future>
#include <thread>

#include <fmt/format.h>

#include "core/error.hpp"

namespace dptrain {

namespace {

bool parse_positive(const std::string& text, int& out) {
  if (text.empty() || text.size() > 6) return false;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
  }
  out = std::stoi(text);
  return out >= 1;
}

}  // namespace

SizeRange parse_size_range(const std::string& text, const std::string& flag) {
  SizeRange r;
  const auto colon = text.find(':');
  const bool ok = colon == std::string::npos
                      ? parse_positive(text, r.min) && parse_positive(text, r.max)
                      : parse_positive(text.substr(0, colon), r.min) &&
                            parse_positive(text.substr(colon + 1), r.max);
  if (!ok || r.min > r.max) {
    throw Error(
        ErrorKind::usage,
        fmt::format("{}: expected N or MIN:MAX with 1 <= MIN <= MAX, got '{}'", flag, text));
  }
  return r;
}

HostProbe ssh_probe(const SshOptions& options) {
  return [options](const HostSpec& host) -> std::string {
    if (host.is_local()) return "";
    try {
      SshSession::connect(host, options);
      return "";
    } catch (const Error& e) {
      return e.what();
    }
  };
}

HostSelection select_hosts(const std::vector<HostSpec>& candidates, int max_nodes,
                           std::chrono::milliseconds wait, const HostProbe& probe,
                           const std::function<bool()>& should_stop,
                           std::chrono::milliseconds interval) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  std::vector<std::string> why(candidates.size());
  for (;;) {
    std::vector<std::future<std::string>> answers;
    for (const auto& h : candidates)
      answers.push_back(std::async(std::launch::async, probe, h));
    int up = 0;
    for (size_t i = 0; i < candidates.size(); ++i) {
      why[i] = answers[i].get();
      if (why[i].empty()) ++up;
    }
    if (up >= max_nodes || std::chrono::steady_clock::now() + interval > deadline ||
        (should_stop && should_stop())) {
      break;
    }
    std::this_thread::sleep_for(interval);
  }
  HostSelection out;
  for (size_t i = 0; i < candidates.size(); ++i) {
    if (!why[i].empty()) {
      out.absent.push_back(fmt::format("{}: {}", candidates[i].display(), why[i]));
    } else if (static_cast<int>(out.hosts.size()) < max_nodes) {
      out.hosts.push_back(candidates[i]);
    }
  }
  return out;
}

}  // namespace dptrain
