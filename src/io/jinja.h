// A small Jinja2 interpreter for chat templates (the subset that Hugging Face chat templates use),
// configured like transformers' template environment: trim_blocks and lstrip_blocks on, loop
// controls, the `tojson` filter of transformers (ensure_ascii=False), `raise_exception` and
// `strftime_now`. Constructs it does not implement (macros, includes, call blocks, unknown
// filters or tests) are reported as kUnsupported with one line naming the construct.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

namespace moe::jinja {

struct Program;

class Template {
 public:
  // Parses template source. Throws moe::Error kUnsupported (naming `origin` and the line) when the
  // template uses syntax this interpreter does not handle or is malformed.
  static Template parse(std::string_view source, const std::string& origin);

  // Renders with the given top-level variables (a JSON object; key order is kept for tojson).
  // Throws kInvalidArgument when the template raises an exception or hits a type error on the
  // given data, kUnsupported for a method or construct that only shows at render time.
  std::string render(const nlohmann::ordered_json& variables) const;

 private:
  std::shared_ptr<const Program> program_;
};

}  // namespace moe::jinja
