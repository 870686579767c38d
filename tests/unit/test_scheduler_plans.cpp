// The scheduler's plans over a stand-in executor (no model): the step budget and the sequence
// limit hold, decodes come before prompt chunks, preemption and recomputation keep every request's
// output, a failing step loses nothing, and no block stays taken. The stand-in keeps its sequences
// in a real SequenceTable and "generates" a token that depends on the sequence's whole history
// and the draw index only, so a request's output shows whether it was fed the right tokens.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <random>

#include "moe/errors.h"
#include "runtime/executor.h"
#include "runtime/sequence_table.h"
#include "serve/scheduler.h"
#include "test_util.h"

namespace moe {
namespace {

using namespace serve;

constexpr int64_t kVocab = 1000;

// The token a request with these tokens so far draws as its draw-th.
int32_t next_token(const std::vector<int32_t>& history, int64_t draw) {
  uint64_t h = 1469598103934665603ull;
  for (int32_t t : history) h = (h ^ static_cast<uint64_t>(t)) * 1099511628211ull;
  return static_cast<int32_t>((h + static_cast<uint64_t>(draw) * 7919) % kVocab);
}

class FakeExecutor final : public runtime::Executor {
 public:
  FakeExecutor(int64_t max_sequences, int64_t kv_blocks, int64_t block_size, int64_t max_context)
      : limits_{max_sequences, max_context, block_size, kv_blocks, kVocab},
        blocks_(kv_blocks, block_size),
        table_(blocks_, max_sequences, max_context, true) {}

  const runtime::ExecutorLimits& limits() const override { return limits_; }
  int32_t open() override {
    const int32_t seq = table_.open();
    sampled_last_[seq] = false;
    return seq;
  }
  void close(int32_t seq) override { table_.close(seq); }
  int64_t length(int32_t seq) const override { return table_.at(seq).length; }
  int64_t reuse_prefix(int32_t seq, std::span<const int32_t> tokens) override {
    return table_.reuse_prefix(seq, tokens);
  }
  runtime::KvUsage kv_usage() const override {
    return {blocks_.num_blocks(), blocks_.free_blocks(), blocks_.cached_blocks()};
  }
  runtime::StepResult run(const runtime::StepPlan& plan) override {
    runtime::check_plan(plan, *this);
    if (fail_next) {
      fail_next = false;
      MOE_THROW(kInternal, "the device went away");
    }
    int64_t need = 0;
    for (const runtime::StepRow& r : plan.rows) need += table_.blocks_needed(r.seq, r.count);
    MOE_CHECK(need <= blocks_.free_blocks(), kInvalidArgument, "KV cache full");
    Recorded rec;
    std::vector<int32_t> out;
    for (const runtime::StepRow& r : plan.rows) {
      rec.decode.push_back(sampled_last_[r.seq]);  // the token it feeds is one it generated
      sampled_last_[r.seq] = r.sample;
      table_.reserve(r.seq, r.count);
      table_.append(r.seq, std::span<const int32_t>(plan.tokens).subspan(static_cast<size_t>(r.offset),
                                                                          static_cast<size_t>(r.count)));
      out.push_back(r.sample ? next_token(table_.at(r.seq).tokens, r.draw) : -1);
    }
    rec.plan = plan;
    plans.push_back(std::move(rec));
    return {out, std::vector<Tensor>(plan.rows.size())};
  }

  struct Recorded {
    runtime::StepPlan plan;
    std::vector<bool> decode;  // whether each row feeds the token its sequence drew last
  };
  std::vector<Recorded> plans;
  bool fail_next = false;

 private:
  runtime::ExecutorLimits limits_;
  BlockAllocator blocks_;
  SequenceTable table_;
  std::map<int32_t, bool> sampled_last_;
};

// What a request generates alone: each token drawn from its whole history.
std::vector<int32_t> alone(std::vector<int32_t> tokens, int64_t max_tokens) {
  std::vector<int32_t> out;
  for (int64_t d = 0; d < max_tokens; ++d) {
    out.push_back(next_token(tokens, d));
    tokens.push_back(out.back());
  }
  return out;
}

std::vector<int32_t> random_prompt(std::mt19937& rng, int64_t n) {
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto& t : p) t = static_cast<int32_t>(rng() % kVocab);
  return p;
}

// Submits n greedy requests (prompt length and max_tokens by index); returns each id's prompt
// and max_tokens.
using Submitted = std::map<uint64_t, std::pair<std::vector<int32_t>, int64_t>>;
Submitted submit_all(Scheduler& s, std::mt19937& rng, int n, const std::function<int64_t(int)>& prompt_len,
                     const std::function<int64_t(int)>& max_tokens) {
  Submitted submitted;
  for (int i = 0; i < n; ++i) {
    RequestOptions o;
    o.max_tokens = max_tokens(i);
    auto p = random_prompt(rng, prompt_len(i));
    submitted[s.submit(p, o)] = {p, o.max_tokens};
  }
  return submitted;
}

std::map<uint64_t, std::vector<int32_t>> run_to_end(Scheduler& s) {
  std::map<uint64_t, std::vector<int32_t>> got;
  for (int step = 0; s.busy(); ++step) {
    EXPECT_LT(step, 5000) << "the scheduler makes no progress";
    if (step >= 5000) break;
    for (const Event& e : s.step())
      if (e.token >= 0) got[e.id].push_back(e.token);
  }
  return got;
}

TEST(SchedulerPlans, BudgetAndSequenceLimitHoldAndDecodesComeFirst) {
  FakeExecutor x(4, 200, 4, 256);
  Scheduler s(x, SchedulerConfig{8, 0, true});
  std::mt19937 rng(3);
  const Submitted submitted =
      submit_all(s, rng, 10, [](int i) { return 1 + (i * 7) % 23; }, [](int i) { return 2 + i % 5; });
  const auto got = run_to_end(s);
  for (const auto& [id, req] : submitted) EXPECT_EQ(got.at(id), alone(req.first, req.second)) << id;
  ASSERT_FALSE(x.plans.empty());
  for (const auto& rec : x.plans) {
    EXPECT_LE(rec.plan.tokens.size(), 8u);
    EXPECT_LE(rec.plan.rows.size(), 4u);
    bool prompt_seen = false;
    for (size_t i = 0; i < rec.plan.rows.size(); ++i) {
      const bool decode = rec.decode[i];
      if (decode) {
        EXPECT_EQ(rec.plan.rows[i].count, 1);
      }
      EXPECT_FALSE(decode && prompt_seen) << "a decode row after a prompt chunk";
      prompt_seen = prompt_seen || !decode;
    }
  }
  EXPECT_EQ(s.stats().blocks_used, 0);
  EXPECT_EQ(s.stats().preemptions, 0);
}

TEST(SchedulerPlans, PreemptionAndRecomputationKeepEveryOutput) {
  FakeExecutor x(6, 10, 4, 256);  // 40 rows for six requests of up to 37
  Scheduler s(x, SchedulerConfig{32, 0, true});
  std::mt19937 rng(5);
  const Submitted submitted =
      submit_all(s, rng, 6, [](int i) { return 6 + 4 * i; }, [](int) { return 12; });
  const auto got = run_to_end(s);
  for (const auto& [id, req] : submitted) EXPECT_EQ(got.at(id), alone(req.first, req.second)) << id;
  EXPECT_GT(s.stats().preemptions, 0);
  EXPECT_EQ(s.stats().blocks_used, 0);
  EXPECT_EQ(x.kv_usage().free, 10);
}

TEST(SchedulerPlans, AFailedStepLosesNothing) {
  FakeExecutor x(3, 64, 4, 256);
  Scheduler s(x, SchedulerConfig{16, 0, true});
  std::mt19937 rng(7);
  const Submitted submitted =
      submit_all(s, rng, 3, [](int i) { return 5 + 3 * i; }, [](int) { return 6; });
  std::map<uint64_t, std::vector<int32_t>> got;
  for (const Event& e : s.step()) got[e.id].push_back(e.token);
  x.fail_next = true;
  EXPECT_THROW(s.step(), Error);
  for (auto& [id, tokens] : run_to_end(s)) got[id].insert(got[id].end(), tokens.begin(), tokens.end());
  for (const auto& [id, req] : submitted) EXPECT_EQ(got[id], alone(req.first, req.second)) << id;
  EXPECT_EQ(s.stats().blocks_used, 0);
}

TEST(SchedulerPlans, CancelClosesTheSequence) {
  FakeExecutor x(2, 32, 4, 256);
  Scheduler s(x, SchedulerConfig{8, 0, true});
  RequestOptions o;
  o.max_tokens = 50;
  const uint64_t a = s.submit(std::vector<int32_t>(9, 1), o);
  const uint64_t b = s.submit(std::vector<int32_t>(5, 2), o);
  const uint64_t c = s.submit(std::vector<int32_t>(5, 3), o);  // waits: two sequences at most
  s.step();
  s.step();
  EXPECT_GT(s.stats().blocks_used, 0);
  EXPECT_TRUE(s.cancel(a));
  EXPECT_TRUE(s.cancel(c));
  EXPECT_TRUE(s.cancel(b));
  EXPECT_FALSE(s.cancel(b));
  EXPECT_EQ(s.stats().blocks_used, 0);
  const auto events = s.step();
  ASSERT_EQ(events.size(), 3u);
  for (const Event& e : events) EXPECT_EQ(e.finish, FinishReason::kCancelled);
  EXPECT_FALSE(s.busy());
}

TEST(SchedulerPlans, ImpossibleConfigsAreRefused) {
  FakeExecutor x(4, 32, 4, 256);
  auto refused = [&](SchedulerConfig c, const std::string& words) {
    auto e = test::expect_error([&] { Scheduler s(x, c); });
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find(words), std::string::npos) << e.message();
  };
  refused(SchedulerConfig{3, 0, true}, "max_step_tokens (3) must be at least max_batch (4)");
  refused(SchedulerConfig{8, 257, true}, "max_context 257 must be in [2, 256]");
  refused(SchedulerConfig{8, 1, true}, "max_context 1");
}

}  // namespace
}  // namespace moe
