// The fused decode routing (src/backend/cuda/moe/norm_route.cu) against the CPU: residual add and
// RMSNorm as the CPU computes them (the residual exactly: one f32 add per element; the
// normalised rows within one bf16 step, the sum of squares being added in another order), router
// logits as a double-precision product of the same bf16 rows and weights (bound 1e-4 of the
// row's largest magnitude: f32 accumulation over `hidden` terms), and the expert choice exactly
// moe::route's on the logits the kernel produced (its contract: route()'s arithmetic). Every
// output is poisoned first; repeated launches check that the block counter is left ready. A
// padding row (past RouterParams::live_rows) is normalised as the others and takes no expert.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

#include "backend/cuda/ops/ops_launch.h"
#include "backend/cuda/moe/router_params.h"
#include "gpu_test_util.h"
#include "moe/errors.h"
#include "moe/router.h"
#include "moe/tensor.h"

namespace moe {
namespace {

using gputest::DeviceBuffer;
namespace k = cuda::kernels;

struct Case {
  int tokens, hidden, experts, top_k;
  bool sigmoid;
  int groups, n_group, topk_group;
};

void run_case(const Case& c, uint32_t seed) {
  std::mt19937 rng(seed);
  const size_t rows = static_cast<size_t>(c.tokens) * c.hidden;
  std::vector<float> x(rows), norm_w(static_cast<size_t>(c.hidden)), bias(static_cast<size_t>(c.experts));
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (auto& v : x) v = d(rng);
  for (auto& v : norm_w) v = std::uniform_real_distribution<float>(0.5f, 1.5f)(rng);
  for (auto& v : bias) v = std::uniform_real_distribution<float>(-0.1f, 0.1f)(rng);
  const auto branch = gputest::to_bf16(gputest::random_bf16_exact(rows, rng, 1.0f));
  const auto router_w = gputest::to_bf16(gputest::random_bf16_exact(
      static_cast<size_t>(c.experts) * c.hidden, rng, 0.1f));

  // CPU: residual, normalised bf16 rows, logits in double.
  std::vector<float> want_x(rows), want_h(rows), want_logits(static_cast<size_t>(c.tokens) * c.experts);
  for (int t = 0; t < c.tokens; ++t) {
    double ss = 0;
    for (int i = 0; i < c.hidden; ++i) {
      const size_t at = static_cast<size_t>(t) * c.hidden + i;
      want_x[at] = x[at] + bf16_to_f32(branch[at]);
      ss += static_cast<double>(want_x[at]) * want_x[at];
    }
    const double inv = 1.0 / std::sqrt(ss / c.hidden + 1e-6);
    for (int i = 0; i < c.hidden; ++i) {
      const size_t at = static_cast<size_t>(t) * c.hidden + i;
      want_h[at] = bf16_to_f32(f32_to_bf16(static_cast<float>(norm_w[i] * (want_x[at] * inv))));
    }
    for (int e = 0; e < c.experts; ++e) {
      double s = 0;
      for (int i = 0; i < c.hidden; ++i)
        s += static_cast<double>(bf16_to_f32(router_w[static_cast<size_t>(e) * c.hidden + i])) *
             want_h[static_cast<size_t>(t) * c.hidden + i];
      want_logits[static_cast<size_t>(t) * c.experts + e] = static_cast<float>(s);
    }
  }

  DeviceBuffer<float> dx(x), dnw(norm_w), dbias(bias), dlogits(want_logits.size()),
      dweights(static_cast<size_t>(c.tokens) * c.top_k);
  DeviceBuffer<uint16_t> dbranch(branch), drw(router_w), dh(rows);
  DeviceBuffer<int32_t> dids(static_cast<size_t>(c.tokens) * c.top_k);
  DeviceBuffer<unsigned> counter(std::vector<unsigned>{0u});
  k::NormRouteParams q;
  q.x = dx.get();
  q.branch = dbranch.get();
  q.norm_weight = dnw.get();
  q.eps = 1e-6f;
  q.normed = dh.get();
  q.router_weight = drw.get();
  q.logits = dlogits.get();
  q.counter = counter.get();
  q.hidden = c.hidden;
  // Sigmoid routers with their correction bias, every router renormalised and scaled by 2.5.
  const RouterConfig rc = gputest::router_config(c.experts, c.top_k, c.sigmoid, c.groups, c.n_group, c.topk_group,
                                                 c.sigmoid, true, 2.5f);
  k::RouterParams p = k::router_params(rc, dbias.get());
  // With more than one row, the last is padding (live_rows): normalised like the others, routed
  // to no expert.
  const int live = c.tokens > 1 ? c.tokens - 1 : c.tokens;
  DeviceBuffer<int32_t> dlive(std::vector<int32_t>{live});
  p.live_rows = dlive.get();

  for (int launch = 0; launch < 3; ++launch) {
    // Each launch starts from the same residual; outputs poisoned.
    ASSERT_EQ(cudaMemcpy(dx.get(), x.data(), rows * 4, cudaMemcpyHostToDevice), cudaSuccess);
    dh.poison();
    dlogits.poison();
    dids.poison();
    dweights.poison();
    ASSERT_EQ(k::norm_route(q, p, c.tokens, dids.get(), dweights.get(), nullptr), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(counter.download()[0], 0u) << "the block counter must be left at zero";
    const auto got_x = dx.download();
    const auto got_h = gputest::from_bf16(dh.download());
    const auto got_logits = dlogits.download();
    int bad = 0;
    for (size_t i = 0; i < rows; ++i) {
      if (got_x[i] != want_x[i] && bad++ < 3) ADD_FAILURE() << "residual " << i << ": " << got_x[i] << " vs " << want_x[i];
      const float step = std::ldexp(1.0f, std::ilogb(want_h[i]) - 7);  // one bf16 ulp
      if (!(std::abs(got_h[i] - want_h[i]) <= step) && bad++ < 3)
        ADD_FAILURE() << "normed " << i << ": " << got_h[i] << " vs " << want_h[i];
    }
    for (int t = 0; t < c.tokens; ++t) {
      float scale = 0;
      for (int e = 0; e < c.experts; ++e)
        scale = std::max(scale, std::abs(want_logits[static_cast<size_t>(t) * c.experts + e]));
      for (int e = 0; e < c.experts; ++e) {
        const size_t at = static_cast<size_t>(t) * c.experts + e;
        if (!(std::abs(got_logits[at] - want_logits[at]) <= 1e-4f * scale) && bad++ < 3)
          ADD_FAILURE() << "logit " << t << "," << e << ": " << got_logits[at] << " vs " << want_logits[at];
      }
    }
    EXPECT_EQ(bad, 0) << "tokens " << c.tokens << ", hidden " << c.hidden << ", experts " << c.experts;

    // The choice: moe::route on the kernel's own logits.
    validate_router(rc, "test");
    std::vector<int32_t> want_ids(static_cast<size_t>(c.tokens) * c.top_k);
    std::vector<float> want_w(want_ids.size());
    route(rc, got_logits.data(), c.sigmoid ? bias.data() : nullptr, c.tokens, want_ids.data(), want_w.data());
    std::fill(want_ids.begin() + static_cast<std::ptrdiff_t>(live) * c.top_k, want_ids.end(), -1);
    std::fill(want_w.begin() + static_cast<std::ptrdiff_t>(live) * c.top_k, want_w.end(), 0.0f);
    EXPECT_EQ(dids.download(), want_ids);
    const auto got_w = dweights.download();
    for (size_t i = 0; i < want_w.size(); ++i)
      EXPECT_NEAR(got_w[i], want_w[i], 1e-6f * std::abs(want_w[i])) << "weight " << i;
  }
}

TEST(CudaNormRoute, MatchesCpuNormProjectionAndRouter) {
  REQUIRE_GPU();
  const Case cases[] = {
      {1, 2048, 128, 8, false, 0, 1, 1},  // qwen3-30b-a3b decode
      {8, 2048, 128, 8, false, 0, 1, 1},
      {3, 2048, 64, 6, false, 1, 8, 3},   // deepseek-v2 group max
      {2, 1024, 256, 8, true, 2, 8, 4},   // deepseek-v3 style
      {5, 520, 60, 4, false, 0, 1, 1},    // widths off every power of two
      {2, 7168, 256, 8, true, 2, 8, 4},   // deepseek-v3 width: the most rows the fused path holds
  };
  uint32_t seed = 7;
  for (const Case& c : cases) run_case(c, ++seed);
}

TEST(CudaNormRoute, RefusesWhatItCannotRun) {
  REQUIRE_GPU();
  EXPECT_FALSE(k::norm_route_supported(9, 2048));      // more rows than the fused path takes
  EXPECT_FALSE(k::norm_route_supported(3, 7168));      // rows past the register budget
  EXPECT_FALSE(k::norm_route_supported(1, 2044));      // not a multiple of 8
  EXPECT_TRUE(k::norm_route_supported(1, 7168));
  k::NormRouteParams q;  // null pointers
  q.hidden = 2048;
  k::RouterParams p;
  p.experts = 128;
  p.top_k = 8;
  EXPECT_EQ(k::norm_route(q, p, 1, nullptr, nullptr, nullptr), cudaErrorInvalidValue);
}

}  // namespace
}  // namespace moe
