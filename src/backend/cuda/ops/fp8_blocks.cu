#include "backend/cuda/ops/fp8_blocks_launch.h"

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include "backend/cuda/bf16x8.cuh"
#include "backend/cuda/ops/fp8_act_quant.cuh"
#include "backend/cuda/pdl.h"

namespace moe::cuda::kernels {
namespace {

// A block takes a row at a time (count x rows of them), a thread 16 codes of it at a time: one
// 16-byte load, two 16-byte stores, the row's scales found once. cols % 16 == 0.
__global__ void dequantize_kernel(const uint4* __restrict__ codes, const float* __restrict__ scales, long long count,
                                  long long rows, int cols, int block_rows, int block_cols, uint4* __restrict__ out) {
  const long long scale_rows = (rows + block_rows - 1) / block_rows;
  const int scale_cols = (cols + block_cols - 1) / block_cols, chunks = cols / 16;
  for (long long row = blockIdx.x; row < count * rows; row += gridDim.x) {
    const float* s = scales + ((row / rows) * scale_rows + row % rows / block_rows) * scale_cols;
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
      const uint4 q = codes[row * chunks + c];
      const float scale = __ldg(s + c * 16 / block_cols);
      const __nv_fp8x2_storage_t* pairs = reinterpret_cast<const __nv_fp8x2_storage_t*>(&q);
      uint4 o[2];
      __nv_bfloat162* ob = reinterpret_cast<__nv_bfloat162*>(o);
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const float2 v = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pairs[i], __NV_E4M3)));
        ob[i] = __floats2bfloat162_rn(v.x * scale, v.y * scale);
      }
      out[(row * chunks + c) * 2] = o[0];
      out[(row * chunks + c) * 2 + 1] = o[1];
    }
  }
}

// A half-warp per 128 columns of a row (a unit), 8 values a lane: one 16-byte load and one 8-byte
// store. Each thread takes kQuantUnits units a grid apart and issues all of their loads before it uses
// any: with one 8-byte load a lane in flight (a warp per unit), 2,048 x 2,048 bf16 took 9.5 µs
// and 2,048 x 4,096 15.7 µs on an H100 (ncu, L2 flushed), three to four times their bytes' time.
// by_block: scales [blocks, rows].
constexpr int kQuantUnits = 4;

__global__ void quantize_rows_kernel(const uint4* __restrict__ x, int rows, const int* __restrict__ rows_on_device,
                                     int cols, uint8_t* __restrict__ q, float* __restrict__ scales, bool by_block) {
  begin_dependent();  // x (and rows_on_device) come from earlier work on the stream
  const int n = rows_on_device ? min(rows, *rows_on_device) : rows;
  const int per_row = (cols + 127) / 128, chunks = cols / 8, sub = threadIdx.x % 16;
  const long long units = static_cast<long long>(n) * per_row;
  const long long stride = static_cast<long long>(gridDim.x) * (blockDim.x / 16);
  // The loop runs over a warp's pair of units so that both halves take every shuffle.
  for (long long pair = (static_cast<long long>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32) * 2;
       pair < units; pair += stride * kQuantUnits) {
    const long long first = pair + (threadIdx.x / 16) % 2;
    uint4 raw[kQuantUnits];
#pragma unroll
    for (int u = 0; u < kQuantUnits; ++u) {
      const long long unit = first + u * stride;
      const int chunk = static_cast<int>(unit % per_row) * 16 + sub;
      raw[u] = unit < units && chunk < chunks ? x[unit / per_row * chunks + chunk] : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kQuantUnits; ++u) {
      const long long unit = first + u * stride;
      float v[8];
      unpack_bf16x8(raw[u], v);
      const float amax = fp8_act_half_warp_amax(v, 0xffffffffu);  // both halves take every shuffle
      if (unit >= units) continue;  // after the shuffles: the other half's unit may be real
      const long long row = unit / per_row;
      const int block = static_cast<int>(unit % per_row), chunk = block * 16 + sub;
      const float scale = fp8_act_scale(amax);
      if (chunk < chunks)
        *reinterpret_cast<uint2*>(q + row * cols + chunk * 8) = fp8_act_codes8(v, fp8_act_inverse(scale));
      if (sub == 0) scales[by_block ? static_cast<long long>(block) * rows + row : row * per_row + block] = scale;
    }
  }
}

}  // namespace

namespace {

cudaError_t quantize_rows(const void* x, int rows, const int* rows_on_device, int cols, void* q, float* scales,
                          bool by_block, cudaStream_t stream) {
  if (rows < 0 || cols < 16 || cols % 16 != 0 || reinterpret_cast<uintptr_t>(x) % 16 != 0 ||
      reinterpret_cast<uintptr_t>(q) % 8 != 0)
    return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  // At most 1024 blocks, each walking units until the rows are done. The cap was set where all of
  // them started at once (30 registers: 8 blocks of 256 threads on each of an H100's 132
  // multiprocessors), so that a programmatic dependent (the expert plan, launch_plan's
  // beside_predecessor) is scheduled at the start; at this kernel's 64 registers about half are
  // resident at once, and the layer at M = 512 and 2048 measured the same as with the old kernel
  // (docs/perf/fp8-quantised-inputs.md).
  // A unit a thread while the rows are few (a decode step's), up to kQuantUnits once the grid is
  // full.
  const long long units = static_cast<long long>(rows) * ((cols + 127) / 128);
  const long long wanted = (units + 15) / 16;
  const unsigned blocks = static_cast<unsigned>(wanted < 1024 ? wanted : 1024);
  const cudaError_t err = launch_dependent(quantize_rows_kernel, dim3(blocks), dim3(256), 0, stream,
                                           static_cast<const uint4*>(x), rows, rows_on_device, cols,
                                           static_cast<uint8_t*>(q), scales, by_block);
  return err != cudaSuccess ? err : cudaGetLastError();
}

}  // namespace

cudaError_t quantize_rows_fp8(const void* x, int rows, const int* rows_on_device, int cols, void* q, float* scales,
                              cudaStream_t stream) {
  return quantize_rows(x, rows, rows_on_device, cols, q, scales, false, stream);
}

cudaError_t quantize_rows_fp8_by_block(const void* x, int rows, int cols, void* q, float* scales, cudaStream_t stream) {
  return quantize_rows(x, rows, nullptr, cols, q, scales, true, stream);
}

cudaError_t dequantize_fp8_blocks(const uint8_t* codes, const float* scales, long long count, long long rows,
                                  long long cols, int block_rows, int block_cols, uint16_t* out,
                                  cudaStream_t stream) {
  if (count < 0 || rows < 0 || cols < 0 || cols % 16 != 0 || cols > (1 << 30) || block_rows < 1 || block_cols < 16 ||
      block_cols % 16 != 0 || (reinterpret_cast<uintptr_t>(codes) | reinterpret_cast<uintptr_t>(out)) % 16 != 0)
    return cudaErrorInvalidValue;
  const long long total_rows = count * rows;
  if (total_rows == 0 || cols == 0) return cudaSuccess;
  const unsigned blocks = static_cast<unsigned>(total_rows < 65536 ? total_rows : 65536);
  dequantize_kernel<<<blocks, 128, 0, stream>>>(reinterpret_cast<const uint4*>(codes), scales, count, rows,
                                                static_cast<int>(cols), block_rows, block_cols,
                                                reinterpret_cast<uint4*>(out));
  return cudaGetLastError();
}

}  // namespace moe::cuda::kernels
