// Keys and values of every layer for one sequence, so that each generated token attends to the
// prefix without recomputing it. Contiguous rows [capacity, width] per layer; the paged cache of
// the serving scheduler builds on the same interface.
#pragma once

#include <cstdint>
#include <vector>

#include "moe/tensor.h"

namespace moe {

class KvCache {
 public:
  KvCache() = default;
  // `k_width` and `v_width` are the floats one token stores per layer.
  KvCache(int64_t layers, int64_t capacity, int64_t k_width, int64_t v_width);

  int64_t capacity() const { return capacity_; }
  int64_t length() const { return length_; }
  void set_length(int64_t n) { length_ = n; }
  void clear() { length_ = 0; }
  float* k(int64_t layer) const { return k_[static_cast<size_t>(layer)].data<float>(); }
  float* v(int64_t layer) const { return v_[static_cast<size_t>(layer)].data<float>(); }
  int64_t k_width() const { return k_width_; }
  int64_t v_width() const { return v_width_; }
  size_t bytes() const;

 private:
  int64_t capacity_ = 0, length_ = 0, k_width_ = 0, v_width_ = 0;
  std::vector<Tensor> k_, v_;
};

}  // namespace moe
