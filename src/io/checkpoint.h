// A Hugging Face model directory's weights: model.safetensors, or the shards listed by
// model.safetensors.index.json. Tensors are found by name across shards, converted once to the
// compute layout (f32 on the CPU) and tracked, so that strict loading can report tensors that
// were expected but missing, or present but never used.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "core/arena.h"
#include "io/safetensors.h"
#include "moe/weight_format.h"

namespace moe {

class Checkpoint {
 public:
  // Opens every shard of the directory and validates their headers; throws kIo / kFormat.
  explicit Checkpoint(const std::string& dir);

  const std::string& dir() const { return dir_; }
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  const TensorInfo& info(const std::string& name) const;  // throws kShape naming a missing tensor
  const void* data(const std::string& name) const;
  // Every tensor name, sorted.
  std::vector<std::string> names() const;
  uint64_t total_bytes() const;     // bytes of tensor data on disk
  uint64_t total_elements() const;  // parameters

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, std::pair<const SafetensorsFile*, const TensorInfo*>> where_;
};

// One FP8 checkpoint matrix as stored: codes [rows, cols] (E4M3, checked free of NaN) and its
// f32 scales, one per block_rows x block_cols block, row-major, edge blocks partial.
struct Fp8Piece {
  const uint8_t* codes = nullptr;
  int64_t rows = 0, cols = 0;
  const float* scales = nullptr;
  int64_t block_rows = 0, block_cols = 0;
};

// Receives weights as the loader converts them. With a sink the host arena only lays tensors
// out (an address-space arena): values of tensors of rank >= 2 go to the sink alone, tensors of
// rank 1 (norms, biases) to the host alone, being small and needed there as f32.
class WeightSink {
 public:
  virtual ~WeightSink() = default;
  // Whether the sink keeps FP8 block-scaled weights as they are stored (write_blocks) rather
  // than as values.
  virtual bool keeps_fp8_blocks() const { return false; }
  // A destination of rank >= 2 laid out at host address dst: what follows writes into it, in
  // `format` (bf16: values through write() or fill_random(); FP8 blocks: write_blocks(), or
  // fill_random() drawing codes and scales).
  virtual void place(float* dst, const std::vector<int64_t>& shape, const WeightFormat& format) {
    (void)dst, (void)shape, (void)format;
  }
  // values[0, count) belong at host address dst .. dst + count.
  virtual void write(float* dst, const float* values, size_t count) = 0;
  // The FP8 matrix `piece` belongs at host address dst (whole rows of a placed FP8 destination,
  // starting on a block boundary).
  virtual void write_blocks(float* dst, const Fp8Piece& piece) { (void)dst, (void)piece; }
  // Draws the random tensor at dst where the sink keeps it, with the loader's stream started
  // from `state` (see WeightLoader: pair i of values comes from splitmix64 step i + 1).
  // false: the sink cannot; the loader draws on the host and calls write().
  virtual bool fill_random(float* dst, size_t count, uint64_t state) {
    (void)dst, (void)count, (void)state;
    return false;
  }
};

// Hands out tensors from a checkpoint, converted to f32 into the weights arena; or, with no
// checkpoint, random tensors (for benchmarks of real shapes without the real weights).
class WeightLoader {
 public:
  // strict: every checkpoint tensor must be taken, and every request must be satisfied.
  WeightLoader(const Checkpoint& ckpt, Arena& arena, bool strict);
  // Random weights: uniform with standard deviation 0.02 (norm weights: 1), a fixed function of
  // the seed and the tensor name. Every request is satisfied.
  WeightLoader(Arena& arena, uint64_t seed);
  // Records the names and shapes asked for; reads and allocates nothing (tensors come back
  // undefined). Lists what a configuration implies without holding its weights.
  static WeightLoader recording(Arena& arena);

  // One checkpoint tensor that take_into will write into an allocation: its name and rows.
  struct Part {
    std::string name;
    int64_t rows = 0;
  };
  // Memory for a tensor the caller fills through take_into (undefined when recording), from
  // `parts` in order (their rows stacked, repeating over the leading dimension of a 3-D shape).
  // With a sink that keeps FP8 blocks, the destination is FP8 when every part is and each part
  // starts on a block row; otherwise its FP8 parts are dequantised (to bf16 on the sink's side).
  Tensor allocate(const std::vector<int64_t>& shape, const std::vector<Part>& parts = {});
  // Every (name, shape) taken so far, in the order taken.
  const std::vector<std::pair<std::string, std::vector<int64_t>>>& taken() const { return order_; }

  // The tensor `name` converted to f32 with exactly `shape`; throws kShape naming the tensor when
  // it is missing or its shape differs.
  Tensor take(const std::string& name, const std::vector<int64_t>& shape);
  // Converts the tensor into `dst` (which holds shape's element count of f32; ignored when
  // recording).
  void take_into(const std::string& name, const std::vector<int64_t>& shape, float* dst);
  // As take(), but returns an undefined Tensor when the tensor is absent and loading is not strict.
  Tensor take_if_present(const std::string& name, const std::vector<int64_t>& shape);
  // Marks a tensor as deliberately unused (e.g. an lm_head tied to the embedding, another rank's
  // experts), and the FP8 scale that goes with it where the checkpoint has one.
  void ignore(const std::string& name) {
    taken_.insert(name);
    taken_.insert(name + "_scale_inv");
  }
  // Marks every checkpoint tensor whose name starts with `prefix` as deliberately unused and
  // returns how many there were (0 without a checkpoint).
  int64_t ignore_prefix(const std::string& prefix);
  // In strict mode, throws kShape naming the tensors that were never taken.
  void finish();

  uint64_t bytes_loaded() const { return bytes_loaded_; }
  // FP8 weights (io/fp8_blocks.h) in blocks of block_rows x block_cols, which the checkpoint's
  // quantization_config declares; a module listed in `not_converted` must not be FP8. Without
  // this call an FP8 tensor is refused.
  void set_fp8_blocks(int64_t block_rows, int64_t block_cols, std::vector<std::string> not_converted);
  // FP8 weights taken so far.
  int64_t fp8_tensors() const { return fp8_tensors_; }
  // Route values through `sink` (see WeightSink); it must outlive the loading.
  void set_sink(WeightSink* sink) { sink_ = sink; }
  // Called as bytes are converted (for progress on a terminal).
  std::function<void(uint64_t done, uint64_t total)> on_progress;

 private:
  const Checkpoint* ckpt_;  // null: random weights
  Arena& arena_;
  bool strict_;
  uint64_t seed_ = 0;
  bool recording_ = false;
  WeightSink* sink_ = nullptr;
  std::vector<std::pair<std::string, std::vector<int64_t>>> order_;
  std::set<std::string> taken_;
  uint64_t bytes_loaded_ = 0;
  int64_t fp8_rows_ = 0, fp8_cols_ = 0;
  std::vector<std::string> fp8_not_converted_;
  int64_t fp8_tensors_ = 0;
  // Destinations placed in FP8 on the sink, by start: their end.
  std::map<const float*, const float*> fp8_destinations_;

  bool is_fp8_part(const std::string& name) const;
  WeightFormat format_for(const std::vector<int64_t>& shape, const std::vector<Part>& parts) const;
  bool in_fp8_destination(const float* dst) const;
};

}  // namespace moe
