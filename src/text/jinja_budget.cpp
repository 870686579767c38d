// Budget: the limit checks of one render and their messages.
#include "text/jinja_budget.h"

#include <limits>

#include "text/jinja_error.h"
#include "text/jinja_value.h"

namespace moe::jinja {

namespace {

// 10000000 -> "10,000,000": limits are easier to read with their thousands marked.
std::string grouped(uint64_t n) {
  std::string digits = std::to_string(n), out;
  for (size_t k = 0; k < digits.size(); ++k) {
    if (k && (digits.size() - k) % 3 == 0) out += ',';
    out += digits[k];
  }
  return out;
}

}  // namespace

size_t saturating_mul(size_t a, size_t b) {
  size_t r;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<size_t>::max() : r;
}

size_t saturating_add(size_t a, size_t b) {
  size_t r;
  return __builtin_add_overflow(a, b, &r) ? std::numeric_limits<size_t>::max() : r;
}

void fail_depth(int max_depth) {
  fail(ErrorKind::kUnsupported, "nesting exceeds the depth limit ({} levels)", max_depth);
}

Budget::~Budget() {
  for (const auto& weak : namespaces_)
    if (const auto ns = weak.lock()) ns->items.clear();
}

void Budget::track_namespace(const std::shared_ptr<Dict>& ns) {
  // Expired entries are dropped whenever the list is full, and the list grows when that frees
  // less than half of it: it stays within about four times the namespaces alive, and each pass is
  // paid for by the half a list of namespaces created since the last one.
  if (namespaces_.size() == namespaces_.capacity()) {
    std::erase_if(namespaces_, [](const std::weak_ptr<Dict>& w) { return w.expired(); });
    if (namespaces_.size() > namespaces_.capacity() / 2)
      namespaces_.reserve(2 * namespaces_.capacity());
  }
  namespaces_.push_back(ns);
}

void Budget::fail_steps() const {
  fail(ErrorKind::kUnsupported, "the render exceeded its step limit ({} steps)",
       grouped(limits_.max_steps));
}

void Budget::grow(size_t have, size_t more, const char* what) {
  const size_t total = saturating_add(have, more);
  if (total > limits_.max_value_bytes) {
    if (total == std::numeric_limits<size_t>::max())
      fail(ErrorKind::kUnsupported, "a {} larger than the value size limit ({} bytes)", what,
           grouped(limits_.max_value_bytes));
    fail(ErrorKind::kUnsupported, "a {} of {} bytes would exceed the value size limit ({} bytes)",
         what, grouped(total), grouped(limits_.max_value_bytes));
  }
  memory_ += more;
  if (memory_ > limits_.max_memory_bytes)
    fail(ErrorKind::kUnsupported, "the render exceeded its memory limit ({} bytes built in total)",
         grouped(limits_.max_memory_bytes));
  step_bytes(more);
}

void Budget::grow_output(size_t have, size_t more) {
  if (saturating_add(have, more) > limits_.max_output_bytes)
    fail(ErrorKind::kUnsupported, "the output exceeded its size limit ({} bytes)",
         grouped(limits_.max_output_bytes));
  memory_ += more;
  if (memory_ > limits_.max_memory_bytes)
    fail(ErrorKind::kUnsupported, "the render exceeded its memory limit ({} bytes built in total)",
         grouped(limits_.max_memory_bytes));
  step_bytes(more);
}

}  // namespace moe::jinja
