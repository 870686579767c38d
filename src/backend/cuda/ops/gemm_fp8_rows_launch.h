// Dense projections of a few rows over FP8 block-scaled weights: y[m, n] = sum_k x[m, k] · w[n, k]
// with x bf16 and w E4M3 codes times one f32 scale per 128 x 128 block, on tensor cores. Between
// the GEMV (gemv_launch.h) and the W8A8 GEMM (cuBLASLt, prefill): each weight is read once for
// all rows and widened exactly to bf16, so the product is the CPU reference's (exact weights,
// bf16 x, f32 sums), not a product of rounded activations.
#pragma once

#include <cuda_runtime.h>

namespace moe::cuda::kernels {

// Where dense FP8 projections take this kernel (projection.cpp): from 3 rows, where it overtook
// the GEMV at every shape measured (at 2 rows on half of them), to 32,
// past which it read x as often as the weights and fell behind the bf16 GEMM
// (lab/cuda/fp8_rows_sweep.cu, docs/perf/fp8-dense-rows.md).
constexpr int kFp8RowsMinRows = 3;
constexpr int kFp8RowsMaxRows = 32;

// x bf16 [rows, k], w E4M3 [n, k] (both 16-byte aligned, k a multiple of 16), scales f32
// [ceil(n / 128), ceil(k / 128)]; y [rows, ldy], f32 when y_f32 else bf16. Launched as a
// programmatic dependent (pdl.h). cudaErrorInvalidValue outside those limits or for rows outside
// [1, kFp8RowsMaxRows].
cudaError_t gemm_fp8_rows(const void* x, const void* w, const float* scales, void* y, bool y_f32, int rows, int n,
                          int k, int ldy, cudaStream_t stream);

}  // namespace moe::cuda::kernels
