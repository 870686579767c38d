// Path and tile choices of the routed-expert layer on sm_90, per shape class, kept apart from the
// kernels (DeepGEMM's heuristics/sm90.hpp habit). Plain C++ (no CUDA types): cuda_moe.cpp picks
// the path, moe_prefill.cu instantiates the tiles named here.
//
// Two paths:
//  - GEMV (moe_decode.cu): each touched expert's weight rows read once with 16-byte loads and
//    applied to its few tokens with FFMA. Right while an expert has about one token: the tensor
//    cores would idle anyway and the GEMV has no tile padding.
//  - grouped GEMM (moe_prefill.cu): mma.sync m16n8k16 bf16 -> f32 with ldmatrix and a 3-stage
//    cp.async pipeline, one row tile of one expert per block. This is the Ampere-style form,
//    written without a GPU at hand; on sm_90 it reaches roughly half of what wgmma + TMA does at
//    compute-bound sizes (M >= 2048). Kept for devices other than sm_90 and as the reference the
//    Hopper path is checked against.
//  - Hopper grouped GEMM (moe_wgmma.cu): the same plan, tiles of BM rows x 256 weight rows (or
//    256 x 128, wgmma_tile_m), wgmma from 128-byte-swizzled shared memory, weights by TMA,
//    activation rows gathered by cp.async, a warp-specialised producer and two consumer
//    warpgroups. Taken instead of the grouped GEMM
//    wherever that one would run, on a device of compute capability 9.0 (the code is sm_90a).
//    Measured on an H200 (moe-bench layer, graph replays, L2 flushed, 2026-11-21), µs, mma.sync
//    GEMM -> wgmma: qwen3-30b-a3b M = 128: 330 -> 313, 512: 363 -> 339, 2048: 696 -> 535,
//    8192: 2170 -> 1478; deepseek-v2-lite 128: 314 -> 296, 512: 338 -> 317, 2048: 831 -> 585,
//    8192: 2690 -> 1677. At M = 8 and 32 it also beats the mma.sync GEMM, but M = 8 stays on
//    the GEMV by the rule below (GEMV 138 vs wgmma 142 on qwen3). FP8 experts run it W8A8
//    (wgmma_fp8_supports): measured on an H100 (moe-bench layer --dtype fp8, 2026-11-26), µs,
//    mma.sync W8A8 -> wgmma W8A8, qwen3-30b-a3b M = 32: 326 -> 209, 512: 443 -> 274, 2048: 1102
//    -> 471, 8192: 3330 -> 1362; deepseek-v3 M = 8: 1342 -> 851, 2048: 8808 -> 5767.
#pragma once

#include <cmath>
#include <cstdint>

namespace moe::cuda::heuristics {

// GEMV path widths (hidden and intermediate): multiples of 8, at most 2048 (one row in registers
// per lane: 8 chunks of 16 bytes x 32 lanes).
constexpr int64_t kGemvMaxWidth = 2048;
constexpr int64_t kGemvWidthMultiple = 8;
// GEMM path widths: multiples of the k-step (64) and of the gate_up output tile (64), at most 8192
// (DeepSeek-V3: hidden 7168, inter 2048).
constexpr int64_t kGemmMaxWidth = 8192;
constexpr int64_t kGemmWidthMultiple = 64;
// Rows of one forward: a prefill chunk on one GPU, or what an expert-parallel rank receives
// (ranks x tokens per rank). The workspace grows with it (qwen3-30b-a3b at 65536: ~3 GB).
constexpr int64_t kMaxTokens = 65536;

// Where the shape allows both, the GEMV path is used up to this many routed slots per touched
// expert on average (M * k / min(E, M * k)). Measured on an H200 (both paths timed at each M by
// moe-bench layer --device cuda, 2026-11-21): qwen3 M = 8 (1 slot per expert) GEMV 138 µs vs
// GEMM 153; M = 32 (2 per expert) GEMV 343 vs GEMM 273; deepseek-v2-lite M = 8 (1 per expert)
// 180 vs 176, M = 32 (3 per expert) 415 vs 288. The switch sits between 1 and 2. On an H100
// (build/gemvH bench, graph replays, L2 flushed, 2026-11-21), GEMV vs wgmma, µs: qwen3 M = 8
// (ratio 1.0) 190 vs 195, M = 16 (1.0) 290 vs 289, M = 32 (2.0) 407 vs 387; deepseek-v2-lite
// M = 8 (1.0) 247 vs 254, M = 16 (1.5) 354 vs 344, M = 32 (3.0) 444 vs 386: 1.5 kept deepseek's
// M = 16 on the slower GEMV, hence 1.25.
constexpr double kGemvMaxSlotsPerExpert = 1.25;
// Up to this many routed slots (M * k) the GEMV runs without the plan kernel, on persistent grids
// chained by programmatic dependent launch (at most 32: one slot per lane). Measured on an H100
// against the plan + short-block form, µs: qwen3 M = 1 (8 slots) 39.7 vs 48.4, M = 2 (16) 66.9
// vs 71.4, M = 3 (24) 92.5 vs 97.1, M = 4 (32) 123.2 vs 124.2; deepseek-v2-lite M = 1 (6) 50.2 vs
// 58.6, M = 2 (12) 90.0 vs 93.5, M = 3 (18) 114.6 vs 116.5, M = 4 (24) 147.1 vs 144.5. The fixed
// cost it saves (plan launch, launch gaps) stays ~5 µs while its per-row latency grows with M.
constexpr int kGemvDirectMaxSlots = 24;
// bf16 experts keep the plan-free form to at most 16 slots (two tokens at top-6 or top-8): in a
// replayed decode graph, three tokens on it ran slower than on the plan and the grouped kernels,
// though one layer timed alone (above) ran faster. H100, 2026-11-27, moe-bench model, 3-row steps
// in a graph of their own, ms: qwen3-30b-a3b (24 slots) 6.69-6.70 against 5.86-5.87,
// deepseek-v2-lite (18) 5.48 against 4.82-4.83; two tokens stay faster plan-free (qwen3 4.70
// against 4.94, deepseek-v2-lite 3.97-4.00 against 4.06-4.08). FP8 experts keep it to
// kGemvDirectMaxSlots: past it they take the wgmma GEMM (prefer_gemv_fp8), slower at 3 tokens.
// Top-2 shapes (Mixtral: 9-12 tokens in 18-24 slots) were not measured.
constexpr int kGemvDirectMaxSlotsBf16 = 16;
inline int gemv_direct_max_slots(bool fp8) { return fp8 ? kGemvDirectMaxSlots : kGemvDirectMaxSlotsBf16; }
// The GEMV keeps f32 partial sums [slots, hidden]; the GEMM path keeps bf16 ones (half the
// traffic at prefill sizes). Where both paths exist the workspace holds the bf16 sums for
// max_tokens and f32 ones for at most this many tokens, the GEMV's limit there.
constexpr int64_t kGemvMaxTokensBesideGemm = 256;

// Grouped GEMM tiles. 256 threads as 2 (rows) x 4 (columns) warps; k-step 64 (128-byte smem rows,
// XOR-swizzled in 16-byte chunks so that ldmatrix and cp.async are free of bank conflicts);
// 3 stages of (BM + 128) x 64 bf16: 72 KB at BM = 128, so two blocks per SM (227 KB).
// The weight tile is always 128 rows: gate_up takes 64 gate rows and the matching 64 up rows,
// so the SiLU(gate) * up epilogue has both in the same thread; down takes 128 rows of hidden.
constexpr int kGemmBK = 64;
constexpr int kGemmStages = 3;
constexpr int kGemmWeightRows = 128;
constexpr int kGemmGateUpCols = kGemmWeightRows / 2;  // act columns per block
constexpr int kGemmDownCols = kGemmWeightRows;        // hidden columns per block

// Row tile (routed slots of one expert per block): 64 while experts get few rows each, so that
// a 5-row expert pads to 64 rather than 128 (the padding costs tensor-core time and A loads, not
// weight bytes: each weight tile is read once per row tile either way); 128 once experts get
// more than 64 rows on average, which halves the weight re-reads per row and the number of blocks
// at compute-bound sizes.
inline int gemm_tile_m(int64_t tokens, int64_t top_k, int64_t experts) {
  const double per_expert = static_cast<double>(tokens * top_k) / static_cast<double>(experts);
  return per_expert > 64.0 ? 128 : 64;
}

// The wgmma path's row tile: gemm_tile_m's, or 256 rows (with 128-row weight tiles) where
// experts average more rows than one 128-row tile holds yet few would pass 256 under a uniform
// router's spread (mean + 3 standard deviations <= 256, so up to ~212 rows). There 128-row tiles
// give most experts a second, partly empty tile that reads all of the expert's weights again,
// while a 256-row tile reads them once and its consumers skip the 64-row sub-tiles past the
// expert's end. Past that range two 256-row tiles per expert lose: each weight tile then feeds
// half the activation rows it did, and the gather of 256 rows a stage costs more than the
// weights saved. Measured (moe-bench layer --device cuda, H100, 2026-11-22), µs, 128 -> 256:
// deepseek-v2-lite M = 1536 (144 rows an expert) 701 -> 617, M = 2048 (192) 729 -> 684;
// qwen3-30b-a3b M = 3072 (192) 885 -> 830; losses at M = 2048 (128 rows) 668 -> 698 and at
// M = 4096 (256) 945 -> 1148, and at M = 8192 on both shapes (qwen3 1601 -> 2024).
constexpr double kWgmmaTallTileFrom = 136.0;  // between the loss at 128 and the gain at 144
inline int wgmma_tile_m(int64_t tokens, int64_t top_k, int64_t experts) {
  const double per_expert = static_cast<double>(tokens * top_k) / static_cast<double>(experts);
  const bool fits = per_expert + 3.0 * std::sqrt(per_expert) <= 256.0;
  return per_expert > kWgmmaTallTileFrom && fits ? 256 : gemm_tile_m(tokens, top_k, experts);
}

// The row tile the plan may pick per forward, from the expert counts, instead of wgmma_tile_m's
// (0: none). wgmma_tile_m assumes every expert draws M * k / E rows; its 256-row tile is a bet on
// that, and under uneven routing 128-row tiles are faster. Measured on an H100 (moe-bench layer,
// same lease), deepseek-v2-lite M = 2048, µs, without -> with the choice: uniform routing 632.6 ->
// 638.1 (the 128-row grids, launched and exiting at once), --routing-skew 1 774.5 -> 673.1.
// Offered only there: from 64-row tiles (M = 512) the choice of 128 gained as much under skew
// (qwen3-30b-a3b 464.5 -> 444.2, deepseek-v2-lite 485.6 -> 453.5) but cost 2.5 µs with uniform
// routing, on layers of ~420-450 µs already near their 1.15x-of-floor line.
//
// Where the heuristics take 128-row tiles with experts averaging kWgmmaMixedFrom to
// kWgmmaTallTileFrom rows, the other candidate is mixed row tiles (kWgmmaMixedTiles): the plan
// still cuts 128-row tiles, and an expert of 129 to 256 rows, which those leave with a second,
// nearly empty tile re-reading all of its weights, runs as one 256-row tile. With uniform routing
// about half the experts are such there. As the only tiles of the layer they lost wherever
// routing was uneven (docs/perf/mixed-row-tiles.md), hence a choice per forward. Measured
// (moe-bench layer --device cuda, H100, 2026-11-23), µs, without -> with the choice:
// qwen3-30b-a3b M = 2048 636 -> 595, --routing-skew 0.3 646 -> 612, M = 2176 699 -> 653; where
// the counts keep 128-row tiles (the mixed grids launched and exiting at once): M = 2048
// --routing-skew 1 625 -> 627, M = 1792 553 -> 557, deepseek-v2-lite M = 1280 499 -> 502. Below
// ~100 rows an expert uniform routing leaves almost no expert past 128 rows (M = 1536, 96 rows:
// 514.6 with 128-row tiles, 513.8 with mixed ones as the only tiles).
constexpr int kWgmmaMixedTiles = 1;
constexpr double kWgmmaMixedFrom = 100.0;

inline int wgmma_alt_tile(int64_t tokens, int64_t top_k, int64_t experts) {
  const int tile = wgmma_tile_m(tokens, top_k, experts);
  if (tile == 256) return 128;
  const double per_expert = static_cast<double>(tokens * top_k) / static_cast<double>(experts);
  const bool near_one_tile = per_expert > kWgmmaMixedFrom && per_expert <= kWgmmaTallTileFrom;
  return tile == 128 && near_one_tile ? kWgmmaMixedTiles : 0;
}

inline bool gemv_supports(int64_t hidden, int64_t inter) {
  return hidden % kGemvWidthMultiple == 0 && inter % kGemvWidthMultiple == 0 &&
         hidden <= kGemvMaxWidth && inter <= kGemvMaxWidth;
}

inline bool gemm_supports(int64_t hidden, int64_t inter) {
  return hidden % kGemmWidthMultiple == 0 && inter % kGemmWidthMultiple == 0 &&
         hidden >= kGemmWidthMultiple && inter >= kGemmWidthMultiple &&
         hidden <= kGemmMaxWidth && inter <= kGemmMaxWidth;
}

// The Hopper path takes the grouped GEMM's widths: k-steps of 64 on both GEMMs; gate_up tiles of
// 128 act columns and down tiles of 256 hidden columns are masked at the edge (the TMA box reads
// the next rows or zeros there, which no stored column uses).
inline bool wgmma_supports(int64_t hidden, int64_t inter) { return gemm_supports(hidden, inter); }

// FP8 experts on the Hopper path (W8A8, moe_wgmma_gemm.cu): a stage is 128 k, one scale block,
// so both widths must be multiples of 128; elsewhere they take the mma.sync W8A8 GEMM. Row tiles
// of 64 or 128 with no alternative per forward: a consumer keeps a stage's products beside its
// sums. 256-row tiles (two sub-tiles a consumer, 232 registers) were slower at every M measured,
// 1024 to 8192 rows, and still 6-9% slower with the producers' arrivals freed
// (docs/perf/fp8-wgmma-bound.md).
// 128-row tiles start from 56 rows an expert on average rather than the bf16 path's 64, where a
// good share of the experts would spill into a second, nearly empty 64-row tile that reads all
// of their weights again. Measured (moe-bench layer --dtype fp8, H100, 2026-11-26, the tile
// forced), µs, 64 -> 128 rows: deepseek-v3 M = 2048 (64 rows an expert) 5783 -> 4471;
// qwen3-30b-a3b M = 768 (48) 292 -> 317, M = 1024 (64) 324 -> 333, M = 1536 (96) 446 -> 369.
// The qwen3 loss at 64 rows (3%) is kept for deepseek-v3's gain (29%); rows between 48 and 64
// on deepseek-v3 are not measured yet.
constexpr double kWgmmaFp8TallFrom = 56.0;
inline bool wgmma_fp8_supports(int64_t hidden, int64_t inter) {
  return wgmma_supports(hidden, inter) && hidden % 128 == 0 && inter % 128 == 0;
}
inline int wgmma_fp8_tile_m(int64_t tokens, int64_t top_k, int64_t experts) {
  const double per_expert = static_cast<double>(tokens * top_k) / static_cast<double>(experts);
  return per_expert > kWgmmaFp8TallFrom ? 128 : 64;
}

// The path for M tokens when the shape allows both.
inline bool prefer_gemv(int64_t tokens, int64_t top_k, int64_t experts) {
  if (tokens > kGemvMaxTokensBesideGemm) return false;
  const int64_t slots = tokens * top_k;
  const int64_t touched = slots < experts ? slots : experts;
  return static_cast<double>(slots) / static_cast<double>(touched) <= kGemvMaxSlotsPerExpert;
}

// FP8 experts where the wgmma W8A8 GEMM runs: the GEMV only in its direct form (at most
// kGemvDirectMaxSlots slots, no plan kernel). Halving the weight bytes leaves the GEMV's fixed
// costs a larger share, and past the direct form the GEMM wins. Measured (moe-bench layer
// --device cuda --preset qwen3-30b-a3b --dtype fp8, H100, 2026-11-26), µs, GEMV vs wgmma: M = 1
// 25.6 vs 38.9, 2: 42.6 vs 55.6, 3 (24 slots): 56.9 vs 77.2; M = 4 (32 slots, the grouped GEMV)
// 88.5 vs 83.3, 6: 117.9 vs 103.0, 8: 144.7 vs 122.5, 16: 240.8 vs 169.0. With two FP8 down rows
// a warp in the grouped GEMV (2026-11-27): M = 4 84.1-84.4 vs 82.9-83.1, 8: 136.0-136.9 vs 122.4-
// 122.5, 16: 222.9 vs 168.7-168.8; still the GEMM.
inline bool prefer_gemv_fp8(int64_t tokens, int64_t top_k, int64_t experts) {
  return tokens * top_k <= kGemvDirectMaxSlots && prefer_gemv(tokens, top_k, experts);
}

// The wgmma path's blocks take 256 weight rows (output columns) each; where the worst-case grid
// of the down projection (row tiles x hidden / 256 column tiles) is smaller than the device's
// multiprocessor count, blocks of 128 rows run instead, for twice the blocks. Small layers need
// it: the seed workload's (8 experts, hidden 512) down projection had 16 blocks for 132
// multiprocessors and took 11.4 µs for 8 MB of weights (ncu, H200, 2026-11-22). Measured gain
// (moe-bench layer --device cuda --tokens M, H200): seed M = 8 31.0 -> 29.6 µs, 64: 32.8 -> 30.5,
// 128: 33.7 -> 31.2; still ~5x the floor, since each block walks all of K (16 steps of 64 for the
// down projection) whatever its share of the rows: split-K (wgmma_down_splits) cuts that.
inline bool wgmma_narrow_tiles(int64_t max_row_tiles, int64_t hidden, int multiprocessors) {
  return max_row_tiles * ((hidden + 255) / 256) < multiprocessors;
}

// FP8 experts also take blocks of 128 weight rows where they average at most one routed row:
// the items, each a weight stream with next to no rows, then come in waves that leave fewer
// multiprocessors idle at the end (qwen3-30b-a3b at M = 8: 54 touched experts x 6 gate_up column
// tiles = 324 items, 2.5 waves of 132, against 648, 4.9 waves). Measured (moe-bench layer
// --device cuda --preset qwen3-30b-a3b --dtype fp8, H100, 2026-11-27, forced both ways, µs,
// 256 -> 128 weight rows a block): M = 4 83.1-83.4 -> 81.4-81.5, 8: 122.3-122.7 -> 119.1-119.5, 16: 169.0-169.2
// -> 166.9-168.2; past one row an expert it stops paying (32: 205.1-205.4 -> 203.6-204.3, 64:
// 233.5-234.3 -> 236.3-237.0). deepseek-v3, at its floor either way: M = 8 910.0 -> 905.1, 32
// (one row an expert) 2482.6-2484.3 -> 2488.8-2490.1. bf16 lost at every M measured (32 to 256
// rows, +1.7-2.6%).
inline bool wgmma_fp8_narrow_tiles(int64_t slots, int64_t experts) { return slots <= experts; }

// Split-K of the wgmma down projection where even 128-row tiles leave the device short of blocks
// (the seed workload's 8 experts of hidden 512 at 64 tokens: ~40 items for 132 multiprocessors,
// each walking 16 k-steps): each (row tile, column tile) item's k range is cut into `splits`
// contiguous pieces run by different blocks. Each piece writes f32 partial sums by slot and
// split, and the combine adds them in split order, so the result does not depend on which block
// finishes first. Sized from a fixed target of 128 blocks rather than the device's count, so
// that the workspace (sized without a device) covers every device; at least 2 k-steps per piece,
// at most 8 pieces. Only where wgmma_narrow_tiles holds; the weight tiles are then 128 rows (as
// they always are with 256-row tiles), hence the column count.
// Measured on an H200 with the launches made programmatic dependents at the same time (moe-bench
// layer --device cuda --ep 1 --tokens 64, seed shape): 30.5 -> 25.6 us; the seed's p2p layer on
// two H200s 45.6 -> 40.4 us.
constexpr int64_t kSplitTargetBlocks = 128;
constexpr int64_t kMaxDownSplits = 8;
constexpr int64_t kMinStepsPerSplit = 2;
inline int wgmma_down_splits(int64_t max_row_tiles, int64_t hidden, int64_t inter) {
  const int64_t items = max_row_tiles * ((hidden + 127) / 128);
  int64_t s = kSplitTargetBlocks / (items > 0 ? items : 1);
  const int64_t by_steps = inter / kGemmBK / kMinStepsPerSplit;
  if (s > by_steps) s = by_steps;
  if (s > kMaxDownSplits) s = kMaxDownSplits;
  return s > 1 ? static_cast<int>(s) : 1;
}

// Upper bound on the row tiles of a forward with `slots` routed rows: sum over experts of
// ceil(count / BM) <= slots / BM + (experts with any rows). The grid is sized for it; blocks past
// the real count (known only on the device) exit at once.
inline int64_t max_row_tiles(int64_t slots, int64_t experts, int tile_m) {
  const int64_t touched = slots < experts ? slots : experts;
  return (slots + tile_m - 1) / tile_m + touched;
}

}  // namespace moe::cuda::heuristics
