// Store: the rendezvous key/value interface and a prefix wrapper for namespacing.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "core/error.hpp"

namespace dptrain {

// What a store throws when keys are still missing at the deadline (key_timeout_message): the
// store answered, and the keys are not there. Anything else (a lost connection, a store that
// is gone) is another Error(comm), which callers must not take for a peer that never came.
class KeyTimeout : public Error {
 public:
  explicit KeyTimeout(const std::string& message) : Error(ErrorKind::comm, message) {}
};

// What a rank that did not join within its timeout is told (join_hint): what to check, and what
// gives the ranks longer to start. The defaults fit ranks started by hand (dptrain worker); a
// launcher's ranks are told that the launcher started them alike (launched_join_advice).
struct JoinAdvice {
  std::string check = "start every rank with the same store and world size";
  std::string longer = "distributed.timeout_s, or a worker's --timeout";
};

// A key/value store shared by all ranks of a job. Values are opaque bytes; counters made by add()
// are stored as decimal text. Every blocking call has a deadline and throws KeyTimeout (an
// Error(ErrorKind::comm)) naming the key(s), the store and the timeout when it passes.
class Store {
 public:
  virtual ~Store() = default;
  virtual void set(const std::string& key, const std::string& value) = 0;
  // Blocks until the key exists, up to `timeout`.
  virtual std::string get(const std::string& key, std::chrono::milliseconds timeout) = 0;
  // Blocks until every key exists, up to `timeout`.
  virtual void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) = 0;
  // Atomically adds `delta` to the counter at `key` (a missing key counts as 0); returns the new
  // value.
  virtual int64_t add(const std::string& key, int64_t delta) = 0;
  // Whether every key exists right now.
  virtual bool check(const std::vector<std::string>& keys) = 0;
  // The value of each of `keys` that exists right now, nothing for the others: one request, where
  // a check and a get each would take two per key.
  virtual std::vector<std::optional<std::string>> peek(const std::vector<std::string>& keys) = 0;
  // "store HOST:PORT", for error messages.
  virtual std::string describe() const = 0;

  // What the ranks that wait here for others are told when those do not join (join_hint).
  const JoinAdvice& join_advice() const { return join_advice_; }
  void set_join_advice(JoinAdvice advice) { join_advice_ = std::move(advice); }

 private:
  JoinAdvice join_advice_;
};

// The prefix of a restart generation's keys ("gen2"): ranks of other generations never see them.
std::string generation_prefix(int generation);

// Namespaces every key as prefix + "/" + key, so that e.g. each restart generation sees only its
// own keys. Error messages name the full key. Its join advice starts as the inner store's.
class PrefixStore : public Store {
 public:
  PrefixStore(std::string prefix, Store& inner);

  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  std::vector<std::optional<std::string>> peek(const std::vector<std::string>& keys) override;
  std::string describe() const override;

  const std::string& prefix() const { return prefix_; }

 private:
  std::string full_key(const std::string& key) const;
  std::vector<std::string> full_keys(const std::vector<std::string>& keys) const;

  std::string prefix_;
  Store& inner_;
};

// key(r) for each rank r from `first` up to `end` (not included): the keys of ranks' posts, read
// together (Store::peek, Store::wait).
std::vector<std::string> rank_keys(std::string (*key)(int), int first, int end);

// All of `text` as a port number (decimal, 1 to 65535), or nothing.
std::optional<uint16_t> parse_port(std::string_view text);

// "host:port" or "[v6-address]:port" -> (host, port). Throws Error(ErrorKind::usage) naming the
// text if it is malformed or the port is not in 1..65535.
std::pair<std::string, uint16_t> parse_host_port(const std::string& text);

// "host:port", with brackets around an IPv6 address.
std::string format_host_port(const std::string& host, uint16_t port);

// A host as given, with the brackets of "[v6-address]" taken off (as an option such as
// --master-addr may write it); anything else unchanged.
std::string unbracketed(const std::string& host);

// A timeout for messages: "30s", "1.5s", "0.25s".
std::string format_timeout(std::chrono::milliseconds timeout);

// What a rank that did not join within `timeout` asks for: advice.check, and where the timeout is
// shorter than ranks take to start (under 10 s, where a process start, a data load or a busy
// machine can take longer), a longer one (advice.longer says how).
std::string join_hint(std::chrono::milliseconds timeout, const JoinAdvice& advice = {});

// The message of the comm error a store throws when keys are still missing at the deadline, e.g.
// "timed out after 30s waiting for key 'gen1/rank3' at store 127.0.0.1:4242".
std::string key_timeout_message(const std::vector<std::string>& missing_keys,
                                std::chrono::milliseconds timeout,
                                const std::string& store_description);

}  // namespace dptrain
