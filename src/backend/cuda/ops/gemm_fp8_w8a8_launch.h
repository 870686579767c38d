// W8A8 dense projections of a few dozen to a few hundred rows on sm_90a (gemm_fp8_w8a8.cu):
// y[m, n] = Σ_kb xs[kb, row] · ws[n / 128, kb] · Σ_{k in kb} x[row, k] · w[n, k], x and w E4M3
// codes, f32 sums, the same product as cuBLASLt's block-scaled GEMM (Blas::linear_fp8_blocks),
// which takes the rows past kW8a8RowsMax. Below it cuBLASLt costs the same whatever the rows: on
// an H200, qwen3-30b-a3b's qkv projection (5120 x 2048) took 10.3-10.7 µs from 32 to 256 rows and
// its o projection (2048 x 4096) 15.2-15.6, slower than its own bf16 GEMM on twice the bytes
// (docs/perf/cublaslt-algorithm-choice.md): 128 x 128 tiles leave most of the device idle there.
// With this kernel instead, decode of qwen3-30b-a3b-fp8 on that H200: batch 64 +3.2%, batch 128
// +1.9% (docs/perf/fp8-dense-w8a8-rows.md).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe::cuda::kernels {

constexpr int64_t kW8a8RowsMax = 256;

// The split of k that gemm_fp8_w8a8_rows takes for this shape on a device of `sms`
// multiprocessors (1: none): the pieces of a tile run as one cluster of that many blocks.
int w8a8_rows_splits(int64_t m, int64_t n, int64_t k, int sms);

// x: E4M3 codes [m, k] row-major (16-byte aligned), x_scales [k / 128, x_scale_stride] (row r of
// block kb at kb * x_scale_stride + r); w: E4M3 codes [n, k] (16-byte aligned), w_scales
// [ceil(n / 128), k / 128]; y [m, ldy], f32 when y_f32 else bf16; k a multiple of 128, 1 <= m <=
// kW8a8RowsMax. Launched as a programmatic dependent (pdl.h). cudaErrorInvalidValue outside those
// limits, cudaErrorNotSupported without the driver's tensor-map encoder; sm_90a machine code only.
cudaError_t gemm_fp8_w8a8_rows(const void* x, const float* x_scales, int64_t x_scale_stride, const void* w,
                               const float* w_scales, void* y, bool y_f32, int64_t m, int64_t n, int64_t k,
                               int64_t ldy, int sms, cudaStream_t stream);

}  // namespace moe::cuda::kernels
