// The launch interface of the Hopper routed-expert GEMM path (moe_wgmma.cu): plain pointers and
// sizes, like moe_decode_launch.h, whose ExpertBuffers it takes.
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/moe/moe_decode_launch.h"

namespace moe::cuda::kernels {

// Plan, grouped GEMM gate_up with SiLU * up in its epilogue, grouped GEMM down (bf16 partial sums
// scaled by the routing weight), combine: the contract of launch_prefill, on wgmma with the weights
// loaded by TMA. Needs a device of compute capability 9.0 (the code is sm_90a), hidden and inter
// multiples of 64, at most 8192; tile_m 64, 128 or 256. The grids are sized for the worst case of
// `tokens`, so the launch is graph-capturable. cudaErrorNotSupported when the driver offers no
// cuTensorMapEncodeTiled. tile_alt (0: none): another row tile; the plan then picks one of the two
// per forward from the expert counts (launch_plan), the GEMM grids of both are launched and those
// of the tile not picked exit at once. Taken only where both leave their partial sums in one form.
// tile_alt heuristics::kWgmmaMixedTiles (beside tile_m 128, on grids of 256 weight rows): mixed
// row tiles, an expert of 129 to 256 rows run as one 256-row tile.
// FP8 experts (b.gate_up_scales set, W8A8): x and act are quantised per row and 128 columns into
// b.x_fp8 and b.act_fp8, and each stage's products are scaled by the activation row's and the
// weight block's scales; hidden and inter multiples of 128, tile_m 64 or 128, no tile_alt.
cudaError_t launch_prefill_wgmma(const ExpertBuffers& b, const void* x, const int* ids,
                                 const float* weights, int tokens, int tile_m, void* y,
                                 cudaStream_t stream, int tile_alt = 0);

// The form in which launch_prefill_wgmma leaves the partial sums for `tokens` (bf16, or f32
// split-K pieces on small grids).
cudaError_t wgmma_partial_sums(const ExpertBuffers& b, int tokens, int tile_m, PartialSums* sums);

}  // namespace moe::cuda::kernels
