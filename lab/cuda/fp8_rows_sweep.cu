// Kernel lab: the dense FP8 projection of 1-32 rows (src/backend/cuda/ops/gemm_fp8_rows.cu) over
// the shapes of a decode step: qwen3-30b-a3b's fused qkv (5120 x 2048) and output (2048 x 4096)
// projections, DeepSeek-V3's q_b (24576 x 1536) and output (7168 x 16384). For each row count the
// library's own choice (`gemm_fp8_rows`) is timed beside every (tiles a warp, k split) variant of
// the same kernel (at 8, 10, 16, 24 and 32 rows), and beside two references: the library's FP8
// GEMV at 1-8 rows and cuBLAS's bf16 GEMM on the same shape and rows (what a bf16 checkpoint pays
// per call, twice the bytes).
//
// Method: each launch reads a different copy of the weights (the copies span at least 200 MB, 4x
// the L2), chained in a graph of 48 launches replayed 40 times (lab_timing.cuh: time_chained); µs
// a launch and the weight bytes over that time. Every variant's output is checked against a
// double-precision product on the host (all rows, the first 256 columns).
//
// Build: cmake -DMOE_BUILD_LAB=ON, target lab_fp8_rows_sweep; or by hand from the repository root:
//   nvcc -O3 -std=c++20 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude -Ilab/cuda \
//     --expt-relaxed-constexpr -o /tmp/fp8_rows_sweep lab/cuda/fp8_rows_sweep.cu \
//     src/backend/cuda/ops/gemv.cu -lcublas
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "backend/cuda/ops/gemm_fp8_rows.cu"
#include "backend/cuda/ops/gemv_launch.h"
#include "lab_timing.cuh"

namespace k = moe::cuda::kernels;

namespace {

float e4m3_value(uint8_t q) {
  __nv_fp8_e4m3 v;
  std::memcpy(&v, &q, 1);
  return static_cast<float>(v);
}

struct Shape {
  const char* name;
  int n, k;
};

template <typename Launch>
void report(const char* label, int m, const Shape& sh, int copies, const std::vector<uint8_t*>& w,
            const std::vector<float*>& s, const void* x, float* y, const std::vector<double>& want,
            Launch&& launch) {
  CHECK(cudaMemset(y, 0xff, static_cast<size_t>(m) * sh.n * 4));
  CHECK(launch(x, w[0], s[0], y, m, sh, nullptr));
  CHECK(cudaDeviceSynchronize());
  std::vector<float> got(static_cast<size_t>(m) * sh.n);
  CHECK(cudaMemcpy(got.data(), y, got.size() * 4, cudaMemcpyDeviceToHost));
  double num = 0, den = 0;
  const int cols = std::min(sh.n, 256);
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < cols; ++j) {
      const double d = got[static_cast<size_t>(i) * sh.n + j] - want[static_cast<size_t>(i) * cols + j];
      num += std::isfinite(d) ? d * d : 1e30;
      den += want[static_cast<size_t>(i) * cols + j] * want[static_cast<size_t>(i) * cols + j];
    }
  const double us = lab::time_chained(48, [&](int l, cudaStream_t st) {
    CHECK(launch(x, w[l % copies], s[l % copies], y, m, sh, st));
  });
  const double bytes = static_cast<double>(sh.n) * sh.k;
  std::printf("  %-22s m=%2d %8.2f us %7.0f GB/s  rel.err %.1e\n", label, m, us, bytes / us / 1e3,
              std::sqrt(num / den));
}

template <int MT, int R, int KS>
cudaError_t variant(const void* x, const void* w, const float* s, float* y, int m, const Shape& sh,
                    cudaStream_t st) {
  return k::fp8_rows::launch<MT, R, KS>(x, w, s, y, true, m, sh.n, sh.k, sh.n, st);
}

template <int MT>
void sweep(int m, const Shape& sh, int copies, const std::vector<uint8_t*>& w, const std::vector<float*>& s,
           const void* x, float* y, const std::vector<double>& want) {
  const k::fp8_rows::Split pick = k::fp8_rows::choose_split(MT, sh.n);
  std::printf(" library picks r=%d ks=%d\n", pick.r, pick.ks);
  auto each = [&](const char* label, auto fn) { report(label, m, sh, copies, w, s, x, y, want, fn); };
  each("library", [](const void* x, const void* w, const float* s, float* y, int m, const Shape& sh, cudaStream_t st) {
    return k::gemm_fp8_rows(x, w, s, y, true, m, sh.n, sh.k, sh.n, st);
  });
  each("r=1 ks=2", variant<MT, 1, 2>);
  each("r=1 ks=4", variant<MT, 1, 4>);
  each("r=1 ks=8", variant<MT, 1, 8>);
  each("r=2 ks=2", variant<MT, 2, 2>);
  each("r=2 ks=4", variant<MT, 2, 4>);
  each("r=2 ks=8", variant<MT, 2, 8>);
}

}  // namespace

int main() {
  const Shape shapes[] = {{"qwen3 qkv", 5120, 2048}, {"qwen3 o", 2048, 4096}, {"deepseek q_b", 24576, 1536},
                          {"deepseek o", 7168, 16384}};
  cublasHandle_t blas;
  if (cublasCreate(&blas) != CUBLAS_STATUS_SUCCESS) return 1;
  std::mt19937 rng(1);
  for (const Shape& sh : shapes) {
    const size_t bytes = static_cast<size_t>(sh.n) * sh.k;
    const int copies = static_cast<int>(std::max<size_t>(2, (200u << 20) / bytes + 1));
    const int kb = (sh.k + 127) / 128, nb = (sh.n + 127) / 128;
    std::vector<uint8_t> codes(bytes);
    for (auto& q : codes) {
      do q = static_cast<uint8_t>(rng());
      while ((q & 0x7f) == 0x7f);
    }
    std::vector<float> scales(static_cast<size_t>(nb) * kb);
    for (auto& v : scales) v = (0.5f + (rng() % 1000) / 1000.0f) / 448.0f;
    std::vector<uint8_t*> w(copies);
    std::vector<float*> s(copies);
    std::vector<__nv_bfloat16*> wb(copies);
    std::vector<uint16_t> wide(bytes);
    for (size_t i = 0; i < bytes; ++i) {
      const float v = e4m3_value(codes[i]) * scales[(i / sh.k / 128) * kb + i % sh.k / 128];
      const __nv_bfloat16 b = __float2bfloat16(v);
      std::memcpy(&wide[i], &b, 2);
    }
    for (int c = 0; c < copies; ++c) {
      CHECK(cudaMalloc(&w[c], bytes));
      CHECK(cudaMalloc(&s[c], scales.size() * 4));
      CHECK(cudaMemcpy(w[c], codes.data(), bytes, cudaMemcpyHostToDevice));
      CHECK(cudaMemcpy(s[c], scales.data(), scales.size() * 4, cudaMemcpyHostToDevice));
      CHECK(cudaMalloc(&wb[c], bytes * 2));
      CHECK(cudaMemcpy(wb[c], wide.data(), bytes * 2, cudaMemcpyHostToDevice));
    }
    std::printf("%s: n=%d k=%d, %.1f MB of FP8 weights, %d copies\n", sh.name, sh.n, sh.k, bytes / 1e6, copies);
    for (int m : {1, 2, 3, 4, 6, 8, 10, 16, 24, 32}) {
      std::vector<uint16_t> xh(static_cast<size_t>(m) * sh.k);
      std::vector<float> xf(xh.size());
      for (size_t i = 0; i < xh.size(); ++i) {
        const __nv_bfloat16 b = __float2bfloat16(static_cast<float>(static_cast<int>(rng() % 2001) - 1000) / 1000.0f);
        std::memcpy(&xh[i], &b, 2);
        xf[i] = __bfloat162float(b);
      }
      const int cols = std::min(sh.n, 256);
      std::vector<double> want(static_cast<size_t>(m) * cols);
      for (int i = 0; i < m; ++i)
        for (int j = 0; j < cols; ++j) {
          double sum = 0;
          for (int c = 0; c < sh.k; ++c)
            sum += static_cast<double>(xf[static_cast<size_t>(i) * sh.k + c]) *
                   e4m3_value(codes[static_cast<size_t>(j) * sh.k + c]) *
                   scales[static_cast<size_t>(j / 128) * kb + c / 128];
          want[static_cast<size_t>(i) * cols + j] = sum;
        }
      void* x;
      float* y;
      CHECK(cudaMalloc(&x, xh.size() * 2));
      CHECK(cudaMalloc(&y, static_cast<size_t>(m) * sh.n * 4));
      CHECK(cudaMemcpy(x, xh.data(), xh.size() * 2, cudaMemcpyHostToDevice));
      std::printf(" m=%d\n", m);
      // bf16 reference: cuBLAS, y[m, n] = x[m, k] w[n, k]^T, f32 out.
      report("cublas bf16 (2x bytes)", m, sh, copies, w, s, x, y, want,
             [&](const void* x, const void* w8, const float*, float* y, int m, const Shape& sh, cudaStream_t st) {
               int c = 0;
               while (c < copies && w[c] != w8) ++c;
               cublasSetStream(blas, st);
               const float one = 1, zero = 0;
               return cublasGemmEx(blas, CUBLAS_OP_T, CUBLAS_OP_N, sh.n, m, sh.k, &one, wb[c], CUDA_R_16BF, sh.k, x,
                                   CUDA_R_16BF, sh.k, &zero, y, CUDA_R_32F, sh.n, CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS
                          ? cudaSuccess
                          : cudaErrorUnknown;
             });
      if (m <= 8) {
        report("library gemv_fp8", m, sh, copies, w, s, x, y, want,
               [](const void* x, const void* w, const float* s, float* y, int m, const Shape& sh, cudaStream_t st) {
                 return k::gemv_fp8(x, w, s, y, true, m, sh.n, sh.k, sh.n, st);
               });
      }
      if (m < 8) {
        report("library gemm_fp8_rows", m, sh, copies, w, s, x, y, want,
               [](const void* x, const void* w, const float* s, float* y, int m, const Shape& sh, cudaStream_t st) {
                 return k::gemm_fp8_rows(x, w, s, y, true, m, sh.n, sh.k, sh.n, st);
               });
      }
      if (m == 8) sweep<1>(m, sh, copies, w, s, x, y, want);
      if (m == 10 || m == 16) sweep<2>(m, sh, copies, w, s, x, y, want);
      if (m == 24) sweep<3>(m, sh, copies, w, s, x, y, want);
      if (m == 32) sweep<4>(m, sh, copies, w, s, x, y, want);
      CHECK(cudaFree(x));
      CHECK(cudaFree(y));
    }
    for (int c = 0; c < copies; ++c) {
      CHECK(cudaFree(w[c]));
      CHECK(cudaFree(s[c]));
      CHECK(cudaFree(wb[c]));
    }
  }
  return 0;
}
