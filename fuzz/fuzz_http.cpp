// libFuzzer target for the server's request handling, without a socket: the input bytes are what
// a client sent on a connection. They go through the HTTP request parser (limits, chunked
// bodies, gzip/br decoding) and, for each complete POST to an OpenAI endpoint, through the
// request preparer (JSON, every field's check, the chat template, tokenization with the prompt
// limit) with the bundled tiny model's tokenizer and chat template. An ApiError or a refused
// request is a normal outcome; a crash, a sanitizer report or any other exception is a bug.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <memory>
#include <string>
#include <string_view>

#include "text/chat_template.h"
#include "text/tokenizer.h"
#include "moe/errors.h"
#include "serve/http/request_reader.h"
#include "serve/openai_request.h"

#ifndef MOE_SOURCE_DIR
#define MOE_SOURCE_DIR "."
#endif

namespace {

struct World {
  moe::Tokenizer tok;
  moe::ChatTemplate chat;
  moe::serve::RequestPreparer preparer;
  World(moe::Tokenizer t, moe::ChatTemplate c)
      : tok(std::move(t)), chat(std::move(c)),
        preparer(tok, &chat, "", moe::serve::ApiConfig{"tiny", 512, 0, {151645}}) {}
};

const World& world() {
  static const std::unique_ptr<World> w = [] {
    const std::string dir = std::string(MOE_SOURCE_DIR) + "/models/tiny-qwen3-moe";
    try {
      return std::make_unique<World>(moe::Tokenizer::from_file(dir + "/tokenizer.json"),
                                     moe::ChatTemplate::from_tokenizer_config(dir + "/tokenizer_config.json"));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "fuzz_http: cannot load the tiny model's tokenizer: %s (run scripts/fetch_tokenizers.sh)\n",
                   e.what());
      std::exit(1);
    }
  }();
  return *w;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const World& w = world();
  moe::serve::http::Limits limits;
  limits.max_body_bytes = 1 << 20;  // small, so that inflating inputs stay cheap
  limits.max_header_bytes = 8192;
  moe::serve::http::RequestReader reader(limits);
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  for (int requests = 0; requests < 8 && !rest.empty(); ++requests) {
    rest.remove_prefix(reader.feed(rest));
    if (reader.state() != moe::serve::http::RequestReader::State::kComplete) break;
    bool keep_alive = false;
    const moe::serve::http::Request req = reader.take(&keep_alive);
    if (req.method != "POST") continue;
    const bool chat = req.path == "/v1/chat/completions";
    if (!chat && req.path != "/v1/completions") continue;
    try {
      w.preparer.prepare(req.body, chat);
    } catch (const moe::serve::ApiError&) {
      // a refused request: the expected outcome for most inputs
    }
  }
  return 0;
}
