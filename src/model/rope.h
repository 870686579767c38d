// Rotary position embeddings with the scalings real checkpoints use. config.json spells them two
// ways: the legacy `rope_scaling` object beside a top-level `rope_theta` (every DeepSeek, Kimi
// and Qwen3 checkpoint on the Hub), and transformers 5's `rope_parameters` (theta inside). Both
// read into one RopeScaling, and one function turns it into the table every backend uses, with
// transformers' arithmetic, so that the CPU and the GPU rotate by the same angles.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/hf_config.h"

namespace moe {

enum class RopeType { kDefault, kLinear, kLlama3, kYarn };

struct RopeScaling {
  RopeType type = RopeType::kDefault;
  double factor = 1.0;                   // linear, llama3, yarn
  int64_t original_max_position = 0;     // llama3, yarn: the pre-training context
  double low_freq_factor = 1.0;          // llama3
  double high_freq_factor = 4.0;         // llama3
  double beta_fast = 32.0, beta_slow = 1.0;  // yarn: the ramp's ends, in rotations
  double mscale = 0.0, mscale_all_dim = 0.0;  // yarn (DeepSeek); 0: absent
  double attention_factor = 0.0;         // yarn: cos/sin multiplier; 0: derived from factor
  bool truncate = true;                  // yarn: round the ramp's ends to whole dimensions
};

const char* rope_type_name(RopeType type);
// One line for `moe-cli info`: "theta 10000, yarn: factor 40 over 4096 positions, ...".
std::string describe_rope(const RopeScaling& rs, double theta);

// Reads `rope_parameters` or `rope_scaling` (both may be present; they must then agree). Throws
// kUnsupported for a rope type or key the engine does not implement (naming it and what is
// supported) and kConfig for a missing or impossible value.
RopeScaling parse_rope_scaling(const HfConfig& cfg, int64_t max_position_embeddings);

// What the rotation of one head needs: angle(position, i) = f32(position) * inv_freq[i], and
// cos / sin multiplied by cos_sin_scale (YaRN's attention factor; 1 otherwise).
struct RopeTable {
  std::vector<float> inv_freq;  // [rot_dim / 2]
  float cos_sin_scale = 1.0f;
};

// The table for a rotary width `rot_dim` (even), computed as transformers computes it (f32
// tensors, double scalars), so that positions past the pre-training context match it too.
RopeTable rope_table(const RopeScaling& rs, double theta, int64_t rot_dim);

// DeepSeek's YaRN softmax correction: its attention multiplies 1 / sqrt(qk_head_dim) by m^2,
// m = 0.1 * mscale_all_dim * ln(factor) + 1 (1 when factor <= 1 or mscale_all_dim is absent).
double yarn_softmax_mscale_squared(const RopeScaling& rs);

}  // namespace moe
