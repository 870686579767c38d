// A small Jinja2 interpreter for chat templates (the subset that Hugging Face chat templates use),
// configured like transformers' template environment: trim_blocks and lstrip_blocks on, loop
// controls, the `tojson` filter of transformers (ensure_ascii=False), `raise_exception` and
// `strftime_now`. Constructs it does not implement (macros, includes, call blocks, unknown
// filters or tests) are reported as kUnsupported with one line naming the construct.
//
// A template is code from a model repository, so the interpreter is a sandbox: whatever the
// template does, parsing and rendering end with output or a moe::Error, within the Limits below,
// without crashing, hanging or exhausting memory. Integer arithmetic is checked: where Python
// would give an integer beyond 64 bits the render fails (kUnsupported) instead of wrapping.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include <nlohmann/json_fwd.hpp>

namespace moe::jinja {

// What one parse or render may use. Breaking a limit is a moe::Error of kind kUnsupported whose
// message names the limit and its value, e.g. "the render exceeded its step limit (10,000,000
// steps)".
//
// The defaults are far above what real chat templates need and low enough that a hostile
// template stops within about a second and well under 100 MB. For scale, the Qwen3 template
// renders a 1,000-message conversation with tools and reasoning (a 1 MB prompt, twice what a
// 128k-token context holds) in 0.05 s, 5 * 10^5 steps and 4.6 MB built in total, with no value
// over 90 KB and nesting 13 deep (17 as the parser counts); DeepSeek-V3's template needs half
// of that. The hostile templates of the tests (runaway loops, doubling strings and lists,
// quadratic searches, exploding JSON) stop within 0.7 s and 65 MB on one core.
struct Limits {
  // Evaluation work: one step per expression node evaluated, statement run and element compared,
  // ten per loop iteration (the loop object), plus one per 16 bytes an operation copies or scans
  // and one per 4 characters it walks one by one. A step takes 20 to 70 ns, so 10^7 steps are
  // at most about 0.7 s: 20 times what the conversation above needs.
  uint64_t max_steps = 10'000'000;
  // The rendered text: 8 MiB is about two million tokens of English, beyond any model's context
  // and 8 times the conversation above.
  size_t max_output_bytes = size_t{8} << 20;
  // Any one string, list or dict the template builds (a list counts its items at the size of a
  // value each), checked before it is allocated. As large as the output, since a template may
  // build the whole prompt in a variable first.
  size_t max_value_bytes = size_t{8} << 20;
  // All strings, lists and dicts the render builds, the output included, counted as they are
  // built whether or not they are freed later. This bounds the render's peak memory (besides the
  // caller's variables and the parsed template), which the per-value limit alone does not: a
  // template could keep many values just under it. 64 MiB is 14 times the conversation above.
  size_t max_memory_bytes = size_t{64} << 20;
  // Nesting of blocks, expressions (a chain such as a + b + c nests one level per operator) and
  // the values a render walks through (lists in lists, the caller's variables included): real
  // templates stay under 20. 128 levels take under 0.5 MB of stack in a release build and under
  // 2 MB with the sanitizers, far inside the 8 MB a thread gets by default.
  int max_depth = 128;
};

struct Program;

// Thread safety: a Template is immutable once parsed; render() keeps all its state on the
// calling thread, so one Template may be rendered from any number of threads at once.
class Template {
 public:
  // Parses template source. Throws moe::Error kUnsupported (naming `origin` and the line) when the
  // template uses syntax this interpreter does not handle, is malformed, or nests deeper than
  // limits.max_depth (the other limits apply to render).
  static Template parse(std::string_view source, const std::string& origin,
                        const Limits& limits = {});

  // Renders with the given top-level variables (a JSON object; key order is kept for tojson).
  // Throws kInvalidArgument when the template raises an exception or hits an error on the given
  // data that Python would raise too (type errors, division by zero), kUnsupported for a method or
  // construct that only shows at render time, for an integer result beyond 64 bits, and for a
  // broken limit.
  std::string render(const nlohmann::ordered_json& variables, const Limits& limits = {}) const;

 private:
  std::shared_ptr<const Program> program_;
};

}  // namespace moe::jinja
