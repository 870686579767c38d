// The ordered sum behind the NCCL communicator's reductions (nccl_communicator.cpp): out[i] = the
// sum over j = 0..n-1, in that order, of the n gathered slices, accumulated in f32 and rounded
// once to the element type: the arithmetic of the in-process group's sums.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include "backend/cuda/comm/rank_sum_launch.h"

namespace moe::cuda::kernels {

namespace {

template <typename T>
__device__ __forceinline__ float to_f32(T v) {
  if constexpr (sizeof(T) == 4) return v;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __bfloat162float(v);
  else return __half2float(v);
}

template <typename T>
__device__ __forceinline__ T from_f32(float v) {
  if constexpr (sizeof(T) == 4) return v;
  else if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else return __float2half_rn(v);
}

template <typename T>
__global__ void rank_sum_kernel(const T* __restrict__ slices, int n, size_t count, T* out) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < count; i += stride) {
    float acc = to_f32(slices[i]);  // the first slice as is (keeps -0)
    for (int j = 1; j < n; ++j) acc += to_f32(slices[static_cast<size_t>(j) * count + i]);
    out[i] = from_f32<T>(acc);
  }
}

template <typename T>
cudaError_t launch(const void* slices, int n, size_t count, void* out, cudaStream_t stream) {
  size_t blocks = (count + 255) / 256;
  if (blocks > 4096) blocks = 4096;
  rank_sum_kernel<T><<<static_cast<unsigned>(blocks), 256, 0, stream>>>(static_cast<const T*>(slices), n, count,
                                                                      static_cast<T*>(out));
  return cudaGetLastError();
}

}  // namespace

cudaError_t rank_sum(const void* slices, int n, size_t count, int dtype, void* out, cudaStream_t stream) {
  if (n < 1 || dtype < 0 || dtype > 2) return cudaErrorInvalidValue;
  if (count == 0) return cudaSuccess;
  switch (dtype) {
    case 0: return launch<float>(slices, n, count, out, stream);
    case 1: return launch<__nv_bfloat16>(slices, n, count, out, stream);
    default: return launch<__half>(slices, n, count, out, stream);
  }
}

}  // namespace moe::cuda::kernels
