// Keys and values of every layer, so that each generated token attends to the prefix without
// recomputing it.
//
// Storage is paged: a KvBlockPool holds fixed-size blocks of `block_size` token rows per layer,
// and a KvCache is one sequence's view over a list of blocks (its block table). Row `pos` of a
// sequence lives in block blocks()[pos / block_size] at row pos % block_size. A standalone
// KvCache (the CLI, the tests, the benchmarks) owns a private pool of a single block as large as
// its capacity, so it is as contiguous as a plain array and needs no allocator; the serving
// scheduler gives many caches blocks of one shared pool instead.
//
// Prefix reuse: a full block's keys and values depend only on the token ids up to its end, so a
// block is published under a chain hash of those ids and another sequence with the same prefix
// can take a reference to it instead of recomputing it. Shared blocks are full and never written
// again. A published block whose last reference goes stays findable until the allocator hands it
// out again (least recently freed first), so a later request or a preempted one resuming can
// still find it.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <span>
#include <unordered_map>
#include <vector>

#include "moe/tensor.h"
#include "runtime/block_allocator.h"

namespace moe {

class KvBlockPool {
 public:
  // `k_width` and `v_width` are the floats one token stores per layer (v_width 0: no values).
  // Throws kInvalidArgument for a non-positive block count or block size.
  KvBlockPool(int64_t layers, int64_t num_blocks, int64_t block_size, int64_t k_width, int64_t v_width);

  int64_t layers() const { return layers_; }
  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }
  int64_t k_width() const { return k_width_; }
  int64_t v_width() const { return v_width_; }
  // The first row of `block` in `layer`: block_size rows of k_width (v_width) floats.
  float* k(int64_t layer, int32_t block) const;
  float* v(int64_t layer, int32_t block) const;
  size_t block_bytes() const;  // keys and values of one block over all layers
  size_t bytes() const;

  // The bookkeeping (BlockAllocator): references, the free list and published prefix blocks.
  BlockAllocator& allocator() { return blocks_; }
  int32_t allocate() { return blocks_.allocate(); }
  void retain(int32_t block) { blocks_.retain(block); }
  void release(int32_t block) { blocks_.release(block); }
  int32_t ref_count(int32_t block) const { return blocks_.ref_count(block); }
  int64_t used_blocks() const { return blocks_.used_blocks(); }
  int64_t free_blocks() const { return blocks_.free_blocks(); }
  int64_t cached_blocks() const { return blocks_.cached_blocks(); }
  static uint64_t chain_hash(uint64_t parent, std::span<const int32_t> tokens) {
    return BlockAllocator::chain_hash(parent, tokens);
  }
  void publish(int32_t block, uint64_t hash, std::span<const int32_t> tokens) { blocks_.publish(block, hash, tokens); }
  int32_t acquire_cached(uint64_t hash, std::span<const int32_t> tokens) { return blocks_.acquire_cached(hash, tokens); }

 private:
  int64_t layers_, num_blocks_, block_size_, k_width_, v_width_;
  BlockAllocator blocks_;
  std::vector<Tensor> k_, v_;  // per layer: [num_blocks * block_size, width]
};

class KvCache {
 public:
  KvCache() = default;
  // A standalone cache of `capacity` tokens, backed by a private single-block pool.
  KvCache(int64_t layers, int64_t capacity, int64_t k_width, int64_t v_width);
  // An empty view over `pool`'s blocks; the pool must outlive the cache.
  explicit KvCache(KvBlockPool& pool);
  // A view of blocks another owner holds the references of (an executor's sequence table): it
  // takes none and gives none back.
  static KvCache borrowed(KvBlockPool& pool, std::span<const int32_t> blocks, int64_t length);
  KvCache(KvCache&& other) noexcept;
  KvCache& operator=(KvCache&& other) noexcept;
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;
  ~KvCache();  // gives its references back to the pool

  // Tokens the blocks held can store.
  int64_t capacity() const { return static_cast<int64_t>(blocks_.size()) * block_size(); }
  int64_t length() const { return length_; }
  void set_length(int64_t n) { length_ = n; }
  void clear() { length_ = 0; }
  // Appends a block to the table, taking over one reference that the caller holds.
  void append_block(int32_t block);
  // Gives every block back to the pool and empties the cache.
  void release();

  KvBlockPool* pool() const { return pool_; }
  // Whether another owner holds this cache's block references (borrowed()).
  bool is_borrowed() const { return borrowed_; }
  const std::vector<int32_t>& blocks() const { return blocks_; }
  int64_t block_size() const { return pool_ ? pool_->block_size() : 0; }
  int64_t k_width() const { return pool_ ? pool_->k_width() : 0; }
  int64_t v_width() const { return pool_ ? pool_->v_width() : 0; }
  // Row `pos` of a layer; pos < capacity().
  float* k_row(int64_t layer, int64_t pos) const;
  float* v_row(int64_t layer, int64_t pos) const;
  size_t bytes() const;  // of the blocks this cache holds

 private:
  std::unique_ptr<KvBlockPool> owned_;  // standalone caches only
  KvBlockPool* pool_ = nullptr;
  std::vector<int32_t> blocks_;
  int64_t length_ = 0;
  bool borrowed_ = false;
};

}  // namespace moe
