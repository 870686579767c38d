// Turns the bytes a connection receives into requests, one at a time, with every size checked
// before it is kept: the header section against max_header_bytes and max_headers, a declared
// Content-Length against max_body_bytes before any body byte is read, a chunked body as it
// arrives, and the decoded body as it inflates. No socket: the connection feeds it bytes, and the
// fuzz target feeds it anything.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "serve/http/http_types.h"

namespace moe::serve::http {

class RequestReader {
 public:
  enum class State { kNeedMore, kComplete, kFailed };

  explicit RequestReader(const Limits& limits);
  ~RequestReader();
  RequestReader(const RequestReader&) = delete;
  RequestReader& operator=(const RequestReader&) = delete;

  // Parses from `bytes`; returns how many it consumed. Bytes not consumed must be offered again
  // with the ones that follow (the parser takes whole lines); once complete, the rest belongs to
  // the next request.
  size_t feed(std::string_view bytes);
  // The peer closed its side.
  void feed_eof();

  State state() const { return state_; }
  // Any byte of a request has arrived (so a timeout is answered 408 rather than just closing).
  bool started() const { return started_; }
  // The header asked for "100 Continue" and the body has not arrived yet.
  bool wants_continue() const;
  void continue_sent() { continue_sent_ = true; }

  // kFailed: the status to answer (400, 413, 415, 431, 501) and why, in one line.
  int error_status() const { return error_status_; }
  const std::string& error() const { return error_; }

  // kComplete: the request (body decoded) and whether the connection may carry another one. The
  // reader is then ready for the next request.
  Request take(bool* keep_alive);

 private:
  struct Parser;
  void new_parser();
  void fail(int status, std::string why);
  void finish();

  Limits limits_;
  std::unique_ptr<Parser> parser_;
  State state_ = State::kNeedMore;
  bool started_ = false, continue_sent_ = false, headers_checked_ = false;
  int error_status_ = 0;
  std::string error_;
  Request request_;
  bool keep_alive_ = false;
};

}  // namespace moe::serve::http
