// The model hyper-parameters the engine needs, parsed from config.json by the architecture's
// own parser (see registry.h). Validated before any weight is read.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/hf_config.h"
#include "model/quantization.h"
#include "model/rope.h"
#include "moe/router.h"

namespace moe {

enum class RopeStyle { kHalf, kInterleaved };
enum class AttentionKind { kGqa, kMla };
enum class QkNorm {
  kNone,
  kPerHead,  // RMSNorm over each head's head_dim features (Qwen3)
  kFull,     // RMSNorm over the whole q / k projection (OLMoE)
};

// Multi-head latent attention (DeepSeek-V2/V3).
struct MlaConfig {
  int64_t q_lora_rank = 0;  // 0: q_proj straight from hidden
  int64_t kv_lora_rank = 0;
  int64_t qk_nope_head_dim = 0;
  int64_t qk_rope_head_dim = 0;
  int64_t v_head_dim = 0;
  int64_t qk_head_dim() const { return qk_nope_head_dim + qk_rope_head_dim; }
};

// Where a sparse MoE block keeps its tensors, relative to "model.layers.<i>.".
struct MoeNames {
  std::string block = "mlp";        // "mlp" (Qwen, DeepSeek) or "block_sparse_moe" (Mixtral)
  std::string router = "gate";      // <block>.<router>.weight is [experts, hidden]
  std::string gate = "gate_proj";   // <block>.experts.<e>.<gate>.weight is [inter, hidden]
  std::string up = "up_proj";
  std::string down = "down_proj";   // [hidden, inter]
  std::string shared = "shared_experts";  // <block>.<shared>.{gate,up,down}_proj
};

struct MoeConfig {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t intermediate_size = 0;    // per routed expert
  RouterConfig router;
  int64_t shared_intermediate = 0;  // 0: no shared expert
  bool shared_gate = false;         // Qwen2-MoE: sigmoid(<block>.shared_expert_gate · x) scales it
  MoeNames names;
};

struct ModelConfig {
  std::string architecture;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t intermediate_size = 0;  // dense MLP layers
  int64_t max_position_embeddings = 0;
  float rms_norm_eps = 1e-6f;
  float rope_theta = 10000.0f;
  RopeScaling rope_scaling;  // YaRN, llama3, linear (rope_scaling / rope_parameters)
  Quantization quant;        // quantization_config: FP8 block-scaled weights, or none
  RopeStyle rope_style = RopeStyle::kHalf;
  // Multiplies the softmax scale 1 / sqrt(qk head dim): DeepSeek's YaRN m^2 (rope.h), else 1.
  float softmax_scale_factor = 1.0f;
  AttentionKind attention = AttentionKind::kGqa;
  MlaConfig mla;
  QkNorm qk_norm = QkNorm::kNone;
  bool qkv_bias = false;  // biases on the q, k, v projections
  bool o_bias = false;    // bias on the output projection
  float clip_qkv = 0.0f;  // > 0: q, k, v clamped to [-clip, clip] (OLMoE)
  bool tie_word_embeddings = false;
  MoeConfig moe;
  std::vector<bool> moe_layers;  // per layer: sparse MoE block (true) or dense MLP
  std::vector<int32_t> eos_token_ids;
  int32_t bos_token_id = -1;
  // DeepSeek's multi-token-prediction layers (num_nextn_predict_layers): stored after the
  // decoder as model.layers.<num_layers + i>; their tensors are skipped at load.
  int64_t num_nextn_predict_layers = 0;

  int64_t num_moe_layers() const;
  // Floats one token keeps in the KV cache per layer (keys, values). MLA keeps the compressed
  // latent and the rotary key part only.
  int64_t kv_key_width() const;
  int64_t kv_value_width() const;
  // The rotary table of this model's rotating width (head_dim; qk_rope_head_dim for MLA).
  RopeTable rope() const;
};

// Reads <dir>/config.json (and generation_config.json for stop tokens when present), picks the
// architecture from "architectures", parses and validates. Throws kIo, kFormat, kConfig or
// kUnsupported (an unknown architecture, listing the supported ones).
ModelConfig load_model_config(const std::string& dir);

// Fields shared by the Llama family of configs; used by the architecture parsers.
void parse_decoder_common(const HfConfig& cfg, ModelConfig& mc);
// Throws kConfig describing the first inconsistent value.
void validate_model_config(const ModelConfig& mc, const std::string& origin);

}  // namespace moe
