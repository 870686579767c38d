#include "backend/cuda/engine/projection.h"

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/ops/fp8_blocks_launch.h"
#include "backend/cuda/ops/gemv_launch.h"

namespace moe::cuda {

void project(Blas& blas, const void* x, const DeviceMatrix& w, void* y, OutType out, int64_t m, cudaStream_t stream,
             int64_t ldy) {
  MOE_CHECK(w.count == 1, kInternal, "a projection over {} stacked matrices", w.count);
  if (!w.format.scaled()) {
    blas.linear(x, w.bf16_data("dense projection"), y, out, m, w.rows, w.cols, stream, ldy);
    return;
  }
  MOE_CHECK(w.format == kFp8Blocks, kUnsupported, "dense projection: no CUDA kernel reads {} weights",
            w.format.name());
  // A few rows: the weight-streaming GEMV reads the codes. More: the matrix widened to bf16 for
  // cuBLASLt (a W8A8 GEMM is to replace this).
  if (m <= kernels::kGemvMaxRows && w.cols % 16 == 0) {
    MOE_CUDA_CHECK(kernels::gemv_fp8(x, w.data, w.scales, y, out == OutType::kF32, static_cast<int>(m),
                                     static_cast<int>(w.rows), static_cast<int>(w.cols),
                                     static_cast<int>(ldy ? ldy : w.rows), stream));
    return;
  }
  uint16_t* wide = blas.widened(static_cast<size_t>(w.rows * w.cols));
  MOE_CUDA_CHECK(kernels::dequantize_fp8_blocks(static_cast<const uint8_t*>(w.data), w.scales, 1, w.rows, w.cols,
                                                static_cast<int>(w.format.block_rows),
                                                static_cast<int>(w.format.block_cols), wide, stream));
  blas.linear(x, wide, y, out, m, w.rows, w.cols, stream, ldy);
}

void project_each(Blas& blas, const void* x, int64_t ldx, int64_t x_stride, const DeviceMatrix& w, void* y,
                  OutType out, int64_t ldy, int64_t y_stride, int64_t m, cudaStream_t stream) {
  blas.linear_batched(x, ldx, x_stride, w.bf16_data("per-head projection"), w.matrix_stride(), y, out, ldy, y_stride,
                      m, w.rows, w.cols, w.count, stream);
}

}  // namespace moe::cuda
