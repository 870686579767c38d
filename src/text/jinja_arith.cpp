// Checked integer and float arithmetic (see jinja_arith.h) and the binary operators built on it.
#include "text/jinja_arith.h"

#include <cmath>
#include <limits>

#include "text/jinja_value.h"

namespace moe::jinja {

namespace {

constexpr int64_t kMin = std::numeric_limits<int64_t>::min();

[[noreturn]] void overflow(int64_t a, const char* op, int64_t b) {
  fail(ErrorKind::kUnsupported, "integer overflow: {} {} {} does not fit in 64 bits", a, op, b);
}

}  // namespace

int64_t int_add(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) overflow(a, "+", b);
  return r;
}

int64_t int_sub(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_sub_overflow(a, b, &r)) overflow(a, "-", b);
  return r;
}

int64_t int_mul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) overflow(a, "*", b);
  return r;
}

int64_t int_neg(int64_t a) {
  if (a == kMin)
    fail(ErrorKind::kUnsupported, "integer overflow: -({}) does not fit in 64 bits", a);
  return -a;
}

int64_t int_abs(int64_t a) {
  if (a == kMin)
    fail(ErrorKind::kUnsupported, "integer overflow: abs({}) does not fit in 64 bits", a);
  return a < 0 ? -a : a;
}

int64_t int_floordiv(int64_t a, int64_t b) {
  if (b == 0) fail(ErrorKind::kInvalidArgument, "integer division or modulo by zero");
  if (a == kMin && b == -1) overflow(a, "//", b);  // 2**63; C++'s a / b would trap
  int64_t q = a / b;
  if (a % b != 0 && ((a % b < 0) != (b < 0))) --q;
  return q;
}

int64_t int_mod(int64_t a, int64_t b) {
  if (b == 0) fail(ErrorKind::kInvalidArgument, "integer division or modulo by zero");
  if (b == -1) return 0;  // also for kMin, where C++'s a % b would trap
  int64_t r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

int64_t int_pow(int64_t a, int64_t b) {
  int64_t result = 1, base = a;
  for (int64_t e = b; e > 0;) {
    // Any overflow here is a real one: the final result is a multiple of it (or of its square).
    if ((e & 1) && __builtin_mul_overflow(result, base, &result)) overflow(a, "**", b);
    e >>= 1;
    if (e && __builtin_mul_overflow(base, base, &base)) overflow(a, "**", b);
  }
  return result;
}

double float_floordiv(double a, double b) {
  if (b == 0) fail(ErrorKind::kInvalidArgument, "float floor division by zero");
  // As Python: from the exact remainder, so that a == q * b + r holds as closely as it can.
  double r = std::fmod(a, b);
  double q = (a - r) / b;
  if (r != 0 && ((r < 0) != (b < 0))) q -= 1.0;
  if (q == 0) return std::copysign(0.0, a / b);
  const double fq = std::floor(q);
  return q - fq > 0.5 ? fq + 1.0 : fq;
}

double float_mod(double a, double b) {
  if (b == 0) fail(ErrorKind::kInvalidArgument, "float modulo by zero");
  double r = std::fmod(a, b);
  if (r == 0) return std::copysign(0.0, b);
  if ((r < 0) != (b < 0)) r += b;
  return r;
}

double float_pow(double a, double b) {
  if (b == 0) return 1.0;
  if (a == 0 && b < 0)
    fail(ErrorKind::kInvalidArgument, "0.0 cannot be raised to a negative power");
  if (a < 0 && std::isfinite(a) && std::isfinite(b) && b != std::floor(b))
    fail(ErrorKind::kUnsupported, "{} ** {} is a complex number", a, b);
  const double r = std::pow(a, b);
  if (std::isinf(r) && std::isfinite(a) && std::isfinite(b))
    fail(ErrorKind::kInvalidArgument, "float overflow: {} ** {} is out of range", a, b);
  return r;
}

int64_t float_to_int(double x) {
  if (std::isnan(x)) fail(ErrorKind::kInvalidArgument, "cannot convert float NaN to integer");
  if (std::isinf(x)) fail(ErrorKind::kInvalidArgument, "cannot convert float infinity to integer");
  const double t = std::trunc(x);
  // -2**63 is exact in a double; 2**63 is the first value beyond int64.
  if (t < -9223372036854775808.0 || t >= 9223372036854775808.0)
    fail(ErrorKind::kUnsupported, "integer overflow: int({}) does not fit in 64 bits", x);
  return static_cast<int64_t>(t);
}

uint64_t range_length(int64_t start, int64_t stop, int64_t step) {
  // Differences and |step| in unsigned arithmetic, where they cannot overflow.
  if (step > 0)
    return start < stop ? (static_cast<uint64_t>(stop) - static_cast<uint64_t>(start) - 1) /
                                  static_cast<uint64_t>(step) +
                              1
                        : 0;
  const uint64_t magnitude = uint64_t{0} - static_cast<uint64_t>(step);
  return start > stop
             ? (static_cast<uint64_t>(start) - static_cast<uint64_t>(stop) - 1) / magnitude + 1
             : 0;
}

namespace {

Value concat_strings(Budget& budget, const Value& a, const Value& b) {
  std::string sa, sb;
  const std::string& x = a.is_string() ? a.str() : (sa = to_str(budget, a));
  const std::string& y = b.is_string() ? b.str() : (sb = to_str(budget, b));
  budget.claim(saturating_add(x.size(), y.size()), "string");
  std::string r;
  r.reserve(x.size() + y.size());
  r += x;
  r += y;
  return Value::string(std::move(r));
}

// s * n and l * n: the size is claimed before anything is copied.
Value repeat(Budget& budget, const Value& seq, int64_t count) {
  const size_t n = count > 0 ? static_cast<size_t>(count) : 0;
  if (seq.is_string()) {
    const std::string& s = seq.str();
    budget.claim(saturating_mul(s.size(), n), "string");
    std::string r;
    r.reserve(s.size() * n);
    for (size_t k = 0; k < n; ++k) r += s;
    return Value::string(std::move(r));
  }
  const List& items = *seq.list;
  budget.claim(list_bytes(saturating_mul(items.size(), n)), "list");
  List r;
  r.reserve(items.size() * n);
  for (size_t k = 0; k < n; ++k) r.insert(r.end(), items.begin(), items.end());
  return Value::new_list(std::move(r));
}

}  // namespace

Value binary_op(Budget& budget, const std::string& op, const Value& a, const Value& b) {
  if (op == "~") return concat_strings(budget, a, b);
  if (op == "+") {
    if (a.is_string() && b.is_string()) return concat_strings(budget, a, b);
    if (a.is_list() && b.is_list()) {
      budget.claim(list_bytes(a.list->size() + b.list->size()), "list");
      List l;
      l.reserve(a.list->size() + b.list->size());
      l.insert(l.end(), a.list->begin(), a.list->end());
      l.insert(l.end(), b.list->begin(), b.list->end());
      return Value::new_list(std::move(l));
    }
  }
  if (op == "*") {
    if ((a.is_string() || a.is_list()) && b.is_integer()) return repeat(budget, a, b.as_int());
    if (a.is_integer() && (b.is_string() || b.is_list())) return repeat(budget, b, a.as_int());
  }
  if (!a.is_number() || !b.is_number())
    fail(ErrorKind::kInvalidArgument, "unsupported operand types for {}: {} and {}", op,
         a.type_name(), b.type_name());
  if (op == "/") {
    if (b.as_double() == 0) fail(ErrorKind::kInvalidArgument, "division by zero");
    return Value::number(a.as_double() / b.as_double());
  }
  if (a.is_integer() && b.is_integer()) {
    const int64_t x = a.as_int(), y = b.as_int();
    if (op == "+") return Value::integer(int_add(x, y));
    if (op == "-") return Value::integer(int_sub(x, y));
    if (op == "*") return Value::integer(int_mul(x, y));
    if (op == "//") return Value::integer(int_floordiv(x, y));
    if (op == "%") return Value::integer(int_mod(x, y));
    if (op == "**" && y >= 0) return Value::integer(int_pow(x, y));
    // x ** -y is a float in Python, as below.
  }
  const double x = a.as_double(), y = b.as_double();
  if (op == "+") return Value::number(x + y);
  if (op == "-") return Value::number(x - y);
  if (op == "*") return Value::number(x * y);
  if (op == "//") return Value::number(float_floordiv(x, y));
  if (op == "%") return Value::number(float_mod(x, y));
  if (op == "**") return Value::number(float_pow(x, y));
  fail(ErrorKind::kUnsupported, "operator '{}' is not supported", op);
}

Value negate(const Value& v) {
  if (v.is_integer()) return Value::integer(int_neg(v.as_int()));
  return Value::number(-v.as_double());
}

}  // namespace moe::jinja
