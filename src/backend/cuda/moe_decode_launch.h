// The launch interface of the decode-path MoE kernels: plain pointers and sizes, no library
// types, so the .cu file needs nothing but CUDA headers.
#pragma once

#include <cuda_runtime.h>

namespace moe::cuda::kernels {

constexpr int kDecodeMaxExperts = 512;
constexpr int kDecodeMaxWidth = 2048;  // hidden and intermediate: multiples of 8, at most this

struct DecodeBuffers {
  const void* gate_up;  // bf16 [experts, 2 * inter, hidden]
  const void* down;     // bf16 [experts, hidden, inter]
  int* offsets;         // [experts + 1]
  int* order;           // [max slots]
  int* active;          // [experts]
  int* num_active;      // [1]
  void* act;            // bf16 [max slots, inter]
  float* part;          // [max slots, hidden]
  int experts, hidden, inter, top_k;
};

// Plan, gate_up, down, combine on `stream`; returns the launch status.
cudaError_t launch_decode(const DecodeBuffers& buffers, const void* x, const int* ids,
                          const float* weights, int tokens, void* y, cudaStream_t stream);

}  // namespace moe::cuda::kernels
