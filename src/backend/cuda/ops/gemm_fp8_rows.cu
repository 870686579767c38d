#include "backend/cuda/ops/gemm_fp8_rows_launch.h"

#include <cuda_bf16.h>

#include <cstdint>
#include <cstring>

#include "backend/cuda/mma_sync.cuh"
#include "backend/cuda/pdl.h"

namespace moe::cuda::kernels {
namespace fp8_rows {

// Why tensor cores at 9-64 rows: the GEMV spends 8 FMAs per weight value at 8 rows and reloads x
// through L1 for each weight row group, so it stops being bound by the weight bytes there
// (docs/perf/decode-graph-buckets.md); cuBLASLt's block-scaled GEMM costs about 20 µs a call at
// these sizes whatever the bytes.
//
// Layout: the product is taken transposed, yᵀ = W xᵀ, so that the weights are mma.sync's A
// operand (16 weight rows a tile) and the few rows of x its B operand (8 rows a tile): 9-16 rows
// of x cost two B tiles, not a 16-row tile padded from 9. Since a sum over k does not depend on
// the order of k, the fragments take k in an order that lets every lane read 16 contiguous bytes
// of a weight row (16 codes) and 32 of an x row (16 values): lane (g, t) of a 64-column chunk
// reads columns 16 t .. 16 t + 15, and mma step s (0-3) of the chunk takes its columns
// 16 t + 4 s .. 16 t + 4 s + 3 into the fragment slots 2t, 2t+1, 2t+8, 2t+9 of both operands.

constexpr int kWarps = 8;
constexpr int kBlock = 128;  // the weights' scale blocks, rows and columns

// Four E4M3 codes (the bytes of q, lowest first) as two bf16 pairs, exactly: `lo` holds codes 0
// and 1, `hi` codes 2 and 3, the lower code in the lower half. Each code's sign, 4 exponent and 3
// mantissa bits are placed as a bf16's sign, low exponent bits and top mantissa bits, which is the
// code's value times 2^-120 for normal and subnormal codes alike (bf16 has E4M3's subnormals as
// its own); the product with 2^120 is then exact. The NaN codes (0x7f, 0xff) read as ±480;
// checkpoints hold none.
__device__ __forceinline__ uint32_t widen_spread(uint32_t spread) {
  // spread: a code in the top byte of each 16-bit half (s eeee mmm, then eight zero bits).
  const uint32_t bits = ((spread >> 4) & 0x07ff07ffu) | (spread & 0x80008000u);
  __nv_bfloat162 v;
  std::memcpy(&v, &bits, 4);
  const __nv_bfloat16 two_120 = __ushort_as_bfloat16(0x7b80);  // exponent 247 = 127 + 120
  v = __hmul2(v, __nv_bfloat162(two_120, two_120));
  uint32_t out;
  std::memcpy(&out, &v, 4);
  return out;
}

__device__ __forceinline__ void widen_e4m3x4(uint32_t q, uint32_t& lo, uint32_t& hi) {
  lo = widen_spread(__byte_perm(q, 0, 0x1404));  // bytes: 0, code 0, 0, code 1
  hi = widen_spread(__byte_perm(q, 0, 0x3424));  // bytes: 0, code 2, 0, code 3
}

__device__ __forceinline__ uint32_t word(const uint4& v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// A block of kWarps warps: kWarps / KS groups of KS warps; a group owns 16 R weight rows (R tiles;
// 16 R divides 128, so a warp's rows share one row of scale blocks) and its KS warps take the
// column blocks of 128 in turn, adding their sums in a fixed order at the end (deterministic).
// MT tiles of 8 rows of x. Each warp keeps the next column block's weights and x values in flight
// while it multiplies the current one's (with x loaded per block instead, each block waited on its
// L2 hits: 5-32% slower, docs/perf/fp8-dense-rows.md), and loads the first block's weights before
// waiting for its predecessor (weights are constant over the forward: pdl.h).
template <int MT, int R, int KS>
__global__ void __launch_bounds__(kWarps * 32) rows_kernel(const uint4* __restrict__ x, const uint8_t* __restrict__ w,
                                                           const float* __restrict__ scales, void* y, bool y_f32,
                                                           int m, int n, int k, int ldy) {
  constexpr int kGroups = kWarps / KS;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int group = warp / KS, part = warp % KS;
  const int n0 = (blockIdx.x * kGroups + group) * 16 * R;
  const bool active = n0 < n;
  const int kblocks = (k + kBlock - 1) / kBlock;

  const uint8_t* wrow[R][2];
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) wrow[r][h] = w + static_cast<size_t>(min(n0 + 16 * r + 8 * h + g, n - 1)) * k;
  const float* srow = scales + static_cast<size_t>(min(n0, n - 1) / kBlock) * kblocks;

  // The weights of column block kb: two 64-column chunks, rows g and g + 8 of each tile.
  auto load_w = [&](uint4 (&wv)[2][R][2], int kb) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = kb * kBlock + 64 * c + 16 * t;
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          wv[c][r][h] = col < k ? __ldg(reinterpret_cast<const uint4*>(wrow[r][h] + col)) : make_uint4(0, 0, 0, 0);
    }
  };

  // The x values column block kb meets: two 64-column chunks, row g of each x tile.
  auto load_x = [&](uint4 (&xv)[2][MT][2], int kb) {
#pragma unroll
    for (int c = 0; c < 2; ++c) {
      const int col = kb * kBlock + 64 * c + 16 * t;
#pragma unroll
      for (int j = 0; j < MT; ++j) {
        const int row = 8 * j + g;
        const bool ok = col < k && row < m;
        const uint4* at = x + (static_cast<size_t>(row) * k + col) / 8;
        xv[c][j][0] = ok ? __ldg(at) : make_uint4(0, 0, 0, 0);
        xv[c][j][1] = ok ? __ldg(at + 1) : make_uint4(0, 0, 0, 0);
      }
    }
  };

  float acc[R][MT][4] = {};
  uint4 wnext[2][R][2];
  uint4 xnext[2][MT][2];
  if (active && part < kblocks) load_w(wnext, part);
  begin_dependent();
  if (active) {
    if (part < kblocks) load_x(xnext, part);
    for (int kb = part; kb < kblocks; kb += KS) {
      uint4 wv[2][R][2];
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int r = 0; r < R; ++r)
#pragma unroll
          for (int h = 0; h < 2; ++h) wv[c][r][h] = wnext[c][r][h];
      uint4 xv[2][MT][2];
#pragma unroll
      for (int c = 0; c < 2; ++c)
#pragma unroll
        for (int j = 0; j < MT; ++j) {
          xv[c][j][0] = xnext[c][j][0];
          xv[c][j][1] = xnext[c][j][1];
        }
      if (kb + KS < kblocks) {
        load_w(wnext, kb + KS);
        load_x(xnext, kb + KS);
      }
      const float scale = __ldg(srow + kb);
      float sums[R][MT][4] = {};
#pragma unroll
      for (int c = 0; c < 2; ++c) {
#pragma unroll
        for (int s = 0; s < 4; ++s) {
          uint32_t a[R][4];
#pragma unroll
          for (int r = 0; r < R; ++r) {
            widen_e4m3x4(word(wv[c][r][0], s), a[r][0], a[r][2]);
            widen_e4m3x4(word(wv[c][r][1], s), a[r][1], a[r][3]);
          }
#pragma unroll
          for (int j = 0; j < MT; ++j) {
            const uint32_t b0 = word(xv[c][j][s / 2], (2 * s) % 4), b1 = word(xv[c][j][s / 2], (2 * s) % 4 + 1);
#pragma unroll
            for (int r = 0; r < R; ++r) mma_bf16(sums[r][j], a[r], b0, b1);
          }
        }
      }
#pragma unroll
      for (int r = 0; r < R; ++r)
#pragma unroll
        for (int j = 0; j < MT; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[r][j][i] = fmaf(sums[r][j][i], scale, acc[r][j][i]);
    }
  }

  if constexpr (KS > 1) {
    constexpr int kSums = R * MT * 4;
    float* sums = &acc[0][0][0];
    __shared__ float partial[kWarps][kSums][32];
#pragma unroll
    for (int i = 0; i < kSums; ++i) partial[warp][i][lane] = sums[i];
    __syncthreads();
    if (part != 0) return;
#pragma unroll
    for (int i = 0; i < kSums; ++i) {
      float sum = 0.0f;
#pragma unroll
      for (int p = 0; p < KS; ++p) sum += partial[warp + p][i][lane];
      sums[i] = sum;
    }
  }
  if (!active) return;
  // Accumulator i of tile (r, j): weight row 16 r + g (+ 8 for i >= 2), x row 8 j + 2 t (+ 1 for
  // odd i).
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int j = 0; j < MT; ++j)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int col = n0 + 16 * r + g + 8 * (i / 2), row = 8 * j + 2 * t + i % 2;
        if (col >= n || row >= m) continue;
        const size_t at = static_cast<size_t>(row) * ldy + col;
        if (y_f32)
          static_cast<float*>(y)[at] = acc[r][j][i];
        else
          static_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(acc[r][j][i]);
      }
}

int blocks_for(int n, int r, int ks) {
  const int rows_per_block = kWarps / ks * 16 * r;
  return (n + rows_per_block - 1) / rows_per_block;
}

template <int MT, int R, int KS>
cudaError_t launch(const void* x, const void* w, const float* scales, void* y, bool y_f32, int m, int n, int k,
                   int ldy, cudaStream_t stream) {
  launch_dependent(rows_kernel<MT, R, KS>, dim3(blocks_for(n, R, KS)), dim3(kWarps * 32), 0, stream,
                   static_cast<const uint4*>(x), static_cast<const uint8_t*>(w), scales, y, y_f32, m, n, k, ldy);
  return cudaGetLastError();
}

template <int MT, int R>
cudaError_t launch_split(int ks, const void* x, const void* w, const float* scales, void* y, bool y_f32, int m,
                         int n, int k, int ldy, cudaStream_t stream) {
  switch (ks) {
    case 2: return launch<MT, R, 2>(x, w, scales, y, y_f32, m, n, k, ldy, stream);
    case 4: return launch<MT, R, 4>(x, w, scales, y, y_f32, m, n, k, ldy, stream);
    default: return launch<MT, R, 8>(x, w, scales, y, y_f32, m, n, k, ldy, stream);
  }
}

struct Split {
  int r, ks;  // tiles of 16 weight rows a warp; warps a group splitting k
};

// Measured on an H100 over qwen3-30b-a3b's and DeepSeek-V3's projection shapes (lab/cuda/
// fp8_rows_sweep.cu, docs/perf/fp8-dense-rows.md): a 4-way k split where that gives each of the
// 132 multiprocessors a block at one weight tile a warp, with two weight tiles a warp past one x
// tile; for fewer weight rows (qwen3's o projection, 2048) one tile a warp and an 8-way split.
Split choose_split(int mt, int n) {
  if (blocks_for(n, 1, 4) < 132) return {1, 8};
  return mt == 1 ? Split{1, 4} : Split{2, 4};
}

template <int MT>
cudaError_t launch_tiles(Split s, const void* x, const void* w, const float* scales, void* y, bool y_f32, int m,
                         int n, int k, int ldy, cudaStream_t stream) {
  return s.r == 2 ? launch_split<MT, 2>(s.ks, x, w, scales, y, y_f32, m, n, k, ldy, stream)
                  : launch_split<MT, 1>(s.ks, x, w, scales, y, y_f32, m, n, k, ldy, stream);
}

}  // namespace fp8_rows

cudaError_t gemm_fp8_rows(const void* x, const void* w, const float* scales, void* y, bool y_f32, int rows, int n,
                          int k, int ldy, cudaStream_t stream) {
  const bool aligned = (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) % 16 == 0;
  if (rows < 1 || rows > kFp8RowsMaxRows || n < 1 || k < 16 || k % 16 != 0 || ldy < n || !aligned ||
      scales == nullptr)
    return cudaErrorInvalidValue;
  using namespace fp8_rows;
  const int mt = (rows + 7) / 8;
  const Split s = choose_split(mt, n);
  switch (mt) {
    case 1: return launch_tiles<1>(s, x, w, scales, y, y_f32, rows, n, k, ldy, stream);
    case 2: return launch_tiles<2>(s, x, w, scales, y, y_f32, rows, n, k, ldy, stream);
    case 3: return launch_tiles<3>(s, x, w, scales, y, y_f32, rows, n, k, ldy, stream);
    default: return launch_tiles<4>(s, x, w, scales, y, y_f32, rows, n, k, ldy, stream);
  }
}

}  // namespace moe::cuda::kernels
