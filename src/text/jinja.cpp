// Evaluator of the chat-template interpreter (see jinja.h): runs the tree that jinja_parse.cpp
// builds. Every node evaluated, statement run and loop iteration is a step of the render's budget,
// and every level of recursion counts against its depth limit.
#include "text/jinja.h"

#include <algorithm>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "text/jinja_ast.h"
#include "text/jinja_value.h"

namespace moe::jinja {

namespace {

struct Ctx {
  Budget& budget;
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

// Where a body's text goes: the render's output, or the capture of a {% set %} block (a value).
struct Sink {
  std::string text;
  bool is_output;
};

void emit(Ctx& c, Sink& out, std::string_view s) {
  if (out.is_output)
    c.budget.grow_output(out.text.size(), s.size());
  else
    c.budget.grow(out.text.size(), s.size(), "string");
  out.text += s;
}

Value eval(const Expr& e, Ctx& c);

Args eval_args(const Expr& e, Ctx& c) {
  Args args;
  for (const auto& x : e.items) args.pos.push_back(eval(*x, c));
  for (const auto& [k, x] : e.kwargs) args.kw.emplace_back(k, eval(*x, c));
  return args;
}

Value eval(const Expr& e, Ctx& c) {
  Budget::Nest nest(c.budget);
  c.budget.step();
  switch (e.k) {
    case Expr::K::kLit:
      return e.lit;
    case Expr::K::kName: {
      Value v = c.lookup(e.name);
      if (v.is_undefined()) return Value::undefined(e.name);
      return v;
    }
    case Expr::K::kAttr:
      return get_attr(c.budget, eval(*e.a, c), e.name);
    case Expr::K::kItem:
      return get_item(c.budget, eval(*e.a, c), eval(*e.b, c));
    case Expr::K::kSlice: {
      Value parts[3];
      for (int k = 0; k < 3; ++k)
        if (e.items[k]) parts[k] = eval(*e.items[k], c);
      return slice(c.budget, eval(*e.a, c), parts[0], parts[1], parts[2]);
    }
    case Expr::K::kCall: {
      if (e.a->k == Expr::K::kAttr) {
        Value obj = eval(*e.a->a, c);
        Args args = eval_args(e, c);
        if (obj.is_dict()) {
          c.budget.step(obj.dict->items.size() / 16);
          if (const Value* f = obj.dict->find(e.a->name); f && f->kind == Value::Kind::kFunction)
            return (*f->fn)(c.budget, args);
        }
        return call_method(c.budget, obj, e.a->name, args);
      }
      Value f = eval(*e.a, c);
      if (f.kind != Value::Kind::kFunction) {
        if (f.is_undefined())
          fail(ErrorKind::kUnsupported, "function '{}' is not available",
               f.str().empty() ? "?" : f.str());
        fail(ErrorKind::kInvalidArgument, "{} is not callable", f.type_name());
      }
      Args args = eval_args(e, c);
      return (*f.fn)(c.budget, args);
    }
    case Expr::K::kFilter: {
      Value v = eval(*e.a, c);
      Args args = eval_args(e, c);
      return apply_filter(c.budget, e.name, v, args);
    }
    case Expr::K::kTest: {
      Value v = eval(*e.a, c);
      Args args = eval_args(e, c);
      return Value::boolean(apply_test(c.budget, e.name, v, args) != e.negated);
    }
    case Expr::K::kNot:
      return Value::boolean(!truthy(eval(*e.a, c)));
    case Expr::K::kNeg:
      return negate(eval(*e.a, c));
    case Expr::K::kBin:
      return binary_op(c.budget, e.name, eval(*e.a, c), eval(*e.b, c));
    case Expr::K::kCmp: {
      Value left = eval(*e.a, c);
      for (size_t k = 0; k < e.ops.size(); ++k) {
        Value right = eval(*e.values[k], c);
        const std::string& op = e.ops[k];
        bool ok;
        if (op == "==")
          ok = equal(c.budget, left, right);
        else if (op == "!=")
          ok = !equal(c.budget, left, right);
        else if (op == "in")
          ok = contains(c.budget, right, left);
        else if (op == "not in")
          ok = !contains(c.budget, right, left);
        else {
          const int r = compare(c.budget, left, right);
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
      c.budget.claim(list_bytes(e.items.size()), "list");
      List l;
      l.reserve(e.items.size());
      for (const auto& x : e.items) l.push_back(eval(*x, c));
      Value v = Value::new_list(std::move(l));
      c.budget.check_nesting(v.nesting());
      return v;
    }
    case Expr::K::kDict: {
      c.budget.claim(dict_bytes(e.items.size()), "dict");
      Value d = Value::new_dict();
      for (size_t k = 0; k < e.items.size(); ++k) {
        Value key = eval(*e.items[k], c);
        if (!key.is_string())
          fail(ErrorKind::kUnsupported, "dict keys other than strings are not supported");
        d.dict->set(key.str(), eval(*e.values[k], c));
      }
      c.budget.check_nesting(d.nesting());
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

// Jinja2's `loop` object for iteration k of n.
Value loop_object(Ctx& c, const List& items, size_t k) {
  const auto n = static_cast<int64_t>(items.size());
  const auto i = static_cast<int64_t>(k);
  Value loop = Value::new_dict();
  auto& d = loop.dict->items;
  d.reserve(10);
  d.emplace_back("index", Value::integer(i + 1));
  d.emplace_back("index0", Value::integer(i));
  d.emplace_back("revindex", Value::integer(n - i));
  d.emplace_back("revindex0", Value::integer(n - i - 1));
  d.emplace_back("first", Value::boolean(i == 0));
  d.emplace_back("last", Value::boolean(i == n - 1));
  d.emplace_back("length", Value::integer(n));
  d.emplace_back("previtem", k > 0 ? items[k - 1] : Value::undefined("previtem"));
  d.emplace_back("nextitem", i + 1 < n ? items[k + 1] : Value::undefined("nextitem"));
  d.emplace_back("cycle", Value::function([k](Budget&, Args& args) {
                   if (args.pos.empty())
                     fail(ErrorKind::kInvalidArgument, "loop.cycle() needs arguments");
                   return args.pos[k % args.pos.size()];
                 }));
  int deepest = 0;
  for (const auto& kv : d) deepest = std::max(deepest, kv.second.nesting());
  loop.dict->depth = deepest + 1;
  c.budget.check_nesting(loop.dict->depth);
  return loop;
}

void exec(const Body& body, Ctx& c, Sink& out);

void exec_for(const Stmt& s, Ctx& c, Sink& out) {
  const Value seq = eval(*s.expr, c);
  // A list is iterated in place (lists never change); anything else is made a list first.
  List made;
  const List* items = seq.is_list() ? seq.list.get() : &(made = iterate(c.budget, seq));
  c.scopes.emplace_back();
  if (s.cond) {
    List kept;
    for (const Value& v : *items) {
      c.budget.step();
      assign_names(c, s.targets, v);
      if (truthy(eval(*s.cond, c))) {
        c.budget.claim(kItemBytes, "list");
        kept.push_back(v);
      }
    }
    made.swap(kept);
    items = &made;
  }
  // The loop object's ten entries cost about as much as ten nodes.
  constexpr uint64_t kIterationSteps = 10;
  for (size_t k = 0; k < items->size(); ++k) {
    c.budget.step(kIterationSteps);
    assign_names(c, s.targets, (*items)[k]);
    c.scopes.back()["loop"] = loop_object(c, *items, k);
    exec(s.body, c, out);
    if (c.flow == Ctx::Flow::kBreak) {
      c.flow = Ctx::Flow::kNone;
      break;
    }
    c.flow = Ctx::Flow::kNone;
  }
  const bool empty = items->empty();
  c.scopes.pop_back();
  if (empty) exec(s.else_body, c, out);
}

void exec(const Body& body, Ctx& c, Sink& out) {
  Budget::Nest nest(c.budget);
  for (const auto& sp : body) {
    const Stmt& s = *sp;
    c.budget.step();
    if (s.line) c.line = s.line;
    switch (s.k) {
      case Stmt::K::kText:
        emit(c, out, s.text);
        break;
      case Stmt::K::kOut: {
        const Value v = eval(*s.expr, c);
        if (v.is_string())
          emit(c, out, v.str());
        else
          emit(c, out, to_str(c.budget, v));
        break;
      }
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
          c.budget.check_nesting(ns.nesting());
        } else {
          assign_names(c, s.targets, v);
        }
        break;
      }
      case Stmt::K::kSetBlock: {
        Sink captured{{}, false};
        exec(s.body, c, captured);
        c.scopes.back()[s.targets[0]] = Value::string(std::move(captured.text));
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

// Messages quote the template and its data (names, keys, raise_exception's text), which may hold
// newlines and any amount of text; errors in this project are one line of reasonable length.
std::string one_line(const std::string& message) {
  constexpr size_t kMaxBytes = 1000;
  std::string out;
  for (unsigned char c : message.substr(0, kMaxBytes)) out += c < 0x20 || c == 0x7F ? ' ' : c;
  if (message.size() > kMaxBytes) {
    // Cut at a character boundary, not inside a UTF-8 sequence.
    while (!out.empty() && (static_cast<unsigned char>(out.back()) & 0xC0) == 0x80) out.pop_back();
    if (!out.empty() && static_cast<unsigned char>(out.back()) >= 0xC0) out.pop_back();
    out += "...";
  }
  return out;
}

}  // namespace

struct Program {
  std::string origin;
  Body body;
};

Template Template::parse(std::string_view source, const std::string& origin, const Limits& limits) {
  auto program = std::make_shared<Program>();
  program->origin = origin;
  try {
    program->body = parse_template(source, limits.max_depth);
  } catch (const TemplateError& e) {
    throw Error(e.kind, fmt::format("chat template of {}: {}", origin, one_line(e.message)),
                __FILE__, __LINE__);
  }
  Template t;
  t.program_ = std::move(program);
  return t;
}

std::string Template::render(const nlohmann::ordered_json& variables, const Limits& limits) const {
  // Everything a render changes lives here, on this thread: the Program is only read.
  Budget budget(limits);
  Ctx c{budget, {}};
  try {
    c.scopes.emplace_back();
    if (variables.is_object())
      for (const auto& [k, v] : variables.items()) c.scopes.back()[k] = from_json(budget, v);
    c.scopes.emplace_back();  // template-level sets
    Sink out{{}, true};
    exec(program_->body, c, out);
    return std::move(out.text);
  } catch (const TemplateError& e) {
    if (c.line == 0)  // before the first statement: in the variables
      throw Error(e.kind,
                  fmt::format("chat template of {}: {}", program_->origin, one_line(e.message)),
                  __FILE__, __LINE__);
    throw Error(e.kind,
                fmt::format("chat template of {} (line {}): {}", program_->origin, c.line,
                            one_line(e.message)),
                __FILE__, __LINE__);
  }
}

}  // namespace moe::jinja
