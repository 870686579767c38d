// Dense projections by weight format: the one place a projection's kernel is chosen from its
// weight's format (backend/device_matrix.h). bf16 weights run through Blas (the weight-streaming
// GEMV for a few rows, cuBLASLt otherwise); FP8 blocks read as codes up to 32 rows (the same GEMV
// for 1-2 rows, a tensor-core kernel from 3), else W8A8 through Blas::linear_fp8_blocks (our
// wgmma kernel up to 256 rows, cuBLASLt's block-scaled GEMM past them; x quantised into Blas's
// reserved room), or, for shapes it does not take, widened to bf16 into
// Blas's reserved room first; a format without kernels is refused with one line naming it. A new
// format adds its case here and its kernels, not a new signature for callers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/ops/blas.h"
#include "backend/device_matrix.h"

namespace moe::cuda {

// y[m, w.rows] = x[m, w.cols] · wᵀ, f32 accumulation; x bf16, y bf16 or f32 with `ldy`
// elements between its rows (0: w.rows), so that projections can write the column blocks of
// one output.
void project(Blas& blas, const void* x, const DeviceMatrix& w, void* y, OutType out, int64_t m, cudaStream_t stream,
             int64_t ldy = 0);

// An FP8 projection's input as its producer may write it, for project() with `in`: where project()
// would run x through the W8A8 GEMM, its first `rows` rows (a multiple of 4) as E4M3 codes
// [rows, w.cols] and block-major scales [w.cols / 128, rows] (quantize_rows_fp8_by_block's
// layout) in Blas's reserved room, the rows after them as bf16 x. rows = 0 where project() would
// not: the input is bf16 x alone.
struct Fp8Input {
  uint8_t* codes = nullptr;
  float* scales = nullptr;
  int64_t rows = 0;
};
Fp8Input fp8_input_room(Blas& blas, const DeviceMatrix& w, const void* y, OutType out, int64_t m, int64_t ldy = 0);

// project() for an input whose first in.rows rows are in `in` (fp8_input_room's for the same
// arguments, written), the rest in x; with in.rows = 0 project() itself.
void project(Blas& blas, const Fp8Input& in, const void* x, const DeviceMatrix& w, void* y, OutType out, int64_t m,
             cudaStream_t stream, int64_t ldy = 0);

// Whether project() over FP8 blocks of `cols` columns needs Blas's reserved room (rows quantised
// for the W8A8 GEMM, or the matrix widened) for steps of up to `rows` rows.
bool fp8_projection_needs_room(int64_t rows, int64_t cols);

// One product per matrix of w (w.count of them, latent attention's heads): product b reads
// x + b * x_stride (rows ldx apart) and writes y + b * y_stride (rows ldy apart); strides in
// elements.
void project_each(Blas& blas, const void* x, int64_t ldx, int64_t x_stride, const DeviceMatrix& w, void* y,
                  OutType out, int64_t ldy, int64_t y_stride, int64_t m, cudaStream_t stream);

}  // namespace moe::cuda
