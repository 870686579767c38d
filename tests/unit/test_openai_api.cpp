// The OpenAI request handling without a socket: every field is implemented or refused by name,
// client-controlled sizes are bounded, and the routes answer through a recorded Response over
// the bundled tiny model and the CPU scheduler.
#include <gtest/gtest.h>

#include <atomic>

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "backend/cpu/cpu_executor.h"
#include "model/model.h"
#include "serve/openai_api.h"
#include "serve/openai_request.h"
#include "serve/request_loop.h"
#include "serve/scheduler.h"

namespace moe::serve {
namespace {

using json = nlohmann::json;

std::string model_dir() { return std::string(MOE_SOURCE_DIR) + "/models/tiny-qwen3-moe"; }

struct Api {
  Tokenizer tok = Tokenizer::from_file(model_dir() + "/tokenizer.json");
  ChatTemplate chat = ChatTemplate::from_tokenizer_config(model_dir() + "/tokenizer_config.json");
  RequestPreparer preparer;
  explicit Api(int64_t context = 256, bool with_chat = true)
      : preparer(tok, with_chat ? &chat : nullptr, "tokenizer_config.json has no chat_template",
                 ApiConfig{"tiny", context, 0, {151645}}) {}
};

ApiError refused(const Api& api, const std::string& body, bool chat = false) {
  try {
    api.preparer.prepare(body, chat);
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "accepted: " << body;
  return {};
}

TEST(OpenAiRequest, EveryUnimplementedFieldIsRefusedByName) {
  Api api;
  struct Case {
    const char* body;
    bool chat;
    const char* param;
  };
  const Case cases[] = {
      {R"({"prompt": "a", "n": 2})", false, "n"},
      {R"({"prompt": "a", "logprobs": 3})", false, "logprobs"},
      {R"({"prompt": "a", "echo": true})", false, "echo"},
      {R"({"prompt": "a", "best_of": 2})", false, "best_of"},
      {R"({"prompt": "a", "suffix": "z"})", false, "suffix"},
      {R"({"prompt": "a", "presence_penalty": 0.5})", false, "presence_penalty"},
      {R"({"prompt": "a", "frequency_penalty": 1})", false, "frequency_penalty"},
      {R"({"prompt": "a", "logit_bias": {"5": 10}})", false, "logit_bias"},
      {R"({"prompt": "a", "repetition_penalty": 1.1})", false, "repetition_penalty"},
      {R"({"prompt": "a", "tools": []})", false, "tools"},  // a chat field on the completions endpoint
      {R"({"messages": [{"role": "user", "content": "hi"}], "logprobs": true})", true, "logprobs"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2})", true, "top_logprobs"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]})",
       true, "tools"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"})", true, "tool_choice"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_object"}})", true,
       "response_format"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "functions": [{"name": "f"}]})", true, "functions"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "prompt": "x"})", true, "prompt"},
      {R"({"messages": [{"role": "user", "content": "hi"}], "stream_options": {"include_usage": true}})", true,
       "stream_options"},
  };
  for (const Case& c : cases) {
    const ApiError e = refused(api, c.body, c.chat);
    EXPECT_EQ(e.status, 400) << c.body;
    EXPECT_EQ(e.param, c.param) << c.body << ": " << e.message;
    EXPECT_NE(e.message.find(std::string("'") + c.param + "'"), std::string::npos) << e.message;
  }
  // Their no-op values are accepted.
  const PreparedRequest r = api.preparer.prepare(
      R"({"messages": [{"role": "user", "content": "hi"}], "n": 1, "logprobs": false, "tools": [],
          "tool_choice": "none", "response_format": {"type": "text"}, "presence_penalty": 0,
          "frequency_penalty": 0.0, "logit_bias": {}, "user": "someone", "stream": true,
          "stream_options": {"include_usage": true}})",
      true);
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
}

TEST(OpenAiRequest, SamplingFields) {
  Api api;
  // A top_k past the vocabulary (or -1) is every token, never a truncated integer.
  EXPECT_EQ(api.preparer.prepare(R"({"prompt": "a", "top_k": 1099511627776})", false).options.sampling.top_k, 0);
  EXPECT_EQ(api.preparer.prepare(R"({"prompt": "a", "top_k": -1})", false).options.sampling.top_k, 0);
  EXPECT_EQ(api.preparer.prepare(R"({"prompt": "a", "top_k": 7})", false).options.sampling.top_k, 7);
  EXPECT_EQ(refused(api, R"({"prompt": "a", "top_k": -2})").param, "top_k");
  EXPECT_EQ(refused(api, R"({"prompt": "a", "top_k": 1e30})").param, "top_k");
  EXPECT_EQ(refused(api, R"({"prompt": "a", "temperature": -0.5})").param, "temperature");
  EXPECT_EQ(refused(api, R"({"prompt": "a", "temperature": "hot"})").param, "temperature");
  EXPECT_EQ(refused(api, R"({"prompt": "a", "top_p": 0})").param, "top_p");
  EXPECT_EQ(refused(api, R"({"prompt": "a", "seed": 1.5})").param, "seed");
  // A seed is kept; no seed is a fresh one per request.
  EXPECT_EQ(api.preparer.prepare(R"({"prompt": "a", "seed": 42})", false).options.sampling.seed, 42u);
  EXPECT_EQ(api.preparer.prepare(R"({"prompt": "a", "seed": -1})", false).options.sampling.seed, UINT64_MAX);
  const uint64_t s1 = api.preparer.prepare(R"({"prompt": "a"})", false).options.sampling.seed;
  const uint64_t s2 = api.preparer.prepare(R"({"prompt": "a"})", false).options.sampling.seed;
  EXPECT_NE(s1, s2);
  // Stop strings: bounded in number and length.
  std::string many = R"({"prompt": "a", "stop": [)";
  for (int i = 0; i < 17; ++i) many += std::string(i ? "," : "") + "\"s" + std::to_string(i) + "\"";
  EXPECT_EQ(refused(api, many + "]}").param, "stop");
  EXPECT_EQ(refused(api, R"({"prompt": "a", "stop": ")" + std::string(600, 'x') + "\"}").param, "stop");
  EXPECT_EQ(refused(api, R"({"prompt": "a", "stop": [""]})").param, "stop");
  // The end-of-text token stops a request unless it asks to run to max_tokens.
  EXPECT_EQ(api.preparer.prepare(R"({"prompt": "a"})", false).options.stop_ids, (std::vector<int32_t>{151645}));
  EXPECT_TRUE(api.preparer.prepare(R"({"prompt": "a", "ignore_eos": true})", false).options.stop_ids.empty());
  EXPECT_EQ(api.preparer.prepare(R"({"prompt": "a", "ignore_eos": false})", false).options.stop_ids.size(), 1u);
  EXPECT_EQ(refused(api, R"({"prompt": "a", "ignore_eos": 1})").param, "ignore_eos");
}

TEST(OpenAiRequest, PromptsAndTheirLimits) {
  Api api(64);
  // The prompt limit holds while tokenizing: a 10 MB one-word prompt is refused without being
  // tokenized (this would take many seconds otherwise), so are 200 words.
  const ApiError huge = refused(api, R"({"prompt": ")" + std::string(10 << 20, 'a') + "\"}");
  EXPECT_EQ(huge.code, "context_length_exceeded");
  EXPECT_EQ(huge.param, "prompt");
  std::string words;
  for (int i = 0; i < 200; ++i) words += "word ";
  EXPECT_EQ(refused(api, R"({"prompt": ")" + words + "\"}").code, "context_length_exceeded");
  // Token ids are a prompt too, checked against the vocabulary and the limit.
  EXPECT_EQ(api.preparer.prepare(R"({"prompt": [1, 2, 3]})", false).prompt, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(refused(api, R"({"prompt": [1, 151936]})").param, "prompt");
  EXPECT_EQ(refused(api, R"({"prompt": [1, -2]})").param, "prompt");
  EXPECT_EQ(refused(api, R"({"prompt": ["a", "b"]})").param, "prompt");
  EXPECT_EQ(api.preparer.prepare(R"({"prompt": ["one"]})", false).prompt,
            api.preparer.prepare(R"({"prompt": "one"})", false).prompt);
  EXPECT_EQ(refused(api, R"({"prompt": ""})").param, "prompt");
  EXPECT_EQ(refused(api, R"({"prompt": "a", "max_tokens": 0})").param, "max_tokens");
  // Completions default to 16 tokens, chat to what the context leaves.
  EXPECT_EQ(api.preparer.prepare(R"({"prompt": "a"})", false).options.max_tokens, 16);
  const PreparedRequest c = api.preparer.prepare(R"({"messages": [{"role": "user", "content": "hi"}]})", true);
  EXPECT_EQ(c.options.max_tokens, 64 - static_cast<int64_t>(c.prompt.size()));
}

TEST(OpenAiRequest, BodiesThatAreNotRequests) {
  Api api;
  EXPECT_NE(refused(api, R"({"prompt": "a",)").message.find("not valid JSON"), std::string::npos);
  EXPECT_NE(refused(api, "[1]").message.find("JSON object"), std::string::npos);
  // Deep nesting is refused by a scan, before any parser recursion.
  EXPECT_NE(refused(api, std::string(1000000, '[')).message.find("nests deeper than 64"), std::string::npos);
  EXPECT_NE(refused(api, R"({"prompt": "a", "user": )" + std::string(100, '{')).message.find("nests deeper"),
            std::string::npos);
  const ApiError model = refused(api, R"({"model": "gpt-4", "prompt": "a"})");
  EXPECT_EQ(model.status, 404);
  EXPECT_EQ(model.code, "model_not_found");
  const json body = json::parse(error_json(model));
  EXPECT_EQ(body["error"]["type"], "not_found_error");
  EXPECT_EQ(body["error"]["param"], "model");
}

TEST(OpenAiRequest, ChatMessages) {
  Api api;
  const auto plain = api.preparer.prepare(R"({"messages": [{"role": "user", "content": "hi there"}]})", true).prompt;
  const auto parts = api.preparer.prepare(
      R"({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi there"}]}]})", true).prompt;
  EXPECT_EQ(plain, parts);
  const std::string rendered = api.chat.render({{"user", "hi there"}}, true);
  EXPECT_EQ(plain, api.tok.encode(rendered, /*add_special=*/false));  // as apply_chat_template
  EXPECT_EQ(refused(api, R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", true).param,
            "messages");
  EXPECT_EQ(refused(api, R"({"messages": [{"role": "user", "content": "x", "weight": 2}]})", true).param,
            "messages");
  EXPECT_EQ(refused(api, R"({"messages": [{"content": "x"}]})", true).param, "messages");
  EXPECT_EQ(refused(api, R"({"messages": []})", true).param, "messages");
  // Template variables pass through chat_template_kwargs; the reserved ones do not.
  const auto thinking = api.preparer.prepare(
      R"({"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"enable_thinking": false}})",
      true).prompt;
  EXPECT_EQ(thinking, api.tok.encode(api.chat.render({{"user", "hi"}}, true, false), false));
  EXPECT_EQ(refused(api, R"({"messages": [{"role": "user", "content": "hi"}],
                             "chat_template_kwargs": {"messages": []}})", true).param,
            "chat_template_kwargs");
  // Without a usable template, chat is refused with the reason; completions still work.
  Api bare(256, false);
  const ApiError e = refused(bare, R"({"messages": [{"role": "user", "content": "hi"}]})", true);
  EXPECT_NE(e.message.find("chat is not available: tokenizer_config.json has no chat_template"), std::string::npos)
      << e.message;
  EXPECT_FALSE(bare.preparer.prepare(R"({"prompt": "hi"})", false).prompt.empty());
}

// A Response that records what a handler wrote.
struct Recorded : http::Response {
  int status = 0;
  std::string type, body, headers;
  bool streamed = false, ended = false, connected = true;
  void add_header(std::string name, std::string value) override { headers += name + ": " + value + "\n"; }
  void send(int s, std::string_view t, std::string_view b) override {
    status = s, type = t, body = b;
  }
  bool begin_stream(int s, std::string_view t) override {
    status = s, type = t, streamed = true;
    return true;
  }
  bool write(std::string_view data) override {
    body += data;
    return connected;
  }
  void end_stream() override { ended = true; }
  bool client_connected() override { return connected; }
  bool started() const override { return status != 0; }
};

struct Served {
  Api api;
  std::unique_ptr<Model> model = Model::load(model_dir());
  cpu::Executor executor{*model, cpu::ExecutorOptions{.sampled_vocab = api.tok.vocab_size()}};
  RequestLoop loop{std::make_unique<Scheduler>(executor, SchedulerConfig{}, &api.tok)};
  OpenAiApi routes{api.preparer, loop};
  Recorded call(const std::string& method, const std::string& path, const std::string& body = "") {
    http::Request req;
    req.method = method;
    req.path = req.target = path;
    req.body = body;
    Recorded res;
    routes.handle(req, res);
    return res;
  }
};

TEST(OpenAiApi, RoutesAndErrorBodies) {
  Served s;
  Recorded r = s.call("GET", "/health");
  EXPECT_EQ(r.status, 200);
  r = s.call("GET", "/v1/nothing");
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(json::parse(r.body)["error"]["type"], "not_found_error");
  r = s.call("GET", "/v1/completions");
  EXPECT_EQ(r.status, 405);
  EXPECT_NE(r.headers.find("Allow: POST"), std::string::npos);
  EXPECT_NE(json::parse(r.body)["error"]["message"].get<std::string>().find("takes POST"), std::string::npos);
  r = s.call("DELETE", "/health");
  EXPECT_EQ(r.status, 405);
  r = s.call("GET", "/v1/models");
  EXPECT_EQ(json::parse(r.body)["data"][0]["id"], "tiny");
  r = s.call("POST", "/v1/completions", R"({"prompt": "a", "n": 3})");
  EXPECT_EQ(r.status, 400);
  EXPECT_EQ(json::parse(r.body)["error"]["param"], "n");
}

TEST(OpenAiApi, CompletionStreamAndUsage) {
  Served s;
  Recorded whole = s.call("POST", "/v1/completions", R"({"prompt": "Hello", "max_tokens": 5, "temperature": 0})");
  ASSERT_EQ(whole.status, 200) << whole.body;
  const json w = json::parse(whole.body);
  EXPECT_EQ(w["usage"]["completion_tokens"], 5);
  EXPECT_EQ(w["choices"][0]["finish_reason"], "length");
  Recorded stream = s.call("POST", "/v1/completions",
                           R"({"prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": true,
                               "stream_options": {"include_usage": true}})");
  ASSERT_TRUE(stream.streamed);
  EXPECT_TRUE(stream.ended);
  std::string text;
  json usage;
  size_t at = 0;
  int chunks = 0;
  while ((at = stream.body.find("data: ", at)) != std::string::npos) {
    const size_t end = stream.body.find("\n\n", at);
    const std::string data = stream.body.substr(at + 6, end - at - 6);
    at = end;
    if (data == "[DONE]") break;
    const json c = json::parse(data);
    ++chunks;
    if (!c["choices"].empty()) text += c["choices"][0]["text"].get<std::string>();
    if (!c["usage"].is_null()) usage = c["usage"];
  }
  EXPECT_EQ(text, w["choices"][0]["text"].get<std::string>());  // greedy: the same text
  EXPECT_EQ(usage["completion_tokens"], 5);
  EXPECT_NE(stream.body.find("data: [DONE]"), std::string::npos);
}

// A request cut by shutdown ends with an OpenAI finish reason, and later requests get 503.
TEST(OpenAiApi, ShutdownCutsWithAnOpenAiFinishReason) {
  Served s;
  std::thread later([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    s.loop.shutdown();
  });
  Recorded r = s.call("POST", "/v1/completions", R"({"prompt": "Hello", "max_tokens": 4000, "temperature": 0})");
  later.join();
  ASSERT_EQ(r.status, 200) << r.body;
  const json j = json::parse(r.body);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");
  EXPECT_LT(j["usage"]["completion_tokens"].get<int64_t>(), 4000);
  Recorded after = s.call("POST", "/v1/completions", R"({"prompt": "Hello"})");
  EXPECT_EQ(after.status, 503);
}

// A client that goes away has its request cancelled: the handler returns long before the
// 4000 tokens are generated, and the KV blocks come back.
TEST(OpenAiApi, ClientThatLeavesCancelsItsRequest) {
  Served s;
  http::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = R"({"prompt": "Hello", "max_tokens": 4000, "temperature": 0, "stream": true})";
  Recorded res;
  res.connected = false;  // gone from the start
  s.routes.handle(req, res);
  EXPECT_EQ(res.body.find("[DONE]"), std::string::npos);
  for (int i = 0; i < 100; ++i) {
    if (s.loop.metrics().find("moe_kv_blocks_in_use 0\n") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_NE(s.loop.metrics().find("moe_kv_blocks_in_use 0\n"), std::string::npos);
}

// The real scheduler, except that the next `failures` steps throw, as a device error would.
struct FailingBatcher : Batcher {
  explicit FailingBatcher(std::unique_ptr<Batcher> inner) : inner(std::move(inner)) {}
  uint64_t submit(std::vector<int32_t> prompt, const RequestOptions& o) override {
    return inner->submit(std::move(prompt), o);
  }
  bool cancel(uint64_t id) override { return inner->cancel(id); }
  std::vector<Event> step() override {
    if (failures.load() > 0) {
      --failures;
      MOE_THROW(kInternal, "device lost");
    }
    return inner->step();
  }
  bool busy() const override { return inner->busy(); }
  SchedulerStats stats() const override { return inner->stats(); }
  std::unique_ptr<Batcher> inner;
  std::atomic<int> failures{0};
};

// A step that throws ends the requests it ran with the reason, as an HTTP 500 or as the last event
// of a stream (never as a short answer that looks complete), and the server goes on serving.
TEST(OpenAiApi, AFailedStepAnswersEveryRequestWithTheReason) {
  Api api;
  std::unique_ptr<Model> model = Model::load(model_dir());
  cpu::Executor executor{*model, cpu::ExecutorOptions{.sampled_vocab = api.tok.vocab_size()}};
  auto failing = std::make_unique<FailingBatcher>(std::make_unique<Scheduler>(executor, SchedulerConfig{}, &api.tok));
  FailingBatcher* fail = failing.get();
  RequestLoop loop{std::move(failing)};
  OpenAiApi routes{api.preparer, loop};
  auto call = [&](const std::string& body) {
    http::Request req;
    req.method = "POST";
    req.path = req.target = "/v1/completions";
    req.body = body;
    Recorded res;
    routes.handle(req, res);
    return res;
  };
  fail->failures = 1;
  Recorded whole = call(R"({"prompt": "Hello", "max_tokens": 5, "temperature": 0})");
  EXPECT_EQ(whole.status, 500) << whole.body;
  const json e = json::parse(whole.body);
  EXPECT_EQ(e["error"]["type"], "server_error");
  EXPECT_NE(e["error"]["message"].get<std::string>().find("the engine failed: device lost"), std::string::npos)
      << whole.body;

  fail->failures = 1;
  Recorded stream = call(R"({"prompt": "Hello", "max_tokens": 5, "temperature": 0, "stream": true})");
  EXPECT_TRUE(stream.streamed);
  EXPECT_TRUE(stream.ended);
  EXPECT_NE(stream.body.find(R"("type":"server_error")"), std::string::npos) << stream.body;
  EXPECT_EQ(stream.body.find("[DONE]"), std::string::npos) << stream.body;

  Recorded after = call(R"({"prompt": "Hello", "max_tokens": 5, "temperature": 0})");
  ASSERT_EQ(after.status, 200) << after.body;
  EXPECT_EQ(json::parse(after.body)["usage"]["completion_tokens"], 5);
  EXPECT_NE(loop.metrics().find("moe_failed_steps_total 2"), std::string::npos) << loop.metrics();
}

}  // namespace
}  // namespace moe::serve
