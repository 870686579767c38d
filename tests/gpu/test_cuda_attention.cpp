// Paged attention on the GPU against moe::cpu::attention, run per sequence on contiguous f32
// copies of the same bf16 values. Every case runs both kernels (the row kernel with its context
// splits, and the tiled tensor-core kernel where the head dim has one) and the automatic choice.
// Block tables are shuffled; cache rows that no sequence may read (past a context, unused blocks,
// table entries past a sequence's last block) hold NaN, and the output is poisoned with NaN, so a
// stray read or a missed write shows up as a non-finite result.
//
// Bound: max |gpu - cpu| / max |cpu| <= 2^-7 per case. The output is rounded to bf16 (2^-9
// relative of each value); the tiled kernel also rounds the softmax weights to bf16 before P V
// (2^-9 relative per weight, averaging out over keys); f32 summation order differs. Two 2^-8
// leaves margin over those and is far below what a wrong key, head or mask produces (order 1).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cuda/attention_launch.h"
#include "gpu_test_util.h"

namespace moe {
namespace {

using cuda::kernels::AttentionPath;
using cuda::kernels::PagedAttentionParams;
using gputest::DeviceBuffer;

constexpr double kBound = 1.0 / 128;  // 2^-7, see the file comment

struct Shape {
  int q_heads, kv_heads, head_dim, block_size;
};

// One batch: rows per sequence and context lengths; the cache holds `cache_lens` positions per
// sequence (>= ctx, for the replay test) in shuffled blocks.
struct Batch {
  std::vector<int> rows, ctx;
};

class PagedCase {
 public:
  PagedCase(const Shape& sh, const Batch& b, int max_context, uint32_t seed)
      : sh_(sh), rows_(b.rows), max_context_(max_context), rng_(seed) {
    const int seqs = static_cast<int>(rows_.size());
    const int bs = sh.block_size;
    max_blocks_ = (max_context + bs - 1) / bs + 1;  // one spare entry, pointed at a NaN block
    int used = 0;
    for (int s = 0; s < seqs; ++s) used += (max_context + bs - 1) / bs;
    num_blocks_ = used + 3;  // a few blocks nobody owns, NaN-filled
    const size_t row_elems = static_cast<size_t>(sh.kv_heads) * sh.head_dim;
    const size_t pool_elems = static_cast<size_t>(num_blocks_) * bs * row_elems;
    // Every pool row starts as NaN; positions < max_context of each sequence get values.
    k_.assign(pool_elems, NAN);
    v_.assign(pool_elems, NAN);
    std::vector<int> perm(static_cast<size_t>(num_blocks_));
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng_);
    const int nan_block = perm.back();
    tables_.assign(static_cast<size_t>(seqs) * max_blocks_, nan_block);
    int next = 0;
    for (int s = 0; s < seqs; ++s)
      for (int i = 0; i < (max_context + bs - 1) / bs; ++i) tables_[s * max_blocks_ + i] = perm[next++];
    // Values per sequence position, kept contiguous for the reference.
    seq_k_.resize(seqs);
    seq_v_.resize(seqs);
    for (int s = 0; s < seqs; ++s) {
      seq_k_[s] = gputest::random_bf16_exact(static_cast<size_t>(max_context) * row_elems, rng_, 1.0f);
      seq_v_[s] = gputest::random_bf16_exact(static_cast<size_t>(max_context) * row_elems, rng_, 1.0f);
    }
    starts_.assign(1, 0);
    for (int r : rows_) starts_.push_back(starts_.back() + r);
    tokens_ = starts_.back();
    q_ = gputest::random_bf16_exact(static_cast<size_t>(tokens_) * sh.q_heads * sh.head_dim, rng_, 1.0f);
    set_context(b.ctx);
  }

  // Cache contents for these context lengths: positions >= ctx of each sequence go back to NaN,
  // as rows not yet written by the engine may hold anything.
  void set_context(const std::vector<int>& ctx) {
    ctx_ = ctx;
    const int bs = sh_.block_size;
    const size_t row_elems = static_cast<size_t>(sh_.kv_heads) * sh_.head_dim;
    for (size_t s = 0; s < rows_.size(); ++s) {
      for (int pos = 0; pos < max_context_; ++pos) {
        const size_t dst = (static_cast<size_t>(tables_[s * max_blocks_ + pos / bs]) * bs + pos % bs) * row_elems;
        for (size_t e = 0; e < row_elems; ++e) {
          k_[dst + e] = pos < ctx[s] ? seq_k_[s][pos * row_elems + e] : NAN;
          v_[dst + e] = pos < ctx[s] ? seq_v_[s][pos * row_elems + e] : NAN;
        }
      }
    }
  }

  std::vector<float> reference() const {
    ThreadPool pool(2);
    const int D = sh_.head_dim;
    std::vector<float> out(static_cast<size_t>(tokens_) * sh_.q_heads * D);
    for (size_t s = 0; s < rows_.size(); ++s) {
      if (rows_[s] == 0) continue;
      const size_t q_off = static_cast<size_t>(starts_[s]) * sh_.q_heads * D;
      cpu::attention(pool, q_.data() + q_off, seq_k_[s].data(), seq_v_[s].data(), out.data() + q_off,
                     rows_[s], ctx_[s], sh_.q_heads, sh_.kv_heads, D, D,
                     static_cast<int64_t>(sh_.kv_heads) * D, static_cast<int64_t>(sh_.kv_heads) * D,
                     1.0f / std::sqrt(static_cast<float>(D)));
    }
    return out;
  }

  // Uploads everything, runs paged_attention with poisoned output, returns the output as f32.
  std::vector<float> run(AttentionPath path) {
    prepare(path);
    return launch();
  }

  void prepare(AttentionPath path) {
    dk_ = std::make_unique<DeviceBuffer<uint16_t>>(gputest::to_bf16(k_));
    dv_ = std::make_unique<DeviceBuffer<uint16_t>>(gputest::to_bf16(v_));
    dq_ = std::make_unique<DeviceBuffer<uint16_t>>(gputest::to_bf16(q_));
    dtables_ = std::make_unique<DeviceBuffer<int32_t>>(tables_);
    dstarts_ = std::make_unique<DeviceBuffer<int32_t>>(starts_);
    dctx_ = std::make_unique<DeviceBuffer<int32_t>>(ctx_);
    dout_ = std::make_unique<DeviceBuffer<uint16_t>>(static_cast<size_t>(tokens_) * sh_.q_heads * sh_.head_dim);
    const size_t ws = cuda::kernels::paged_attention_workspace_bytes(tokens_, sh_.q_heads, sh_.head_dim,
                                                                     max_context_);
    dws_ = std::make_unique<DeviceBuffer<uint8_t>>(ws);
    dws_->poison();
    p_ = PagedAttentionParams{};
    p_.q = dq_->get();
    p_.k_cache = dk_->get();
    p_.v_cache = dv_->get();
    p_.block_tables = dtables_->get();
    p_.seq_starts = dstarts_->get();
    p_.context_lens = dctx_->get();
    p_.num_seqs = static_cast<int>(rows_.size());
    p_.tokens = tokens_;
    p_.q_heads = sh_.q_heads;
    p_.kv_heads = sh_.kv_heads;
    p_.head_dim = sh_.head_dim;
    p_.block_size = sh_.block_size;
    p_.max_blocks_per_seq = max_blocks_;
    p_.max_context = max_context_;
    p_.scale = 1.0f / std::sqrt(static_cast<float>(sh_.head_dim));
    p_.out = dout_->get();
    p_.workspace = ws ? dws_->get() : nullptr;
    p_.path = path;
  }

  // Same host fields as the last prepare(); only the device lengths and cache contents change.
  void replay_with(const std::vector<int>& ctx) {
    set_context(ctx);
    dk_->upload(gputest::to_bf16(k_));
    dv_->upload(gputest::to_bf16(v_));
    dctx_->upload(ctx_);
  }

  std::vector<float> launch() {
    dout_->poison();
    EXPECT_EQ(cuda::kernels::paged_attention(p_, nullptr), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return gputest::from_bf16(dout_->download());
  }

  const PagedAttentionParams& params() const { return p_; }

 private:
  Shape sh_;
  std::vector<int> rows_, ctx_;
  int max_context_, max_blocks_ = 0, num_blocks_ = 0, tokens_ = 0;
  std::mt19937 rng_;
  std::vector<float> k_, v_, q_;
  std::vector<std::vector<float>> seq_k_, seq_v_;
  std::vector<int32_t> tables_, starts_;
  std::unique_ptr<DeviceBuffer<uint16_t>> dk_, dv_, dq_, dout_;
  std::unique_ptr<DeviceBuffer<int32_t>> dtables_, dstarts_, dctx_;
  std::unique_ptr<DeviceBuffer<uint8_t>> dws_;
  PagedAttentionParams p_;
};

int max_of(const std::vector<int>& v) { return *std::max_element(v.begin(), v.end()); }

// Runs every applicable path on one batch and checks each against the CPU.
void check_batch(const Shape& sh, const Batch& b, uint32_t seed) {
  PagedCase c(sh, b, max_of(b.ctx), seed);
  const std::vector<float> ref = c.reference();
  std::vector<AttentionPath> paths = {AttentionPath::kAuto, AttentionPath::kRow};
  if (cuda::kernels::paged_attention_has_tiled(sh.head_dim)) paths.push_back(AttentionPath::kTiled);
  for (AttentionPath path : paths) {
    const double err = gputest::max_rel_error(c.run(path), ref);
    EXPECT_LE(err, kBound) << "path " << static_cast<int>(path) << " q_heads " << sh.q_heads
                           << " kv_heads " << sh.kv_heads << " head_dim " << sh.head_dim
                           << " block " << sh.block_size;
  }
}

TEST(CudaAttention, DecodeBatchMixedLengths) {
  REQUIRE_GPU();
  const Batch b{{1, 1, 1, 1, 1, 1}, {1, 7, 16, 17, 300, 2100}};
  uint32_t seed = 1;
  for (int head_dim : {8, 32, 64, 128})
    for (int ratio : {1, 2, 8}) check_batch({8, 8 / ratio, head_dim, 16}, b, seed++);
}

TEST(CudaAttention, DecodeQwen3Shape) {
  REQUIRE_GPU();
  // qwen3-30b-a3b: 32 query heads on 4 kv heads of 128; batch 1 at 2048 uses many splits.
  check_batch({32, 4, 128, 16}, {{1}, {2048}}, 11);
  check_batch({32, 4, 128, 16}, {{1, 1, 1}, {2048, 33, 900}}, 12);
}

TEST(CudaAttention, PrefillFresh) {
  REQUIRE_GPU();
  uint32_t seed = 20;
  for (int head_dim : {8, 32, 64, 128})
    for (int ratio : {1, 2, 8}) check_batch({8, 8 / ratio, head_dim, 16}, {{150}, {150}}, seed++);
  check_batch({4, 2, 128, 16}, {{700}, {700}}, seed++);  // many tiles, a ragged last one
}

TEST(CudaAttention, PrefillContinuingPrefix) {
  REQUIRE_GPU();
  uint32_t seed = 40;
  for (int head_dim : {8, 32, 64, 128})
    for (int ratio : {1, 8}) check_batch({8, 8 / ratio, head_dim, 16}, {{77}, {300}}, seed++);
  check_batch({4, 1, 64, 16}, {{130, 64}, {1000, 64}}, seed++);
}

TEST(CudaAttention, MixedBatch) {
  REQUIRE_GPU();
  uint32_t seed = 60;
  const Batch b{{1, 50, 1, 130, 3, 64}, {40, 50, 1000, 300, 3, 200}};
  for (int head_dim : {8, 32, 64, 128})
    for (int ratio : {1, 2, 8}) check_batch({8, 8 / ratio, head_dim, 16}, b, seed++);
}

TEST(CudaAttention, BlockSizesAndOddHeadDims) {
  REQUIRE_GPU();
  uint32_t seed = 80;
  const Batch b{{1, 40, 1}, {333, 90, 1}};
  for (int bs : {8, 32, 64}) check_batch({8, 2, 64, bs}, b, seed++);
  for (int head_dim : {16, 24, 96, 200, 256}) check_batch({4, 2, head_dim, 16}, b, seed++);
  check_batch({12, 4, 64, 16}, b, seed++);  // groups of 3 heads
}

// The same launch (host fields fixed, as in a captured graph) with longer device context_lens.
TEST(CudaAttention, ReplayWithLongerContexts) {
  REQUIRE_GPU();
  const Shape sh{32, 4, 128, 16};
  const int max_context = 2100;
  for (AttentionPath path : {AttentionPath::kAuto, AttentionPath::kRow, AttentionPath::kTiled}) {
    PagedCase c(sh, {{1, 1, 1}, {100, 5, 700}}, max_context, 100);
    c.prepare(path);
    EXPECT_LE(gputest::max_rel_error(c.launch(), c.reference()), kBound) << "first, path " << static_cast<int>(path);
    c.replay_with({600, 2000, 2100});
    EXPECT_LE(gputest::max_rel_error(c.launch(), c.reference()), kBound) << "replay, path " << static_cast<int>(path);
  }
}

// Rejected sizes return an error instead of launching.
TEST(CudaAttention, RejectsBadSizes) {
  REQUIRE_GPU();
  PagedCase c({4, 2, 64, 16}, {{1}, {10}}, 10, 5);
  c.prepare(AttentionPath::kAuto);
  PagedAttentionParams p = c.params();
  p.head_dim = 60;
  EXPECT_EQ(cuda::kernels::paged_attention(p, nullptr), cudaErrorInvalidValue);
  p = c.params();
  p.block_size = 24;
  EXPECT_EQ(cuda::kernels::paged_attention(p, nullptr), cudaErrorInvalidValue);
  p = c.params();
  p.kv_heads = 3;
  EXPECT_EQ(cuda::kernels::paged_attention(p, nullptr), cudaErrorInvalidValue);
}

// Not a check: times the two shapes the engine cares about, printed next to the bytes moved.
TEST(CudaAttention, Timing) {
  REQUIRE_GPU();
  struct T {
    const char* name;
    Batch b;
    AttentionPath path;
  };
  const Shape sh{32, 4, 128, 16};
  for (const T& t : {T{"decode b1 ctx2048", {{1}, {2048}}, AttentionPath::kAuto},
                     T{"decode b64 ctx2048", {std::vector<int>(64, 1), std::vector<int>(64, 2048)}, AttentionPath::kAuto},
                     T{"prefill 4096 tiled", {{4096}, {4096}}, AttentionPath::kTiled},
                     T{"prefill 1024 row", {{1024}, {1024}}, AttentionPath::kRow},
                     T{"prefill 1024 tiled", {{1024}, {1024}}, AttentionPath::kTiled}}) {
    PagedCase c(sh, t.b, max_of(t.b.ctx), 7);
    c.prepare(t.path);
    c.launch();
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    const int iters = 20;
    cudaEventRecord(e0);
    for (int i = 0; i < iters; ++i) cuda::kernels::paged_attention(c.params(), nullptr);
    cudaEventRecord(e1);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    const double us = 1000.0 * ms / iters;
    double kv_bytes = 0;
    for (int ctx : t.b.ctx) kv_bytes += 2.0 * ctx * sh.kv_heads * sh.head_dim * 2;
    double flops = 0;
    for (size_t s = 0; s < t.b.rows.size(); ++s)
      for (int i = 0; i < t.b.rows[s]; ++i)
        flops += 4.0 * sh.q_heads * sh.head_dim * (t.b.ctx[s] - t.b.rows[s] + i + 1);
    std::printf("[timing] %-20s %9.1f us  KV %.1f GB/s  %.1f TFLOP/s\n", t.name, us, kv_bytes / us / 1e3,
                flops / us / 1e6);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
}

}  // namespace
}  // namespace moe
