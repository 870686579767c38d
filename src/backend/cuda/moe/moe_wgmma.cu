// The entry of the Hopper routed-expert path (moe_wgmma_launch.h): checks a call, reads the
// launch shape of the forward (row-tile bound, tile width, split of the down projection), picks
// whether a second row tile runs beside the first, then launches the plan, the grouped GEMMs of
// each row tile (moe_wgmma_gemm.cu, through moe_wgmma_gemm.h) and the combine. Host code, apart
// from the kernels so that the kernel file holds the pipeline alone.
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/moe/moe_decode_launch.h"
#include "backend/cuda/moe/moe_heuristics.h"
#include "backend/cuda/moe/moe_wgmma_gemm.h"
#include "backend/cuda/moe/moe_wgmma_launch.h"
#include "backend/cuda/ops/fp8_blocks_launch.h"

namespace moe::cuda::kernels {

namespace {

using wgmma_detail::kStepK;
using wgmma_detail::LaunchShape;

cudaError_t launch_shape(const ExpertBuffers& b, int tokens, int tile_m, LaunchShape* s) {
  s->tokens = tokens;
  s->max_tiles = static_cast<int>(
      heuristics::max_row_tiles(static_cast<int64_t>(tokens) * b.top_k, b.experts, tile_m));
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err == cudaSuccess) err = cudaDeviceGetAttribute(&s->sms, cudaDevAttrMultiProcessorCount, device);
  if (err != cudaSuccess) return err;
  const bool fp8 = b.gate_up_scales != nullptr;
  s->narrow = heuristics::wgmma_narrow_tiles(s->max_tiles, b.hidden, s->sms) ||
              (fp8 && heuristics::wgmma_fp8_narrow_tiles(static_cast<int64_t>(tokens) * b.top_k, b.experts));
  s->sums = PartialSums{};
  s->sums.splits = s->narrow ? heuristics::wgmma_down_splits(s->max_tiles, b.hidden, b.inter) : 1;
  s->sums.bf16 = s->sums.splits == 1;
  s->sums.split_stride = static_cast<long long>(tokens) * b.top_k;
  return cudaSuccess;
}

bool valid_tile(int tile_m) { return tile_m == 64 || tile_m == 128 || tile_m == 256; }
bool valid_alt(int tile_m, int tile_alt) {
  if (tile_alt == heuristics::kWgmmaMixedTiles) return tile_m == 128;
  return valid_tile(tile_alt) && tile_alt != tile_m;
}

}  // namespace

cudaError_t wgmma_partial_sums(const ExpertBuffers& b, int tokens, int tile_m, PartialSums* sums) {
  LaunchShape s;
  const cudaError_t err = launch_shape(b, tokens, tile_m, &s);
  if (err == cudaSuccess) *sums = s.sums;
  return err;
}

cudaError_t launch_prefill_wgmma(const ExpertBuffers& b, const void* x, const int* ids,
                                 const float* weights, int tokens, int tile_m, void* y,
                                 cudaStream_t stream, int tile_alt) {
  if (!valid_tile(tile_m) || (tile_alt != 0 && !valid_alt(tile_m, tile_alt))) return cudaErrorInvalidValue;
  if (b.hidden % kStepK != 0 || b.inter % kStepK != 0) return cudaErrorInvalidValue;
  const bool fp8 = b.gate_up_scales != nullptr;
  // FP8: stages of one 128-column scale block, one tile per forward, room for the quantised rows.
  if (fp8 && (b.hidden % (2 * kStepK) != 0 || b.inter % (2 * kStepK) != 0 || tile_m == 256 || tile_alt != 0 ||
              b.down_scales == nullptr || b.x_fp8 == nullptr || b.act_fp8 == nullptr))
    return cudaErrorInvalidValue;
  LaunchShape shape, alt_shape;
  cudaError_t err = launch_shape(b, tokens, tile_m, &shape);
  // Mixed row tiles keep tile_m's plan, hence its shape.
  if (tile_alt == heuristics::kWgmmaMixedTiles) alt_shape = shape;
  else if (err == cudaSuccess && tile_alt != 0) err = launch_shape(b, tokens, tile_alt, &alt_shape);
  if (err != cudaSuccess) return err;
  // Both tiles must leave the sums in one form for the combine: no split-K on either. Mixed row
  // tiles exist on grids of 256 weight rows only.
  if (tile_alt != 0 && (shape.sums.splits != 1 || alt_shape.sums.splits != 1)) tile_alt = 0;
  if (tile_alt == heuristics::kWgmmaMixedTiles && shape.narrow) tile_alt = 0;
  // FP8: x's quantisation and the plan run side by side; the plan's last grid waits for it.
  if (fp8) err = quantize_rows_fp8(x, tokens, nullptr, b.hidden, b.x_fp8, b.x_scales, stream);
  if (err == cudaSuccess) err = launch_plan(b, ids, tokens, tile_m, stream, tile_alt, /*beside_predecessor=*/fp8);
  if (err == cudaSuccess) err = wgmma_detail::run_tile(b, x, weights, tile_m, shape, stream);
  if (err == cudaSuccess && tile_alt != 0) {
    ExpertBuffers alt = b;
    alt.num_tiles = b.num_tiles + 1;
    err = wgmma_detail::run_tile(alt, x, weights, tile_alt, alt_shape, stream);
  }
  if (err != cudaSuccess) return err;
  PartialSums sums = shape.sums;
  if (b.leave_partials) {
    *b.leave_partials = sums;
    return cudaSuccess;
  }
  sums.chained = true;
  return launch_combine(b, ids, tokens, sums, y, stream);
}

}  // namespace moe::cuda::kernels
