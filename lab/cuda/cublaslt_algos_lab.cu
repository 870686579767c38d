// Kernel lab: how far cuBLASLt's first heuristic choice (what Blas::plan takes) is from the best of
// the algorithms the heuristic offers, on the dense projections of a prefill and of a batch-64
// decode step (or the row counts given as arguments): qwen3-30b-a3b's fused qkv (5120 x 2048) and
// output (2048 x 4096) projections,
// in bf16 and in FP8 with 128 x 128 weight blocks and per-128 activation scales (the engine's two
// cuBLASLt forms, set up as src/backend/cuda/ops/blas.cpp sets them up).
//
// Method: for each shape, up to 16 algorithms from cublasLtMatmulAlgoGetHeuristic; each runs 8
// launches over 8 copies of the weights (so that the next launch's weights are not in L2), 5
// times untimed, then 20 times between events; µs a launch. Each algorithm's output is compared
// with the first one's (largest difference over largest magnitude), so that a fast wrong result
// cannot pass.
//
// Build: cmake -DMOE_BUILD_LAB=ON, target lab_cublaslt_algos; or by hand from the repository root:
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -o /tmp/cublaslt_algos \
//     lab/cuda/cublaslt_algos_lab.cu -lcublasLt
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "lab_timing.cuh"  // CHECK

namespace {

#define CHECK_LT(x)                                                                           \
  do {                                                                                        \
    cublasStatus_t s_ = (x);                                                                  \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                        \
      std::fprintf(stderr, "%s:%d cublasLt status %d\n", __FILE__, __LINE__, static_cast<int>(s_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)

constexpr int kCopies = 8;
constexpr size_t kWorkspace = 32u << 20;

struct Shape {
  const char* name;
  int m, n, k;  // y[m, n] = x[m, k] · w[n, k]ᵀ
};

float bf16_value(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

void run(cublasLtHandle_t handle, const Shape& s, bool fp8, void* workspace) {
  const size_t w_elems = static_cast<size_t>(s.n) * s.k, x_elems = static_cast<size_t>(s.m) * s.k;
  const size_t elem = fp8 ? 1 : 2;
  std::mt19937 rng(7);
  // Small random values: FP8 codes with exponents 4-9 and either sign (no NaN), bf16 in [-1, 1).
  std::vector<uint8_t> w_host(w_elems * elem * kCopies), x_host(x_elems * elem);
  if (fp8) {
    for (auto& b : w_host) b = static_cast<uint8_t>((rng() & 0x80) | (((rng() % 6) + 4) << 3) | (rng() & 7));
    for (auto& b : x_host) b = static_cast<uint8_t>((rng() & 0x80) | (((rng() % 6) + 4) << 3) | (rng() & 7));
  } else {
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    auto fill = [&](std::vector<uint8_t>& v) {
      auto* p = reinterpret_cast<__nv_bfloat16*>(v.data());
      for (size_t i = 0; i < v.size() / 2; ++i) p[i] = __float2bfloat16(u(rng));
    };
    fill(w_host);
    fill(x_host);
  }
  void *w = nullptr, *x = nullptr, *y = nullptr;
  float *w_scales = nullptr, *x_scales = nullptr;
  CHECK(cudaMalloc(&w, w_host.size()));
  CHECK(cudaMalloc(&x, x_host.size()));
  CHECK(cudaMalloc(&y, static_cast<size_t>(s.m) * s.n * 2));
  CHECK(cudaMemcpy(w, w_host.data(), w_host.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(x, x_host.data(), x_host.size(), cudaMemcpyHostToDevice));
  const size_t w_blocks = static_cast<size_t>((s.n + 127) / 128) * ((s.k + 127) / 128);
  const size_t x_blocks = static_cast<size_t>(s.m) * ((s.k + 127) / 128);
  std::vector<float> ws(w_blocks * kCopies), xs(x_blocks);
  for (auto& v : ws) v = std::ldexp(1.0f, -8) * (1.0f + (rng() % 8) / 8.0f);
  for (auto& v : xs) v = std::ldexp(1.0f, -8) * (1.0f + (rng() % 8) / 8.0f);
  CHECK(cudaMalloc(&w_scales, ws.size() * 4));
  CHECK(cudaMalloc(&x_scales, xs.size() * 4));
  CHECK(cudaMemcpy(w_scales, ws.data(), ws.size() * 4, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(x_scales, xs.data(), xs.size() * 4, cudaMemcpyHostToDevice));

  // Column-major, as blas.cpp: yᵀ[n, m] = w[n, k] · xᵀ[k, m], A = w ([k, n] used transposed).
  cublasLtMatmulDesc_t op;
  CHECK_LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t t = CUBLAS_OP_T;
  CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof(t)));
  if (fp8) {
    const cublasLtMatmulMatrixScale_t wm = CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F,
                                      xm = CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F;
    CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &wm, sizeof(wm)));
    CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &xm, sizeof(xm)));
    CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &w_scales, sizeof(w_scales)));
    CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &x_scales, sizeof(x_scales)));
  }
  const cudaDataType_t in = fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  cublasLtMatrixLayout_t a, b, d;
  CHECK_LT(cublasLtMatrixLayoutCreate(&a, in, s.k, s.n, s.k));
  CHECK_LT(cublasLtMatrixLayoutCreate(&b, in, s.k, s.m, s.k));
  CHECK_LT(cublasLtMatrixLayoutCreate(&d, CUDA_R_16BF, s.n, s.m, s.n));
  cublasLtMatmulPreference_t pref;
  CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
  CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &kWorkspace,
                                                sizeof(kWorkspace)));
  cublasLtMatmulHeuristicResult_t results[16];
  int found = 0;
  CHECK_LT(cublasLtMatmulAlgoGetHeuristic(handle, op, a, b, d, d, pref, 16, results, &found));

  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  const float alpha = 1.0f, beta = 0.0f;
  std::vector<uint16_t> first(static_cast<size_t>(s.m) * s.n), out(first.size());
  const double flops = 2.0 * s.m * s.n * s.k;
  std::printf("%s %s m=%d n=%d k=%d: %d algorithms\n", s.name, fp8 ? "fp8" : "bf16", s.m, s.n, s.k, found);
  for (int i = 0; i < found; ++i) {
    auto launch = [&](int copy) {
      const void* wc = static_cast<const char*>(w) + w_elems * elem * copy;
      if (fp8) {
        const float* sc = w_scales + w_blocks * copy;
        CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sc, sizeof(sc)));
      }
      return cublasLtMatmul(handle, op, &alpha, wc, a, x, b, &beta, y, d, y, d, &results[i].algo, workspace,
                            kWorkspace, nullptr);
    };
    if (launch(0) != CUBLAS_STATUS_SUCCESS) {
      std::printf("  algo %2d: does not run\n", i);
      continue;
    }
    CHECK(cudaDeviceSynchronize());
    CHECK(cudaMemcpy(out.data(), y, out.size() * 2, cudaMemcpyDeviceToHost));
    if (i == 0) first = out;
    double diff = 0.0, top = 0.0;
    for (size_t j = 0; j < out.size(); ++j) {
      diff = std::max(diff, static_cast<double>(std::fabs(bf16_value(out[j]) - bf16_value(first[j]))));
      top = std::max(top, static_cast<double>(std::fabs(bf16_value(first[j]))));
    }
    for (int r = 0; r < 5; ++r)
      for (int c = 0; c < kCopies; ++c) launch(c);
    CHECK(cudaEventRecord(e0));
    for (int r = 0; r < 20; ++r)
      for (int c = 0; c < kCopies; ++c) launch(c);
    CHECK(cudaEventRecord(e1));
    CHECK(cudaEventSynchronize(e1));
    float ms = 0.0f;
    CHECK(cudaEventElapsedTime(&ms, e0, e1));
    const double us = ms * 1e3 / (20.0 * kCopies);
    int tile = -1, stages = -1, splitk = -1, swizzle = -1, cluster = -1;
    size_t written = 0;
    cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_TILE_ID, &tile, sizeof(tile), &written);
    cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_STAGES_ID, &stages, sizeof(stages), &written);
    cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM, &splitk, sizeof(splitk), &written);
    cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING, &swizzle, sizeof(swizzle), &written);
    cublasLtMatmulAlgoConfigGetAttribute(&results[i].algo, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID, &cluster, sizeof(cluster), &written);
    std::printf("  algo %2d: %8.2f us  %6.1f TFLOP/s  diff/max %.2e  tile %d stages %d splitk %d swizzle %d cluster %d\n", i,
                us, flops / (us * 1e-6) / 1e12, top > 0 ? diff / top : diff, tile, stages, splitk, swizzle, cluster);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  cublasLtMatrixLayoutDestroy(a);
  cublasLtMatrixLayoutDestroy(b);
  cublasLtMatrixLayoutDestroy(d);
  cublasLtMatmulDescDestroy(op);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
  cudaFree(w);
  cudaFree(x);
  cudaFree(y);
  cudaFree(w_scales);
  cudaFree(x_scales);
}

}  // namespace

int main(int argc, char** argv) {
  cublasLtHandle_t handle;
  CHECK_LT(cublasLtCreate(&handle));
  void* workspace = nullptr;
  CHECK(cudaMalloc(&workspace, kWorkspace));
  // Row counts from the command line (default: a 2048-token prefill chunk and a batch-64 step).
  std::vector<int> rows;
  for (int i = 1; i < argc; ++i) rows.push_back(std::atoi(argv[i]));
  if (rows.empty()) rows = {2048, 64};
  for (int m : rows)
    for (const Shape& s : {Shape{"qkv", m, 5120, 2048}, Shape{"o", m, 2048, 4096}})
      for (bool fp8 : {true, false}) run(handle, s, fp8, workspace);
  cublasLtDestroy(handle);
  return 0;
}
