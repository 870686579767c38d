// Internal data of moe::Tokenizer, shared by tokenizer.cpp (loading tokenizer.json) and bpe.cpp
// (encoding and decoding). Not part of the public interface.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>
#include <utility>
#include <vector>

#include "text/tokenizer.h"

typedef struct pcre2_real_code_8 pcre2_code_8;
typedef struct pcre2_real_match_data_8 pcre2_match_data_8;

namespace moe::tok {

// A compiled PCRE2 pattern (UTF, Unicode properties, invalid UTF-8 tolerated, JIT when available).
class Regex {
 public:
  // `pattern` uses Oniguruma syntax as in tokenizer.json; \s, \S, \h and \H are translated to
  // their Oniguruma meaning. Throws kFormat naming `origin` if it does not compile.
  Regex(const std::string& pattern, const std::string& origin);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends the [begin, end) byte ranges of all non-overlapping, non-empty matches in subject.
  void find_all(std::string_view subject, pcre2_match_data_8* md,
                std::vector<std::pair<size_t, size_t>>& out) const;

 private:
  pcre2_code_8* code_ = nullptr;
  std::string pattern_;
};

// Match data for one encode() call (one pair of offsets is all that is read).
class MatchData {
 public:
  MatchData();
  ~MatchData();
  MatchData(const MatchData&) = delete;
  MatchData& operator=(const MatchData&) = delete;
  pcre2_match_data_8* get() const { return md_; }

 private:
  pcre2_match_data_8* md_;
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizer {
  enum class Kind { kSplit, kByteLevel } kind = Kind::kSplit;
  // kSplit (also used for Digits and for ByteLevel's use_regex): a regex or a literal string.
  std::unique_ptr<Regex> regex;
  std::string literal;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  // kByteLevel
  bool add_prefix_space = false;
};

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool single_word = false, lstrip = false, rstrip = false, normalized = false, special = false;
};

// Byte trie over added-token contents for leftmost-longest matching.
struct TokenTrie {
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> next;  // sorted by byte
    int32_t token = -1;                                   // index into Impl::added
  };
  std::vector<Node> nodes{Node{}};
  void insert(std::string_view s, int32_t token);
  // Index of the longest token starting at text[pos] and its length, or {-1, 0}.
  std::pair<int32_t, size_t> longest_at(std::string_view text, size_t pos) const;
  bool empty() const { return nodes.size() == 1; }
};

// Hash and equality that let string-keyed maps be searched with a string_view.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StringMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

struct MergeRule {
  int32_t rank;
  int32_t new_id;
};

}  // namespace moe::tok

namespace moe {

struct Tokenizer::Impl {
  std::string origin;  // file name for messages

  // Normalizer: NFC or nothing.
  bool nfc = false;
  // Pre-tokenizers in order; the last one is ByteLevel.
  std::vector<tok::PreTokenizer> pre_tokenizers;

  // BPE model.
  tok::StringMap vocab;  // byte-level token string -> id
  std::unordered_map<uint64_t, tok::MergeRule> merges;
  std::array<int32_t, 256> byte_id{};  // initial symbol of each byte; -1: dropped
  int32_t unk_id = -1;
  bool fuse_unk = false;
  bool ignore_merges = false;

  // Added tokens.
  std::vector<tok::AddedToken> added;
  tok::StringMap added_by_content;  // content -> id
  tok::TokenTrie raw_trie;          // tokens with normalized == false: matched on the raw text
  tok::TokenTrie normalized_trie;   // tokens with normalized == true: matched after normalization

  // Post-processor for add_special (single sequence).
  std::vector<int32_t> prefix_ids, suffix_ids;

  // Per id (index = id): token string, decoded bytes, special flag, known flag.
  std::vector<std::string> id_token;
  std::vector<std::string> id_bytes;
  std::vector<uint8_t> id_special;
  std::vector<uint8_t> id_known;

  // Bounds for encode's token limit (see Tokenizer::max_bytes_per_token). bpe_bytes_per_token:
  // the most bytes of a pre-token one BPE token covers, valid when every byte has its own
  // byte-level token (nothing is dropped or fused), else 0.
  size_t bpe_bytes_per_token = 0;
  size_t max_bytes_per_token = 0;

  // Bounded cache of BPE results per pre-token (bytes -> ids).
  static constexpr size_t kCacheCapacity = 1 << 15;
  static constexpr size_t kCacheMaxWord = 256;
  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>, tok::StringHash, std::equal_to<>>
      cache;

  static uint64_t pair_key(int32_t a, int32_t b) {
    return (uint64_t(uint32_t(a)) << 32) | uint32_t(b);
  }

  // Append the ids of text to out; throw kInvalidArgument once out holds more than max_tokens.
  void encode_text(std::string_view text, tok::MatchData& md, std::vector<int32_t>& out,
                   size_t max_tokens) const;
  void encode_normalized(std::string_view text, tok::MatchData& md, std::vector<int32_t>& out,
                         size_t max_tokens) const;
  void bpe(std::string_view word, std::vector<int32_t>& out) const;
  void bpe_uncached(std::string_view word, std::vector<int32_t>& out) const;
  // Splits text on the added tokens of trie: (token id or -1, begin, end) in order.
  void split_added(std::string_view text, const tok::TokenTrie& trie,
                   std::vector<std::tuple<int32_t, size_t, size_t>>& out) const;
  void check_id(int32_t id) const;
};

}  // namespace moe
