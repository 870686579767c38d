// A small HTTP/1.1 server for moe-server: a thread per connection (at most max_connections),
// each request read under one deadline, so a client that sends its headers a byte at a time
// holds only its own thread and only until request_timeout_s; /health and new requests keep
// being answered meanwhile. Requests are parsed by RequestReader (bounded sizes, decoded
// bodies); responses are whole or chunked streams (server-sent events).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <set>
#include <string>

#include "serve/http/http_types.h"

namespace moe::serve::http {

using Handler = std::function<void(const Request&, Response&)>;
// The body of an error this layer answers by itself (408, 413, 431, 503, ...): the API decides
// its shape (OpenAI's error object). Returns (content type, body).
using ErrorBody = std::function<std::pair<std::string, std::string>(int status, const std::string& message)>;

// What the layer refused or dropped, for /metrics.
struct HttpStats {
  int64_t open_connections = 0;
  int64_t connections = 0;          // accepted, in all
  int64_t refused_connections = 0;  // over max_connections: 503
  int64_t timed_out = 0;            // 408: the request did not arrive in time
  int64_t rejected = 0;             // 400, 413, 415, 431: the request was malformed or too large
};

class Server {
 public:
  Server(Limits limits, Handler handler, ErrorBody error_body);
  ~Server();
  Server(const Server&) = delete;
  Server& operator=(const Server&) = delete;

  // Binds and listens; returns the port (useful with port 0). Throws kIo.
  int listen(const std::string& host, int port);
  // Accepts and serves until stop(); returns once every connection has ended. Connections still
  // receiving a request end at once; a handler in flight finishes (its writes bounded by
  // write_timeout_s), or is cut when its socket is shut after shutdown_grace_s.
  void run(double shutdown_grace_s = 10.0);
  // From any thread, e.g. a signal waiter.
  void stop();
  HttpStats stats() const;

 private:
  struct Connection;
  void serve(Connection* c);
  void refuse(int fd);
  void finished(Connection* c);

  Limits limits_;
  Handler handler_;
  ErrorBody error_body_;
  int listen_fd_ = -1;
  int wake_[2] = {-1, -1};  // a pipe that stop() writes to wake the accept loop
  std::atomic<bool> stopping_{false};
  mutable std::mutex m_;
  std::condition_variable all_done_;
  std::set<Connection*> live_;
  HttpStats stats_;
};

}  // namespace moe::serve::http
