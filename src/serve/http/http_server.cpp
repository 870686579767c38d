#include "serve/http/http_server.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "core/socket_io.h"
#include "core/tcp_endpoint.h"
#include "moe/errors.h"
#include "serve/http/request_reader.h"

namespace moe::serve::http {

namespace {

using net::after;
using net::wait_fd;

// Writes all of `data`; a peer that accepts nothing for `timeout_s` seconds is given up on.
bool write_all(int fd, std::string_view data, double timeout_s) {
  return net::send_all(fd, data.data(), data.size(), after(timeout_s), timeout_s) == net::Io::kDone;
}

class SocketResponse : public Response {
 public:
  SocketResponse(int fd, double write_timeout_s, bool keep_alive)
      : fd_(fd), write_timeout_s_(write_timeout_s), keep_alive_(keep_alive) {}

  void add_header(std::string name, std::string value) override {
    headers_ += name + ": " + value + "\r\n";
  }
  void send(int status, std::string_view content_type, std::string_view body) override {
    if (started_) return;
    started_ = true;
    std::string out = head(status, content_type) + fmt::format("Content-Length: {}\r\n\r\n", body.size());
    out += body;
    ok_ = write_all(fd_, out, write_timeout_s_);
    complete_ = true;
  }
  bool begin_stream(int status, std::string_view content_type) override {
    if (started_) return false;
    started_ = streaming_ = true;
    ok_ = write_all(fd_, head(status, content_type) + "Transfer-Encoding: chunked\r\n\r\n", write_timeout_s_);
    return ok_;
  }
  bool write(std::string_view data) override {
    if (!streaming_ || !ok_ || complete_) return false;
    if (data.empty()) return true;  // an empty chunk would end the stream
    ok_ = write_all(fd_, fmt::format("{:x}\r\n", data.size()), write_timeout_s_) &&
          write_all(fd_, data, write_timeout_s_) && write_all(fd_, "\r\n", write_timeout_s_);
    return ok_;
  }
  void end_stream() override {
    if (!streaming_ || complete_) return;
    if (ok_) ok_ = write_all(fd_, "0\r\n\r\n", write_timeout_s_);
    complete_ = true;
  }
  bool client_connected() override {
    if (!ok_) return false;
    pollfd p{fd_, static_cast<short>(POLLIN | POLLRDHUP), 0};
    if (::poll(&p, 1, 0) <= 0) return true;
    if (p.revents & (POLLERR | POLLHUP | POLLRDHUP)) return false;
    char c;
    const ssize_t n = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
    return n != 0;  // 0: the peer closed; data (a pipelined request) or EAGAIN: still there
  }
  bool started() const override { return started_; }

  // Whether the connection can carry another request.
  bool reusable() const { return ok_ && complete_ && keep_alive_; }

 private:
  std::string head(int status, std::string_view content_type) const {
    return fmt::format("HTTP/1.1 {} {}\r\nContent-Type: {}\r\n{}Connection: {}\r\n", status, reason_phrase(status),
                       content_type, headers_, keep_alive_ ? "keep-alive" : "close");
  }

  int fd_;
  double write_timeout_s_;
  bool keep_alive_;
  std::string headers_;
  bool started_ = false, streaming_ = false, complete_ = false, ok_ = true;
};

}  // namespace

const char* reason_phrase(int status) {
  switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 400: return "Bad Request";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 413: return "Payload Too Large";
    case 415: return "Unsupported Media Type";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    default: return status < 400 ? "OK" : status < 500 ? "Bad Request" : "Internal Server Error";
  }
}

struct Server::Connection {
  int fd = -1;
  bool in_handler = false;  // guarded by Server::m_
};

Server::Server(Limits limits, Handler handler, ErrorBody error_body)
    : limits_(limits), handler_(std::move(handler)), error_body_(std::move(error_body)) {
  MOE_CHECK(limits_.max_connections > 0 && limits_.max_body_bytes > 0 && limits_.max_header_bytes > 0 &&
                limits_.max_headers > 0 && limits_.request_timeout_s > 0 && limits_.idle_timeout_s > 0 &&
                limits_.write_timeout_s > 0,
            kInvalidArgument, "every HTTP limit must be positive");
  MOE_CHECK(::pipe2(wake_, O_CLOEXEC | O_NONBLOCK) == 0, kIo, "cannot create a pipe: {}", std::strerror(errno));
}

Server::~Server() {
  stop();
  std::unique_lock lock(m_);
  all_done_.wait(lock, [&] { return live_.empty(); });
  lock.unlock();
  if (listen_fd_ >= 0) ::close(listen_fd_);
  ::close(wake_[0]);
  ::close(wake_[1]);
}

int Server::listen(const std::string& host, int port) {
  int bound = 0;
  listen_fd_ = net::listen_tcp({host, port}, &bound);
  return bound;
}

void Server::refuse(int fd) {
  // Best effort and never blocking: the accept loop must not wait on this client.
  auto [type, body] = error_body_(503, fmt::format("the server has {} open connections, its limit; retry later",
                                                   limits_.max_connections));
  const std::string out = fmt::format(
      "HTTP/1.1 503 Service Unavailable\r\nContent-Type: {}\r\nRetry-After: 1\r\nContent-Length: {}\r\n"
      "Connection: close\r\n\r\n{}",
      type, body.size(), body);
  [[maybe_unused]] const ssize_t n = ::send(fd, out.data(), out.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
  ::shutdown(fd, SHUT_WR);
  ::close(fd);
}

void Server::run(double shutdown_grace_s) {
  MOE_CHECK(listen_fd_ >= 0, kInvalidArgument, "HTTP server: listen() before run()");
  while (!stopping_) {
    pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_[0], POLLIN, 0}};
    if (::poll(fds, 2, -1) < 0) continue;
    if (fds[1].revents) break;
    if (!(fds[0].revents & POLLIN)) continue;
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EMFILE || errno == ENFILE) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      continue;
    }
    const int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // streamed tokens go out at once
    std::unique_lock lock(m_);
    if (static_cast<int>(live_.size()) >= limits_.max_connections) {
      ++stats_.refused_connections;
      lock.unlock();
      refuse(fd);
      continue;
    }
    auto* c = new Connection{fd};
    live_.insert(c);
    ++stats_.connections;
    lock.unlock();
    std::thread([this, c] {
      serve(c);
      finished(c);
    }).detach();
  }
  // Handlers in flight get the grace period to end (their requests were cancelled by then);
  // what remains is cut by shutting its socket, which fails its next write.
  std::unique_lock lock(m_);
  if (!all_done_.wait_for(lock, std::chrono::duration<double>(shutdown_grace_s), [&] { return live_.empty(); }))
    for (Connection* c : live_) ::shutdown(c->fd, SHUT_RDWR);
  all_done_.wait(lock, [&] { return live_.empty(); });
}

void Server::stop() {
  if (stopping_.exchange(true)) return;
  [[maybe_unused]] const ssize_t n = ::write(wake_[1], "x", 1);
  // Connections still receiving a request end now: shutdown never waits for a slow sender.
  std::lock_guard lock(m_);
  for (Connection* c : live_)
    if (!c->in_handler) ::shutdown(c->fd, SHUT_RDWR);
}

HttpStats Server::stats() const {
  std::lock_guard lock(m_);
  HttpStats s = stats_;
  s.open_connections = static_cast<int64_t>(live_.size());
  return s;
}

void Server::finished(Connection* c) {
  ::close(c->fd);
  std::lock_guard lock(m_);
  live_.erase(c);
  delete c;
  all_done_.notify_all();
}

void Server::serve(Connection* c) {
  const int fd = c->fd;
  RequestReader reader(limits_);
  std::string pending;  // received, not yet consumed by the reader
  char chunk[16384];
  bool first = true;
  auto answer_error = [&](int status, const std::string& message) {
    SocketResponse res(fd, limits_.write_timeout_s, false);
    auto [type, body] = error_body_(status, message);
    res.send(status, type, body);
  };
  for (;;) {
    // The first request must arrive within request_timeout_s of the connection; a later one
    // must start within idle_timeout_s and then arrive within request_timeout_s.
    auto deadline = after(first ? limits_.request_timeout_s : limits_.idle_timeout_s);
    bool begun = first;
    while (reader.state() == RequestReader::State::kNeedMore) {
      if (!pending.empty()) {
        pending.erase(0, reader.feed(pending));
        if (reader.state() != RequestReader::State::kNeedMore) break;
        if (reader.wants_continue()) {
          if (!write_all(fd, "HTTP/1.1 100 Continue\r\n\r\n", limits_.write_timeout_s)) return;
          reader.continue_sent();
        }
        // The reader keeps at most a partial line back; more than the header limit of it
        // unconsumed is a line no request has.
        if (pending.size() > limits_.max_header_bytes + sizeof chunk) {
          std::lock_guard lock(m_);
          ++stats_.rejected;
          return answer_error(431, "a request line or header line is too long");
        }
      }
      if (stopping_) return;
      if (!wait_fd(fd, POLLIN, deadline)) {
        if (!reader.started() && pending.empty()) return;  // an idle keep-alive connection: just close
        {
          std::lock_guard lock(m_);
          ++stats_.timed_out;
        }
        return answer_error(408, fmt::format("the request did not arrive within {:g} s", limits_.request_timeout_s));
      }
      const ssize_t n = ::recv(fd, chunk, sizeof chunk, 0);
      if (n == 0) {
        reader.feed_eof();
        return;  // the client is gone: nobody to answer
      }
      if (n < 0) {
        if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
        return;
      }
      pending.append(chunk, static_cast<size_t>(n));
      if (!begun) {
        begun = true;
        deadline = after(limits_.request_timeout_s);
      }
    }
    if (reader.state() == RequestReader::State::kFailed) {
      {
        std::lock_guard lock(m_);
        ++stats_.rejected;
      }
      return answer_error(reader.error_status(), reader.error());
    }
    bool keep_alive = false;
    const Request request = reader.take(&keep_alive);
    {
      std::lock_guard lock(m_);
      if (stopping_) return;
      c->in_handler = true;
    }
    SocketResponse res(fd, limits_.write_timeout_s, keep_alive);
    try {
      handler_(request, res);
      if (!res.started()) {
        auto [type, body] = error_body_(500, "the handler sent no response");
        res.send(500, type, body);
      }
    } catch (const std::exception& e) {
      if (!res.started()) {
        auto [type, body] = error_body_(500, e.what());
        res.send(500, type, body);
      }
    }
    res.end_stream();
    {
      std::lock_guard lock(m_);
      c->in_handler = false;
      if (stopping_ || !res.reusable()) return;
    }
    first = false;
  }
}

}  // namespace moe::serve::http
