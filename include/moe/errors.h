// Typed errors. Library code throws these; the tools catch them at the edge and print one line.
#pragma once

#include <stdexcept>
#include <string>

#include <fmt/format.h>

namespace moe {

enum class ErrorKind {
  kInvalidArgument,  // a caller passed something impossible (bad flag, id out of range)
  kIo,               // a file is missing, unreadable or truncated
  kFormat,           // a file exists but its content is malformed (safetensors header, json)
  kConfig,           // a model config lacks a key or holds an unsupported value
  kShape,            // a tensor has the wrong shape or dtype
  kUnsupported,      // valid input that this build cannot handle (architecture, template, device)
  kInternal,         // a broken invariant inside the library
};

const char* error_kind_name(ErrorKind kind);

// Carries what went wrong and where in the source it was detected. what() is one line:
// "<message> [<kind> at <file>:<line>]" so that the tools can print it as it is.
class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, const std::string& message, const char* file, int line);

  ErrorKind kind() const { return kind_; }
  const std::string& message() const { return message_; }
  const char* file() const { return file_; }
  int line() const { return line_; }

 private:
  ErrorKind kind_;
  std::string message_;
  const char* file_;
  int line_;
};

}  // namespace moe

#define MOE_THROW(kind, ...) \
  throw ::moe::Error(::moe::ErrorKind::kind, ::fmt::format(__VA_ARGS__), __FILE__, __LINE__)

#define MOE_CHECK(cond, kind, ...)   \
  do {                               \
    if (!(cond)) MOE_THROW(kind, __VA_ARGS__); \
  } while (0)
