// Kernel lab: the dense bf16 GEMV of decode (y = W x, W [n, k] row-major, M rows of x) over the
// shapes of a qwen3-30b-a3b decode step at batch 1: the fused qkv projection (5120 x 2048), the
// output projection (2048 x 4096) and a wide one (lm_head-like, 32768 x 2048). The first row is
// the library's own `gemv_bf16` (src/backend/cuda/ops/gemv.cu, whatever block shape it picks for the
// shape); the others are variants of one lab kernel: rows per warp, 16-byte loads in flight per
// row, warps per block, and the load instruction (the read-only path, or the library's streaming
// load from stream_load.cuh: no L1 allocation, 256-byte L2 fetches).
//
// Method: every launch reads a different copy of W (copies spanning 4x the L2), so weights come
// from HBM as in a decode step; eight launches chained by programmatic dependent launch (pdl.h)
// in a CUDA graph, replayed 30 times after 5, time per launch from events. Each variant's output
// is compared with the library's.
//
// Build: cmake -DMOE_BUILD_LAB=ON, target lab_gemv_sweep; or by hand from the repository root:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude \
//     -o /tmp/gemv_sweep lab/cuda/gemv_sweep.cu src/backend/cuda/ops/gemv.cu
// Decisions taken from it: docs/perf/dense-gemv-blocks.md.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "backend/cuda/ops/gemv_launch.h"
#include "backend/cuda/pdl.h"
#include "backend/cuda/stream_load.cuh"

using moe::cuda::kernels::load_stream;

#define CHECK(x)                                                                                 \
  do {                                                                                           \
    cudaError_t err_ = (x);                                                                      \
    if (err_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

__device__ __forceinline__ void unpack(const uint4& v, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// ROWS weight rows per warp, UNROLL 16-byte loads per row and lane issued before any is used.
template <int M, int ROWS, int UNROLL, int WARPS, bool STREAM>
__global__ void __launch_bounds__(WARPS * 32) gemv(const uint4* __restrict__ x, const uint4* __restrict__ w,
                                                   __nv_bfloat16* __restrict__ y, int n, int k8) {
  moe::cuda::kernels::begin_dependent();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = (blockIdx.x * WARPS + warp) * ROWS;
  if (row0 >= n) return;
  float acc[ROWS][M] = {};
  const uint4* wr[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) wr[r] = w + static_cast<size_t>(min(row0 + r, n - 1)) * k8;
  for (int base = lane; base < k8; base += 32 * UNROLL) {
    uint4 wv[ROWS][UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = base + u * 32;
#pragma unroll
      for (int r = 0; r < ROWS; ++r)
        wv[r][u] = c < k8 ? (STREAM ? load_stream(wr[r] + c) : __ldg(wr[r] + c)) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int c = base + u * 32;
      if (c >= k8) break;
      float wf[ROWS][8];
#pragma unroll
      for (int r = 0; r < ROWS; ++r) unpack(wv[r][u], wf[r]);
#pragma unroll
      for (int m = 0; m < M; ++m) {
        float xf[8];
        unpack(__ldg(x + static_cast<size_t>(m) * k8 + c), xf);
#pragma unroll
        for (int r = 0; r < ROWS; ++r)
#pragma unroll
          for (int i = 0; i < 8; ++i) acc[r][m] = fmaf(wf[r][i], xf[i], acc[r][m]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < ROWS; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m)
#pragma unroll
      for (int off = 16; off > 0; off /= 2) acc[r][m] += __shfl_xor_sync(0xffffffffu, acc[r][m], off);
  if (lane != 0) return;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    if (row0 + r >= n) break;
#pragma unroll
    for (int m = 0; m < M; ++m) y[static_cast<size_t>(m) * n + row0 + r] = __float2bfloat16_rn(acc[r][m]);
  }
}

struct Shape {
  const char* name;
  int n, k;
};

struct Result {
  double us, tbs, rel;
};

// Times `launch(w, stream)` over the weight copies: kChain launches in one graph, replayed.
template <int M, typename Launch>
Result time_chain(const Shape& s, const std::vector<uint4*>& ws, __nv_bfloat16* y,
                  std::vector<float>* reference, Launch&& launch) {
  cudaStream_t stream;
  CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  constexpr int kChain = 8;
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < kChain; ++i) launch(ws[i % ws.size()], stream);
  CHECK(cudaStreamEndCapture(stream, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 5; ++i) CHECK(cudaGraphLaunch(exec, stream));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  constexpr int kReplays = 30;
  CHECK(cudaEventRecord(a, stream));
  for (int i = 0; i < kReplays; ++i) CHECK(cudaGraphLaunch(exec, stream));
  CHECK(cudaEventRecord(b, stream));
  CHECK(cudaEventSynchronize(b));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, a, b));
  const double us = ms * 1e3 / (kReplays * kChain);
  // Output of the last launch (copy kChain - 1) against the reference.
  std::vector<__nv_bfloat16> got(static_cast<size_t>(M) * s.n);
  CHECK(cudaMemcpy(got.data(), y, got.size() * 2, cudaMemcpyDeviceToHost));
  double rel = 0;
  if (reference->empty()) {
    for (auto v : got) reference->push_back(__bfloat162float(v));
  } else {
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); ++i) {
      const double d = __bfloat162float(got[i]) - (*reference)[i];
      num = std::max(num, std::fabs(d));
      den = std::max(den, std::fabs(static_cast<double>((*reference)[i])));
    }
    rel = num / den;
  }
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  CHECK(cudaStreamDestroy(stream));
  return {us, static_cast<double>(s.n) * s.k * 2 / (us * 1e-6) / 1e12, rel};
}

// The library's dense GEMV, as the engine calls it (bf16 out, rows M, ldy n).
template <int M>
Result run_library(const Shape& s, const std::vector<uint4*>& ws, const uint4* x, __nv_bfloat16* y,
                   std::vector<float>* reference) {
  return time_chain<M>(s, ws, y, reference, [&](const uint4* w, cudaStream_t stream) {
    CHECK(moe::cuda::kernels::gemv_bf16(x, w, y, false, M, s.n, s.k, s.n, stream));
  });
}

template <int M, int ROWS, int UNROLL, int WARPS, bool STREAM>
Result run(const Shape& s, const std::vector<uint4*>& ws, const uint4* x, __nv_bfloat16* y,
           std::vector<float>* reference) {
  const int rows_per_block = WARPS * ROWS;
  const dim3 grid((s.n + rows_per_block - 1) / rows_per_block);
  return time_chain<M>(s, ws, y, reference, [&](const uint4* w, cudaStream_t stream) {
    CHECK(moe::cuda::kernels::launch_dependent(gemv<M, ROWS, UNROLL, WARPS, STREAM>, grid,
                                               dim3(WARPS * 32), 0, stream, x, w, y, s.n, s.k / 8));
  });
}

template <int M>
void sweep(const Shape& s) {
  const size_t bytes = static_cast<size_t>(s.n) * s.k * 2;
  int l2 = 0;
  CHECK(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, 0));
  const int copies = static_cast<int>(std::max<size_t>(8, (4 * static_cast<size_t>(l2) + bytes - 1) / bytes));
  std::vector<uint4*> ws(static_cast<size_t>(std::min(copies, 8)));
  std::vector<__nv_bfloat16> host(bytes / 2);
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> dist(-1.f, 1.f);
  for (auto& v : host) v = __float2bfloat16(dist(rng));
  // One weight copy per chained launch (8), each bytes apart: 8 x 21 MB already exceeds the L2
  // several times for the smallest shape.
  for (auto& w : ws) {
    CHECK(cudaMalloc(&w, bytes));
    CHECK(cudaMemcpy(w, host.data(), bytes, cudaMemcpyHostToDevice));
  }
  std::vector<__nv_bfloat16> xh(static_cast<size_t>(M) * s.k);
  for (auto& v : xh) v = __float2bfloat16(dist(rng));
  uint4* x;
  __nv_bfloat16* y;
  CHECK(cudaMalloc(&x, xh.size() * 2));
  CHECK(cudaMemcpy(x, xh.data(), xh.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMalloc(&y, static_cast<size_t>(M) * s.n * 2));
  std::vector<float> ref;
  std::printf("%s n=%d k=%d M=%d (%.1f MB per launch, L2 %d MB)\n", s.name, s.n, s.k, M, bytes / 1e6, l2 >> 20);
  auto show = [&](const char* label, Result r) {
    std::printf("  %-34s %8.2f us %6.2f TB/s  rel %.1e\n", label, r.us, r.tbs, r.rel);
  };
  show("library gemv_bf16 (reference)", run_library<M>(s, ws, x, y, &ref));
  show("rows2 unroll4 warps8 ldg", run<M, 2, 4, 8, false>(s, ws, x, y, &ref));
  show("rows2 unroll4 warps8 stream", run<M, 2, 4, 8, true>(s, ws, x, y, &ref));
  show("rows2 unroll8 warps8 ldg", run<M, 2, 8, 8, false>(s, ws, x, y, &ref));
  show("rows2 unroll8 warps8 stream", run<M, 2, 8, 8, true>(s, ws, x, y, &ref));
  show("rows1 unroll8 warps8 stream", run<M, 1, 8, 8, true>(s, ws, x, y, &ref));
  show("rows1 unroll8 warps4 stream", run<M, 1, 8, 4, true>(s, ws, x, y, &ref));
  show("rows1 unroll16 warps4 stream", run<M, 1, 16, 4, true>(s, ws, x, y, &ref));
  show("rows2 unroll8 warps4 stream", run<M, 2, 8, 4, true>(s, ws, x, y, &ref));
  show("rows4 unroll4 warps4 stream", run<M, 4, 4, 4, true>(s, ws, x, y, &ref));
  show("rows4 unroll8 warps4 stream", run<M, 4, 8, 4, true>(s, ws, x, y, &ref));
  show("rows1 unroll8 warps2 stream", run<M, 1, 8, 2, true>(s, ws, x, y, &ref));
  show("rows2 unroll4 warps4 stream", run<M, 2, 4, 4, true>(s, ws, x, y, &ref));
  for (auto* w : ws) CHECK(cudaFree(w));
  CHECK(cudaFree(x));
  CHECK(cudaFree(y));
}

int main() {
  cudaDeviceProp p;
  CHECK(cudaGetDeviceProperties(&p, 0));
  std::printf("%s, %d SMs\n", p.name, p.multiProcessorCount);
  const Shape shapes[] = {{"qkv", 5120, 2048}, {"o", 2048, 4096}, {"wide", 32768, 2048}};
  for (const Shape& s : shapes) sweep<1>(s);
  for (const Shape& s : shapes) sweep<8>(s);
  return 0;
}
