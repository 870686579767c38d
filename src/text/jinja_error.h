// The error type thrown inside the chat-template interpreter (see jinja.h). Internal.
#pragma once

#include <string>
#include <utility>

#include <fmt/format.h>

#include "moe/errors.h"

namespace moe::jinja {

// Thrown inside the interpreter; Template turns it into a moe::Error naming the template and line.
struct TemplateError {
  ErrorKind kind;
  std::string message;
};

template <typename... A>
[[noreturn]] void fail(ErrorKind kind, fmt::format_string<A...> f, A&&... args) {
  throw TemplateError{kind, fmt::format(f, std::forward<A>(args)...)};
}

}  // namespace moe::jinja
