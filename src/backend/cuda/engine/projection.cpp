#include "backend/cuda/engine/projection.h"

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/ops/fp8_blocks_launch.h"
#include "backend/cuda/ops/gemm_fp8_rows_launch.h"
#include "backend/cuda/ops/gemv_launch.h"

namespace moe::cuda {
namespace {

void gemv_fp8(const void* x, const DeviceMatrix& w, void* y, OutType out, int64_t m, cudaStream_t stream,
              int64_t ldy) {
  MOE_CUDA_CHECK(kernels::gemv_fp8(x, w.data, w.scales, y, out == OutType::kF32, static_cast<int>(m),
                                   static_cast<int>(w.rows), static_cast<int>(w.cols),
                                   static_cast<int>(ldy ? ldy : w.rows), stream));
}

// Rows read straight from the codes, each weight once for all of them.
bool fp8_direct(int64_t rows, int64_t cols) { return rows <= kernels::kFp8RowsMaxRows && cols % 16 == 0; }

}  // namespace

bool fp8_projection_needs_room(int64_t rows, int64_t cols) { return !fp8_direct(rows, cols); }

void project(Blas& blas, const void* x, const DeviceMatrix& w, void* y, OutType out, int64_t m, cudaStream_t stream,
             int64_t ldy) {
  MOE_CHECK(w.count == 1, kInternal, "a projection over {} stacked matrices", w.count);
  if (!w.format.scaled()) {
    blas.linear(x, w.bf16_data("dense projection"), y, out, m, w.rows, w.cols, stream, ldy);
    return;
  }
  MOE_CHECK(w.format == kFp8Blocks, kUnsupported, "dense projection: no CUDA kernel reads {} weights",
            w.format.name());
  // Up to 32 rows the codes are read once: by the GEMV for 1-2 rows, by the tensor-core kernel
  // (exact bf16 widening) from 3 (gemm_fp8_rows_launch.h says where each is faster).
  if (fp8_direct(m, w.cols)) {
    if (m < kernels::kFp8RowsMinRows) {
      gemv_fp8(x, w, y, out, m, stream, ldy);
      return;
    }
    MOE_CUDA_CHECK(kernels::gemm_fp8_rows(x, w.data, w.scales, y, out == OutType::kF32, static_cast<int>(m),
                                          static_cast<int>(w.rows), static_cast<int>(w.cols),
                                          static_cast<int>(ldy ? ldy : w.rows), stream));
    return;
  }
  // More: W8A8, x quantised per row and 128 columns (fp8_input_room), through Blas::linear_fp8_blocks.
  const Fp8Input in = fp8_input_room(blas, w, y, out, m, ldy);
  if (in.rows > 0) {
    MOE_CUDA_CHECK(kernels::quantize_rows_fp8_by_block(x, static_cast<int>(in.rows), static_cast<int>(w.cols),
                                                       in.codes, in.scales, stream));
    project(blas, in, x, w, y, out, m, stream, ldy);
    return;
  }
  // Otherwise the matrix widened to bf16 for cuBLASLt.
  uint16_t* wide = blas.widened(static_cast<size_t>(w.rows * w.cols));
  MOE_CUDA_CHECK(kernels::dequantize_fp8_blocks(static_cast<const uint8_t*>(w.data), w.scales, 1, w.rows, w.cols,
                                                static_cast<int>(w.format.block_rows),
                                                static_cast<int>(w.format.block_cols), wide, stream));
  blas.linear(x, wide, y, out, m, w.rows, w.cols, stream, ldy);
}

Fp8Input fp8_input_room(Blas& blas, const DeviceMatrix& w, const void* y, OutType out, int64_t m, int64_t ldy) {
  // W8A8 where the codes are not read directly (Blas::linear_fp8_blocks), which takes row counts
  // that are multiples of 4 (blas.h); the last one to three rows go through the GEMV (the
  // weights are then in L2). This is the numerics of the engines these checkpoints are deployed
  // on (activations rounded to E4M3 per 128 values), not the CPU reference's.
  if (w.count != 1 || !(w.format == kFp8Blocks) || fp8_direct(m, w.cols) || w.format.block_rows != 128 ||
      w.format.block_cols != 128 || w.cols % (128 * kFp8BlockColumnMultiple) != 0)
    return {};
  const int64_t head = m / kFp8BlockRowMultiple * kFp8BlockRowMultiple;
  if (!blas.has_fp8_rows(head, w.cols)) return {};
  const Blas::Fp8Rows room = blas.fp8_rows(head, w.cols);
  if (!blas.runs_fp8_blocks(room.codes, room.scales, w.data, w.scales, y, out, head, w.rows, w.cols, ldy)) return {};
  return {room.codes, room.scales, head};
}

void project(Blas& blas, const Fp8Input& in, const void* x, const DeviceMatrix& w, void* y, OutType out, int64_t m,
             cudaStream_t stream, int64_t ldy) {
  if (in.rows == 0) {
    project(blas, x, w, y, out, m, stream, ldy);
    return;
  }
  MOE_CHECK(in.rows <= m && blas.linear_fp8_blocks(in.codes, in.scales, w.data, w.scales, y, out, in.rows, w.rows,
                                                   w.cols, stream, ldy),
            kInternal, "dense projection: {} quantised rows of {} that the block-scaled GEMM does not take", in.rows,
            m);
  if (in.rows < m) {
    const size_t y_size = out == OutType::kF32 ? 4 : 2;
    gemv_fp8(static_cast<const uint16_t*>(x) + in.rows * w.cols, w,
             static_cast<char*>(y) + static_cast<size_t>(in.rows * (ldy ? ldy : w.rows)) * y_size, out, m - in.rows,
             stream, ldy);
  }
}

void project_each(Blas& blas, const void* x, int64_t ldx, int64_t x_stride, const DeviceMatrix& w, void* y,
                  OutType out, int64_t ldy, int64_t y_stride, int64_t m, cudaStream_t stream) {
  blas.linear_batched(x, ldx, x_stride, w.bf16_data("per-head projection"), w.matrix_stride(), y, out, ldy, y_stride,
                      m, w.rows, w.cols, w.count, stream);
}

}  // namespace moe::cuda
