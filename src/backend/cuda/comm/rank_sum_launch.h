// The launch interface of rank_sum.cu: plain pointers and sizes.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

namespace moe::cuda::kernels {

// out[i] = sum over j < n, in order, of slices[j * count + i], accumulated in f32 and rounded once.
// dtype: 0 f32, 1 bf16, 2 f16 (moe::DType's order). out may alias slice 0 or none.
cudaError_t rank_sum(const void* slices, int n, size_t count, int dtype, void* out, cudaStream_t stream);

}  // namespace moe::cuda::kernels
