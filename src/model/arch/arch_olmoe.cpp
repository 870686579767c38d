// OlmoeForCausalLM: RMSNorm over the whole q and k projections (before the heads are split),
// optional clamping of q, k, v (clip_qkv), every layer sparse, softmax router.
#include "model/registry.h"

namespace moe {

void parse_olmoe(const HfConfig& cfg, ModelConfig& mc) {
  parse_decoder_common(cfg, mc);
  mc.qk_norm = QkNorm::kFull;
  mc.clip_qkv = cfg.get_or<float>({"clip_qkv"}, 0.0f);
  MOE_CHECK(mc.clip_qkv >= 0.0f, kConfig, "{}: clip_qkv must be >= 0", cfg.origin());
  parse_qwen_style_moe(cfg, mc, /*expert_size_is_intermediate=*/true);
  MOE_CHECK(mc.num_moe_layers() == mc.num_layers, kConfig,
            "{}: OLMoE has sparse MoE blocks on every layer", cfg.origin());
}

}  // namespace moe
