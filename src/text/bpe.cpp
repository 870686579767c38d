// Encoding and decoding for moe::Tokenizer: PCRE2 pre-tokenizer regexes, added-token splitting,
// byte-level BPE merging with a bounded per-word cache, decoding and streaming decoding. The
// behaviour follows Hugging Face tokenizers (tokenizers/src/{tokenizer,pre_tokenizers,models/bpe})
// so that the ids are identical; comments name the places where that matters.
#include <pcre2.h>

#include <algorithm>
#include <deque>
#include <limits>
#include <queue>

#include "text/tokenizer_impl.h"
#include "text/unicode_util.h"
#include "moe/errors.h"

namespace moe {
namespace tok {

namespace {

// Oniguruma (used by Hugging Face tokenizers) and PCRE2 agree on everything these patterns use
// except a few escapes: Oniguruma's \s is Unicode White_Space (it includes U+0085, PCRE2's does
// not), and \h is a hex digit in Oniguruma but horizontal space in PCRE2.
constexpr std::string_view kWhiteSpaceSet =
    "\\t\\n\\x0B\\f\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";
constexpr std::string_view kHexDigitSet = "0-9a-fA-F";

std::string translate_oniguruma(const std::string& pattern) {
  std::string out;
  out.reserve(pattern.size() + 64);
  bool in_class = false;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char e = pattern[i + 1];
      ++i;
      if (e == 's' || e == 'h') {
        const std::string_view set = e == 's' ? kWhiteSpaceSet : kHexDigitSet;
        if (in_class) {
          out += set;
        } else {
          out += '[';
          out += set;
          out += ']';
        }
      } else if ((e == 'S' || e == 'H') && !in_class) {
        out += "[^";
        out += e == 'S' ? kWhiteSpaceSet : kHexDigitSet;
        out += ']';
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal member of the class.
      if (i + 1 < pattern.size() && pattern[i + 1] == '^') out += pattern[++i];
      if (i + 1 < pattern.size() && pattern[i + 1] == ']') out += pattern[++i];
      continue;
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

}  // namespace

Regex::Regex(const std::string& pattern, const std::string& origin) : pattern_(pattern) {
  const std::string translated = translate_oniguruma(pattern);
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  code_ =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                    PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &err_offset, nullptr);
  if (!code_) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    MOE_THROW(kFormat, "{}: pre-tokenizer regex '{}' does not compile: {} (at offset {})", origin,
              pattern, reinterpret_cast<const char*>(msg), err_offset);
  }
  // JIT makes matching several times faster; without it (unsupported CPU, SELinux) the
  // interpreter is used.
  (void)pcre2_jit_compile(code_, PCRE2_JIT_COMPLETE);
}

Regex::~Regex() { pcre2_code_free(code_); }

void Regex::find_all(std::string_view subject, pcre2_match_data_8* md,
                     std::vector<std::pair<size_t, size_t>>& out) const {
  const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data());
  const size_t n = subject.size();
  size_t last_end = 0;
  bool have_last = false;
  size_t last_match_end = 0;
  // Iteration as in the onig crate's find_iter: an empty match right at the end of the previous
  // match is skipped by advancing one character; other empty matches are reported.
  while (last_end <= n) {
    int rc = pcre2_match(code_, s, n, last_end, 0, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0 && rc != PCRE2_ERROR_NOMATCH) {
      // The JIT stack or the match limit ran out: retry with the interpreter (heap-backed).
      rc = pcre2_match(code_, s, n, last_end, PCRE2_NO_JIT, md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof msg);
        MOE_THROW(kInternal, "pre-tokenizer regex '{}' failed on a {}-byte piece: {}", pattern_, n,
                  reinterpret_cast<const char*>(msg));
      }
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t b = ov[0], e = ov[1];
    if (b == e && have_last && last_match_end == e) {
      const size_t len = unicode::utf8_valid_len(subject, last_end);
      last_end += len ? len : 1;
      continue;
    }
    last_end = e;
    have_last = true;
    last_match_end = e;
    out.emplace_back(b, e);
  }
}

MatchData::MatchData() : md_(pcre2_match_data_create(1, nullptr)) {
  MOE_CHECK(md_, kInternal, "out of memory creating PCRE2 match data");
}
MatchData::~MatchData() { pcre2_match_data_free(md_); }

void TokenTrie::insert(std::string_view s, int32_t token) {
  int32_t node = 0;
  for (unsigned char c : s) {
    auto& next = nodes[node].next;
    auto it = std::lower_bound(next.begin(), next.end(), c,
                               [](const auto& p, unsigned char v) { return p.first < v; });
    if (it != next.end() && it->first == c) {
      node = it->second;
    } else {
      const auto child = static_cast<int32_t>(nodes.size());
      next.insert(it, {c, child});
      nodes.emplace_back();  // may reallocate: `next` is not used after this
      node = child;
    }
  }
  nodes[node].token = token;
}

std::pair<int32_t, size_t> TokenTrie::longest_at(std::string_view text, size_t pos) const {
  int32_t node = 0;
  std::pair<int32_t, size_t> best{-1, 0};
  for (size_t i = pos; i < text.size(); ++i) {
    const auto c = static_cast<unsigned char>(text[i]);
    const auto& next = nodes[node].next;
    auto it = std::lower_bound(next.begin(), next.end(), c,
                               [](const auto& p, unsigned char v) { return p.first < v; });
    if (it == next.end() || it->first != c) break;
    node = it->second;
    if (nodes[node].token >= 0) best = {nodes[node].token, i + 1 - pos};
  }
  return best;
}

namespace {

// Applies one Split step to a piece, as NormalizedString::split does.
void split_piece(const PreTokenizer& pt, std::string_view s, MatchData& md,
                 std::vector<std::pair<size_t, size_t>>& scratch,
                 std::vector<std::string_view>& out) {
  scratch.clear();
  if (pt.regex) {
    pt.regex->find_all(s, md.get(), scratch);
  } else if (!pt.literal.empty()) {
    for (size_t p = s.find(pt.literal); p != std::string_view::npos;
         p = s.find(pt.literal, p + pt.literal.size()))
      scratch.emplace_back(p, p + pt.literal.size());
  }
  // Cover the piece with (begin, end, is_match) ranges.
  struct Range {
    size_t b, e;
    bool match;
  };
  std::vector<Range> ranges;
  ranges.reserve(scratch.size() * 2 + 1);
  size_t prev = 0;
  for (auto [b, e] : scratch) {
    if (prev != b) ranges.push_back({prev, b, false});
    ranges.push_back({b, e, true});
    prev = e;
  }
  if (prev != s.size()) ranges.push_back({prev, s.size(), false});
  if (pt.invert)
    for (auto& r : ranges) r.match = !r.match;

  auto emit = [&](size_t b, size_t e) {
    if (e > b) out.push_back(s.substr(b, e - b));
  };
  switch (pt.behavior) {
    case SplitBehavior::kIsolated:
      for (const auto& r : ranges) emit(r.b, r.e);
      break;
    case SplitBehavior::kRemoved:
      for (const auto& r : ranges)
        if (!r.match) emit(r.b, r.e);
      break;
    case SplitBehavior::kContiguous:
    case SplitBehavior::kMergedWithPrevious: {
      std::vector<std::pair<size_t, size_t>> acc;
      bool previous_match = false;
      for (const auto& r : ranges) {
        const bool extend = pt.behavior == SplitBehavior::kContiguous ? r.match == previous_match
                                                                      : r.match && !previous_match;
        if (extend && !acc.empty())
          acc.back().second = r.e;
        else
          acc.emplace_back(r.b, r.e);
        previous_match = r.match;
      }
      for (auto [b, e] : acc) emit(b, e);
      break;
    }
    case SplitBehavior::kMergedWithNext: {
      std::vector<std::pair<size_t, size_t>> acc;
      bool previous_match = false;
      for (auto it = ranges.rbegin(); it != ranges.rend(); ++it) {
        if (it->match && !previous_match && !acc.empty())
          acc.back().first = it->b;
        else
          acc.emplace_back(it->b, it->e);
        previous_match = it->match;
      }
      for (auto it = acc.rbegin(); it != acc.rend(); ++it) emit(it->first, it->second);
      break;
    }
  }
}

// Start of the run of White_Space characters that ends text (byte offset).
size_t trailing_space_start(std::string_view text) {
  size_t pos = text.size();
  while (pos > 0) {
    size_t b = pos - 1;
    while (b > 0 && (static_cast<unsigned char>(text[b]) & 0xC0) == 0x80 && pos - b < 4) --b;
    const size_t n = unicode::utf8_valid_len(text, b);
    if (n != pos - b || !unicode::is_white_space(unicode::utf8_decode(text, b, n))) break;
    pos = b;
  }
  return pos;
}

// Length of the run of White_Space characters that starts text.
size_t leading_space_len(std::string_view text) {
  size_t pos = 0;
  while (pos < text.size()) {
    const size_t n = unicode::utf8_valid_len(text, pos);
    if (!n || !unicode::is_white_space(unicode::utf8_decode(text, pos, n))) break;
    pos += n;
  }
  return pos;
}

// Whether the character that ends / starts text is a word character (alphanumeric or '_'), for
// added tokens with single_word.
bool is_word_char(std::string_view ch) {
  static const Regex word("^[\\p{L}\\p{N}_]", "single_word check");
  MatchData md;
  std::vector<std::pair<size_t, size_t>> m;
  word.find_all(ch, md.get(), m);
  return !m.empty();
}

bool ends_with_word(std::string_view text) {
  if (text.empty()) return false;
  size_t b = text.size() - 1;
  while (b > 0 && (static_cast<unsigned char>(text[b]) & 0xC0) == 0x80 && text.size() - b < 4) --b;
  return is_word_char(text.substr(b));
}

bool starts_with_word(std::string_view text) {
  if (text.empty()) return false;
  const size_t n = unicode::utf8_valid_len(text, 0);
  return is_word_char(text.substr(0, n ? n : 1));
}

}  // namespace
}  // namespace tok

void Tokenizer::Impl::split_added(std::string_view text, const tok::TokenTrie& trie,
                                  std::vector<std::tuple<int32_t, size_t, size_t>>& out) const {
  out.clear();
  size_t start_offset = 0;
  size_t i = 0;
  if (!trie.empty()) {
    while (i < text.size()) {
      auto [index, len] = trie.longest_at(text, i);
      if (index < 0) {
        ++i;
        continue;
      }
      const tok::AddedToken& t = added[index];
      size_t start = i, stop = i + len;
      if (t.single_word && ((start > 0 && tok::ends_with_word(text.substr(0, start))) ||
                            (stop < text.size() && tok::starts_with_word(text.substr(stop))))) {
        i = stop;  // the automaton resumes after the rejected match
        continue;
      }
      if (t.lstrip)
        start = std::max(tok::trailing_space_start(text.substr(0, start)), start_offset);
      if (t.rstrip) stop += tok::leading_space_len(text.substr(stop));
      if (start_offset < start) out.emplace_back(-1, start_offset, start);
      out.emplace_back(t.id, start, stop);
      start_offset = stop;
      i = stop;
    }
  }
  if (start_offset < text.size()) out.emplace_back(-1, start_offset, text.size());
}

namespace {

[[noreturn]] void throw_too_many_tokens(size_t max_tokens) {
  MOE_THROW(kInvalidArgument, "the text encodes to more than {} tokens", max_tokens);
}

void check_count(const std::vector<int32_t>& out, size_t max_tokens) {
  if (out.size() > max_tokens) throw_too_many_tokens(max_tokens);
}

}  // namespace

void Tokenizer::Impl::encode_text(std::string_view text, tok::MatchData& md,
                                  std::vector<int32_t>& out, size_t max_tokens) const {
  std::vector<std::tuple<int32_t, size_t, size_t>> segments;
  split_added(text, raw_trie, segments);
  for (const auto& [id, b, e] : segments) {
    if (id >= 0) {
      out.push_back(id);
      check_count(out, max_tokens);
      continue;
    }
    std::string_view piece = text.substr(b, e - b);
    if (nfc) {
      const std::string normalized = unicode::nfc(piece);
      encode_normalized(normalized, md, out, max_tokens);
    } else {
      encode_normalized(piece, md, out, max_tokens);
    }
  }
}

void Tokenizer::Impl::encode_normalized(std::string_view text, tok::MatchData& md,
                                        std::vector<int32_t>& out, size_t max_tokens) const {
  std::vector<std::tuple<int32_t, size_t, size_t>> segments;
  split_added(text, normalized_trie, segments);
  std::vector<std::string_view> pieces, next;
  std::deque<std::string> owned;  // pieces that got a prefix space
  std::vector<std::pair<size_t, size_t>> scratch;
  for (const auto& [id, b, e] : segments) {
    if (id >= 0) {
      out.push_back(id);
      check_count(out, max_tokens);
      continue;
    }
    pieces.assign(1, text.substr(b, e - b));
    for (const tok::PreTokenizer& pt : pre_tokenizers) {
      next.clear();
      for (std::string_view p : pieces) {
        if (pt.kind == tok::PreTokenizer::Kind::kByteLevel) {
          if (pt.add_prefix_space && (p.empty() || p[0] != ' ')) {
            std::string& spaced = owned.emplace_back();
            spaced.reserve(p.size() + 1);
            spaced += ' ';
            spaced += p;
            p = spaced;
          }
          if (pt.regex)
            tok::split_piece(pt, p, md, scratch, next);
          else if (!p.empty())
            next.push_back(p);
        } else {
          tok::split_piece(pt, p, md, scratch, next);
        }
      }
      pieces.swap(next);
    }
    for (std::string_view p : pieces) {
      // A pre-token of n bytes becomes at least n / bpe_bytes_per_token tokens: a long word that
      // cannot fit is refused before the merging, the costly part, starts.
      if (bpe_bytes_per_token > 0 &&
          (p.size() + bpe_bytes_per_token - 1) / bpe_bytes_per_token > max_tokens - out.size())
        throw_too_many_tokens(max_tokens);
      bpe(p, out);
      check_count(out, max_tokens);
    }
  }
}

void Tokenizer::Impl::bpe(std::string_view word, std::vector<int32_t>& out) const {
  if (word.size() > kCacheMaxWord) {
    bpe_uncached(word, out);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(cache_mutex);
    auto it = cache.find(word);
    if (it != cache.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  bpe_uncached(word, out);
  std::vector<int32_t> ids(out.begin() + static_cast<std::ptrdiff_t>(first), out.end());
  std::lock_guard<std::mutex> lock(cache_mutex);
  if (cache.size() >= kCacheCapacity) cache.clear();
  cache.emplace(std::string(word), std::move(ids));
}

// BPE on one pre-token, as tokenizers' Word::merge_all: every adjacent pair that has a merge rule
// goes into a min-heap ordered by (rank, position); the best pair is merged and the pairs it forms
// with its neighbours are pushed; entries made stale by earlier merges are skipped.
void Tokenizer::Impl::bpe_uncached(std::string_view word, std::vector<int32_t>& out) const {
  if (ignore_merges) {
    std::string mapped;
    for (unsigned char c : word) unicode::utf8_append(mapped, unicode::byte_to_char()[c]);
    if (auto it = vocab.find(mapped); it != vocab.end()) {
      out.push_back(it->second);
      return;
    }
  }
  struct Symbol {
    int32_t id, prev, next;
    bool alive;
  };
  std::vector<Symbol> sym;
  sym.reserve(word.size());
  for (unsigned char c : word) {
    const int32_t id = byte_id[c];
    if (id < 0) continue;  // not in the vocabulary and no unk token: dropped, as tokenizers does
    if (fuse_unk && id == unk_id && !sym.empty() && sym.back().id == unk_id) continue;
    const auto n = static_cast<int32_t>(sym.size());
    sym.push_back({id, n - 1, n + 1, true});
  }
  if (sym.empty()) return;
  sym.back().next = -1;

  struct Candidate {
    int32_t rank, pos, new_id;
    bool operator>(const Candidate& o) const {
      return rank != o.rank ? rank > o.rank : pos > o.pos;
    }
  };
  std::priority_queue<Candidate, std::vector<Candidate>, std::greater<Candidate>> queue;
  auto push_pair = [&](int32_t pos) {
    const int32_t nxt = sym[pos].next;
    if (nxt < 0) return;
    auto it = merges.find(pair_key(sym[pos].id, sym[nxt].id));
    if (it != merges.end()) queue.push({it->second.rank, pos, it->second.new_id});
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(sym.size()); ++i) push_pair(i);
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    Symbol& s = sym[top.pos];
    if (!s.alive || s.next < 0) continue;
    Symbol& right = sym[s.next];
    auto it = merges.find(pair_key(s.id, right.id));
    if (it == merges.end() || it->second.new_id != top.new_id) continue;  // stale entry
    s.id = top.new_id;
    right.alive = false;
    s.next = right.next;
    if (s.next >= 0) sym[s.next].prev = top.pos;
    if (s.prev >= 0) push_pair(s.prev);
    push_pair(top.pos);
  }
  for (const Symbol& s : sym)
    if (s.alive) out.push_back(s.id);
}

void Tokenizer::Impl::check_id(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_known.size() || !id_known[id])
    MOE_THROW(kInvalidArgument, "token id {} is not in the vocabulary of {} (vocab size {})", id,
              origin, id_known.size());
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special) const {
  return encode(text, add_special, std::numeric_limits<size_t>::max());
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special,
                                       size_t max_tokens) const {
  const size_t per_token = impl_->max_bytes_per_token;
  if (per_token > 0 && max_tokens < std::numeric_limits<size_t>::max() / per_token &&
      text.size() > max_tokens * per_token)
    MOE_THROW(kInvalidArgument,
              "the text encodes to more than {} tokens (it has {} bytes, and no token stands for "
              "more than {})",
              max_tokens, text.size(), per_token);
  std::vector<int32_t> ids;
  ids.reserve(std::min(text.size() / 3, max_tokens) + 4);
  if (add_special) {
    ids.insert(ids.end(), impl_->prefix_ids.begin(), impl_->prefix_ids.end());
    check_count(ids, max_tokens);
  }
  tok::MatchData md;
  impl_->encode_text(text, md, ids, max_tokens);
  if (add_special) {
    ids.insert(ids.end(), impl_->suffix_ids.begin(), impl_->suffix_ids.end());
    check_count(ids, max_tokens);
  }
  return ids;
}

size_t Tokenizer::max_bytes_per_token() const { return impl_->max_bytes_per_token; }

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool skip_special) const {
  std::string bytes;
  for (int32_t id : ids) {
    impl_->check_id(id);
    if (skip_special && impl_->id_special[id]) continue;
    bytes += impl_->id_bytes[id];
  }
  return unicode::utf8_lossy(bytes);
}

StreamDecoder::StreamDecoder(const Tokenizer& tok, bool skip_special)
    : tok_(tok), skip_special_(skip_special) {}

std::string StreamDecoder::push(int32_t id) {
  const std::string_view bytes = tok_.token_bytes(id);
  if (skip_special_ && tok_.is_special(id)) return {};
  pending_ += bytes;
  const size_t keep = unicode::utf8_incomplete_tail(pending_);
  const size_t ready = pending_.size() - keep;
  if (ready == 0) return {};
  std::string text = unicode::utf8_lossy(std::string_view(pending_).substr(0, ready));
  pending_.erase(0, ready);
  return text;
}

std::string StreamDecoder::flush() {
  std::string text = unicode::utf8_lossy(pending_);
  pending_.clear();
  return text;
}

}  // namespace moe
