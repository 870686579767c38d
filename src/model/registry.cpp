#include "model/registry.h"

#include <algorithm>

namespace moe {

namespace {
const Architecture kArchitectures[] = {
    {"Qwen3ForCausalLM", parse_qwen3},
    {"Qwen3MoeForCausalLM", parse_qwen3_moe},
    {"Qwen2MoeForCausalLM", parse_qwen2_moe},
    {"OlmoeForCausalLM", parse_olmoe},
    {"MixtralForCausalLM", parse_mixtral},
    {"DeepseekV2ForCausalLM", parse_deepseek_v2},
    {"DeepseekV3ForCausalLM", parse_deepseek_v3},
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

void parse_qwen_style_moe(const HfConfig& cfg, ModelConfig& mc, bool expert_size_is_intermediate) {
  mc.moe.num_experts = cfg.get<int64_t>({"num_experts", "num_local_experts", "n_routed_experts"});
  mc.moe.top_k = cfg.get<int64_t>({"num_experts_per_tok", "moe_top_k"});
  mc.moe.intermediate_size = expert_size_is_intermediate
                                 ? cfg.get<int64_t>({"intermediate_size"})
                                 : cfg.get<int64_t>({"moe_intermediate_size"});
  mc.moe.router = softmax_router(mc.moe.num_experts, mc.moe.top_k,
                                 cfg.get_or<bool>({"norm_topk_prob"}, false));
  int64_t step = cfg.get_or<int64_t>({"decoder_sparse_step"}, 1);
  MOE_CHECK(step >= 1, kConfig, "{}: decoder_sparse_step must be >= 1, got {}", cfg.origin(), step);
  auto only_mlp = cfg.get_or<std::vector<int64_t>>({"mlp_only_layers"}, {});
  for (int64_t i = 0; i < mc.num_layers; ++i) {
    bool listed = std::find(only_mlp.begin(), only_mlp.end(), i) != only_mlp.end();
    mc.moe_layers.push_back(!listed && mc.moe.num_experts > 0 && (i + 1) % step == 0);
  }
}

}  // namespace moe
