// The decode kernel of paged attention (AttentionPath::kDecode) and the merge of its context
// splits: the decomposition of the row kernel (attention_row.cu) on mma.sync bf16 tensor cores,
// with the heads of a kv group as the rows of the tiles, K/V streamed by cp.async per warp, and
// the split count chosen per row on the device from its real length. Correct for every input;
// chosen when sequences average few rows (decode).
// Only CUDA headers here.
#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/attention/attention_device.cuh"
#include "backend/cuda/attention/attention_paths.h"
#include "backend/cuda/mma_sync.cuh"
#include "backend/cuda/attention/online_softmax.cuh"
#include "backend/cuda/pdl.h"

namespace moe::cuda::kernels::attention_detail {

namespace {

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

}  // namespace

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


cudaError_t run_decode(const PagedAttentionParams& p, cudaStream_t stream) {
  const DecodePlan plan = plan_decode(p.tokens, p.max_context, p.split_keys);
  float *part_o, *part_ml;
  const cudaError_t ws = split_partials(p.workspace, (size_t)p.tokens * p.q_heads, plan.splits, p.head_dim,
                                        &part_o, &part_ml);
  if (ws != cudaSuccess) return ws;
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

}  // namespace moe::cuda::kernels::attention_detail
