#include "model/step_reads.h"

#include <algorithm>

namespace moe {

StepReads step_reads(const ModelConfig& c, int tp, int ep) {
  StepReads r;
  const double h = static_cast<double>(c.hidden_size), heads = static_cast<double>(c.num_heads) / tp;
  const double layers = static_cast<double>(c.num_layers);
  double attn = 0;
  if (c.attention == AttentionKind::kMla) {
    // Each GPU runs its heads' query, absorbed key/value and output projections; the latent
    // projections (q_a, kv_a) and the latent cache are whole on every GPU.
    const MlaConfig& m = c.mla;
    const double qk = static_cast<double>(m.qk_head_dim()), lora = static_cast<double>(m.kv_lora_rank);
    const double rope = static_cast<double>(m.qk_rope_head_dim), vd = static_cast<double>(m.v_head_dim);
    const double q_in = m.q_lora_rank > 0 ? static_cast<double>(m.q_lora_rank) : h;
    attn = (m.q_lora_rank > 0 ? h * q_in : 0) + heads * qk * q_in + h * (lora + rope) +
           heads * lora * (static_cast<double>(m.qk_nope_head_dim) + vd) + heads * vd * h;
    r.kv_token_bytes = layers * (lora + rope) * 2;
    r.attention_width = layers * heads * (2 * lora + rope) / 2;
  } else {
    // Key/value heads split with the query heads, or one each where there are fewer than tp.
    const double hd = static_cast<double>(c.head_dim);
    const double kv_heads = tp == 1 ? static_cast<double>(c.num_kv_heads)
                                    : std::max(1.0, static_cast<double>(c.num_kv_heads) / tp);
    attn = h * (heads + 2 * kv_heads) * hd + heads * hd * h;
    r.kv_token_bytes = layers * 2 * kv_heads * hd * 2;
    r.attention_width = layers * heads * hd;
  }
  const double quantized = c.quant.fp8 ? 1.0 + 4.0 / static_cast<double>(c.quant.block_rows * c.quant.block_cols) : 2.0;
  double kept = 0, converted = 0;  // parameters kept in 16 bits, and in the weights' format
  for (int64_t l = 0; l < c.num_layers; ++l) {
    converted += attn;
    if (c.moe_layers[static_cast<size_t>(l)]) {
      kept += h * static_cast<double>(c.moe.num_experts);
      converted += 3 * h * static_cast<double>(c.moe.shared_intermediate);
      if (c.moe.shared_gate) kept += h;
    } else {
      converted += 3 * h * static_cast<double>(c.intermediate_size);
    }
  }
  kept += h * static_cast<double>(c.vocab_size);  // lm_head (the embedding itself when tied)
  r.fixed = kept + converted;
  r.fixed_bytes = kept * 2 + converted * quantized;
  r.per_expert = 3 * h * static_cast<double>(c.moe.intermediate_size) / ep;
  r.per_expert_bytes = r.per_expert * quantized;
  return r;
}

}  // namespace moe
