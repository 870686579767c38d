// libFuzzer target for the tokenizer: encodes arbitrary bytes with the Qwen3 tokenizer and checks
// the round trip. The tokenizer is loaded once, from $MOE_TOKENIZER or
// <source dir>/.cache/tokenizers/qwen3/tokenizer.json (scripts/fetch_tokenizers.sh fetches it).
//
// Properties checked for every input s:
//  - encode never throws or crashes, and every id is inside the vocabulary;
//  - the token bytes concatenate to the text as the tokenizer must see it (see expected_text), so
//    nothing is lost or invented, and the added tokens found in s are the ones encoded;
//  - for valid UTF-8, decode(encode(s)) is that same text;
//  - streaming decode gives the same text as decode; add_special only adds ids around the text.
//
// The text the tokenizer sees is not simply s or NFC(s). As in Hugging Face tokenizers, added
// tokens with "normalized": false (all of Qwen3's, e.g. <|im_end|>) are split off the raw text
// first, and only the pieces between them are normalized, each on its own. NFC of the whole input
// can differ: a combining mark right after such a token may compose with the token's last
// character, e.g. '>' + U+0338 is U+226F (a "not greater-than" sign), so NFC("é<|im_end|>" U+0338)
// is "é<|im_end|" U+226F, where <|im_end|> no longer appears, while the tokenizer keeps the token
// and the lone U+0338. (U+0301 does not compose with '>': "<|im_end|>" U+0301 is the same text
// either way.) The expected text is therefore built the same way: the added tokens found in s by
// leftmost-longest matching, kept verbatim, and NFC (when the tokenizer normalizes) applied to
// each piece between them.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "io/regular_file.h"
#include "text/tokenizer.h"
#include "text/unicode_util.h"
#include "moe/errors.h"

#ifndef MOE_SOURCE_DIR
#define MOE_SOURCE_DIR "."
#endif

namespace {

[[noreturn]] void die(const std::string& what, std::string_view input) {
  std::fprintf(stderr, "fuzz_tokenizer: %s (input of %zu bytes)\n", what.c_str(), input.size());
  std::abort();
}

[[noreturn]] void cannot_start(const std::string& path, const std::string& why) {
  std::fprintf(stderr, "fuzz_tokenizer: %s: %s\n", path.c_str(), why.c_str());
  std::exit(1);
}

// The tokenizer, and what the round-trip oracle reads from its tokenizer.json independently of
// the library: the added tokens matched on the raw text and whether the normalizer is NFC.
struct Subject {
  std::unique_ptr<moe::Tokenizer> tok;
  struct RawToken {
    std::string content;
    int32_t id;
  };
  std::vector<RawToken> raw_tokens;
  std::vector<int32_t> raw_ids;  // sorted
  bool nfc = false;
};

bool has_nfc(const nlohmann::json& n) {
  if (!n.is_object()) return false;
  if (n.value("type", "") == "NFC") return true;
  if (auto it = n.find("normalizers"); it != n.end() && it->is_array())
    for (const auto& sub : *it)
      if (has_nfc(sub)) return true;
  return false;
}

const Subject& subject() {
  static const Subject s = [] {
    const char* env = std::getenv("MOE_TOKENIZER");
    const std::string path =
        env && *env ? std::string(env)
                    : std::string(MOE_SOURCE_DIR) + "/.cache/tokenizers/qwen3/tokenizer.json";
    Subject out;
    try {
      out.tok = std::make_unique<moe::Tokenizer>(moe::Tokenizer::from_file(path));
      const auto j =
          nlohmann::json::parse(moe::read_regular_file(path, moe::Tokenizer::kMaxFileBytes));
      out.nfc = j.contains("normalizer") && has_nfc(j.at("normalizer"));
      for (const auto& t : j.value("added_tokens", nlohmann::json::array())) {
        const std::string content = t.at("content").get<std::string>();
        const int32_t id = t.at("id").get<int32_t>();
        // The oracle models tokens kept verbatim; stripping or word rules would change the text.
        if (t.value("lstrip", false) || t.value("rstrip", false) || t.value("single_word", false))
          cannot_start(path, "added token '" + content + "' strips or matches whole words, which "
                             "the round-trip oracle does not model");
        if (std::string(out.tok->token_bytes(id)) != content)
          cannot_start(path, "added token '" + content + "' decodes to other bytes");
        if (t.value("normalized", !t.value("special", false))) {
          if (out.nfc && moe::unicode::nfc(content) != content)
            cannot_start(path, "normalized added token '" + content + "' is not in NFC");
        } else if (!content.empty()) {
          out.raw_tokens.push_back({content, id});
          out.raw_ids.push_back(id);
        }
      }
      std::sort(out.raw_ids.begin(), out.raw_ids.end());
    } catch (const std::exception& e) {
      cannot_start(path, std::string(e.what()) +
                             " (run scripts/fetch_tokenizers.sh or set MOE_TOKENIZER)");
    }
    return out;
  }();
  return s;
}

// The text the tokenizer must produce for s (see the top of the file), and the ids of the raw
// added tokens found in it, in order.
std::string expected_text(const Subject& sub, std::string_view s, std::vector<int32_t>& added) {
  auto normalize = [&](std::string_view piece) {
    return sub.nfc ? moe::unicode::nfc(piece) : std::string(piece);
  };
  std::string out;
  size_t piece_start = 0, pos = 0;
  while (pos < s.size()) {
    const Subject::RawToken* longest = nullptr;
    for (const auto& t : sub.raw_tokens)
      if (s.substr(pos).starts_with(t.content) &&
          (!longest || t.content.size() > longest->content.size()))
        longest = &t;
    if (!longest) {
      ++pos;
      continue;
    }
    out += normalize(s.substr(piece_start, pos - piece_start));
    out += longest->content;
    added.push_back(longest->id);
    pos += longest->content.size();
    piece_start = pos;
  }
  out += normalize(s.substr(piece_start));
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const Subject& sub = subject();
  const moe::Tokenizer& tok = *sub.tok;
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
  std::vector<int32_t> expected_added, encoded_added;
  const std::string expected = expected_text(sub, s, expected_added);
  for (int32_t id : ids)
    if (std::binary_search(sub.raw_ids.begin(), sub.raw_ids.end(), id)) encoded_added.push_back(id);
  if (bytes != expected) die("token bytes differ from the (piecewise normalized) input", s);
  if (encoded_added != expected_added)
    die("the added tokens encoded differ from those in the input", s);
  if (text != moe::unicode::utf8_lossy(bytes)) die("decode differs from the token bytes", s);
  if (streamed != text) die("streaming decode differs from decode", s);
  if (moe::unicode::is_valid_utf8(s) && text != expected)
    die("decode(encode(s)) differs from the (piecewise normalized) input", s);
  return 0;
}
