// The row kernel of paged attention (AttentionPath::kRow): one block per (query row, group of query
// heads sharing a kv head, context split). The heads of a group read each key once; long contexts
// are cut into splits whose partial max / sum / output go to the workspace and are merged by a
// small reduce kernel (flash-decoding), so a batch of one still spreads over the whole GPU. Plain
// f32 FMAs and any head dim the entry accepts: the reference the tensor-core kernels are tested
// against, and the path for head dims they lack.
// Only CUDA headers here.
#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/attention/attention_device.cuh"
#include "backend/cuda/attention/attention_paths.h"
#include "backend/cuda/attention/online_softmax.cuh"

namespace moe::cuda::kernels::attention_detail {

namespace {

// Splits are added until about kTargetRowSplits (row, split) pairs exist, which with 4+ head groups
// per row is two waves on 132 SMs.
constexpr int kTargetRowSplits = 128;

__device__ __forceinline__ void unpack8(uint4 u, float* f) {
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 x = __bfloat1622float2(b[i]);
    f[2 * i] = x.x;
    f[2 * i + 1] = x.y;
  }
}

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

  // This thread's 16 bytes of each of its keys in the tile at t0 (zeros past the end), from the
  // K or the V cache.
  const auto load_rows = [&](const uint16_t* cache, int t0, uint4 (&kv)[KPG]) {
#pragma unroll
    for (int k = 0; k < KPG; ++k) {
      const int j = t0 + g + k * NG;
      kv[k] = make_uint4(0, 0, 0, 0);
      if (active && j < end)
        kv[k] = __ldg(reinterpret_cast<const uint4*>(cache + cache_offset(p, seq, j, kvh, block_shift) + d0));
    }
  };

  for (int t0 = begin; t0 < end; t0 += T) {
    uint4 kv[KPG];
    load_rows(p.k_cache, t0, kv);
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
    load_rows(p.v_cache, t0, kv);
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

}  // namespace

int choose_row_splits(int tokens, int max_context) {
  if (tokens <= 0 || max_context <= 0) return 1;
  int by_len = (max_context + kMinChunk - 1) / kMinChunk;
  int by_fill = (kTargetRowSplits + tokens - 1) / tokens;
  int s = by_len < by_fill ? by_len : by_fill;
  s = s < kMaxSplits ? s : kMaxSplits;
  return s < 1 ? 1 : s;
}

cudaError_t run_row(const PagedAttentionParams& p, cudaStream_t stream) {
  const int splits = choose_row_splits(p.tokens, p.max_context);
  int chunk = (p.max_context + splits - 1) / splits;
  chunk = chunk < 64 ? 64 : (chunk + 63) / 64 * 64;  // whole tiles of keys per split
  const int splits_used = (p.max_context + chunk - 1) / chunk;  // <= splits: the workspace fits
  float *part_o, *part_ml;
  const cudaError_t ws = split_partials(p.workspace, (size_t)p.tokens * p.q_heads, splits_used, p.head_dim,
                                        &part_o, &part_ml);
  if (ws != cudaSuccess) return ws;
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

}  // namespace moe::cuda::kernels::attention_detail
