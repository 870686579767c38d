#include "moe/tensor.h"

#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>

#include "core/arena.h"
#include "moe/errors.h"

namespace moe {

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kF32: return 4;
    case DType::kBF16: return 2;
    case DType::kF16: return 2;
    case DType::kF8E4M3:
    case DType::kF8E5M2: return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kF32: return "f32";
    case DType::kBF16: return "bf16";
    case DType::kF16: return "f16";
    case DType::kF8E4M3: return "f8_e4m3";
    case DType::kF8E5M2: return "f8_e5m2";
  }
  return "?";
}

DType dtype_from_safetensors(const std::string& name) {
  if (name == "F32") return DType::kF32;
  if (name == "BF16") return DType::kBF16;
  if (name == "F16") return DType::kF16;
  if (name == "F8_E4M3") return DType::kF8E4M3;
  if (name == "F8_E5M2") return DType::kF8E5M2;
  MOE_THROW(kFormat, "unsupported tensor dtype '{}' (supported: F32, BF16, F16, F8_E4M3, F8_E5M2)", name);
}

std::string Device::str() const {
  return type == DeviceType::kCPU ? std::string("cpu") : fmt::format("cuda:{}", index);
}

float bf16_to_f32(uint16_t bits) {
  return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16);
}

uint16_t f32_to_bf16(float value) {
  uint32_t word = std::bit_cast<uint32_t>(value);
  if ((word & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((word >> 16) | 0x40);  // NaN
  word += 0x7fffu + ((word >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(word >> 16);
}

// E4M3 (OCP "fn"): bias 7, no infinities, only S.1111.111 is NaN; subnormals are m x 2^-9.
float f8e4m3_to_f32(uint8_t bits) {
  const float sign = (bits & 0x80u) ? -1.0f : 1.0f;
  const int exp = (bits >> 3) & 0xf, mant = bits & 0x7;
  if (exp == 0xf && mant == 0x7) return std::numeric_limits<float>::quiet_NaN();
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -9);
  return sign * std::ldexp(static_cast<float>(8 + mant), exp - 10);
}

// E5M2: bias 15, IEEE-like (exponent 31 is infinity or NaN); subnormals are m x 2^-16.
float f8e5m2_to_f32(uint8_t bits) {
  const float sign = (bits & 0x80u) ? -1.0f : 1.0f;
  const int exp = (bits >> 2) & 0x1f, mant = bits & 0x3;
  if (exp == 0x1f) return mant ? std::numeric_limits<float>::quiet_NaN() : sign * std::numeric_limits<float>::infinity();
  if (exp == 0) return sign * std::ldexp(static_cast<float>(mant), -16);
  return sign * std::ldexp(static_cast<float>(4 + mant), exp - 17);
}

float f16_to_f32(uint16_t bits) {
  uint32_t sign = (bits & 0x8000u) << 16;
  uint32_t exp = (bits >> 10) & 0x1fu;
  uint32_t mant = bits & 0x3ffu;
  uint32_t word;
  if (exp == 0) {
    if (mant == 0) {
      word = sign;
    } else {  // subnormal: normalise
      int e = -1;
      do {
        ++e;
        mant <<= 1;
      } while ((mant & 0x400u) == 0);
      word = sign | static_cast<uint32_t>(127 - 15 - e) << 23 | (mant & 0x3ffu) << 13;
    }
  } else if (exp == 31) {
    word = sign | 0x7f800000u | mant << 13;
  } else {
    word = sign | (exp + 127 - 15) << 23 | mant << 13;
  }
  return std::bit_cast<float>(word);
}

uint16_t f32_to_f16(float value) {
  const uint32_t word = std::bit_cast<uint32_t>(value);
  uint32_t sign = (word >> 16) & 0x8000u;
  uint32_t abs = word & 0x7fffffffu;
  if (abs > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u);   // NaN
  if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // overflow -> inf
  if (abs < 0x38800000u) {  // f16 subnormal or zero: count units of 2^-24, ties to even
    const float magnitude = std::bit_cast<float>(abs);
    return static_cast<uint16_t>(sign | static_cast<uint32_t>(std::nearbyint(magnitude * 16777216.0f)));
  }
  uint32_t rounded = abs + 0xfffu + ((abs >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

namespace {

// A checkpoint's 16-bit values need not be 2-byte aligned (safetensors does not pad its header):
// each is read byte-wise.
template <float (*Widen)(uint16_t)>
void widen_16bit(const void* src, float* dst, size_t count) {
  const auto* p = static_cast<const unsigned char*>(src);
  for (size_t i = 0; i < count; ++i) {
    uint16_t bits;
    std::memcpy(&bits, p + 2 * i, 2);
    dst[i] = Widen(bits);
  }
}

}  // namespace

void convert_to_f32(const void* src, DType from, float* dst, size_t count) {
  switch (from) {
    case DType::kF32:
      std::memcpy(dst, src, count * 4);
      return;
    case DType::kBF16:
      widen_16bit<bf16_to_f32>(src, dst, count);
      return;
    case DType::kF16:
      widen_16bit<f16_to_f32>(src, dst, count);
      return;
    case DType::kF8E4M3: {
      const auto* p = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = f8e4m3_to_f32(p[i]);
      return;
    }
    case DType::kF8E5M2: {
      const auto* p = static_cast<const uint8_t*>(src);
      for (size_t i = 0; i < count; ++i) dst[i] = f8e5m2_to_f32(p[i]);
      return;
    }
  }
}

namespace {
int64_t count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    MOE_CHECK(d >= 0, kShape, "negative dimension in shape");
    n *= d;
  }
  return n;
}
}  // namespace

Tensor Tensor::zeros(std::vector<int64_t> shape, DType dtype) {
  Tensor t;
  size_t bytes = static_cast<size_t>(count(shape)) * dtype_size(dtype);
  void* p = std::calloc(bytes ? bytes : 1, 1);
  MOE_CHECK(p != nullptr, kInternal, "out of host memory allocating {} bytes", bytes);
  t.holder_ = std::shared_ptr<void>(p, std::free);
  t.data_ = p;
  t.dtype_ = dtype;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::empty(Arena& arena, std::vector<int64_t> shape, DType dtype) {
  size_t bytes = static_cast<size_t>(count(shape)) * dtype_size(dtype);
  return view(arena.allocate(bytes), std::move(shape), dtype, arena.device());
}

Tensor Tensor::view(void* data, std::vector<int64_t> shape, DType dtype, Device device) {
  Tensor t;
  t.data_ = data;
  t.dtype_ = dtype;
  t.device_ = device;
  t.shape_ = std::move(shape);
  count(t.shape_);
  return t;
}

int64_t Tensor::dim(int i) const {
  if (i < 0) i += ndim();
  MOE_CHECK(i >= 0 && i < ndim(), kShape, "dimension {} out of range for shape {}", i, shape_str());
  return shape_[static_cast<size_t>(i)];
}

int64_t Tensor::numel() const { return shape_.empty() ? (data_ ? 1 : 0) : count(shape_); }

std::string Tensor::shape_str() const {
  std::string s = "[";
  for (size_t i = 0; i < shape_.size(); ++i) s += (i ? ", " : "") + std::to_string(shape_[i]);
  return s + "]";
}

Tensor Tensor::reshape(std::vector<int64_t> shape) const {
  MOE_CHECK(count(shape) == numel(), kShape, "cannot reshape {} to a different element count",
            shape_str());
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  MOE_CHECK(ndim() >= 1 && 0 <= begin && begin <= end && end <= shape_[0], kShape,
            "rows [{}, {}) out of range for shape {}", begin, end, shape_str());
  Tensor t = *this;
  int64_t row = shape_[0] ? numel() / shape_[0] : 0;
  t.data_ = static_cast<char*>(data_) + static_cast<size_t>(begin * row) * dtype_size(dtype_);
  t.shape_[0] = end - begin;
  return t;
}

}  // namespace moe
