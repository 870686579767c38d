// The HTTP layer's vocabulary: the limits every connection runs under, a parsed request, and
// the interface a handler answers through. Nothing here knows about sockets, so handlers and
// the request parser are tested (and fuzzed) without one.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace moe::serve::http {

// Every bound a client could otherwise push: each is a flag of moe-server. The defaults leave
// any real OpenAI client far inside them (a 128k-token prompt is about 0.5 MB of JSON) while a
// hostile one costs at most a thread and max_body_bytes for request_timeout_s seconds.
struct Limits {
  size_t max_body_bytes = 16u << 20;  // request body after decoding (gzip, deflate, br): 413
  size_t max_header_bytes = 32u << 10;  // request line and header fields together: 431
  size_t max_headers = 100;           // header fields: 431
  double request_timeout_s = 30.0;    // the whole request must arrive within this: 408
  double idle_timeout_s = 15.0;       // a kept-alive connection waits this long for its next request
  double write_timeout_s = 30.0;      // a client that stops reading for this long is dropped
  int max_connections = 256;          // open connections; one more is answered 503 and closed
};

struct Request {
  std::string method;  // as sent ("GET", "POST", ...)
  std::string target;  // the request target, query included
  std::string path;    // the target without its query
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;    // decoded: Content-Encoding already undone
  // The first header of that name (case-insensitive), or "" when absent.
  std::string header(std::string_view name) const;
};

// What a handler writes its answer to: one whole response, or a stream of chunks.
class Response {
 public:
  virtual ~Response() = default;
  // Extra header for the response about to start (e.g. Allow on a 405).
  virtual void add_header(std::string name, std::string value) = 0;
  virtual void send(int status, std::string_view content_type, std::string_view body) = 0;
  // A streamed response (chunked transfer coding). write() returns false once the client is
  // gone or stopped reading for the write timeout; the handler should then stop.
  virtual bool begin_stream(int status, std::string_view content_type) = 0;
  virtual bool write(std::string_view data) = 0;
  virtual void end_stream() = 0;
  // Whether the client still holds the connection open (checked without reading).
  virtual bool client_connected() = 0;
  // Whether send() or begin_stream() has been called.
  virtual bool started() const = 0;
};

// The standard reason phrase of a status code ("Payload Too Large").
const char* reason_phrase(int status);

}  // namespace moe::serve::http
