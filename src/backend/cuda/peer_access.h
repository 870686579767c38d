// Enabling peer access once per ordered pair of GPUs for the whole process. CUDA reports a second
// enable of the same pair as an error (cudaErrorPeerAccessAlreadyEnabled); remembering the pairs
// keeps that error out of the runtime's error state and out of compute-sanitizer's reports.
#pragma once

#include <cuda_runtime.h>

#include <mutex>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "backend/cuda/cuda_check.h"

namespace moe::cuda {

// Whether every pair of `devices` can access each other's memory; *why names a pair that cannot.
inline bool peers_can_access(const std::vector<int>& devices, std::string* why = nullptr) {
  for (int a : devices)
    for (int b : devices) {
      if (a == b) continue;
      int can = 0;
      if (cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess) {
        cudaGetLastError();
        can = 0;
      }
      if (!can) {
        if (why) *why = "GPU " + std::to_string(a) + " cannot access the memory of GPU " + std::to_string(b);
        return false;
      }
    }
  return true;
}

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
