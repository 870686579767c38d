// The routed experts of one MoE layer on one rank, and the two ways of running them:
//   naive   - per local expert: gather its tokens, run the FFN, scatter-add the weighted rows;
//   grouped - plan once, gather every routed row into expert-contiguous slices, one grouped
//             gate_up pass over all slices, SiLU·up over all rows, one grouped down pass, then a
//             weighted combine per token.
// Both sum a token's expert outputs in ascending expert order, so they agree bit for bit.
#pragma once

#include <functional>
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

// Synthetic experts, for tests and benchmarks: f32 weights of the given shape, all zero.
ExpertWeights zero_experts(int64_t num_local, int64_t hidden, int64_t inter);

// Fills an f32 tensor with uniform values in [-scale, scale), each rounded to bf16, from a 64-bit
// xorshift seeded by `seed`: synthetic weights that a bf16 device copy holds exactly, drawn far
// faster than normal ones (a qwen3-30b-a3b layer has 600M).
void fill_uniform_bf16(Tensor& t, uint64_t seed, float scale);

// Some tokens of a batch gathered for a host reference of the experts' output on them (an output
// row depends only on its token's input and slots): checking a device's output on a sample of
// the rows costs the reference a fraction of the batch.
struct TokenSample {
  Tensor x;                    // [tokens, hidden]
  std::vector<int32_t> ids;    // [tokens, top_k]
  std::vector<float> weights;  // [tokens, top_k]
};
// The batch's ids and weights are [T, top_k]; input(t, row) writes token t's hidden values.
TokenSample sample_tokens(const std::vector<int64_t>& tokens, int64_t hidden, int64_t top_k,
                          const std::vector<int32_t>& ids, const std::vector<float>& weights,
                          const std::function<void(int64_t, float*)>& input);

// out[t] = sum over the slots j of token t whose expert is held here (local_of[e] >= 0) of
// weights[t, j] * FFN_e(x[t]); rows with no local slot are zero. ids are global expert ids in
// ascending order per token; -1 marks an empty slot (padding). `plan` is scratch (reused across calls).
void run_experts(ExecMode mode, ThreadPool& pool, Arena& workspace, const ExpertWeights& w,
                 const std::vector<int32_t>& local_of, const Tensor& x, const int32_t* ids,
                 const float* weights, int64_t top_k, Tensor& out, ExpertPlan& plan);

}  // namespace moe
