#include "backend/cuda/ops/blas.h"

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/ops/gemm_fp8_w8a8_launch.h"
#include "backend/cuda/ops/gemv_launch.h"

#define MOE_CUBLAS_CHECK(expr)                                                               \
  do {                                                                                       \
    cublasStatus_t moe_blas_status_ = (expr);                                                \
    if (moe_blas_status_ != CUBLAS_STATUS_SUCCESS)                                           \
      MOE_THROW(kInternal, "cuBLASLt error in {}: status {}", #expr,                         \
                static_cast<int>(moe_blas_status_));                                         \
  } while (0)

namespace moe::cuda {
namespace {

// The largest power of two (up to 256) dividing the address: cuBLASLt picks algorithms for the
// alignment it is promised, so the promise must be true.
int64_t alignment(const void* p) {
  const auto a = reinterpret_cast<uintptr_t>(p);
  int64_t al = 256;
  while (al > 1 && a % static_cast<uintptr_t>(al) != 0) al /= 2;
  return al;
}

void destroy(cublasLtMatmulDesc_t op, cublasLtMatrixLayout_t a, cublasLtMatrixLayout_t b,
             cublasLtMatrixLayout_t d) {
  if (a) cublasLtMatrixLayoutDestroy(a);
  if (b) cublasLtMatrixLayoutDestroy(b);
  if (d) cublasLtMatrixLayoutDestroy(d);
  if (op) cublasLtMatmulDescDestroy(op);
}

}  // namespace

Blas::Blas(size_t workspace_bytes) : workspace_bytes_(workspace_bytes) {
  MOE_CUBLAS_CHECK(cublasLtCreate(&handle_));
  MOE_CUDA_CHECK(cudaMalloc(&workspace_, workspace_bytes_));
  int device = 0, major = 0, minor = 0;
  MOE_CUDA_CHECK(cudaGetDevice(&device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms_, cudaDevAttrMultiProcessorCount, device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  MOE_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  sm90a_ = major == 9 && minor == 0;
}

Blas::~Blas() {
  for (auto& [key, p] : plans_) destroy(p.op, p.a, p.b, p.d);
  if (workspace_) cudaFree(workspace_);
  if (widened_) cudaFree(widened_);
  if (fp8_rows_) cudaFree(fp8_rows_);
  if (handle_) cublasLtDestroy(handle_);
}

void Blas::reserve_widened(size_t elements) {
  if (elements * 2 <= widened_bytes_) return;
  if (widened_) cudaFree(widened_);
  widened_ = nullptr;
  widened_bytes_ = 0;
  MOE_CUDA_CHECK(cudaMalloc(&widened_, elements * 2));
  widened_bytes_ = elements * 2;
}

uint16_t* Blas::widened(size_t elements) const {
  MOE_CHECK(elements * 2 <= widened_bytes_, kInternal, "a widened weight of {} values, {} reserved", elements,
            widened_bytes_ / 2);
  return widened_;
}

void Blas::reserve_fp8_rows(int64_t rows, int64_t cols) {
  if (rows <= fp8_rows_cap_ && cols <= fp8_cols_cap_) return;
  rows = std::max(rows, fp8_rows_cap_);
  cols = std::max(cols, fp8_cols_cap_);
  if (fp8_rows_) cudaFree(fp8_rows_);
  fp8_rows_ = nullptr;
  fp8_rows_cap_ = fp8_cols_cap_ = 0;
  fp8_rows_bytes_ = 0;
  // Codes first, then the scales at a 256-byte boundary.
  const size_t codes = (static_cast<size_t>(rows * cols) + 255) / 256 * 256;
  const size_t bytes = codes + static_cast<size_t>(rows * ((cols + 127) / 128)) * sizeof(float);
  MOE_CUDA_CHECK(cudaMalloc(&fp8_rows_, bytes));
  fp8_rows_cap_ = rows;
  fp8_cols_cap_ = cols;
  fp8_rows_bytes_ = bytes;
}

Blas::Fp8Rows Blas::fp8_rows(int64_t rows, int64_t cols) const {
  MOE_CHECK(rows <= fp8_rows_cap_ && cols <= fp8_cols_cap_, kInternal,
            "{} FP8 activation rows of {} values, room for {} of {}", rows, cols, fp8_rows_cap_, fp8_cols_cap_);
  const size_t codes = (static_cast<size_t>(fp8_rows_cap_ * fp8_cols_cap_) + 255) / 256 * 256;
  return {fp8_rows_, reinterpret_cast<float*>(fp8_rows_ + codes)};
}

// Row-major y = x · wᵀ is, read column-major, yᵀ[n, m] = w[n, k] · xᵀ[k, m]: A is w stored as a
// column-major [k, n] matrix used transposed, B is x stored as column-major [k, m].
// For FP8 blocks, w's scales are per 128 x 128 block and x's per 128 values of k, the inner
// dimension of both (the scale pointers are set per call).
const Blas::Plan* Blas::plan(const Key& key) {
  auto it = plans_.find(key);
  if (it != plans_.end()) return it->second.op ? &it->second : nullptr;
  const auto [out, m, n, k, ldx, ldy, batch, x_stride, w_stride, y_stride, al_x, al_w, al_y, fp8] = key;
  Plan p;
  const cudaDataType_t dtype = out == static_cast<int64_t>(OutType::kF32) ? CUDA_R_32F : CUDA_R_16BF;
  const cudaDataType_t in = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  try {
    MOE_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t transpose = CUBLAS_OP_T;
    MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &transpose,
                                                    sizeof(transpose)));
    if (fp8) {
      const cublasLtMatmulMatrixScale_t w_mode = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                                        x_mode = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
      MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &w_mode,
                                                      sizeof(w_mode)));
      MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &x_mode,
                                                      sizeof(x_mode)));
      // The heuristic finds no algorithm while the scale pointers are null: stand-ins until the
      // call sets the real ones.
      for (const auto attribute : {CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER})
        MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.op, attribute, &workspace_, sizeof(workspace_)));
    }
    MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, in, k, n, k));
    MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, in, k, m, ldx));
    MOE_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.d, dtype, n, m, ldy));
    if (batch > 1) {
      const int32_t count = static_cast<int32_t>(batch);
      const std::pair<cublasLtMatrixLayout_t, int64_t> strided[] = {{p.a, w_stride}, {p.b, x_stride}, {p.d, y_stride}};
      for (const auto& [layout, stride] : strided) {
        MOE_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(layout, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                          &count, sizeof(count)));
        MOE_CUBLAS_CHECK(cublasLtMatrixLayoutSetAttribute(
            layout, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof(stride)));
      }
    }
    cublasLtMatmulPreference_t pref = nullptr;
    MOE_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const uint32_t aw = static_cast<uint32_t>(al_w), ax = static_cast<uint32_t>(al_x),
                   ay = static_cast<uint32_t>(al_y);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                         &workspace_bytes_, sizeof(workspace_bytes_));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &aw, sizeof(aw));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &ax, sizeof(ax));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &ay, sizeof(ay));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &ay, sizeof(ay));
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle_, p.op, p.a, p.b, p.d, p.d,
                                                                 pref, 1, &result, &found);
    cublasLtMatmulPreferenceDestroy(pref);
    if (fp8 && (status != CUBLAS_STATUS_SUCCESS || found == 0)) {
      destroy(p.op, p.a, p.b, p.d);
      plans_.emplace(key, Plan{});
      return nullptr;
    }
    MOE_CHECK(status == CUBLAS_STATUS_SUCCESS && found > 0, kUnsupported,
              "cuBLASLt has no bf16 algorithm for m={} n={} k={} batch={} (status {})", m, n, k,
              batch, static_cast<int>(status));
    p.algo = result.algo;
  } catch (...) {
    destroy(p.op, p.a, p.b, p.d);
    throw;
  }
  return &plans_.emplace(key, p).first->second;
}

void Blas::linear(const void* x, const void* w, void* y, OutType out, int64_t m, int64_t n,
                  int64_t k, cudaStream_t stream, int64_t ldy) {
  linear_batched(x, k, 0, w, 0, y, out, ldy == 0 ? n : ldy, 0, m, n, k, 1, stream);
}

void Blas::linear_batched(const void* x, int64_t ldx, int64_t x_stride, const void* w,
                          int64_t w_stride, void* y, OutType out, int64_t ldy, int64_t y_stride,
                          int64_t m, int64_t n, int64_t k, int64_t batch, cudaStream_t stream) {
  // A few rows (decode steps): our weight-streaming kernel; cuBLASLt reaches about half the
  // bandwidth there.
  if (m <= kernels::kGemvMaxRows && k % 8 == 0 && ldx % 8 == 0 && x_stride % 8 == 0 &&
      w_stride % 8 == 0 && (reinterpret_cast<uintptr_t>(x) | reinterpret_cast<uintptr_t>(w)) % 16 == 0) {
    MOE_CUDA_CHECK(kernels::gemv_bf16_batched(x, static_cast<int>(ldx), x_stride, w, w_stride, y,
                                              out == OutType::kF32, static_cast<int>(ldy), y_stride,
                                              static_cast<int>(m), static_cast<int>(n),
                                              static_cast<int>(k), static_cast<int>(batch), stream));
    return;
  }
  const Key key{static_cast<int64_t>(out), m, n, k, ldx, ldy, batch, x_stride, w_stride, y_stride,
                alignment(x), alignment(w), alignment(y), 0};
  const Plan& p = *plan(key);
  const float alpha = 1.0f, beta = 0.0f;
  MOE_CUBLAS_CHECK(cublasLtMatmul(handle_, p.op, &alpha, w, p.a, x, p.b, &beta, y, p.d, y, p.d,
                                  &p.algo, workspace_, workspace_bytes_, stream));
}

const Blas::Plan* Blas::fp8_blocks_plan(const void* x, const float* x_scales, const void* w, const float* w_scales,
                                        const void* y, OutType out, int64_t m, int64_t n, int64_t k, int64_t ldy) {
  if (m < 1 || m % kFp8BlockRowMultiple != 0 || n < 1 || k % (128 * kFp8BlockColumnMultiple) != 0 || !x_scales ||
      !w_scales ||
      (reinterpret_cast<uintptr_t>(x_scales) | reinterpret_cast<uintptr_t>(w_scales)) % 16 != 0)
    return nullptr;
  const Key key{static_cast<int64_t>(out), m, n, k, k, ldy == 0 ? n : ldy, 1, 0, 0, 0,
                alignment(x), alignment(w), alignment(y), 1};
  return plan(key);
}

bool Blas::runs_w8a8_rows(const void* x, const float* x_scales, const void* w, const float* w_scales, int64_t m,
                          int64_t n, int64_t k) const {
  // The same contract as cuBLASLt's form below (row and block multiples, 16-byte aligned scales),
  // so that what runs does not depend on the device.
  const auto a16 = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return sm90a_ && m >= 1 && m <= kernels::kW8a8RowsMax && m % kFp8BlockRowMultiple == 0 && n >= 1 &&
         k % (128 * kFp8BlockColumnMultiple) == 0 && x_scales && w_scales && a16(x) && a16(w) && a16(x_scales) &&
         a16(w_scales);
}

bool Blas::runs_fp8_blocks(const void* x, const float* x_scales, const void* w, const float* w_scales, const void* y,
                           OutType out, int64_t m, int64_t n, int64_t k, int64_t ldy) {
  return runs_w8a8_rows(x, x_scales, w, w_scales, m, n, k) ||
         fp8_blocks_plan(x, x_scales, w, w_scales, y, out, m, n, k, ldy) != nullptr;
}

bool Blas::linear_fp8_blocks(const void* x, const float* x_scales, const void* w, const float* w_scales, void* y,
                             OutType out, int64_t m, int64_t n, int64_t k, cudaStream_t stream, int64_t ldy) {
  if (runs_w8a8_rows(x, x_scales, w, w_scales, m, n, k)) {
    MOE_CUDA_CHECK(kernels::gemm_fp8_w8a8_rows(x, x_scales, m, w, w_scales, y, out == OutType::kF32, m, n, k,
                                               ldy == 0 ? n : ldy, sms_, stream));
    return true;
  }
  const Plan* p = fp8_blocks_plan(x, x_scales, w, w_scales, y, out, m, n, k, ldy);
  if (!p) return false;
  MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scales,
                                                  sizeof(w_scales)));
  MOE_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p->op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scales,
                                                  sizeof(x_scales)));
  const float alpha = 1.0f, beta = 0.0f;
  MOE_CUBLAS_CHECK(cublasLtMatmul(handle_, p->op, &alpha, w, p->a, x, p->b, &beta, y, p->d, y, p->d,
                                  &p->algo, workspace_, workspace_bytes_, stream));
  return true;
}

}  // namespace moe::cuda
