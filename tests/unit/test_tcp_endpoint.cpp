// TCP endpoints as the executor flags use them: HOST:PORT parsing (bad spellings refused in one
// line naming the flag), a loopback listen, connect and accept that carries bytes both ways, and a
// connection to a port nobody listens on given up after its timeout.
#include <sys/socket.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <thread>

#include "core/tcp_endpoint.h"
#include "test_util.h"

namespace moe {
namespace {

TEST(TcpEndpoint, ParsesHostAndPortAndRefusesOtherSpellings) {
  net::Endpoint e = net::parse_endpoint("127.0.0.1:7000", "--executor");
  EXPECT_EQ(e.host, "127.0.0.1");
  EXPECT_EQ(e.port, 7000);
  e = net::parse_endpoint("[::1]:0", "--executor");
  EXPECT_EQ(e.host, "::1");
  EXPECT_EQ(e.port, 0);
  e = net::parse_endpoint("worker-3.local:65535", "--executor");
  EXPECT_EQ(e.host, "worker-3.local");
  EXPECT_EQ(e.port, 65535);
  for (const char* bad : {"localhost", ":7000", "host:", "host:-1", "host:65536", "host:70x", "host:7 ", ""}) {
    std::string why;
    EXPECT_EQ(test::error_kind_of([&] { net::parse_endpoint(bad, "--serve-executor"); }, &why),
              ErrorKind::kInvalidArgument)
        << bad;
    EXPECT_NE(why.find("--serve-executor " + std::string(bad) + ": expected HOST:PORT"), std::string::npos) << why;
  }
}

TEST(TcpEndpoint, ListenConnectAndAcceptCarryBytesBothWays) {
  int port = 0;
  const int listener = net::listen_tcp({"127.0.0.1", 0}, &port);
  ASSERT_GT(port, 0);
  int accepted = -1;
  std::thread server([&] { accepted = net::accept_one(listener); });
  const int client = net::connect_tcp({"127.0.0.1", port}, 5.0);
  server.join();
  ASSERT_GE(accepted, 0);
  ASSERT_EQ(::send(client, "ping", 4, 0), 4);
  char got[4] = {};
  ASSERT_EQ(::recv(accepted, got, 4, MSG_WAITALL), 4);
  EXPECT_EQ(std::string(got, 4), "ping");
  ASSERT_EQ(::send(accepted, "pong", 4, 0), 4);
  ASSERT_EQ(::recv(client, got, 4, MSG_WAITALL), 4);
  EXPECT_EQ(std::string(got, 4), "pong");
  ::close(client);
  ::close(accepted);
  // The port is taken while the listener lives.
  std::string why;
  EXPECT_EQ(test::error_kind_of([&] { int p = 0; ::close(net::listen_tcp({"127.0.0.1", port}, &p)); }, &why),
            ErrorKind::kIo);
  EXPECT_NE(why.find("cannot listen on 127.0.0.1:" + std::to_string(port)), std::string::npos) << why;
  ::close(listener);
}

TEST(TcpEndpoint, AConnectionNobodyAcceptsIsGivenUpAfterItsTimeout) {
  int port = 0;
  ::close(net::listen_tcp({"127.0.0.1", 0}, &port));  // a port that was free a moment ago
  std::string why;
  EXPECT_EQ(test::error_kind_of([&] { net::connect_tcp({"127.0.0.1", port}, 0.3); }, &why), ErrorKind::kIo);
  EXPECT_NE(why.find("could not connect to 127.0.0.1:" + std::to_string(port) + " within 0.3 s"), std::string::npos)
      << why;
}

}  // namespace
}  // namespace moe
