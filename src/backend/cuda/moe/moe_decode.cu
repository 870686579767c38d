// Small-M (decode) routed-expert path (the plan is in moe_plan.cu, the combine that the paths
// share in moe_combine.cu). Per touched expert each bf16 weight row is read once, with 16-byte
// streaming loads, and applied to all of that expert's tokens.
//
// Two forms, switched at heuristics::gemv_direct_max_slots routed slots (24 for FP8 experts, 16
// for bf16; docs/perf/decode-direct-gemv.md):
//  - direct (decode, M of 1 to 3): no plan kernel; the warps read the ids themselves (one slot
//    per lane). Persistent grids (a warp loops over weight rows: no block churn, no tail of short
//    blocks) chained by programmatic dependent launch, so each grid is resident before its
//    predecessor ends: the down GEMV issues its first weight loads while gate_up drains, the
//    combine has no launch gap. act and the f32 partial sums are kept by slot. One token with
//    the plain combine (no folded norm, no partial sums left for an exchange) has no combine
//    grid: down_combine_kernel sums each output row over the experts itself.
//  - grouped (v2, up to the switch to the GEMM path): the plan, then one short block per touched
//    expert and 4 rows; act by position in the plan's order, partial sums by slot. Chained by
//    programmatic dependent launch too, every read after the wait (reading the plan before it,
//    through L2, cost more than the launch gap it hid: docs/perf/strong-loads.md).
// Nothing allocated, the counts only on the device, every output summed in a fixed order.
// Only CUDA headers here: the host side (checks, errors, uploads) is in cuda_moe.cpp.
#include <cuda_bf16.h>

#include <type_traits>

#include "backend/cuda/bf16x8.cuh"
#include "backend/cuda/moe/moe_decode_launch.h"
#include "backend/cuda/moe/moe_heuristics.h"
#include "backend/cuda/pdl.h"
#include "backend/cuda/moe/slot_sums.cuh"
#include "backend/cuda/stream_load.cuh"
#include "backend/cuda/weight_rows.cuh"

namespace moe::cuda::kernels {

namespace {

constexpr int kGemvWarps = 4;      // per block
constexpr int kGemvMinBlocks = 3;  // per SM: caps registers at 168 (12 warps, ~8 KB in flight each)
constexpr int kDownCombineMinBlocks = 4;  // 128 registers: combine_batch's 12 loads fit
constexpr int kDirectMaxSlots = 32;  // one slot per lane
static_assert(heuristics::kGemvDirectMaxSlots <= kDirectMaxSlots, "one routed slot per lane");
constexpr int kGroupedWarps = 4;      // v2's sweep: 4 warps per block, 3 blocks per SM
constexpr int kGroupedMinBlocks = 3;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// A gate row and its up row, C 16-byte chunks per lane (lane-strided) through `load`, every load
// issued before the first use: indices clamped into the row so that each issues unconditionally,
// chunks past the row's end zeroed after loading.
template <int C, typename Load>
__device__ __forceinline__ void load_gate_up_rows(const uint4* g, const uint4* u, int chunks, int lane, Load&& load,
                                                  uint4 (&gr)[C], uint4 (&ur)[C]) {
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int idx = min(c * 32 + lane, chunks - 1);
    gr[c] = load(g + idx);
    ur[c] = load(u + idx);
  }
#pragma unroll
  for (int c = 0; c < C; ++c)
    if (c * 32 + lane >= chunks) gr[c] = ur[c] = make_uint4(0, 0, 0, 0);
}

// R act values from R loaded gate rows and their up rows (block scales gsc[r], usc[r] where W
// has them) and the activation row xr: SiLU(gate . x) * (up . x) for each, handed to
// store(r, value) on lane 0. Each chunk of x is converted to f32 once for all 2R rows it meets
// (measured with the one-row FP8 items: qwen3-30b-a3b decode, H100, batch 3 +3.5% in bf16 and
// +3.0% in FP8, batch 1 +1% in FP8).
template <int R, int C, typename W, typename Store>
__device__ __forceinline__ void gate_up_act(const uint4 (&gr)[R][C], const uint4 (&ur)[R][C],
                                            const float* const (&gsc)[R], const float* const (&usc)[R],
                                            const uint4* xr, int chunks, int lane, Store&& store) {
  float gs[R], us[R];
#pragma unroll
  for (int r = 0; r < R; ++r) gs[r] = us[r] = 0.f;
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int idx = min(c * 32 + lane, chunks - 1);
    float xf[W::kValues];
    W::unpack_x(W::template load_x<true>(xr, idx), xf);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      if constexpr (W::kScaled) {
        gs[r] += W::scale(gsc[r], idx) * W::dot_f32(gr[r][c], xf);
        us[r] += W::scale(usc[r], idx) * W::dot_f32(ur[r][c], xf);
      } else {
        gs[r] += W::dot_f32(gr[r][c], xf);
        us[r] += W::dot_f32(ur[r][c], xf);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const float g = warp_sum(gs[r]), u = warp_sum(us[r]);
    if (lane == 0) store(r, __float2bfloat16(g / (1.f + __expf(-g)) * u));
  }
}

// The routed slots as one warp sees them, straight from the ids (lane s holds slot s's
// expert; no plan needed): the active experts, ascending, and each one's slots. All methods are
// warp-collective.
struct Routing {
  int id;    // -1 past the slots
  int head;  // 1 on the lowest slot of each expert
  int rank;  // of id among the distinct experts
  int count;

  __device__ Routing(const int* ids, int slots) {
    const int lane = threadIdx.x % 32;
    id = lane < slots ? __ldg(ids + lane) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, id);
    head = id >= 0 && lane == __ffs(peers) - 1;
    rank = 0;
#pragma unroll 4
    for (int s = 0; s < kDirectMaxSlots; ++s) {
      const int v = __shfl_sync(0xffffffffu, id, s), h = __shfl_sync(0xffffffffu, head, s);
      rank += h && v < id;
    }
    count = __popc(__ballot_sync(0xffffffffu, head));
  }
  __device__ int num_active() const { return count; }
  __device__ int expert(int a) const {
    const int src = __ffs(__ballot_sync(0xffffffffu, head && rank == a)) - 1;
    return __shfl_sync(0xffffffffu, id, src);
  }
  // f(slot) for each slot of e, the a-th active expert.
  template <typename F>
  __device__ void for_slots(int /*a*/, int e, F&& f) const {
    for (unsigned m = __ballot_sync(0xffffffffu, id == e); m != 0; m &= m - 1) f(__ffs(m) - 1);
  }
};

// The same for one token, whose k experts are distinct: every routed slot is its expert's only
// slot, so the a-th active expert is the a-th slot with a local expert (id >= 0), found with one
// ballot, and for_slots is a single call. (Were an expert repeated, its rows would be read once
// per slot: slower, still right.) Besides skipping the ranks' 32-step loop, the kernels
// built on it are straight-line code per item: 133 registers instead of 168 for gate_up at
// hidden 2048, every weight load in flight before the first use (lab/cuda/expert_stream_lab.cu,
// H100, qwen3-30b-a3b at M = 1: gate_up alone 21.6 -> 18.4 µs, the experts 33.4 -> 30.6 µs).
struct OneTokenRouting {
  int id;            // -1 past the slots or for another rank's expert
  int slot_of_rank;  // lane a: the slot of the a-th active expert
  int count;

  __device__ OneTokenRouting(const int* ids, int slots) {
    const int lane = threadIdx.x % 32;
    id = lane < slots ? __ldg(ids + lane) : -1;
    const unsigned valid = __ballot_sync(0xffffffffu, id >= 0);
    count = __popc(valid);
    slot_of_rank = lane < count ? static_cast<int>(__fns(valid, 0, lane + 1)) : 0;
  }
  __device__ int num_active() const { return count; }
  __device__ int expert(int a) const {
    return __shfl_sync(0xffffffffu, id, __shfl_sync(0xffffffffu, slot_of_rank, a));
  }
  __device__ int slot(int a) const { return __shfl_sync(0xffffffffu, slot_of_rank, a); }
  template <typename F>
  __device__ void for_slots(int a, int /*e*/, F&& f) const {
    f(slot(a));
  }
};

// Blocks a multiprocessor the persistent kernels below are compiled for (their register cap):
// kGemvMinBlocks (168 registers), or 4 (128) where the loads in flight fit 128 registers without
// spilling and the extra warps measured faster. gate_up for several tokens with at most 128
// bytes of a gate and an up row a lane (FP8 rows of hidden 2048: 4 chunks each): qwen3-30b-a3b-fp8
// decode batch 3 -1.6% (H200); at one token it measured 0.4% slower, and bf16's 256 bytes spill.
template <typename Route>
constexpr int gate_up_min_blocks(int chunks) {
  return std::is_same_v<Route, Routing> && 2 * chunks * 16 <= 128 ? 4 : kGemvMinBlocks;
}

// Persistent: warp w of the grid takes items w, w + warps, ...; item = (active expert, row j):
// the gate and up rows (C 16-byte chunks per lane each, all loads issued before the first use),
// applied to each of the expert's slots; act[slot, j] = bf16(SiLU(gate) * up). Consecutive warps
// take consecutive rows, so the whole grid streams one region of memory. FP8 rows too go one an
// item, though they are half the bytes: two rows an item (as many loads in flight as bf16's one)
// measured slower (qwen3-30b-a3b-fp8 decode, H100: batch 1 398 against 393 tokens/s, batch 3 745
// against 736; bench/gpu_fp8_decode_h100.md).
// C: 16-byte chunks of a row per lane; Route: Routing or OneTokenRouting; W: weight_rows.cuh.
template <int C, typename Route, typename W>
__global__ void __launch_bounds__(kGemvWarps * 32, gate_up_min_blocks<Route>(C)) gate_up_kernel(
    const __nv_bfloat16* __restrict__ x, const void* __restrict__ w_gate_up, const float* __restrict__ scales,
    const int* __restrict__ ids, int slots, int hidden, int inter, int top_k,
    __nv_bfloat16* __restrict__ act) {
  wait_for_predecessor();  // chained after the router, whose ids it reads
  allow_dependents();
  const Route route(ids, slots);
  const int lane = threadIdx.x % 32;
  const int chunks = hidden / W::kValues;
  const int total = route.num_active() * inter;
  for (int item = blockIdx.x * kGemvWarps + threadIdx.x / 32; item < total;
       item += gridDim.x * kGemvWarps) {
    const int e = route.expert(item / inter), j = item % inter;
    uint4 gr[1][C], ur[1][C];
    const uint4* g = W::row(w_gate_up, e, 2 * inter, j, hidden);
    load_gate_up_rows(g, g + (size_t)inter * chunks, chunks, lane, [](const uint4* p) { return load_stream(p); },
                      gr[0], ur[0]);
    const float* const gsc[1] = {W::row_scales(scales, e, 2 * inter, j, hidden)};
    const float* const usc[1] = {W::row_scales(scales, e, 2 * inter, inter + j, hidden)};
    route.for_slots(item / inter, e, [&](int s) {
      const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)(s / top_k) * hidden);
      gate_up_act<1, C, W>(gr, ur, gsc, usc, xr, chunks, lane,
                           [&](int, __nv_bfloat16 v) { act[(size_t)s * inter + j] = v; });
    });
  }
}

// Rows of down per warp item: 128 to 256 bytes of weights in flight per lane (8 to 16 loads of
// 16 bytes; past 96 bytes a row, two rows spill at the 168-register cap).
template <typename W>
constexpr int down_rows(int chunks) {
  const int bytes = chunks * static_cast<int>(sizeof(typename W::Chunk));
  return bytes <= 32 ? 8 : bytes <= 64 ? 4 : bytes <= 96 ? 2 : 1;
}

// down for one token over FP8 rows in 8-byte chunks (Fp8NarrowRows: 8 rows an item, 192 bytes a
// lane): 4 blocks a multiprocessor. qwen3-30b-a3b-fp8's 2048 items then run as one round on 2112
// resident warps instead of 1.3 rounds on 1584: decode batch 1 -1.4% (H200), with 40 bytes of
// spills. Several tokens (the routing's rank loop spills more at 128 registers) measured 0.7%
// slower, bf16's one-token rows unchanged, and wider FP8 rows spill 100 bytes.
template <typename Route, typename W>
constexpr int down_min_blocks() {
  return std::is_same_v<Route, OneTokenRouting> && sizeof(typename W::Chunk) == 8 ? 4 : kGemvMinBlocks;
}

// Persistent like gate_up; item = (active expert, R consecutive rows of down). The first item's
// weights are loaded before waiting for gate_up (they do not depend on it): that is what fills
// gate_up's tail. part[slot, h] = weight[slot] * (down[h] . act[slot]).
template <int C, typename Route, typename W>  // C: chunks of a down row per lane
__global__ void __launch_bounds__(kGemvWarps * 32, down_min_blocks<Route, W>()) down_kernel(
    const __nv_bfloat16* __restrict__ act, const void* __restrict__ w_down, const float* __restrict__ scales,
    const int* __restrict__ ids, int slots, const float* __restrict__ weights,
    int hidden, int inter, float* __restrict__ part) {
  constexpr int R = down_rows<W>(C);
  using Chunk = typename W::Chunk;
  allow_dependents();
  const Route route(ids, slots);
  const int lane = threadIdx.x % 32;
  const int chunks = inter / W::kValues;
  const int groups = (hidden + R - 1) / R;
  const int total = route.num_active() * groups;
  const int stride = gridDim.x * kGemvWarps;
  int item = blockIdx.x * kGemvWarps + threadIdx.x / 32;
  Chunk wr[R][C];
  auto load = [&](int it) {
    const int e = route.expert(it / groups), h0 = (it % groups) * R;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const Chunk* w = W::row(w_down, e, hidden, min(h0 + r, hidden - 1), inter);
#pragma unroll
      for (int c = 0; c < C; ++c) wr[r][c] = load_stream(w + min(c * 32 + lane, chunks - 1));
    }
  };
  if (item < total) load(item);
  wait_for_predecessor();  // act
  for (; item < total; item += stride) {
    if (item != blockIdx.x * kGemvWarps + threadIdx.x / 32) load(item);
    const int e = route.expert(item / groups), h0 = (item % groups) * R;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < C; ++c)
        if (c * 32 + lane >= chunks) wr[r][c] = Chunk{};
    route.for_slots(item / groups, e, [&](int s) {
      const uint4* ar = reinterpret_cast<const uint4*>(act + (size_t)s * inter);
      typename W::X av[C];
#pragma unroll
      for (int c = 0; c < C; ++c) av[c] = W::template load_x<false>(ar, min(c * 32 + lane, chunks - 1));  // plain: slot_sums.cuh
      float mine = 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float v = 0.f;
        const float* sc = W::row_scales(scales, e, hidden, min(h0 + r, hidden - 1), inter);
#pragma unroll
        for (int c = 0; c < C; ++c) {
          if constexpr (W::kScaled) v += W::scale(sc, min(c * 32 + lane, chunks - 1)) * W::dot(wr[r][c], av[c]);
          else v += W::dot(wr[r][c], av[c]);
        }
        v = warp_sum(v);
        if (lane == r) mine = v;
      }
      if (lane < R && h0 + lane < hidden) part[(size_t)s * hidden + h0 + lane] = __ldg(weights + s) * mine;
    });
  }
}

// Experts of one token whose down rows a lane holds at once in down_combine_kernel: about 192
// bytes of weights in flight per lane (qwen3-30b-a3b's inter 768 in bf16: 4 experts at 3 chunks
// of 16 bytes; in FP8's 8-byte chunks all 8 experts at 3), as in down_kernel, which keeps the
// kernel within 128 registers and 4 blocks per SM. 8 bf16 experts at a time (166 registers, 3
// blocks per SM, half the warps) measured slower: qwen3-30b-a3b at M = 1, the down projection
// alone (ncu) 15.6 against 14.3 µs, the layer 37.2 against 34.7.
template <typename W>
constexpr int combine_batch(int chunks) {
  const int b = 192 / (chunks * static_cast<int>(sizeof(typename W::Chunk)));
  return b < 1 ? 1 : b > 8 ? 8 : b;
}

// One token with the plain combine: down and the combine in one grid. Item = one row h of down,
// taken from every active expert (combine_batch(C) experts' rows in flight at a time); the lane's
// dot products are weighted and added in slot order, then summed across the warp once, and y[h]
// is stored. No partial sums leave the warp and no combine grid runs after it. Measured against
// down_kernel + combine_kernel (moe-bench layer --device cuda --tokens 1, H100, 2026-11-23), µs:
// qwen3-30b-a3b 35.6 -> 34.7, deepseek-v2-lite 46.0 -> 45.1. The first row's weights are loaded
// before the wait, like down_kernel's. Rows with no active expert come out 0.
template <int C, typename W>  // C: chunks of a down row per lane
__global__ void __launch_bounds__(kGemvWarps * 32, kDownCombineMinBlocks) down_combine_kernel(
    const __nv_bfloat16* __restrict__ act, const void* __restrict__ w_down, const float* __restrict__ scales,
    const int* __restrict__ ids, int slots, const float* __restrict__ weights, int hidden,
    int inter, __nv_bfloat16* __restrict__ y) {
  constexpr int B = combine_batch<W>(C);
  using Chunk = typename W::Chunk;
  allow_dependents();
  const OneTokenRouting route(ids, slots);
  const int n = route.num_active();
  const int lane = threadIdx.x % 32;
  const int chunks = inter / W::kValues;
  const int first = blockIdx.x * kGemvWarps + threadIdx.x / 32;
  Chunk wr[B][C];
  // Rows h of the active experts a0 .. a0 + B - 1 (past n: the last one again, not used).
  auto load = [&](int h, int a0) {
#pragma unroll
    for (int b = 0; b < B; ++b) {
      const int e = route.expert(min(a0 + b, n - 1));
      const Chunk* w = W::row(w_down, e, hidden, h, inter);
#pragma unroll
      for (int c = 0; c < C; ++c) wr[b][c] = load_stream(w + min(c * 32 + lane, chunks - 1));
    }
  };
  if (first < hidden && n > 0) load(first, 0);
  wait_for_predecessor();  // act
  for (int h = first; h < hidden; h += gridDim.x * kGemvWarps) {
    float mine = 0.f;
    for (int a0 = 0; a0 < n; a0 += B) {
      if (h != first || a0 > 0) load(h, a0);
#pragma unroll
      for (int b = 0; b < B; ++b)
#pragma unroll
        for (int c = 0; c < C; ++c)
          if (c * 32 + lane >= chunks) wr[b][c] = Chunk{};
      // Every expert of the batch is used unconditionally (past n: the last one again, weighted
      // 0): behind a branch per expert, the compiler sinks that expert's loads to their use, and
      // the row's loads go one expert after another (measured with 8 experts a batch, ncu: 23.3
      // µs against 15.6 for the down projection at M = 1).
#pragma unroll
      for (int b = 0; b < B; ++b) {
        const int slot = route.slot(min(a0 + b, n - 1));
        const uint4* ar = reinterpret_cast<const uint4*>(act + (size_t)slot * inter);
        const float* sc = W::row_scales(scales, route.expert(min(a0 + b, n - 1)), hidden, h, inter);
        float v = 0.f;
#pragma unroll
        for (int c = 0; c < C; ++c) {
          const int idx = min(c * 32 + lane, chunks - 1);
          const float d = W::dot(wr[b][c], W::template load_x<false>(ar, idx));  // plain load: slot_sums.cuh
          if constexpr (W::kScaled) v += W::scale(sc, idx) * d;
          else v += d;
        }
        mine += (a0 + b < n ? __ldg(weights + slot) : 0.f) * v;
      }
    }
    mine = warp_sum(mine);
    if (lane == 0) y[h] = __float2bfloat16(mine);
  }
}

// The register arrays need a compile-time size: one instantiation per count of chunks a
// lane holds of a row of `chunks`.
// FP8 rows of the widths the GEMV path takes (at most 2048) are at most 128 chunks: 4 a lane.
template <typename W, int kMax = 2048 / W::kValues / 32, int kC = 1, typename F>
cudaError_t with_chunks(int chunks, F&& f) {
  if constexpr (kC > kMax) {
    return cudaErrorInvalidValue;
  } else {
    if ((chunks + 31) / 32 == kC) return f(std::integral_constant<int, kC>{});
    return with_chunks<W, kMax, kC + 1>(chunks, f);
  }
}

// A persistent grid: enough blocks for the items, at most as many as fit on the device at once.
// The occupancy is asked once per kernel (a template argument: the instantiations share one
// function type, so a cache keyed by type would mix their register counts).
template <auto kKernel>
int persistent_blocks(long long items) {
  static const int per_sm = [] {
    int n = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kKernel, kGemvWarps * 32, 0) != cudaSuccess)
      n = 1;
    return n > 0 ? n : 1;
  }();
  int device = 0, sms = 1;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const long long wanted = (items + kGemvWarps - 1) / kGemvWarps;
  const long long cap = (long long)per_sm * sms;
  return (int)(wanted < cap ? (wanted > 0 ? wanted : 1) : cap);
}

// `chained`: a programmatic dependent of its predecessor (pdl.h), which may let it start early;
// it waits with griddepcontrol.wait before reading that kernel's output.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), int blocks, int threads, bool chained,
                   cudaStream_t stream, Args... args) {
  return launch_kernel(kernel, dim3(blocks), dim3(threads), 0, stream, chained, args...);
}

// One token's down projection and plain combine into y (down_combine_kernel).
template <typename W, int kMaxChunks = 2048 / W::kValues / 32>
cudaError_t launch_down_combine(const ExpertBuffers& b, const __nv_bfloat16* act, const int* ids, int slots,
                                const float* weights, void* y, cudaStream_t stream) {
  return with_chunks<W, kMaxChunks>(b.inter / W::kValues, [&](auto c) {
    constexpr auto k = down_combine_kernel<decltype(c)::value, W>;
    // As many warps as make whole rounds of rows: 2048 rows on 1584 resident warps would leave
    // a second round of 464.
    const int cap = persistent_blocks<k>(b.hidden) * kGemvWarps;
    const int rounds = (b.hidden + cap - 1) / cap;
    const int warps = (b.hidden + rounds - 1) / rounds;
    return launch(k, (warps + kGemvWarps - 1) / kGemvWarps, kGemvWarps * 32, true, stream, act, b.down,
                  b.down_scales, ids, slots, weights, b.hidden, b.inter, static_cast<__nv_bfloat16*>(y));
  });
}

// The down projection into the f32 partial sums by slot (down_kernel).
template <typename Route, typename W, int kMaxChunks = 2048 / W::kValues / 32>
cudaError_t launch_down(const ExpertBuffers& b, const __nv_bfloat16* act, const int* ids, int slots,
                        const float* weights, long long max_active, cudaStream_t stream) {
  return with_chunks<W, kMaxChunks>(b.inter / W::kValues, [&](auto c) {
    constexpr int C = decltype(c)::value;
    constexpr auto k = down_kernel<C, Route, W>;
    const long long groups = (b.hidden + down_rows<W>(C) - 1) / down_rows<W>(C);
    return launch(k, persistent_blocks<k>(max_active * groups), kGemvWarps * 32, true, stream, act, b.down,
                  b.down_scales, ids, slots, weights, b.hidden, b.inter, static_cast<float*>(b.part));
  });
}

// FP8 down rows of up to 1024 columns go in 8-byte chunks where 16-byte ones would leave more
// of the warp's lanes idle: qwen3-30b-a3b's 768 columns are 48 chunks of 16 bytes (lanes 16-31
// idle on their second) but 96 of 8 (3 a lane, every lane busy), which also lets all 8 experts'
// rows be in flight at once in down_combine_kernel (combine_batch) and 8 rows an item in
// down_kernel (down_rows). The share of lane slots a row fills, in each form:
// (Past 3 chunks a lane, 8-byte chunks never fill more: 97 to 128 of them are 49 to 64 of 16.)
constexpr int kNarrowMaxChunks = 3;
bool narrow_fills_more_lanes(int inter) {
  const int wide = inter / Fp8Rows::kValues, narrow = inter / Fp8NarrowRows::kValues;
  const int wide_slots = (wide + 31) / 32 * 32, narrow_slots = (narrow + 31) / 32 * 32;
  return narrow_slots <= kNarrowMaxChunks * 32 && (long long)narrow * wide_slots > (long long)wide * narrow_slots;
}

// `y` set (one token, the plain combine): down_combine_kernel writes y and no combine follows.
template <typename Route, typename W>
cudaError_t launch_direct_with(const ExpertBuffers& b, const void* x, const int* ids,
                               const float* weights, int tokens, void* y, cudaStream_t stream) {
  const int slots = tokens * b.top_k;
  const long long max_active = b.experts < slots ? b.experts : slots;
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  auto* act = static_cast<__nv_bfloat16*>(b.act);
  cudaError_t err = with_chunks<W>(b.hidden / W::kValues, [&](auto c) {
    constexpr auto k = gate_up_kernel<decltype(c)::value, Route, W>;
    return launch(k, persistent_blocks<k>(max_active * b.inter), kGemvWarps * 32, true, stream,
                  xb, b.gate_up, b.gate_up_scales, ids, slots, b.hidden, b.inter, b.top_k, act);
  });
  if (err != cudaSuccess) return err;
  if (y != nullptr) {
    if constexpr (std::is_same_v<W, Fp8Rows>) {
      if (narrow_fills_more_lanes(b.inter))
        return launch_down_combine<Fp8NarrowRows, kNarrowMaxChunks>(b, act, ids, slots, weights, y, stream);
    }
    return launch_down_combine<W>(b, act, ids, slots, weights, y, stream);
  }
  if constexpr (std::is_same_v<W, Fp8Rows>) {
    if (narrow_fills_more_lanes(b.inter))
      return launch_down<Route, Fp8NarrowRows, kNarrowMaxChunks>(b, act, ids, slots, weights, max_active, stream);
  }
  return launch_down<Route, W>(b, act, ids, slots, weights, max_active, stream);
}

// `y`: see launch_direct_with; only taken for one token (OneTokenRouting).
template <typename W>
cudaError_t launch_direct(const ExpertBuffers& b, const void* x, const int* ids,
                          const float* weights, int tokens, void* y, cudaStream_t stream) {
  return tokens == 1 ? launch_direct_with<OneTokenRouting, W>(b, x, ids, weights, tokens, y, stream)
                     : launch_direct_with<Routing, W>(b, x, ids, weights, tokens, nullptr, stream);
}

// Down rows a warp of grouped_down_kernel takes: FP8 rows are half the bytes of bf16 ones, so two
// a warp keep as many bytes in flight (qwen3-30b-a3b, the FP8 grouped GEMV, H100: M = 4 88.6 ->
// 84.2 µs, 8: 144.7 -> 136.5, 16: 241 -> 223). gate_up keeps one row a warp: two FP8 rows, with
// twice its 8 loads a lane, spilled 0.7 KB a thread at the 168-register cap.
template <typename W>
constexpr int grouped_rows() { return W::kScaled ? 2 : 1; }

// The grouped kernels' grid: blockIdx.x indexes the touched experts (blocks past their count
// exit), blockIdx.y a tile of kGroupedWarps * R weight rows, R per warp. Gives this warp's
// expert and first row, false where there is none.
template <int R>
__device__ __forceinline__ bool grouped_item(const int* active, const int* num_active, int rows, int& e, int& row) {
  if (blockIdx.x >= *num_active) return false;
  e = active[blockIdx.x];
  row = (blockIdx.y * kGroupedWarps + threadIdx.x / 32) * R;
  return row < rows;
}

// gate_up: one intermediate row a warp (its gate and up rows), as arrays of one row for
// gate_up_act.
template <int C, typename W>  // 16-byte chunks of a weight row per lane
__global__ void __launch_bounds__(kGroupedWarps * 32, kGroupedMinBlocks) grouped_gate_up_kernel(
    const __nv_bfloat16* __restrict__ x, const void* __restrict__ w_gate_up, const float* __restrict__ scales,
    const int* __restrict__ offsets, const int* __restrict__ order, const int* __restrict__ active,
    const int* __restrict__ num_active, int hidden, int inter, int top_k,
    __nv_bfloat16* __restrict__ act) {
  begin_dependent();  // the plan's
  int e, j;
  if (!grouped_item<1>(active, num_active, inter, e, j)) return;
  const int lane = threadIdx.x % 32;
  const int chunks = hidden / W::kValues;
  uint4 gr[1][C], ur[1][C];
  load_gate_up_rows(W::row(w_gate_up, e, 2 * inter, j, hidden), W::row(w_gate_up, e, 2 * inter, inter + j, hidden),
                    chunks, lane, [](const uint4* p) { return __ldg(p); }, gr[0], ur[0]);
  const float* const gsc[1] = {W::row_scales(scales, e, 2 * inter, j, hidden)};
  const float* const usc[1] = {W::row_scales(scales, e, 2 * inter, inter + j, hidden)};
  for (int p = offsets[e]; p < offsets[e + 1]; ++p) {
    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)(order[p] / top_k) * hidden);
    gate_up_act<1, C, W>(gr, ur, gsc, usc, xr, chunks, lane,
                         [&](int, __nv_bfloat16 v) { act[(size_t)p * inter + j] = v; });
  }
}

// down: grouped_rows<W>() output rows a warp, like gate_up.
template <int C, typename W>  // chunks of a down row per lane
__global__ void __launch_bounds__(kGroupedWarps * 32, kGroupedMinBlocks) grouped_down_kernel(
    const __nv_bfloat16* __restrict__ act, const void* __restrict__ w_down, const float* __restrict__ scales,
    const int* __restrict__ offsets, const int* __restrict__ order, const int* __restrict__ active,
    const int* __restrict__ num_active, const float* __restrict__ weights, int hidden, int inter,
    float* __restrict__ part) {
  constexpr int R = grouped_rows<W>();
  begin_dependent();  // gate_up's act
  int e, h0;
  if (!grouped_item<R>(active, num_active, hidden, e, h0)) return;
  const int lane = threadIdx.x % 32;
  const int chunks = inter / W::kValues;
  uint4 wr[R][C];
  const float* sc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int h = min(h0 + r, hidden - 1);
    const uint4* w = W::row(w_down, e, hidden, h, inter);
    sc[r] = W::row_scales(scales, e, hidden, h, inter);
#pragma unroll
    for (int c = 0; c < C; ++c) wr[r][c] = __ldg(w + min(c * 32 + lane, chunks - 1));
  }
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int c = 0; c < C; ++c)
      if (c * 32 + lane >= chunks) wr[r][c] = make_uint4(0, 0, 0, 0);
  for (int p = offsets[e]; p < offsets[e + 1]; ++p) {
    const int slot = order[p];
    const uint4* ar = reinterpret_cast<const uint4*>(act + (size_t)p * inter);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      float s = 0.f;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int idx = min(c * 32 + lane, chunks - 1);
        const float d = W::dot(wr[r][c], W::template load_x<true>(ar, idx));
        if constexpr (W::kScaled) s += W::scale(sc[r], idx) * d;
        else s += d;
      }
      s = warp_sum(s);
      if (lane == 0 && h0 + r < hidden) part[(size_t)slot * hidden + h0 + r] = weights[slot] * s;
    }
  }
}

template <int C, typename W>
void launch_grouped_gate_up(dim3 grid, cudaStream_t stream, const __nv_bfloat16* x, const ExpertBuffers& b,
                    __nv_bfloat16* act) {
  launch_dependent(grouped_gate_up_kernel<C, W>, grid, dim3(kGroupedWarps * 32), 0, stream, x, b.gate_up,
                   b.gate_up_scales, b.offsets, b.order, b.active, b.num_active, b.hidden, b.inter, b.top_k, act);
}

template <int C, typename W>
void launch_grouped_down(dim3 grid, cudaStream_t stream, const __nv_bfloat16* act, const float* weights,
                 const ExpertBuffers& b) {
  launch_dependent(grouped_down_kernel<C, W>, grid, dim3(kGroupedWarps * 32), 0, stream, act, b.down,
                   b.down_scales, b.offsets, b.order, b.active, b.num_active, weights, b.hidden, b.inter,
                   static_cast<float*>(b.part));
}

// Past heuristics::gemv_direct_max_slots: the plan, then one short block per (touched expert, 4
// rows), the v2 of docs/perf/decode-expert-gemv.md. The persistent kernels above, fed by the plan
// instead of the ids, ran 5-15% slower here (each item's expert, offsets and slot list cost
// dependent L2 round trips before its weight loads could issue; docs/perf/decode-direct-gemv.md).
template <typename W>
cudaError_t launch_grouped(const ExpertBuffers& b, const void* x, const float* weights, int tokens,
                           cudaStream_t stream) {
  const int slots = tokens * b.top_k;
  const int max_active = b.experts < slots ? b.experts : slots;
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  auto* act = static_cast<__nv_bfloat16*>(b.act);
  const int down_tile = kGroupedWarps * grouped_rows<W>();
  const dim3 gate_up_grid(max_active, (b.inter + kGroupedWarps - 1) / kGroupedWarps);
  const dim3 down_grid(max_active, (b.hidden + down_tile - 1) / down_tile);
  with_chunks<W>(b.hidden / W::kValues, [&](auto c) {
    launch_grouped_gate_up<decltype(c)::value, W>(gate_up_grid, stream, xb, b, act);
    return cudaSuccess;
  });
  with_chunks<W>(b.inter / W::kValues, [&](auto c) {
    launch_grouped_down<decltype(c)::value, W>(down_grid, stream, act, weights, b);
    return cudaSuccess;
  });
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_decode(const ExpertBuffers& b, const void* x, const int* ids,
                          const float* weights, int tokens, void* y, cudaStream_t stream) {
  const bool fp8 = b.gate_up_scales != nullptr;
  // FP8 rows: 16 codes a chunk, and 128 x 128 scale blocks that gate_up's halves start on.
  if (fp8 && (b.down_scales == nullptr || b.hidden % 16 != 0 || b.inter % Fp8Rows::kBlock != 0))
    return cudaErrorInvalidValue;
  cudaError_t err;
  if (tokens * b.top_k <= heuristics::gemv_direct_max_slots(fp8)) {
    // One token with the plain combine: down and the combine are one grid (down_combine_kernel).
    const bool fused = tokens == 1 && b.leave_partials == nullptr && b.norm.x == nullptr;
    void* out = fused ? y : nullptr;
    err = fp8 ? launch_direct<Fp8Rows>(b, x, ids, weights, tokens, out, stream)
              : launch_direct<Bf16Rows>(b, x, ids, weights, tokens, out, stream);
    if (err != cudaSuccess || fused) return err;
  } else {
    err = launch_plan(b, ids, tokens, 0, stream);
    if (err == cudaSuccess)
      err = fp8 ? launch_grouped<Fp8Rows>(b, x, weights, tokens, stream)
                : launch_grouped<Bf16Rows>(b, x, weights, tokens, stream);
  }
  if (err != cudaSuccess) return err;
  if (b.leave_partials) {
    *b.leave_partials = PartialSums{false};
    return cudaSuccess;
  }
  return launch_combine(b, ids, tokens, PartialSums{false, 1, 0, true}, y, stream);
}

}  // namespace moe::cuda::kernels
