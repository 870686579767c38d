#include "backend/cuda/engine/weight_store.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/ops/fill_launch.h"
#include "moe/errors.h"

namespace moe::cuda {
namespace {

constexpr size_t kStaging = size_t(1) << 22;  // bf16 values converted at a time
constexpr size_t kSlabBytes = size_t(256) << 20;

int64_t blocks(int64_t n, int64_t block) { return (n + block - 1) / block; }

}  // namespace

WeightStore::WeightStore(bool fp8, size_t size_hint)
    : fp8_(fp8), slab_bytes_(std::max<size_t>(std::min(kSlabBytes, size_hint), 1 << 20)) {
  MOE_CUDA_CHECK(cudaMallocHost(&staging_, kStaging * 2));
}

WeightStore::~WeightStore() { cudaFreeHost(staging_); }

// A matrix of at least half a slab gets memory of its own; smaller ones share the current slab,
// so that a slab's unused tail is never more than half a slab.
void* WeightStore::take(size_t bytes) {
  if (bytes >= slab_bytes_ / 2) {
    slabs_.emplace_back("weights", bytes);
    return slabs_.back().take(bytes);
  }
  if (shared_ < 0 || ((slabs_[shared_].used() + 255) & ~size_t(255)) + bytes > slabs_[shared_].capacity()) {
    slabs_.emplace_back("weights", slab_bytes_);
    shared_ = static_cast<int>(slabs_.size()) - 1;
  }
  return slabs_[shared_].take(bytes);
}

void WeightStore::place(float* dst, const std::vector<int64_t>& shape, const WeightFormat& format) {
  MOE_CHECK(shape.size() >= 2 && !finished_, kInternal, "weight store: a destination of rank {}", shape.size());
  MOE_CHECK(!format.scaled() || (fp8_ && format.dtype == DType::kF8E4M3), kInternal,
            "weight store: a {} destination", format.name());
  Region r;
  r.format = format;
  r.rows = shape[shape.size() - 2];
  r.cols = shape.back();
  for (size_t i = 0; i + 2 < shape.size(); ++i) r.count *= shape[i];
  const size_t elements = static_cast<size_t>(r.count * r.rows * r.cols);
  r.host_begin = dst;
  r.host_end = dst + elements;
  r.device = take(elements * dtype_size(format.dtype));
  if (format.scaled()) {
    r.scales.assign(static_cast<size_t>(r.count * blocks(r.rows, format.block_rows) * blocks(r.cols, format.block_cols)),
                    std::numeric_limits<float>::quiet_NaN());  // NaN: not written yet
    ++fp8_matrices_;
    fp8_bytes_ += elements;
  }
  regions_[dst] = std::move(r);
}

WeightStore::Region& WeightStore::region_of(const float* dst, size_t count, const char* what) {
  auto it = regions_.upper_bound(dst);
  MOE_CHECK(it != regions_.begin(), kInternal, "weight store: {} outside every placed tensor", what);
  --it;
  MOE_CHECK(dst + count <= it->second.host_end, kInternal, "weight store: {} past the end of its tensor", what);
  return it->second;
}

void WeightStore::write(float* dst, const float* values, size_t count) {
  Region& r = region_of(dst, count, "values");
  MOE_CHECK(!r.format.scaled(), kInternal, "weight store: values for an FP8 tensor");
  uint16_t* out = static_cast<uint16_t*>(r.device) + (dst - r.host_begin);
  for (size_t done = 0; done < count; done += kStaging) {
    const size_t n = std::min(kStaging, count - done);
    for (size_t i = 0; i < n; ++i) staging_[i] = f32_to_bf16(values[done + i]);
    MOE_CUDA_CHECK(cudaMemcpy(out + done, staging_, n * 2, cudaMemcpyHostToDevice));
  }
}

void WeightStore::write_blocks(float* dst, const Fp8Piece& piece) {
  Region& r = region_of(dst, static_cast<size_t>(piece.rows * piece.cols), "FP8 codes");
  const WeightFormat& f = r.format;
  const int64_t at = dst - r.host_begin, matrix = at / (r.rows * r.cols), row = at % (r.rows * r.cols) / r.cols;
  MOE_CHECK(f.scaled() && piece.cols == r.cols && at % r.cols == 0 && row % f.block_rows == 0 &&
                piece.block_rows == f.block_rows && piece.block_cols == f.block_cols,
            kInternal, "weight store: FP8 rows [{}, +{}) do not fit their {} destination", row, piece.rows, f.name());
  MOE_CUDA_CHECK(cudaMemcpy(static_cast<uint8_t*>(r.device) + at, piece.codes,
                            static_cast<size_t>(piece.rows * piece.cols), cudaMemcpyHostToDevice));
  const int64_t scale_cols = blocks(r.cols, f.block_cols), scale_rows = blocks(r.rows, f.block_rows);
  const int64_t first = matrix * scale_rows + row / f.block_rows;
  std::copy_n(piece.scales, blocks(piece.rows, f.block_rows) * scale_cols, r.scales.begin() + first * scale_cols);
  ++fp8_pieces_;
}

bool WeightStore::fill_random(float* dst, size_t count, uint64_t state) {
  Region& r = region_of(dst, count, "random values");
  const int64_t at = dst - r.host_begin;
  if (!r.format.scaled()) {
    MOE_CUDA_CHECK(kernels::fill_random_bf16(static_cast<uint16_t*>(r.device) + at, count, state, nullptr));
    return true;
  }
  const WeightFormat& f = r.format;
  MOE_CHECK(at % r.cols == 0 && static_cast<int64_t>(count) % r.cols == 0 && at % (r.rows * r.cols) / r.cols % f.block_rows == 0,
            kInternal, "weight store: random FP8 rows that split a block");
  MOE_CUDA_CHECK(kernels::fill_random_fp8(static_cast<uint8_t*>(r.device) + at, count, state, nullptr));
  // Every block the rows touch: their scale rows (whole matrices, or block rows of one).
  const int64_t scale_cols = blocks(r.cols, f.block_cols), scale_rows = blocks(r.rows, f.block_rows);
  const int64_t first_row = at / r.cols, rows = static_cast<int64_t>(count) / r.cols;
  for (int64_t row = first_row; row < first_row + rows;) {
    const int64_t matrix = row / r.rows, in_matrix = row % r.rows;
    std::fill_n(r.scales.begin() + (matrix * scale_rows + in_matrix / f.block_rows) * scale_cols, scale_cols,
                kernels::kRandomFp8Scale);
    row += std::min(f.block_rows - in_matrix % f.block_rows, r.rows - in_matrix);  // the next block row
  }
  return true;
}

void WeightStore::finish() {
  MOE_CHECK(!finished_, kInternal, "weight store finished twice");
  size_t bytes = 256;
  for (const auto& [_, r] : regions_) bytes += r.scales.size() * 4 + 256;
  scale_arena_ = DeviceArena("weight scales", bytes);
  for (auto& [_, r] : regions_) {
    if (r.scales.empty()) continue;
    for (float s : r.scales) MOE_CHECK(std::isfinite(s), kInternal, "weight store: an FP8 block left without a scale");
    float* d = scale_arena_.take_n<float>(r.scales.size());
    MOE_CUDA_CHECK(cudaMemcpy(d, r.scales.data(), r.scales.size() * 4, cudaMemcpyHostToDevice));
    r.device_scales = d;
    r.scales = {};
  }
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  finished_ = true;
}

DeviceMatrix WeightStore::matrix(const Tensor& t) const {
  if (!t.defined()) return {};
  auto it = regions_.find(t.data<float>());
  MOE_CHECK(finished_ && it != regions_.end() && it->second.host_end == t.data<float>() + t.numel(), kInternal,
            "weight store: a tensor that was not placed whole");
  const Region& r = it->second;
  DeviceMatrix m;
  m.data = r.device;
  m.format = r.format;
  m.scales = r.device_scales;
  m.rows = r.rows;
  m.cols = r.cols;
  m.count = r.count;
  return m;
}

size_t WeightStore::payload_bytes() const {
  size_t total = 0;
  for (const auto& [_, r] : regions_) {
    total += static_cast<size_t>(r.count * r.rows * r.cols) * dtype_size(r.format.dtype);
    if (r.format.scaled())
      total += static_cast<size_t>(r.count * blocks(r.rows, r.format.block_rows) * blocks(r.cols, r.format.block_cols)) * 4;
  }
  return total;
}

size_t WeightStore::bytes() const {
  size_t total = scale_arena_.capacity();
  for (const DeviceArena& s : slabs_) total += s.capacity();
  return total;
}

}  // namespace moe::cuda
