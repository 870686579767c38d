// Loading of Hugging Face tokenizer.json files into moe::Tokenizer (see tokenizer.h). Encoding and
// decoding live in bpe.cpp.
#include "text/tokenizer.h"

#include <algorithm>
#include <array>

#include <nlohmann/json.hpp>

#include "io/regular_file.h"
#include "text/tokenizer_impl.h"
#include "text/unicode_util.h"
#include "moe/errors.h"

namespace moe {

namespace {

using json = nlohmann::json;

// The GPT-2 pre-tokenizer regex that ByteLevel applies when use_regex is true.
constexpr const char* kGpt2Pattern =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

// Keeps library messages on one line.
std::string one_line(std::string s) {
  for (char& c : s)
    if (c == '\n' || c == '\r') c = ' ';
  if (s.size() > 300) s = s.substr(0, 300) + "...";
  return s;
}

std::string type_of(const json& j) {
  if (!j.is_object()) return "";
  auto it = j.find("type");
  return it != j.end() && it->is_string() ? it->get<std::string>() : "";
}

bool get_bool(const json& j, const char* key, bool fallback) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return fallback;
  return it->get<bool>();
}

// The bytes a token decodes to under ByteLevel: each character of the token is mapped back to its
// byte; a token with a character outside the byte alphabet (e.g. DeepSeek's
// "<｜begin▁of▁sentence｜>") is taken as its UTF-8 text, as tokenizers' ByteLevel decoder does.
std::string byte_level_bytes(const std::string& token) {
  static const std::array<int16_t, 512> c2b = [] {  // the byte alphabet lies below U+0200
    std::array<int16_t, 512> table;
    table.fill(-1);
    const auto& b2c = unicode::byte_to_char();
    for (int b = 0; b < 256; ++b) table[b2c[b]] = static_cast<int16_t>(b);
    return table;
  }();
  std::string bytes;
  bytes.reserve(token.size());
  for (size_t i = 0; i < token.size();) {
    const size_t len = unicode::utf8_valid_len(token, i);
    if (!len) return token;
    const char32_t cp = unicode::utf8_decode(token, i, len);
    if (cp >= c2b.size() || c2b[cp] < 0) return token;
    bytes.push_back(static_cast<char>(c2b[cp]));
    i += len;
  }
  return bytes;
}

// Parsed text of one merge: the two tokens concatenated, and where the second one starts.
struct RawMerge {
  std::string joined;
  uint32_t split;
};

// SAX handler that builds the JSON document except for the two big members, model.vocab and
// model.merges, which it streams straight into the vocabulary map and a merge list. That halves
// the load time of a 150k-token file compared with building the full document.
class TokenizerSax : public nlohmann::json_sax<json> {
 public:
  explicit TokenizerSax(tok::StringMap& vocab) : vocab_(vocab) {}

  json root;
  std::vector<RawMerge> merges;
  bool have_vocab = false, have_merges = false;
  std::string error;          // the first problem found, if any
  bool syntax_error = false;  // error is the JSON parser's (else a value this loader refuses)

  bool null() override { return value(json()); }
  bool boolean(bool v) override { return value(v); }
  bool number_integer(number_integer_t v) override {
    return mode() == Mode::kVocab ? vocab_entry(v) : value(v);
  }
  bool number_unsigned(number_unsigned_t v) override {
    return mode() == Mode::kVocab
               ? vocab_entry(static_cast<int64_t>(std::min<uint64_t>(v, uint64_t(1) << 40)))
               : value(v);
  }
  bool number_float(number_float_t v, const string_t&) override {
    if (mode() == Mode::kVocab)
      return fail(fmt::format("model.vocab['{}'] id is not an integer", key_));
    return value(v);
  }
  bool binary(binary_t&) override { return fail("unexpected binary value"); }
  bool string(string_t& v) override {
    switch (mode()) {
      case Mode::kVocab:
        return fail(fmt::format("model.vocab['{}'] id is not an integer", key_));
      case Mode::kMerges: {
        const size_t sp = v.find(' ');
        if (sp == std::string::npos)
          return fail(fmt::format("merge #{} '{}' is not of the form 'a b'", merges.size(), v));
        if (!room_for_merge()) return false;
        v.erase(sp, 1);
        merges.push_back({std::move(v), static_cast<uint32_t>(sp)});
        return true;
      }
      case Mode::kMergePair:
        if (pair_parts_ == 0) pair_split_ = static_cast<uint32_t>(v.size());
        pair_text_ += v;
        ++pair_parts_;
        return true;
      case Mode::kDom:
        return value(v);
    }
    return true;
  }
  bool key(string_t& k) override {
    key_ = std::move(k);
    return true;
  }
  bool start_object(std::size_t) override {
    return open_container("vocab", Mode::kVocab, have_vocab, json::object());
  }
  bool end_object() override {
    stack_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    if (mode() == Mode::kMerges) {
      pair_text_.clear();
      pair_parts_ = 0;
      stack_.push_back({nullptr, Mode::kMergePair, {}});
      return true;
    }
    return open_container("merges", Mode::kMerges, have_merges, json::array());
  }
  bool end_array() override {
    if (mode() == Mode::kMergePair) {
      if (pair_parts_ != 2)
        return fail(fmt::format("merge #{} is not a pair of strings", merges.size()));
      if (!room_for_merge()) return false;
      merges.push_back({std::move(pair_text_), pair_split_});
      pair_text_.clear();
    }
    stack_.pop_back();
    return true;
  }
  bool parse_error(std::size_t, const std::string&,
                   const nlohmann::detail::exception& ex) override {
    if (error.empty()) syntax_error = true;
    return fail(ex.what());
  }

 private:
  enum class Mode { kDom, kVocab, kMerges, kMergePair };
  struct Frame {
    json* node;
    Mode mode;
    std::string key;  // the key this container was stored under in its parent
  };

  Mode mode() const { return stack_.empty() ? Mode::kDom : stack_.back().mode; }

  // True when the container about to open is the member `name` of the top-level "model" object.
  bool at_model_member(const char* name) const {
    return stack_.size() == 2 && stack_[1].key == "model" && stack_[1].node &&
           stack_[1].node->is_object() && key_ == name;
  }

  bool fail(std::string message) {
    if (error.empty()) error = std::move(message);
    return false;
  }

  // The limits are checked as entries stream in, so that the map and the merge list never grow
  // past them.
  bool vocab_entry(int64_t id) {
    if (id < 0)
      return fail(fmt::format("model.vocab['{}'] has a negative id {}", key_, id));
    if (id > Tokenizer::kMaxTokenId)
      return fail(fmt::format("model.vocab['{}'] id {} is past the largest supported id {}", key_,
                              id, Tokenizer::kMaxTokenId));
    if (vocab_.size() >= Tokenizer::kMaxVocabEntries && !vocab_.count(key_))
      return fail(fmt::format("model.vocab has more than the {} entries supported",
                              Tokenizer::kMaxVocabEntries));
    vocab_.insert_or_assign(std::move(key_), static_cast<int32_t>(id));
    return true;
  }
  bool room_for_merge() {
    if (merges.size() < Tokenizer::kMaxMerges) return true;
    return fail(fmt::format("model.merges has more than the {} entries supported",
                            Tokenizer::kMaxMerges));
  }

  json* place(json&& v) {
    if (stack_.empty()) {
      root = std::move(v);
      return &root;
    }
    json* parent = stack_.back().node;
    if (parent->is_array()) {
      parent->push_back(std::move(v));
      return &parent->back();
    }
    json& slot = (*parent)[key_];
    slot = std::move(v);
    return &slot;
  }
  bool value(json&& v) {
    if (mode() == Mode::kMergePair) return fail("merges must be strings or pairs of strings");
    if (mode() != Mode::kDom) return fail(fmt::format("unexpected value in {}", stack_.back().key));
    place(std::move(v));
    return true;
  }
  bool open(json&& container) {
    std::string key = stack_.empty() || stack_.back().node->is_array() ? std::string() : key_;
    json* node = place(std::move(container));
    stack_.push_back({node, Mode::kDom, std::move(key)});
    return true;
  }
  // An object or array opening where the DOM is being built: model.vocab and model.merges are
  // streamed in `streamed` mode (and `seen` set), anything else becomes `container` in the DOM.
  bool open_container(const char* member, Mode streamed, bool& seen, json&& container) {
    if (mode() != Mode::kDom) return fail("merges must be strings or pairs of strings");
    if (at_model_member(member)) {
      seen = true;
      stack_.push_back({nullptr, streamed, key_});
      return true;
    }
    return open(std::move(container));
  }

  tok::StringMap& vocab_;
  std::vector<Frame> stack_;
  std::string key_;
  std::string pair_text_;
  uint32_t pair_split_ = 0;
  int pair_parts_ = 0;
};

struct Loader {
  Tokenizer::Impl& t;
  const std::string& origin;
  const TokenizerSax& sax;

  // A token id read from the file; `field` names where, e.g. "added_tokens[3].id".
  int32_t token_id(const json& v, const std::string& field) const {
    MOE_CHECK(v.is_number_integer(), kFormat, "{}: {} is {}, not an integer token id", origin,
              field, one_line(v.dump()));
    MOE_CHECK(v.is_number_unsigned() || v.get<int64_t>() >= 0, kFormat,
              "{}: {} is a negative token id {}", origin, field, v.get<int64_t>());
    const uint64_t id = v.get<uint64_t>();
    MOE_CHECK(id <= uint64_t(Tokenizer::kMaxTokenId), kFormat,
              "{}: {} {} is past the largest supported id {}", origin, field, id,
              Tokenizer::kMaxTokenId);
    return static_cast<int32_t>(id);
  }

  void model(const json& m) {
    MOE_CHECK(m.is_object(), kFormat, "{}: \"model\" is missing or not an object", origin);
    std::string type = type_of(m);
    if (type.empty() && sax.have_merges) type = "BPE";  // old files omit the type
    if (type != "BPE")
      MOE_THROW(kUnsupported, "{}: tokenizer model type '{}' is not supported (only BPE)", origin,
                type.empty() ? "(none)" : type);
    if (auto it = m.find("dropout"); it != m.end() && !it->is_null() && it->get<double>() > 0)
      MOE_THROW(kUnsupported, "{}: BPE dropout is not supported", origin);
    for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
      auto it = m.find(key);
      if (it != m.end() && !it->is_null() && !it->get<std::string>().empty())
        MOE_THROW(kUnsupported, "{}: BPE {} '{}' is not supported (byte-level BPE has none)",
                  origin, key, it->get<std::string>());
    }
    t.ignore_merges = get_bool(m, "ignore_merges", false);
    t.fuse_unk = get_bool(m, "fuse_unk", false);

    MOE_CHECK(sax.have_vocab, kFormat, "{}: model \"vocab\" is missing or not an object", origin);
    MOE_CHECK(sax.have_merges, kFormat, "{}: model \"merges\" is missing or not an array", origin);

    if (auto it = m.find("unk_token"); it != m.end() && !it->is_null()) {
      const auto unk = it->get<std::string>();
      auto v = t.vocab.find(unk);
      MOE_CHECK(v != t.vocab.end(), kFormat, "{}: unk_token '{}' is not in the vocabulary", origin,
                unk);
      t.unk_id = v->second;
    }

    t.merges.reserve(sax.merges.size() * 2);
    int32_t rank = 0;
    for (const RawMerge& merge : sax.merges) {
      const std::string_view joined = merge.joined;
      const std::string_view a = joined.substr(0, merge.split), b = joined.substr(merge.split);
      int32_t ids[3];
      const std::string_view parts[3] = {a, b, joined};
      for (int k = 0; k < 3; ++k) {
        auto v = t.vocab.find(parts[k]);
        MOE_CHECK(v != t.vocab.end(), kFormat,
                  "{}: merge #{} '{} {}' uses token '{}' that is not in the vocabulary", origin,
                  rank, a, b, parts[k]);
        ids[k] = v->second;
      }
      // Like tokenizers' HashMap collect, a repeated pair keeps its last rank.
      t.merges[Tokenizer::Impl::pair_key(ids[0], ids[1])] = {rank, ids[2]};
      ++rank;
    }

    const auto& b2c = unicode::byte_to_char();
    for (int b = 0; b < 256; ++b) {
      std::string ch;
      unicode::utf8_append(ch, b2c[b]);
      auto v = t.vocab.find(ch);
      t.byte_id[b] = v != t.vocab.end() ? v->second : t.unk_id;
    }
  }

  void normalizer(const json& n) {
    if (n.is_null()) return;
    const std::string type = type_of(n);
    if (type == "NFC") {
      t.nfc = true;
    } else if (type == "Sequence") {
      auto it = n.find("normalizers");
      MOE_CHECK(it != n.end() && it->is_array(), kFormat,
                "{}: Sequence normalizer lacks \"normalizers\"", origin);
      for (const json& sub : *it) normalizer(sub);
    } else {
      MOE_THROW(kUnsupported, "{}: normalizer type '{}' is not supported (NFC or none)", origin,
                type.empty() ? one_line(n.dump()) : type);
    }
  }

  static tok::SplitBehavior behavior(const std::string& name, const std::string& origin) {
    if (name == "Isolated") return tok::SplitBehavior::kIsolated;
    if (name == "Removed") return tok::SplitBehavior::kRemoved;
    if (name == "MergedWithPrevious") return tok::SplitBehavior::kMergedWithPrevious;
    if (name == "MergedWithNext") return tok::SplitBehavior::kMergedWithNext;
    if (name == "Contiguous") return tok::SplitBehavior::kContiguous;
    MOE_THROW(kFormat, "{}: unknown Split behavior '{}'", origin, name);
  }

  void pre_tokenizer(const json& p) {
    const std::string type = type_of(p);
    if (type == "Sequence") {
      auto it = p.find("pretokenizers");
      MOE_CHECK(it != p.end() && it->is_array(), kFormat,
                "{}: Sequence pre-tokenizer lacks \"pretokenizers\"", origin);
      for (const json& sub : *it) pre_tokenizer(sub);
      return;
    }
    if (!t.pre_tokenizers.empty() &&
        t.pre_tokenizers.back().kind == tok::PreTokenizer::Kind::kByteLevel)
      MOE_THROW(kUnsupported, "{}: pre-tokenizer '{}' after ByteLevel is not supported", origin,
                type);
    tok::PreTokenizer pt;
    if (type == "Split") {
      auto pat = p.find("pattern");
      MOE_CHECK(pat != p.end() && pat->is_object(), kFormat,
                "{}: Split pre-tokenizer lacks a \"pattern\" object", origin);
      if (auto r = pat->find("Regex"); r != pat->end())
        pt.regex = std::make_unique<tok::Regex>(r->get<std::string>(), origin);
      else if (auto s = pat->find("String"); s != pat->end())
        pt.literal = s->get<std::string>();
      else
        MOE_THROW(kFormat, "{}: Split pattern is neither Regex nor String: {}", origin,
                  one_line(pat->dump()));
      pt.behavior = behavior(p.value("behavior", std::string("Isolated")), origin);
      pt.invert = get_bool(p, "invert", false);
    } else if (type == "Digits") {
      // Digits splits on char::is_numeric (\p{N}); contiguous digits stay together unless
      // individual_digits.
      const bool individual = get_bool(p, "individual_digits", false);
      pt.regex = std::make_unique<tok::Regex>(individual ? "\\p{N}" : "\\p{N}+", origin);
    } else if (type == "ByteLevel") {
      pt.kind = tok::PreTokenizer::Kind::kByteLevel;
      pt.add_prefix_space = get_bool(p, "add_prefix_space", true);
      if (get_bool(p, "use_regex", true))
        pt.regex = std::make_unique<tok::Regex>(kGpt2Pattern, origin);
    } else {
      MOE_THROW(kUnsupported,
                "{}: pre-tokenizer type '{}' is not supported (Sequence, Split, Digits, ByteLevel)",
                origin, type.empty() ? one_line(p.dump()) : type);
    }
    t.pre_tokenizers.push_back(std::move(pt));
  }

  int32_t special_id(const std::string& name) {
    auto it = t.added_by_content.find(name);
    if (it != t.added_by_content.end()) return it->second;
    auto v = t.vocab.find(name);
    MOE_CHECK(v != t.vocab.end(), kFormat, "{}: post-processor token '{}' is not in the vocabulary",
              origin, name);
    return v->second;
  }

  void post_processor(const json& p) {
    if (p.is_null()) return;
    const std::string type = type_of(p);
    std::vector<int32_t> prefix, suffix;
    if (type == "ByteLevel") {
      return;  // only adjusts offsets
    } else if (type == "Sequence") {
      auto it = p.find("processors");
      MOE_CHECK(it != p.end() && it->is_array(), kFormat,
                "{}: Sequence post-processor lacks \"processors\"", origin);
      for (const json& sub : *it) post_processor(sub);
      return;
    } else if (type == "TemplateProcessing") {
      auto single = p.find("single");
      MOE_CHECK(single != p.end() && single->is_array(), kFormat,
                "{}: TemplateProcessing lacks \"single\"", origin);
      const json& specials = p.contains("special_tokens") ? p.at("special_tokens") : json::object();
      bool seen_sequence = false;
      for (const json& piece : *single) {
        if (piece.contains("Sequence")) {
          seen_sequence = true;
          continue;
        }
        auto st = piece.find("SpecialToken");
        MOE_CHECK(st != piece.end(), kFormat, "{}: TemplateProcessing piece {} is not understood",
                  origin, one_line(piece.dump()));
        const std::string name = st->at("id").get<std::string>();
        std::vector<int32_t> ids;
        if (auto s = specials.find(name); s != specials.end() && s->contains("ids")) {
          const json& list = s->at("ids");
          MOE_CHECK(list.is_array(), kFormat,
                    "{}: post_processor.special_tokens['{}'].ids is not an array", origin, name);
          for (size_t k = 0; k < list.size(); ++k)
            ids.push_back(token_id(
                list[k], fmt::format("post_processor.special_tokens['{}'].ids[{}]", name, k)));
        } else {
          ids.push_back(special_id(name));
        }
        auto& dst = seen_sequence ? suffix : prefix;
        dst.insert(dst.end(), ids.begin(), ids.end());
      }
    } else if (type == "BertProcessing" || type == "RobertaProcessing") {
      prefix.push_back(token_id(p.at("cls").at(1), "post_processor.cls[1]"));
      suffix.push_back(token_id(p.at("sep").at(1), "post_processor.sep[1]"));
    } else {
      MOE_THROW(kUnsupported,
                "{}: post-processor type '{}' is not supported (TemplateProcessing, Bert, Roberta, "
                "ByteLevel, Sequence)",
                origin, type.empty() ? one_line(p.dump()) : type);
    }
    // A later processor wraps the result of an earlier one.
    t.prefix_ids.insert(t.prefix_ids.begin(), prefix.begin(), prefix.end());
    t.suffix_ids.insert(t.suffix_ids.end(), suffix.begin(), suffix.end());
  }

  void decoder(const json& d) {
    const std::string type = type_of(d);
    if (type == "ByteLevel") return;
    if (type == "Sequence") {
      auto it = d.find("decoders");
      MOE_CHECK(it != d.end() && it->is_array() && !it->empty(), kFormat,
                "{}: Sequence decoder lacks \"decoders\"", origin);
      for (const json& sub : *it) decoder(sub);
      return;
    }
    MOE_THROW(kUnsupported, "{}: decoder type '{}' is not supported (only ByteLevel)", origin,
              d.is_null()    ? "null"
              : type.empty() ? one_line(d.dump())
                             : type);
  }

  void added_tokens(const json& a) {
    if (a.is_null()) return;
    MOE_CHECK(a.is_array(), kFormat, "{}: \"added_tokens\" is not an array", origin);
    MOE_CHECK(a.size() <= Tokenizer::kMaxAddedTokens, kFormat,
              "{}: added_tokens has {} entries, more than the {} supported", origin, a.size(),
              Tokenizer::kMaxAddedTokens);
    t.added.reserve(a.size());
    for (size_t i = 0; i < a.size(); ++i) {
      const json& e = a[i];
      MOE_CHECK(e.is_object(), kFormat, "{}: added_tokens[{}] is not an object", origin, i);
      tok::AddedToken tk;
      tk.id = token_id(e.at("id"), fmt::format("added_tokens[{}].id", i));
      tk.content = e.at("content").get<std::string>();
      tk.single_word = get_bool(e, "single_word", false);
      tk.lstrip = get_bool(e, "lstrip", false);
      tk.rstrip = get_bool(e, "rstrip", false);
      tk.normalized = get_bool(e, "normalized", !get_bool(e, "special", false));
      tk.special = get_bool(e, "special", false);
      t.added_by_content[tk.content] = tk.id;
      t.added.push_back(std::move(tk));
    }
  }

  // Builds the tables indexed by id. They are sized by the largest id, so that id is first
  // checked against the number of entries: the tables stay proportional to the file.
  void finish() {
    for (size_t i = 0; i < t.added.size(); ++i) {
      const tok::AddedToken& tk = t.added[i];
      if (tk.content.empty()) continue;
      if (tk.normalized)
        t.normalized_trie.insert(t.nfc ? unicode::nfc(tk.content) : tk.content,
                                 static_cast<int32_t>(i));
      else
        t.raw_trie.insert(tk.content, static_cast<int32_t>(i));
    }
    check_id_density();
    int32_t max_id = -1;
    for (const auto& [token, id] : t.vocab) max_id = std::max(max_id, id);
    for (const auto& tk : t.added) max_id = std::max(max_id, tk.id);
    const size_t n = static_cast<size_t>(max_id + 1);
    t.id_token.assign(n, {});
    t.id_known.assign(n, 0);
    t.id_special.assign(n, 0);
    t.id_bytes.assign(n, {});
    for (const auto& [token, id] : t.vocab) {
      MOE_CHECK(!t.id_known[id], kFormat,
                "{}: model.vocab['{}'] and model.vocab['{}'] both have id {}", origin,
                one_line(t.id_token[id]), one_line(token), id);
      t.id_token[id] = token;
      t.id_known[id] = 1;
    }
    // The longest text one BPE token covers, measured before added tokens take over some ids.
    size_t longest_bpe = 0;
    for (size_t id = 0; id < n; ++id) {
      if (!t.id_known[id]) continue;
      t.id_bytes[id] = byte_level_bytes(t.id_token[id]);
      longest_bpe = std::max(longest_bpe, t.id_bytes[id].size());
    }
    size_t longest_added = 0;
    std::vector<int32_t> added_at(n, -1);  // index in added_tokens of each id taken
    for (size_t i = 0; i < t.added.size(); ++i) {  // the added vocabulary wins, as in tokenizers
      const tok::AddedToken& tk = t.added[i];
      MOE_CHECK(added_at[tk.id] < 0, kFormat,
                "{}: added_tokens[{}] and added_tokens[{}] both have id {}", origin,
                added_at[tk.id], i, tk.id);
      added_at[tk.id] = static_cast<int32_t>(i);
      t.id_token[tk.id] = tk.content;
      t.id_known[tk.id] = 1;
      t.id_special[tk.id] = tk.special ? 1 : 0;
      t.id_bytes[tk.id] = byte_level_bytes(tk.content);
      // A normalized token is matched in the normalized text, where it may be longer.
      const size_t matched =
          tk.normalized && t.nfc ? unicode::nfc(tk.content).size() : tk.content.size();
      longest_added = std::max({longest_added, tk.content.size(), matched});
    }
    for (const auto* list : {&t.prefix_ids, &t.suffix_ids})
      for (int32_t id : *list)
        MOE_CHECK(static_cast<size_t>(id) < n && t.id_known[id], kFormat,
                  "{}: post_processor adds id {}, which is no token", origin, id);
    set_length_bounds(longest_bpe, longest_added);
  }

  // The largest id may be at most twice the number of entries (vocabulary and added tokens) plus
  // Tokenizer::kIdSlack, so that a few entries cannot size the id tables by a huge id.
  void check_id_density() const {
    int64_t max_vocab = -1, max_added = -1;
    const std::string* max_vocab_token = nullptr;
    size_t max_added_index = 0;
    for (const auto& [token, id] : t.vocab) {
      if (id <= max_vocab) continue;
      max_vocab = id;
      max_vocab_token = &token;
    }
    for (size_t i = 0; i < t.added.size(); ++i) {
      if (t.added[i].id <= max_added) continue;
      max_added = t.added[i].id;
      max_added_index = i;
    }
    const int64_t entries = static_cast<int64_t>(t.vocab.size() + t.added.size());
    const int64_t largest = 2 * entries + Tokenizer::kIdSlack - 1;
    if (std::max(max_vocab, max_added) <= largest) return;
    const std::string field =
        max_added > max_vocab ? fmt::format("added_tokens[{}].id", max_added_index)
                              : fmt::format("model.vocab['{}'] id", one_line(*max_vocab_token));
    MOE_THROW(kFormat,
              "{}: {} {} leaves most ids unused: {} tokens may use ids up to {} (twice their "
              "number plus {})",
              origin, field, std::max(max_vocab, max_added), entries, largest,
              Tokenizer::kIdSlack);
  }

  // Bounds for encode's token limit (see Tokenizer::max_bytes_per_token).
  void set_length_bounds(size_t longest_bpe, size_t longest_added) {
    // When every byte has its own token, a BPE token is the merge of longest_bpe bytes at most.
    bool every_byte_kept = true;
    for (int32_t id : t.byte_id) every_byte_kept = every_byte_kept && id >= 0 && id != t.unk_id;
    t.bpe_bytes_per_token = every_byte_kept ? longest_bpe : 0;
    // Text also vanishes into a token that strips spaces, or in a Split that removes matches.
    bool text_kept = every_byte_kept;
    for (const auto& tk : t.added) text_kept = text_kept && !tk.lstrip && !tk.rstrip;
    for (const auto& pt : t.pre_tokenizers)
      text_kept = text_kept && pt.behavior != tok::SplitBehavior::kRemoved;
    const size_t longest = std::max(longest_bpe, longest_added);
    t.max_bytes_per_token = text_kept ? longest * (t.nfc ? unicode::kNfcMaxShrink : 1) : 0;
  }
};

}  // namespace

Tokenizer Tokenizer::from_file(const std::string& path) {
  return from_json_text(read_regular_file(path, kMaxFileBytes), path);
}

Tokenizer Tokenizer::from_json_text(std::string_view text, const std::string& origin) {
  auto impl = std::make_shared<Impl>();
  impl->origin = origin;
  impl->vocab.reserve(1 << 18);
  TokenizerSax sax(impl->vocab);
  bool ok = false;
  try {
    ok = json::sax_parse(text.begin(), text.end(), &sax);
  } catch (const json::exception& e) {
    sax.error = e.what();
    sax.syntax_error = true;
  }
  if (!ok || !sax.error.empty()) {
    if (!sax.error.empty() && !sax.syntax_error)
      MOE_THROW(kFormat, "{}: {}", origin, one_line(sax.error));
    MOE_THROW(kFormat, "{}: malformed tokenizer JSON: {}", origin,
              one_line(sax.error.empty() ? "parse failed" : sax.error));
  }
  const json& j = sax.root;
  MOE_CHECK(j.is_object(), kFormat, "{}: tokenizer JSON is not an object", origin);
  Loader loader{*impl, origin, sax};
  try {
    loader.model(j.contains("model") ? j.at("model") : json());
    loader.added_tokens(j.contains("added_tokens") ? j.at("added_tokens") : json());
    loader.normalizer(j.contains("normalizer") ? j.at("normalizer") : json());
    const json pre = j.contains("pre_tokenizer") ? j.at("pre_tokenizer") : json();
    if (!pre.is_null()) loader.pre_tokenizer(pre);
    if (impl->pre_tokenizers.empty() ||
        impl->pre_tokenizers.back().kind != tok::PreTokenizer::Kind::kByteLevel)
      MOE_THROW(kUnsupported,
                "{}: pre-tokenizer does not end with ByteLevel; only byte-level BPE is supported",
                origin);
    loader.post_processor(j.contains("post_processor") ? j.at("post_processor") : json());
    loader.decoder(j.contains("decoder") ? j.at("decoder") : json());
    loader.finish();
  } catch (const json::exception& e) {
    MOE_THROW(kFormat, "{}: unexpected tokenizer JSON content: {}", origin, one_line(e.what()));
  }
  return Tokenizer(std::move(impl));
}

int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_known.size()); }

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (auto it = impl_->added_by_content.find(token); it != impl_->added_by_content.end())
    return it->second;
  if (auto it = impl_->vocab.find(token); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

std::string Tokenizer::id_to_token(int32_t id) const {
  impl_->check_id(id);
  return impl_->id_token[id];
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < impl_->id_special.size() && impl_->id_special[id];
}

std::string_view Tokenizer::token_bytes(int32_t id) const {
  impl_->check_id(id);
  return impl_->id_bytes[id];
}

}  // namespace moe
