// Chat templates: renders a conversation into the prompt text a model was trained on, from the
// Jinja "chat_template" of a Hugging Face tokenizer_config.json, with the same output as
// transformers' apply_chat_template(..., tokenize=False). The template runs in a small Jinja
// interpreter (text/jinja.h) that covers what the Qwen3 and DeepSeek-V3 templates (and most other
// chat templates) use; a template that needs more is refused with kUnsupported when loaded or, for
// constructs only reached at run time, when rendered.
//
// The template comes with the model, so it is treated as untrusted code: it runs in a sandbox
// with limits on steps, output, memory and nesting (jinja::Limits), and a template that breaks one
// fails with a moe::Error instead of crashing or stalling the process.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "text/jinja.h"

namespace moe {

struct ChatMessage {
  std::string role;
  std::string content;
};

// Thread safety: render() and render_json() are const and share no mutable state (each render
// keeps its state on the calling thread), so one ChatTemplate may render on many threads at once
// without a lock. set_limits() is not synchronized: call it before sharing the template.
class ChatTemplate {
 public:
  // Reads "chat_template" (and the bos/eos/pad/unk tokens) from tokenizer_config.json. When the
  // config has no template, a chat_template.jinja next to it is used (newer transformers save it
  // there). Throws moe::Error: kIo if the file is missing, kFormat if it is not valid JSON, kConfig
  // if there is no template, kUnsupported if the template uses Jinja this interpreter lacks.
  static ChatTemplate from_tokenizer_config(const std::string& path);
  // From template source directly (bos/eos may be empty); `origin` names it in messages. The
  // limits apply to this parse (its depth) and to every render until set_limits().
  static ChatTemplate from_source(const std::string& source, const std::string& origin,
                                  const std::string& bos_token = {},
                                  const std::string& eos_token = {},
                                  const jinja::Limits& limits = {});

  // Renders the conversation. enable_thinking is left undefined (the template's default) unless
  // given. Throws kInvalidArgument when the template rejects the conversation
  // (raise_exception), kUnsupported for constructs it cannot render and for a render that breaks
  // one of the limits.
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt) const;
  std::string render(const std::vector<ChatMessage>& messages, bool add_generation_prompt,
                     std::optional<bool> enable_thinking) const;
  // General form: messages as JSON (objects with role, content and anything else, e.g.
  // tool_calls) and extra variables (e.g. tools, enable_thinking) merged into the context.
  std::string render_json(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                          const nlohmann::ordered_json& extra) const;

  const std::string& bos_token() const { return bos_; }
  const std::string& eos_token() const { return eos_; }
  const std::string& source() const { return source_; }

  // The limits of later renders (the defaults of jinja::Limits unless set).
  void set_limits(const jinja::Limits& limits) { limits_ = limits; }
  const jinja::Limits& limits() const { return limits_; }

 private:
  std::shared_ptr<const jinja::Template> template_;
  jinja::Limits limits_;
  std::string source_, origin_;
  std::string bos_, eos_, pad_, unk_;
};

}  // namespace moe
