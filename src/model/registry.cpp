#include "model/registry.h"

namespace moe {

namespace {
const Architecture kArchitectures[] = {
    {"Qwen3ForCausalLM", parse_qwen3},
    {"Qwen3MoeForCausalLM", parse_qwen3_moe},
    {"MixtralForCausalLM", parse_mixtral},
};
}  // namespace

const Architecture* find_architecture(const std::string& name) {
  for (const auto& a : kArchitectures)
    if (name == a.name) return &a;
  return nullptr;
}

std::string supported_architectures() {
  std::string s;
  for (const auto& a : kArchitectures) s += (s.empty() ? "" : ", ") + std::string(a.name);
  return s;
}

}  // namespace moe
