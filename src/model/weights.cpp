#include "model/weights.h"

#include <cstdio>

#include <fmt/format.h>

namespace moe {

namespace {

// Gate and up of one FFN into rows [0, inter) and [inter, 2 * inter) of `gate_up`; down into
// `down`. Both destinations are [.., hidden] / [hidden, inter] slices owned by the caller.
void take_ffn(WeightLoader& loader, const std::string& prefix, const MoeNames& n, float* gate_up,
              float* down, int64_t hidden, int64_t inter) {
  loader.take_into(prefix + n.gate + ".weight", {inter, hidden}, gate_up);
  loader.take_into(prefix + n.up + ".weight", {inter, hidden}, gate_up ? gate_up + inter * hidden : nullptr);
  loader.take_into(prefix + n.down + ".weight", {hidden, inter}, down);
}

// The checkpoint tensors behind a fused gate_up and a down, in the order take_ffn writes them.
std::vector<WeightLoader::Part> gate_up_parts(const std::string& prefix, const MoeNames& n, int64_t inter) {
  return {{prefix + n.gate + ".weight", inter}, {prefix + n.up + ".weight", inter}};
}

FfnWeights load_ffn(WeightLoader& loader, const std::string& prefix, int64_t hidden, int64_t inter) {
  FfnWeights w;
  const MoeNames names;
  w.gate_up = loader.allocate({2 * inter, hidden}, gate_up_parts(prefix, names, inter));
  w.down = loader.allocate({hidden, inter}, {{prefix + names.down + ".weight", hidden}});
  take_ffn(loader, prefix, names, w.gate_up.data<float>(), w.down.data<float>(), hidden, inter);
  return w;
}

void load_attention(const ModelConfig& mc, WeightLoader& loader, const std::string& p,
                    AttentionWeights& a) {
  const int64_t h = mc.hidden_size, heads = mc.num_heads;
  if (mc.attention == AttentionKind::kMla) {
    const MlaConfig& m = mc.mla;
    if (m.q_lora_rank > 0) {
      a.q_a = loader.take(p + "self_attn.q_a_proj.weight", {m.q_lora_rank, h});
      a.q_a_norm = loader.take(p + "self_attn.q_a_layernorm.weight", {m.q_lora_rank});
      a.q_b = loader.take(p + "self_attn.q_b_proj.weight", {heads * m.qk_head_dim(), m.q_lora_rank});
    } else {
      a.q = loader.take(p + "self_attn.q_proj.weight", {heads * m.qk_head_dim(), h});
    }
    a.kv_a = loader.take(p + "self_attn.kv_a_proj_with_mqa.weight", {m.kv_lora_rank + m.qk_rope_head_dim, h});
    a.kv_a_norm = loader.take(p + "self_attn.kv_a_layernorm.weight", {m.kv_lora_rank});
    a.kv_b = loader.take(p + "self_attn.kv_b_proj.weight",
                         {heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank});
    a.o = loader.take(p + "self_attn.o_proj.weight", {h, heads * m.v_head_dim});
    return;
  }
  const int64_t hd = mc.head_dim, q_width = heads * hd, kv_width = mc.num_kv_heads * hd;
  a.q = loader.take(p + "self_attn.q_proj.weight", {q_width, h});
  a.k = loader.take(p + "self_attn.k_proj.weight", {kv_width, h});
  a.v = loader.take(p + "self_attn.v_proj.weight", {kv_width, h});
  a.o = loader.take(p + "self_attn.o_proj.weight", {h, q_width});
  if (mc.qkv_bias) {
    a.q_bias = loader.take(p + "self_attn.q_proj.bias", {q_width});
    a.k_bias = loader.take(p + "self_attn.k_proj.bias", {kv_width});
    a.v_bias = loader.take(p + "self_attn.v_proj.bias", {kv_width});
  }
  if (mc.o_bias) a.o_bias = loader.take(p + "self_attn.o_proj.bias", {h});
  if (mc.qk_norm == QkNorm::kPerHead) {
    a.q_norm = loader.take(p + "self_attn.q_norm.weight", {hd});
    a.k_norm = loader.take(p + "self_attn.k_norm.weight", {hd});
  } else if (mc.qk_norm == QkNorm::kFull) {
    a.q_norm = loader.take(p + "self_attn.q_norm.weight", {q_width});
    a.k_norm = loader.take(p + "self_attn.k_norm.weight", {kv_width});
  }
}

void load_moe(const ModelConfig& mc, WeightLoader& loader, const std::string& p,
              const ExpertSelection& sel, MoeWeights& w) {
  const MoeConfig& c = mc.moe;
  const MoeNames& n = c.names;
  const int64_t h = mc.hidden_size, inter = c.intermediate_size;
  const std::string block = p + n.block + ".";
  w.router = loader.take(block + n.router + ".weight", {c.num_experts, h});
  // Cast once here to the router's compute dtype (f32), whatever the checkpoint stores.
  if (c.router.correction_bias)
    w.router_bias = loader.take(block + n.router + ".e_score_correction_bias", {c.num_experts});
  int64_t held = 0;
  for (int64_t e = 0; e < c.num_experts; ++e) held += sel.holds(e);
  ExpertWeights& x = w.experts;
  x.num_local = held;
  x.hidden = h;
  x.inter = inter;
  std::vector<WeightLoader::Part> gate_up, down;
  for (int64_t e = 0; e < c.num_experts; ++e) {
    if (!sel.holds(e)) continue;
    const std::string expert = fmt::format("{}experts.{}.", block, e);
    for (auto& part : gate_up_parts(expert, n, inter)) gate_up.push_back(std::move(part));
    down.push_back({expert + n.down + ".weight", h});
  }
  x.gate_up = loader.allocate({held, 2 * inter, h}, gate_up);
  x.down = loader.allocate({held, h, inter}, down);
  int64_t local = 0;
  for (int64_t e = 0; e < c.num_experts; ++e) {
    if (!sel.holds(e)) {  // another rank's expert: neither read nor reported as unexpected
      for (const std::string* part : {&n.gate, &n.up, &n.down})
        loader.ignore(fmt::format("{}experts.{}.{}.weight", block, e, *part));
      continue;
    }
    float* gu = x.gate_up.defined() ? x.gate_up.data<float>() + local * 2 * inter * h : nullptr;
    float* dn = x.down.defined() ? x.down.data<float>() + local * h * inter : nullptr;
    take_ffn(loader, fmt::format("{}experts.{}.", block, e), n, gu, dn, h, inter);
    ++local;
  }
  if (c.shared_intermediate > 0) {
    w.shared = load_ffn(loader, block + n.shared + ".", h, c.shared_intermediate);
    if (c.shared_gate) w.shared_gate = loader.take(block + "shared_expert_gate.weight", {1, h});
  }
}

}  // namespace

ModelWeights load_weights(const ModelConfig& mc, WeightLoader& loader, const ExpertSelection& sel) {
  ModelWeights w;
  const int64_t h = mc.hidden_size;
  w.embed = loader.take("model.embed_tokens.weight", {mc.vocab_size, h});
  for (int64_t l = 0; l < mc.num_layers; ++l) {
    const std::string p = fmt::format("model.layers.{}.", l);
    LayerWeights lw;
    lw.input_norm = loader.take(p + "input_layernorm.weight", {h});
    lw.post_attention_norm = loader.take(p + "post_attention_layernorm.weight", {h});
    load_attention(mc, loader, p, lw.attn);
    lw.sparse = mc.moe_layers[static_cast<size_t>(l)];
    if (lw.sparse)
      load_moe(mc, loader, p, sel, lw.moe);
    else
      lw.mlp = load_ffn(loader, p + "mlp.", h, mc.intermediate_size);
    w.layers.push_back(std::move(lw));
  }
  w.final_norm = loader.take("model.norm.weight", {h});
  if (mc.tie_word_embeddings) {
    w.lm_head = w.embed;
    loader.ignore("lm_head.weight");  // some writers store the tied copy anyway
  } else {
    w.lm_head = loader.take("lm_head.weight", {mc.vocab_size, h});
  }
  for (int64_t i = 0; i < mc.num_nextn_predict_layers; ++i)
    w.skipped_mtp_tensors += loader.ignore_prefix(fmt::format("model.layers.{}.", mc.num_layers + i));
  return w;
}

void note_random_fp8(const ModelConfig& mc, const char* dtype) {
  if (!mc.quant.fp8) return;
  std::fprintf(stderr, "note: random weights are drawn in %s; the config's FP8 format (%s) is not drawn\n", dtype,
               mc.quant.weight_format().name().c_str());
}

void check_fp8_found(const ModelConfig& mc, const WeightLoader& loader, const std::string& dir) {
  MOE_CHECK(!mc.quant.fp8 || loader.fp8_tensors() > 0, kFormat,
            "{}: quantization_config declares FP8 weights, but no tensor the model uses is F8_E4M3", dir);
}

void note_skipped_mtp(const ModelConfig& mc, const ModelWeights& w) {
  if (w.skipped_mtp_tensors == 0) return;
  const std::string layers = mc.num_nextn_predict_layers == 1
                                 ? fmt::format("model.layers.{}", mc.num_layers)
                                 : fmt::format("model.layers.{}-{}", mc.num_layers,
                                               mc.num_layers + mc.num_nextn_predict_layers - 1);
  std::fprintf(stderr, "note: skipped %lld tensors of the multi-token-prediction layer %s "
               "(num_nextn_predict_layers %lld): not used for decoding\n",
               static_cast<long long>(w.skipped_mtp_tensors), layers.c_str(),
               static_cast<long long>(mc.num_nextn_predict_layers));
}

}  // namespace moe
