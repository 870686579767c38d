// MixtralForCausalLM: Llama attention (no q/k norm), every layer sparse. Router: softmax over all
// experts, top-k, always renormalised. Tensors under "block_sparse_moe" with w1 (gate), w3 (up),
// w2 (down).
#include "model/registry.h"

namespace moe {

void parse_mixtral(const HfConfig& cfg, ModelConfig& mc) {
  parse_decoder_common(cfg, mc);
  mc.moe.num_experts = cfg.get<int64_t>({"num_local_experts", "num_experts"});
  mc.moe.top_k = cfg.get<int64_t>({"num_experts_per_tok"});
  mc.moe.intermediate_size = cfg.get<int64_t>({"intermediate_size"});
  mc.moe.router = softmax_router(mc.moe.num_experts, mc.moe.top_k, /*renormalize=*/true);
  mc.moe.names = MoeNames{"block_sparse_moe", "gate", "w1", "w3", "w2", ""};
  MOE_CHECK(!cfg.has({"sliding_window"}), kUnsupported,
            "{}: sliding_window attention is not supported (set it to null for full attention)",
            cfg.origin());
  mc.moe_layers.assign(static_cast<size_t>(mc.num_layers), true);
}

}  // namespace moe
