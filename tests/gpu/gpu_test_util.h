// Shared helpers of the GPU tests: skip visibly without a device, move vectors to and from the
// device, poison outputs so a kernel that forgets to write shows up as NaN.
#pragma once

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "moe/tensor.h"

namespace moe::gputest {

inline bool have_gpu() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return false;
  }
  return n > 0;
}

#define REQUIRE_GPU() \
  if (!::moe::gputest::have_gpu()) GTEST_SKIP() << "no CUDA device: GPU test skipped"

inline int gpu_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return n;
}

// Whether GPUs 0..n-1 can all access each other's memory.
inline bool peers_reachable(int n) {
  for (int a = 0; a < n; ++a)
    for (int b = 0; b < n; ++b) {
      int can = 0;
      if (a != b && (cudaDeviceCanAccessPeer(&can, a, b) != cudaSuccess || !can)) return false;
    }
  return true;
}

// n GPUs with peer access between them, or the test skips, saying which is missing.
#define REQUIRE_PEER_GPUS(n)                                                                    \
  if (::moe::gputest::gpu_count() < (n))                                                        \
    GTEST_SKIP() << "fewer than " << (n) << " CUDA devices: multi-GPU test skipped";            \
  if (!::moe::gputest::peers_reachable(n))                                                      \
    GTEST_SKIP() << "no peer access between the GPUs: multi-GPU test skipped"

// A device buffer that frees itself; the tests keep no raw cudaMalloc pointers.
template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  explicit DeviceBuffer(size_t count) : count_(count) {
    EXPECT_EQ(cudaMalloc(&ptr_, std::max<size_t>(count, 1) * sizeof(T)), cudaSuccess);
  }
  explicit DeviceBuffer(const std::vector<T>& host) : DeviceBuffer(host.size()) { upload(host); }
  ~DeviceBuffer() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& o) noexcept : ptr_(o.ptr_), count_(o.count_) { o.ptr_ = nullptr; }

  T* get() const { return static_cast<T*>(ptr_); }
  size_t size() const { return count_; }
  void upload(const std::vector<T>& host) {
    EXPECT_EQ(cudaMemcpy(ptr_, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice),
              cudaSuccess);
  }
  std::vector<T> download() const {
    std::vector<T> host(count_);
    EXPECT_EQ(cudaMemcpy(host.data(), ptr_, count_ * sizeof(T), cudaMemcpyDeviceToHost), cudaSuccess);
    return host;
  }
  // Every byte 0xff: NaN for f32, bf16 and f16, -1 for integers.
  void poison() { EXPECT_EQ(cudaMemset(ptr_, 0xff, count_ * sizeof(T)), cudaSuccess); }

 private:
  void* ptr_ = nullptr;
  size_t count_ = 0;
};

// Normal values rounded to bf16, so a CPU reference in f32 and a GPU kernel reading bf16 start
// from the same numbers.
inline std::vector<float> random_bf16_exact(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = bf16_to_f32(f32_to_bf16(d(rng)));
  return v;
}

inline std::vector<uint16_t> to_bf16(const std::vector<float>& v) {
  std::vector<uint16_t> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = f32_to_bf16(v[i]);
  return out;
}

inline std::vector<float> from_bf16(const std::vector<uint16_t>& v) {
  std::vector<float> out(v.size());
  for (size_t i = 0; i < v.size(); ++i) out[i] = bf16_to_f32(v[i]);
  return out;
}

// max |a - b| / max(max |b|, tiny): one number per comparison, stated bounds are against it.
inline double max_rel_error(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 1e-30;
  if (a.size() != b.size()) return INFINITY;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!std::isfinite(a[i]) || !std::isfinite(b[i])) return INFINITY;  // a poisoned output left unwritten
    num = std::max(num, static_cast<double>(std::abs(a[i] - b[i])));
    den = std::max(den, static_cast<double>(std::abs(b[i])));
  }
  return num / den;
}

}  // namespace moe::gputest
