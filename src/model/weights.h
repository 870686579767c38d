// The weights of a decoder in the engine's compute layout: f32, row-major [out, in] as in
// nn.Linear, with each expert's gate and up projections packed into one [2 * inter, hidden]
// matrix at load time, so a forward performs no conversion and no repacking.
#pragma once

#include <vector>

#include "io/checkpoint.h"
#include "model/config.h"

namespace moe {

struct AttentionWeights {
  Tensor q, k, v, o;                 // [heads * head_dim, hidden] ... o: [hidden, heads * head_dim]
  Tensor q_bias, k_bias, v_bias;     // present when attention_bias
  Tensor q_norm, k_norm;             // [head_dim], present when qk_norm
};

struct FfnWeights {
  Tensor gate_up;  // [2 * inter, hidden]: rows [0, inter) gate, [inter, 2 * inter) up
  Tensor down;     // [hidden, inter]
  bool defined() const { return gate_up.raw() != nullptr; }
};

struct MoeWeights {
  Tensor router;                    // [experts, hidden]
  std::vector<FfnWeights> experts;  // one per global expert; undefined where not loaded
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
};

// Reads every tensor the config implies, by Hugging Face name, through `loader`.
ModelWeights load_weights(const ModelConfig& mc, WeightLoader& loader, Arena& arena);

}  // namespace moe
