// Built-ins of the chat-template interpreter: the string and dict methods, filters, tests and
// global functions that chat templates use, with Python / Jinja2 semantics. Each claims what it
// builds from the render's budget before building it.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <iterator>
#include <limits>

#include "text/jinja_arith.h"
#include "text/jinja_text.h"
#include "text/jinja_value.h"
#include "text/unicode_util.h"

namespace moe::jinja {

namespace {

using Kind = Value::Kind;

// A list built item by item, each item claimed before it is added.
class ListBuilder {
 public:
  explicit ListBuilder(Budget& budget) : budget_(budget) { budget_.claim(list_bytes(0), "list"); }
  void push(Value v) {
    budget_.grow(list_bytes(items_.size()), kItemBytes, "list");
    items_.push_back(std::move(v));
  }
  Value take() { return Value::new_list(std::move(items_)); }

 private:
  Budget& budget_;
  List items_;
};

Value new_string(Budget& budget, std::string_view s) {
  budget.claim(s.size(), "string");
  return Value::string(std::string(s));
}

bool is_py_space(std::string_view ch) {
  if (ch.size() == 1)
    return ch[0] == ' ' || (ch[0] >= '\t' && ch[0] <= '\r') || (ch[0] >= 0x1C && ch[0] <= 0x1F);
  const size_t n = unicode::utf8_valid_len(ch, 0);
  return n == ch.size() && unicode::is_white_space(unicode::utf8_decode(ch, 0, n));
}

const std::string& need_string(const Value& v, const char* what) {
  if (!v.is_string())
    fail(ErrorKind::kInvalidArgument, "{} expects a string, got {}", what, v.type_name());
  return v.str();
}

// Python str.strip / lstrip / rstrip, as a view into s.
std::string_view py_strip(Budget& budget, std::string_view s, const Value* chars, bool left,
                          bool right) {
  std::vector<std::string_view> set;  // the characters to strip, unless whitespace
  const bool whitespace = !chars || chars->is_none() || chars->is_undefined();
  if (!whitespace) {
    if (!chars->is_string()) fail(ErrorKind::kInvalidArgument, "strip arg must be None or str");
    const std::string& cs = chars->str();
    budget.chars(cs.size());
    budget.claim(saturating_mul(text::count_chars(cs), sizeof(std::string_view)), "list");
    for (size_t i = 0; i < cs.size(); i += text::char_len(cs, i))
      set.push_back(std::string_view(cs).substr(i, text::char_len(cs, i)));
  }
  size_t checked = 0;  // characters looked at, charged when done
  auto strip_this = [&](std::string_view c) {
    ++checked;
    if (whitespace) return is_py_space(c);
    if (set.size() >= 16) budget.step(set.size() / 16);  // a long set is charged as it goes
    return std::find(set.begin(), set.end(), c) != set.end();
  };
  size_t b = 0, e = s.size();
  if (left)
    while (b < e && strip_this(s.substr(b, text::char_len(s, b)))) b += text::char_len(s, b);
  if (right) {
    while (e > b) {
      const size_t p = text::char_start_before(s, e);
      if (!strip_this(s.substr(p, e - p))) break;
      e = p;
    }
  }
  budget.chars(checked);
  return s.substr(b, e - b);
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

Value arg_or(const Args& args, size_t index, std::string_view name, Value fallback) {
  const Value* v = args.get(index, name);
  return v ? *v : fallback;
}

Value py_split(Budget& budget, const std::string& s, const Value* sep, int64_t maxsplit) {
  ListBuilder out(budget);
  int64_t pieces = 0;
  if (!sep || sep->is_none()) {
    budget.chars(s.size());
    const std::string_view sv(s);
    size_t k = 0;
    auto space_at = [&](size_t i) { return is_py_space(sv.substr(i, text::char_len(sv, i))); };
    while (k < sv.size()) {
      while (k < sv.size() && space_at(k)) k += text::char_len(sv, k);
      if (k == sv.size()) break;
      if (maxsplit >= 0 && pieces == maxsplit) {  // the rest as it is, as Python
        out.push(new_string(budget, sv.substr(k)));
        break;
      }
      size_t e = k;
      while (e < sv.size() && !space_at(e)) e += text::char_len(sv, e);
      out.push(new_string(budget, sv.substr(k, e - k)));
      ++pieces;
      k = e;
    }
    return out.take();
  }
  const std::string& d = need_string(*sep, "split");
  if (d.empty()) fail(ErrorKind::kInvalidArgument, "split: empty separator");
  budget.scan(s.size());
  size_t start = 0;
  while (maxsplit < 0 || pieces < maxsplit) {
    const size_t p = text::find(s, d, start);
    if (p == std::string::npos) break;
    out.push(new_string(budget, std::string_view(s).substr(start, p - start)));
    ++pieces;
    start = p + d.size();
  }
  out.push(new_string(budget, std::string_view(s).substr(start)));
  return out.take();
}

bool starts_or_ends(Budget& budget, const std::string& s, const Value& arg, bool start) {
  auto one = [&](const std::string& x) {
    budget.scan(x.size());
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

// Python str.replace; count < 0 replaces all. The result's size is known before it is built.
std::string py_replace(Budget& budget, const std::string& s, const std::string& a,
                       const std::string& b, int64_t count) {
  const uint64_t limit = count < 0 ? UINT64_MAX : static_cast<uint64_t>(count);
  if (a.empty()) {  // Python inserts b before every character and at the end
    budget.chars(saturating_mul(s.size(), 2));  // counting, then copying
    const uint64_t n = std::min<uint64_t>(limit, text::count_chars(s) + 1);
    const size_t size = saturating_add(s.size(), saturating_mul(n, b.size()));
    budget.claim(size, "string");
    std::string out;
    out.reserve(size);
    uint64_t done = 0;
    for (size_t i = 0; i < s.size(); i += text::char_len(s, i)) {
      if (done < n) {
        out += b;
        ++done;
      }
      out.append(s, i, text::char_len(s, i));
    }
    if (done < n) out += b;
    return out;
  }
  budget.scan(s.size());
  std::vector<size_t> hits;
  for (size_t p = text::find(s, a); p != std::string::npos && hits.size() < limit;
       p = text::find(s, a, p + a.size())) {
    budget.grow(hits.size() * sizeof(size_t), sizeof(size_t), "list");
    hits.push_back(p);
  }
  const size_t size =
      b.size() >= a.size()
          ? saturating_add(s.size(), saturating_mul(hits.size(), b.size() - a.size()))
          : s.size() - hits.size() * (a.size() - b.size());
  budget.claim(size, "string");
  std::string out;
  out.reserve(size);
  size_t start = 0;
  for (size_t p : hits) {
    out.append(s, start, p - start);
    out += b;
    start = p + a.size();
  }
  out.append(s, start, std::string::npos);
  return out;
}

std::string html_escape(Budget& budget, const std::string& s) {
  auto escape = [](char c) -> std::string_view {
    switch (c) {
      case '&':
        return "&amp;";
      case '<':
        return "&lt;";
      case '>':
        return "&gt;";
      case '"':
        return "&#34;";
      case '\'':
        return "&#39;";
      default:
        return {};
    }
  };
  size_t size = 0;
  for (char c : s) size += escape(c).empty() ? 1 : escape(c).size();
  budget.claim(size, "string");
  std::string out;
  out.reserve(size);
  for (char c : s) {
    const std::string_view e = escape(c);
    if (e.empty())
      out += c;
    else
      out += e;
  }
  return out;
}

// Python's int(str): surrounding whitespace, a sign, digits with single underscores between them.
// Returns false when s is not such a number; fails when it is one beyond 64 bits.
bool parse_int(std::string_view s, int64_t& out) {
  while (!s.empty() && is_py_space(s.substr(0, 1))) s.remove_prefix(1);
  while (!s.empty() && is_py_space(s.substr(s.size() - 1))) s.remove_suffix(1);
  bool negative = false;
  if (!s.empty() && (s[0] == '+' || s[0] == '-')) {
    negative = s[0] == '-';
    s.remove_prefix(1);
  }
  if (s.empty() || s.front() == '_' || s.back() == '_') return false;
  // Accumulated as a negative number, whose range includes INT64_MIN.
  int64_t v = 0;
  for (size_t k = 0; k < s.size(); ++k) {
    if (s[k] == '_' && s[k - 1] != '_') continue;
    if (s[k] < '0' || s[k] > '9') return false;
    if (__builtin_mul_overflow(v, 10, &v) || __builtin_sub_overflow(v, s[k] - '0', &v) ||
        (!negative && v == std::numeric_limits<int64_t>::min()))
      fail(ErrorKind::kUnsupported, "integer overflow: int('{}') does not fit in 64 bits",
           s.substr(0, 40));
  }
  out = negative ? v : -v;
  return true;
}

// Python's float(str): decimal notation, inf, infinity and nan (no hex, no C99 extensions).
bool parse_float(std::string_view s, double& out) {
  bool underscores = false;
  for (size_t k = 0; k < s.size(); ++k) {
    const char c = s[k];
    if (c == '_') {  // only between digits
      if (k == 0 || k + 1 == s.size() || !std::isdigit(static_cast<unsigned char>(s[k - 1])) ||
          !std::isdigit(static_cast<unsigned char>(s[k + 1])))
        return false;
      underscores = true;
    } else if (c == '\0' ||
               (!std::isdigit(static_cast<unsigned char>(c)) && !std::strchr("+-.eE", c) &&
                !is_py_space(s.substr(k, 1)) && !std::strchr("infatyINFATY", c))) {
      return false;  // also rules out strtod's hex and nan(...) forms
    }
  }
  std::string clean;
  if (underscores)
    std::copy_if(s.begin(), s.end(), std::back_inserter(clean), [](char c) { return c != '_'; });
  else
    clean = s;
  const char* begin = clean.c_str();
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(begin, &end);  // ERANGE: +-inf or 0, as Python
  if (end == begin) return false;
  while (*end && is_py_space(std::string_view(end, 1))) ++end;
  if (*end) return false;
  out = v;
  return true;
}

Value round_filter(const Value& v, int64_t precision) {
  const double x = v.as_double();
  if (!std::isfinite(x)) return Value::number(x);
  // Past 10^308 the scale is inf or 0: every digit is kept, or none is.
  if (precision > 308) return Value::number(x);
  if (precision < -308) return Value::number(std::copysign(0.0, x));
  const double scale = std::pow(10.0, static_cast<double>(precision));
  const double scaled = x * scale;
  if (!std::isfinite(scaled)) return Value::number(x);
  return Value::number(std::round(scaled) / scale);
}

}  // namespace

Value call_method(Budget& budget, const Value& obj, const std::string& name, Args& args) {
  if (obj.is_undefined())
    fail(ErrorKind::kInvalidArgument, "'{}' is undefined (calling .{}())",
         obj.str().empty() ? "value" : obj.str(), name);
  if (obj.is_string()) {
    const std::string& s = obj.str();
    if (name == "startswith" || name == "endswith") {
      const Value* a = args.get(0, "prefix");
      if (!a) fail(ErrorKind::kInvalidArgument, "{}() needs an argument", name);
      return Value::boolean(starts_or_ends(budget, s, *a, name == "startswith"));
    }
    if (name == "strip" || name == "lstrip" || name == "rstrip")
      return new_string(
          budget, py_strip(budget, s, args.get(0, "chars"), name != "rstrip", name != "lstrip"));
    if (name == "split") {
      const Value* mx = args.get(1, "maxsplit");
      return py_split(budget, s, args.get(0, "sep"), mx ? mx->as_int() : -1);
    }
    if (name == "upper") return Value::string(ascii_upper(to_str(budget, obj)));
    if (name == "lower") return Value::string(ascii_lower(to_str(budget, obj)));
    if (name == "title" || name == "capitalize") return apply_filter(budget, name, obj, args);
    if (name == "replace") {
      const Value* a = args.get(0, "old");
      const Value* b = args.get(1, "new");
      if (!a || !b) fail(ErrorKind::kInvalidArgument, "replace() needs two arguments");
      const Value* c = args.get(2, "count");
      return Value::string(py_replace(budget, s, need_string(*a, "replace"),
                                      need_string(*b, "replace"), c ? c->as_int() : -1));
    }
    if (name == "find" || name == "count") {
      const Value* a = args.get(0, "sub");
      if (!a) fail(ErrorKind::kInvalidArgument, "{}() needs an argument", name);
      const std::string& sub = need_string(*a, name.c_str());
      budget.scan(s.size());
      if (name == "find") {
        const size_t p = text::find(s, sub);
        if (p != std::string::npos) budget.chars(p);
        return Value::integer(p == std::string::npos ? -1
                                                     : static_cast<int64_t>(text::count_chars(
                                                           std::string_view(s).substr(0, p))));
      }
      if (sub.empty()) {
        budget.chars(s.size());
        return Value::integer(static_cast<int64_t>(text::count_chars(s) + 1));
      }
      int64_t n = 0;
      for (size_t p = text::find(s, sub); p != std::string::npos;
           p = text::find(s, sub, p + sub.size())) {
        budget.step();  // a search per occurrence
        ++n;
      }
      return Value::integer(n);
    }
    if (name == "join") {
      const Value* a = args.get(0, "iterable");
      if (!a) fail(ErrorKind::kInvalidArgument, "join() needs an argument");
      TextBuilder out(budget);
      bool first = true;
      for (const Value& x : iterate(budget, *a)) {
        if (!first) out.append(s);
        out.append(need_string(x, "join"));
        first = false;
      }
      return Value::string(out.take());
    }
    if (name == "splitlines") {
      ListBuilder lines(budget);
      budget.scan(s.size());
      size_t start = 0;
      for (size_t k = 0; k < s.size(); ++k) {
        if (s[k] == '\n' || s[k] == '\r') {
          lines.push(new_string(budget, std::string_view(s).substr(start, k - start)));
          if (s[k] == '\r' && k + 1 < s.size() && s[k + 1] == '\n') ++k;
          start = k + 1;
        }
      }
      if (start < s.size()) lines.push(new_string(budget, std::string_view(s).substr(start)));
      return lines.take();
    }
    if (name == "isspace" || name == "isdigit" || name == "isalpha" || name == "isalnum") {
      if (s.empty()) return Value::boolean(false);
      budget.scan(s.size());
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
    const auto& items = obj.dict->items;
    if (name == "items") {
      ListBuilder l(budget);
      for (const auto& [k, x] : items) {
        budget.claim(list_bytes(2), "list");
        l.push(Value::new_list({new_string(budget, k), x}));
      }
      return l.take();
    }
    if (name == "keys") return Value::new_list(iterate(budget, obj));
    if (name == "values") {
      ListBuilder l(budget);
      for (const auto& kv : items) l.push(kv.second);
      return l.take();
    }
    if (name == "get") {
      const Value* k = args.get(0, "key");
      if (!k) fail(ErrorKind::kInvalidArgument, "get() needs a key");
      if (k->is_string()) {
        budget.step(items.size() / 16);
        if (const Value* v = obj.dict->find(k->str())) return *v;
      }
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

Value apply_filter(Budget& budget, const std::string& name, const Value& v, Args& args) {
  Budget::Nest nest(budget);  // map() applies filters, map() among them
  if (name == "length" || name == "count")
    return Value::integer(static_cast<int64_t>(py_len(budget, v)));
  if (name == "tojson") {
    // transformers: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
    if (truthy(arg_or(args, 0, "ensure_ascii", Value::boolean(false))))
      fail(ErrorKind::kUnsupported, "tojson with ensure_ascii=True is not supported");
    const Value indent = arg_or(args, 1, "indent", Value::none());
    const int64_t ind = indent.is_none() ? -1 : indent.as_int();
    std::string item_sep = ind >= 0 ? "," : ", ", key_sep = ": ";
    if (const Value* sep = args.get(2, "separators");
        sep && sep->is_list() && sep->list->size() == 2) {
      item_sep = need_string((*sep->list)[0], "tojson separators");
      key_sep = need_string((*sep->list)[1], "tojson separators");
    }
    const bool sort_keys = truthy(arg_or(args, 3, "sort_keys", Value::boolean(false)));
    return Value::string(to_json(budget, v, ind, item_sep, key_sep, sort_keys));
  }
  if (name == "trim")
    return new_string(budget,
                      py_strip(budget, need_string(v, "trim"), args.get(0, "chars"), true, true));
  if (name == "upper") return Value::string(ascii_upper(to_str(budget, v)));
  if (name == "lower") return Value::string(ascii_lower(to_str(budget, v)));
  if (name == "capitalize") {
    std::string s = ascii_lower(to_str(budget, v));
    if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = static_cast<char>(s[0] - 32);
    return Value::string(s);
  }
  if (name == "title") {
    std::string s = to_str(budget, v);
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
    const bool first = name == "first";
    if (v.is_list()) {
      if (v.list->empty()) return Value::undefined();
      return first ? v.list->front() : v.list->back();
    }
    if (v.is_dict()) {
      if (v.dict->items.empty()) return Value::undefined();
      return new_string(budget, first ? v.dict->items.front().first : v.dict->items.back().first);
    }
    if (v.is_string()) {
      const std::string& s = v.str();
      if (s.empty()) return Value::undefined();
      const size_t at = first ? 0 : text::char_start_before(s, s.size());
      return new_string(budget, std::string_view(s).substr(at, text::char_len(s, at)));
    }
    iterate(budget, v);  // fails, naming what is not iterable
    return Value::undefined();
  }
  if (name == "default" || name == "d") {
    const bool boolean = truthy(arg_or(args, 1, "boolean", Value::boolean(false)));
    if (v.is_undefined() || (boolean && !truthy(v)))
      return arg_or(args, 0, "default_value", Value::string(""));
    return v;
  }
  if (name == "join") {
    const std::string sep = to_str(budget, arg_or(args, 0, "d", Value::string("")));
    const Value attr = arg_or(args, 1, "attribute", Value::none());
    TextBuilder out(budget);
    bool first = true;
    for (const Value& x : iterate(budget, v)) {
      if (!first) out.append(sep);
      const Value item = attr.is_none() ? x : get_attr(budget, x, to_str(budget, attr));
      if (item.is_string())
        out.append(item.str());
      else
        out.append(to_str(budget, item));
      first = false;
    }
    return Value::string(out.take());
  }
  if (name == "string") return Value::string(to_str(budget, v));
  if (name == "safe") return v;
  if (name == "e" || name == "escape") return Value::string(html_escape(budget, to_str(budget, v)));
  if (name == "int") {
    // Jinja2: int(v), else int(float(v)), else the default. int() of a float nan gives the
    // default, of a float inf raises; a string's inf or nan gives the default.
    const Value fallback = arg_or(args, 0, "default", Value::integer(0));
    if (v.is_integer()) return Value::integer(v.as_int());
    if (v.kind == Kind::kFloat)
      return std::isnan(v.f) ? fallback : Value::integer(float_to_int(v.f));
    if (!v.is_string()) return fallback;
    budget.chars(v.str().size());
    int64_t i;
    double d;
    if (parse_int(v.str(), i)) return Value::integer(i);
    if (!parse_float(v.str(), d) || !std::isfinite(d)) return fallback;
    return Value::integer(float_to_int(d));
  }
  if (name == "float") {
    if (v.is_number()) return Value::number(v.as_double());
    if (v.is_string()) {
      budget.chars(v.str().size());
      if (double d; parse_float(v.str(), d)) return Value::number(d);
    }
    return arg_or(args, 0, "default", Value::number(0));
  }
  if (name == "abs")
    return v.is_integer() ? Value::integer(int_abs(v.as_int()))
                          : Value::number(std::fabs(v.as_double()));
  if (name == "round")
    return round_filter(v, arg_or(args, 0, "precision", Value::integer(0)).as_int());
  if (name == "list") return Value::new_list(iterate(budget, v));
  if (name == "items") return call_method(budget, v, "items", args);
  if (name == "replace") {
    Args a = args;
    return call_method(budget, Value::string(to_str(budget, v)), "replace", a);
  }
  if (name == "reverse") {
    if (v.is_string()) {
      const std::string& s = v.str();
      budget.chars(s.size());
      budget.claim(s.size(), "string");
      std::string out;
      out.reserve(s.size());
      for (size_t e = s.size(); e > 0;) {
        const size_t p = text::char_start_before(s, e);
        out.append(s, p, e - p);
        e = p;
      }
      return Value::string(std::move(out));
    }
    List items = iterate(budget, v);
    std::reverse(items.begin(), items.end());
    return Value::new_list(std::move(items));
  }
  if (name == "unique") {
    ListBuilder out(budget);
    List seen;
    for (const Value& x : iterate(budget, v)) {
      if (std::none_of(seen.begin(), seen.end(),
                       [&](const Value& y) { return equal(budget, x, y); })) {
        out.push(x);
        seen.push_back(x);
      }
    }
    return out.take();
  }
  if (name == "sort") {
    List items = iterate(budget, v);
    const bool reverse = truthy(arg_or(args, 0, "reverse", Value::boolean(false)));
    const Value attr = arg_or(args, 2, "attribute", Value::none());
    const std::string attr_name = attr.is_none() ? std::string() : to_str(budget, attr);
    auto key = [&](const Value& x) { return attr.is_none() ? x : get_attr(budget, x, attr_name); };
    std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) {
      return reverse ? compare(budget, key(b), key(a)) < 0 : compare(budget, key(a), key(b)) < 0;
    });
    return Value::new_list(std::move(items));
  }
  if (name == "map") {
    ListBuilder out(budget);
    const Value* attr = args.get(SIZE_MAX, "attribute");  // keyword only
    if (!attr && args.pos.empty())
      fail(ErrorKind::kInvalidArgument, "map() needs a filter or attribute");
    for (const Value& x : iterate(budget, v)) {
      budget.step();
      if (attr) {
        out.push(get_attr(budget, x, to_str(budget, *attr)));
      } else {
        Args rest;
        rest.pos.assign(args.pos.begin() + 1, args.pos.end());
        const std::string f = to_str(budget, args.pos[0]);
        if (!has_filter(f)) fail(ErrorKind::kUnsupported, "filter '{}' is not supported", f);
        out.push(apply_filter(budget, f, x, rest));
      }
    }
    return out.take();
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    const bool attr = name.size() > 6;
    const bool keep_if = name[0] == 's';
    ListBuilder out(budget);
    for (const Value& x : iterate(budget, v)) {
      budget.step();
      size_t k = 0;
      Value item = x;
      if (attr) {
        if (args.pos.empty()) fail(ErrorKind::kInvalidArgument, "{}() needs an attribute", name);
        item = get_attr(budget, x, to_str(budget, args.pos[k++]));
      }
      bool ok;
      if (k < args.pos.size()) {
        const std::string test = to_str(budget, args.pos[k]);
        if (!has_test(test)) fail(ErrorKind::kUnsupported, "test '{}' is not supported", test);
        Args rest;
        rest.pos.assign(args.pos.begin() + static_cast<std::ptrdiff_t>(k) + 1, args.pos.end());
        ok = apply_test(budget, test, item, rest);
      } else {
        ok = truthy(item);
      }
      if (ok == keep_if) out.push(x);
    }
    return out.take();
  }
  fail(ErrorKind::kUnsupported, "filter '{}' is not supported", name);
}

bool apply_test(Budget& budget, const std::string& name, const Value& v, Args& args) {
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
    const int64_t r = int_mod(v.as_int(), 2);
    return name == "odd" ? r != 0 : r == 0;
  }
  if (name == "divisibleby") return arg().as_int() != 0 && int_mod(v.as_int(), arg().as_int()) == 0;
  if (name == "lower" || name == "upper") {  // no ASCII letter of the other case
    if (!v.is_string()) return false;
    budget.scan(v.str().size());
    const char from = name == "lower" ? 'A' : 'a';
    return std::none_of(v.str().begin(), v.str().end(),
                        [&](char c) { return c >= from && c <= from + 25; });
  }
  if (name == "eq" || name == "equalto" || name == "==") return equal(budget, v, arg());
  if (name == "ne" || name == "!=") return !equal(budget, v, arg());
  if (name == "lt" || name == "<") return compare(budget, v, arg()) < 0;
  if (name == "le" || name == "<=") return compare(budget, v, arg()) <= 0;
  if (name == "gt" || name == ">") return compare(budget, v, arg()) > 0;
  if (name == "ge" || name == ">=") return compare(budget, v, arg()) >= 0;
  if (name == "in") return contains(budget, arg(), v);
  if (name == "sameas") {
    const Value& o = arg();
    if (v.kind != o.kind) return false;
    if (v.is_list()) return v.list == o.list;
    if (v.is_dict()) return v.dict == o.dict;
    return equal(budget, v, o);
  }
  fail(ErrorKind::kUnsupported, "test '{}' is not supported", name);
}

Value global_function(std::string_view name) {
  if (name == "namespace" || name == "dict") {
    const bool ns = name == "namespace";
    return Value::function([ns](Budget& budget, Args& args) {
      Value d = Value::new_dict();
      d.dict->is_namespace = ns;
      for (const Value& p : args.pos) {  // namespace({...}) / dict({...}) copy a mapping
        if (!p.is_dict()) fail(ErrorKind::kInvalidArgument, "namespace()/dict() takes a mapping");
        budget.claim(dict_bytes(p.dict->items.size()), "dict");
        for (const auto& [k, x] : p.dict->items) d.dict->set(k, x);
      }
      budget.claim(dict_bytes(args.kw.size()), "dict");
      for (const auto& [k, x] : args.kw) d.dict->set(k, x);
      budget.check_nesting(d.nesting());
      if (ns) budget.track_namespace(d.dict);
      return d;
    });
  }
  if (name == "range") {
    return Value::function([](Budget& budget, Args& args) {
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
      const uint64_t n = range_length(start, stop, step);
      budget.claim(list_bytes(n), "list");
      List l;
      l.reserve(n);
      int64_t k = start;
      for (uint64_t taken = 0; taken < n; ++taken) {
        l.push_back(Value::integer(k));
        if (taken + 1 < n) k += step;  // stays between start and stop: no overflow
      }
      return Value::new_list(std::move(l));
    });
  }
  if (name == "raise_exception") {
    return Value::function([](Budget& budget, Args& args) -> Value {
      fail(ErrorKind::kInvalidArgument, "chat template raised an exception: {}",
           args.pos.empty() ? std::string("(no message)") : to_str(budget, args.pos[0]));
    });
  }
  if (name == "strftime_now") {
    return Value::function([](Budget& budget, Args& args) {
      const std::string f =
          args.pos.empty() ? std::string("%Y-%m-%d") : to_str(budget, args.pos[0]);
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
