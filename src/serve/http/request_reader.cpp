#include "serve/http/request_reader.h"

#include <algorithm>
#include <cstdint>
#include <iterator>
#include <limits>

#include <boost/asio/buffer.hpp>
#include <boost/beast/http/error.hpp>
#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>
#include <fmt/format.h>

#include "serve/http/body_decoding.h"

namespace moe::serve::http {

namespace bhttp = boost::beast::http;

struct RequestReader::Parser {
  bhttp::request_parser<bhttp::string_body> p;
};

namespace {

bool iequals(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

}  // namespace

std::string Request::header(std::string_view name) const {
  for (const auto& [k, v] : headers)
    if (iequals(k, name)) return v;
  return {};
}

RequestReader::RequestReader(const Limits& limits) : limits_(limits) { new_parser(); }

void RequestReader::new_parser() {
  parser_ = std::make_unique<Parser>();
  parser_->p.header_limit(static_cast<std::uint32_t>(
      std::min<size_t>(limits_.max_header_bytes, std::numeric_limits<std::uint32_t>::max())));
  // The raw body (compressed or not) is bounded too: a declared length past it is refused before
  // any of it is read, a chunked one as it arrives.
  parser_->p.body_limit(static_cast<std::uint64_t>(limits_.max_body_bytes));
  parser_->p.eager(true);
}

RequestReader::~RequestReader() = default;

void RequestReader::fail(int status, std::string why) {
  state_ = State::kFailed;
  error_status_ = status;
  error_ = std::move(why);
}

size_t RequestReader::feed(std::string_view bytes) {
  if (state_ != State::kNeedMore || bytes.empty()) return 0;
  started_ = true;
  size_t used = 0;
  boost::system::error_code ec;
  while (used < bytes.size()) {
    const size_t n = parser_->p.put(boost::asio::buffer(bytes.data() + used, bytes.size() - used), ec);
    used += n;
    if (parser_->p.is_header_done() && !headers_checked_) {
      headers_checked_ = true;
      const auto& fields = parser_->p.get();
      const auto count = static_cast<size_t>(std::distance(fields.begin(), fields.end()));
      if (count > limits_.max_headers) {
        fail(431, fmt::format("the request has {} header fields; at most {} are accepted", count, limits_.max_headers));
        return used;
      }
    }
    if (ec == bhttp::error::need_more) return used;
    if (ec == bhttp::error::header_limit) {
      fail(431, fmt::format("the request line and headers exceed {} bytes", limits_.max_header_bytes));
      return used;
    }
    if (ec == bhttp::error::body_limit) {
      fail(413, fmt::format("the request body exceeds {} bytes", limits_.max_body_bytes));
      return used;
    }
    if (ec) {
      fail(400, fmt::format("malformed HTTP request: {}", ec.message()));
      return used;
    }
    if (parser_->p.is_done()) {
      finish();
      return used;
    }
    if (n == 0) return used;
  }
  return used;
}

void RequestReader::feed_eof() {
  if (state_ != State::kNeedMore || !started_) return;
  fail(400, "the connection closed before the request was complete");
}

bool RequestReader::wants_continue() const {
  if (state_ != State::kNeedMore || continue_sent_ || !parser_->p.is_header_done()) return false;
  const auto& fields = parser_->p.get();
  auto it = fields.find(bhttp::field::expect);
  return it != fields.end() && iequals(std::string_view(it->value().data(), it->value().size()), "100-continue");
}

void RequestReader::finish() {
  bhttp::request<bhttp::string_body> msg = parser_->p.release();
  request_ = Request{};
  request_.method = std::string(msg.method_string());
  request_.target = std::string(msg.target());
  request_.path = request_.target.substr(0, request_.target.find('?'));
  for (const auto& f : msg) request_.headers.emplace_back(std::string(f.name_string()), std::string(f.value()));
  keep_alive_ = msg.keep_alive();
  Decoded decoded = decode_body(request_.header("Content-Encoding"), msg.body(), limits_.max_body_bytes);
  switch (decoded.status) {
    case DecodeStatus::kOk:
      request_.body = std::move(decoded.body);
      state_ = State::kComplete;
      return;
    case DecodeStatus::kTooLarge: return fail(413, std::move(decoded.error));
    case DecodeStatus::kUnsupported: return fail(415, std::move(decoded.error));
    case DecodeStatus::kCorrupt: return fail(400, std::move(decoded.error));
  }
}

Request RequestReader::take(bool* keep_alive) {
  Request out = std::move(request_);
  if (keep_alive) *keep_alive = keep_alive_;
  new_parser();  // for the next request on this connection
  state_ = State::kNeedMore;
  started_ = continue_sent_ = headers_checked_ = false;
  error_status_ = 0;
  error_.clear();
  request_ = Request{};
  return out;
}

}  // namespace moe::serve::http
