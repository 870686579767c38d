// Values and built-ins of the chat-template interpreter: Python semantics for the operators,
// methods, filters and tests that chat templates use.
#include "io/jinja_value.h"

#include <algorithm>
#include <cmath>
#include <ctime>

#include <nlohmann/json.hpp>

#include "io/unicode_util.h"

namespace moe::jinja {

Value Value::undefined(std::string name) {
  Value v;
  v.s = std::move(name);
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
  v.s = std::move(x);
  return v;
}
Value Value::new_list(List items) {
  Value v;
  v.kind = Kind::kList;
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

// Code points of a UTF-8 string, each as its own UTF-8 substring (Python indexes strings by code
// point). Invalid bytes count as one character each.
std::vector<std::string_view> chars_of(std::string_view s) {
  std::vector<std::string_view> out;
  for (size_t i = 0; i < s.size();) {
    size_t n = unicode::utf8_valid_len(s, i);
    if (!n) n = 1;
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}

bool is_py_space(std::string_view ch) {
  if (ch.size() == 1)
    return ch[0] == ' ' || (ch[0] >= '\t' && ch[0] <= '\r') || (ch[0] >= 0x1C && ch[0] <= 0x1F);
  const size_t n = unicode::utf8_valid_len(ch, 0);
  return n == ch.size() && unicode::is_white_space(unicode::utf8_decode(ch, 0, n));
}

// Python str.strip / lstrip / rstrip.
std::string py_strip(const std::string& s, const Value* chars, bool left, bool right) {
  const auto cs = chars_of(s);
  std::vector<std::string_view> set;
  const bool whitespace = !chars || chars->is_none() || chars->is_undefined();
  if (!whitespace) {
    if (!chars->is_string()) fail(ErrorKind::kInvalidArgument, "strip arg must be None or str");
    set = chars_of(chars->s);
  }
  auto strip_this = [&](std::string_view c) {
    return whitespace ? is_py_space(c) : std::find(set.begin(), set.end(), c) != set.end();
  };
  size_t b = 0, e = cs.size();
  if (left)
    while (b < e && strip_this(cs[b])) ++b;
  if (right)
    while (e > b && strip_this(cs[e - 1])) --e;
  if (b == e) return {};
  const char* begin = cs[b].data();
  const char* end = cs[e - 1].data() + cs[e - 1].size();
  return std::string(begin, end);
}

std::string ascii_upper(std::string s) {
  for (char& c : s)
    if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
  return s;
}
std::string ascii_lower(std::string s) {
  for (char& c : s)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
  return s;
}

std::string py_float_repr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  std::string s = fmt::format("{}", d);
  if (s.find_first_of(".e") == std::string::npos) s += ".0";
  return s;
}

std::string py_str_repr(const std::string& s) {
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  std::string out(1, q);
  for (unsigned char c : s) {
    if (c == '\\')
      out += "\\\\";
    else if (c == q)
      out += std::string("\\") + static_cast<char>(q);
    else if (c == '\n')
      out += "\\n";
    else if (c == '\r')
      out += "\\r";
    else if (c == '\t')
      out += "\\t";
    else if (c < 0x20 || c == 0x7F)
      out += fmt::format("\\x{:02x}", c);
    else
      out += static_cast<char>(c);
  }
  return out + q;
}

void json_string(const std::string& s, std::string& out) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      default:
        if (c < 0x20)
          out += fmt::format("\\u{:04x}", c);
        else
          out += static_cast<char>(c);
    }
  }
  out += '"';
}

void json_dump(const Value& v, int indent, const std::string& item_sep, const std::string& key_sep,
               bool sort_keys, int level, std::string& out) {
  auto newline = [&](int lvl) {
    out += '\n';
    out.append(static_cast<size_t>(indent * lvl), ' ');
  };
  switch (v.kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      out += "null";
      return;
    case Kind::kBool:
      out += v.b ? "true" : "false";
      return;
    case Kind::kInt:
      out += std::to_string(v.i);
      return;
    case Kind::kFloat:
      if (std::isnan(v.f))
        out += "NaN";
      else if (std::isinf(v.f))
        out += v.f > 0 ? "Infinity" : "-Infinity";
      else
        out += py_float_repr(v.f);
      return;
    case Kind::kString:
      json_string(v.s, out);
      return;
    case Kind::kList: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k) out += item_sep;
        if (indent >= 0) newline(level + 1);
        json_dump((*v.list)[k], indent, item_sep, key_sep, sort_keys, level + 1, out);
      }
      if (indent >= 0) newline(level);
      out += ']';
      return;
    }
    case Kind::kDict: {
      if (v.dict->items.empty()) {
        out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.dict->items) items.push_back(&kv);
      if (sort_keys)
        std::stable_sort(items.begin(), items.end(),
                         [](const auto* a, const auto* b) { return a->first < b->first; });
      out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k) out += item_sep;
        if (indent >= 0) newline(level + 1);
        json_string(items[k]->first, out);
        out += key_sep;
        json_dump(items[k]->second, indent, item_sep, key_sep, sort_keys, level + 1, out);
      }
      if (indent >= 0) newline(level);
      out += '}';
      return;
    }
    case Kind::kFunction:
      fail(ErrorKind::kInvalidArgument, "a function is not JSON serializable");
  }
}

Value arg_or(const Args& args, size_t index, std::string_view name, Value fallback) {
  const Value* v = args.get(index, name);
  return v ? *v : fallback;
}

const std::string& need_string(const Value& v, const char* what) {
  if (!v.is_string())
    fail(ErrorKind::kInvalidArgument, "{} expects a string, got {}", what, v.type_name());
  return v.s;
}

std::vector<std::string> py_split(const std::string& s, const Value* sep, int64_t maxsplit) {
  std::vector<std::string> out;
  if (!sep || sep->is_none()) {
    const auto cs = chars_of(s);
    size_t k = 0;
    while (k < cs.size()) {
      while (k < cs.size() && is_py_space(cs[k])) ++k;
      if (k == cs.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        const char* b = cs[k].data();
        std::string rest(b, s.data() + s.size());
        out.push_back(py_strip(rest, nullptr, false, true));
        return out;
      }
      size_t e = k;
      while (e < cs.size() && !is_py_space(cs[e])) ++e;
      out.emplace_back(cs[k].data(), cs[e - 1].data() + cs[e - 1].size());
      k = e;
    }
    return out;
  }
  const std::string& d = need_string(*sep, "split");
  if (d.empty()) fail(ErrorKind::kInvalidArgument, "split: empty separator");
  size_t start = 0;
  while (true) {
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) break;
    size_t p = s.find(d, start);
    if (p == std::string::npos) break;
    out.push_back(s.substr(start, p - start));
    start = p + d.size();
  }
  out.push_back(s.substr(start));
  return out;
}

Value strings_to_list(const std::vector<std::string>& parts) {
  List l;
  for (const auto& p : parts) l.push_back(Value::string(p));
  return Value::new_list(std::move(l));
}

bool starts_or_ends(const std::string& s, const Value& arg, bool start) {
  auto one = [&](const std::string& x) {
    if (x.size() > s.size()) return false;
    return start ? s.compare(0, x.size(), x) == 0
                 : s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  if (arg.is_list()) {
    for (const Value& x : *arg.list)
      if (one(need_string(x, "startswith/endswith"))) return true;
    return false;
  }
  return one(need_string(arg, "startswith/endswith"));
}

std::string py_replace(const std::string& s, const std::string& a, const std::string& b,
                       int64_t count) {
  std::string out;
  if (a.empty()) {  // Python inserts b between characters
    const auto cs = chars_of(s);
    int64_t n = 0;
    for (auto c : cs) {
      if (count < 0 || n < count) {
        out += b;
        ++n;
      }
      out += c;
    }
    if (count < 0 || n < count) out += b;
    return out;
  }
  size_t start = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    size_t p = s.find(a, start);
    if (p == std::string::npos) break;
    out.append(s, start, p - start);
    out += b;
    start = p + a.size();
    ++n;
  }
  out.append(s, start, std::string::npos);
  return out;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out += c;
    }
  }
  return out;
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
      return !v.s.empty();
    case Kind::kList:
      return !v.list->empty();
    case Kind::kDict:
      return v.dict->is_namespace || !v.dict->items.empty();
    case Kind::kFunction:
      return true;
  }
  return false;
}

std::string to_str(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return {};
    case Kind::kString:
      return v.s;
    default:
      return repr(v);
  }
}

std::string repr(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return {};
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return v.b ? "True" : "False";
    case Kind::kInt:
      return std::to_string(v.i);
    case Kind::kFloat:
      return py_float_repr(v.f);
    case Kind::kString:
      return py_str_repr(v.s);
    case Kind::kList: {
      std::string out = "[";
      for (size_t k = 0; k < v.list->size(); ++k) out += (k ? ", " : "") + repr((*v.list)[k]);
      return out + "]";
    }
    case Kind::kDict: {
      if (v.dict->is_namespace) return "<Namespace>";
      std::string out = "{";
      bool first = true;
      for (const auto& [k, x] : v.dict->items) {
        out += (first ? "" : ", ") + py_str_repr(k) + ": " + repr(x);
        first = false;
      }
      return out + "}";
    }
    case Kind::kFunction:
      return "<function>";
  }
  return {};
}

bool equal(const Value& a, const Value& b) {
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
      return a.s == b.s;
    case Kind::kList:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k)
        if (!equal((*a.list)[k], (*b.list)[k])) return false;
      return true;
    case Kind::kDict:
      if (a.dict == b.dict) return true;
      if (a.dict->is_namespace || b.dict->is_namespace) return false;
      if (a.dict->items.size() != b.dict->items.size()) return false;
      for (const auto& [k, x] : a.dict->items) {
        const Value* y = b.dict->find(k);
        if (!y || !equal(x, *y)) return false;
      }
      return true;
    case Kind::kFunction:
      return a.fn == b.fn;
    default:
      return false;
  }
}

int compare(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_integer() && b.is_integer())
      return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int();
    const double x = a.as_double(), y = b.as_double();
    return x < y ? -1 : x > y;
  }
  if (a.is_string() && b.is_string()) return a.s < b.s ? -1 : a.s > b.s;
  if (a.is_list() && b.is_list()) {
    for (size_t k = 0; k < a.list->size() && k < b.list->size(); ++k) {
      if (int c = compare((*a.list)[k], (*b.list)[k])) return c;
    }
    return a.list->size() < b.list->size() ? -1 : a.list->size() > b.list->size();
  }
  fail(ErrorKind::kInvalidArgument, "cannot order {} and {}", a.type_name(), b.type_name());
}

bool contains(const Value& c, const Value& item) {
  switch (c.kind) {
    case Kind::kString:
      return c.s.find(need_string(item, "'in <string>'")) != std::string::npos;
    case Kind::kList:
      for (const Value& x : *c.list)
        if (equal(x, item)) return true;
      return false;
    case Kind::kDict:
      return item.is_string() && c.dict->find(item.s) != nullptr;
    default:
      fail(ErrorKind::kInvalidArgument, "argument of type {} is not iterable", c.type_name());
  }
}

Value binary_op(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") return Value::string(to_str(a) + to_str(b));
  if (op == "+") {
    if (a.is_string() && b.is_string()) return Value::string(a.s + b.s);
    if (a.is_list() && b.is_list()) {
      List l = *a.list;
      l.insert(l.end(), b.list->begin(), b.list->end());
      return Value::new_list(std::move(l));
    }
  }
  if (op == "*") {
    if ((a.is_string() || a.is_list()) && b.is_integer()) {
      Value r = a.is_string() ? Value::string({}) : Value::new_list();
      for (int64_t k = 0; k < b.as_int(); ++k) {
        if (a.is_string())
          r.s += a.s;
        else
          r.list->insert(r.list->end(), a.list->begin(), a.list->end());
      }
      return r;
    }
  }
  if (!a.is_number() || !b.is_number())
    fail(ErrorKind::kInvalidArgument, "unsupported operand types for {}: {} and {}", op,
         a.type_name(), b.type_name());
  const bool ints = a.is_integer() && b.is_integer();
  if (op == "/") {
    if (b.as_double() == 0) fail(ErrorKind::kInvalidArgument, "division by zero");
    return Value::number(a.as_double() / b.as_double());
  }
  if (ints) {
    const int64_t x = a.as_int(), y = b.as_int();
    if (op == "+") return Value::integer(x + y);
    if (op == "-") return Value::integer(x - y);
    if (op == "*") return Value::integer(x * y);
    if (op == "//" || op == "%") {
      if (y == 0) fail(ErrorKind::kInvalidArgument, "integer division or modulo by zero");
      int64_t q = x / y, r = x % y;
      if (r != 0 && ((r < 0) != (y < 0))) {
        --q;
        r += y;
      }
      return Value::integer(op == "//" ? q : r);
    }
    if (op == "**" && y >= 0) {
      int64_t r = 1;
      for (int64_t k = 0; k < y; ++k) r *= x;
      return Value::integer(r);
    }
  }
  const double x = a.as_double(), y = b.as_double();
  if (op == "+") return Value::number(x + y);
  if (op == "-") return Value::number(x - y);
  if (op == "*") return Value::number(x * y);
  if (op == "//") return Value::number(std::floor(x / y));
  if (op == "%") return Value::number(x - y * std::floor(x / y));
  if (op == "**") return Value::number(std::pow(x, y));
  fail(ErrorKind::kUnsupported, "operator '{}' is not supported", op);
}

size_t py_len(const Value& v) {
  switch (v.kind) {
    case Kind::kString:
      return chars_of(v.s).size();
    case Kind::kList:
      return v.list->size();
    case Kind::kDict:
      return v.dict->items.size();
    default:
      fail(ErrorKind::kInvalidArgument, "object of type {} has no len()", v.type_name());
  }
}

List iterate(const Value& v) {
  switch (v.kind) {
    case Kind::kList:
      return *v.list;
    case Kind::kDict: {
      List l;
      for (const auto& kv : v.dict->items) l.push_back(Value::string(kv.first));
      return l;
    }
    case Kind::kString: {
      List l;
      for (auto c : chars_of(v.s)) l.push_back(Value::string(std::string(c)));
      return l;
    }
    case Kind::kUndefined:
      fail(ErrorKind::kInvalidArgument, "'{}' is undefined", v.s.empty() ? "value" : v.s);
    default:
      fail(ErrorKind::kInvalidArgument, "{} is not iterable", v.type_name());
  }
}

Value get_attr(const Value& obj, const std::string& name) {
  if (obj.is_undefined())
    fail(ErrorKind::kInvalidArgument, "'{}' is undefined (reading .{})",
         obj.s.empty() ? "value" : obj.s, name);
  if (obj.is_dict()) {
    if (const Value* v = obj.dict->find(name)) return *v;
  }
  return Value::undefined(name);
}

Value get_item(const Value& obj, const Value& key) {
  if (obj.is_undefined())
    fail(ErrorKind::kInvalidArgument, "'{}' is undefined (indexing it)",
         obj.s.empty() ? "value" : obj.s);
  if (obj.is_dict() && key.is_string()) {
    if (const Value* v = obj.dict->find(key.s)) return *v;
    return Value::undefined(key.s);
  }
  if ((obj.is_list() || obj.is_string()) && key.is_integer()) {
    const auto cs = obj.is_string() ? chars_of(obj.s) : std::vector<std::string_view>{};
    const auto n = static_cast<int64_t>(obj.is_list() ? obj.list->size() : cs.size());
    int64_t k = key.as_int();
    if (k < 0) k += n;
    if (k < 0 || k >= n) return Value::undefined();
    return obj.is_list() ? (*obj.list)[k] : Value::string(std::string(cs[k]));
  }
  return Value::undefined(key.is_string() ? key.s : std::string());
}

Value slice(const Value& obj, const Value& start_v, const Value& stop_v, const Value& step_v) {
  auto opt = [](const Value& v) { return v.is_undefined() || v.is_none(); };
  const int64_t step = opt(step_v) ? 1 : step_v.as_int();
  if (step == 0) fail(ErrorKind::kInvalidArgument, "slice step cannot be zero");
  std::vector<std::string_view> cs;
  int64_t n;
  if (obj.is_list()) {
    n = static_cast<int64_t>(obj.list->size());
  } else if (obj.is_string()) {
    cs = chars_of(obj.s);
    n = static_cast<int64_t>(cs.size());
  } else {
    fail(ErrorKind::kInvalidArgument, "cannot slice {}", obj.type_name());
  }
  const int64_t lower = step < 0 ? -1 : 0, upper = step < 0 ? n - 1 : n;
  auto clamp = [&](const Value& v, int64_t fallback) {
    if (opt(v)) return fallback;
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
  List items;
  std::string text;
  for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
    if (obj.is_list())
      items.push_back((*obj.list)[k]);
    else
      text += cs[k];
  }
  return obj.is_list() ? Value::new_list(std::move(items)) : Value::string(std::move(text));
}

std::string to_json(const Value& v, int indent, const std::string& item_sep,
                    const std::string& key_sep, bool sort_keys) {
  std::string out;
  json_dump(v, indent, item_sep, key_sep, sort_keys, 0, out);
  return out;
}

Value from_json(const nlohmann::ordered_json& j) {
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return Value::none();
    case nlohmann::ordered_json::value_t::boolean:
      return Value::boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
    case nlohmann::ordered_json::value_t::number_unsigned:
      return Value::integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_float:
      return Value::number(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return Value::string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      List l;
      for (const auto& x : j) l.push_back(from_json(x));
      return Value::new_list(std::move(l));
    }
    case nlohmann::ordered_json::value_t::object: {
      Value d = Value::new_dict();
      for (const auto& [k, x] : j.items()) d.dict->items.emplace_back(k, from_json(x));
      return d;
    }
    default:
      return Value::undefined();
  }
}

Value call_method(const Value& obj, const std::string& name, Args& args) {
  if (obj.is_undefined())
    fail(ErrorKind::kInvalidArgument, "'{}' is undefined (calling .{}())",
         obj.s.empty() ? "value" : obj.s, name);
  if (obj.is_string()) {
    const std::string& s = obj.s;
    if (name == "startswith" || name == "endswith") {
      const Value* a = args.get(0, "prefix");
      if (!a) fail(ErrorKind::kInvalidArgument, "{}() needs an argument", name);
      return Value::boolean(starts_or_ends(s, *a, name == "startswith"));
    }
    if (name == "strip") return Value::string(py_strip(s, args.get(0, "chars"), true, true));
    if (name == "lstrip") return Value::string(py_strip(s, args.get(0, "chars"), true, false));
    if (name == "rstrip") return Value::string(py_strip(s, args.get(0, "chars"), false, true));
    if (name == "split") {
      const Value* mx = args.get(1, "maxsplit");
      return strings_to_list(py_split(s, args.get(0, "sep"), mx ? mx->as_int() : -1));
    }
    if (name == "upper") return Value::string(ascii_upper(s));
    if (name == "lower") return Value::string(ascii_lower(s));
    if (name == "title" || name == "capitalize") return apply_filter(name, obj, args);
    if (name == "replace") {
      const Value* a = args.get(0, "old");
      const Value* b = args.get(1, "new");
      if (!a || !b) fail(ErrorKind::kInvalidArgument, "replace() needs two arguments");
      const Value* c = args.get(2, "count");
      return Value::string(py_replace(s, need_string(*a, "replace"), need_string(*b, "replace"),
                                      c ? c->as_int() : -1));
    }
    if (name == "find" || name == "count") {
      const Value* a = args.get(0, "sub");
      if (!a) fail(ErrorKind::kInvalidArgument, "{}() needs an argument", name);
      const std::string& sub = need_string(*a, name.c_str());
      if (name == "find") {
        const size_t p = s.find(sub);
        return Value::integer(
            p == std::string::npos ? -1 : static_cast<int64_t>(chars_of(s.substr(0, p)).size()));
      }
      if (sub.empty()) return Value::integer(static_cast<int64_t>(chars_of(s).size() + 1));
      int64_t n = 0;
      for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
      return Value::integer(n);
    }
    if (name == "join") {
      const Value* a = args.get(0, "iterable");
      if (!a) fail(ErrorKind::kInvalidArgument, "join() needs an argument");
      std::string out;
      bool first = true;
      for (const Value& x : iterate(*a)) {
        if (!first) out += s;
        out += need_string(x, "join");
        first = false;
      }
      return Value::string(out);
    }
    if (name == "splitlines") {
      std::vector<std::string> lines;
      size_t start = 0;
      for (size_t k = 0; k < s.size(); ++k) {
        if (s[k] == '\n' || s[k] == '\r') {
          lines.push_back(s.substr(start, k - start));
          if (s[k] == '\r' && k + 1 < s.size() && s[k + 1] == '\n') ++k;
          start = k + 1;
        }
      }
      if (start < s.size()) lines.push_back(s.substr(start));
      return strings_to_list(lines);
    }
    if (name == "isspace" || name == "isdigit" || name == "isalpha" || name == "isalnum") {
      if (s.empty()) return Value::boolean(false);
      for (unsigned char c : s) {
        const bool ok = name == "isspace"   ? (c == ' ' || (c >= '\t' && c <= '\r'))
                        : name == "isdigit" ? (c >= '0' && c <= '9')
                        : name == "isalpha" ? std::isalpha(c) != 0
                                            : std::isalnum(c) != 0;
        if (!ok) return Value::boolean(false);
      }
      return Value::boolean(true);
    }
  } else if (obj.is_dict() && !obj.dict->is_namespace) {
    if (name == "items") {
      List l;
      for (const auto& [k, x] : obj.dict->items)
        l.push_back(Value::new_list({Value::string(k), x}));
      return Value::new_list(std::move(l));
    }
    if (name == "keys") return Value::new_list(iterate(obj));
    if (name == "values") {
      List l;
      for (const auto& kv : obj.dict->items) l.push_back(kv.second);
      return Value::new_list(std::move(l));
    }
    if (name == "get") {
      const Value* k = args.get(0, "key");
      if (!k) fail(ErrorKind::kInvalidArgument, "get() needs a key");
      if (k->is_string())
        if (const Value* v = obj.dict->find(k->s)) return *v;
      return arg_or(args, 1, "default", Value::none());
    }
  }
  fail(ErrorKind::kUnsupported, "method '{}' of {} is not supported", name, obj.type_name());
}

namespace {
constexpr std::string_view kFilters[] = {
    "abs",        "capitalize", "count",      "d",       "default", "e",      "escape", "first",
    "float",      "int",        "items",      "join",    "last",    "length", "list",   "lower",
    "map",        "reject",     "rejectattr", "replace", "reverse", "round",  "safe",   "select",
    "selectattr", "sort",       "string",     "title",   "tojson",  "trim",   "unique", "upper"};
constexpr std::string_view kTests[] = {
    "boolean",  "callable", "defined", "divisibleby", "eq",      "equalto", "escaped",
    "even",     "false",    "float",   "ge",          "gt",      "in",      "integer",
    "iterable", "le",       "lower",   "lt",          "mapping", "ne",      "none",
    "number",   "odd",      "sameas",  "sequence",    "string",  "true",    "undefined",
    "upper",    "==",       "!=",      "<",           "<=",      ">",       ">="};
}  // namespace

bool has_filter(std::string_view name) {
  return std::find(std::begin(kFilters), std::end(kFilters), name) != std::end(kFilters);
}
bool has_test(std::string_view name) {
  return std::find(std::begin(kTests), std::end(kTests), name) != std::end(kTests);
}

Value apply_filter(const std::string& name, const Value& v, Args& args) {
  if (name == "length" || name == "count") return Value::integer(static_cast<int64_t>(py_len(v)));
  if (name == "tojson") {
    // transformers: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
    if (truthy(arg_or(args, 0, "ensure_ascii", Value::boolean(false))))
      fail(ErrorKind::kUnsupported, "tojson with ensure_ascii=True is not supported");
    const Value indent = arg_or(args, 1, "indent", Value::none());
    const int ind = indent.is_none() ? -1 : static_cast<int>(indent.as_int());
    std::string item_sep = ind >= 0 ? "," : ", ", key_sep = ": ";
    if (const Value* sep = args.get(2, "separators");
        sep && sep->is_list() && sep->list->size() == 2) {
      item_sep = need_string((*sep->list)[0], "tojson separators");
      key_sep = need_string((*sep->list)[1], "tojson separators");
    }
    const bool sort_keys = truthy(arg_or(args, 3, "sort_keys", Value::boolean(false)));
    return Value::string(to_json(v, ind, item_sep, key_sep, sort_keys));
  }
  if (name == "trim")
    return Value::string(py_strip(need_string(v, "trim"), args.get(0, "chars"), true, true));
  if (name == "upper") return Value::string(ascii_upper(to_str(v)));
  if (name == "lower") return Value::string(ascii_lower(to_str(v)));
  if (name == "capitalize") {
    std::string s = ascii_lower(to_str(v));
    if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = static_cast<char>(s[0] - 32);
    return Value::string(s);
  }
  if (name == "title") {
    std::string s = to_str(v);
    bool start = true;
    for (char& c : s) {
      const bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
      if (alpha)
        c = start ? static_cast<char>(std::toupper(c)) : static_cast<char>(std::tolower(c));
      start = !alpha;
    }
    return Value::string(s);
  }
  if (name == "first" || name == "last") {
    List items = iterate(v);
    if (items.empty()) return Value::undefined();
    return name == "first" ? items.front() : items.back();
  }
  if (name == "default" || name == "d") {
    const bool boolean = truthy(arg_or(args, 1, "boolean", Value::boolean(false)));
    if (v.is_undefined() || (boolean && !truthy(v)))
      return arg_or(args, 0, "default_value", Value::string(""));
    return v;
  }
  if (name == "join") {
    const std::string sep = to_str(arg_or(args, 0, "d", Value::string("")));
    const Value attr = arg_or(args, 1, "attribute", Value::none());
    std::string out;
    bool first = true;
    for (const Value& x : iterate(v)) {
      if (!first) out += sep;
      out += to_str(attr.is_none() ? x : get_attr(x, to_str(attr)));
      first = false;
    }
    return Value::string(out);
  }
  if (name == "string") return Value::string(to_str(v));
  if (name == "safe") return v;
  if (name == "e" || name == "escape") return Value::string(html_escape(to_str(v)));
  if (name == "int") {
    if (v.is_integer()) return Value::integer(v.as_int());
    if (v.kind == Kind::kFloat) return Value::integer(static_cast<int64_t>(v.f));
    if (v.is_string()) {
      try {
        return Value::integer(std::stoll(v.s));
      } catch (...) {
      }
    }
    return arg_or(args, 0, "default", Value::integer(0));
  }
  if (name == "float") {
    if (v.is_number()) return Value::number(v.as_double());
    if (v.is_string()) {
      try {
        return Value::number(std::stod(v.s));
      } catch (...) {
      }
    }
    return arg_or(args, 0, "default", Value::number(0));
  }
  if (name == "abs")
    return v.is_integer() ? Value::integer(std::llabs(v.as_int()))
                          : Value::number(std::fabs(v.as_double()));
  if (name == "round") {
    const double p = std::pow(
        10.0, static_cast<double>(arg_or(args, 0, "precision", Value::integer(0)).as_int()));
    return Value::number(std::round(v.as_double() * p) / p);
  }
  if (name == "list") return Value::new_list(iterate(v));
  if (name == "items") return call_method(v, "items", args);
  if (name == "replace") {
    Args a = args;
    return call_method(Value::string(to_str(v)), "replace", a);
  }
  if (name == "reverse") {
    if (v.is_string()) {
      auto cs = chars_of(v.s);
      std::string out;
      for (auto it = cs.rbegin(); it != cs.rend(); ++it) out += *it;
      return Value::string(out);
    }
    List items = iterate(v);
    std::reverse(items.begin(), items.end());
    return Value::new_list(std::move(items));
  }
  if (name == "unique") {
    List out;
    for (const Value& x : iterate(v))
      if (std::none_of(out.begin(), out.end(), [&](const Value& y) { return equal(x, y); }))
        out.push_back(x);
    return Value::new_list(std::move(out));
  }
  if (name == "sort") {
    List items = iterate(v);
    const bool reverse = truthy(arg_or(args, 0, "reverse", Value::boolean(false)));
    const Value attr = arg_or(args, 2, "attribute", Value::none());
    auto key = [&](const Value& x) { return attr.is_none() ? x : get_attr(x, to_str(attr)); };
    std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
      return reverse ? compare(key(b), key(a)) < 0 : compare(key(a), key(b)) < 0;
    });
    return Value::new_list(std::move(items));
  }
  if (name == "map") {
    List out;
    const Value* attr = args.get(99, "attribute");
    if (!attr && args.pos.empty())
      fail(ErrorKind::kInvalidArgument, "map() needs a filter or attribute");
    for (const Value& x : iterate(v)) {
      if (attr) {
        out.push_back(get_attr(x, to_str(*attr)));
      } else {
        Args rest;
        rest.pos.assign(args.pos.begin() + 1, args.pos.end());
        const std::string f = to_str(args.pos[0]);
        if (!has_filter(f)) fail(ErrorKind::kUnsupported, "filter '{}' is not supported", f);
        out.push_back(apply_filter(f, x, rest));
      }
    }
    return Value::new_list(std::move(out));
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    const bool attr = name.size() > 6;
    const bool keep_if = name[0] == 's';
    List out;
    for (const Value& x : iterate(v)) {
      size_t k = 0;
      Value item = x;
      if (attr) {
        if (args.pos.empty()) fail(ErrorKind::kInvalidArgument, "{}() needs an attribute", name);
        item = get_attr(x, to_str(args.pos[k++]));
      }
      bool ok;
      if (k < args.pos.size()) {
        const std::string test = to_str(args.pos[k]);
        if (!has_test(test)) fail(ErrorKind::kUnsupported, "test '{}' is not supported", test);
        Args rest;
        rest.pos.assign(args.pos.begin() + static_cast<std::ptrdiff_t>(k) + 1, args.pos.end());
        ok = apply_test(test, item, rest);
      } else {
        ok = truthy(item);
      }
      if (ok == keep_if) out.push_back(x);
    }
    return Value::new_list(std::move(out));
  }
  fail(ErrorKind::kUnsupported, "filter '{}' is not supported", name);
}

bool apply_test(const std::string& name, const Value& v, Args& args) {
  auto arg = [&]() -> const Value& {
    if (args.pos.empty()) fail(ErrorKind::kInvalidArgument, "test '{}' needs an argument", name);
    return args.pos[0];
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.kind == Kind::kBool;
  if (name == "true") return v.kind == Kind::kBool && v.b;
  if (name == "false") return v.kind == Kind::kBool && !v.b;
  if (name == "integer") return v.kind == Kind::kInt;
  if (name == "float") return v.kind == Kind::kFloat;
  if (name == "number") return v.is_number();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_dict() && !v.dict->is_namespace;
  if (name == "iterable")
    return v.is_list() || v.is_string() || (v.is_dict() && !v.dict->is_namespace);
  if (name == "sequence")
    return v.is_list() || v.is_string() || (v.is_dict() && !v.dict->is_namespace);
  if (name == "callable") return v.kind == Kind::kFunction;
  if (name == "escaped") return false;
  if (name == "odd" || name == "even") {
    const int64_t r = v.as_int() % 2;
    return name == "odd" ? r != 0 : r == 0;
  }
  if (name == "divisibleby") return arg().as_int() != 0 && v.as_int() % arg().as_int() == 0;
  if (name == "lower") return v.is_string() && ascii_lower(v.s) == v.s;
  if (name == "upper") return v.is_string() && ascii_upper(v.s) == v.s;
  if (name == "eq" || name == "equalto" || name == "==") return equal(v, arg());
  if (name == "ne" || name == "!=") return !equal(v, arg());
  if (name == "lt" || name == "<") return compare(v, arg()) < 0;
  if (name == "le" || name == "<=") return compare(v, arg()) <= 0;
  if (name == "gt" || name == ">") return compare(v, arg()) > 0;
  if (name == "ge" || name == ">=") return compare(v, arg()) >= 0;
  if (name == "in") return contains(arg(), v);
  if (name == "sameas") {
    const Value& o = arg();
    if (v.kind != o.kind) return false;
    if (v.is_list()) return v.list == o.list;
    if (v.is_dict()) return v.dict == o.dict;
    return equal(v, o);
  }
  fail(ErrorKind::kUnsupported, "test '{}' is not supported", name);
}

Value global_function(std::string_view name) {
  if (name == "namespace" || name == "dict") {
    const bool ns = name == "namespace";
    return Value::function([ns](Args& args) {
      Value d = Value::new_dict();
      d.dict->is_namespace = ns;
      for (const Value& p : args.pos) {  // namespace({...}) / dict({...}) copy a mapping
        if (!p.is_dict()) fail(ErrorKind::kInvalidArgument, "namespace()/dict() takes a mapping");
        for (const auto& [k, x] : p.dict->items) d.dict->set(k, x);
      }
      for (const auto& [k, x] : args.kw) d.dict->set(k, x);
      return d;
    });
  }
  if (name == "range") {
    return Value::function([](Args& args) {
      int64_t start = 0, stop, step = 1;
      if (args.pos.size() == 1) {
        stop = args.pos[0].as_int();
      } else if (args.pos.size() >= 2) {
        start = args.pos[0].as_int();
        stop = args.pos[1].as_int();
        if (args.pos.size() > 2) step = args.pos[2].as_int();
      } else {
        fail(ErrorKind::kInvalidArgument, "range() needs arguments");
      }
      if (step == 0) fail(ErrorKind::kInvalidArgument, "range() step must not be zero");
      List l;
      for (int64_t k = start; step > 0 ? k < stop : k > stop; k += step) {
        if (l.size() > 1000000) fail(ErrorKind::kInvalidArgument, "range() too large");
        l.push_back(Value::integer(k));
      }
      return Value::new_list(std::move(l));
    });
  }
  if (name == "raise_exception") {
    return Value::function([](Args& args) -> Value {
      fail(ErrorKind::kInvalidArgument, "chat template raised an exception: {}",
           args.pos.empty() ? std::string("(no message)") : to_str(args.pos[0]));
    });
  }
  if (name == "strftime_now") {
    return Value::function([](Args& args) {
      const std::string f = args.pos.empty() ? std::string("%Y-%m-%d") : to_str(args.pos[0]);
      std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof buf, f.c_str(), &tm);
      return Value::string(std::string(buf, n));
    });
  }
  return Value::undefined(std::string(name));
}

}  // namespace moe::jinja
