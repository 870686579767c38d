// Device code shared by the paged attention kernels (attention_row.cu, attention_tiled.cu,
// attention_decode.cu, attention_wgmma.cu): their block size, warp reductions, where a cache
// position lives, which sequence a row belongs to and which rows a prefill block takes. CUDA
// headers only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "backend/cuda/attention/attention_launch.h"
#include "backend/cuda/mma_sync.cuh"

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

// The rows of one block of the prefill kernels (attention_tiled.cu, attention_wgmma.cu): tiles of
// `tile_rows` rows numbered sequence by sequence, the block's index counted from the back so that
// the longest causal tiles (a sequence's last) start first.
struct RowTile {
  int seq;   // -1: the block has no tile (the grid is sized for the worst case)
  int row0;  // first row of the tile in q and out
  int rows;  // rows of the tile, <= tile_rows
  int pos0;  // cache position of the tile's row 0 (negative rows see no key)
};

// The block's tile from its index among the grid's `count` tile slots, counted from the last.
__device__ __forceinline__ RowTile find_row_tile(const PagedAttentionParams& p, int tile_rows, int from_last,
                                                 int count) {
  RowTile t{-1, 0, 0, 0};
  int tile = count - 1 - from_last;
  for (int s = 0; s < p.num_seqs; ++s) {
    const int nt = (p.seq_starts[s + 1] - p.seq_starts[s] + tile_rows - 1) / tile_rows;
    if (tile < nt) {
      t.seq = s;
      break;
    }
    tile -= nt;
  }
  if (t.seq < 0) return t;
  const int n = p.seq_starts[t.seq + 1] - p.seq_starts[t.seq];
  t.row0 = p.seq_starts[t.seq] + tile * tile_rows;
  t.rows = min(tile_rows, n - tile * tile_rows);
  t.pos0 = p.context_lens[t.seq] - n + tile * tile_rows;
  return t;
}

// The end of a prefill kernel's rows (attention_tiled.cu, attention_wgmma.cu): l summed over the
// quad, then O / l rounded to bf16 into out for this thread's rows ra and ra + 8 of the tile (those
// below `rows`) and query head `head`; o in the m16n8 accumulator layout (two dims of each n8
// tile). A row that saw no key (l = 0) gets zeros.
template <int D>
__device__ __forceinline__ void store_row_pair(const PagedAttentionParams& p, const float (&o)[D / 8][4], float l_a,
                                               float l_b, int row0, int ra, int rows, int head) {
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
  }
  const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f, inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
  const int rb = ra + 8, tq = threadIdx.x % 4;
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) {
    const int d = nd * 8 + 2 * tq;
    if (ra < rows)
      *reinterpret_cast<uint32_t*>(p.out + ((size_t)(row0 + ra) * p.q_heads + head) * D + d) =
          pack_bf16(o[nd][0] * inv_a, o[nd][1] * inv_a);
    if (rb < rows)
      *reinterpret_cast<uint32_t*>(p.out + ((size_t)(row0 + rb) * p.q_heads + head) * D + d) =
          pack_bf16(o[nd][2] * inv_b, o[nd][3] * inv_b);
  }
}

}  // namespace moe::cuda::kernels::attention_detail
