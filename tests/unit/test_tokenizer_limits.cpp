// Hostile tokenizer.json files (ids, duplicates and sparse ids that would size tables by a number
// in the file) and the token limit of encode(): early refusal of text that cannot fit, and ids
// identical to plain encode() up to the limit.
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/tokenizer.h"
#include "text/unicode_util.h"
#include "moe/errors.h"
#include "test_util.h"

namespace moe {
namespace {

using json = nlohmann::json;

// A byte-level BPE tokenizer.json with the given vocabulary, added tokens and extra members.
std::string tokenizer_json(const json& vocab, const json& added = json::array(),
                           const json& extra = json::object()) {
  json j = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", json::array()}}},
            {"added_tokens", added},
            {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false},
                               {"use_regex", false}}},
            {"decoder", {{"type", "ByteLevel"}}}};
  j.update(extra);
  return j.dump();
}

json added_token(int64_t id, const std::string& content) {
  return {{"id", id}, {"content", content}, {"special", true}, {"normalized", false}};
}

// The kFormat error from loading `text` as tokenizer.json; checks that it is one line naming the
// file and every string in `names`.
void expect_format_error(const std::string& text, const std::vector<std::string>& names) {
  const Error e = test::expect_error([&] { Tokenizer::from_json_text(text, "tokenizer.json"); });
  EXPECT_EQ(e.kind(), ErrorKind::kFormat) << e.what();
  EXPECT_EQ(e.message().rfind("tokenizer.json: ", 0), 0u) << e.what();
  for (const auto& name : names) EXPECT_NE(e.message().find(name), std::string::npos) << e.what();
  EXPECT_EQ(e.message().find('\n'), std::string::npos) << e.what();
}

const json kSmallVocab = {{"a", 0}, {"b", 1}, {"c", 2}};

TEST(TokenizerLimits, IdPastTheLargestSupportedIdIsRefused) {
  // Accepted, each of these would size the id tables (about 70 bytes an id) to 20 GB.
  const json added = {added_token(3, "<a>"), added_token(4, "<b>"), added_token(5, "<c>"),
                      added_token(300000000, "<big>")};
  expect_format_error(tokenizer_json(kSmallVocab, added),
                      {"added_tokens[3].id 300000000", "largest supported id 16777215"});
  expect_format_error(tokenizer_json({{"a", 0}, {"b", 300000000}}),
                      {"model.vocab['b'] id 300000000", "largest supported id 16777215"});
  // Through a file, the message names the file.
  const std::string path =
      test::temp_file("huge-id-tokenizer.json", tokenizer_json(kSmallVocab, added));
  const Error e = test::expect_error([&] { Tokenizer::from_file(path); });
  EXPECT_EQ(e.kind(), ErrorKind::kFormat);
  EXPECT_NE(e.message().find(path + ": added_tokens[3].id 300000000"), std::string::npos)
      << e.what();
  // Ids that do not fit an int32 are not wrapped into range.
  expect_format_error(
      tokenizer_json(kSmallVocab, json::array({added_token(4294967296 + 3, "<x>")})),
      {"added_tokens[0].id 4294967299"});
}

TEST(TokenizerLimits, NegativeAndNonIntegerIdsAreRefused) {
  expect_format_error(tokenizer_json(kSmallVocab, json::array({added_token(-1, "<x>")})),
                      {"added_tokens[0].id", "negative"});
  json fractional = added_token(0, "<x>");
  fractional["id"] = 1.5;
  expect_format_error(tokenizer_json(kSmallVocab, json::array({fractional})),
                      {"added_tokens[0].id", "not an integer"});
  json text_id = added_token(0, "<x>");
  text_id["id"] = "7";
  expect_format_error(tokenizer_json(kSmallVocab, json::array({text_id})), {"added_tokens[0].id"});
  expect_format_error(tokenizer_json({{"a", -1}}), {"model.vocab['a']", "negative"});
  expect_format_error(tokenizer_json({{"a", 2.5}}), {"model.vocab['a']", "not an integer"});
}

TEST(TokenizerLimits, SparseIdsAreRefused) {
  // 3 vocabulary entries and 1 added token: ids up to 2 * 4 + kIdSlack - 1 are allowed.
  const int64_t largest = 2 * 4 + Tokenizer::kIdSlack - 1;
  const Tokenizer ok = Tokenizer::from_json_text(
      tokenizer_json(kSmallVocab, json::array({added_token(largest, "<x>")})), "t");
  EXPECT_EQ(ok.vocab_size(), largest + 1);
  EXPECT_EQ(ok.encode("<x>a"), (std::vector<int32_t>{static_cast<int32_t>(largest), 0}));
  expect_format_error(tokenizer_json(kSmallVocab, json::array({added_token(largest + 1, "<x>")})),
                      {"added_tokens[0].id " + std::to_string(largest + 1), "leaves most ids"});
  // A sparse vocabulary id, well below the largest supported id.
  expect_format_error(tokenizer_json({{"a", 0}, {"b", 5000000}}),
                      {"model.vocab['b'] id 5000000", "leaves most ids"});
}

TEST(TokenizerLimits, DuplicateIdsAreRefused) {
  expect_format_error(tokenizer_json({{"a", 0}, {"b", 1}, {"c", 1}}),
                      {"model.vocab['b']", "model.vocab['c']", "both have id 1"});
  expect_format_error(
      tokenizer_json(kSmallVocab, json::array({added_token(5, "<x>"), added_token(5, "<y>")})),
      {"added_tokens[0]", "added_tokens[1]", "both have id 5"});
  // An added token may take over a vocabulary id, as in Hugging Face tokenizers.
  const Tokenizer t = Tokenizer::from_json_text(
      tokenizer_json(kSmallVocab, json::array({added_token(1, "<x>")})), "t");
  EXPECT_EQ(t.encode("a<x>"), (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(t.id_to_token(1), "<x>");
}

TEST(TokenizerLimits, PostProcessorIdsMustBeTokens) {
  const json template_processing = {
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single", {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
                    {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {999}}, {"tokens", {"<s>"}}}}}}}}};
  expect_format_error(tokenizer_json(kSmallVocab, json::array(), template_processing),
                      {"post_processor", "999"});
  const json bert = {{"post_processor",
                      {{"type", "BertProcessing"},
                       {"cls", {"[CLS]", 3000000000}},
                       {"sep", {"[SEP]", 1}}}}};
  expect_format_error(tokenizer_json(kSmallVocab, json::array(), bert),
                      {"post_processor.cls[1] 3000000000"});
}

// ---------------------------------------------------------------------------------------------
// The token limit.

const Tokenizer& real_tokenizer(const std::string& name) {
  static std::map<std::string, std::unique_ptr<Tokenizer>> cache;
  auto& slot = cache[name];
  if (!slot)
    slot = std::make_unique<Tokenizer>(Tokenizer::from_file(
        std::string(MOE_SOURCE_DIR) + "/.cache/tokenizers/" + name + "/tokenizer.json"));
  return *slot;
}

// Texts to encode: the reference entries and a long mixed text.
std::vector<std::string> sample_texts(const std::string& name) {
  std::vector<std::string> texts;
  const std::string refs =
      test::read_file(std::string(MOE_SOURCE_DIR) + "/tests/data/tokenizer_ids_" + name + ".json");
  const json parsed = json::parse(refs);
  for (const json& e : parsed.at("entries")) texts.push_back(e.at("text").get<std::string>());
  std::string mixed;
  for (int i = 0; i < 300; ++i)
    mixed += "Line " + std::to_string(i) +
             ": the quick brown fox, \xE4\xBD\xA0\xE5\xA5\xBD e\xCC\x81 <|im_end|> \t\n";
  texts.push_back(mixed);
  return texts;
}

TEST(TokenizerTokenLimit, SameIdsUpToTheLimitAndRefusedOneBelow) {
  for (const std::string name : {"qwen3", "deepseek_v3"}) {
    const Tokenizer& tok = real_tokenizer(name);
    const auto texts = sample_texts(name);
    ASSERT_GE(texts.size(), 30u);
    for (const auto& text : texts) {
      for (bool add_special : {false, true}) {
        SCOPED_TRACE(name + (add_special ? " with specials: " : ": ") + text.substr(0, 60));
        const auto ids = tok.encode(text, add_special);
        EXPECT_EQ(tok.encode(text, add_special, ids.size()), ids);
        EXPECT_EQ(tok.encode(text, add_special, ids.size() + 1000), ids);
        if (ids.empty()) continue;
        const Error e = test::expect_error([&] { tok.encode(text, add_special, ids.size() - 1); });
        EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
        EXPECT_NE(e.message().find("more than " + std::to_string(ids.size() - 1) + " tokens"),
                  std::string::npos)
            << e.what();
      }
    }
  }
}

TEST(TokenizerTokenLimit, HugeOneWordTextIsRefusedWithoutEncoding) {
  const std::string text(100'000'000, 'a');
  for (const std::string name : {"qwen3", "deepseek_v3"}) {
    const Tokenizer& tok = real_tokenizer(name);
    const auto t0 = std::chrono::steady_clock::now();
    const Error e = test::expect_error([&] { tok.encode(text, true, 40960); });
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    std::printf("[ info     ] %s: refused 100 MB at 40960 tokens in %.3f ms\n", name.c_str(), ms);
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find("more than 40960 tokens"), std::string::npos) << e.what();
    // Refused by its length alone: the message gives the byte count that proves it.
    EXPECT_NE(e.message().find("100000000 bytes"), std::string::npos) << e.what();
  }
}

TEST(TokenizerTokenLimit, CountedWhileEncoding) {
  // Short enough not to be refused by its length, but of many more tokens than the limit.
  std::string text;
  for (int i = 0; i < 20000; ++i) {
    text += 'w';
    text += static_cast<char>('0' + i % 10);
    text += ' ';
  }
  const Tokenizer& tok = real_tokenizer("qwen3");
  ASSERT_LE(text.size(), 1000 * tok.max_bytes_per_token());
  ASSERT_GT(tok.encode(text).size(), 1000u);
  const Error e = test::expect_error([&] { tok.encode(text, false, 1000); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(e.message().find("the text encodes to more than 1000 tokens"), std::string::npos)
      << e.what();
  EXPECT_EQ(e.message().find("bytes"), std::string::npos) << e.what();
}

TEST(TokenizerTokenLimit, LongWordOfAnUnboundedTokenizerIsRefused) {
  // Every byte has its token (id = the byte), "aa" is 256. A token that strips the spaces before
  // it ([L], 257) can stand for any number of bytes, so the text's length bounds nothing; the
  // limit still holds, checked on each word before it is merged.
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) {
    std::string ch;
    unicode::utf8_append(ch, unicode::byte_to_char()[b]);
    vocab[ch] = b;
  }
  vocab["aa"] = 256;
  const json added = {{{"id", 257}, {"content", "[L]"}, {"lstrip", true}, {"normalized", false}}};
  const json model = {{"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", {"a a"}}}}};
  const Tokenizer tok = Tokenizer::from_json_text(tokenizer_json({}, added, model), "t");
  EXPECT_EQ(tok.max_bytes_per_token(), 0u);
  EXPECT_EQ(tok.encode("      [L]aaa"), (std::vector<int32_t>{257, 256, 'a'}));
  const std::string word(200000, 'a');
  EXPECT_EQ(tok.encode(word).size(), 100000u);
  const Error e = test::expect_error([&] { tok.encode(word, false, 100); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(e.message().find("more than 100 tokens"), std::string::npos) << e.what();
  EXPECT_EQ(tok.encode(word, false, 100000).size(), 100000u);
}

TEST(TokenizerTokenLimit, MaxBytesPerTokenBoundsEveryText) {
  for (const std::string name : {"qwen3", "deepseek_v3"}) {
    SCOPED_TRACE(name);
    const Tokenizer& tok = real_tokenizer(name);
    size_t longest = 0;
    for (int32_t id = 0; id < tok.vocab_size(); ++id) {
      try {
        longest = std::max(longest, tok.token_bytes(id).size());
      } catch (const Error&) {  // an unused id
      }
    }
    EXPECT_GE(longest, 16u);
    // Qwen3 normalizes with NFC, which may shrink the text; DeepSeek-V3 does not normalize.
    EXPECT_EQ(tok.max_bytes_per_token(),
              longest * (name == "qwen3" ? unicode::kNfcMaxShrink : size_t(1)));
    for (const auto& text : sample_texts(name))
      EXPECT_LE(text.size(), tok.encode(text).size() * tok.max_bytes_per_token());
  }
}

}  // namespace
}  // namespace moe
