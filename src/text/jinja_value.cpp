// Values of the chat-template interpreter and the operations every template uses on them, with
// Python semantics: truth, str() and repr(), comparison, membership, len, iteration, attribute
// and item access, slicing and JSON. Each charges the budget for the work it does.
#include "text/jinja_value.h"

#include <algorithm>
#include <cmath>

#include <nlohmann/json.hpp>

#include "text/jinja_arith.h"
#include "text/jinja_text.h"

namespace moe::jinja {

Value Value::undefined(std::string name) {
  Value v;
  if (!name.empty()) v.text = std::make_shared<const std::string>(std::move(name));
  return v;
}
Value Value::none() {
  Value v;
  v.kind = Kind::kNone;
  return v;
}
Value Value::boolean(bool x) {
  Value v;
  v.kind = Kind::kBool;
  v.b = x;
  return v;
}
Value Value::integer(int64_t x) {
  Value v;
  v.kind = Kind::kInt;
  v.i = x;
  return v;
}
Value Value::number(double x) {
  Value v;
  v.kind = Kind::kFloat;
  v.f = x;
  return v;
}
Value Value::string(std::string x) {
  Value v;
  v.kind = Kind::kString;
  v.text = std::make_shared<const std::string>(std::move(x));
  return v;
}
Value Value::new_list(List items) {
  Value v;
  v.kind = Kind::kList;
  int deepest = 0;
  for (const Value& x : items) deepest = std::max(deepest, x.nesting());
  v.list_depth = deepest + 1;
  v.list = std::make_shared<List>(std::move(items));
  return v;
}
Value Value::new_dict() {
  Value v;
  v.kind = Kind::kDict;
  v.dict = std::make_shared<Dict>();
  return v;
}
Value Value::function(Function f) {
  Value v;
  v.kind = Kind::kFunction;
  v.fn = std::make_shared<Function>(std::move(f));
  return v;
}

const std::string& Value::str() const {
  static const std::string kEmpty;  // immutable, so safe to share between threads
  return text ? *text : kEmpty;
}

int Value::nesting() const {
  if (kind == Kind::kList) return list_depth;
  if (kind == Kind::kDict) return dict->depth;
  return 0;
}

double Value::as_double() const {
  switch (kind) {
    case Kind::kBool:
      return b ? 1 : 0;
    case Kind::kInt:
      return static_cast<double>(i);
    case Kind::kFloat:
      return f;
    default:
      fail(ErrorKind::kInvalidArgument, "expected a number, got {}", type_name());
  }
}

int64_t Value::as_int() const {
  switch (kind) {
    case Kind::kBool:
      return b ? 1 : 0;
    case Kind::kInt:
      return i;
    default:
      fail(ErrorKind::kInvalidArgument, "expected an integer, got {}", type_name());
  }
}

const char* Value::type_name() const {
  switch (kind) {
    case Kind::kUndefined:
      return "undefined";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return "list";
    case Kind::kDict:
      return dict && dict->is_namespace ? "namespace" : "dict";
    case Kind::kFunction:
      return "function";
  }
  return "?";
}

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : items)
    if (k == key) return &v;
  return nullptr;
}

void Dict::set(const std::string& key, Value v) {
  depth = std::max(depth, v.nesting() + 1);
  for (auto& [k, old] : items)
    if (k == key) {
      old = std::move(v);
      return;
    }
  items.emplace_back(key, std::move(v));
}

const Value* Args::get(size_t index, std::string_view name) const {
  if (index < pos.size()) return &pos[index];
  for (const auto& [k, v] : kw)
    if (k == name) return &v;
  return nullptr;
}

namespace {

using Kind = Value::Kind;

// A dict lookup compares keys one by one: one step per 16 keys.
const Value* find_key(Budget& budget, const Dict& d, std::string_view key) {
  budget.step(d.items.size() / 16);
  return d.find(key);
}

std::string py_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  std::string s = fmt::format("{}", d);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

// Appends s to out, with runs of bytes that need no escape appended whole.
template <typename Escape>
void append_escaped(TextBuilder& out, std::string_view s, Escape escape) {
  size_t run = 0;
  for (size_t k = 0; k < s.size(); ++k) {
    const std::string_view e = escape(static_cast<unsigned char>(s[k]));
    if (e.empty()) continue;
    out.append(s.substr(run, k - run));
    out.append(e);
    run = k + 1;
  }
  out.append(s.substr(run));
}

void write_str_repr(TextBuilder& out, std::string_view s) {
  const bool dq = s.find('\'') != std::string_view::npos && s.find('"') == std::string_view::npos;
  const char q = dq ? '"' : '\'';
  std::string hex;
  out.push_back(q);
  append_escaped(out, s, [&](unsigned char c) -> std::string_view {
    if (c == '\\') return "\\\\";
    if (c == q) return q == '"' ? "\\\"" : "\\'";
    if (c == '\n') return "\\n";
    if (c == '\r') return "\\r";
    if (c == '\t') return "\\t";
    if (c < 0x20 || c == 0x7F) return hex = fmt::format("\\x{:02x}", c);
    return {};
  });
  out.push_back(q);
}

void write_repr(Budget& budget, const Value& v, TextBuilder& out) {
  Budget::Nest nest(budget);
  budget.step();
  switch (v.kind) {
    case Kind::kUndefined:
      return;
    case Kind::kNone:
      out.append("None");
      return;
    case Kind::kBool:
      out.append(v.b ? "True" : "False");
      return;
    case Kind::kInt:
      out.append(std::to_string(v.i));
      return;
    case Kind::kFloat:
      out.append(py_float_repr(v.f));
      return;
    case Kind::kString:
      write_str_repr(out, v.str());
      return;
    case Kind::kList:
      out.push_back('[');
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out.append(", ");
        write_repr(budget, (*v.list)[k], out);
      }
      out.push_back(']');
      return;
    case Kind::kDict:
      if (v.dict->is_namespace) {
        out.append("<Namespace>");
        return;
      }
      out.push_back('{');
      for (size_t k = 0; k < v.dict->items.size(); ++k) {
        if (k) out.append(", ");
        write_str_repr(out, v.dict->items[k].first);
        out.append(": ");
        write_repr(budget, v.dict->items[k].second, out);
      }
      out.push_back('}');
      return;
    case Kind::kFunction:
      out.append("<function>");
      return;
  }
}

void write_json_string(TextBuilder& out, std::string_view s) {
  std::string hex;
  out.push_back('"');
  append_escaped(out, s, [&](unsigned char c) -> std::string_view {
    switch (c) {
      case '"':
        return "\\\"";
      case '\\':
        return "\\\\";
      case '\n':
        return "\\n";
      case '\r':
        return "\\r";
      case '\t':
        return "\\t";
      case '\b':
        return "\\b";
      case '\f':
        return "\\f";
      default:
        if (c < 0x20) return hex = fmt::format("\\u{:04x}", c);
        return {};
    }
  });
  out.push_back('"');
}

struct JsonStyle {
  int64_t indent;  // < 0: all on one line
  const std::string& item_sep;
  const std::string& key_sep;
  bool sort_keys;
};

void write_json(Budget& budget, const Value& v, const JsonStyle& style, size_t level,
                TextBuilder& out) {
  Budget::Nest nest(budget);
  budget.step();
  auto newline = [&](size_t lvl) {
    out.push_back('\n');
    out.append(saturating_mul(static_cast<size_t>(style.indent), lvl), ' ');
  };
  switch (v.kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      out.append("null");
      return;
    case Kind::kBool:
      out.append(v.b ? "true" : "false");
      return;
    case Kind::kInt:
      out.append(std::to_string(v.i));
      return;
    case Kind::kFloat:
      if (std::isnan(v.f))
        out.append("NaN");
      else if (std::isinf(v.f))
        out.append(v.f > 0 ? "Infinity" : "-Infinity");
      else
        out.append(py_float_repr(v.f));
      return;
    case Kind::kString:
      write_json_string(out, v.str());
      return;
    case Kind::kList: {
      if (v.list->empty()) {
        out.append("[]");
        return;
      }
      out.push_back('[');
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out.append(style.item_sep);
        if (style.indent >= 0) newline(level + 1);
        write_json(budget, (*v.list)[k], style, level + 1, out);
      }
      if (style.indent >= 0) newline(level);
      out.push_back(']');
      return;
    }
    case Kind::kDict: {
      if (v.dict->items.empty()) {
        out.append("{}");
        return;
      }
      budget.claim(saturating_mul(v.dict->items.size(), sizeof(void*)), "list");
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.dict->items) items.push_back(&kv);
      if (style.sort_keys) {
        budget.step(items.size() * 8);  // n log n key comparisons, roughly
        std::stable_sort(items.begin(), items.end(),
                         [](const auto* a, const auto* b) { return a->first < b->first; });
      }
      out.push_back('{');
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out.append(style.item_sep);
        if (style.indent >= 0) newline(level + 1);
        write_json_string(out, items[k]->first);
        out.append(style.key_sep);
        write_json(budget, items[k]->second, style, level + 1, out);
      }
      if (style.indent >= 0) newline(level);
      out.push_back('}');
      return;
    }
    case Kind::kFunction:
      fail(ErrorKind::kInvalidArgument, "a function is not JSON serializable");
  }
}

}  // namespace

bool truthy(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return v.b;
    case Kind::kInt:
      return v.i != 0;
    case Kind::kFloat:
      return v.f != 0;
    case Kind::kString:
      return !v.str().empty();
    case Kind::kList:
      return !v.list->empty();
    case Kind::kDict:
      return v.dict->is_namespace || !v.dict->items.empty();
    case Kind::kFunction:
      return true;
  }
  return false;
}

std::string to_str(Budget& budget, const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return {};
    case Kind::kString:
      budget.claim(v.str().size(), "string");
      return v.str();
    default:
      return repr(budget, v);
  }
}

std::string repr(Budget& budget, const Value& v) {
  TextBuilder out(budget);
  write_repr(budget, v, out);
  return out.take();
}

bool equal(Budget& budget, const Value& a, const Value& b) {
  Budget::Nest nest(budget);
  budget.step();
  if (a.is_number() && b.is_number()) {
    if (a.is_integer() && b.is_integer()) return a.as_int() == b.as_int();
    return a.as_double() == b.as_double();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      if (a.str().size() != b.str().size()) return false;
      budget.scan(a.str().size());
      return a.str() == b.str();
    case Kind::kList:
      if (a.list == b.list) return true;
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equal(budget, (*a.list)[k], (*b.list)[k])) return false;
      return true;
    case Kind::kDict:
      if (a.dict == b.dict) return true;
      if (a.dict->is_namespace || b.dict->is_namespace) return false;
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, x] : a.dict->items) {
        const Value* y = find_key(budget, *b.dict, k);
        if (!y || !equal(budget, x, *y)) return false;
      }
      return true;
    case Kind::kFunction:
      return a.fn == b.fn;
    default:
      return false;
  }
}

int compare(Budget& budget, const Value& a, const Value& b) {
  Budget::Nest nest(budget);
  budget.step();
  if (a.is_number() && b.is_number()) {
    if (a.is_integer() && b.is_integer())
      return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int();
    const double x = a.as_double(), y = b.as_double();
    return x < y ? -1 : x > y;
  }
  if (a.is_string() && b.is_string()) {
    budget.scan(std::min(a.str().size(), b.str().size()));
    const int c = a.str().compare(b.str());
    return c < 0 ? -1 : c > 0;
  }
  if (a.is_list() && b.is_list()) {
    for (size_t k = 0; k < a.list->size() && k < b.list->size(); ++k) {
      if (int c = compare(budget, (*a.list)[k], (*b.list)[k])) return c;
    }
    return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size();
  }
  fail(ErrorKind::kInvalidArgument, "cannot order {} and {}", a.type_name(), b.type_name());
}

bool contains(Budget& budget, const Value& c, const Value& item) {
  switch (c.kind) {
    case Kind::kString:
      if (!item.is_string())
        fail(ErrorKind::kInvalidArgument, "'in <string>' expects a string, got {}",
             item.type_name());
      budget.scan(c.str().size());
      return text::find(c.str(), item.str()) != std::string_view::npos;
    case Kind::kList:
      for (const Value& x : *c.list)
        if (equal(budget, x, item)) return true;
      return false;
    case Kind::kDict:
      return item.is_string() && find_key(budget, *c.dict, item.str()) != nullptr;
    default:
      fail(ErrorKind::kInvalidArgument, "argument of type {} is not iterable", c.type_name());
  }
}

size_t py_len(Budget& budget, const Value& v) {
  switch (v.kind) {
    case Kind::kString:
      budget.chars(v.str().size());
      return text::count_chars(v.str());
    case Kind::kList:
      return v.list->size();
    case Kind::kDict:
      return v.dict->items.size();
    default:
      fail(ErrorKind::kInvalidArgument, "object of type {} has no len()", v.type_name());
  }
}

List iterate(Budget& budget, const Value& v) {
  switch (v.kind) {
    case Kind::kList:
      budget.claim(list_bytes(v.list->size()), "list");
      return *v.list;
    case Kind::kDict: {
      List l;
      budget.claim(list_bytes(v.dict->items.size()), "list");
      for (const auto& kv : v.dict->items) {
        budget.claim(kv.first.size(), "string");
        l.push_back(Value::string(kv.first));
      }
      return l;
    }
    case Kind::kString: {
      const std::string& s = v.str();
      // A value and a small shared string (about another value's size) per character.
      budget.chars(s.size());
      budget.claim(list_bytes(saturating_mul(text::count_chars(s), 2)), "list");
      List l;
      for (size_t i = 0; i < s.size();) {
        const size_t n = text::char_len(s, i);
        l.push_back(Value::string(s.substr(i, n)));
        i += n;
      }
      return l;
    }
    case Kind::kUndefined:
      fail(ErrorKind::kInvalidArgument, "'{}' is undefined", v.str().empty() ? "value" : v.str());
    default:
      fail(ErrorKind::kInvalidArgument, "{} is not iterable", v.type_name());
  }
}

Value get_attr(Budget& budget, const Value& obj, const std::string& name) {
  if (obj.is_undefined())
    fail(ErrorKind::kInvalidArgument, "'{}' is undefined (reading .{})",
         obj.str().empty() ? "value" : obj.str(), name);
  if (obj.is_dict()) {
    if (const Value* v = find_key(budget, *obj.dict, name)) return *v;
  }
  return Value::undefined(name);
}

Value get_item(Budget& budget, const Value& obj, const Value& key) {
  if (obj.is_undefined())
    fail(ErrorKind::kInvalidArgument, "'{}' is undefined (indexing it)",
         obj.str().empty() ? "value" : obj.str());
  if (obj.is_dict() && key.is_string()) {
    if (const Value* v = find_key(budget, *obj.dict, key.str())) return *v;
    return Value::undefined(key.str());
  }
  if (obj.is_list() && key.is_integer()) {
    const auto n = static_cast<int64_t>(obj.list->size());
    int64_t k = key.as_int();
    if (k < 0) k += n;  // cannot overflow: k < 0 <= n
    if (k < 0 || k >= n) return Value::undefined();
    return (*obj.list)[static_cast<size_t>(k)];
  }
  if (obj.is_string() && key.is_integer()) {
    const std::string& s = obj.str();
    budget.chars(saturating_mul(s.size(), 2));  // counting, then walking to the character
    const auto n = static_cast<int64_t>(text::count_chars(s));
    int64_t k = key.as_int();
    if (k < 0) k += n;
    if (k < 0 || k >= n) return Value::undefined();
    const size_t at = text::skip_chars(s, 0, static_cast<size_t>(k));
    return Value::string(s.substr(at, text::char_len(s, at)));
  }
  return Value::undefined(key.is_string() ? key.str() : std::string());
}

Value slice(Budget& budget, const Value& obj, const Value& start_v, const Value& stop_v,
            const Value& step_v) {
  auto given = [](const Value& v) { return !v.is_undefined() && !v.is_none(); };
  const int64_t step = given(step_v) ? step_v.as_int() : 1;
  if (step == 0) fail(ErrorKind::kInvalidArgument, "slice step cannot be zero");
  int64_t n;
  if (obj.is_list()) {
    n = static_cast<int64_t>(obj.list->size());
  } else if (obj.is_string()) {
    budget.chars(saturating_mul(obj.str().size(), 2));  // counting, then walking
    n = static_cast<int64_t>(text::count_chars(obj.str()));
  } else {
    fail(ErrorKind::kInvalidArgument, "cannot slice {}", obj.type_name());
  }
  // Python's slice.indices: bounds clamped into [lower, upper], none of it able to overflow
  // (a negative bound plus n stays below n).
  const int64_t lower = step < 0 ? -1 : 0, upper = step < 0 ? n - 1 : n;
  auto clamp = [&](const Value& v, int64_t fallback) {
    if (!given(v)) return fallback;
    int64_t x = v.as_int();
    if (x < 0) {
      x += n;
      if (x < lower) x = lower;
    } else if (x > upper) {
      x = upper;
    }
    return x;
  };
  const int64_t start = clamp(start_v, step < 0 ? upper : lower);
  const int64_t stop = clamp(stop_v, step < 0 ? lower : upper);
  const uint64_t count = range_length(start, stop, step);  // at most n, whatever the step
  if (obj.is_list()) {
    budget.claim(list_bytes(count), "list");
    List items;
    items.reserve(count);
    int64_t k = start;
    for (uint64_t taken = 0; taken < count; ++taken) {
      items.push_back((*obj.list)[static_cast<size_t>(k)]);
      if (taken + 1 < count) k += step;  // stays inside the list, so it cannot overflow
    }
    return Value::new_list(std::move(items));
  }
  const std::string& s = obj.str();
  size_t at = count ? text::skip_chars(s, 0, static_cast<size_t>(start)) : 0;
  if (step == 1) {
    const size_t end = text::skip_chars(s, at, count);
    budget.claim(end - at, "string");
    return Value::string(s.substr(at, end - at));
  }
  // Walk from character to character; the moves add up to at most n characters.
  TextBuilder out(budget);
  for (uint64_t taken = 0; taken < count; ++taken) {
    out.append(std::string_view(s).substr(at, text::char_len(s, at)));
    if (taken + 1 == count) break;
    if (step > 0) {
      at = text::skip_chars(s, at, static_cast<size_t>(step));
    } else {
      for (uint64_t back = 0; back < uint64_t{0} - static_cast<uint64_t>(step) && at > 0; ++back)
        at = text::char_start_before(s, at);
    }
  }
  return Value::string(out.take());
}

std::string to_json(Budget& budget, const Value& v, int64_t indent, const std::string& item_sep,
                    const std::string& key_sep, bool sort_keys) {
  TextBuilder out(budget);
  write_json(budget, v, JsonStyle{indent, item_sep, key_sep, sort_keys}, 0, out);
  return out.take();
}

Value from_json(Budget& budget, const nlohmann::ordered_json& j) {
  Budget::Nest nest(budget);
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned: {
      const auto u = j.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        fail(ErrorKind::kUnsupported, "the integer {} does not fit in 64 bits", u);
      return Value::integer(static_cast<int64_t>(u));
    }
    case nlohmann::ordered_json::value_t::number_float:
      return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List l;
      l.reserve(j.size());
      for (const auto& x : j) l.push_back(from_json(budget, x));
      return Value::new_list(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = Value::new_dict();
      d.dict->items.reserve(j.size());
      // Keys of a JSON object are distinct, so no Dict::set (and its search) per key.
      for (const auto& [k, x] : j.items()) {
        Value v = from_json(budget, x);
        d.dict->depth = std::max(d.dict->depth, v.nesting() + 1);
        d.dict->items.emplace_back(k, std::move(v));
      }
      return d;
    }
    default:
      return Value::undefined();
  }
}

}  // namespace moe::jinja
