#include "serve/openai_request.h"

#include <algorithm>
#include <climits>
#include <random>
#include <set>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "moe/errors.h"

namespace moe::serve {

namespace {

using ojson = nlohmann::ordered_json;

[[noreturn]] void bad(std::string message, std::string param = "", int status = 400, std::string code = "") {
  throw ApiError{status, std::move(message), std::move(param), std::move(code)};
}

// Fields each endpoint implements. Anything else is refused by name.
const std::set<std::string>& known_fields(bool chat) {
  static const std::set<std::string> common = {
      "model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
      "n", "presence_penalty", "frequency_penalty", "logit_bias", "user", "logprobs", "ignore_eos"};
  static const std::set<std::string> completions = [] {
    auto s = common;
    s.insert({"prompt", "echo", "best_of", "suffix"});
    return s;
  }();
  static const std::set<std::string> chats = [] {
    auto s = common;
    s.insert({"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice", "parallel_tool_calls",
              "functions", "function_call", "response_format", "chat_template_kwargs"});
    return s;
  }();
  return chat ? chats : completions;
}

// How deeply arrays and objects nest, scanned before parsing so that a body of a million '['
// costs one pass and no recursion anywhere after.
int nesting_depth(std::string_view body, int stop_past) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : body) {
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
      if (deepest > stop_past) return deepest;
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

const ojson* find(const ojson& body, const char* name) {
  auto it = body.find(name);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

int64_t integer(const ojson& body, const char* name, int64_t fallback) {
  const ojson* v = find(body, name);
  if (!v) return fallback;
  if (!v->is_number_integer()) bad(fmt::format("'{}' must be an integer", name), name);
  if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
    bad(fmt::format("'{}' is out of range", name), name);
  return v->get<int64_t>();
}

double number(const ojson& body, const char* name, double fallback) {
  const ojson* v = find(body, name);
  if (!v) return fallback;
  if (!v->is_number()) bad(fmt::format("'{}' must be a number", name), name);
  return v->get<double>();
}

bool boolean(const ojson& body, const char* name, bool fallback) {
  const ojson* v = find(body, name);
  if (!v) return fallback;
  if (!v->is_boolean()) bad(fmt::format("'{}' must be a boolean", name), name);
  return v->get<bool>();
}

// A field whose feature is not implemented: accepted only at its no-op value.
void only_default(const ojson& body, const char* name, bool (*is_default)(const ojson&), const char* why) {
  const ojson* v = find(body, name);
  if (v && !is_default(*v)) bad(fmt::format("'{}' is not supported: {}", name, why), name, 400, "unsupported_parameter");
}

void check_unimplemented(const ojson& body, bool chat) {
  auto zero = [](const ojson& v) { return v.is_number() && v.get<double>() == 0.0; };
  only_default(body, "n", [](const ojson& v) { return v.is_number_integer() && v.get<int64_t>() == 1; },
               "one choice per request (n = 1)");
  only_default(body, "presence_penalty", +zero, "no penalties are applied (0 only)");
  only_default(body, "frequency_penalty", +zero, "no penalties are applied (0 only)");
  only_default(body, "logit_bias", [](const ojson& v) { return v.is_object() && v.empty(); },
               "logits are not biased ({} only)");
  if (chat) {
    only_default(body, "logprobs", [](const ojson& v) { return v.is_boolean() && !v.get<bool>(); },
                 "log probabilities are not returned (false only)");
    only_default(body, "top_logprobs", +zero, "log probabilities are not returned (0 only)");
    only_default(body, "tools", [](const ojson& v) { return v.is_array() && v.empty(); },
                 "tool calls are not parsed from the output ([] only)");
    only_default(body, "functions", [](const ojson& v) { return v.is_array() && v.empty(); },
                 "function calls are not parsed from the output ([] only)");
    auto no_choice = [](const ojson& v) { return v.is_string() && (v == "none" || v == "auto"); };
    only_default(body, "tool_choice", +no_choice, "there are no tools (\"none\" or \"auto\" only)");
    only_default(body, "function_call", +no_choice, "there are no functions (\"none\" or \"auto\" only)");
    only_default(body, "parallel_tool_calls", [](const ojson& v) { return v.is_boolean(); },
                 "there are no tools (a boolean only)");
    only_default(body, "response_format",
                 [](const ojson& v) { return v.is_object() && v.size() == 1 && v.value("type", "") == "text"; },
                 "the output is not constrained ({\"type\": \"text\"} only)");
  } else {
    only_default(body, "logprobs", +zero, "log probabilities are not returned (0 only)");
    only_default(body, "echo", [](const ojson& v) { return v.is_boolean() && !v.get<bool>(); },
                 "the prompt is not echoed (false only)");
    only_default(body, "best_of", [](const ojson& v) { return v.is_number_integer() && v.get<int64_t>() == 1; },
                 "one candidate per request (1 only)");
    only_default(body, "suffix", [](const ojson& v) { return v.is_string() && v.get<std::string>().empty(); },
                 "insertion is not supported (\"\" only)");
  }
  if (const ojson* u = find(body, "user"); u && !u->is_string()) bad("'user' must be a string", "user");
}

// One message's content: a string, or OpenAI's list of text parts (joined by newlines).
std::string message_text(const ojson& content) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) bad("each message's 'content' must be a string or a list of text parts", "messages");
  std::string text;
  for (const ojson& part : content) {
    if (!part.is_object() || !part.contains("type") || !part["type"].is_string())
      bad("each content part must be an object with a string 'type'", "messages");
    const std::string type = part["type"].get<std::string>();
    if (type != "text") bad(fmt::format("content parts of type '{}' are not supported (text only)", type), "messages");
    if (!part.contains("text") || !part["text"].is_string()) bad("a text part needs a string 'text'", "messages");
    if (!text.empty()) text += "\n";
    text += part["text"].get<std::string>();
  }
  return text;
}

ojson chat_messages(const ojson& body) {
  const ojson* list = find(body, "messages");
  if (!list || !list->is_array() || list->empty()) bad("'messages' must be a non-empty array", "messages");
  static const std::set<std::string> keys = {"role", "content", "name", "tool_calls", "tool_call_id",
                                             "reasoning_content"};
  ojson out = ojson::array();
  for (const ojson& m : *list) {
    if (!m.is_object()) bad("each message must be an object", "messages");
    for (const auto& [k, v] : m.items())
      if (!keys.count(k)) bad(fmt::format("unrecognized message field '{}'", k), "messages");
    if (!m.contains("role") || !m["role"].is_string()) bad("each message needs a string 'role'", "messages");
    if (!m.contains("content") || m["content"].is_null()) bad("each message needs 'content'", "messages");
    ojson copy = m;
    copy["content"] = message_text(m["content"]);
    out.push_back(std::move(copy));
  }
  return out;
}

}  // namespace

std::string error_json(const ApiError& e) {
  const char* type = e.status == 404 ? "not_found_error" : e.status >= 500 ? "server_error" : "invalid_request_error";
  nlohmann::json body = {{"error",
                          {{"message", e.message},
                           {"type", type},
                           {"param", e.param.empty() ? nlohmann::json(nullptr) : nlohmann::json(e.param)},
                           {"code", e.code.empty() ? nlohmann::json(nullptr) : nlohmann::json(e.code)}}}};
  return body.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

RequestPreparer::RequestPreparer(const Tokenizer& tokenizer, const ChatTemplate* chat, std::string no_chat_reason,
                                 ApiConfig config)
    : tok_(tokenizer), chat_(chat), no_chat_reason_(std::move(no_chat_reason)), config_(std::move(config)) {
  MOE_CHECK(config_.context > 1, kInvalidArgument, "the context must hold at least 2 tokens, got {}", config_.context);
  if (config_.max_prompt_tokens <= 0 || config_.max_prompt_tokens >= config_.context)
    config_.max_prompt_tokens = config_.context - 1;
}

PreparedRequest RequestPreparer::prepare(std::string_view text, bool chat) const {
  if (nesting_depth(text, config_.max_json_depth) > config_.max_json_depth)
    bad(fmt::format("the request body nests deeper than {} levels", config_.max_json_depth));
  const ojson body = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) bad("the request body is not valid JSON");
  if (!body.is_object()) bad("the request body must be a JSON object");
  const auto& known = known_fields(chat);
  for (const auto& [k, v] : body.items())
    if (!known.count(k))
      bad(fmt::format("unrecognized request field '{}'", k), k, 400, "unrecognized_parameter");
  if (const ojson* m = find(body, "model")) {
    if (!m->is_string()) bad("'model' must be a string", "model");
    if (m->get<std::string>() != config_.model_name)
      bad(fmt::format("the model '{}' does not exist; this server serves '{}'", m->get<std::string>(),
                      config_.model_name),
          "model", 404, "model_not_found");
  }
  check_unimplemented(body, chat);

  PreparedRequest r;
  r.chat = chat;
  r.stream = boolean(body, "stream", false);
  if (const ojson* so = find(body, "stream_options")) {
    if (!r.stream) bad("'stream_options' needs \"stream\": true", "stream_options");
    if (!so->is_object()) bad("'stream_options' must be an object", "stream_options");
    for (const auto& [k, v] : so->items())
      if (k != "include_usage") bad(fmt::format("unrecognized stream option '{}'", k), "stream_options");
    r.include_usage = boolean(*so, "include_usage", false);
  }

  // Sampling.
  SamplingParams& sp = r.options.sampling;
  const double temperature = number(body, "temperature", 1.0);
  if (!(temperature >= 0.0) || temperature > 1e30) bad("'temperature' must be a finite number >= 0", "temperature");
  sp.temperature = static_cast<float>(temperature);
  const double top_p = number(body, "top_p", 1.0);
  if (!(top_p > 0.0 && top_p <= 1.0)) bad("'top_p' must be in (0, 1]", "top_p");
  sp.top_p = static_cast<float>(top_p);
  const int64_t top_k = integer(body, "top_k", 0);
  if (top_k < -1) bad("'top_k' must be -1 or 0 (every token) or positive", "top_k");
  // Past the vocabulary means every token; never a truncated integer.
  sp.top_k = top_k <= 0 || top_k >= tok_.vocab_size() ? 0 : static_cast<int>(top_k);
  if (const ojson* seed = find(body, "seed")) {
    if (!seed->is_number_integer()) bad("'seed' must be an integer", "seed");
    sp.seed = seed->is_number_unsigned() ? seed->get<uint64_t>() : static_cast<uint64_t>(seed->get<int64_t>());
  } else {
    // No seed: a fresh one, so that two identical requests do not sample the same text.
    static thread_local std::mt19937_64 seeds(std::random_device{}());
    sp.seed = seeds();
  }

  // Stop strings.
  if (const ojson* stop = find(body, "stop")) {
    std::vector<std::string>& out = r.options.stop_strings;
    auto add = [&](const ojson& s) {
      if (!s.is_string()) bad("'stop' must be a string or an array of strings", "stop");
      const std::string v = s.get<std::string>();
      if (v.empty()) bad("a stop string must not be empty", "stop");
      if (v.size() > config_.max_stop_bytes)
        bad(fmt::format("a stop string is longer than {} bytes", config_.max_stop_bytes), "stop");
      out.push_back(v);
    };
    if (stop->is_array()) {
      if (stop->size() > config_.max_stop_strings)
        bad(fmt::format("'stop' holds more than {} strings", config_.max_stop_strings), "stop");
      for (const ojson& s : *stop) add(s);
    } else {
      add(*stop);
    }
  }
  // vLLM's extension, which load generators send so that every request runs to max_tokens.
  if (!boolean(body, "ignore_eos", false)) r.options.stop_ids = config_.eos_token_ids;

  // The prompt, counted while it is tokenized.
  const char* prompt_param = chat ? "messages" : "prompt";
  const auto limit = static_cast<size_t>(config_.max_prompt_tokens);
  auto too_long = [&](const std::string& detail) {
    bad(fmt::format("the prompt {}; this server takes at most {} prompt tokens (context {})", detail, limit,
                    config_.context),
        prompt_param, 400, "context_length_exceeded");
  };
  auto encode = [&](const std::string& s, bool add_special) {
    try {
      return tok_.encode(s, add_special, limit);
    } catch (const Error& e) {
      if (e.kind() == ErrorKind::kInvalidArgument) too_long("is too long");
      throw;
    }
  };
  if (chat) {
    if (!chat_) bad(fmt::format("chat is not available: {}", no_chat_reason_), "messages");
    const ojson messages = chat_messages(body);
    ojson extra = ojson::object();
    if (const ojson* kw = find(body, "chat_template_kwargs")) {
      if (!kw->is_object()) bad("'chat_template_kwargs' must be an object", "chat_template_kwargs");
      for (const auto& [k, v] : kw->items()) {
        if (k == "messages" || k == "add_generation_prompt" || k.ends_with("_token"))
          bad(fmt::format("'chat_template_kwargs' may not set '{}'", k), "chat_template_kwargs");
        extra[k] = v;
      }
    }
    std::string rendered;
    try {
      rendered = chat_->render_json(messages, /*add_generation_prompt=*/true, extra);
    } catch (const Error& e) {
      bad(fmt::format("the chat template failed: {}", e.message()), "messages");
    }
    // As transformers' apply_chat_template: the template writes the special tokens itself.
    r.prompt = encode(rendered, /*add_special=*/false);
  } else {
    const ojson* prompt = find(body, "prompt");
    if (!prompt) bad("'prompt' is required", "prompt");
    if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) prompt = &(*prompt)[0];
    if (prompt->is_string()) {
      r.prompt = encode(prompt->get<std::string>(), /*add_special=*/true);
    } else if (prompt->is_array() && std::all_of(prompt->begin(), prompt->end(),
                                                 [](const ojson& v) { return v.is_number_integer(); })) {
      if (prompt->size() > limit) too_long(fmt::format("has {} tokens", prompt->size()));
      for (const ojson& id : *prompt) {
        const int64_t v = id.is_number_unsigned() && id.get<uint64_t>() > INT32_MAX ? -1 : id.get<int64_t>();
        if (v < 0 || v >= tok_.vocab_size())
          bad(fmt::format("prompt token id {} is outside the vocabulary [0, {})", id.dump(), tok_.vocab_size()),
              "prompt");
        r.prompt.push_back(static_cast<int32_t>(v));
      }
    } else {
      bad("'prompt' must be a string or an array of token ids (one prompt per request)", "prompt");
    }
  }
  if (r.prompt.empty()) bad("the prompt encodes to no tokens", prompt_param);

  // Completion length: OpenAI's defaults (16 for completions; what the context leaves for chat).
  const int64_t room = config_.context - static_cast<int64_t>(r.prompt.size());
  int64_t max_tokens = integer(body, "max_tokens", chat ? room : 16);
  if (chat) max_tokens = integer(body, "max_completion_tokens", max_tokens);
  if (max_tokens < 1) bad("'max_tokens' must be at least 1", chat && find(body, "max_completion_tokens")
                                                              ? "max_completion_tokens" : "max_tokens");
  r.options.max_tokens = max_tokens;
  return r;
}

}  // namespace moe::serve
