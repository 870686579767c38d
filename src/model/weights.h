// The weights of a decoder in the engine's compute layout: f32, row-major [out, in] as in
// nn.Linear. At load time each expert's gate and up projections are packed into one
// [2 * inter, hidden] matrix and a layer's experts are laid back to back, so a forward performs
// no conversion and no repacking, and the packed experts are the only copy (nothing extra is
// resident).
#pragma once

#include <vector>

#include "io/checkpoint.h"
#include "model/config.h"
#include "moe/experts.h"

namespace moe {

struct AttentionWeights {
  // GQA
  Tensor q, k, v, o;              // q: [heads * head_dim, hidden] ... o: [hidden, heads * v_dim]
  Tensor q_bias, k_bias, v_bias, o_bias;
  Tensor q_norm, k_norm;          // [head_dim] (per head) or the projection width (full)
  // MLA
  Tensor q_a, q_a_norm, q_b;      // when q_lora_rank > 0 (else `q` is [heads * qk_head_dim, hidden])
  Tensor kv_a, kv_a_norm, kv_b;   // kv_a: [kv_lora + rope, hidden]; kv_b: [heads * (nope + v), kv_lora]
};

struct FfnWeights {
  Tensor gate_up;  // [2 * inter, hidden]: rows [0, inter) gate, [inter, 2 * inter) up
  Tensor down;     // [hidden, inter]
  bool defined() const { return gate_up.defined(); }
};

struct MoeWeights {
  Tensor router;          // [experts, hidden]
  Tensor router_bias;     // [experts]: e_score_correction_bias (f32, for the choice only)
  ExpertWeights experts;  // this rank's routed experts, packed
  FfnWeights shared;      // defined when the architecture has a shared expert
  Tensor shared_gate;     // [1, hidden] (Qwen2-MoE)
};

struct LayerWeights {
  Tensor input_norm, post_attention_norm;  // [hidden]
  AttentionWeights attn;
  bool sparse = false;
  FfnWeights mlp;  // dense layers
  MoeWeights moe;  // sparse layers
};

struct ModelWeights {
  Tensor embed;    // [vocab, hidden]
  Tensor lm_head;  // [vocab, hidden]; aliases embed when tied
  Tensor final_norm;
  std::vector<LayerWeights> layers;
  int64_t skipped_mtp_tensors = 0;  // tensors of the multi-token-prediction layers, present and unused
};

// Which routed experts this rank loads: global_to_local[e] >= 0 for the held ones, in
// ascending global order. Empty: all experts.
struct ExpertSelection {
  std::vector<int32_t> global_to_local;
  bool holds(int64_t e) const {
    return global_to_local.empty() || global_to_local[static_cast<size_t>(e)] >= 0;
  }
};

// Reads every tensor the config implies, by Hugging Face name, through `loader`. With a
// recording loader (WeightLoader::recording) nothing is read or allocated and the loader ends up
// holding the list of tensor names and shapes.
// The tensors of DeepSeek's multi-token-prediction layers (model.layers.<num_layers + i>) are
// skipped: strict loading stays strict for every other name.
ModelWeights load_weights(const ModelConfig& mc, WeightLoader& loader,
                          const ExpertSelection& experts = {});

// The one line on stderr saying that the multi-token-prediction tensors were skipped (nothing
// when there were none).
void note_skipped_mtp(const ModelConfig& mc, const ModelWeights& w);

// With --random-weights over a config that declares FP8 weights: the one line on stderr saying that
// the weights were drawn in `dtype` instead (nothing otherwise).
void note_random_fp8(const ModelConfig& mc, const char* dtype);

// After a checkpoint's weights were taken: a quantization_config that declares FP8 weights where
// no tensor was FP8 disagrees with the files (kFormat naming the directory).
void check_fp8_found(const ModelConfig& mc, const WeightLoader& loader, const std::string& dir);

}  // namespace moe
