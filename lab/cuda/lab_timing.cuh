// The lab's two timings of a body(layer, stream) of kernel launches, shared by the lab files:
//  - time_chained: `layers` layers in one graph, replayed 40 times after 3; µs a layer. Each
//    layer's kernels overlap their neighbours' as in a model's forward.
//  - time_cold: moe-bench layer's method: layer 0 alone in a graph, 256 MB written before each
//    replay to flush L2, events around the replay, median of 50 after 10; µs.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#ifndef CHECK
#define CHECK(x)                                                                      \
  do {                                                                                \
    cudaError_t e_ = (x);                                                             \
    if (e_ != cudaSuccess) {                                                          \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, cudaGetErrorString(e_)); \
      std::exit(1);                                                                   \
    }                                                                                 \
  } while (0)
#endif

namespace lab {

// Captures body(l, s) for l in [0, layers) into a graph on a fresh stream and instantiates it.
template <typename F>
cudaGraphExec_t capture(int layers, cudaStream_t s, F&& body) {
  cudaGraph_t g;
  cudaGraphExec_t ge;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  for (int l = 0; l < layers; ++l) body(l, s);
  CHECK(cudaStreamEndCapture(s, &g));
  CHECK(cudaGraphInstantiate(&ge, g, 0));
  CHECK(cudaGraphDestroy(g));
  return ge;
}

template <typename F>
double time_chained(int layers, F&& body) {
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraphExec_t ge = capture(layers, s, body);
  for (int i = 0; i < 3; ++i) CHECK(cudaGraphLaunch(ge, s));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  constexpr int kReplays = 40;
  CHECK(cudaEventRecord(t0, s));
  for (int i = 0; i < kReplays; ++i) CHECK(cudaGraphLaunch(ge, s));
  CHECK(cudaEventRecord(t1, s));
  CHECK(cudaEventSynchronize(t1));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, t0, t1));
  CHECK(cudaEventDestroy(t0));
  CHECK(cudaEventDestroy(t1));
  CHECK(cudaGraphExecDestroy(ge));
  CHECK(cudaStreamDestroy(s));
  return 1e3 * ms / (kReplays * layers);
}

template <typename F>
double time_cold(F&& body) {
  static void* flush = nullptr;
  if (!flush) CHECK(cudaMalloc(&flush, 256u << 20));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  cudaGraphExec_t ge = capture(1, s, body);
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  std::vector<float> us;
  for (int r = 0; r < 60; ++r) {
    CHECK(cudaMemsetAsync(flush, r & 0xff, 256u << 20, s));
    CHECK(cudaEventRecord(t0, s));
    CHECK(cudaGraphLaunch(ge, s));
    CHECK(cudaEventRecord(t1, s));
    CHECK(cudaEventSynchronize(t1));
    float ms = 0;
    CHECK(cudaEventElapsedTime(&ms, t0, t1));
    if (r >= 10) us.push_back(ms * 1e3f);
  }
  std::sort(us.begin(), us.end());
  CHECK(cudaEventDestroy(t0));
  CHECK(cudaEventDestroy(t1));
  CHECK(cudaGraphExecDestroy(ge));
  CHECK(cudaStreamDestroy(s));
  return us[us.size() / 2];
}

}  // namespace lab
