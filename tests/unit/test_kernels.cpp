// CPU kernels against straightforward double-precision loops.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/cpu/kernels.h"

namespace moe {
namespace {

std::vector<float> random_vec(size_t n, std::mt19937& rng) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

TEST(Kernels, LinearMatchesDoubleReference) {
  std::mt19937 rng(1);
  ThreadPool pool(3);
  for (auto [m, k, n] : {std::tuple{1, 7, 5}, {4, 16, 33}, {9, 64, 17}, {13, 129, 70}}) {
    auto x = random_vec(static_cast<size_t>(m * k), rng), w = random_vec(static_cast<size_t>(n * k), rng),
         b = random_vec(static_cast<size_t>(n), rng);
    std::vector<float> y(static_cast<size_t>(m * n), NAN);
    cpu::linear(pool, x.data(), w.data(), b.data(), y.data(), m, k, n);
    for (int i = 0; i < m; ++i)
      for (int j = 0; j < n; ++j) {
        double ref = b[static_cast<size_t>(j)];
        for (int t = 0; t < k; ++t) ref += double(x[static_cast<size_t>(i * k + t)]) * w[static_cast<size_t>(j * k + t)];
        ASSERT_NEAR(y[static_cast<size_t>(i * n + j)], ref, 1e-4 * std::sqrt(k)) << m << "x" << k << "x" << n;
      }
  }
}

TEST(Kernels, RmsNormAndSoftmax) {
  std::vector<float> x{1, 2, 3, 4, -1, 0, 0, 1}, w{1, 0.5f, 2, 1}, out(8);
  ThreadPool pool(2);
  cpu::rms_norm(pool, x.data(), w.data(), out.data(), 2, 4, 0.0f);
  double rms = std::sqrt((1 + 4 + 9 + 16) / 4.0);
  EXPECT_NEAR(out[2], 3 / rms * 2, 1e-6);
  EXPECT_NEAR(out[4], -1 / std::sqrt(0.5), 1e-6);
  std::vector<float> s{1, 2, 3, 1000, 1000, -1000};
  cpu::softmax_rows(s.data(), 2, 3);
  double z = std::exp(1.0) + std::exp(2.0) + std::exp(3.0);
  EXPECT_NEAR(s[0], std::exp(1.0) / z, 1e-6);
  EXPECT_NEAR(s[3], 0.5, 1e-6);  // large logits do not overflow
  EXPECT_NEAR(s[5], 0.0, 1e-6);
}

TEST(Kernels, RopeRotatesPairsByPositionAngle) {
  const int64_t hd = 4;
  std::vector<float> inv{1.0f, 0.25f};
  std::vector<int32_t> pos{3};
  std::vector<float> half{1, 2, 3, 4}, inter{1, 2, 3, 4};
  cpu::rope_half(half.data(), 1, 1, hd, hd, pos.data(), inv.data());
  cpu::rope_interleaved(inter.data(), 1, 1, hd, hd, pos.data(), inv.data());
  // half layout pairs (0, 2) and (1, 3); interleaved pairs (0, 1) and (2, 3).
  EXPECT_NEAR(half[0], 1 * std::cos(3.0) - 3 * std::sin(3.0), 1e-5);
  EXPECT_NEAR(half[2], 3 * std::cos(3.0) + 1 * std::sin(3.0), 1e-5);
  EXPECT_NEAR(half[1], 2 * std::cos(0.75) - 4 * std::sin(0.75), 1e-5);
  EXPECT_NEAR(inter[0], 1 * std::cos(3.0) - 2 * std::sin(3.0), 1e-5);
  EXPECT_NEAR(inter[1], 2 * std::cos(3.0) + 1 * std::sin(3.0), 1e-5);
  EXPECT_NEAR(inter[3], 4 * std::cos(0.75) + 3 * std::sin(0.75), 1e-5);
}

TEST(Kernels, CausalGqaAttentionMatchesReference) {
  std::mt19937 rng(5);
  ThreadPool pool(2);
  const int64_t tokens = 3, ctx = 5, qh = 4, kvh = 2, hd = 8, vd = 6;
  auto q = random_vec(tokens * qh * hd, rng), k = random_vec(ctx * kvh * hd, rng),
       v = random_vec(ctx * kvh * vd, rng);
  std::vector<float> out(static_cast<size_t>(tokens * qh * vd), NAN);
  const float scale = 0.3f;
  cpu::attention(pool, q.data(), k.data(), v.data(), out.data(), tokens, ctx, qh, kvh, hd, vd,
                 kvh * hd, kvh * vd, scale);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < qh; ++h) {
      int64_t g = h / (qh / kvh), visible = ctx - tokens + t + 1;
      std::vector<double> p(static_cast<size_t>(visible));
      double z = 0;
      for (int64_t j = 0; j < visible; ++j) {
        double s = 0;
        for (int64_t d = 0; d < hd; ++d) s += double(q[static_cast<size_t>((t * qh + h) * hd + d)]) * k[static_cast<size_t>((j * kvh + g) * hd + d)];
        p[static_cast<size_t>(j)] = std::exp(s * scale);
        z += p[static_cast<size_t>(j)];
      }
      for (int64_t d = 0; d < vd; ++d) {
        double ref = 0;
        for (int64_t j = 0; j < visible; ++j) ref += p[static_cast<size_t>(j)] / z * v[static_cast<size_t>((j * kvh + g) * vd + d)];
        ASSERT_NEAR(out[static_cast<size_t>((t * qh + h) * vd + d)], ref, 1e-5);
      }
    }
}

}  // namespace
}  // namespace moe
