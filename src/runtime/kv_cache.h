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

  // A block with one reference, or -1 when every block is referenced. Reuses the least recently
  // freed block, dropping the prefix entry it may still carry.
  int32_t allocate();
  void retain(int32_t block);
  // Drops one reference; at zero the block becomes free (and stays findable if published).
  void release(int32_t block);
  int32_t ref_count(int32_t block) const;
  int64_t used_blocks() const { return num_blocks_ - static_cast<int64_t>(free_.size()); }
  int64_t free_blocks() const { return static_cast<int64_t>(free_.size()); }
  // Published blocks that are still findable (in use or free).
  int64_t cached_blocks() const { return static_cast<int64_t>(index_.size()); }

  // The prefix key of a block: `parent` is the key of the block before it (0 for the first),
  // `tokens` its block_size token ids.
  static uint64_t chain_hash(uint64_t parent, std::span<const int32_t> tokens);
  // Makes a full block findable under `hash`. When another block already holds that hash the
  // call does nothing: the older copy stays the shared one.
  void publish(int32_t block, uint64_t hash, std::span<const int32_t> tokens);
  // The block published under `hash` with exactly these tokens, with one more reference; -1
  // when there is none. The token comparison makes a hash collision a miss, not wrong keys.
  int32_t acquire_cached(uint64_t hash, std::span<const int32_t> tokens);

 private:
  void check_block(int32_t block) const;
  void unpublish(int32_t block);

  int64_t layers_, num_blocks_, block_size_, k_width_, v_width_;
  std::vector<Tensor> k_, v_;  // per layer: [num_blocks * block_size, width]
  std::vector<int32_t> refs_;
  std::list<int32_t> free_;  // least recently freed first
  std::vector<std::list<int32_t>::iterator> free_pos_;
  std::unordered_map<uint64_t, int32_t> index_;  // prefix hash -> block
  std::vector<uint64_t> hash_of_;
  std::vector<bool> published_;
  std::vector<int32_t> block_tokens_;  // [num_blocks, block_size]: what each published block holds
};

class KvCache {
 public:
  KvCache() = default;
  // A standalone cache of `capacity` tokens, backed by a private single-block pool.
  KvCache(int64_t layers, int64_t capacity, int64_t k_width, int64_t v_width);
  // An empty view over `pool`'s blocks; the pool must outlive the cache.
  explicit KvCache(KvBlockPool& pool);
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
};

}  // namespace moe
