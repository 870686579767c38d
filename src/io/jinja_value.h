// Values and built-in operations of the chat-template interpreter (see jinja.h). Internal.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json_fwd.hpp>

#include "moe/errors.h"

namespace moe::jinja {

// Thrown inside the interpreter; Template turns it into a moe::Error naming the template and line.
struct TemplateError {
  ErrorKind kind;
  std::string message;
};

template <typename... A>
[[noreturn]] void fail(ErrorKind kind, fmt::format_string<A...> f, A&&... args) {
  throw TemplateError{kind, fmt::format(f, std::forward<A>(args)...)};
}

struct Value;
struct Dict;
struct Args;
using List = std::vector<Value>;
using Function = std::function<Value(Args&)>;

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
  int64_t i = 0;
  double f = 0;
  std::string s;  // kString: the text; kUndefined: the name that was looked up (for messages)
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

struct Dict {
  std::vector<std::pair<std::string, Value>> items;  // insertion order, as Python dicts
  bool is_namespace = false;
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
std::string to_str(const Value& v);  // Python str()
std::string repr(const Value& v);    // Python repr()
bool equal(const Value& a, const Value& b);
int compare(const Value& a, const Value& b);  // <0, 0, >0; fails for unorderable types
bool contains(const Value& container, const Value& item);
Value binary_op(const std::string& op, const Value& a, const Value& b);
size_t py_len(const Value& v);
// Items of an iterable (list items, dict keys, string characters).
List iterate(const Value& v);
Value get_attr(const Value& obj, const std::string& name);
Value get_item(const Value& obj, const Value& key);
Value slice(const Value& obj, const Value& start, const Value& stop, const Value& step);

// Python json.dumps(v, ensure_ascii=False, indent=indent, separators=..., sort_keys=...).
std::string to_json(const Value& v, int indent, const std::string& item_sep,
                    const std::string& key_sep, bool sort_keys);
Value from_json(const nlohmann::ordered_json& j);

Value call_method(const Value& obj, const std::string& name, Args& args);
bool has_filter(std::string_view name);
Value apply_filter(const std::string& name, const Value& v, Args& args);
bool has_test(std::string_view name);
bool apply_test(const std::string& name, const Value& v, Args& args);
// The global functions of the transformers environment: namespace, range, dict,
// raise_exception, strftime_now.
Value global_function(std::string_view name);

}  // namespace moe::jinja
