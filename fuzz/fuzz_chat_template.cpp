// libFuzzer target for the chat-template interpreter: parses arbitrary bytes as a template and
// renders it, with small limits, against a fixed conversation with tools. Seeds are in
// fuzz/corpus/chat_template, tokens of the template language in fuzz/chat_template.dict, e.g.
//   fuzz-chat-template fuzz/corpus/chat_template -dict=fuzz/chat_template.dict -max_total_time=60
//
// A moe::Error is a normal outcome (most inputs are not valid templates, and hostile ones break a
// limit). A bug is anything else: another exception type, a crash, a sanitizer report, a render
// that runs away (libFuzzer's -timeout and -rss_limit_mb catch those), or output larger than the
// output limit.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "text/chat_template.h"
#include "moe/errors.h"

namespace {

using ojson = nlohmann::ordered_json;

[[noreturn]] void die(const std::string& what, std::string_view input) {
  std::fprintf(stderr, "fuzz_chat_template: %s (input of %zu bytes)\n", what.c_str(), input.size());
  std::abort();
}

// Small enough that every input finishes in milliseconds; the depth stays at its default so that
// the deepest nesting a real render allows is exercised under the sanitizers.
moe::jinja::Limits fuzz_limits() {
  moe::jinja::Limits l;
  l.max_steps = 200'000;
  l.max_output_bytes = 64 << 10;
  l.max_value_bytes = 64 << 10;
  l.max_memory_bytes = 1 << 20;
  return l;
}

const ojson& conversation() {
  static const ojson messages = ojson::parse(R"([
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the weather in Paris? \u00e9\ud83d\ude00"},
    {"role": "assistant", "content": "<think>\nlook it up\n</think>\n\nLet me check.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather",
                     "arguments": {"city": "Paris", "days": [1, 2]}}}]},
    {"role": "tool", "content": "{\"temperature\": 21.5, \"sky\": \"clear\"}"},
    {"role": "assistant", "content": "It is 21.5 degrees and clear."},
    {"role": "user", "content": ""}
  ])");
  return messages;
}

const ojson& extra() {
  static const ojson vars = ojson::parse(R"({
    "tools": [{"type": "function", "function": {"name": "get_weather",
      "description": "Current weather for a city.",
      "parameters": {"type": "object",
        "properties": {"city": {"type": "string"},
                       "days": {"type": "array", "items": {"type": "integer"}}},
        "required": ["city"]}}}],
    "enable_thinking": false,
    "numbers": [0, -1, 9223372036854775807, -9223372036854775808, 1.5e308, -0.0]
  })");
  return vars;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string source(reinterpret_cast<const char*>(data), size);
  const moe::jinja::Limits limits = fuzz_limits();
  try {
    const auto tmpl = moe::ChatTemplate::from_source(source, "fuzz", "<s>", "</s>", limits);
    const std::string out = tmpl.render_json(conversation(), true, extra());
    if (out.size() > limits.max_output_bytes) die("output beyond the output limit", source);
  } catch (const moe::Error& e) {
    const std::string what = e.what();
    if (what.find('\n') != std::string::npos)
      die("error message of several lines: " + what, source);
  } catch (const std::exception& e) {
    die(std::string("exception other than moe::Error: ") + e.what(), source);
  } catch (...) {
    die("exception of an unknown type", source);
  }
  return 0;
}
