// An OpenAI completions or chat-completions request body, validated and turned into what the
// scheduler runs: prompt token ids and request options. Every field is either implemented or
// refused with a 400 that names it; none is dropped. Sizes a client controls are bounded before
// they cost anything: JSON nesting, stop strings, and the prompt's token count while it is
// tokenized. No socket and no engine: the HTTP handler, the unit tests and the fuzz target all
// call prepare() alike.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "serve/batcher.h"

namespace moe::serve {

// A request the client got wrong (or that the server cannot take): an HTTP status and an
// OpenAI error object.
struct ApiError {
  int status = 400;
  std::string message, param, code;
};

// {"error": {"message", "type", "param", "code"}} as OpenAI shapes it.
std::string error_json(const ApiError& e);

struct ApiConfig {
  std::string model_name;
  int64_t context = 0;            // tokens of prompt and completion per request
  int64_t max_prompt_tokens = 0;  // 0: context - 1
  std::vector<int32_t> eos_token_ids;
  size_t max_stop_strings = 16;
  size_t max_stop_bytes = 512;    // each stop string
  int max_json_depth = 64;        // nesting of the request body
};

struct PreparedRequest {
  bool chat = false;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage: a last chunk with the usage
  std::vector<int32_t> prompt;
  RequestOptions options;
};

class RequestPreparer {
 public:
  // `chat` may be null (no usable template): chat requests are then refused with
  // `no_chat_reason`. Both must outlive the preparer.
  RequestPreparer(const Tokenizer& tokenizer, const ChatTemplate* chat, std::string no_chat_reason, ApiConfig config);

  // Throws ApiError. Safe to call from several threads at once.
  PreparedRequest prepare(std::string_view body, bool chat) const;
  const ApiConfig& config() const { return config_; }

 private:
  const Tokenizer& tok_;
  const ChatTemplate* chat_;
  std::string no_chat_reason_;
  ApiConfig config_;
};

}  // namespace moe::serve
