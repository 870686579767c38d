#include "moe/plan.h"

#include "moe/errors.h"

namespace moe {

void make_plan(const int32_t* ids, int64_t tokens, int64_t top_k, int64_t num_experts,
               ExpertPlan& plan) {
  const int64_t slots = tokens * top_k;
  plan.tokens = tokens;
  plan.top_k = top_k;
  plan.num_experts = num_experts;
  plan.counts.assign(static_cast<size_t>(num_experts), 0);
  plan.offsets.assign(static_cast<size_t>(num_experts + 1), 0);
  plan.inverse.assign(static_cast<size_t>(slots), -1);
  for (int64_t s = 0; s < slots; ++s) {
    int32_t e = ids[s];
    if (e < 0) continue;
    MOE_CHECK(e < num_experts, kInternal, "plan: expert id {} outside [0, {})", e, num_experts);
    ++plan.counts[static_cast<size_t>(e)];
  }
  for (int64_t e = 0; e < num_experts; ++e)
    plan.offsets[static_cast<size_t>(e + 1)] = plan.offsets[static_cast<size_t>(e)] + plan.counts[static_cast<size_t>(e)];
  plan.order.assign(static_cast<size_t>(plan.offsets.back()), 0);
  std::vector<int32_t> cursor(plan.offsets.begin(), plan.offsets.end() - 1);
  for (int64_t s = 0; s < slots; ++s) {
    int32_t e = ids[s];
    if (e < 0) continue;
    int32_t pos = cursor[static_cast<size_t>(e)]++;
    plan.order[static_cast<size_t>(pos)] = static_cast<int32_t>(s);
    plan.inverse[static_cast<size_t>(s)] = pos;
  }
}

}  // namespace moe
