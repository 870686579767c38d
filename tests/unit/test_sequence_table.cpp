// The sequence table both executors keep: limits on open sequences, block reservation and its
// refusals, publishing full blocks as tokens are appended, and prefix reuse by chain hash.
#include <gtest/gtest.h>

#include <functional>
#include <numeric>

#include "moe/errors.h"
#include "runtime/sequence_table.h"
#include "test_util.h"

namespace moe {
namespace {

using test::expect_error;

std::vector<int32_t> iota_tokens(int n, int32_t first = 100) {
  std::vector<int32_t> t(static_cast<size_t>(n));
  std::iota(t.begin(), t.end(), first);
  return t;
}

// A new sequence whose cache holds `tokens`.
int32_t filled(SequenceTable& t, const std::vector<int32_t>& tokens) {
  const int32_t s = t.open();
  t.reserve(s, static_cast<int64_t>(tokens.size()));
  t.append(s, tokens);
  return s;
}

void expect_refusal(const std::function<void()>& f, const std::string& words) {
  auto e = expect_error(f);
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(e.message().find(words), std::string::npos) << e.message();
}

TEST(SequenceTable, OpensUpToTheLimitAndReusesClosedIds) {
  BlockAllocator blocks(8, 4);
  SequenceTable t(blocks, 2, 32, true);
  const int32_t a = t.open(), b = t.open();
  EXPECT_NE(a, b);
  EXPECT_EQ(t.open_count(), 2);
  expect_refusal([&] { t.open(); }, "2 sequences are open");
  t.close(a);
  EXPECT_EQ(t.open(), a);  // the lowest free id
  expect_refusal([&] { t.at(7); }, "sequence 7 is not open");
  expect_refusal([&] { t.close(-1); }, "sequence -1 is not open");
  expect_refusal([&] { SequenceTable(blocks, 0, 32, true); }, "at least one sequence");
}

// The tables of data-parallel groups give out disjoint ids (first_id + i * stride), refuse the
// others' ids, and name the id they were given in every refusal.
TEST(SequenceTable, GroupTablesGiveOutDisjointIds) {
  BlockAllocator blocks0(8, 4), blocks1(8, 4);
  SequenceTable t0(blocks0, 3, 32, true, 0, 2), t1(blocks1, 3, 32, true, 1, 2);
  EXPECT_EQ(t0.open(), 0);
  EXPECT_EQ(t0.open(), 2);
  EXPECT_EQ(t1.open(), 1);
  EXPECT_EQ(t1.open(), 3);
  expect_refusal([&] { t0.at(1); }, "sequence 1 is not open");
  expect_refusal([&] { t1.at(2); }, "sequence 2 is not open");
  expect_refusal([&] { t1.at(5); }, "sequence 5 is not open");
  t1.reserve(3, 5);
  EXPECT_EQ(blocks1.free_blocks(), 6);
  EXPECT_EQ(blocks0.free_blocks(), 8);
  const Error e = expect_error([&] { t1.append(3, iota_tokens(9)); });  // 2 blocks of 4 rows
  EXPECT_EQ(e.kind(), ErrorKind::kInternal);
  EXPECT_NE(e.message().find("sequence 3: 9 tokens appended past its 8 reserved rows"), std::string::npos)
      << e.message();
  t0.close(0);
  EXPECT_EQ(t0.open(), 0);
  expect_refusal([&] { SequenceTable(blocks0, 1, 32, true, 0, 0); }, "in steps of 0");
}

TEST(SequenceTable, ReservesOnlyTheBlocksNewRowsNeed) {
  BlockAllocator blocks(8, 4);
  SequenceTable t(blocks, 2, 32, false);
  const int32_t s = t.open();
  EXPECT_EQ(t.blocks_needed(s, 5), 2);
  t.reserve(s, 5);
  EXPECT_EQ(blocks.free_blocks(), 6);
  const auto first = iota_tokens(5);
  t.append(s, first);
  EXPECT_EQ(t.at(s).length, 5);
  EXPECT_EQ(t.blocks_needed(s, 3), 0);  // rows 5..7 fit the second block
  EXPECT_EQ(t.blocks_needed(s, 4), 1);
  // Row 6 lives in the second block at offset 2.
  EXPECT_EQ(t.slot(s, 6), static_cast<int64_t>(t.at(s).blocks[1]) * 4 + 2);
  expect_refusal([&] { t.reserve(s, 28); }, "exceed the context of 32");
  const int32_t other = t.open();
  t.reserve(other, 4);
  expect_refusal([&] { t.reserve(s, 27); }, "KV cache full: 6 more blocks needed, 5 free");
  EXPECT_EQ(t.at(s).blocks.size(), 2u);  // a refused reservation takes nothing
  t.close(other);
  t.close(s);
  EXPECT_EQ(blocks.free_blocks(), 8);
  EXPECT_EQ(t.open_count(), 0);
}

TEST(SequenceTable, AppendPastTheReservedRowsIsAnInternalError) {
  BlockAllocator blocks(4, 4);
  SequenceTable t(blocks, 1, 16, false);
  const int32_t s = t.open();
  t.reserve(s, 2);
  auto e = expect_error([&] { t.append(s, iota_tokens(5)); });
  EXPECT_EQ(e.kind(), ErrorKind::kInternal);
}

TEST(SequenceTable, FullBlocksAreSharedByTheirPrefix) {
  BlockAllocator blocks(16, 4);
  SequenceTable t(blocks, 3, 64, true);
  const auto prompt = iota_tokens(10);
  const int32_t a = filled(t, prompt);
  EXPECT_EQ(t.at(a).published, 2);  // two full blocks of four; the third holds two rows
  EXPECT_EQ(blocks.cached_blocks(), 2);

  // The same ten tokens: the two full blocks are found, the last token is left to compute.
  const int32_t b = t.open();
  EXPECT_EQ(t.reuse_prefix(b, prompt), 8);
  EXPECT_EQ(t.at(b).blocks[0], t.at(a).blocks[0]);
  EXPECT_EQ(t.at(b).blocks[1], t.at(a).blocks[1]);
  EXPECT_EQ(blocks.ref_count(t.at(a).blocks[0]), 2);
  expect_refusal([&] { t.reuse_prefix(b, prompt); }, "needs an empty sequence");

  // Exactly eight tokens: only the first block, since the last token must be computed.
  const int32_t c = t.open();
  EXPECT_EQ(t.reuse_prefix(c, std::vector<int32_t>(prompt.begin(), prompt.begin() + 8)), 4);
  t.close(c);

  // A prefix that differs in its first block shares nothing.
  auto other = prompt;
  other[1] += 1;
  const int32_t d = t.open();
  EXPECT_EQ(t.reuse_prefix(d, other), 0);
  t.close(d);

  // A sequence holding only shared blocks must not write into them: its next rows take a block
  // of its own.
  EXPECT_EQ(t.blocks_needed(b, 2), 1);
  t.reserve(b, 2);
  EXPECT_NE(t.at(b).blocks[2], t.at(a).blocks[2]);

  // Closed sequences leave their published blocks findable until the allocator hands them out.
  t.close(a);
  t.close(b);
  EXPECT_EQ(blocks.free_blocks(), 16);
  const int32_t e = t.open();
  EXPECT_EQ(t.reuse_prefix(e, prompt), 8);
}

TEST(SequenceTable, WithoutPrefixReuseNothingIsPublishedOrFound) {
  BlockAllocator blocks(8, 4);
  SequenceTable t(blocks, 2, 32, false);
  const auto prompt = iota_tokens(9);
  filled(t, prompt);
  EXPECT_EQ(blocks.cached_blocks(), 0);
  const int32_t b = t.open();
  EXPECT_EQ(t.reuse_prefix(b, prompt), 0);
}

}  // namespace
}  // namespace moe
