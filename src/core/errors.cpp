#include "moe/errors.h"

#include <cstring>

namespace moe {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::kInvalidArgument: return "invalid argument";
    case ErrorKind::kIo: return "io error";
    case ErrorKind::kFormat: return "format error";
    case ErrorKind::kConfig: return "config error";
    case ErrorKind::kShape: return "shape error";
    case ErrorKind::kUnsupported: return "unsupported";
    case ErrorKind::kInternal: return "internal error";
  }
  return "error";
}

namespace {
const char* base_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}
}  // namespace

Error::Error(ErrorKind kind, const std::string& message, const char* file, int line)
    : std::runtime_error(fmt::format("{} [{} at {}:{}]", message, error_kind_name(kind),
                                     base_name(file), line)),
      kind_(kind),
      message_(message),
      file_(file),
      line_(line) {}

}  // namespace moe
