// Checked arithmetic of the chat-template interpreter: Python's results wherever they fit in an
// int64 or a double, and otherwise one-line errors instead of undefined behaviour or a signal.
// A result Python would give as a big integer is kUnsupported ("integer overflow: ..."); what
// Python raises (division by zero, float overflow in **, int(inf)) is kInvalidArgument. Internal.
#pragma once

#include <cstdint>

namespace moe::jinja {

int64_t int_add(int64_t a, int64_t b);
int64_t int_sub(int64_t a, int64_t b);
int64_t int_mul(int64_t a, int64_t b);
int64_t int_neg(int64_t a);
int64_t int_abs(int64_t a);
// Python's // and %: the quotient rounds toward minus infinity, the remainder takes the sign of b.
int64_t int_floordiv(int64_t a, int64_t b);
int64_t int_mod(int64_t a, int64_t b);
// a ** b for b >= 0, in O(log b) multiplications.
int64_t int_pow(int64_t a, int64_t b);

double float_floordiv(double a, double b);
double float_mod(double a, double b);
double float_pow(double a, double b);

// Python int(x) of a float: truncates toward zero; fails for nan, inf and values beyond int64.
int64_t float_to_int(double x);

// Number of items of Python's range(start, stop, step), step != 0, without overflow.
uint64_t range_length(int64_t start, int64_t stop, int64_t step);

}  // namespace moe::jinja
