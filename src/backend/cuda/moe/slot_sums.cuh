// The sum of a row's routed slots from the experts' partial sums (bf16 or f32, optionally in
// split-K pieces): shared by the experts' combine (moe_decode.cu) and the p2p exchange's
// send-back (ep_exchange.cu), which sums the rows while writing them into the peers' buffers.
// Device code, CUDA headers only.
#pragma once

#include <cuda_bf16.h>

#include <cstddef>

namespace moe::cuda::kernels {

// Pieces (slot, split) whose loads are in flight together in sum_slots.
constexpr int kSumBatch = 8;

// s[0..8) = the sum of token t's k slots at columns [h, h + 8), in slot order (deterministic);
// skipped slots (id -1) have no partial sum and add nothing. A slot's partial sum may come in
// `splits` pieces (split-K of the wgmma down projection), `split_stride` slots apart, added in
// split order too.
//
// The pieces go kSumBatch at a time, in the order they are added: first every id of the batch,
// then every piece's load, then the adds, so that a thread waits for one round trip per batch, not
// one per slot (at small M, where each thread has only its own slots to wait for, that latency is
// the whole kernel). For that:
//  - every id and piece is loaded, a skipped slot's row too (it is inside the buffer, its
//    contents unused), and only the adds are conditional: a load behind a branch waits for the
//    branch's id;
//  - the loads are plain (weak) ones. A strong load such as __ldcg (LDG.STRONG.GPU) to an address
//    the compiler cannot prove distinct from the previous one waits for that one to complete, one
//    slot after another (seen in the SASS). Plain loads see the down grid's sums: the caller runs
//    after wait_for_predecessor(), which makes the predecessor's writes visible to this grid.
template <typename Part, bool kSplit>
__device__ __forceinline__ void sum_slots(const Part* __restrict__ part, const int* __restrict__ ids,
                                          int t, int top_k, int hidden, int h, int splits,
                                          long long split_stride, float (&s)[8]) {
  constexpr int kVecs = sizeof(Part) == 4 ? 2 : 1;  // 16-byte loads for 8 values
  const int per_slot = kSplit ? splits : 1;
  const int pieces = top_k * per_slot;
#pragma unroll
  for (int i = 0; i < 8; ++i) s[i] = 0.f;
  for (int q0 = 0; q0 < pieces; q0 += kSumBatch) {
    bool live[kSumBatch];
    uint4 raw[kSumBatch][kVecs];
#pragma unroll
    for (int u = 0; u < kSumBatch; ++u) {
      const int q = min(q0 + u, pieces - 1);  // past the end: a repeat load, not added
      const int j = kSplit ? q / per_slot : q, sp = kSplit ? q - j * per_slot : 0;
      const int id = __ldg(ids + (size_t)t * top_k + j);  // unconditional: no branch in the batch
      live[u] = q0 + u < pieces && id >= 0;
      const uint4* src = reinterpret_cast<const uint4*>(
          part + ((size_t)sp * split_stride + (size_t)t * top_k + j) * hidden + h);
#pragma unroll
      for (int v = 0; v < kVecs; ++v) raw[u][v] = src[v];
    }
#pragma unroll
    for (int u = 0; u < kSumBatch; ++u) {
      float f[8];
      const uint4 a = raw[u][0];
      if constexpr (sizeof(Part) == 4) {
        const uint4 b = raw[u][kVecs - 1];
        const unsigned w[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int i = 0; i < 8; ++i) f[i] = __uint_as_float(w[i]);
      } else {
        const unsigned w[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float2 p = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&w[c]));
          f[2 * c] = p.x, f[2 * c + 1] = p.y;
        }
      }
#pragma unroll
      for (int i = 0; i < 8; ++i) s[i] = live[u] ? s[i] + f[i] : s[i];  // a select, not a branch
    }
  }
}

}  // namespace moe::cuda::kernels
