// cpu::Executor on the fixture models: a plan's logits are Model::forward's (one rank, and every
// expert-parallel backend over 2 and 3 rank threads), a prompt split into chunks and rows of
// several sequences in one step give the logits of each alone, and plans that do not fit are
// refused with one line before anything runs.
#include <gtest/gtest.h>

#include <cmath>

#include "backend/cpu/cpu_executor.h"
#include "model/model.h"
#include "../support/fixtures.h"
#include "../unit/test_util.h"

namespace moe {
namespace {

using runtime::RowLogits;
using runtime::StepPlan;
using runtime::StepRow;

StepRow row(int32_t seq, int32_t offset, int32_t count, RowLogits logits, bool sample = false) {
  return StepRow{.seq = seq, .offset = offset, .count = count, .sample = sample, .logits = logits};
}

float max_diff(const Tensor& a, const Tensor& b) {
  EXPECT_EQ(a.shape(), b.shape());
  float worst = 0;
  for (int64_t i = 0; i < std::min(a.numel(), b.numel()); ++i)
    worst = std::max(worst, std::fabs(a.data<float>()[i] - b.data<float>()[i]));
  return worst;
}

cpu::ExecutorOptions small_pool() {
  cpu::ExecutorOptions o;
  o.kv_blocks = 16;
  o.block_size = 4;
  o.max_sequences = 3;
  o.max_context = 64;
  return o;
}

const std::vector<int32_t> kIds{3, 17, 42, 7, 99, 5, 250, 11, 4};

class CpuExecutorTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    LoadOptions lo;
    lo.threads = 1;
    model = Model::load(test::fixture_dir(GetParam()), lo);
    KvCache cache = model->new_cache(64);
    reference = model->forward(kIds, cache, /*all_logits=*/true);
  }
  std::unique_ptr<Model> model;
  Tensor reference;  // Model::forward's logits for every position of kIds
};

TEST_P(CpuExecutorTest, ChunksAndBatchedRowsGiveTheLogitsOfOneForward) {
  cpu::Executor x(*model, small_pool());
  // Sequence a: the prompt in one row. Sequence b: the same prompt in chunks of 5 and 4, the
  // second chunk in the same step as a third sequence's first token.
  const int32_t a = x.open(), b = x.open();
  StepPlan one{kIds, {row(a, 0, 9, RowLogits::kAll)}};
  const Tensor whole = x.run(one).logits[0];
  EXPECT_LE(max_diff(whole, reference), 1e-5f);

  StepPlan first{std::vector<int32_t>(kIds.begin(), kIds.begin() + 5), {row(b, 0, 5, RowLogits::kNone)}};
  EXPECT_EQ(x.run(first).logits[0].numel(), 0);  // no logits asked for, none given
  const int32_t c = x.open();
  StepPlan second{std::vector<int32_t>(kIds.begin() + 5, kIds.end()), {}};
  second.tokens.push_back(kIds[0]);
  second.rows = {row(b, 0, 4, RowLogits::kLast), row(c, 4, 1, RowLogits::kLast)};
  const runtime::StepResult out = x.run(second);
  ASSERT_EQ(out.logits[0].dim(0), 1);
  const int64_t v = model->config().vocab_size;
  float worst_b = 0, worst_c = 0;
  for (int64_t j = 0; j < v; ++j) {
    worst_b = std::max(worst_b, std::fabs(out.logits[0].data<float>()[j] - reference.data<float>()[8 * v + j]));
    worst_c = std::max(worst_c, std::fabs(out.logits[1].data<float>()[j] - reference.data<float>()[j]));
  }
  EXPECT_LE(worst_b, 1e-5f);
  EXPECT_LE(worst_c, 1e-5f);
  EXPECT_EQ(x.length(b), 9);
  EXPECT_EQ(x.length(c), 1);
  EXPECT_EQ(out.tokens, (std::vector<int32_t>{-1, -1}));  // no row asked to sample
}

TEST_P(CpuExecutorTest, ExpertParallelRanksGiveTheLogitsOfOneRank) {
  const int64_t experts = model->config().moe.num_experts;
  for (auto backend : {dist::EpBackend::kLocalAllreduce, dist::EpBackend::kAllgatherReducescatter,
                       dist::EpBackend::kAlltoallPadded, dist::EpBackend::kAlltoallPacked}) {
    for (int ep : {2, 3}) {
      if (ep > experts) continue;
      LoadOptions lo;
      lo.threads = 2;
      lo.ep_backend = backend;
      auto x = cpu::Executor::load(test::fixture_dir(GetParam()), lo, ep, small_pool());
      ASSERT_EQ(x->ranks(), ep);
      const int32_t s = x->open();
      StepPlan plan{kIds, {row(s, 0, 9, RowLogits::kAll, true)}};
      const runtime::StepResult out = x->run(plan);
      const std::string what = std::string(dist::ep_backend_name(backend)) + " ep=" + std::to_string(ep);
      EXPECT_LE(max_diff(out.logits[0], reference), 1e-5f) << what;
      // Greedy: the draw is the argmax of the last position.
      const int64_t v = model->config().vocab_size;
      const float* last = reference.data<float>() + 8 * v;
      EXPECT_EQ(out.tokens[0], std::max_element(last, last + v) - last) << what;
      // A decode step after it, on every rank.
      StepPlan next{{out.tokens[0]}, {row(s, 0, 1, RowLogits::kLast)}};
      Tensor l = x->run(next).logits[0];
      KvCache cache = model->new_cache(64);
      model->forward(kIds, cache);
      EXPECT_LE(max_diff(l, model->forward(std::vector<int32_t>{out.tokens[0]}, cache)), 1e-5f) << what;
    }
  }
}

TEST_P(CpuExecutorTest, PlansThatDoNotFitAreRefusedBeforeAnythingRuns) {
  cpu::Executor x(*model, small_pool());
  const int32_t s = x.open();
  auto refused = [&](const StepPlan& p, const std::string& words) {
    auto e = test::expect_error([&] { x.run(p); });
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find(words), std::string::npos) << e.message();
    EXPECT_EQ(e.message().find('\n'), std::string::npos);
    EXPECT_EQ(x.length(s), 0) << "a refused plan ran";
  };
  refused(StepPlan{}, "at least one row");
  refused(StepPlan{{1, 2}, {row(s, 1, 2, RowLogits::kNone)}}, "outside the step's 2 tokens");
  refused(StepPlan{{1, 2}, {row(s, 0, 1, RowLogits::kNone), row(s, 1, 1, RowLogits::kNone)}},
          "appears twice");
  refused(StepPlan{{1}, {row(7, 0, 1, RowLogits::kNone)}}, "sequence 7 is not open");
  const auto vocab = static_cast<int32_t>(model->config().vocab_size);
  refused(StepPlan{{vocab}, {row(s, 0, 1, RowLogits::kNone)}}, "outside the vocabulary");
  refused(StepPlan{std::vector<int32_t>(65, 1), {row(s, 0, 65, RowLogits::kNone)}}, "exceed the context of 64");
  StepRow bad_sampling = row(s, 0, 1, RowLogits::kNone, true);
  bad_sampling.sampling.top_p = 0;
  refused(StepPlan{{1}, {bad_sampling}}, "top-p");
  // Two sequences that need more blocks than the pool has between them (16 of 4 tokens).
  const int32_t t = x.open();
  refused(StepPlan{std::vector<int32_t>(80, 1), {row(s, 0, 40, RowLogits::kNone), row(t, 40, 40, RowLogits::kNone)}},
          "KV cache full: 20 more blocks needed, 16 free");
  EXPECT_EQ(x.kv_usage().free, 16);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CpuExecutorTest,
                         ::testing::Values("qwen3_moe_f32", "deepseek_v2_f32", "mixtral_f32"),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace moe
