#include "runtime/sequence_table.h"

#include <algorithm>

#include "moe/errors.h"

namespace moe {

SequenceTable::SequenceTable(BlockAllocator& blocks, int64_t max_sequences, int64_t max_context, bool prefix_reuse,
                             int32_t first_id, int32_t id_stride)
    : blocks_(blocks),
      max_sequences_(max_sequences),
      max_context_(max_context),
      prefix_reuse_(prefix_reuse),
      first_id_(first_id),
      id_stride_(id_stride) {
  MOE_CHECK(first_id >= 0 && id_stride >= 1, kInvalidArgument, "sequence ids from {} in steps of {}", first_id,
            id_stride);
  MOE_CHECK(max_sequences >= 1, kInvalidArgument, "at least one sequence must fit, got {}", max_sequences);
  MOE_CHECK(max_context >= 1, kInvalidArgument, "the context must hold at least one token, got {}", max_context);
}

SequenceTable::~SequenceTable() {
  for (Sequence& s : seqs_)
    for (int32_t b : s.blocks) blocks_.release(b);
}

int32_t SequenceTable::open() {
  MOE_CHECK(open_ < max_sequences_, kInvalidArgument, "{} sequences are open: at most {} fit", open_,
            max_sequences_);
  auto it = std::find_if(seqs_.begin(), seqs_.end(), [](const Sequence& s) { return !s.open; });
  if (it == seqs_.end()) it = seqs_.insert(seqs_.end(), Sequence{});
  *it = Sequence{};
  it->open = true;
  ++open_;
  return first_id_ + static_cast<int32_t>(it - seqs_.begin()) * id_stride_;
}

int64_t SequenceTable::index_of(int32_t seq) const {
  if (seq < first_id_ || (seq - first_id_) % id_stride_ != 0) return -1;
  return (seq - first_id_) / id_stride_;
}

void SequenceTable::close(int32_t seq) {
  Sequence& s = at_mutable(seq);
  for (int32_t b : s.blocks) blocks_.release(b);
  s = Sequence{};
  --open_;
}

const Sequence& SequenceTable::at(int32_t seq) const {
  const int64_t i = index_of(seq);
  MOE_CHECK(i >= 0 && static_cast<size_t>(i) < seqs_.size() && seqs_[static_cast<size_t>(i)].open,
            kInvalidArgument, "sequence {} is not open", seq);
  return seqs_[static_cast<size_t>(i)];
}

Sequence& SequenceTable::at_mutable(int32_t seq) { return const_cast<Sequence&>(at(seq)); }

int64_t SequenceTable::reuse_prefix(int32_t seq, std::span<const int32_t> tokens) {
  Sequence& s = at_mutable(seq);
  MOE_CHECK(s.length == 0, kInvalidArgument, "prefix reuse needs an empty sequence; sequence {} holds {} tokens",
            seq, s.length);
  if (!prefix_reuse_ || tokens.empty()) return 0;
  const int64_t bs = block_size();
  const int64_t reusable = std::min<int64_t>((static_cast<int64_t>(tokens.size()) - 1) / bs, max_context_ / bs);
  for (int64_t i = 0; i < reusable; ++i) {
    const auto block = tokens.subspan(static_cast<size_t>(i * bs), static_cast<size_t>(bs));
    const uint64_t key = BlockAllocator::chain_hash(s.last_key, block);
    const int32_t b = blocks_.acquire_cached(key, block);
    if (b < 0) break;
    s.blocks.push_back(b);
    s.last_key = key;
    ++s.published;
  }
  s.length = s.published * bs;
  s.tokens.assign(tokens.begin(), tokens.begin() + s.length);
  return s.length;
}

int64_t SequenceTable::blocks_needed(int32_t seq, int64_t more) const {
  const Sequence& s = at(seq);
  const int64_t want = (s.length + more + block_size() - 1) / block_size();
  return std::max<int64_t>(0, want - static_cast<int64_t>(s.blocks.size()));
}

void SequenceTable::reserve(int32_t seq, int64_t more) {
  Sequence& s = at_mutable(seq);
  MOE_CHECK(more >= 0, kInvalidArgument, "cannot reserve {} tokens", more);
  MOE_CHECK(s.length + more <= max_context_, kInvalidArgument,
            "context full: {} cached + {} new tokens exceed the context of {}", s.length, more, max_context_);
  const int64_t need = blocks_needed(seq, more);
  MOE_CHECK(need <= blocks_.free_blocks(), kInvalidArgument, "KV cache full: {} more blocks needed, {} free", need,
            blocks_.free_blocks());
  // Rows already in the table's blocks must not land in one another sequence shares.
  const int64_t bs = block_size();
  for (int64_t b = s.length / bs; b < static_cast<int64_t>(s.blocks.size()) && b * bs < s.length + more; ++b)
    MOE_CHECK(blocks_.ref_count(s.blocks[static_cast<size_t>(b)]) == 1, kInvalidArgument,
              "KV block {} is shared with another sequence and cannot be written", s.blocks[static_cast<size_t>(b)]);
  for (int64_t n = need; n > 0; --n) {
    const int32_t b = blocks_.allocate();
    MOE_CHECK(b >= 0, kInternal, "KV block allocation failed after the free count was checked");
    s.blocks.push_back(b);
  }
}

void SequenceTable::append(int32_t seq, std::span<const int32_t> ids) {
  Sequence& s = at_mutable(seq);
  const int64_t n = static_cast<int64_t>(ids.size());
  MOE_CHECK(s.length + n <= static_cast<int64_t>(s.blocks.size()) * block_size(), kInternal,
            "sequence {}: {} tokens appended past its {} reserved rows", seq, s.length + n,
            static_cast<int64_t>(s.blocks.size()) * block_size());
  s.tokens.insert(s.tokens.end(), ids.begin(), ids.end());
  s.length += n;
  if (!prefix_reuse_) return;
  const int64_t bs = block_size();
  for (; s.published < s.length / bs; ++s.published) {
    const auto block = std::span<const int32_t>(s.tokens).subspan(static_cast<size_t>(s.published * bs),
                                                                  static_cast<size_t>(bs));
    s.last_key = BlockAllocator::chain_hash(s.last_key, block);
    blocks_.publish(s.blocks[static_cast<size_t>(s.published)], s.last_key, block);
  }
}

int64_t SequenceTable::slot(int32_t seq, int64_t position) const {
  const Sequence& s = at(seq);
  const int64_t bs = block_size();
  return static_cast<int64_t>(s.blocks[static_cast<size_t>(position / bs)]) * bs + position % bs;
}

}  // namespace moe
