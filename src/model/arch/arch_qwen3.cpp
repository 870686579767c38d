// Qwen3ForCausalLM: the dense baseline. GQA attention with per-head RMSNorm of q and k before the
// rotary embedding (half layout), SwiGLU MLP.
#include "model/registry.h"

namespace moe {

void parse_qwen3(const HfConfig& cfg, ModelConfig& mc) {
  parse_decoder_common(cfg, mc);
  mc.qk_norm = QkNorm::kPerHead;
  mc.moe_layers.assign(static_cast<size_t>(mc.num_layers), false);
}

}  // namespace moe
