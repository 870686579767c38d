// Routers on hand-made logits whose answers are worked out by hand in the comments.
#include <gtest/gtest.h>

#include <cmath>

#include "moe/errors.h"
#include "moe/router.h"

namespace moe {
namespace {

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights;
};

Routed run(const RouterConfig& rc, const std::vector<float>& logits, const std::vector<float>& bias = {}) {
  const int64_t tokens = static_cast<int64_t>(logits.size()) / rc.num_experts;
  Routed r{std::vector<int32_t>(static_cast<size_t>(tokens * rc.top_k)),
           std::vector<float>(static_cast<size_t>(tokens * rc.top_k))};
  route(rc, logits.data(), bias.empty() ? nullptr : bias.data(), tokens, r.ids.data(), r.weights.data());
  return r;
}

float sigmoid(float x) { return 1.0f / (1.0f + std::exp(-x)); }

TEST(Router, SoftmaxTopKWithAndWithoutRenormalisation) {
  // logits 0, ln 2, ln 3, ln 4: softmax = 1/10, 2/10, 3/10, 4/10. Top-2 = experts 3 and 2,
  // returned in ascending expert order.
  std::vector<float> logits{0.0f, std::log(2.0f), std::log(3.0f), std::log(4.0f)};
  Routed plain = run(softmax_router(4, 2, false), logits);
  EXPECT_EQ(plain.ids, (std::vector<int32_t>{2, 3}));
  EXPECT_NEAR(plain.weights[0], 0.3f, 1e-6);
  EXPECT_NEAR(plain.weights[1], 0.4f, 1e-6);
  Routed norm = run(softmax_router(4, 2, true), logits);
  EXPECT_NEAR(norm.weights[0], 3.0f / 7.0f, 1e-6);
  EXPECT_NEAR(norm.weights[1], 4.0f / 7.0f, 1e-6);
}

TEST(Router, TiesGoToTheLowerIndex) {
  // Experts 1, 2 and 3 tie; top-2 takes 1 and 2. Two tied groups: the lower group wins.
  Routed r = run(softmax_router(4, 2, true), {0.0f, 1.0f, 1.0f, 1.0f});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{1, 2}));
  EXPECT_NEAR(r.weights[0], 0.5f, 1e-6);
  const RouterConfig g{.num_experts = 4, .top_k = 1, .scoring = RouterScoring::kSigmoid,
                       .groups = GroupRanking::kTop2Sum, .n_group = 2, .topk_group = 1};
  // Groups {0,1} and {2,3} both sum to the same; group 0 is kept, and in it expert 1 is best.
  Routed t = run(g, {0.5f, 1.0f, 1.0f, 0.5f});
  EXPECT_EQ(t.ids, (std::vector<int32_t>{1}));
}

TEST(Router, CorrectionBiasChangesTheChoiceButNotTheWeights) {
  RouterConfig rc{.num_experts = 4, .top_k = 2, .scoring = RouterScoring::kSigmoid, .groups = GroupRanking::kTop2Sum,
                  .n_group = 1, .topk_group = 1, .correction_bias = true, .renormalize = false, .scaling = 2.0f};
  std::vector<float> logits{2.0f, 1.0f, 0.0f, -1.0f};
  // Without bias: experts 0 and 1. A bias of +3 on expert 3 pulls it in ahead of expert 1.
  Routed unbiased = run(rc, logits, {0.0f, 0.0f, 0.0f, 0.0f});
  EXPECT_EQ(unbiased.ids, (std::vector<int32_t>{0, 1}));
  Routed biased = run(rc, logits, {0.0f, 0.0f, 0.0f, 3.0f});
  EXPECT_EQ(biased.ids, (std::vector<int32_t>{0, 3}));
  // The weights are the unbiased sigmoid scores times routed_scaling_factor.
  EXPECT_NEAR(biased.weights[0], 2.0f * sigmoid(2.0f), 1e-6);
  EXPECT_NEAR(biased.weights[1], 2.0f * sigmoid(-1.0f), 1e-6);
  rc.renormalize = true;
  Routed norm = run(rc, logits, {0.0f, 0.0f, 0.0f, 3.0f});
  float sum = sigmoid(2.0f) + sigmoid(-1.0f);
  EXPECT_NEAR(norm.weights[1], 2.0f * sigmoid(-1.0f) / sum, 1e-6);
}

TEST(Router, GroupMaskExcludesTheGlobalBestExpert) {
  // noaux_tc, 3 groups of 2, keep 1 group, top-2. Expert 0 is the single best expert, but its
  // group {0, 1} sums lower (0.95 + 0.05) than group {4, 5} (0.9 + 0.8).
  const RouterConfig rc{.num_experts = 6, .top_k = 2, .scoring = RouterScoring::kSigmoid,
                        .groups = GroupRanking::kTop2Sum, .n_group = 3, .topk_group = 1};
  auto logit = [](float p) { return std::log(p / (1.0f - p)); };
  std::vector<float> logits{logit(0.95f), logit(0.05f), logit(0.3f), logit(0.3f), logit(0.9f), logit(0.8f)};
  Routed r = run(rc, logits);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{4, 5}));
  EXPECT_NEAR(r.weights[0], 0.9f, 1e-5);
  // DeepSeek-V2 ranks groups by their best expert instead: group {0, 1} wins with 0.95.
  RouterConfig v2 = rc;
  v2.scoring = RouterScoring::kSoftmax;
  v2.groups = GroupRanking::kMax;
  std::vector<float> v2_logits{5.0f, 0.0f, 1.0f, 1.0f, 4.0f, 3.9f};
  Routed g = run(v2, v2_logits);
  EXPECT_EQ(g.ids, (std::vector<int32_t>{0, 1}));
  // With 2 groups kept, V2 would take experts 0 and 4.
  v2.topk_group = 2;
  EXPECT_EQ(run(v2, v2_logits).ids, (std::vector<int32_t>{0, 4}));
}

TEST(Router, InvalidConfigurations) {
  RouterConfig rc = softmax_router(4, 5, false);
  EXPECT_THROW(validate_router(rc, "cfg"), Error);
  rc.top_k = 2;
  rc.groups = GroupRanking::kTop2Sum;
  rc.n_group = 3;  // does not divide 4
  EXPECT_THROW(validate_router(rc, "cfg"), Error);
  rc.n_group = 4;  // groups of one expert cannot give a top-2 sum
  EXPECT_THROW(validate_router(rc, "cfg"), Error);
  rc.n_group = 2;
  rc.topk_group = 3;
  EXPECT_THROW(validate_router(rc, "cfg"), Error);
  rc.topk_group = 1;
  validate_router(rc, "cfg");
}

}  // namespace
}  // namespace moe
