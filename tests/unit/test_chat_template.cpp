// Chat template tests: renders of the real Qwen3 (and DeepSeek-V3) templates against
// transformers' apply_chat_template output (tests/data/tokenizer_ids_*.json), the Qwen3 template's
// rules for thinking content, Jinja semantics against outputs of the jinja2 package configured as
// transformers does (trim_blocks, lstrip_blocks, loopcontrols, its tojson), and errors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "test_util.h"
#include "text/chat_template.h"
#include "moe/errors.h"

namespace {

using json = nlohmann::json;
using ojson = nlohmann::ordered_json;

std::string source_path(const std::string& rel) { return std::string(MOE_SOURCE_DIR) + "/" + rel; }

std::string config_path(const std::string& name) {
  return source_path(".cache/tokenizers/" + name + "/tokenizer_config.json");
}

bool require_config(const std::string& name) {
  if (std::filesystem::exists(config_path(name))) return true;
  ADD_FAILURE() << config_path(name) << " is missing: run scripts/fetch_tokenizers.sh";
  return false;
}

using moe::test::error_kind_of;
using moe::test::temp_file;

void check_reference_chats(const std::string& name, bool required) {
  if (!require_config(name)) return;
  const std::string ref_path = source_path("tests/data/tokenizer_ids_" + name + ".json");
  std::ifstream in(ref_path);
  ASSERT_TRUE(in) << ref_path << " is missing: run scripts/make_tokenizer_refs.py";
  const json refs = json::parse(in);
  if (!refs.contains("chat")) {
    ASSERT_FALSE(required) << ref_path << " has no chat renders: "
                           << refs.value("chat_error", std::string("(no chat_error recorded)"));
    return;
  }
  const auto tmpl = moe::ChatTemplate::from_tokenizer_config(config_path(name));
  ASSERT_GE(refs.at("chat").size(), 6u);
  for (const json& c : refs.at("chat")) {
    std::vector<moe::ChatMessage> messages;
    for (const json& m : c.at("messages"))
      messages.push_back({m.at("role").get<std::string>(), m.at("content").get<std::string>()});
    const bool gen = c.at("add_generation_prompt").get<bool>();
    SCOPED_TRACE(c.at("messages").dump() + (gen ? " +generation prompt" : ""));
    EXPECT_EQ(tmpl.render(messages, gen), c.at("text").get<std::string>());
  }
}

// Renders `source` with the given variables (a JSON object) besides messages.
std::string render(const std::string& source, const ojson& vars = ojson::object(),
                   const ojson& messages = ojson::array()) {
  return moe::ChatTemplate::from_source(source, "test").render_json(messages, false, vars);
}

}  // namespace

TEST(ChatTemplateReference, Qwen3MatchesTransformers) { check_reference_chats("qwen3", true); }
TEST(ChatTemplateReference, DeepSeekV3MatchesTransformers) {
  check_reference_chats("deepseek_v3", false);
}

TEST(ChatTemplateQwen3, GenerationPromptAndThinkingSwitch) {
  if (!require_config("qwen3")) return;
  const auto t = moe::ChatTemplate::from_tokenizer_config(config_path("qwen3"));
  EXPECT_EQ(t.eos_token(), "<|im_end|>");
  EXPECT_EQ(t.bos_token(), "");
  const std::vector<moe::ChatMessage> hi = {{"user", "Hi"}};
  EXPECT_EQ(t.render(hi, true), "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(t.render(hi, true, /*enable_thinking=*/true),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(t.render(hi, true, /*enable_thinking=*/false),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n");
}

TEST(ChatTemplateQwen3, ThinkingKeptOnlyAfterTheLastUserTurn) {
  if (!require_config("qwen3")) return;
  const auto t = moe::ChatTemplate::from_tokenizer_config(config_path("qwen3"));
  // The final assistant turn (after the last user message) keeps its reasoning, normalized to
  // "<think>\n...\n</think>\n\n".
  EXPECT_EQ(t.render({{"user", "Q"}, {"assistant", "<think>\nplan\n</think>\n\nA"}}, false),
            "<|im_start|>user\nQ<|im_end|>\n"
            "<|im_start|>assistant\n<think>\nplan\n</think>\n\nA<|im_end|>\n");
  // Earlier assistant turns lose it.
  EXPECT_EQ(t.render({{"user", "Q"}, {"assistant", "<think>\nplan\n</think>\n\nA"}, {"user", "Q2"}},
                     true),
            "<|im_start|>user\nQ<|im_end|>\n<|im_start|>assistant\nA<|im_end|>\n"
            "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n");
  // A system message only counts as the system prompt when it comes first.
  EXPECT_EQ(t.render({{"system", "S"}, {"user", "U"}, {"system", "S2"}}, false),
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n"
            "<|im_start|>system\nS2<|im_end|>\n");
}

TEST(ChatTemplateQwen3, ToolsAndToolCallsThroughJson) {
  if (!require_config("qwen3")) return;
  const auto t = moe::ChatTemplate::from_tokenizer_config(config_path("qwen3"));
  const ojson tools = ojson::parse(R"([{"type": "function", "function": {"name": "f",
      "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}])");
  const ojson messages = ojson::parse(R"([
      {"role": "user", "content": "call f"},
      {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": {"x": 1}}}]},
      {"role": "tool", "content": "2"}])");
  const std::string out = t.render_json(messages, true, {{"tools", tools}});
  // Expected text as rendered by jinja2 with transformers' settings.
  EXPECT_EQ(
      out,
      "<|im_start|>system\n# Tools\n\nYou may call one or more functions to assist with the "
      "user query.\n\nYou are provided with function signatures within <tools></tools> XML "
      "tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"f\", "
      "\"parameters\": {\"type\": \"object\", \"properties\": {\"x\": {\"type\": "
      "\"integer\"}}}}}\n</tools>\n\nFor each function call, return a json object with "
      "function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
      "{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n"
      "<|im_start|>user\ncall f<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": "
      "\"f\", \"arguments\": {\"x\": 1}}\n</tool_call><|im_end|>\n<|im_start|>user\n"
      "<tool_response>\n2\n</tool_response><|im_end|>\n<|im_start|>assistant\n");
}

// Expected outputs below were produced by jinja2 3.1 with transformers' environment settings.
TEST(ChatTemplateJinja, WhitespaceControl) {
  EXPECT_EQ(render("{% if true %}\n  yes\n{% endif %}\n"), "  yes\n");
  EXPECT_EQ(render("a\n  {% if x %}\n  b\n  {% endif %}\nc", {{"x", true}}), "a\n  b\nc");
  EXPECT_EQ(render("  {# comment #}\nx {{- \"  y  \" -}}   z\n  {%- if true %} w{% endif %}"),
            "x  y  z w");
}

TEST(ChatTemplateJinja, LoopsNamespacesAndControl) {
  const ojson msgs = ojson::parse(R"([{"role": "a"}, {"role": "b"}, {"role": "c"}])");
  EXPECT_EQ(
      render("{%- for m in messages -%}\n  [{{ loop.index0 }}/{{ loop.length }}{% if loop.first "
             "%}F{% endif %}{% if loop.last %}L{% endif %}:{{ m.role }}]\n{%- endfor %}",
             ojson::object(), msgs),
      "[0/3F:a][1/3:b][2/3L:c]");
  EXPECT_EQ(render("{% set ns = namespace(n=0) %}{% for i in range(5) %}{% if i == 3 %}{% break %}"
                   "{% endif %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}"),
            "3");
}

TEST(ChatTemplateJinja, ExpressionsFiltersAndMethods) {
  EXPECT_EQ(render("{{ x | tojson }}",
                   {{"x", ojson::parse(R"({"b": [1, 2.5, null, true], "a": "é\"\n"})")}}),
            "{\"b\": [1, 2.5, null, true], \"a\": \"é\\\"\\n\"}");
  EXPECT_EQ(
      render("{{ x | tojson(indent=2) }}", {{"x", ojson::parse(R"({"b": [1, {}], "a": []})")}}),
      "{\n  \"b\": [\n    1,\n    {}\n  ],\n  \"a\": []\n}");
  EXPECT_EQ(
      render("{{ \"a,b,,c\".split(\",\") }}|{{ \"  x y  \".strip() }}|{{ \"xxhixx\".strip(\"x\") "
             "}}|{{ s[::-1] }}|{{ s[1:3] }}|{{ s[-1] }}",
             {{"s", "h\xC3\xA9llo"}}),
      "['a', 'b', '', 'c']|x y|hi|oll\xC3\xA9h|\xC3\xA9l|o");
  EXPECT_EQ(render("{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} "
                   "{{ 1 + 2.0 }} {{ \"ab\" ~ 3 }} {{ none }} {{ true }}"),
            "3 -4 1 2 3.5 1024 3.0 ab3 None True");
  EXPECT_EQ(render("{{ x is defined }} {{ y is defined }} {{ x is string }} {{ x is not none }} "
                   "{{ \"b\" in x }} {{ \"z\" not in x }} {{ 1 < 2 < 3 }} {{ [1, 2] }} "
                   "{{ {\"k\": \"v\"} }}",
                   {{"x", "abc"}}),
            "True False True True True True True [1, 2] {'k': 'v'}");
  EXPECT_EQ(
      render("{{ \"yes\" if a else \"no\" }}{{ b or \"dflt\" }}{{ u | default(\"D\") }}"
             "{{ items | length }}{{ items | join(\"-\") }}{{ items | first }}{{ items | last }}",
             {{"a", 0}, {"b", ""}, {"items", {"p", "q", "r"}}}),
      "nodfltD3p-q-rpr");
}

TEST(ChatTemplateErrors, MissingFileIsIoError) {
  EXPECT_EQ(error_kind_of([] { moe::ChatTemplate::from_tokenizer_config("/nonexistent/tc.json"); }),
            moe::ErrorKind::kIo);
}

TEST(ChatTemplateErrors, MalformedJsonIsFormatError) {
  const std::string path = temp_file("bad_config.json", "{\"chat_template\": ");
  EXPECT_EQ(error_kind_of([&] { moe::ChatTemplate::from_tokenizer_config(path); }),
            moe::ErrorKind::kFormat);
}

TEST(ChatTemplateErrors, MissingTemplateIsConfigError) {
  const std::string path = temp_file("no_template.json", R"({"eos_token": "</s>"})");
  std::string msg;
  EXPECT_EQ(error_kind_of([&] { moe::ChatTemplate::from_tokenizer_config(path); }, &msg),
            moe::ErrorKind::kConfig);
  EXPECT_NE(msg.find("chat_template"), std::string::npos) << msg;
}

TEST(ChatTemplateErrors, UnsupportedTemplateIsUnsupported) {
  std::string msg;
  const std::string path = temp_file(
      "macro_template.json",
      R"({"chat_template": "{% macro m(x) %}{{ x }}{% endmacro %}{% for message in messages %}{{ m(message.content) }}{% endfor %}"})");
  EXPECT_EQ(error_kind_of([&] { moe::ChatTemplate::from_tokenizer_config(path); }, &msg),
            moe::ErrorKind::kUnsupported);
  EXPECT_NE(msg.find("macro"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  EXPECT_EQ(error_kind_of([] { render("{% include 'other.jinja' %}"); }, &msg),
            moe::ErrorKind::kUnsupported);
  EXPECT_EQ(error_kind_of([] { render("{{ messages | wordwrap(10) }}"); }, &msg),
            moe::ErrorKind::kUnsupported);
  EXPECT_NE(msg.find("wordwrap"), std::string::npos) << msg;
  EXPECT_EQ(error_kind_of([] { render("{{ 'x'.format(1) }}"); }, &msg),
            moe::ErrorKind::kUnsupported);
  EXPECT_EQ(error_kind_of([] { render("{% if x %}unclosed"); }, &msg),
            moe::ErrorKind::kUnsupported);
}

TEST(ChatTemplateErrors, RaiseExceptionIsInvalidArgument) {
  std::string msg;
  EXPECT_EQ(error_kind_of(
                [] {
                  render(
                      "{% if messages[0].role != 'user' %}{{ raise_exception('first must be "
                      "user') }}{% endif %}",
                      ojson::object(), ojson::parse(R"([{"role": "assistant", "content": ""}])"));
                },
                &msg),
            moe::ErrorKind::kInvalidArgument);
  EXPECT_NE(msg.find("first must be user"), std::string::npos) << msg;
}
