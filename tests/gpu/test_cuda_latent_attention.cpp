// Multi-head latent attention (absorbed form) on the GPU: prepare_latent, prepare_mla_q and
// latent_attention against CPU references built from the same bf16-exact values.
// - prepare_latent vs cpu::rms_norm + cpu::rope_interleaved on each token's row (the order of
//   Model::latent_attention); tokens scatter over shuffled cache rows, one has slot -1, and the
//   rows nobody writes hold a sentinel that must survive bit for bit.
// - prepare_mla_q vs a copy of q's nope part and cpu::rope_interleaved of its rope part; the
//   q_full columns [0, lora) that belong to the engine's absorbed GEMM must stay poisoned.
// - latent_attention vs cpu::attention with one kv head of head_dim lora + rope whose values are
//   the first lora dims of the same rows (v_dim = lora, both strides lora + rope). Block tables
//   are shuffled; cache rows no sequence may read hold NaN and the output is poisoned with NaN, so
//   a stray read or a missed write shows up as a non-finite result.
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
#include "backend/cuda/attention/latent_attention_launch.h"
#include "gpu_test_util.h"

namespace moe {
namespace {

using cuda::kernels::LatentAttentionParams;
using gputest::DeviceBuffer;

// prepare_latent / prepare_mla_q rotated parts: each output is one f32 value rounded to bf16
// (2^-9 relative); the f32 sum of squares and sin/cos differ from the CPU's by a few ulps. 2^-8 of
// max |ref| leaves margin and is far below a wrong position, pair or norm (order 1).
constexpr double kPrepBound = 1.0 / 256;
// latent_attention: max |gpu - cpu| / max |cpu| <= 2^-7. The output is rounded to bf16 (2^-9
// relative), the softmax weights are rounded to bf16 before P V (2^-9 relative per weight,
// averaging out over keys), f32 summation orders differ (tensor-core products, context splits).
// A wrong key, head, mask or split merge errs by order 1.
constexpr double kAttnBound = 1.0 / 128;

struct Dims {
  int heads, lora, rope;
};

// The rotation's inputs, which both prepare kernels take: the inverse frequencies of `rope` dims,
// a scale on cos and sin, and one random position below max_pos a token; with device copies.
struct RopeInputs {
  std::vector<float> inv_freq;
  float scale;
  std::vector<int32_t> positions;
  DeviceBuffer<float> dfreq;
  DeviceBuffer<int32_t> dpos;

  RopeInputs(int rope, float scale, int tokens, int max_pos, std::mt19937& rng)
      : inv_freq(inverse_frequencies(rope)),
        scale(scale),
        positions(random_positions(tokens, max_pos, rng)),
        dfreq(inv_freq),
        dpos(positions) {}

  static std::vector<float> inverse_frequencies(int rope) {
    std::vector<float> f(static_cast<size_t>(rope / 2));
    for (int i = 0; i < rope / 2; ++i) f[i] = 1.0f / std::pow(10000.0f, static_cast<float>(2 * i) / rope);
    return f;
  }
  static std::vector<int32_t> random_positions(int tokens, int max_pos, std::mt19937& rng) {
    std::vector<int32_t> positions(static_cast<size_t>(tokens));
    std::uniform_int_distribution<int> pos_dist(0, max_pos);
    for (auto& p : positions) p = pos_dist(rng);
    return positions;
  }

  template <class Params>
  void set(Params& p) const {
    p.inv_freq = dfreq.get();
    p.rope_scale = scale;
    p.positions = dpos.get();
  }
};

// ---------------------------------------------------------------------------------------------
TEST(CudaLatentAttention, PrepareLatent) {
  REQUIRE_GPU();
  std::mt19937 rng(3);
  ThreadPool pool(1);
  const uint16_t kSentinel = 0xabcd;
  for (auto [lora, rope] : std::vector<std::pair<int, int>>{{16, 8}, {24, 8}, {32, 8}, {512, 64}}) {
    const int tokens = 37, row = lora + rope, block_size = 16, num_blocks = 5;
    const int pool_rows = num_blocks * block_size;
    const int stride = row + 8;  // a strided kv, as a fused q_a | kv_a projection would give
    std::vector<float> kv = gputest::random_bf16_exact(static_cast<size_t>(tokens) * stride, rng, 2.0f);
    std::vector<float> weight = gputest::random_bf16_exact(lora, rng, 0.2f);
    for (float& w : weight) w += 1.0f;
    // 0.93: YaRN's attention factor on cos and sin
    const RopeInputs rot(rope, lora == 24 ? 1.0f : 0.93f, tokens, 5000, rng);
    std::vector<int32_t> slots(pool_rows);
    std::iota(slots.begin(), slots.end(), 0);
    std::shuffle(slots.begin(), slots.end(), rng);
    slots.resize(tokens);
    slots[5] = -1;

    DeviceBuffer<float> dkv(kv), dw(weight);
    DeviceBuffer<int32_t> dslots(slots);
    DeviceBuffer<uint16_t> dcache(std::vector<uint16_t>(static_cast<size_t>(pool_rows) * row, kSentinel));
    cuda::kernels::LatentCacheParams p;
    p.kv = dkv.get();
    p.kv_stride = stride;
    p.norm_weight = dw.get();
    p.eps = 1e-6f;
    rot.set(p);
    p.slots = dslots.get();
    p.cache = dcache.get();
    p.tokens = tokens;
    p.lora = lora;
    p.rope = rope;
    ASSERT_EQ(cuda::kernels::prepare_latent(p, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint16_t> cache = dcache.download();

    std::vector<float> got, ref;
    std::vector<bool> written(static_cast<size_t>(pool_rows), false);
    for (int t = 0; t < tokens; ++t) {
      if (slots[t] < 0) continue;
      written[static_cast<size_t>(slots[t])] = true;
      std::vector<float> r(static_cast<size_t>(row));
      cpu::rms_norm(pool, kv.data() + static_cast<size_t>(t) * stride, weight.data(), r.data(), 1, lora, 1e-6f);
      std::copy_n(kv.data() + static_cast<size_t>(t) * stride + lora, rope, r.data() + lora);
      cpu::rope_interleaved(r.data() + lora, 1, 1, rope, rope, &rot.positions[t], rot.inv_freq.data(), rot.scale);
      ref.insert(ref.end(), r.begin(), r.end());
      for (int e = 0; e < row; ++e) got.push_back(bf16_to_f32(cache[static_cast<size_t>(slots[t]) * row + e]));
    }
    EXPECT_LE(gputest::max_rel_error(got, ref), kPrepBound) << "lora " << lora << " rope " << rope;
    size_t changed = 0;
    for (int r = 0; r < pool_rows; ++r)
      if (!written[static_cast<size_t>(r)])
        for (int e = 0; e < row; ++e) changed += cache[static_cast<size_t>(r) * row + e] != kSentinel;
    EXPECT_EQ(changed, 0u) << "rows without a token were written, lora " << lora;
  }
}

TEST(CudaLatentAttention, PrepareMlaQ) {
  REQUIRE_GPU();
  std::mt19937 rng(4);
  struct Q {
    int heads, nope, rope, lora;
  };
  for (const Q& d : {Q{4, 16, 8, 16}, Q{4, 8, 8, 32}, Q{16, 128, 64, 512}, Q{128, 128, 64, 512}}) {
    const int tokens = 19, width = d.nope + d.rope, full = d.lora + d.rope;
    const std::vector<float> q = gputest::random_bf16_exact(static_cast<size_t>(tokens) * d.heads * width, rng, 1.5f);
    // 1.12: YaRN's attention factor on cos and sin
    const RopeInputs rot(d.rope, d.lora == 32 ? 1.0f : 1.12f, tokens, 3000, rng);
    DeviceBuffer<float> dq(q);
    DeviceBuffer<uint16_t> dnope(static_cast<size_t>(tokens) * d.heads * d.nope);
    DeviceBuffer<uint16_t> dfull(static_cast<size_t>(tokens) * d.heads * full);
    dnope.poison();
    dfull.poison();
    cuda::kernels::MlaQParams p;
    p.q = dq.get();
    rot.set(p);
    p.q_nope = dnope.get();
    p.q_full = dfull.get();
    p.tokens = tokens;
    p.heads = d.heads;
    p.nope = d.nope;
    p.rope = d.rope;
    p.lora = d.lora;
    ASSERT_EQ(cuda::kernels::prepare_mla_q(p, nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const std::vector<uint16_t> nope = dnope.download(), fullq = dfull.download();

    std::vector<float> ref_rope = q;
    for (int t = 0; t < tokens; ++t)
      cpu::rope_interleaved(ref_rope.data() + static_cast<size_t>(t) * d.heads * width + d.nope, 1, d.heads,
                            width, d.rope, &rot.positions[t], rot.inv_freq.data(), rot.scale);
    // The nope part is a copy of bf16-exact values: it must be exact.
    size_t nope_wrong = 0, lora_touched = 0;
    std::vector<float> got, ref;
    for (size_t th = 0; th < static_cast<size_t>(tokens) * d.heads; ++th) {
      for (int e = 0; e < d.nope; ++e) nope_wrong += bf16_to_f32(nope[th * d.nope + e]) != q[th * width + e];
      for (int e = 0; e < d.lora; ++e) lora_touched += fullq[th * full + e] != 0xffff;
      for (int e = 0; e < d.rope; ++e) {
        got.push_back(bf16_to_f32(fullq[th * full + d.lora + e]));
        ref.push_back(ref_rope[th * width + d.nope + e]);
      }
    }
    EXPECT_EQ(nope_wrong, 0u) << "heads " << d.heads;
    EXPECT_EQ(lora_touched, 0u) << "q_full[:, :, :lora] belongs to the absorbed GEMM";
    EXPECT_LE(gputest::max_rel_error(got, ref), kPrepBound) << "heads " << d.heads << " rope " << d.rope;
  }
}

// ---------------------------------------------------------------------------------------------
struct Batch {
  std::vector<int> rows, ctx;
};

class LatentCase {
 public:
  LatentCase(const Dims& dims, int block_size, const Batch& b, int max_context, uint32_t seed)
      : dims_(dims), rows_(b.rows), max_context_(max_context), rng_(seed), blocks_(rows_, block_size, max_context, rng_) {
    row_ = dims.lora + dims.rope;
    cache_.assign(blocks_.pool_rows() * row_, NAN);
    seq_rows_.resize(rows_.size());
    for (auto& r : seq_rows_) r = gputest::random_bf16_exact(static_cast<size_t>(max_context) * row_, rng_, 1.0f);
    tokens_ = blocks_.tokens;
    q_ = gputest::random_bf16_exact(static_cast<size_t>(tokens_) * dims.heads * row_, rng_, 1.0f);
    // As 1 / sqrt(nope + rope) with nope = lora / 4 (128 for lora 512).
    scale_ = 1.0f / std::sqrt(static_cast<float>(dims.lora / 4 + dims.rope));
    set_context(b.ctx);
  }

  // Positions >= ctx of each sequence go back to NaN: rows not yet written may hold anything.
  void set_context(const std::vector<int>& ctx) {
    ctx_ = ctx;
    blocks_.scatter(seq_rows_, ctx, static_cast<size_t>(row_), cache_);
  }

  std::vector<float> reference() const {
    ThreadPool pool(0);
    std::vector<float> out(static_cast<size_t>(tokens_) * dims_.heads * dims_.lora);
    for (size_t s = 0; s < rows_.size(); ++s) {
      if (rows_[s] == 0) continue;
      const size_t r0 = static_cast<size_t>(blocks_.starts[s]) * dims_.heads;
      cpu::attention(pool, q_.data() + r0 * row_, seq_rows_[s].data(), seq_rows_[s].data(),
                     out.data() + r0 * dims_.lora, rows_[s], ctx_[s], dims_.heads, 1, row_, dims_.lora, row_,
                     row_, scale_);
    }
    return out;
  }

  void prepare() {
    dcache_ = std::make_unique<DeviceBuffer<uint16_t>>(gputest::to_bf16(cache_));
    dq_ = std::make_unique<DeviceBuffer<uint16_t>>(gputest::to_bf16(q_));
    dblocks_ = std::make_unique<gputest::DevicePagedBlocks>(blocks_, ctx_);
    dout_ = std::make_unique<DeviceBuffer<uint16_t>>(static_cast<size_t>(tokens_) * dims_.heads * dims_.lora);
    const size_t ws =
        cuda::kernels::latent_attention_workspace_bytes(tokens_, dims_.heads, dims_.lora, max_context_);
    p_ = LatentAttentionParams{};
    dblocks_->set(p_, blocks_, dq_->get(), dout_->get());
    p_.cache = dcache_->get();
    p_.heads = dims_.heads;
    p_.lora = dims_.lora;
    p_.rope = dims_.rope;
    p_.scale = scale_;
    p_.workspace = gputest::poisoned_workspace(ws, dws_);
  }

  // Same host fields as the last prepare(), as in a captured graph; only the device lengths and
  // the cache contents change.
  void replay_with(const std::vector<int>& ctx) {
    set_context(ctx);
    dcache_->upload(gputest::to_bf16(cache_));
    dblocks_->context_lens.upload(ctx_);
  }

  std::vector<float> launch() { return gputest::launch_bf16_out(cuda::kernels::latent_attention, p_, *dout_); }

  // The launch captured once in a CUDA graph on its own stream, then replayed: the graph keeps
  // the host fields of the capture and reads the device lengths of the moment.
  std::vector<float> launch_graph() {
    if (!exec_) {
      EXPECT_EQ(cudaStreamCreate(&stream_), cudaSuccess);
      cudaGraph_t graph = nullptr;
      EXPECT_EQ(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal), cudaSuccess);
      EXPECT_EQ(cuda::kernels::latent_attention(p_, stream_), cudaSuccess);
      EXPECT_EQ(cudaStreamEndCapture(stream_, &graph), cudaSuccess);
      EXPECT_EQ(cudaGraphInstantiate(&exec_, graph, 0), cudaSuccess);
      cudaGraphDestroy(graph);
    }
    dout_->poison();
    EXPECT_EQ(cudaGraphLaunch(exec_, stream_), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    return gputest::from_bf16(dout_->download());
  }

  ~LatentCase() {
    if (exec_) cudaGraphExecDestroy(exec_);
    if (stream_) cudaStreamDestroy(stream_);
  }

  const LatentAttentionParams& params() const { return p_; }

 private:
  Dims dims_;
  std::vector<int> rows_, ctx_;
  int max_context_, row_ = 0, tokens_ = 0;
  float scale_ = 1.0f;
  std::mt19937 rng_;
  gputest::PagedBlocks blocks_;
  std::vector<float> cache_, q_;
  std::vector<std::vector<float>> seq_rows_;
  std::unique_ptr<DeviceBuffer<uint16_t>> dcache_, dq_, dout_;
  std::unique_ptr<gputest::DevicePagedBlocks> dblocks_;
  std::unique_ptr<DeviceBuffer<uint8_t>> dws_;
  LatentAttentionParams p_;
  cudaStream_t stream_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
};

int max_of(const std::vector<int>& v) { return *std::max_element(v.begin(), v.end()); }

void check_batch(const Dims& d, int block_size, const Batch& b, uint32_t seed) {
  LatentCase c(d, block_size, b, max_of(b.ctx), seed);
  c.prepare();
  const double err = gputest::max_rel_error(c.launch(), c.reference());
  EXPECT_LE(err, kAttnBound) << "heads " << d.heads << " lora " << d.lora << " rope " << d.rope << " block "
                             << block_size << " seqs " << b.rows.size() << " max ctx " << max_of(b.ctx);
}

const Dims kTiny{4, 16, 8}, kV2Lite{16, 512, 64}, kV3{128, 512, 64};

TEST(CudaLatentAttention, DecodeBatch) {
  REQUIRE_GPU();
  const Batch b{{1, 1, 1, 1, 1}, {1, 7, 17, 300, 2100}};
  uint32_t seed = 1;
  for (const Dims& d : {kTiny, kV2Lite, kV3})
    for (int bs : {16, 64}) check_batch(d, bs, b, seed++);
  // The fixtures' other sizes (lora 24 and 32, rope 8), and a batch of one over many splits.
  check_batch({4, 24, 8}, 16, b, seed++);
  check_batch({4, 32, 8}, 16, b, seed++);
  check_batch(kV2Lite, 16, {{1}, {2048}}, seed++);
  check_batch({16, 256, 32}, 16, b, seed++);  // the middle instantiation
}

TEST(CudaLatentAttention, PrefillFresh) {
  REQUIRE_GPU();
  uint32_t seed = 20;
  for (const Dims& d : {kTiny, kV2Lite})
    for (int bs : {16, 64}) check_batch(d, bs, {{150}, {150}}, seed++);
  check_batch(kTiny, 16, {{700}, {700}}, seed++);  // many tiles, a ragged last one
  check_batch({4, 24, 8}, 16, {{45}, {45}}, seed++);
}

TEST(CudaLatentAttention, PrefillContinuingPrefix) {
  REQUIRE_GPU();
  uint32_t seed = 40;
  for (const Dims& d : {kTiny, kV2Lite})
    for (int bs : {16, 64}) check_batch(d, bs, {{77}, {300}}, seed++);
  check_batch(kV2Lite, 16, {{130, 64}, {1000, 64}}, seed++);
}

TEST(CudaLatentAttention, MixedBatch) {
  REQUIRE_GPU();
  uint32_t seed = 60;
  const Batch b{{1, 50, 1, 130, 3, 64}, {40, 50, 1000, 300, 3, 200}};
  for (const Dims& d : {kTiny, kV2Lite})
    for (int bs : {16, 64}) check_batch(d, bs, b, seed++);
  check_batch({4, 32, 8}, 16, b, seed++);
}

// The same launch (host fields fixed, as in a captured graph) with longer device context_lens.
TEST(CudaLatentAttention, ReplayWithLongerContexts) {
  REQUIRE_GPU();
  for (const Dims& d : {kTiny, kV2Lite}) {
    LatentCase c(d, 16, {{1, 1, 1}, {100, 5, 700}}, 2100, 100);
    c.prepare();
    EXPECT_LE(gputest::max_rel_error(c.launch(), c.reference()), kAttnBound) << "first, heads " << d.heads;
    c.replay_with({600, 2000, 2100});
    EXPECT_LE(gputest::max_rel_error(c.launch(), c.reference()), kAttnBound) << "replay, heads " << d.heads;
  }
  // The same through a captured graph: first at the capture's lengths, then longer ones.
  for (const Dims& d : {kTiny, kV2Lite, kV3}) {
    LatentCase c(d, 64, {{1, 1, 1, 1}, {100, 5, 700, 33}}, 2100, 101);
    c.prepare();
    EXPECT_LE(gputest::max_rel_error(c.launch_graph(), c.reference()), kAttnBound) << "graph, heads " << d.heads;
    c.replay_with({600, 2000, 2100, 64});
    EXPECT_LE(gputest::max_rel_error(c.launch_graph(), c.reference()), kAttnBound)
        << "graph replay, heads " << d.heads;
  }
}

TEST(CudaLatentAttention, RejectsBadSizes) {
  REQUIRE_GPU();
  LatentCase c(kTiny, 16, {{1}, {10}}, 10, 5);
  c.prepare();
  const auto with = [&](auto change) {
    return gputest::launch_changed(cuda::kernels::latent_attention, c.params(), change);
  };
  EXPECT_EQ(with([](LatentAttentionParams& p) { p.lora = 20; }), cudaErrorInvalidValue);
  EXPECT_EQ(with([](LatentAttentionParams& p) { p.lora = 520; }), cudaErrorInvalidValue);
  EXPECT_EQ(with([](LatentAttentionParams& p) { p.rope = 72; }), cudaErrorInvalidValue);
  EXPECT_EQ(with([](LatentAttentionParams& p) { p.block_size = 24; }), cudaErrorInvalidValue);
  cuda::kernels::MlaQParams q;
  q.tokens = 1;
  q.heads = 4;
  q.nope = 7;
  q.rope = 8;
  q.lora = 16;
  EXPECT_EQ(cuda::kernels::prepare_mla_q(q, nullptr), cudaErrorInvalidValue);
}

// Not a check: the shapes the engine cares about, printed next to the cache bytes and the flops.
TEST(CudaLatentAttention, Timing) {
  REQUIRE_GPU();
  struct T {
    const char* name;
    Dims d;
    Batch b;
  };
  const std::vector<int> b64_rows(64, 1), b64_ctx(64, 2048);
  for (const T& t : {T{"v2lite decode b1 ctx2048", kV2Lite, {{1}, {2048}}},
                     T{"v2lite decode b64 ctx2048", kV2Lite, {b64_rows, b64_ctx}},
                     T{"v2lite prefill 2048", kV2Lite, {{2048}, {2048}}},
                     T{"v3 decode b1 ctx2048", kV3, {{1}, {2048}}},
                     T{"v3 decode b64 ctx2048", kV3, {b64_rows, b64_ctx}}}) {
    LatentCase c(t.d, 16, t.b, max_of(t.b.ctx), 7);
    c.prepare();
    c.launch();
    cudaEvent_t e0, e1;
    cudaEventCreate(&e0);
    cudaEventCreate(&e1);
    // Timed as a graph of `iters` calls, as the engine runs decode: no host launch cost inside.
    const int iters = 20;
    cudaStream_t stream;
    cudaStreamCreate(&stream);
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal);
    for (int i = 0; i < iters; ++i) cuda::kernels::latent_attention(c.params(), stream);
    cudaStreamEndCapture(stream, &graph);
    cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphLaunch(exec, stream);
    cudaEventRecord(e0, stream);
    cudaGraphLaunch(exec, stream);
    cudaEventRecord(e1, stream);
    cudaEventSynchronize(e1);
    float ms = 0;
    cudaEventElapsedTime(&ms, e0, e1);
    const double us = 1000.0 * ms / iters;
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamDestroy(stream);
    const int row = t.d.lora + t.d.rope;
    double bytes = 0, flops = 0;
    for (size_t s = 0; s < t.b.rows.size(); ++s) {
      bytes += 2.0 * t.b.ctx[s] * row;
      for (int i = 0; i < t.b.rows[s]; ++i)
        flops += 2.0 * t.d.heads * (row + t.d.lora) * (t.b.ctx[s] - t.b.rows[s] + i + 1);
    }
    std::printf("[timing] %-26s %9.1f us  cache %.1f GB/s  %.1f TFLOP/s\n", t.name, us, bytes / us / 1e3,
                flops / us / 1e6);
    cudaEventDestroy(e0);
    cudaEventDestroy(e1);
  }
}

}  // namespace
}  // namespace moe
