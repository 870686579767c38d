// Which rank owns which routed experts under expert parallelism: contiguous blocks in expert
// order, the remainder going to the first ranks (10 experts on 4 ranks: 3, 3, 2, 2, i.e. experts
// 0-2, 3-5, 6-7, 8-9).
#pragma once

#include <cstdint>
#include <vector>

namespace moe {

class ExpertPlacement {
 public:
  // The placement of `num_experts` experts over `ep` ranks, seen from `rank`.
  // Errors (kInvalidArgument): ep < 1, ep > num_experts, rank outside [0, ep).
  ExpertPlacement(int64_t num_experts, int ep, int rank);

  int64_t num_experts() const { return num_experts_; }
  int ep() const { return ep_; }
  int rank() const { return rank_; }

  // The first global expert of rank r and how many it owns (kInvalidArgument for r outside
  // [0, ep)). The no-argument forms are for this rank.
  int64_t first_expert(int r) const;
  int64_t num_local(int r) const;
  int64_t first_expert() const { return first_expert(rank_); }
  int64_t num_local() const { return num_local(rank_); }

  // The rank that owns global expert e (kInvalidArgument for e outside [0, num_experts)).
  int owner(int64_t e) const;
  // The index of global expert e among this rank's experts, or -1 when another rank owns it
  // (kInvalidArgument for e outside [0, num_experts)).
  int32_t local_index(int64_t e) const;
  bool is_local(int64_t e) const { return local_index(e) >= 0; }

  // For every global expert: its local index on this rank, or -1 when owned elsewhere.
  const std::vector<int32_t>& global_to_local() const { return global_to_local_; }

 private:
  void check_rank(int r) const;
  void check_expert(int64_t e) const;

  int64_t num_experts_;
  int ep_;
  int rank_;
  int64_t base_;       // experts per rank, rounded down
  int64_t remainder_;  // the first `remainder_` ranks own one more
  std::vector<int32_t> global_to_local_;
};

}  // namespace moe
