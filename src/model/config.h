// The model hyper-parameters the engine needs, parsed from config.json by the architecture's
// own parser (see registry.h). Validated before any weight is read.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/hf_config.h"

namespace moe {

enum class RopeStyle { kHalf, kInterleaved };

// Where a sparse MoE block keeps its tensors, relative to "model.layers.<i>.".
struct MoeNames {
  std::string block = "mlp";        // "mlp" (Qwen, DeepSeek) or "block_sparse_moe" (Mixtral)
  std::string router = "gate";      // <block>.<router>.weight is [experts, hidden]
  std::string gate = "gate_proj";   // <block>.experts.<e>.<gate>.weight is [inter, hidden]
  std::string up = "up_proj";
  std::string down = "down_proj";   // [hidden, inter]
};

struct MoeConfig {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  int64_t intermediate_size = 0;  // per expert
  bool norm_topk_prob = true;     // renormalise the k routing weights to sum to 1
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
  RopeStyle rope_style = RopeStyle::kHalf;
  bool qk_norm = false;         // per-head RMSNorm of q and k (Qwen3)
  bool attention_bias = false;  // biases on q, k, v projections
  bool tie_word_embeddings = false;
  MoeConfig moe;
  std::vector<bool> moe_layers;  // per layer: sparse MoE block (true) or dense MLP
  std::vector<int32_t> eos_token_ids;
  int32_t bos_token_id = -1;

  int64_t num_moe_layers() const;
  // Parameter count implied by the config (what `info` reports next to the checkpoint's).
  int64_t parameter_count() const;
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
