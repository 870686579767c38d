// The activations' E4M3 quantisation for the W8A8 GEMMs, per row and 128 columns: a block's scale
// from its largest magnitude, and the values' codes. One definition for the quantising kernel
// (fp8_blocks.cu) and for the producers that write their output already quantised (the grouped
// GEMM's epilogue, moe/wgmma_epilogue.cuh; the folded norm, moe/moe_combine.cu; the prefill
// attention), which must give the same bits. Device code only.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace moe::cuda::kernels {

// 448 is E4M3's largest finite value; a block of zeros gets 1, so that its codes are zeros.
__device__ __forceinline__ float fp8_act_scale(float amax) { return amax > 0.f ? amax / 448.f : 1.f; }

// The codes are E4M3(value x (1 / scale)), the reciprocal rounded once per block. A division per
// value is slow in gate_up's epilogue, which runs while the tensor cores idle: quantising there
// 64 columns a consumer, the divisions took 11M of gate_up's 70M instructions and 33 of its 201
// µs (qwen3-30b-a3b M = 1024, H100, ncu; docs/perf/fp8-act-quant-cluster-pairs.md).
__device__ __forceinline__ float fp8_act_inverse(float scale) { return __frcp_rn(scale); }

// The codes of two values (one conversion instruction), lo's in bits 0-7 and hi's in 8-15;
// saturating: a value past the block's max (none, in exact arithmetic) keeps the largest code.
__device__ __forceinline__ uint32_t fp8_act_codes2(float lo, float hi, float inverse) {
  return __nv_cvt_float2_to_fp8x2(make_float2(lo * inverse, hi * inverse), __NV_SATFINITE, __NV_E4M3);
}

// Eight values a lane, a 128-column block a half-warp (lanes 0-15 or 16-31): the block's largest
// magnitude, the same in every lane of the half. `lanes`: the lanes that call it together, the
// whole warp or the caller's half (0xffff << (lane & 16)); a full warp's mask costs the
// quantising kernel no register for it.
__device__ __forceinline__ float fp8_act_half_warp_amax(const float (&v)[8], unsigned lanes) {
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
#pragma unroll
  for (int o = 8; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(lanes, amax, o));
  return amax;
}

// The codes of eight values, in order, as 8 bytes.
__device__ __forceinline__ uint2 fp8_act_codes8(const float (&v)[8], float inverse) {
  return make_uint2(fp8_act_codes2(v[0], v[1], inverse) | fp8_act_codes2(v[2], v[3], inverse) << 16,
                    fp8_act_codes2(v[4], v[5], inverse) | fp8_act_codes2(v[6], v[7], inverse) << 16);
}

}  // namespace moe::cuda::kernels
