// Syntax tree of the chat-template interpreter (see jinja.h), built by jinja_parse.cpp and run by
// jinja.cpp. Internal.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "text/jinja_value.h"

namespace moe::jinja {

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
  int height = 1;  // levels of nodes from here down to the deepest leaf
};

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

// Parses template source. Throws TemplateError: kUnsupported for syntax outside the subset, for
// malformed templates and for nesting deeper than max_depth. The depth counted is the one the
// evaluator reaches: one level per enclosing block and per level of the expression tree.
Body parse_template(std::string_view source, int max_depth);

}  // namespace moe::jinja
