#include "serve/http/body_decoding.h"

#include <brotli/decode.h>
#include <zlib.h>

#include <algorithm>
#include <cctype>
#include <memory>

#include <fmt/format.h>

namespace moe::serve::http {

namespace {

constexpr size_t kChunk = 64u << 10;  // inflated at a time: the overshoot past the limit

Decoded too_large(size_t max_bytes) {
  return {DecodeStatus::kTooLarge, {}, fmt::format("the decoded request body exceeds {} bytes", max_bytes)};
}

Decoded corrupt(std::string_view encoding, std::string_view why) {
  return {DecodeStatus::kCorrupt, {}, fmt::format("the request body is not valid {} data ({})", encoding, why)};
}

// gzip (one or more members) or zlib-wrapped deflate; raw deflate when `raw`.
Decoded inflate_zlib(std::string_view encoding, std::string_view in, size_t max_bytes, bool raw) {
  z_stream zs{};
  // 15 + 32: a zlib or gzip header, detected; -15: no header at all.
  if (inflateInit2(&zs, raw ? -15 : 15 + 32) != Z_OK) return corrupt(encoding, "the decoder did not start");
  std::unique_ptr<z_stream, int (*)(z_stream*)> guard(&zs, inflateEnd);
  zs.next_in = reinterpret_cast<Bytef*>(const_cast<char*>(in.data()));
  zs.avail_in = static_cast<uInt>(in.size());
  Decoded out;
  for (;;) {
    const size_t at = out.body.size();
    out.body.resize(at + kChunk);
    zs.next_out = reinterpret_cast<Bytef*>(out.body.data() + at);
    zs.avail_out = static_cast<uInt>(kChunk);
    const int rc = inflate(&zs, Z_NO_FLUSH);
    out.body.resize(at + (kChunk - zs.avail_out));
    if (out.body.size() > max_bytes) return too_large(max_bytes);
    if (rc == Z_STREAM_END) {
      if (zs.avail_in == 0) return out;
      if (raw) return corrupt(encoding, "data after the end of the stream");
      if (inflateReset(&zs) != Z_OK) return corrupt(encoding, "a later member did not start");
      continue;  // gzip allows several members back to back
    }
    if (rc == Z_BUF_ERROR && zs.avail_in == 0) return corrupt(encoding, "truncated");
    if (rc != Z_OK && rc != Z_BUF_ERROR) return corrupt(encoding, zs.msg ? zs.msg : "bad data");
  }
}

Decoded inflate_brotli(std::string_view in, size_t max_bytes) {
  std::unique_ptr<BrotliDecoderState, void (*)(BrotliDecoderState*)> state(
      BrotliDecoderCreateInstance(nullptr, nullptr, nullptr), BrotliDecoderDestroyInstance);
  if (!state) return corrupt("br", "the decoder did not start");
  const auto* next_in = reinterpret_cast<const uint8_t*>(in.data());
  size_t avail_in = in.size();
  Decoded out;
  for (;;) {
    const size_t at = out.body.size();
    out.body.resize(at + kChunk);
    auto* next_out = reinterpret_cast<uint8_t*>(out.body.data() + at);
    size_t avail_out = kChunk;
    const BrotliDecoderResult rc =
        BrotliDecoderDecompressStream(state.get(), &avail_in, &next_in, &avail_out, &next_out, nullptr);
    out.body.resize(at + (kChunk - avail_out));
    if (out.body.size() > max_bytes) return too_large(max_bytes);
    switch (rc) {
      case BROTLI_DECODER_RESULT_SUCCESS:
        return avail_in == 0 ? out : corrupt("br", "data after the end of the stream");
      case BROTLI_DECODER_RESULT_NEEDS_MORE_OUTPUT: continue;
      case BROTLI_DECODER_RESULT_NEEDS_MORE_INPUT: return corrupt("br", "truncated");
      default:
        return corrupt("br", BrotliDecoderErrorString(BrotliDecoderGetErrorCode(state.get())));
    }
  }
}

std::string lower_trimmed(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

}  // namespace

Decoded decode_body(std::string_view encoding, std::string_view body, size_t max_bytes) {
  const std::string e = lower_trimmed(encoding);
  if (e.empty() || e == "identity") {
    if (body.size() > max_bytes) return too_large(max_bytes);
    return {DecodeStatus::kOk, std::string(body), {}};
  }
  if (e == "gzip" || e == "x-gzip") return inflate_zlib(e, body, max_bytes, false);
  if (e == "deflate") {
    // RFC 9110's deflate is zlib-wrapped; some clients send the raw stream.
    Decoded d = inflate_zlib(e, body, max_bytes, false);
    return d.status == DecodeStatus::kCorrupt ? inflate_zlib(e, body, max_bytes, true) : d;
  }
  if (e == "br") return inflate_brotli(body, max_bytes);
  return {DecodeStatus::kUnsupported, {},
          fmt::format("Content-Encoding '{}' is not supported (gzip, deflate, br or identity)", encoding)};
}

}  // namespace moe::serve::http
