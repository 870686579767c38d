// Whole models against Hugging Face transformers: tiny random checkpoints written by
// scripts/make_fixtures.py, with the logits and greedy continuations transformers computed for
// them (float32, on the CPU, on exactly the stored weights).
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "model/model.h"
#include "../support/fixtures.h"

namespace moe {
namespace {

// f32 checkpoints: both sides compute in f32, differing only in summation order.
// bf16/f16 checkpoints: the weights are stored rounded and upcast exactly, and the reference ran
// in f32 on those same rounded weights, so the same bound applies (see make_fixtures.py).
constexpr float kLogitBound = 1e-4f;

using test::fixture_dir;
using test::reference;

int32_t argmax(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 1; i < n; ++i)
    if (row[i] > row[best]) best = i;
  return static_cast<int32_t>(best);
}

class FixtureTest : public ::testing::TestWithParam<std::string> {};

TEST_P(FixtureTest, LogitsMatchTransformers) {
  const std::string dir = fixture_dir(GetParam());
  auto ref = reference(dir);
  auto model = Model::load(dir);
  EXPECT_EQ(model->config().architecture, ref["architecture"].get<std::string>());
  const int64_t vocab = model->config().vocab_size;
  const bool all_rows = ref.value("logits_rows", std::string("all")) == "all";
  for (size_t i = 0; i < ref["inputs"].size(); ++i) {
    auto ids = ref["inputs"][i].get<std::vector<int32_t>>();
    KvCache cache = model->new_cache(128);
    Tensor logits = model->forward(ids, cache, all_rows);
    const auto& expected = ref["logits"][i];
    ASSERT_EQ(logits.dim(0), static_cast<int64_t>(expected.size()));
    ASSERT_EQ(logits.dim(1), vocab);
    float worst = 0.0f;
    for (size_t r = 0; r < expected.size(); ++r) {
      auto row = expected[r].get<std::vector<float>>();
      ASSERT_EQ(static_cast<int64_t>(row.size()), vocab);
      for (int64_t v = 0; v < vocab; ++v)
        worst = std::max(worst, std::fabs(logits.data<float>()[static_cast<int64_t>(r) * vocab + v] - row[static_cast<size_t>(v)]));
    }
    EXPECT_LE(worst, kLogitBound) << GetParam() << " input " << i;
  }
}

TEST_P(FixtureTest, GreedyTokensMatchTransformers) {
  const std::string dir = fixture_dir(GetParam());
  auto ref = reference(dir);
  auto model = Model::load(dir);
  const int64_t vocab = model->config().vocab_size;
  for (size_t i = 0; i < ref["inputs"].size(); ++i) {
    auto ids = ref["inputs"][i].get<std::vector<int32_t>>();
    auto expected = ref["greedy"][i].get<std::vector<int32_t>>();
    KvCache cache = model->new_cache(128);
    Tensor logits = model->forward(ids, cache);
    std::vector<int32_t> got;
    for (size_t step = 0; step < expected.size(); ++step) {
      int32_t next = argmax(logits.data<float>(), vocab);
      got.push_back(next);
      std::vector<int32_t> one{next};
      if (step + 1 < expected.size()) logits = model->forward(one, cache);
    }
    EXPECT_EQ(got, expected) << GetParam() << " input " << i;
  }
}

// Decoding token by token through the KV cache gives the logits of one full forward.
TEST_P(FixtureTest, IncrementalDecodeMatchesPrefill) {
  auto model = Model::load(fixture_dir(GetParam()));
  const int64_t vocab = model->config().vocab_size;
  std::vector<int32_t> ids{5, 9, 1, 7, 3, 2, 8};
  KvCache full = model->new_cache(16);
  Tensor all = model->forward(ids, full, true);
  KvCache step = model->new_cache(16);
  float worst = 0.0f;
  for (size_t i = 0; i < ids.size(); ++i) {
    std::vector<int32_t> one{ids[i]};
    Tensor row = model->forward(one, step);
    for (int64_t v = 0; v < vocab; ++v)
      worst = std::max(worst, std::fabs(row.data<float>()[v] - all.data<float>()[static_cast<int64_t>(i) * vocab + v]));
  }
  EXPECT_LE(worst, 1e-5f);
}

// Sequences of different lengths in one batched forward give the logits each gives alone.
TEST_P(FixtureTest, BatchedForwardMatchesSeparateForwards) {
  auto model = Model::load(fixture_dir(GetParam()));
  const int64_t vocab = model->config().vocab_size;
  std::vector<std::vector<int32_t>> prompts{{5, 9, 1}, {7}, {3, 2, 8, 8, 4, 6}};
  std::vector<KvCache> caches;
  for (size_t i = 0; i < prompts.size(); ++i) caches.push_back(model->new_cache(16));
  std::vector<SequenceInput> batch;
  for (size_t i = 0; i < prompts.size(); ++i) batch.push_back({prompts[i], &caches[i], true});
  auto together = model->forward_batch(batch);
  std::vector<int32_t> next{11, 12, 13};  // a decode step for all three at once
  for (size_t i = 0; i < prompts.size(); ++i) batch[i] = {std::span<const int32_t>(&next[i], 1), &caches[i], false};
  auto step = model->forward_batch(batch);
  for (size_t i = 0; i < prompts.size(); ++i) {
    KvCache alone = model->new_cache(16);
    Tensor ref = model->forward(prompts[i], alone, true);
    ASSERT_EQ(ref.shape(), together[i].shape());
    for (int64_t j = 0; j < ref.numel(); ++j)
      ASSERT_NEAR(ref.data<float>()[j], together[i].data<float>()[j], 1e-5) << i;
    std::vector<int32_t> one{next[i]};
    Tensor ref_step = model->forward(one, alone);
    for (int64_t v = 0; v < vocab; ++v)
      ASSERT_NEAR(ref_step.data<float>()[v], step[i].data<float>()[v], 1e-5) << i;
  }
  // A bad sequence rejects the whole batch and leaves every cache as it was.
  std::vector<int32_t> bad{static_cast<int32_t>(vocab)};
  batch[1].ids = bad;
  EXPECT_THROW(model->forward_batch(batch), Error);
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(caches[i].length(), static_cast<int64_t>(prompts[i].size()) + 1);
}

INSTANTIATE_TEST_SUITE_P(Transformers, FixtureTest,
                         ::testing::Values("qwen3_dense_f32", "qwen3_dense_bf16_tied", "qwen3_moe_f32",
                                           "qwen3_moe_nonorm_f32", "qwen3_moe_bf16",
                                           "mixtral_f32", "mixtral_f16_sharded", "mixtral_bf16",
                                           "tiny_qwen3_moe", "deepseek_v2_f32",
                                           "deepseek_v2_grouped_f32", "deepseek_v3_f32",
                                           "deepseek_v3_g8_f32", "deepseek_v3_bf16",
                                           "qwen2_moe_f32", "olmoe_f32", "qwen3_moe_yarn_f32",
                                           "qwen3_moe_fp8", "deepseek_v3_fp8",
                                           "deepseek_v2_yarn_legacy_f32", "deepseek_v3_yarn_mtp_legacy_bf16",
                                           "mixtral_llama3_f32", "qwen3_dense_linear_f32"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace moe
