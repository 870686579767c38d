// Small-M (decode) routed-expert path, from lab/cuda/moe_decode_v2 (its best variant): a
// device-side plan, then per touched expert each bf16 weight row is read once, with 16-byte loads,
// and applied to all of that expert's tokens; four launches, no host round trip, nothing
// allocated per call. Tile choices (4 warps per block, 3 blocks per SM) came from the lab sweep.
// Only CUDA headers here: the host side (checks, errors, uploads) is in cuda_moe.cpp.
#include <cuda_bf16.h>

#include "backend/cuda/moe_decode_launch.h"

namespace moe::cuda::kernels {

namespace {

constexpr int kMaxExperts = kDecodeMaxExperts;
constexpr int kWarps = 4;
constexpr int kMinBlocks = 3;

// One block. Counts, offsets, the touched experts (ascending) and, per expert, its slots in slot
// order (thread e walks the slots and appends its own: stable, and cheap at decode sizes).
__global__ void plan_kernel(const int* ids, int slots, int experts, int* offsets, int* order,
                            int* active, int* num_active) {
  __shared__ int counts[kMaxExperts];
  __shared__ int starts[kMaxExperts + 1];
  for (int e = threadIdx.x; e < experts; e += blockDim.x) counts[e] = 0;
  __syncthreads();
  for (int s = threadIdx.x; s < slots; s += blockDim.x) atomicAdd(&counts[ids[s]], 1);
  __syncthreads();
  if (threadIdx.x == 0) {
    int run = 0, n = 0;
    for (int e = 0; e < experts; ++e) {
      starts[e] = run;
      if (counts[e] > 0) active[n++] = e;
      run += counts[e];
    }
    starts[experts] = run;
    *num_active = n;
  }
  __syncthreads();
  for (int e = threadIdx.x; e <= experts; e += blockDim.x) offsets[e] = starts[e];
  for (int e = threadIdx.x; e < experts; e += blockDim.x) {
    if (counts[e] == 0) continue;
    int pos = starts[e];
    for (int s = 0; s < slots; ++s)
      if (ids[s] == e) order[pos++] = s;
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

// y[t, h] = sum over the k slots of token t, in slot order (ascending expert id): deterministic.
__global__ void combine_kernel(const float* __restrict__ part, int tokens, int top_k, int hidden,
                               __nv_bfloat16* __restrict__ y) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= tokens * hidden) return;
  const int t = i / hidden, h = i % hidden;
  float s = 0.f;
  for (int j = 0; j < top_k; ++j) s += part[((size_t)t * top_k + j) * hidden + h];
  y[i] = __float2bfloat16(s);
}

template <int C>
void launch_gate_up(dim3 grid, cudaStream_t stream, const __nv_bfloat16* x, const DecodeBuffers& b,
                    __nv_bfloat16* act) {
  gate_up_kernel<C><<<grid, kWarps * 32, 0, stream>>>(
      x, static_cast<const __nv_bfloat16*>(b.gate_up), b.offsets, b.order, b.active, b.num_active,
      b.hidden, b.inter, b.top_k, act);
}

template <int C>
void launch_down(dim3 grid, cudaStream_t stream, const __nv_bfloat16* act, const float* weights,
                 const DecodeBuffers& b) {
  down_kernel<C><<<grid, kWarps * 32, 0, stream>>>(act, static_cast<const __nv_bfloat16*>(b.down),
                                                   b.offsets, b.order, b.active, b.num_active,
                                                   weights, b.hidden, b.inter, b.part);
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

cudaError_t launch_decode(const DecodeBuffers& b, const void* x, const int* ids,
                          const float* weights, int tokens, void* y, cudaStream_t stream) {
  const int slots = tokens * b.top_k;
  const int max_active = b.experts < slots ? b.experts : slots;
  const auto* xb = static_cast<const __nv_bfloat16*>(x);
  auto* act = static_cast<__nv_bfloat16*>(b.act);
  plan_kernel<<<1, 256, 0, stream>>>(ids, slots, b.experts, b.offsets, b.order, b.active, b.num_active);
  dispatch_chunks<GateUp>(b.hidden, dim3(max_active, (b.inter + kWarps - 1) / kWarps), stream, xb, b, act);
  dispatch_chunks<Down>(b.inter, dim3(max_active, (b.hidden + kWarps - 1) / kWarps), stream,
                        static_cast<const __nv_bfloat16*>(act), weights, b);
  const int total = tokens * b.hidden;
  combine_kernel<<<(total + 255) / 256, 256, 0, stream>>>(b.part, tokens, b.top_k, b.hidden,
                                                         static_cast<__nv_bfloat16*>(y));
  return cudaGetLastError();
}

}  // namespace moe::cuda::kernels
