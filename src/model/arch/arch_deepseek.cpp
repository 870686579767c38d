// DeepseekV2ForCausalLM and DeepseekV3ForCausalLM: multi-head latent attention (optional
// q_lora_rank; the compressed KV latent and the shared rotary key are what the cache keeps),
// rotary embedding on the last qk_rope_head_dim features in the interleaved-pair layout, dense
// MLP for the first first_k_dense_replace layers and then a sparse block every moe_layer_freq
// layers, with n_shared_experts folded into one shared MLP whose output is added.
// V2 routes with softmax ("greedy" or "group_limited_greedy"); V3 with "noaux_tc".
#include "model/registry.h"

namespace moe {

namespace {

void parse_deepseek_common(const HfConfig& cfg, ModelConfig& mc) {
  parse_decoder_common(cfg, mc);
  mc.attention = AttentionKind::kMla;
  mc.rope_style = RopeStyle::kInterleaved;
  mc.mla.q_lora_rank = cfg.get_or<int64_t>({"q_lora_rank"}, 0);
  mc.mla.kv_lora_rank = cfg.get<int64_t>({"kv_lora_rank"});
  mc.mla.qk_nope_head_dim = cfg.get<int64_t>({"qk_nope_head_dim"});
  mc.mla.qk_rope_head_dim = cfg.get<int64_t>({"qk_rope_head_dim"});
  mc.mla.v_head_dim = cfg.get<int64_t>({"v_head_dim"});
  // The rotary part is what rotates: its width is the "head_dim" of the rotary embedding.
  mc.head_dim = mc.mla.qk_rope_head_dim;
  mc.num_kv_heads = mc.num_heads;
  mc.moe.num_experts = cfg.get<int64_t>({"n_routed_experts", "num_experts", "num_local_experts"});
  mc.moe.top_k = cfg.get<int64_t>({"num_experts_per_tok"});
  mc.moe.intermediate_size = cfg.get<int64_t>({"moe_intermediate_size"});
  const int64_t shared = cfg.get_or<int64_t>({"n_shared_experts"}, 0);
  MOE_CHECK(shared >= 0, kConfig, "{}: n_shared_experts must be >= 0", cfg.origin());
  mc.moe.shared_intermediate = shared * mc.moe.intermediate_size;
  const int64_t first_dense = cfg.get_or<int64_t>({"first_k_dense_replace"}, 0);
  const int64_t freq = cfg.get_or<int64_t>({"moe_layer_freq"}, 1);
  MOE_CHECK(freq >= 1, kConfig, "{}: moe_layer_freq must be >= 1, got {}", cfg.origin(), freq);
  for (int64_t i = 0; i < mc.num_layers; ++i)
    mc.moe_layers.push_back(mc.moe.num_experts > 0 && i >= first_dense && i % freq == 0);
  // With YaRN, DeepSeek's attention scales its softmax by m^2 as well (transformers and the
  // reference code agree; V2-Lite's mscale_all_dim 0.707 makes it 1.59 at factor 40).
  mc.softmax_scale_factor = static_cast<float>(yarn_softmax_mscale_squared(mc.rope_scaling));
  mc.num_nextn_predict_layers = cfg.get_or<int64_t>({"num_nextn_predict_layers"}, 0);
  MOE_CHECK(mc.num_nextn_predict_layers >= 0, kConfig, "{}: num_nextn_predict_layers must be >= 0, got {}",
            cfg.origin(), mc.num_nextn_predict_layers);
}

void check_scoring(const HfConfig& cfg, const char* expected) {
  const std::string scoring = cfg.get_or<std::string>({"scoring_func"}, expected);
  MOE_CHECK(scoring == expected, kUnsupported, "{}: scoring_func '{}' is not supported for this architecture ({})",
            cfg.origin(), scoring, expected);
}

}  // namespace

void parse_deepseek_v2(const HfConfig& cfg, ModelConfig& mc) {
  parse_deepseek_common(cfg, mc);
  check_scoring(cfg, "softmax");
  RouterConfig& r = mc.moe.router;
  r = softmax_router(mc.moe.num_experts, mc.moe.top_k, /*renormalize=*/false);
  r.scaling = cfg.get_or<float>({"routed_scaling_factor"}, 1.0f);
  std::string method = cfg.get_or<std::string>({"topk_method"}, "greedy");
  if (method == "group_limited_greedy") {
    r.groups = GroupRanking::kMax;
    r.n_group = cfg.get<int64_t>({"n_group"});
    r.topk_group = cfg.get<int64_t>({"topk_group"});
  } else {
    MOE_CHECK(method == "greedy", kUnsupported,
              "{}: topk_method '{}' is not supported for DeepSeek-V2 (greedy, group_limited_greedy)",
              cfg.origin(), method);
  }
}

void parse_deepseek_v3(const HfConfig& cfg, ModelConfig& mc) {
  parse_deepseek_common(cfg, mc);
  check_scoring(cfg, "sigmoid");
  MOE_CHECK(cfg.get_or<bool>({"rope_interleave"}, true), kUnsupported,
            "{}: rope_interleave false is not supported", cfg.origin());
  std::string method = cfg.get_or<std::string>({"topk_method"}, "noaux_tc");
  MOE_CHECK(method == "noaux_tc", kUnsupported,
            "{}: topk_method '{}' is not supported for DeepSeek-V3 (noaux_tc)", cfg.origin(), method);
  RouterConfig& r = mc.moe.router;
  r.num_experts = mc.moe.num_experts;
  r.top_k = mc.moe.top_k;
  r.scoring = RouterScoring::kSigmoid;
  r.groups = GroupRanking::kTop2Sum;
  r.n_group = cfg.get_or<int64_t>({"n_group"}, 1);
  r.topk_group = cfg.get_or<int64_t>({"topk_group"}, 1);
  r.correction_bias = true;
  r.renormalize = cfg.get_or<bool>({"norm_topk_prob"}, true);
  r.scaling = cfg.get_or<float>({"routed_scaling_factor"}, 1.0f);
}

}  // namespace moe
