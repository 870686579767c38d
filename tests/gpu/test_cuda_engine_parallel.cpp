// The engine on several GPUs (EngineOptions tp, ep and dp) against the same engine on one GPU, on
// the transformers fixtures: logits within the bf16 bound, the same greedy tokens wherever the
// one-GPU run decides clearly, graph replay equal to eager decode and a batch equal to its
// sequences alone. The split settings it cannot run are refused before any GPU is touched (those
// tests run everywhere). GPU tests skip, visibly, with fewer GPUs than they need.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <tuple>

#include <nlohmann/json.hpp>

#include "backend/cuda_engine.h"
#include "gpu_test_util.h"
#include "../support/engine_decode.h"
#include "../support/fixtures.h"
#include "../unit/test_util.h"
#include "model/config.h"
#include "moe/errors.h"

namespace moe {
namespace {

using test::fixture_dir;
using test::reference;

using gputest::gpu_count;

// Attention splits over the GPUs (grouped-query and latent alike) unless a q/k norm spans every
// head: those run tp 1, ep n.
int tp_for(const std::string& dir, int n) {
  const ModelConfig mc = load_model_config(dir);
  return mc.qk_norm == QkNorm::kFull ? 1 : n;
}

std::unique_ptr<cuda::Engine> load(const std::string& dir, int tp, int ep, bool graphs = true, bool fuse = true,
                                   dist::EpBackend backend = dist::EpBackend::kLocalAllreduce, int dp = 1) {
  cuda::EngineOptions o;
  o.ep_backend = backend;
  o.dp = dp;
  o.fuse = fuse;
  o.record_routing = true;
  o.max_batch = 4;
  o.max_context = std::min<int64_t>(128, load_model_config(dir).max_position_embeddings);
  o.graphs = graphs;
  o.tp = tp;
  o.ep = ep;
  return cuda::Engine::load(dir, o);
}

// The one-GPU engine's bound against transformers (test_cuda_engine.cpp) covers two bf16 runs
// that round differently: 4% of the largest logit magnitude, at least 2e-3. FP8 weights under
// tp or on four GPUs take its FP8 bound, 10%: there one GPU and several run them through
// different paths, each within that bound of the reference: under tp the attention projections
// cut from bf16 copies (shares that are not whole blocks) where one GPU runs them W8A8 (qwen3_moe_fp8
// on two H100s: 0.170 against a bound of 0.113), and on four GPUs the experts' GEMV (bf16
// activations) or W8A8 GEMM (activations rounded to E4M3) by the rows an exchange hands them,
// which count the other groups' padding rows. FP8 with whole attention on two GPUs keeps the
// bf16 bound.
double logit_bound(double scale, bool fp8 = false) { return std::max((fp8 ? 0.10 : 0.04) * scale, 2e-3); }

// With `hold` > 0, that many sequences are opened first and kept open meanwhile: under dp they
// take the first attention groups, and the forced sequence lands in group `hold`.
Tensor forced_logits(cuda::Engine& e, const std::vector<int32_t>& sequence, std::vector<int32_t>* routing,
                     int hold = 0) {
  std::vector<int32_t> held;
  for (int i = 0; i < hold; ++i) held.push_back(e.open());
  Tensor logits;
  const int32_t s = e.open();
  EXPECT_EQ(e.group_of(s), e.limits().groups > 1 ? hold : 0);
  e.prefill(s, sequence, SamplingParams{}, &logits, true);
  e.close(s);
  for (int32_t h : held) e.close(h);
  if (routing) *routing = e.last_routing();
  return logits;
}

// Rows before the first routing decision where the two runs chose differently (a bf16 near-tie:
// the GPUs round partial sums separately) must agree within the bound; greedy tokens must agree
// for every step the one-GPU run decides clearly (top-1 gap over 3x the logit difference).
// Under dp (data-parallel attention, dp groups of n / dp GPUs that split the heads) the sequence
// runs in group 0 while the others pad, and once more in the last group, within the same bound.
void expect_one_gpu_answers(const std::string& name, int n, dist::EpBackend backend, int dp = 1) {
  const std::string dir = fixture_dir(name);
  const int tp = dp > 1 ? n / dp : tp_for(dir, n);
  const char* via = dist::ep_backend_name(backend);
  auto one = load(dir, 1, 1);
  auto many = load(dir, tp, n, true, true, backend, dp);
  // Folding the residual adds and norms into the all-reduces changes only f32 summation order.
  auto unfused = load(dir, tp, n, true, false, backend, dp);
  const ModelConfig& mc = one->config();
  const int64_t vocab = mc.vocab_size, k = std::max<int64_t>(mc.moe.top_k, 1);
  const bool fp8 = mc.quant.fp8 && (tp > 1 || n >= 4);  // the FP8 bound (above)
  auto ref = reference(dir);
  size_t compared = 0, rows_checked = 0;
  bool all_equal = true;
  for (size_t i = 0; i < ref["inputs"].size(); ++i) {
    const auto [ids, expected, sequence] = test::greedy_case(ref, i);
    const int64_t rows = static_cast<int64_t>(sequence.size());
    std::vector<int32_t> route1, routen;
    const Tensor l1 = forced_logits(*one, sequence, &route1);
    const Tensor ln = forced_logits(*many, sequence, &routen);
    ASSERT_EQ(route1.size(), routen.size());
    std::vector<int32_t> route_unfused;
    const Tensor lu = forced_logits(*unfused, sequence, &route_unfused);
    if (route_unfused == routen) {
      double d = 0, scale = 0;
      for (int64_t j = 0; j < rows * vocab; ++j) {
        d = std::max(d, std::fabs(static_cast<double>(lu.data<float>()[j]) - ln.data<float>()[j]));
        scale = std::max(scale, std::fabs(static_cast<double>(ln.data<float>()[j])));
      }
      EXPECT_LE(d, logit_bound(scale)) << name << ": folded and separate kernels disagree, input " << i;
    }
    int64_t diverged = rows;
    for (int64_t l = 0; l < mc.num_layers; ++l)
      for (int64_t t = 0; t < rows; ++t)
        if (!std::equal(route1.begin() + (l * rows + t) * k, route1.begin() + (l * rows + t + 1) * k,
                        routen.begin() + (l * rows + t) * k))
          diverged = std::min(diverged, t);
    std::vector<double> diff(static_cast<size_t>(rows), 0.0);
    for (int64_t t = 0; t < rows; ++t) {
      const float* a = l1.data<float>() + t * vocab;
      const float* b = ln.data<float>() + t * vocab;
      double scale = 0;
      for (int64_t v = 0; v < vocab; ++v) {
        ASSERT_TRUE(std::isfinite(b[v])) << name << " row " << t;
        diff[static_cast<size_t>(t)] = std::max(diff[static_cast<size_t>(t)], std::fabs(static_cast<double>(a[v]) - b[v]));
        scale = std::max(scale, std::fabs(static_cast<double>(a[v])));
      }
      if (t >= diverged) continue;
      ++rows_checked;
      EXPECT_LE(diff[static_cast<size_t>(t)], logit_bound(scale, fp8)) << name << " on " << n << " GPUs, input " << i << " row " << t;
    }
    if (dp > 1) {
      const Tensor last = forced_logits(*many, sequence, nullptr, dp - 1);
      for (int64_t t = 0; t < diverged; ++t) {
        double d = 0, scale = 0;
        for (int64_t v = 0; v < vocab; ++v) {
          const double a = l1.data<float>()[t * vocab + v], b = last.data<float>()[t * vocab + v];
          d = std::max(d, std::fabs(a - b));
          scale = std::max(scale, std::fabs(a));
        }
        EXPECT_LE(d, logit_bound(scale, fp8)) << name << " dp " << dp << ", in the last group, input " << i << " row " << t;
      }
    }
    const auto got1 = test::greedy_tokens(*one, ids, expected.size());
    const auto gotn = test::greedy_tokens(*many, ids, expected.size());
    size_t clear = 0;
    for (size_t step = 0; step < expected.size(); ++step) {
      const int64_t pos = static_cast<int64_t>(ids.size() - 1 + step);
      if (pos >= diverged || got1[step] != expected[step]) break;  // past the forced path
      const float* a = l1.data<float>() + pos * vocab;
      std::vector<float> sorted(a, a + vocab);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      // FP8: a decode step may take another path than the forced pass (logit_bound), so a step
      // is clear only by the bound's margin more.
      double margin = 3 * diff[static_cast<size_t>(pos)];
      if (fp8) margin += logit_bound(std::max(std::fabs(sorted[0]), std::fabs(*std::min_element(a, a + vocab))), true);
      if (sorted[0] - sorted[1] <= margin) break;
      EXPECT_EQ(gotn[step], got1[step]) << name << " on " << n << " GPUs, input " << i << " step " << step;
      ++clear;
    }
    std::printf("[ %s, tp %d ep %d dp %d %s, input %zu ] %zu of %zu greedy steps decided clearly; tokens: %s\n",
                name.c_str(), tp, n, dp, via, i, clear, expected.size(),
                gotn == got1 ? "all equal to one GPU" : "differ later");
    compared += clear;
    all_equal = all_equal && gotn == got1;
  }
  EXPECT_GT(rows_checked, 0u) << name << ": routing diverged at the first row of every input";
  EXPECT_TRUE(compared > 0 || all_equal) << name << ": no step was decided clearly and the tokens differ";
}

// The same kernels and exchanges whether replayed from graphs or run eagerly, and whatever the
// batch: identical tokens.
// Under dp the three prompts spread over the attention groups as evenly as they can (two in
// group 0 and one in group 1 of two), so steps pad; alone, each sequence's group runs it while
// the others pad.
void expect_graph_equals_eager_and_batch_equals_alone(const std::string& name, int n, dist::EpBackend backend,
                                                      int dp = 1) {
  const std::string dir = fixture_dir(name);
  const int tp = dp > 1 ? n / dp : tp_for(dir, n);
  std::vector<std::vector<int32_t>> prompts{{5, 9, 1}, {7}, {3, 2, 8, 8, 4, 6, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}};
  auto run = [&](bool graphs, bool together) {
    auto engine = load(dir, tp, n, graphs, true, backend, dp);
    std::vector<int32_t> seqs;
    auto out = test::greedy_prompts(*engine, prompts, 12, together, &seqs);
    if (dp > 1) {
      std::vector<int> on(static_cast<size_t>(dp), 0);
      for (int32_t s : seqs) on[static_cast<size_t>(engine->group_of(s))] += 1;
      EXPECT_LE(*std::max_element(on.begin(), on.end()) - *std::min_element(on.begin(), on.end()), 1)
          << "the sequences are not spread evenly over the groups";
      EXPECT_EQ(on[0], 1 + (dp == 2 ? 1 : 0)) << "the first group takes the first sequence and, of two, the third";
    }
    for (int32_t s : seqs) engine->close(s);
    const cuda::MemoryReport m = engine->memory();
    EXPECT_GT(m.weights, 0u);
    EXPECT_EQ(m.kv_blocks_free, m.kv_blocks - dp) << "blocks left behind after closing every sequence";
    return out;
  };
  const char* via = dist::ep_backend_name(backend);
  const auto graph_batch = run(true, true);
  EXPECT_EQ(graph_batch, run(false, true)) << name << " " << via << ": graph replay differs from eager decode";
  if (load_model_config(dir).quant.fp8) {
    // FP8 experts take the GEMV (bf16 activations) or the W8A8 GEMM (activations rounded to
    // E4M3) by the rows a step routes to a rank's experts, so a batch and its sequences alone
    // round differently, by a few percent, enough to flip a greedy token: not compared until
    // both paths quantise the activations alike.
    std::printf("[ %s %s ] FP8: a batch against its sequences alone not compared (GEMV and W8A8 paths differ)\n",
                name.c_str(), via);
    return;
  }
  EXPECT_EQ(graph_batch, run(true, false)) << name << " " << via << ": a batch differs from its sequences decoded alone";
}

class CudaEngineParallel : public ::testing::TestWithParam<std::tuple<std::string, int>> {};

TEST_P(CudaEngineParallel, LogitsAndGreedyTokensMatchOneGpu) {
  const auto& [name, n] = GetParam();
  REQUIRE_PEER_GPUS(n);
  expect_one_gpu_answers(name, n, dist::EpBackend::kLocalAllreduce);
}

TEST_P(CudaEngineParallel, GraphDecodeEqualsEagerAndBatchEqualsAlone) {
  const auto& [name, n] = GetParam();
  REQUIRE_PEER_GPUS(n);
  expect_graph_equals_eager_and_batch_equals_alone(name, n, dist::EpBackend::kLocalAllreduce);
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, CudaEngineParallel,
    ::testing::Combine(::testing::Values("qwen3_moe_f32", "qwen3_moe_bf16", "mixtral_f32", "mixtral_f16_sharded",
                                         "qwen2_moe_f32", "olmoe_f32", "deepseek_v2_f32", "deepseek_v3_f32",
                                         "qwen3_moe_yarn_f32", "deepseek_v3_yarn_mtp_legacy_bf16", "qwen3_moe_fp8",
                                         "deepseek_v3_fp8"),
                       ::testing::Values(2, 4)),
    [](const auto& info) { return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) + "gpus"; });

// The exchanging EP backends in the engine: each moves rows between the GPUs its own way and
// must give the one-GPU answers. Fixtures of every feed-forward kind: plain routed experts
// (split attention, or whole under a full q/k norm), a gated shared expert, latent attention
// with a biased router and a shared expert.
class CudaEngineEpBackends : public ::testing::TestWithParam<std::tuple<std::string, int, dist::EpBackend>> {};

TEST_P(CudaEngineEpBackends, LogitsAndGreedyTokensMatchOneGpu) {
  const auto& [name, n, backend] = GetParam();
  REQUIRE_PEER_GPUS(n);
  expect_one_gpu_answers(name, n, backend);
}

TEST_P(CudaEngineEpBackends, GraphDecodeEqualsEagerAndBatchEqualsAlone) {
  const auto& [name, n, backend] = GetParam();
  REQUIRE_PEER_GPUS(n);
  expect_graph_equals_eager_and_batch_equals_alone(name, n, backend);
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, CudaEngineEpBackends,
    ::testing::Combine(::testing::Values("qwen3_moe_bf16", "mixtral_f32", "qwen2_moe_f32", "olmoe_f32", "deepseek_v3_f32",
                                         "deepseek_v3_fp8"),
                       ::testing::Values(2, 4),
                       ::testing::Values(dist::EpBackend::kAllgatherReducescatter, dist::EpBackend::kAlltoallPadded,
                                         dist::EpBackend::kAlltoallPacked, dist::EpBackend::kP2p)),
    [](const auto& info) {
      return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) + "gpus_" +
             dist::ep_backend_name(std::get<2>(info.param));
    });

// Data-parallel attention (--dp N --ep N): each GPU runs attention for its own sequences and the
// experts exchange each GPU's own rows. The one-GPU answers on rank 0 and on the last rank, the
// graph and batch checks with uneven ranks, and a step of prefills on every rank at once (in
// lockstep chunks of uneven length) equal to each prefill run alone.
class CudaEngineDataParallel : public ::testing::TestWithParam<std::tuple<std::string, int, dist::EpBackend>> {};

TEST_P(CudaEngineDataParallel, LogitsAndGreedyTokensMatchOneGpu) {
  const auto& [name, n, backend] = GetParam();
  REQUIRE_PEER_GPUS(n);
  expect_one_gpu_answers(name, n, backend, n);
}

TEST_P(CudaEngineDataParallel, GraphDecodeEqualsEagerAndBatchEqualsAlone) {
  const auto& [name, n, backend] = GetParam();
  REQUIRE_PEER_GPUS(n);
  expect_graph_equals_eager_and_batch_equals_alone(name, n, backend, n);
}

// A step of prefills in every attention group at once (in lockstep chunks of uneven length, and
// under tp > 1 rounded up to a multiple of tp rows), then one decode step of them all, equal to
// each prompt run alone.
void expect_lockstep_prefills_equal_alone(const std::string& name, int n, dist::EpBackend backend, int dp) {
  const std::string dir = fixture_dir(name);
  cuda::EngineOptions o;
  o.ep_backend = backend;
  o.ep = n;
  o.dp = dp;
  o.tp = n / dp;
  o.max_batch = 4;
  o.max_step_tokens = 8;  // prompts of up to 26 tokens take up to 4 chunks, of different lengths per rank
  o.max_context = 64;
  auto engine = cuda::Engine::load(dir, o);
  const std::vector<std::vector<int32_t>> prompts{
      {3, 2, 8, 8, 4, 6, 1, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, {7, 1, 9}, {4, 4, 2, 9, 8, 1, 3, 5, 7, 9, 2, 4, 6,
                                                                       8, 1, 3, 5, 7, 9, 2, 4, 6, 8, 1, 3, 5},
      {6, 5, 4, 3, 2, 1, 9, 8, 7}, {11}};
  std::vector<int32_t> seqs;
  runtime::StepPlan plan;
  for (const auto& p : prompts) {
    seqs.push_back(engine->open());
    runtime::StepRow row;
    row.seq = seqs.back();
    row.offset = static_cast<int32_t>(plan.tokens.size());
    row.count = static_cast<int32_t>(p.size());
    row.sample = true;
    plan.tokens.insert(plan.tokens.end(), p.begin(), p.end());
    plan.rows.push_back(row);
  }
  std::vector<int32_t> together = engine->run(plan).tokens;
  runtime::StepPlan next;  // then one decode step of them all
  for (size_t i = 0; i < seqs.size(); ++i) {
    runtime::StepRow row;
    row.seq = seqs[i];
    row.offset = static_cast<int32_t>(i);
    row.count = 1;
    row.sample = true;
    row.draw = 1;
    next.tokens.push_back(together[i]);
    next.rows.push_back(row);
  }
  const std::vector<int32_t> decoded = engine->run(next).tokens;
  together.insert(together.end(), decoded.begin(), decoded.end());
  for (int32_t s : seqs) engine->close(s);
  std::vector<int32_t> alone(2 * prompts.size());
  for (size_t i = 0; i < prompts.size(); ++i) {
    const int32_t s = engine->open();
    alone[i] = engine->prefill(s, prompts[i], SamplingParams{});
    std::vector<SamplingParams> g(1);
    alone[prompts.size() + i] = engine->decode(std::vector<int32_t>{s}, std::vector<int32_t>{alone[i]}, g)[0];
    engine->close(s);
  }
  EXPECT_EQ(together, alone) << name << " dp " << dp << " tp " << o.tp << " " << dist::ep_backend_name(backend);
  const cuda::MemoryReport total = engine->memory();
  EXPECT_EQ(total.kv_blocks_free, total.kv_blocks - dp);
  // Each GPU's own bytes: a part of the weights, and an equal share of the cache (every GPU's
  // pools have the same blocks of the same width).
  const std::vector<cuda::MemoryReport> per_gpu = engine->memory_per_gpu();
  ASSERT_EQ(per_gpu.size(), static_cast<size_t>(n));
  for (const cuda::MemoryReport& g : per_gpu) {
    EXPECT_GT(g.weights, 0u);
    EXPECT_LT(g.weights, total.weights);
    EXPECT_EQ(g.kv_cache * static_cast<size_t>(n), total.kv_cache);
    EXPECT_EQ(g.kv_blocks * dp, total.kv_blocks);
  }
}

TEST_P(CudaEngineDataParallel, PrefillsOfEveryRankInOneStepEqualEachAlone) {
  const auto& [name, n, backend] = GetParam();
  REQUIRE_PEER_GPUS(n);
  expect_lockstep_prefills_equal_alone(name, n, backend, n);
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, CudaEngineDataParallel,
    ::testing::Combine(::testing::Values("qwen3_moe_bf16", "qwen2_moe_f32", "deepseek_v3_f32", "qwen3_moe_fp8"),
                       ::testing::Values(2, 4),
                       ::testing::Values(dist::EpBackend::kAllgatherReducescatter, dist::EpBackend::kAlltoallPadded,
                                         dist::EpBackend::kAlltoallPacked, dist::EpBackend::kP2p)),
    [](const auto& info) {
      return std::get<0>(info.param) + "_" + std::to_string(std::get<1>(info.param)) + "gpus_dp_" +
             dist::ep_backend_name(std::get<2>(info.param));
    });

// Data-parallel attention groups of two GPUs each on four (--dp 2 --tp 2 --ep 4): each group
// splits its heads over its GPUs, and each GPU exchanges half of its group's rows with the
// experts of all four. Fixtures of grouped-query attention (q/k norm per head), a shared
// expert, latent attention, and FP8 weights.
class CudaEngineDataParallelGroups : public ::testing::TestWithParam<std::tuple<std::string, dist::EpBackend>> {};

TEST_P(CudaEngineDataParallelGroups, LogitsAndGreedyTokensMatchOneGpu) {
  const auto& [name, backend] = GetParam();
  REQUIRE_PEER_GPUS(4);
  expect_one_gpu_answers(name, 4, backend, 2);
}

TEST_P(CudaEngineDataParallelGroups, GraphDecodeEqualsEagerAndBatchEqualsAlone) {
  const auto& [name, backend] = GetParam();
  REQUIRE_PEER_GPUS(4);
  expect_graph_equals_eager_and_batch_equals_alone(name, 4, backend, 2);
}

TEST_P(CudaEngineDataParallelGroups, PrefillsOfEveryGroupInOneStepEqualEachAlone) {
  const auto& [name, backend] = GetParam();
  REQUIRE_PEER_GPUS(4);
  expect_lockstep_prefills_equal_alone(name, 4, backend, 2);
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, CudaEngineDataParallelGroups,
    ::testing::Combine(::testing::Values("qwen3_moe_bf16", "qwen2_moe_f32", "deepseek_v3_f32", "qwen3_moe_fp8"),
                       ::testing::Values(dist::EpBackend::kAllgatherReducescatter, dist::EpBackend::kAlltoallPadded,
                                         dist::EpBackend::kAlltoallPacked, dist::EpBackend::kP2p)),
    [](const auto& info) {
      return std::get<0>(info.param) + "_4gpus_dp2_tp2_" + dist::ep_backend_name(std::get<1>(info.param));
    });

// Refused with a one-line reason before any weight is read or any GPU is needed.
TEST(CudaEngineParallel, RefusesSplitsItCannotRun) {
  EXPECT_EQ(test::error_kind_of([] { cuda::engine_ranks(2, 1); }), ErrorKind::kUnsupported) << "tp without ep";
  EXPECT_EQ(test::error_kind_of([] { cuda::engine_ranks(2, 4); }), ErrorKind::kUnsupported) << "tp neither 1 nor ep";
  EXPECT_EQ(test::error_kind_of([] { cuda::engine_ranks(0, 1); }), ErrorKind::kInvalidArgument);
  EXPECT_EQ(cuda::engine_ranks(1, 3), 3);
  std::string why;
  EXPECT_EQ(test::error_kind_of([] { cuda::engine_ep_backend("fastest"); }, &why), ErrorKind::kConfig);
  EXPECT_NE(why.find("valid names: local_allreduce, allgather_reducescatter"), std::string::npos) << why;
  EXPECT_EQ(test::error_kind_of([] { cuda::engine_ep_backend("deepep"); }, &why), ErrorKind::kUnsupported);
  EXPECT_EQ(cuda::engine_ep_backend("alltoall_packed"), dist::EpBackend::kAlltoallPacked);
  using dist::EpBackend;
  EXPECT_EQ(test::error_kind_of([] { cuda::check_engine_dp(2, 2, 2, EpBackend::kP2p); }, &why),
            ErrorKind::kInvalidArgument);
  EXPECT_NE(why.find("dp × tp must equal the GPUs"), std::string::npos) << why;
  EXPECT_EQ(test::error_kind_of([] { cuda::check_engine_dp(2, 1, 4, EpBackend::kP2p); }, &why),
            ErrorKind::kInvalidArgument);
  EXPECT_NE(why.find("dp × tp must equal the GPUs"), std::string::npos) << why;
  EXPECT_EQ(test::error_kind_of([] { cuda::engine_ranks(2, 4, 3); }, &why), ErrorKind::kInvalidArgument);
  EXPECT_NE(why.find("(--dp 3 --tp 2 --ep 6)"), std::string::npos) << why;
  EXPECT_EQ(cuda::engine_ranks(2, 4, 2), 4) << "two attention groups of two GPUs";
  cuda::check_engine_dp(2, 2, 4, EpBackend::kP2p);
  cuda::check_engine_dp(4, 2, 8, EpBackend::kAllgatherReducescatter);
  EXPECT_EQ(test::error_kind_of([] { cuda::check_engine_dp(2, 1, 2, EpBackend::kLocalAllreduce); }, &why),
            ErrorKind::kInvalidArgument);
  EXPECT_NE(why.find("allgather_reducescatter, alltoall_padded, alltoall_packed or p2p"), std::string::npos) << why;
  EXPECT_EQ(test::error_kind_of([] { cuda::check_engine_dp(0, 1, 1, EpBackend::kP2p); }), ErrorKind::kInvalidArgument);
  cuda::check_engine_dp(1, 2, 2, EpBackend::kLocalAllreduce);  // no dp: nothing to check
  cuda::check_engine_dp(4, 1, 4, EpBackend::kAlltoallPacked);
  EXPECT_EQ(test::error_kind_of([] { load(fixture_dir("qwen3_moe_f32"), 1, 2, true, true, EpBackend::kLocalAllreduce, 2); }, &why),
            ErrorKind::kInvalidArgument)
      << "dp through an all-reduce, refused by the engine before any GPU is needed";
  EXPECT_EQ(test::error_kind_of([] { load(fixture_dir("qwen3_moe_f32"), 1, 1, true, true, dist::EpBackend::kP2p); }, &why),
            ErrorKind::kInvalidArgument)
      << "an exchange on one GPU";
  EXPECT_NE(why.find("needs --ep 2 or more"), std::string::npos) << why;
  EXPECT_EQ(test::error_kind_of([] { load(fixture_dir("deepseek_v2_f32"), 3, 3); }, &why), ErrorKind::kUnsupported)
      << "4 latent-attention heads over 3 GPUs";
  EXPECT_NE(why.find("do not split"), std::string::npos) << why;
  EXPECT_EQ(test::error_kind_of([] { load(fixture_dir("olmoe_f32"), 2, 2); }, &why), ErrorKind::kUnsupported);
  EXPECT_NE(why.find("q/k norm"), std::string::npos) << why;
  EXPECT_EQ(test::error_kind_of([] { load(fixture_dir("qwen3_moe_f32"), 3, 3); }, &why), ErrorKind::kUnsupported);
  EXPECT_NE(why.find("do not split"), std::string::npos) << why;
  EXPECT_EQ(test::error_kind_of([] { load(fixture_dir("qwen3_moe_f32"), 1, 9); }, &why), ErrorKind::kInvalidArgument)
      << "9 ranks for 8 experts";
  EXPECT_EQ(test::error_kind_of([] { load(fixture_dir("qwen3_dense_f32"), 1, 2); }, &why), ErrorKind::kInvalidArgument)
      << "expert parallelism without experts";
  const int too_many = std::clamp(gpu_count() + 1, 2, 16);
  if (gpu_count() < 16) {
    EXPECT_EQ(test::error_kind_of([&] { load(fixture_dir("qwen3_moe_bf16"), 1, too_many); }, &why), ErrorKind::kUnsupported);
    EXPECT_NE(why.find("GPUs"), std::string::npos) << why;
  }
}

}  // namespace
}  // namespace moe
