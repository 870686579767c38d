#include "io/fp8_blocks.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fmt/format.h>

#include "moe/errors.h"

namespace moe {

namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

// E4M3 keeps one code for NaN in each sign: S.1111.111.
bool is_nan_code(uint8_t q) { return (q & 0x7fu) == 0x7fu; }

}  // namespace

Fp8Tensor::Fp8Tensor(const Checkpoint& ckpt, const std::string& name, int64_t block_rows, int64_t block_cols)
    : name_(name), block_rows_(block_rows), block_cols_(block_cols) {
  const TensorInfo& info = ckpt.info(name);
  MOE_CHECK(info.dtype != DType::kF8E5M2, kFormat,
            "tensor '{}' is F8_E5M2, but quantization_config declares e4m3 weights", name);
  MOE_CHECK(info.dtype == DType::kF8E4M3, kFormat, "tensor '{}' is {}, not F8_E4M3", name, dtype_name(info.dtype));
  MOE_CHECK(info.shape.size() == 2, kShape, "FP8 tensor '{}' has shape {}; block scales cover matrices only", name,
            shape_text(info.shape));
  MOE_CHECK(name.ends_with("weight"), kFormat, "FP8 tensor '{}' is not a weight, whose scale could be found", name);
  scale_name_ = name + "_scale_inv";
  MOE_CHECK(ckpt.contains(scale_name_), kFormat, "FP8 tensor '{}' has no scale tensor '{}'", name, scale_name_);
  const TensorInfo& scale = ckpt.info(scale_name_);
  const int64_t rows = rows_ = info.shape[0];
  cols_ = info.shape[1];
  scale_cols_ = blocks(cols_, block_cols);
  const std::vector<int64_t> want{blocks(rows, block_rows), scale_cols_};
  MOE_CHECK(scale.shape == want, kShape,
            "scale '{}' has shape {}, but {} {} in {} x {} blocks needs {}", scale_name_, shape_text(scale.shape),
            name, shape_text(info.shape), block_rows, block_cols, shape_text(want));
  MOE_CHECK(scale.dtype == DType::kF32 || scale.dtype == DType::kBF16 || scale.dtype == DType::kF16, kFormat,
            "scale '{}' is {}; scales are f32 (or bf16, f16)", scale_name_, dtype_name(scale.dtype));
  scales_.resize(static_cast<size_t>(want[0] * want[1]));
  convert_to_f32(ckpt.data(scale_name_), scale.dtype, scales_.data(), scales_.size());
  for (size_t i = 0; i < scales_.size(); ++i) {
    const float s = scales_[i];
    MOE_CHECK(std::isfinite(s) && s > 0, kFormat, "scale '{}' holds {} at block [{}, {}]; scales must be finite and positive",
              scale_name_, s, static_cast<int64_t>(i) / scale_cols_, static_cast<int64_t>(i) % scale_cols_);
  }
  scale_bytes_ = scale.end - scale.begin;
  codes_ = static_cast<const uint8_t*>(ckpt.data(name));
}

Fp8Piece Fp8Tensor::piece() const {
  const size_t count = static_cast<size_t>(rows_ * cols_);
  for (size_t e = 0; e < count; ++e)
    MOE_CHECK(!is_nan_code(codes_[e]), kFormat, "FP8 tensor '{}' holds NaN at [{}, {}]", name_,
              e / static_cast<size_t>(cols_), e % static_cast<size_t>(cols_));
  return Fp8Piece{codes_, rows_, cols_, scales_.data(), block_rows_, block_cols_};
}

void Fp8Tensor::dequantize(size_t at, size_t count, float* out) const {
  static const std::array<float, 256> kValue = [] {
    std::array<float, 256> t{};
    for (int q = 0; q < 256; ++q) t[static_cast<size_t>(q)] = f8e4m3_to_f32(static_cast<uint8_t>(q));
    return t;
  }();
  const size_t cols = static_cast<size_t>(cols_), bc = static_cast<size_t>(block_cols_);
  size_t e = at;
  const size_t end = at + count;
  while (e < end) {  // one run of a row per block of columns
    const size_t r = e / cols, c = e % cols;
    const size_t stop = std::min({end, e + (cols - c), e + (bc - c % bc)});
    const float scale = scales_[(r / static_cast<size_t>(block_rows_)) * static_cast<size_t>(scale_cols_) + c / bc];
    for (; e < stop; ++e, ++out) {
      const uint8_t q = codes_[e];
      MOE_CHECK(!is_nan_code(q), kFormat, "FP8 tensor '{}' holds NaN at [{}, {}]", name_, e / cols, e % cols);
      *out = kValue[q] * scale;
    }
  }
}

}  // namespace moe
