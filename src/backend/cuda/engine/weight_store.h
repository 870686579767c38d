// The model's matrices on one device, each in the format the loader placed it in: bf16, or FP8
// codes with their f32 block scales (no bf16 copy). A WeightSink: the loader lays tensors out in
// an address-space arena on the host and hands their values (or FP8 codes and scales) here;
// matrix() then gives the DeviceMatrix of a loaded tensor. Device memory comes in slabs, so that
// what is resident is what the formats need, not a size guessed before loading.
#pragma once

#include <map>
#include <vector>

#include "backend/cuda/device_arena.h"
#include "backend/device_matrix.h"
#include "core/arena.h"
#include "io/checkpoint.h"

namespace moe::cuda {

class WeightStore : public WeightSink {
 public:
  // `fp8`: keep FP8 block-scaled weights as stored (else the loader dequantises them).
  // size_hint: about the bytes the weights will take (bounds the first slab of a small model).
  WeightStore(bool fp8, size_t size_hint);
  ~WeightStore() override;

  bool keeps_fp8_blocks() const override { return fp8_; }
  void place(float* dst, const std::vector<int64_t>& shape, const WeightFormat& format) override;
  void write(float* dst, const float* values, size_t count) override;
  void write_blocks(float* dst, const Fp8Piece& piece) override;
  bool fill_random(float* dst, size_t count, uint64_t state) override;

  // Uploads the block scales; call once every weight is written, before matrix().
  void finish();
  // The loaded tensor t (rank 2: [rows, cols]; rank 3: count x [rows, cols]) as the kernels take
  // it; empty for an undefined tensor.
  DeviceMatrix matrix(const Tensor& t) const;
  // Device bytes held (the slabs and the scales).
  size_t bytes() const;
  // Of those, the matrices' own: codes or values, and scales.
  size_t payload_bytes() const;
  // Matrices held in FP8, and the bytes of those.
  int64_t fp8_matrices() const { return fp8_matrices_; }
  // Checkpoint FP8 tensors written as stored.
  int64_t fp8_pieces() const { return fp8_pieces_; }
  size_t fp8_bytes() const { return fp8_bytes_; }

 private:
  struct Region {
    const float *host_begin = nullptr, *host_end = nullptr;
    void* device = nullptr;
    WeightFormat format;
    int64_t count = 1, rows = 0, cols = 0;
    std::vector<float> scales;  // host copy until finish()
    const float* device_scales = nullptr;
  };
  Region& region_of(const float* dst, size_t count, const char* what);
  void* take(size_t bytes);

  bool fp8_;
  size_t slab_bytes_;
  std::map<const float*, Region> regions_;
  std::vector<DeviceArena> slabs_;
  int shared_ = -1;  // the slab that small matrices share now
  DeviceArena scale_arena_;
  uint16_t* staging_ = nullptr;  // pinned, for bf16 values
  int64_t fp8_matrices_ = 0, fp8_pieces_ = 0;
  size_t fp8_bytes_ = 0;
  bool finished_ = false;
};

}  // namespace moe::cuda
