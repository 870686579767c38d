#include "backend/cuda/blas.h"

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/gemv_launch.h"

#define MOE_CUBLAS_CHECK(expr)                                                               \
  do {                                                                                       \
    cublasStatus_t moe_blas_status_ = (expr);                                                \
    if (moe_blas_status_ != CUBLAS_STATUS_SUCCESS)                                           \
      MOE_THROW(kInternal, "cuBLASLt error in {}: status {}", #expr,                         \
                static_cast<int>(moe_blas_status_));                                         \
  } while (0)

namespace moe::cuda {

Blas::Blas(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  MOE_CUBLAS_CHECK(cublasLtCreate(&handle_));
  MOE_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
}

Blas::~Blas() {
  for (auto& [key, p] : plans_) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.d);
    cublasLtMatmulDescDestroy(p.op);
  }
  if (workspace_) cudaFree(workspace_);
  if (handle_) cublasLtDestroy(handle_);
}

// Row-major y = x · wᵀ is, read column-major, yᵀ[n, m] = w[n, k] · xᵀ[k, m]: A is w stored as a
// column-major [k, n] matrix used transposed, B is x stored as column-major [k, m].
const Blas::Plan& Blas::plan(OutType out, int64_t m, int64_t n, int64_t k, int64_t ldy) {
  auto key = std::make_tuple(static_cast<int>(out), m, n, k, ldy);
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second;
  Plan p;
  const cudaDataType_t dtype = out == OutType::kF32 ? CUDA_R_32F : CUDA_R_16BF;
  MOE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t transpose = CUBLAS_OP_T;
  MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                                  sizeof(transpose)));
  MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, k, n, k));
  MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, k, m, k));
  MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, dtype, n, m, ldy));
  cublasLtMatmulPreference_t pref = nullptr;
  MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(
      pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes_, sizeof(workspace_bytes_)));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.d, p.d, pref,
                                                         1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  if (status != CUBLAS_STATUS_SUCCESS || found == 0) {
    cublasLtMatrixLayoutDestroy(p.a);
    cublasLtMatrixLayoutDestroy(p.b);
    cublasLtMatrixLayoutDestroy(p.d);
    cublasLtMatmulDescDestroy(p.op);
    MOE_THROW(kUnsupported, "cuBLASLt has no bf16 algorithm for m={} n={} k={} (status {})", m, n,
              k, static_cast<int>(status));
  }
  p.algo = result.algo;
  return plans_.emplace(key, p).first->second;
}

void Blas::linear(const void* x, const void* w, void* y, OutType out, int64_t m, int64_t n,
                  int64_t k, cudaStream_t stream, int64_t ldy) {
  if (ldy == 0) ldy = n;
  // A few rows (decode steps): our weight-streaming kernel; cuBLASLt reaches about half the
  // bandwidth there.
  if (m <= kernels::kGemvMaxRows && k % 8 == 0 &&
      (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) % 16 == 0) {
    MOE_CUDA_CHECK(kernels::gemv_bf16(x, w, y, out == OutType::kF32, static_cast<int>(m),
                                      static_cast<int>(n), static_cast<int>(k), static_cast<int>(ldy), stream));
    return;
  }
  const Plan& p = plan(out, m, n, k, ldy);
  const float alpha = 1.0f, beta = 0.0f;
  MOE_CUBLAS_CHECK(cublasLtMatmul(handle_, p.op, &alpha, w, p.a, x, p.b, &beta, y, p.d, y, p.d,
                                  &p.algo, workspace_, workspace_bytes_, stream));
}

}  // namespace moe::cuda
