// A dense, row-major tensor: dtype, device, shape and a pointer that is either owned (through a
// shared holder) or borrowed from an arena or a memory map. Tensors never copy implicitly.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

namespace moe {

// kF8E4M3 and kF8E5M2 are storage types of checkpoint weights (one byte, OCP FP8: 4 exponent
// bits and 3 of mantissa with no infinities, or 5 and 2 IEEE-like); tensors the engine computes
// with are f32, bf16 or f16.
enum class DType : uint8_t { kF32, kBF16, kF16, kF8E4M3, kF8E5M2 };

size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
// Parses the safetensors spelling ("F32", "BF16", "F16", "F8_E4M3", "F8_E5M2"); throws kFormat
// for anything else.
DType dtype_from_safetensors(const std::string& name);

enum class DeviceType : uint8_t { kCPU, kCUDA };

struct Device {
  DeviceType type = DeviceType::kCPU;
  int index = 0;
  static Device cpu() { return {}; }
  static Device cuda(int index) { return {DeviceType::kCUDA, index}; }
  bool operator==(const Device&) const = default;
  std::string str() const;
};

// Conversions between f32 and the 16-bit formats; f32 -> 16-bit rounds to nearest even.
float bf16_to_f32(uint16_t bits);
uint16_t f32_to_bf16(float value);
float f16_to_f32(uint16_t bits);
uint16_t f32_to_f16(float value);
// The exact f32 value of an FP8 code (every FP8 value is an f32 value).
float f8e4m3_to_f32(uint8_t bits);
float f8e5m2_to_f32(uint8_t bits);
// Converts `count` elements of `src` (of dtype `from`) to f32.
void convert_to_f32(const void* src, DType from, float* dst, size_t count);

class Arena;

class Tensor {
 public:
  Tensor() = default;

  // Heap-owned, zero-filled.
  static Tensor zeros(std::vector<int64_t> shape, DType dtype = DType::kF32);
  // Carved out of an arena; the arena owns the memory, contents undefined.
  static Tensor empty(Arena& arena, std::vector<int64_t> shape, DType dtype = DType::kF32);
  // Borrowed memory; the caller keeps it alive.
  static Tensor view(void* data, std::vector<int64_t> shape, DType dtype,
                     Device device = Device::cpu());

  bool defined() const { return data_ != nullptr; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const;
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  std::string shape_str() const;

  void* raw() const { return data_; }
  template <typename T>
  T* data() const { return static_cast<T*>(data_); }

  // Same memory, new shape with the same element count.
  Tensor reshape(std::vector<int64_t> shape) const;
  // Rows [begin, end) of the first dimension, sharing memory.
  Tensor rows(int64_t begin, int64_t end) const;

 private:
  void* data_ = nullptr;
  std::shared_ptr<void> holder_;
  DType dtype_ = DType::kF32;
  Device device_;
  std::vector<int64_t> shape_;
};

}  // namespace moe
