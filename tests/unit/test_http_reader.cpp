// The HTTP request parser and body decoding, fed bytes directly (no socket): every size a client
// controls is refused with the right status before it is held, and bodies inflate only up to
// the limit.
#include <gtest/gtest.h>

#include <brotli/encode.h>
#include <zlib.h>

#include <string>

#include "serve/http/body_decoding.h"
#include "serve/http/request_reader.h"

namespace moe::serve::http {
namespace {

using State = RequestReader::State;

// Feeds `bytes` as a connection would (keeping what the reader did not consume), `piece` bytes
// at a time.
void feed(RequestReader& r, const std::string& bytes, size_t piece = 1 << 20) {
  std::string pending;
  for (size_t at = 0; at < bytes.size() && r.state() == State::kNeedMore; at += piece) {
    pending += bytes.substr(at, piece);
    pending.erase(0, r.feed(pending));
  }
}

// zlib's deflate with the given window bits: 15 + 16 writes gzip, -15 a raw deflate stream.
std::string deflated(const std::string& data, int window_bits) {
  z_stream zs{};
  EXPECT_EQ(deflateInit2(&zs, 9, Z_DEFLATED, window_bits, 9, Z_DEFAULT_STRATEGY), Z_OK);
  std::string out(deflateBound(&zs, data.size()) + 64, '\0');
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(data.data()));
  zs.avail_in = static_cast<uInt>(data.size());
  zs.next_out = reinterpret_cast<Bytef*>(out.data());
  zs.avail_out = static_cast<uInt>(out.size());
  EXPECT_EQ(deflate(&zs, Z_FINISH), Z_STREAM_END);
  out.resize(zs.total_out);
  deflateEnd(&zs);
  return out;
}

std::string gzip(const std::string& data) { return deflated(data, 15 + 16); }

std::string brotli(const std::string& data) {
  size_t size = BrotliEncoderMaxCompressedSize(data.size());
  std::string out(size, '\0');
  EXPECT_TRUE(BrotliEncoderCompress(BROTLI_DEFAULT_QUALITY, BROTLI_DEFAULT_WINDOW, BROTLI_MODE_GENERIC, data.size(),
                                    reinterpret_cast<const uint8_t*>(data.data()), &size,
                                    reinterpret_cast<uint8_t*>(out.data())));
  out.resize(size);
  return out;
}

std::string post(const std::string& body, const std::string& extra_headers = "") {
  return "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: " + std::to_string(body.size()) + "\r\n" +
         extra_headers + "\r\n" + body;
}

TEST(HttpReader, ARequestInOneBytePiecesAndTwoPipelined) {
  Limits limits;
  RequestReader r(limits);
  const std::string one = post("{\"a\":1}", "Content-Type: application/json\r\n");
  feed(r, one, 1);
  ASSERT_EQ(r.state(), State::kComplete);
  bool keep = false;
  Request req = r.take(&keep);
  EXPECT_EQ(req.method, "POST");
  EXPECT_EQ(req.path, "/v1/completions");
  EXPECT_EQ(req.body, "{\"a\":1}");
  EXPECT_EQ(req.header("content-type"), "application/json");
  EXPECT_TRUE(keep);
  // Two requests back to back: the first takes only its own bytes.
  const std::string two = "GET /health?x=1 HTTP/1.1\r\nHost: x\r\n\r\n" + post("[]");
  size_t used = r.feed(two);
  ASSERT_EQ(r.state(), State::kComplete);
  req = r.take(&keep);
  EXPECT_EQ(req.path, "/health");
  EXPECT_EQ(req.target, "/health?x=1");
  used += r.feed(std::string_view(two).substr(used));
  ASSERT_EQ(r.state(), State::kComplete);
  EXPECT_EQ(used, two.size());
  EXPECT_EQ(r.take(&keep).body, "[]");
}

TEST(HttpReader, ChunkedBodyAndHttp10KeepAlive) {
  RequestReader r(Limits{});
  feed(r, "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n", 3);
  ASSERT_EQ(r.state(), State::kComplete);
  bool keep = true;
  EXPECT_EQ(r.take(&keep).body, "abcde");
  feed(r, "GET / HTTP/1.0\r\n\r\n");
  ASSERT_EQ(r.state(), State::kComplete);
  r.take(&keep);
  EXPECT_FALSE(keep);  // HTTP/1.0 without keep-alive closes
}

TEST(HttpReader, HeaderLimits) {
  Limits limits;
  limits.max_header_bytes = 256;
  limits.max_headers = 4;
  RequestReader big(limits);
  feed(big, "GET / HTTP/1.1\r\nX-Long: " + std::string(1000, 'a') + "\r\n\r\n", 7);
  ASSERT_EQ(big.state(), State::kFailed);
  EXPECT_EQ(big.error_status(), 431);
  EXPECT_NE(big.error().find("256 bytes"), std::string::npos) << big.error();
  // A line that never ends is refused once it passes the limit, not held.
  RequestReader endless(limits);
  feed(endless, "GET /" + std::string(10000, 'a'), 100);
  EXPECT_EQ(endless.state(), State::kFailed);
  EXPECT_EQ(endless.error_status(), 431);
  RequestReader many(limits);
  std::string headers;
  for (int i = 0; i < 6; ++i) headers += "X-" + std::to_string(i) + ": v\r\n";
  feed(many, "GET / HTTP/1.1\r\n" + headers + "\r\n");
  ASSERT_EQ(many.state(), State::kFailed);
  EXPECT_EQ(many.error_status(), 431);
  EXPECT_NE(many.error().find("6 header fields; at most 4"), std::string::npos) << many.error();
}

TEST(HttpReader, BodyLimitBeforeTheBodyArrives) {
  Limits limits;
  limits.max_body_bytes = 1000;
  RequestReader r(limits);
  // Only the header: a declared length past the limit is refused before any of the body.
  feed(r, "POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 536870912\r\n\r\n");
  ASSERT_EQ(r.state(), State::kFailed);
  EXPECT_EQ(r.error_status(), 413);
  RequestReader chunked(limits);
  std::string body = "POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
  for (int i = 0; i < 20; ++i) body += "64\r\n" + std::string(100, 'x') + "\r\n";
  feed(chunked, body, 50);
  ASSERT_EQ(chunked.state(), State::kFailed);
  EXPECT_EQ(chunked.error_status(), 413);
}

// A small compressed body that inflates past the limit stops at the limit (413); within it, it
// decodes to the original bytes.
TEST(HttpReader, CompressedBodiesInflateOnlyToTheLimit) {
  Limits limits;
  limits.max_body_bytes = 1 << 20;
  const std::string bomb(64 << 20, '\0');  // 64 MiB of zeros: a few kB compressed
  for (const auto& [name, packed] : {std::pair<std::string, std::string>{"gzip", gzip(bomb)},
                                     std::pair<std::string, std::string>{"br", brotli(bomb)}}) {
    ASSERT_LT(packed.size(), limits.max_body_bytes) << name;
    RequestReader r(limits);
    feed(r, post(packed, "Content-Encoding: " + name + "\r\n"));
    ASSERT_EQ(r.state(), State::kFailed) << name;
    EXPECT_EQ(r.error_status(), 413) << name;
    EXPECT_NE(r.error().find("decoded request body exceeds 1048576 bytes"), std::string::npos) << r.error();
  }
  const std::string json = "{\"prompt\": \"" + std::string(5000, 'q') + "\"}";
  for (const auto& [name, packed] : {std::pair<std::string, std::string>{"gzip", gzip(json)},
                                     std::pair<std::string, std::string>{"br", brotli(json)}}) {
    RequestReader r(limits);
    feed(r, post(packed, "Content-Encoding: " + name + "\r\n"));
    ASSERT_EQ(r.state(), State::kComplete) << name << ": " << r.error();
    bool keep;
    EXPECT_EQ(r.take(&keep).body, json) << name;
  }
}

TEST(HttpReader, BadEncodingsAndMalformedRequests) {
  struct Case {
    std::string bytes;
    int status;
    const char* says;
  };
  const std::string garbage = "this is not compressed";
  const Case cases[] = {
      {post("abc", "Content-Encoding: zstd\r\n"), 415, "Content-Encoding 'zstd' is not supported"},
      {post(garbage, "Content-Encoding: gzip\r\n"), 400, "not valid gzip"},
      {post(garbage, "Content-Encoding: br\r\n"), 400, "not valid br"},
      {post(gzip("{}").substr(0, 8), "Content-Encoding: gzip\r\n"), 400, "not valid gzip"},
      {"GET / HTTP/1.1\r\nBad Header\r\n\r\n", 400, "malformed HTTP request"},
      {"POST / HTTP/1.1\r\nContent-Length: -5\r\n\r\n", 400, "malformed HTTP request"},
      {"POST / HTTP/1.1\r\nContent-Length: 5\r\nContent-Length: 6\r\n\r\nabcde", 400, "malformed HTTP request"},
      {"\x01\x02\x03 / HTTP/1.1\r\n\r\n", 400, "malformed HTTP request"},
  };
  for (const Case& c : cases) {
    RequestReader r(Limits{});
    feed(r, c.bytes);
    ASSERT_EQ(r.state(), State::kFailed) << c.says;
    EXPECT_EQ(r.error_status(), c.status) << c.says;
    EXPECT_NE(r.error().find(c.says), std::string::npos) << r.error();
  }
  // A connection that closes mid-request fails; one that never started does not.
  RequestReader cut(Limits{});
  cut.feed("POST / HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc");
  cut.feed_eof();
  EXPECT_EQ(cut.state(), State::kFailed);
  RequestReader idle(Limits{});
  idle.feed_eof();
  EXPECT_EQ(idle.state(), State::kNeedMore);
  EXPECT_FALSE(idle.started());
}

TEST(HttpReader, ExpectContinue) {
  RequestReader r(Limits{});
  r.feed("POST / HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nExpect: 100-continue\r\n\r\n");
  EXPECT_TRUE(r.wants_continue());
  r.continue_sent();
  EXPECT_FALSE(r.wants_continue());
  r.feed("abcd");
  ASSERT_EQ(r.state(), State::kComplete);
}

TEST(HttpDecode, IdentityAndDeflate) {
  EXPECT_EQ(decode_body("identity", "abc", 3).body, "abc");
  EXPECT_EQ(decode_body("", "abcd", 3).status, DecodeStatus::kTooLarge);
  // Raw deflate, as some clients send "deflate".
  const std::string text = "hello hello hello";
  const std::string out = deflated(text, -15);
  const Decoded d = decode_body("Deflate", out, 100);
  ASSERT_EQ(d.status, DecodeStatus::kOk) << d.error;
  EXPECT_EQ(d.body, text);
  // Two gzip members back to back decode to both.
  const Decoded two = decode_body("gzip", gzip("ab") + gzip("cd"), 100);
  ASSERT_EQ(two.status, DecodeStatus::kOk) << two.error;
  EXPECT_EQ(two.body, "abcd");
}

}  // namespace
}  // namespace moe::serve::http
