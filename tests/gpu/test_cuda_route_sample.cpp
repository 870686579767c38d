// The device routers and samplers (src/backend/cuda/moe/route_sample.cu).
// Routers: compared with moe::route on many random tokens, every configuration it supports, with
// exact ties (logits drawn from a handful of values), -inf and very negative logits, saturated
// sigmoids. Bound: the same expert ids, in the same (ascending) order; weights within 1e-6
// relative (the kernel reproduces the CPU arithmetic; only a rare last-bit difference of exp is
// possible). Tokens past RouterParams::live_rows (padding) take no expert: ids -1, weights 0.
// Samplers: greedy against a host argmax (first maximum) with planted ties; temperature 0 and
// top_k 1 equal greedy; every draw inside the allowed set computed on the host as moe::Sampler
// defines it; frequencies over 4000 fixed seeds against the exact probabilities; replays; a padded
// row_stride whose padding is never drawn.
// Timings (MOE_GPU_PERF=1): graph replays of back-to-back launches, printed, not checked.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "backend/cuda/ops/ops_launch.h"
#include "backend/cuda/moe/router_params.h"
#include "gpu_test_util.h"
#include "moe/router.h"

namespace moe {
namespace {

using gputest::DeviceBuffer;
namespace k = cuda::kernels;

// ---- routers ----------------------------------------------------------------------------------

struct RouteCase {
  int experts, top_k;
  bool sigmoid;
  int groups;  // 0 none, 1 max, 2 top-2 sum
  int n_group, topk_group;
  bool bias, renorm;
  float scaling;
};

std::vector<float> router_logits(int tokens, int experts, std::mt19937& rng) {
  std::vector<float> l(static_cast<size_t>(tokens) * experts);
  std::normal_distribution<float> d(0.0f, 2.0f);
  for (int t = 0; t < tokens; ++t) {
    float* row = l.data() + static_cast<size_t>(t) * experts;
    const int style = t % 4;
    for (int e = 0; e < experts; ++e) {
      if (style == 0) row[e] = d(rng);
      else if (style == 1) row[e] = static_cast<float>(static_cast<int>(rng() % 5)) - 2.0f;  // ties
      else if (style == 2) row[e] = rng() % 3 == 0 ? -std::numeric_limits<float>::infinity()
                                    : (rng() % 2 ? -1e30f : d(rng));
      else row[e] = rng() % 2 ? 30.0f + static_cast<float>(rng() % 3) : d(rng);  // sigmoid 1.0
    }
    row[rng() % static_cast<unsigned>(experts)] = 0.5f;  // at least one finite logit per row
  }
  return l;
}

void run_route_case(const RouteCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const int tokens = 1000;
  const auto logits = router_logits(tokens, c.experts, rng);
  std::vector<float> bias(static_cast<size_t>(c.experts));
  for (auto& b : bias)  // some biases repeated so that biased choices tie too
    b = rng() % 2 ? 0.25f : std::uniform_real_distribution<float>(-0.5f, 0.5f)(rng);

  const RouterConfig rc = gputest::router_config(c.experts, c.top_k, c.sigmoid, c.groups, c.n_group, c.topk_group,
                                                 c.bias, c.renorm, c.scaling);
  validate_router(rc, "test");
  std::vector<int32_t> want_ids(static_cast<size_t>(tokens) * c.top_k);
  std::vector<float> want_w(want_ids.size());
  route(rc, logits.data(), c.bias ? bias.data() : nullptr, tokens, want_ids.data(), want_w.data());
  // The last 100 tokens are padding rows (live_rows): no expert, weight 0.
  const int live = tokens - 100;
  std::fill(want_ids.begin() + static_cast<std::ptrdiff_t>(live) * c.top_k, want_ids.end(), -1);
  std::fill(want_w.begin() + static_cast<std::ptrdiff_t>(live) * c.top_k, want_w.end(), 0.0f);

  DeviceBuffer<float> dl(logits), db(bias), dw(want_w.size());
  DeviceBuffer<int32_t> dlive(std::vector<int32_t>{live});
  DeviceBuffer<int32_t> di(want_ids.size());
  dw.poison();
  di.poison();
  k::RouterParams p = k::router_params(rc, db.get());
  // Expert parallelism: the ids also as indices among the middle third of the experts (a rank
  // holding [first, first + count)), -1 outside.
  DeviceBuffer<int32_t> dlocal(want_ids.size());
  dlocal.poison();
  p.local_ids = dlocal.get();
  p.local_first = c.experts / 3;
  p.local_count = std::max(1, c.experts / 3);
  p.live_rows = dlive.get();
  ASSERT_EQ(k::route(dl.get(), p, tokens, di.get(), dw.get(), nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto ids = di.download();
  const auto local = dlocal.download();
  int bad_local = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int e = want_ids[i] - p.local_first;
    bad_local += local[i] != (e >= 0 && e < p.local_count ? e : -1);
  }
  EXPECT_EQ(bad_local, 0) << rc.describe() << ": local indices";
  const auto w = dw.download();
  int bad_ids = 0, bad_w = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] != want_ids[i]) {
      if (bad_ids++ < 3)
        ADD_FAILURE() << rc.describe() << ": token " << i / c.top_k << " slot " << i % c.top_k
                      << " gpu " << ids[i] << " cpu " << want_ids[i];
    } else if (!(std::abs(w[i] - want_w[i]) <= 1e-6f * std::abs(want_w[i]) + 1e-30f)) {
      if (bad_w++ < 3)
        ADD_FAILURE() << rc.describe() << ": token " << i / c.top_k << " weight gpu " << w[i]
                      << " cpu " << want_w[i];
    }
  }
  EXPECT_EQ(bad_ids, 0) << rc.describe();
  EXPECT_EQ(bad_w, 0) << rc.describe();
}

TEST(CudaRoute, MatchesCpuRouterInEveryConfiguration) {
  REQUIRE_GPU();
  const RouteCase cases[] = {
      // softmax top-k (Qwen, Mixtral, OLMoE), with and without renormalisation
      {8, 2, false, 0, 1, 1, false, true, 1.0f},
      {8, 2, false, 0, 1, 1, false, false, 1.0f},
      {60, 4, false, 0, 1, 1, false, false, 1.0f},
      {64, 8, false, 0, 1, 1, false, false, 1.0f},
      {128, 8, false, 0, 1, 1, false, true, 1.0f},
      {512, 16, false, 0, 1, 1, false, true, 1.0f},
      {1, 1, false, 0, 1, 1, false, true, 1.0f},
      {33, 16, false, 0, 1, 1, true, true, 1.5f},  // a bias on softmax scores: allowed by route
      // DeepSeek-V2 greedy and group_limited_greedy (softmax, group max, masked experts score 0)
      {64, 6, false, 0, 1, 1, false, false, 16.0f},
      {64, 6, false, 1, 8, 3, false, false, 16.0f},
      {160, 6, false, 1, 8, 3, false, false, 16.0f},
      {160, 6, false, 1, 8, 3, false, true, 2.5f},
      {12, 4, false, 1, 3, 1, false, false, 1.0f},  // a kept group of 4 must supply all 4
      // DeepSeek-V3 noaux_tc (sigmoid, bias for the choice, top-2 sum groups, -inf masks)
      {256, 8, true, 2, 8, 4, true, true, 2.5f},
      {256, 8, true, 2, 8, 4, true, false, 1.0f},
      {64, 6, true, 2, 1, 1, true, true, 2.5f},
      {6, 2, true, 2, 3, 1, false, true, 1.0f},
      {512, 16, true, 2, 64, 4, true, true, 1.0f},
      {256, 8, true, 2, 32, 3, true, true, 1.0f},
      // sigmoid without groups, with and without bias
      {64, 4, true, 0, 1, 1, false, false, 1.0f},
      {96, 8, true, 0, 1, 1, true, true, 1.0f},
  };
  uint32_t seed = 1;
  for (const auto& c : cases) run_route_case(c, ++seed);
}

TEST(CudaRoute, RejectsWhatItCannotRoute) {
  REQUIRE_GPU();
  k::RouterParams p;
  p.experts = 513;
  p.top_k = 2;
  EXPECT_EQ(k::route(nullptr, p, 1, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  p.experts = 64;
  p.top_k = 17;
  EXPECT_EQ(k::route(nullptr, p, 1, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  p.top_k = 4;
  p.group_ranking = 2;
  p.n_group = 64;  // groups of one expert cannot give a top-2 sum
  EXPECT_EQ(k::route(nullptr, p, 1, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
}

// route_hidden: the projection folded into the router. Its logits (written out) are within f32
// rounding of a double-precision dot product of the same bf16 numbers, and its choice is exactly
// moe::route's on those logits. Small routers of the seed, Mixtral and a DeepSeek-like grouped
// shape; routers past the size limit and misaligned rows are refused.
TEST(CudaRoute, HiddenFoldedRouterMatchesCpuOnItsLogits) {
  REQUIRE_GPU();
  struct Case {
    int experts, top_k, hidden;
    bool sigmoid;
    int groups, n_group, topk_group;
    bool renorm;
  };
  const Case cases[] = {{8, 2, 512, false, 0, 1, 1, true},
                        {8, 2, 4096, false, 0, 1, 1, true},
                        {60, 4, 1024, false, 0, 1, 1, false},
                        {64, 6, 1024, true, 2, 8, 4, true}};
  uint32_t seed = 40;
  for (const auto& c : cases) {
    std::mt19937 rng(++seed);
    const int tokens = 300;
    const auto x = gputest::random_bf16_exact(static_cast<size_t>(tokens) * c.hidden, rng, 1.0f);
    const auto w = gputest::random_bf16_exact(static_cast<size_t>(c.experts) * c.hidden, rng,
                                              1.0f / std::sqrt(static_cast<float>(c.hidden)));
    DeviceBuffer<uint16_t> dx(gputest::to_bf16(x)), dr(gputest::to_bf16(w));
    DeviceBuffer<float> dl(static_cast<size_t>(tokens) * c.experts), dw(static_cast<size_t>(tokens) * c.top_k);
    DeviceBuffer<int32_t> di(static_cast<size_t>(tokens) * c.top_k);
    dl.poison();
    dw.poison();
    di.poison();
    const RouterConfig rc = gputest::router_config(c.experts, c.top_k, c.sigmoid, c.groups, c.n_group,
                                                   c.topk_group, false, c.renorm, 1.0f);
    const k::RouterParams p = k::router_params(rc, nullptr);
    ASSERT_TRUE(k::route_hidden_supported(c.experts, c.hidden));
    ASSERT_EQ(k::route_hidden(dx.get(), dr.get(), c.hidden, p, tokens, di.get(), dw.get(), dl.get(), nullptr),
              cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto logits = dl.download();
    for (int t = 0; t < tokens; ++t)
      for (int e = 0; e < c.experts; ++e) {
        double want = 0, mag = 0;
        for (int h = 0; h < c.hidden; ++h) {
          const double v = static_cast<double>(x[static_cast<size_t>(t) * c.hidden + h]) * w[static_cast<size_t>(e) * c.hidden + h];
          want += v;
          mag += std::abs(v);
        }
        const double got = logits[static_cast<size_t>(t) * c.experts + e];
        ASSERT_LE(std::abs(got - want), 1e-6 * mag + 1e-30) << "token " << t << " expert " << e;
      }
    std::vector<int32_t> want_ids(static_cast<size_t>(tokens) * c.top_k);
    std::vector<float> want_w(want_ids.size());
    route(rc, logits.data(), nullptr, tokens, want_ids.data(), want_w.data());
    EXPECT_EQ(di.download(), want_ids) << rc.describe();
    const auto got_w = dw.download();
    for (size_t i = 0; i < got_w.size(); ++i)
      ASSERT_LE(std::abs(got_w[i] - want_w[i]), 1e-6f * std::abs(want_w[i]) + 1e-30f) << rc.describe() << " slot " << i;
  }
  k::RouterParams p;
  p.experts = 128;
  p.top_k = 8;
  EXPECT_FALSE(k::route_hidden_supported(128, 2048));
  EXPECT_EQ(k::route_hidden(nullptr, nullptr, 2048, p, 1, nullptr, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
  EXPECT_FALSE(k::route_hidden_supported(8, 12));
}

// ---- sampling ---------------------------------------------------------------------------------

int host_argmax(const float* x, int n) {
  int best = 0;
  for (int i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;
  return best;
}

struct Draw {
  float temperature;
  int top_k;
  float top_p;
  uint64_t seed;
  int32_t step;
};

std::vector<int32_t> sample(const std::vector<float>& logits, int vocab, const std::vector<Draw>& d) {
  const int rows = static_cast<int>(d.size());
  std::vector<float> t, p;
  std::vector<int32_t> kk, st;
  std::vector<uint64_t> s;
  for (const auto& x : d) {
    t.push_back(x.temperature), kk.push_back(x.top_k), p.push_back(x.top_p);
    s.push_back(x.seed), st.push_back(x.step);
  }
  DeviceBuffer<float> dl(logits), dt(t), dp(p);
  DeviceBuffer<int32_t> dk(kk), dst(st), out(static_cast<size_t>(rows));
  DeviceBuffer<uint64_t> ds(s);
  out.poison();
  k::SampleParams sp{dt.get(), dk.get(), dp.get(), ds.get(), dst.get()};
  EXPECT_EQ(k::sample_rows(dl.get(), sp, rows, vocab, out.get(), nullptr), cudaSuccess);
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  return out.download();
}

// moe::Sampler's set: order by (logit / T desc, index asc), keep top_k, then the shortest prefix
// whose probability reaches top_p + slack. The device sums probabilities in 2^-45 fixed point,
// the host in double: a slack of 1e-6 admits the few tail tokens (each of tiny probability in a
// large flat vocabulary) whose place relative to the cut those last bits could change.
std::vector<int32_t> allowed_set(const float* x, int vocab, float temperature, int top_k, float top_p,
                                 double slack = 0.0) {
  std::vector<std::pair<float, int32_t>> s(static_cast<size_t>(vocab));
  for (int i = 0; i < vocab; ++i) s[static_cast<size_t>(i)] = {x[i] / temperature, i};
  std::sort(s.begin(), s.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
  if (top_k > 0 && top_k < vocab) s.resize(static_cast<size_t>(top_k));
  const float mx = s[0].first;
  double sum = 0;
  std::vector<double> e(s.size());
  for (size_t i = 0; i < s.size(); ++i) sum += e[i] = std::exp(static_cast<double>(s[i].first - mx));
  size_t cut = s.size();
  if (top_p < 1.0f) {
    double cum = 0;
    for (size_t i = 0; i < s.size(); ++i) {
      cum += e[i] / sum;
      if (cum >= top_p + slack) {
        cut = i + 1;
        break;
      }
    }
  }
  std::vector<int32_t> ids;
  for (size_t i = 0; i < cut; ++i) ids.push_back(s[i].second);
  return ids;
}

TEST(CudaSample, ArgmaxTakesTheFirstMaximum) {
  REQUIRE_GPU();
  std::mt19937 rng(7);
  for (int vocab : {1000, 151936, 262144, 3}) {
    const int rows = 6;
    auto x = gputest::random_bf16_exact(static_cast<size_t>(rows) * vocab, rng, 3.0f);
    // Planted ties: row r's maximum appears twice (or at every index in row 5).
    for (int r = 0; r < rows; ++r) {
      float* row = x.data() + static_cast<size_t>(r) * vocab;
      if (r == 5) {
        std::fill(row, row + vocab, -1.0f);
        continue;
      }
      const int a = static_cast<int>(rng() % vocab), b = static_cast<int>(rng() % vocab);
      row[a] = row[b] = 100.0f + r;
    }
    DeviceBuffer<float> dx(x);
    DeviceBuffer<int32_t> out(rows);
    out.poison();
    ASSERT_EQ(k::argmax_rows(dx.get(), rows, vocab, out.get(), nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    const auto got = out.download();
    for (int r = 0; r < rows; ++r)
      EXPECT_EQ(got[static_cast<size_t>(r)], host_argmax(x.data() + static_cast<size_t>(r) * vocab, vocab))
          << "vocab " << vocab << " row " << r;
  }
}

TEST(CudaSample, TemperatureZeroAndTopKOneAreGreedy) {
  REQUIRE_GPU();
  std::mt19937 rng(8);
  const int vocab = 5003, rows = 8;
  auto x = gputest::random_bf16_exact(static_cast<size_t>(rows) * vocab, rng, 2.0f);
  x[17] = x[40] = 50.0f;  // a tie in row 0
  std::vector<Draw> d;
  for (int r = 0; r < rows; ++r)
    d.push_back(r % 2 ? Draw{1.3f, 1, 0.9f, 11u + r, r} : Draw{0.0f, 40, 0.5f, 11u + r, r});
  const auto got = sample(x, vocab, d);
  for (int r = 0; r < rows; ++r)
    EXPECT_EQ(got[static_cast<size_t>(r)], host_argmax(x.data() + static_cast<size_t>(r) * vocab, vocab)) << r;
}

// One vocabulary size a case (one test each, so that a sanitizer can take them one at a time).
class CudaSampleVocab : public ::testing::TestWithParam<int> {};

TEST_P(CudaSampleVocab, DrawsStayInsideTheTopKTopPSet) {
  REQUIRE_GPU();
  const int vocab = GetParam();
  std::mt19937 rng(9 + static_cast<uint32_t>(vocab));
  const int rows = 48;
  std::vector<float> x(static_cast<size_t>(rows) * vocab);
  std::normal_distribution<float> d(0.0f, 3.0f);
  for (int r = 0; r < rows; ++r)
    for (int i = 0; i < vocab; ++i)  // every third row from a few values: ties at the cuts
      x[static_cast<size_t>(r) * vocab + i] =
          r % 3 == 0 ? static_cast<float>(static_cast<int>(rng() % 6)) : d(rng);
  const float temps[] = {1.0f, 0.7f, 1.5f, 0.3f};
  const int ks[] = {0, 2, 5, 50, 1000};
  const float ps[] = {1.0f, 0.9f, 0.5f, 0.99f, 0.05f};
  std::vector<Draw> draws;
  for (int r = 0; r < rows; ++r)
    draws.push_back({temps[r % 4], ks[r % 5], ps[(r / 5) % 5], 1234u + static_cast<uint64_t>(r), r});
  const auto got = sample(x, vocab, draws);
  for (int r = 0; r < rows; ++r) {
    const Draw& w = draws[static_cast<size_t>(r)];
    const auto set = allowed_set(x.data() + static_cast<size_t>(r) * vocab, vocab, w.temperature, w.top_k,
                                 w.top_p, 1e-6);
    EXPECT_NE(std::find(set.begin(), set.end(), got[static_cast<size_t>(r)]), set.end())
        << "vocab " << vocab << " row " << r << " T " << w.temperature << " k " << w.top_k << " p "
        << w.top_p << ": token " << got[static_cast<size_t>(r)] << " outside a set of " << set.size();
  }
}
INSTANTIATE_TEST_SUITE_P(CudaSample, CudaSampleVocab, ::testing::Values(7, 1000, 32000, 151936),
                         [](const ::testing::TestParamInfo<int>& i) {
                           // Formatted, not "V" + std::to_string: g++ 12 warns (-Wrestrict) on that
                           // concatenation where it cannot overlap.
                           char name[16];
                           std::snprintf(name, sizeof name, "V%d", i.param);
                           return std::string(name);
                         });

// 4000 draws from fixed seeds: each frequency within 5 standard errors (sqrt(p (1 - p) / N)) of
// its probability, a failure chance of about 6e-7 per token were the draws independent; tokens
// outside the allowed set never drawn.
void check_frequencies(const std::vector<float>& row, float temperature, int top_k, float top_p,
                       bool vary_step) {
  const int vocab = static_cast<int>(row.size()), n = 4000;
  std::vector<float> x;
  std::vector<Draw> draws;
  for (int i = 0; i < n; ++i) {
    x.insert(x.end(), row.begin(), row.end());
    draws.push_back(vary_step ? Draw{temperature, top_k, top_p, 77u, i}
                              : Draw{temperature, top_k, top_p, 1000u + static_cast<uint64_t>(i), 5});
  }
  const auto got = sample(x, vocab, draws);
  const auto set = allowed_set(row.data(), vocab, temperature, top_k, top_p);
  // The cut must not sit within rounding of top_p, or the expected set would be ambiguous.
  ASSERT_EQ(set, allowed_set(row.data(), vocab, temperature, top_k, top_p, 1e-6));
  ASSERT_EQ(set, allowed_set(row.data(), vocab, temperature, top_k, top_p, -1e-6));
  std::vector<double> prob(static_cast<size_t>(vocab), 0.0);
  double sum = 0;
  for (int id : set) sum += prob[static_cast<size_t>(id)] = std::exp(static_cast<double>(row[static_cast<size_t>(id)]) / temperature);
  for (auto& p : prob) p /= sum;
  std::vector<int> count(static_cast<size_t>(vocab), 0);
  for (int id : got) {
    ASSERT_TRUE(id >= 0 && id < vocab) << id;
    ++count[static_cast<size_t>(id)];
  }
  for (int i = 0; i < vocab; ++i) {
    const double p = prob[static_cast<size_t>(i)], f = count[static_cast<size_t>(i)] / static_cast<double>(n);
    EXPECT_LE(std::abs(f - p), 5.0 * std::sqrt(p * (1 - p) / n) + 1e-12)
        << "token " << i << " frequency " << f << " probability " << p << " (T " << temperature << " k "
        << top_k << " p " << top_p << ")";
  }
}

// One setting a case: temperature, top-k, top-p, and whether the draws differ by step or by seed.
struct FrequencyCase {
  float temperature;
  int top_k;
  float top_p;
  bool vary_step;
  const char* name;
};

void PrintTo(const FrequencyCase& c, std::ostream* os) {
  *os << "T " << c.temperature << ", k " << c.top_k << ", p " << c.top_p << (c.vary_step ? ", by step" : ", by seed");
}

class CudaSampleFrequencies : public ::testing::TestWithParam<FrequencyCase> {};

TEST_P(CudaSampleFrequencies, MatchTheDistribution) {
  REQUIRE_GPU();
  const std::vector<float> row = {1.0f, 2.0f, 0.5f, 2.0f, -1.0f, 0.0f, 1.5f, -3.0f};
  const FrequencyCase& c = GetParam();
  check_frequencies(row, c.temperature, c.top_k, c.top_p, c.vary_step);
}
INSTANTIATE_TEST_SUITE_P(CudaSample, CudaSampleFrequencies,
                         ::testing::Values(FrequencyCase{1.0f, 0, 1.0f, false, "plain"},
                                           FrequencyCase{0.7f, 0, 1.0f, true, "temperature"},
                                           // the tie at 2.0 sits inside the five
                                           FrequencyCase{1.0f, 5, 1.0f, false, "top_k"},
                                           FrequencyCase{1.0f, 0, 0.8f, true, "top_p"},  // cut inside the set
                                           FrequencyCase{2.0f, 4, 0.6f, false, "all_three"}),
                         [](const ::testing::TestParamInfo<FrequencyCase>& i) { return std::string(i.param.name); });

TEST(CudaSample, SameSeedAndStepReplay) {
  REQUIRE_GPU();
  std::mt19937 rng(12);
  const int vocab = 32000, rows = 16;
  const auto x = gputest::random_bf16_exact(static_cast<size_t>(rows) * vocab, rng, 1.0f);
  std::vector<Draw> d, d2;
  for (int r = 0; r < rows; ++r) {
    d.push_back({1.0f, r % 2 ? 0 : 100, r % 3 ? 1.0f : 0.95f, 42u, r});
    d2.push_back({1.0f, r % 2 ? 0 : 100, r % 3 ? 1.0f : 0.95f, 42u, r + 1000});
  }
  const auto a = sample(x, vocab, d), b = sample(x, vocab, d), c = sample(x, vocab, d2);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);  // another step draws otherwise (16 near-flat rows: all equal is ~impossible)
}

// Route and sample captured into a CUDA graph (no host sync or allocation inside) and replayed:
// the same results as direct launches.
TEST(CudaSample, CapturesInAGraph) {
  REQUIRE_GPU();
  std::mt19937 rng(14);
  const int vocab = 4096, rows = 4, tokens = 8;
  const auto x = gputest::random_bf16_exact(static_cast<size_t>(rows) * vocab, rng, 2.0f);
  const auto logits = router_logits(tokens, 64, rng);
  std::vector<Draw> d;
  for (int r = 0; r < rows; ++r) d.push_back({1.0f, 40, 0.9f, 5u, r});
  const auto direct = sample(x, vocab, d);
  DeviceBuffer<float> dl(x), rl(logits), w(static_cast<size_t>(tokens) * 4);
  DeviceBuffer<int32_t> ids(static_cast<size_t>(tokens) * 4), out(rows);
  std::vector<float> t(rows, 1.0f), p(rows, 0.9f);
  std::vector<int32_t> kk(rows, 40), st = {0, 1, 2, 3};
  std::vector<uint64_t> sd(rows, 5);
  DeviceBuffer<float> dt(t), dp(p);
  DeviceBuffer<int32_t> dk(kk), dst(st);
  DeviceBuffer<uint64_t> ds(sd);
  k::SampleParams sp{dt.get(), dk.get(), dp.get(), ds.get(), dst.get()};
  k::RouterParams rp;
  rp.experts = 64, rp.top_k = 4, rp.renormalize = 1;
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreate(&stream), cudaSuccess);
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  EXPECT_EQ(k::route(rl.get(), rp, tokens, ids.get(), w.get(), stream), cudaSuccess);
  EXPECT_EQ(k::sample_rows(dl.get(), sp, rows, vocab, out.get(), stream), cudaSuccess);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  out.poison();
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  EXPECT_EQ(out.download(), direct);
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
}

// A padded row (row_stride > vocab, odd so that the rows are not 16-byte aligned): the padding
// holds the largest logits and must never be drawn or returned by greedy rows.
TEST(CudaSample, RowStridePaddingIsNeverDrawn) {
  REQUIRE_GPU();
  std::mt19937 rng(15);
  const int vocab = 30001, stride = 30013, rows = 12;
  auto x = gputest::random_bf16_exact(static_cast<size_t>(rows) * stride, rng, 2.0f);
  for (int r = 0; r < rows; ++r)
    for (int i = vocab; i < stride; ++i) x[static_cast<size_t>(r) * stride + i] = 1e9f;
  std::vector<float> t, p;
  std::vector<int32_t> kk, st;
  std::vector<uint64_t> sd;
  for (int r = 0; r < rows; ++r) {
    t.push_back(r % 4 == 0 ? 0.0f : 1.0f), kk.push_back(r % 3 == 0 ? 0 : 20), p.push_back(r % 2 ? 1.0f : 0.9f);
    sd.push_back(99u + static_cast<uint64_t>(r)), st.push_back(r);
  }
  DeviceBuffer<float> dl(x), dt(t), dp(p);
  DeviceBuffer<int32_t> dk(kk), dst(st), out(rows);
  DeviceBuffer<uint64_t> ds(sd);
  out.poison();
  k::SampleParams sp{dt.get(), dk.get(), dp.get(), ds.get(), dst.get(), stride};
  ASSERT_EQ(k::sample_rows(dl.get(), sp, rows, vocab, out.get(), nullptr), cudaSuccess);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  const auto got = out.download();
  for (int r = 0; r < rows; ++r) {
    const float* row = x.data() + static_cast<size_t>(r) * stride;
    const int32_t id = got[static_cast<size_t>(r)];
    if (t[static_cast<size_t>(r)] == 0.0f) {
      EXPECT_EQ(id, host_argmax(row, vocab)) << r;
      continue;
    }
    const auto set = allowed_set(row, vocab, 1.0f, kk[static_cast<size_t>(r)], p[static_cast<size_t>(r)], 1e-6);
    EXPECT_NE(std::find(set.begin(), set.end(), id), set.end()) << "row " << r << " token " << id;
  }
}

// Microseconds per launch: `reps` back-to-back launches captured in a CUDA graph, replayed, so
// that what is timed is what a decode graph pays (launch included, no host overhead).
template <typename Launch>
float graph_us(Launch&& launch, int reps = 100) {
  cudaStream_t s;
  cudaStreamCreate(&s);
  launch(s);  // outside the capture: function attributes, module loading
  cudaStreamSynchronize(s);
  cudaGraph_t g;
  cudaGraphExec_t e;
  cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
  for (int i = 0; i < reps; ++i) launch(s);
  cudaStreamEndCapture(s, &g);
  cudaGraphInstantiate(&e, g, 0);
  cudaGraphLaunch(e, s);
  cudaStreamSynchronize(s);
  gputest::EventTimer timer;
  const int replays = 5;
  timer.start(s);
  for (int i = 0; i < replays; ++i) cudaGraphLaunch(e, s);
  timer.stop(s);
  cudaGraphExecDestroy(e);
  cudaGraphDestroy(g);
  cudaStreamDestroy(s);
  return timer.ms() * 1000.0f / static_cast<float>(replays * reps);
}

// Timings, not checks: run with MOE_GPU_PERF=1 to print them.
TEST(CudaRouteSample, Timings) {
  REQUIRE_GPU();
  if (!std::getenv("MOE_GPU_PERF")) GTEST_SKIP() << "set MOE_GPU_PERF=1 for timings";
  std::mt19937 rng(13);
  for (int tokens : {1, 8, 64, 1024}) {
    const auto logits = router_logits(tokens, 256, rng);
    std::vector<float> q(static_cast<size_t>(tokens) * 128);
    std::normal_distribution<float> d(0.0f, 2.0f);
    for (auto& v : q) v = d(rng);
    DeviceBuffer<float> rl(logits), ql(q), bias(std::vector<float>(256, 0.1f)), w(static_cast<size_t>(tokens) * 8);
    DeviceBuffer<int32_t> ids(static_cast<size_t>(tokens) * 8);
    k::RouterParams v3;
    v3.experts = 256, v3.top_k = 8, v3.sigmoid = 1, v3.group_ranking = 2, v3.n_group = 8, v3.topk_group = 4;
    v3.bias = bias.get(), v3.renormalize = 1, v3.scaling = 2.5f;
    k::RouterParams qwen;
    qwen.experts = 128, qwen.top_k = 8, qwen.renormalize = 1;
    std::printf("route %4d tokens: softmax 128/8 %6.2f us, V3 256/8 grouped %6.2f us\n", tokens,
                graph_us([&](cudaStream_t s) { k::route(ql.get(), qwen, tokens, ids.get(), w.get(), s); }),
                graph_us([&](cudaStream_t s) { k::route(rl.get(), v3, tokens, ids.get(), w.get(), s); }));
  }
  const int vocab = 151936;
  const auto x = gputest::random_bf16_exact(static_cast<size_t>(64) * vocab, rng, 2.0f);
  DeviceBuffer<float> dl(x);
  DeviceBuffer<int32_t> out(64);
  std::printf("argmax_rows 8 x %d: %.1f us\n", vocab,
              graph_us([&](cudaStream_t s) { k::argmax_rows(dl.get(), 8, vocab, out.get(), s); }, 20));
  const Draw configs[] = {{0.0f, 0, 1.0f, 1, 0},  {1.0f, 0, 1.0f, 1, 0},   {1.0f, 50, 1.0f, 1, 0},
                          {1.0f, 0, 0.9f, 1, 0},  {0.8f, 50, 0.9f, 1, 0},  {1.0f, 1024, 1.0f, 1, 0}};
  for (int rows : {1, 8, 64}) {
    for (const Draw& c : configs) {
      std::vector<float> t(rows, c.temperature), p(rows, c.top_p);
      std::vector<int32_t> kk(rows, c.top_k), st(rows, 0);
      std::vector<uint64_t> sd(rows, 1);
      DeviceBuffer<float> dt(t), dp(p);
      DeviceBuffer<int32_t> dk(kk), dst(st);
      DeviceBuffer<uint64_t> ds(sd);
      k::SampleParams sp{dt.get(), dk.get(), dp.get(), ds.get(), dst.get()};
      std::printf("sample_rows %2d x %d, T %.1f top_k %4d top_p %.2f: %7.1f us\n", rows, vocab, c.temperature,
                  c.top_k, c.top_p,
                  graph_us([&](cudaStream_t s) { k::sample_rows(dl.get(), sp, rows, vocab, out.get(), s); }, 20));
    }
  }
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess);
}

}  // namespace
}  // namespace moe
