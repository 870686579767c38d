// Lexer and parser of the chat-template interpreter (see jinja.h). The whitespace rules follow
// Jinja2 with trim_blocks=True and lstrip_blocks=True (what transformers uses), the operator
// precedence follows jinja2/parser.py. Nesting is bounded (see parse_template in jinja_ast.h), so
// neither the parser's recursion nor, later, the evaluator's can run out of stack.
#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>

#include "text/jinja_ast.h"
#include "text/unicode_util.h"

namespace moe::jinja {

namespace {

// ---------------------------------------------------------------------------------------------
// Source -> chunks of text, {{ expressions }} and {% statements %}, whitespace control applied.

struct Chunk {
  enum class K { kText, kVar, kBlock } k;
  std::string text;
  int line;
};

bool is_space(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

std::string normalize_newlines(std::string_view src) {
  std::string s;
  s.reserve(src.size());
  for (size_t i = 0; i < src.size(); ++i) {
    if (src[i] == '\r') {
      s += '\n';
      if (i + 1 < src.size() && src[i + 1] == '\n') ++i;
    } else {
      s += src[i];
    }
  }
  if (!s.empty() && s.back() == '\n') s.pop_back();  // keep_trailing_newline=False
  return s;
}

std::vector<Chunk> split_source(const std::string& src) {
  std::vector<Chunk> out;
  const size_t n = src.size();
  size_t pos = 0;
  bool line_starting = true;
  int line = 1;
  size_t line_pos = 0;
  auto line_of = [&](size_t p) {
    for (; line_pos < p; ++line_pos)
      if (src[line_pos] == '\n') ++line;
    return line;
  };
  while (pos < n) {
    size_t t = pos;
    while ((t = src.find('{', t)) != std::string::npos) {
      if (t + 1 < n && (src[t + 1] == '{' || src[t + 1] == '%' || src[t + 1] == '#')) break;
      ++t;
    }
    if (t == std::string::npos) {
      out.push_back({Chunk::K::kText, src.substr(pos), line_of(pos)});
      break;
    }
    const char kind = src[t + 1];
    char sign = t + 2 < n ? src[t + 2] : 0;
    if (sign != '-' && !(sign == '+' && kind != '{')) sign = 0;
    std::string text = src.substr(pos, t - pos);
    if (sign == '-') {
      while (!text.empty() && is_space(text.back())) text.pop_back();
    } else if (sign != '+' && kind != '{') {
      // lstrip_blocks: drop spaces and tabs between the start of the line and a block tag.
      const size_t l_pos = text.rfind('\n') + 1;  // 0 when there is no newline
      if ((l_pos > 0 || line_starting) && l_pos < text.size()) {
        bool blank = true;
        for (size_t k = l_pos; k < text.size(); ++k) blank = blank && is_space(text[k]);
        if (blank) text.resize(l_pos);
      }
    }
    if (!text.empty()) out.push_back({Chunk::K::kText, std::move(text), line_of(pos)});
    const int tag_line = line_of(t);
    const size_t body = t + 2 + (sign ? 1 : 0);
    size_t end = std::string::npos;
    if (kind == '#') {
      end = src.find("#}", body);
    } else {
      const char close = kind == '{' ? '}' : '%';
      int depth = 0;
      for (size_t k = body; k + 1 < n; ++k) {
        const char c = src[k];
        if (c == '\'' || c == '"') {
          for (++k; k < n && src[k] != c; ++k)
            if (src[k] == '\\') ++k;
          continue;
        }
        if (depth == 0 && c == close && src[k + 1] == '}') {
          end = k;
          break;
        }
        if (c == '(' || c == '[' || c == '{')
          ++depth;
        else if ((c == ')' || c == ']' || c == '}') && depth > 0)
          --depth;
      }
    }
    if (end == std::string::npos)
      fail(ErrorKind::kUnsupported, "line {}: unclosed '{{{}' tag", tag_line, kind);
    char end_sign = 0;
    if (end > body && (src[end - 1] == '-' || (src[end - 1] == '+' && kind != '{')))
      end_sign = src[end - 1];
    std::string content = src.substr(body, end - body - (end_sign ? 1 : 0));
    size_t after = end + 2;
    if (end_sign == '-') {
      while (after < n && is_space(src[after])) ++after;
    } else if (kind != '{' && end_sign != '+' && after < n && src[after] == '\n') {
      ++after;  // trim_blocks
    }
    line_starting = src[after - 1] == '\n';
    if (kind != '#')
      out.push_back(
          {kind == '{' ? Chunk::K::kVar : Chunk::K::kBlock, std::move(content), tag_line});
    pos = after;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Expression tokens.

struct Token {
  enum class T { kName, kString, kInt, kFloat, kOp, kEnd } t = T::kEnd;
  std::string s;
  int64_t i = 0;
  double f = 0;
};

void append_code_point(std::string& out, uint32_t cp) {
  if (cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) cp = 0xFFFD;
  unicode::utf8_append(out, cp);
}

std::vector<Token> lex(const std::string& src, int line) {
  std::vector<Token> toks;
  size_t i = 0;
  const size_t n = src.size();
  while (i < n) {
    const char c = src[i];
    if (is_space(c)) {
      ++i;
      continue;
    }
    Token t;
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < n && (std::isalnum(static_cast<unsigned char>(src[j])) || src[j] == '_')) ++j;
      t.t = Token::T::kName;
      t.s = src.substr(i, j - i);
      i = j;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t j = i;
      while (j < n && (std::isdigit(static_cast<unsigned char>(src[j])) || src[j] == '_')) ++j;
      bool is_float = false;
      if (j + 1 < n && src[j] == '.' && std::isdigit(static_cast<unsigned char>(src[j + 1]))) {
        is_float = true;
        for (++j; j < n && std::isdigit(static_cast<unsigned char>(src[j])); ++j) {
        }
      }
      if (j < n && (src[j] == 'e' || src[j] == 'E')) {
        size_t k = j + 1;
        if (k < n && (src[k] == '+' || src[k] == '-')) ++k;
        if (k < n && std::isdigit(static_cast<unsigned char>(src[k]))) {
          is_float = true;
          for (j = k; j < n && std::isdigit(static_cast<unsigned char>(src[j])); ++j) {
          }
        }
      }
      std::string num;
      for (size_t k = i; k < j; ++k)
        if (src[k] != '_') num += src[k];
      if (is_float) {
        t.t = Token::T::kFloat;
        t.f = std::strtod(num.c_str(), nullptr);  // inf when too large, as Python
      } else {
        t.t = Token::T::kInt;
        errno = 0;
        t.i = std::strtoll(num.c_str(), nullptr, 10);
        if (errno == ERANGE)
          fail(ErrorKind::kUnsupported, "line {}: integer literal {}{} does not fit in 64 bits",
               line, num.substr(0, 40), num.size() > 40 ? "..." : "");
      }
      i = j;
    } else if (c == '\'' || c == '"') {
      t.t = Token::T::kString;
      size_t j = i + 1;
      for (; j < n && src[j] != c; ++j) {
        if (src[j] != '\\' || j + 1 >= n) {
          t.s += src[j];
          continue;
        }
        const char e = src[++j];
        switch (e) {
          case 'n':
            t.s += '\n';
            break;
          case 't':
            t.s += '\t';
            break;
          case 'r':
            t.s += '\r';
            break;
          case 'f':
            t.s += '\f';
            break;
          case 'v':
            t.s += '\v';
            break;
          case 'a':
            t.s += '\a';
            break;
          case 'b':
            t.s += '\b';
            break;
          case '0':
            t.s += '\0';
            break;
          case '\\':
            t.s += '\\';
            break;
          case '\'':
            t.s += '\'';
            break;
          case '"':
            t.s += '"';
            break;
          case '\n':
            break;
          case 'x':
          case 'u':
          case 'U': {
            const size_t digits = e == 'x' ? 2 : e == 'u' ? 4 : 8;
            uint32_t cp = 0;
            for (size_t k = 1; k <= digits; ++k) {
              const char h = j + k < n ? src[j + k] : '\0';
              if (!std::isxdigit(static_cast<unsigned char>(h)))
                fail(ErrorKind::kUnsupported, "line {}: bad \\{} escape", line, e);
              cp = cp * 16 + static_cast<uint32_t>(std::isdigit(static_cast<unsigned char>(h))
                                                       ? h - '0'
                                                       : std::tolower(h) - 'a' + 10);
            }
            append_code_point(t.s, cp);
            j += digits;
            break;
          }
          default:  // Python keeps unknown escapes as they are
            t.s += '\\';
            t.s += e;
        }
      }
      if (j >= n) fail(ErrorKind::kUnsupported, "line {}: unterminated string literal", line);
      i = j + 1;
    } else {
      static const char* const kOps[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*",
                                         "/",  "%",  "~",  "<",  ">",  "(",  ")", "[", "]",
                                         "{",  "}",  ",",  ".",  ":",  "|",  "="};
      bool found = false;
      for (const char* op : kOps) {
        const size_t len = std::char_traits<char>::length(op);
        if (src.compare(i, len, op) == 0) {
          t.t = Token::T::kOp;
          t.s = op;
          i += len;
          found = true;
          break;
        }
      }
      if (!found) {
        if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7F)
          fail(ErrorKind::kUnsupported, "line {}: unexpected byte 0x{:02x}", line,
               static_cast<unsigned char>(c));
        fail(ErrorKind::kUnsupported, "line {}: unexpected character '{}'", line, c);
      }
    }
    toks.push_back(std::move(t));
  }
  toks.push_back(Token{});
  return toks;
}

// ---------------------------------------------------------------------------------------------
// Expressions.

// A token as shown in a message: on one line and short.
std::string shown(const std::string& s) {
  std::string out;
  for (char c : s.substr(0, 40)) out += static_cast<unsigned char>(c) < 0x20 ? ' ' : c;
  return s.size() > 40 ? out + "..." : out;
}

ExprP make(Expr::K k) {
  auto e = std::make_unique<Expr>();
  e->k = k;
  return e;
}

// Parses the expressions of one tag. `base_depth` is the evaluator's depth where the tag runs;
// both the parser's recursion and the tree it builds stay within max_depth from there.
class ExprParser {
 public:
  ExprParser(std::vector<Token> toks, int line, int base_depth, int max_depth)
      : toks_(std::move(toks)),
        line_(line),
        depth_(base_depth),
        base_depth_(base_depth),
        max_depth_(max_depth) {}

  const Token& peek(size_t k = 0) const { return toks_[std::min(pos_ + k, toks_.size() - 1)]; }
  bool at_end() const { return peek().t == Token::T::kEnd; }
  bool is_op(const char* op, size_t k = 0) const {
    return peek(k).t == Token::T::kOp && peek(k).s == op;
  }
  bool is_name(const char* name, size_t k = 0) const {
    return peek(k).t == Token::T::kName && peek(k).s == name;
  }
  bool skip_op(const char* op) {
    if (!is_op(op)) return false;
    ++pos_;
    return true;
  }
  bool skip_name(const char* name) {
    if (!is_name(name)) return false;
    ++pos_;
    return true;
  }
  void expect_op(const char* op) {
    if (!skip_op(op)) error(fmt::format("expected '{}'", op));
  }
  std::string expect_name() {
    if (peek().t != Token::T::kName) error("expected a name");
    return toks_[pos_++].s;
  }
  void expect_end() {
    if (!at_end()) error("unexpected tokens at the end of the tag");
  }
  [[noreturn]] void error(const std::string& what) const {
    const Token& t = peek();
    fail(ErrorKind::kUnsupported, "line {}: {} (at '{}')", line_, what,
         t.t == Token::T::kEnd      ? std::string("end of tag")
         : t.t == Token::T::kString ? "'" + shown(t.s) + "'"
                                    : shown(t.s));
  }

  ExprP expression(bool with_cond = true) {
    Deeper deeper(*this);
    return with_cond ? cond_expr() : or_expr();
  }

  // A comma-separated tuple (as a list) or a single expression.
  ExprP tuple(bool with_cond = true) {
    ExprP first = expression(with_cond);
    if (!is_op(",")) return first;
    auto list = make(Expr::K::kList);
    list->items.push_back(std::move(first));
    while (skip_op(",")) {
      if (at_end() || is_op(")") || is_op("=")) break;
      list->items.push_back(expression(with_cond));
    }
    return seal(std::move(list));
  }

 private:
  // Counts one level of the parser's recursion for its lifetime.
  class Deeper {
   public:
    explicit Deeper(ExprParser& p) : p_(p) {
      if (++p_.depth_ > p_.max_depth_) p_.too_deep();
    }
    ~Deeper() { --p_.depth_; }
    Deeper(const Deeper&) = delete;
    Deeper& operator=(const Deeper&) = delete;

   private:
    ExprParser& p_;
  };

  [[noreturn]] void too_deep() const {
    fail(ErrorKind::kUnsupported, "line {}: nesting exceeds the depth limit ({} levels)", line_,
         max_depth_);
  }

  // Records the height of a finished node. Chains such as a + b + c or x.y.z grow the tree without
  // recursing in the parser, so the tree's height is checked here, as each node is finished: a
  // tree too deep to evaluate (or to destroy) is never built.
  ExprP seal(ExprP e) {
    int below = 0;
    for (const Expr* x : {e->a.get(), e->b.get(), e->c.get()})
      if (x) below = std::max(below, x->height);
    for (const auto& x : e->items)
      if (x) below = std::max(below, x->height);
    for (const auto& x : e->values) below = std::max(below, x->height);
    for (const auto& kv : e->kwargs) below = std::max(below, kv.second->height);
    e->height = below + 1;
    if (base_depth_ + e->height > max_depth_) too_deep();
    return e;
  }

  ExprP cond_expr() {
    ExprP e = or_expr();
    while (skip_name("if")) {
      auto c = make(Expr::K::kCond);
      c->a = std::move(e);
      c->b = or_expr();
      if (skip_name("else")) {
        Deeper deeper(*this);
        c->c = cond_expr();
      }
      e = seal(std::move(c));
    }
    return e;
  }
  // operand (`name` operand)*, grouped to the left: "a or b or c" is (a or b) or c.
  ExprP left_assoc(const char* name, Expr::K kind, ExprP (ExprParser::*operand)()) {
    ExprP e = (this->*operand)();
    while (skip_name(name)) {
      auto o = make(kind);
      o->a = std::move(e);
      o->b = (this->*operand)();
      e = seal(std::move(o));
    }
    return e;
  }
  ExprP or_expr() { return left_assoc("or", Expr::K::kOr, &ExprParser::and_expr); }
  ExprP and_expr() { return left_assoc("and", Expr::K::kAnd, &ExprParser::not_expr); }
  ExprP not_expr() {
    if (skip_name("not")) {
      Deeper deeper(*this);
      auto n = make(Expr::K::kNot);
      n->a = not_expr();
      return seal(std::move(n));
    }
    return compare();
  }
  ExprP compare() {
    ExprP first = math1();
    auto cmp = make(Expr::K::kCmp);
    while (true) {
      std::string op;
      if (peek().t == Token::T::kOp && (peek().s == "==" || peek().s == "!=" || peek().s == "<" ||
                                        peek().s == ">" || peek().s == "<=" || peek().s == ">=")) {
        op = toks_[pos_++].s;
      } else if (skip_name("in")) {
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        pos_ += 2;
        op = "not in";
      } else {
        break;
      }
      cmp->ops.push_back(op);
      cmp->values.push_back(math1());
    }
    if (cmp->ops.empty()) return first;
    cmp->a = std::move(first);
    return seal(std::move(cmp));
  }
  ExprP binary_level(int level) {
    static const std::vector<std::vector<std::string>> kLevels = {
        {"+", "-"}, {"~"}, {"*", "/", "//", "%"}, {"**"}};
    if (level == 4) return unary(true);
    ExprP e = binary_level(level + 1);
    while (peek().t == Token::T::kOp && std::find(kLevels[level].begin(), kLevels[level].end(),
                                                  peek().s) != kLevels[level].end()) {
      auto b = make(Expr::K::kBin);
      b->name = toks_[pos_++].s;
      b->a = std::move(e);
      b->b = binary_level(level + 1);
      e = seal(std::move(b));
    }
    return e;
  }
  ExprP math1() { return binary_level(0); }
  ExprP unary(bool with_filter) {
    ExprP e;
    if (skip_op("-")) {
      Deeper deeper(*this);
      e = make(Expr::K::kNeg);
      e->a = unary(false);
      e = seal(std::move(e));
    } else if (skip_op("+")) {
      Deeper deeper(*this);
      e = unary(false);
    } else {
      e = primary();
    }
    e = postfix(std::move(e));
    if (with_filter) e = filter_expr(std::move(e));
    return e;
  }
  ExprP primary() {
    const Token& t = peek();
    if (t.t == Token::T::kName) {
      ++pos_;
      auto e = make(Expr::K::kLit);
      if (t.s == "true" || t.s == "True")
        e->lit = Value::boolean(true);
      else if (t.s == "false" || t.s == "False")
        e->lit = Value::boolean(false);
      else if (t.s == "none" || t.s == "None")
        e->lit = Value::none();
      else {
        e->k = Expr::K::kName;
        e->name = t.s;
      }
      return e;
    }
    if (t.t == Token::T::kString) {
      std::string s;
      while (peek().t == Token::T::kString) s += toks_[pos_++].s;
      auto e = make(Expr::K::kLit);
      e->lit = Value::string(std::move(s));
      return e;
    }
    if (t.t == Token::T::kInt || t.t == Token::T::kFloat) {
      ++pos_;
      auto e = make(Expr::K::kLit);
      e->lit = t.t == Token::T::kInt ? Value::integer(t.i) : Value::number(t.f);
      return e;
    }
    if (skip_op("(")) {
      if (skip_op(")")) return make(Expr::K::kList);
      ExprP e = tuple();
      expect_op(")");
      return e;
    }
    if (skip_op("[")) {
      auto e = make(Expr::K::kList);
      while (!is_op("]")) {
        e->items.push_back(expression());
        if (!skip_op(",")) break;
      }
      expect_op("]");
      return seal(std::move(e));
    }
    if (skip_op("{")) {
      auto e = make(Expr::K::kDict);
      while (!is_op("}")) {
        e->items.push_back(expression());
        expect_op(":");
        e->values.push_back(expression());
        if (!skip_op(",")) break;
      }
      expect_op("}");
      return seal(std::move(e));
    }
    error("expected an expression");
  }
  ExprP postfix(ExprP e) {
    while (true) {
      if (skip_op(".")) {
        if (peek().t == Token::T::kInt) {
          auto item = make(Expr::K::kItem);
          item->a = std::move(e);
          item->b = make(Expr::K::kLit);
          item->b->lit = Value::integer(toks_[pos_++].i);
          e = seal(std::move(item));
          continue;
        }
        auto attr = make(Expr::K::kAttr);
        attr->a = std::move(e);
        attr->name = expect_name();
        e = seal(std::move(attr));
      } else if (skip_op("[")) {
        ExprP parts[3];
        bool is_slice = false;
        for (int k = 0; k < 3; ++k) {
          if (!is_op(":") && !is_op("]")) parts[k] = expression();
          if (k < 2 && skip_op(":")) {
            is_slice = true;
            continue;
          }
          break;
        }
        expect_op("]");
        if (is_slice) {
          auto s = make(Expr::K::kSlice);
          s->a = std::move(e);
          s->items.push_back(std::move(parts[0]));
          s->items.push_back(std::move(parts[1]));
          s->items.push_back(std::move(parts[2]));
          e = seal(std::move(s));
        } else {
          if (!parts[0]) error("empty subscript");
          auto item = make(Expr::K::kItem);
          item->a = std::move(e);
          item->b = std::move(parts[0]);
          e = seal(std::move(item));
        }
      } else if (is_op("(")) {
        e = call(std::move(e));
      } else {
        return e;
      }
    }
  }
  void call_args(Expr& e) {
    expect_op("(");
    while (!is_op(")")) {
      if (is_op("*") || is_op("**")) error("*args and **kwargs are not supported");
      if (peek().t == Token::T::kName && is_op("=", 1)) {
        std::string key = toks_[pos_].s;
        pos_ += 2;
        e.kwargs.emplace_back(std::move(key), expression());
      } else {
        e.items.push_back(expression());
      }
      if (!skip_op(",")) break;
    }
    expect_op(")");
  }
  ExprP call(ExprP callee) {
    auto c = make(Expr::K::kCall);
    c->a = std::move(callee);
    call_args(*c);
    return seal(std::move(c));
  }
  ExprP filter_expr(ExprP e) {
    while (true) {
      if (skip_op("|")) {
        auto f = make(Expr::K::kFilter);
        f->name = expect_name();
        while (skip_op(".")) {
          f->name += '.';
          f->name += expect_name();
        }
        if (!has_filter(f->name)) error(fmt::format("filter '{}' is not supported", f->name));
        f->a = std::move(e);
        if (is_op("(")) call_args(*f);
        e = seal(std::move(f));
      } else if (skip_name("is")) {
        auto t = make(Expr::K::kTest);
        t->negated = skip_name("not");
        if (peek().t == Token::T::kName) {
          t->name = expect_name();
        } else if (peek().t == Token::T::kOp &&
                   (peek().s == "==" || peek().s == "!=" || peek().s == "<" || peek().s == ">" ||
                    peek().s == "<=" || peek().s == ">=")) {
          t->name = toks_[pos_++].s;
        } else {
          error("expected a test name");
        }
        if (!has_test(t->name)) error(fmt::format("test '{}' is not supported", t->name));
        t->a = std::move(e);
        if (is_op("(")) {
          call_args(*t);
        } else if ((peek().t == Token::T::kName || peek().t == Token::T::kString ||
                    peek().t == Token::T::kInt || peek().t == Token::T::kFloat || is_op("(") ||
                    is_op("[") || is_op("{")) &&
                   !is_name("else") && !is_name("or") && !is_name("and")) {
          Deeper deeper(*this);
          ExprP arg = postfix(primary());
          t->items.push_back(std::move(arg));
        }
        e = seal(std::move(t));
      } else if (is_op("(")) {
        e = call(std::move(e));
      } else {
        return e;
      }
    }
  }

  std::vector<Token> toks_;
  size_t pos_ = 0;
  int line_;
  int depth_;  // the parser's recursion, from base_depth_
  int base_depth_;
  int max_depth_;
};

// ---------------------------------------------------------------------------------------------
// Statements.

class StmtParser {
 public:
  StmtParser(std::vector<Chunk> chunks, int max_depth)
      : chunks_(std::move(chunks)), max_depth_(max_depth) {}

  Body parse_all() {
    std::string end;
    Body body = parse_body({}, end);
    return body;
  }

 private:
  // Parses until one of the `ends` keywords; returns its name in `end` and leaves its parser (for
  // `elif cond`) in end_parser_.
  Body parse_body(const std::vector<std::string>& ends, std::string& end) {
    // A body inside a block (any but the template's own) is one level deeper: the evaluator runs
    // the template's body at depth 1, a block's body at depth 2, and so on.
    const int blocks = ends.empty() ? 0 : 1;
    struct Restore {
      int& depth;
      int saved;
      ~Restore() { depth = saved; }
    } restore{blocks_, blocks_};
    blocks_ += blocks;
    if (blocks_ + 1 > max_depth_)
      fail(ErrorKind::kUnsupported, "line {}: nesting exceeds the depth limit ({} levels)",
           idx_ ? chunks_[idx_ - 1].line : 1, max_depth_);
    Body body;
    while (idx_ < chunks_.size()) {
      Chunk& ch = chunks_[idx_++];
      if (ch.k == Chunk::K::kText) {
        auto s = std::make_unique<Stmt>();
        s->k = Stmt::K::kText;
        s->text = std::move(ch.text);
        body.push_back(std::move(s));
        continue;
      }
      auto p =
          std::make_unique<ExprParser>(lex(ch.text, ch.line), ch.line, blocks_ + 1, max_depth_);
      if (ch.k == Chunk::K::kVar) {
        auto s = std::make_unique<Stmt>();
        s->k = Stmt::K::kOut;
        s->line = ch.line;
        s->expr = p->tuple();
        p->expect_end();
        body.push_back(std::move(s));
        continue;
      }
      const std::string keyword = p->expect_name();
      if (std::find(ends.begin(), ends.end(), keyword) != ends.end()) {
        end = keyword;
        end_parser_ = std::move(p);
        return body;
      }
      body.push_back(statement(keyword, *p, ch.line));
    }
    if (!ends.empty())
      fail(ErrorKind::kUnsupported, "missing '{{% {} %}}' at the end of the template",
           ends.front());
    return body;
  }

  std::unique_ptr<Stmt> statement(const std::string& keyword, ExprParser& p, int line) {
    auto s = std::make_unique<Stmt>();
    s->line = line;
    std::string end;
    if (keyword == "if") {
      s->k = Stmt::K::kIf;
      ExprP cond = p.tuple(false);
      p.expect_end();
      while (true) {
        Body body = parse_body({"elif", "else", "endif"}, end);
        s->branches.emplace_back(std::move(cond), std::move(body));
        if (end == "elif") {
          cond = end_parser_->tuple(false);
          end_parser_->expect_end();
          continue;
        }
        end_parser_->expect_end();
        if (end == "else") {
          s->else_body = parse_body({"endif"}, end);
          end_parser_->expect_end();
        }
        break;
      }
    } else if (keyword == "for") {
      s->k = Stmt::K::kFor;
      const bool paren = p.skip_op("(");
      do {
        s->targets.push_back(p.expect_name());
      } while (p.skip_op(","));
      if (paren) p.expect_op(")");
      if (!p.skip_name("in")) p.error("expected 'in'");
      s->expr = p.tuple(false);
      if (p.skip_name("if")) s->cond = p.expression();
      if (p.is_name("recursive")) p.error("recursive loops are not supported");
      p.expect_end();
      s->body = parse_body({"else", "endfor"}, end);
      end_parser_->expect_end();
      if (end == "else") {
        s->else_body = parse_body({"endfor"}, end);
        end_parser_->expect_end();
      }
    } else if (keyword == "set") {
      std::string first = p.expect_name();
      if (p.skip_op(".")) {
        s->attr = p.expect_name();
        s->targets.push_back(first);
      } else {
        s->targets.push_back(first);
        while (p.skip_op(",")) s->targets.push_back(p.expect_name());
      }
      if (p.skip_op("=")) {
        s->k = Stmt::K::kSet;
        s->expr = p.tuple();
        p.expect_end();
      } else {
        if (!s->attr.empty() || s->targets.size() != 1) p.error("expected '='");
        if (p.is_op("|")) p.error("filtered set blocks are not supported");
        p.expect_end();
        s->k = Stmt::K::kSetBlock;
        s->body = parse_body({"endset"}, end);
        end_parser_->expect_end();
      }
    } else if (keyword == "break" || keyword == "continue") {
      s->k = keyword == "break" ? Stmt::K::kBreak : Stmt::K::kContinue;
      p.expect_end();
    } else if (keyword == "generation") {  // transformers' AssistantTracker: renders its body
      s->k = Stmt::K::kBlock;
      p.expect_end();
      s->body = parse_body({"endgeneration"}, end);
      end_parser_->expect_end();
    } else {
      fail(ErrorKind::kUnsupported, "line {}: '{{% {} %}}' is not supported", line, keyword);
    }
    return s;
  }

  std::vector<Chunk> chunks_;
  size_t idx_ = 0;
  std::unique_ptr<ExprParser> end_parser_;
  int max_depth_;
  int blocks_ = 0;  // blocks around the statements being parsed
};

}  // namespace

Body parse_template(std::string_view source, int max_depth) {
  StmtParser parser(split_source(normalize_newlines(source)), max_depth);
  return parser.parse_all();
}

}  // namespace moe::jinja
