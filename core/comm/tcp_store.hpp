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
class TcpStoreServer {
 public:
  // Port 0 picks a free port; see port(). Throws Error(comm) if it cannot listen.
  explicit TcpStoreServer(const std::string& bind_host = "127.0.0.1", uint16_t port = 0);
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

// A Store talking to a TcpStoreServer over one connection. Thread-safe: requests from several
// threads are serialised. After a broken connection the next request reconnects.
class TcpStoreClient : public Store {
 public:
  // Retries connecting until connect_timeout, then throws Error(comm)
  // "cannot reach store at HOST:PORT within Ns: <reason>".
  TcpStoreClient(std::string host, uint16_t port, std::chrono::milliseconds connect_timeout);
  ~TcpStoreClient() override;

  void set(const std::string& key, const std::string& value) override;
  std::string get(const std::string& key, std::chrono::milliseconds timeout) override;
  void wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) override;
  int64_t add(const std::string& key, int64_t delta) override;
  bool check(const std::vector<std::string>& keys) override;
  std::string describe() const override;

  const std::string& host() const { return host_; }
  uint16_t port() const { return port_; }

 private:
  struct Reply;
  void connect_locked();
  void handshake_locked(SteadyTime deadline);
  Reply exchange_locked(const std::string& frame, SteadyTime deadline);
  // Sends one request and returns the reply's fields after an ok status; a timeout status throws
  // the key timeout error, an error status throws Error(comm) naming the request.
  std::string request(const std::string& frame, const std::string& what, SteadyTime deadline,
                      std::chrono::milliseconds key_timeout = {});

  std::string host_;
  uint16_t port_;
  std::chrono::milliseconds connect_timeout_;
  std::mutex mutex_;
  UniqueFd socket_;
};

}  // namespace dptrain
