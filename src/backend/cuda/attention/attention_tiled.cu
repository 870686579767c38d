// The tiled kernel of paged attention (AttentionPath::kTiled, for prefill): one block per (64 rows
// of one sequence, one query head), key tiles of 64 with an online softmax (online_softmax.cuh) on
// mma.sync m16n8k16 bf16 tensor cores (FlashAttention-2 layout).
// Only CUDA headers here.
#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/attention/attention_device.cuh"
#include "backend/cuda/attention/attention_paths.h"
#include "backend/cuda/mma_sync.cuh"
#include "backend/cuda/attention/online_softmax.cuh"

namespace moe::cuda::kernels::attention_detail {

namespace {

// Tiled kernel (tensor cores). Warp w owns query rows 16w..16w+15 of the tile; its Q fragments
// stay in registers, K and V tiles of 64 keys pass through shared memory (rows padded by 16 bytes
// so ldmatrix hits distinct banks). S = Q K^T and O += P V on m16n8k16, P rounded to bf16 for the
// second product (its f32 row sums are kept for the normalisation).
constexpr int kTileQ = 64;
constexpr int kTileK = 64;

// grid: x = query head, y = tile slot (counted from the back, so the longest causal tiles start
// first, every head's before any shorter one). Three blocks a multiprocessor: left to itself ptxas
// took 169 registers at D = 128, which fits two (8 warps); capped at 168 it spills (64 bytes when
// measured, 56 now), and a 2048-token prefill's attention fell 16.8 -> 14.7 ms
// (qwen3-30b-a3b, H100; the prefill +4-5% in bf16 and FP8, bench/gpu_fp8_h100.md). On compute
// capability 9.0 at D = 128 the wgmma kernel (attention_wgmma.cu) takes prefill instead.
template <int D>
__global__ void __launch_bounds__(kThreads, 3) tiled_attention_kernel(const PagedAttentionParams p) {
  constexpr int kStride = D + 8;  // bf16 elements per shared row
  constexpr int kChunks = D / 8;  // 16-byte chunks per row
  __shared__ __align__(16) uint16_t s_k[kTileK * kStride];
  __shared__ __align__(16) uint16_t s_v[kTileK * kStride];

  const RowTile rt = find_row_tile(p, kTileQ, blockIdx.y, gridDim.y);
  if (rt.seq < 0) return;
  const int seq = rt.seq, row0 = rt.row0, rows = rt.rows, pos0 = rt.pos0;
  const int head = blockIdx.x;
  const int kvh = head / (p.q_heads / p.kv_heads);
  const int kv_end = pos0 + rows;  // keys this tile can see
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
      online_softmax_tile(s, o, m_a, m_b, l_a, l_b, causal);
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

  store_row_pair<D>(p, o, l_a, l_b, row0, warp * 16 + gr, rows, head);
}

}  // namespace

cudaError_t run_tiled(const PagedAttentionParams& p, cudaStream_t stream) {
  // Each sequence leaves at most one partly filled tile.
  const dim3 grid(p.q_heads, (p.tokens + kTileQ - 1) / kTileQ + p.num_seqs);
  switch (p.head_dim) {
    case 32: tiled_attention_kernel<32><<<grid, kThreads, 0, stream>>>(p); break;
    case 64: tiled_attention_kernel<64><<<grid, kThreads, 0, stream>>>(p); break;
    case 128: tiled_attention_kernel<128><<<grid, kThreads, 0, stream>>>(p); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace moe::cuda::kernels::attention_detail
