// Attention over a paged KV cache, bf16 in and out, f32 softmax and accumulation.
//
// Three kernels, each correct for every input (decode rows, prefill rows, mixed batches):
// - row kernel: one block per (query row, group of query heads sharing a kv head, context
//   split). The heads of a group read each key once; long contexts are cut into splits whose
//   partial max / sum / output go to the workspace and are merged by a small reduce kernel
//   (flash-decoding), so a batch of one still spreads over the whole GPU. Plain f32 FMAs; kept
//   as the reference and for head dims the others lack.
// - decode kernel: the same decomposition with the group's heads as the rows of mma.sync tiles,
//   K/V streamed by cp.async per warp, and the split count chosen per row on the device from its
//   real length (see the kernel's comment).
// - tiled kernel: one block per (64 rows of one sequence, one query head), key tiles of 64 with
//   an online softmax on mma.sync m16n8k16 bf16 tensor cores (FlashAttention-2 layout).
// Sequence lengths are read on the device; the host sizes only bound the grid.
// Only CUDA headers here.
#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/attention_launch.h"
#include "backend/cuda/mma_sync.cuh"
#include "backend/cuda/online_softmax.cuh"
#include "backend/cuda/pdl.h"

namespace moe::cuda::kernels {

namespace {

constexpr int kThreads = 128;

// Split heuristics of the row kernel. A split covers at least kMinChunk positions (fewer would
// spend more on the partial results than on the keys); splits are added until about
// kTargetRowSplits (row, split) pairs exist, which with 4+ head groups per row is two waves on
// 132 SMs; kMaxSplits bounds the workspace.
constexpr int kMinChunk = 64;
constexpr int kTargetRowSplits = 128;
constexpr int kMaxSplits = 64;

int choose_splits(int tokens, int max_context) {
  if (tokens <= 0 || max_context <= 0) return 1;
  int by_len = (max_context + kMinChunk - 1) / kMinChunk;
  int by_fill = (kTargetRowSplits + tokens - 1) / tokens;
  int s = by_len < by_fill ? by_len : by_fill;
  s = s < kMaxSplits ? s : kMaxSplits;
  return s < 1 ? 1 : s;
}

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

__device__ __forceinline__ void unpack8(uint4 u, float* f) {
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 x = __bfloat1622float2(b[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
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

// ---------------------------------------------------------------------------------------------
// Row kernel. L lanes hold one key (8 dims each, L = next power of two of head_dim / 8), so a
// warp covers 32 / L keys at a time and the block 128 / L; HG query heads share every key load.
// grid: x = row, y = head group, z = split.
template <int L, int HG>
__global__ void __launch_bounds__(kThreads) row_attention_kernel(const PagedAttentionParams p,
                                                                 int splits, int chunk,
                                                                 float* __restrict__ part_o,
                                                                 float* __restrict__ part_ml) {
  constexpr int NG = kThreads / L;  // key groups in the block
  constexpr int KPG = (64 / NG) < 1 ? 1 : ((64 / NG) > 8 ? 8 : 64 / NG);  // keys per group per tile
  constexpr int T = NG * KPG;                                              // keys per tile
  constexpr int kWarps = kThreads / 32;
  __shared__ float s_p[HG][T];
  __shared__ float s_m[HG], s_l[HG], s_alpha[HG];
  __shared__ float s_red[kWarps][HG][L * 8];

  const int row = blockIdx.x, split = blockIdx.z;
  if (row >= p.seq_starts[p.num_seqs]) return;
  const int D = p.head_dim;
  const int h0 = blockIdx.y * HG;
  const int kvh = h0 / (p.q_heads / p.kv_heads);
  const int seq = find_seq(p.seq_starts, p.num_seqs, row);
  const int n = p.seq_starts[seq + 1] - p.seq_starts[seq];
  const int visible = p.context_lens[seq] - n + (row - p.seq_starts[seq]) + 1;
  const int begin = split * chunk;
  // The last split runs to the row's end, so no key is lost even past max_context.
  const int end = split == splits - 1 ? visible : min(visible, begin + chunk);
  const size_t head_row = (size_t)row * p.q_heads + h0;  // first (row, head) of this block
  if (splits > 1 && begin >= end) {  // empty split: the reduce skips it by its zero sum
    if (threadIdx.x < HG) {
      part_ml[((head_row + threadIdx.x) * splits + split) * 2] = -INFINITY;
      part_ml[((head_row + threadIdx.x) * splits + split) * 2 + 1] = 0.f;
    }
    return;
  }

  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int g = tid / L, li = tid % L;
  const int d0 = li * 8;
  const bool active = d0 < D;
  const int block_shift = __ffs(p.block_size) - 1;

  float q[HG][8];
#pragma unroll
  for (int h = 0; h < HG; ++h) {
    uint4 u = make_uint4(0, 0, 0, 0);
    if (active) u = *reinterpret_cast<const uint4*>(p.q + (head_row + h) * D + d0);
    unpack8(u, q[h]);
  }
  float acc[HG][8];
#pragma unroll
  for (int h = 0; h < HG; ++h)
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[h][e] = 0.f;
  if (tid < HG) {
    s_m[tid] = -INFINITY;
    s_l[tid] = 0.f;
  }
  const float scale = p.scale * kLog2e;  // scores in the log2 domain, exp2 below

  for (int t0 = begin; t0 < end; t0 += T) {
    uint4 kv[KPG];
#pragma unroll
    for (int k = 0; k < KPG; ++k) {
      const int j = t0 + g + k * NG;
      kv[k] = make_uint4(0, 0, 0, 0);
      if (active && j < end)
        kv[k] = __ldg(reinterpret_cast<const uint4*>(p.k_cache + cache_offset(p, seq, j, kvh, block_shift) + d0));
    }
#pragma unroll
    for (int k = 0; k < KPG; ++k) {
      float kf[8];
      unpack8(kv[k], kf);
      const int j = t0 + g + k * NG;
#pragma unroll
      for (int h = 0; h < HG; ++h) {
        float s = 0.f;
#pragma unroll
        for (int e = 0; e < 8; ++e) s = fmaf(q[h][e], kf[e], s);
#pragma unroll
        for (int o = L / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (li == 0) s_p[h][g + k * NG] = j < end ? s * scale : -INFINITY;
      }
    }
    __syncthreads();
    for (int h = warp; h < HG; h += kWarps) {
      float mx = -INFINITY;
      for (int i = lane; i < T; i += 32) mx = fmaxf(mx, s_p[h][i]);
      mx = warp_max(mx);
      const float m_old = s_m[h];
      const float m_new = fmaxf(m_old, mx);  // finite: key t0 < end is in this tile
      float sum = 0.f;
      for (int i = lane; i < T; i += 32) {
        const float e = exp2f(s_p[h][i] - m_new);
        s_p[h][i] = e;
        sum += e;
      }
      sum = warp_sum(sum);
      __syncwarp();
      if (lane == 0) {
        const float alpha = exp2f(m_old - m_new);
        s_alpha[h] = alpha;
        s_l[h] = s_l[h] * alpha + sum;
        s_m[h] = m_new;
      }
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < KPG; ++k) {
      const int j = t0 + g + k * NG;
      kv[k] = make_uint4(0, 0, 0, 0);
      if (active && j < end)
        kv[k] = __ldg(reinterpret_cast<const uint4*>(p.v_cache + cache_offset(p, seq, j, kvh, block_shift) + d0));
    }
#pragma unroll
    for (int h = 0; h < HG; ++h) {
      const float a = s_alpha[h];
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[h][e] *= a;
    }
#pragma unroll
    for (int k = 0; k < KPG; ++k) {
      float vf[8];
      unpack8(kv[k], vf);
#pragma unroll
      for (int h = 0; h < HG; ++h) {
        const float pw = s_p[h][g + k * NG];
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[h][e] = fmaf(pw, vf[e], acc[h][e]);
      }
    }
    __syncthreads();
  }

  // Sum the key groups: first those of one warp by shuffles, then the warps through shared memory.
#pragma unroll
  for (int h = 0; h < HG; ++h)
#pragma unroll
    for (int e = 0; e < 8; ++e)
#pragma unroll
      for (int o = L; o < 32; o <<= 1) acc[h][e] += __shfl_xor_sync(0xffffffffu, acc[h][e], o);
  if (lane < L && active) {
#pragma unroll
    for (int h = 0; h < HG; ++h)
#pragma unroll
      for (int e = 0; e < 8; ++e) s_red[warp][h][d0 + e] = acc[h][e];
  }
  __syncthreads();
  for (int i = tid; i < HG * D; i += kThreads) {
    const int h = i / D, d = i % D;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) o += s_red[w][h][d];
    if (splits == 1) {
      const float l = s_l[h];
      p.out[(head_row + h) * D + d] = __bfloat16_as_ushort(__float2bfloat16(l > 0.f ? o / l : 0.f));
    } else {
      part_o[((head_row + h) * splits + split) * D + d] = o;
    }
  }
  if (splits > 1 && tid < HG) {
    part_ml[((head_row + tid) * splits + split) * 2] = s_m[tid];
    part_ml[((head_row + tid) * splits + split) * 2 + 1] = s_l[tid];
  }
}

// Merges the splits of one (row, head): weights exp2(m_i - max m) on sums and outputs.
__global__ void split_reduce_kernel(const PagedAttentionParams p, int splits,
                                    const float* __restrict__ part_o,
                                    const float* __restrict__ part_ml) {
  const int rh = blockIdx.x;  // row * q_heads + head
  const int row = rh / p.q_heads;
  if (row >= p.seq_starts[p.num_seqs]) return;
  const float* ml = part_ml + (size_t)rh * splits * 2;
  float mx = -INFINITY;
  for (int i = 0; i < splits; ++i)
    if (ml[2 * i + 1] > 0.f) mx = fmaxf(mx, ml[2 * i]);
  float total = 0.f;
  for (int i = 0; i < splits; ++i)
    if (ml[2 * i + 1] > 0.f) total += ml[2 * i + 1] * exp2f(ml[2 * i] - mx);
  const int D = p.head_dim;
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float o = 0.f;
    for (int i = 0; i < splits; ++i)
      if (ml[2 * i + 1] > 0.f) o += exp2f(ml[2 * i] - mx) * part_o[((size_t)rh * splits + i) * D + d];
    p.out[(size_t)rh * D + d] = __bfloat16_as_ushort(__float2bfloat16(total > 0.f ? o / total : 0.f));
  }
}

// ---------------------------------------------------------------------------------------------
// Tiled kernel (tensor cores). Warp w owns query rows 16w..16w+15 of the tile; its Q fragments
// stay in registers, K and V tiles of 64 keys pass through shared memory (rows padded by 16 bytes
// so ldmatrix hits distinct banks). S = Q K^T and O += P V on m16n8k16, P rounded to bf16 for the
// second product (its f32 row sums are kept for the normalisation).
constexpr int kTileQ = 64;
constexpr int kTileK = 64;

// grid: x = tile slot (counted from the back, so the longest causal tiles start first),
// y = query head.
template <int D>
__global__ void __launch_bounds__(kThreads) tiled_attention_kernel(const PagedAttentionParams p) {
  constexpr int kStride = D + 8;  // bf16 elements per shared row
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  __shared__ __align__(16) uint16_t s_k[kTileK * kStride];
  __shared__ __align__(16) uint16_t s_v[kTileK * kStride];

  // Find (sequence, tile): tiles are numbered sequence by sequence.
  int tile = gridDim.x - 1 - blockIdx.x;
  int seq = -1;
  for (int s = 0; s < p.num_seqs; ++s) {
    const int nt = (p.seq_starts[s + 1] - p.seq_starts[s] + kTileQ - 1) / kTileQ;
    if (tile < nt) {
      seq = s;
      break;
    }
    tile -= nt;
  }
  if (seq < 0) return;
  const int head = blockIdx.y;
  const int kvh = head / (p.q_heads / p.kv_heads);
  const int n = p.seq_starts[seq + 1] - p.seq_starts[seq];
  const int row0 = p.seq_starts[seq] + tile * kTileQ;
  const int rows = min(kTileQ, n - tile * kTileQ);
  const int pos0 = p.context_lens[seq] - n + tile * kTileQ;  // position of the tile's row 0
  const int kv_end = pos0 + rows;                             // keys this tile can see
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int gr = lane / 4, tq = lane % 4;
  const int block_shift = __ffs(p.block_size) - 1;

  // Q tile through s_k into registers.
  for (int i = tid; i < kTileQ * kChunks; i += kThreads) {
    const int r = i / kChunks, c = i % kChunks;
    uint4 u = make_uint4(0, 0, 0, 0);
    if (r < rows) u = *reinterpret_cast<const uint4*>(p.q + ((size_t)(row0 + r) * p.q_heads + head) * D + c * 8);
    *reinterpret_cast<uint4*>(s_k + r * kStride + c * 8) = u;
  }
  __syncthreads();
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    ldmatrix_x4(qf[kk], s_k + (warp * 16 + lane % 16) * kStride + kk * 16 + (lane / 16) * 8);
  __syncthreads();

  const int pos_a = pos0 + warp * 16 + gr, pos_b = pos_a + 8;  // this thread's two rows
  const int warp_last = pos0 + warp * 16 + 15;
  float o[D / 8][4];
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
  const float scale = p.scale * kLog2e;

  for (int kt = 0; kt < kv_end; kt += kTileK) {
    for (int i = tid; i < kTileK * kChunks; i += kThreads) {
      const int r = i / kChunks, c = i % kChunks;
      const int j = kt + r;
      uint4 ku = make_uint4(0, 0, 0, 0), vu = ku;
      if (j < kv_end) {
        const size_t off = cache_offset(p, seq, j, kvh, block_shift) + c * 8;
        ku = __ldg(reinterpret_cast<const uint4*>(p.k_cache + off));
        vu = __ldg(reinterpret_cast<const uint4*>(p.v_cache + off));
      }
      *reinterpret_cast<uint4*>(s_k + r * kStride + c * 8) = ku;
      *reinterpret_cast<uint4*>(s_v + r * kStride + c * 8) = vu;
    }
    __syncthreads();
    // Skipped by a warp whose rows all precede this key tile, or are all padding.
    if (kt <= warp_last && warp * 16 < rows) {
      float s[kTileK / 8][4];
#pragma unroll
      for (int nt = 0; nt < kTileK / 8; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < D / 16; ++kk) {
#pragma unroll
        for (int nt = 0; nt < kTileK / 8; nt += 2) {
          uint32_t b[4];
          const int m = lane / 8;
          ldmatrix_x4(b, s_k + ((nt + (m >> 1)) * 8 + lane % 8) * kStride + kk * 16 + (m & 1) * 8);
          mma_bf16(s[nt], qf[kk], b[0], b[1]);
          mma_bf16(s[nt + 1], qf[kk], b[2], b[3]);
        }
      }
      // Causal: each row sees the keys up to its own position.
      const auto causal = [&](int nt, float (&c)[4]) {
        const int j = kt + nt * 8 + 2 * tq;
        c[0] = j <= pos_a ? c[0] * scale : -INFINITY;
        c[1] = j + 1 <= pos_a ? c[1] * scale : -INFINITY;
        c[2] = j <= pos_b ? c[2] * scale : -INFINITY;
        c[3] = j + 1 <= pos_b ? c[3] * scale : -INFINITY;
      };
      const TileMax t = raise_running_max(s, m_a, m_b, causal);
      m_a = t.m_a;
      m_b = t.m_b;
      const RowPair sum = tile_weights_and_sums(s, t);
      l_a = l_a * t.alpha_a + sum.a;
      l_b = l_b * t.alpha_b + sum.b;
      rescale_rows(o, t);
#pragma unroll
      for (int kk = 0; kk < kTileK / 16; ++kk) {
        uint32_t a[4];
        accumulators_to_a_fragment(s[2 * kk], s[2 * kk + 1], a);
#pragma unroll
        for (int nd = 0; nd < D / 8; nd += 2) {
          uint32_t b[4];
          const int m = lane / 8;
          ldmatrix_x4_trans(b, s_v + (kk * 16 + (m & 1) * 8 + lane % 8) * kStride + (nd + (m >> 1)) * 8);
          mma_bf16(o[nd], a, b[0], b[1]);
          mma_bf16(o[nd + 1], a, b[2], b[3]);
        }
      }
    }
    __syncthreads();
  }

  // Every thread of the quad gets its rows' whole l.
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
  }
  const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f, inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
  const int ra = warp * 16 + gr, rb = ra + 8;
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

// ---------------------------------------------------------------------------------------------
// Decode kernel (tensor cores). One block per (row, group of up to 16 query heads on one kv head,
// context split). The heads are the 16 rows of an m16n8k16 tile (zero queries pad a smaller
// group), the keys its n dimension, so S = Q K^T and O += P V use the fragment layout of the
// tiled kernel. Each warp walks its own 16-key steps of the split (steps w, w + 4, ...) through a
// private cp.async ring, so warps never wait on one another until the final merge of their
// (max, sum, output) through shared memory. The split count is chosen per row on the device from
// its real length: the grid is sized for max_context, blocks of splits past the end exit at once,
// and a row with one split writes its output directly (the reduce kernel skips it).
constexpr int kDecWarps = kThreads / 32;
constexpr int kDecKeys = 16;    // keys per warp step: one n16 pair of S tiles, one k16 step of P V
// (row, split) pairs aimed at when sizing the grid's split count: a batch of 64 rows gets 2 (with
// 4 kv heads, 512 blocks: two waves at two blocks an SM), a batch of 128 none. Measured on an H100
// with 64 rows of 2048: 1 split 100 us, 2 106 us, 4 109 us, 8 114 us.
constexpr int kDecTarget = 128;
// A row uses at most this many splits of its own accord (chunk grows with its length): at one
// row of 2048 on an H100, 16 splits of 128 took 7.0-7.6 us and 32 of 64 7.5-8.1 us (two runs).
constexpr int kDecSplitCap = 16;
// Rows of at most this many keys take one split of their own accord: their keys are too few to
// pay for merging splits (qwen3-30b-a3b batch 1 at ~190 keys, H100: 3.460 -> 3.446 ms a step).
constexpr int kDecOneSplitKeys = 256;

template <int D>
struct DecodeCfg {
  static constexpr int kStages = D <= 64 ? 4 : 3;  // 3 x 8.5 KB per warp at D = 128: two blocks an SM
  static constexpr int kStride = D + 8;             // bf16 per shared row, padded for ldmatrix banks
  static constexpr int kStageElems = 2 * kDecKeys * kStride;  // K rows, then V rows
  static constexpr size_t kRingBytes = (size_t)kDecWarps * kStages * kStageElems * 2;
  static constexpr int kOStride = D + 4;  // f32 per row of the merge buffer
  static constexpr size_t kMergeBytes = (size_t)kDecWarps * 16 * kOStride * 4;
  static constexpr size_t kSmem = kRingBytes > kMergeBytes ? kRingBytes : kMergeBytes;
};

struct DecodePlan {
  int splits;  // grid z: the most splits a row may use
  int chunk;   // keys per split (a multiple of kDecKeys); the last split of a row takes the rest
};

DecodePlan plan_decode(int tokens, int max_context, int split_keys) {
  DecodePlan d;
  if (split_keys > 0) {
    d.chunk = (split_keys + kDecKeys - 1) / kDecKeys * kDecKeys;
    d.splits = (max_context + d.chunk - 1) / d.chunk;
  } else {
    const int by_len = (max_context + kMinChunk - 1) / kMinChunk;
    const int by_fill = tokens > 0 ? (kDecTarget + tokens - 1) / tokens : 1;
    d.splits = by_len < by_fill ? by_len : by_fill;
    d.splits = d.splits < 1 ? 1 : d.splits;
    d.splits = d.splits > kMaxSplits ? kMaxSplits : d.splits;
    int c = (max_context + d.splits - 1) / d.splits;
    c = c < kMinChunk ? kMinChunk : c;
    d.chunk = (c + kDecKeys - 1) / kDecKeys * kDecKeys;
  }
  d.splits = d.splits < 1 ? 1 : (d.splits > kMaxSplits ? kMaxSplits : d.splits);
  return d;
}

// Keys per split of a row: the host's chunk, grown so the row uses at most split_cap splits
// (split_cap 0: the chunk as given).
__device__ __forceinline__ int decode_chunk(int visible, int chunk, int split_cap) {
  if (split_cap <= 0) return chunk;
  if (visible <= kDecOneSplitKeys)
    return visible > chunk ? (visible + kDecKeys - 1) / kDecKeys * kDecKeys : chunk;
  int c = (visible + split_cap - 1) / split_cap;
  c = (c + kDecKeys - 1) / kDecKeys * kDecKeys;
  return c > chunk ? c : chunk;
}

__device__ __forceinline__ int decode_splits(int visible, int chunk, int max_splits) {
  const int n = (visible + chunk - 1) / chunk;
  return n < 1 ? 1 : (n > max_splits ? max_splits : n);
}

// grid: x = row, y = head group, z = split slot.
template <int D>
__global__ void __launch_bounds__(kThreads, 2) decode_attention_kernel(const PagedAttentionParams p, int hg,
                                                                      int chunk, int split_cap,
                                                                      float* __restrict__ part_o,
                                                                      float* __restrict__ part_ml) {
  using C = DecodeCfg<D>;
  constexpr int NS = C::kStages;
  constexpr int kChunks = D / 8;  // 16-byte pieces of a key row
  constexpr int kLoads = kDecKeys * kChunks / 32;
  static_assert(kDecKeys * kChunks % 32 == 0, "a warp step must split evenly over the lanes");
  extern __shared__ __align__(16) unsigned char dsmem[];
  __shared__ float s_mw[kDecWarps][16], s_lw[kDecWarps][16], s_mt[16], s_lt[16];

  // The step's metadata (lengths, block tables) is uploaded before the forward and stays
  // constant over it, so its chain of dependent loads is read before waiting for the q/k/v
  // preparation (pdl.h), overlapping that kernel, up to the table entries of the first steps.
  const int row = blockIdx.x, split = blockIdx.z, max_splits = gridDim.z;
  int seq = 0, visible = 0, n_s = 0;  // n_s = 0: a padding row, nothing to do
  if (row < p.seq_starts[p.num_seqs]) {
    seq = find_seq(p.seq_starts, p.num_seqs, row);
    const int n = p.seq_starts[seq + 1] - p.seq_starts[seq];
    visible = p.context_lens[seq] - n + (row - p.seq_starts[seq]) + 1;
    chunk = decode_chunk(visible, chunk, split_cap);
    n_s = decode_splits(visible, chunk, max_splits);
  }
  const int begin = split * chunk;
  const int end = split == n_s - 1 ? visible : begin + chunk;
  const int h0 = blockIdx.y * hg;
  const int kvh = h0 / (p.q_heads / p.kv_heads);
  const size_t head_row = (size_t)row * p.q_heads + h0;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int gr = lane / 4, tq = lane % 4;
  const int block_shift = __ffs(p.block_size) - 1, block_mask = p.block_size - 1;
  const int32_t* table = p.block_tables + (size_t)seq * p.max_blocks_per_seq;
  const int len = split < n_s && end > begin ? end - begin : 0;
  const int steps = (len + kDecKeys - 1) / kDecKeys;
  const int my = steps > warp ? (steps - warp + kDecWarps - 1) / kDecWarps : 0;  // this warp's steps
  // This lane's table entry for step i of this warp (the block of key t0 + lane % kDecKeys).
  auto block_of = [&](int i) {
    const int jl = begin + (warp + i * kDecWarps) * kDecKeys + (lane & (kDecKeys - 1));
    return i < my && jl < end ? __ldg(table + (jl >> block_shift)) : 0;
  };
  int first_blocks[NS - 1];
#pragma unroll
  for (int i = 0; i < NS - 1; ++i) first_blocks[i] = block_of(i);

  wait_for_predecessor();
  // Lets the reduce kernel (launched with programmatic stream serialization) be scheduled while
  // this grid drains; it waits for this grid's completion before reading anything we write.
  allow_dependents();
  if (split >= n_s) return;

  // Query fragments straight from global memory: rows gr and gr + 8 of the head group.
  const bool ra = gr < hg, rb = gr + 8 < hg;
  const uint32_t* qa = reinterpret_cast<const uint32_t*>(p.q + (head_row + gr) * D);
  const uint32_t* qb = reinterpret_cast<const uint32_t*>(p.q + (head_row + gr + 8) * D);
  uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    qf[kk][0] = ra ? __ldg(qa + kk * 8 + tq) : 0u;
    qf[kk][1] = rb ? __ldg(qb + kk * 8 + tq) : 0u;
    qf[kk][2] = ra ? __ldg(qa + kk * 8 + 4 + tq) : 0u;
    qf[kk][3] = rb ? __ldg(qb + kk * 8 + 4 + tq) : 0u;
  }

  uint16_t* ring = reinterpret_cast<uint16_t*>(dsmem) + (size_t)warp * NS * C::kStageElems;
  const size_t pos_stride = (size_t)p.kv_heads * D;  // elements per cache position
  const uint16_t* kbase = p.k_cache + (size_t)kvh * D;
  const uint16_t* vbase = p.v_cache + (size_t)kvh * D;

  // Step i of this warp into ring stage i % NS. Keys at or past `end` are zero-filled and never
  // addressed: their table entries and cache rows may hold anything, and a NaN V row would leak
  // through a zero weight.
  auto issue = [&](int i, int blk) {
    if (i < my) {
      const int t0 = begin + (warp + i * kDecWarps) * kDecKeys;
      uint16_t* sk = ring + (i % NS) * C::kStageElems;
      uint16_t* sv = sk + kDecKeys * C::kStride;
#pragma unroll
      for (int it = 0; it < kLoads; ++it) {
        const int c = lane + it * 32;
        const int r = c / kChunks, ch = c % kChunks;
        const int b = __shfl_sync(0xffffffffu, blk, r);
        const int j = t0 + r;
        const bool ok = j < end;
        const size_t off = ok ? ((size_t)b * p.block_size + (j & block_mask)) * pos_stride + ch * 8 : 0;
        cp_async16(sk + r * C::kStride + ch * 8, kbase + off, ok);
        cp_async16(sv + r * C::kStride + ch * 8, vbase + off, ok);
      }
    }
    cp_async_commit();  // an empty group past the end keeps the wait count uniform
  };

  float o[D / 8][4];
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) o[nd][0] = o[nd][1] = o[nd][2] = o[nd][3] = 0.f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
  const float scale = p.scale * kLog2e;

#pragma unroll
  for (int i = 0; i < NS - 1; ++i) issue(i, first_blocks[i]);
  for (int i = 0; i < my; ++i) {
    issue(i + NS - 1, block_of(i + NS - 1));
    cp_async_wait<NS - 1>();
    __syncwarp();
    const uint16_t* sk = ring + (i % NS) * C::kStageElems;
    const uint16_t* sv = sk + kDecKeys * C::kStride;
    const int t0 = begin + (warp + i * kDecWarps) * kDecKeys;
    const int m8 = lane / 8;
    float s[2][4];
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      uint32_t b[4];
      ldmatrix_x4(b, sk + ((m8 >> 1) * 8 + lane % 8) * C::kStride + kk * 16 + (m8 & 1) * 8);
      mma_bf16(s[0], qf[kk], b[0], b[1]);
      mma_bf16(s[1], qf[kk], b[2], b[3]);
    }
    // Padding rows (heads past the group) and keys past the split are masked.
    const auto in_split = [&](int nt, float (&c)[4]) {
      const int j = t0 + nt * 8 + 2 * tq;
      c[0] = ra && j < end ? c[0] * scale : -INFINITY;
      c[1] = ra && j + 1 < end ? c[1] * scale : -INFINITY;
      c[2] = rb && j < end ? c[2] * scale : -INFINITY;
      c[3] = rb && j + 1 < end ? c[3] * scale : -INFINITY;
    };
    // The step of online_softmax.cuh with tile_weights rather than tile_weights_and_sums: this
    // kernel adds a row's four weights left to right in one expression, not n8 tile by n8 tile.
    // The order sets the rounding of l, and with it the last bits of the output.
    const TileMax t = raise_running_max(s, m_a, m_b, in_split);
    m_a = t.m_a;
    m_b = t.m_b;
    tile_weights(s, t);
    l_a = l_a * t.alpha_a + (s[0][0] + s[0][1] + s[1][0] + s[1][1]);
    l_b = l_b * t.alpha_b + (s[0][2] + s[0][3] + s[1][2] + s[1][3]);
    rescale_rows(o, t);
    uint32_t a[4];
    accumulators_to_a_fragment(s[0], s[1], a);
#pragma unroll
    for (int nd = 0; nd < D / 8; nd += 2) {
      uint32_t b[4];
      ldmatrix_x4_trans(b, sv + ((m8 & 1) * 8 + lane % 8) * C::kStride + (nd + (m8 >> 1)) * 8);
      mma_bf16(o[nd], a, b[0], b[1]);
      mma_bf16(o[nd + 1], a, b[2], b[3]);
    }
    __syncwarp();  // every lane is done with this stage before a later step refills it
  }
  cp_async_wait<0>();

  // Merge the warps: common max per head row, rescaled outputs summed through shared memory
  // (the rings are free once every warp has passed the barrier).
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
  }
  if (tq == 0) {
    s_mw[warp][gr] = m_a;
    s_mw[warp][gr + 8] = m_b;
    s_lw[warp][gr] = l_a;
    s_lw[warp][gr + 8] = l_b;
  }
  __syncthreads();
  float ma = -INFINITY, mb = -INFINITY;
#pragma unroll
  for (int w = 0; w < kDecWarps; ++w) {
    ma = fmaxf(ma, s_mw[w][gr]);
    mb = fmaxf(mb, s_mw[w][gr + 8]);
  }
  const float fa = m_a == -INFINITY ? 0.f : exp2f(m_a - ma);
  const float fb = m_b == -INFINITY ? 0.f : exp2f(m_b - mb);
  float* so = reinterpret_cast<float*>(dsmem);
  float* mine = so + warp * 16 * C::kOStride;
#pragma unroll
  for (int nd = 0; nd < D / 8; ++nd) {
    const int d = nd * 8 + 2 * tq;
    *reinterpret_cast<float2*>(mine + gr * C::kOStride + d) = make_float2(o[nd][0] * fa, o[nd][1] * fa);
    *reinterpret_cast<float2*>(mine + (gr + 8) * C::kOStride + d) = make_float2(o[nd][2] * fb, o[nd][3] * fb);
  }
  if (tid < 16) {
    float mt = -INFINITY, lt = 0.f;
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) mt = fmaxf(mt, s_mw[w][tid]);
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w)
      if (s_mw[w][tid] != -INFINITY) lt += s_lw[w][tid] * exp2f(s_mw[w][tid] - mt);
    s_mt[tid] = mt;
    s_lt[tid] = lt;
  }
  __syncthreads();

  constexpr int kQuads = D / 4;
  for (int i = tid; i < hg * kQuads; i += kThreads) {
    const int r = i / kQuads, d = (i % kQuads) * 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
    for (int w = 0; w < kDecWarps; ++w) {
      const float4 v = *reinterpret_cast<const float4*>(so + (w * 16 + r) * C::kOStride + d);
      acc.x += v.x;
      acc.y += v.y;
      acc.z += v.z;
      acc.w += v.w;
    }
    if (n_s == 1) {
      const float l = s_lt[r];
      const float inv = l > 0.f ? 1.f / l : 0.f;
      *reinterpret_cast<uint2*>(p.out + (head_row + r) * D + d) =
          make_uint2(pack_bf16(acc.x * inv, acc.y * inv), pack_bf16(acc.z * inv, acc.w * inv));
    } else {
      *reinterpret_cast<float4*>(part_o + ((head_row + r) * max_splits + split) * D + d) = acc;
    }
  }
  if (n_s > 1 && tid < hg) {
    part_ml[((head_row + tid) * max_splits + split) * 2] = s_mt[tid];
    part_ml[((head_row + tid) * max_splits + split) * 2 + 1] = s_lt[tid];
  }
}

// Merges the splits of RH heads of one row of the decode kernel, a thread per (head, dim); rows
// with one split were written there. Few, wide blocks: at 64 rows an empty block per (row, head)
// cost about 3 us. Launched as a programmatic dependent: everything before griddepcontrol.wait
// reads only inputs of the call.
template <int D>
__global__ void __launch_bounds__(1024) decode_reduce_kernel(const PagedAttentionParams p, int chunk, int split_cap,
                                                             int max_splits, const float* __restrict__ part_o,
                                                             const float* __restrict__ part_ml) {
  static_assert(D >= 32 && kMaxSplits <= 64, "one warp weighs a head's splits, two per lane");
  __shared__ float s_w[1024 / D][kMaxSplits];
  __shared__ float s_inv[1024 / D];
  const int rh_count = blockDim.x / D;  // heads of this block
  const int row = blockIdx.x, h0 = blockIdx.y * rh_count;
  if (row >= p.seq_starts[p.num_seqs]) return;
  const int seq = find_seq(p.seq_starts, p.num_seqs, row);
  const int n = p.seq_starts[seq + 1] - p.seq_starts[seq];
  const int visible = p.context_lens[seq] - n + (row - p.seq_starts[seq]) + 1;
  const int n_s = decode_splits(visible, decode_chunk(visible, chunk, split_cap), max_splits);
  // Wait even where there is nothing to merge: this grid must not complete before the attention
  // grid, or the o projection chained after it could read rows that kernel has not written.
  wait_for_predecessor();
  if (n_s <= 1) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp < rh_count) {
    const float* ml = part_ml + ((size_t)row * p.q_heads + h0 + warp) * max_splits * 2;
    float m0 = -INFINITY, l0 = 0.f, m1 = -INFINITY, l1 = 0.f;
    if (lane < n_s) {
      m0 = ml[2 * lane];
      l0 = ml[2 * lane + 1];
    }
    if (lane + 32 < n_s) {
      m1 = ml[2 * (lane + 32)];
      l1 = ml[2 * (lane + 32) + 1];
    }
    const float mx = warp_max(fmaxf(l0 > 0.f ? m0 : -INFINITY, l1 > 0.f ? m1 : -INFINITY));
    const float w0 = l0 > 0.f ? exp2f(m0 - mx) : 0.f;
    const float w1 = l1 > 0.f ? exp2f(m1 - mx) : 0.f;
    if (lane < n_s) s_w[warp][lane] = w0;
    if (lane + 32 < n_s) s_w[warp][lane + 32] = w1;
    const float total = warp_sum(w0 * l0 + w1 * l1);
    if (lane == 0) s_inv[warp] = total > 0.f ? 1.f / total : 0.f;
  }
  __syncthreads();
  const int hl = threadIdx.x / D, d = threadIdx.x % D;
  const size_t rh = (size_t)row * p.q_heads + h0 + hl;
  const float* po = part_o + rh * max_splits * D + d;
  float acc = 0.f;
#pragma unroll 4
  for (int i = 0; i < n_s; ++i) acc = fmaf(s_w[hl][i], po[(size_t)i * D], acc);
  p.out[rh * D + d] = __bfloat16_as_ushort(__float2bfloat16(acc * s_inv[hl]));
}

template <int D>
cudaError_t launch_decode(const PagedAttentionParams& p, int hg, const DecodePlan& plan, float* part_o,
                          float* part_ml, cudaStream_t stream) {
  const int split_cap = p.split_keys > 0 ? 0 : kDecSplitCap;  // a tuning override is taken as given
  using C = DecodeCfg<D>;
  cudaError_t e = cudaFuncSetAttribute(decode_attention_kernel<D>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       static_cast<int>(C::kSmem));
  if (e != cudaSuccess) return e;
  const dim3 grid(p.tokens, p.q_heads / hg, plan.splits);
  e = launch_dependent(decode_attention_kernel<D>, grid, dim3(kThreads), C::kSmem, stream, p, hg, plan.chunk,
                       split_cap, part_o, part_ml);
  if (e != cudaSuccess || plan.splits == 1) return e;
  // Heads per reduce block: the largest divisor of the decode block's group that fits 1024 threads.
  int rh = hg;
  while (rh * D > 1024 || hg % rh != 0) --rh;
  return launch_dependent(decode_reduce_kernel<D>, dim3(p.tokens, p.q_heads / rh), dim3(rh * D), 0, stream, p,
                          plan.chunk, split_cap, plan.splits, static_cast<const float*>(part_o),
                          static_cast<const float*>(part_ml));
}

cudaError_t run_decode(const PagedAttentionParams& p, cudaStream_t stream) {
  const DecodePlan plan = plan_decode(p.tokens, p.max_context, p.split_keys);
  float* part_o = nullptr;
  float* part_ml = nullptr;
  if (plan.splits > 1) {
    if (p.workspace == nullptr) return cudaErrorInvalidValue;
    part_o = static_cast<float*>(p.workspace);
    part_ml = part_o + (size_t)p.tokens * p.q_heads * plan.splits * p.head_dim;
  }
  // Heads per block: the largest divisor of the kv group that fits the 16 rows of the tile.
  const int group = p.q_heads / p.kv_heads;
  int hg = 16 < group ? 16 : group;
  while (group % hg != 0) --hg;
  switch (p.head_dim) {
    case 32: return launch_decode<32>(p, hg, plan, part_o, part_ml, stream);
    case 64: return launch_decode<64>(p, hg, plan, part_o, part_ml, stream);
    case 128: return launch_decode<128>(p, hg, plan, part_o, part_ml, stream);
    default: return cudaErrorInvalidValue;
  }
}

// ---------------------------------------------------------------------------------------------
template <int L, int HG>
void launch_row(const PagedAttentionParams& p, int splits, int chunk, float* part_o,
                float* part_ml, cudaStream_t stream) {
  const dim3 grid(p.tokens, p.q_heads / HG, splits);
  row_attention_kernel<L, HG><<<grid, kThreads, 0, stream>>>(p, splits, chunk, part_o, part_ml);
}

template <int L>
void launch_row_group(const PagedAttentionParams& p, int hg, int splits, int chunk, float* part_o,
                      float* part_ml, cudaStream_t stream) {
  switch (hg) {
    case 8: launch_row<L, 8>(p, splits, chunk, part_o, part_ml, stream); break;
    case 4: launch_row<L, 4>(p, splits, chunk, part_o, part_ml, stream); break;
    case 2: launch_row<L, 2>(p, splits, chunk, part_o, part_ml, stream); break;
    default: launch_row<L, 1>(p, splits, chunk, part_o, part_ml, stream); break;
  }
}

cudaError_t run_row(const PagedAttentionParams& p, cudaStream_t stream) {
  const int splits = choose_splits(p.tokens, p.max_context);
  int chunk = (p.max_context + splits - 1) / splits;
  chunk = chunk < 64 ? 64 : (chunk + 63) / 64 * 64;  // whole tiles of keys per split
  const int splits_used = (p.max_context + chunk - 1) / chunk;  // <= splits: the workspace fits
  float* part_o = nullptr;
  float* part_ml = nullptr;
  if (splits_used > 1) {
    if (p.workspace == nullptr) return cudaErrorInvalidValue;
    part_o = static_cast<float*>(p.workspace);
    part_ml = part_o + (size_t)p.tokens * p.q_heads * splits_used * p.head_dim;
  }
  // Heads of one kv group per block: the largest power of two, at most 8, dividing the group.
  const int group = p.q_heads / p.kv_heads;
  const int hg = group % 8 == 0 ? 8 : group % 4 == 0 ? 4 : group % 2 == 0 ? 2 : 1;
  int lanes = 1;
  while (lanes * 8 < p.head_dim) lanes *= 2;
  switch (lanes) {
    case 1: launch_row_group<1>(p, hg, splits_used, chunk, part_o, part_ml, stream); break;
    case 2: launch_row_group<2>(p, hg, splits_used, chunk, part_o, part_ml, stream); break;
    case 4: launch_row_group<4>(p, hg, splits_used, chunk, part_o, part_ml, stream); break;
    case 8: launch_row_group<8>(p, hg, splits_used, chunk, part_o, part_ml, stream); break;
    case 16: launch_row_group<16>(p, hg, splits_used, chunk, part_o, part_ml, stream); break;
    default: launch_row_group<32>(p, hg, splits_used, chunk, part_o, part_ml, stream); break;
  }
  if (splits_used > 1) {
    const int threads = p.head_dim <= 128 ? 128 : 256;
    split_reduce_kernel<<<p.tokens * p.q_heads, threads, 0, stream>>>(p, splits_used, part_o, part_ml);
  }
  return cudaGetLastError();
}

cudaError_t run_tiled(const PagedAttentionParams& p, cudaStream_t stream) {
  // Each sequence leaves at most one partly filled tile.
  const dim3 grid((p.tokens + kTileQ - 1) / kTileQ + p.num_seqs, p.q_heads);
  switch (p.head_dim) {
    case 32: tiled_attention_kernel<32><<<grid, kThreads, 0, stream>>>(p); break;
    case 64: tiled_attention_kernel<64><<<grid, kThreads, 0, stream>>>(p); break;
    case 128: tiled_attention_kernel<128><<<grid, kThreads, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace

size_t paged_attention_workspace_bytes(int tokens, int q_heads, int head_dim, int max_context, int split_keys) {
  // The worst case over every call with at most `tokens` rows: fewer rows may use more splits.
  size_t worst = 0;
  for (int t = 1; t <= tokens; ++t) {
    const int row = choose_splits(t, max_context);
    const int dec = plan_decode(t, max_context, split_keys).splits;
    const int s = row > dec ? row : dec;
    if (s > 1 && (size_t)t * s > worst) worst = (size_t)t * s;
  }
  return worst * q_heads * (head_dim + 2) * sizeof(float);
}

bool paged_attention_has_tiled(int head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128;
}

bool paged_attention_has_decode(int head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128;
}

cudaError_t paged_attention(const PagedAttentionParams& p, cudaStream_t stream) {
  const bool pow2_block = (p.block_size & (p.block_size - 1)) == 0;
  if (p.num_seqs <= 0 || p.tokens < 0 || p.q_heads <= 0 || p.kv_heads <= 0 ||
      p.q_heads % p.kv_heads != 0 || p.head_dim <= 0 || p.head_dim % 8 != 0 ||
      p.head_dim > kAttentionMaxHeadDim || !pow2_block || p.block_size < kAttentionMinBlockSize ||
      p.block_size > kAttentionMaxBlockSize || p.max_blocks_per_seq <= 0 || p.max_context < 0)
    return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaSuccess;
  AttentionPath path = p.path;
  if (path == AttentionPath::kAuto) {
    // Rows per sequence on average: decode has one, prefill hundreds. Below 16 most 64-row tiles
    // would be padding.
    const bool many_rows = p.tokens >= 16 * p.num_seqs;
    if (many_rows && paged_attention_has_tiled(p.head_dim)) path = AttentionPath::kTiled;
    else if (paged_attention_has_decode(p.head_dim)) path = AttentionPath::kDecode;
    else path = AttentionPath::kRow;
  }
  switch (path) {
    case AttentionPath::kTiled: return run_tiled(p, stream);
    case AttentionPath::kDecode: return run_decode(p, stream);
    default: return run_row(p, stream);
  }
}

}  // namespace moe::cuda::kernels
