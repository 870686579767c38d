// The activations' E4M3 quantisation for the W8A8 GEMMs, per row and 128 columns: a block's scale
// from its largest magnitude, and the values' codes. One definition for the quantising kernel
// (fp8_blocks.cu) and for the grouped GEMM's epilogue that writes act already quantised
// (moe/wgmma_epilogue.cuh), which must give the same bits. Device code only.
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

}  // namespace moe::cuda::kernels
