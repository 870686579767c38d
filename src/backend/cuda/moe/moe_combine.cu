// The combine that every routed-expert path ends with: each token's output summed over its slots
// in slot order, stored, or folded into the next layer's residual add and input norm
// (ResidualNorm), whose normalised rows may be written as an FP8 projection's input.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/bf16x8.cuh"
#include "backend/cuda/moe/moe_decode_launch.h"
#include "backend/cuda/moe/slot_sums.cuh"
#include "backend/cuda/ops/fp8_act_quant.cuh"
#include "backend/cuda/pdl.h"

namespace moe::cuda::kernels {

namespace {

// `chained`: a programmatic dependent of its predecessor (pdl.h), which may let it start early;
// it waits with griddepcontrol.wait before reading that kernel's output.
template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), int blocks, int threads, bool chained,
                   cudaStream_t stream, Args... args) {
  return launch_kernel(kernel, dim3(blocks), dim3(threads), 0, stream, chained, args...);
}

// y[t, h] = sum over the k slots of token t (sum_slots). Eight outputs per thread (hidden is a
// multiple of 8), 16-byte stores. The register cap is what lets the loads of a batch be in flight
// together: left to itself, ptxas fits the kernel in 32 registers by waiting for each load before
// issuing the next.
template <typename Part, bool kSplit>
__global__ void __maxnreg__(128) combine_kernel(const Part* __restrict__ part,
                                                const int* __restrict__ ids, int tokens, int top_k,
                                                int hidden, int splits, long long split_stride,
                                                __nv_bfloat16* __restrict__ y) {
  wait_for_predecessor();
  const int groups = hidden / 8;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= tokens * groups) return;
  const int t = i / groups, h = (i % groups) * 8;
  float s[8];
  sum_slots<Part, kSplit>(part, ids, t, top_k, hidden, h, splits, split_stride, s);
  uint4 out;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int c = 0; c < 4; ++c) o[c] = __floats2bfloat162_rn(s[2 * c], s[2 * c + 1]);
  *reinterpret_cast<uint4*>(y + (size_t)t * hidden + h) = out;
}

// The codes form of a normalised chunk (ResidualNorm::codes): chunk g of row t, 8 bf16 values, as
// E4M3 codes of its 128-column block, which the half-warp holding the block's 16 chunks shares
// (hidden a multiple of 128, so no half-warp straddles two blocks or the row's end); the codes and
// scale are quantize_rows_fp8_by_block's of the bf16 values (fp8_act_quant.cuh).
__device__ __forceinline__ void store_codes(const uint4& normed, int g, int t, int hidden, const ResidualNorm& rn) {
  float f[8];
  unpack_bf16x8(normed, f);
  // A half-warp may stop at the row's end while the other goes on: the half's own mask.
  const float scale = fp8_act_scale(fp8_act_half_warp_amax(f, 0xffffu << (threadIdx.x & 16)));
  *reinterpret_cast<uint2*>(rn.codes + (size_t)t * hidden + g * 8) = fp8_act_codes8(f, fp8_act_inverse(scale));
  if (g % 16 == 0) rn.scales[(size_t)(g / 16) * rn.code_rows + t] = scale;
}

// One block per token: the combine of combine_kernel, then the residual add and RMSNorm of
// ResidualNorm (the same arithmetic as add_rms_norm_kernel). hidden <= 256 * kNormMaxChunks * 8.
constexpr int kNormThreads = 256;
constexpr int kNormMaxChunks = 4;

// kCodes: rows below rn.code_rows as codes (store_codes); a template argument so that the other
// forms compile to the code they had without it (decode batch 1 measured 1.2% slower with a
// run-time branch).
template <typename Part, bool kSplit, bool kCodes>
__global__ void __launch_bounds__(kNormThreads) combine_norm_kernel(const Part* __restrict__ part,
                                                                    const int* __restrict__ ids,
                                                                    int top_k, int hidden,
                                                                    int splits,
                                                                    long long split_stride,
                                                                    ResidualNorm rn) {
  prefetch_weights_l2(rn.weight, static_cast<size_t>(hidden) * 4);  // before the wait: pdl.h
  wait_for_predecessor();
  __shared__ float red[kNormThreads / 32];
  const int t = blockIdx.x, groups = hidden / 8;
  float* x = rn.x + (size_t)t * hidden;
  float v[kNormMaxChunks][8];
  float ss = 0.0f;
#pragma unroll
  for (int c = 0; c < kNormMaxChunks; ++c) {
    const int g = threadIdx.x + c * kNormThreads;
    if (g >= groups) break;
    float s[8];
    sum_slots<Part, kSplit>(part, ids, t, top_k, hidden, g * 8, splits, split_stride, s);
    float4* xs = reinterpret_cast<float4*>(x + g * 8);
    const float4 lo = xs[0], hi = xs[1];
    const float xv[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      v[c][i] = xv[i] + __bfloat162float(__float2bfloat16_rn(s[i]));  // y as it would be stored
      ss += v[c][i] * v[c][i];
    }
    xs[0] = make_float4(v[c][0], v[c][1], v[c][2], v[c][3]);
    xs[1] = make_float4(v[c][4], v[c][5], v[c][6], v[c][7]);
  }
#pragma unroll
  for (int off = 16; off > 0; off /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, off);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = ss;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kNormThreads / 32; ++w) total += red[w];
  const float inv = 1.0f / sqrtf(total / static_cast<float>(hidden) + rn.eps);
  auto* h = static_cast<__nv_bfloat16*>(rn.h) + (size_t)t * hidden;
  const bool codes = kCodes && t < rn.code_rows;  // the whole block's
#pragma unroll
  for (int c = 0; c < kNormMaxChunks; ++c) {
    const int g = threadIdx.x + c * kNormThreads;
    if (g >= groups) break;
    const float4 w0 = __ldg(reinterpret_cast<const float4*>(rn.weight + g * 8));
    const float4 w1 = __ldg(reinterpret_cast<const float4*>(rn.weight + g * 8) + 1);
    const uint4 normed = norm_bf16x8(w0, w1, v[c], inv);
    if (codes)
      store_codes(normed, g, t, hidden, rn);
    else
      *reinterpret_cast<uint4*>(h + g * 8) = normed;
  }
}

}  // namespace

cudaError_t launch_combine(const ExpertBuffers& b, const int* ids, int tokens, PartialSums sums,
                           void* y, cudaStream_t stream) {
  const bool chained = sums.chained;
  const bool bf16 = sums.bf16;
  if (sums.splits < 1 || (sums.splits > 1 && (bf16 || sums.split_stride < (long long)tokens * b.top_k)))
    return cudaErrorInvalidValue;
  const bool split = sums.splits > 1;
  if (b.norm.x) {
    if (b.hidden > kNormThreads * kNormMaxChunks * 8) return cudaErrorInvalidValue;
    const bool codes = b.norm.codes || b.norm.scales || b.norm.code_rows != 0;
    if (codes && (!b.norm.codes || !b.norm.scales || b.norm.code_rows < 0 || b.norm.code_rows > tokens ||
                  b.hidden % 128 != 0 || reinterpret_cast<uintptr_t>(b.norm.codes) % 8 != 0))
      return cudaErrorInvalidValue;
    if (bf16)
      return launch(codes ? combine_norm_kernel<__nv_bfloat16, false, true> : combine_norm_kernel<__nv_bfloat16, false, false>,
                    tokens, kNormThreads, chained, stream, static_cast<const __nv_bfloat16*>(b.part), ids, b.top_k,
                    b.hidden, 1, 0LL, b.norm);
    const auto kernel = split ? (codes ? combine_norm_kernel<float, true, true> : combine_norm_kernel<float, true, false>)
                              : (codes ? combine_norm_kernel<float, false, true> : combine_norm_kernel<float, false, false>);
    return launch(kernel, tokens, kNormThreads, chained, stream, static_cast<const float*>(b.part), ids, b.top_k,
                  b.hidden, sums.splits, sums.split_stride, b.norm);
  }
  const int total = tokens * (b.hidden / 8);
  auto* yb = static_cast<__nv_bfloat16*>(y);
  // Below 128 blocks of 256 threads, blocks of 64 spread the rows over four times the
  // multiprocessors (qwen3-30b-a3b M = 8: 3.4 -> 3.2 µs, ncu).
  const int threads = total < 128 * 256 ? 64 : 256;
  const int blocks = (total + threads - 1) / threads;
  if (bf16)
    return launch(combine_kernel<__nv_bfloat16, false>, blocks, threads, chained, stream,
                  static_cast<const __nv_bfloat16*>(b.part), ids, tokens, b.top_k, b.hidden, 1, 0LL, yb);
  return launch(split ? combine_kernel<float, true> : combine_kernel<float, false>, blocks, threads, chained,
                stream, static_cast<const float*>(b.part), ids, tokens, b.top_k, b.hidden, sums.splits,
                sums.split_stride, yb);
}

}  // namespace moe::cuda::kernels
