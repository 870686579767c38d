#include "model/config.h"

#include <algorithm>
#include <cmath>
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

namespace {

// Sane maxima, checked before anything is sized from a config: each is well past every public
// model (DeepSeek-V3: 61 layers, 256 experts, 129,280 tokens; Llama 3.1 405B: 126 layers, hidden
// 16,384; contexts of 10M positions exist) and small enough that a hostile config cannot make the
// loader enumerate billions of tensors or allocate gigabytes from one number.
constexpr int64_t kMaxVocab = int64_t(1) << 24;
constexpr int64_t kMaxHidden = int64_t(1) << 17;
constexpr int64_t kMaxLayers = 1024;
constexpr int64_t kMaxHeads = 4096;
constexpr int64_t kMaxHeadDim = 4096;
constexpr int64_t kMaxIntermediate = int64_t(1) << 20;
constexpr int64_t kMaxPositions = int64_t(1) << 26;
constexpr int64_t kMaxExperts = 16384;
constexpr int64_t kMaxTensors = 4'000'000;  // tensor names the configuration implies

void at_most(int64_t v, int64_t limit, const char* name, const std::string& origin) {
  MOE_CHECK(v <= limit, kConfig, "{}: {} {} is past the largest supported value {}", origin, name, v, limit);
}

// A token id or a list of them (eos_token_id), each an integer in [0, kMaxVocab).
std::vector<int32_t> token_ids(const nlohmann::json& v, const char* name, const std::string& origin) {
  std::vector<int32_t> ids;
  auto one = [&](const nlohmann::json& e) {
    MOE_CHECK(e.is_number_integer() && e.get<int64_t>() >= 0 && e.get<int64_t>() < kMaxVocab, kConfig,
              "{}: {} must hold token ids (integers in [0, {})), got {}", origin, name, kMaxVocab, e.dump());
    ids.push_back(static_cast<int32_t>(e.get<int64_t>()));
  };
  if (v.is_array()) {
    MOE_CHECK(v.size() <= 1024, kConfig, "{}: {} lists {} ids, more than 1024", origin, name, v.size());
    for (const auto& e : v) one(e);
  } else {
    one(v);
  }
  return ids;
}

}  // namespace

void parse_decoder_common(const HfConfig& cfg, ModelConfig& mc) {
  mc.vocab_size = cfg.get<int64_t>({"vocab_size"});
  mc.hidden_size = cfg.get<int64_t>({"hidden_size", "d_model", "n_embd"});
  mc.num_layers = cfg.get<int64_t>({"num_hidden_layers", "num_layers", "n_layer"});
  mc.num_heads = cfg.get<int64_t>({"num_attention_heads", "n_head"});
  mc.num_kv_heads = cfg.get_or<int64_t>({"num_key_value_heads", "num_kv_heads"}, mc.num_heads);
  mc.head_dim = cfg.get_or<int64_t>({"head_dim"}, mc.num_heads ? mc.hidden_size / mc.num_heads : 0);
  mc.intermediate_size = cfg.get_or<int64_t>({"intermediate_size", "ffn_dim"}, 0);
  mc.max_position_embeddings = cfg.get_or<int64_t>({"max_position_embeddings"}, 4096);
  // The layer count sizes per-layer tables in every architecture parser: bounded first.
  at_most(mc.num_layers, kMaxLayers, "num_hidden_layers", cfg.origin());
  MOE_CHECK(mc.num_layers > 0, kConfig, "{}: num_hidden_layers must be positive, got {}", cfg.origin(), mc.num_layers);
  mc.rms_norm_eps = cfg.get_or<float>({"rms_norm_eps", "layer_norm_epsilon"}, 1e-6f);
  mc.rope_theta = cfg.get_or<float>({"rope_theta", "rope_parameters.rope_theta"}, 10000.0f);
  MOE_CHECK(std::isfinite(mc.rope_theta) && mc.rope_theta > 1.0f, kConfig, "{}: rope_theta must be a finite number above 1, got {}",
            cfg.origin(), mc.rope_theta);
  MOE_CHECK(std::isfinite(mc.rms_norm_eps) && mc.rms_norm_eps > 0.0f, kConfig,
            "{}: rms_norm_eps must be a positive finite number, got {}", cfg.origin(), mc.rms_norm_eps);
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
  mc.quant = parse_quantization(cfg);
  std::string act = cfg.get_or<std::string>({"hidden_act", "hidden_activation"}, "silu");
  MOE_CHECK(act == "silu", kUnsupported, "{}: hidden_act '{}' is not supported (only 'silu')",
            cfg.origin(), act);
  MOE_CHECK(!cfg.get_or<bool>({"use_sliding_window"}, false), kUnsupported,
            "{}: sliding-window attention is not supported", cfg.origin());
  if (const auto* eos = cfg.find({"eos_token_id"})) mc.eos_token_ids = token_ids(*eos, "eos_token_id", cfg.origin());
  if (const auto* bos = cfg.find({"bos_token_id"})) {
    const auto ids = token_ids(*bos, "bos_token_id", cfg.origin());
    MOE_CHECK(ids.size() == 1, kConfig, "{}: bos_token_id must be one token id", cfg.origin());
    mc.bos_token_id = ids[0];
  }
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
  positive(mc.max_position_embeddings, "max_position_embeddings");
  at_most(mc.vocab_size, kMaxVocab, "vocab_size", origin);
  at_most(mc.hidden_size, kMaxHidden, "hidden_size", origin);
  at_most(mc.num_layers, kMaxLayers, "num_hidden_layers", origin);
  at_most(mc.num_heads, kMaxHeads, "num_attention_heads", origin);
  at_most(mc.num_kv_heads, mc.num_heads, "num_key_value_heads", origin);
  at_most(mc.head_dim, kMaxHeadDim, "head_dim", origin);
  at_most(mc.intermediate_size, kMaxIntermediate, "intermediate_size", origin);
  at_most(mc.max_position_embeddings, kMaxPositions, "max_position_embeddings", origin);
  at_most(mc.moe.num_experts, kMaxExperts, "the number of experts", origin);
  at_most(mc.moe.intermediate_size, kMaxIntermediate, "the expert intermediate size", origin);
  at_most(mc.moe.shared_intermediate, kMaxIntermediate, "the shared expert intermediate size", origin);
  at_most(mc.num_nextn_predict_layers, kMaxLayers, "num_nextn_predict_layers", origin);
  if (mc.attention == AttentionKind::kMla) {
    at_most(mc.mla.q_lora_rank, kMaxHidden, "q_lora_rank", origin);
    at_most(mc.mla.kv_lora_rank, kMaxHidden, "kv_lora_rank", origin);
    at_most(mc.mla.qk_nope_head_dim, kMaxHeadDim, "qk_nope_head_dim", origin);
    at_most(mc.mla.v_head_dim, kMaxHeadDim, "v_head_dim", origin);
  }
  // Each routed expert is three tensors: bound the names a loader or `info` would list.
  const int64_t tensors = mc.num_layers * (3 * std::max<int64_t>(mc.moe.num_experts, 0) + 32);
  MOE_CHECK(tensors <= kMaxTensors, kConfig,
            "{}: {} layers of {} experts imply {} tensors, more than the {} supported", origin, mc.num_layers,
            mc.moe.num_experts, tensors, kMaxTensors);
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
    if (const auto* eos = gen.find({"eos_token_id"})) mc.eos_token_ids = token_ids(*eos, "eos_token_id", gen_path);
  }
  validate_model_config(mc, path);
  return mc;
}

}  // namespace moe
