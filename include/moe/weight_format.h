// How a weight matrix is stored: its element type and, for block-scaled formats, the block of
// elements one f32 scale covers (a [rows, cols] matrix then has ceil(rows / block_rows) x
// ceil(cols / block_cols) scales, row-major; edge blocks are partial). The format travels with
// a matrix from the loader to the kernels, which dispatch on it: a new format is a loader case,
// an exact dequantisation on the CPU and its kernels, with no signature change in between.
#pragma once

#include <cstdint>
#include <string>

#include "moe/tensor.h"

namespace moe {

struct WeightFormat {
  DType dtype = DType::kBF16;
  int64_t block_rows = 0, block_cols = 0;  // 0 x 0: no scales

  bool scaled() const { return block_rows > 0 && block_cols > 0; }
  bool operator==(const WeightFormat&) const = default;
  // "bf16", or the element type with its block, e.g. "f32 (128 x 128 blocks)".
  std::string name() const;
};

}  // namespace moe
