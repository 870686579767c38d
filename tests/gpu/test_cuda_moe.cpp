// The CUDA routed experts (GEMV path, mma.sync grouped GEMM path, and the Hopper wgmma + TMA
// grouped GEMM path where the device is sm_90) against the CPU reference
// (run_experts) on random data: ragged loads, experts with no tokens, every token on one expert,
// the qwen3-30b-a3b and deepseek-v2-lite shapes from decode to prefill sizes, outputs poisoned
// first. Skipped, visibly, where no CUDA device exists.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>

#include "backend/cuda/moe/moe_heuristics.h"
#include "backend/cuda_moe.h"
#include "gpu_test_util.h"
#include "moe/errors.h"
#include "moe/experts.h"

namespace moe {
namespace {

using cuda::ExpertPath;
using gputest::DeviceBuffer;

// bf16 weights, activations, act (SiLU * up) and output, f32 accumulation: the relative
// Frobenius error against the f32 CPU reference is a few 1e-3 (measured on an H200 on the qwen3
// and deepseek-v2-lite shapes: GEMV path 2.3e-3, GEMM path 2.9e-3, which also rounds its per-slot
// partial sums to bf16); 1e-2 is the bound. The wgmma path rounds the same intermediates as the
// GEMM path (bf16 act, bf16 partial sums), only its f32 summation order differs: same bound.
constexpr double kBound = 1e-2;

// The wgmma path's code is sm_90a: it runs on compute capability 9.0 only.
using gputest::device_is_sm90;

// k distinct experts per token, ascending (the router's contract), drawn with weight
// skew^e so that loads are ragged and, for skew < 1, the last experts get few or no tokens.
std::vector<int32_t> route(int64_t experts, int64_t tokens, int64_t k, double skew, std::mt19937& rng) {
  std::vector<double> p(static_cast<size_t>(experts));
  for (size_t e = 0; e < p.size(); ++e) p[e] = std::pow(skew, static_cast<double>(e));
  std::vector<int32_t> ids;
  for (int64_t t = 0; t < tokens; ++t) {
    const std::vector<int32_t> pick = gputest::draw_experts(p, k, rng);
    ids.insert(ids.end(), pick.begin(), pick.end());
  }
  return ids;
}

struct Layer {
  ExpertWeights w;
  DeviceBuffer<uint16_t> gate_up, down;
};

// Weights: uniform, bf16-exact (fill_uniform_bf16: a normal draw per element takes ~15 s for the
// 600M weights of a qwen3 layer; this takes about one).
ExpertWeights make_weights(int64_t experts, int64_t hidden, int64_t inter, std::mt19937& rng) {
  ExpertWeights w = zero_experts(experts, hidden, inter);
  fill_uniform_bf16(w.gate_up, rng(), 0.08f);
  fill_uniform_bf16(w.down, rng(), 0.08f);
  return w;
}

std::vector<uint16_t> bf16_bits(const Tensor& t) {
  return gputest::to_bf16(std::vector<float>(t.data<float>(), t.data<float>() + t.numel()));
}

// The engine's case: bf16 weights already on the device, owned by the caller.
Layer make_layer(int64_t experts, int64_t hidden, int64_t inter, std::mt19937& rng) {
  ExpertWeights w = make_weights(experts, hidden, inter, rng);
  const auto gate_up = bf16_bits(w.gate_up), down = bf16_bits(w.down);
  return Layer{std::move(w), DeviceBuffer<uint16_t>(gate_up), DeviceBuffer<uint16_t>(down)};
}

// The CPU reference: run_experts (naive) of x's rows, local_of mapping expert ids to the layer's
// experts (-1: left out).
Tensor cpu_experts(const ExpertWeights& w, const std::vector<int32_t>& local_of, const Tensor& x, const int32_t* ids,
                   const float* weights, int64_t k) {
  ThreadPool pool(0);
  Arena arena("ws", 1 << 20);
  ExpertPlan plan;
  Tensor out = Tensor::zeros({x.dim(0), w.hidden});
  run_experts(ExecMode::kNaive, pool, arena, w, local_of, x, ids, weights, k, out, plan);
  return out;
}

struct GpuRun {
  std::vector<float> y;  // [tokens, hidden], from the GPU
  double rel = INFINITY; // relative Frobenius error on the checked rows against the CPU
};

// Runs the layer on the GPU through the non-owning core with a caller-owned workspace, then
// checks every row for poison (NaN) and up to 128 rows spread over all tokens against
// run_experts (the reference's cost is what limits the rows; each row depends only on its token).
// With `skip`, the slots whose expert it marks go to the GPU as -1 (left out) and the reference
// leaves them out the same way (run_experts' -1 in its local-index map).
GpuRun run(const Layer& l, int64_t tokens, int64_t k, const std::vector<int32_t>& ids,
        ExpertPath path, std::mt19937& rng, const std::vector<bool>* skip = nullptr) {
  const int64_t hidden = l.w.hidden;
  const cuda::ExpertShape shape{l.w.num_local, hidden, l.w.inter, k};
  cuda::Experts gpu(l.gate_up.get(), l.down.get(), shape, tokens);
  DeviceBuffer<unsigned char> ws(cuda::Experts::workspace_bytes(shape, tokens));
  ws.poison();
  const auto x = gputest::random_bf16_exact(static_cast<size_t>(tokens * hidden), rng, 1.0f);
  std::vector<float> weights(ids.size());
  for (auto& v : weights) v = std::uniform_real_distribution<float>(0.1f, 1.0f)(rng);
  DeviceBuffer<uint16_t> dx(gputest::to_bf16(x)), dy(static_cast<size_t>(tokens * hidden));
  std::vector<int32_t> gpu_ids = ids;
  if (skip)
    for (auto& id : gpu_ids)
      if ((*skip)[static_cast<size_t>(id)]) id = -1;
  DeviceBuffer<int32_t> dids(gpu_ids);
  DeviceBuffer<float> dw(weights);
  dy.poison();
  gpu.forward(dx.get(), dids.get(), dw.get(), tokens, dy.get(), ws.get(), nullptr, path);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  GpuRun r;
  r.y = gputest::from_bf16(dy.download());

  const int64_t stride = std::max<int64_t>(1, (tokens + 127) / 128);
  std::vector<int64_t> rows;
  for (int64_t t = 0; t < tokens; t += stride) rows.push_back(t);
  if (rows.back() != tokens - 1) rows.push_back(tokens - 1);
  const int64_t n = static_cast<int64_t>(rows.size());
  const TokenSample sample = sample_tokens(rows, hidden, k, ids, weights, [&](int64_t t, float* row) {
    std::copy_n(x.begin() + t * hidden, hidden, row);
  });
  std::vector<int32_t> all(static_cast<size_t>(l.w.num_local));
  for (size_t e = 0; e < all.size(); ++e) all[e] = skip && (*skip)[e] ? -1 : static_cast<int32_t>(e);
  const Tensor ref = cpu_experts(l.w, all, sample.x, sample.ids.data(), sample.weights.data(), k);
  for (float v : r.y)
    if (!std::isfinite(v)) return r;  // an unwritten (poisoned) or broken element: rel stays inf
  double num = 0, den = 0;
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < hidden; ++h) {
      const double got = r.y[static_cast<size_t>(rows[static_cast<size_t>(i)] * hidden + h)];
      const double want = ref.data<float>()[i * hidden + h];
      num += (got - want) * (got - want);
      den += want * want;
    }
  // Every slot of every checked row left out: the reference is zero and so must the output be.
  r.rel = den > 0 ? std::sqrt(num / den) : (num == 0 ? 0.0 : INFINITY);
  return r;
}

// One path on one routing: every row checked for poison, sampled rows against the CPU.
void check_path(const Layer& l, int64_t tokens, int64_t k, const std::vector<int32_t>& ids, ExpertPath p,
                std::mt19937& rng) {
  EXPECT_LE(run(l, tokens, k, ids, p, rng).rel, kBound)
      << "path " << static_cast<int>(p) << ", M=" << tokens << ", E=" << l.w.num_local << ", H=" << l.w.hidden
      << ", I=" << l.w.inter << ", k=" << k;
}

// Each path the shape allows (the GEMV one up to 256 tokens, the wgmma one on sm_90), and the
// automatic choice.
void check_all_paths(const Layer& l, int64_t tokens, int64_t k, const std::vector<int32_t>& ids,
                     uint32_t seed) {
  std::mt19937 rng(seed);
  const cuda::ExpertShape shape{l.w.num_local, l.w.hidden, l.w.inter, k};
  for (ExpertPath p : {ExpertPath::kAuto, ExpertPath::kGemv, ExpertPath::kGemm, ExpertPath::kWgmma}) {
    if (!cuda::experts_support(shape, p)) continue;
    if (p == ExpertPath::kWgmma && !device_is_sm90()) continue;
    if (p == ExpertPath::kGemv && cuda::experts_support(shape, ExpertPath::kGemm) && tokens > 256) continue;
    check_path(l, tokens, k, ids, p, rng);
  }
}

void check_all_paths(int64_t experts, int64_t hidden, int64_t inter, int64_t tokens, int64_t k,
                     const std::vector<int32_t>& ids, uint32_t seed) {
  std::mt19937 rng(seed + 1000);
  check_all_paths(make_layer(experts, hidden, inter, rng), tokens, k, ids, seed);
}

TEST(CudaMoe, RaggedRandomRouting) {
  REQUIRE_GPU();
  std::mt19937 rng(3);
  check_all_paths(10, 256, 128, 7, 3, route(10, 7, 3, 1.0, rng), 1);
}

// Slots of experts another rank holds come in as -1 (expert parallelism): they add nothing, on
// every path, including tokens whose slots are all left out (their rows must come out zero, not
// poison) and the all-left-out batch.
TEST(CudaMoe, SkippedSlotsAddNothingOnEveryPath) {
  REQUIRE_GPU();
  std::mt19937 rng(31);
  const Layer l = make_layer(16, 256, 128, rng);
  for (int64_t tokens : {1, 3, 40, 300}) {
    const auto ids = route(16, tokens, 4, 0.8, rng);
    for (int variant = 0; variant < 3; ++variant) {
      std::vector<bool> skip(16);
      for (size_t e = 0; e < skip.size(); ++e)
        skip[e] = variant == 0 ? e >= 8 : variant == 1 ? e % 3 != 0 : true;
      for (ExpertPath p : {ExpertPath::kGemv, ExpertPath::kGemm, ExpertPath::kWgmma}) {
        if (!cuda::experts_support({16, 256, 128, 4}, p)) continue;
        if (p == ExpertPath::kWgmma && !device_is_sm90()) continue;
        if (p == ExpertPath::kGemv && tokens > 256) continue;
        const GpuRun r = run(l, tokens, 4, ids, p, rng, &skip);
        if (variant == 2) {  // nothing local: exactly zero
          bool zero = true;
          for (float v : r.y) zero = zero && v == 0.0f;
          EXPECT_TRUE(zero) << "path " << static_cast<int>(p) << ", M=" << tokens;
          continue;
        }
        EXPECT_LE(r.rel, kBound) << "path " << static_cast<int>(p) << ", M=" << tokens
                                 << ", variant " << variant;
      }
    }
  }
}

// A rank may hold fewer experts than top-k (mixtral's 8 experts on 4 GPUs: 2 each, top-2; here
// 2 held of 8, top-4): a token has 0, 1 or 2 local slots, the rest come in as -1. Every path
// against the CPU on the global routing; tokens with no local slot must come out exactly zero.
TEST(CudaMoe, FewerExpertsHeldThanTopK) {
  REQUIRE_GPU();
  std::mt19937 rng(51);
  const int64_t global = 8, held = 2, first = 4, k = 4, hidden = 256, inter = 128;
  const Layer l = make_layer(held, hidden, inter, rng);
  const cuda::ExpertShape shape{held, hidden, inter, k};
  std::vector<int32_t> local_of(static_cast<size_t>(global), -1);
  for (int64_t e = 0; e < held; ++e) local_of[static_cast<size_t>(first + e)] = static_cast<int32_t>(e);
  for (int64_t tokens : {1, 5, 64}) {
    const auto ids = route(global, tokens, k, 1.0, rng);
    std::vector<int32_t> local(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) local[i] = local_of[static_cast<size_t>(ids[i])];
    const size_t n = static_cast<size_t>(tokens * hidden);
    const auto x = gputest::random_bf16_exact(n, rng, 1.0f);
    std::vector<float> weights(ids.size());
    for (auto& v : weights) v = std::uniform_real_distribution<float>(0.1f, 1.0f)(rng);
    Tensor xs = Tensor::zeros({tokens, hidden});
    std::copy(x.begin(), x.end(), xs.data<float>());
    const Tensor ref = cpu_experts(l.w, local_of, xs, ids.data(), weights.data(), k);
    for (ExpertPath path : {ExpertPath::kGemv, ExpertPath::kGemm, ExpertPath::kWgmma}) {
      if (!cuda::experts_support(shape, path)) continue;
      if (path == ExpertPath::kWgmma && !device_is_sm90()) continue;
      cuda::Experts gpu(l.gate_up.get(), l.down.get(), shape, tokens);
      DeviceBuffer<unsigned char> ws(cuda::Experts::workspace_bytes(shape, tokens));
      ws.poison();
      DeviceBuffer<uint16_t> dx(gputest::to_bf16(x)), dy(n);
      DeviceBuffer<int32_t> dids(local);
      DeviceBuffer<float> dw(weights);
      dy.poison();
      gpu.forward(dx.get(), dids.get(), dw.get(), tokens, dy.get(), ws.get(), nullptr, path);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto y = gputest::from_bf16(dy.download());
      double num = 0, den = 0;
      for (int64_t t = 0; t < tokens; ++t) {
        bool any = false;
        for (int64_t j = 0; j < k; ++j) any = any || local[static_cast<size_t>(t * k + j)] >= 0;
        for (int64_t h = 0; h < hidden; ++h) {
          const size_t at = static_cast<size_t>(t * hidden + h);
          ASSERT_TRUE(std::isfinite(y[at])) << "path " << static_cast<int>(path) << ", M=" << tokens;
          if (!any) {
            ASSERT_EQ(y[at], 0.0f) << "token " << t << " has no local slot";
          }
          num += (y[at] - ref.data<float>()[at]) * double(y[at] - ref.data<float>()[at]);
          den += double(ref.data<float>()[at]) * ref.data<float>()[at];
        }
      }
      EXPECT_LE(std::sqrt(num / den), kBound) << "path " << static_cast<int>(path) << ", M=" << tokens;
    }
  }
}

TEST(CudaMoe, MostExpertsIdleAndWidthsNotMultiplesOf256) {
  REQUIRE_GPU();
  // 64 experts, one token with two of them: 62 experts get nothing; widths 1408 and 520 leave
  // partial 16-byte chunk rows per lane (GEMV only: 520 is no multiple of 64).
  check_all_paths(64, 520, 1408, 1, 2, {5, 60}, 2);
}

TEST(CudaMoe, EveryTokenOnOneExpert) {
  REQUIRE_GPU();
  check_all_paths(8, 128, 64, 32, 1, std::vector<int32_t>(32, 3), 4);
  // 1000 rows on one expert: 16 row tiles of 64 or 8 of 128, the last one partial.
  check_all_paths(8, 256, 192, 1000, 1, std::vector<int32_t>(1000, 6), 5);
}

TEST(CudaMoe, EveryTokenOnTheSameSixExperts) {
  REQUIRE_GPU();
  std::vector<int32_t> ids;
  for (int t = 0; t < 700; ++t)
    for (int32_t e : {1, 9, 20, 33, 47, 63}) ids.push_back(e);
  check_all_paths(64, 2048, 1408, 700, 6, ids, 6);
}

// The model shapes' layers are large (600M weights for qwen3): each suite makes its layer once
// and shares it among its cases. The cases are one test each, so that a sanitizer can take them
// one process at a time.
template <int64_t Experts, int64_t Hidden, int64_t Inter, uint32_t Seed, typename Param>
class SharedLayerTest : public ::testing::TestWithParam<Param> {
 protected:
  static void SetUpTestSuite() {
    if (!gputest::have_gpu()) return;
    std::mt19937 rng(Seed);
    layer_ = std::make_unique<Layer>(make_layer(Experts, Hidden, Inter, rng));
  }
  static void TearDownTestSuite() { layer_.reset(); }
  static const Layer& layer() { return *layer_; }

 private:
  static inline std::unique_ptr<Layer> layer_;
};

// One routed batch through one path.
struct PathCase {
  int64_t tokens;
  ExpertPath path;
};

const char* path_name(ExpertPath p) {
  switch (p) {
    case ExpertPath::kAuto: return "auto";
    case ExpertPath::kGemv: return "gemv";
    case ExpertPath::kGemm: return "gemm";
    case ExpertPath::kWgmma: return "wgmma";
  }
  return "unknown";
}

// Every path at each M, the GEMV one up to 256 tokens (past that it is never chosen where the
// GEMM can run).
std::vector<PathCase> path_cases(std::initializer_list<int64_t> tokens) {
  std::vector<PathCase> cases;
  for (int64_t t : tokens)
    for (ExpertPath p : {ExpertPath::kAuto, ExpertPath::kGemv, ExpertPath::kGemm, ExpertPath::kWgmma})
      if (p != ExpertPath::kGemv || t <= 256) cases.push_back({t, p});
  return cases;
}

void PrintTo(const PathCase& c, std::ostream* os) { *os << "M " << c.tokens << ", " << path_name(c.path); }

std::string path_case_name(const ::testing::TestParamInfo<PathCase>& info) {
  return "M" + std::to_string(info.param.tokens) + "_" + path_name(info.param.path);
}

// The case's path on the shared layer, skipped visibly where the shape or device cannot take it
// (a skip inside this helper ends the test: nothing follows the call).
void run_path_case(const Layer& l, const PathCase& c, int64_t k, double skew, uint32_t seed) {
  if (!cuda::experts_support({l.w.num_local, l.w.hidden, l.w.inter, k}, c.path))
    GTEST_SKIP() << "the shape does not take path " << path_name(c.path);
  if (c.path == ExpertPath::kWgmma && !device_is_sm90())
    GTEST_SKIP() << "the wgmma path needs compute capability 9.0";
  std::mt19937 rng(seed + static_cast<uint32_t>(c.tokens));
  const auto ids = route(l.w.num_local, c.tokens, k, skew, rng);
  check_path(l, c.tokens, k, ids, c.path, rng);
}

using QwenShape = SharedLayerTest<128, 2048, 768, 9, PathCase>;
TEST_P(QwenShape, FromDecodeToPrefill) {
  REQUIRE_GPU();
  run_path_case(layer(), GetParam(), 8, 1.0, 5u);
}
// 2048: mixed row tiles on the wgmma path.
INSTANTIATE_TEST_SUITE_P(CudaMoe, QwenShape, ::testing::ValuesIn(path_cases({1, 8, 33, 200, 1024, 2048})),
                         path_case_name);

// skew 0.93: expert 0 is ~80x as likely as expert 63; at small M many experts get nothing.
using DeepSeekV2LiteShape = SharedLayerTest<64, 2048, 1408, 10, PathCase>;
TEST_P(DeepSeekV2LiteShape, RaggedLoads) {
  REQUIRE_GPU();
  run_path_case(layer(), GetParam(), 6, 0.93, 20u);
}
// 2048: the wgmma row tile picked per forward.
INSTANTIATE_TEST_SUITE_P(CudaMoe, DeepSeekV2LiteShape,
                         ::testing::ValuesIn(path_cases({1, 8, 33, 200, 1024, 2048})), path_case_name);

TEST(CudaMoe, WideShapeOnlyTheGemmRuns) {
  REQUIRE_GPU();
  // hidden 3072 is past the GEMV's 2048 and no multiple of the down tile (128): the last column
  // tile is half empty. The GEMV must refuse it.
  std::mt19937 rng(11);
  check_all_paths(16, 3072, 320, 100, 4, route(16, 100, 4, 0.9, rng), 12);
  const cuda::ExpertShape shape{16, 3072, 320, 4};
  EXPECT_FALSE(cuda::experts_support(shape, ExpertPath::kGemv));
}

// The wgmma path against the CPU on sampled rows and against the mma.sync GEMM on every element:
// the same inputs, the same bf16 roundings of act and the partial sums, f32 sums in another
// order, so a rounding step apart in some elements at most.
void expect_wgmma_matches_gemm(const Layer& l, int64_t tokens, int64_t k, const std::vector<int32_t>& ids,
                               uint32_t seed, const std::string& what) {
  std::mt19937 a(seed), b(seed);  // the same x and weights for both runs
  const GpuRun gemm = run(l, tokens, k, ids, ExpertPath::kGemm, a);
  const GpuRun wgmma = run(l, tokens, k, ids, ExpertPath::kWgmma, b);
  EXPECT_LE(wgmma.rel, kBound) << what;
  double num = 0, den = 0;
  for (size_t i = 0; i < gemm.y.size(); ++i) {
    num += (wgmma.y[i] - gemm.y[i]) * double(wgmma.y[i] - gemm.y[i]);
    den += double(gemm.y[i]) * gemm.y[i];
  }
  // Not measured yet: where the f32 sums differ in their last bits a bf16 rounding (act, a
  // partial sum, y) can flip by one step (2^-8 to 2^-7 relative), in a small fraction of the
  // elements; a wrong tile, row or column would put an error of the order of 1 on whole tiles
  // of the ~1e3 here. 1e-2 sits between.
  EXPECT_LE(std::sqrt(num / den), kBound) << what;
}

// The two grouped GEMMs on the same inputs (expect_wgmma_matches_gemm); checked
// where each row tile size is taken (M = 200: 64 rows; M = 1024: 128 rows; M = 2048: 256 rows),
// with the deepseek-v2-lite shape's 11 gate_up column tiles (22 at 256 rows) and 22 down k-steps.
using WgmmaAgreesWithGemm = SharedLayerTest<64, 2048, 1408, 14, int64_t>;
TEST_P(WgmmaAgreesWithGemm, DeepSeekV2LiteShape) {
  REQUIRE_GPU();
  if (!device_is_sm90()) GTEST_SKIP() << "the wgmma path needs compute capability 9.0";
  const int64_t t = GetParam();
  namespace hx = cuda::heuristics;
  ASSERT_EQ(hx::wgmma_tile_m(t, 6, 64), t == 200 ? 64 : t == 1024 ? 128 : 256);
  std::mt19937 rng(14 + static_cast<uint32_t>(t));
  expect_wgmma_matches_gemm(layer(), t, 6, route(64, t, 6, 0.97, rng), static_cast<uint32_t>(t),
                            "M=" + std::to_string(t));
}
INSTANTIATE_TEST_SUITE_P(CudaMoe, WgmmaAgreesWithGemm, ::testing::Values(200, 1024, 2048),
                         [](const ::testing::TestParamInfo<int64_t>& i) {
                           return std::string("M").append(std::to_string(i.param));  // "M" + ...: GCC 12 -Wrestrict
                         });

// Ids of `tokens` tokens of two slots each giving expert e load[e] rows: the i-th and
// (i + tokens)-th of the expert-sorted slot list go to token i, distinct experts as long as no
// expert has more than `tokens` rows.
void two_slot_ids(const std::vector<int>& load, int64_t tokens, std::vector<int32_t>* ids) {
  std::vector<int32_t> sorted;
  for (int e = 0; e < static_cast<int>(load.size()); ++e) sorted.insert(sorted.end(), load[e], e);
  ASSERT_EQ(static_cast<int64_t>(sorted.size()), tokens * 2);
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t a = sorted[t], b = sorted[t + tokens];
    ASSERT_NE(a, b) << "token " << t;
    ids->insert(ids->end(), {std::min(a, b), std::max(a, b)});
  }
}

// Each load (rows per expert, summing to tokens * 2) routed by two_slot_ids, through
// expect_wgmma_matches_gemm.
void expect_loads_match_gemm(const Layer& l, int64_t tokens, const std::vector<std::vector<int>>& loads,
                             uint32_t seed) {
  for (const auto& load : loads) {
    std::vector<int32_t> ids;
    ASSERT_NO_FATAL_FAILURE(two_slot_ids(load, tokens, &ids));
    expect_wgmma_matches_gemm(l, tokens, 2, ids, seed, "first load " + std::to_string(load[0]));
  }
}

// expect_loads_match_gemm at 1280 tokens of top-2 over 16 experts (hidden 1024, inter 512), where
// the heuristics take 256-row tiles (and, where alt_tile is not 0, offer that one beside them),
// on a layer drawn from layer_seed.
void expect_tall_tile_loads(uint32_t layer_seed, int alt_tile, const std::vector<std::vector<int>>& loads,
                            uint32_t seed) {
  std::mt19937 rng(layer_seed);
  const int64_t experts = 16, hidden = 1024, inter = 512, k = 2, tokens = 1280;
  ASSERT_EQ(cuda::heuristics::wgmma_tile_m(tokens, k, experts), 256);
  if (alt_tile != 0) {
    ASSERT_EQ(cuda::heuristics::wgmma_alt_tile(tokens, k, experts), alt_tile);
  }
  const Layer l = make_layer(experts, hidden, inter, rng);
  expect_loads_match_gemm(l, tokens, loads, seed);
}

// 256-row tiles (taken where experts average a little more than one 128-row tile): each consumer
// warpgroup takes 128 rows as two 64-row sub-tiles and skips those past the expert's end. Loads
// chosen to hit every case: an expert of two and a half tiles, tiles that end inside the first
// sub-tile of either consumer and inside the second, exactly full tiles (256, 512 and 1280 rows),
// experts of one row and of none. Against the CPU on sampled rows and against the mma.sync GEMM
// on every element.
TEST(CudaMoe, WgmmaTallRowTiles) {
  REQUIRE_GPU();
  if (!device_is_sm90()) GTEST_SKIP() << "the wgmma path needs compute capability 9.0";
  // Rows per expert (2560 slots, two_slot_ids).
  expect_tall_tile_loads(15, 0,
                         {{520, 300, 257, 256, 193, 150, 129, 100, 65, 64, 13, 1, 0, 0, 512, 0},
                          {0, 0, 0, 1280, 0, 0, 0, 0, 0, 0, 0, 1280, 0, 0, 0, 0}},
                         7);
}

// Where the heuristics offer the plan a second row tile (128 beside 256 here), both choices give
// the CPU's and the mma.sync GEMM's result: even loads of 160 rows keep the 256-row tiles; two
// experts of 600 rows beside fourteen of ~100 take 128 (CudaPlan.PicksTheRowTileFromTheCounts
// checks the choice itself).
TEST(CudaMoe, WgmmaRowTileChosenPerForward) {
  REQUIRE_GPU();
  if (!device_is_sm90()) GTEST_SKIP() << "the wgmma path needs compute capability 9.0";
  expect_tall_tile_loads(16, 128,
                         {std::vector<int>(16, 160),                                             // 256-row tiles
                          {600, 600, 98, 98, 98, 98, 98, 98, 98, 98, 98, 98, 98, 98, 92, 92}},  // 128-row tiles
                         9);
}

// Mixed row tiles, offered where experts average about 128 rows: the plan cuts 128-row tiles and,
// where the counts favour it (CudaPlan.PicksMixedRowTilesFromTheCounts checks the choice), an
// expert of 129 to 256 rows runs as one 256-row tile, its two tiles' column items taken as twice
// as many of half the width. The first load hits every tall case: the first and last sizes (129,
// 256), ends inside either consumer's first or second sub-tile (140, 173, 200, 250), beside an
// exactly full short tile (128), short ones (100, 64, 1) and an empty expert; the second has half
// the experts tall. The third, with experts of 257 and 600 rows, keeps 128-row tiles. hidden 2048:
// enough column tiles that the grid is not the narrow one, which has no mixed tiles.
TEST(CudaMoe, WgmmaMixedRowTiles) {
  REQUIRE_GPU();
  if (!device_is_sm90()) GTEST_SKIP() << "the wgmma path needs compute capability 9.0";
  namespace hx = cuda::heuristics;
  std::mt19937 rng(17);
  const int64_t experts = 16, hidden = 2048, inter = 512, k = 2, tokens = 1024;
  ASSERT_EQ(hx::wgmma_tile_m(tokens, k, experts), 128);
  ASSERT_EQ(hx::wgmma_alt_tile(tokens, k, experts), hx::kWgmmaMixedTiles);
  int sms = 0;
  ASSERT_EQ(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0), cudaSuccess);
  ASSERT_FALSE(hx::wgmma_narrow_tiles(hx::max_row_tiles(tokens * k, experts, 128), hidden, sms));
  const Layer l = make_layer(experts, hidden, inter, rng);
  const std::vector<std::vector<int>> loads = {
      {129, 256, 128, 200, 140, 1, 0, 64, 100, 173, 250, 199, 130, 100, 80, 98},            // mixed
      {136, 120, 136, 120, 136, 120, 136, 120, 136, 120, 136, 120, 136, 120, 136, 120},  // mixed
      {129, 256, 257, 128, 200, 140, 1, 0, 600, 64, 100, 173, 0, 0, 0, 0}};              // 128
  expect_loads_match_gemm(l, tokens, loads, 8);
}

// The GEMV and GEMM paths on the same inputs: two roundings of bf16 intermediates apart, not
// identical.
using PathsAgree = SharedLayerTest<128, 2048, 768, 13, int64_t>;
TEST_P(PathsAgree, GemvAndGemmOnTheQwenShape) {
  REQUIRE_GPU();
  const int64_t t = GetParam();
  std::mt19937 rng(13 + static_cast<uint32_t>(t));
  const auto ids = route(128, t, 8, 1.0, rng);
  std::mt19937 a(static_cast<uint32_t>(t)), b(static_cast<uint32_t>(t));  // the same x and weights
  const GpuRun gemv = run(layer(), t, 8, ids, ExpertPath::kGemv, a);
  const GpuRun gemm = run(layer(), t, 8, ids, ExpertPath::kGemm, b);
  double num = 0, den = 0;
  for (size_t i = 0; i < gemv.y.size(); ++i) {
    num += (gemm.y[i] - gemv.y[i]) * double(gemm.y[i] - gemv.y[i]);
    den += double(gemv.y[i]) * gemv.y[i];
  }
  EXPECT_LE(std::sqrt(num / den), kBound) << "M=" << t;
}
INSTANTIATE_TEST_SUITE_P(CudaMoe, PathsAgree, ::testing::Values(33, 200),
                         [](const ::testing::TestParamInfo<int64_t>& i) {
                           return std::string("M").append(std::to_string(i.param));  // "M" + ...: GCC 12 -Wrestrict
                         });

// The GEMV path's two forms: up to heuristics::gemv_direct_max_slots routed slots (bf16 here: 16,
// qwen3 and deepseek-v2-lite M <= 2) the warps read the ids themselves, past that the plan
// kernel and v2's grouped kernels.
// Both shapes at the decode sizes either side of the switch, against the CPU (bound kBound).
TEST(CudaMoe, GemvSmallBatchesEitherSideOfThePlanSwitch) {
  REQUIRE_GPU();
  std::mt19937 rng(21);
  const Layer q = make_layer(128, 2048, 768, rng);
  for (int64_t t : {1, 2, 3, 4, 5, 16}) {
    const auto ids = route(128, t, 8, 1.0, rng);
    EXPECT_LE(run(q, t, 8, ids, ExpertPath::kGemv, rng).rel, kBound) << "qwen3 M=" << t;
  }
  const Layer d = make_layer(64, 2048, 1408, rng);
  for (int64_t t : {1, 2, 3, 5, 6, 16}) {
    const auto ids = route(64, t, 6, 0.95, rng);
    EXPECT_LE(run(d, t, 6, ids, ExpertPath::kGemv, rng).rel, kBound) << "deepseek-v2-lite M=" << t;
  }
}

// Without the plan, slots that share an expert must all be found (here 2 tokens on the same 8
// experts: 16 slots, the plan-free form's most for bf16, 8 experts with 2 each; the same with 3
// tokens, past it, on the grouped form; and one token whose k slots repeat an expert, which the
// router never produces but the GEMV must still sum right). Widths: gate_up rows of one 16-byte
// chunk per lane (hidden 64: 8 down rows per warp) and down rows of 225 chunks (inter 1800: eight
// chunks per lane, the last partly past the row). Bound kBound.
TEST(CudaMoe, GemvDirectRoutingSharedExpertsAndNarrowWidths) {
  REQUIRE_GPU();
  std::mt19937 rng(22);
  const Layer l = make_layer(16, 64, 1800, rng);
  for (int tokens : {2, 3}) {
    std::vector<int32_t> same;
    for (int t = 0; t < tokens; ++t)
      for (int32_t e : {0, 2, 3, 7, 8, 11, 14, 15}) same.push_back(e);
    EXPECT_LE(run(l, tokens, 8, same, ExpertPath::kGemv, rng).rel, kBound) << tokens << " tokens";
  }
  EXPECT_LE(run(l, 1, 4, {5, 5, 9, 5}, ExpertPath::kGemv, rng).rel, kBound);
  // Past the plan switch with more row items than the persistent grid has warps (a GEMV-only
  // width: 520 is no multiple of 64, so 300 tokens are allowed).
  const Layer w = make_layer(64, 520, 1408, rng);
  EXPECT_LE(run(w, 300, 2, route(64, 300, 2, 0.97, rng), ExpertPath::kGemv, rng).rel, kBound);
}

// A graph of one forward of `layer` (t tokens of e experts, hidden h, top-k; every weight `weight`;
// on `path`) captured once, then replayed after a new routing of each skew is uploaded: the
// replay must give the bits of a direct call (and, with `replay_twice`, a second replay the same),
// every element written. `what` names the case in the messages.
void check_replays(const cuda::DecodeExperts& layer, int64_t e, int64_t h, int64_t k, int64_t t, float weight,
                   std::initializer_list<double> skews, ExpertPath path, bool replay_twice, std::mt19937& rng,
                   const std::string& what) {
  const auto x = gputest::random_bf16_exact(static_cast<size_t>(t * h), rng, 1.0f);
  std::vector<float> w(static_cast<size_t>(t * k), weight);
  DeviceBuffer<uint16_t> dx(gputest::to_bf16(x)), dy(static_cast<size_t>(t * h));
  DeviceBuffer<int32_t> dids(route(e, t, k, 1.0, rng));
  DeviceBuffer<float> dw(w);
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  const auto forward = [&] { layer.forward(dx.get(), dids.get(), dw.get(), t, dy.get(), stream, path); };
  const auto replay = [&] {
    dy.poison();
    ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  };
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal), cudaSuccess);
  forward();
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  for (double skew : skews) {
    dids.upload(route(e, t, k, skew, rng));
    ASSERT_NO_FATAL_FAILURE(replay());
    const auto replayed = dy.download();
    if (replay_twice) {
      ASSERT_NO_FATAL_FAILURE(replay());
      EXPECT_EQ(replayed, dy.download()) << what << ": two replays differ";
    }
    dy.poison();
    forward();
    ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
    const auto direct = dy.download();
    EXPECT_EQ(replayed, direct) << what << ", skew " << skew;
    for (float v : gputest::from_bf16(direct)) ASSERT_TRUE(std::isfinite(v)) << "an element left unwritten";
  }
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// The GEMV launches are chained (programmatic dependent launch) and, up to 24 slots, run without
// the plan: a captured graph must still replay bit-identical to a direct call for new routings,
// on both sides of the switch (M = 2: 16 slots; M = 8: 64 slots), and for one token, whose down
// projection and combine are one grid (M = 1).
TEST(CudaMoe, GemvGraphReplayWithNewRoutingIsExact) {
  REQUIRE_GPU();
  std::mt19937 rng(23);
  const int64_t e = 32, h = 1024, inter = 512, k = 8;
  const Layer l = make_layer(e, h, inter, rng);
  cuda::DecodeExperts layer(l.w, 8, k);
  for (int64_t t : {1, 2, 8})
    ASSERT_NO_FATAL_FAILURE(
        check_replays(layer, e, h, k, t, 0.25f, {1.0, 0.7}, ExpertPath::kGemv, true, rng, "M=" + std::to_string(t)));
}

// Counts and offsets live on the device only: a graph captured once replays right for other
// routings of the same M, and the GEMM path gives the same bits every time.
void check_graph_replay(int64_t e, int64_t h, int64_t inter, int64_t k, int64_t t, uint32_t seed) {
  std::mt19937 rng(seed);
  const Layer l = make_layer(e, h, inter, rng);
  cuda::DecodeExperts layer(l.w, t, k);
  check_replays(layer, e, h, k, t, 0.5f, {1.0, 0.8, 0.3}, ExpertPath::kAuto, false, rng, "E=" + std::to_string(e));
}

TEST(CudaMoe, GraphReplayWithNewRoutingIsExactAndDeterministic) {
  REQUIRE_GPU();
  check_graph_replay(64, 2048, 1408, 6, 300, 17);
  // The seed workload's shape at 64 tokens: on sm_90 its down projection runs split-K, whose
  // pieces the combine adds in a fixed order, so the bits must not depend on block timing.
  check_graph_replay(8, 512, 1024, 2, 64, 18);
}

// Small layers (the seed workload: 8 experts, hidden 512, inter 1024, top-2) leave the device
// short of blocks, so the wgmma path splits the down projection's k range (f32 pieces by slot,
// added by the combine in split order). Checked where the heuristics split (asserted, so that
// the test keeps covering it), from 1 to 128 tokens on 64-row tiles and at 600 tokens on 256-row
// tiles (150 rows an expert): ragged loads, every token on the same two experts (six get
// nothing), and the slots of another rank's experts left out, as on a rank of two. The folded-norm form of the split combine is covered by FoldedNextNormMatchesCpuOnEveryPath
// at M = 1 (its down projection splits in two there).
TEST(CudaMoe, SmallLayerSplitsTheDownProjection) {
  REQUIRE_GPU();
  if (!device_is_sm90()) GTEST_SKIP() << "the wgmma path needs compute capability 9.0";
  namespace hx = cuda::heuristics;
  std::mt19937 rng(41);
  const int64_t e = 8, h = 512, inter = 1024, k = 2;
  const Layer l = make_layer(e, h, inter, rng);
  std::vector<bool> other_rank(static_cast<size_t>(e));
  for (size_t i = 4; i < other_rank.size(); ++i) other_rank[i] = true;
  ASSERT_EQ(hx::wgmma_tile_m(600, k, e), 256);
  for (int64_t t : {1, 8, 64, 128, 600}) {
    const int64_t tiles = hx::max_row_tiles(t * k, e, hx::wgmma_tile_m(t, k, e));
    ASSERT_GT(hx::wgmma_down_splits(tiles, h, inter), 1) << "M=" << t;
    EXPECT_LE(run(l, t, k, route(e, t, k, 0.8, rng), ExpertPath::kWgmma, rng).rel, kBound) << "M=" << t;
    std::vector<int32_t> same;
    for (int64_t i = 0; i < t; ++i) same.insert(same.end(), {2, 5});
    EXPECT_LE(run(l, t, k, same, ExpertPath::kWgmma, rng).rel, kBound) << "two experts, M=" << t;
    EXPECT_LE(run(l, t, k, route(e, t, k, 1.0, rng), ExpertPath::kWgmma, rng, &other_rank).rel, kBound)
        << "half the experts elsewhere, M=" << t;
  }
}

// forward_then_norm: the next layer's input norm folded into the combine. Against the CPU: the
// residual gains the experts' output (relative error of the added part within kBound), and the
// normalised rows of that residual match within kBound too (their error is the output's, scaled).
TEST(CudaMoe, FoldedNextNormMatchesCpuOnEveryPath) {
  REQUIRE_GPU();
  std::mt19937 rng(21);
  const int64_t experts = 16, hidden = 512, inter = 256, k = 4;
  const Layer l = make_layer(experts, hidden, inter, rng);
  const cuda::ExpertShape shape{experts, hidden, inter, k};
  // At M = 1 the wgmma path splits the down projection in two (f32 pieces into the folded norm).
  ASSERT_EQ(cuda::heuristics::wgmma_down_splits(
                cuda::heuristics::max_row_tiles(k, experts, cuda::heuristics::wgmma_tile_m(1, k, experts)),
                hidden, inter),
            2);
  for (int64_t tokens : {1, 5, 300}) {
    const auto ids = route(experts, tokens, k, 0.8, rng);
    const size_t n = static_cast<size_t>(tokens * hidden);
    const auto x = gputest::random_bf16_exact(n, rng, 1.0f);
    std::vector<float> weights(ids.size()), residual(n), norm_w(static_cast<size_t>(hidden));
    for (auto& v : weights) v = std::uniform_real_distribution<float>(0.1f, 1.0f)(rng);
    for (auto& v : residual) v = std::normal_distribution<float>(0.0f, 1.0f)(rng);
    for (auto& v : norm_w) v = std::uniform_real_distribution<float>(0.5f, 1.5f)(rng);

    Tensor xs = Tensor::zeros({tokens, hidden});
    std::copy(x.begin(), x.end(), xs.data<float>());
    std::vector<int32_t> all(static_cast<size_t>(experts));
    for (size_t e = 0; e < all.size(); ++e) all[e] = static_cast<int32_t>(e);
    const Tensor y = cpu_experts(l.w, all, xs, ids.data(), weights.data(), k);
    std::vector<float> want_x(n), want_h(n);
    for (int64_t t = 0; t < tokens; ++t) {
      double ss = 0;
      for (int64_t i = 0; i < hidden; ++i) {
        const size_t at = static_cast<size_t>(t * hidden + i);
        want_x[at] = residual[at] + y.data<float>()[at];
        ss += static_cast<double>(want_x[at]) * want_x[at];
      }
      const double inv = 1.0 / std::sqrt(ss / static_cast<double>(hidden) + 1e-6);
      for (int64_t i = 0; i < hidden; ++i) {
        const size_t at = static_cast<size_t>(t * hidden + i);
        want_h[at] = static_cast<float>(norm_w[static_cast<size_t>(i)] * want_x[at] * inv);
      }
    }

    for (ExpertPath path : {ExpertPath::kAuto, ExpertPath::kGemv, ExpertPath::kGemm, ExpertPath::kWgmma}) {
      if (!cuda::experts_support(shape, path)) continue;
      if (path == ExpertPath::kWgmma && !device_is_sm90()) continue;
      if (path == ExpertPath::kGemv && tokens > 256) continue;
      cuda::Experts gpu(l.gate_up.get(), l.down.get(), shape, tokens);
      DeviceBuffer<unsigned char> ws(cuda::Experts::workspace_bytes(shape, tokens));
      ws.poison();
      DeviceBuffer<uint16_t> dx(gputest::to_bf16(x)), dh(n);
      DeviceBuffer<int32_t> dids(ids);
      DeviceBuffer<float> dw(weights), dres(residual), dnw(norm_w);
      dh.poison();
      cuda::Experts::NextNorm next{dres.get(), dnw.get(), 1e-6f, dh.get()};
      gpu.forward_then_norm(dx.get(), dids.get(), dw.get(), tokens, next, ws.get(), nullptr, path);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const auto got_x = dres.download();
      const auto got_h = gputest::from_bf16(dh.download());
      double ex = 0, ey = 0, eh = 0, nh = 0;
      for (size_t i = 0; i < n; ++i) {
        ASSERT_TRUE(std::isfinite(got_h[i])) << "normalised element " << i << " left unwritten";
        ex += (got_x[i] - want_x[i]) * (got_x[i] - want_x[i]);
        ey += static_cast<double>(y.data<float>()[i]) * y.data<float>()[i];
        eh += (got_h[i] - want_h[i]) * (got_h[i] - want_h[i]);
        nh += static_cast<double>(want_h[i]) * want_h[i];
      }
      EXPECT_LE(std::sqrt(ex / ey), kBound) << "residual, path " << static_cast<int>(path) << ", M=" << tokens;
      EXPECT_LE(std::sqrt(eh / nh), kBound) << "normed, path " << static_cast<int>(path) << ", M=" << tokens;
    }
  }
  // A folded norm without its residual, weight or output is refused, not run.
  cuda::Experts gpu(l.gate_up.get(), l.down.get(), shape, 1);
  DeviceBuffer<unsigned char> ws(cuda::Experts::workspace_bytes(shape, 1));
  DeviceBuffer<uint16_t> dx(static_cast<size_t>(hidden));
  DeviceBuffer<int32_t> dids(std::vector<int32_t>{0, 1, 2, 3});
  DeviceBuffer<float> dw(std::vector<float>(4, 0.25f));
  EXPECT_THROW(gpu.forward_then_norm(dx.get(), dids.get(), dw.get(), 1, cuda::Experts::NextNorm{}, ws.get(), nullptr),
               Error);
}

TEST(CudaMoe, RefusesWhatItCannotRun) {
  ExpertWeights w;
  w.num_local = 4;
  w.hidden = 4104;  // past the GEMV's 2048 and no multiple of 64: neither path
  w.inter = 64;
  w.gate_up = Tensor::zeros({4, 128, 4104});
  w.down = Tensor::zeros({4, 4104, 64});
  EXPECT_THROW(cuda::DecodeExperts(w, 4, 2), Error);
  EXPECT_THROW(cuda::Experts::workspace_bytes({4, 4104, 64, 2}, 4), Error);
  EXPECT_THROW(cuda::Experts::workspace_bytes({4, 64, 64, 2}, 65537), Error);  // past max_tokens
  EXPECT_FALSE(cuda::experts_support({4, 4096, 64, 2}, ExpertPath::kGemv));
  EXPECT_TRUE(cuda::experts_support({4, 4096, 64, 2}, ExpertPath::kGemm));
  if (!gputest::have_gpu()) {
    w.hidden = 64;
    w.gate_up = Tensor::zeros({4, 128, 64});
    w.down = Tensor::zeros({4, 64, 64});
    EXPECT_THROW(cuda::DecodeExperts(w, 4, 2), Error);  // no device: a clear error, no crash
  }
}

}  // namespace
}  // namespace moe
