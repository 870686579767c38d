#include "runtime/sampler.h"

#include <algorithm>
#include <cmath>

#include "moe/errors.h"

namespace moe {

void validate_sampling(const SamplingParams& p) {
  MOE_CHECK(p.temperature >= 0.0f && std::isfinite(p.temperature), kInvalidArgument,
            "temperature must be >= 0, got {}", p.temperature);
  MOE_CHECK(p.top_k >= 0, kInvalidArgument, "top-k must be >= 0, got {}", p.top_k);
  MOE_CHECK(p.top_p > 0.0f && p.top_p <= 1.0f, kInvalidArgument, "top-p must be in (0, 1], got {}",
            p.top_p);
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {
  validate_sampling(params);
}

int32_t Sampler::sample(const float* logits, int64_t vocab) {
  if (params_.temperature == 0.0f || params_.top_k == 1) {
    int64_t best = 0;  // the first maximum, as torch.argmax
    for (int64_t i = 1; i < vocab; ++i)
      if (logits[i] > logits[best]) best = i;
    return static_cast<int32_t>(best);
  }
  scratch_.resize(static_cast<size_t>(vocab));
  for (int64_t i = 0; i < vocab; ++i)
    scratch_[static_cast<size_t>(i)] = {logits[i] / params_.temperature, static_cast<int32_t>(i)};
  auto by_logit = [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  size_t keep = scratch_.size();
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < keep) {
    keep = static_cast<size_t>(params_.top_k);
    std::partial_sort(scratch_.begin(), scratch_.begin() + static_cast<std::ptrdiff_t>(keep),
                      scratch_.end(), by_logit);
  } else {
    std::sort(scratch_.begin(), scratch_.end(), by_logit);
  }
  scratch_.resize(keep);
  float mx = scratch_[0].first;
  double sum = 0.0;
  for (auto& [value, id] : scratch_) {
    value = std::exp(value - mx);
    sum += value;
  }
  if (params_.top_p < 1.0f) {
    double cumulative = 0.0;
    size_t cut = 0;
    while (cut < scratch_.size()) {
      cumulative += scratch_[cut].first / sum;
      ++cut;
      if (cumulative >= params_.top_p) break;
    }
    scratch_.resize(cut);
    sum = 0.0;
    for (const auto& [value, id] : scratch_) sum += value;
  }
  double r = std::uniform_real_distribution<double>(0.0, sum)(rng_);
  for (const auto& [value, id] : scratch_) {
    r -= value;
    if (r <= 0.0) return id;
  }
  return scratch_.back().second;
}

}  // namespace moe
