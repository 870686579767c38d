// Qwen3MoeForCausalLM: Qwen3 attention; a layer is sparse unless listed in mlp_only_layers, and
// then only every decoder_sparse_step-th layer ((i + 1) % step == 0). Router: softmax over all
// experts, top-k, renormalised when norm_topk_prob.
#include "model/registry.h"

namespace moe {

void parse_qwen3_moe(const HfConfig& cfg, ModelConfig& mc) {
  parse_decoder_common(cfg, mc);
  mc.qk_norm = QkNorm::kPerHead;
  parse_qwen_style_moe(cfg, mc);
}

}  // namespace moe
