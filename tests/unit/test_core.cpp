#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <random>

#include "core/arena.h"
#include "core/thread_pool.h"
#include "moe/errors.h"
#include "moe/tensor.h"
#include "runtime/sampler.h"
#include "test_util.h"

namespace moe {
namespace {

TEST(DType, HalfPrecisionKnownValues) {
  // Bit patterns from the IEEE 754 binary16 and bfloat16 definitions.
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0xc000), -2.0f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x0400), std::ldexp(1.0f, -14));  // smallest normal
  EXPECT_TRUE(std::isinf(f16_to_f32(0x7c00)));
  EXPECT_TRUE(std::isnan(f16_to_f32(0x7e00)));
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_EQ(bf16_to_f32(0xc2f7), -123.5f);
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(f32_to_f16(1.0f), 0x3c00);
  EXPECT_EQ(f32_to_f16(65504.0f), 0x7bff);
  EXPECT_EQ(f32_to_f16(1e6f), 0x7c00);  // overflow to infinity
  EXPECT_EQ(f32_to_f16(std::ldexp(1.0f, -24)), 0x0001);
  // Ties round to even: 1 + 2^-8 lies halfway between two bf16 values.
  EXPECT_EQ(f32_to_bf16(1.0f + std::ldexp(1.0f, -8)), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 3 * std::ldexp(1.0f, -8)), 0x3f82);
  EXPECT_EQ(f32_to_f16(1.0f + std::ldexp(1.0f, -11)), 0x3c00);
}

TEST(DType, EveryHalfRoundTrips) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    uint16_t h = static_cast<uint16_t>(bits);
    float f = f16_to_f32(h);
    if (std::isnan(f)) continue;
    ASSERT_EQ(f32_to_f16(f), h) << std::hex << bits;
    float b = bf16_to_f32(h);
    if (!std::isnan(b)) ASSERT_EQ(f32_to_bf16(b), h) << std::hex << bits;
  }
}

TEST(Tensor, ShapesViewsAndRows) {
  Tensor t = Tensor::zeros({3, 4});
  EXPECT_EQ(t.numel(), 12);
  EXPECT_EQ(t.nbytes(), 48u);
  for (int i = 0; i < 12; ++i) t.data<float>()[i] = static_cast<float>(i);
  Tensor r = t.rows(1, 3);
  EXPECT_EQ(r.dim(0), 2);
  EXPECT_EQ(r.data<float>()[0], 4.0f);
  EXPECT_EQ(t.reshape({2, 6}).dim(1), 6);
  EXPECT_THROW(t.reshape({5}), Error);
  EXPECT_THROW(t.rows(2, 4), Error);
  EXPECT_THROW(t.dim(2), Error);
}

TEST(Arena, AlignsResetsAndTracksHighWater) {
  Arena arena("test", 1024);
  void* a = arena.allocate(10, 64);
  void* b = arena.allocate(100, 64);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(a) % 64, 0u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(b) % 64, 0u);
  EXPECT_GE(static_cast<char*>(b) - static_cast<char*>(a), 10);
  void* big = arena.allocate(5000);  // larger than a chunk: gets its own
  std::memset(big, 1, 5000);
  size_t high = arena.high_water();
  EXPECT_GE(high, 5110u);
  arena.reset();
  EXPECT_EQ(arena.used(), 0u);
  EXPECT_EQ(arena.allocate(10, 64), a);  // memory is reused after reset
  EXPECT_EQ(arena.high_water(), high);
}

TEST(ThreadPool, CoversRangeOnceAndPropagatesErrors) {
  ThreadPool pool(4);
  std::vector<std::atomic<int>> hits(1000);
  pool.parallel_for(1000, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)]++;
  });
  for (auto& h : hits) ASSERT_EQ(h.load(), 1);
  EXPECT_THROW(pool.parallel_for(100, [](int64_t b, int64_t) {
    if (b > 0) throw std::runtime_error("worker failed");
  }), std::runtime_error);
  // Still usable after an error, and nested calls run inline instead of deadlocking.
  std::atomic<int64_t> total{0};
  pool.parallel_for(8, [&](int64_t b, int64_t e) {
    pool.parallel_for(10, [&](int64_t b2, int64_t e2) { total += (e - b) * (e2 - b2); });
  });
  EXPECT_EQ(total.load(), 80);
}

TEST(Sampler, GreedyTopKAndSeeds) {
  std::vector<float> logits{0.1f, 2.0f, -1.0f, 2.0f, 1.5f};
  Sampler greedy({});
  EXPECT_EQ(greedy.sample(logits.data(), 5), 1);  // first of the tied maxima
  Sampler top1({1.0f, 1, 1.0f, 7});
  EXPECT_EQ(top1.sample(logits.data(), 5), 1);
  // top-k 3 never picks outside {1, 3, 4}; top-p tiny keeps only the best.
  Sampler top3({1.0f, 3, 1.0f, 11});
  for (int i = 0; i < 200; ++i) {
    int32_t id = top3.sample(logits.data(), 5);
    ASSERT_TRUE(id == 1 || id == 3 || id == 4) << id;
  }
  Sampler nucleus({1.0f, 0, 0.01f, 3});
  for (int i = 0; i < 50; ++i) ASSERT_EQ(nucleus.sample(logits.data(), 5), 1);
  // The same seed gives the same sequence; sampling follows the distribution.
  Sampler s1({1.0f, 0, 1.0f, 42}), s2({1.0f, 0, 1.0f, 42});
  std::vector<int> counts(5);
  for (int i = 0; i < 4000; ++i) {
    int32_t a = s1.sample(logits.data(), 5);
    ASSERT_EQ(a, s2.sample(logits.data(), 5));
    counts[static_cast<size_t>(a)]++;
  }
  double z = 0;
  for (float l : logits) z += std::exp(l);
  for (size_t i = 0; i < 5; ++i)
    EXPECT_NEAR(counts[i] / 4000.0, std::exp(logits[i]) / z, 0.03) << i;
  EXPECT_THROW(Sampler({-1.0f, 0, 1.0f, 0}), Error);
  EXPECT_THROW(Sampler({1.0f, 0, 0.0f, 0}), Error);
  EXPECT_THROW(Sampler({1.0f, -2, 1.0f, 0}), Error);
}

// A top_k at or past the vocabulary means every token: the draws follow the full softmax, as
// with top_k 0 (not a truncated or wrapped integer).
TEST(Sampler, TopKPastTheVocabularyIsTheWholeVocabulary) {
  std::vector<float> logits{0.1f, 2.0f, -1.0f, 2.0f, 1.5f};
  double z = 0;
  for (float l : logits) z += std::exp(l);
  for (int k : {5, 6, 1 << 30, std::numeric_limits<int>::max()}) {
    Sampler s({1.0f, k, 1.0f, 9});
    std::vector<int> counts(5);
    for (int i = 0; i < 4000; ++i) counts[static_cast<size_t>(s.sample(logits.data(), 5))]++;
    for (size_t i = 0; i < 5; ++i) EXPECT_NEAR(counts[i] / 4000.0, std::exp(logits[i]) / z, 0.03) << "k " << k << " id " << i;
  }
}

// A temperature too small to divide by (denormal, or under 1e-5) is greedy, never NaN.
TEST(Sampler, TinyTemperatureIsGreedy) {
  std::vector<float> logits{0.1f, 2.0f, -1.0f, 2.0f, 1.5f};
  for (float t : {std::numeric_limits<float>::denorm_min(), 1e-38f, 1e-7f, 9e-6f}) {
    Sampler s({t, 0, 0.9f, 5});
    for (int i = 0; i < 20; ++i) ASSERT_EQ(s.sample(logits.data(), 5), 1) << t;
    EXPECT_EQ(effective_sampling({t, 0, 0.9f, 5}, 5).temperature, 0.0f);
  }
  EXPECT_EQ(effective_sampling({1e-4f, 0, 1.0f, 0}, 5).temperature, 1e-4f);
  // Huge logits at a small temperature stay finite: the draw is still from the two best.
  std::vector<float> big{3e38f, -3e38f, 3e38f, 0.0f};
  Sampler hot({1e-4f, 0, 1.0f, 1});
  for (int i = 0; i < 50; ++i) {
    const int32_t id = hot.sample(big.data(), 4);
    ASSERT_TRUE(id == 0 || id == 2) << id;
  }
}

// Over a real vocabulary size, top-p draws stay inside the nucleus computed here by sorting every
// probability, and follow its renormalised distribution.
TEST(Sampler, NucleusOverALargeVocabulary) {
  const int64_t vocab = 151936;
  std::vector<float> logits(static_cast<size_t>(vocab));
  std::mt19937 rng(17);
  std::normal_distribution<float> noise(0.0f, 1.0f);
  for (auto& l : logits) l = noise(rng);
  for (int i = 0; i < 40; ++i) logits[static_cast<size_t>(i * 3001)] = 9.0f - 0.1f * static_cast<float>(i);
  const float temperature = 0.8f, top_p = 0.7f;
  std::vector<std::pair<double, int32_t>> probs;
  double z = 0;
  for (int64_t i = 0; i < vocab; ++i) z += std::exp(static_cast<double>(logits[static_cast<size_t>(i)]) / temperature);
  for (int64_t i = 0; i < vocab; ++i)
    probs.push_back({std::exp(static_cast<double>(logits[static_cast<size_t>(i)]) / temperature) / z,
                     static_cast<int32_t>(i)});
  std::sort(probs.begin(), probs.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  std::map<int32_t, double> nucleus;
  double mass = 0;
  for (const auto& [p, id] : probs) {
    nucleus[id] = p;
    mass += p;
    if (mass >= top_p) break;
  }
  ASSERT_GT(nucleus.size(), 64u);  // past the first selection round
  Sampler s({temperature, 0, top_p, 23});
  std::map<int32_t, int> counts;
  const int draws = 6000;
  for (int i = 0; i < draws; ++i) {
    const int32_t id = s.sample(logits.data(), vocab);
    ASSERT_TRUE(nucleus.count(id)) << "token " << id << " is outside the nucleus";
    counts[id]++;
  }
  for (const auto& [id, p] : nucleus)
    if (p / mass > 0.02) EXPECT_NEAR(counts[id] / static_cast<double>(draws), p / mass, 0.02) << id;
}

}  // namespace
}  // namespace moe
