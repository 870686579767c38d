#include "runtime/block_allocator.h"

#include <algorithm>

#include "moe/errors.h"

namespace moe {

BlockAllocator::BlockAllocator(int64_t num_blocks, int64_t block_size)
    : num_blocks_(num_blocks), block_size_(block_size) {
  MOE_CHECK(num_blocks > 0, kInvalidArgument, "KV block count must be positive, got {}", num_blocks);
  MOE_CHECK(block_size > 0, kInvalidArgument, "KV block size must be positive, got {}", block_size);
  MOE_CHECK(num_blocks <= INT32_MAX, kInvalidArgument, "too many KV blocks: {}", num_blocks);
  const auto n = static_cast<size_t>(num_blocks);
  refs_.assign(n, 0);
  free_pos_.resize(n);
  for (int32_t b = 0; b < static_cast<int32_t>(num_blocks); ++b)
    free_pos_[static_cast<size_t>(b)] = free_.insert(free_.end(), b);
  hash_of_.assign(n, 0);
  published_.assign(n, false);
}

void BlockAllocator::check_block(int32_t block) const {
  MOE_CHECK(block >= 0 && block < num_blocks_, kInternal, "KV block {} is outside the pool of {}",
            block, num_blocks_);
}

int32_t BlockAllocator::allocate() {
  if (free_.empty()) return -1;
  const int32_t b = free_.front();
  free_.pop_front();
  unpublish(b);  // its contents are about to be overwritten
  refs_[static_cast<size_t>(b)] = 1;
  return b;
}

void BlockAllocator::retain(int32_t block) {
  check_block(block);
  int32_t& r = refs_[static_cast<size_t>(block)];
  if (r == 0) free_.erase(free_pos_[static_cast<size_t>(block)]);
  ++r;
}

void BlockAllocator::release(int32_t block) {
  check_block(block);
  int32_t& r = refs_[static_cast<size_t>(block)];
  MOE_CHECK(r > 0, kInternal, "KV block {} released more often than it was taken", block);
  if (--r == 0) free_pos_[static_cast<size_t>(block)] = free_.insert(free_.end(), block);
}

int32_t BlockAllocator::ref_count(int32_t block) const {
  check_block(block);
  return refs_[static_cast<size_t>(block)];
}

uint64_t BlockAllocator::chain_hash(uint64_t parent, std::span<const int32_t> tokens) {
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

void BlockAllocator::publish(int32_t block, uint64_t hash, std::span<const int32_t> tokens) {
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

int32_t BlockAllocator::acquire_cached(uint64_t hash, std::span<const int32_t> tokens) {
  auto it = index_.find(hash);
  if (it == index_.end() || static_cast<int64_t>(tokens.size()) != block_size_) return -1;
  const int32_t b = it->second;
  if (!std::equal(tokens.begin(), tokens.end(), block_tokens_.begin() + b * block_size_)) return -1;
  retain(b);
  return b;
}

void BlockAllocator::unpublish(int32_t block) {
  if (!published_[static_cast<size_t>(block)]) return;
  index_.erase(hash_of_[static_cast<size_t>(block)]);
  published_[static_cast<size_t>(block)] = false;
}

}  // namespace moe
