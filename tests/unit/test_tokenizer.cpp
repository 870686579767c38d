// Tokenizer tests: ids against Hugging Face tokenizers' reference output for the real Qwen3 and
// DeepSeek-V3 tokenizers (tests/data/tokenizer_ids_*.json, written by
// scripts/make_tokenizer_refs.py), round trips, streaming decode, errors, and small hand-made
// tokenizers whose expected ids follow from the BPE rules.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_util.h"
#include "text/tokenizer.h"
#include "text/unicode_util.h"
#include "moe/errors.h"

namespace {

using json = nlohmann::json;

std::string source_path(const std::string& rel) { return std::string(MOE_SOURCE_DIR) + "/" + rel; }

// The real tokenizers are fetched, not committed. Missing files are a failure, not a skip: the
// tests would otherwise pass without testing anything.
const moe::Tokenizer* load_tokenizer(const std::string& name) {
  static std::map<std::string, std::unique_ptr<moe::Tokenizer>> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return it->second.get();
  const std::string path = source_path(".cache/tokenizers/" + name + "/tokenizer.json");
  if (!std::filesystem::exists(path)) {
    ADD_FAILURE() << path << " is missing: run scripts/fetch_tokenizers.sh";
    return nullptr;
  }
  const auto t0 = std::chrono::steady_clock::now();
  auto tok = std::make_unique<moe::Tokenizer>(moe::Tokenizer::from_file(path));
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ info     ] loaded %s tokenizer in %.3f s\n", name.c_str(), s);
  return cache.emplace(name, std::move(tok)).first->second.get();
}

const json* load_refs(const std::string& name) {
  static std::map<std::string, json> cache;
  auto it = cache.find(name);
  if (it != cache.end()) return &it->second;
  const std::string path = source_path("tests/data/tokenizer_ids_" + name + ".json");
  std::ifstream in(path);
  if (!in) {
    ADD_FAILURE() << path
                  << " is missing: run scripts/make_tokenizer_refs.py (needs HF tokenizers)";
    return nullptr;
  }
  return &cache.emplace(name, json::parse(in)).first->second;
}

std::vector<int32_t> as_ids(const json& j) { return j.get<std::vector<int32_t>>(); }

using moe::test::error_kind_of;
using moe::test::temp_file;

void check_reference_ids(const std::string& name) {
  const moe::Tokenizer* tok = load_tokenizer(name);
  const json* refs = load_refs(name);
  ASSERT_NE(tok, nullptr);
  ASSERT_NE(refs, nullptr);
  const json& entries = refs->at("entries");
  ASSERT_GE(entries.size(), 30u);
  size_t plain_ok = 0, special_ok = 0;
  for (const json& e : entries) {
    const std::string text = e.at("text").get<std::string>();
    SCOPED_TRACE("text: " + text);
    const auto ids = tok->encode(text);
    const auto ids_special = tok->encode(text, /*add_special=*/true);
    EXPECT_EQ(ids, as_ids(e.at("ids")));
    EXPECT_EQ(ids_special, as_ids(e.at("ids_with_special")));
    plain_ok += ids == as_ids(e.at("ids"));
    special_ok += ids_special == as_ids(e.at("ids_with_special"));
  }
  std::printf("[ info     ] %s: %zu/%zu entries match (ids), %zu/%zu (ids_with_special)\n",
              name.c_str(), plain_ok, entries.size(), special_ok, entries.size());
}

void check_round_trip(const std::string& name) {
  const moe::Tokenizer* tok = load_tokenizer(name);
  const json* refs = load_refs(name);
  ASSERT_NE(tok, nullptr);
  ASSERT_NE(refs, nullptr);
  for (const json& e : refs->at("entries")) {
    const std::string text = e.at("text").get<std::string>();
    const std::string decoded = e.at("decoded").get<std::string>();
    SCOPED_TRACE("text: " + text);
    // Decoding Hugging Face's ids gives Hugging Face's text.
    EXPECT_EQ(tok->decode(as_ids(e.at("ids"))), decoded);
    // Our own round trip gives the text back up to normalization (Qwen3 normalizes with NFC, so
    // HF's `decoded` is the NFC form of the text).
    EXPECT_EQ(tok->decode(tok->encode(text)), decoded);
    // HF's normalization agrees with ours: Qwen3 applies NFC, DeepSeek-V3 nothing.
    EXPECT_EQ(decoded, name == "qwen3" ? moe::unicode::nfc(text) : text);
    if (moe::unicode::nfc(text) == text) {
      EXPECT_EQ(tok->decode(tok->encode(text)), text);
    }
    // With BOS/EOS skipped, the post-processed ids decode to the same text.
    EXPECT_EQ(tok->decode(tok->encode(text, true), /*skip_special=*/true),
              tok->decode(tok->encode(text), /*skip_special=*/true));
  }
}

}  // namespace

TEST(TokenizerReference, Qwen3IdsMatchHuggingFace) { check_reference_ids("qwen3"); }
TEST(TokenizerReference, DeepSeekV3IdsMatchHuggingFace) { check_reference_ids("deepseek_v3"); }
TEST(TokenizerReference, Qwen3RoundTrip) { check_round_trip("qwen3"); }
TEST(TokenizerReference, DeepSeekV3RoundTrip) { check_round_trip("deepseek_v3"); }

TEST(TokenizerReference, Qwen3NormalizesToNfc) {
  const moe::Tokenizer* tok = load_tokenizer("qwen3");
  ASSERT_NE(tok, nullptr);
  // "e" + combining acute encodes like the precomposed "é".
  EXPECT_EQ(tok->encode("caf\x65\xCC\x81"), tok->encode("caf\xC3\xA9"));
  EXPECT_EQ(tok->decode(tok->encode("caf\x65\xCC\x81")), "caf\xC3\xA9");
}

TEST(TokenizerReference, SpecialTokensAreSplitOffBeforeNormalization) {
  // Hugging Face tokenizers splits the added tokens with "normalized": false (all of Qwen3's) off
  // the raw text first and normalizes each piece between them on its own. The expected ids below
  // are what that gives, from Qwen3's tokenizer.json: U+0301 is the bytes CC 81, byte-level "Ìģ",
  // merged into token 53839; "é" is 963; U+0338 (CC B8) is "Ì" 136 and "¸" 116, with no merge.
  const moe::Tokenizer* qwen = load_tokenizer("qwen3");
  ASSERT_NE(qwen, nullptr);
  using moe::unicode::nfc;
  // '>' does not compose with U+0301: the text is the same under NFC, and encodes as the token
  // and the lone mark.
  const std::string acute = "<|im_end|>\xCC\x81";
  EXPECT_EQ(nfc(acute), acute);
  EXPECT_EQ(qwen->encode(acute), (std::vector<int32_t>{151645, 53839}));
  EXPECT_EQ(qwen->decode(qwen->encode(acute)), acute);
  // '>' + U+0338 composes to U+226F (not greater-than). NFC of the whole text would turn
  // "<|im_end|>" into "<|im_end|" U+226F; the tokenizer keeps the token and normalizes the mark
  // alone, while still composing "e" U+0301 before it. The text it encodes is therefore neither
  // the input nor its NFC.
  const std::string solidus = "e\xCC\x81<|im_end|>\xCC\xB8";
  EXPECT_EQ(nfc(solidus), "\xC3\xA9<|im_end|\xE2\x89\xAF");
  const auto ids = qwen->encode(solidus);
  EXPECT_EQ(ids, (std::vector<int32_t>{963, 151645, 136, 116}));
  const std::string decoded = qwen->decode(ids);
  EXPECT_EQ(decoded, "\xC3\xA9<|im_end|>\xCC\xB8");
  EXPECT_NE(decoded, solidus);
  EXPECT_NE(decoded, nfc(solidus));
  // Encoding the NFC of the whole text instead would lose the special token.
  const auto whole = qwen->encode(nfc(solidus));
  EXPECT_EQ(std::count(whole.begin(), whole.end(), 151645), 0);
}

TEST(TokenizerReference, KnownIdsAndSpecialTokens) {
  const moe::Tokenizer* qwen = load_tokenizer("qwen3");
  const moe::Tokenizer* ds = load_tokenizer("deepseek_v3");
  ASSERT_NE(qwen, nullptr);
  ASSERT_NE(ds, nullptr);
  EXPECT_EQ(qwen->vocab_size(), 151669);
  EXPECT_EQ(qwen->token_to_id("<|im_end|>"), 151645);
  EXPECT_EQ(qwen->token_to_id("<think>"), 151667);
  EXPECT_EQ(qwen->token_to_id("no such token"), std::nullopt);
  EXPECT_TRUE(qwen->is_special(151645));
  EXPECT_FALSE(qwen->is_special(151667));  // <think> is an added token but not special
  EXPECT_FALSE(qwen->is_special(9707));
  EXPECT_FALSE(qwen->is_special(-1));
  EXPECT_EQ(qwen->id_to_token(9707), "Hello");
  // Added tokens are recognised inside text, special or not.
  EXPECT_EQ(qwen->encode("<think>"), std::vector<int32_t>{151667});
  const auto ids = qwen->encode("a<|im_end|>b");
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids[1], 151645);
  EXPECT_EQ(qwen->decode(ids, /*skip_special=*/true), "ab");
  EXPECT_EQ(qwen->decode(ids), "a<|im_end|>b");
  EXPECT_EQ(ds->vocab_size(), 128815);
  EXPECT_EQ(ds->token_to_id("<\xEF\xBD\x9C"
                            "begin\xE2\x96\x81of\xE2\x96\x81sentence\xEF\xBD\x9C>"),
            0);
  EXPECT_EQ(ds->decode({0}, true), "");
}

TEST(TokenizerReference, InvalidUtf8KeepsItsBytes) {
  const moe::Tokenizer* tok = load_tokenizer("qwen3");
  ASSERT_NE(tok, nullptr);
  const std::string text = "ok \xFF\xFE bad \xE4\xBD tail \xC3";
  const auto ids = tok->encode(text);
  std::string bytes;
  for (int32_t id : ids) bytes += tok->token_bytes(id);
  EXPECT_EQ(bytes, text);
  // decode() repairs the bytes as Python's bytes.decode('utf-8', 'replace') does.
  EXPECT_EQ(tok->decode(ids), "ok \xEF\xBF\xBD\xEF\xBF\xBD bad \xEF\xBF\xBD tail \xEF\xBF\xBD");
}

TEST(TokenizerReference, LongInputIsFastAndRoundTrips) {
  const moe::Tokenizer* tok = load_tokenizer("deepseek_v3");
  ASSERT_NE(tok, nullptr);
  std::string text;
  for (int i = 0; i < 2000; ++i)
    text += "Line " + std::to_string(i) + ": the quick brown fox, 你好世界 😀 \t\n";
  text += std::string(5000, ' ') + "x" + std::string(3000, '!');
  const auto t0 = std::chrono::steady_clock::now();
  const auto ids = tok->encode(text);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ info     ] encoded %zu bytes into %zu ids in %.3f s\n", text.size(), ids.size(),
              s);
  EXPECT_EQ(tok->decode(ids), text);
}

TEST(TokenizerReference, ConcurrentEncodesAgree) {
  // One tokenizer shared by several threads (its word cache is the only mutable state).
  const moe::Tokenizer* tok = load_tokenizer("qwen3");
  const json* refs = load_refs("qwen3");
  ASSERT_NE(tok, nullptr);
  ASSERT_NE(refs, nullptr);
  std::vector<std::thread> threads;
  std::vector<int> mismatches(4, 0);
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 20; ++round)
        for (const json& e : refs->at("entries"))
          if (tok->encode(e.at("text").get<std::string>()) != as_ids(e.at("ids"))) ++mismatches[t];
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
}

TEST(TokenizerStream, EmojiSplitAcrossTokensMatchesDecode) {
  for (const char* name : {"qwen3", "deepseek_v3"}) {
    SCOPED_TRACE(name);
    const moe::Tokenizer* tok = load_tokenizer(name);
    ASSERT_NE(tok, nullptr);
    const std::string text =
        "emoji: \xF0\x9F\x98\x80 \xF0\x9F\x91\x8D\xF0\x9F\x8F\xBD "
        "\xF0\x9F\x91\xA8\xE2\x80\x8D\xF0\x9F\x91\xA9\xE2\x80\x8D\xF0\x9F\x91\xA7 done";
    const auto ids = tok->encode(text);
    // The test only means something if some token holds part of a character.
    bool split = false;
    for (int32_t id : ids) split = split || !moe::unicode::is_valid_utf8(tok->token_bytes(id));
    EXPECT_TRUE(split);
    moe::StreamDecoder stream(*tok);
    std::string streamed;
    for (int32_t id : ids) {
      const std::string piece = stream.push(id);
      EXPECT_TRUE(moe::unicode::is_valid_utf8(piece)) << "piece of id " << id;
      streamed += piece;
    }
    streamed += stream.flush();
    EXPECT_EQ(streamed, tok->decode(ids));
    EXPECT_EQ(streamed, text);
  }
}

TEST(TokenizerStream, HoldsBackThenFlushesIncompleteBytes) {
  const moe::Tokenizer* tok = load_tokenizer("qwen3");
  ASSERT_NE(tok, nullptr);
  // Find the byte-level tokens for the bytes of U+1F600 (F0 9F 98 80).
  const auto& b2c = moe::unicode::byte_to_char();
  std::vector<int32_t> ids;
  for (unsigned char b : {0xF0, 0x9F, 0x98, 0x80}) {
    std::string token;
    moe::unicode::utf8_append(token, b2c[b]);
    auto id = tok->token_to_id(token);
    ASSERT_TRUE(id.has_value());
    ids.push_back(*id);
  }
  moe::StreamDecoder stream(*tok);
  EXPECT_EQ(stream.push(ids[0]), "");
  EXPECT_EQ(stream.push(ids[1]), "");
  EXPECT_EQ(stream.push(ids[2]), "");
  EXPECT_EQ(stream.push(ids[3]), "\xF0\x9F\x98\x80");
  // An incomplete sequence at the end is flushed as U+FFFD, as decode() gives.
  EXPECT_EQ(stream.push(ids[0]), "");
  EXPECT_EQ(stream.push(ids[1]), "");
  EXPECT_EQ(stream.flush(), "\xEF\xBF\xBD");
  EXPECT_EQ(tok->decode({ids[0], ids[1]}), "\xEF\xBF\xBD");
  // An incomplete sequence followed by a character that cannot continue it.
  const auto a = tok->token_to_id("a");
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(stream.push(ids[0]), "");
  EXPECT_EQ(stream.push(*a),
            "\xEF\xBF\xBD"
            "a");
  // skip_special drops special tokens.
  moe::StreamDecoder skipping(*tok, /*skip_special=*/true);
  EXPECT_EQ(skipping.push(151645), "");
  EXPECT_EQ(skipping.push(*a), "a");
  EXPECT_THROW(skipping.push(tok->vocab_size()), moe::Error);
}

TEST(TokenizerErrors, MissingFileIsIoError) {
  std::string msg;
  EXPECT_EQ(error_kind_of([] { moe::Tokenizer::from_file("/nonexistent/tokenizer.json"); }, &msg),
            moe::ErrorKind::kIo);
  EXPECT_NE(msg.find("/nonexistent/tokenizer.json"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos);
  EXPECT_EQ(error_kind_of([] { moe::Tokenizer::from_file(MOE_SOURCE_DIR); }), moe::ErrorKind::kIo);
}

TEST(TokenizerErrors, MalformedJsonIsFormatError) {
  const std::string path =
      temp_file("malformed.json", "{\"model\": {\"type\": \"BPE\",\n \"vocab\": [");
  std::string msg;
  EXPECT_EQ(error_kind_of([&] { moe::Tokenizer::from_file(path); }, &msg), moe::ErrorKind::kFormat);
  EXPECT_NE(msg.find("malformed.json"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  EXPECT_EQ(error_kind_of([] { moe::Tokenizer::from_json_text("[1, 2]", "t"); }),
            moe::ErrorKind::kFormat);
  // A merge that uses a token outside the vocabulary.
  EXPECT_EQ(error_kind_of([] {
              moe::Tokenizer::from_json_text(
                  R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a q"]},
                      "pre_tokenizer": {"type": "ByteLevel"}, "decoder": {"type": "ByteLevel"}})",
                  "t");
            }),
            moe::ErrorKind::kFormat);
}

namespace {

// The kind of the error that loading the tokenizer.json `text` gives, and its message.
moe::ErrorKind json_error(const std::string& text, const std::string& origin, std::string* msg) {
  return error_kind_of([&] { moe::Tokenizer::from_json_text(text, origin); }, msg);
}

}  // namespace

TEST(TokenizerErrors, UnsupportedTypesAreNamed) {
  std::string msg;
  EXPECT_EQ(json_error(R"({"model": {"type": "WordPiece", "vocab": {"a": 0}}})", "wp.json", &msg),
            moe::ErrorKind::kUnsupported);
  EXPECT_NE(msg.find("WordPiece"), std::string::npos) << msg;
  EXPECT_EQ(json_error(R"({"model": {"type": "Unigram", "vocab": [["a", 0.0]]}})", "u.json", &msg),
            moe::ErrorKind::kUnsupported);
  EXPECT_NE(msg.find("Unigram"), std::string::npos) << msg;
  EXPECT_EQ(json_error(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                          "pre_tokenizer": {"type": "Metaspace"}, "decoder": {"type": "ByteLevel"}})",
                       "m.json", &msg),
            moe::ErrorKind::kUnsupported);
  EXPECT_NE(msg.find("Metaspace"), std::string::npos) << msg;
  EXPECT_EQ(json_error(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": []},
                          "normalizer": {"type": "Lowercase"},
                          "pre_tokenizer": {"type": "ByteLevel"}, "decoder": {"type": "ByteLevel"}})",
                       "n.json", &msg),
            moe::ErrorKind::kUnsupported);
  EXPECT_NE(msg.find("Lowercase"), std::string::npos) << msg;
}

TEST(TokenizerErrors, DecodeOutOfVocabularyIsInvalidArgument) {
  const moe::Tokenizer* tok = load_tokenizer("qwen3");
  ASSERT_NE(tok, nullptr);
  std::string msg;
  EXPECT_EQ(error_kind_of(
                [&] {
                  tok->decode({9707, tok->vocab_size()});
                },
                &msg),
            moe::ErrorKind::kInvalidArgument);
  EXPECT_NE(msg.find(std::to_string(tok->vocab_size())), std::string::npos) << msg;
  EXPECT_EQ(error_kind_of([&] { tok->decode({-3}); }, &msg), moe::ErrorKind::kInvalidArgument);
  EXPECT_NE(msg.find("-3"), std::string::npos) << msg;
  EXPECT_EQ(error_kind_of([&] { tok->decode({1 << 30}); }), moe::ErrorKind::kInvalidArgument);
}

// ---------------------------------------------------------------------------------------------
// Hand-made tokenizers: the expected ids follow from the BPE and added-token rules.

namespace {

// A byte-level BPE over the letters a-e plus the given merges (ids: a=0 .. e=4, space "Ġ"=5,
// then the merged tokens in the order given, then the added tokens).
moe::Tokenizer tiny(const std::vector<std::string>& merges, const std::string& extra = "",
                    const std::string& added = "[]") {
  json vocab = json::object();
  int id = 0;
  for (const char* t : {"a", "b", "c", "d", "e", "\xC4\xA0"}) vocab[t] = id++;
  json merge_list = json::array();
  for (const auto& m : merges) {
    const auto sp = m.find(' ');
    const std::string joined = m.substr(0, sp) + m.substr(sp + 1);
    if (!vocab.contains(joined)) vocab[joined] = id++;
    merge_list.push_back(m);
  }
  std::string text = R"({"added_tokens": )" + added + R"(, "model": {"type": "BPE", "vocab": )" +
                     vocab.dump() + R"(, "merges": )" + merge_list.dump() + R"(},
      "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
          {"type": "Split", "pattern": {"Regex": " ?[a-z]+|\\s+"}, "behavior": "Isolated"},
          {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]},
      "decoder": {"type": "ByteLevel"})" +
                     extra + "}";
  return moe::Tokenizer::from_json_text(text, "tiny.json");
}

}  // namespace

TEST(TokenizerBpe, LowestRankMergesFirst) {
  // The merges create "bc"=6, "ab"=7, "abc"=8 in this order.
  auto tok = tiny({"b c", "a b", "a bc"});
  // "abc": rank 0 merges b+c first, then a+bc; a left-to-right merger would make ab + c.
  EXPECT_EQ(tok.encode("abc"), (std::vector<int32_t>{8}));
  auto tok2 = tiny({"a b", "b c", "ab c"});  // ab=6, bc=7, abc=8
  EXPECT_EQ(tok2.encode("abc"), (std::vector<int32_t>{8}));
  EXPECT_EQ(tok2.encode("bc"), (std::vector<int32_t>{7}));
  // Equal pairs merge leftmost first: "aaa" with a+a -> [aa, a].
  auto tok3 = tiny({"a a"});  // aa=6
  EXPECT_EQ(tok3.encode("aaa"), (std::vector<int32_t>{6, 0}));
  EXPECT_EQ(tok3.encode("aaaa"), (std::vector<int32_t>{6, 6}));
  // Pre-tokens do not merge across their boundary: " a" is Ġ + a.
  EXPECT_EQ(tok3.encode("aa aa"), (std::vector<int32_t>{6, 5, 6}));
  // Merges given as pairs work like "a b" strings.
  auto pairs = moe::Tokenizer::from_json_text(
      R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": [["a", "b"]]},
          "pre_tokenizer": {"type": "ByteLevel", "use_regex": false, "add_prefix_space": false},
          "decoder": {"type": "ByteLevel"}})",
      "pairs.json");
  EXPECT_EQ(pairs.encode("abab"), (std::vector<int32_t>{2, 2}));
}

TEST(TokenizerBpe, IgnoreMergesTakesWholeWords) {
  // With ignore_merges a word in the vocabulary is one token even if no merge path reaches it.
  json vocab = {{"a", 0}, {"b", 1}, {"c", 2}, {"ab", 3}, {"abc", 4}};
  for (bool ignore : {false, true}) {
    const std::string text = R"({"model": {"type": "BPE", "ignore_merges": )" +
                             std::string(ignore ? "true" : "false") + R"(, "vocab": )" +
                             vocab.dump() + R"(, "merges": ["a b"]},
        "pre_tokenizer": {"type": "ByteLevel", "use_regex": false, "add_prefix_space": false},
        "decoder": {"type": "ByteLevel"}})";
    auto tok = moe::Tokenizer::from_json_text(text, "im.json");
    const std::vector<int32_t> expected =
        ignore ? std::vector<int32_t>{4} : std::vector<int32_t>{3, 2};
    EXPECT_EQ(tok.encode("abc"), expected);
  }
}

TEST(TokenizerBpe, PostProcessorTemplateAddsBosAndEos) {
  auto tok = tiny({"a b"},
                  R"(, "post_processor": {"type": "TemplateProcessing",
                      "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                 {"Sequence": {"id": "A", "type_id": 0}},
                                 {"SpecialToken": {"id": "</s>", "type_id": 0}}],
                      "special_tokens": {"<s>": {"id": "<s>", "ids": [100], "tokens": ["<s>"]},
                                         "</s>": {"id": "</s>", "ids": [101], "tokens": ["</s>"]}}})",
                  R"([{"id": 100, "content": "<s>", "special": true, "normalized": false},
                      {"id": 101, "content": "</s>", "special": true, "normalized": false}])");
  EXPECT_EQ(tok.encode("ab"), (std::vector<int32_t>{6}));
  EXPECT_EQ(tok.encode("ab", true), (std::vector<int32_t>{100, 6, 101}));
  EXPECT_EQ(tok.vocab_size(), 102);
  EXPECT_EQ(tok.decode({100, 6, 101}), "<s>ab</s>");
  EXPECT_EQ(tok.decode({100, 6, 101}, true), "ab");
  // ids 8..99 are holes: not in the vocabulary.
  EXPECT_THROW(tok.decode({50}), moe::Error);
}

TEST(TokenizerBpe, AddedTokensLongestMatchAndStrip) {
  auto tok = tiny({}, "",
                  R"([{"id": 10, "content": "<x>", "special": true, "normalized": false},
                      {"id": 11, "content": "<x><y>", "special": true, "normalized": false},
                      {"id": 12, "content": "[L]", "special": false, "lstrip": true, "normalized": false},
                      {"id": 13, "content": "[R]", "special": false, "rstrip": true, "normalized": false}])");
  // Longest match at the leftmost position wins.
  EXPECT_EQ(tok.encode("<x><y>"), (std::vector<int32_t>{11}));
  EXPECT_EQ(tok.encode("<x>a"), (std::vector<int32_t>{10, 0}));
  // lstrip swallows the spaces before the token, rstrip those after it.
  EXPECT_EQ(tok.encode("a  [L]b"), (std::vector<int32_t>{0, 12, 1}));
  EXPECT_EQ(tok.encode("a[R]  b"), (std::vector<int32_t>{0, 13, 1}));
  EXPECT_EQ(tok.encode("a [R] b"), (std::vector<int32_t>{0, 5, 13, 1}));
}

TEST(TokenizerUnicode, NfcMatchesUnicodeData) {
  using moe::unicode::nfc;
  // Expected values from Python's unicodedata.normalize('NFC', ...).
  EXPECT_EQ(nfc("e\xCC\x81"), "\xC3\xA9");                                 // e + U+0301 -> é
  EXPECT_EQ(nfc("a\xCC\x81\xCC\x96"), "\xC3\xA1\xCC\x96");                 // reorder, then compose
  EXPECT_EQ(nfc("\xE1\x84\x80\xE1\x85\xA1"), "\xEA\xB0\x80");              // Hangul L+V
  EXPECT_EQ(nfc("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8"), "\xEA\xB0\x81");  // L+V+T
  EXPECT_EQ(nfc("\xE2\x84\xAB"), "\xC3\x85");                              // Angstrom sign -> Å
  EXPECT_EQ(nfc("\xE0\xA5\x98"), "\xE0\xA4\x95\xE0\xA4\xBC");      // exclusion stays decomposed
  EXPECT_EQ(nfc("\xCD\x84"), "\xCC\x88\xCC\x81");                  // non-starter decomposition
  EXPECT_EQ(nfc("e\xCC\xA3\xCC\x82"), "\xE1\xBB\x87");             // ệ
  EXPECT_EQ(nfc("\xE1\xB8\x8B\xCC\xA3"), "\xE1\xB8\x8D\xCC\x87");  // ḋ + dot below -> ḍ + dot above
  EXPECT_EQ(nfc("plain ascii"), "plain ascii");
  EXPECT_EQ(nfc("\xCC\x81 leading mark"), "\xCC\x81 leading mark");
  EXPECT_EQ(nfc("bad \xFF e\xCC\x81"), "bad \xFF \xC3\xA9");  // invalid bytes pass through
}

TEST(TokenizerUnicode, NfcShrinksTextByLessThanTheBound) {
  using moe::unicode::kNfcMaxShrink;
  using moe::unicode::nfc;
  // The most NFC shrinks text (Python's unicodedata): U+1FBE (3 bytes, a singleton that
  // decomposes to U+03B9) U+0308 U+0301 compose to U+0390, 7 bytes to 2.
  const std::string worst = "\xE1\xBE\xBE\xCC\x88\xCC\x81";
  EXPECT_EQ(nfc(worst), "\xCE\x90");
  EXPECT_LE(worst.size(), kNfcMaxShrink * nfc(worst).size());
  // Hangul L + V + T (9 bytes) compose to one syllable (3 bytes).
  EXPECT_LE(9u, kNfcMaxShrink * nfc("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8").size());
  // Every code point on its own (U+1FEF, 3 bytes, becomes '`', 1 byte).
  size_t most = 0;
  for (char32_t cp = 1; cp < 0x110000; ++cp) {
    if (cp >= 0xD800 && cp < 0xE000) continue;
    std::string s;
    moe::unicode::utf8_append(s, cp);
    const std::string n = nfc(s);
    ASSERT_FALSE(n.empty());
    EXPECT_LE(s.size(), kNfcMaxShrink * n.size()) << "U+" << std::hex << uint32_t(cp);
    most = std::max(most, s.size() / n.size());
  }
  EXPECT_EQ(most, 3u);
}

TEST(TokenizerUnicode, LossyMatchesPython) {
  using moe::unicode::utf8_lossy;
  const std::string r = "\xEF\xBF\xBD";
  // Expected values from Python's bytes.decode('utf-8', 'replace').
  EXPECT_EQ(utf8_lossy("\xE4\xBD"), r);
  EXPECT_EQ(utf8_lossy("\xFF\xFE"), r + r);
  EXPECT_EQ(utf8_lossy("\xED\xA0\x80"), r + r + r);
  EXPECT_EQ(utf8_lossy("\xF0\x9F\x98"), r);
  EXPECT_EQ(utf8_lossy("a\xC3"), "a" + r);
  EXPECT_EQ(utf8_lossy("\xE0\x80\x80"), r + r + r);
  EXPECT_EQ(utf8_lossy("\xF4\x90\x80\x80"), r + r + r + r);
  EXPECT_EQ(utf8_lossy("\xC0\xAF"), r + r);
  EXPECT_EQ(moe::unicode::utf8_incomplete_tail("ab\xF0\x9F\x98"), 3u);
  EXPECT_EQ(moe::unicode::utf8_incomplete_tail("ab\xE0\x80"), 0u);  // can never complete
  EXPECT_EQ(moe::unicode::utf8_incomplete_tail("ab\xF0\x9F\x98\x80"), 0u);
}
