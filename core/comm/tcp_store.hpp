// The rendezvous store over TCP: an in-process server (one poll-loop thread) and its client.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/comm/socket.hpp"
#include "core/comm/store.hpp"

namespace dptrain {

// Serves the store on bind_host:port from a background thread until stop() or destruction. One
// thread multiplexes every connection, so a client blocked in get/wait never holds up the others; a
// client that disconnects or sends bytes that are not the protocol only loses its own connection.
//
// With a non-empty `secret` (see auth.hpp) every connection must prove it holds the secret before
// the server reads a request, and the server proves it back; a connection that has not finished
// its handshake within `auth_timeout` is dropped. With or without a secret the server never
// writes the secret anywhere.
class TcpStoreServer {
 public:
  // Long enough for a rank on a machine busy starting many (hundreds of ranks on a few cores
  // took over 5 s to answer): a silent connection holds a descriptor and one of the server's
  // connection slots that long.
  static constexpr std::chrono::milliseconds kDefaultAuthTimeout{30000};

  // Port 0 picks a free port; see port(). Throws Error(comm) if it cannot listen.
  explicit TcpStoreServer(const std::string& bind_host = "127.0.0.1", uint16_t port = 0,
                          std::string secret = "",
                          std::chrono::milliseconds auth_timeout = kDefaultAuthTimeout);
  ~TcpStoreServer();
  TcpStoreServer(const TcpStoreServer&) = delete;
  TcpStoreServer& operator=(const TcpStoreServer&) = delete;

  uint16_t port() const;
  // Closes every connection and joins the thread; idempotent.
  void stop();

 private:
  class Loop;
  std::unique_ptr<Loop> loop_;
  std::thread thread_;
};

// What a TcpStoreClient throws when nothing it could connect to answered at the store's address
// within its connect timeout (no store started there yet, a wrong address, a firewall): a caller
// can say who should serve it. Not a store that answered and refused, nor one that served this
// client and is gone (refused at once); a reconnect in mid-run that times out throws it too.
class StoreUnreachable : public Error {
 public:
  explicit StoreUnreachable(const std::string& message) : Error(ErrorKind::comm, message) {}
};

// A Store talking to a TcpStoreServer over one connection. Thread-safe: requests from several
// threads are serialised. After a broken connection the next request reconnects (and
// authenticates again); when nothing listens at the store's address any more (connection
// refused), the store is gone and the request fails at once, rather than after the connect
// timeout.
class TcpStoreClient : public Store {
 public:
  // Retries connecting until connect_timeout, then throws StoreUnreachable (an Error(comm))
  // "cannot reach store at HOST:PORT within Ns: <reason>". With a `secret`, the client proves it
  // and refuses a server that cannot prove it back (or does not ask for it); without one, a server
  // that asks for a secret refuses the client. A refusal of the secret throws Error(usage)
  // "store HOST:PORT refused this client: wrong or missing job secret" (a setting: exit 2), as do
  // a store that does not ask for it or cannot prove it; Error(comm) where the store served this
  // client before (a reconnect) or refused it for another reason (its timeout). A dptrain store
  // answers the handshake at once: a listener that accepts the connection and stays silent for
  // `handshake_timeout` (another service on that port) is an Error(comm) saying so, not a wait
  // for the whole connect_timeout.
  static constexpr std::chrono::milliseconds kHandshakeTimeout{30000};
  TcpStoreClient(std::string host, uint16_t port, std::chrono::milliseconds connect_timeout,
                 std::string secret = "",
                 std::chrono::milliseconds handshake_timeout = kHandshakeTimeout);
  ~TcpStoreClient() override;

  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  std::vector<std::optional<std::string>> peek(const std::vector<std::string>& keys) override;
  std::string describe() const override;

  const std::string& host() const { return host_; }
  uint16_t port() const { return port_; }
  // How long a request that never blocks on the server (set, add, check, peek) may take: 60 s by
  // default. A client whose requests may be given up on (heartbeats) sets a short one, so that a
  // store that stopped answering (its process frozen) holds no caller of it for a minute.
  void set_request_timeout(std::chrono::milliseconds timeout) { request_timeout_ = timeout; }

 private:
  struct Reply;
  void connect_locked();
  void handshake_locked(SteadyTime deadline);
  struct HelloReply;
  HelloReply parse_hello_reply(const std::string& fields) const;
  void authenticate_locked(const std::string& client_nonce, const HelloReply& hello,
                           SteadyTime deadline);
  Reply handshake_exchange_locked(const std::string& frame, SteadyTime deadline);
  Reply exchange_locked(const std::string& frame, SteadyTime deadline);
  // Sends one request and returns the reply's fields after an ok status; a timeout status throws
  // the key timeout error, an error status throws Error(comm) naming the request.
  std::string request(const std::string& frame, const std::string& what, SteadyTime deadline,
                      std::chrono::milliseconds key_timeout = {});

  std::string host_;
  uint16_t port_;
  std::chrono::milliseconds connect_timeout_;
  std::chrono::milliseconds handshake_timeout_;
  std::chrono::milliseconds request_timeout_{std::chrono::seconds(60)};
  // When the handshake in progress began: its messages say how long it waited.
  SteadyTime handshake_began_{};
  // Whether a connection was ever authenticated: a store that served this client and then
  // refuses connections is gone (its process ended), not yet to come.
  bool served_ = false;
  std::string secret_;
  std::mutex mutex_;
  UniqueFd socket_;
};

}  // namespace dptrain
