#include "backend/cuda/ops/gemv_launch.h"
#include "backend/cuda/bf16x8.cuh"
#include "backend/cuda/pdl.h"
#include "backend/cuda/stream_load.cuh"
#include "backend/cuda/weight_rows.cuh"

#include <cuda_bf16.h>

namespace moe::cuda::kernels {
namespace {

constexpr int kUnroll = 4;  // 16-byte loads per row a lane issues before using any
// Two shapes of block: 8 warps of 2 rows (k split among them when rows are few), and, for long
// matrices that need no split (the qkv projection, lm_head), 4 warps of 4 rows with streaming
// loads, which keeps more loads in flight per lane (lab/cuda/gemv_sweep.cu: qkv at M = 1 10.2 ->
// 9.0 µs, at M = 8 15.5 -> 13.2 µs; a 32768 x 2048 matrix at M = 8 65.8 -> 59.3 µs). Unsplit,
// both take 16 rows per block.
constexpr int kRowsUnsplit = 16;

// A block of kWarps warps; a group of KS warps owns kRowsPerGroup weight rows and splits k among
// its warps (KS > 1 when there are too few rows to give every
// multiprocessor work). kStream: weights read with streaming loads instead of __ldg. A lane reads 8 consecutive k at a
// time, kUnroll steps ahead, so each lane keeps kRowsPerGroup * kUnroll 16-byte loads in flight.
// x (a few rows, shared by every warp) is read through L1.
// Batch b (blockIdx.y) reads x + b * x_stride (rows ldx8 * 8 apart), w + b * w_stride and writes
// y + b * y_stride: the per-head projections of latent attention.
struct Batch {
  int ldx8;  // 16-byte units between rows of x
  long long x_stride8, w_stride8, y_stride;
};

// W (weight_rows.cuh): bf16 rows, or FP8 ones with their block scales (`scales`, scale_cols a
// row of blocks; not batched). A chunk is 16 bytes of a weight row: W::kValues values of k.
template <int M, int KS, int kWarps, int kRowsPerGroup, bool kStream, typename W>
__global__ void __launch_bounds__(kWarps * 32) gemv_kernel(const uint4* __restrict__ x,
                                                          const uint4* __restrict__ w,
                                                          const float* __restrict__ scales, int scale_cols,
                                                          void* y, bool y_f32, int n, int k8, int ldy, Batch bt) {
  constexpr int kXChunks = W::kValues / 8;  // 16-byte chunks of x a weight chunk meets
  begin_dependent();  // first: see pdl.h
  constexpr int kGroups = kWarps / KS;
  x += blockIdx.y * bt.x_stride8;
  w += blockIdx.y * bt.w_stride8;
  const size_t y_base = blockIdx.y * static_cast<size_t>(bt.y_stride);
  __shared__ float partial[KS > 1 ? kWarps : 1][kRowsPerGroup][M];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int group = warp / KS, part = warp % KS;
  const int row0 = (blockIdx.x * kGroups + group) * kRowsPerGroup;
  float acc[kRowsPerGroup][M] = {};
  if (row0 < n) {
    const uint4* wr[kRowsPerGroup];
#pragma unroll
    for (int r = 0; r < kRowsPerGroup; ++r) wr[r] = w + static_cast<size_t>(min(row0 + r, n - 1)) * k8;
    const int stride = 32 * KS;
    for (int base = part * 32 + lane; base < k8; base += stride * kUnroll) {
      uint4 wv[kRowsPerGroup][kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = base + u * stride;
#pragma unroll
        for (int r = 0; r < kRowsPerGroup; ++r)
          wv[r][u] = c >= k8 ? make_uint4(0, 0, 0, 0) : kStream ? load_stream(wr[r] + c) : __ldg(wr[r] + c);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = base + u * stride;
        if (c >= k8) break;
        float wf[kRowsPerGroup][W::kValues];
#pragma unroll
        for (int r = 0; r < kRowsPerGroup; ++r) {
          float scale = 1.0f;
          if constexpr (W::kScaled)
            scale = W::scale(scales + static_cast<size_t>(min(row0 + r, n - 1) / W::kBlock) * scale_cols, c);
          W::unpack(wv[r][u], scale, wf[r]);
        }
#pragma unroll
        for (int m = 0; m < M; ++m) {
#pragma unroll
          for (int xc = 0; xc < kXChunks; ++xc) {
            float xf[8];
            unpack_bf16x8(__ldg(x + static_cast<size_t>(m) * bt.ldx8 + c * kXChunks + xc), xf);
#pragma unroll
            for (int r = 0; r < kRowsPerGroup; ++r)
#pragma unroll
              for (int i = 0; i < 8; ++i) acc[r][m] = fmaf(wf[r][xc * 8 + i], xf[i], acc[r][m]);
          }
        }
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerGroup; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int off = 16; off > 0; off /= 2) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], off);
  if (KS > 1) {
    // The k-split warps of a group add their partial sums in a fixed order: deterministic.
    if (lane == 0)
#pragma unroll
      for (int r = 0; r < kRowsPerGroup; ++r)
#pragma unroll
        for (int m = 0; m < M; ++m) partial[warp][r][m] = acc[r][m];
    __syncthreads();
    if (part != 0 || lane != 0) return;
#pragma unroll
    for (int r = 0; r < kRowsPerGroup; ++r)
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float s = 0.0f;
#pragma unroll
        for (int p = 0; p < KS; ++p) s += partial[warp + p][r][m];
        acc[r][m] = s;
      }
  } else if (lane != 0) {
    return;
  }
  if (row0 >= n) return;
#pragma unroll
  for (int r = 0; r < kRowsPerGroup; ++r) {
    if (row0 + r >= n) break;
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const size_t at = y_base + static_cast<size_t>(m) * ldy + row0 + r;
      if (y_f32)
        static_cast<float*>(y)[at] = acc[r][m];
      else
        static_cast<__nv_bfloat16*>(y)[at] = __float2bfloat16_rn(acc[r][m]);
    }
  }
}

// The weights: bf16 (scales null) or FP8 blocks.
struct Weights {
  const void* data;
  const float* scales;
};

template <typename W, int M, int KS, int kWarps = 8, int kRowsPerGroup = 2, bool kStream = false>
cudaError_t launch_split(const void* x, Weights w, void* y, bool y_f32, int n, int k, int ldy,
                         int batch, const Batch& bt, cudaStream_t stream) {
  const int rows_per_block = (kWarps / KS) * kRowsPerGroup;
  const dim3 grid((n + rows_per_block - 1) / rows_per_block, batch);
  launch_dependent(gemv_kernel<M, KS, kWarps, kRowsPerGroup, kStream, W>, grid, kWarps * 32, 0, stream,
      static_cast<const uint4*>(x), static_cast<const uint4*>(w.data), w.scales, (k + 127) / 128, y, y_f32, n,
      k / W::kValues, ldy, bt);
  return cudaGetLastError();
}

// Splits k among more warps when the rows alone would leave multiprocessors idle (the router:
// 128 rows; the shared-expert gate: 1 row). 264 blocks: two per multiprocessor of an H100.
// The thresholds count 16-byte chunks of a row (k / W::kValues) as they were measured for bf16.
template <typename W, int M>
cudaError_t launch(const void* x, Weights w, void* y, bool y_f32, int n, int k, int ldy,
                   int batch, const Batch& bt, cudaStream_t stream) {
  const int blocks_unsplit = batch * ((n + kRowsUnsplit - 1) / kRowsUnsplit);
  const int k8 = k / W::kValues * 8;  // k of a bf16 row of as many chunks
  if (blocks_unsplit >= 264 && k8 >= 8 * 32 * 2)
    return launch_split<W, M, 1, 4, 4, true>(x, w, y, y_f32, n, k, ldy, batch, bt, stream);
  if (blocks_unsplit >= 264 || k8 < 8 * 32 * 2)
    return launch_split<W, M, 1>(x, w, y, y_f32, n, k, ldy, batch, bt, stream);
  if (blocks_unsplit >= 66 || k8 < 8 * 32 * 8)
    return launch_split<W, M, 4>(x, w, y, y_f32, n, k, ldy, batch, bt, stream);
  return launch_split<W, M, 8>(x, w, y, y_f32, n, k, ldy, batch, bt, stream);
}

template <typename W>
cudaError_t launch_rows(int rows, const void* x, Weights w, void* y, bool y_f32, int n, int k, int ldy, int batch,
                        const Batch& bt, cudaStream_t stream) {
  switch (rows) {
    case 1: return launch<W, 1>(x, w, y, y_f32, n, k, ldy, batch, bt, stream);
    case 2: return launch<W, 2>(x, w, y, y_f32, n, k, ldy, batch, bt, stream);
    case 3: return launch<W, 3>(x, w, y, y_f32, n, k, ldy, batch, bt, stream);
    case 4: return launch<W, 4>(x, w, y, y_f32, n, k, ldy, batch, bt, stream);
    case 5: return launch<W, 5>(x, w, y, y_f32, n, k, ldy, batch, bt, stream);
    case 6: return launch<W, 6>(x, w, y, y_f32, n, k, ldy, batch, bt, stream);
    case 7: return launch<W, 7>(x, w, y, y_f32, n, k, ldy, batch, bt, stream);
    default: return launch<W, 8>(x, w, y, y_f32, n, k, ldy, batch, bt, stream);
  }
}

}  // namespace

cudaError_t gemv_bf16_batched(const void* x, int ldx, long long x_stride, const void* w,
                              long long w_stride, void* y, bool y_f32, int ldy, long long y_stride,
                              int rows, int n, int k, int batch, cudaStream_t stream) {
  const bool aligned = (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) % 16 == 0;
  if (rows < 1 || rows > kGemvMaxRows || n < 1 || k < 8 || k % 8 != 0 || ldy < n || !aligned ||
      batch < 1 || batch > 65535 || ldx < k || ldx % 8 != 0 || x_stride % 8 != 0 || w_stride % 8 != 0)
    return cudaErrorInvalidValue;
  const Batch bt{ldx / 8, x_stride / 8, w_stride / 8, y_stride};
  return launch_rows<Bf16Rows>(rows, x, Weights{w, nullptr}, y, y_f32, n, k, ldy, batch, bt, stream);
}

cudaError_t gemv_fp8(const void* x, const void* w, const float* scales, void* y, bool y_f32, int rows, int n,
                     int k, int ldy, cudaStream_t stream) {
  const bool aligned = (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) % 16 == 0;
  if (rows < 1 || rows > kGemvMaxRows || n < 1 || k < 16 || k % 16 != 0 || ldy < n || !aligned || scales == nullptr)
    return cudaErrorInvalidValue;
  const Batch bt{k / 8, 0, 0, 0};
  return launch_rows<Fp8Rows>(rows, x, Weights{w, scales}, y, y_f32, n, k, ldy, 1, bt, stream);
}

cudaError_t gemv_bf16(const void* x, const void* w, void* y, bool y_f32, int rows, int n, int k,
                      int ldy, cudaStream_t stream) {
  return gemv_bf16_batched(x, k, 0, w, 0, y, y_f32, ldy, 0, rows, n, k, 1, stream);
}

}  // namespace moe::cuda::kernels
