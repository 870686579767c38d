// Qwen3MoeForCausalLM: Qwen3 attention; a layer is sparse unless listed in mlp_only_layers, and
// then only every decoder_sparse_step-th layer ((i + 1) % step == 0). Router: softmax over all
// experts, top-k, renormalised when norm_topk_prob.
#include <algorithm>

#include "model/registry.h"

namespace moe {

void parse_qwen3_moe(const HfConfig& cfg, ModelConfig& mc) {
  parse_decoder_common(cfg, mc);
  mc.qk_norm = true;
  mc.rope_style = RopeStyle::kHalf;
  mc.moe.num_experts = cfg.get<int64_t>({"num_experts", "num_local_experts", "n_routed_experts"});
  mc.moe.top_k = cfg.get<int64_t>({"num_experts_per_tok", "moe_top_k"});
  mc.moe.intermediate_size = cfg.get<int64_t>({"moe_intermediate_size"});
  mc.moe.norm_topk_prob = cfg.get_or<bool>({"norm_topk_prob"}, false);
  int64_t step = cfg.get_or<int64_t>({"decoder_sparse_step"}, 1);
  MOE_CHECK(step >= 1, kConfig, "{}: decoder_sparse_step must be >= 1, got {}", cfg.origin(), step);
  auto only_mlp = cfg.get_or<std::vector<int64_t>>({"mlp_only_layers"}, {});
  for (int64_t i = 0; i < mc.num_layers; ++i) {
    bool listed = std::find(only_mlp.begin(), only_mlp.end(), i) != only_mlp.end();
    mc.moe_layers.push_back(!listed && mc.moe.num_experts > 0 && (i + 1) % step == 0);
  }
}

}  // namespace moe
