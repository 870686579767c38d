#include "core/tcp_endpoint.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <memory>
#include <thread>

#include "core/socket_io.h"
#include "moe/errors.h"

namespace moe::net {

namespace {

using AddrList = std::unique_ptr<addrinfo, void (*)(addrinfo*)>;

AddrList resolve(const Endpoint& e, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_NUMERICSERV | (passive ? AI_PASSIVE : 0);
  addrinfo* found = nullptr;
  const int rc = ::getaddrinfo(e.host.c_str(), std::to_string(e.port).c_str(), &hints, &found);
  MOE_CHECK(rc == 0, kIo, "{} {}:{}: {}", passive ? "cannot listen on" : "cannot connect to", e.host, e.port,
            ::gai_strerror(rc));
  return AddrList(found, ::freeaddrinfo);
}

void no_delay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);  // small requests go out at once
}

}  // namespace

Endpoint parse_endpoint(std::string_view text, std::string_view flag) {
  const size_t colon = text.rfind(':');
  Endpoint e;
  int port = -1;
  if (colon != std::string_view::npos && colon > 0) {
    std::string_view host = text.substr(0, colon), digits = text.substr(colon + 1);
    if (host.size() >= 2 && host.front() == '[' && host.back() == ']') host = host.substr(1, host.size() - 2);
    const auto [end, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), port);
    if (ec != std::errc() || end != digits.data() + digits.size() || digits.empty()) port = -1;
    e.host = std::string(host);
  }
  MOE_CHECK(port >= 0 && port <= 65535 && !e.host.empty(), kInvalidArgument,
            "{} {}: expected HOST:PORT with a port of 0-65535", flag, text);
  e.port = port;
  return e;
}

int listen_tcp(const Endpoint& at, int* bound) {
  const AddrList found = resolve(at, true);
  std::string why = "no address";
  int fd = -1;
  for (addrinfo* a = found.get(); a && fd < 0; a = a->ai_next) {
    fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (::bind(fd, a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd, 128) != 0) {
      why = std::strerror(errno);
      ::close(fd);
      fd = -1;
    }
  }
  MOE_CHECK(fd >= 0, kIo, "cannot listen on {}:{}: {}", at.host, at.port, why);
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  *bound = addr.ss_family == AF_INET6 ? ntohs(reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port)
                                      : ntohs(reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
  return fd;
}

int accept_one(int listen_fd) {
  for (;;) {
    const int fd = ::accept4(listen_fd, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd >= 0) {
      no_delay(fd);
      return fd;
    }
    MOE_CHECK(errno == EINTR || errno == ECONNABORTED, kIo, "accepting a connection failed: {}",
              std::strerror(errno));
  }
}

int connect_tcp(const Endpoint& to, double timeout_s) {
  const Deadline deadline = after(timeout_s);
  std::string why;
  for (;;) {
    const AddrList found = resolve(to, false);
    for (addrinfo* a = found.get(); a; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
        no_delay(fd);
        return fd;
      }
      why = std::strerror(errno);
      ::close(fd);
    }
    MOE_CHECK(Clock::now() < deadline, kIo, "could not connect to {}:{} within {} s: {}", to.host, to.port, timeout_s,
              why);
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

}  // namespace moe::net
