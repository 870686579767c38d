// One cudaMalloc per category (weights, KV cache, workspace), handed out by bumping, so that the
// engine knows its resident bytes by category and nothing is allocated once loading is over.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <string>

#include "backend/cuda/cuda_check.h"

namespace moe::cuda {

// The alignment of every piece carved out of one device allocation (cudaMalloc's own).
constexpr size_t kDeviceAlign = 256;
constexpr size_t align_up(size_t n) { return (n + kDeviceAlign - 1) / kDeviceAlign * kDeviceAlign; }

class DeviceArena {
 public:
  DeviceArena() = default;
  DeviceArena(std::string name, size_t bytes) : name_(std::move(name)), capacity_(bytes) {
    cudaError_t err = cudaMalloc(&base_, std::max<size_t>(bytes, 256));
    if (err != cudaSuccess) {
      cudaGetLastError();
      size_t free = 0, total = 0;
      cudaMemGetInfo(&free, &total);
      MOE_THROW(kInvalidArgument, "GPU memory: the {} needs {:.2f} GB but {:.2f} GB of {:.2f} GB are free",
                name_, bytes / 1e9, free / 1e9, total / 1e9);
    }
  }
  ~DeviceArena() {
    if (base_) cudaFree(base_);
  }
  DeviceArena(const DeviceArena&) = delete;
  DeviceArena& operator=(const DeviceArena&) = delete;
  DeviceArena(DeviceArena&& o) noexcept { *this = std::move(o); }
  DeviceArena& operator=(DeviceArena&& o) noexcept {
    std::swap(name_, o.name_);
    std::swap(base_, o.base_);
    std::swap(capacity_, o.capacity_);
    std::swap(used_, o.used_);
    return *this;
  }

  template <typename T = void>
  T* take(size_t bytes, size_t align = 256) {
    size_t start = (used_ + align - 1) & ~(align - 1);
    MOE_CHECK(start + bytes <= capacity_, kInternal, "device arena '{}': {} + {} bytes exceed {}",
              name_, start, bytes, capacity_);
    used_ = start + bytes;
    return reinterpret_cast<T*>(static_cast<char*>(base_) + start);
  }
  template <typename T>
  T* take_n(size_t count) {
    return take<T>(count * sizeof(T));
  }
  void* base() const { return base_; }
  size_t capacity() const { return capacity_; }
  size_t used() const { return used_; }

 private:
  std::string name_;
  void* base_ = nullptr;
  size_t capacity_ = 0, used_ = 0;
};

// Bytes a bump allocator needs for a list of requests, each aligned as take() aligns them.
class ArenaSizer {
 public:
  template <typename T>
  T* take_n(size_t count) {
    bytes_ = ((bytes_ + 255) & ~size_t(255)) + count * sizeof(T);
    return nullptr;
  }
  template <typename T = void>
  T* take(size_t bytes, size_t = 256) {
    bytes_ = ((bytes_ + 255) & ~size_t(255)) + bytes;
    return nullptr;
  }
  size_t bytes() const { return bytes_ + 256; }

 private:
  size_t bytes_ = 0;
};

}  // namespace moe::cuda
