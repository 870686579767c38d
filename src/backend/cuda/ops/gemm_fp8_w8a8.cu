// W8A8 dense projections of up to kW8a8RowsMax rows on wgmma (gemm_fp8_w8a8_launch.h says why).
//
// A block takes one tile of 64 rows of x by 128 weight rows (one block row of weight scales) over
// a contiguous range of the 128-column k blocks: one consumer warpgroup and one producer warp. The
// producer's lane 0 loads each k block's x box (64 x 128 codes) and weight box (128 x 128) by TMA
// into a ring of four 24 KB stages, the weights of the first stages before waiting for the
// predecessor (they are constant over the forward, pdl.h). The consumers take each stage as four
// wgmma m64n128k32 E4M3 products into f32 registers and scale them into their sums by the row's
// and the weight block's scales, as the routed experts' W8A8 GEMM does (moe_wgmma_gemm.cu).
//
// Few rows make few tiles (qwen3's o projection: 16 at 64 rows), so k is split over blocks until
// the tiles x the split reach the multiprocessors. The pieces of a tile are one cluster: each
// leaves its f32 sums in its own shared memory, and after a cluster barrier each adds a slice of
// the tile's rows over all the pieces, in split order, through distributed shared memory, and
// stores it; the result does not depend on which block finishes first. (The first form wrote the
// pieces to global memory and let the last block of a tile add them behind a counter: its chain of
// L2 round trips made qwen3's qkv projection at 64 rows take 39 µs, cuBLASLt's 10.)
#include "backend/cuda/ops/gemm_fp8_w8a8_launch.h"

#include <cuda.h>
#include <cuda_bf16.h>

#include "backend/cuda/pdl.h"
#include "backend/cuda/sm90_async.cuh"
#include "backend/cuda/tensor_map.h"

namespace moe::cuda::kernels {
namespace {

using namespace sm90;

constexpr int kTileM = 64, kTileN = 128, kStages = 4;
constexpr int kABytes = kTileM * 128, kBBytes = kTileN * 128, kStageBytes = kABytes + kBBytes;
constexpr int kConsumerWarps = 4, kThreads = (kConsumerWarps + 1) * 32;
constexpr int kSmem = kStages * kStageBytes + 1024;  // the ring, and room to align it to 1024 bytes
constexpr int kMaxSplits = 8;  // the pieces of a tile are one cluster: at most 8 blocks (portable)

__global__ void __launch_bounds__(kThreads) w8a8_rows_kernel(const __grid_constant__ CUtensorMap xmap,
                                                             const __grid_constant__ CUtensorMap wmap,
                                                             const float* __restrict__ x_scales, int x_scale_stride,
                                                             const float* __restrict__ w_scales, void* y, int y_f32,
                                                             int m, int n, int kt_total, int ldy, int splits) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  extern __shared__ uint8_t raw[];
  __shared__ uint64_t bars[2 * kStages];
  const uint32_t ring = (smem_u32(raw) + 1023u) & ~1023u;  // the 128-byte swizzle's atoms: 1024-aligned
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = blockIdx.x * kTileN, m0 = blockIdx.y * kTileM, split = blockIdx.z;
  const int kt0 = split * kt_total / splits, kt1 = (split + 1) * kt_total / splits, steps = kt1 - kt0;
  auto full = [&](int s) { return smem_u32(&bars[s]); };
  auto empty = [&](int s) { return smem_u32(&bars[kStages + s]); };
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(full(s), 1);                // the producer's expect_tx
      mbar_init(empty(s), kConsumerWarps);  // each consumer warp
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (warp == kConsumerWarps) {  // the producer
    if (lane == 0) {
      const int first = steps < kStages ? steps : kStages;
      for (int i = 0; i < first; ++i) {
        mbar_arrive_expect_tx(full(i), kStageBytes);
        tma_load_2d(ring + i * kStageBytes + kABytes, &wmap, (kt0 + i) * 128, n0, full(i));
      }
      wait_for_predecessor();  // x is the predecessor's output
      allow_dependents();
      for (int i = 0; i < first; ++i) tma_load_2d(ring + i * kStageBytes, &xmap, (kt0 + i) * 128, m0, full(i));
      for (int i = first; i < steps; ++i) {
        const int s = i % kStages;
        mbar_wait(empty(s), (i / kStages - 1) & 1);
        mbar_arrive_expect_tx(full(s), kStageBytes);
        tma_load_2d(ring + s * kStageBytes + kABytes, &wmap, (kt0 + i) * 128, n0, full(s));
        tma_load_2d(ring + s * kStageBytes, &xmap, (kt0 + i) * 128, m0, full(s));
      }
    }
    if (splits == 1) return;
    cluster_sync();  // the pieces' sums are in place
    cluster_sync();  // and read: every block of the cluster still holds its shared memory till here
    return;
  }

  // The consumers. Fragment (m64n128, f32): register 4j + 2h + c holds row 16 warp + lane / 4 + 8h,
  // column 8j + 2 (lane % 4) + c.
  wait_for_predecessor();  // x's scales
  allow_dependents();
  const int row[2] = {m0 + 16 * warp + lane / 4, m0 + 16 * warp + lane / 4 + 8};
  const float* ws = w_scales + static_cast<size_t>(n0 / 128) * kt_total;
  float acc[64] = {}, prod[64];
  for (int i = 0; i < steps; ++i) {
    const int s = i % kStages, kt = kt0 + i;
    // Rows past m read zero codes (the box past the map's rows) and take scale 0, so that no
    // scale of another tensor meets them.
    const float wsk = __ldg(ws + kt);
    float sc[2];
#pragma unroll
    for (int h = 0; h < 2; ++h)
      sc[h] = row[h] < m ? __ldg(x_scales + static_cast<size_t>(kt) * x_scale_stride + row[h]) * wsk : 0.0f;
    mbar_wait(full(s), (i / kStages) & 1);
    const uint32_t sa = ring + s * kStageBytes, sb = sa + kABytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 4; ++kk)
      wgmma_m64n128_e4m3(prod, sw128_desc(sa + kk * 32), sw128_desc(sb + kk * 32), kk);
    wgmma_commit();
    wgmma_wait<0>();
    fence_regs(prod);
    __syncwarp();
    if (lane == 0) mbar_arrive(empty(s));
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        acc[4 * j + 2 * h] += prod[4 * j + 2 * h] * sc[h];
        acc[4 * j + 2 * h + 1] += prod[4 * j + 2 * h + 1] * sc[h];
      }
  }

  const int col0 = n0 + 2 * (lane % 4);
  const bool pairs = ldy % 2 == 0 && reinterpret_cast<uintptr_t>(y) % (y_f32 ? 8 : 4) == 0;
  auto store = [&](int r, int c, float v0, float v1) {
    const size_t at = static_cast<size_t>(r) * ldy + c;
    if (y_f32) {
      float* out = static_cast<float*>(y) + at;
      if (pairs && c + 1 < n) {
        *reinterpret_cast<float2*>(out) = make_float2(v0, v1);
      } else {
        out[0] = v0;
        if (c + 1 < n) out[1] = v1;
      }
    } else {
      __nv_bfloat16* out = static_cast<__nv_bfloat16*>(y) + at;
      if (pairs && c + 1 < n) {
        *reinterpret_cast<__nv_bfloat162*>(out) = __floats2bfloat162_rn(v0, v1);
      } else {
        out[0] = __float2bfloat16_rn(v0);
        if (c + 1 < n) out[1] = __float2bfloat16_rn(v1);
      }
    }
  };
  if (splits == 1) {
#pragma unroll
    for (int j = 0; j < 16; ++j)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        if (row[h] < m && col0 + 8 * j < n) store(row[h], col0 + 8 * j, acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
    return;
  }

  constexpr int kPitch = kTileN + 4;  // floats between the rows of a piece's sums in shared memory
  // This piece's sums into its ring (every stage consumed: the TMA writes have landed, and the
  // named barrier waits for the last products of the other consumer warps), then each piece adds
  // rows [r0, r1) of the tile over the pieces, in split order.
  asm volatile("bar.sync 1, %0;\n" ::"n"(kConsumerWarps * 32) : "memory");
  float* tile = reinterpret_cast<float*>(raw + (ring - smem_u32(raw)));
#pragma unroll
  for (int j = 0; j < 16; ++j)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      *reinterpret_cast<float2*>(tile + (row[h] - m0) * kPitch + 8 * j + 2 * (lane % 4)) =
          make_float2(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
  cluster_sync();
  const int r0 = split * kTileM / splits, r1 = (split + 1) * kTileM / splits;
  for (int e = threadIdx.x; e < (r1 - r0) * (kTileN / 4); e += kConsumerWarps * 32) {
    const int r = r0 + e / (kTileN / 4), c = 4 * (e % (kTileN / 4));
    const uint32_t local = ring + static_cast<uint32_t>((r * kPitch + c) * 4);
    float4 sum = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int p = 0; p < splits; ++p) {
      const float4 v = ld_cluster_f4(map_cluster(local, p));
      sum.x += v.x, sum.y += v.y, sum.z += v.z, sum.w += v.w;
    }
    const int gr = m0 + r, gc = n0 + c;
    if (gr < m && gc < n) {
      store(gr, gc, sum.x, sum.y);
      if (gc + 2 < n) store(gr, gc + 2, sum.z, sum.w);
    }
  }
  cluster_sync();  // no block leaves while another reads its shared memory
#else
  __trap();  // wgmma and TMA exist only in the sm_90a machine code of this build
#endif
}

}  // namespace

// Split until the blocks reach the multiprocessors, at least two k blocks a piece. Spreading the
// work more evenly instead (the blocks a multiprocessor runs in turn times their k blocks, plus one
// for each block's start and cluster sums; qwen3's qkv projection at 64 rows then split 3 ways
// instead of 4, 120 blocks instead of 160) measured slower on an H200, each against the build
// without this kernel on its own lease: batch-64 decode +3.5% -> +2.4%, batch 128 +1.4% -> -1.1%
// (docs/perf/fp8-dense-w8a8-rows.md). More blocks in flight, not even work, is what these
// latency-bound calls need.
int w8a8_rows_splits(int64_t m, int64_t n, int64_t k, int sms) {
  const int64_t tiles = ((n + kTileN - 1) / kTileN) * ((m + kTileM - 1) / kTileM);
  if (tiles >= sms || sms <= 0) return 1;
  int64_t splits = (sms + tiles - 1) / tiles;
  const int64_t by_steps = k / 128 / 2;  // at least two k blocks a piece
  if (splits > by_steps) splits = by_steps;
  if (splits > kMaxSplits) splits = kMaxSplits;
  return splits > 1 ? static_cast<int>(splits) : 1;
}

cudaError_t gemm_fp8_w8a8_rows(const void* x, const float* x_scales, int64_t x_scale_stride, const void* w,
                               const float* w_scales, void* y, bool y_f32, int64_t m, int64_t n, int64_t k,
                               int64_t ldy, int sms, cudaStream_t stream) {
  const auto a16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  if (m < 1 || m > kW8a8RowsMax || n < 1 || k < 128 || k % 128 != 0 || ldy < n || x_scale_stride < m ||
      !a16(x) || !a16(w) || !x_scales || !w_scales || !y)
    return cudaErrorInvalidValue;
  const int splits = w8a8_rows_splits(m, n, k, sms);
  CUtensorMap xmap, wmap;
  cudaError_t err = kmajor_tile_map(&xmap, x, static_cast<uint64_t>(m), static_cast<uint64_t>(k), kTileM, true);
  if (err == cudaSuccess)
    err = kmajor_tile_map(&wmap, w, static_cast<uint64_t>(n), static_cast<uint64_t>(k), kTileN, true);
  if (err != cudaSuccess) return err;
  // Per device, not a stream operation: harmless inside a graph capture.
  err = cudaFuncSetAttribute(w8a8_rows_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>((n + kTileN - 1) / kTileN), static_cast<unsigned>((m + kTileM - 1) / kTileM),
                     static_cast<unsigned>(splits));
  cfg.blockDim = dim3(kThreads);
  cfg.dynamicSmemBytes = kSmem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;  // pdl.h
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  attr[1].id = cudaLaunchAttributeClusterDimension;  // a tile's pieces
  attr[1].val.clusterDim.x = 1;
  attr[1].val.clusterDim.y = 1;
  attr[1].val.clusterDim.z = static_cast<unsigned>(splits);
  cfg.attrs = attr;
  cfg.numAttrs = 2;
  err = cudaLaunchKernelEx(&cfg, w8a8_rows_kernel, xmap, wmap, x_scales, static_cast<int>(x_scale_stride), w_scales, y,
                           y_f32 ? 1 : 0, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k / 128),
                           static_cast<int>(ldy), splits);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace moe::cuda::kernels
