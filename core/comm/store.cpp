// PrefixStore and the address/timeout formatting shared by every Store implementation.
#include "core/comm/store.hpp"

#include <fmt/format.h>

#include <charconv>

#include "core/error.hpp"

namespace dptrain {

PrefixStore::PrefixStore(std::string prefix, Store& inner)
    : prefix_(std::move(prefix)), inner_(inner) {
  set_join_advice(inner.join_advice());
}

std::string PrefixStore::full_key(const std::string& key) const {
  return prefix_ + "/" + key;
}

std::vector<std::string> PrefixStore::full_keys(const std::vector<std::string>& keys) const {
  std::vector<std::string> result;
  result.reserve(keys.size());
  for (const auto& key : keys)
    result.push_back(full_key(key));
  return result;
}

void PrefixStore::set(const std::string& key, const std::string& value) {
  inner_.set(full_key(key), value);
}

std::string PrefixStore::get(const std::string& key, std::chrono::milliseconds timeout) {
  return inner_.get(full_key(key), timeout);
}

void PrefixStore::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  inner_.wait(full_keys(keys), timeout);
}

int64_t PrefixStore::add(const std::string& key, int64_t delta) {
  return inner_.add(full_key(key), delta);
}

bool PrefixStore::check(const std::vector<std::string>& keys) {
  return inner_.check(full_keys(keys));
}

std::vector<std::optional<std::string>> PrefixStore::peek(const std::vector<std::string>& keys) {
  return inner_.peek(full_keys(keys));
}

std::string PrefixStore::describe() const {
  return inner_.describe();
}

std::vector<std::string> rank_keys(std::string (*key)(int), int first, int end) {
  std::vector<std::string> keys;
  for (int r = first; r < end; ++r)
    keys.push_back(key(r));
  return keys;
}

std::optional<uint16_t> parse_port(std::string_view text) {
  unsigned port = 0;
  const char* end = text.data() + text.size();
  const auto [stop, status] = std::from_chars(text.data(), end, port);
  if (text.empty() || status != std::errc() || stop != end || port == 0 || port > 65535) {
    return std::nullopt;
  }
  return static_cast<uint16_t>(port);
}

std::pair<std::string, uint16_t> parse_host_port(const std::string& text) {
  auto malformed = [&](const char* why) {
    return Error(
        ErrorKind::usage,
        fmt::format("invalid address '{}': {} (expected HOST:PORT or [IPV6]:PORT)", text, why));
  };
  std::string host;
  std::string port_text;
  if (!text.empty() && text.front() == '[') {
    const auto close = text.find(']');
    if (close == std::string::npos) throw malformed("no closing bracket");
    if (close + 1 == text.size()) throw malformed("no port");
    if (text[close + 1] != ':') throw malformed("':' and a port must follow the bracket");
    host = text.substr(1, close - 1);
    port_text = text.substr(close + 2);
  } else {
    const auto colon = text.find(':');
    if (colon == std::string::npos) throw malformed("no port");
    if (text.find(':', colon + 1) != std::string::npos) {
      throw malformed("an IPv6 address needs brackets");
    }
    host = text.substr(0, colon);
    port_text = text.substr(colon + 1);
  }
  if (host.empty()) throw malformed("empty host");
  const auto port = parse_port(port_text);
  if (!port) throw malformed("port must be a number in 1..65535");
  return {host, *port};
}

std::string unbracketed(const std::string& host) {
  if (host.size() >= 2 && host.front() == '[' && host.back() == ']') {
    return host.substr(1, host.size() - 2);
  }
  return host;
}

std::string format_host_port(const std::string& host, uint16_t port) {
  if (host.find(':') != std::string::npos) return fmt::format("[{}]:{}", host, port);
  return fmt::format("{}:{}", host, port);
}

std::string format_timeout(std::chrono::milliseconds timeout) {
  const auto ms = timeout.count();
  if (ms % 1000 == 0) return fmt::format("{}s", ms / 1000);
  return fmt::format("{:g}s", static_cast<double>(ms) / 1000.0);
}

std::string join_hint(std::chrono::milliseconds timeout, const JoinAdvice& advice) {
  std::string hint = advice.check;
  if (timeout < std::chrono::seconds(10)) {
    hint += fmt::format(", or give them longer than {} to start ({})", format_timeout(timeout),
                        advice.longer);
  }
  return hint;
}

std::string key_timeout_message(const std::vector<std::string>& missing_keys,
                                std::chrono::milliseconds timeout,
                                const std::string& store_description) {
  std::string keys;
  for (const auto& key : missing_keys) {
    if (!keys.empty()) keys += ", ";
    keys += "'" + key + "'";
  }
  return fmt::format("timed out after {} waiting for key{} {} at {}", format_timeout(timeout),
                     missing_keys.size() == 1 ? "" : "s", keys, store_description);
}

std::string generation_prefix(int generation) {
  return fmt::format("gen{}", generation);
}

}  // namespace dptrain
