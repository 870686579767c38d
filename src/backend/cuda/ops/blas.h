// Dense projections: y[m, n] = x[m, k] · w[n, k]ᵀ with x and w bf16 (w row-major as in
// nn.Linear), f32 accumulation, y bf16 or f32. A few rows (decode) go through our own
// weight-streaming kernel (gemv.cu), more through cuBLASLt. The cuBLASLt algorithm for each
// shape is chosen once and cached and the workspace is allocated at construction, so calls made
// during CUDA-graph capture allocate nothing.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <map>

namespace moe::cuda {

enum class OutType { kBf16, kF32 };

class Blas {
 public:
  explicit Blas(size_t workspace_bytes = 32u << 20);
  ~Blas();
  Blas(const Blas&) = delete;
  Blas& operator=(const Blas&) = delete;

  // ldy: elements between rows of y (0: n), so that several projections can write the column
  // blocks of one output.
  void linear(const void* x, const void* w, void* y, OutType out, int64_t m, int64_t n, int64_t k,
              cudaStream_t stream, int64_t ldy = 0);

  // `batch` independent projections (latent attention's per-head products): batch b reads
  // x + b * x_stride with rows ldx apart, w + b * w_stride ([n, k] row-major), and writes
  // y + b * y_stride with rows ldy apart. Strides in elements.
  void linear_batched(const void* x, int64_t ldx, int64_t x_stride, const void* w, int64_t w_stride,
                      void* y, OutType out, int64_t ldy, int64_t y_stride, int64_t m, int64_t n,
                      int64_t k, int64_t batch, cudaStream_t stream);

  size_t workspace_bytes() const { return workspace_bytes_ + widened_bytes_; }

  // Room for a weight matrix of `elements` values widened to bf16 (a block-scaled one for the
  // bf16 GEMM: projection.cpp), allocated now so that none is allocated during graph capture.
  void reserve_widened(size_t elements);
  // That room, for at most the reserved elements; kInternal past them.
  uint16_t* widened(size_t elements) const;

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  // out, m, n, k, ldx, ldy, batch, x_stride, w_stride, y_stride, and the pointers' alignments.
  using Key = std::array<int64_t, 13>;
  const Plan& plan(const Key& key);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  uint16_t* widened_ = nullptr;
  size_t widened_bytes_ = 0;
  std::map<Key, Plan> plans_;
};

}  // namespace moe::cuda
