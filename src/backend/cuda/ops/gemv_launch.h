// Dense projections of a few rows (decode): y[m, n] = sum_k x[m, k] · w[n, k] for m < rows <= 8,
// x bf16, w bf16 or FP8 blocks, f32 accumulation. Bound by reading w once, which cuBLASLt does poorly at these sizes.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe::cuda::kernels {

constexpr int kGemvMaxRows = 8;

// x bf16 [rows, k], w bf16 [n, k] (both 16-byte aligned, k a multiple of 8); y [rows, ldy], f32
// when y_f32 else bf16. cudaErrorInvalidValue outside those limits.
cudaError_t gemv_bf16(const void* x, const void* w, void* y, bool y_f32, int rows, int n, int k,
                      int ldy, cudaStream_t stream);

// `batch` independent products: batch b uses x + b * x_stride (rows ldx apart), w + b * w_stride
// and y + b * y_stride (all in elements; ldx and the x and w strides multiples of 8).
cudaError_t gemv_bf16_batched(const void* x, int ldx, long long x_stride, const void* w,
                              long long w_stride, void* y, bool y_f32, int ldy, long long y_stride,
                              int rows, int n, int k, int batch, cudaStream_t stream);

// The same over FP8 weights: w E4M3 codes [n, k] (k a multiple of 16) with f32 scales per 128 x
// 128 block, [ceil(n / 128), ceil(k / 128)]; each weight is code x scale in f32, as the CPU
// reference dequantises it.
cudaError_t gemv_fp8(const void* x, const void* w, const float* scales, void* y, bool y_f32, int rows, int n,
                     int k, int ldy, cudaStream_t stream);

}  // namespace moe::cuda::kernels
