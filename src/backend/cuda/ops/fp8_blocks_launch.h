// Device work on FP8 block-scaled weights (E4M3 codes, one f32 scale per block; see
// moe/weight_format.h) outside the projections themselves: widening to bf16 for the consumers
// that read nothing else, and quantising activations for the W8A8 GEMM. (Random FP8 weights are
// drawn in fill_launch.h.)
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moe::cuda::kernels {

// out = bf16(code x scale of its block) for `count` matrices [rows, cols], codes and out
// row-major and contiguous (16-byte aligned, cols and block_cols multiples of 16), scales
// [count, ceil(rows / block_rows), ceil(cols / block_cols)]. cudaErrorInvalidValue otherwise.
cudaError_t dequantize_fp8_blocks(const uint8_t* codes, const float* scales, long long count, long long rows,
                                  long long cols, int block_rows, int block_cols, uint16_t* out,
                                  cudaStream_t stream);

// Activations for an FP8 GEMM: x bf16 [rows, cols] quantised per row and 128 columns, scale =
// max |value| / 448 (1 for a block of zeros), q = E4M3(value x (1 / scale)): q [rows, cols],
// scales [rows, ceil(cols / 128)]. cols a multiple of 16, x 16-byte and q 8-byte aligned
// (cudaErrorInvalidValue otherwise). rows_on_device, when set, holds the rows to quantise (at most
// `rows`, read on the device).
cudaError_t quantize_rows_fp8(const void* x, int rows, const int* rows_on_device, int cols, void* q, float* scales,
                              cudaStream_t stream);
// The same with the scales block-major, [ceil(cols / 128), rows]: the layout of cuBLASLt's
// per-128 activation scales (Blas::linear_fp8_blocks).
cudaError_t quantize_rows_fp8_by_block(const void* x, int rows, int cols, void* q, float* scales, cudaStream_t stream);

}  // namespace moe::cuda::kernels
