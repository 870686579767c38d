// The HTTP server over loopback sockets, with small limits: a client that sends its request a
// byte at a time holds only its own connection (others are answered first) and is answered 408
// at the deadline; the connection cap answers 503; stop() does not wait for clients that never
// finish sending; responses are whole or chunked, and connections are kept alive.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <string>
#include <thread>
#include <vector>

#include "serve/http/http_server.h"

namespace moe::serve::http {
namespace {

// A running server on 127.0.0.1 with its accept loop on a thread.
struct Running {
  Server server;
  int port = 0;
  std::thread thread;
  explicit Running(const Limits& limits, Handler handler = nullptr)
      : server(limits,
               handler ? std::move(handler)
                       : Handler([](const Request& req, Response& res) {
                           if (req.path == "/stream") {
                             res.begin_stream(200, "text/plain");
                             res.write("one,");
                             res.write("two");
                             res.end_stream();
                           } else {
                             res.send(200, "text/plain", "path " + req.path + " body " + req.body);
                           }
                         }),
               [](int status, const std::string& message) {
                 return std::pair<std::string, std::string>("application/json",
                                                            "{\"status\":" + std::to_string(status) + ",\"message\":\"" +
                                                                message + "\"}");
               }) {
    port = server.listen("127.0.0.1", 0);
    thread = std::thread([this] { server.run(2.0); });
  }
  ~Running() {
    server.stop();
    thread.join();
  }
};

int connect_to(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  return fd;
}

void send_all(int fd, const std::string& s) {
  size_t at = 0;
  while (at < s.size()) {
    const ssize_t n = ::send(fd, s.data() + at, s.size() - at, MSG_NOSIGNAL);
    if (n <= 0) return;
    at += static_cast<size_t>(n);
  }
}

// Reads until the peer closes or `until` appears (or 20 s pass, to keep a broken server from
// hanging the test forever).
std::string read_until(int fd, const std::string& until = "") {
  std::string got;
  char buf[4096];
  const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < give_up) {
    if (!until.empty() && got.find(until) != std::string::npos) break;
    pollfd p{fd, POLLIN, 0};
    if (::poll(&p, 1, 100) <= 0) continue;
    const ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    got.append(buf, static_cast<size_t>(n));
  }
  return got;
}

// `request` on a connection of its own; all that comes back until the server closes it.
std::string round_trip(int port, const std::string& request) {
  const int fd = connect_to(port);
  send_all(fd, request);
  std::string r = read_until(fd);
  ::close(fd);
  return r;
}

std::string get(int port, const std::string& path) {
  return round_trip(port, "GET " + path + " HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n");
}

TEST(HttpServer, AnswersAndKeepsConnectionsAlive) {
  Running s(Limits{});
  const int fd = connect_to(s.port);
  send_all(fd, "POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nhi");
  std::string r = read_until(fd, "body hi");
  EXPECT_NE(r.find("HTTP/1.1 200 OK"), std::string::npos) << r;
  EXPECT_NE(r.find("Connection: keep-alive"), std::string::npos) << r;
  send_all(fd, "GET /stream HTTP/1.1\r\nHost: x\r\n\r\n");
  r = read_until(fd, "0\r\n\r\n");
  EXPECT_NE(r.find("Transfer-Encoding: chunked"), std::string::npos) << r;
  EXPECT_NE(r.find("4\r\none,\r\n3\r\ntwo\r\n0\r\n\r\n"), std::string::npos) << r;
  ::close(fd);
}

// Ten clients send their headers a byte every 50 ms; meanwhile a normal request is answered
// (before any of them has finished), and each slow one gets 408 at its deadline.
TEST(HttpServer, SlowSendersHoldOnlyTheirOwnConnections) {
  Limits limits;
  limits.request_timeout_s = 1.5;
  Running s(limits);
  std::atomic<int> slow_answered{0};
  std::vector<std::thread> slow;
  std::vector<std::string> answers(10);
  for (int i = 0; i < 10; ++i)
    slow.emplace_back([&, i] {
      const int fd = connect_to(s.port);
      const std::string request = "GET /slow HTTP/1.1\r\nHost: x\r\nX-Pad: " + std::string(200, 'p') + "\r\n\r\n";
      for (char c : request) {
        if (::send(fd, &c, 1, MSG_NOSIGNAL) != 1) break;
        pollfd p{fd, POLLIN, 0};
        if (::poll(&p, 1, 50) > 0) break;  // answered (408) before the request was complete
      }
      answers[static_cast<size_t>(i)] = read_until(fd);
      ++slow_answered;
      ::close(fd);
    });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  const std::string fast = get(s.port, "/health");
  EXPECT_EQ(slow_answered.load(), 0) << "a normal request waited for the slow senders";
  EXPECT_NE(fast.find("path /health"), std::string::npos) << fast;
  for (auto& t : slow) t.join();
  for (const auto& a : answers) {
    EXPECT_NE(a.find("HTTP/1.1 408 Request Timeout"), std::string::npos) << a;
    EXPECT_NE(a.find("did not arrive within 1.5 s"), std::string::npos) << a;
  }
  EXPECT_EQ(s.server.stats().timed_out, 10);
}

TEST(HttpServer, ConnectionCapAnswers503) {
  Limits limits;
  limits.max_connections = 3;
  Running s(limits);
  std::vector<int> held;
  for (int i = 0; i < 3; ++i) held.push_back(connect_to(s.port));
  // Wait until the server has taken all three (accepting is asynchronous).
  for (int i = 0; i < 100 && s.server.stats().open_connections < 3; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  ASSERT_EQ(s.server.stats().open_connections, 3);
  const std::string refused = get(s.port, "/health");
  EXPECT_NE(refused.find("HTTP/1.1 503"), std::string::npos) << refused;
  EXPECT_NE(refused.find("\"status\":503"), std::string::npos) << refused;
  EXPECT_NE(refused.find("Retry-After: 1"), std::string::npos) << refused;
  for (int fd : held) ::close(fd);
  for (int i = 0; i < 100 && s.server.stats().open_connections > 0; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_NE(get(s.port, "/health").find("200 OK"), std::string::npos);
  EXPECT_EQ(s.server.stats().refused_connections, 1);
}

TEST(HttpServer, LimitsAnsweredWithTheirStatus) {
  Limits limits;
  limits.max_body_bytes = 100;
  limits.max_header_bytes = 512;
  Running s(limits);
  struct Case {
    std::string request;
    const char* status;
  };
  const Case cases[] = {
      {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n", "413 Payload Too Large"},
      {"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + std::string(2000, 'b') + "\r\n\r\n", "431 Request Header Fields"},
      {"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\nContent-Encoding: lzma\r\n\r\nabc", "415 Unsupported"},
      {"NOT HTTP\r\n\r\n", "400 Bad Request"},
  };
  for (const Case& c : cases) {
    const std::string r = round_trip(s.port, c.request);
    EXPECT_NE(r.find(c.status), std::string::npos) << r;
    EXPECT_NE(r.find("Connection: close"), std::string::npos) << r;
    EXPECT_NE(r.find("{\"status\":"), std::string::npos) << r;
  }
}

// stop() ends connections still receiving a request at once: with a request timeout of an
// hour, the test would hang here if it waited for them.
TEST(HttpServer, StopDoesNotWaitForSlowSenders) {
  Limits limits;
  limits.request_timeout_s = 3600;
  auto s = std::make_unique<Running>(limits);
  const int fd = connect_to(s->port);
  send_all(fd, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nonly part");
  for (int i = 0; i < 100 && s->server.stats().open_connections < 1; ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  s.reset();  // stop() and join the accept loop
  EXPECT_EQ(read_until(fd), "");  // closed without an answer
  ::close(fd);
}

// A handler that throws gets a 500 with the error body; the server goes on.
TEST(HttpServer, HandlerFailureIs500) {
  Running s(Limits{}, [](const Request& req, Response& res) {
    if (req.path == "/boom") throw std::runtime_error("boom");
    res.send(200, "text/plain", "fine");
  });
  const std::string r = get(s.port, "/boom");
  EXPECT_NE(r.find("500 Internal Server Error"), std::string::npos) << r;
  EXPECT_NE(r.find("boom"), std::string::npos) << r;
  EXPECT_NE(get(s.port, "/ok").find("fine"), std::string::npos);
}

}  // namespace
}  // namespace moe::serve::http
