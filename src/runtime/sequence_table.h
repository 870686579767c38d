// The sequences an executor holds, over one BlockAllocator: each one's block table, how many of
// its tokens the cache holds, and the prefix index. Both executors (the CPU reference and the
// CUDA engine) keep their sequences here; only where the keys and values live differs.
//
// Prefix reuse: a full block's keys and values depend only on the token ids up to its end, so
// every full block a sequence computes is published under the chain hash of those ids, and a new
// sequence whose tokens start the same way takes references to those blocks instead of
// computing them (reuse_prefix). Shared blocks are full and never written again.
//
// Not thread-safe: one thread opens, grows and closes sequences.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "runtime/block_allocator.h"

namespace moe {

struct Sequence {
  bool open = false;
  int64_t length = 0;           // tokens whose keys and values the cache holds
  std::vector<int32_t> blocks;  // allocator blocks, in token order: row p is in blocks[p / block_size]
  std::vector<int32_t> tokens;  // the ids of those `length` tokens
  int64_t published = 0;        // leading full blocks published for reuse
  uint64_t last_key = 0;        // the chain key of the last published block
  int64_t draws = 0;            // tokens sampled so far (for callers that count draws here)
};

class SequenceTable {
 public:
  // At most `max_sequences` open at once, each of at most `max_context` tokens. The allocator
  // must outlive the table. Ids are first_id, first_id + id_stride, ...: the tables of several
  // attention groups (data-parallel ranks) give out disjoint ids, and an id names its group.
  // Throws kInvalidArgument for non-positive limits.
  SequenceTable(BlockAllocator& blocks, int64_t max_sequences, int64_t max_context, bool prefix_reuse,
                int32_t first_id = 0, int32_t id_stride = 1);
  ~SequenceTable();  // gives every open sequence's blocks back
  SequenceTable(const SequenceTable&) = delete;
  SequenceTable& operator=(const SequenceTable&) = delete;

  int64_t block_size() const { return blocks_.block_size(); }
  int64_t max_sequences() const { return max_sequences_; }
  int64_t max_context() const { return max_context_; }
  bool prefix_reuse() const { return prefix_reuse_; }
  int64_t open_count() const { return open_; }
  const BlockAllocator& allocator() const { return blocks_; }

  // A new empty sequence (the lowest free id); throws kInvalidArgument when max_sequences are open.
  int32_t open();
  // Gives the sequence's block references back; published blocks stay findable until reused.
  void close(int32_t seq);
  // The open sequence `seq`; throws kInvalidArgument for an id that is not open.
  const Sequence& at(int32_t seq) const;

  // Gives the empty sequence `seq` the published blocks that hold `tokens`' leading full blocks,
  // as shared references, and returns the tokens it now holds: a multiple of the block size and
  // never all of `tokens` (the last token is left to compute: the next token is drawn from its
  // logits, and the block it lands in must be the sequence's own to write). 0 with prefix reuse off.
  int64_t reuse_prefix(int32_t seq, std::span<const int32_t> tokens);

  // New blocks `seq` needs to hold `more` tokens past its length.
  int64_t blocks_needed(int32_t seq, int64_t more) const;
  // Checks that `more` tokens fit the sequence's context, the blocks they need are free and that
  // none of them lands in a shared block (kInvalidArgument otherwise), then takes those blocks.
  void reserve(int32_t seq, int64_t more);
  // Records that the cache now holds `ids` after the sequence's tokens (their blocks reserved):
  // the length grows and the newly full blocks are published.
  void append(int32_t seq, std::span<const int32_t> ids);
  // Counts one sampled token of the sequence.
  void count_draw(int32_t seq) { at_mutable(seq).draws += 1; }

  // The cache row of the sequence's token at `position`: block * block_size + position % block_size.
  int64_t slot(int32_t seq, int64_t position) const;

 private:
  Sequence& at_mutable(int32_t seq);
  // The index of id `seq` in seqs_, -1 for an id this table never gives out.
  int64_t index_of(int32_t seq) const;

  BlockAllocator& blocks_;
  int64_t max_sequences_, max_context_;
  bool prefix_reuse_;
  int64_t open_ = 0;
  int32_t first_id_ = 0, id_stride_ = 1;
  std::vector<Sequence> seqs_;
};

}  // namespace moe
