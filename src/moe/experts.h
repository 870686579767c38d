// The routed experts of one MoE layer on one rank, and the two ways of running them:
//   naive   - per local expert: gather its tokens, run the FFN, scatter-add the weighted rows;
//   grouped - plan once, gather every routed row into expert-contiguous slices, one grouped
//             gate_up pass over all slices, SiLU·up over all rows, one grouped down pass, then a
//             weighted combine per token.
// Both sum a token's expert outputs in ascending expert order, so they agree bit for bit.
#pragma once

#include <string>
#include <vector>

#include "core/arena.h"
#include "core/thread_pool.h"
#include "moe/plan.h"
#include "moe/tensor.h"

namespace moe {

enum class ExecMode { kNaive, kGrouped };
ExecMode parse_exec_mode(const std::string& name);  // kInvalidArgument listing the valid names
const char* exec_mode_name(ExecMode mode);

// Packed at load: experts of this rank back to back, gate rows then up rows in each gate_up.
struct ExpertWeights {
  int64_t num_local = 0, hidden = 0, inter = 0;
  Tensor gate_up;  // [num_local, 2 * inter, hidden]
  Tensor down;     // [num_local, hidden, inter]
  size_t bytes() const { return gate_up.nbytes() + down.nbytes(); }
};

// out[t] = sum over the slots j of token t whose expert is held here (local_of[e] >= 0) of
// weights[t, j] * FFN_e(x[t]); rows with no local slot are zero. ids are global expert ids in
// ascending order per token; -1 marks an empty slot (padding). `plan` is scratch (reused across calls).
void run_experts(ExecMode mode, ThreadPool& pool, Arena& workspace, const ExpertWeights& w,
                 const std::vector<int32_t>& local_of, const Tensor& x, const int32_t* ids,
                 const float* weights, int64_t top_k, Tensor& out, ExpertPlan& plan);

}  // namespace moe
