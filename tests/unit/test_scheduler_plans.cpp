// The scheduler's plans over a stand-in executor (no model): the step budget and the sequence
// limit hold, decodes come before prompt chunks, preemption and recomputation keep every request's
// output (also with data-parallel groups, each with its own blocks), a failing step loses nothing (also one that ran part of its rows before it failed), and
// no block or sequence stays taken. The stand-in keeps its sequences in a real SequenceTable and
// "generates" a token that depends on the sequence's whole history and the draw index only, so a
// request's output shows whether it was fed the right tokens. Last, the request loop over the
// scheduler after such a failure.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>

#include "moe/errors.h"
#include "runtime/executor.h"
#include "runtime/sequence_table.h"
#include "serve/request_loop.h"
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
  // `groups` attention groups (data-parallel ranks), each of max_sequences and kv_blocks of its
  // own; a sequence lives in the group with the fewest open ones, and its id names the group.
  FakeExecutor(int64_t max_sequences, int64_t kv_blocks, int64_t block_size, int64_t max_context, int groups = 1)
      : limits_{max_sequences * groups, max_context, block_size, kv_blocks * groups, kVocab, groups} {
    for (int g = 0; g < groups; ++g) {
      blocks_.push_back(std::make_unique<BlockAllocator>(kv_blocks, block_size));
      tables_.push_back(std::make_unique<SequenceTable>(*blocks_.back(), max_sequences, max_context, true, g, groups));
    }
  }

  const runtime::ExecutorLimits& limits() const override { return limits_; }
  int32_t open() override {
    size_t g = 0;
    for (size_t i = 1; i < tables_.size(); ++i)
      if (tables_[i]->open_count() < tables_[g]->open_count()) g = i;
    const int32_t seq = tables_[g]->open();
    sampled_last_[seq] = false;
    open_.insert(seq);
    return seq;
  }
  void close(int32_t seq) override {
    closes.push_back({group_of(seq), table(seq).at(seq).length});
    table(seq).close(seq);
    open_.erase(seq);
  }
  int64_t length(int32_t seq) const override { return table(seq).at(seq).length; }
  int64_t reuse_prefix(int32_t seq, std::span<const int32_t> tokens) override {
    return table(seq).reuse_prefix(seq, tokens);
  }
  runtime::KvUsage kv_usage() const override {
    runtime::KvUsage u;
    for (int g = 0; g < static_cast<int>(blocks_.size()); ++g) {
      const runtime::KvUsage x = group_kv_usage(g);
      u.total += x.total, u.free += x.free, u.cached += x.cached;
    }
    return u;
  }
  int group_of(int32_t seq) const override { return seq % static_cast<int32_t>(tables_.size()); }
  runtime::KvUsage group_kv_usage(int g) const override {
    const BlockAllocator& b = *blocks_[static_cast<size_t>(g)];
    return {b.num_blocks(), b.free_blocks(), b.cached_blocks()};
  }
  runtime::StepResult run(const runtime::StepPlan& plan) override {
    runtime::check_plan(plan, *this);
    std::vector<int64_t> need(blocks_.size(), 0);
    for (const runtime::StepRow& r : plan.rows)
      need[static_cast<size_t>(group_of(r.seq))] += table(r.seq).blocks_needed(r.seq, r.count);
    for (size_t g = 0; g < need.size(); ++g)
      MOE_CHECK(need[g] <= blocks_[g]->free_blocks(), kInvalidArgument, "KV cache full in group {}", g);
    Recorded rec;
    std::vector<int32_t> out;
    const bool fail = fail_after_rows >= 0;
    const size_t rows = fail ? std::min(plan.rows.size(), static_cast<size_t>(fail_after_rows)) : plan.rows.size();
    for (size_t i = 0; i < rows; ++i) {
      const runtime::StepRow& r = plan.rows[i];
      rec.decode.push_back(sampled_last_[r.seq]);  // the token it feeds is one it generated
      sampled_last_[r.seq] = r.sample;
      table(r.seq).reserve(r.seq, r.count);
      table(r.seq).append(r.seq, std::span<const int32_t>(plan.tokens).subspan(static_cast<size_t>(r.offset),
                                                                                static_cast<size_t>(r.count)));
      out.push_back(r.sample ? next_token(table(r.seq).at(r.seq).tokens, r.draw) : -1);
    }
    if (fail) {
      fail_after_rows = -1;
      failed_plan = plan;
      MOE_THROW(kInternal, "the device went away");
    }
    rec.plan = plan;
    plans.push_back(std::move(rec));
    return {out, std::vector<Tensor>(plan.rows.size())};
  }

  struct Recorded {
    runtime::StepPlan plan;
    std::vector<bool> decode;  // whether each row feeds the token its sequence drew last
  };
  // The open sequences, and the tokens whose keys and values one of them holds.
  std::vector<int32_t> open_sequences() const { return {open_.begin(), open_.end()}; }
  const std::vector<int32_t>& history(int32_t seq) const { return table(seq).at(seq).tokens; }

  std::vector<Recorded> plans;
  std::vector<std::pair<int, int64_t>> closes;  // each closed sequence's group and length
  // >= 0: the next run feeds that many of its rows (their tokens into the cache, as a device
  // that failed partway through a step leaves them), then throws and records the plan.
  int64_t fail_after_rows = -1;
  runtime::StepPlan failed_plan;

 private:
  SequenceTable& table(int32_t seq) { return *tables_[static_cast<size_t>(group_of(seq))]; }
  const SequenceTable& table(int32_t seq) const { return *tables_[static_cast<size_t>(group_of(seq))]; }

  runtime::ExecutorLimits limits_;
  std::vector<std::unique_ptr<BlockAllocator>> blocks_;
  std::vector<std::unique_ptr<SequenceTable>> tables_;
  std::map<int32_t, bool> sampled_last_;
  std::set<int32_t> open_;
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

// Steps until nothing is left; after_step runs after each step.
std::map<uint64_t, std::vector<int32_t>> run_to_end(Scheduler& s, const std::function<void()>& after_step = {}) {
  std::map<uint64_t, std::vector<int32_t>> got;
  for (int step = 0; s.busy(); ++step) {
    EXPECT_LT(step, 5000) << "the scheduler makes no progress";
    if (step >= 5000) break;
    for (const Event& e : s.step())
      if (e.token >= 0) got[e.id].push_back(e.token);
    if (after_step) after_step();
  }
  return got;
}

// Every open sequence holds the start of one request's tokens (its prompt, then what it generates
// alone): each request was fed from where its sequence ends, no token twice and none skipped.
void expect_sequences_follow_requests(const FakeExecutor& x, const Submitted& submitted) {
  for (int32_t seq : x.open_sequences()) {
    const std::vector<int32_t>& held = x.history(seq);
    bool found = false;
    for (const auto& [id, req] : submitted) {
      std::vector<int32_t> all = req.first;
      const std::vector<int32_t> generated = alone(req.first, req.second);
      all.insert(all.end(), generated.begin(), generated.end());
      found = found || (held.size() <= all.size() && std::equal(held.begin(), held.end(), all.begin()));
    }
    EXPECT_TRUE(found) << "sequence " << seq << " holds " << held.size() << " tokens that are no request's";
  }
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

// Data-parallel attention: each group has its own blocks, so a request that needs room must
// preempt a request of its own group (preempting another group's frees nothing it can use, and
// the stand-in refuses a step that overfills a group). Every output is still the request's alone,
// and the per-group load adds up to the totals while requests run.
TEST(SchedulerPlans, GroupsPreemptWithinTheirOwnBlocksAndKeepEveryOutput) {
  FakeExecutor x(3, 8, 4, 256, 2);  // two groups of 3 sequences and 32 rows each
  Scheduler s(x, SchedulerConfig{32, 0, true});
  std::mt19937 rng(11);
  const Submitted submitted =
      submit_all(s, rng, 9, [](int i) { return 3 + 2 * i; }, [](int i) { return 8 + i % 3; });
  bool both_busy = false;
  const auto got = run_to_end(s, [&] {
    const SchedulerStats st = s.stats();
    ASSERT_EQ(st.groups.size(), 2u);
    EXPECT_EQ(st.groups[0].running + st.groups[1].running, st.running);
    EXPECT_EQ(st.groups[0].blocks_used + st.groups[1].blocks_used, st.blocks_used);
    both_busy = both_busy || (st.groups[0].running > 0 && st.groups[1].running > 0);
  });
  for (const auto& [id, req] : submitted) EXPECT_EQ(got.at(id), alone(req.first, req.second)) << id;
  EXPECT_TRUE(both_busy) << "the requests never ran on both groups at once";
  EXPECT_GT(s.stats().preemptions, 0);
  EXPECT_EQ(s.stats().blocks_used, 0);
  EXPECT_EQ(x.kv_usage().free, 16);
  // A request that one group's blocks cannot hold is refused at submit, though both groups' could.
  RequestOptions o;
  o.max_tokens = 8;
  EXPECT_EQ(test::error_kind_of([&] { s.submit(random_prompt(rng, 30), o); }), ErrorKind::kInvalidArgument);
}

// The newest running request overall is in the group with room; the one that must give way is
// the newest of the full group. Requests 1 and 3 (group 0) outgrow its 8 blocks; 2 and 4 (group
// 1) fit and must finish without ever being preempted.
// Data-parallel attention: each group (GPU) runs its own prompt chunks, so the step budget holds
// per group. No group's rows exceed it, some step fills it in both groups at once (a single
// budget would have split it between them), and every output is still the request's alone.
TEST(SchedulerPlans, EachGroupHasTheWholeStepBudget) {
  FakeExecutor x(3, 40, 4, 256, 2);
  Scheduler s(x, SchedulerConfig{8, 0, true});
  std::mt19937 rng(17);
  const Submitted submitted =
      submit_all(s, rng, 8, [](int i) { return 9 + 5 * i; }, [](int i) { return 3 + i % 4; });
  const auto got = run_to_end(s);
  for (const auto& [id, req] : submitted) EXPECT_EQ(got.at(id), alone(req.first, req.second)) << id;
  size_t most = 0;
  for (const auto& rec : x.plans) {
    int64_t per_group[2] = {0, 0};
    for (const runtime::StepRow& row : rec.plan.rows) per_group[x.group_of(row.seq)] += row.count;
    EXPECT_LE(per_group[0], 8);
    EXPECT_LE(per_group[1], 8);
    most = std::max(most, rec.plan.tokens.size());
  }
  EXPECT_EQ(most, 16u) << "no step gave both groups their whole budget";
  EXPECT_EQ(s.stats().blocks_used, 0);
}

// Groups split the executor's sequences and blocks evenly, and the step budget must let every
// sequence of one group decode.
TEST(SchedulerPlans, GroupBudgetsAreCheckedPerGroup) {
  FakeExecutor x(4, 32, 4, 256, 2);  // 8 sequences, 4 per group
  EXPECT_NO_THROW(Scheduler(x, SchedulerConfig{4, 0, true}));
  auto e = test::expect_error([&] { Scheduler s(x, SchedulerConfig{3, 0, true}); });
  EXPECT_NE(e.message().find("max_step_tokens (3) must be at least max_batch (4)"), std::string::npos)
      << e.message();
}

TEST(SchedulerPlans, ARequestMakesRoomOnlyInItsOwnGroup) {
  FakeExecutor x(2, 8, 4, 256, 2);
  Scheduler s(x, SchedulerConfig{32, 0, true});
  std::mt19937 rng(13);
  const Submitted submitted =
      submit_all(s, rng, 4, [](int i) { return i % 2 == 0 ? 12 : 1; }, [](int) { return 12; });
  const auto got = run_to_end(s);
  for (const auto& [id, req] : submitted) EXPECT_EQ(got.at(id), alone(req.first, req.second)) << id;
  EXPECT_GT(s.stats().preemptions, 0);
  int group1 = 0;
  for (const auto& [group, length] : x.closes)
    if (group == 1) {
      EXPECT_EQ(length, 12) << "a request of the group with room was preempted";
      ++group1;
    }
  EXPECT_EQ(group1, 2);
}

// Three requests (prompts of 5, 8 and 11 tokens, 6 to generate each) whose second step fails
// after `rows` of its rows; what they were and the tokens their first step gave.
struct Interrupted {
  Submitted submitted;
  std::map<uint64_t, std::vector<int32_t>> got;
};

Interrupted fail_the_second_step(FakeExecutor& x, Scheduler& s, uint32_t seed, int rows) {
  std::mt19937 rng(seed);
  Interrupted r{submit_all(s, rng, 3, [](int i) { return 5 + 3 * i; }, [](int) { return 6; }), {}};
  for (const Event& e : s.step()) r.got[e.id].push_back(e.token);
  x.fail_after_rows = rows;
  EXPECT_THROW(s.step(), Error);
  return r;
}

TEST(SchedulerPlans, AFailedStepLosesNothing) {
  FakeExecutor x(3, 64, 4, 256);
  Scheduler s(x, SchedulerConfig{16, 0, true});
  auto [submitted, got] = fail_the_second_step(x, s, 7, 0);
  for (auto& [id, tokens] : run_to_end(s)) got[id].insert(got[id].end(), tokens.begin(), tokens.end());
  for (const auto& [id, req] : submitted) EXPECT_EQ(got[id], alone(req.first, req.second)) << id;
  EXPECT_EQ(s.stats().blocks_used, 0);
}

// The CUDA engine runs a step's decode rows before its prefill rows, so a prefill row that fails
// leaves the decodes' tokens in their sequences. The scheduler must not feed those again from
// where it had counted: every request of the failed step starts over on a new sequence.
TEST(SchedulerPlans, AStepThatFailsPartwayIsRecomputedFromTheStart) {
  FakeExecutor x(3, 64, 4, 256);
  Scheduler s(x, SchedulerConfig{16, 0, true});
  // Prompts of 5, 8 and 11: the first step computes 5 + 8 + 3 of them, the second has two decode
  // rows, then the rest of the third prompt.
  auto [submitted, got] = fail_the_second_step(x, s, 11, 2);
  ASSERT_EQ(x.failed_plan.rows.size(), 3u);
  EXPECT_EQ(x.failed_plan.rows[0].count, 1);
  EXPECT_EQ(x.failed_plan.rows[1].count, 1);
  EXPECT_EQ(x.failed_plan.rows[2].count, 8);

  EXPECT_TRUE(x.open_sequences().empty()) << "the failed step's sequences are still open";
  EXPECT_EQ(s.stats().running, 0);
  EXPECT_EQ(s.stats().waiting, 3);
  EXPECT_EQ(s.stats().blocks_used, 0);
  const auto rest = run_to_end(s, [&] { expect_sequences_follow_requests(x, submitted); });
  for (auto& [id, tokens] : rest) got[id].insert(got[id].end(), tokens.begin(), tokens.end());
  for (const auto& [id, req] : submitted) EXPECT_EQ(got[id], alone(req.first, req.second)) << id;
  EXPECT_EQ(s.stats().preemptions, 0);  // a failed step is not counted as one
  EXPECT_EQ(s.stats().blocks_used, 0);
  EXPECT_TRUE(x.open_sequences().empty());
}

// What the request loop does after a failed step: cancel every request, then step once more to
// report it. Each sequence is closed exactly once (a second close would throw) and none stays open.
TEST(SchedulerPlans, CancellingEveryRequestAfterAFailedStepClosesEachSequenceOnce) {
  FakeExecutor x(2, 64, 4, 256);
  Scheduler s(x, SchedulerConfig{16, 0, true});
  std::mt19937 rng(13);
  // Two run, the third waits for a sequence.
  const Submitted submitted =
      submit_all(s, rng, 3, [](int i) { return 4 + 5 * i; }, [](int) { return 6; });
  s.step();
  x.fail_after_rows = 1;
  EXPECT_THROW(s.step(), Error);
  for (const auto& [id, req] : submitted) EXPECT_TRUE(s.cancel(id)) << id;
  std::vector<Event> events;
  ASSERT_NO_THROW(events = s.step());
  ASSERT_EQ(events.size(), 3u);
  for (const Event& e : events) EXPECT_EQ(e.finish, FinishReason::kCancelled);
  EXPECT_FALSE(s.busy());
  EXPECT_TRUE(x.open_sequences().empty());
  EXPECT_EQ(s.stats().blocks_used, 0);
}

// The request loop over the scheduler: a step that fails partway ends its request with the
// reason, leaves no sequence open, and the next request is served as if alone.
TEST(RequestLoop, AStepThatFailsPartwayEndsItsRequestAndTheNextOneIsServed) {
  FakeExecutor x(2, 64, 4, 256);
  x.fail_after_rows = 1;  // the first step: its one row is fed, then the step fails
  auto run_job = [](RequestLoop& loop, std::vector<int32_t> prompt) {
    auto job = std::make_shared<Job>();
    job->prompt = std::move(prompt);
    job->options.max_tokens = 5;
    EXPECT_EQ(loop.submit(job), "");
    std::unique_lock lock(job->m);
    job->cv.wait(lock, [&] { return job->finished; });
    return job;
  };
  std::mt19937 rng(17);
  const std::vector<int32_t> first = random_prompt(rng, 9), second = random_prompt(rng, 7);
  {
    RequestLoop loop{std::make_unique<Scheduler>(x, SchedulerConfig{16, 0, true})};
    const auto failed = run_job(loop, first);
    EXPECT_NE(failed->failure.find("the device went away"), std::string::npos) << failed->failure;
    const auto served = run_job(loop, second);
    EXPECT_EQ(served->failure, "");
    std::vector<int32_t> tokens;
    for (const Event& e : served->events)
      if (e.token >= 0) tokens.push_back(e.token);
    EXPECT_EQ(tokens, alone(second, 5));
  }
  EXPECT_TRUE(x.open_sequences().empty());
  EXPECT_EQ(x.kv_usage().free, 64);
}

// /metrics lists each data-parallel rank's running requests and blocks (the counts themselves
// are SchedulerStats::groups, checked above); one group lists none.
TEST(RequestLoop, MetricsListEveryRankOfADataParallelExecutor) {
  FakeExecutor two(2, 16, 4, 256, 2), one(2, 16, 4, 256);
  RequestLoop with_ranks{std::make_unique<Scheduler>(two, SchedulerConfig{16, 0, true})};
  RequestLoop without{std::make_unique<Scheduler>(one, SchedulerConfig{16, 0, true})};
  auto served = [](RequestLoop& loop) {
    auto job = std::make_shared<Job>();
    job->prompt = {1, 2, 3};
    job->options.max_tokens = 3;
    EXPECT_EQ(loop.submit(job), "");
    std::unique_lock lock(job->m);
    job->cv.wait(lock, [&] { return job->finished; });
  };
  served(with_ranks);
  served(without);
  const std::string m = with_ranks.metrics();
  for (const char* line : {"moe_rank_running_requests{rank=\"0\"} 0\n", "moe_rank_running_requests{rank=\"1\"} 0\n",
                           "moe_rank_kv_blocks_in_use{rank=\"0\"} 0\n", "moe_rank_kv_blocks_in_use{rank=\"1\"} 0\n"})
    EXPECT_NE(m.find(line), std::string::npos) << line << " missing from\n" << m;
  EXPECT_EQ(without.metrics().find("moe_rank_"), std::string::npos);
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
