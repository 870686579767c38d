// The row counts a decode step's CUDA graph is captured for (its buckets): a step of r rows
// replays the smallest bucket of at least r, its extra rows inert padding (they take no expert
// but still run the dense projections, attention, the lm_head and sampling). Plain C++: the rule
// is tested without a GPU.
#pragma once

#include <algorithm>
#include <bit>
#include <vector>

namespace moe::cuda::engine {

// Whether three rows get a bucket of their own, or run as four with one inert. On one GPU three
// rows step faster on their own in both formats (H100, replayed graphs; bench/gpu_fp8_decode_h100.md):
//  - FP8 experts: three exact rows take the plan-free GEMV, four the wgmma W8A8 GEMM: qwen3-30b-a3b
//    4.01 against 4.49 ms at 128-token contexts, 4.38 against 4.88 at 2048;
//  - bf16 experts: three exact rows take the grouped GEMV as four do (gemv_direct_max_slots):
//    qwen3-30b-a3b 5.86 against 5.97 ms, deepseek-v2-lite 4.82 against 5.67. (On the plan-free
//    GEMV they were slower than four: 6.69 ms; that is why three ran as four before.)
// Several GPUs keep three as four (not measured there).
inline bool own_bucket_for_three_rows(int gpus) { return gpus == 1; }

// Four buckets per doubling (1, 2, 3 or not, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20, 24, ...) and
// max_batch, so that a step pads by less than a quarter of its rows; each rounded up to a multiple
// of `unit` (under dp with tp > 1 each GPU of a group passes an equal share of its rows), repeats
// dropped.
inline std::vector<int> decode_buckets(int max_batch, int unit, bool three) {
  std::vector<int> buckets;
  auto add = [&](int b) {
    const int rounded = (b + unit - 1) / unit * unit;
    if (buckets.empty() || buckets.back() < rounded) buckets.push_back(rounded);
  };
  for (int b = 1; b < max_batch; b += std::max(1, static_cast<int>(std::bit_floor(static_cast<unsigned>(b)) / 4)))
    if (b != 3 || three) add(b);
  add(max_batch);
  return buckets;
}

}  // namespace moe::cuda::engine
