// A weight matrix on the device as the loader placed it: where it is, its shape, its format and,
// for a block-scaled format, its scales. Projections and experts take these rather than raw
// element pointers, and dispatch on the format (projection.h, cuda_moe.h), so that a new weight
// format changes the loader and the kernels but no signature in between. `count` stacks
// matrices of one shape back to back (the experts of a layer, the heads of a per-head product).
#pragma once

#include <cstdint>

#include "moe/errors.h"
#include "moe/weight_format.h"

namespace moe::cuda {

// The block-scaled format the CUDA kernels read: FP8 E4M3 codes, one f32 scale per 128 x 128
// block (DeepSeek-V3's and Qwen3-FP8's layout).
inline constexpr WeightFormat kFp8Blocks{DType::kF8E4M3, 128, 128};

struct DeviceMatrix {
  const void* data = nullptr;
  WeightFormat format;
  const float* scales = nullptr;  // format.scaled(): per block, row-major, for every matrix
  int64_t rows = 0, cols = 0, count = 1;
  int64_t stride = 0;  // elements from one of the `count` matrices to the next; 0: rows * cols

  explicit operator bool() const { return data != nullptr; }

  // A bf16 matrix.
  static DeviceMatrix bf16(const void* data, int64_t rows, int64_t cols, int64_t count = 1, int64_t stride = 0) {
    DeviceMatrix m;
    m.data = data;
    m.rows = rows;
    m.cols = cols;
    m.count = count;
    m.stride = stride;
    return m;
  }
  int64_t matrix_stride() const { return stride ? stride : rows * cols; }

  // Rows [first, first + n) of a single matrix, as a matrix of its own.
  DeviceMatrix row_slice(int64_t first, int64_t n) const {
    MOE_CHECK(count == 1 && first >= 0 && n >= 0 && first + n <= rows, kInternal,
              "rows [{}, {}) of a {} x {} matrix", first, first + n, rows, cols);
    MOE_CHECK(!format.scaled() || first % format.block_rows == 0, kInternal,
              "a row slice from {} splits a block of {} rows", first, format.block_rows);
    DeviceMatrix s = *this;
    s.data = static_cast<const char*>(data) + first * cols * static_cast<int64_t>(dtype_size(format.dtype));
    if (format.scaled())
      s.scales = scales + (first / format.block_rows) * ((cols + format.block_cols - 1) / format.block_cols);
    s.rows = n;
    return s;
  }

  // The elements as bf16, for a kernel that reads nothing else; kUnsupported naming `what` and
  // the format otherwise.
  const uint16_t* bf16_data(const char* what) const {
    MOE_CHECK(format == WeightFormat{}, kUnsupported, "{}: no CUDA kernel reads {} weights yet", what, format.name());
    return static_cast<const uint16_t*>(data);
  }
};

}  // namespace moe::cuda
