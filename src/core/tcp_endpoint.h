// TCP endpoints: "HOST:PORT" as flags spell them, a listening socket, one accepted connection and
// a connection made with retries (the peer may still be starting). Every failure is one kIo or
// kInvalidArgument line naming the address.
#pragma once

#include <string>
#include <string_view>

namespace moe::net {

struct Endpoint {
  std::string host;
  int port = 0;
};

// "HOST:PORT" (the port 0-65535; an IPv6 host in brackets, "[::1]:7000"); `flag` names the
// option in the error.
Endpoint parse_endpoint(std::string_view text, std::string_view flag);

// A socket listening on `at` (port 0: any free port); *bound gets the port it took.
int listen_tcp(const Endpoint& at, int* bound);

// Waits for one connection on `listen_fd` and returns it (blocking, with TCP_NODELAY).
int accept_one(int listen_fd);

// A connection to `to`, retried until `timeout_s` seconds have passed (with TCP_NODELAY).
int connect_tcp(const Endpoint& to, double timeout_s);

}  // namespace moe::net
