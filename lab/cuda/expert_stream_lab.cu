// Kernel lab: where the decode path's persistent expert GEMV (src/backend/cuda/moe/moe_decode.cu,
// included below, so that the baseline is the library's own code) loses time at M = 1.
//
// Measured before (ncu, H100, qwen3-30b-a3b at M = 1): gate_up read 50.3 MB in 23.8 µs, down
// 25.2 MB in 13.4 µs, against ~2.96 TB/s for a long dense GEMV stream.
//
// Variants of a whole layer (gate_up, down, the library's combine, chained by programmatic
// dependent launch; 8 layers with their own weights and their own 8 distinct experts, in one
// graph), partial sums compared bit for bit with the library's general kernels:
//   one token                 the library's OneTokenRouting kernels (what the engine runs at M = 1)
//   fast routing              the active experts' ranks in O(1) (lane order) instead of a loop
//   gate_up pipe<N>           item i+1's weight loads issued before item i's math, N blocks/SM
//   gate_up halves<N>         an item in two half-row stages, one in flight while the other is
//                             reduced (M = 1 only)
//   down pipe<N>              down's rows double-buffered the same way
// and gate_up alone, chained: the library's, with the expert list known (no routing), with a
// non-persistent grid, fast routing, one token, and a dense GEMV over the same bytes.
//
// Results and what was taken from them: docs/perf/one-token-expert-kernels.md.
//
// Build: cmake -DMOE_BUILD_LAB=ON, target lab_expert_stream; or by hand from the repository root:
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Isrc \
//     -Iinclude -o /tmp/expert_stream_lab lab/cuda/expert_stream_lab.cu src/backend/cuda/moe/moe_plan.cu
// Run:   /tmp/expert_stream_lab
#include "backend/cuda/moe/moe_decode.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace moe::cuda::kernels {
namespace {

#define CHECK(x)                                                                                 \
  do {                                                                                           \
    cudaError_t err_ = (x);                                                                      \
    if (err_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

template <int C>
struct GateUpItem {
  uint4 g[C], u[C];
  __device__ void load(const __nv_bfloat16* w_gate_up, const Routing& route, int item, int inter,
                       int hidden) {
    const int lane = threadIdx.x % 32, chunks = hidden / 8;
    const int e = route.expert(item / inter), j = item % inter;
    const uint4* gp = reinterpret_cast<const uint4*>(w_gate_up + ((size_t)e * 2 * inter + j) * hidden);
    const uint4* up = gp + (size_t)inter * chunks;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int idx = min(c * 32 + lane, chunks - 1);
      g[c] = load_stream(gp + idx);
      u[c] = load_stream(up + idx);
    }
  }
  __device__ void apply(const __nv_bfloat16* x, const Routing& route, int item, int inter,
                        int hidden, int top_k, __nv_bfloat16* act) {
    const int lane = threadIdx.x % 32, chunks = hidden / 8;
    const int e = route.expert(item / inter), j = item % inter;
#pragma unroll
    for (int c = 0; c < C; ++c)
      if (c * 32 + lane >= chunks) g[c] = u[c] = make_uint4(0, 0, 0, 0);
    route.for_slots(item / inter, e, [&](int s) {
      const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)(s / top_k) * hidden);
      float gs = 0.f, us = 0.f;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const uint4 xv = __ldg(xr + min(c * 32 + lane, chunks - 1));
        gs += dot8(g[c], xv);
        us += dot8(u[c], xv);
      }
      gs = warp_sum(gs);
      us = warp_sum(us);
      if (lane == 0) act[(size_t)s * inter + j] = __float2bfloat16(gs / (1.f + __expf(-gs)) * us);
    });
  }
};

template <int C, int MinBlocks>
__global__ void __launch_bounds__(kGemvWarps * 32, MinBlocks) gate_up_pipe(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_gate_up,
    const int* __restrict__ ids, int slots, int hidden, int inter, int top_k,
    __nv_bfloat16* __restrict__ act) {
  wait_for_predecessor();
  allow_dependents();
  const Routing route(ids, slots);
  const int total = route.num_active() * inter;
  const int stride = gridDim.x * kGemvWarps;
  int item = blockIdx.x * kGemvWarps + threadIdx.x / 32;
  GateUpItem<C> a, b;
  if (item < total) a.load(w_gate_up, route, item, inter, hidden);
  while (item < total) {
    if (item + stride < total) b.load(w_gate_up, route, item + stride, inter, hidden);
    a.apply(x, route, item, inter, hidden, top_k, act);
    item += stride;
    if (item >= total) break;
    if (item + stride < total) a.load(w_gate_up, route, item + stride, inter, hidden);
    b.apply(x, route, item, inter, hidden, top_k, act);
    item += stride;
  }
}

// Half-row stages: stage (item, 0) = chunks [0, C/2) of gate and up, (item, 1) = [C/2, C).
template <int C, int MinBlocks>
__global__ void __launch_bounds__(kGemvWarps * 32, MinBlocks) gate_up_halves(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_gate_up,
    const int* __restrict__ ids, int slots, int hidden, int inter, int top_k,
    __nv_bfloat16* __restrict__ act) {
  static_assert(C % 2 == 0, "two halves");
  constexpr int H = C / 2;
  wait_for_predecessor();
  allow_dependents();
  const Routing route(ids, slots);
  const int lane = threadIdx.x % 32, chunks = hidden / 8;
  const int total = route.num_active() * inter;
  const int stride = gridDim.x * kGemvWarps;
  int item = blockIdx.x * kGemvWarps + threadIdx.x / 32;
  uint4 g0[H], u0[H], g1[H], u1[H];
  auto load = [&](uint4 (&g)[H], uint4 (&u)[H], int it, int half) {
    const int e = route.expert(it / inter), j = it % inter;
    const uint4* gp = reinterpret_cast<const uint4*>(w_gate_up + ((size_t)e * 2 * inter + j) * hidden);
    const uint4* up = gp + (size_t)inter * chunks;
#pragma unroll
    for (int c = 0; c < H; ++c) {
      const int idx = min((half * H + c) * 32 + lane, chunks - 1);
      g[c] = load_stream(gp + idx);
      u[c] = load_stream(up + idx);
    }
  };
  if (item < total) load(g0, u0, item, 0);
  while (item < total) {
    const int e = route.expert(item / inter), j = item % inter;
    load(g1, u1, item, 1);
    // Partial dot products of the first half, per slot of this expert (at most 32 slots: kept
    // as a lane-indexed value, lane s holding slot s's sums).
    float pg = 0.f, pu = 0.f;
    route.for_slots(item / inter, e, [&](int s) {
      const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)(s / top_k) * hidden);
      float gs = 0.f, us = 0.f;
#pragma unroll
      for (int c = 0; c < H; ++c) {
        const int cc = c * 32 + lane;
        const uint4 xv = __ldg(xr + min(cc, chunks - 1));
        if (cc < chunks) gs += dot8(g0[c], xv), us += dot8(u0[c], xv);
      }
      // Keep the per-lane partials of slot s in lane-private registers: one slot per expert at
      // M = 1, so a single accumulator pair suffices there; more slots fall back below.
      pg = gs, pu = us;
      (void)s;
    });
    const int next = item + stride;
    if (next < total) load(g0, u0, next, 0);
    const unsigned mine = __ballot_sync(0xffffffffu, route.id == e);
    if (__popc(mine) == 1) {
      const int s = __ffs(mine) - 1;
      const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)(s / top_k) * hidden);
      float gs = pg, us = pu;
#pragma unroll
      for (int c = 0; c < H; ++c) {
        const int cc = (H + c) * 32 + lane;
        const uint4 xv = __ldg(xr + min(cc, chunks - 1));
        if (cc < chunks) gs += dot8(g1[c], xv), us += dot8(u1[c], xv);
      }
      gs = warp_sum(gs);
      us = warp_sum(us);
      if (lane == 0) act[(size_t)s * inter + j] = __float2bfloat16(gs / (1.f + __expf(-gs)) * us);
    }
    item = next;
  }
}

template <int C>
struct DownItem {
  static constexpr int R = down_rows(C);
  uint4 w[R][C];
  __device__ void load(const __nv_bfloat16* w_down, const Routing& route, int it, int groups,
                       int hidden, int inter) {
    const int lane = threadIdx.x % 32, chunks = inter / 8;
    const int e = route.expert(it / groups), h0 = (it % groups) * R;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const uint4* p = reinterpret_cast<const uint4*>(w_down + ((size_t)e * hidden + min(h0 + r, hidden - 1)) * inter);
#pragma unroll
      for (int c = 0; c < C; ++c) w[r][c] = load_stream(p + min(c * 32 + lane, chunks - 1));
    }
  }
  __device__ void apply(const __nv_bfloat16* act, const Routing& route, int it, int groups,
                        int hidden, int inter, const float* weights, float* part) {
    const int lane = threadIdx.x % 32, chunks = inter / 8;
    const int e = route.expert(it / groups), h0 = (it % groups) * R;
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int c = 0; c < C; ++c)
        if (c * 32 + lane >= chunks) w[r][c] = make_uint4(0, 0, 0, 0);
    route.for_slots(it / groups, e, [&](int s) {
      const uint4* ar = reinterpret_cast<const uint4*>(act + (size_t)s * inter);
      uint4 av[C];
#pragma unroll
      for (int c = 0; c < C; ++c) av[c] = __ldcg(ar + min(c * 32 + lane, chunks - 1));
      float mine = 0.f;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        float v = 0.f;
#pragma unroll
        for (int c = 0; c < C; ++c) v += dot8(w[r][c], av[c]);
        v = warp_sum(v);
        if (lane == r) mine = v;
      }
      if (lane < R && h0 + lane < hidden) part[(size_t)s * hidden + h0 + lane] = __ldg(weights + s) * mine;
    });
  }
};

template <int C, int MinBlocks>
__global__ void __launch_bounds__(kGemvWarps * 32, MinBlocks) down_pipe(
    const __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ w_down,
    const int* __restrict__ ids, int slots, const float* __restrict__ weights, int hidden,
    int inter, float* __restrict__ part) {
  allow_dependents();
  const Routing route(ids, slots);
  constexpr int R = DownItem<C>::R;
  const int groups = (hidden + R - 1) / R;
  const int total = route.num_active() * groups;
  const int stride = gridDim.x * kGemvWarps;
  int item = blockIdx.x * kGemvWarps + threadIdx.x / 32;
  DownItem<C> a, b;
  if (item < total) a.load(w_down, route, item, groups, hidden, inter);
  if (item + stride < total) b.load(w_down, route, item + stride, groups, hidden, inter);
  wait_for_predecessor();  // act
  while (item < total) {
    a.apply(act, route, item, groups, hidden, inter, weights, part);
    item += stride;
    if (item >= total) break;
    if (item + stride < total) a.load(w_down, route, item + stride, groups, hidden, inter);
    b.apply(act, route, item, groups, hidden, inter, weights, part);
    item += stride;
    if (item + stride < total) b.load(w_down, route, item + stride, groups, hidden, inter);
  }
}

// Phase variants, timed alone (a chain of one kernel per layer):
// the library's gate_up with the routing replaced by a known expert list (ids sorted, one slot
// per expert: what the routing costs), the same grid non-persistent (one item per warp), and a
// dense GEMV over the same bytes (the first 8 experts' gate_up rows as one matrix, 4 warps x 4
// rows, streaming loads: what a plain stream of those bytes costs).
template <int C>
__global__ void __launch_bounds__(kGemvWarps * 32, kGemvMinBlocks) gate_up_known(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_gate_up,
    const int* __restrict__ ids, int slots, int hidden, int inter, int top_k,
    __nv_bfloat16* __restrict__ act) {
  wait_for_predecessor();
  allow_dependents();
  const int lane = threadIdx.x % 32;
  const int chunks = hidden / 8;
  const int total = slots * inter;
  for (int item = blockIdx.x * kGemvWarps + threadIdx.x / 32; item < total;
       item += gridDim.x * kGemvWarps) {
    const int s = item / inter, j = item % inter;
    const int e = __ldg(ids + s);
    const uint4* g = reinterpret_cast<const uint4*>(w_gate_up + ((size_t)e * 2 * inter + j) * hidden);
    const uint4* u = g + (size_t)inter * chunks;
    uint4 gr[C], ur[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int idx = min(c * 32 + lane, chunks - 1);
      gr[c] = load_stream(g + idx);
      ur[c] = load_stream(u + idx);
    }
    const uint4* xr = reinterpret_cast<const uint4*>(x);
    float gs = 0.f, us = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const uint4 xv = __ldg(xr + min(c * 32 + lane, chunks - 1));
      gs += dot8(gr[c], xv);
      us += dot8(ur[c], xv);
    }
    gs = warp_sum(gs);
    us = warp_sum(us);
    if (lane == 0) act[(size_t)s * inter + j] = __float2bfloat16(gs / (1.f + __expf(-gs)) * us);
  }
}

template <int C>
__global__ void __launch_bounds__(kGemvWarps * 32, kGemvMinBlocks) gate_up_flat(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_gate_up,
    const int* __restrict__ ids, int slots, int hidden, int inter, int top_k,
    __nv_bfloat16* __restrict__ act) {
  wait_for_predecessor();
  allow_dependents();
  const Routing route(ids, slots);
  const int item = blockIdx.x * kGemvWarps + threadIdx.x / 32;
  if (item >= route.num_active() * inter) return;
  GateUpItem<C> a;
  a.load(w_gate_up, route, item, inter, hidden);
  a.apply(x, route, item, inter, hidden, top_k, act);
}

__global__ void __launch_bounds__(128) dense_4x4(const __nv_bfloat16* __restrict__ x_,
                                                 const __nv_bfloat16* __restrict__ w_, const int*, int,
                                                 int hidden, int rows, int, __nv_bfloat16* __restrict__ y) {
  wait_for_predecessor();
  allow_dependents();
  const uint4* x = reinterpret_cast<const uint4*>(x_);
  const uint4* w = reinterpret_cast<const uint4*>(w_);
  const int k8 = hidden / 8;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = (blockIdx.x * 4 + warp) * 4;
  if (row0 >= rows) return;
  float acc[4] = {};
  for (int base = lane; base < k8; base += 128) {
    uint4 wv[4][4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int r = 0; r < 4; ++r) wv[r][u] = load_stream(w + (size_t)(row0 + r) * k8 + base + 32 * u);
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const uint4 xv = __ldg(x + base + 32 * u);
#pragma unroll
      for (int r = 0; r < 4; ++r) acc[r] += dot8(wv[r][u], xv);
    }
  }
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    const float v = warp_sum(acc[r]);
    if (lane == 0) y[row0 + r] = __float2bfloat16(v);
  }
}

// The routing with the active experts in lane order instead of ascending: O(1) per warp (one
// ballot, a find-n-th-set-bit and one shuffle) instead of a 32-step shuffle loop for the ranks.
// Which warp takes which expert changes no result (act and part are by slot). Plugged into the
// library's kernels as their Route.
struct FastRouting {
  int id;
  int by_rank;  // lane a: the a-th active expert
  int count;
  __device__ FastRouting(const int* ids, int slots) {
    const int lane = threadIdx.x % 32;
    id = lane < slots ? __ldg(ids + lane) : -1;
    const unsigned peers = __match_any_sync(0xffffffffu, id);
    const bool head = id >= 0 && lane == __ffs(peers) - 1;
    const unsigned heads = __ballot_sync(0xffffffffu, head);
    count = __popc(heads);
    const int src = lane < count ? (int)__fns(heads, 0, lane + 1) : 0;
    by_rank = __shfl_sync(0xffffffffu, id, src);
  }
  __device__ int num_active() const { return count; }
  __device__ int expert(int a) const { return __shfl_sync(0xffffffffu, by_rank, a); }
  template <typename F>
  __device__ void for_slots(int /*a*/, int e, F&& f) const {
    for (unsigned m = __ballot_sync(0xffffffffu, id == e); m != 0; m &= m - 1) f(__ffs(m) - 1);
  }
};

template <typename K>
int grid_of(K kernel) {
  int n = 0, sms = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, kGemvWarps * 32, 0));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  return n * sms;
}

struct Shape {
  const char* name;
  int experts, hidden, inter, top_k;
};

using GateUpFn = void (*)(const __nv_bfloat16*, const __nv_bfloat16*, const int*, int, int, int, int,
                          __nv_bfloat16*);
using DownFn = void (*)(const __nv_bfloat16*, const __nv_bfloat16*, const int*, int, const float*, int,
                        int, float*);

struct Variant {
  const char* name;
  GateUpFn gate_up;
  DownFn down;
};

struct LayerBufs {
  __nv_bfloat16 *gate_up, *down;
  int* ids;
};

__global__ void fill(__nv_bfloat16* p, size_t n, unsigned seed) {
  for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    unsigned h = (unsigned)i * 2654435761u ^ seed;
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    p[i] = __float2bfloat16(((h & 0xffff) / 65536.f - 0.5f) * 0.1f);
  }
}

constexpr int kLayers = 8;

double run(const Shape& sh, const Variant& v, std::vector<LayerBufs>& L, const __nv_bfloat16* x,
           const float* weights, __nv_bfloat16* act, float* part, __nv_bfloat16* y,
           std::vector<float>* out_part) {
  const int slots = sh.top_k;  // M = 1
  const int gu_grid = grid_of(v.gate_up), dn_grid = grid_of(v.down);
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  auto layer = [&](const LayerBufs& l) {
    CHECK(launch_kernel(v.gate_up, dim3(gu_grid), dim3(kGemvWarps * 32), 0, s, true, x,
                        (const __nv_bfloat16*)l.gate_up, (const int*)l.ids, slots, sh.hidden, sh.inter,
                        sh.top_k, act));
    CHECK(launch_kernel(v.down, dim3(dn_grid), dim3(kGemvWarps * 32), 0, s, true,
                        (const __nv_bfloat16*)act, (const __nv_bfloat16*)l.down, (const int*)l.ids,
                        slots, weights, sh.hidden, sh.inter, part));
    CHECK(launch_kernel(combine_kernel<float, false>, dim3((sh.hidden / 8 + 255) / 256), dim3(256), 0, s,
                        true, (const float*)part, (const int*)l.ids, 1, sh.top_k, sh.hidden, 1, 0LL, y));
  };
  if (out_part) {  // eager, layer 0, poisoned outputs first
    CHECK(cudaMemset(part, 0xff, (size_t)slots * sh.hidden * 4));
    CHECK(cudaMemset(act, 0xff, (size_t)slots * sh.inter * 2));
    layer(L[0]);
    CHECK(cudaStreamSynchronize(s));
    out_part->resize((size_t)slots * sh.hidden);
    CHECK(cudaMemcpy(out_part->data(), part, out_part->size() * 4, cudaMemcpyDeviceToHost));
  }
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int l = 0; l < kLayers; ++l) layer(L[(size_t)l]);
  CHECK(cudaStreamEndCapture(s, &g));
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 3; ++i) CHECK(cudaGraphLaunch(ge, s));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  constexpr int kReplays = 30;
  CHECK(cudaEventRecord(t0, s));
  for (int i = 0; i < kReplays; ++i) CHECK(cudaGraphLaunch(ge, s));
  CHECK(cudaEventRecord(t1, s));
  CHECK(cudaEventSynchronize(t1));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, t0, t1));
  CHECK(cudaGraphExecDestroy(ge));
  CHECK(cudaGraphDestroy(g));
  CHECK(cudaStreamDestroy(s));
  return ms * 1e3 / (kReplays * kLayers);
}

// gate_up kernels alone, one per layer, chained; grid: 0 = persistent (occupancy), else blocks.
double time_gate_up(const Shape& sh, GateUpFn k, int grid, int inter_arg, std::vector<LayerBufs>& L,
                    const __nv_bfloat16* x, __nv_bfloat16* act) {
  if (grid == 0) grid = grid_of(k);
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int l = 0; l < kLayers; ++l)
    CHECK(launch_kernel(k, dim3(grid), dim3(kGemvWarps * 32), 0, s, true, x,
                        (const __nv_bfloat16*)L[(size_t)l].gate_up, (const int*)L[(size_t)l].ids, sh.top_k,
                        sh.hidden, inter_arg, sh.top_k, act));
  CHECK(cudaStreamEndCapture(s, &g));
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  for (int i = 0; i < 3; ++i) CHECK(cudaGraphLaunch(ge, s));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  CHECK(cudaEventRecord(t0, s));
  for (int i = 0; i < 30; ++i) CHECK(cudaGraphLaunch(ge, s));
  CHECK(cudaEventRecord(t1, s));
  CHECK(cudaEventSynchronize(t1));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, t0, t1));
  CHECK(cudaGraphExecDestroy(ge));
  CHECK(cudaGraphDestroy(g));
  CHECK(cudaStreamDestroy(s));
  return ms * 1e3 / (30 * kLayers);
}

template <int CG, int CD>
void bench(const Shape& sh) {
  std::printf("\n%s: experts %d, hidden %d, inter %d, top-%d, M = 1\n", sh.name, sh.experts, sh.hidden,
              sh.inter, sh.top_k);
  std::vector<LayerBufs> L(kLayers);
  std::mt19937 rng(7);
  for (int l = 0; l < kLayers; ++l) {
    const size_t gu = (size_t)sh.experts * 2 * sh.inter * sh.hidden, dn = (size_t)sh.experts * sh.hidden * sh.inter;
    CHECK(cudaMalloc(&L[l].gate_up, gu * 2));
    CHECK(cudaMalloc(&L[l].down, dn * 2));
    fill<<<1024, 256>>>(L[l].gate_up, gu, 17u * l + 1);
    fill<<<1024, 256>>>(L[l].down, dn, 17u * l + 2);
    std::vector<int> e(sh.experts);
    for (int i = 0; i < sh.experts; ++i) e[i] = i;
    std::shuffle(e.begin(), e.end(), rng);
    CHECK(cudaMalloc(&L[l].ids, sh.top_k * 4));
    CHECK(cudaMemcpy(L[l].ids, e.data(), sh.top_k * 4, cudaMemcpyHostToDevice));
  }
  __nv_bfloat16 *x, *act, *y;
  float *weights, *part;
  CHECK(cudaMalloc(&x, sh.hidden * 2));
  fill<<<8, 256>>>(x, sh.hidden, 99);
  std::vector<float> wh(sh.top_k, 1.0f / sh.top_k);
  CHECK(cudaMalloc(&weights, sh.top_k * 4));
  CHECK(cudaMemcpy(weights, wh.data(), sh.top_k * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&act, (size_t)sh.top_k * sh.inter * 2 * 2));  // x2: the dense variant writes gate and up rows
  CHECK(cudaMalloc(&part, (size_t)sh.top_k * sh.hidden * 4));
  CHECK(cudaMalloc(&y, sh.hidden * 2));
  CHECK(cudaDeviceSynchronize());
  const double bytes = (double)sh.top_k * 3 * sh.inter * sh.hidden * 2;
  std::printf("floor (%.1f MB at 3.0 TB/s): %.1f us\n", bytes / 1e6, bytes / 3.0e12 * 1e6);
  const Variant vs[] = {
      {"library", gate_up_kernel<CG, Routing>, down_kernel<CD, Routing>},
      {"fast routing", gate_up_kernel<CG, FastRouting>, down_kernel<CD, FastRouting>},
      {"one token", gate_up_kernel<CG, OneTokenRouting>, down_kernel<CD, OneTokenRouting>},
      {"one token gate_up only", gate_up_kernel<CG, OneTokenRouting>, down_kernel<CD, Routing>},
      {"gate_up pipe<3>", gate_up_pipe<CG, 3>, down_kernel<CD, Routing>},
      {"gate_up pipe<2>", gate_up_pipe<CG, 2>, down_kernel<CD, Routing>},
      {"gate_up halves<3>", gate_up_halves<CG, 3>, down_kernel<CD, Routing>},
      {"gate_up halves<4>", gate_up_halves<CG, 4>, down_kernel<CD, Routing>},
      {"down pipe<3>", gate_up_kernel<CG, Routing>, down_pipe<CD, 3>},
      {"down pipe<2>", gate_up_kernel<CG, Routing>, down_pipe<CD, 2>},
      {"pipe<3> + down pipe<3>", gate_up_pipe<CG, 3>, down_pipe<CD, 3>},
      {"halves<4> + down pipe<3>", gate_up_halves<CG, 4>, down_pipe<CD, 3>},
  };
  {
    const double gb = (double)sh.top_k * 2 * sh.inter * sh.hidden * 2;
    std::printf("gate_up alone (%.1f MB, floor %.1f us at 3.0 TB/s):\n", gb / 1e6, gb / 3.0e12 * 1e6);
    const int flat = (sh.top_k * sh.inter + kGemvWarps - 1) / kGemvWarps;
    const int dense = (sh.top_k * 2 * sh.inter + 15) / 16;
    for (int rep = 0; rep < 2; ++rep) {
      std::printf("  library             %7.2f us\n", time_gate_up(sh, gate_up_kernel<CG, Routing>, 0, sh.inter, L, x, act));
      std::printf("  known experts       %7.2f us\n", time_gate_up(sh, gate_up_known<CG>, 0, sh.inter, L, x, act));
      std::printf("  non-persistent      %7.2f us\n", time_gate_up(sh, gate_up_flat<CG>, flat, sh.inter, L, x, act));
      std::printf("  fast routing        %7.2f us\n", time_gate_up(sh, gate_up_kernel<CG, FastRouting>, 0, sh.inter, L, x, act));
      std::printf("  one token           %7.2f us\n", time_gate_up(sh, gate_up_kernel<CG, OneTokenRouting>, 0, sh.inter, L, x, act));
      std::printf("  dense 4x4 same bytes%7.2f us\n", time_gate_up(sh, dense_4x4, dense, sh.top_k * 2 * sh.inter, L, x, act));
    }
  }
  std::vector<float> ref;
  for (int rep = 0; rep < 2; ++rep)
    for (const Variant& v : vs) {
      std::vector<float> got;
      const double us = run(sh, v, L, x, weights, act, part, y, rep == 0 ? &got : nullptr);
      const char* check = "";
      if (rep == 0) {
        if (ref.empty()) ref = got;
        check = std::memcmp(ref.data(), got.data(), ref.size() * 4) == 0 ? "bits equal" : "DIFFERS";
      }
      std::printf("  %-26s grids %4d/%4d  %7.2f us  %s\n", v.name, grid_of(v.gate_up), grid_of(v.down), us, check);
    }
  for (auto& l : L) cudaFree(l.gate_up), cudaFree(l.down), cudaFree(l.ids);
  cudaFree(x), cudaFree(act), cudaFree(y), cudaFree(weights), cudaFree(part);
}

}  // namespace
}  // namespace moe::cuda::kernels

int main() {
  using namespace moe::cuda::kernels;
  cudaDeviceProp p;
  CHECK(cudaGetDeviceProperties(&p, 0));
  std::printf("%s, %d SMs\n", p.name, p.multiProcessorCount);
  bench<8, 3>({"qwen3-30b-a3b", 128, 2048, 768, 8});
  bench<8, 6>({"deepseek-v2-lite", 64, 2048, 1408, 6});
  return 0;
}
