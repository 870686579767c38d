#include "moe/router.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include <fmt/format.h>

#include "moe/errors.h"

namespace moe {

std::string RouterConfig::describe() const {
  std::string s = fmt::format("{} top-{} of {}", scoring == RouterScoring::kSoftmax ? "softmax" : "sigmoid",
                              top_k, num_experts);
  if (groups != GroupRanking::kNone)
    s += fmt::format(", {} of {} groups by {}", topk_group, n_group,
                     groups == GroupRanking::kMax ? "max" : "top-2 sum");
  if (correction_bias) s += ", correction bias";
  if (renormalize) s += ", renormalised";
  if (scaling != 1.0f) s += fmt::format(", x{}", scaling);
  return s;
}

RouterConfig softmax_router(int64_t experts, int64_t top_k, bool renormalize) {
  RouterConfig r;
  r.num_experts = experts;
  r.top_k = top_k;
  r.scoring = RouterScoring::kSoftmax;
  r.renormalize = renormalize;
  return r;
}

void validate_router(const RouterConfig& rc, const std::string& origin) {
  MOE_CHECK(rc.num_experts > 0, kConfig, "{}: the router needs at least one expert", origin);
  MOE_CHECK(rc.top_k >= 1 && rc.top_k <= rc.num_experts, kConfig,
            "{}: num_experts_per_tok {} must be in [1, {}]", origin, rc.top_k, rc.num_experts);
  if (rc.groups != GroupRanking::kNone) {
    MOE_CHECK(rc.n_group >= 1 && rc.num_experts % rc.n_group == 0, kConfig,
              "{}: n_group {} must divide the {} experts", origin, rc.n_group, rc.num_experts);
    MOE_CHECK(rc.topk_group >= 1 && rc.topk_group <= rc.n_group, kConfig,
              "{}: topk_group {} must be in [1, n_group = {}]", origin, rc.topk_group, rc.n_group);
    const int64_t per_group = rc.num_experts / rc.n_group;
    MOE_CHECK(rc.topk_group * per_group >= rc.top_k, kConfig,
              "{}: {} groups of {} experts cannot supply top-{}", origin, rc.topk_group, per_group,
              rc.top_k);
    MOE_CHECK(rc.groups != GroupRanking::kTop2Sum || per_group >= 2, kConfig,
              "{}: noaux_tc ranks groups by their two best experts, but groups hold {}", origin,
              per_group);
  }
}

namespace {
// Indices of the k largest values, largest first, lower index first among equals.
void top_indices(const float* values, int64_t n, int64_t k, std::vector<int32_t>& order) {
  order.resize(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int32_t a, int32_t b) {
    return values[a] > values[b] || (values[a] == values[b] && a < b);
  });
  order.resize(static_cast<size_t>(k));
}
}  // namespace

void route(const RouterConfig& rc, const float* logits, const float* bias, int64_t tokens,
           int32_t* topk_ids, float* topk_weights) {
  const int64_t n = rc.num_experts, k = rc.top_k;
  MOE_CHECK(!rc.correction_bias || bias != nullptr, kInternal, "router: correction bias missing");
  std::vector<float> scores(static_cast<size_t>(n)), choice(static_cast<size_t>(n));
  std::vector<float> group_scores(static_cast<size_t>(rc.n_group));
  std::vector<int32_t> order, group_order, in_group;
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = logits + t * n;
    if (rc.scoring == RouterScoring::kSoftmax) {
      float mx = -std::numeric_limits<float>::infinity();
      for (int64_t e = 0; e < n; ++e) mx = std::fmax(mx, row[e]);
      float sum = 0.0f;
      for (int64_t e = 0; e < n; ++e) sum += scores[static_cast<size_t>(e)] = std::exp(row[e] - mx);
      for (auto& s : scores) s /= sum;
    } else {
      for (int64_t e = 0; e < n; ++e) scores[static_cast<size_t>(e)] = 1.0f / (1.0f + std::exp(-row[e]));
    }
    for (int64_t e = 0; e < n; ++e)
      choice[static_cast<size_t>(e)] = scores[static_cast<size_t>(e)] + (rc.correction_bias ? bias[e] : 0.0f);
    if (rc.groups != GroupRanking::kNone) {
      const int64_t per = n / rc.n_group;
      for (int64_t g = 0; g < rc.n_group; ++g) {
        const float* c = choice.data() + g * per;
        if (rc.groups == GroupRanking::kMax) {
          group_scores[static_cast<size_t>(g)] = *std::max_element(c, c + per);
        } else {
          top_indices(c, per, 2, in_group);
          group_scores[static_cast<size_t>(g)] = c[in_group[0]] + c[in_group[1]];
        }
      }
      top_indices(group_scores.data(), rc.n_group, rc.topk_group, group_order);
      std::vector<bool> kept(static_cast<size_t>(rc.n_group), false);
      for (int32_t g : group_order) kept[static_cast<size_t>(g)] = true;
      // As the reference implementations: V2 zeroes the experts of dropped groups, V3 sets -inf.
      const float masked = rc.groups == GroupRanking::kMax ? 0.0f : -std::numeric_limits<float>::infinity();
      for (int64_t e = 0; e < n; ++e)
        if (!kept[static_cast<size_t>(e / per)]) choice[static_cast<size_t>(e)] = masked;
    }
    top_indices(choice.data(), n, k, order);
    std::sort(order.begin(), order.end());  // ascending expert order fixes the summation order
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      int32_t e = order[static_cast<size_t>(j)];
      // DeepSeek-V2 takes its weights from the masked scores (a dropped group's expert, chosen
      // only when fewer than k experts score above 0, weighs 0); the others from the unbiased ones.
      float w = rc.groups == GroupRanking::kMax ? choice[static_cast<size_t>(e)]
                                                : scores[static_cast<size_t>(e)];
      topk_ids[t * k + j] = e;
      topk_weights[t * k + j] = w;
      sum += w;
    }
    for (int64_t j = 0; j < k; ++j) {
      float& w = topk_weights[t * k + j];
      if (rc.renormalize) w /= (rc.scoring == RouterScoring::kSigmoid ? sum + 1e-20f : sum);
      w *= rc.scaling;
    }
  }
}

}  // namespace moe
