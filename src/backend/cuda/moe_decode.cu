// Small-M (decode) routed-expert path, from lab/cuda/moe_decode_v2 (its best variant), and the
// plan and combine kernels that the grouped GEMM path (moe_prefill.cu) shares. A device-side
// plan, then per touched expert each bf16 weight row is read once, with 16-byte loads, and
// applied to all of that expert's tokens; four launches, no host round trip, nothing allocated
// per call. Tile choices (4 warps per block, 3 blocks per SM) came from the lab sweep.
// Only CUDA headers here: the host side (checks, errors, uploads) is in cuda_moe.cpp.
#include <cuda_bf16.h>

#include "backend/cuda/moe_decode_launch.h"

namespace moe::cuda::kernels {

namespace {

constexpr int kWarps = 4;
constexpr int kMinBlocks = 3;
constexpr int kPlanThreads = 1024;

// Slots of one warp that share an expert are counted or placed with one shared atomic by the
// lowest such lane (warp-aggregated): "every token on one expert" would otherwise serialise
// M * k atomics on one address.
__device__ __forceinline__ int warp_aggregated_add(int* counter, int e, bool valid) {
  const unsigned peers = __match_any_sync(0xffffffffu, valid ? e : -1);
  const int lane = threadIdx.x % 32;
  const int leader = __ffs(peers) - 1;
  int base = 0;
  if (valid && lane == leader) base = atomicAdd(counter, __popc(peers));
  base = __shfl_sync(0xffffffffu, base, leader);
  return base + __popc(peers & ((1u << lane) - 1u));
}

// One block. Counts per expert, offsets, the touched experts (ascending), each expert's slots
// (in no fixed order inside the expert) and, when tile_m > 0, the GEMM row tiles. Two passes over
// the ids with shared atomics; the scans run in warp 0 with shuffles.
__global__ void __launch_bounds__(kPlanThreads) plan_kernel(
    const int* __restrict__ ids, int slots, int experts, int tile_m, int* __restrict__ offsets,
    int* __restrict__ order, int* __restrict__ active, int* __restrict__ num_active,
    int* __restrict__ tile_expert, int* __restrict__ tile_row, int* __restrict__ num_tiles) {
  __shared__ int counts[kMaxExperts];
  __shared__ int cursor[kMaxExperts];
  __shared__ int tile_start[kMaxExperts + 1];
  __shared__ int total_tiles;
  const int lane = threadIdx.x % 32;
  for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  // Whole warps iterate together (match_any needs every lane); past the end a lane is invalid.
  const int rounded = (slots + blockDim.x - 1) / blockDim.x * blockDim.x;
  for (int s = threadIdx.x; s < rounded; s += blockDim.x) {
    const bool valid = s < slots;
    const int e = valid ? ids[s] : 0;
    warp_aggregated_add(&counts[valid ? e : 0], e, valid);
  }
  __syncthreads();
  if (threadIdx.x < 32) {
    int run = 0, n = 0, tiles = 0;
    for (int base = 0; base < experts; base += 32) {
      const int e = base + lane;
      const int c = e < experts ? counts[e] : 0;
      const int t = tile_m > 0 ? (c + tile_m - 1) / tile_m : 0;
      int ic = c, it = t;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int uc = __shfl_up_sync(0xffffffffu, ic, o), ut = __shfl_up_sync(0xffffffffu, it, o);
        if (lane >= o) ic += uc, it += ut;
      }
      const unsigned touched = __ballot_sync(0xffffffffu, c > 0);
      if (e < experts) {
        cursor[e] = run + ic - c;
        tile_start[e] = tiles + it - t;
        if (c > 0) active[n + __popc(touched & ((1u << lane) - 1u))] = e;
      }
      run += __shfl_sync(0xffffffffu, ic, 31);
      tiles += __shfl_sync(0xffffffffu, it, 31);
      n += __popc(touched);
    }
    if (lane == 0) {
      tile_start[experts] = tiles;
      total_tiles = tiles;
      offsets[experts] = run;
      *num_active = n;
      *num_tiles = tiles;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < experts; e += blockDim.x) offsets[e] = cursor[e];
  __syncthreads();  // cursor is advanced below; offsets took the starts first
  for (int s = threadIdx.x; s < rounded; s += blockDim.x) {
    const bool valid = s < slots;
    const int e = valid ? ids[s] : 0;
    const int pos = warp_aggregated_add(&cursor[valid ? e : 0], e, valid);
    if (valid) order[pos] = s;
  }
  if (tile_m <= 0) return;
  // Row tile j belongs to the expert whose [tile_start[e], tile_start[e + 1]) holds j.
  for (int j = threadIdx.x; j < total_tiles; j += blockDim.x) {
    int lo = 0, hi = experts - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (tile_start[mid] <= j) lo = mid; else hi = mid - 1;
    }
    tile_expert[j] = lo;
    tile_row[j] = offsets[lo] + (j - tile_start[lo]) * tile_m;
  }
}

__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
  const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&w);
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&x);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 fa = __bfloat1622float2(a[i]), fb = __bfloat1622float2(b[i]);
    s = fmaf(fa.x, fb.x, s);
    s = fmaf(fa.y, fb.y, s);
  }
  return s;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// blockIdx.x: index into the touched experts (blocks past their count exit); blockIdx.y: a tile
// of kWarps intermediate rows, one per warp.
template <int C>  // 16-byte chunks of a weight row per lane: ceil(hidden / 256)
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) gate_up_kernel(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_gate_up,
    const int* __restrict__ offsets, const int* __restrict__ order, const int* __restrict__ active,
    const int* __restrict__ num_active, int hidden, int inter, int top_k,
    __nv_bfloat16* __restrict__ act) {
  if (blockIdx.x >= *num_active) return;
  const int e = active[blockIdx.x];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int j = blockIdx.y * kWarps + warp;
  if (j >= inter) return;
  const int chunks = hidden / 8;
  const uint4* g = reinterpret_cast<const uint4*>(w_gate_up + ((size_t)e * 2 * inter + j) * hidden);
  const uint4* u = reinterpret_cast<const uint4*>(w_gate_up + ((size_t)e * 2 * inter + inter + j) * hidden);
  // Every load is issued unconditionally (indices clamped into the row) so that all of them are
  // in flight at once; chunks past the row's end are zeroed after loading.
  uint4 gr[C], ur[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    const int idx = min(c * 32 + lane, chunks - 1);
    gr[c] = __ldg(g + idx);
    ur[c] = __ldg(u + idx);
  }
#pragma unroll
  for (int c = 0; c < C; ++c)
    if (c * 32 + lane >= chunks) gr[c] = ur[c] = make_uint4(0, 0, 0, 0);
  for (int p = offsets[e]; p < offsets[e + 1]; ++p) {
    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)(order[p] / top_k) * hidden);
    float gs = 0.f, us = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      const uint4 xv = __ldg(xr + min(c * 32 + lane, chunks - 1));
      gs += dot8(gr[c], xv);
      us += dot8(ur[c], xv);
    }
    gs = warp_sum(gs);
    us = warp_sum(us);
    if (lane == 0) act[(size_t)p * inter + j] = __float2bfloat16(gs / (1.f + __expf(-gs)) * us);
  }
}

template <int C>  // ceil(inter / 256)
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks) down_kernel(
    const __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ w_down,
    const int* __restrict__ offsets, const int* __restrict__ order, const int* __restrict__ active,
    const int* __restrict__ num_active, const float* __restrict__ weights, int hidden, int inter,
    float* __restrict__ part) {
  if (blockIdx.x >= *num_active) return;
  const int e = active[blockIdx.x];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int h = blockIdx.y * kWarps + warp;
  if (h >= hidden) return;
  const int chunks = inter / 8;
  const uint4* w = reinterpret_cast<const uint4*>(w_down + ((size_t)e * hidden + h) * inter);
  uint4 wr[C];
#pragma unroll
  for (int c = 0; c < C; ++c) wr[c] = __ldg(w + min(c * 32 + lane, chunks - 1));
#pragma unroll
  for (int c = 0; c < C; ++c)
    if (c * 32 + lane >= chunks) wr[c] = make_uint4(0, 0, 0, 0);
  for (int p = offsets[e]; p < offsets[e + 1]; ++p) {
    const int slot = order[p];
    const uint4* ar = reinterpret_cast<const uint4*>(act + (size_t)p * inter);
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) s += dot8(wr[c], __ldg(ar + min(c * 32 + lane, chunks - 1)));
    s = warp_sum(s);
    if (lane == 0) part[(size_t)slot * hidden + h] = weights[slot] * s;
  }
}

// y[t, h] = sum over the k slots of token t, in slot order: deterministic. Eight outputs per
// thread (hidden is a multiple of 8), 16-byte stores.
template <typename Part>
__global__ void combine_kernel(const Part* __restrict__ part, int tokens, int top_k, int hidden,
                               __nv_bfloat16* __restrict__ y) {
  const int groups = hidden / 8;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= tokens * groups) return;
  const int t = i / groups, h = (i % groups) * 8;
  float s[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int j = 0; j < top_k; ++j) {
    const Part* p = part + ((size_t)t * top_k + j) * hidden + h;
    if constexpr (sizeof(Part) == 4) {
      const float4 a = __ldg(reinterpret_cast<const float4*>(p));
      const float4 b = __ldg(reinterpret_cast<const float4*>(p) + 1);
      s[0] += a.x, s[1] += a.y, s[2] += a.z, s[3] += a.w;
      s[4] += b.x, s[5] += b.y, s[6] += b.z, s[7] += b.w;
    } else {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p));
      const __nv_bfloat162* q = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float2 f = __bfloat1622float2(q[c]);
        s[2 * c] += f.x, s[2 * c + 1] += f.y;
      }
    }
  }
  uint4 out;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int c = 0; c < 4; ++c) o[c] = __floats2bfloat162_rn(s[2 * c], s[2 * c + 1]);
  *reinterpret_cast<uint4*>(y + (size_t)t * hidden + h) = out;
}

template <int C>
void launch_gate_up(dim3 grid, cudaStream_t stream, const __nv_bfloat16* x, const ExpertBuffers& b,
                    __nv_bfloat16* act) {
  gate_up_kernel<C><<<grid, kWarps * 32, 0, stream>>>(
      x, static_cast<const __nv_bfloat16*>(b.gate_up), b.offsets, b.order, b.active, b.num_active,
      b.hidden, b.inter, b.top_k, act);
}

template <int C>
void launch_down(dim3 grid, cudaStream_t stream, const __nv_bfloat16* act, const float* weights,
                 const ExpertBuffers& b) {
  down_kernel<C><<<grid, kWarps * 32, 0, stream>>>(act, static_cast<const __nv_bfloat16*>(b.down),
                                                   b.offsets, b.order, b.active, b.num_active,
                                                   weights, b.hidden, b.inter, static_cast<float*>(b.part));
}

// The register arrays must have a compile-time size: one instantiation per chunk count.
template <template <int> class Launcher, typename... Args>
void dispatch_chunks(int width, Args&&... args) {
  switch ((width / 8 + 31) / 32) {
    case 1: Launcher<1>::run(args...); break;
    case 2: Launcher<2>::run(args...); break;
    case 3: Launcher<3>::run(args...); break;
    case 4: Launcher<4>::run(args...); break;
    case 5: Launcher<5>::run(args...); break;
    case 6: Launcher<6>::run(args...); break;
    case 7: Launcher<7>::run(args...); break;
    default: Launcher<8>::run(args...); break;
  }
}

template <int C>
struct GateUp {
  template <typename... A>
  static void run(A&&... a) { launch_gate_up<C>(a...); }
};
template <int C>
struct Down {
  template <typename... A>
  static void run(A&&... a) { launch_down<C>(a...); }
};

}  // namespace

cudaError_t launch_plan(const ExpertBuffers& b, const int* ids, int tokens, int tile_m,
                        cudaStream_t stream) {
  plan_kernel<<<1, kPlanThreads, 0, stream>>>(ids, tokens * b.top_k, b.experts, tile_m, b.offsets,
                                              b.order, b.active, b.num_active, b.tile_expert,
                                              b.tile_row, b.num_tiles);
  return cudaGetLastError();
}

cudaError_t launch_combine(const ExpertBuffers& b, int tokens, bool part_bf16, void* y,
                           cudaStream_t stream) {
  const int total = tokens * (b.hidden / 8);
  auto* yb = static_cast<__nv_bfloat16*>(y);
  if (part_bf16)
    combine_kernel<<<(total + 255) / 256, 256, 0, stream>>>(
        static_cast<const __nv_bfloat16*>(b.part), tokens, b.top_k, b.hidden, yb);
  else
    combine_kernel<<<(total + 255) / 256, 256, 0, stream>>>(static_cast<const float*>(b.part),
                                                           tokens, b.top_k, b.hidden, yb);
  return cudaGetLastError();
}

cudaError_t launch_decode(const ExpertBuffers& b, const void* x, const int* ids,
                          const float* weights, int tokens, void* y, cudaStream_t stream) {
  const int slots = tokens * b.top_k;
  const int max_active = b.experts < slots ? b.experts : slots;
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  auto* act = static_cast<__nv_bfloat16*>(b.act);
  cudaError_t err = launch_plan(b, ids, tokens, 0, stream);
  if (err != cudaSuccess) return err;
  dispatch_chunks<GateUp>(b.hidden, dim3(max_active, (b.inter + kWarps - 1) / kWarps), stream, xb, b, act);
  dispatch_chunks<Down>(b.inter, dim3(max_active, (b.hidden + kWarps - 1) / kWarps), stream,
                        static_cast<const __nv_bfloat16*>(act), weights, b);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  return launch_combine(b, tokens, false, y, stream);
}

}  // namespace moe::cuda::kernels
