#include <cublasLt.h>
#include <cuda_runtime.h>

#include <utility>

#include "backend/cuda/ops/blas.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/peer_access.h"
#include "backend/device_info.h"

namespace moe {
namespace {

// Times `reps` calls of `body` on `stream` after one warm-up, with events.
template <typename F>
double seconds_per_call(cudaStream_t stream, int reps, F body) {
  body();
  cudaEvent_t start, stop;
  MOE_CUDA_CHECK(cudaEventCreate(&start));
  MOE_CUDA_CHECK(cudaEventCreate(&stop));
  MOE_CUDA_CHECK(cudaEventRecord(start, stream));
  for (int i = 0; i < reps; ++i) body();
  MOE_CUDA_CHECK(cudaEventRecord(stop, stream));
  MOE_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return ms * 1e-3 / reps;
}

}  // namespace

double measure_copy_bandwidth(int device) {
  MOE_CUDA_CHECK(cudaSetDevice(device));
  const size_t bytes = size_t(1) << 30;
  void *a = nullptr, *b = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&a, bytes));
  MOE_CUDA_CHECK(cudaMalloc(&b, bytes));
  MOE_CUDA_CHECK(cudaMemset(a, 1, bytes));
  const double s = seconds_per_call(nullptr, 10, [&] {
    MOE_CUDA_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, nullptr));
  });
  cudaFree(a);
  cudaFree(b);
  return 2.0 * static_cast<double>(bytes) / s;
}

double measure_peer_bandwidth(int from, int to) {
  int can_to = 0, can_from = 0;
  MOE_CUDA_CHECK(cudaDeviceCanAccessPeer(&can_to, from, to));
  MOE_CUDA_CHECK(cudaDeviceCanAccessPeer(&can_from, to, from));
  if (can_to && can_from) cuda::enable_peer_access({from, to});  // else the copy goes through the host
  const size_t bytes = size_t(256) << 20;
  void *src = nullptr, *dst = nullptr;
  MOE_CUDA_CHECK(cudaSetDevice(to));
  MOE_CUDA_CHECK(cudaMalloc(&dst, bytes));
  MOE_CUDA_CHECK(cudaSetDevice(from));
  MOE_CUDA_CHECK(cudaMalloc(&src, bytes));
  const double s = seconds_per_call(nullptr, 10, [&] {
    MOE_CUDA_CHECK(cudaMemcpyPeerAsync(dst, to, src, from, bytes, nullptr));
  });
  cudaFree(src);
  MOE_CUDA_CHECK(cudaSetDevice(to));
  cudaFree(dst);
  MOE_CUDA_CHECK(cudaSetDevice(from));
  return static_cast<double>(bytes) / s;
}

double measure_bf16_matmul_rate(int device) {
  MOE_CUDA_CHECK(cudaSetDevice(device));
  const int64_t n = 8192;
  const size_t bytes = static_cast<size_t>(n * n) * 2;
  void *x = nullptr, *w = nullptr, *y = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&x, bytes));
  MOE_CUDA_CHECK(cudaMalloc(&w, bytes));
  MOE_CUDA_CHECK(cudaMalloc(&y, bytes));
  // Small finite values (0x3c00 is bf16 0.0078125) so no denormal or infinity slows the units.
  MOE_CUDA_CHECK(cudaMemset(x, 0x3c, bytes));
  MOE_CUDA_CHECK(cudaMemset(w, 0x3c, bytes));
  double s = 0;
  {
    cuda::Blas blas;
    s = seconds_per_call(nullptr, 10, [&] { blas.linear(x, w, y, cuda::OutType::kBf16, n, n, n, nullptr); });
  }
  cudaFree(x);
  cudaFree(w);
  cudaFree(y);
  return 2.0 * static_cast<double>(n) * n * n / s;
}

double measure_fp8_matmul_rate(int device) {
  MOE_CUDA_CHECK(cudaSetDevice(device));
  const int64_t n = 8192;
  void *x = nullptr, *w = nullptr, *y = nullptr;
  MOE_CUDA_CHECK(cudaMalloc(&x, static_cast<size_t>(n * n)));
  MOE_CUDA_CHECK(cudaMalloc(&w, static_cast<size_t>(n * n)));
  MOE_CUDA_CHECK(cudaMalloc(&y, static_cast<size_t>(n * n) * 2));
  // 0x30 is E4M3 0.125: finite, normal, and the sums of 8192 products stay well inside bf16.
  MOE_CUDA_CHECK(cudaMemset(x, 0x30, static_cast<size_t>(n * n)));
  MOE_CUDA_CHECK(cudaMemset(w, 0x30, static_cast<size_t>(n * n)));
  // E4M3 x E4M3 -> bf16 with f32 accumulation, tensor-wide scales left at 1; cuBLASLt takes FP8
  // operands in the "TN" layout only (A transposed).
  cublasLtHandle_t handle = nullptr;
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, d = nullptr;
  void* workspace = nullptr;
  const size_t workspace_bytes = 32u << 20;
  double s = 0;
  bool ok = cublasLtCreate(&handle) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatrixLayoutCreate(&a, CUDA_R_8F_E4M3, n, n, n) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatrixLayoutCreate(&b, CUDA_R_8F_E4M3, n, n, n) == CUBLAS_STATUS_SUCCESS &&
            cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, n, n, n) == CUBLAS_STATUS_SUCCESS &&
            cudaMalloc(&workspace, workspace_bytes) == cudaSuccess;
  cublasLtMatmulHeuristicResult_t result{};
  if (ok) {
    const cublasOperation_t t = CUBLAS_OP_T;
    cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t));
    cublasLtMatmulPreference_t pref = nullptr;
    int found = 0;
    ok = cublasLtMatmulPreferenceCreate(&pref) == CUBLAS_STATUS_SUCCESS;
    if (ok) {
      cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                           sizeof(workspace_bytes));
      ok = cublasLtMatmulAlgoGetHeuristic(handle, op, a, b, d, d, pref, 1, &result, &found) == CUBLAS_STATUS_SUCCESS &&
           found > 0;
      cublasLtMatmulPreferenceDestroy(pref);
    }
  }
  if (ok) {
    const float alpha = 1.0f, beta = 0.0f;
    cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
    s = seconds_per_call(nullptr, 10, [&] {
      const cublasStatus_t st = cublasLtMatmul(handle, op, &alpha, w, a, x, b, &beta, y, d, y, d, &result.algo,
                                               workspace, workspace_bytes, nullptr);
      if (st != CUBLAS_STATUS_SUCCESS) status = st;
    });
    ok = status == CUBLAS_STATUS_SUCCESS;
  }
  if (d) cublasLtMatrixLayoutDestroy(d);
  if (b) cublasLtMatrixLayoutDestroy(b);
  if (a) cublasLtMatrixLayoutDestroy(a);
  if (op) cublasLtMatmulDescDestroy(op);
  if (handle) cublasLtDestroy(handle);
  cudaFree(workspace);
  cudaFree(x);
  cudaFree(w);
  cudaFree(y);
  MOE_CHECK(ok && s > 0, kUnsupported, "cuBLASLt ran no E4M3 matmul on this device to measure the FP8 rate");
  return 2.0 * static_cast<double>(n) * n * n / s;
}

}  // namespace moe
