#include "runtime/kv_cache.h"

#include <algorithm>
#include <utility>

#include "moe/errors.h"

namespace moe {

KvBlockPool::KvBlockPool(int64_t layers, int64_t num_blocks, int64_t block_size, int64_t k_width,
                         int64_t v_width)
    : layers_(layers), num_blocks_(num_blocks), block_size_(block_size), k_width_(k_width), v_width_(v_width),
      blocks_(num_blocks, block_size) {
  for (int64_t l = 0; l < layers; ++l) {
    k_.push_back(Tensor::zeros({num_blocks * block_size, k_width}));
    v_.push_back(Tensor::zeros({num_blocks * block_size, v_width}));  // MLA keeps no values: width 0
  }
}

float* KvBlockPool::k(int64_t layer, int32_t block) const {
  return k_[static_cast<size_t>(layer)].data<float>() + block * block_size_ * k_width_;
}

float* KvBlockPool::v(int64_t layer, int32_t block) const {
  return v_[static_cast<size_t>(layer)].data<float>() + block * block_size_ * v_width_;
}

size_t KvBlockPool::block_bytes() const {
  return static_cast<size_t>(layers_ * block_size_ * (k_width_ + v_width_)) * sizeof(float);
}

size_t KvBlockPool::bytes() const { return block_bytes() * static_cast<size_t>(num_blocks_); }

KvCache::KvCache(int64_t layers, int64_t capacity, int64_t k_width, int64_t v_width) {
  MOE_CHECK(capacity > 0, kInvalidArgument, "KV cache capacity must be positive, got {}", capacity);
  owned_ = std::make_unique<KvBlockPool>(layers, 1, capacity, k_width, v_width);
  pool_ = owned_.get();
  blocks_.push_back(pool_->allocate());
}

KvCache::KvCache(KvBlockPool& pool) : pool_(&pool) {}

KvCache KvCache::borrowed(KvBlockPool& pool, std::span<const int32_t> blocks, int64_t length) {
  KvCache c(pool);
  c.blocks_.assign(blocks.begin(), blocks.end());
  c.length_ = length;
  c.borrowed_ = true;
  return c;
}

KvCache::KvCache(KvCache&& other) noexcept
    : owned_(std::move(other.owned_)),
      pool_(std::exchange(other.pool_, nullptr)),
      blocks_(std::move(other.blocks_)),
      length_(std::exchange(other.length_, 0)),
      borrowed_(std::exchange(other.borrowed_, false)) {
  other.blocks_.clear();
}

KvCache& KvCache::operator=(KvCache&& other) noexcept {
  if (this != &other) {
    release();
    owned_ = std::move(other.owned_);
    pool_ = std::exchange(other.pool_, nullptr);
    blocks_ = std::move(other.blocks_);
    other.blocks_.clear();
    length_ = std::exchange(other.length_, 0);
    borrowed_ = std::exchange(other.borrowed_, false);
  }
  return *this;
}

KvCache::~KvCache() { release(); }

void KvCache::append_block(int32_t block) {
  MOE_CHECK(pool_ != nullptr, kInternal, "a KV cache without a pool cannot take blocks");
  MOE_CHECK(pool_->ref_count(block) > 0, kInternal, "KV block {} is appended without a reference", block);
  blocks_.push_back(block);
}

void KvCache::release() {
  if (pool_ && !borrowed_)
    for (int32_t b : blocks_) pool_->release(b);
  blocks_.clear();
  length_ = 0;
}

float* KvCache::k_row(int64_t layer, int64_t pos) const {
  const int64_t bs = pool_->block_size();
  return pool_->k(layer, blocks_[static_cast<size_t>(pos / bs)]) + (pos % bs) * pool_->k_width();
}

float* KvCache::v_row(int64_t layer, int64_t pos) const {
  const int64_t bs = pool_->block_size();
  return pool_->v(layer, blocks_[static_cast<size_t>(pos / bs)]) + (pos % bs) * pool_->v_width();
}

size_t KvCache::bytes() const {
  return pool_ ? pool_->block_bytes() * blocks_.size() : 0;
}

}  // namespace moe
