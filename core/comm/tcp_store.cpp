// TcpStoreServer (a single-threaded poll loop over all connections) and TcpStoreClient.
#include "core/comm/tcp_store.hpp"

#include <fcntl.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <list>
#include <map>
#include <unordered_map>

#include <fmt/format.h>

#include "core/comm/auth.hpp"
#include "core/comm/store_protocol.hpp"
#include "core/error.hpp"

namespace dptrain {

namespace protocol = store_protocol;
using protocol::FrameReader;
using protocol::FrameWriter;
using protocol::Op;
using protocol::Status;
using Clock = std::chrono::steady_clock;

namespace {

// A deadline `timeout` from now; absurdly long timeouts are capped so the arithmetic cannot
// overflow.
SteadyTime deadline_after(std::chrono::milliseconds timeout) {
  constexpr std::chrono::milliseconds kLongest = std::chrono::hours(24 * 365);
  return Clock::now() + std::clamp(timeout, std::chrono::milliseconds(0), kLongest);
}

uint64_t timeout_field(std::chrono::milliseconds timeout) {
  return static_cast<uint64_t>(std::max<int64_t>(timeout.count(), 0));
}

// The one string left in an auth message: the proof. Empty if the message is malformed, which
// then fails verification like any other wrong proof.
std::string proof_field(FrameReader& message) {
  try {
    std::string proof = message.str();
    message.expect_end();
    return proof;
  } catch (const Error&) {
    return {};
  }
}

std::string quoted_keys(const std::vector<std::string>& keys) {
  std::string text;
  for (const auto& key : keys)
    text += (text.empty() ? "'" : ", '") + key + "'";
  return text;
}

}  // namespace

// ---- server ----

class TcpStoreServer::Loop {
 public:
  Loop(const std::string& host, uint16_t port, std::string secret,
       std::chrono::milliseconds auth_timeout);
  uint16_t port() const { return port_; }
  void run();
  void request_stop();

 private:
  // A connection reads requests only once it reaches `ready`.
  enum class Stage { hello, proof, ready };
  struct Connection {
    UniqueFd fd;
    std::string inbox;
    std::string outbox;
    Stage stage = Stage::hello;
    SteadyTime handshake_deadline;
    std::string client_nonce;  // the two nonces a client's proof must cover
    std::string server_nonce;
    bool parked = false;  // a get/wait is waiting for keys; later requests stay queued in inbox
    bool close_after_flush = false;
    bool dead = false;
  };
  struct Waiter {
    uint64_t connection;
    Op op;
    std::vector<std::string> keys;
    SteadyTime deadline;
  };

  static constexpr size_t kMaxConnections = 4096;
  static constexpr size_t kReadChunk = 64 * 1024;
  static constexpr int kChunksPerWakeup = 16;
  // A client that stops reading its replies cannot make the server hold more than this.
  static constexpr size_t kMaxOutbox = 2 * size_t{protocol::kMaxFrameBytes};
  // The largest frame before a connection is ready (hello, proof: tens of bytes): a stranger
  // cannot make the server buffer more than this.
  static constexpr uint32_t kMaxHandshakeFrame = 1024;
  // How long the listener rests after accept failed for want of descriptors or memory: the
  // pending connection keeps it readable, so polling it at once would spin.
  static constexpr std::chrono::milliseconds kAcceptPause{100};

  int poll_timeout_ms() const;
  SteadyTime earliest_deadline() const;
  void accept_connections();
  void read_from(uint64_t id, Connection& connection);
  void serve(uint64_t id);
  void handle(uint64_t id, Connection& connection, FrameReader request);
  void handle_hello(Connection& connection, FrameReader& request);
  void handle_proof(Connection& connection, Op op, FrameReader& request);
  // Replies with an error saying why, then closes the connection.
  void refuse(Connection& connection, const std::string& reason);
  void handle_add(Connection& connection, FrameReader& request);
  void park_or_reply(uint64_t id, Connection& connection, Op op, std::vector<std::string> keys,
                     uint64_t timeout_ms);
  void reply(Connection& connection, std::string frame);
  void flush(Connection& connection);
  void reply_to_waiter(const Waiter& waiter);
  void wake_waiters();
  void expire_waiters();
  void expire_handshakes();
  void sweep_dead();
  std::vector<std::string> missing(const std::vector<std::string>& keys) const;

  UniqueFd listener_;
  uint16_t port_;
  const std::string secret_;  // empty: connections need no proof
  const std::chrono::milliseconds auth_timeout_;
  UniqueFd wake_read_;
  UniqueFd wake_write_;
  std::atomic<bool> stopping_{false};
  SteadyTime accept_paused_until_{};
  bool accept_failure_said_ = false;
  std::map<uint64_t, Connection> connections_;
  uint64_t next_connection_id_ = 0;
  std::list<Waiter> waiters_;
  std::vector<uint64_t> resumable_;  // connections unparked since they were last served
  std::unordered_map<std::string, std::string> data_;
};

TcpStoreServer::Loop::Loop(const std::string& host, uint16_t port, std::string secret,
                           std::chrono::milliseconds auth_timeout)
    : listener_(listen_tcp(host, port)),
      port_(local_port(listener_.get())),
      secret_(std::move(secret)),
      auth_timeout_(auth_timeout) {
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC | O_NONBLOCK) != 0) {
    throw Error(ErrorKind::comm,
                fmt::format("store server: pipe failed: {}", std::strerror(errno)));
  }
  wake_read_.reset(pipe_fds[0]);
  wake_write_.reset(pipe_fds[1]);
}

void TcpStoreServer::Loop::request_stop() {
  stopping_ = true;
  const char byte = 0;
  // A full pipe already guarantees a wakeup, so a failed write needs no handling.
  [[maybe_unused]] const ssize_t written = write(wake_write_.get(), &byte, 1);
}

SteadyTime TcpStoreServer::Loop::earliest_deadline() const {
  SteadyTime earliest = SteadyTime::max();
  if (accept_paused_until_ != SteadyTime{}) earliest = accept_paused_until_;
  for (const auto& waiter : waiters_)
    earliest = std::min(earliest, waiter.deadline);
  for (const auto& [id, connection] : connections_) {
    if (connection.stage != Stage::ready)
      earliest = std::min(earliest, connection.handshake_deadline);
  }
  return earliest;
}

int TcpStoreServer::Loop::poll_timeout_ms() const {
  const SteadyTime earliest = earliest_deadline();
  if (earliest == SteadyTime::max()) return -1;
  // Round up so a waiter is never woken a little early and then left for another full poll.
  const auto left = std::chrono::ceil<std::chrono::milliseconds>(earliest - Clock::now());
  return static_cast<int>(std::clamp<int64_t>(left.count(), 0, 1 << 30));
}

void TcpStoreServer::Loop::run() {
  std::vector<pollfd> fds;
  std::vector<uint64_t> ids;
  while (!stopping_) {
    if (accept_paused_until_ != SteadyTime{} && Clock::now() >= accept_paused_until_)
      accept_paused_until_ = SteadyTime{};
    const bool accepting = accept_paused_until_ == SteadyTime{};
    fds.assign({{wake_read_.get(), POLLIN, 0},
                {listener_.get(), static_cast<short>(accepting ? POLLIN : 0), 0}});
    ids.clear();
    for (const auto& [id, connection] : connections_) {
      const short events = static_cast<short>(POLLIN | (connection.outbox.empty() ? 0 : POLLOUT));
      fds.push_back({connection.fd.get(), events, 0});
      ids.push_back(id);
    }
    if (poll(fds.data(), fds.size(), poll_timeout_ms()) < 0) {
      if (errno == EINTR) continue;
      std::fprintf(stderr, "dptrain: store server on port %u stopped: poll failed: %s\n", port_,
                   std::strerror(errno));
      return;
    }
    if (fds[0].revents != 0) break;
    if (fds[1].revents != 0) accept_connections();
    for (size_t i = 0; i < ids.size(); ++i) {
      const short revents = fds[i + 2].revents;
      auto found = connections_.find(ids[i]);
      if (revents == 0 || found == connections_.end() || found->second.dead) continue;
      if (revents & POLLOUT) flush(found->second);
      if (revents & (POLLIN | POLLHUP | POLLERR)) read_from(ids[i], found->second);
    }
    expire_waiters();
    expire_handshakes();
    while (!resumable_.empty()) {
      const uint64_t id = resumable_.back();
      resumable_.pop_back();
      serve(id);
    }
    sweep_dead();
  }
  // Refuse newcomers at once instead of leaving them to time out in the handshake.
  listener_.reset();
  connections_.clear();
}

void TcpStoreServer::Loop::accept_connections() {
  while (true) {
    UniqueFd fd(accept4(listener_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC));
    if (!fd) {
      const int error = errno;
      if (error == EMFILE || error == ENFILE || error == ENOBUFS || error == ENOMEM) {
        // The connection stays pending (its client waits in the handshake): tried again after
        // a pause, once connections that end have given descriptors back.
        accept_paused_until_ = Clock::now() + kAcceptPause;
        if (!accept_failure_said_) {
          accept_failure_said_ = true;
          std::fprintf(stderr,
                       "dptrain: warning: store server on port %u cannot accept connections: %s "
                       "(raise the limit on open files, ulimit -n)\n",
                       port_, std::strerror(error));
        }
      }
      return;  // EAGAIN, or a connection that went away before it was accepted
    }
    if (connections_.size() >= kMaxConnections) continue;  // closing it tells the client
    set_no_delay(fd.get());
    Connection& connection = connections_[next_connection_id_++];
    connection.fd = std::move(fd);
    // Bounds how long a silent peer can hold one of the kMaxConnections slots.
    connection.handshake_deadline = Clock::now() + auth_timeout_;
  }
}

void TcpStoreServer::Loop::read_from(uint64_t id, Connection& connection) {
  char chunk[kReadChunk];
  for (int i = 0; i < kChunksPerWakeup && !connection.dead; ++i) {
    const ssize_t received = recv(connection.fd.get(), chunk, sizeof(chunk), 0);
    if (received > 0) {
      connection.inbox.append(chunk, static_cast<size_t>(received));
      serve(id);
      continue;
    }
    if (received < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
    if (received < 0 && errno == EINTR) continue;
    // The peer closed (or reset) the connection: whatever it sent in full was served above.
    connection.dead = true;
  }
}

void TcpStoreServer::Loop::serve(uint64_t id) {
  auto found = connections_.find(id);
  if (found == connections_.end()) return;
  Connection& connection = found->second;
  try {
    while (!connection.dead && !connection.parked && !connection.close_after_flush &&
           connection.inbox.size() >= protocol::kLengthBytes) {
      const uint32_t length = protocol::frame_length(connection.inbox);
      const uint32_t most =
          connection.stage == Stage::ready ? protocol::kMaxFrameBytes : kMaxHandshakeFrame;
      if (length == 0 || length > most) {
        throw Error(ErrorKind::comm, fmt::format("frame length {} out of range", length));
      }
      if (connection.inbox.size() < protocol::kLengthBytes + length) break;
      const std::string frame = connection.inbox.substr(0, protocol::kLengthBytes + length);
      connection.inbox.erase(0, frame.size());
      handle(id, connection, FrameReader(std::string_view(frame).substr(protocol::kLengthBytes)));
    }
    // Only a client that ignores the protocol (pipelining while parked) gets this far.
    if (connection.inbox.size() > protocol::kLengthBytes + protocol::kMaxFrameBytes + kReadChunk) {
      throw Error(ErrorKind::comm, "too many queued bytes");
    }
  } catch (const std::exception&) {
    // Not our protocol, a client that misbehaves, or one whose request cannot be held (memory):
    // drop only this connection, never the store.
    connection.dead = true;
  }
}

void TcpStoreServer::Loop::handle(uint64_t id, Connection& connection, FrameReader request) {
  const auto op = static_cast<Op>(request.u8());
  switch (connection.stage) {
    case Stage::hello:
      if (op != Op::hello) throw Error(ErrorKind::comm, "first request is not hello");
      handle_hello(connection, request);
      return;
    case Stage::proof:
      handle_proof(connection, op, request);
      return;
    case Stage::ready:
      break;
  }
  switch (op) {
    case Op::set: {
      std::string key = request.str();
      std::string value = request.str();
      request.expect_end();
      data_[std::move(key)] = std::move(value);
      reply(connection, FrameWriter().u8(static_cast<uint8_t>(Status::ok)).finish());
      wake_waiters();
      return;
    }
    case Op::get: {
      std::string key = request.str();
      const uint64_t timeout_ms = request.u64();
      request.expect_end();
      park_or_reply(id, connection, op, {std::move(key)}, timeout_ms);
      return;
    }
    case Op::wait: {
      std::vector<std::string> keys = request.strs();
      const uint64_t timeout_ms = request.u64();
      request.expect_end();
      park_or_reply(id, connection, op, std::move(keys), timeout_ms);
      return;
    }
    case Op::add:
      handle_add(connection, request);
      return;
    case Op::check: {
      const std::vector<std::string> keys = request.strs();
      request.expect_end();
      const bool present = missing(keys).empty();
      reply(connection, FrameWriter().u8(static_cast<uint8_t>(Status::ok)).u8(present).finish());
      return;
    }
    case Op::peek: {
      const std::vector<std::string> keys = request.strs();
      request.expect_end();
      FrameWriter values;
      values.u8(static_cast<uint8_t>(Status::ok));
      for (const std::string& key : keys) {
        const auto found = data_.find(key);
        values.u8(found != data_.end()).str(found != data_.end() ? found->second : "");
      }
      reply(connection, values.finish());
      return;
    }
    case Op::hello:
    case Op::auth:
      break;
  }
  throw Error(ErrorKind::comm, fmt::format("unexpected op {}", static_cast<int>(op)));
}

void TcpStoreServer::Loop::handle_hello(Connection& connection, FrameReader& request) {
  const uint32_t magic = request.u32();
  const uint16_t version = request.u16();
  if (magic != protocol::kMagic) throw Error(ErrorKind::comm, "bad magic");
  if (version != protocol::kVersion) {
    refuse(connection, fmt::format("store speaks protocol version {}, client speaks {}",
                                   protocol::kVersion, version));
    return;
  }
  std::string client_nonce = request.str();
  request.expect_end();
  if (!client_nonce.empty() && client_nonce.size() != kAuthNonceBytes) {
    throw Error(ErrorKind::comm, "client nonce of the wrong length");
  }
  FrameWriter answer;
  answer.u8(static_cast<uint8_t>(Status::ok)).u16(protocol::kVersion);
  if (secret_.empty()) {
    connection.stage = Stage::ready;
    reply(connection, answer.u8(static_cast<uint8_t>(protocol::Auth::none)).finish());
    return;
  }
  connection.stage = Stage::proof;
  connection.client_nonce = std::move(client_nonce);
  connection.server_nonce = random_bytes(kAuthNonceBytes);
  reply(connection, answer.u8(static_cast<uint8_t>(protocol::Auth::required))
                        .str(connection.server_nonce)
                        .finish());
}

void TcpStoreServer::Loop::handle_proof(Connection& connection, Op op, FrameReader& request) {
  // A client without a secret sent no nonce: nothing it sends can prove anything.
  const bool proven = op == Op::auth && !connection.client_nonce.empty() &&
                      auth_proof_matches(proof_field(request), secret_, AuthRole::client,
                                         connection.server_nonce, connection.client_nonce);
  if (!proven) {
    refuse(connection, protocol::kWrongSecretReason);
    return;
  }
  // Only now, so the server never MACs anything for a peer that has not shown the secret.
  const std::string server_proof =
      auth_proof(secret_, AuthRole::server, connection.client_nonce, connection.server_nonce);
  connection.stage = Stage::ready;
  connection.client_nonce.clear();
  connection.server_nonce.clear();
  reply(connection, FrameWriter().u8(static_cast<uint8_t>(Status::ok)).str(server_proof).finish());
}

void TcpStoreServer::Loop::refuse(Connection& connection, const std::string& reason) {
  connection.close_after_flush = true;  // before reply(), which may flush at once
  reply(connection, FrameWriter().u8(static_cast<uint8_t>(Status::error)).str(reason).finish());
}

void TcpStoreServer::Loop::handle_add(Connection& connection, FrameReader& request) {
  const std::string key = request.str();
  const int64_t delta = request.i64();
  request.expect_end();
  std::string& value = data_[key];
  int64_t current = 0;
  const char* end = value.data() + value.size();
  const bool is_counter = value.empty() || std::from_chars(value.data(), end, current).ptr == end;
  int64_t updated = 0;
  if (!is_counter || __builtin_add_overflow(current, delta, &updated)) {
    const std::string why = is_counter ? fmt::format("adding {} to {} overflows", delta, current)
                                       : "the key holds a value that is not an integer counter";
    reply(connection, FrameWriter().u8(static_cast<uint8_t>(Status::error)).str(why).finish());
    return;
  }
  value = std::to_string(updated);
  reply(connection, FrameWriter().u8(static_cast<uint8_t>(Status::ok)).i64(updated).finish());
  wake_waiters();
}

void TcpStoreServer::Loop::park_or_reply(uint64_t id, Connection& connection, Op op,
                                         std::vector<std::string> keys, uint64_t timeout_ms) {
  Waiter waiter{id, op, std::move(keys),
                deadline_after(std::chrono::milliseconds(
                    static_cast<int64_t>(std::min<uint64_t>(timeout_ms, INT64_MAX))))};
  if (missing(waiter.keys).empty()) {
    reply_to_waiter(waiter);
    return;
  }
  connection.parked = true;
  waiters_.push_back(std::move(waiter));
}

void TcpStoreServer::Loop::reply_to_waiter(const Waiter& waiter) {
  Connection& connection = connections_.at(waiter.connection);
  FrameWriter frame;
  frame.u8(static_cast<uint8_t>(Status::ok));
  if (waiter.op == Op::get) frame.str(data_.at(waiter.keys.front()));
  reply(connection, frame.finish());
}

void TcpStoreServer::Loop::wake_waiters() {
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    if (!missing(it->keys).empty()) {
      ++it;
      continue;
    }
    reply_to_waiter(*it);
    connections_.at(it->connection).parked = false;
    resumable_.push_back(it->connection);
    it = waiters_.erase(it);
  }
}

void TcpStoreServer::Loop::expire_waiters() {
  const SteadyTime now = Clock::now();
  for (auto it = waiters_.begin(); it != waiters_.end();) {
    if (it->deadline > now) {
      ++it;
      continue;
    }
    Connection& connection = connections_.at(it->connection);
    reply(connection,
          FrameWriter().u8(static_cast<uint8_t>(Status::timeout)).strs(missing(it->keys)).finish());
    connection.parked = false;
    resumable_.push_back(it->connection);
    it = waiters_.erase(it);
  }
}

void TcpStoreServer::Loop::expire_handshakes() {
  const SteadyTime now = Clock::now();
  for (auto& [id, connection] : connections_) {
    if (connection.stage == Stage::ready || connection.dead ||
        connection.handshake_deadline > now) {
      continue;
    }
    if (connection.close_after_flush) {  // refused earlier, and the peer never read why
      connection.dead = true;
      continue;
    }
    const char* awaited = connection.stage == Stage::hello ? "hello" : "proof of the job secret";
    refuse(connection, fmt::format("no {} within {}", awaited, format_timeout(auth_timeout_)));
    connection.handshake_deadline = now + auth_timeout_;  // time for the refusal to drain
  }
}

void TcpStoreServer::Loop::reply(Connection& connection, std::string frame) {
  if (connection.dead) return;
  connection.outbox += frame;
  flush(connection);
  if (connection.outbox.size() > kMaxOutbox) connection.dead = true;
}

void TcpStoreServer::Loop::flush(Connection& connection) {
  while (!connection.outbox.empty() && !connection.dead) {
    const ssize_t sent =
        send(connection.fd.get(), connection.outbox.data(), connection.outbox.size(), MSG_NOSIGNAL);
    if (sent > 0) {
      connection.outbox.erase(0, static_cast<size_t>(sent));
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      return;
    } else if (errno != EINTR) {
      connection.dead = true;
    }
  }
  if (connection.outbox.empty() && connection.close_after_flush) connection.dead = true;
}

void TcpStoreServer::Loop::sweep_dead() {
  waiters_.remove_if([&](const Waiter& waiter) { return connections_.at(waiter.connection).dead; });
  std::erase_if(connections_, [](const auto& entry) { return entry.second.dead; });
}

std::vector<std::string> TcpStoreServer::Loop::missing(const std::vector<std::string>& keys) const {
  std::vector<std::string> result;
  for (const auto& key : keys) {
    if (!data_.contains(key)) result.push_back(key);
  }
  return result;
}

TcpStoreServer::TcpStoreServer(const std::string& bind_host, uint16_t port, std::string secret,
                               std::chrono::milliseconds auth_timeout)
    : loop_(std::make_unique<Loop>(bind_host, port, std::move(secret), auth_timeout)),
      thread_([this] { loop_->run(); }) {}

TcpStoreServer::~TcpStoreServer() {
  stop();
}

uint16_t TcpStoreServer::port() const {
  return loop_->port();
}

void TcpStoreServer::stop() {
  if (!thread_.joinable()) return;
  loop_->request_stop();
  thread_.join();
}

// ---- client ----

namespace {

// How much longer than a get/wait timeout the client waits for the server's own timeout reply.
// (Requests that never block on the server are bounded by the client's request timeout.)
constexpr std::chrono::seconds kTimeoutReplyGrace{10};
constexpr std::chrono::milliseconds kConnectRetryPause{100};

}  // namespace

struct TcpStoreClient::Reply {
  Status status;
  std::string fields;  // the payload after the status byte
};

struct TcpStoreClient::HelloReply {
  protocol::Auth auth;
  std::string server_nonce;  // with Auth::required
};

TcpStoreClient::TcpStoreClient(std::string host, uint16_t port,
                               std::chrono::milliseconds connect_timeout, std::string secret,
                               std::chrono::milliseconds handshake_timeout)
    : host_(std::move(host)),
      port_(port),
      connect_timeout_(connect_timeout),
      handshake_timeout_(handshake_timeout),
      secret_(std::move(secret)) {
  std::lock_guard lock(mutex_);
  connect_locked();
}

TcpStoreClient::~TcpStoreClient() = default;

std::string TcpStoreClient::describe() const {
  return "store " + format_host_port(host_, port_);
}

void TcpStoreClient::connect_locked() {
  const SteadyTime deadline = deadline_after(connect_timeout_);
  while (true) {
    ConnectAttempt attempt = connect_tcp(host_, port_, deadline);
    if (attempt.fd) {
      socket_ = std::move(attempt.fd);
      break;
    }
    if (served_ && attempt.refused) {
      throw Error(ErrorKind::comm,
                  fmt::format("store at {} is gone: it served this process, and now nothing "
                              "listens there ({})",
                              format_host_port(host_, port_), attempt.failure));
    }
    const auto now = Clock::now();
    if (now >= deadline) {
      throw StoreUnreachable(fmt::format("cannot reach store at {} within {}: {}",
                                         format_host_port(host_, port_),
                                         format_timeout(connect_timeout_), attempt.failure));
    }
    std::this_thread::sleep_for(std::min<Clock::duration>(kConnectRetryPause, deadline - now));
  }
  // At least 5 s, at most handshake_timeout_, else what is left of the connect timeout.
  const SteadyTime now = Clock::now();
  handshake_began_ = now;
  handshake_locked(
      std::min(std::max(deadline, now + std::chrono::seconds(5)), now + handshake_timeout_));
}

void TcpStoreClient::handshake_locked(SteadyTime deadline) {
  // Without a secret the client sends no nonce: it could not check the server's proof anyway.
  const std::string client_nonce = secret_.empty() ? std::string() : random_bytes(kAuthNonceBytes);
  const std::string hello = FrameWriter()
                                .u8(static_cast<uint8_t>(Op::hello))
                                .u32(protocol::kMagic)
                                .u16(protocol::kVersion)
                                .str(client_nonce)
                                .finish();
  const Reply answer = handshake_exchange_locked(hello, deadline);
  if (answer.status != Status::ok) {
    socket_.reset();
    throw Error(ErrorKind::comm,
                fmt::format("store at {} refused the handshake: {}", format_host_port(host_, port_),
                            FrameReader(answer.fields).str()));
  }
  try {
    authenticate_locked(client_nonce, parse_hello_reply(answer.fields), deadline);
    served_ = true;
  } catch (const Error&) {
    // Not authenticated, so the connection must not serve requests.
    socket_.reset();
    throw;
  }
}

TcpStoreClient::HelloReply TcpStoreClient::parse_hello_reply(const std::string& fields) const {
  try {
    FrameReader reader(fields);
    reader.u16();  // the server's version, equal to ours since it accepted the hello
    HelloReply hello{static_cast<protocol::Auth>(reader.u8()), {}};
    if (hello.auth == protocol::Auth::required) {
      hello.server_nonce = reader.str();
      if (hello.server_nonce.size() != kAuthNonceBytes) {
        throw Error(ErrorKind::comm, fmt::format("a nonce of {} bytes, not {}",
                                                 hello.server_nonce.size(), kAuthNonceBytes));
      }
    } else if (hello.auth != protocol::Auth::none) {
      throw Error(ErrorKind::comm,
                  fmt::format("unknown authentication mode {}", static_cast<int>(hello.auth)));
    }
    reader.expect_end();
    return hello;
  } catch (const Error& error) {
    throw Error(ErrorKind::comm,
                fmt::format("{} sent a malformed handshake: {}", describe(), error.what()));
  }
}

void TcpStoreClient::authenticate_locked(const std::string& client_nonce, const HelloReply& hello,
                                         SteadyTime deadline) {
  // A refusal of the secret is a setting (the secret, the store's address), not a fault a retry
  // or a restart would cure: a usage error (exit 2), as a wrong --store's world size is. Not for
  // a client the store served before (a reconnect in mid-run meeting another listener on the
  // port: the store is gone), nor for the store's timeout waiting for the proof (a busy machine).
  const ErrorKind refused = served_ ? ErrorKind::comm : ErrorKind::usage;
  if (hello.auth == protocol::Auth::none) {
    if (secret_.empty()) return;
    // Any listener can skip the challenge; only one that proves the secret is this job's store.
    throw Error(refused,
                fmt::format("{} does not ask for the job secret, so it cannot be this job's store "
                            "(another job's store or an older dptrain on that port?)",
                            describe()));
  }
  if (secret_.empty()) {
    throw Error(refused,
                fmt::format("{} refused this client: {} (this client has none; the launcher "
                            "passes it in {})",
                            describe(), protocol::kWrongSecretReason, kStoreSecretEnv));
  }
  const std::string proof =
      FrameWriter()
          .u8(static_cast<uint8_t>(Op::auth))
          .str(auth_proof(secret_, AuthRole::client, hello.server_nonce, client_nonce))
          .finish();
  const Reply verdict = handshake_exchange_locked(proof, deadline);
  if (verdict.status != Status::ok) {
    const std::string why = FrameReader(verdict.fields).str();
    throw Error(why == protocol::kWrongSecretReason ? refused : ErrorKind::comm,
                fmt::format("{} refused this client: {}", describe(), why));
  }
  FrameReader reader(verdict.fields);
  if (!auth_proof_matches(proof_field(reader), secret_, AuthRole::server, client_nonce,
                          hello.server_nonce)) {
    throw Error(refused,
                fmt::format("{} accepted this client but could not prove it holds the job secret "
                            "itself, so it is not this job's store: refusing to use it",
                            describe()));
  }
}

TcpStoreClient::Reply TcpStoreClient::handshake_exchange_locked(const std::string& frame,
                                                                SteadyTime deadline) {
  const auto waited = [this](SteadyTime until) {
    return std::chrono::duration_cast<std::chrono::milliseconds>(until - handshake_began_);
  };
  try {
    return exchange_locked(frame, deadline);
  } catch (const Error& error) {
    const bool silent = std::string_view(error.what()) == "timed out";
    throw Error(ErrorKind::comm,
                fmt::format("no handshake from store at {}: {}", format_host_port(host_, port_),
                            silent ? fmt::format("something accepted the connection but did not "
                                                 "answer as a dptrain store within {} (another "
                                                 "service on that port?)",
                                                 format_timeout(waited(deadline)))
                                   : std::string(error.what())));
  }
}

TcpStoreClient::Reply TcpStoreClient::exchange_locked(const std::string& frame,
                                                      SteadyTime deadline) {
  try {
    send_all(socket_.get(), frame, deadline);
    char header[protocol::kLengthBytes];
    recv_exact(socket_.get(), header, sizeof(header), deadline);
    const uint32_t length = protocol::frame_length(std::string_view(header, sizeof(header)));
    if (length == 0 || length > protocol::kMaxFrameBytes) {
      // Before the store answered as one (the handshake): the first bytes of another service's
      // answer (an HTTP server's "HTTP/1.1 400"), not a length.
      if (!served_) {
        throw Error(ErrorKind::comm,
                    fmt::format("it answered '{}...', not as a dptrain store (another service on "
                                "that port?)",
                                printable(std::string_view(header, sizeof(header)))));
      }
      throw Error(ErrorKind::comm, fmt::format("reply length {} out of range", length));
    }
    std::string payload(length, '\0');
    recv_exact(socket_.get(), payload.data(), payload.size(), deadline);
    return Reply{static_cast<Status>(payload.front()), payload.substr(1)};
  } catch (const Error&) {
    // The stream may be mid-frame: the next request starts on a fresh connection.
    socket_.reset();
    throw;
  }
}

std::string TcpStoreClient::request(const std::string& frame, const std::string& what,
                                    SteadyTime deadline, std::chrono::milliseconds key_timeout) {
  std::lock_guard lock(mutex_);
  if (!socket_) connect_locked();
  Reply answer;
  try {
    answer = exchange_locked(frame, deadline);
  } catch (const Error& error) {
    throw Error(ErrorKind::comm,
                fmt::format("lost connection to {} during {}: {}", describe(), what, error.what()));
  }
  switch (answer.status) {
    case Status::ok:
      return std::move(answer.fields);
    case Status::timeout:
      throw KeyTimeout(
          key_timeout_message(FrameReader(answer.fields).strs(), key_timeout, describe()));
    case Status::error:
      throw Error(ErrorKind::comm, fmt::format("{} rejected {}: {}", describe(), what,
                                               FrameReader(answer.fields).str()));
  }
  socket_.reset();
  throw Error(ErrorKind::comm, fmt::format("{} sent an unknown status {} for {}", describe(),
                                           static_cast<int>(answer.status), what));
}

void TcpStoreClient::set(const std::string& key, const std::string& value) {
  const std::string frame =
      FrameWriter().u8(static_cast<uint8_t>(Op::set)).str(key).str(value).finish();
  request(frame, fmt::format("set '{}'", key), deadline_after(request_timeout_));
}

std::string TcpStoreClient::get(const std::string& key, std::chrono::milliseconds timeout) {
  const std::string frame =
      FrameWriter().u8(static_cast<uint8_t>(Op::get)).str(key).u64(timeout_field(timeout)).finish();
  const std::string fields = request(frame, fmt::format("get '{}'", key),
                                     deadline_after(timeout + kTimeoutReplyGrace), timeout);
  return FrameReader(fields).str();
}

void TcpStoreClient::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  const std::string frame = FrameWriter()
                                .u8(static_cast<uint8_t>(Op::wait))
                                .strs(keys)
                                .u64(timeout_field(timeout))
                                .finish();
  request(frame, "wait for " + quoted_keys(keys), deadline_after(timeout + kTimeoutReplyGrace),
          timeout);
}

int64_t TcpStoreClient::add(const std::string& key, int64_t delta) {
  const std::string frame =
      FrameWriter().u8(static_cast<uint8_t>(Op::add)).str(key).i64(delta).finish();
  const std::string fields =
      request(frame, fmt::format("add '{}'", key), deadline_after(request_timeout_));
  return FrameReader(fields).i64();
}

bool TcpStoreClient::check(const std::vector<std::string>& keys) {
  const std::string frame = FrameWriter().u8(static_cast<uint8_t>(Op::check)).strs(keys).finish();
  const std::string fields =
      request(frame, "check " + quoted_keys(keys), deadline_after(request_timeout_));
  return FrameReader(fields).u8() != 0;
}

std::vector<std::optional<std::string>> TcpStoreClient::peek(const std::vector<std::string>& keys) {
  const std::string frame = FrameWriter().u8(static_cast<uint8_t>(Op::peek)).strs(keys).finish();
  // (Many keys: the first names them in a message.)
  const std::string what =
      keys.size() <= 3 ? "peek at " + quoted_keys(keys)
                       : fmt::format("peek at {} keys from '{}'", keys.size(), keys.front());
  const std::string fields = request(frame, what, deadline_after(request_timeout_));
  FrameReader reader(fields);
  std::vector<std::optional<std::string>> values;
  for (size_t i = 0; i < keys.size(); ++i) {
    const bool present = reader.u8() != 0;
    std::string value = reader.str();
    values.push_back(present ? std::optional<std::string>(std::move(value)) : std::nullopt);
  }
  reader.expect_end();
  return values;
}

}  // namespace dptrain
