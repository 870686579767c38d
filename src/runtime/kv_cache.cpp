#include "runtime/kv_cache.h"

#include "moe/errors.h"

namespace moe {

KvCache::KvCache(int64_t layers, int64_t capacity, int64_t k_width, int64_t v_width)
    : capacity_(capacity), k_width_(k_width), v_width_(v_width) {
  MOE_CHECK(capacity > 0, kInvalidArgument, "KV cache capacity must be positive, got {}", capacity);
  for (int64_t l = 0; l < layers; ++l) {
    k_.push_back(Tensor::zeros({capacity, k_width}));
    v_.push_back(Tensor::zeros({capacity, v_width}));  // MLA keeps no values: width 0
  }
}

size_t KvCache::bytes() const {
  size_t total = 0;
  for (const auto& t : k_) total += t.nbytes();
  for (const auto& t : v_) total += t.nbytes();
  return total;
}

}  // namespace moe
