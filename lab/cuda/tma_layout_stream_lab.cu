// Kernel lab: how fast TMA streams the routed experts' FP8 weights in the order the grouped
// wgmma GEMM reads them, with the weights in their checkpoint layout and in a k-blocked one.
//
// Why: under ncu (qwen3-30b-a3b, FP8, H200) the GEMM's gate_up streams at 85-88% of the copy
// bandwidth at M = 32-512 and its down at 70-75%; down's rows are 768 bytes (six stages of 128 k)
// where gate_up's are 2048. This lab takes the arithmetic away and asks whether the weights'
// access pattern alone already costs that.
//
// The kernel is the GEMM's ring with nothing to compute: persistent blocks, one producer thread
// issuing a stage's TMA boxes (256 weight rows x 128 bytes of k: 32 KB, as a 64 x 256 or 128 x 256
// FP8 item's stage), one consumer warp waiting for each stage and releasing it. Items are
// (expert, 256-row column tile), k stages in order, item i on block i mod grid, as the GEMM.
//  - rowmajor/B: the checkpoint layout [experts x rows, k], boxes of B rows (the GEMM's boxes are
//    64 rows at BM 64 and 128 at BM 128), L2 promotion 256 B as the library's maps.
//  - kblocked: [experts][k / 128][rows][128]: a stage is one contiguous 32 KB box.
//  - plain: a contiguous read of the same bytes by 16-byte loads (what the copy bandwidth allows).
// Timed cold (moe-bench layer's method: L2 flushed before each replay). Result (H200): every form
// streams as fast as the contiguous read; docs/perf/down-stores-whole-lines.md.
//
// Build: cmake -DMOE_BUILD_LAB=ON, target lab_tma_layout_stream; or by hand from the repository root:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude -Ilab/cuda \
//     -o /tmp/tma_layout_stream_lab lab/cuda/tma_layout_stream_lab.cu src/backend/cuda/tensor_map.cpp
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <vector>

#include "backend/cuda/sm90_async.cuh"
#include "backend/cuda/tensor_map.h"
#include "lab_timing.cuh"

namespace {

using namespace moe::cuda::kernels::sm90;

constexpr int kTileRows = 256;                 // weight rows of an item
constexpr int kStageBytes = kTileRows * 128;  // 32 KB

struct Shape {
  const char* name;
  int experts, rows, k;
};

// layout 0: row-major, boxes of box_rows; layout 1: k-blocked, one box a stage.
template <int kStages>
__global__ void __launch_bounds__(64) ring_kernel(const __grid_constant__ CUtensorMap map, int experts, int rows,
                                                   int k, int layout, int box_rows, unsigned* sink) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + kStages * kStageBytes);
  uint64_t* empty = full + kStages;
  const int col_tiles = rows / kTileRows, kb = k / 128, items = experts * col_tiles;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(smem_u32(&full[s]), 1);
      mbar_init(smem_u32(&empty[s]), 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (warp == 0) {
    if (lane != 0) return;
    int n = 0;
    for (int it = blockIdx.x; it < items; it += gridDim.x) {
      const int e = it / col_tiles, c = it % col_tiles;
      for (int s = 0; s < kb; ++s, ++n) {
        const int st = n % kStages;
        if (n >= kStages) mbar_wait(smem_u32(&empty[st]), ((n / kStages) - 1) & 1);
        const uint32_t bar = smem_u32(&full[st]);
        mbar_arrive_expect_tx(bar, kStageBytes);
        const uint32_t dst = smem_u32(smem + st * kStageBytes);
        if (layout == 0) {
          const int row0 = e * rows + c * kTileRows;
          for (int b = 0; b < kTileRows / box_rows; ++b)
            tma_load_2d(dst + b * box_rows * 128, &map, s * 128, row0 + b * box_rows, bar);
        } else {
          tma_load_2d(dst, &map, 0, (e * kb + s) * rows + c * kTileRows, bar);
        }
      }
    }
  } else {
    unsigned acc = 0;
    int n = 0;
    for (int it = blockIdx.x; it < items; it += gridDim.x)
      for (int s = 0; s < kb; ++s, ++n) {
        const int st = n % kStages;
        mbar_wait(smem_u32(&full[st]), (n / kStages) & 1);
        acc ^= reinterpret_cast<const unsigned*>(smem + st * kStageBytes)[lane * 257 % (kStageBytes / 4)];
        __syncwarp();
        if (lane == 0) mbar_arrive(smem_u32(&empty[st]));
      }
    if (acc == 0x9e3779b9u) sink[blockIdx.x] = acc;  // keeps the reads
  }
}

__global__ void plain_kernel(const uint4* p, size_t n, unsigned* sink) {
  unsigned acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  size_t i = size_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (; i + 3 * stride < n; i += 4 * stride) {
    uint4 v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) v[u] = __ldcs(p + i + u * stride);
#pragma unroll
    for (int u = 0; u < 4; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (; i < n; i += stride) acc ^= __ldcs(p + i).x;
  if (acc == 0x9e3779b9u) sink[0] = acc;
}

template <int kStages>
double time_ring(const CUtensorMap& map, const Shape& sh, int layout, int box_rows, int grid, unsigned* sink) {
  const int smem = kStages * kStageBytes + 2 * kStages * 8 + 1024;
  CHECK(cudaFuncSetAttribute(ring_kernel<kStages>, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  return lab::time_cold([&](int, cudaStream_t s) {
    ring_kernel<kStages><<<grid, 64, smem, s>>>(map, sh.experts, sh.rows, sh.k, layout, box_rows, sink);
  });
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp prop{};
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("# %s, %d SMs; cold timings (L2 flushed), median of 50 replays; GB/s = weight bytes / time\n",
              prop.name, sms);
  const Shape shapes[] = {{"qwen3 down (2048 x 768)", 128, 2048, 768},
                          {"qwen3 gate_up (1536 x 2048)", 128, 1536, 2048},
                          {"deepseek-v3 down (7168 x 2048)", 64, 7168, 2048}};
  unsigned* sink = nullptr;
  CHECK(cudaMalloc(&sink, 4096 * sizeof(unsigned)));
  for (const Shape& sh : shapes) {
    const size_t bytes = size_t(sh.experts) * sh.rows * sh.k;
    void* w = nullptr;
    CHECK(cudaMalloc(&w, bytes));
    CHECK(cudaMemset(w, 0x11, bytes));
    std::printf("\n## %s, %d experts, %.1f MB\n", sh.name, sh.experts, bytes / 1e6);
    const double plain = lab::time_cold([&](int, cudaStream_t s) {
      plain_kernel<<<sms * 4, 512, 0, s>>>(static_cast<const uint4*>(w), bytes / 16, sink);
    });
    std::printf("%-28s %9.2f us %8.0f GB/s\n", "plain 16-byte loads", plain, bytes / plain / 1e3);
    for (int layout = 0; layout < 2; ++layout) {
      for (int box_rows : {64, 128, 256}) {
        if (layout == 1 && box_rows != 256) continue;
        CUtensorMap map;
        const uint64_t map_rows = layout == 0 ? uint64_t(sh.experts) * sh.rows : bytes / 128;
        const uint64_t map_k = layout == 0 ? sh.k : 128;
        CHECK(moe::cuda::kmajor_tile_map(&map, w, map_rows, map_k, layout == 0 ? box_rows : 256, true));
        char label[64];
        for (int stages : {4, 5, 6}) {
          double us = stages == 4   ? time_ring<4>(map, sh, layout, box_rows, sms, sink)
                      : stages == 5 ? time_ring<5>(map, sh, layout, box_rows, sms, sink)
                                    : time_ring<6>(map, sh, layout, box_rows, sms, sink);
          std::snprintf(label, sizeof label, "%s%s%d, %d stages", layout == 0 ? "rowmajor" : "kblocked",
                        layout == 0 ? "/" : "", layout == 0 ? box_rows : 0, stages);
          if (layout == 1) std::snprintf(label, sizeof label, "kblocked, %d stages", stages);
          std::printf("%-28s %9.2f us %8.0f GB/s\n", label, us, bytes / us / 1e3);
        }
      }
    }
    CHECK(cudaFree(w));
  }
  return 0;
}
