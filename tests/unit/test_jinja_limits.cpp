// The chat-template interpreter as a sandbox: hostile templates (deep nesting, integer edge
// cases, runaway loops, exploding strings and lists) end in a moe::Error that names the broken
// limit, never in a crash, a signal, a hang or exhausted memory; and real templates stay far
// below the default limits. Expected values of successful renders come from jinja2 3.1 (Python
// semantics) with transformers' environment settings.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "text/chat_template.h"
#include "moe/errors.h"
#include "test_util.h"

namespace {

using ojson = nlohmann::ordered_json;
using moe::ErrorKind;
using moe::jinja::Limits;

constexpr auto npos = std::string::npos;

// The default limits as the messages print them.
const std::string kStepLimit = "step limit (10,000,000 steps)";
const std::string kDepthLimit = "depth limit (128 levels)";
const std::string kValueLimit = "value size limit (8,388,608 bytes)";
const std::string kOutputLimit = "output exceeded its size limit (8,388,608 bytes)";
const std::string kMemoryLimit = "memory limit (67,108,864 bytes built in total)";

std::string times(const std::string& s, int n) {
  std::string out;
  for (int k = 0; k < n; ++k) out += s;
  return out;
}

std::string render(const std::string& source, const Limits& limits = {},
                   const ojson& vars = ojson::object()) {
  return moe::ChatTemplate::from_source(source, "test", {}, {}, limits)
      .render_json(ojson::array(), false, vars);
}

// The error that parsing or rendering `source` ends with.
moe::Error error_of(const std::string& source, const Limits& limits = {},
                    const ojson& vars = ojson::object()) {
  return moe::test::expect_error([&] { render(source, limits, vars); });
}

// Expects `source` to fail with `kind` and a one-line message that contains `text`.
void expect_error(const std::string& source, ErrorKind kind, const std::string& text,
                  const Limits& limits = {}, const ojson& vars = ojson::object()) {
  SCOPED_TRACE(source.size() > 300 ? source.substr(0, 300) + "..." : source);
  const moe::Error e = error_of(source, limits, vars);
  EXPECT_EQ(e.kind(), kind) << e.what();
  EXPECT_NE(e.message().find(text), npos) << e.what();
  EXPECT_EQ(e.message().find('\n'), npos) << e.what();
}

void expect_limit(const std::string& source, const std::string& limit, const Limits& limits = {},
                  const ojson& vars = ojson::object()) {
  expect_error(source, ErrorKind::kUnsupported, limit, limits, vars);
}

std::string config_path(const std::string& name) {
  return std::string(MOE_SOURCE_DIR) + "/.cache/tokenizers/" + name + "/tokenizer_config.json";
}

bool require_config(const std::string& name) {
  if (std::filesystem::exists(config_path(name))) return true;
  ADD_FAILURE() << config_path(name) << " is missing: run scripts/fetch_tokenizers.sh";
  return false;
}

// A long conversation with reasoning, tool calls and tool results.
ojson long_conversation(int turns) {
  ojson messages = ojson::array({{{"role", "system"}, {"content", "You are helpful."}}});
  for (int k = 0; k < turns; ++k) {
    const std::string n = std::to_string(k);
    messages.push_back(
        {{"role", "user"}, {"content", "Question " + n + "? " + times("word ", 50)}});
    const ojson call = {
        {"type", "function"},
        {"function", {{"name", "lookup"}, {"arguments", ojson{{"query", "q" + n}}.dump()}}}};
    messages.push_back({{"role", "assistant"},
                        {"content", "<think>\nplan " + n + "\n</think>\n\nLet me look that up."},
                        {"tool_calls", ojson::array({call})}});
    messages.push_back({{"role", "tool"}, {"content", "result " + n}});
    messages.push_back(
        {{"role", "assistant"}, {"content", "Answer " + n + ". " + times("text ", 50)}});
  }
  return messages;
}

const ojson kTools = ojson::parse(R"([{"type": "function", "function": {"name": "lookup",
    "description": "Looks things up.", "parameters": {"type": "object",
    "properties": {"query": {"type": "string"}}, "required": ["query"]}}}])");

}  // namespace

// ---------------------------------------------------------------------------------------------
// Nesting: an error at parse (or render) time, never a stack overflow.

TEST(JinjaLimits, ThousandsOfNestedParenthesesAreAnError) {
  expect_limit("{{ " + times("(", 3000) + "1" + times(")", 3000) + " }}", kDepthLimit);
  expect_limit("{{ " + times("(", 100000) + "1" + times(")", 100000) + " }}", kDepthLimit);
}

TEST(JinjaLimits, ThousandsOfNestedIfsAreAnError) {
  expect_limit(times("{% if true %}", 3000) + "x" + times("{% endif %}", 3000), kDepthLimit);
  expect_limit(times("{% if true %}", 100000) + "x", kDepthLimit);
}

TEST(JinjaLimits, DeepNestingInEverySyntacticPositionIsAnError) {
  constexpr int n = 3000;
  const std::vector<std::string> expressions = {
      times("[", n) + times("]", n),                 // lists
      times("{'a': ", n) + "1" + times("}", n),      // dicts
      times("not ", n) + "x",                        // not
      times("- ", n) + "1",                          // unary minus
      times("+ ", n) + "1",                          // unary plus
      times("x[", n) + "0" + times("]", n),          // subscripts
      times("x[1:", n) + "2" + times("]", n),        // slices
      times("range(", n) + "1" + times(")", n),      // call arguments
      times("x|default(", n) + "1" + times(")", n),  // filter arguments
      times("1 is eq(", n) + "1" + times(")", n),    // test arguments
      "1" + times(" + 1", n),                        // left-deep operator chains
      "'a'" + times(" ~ 'a'", n),                    //
      "2" + times(" ** 1", n),                       //
      "x" + times(" and x", n),                      //
      "x" + times(" or x", n),                       //
      "x" + times(".a", n),                          // attribute chains
      "x" + times("[0]", n),                         // item chains
      "x" + times("()", n),                          // call chains
      "x" + times("|trim", n),                       // filter chains
      "x" + times(" is eq(x)", n),                   // test chains
  };
  for (const std::string& e : expressions) {
    expect_limit("{{ " + e + " }}", kDepthLimit);
    expect_limit("{% set y = " + e + " %}", kDepthLimit);
    expect_limit("{% if " + e + " %}{% endif %}", kDepthLimit);
    expect_limit("{% for i in " + e + " %}{% endfor %}", kDepthLimit);
  }
  // Conditional expressions (not allowed in the head of an if or a for, as in Jinja2).
  const std::string cond = times("1 if x else ", n) + "2";
  expect_limit("{{ " + cond + " }}", kDepthLimit);
  expect_limit("{% set y = " + cond + " %}", kDepthLimit);
  const std::vector<std::pair<std::string, std::string>> blocks = {
      {"{% if true %}", "{% endif %}"},
      {"{% if false %}{% elif true %}", "{% endif %}"},
      {"{% if false %}{% else %}", "{% endif %}"},
      {"{% for i in [1] %}", "{% endfor %}"},
      {"{% for i in [] %}{% else %}", "{% endfor %}"},
      {"{% set x %}", "{% endset %}"},
      {"{% generation %}", "{% endgeneration %}"},
  };
  for (const auto& [open, close] : blocks)
    expect_limit(times(open, n) + times(close, n), kDepthLimit);
}

TEST(JinjaLimits, NestingBelowTheLimitRenders) {
  Limits small;
  small.max_depth = 24;
  EXPECT_EQ(render("{{ " + times("(", 10) + "7" + times(")", 10) + " }}", small), "7");
  EXPECT_EQ(render(times("{% if true %}", 10) + "x" + times("{% endif %}", 10), small), "x");
  EXPECT_EQ(render("{{ 1" + times(" + 1", 10) + " }}", small), "11");
  EXPECT_EQ(render("{{ " + times("[", 10) + times("]", 10) + "|length }}", small), "1");
  // The same constructs three times as deep break the smaller limit.
  expect_limit("{{ " + times("(", 30) + "7" + times(")", 30) + " }}", "depth limit (24 levels)",
               small);
  expect_limit(times("{% if true %}", 30) + "x" + times("{% endif %}", 30),
               "depth limit (24 levels)", small);
  expect_limit("{{ 1" + times(" + 1", 30) + " }}", "depth limit (24 levels)", small);
}

TEST(JinjaLimits, LongFlatConstructsAreNotNesting) {
  EXPECT_EQ(render("{{ 1" + times(" <= 2", 5000) + " }}"), "True");  // one comparison chain
  EXPECT_EQ(render("{{ [" + times("1, ", 5000) + "1]|length }}"), "5001");
  EXPECT_EQ(render("{% if false %}" + times("{% elif false %}", 5000) + "{% else %}e{% endif %}"),
            "e");
  EXPECT_EQ(render(times("{% if true %}x{% endif %}", 5000)), std::string(5000, 'x'));
}

TEST(JinjaLimits, RenderTimeLimitsCanBeSmallerThanTheParseLimits) {
  auto t = moe::ChatTemplate::from_source(
      times("{% if true %}", 10) + "x" + times("{% endif %}", 10), "test");
  EXPECT_EQ(t.render_json(ojson::array(), false, ojson::object()), "x");
  Limits small;
  small.max_depth = 5;
  t.set_limits(small);
  EXPECT_EQ(t.limits().max_depth, 5);
  const moe::Error e =
      moe::test::expect_error([&] { t.render_json(ojson::array(), false, ojson::object()); });
  EXPECT_EQ(e.kind(), ErrorKind::kUnsupported) << e.what();
  EXPECT_NE(e.message().find("depth limit (5 levels)"), npos) << e.what();
}

TEST(JinjaLimits, DeeplyNestedValuesBuiltAtRenderTimeAreAnError) {
  // Each iteration wraps the list once more: destroying a million-deep list would overflow the
  // stack, so it must never be built.
  expect_limit(
      "{% set ns = namespace(p=[]) %}{% for i in range(50000) %}{% set ns.p = [ns.p] %}"
      "{% endfor %}",
      kDepthLimit);
  expect_limit(
      "{% set ns = namespace(p={}) %}{% for i in range(50000) %}{% set ns.p = {'p': ns.p} %}"
      "{% endfor %}",
      kDepthLimit);
  expect_limit(
      "{% set ns = namespace(p=1) %}{% for i in range(50000) %}{% set ns.p = namespace(p=ns.p) %}"
      "{% endfor %}",
      kDepthLimit);
}

TEST(JinjaLimits, SelfReferenceThroughANamespace) {
  // The only recursive structure the subset can build: a namespace holding itself. Reading
  // through it works; walking it (JSON, comparison) stops at the depth limit.
  EXPECT_EQ(render("{% set ns = namespace(v=1) %}{% set ns.me = ns %}{{ ns.me.me.me.v }}"), "1");
  expect_limit("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns|tojson }}", kDepthLimit);
  expect_limit(
      "{% set a = namespace() %}{% set b = namespace(a=a) %}{% set a.b = b %}{{ [a]|tojson }}",
      kDepthLimit);
  // Namespaces compare by identity, so comparing never walks into one.
  EXPECT_EQ(render("{% set a = namespace() %}{% set a.me = a %}{% set b = namespace() %}"
                   "{% set b.me = b %}{{ [a] == [b] }} {{ [a] == [a] }} {{ a == a }}"),
            "False True True");
}

TEST(JinjaLimits, FiltersAppliedByFiltersAreNesting) {
  // map() applies a filter to each item, and that filter may be map() again: a one-character
  // string iterates to itself, so each 'map' argument is one more level of recursion.
  EXPECT_EQ(render("{{ 'ab'|map('map', 'upper')|map('join')|join(',') }}"), "A,B");
  expect_limit("{{ 'a'|map(" + times("'map', ", 5000) + "'upper')|list }}", kDepthLimit);
  // Within a larger limit, 150 filter names (beyond any fixed argument count) make 151 lists
  // around "A".
  Limits deep;
  deep.max_depth = 300;
  EXPECT_EQ(render("{{ 'a'|map(" + times("'map', ", 150) + "'upper')|list|tojson }}", deep),
            times("[", 151) + "\"A\"" + times("]", 151));
}

TEST(JinjaLimits, DeeplyNestedVariablesAreAnError) {
  const ojson deep = ojson::parse(times("[", 5000) + times("]", 5000));
  expect_limit("{{ x|length }}", kDepthLimit, {}, {{"x", deep}});
  const ojson shallow = ojson::parse(times("[", 50) + "1" + times("]", 50));
  EXPECT_EQ(render("{{ x|tojson }}", {}, {{"x", shallow}}), shallow.dump());
}

// ---------------------------------------------------------------------------------------------
// Integer arithmetic: Python's results where they fit in 64 bits, an error where they do not.

TEST(JinjaArithmetic, Int64MinFloorDividedByMinusOneIsAnErrorNotASignal) {
  expect_error("{{ (-9223372036854775807 - 1) // -1 }}", ErrorKind::kUnsupported,
               "integer overflow");
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) % -1 }}"), "0");
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) // 1 }} {{ (-9223372036854775807 - 1) % 7 }} "
                   "{{ 9223372036854775807 % -2 }}"),
            "-9223372036854775808 6 -1");
}

TEST(JinjaArithmetic, OverflowIsAnError) {
  for (const char* e :
       {"9223372036854775807 + 1", "-9223372036854775807 - 2", "4611686018427387904 * 2",
        "-(-9223372036854775807 - 1)", "2 ** 63", "2 ** 64", "(-2) ** 64", "3 ** 40",
        "2 ** (10**15)", "(-9223372036854775807 - 1)|abs", "1e300|int",
        "'99999999999999999999'|int", "'9223372036854775808'|int"}) {
    SCOPED_TRACE(e);
    const moe::Error err = error_of(std::string("{{ ") + e + " }}");
    EXPECT_EQ(err.kind(), ErrorKind::kUnsupported) << err.what();
    EXPECT_NE(err.message().find("integer overflow"), npos) << err.what();
    EXPECT_NE(err.message().find("does not fit in 64 bits"), npos) << err.what();
  }
  expect_error("{{ 9223372036854775808 }}", ErrorKind::kUnsupported, "does not fit in 64 bits");
  // Just inside the range.
  EXPECT_EQ(render("{{ 9223372036854775806 + 1 }} {{ (-2) ** 63 }} {{ 2 ** 62 }} {{ 3 ** 39 }} "
                   "{{ -9223372036854775807 - 1 }}"),
            "9223372036854775807 -9223372036854775808 4611686018427387904 "
            "4052555153018976267 -9223372036854775808");
}

TEST(JinjaArithmetic, HugeExponentsFinishAtOnce) {
  // Exponentiation by squaring: 10**15 multiplications would hang.
  EXPECT_EQ(render("{{ 1 ** 10**15 }} {{ (-1) ** (10**15 + 1) }} {{ 0 ** 10**15 }}"), "1 -1 0");
}

TEST(JinjaArithmetic, DivisionByZeroIsAnError) {
  for (const char* e : {"1 // 0", "1 % 0", "1 / 0", "1.0 // 0.0", "1.0 % 0", "7 // False"}) {
    SCOPED_TRACE(e);
    const moe::Error err = error_of(std::string("{{ ") + e + " }}");
    EXPECT_EQ(err.kind(), ErrorKind::kInvalidArgument) << err.what();
    EXPECT_NE(err.message().find("by zero"), npos) << err.what();
  }
  expect_error("{{ 0 ** -1 }}", ErrorKind::kInvalidArgument,
               "cannot be raised to a negative power");
  expect_error("{{ 0.0 ** -2 }}", ErrorKind::kInvalidArgument,
               "cannot be raised to a negative power");
  // Modulo by -1 of the most negative integer is 0, not a trap.
  EXPECT_EQ(render("{{ (-9223372036854775807 - 1) is divisibleby(-1) }} "
                   "{{ (-9223372036854775807 - 1) is odd }} {{ -7 is odd }}"),
            "True False True");
}

TEST(JinjaArithmetic, FloorDivisionAndModuloFollowPythonSigns) {
  EXPECT_EQ(render("{{ 7 // -2 }} {{ -7 // 2 }} {{ -7 % -3 }} {{ 7 % -3 }} {{ -7 % 2 }} "
                   "{{ -7.5 // 2 }} {{ 7.5 % -2 }} {{ -0.0 % 5 }} {{ 5.0 % 1e309 }} "
                   "{{ -5.0 % 1e309 }} {{ 5.0 // 1e309 }} {{ -5.0 // 1e309 }}"),
            "-4 -4 -1 -2 1 -4.0 -0.5 0.0 5.0 inf 0.0 -1.0");
}

TEST(JinjaArithmetic, PowersAndFloatOverflow) {
  EXPECT_EQ(render("{{ 10 ** -1 }} {{ 2 ** -2 }} {{ 10.0 ** -400 }}"), "0.1 0.25 0.0");
  // Float arithmetic overflows to inf as in Python; ** raises OverflowError there.
  EXPECT_EQ(render("{{ 1e308 * 10 }} {{ -1e308 * 10 }} {{ 1e309 }} {{ 1e309 - 1e309 }}"),
            "inf -inf inf nan");
  expect_error("{{ 2.0 ** 10000 }}", ErrorKind::kInvalidArgument, "float overflow");
  expect_error("{{ (-8) ** (1/3) }}", ErrorKind::kUnsupported, "complex");
}

TEST(JinjaArithmetic, IntAndFloatConversions) {
  EXPECT_EQ(render("{{ '12abc'|int }} {{ ' 42 '|int }} {{ '4.7'|int }} "
                   "{{ '-9223372036854775808'|int }} {{ '1_000'|int }} {{ '1__0'|int }} "
                   "{{ '1e3'|int }} {{ 'inf'|int }} {{ (1e309 - 1e309)|int }} {{ 4.9|int }} "
                   "{{ -4.9|int }}"),
            "0 42 4 -9223372036854775808 1000 0 1000 0 0 4 -4");
  EXPECT_EQ(render("{{ '1e999'|float }} {{ 'abc'|float }} {{ ' 2.5 '|float }} "
                   "{{ '1_0.5'|float }} {{ '-inf'|float }} {{ 'nan'|float }} {{ '0x10'|float }}"),
            "inf 0.0 2.5 10.5 -inf nan 0.0");
  expect_error("{{ (1e308 * 10)|int }}", ErrorKind::kInvalidArgument, "infinity");
}

TEST(JinjaArithmetic, RangeWithExtremeArguments) {
  EXPECT_EQ(render("{{ range(9223372036854775806, 9223372036854775807, 5)|list }} "
                   "{{ range(0, 10, -9223372036854775807 - 1)|list }} "
                   "{{ range(9223372036854775807, -9223372036854775807 - 1, "
                   "-9223372036854775807 - 1)|list }}"),
            "[9223372036854775806] [] [9223372036854775807, -1]");
  expect_error("{{ range(1, 2, 0) }}", ErrorKind::kInvalidArgument, "step");
}

TEST(JinjaArithmetic, HugeRangeFailsBeforeAllocating) {
  expect_limit("{{ range(10**15)|length }}", kValueLimit);
  expect_limit("{{ range(-9223372036854775807 - 1, 9223372036854775807)|length }}", kValueLimit);
  // The nested million-by-million loop: the first million-item list is already too large.
  expect_limit("{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}",
               kValueLimit);
}

TEST(JinjaArithmetic, SlicesWithExtremeBoundsAndSteps) {
  EXPECT_EQ(render("{{ [1,2,3][::9223372036854775807] }} {{ [1,2,3][::-9223372036854775807-1] }} "
                   "{{ 'abc'[::-9223372036854775807 - 1] }} "
                   "{{ [1,2,3][-9223372036854775807-1:9223372036854775807] }}|"
                   "{{ 'héllo'[9223372036854775807:] }}|{{ 'héllo'[::2] }}|"
                   "{{ 'héllo'[::-2] }}|{{ 'héllo'[-2::-1] }}|{{ 'héllo'[1:-1] }}|"
                   "{{ 'héllo'[-9223372036854775807-1::3] }}|"
                   "{{ [1,2,3,4,5][-2:-9223372036854775807:-2] }} {{ 'abc'[5:1:-1] }}"),
            "[1] [3] c [1, 2, 3]||hlo|olh|lléh|éll|hl|[4, 2] c");
  EXPECT_EQ(render("{{ [1,2][-9223372036854775807-1] }}|{{ 'ab'[9223372036854775807] }}|"
                   "{{ 'héllo'[-4] }}|{{ 'héllo'[1] }}"),
            "||é|é");
  expect_error("{{ [1][::0] }}", ErrorKind::kInvalidArgument, "zero");
}

TEST(JinjaArithmetic, RepetitionCounts) {
  EXPECT_EQ(render("{{ 'ab' * -3 }}|{{ [1] * -1 }}|{{ 3 * 'ab' }}|{{ 2 * [1, 2] }}|{{ 'ab' * 0 }}"),
            "|[]|ababab|[1, 2, 1, 2]|");
}

// ---------------------------------------------------------------------------------------------
// Text walked by character: the same characters forwards and backwards, invalid bytes included.

TEST(JinjaText, CharactersAreTheSameForwardsAndBackwards) {
  const std::vector<std::string> texts = {
      "h\xC3\xA9llo",  // valid two-byte character
      "a\xFF"
      "b\xC3",                     // stray and truncated bytes
      "\xF0\x9F\x98\x80\x80\x80",  // emoji, then stray continuation bytes
      "\xE2\x80",                  // truncated three-byte sequence
      "\xC3\xC3\xA9",              // bad lead byte before a valid character
      "\xED\xA0\x80x",             // encoded surrogate (invalid)
      "\xF4\x90\x80\x80",          // beyond U+10FFFF (invalid)
  };
  for (const std::string& s : texts) {
    SCOPED_TRACE(ojson(s).dump(-1, ' ', true, ojson::error_handler_t::replace));
    const ojson vars = {{"s", s}};
    const std::string forward = render("{{ s|list|reverse|join('') }}", {}, vars);
    EXPECT_EQ(render("{{ s|reverse }}", {}, vars), forward);
    EXPECT_EQ(render("{{ s[::-1] }}", {}, vars), forward);
    EXPECT_EQ(render("{{ s|length }}", {}, vars), render("{{ s|list|length }}", {}, vars));
    EXPECT_EQ(render("{{ s|last }}", {}, vars), render("{{ (s|list)[-1] }}", {}, vars));
    EXPECT_EQ(render("{{ s[-1] }}", {}, vars), render("{{ (s|list)[-1] }}", {}, vars));
    EXPECT_EQ(render("{{ s[::2] }}", {}, vars), render("{{ (s|list)[::2]|join('') }}", {}, vars));
    EXPECT_EQ(render("{{ s[::-3] }}", {}, vars), render("{{ (s|list)[::-3]|join('') }}", {}, vars));
  }
  EXPECT_EQ(
      render("{{ 'h\xC3\xA9llo'|reverse }}|{{ 'h\xC3\xA9llo'|first }}|{{ 'h\xC3\xA9llo'|last }}|"
             "{{ 'h\xC3\xA9llo'|length }}"),
      "oll\xC3\xA9h|h|o|5");
}

TEST(JinjaText, StringMethodsKeepPythonResults) {
  EXPECT_EQ(render("{{ ' a b '.split() }} {{ 'a,b,,c'.split(',', 1) }} "
                   "{{ ' a  b c '.split(None, 1) }} {{ 'aXbXc'.replace('X', '--', 1) }} "
                   "{{ 'ab'.replace('', '-') }} {{ 'abc'.replace('', '-', 2) }} "
                   "{{ 'h\xC3\xA9llo'.find('l') }} {{ 'aaa'.count('') }} {{ 'aaaa'.count('aa') }}"),
            "['a', 'b'] ['a', 'b,,c'] ['a', 'b c '] a--bXc -a-b- -a-bc 2 4 2");
  EXPECT_EQ(render("{{ '  x  '.strip() }}|{{ 'xxhixx'.strip('x') }}|"
                   "{{ 'h\xC3\xA9\xC3\xA9'.rstrip('\xC3\xA9') }}|{{ '\xE2\x80\x83 hi "
                   "\xE2\x80\x83'.strip() }}|"),
            "x|hi|h|hi|");
}

TEST(JinjaText, SubstringSearchStaysLinear) {
  // A naive search takes |haystack| * |needle| = 5 * 10^11 steps here.
  EXPECT_EQ(render("{% set h = 'a' * 1000000 %}{% set n = 'a' * 500000 ~ 'b' %}"
                   "{{ n in h }}|{{ h.find(n) }}|{{ h.count(n) }}|{{ h.split(n)|length }}|"
                   "{{ h.replace(n, 'x')|length }}"),
            "False|-1|0|1|1000000");
}

// ---------------------------------------------------------------------------------------------
// Steps, output, value size and memory.

TEST(JinjaLimits, RunawayLoopsHitTheStepLimit) {
  expect_limit(
      "{% for i in range(1000) %}{% for j in range(1000) %}{% for k in range(1000) %}"
      "{% endfor %}{% endfor %}{% endfor %}",
      kStepLimit);
  expect_limit(
      "{% set r = range(50000) %}{% for i in r %}{% for j in r %}{{ '' }}{% endfor %}{% endfor %}",
      kStepLimit);
  expect_limit(
      "{% set ns = namespace(n=0) %}{% set r = range(50000) %}{% for i in r %}{% for j in r %}"
      "{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}",
      kStepLimit);
}

TEST(JinjaLimits, StepLimitIsConfigurable) {
  Limits small;
  small.max_steps = 1000;
  EXPECT_EQ(render("{% for i in range(10) %}{{ i }}{% endfor %}", small), "0123456789");
  expect_limit("{% for i in range(2000) %}{{ i }}{% endfor %}", "step limit (1,000 steps)", small);
}

TEST(JinjaLimits, ScanningLongStringsCostsSteps) {
  Limits small;
  small.max_steps = 20000;
  // One `in` over 100,000 bytes is cheap in nodes but not in work.
  EXPECT_EQ(
      render("{% set s = 'a' * 1000 %}{% for i in range(10) %}{{ 'b' in s }}{% endfor %}", small),
      times("False", 10));
  expect_limit("{% set s = 'a' * 100000 %}{% for i in range(10) %}{{ 'b' in s }}{% endfor %}",
               "step limit (20,000 steps)", small);
}

TEST(JinjaLimits, QuadraticBuiltinsAreCharged) {
  Limits small;
  small.max_steps = 100000;
  EXPECT_EQ(render("{{ range(100)|unique|list|length }}", small), "100");
  expect_limit("{{ range(1000)|unique|list|length }}", "step limit (100,000 steps)", small);
  // Stripping a long string of a long set of characters compares every pair.
  EXPECT_EQ(render("{{ ('a' * 1000).strip('b' * 100 ~ 'a')|length }}", small), "0");
  expect_limit("{{ ('a' * 100000).strip('b' * 100000 ~ 'a')|length }}",
               "step limit (100,000 steps)", small);
  // Structures that share their halves: comparing two of them walks 2^60 leaves.
  expect_limit(
      "{% set ns = namespace(t=[1], u=[1]) %}{% for i in range(60) %}"
      "{% set ns.t = [ns.t, ns.t] %}{% set ns.u = [ns.u, ns.u] %}{% endfor %}{{ ns.t == ns.u }}",
      kStepLimit);
}

TEST(JinjaLimits, StringRepetitionFailsBeforeAllocating) {
  expect_limit("{{ 'a' * 10**10 }}", kValueLimit);
  expect_limit("{{ 'a' * 10**10 }}", "a string of 10,000,000,000 bytes");
  expect_limit("{{ 10**10 * 'a' }}", kValueLimit);
  expect_limit("{{ 'ab' * 9223372036854775807 }}", kValueLimit);
  expect_limit("{{ [1] * 10**10 }}", kValueLimit);
  expect_limit("{{ [1, 2] * 9223372036854775807 }}", kValueLimit);
}

TEST(JinjaLimits, DoublingInsideLoopsHitsTheValueSizeLimit) {
  expect_limit(
      "{% set ns = namespace(s='a') %}{% for i in range(100) %}{% set ns.s = ns.s + ns.s %}"
      "{% endfor %}",
      "a string of 16,777,216 bytes would exceed the " + kValueLimit);
  expect_limit(
      "{% set ns = namespace(s='a') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}"
      "{% endfor %}",
      kValueLimit);
  expect_limit(
      "{% set ns = namespace(l=[1]) %}{% for i in range(100) %}{% set ns.l = ns.l + ns.l %}"
      "{% endfor %}",
      kValueLimit);
  expect_limit(
      "{% set ns = namespace(l=[1]) %}{% for i in range(100) %}{% set ns.l = ns.l * 2 %}"
      "{% endfor %}",
      kValueLimit);
}

TEST(JinjaLimits, BuiltinsWithHugeResultsFailBeforeAllocating) {
  expect_limit("{{ ('a' * 1000)|replace('a', 'a' * 10000) }}", "a string of 10,000,000 bytes");
  expect_limit("{{ 'ab'.replace('', 'x' * 5000000) }}", kValueLimit);
  expect_limit("{{ [1]|tojson(indent=10**12) }}", kValueLimit);
  expect_limit("{{ ('x' * 100000)|list|length }}", kValueLimit);
  expect_limit("{{ ('x ' * 4000000).split()|length }}", kValueLimit);
  expect_limit("{{ ('x' * 3000000)|escape|length }} {{ ('&' * 3000000)|escape|length }}",
               kValueLimit);
  // A structure that shares its halves is small, its text is not.
  Limits small;
  small.max_value_bytes = 10000;
  const std::string tree =
      "{% set ns = namespace(t=[1]) %}{% for i in range(60) %}{% set ns.t = [ns.t, ns.t] %}"
      "{% endfor %}";
  EXPECT_EQ(render(tree + "{{ ns.t|length }}", small), "2");
  expect_limit(tree + "{{ ns.t|tojson }}", "value size limit (10,000 bytes)", small);
  expect_limit(tree + "{{ ns.t }}", "value size limit (10,000 bytes)", small);
}

TEST(JinjaLimits, SetBlockCapturesAreValues) {
  expect_limit(
      "{% set x %}{% for i in range(90000) %}{{ 'y' * 100 }}{% endfor %}{% endset %}{{ x|length }}",
      kValueLimit);
}

TEST(JinjaLimits, OutputLimit) {
  expect_limit("{% for i in range(90000) %}{{ 'x' * 100 }}{% endfor %}", kOutputLimit);
  Limits small;
  small.max_output_bytes = 10;
  EXPECT_EQ(render("{{ 'abcdefghij' }}", small), "abcdefghij");
  EXPECT_EQ(render("abcde{{ 'fghij' }}", small), "abcdefghij");
  expect_limit("{{ 'abcdefghijk' }}", "output exceeded its size limit (10 bytes)", small);
  expect_limit("abcdefghijk", "output exceeded its size limit (10 bytes)", small);
}

TEST(JinjaLimits, MemoryLimitCountsEverythingBuilt) {
  // Each string is within the value size limit; together they are not within the memory limit.
  std::string source = "{% set ns = namespace() %}";
  for (char c = 'a'; c <= 'j'; ++c) source += std::string("{% set ns.") + c + " = 'x' * 8000000 %}";
  expect_limit(source, kMemoryLimit);
  Limits small;
  small.max_memory_bytes = 100000;
  EXPECT_EQ(render("{{ ('a' * 1000)|length }}", small), "1000");
  expect_limit("{% for i in range(100) %}{% set x = 'a' * 2000 %}{% endfor %}",
               "memory limit (100,000 bytes built in total)", small);
}

// ---------------------------------------------------------------------------------------------
// Messages and the lexer.

TEST(JinjaLimits, RaisedMessagesStayOneLine) {
  const moe::Error e = error_of("{{ raise_exception('first\nsecond' ~ 'x' * 100000) }}");
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument) << e.what();
  EXPECT_NE(e.message().find("first second"), npos) << e.what();
  EXPECT_EQ(e.message().find('\n'), npos) << e.what();
  EXPECT_LT(e.message().size(), 2000u);
}

TEST(JinjaLimits, MalformedLiteralsAreErrors) {
  expect_error("{{ '\\xZZ' }}", ErrorKind::kUnsupported, "bad \\x escape");
  expect_error("{{ '\\u12' }}", ErrorKind::kUnsupported, "bad \\u escape");
  expect_error("{{ 99999999999999999999 }}", ErrorKind::kUnsupported, "does not fit in 64 bits");
  expect_error("{{ \x01 }}", ErrorKind::kUnsupported, "unexpected byte 0x01");
  EXPECT_EQ(render("{{ 1e999 }} {{ '\\x41\\u00e9' }}"), "inf A\xC3\xA9");
  expect_error("{{ x }}", ErrorKind::kUnsupported, "does not fit in 64 bits", {},
               {{"x", 18446744073709551615ull}});
}

// ---------------------------------------------------------------------------------------------
// Real templates: far below the limits, and safe to render from many threads at once.

TEST(JinjaLimits, RealTemplatesRenderWithATenthOfTheDefaults) {
  Limits tenth;
  tenth.max_steps /= 10;
  tenth.max_output_bytes /= 10;
  tenth.max_value_bytes /= 10;
  tenth.max_memory_bytes /= 10;
  tenth.max_depth = 32;
  for (const char* name : {"qwen3", "deepseek_v3"}) {
    SCOPED_TRACE(name);
    if (!require_config(name)) continue;
    auto t = moe::ChatTemplate::from_tokenizer_config(config_path(name));
    ojson messages = long_conversation(100);
    if (std::string(name) == "deepseek_v3")  // its tool calls carry no content
      for (auto& m : messages)
        if (m.contains("tool_calls")) m["content"] = nullptr;
    const ojson extra = {{"tools", kTools}};
    const std::string full = t.render_json(messages, true, extra);
    EXPECT_GT(full.size(), 50000u);
    auto small =
        moe::ChatTemplate::from_source(t.source(), name, t.bos_token(), t.eos_token(), tenth);
    EXPECT_EQ(small.render_json(messages, true, extra), full);
  }
}

TEST(JinjaLimits, OneTemplateRendersOnManyThreadsAtOnce) {
  if (!require_config("qwen3")) return;
  const auto t = moe::ChatTemplate::from_tokenizer_config(config_path("qwen3"));
  const ojson messages = long_conversation(20);
  const ojson extra = {{"tools", kTools}};
  const std::string expected = t.render_json(messages, true, extra);
  std::vector<std::string> got(8);
  std::vector<std::thread> threads;
  for (size_t k = 0; k < got.size(); ++k)
    threads.emplace_back([&, k] {
      for (int round = 0; round < 20; ++round) {
        std::string out = t.render_json(messages, true, extra);
        if (out != expected) {
          got[k] = out;
          return;
        }
      }
      got[k] = expected;
    });
  for (auto& th : threads) th.join();
  for (const std::string& g : got) EXPECT_EQ(g, expected);
}

TEST(JinjaLimits, ChatTemplateCarriesItsLimits) {
  auto t = moe::ChatTemplate::from_source("{{ 'x' * 20 }}", "test");
  EXPECT_EQ(t.limits().max_steps, Limits{}.max_steps);
  EXPECT_EQ(t.render({}, false), std::string(20, 'x'));
  Limits small;
  small.max_output_bytes = 19;
  t.set_limits(small);
  EXPECT_EQ(t.limits().max_output_bytes, 19u);
  const moe::Error e = moe::test::expect_error([&] { t.render({}, false); });
  EXPECT_EQ(e.kind(), ErrorKind::kUnsupported) << e.what();
  EXPECT_NE(e.message().find("output exceeded its size limit (19 bytes)"), npos) << e.what();
  // The limits given to from_source apply to the parse too.
  Limits shallow;
  shallow.max_depth = 4;
  const std::string nested = times("{% if true %}", 6) + "x" + times("{% endif %}", 6);
  EXPECT_EQ(moe::ChatTemplate::from_source(nested, "test").render({}, false), "x");
  const moe::Error p = moe::test::expect_error(
      [&] { moe::ChatTemplate::from_source(nested, "test", {}, {}, shallow); });
  EXPECT_EQ(p.kind(), ErrorKind::kUnsupported) << p.what();
  EXPECT_NE(p.message().find("depth limit (4 levels)"), npos) << p.what();
}
