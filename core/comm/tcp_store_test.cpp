// Tests for the TCP store: real server and clients on 127.0.0.1, raw sockets for misbehaving peers.
#include <doctest/doctest.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <functional>
#include <optional>
#include <random>
#include <thread>

#include <fmt/format.h>

#include "core/comm/auth.hpp"
#include "core/comm/socket.hpp"
#include "core/comm/store_protocol.hpp"
#include "core/comm/tcp_store.hpp"
#include "core/error.hpp"

namespace dptrain {
namespace {

using namespace std::chrono_literals;

constexpr auto kConnectTimeout = 10s;
constexpr auto kLongWait = 20s;  // generous: only reached if something is broken

TcpStoreClient connect_to(const TcpStoreServer& server, const std::string& secret = "") {
  return TcpStoreClient("127.0.0.1", server.port(), kConnectTimeout, secret);
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

// A hello with `client_nonce` (empty: a client without a secret).
std::string hello_frame(const std::string& client_nonce = "") {
  return store_protocol::FrameWriter()
      .u8(static_cast<uint8_t>(store_protocol::Op::hello))
      .u32(store_protocol::kMagic)
      .u16(store_protocol::kVersion)
      .str(client_nonce)
      .finish();
}

// Reads one frame from a raw connection and returns its payload.
std::string receive_frame(int fd) {
  const auto deadline = std::chrono::steady_clock::now() + kLongWait;
  char header[store_protocol::kLengthBytes];
  recv_exact(fd, header, sizeof(header), deadline);
  std::string payload(store_protocol::frame_length(std::string_view(header, sizeof(header))), '\0');
  recv_exact(fd, payload.data(), payload.size(), deadline);
  return payload;
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
void check_still_serving(const TcpStoreServer& server, TcpStoreClient& existing,
                         const std::string& secret = "") {
  TcpStoreClient fresh = connect_to(server, secret);
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
  // peek: each key's value where it exists (empty and binary values too), nothing for the others.
  using Peeked = std::vector<std::optional<std::string>>;
  CHECK(store.peek({"a", "missing", "empty", "binary"}) ==
        Peeked{"again", std::nullopt, "", std::string("\0\xff\n", 3)});
  CHECK(store.peek({}).empty());
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
  // A key that is not there is a KeyTimeout: callers tell it from a store that failed.
  CHECK_THROWS_AS(store.get("gen1/rank3", 10ms), KeyTimeout);

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
    recv_exact(raw.get(), reply, 8, std::chrono::steady_clock::now() + kLongWait);  // hello's reply
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
  SUBCASE("a handshake frame of megabytes, before any proof") {
    // A stranger cannot make the server hold more than a handshake's size: dropped as soon as
    // the length is read, not once the bytes arrive.
    UniqueFd raw = raw_connection(server);
    std::string header(store_protocol::kLengthBytes, '\0');
    const uint32_t length = 8u << 20;
    for (size_t i = 0; i < header.size(); ++i)
      header[i] = static_cast<char>((length >> (8 * i)) & 0xff);
    send_all(raw.get(), header + std::string(1024, 'x'), deadline());
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
  send_all(raw.get(), hello, std::chrono::steady_clock::now() + kLongWait);
  const std::string reply = receive_frame(raw.get());
  store_protocol::FrameReader reader(reply);
  CHECK(reader.u8() == static_cast<uint8_t>(store_protocol::Status::error));
  CHECK(reader.str().find(fmt::format("protocol version {}, client speaks {}",
                                      store_protocol::kVersion, store_protocol::kVersion + 1)) !=
        std::string::npos);
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
  // Typed, for a caller that says who should serve the store (a hand-started rank).
  CHECK_THROWS_AS(TcpStoreClient("127.0.0.1", closed_port, 100ms), StoreUnreachable);
}

TEST_CASE("tcp store: a listener that accepts and stays silent is named, not waited on for ever") {
  // Another service on MASTER_PORT: the kernel accepts the connection, nothing answers. The
  // client gives up after its handshake timeout, not its (long) connect timeout.
  const UniqueFd silent = listen_tcp("127.0.0.1", 0);
  const uint16_t port = local_port(silent.get());
  const std::string message =
      error_message([&] { TcpStoreClient("127.0.0.1", port, std::chrono::hours(1), "", 300ms); },
                    ErrorKind::comm);
  CHECK(message == fmt::format("no handshake from store at 127.0.0.1:{}: something accepted the "
                               "connection but did not answer as a dptrain store within 0.3s "
                               "(another service on that port?)",
                               port));
  // A short connect timeout still leaves the handshake 5 s, and the message says so.
  const std::string floor =
      error_message([&] { TcpStoreClient("127.0.0.1", port, 1s, "", std::chrono::seconds(30)); },
                    ErrorKind::comm);
  CHECK(floor.find("did not answer as a dptrain store within 5s ") != std::string::npos);
}

TEST_CASE("tcp store: a listener that answers as another service is named by its answer") {
  const UniqueFd other = listen_tcp("127.0.0.1", 0);
  const uint16_t port = local_port(other.get());
  std::thread service([&] {
    // (The listening socket does not block: wait for the client first.)
    struct pollfd ready {
      other.get(), POLLIN, 0
    };
    if (::poll(&ready, 1, 30000) != 1) return;
    const int fd = ::accept(other.get(), nullptr, nullptr);
    if (fd < 0) return;
    const std::string_view answer = "HTTP/1.1 400 Bad Request\r\n\r\n";
    CHECK(::send(fd, answer.data(), answer.size(), MSG_NOSIGNAL) ==
          static_cast<ssize_t>(answer.size()));
    char ignored[256];
    while (::recv(fd, ignored, sizeof(ignored), 0) > 0) {
    }
    ::close(fd);
  });
  const std::string message =
      error_message([&] { TcpStoreClient("127.0.0.1", port, 2s); }, ErrorKind::comm);
  service.join();
  CHECK(message == fmt::format("no handshake from store at 127.0.0.1:{}: it answered 'HTTP...', "
                               "not as a dptrain store (another service on that port?)",
                               port));
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

TEST_CASE("tcp store: a store that served a client and is gone fails its next request at once") {
  auto server = std::make_unique<TcpStoreServer>();
  const uint16_t port = server->port();
  // A connect timeout far beyond the test's: a request that retried for it would hang the test.
  TcpStoreClient store("127.0.0.1", port, std::chrono::hours(1));
  store.set("k", "v");
  server->stop();
  server.reset();
  // The request on the connection it had: "connection closed by peer".
  try {
    store.get("k", 1s);
    FAIL("a get from a store that is gone succeeded");
  } catch (const KeyTimeout&) {
    FAIL("a store that is gone is not a missing key");
  } catch (const Error& e) {
    CHECK(e.kind() == ErrorKind::comm);
  }
  // The next ones would reconnect: nothing listens, and the store served this client, so it is
  // gone (not retried for the connect timeout, as at the start, when it may be yet to come).
  std::string message;
  try {
    store.check({"k"});
  } catch (const Error& e) {
    message = e.what();
  }
  CHECK_MESSAGE(
      message.find(fmt::format("store at 127.0.0.1:{} is gone", port)) != std::string::npos,
      message);
  CHECK_THROWS_WITH_AS(store.set("k", "w"), doctest::Contains("is gone"), Error);
}

// ---- job secret ----

// What a store on `port` says to a client it refuses for its secret.
std::string refusal_for(uint16_t port) {
  return fmt::format("store 127.0.0.1:{} refused this client: wrong or missing job secret", port);
}

void check_secret_not_in(const std::string& message, const std::string& secret) {
  CHECK_MESSAGE(message.find(secret) == std::string::npos, message);
}

std::string auth_frame(const std::string& proof) {
  return store_protocol::FrameWriter()
      .u8(static_cast<uint8_t>(store_protocol::Op::auth))
      .str(proof)
      .finish();
}

// A raw connection that has sent hello with `client_nonce` and read the challenge.
struct ChallengedConnection {
  UniqueFd fd;
  std::string client_nonce;
  std::string server_nonce;
};

ChallengedConnection challenged_connection(const TcpStoreServer& server) {
  ChallengedConnection connection{raw_connection(server), random_bytes(kAuthNonceBytes), {}};
  send_all(connection.fd.get(), hello_frame(connection.client_nonce),
           std::chrono::steady_clock::now() + kLongWait);
  const std::string reply = receive_frame(connection.fd.get());
  store_protocol::FrameReader reader(reply);
  REQUIRE(reader.u8() == static_cast<uint8_t>(store_protocol::Status::ok));
  CHECK(reader.u16() == store_protocol::kVersion);
  REQUIRE(reader.u8() == static_cast<uint8_t>(store_protocol::Auth::required));
  connection.server_nonce = reader.str();
  reader.expect_end();
  CHECK(connection.server_nonce.size() == kAuthNonceBytes);
  return connection;
}

// The reason in the error frame a server sends before it closes a connection.
std::string refusal_reason(int fd) {
  const std::string reply = receive_frame(fd);
  store_protocol::FrameReader reader(reply);
  CHECK(reader.u8() == static_cast<uint8_t>(store_protocol::Status::error));
  return reader.str();
}

TEST_CASE("tcp store with a secret: a client with the secret works, also after reconnecting") {
  const std::string secret = generate_job_secret();
  auto server = std::make_unique<TcpStoreServer>("127.0.0.1", 0, secret);
  const uint16_t port = server->port();
  TcpStoreClient store = connect_to(*server, secret);
  store.set("a", "alpha");
  CHECK(store.get("a", 1s) == "alpha");
  CHECK(store.add("n", 2) == 2);
  CHECK(store.check({"a", "n"}));
  store.wait({"a"}, 1s);
  PrefixStore generation("gen1", store);
  generation.set("rank0", "ready");
  CHECK(store.get("gen1/rank0", 1s) == "ready");

  // A store restarted on the same port: the request in flight fails, the next one reconnects and
  // proves the secret again.
  server.reset();
  server = std::make_unique<TcpStoreServer>("127.0.0.1", port, secret);
  check_secret_not_in(error_message([&] { store.set("b", "lost"); }, ErrorKind::comm), secret);
  store.set("b", "beta");
  CHECK(store.get("b", 1s) == "beta");
  CHECK_FALSE(store.check({"a"}));  // really the new store
}

TEST_CASE("tcp store with a secret: wrong and missing secrets are refused, the job goes on") {
  const std::string secret = generate_job_secret();
  const std::string wrong_secret = generate_job_secret();
  TcpStoreServer server("127.0.0.1", 0, secret);
  constexpr int kLegitimateAdds = 300;
  std::string legitimate_failure;
  std::thread legitimate([&] {
    try {
      TcpStoreClient store = connect_to(server, secret);
      for (int i = 0; i < kLegitimateAdds; ++i)
        store.add("progress", 1);
    } catch (const Error& error) {
      legitimate_failure = error.what();
    }
  });
  std::vector<std::string> messages;
  for (int i = 0; i < 10; ++i) {
    messages.push_back(error_message([&] { connect_to(server, wrong_secret); }, ErrorKind::usage));
    messages.push_back(error_message([&] { connect_to(server); }, ErrorKind::usage));
    // Close to the secret is as wrong as anything else.
    messages.push_back(
        error_message([&] { connect_to(server, secret.substr(1)); }, ErrorKind::usage));
  }
  legitimate.join();
  CHECK(legitimate_failure.empty());
  for (const auto& message : messages) {
    CHECK_MESSAGE(message.starts_with(refusal_for(server.port())), message);
    check_secret_not_in(message, secret);
    check_secret_not_in(message, wrong_secret);
    check_secret_not_in(message, secret.substr(1));
  }
  // The one without a secret also says where the secret comes from.
  CHECK(messages[1].find(kStoreSecretEnv) != std::string::npos);
  TcpStoreClient store = connect_to(server, secret);
  CHECK(store.add("progress", 0) == kLegitimateAdds);
}

TEST_CASE("tcp store: a client that stalls in the handshake is dropped after the auth timeout") {
  std::string secret;
  SUBCASE("without a secret") {}
  SUBCASE("with a secret") {
    secret = generate_job_secret();
  }
  TcpStoreServer server("127.0.0.1", 0, secret, 300ms);
  UniqueFd silent = raw_connection(server);
  std::optional<ChallengedConnection> unproven;
  if (!secret.empty()) unproven = challenged_connection(server);
  // Others are served while the stalled connections are open...
  TcpStoreClient store = connect_to(server, secret);
  store.set("alive", "yes");
  CHECK(store.get("alive", 1s) == "yes");
  // ...and the stalled ones are told why and closed.
  CHECK(refusal_reason(silent.get()) == "no hello within 0.3s");
  CHECK(closed_by_server(silent.get()));
  if (unproven) {
    CHECK(refusal_reason(unproven->fd.get()) == "no proof of the job secret within 0.3s");
    CHECK(closed_by_server(unproven->fd.get()));
  }
  check_still_serving(server, store, secret);
}

TEST_CASE("tcp store with a secret: anything but the right proof is refused") {
  const std::string secret = generate_job_secret();
  TcpStoreServer server("127.0.0.1", 0, secret);
  TcpStoreClient store = connect_to(server, secret);
  ChallengedConnection raw = challenged_connection(server);
  const auto send = [&](const std::string& bytes) {
    send_all(raw.fd.get(), bytes, std::chrono::steady_clock::now() + 1s);
  };
  const auto expect_refusal = [&] {
    CHECK(refusal_reason(raw.fd.get()) == store_protocol::kWrongSecretReason);
    CHECK(closed_by_server(raw.fd.get()));
  };

  SUBCASE("the right proof is accepted and the server proves itself back") {
    send(auth_frame(auth_proof(secret, AuthRole::client, raw.server_nonce, raw.client_nonce)));
    const std::string reply = receive_frame(raw.fd.get());
    store_protocol::FrameReader reader(reply);
    CHECK(reader.u8() == static_cast<uint8_t>(store_protocol::Status::ok));
    CHECK(auth_proof_matches(reader.str(), secret, AuthRole::server, raw.client_nonce,
                             raw.server_nonce));
    send(store_protocol::FrameWriter()
             .u8(static_cast<uint8_t>(store_protocol::Op::set))
             .str("raw")
             .str("in")
             .finish());
    CHECK(receive_frame(raw.fd.get()) == std::string(1, '\0'));
    CHECK(store.get("raw", 1s) == "in");
  }
  SUBCASE("random bytes as the proof") {
    send(auth_frame(random_bytes(kAuthProofBytes)));
    expect_refusal();
  }
  SUBCASE("an empty proof") {
    send(auth_frame(""));
    expect_refusal();
  }
  SUBCASE("a proof made with another secret") {
    send(auth_frame(
        auth_proof(generate_job_secret(), AuthRole::client, raw.server_nonce, raw.client_nonce)));
    expect_refusal();
  }
  SUBCASE("a proof for another challenge, as if replayed from an earlier connection") {
    send(auth_frame(
        auth_proof(secret, AuthRole::client, random_bytes(kAuthNonceBytes), raw.client_nonce)));
    expect_refusal();
  }
  SUBCASE("the server's kind of proof reflected back") {
    send(auth_frame(auth_proof(secret, AuthRole::server, raw.client_nonce, raw.server_nonce)));
    expect_refusal();
  }
  SUBCASE("an auth message with trailing garbage") {
    const std::string proof =
        auth_proof(secret, AuthRole::client, raw.server_nonce, raw.client_nonce);
    send(store_protocol::FrameWriter()
             .u8(static_cast<uint8_t>(store_protocol::Op::auth))
             .str(proof)
             .u32(0xdeadbeef)
             .finish());
    expect_refusal();
  }
  SUBCASE("a request instead of the proof") {
    send(store_protocol::FrameWriter()
             .u8(static_cast<uint8_t>(store_protocol::Op::set))
             .str("intruder")
             .str("x")
             .finish());
    expect_refusal();
    CHECK_FALSE(store.check({"intruder"}));
  }
  SUBCASE("bytes that are not a frame") {
    std::mt19937 random(7);
    std::string garbage;
    for (int i = 0; i < 4096; ++i)
      garbage.push_back(static_cast<char>(random() & 0xff));
    send(garbage);
    CHECK(closed_by_server(raw.fd.get()));
  }
  check_still_serving(server, store, secret);
}

TEST_CASE("tcp store without a secret: a client with one refuses it, and it serves the rest") {
  TcpStoreServer server;
  const std::string secret = generate_job_secret();
  const std::string message = error_message([&] { connect_to(server, secret); }, ErrorKind::usage);
  CHECK(message == fmt::format("store 127.0.0.1:{} does not ask for the job secret, so it cannot "
                               "be this job's store (another job's store or an older dptrain on "
                               "that port?)",
                               server.port()));
  TcpStoreClient store = connect_to(server);
  check_still_serving(server, store);
}

// A listener that plays a store: it challenges the client and accepts any proof, but cannot prove
// a secret it does not have.
class FakeStore {
 public:
  FakeStore() : listener_(listen_tcp("127.0.0.1", 0)), thread_([this] { run(); }) {}
  ~FakeStore() { thread_.join(); }
  uint16_t port() const { return local_port(listener_.get()); }

 private:
  void run() {
    const auto deadline = std::chrono::steady_clock::now() + kLongWait;
    pollfd entry{listener_.get(), POLLIN, 0};
    if (poll(&entry, 1, static_cast<int>(kLongWait / 1ms)) <= 0) return;
    UniqueFd client(accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!client) return;
    try {
      receive_frame(client.get());  // hello
      send_all(client.get(),
               store_protocol::FrameWriter()
                   .u8(static_cast<uint8_t>(store_protocol::Status::ok))
                   .u16(store_protocol::kVersion)
                   .u8(static_cast<uint8_t>(store_protocol::Auth::required))
                   .str(random_bytes(kAuthNonceBytes))
                   .finish(),
               deadline);
      receive_frame(client.get());  // the client's proof, taken at face value
      send_all(client.get(),
               store_protocol::FrameWriter()
                   .u8(static_cast<uint8_t>(store_protocol::Status::ok))
                   .str(random_bytes(kAuthProofBytes))
                   .finish(),
               deadline);
      closed_by_server(client.get());  // here: until the client hangs up
    } catch (const Error&) {
      // The test's checks on the client say what went wrong.
    }
  }

  UniqueFd listener_;
  std::thread thread_;
};

TEST_CASE("tcp store with a secret: a client refuses a store that cannot prove the secret") {
  FakeStore fake;
  const std::string secret = generate_job_secret();
  const std::string message = error_message(
      [&] { TcpStoreClient("127.0.0.1", fake.port(), kConnectTimeout, secret); }, ErrorKind::usage);
  CHECK(message == fmt::format("store 127.0.0.1:{} accepted this client but could not prove it "
                               "holds the job secret itself, so it is not this job's store: "
                               "refusing to use it",
                               fake.port()));
  check_secret_not_in(message, secret);
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
  CHECK(gen1.peek({"only1", "rank0"}) == std::vector<std::optional<std::string>>{"x", "old"});
  CHECK(gen2.peek({"only1", "rank0"}) ==
        std::vector<std::optional<std::string>>{std::nullopt, "new"});
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
  // Each says what is wrong with it.
  for (const auto& [bad, why] : std::vector<std::pair<std::string, std::string>>{
           {"[::1]", "no port"},
           {"[::1:1234", "no closing bracket"},
           {"[::1]1234", "':' and a port must follow the bracket"},
           {"::1:1234", "an IPv6 address needs brackets"},
           {"host", "no port"},
           {"host:99999", "port must be a number in 1..65535"}}) {
    CAPTURE(bad);
    CHECK(error_message([&] { parse_host_port(bad); }, ErrorKind::usage) ==
          "invalid address '" + bad + "': " + why + " (expected HOST:PORT or [IPV6]:PORT)");
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

TEST_CASE("join hint: a timeout shorter than ranks take to start is named as a cause") {
  CHECK(join_hint(30s) == "start every rank with the same store and world size");
  CHECK(join_hint(10s) == "start every rank with the same store and world size");
  CHECK(join_hint(1ms) ==
        "start every rank with the same store and world size, or give them longer than 0.001s "
        "to start (distributed.timeout_s, or a worker's --timeout)");
}

TEST_CASE("join hint: a store's advice, which a prefix store over it starts with") {
  TcpStoreServer server;
  TcpStoreClient client = connect_to(server);
  client.set_join_advice({"the launcher started them", "bench's --timeout"});
  PrefixStore prefixed("gen0", client);
  CHECK(join_hint(1ms, prefixed.join_advice()) ==
        "the launcher started them, or give them longer than 0.001s to start (bench's --timeout)");
  CHECK(join_hint(30s, prefixed.join_advice()) == "the launcher started them");
  prefixed.set_join_advice({});
  CHECK(join_hint(30s, prefixed.join_advice()) ==
        "start every rank with the same store and world size");
  CHECK(client.join_advice().check == "the launcher started them");
}

}  // namespace
}  // namespace dptrain
