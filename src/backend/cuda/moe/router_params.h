// The device routers' parameters (RouterParams, ops_launch.h) for a model's RouterConfig: the one
// place that maps the router's settings onto the kernels' plain fields.
#pragma once

#include "backend/cuda/ops/ops_launch.h"
#include "moe/router.h"

namespace moe::cuda::kernels {

// `bias`: the device copy of e_score_correction_bias, taken only where the config has one.
inline RouterParams router_params(const RouterConfig& rc, const float* bias) {
  RouterParams p;
  p.experts = static_cast<int>(rc.num_experts);
  p.top_k = static_cast<int>(rc.top_k);
  p.sigmoid = rc.scoring == RouterScoring::kSigmoid ? 1 : 0;
  p.group_ranking = rc.groups == GroupRanking::kNone ? 0 : rc.groups == GroupRanking::kMax ? 1 : 2;
  p.n_group = static_cast<int>(rc.n_group);
  p.topk_group = static_cast<int>(rc.topk_group);
  p.bias = rc.correction_bias ? bias : nullptr;
  p.renormalize = rc.renormalize ? 1 : 0;
  p.scaling = rc.scaling;
  return p;
}

}  // namespace moe::cuda::kernels
