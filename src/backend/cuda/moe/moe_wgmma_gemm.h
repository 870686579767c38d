// The interface between moe_wgmma.cu, the entry of the Hopper routed-expert path
// (moe_wgmma_launch.h), and moe_wgmma_gemm.cu, its two grouped GEMMs on wgmma and TMA. The entry
// checks a call, reads the launch shape of the forward and runs the plan and the combine; the
// GEMM file owns the kernel, its tile configurations and the tensor maps of the weights. Host
// code.
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/moe/moe_decode_launch.h"

namespace moe::cuda::kernels::wgmma_detail {

// k of one pipeline stage: one 128-byte swizzle atom of bf16. hidden and inter must be multiples
// (of twice it for FP8 experts, whose stage of 128 bytes is one scale block).
constexpr int kStepK = 64;

// The launch shape of one forward, read once: the row-tile bound, the device's multiprocessors,
// the tile width and the split of the down projection with the partial sums it leaves.
struct LaunchShape {
  int tokens = 0, max_tiles = 0, sms = 0;
  bool narrow = false;
  PartialSums sums;
};

// gate_up and down for one row tile (tile_m 64, 128, 256 or heuristics::kWgmmaMixedTiles, the
// last only where shape.narrow is false), on the tile count at b.num_tiles. FP8 experts
// (b.gate_up_scales set): tile_m 64 or 128, x already quantised into b.x_fp8.
cudaError_t run_tile(const ExpertBuffers& b, const void* x, const float* weights, int tile_m,
                     const LaunchShape& shape, cudaStream_t stream);

}  // namespace moe::cuda::kernels::wgmma_detail
