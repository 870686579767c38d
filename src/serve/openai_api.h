// moe-server's routes: the OpenAI endpoints (/v1/completions, /v1/chat/completions, /v1/models)
// plus /health and /metrics, answered over the HTTP layer's Response. A request is validated by
// RequestPreparer, run by the RequestLoop, and answered whole or as server-sent events; a client
// that goes away has its request cancelled. Unknown paths get 404 and known paths with another
// method 405, both with an OpenAI error body.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <string>
#include <utility>

#include "serve/http/http_types.h"
#include "serve/openai_request.h"
#include "serve/request_loop.h"

namespace moe::serve {

class OpenAiApi {
 public:
  // `extra_metrics` adds lines to /metrics (the HTTP layer's counters); may be empty.
  OpenAiApi(const RequestPreparer& preparer, RequestLoop& loop, std::function<std::string()> extra_metrics = {});

  void handle(const http::Request& request, http::Response& response);

  // The (content type, body) of an error answered outside a handler, for http::Server.
  static std::pair<std::string, std::string> error_body(int status, const std::string& message);

 private:
  void completion(const http::Request& request, http::Response& response, bool chat);

  const RequestPreparer& preparer_;
  RequestLoop& loop_;
  std::function<std::string()> extra_metrics_;
  std::atomic<uint64_t> counter_{0};
};

}  // namespace moe::serve
