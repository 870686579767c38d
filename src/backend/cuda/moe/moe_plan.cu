// The routed-expert plan, shared by the grouped paths of the experts (moe_decode.cu's grouped
// GEMV, moe_prefill.cu, moe_wgmma.cu): counts per expert, offsets, the touched experts
// (ascending), each expert's slots (in no fixed order inside the expert) and, when tile_m > 0,
// the GEMM row tiles, with the row tile picked per forward where two are offered. Two passes
// over the ids with shared atomics (count, then place; one when each thread holds a single slot,
// whose count already gives its place); the scan runs over the block's warps with shuffles.
//  - Up to kPlanOneBlockSlots slots: one block does it all (plan_kernel).
//  - Past that, three grids chained as programmatic dependents: each of up to kMaxPlanBlocks
//    blocks counts its own range of slots (plan_count_kernel), one block turns the per-block
//    counts into offsets, per-block starts and tiles (plan_scan_kernel), and each block places
//    its range (plan_scatter_kernel). One block alone is bound by its single multiprocessor's
//    shared atomics: qwen3-30b-a3b's plan took 40 µs at M = 2048 and 145 µs at M = 8192 (H100,
//    ncu), 6 and 9% of the layer. Loading several rounds of ids ahead of the atomics changed
//    nothing (40 µs), so it is throughput, not load latency.
// Nothing allocated, the counts only on the device. Only CUDA headers here.
#include <cuda_runtime.h>

#include "backend/cuda/moe/moe_decode_launch.h"
#include "backend/cuda/moe/moe_heuristics.h"
#include "backend/cuda/pdl.h"

namespace moe::cuda::kernels {

namespace {

constexpr int kPlanThreads = 1024;

// A slot's place among its expert's slots: one shared atomic a lane. A warp whose lanes all hold
// one expert (every token routed alike) takes its 32 places with one atomic, as 32 on one address
// would serialise. Grouping every warp's lanes by expert (__match_any_sync, one atomic a group)
// bound the one-block plan instead: 15 µs for 4096 slots on an H100.
__device__ __forceinline__ int place_in_expert(int* counter, int e, bool valid) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x % 32;
  const int e0 = __shfl_sync(kAll, valid ? e : -1, 0);
  if (__all_sync(kAll, valid && e == e0)) {
    int base = 0;
    if (lane == 0) base = atomicAdd(counter, 32);
    return __shfl_sync(kAll, base, 0) + lane;
  }
  return valid ? atomicAdd(counter, 1) : 0;
}

constexpr int kPlanOneBlockSlots = 4096;
constexpr int kPlanBlockThreads = 256;
constexpr int kPlanSlotsPerBlock = 4 * kPlanBlockThreads;  // four rounds of a block's threads

int plan_blocks(int slots) {
  const int blocks = (slots + kPlanSlotsPerBlock - 1) / kPlanSlotsPerBlock;
  return blocks < kMaxPlanBlocks ? blocks : kMaxPlanBlocks;
}

// f(s, e) for every slot s in [begin, end) (e = ids[s], or -1 past `end`), warp-collective:
// whole warps iterate together (match_any needs every lane).
template <typename F>
__device__ __forceinline__ void for_each_slot(const int* __restrict__ ids, int begin, int end, F&& f) {
  for (int s0 = begin; s0 < end; s0 += blockDim.x) {
    const int s = s0 + threadIdx.x;
    f(s, s < end ? ids[s] : -1);
  }
}

// The whole block (it synchronises inside): from counts[e] (shared), each expert's first
// position (cursor[e], shared, and offsets), the touched experts, their number, and with
// tile_m > 0 each expert's first row tile (tile_start, shared) and the tiles' count. Each warp
// takes chunks of 32 experts: first their totals (into chunk_sums, shared), then, after the
// barrier, the scan inside the chunk from the totals of the chunks before it. One warp walking
// every chunk in turn made 128 experts four dependent rounds of shuffles. The caller
// synchronises before and after.
constexpr int kPlanChunks = kMaxExperts / 32;
// Rows of 4 KB k-slices a row tile of `tile` rows brings into the SMs per 256 output columns,
// for an expert of c rows (rows past its end are zero-filled, not read): a 64- or 128-row tile
// takes 256 weight columns and so reads 256 weight rows; the 256-row tile takes 128 weight
// columns, so two of its items cover 256 columns, each reading the expert's rows again.
// Mixed row tiles (heuristics::kWgmmaMixedTiles): an expert of 129 to 256 rows counts as one
// 256-row tile, any other as 128-row tiles; one past 256 rows rules them out (-1), as they
// measured slower wherever such experts were (docs/perf/mixed-row-tiles.md).
__device__ __forceinline__ int tile_ingress_rows(int c, int tile) {
  if (c == 0) return 0;
  if (tile == heuristics::kWgmmaMixedTiles) {
    if (c > 256) return -1;
    tile = c > 128 ? 256 : 128;
  }
  const int n = (c + tile - 1) / tile;
  return tile == 256 ? 256 * n + 2 * c : 256 * n + c;
}

// Returns the row tile the tiles are built for: tile_m, or with tile_alt > 0 whichever of the two
// the counts favour: the smaller, unless the larger brings more than 5% fewer rows into the SMs
// (tile_ingress_rows summed over the experts; with no rows at all, the smaller). Mixed row tiles
// as tile_alt (beside tile_m = 128) count as the larger, and the tiles are tile_m's either way.
// num_tiles[0] gets the tile count when tile_m is taken and 0 otherwise; with tile_alt,
// num_tiles[1] the same for tile_alt. Each GEMM grid reads its own, so the grids of the tile not
// taken exit at once.
// Checked offline against eight measured cases (docs/perf/row-tile-per-forward.md); it does not
// count the tensor work of zero-filled rows or the items' balance.
__device__ int plan_scan(const int* counts, int experts, int tile_m, int tile_alt, int* cursor,
                         int* tile_start, int* total_tiles, int* chunk_sums, int* __restrict__ offsets,
                         int* __restrict__ active, int* __restrict__ num_active,
                         int* __restrict__ num_tiles) {
  constexpr unsigned kAll = 0xffffffffu;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
  const int chunks = (experts + 31) / 32;
  auto count_at = [&](int c) {
    const int e = c * 32 + lane;
    return e < experts ? counts[e] : 0;
  };
  auto tiles_of = [](int cnt, int tile) { return tile > 0 ? (cnt + tile - 1) / tile : 0; };
  const bool mixed = tile_alt == heuristics::kWgmmaMixedTiles;  // tile_m's tiles either way
  for (int c = warp; c < chunks; c += warps) {
    const int cnt = count_at(c);
    const int sc = __reduce_add_sync(kAll, cnt), st = __reduce_add_sync(kAll, tiles_of(cnt, tile_m));
    const int sn = __popc(__ballot_sync(kAll, cnt > 0));
    if (lane == 0) {
      chunk_sums[c] = sc;
      chunk_sums[kPlanChunks + c] = st;
      chunk_sums[2 * kPlanChunks + c] = sn;
    }
    if (tile_alt > 0) {
      const int sa = mixed ? 0 : __reduce_add_sync(kAll, tiles_of(cnt, tile_alt));
      const int cm = __reduce_add_sync(kAll, tile_ingress_rows(cnt, tile_m));
      const int ia = tile_ingress_rows(cnt, tile_alt);
      const int ca = __any_sync(kAll, ia < 0) ? -1 : __reduce_add_sync(kAll, ia);
      if (lane == 0) {
        chunk_sums[3 * kPlanChunks + c] = sa;
        chunk_sums[4 * kPlanChunks + c] = cm;
        chunk_sums[5 * kPlanChunks + c] = ca;
      }
    }
  }
  __syncthreads();
  bool alt = false;
  if (tile_alt > 0) {
    long long cm = 0, ca = 0;
    bool ruled_out = false;
    for (int c = 0; c < chunks; ++c) {
      cm += chunk_sums[4 * kPlanChunks + c];
      const int a = chunk_sums[5 * kPlanChunks + c];
      ruled_out |= a < 0;
      ca += a;
    }
    alt = !ruled_out && (tile_alt > tile_m || mixed ? ca * 20 < cm * 19 : !(cm * 20 < ca * 19));
  }
  const bool alt_tiles = alt && !mixed;  // tiles built for tile_alt
  const int tile = alt_tiles ? tile_alt : tile_m;
  const int* tile_sums = chunk_sums + (alt_tiles ? 3 : 1) * kPlanChunks;
  auto at = [&](int c, int& cnt, int& tiles) {
    cnt = count_at(c);
    tiles = tiles_of(cnt, tile);
  };
  for (int c = warp; c < chunks; c += warps) {
    // The chunks before c: one per lane (at most kPlanChunks <= 32).
    const bool before = lane < c;
    const int run = __reduce_add_sync(kAll, before ? chunk_sums[lane] : 0);
    const int tiles0 = __reduce_add_sync(kAll, before ? tile_sums[lane] : 0);
    const int n = __reduce_add_sync(kAll, before ? chunk_sums[2 * kPlanChunks + lane] : 0);
    int cnt, t;
    at(c, cnt, t);
    int ic = cnt, it = t;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int uc = __shfl_up_sync(kAll, ic, o), ut = __shfl_up_sync(kAll, it, o);
      if (lane >= o) ic += uc, it += ut;
    }
    const unsigned touched = __ballot_sync(kAll, cnt > 0);
    const int e = c * 32 + lane;
    if (e < experts) {
      cursor[e] = run + ic - cnt;
      offsets[e] = run + ic - cnt;
      tile_start[e] = tiles0 + it - t;
      if (cnt > 0) active[n + __popc(touched & ((1u << lane) - 1u))] = e;
    }
  }
  if (threadIdx.x == 0) {
    int run = 0, tiles = 0, n = 0;
    for (int c = 0; c < chunks; ++c) {
      run += chunk_sums[c];
      tiles += tile_sums[c];
      n += chunk_sums[2 * kPlanChunks + c];
    }
    tile_start[experts] = tiles;
    *total_tiles = tiles;
    offsets[experts] = run;
    *num_active = n;
    num_tiles[0] = alt ? 0 : tiles;
    if (tile_alt > 0) num_tiles[1] = alt ? tiles : 0;
  }
  return tile;
}

// Row tile j belongs to the expert whose [tile_start[e], tile_start[e + 1]) holds j. All threads.
__device__ void plan_tiles(const int* tile_start, const int* starts, int experts, int total_tiles, int tile_m,
                           int* __restrict__ tile_expert, int* __restrict__ tile_row) {
  for (int j = threadIdx.x; j < total_tiles; j += blockDim.x) {
    int lo = 0, hi = experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tile_start[mid] <= j) lo = mid; else hi = mid - 1;
    }
    tile_expert[j] = lo;
    tile_row[j] = starts[lo] + (j - tile_start[lo]) * tile_m;
  }
}
__global__ void __launch_bounds__(kPlanThreads) plan_kernel(
    const int* __restrict__ ids, int slots, int experts, int tile_m, int tile_alt,
    int* __restrict__ offsets, int* __restrict__ order, int* __restrict__ active,
    int* __restrict__ num_active, int* __restrict__ tile_expert, int* __restrict__ tile_row,
    int* __restrict__ num_tiles, bool beside_predecessor) {
  __shared__ int counts[kMaxExperts];
  __shared__ int cursor[kMaxExperts];
  __shared__ int tile_start[kMaxExperts + 1];
  __shared__ int chunk_sums[6 * kPlanChunks];
  __shared__ int total_tiles;
  if (!beside_predecessor) wait_for_predecessor();  // the router's ids (beside it: launch_plan)
  allow_dependents();  // the GEMV's gate_up grid gets resident and waits for this one
  for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  // With one slot per thread (decode), the count's atomic already gives the slot its place in the
  // expert's list, and the second pass over the ids is left out.
  const bool one_round = slots <= static_cast<int>(blockDim.x);
  int mine = -1, rank = 0;
  for_each_slot(ids, 0, slots, [&](int, int e) {
    const bool valid = e >= 0;  // -1: a skipped slot (another rank's expert), or past the end
    const int r = place_in_expert(&counts[valid ? e : 0], e, valid);
    if (one_round) mine = e, rank = r;
  });
  __syncthreads();
  const int tile = plan_scan(counts, experts, tile_m, tile_alt, cursor, tile_start, &total_tiles,
                             chunk_sums, offsets, active, num_active, num_tiles);
  __syncthreads();  // offsets keep the first positions; cursor is advanced below
  if (one_round) {
    if (mine >= 0) order[cursor[mine] + rank] = threadIdx.x;
  } else {
    for_each_slot(ids, 0, slots, [&](int s, int e) {
      const bool valid = e >= 0;
      const int pos = place_in_expert(&cursor[valid ? e : 0], e, valid);
      if (valid) order[pos] = s;
    });
  }
  if (tile > 0) plan_tiles(tile_start, offsets, experts, total_tiles, tile, tile_expert, tile_row);
  if (beside_predecessor) wait_for_predecessor();  // this grid completes after its predecessor
}

// Multi-block plan, step 1: block b counts the slots [b * chunk, (b + 1) * chunk) into
// block_counts[b * experts + e].
__global__ void __launch_bounds__(kPlanBlockThreads) plan_count_kernel(const int* __restrict__ ids, int slots,
                                                                       int experts, int chunk,
                                                                       int* __restrict__ block_counts,
                                                                       bool beside_predecessor) {
  __shared__ int counts[kMaxExperts];
  if (!beside_predecessor) wait_for_predecessor();  // the router's ids (beside it: launch_plan)
  allow_dependents();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  const int begin = blockIdx.x * chunk, end = min(slots, begin + chunk);
  for_each_slot(ids, begin, end, [&](int, int e) {
    const bool valid = e >= 0;
    place_in_expert(&counts[valid ? e : 0], e, valid);
  });
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) block_counts[blockIdx.x * experts + e] = counts[e];
  if (beside_predecessor) wait_for_predecessor();  // this grid completes after its predecessor
}

// Step 2, one block: each expert's count (the sum over blocks) and, in place of block b's count,
// the position of its first slot inside the expert's list (the sum over the blocks before b);
// then the offsets, touched experts and tiles of plan_scan / plan_tiles.
__global__ void __launch_bounds__(kPlanThreads) plan_scan_kernel(
    int* __restrict__ block_counts, int blocks, int experts, int tile_m, int tile_alt,
    int* __restrict__ offsets, int* __restrict__ active, int* __restrict__ num_active,
    int* __restrict__ tile_expert, int* __restrict__ tile_row, int* __restrict__ num_tiles) {
  __shared__ int counts[kMaxExperts];
  __shared__ int cursor[kMaxExperts];
  __shared__ int tile_start[kMaxExperts + 1];
  __shared__ int chunk_sums[6 * kPlanChunks];
  __shared__ int total_tiles;
  wait_for_predecessor();
  allow_dependents();
  // Sixteen blocks' counts loaded before any is overwritten: one load after each store put a
  // global round trip per block on the path (18.7 µs for 64 blocks, qwen3-30b-a3b at M = 8192).
  constexpr int kBatch = 16;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    int run = 0;
    for (int b0 = 0; b0 < blocks; b0 += kBatch) {
      int c[kBatch];
#pragma unroll
      for (int u = 0; u < kBatch; ++u) c[u] = b0 + u < blocks ? block_counts[(b0 + u) * experts + e] : 0;
#pragma unroll
      for (int u = 0; u < kBatch; ++u) {
        if (b0 + u < blocks) block_counts[(b0 + u) * experts + e] = run;
        run += c[u];
      }
    }
    counts[e] = run;
  }
  __syncthreads();
  const int tile = plan_scan(counts, experts, tile_m, tile_alt, cursor, tile_start, &total_tiles,
                             chunk_sums, offsets, active, num_active, num_tiles);
  __syncthreads();
  if (tile > 0) plan_tiles(tile_start, cursor, experts, total_tiles, tile, tile_expert, tile_row);
}

// Step 3: block b places its range's slots from offsets[e] + its start inside the expert's list.
__global__ void __launch_bounds__(kPlanBlockThreads) plan_scatter_kernel(
    const int* __restrict__ ids, int slots, int experts, int chunk, const int* __restrict__ block_counts,
    const int* __restrict__ offsets, int* __restrict__ order) {
  __shared__ int cursor[kMaxExperts];
  wait_for_predecessor();
  allow_dependents();
  for (int e = threadIdx.x; e < experts; e += blockDim.x)
    cursor[e] = offsets[e] + block_counts[blockIdx.x * experts + e];
  __syncthreads();
  const int begin = blockIdx.x * chunk, end = min(slots, begin + chunk);
  for_each_slot(ids, begin, end, [&](int s, int e) {
    const bool valid = e >= 0;
    const int pos = place_in_expert(&cursor[valid ? e : 0], e, valid);
    if (valid) order[pos] = s;
  });
}

}  // namespace

cudaError_t launch_plan(const ExpertBuffers& b, const int* ids, int tokens, int tile_m,
                        cudaStream_t stream, int tile_alt, bool beside_predecessor) {
  if (tile_alt != 0 && (tile_m <= 0 || tile_alt == tile_m)) return cudaErrorInvalidValue;
  if (tile_alt == heuristics::kWgmmaMixedTiles && tile_m != 128) return cudaErrorInvalidValue;
  const int slots = tokens * b.top_k;
  if (slots > kPlanOneBlockSlots && b.plan_counts != nullptr) {
    const int blocks = plan_blocks(slots);
    // Whole rounds of a block's threads per block, so that every warp of a range is full.
    const int chunk = ((slots + blocks - 1) / blocks + kPlanBlockThreads - 1) / kPlanBlockThreads *
                      kPlanBlockThreads;
    cudaError_t err = launch_dependent(plan_count_kernel, dim3(blocks), dim3(kPlanBlockThreads), 0, stream, ids,
                                       slots, b.experts, chunk, b.plan_counts, beside_predecessor);
    if (err == cudaSuccess)
      err = launch_dependent(plan_scan_kernel, dim3(1), dim3(kPlanThreads), 0, stream, b.plan_counts, blocks,
                             b.experts, tile_m, tile_alt, b.offsets, b.active, b.num_active, b.tile_expert,
                             b.tile_row, b.num_tiles);
    if (err == cudaSuccess)
      err = launch_dependent(plan_scatter_kernel, dim3(blocks), dim3(kPlanBlockThreads), 0, stream, ids, slots,
                             b.experts, chunk, static_cast<const int*>(b.plan_counts), b.offsets, b.order);
    return err;
  }
  // One block, threads to match the slots (at least 4 warps): a small layer's plan (128 slots in
  // the seed workload) is latency, and a block of 32 warps costs more to start and to synchronise.
  const int threads = slots >= kPlanThreads ? kPlanThreads : slots <= 128 ? 128 : (slots + 31) / 32 * 32;
  return launch_dependent(plan_kernel, dim3(1), dim3(threads), 0, stream, ids,
                          tokens * b.top_k, b.experts, tile_m, tile_alt, b.offsets, b.order, b.active,
                          b.num_active, b.tile_expert, b.tile_row, b.num_tiles, beside_predecessor);
}

}  // namespace moe::cuda::kernels
