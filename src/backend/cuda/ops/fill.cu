#include "backend/cuda/ops/fill_launch.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace moe::cuda::kernels {
namespace {

// Pair p of the loader's stream from `state` (splitmix64 step p + 1), as int32 halves times scale.
__device__ __forceinline__ void random_pair(uint64_t state, size_t p, float scale, float& lo, float& hi) {
  uint64_t z = state + (p + 1) * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  lo = static_cast<float>(static_cast<int32_t>(static_cast<uint32_t>(z))) * scale;
  hi = static_cast<float>(static_cast<int32_t>(static_cast<uint32_t>(z >> 32))) * scale;
}

constexpr float kStreamScale = 0.02f * 1.7320508f / 2147483648.0f;

// Blocks of 256 threads for `items` (the kernels loop past 65536 blocks).
unsigned blocks_for(size_t items) { return static_cast<unsigned>(items / 256 + 1 < 65536 ? items / 256 + 1 : 65536); }

__global__ void fill_random_kernel(uint16_t* dst, size_t count, uint64_t state) {
  const size_t pairs = (count + 1) / 2;
  for (size_t p = blockIdx.x * size_t(blockDim.x) + threadIdx.x; p < pairs;
       p += size_t(gridDim.x) * blockDim.x) {
    float lo, hi;
    random_pair(state, p, kStreamScale, lo, hi);
    __nv_bfloat16 a = __float2bfloat16_rn(lo), b = __float2bfloat16_rn(hi);
    dst[2 * p] = *reinterpret_cast<uint16_t*>(&a);
    if (2 * p + 1 < count) dst[2 * p + 1] = *reinterpret_cast<uint16_t*>(&b);
  }
}

__global__ void fill_random_fp8_kernel(uint8_t* codes, size_t count, uint64_t state) {
  const size_t pairs = (count + 1) / 2;
  for (size_t p = blockIdx.x * size_t(blockDim.x) + threadIdx.x; p < pairs; p += size_t(gridDim.x) * blockDim.x) {
    float lo, hi;
    random_pair(state, p, kStreamScale / kRandomFp8Scale, lo, hi);
    codes[2 * p] = __nv_cvt_float_to_fp8(lo, __NV_SATFINITE, __NV_E4M3);
    if (2 * p + 1 < count) codes[2 * p + 1] = __nv_cvt_float_to_fp8(hi, __NV_SATFINITE, __NV_E4M3);
  }
}

__global__ void extract_uk_kernel(const uint16_t* __restrict__ kv_b, int heads, int nope, int v,
                                  int lora, uint16_t* __restrict__ uk_t) {
  const size_t total = static_cast<size_t>(heads) * lora * nope;
  for (size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x; idx < total;
       idx += size_t(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(idx % nope);
    const int j = static_cast<int>((idx / nope) % lora);
    const int h = static_cast<int>(idx / (static_cast<size_t>(nope) * lora));
    uk_t[idx] = kv_b[(static_cast<size_t>(h) * (nope + v) + i) * lora + j];
  }
}

}  // namespace

cudaError_t extract_uk_transposed(const uint16_t* kv_b, int heads, int nope, int v, int lora,
                                  uint16_t* uk_t, cudaStream_t stream) {
  const size_t total = static_cast<size_t>(heads) * lora * nope;
  if (total == 0) return cudaSuccess;
  extract_uk_kernel<<<blocks_for(total), 256, 0, stream>>>(kv_b, heads, nope, v, lora, uk_t);
  return cudaGetLastError();
}

cudaError_t fill_random_fp8(uint8_t* codes, size_t count, uint64_t state, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  fill_random_fp8_kernel<<<blocks_for((count + 1) / 2), 256, 0, stream>>>(codes, count, state);
  return cudaGetLastError();
}

cudaError_t fill_random_bf16(uint16_t* dst, size_t count, uint64_t state, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  fill_random_kernel<<<blocks_for((count + 1) / 2), 256, 0, stream>>>(dst, count, state);
  return cudaGetLastError();
}

}  // namespace moe::cuda::kernels
