// The sum of a row's routed slots from the experts' partial sums (bf16 or f32, optionally in
// split-K pieces): shared by the experts' combine (moe_decode.cu) and the p2p exchange's
// send-back (ep_exchange.cu), which sums the rows while writing them into the peers' buffers.
// Device code, CUDA headers only.
#pragma once

#include <cuda_bf16.h>

#include <cstddef>

namespace moe::cuda::kernels {

// s[0..8) = the sum of token t's k slots at columns [h, h + 8), in slot order (deterministic);
// skipped slots (id -1) have no partial sum and add nothing. A slot's partial sum may come in
// `splits` pieces (split-K of the wgmma down projection), `split_stride` slots apart, added in
// split order too. The partial sums are read through L2 (__ldcg): in the GEMV path the combine
// starts before the down grid has finished.
template <typename Part, bool kSplit>
__device__ __forceinline__ void sum_slots(const Part* __restrict__ part, const int* __restrict__ ids,
                                          int t, int top_k, int hidden, int h, int splits,
                                          long long split_stride, float (&s)[8]) {
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = 0.f;
#pragma unroll 4  // loads of several slots in flight; the adds stay in slot order
  for (int j = 0; j < top_k; ++j) {
    if (__ldg(ids + (size_t)t * top_k + j) < 0) continue;
    for (int sp = 0; sp < (kSplit ? splits : 1); ++sp) {
      const Part* p = part + ((size_t)sp * split_stride + (size_t)t * top_k + j) * hidden + h;
      if constexpr (sizeof(Part) == 4) {
        const float4 a = __ldcg(reinterpret_cast<const float4*>(p));
        const float4 b = __ldcg(reinterpret_cast<const float4*>(p) + 1);
        s[0] += a.x, s[1] += a.y, s[2] += a.z, s[3] += a.w;
        s[4] += b.x, s[5] += b.y, s[6] += b.z, s[7] += b.w;
      } else {
        const uint4 v = __ldcg(reinterpret_cast<const uint4*>(p));
        const __nv_bfloat162* q = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float2 f = __bfloat1622float2(q[c]);
          s[2 * c] += f.x, s[2 * c + 1] += f.y;
        }
      }
    }
  }
}

}  // namespace moe::cuda::kernels
