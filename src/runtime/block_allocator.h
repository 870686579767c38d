// The bookkeeping of a paged KV cache, apart from where the keys and values live: which blocks
// are taken and how often (shared prefix blocks have several references), which are free (least
// recently freed handed out first), and which full blocks are published for prefix reuse under a
// chain hash of the token ids up to their end. KvBlockPool keeps its host storage beside one; the
// CUDA engine keeps its device storage beside another.
#pragma once

#include <cstdint>
#include <list>
#include <span>
#include <unordered_map>
#include <vector>

namespace moe {

class BlockAllocator {
 public:
  // Blocks 0 .. num_blocks - 1 of block_size tokens, all free. Throws kInvalidArgument for a
  // non-positive count or size.
  BlockAllocator(int64_t num_blocks, int64_t block_size);

  int64_t num_blocks() const { return num_blocks_; }
  int64_t block_size() const { return block_size_; }

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

  int64_t num_blocks_, block_size_;
  std::vector<int32_t> refs_;
  std::list<int32_t> free_;  // least recently freed first
  std::vector<std::list<int32_t>::iterator> free_pos_;
  std::unordered_map<uint64_t, int32_t> index_;  // prefix hash -> block
  std::vector<uint64_t> hash_of_;
  std::vector<bool> published_;
  std::vector<int32_t> block_tokens_;  // [num_blocks, block_size]: what each published block holds
};

}  // namespace moe
