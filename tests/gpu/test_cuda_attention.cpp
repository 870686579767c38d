// Paged attention on the GPU against moe::cpu::attention, run per sequence on contiguous f32
// copies of the same bf16 values. Every case runs every kernel (the row kernel with its context
// splits, the tiled and decode tensor-core kernels where the head dim has them, the wgmma kernel
// where the device and head dim run it) and the automatic choice.
// Block tables are shuffled; cache rows that no sequence may read (past a context, unused blocks,
// table entries past a sequence's last block) hold NaN, and the output is poisoned with NaN, so a
// stray read or a missed write shows up as a non-finite result.
//
// Bound: max |gpu - cpu| / max |cpu| <= 2^-7 per case. The output is rounded to bf16 (2^-9
// relative of each value); the tiled and wgmma kernels also round the softmax weights to bf16 before P V
// (2^-9 relative per weight, averaging out over keys; the decode kernel does the same); f32
// summation order differs. Two 2^-8
// leaves margin over those and is far below what a wrong key, head or mask produces (order 1).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/cpu/kernels.h"
#include "backend/cuda/attention/attention_launch.h"
#include "backend/cuda/ops/fp8_blocks_launch.h"
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
      : sh_(sh), rows_(b.rows), max_context_(max_context), rng_(seed), blocks_(rows_, sh.block_size, max_context, rng_) {
    const int seqs = static_cast<int>(rows_.size());
    const size_t row_elems = static_cast<size_t>(sh.kv_heads) * sh.head_dim;
    // Every pool row starts as NaN; positions < max_context of each sequence get values.
    k_.assign(blocks_.pool_rows() * row_elems, NAN);
    v_.assign(blocks_.pool_rows() * row_elems, NAN);
    // Values per sequence position, kept contiguous for the reference.
    seq_k_.resize(seqs);
    seq_v_.resize(seqs);
    for (int s = 0; s < seqs; ++s) {
      seq_k_[s] = gputest::random_bf16_exact(static_cast<size_t>(max_context) * row_elems, rng_, 1.0f);
      seq_v_[s] = gputest::random_bf16_exact(static_cast<size_t>(max_context) * row_elems, rng_, 1.0f);
    }
    tokens_ = blocks_.tokens;
    q_ = gputest::random_bf16_exact(static_cast<size_t>(tokens_) * sh.q_heads * sh.head_dim, rng_, 1.0f);
    set_context(b.ctx);
  }

  // Cache contents for these context lengths: positions >= ctx of each sequence go back to NaN,
  // as rows not yet written by the engine may hold anything.
  void set_context(const std::vector<int>& ctx) {
    ctx_ = ctx;
    const size_t row_elems = static_cast<size_t>(sh_.kv_heads) * sh_.head_dim;
    blocks_.scatter(seq_k_, ctx, row_elems, k_);
    blocks_.scatter(seq_v_, ctx, row_elems, v_);
  }

  std::vector<float> reference() const {
    ThreadPool pool(2);
    const int D = sh_.head_dim;
    std::vector<float> out(static_cast<size_t>(tokens_) * sh_.q_heads * D);
    for (size_t s = 0; s < rows_.size(); ++s) {
      if (rows_[s] == 0) continue;
      const size_t q_off = static_cast<size_t>(blocks_.starts[s]) * sh_.q_heads * D;
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
    dblocks_ = std::make_unique<gputest::DevicePagedBlocks>(blocks_, ctx_);
    dout_ = std::make_unique<DeviceBuffer<uint16_t>>(static_cast<size_t>(tokens_) * sh_.q_heads * sh_.head_dim);
    p_ = PagedAttentionParams{};
    dblocks_->set(p_, blocks_, dq_->get(), dout_->get());
    p_.k_cache = dk_->get();
    p_.v_cache = dv_->get();
    p_.q_heads = sh_.q_heads;
    p_.kv_heads = sh_.kv_heads;
    p_.head_dim = sh_.head_dim;
    p_.scale = 1.0f / std::sqrt(static_cast<float>(sh_.head_dim));
    set_path(path, 0);
  }

  // Another kernel or split size on the uploaded data; the workspace is sized (and poisoned) for it.
  void set_path(AttentionPath path, int split_keys) {
    const size_t ws = cuda::kernels::paged_attention_workspace_bytes(tokens_, sh_.q_heads, sh_.head_dim,
                                                                     max_context_, split_keys);
    p_.workspace = gputest::poisoned_workspace(ws, dws_);
    p_.path = path;
    p_.split_keys = split_keys;
  }

  // Same host fields as the last prepare(); only the device lengths and cache contents change.
  void replay_with(const std::vector<int>& ctx) {
    set_context(ctx);
    dk_->upload(gputest::to_bf16(k_));
    dv_->upload(gputest::to_bf16(v_));
    dblocks_->context_lens.upload(ctx_);
  }

  std::vector<float> launch() { return gputest::launch_bf16_out(cuda::kernels::paged_attention, p_, *dout_); }

  const PagedAttentionParams& params() const { return p_; }

 private:
  Shape sh_;
  std::vector<int> rows_, ctx_;
  int max_context_, tokens_ = 0;
  std::mt19937 rng_;
  gputest::PagedBlocks blocks_;
  std::vector<float> k_, v_, q_;
  std::vector<std::vector<float>> seq_k_, seq_v_;
  std::unique_ptr<DeviceBuffer<uint16_t>> dk_, dv_, dq_, dout_;
  std::unique_ptr<gputest::DevicePagedBlocks> dblocks_;
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
  if (cuda::kernels::paged_attention_has_decode(sh.head_dim)) paths.push_back(AttentionPath::kDecode);
  if (cuda::kernels::paged_attention_has_wgmma(sh.head_dim)) paths.push_back(AttentionPath::kWgmma);
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

// Prefill shapes of the 128-row kernels: the qwen3 head layout over several 128-key tiles, a last
// tile of 1 and of 127 rows, sequences whose first row sits mid-tile behind a cached prefix (the
// diagonal crossing a warpgroup's rows anywhere), and a batch mixing them with decode rows.
TEST(CudaAttention, PrefillLongTiles) {
  REQUIRE_GPU();
  const Shape sh{8, 1, 128, 16};
  uint32_t seed = 140;
  check_batch(sh, {{1025}, {1025}}, seed++);
  check_batch(sh, {{639}, {639}}, seed++);
  check_batch(sh, {{300, 200}, {1000, 263}}, seed++);
  check_batch({32, 4, 128, 16}, {{129, 1, 64, 250}, {129, 900, 1064, 250}}, seed++);
  check_batch({16, 16, 128, 32}, {{190}, {450}}, seed++);
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

// kAuto's choice from the host sizes (no GPU needed): prompts alone take the wgmma kernel where the
// device runs it; a serving step mixing decode rows with a prompt chunk, and devices or head dims
// without it, the tiled kernel; decode batches the decode kernel; head dims without tensor-core
// kernels the row kernel.
TEST(CudaAttention, AutoPathByRowsPerSequence) {
  using cuda::kernels::paged_attention_auto_path;
  EXPECT_EQ(paged_attention_auto_path(2048, 1, 128, true), AttentionPath::kWgmma);
  EXPECT_EQ(paged_attention_auto_path(4 * 512, 4, 128, true), AttentionPath::kWgmma);
  EXPECT_EQ(paged_attention_auto_path(256, 1, 128, true), AttentionPath::kWgmma);    // a chunk alone
  EXPECT_EQ(paged_attention_auto_path(256, 10, 128, true), AttentionPath::kTiled);   // 9 decodes + a chunk
  EXPECT_EQ(paged_attention_auto_path(2048, 1, 128, false), AttentionPath::kTiled);
  EXPECT_EQ(paged_attention_auto_path(2048, 1, 64, true), AttentionPath::kTiled);
  EXPECT_EQ(paged_attention_auto_path(64, 64, 128, true), AttentionPath::kDecode);
  EXPECT_EQ(paged_attention_auto_path(150, 10, 128, true), AttentionPath::kDecode);  // 15 rows a sequence
  EXPECT_EQ(paged_attention_auto_path(2048, 1, 96, true), AttentionPath::kRow);
}

// The wgmma kernel runs head dim 128 only; asked for another, or on a device without wgmma, the call
// is refused rather than run.
TEST(CudaAttention, WgmmaPathRefusesWhatItDoesNotRun) {
  REQUIRE_GPU();
  PagedCase c({8, 2, 64, 16}, {{150}, {150}}, 150, 160);
  c.prepare(AttentionPath::kWgmma);
  EXPECT_EQ(cuda::kernels::paged_attention(c.params(), nullptr), cudaErrorInvalidValue);
  PagedCase d({8, 2, 128, 16}, {{150}, {150}}, 150, 161);
  d.prepare(AttentionPath::kWgmma);
  const cudaError_t want = cuda::kernels::paged_attention_has_wgmma(128) ? cudaSuccess : cudaErrorInvalidValue;
  EXPECT_EQ(cuda::kernels::paged_attention(d.params(), nullptr), want);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

// The wgmma kernel writing an FP8 projection's input (out_codes): the rows below code_rows as the
// codes and block-major scales that quantize_rows_fp8_by_block gives for the kernel's own bf16
// output, bit for bit, and nothing of them in `out`; the rows from code_rows on in `out` as that
// bf16 output. Three ragged sequences, one behind a cached prefix, of which all rows but the last
// two are codes. Asked on another path, for more rows than the call has, or without scales, the
// call is refused.
TEST(CudaAttention, WgmmaWritesTheFp8ProjectionInput) {
  REQUIRE_GPU();
  if (!cuda::kernels::paged_attention_has_wgmma(128)) GTEST_SKIP() << "this device does not run the wgmma kernel";
  const Shape sh{32, 4, 128, 16};
  PagedCase c(sh, {{300, 129, 517}, {300, 1000, 517}}, 1000, 170);
  c.prepare(AttentionPath::kWgmma);
  const std::vector<uint16_t> bf16_out = gputest::to_bf16(c.launch());  // the values are bf16: exact
  PagedAttentionParams p = c.params();
  const int cols = sh.q_heads * sh.head_dim, code_rows = p.tokens - 2;
  const size_t code_elems = static_cast<size_t>(code_rows) * cols;
  DeviceBuffer<uint16_t> ref_in(bf16_out);
  DeviceBuffer<uint8_t> ref_codes(code_elems);
  DeviceBuffer<float> ref_scales(static_cast<size_t>(sh.q_heads) * code_rows);
  ASSERT_EQ(cuda::kernels::quantize_rows_fp8_by_block(ref_in.get(), code_rows, cols, ref_codes.get(),
                                                      ref_scales.get(), nullptr),
            cudaSuccess);
  DeviceBuffer<uint16_t> out(bf16_out.size());
  DeviceBuffer<uint8_t> codes(bf16_out.size());
  DeviceBuffer<float> scales(static_cast<size_t>(sh.q_heads) * code_rows);
  out.poison();
  codes.poison();
  scales.poison();
  p.out = out.get();
  p.out_codes = codes.get();
  p.out_scales = scales.get();
  p.code_rows = code_rows;
  ASSERT_EQ(cuda::kernels::paged_attention(p, nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got_codes = codes.download(), want_codes = ref_codes.download();
  const auto got_scales = scales.download(), want_scales = ref_scales.download();
  const auto got_out = out.download();
  int wrong = 0;
  for (size_t i = 0; i < code_elems; ++i)
    if (got_codes[i] != want_codes[i] && wrong++ < 5)
      ADD_FAILURE() << "code [" << i / cols << "][" << i % cols << "] = " << int{got_codes[i]} << ", want "
                    << int{want_codes[i]};
  for (size_t i = 0; i < want_scales.size(); ++i)
    if (got_scales[i] != want_scales[i] && wrong++ < 5)
      ADD_FAILURE() << "scale of head " << i / code_rows << " row " << i % code_rows << " = " << got_scales[i]
                    << ", want " << want_scales[i];
  for (size_t i = 0; i < got_out.size(); ++i) {
    const uint16_t want = i < code_elems ? uint16_t{0xffff} : bf16_out[i];  // poison, or the bf16 output
    if (got_out[i] != want && wrong++ < 5)
      ADD_FAILURE() << "out [" << i / cols << "][" << i % cols << "] = " << got_out[i] << ", want " << want;
  }
  EXPECT_EQ(wrong, 0);
  PagedAttentionParams q = p;
  q.path = AttentionPath::kTiled;
  EXPECT_EQ(cuda::kernels::paged_attention(q, nullptr), cudaErrorInvalidValue);
  q = p;
  q.code_rows = p.tokens + 1;
  EXPECT_EQ(cuda::kernels::paged_attention(q, nullptr), cudaErrorInvalidValue);
  q = p;
  q.out_scales = nullptr;
  EXPECT_EQ(cuda::kernels::paged_attention(q, nullptr), cudaErrorInvalidValue);
}

// The same launch (host fields fixed, as in a captured graph) with longer device context_lens.
TEST(CudaAttention, ReplayWithLongerContexts) {
  REQUIRE_GPU();
  const Shape sh{32, 4, 128, 16};
  const int max_context = 2100;
  std::vector<AttentionPath> paths = {AttentionPath::kAuto, AttentionPath::kRow, AttentionPath::kTiled,
                                      AttentionPath::kDecode};
  if (cuda::kernels::paged_attention_has_wgmma(sh.head_dim)) paths.push_back(AttentionPath::kWgmma);
  for (AttentionPath path : paths) {
    PagedCase c(sh, {{1, 1, 1}, {100, 5, 700}}, max_context, 100);
    c.prepare(path);
    EXPECT_LE(gputest::max_rel_error(c.launch(), c.reference()), kBound) << "first, path " << static_cast<int>(path);
    c.replay_with({600, 2000, 2100});
    EXPECT_LE(gputest::max_rel_error(c.launch(), c.reference()), kBound) << "replay, path " << static_cast<int>(path);
  }
}

// The decode kernel with the grid sized for a long max_context (as a captured graph is) and real
// contexts from 1 to 2048, under several split sizes: one split, splits past a row's end that must
// exit, the clamp to 64 splits where the last split takes the rest, a size not a multiple of 16.
TEST(CudaAttention, DecodeSplitSizes) {
  REQUIRE_GPU();
  const Shape sh{32, 4, 128, 16};
  PagedCase c(sh, {{1, 1, 1, 1, 1}, {2048, 200, 17, 1, 64}}, 2050, 120);
  const std::vector<float> ref = c.reference();
  c.prepare(AttentionPath::kDecode);
  for (int split_keys : {0, 16, 64, 100, 1 << 20}) {
    c.set_path(AttentionPath::kDecode, split_keys);
    EXPECT_LE(gputest::max_rel_error(c.launch(), ref), kBound) << "split_keys " << split_keys;
  }
}

// Rejected sizes return an error instead of launching.
TEST(CudaAttention, RejectsBadSizes) {
  REQUIRE_GPU();
  PagedCase c({4, 2, 64, 16}, {{1}, {10}}, 10, 5);
  c.prepare(AttentionPath::kAuto);
  const auto with = [&](auto change) {
    return gputest::launch_changed(cuda::kernels::paged_attention, c.params(), change);
  };
  EXPECT_EQ(with([](PagedAttentionParams& p) { p.head_dim = 60; }), cudaErrorInvalidValue);
  EXPECT_EQ(with([](PagedAttentionParams& p) { p.block_size = 24; }), cudaErrorInvalidValue);
  EXPECT_EQ(with([](PagedAttentionParams& p) { p.kv_heads = 3; }), cudaErrorInvalidValue);
}

// Microseconds per call: `reps` calls captured in one CUDA graph (as the engine replays its
// decode step), the graph replayed a few times. With `flush`, a memset of a buffer larger than L2
// precedes every call and a graph of the memsets alone is subtracted, so K/V come from HBM as in
// the engine, where a layer's expert weights pass through L2 between two attention calls.
double graph_us(const PagedAttentionParams& p, DeviceBuffer<uint8_t>* flush) {
  constexpr int kReps = 20, kReplays = 5;
  cudaStream_t st;
  EXPECT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
  auto time_graph = [&](bool attention) {
    cudaGraph_t g;
    cudaGraphExec_t ge;
    EXPECT_EQ(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    for (int i = 0; i < kReps; ++i) {
      if (flush) {
        EXPECT_EQ(cudaMemsetAsync(flush->get(), i & 0xff, flush->size(), st), cudaSuccess);
      }
      if (attention) {
        EXPECT_EQ(cuda::kernels::paged_attention(p, st), cudaSuccess);
      }
    }
    EXPECT_EQ(cudaStreamEndCapture(st, &g), cudaSuccess);
    EXPECT_EQ(cudaGraphInstantiate(&ge, g, 0), cudaSuccess);
    EXPECT_EQ(cudaGraphLaunch(ge, st), cudaSuccess);  // warm-up
    EXPECT_EQ(cudaStreamSynchronize(st), cudaSuccess);
    gputest::EventTimer timer;
    timer.start(st);
    for (int r = 0; r < kReplays; ++r) cudaGraphLaunch(ge, st);
    EXPECT_EQ(timer.stop(st), cudaSuccess);
    cudaGraphExecDestroy(ge);
    cudaGraphDestroy(g);
    return 1000.0 * timer.ms() / (kReps * kReplays);
  };
  double us = time_graph(true);
  if (flush) us -= time_graph(false);
  cudaStreamDestroy(st);
  return us;
}

// Not a check of speed (nothing is asserted on times): the decode shapes of qwen3-30b-a3b with the
// grid sized for max_context 2050 as the engine captures it, every decode variant checked against
// the row kernel on the same data, then timed warm (K/V in L2 where they fit) and cold.
TEST(CudaAttention, Timing) {
  REQUIRE_GPU();
  const Shape sh{32, 4, 128, 16};
  const int max_context = 2050;
  DeviceBuffer<uint8_t> flush(size_t{160} << 20);  // > the 50 MB L2 of an H100
  struct V {
    const char* name;
    AttentionPath path;
    int split_keys;
  };
  const V variants[] = {{"row (old)", AttentionPath::kRow, 0},     {"auto", AttentionPath::kAuto, 0},
                        {"decode split 64", AttentionPath::kDecode, 64},
                        {"decode split 128", AttentionPath::kDecode, 128},
                        {"decode split 256", AttentionPath::kDecode, 256},
                        {"decode split 512", AttentionPath::kDecode, 512},
                        {"decode split 1024", AttentionPath::kDecode, 1024},
                        {"decode no split", AttentionPath::kDecode, 1 << 20}};
  for (int batch : {1, 64}) {
    PagedCase c(sh, {std::vector<int>(batch, 1), std::vector<int>(batch, 2048)}, max_context, 7);
    c.prepare(AttentionPath::kRow);
    // Contexts: all 2048, all 200, and (batch 64) spread from 32 to 2048, where one split per row
    // would leave the longest rows alone at the end.
    std::vector<int> spread(static_cast<size_t>(batch));
    for (int i = 0; i < batch; ++i) spread[static_cast<size_t>(i)] = 2048 - i * 2016 / std::max(batch - 1, 1);
    for (int ctx : {2048, 200, -1}) {
      if (ctx == -1 && batch == 1) continue;
      const std::vector<int> lens = ctx == -1 ? spread : std::vector<int>(batch, ctx);
      if (ctx != 2048) c.replay_with(lens);
      c.set_path(AttentionPath::kRow, 0);
      const std::vector<float> want = c.launch();
      double kv_bytes = 0;
      for (int l : lens) kv_bytes += 2.0 * l * sh.kv_heads * sh.head_dim * 2;
      for (const V& v : variants) {
        c.set_path(v.path, v.split_keys);
        EXPECT_LE(gputest::max_rel_error(c.launch(), want), kBound) << v.name << " b" << batch << " ctx" << ctx;
        const double warm = graph_us(c.params(), nullptr), cold = graph_us(c.params(), &flush);
        std::printf("[timing] decode b%-2d ctx%-6s (max 2050) %-18s warm %7.1f us  cold %7.1f us  KV %6.0f GB/s cold\n",
                    batch, ctx == -1 ? "spread" : std::to_string(ctx).c_str(), v.name, warm, cold,
                    kv_bytes / cold / 1e3);
      }
    }
  }
  struct T {
    const char* name;
    Batch b;
    AttentionPath path;
  };
  for (const T& t : {T{"prefill 4096 tiled", {{4096}, {4096}}, AttentionPath::kTiled},
                     T{"prefill 4096 wgmma", {{4096}, {4096}}, AttentionPath::kWgmma},
                     T{"prefill 2048 tiled", {{2048}, {2048}}, AttentionPath::kTiled},
                     T{"prefill 2048 wgmma", {{2048}, {2048}}, AttentionPath::kWgmma},
                     T{"prefill 1024 row", {{1024}, {1024}}, AttentionPath::kRow},
                     T{"prefill 1024 tiled", {{1024}, {1024}}, AttentionPath::kTiled},
                     T{"prefill 1024 wgmma", {{1024}, {1024}}, AttentionPath::kWgmma}}) {
    if (t.path == AttentionPath::kWgmma && !cuda::kernels::paged_attention_has_wgmma(sh.head_dim)) continue;
    PagedCase c(sh, t.b, max_of(t.b.ctx), 7);
    c.prepare(t.path);
    const double us = graph_us(c.params(), nullptr);
    double flops = 0;
    for (size_t s = 0; s < t.b.rows.size(); ++s)
      for (int i = 0; i < t.b.rows[s]; ++i)
        flops += 4.0 * sh.q_heads * sh.head_dim * (t.b.ctx[s] - t.b.rows[s] + i + 1);
    std::printf("[timing] %-20s %9.1f us  %.1f TFLOP/s\n", t.name, us, flops / us / 1e6);
    if (t.path != AttentionPath::kWgmma) continue;
    // The same with the output written as an FP8 projection's input (all rows codes).
    PagedAttentionParams q = c.params();
    DeviceBuffer<uint8_t> codes(static_cast<size_t>(q.tokens) * sh.q_heads * sh.head_dim);
    DeviceBuffer<float> scales(static_cast<size_t>(q.tokens) * sh.q_heads);
    q.out_codes = codes.get();
    q.out_scales = scales.get();
    q.code_rows = q.tokens;
    const double codes_us = graph_us(q, nullptr);
    std::printf("[timing] %-20s %9.1f us  %.1f TFLOP/s (FP8 codes out)\n", t.name, codes_us, flops / codes_us / 1e6);
  }
}

}  // namespace
}  // namespace moe
