// Accounting of jinja::Limits during one render: steps, memory built, output size and nesting
// depth. A Budget belongs to one render on one thread; nothing in it is shared. Internal.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "text/jinja.h"

namespace moe::jinja {

struct Dict;

// a * b, or SIZE_MAX when that does not fit (sizes compared against a limit).
size_t saturating_mul(size_t a, size_t b);
size_t saturating_add(size_t a, size_t b);

// Throws the kUnsupported error of a broken depth limit ("nesting exceeds the depth limit (128
// levels)").
[[noreturn]] void fail_depth(int max_depth);

class Budget {
 public:
  // Bytes of copying or scanning that count as one step: about what a step of evaluation costs.
  static constexpr uint64_t kBytesPerStep = 16;
  static constexpr uint64_t kCharsPerStep = 4;

  explicit Budget(const Limits& limits) : limits_(limits) {}
  ~Budget();
  Budget(const Budget&) = delete;
  Budget& operator=(const Budget&) = delete;

  const Limits& limits() const { return limits_; }

  // `n` units of evaluation: nodes, statements, loop iterations, elements compared.
  void step(uint64_t n = 1) {
    steps_ = saturating_add(steps_, n);
    if (saturating_add(steps_, bytes_worked_ / kBytesPerStep) > limits_.max_steps) fail_steps();
  }
  // Work proportional to `bytes` read or copied at memory speed (searching, comparing, copying).
  void scan(size_t bytes) { step_bytes(bytes); }
  // Work done character by character (stripping, parsing, walking by code point), several times
  // slower a byte than scanning: one step per kCharsPerStep characters.
  void chars(size_t n) { step_bytes(saturating_mul(n, kBytesPerStep / kCharsPerStep)); }

  // Claims `bytes` for a new string, list or dict (`what`, for the message) before it is
  // allocated: fails when that value would exceed max_value_bytes or everything the render has
  // built would exceed max_memory_bytes. Building costs steps too.
  void claim(size_t bytes, const char* what) { grow(0, bytes, what); }
  // As claim, for a value that grows from `have` to `have + more` bytes.
  void grow(size_t have, size_t more, const char* what);
  // As grow, for the render's output (max_output_bytes instead of max_value_bytes).
  void grow_output(size_t have, size_t more);

  // Fails when a value nests deeper than max_depth (checked where values are built).
  void check_nesting(int depth) const {
    if (depth > limits_.max_depth) fail_depth(limits_.max_depth);
  }

  // Namespaces are the only mutable values, so the only way to a reference cycle (a namespace
  // holding itself); the Budget empties every namespace of its render still alive when it ends,
  // which breaks such cycles instead of leaking them.
  void track_namespace(const std::shared_ptr<Dict>& ns);

  // Counts one level of recursion (evaluation, blocks, walking nested values) for its lifetime.
  class Nest {
   public:
    explicit Nest(Budget& b) : b_(b) {
      if (++b_.depth_ > b_.limits_.max_depth) {
        --b_.depth_;
        fail_depth(b_.limits_.max_depth);
      }
    }
    ~Nest() { --b_.depth_; }
    Nest(const Nest&) = delete;
    Nest& operator=(const Nest&) = delete;

   private:
    Budget& b_;
  };

 private:
  void step_bytes(uint64_t bytes) {
    bytes_worked_ = saturating_add(bytes_worked_, bytes);
    if (saturating_add(steps_, bytes_worked_ / kBytesPerStep) > limits_.max_steps) fail_steps();
  }
  [[noreturn]] void fail_steps() const;

  Limits limits_;
  uint64_t steps_ = 0;
  uint64_t bytes_worked_ = 0;
  uint64_t memory_ = 0;
  int depth_ = 0;
  std::vector<std::weak_ptr<Dict>> namespaces_;  // expired ones pruned as it grows
};

// A string built piece by piece, each piece claimed from the budget before it is appended, so
// that no text beyond the value size limit is ever allocated.
class TextBuilder {
 public:
  explicit TextBuilder(Budget& budget, const char* what = "string")
      : budget_(budget), what_(what) {}
  void append(std::string_view s) {
    budget_.grow(text_.size(), s.size(), what_);
    text_.append(s);
  }
  void append(size_t count, char c) {
    budget_.grow(text_.size(), count, what_);
    text_.append(count, c);
  }
  void push_back(char c) { append(std::string_view(&c, 1)); }
  size_t size() const { return text_.size(); }
  std::string take() { return std::move(text_); }

 private:
  Budget& budget_;
  const char* what_;
  std::string text_;
};

}  // namespace moe::jinja
