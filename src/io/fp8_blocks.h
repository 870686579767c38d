// One FP8 weight of a checkpoint as DeepSeek-V3 and Qwen3-*-FP8 store it: an F8_E4M3 matrix
// [N, K] beside `<name>_scale_inv` (for `<prefix>.weight`: `<prefix>.weight_scale_inv`), f32
// [ceil(N / block_rows), ceil(K / block_cols)], one scale per block, edge blocks partial; the
// weight's value is q x scale of its block. Both are checked when the tensor is opened, so that a
// missing or misshapen scale, a non-finite or non-positive scale, a NaN code or an E5M2 tensor
// is one line naming the tensor before anything is converted; the values then come out exactly
// (every E4M3 code times an f32 scale is one f32 product, rounded once).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/checkpoint.h"

namespace moe {

class Fp8Tensor {
 public:
  // The weight `name` of `ckpt` in blocks of block_rows x block_cols. Throws kFormat or kShape
  // naming the tensor (or its scale) for anything the layout above does not allow.
  Fp8Tensor(const Checkpoint& ckpt, const std::string& name, int64_t block_rows, int64_t block_cols);

  // The name of the scale tensor, and its bytes on disk.
  const std::string& scale_name() const { return scale_name_; }
  uint64_t scale_bytes() const { return scale_bytes_; }
  // Elements [at, at + count) of the matrix in row-major order, dequantised into out.
  void dequantize(size_t at, size_t count, float* out) const;
  // The codes and scales as stored, for a sink that keeps them (the codes checked free of NaN;
  // valid while the checkpoint and this object live).
  Fp8Piece piece() const;

 private:
  std::string name_, scale_name_;
  const uint8_t* codes_ = nullptr;
  int64_t rows_ = 0, cols_ = 0, block_rows_ = 0, block_cols_ = 0, scale_cols_ = 0;
  std::vector<float> scales_;
  uint64_t scale_bytes_ = 0;
};

}  // namespace moe
