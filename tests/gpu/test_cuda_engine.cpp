// The whole model on the GPU against transformers' logits (bf16 bound) and the CPU engine's
// greedy tokens; decode through CUDA graphs against eager decode; batched decode against each
// sequence alone; bad input. Skipped, visibly, where no CUDA device exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <fstream>
#include <random>

#include <nlohmann/json.hpp>

#include "backend/cuda/engine/decode_buckets.h"
#include "backend/cuda_engine.h"
#include "gpu_test_util.h"
#include "../support/engine_decode.h"
#include "../support/fixtures.h"
#include "model/model.h"
#include "moe/errors.h"

namespace moe {
namespace {

// The GPU runs bf16 weights and activations with f32 accumulation, against an f32 reference on
// the same (bf16-representable) weights: each projection rounds its input to 8 significant
// bits, so logits carry errors of a few 2^-8 of their scale. Bound: 4% of the largest
// reference logit magnitude (and at least 2e-3), measured ~1-2% on the fixtures.
double logit_bound(double scale) { return std::max(0.04 * scale, 2e-3); }
// FP8 fixtures: an expert GEMM past the GEMV (a prefill of more routed rows than it takes) is
// W8A8, its activations rounded to E4M3's 4 significant bits per row and 128 columns, so the
// logits carry errors of a few 2^-4 of their scale there: measured 4.7% (qwen3_moe_fp8, 24
// tokens; H100); bound 10%. transformers' own W8A8 forward is 4.9-47% away over whole inputs
// (Fp8LogitsAtLeastAsCloseToExactAsTransformersW8A8 below).
double logit_bound(double scale, const std::string& fixture) {
  return load_model_config(test::fixture_dir(fixture)).quant.fp8 ? std::max(0.10 * scale, 2e-3) : logit_bound(scale);
}

using test::fixture_dir;
using test::reference;

std::unique_ptr<cuda::Engine> load(const std::string& dir, bool graphs = true, int max_batch = 4) {
  cuda::EngineOptions o;
  o.record_routing = true;
  o.max_batch = max_batch;
  // 128, or the model's own context where it is shorter (the YaRN fixture's is 64).
  o.max_context = std::min<int64_t>(128, load_model_config(dir).max_position_embeddings);
  o.graphs = graphs;
  return cuda::Engine::load(dir, o);
}

// The CPU engine's logits and expert choices for a sequence, to compare the GPU's against.
struct CpuRun {
  Tensor logits;                          // [T, vocab]
  std::vector<std::vector<int32_t>> ids;  // per layer: [T * top_k] chosen experts (empty: dense)
};

CpuRun cpu_run(const std::string& dir, const std::vector<int32_t>& ids) {
  auto model = Model::load(dir);
  const RouterConfig rc = model->config().moe.router;
  CpuRun r;
  r.ids.resize(static_cast<size_t>(model->config().num_layers));
  model->on_router = [&](int64_t layer, const float* logits, const float* bias, int64_t tokens, int64_t) {
    auto& out = r.ids[static_cast<size_t>(layer)];
    out.resize(static_cast<size_t>(tokens * rc.top_k));
    std::vector<float> w(out.size());
    route(rc, logits, bias, tokens, out.data(), w.data());
  };
  KvCache cache = model->new_cache(static_cast<int64_t>(ids.size()));
  r.logits = model->forward(ids, cache, true);
  return r;
}

// Where the GPU's routing (bf16 activations) first chose other experts than the CPU's for some
// layer: that row and every later one (through attention) are no longer comparable. Also counts
// the decisions, so that a systematic difference (a wiring bug, not a near-tie) fails.
struct RoutingAgreement {
  size_t first_divergence = SIZE_MAX;
  size_t decisions = 0, agreeing = 0;
};

RoutingAgreement compare_routing(const CpuRun& cpu, const std::vector<int32_t>& gpu, int64_t layers,
                                 int64_t tokens, int64_t k) {
  RoutingAgreement a;
  for (int64_t l = 0; l < layers; ++l) {
    const auto& c = cpu.ids[static_cast<size_t>(l)];
    if (c.empty()) continue;
    for (int64_t t = 0; t < tokens; ++t) {
      const bool same = std::equal(c.begin() + t * k, c.begin() + (t + 1) * k, gpu.begin() + (l * tokens + t) * k);
      ++a.decisions;
      a.agreeing += same;
      if (!same) a.first_divergence = std::min(a.first_divergence, static_cast<size_t>(t));
    }
  }
  return a;
}

// Near-ties flip a few routing decisions under bf16; more than one in ten is a bug.
constexpr double kMinRoutingAgreement = 0.9;

class CudaFixtureTest : public ::testing::TestWithParam<std::string> {};

// Every row before the first routing divergence from the CPU must be within the bf16 bound of
// transformers' logits; later rows are reported. The GPU's routing must agree with the CPU's on
// most decisions.
TEST_P(CudaFixtureTest, LogitsMatchTransformersWithinBf16Bound) {
  REQUIRE_GPU();
  const std::string dir = fixture_dir(GetParam());
  auto ref = reference(dir);
  auto engine = load(dir);
  const ModelConfig& mc = engine->config();
  const int64_t vocab = mc.vocab_size;
  const bool all_rows = ref.value("logits_rows", std::string("all")) == "all";
  size_t checked = 0, decisions = 0, agreeing = 0;
  for (size_t i = 0; i < ref["inputs"].size(); ++i) {
    auto ids = ref["inputs"][i].get<std::vector<int32_t>>();
    const int32_t seq = engine->open();
    Tensor logits;
    engine->prefill(seq, ids, SamplingParams{}, &logits, all_rows);
    engine->close(seq);
    const RoutingAgreement ra = compare_routing(cpu_run(dir, ids), engine->last_routing(), mc.num_layers,
                                                static_cast<int64_t>(ids.size()), std::max<int64_t>(mc.moe.top_k, 1));
    decisions += ra.decisions;
    agreeing += ra.agreeing;
    const auto& expected = ref["logits"][i];
    ASSERT_EQ(logits.dim(0), static_cast<int64_t>(expected.size()));
    const size_t first_row = all_rows ? 0 : ids.size() - 1;  // position of expected row 0
    double worst = 0, worst_after = 0, scale = 0;
    for (size_t r = 0; r < expected.size(); ++r) {
      auto row = expected[r].get<std::vector<float>>();
      ASSERT_EQ(static_cast<int64_t>(row.size()), vocab);
      const bool trusted = first_row + r < ra.first_divergence;
      for (int64_t v = 0; v < vocab; ++v) {
        const float got = logits.data<float>()[static_cast<int64_t>(r) * vocab + v];
        ASSERT_TRUE(std::isfinite(got)) << "row " << r << " id " << v;
        const double err = std::fabs(static_cast<double>(got) - row[static_cast<size_t>(v)]);
        (trusted ? worst : worst_after) = std::max(trusted ? worst : worst_after, err);
        scale = std::max(scale, std::fabs(static_cast<double>(row[static_cast<size_t>(v)])));
      }
      checked += trusted;
    }
    std::printf("[ %s input %zu ] max |logit - transformers| = %.3g (%.2f%% of max |logit| %.3g) over "
                "rows before the first routing divergence (position %zu of %zu; %zu of %zu decisions "
                "agree); %.3g after it\n", GetParam().c_str(), i, worst, 100 * worst / scale, scale,
                std::min(ra.first_divergence, ids.size()), ids.size(), ra.agreeing, ra.decisions, worst_after);
    EXPECT_LE(worst, logit_bound(scale, GetParam())) << GetParam() << " input " << i;
  }
  if (decisions > 0) {
    EXPECT_GE(static_cast<double>(agreeing) / static_cast<double>(decisions), kMinRoutingAgreement)
        << GetParam() << ": the GPU routes differently from the CPU far more often than near-ties explain";
  }
  // A fixture whose routing diverged at the very first token of every input checks no logits;
  // its routing agreement above still holds it.
  std::printf("[ %s ] %zu rows checked against the bound\n", GetParam().c_str(), checked);
}

// Greedy continuations through prefill and graph-replayed decode steps equal the CPU engine's
// (which equal transformers') at every step the CPU decided clearly. A step is clear when the
// GPU routed every earlier position as the CPU did and the CPU's top-2 logit margin exceeds three times the largest
// |GPU - CPU| logit difference measured at that position, both in one forward of the whole
// sequence and one token at a time as decode computes it (from the keys and values earlier steps
// cached in bf16), teacher-forced along the CPU's tokens: twice that difference already fixes the
// GPU's argmax, the third covers the graph's batch padding. Steps after the first unclear one are
// reported.
TEST_P(CudaFixtureTest, GreedyTokensMatchCpuEngine) {
  REQUIRE_GPU();
  const std::string dir = fixture_dir(GetParam());
  auto ref = reference(dir);
  auto engine = load(dir);
  const int64_t vocab = engine->config().vocab_size;
  size_t compared = 0;
  bool all_equal = true;
  for (size_t i = 0; i < ref["inputs"].size(); ++i) {
    const auto [ids, expected, sequence] = test::greedy_case(ref, i);
    const CpuRun cpu = cpu_run(dir, sequence);
    Tensor forced;
    const int32_t probe = engine->open();
    engine->prefill(probe, sequence, SamplingParams{}, &forced, true);
    engine->close(probe);
    const RoutingAgreement ra =
        compare_routing(cpu, engine->last_routing(), engine->config().num_layers,
                        static_cast<int64_t>(sequence.size()), std::max<int64_t>(engine->config().moe.top_k, 1));
    // The same positions as decode computes them: one token at a time after the prompt, each
    // reading the keys and values the earlier steps cached (one-token steps run the decode
    // step's kernels), along the CPU's tokens.
    std::vector<Tensor> stepped;
    {
      const int32_t s = engine->open();
      Tensor last;
      engine->prefill(s, ids, SamplingParams{}, &last);
      stepped.push_back(last);
      for (size_t step = 0; step + 1 < expected.size(); ++step) {
        engine->prefill(s, std::vector<int32_t>{expected[step]}, SamplingParams{}, &last);
        stepped.push_back(last);
      }
      engine->close(s);
    }
    size_t clear = 0;
    for (size_t step = 0; step < expected.size(); ++step) {
      const size_t pos = ids.size() - 1 + step;
      if (ra.first_divergence <= pos) break;
      const float* c = cpu.logits.data<float>() + static_cast<int64_t>(pos) * vocab;
      const float* g = forced.data<float>() + static_cast<int64_t>(pos) * vocab;
      const float* d = stepped[step].data<float>();
      double diff = 0;
      for (int64_t v = 0; v < vocab; ++v)
        diff = std::max({diff, std::fabs(static_cast<double>(c[v]) - g[v]), std::fabs(static_cast<double>(c[v]) - d[v])});
      std::vector<float> sorted(c, c + vocab);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      if (sorted[0] - sorted[1] <= 3 * diff) break;
      ++clear;
    }
    const std::vector<int32_t> got = test::greedy_tokens(*engine, ids, expected.size());
    std::printf("[ %s input %zu ] %zu of %zu greedy steps decided clearly on the CPU; GPU: %s\n",
                GetParam().c_str(), i, clear, expected.size(),
                std::equal(got.begin(), got.end(), expected.begin()) ? "all equal" : "differs later");
    for (size_t step = 0; step < clear; ++step)
      EXPECT_EQ(got[step], expected[step]) << GetParam() << " input " << i << " step " << step;
    compared += clear;
    all_equal = all_equal && got == expected;
  }
  // A fixture whose every step is a near-tie must still give the CPU's tokens (the kernels are
  // deterministic, so this cannot flake); otherwise it would check nothing.
  EXPECT_TRUE(compared > 0 || all_equal) << GetParam() << ": no step was decided clearly and the tokens differ";
}

// Graph replay and eager decode run the same kernels on the same data: identical tokens, and a
// batch of three sequences decodes as each does alone.
TEST_P(CudaFixtureTest, GraphDecodeEqualsEagerAndBatchEqualsAlone) {
  REQUIRE_GPU();
  const std::string dir = fixture_dir(GetParam());
  std::vector<std::vector<int32_t>> prompts{{5, 9, 1}, {7}, {3, 2, 8, 8, 4, 6, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}};
  auto run = [&](bool graphs, bool together) {
    auto engine = load(dir, graphs);
    std::vector<int32_t> seqs;
    return test::greedy_prompts(*engine, prompts, 20, together, &seqs);
  };
  const auto graph_batch = run(true, true);
  EXPECT_EQ(graph_batch, run(false, true)) << "graph replay differs from eager decode";
  EXPECT_EQ(graph_batch, run(true, false)) << "a batch differs from its sequences decoded alone";
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaFixtureTest,
                         ::testing::Values("qwen3_dense_f32", "qwen3_dense_bf16_tied", "qwen3_moe_f32",
                                           "qwen3_moe_nonorm_f32", "qwen3_moe_bf16", "mixtral_f32",
                                           "mixtral_f16_sharded", "mixtral_bf16", "qwen2_moe_f32",
                                           "olmoe_f32", "tiny_qwen3_moe", "deepseek_v2_f32",
                                           "deepseek_v2_grouped_f32", "deepseek_v3_f32",
                                           "deepseek_v3_g8_f32", "deepseek_v3_bf16", "qwen3_moe_yarn_f32",
                                           "deepseek_v2_yarn_legacy_f32", "deepseek_v3_yarn_mtp_legacy_bf16",
                                           "mixtral_llama3_f32", "qwen3_dense_linear_f32", "qwen3_moe_fp8",
                                           "deepseek_v3_fp8"));

// transformers' own FP8 forward (scripts/make_w8a8_references.py: W8A8 in every FP8 projection,
// activations rounded to E4M3 per token and 128 channels) moves these tiny random models' logits
// by 4.9% to 47% of their scale from the exact reference, its routing and greedy tokens with them
// (reference_w8a8.json). The engine runs W8A8 in the expert GEMMs of a prefill past the GEMV and
// keeps bf16 activations elsewhere, so over every row of every input, routing divergences
// included, its logits must be at least as close to the exact reference as transformers' W8A8
// forward is (or within the bf16 bound where that forward comes closer).
TEST(CudaEngine, Fp8LogitsAtLeastAsCloseToExactAsTransformersW8A8) {
  REQUIRE_GPU();
  for (const char* name : {"qwen3_moe_fp8", "deepseek_v3_fp8"}) {
    const std::string dir = fixture_dir(name);
    const nlohmann::json exact = reference(dir);
    std::ifstream in(dir + "/reference_w8a8.json");
    ASSERT_TRUE(in.good()) << "missing " << dir << "/reference_w8a8.json";
    const nlohmann::json w8a8 = nlohmann::json::parse(in);
    ASSERT_EQ(w8a8["inputs"], exact["inputs"]) << name;
    ASSERT_EQ(exact.value("logits_rows", std::string("all")), "all") << name;
    auto engine = load(dir);
    for (size_t i = 0; i < exact["inputs"].size(); ++i) {
      const auto ids = exact["inputs"][i].get<std::vector<int32_t>>();
      const int32_t seq = engine->open();
      Tensor logits;
      engine->prefill(seq, ids, SamplingParams{}, &logits, true);
      engine->close(seq);
      std::vector<float> ex, tf;
      for (const auto& row : exact["logits"][i]) for (float v : row) ex.push_back(v);
      for (const auto& row : w8a8["logits"][i]) for (float v : row) tf.push_back(v);
      ASSERT_EQ(tf.size(), ex.size()) << name << " input " << i;
      ASSERT_EQ(static_cast<size_t>(logits.numel()), ex.size()) << name << " input " << i;
      const std::vector<float> gpu(logits.data<float>(), logits.data<float>() + logits.numel());
      const double ours = gputest::max_rel_error(gpu, ex), theirs = gputest::max_rel_error(tf, ex);
      std::printf("[ %s input %zu, %zu tokens ] max |logit - exact| / max |exact|: engine %.3g, transformers "
                  "W8A8 %.3g\n", name, i, ids.size(), ours, theirs);
      EXPECT_LE(ours, std::max(theirs, 0.04)) << name << " input " << i;
    }
  }
}

// The decode graphs' buckets (decode_buckets.h): four per doubling up to max_batch, rounded to
// the row unit; three rows get their own on one GPU, where they measured faster than as four in
// both formats. Runs without a GPU.
TEST(CudaEngine, DecodeBucketsGiveThreeRowsTheirOwnOnOneGpu) {
  using cuda::engine::decode_buckets;
  using cuda::engine::own_bucket_for_three_rows;
  EXPECT_TRUE(own_bucket_for_three_rows(1));
  EXPECT_FALSE(own_bucket_for_three_rows(2));
  EXPECT_EQ(decode_buckets(16, 1, true), (std::vector<int>{1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 14, 16}));
  EXPECT_EQ(decode_buckets(16, 1, false), (std::vector<int>{1, 2, 4, 5, 6, 7, 8, 10, 12, 14, 16}));
  EXPECT_EQ(decode_buckets(3, 1, false), (std::vector<int>{1, 2, 3}));  // max_batch is always one
  EXPECT_EQ(decode_buckets(20, 1, false), (std::vector<int>{1, 2, 4, 5, 6, 7, 8, 10, 12, 14, 16, 20}));
  EXPECT_EQ(decode_buckets(9, 2, true), (std::vector<int>{2, 4, 6, 8, 10}));  // rounded, repeats dropped
  EXPECT_EQ(decode_buckets(1, 1, true), (std::vector<int>{1}));
}

// Real widths (head_dim 64, 64 experts of 384, vocab 151936): the GPU engine and the CPU engine
// hold the same random weights (the device draws the loader's stream) and must agree.
TEST(CudaEngine, RandomWeightPresetMatchesCpuEngine) {
  REQUIRE_GPU();
  const std::string dir = std::string(MOE_SOURCE_DIR) + "/presets/qwen3-moe-mid";
  std::vector<int32_t> ids{151643, 785, 3974, 13876, 38835, 34208, 916, 279, 15678, 5562, 13};
  cuda::EngineOptions o;
  o.random_weights = true;
  o.seed = 3;
  o.max_context = 64;
  auto engine = cuda::Engine::load(dir, o);
  Tensor gpu;
  engine->prefill(engine->open(), ids, SamplingParams{}, &gpu, true);
  LoadOptions lo;
  lo.random_weights = true;
  lo.seed = 3;
  auto model = Model::load(dir, lo);
  KvCache cache = model->new_cache(64);
  Tensor cpu = model->forward(ids, cache, true);
  ASSERT_EQ(gpu.numel(), cpu.numel());
  std::vector<float> a(gpu.data<float>(), gpu.data<float>() + gpu.numel());
  std::vector<float> b(cpu.data<float>(), cpu.data<float>() + cpu.numel());
  const double err = gputest::max_rel_error(a, b);
  std::printf("[ qwen3-moe-mid random ] max |gpu - cpu| / max |cpu| = %.3g\n", err);
  EXPECT_LE(err, 0.04);  // the bf16 bound above
}

// The largest difference between the logits of every position of a prefill of `ids` with the
// folded kernels (EngineOptions::fuse) and with every operation on its own, relative to the
// largest logit; `o` gives the other options.
double folded_against_separate(const std::string& dir, const std::vector<int32_t>& ids, cuda::EngineOptions o) {
  Tensor logits[2];
  for (int fuse = 0; fuse < 2; ++fuse) {
    o.fuse = fuse == 1;
    auto engine = cuda::Engine::load(dir, o);
    engine->prefill(engine->open(), ids, SamplingParams{}, &logits[fuse], true);
  }
  if (logits[0].numel() != logits[1].numel() || logits[0].numel() == 0) {
    ADD_FAILURE() << "logits of " << logits[1].numel() << " and " << logits[0].numel() << " values";
    return INFINITY;
  }
  std::vector<float> a(logits[1].data<float>(), logits[1].data<float>() + logits[1].numel());
  std::vector<float> b(logits[0].data<float>(), logits[0].data<float>() + logits[0].numel());
  return gputest::max_rel_error(a, b);
}

// The folded kernels (post-attention norm + router + top-k in one launch, the next input norm in
// the experts' combine) against every operation on its own: the same arithmetic in another f32
// summation order, so logits agree far inside the bf16 bound. A 2-token prompt takes both folded
// paths (the fused router runs for up to 2 rows).
TEST(CudaEngine, FoldedKernelsMatchSeparateOnes) {
  REQUIRE_GPU();
  for (const char* name : {"qwen3_moe_f32", "mixtral_f32", "deepseek_v3_f32"}) {
    cuda::EngineOptions o;
    o.max_context = 64;
    EXPECT_LE(folded_against_separate(fixture_dir(name), {5, 9}, o), 5e-3) << name;
  }
}

// The same with an FP8 model of real widths (qwen3-30b-a3b-fp8's config cut to 2 layers, 16
// experts and a 2,048-token vocabulary; random weights) and a 300-token prompt, where the folded
// kernels also write the W8A8 projections' inputs quantised (the wgmma attention kernel for o, the
// experts' folded norm for q/k/v) and the separate ones quantise bf16 rows in a kernel of their
// own. Those codes are the same bits for the same rows (CudaAttention.WgmmaWritesTheFp8ProjectionInput,
// CudaFp8ActQuant.FoldedNormWritesTheNextProjectionsInput), so only the folded norm's summation
// order could separate the logits (they came out equal on an H100); a code or scale read from the
// wrong place would move them by their own scale.
TEST(CudaEngine, FoldedFp8InputsMatchSeparateQuantising) {
  REQUIRE_GPU();
  nlohmann::json config;
  std::ifstream(std::string(MOE_SOURCE_DIR) + "/presets/qwen3-30b-a3b-fp8/config.json") >> config;
  config["num_hidden_layers"] = 2;
  config["num_experts"] = 16;
  config["vocab_size"] = 2048;
  const std::string dir = ::testing::TempDir() + "/qwen3_fp8_two_layers";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << config.dump(2);
  std::mt19937 rng(7);
  std::vector<int32_t> ids(300);
  for (auto& id : ids) id = std::uniform_int_distribution<int32_t>(0, 2047)(rng);
  cuda::EngineOptions o;
  o.random_weights = true;
  o.seed = 11;
  o.max_context = 512;
  const double err = folded_against_separate(dir, ids, o);
  std::printf("[ qwen3 fp8, 2 layers, 300 tokens ] folded against separate: %.3g\n", err);
  EXPECT_LE(err, 5e-3);
}

TEST(CudaEngine, BadInputIsRejectedAndTheEngineKeepsWorking) {
  REQUIRE_GPU();
  auto engine = load(fixture_dir("qwen3_moe_f32"), true, 2);
  const int64_t vocab = engine->config().vocab_size;
  const int32_t a = engine->open();
  std::vector<int32_t> bad{1, static_cast<int32_t>(vocab)};
  EXPECT_THROW(engine->prefill(a, bad, SamplingParams{}), Error);
  EXPECT_EQ(engine->length(a), 0);
  std::vector<int32_t> empty;
  EXPECT_THROW(engine->prefill(a, empty, SamplingParams{}), Error);
  std::vector<int32_t> too_long(129, 1);
  EXPECT_THROW(engine->prefill(a, too_long, SamplingParams{}), Error);
  SamplingParams negative;
  negative.temperature = -1;
  std::vector<int32_t> ok{1, 2, 3};
  EXPECT_THROW(engine->prefill(a, ok, negative), Error);
  const int32_t first = engine->prefill(a, ok, SamplingParams{});
  EXPECT_GE(first, 0);
  EXPECT_LT(first, vocab);
  EXPECT_EQ(engine->length(a), 3);
  const int32_t b = engine->open();
  EXPECT_THROW(engine->open(), Error);  // max_batch 2
  std::vector<int32_t> twice{a, a}, toks{1, 2};
  std::vector<SamplingParams> greedy(2);
  EXPECT_THROW(engine->decode(twice, toks, greedy), Error);
  engine->close(b);
  EXPECT_THROW(engine->close(b), Error);
  std::vector<int32_t> closed{b}, one{1};
  std::vector<SamplingParams> g1(1);
  EXPECT_THROW(engine->decode(closed, one, g1), Error);
  std::vector<int32_t> seqs{a};
  EXPECT_NO_THROW(engine->decode(seqs, one, g1));
  EXPECT_EQ(engine->length(a), 4);
  const cuda::MemoryReport m = engine->memory();
  EXPECT_GT(m.weights, 0u);
  EXPECT_GT(m.kv_cache, 0u);
  EXPECT_LT(m.kv_blocks_free, m.kv_blocks);
}

// A sequence that takes two cached 16-token blocks of an earlier one (closed, or still open and
// sharing them) computes the rest and gets the logits of recomputing everything, within the bf16
// bound (only the rows per forward differ), and the same token where the choice is clear; the
// shared blocks return to the free list once both sequences are closed.
TEST(CudaEngine, PrefixReuseMatchesRecompute) {
  REQUIRE_GPU();
  const std::string dir = fixture_dir("qwen3_moe_f32");
  auto engine = load(dir, true, 2);
  const int64_t vocab = engine->config().vocab_size;
  std::mt19937 rng(4);
  std::vector<int32_t> prompt(45);
  for (auto& t : prompt) t = static_cast<int32_t>(rng() % static_cast<uint32_t>(vocab));
  const std::vector<int32_t> head(prompt.begin(), prompt.begin() + 40);

  cuda::EngineOptions off;
  off.max_batch = 2;
  off.max_context = 128;
  off.prefix_reuse = false;
  auto plain = cuda::Engine::load(dir, off);
  Tensor want;
  const int32_t p = plain->open();
  const int32_t want_next = plain->prefill(p, prompt, SamplingParams{}, &want);
  EXPECT_EQ(plain->reuse_prefix(plain->open(), prompt), 0) << "reuse with prefix_reuse off";

  const int64_t free_before = engine->memory().kv_blocks_free;
  const int32_t a = engine->open();
  engine->prefill(a, head, SamplingParams{});
  EXPECT_GE(engine->memory().kv_blocks_cached, 2);
  for (bool a_open : {true, false}) {
    if (!a_open) engine->close(a);
    const int32_t b = engine->open();
    ASSERT_EQ(engine->reuse_prefix(b, prompt), 32) << (a_open ? "shared with an open sequence" : "after it closed");
    EXPECT_EQ(engine->length(b), 32);
    Tensor got;
    const std::vector<int32_t> rest(prompt.begin() + 32, prompt.end());
    const int32_t next = engine->prefill(b, rest, SamplingParams{}, &got);
    double diff = 0, scale = 0;
    std::vector<float> sorted(want.data<float>(), want.data<float>() + vocab);
    for (int64_t v = 0; v < vocab; ++v) {
      diff = std::max(diff, std::fabs(static_cast<double>(got.data<float>()[v]) - want.data<float>()[v]));
      scale = std::max(scale, std::fabs(static_cast<double>(want.data<float>()[v])));
    }
    EXPECT_LE(diff, logit_bound(scale));
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
    if (sorted[0] - sorted[1] > 3 * diff) {
      EXPECT_EQ(next, want_next);
    }
    engine->close(b);
  }
  EXPECT_EQ(engine->memory().kv_blocks_free, free_before) << "blocks left referenced";
  // A sequence that already holds tokens cannot take a prefix.
  const int32_t c = engine->open();
  engine->prefill(c, head, SamplingParams{});
  EXPECT_THROW(engine->reuse_prefix(c, prompt), Error);
}

}  // namespace
}  // namespace moe
