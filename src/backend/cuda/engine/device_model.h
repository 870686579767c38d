// The model's weights on one device, in the layout the CUDA engine runs: matrices, each a
// DeviceMatrix that carries its format (bf16, or FP8 codes with block scales), held by a
// WeightStore that the host loader writes into (the host only lays tensors out, so a 60 GB model
// never exists as f32 there), f32 norms and biases, the routed experts of each sparse layer
// behind cuda::Experts.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "backend/cuda/device_arena.h"
#include "backend/cuda/engine/weight_store.h"
#include "backend/device_matrix.h"
#include "backend/cuda_moe.h"
#include "model/config.h"

namespace moe::cuda {

struct DeviceLayer {
  const float* input_norm = nullptr;
  const float* post_norm = nullptr;
  // Attention: q, k, v rows back to back when qkv_fused (then q holds all three), else three.
  DeviceMatrix q, k, v, o;
  bool qkv_fused = false;
  const float* qkv_bias = nullptr;  // [(heads + 2 kv_heads) * head_dim] or null
  const float *q_norm = nullptr, *k_norm = nullptr;
  // Latent attention (MLA): q_a/q_b (q_lora_rank > 0) or q; kv_a; the absorbed per-head
  // projections: uk_t, heads x [lora, nope] (derived at load), and uv, the value rows of kv_b
  // (heads x [v, lora], (nope + v) * lora elements apart).
  DeviceMatrix q_a, q_b, kv_a, uk_t, uv;
  const float *q_a_norm = nullptr, *kv_a_norm = nullptr;
  // Feed-forward
  bool sparse = false;
  DeviceMatrix mlp_gate_up, mlp_down;  // dense layers
  DeviceMatrix router;                 // [experts, hidden]
  const float* router_bias = nullptr;
  std::unique_ptr<Experts> experts;
  // This rank's block of routed experts in the Experts layout (what `experts` runs), for an
  // expert-parallel exchange that runs them itself.
  DeviceMatrix expert_gate_up, expert_down;
  DeviceMatrix shared_gate_up, shared_down, shared_gate;
};

struct DeviceModel {
  std::unique_ptr<WeightStore> store;  // the matrices, each in its format
  DeviceArena small;    // f32 rank-1 tensors, rotary frequencies
  DeviceArena derived;  // weights rearranged at load (absorbed keys; a rank's attention slices)
  DeviceArena widened;  // FP8 matrices read as bf16 by what reads nothing else
  DeviceMatrix embed, lm_head;
  const float* final_norm = nullptr;
  // This rank's share (all of it on one GPU): attention heads, and the block of routed experts
  // that starts at global expert first_expert.
  int64_t q_heads = 0, kv_heads = 0;
  int64_t first_expert = 0, local_experts = 0;
  const float* inv_freq = nullptr;
  float rope_cos_sin_scale = 1.0f;  // YaRN's attention factor on cos and sin
  std::vector<DeviceLayer> layers;
  size_t bytes() const { return store->bytes() + small.capacity() + derived.capacity() + widened.capacity(); }
};

struct DeviceLoad {
  int device = 0;
  bool random_weights = false;
  uint64_t seed = 0;
  bool strict = true;
  bool progress = false;
  int64_t max_tokens = 0;  // largest step, for the experts' path choice
  // Rank `rank` of `ranks` GPUs holds its block of every layer's routed experts (ExpertPlacement)
  // and, with tp > 1, share rank % tp of the attention heads of its group of tp GPUs:
  // num_heads / tp query heads and the key/value heads they read (their own share, or one head
  // when there are fewer than tp).
  int rank = 0, ranks = 1;
  int tp = 1;
};

// Throws kUnsupported for a model the parallel settings cannot split (a whole-width q/k norm
// under tp > 1, heads that do not divide over tp), kInvalidArgument for more ranks than experts.
void check_parallel_supported(const ModelConfig& mc, int ranks, int tp);

// Throws kUnsupported for what the CUDA path does not run yet (an output-projection bias, latent
// widths past the kernels' limits).
void check_cuda_supported(const ModelConfig& mc);
std::unique_ptr<DeviceModel> load_device_model(const std::string& dir, const ModelConfig& mc,
                                               const DeviceLoad& opts);

}  // namespace moe::cuda
