// Qwen2MoeForCausalLM: Llama attention with q/k/v biases (qkv_bias), Qwen-style sparse layers,
// and a shared expert on every sparse layer whose output is scaled by
// sigmoid(shared_expert_gate · x) before it is added.
#include "model/registry.h"

namespace moe {

void parse_qwen2_moe(const HfConfig& cfg, ModelConfig& mc) {
  parse_decoder_common(cfg, mc);
  mc.qkv_bias = cfg.get_or<bool>({"qkv_bias"}, true);
  mc.o_bias = false;
  parse_qwen_style_moe(cfg, mc);
  mc.moe.shared_intermediate = cfg.get<int64_t>({"shared_expert_intermediate_size"});
  mc.moe.shared_gate = true;
  mc.moe.names.shared = "shared_expert";
}

}  // namespace moe
