// The launch interface of the routed-expert kernels (moe_plan.cu: plan; moe_decode.cu: GEMV
// path; moe_combine.cu: combine; moe_prefill.cu: grouped GEMM path): plain pointers and sizes, no library types,
// so the .cu files need nothing but CUDA headers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe::cuda::kernels {

constexpr int kMaxExperts = 512;

// The following layer's input norm, folded into the combine when x != null: per token t,
// x[t] += f32(y[t]) (y rounded to bf16 first, as when it is stored), then
// h[t] = bf16(x[t] / sqrt(mean(x[t]^2) + eps) * weight): add_rms_norm's result with one launch
// less per layer. y is then not written.
struct ResidualNorm {
  float* x = nullptr;            // f32 [tokens, hidden], in place
  const float* weight = nullptr;  // f32 [hidden]
  float eps = 0.0f;
  void* h = nullptr;  // bf16 [tokens, hidden]
  // Rows t < code_rows go to `codes` instead of h, as an FP8 projection's input: E4M3 codes
  // [code_rows, hidden] (8-byte aligned) and scales block-major [hidden / 128, code_rows] of the
  // bf16 rows h would get (quantize_rows_fp8_by_block's; hidden a multiple of 128).
  uint8_t* codes = nullptr;
  float* scales = nullptr;
  int code_rows = 0;
};

// The form of the partial sums in ExpertBuffers::part that the combine adds up.
struct PartialSums {
  bool bf16 = false;  // bf16 [slots, hidden] (GEMM paths) or f32 (GEMV path, split-K)
  // Split-K (f32 only): slot s's sum comes in `splits` pieces, at part[(i * split_stride + s) *
  // hidden], i < splits, added in that order.
  int splits = 1;
  long long split_stride = 0;
  bool chained = false;  // a programmatic dependent of the kernel before it (pdl.h)
};

// Blocks of the plan past one block's worth of slots (moe_plan.cu): ExpertBuffers::plan_counts
// holds this many rows of per-expert counts.
constexpr int kMaxPlanBlocks = 128;

// Device pointers, all carved by the caller from one workspace except the weights.
struct ExpertBuffers {
  const void* gate_up;  // bf16 [experts, 2 * inter, hidden]: gate rows, then up rows
  const void* down;     // bf16 [experts, hidden, inter]
  // Set: gate_up and down are FP8 E4M3 codes with f32 scales per 128 x 128
  // block, per expert [ceil(2 * inter / 128), ceil(hidden / 128)] and [ceil(hidden / 128),
  // ceil(inter / 128)] (inter a multiple of 128, hidden of 16).
  const float* gate_up_scales = nullptr;
  const float* down_scales = nullptr;
  // FP8 GEMM path (W8A8): x and act quantised per row and 128 columns, [max tokens, hidden] and
  // [max slots, inter] E4M3 with their [rows, ceil(width / 128)] scales.
  void* x_fp8 = nullptr;
  float* x_scales = nullptr;
  void* act_fp8 = nullptr;
  float* act_scales = nullptr;
  int* offsets;         // [experts + 1] start of each expert's rows in order
  int* order;           // [max slots] routed slots (t * top_k + j) grouped by expert
  int* active;          // [experts] touched experts, ascending (GEMV path)
  int* num_active;      // [1]
  int* tile_expert;     // [max row tiles] expert of each GEMM row tile
  int* tile_row;        // [max row tiles] first position in order of each GEMM row tile
  int* num_tiles;       // [2]: the row tiles (see launch_plan's tile_alt)
  int* plan_counts = nullptr;  // [kMaxPlanBlocks * experts] the multi-block plan's per-block counts
  void* act;            // bf16 [max slots, inter]: SiLU(gate) * up, row p = position in order
  void* part;           // [max slots, hidden] by slot: f32 (GEMV path) or bf16 (GEMM path)
  int experts, hidden, inter, top_k;
  ResidualNorm norm;  // see above; x == null: the plain combine into y
  // Set: the launchers stop before the combine and describe the partial sums here instead (the
  // p2p exchange sums the rows itself while sending them back).
  PartialSums* leave_partials = nullptr;
};

// Counts, offsets, the per-expert slot lists and, when tile_m > 0, the GEMM row tiles. One block;
// the order inside an expert's list is not fixed, which changes no result: every row is computed
// on its own and the combine sums by slot. tile_alt > 0 (another row tile than tile_m): the plan
// picks one of the two from the counts (moe_plan.cu, plan_scan), builds the tiles for it and
// writes num_tiles[0] (tile_m's count, 0 when not picked) and num_tiles[1] (tile_alt's).
// tile_alt heuristics::kWgmmaMixedTiles (beside tile_m 128 only): the tiles are 128 rows either
// way, the pick only sets the counts.
// beside_predecessor: the plan's first grid reads the ids and writes its buffers without waiting
// for its predecessor on the stream, and waits for it only before it exits, so that the grids
// after the plan still start after both. Only where that predecessor is a programmatic dependent
// that itself waited for everything before it (the ids' producer and the last readers of the
// plan's buffers included) before it let the plan start (begin_dependent): then the two run side
// by side (the FP8 wgmma path's quantisation of x, moe_wgmma.cu). A dependent grid is scheduled
// only once every block of the grid before it has started, so the GEMM blocks that get resident
// early and wait never hold multiprocessors the quantisation still needs.
cudaError_t launch_plan(const ExpertBuffers& b, const int* ids, int tokens, int tile_m,
                        cudaStream_t stream, int tile_alt = 0, bool beside_predecessor = false);

// Plan, gate_up GEMV + SiLU, down GEMV, combine on `stream` (hidden, inter: multiples of 8, at
// most 2048).
cudaError_t launch_decode(const ExpertBuffers& b, const void* x, const int* ids,
                          const float* weights, int tokens, void* y, cudaStream_t stream);

// Plan, grouped GEMM gate_up with SiLU * up in its epilogue, grouped GEMM down (bf16 partial sums
// scaled by the routing weight), combine (hidden, inter: multiples of 64, at most 8192; tile_m 64
// or 128). The grids are sized for the worst case of `tokens`, so the launch is graph-capturable.
cudaError_t launch_prefill(const ExpertBuffers& b, const void* x, const int* ids,
                           const float* weights, int tokens, int tile_m, void* y,
                           cudaStream_t stream);

// y[t, h] = sum over j < top_k of part[t * top_k + j, h], in j order (deterministic), leaving
// out the slots whose id is -1; with b.norm.x set, the residual add and norm of ResidualNorm
// instead of storing y.
cudaError_t launch_combine(const ExpertBuffers& b, const int* ids, int tokens, PartialSums sums,
                           void* y, cudaStream_t stream);

}  // namespace moe::cuda::kernels
