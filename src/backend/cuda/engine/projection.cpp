#include "backend/cuda/engine/projection.h"

namespace moe::cuda {

void project(Blas& blas, const void* x, const DeviceMatrix& w, void* y, OutType out, int64_t m, cudaStream_t stream,
             int64_t ldy) {
  MOE_CHECK(w.count == 1, kInternal, "a projection over {} stacked matrices", w.count);
  blas.linear(x, w.bf16_data("dense projection"), y, out, m, w.rows, w.cols, stream, ldy);
}

void project_each(Blas& blas, const void* x, int64_t ldx, int64_t x_stride, const DeviceMatrix& w, void* y,
                  OutType out, int64_t ldy, int64_t y_stride, int64_t m, cudaStream_t stream) {
  blas.linear_batched(x, ldx, x_stride, w.bf16_data("per-head projection"), w.matrix_stride(), y, out, ldy, y_stride,
                      m, w.rows, w.cols, w.count, stream);
}

}  // namespace moe::cuda
