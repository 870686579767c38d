// The activations' E4M3 quantisation for the W8A8 GEMMs, per row and 128 columns: a block's scale
// from its largest magnitude, and each value's code. One definition for the quantising kernel
// (fp8_blocks.cu) and for the grouped GEMM's epilogue that writes act already quantised
// (moe/wgmma_epilogue.cuh), which must give the same bits. Device code only.
#pragma once

#include <cuda_fp8.h>

#include <cstdint>

namespace moe::cuda::kernels {

// 448 is E4M3's largest finite value; a block of zeros gets 1, so that its codes are zeros.
__device__ __forceinline__ float fp8_act_scale(float amax) { return amax > 0.f ? amax / 448.f : 1.f; }

// Saturating: a value past the block's max (none, in exact arithmetic) keeps the largest code.
__device__ __forceinline__ uint32_t fp8_act_code(float value, float scale) {
  return __nv_cvt_float_to_fp8(value / scale, __NV_SATFINITE, __NV_E4M3);
}

}  // namespace moe::cuda::kernels
