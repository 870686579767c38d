#include "runtime/kv_cache.h"

#include <algorithm>
#include <utility>

#include "moe/errors.h"

namespace moe {

KvBlockPool::KvBlockPool(int64_t layers, int64_t num_blocks, int64_t block_size, int64_t k_width,
                         int64_t v_width)
    : layers_(layers), num_blocks_(num_blocks), block_size_(block_size), k_width_(k_width), v_width_(v_width) {
  MOE_CHECK(num_blocks > 0, kInvalidArgument, "KV block count must be positive, got {}", num_blocks);
  MOE_CHECK(block_size > 0, kInvalidArgument, "KV block size must be positive, got {}", block_size);
  MOE_CHECK(num_blocks <= INT32_MAX, kInvalidArgument, "too many KV blocks: {}", num_blocks);
  for (int64_t l = 0; l < layers; ++l) {
    k_.push_back(Tensor::zeros({num_blocks * block_size, k_width}));
    v_.push_back(Tensor::zeros({num_blocks * block_size, v_width}));  // MLA keeps no values: width 0
  }
  const auto n = static_cast<size_t>(num_blocks);
  refs_.assign(n, 0);
  free_pos_.resize(n);
  for (int32_t b = 0; b < static_cast<int32_t>(num_blocks); ++b)
    free_pos_[static_cast<size_t>(b)] = free_.insert(free_.end(), b);
  hash_of_.assign(n, 0);
  published_.assign(n, false);
}

void KvBlockPool::check_block(int32_t block) const {
  MOE_CHECK(block >= 0 && block < num_blocks_, kInternal, "KV block {} is outside the pool of {}",
            block, num_blocks_);
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

int32_t KvBlockPool::allocate() {
  if (free_.empty()) return -1;
  const int32_t b = free_.front();
  free_.pop_front();
  unpublish(b);  // its contents are about to be overwritten
  refs_[static_cast<size_t>(b)] = 1;
  return b;
}

void KvBlockPool::retain(int32_t block) {
  check_block(block);
  int32_t& r = refs_[static_cast<size_t>(block)];
  if (r == 0) free_.erase(free_pos_[static_cast<size_t>(block)]);
  ++r;
}

void KvBlockPool::release(int32_t block) {
  check_block(block);
  int32_t& r = refs_[static_cast<size_t>(block)];
  MOE_CHECK(r > 0, kInternal, "KV block {} released more often than it was taken", block);
  if (--r == 0) free_pos_[static_cast<size_t>(block)] = free_.insert(free_.end(), block);
}

int32_t KvBlockPool::ref_count(int32_t block) const {
  check_block(block);
  return refs_[static_cast<size_t>(block)];
}

uint64_t KvBlockPool::chain_hash(uint64_t parent, std::span<const int32_t> tokens) {
  // splitmix64's finaliser after folding in each token: every input bit reaches every output bit,
  // so prefixes that differ anywhere give unrelated keys.
  auto mix = [](uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  };
  uint64_t h = mix(parent ^ 0x6b76636163686521ull);
  for (int32_t t : tokens) h = mix(h ^ static_cast<uint32_t>(t));
  return mix(h ^ tokens.size());
}

void KvBlockPool::publish(int32_t block, uint64_t hash, std::span<const int32_t> tokens) {
  check_block(block);
  MOE_CHECK(static_cast<int64_t>(tokens.size()) == block_size_, kInternal,
            "only a full block can be published ({} of {} tokens)", tokens.size(), block_size_);
  if (published_[static_cast<size_t>(block)] || index_.count(hash)) return;
  if (block_tokens_.empty()) block_tokens_.assign(static_cast<size_t>(num_blocks_ * block_size_), 0);
  std::copy(tokens.begin(), tokens.end(), block_tokens_.begin() + block * block_size_);
  index_.emplace(hash, block);
  hash_of_[static_cast<size_t>(block)] = hash;
  published_[static_cast<size_t>(block)] = true;
}

int32_t KvBlockPool::acquire_cached(uint64_t hash, std::span<const int32_t> tokens) {
  auto it = index_.find(hash);
  if (it == index_.end() || static_cast<int64_t>(tokens.size()) != block_size_) return -1;
  const int32_t b = it->second;
  if (!std::equal(tokens.begin(), tokens.end(), block_tokens_.begin() + b * block_size_)) return -1;
  retain(b);
  return b;
}

void KvBlockPool::unpublish(int32_t block) {
  if (!published_[static_cast<size_t>(block)]) return;
  index_.erase(hash_of_[static_cast<size_t>(block)]);
  published_[static_cast<size_t>(block)] = false;
}

KvCache::KvCache(int64_t layers, int64_t capacity, int64_t k_width, int64_t v_width) {
  MOE_CHECK(capacity > 0, kInvalidArgument, "KV cache capacity must be positive, got {}", capacity);
  owned_ = std::make_unique<KvBlockPool>(layers, 1, capacity, k_width, v_width);
  pool_ = owned_.get();
  blocks_.push_back(pool_->allocate());
}

KvCache::KvCache(KvBlockPool& pool) : pool_(&pool) {}

KvCache::KvCache(KvCache&& other) noexcept
    : owned_(std::move(other.owned_)),
      pool_(std::exchange(other.pool_, nullptr)),
      blocks_(std::move(other.blocks_)),
      length_(std::exchange(other.length_, 0)) {
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
  if (pool_)
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
