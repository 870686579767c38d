// The 16-byte (and 8-byte) weight loads of the GEMV kernels (gemv.cu, moe_decode.cu). Weights
// are read once per forward: no L1 allocation (x and the activations stay there), 256-byte L2
// fetches (a warp reads whole rows, so the extra sectors are always used). Device code, CUDA
// headers only.
#pragma once

#include <cuda_runtime.h>

namespace moe::cuda::kernels {

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

// The same, 8 bytes: FP8 rows whose 16-byte chunks would leave lanes idle (weight_rows.cuh).
__device__ __forceinline__ uint2 load_stream(const uint2* p) {
  uint2 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}

}  // namespace moe::cuda::kernels
