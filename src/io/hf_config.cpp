#include "io/hf_config.h"

#include "io/regular_file.h"

namespace moe {

namespace {
// Configs are a few kilobytes; the bound only keeps a huge file from being read into memory.
constexpr uint64_t kMaxConfigBytes = 64ull << 20;
}  // namespace

HfConfig::HfConfig(nlohmann::json root, std::string origin)
    : root_(std::move(root)), origin_(std::move(origin)) {
  MOE_CHECK(root_.is_object(), kFormat, "{} is not a JSON object", origin_);
}

HfConfig HfConfig::from_file(const std::string& path) {
  const std::string text = read_regular_file(path, kMaxConfigBytes);
  nlohmann::json root;
  try {
    root = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    MOE_THROW(kFormat, "{} is not valid JSON ({})", path, e.what());
  }
  return HfConfig(std::move(root), path);
}

const nlohmann::json* HfConfig::find(std::initializer_list<const char*> aliases) const {
  for (const char* alias : aliases) {
    const nlohmann::json* node = &root_;
    std::string path(alias);
    size_t start = 0;
    while (node) {
      size_t dot = path.find('.', start);
      std::string part = path.substr(start, dot == std::string::npos ? dot : dot - start);
      auto it = node->is_object() ? node->find(part) : node->end();
      node = (node->is_object() && it != node->end()) ? &*it : nullptr;
      if (dot == std::string::npos) break;
      start = dot + 1;
    }
    if (node && !node->is_null()) return node;
  }
  return nullptr;
}

std::string HfConfig::describe(std::initializer_list<const char*> aliases) {
  std::string s;
  size_t i = 0;
  for (const char* a : aliases) {
    s += (i == 0 ? "'" : (i + 1 == aliases.size() ? "' or '" : "', '"));
    s += a;
    ++i;
  }
  return s + "'";
}

}  // namespace moe
