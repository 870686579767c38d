#include "model/weights.h"

#include <fmt/format.h>

namespace moe {

namespace {

FfnWeights load_ffn(WeightLoader& loader, Arena& arena, const std::string& prefix,
                    const std::string& gate, const std::string& up, const std::string& down,
                    int64_t hidden, int64_t inter) {
  FfnWeights w;
  w.gate_up = Tensor::empty(arena, {2 * inter, hidden});
  loader.take_into(prefix + gate + ".weight", {inter, hidden}, w.gate_up.data<float>());
  loader.take_into(prefix + up + ".weight", {inter, hidden},
                   w.gate_up.data<float>() + inter * hidden);
  w.down = loader.take(prefix + down + ".weight", {hidden, inter});
  return w;
}

}  // namespace

ModelWeights load_weights(const ModelConfig& mc, WeightLoader& loader, Arena& arena) {
  ModelWeights w;
  const int64_t h = mc.hidden_size, hd = mc.head_dim;
  w.embed = loader.take("model.embed_tokens.weight", {mc.vocab_size, h});
  for (int64_t l = 0; l < mc.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    LayerWeights lw;
    lw.input_norm = loader.take(p + "input_layernorm.weight", {h});
    lw.post_attention_norm = loader.take(p + "post_attention_layernorm.weight", {h});
    AttentionWeights& a = lw.attn;
    a.q = loader.take(p + "self_attn.q_proj.weight", {mc.num_heads * hd, h});
    a.k = loader.take(p + "self_attn.k_proj.weight", {mc.num_kv_heads * hd, h});
    a.v = loader.take(p + "self_attn.v_proj.weight", {mc.num_kv_heads * hd, h});
    a.o = loader.take(p + "self_attn.o_proj.weight", {h, mc.num_heads * hd});
    if (mc.attention_bias) {
      a.q_bias = loader.take(p + "self_attn.q_proj.bias", {mc.num_heads * hd});
      a.k_bias = loader.take(p + "self_attn.k_proj.bias", {mc.num_kv_heads * hd});
      a.v_bias = loader.take(p + "self_attn.v_proj.bias", {mc.num_kv_heads * hd});
    }
    if (mc.qk_norm) {
      a.q_norm = loader.take(p + "self_attn.q_norm.weight", {hd});
      a.k_norm = loader.take(p + "self_attn.k_norm.weight", {hd});
    }
    lw.sparse = mc.moe_layers[static_cast<size_t>(l)];
    if (lw.sparse) {
      const MoeNames& n = mc.moe.names;
      const std::string block = p + n.block + ".";
      lw.moe.router = loader.take(block + n.router + ".weight", {mc.moe.num_experts, h});
      for (int64_t e = 0; e < mc.moe.num_experts; ++e)
        lw.moe.experts.push_back(load_ffn(loader, arena, fmt::format("{}experts.{}.", block, e),
                                          n.gate, n.up, n.down, h, mc.moe.intermediate_size));
    } else {
      lw.mlp = load_ffn(loader, arena, p + "mlp.", "gate_proj", "up_proj", "down_proj", h,
                        mc.intermediate_size);
    }
    w.layers.push_back(std::move(lw));
  }
  w.final_norm = loader.take("model.norm.weight", {h});
  if (mc.tie_word_embeddings) {
    w.lm_head = w.embed;
    loader.ignore("lm_head.weight");  // some writers store the tied copy anyway
  } else {
    w.lm_head = loader.take("lm_head.weight", {mc.vocab_size, h});
  }
  return w;
}

}  // namespace moe
