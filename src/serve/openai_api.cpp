#include "serve/openai_api.h"

#include <atomic>
#include <chrono>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace moe::serve {

namespace {

using json = nlohmann::json;

// Generated text is valid UTF-8 except, at worst, where a token sequence ends mid-character;
// such bytes go out as U+FFFD instead of failing the response.
std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

constexpr auto kPoll = std::chrono::milliseconds(200);  // how often a waiting request checks its client

void send_error(http::Response& res, const ApiError& e) {
  res.send(e.status, "application/json", error_json(e));
}

// OpenAI has no finish reason for a request the server cut; "length" (the output was truncated)
// is the closest of its values, and clients know it.
const char* finish_name(FinishReason r) {
  return r == FinishReason::kStop ? "stop" : "length";
}

json choice(bool chat, bool stream, const std::string& text, const char* finish, bool first) {
  json c = {{"index", 0}, {"finish_reason", finish ? json(finish) : json(nullptr)}};
  if (!chat) {
    c["text"] = text;
    c["logprobs"] = nullptr;
  } else if (stream) {
    c["delta"] = json::object();
    if (first) c["delta"]["role"] = "assistant";
    if (!text.empty() || !finish) c["delta"]["content"] = text;
  } else {
    c["message"] = {{"role", "assistant"}, {"content", text}};
  }
  return c;
}

json usage(size_t prompt, int64_t completion) {
  return {{"prompt_tokens", prompt},
          {"completion_tokens", completion},
          {"total_tokens", static_cast<int64_t>(prompt) + completion}};
}

}  // namespace

OpenAiApi::OpenAiApi(const RequestPreparer& preparer, RequestLoop& loop, std::function<std::string()> extra_metrics)
    : preparer_(preparer), loop_(loop), extra_metrics_(std::move(extra_metrics)) {}

std::pair<std::string, std::string> OpenAiApi::error_body(int status, const std::string& message) {
  return {"application/json", error_json(ApiError{status, message, "", ""})};
}

void OpenAiApi::handle(const http::Request& req, http::Response& res) {
  struct Route {
    const char* path;
    const char* method;
  };
  static constexpr Route kRoutes[] = {{"/health", "GET"},          {"/metrics", "GET"},
                                      {"/v1/models", "GET"},       {"/v1/completions", "POST"},
                                      {"/v1/chat/completions", "POST"}};
  const Route* route = nullptr;
  for (const Route& r : kRoutes)
    if (req.path == r.path) route = &r;
  if (!route) return send_error(res, {404, fmt::format("no such endpoint: {} {}", req.method, req.path), "", ""});
  if (req.method != route->method && !(req.method == "HEAD" && std::string_view(route->method) == "GET")) {
    res.add_header("Allow", route->method);
    return send_error(res, {405, fmt::format("{} takes {}, not {}", req.path, route->method, req.method), "", ""});
  }
  const std::string path = req.path;
  if (path == "/health") return res.send(200, "application/json", R"({"status":"ok"})");
  if (path == "/metrics")
    return res.send(200, "text/plain; version=0.0.4", loop_.metrics() + (extra_metrics_ ? extra_metrics_() : ""));
  if (path == "/v1/models") {
    const json m = {{"object", "list"},
                    {"data", json::array({{{"id", preparer_.config().model_name},
                                           {"object", "model"},
                                           {"created", 0},
                                           {"owned_by", "moe.cpp"},
                                           {"max_model_len", preparer_.config().context}}})}};
    return res.send(200, "application/json", dump(m));
  }
  completion(req, res, path == "/v1/chat/completions");
}

void OpenAiApi::completion(const http::Request& req, http::Response& res, bool chat) {
  auto job = std::make_shared<Job>();
  PreparedRequest p;
  try {
    p = preparer_.prepare(req.body, chat);
  } catch (const ApiError& e) {
    return send_error(res, e);
  }
  job->prompt = p.prompt;
  job->options = p.options;
  if (std::string why = loop_.submit(job); !why.empty()) {
    const bool closing = why.find("shutting down") != std::string::npos;
    return send_error(res, {closing ? 503 : 400, why, closing ? "" : "max_tokens",
                            why.find("context") != std::string::npos ? "context_length_exceeded" : ""});
  }
  const std::string id = fmt::format("{}-{}", chat ? "chatcmpl" : "cmpl", ++counter_);
  const int64_t created =
      std::chrono::duration_cast<std::chrono::seconds>(std::chrono::system_clock::now().time_since_epoch()).count();
  json head = {{"id", id},
               {"object", chat ? (p.stream ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
               {"created", created},
               {"model", preparer_.config().model_name}};

  if (!p.stream) {
    // Wait for the end, noticing a client that went away (its request is then cancelled).
    std::unique_lock lock(job->m);
    while (!job->cv.wait_for(lock, kPoll, [&] { return job->finished; })) {
      lock.unlock();
      const bool here = res.client_connected();
      lock.lock();
      if (!here) {
        lock.unlock();
        loop_.cancel(job);
        return;
      }
    }
    if (!job->failure.empty()) {
      const std::string why = job->failure;
      lock.unlock();
      return send_error(res, {500, why, "", ""});
    }
    std::string text;
    int64_t tokens = 0;
    FinishReason finish = FinishReason::kStop;
    for (const auto& e : job->events) {
      text += e.text;
      tokens += e.token >= 0;
      if (e.finish != FinishReason::kNone) finish = e.finish;
    }
    lock.unlock();
    json out = head;
    out["choices"] = json::array({choice(chat, false, text, finish_name(finish), true)});
    out["usage"] = usage(job->prompt.size(), tokens);
    return res.send(200, "application/json", dump(out));
  }

  res.add_header("Cache-Control", "no-cache");
  if (!res.begin_stream(200, "text/event-stream")) return loop_.cancel(job);
  bool first = true;
  int64_t tokens = 0;
  for (;;) {
    std::deque<Event> events;
    bool finished;
    std::string failure;
    {
      std::unique_lock lock(job->m);
      job->cv.wait_for(lock, kPoll, [&] { return !job->events.empty() || job->finished; });
      events.swap(job->events);
      finished = job->finished;
      failure = job->failure;
    }
    if (!res.client_connected()) return loop_.cancel(job);
    if (finished && !failure.empty()) {
      // The status line has gone out: the error travels as the stream's last event.
      res.write("data: " + error_json(ApiError{500, failure, "", ""}) + "\n\n");
      res.end_stream();
      return;
    }
    for (const auto& e : events) {
      tokens += e.token >= 0;
      const bool last = e.finish != FinishReason::kNone;
      if (e.text.empty() && !last && !first) continue;
      json chunk = head;
      chunk["choices"] = json::array({choice(chat, true, e.text, last ? finish_name(e.finish) : nullptr, first)});
      if (p.include_usage) chunk["usage"] = nullptr;
      first = false;
      if (!res.write("data: " + dump(chunk) + "\n\n")) return loop_.cancel(job);
    }
    if (finished) break;
  }
  if (p.include_usage) {
    json chunk = head;
    chunk["choices"] = json::array();
    chunk["usage"] = usage(job->prompt.size(), tokens);
    res.write("data: " + dump(chunk) + "\n\n");
  }
  res.write("data: [DONE]\n\n");
  res.end_stream();
}

}  // namespace moe::serve
