// Values and built-in operations of the chat-template interpreter (see jinja.h). Internal.
//
// Every operation whose cost grows with its operands takes the render's Budget and charges it
// (see jinja_budget.h); values are built only after their size has been claimed.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "text/jinja_budget.h"
#include "text/jinja_error.h"

namespace moe::jinja {

struct Value;
struct Dict;
struct Args;
using List = std::vector<Value>;
using Function = std::function<Value(Budget&, Args&)>;

struct Value {
  enum class Kind : uint8_t {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kFunction
  };
  Kind kind = Kind::kUndefined;
  bool b = false;
  int list_depth = 0;  // kList: 1 + the nesting of its deepest item (lists never change)
  int64_t i = 0;
  double f = 0;
  // kString: the text; kUndefined: the name that was looked up (for messages). Strings never
  // change, so copies of a value share the text instead of copying it.
  std::shared_ptr<const std::string> text;
  std::shared_ptr<List> list;
  std::shared_ptr<Dict> dict;
  std::shared_ptr<Function> fn;

  static Value undefined(std::string name = {});
  static Value none();
  static Value boolean(bool v);
  static Value integer(int64_t v);
  static Value number(double v);
  static Value string(std::string v);
  static Value new_list(List items = {});
  static Value new_dict();
  static Value function(Function fn);

  const std::string& str() const;  // the text ("" without one)
  // 0 for scalars, 1 + the deepest item for lists and dicts.
  int nesting() const;

  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_none() const { return kind == Kind::kNone; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_list() const { return kind == Kind::kList; }
  bool is_dict() const { return kind == Kind::kDict; }
  bool is_number() const {
    return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool;
  }
  bool is_integer() const { return kind == Kind::kInt || kind == Kind::kBool; }
  double as_double() const;
  int64_t as_int() const;
  const char* type_name() const;
};

// Approximate bytes that building a list or dict allocates (for Budget::claim): the container
// with its shared count, and its items.
constexpr size_t kContainerBytes = 64;
constexpr size_t kItemBytes = sizeof(Value);
constexpr size_t kEntryBytes = sizeof(std::pair<std::string, Value>);
inline size_t list_bytes(size_t items) {
  return saturating_add(kContainerBytes, saturating_mul(items, kItemBytes));
}
inline size_t dict_bytes(size_t entries) {
  return saturating_add(kContainerBytes, saturating_mul(entries, kEntryBytes));
}

struct Dict {
  std::vector<std::pair<std::string, Value>> items;  // insertion order, as Python dicts
  bool is_namespace = false;
  int depth = 1;  // 1 + the nesting of the deepest value it ever held
  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value v);
};

struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  // Positional argument `index` or keyword `name`, or nullptr.
  const Value* get(size_t index, std::string_view name) const;
};

bool truthy(const Value& v);
std::string to_str(Budget& b, const Value& v);  // Python str()
std::string repr(Budget& b, const Value& v);    // Python repr()
bool equal(Budget& b, const Value& x, const Value& y);
int compare(Budget& b, const Value& x, const Value& y);  // <0, 0, >0; fails for unorderable types
bool contains(Budget& b, const Value& container, const Value& item);
Value binary_op(Budget& b, const std::string& op, const Value& x, const Value& y);
Value negate(const Value& v);
size_t py_len(Budget& b, const Value& v);
// Items of an iterable (list items, dict keys, string characters).
List iterate(Budget& b, const Value& v);
Value get_attr(Budget& b, const Value& obj, const std::string& name);
Value get_item(Budget& b, const Value& obj, const Value& key);
Value slice(Budget& b, const Value& obj, const Value& start, const Value& stop, const Value& step);

// Python json.dumps(v, ensure_ascii=False, indent=indent, separators=..., sort_keys=...).
std::string to_json(Budget& b, const Value& v, int64_t indent, const std::string& item_sep,
                    const std::string& key_sep, bool sort_keys);
// The caller's variables; fails when they nest deeper than the depth limit.
Value from_json(Budget& b, const nlohmann::ordered_json& j);

Value call_method(Budget& b, const Value& obj, const std::string& name, Args& args);
bool has_filter(std::string_view name);
Value apply_filter(Budget& b, const std::string& name, const Value& v, Args& args);
bool has_test(std::string_view name);
bool apply_test(Budget& b, const std::string& name, const Value& v, Args& args);
// The global functions of the transformers environment: namespace, range, dict,
// raise_exception, strftime_now.
Value global_function(std::string_view name);

}  // namespace moe::jinja
