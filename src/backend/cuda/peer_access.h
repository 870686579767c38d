// Enabling peer access once per ordered pair of GPUs for the whole process. CUDA reports a second
// enable of the same pair as an error (cudaErrorPeerAccessAlreadyEnabled); remembering the pairs
// keeps that error out of the runtime's error state and out of compute-sanitizer's reports.
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <set>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_check.h"

namespace moe::cuda {

// Lets every device of `devices` access the memory of every other one; leaves device
// devices.back() current. The caller has checked cudaDeviceCanAccessPeer.
inline void enable_peer_access(const std::vector<int>& devices) {
  static std::mutex mu;
  static std::set<std::pair<int, int>> enabled;
  std::lock_guard<std::mutex> lock(mu);
  for (int a : devices) {
    MOE_CUDA_CHECK(cudaSetDevice(a));
    for (int b : devices) {
      if (a == b || enabled.count({a, b})) continue;
      const cudaError_t err = cudaDeviceEnablePeerAccess(b, 0);
      if (err == cudaErrorPeerAccessAlreadyEnabled) cudaGetLastError();  // enabled outside this helper
      else MOE_CUDA_CHECK(err);
      enabled.insert({a, b});
    }
  }
}

}  // namespace moe::cuda
