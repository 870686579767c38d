// Kernel lab: the one-token expert GEMVs (M = 1) with their weights brought into shared memory
// by bulk copies (cp.async.bulk, completing on mbarriers) instead of 16-byte loads into
// registers.
//
// Why: under ncu the library's one-token kernels stream at 70-73% (gate_up) and 50-54%
// (down_combine) of DRAM peak. A warp can hold only ~12-16 loads of 16 bytes in flight within
// its register budget, and issues the next batch only after the previous one's math. A bulk copy
// costs one instruction and no registers: a block can keep 100-200 KB of weights in flight while
// its warps reduce what has landed.
//
//  - gate_up_bulk: each block takes a contiguous range of the flattened (active expert, row)
//    items; chunks of up to kRows gate rows and the matching up rows go through a ring of
//    shared-memory stages; warp w reduces chunk rows w, w + warps, ... exactly as the library's
//    warp reduces one item (same lane split, same order: the act values are bit-equal).
//  - down_combine_bulk: block b takes rows [b R, b R + R) of the output; one chunk = those R
//    rows of one active expert (contiguous: one copy); warp w keeps R / warps rows' sums across
//    the experts, in the library's order (y bit-equal). The chunks are issued before the wait
//    for gate_up (weights only), the act rows read after it.
//
// Also two changes to the library's gate_up itself (gate_up_try): items with the expert fastest,
// and every 2 MB page of the layer's weights touched before the ids are read.
//
// Timed two ways: chained (8 layers with their own weights and experts in one graph, gate_up and
// down_combine chained by programmatic dependent launch; each kernel alone chained 8 times too)
// and cold (one layer, L2 flushed before each replay: moe-bench layer's method). act and y are
// compared bit for bit with the library's one-token kernels. Results (none kept):
// docs/perf/bulk-copy-weights.md, docs/perf/gate-up-m1-order-and-pages.md, docs/perf/m1-cold-floor.md.
//
// Build: cmake -DMOE_BUILD_LAB=ON, target lab_bulk_stream; or by hand from the repository root:
//   nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a -Isrc \
//     -Iinclude -o /tmp/bulk_stream_lab lab/cuda/bulk_stream_lab.cu src/backend/cuda/moe/moe_plan.cu
// Run:   /tmp/bulk_stream_lab
#include "backend/cuda/moe/moe_decode.cu"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "lab_timing.cuh"

namespace moe::cuda::kernels {
namespace {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void bar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void bar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void bar_wait(uint32_t bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}\n"
        : "=r"(done)
        : "r"(bar), "r"(parity)
        : "memory");
  } while (!done);
}
// kHint: an L2 evict-first policy on the copy (the weights are read once per forward).
template <bool kHint>
__device__ __forceinline__ void bulk_copy(uint32_t dst, const void* src, uint32_t bytes, uint32_t bar) {
  if constexpr (kHint) {
    uint64_t policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;\n" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar), "l"(policy)
        : "memory");
  } else {
    asm volatile(
        "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(dst),
        "l"(src), "r"(bytes), "r"(bar)
        : "memory");
  }
}

constexpr int kBulkWarps = 8;

// Shared memory: ring full barriers, ring empty barriers (8 bytes each, padded to 128), stages.
struct Ring {
  uint32_t base, full, empty;
  int stages;
  __device__ Ring(unsigned char* smem, int n) : stages(n) {
    full = smem_addr(smem);
    empty = full + 8 * n;
    base = full + ((16 * n + 127) / 128) * 128;
  }
  __device__ uint32_t full_bar(int k) const { return full + 8 * (k % stages); }
  __device__ uint32_t empty_bar(int k) const { return empty + 8 * (k % stages); }
  __device__ uint32_t parity(int k) const { return (k / stages) & 1; }
};
size_t ring_smem(int stages, size_t stage_bytes) { return ((16 * stages + 127) / 128) * 128 + stages * stage_bytes; }

// The block's chunks: a contiguous range [lo, hi) of the flattened (active expert, row) items,
// cut at expert ends and every `rows` rows.
struct Chunks {
  int pos, hi, inter, rows;
  __device__ bool more() const { return pos < hi; }
  __device__ void next(int& a, int& j, int& cnt) {
    a = pos / inter;
    j = pos % inter;
    cnt = min(rows, min(hi - pos, inter - j));
    pos += cnt;
  }
};

template <int C, int kRows, bool kHint>  // C: ceil(hidden / 256); kRows: gate rows a chunk
__global__ void __launch_bounds__(kBulkWarps * 32, 1) gate_up_bulk(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_gate_up,
    const int* __restrict__ ids, int slots, int hidden, int inter, int top_k,
    __nv_bfloat16* __restrict__ act, int stages) {
  extern __shared__ __align__(128) unsigned char smem[];
  const Ring ring(smem, stages);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      bar_init(ring.full + 8 * s, 1);
      bar_init(ring.empty + 8 * s, kBulkWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  wait_for_predecessor();  // the ids
  allow_dependents();
  const OneTokenRouting route(ids, slots);
  const long long total = (long long)route.num_active() * inter;
  const int lo = (int)(total * blockIdx.x / gridDim.x), hi = (int)(total * (blockIdx.x + 1) / gridDim.x);
  const size_t half = (size_t)kRows * hidden * 2;  // bytes of a stage's gate rows
  const size_t stage_bytes = 2 * half;
  Chunks produce{lo, hi, inter, kRows}, consume{lo, hi, inter, kRows};
  int issued = 0;
  // Warp 0 issues (route.expert is warp-collective), lane 0 copies.
  auto issue = [&] {
    int a, j, cnt;
    produce.next(a, j, cnt);
    const int e = route.expert(a);
    if (lane == 0) {
      const uint32_t dst = ring.base + (uint32_t)((issued % stages) * stage_bytes), bar = ring.full_bar(issued);
      const uint32_t bytes = (uint32_t)cnt * hidden * 2;
      const __nv_bfloat16* g = w_gate_up + ((size_t)e * 2 * inter + j) * hidden;
      bar_expect(bar, 2 * bytes);
      bulk_copy<kHint>(dst, g, bytes, bar);
      bulk_copy<kHint>(dst + (uint32_t)half, g + (size_t)inter * hidden, bytes, bar);
    }
    ++issued;
  };
  if (warp == 0)
    while (issued < stages && produce.more()) issue();
  const int chunks = hidden / 8;
  const uint4* xr = reinterpret_cast<const uint4*>(x);
  uint4 xv[C];
#pragma unroll
  for (int c = 0; c < C; ++c) xv[c] = __ldg(xr + min(c * 32 + lane, chunks - 1));
  for (int k = 0; consume.more(); ++k) {
    int a, j, cnt;
    consume.next(a, j, cnt);
    const int s = route.slot(a);
    bar_wait(ring.full_bar(k), ring.parity(k));
    const unsigned char* st = smem + (ring.base - smem_addr(smem)) + (size_t)(k % stages) * stage_bytes;
    for (int i = warp; i < cnt; i += kBulkWarps) {
      const uint4* g = reinterpret_cast<const uint4*>(st + (size_t)i * hidden * 2);
      const uint4* u = reinterpret_cast<const uint4*>(st + half + (size_t)i * hidden * 2);
      float gs = 0.f, us = 0.f;
#pragma unroll
      for (int c = 0; c < C; ++c) {
        const int idx = c * 32 + lane;
        if (idx < chunks) {
          gs += dot8(g[idx], xv[c]);
          us += dot8(u[idx], xv[c]);
        }
      }
      gs = warp_sum(gs);
      us = warp_sum(us);
      if (lane == 0) act[(size_t)s * inter + j + i] = __float2bfloat16(gs / (1.f + __expf(-gs)) * us);
    }
    __syncwarp();
    if (lane == 0) bar_arrive(ring.empty_bar(k));
    if (warp == 0 && produce.more()) {
      bar_wait(ring.empty_bar(k), ring.parity(k));
      issue();
    }
  }
}

// R = kRowsPerWarp * kBulkWarps output rows a block.
template <int C, int kRowsPerWarp, bool kHint>  // C: ceil(inter / 256)
__global__ void __launch_bounds__(kBulkWarps * 32, 1) down_combine_bulk(
    const __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ w_down,
    const int* __restrict__ ids, int slots, const float* __restrict__ weights, int hidden,
    int inter, __nv_bfloat16* __restrict__ y, int stages) {
  constexpr int R = kRowsPerWarp * kBulkWarps;
  extern __shared__ __align__(128) unsigned char smem[];
  const Ring ring(smem, stages);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (threadIdx.x == 0) {
    for (int s = 0; s < stages; ++s) {
      bar_init(ring.full + 8 * s, 1);
      bar_init(ring.empty + 8 * s, kBulkWarps);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  allow_dependents();
  const OneTokenRouting route(ids, slots);
  const int n = route.num_active();
  const int h0 = blockIdx.x * R, rows = min(R, hidden - h0);
  const size_t stage_bytes = (size_t)R * inter * 2;
  auto issue = [&](int a) {  // warp 0
    const int e = route.expert(a);
    if (lane == 0) {
      const uint32_t bar = ring.full_bar(a), bytes = (uint32_t)rows * inter * 2;
      bar_expect(bar, bytes);
      bulk_copy<kHint>(ring.base + (uint32_t)((a % stages) * stage_bytes),
                       w_down + ((size_t)e * hidden + h0) * inter, bytes, bar);
    }
  };
  if (warp == 0)
    for (int a = 0; a < min(stages, n); ++a) issue(a);
  wait_for_predecessor();  // act
  const int chunks = inter / 8;
  float mine[kRowsPerWarp] = {};
  for (int a = 0; a < n; ++a) {
    const int slot = route.slot(a);
    const float w = __ldg(weights + slot);
    const uint4* ar = reinterpret_cast<const uint4*>(act + (size_t)slot * inter);
    uint4 av[C];
#pragma unroll
    for (int c = 0; c < C; ++c) av[c] = ar[min(c * 32 + lane, chunks - 1)];
    bar_wait(ring.full_bar(a), ring.parity(a));
    const unsigned char* st = smem + (ring.base - smem_addr(smem)) + (size_t)(a % stages) * stage_bytes;
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int row = warp + r * kBulkWarps;
      if (row < rows) {
        const uint4* wr = reinterpret_cast<const uint4*>(st + (size_t)row * inter * 2);
        float v = 0.f;
#pragma unroll
        for (int c = 0; c < C; ++c)
          if (c * 32 + lane < chunks) v += dot8(wr[c * 32 + lane], av[c]);
        mine[r] += w * v;
      }
    }
    __syncwarp();
    if (lane == 0) bar_arrive(ring.empty_bar(a));
    if (warp == 0 && a + stages < n) {
      bar_wait(ring.empty_bar(a), ring.parity(a));
      issue(a + stages);
    }
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int row = warp + r * kBulkWarps;
    const float v = warp_sum(mine[r]);
    if (lane == 0 && row < rows) y[h0 + row] = __float2bfloat16(v);
  }
}

// The library's one-token gate_up with two changes to try:
//  - kExpertFastest: item -> (a = item % n, j = item / n), so that a round of warps reads rows
//    of every active expert at once instead of two or three experts' rows;
//  - kExperts > 0: before reading the ids, the grid touches one line of every 2 MB page of the
//    layer's gate_up weights (all kExperts experts, prefetch.global.L2), so that the address
//    translations of whichever experts the ids name are warm when the weight loads go out.
template <int C, bool kExpertFastest, int kExperts>
__global__ void __launch_bounds__(kGemvWarps * 32, kGemvMinBlocks) gate_up_try(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_gate_up,
    const int* __restrict__ ids, int slots, int hidden, int inter, int top_k,
    __nv_bfloat16* __restrict__ act) {
  if constexpr (kExperts > 0) {
    const size_t bytes = (size_t)kExperts * 2 * inter * hidden * 2, page = 2u << 20;
    const size_t p = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (p * page < bytes) asm volatile("prefetch.global.L2 [%0];" ::"l"(reinterpret_cast<const char*>(w_gate_up) + p * page));
  }
  wait_for_predecessor();
  allow_dependents();
  const OneTokenRouting route(ids, slots);
  const int lane = threadIdx.x % 32;
  const int chunks = hidden / 8;
  const int n = route.num_active();
  const int total = n * inter;
  for (int item = blockIdx.x * kGemvWarps + threadIdx.x / 32; item < total;
       item += gridDim.x * kGemvWarps) {
    const int a = kExpertFastest ? item % n : item / inter, j = kExpertFastest ? item / n : item % inter;
    const int e = route.expert(a);
    const uint4* g = reinterpret_cast<const uint4*>(w_gate_up + ((size_t)e * 2 * inter + j) * hidden);
    const uint4* u = g + (size_t)inter * chunks;
    uint4 gr[C], ur[C];
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const int idx = min(c * 32 + lane, chunks - 1);
      gr[c] = load_stream(g + idx);
      ur[c] = load_stream(u + idx);
    }
#pragma unroll
    for (int c = 0; c < C; ++c)
      if (c * 32 + lane >= chunks) gr[c] = ur[c] = make_uint4(0, 0, 0, 0);
    const int s = route.slot(a);
    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)(s / top_k) * hidden);
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

struct Shape {
  const char* name;
  int experts, hidden, inter, top_k;
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
int g_sms = 0;

// One launch of a gate_up or down variant for one layer.
struct GateUpVariant {
  const char* name;
  void (*lib)(const __nv_bfloat16*, const __nv_bfloat16*, const int*, int, int, int, int, __nv_bfloat16*);
  void (*bulk)(const __nv_bfloat16*, const __nv_bfloat16*, const int*, int, int, int, int, __nv_bfloat16*, int);
  int rows, stages;  // bulk: gate rows a chunk, ring stages
  bool plain = false;  // launched without the programmatic-dependent attribute
};
struct DownVariant {
  const char* name;
  void (*lib)(const __nv_bfloat16*, const __nv_bfloat16*, const int*, int, const float*, int, int, __nv_bfloat16*);
  void (*bulk)(const __nv_bfloat16*, const __nv_bfloat16*, const int*, int, const float*, int, int, __nv_bfloat16*, int);
  int rows, stages;  // bulk: rows a block (kRowsPerWarp * 8), ring stages
};

template <typename K>
int occupancy_grid(K kernel, int threads, size_t smem) {
  int n = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem));
  return n * g_sms;
}

void launch_gate_up(const GateUpVariant& v, const Shape& sh, const LayerBufs& l, const __nv_bfloat16* x,
                    __nv_bfloat16* act, cudaStream_t s) {
  if (v.lib) {
    CHECK(launch_kernel(v.lib, dim3(occupancy_grid(v.lib, 128, 0)), dim3(128), 0, s, !v.plain, x,
                        (const __nv_bfloat16*)l.gate_up, (const int*)l.ids, sh.top_k, sh.hidden, sh.inter,
                        sh.top_k, act));
    return;
  }
  const size_t smem = ring_smem(v.stages, (size_t)2 * v.rows * sh.hidden * 2);
  CHECK(launch_kernel(v.bulk, dim3(occupancy_grid(v.bulk, kBulkWarps * 32, smem)), dim3(kBulkWarps * 32), smem, s, true, x,
                      (const __nv_bfloat16*)l.gate_up, (const int*)l.ids, sh.top_k, sh.hidden, sh.inter,
                      sh.top_k, act, v.stages));
}

void launch_down(const DownVariant& v, const Shape& sh, const LayerBufs& l, const __nv_bfloat16* act,
                 const float* weights, __nv_bfloat16* y, cudaStream_t s) {
  if (v.lib) {
    // The library's grid: whole rounds of rows.
    const int cap = occupancy_grid(v.lib, 128, 0) * kGemvWarps;
    const int rounds = (sh.hidden + cap - 1) / cap;
    const int warps = (sh.hidden + rounds - 1) / rounds;
    CHECK(launch_kernel(v.lib, dim3((warps + kGemvWarps - 1) / kGemvWarps), dim3(128), 0, s, true, act,
                        (const __nv_bfloat16*)l.down, (const int*)l.ids, sh.top_k, weights, sh.hidden,
                        sh.inter, y));
    return;
  }
  const size_t smem = ring_smem(v.stages, (size_t)v.rows * sh.inter * 2);
  CHECK(launch_kernel(v.bulk, dim3((sh.hidden + v.rows - 1) / v.rows), dim3(kBulkWarps * 32), smem, s, true,
                      act, (const __nv_bfloat16*)l.down, (const int*)l.ids, sh.top_k, weights, sh.hidden,
                      sh.inter, y, v.stages));
}

using lab::time_cold;

__global__ void empty_kernel(int) {}

template <int CG, int CD>
void bench(const Shape& sh, const std::vector<GateUpVariant>& gus, const std::vector<DownVariant>& dns) {
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
  float* weights;
  CHECK(cudaMalloc(&x, sh.hidden * 2));
  fill<<<8, 256>>>(x, sh.hidden, 99);
  std::vector<float> wh(sh.top_k);
  for (int i = 0; i < sh.top_k; ++i) wh[i] = 0.05f + 0.03f * i;
  CHECK(cudaMalloc(&weights, sh.top_k * 4));
  CHECK(cudaMemcpy(weights, wh.data(), sh.top_k * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&act, (size_t)sh.top_k * sh.inter * 2));
  CHECK(cudaMalloc(&y, sh.hidden * 2));
  CHECK(cudaDeviceSynchronize());
  const double gb = (double)sh.top_k * 2 * sh.inter * sh.hidden * 2, db = gb / 2;
  std::printf("floors at 3.0 TB/s: gate_up %.1f us (%.1f MB), down %.1f us, layer %.1f us\n", gb / 3e6,
              gb / 1e6, db / 3e6, (gb + db) / 3e6);
  cudaStream_t s0;
  CHECK(cudaStreamCreateWithFlags(&s0, cudaStreamNonBlocking));
  // Correctness, eager, layer 0, poisoned outputs: act of every gate_up variant against the
  // library's; y of every down variant (on the library's act) against the library's.
  std::vector<uint16_t> act_ref, y_ref, got;
  for (size_t i = 0; i < gus.size(); ++i) {
    CHECK(cudaMemset(act, 0xff, (size_t)sh.top_k * sh.inter * 2));
    launch_gate_up(gus[i], sh, L[0], x, act, s0);
    CHECK(cudaStreamSynchronize(s0));
    got.resize((size_t)sh.top_k * sh.inter);
    CHECK(cudaMemcpy(got.data(), act, got.size() * 2, cudaMemcpyDeviceToHost));
    if (i == 0) act_ref = got;
    std::printf("  check gate_up %-28s %s\n", gus[i].name, got == act_ref ? "bits equal" : "DIFFERS");
  }
  CHECK(cudaMemset(act, 0, (size_t)sh.top_k * sh.inter * 2));
  launch_gate_up(gus[0], sh, L[0], x, act, s0);
  for (size_t i = 0; i < dns.size(); ++i) {
    CHECK(cudaMemset(y, 0xff, sh.hidden * 2));
    launch_down(dns[i], sh, L[0], act, weights, y, s0);
    CHECK(cudaStreamSynchronize(s0));
    got.resize(sh.hidden);
    CHECK(cudaMemcpy(got.data(), y, got.size() * 2, cudaMemcpyDeviceToHost));
    if (i == 0) y_ref = got;
    std::printf("  check down    %-28s %s\n", dns[i].name, got == y_ref ? "bits equal" : "DIFFERS");
  }
  for (int rep = 0; rep < 2; ++rep) {
    std::printf(" run %d, alone (chained x8), us:\n", rep);
    for (const auto& v : gus)
      std::printf("  gate_up %-28s %7.2f\n", v.name,
                  lab::time_chained(kLayers, [&](int l, cudaStream_t s) { launch_gate_up(v, sh, L[l], x, act, s); }));
    for (const auto& v : dns)
      std::printf("  down    %-28s %7.2f\n", v.name,
                  lab::time_chained(kLayers, [&](int l, cudaStream_t s) { launch_down(v, sh, L[l], act, weights, y, s); }));
    std::printf(" run %d, layers (gate_up + down), us:\n", rep);
    for (const auto& g : gus)
      for (const auto& d : dns)
        std::printf("  %-28s + %-28s %7.2f\n", g.name, d.name, lab::time_chained(kLayers, [&](int l, cudaStream_t s) {
                      launch_gate_up(g, sh, L[l], x, act, s);
                      launch_down(d, sh, L[l], act, weights, y, s);
                    }));
  }
  for (int rep = 0; rep < 2; ++rep) {
    std::printf(" run %d, one layer cold (moe-bench's method), us:\n", rep);
    std::printf("  empty kernel                  %7.2f\n", time_cold([&](int, cudaStream_t s) {
                  CHECK(launch_kernel(empty_kernel, dim3(1), dim3(32), 0, s, true, 0));
                }));
    std::printf("  empty kernel, plain launch    %7.2f\n", time_cold([&](int, cudaStream_t s) {
                  CHECK(launch_kernel(empty_kernel, dim3(1), dim3(32), 0, s, false, 0));
                }));
    std::printf("  two empty kernels, chained    %7.2f\n", time_cold([&](int, cudaStream_t s) {
                  CHECK(launch_kernel(empty_kernel, dim3(1), dim3(32), 0, s, true, 0));
                  CHECK(launch_kernel(empty_kernel, dim3(1), dim3(32), 0, s, true, 0));
                }));
    for (const auto& v : gus)
      std::printf("  gate_up %-28s %7.2f\n", v.name,
                  time_cold([&](int l, cudaStream_t s) { launch_gate_up(v, sh, L[l], x, act, s); }));
    for (const auto& v : dns)
      std::printf("  down    %-28s %7.2f\n", v.name,
                  time_cold([&](int l, cudaStream_t s) { launch_down(v, sh, L[l], act, weights, y, s); }));
    for (const auto& g : gus)
      for (const auto& d : dns)
        std::printf("  %-28s + %-28s %7.2f\n", g.name, d.name, time_cold([&](int l, cudaStream_t s) {
                      launch_gate_up(g, sh, L[l], x, act, s);
                      launch_down(d, sh, L[l], act, weights, y, s);
                    }));
  }
  CHECK(cudaStreamDestroy(s0));
  for (auto& l : L) cudaFree(l.gate_up), cudaFree(l.down), cudaFree(l.ids);
  cudaFree(x), cudaFree(act), cudaFree(y), cudaFree(weights);
}

template <typename K>
void allow_smem(K kernel) {
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 227 * 1024));
}

}  // namespace
}  // namespace moe::cuda::kernels

int main() {
  using namespace moe::cuda::kernels;
  cudaDeviceProp p;
  CHECK(cudaGetDeviceProperties(&p, 0));
  g_sms = p.multiProcessorCount;
  std::printf("%s, %d SMs\n", p.name, p.multiProcessorCount);
  allow_smem(gate_up_bulk<8, 8, false>);
  allow_smem(gate_up_bulk<8, 8, true>);
  allow_smem(gate_up_bulk<8, 4, false>);
  allow_smem(down_combine_bulk<3, 2, false>);
  allow_smem(down_combine_bulk<3, 2, true>);
  allow_smem(down_combine_bulk<6, 2, false>);
  allow_smem(down_combine_bulk<6, 2, true>);
  allow_smem(down_combine_bulk<3, 1, false>);
  allow_smem(down_combine_bulk<6, 1, false>);
  // The copy of the library's kernel with the largest shared-memory carveout, so that a bulk down
  // block (up to ~200 KB) can start on a multiprocessor as soon as one gate_up block there exits,
  // without waiting for the multiprocessor to drain and be reconfigured.
  CHECK(cudaFuncSetAttribute(gate_up_try<8, false, 0>, cudaFuncAttributePreferredSharedMemoryCarveout, 100));
  // Stage bytes: gate_up 2 x rows x 4 KB (hidden 2048); down rows x inter x 2.
  std::vector<GateUpVariant> gus = {
      {"library", gate_up_kernel<8, OneTokenRouting>, nullptr, 0, 0},
      {"bulk 8 rows x 2 stages", nullptr, gate_up_bulk<8, 8, false>, 8, 2},
      {"bulk 8 rows x 3 stages", nullptr, gate_up_bulk<8, 8, false>, 8, 3},
      {"bulk 4 rows x 6 stages", nullptr, gate_up_bulk<8, 4, false>, 4, 6},
      {"bulk 8 x 3, evict_first", nullptr, gate_up_bulk<8, 8, true>, 8, 3},
      {"library, smem carveout", gate_up_try<8, false, 0>, nullptr, 0, 0},
      {"expert fastest", gate_up_try<8, true, 0>, nullptr, 0, 0},
      {"pages touched", gate_up_try<8, false, 128>, nullptr, 0, 0},
      {"library, plain launch", gate_up_kernel<8, OneTokenRouting>, nullptr, 0, 0, true},
  };
  bench<8, 3>({"qwen3-30b-a3b", 128, 2048, 768, 8}, gus,
              {
                  {"library", down_combine_kernel<3>, nullptr, 0, 0},
                  {"bulk 16 rows x 4 stages", nullptr, down_combine_bulk<3, 2, false>, 16, 4},
                  {"bulk 16 rows x 8 stages", nullptr, down_combine_bulk<3, 2, false>, 16, 8},
                  {"bulk 16 x 8, evict_first", nullptr, down_combine_bulk<3, 2, true>, 16, 8},
                  {"bulk 8 rows x 8 stages", nullptr, down_combine_bulk<3, 1, false>, 8, 8},
              });
  gus[gus.size() - 2] = {"pages touched", gate_up_try<8, false, 64>, nullptr, 0, 0};
  bench<8, 6>({"deepseek-v2-lite", 64, 2048, 1408, 6}, gus,
              {
                  {"library", down_combine_kernel<6>, nullptr, 0, 0},
                  {"bulk 16 rows x 4 stages", nullptr, down_combine_bulk<6, 2, false>, 16, 4},
                  {"bulk 16 rows x 3 stages", nullptr, down_combine_bulk<6, 2, false>, 16, 3},
                  {"bulk 16 x 4, evict_first", nullptr, down_combine_bulk<6, 2, true>, 16, 4},
                  {"bulk 8 rows x 4 stages", nullptr, down_combine_bulk<6, 1, false>, 8, 4},
              });
  return 0;
}
