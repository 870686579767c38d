// Byte-level BPE tokenizer that reads Hugging Face tokenizer.json files (Qwen3, DeepSeek-V3 and
// other GPT-2-style tokenizers) and reproduces the ids of the Hugging Face `tokenizers` library.
//
// Pipeline, as in `tokenizers`: added tokens are split off the raw text first (longest match at the
// leftmost position; tokens with "normalized": true are matched after normalization); each
// remaining piece is normalized (NFC or nothing), pre-tokenized (Split regexes, Digits, ByteLevel)
// and every pre-token is merged by the BPE model. add_special applies the post-processor
// (TemplateProcessing, Bert, Roberta, ByteLevel or a Sequence of them).
//
// A Tokenizer is immutable after loading except for an internal, mutex-protected cache, so one
// instance may be used from several threads. Copies share the loaded data.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace moe {

class Tokenizer {
 public:
  // Limits on what a tokenizer.json may hold, checked while it is read and before anything is
  // sized by it (a kFormat error names the field). The largest vocabularies in use have about
  // 262k tokens; these leave 16x room or more while keeping every table bounded. The tables
  // indexed by id (about 70 bytes an id) are sized by the largest id, so ids must also be dense:
  // the largest id is less than twice the number of entries (vocabulary and added tokens) plus
  // kIdSlack (a small file may leave holes, e.g. added tokens at a round number past its
  // vocabulary). Ids are unique within the vocabulary and within the added tokens; an added token
  // may reuse a vocabulary id (it overrides that token, as in Hugging Face tokenizers).
  static constexpr int64_t kMaxTokenId = (int64_t(1) << 24) - 1;  // exact in a float, too
  static constexpr size_t kMaxVocabEntries = size_t(1) << 22;
  static constexpr size_t kMaxMerges = size_t(1) << 22;
  static constexpr size_t kMaxAddedTokens = size_t(1) << 20;
  static constexpr int64_t kIdSlack = int64_t(1) << 16;
  // tokenizer.json files in use are under 40 MB.
  static constexpr uint64_t kMaxFileBytes = uint64_t(1) << 30;

  // Reads a Hugging Face tokenizer.json (model type BPE, byte-level). Throws moe::Error: kIo if the
  // file is missing, unreadable, larger than kMaxFileBytes or not a regular file, kFormat if it is
  // malformed or past the limits above, kUnsupported for a model, normalizer, pre-tokenizer,
  // post-processor or decoder type it does not implement (naming it).
  static Tokenizer from_file(const std::string& tokenizer_json_path);
  // Same, from the text of a tokenizer.json; `origin` names it in error messages.
  static Tokenizer from_json_text(std::string_view json_text, const std::string& origin);

  // Encodes text. Added tokens (special or not) that appear in the text become their ids, as in
  // Hugging Face tokenizers. add_special applies the post-processor, like
  // `encode(text, add_special_tokens=True)`. Bytes that are not valid UTF-8 are encoded as their
  // byte-level tokens, so decode(encode(s)) == s for any s.
  std::vector<int32_t> encode(std::string_view text, bool add_special = false) const;
  // Same ids, but throws kInvalidArgument ("the text encodes to more than N tokens") once the
  // count, add_special's ids included, passes max_tokens: counted while encoding (and each word
  // checked before it is merged), so that a text far over the limit stops early, and refused
  // without encoding when its length alone proves it (more than max_tokens *
  // max_bytes_per_token() bytes).
  std::vector<int32_t> encode(std::string_view text, bool add_special, size_t max_tokens) const;
  // The most bytes of text one token can stand for: the longest token's bytes, times the most
  // that NFC can shrink text when the tokenizer normalizes. 0 when there is no such bound (an
  // added token that strips the spaces around it, a pre-tokenizer that removes text, bytes that
  // the vocabulary drops or fuses). A text of more than max_tokens * this bytes cannot encode
  // to max_tokens tokens or fewer.
  size_t max_bytes_per_token() const;

  // Decodes ids (invalid UTF-8 in the result is replaced by U+FFFD as Hugging Face does). Throws
  // kInvalidArgument naming the id if an id is not in the vocabulary.
  std::string decode(const std::vector<int32_t>& ids, bool skip_special = false) const;

  // Max id + 1 over the model vocabulary and the added tokens.
  int32_t vocab_size() const;
  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token string of an id (the vocabulary form, e.g. "Ġthe"); kInvalidArgument if unknown.
  std::string id_to_token(int32_t id) const;
  // True for added tokens flagged "special" (e.g. <|im_end|>); false for anything else.
  bool is_special(int32_t id) const;
  // The bytes that id decodes to (before UTF-8 repair); kInvalidArgument if unknown.
  std::string_view token_bytes(int32_t id) const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

// Streaming decode for generation: feed ids one by one, get the text that became complete. Bytes of
// an incomplete UTF-8 sequence are held back until the sequence completes (or flush()). The
// concatenation of all push() results and flush() equals Tokenizer::decode of all ids.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tok, bool skip_special = false);
  std::string push(int32_t id);
  std::string flush();

 private:
  Tokenizer tok_;  // shares the tokenizer's data, so the decoder may outlive the original object
  bool skip_special_;
  std::string pending_;
};

}  // namespace moe
