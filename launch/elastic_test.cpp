// Host selection and the watch for returning hosts, with a scripted probe instead of SSH.
#include "launch/elastic.hpp"

#include <doctest/doctest.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "core/error.hpp"

using namespace dptrain;
using namespace std::chrono_literals;

namespace {

HostSpec host(const std::string& name) {
  HostSpec h;
  h.host = name;
  h.slots = 1;
  return h;
}

// Answers for the hosts in `up` (changeable while probes run); counts the probes of each host.
// Its state is shared with the probes: one given up on runs on after the selection (and the
// test) ended, on what it copied.
struct ScriptedProbe {
  struct State {
    std::mutex mutex;
    std::set<std::string> up;
    std::map<std::string, int> probes;
  };
  std::shared_ptr<State> state = std::make_shared<State>();

  HostProbe probe() const {
    return [state = state](const HostSpec& h) -> std::string {
      std::lock_guard lock(state->mutex);
      ++state->probes[h.host];
      return state->up.count(h.host) ? "" : "connection refused";
    };
  }
  void set_up(const std::string& name) {
    std::lock_guard lock(state->mutex);
    state->up.insert(name);
  }
  int count(const std::string& name) {
    std::lock_guard lock(state->mutex);
    return state->probes[name];
  }
};

std::vector<std::string> names(const std::vector<HostSpec>& hosts) {
  std::vector<std::string> out;
  for (const auto& h : hosts)
    out.push_back(h.host);
  return out;
}

}  // namespace

TEST_CASE("elastic: --nnodes and --nproc ranges") {
  CHECK(parse_size_range("3", "--nproc").min == 3);
  CHECK_FALSE(parse_size_range("3", "--nproc").elastic());
  const SizeRange r = parse_size_range("1:4", "--nnodes");
  CHECK(r.min == 1);
  CHECK(r.max == 4);
  CHECK(r.elastic());
  // Up to a hostfile's most slots, 2^20; the message says the bound.
  CHECK(parse_size_range("1048576", "--nproc").max == 1048576);
  for (const char* bad :
       {"", "0", "2:1", "1:", ":2", "a", "1:2:3", "-1", "9999999", "1048577", "1:1048577"}) {
    CAPTURE(bad);
    CHECK_THROWS_WITH_AS(
        parse_size_range(bad, "--nnodes"),
        doctest::Contains("--nnodes: expected N or MIN:MAX with 1 <= MIN <= MAX <= 1048576"),
        Error);
  }
}

TEST_CASE("elastic: the first MAX hosts that answer, in order; the others named with why") {
  ScriptedProbe p;
  p.state->up = {"b", "c", "d"};
  const auto sel =
      select_hosts({host("a"), host("b"), host("c"), host("d")}, 2, 0ms, p.probe(), nullptr);
  CHECK(names(sel.hosts) == std::vector<std::string>{"b", "c"});
  REQUIRE(sel.absent.size() == 1);
  CHECK(sel.absent[0] == "a: connection refused");
}

TEST_CASE("elastic: a host that comes back within the wait is taken") {
  ScriptedProbe p;
  p.state->up = {"a"};
  std::thread back([&p] {
    std::this_thread::sleep_for(150ms);
    p.set_up("b");
  });
  const auto sel = select_hosts({host("a"), host("b")}, 2, 10s, p.probe(), nullptr,
                                std::chrono::milliseconds(50));
  back.join();
  CHECK(names(sel.hosts) == std::vector<std::string>{"a", "b"});
  CHECK(sel.absent.empty());
}

TEST_CASE("elastic: the wait ends with a probe at its deadline, not an interval before it") {
  // The interval (1 s) is longer than what is left of the wait when the host comes back: it must
  // still be probed at the deadline.
  ScriptedProbe p;
  p.state->up = {"a"};
  std::thread back([&p] {
    std::this_thread::sleep_for(300ms);
    p.set_up("b");
  });
  const auto start = std::chrono::steady_clock::now();
  const auto sel =
      select_hosts({host("a"), host("b")}, 2, 600ms, p.probe(), nullptr, std::chrono::seconds(1));
  back.join();
  CHECK(names(sel.hosts) == std::vector<std::string>{"a", "b"});
  CHECK(std::chrono::steady_clock::now() - start >= 550ms);
}

TEST_CASE("elastic: the host watch reports the hosts that answer again, and only then") {
  ScriptedProbe p;
  HostWatch watch({host("x"), host("y"), host("z")}, p.probe(), 20ms);
  std::this_thread::sleep_for(200ms);
  CHECK(watch.answered().empty());
  CHECK(p.count("x") >= 2);  // probed again and again
  p.set_up("y");
  for (int i = 0; i < 500 && watch.answered().empty(); ++i)
    std::this_thread::sleep_for(10ms);
  CHECK(names(watch.answered()) == std::vector<std::string>{"y"});
  // It stops probing once a host answered.
  const int probes = p.count("x");
  std::this_thread::sleep_for(100ms);
  CHECK(p.count("x") == probes);
}

TEST_CASE("elastic: a host watch is stopped by its destructor while it waits") {
  ScriptedProbe p;
  const auto t0 = std::chrono::steady_clock::now();
  { HostWatch watch({host("x")}, p.probe(), 1h); }
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);  // bound against a hang, not a timing
  CHECK(p.count("x") == 0);                           // the first round comes after one interval
}

// A login that hangs (a host that takes the connection and never speaks SSH) until `release`;
// shared, as a probe given up on runs on after the test.
struct HangingProbe {
  std::shared_ptr<std::atomic<bool>> release = std::make_shared<std::atomic<bool>>(false);
  HostProbe probe() const {
    return [release = release](const HostSpec&) {
      while (!release->load())
        std::this_thread::sleep_for(10ms);
      return std::string("released");
    };
  }
  // The host named `name` hangs; the others answer as `others` says.
  HostProbe for_host(const std::string& name, const ScriptedProbe& others) const {
    return [name, other = others.probe(), h = probe()](const HostSpec& s) {
      return s.host == name ? h(s) : other(s);
    };
  }
  ~HangingProbe() { release->store(true); }
};

TEST_CASE("elastic: a probe that hangs is given up on at the wait's end, or at a stop") {
  HangingProbe hanging;
  SUBCASE("the wait's end") {
    ScriptedProbe p;
    p.state->up = {"a"};
    const HostProbe both = hanging.for_host("b", p);
    const auto sel = select_hosts({host("a"), host("b")}, 2, 1500ms, both, nullptr, 100ms);
    CHECK(names(sel.hosts) == std::vector<std::string>{"a"});
    REQUIRE(sel.absent.size() == 1);
    CHECK(sel.absent[0] == "b: no answer within 1.5 s (--rejoin-timeout)");
    CHECK_FALSE(sel.stopped);
  }
  SUBCASE("a stop") {
    std::atomic<bool> stop{false};
    std::thread later([&stop] {
      std::this_thread::sleep_for(200ms);
      stop = true;
    });
    const auto t0 = std::chrono::steady_clock::now();
    // Both hang (a probe given up on must hold nothing of the test's).
    const auto sel = select_hosts({host("a"), host("b")}, 2, 1h, hanging.probe(),
                                  [&stop] { return stop.load(); });
    later.join();
    CHECK(sel.stopped);
    CHECK(std::chrono::steady_clock::now() - t0 < 30s);  // bound against a hang, not a timing
  }
}

TEST_CASE("elastic: a host watch's destructor does not wait for a probe that hangs") {
  HangingProbe hanging;
  std::atomic<int> calls{0};
  const HostProbe counted = [&calls, h = hanging.probe()](const HostSpec& s) {
    ++calls;
    return h(s);
  };
  const auto t0 = std::chrono::steady_clock::now();
  {
    HostWatch watch({host("x")}, counted, 10ms);
    while (calls.load() == 0)
      std::this_thread::sleep_for(5ms);
  }
  CHECK(std::chrono::steady_clock::now() - t0 < 30s);  // bound against a hang, not a timing
}

TEST_CASE("elastic: a probe that hangs holds up no other host's") {
  HangingProbe hanging;
  ScriptedProbe p;
  p.state->up = {"b"};
  const HostProbe mixed = hanging.for_host("a", p);
  SUBCASE("a host that comes back meanwhile is taken, and one that hangs passed over") {
    std::thread back([&p] {
      std::this_thread::sleep_for(300ms);
      p.set_up("c");
    });
    // With an hour to wait, the selection ends when b and c answer, not at the wait's end.
    const auto sel = select_hosts({host("a"), host("b"), host("c")}, 2, 1h, mixed, nullptr, 50ms);
    back.join();
    CHECK(names(sel.hosts) == std::vector<std::string>{"b", "c"});
    REQUIRE(sel.absent.size() == 1);
    CHECK(sel.absent[0].rfind("a: no answer within ", 0) == 0);
    CHECK(p.count("c") >= 2);  // probed again while a's probe hung
  }
  SUBCASE("the wait is announced while the probe hangs") {
    std::vector<std::string> told;
    const auto sel =
        select_hosts({host("a"), host("b"), host("c")}, 3, 1500ms, mixed, nullptr, 100ms,
                     [&](const std::vector<std::string>& absent) { told = absent; });
    CHECK(told == std::vector<std::string>{"a: no answer yet", "c: connection refused"});
    CHECK(names(sel.hosts) == std::vector<std::string>{"b"});
    CHECK(sel.absent == std::vector<std::string>{"a: no answer within 1.5 s (--rejoin-timeout)",
                                                 "c: connection refused"});
  }
}

TEST_CASE("elastic: a host watch probes the others while one probe hangs") {
  HangingProbe hanging;
  ScriptedProbe p;
  const HostProbe mixed = hanging.for_host("x", p);
  HostWatch watch({host("x"), host("y")}, mixed, 20ms);
  std::this_thread::sleep_for(200ms);
  CHECK(p.count("y") >= 2);
  p.set_up("y");
  for (int i = 0; i < 3000 && watch.answered().empty(); ++i)
    std::this_thread::sleep_for(10ms);
  CHECK(names(watch.answered()) == std::vector<std::string>{"y"});
}

TEST_CASE("elastic: a wait of 0 still gives up on a probe that hangs; all the hosts there are do") {
  HangingProbe hanging;
  ScriptedProbe p;
  p.state->up = {"b"};
  const HostProbe mixed = hanging.for_host("a", p);
  // --rejoin-timeout 0: the hanging probe is given up on after its second, not held until the
  // login's own timeout.
  const auto sel = select_hosts({host("a"), host("b")}, 2, 0ms, mixed, nullptr, 100ms);
  CHECK(names(sel.hosts) == std::vector<std::string>{"b"});
  CHECK(sel.absent == std::vector<std::string>{"a: no answer within 0 s (--rejoin-timeout)"});
  // Fewer candidates than the job's maximum (one was left out), every one answering: nothing
  // more to wait for. (The bound is against a wait of the hour, not a timing.)
  const auto t0 = std::chrono::steady_clock::now();
  const auto all = select_hosts({host("b")}, 2, 1h, p.probe(), nullptr);
  CHECK(names(all.hosts) == std::vector<std::string>{"b"});
  CHECK(std::chrono::steady_clock::now() - t0 < 30s);
}
