// The paged KV cache: the block allocator with reference counts and prefix index, the paged
// attention kernel, and a model running over scattered blocks.
#include <gtest/gtest.h>

#include <random>

#include "backend/cpu/kernels.h"
#include "model/model.h"
#include "runtime/kv_cache.h"
#include "test_util.h"

namespace moe {
namespace {

using test::expect_error;

TEST(KvBlockPool, AllocatesUntilEmptyAndCountsReferences) {
  KvBlockPool pool(2, 3, 4, 8, 8);
  EXPECT_EQ(pool.free_blocks(), 3);
  int32_t a = pool.allocate(), b = pool.allocate(), c = pool.allocate();
  EXPECT_NE(a, b);
  EXPECT_NE(b, c);
  EXPECT_NE(a, c);
  EXPECT_EQ(pool.allocate(), -1);  // exhausted: a result, not an error
  EXPECT_EQ(pool.used_blocks(), 3);
  pool.retain(b);
  EXPECT_EQ(pool.ref_count(b), 2);
  pool.release(b);
  EXPECT_EQ(pool.used_blocks(), 3);  // still referenced once
  pool.release(b);
  EXPECT_EQ(pool.ref_count(b), 0);
  EXPECT_EQ(pool.used_blocks(), 2);
  EXPECT_EQ(pool.allocate(), b);  // the only free block
  EXPECT_EQ(expect_error([&] { pool.release(7); }).kind(), ErrorKind::kInternal);
  pool.release(a);
  EXPECT_EQ(expect_error([&] { pool.release(a); }).kind(), ErrorKind::kInternal);
}

TEST(KvBlockPool, BlocksDoNotOverlap) {
  KvBlockPool pool(2, 4, 3, 5, 2);
  EXPECT_EQ(pool.block_bytes(), static_cast<size_t>(2 * 3 * (5 + 2) * 4));
  EXPECT_EQ(pool.bytes(), 4 * pool.block_bytes());
  for (int32_t b = 0; b < 4; ++b)
    for (int64_t l = 0; l < 2; ++l) {
      for (int64_t i = 0; i < 3 * 5; ++i) pool.k(l, b)[i] = static_cast<float>(100 * b + 10 * l);
      for (int64_t i = 0; i < 3 * 2; ++i) pool.v(l, b)[i] = static_cast<float>(-100 * b - 10 * l);
    }
  for (int32_t b = 0; b < 4; ++b)
    for (int64_t l = 0; l < 2; ++l) {
      for (int64_t i = 0; i < 3 * 5; ++i) ASSERT_EQ(pool.k(l, b)[i], 100 * b + 10 * l);
      for (int64_t i = 0; i < 3 * 2; ++i) ASSERT_EQ(pool.v(l, b)[i], -100 * b - 10 * l);
    }
}

TEST(KvBlockPool, BadSizesAreOneLineErrors) {
  auto e = expect_error([] { KvBlockPool(2, 0, 16, 8, 8); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(e.message().find("block count"), std::string::npos);
  e = expect_error([] { KvBlockPool(2, 4, 0, 8, 8); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(e.message().find("block size"), std::string::npos);
  EXPECT_EQ(expect_error([] { KvCache(2, 0, 8, 8); }).kind(), ErrorKind::kInvalidArgument);
}

TEST(KvBlockPool, ChainHashDependsOnEveryTokenAndTheParent) {
  std::vector<int32_t> t{1, 2, 3, 4}, swapped{2, 1, 3, 4};
  const uint64_t h = KvBlockPool::chain_hash(0, t);
  EXPECT_EQ(h, KvBlockPool::chain_hash(0, t));
  EXPECT_NE(h, KvBlockPool::chain_hash(0, swapped));
  EXPECT_NE(h, KvBlockPool::chain_hash(h, t));
  EXPECT_NE(KvBlockPool::chain_hash(1, t), KvBlockPool::chain_hash(2, t));
}

TEST(KvBlockPool, PublishedBlocksAreSharedUntilReallocated) {
  KvBlockPool pool(1, 2, 2, 4, 4);
  std::vector<int32_t> tokens{7, 8}, other{7, 9};
  const uint64_t key = KvBlockPool::chain_hash(0, tokens);
  EXPECT_EQ(pool.acquire_cached(key, tokens), -1);  // nothing published yet
  int32_t a = pool.allocate();
  pool.publish(a, key, tokens);
  EXPECT_EQ(pool.cached_blocks(), 1);
  EXPECT_EQ(pool.acquire_cached(key, tokens), a);
  EXPECT_EQ(pool.ref_count(a), 2);
  // The same key with other tokens (a collision) is a miss, never somebody else's keys.
  EXPECT_EQ(pool.acquire_cached(key, other), -1);
  pool.release(a);
  pool.release(a);
  EXPECT_EQ(pool.used_blocks(), 0);
  // Free but still findable: taking it again takes it off the free list.
  EXPECT_EQ(pool.acquire_cached(key, tokens), a);
  EXPECT_EQ(pool.used_blocks(), 1);
  EXPECT_EQ(pool.free_blocks(), 1);
  pool.release(a);
  // Allocation reuses the least recently freed block first: the other one, then a, whose
  // prefix entry goes with its old contents.
  int32_t b = pool.allocate();
  EXPECT_NE(b, a);
  EXPECT_EQ(pool.acquire_cached(key, tokens), a);
  pool.release(a);
  EXPECT_EQ(pool.allocate(), a);
  EXPECT_EQ(pool.cached_blocks(), 0);
  EXPECT_EQ(pool.acquire_cached(key, tokens), -1);
  // Only full blocks can be published.
  std::vector<int32_t> one{7};
  EXPECT_EQ(expect_error([&] { pool.publish(b, key, one); }).kind(), ErrorKind::kInternal);
}

TEST(KvCache, PagedViewGivesItsBlocksBackWhenItDies) {
  KvBlockPool pool(1, 4, 2, 3, 3);
  {
    KvCache cache(pool);
    EXPECT_EQ(cache.capacity(), 0);
    cache.append_block(pool.allocate());
    cache.append_block(pool.allocate());
    EXPECT_EQ(cache.capacity(), 4);
    EXPECT_EQ(cache.bytes(), 2 * pool.block_bytes());
    // Row 3 is the second row of the second block.
    EXPECT_EQ(cache.k_row(0, 3), pool.k(0, cache.blocks()[1]) + 3);
    KvCache moved = std::move(cache);
    EXPECT_EQ(moved.capacity(), 4);
    EXPECT_EQ(pool.used_blocks(), 2);
  }
  EXPECT_EQ(pool.used_blocks(), 0);
  KvCache standalone(2, 10, 3, 1);
  EXPECT_EQ(standalone.capacity(), 10);
  EXPECT_EQ(standalone.bytes(), static_cast<size_t>(2 * 10 * 4 * 4));
}

// The paged kernel reads the same rows through a block table and gives the contiguous result
// bit for bit.
TEST(Kernels, PagedAttentionEqualsContiguous) {
  std::mt19937 rng(3);
  std::normal_distribution<float> d(0.0f, 1.0f);
  ThreadPool pool(2);
  const int64_t tokens = 3, ctx = 11, qh = 4, kvh = 2, hd = 8, vd = 6, bs = 4;
  const int64_t kw = kvh * hd, vw = kvh * vd, nblocks = (ctx + bs - 1) / bs;
  std::vector<float> q(static_cast<size_t>(tokens * qh * hd)), k(static_cast<size_t>(ctx * kw)),
      v(static_cast<size_t>(ctx * vw));
  for (auto* x : {&q, &k, &v})
    for (float& f : *x) f = d(rng);
  // Scatter the rows into blocks held in reverse order, with poison in the unused rows.
  std::vector<float> kstore(static_cast<size_t>(nblocks * bs * kw), NAN),
      vstore(static_cast<size_t>(nblocks * bs * vw), NAN);
  std::vector<const float*> kb(static_cast<size_t>(nblocks)), vb(static_cast<size_t>(nblocks));
  for (int64_t b = 0; b < nblocks; ++b) {
    const int64_t slot = nblocks - 1 - b;
    kb[static_cast<size_t>(b)] = kstore.data() + slot * bs * kw;
    vb[static_cast<size_t>(b)] = vstore.data() + slot * bs * vw;
  }
  for (int64_t j = 0; j < ctx; ++j) {
    std::copy_n(k.data() + j * kw, kw, const_cast<float*>(kb[static_cast<size_t>(j / bs)]) + (j % bs) * kw);
    std::copy_n(v.data() + j * vw, vw, const_cast<float*>(vb[static_cast<size_t>(j / bs)]) + (j % bs) * vw);
  }
  std::vector<float> want(static_cast<size_t>(tokens * qh * vd)), got(want.size(), NAN);
  const float scale = 0.3f;
  cpu::attention(pool, q.data(), k.data(), v.data(), want.data(), tokens, ctx, qh, kvh, hd, vd, kw, vw, scale);
  cpu::paged_attention(pool, q.data(), kb.data(), vb.data(), bs, got.data(), tokens, ctx, qh, kvh, hd,
                       vd, kw, vw, scale);
  for (size_t i = 0; i < want.size(); ++i) ASSERT_EQ(want[i], got[i]) << i;
}

// A model over a paged cache whose blocks lie scattered in a shared pool computes exactly what
// it computes over a standalone cache, for grouped-query and latent attention alike.
class PagedModel : public ::testing::TestWithParam<std::string> {};

TEST_P(PagedModel, ScatteredBlocksGiveTheLogitsOfAContiguousCache) {
  auto model = Model::load(std::string(MOE_SOURCE_DIR) + "/tests/fixtures/" + GetParam());
  const ModelConfig& c = model->config();
  KvBlockPool pool(c.num_layers, 8, 3, c.kv_key_width(), c.kv_value_width());
  std::vector<int32_t> held;
  for (int i = 0; i < 8; ++i) held.push_back(pool.allocate());
  KvCache paged(pool);
  for (int i : {6, 1, 4, 0}) paged.append_block(held[static_cast<size_t>(i)]);  // 12 rows, out of order
  for (int i : {2, 3, 5, 7}) pool.release(held[static_cast<size_t>(i)]);
  KvCache plain = model->new_cache(12);
  std::vector<int32_t> prompt{5, 9, 1, 7, 3}, more{2, 8, 8, 4};
  for (auto* ids : {&prompt, &more}) {
    Tensor a = model->forward(*ids, plain, true), b = model->forward(*ids, paged, true);
    ASSERT_EQ(a.shape(), b.shape());
    for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(a.data<float>()[i], b.data<float>()[i]) << i;
  }
  std::vector<int32_t> one{11};
  Tensor a = model->forward(one, plain), b = model->forward(one, paged);
  for (int64_t i = 0; i < a.numel(); ++i) ASSERT_EQ(a.data<float>()[i], b.data<float>()[i]) << i;
  // Past the blocks held: the same "context full" error as a standalone cache.
  std::vector<int32_t> four{1, 2, 3, 4};
  auto e = expect_error([&] { model->forward(four, paged); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(e.message().find("context full"), std::string::npos);
}

TEST_P(PagedModel, ASharedBlockIsNeverWritten) {
  auto model = Model::load(std::string(MOE_SOURCE_DIR) + "/tests/fixtures/" + GetParam());
  const ModelConfig& c = model->config();
  KvBlockPool pool(c.num_layers, 2, 4, c.kv_key_width(), c.kv_value_width());
  KvCache a(pool), b(pool);
  const int32_t shared = pool.allocate();
  a.append_block(shared);
  pool.retain(shared);
  b.append_block(shared);
  std::vector<int32_t> ids{1, 2};
  auto e = expect_error([&] { model->forward(ids, b); });
  EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
  EXPECT_NE(e.message().find("shared"), std::string::npos);
  EXPECT_EQ(b.length(), 0);
  a.release();
  model->forward(ids, b);  // its own block now
  EXPECT_EQ(b.length(), 2);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, PagedModel,
                         ::testing::Values("qwen3_moe_f32", "deepseek_v2_f32", "mixtral_f32"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace moe
