// The architectures the engine knows, by the class name config.json gives in "architectures".
// Each architecture lives in its own file (arch_*.cpp) and only describes its config and tensor
// names; the shared blocks do the computing. Adding one is a new file and a line in registry.cpp.
#pragma once

#include <string>

#include "model/config.h"

namespace moe {

struct Architecture {
  const char* name;
  void (*parse)(const HfConfig& cfg, ModelConfig& mc);
};

const Architecture* find_architecture(const std::string& name);
std::string supported_architectures();  // comma-separated, for error messages

// Shared by the parsers: Qwen's way of choosing sparse layers (num_experts,
// moe_intermediate_size, norm_topk_prob, mlp_only_layers, decoder_sparse_step); the softmax router
// is moe::softmax_router (moe/router.h).
// OLMoE sizes its experts with intermediate_size; the Qwen family with moe_intermediate_size.
void parse_qwen_style_moe(const HfConfig& cfg, ModelConfig& mc,
                          bool expert_size_is_intermediate = false);

// Parsers defined in the arch_*.cpp files.
void parse_qwen3(const HfConfig& cfg, ModelConfig& mc);
void parse_qwen3_moe(const HfConfig& cfg, ModelConfig& mc);
void parse_qwen2_moe(const HfConfig& cfg, ModelConfig& mc);
void parse_olmoe(const HfConfig& cfg, ModelConfig& mc);
void parse_mixtral(const HfConfig& cfg, ModelConfig& mc);
void parse_deepseek_v2(const HfConfig& cfg, ModelConfig& mc);
void parse_deepseek_v3(const HfConfig& cfg, ModelConfig& mc);

}  // namespace moe
