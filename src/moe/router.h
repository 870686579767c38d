// Routers: from router logits [T, E] to the k experts of each token and their weights. One
// function covers the three families the supported checkpoints use:
//   softmax top-k (Qwen, Mixtral, OLMoE), optionally renormalised over the k;
//   DeepSeek-V2: softmax, "greedy" or "group_limited_greedy" (groups ranked by their best
//     expert, masked experts score 0), weights times routed_scaling_factor;
//   DeepSeek-V3 "noaux_tc": sigmoid, e_score_correction_bias added for the choice only, groups
//     ranked by the sum of their two best biased scores (masked experts score -inf), weights from
//     the unbiased sigmoid, renormalised when norm_topk_prob, times routed_scaling_factor.
// Ties: among equal scores the lower index (expert or group) wins, so routing is deterministic.
// Each token's k choices are returned in ascending expert order, which fixes the order in which
// expert outputs are summed.
#pragma once

#include <cstdint>
#include <string>

namespace moe {

enum class RouterScoring { kSoftmax, kSigmoid };
enum class GroupRanking {
  kNone,     // all experts compete
  kMax,      // a group scores its best expert (DeepSeek-V2 group_limited_greedy)
  kTop2Sum,  // a group scores the sum of its two best experts (DeepSeek-V3 noaux_tc)
};

struct RouterConfig {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  RouterScoring scoring = RouterScoring::kSoftmax;
  GroupRanking groups = GroupRanking::kNone;
  int64_t n_group = 1;
  int64_t topk_group = 1;
  bool correction_bias = false;  // e_score_correction_bias, for the choice only
  bool renormalize = false;      // weights divided by their sum over the k
  float scaling = 1.0f;          // routed_scaling_factor

  std::string describe() const;
};

// The softmax top-k router (Qwen, Mixtral, OLMoE; DeepSeek-V2's greedy), renormalised over the k
// or not.
RouterConfig softmax_router(int64_t experts, int64_t top_k, bool renormalize);

// Throws kConfig when the fields are inconsistent (k > E, groups not dividing E, ...).
void validate_router(const RouterConfig& rc, const std::string& origin);

// logits: [tokens, E] f32; bias: [E] f32 or null (must be non-null when correction_bias).
// Writes ids [tokens, k] and weights [tokens, k].
void route(const RouterConfig& rc, const float* logits, const float* bias, int64_t tokens,
           int32_t* topk_ids, float* topk_weights);

}  // namespace moe
