// libFuzzer target for the tokenizer: encodes arbitrary bytes with the Qwen3 tokenizer and checks
// the round trip. The tokenizer is loaded once, from $MOE_TOKENIZER or
// <source dir>/.cache/tokenizers/qwen3/tokenizer.json (scripts/fetch_tokenizers.sh fetches it).
//
// Properties checked for every input s:
//  - encode never throws or crashes, and every id is inside the vocabulary;
//  - the token bytes concatenate to the normalized input (NFC for Qwen3; invalid UTF-8 bytes are
//    kept as they are), so nothing is lost or invented;
//  - for valid UTF-8, decode(encode(s)) == s, or == NFC(s) for a tokenizer that normalizes (Qwen3);
//  - streaming decode gives the same text as decode; add_special only adds ids around the text.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <string_view>

#include "io/tokenizer.h"
#include "io/unicode_util.h"
#include "moe/errors.h"

#ifndef MOE_SOURCE_DIR
#define MOE_SOURCE_DIR "."
#endif

namespace {

[[noreturn]] void die(const std::string& what, std::string_view input) {
  std::fprintf(stderr, "fuzz_tokenizer: %s (input of %zu bytes)\n", what.c_str(), input.size());
  std::abort();
}

const moe::Tokenizer& tokenizer() {
  static const std::unique_ptr<moe::Tokenizer> tok = [] {
    const char* env = std::getenv("MOE_TOKENIZER");
    const std::string path =
        env && *env ? std::string(env)
                    : std::string(MOE_SOURCE_DIR) + "/.cache/tokenizers/qwen3/tokenizer.json";
    try {
      return std::make_unique<moe::Tokenizer>(moe::Tokenizer::from_file(path));
    } catch (const std::exception& e) {
      std::fprintf(stderr,
                   "fuzz_tokenizer: cannot load %s: %s\n(run scripts/fetch_tokenizers.sh or set "
                   "MOE_TOKENIZER)\n",
                   path.c_str(), e.what());
      std::exit(1);
    }
  }();
  return *tok;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const moe::Tokenizer& tok = tokenizer();
  const std::string_view s(reinterpret_cast<const char*>(data), size);
  std::vector<int32_t> ids;
  std::string bytes, text, streamed;
  try {
    ids = tok.encode(s);
    for (int32_t id : ids) {
      if (id < 0 || id >= tok.vocab_size()) die("id outside the vocabulary", s);
      bytes += tok.token_bytes(id);
    }
    text = tok.decode(ids);
    moe::StreamDecoder stream(tok);
    for (int32_t id : ids) streamed += stream.push(id);
    streamed += stream.flush();
    const auto with_special = tok.encode(s, /*add_special=*/true);
    if (tok.decode(with_special, /*skip_special=*/true) != tok.decode(ids, /*skip_special=*/true))
      die("add_special changed the text", s);
  } catch (const std::exception& e) {
    die(std::string("exception: ") + e.what(), s);
  }
  const std::string normalized = moe::unicode::nfc(s);
  if (bytes != s && bytes != normalized) die("token bytes differ from the input", s);
  if (text != moe::unicode::utf8_lossy(bytes)) die("decode differs from the token bytes", s);
  if (streamed != text) die("streaming decode differs from decode", s);
  if (moe::unicode::is_valid_utf8(s) && text != s && text != normalized)
    die("decode(encode(s)) differs from s", s);
  return 0;
}
