// The plan of one MoE layer's forward: which (token, slot) pairs each expert serves. Built by a
// counting sort over topk_ids (count, exclusive scan, stable scatter), the same three steps a
// device version runs without a host round trip.
#pragma once

#include <cstdint>
#include <vector>

namespace moe {

struct ExpertPlan {
  int64_t tokens = 0, top_k = 0, num_experts = 0;
  std::vector<int32_t> counts;   // [E] slots routed to each expert
  std::vector<int32_t> offsets;  // [E + 1] exclusive prefix sum of counts
  std::vector<int32_t> order;    // [T * k] sorted position -> slot (t * k + j), stable in slot order
  std::vector<int32_t> inverse;  // [T * k] slot -> sorted position
};

// ids: [tokens, k] expert indices in [0, E) (or -1 for a slot that goes nowhere; such slots are
// left out of every expert's range and have inverse -1). Throws kInternal on an id >= E.
void make_plan(const int32_t* topk_ids, int64_t tokens, int64_t top_k, int64_t num_experts,
               ExpertPlan& plan);

}  // namespace moe
