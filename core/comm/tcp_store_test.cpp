// Tests for the TCP store: real server and clients on 127.0.0.1, raw sockets for misbehaving peers.
#include <doctest/doctest.h>
#include <poll.h>
#include <sys/socket.h>

#include <atomic>
#include <functional>
#include <random>
#include <thread>

#include "core/comm/socket.hpp"
#include "core/comm/store_protocol.hpp"
#include "core/comm/tcp_store.hpp"
#include "core/error.hpp"

namespace dptrain {
namespace {

using namespace std::chrono_literals;

constexpr auto kConnectTimeout = 10s;
constexpr auto kLongWait = 20s;  // generous: only reached if something is broken

TcpStoreClient connect_to(const TcpStoreServer& server) {
  return TcpStoreClient("127.0.0.1", server.port(), kConnectTimeout);
}

std::string error_message(const std::function<void()>& action, ErrorKind expected_kind) {
  try {
    action();
  } catch (const Error& error) {
    CHECK(error.kind() == expected_kind);
    return error.what();
  }
  FAIL("expected an Error");
  return {};
}

UniqueFd raw_connection(const TcpStoreServer& server) {
  ConnectAttempt attempt =
      connect_tcp("127.0.0.1", server.port(), std::chrono::steady_clock::now() + kConnectTimeout);
  REQUIRE_MESSAGE(attempt.fd, attempt.failure);
  return std::move(attempt.fd);
}

std::string hello_frame() {
  return store_protocol::FrameWriter()
      .u8(static_cast<uint8_t>(store_protocol::Op::hello))
      .u32(store_protocol::kMagic)
      .u16(store_protocol::kVersion)
      .finish();
}

// True once the server has closed `fd` (EOF or reset), reading and discarding anything it sent
// first.
bool closed_by_server(int fd) {
  const auto deadline = std::chrono::steady_clock::now() + kLongWait;
  char buffer[256];
  while (std::chrono::steady_clock::now() < deadline) {
    pollfd entry{fd, POLLIN, 0};
    if (poll(&entry, 1, 100) <= 0) continue;
    const ssize_t received = recv(fd, buffer, sizeof(buffer), 0);
    if (received <= 0) return true;
  }
  return false;
}

// The server still answers a fresh client and an existing one.
void check_still_serving(const TcpStoreServer& server, TcpStoreClient& existing) {
  TcpStoreClient fresh = connect_to(server);
  fresh.set("alive", "yes");
  CHECK(existing.get("alive", kLongWait) == "yes");
  const int64_t after_fresh = fresh.add("alive-counter", 1);
  CHECK(existing.add("alive-counter", 0) == after_fresh);
}

TEST_CASE("tcp store: set, get, add, check and wait") {
  TcpStoreServer server;
  TcpStoreClient store = connect_to(server);
  CHECK(store.describe() == "store 127.0.0.1:" + std::to_string(server.port()));

  store.set("a", "alpha");
  store.set("empty", "");
  store.set("binary", std::string("\0\xff\n", 3));
  CHECK(store.get("a", 1s) == "alpha");
  CHECK(store.get("empty", 1s).empty());
  CHECK(store.get("binary", 1s) == std::string("\0\xff\n", 3));
  store.set("a", "again");
  CHECK(store.get("a", 1s) == "again");

  CHECK(store.add("counter", 5) == 5);
  CHECK(store.add("counter", -7) == -2);
  CHECK(store.add("counter", 0) == -2);
  CHECK(store.get("counter", 1s) == "-2");

  CHECK(store.check({"a", "counter"}));
  CHECK_FALSE(store.check({"a", "missing"}));
  CHECK(store.check({}));
  store.wait({"a", "counter"}, 1s);
  store.wait({}, 1s);

  const std::string large(5 << 20, 'x');
  store.set("large", large);
  CHECK(store.get("large", 1s) == large);
}

TEST_CASE("tcp store: a timed-out get names the key, the store and the timeout") {
  TcpStoreServer server;
  TcpStoreClient store = connect_to(server);
  const std::string message =
      error_message([&] { store.get("gen1/rank3", 200ms); }, ErrorKind::comm);
  CHECK(message == "timed out after 0.2s waiting for key 'gen1/rank3' at store 127.0.0.1:" +
                       std::to_string(server.port()));

  store.set("present", "1");
  const std::string wait_message = error_message(
      [&] {
        store.wait({"present", "absent1", "absent2"}, 100ms);
      },
      ErrorKind::comm);
  CHECK(wait_message.find("keys 'absent1', 'absent2'") != std::string::npos);
  CHECK(wait_message.find("'present'") == std::string::npos);
  // The connection stays usable after a timeout.
  CHECK(store.get("present", 1s) == "1");
}

TEST_CASE("tcp store: add on a non-counter value is rejected and the client keeps working") {
  TcpStoreServer server;
  TcpStoreClient store = connect_to(server);
  store.set("text", "hello");
  const std::string message = error_message([&] { store.add("text", 1); }, ErrorKind::comm);
  CHECK(message.find("add 'text'") != std::string::npos);
  CHECK(message.find("not an integer") != std::string::npos);
  store.set("max", std::to_string(INT64_MAX));
  CHECK(error_message([&] { store.add("max", 1); }, ErrorKind::comm).find("overflow") !=
        std::string::npos);
  CHECK(store.add("fine", 2) == 2);
}

TEST_CASE("tcp store: a blocked get does not hold up other clients") {
  TcpStoreServer server;
  TcpStoreClient waiter = connect_to(server);
  std::string received;
  std::thread blocked([&] { received = waiter.get("late", kLongWait); });

  TcpStoreClient other = connect_to(server);
  for (int i = 0; i < 20; ++i) {
    other.set("k" + std::to_string(i), std::to_string(i));
    CHECK(other.get("k" + std::to_string(i), 1s) == std::to_string(i));
    CHECK(other.add("n", 1) == i + 1);
  }
  other.set("late", "finally");
  blocked.join();
  CHECK(received == "finally");
}

TEST_CASE("tcp store: 64 concurrent clients") {
  TcpStoreServer server;
  constexpr int kClients = 64;
  constexpr int kAddsPerClient = 50;
  std::atomic<int> failures{0};
  std::vector<std::thread> threads;
  for (int c = 0; c < kClients; ++c) {
    threads.emplace_back([&, c] {
      try {
        TcpStoreClient store = connect_to(server);
        for (int i = 0; i < kAddsPerClient; ++i)
          store.add("shared", 1);
        store.set("client/" + std::to_string(c), std::to_string(c * 7));
        // Each client reads its neighbour's key, blocking until the neighbour got there.
        const int next = (c + 1) % kClients;
        if (store.get("client/" + std::to_string(next), kLongWait) != std::to_string(next * 7)) {
          ++failures;
        }
      } catch (const Error&) {
        ++failures;
      }
    });
  }
  for (auto& thread : threads)
    thread.join();
  CHECK(failures == 0);
  TcpStoreClient store = connect_to(server);
  CHECK(store.add("shared", 0) == kClients * kAddsPerClient);
}

TEST_CASE("tcp store: clients that disconnect mid-request do not disturb the server") {
  TcpStoreServer server;
  TcpStoreClient store = connect_to(server);

  {  // half a hello
    UniqueFd raw = raw_connection(server);
    const std::string hello = hello_frame();
    send_all(raw.get(), std::string_view(hello).substr(0, 5),
             std::chrono::steady_clock::now() + 1s);
  }
  {  // a full hello, then half of a set announcing a large value
    UniqueFd raw = raw_connection(server);
    std::string set = store_protocol::FrameWriter()
                          .u8(static_cast<uint8_t>(store_protocol::Op::set))
                          .str("half")
                          .str(std::string(100000, 'v'))
                          .finish();
    send_all(raw.get(), hello_frame() + set.substr(0, set.size() / 2),
             std::chrono::steady_clock::now() + 1s);
  }
  {  // a get that blocks on the server, then the client vanishes
    UniqueFd raw = raw_connection(server);
    std::string get = store_protocol::FrameWriter()
                          .u8(static_cast<uint8_t>(store_protocol::Op::get))
                          .str("later")
                          .u64(60000)
                          .finish();
    send_all(raw.get(), hello_frame() + get, std::chrono::steady_clock::now() + 1s);
    char reply[16];
    recv_exact(raw.get(), reply, 7, std::chrono::steady_clock::now() + kLongWait);  // hello's reply
  }
  check_still_serving(server, store);
  CHECK_FALSE(store.check({"half"}));
  store.set("later", "now");  // wakes the waiter of a connection that is gone
  check_still_serving(server, store);
}

TEST_CASE("tcp store: garbage on a socket drops only that connection") {
  TcpStoreServer server;
  TcpStoreClient store = connect_to(server);
  const auto deadline = [] { return std::chrono::steady_clock::now() + 1s; };

  SUBCASE("an absurd frame length") {
    UniqueFd raw = raw_connection(server);
    send_all(raw.get(), std::string(64, '\xff'), deadline());
    CHECK(closed_by_server(raw.get()));
  }
  SUBCASE("a well-formed frame that is not hello") {
    UniqueFd raw = raw_connection(server);
    send_all(raw.get(), store_protocol::FrameWriter().u8(3).str("x").u64(0).finish(), deadline());
    CHECK(closed_by_server(raw.get()));
  }
  SUBCASE("random bytes after a valid hello") {
    UniqueFd raw = raw_connection(server);
    std::mt19937 random(12345);
    std::string garbage = hello_frame();
    for (int i = 0; i < 4096; ++i)
      garbage.push_back(static_cast<char>(random() & 0xff));
    send_all(raw.get(), garbage, deadline());
    CHECK(closed_by_server(raw.get()));
  }
  SUBCASE("a frame whose fields overrun it") {
    UniqueFd raw = raw_connection(server);
    // A set whose key claims 4 GiB inside a 9-byte frame.
    std::string bogus = store_protocol::FrameWriter().u8(2).u32(0xffffffff).u32(0).finish();
    send_all(raw.get(), hello_frame() + bogus, deadline());
    CHECK(closed_by_server(raw.get()));
  }
  check_still_serving(server, store);
}

TEST_CASE("tcp store: a client speaking another protocol version is told so") {
  TcpStoreServer server;
  UniqueFd raw = raw_connection(server);
  const std::string hello = store_protocol::FrameWriter()
                                .u8(static_cast<uint8_t>(store_protocol::Op::hello))
                                .u32(store_protocol::kMagic)
                                .u16(store_protocol::kVersion + 1)
                                .finish();
  const auto deadline = std::chrono::steady_clock::now() + kLongWait;
  send_all(raw.get(), hello, deadline);
  char header[store_protocol::kLengthBytes];
  recv_exact(raw.get(), header, sizeof(header), deadline);
  std::string reply(store_protocol::frame_length(std::string_view(header, sizeof(header))), '\0');
  recv_exact(raw.get(), reply.data(), reply.size(), deadline);
  store_protocol::FrameReader reader(reply);
  CHECK(reader.u8() == static_cast<uint8_t>(store_protocol::Status::error));
  CHECK(reader.str().find("protocol version 1, client speaks 2") != std::string::npos);
  CHECK(closed_by_server(raw.get()));
}

TEST_CASE(
    "tcp store: a client pointed at a closed port fails within its timeout naming the address") {
  uint16_t closed_port = 0;
  {
    TcpStoreServer server;
    closed_port = server.port();
  }
  const std::string message =
      error_message([&] { TcpStoreClient("127.0.0.1", closed_port, 300ms); }, ErrorKind::comm);
  CHECK(message.find("cannot reach store at 127.0.0.1:" + std::to_string(closed_port) +
                     " within 0.3s") != std::string::npos);
  CHECK(message.find("refused") != std::string::npos);
}

TEST_CASE("tcp store: a client whose server stops gets a comm error, not a hang") {
  auto server = std::make_unique<TcpStoreServer>();
  TcpStoreClient store = connect_to(*server);
  std::string message;
  std::thread blocked(
      [&] { message = error_message([&] { store.get("never", kLongWait); }, ErrorKind::comm); });
  // Whether or not the get has reached the server yet, it must fail naming the store and key.
  std::this_thread::sleep_for(50ms);
  server->stop();
  blocked.join();
  CHECK(message.find("store 127.0.0.1:") != std::string::npos);
  CHECK(message.find("'never'") != std::string::npos);
}

TEST_CASE("prefix store: generations are isolated") {
  TcpStoreServer server;
  TcpStoreClient client = connect_to(server);
  PrefixStore gen1("gen1", client);
  PrefixStore gen2("gen2", client);

  gen1.set("rank0", "old");
  gen2.set("rank0", "new");
  CHECK(gen1.get("rank0", 1s) == "old");
  CHECK(gen2.get("rank0", 1s) == "new");
  CHECK(client.get("gen1/rank0", 1s) == "old");

  gen1.set("only1", "x");
  CHECK(gen1.check({"only1", "rank0"}));
  CHECK_FALSE(gen2.check({"only1"}));
  CHECK(gen1.add("count", 3) == 3);
  CHECK(gen2.add("count", 1) == 1);
  gen1.wait({"only1"}, 1s);

  CHECK(gen2.describe() == client.describe());
  const std::string message = error_message([&] { gen2.get("only1", 50ms); }, ErrorKind::comm);
  CHECK(message.find("'gen2/only1'") != std::string::npos);
}

TEST_CASE("parse_host_port") {
  CHECK(parse_host_port("127.0.0.1:4242") == std::pair<std::string, uint16_t>("127.0.0.1", 4242));
  CHECK(parse_host_port("head-node:1") == std::pair<std::string, uint16_t>("head-node", 1));
  CHECK(parse_host_port("[::1]:65535") == std::pair<std::string, uint16_t>("::1", 65535));
  for (const char* bad : {"", "host", "host:", ":80", "host:0", "host:65536", "host:12x", "::1:80",
                          "host:-1", "[]:80"}) {
    const std::string message = error_message([&] { parse_host_port(bad); }, ErrorKind::usage);
    CHECK_MESSAGE(message.find("'" + std::string(bad) + "'") != std::string::npos, bad);
  }
  CHECK(format_host_port("::1", 80) == "[::1]:80");
  CHECK(format_host_port("node", 80) == "node:80");
}

TEST_CASE("format_timeout") {
  CHECK(format_timeout(30s) == "30s");
  CHECK(format_timeout(1500ms) == "1.5s");
  CHECK(format_timeout(250ms) == "0.25s");
  CHECK(format_timeout(0ms) == "0s");
}

}  // namespace
}  // namespace dptrain
