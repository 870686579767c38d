// Multi-head latent attention (absorbed form) over a paged latent cache, and the two small ops
// that fill its inputs. bf16 in and out, f32 norms, rotations, softmax and accumulation.
//
// Attention kernel: all heads read the same latent row of a token, so a block owns 16 "query
// slots" of one sequence, the (row, head) pairs 16k..16k+15 of that sequence in row-major order
// (16 heads of one row for DeepSeek-V2-Lite; an m16 slice of the 128 heads of V3; several rows
// when heads < 16), and reads each cache row once for all of them. The 16 slots are the M side of
// mma.sync m16n8k16 bf16 tensor-core products:
//   S[16, 32 keys] = Q[16, D] K^T: the D = lora + rope dims are cut into 16-wide chunks dealt to
//     the 4 warps (chunk c to warp c % 4), each warp keeps its Q fragments in registers and makes
//     a partial S; the partials meet in shared memory and every warp sums them in the same order,
//     so all warps hold the same S and the same online-softmax state.
//   O[16, lora] += P V: each warp owns its 16-wide chunks of the lora value dims.
// Key tiles of 32 rows are double-buffered in shared memory through cp.async (rows padded by 16
// bytes so ldmatrix hits distinct banks; rows past the range and dims past D are zero-filled so
// unwritten cache rows never reach a product). Long contexts are cut into splits whose partial
// max / sum / output go to the workspace and are merged by a reduce kernel (flash-decoding), so a
// decode batch of one still spreads over the GPU.
// Only CUDA headers here.
#include <cuda_bf16.h>

#include <atomic>
#include <cstdint>

#include "backend/cuda/attention/latent_attention_launch.h"
#include "backend/cuda/mma_sync.cuh"
#include "backend/cuda/attention/online_softmax.cuh"

namespace moe::cuda::kernels {

namespace {

constexpr int kThreads = 128;  // 4 warps
constexpr int kWarps = kThreads / 32;
constexpr int kSlots = 16;     // query slots per block: the m16 of the mma
constexpr int kKeys = 32;      // keys per shared-memory tile

// Split heuristics. A split covers at least one key tile; splits are added while tiles x splits
// stays within kTargetBlocks, one wave at two blocks per SM on 132 SMs (what shared memory allows
// at D = 576): a decode batch is bound by the cache bytes, and a second, partial wave would cost
// nearly as much as a full one (64 rows of V2-Lite at 2048 with 5 splits, 1.2 waves: 93 us on an
// H100, i.e. 1.6 TB/s of cache). kMaxSplits bounds the workspace.
constexpr int kMinChunk = kKeys;
constexpr int kTargetBlocks = 264;
constexpr int kMaxSplits = 64;

int choose_splits(int tokens, int heads, int max_context) {
  if (tokens <= 0 || max_context <= 0) return 1;
  const long long tiles = ((long long)tokens * heads + kSlots - 1) / kSlots;
  const long long by_len = (max_context + kMinChunk - 1) / kMinChunk;
  const long long by_fill = kTargetBlocks / tiles;
  long long s = by_len < by_fill ? by_len : by_fill;
  s = s < kMaxSplits ? s : kMaxSplits;
  return s < 1 ? 1 : static_cast<int>(s);
}

__device__ __forceinline__ float block_sum(float v, float* s_red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) s_red[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < (int)(blockDim.x / 32); ++w) total += s_red[w];
  return total;
}

// ---------------------------------------------------------------------------------------------
// prepare_latent: one block per token.
__global__ void __launch_bounds__(kThreads) prepare_latent_kernel(const LatentCacheParams p, int stride) {
  __shared__ float s_red[kWarps];
  const int t = blockIdx.x;
  const int slot = p.slots[t];
  if (slot < 0) return;
  const float* x = p.kv + (size_t)t * stride;
  const int row = p.lora + p.rope;
  uint16_t* dst = p.cache + (size_t)slot * row;
  float ss = 0.f;
  for (int i = threadIdx.x; i < p.lora; i += blockDim.x) ss += x[i] * x[i];
  ss = block_sum(ss, s_red);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(p.lora) + p.eps);
  for (int i = threadIdx.x; i < p.lora; i += blockDim.x)
    dst[i] = __bfloat16_as_ushort(__float2bfloat16(p.norm_weight[i] * (x[i] * inv)));
  const float pos = static_cast<float>(p.positions[t]);
  for (int i = threadIdx.x; i < p.rope / 2; i += blockDim.x) {
    float s, c;
    sincosf(pos * p.inv_freq[i], &s, &c);
    s *= p.rope_scale;
    c *= p.rope_scale;
    const float a = x[p.lora + 2 * i], b = x[p.lora + 2 * i + 1];
    *reinterpret_cast<uint32_t*>(dst + p.lora + 2 * i) = pack_bf16(a * c - b * s, b * c + a * s);
  }
}

// prepare_mla_q: one block per token, a thread per pair of features.
__global__ void __launch_bounds__(256) prepare_mla_q_kernel(const MlaQParams p) {
  __shared__ float s_cos[kLatentMaxRope / 2], s_sin[kLatentMaxRope / 2];
  const int t = blockIdx.x;
  const float pos = static_cast<float>(p.positions[t]);
  const int half = p.rope / 2;
  for (int i = threadIdx.x; i < half; i += blockDim.x) {
    float s, c;
    sincosf(pos * p.inv_freq[i], &s, &c);
    s_sin[i] = s * p.rope_scale;
    s_cos[i] = c * p.rope_scale;
  }
  __syncthreads();
  const int width = p.nope + p.rope, pairs = width / 2, full = p.lora + p.rope;
  for (int k = threadIdx.x; k < p.heads * pairs; k += blockDim.x) {
    const int h = k / pairs, i = k % pairs;
    const size_t th = (size_t)t * p.heads + h;
    const float2 v = *reinterpret_cast<const float2*>(p.q + th * width + 2 * i);
    if (2 * i < p.nope) {
      *reinterpret_cast<uint32_t*>(p.q_nope + th * p.nope + 2 * i) = pack_bf16(v.x, v.y);
    } else {
      const int r = i - p.nope / 2;
      const float c = s_cos[r], s = s_sin[r];
      *reinterpret_cast<uint32_t*>(p.q_full + th * full + p.lora + 2 * r) =
          pack_bf16(v.x * c - v.y * s, v.y * c + v.x * s);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Attention. KS: the most 64-wide dim groups of D (Q fragments per warp), VS: the most 64-wide
// groups of lora (value chunks per warp); ks <= KS and vs <= VS are the actual ones.
// grid: x = tile slot (counted from the back so the longest causal tiles start first), y = split.
template <int KS, int VS>
__global__ void __launch_bounds__(kThreads) latent_attention_kernel(const LatentAttentionParams p,
                                                                    int ks, int vs, int splits,
                                                                    int chunk, float* __restrict__ part_o,
                                                                    float* __restrict__ part_ml) {
  extern __shared__ __align__(16) uint8_t smem[];
  const int stride = ks * 64 + 8;  // bf16 per shared row
  uint16_t* const s_kv = reinterpret_cast<uint16_t*>(smem);  // two key tiles of kKeys rows
  const int tile_elems = kKeys * stride;
  float4* s_s = reinterpret_cast<float4*>(s_kv + 2 * tile_elems);  // [warp][n-tile][lane]

  // Find (sequence, tile): tiles of 16 slots are numbered sequence by sequence.
  int tile = gridDim.x - 1 - blockIdx.x;
  int seq = -1;
  for (int s = 0; s < p.num_seqs; ++s) {
    const int nt = ((p.seq_starts[s + 1] - p.seq_starts[s]) * p.heads + kSlots - 1) / kSlots;
    if (tile < nt) {
      seq = s;
      break;
    }
    tile -= nt;
  }
  if (seq < 0) return;
  const int split = blockIdx.y;
  const int n = p.seq_starts[seq + 1] - p.seq_starts[seq];
  const int pairs = n * p.heads;
  const int idx0 = tile * kSlots;
  const int first_pos = p.context_lens[seq] - n;  // position of the sequence's row 0
  const int last = min(idx0 + kSlots - 1, pairs - 1);
  const int kv_end = first_pos + last / p.heads + 1;  // keys the tile's last row sees
  const int begin = split * chunk;
  // The last split runs to the tile's end, so no key is lost even past max_context.
  const int end = split == splits - 1 ? kv_end : min(kv_end, begin + chunk);
  const size_t g0 = (size_t)p.seq_starts[seq] * p.heads + idx0;  // global slot of M row 0
  const int tid = threadIdx.x;
  if (splits > 1 && begin >= end) {  // empty split: the reduce skips it by its zero sum
    if (tid < kSlots && idx0 + tid < pairs) {
      part_ml[((g0 + tid) * splits + split) * 2] = -INFINITY;
      part_ml[((g0 + tid) * splits + split) * 2 + 1] = 0.f;
    }
    return;
  }

  const int D = p.lora + p.rope;
  const int dchunks = D / 8, pchunks = ks * 8;  // 16-byte chunks per row: real, padded
  const int warp = tid / 32, lane = tid % 32;
  const int gr = lane / 4, tq = lane % 4;
  const int block_shift = __ffs(p.block_size) - 1;
  const int32_t* table = p.block_tables + (size_t)seq * p.max_blocks_per_seq;

  // 4 threads per key row, each a strided quarter of its chunks.
  auto load_keys = [&](uint16_t* dst, int kt) {
    const int r = tid / 4;
    const int j = kt + r;
    const bool ok = j < end;
    const uint16_t* src = p.cache;
    if (ok) src = p.cache + ((size_t)table[j >> block_shift] * p.block_size + (j & (p.block_size - 1))) * D;
    for (int c = tid % 4; c < pchunks; c += 4)
      cp_async16(dst + r * stride + c * 8, ok && c < dchunks ? src + c * 8 : p.cache, ok && c < dchunks);
  };

  // Q of the 16 slots (contiguous in q) through buffer 1, key tile 0 into buffer 0.
  {
    const int r = tid / 8;
    const bool ok = idx0 + r < pairs;
    const uint16_t* src = p.q + (g0 + r) * D;
    for (int c = tid % 8; c < pchunks; c += 8)
      cp_async16(s_kv + tile_elems + r * stride + c * 8, ok && c < dchunks ? src + c * 8 : p.q, ok && c < dchunks);
  }
  if (begin < end) load_keys(s_kv, begin);
  cp_async_commit();
  cp_async_wait<0>();
  __syncthreads();
  uint32_t qf[KS][4];
#pragma unroll
  for (int i = 0; i < KS; ++i)
    if (i < ks) ldmatrix_x4(qf[i], s_kv + tile_elems + (lane % 16) * stride + (warp + 4 * i) * 16 + (lane / 16) * 8);
  __syncthreads();

  // This thread's two slots (M rows gr and gr + 8): the last key position each may see.
  int pos_a = -1, pos_b = -1;
  if (idx0 + gr < pairs) pos_a = first_pos + (idx0 + gr) / p.heads;
  if (idx0 + gr + 8 < pairs) pos_b = first_pos + (idx0 + gr + 8) / p.heads;
  float o[2 * VS][4];
#pragma unroll
  for (int i = 0; i < 2 * VS; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;
  const float scale = p.scale * kLog2e;  // scores in the log2 domain, exp2 below
  const int m8 = lane / 8;

  int buf = 0;
  for (int kt = begin; kt < end; kt += kKeys, buf ^= 1) {
    if (kt + kKeys < end) load_keys(s_kv + (buf ^ 1) * tile_elems, kt + kKeys);
    cp_async_commit();
    const uint16_t* s_k = s_kv + buf * tile_elems;

    float s[4][4];
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
#pragma unroll
    for (int i = 0; i < KS; ++i) {
      if (i < ks) {
        const int kk = warp + 4 * i;
#pragma unroll
        for (int nt = 0; nt < 4; nt += 2) {
          uint32_t b[4];
          ldmatrix_x4(b, s_k + ((nt + (m8 >> 1)) * 8 + lane % 8) * stride + kk * 16 + (m8 & 1) * 8);
          mma_bf16(s[nt], qf[i], b[0], b[1]);
          mma_bf16(s[nt + 1], qf[i], b[2], b[3]);
        }
      }
    }
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) s_s[(warp * 4 + nt) * 32 + lane] = make_float4(s[nt][0], s[nt][1], s[nt][2], s[nt][3]);
    __syncthreads();
    // Every warp sums the partials in the same order: identical S, max and sums in all warps.
#pragma unroll
    for (int nt = 0; nt < 4; ++nt) {
      float4 acc = s_s[nt * 32 + lane];
#pragma unroll
      for (int w = 1; w < kWarps; ++w) {
        const float4 v = s_s[(w * 4 + nt) * 32 + lane];
        acc.x += v.x;
        acc.y += v.y;
        acc.z += v.z;
        acc.w += v.w;
      }
      const int j = kt + nt * 8 + 2 * tq;
      s[nt][0] = j <= pos_a && j < end ? acc.x * scale : -INFINITY;
      s[nt][1] = j + 1 <= pos_a && j + 1 < end ? acc.y * scale : -INFINITY;
      s[nt][2] = j <= pos_b && j < end ? acc.z * scale : -INFINITY;
      s[nt][3] = j + 1 <= pos_b && j + 1 < end ? acc.w * scale : -INFINITY;
    }
    online_softmax_tile(s, o, m_a, m_b, l_a, l_b, AlreadyMasked{});
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      uint32_t a[4];
      accumulators_to_a_fragment(s[2 * kk], s[2 * kk + 1], a);
#pragma unroll
      for (int i = 0; i < VS; ++i) {
        if (i < vs) {
          const int c = warp + 4 * i;  // this warp's 16-wide value chunk
          uint32_t b[4];
          ldmatrix_x4_trans(b, s_k + (kk * 16 + (m8 & 1) * 8 + lane % 8) * stride + (2 * c + (m8 >> 1)) * 8);
          mma_bf16(o[2 * i], a, b[0], b[1]);
          mma_bf16(o[2 * i + 1], a, b[2], b[3]);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the next tile has landed; this tile's buffer and s_s are free
  }

  // Every thread of the quad gets its rows' whole l.
#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
  }
  const bool ok_a = idx0 + gr < pairs, ok_b = idx0 + gr + 8 < pairs;
  const size_t ga = g0 + gr, gb = ga + 8;
  if (splits == 1) {
    const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f, inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
#pragma unroll
    for (int i = 0; i < 2 * VS; ++i) {
      const int d = (warp + 4 * (i / 2)) * 16 + (i % 2) * 8 + 2 * tq;
      if (i / 2 < vs && d < p.lora) {
        if (ok_a) *reinterpret_cast<uint32_t*>(p.out + ga * p.lora + d) = pack_bf16(o[i][0] * inv_a, o[i][1] * inv_a);
        if (ok_b) *reinterpret_cast<uint32_t*>(p.out + gb * p.lora + d) = pack_bf16(o[i][2] * inv_b, o[i][3] * inv_b);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < 2 * VS; ++i) {
      const int d = (warp + 4 * (i / 2)) * 16 + (i % 2) * 8 + 2 * tq;
      if (i / 2 < vs && d < p.lora) {
        if (ok_a) *reinterpret_cast<float2*>(part_o + (ga * splits + split) * p.lora + d) = make_float2(o[i][0], o[i][1]);
        if (ok_b) *reinterpret_cast<float2*>(part_o + (gb * splits + split) * p.lora + d) = make_float2(o[i][2], o[i][3]);
      }
    }
    if (warp == 0 && tq == 0) {
      if (ok_a) {
        part_ml[(ga * splits + split) * 2] = m_a;
        part_ml[(ga * splits + split) * 2 + 1] = l_a;
      }
      if (ok_b) {
        part_ml[(gb * splits + split) * 2] = m_b;
        part_ml[(gb * splits + split) * 2 + 1] = l_b;
      }
    }
  }
}

// Merges the splits of one (row, head): weights exp2(m_i - max m) on sums and outputs. Warp 0
// turns the (max, sum) pairs into weights in shared memory first, so the loop over splits has no
// dependence between iterations and keeps many loads in flight (a serial loop of dependent
// loads cost ~25 us at 32-64 splits, more than the attention itself at batch 1).
constexpr int kReduceThreads = 256;
static_assert(kMaxSplits <= 64, "warp 0 holds two splits per lane");

__global__ void __launch_bounds__(kReduceThreads) latent_reduce_kernel(const LatentAttentionParams p, int splits,
                                                                       const float* __restrict__ part_o,
                                                                       const float* __restrict__ part_ml) {
  __shared__ float s_w[kMaxSplits];
  __shared__ float s_inv;
  const int g = blockIdx.x;  // row * heads + head
  if (g / p.heads >= p.seq_starts[p.num_seqs]) return;
  const float* ml = part_ml + (size_t)g * splits * 2;
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    float m[2], l[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int i = lane + 32 * k;
      m[k] = -INFINITY;
      l[k] = 0.f;
      if (i < splits && ml[2 * i + 1] > 0.f) {  // an empty split has sum 0 and m = -inf
        m[k] = ml[2 * i];
        l[k] = ml[2 * i + 1];
      }
    }
    float mx = fmaxf(m[0], m[1]);
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const float w = l[k] > 0.f ? exp2f(m[k] - mx) : 0.f;
      if (lane + 32 * k < splits) s_w[lane + 32 * k] = w;
      total += w * l[k];
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    if (lane == 0) s_inv = total > 0.f ? 1.f / total : 0.f;
  }
  __syncthreads();
  const float inv = s_inv;
  const float* po = part_o + (size_t)g * splits * p.lora;
  for (int d = 2 * threadIdx.x; d < p.lora; d += 2 * kReduceThreads) {
    float ox = 0.f, oy = 0.f;
#pragma unroll 8
    for (int i = 0; i < splits; ++i) {
      // Loaded unconditionally (the workspace holds every split's slot) and dropped by the
      // select where the split was empty: its slot was never written and may hold anything.
      const float2 v = *reinterpret_cast<const float2*>(po + (size_t)i * p.lora + d);
      const float w = s_w[i];
      ox += w > 0.f ? w * v.x : 0.f;
      oy += w > 0.f ? w * v.y : 0.f;
    }
    *reinterpret_cast<uint32_t*>(p.out + (size_t)g * p.lora + d) = pack_bf16(ox * inv, oy * inv);
  }
}

template <int KS, int VS>
cudaError_t launch_attention(const LatentAttentionParams& p, int ks, int vs, int splits, int chunk,
                             float* part_o, float* part_ml, cudaStream_t stream) {
  const int smem = 2 * kKeys * (ks * 64 + 8) * 2 + kWarps * 4 * 32 * 16;
  auto* kernel = latent_attention_kernel<KS, VS>;
  // The largest size of the instantiation, allowed once per device (not a stream operation, so
  // harmless inside a graph capture; once keeps the host cost of a launch down).
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return cudaGetLastError();
  const uint64_t bit = 1ull << (device & 63);
  if (!(configured.load(std::memory_order_relaxed) & bit)) {
    const int most = 2 * kKeys * (KS * 64 + 8) * 2 + kWarps * 4 * 32 * 16;
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, most);
    if (err != cudaSuccess) return err;
    configured.fetch_or(bit, std::memory_order_relaxed);
  }
  // Each sequence leaves at most one partly filled tile.
  const long long tiles = ((long long)p.tokens * p.heads + kSlots - 1) / kSlots + p.num_seqs;
  if (tiles > 0x7fffffff) return cudaErrorInvalidValue;
  kernel<<<dim3((unsigned)tiles, splits), kThreads, smem, stream>>>(p, ks, vs, splits, chunk, part_o, part_ml);
  return cudaSuccess;
}

bool valid_dims(int lora, int rope) {
  return lora >= 8 && lora <= kLatentMaxLora && lora % 8 == 0 && rope >= 8 && rope <= kLatentMaxRope &&
         rope % 8 == 0;
}

}  // namespace

cudaError_t prepare_latent(const LatentCacheParams& p, cudaStream_t stream) {
  const int stride = p.kv_stride == 0 ? p.lora + p.rope : p.kv_stride;
  if (p.tokens < 0 || !valid_dims(p.lora, p.rope) || stride < p.lora + p.rope) return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaSuccess;
  prepare_latent_kernel<<<p.tokens, kThreads, 0, stream>>>(p, stride);
  return cudaGetLastError();
}

cudaError_t prepare_mla_q(const MlaQParams& p, cudaStream_t stream) {
  if (p.tokens < 0 || p.heads <= 0 || !valid_dims(p.lora, p.rope) || p.nope < 2 ||
      p.nope > kLatentMaxNope || p.nope % 2 != 0)
    return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaSuccess;
  prepare_mla_q_kernel<<<p.tokens, 256, 0, stream>>>(p);
  return cudaGetLastError();
}

size_t latent_attention_workspace_bytes(int tokens, int heads, int lora, int max_context) {
  const int splits = choose_splits(tokens, heads, max_context);
  if (splits <= 1) return 0;
  return (size_t)tokens * heads * splits * (lora + 2) * sizeof(float);
}

cudaError_t latent_attention(const LatentAttentionParams& p, cudaStream_t stream) {
  const bool pow2_block = p.block_size > 0 && (p.block_size & (p.block_size - 1)) == 0;
  if (p.num_seqs <= 0 || p.tokens < 0 || p.heads <= 0 || !valid_dims(p.lora, p.rope) || !pow2_block ||
      p.block_size > kLatentMaxBlockSize || p.max_blocks_per_seq <= 0 || p.max_context < 0)
    return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaSuccess;
  const int splits = choose_splits(p.tokens, p.heads, p.max_context);
  int chunk = p.max_context > 0 ? (p.max_context + splits - 1) / splits : kMinChunk;
  chunk = (chunk + kMinChunk - 1) / kMinChunk * kMinChunk;  // whole key tiles per split
  const int splits_used = p.max_context > 0 ? (p.max_context + chunk - 1) / chunk : 1;  // <= splits
  float *part_o, *part_ml;
  const cudaError_t ws = split_partials(p.workspace, (size_t)p.tokens * p.heads, splits_used, p.lora,
                                        &part_o, &part_ml);
  if (ws != cudaSuccess) return ws;
  const int D = p.lora + p.rope;
  const int ks = (D + 63) / 64, vs = (p.lora + 63) / 64;
  cudaError_t err;
  if (ks <= 1) err = launch_attention<1, 1>(p, ks, vs, splits_used, chunk, part_o, part_ml, stream);
  else if (ks <= 2) err = launch_attention<2, 2>(p, ks, vs, splits_used, chunk, part_o, part_ml, stream);
  else if (ks <= 5 && vs <= 4) err = launch_attention<5, 4>(p, ks, vs, splits_used, chunk, part_o, part_ml, stream);
  else err = launch_attention<9, 8>(p, ks, vs, splits_used, chunk, part_o, part_ml, stream);
  if (err != cudaSuccess) return err;
  if (splits_used > 1)
    latent_reduce_kernel<<<p.tokens * p.heads, kReduceThreads, 0, stream>>>(p, splits_used, part_o, part_ml);
  return cudaGetLastError();
}

}  // namespace moe::cuda::kernels
