#include "model/config.h"

#include <filesystem>

#include "model/registry.h"

namespace moe {

namespace fs = std::filesystem;

int64_t ModelConfig::num_moe_layers() const {
  int64_t n = 0;
  for (bool b : moe_layers) n += b;
  return n;
}

int64_t ModelConfig::kv_key_width() const {
  return attention == AttentionKind::kMla ? mla.kv_lora_rank + mla.qk_rope_head_dim
                                          : num_kv_heads * head_dim;
}

int64_t ModelConfig::kv_value_width() const {
  return attention == AttentionKind::kMla ? 0 : num_kv_heads * head_dim;
}

RopeTable ModelConfig::rope() const { return rope_table(rope_scaling, rope_theta, head_dim); }

void parse_decoder_common(const HfConfig& cfg, ModelConfig& mc) {
  mc.vocab_size = cfg.get<int64_t>({"vocab_size"});
  mc.hidden_size = cfg.get<int64_t>({"hidden_size", "d_model", "n_embd"});
  mc.num_layers = cfg.get<int64_t>({"num_hidden_layers", "num_layers", "n_layer"});
  mc.num_heads = cfg.get<int64_t>({"num_attention_heads", "n_head"});
  mc.num_kv_heads = cfg.get_or<int64_t>({"num_key_value_heads", "num_kv_heads"}, mc.num_heads);
  mc.head_dim = cfg.get_or<int64_t>({"head_dim"}, mc.num_heads ? mc.hidden_size / mc.num_heads : 0);
  mc.intermediate_size = cfg.get_or<int64_t>({"intermediate_size", "ffn_dim"}, 0);
  mc.max_position_embeddings = cfg.get_or<int64_t>({"max_position_embeddings"}, 4096);
  mc.rms_norm_eps = cfg.get_or<float>({"rms_norm_eps", "layer_norm_epsilon"}, 1e-6f);
  mc.rope_theta = cfg.get_or<float>({"rope_theta", "rope_parameters.rope_theta"}, 10000.0f);
  mc.tie_word_embeddings = cfg.get_or<bool>({"tie_word_embeddings"}, false);
  mc.qkv_bias = mc.o_bias = cfg.get_or<bool>({"attention_bias"}, false);
  mc.rope_scaling = parse_rope_scaling(cfg, mc.max_position_embeddings);
  // YaRN stretches the original context by its factor; where config.json keeps the original
  // length (Qwen3's recipe adds rope_scaling to a 40,960-position config), the stretched one is
  // the model's context, as vLLM reads it.
  if (mc.rope_scaling.type == RopeType::kYarn) {
    const double stretched = static_cast<double>(mc.rope_scaling.original_max_position) * mc.rope_scaling.factor;
    if (stretched > static_cast<double>(mc.max_position_embeddings) && stretched < 1e12)
      mc.max_position_embeddings = static_cast<int64_t>(stretched);
  }
  const double partial = cfg.get_or<double>({"partial_rotary_factor"}, 1.0);
  MOE_CHECK(partial == 1.0, kUnsupported, "{}: partial_rotary_factor {} is not supported (only 1)", cfg.origin(),
            partial);
  // Not implemented, so refused rather than ignored: the weights would be read wrongly.
  if (const auto* q = cfg.find({"quantization_config"})) {
    const auto method = q->is_object() && q->contains("quant_method") ? q->at("quant_method").dump() : q->dump();
    MOE_THROW(kUnsupported,
              "{}: quantization_config (quant_method {}) is not supported yet: the engine loads F32, BF16 "
              "and F16 weights only",
              cfg.origin(), method);
  }
  std::string act = cfg.get_or<std::string>({"hidden_act", "hidden_activation"}, "silu");
  MOE_CHECK(act == "silu", kUnsupported, "{}: hidden_act '{}' is not supported (only 'silu')",
            cfg.origin(), act);
  MOE_CHECK(!cfg.get_or<bool>({"use_sliding_window"}, false), kUnsupported,
            "{}: sliding-window attention is not supported", cfg.origin());
  if (const auto* eos = cfg.find({"eos_token_id"})) {
    if (eos->is_array())
      for (const auto& e : *eos) mc.eos_token_ids.push_back(e.get<int32_t>());
    else if (eos->is_number_integer())
      mc.eos_token_ids.push_back(eos->get<int32_t>());
  }
  mc.bos_token_id = cfg.get_or<int32_t>({"bos_token_id"}, -1);
}

void validate_model_config(const ModelConfig& mc, const std::string& origin) {
  auto positive = [&](int64_t v, const char* name) {
    MOE_CHECK(v > 0, kConfig, "{}: {} must be positive, got {}", origin, name, v);
  };
  positive(mc.vocab_size, "vocab_size");
  positive(mc.hidden_size, "hidden_size");
  positive(mc.num_layers, "num_hidden_layers");
  positive(mc.num_heads, "num_attention_heads");
  positive(mc.num_kv_heads, "num_key_value_heads");
  positive(mc.head_dim, "head_dim");
  MOE_CHECK(mc.head_dim % 2 == 0, kConfig, "{}: head_dim {} must be even for rotary embeddings",
            origin, mc.head_dim);
  MOE_CHECK(mc.num_heads % mc.num_kv_heads == 0, kConfig,
            "{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", origin,
            mc.num_heads, mc.num_kv_heads);
  MOE_CHECK(static_cast<int64_t>(mc.moe_layers.size()) == mc.num_layers, kInternal,
            "{}: layer kinds not set for every layer", origin);
  bool any_dense = false;
  for (bool b : mc.moe_layers) any_dense |= !b;
  if (any_dense) positive(mc.intermediate_size, "intermediate_size");
  if (mc.num_moe_layers() > 0) {
    positive(mc.moe.num_experts, "the number of experts");
    positive(mc.moe.intermediate_size, "the expert intermediate size");
    MOE_CHECK(mc.moe.router.num_experts == mc.moe.num_experts && mc.moe.router.top_k == mc.moe.top_k,
              kInternal, "{}: router and MoE block disagree", origin);
    validate_router(mc.moe.router, origin);
  }
  if (mc.attention == AttentionKind::kMla) {
    positive(mc.mla.kv_lora_rank, "kv_lora_rank");
    positive(mc.mla.qk_nope_head_dim, "qk_nope_head_dim");
    positive(mc.mla.qk_rope_head_dim, "qk_rope_head_dim");
    positive(mc.mla.v_head_dim, "v_head_dim");
    MOE_CHECK(mc.mla.qk_rope_head_dim % 2 == 0, kConfig, "{}: qk_rope_head_dim must be even", origin);
  }
  for (int32_t id : mc.eos_token_ids)
    MOE_CHECK(id >= 0, kConfig, "{}: negative eos_token_id {}", origin, id);
}

ModelConfig load_model_config(const std::string& dir) {
  MOE_CHECK(fs::is_directory(dir), kIo, "model directory {} does not exist", dir);
  std::string path = (fs::path(dir) / "config.json").string();
  HfConfig cfg = HfConfig::from_file(path);
  const auto* archs = cfg.find({"architectures"});
  MOE_CHECK(archs && archs->is_array() && !archs->empty() && (*archs)[0].is_string(), kConfig,
            "{}: missing key 'architectures' (a list naming the model class)", path);
  std::string arch = (*archs)[0].get<std::string>();
  const Architecture* spec = find_architecture(arch);
  MOE_CHECK(spec != nullptr, kUnsupported, "{}: unknown architecture '{}' (supported: {})", path,
            arch, supported_architectures());
  ModelConfig mc;
  mc.architecture = arch;
  spec->parse(cfg, mc);
  // generation_config.json's stop tokens take precedence, as in transformers' generate().
  std::string gen_path = (fs::path(dir) / "generation_config.json").string();
  if (fs::exists(gen_path)) {
    HfConfig gen = HfConfig::from_file(gen_path);
    if (const auto* eos = gen.find({"eos_token_id"})) {
      mc.eos_token_ids.clear();
      if (eos->is_array())
        for (const auto& e : *eos) mc.eos_token_ids.push_back(e.get<int32_t>());
      else if (eos->is_number_integer())
        mc.eos_token_ids.push_back(eos->get<int32_t>());
    }
  }
  validate_model_config(mc, path);
  return mc;
}

}  // namespace moe
