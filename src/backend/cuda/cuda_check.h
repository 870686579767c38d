// CUDA runtime errors as moe::Error, with the failing call and where it was made.
#pragma once

#include <cuda_runtime.h>

#include "moe/errors.h"

#define MOE_CUDA_CHECK(expr)                                                                  \
  do {                                                                                        \
    cudaError_t moe_cuda_err_ = (expr);                                                       \
    if (moe_cuda_err_ != cudaSuccess)                                                         \
      MOE_THROW(kInternal, "CUDA error in {}: {}", #expr, cudaGetErrorString(moe_cuda_err_)); \
  } while (0)
