// The weight quantization a checkpoint declares in config.json's `quantization_config`, checked
// before any weight is read. The engine runs FP8 block-scaled weights as DeepSeek-V3/R1/V3.1,
// Kimi-K2 and Qwen3-*-FP8 publish them: E4M3 values with one f32 `weight_scale_inv` per
// 128 x 128 block (the weight is q x scale of its block) and activations quantised on the fly
// ("dynamic"). Which tensors are FP8 follows the files; every other method or layout is refused
// with one line naming what is supported.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "io/hf_config.h"
#include "moe/weight_format.h"

namespace moe {

struct Quantization {
  bool fp8 = false;  // quant_method "fp8": E4M3 weights in scaled blocks
  int64_t block_rows = 0, block_cols = 0;
  // "ue8m0" (DeepSeek-V3.1): the scales are powers of two, still stored as f32; "" otherwise.
  std::string scale_fmt;
  // Modules kept in the storage dtype ("lm_head", "model.layers.0.mlp.gate", ...).
  std::vector<std::string> modules_to_not_convert;

  // The format of the FP8 weights (f8_e4m3 in block_rows x block_cols blocks); bf16 when none.
  WeightFormat weight_format() const;
  // One line for `moe-cli info`: "fp8 e4m3, 128 x 128 blocks, dynamic activations" or "none".
  std::string describe() const;
};

// Reads `quantization_config` (absent: no quantization). Throws kUnsupported naming the method,
// key or value the engine does not run and what it does, kConfig for a malformed value.
Quantization parse_quantization(const HfConfig& cfg);

}  // namespace moe
