#include "moe/placement.h"

#include <algorithm>
#include <limits>

#include "moe/errors.h"

namespace moe {

ExpertPlacement::ExpertPlacement(int64_t num_experts, int ep, int rank)
    : num_experts_(num_experts), ep_(ep), rank_(rank) {
  MOE_CHECK(ep >= 1, kInvalidArgument, "ep must be at least 1, got {}", ep);
  MOE_CHECK(num_experts >= 1, kInvalidArgument,
            "expert placement needs at least 1 expert, got {}", num_experts);
  MOE_CHECK(ep <= num_experts, kInvalidArgument, "ep {} is larger than the number of experts {}",
            ep, num_experts);
  MOE_CHECK(num_experts <= std::numeric_limits<int32_t>::max(), kInvalidArgument,
            "{} experts do not fit 32-bit local indices", num_experts);
  check_rank(rank);
  base_ = num_experts / ep;
  remainder_ = num_experts % ep;
  global_to_local_.assign(static_cast<size_t>(num_experts), -1);
  const int64_t first = first_expert(rank);
  const int64_t count = num_local(rank);
  for (int64_t i = 0; i < count; ++i) global_to_local_[first + i] = static_cast<int32_t>(i);
}

void ExpertPlacement::check_rank(int r) const {
  MOE_CHECK(r >= 0 && r < ep_, kInvalidArgument, "rank {} is outside [0, {}) for ep {}", r, ep_,
            ep_);
}

void ExpertPlacement::check_expert(int64_t e) const {
  MOE_CHECK(e >= 0 && e < num_experts_, kInvalidArgument,
            "expert {} is outside [0, {})", e, num_experts_);
}

int64_t ExpertPlacement::first_expert(int r) const {
  check_rank(r);
  return r * base_ + std::min<int64_t>(r, remainder_);
}

int64_t ExpertPlacement::num_local(int r) const {
  check_rank(r);
  return base_ + (r < remainder_ ? 1 : 0);
}

int ExpertPlacement::owner(int64_t e) const {
  check_expert(e);
  const int64_t big = remainder_ * (base_ + 1);  // experts held by the ranks with one extra
  if (e < big) return static_cast<int>(e / (base_ + 1));
  return static_cast<int>(remainder_ + (e - big) / base_);
}

int32_t ExpertPlacement::local_index(int64_t e) const {
  check_expert(e);
  return global_to_local_[static_cast<size_t>(e)];
}

}  // namespace moe
