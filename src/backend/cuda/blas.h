// Dense projections (rows <= 8 through our own weight-streaming kernel, gemv.cu) or cuBLASLt: y[m, n] = x[m, k] · w[n, k]ᵀ with x and w bf16 (w row-major
// as in nn.Linear), f32 accumulation, y bf16 or f32. The algorithm for each shape is chosen once
// and cached, and the workspace is allocated at construction, so calls made during CUDA-graph
// capture allocate nothing.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <tuple>

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

  size_t workspace_bytes() const { return workspace_bytes_; }

 private:
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  const Plan& plan(OutType out, int64_t m, int64_t n, int64_t k, int64_t ldy);

  cublasLtHandle_t handle_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  std::map<std::tuple<int, int64_t, int64_t, int64_t, int64_t>, Plan> plans_;
};

}  // namespace moe::cuda
