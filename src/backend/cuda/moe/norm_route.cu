// Decode routing in one launch: the post-attention residual add and RMSNorm, the router
// projection and the top-k choice, which are three short kernels otherwise (each a few µs of
// latency for almost no bytes at decode sizes).
//
// Every block normalises the (at most kNormRouteMaxTokens) rows itself into shared memory (bf16,
// rounded as add_rms_norm rounds its output; a few KB read from L2 per block), then each warp
// computes router logits for its experts. The last block to finish (a counter in global memory, reset by that block) writes the
// updated residual and the normalised rows once, and routes each token with the body of route()
// (route_device.cuh), so the experts chosen are route()'s. Nobody writes x before every block has
// read it: only the last block writes, after all others have counted themselves out.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>

#include "backend/cuda/bf16x8.cuh"
#include "backend/cuda/ops/ops_launch.h"
#include "backend/cuda/pdl.h"
#include "backend/cuda/moe/route_device.cuh"

namespace moe::cuda::kernels {

namespace {

constexpr int kWarps = 8;
// 16-byte chunks of the rows each thread holds: tokens * hidden <= kIter * 256 * 8.
constexpr int kIter = kNormRouteMaxElements / (kWarps * 32 * 8);

// x + branch for 8 consecutive values at chunk c of row t.
__device__ __forceinline__ void residual8(const NormRouteParams& q, int t, int c, float (&a)[8]) {
  const size_t at = static_cast<size_t>(t) * q.hidden + static_cast<size_t>(c) * 8;
  const float4 lo = *reinterpret_cast<const float4*>(q.x + at);
  const float4 hi = *reinterpret_cast<const float4*>(q.x + at + 4);
  float b[8];
  unpack_bf16x8(*reinterpret_cast<const uint4*>(q.branch + at), b);
  a[0] = lo.x + b[0], a[1] = lo.y + b[1], a[2] = lo.z + b[2], a[3] = lo.w + b[3];
  a[4] = hi.x + b[4], a[5] = hi.y + b[5], a[6] = hi.z + b[6], a[7] = hi.w + b[7];
}

template <int P>
__global__ void __launch_bounds__(kWarps * 32) norm_route_kernel(NormRouteParams q, RouterParams p,
                                                                 int tokens, int group_lanes,
                                                                 int32_t* __restrict__ ids,
                                                                 float* __restrict__ weights) {
  // The weights this block reads (its router rows, the norm's scales) are asked of L2 before
  // waiting for the predecessor (pdl.h), so that their HBM latency overlaps its tail.
  {
    const int first = blockIdx.x * kWarps, rows = min(kWarps, p.experts - first);
    const size_t row_bytes = static_cast<size_t>(q.hidden) * 2;
    if (rows > 0)
      prefetch_weights_l2(q.router_weight + static_cast<size_t>(first) * q.hidden, rows * row_bytes);
    prefetch_weights_l2(q.norm_weight, static_cast<size_t>(q.hidden) * 4);
  }
  begin_dependent();
  extern __shared__ uint4 s_rows[];  // bf16 [tokens, hidden]: the normalised rows
  __shared__ route_detail::RouteScratch<kWarps> s_scratch;
  __shared__ bool s_last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int chunks = q.hidden / 8;

  // 1. Residual add and norm. Thread i of the block holds chunks i, i + 256, ... of the rows laid
  // end to end (every load issued before any is used); the per-row sums of squares are added in
  // a fixed order (results must not depend on timing: replays are compared bit for bit).
  __shared__ float s_part[kIter * kWarps * 32];
  __shared__ float s_inv[kNormRouteMaxTokens];
  const int total = tokens * chunks;
  float v[kIter][8];
#pragma unroll
  for (int j = 0; j < kIter; ++j) {
    const int i = threadIdx.x + j * kWarps * 32;
    if (i < total) residual8(q, i / chunks, i % chunks, v[j]);
  }
#pragma unroll
  for (int j = 0; j < kIter; ++j) {
    const int i = threadIdx.x + j * kWarps * 32;
    if (i >= total) break;
    float ss = 0.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) ss += v[j][k] * v[j][k];
    s_part[i] = ss;
  }
  __syncthreads();
  for (int t = warp; t < tokens; t += kWarps) {
    float ss = 0.0f;
    for (int c = lane; c < chunks; c += 32) ss += s_part[t * chunks + c];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) s_inv[t] = 1.0f / sqrtf(ss / static_cast<float>(q.hidden) + q.eps);
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kIter; ++j) {
    const int i = threadIdx.x + j * kWarps * 32;
    if (i >= total) break;
    const int c = i % chunks;
    const float inv = s_inv[i / chunks];
    const float4 w0 = __ldg(reinterpret_cast<const float4*>(q.norm_weight) + 2 * c);
    const float4 w1 = __ldg(reinterpret_cast<const float4*>(q.norm_weight) + 2 * c + 1);
    s_rows[i] = norm_bf16x8(w0, w1, v[j], inv);
  }
  __syncthreads();

  // 2. Router logits: a warp per expert row, every token at once; kUnroll 16-byte weight loads
  // per lane in flight before any is used.
  constexpr int kUnroll = 8;
  const uint4* w = reinterpret_cast<const uint4*>(q.router_weight);
  for (int e = blockIdx.x * kWarps + warp; e < p.experts; e += gridDim.x * kWarps) {
    float acc[kNormRouteMaxTokens] = {};
    const uint4* row = w + static_cast<size_t>(e) * chunks;
    for (int base = lane; base < chunks; base += 32 * kUnroll) {
      uint4 wv[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = base + 32 * u;
        wv[u] = c < chunks ? __ldg(row + c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        const int c = base + 32 * u;
        if (c >= chunks) break;
        float wf[8];
        unpack_bf16x8(wv[u], wf);
#pragma unroll
        for (int t = 0; t < kNormRouteMaxTokens; ++t) {
          if (t >= tokens) break;
          float xf[8];
          unpack_bf16x8(s_rows[static_cast<size_t>(t) * chunks + c], xf);
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[t] = fmaf(wf[i], xf[i], acc[t]);
        }
      }
    }
#pragma unroll
    for (int t = 0; t < kNormRouteMaxTokens; ++t) {
      if (t >= tokens) break;
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) acc[t] += __shfl_xor_sync(0xffffffffu, acc[t], o);
      if (lane == 0) q.logits[static_cast<size_t>(t) * p.experts + e] = acc[t];
    }
  }

  // 3. The last block out: residual, normalised rows, routing.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this block's logits before its count
    s_last = atomicAdd(q.counter, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!s_last) return;
  __threadfence();  // every other block's logits before they are read
#pragma unroll
  for (int j = 0; j < kIter; ++j) {
    const int i = threadIdx.x + j * kWarps * 32;
    if (i >= total) break;
    float4* xs = reinterpret_cast<float4*>(q.x) + 2 * static_cast<size_t>(i);  // rows are contiguous
    xs[0] = make_float4(v[j][0], v[j][1], v[j][2], v[j][3]);
    xs[1] = make_float4(v[j][4], v[j][5], v[j][6], v[j][7]);
    reinterpret_cast<uint4*>(q.normed)[i] = s_rows[i];
  }
  for (int t = warp; t < tokens; t += kWarps) {
    if (route_detail::skip_padding_row(p, t, lane, ids + static_cast<size_t>(t) * p.top_k, weights + static_cast<size_t>(t) * p.top_k,
                         p.local_ids ? p.local_ids + static_cast<size_t>(t) * p.top_k : nullptr))
      continue;
    const float* row = q.logits + static_cast<size_t>(t) * p.experts;
    route_detail::route_token<P>([&](int e) { return __ldcg(row + e); }, p, group_lanes, lane,
                                 s_scratch.buf[warp], s_scratch.group[warp], s_scratch.weights[warp],
                                 ids + static_cast<size_t>(t) * p.top_k,
                                 weights + static_cast<size_t>(t) * p.top_k,
                                 p.local_ids ? p.local_ids + static_cast<size_t>(t) * p.top_k : nullptr);
  }
  if (threadIdx.x == 0) *q.counter = 0u;  // ready for the next launch
}

template <int P>
cudaError_t launch_norm_route(const NormRouteParams& q, const RouterParams& p, int tokens,
                              int group_lanes, int32_t* ids, float* weights, cudaStream_t stream) {
  const size_t smem = static_cast<size_t>(tokens) * q.hidden * 2;
  // With the static arrays the block takes more than the default 48 KB: opt in once per device
  // (the attribute is the current device's; one process may drive several GPUs).
  static std::atomic<uint64_t> opted_in{0};
  int device = 0;
  cudaError_t attr = cudaGetDevice(&device);
  if (attr != cudaSuccess) return attr;
  const uint64_t bit = device < 64 ? uint64_t{1} << device : 0;
  if (bit == 0 || !(opted_in.load() & bit)) {
    attr = cudaFuncSetAttribute(norm_route_kernel<P>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                kNormRouteMaxElements * 2);
    if (attr != cudaSuccess) return attr;
    opted_in.fetch_or(bit);
  }
  const int blocks = (p.experts + kWarps - 1) / kWarps;
  launch_dependent(norm_route_kernel<P>, dim3(blocks), dim3(kWarps * 32), smem, stream, q, p, tokens,
                   group_lanes, ids, weights);
  return cudaGetLastError();
}

}  // namespace

bool norm_route_supported(int tokens, int hidden) {
  return tokens >= 1 && tokens <= kNormRouteMaxTokens && hidden % 8 == 0 &&
         static_cast<long long>(tokens) * hidden <= kNormRouteMaxElements;
}

cudaError_t norm_route(const NormRouteParams& q, const RouterParams& p, int tokens, int32_t* ids,
                       float* weights, cudaStream_t stream) {
  const auto a16 = [](const void* ptr) { return reinterpret_cast<uintptr_t>(ptr) % 16 == 0; };
  if (!norm_route_supported(tokens, q.hidden) || !q.counter || !a16(q.x) || !a16(q.branch) ||
      !a16(q.norm_weight) || !a16(q.router_weight) || !a16(q.normed) || !q.logits)
    return cudaErrorInvalidValue;
  int group_lanes = 0;
  const int per_lane = route_detail::route_lanes(p, &group_lanes);
  if (per_lane == 0) return cudaErrorInvalidValue;
  switch (per_lane) {
    case 1: return launch_norm_route<1>(q, p, tokens, group_lanes, ids, weights, stream);
    case 2: return launch_norm_route<2>(q, p, tokens, group_lanes, ids, weights, stream);
    case 4: return launch_norm_route<4>(q, p, tokens, group_lanes, ids, weights, stream);
    case 8: return launch_norm_route<8>(q, p, tokens, group_lanes, ids, weights, stream);
    default: return launch_norm_route<16>(q, p, tokens, group_lanes, ids, weights, stream);
  }
}

}  // namespace moe::cuda::kernels
