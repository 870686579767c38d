// Undoes a request body's Content-Encoding (gzip, deflate, br) with the size of the result
// bounded while it inflates: a 2 KB brotli body that would inflate to 1 GiB stops at the limit,
// having held no more than the limit in memory.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace moe::serve::http {

enum class DecodeStatus { kOk, kTooLarge, kCorrupt, kUnsupported };

struct Decoded {
  DecodeStatus status = DecodeStatus::kOk;
  std::string body;
  std::string error;  // one line, when status != kOk
};

// `encoding` is the Content-Encoding header ("" or "identity": nothing to undo). The result is
// at most max_bytes long; more is kTooLarge.
Decoded decode_body(std::string_view encoding, std::string_view body, size_t max_bytes);

}  // namespace moe::serve::http
