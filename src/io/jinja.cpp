// Lexer, parser and evaluator of the chat-template interpreter (see jinja.h). The whitespace rules
// follow Jinja2 with trim_blocks=True and lstrip_blocks=True (what transformers uses), the operator
// precedence follows jinja2/parser.py.
#include "io/jinja.h"

#include <unordered_map>

#include <nlohmann/json.hpp>

#include "io/jinja_value.h"
#include "io/unicode_util.h"

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
        t.f = std::stod(num);
      } else {
        t.t = Token::T::kInt;
        try {
          t.i = std::stoll(num);
        } catch (...) {
          fail(ErrorKind::kUnsupported, "line {}: integer literal {} is too large", line, num);
        }
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
            if (j + digits >= n) fail(ErrorKind::kUnsupported, "line {}: bad \\{} escape", line, e);
            append_code_point(
                t.s, static_cast<uint32_t>(std::stoul(src.substr(j + 1, digits), nullptr, 16)));
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
      if (!found) fail(ErrorKind::kUnsupported, "line {}: unexpected character '{}'", line, c);
    }
    toks.push_back(std::move(t));
  }
  toks.push_back(Token{});
  return toks;
}

// ---------------------------------------------------------------------------------------------
// Syntax tree.

struct Expr;
using ExprP = std::unique_ptr<Expr>;

struct Expr {
  enum class K {
    kLit,
    kName,
    kAttr,
    kItem,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kNot,
    kNeg,
    kBin,
    kCmp,
    kAnd,
    kOr,
    kCond,
    kList,
    kDict
  } k;
  Value lit;
  std::string name;  // name, attribute, filter, test or operator
  ExprP a, b, c;
  std::vector<ExprP> items;   // list items, call / filter / test positional args, dict keys
  std::vector<ExprP> values;  // dict values, comparison operands
  std::vector<std::pair<std::string, ExprP>> kwargs;
  std::vector<std::string> ops;  // comparison operators
  bool negated = false;
};

ExprP make(Expr::K k) {
  auto e = std::make_unique<Expr>();
  e->k = k;
  return e;
}

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

struct Stmt {
  enum class K { kText, kOut, kIf, kFor, kSet, kSetBlock, kBreak, kContinue, kBlock } k;
  int line = 0;
  std::string text;
  ExprP expr;
  std::vector<std::pair<ExprP, Body>> branches;
  Body body, else_body;
  std::vector<std::string> targets;
  std::string attr;
  ExprP cond;
};

class ExprParser {
 public:
  ExprParser(std::vector<Token> toks, int line) : toks_(std::move(toks)), line_(line) {}

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
         : t.t == Token::T::kString ? "'" + t.s + "'"
                                    : t.s);
  }

  ExprP expression(bool with_cond = true) { return with_cond ? cond_expr() : or_expr(); }

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
    return list;
  }

 private:
  ExprP cond_expr() {
    ExprP e = or_expr();
    while (skip_name("if")) {
      auto c = make(Expr::K::kCond);
      c->a = std::move(e);
      c->b = or_expr();
      if (skip_name("else")) c->c = cond_expr();
      e = std::move(c);
    }
    return e;
  }
  ExprP or_expr() {
    ExprP e = and_expr();
    while (skip_name("or")) {
      auto o = make(Expr::K::kOr);
      o->a = std::move(e);
      o->b = and_expr();
      e = std::move(o);
    }
    return e;
  }
  ExprP and_expr() {
    ExprP e = not_expr();
    while (skip_name("and")) {
      auto o = make(Expr::K::kAnd);
      o->a = std::move(e);
      o->b = not_expr();
      e = std::move(o);
    }
    return e;
  }
  ExprP not_expr() {
    if (skip_name("not")) {
      auto n = make(Expr::K::kNot);
      n->a = not_expr();
      return n;
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
    return cmp;
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
      e = std::move(b);
    }
    return e;
  }
  ExprP math1() { return binary_level(0); }
  ExprP unary(bool with_filter) {
    ExprP e;
    if (skip_op("-")) {
      e = make(Expr::K::kNeg);
      e->a = unary(false);
    } else if (skip_op("+")) {
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
      return e;
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
      return e;
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
          e = std::move(item);
          continue;
        }
        auto attr = make(Expr::K::kAttr);
        attr->a = std::move(e);
        attr->name = expect_name();
        e = std::move(attr);
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
          e = std::move(s);
        } else {
          if (!parts[0]) error("empty subscript");
          auto item = make(Expr::K::kItem);
          item->a = std::move(e);
          item->b = std::move(parts[0]);
          e = std::move(item);
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
    return c;
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
        e = std::move(f);
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
          ExprP arg = postfix(primary());
          t->items.push_back(std::move(arg));
        }
        e = std::move(t);
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
};

// ---------------------------------------------------------------------------------------------
// Statements.

class StmtParser {
 public:
  explicit StmtParser(std::vector<Chunk> chunks) : chunks_(std::move(chunks)) {}

  Body parse_all() {
    std::string end;
    Body body = parse_body({}, end);
    return body;
  }

 private:
  // Parses until one of the `ends` keywords; returns its name in `end` and leaves its parser (for
  // `elif cond`) in end_parser_.
  Body parse_body(const std::vector<std::string>& ends, std::string& end) {
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
      auto p = std::make_unique<ExprParser>(lex(ch.text, ch.line), ch.line);
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
};

// ---------------------------------------------------------------------------------------------
// Evaluation.

struct Ctx {
  std::vector<std::unordered_map<std::string, Value>> scopes;
  enum class Flow { kNone, kBreak, kContinue } flow = Flow::kNone;
  int line = 0;

  Value lookup(const std::string& name) const {
    for (auto it = scopes.rbegin(); it != scopes.rend(); ++it) {
      auto f = it->find(name);
      if (f != it->end()) return f->second;
    }
    return global_function(name);
  }
};

Value eval(const Expr& e, Ctx& c);

Args eval_args(const Expr& e, Ctx& c) {
  Args args;
  for (const auto& x : e.items) args.pos.push_back(eval(*x, c));
  for (const auto& [k, x] : e.kwargs) args.kw.emplace_back(k, eval(*x, c));
  return args;
}

Value eval(const Expr& e, Ctx& c) {
  switch (e.k) {
    case Expr::K::kLit:
      return e.lit;
    case Expr::K::kName: {
      Value v = c.lookup(e.name);
      if (v.is_undefined()) v.s = e.name;
      return v;
    }
    case Expr::K::kAttr:
      return get_attr(eval(*e.a, c), e.name);
    case Expr::K::kItem:
      return get_item(eval(*e.a, c), eval(*e.b, c));
    case Expr::K::kSlice: {
      Value parts[3];
      for (int k = 0; k < 3; ++k)
        if (e.items[k]) parts[k] = eval(*e.items[k], c);
      return slice(eval(*e.a, c), parts[0], parts[1], parts[2]);
    }
    case Expr::K::kCall: {
      if (e.a->k == Expr::K::kAttr) {
        Value obj = eval(*e.a->a, c);
        Args args = eval_args(e, c);
        if (obj.is_dict())
          if (const Value* f = obj.dict->find(e.a->name); f && f->kind == Value::Kind::kFunction)
            return (*f->fn)(args);
        return call_method(obj, e.a->name, args);
      }
      Value f = eval(*e.a, c);
      if (f.kind != Value::Kind::kFunction) {
        if (f.is_undefined())
          fail(ErrorKind::kUnsupported, "function '{}' is not available", f.s.empty() ? "?" : f.s);
        fail(ErrorKind::kInvalidArgument, "{} is not callable", f.type_name());
      }
      Args args = eval_args(e, c);
      return (*f.fn)(args);
    }
    case Expr::K::kFilter: {
      Value v = eval(*e.a, c);
      Args args = eval_args(e, c);
      return apply_filter(e.name, v, args);
    }
    case Expr::K::kTest: {
      Value v = eval(*e.a, c);
      Args args = eval_args(e, c);
      return Value::boolean(apply_test(e.name, v, args) != e.negated);
    }
    case Expr::K::kNot:
      return Value::boolean(!truthy(eval(*e.a, c)));
    case Expr::K::kNeg: {
      Value v = eval(*e.a, c);
      if (v.is_integer()) return Value::integer(-v.as_int());
      return Value::number(-v.as_double());
    }
    case Expr::K::kBin:
      return binary_op(e.name, eval(*e.a, c), eval(*e.b, c));
    case Expr::K::kCmp: {
      Value left = eval(*e.a, c);
      for (size_t k = 0; k < e.ops.size(); ++k) {
        Value right = eval(*e.values[k], c);
        const std::string& op = e.ops[k];
        bool ok;
        if (op == "==")
          ok = equal(left, right);
        else if (op == "!=")
          ok = !equal(left, right);
        else if (op == "in")
          ok = contains(right, left);
        else if (op == "not in")
          ok = !contains(right, left);
        else {
          const int r = compare(left, right);
          ok = op == "<" ? r < 0 : op == ">" ? r > 0 : op == "<=" ? r <= 0 : r >= 0;
        }
        if (!ok) return Value::boolean(false);
        left = std::move(right);
      }
      return Value::boolean(true);
    }
    case Expr::K::kAnd: {
      Value a = eval(*e.a, c);
      return truthy(a) ? eval(*e.b, c) : a;
    }
    case Expr::K::kOr: {
      Value a = eval(*e.a, c);
      return truthy(a) ? a : eval(*e.b, c);
    }
    case Expr::K::kCond:
      if (truthy(eval(*e.b, c))) return eval(*e.a, c);
      return e.c ? eval(*e.c, c) : Value::undefined();
    case Expr::K::kList: {
      List l;
      for (const auto& x : e.items) l.push_back(eval(*x, c));
      return Value::new_list(std::move(l));
    }
    case Expr::K::kDict: {
      Value d = Value::new_dict();
      for (size_t k = 0; k < e.items.size(); ++k) {
        Value key = eval(*e.items[k], c);
        if (!key.is_string())
          fail(ErrorKind::kUnsupported, "dict keys other than strings are not supported");
        d.dict->set(key.s, eval(*e.values[k], c));
      }
      return d;
    }
  }
  return Value::undefined();
}

void assign_names(Ctx& c, const std::vector<std::string>& targets, const Value& v) {
  if (targets.size() == 1) {
    c.scopes.back()[targets[0]] = v;
    return;
  }
  if (!v.is_list() || v.list->size() != targets.size())
    fail(ErrorKind::kInvalidArgument, "cannot unpack {} into {} names", v.type_name(),
         targets.size());
  for (size_t k = 0; k < targets.size(); ++k) c.scopes.back()[targets[k]] = (*v.list)[k];
}

void exec(const Body& body, Ctx& c, std::string& out);

void exec_for(const Stmt& s, Ctx& c, std::string& out) {
  List items = iterate(eval(*s.expr, c));
  c.scopes.emplace_back();
  if (s.cond) {
    List kept;
    for (const Value& v : items) {
      assign_names(c, s.targets, v);
      if (truthy(eval(*s.cond, c))) kept.push_back(v);
    }
    items.swap(kept);
  }
  const auto n = static_cast<int64_t>(items.size());
  for (int64_t k = 0; k < n; ++k) {
    assign_names(c, s.targets, items[k]);
    Value loop = Value::new_dict();
    Dict& d = *loop.dict;
    d.set("index", Value::integer(k + 1));
    d.set("index0", Value::integer(k));
    d.set("revindex", Value::integer(n - k));
    d.set("revindex0", Value::integer(n - k - 1));
    d.set("first", Value::boolean(k == 0));
    d.set("last", Value::boolean(k == n - 1));
    d.set("length", Value::integer(n));
    d.set("previtem", k > 0 ? items[k - 1] : Value::undefined("previtem"));
    d.set("nextitem", k + 1 < n ? items[k + 1] : Value::undefined("nextitem"));
    d.set("cycle", Value::function([k](Args& args) {
            if (args.pos.empty()) fail(ErrorKind::kInvalidArgument, "loop.cycle() needs arguments");
            return args.pos[static_cast<size_t>(k) % args.pos.size()];
          }));
    c.scopes.back()["loop"] = loop;
    exec(s.body, c, out);
    if (c.flow == Ctx::Flow::kBreak) {
      c.flow = Ctx::Flow::kNone;
      break;
    }
    c.flow = Ctx::Flow::kNone;
  }
  c.scopes.pop_back();
  if (n == 0) exec(s.else_body, c, out);
}

void exec(const Body& body, Ctx& c, std::string& out) {
  for (const auto& sp : body) {
    const Stmt& s = *sp;
    if (s.line) c.line = s.line;
    switch (s.k) {
      case Stmt::K::kText:
        out += s.text;
        break;
      case Stmt::K::kOut:
        out += to_str(eval(*s.expr, c));
        break;
      case Stmt::K::kIf: {
        bool done = false;
        for (const auto& [cond, branch] : s.branches) {
          if (truthy(eval(*cond, c))) {
            exec(branch, c, out);
            done = true;
            break;
          }
        }
        if (!done) exec(s.else_body, c, out);
        break;
      }
      case Stmt::K::kFor:
        exec_for(s, c, out);
        break;
      case Stmt::K::kSet: {
        Value v = eval(*s.expr, c);
        if (!s.attr.empty()) {
          Value ns = c.lookup(s.targets[0]);
          if (!ns.is_dict() || !ns.dict->is_namespace)
            fail(ErrorKind::kInvalidArgument,
                 "cannot assign attribute '{}' on {} '{}' (not a namespace)", s.attr,
                 ns.type_name(), s.targets[0]);
          ns.dict->set(s.attr, std::move(v));
        } else {
          assign_names(c, s.targets, v);
        }
        break;
      }
      case Stmt::K::kSetBlock: {
        std::string captured;
        exec(s.body, c, captured);
        c.scopes.back()[s.targets[0]] = Value::string(std::move(captured));
        break;
      }
      case Stmt::K::kBreak:
        c.flow = Ctx::Flow::kBreak;
        return;
      case Stmt::K::kContinue:
        c.flow = Ctx::Flow::kContinue;
        return;
      case Stmt::K::kBlock:
        exec(s.body, c, out);
        break;
    }
    if (c.flow != Ctx::Flow::kNone) return;
  }
}

}  // namespace

struct Program {
  std::string origin;
  Body body;
};

Template Template::parse(std::string_view source, const std::string& origin) {
  auto program = std::make_shared<Program>();
  program->origin = origin;
  try {
    StmtParser parser(split_source(normalize_newlines(source)));
    program->body = parser.parse_all();
  } catch (const TemplateError& e) {
    throw Error(e.kind, fmt::format("chat template of {}: {}", origin, e.message), __FILE__,
                __LINE__);
  }
  Template t;
  t.program_ = std::move(program);
  return t;
}

std::string Template::render(const nlohmann::ordered_json& variables) const {
  Ctx c;
  c.scopes.emplace_back();
  if (variables.is_object())
    for (const auto& [k, v] : variables.items()) c.scopes.back()[k] = from_json(v);
  c.scopes.emplace_back();  // template-level sets
  std::string out;
  try {
    exec(program_->body, c, out);
  } catch (const TemplateError& e) {
    throw Error(
        e.kind,
        fmt::format("chat template of {} (line {}): {}", program_->origin, c.line, e.message),
        __FILE__, __LINE__);
  }
  return out;
}

}  // namespace moe::jinja
