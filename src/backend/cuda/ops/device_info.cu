#include <cuda_runtime.h>

#include <fmt/format.h>

#include "backend/device_info.h"

namespace moe {

bool cuda_built() { return true; }

std::vector<GpuInfo> cuda_devices() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver" error
    return {};
  }
  std::vector<GpuInfo> out;
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    out.push_back({i, prop.name, prop.totalGlobalMem, prop.major, prop.minor,
                   prop.multiProcessorCount});
  }
  return out;
}

std::string cuda_status() {
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    return fmt::format("built with CUDA {}.{}; no usable CUDA device ({})", CUDART_VERSION / 1000,
                       (CUDART_VERSION % 1000) / 10, cudaGetErrorString(err));
  }
  return fmt::format("built with CUDA {}.{}; {} device(s)", CUDART_VERSION / 1000,
                     (CUDART_VERSION % 1000) / 10, count);
}

}  // namespace moe
