// Device code shared by the paged attention kernels (attention_row.cu, attention_tiled.cu,
// attention_decode.cu): their block size, warp reductions, where a cache position lives and which
// sequence a row belongs to. CUDA headers only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/attention/attention_launch.h"

namespace moe::cuda::kernels::attention_detail {

constexpr int kThreads = 128;  // 4 warps: the block of the row, tiled and decode kernels

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Element offset of cache position `pos` of sequence `seq`, kv head `kvh`, dim 0.
__device__ __forceinline__ size_t cache_offset(const PagedAttentionParams& p, int seq, int pos,
                                               int kvh, int block_shift) {
  const int blk = p.block_tables[(size_t)seq * p.max_blocks_per_seq + (pos >> block_shift)];
  const int row = pos & (p.block_size - 1);
  return (((size_t)blk * p.block_size + row) * p.kv_heads + kvh) * p.head_dim;
}

// The sequence that owns row `row` (< seq_starts[num_seqs]): the last s with start <= row, which
// skips sequences with no rows.
__device__ __forceinline__ int find_seq(const int32_t* starts, int num_seqs, int row) {
  // Decode batches (one row per sequence) answer with two independent loads instead of a chain.
  if (row < num_seqs && starts[row] <= row && starts[row + 1] > row) return row;
  int lo = 0, hi = num_seqs - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (starts[mid] <= row) lo = mid;
    else hi = mid - 1;
  }
  return lo;
}

}  // namespace moe::cuda::kernels::attention_detail
