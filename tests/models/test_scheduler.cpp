// The continuous-batching scheduler over the CPU executor on the fixture models: every request,
// however it was batched, chunked, preempted or shared blocks with others, generates what it
// generates alone through Model::forward; and the pool ends empty.
#include <gtest/gtest.h>

#include <functional>
#include <map>
#include <random>

#include "backend/cpu/cpu_executor.h"
#include "text/tokenizer.h"
#include "model/model.h"
#include "serve/scheduler.h"
#include "../support/fixtures.h"
#include "../unit/test_util.h"

namespace moe {
namespace {

using serve::Event;
using serve::FinishReason;
using serve::RequestOptions;
using serve::Scheduler;
using test::expect_error;
using test::fixture_dir;

// The reference: one request alone, prompt in one forward, then one token per forward, sampled
// over the first `vocab` logits; stops after a stop id or max_tokens.
std::vector<int32_t> alone(Model& model, const std::vector<int32_t>& prompt, const RequestOptions& o,
                           int64_t vocab = 0) {
  if (vocab == 0) vocab = model.config().vocab_size;
  KvCache cache = model.new_cache(static_cast<int64_t>(prompt.size()) + o.max_tokens);
  Sampler sampler(o.sampling);
  std::vector<int32_t> out;
  Tensor logits = model.forward(prompt, cache);
  while (true) {
    int32_t t = sampler.sample(logits.data<float>(), vocab);
    out.push_back(t);
    if (static_cast<int64_t>(out.size()) == o.max_tokens ||
        std::find(o.stop_ids.begin(), o.stop_ids.end(), t) != o.stop_ids.end())
      return out;
    std::vector<int32_t> one{t};
    logits = model.forward(one, cache);
  }
}

// What a server sets up: the executor's pool and batch, and the scheduler's step budget.
struct ServeSetup {
  int64_t kv_blocks = 256, block_size = 16, max_batch = 16, max_step_tokens = 256, max_context = 0;
  bool prefix_reuse = true;
};

cpu::ExecutorOptions executor_options(const ServeSetup& c, const Tokenizer* tok) {
  cpu::ExecutorOptions o;
  o.kv_blocks = c.kv_blocks;
  o.block_size = c.block_size;
  o.max_sequences = c.max_batch;
  o.max_context = c.max_context;
  o.sampled_vocab = tok ? tok->vocab_size() : 0;
  o.prefix_reuse = c.prefix_reuse;
  return o;
}

// The CPU executor and the scheduler over it.
struct Served {
  Served(Model& model, const ServeSetup& c, const Tokenizer* tok = nullptr)
      : executor(model, executor_options(c, tok)),
        scheduler(executor, serve::SchedulerConfig{c.max_step_tokens, c.max_context, c.prefix_reuse}, tok) {}
  uint64_t submit(std::vector<int32_t> prompt, const RequestOptions& o) { return scheduler.submit(std::move(prompt), o); }
  bool cancel(uint64_t id) { return scheduler.cancel(id); }
  std::vector<Event> step() { return scheduler.step(); }
  bool busy() const { return scheduler.busy(); }
  serve::SchedulerStats stats() const { return scheduler.stats(); }

  cpu::Executor executor;
  Scheduler scheduler;
};

struct Outcome {
  std::vector<int32_t> tokens;
  std::string text;
  FinishReason finish = FinishReason::kNone;
  int finishes = 0;
};

// Steps until nothing is left (bounded, so a scheduler that stalls fails instead of hanging).
std::map<uint64_t, Outcome> run_to_end(Served& s, std::map<uint64_t, Outcome> seen = {}) {
  for (int step = 0; s.busy() || step == 0; ++step) {
    EXPECT_LT(step, 5000) << "the scheduler makes no progress";
    if (step >= 5000) break;
    for (const Event& e : s.step()) {
      Outcome& o = seen[e.id];
      if (e.token >= 0) o.tokens.push_back(e.token);
      o.text += e.text;
      if (e.finish != FinishReason::kNone) {
        o.finish = e.finish;
        ++o.finishes;
      }
    }
  }
  return seen;
}

std::vector<int32_t> random_prompt(std::mt19937& rng, int64_t n, int64_t vocab) {
  std::uniform_int_distribution<int32_t> d(0, static_cast<int32_t>(vocab) - 1);
  std::vector<int32_t> p(static_cast<size_t>(n));
  for (auto& t : p) t = d(rng);
  return p;
}

using Submitted = std::map<uint64_t, std::pair<std::vector<int32_t>, RequestOptions>>;

RequestOptions greedy(int64_t max_tokens) {
  RequestOptions o;
  o.max_tokens = max_tokens;
  return o;
}

// Submits `count` requests, request i with options(i) and a random prompt of prompt_len(i) tokens.
Submitted submit_random(Served& s, std::mt19937& rng, int64_t vocab, int count,
                        const std::function<int64_t(int)>& prompt_len,
                        const std::function<RequestOptions(int)>& options) {
  Submitted submitted;
  for (int i = 0; i < count; ++i) {
    const RequestOptions o = options(i);
    auto prompt = random_prompt(rng, prompt_len(i), vocab);
    submitted[s.submit(prompt, o)] = {prompt, o};
  }
  return submitted;
}

// Runs the submitted requests to their ends, which must come after some preemption: each output
// is still the one the request has alone, and no block stays in use.
void expect_outputs_as_alone_after_preemption(Served& s, Model& model, const Submitted& submitted) {
  auto got = run_to_end(s);
  for (const auto& [id, req] : submitted)
    EXPECT_EQ(got[id].tokens, alone(model, req.first, req.second)) << "request " << id;
  EXPECT_GT(s.stats().preemptions, 0);
  EXPECT_EQ(s.stats().blocks_used, 0);
}

class SchedulerTest : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override { model = Model::load(fixture_dir(GetParam())); }
  std::unique_ptr<Model> model;
};

// Many requests of mixed lengths at once, with a step budget small enough that prompts are
// prefilled in several chunks beside the running decodes.
TEST_P(SchedulerTest, ConcurrentGreedyRequestsMatchEachAlone) {
  Served s(*model, ServeSetup{.kv_blocks = 200, .block_size = 4, .max_batch = 6, .max_step_tokens = 16});
  std::mt19937 rng(7);
  const Submitted submitted = submit_random(
      s, rng, model->config().vocab_size, 14, [](int i) { return 1 + (i * 13) % 41; },
      [](int i) { return greedy(1 + (i * 5) % 11); });
  int64_t need = 0;
  for (const auto& [id, req] : submitted) need += static_cast<int64_t>(req.first.size()) + req.second.max_tokens - 1;
  auto got = run_to_end(s);
  ASSERT_EQ(got.size(), submitted.size());
  for (const auto& [id, req] : submitted) {
    EXPECT_EQ(got[id].tokens, alone(*model, req.first, req.second)) << "request " << id;
    EXPECT_EQ(got[id].finish, FinishReason::kLength);
    EXPECT_EQ(got[id].finishes, 1);
  }
  auto st = s.stats();
  EXPECT_EQ(st.preemptions, 0);
  EXPECT_EQ(st.prefix_hit_tokens, 0);  // random prompts share no block
  EXPECT_EQ(st.computed_tokens, need);  // nothing computed twice
  EXPECT_EQ(st.blocks_used, 0);
  EXPECT_EQ(st.running + st.waiting, 0);
}

// A long prompt arriving while another request decodes is prefilled in chunks: the decoding
// request still gets a token at every step.
TEST_P(SchedulerTest, LongPromptDoesNotStallRunningDecodes) {
  Served s(*model, ServeSetup{.kv_blocks = 64, .block_size = 4, .max_batch = 4, .max_step_tokens = 8});
  std::mt19937 rng(11);
  RequestOptions short_opts, long_opts;
  short_opts.max_tokens = 12;
  long_opts.max_tokens = 3;
  auto short_prompt = random_prompt(rng, 3, model->config().vocab_size);
  auto long_prompt = random_prompt(rng, 60, model->config().vocab_size);
  const uint64_t a = s.submit(short_prompt, short_opts);
  std::vector<int32_t> a_tokens, b_tokens;
  for (const Event& e : s.step()) a_tokens.push_back(e.token);  // its prompt and first token
  ASSERT_EQ(a_tokens.size(), 1u);
  const uint64_t b = s.submit(long_prompt, long_opts);
  int steps = 0, steps_before_b = 0;
  for (bool a_done = false; !a_done;) {
    bool a_here = false;
    for (const Event& e : s.step()) {
      if (e.id == a) {
        a_here = true;
        a_tokens.push_back(e.token);
        a_done = e.finish != FinishReason::kNone;
      } else {
        b_tokens.push_back(e.token);
      }
    }
    ASSERT_TRUE(a_here) << "the decoding request waited behind the long prompt";
    ++steps;
    if (b_tokens.empty()) ++steps_before_b;
  }
  EXPECT_EQ(steps, 11);
  // The decode takes one token of each step's 8, the prompt the other 7: its 60 tokens take 9
  // steps, so its first token comes with the 9th.
  EXPECT_EQ(steps_before_b, 8);
  auto rest = run_to_end(s);
  b_tokens.insert(b_tokens.end(), rest[b].tokens.begin(), rest[b].tokens.end());
  EXPECT_EQ(a_tokens, alone(*model, short_prompt, short_opts));
  EXPECT_EQ(b_tokens, alone(*model, long_prompt, long_opts));
  EXPECT_EQ(s.stats().blocks_used, 0);
}

// A pool far smaller than the requests need together: requests are preempted and recomputed,
// and every output is still the one it has alone.
TEST_P(SchedulerTest, PreemptionWhenBlocksRunOutKeepsOutputs) {
  // 40 tokens for 6 requests of up to 27 tokens each.
  Served s(*model, ServeSetup{.kv_blocks = 10, .block_size = 4, .max_batch = 6, .max_step_tokens = 32});
  std::mt19937 rng(5);
  const Submitted submitted = submit_random(
      s, rng, model->config().vocab_size, 6, [](int i) { return 6 + 3 * i; }, [](int) { return greedy(12); });
  expect_outputs_as_alone_after_preemption(s, *model, submitted);
}

// Prompts that begin with the same full blocks share them: fewer blocks in use, no recomputation,
// the same outputs.
TEST_P(SchedulerTest, IdenticalPromptBlocksAreShared) {
  std::mt19937 rng(9);
  const auto prefix = random_prompt(rng, 12, model->config().vocab_size);  // three blocks of 4
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 3; ++i) {
    auto p = prefix;
    auto tail = random_prompt(rng, 3, model->config().vocab_size);
    p.insert(p.end(), tail.begin(), tail.end());
    prompts.push_back(p);
  }
  RequestOptions o;
  o.max_tokens = 6;
  for (bool reuse : {true, false}) {
    Served s(*model, ServeSetup{.kv_blocks = 32, .block_size = 4, .max_step_tokens = 64, .prefix_reuse = reuse});
    std::vector<uint64_t> ids{s.submit(prompts[0], o)};
    std::map<uint64_t, Outcome> seen;
    for (const Event& e : s.step()) seen[e.id].tokens.push_back(e.token);
    // The first request's 15 prompt tokens fill three blocks and start a fourth.
    EXPECT_EQ(s.stats().blocks_used, 4);
    ids.push_back(s.submit(prompts[1], o));
    ids.push_back(s.submit(prompts[2], o));
    for (const Event& e : s.step()) seen[e.id].tokens.push_back(e.token);
    // With reuse, each newcomer takes the three shared blocks and one of its own for its tail;
    // without, each needs four of its own.
    EXPECT_EQ(s.stats().blocks_used, reuse ? 4 + 1 + 1 : 4 + 4 + 4) << reuse;
    EXPECT_EQ(s.stats().prefix_hit_tokens, reuse ? 2 * 12 : 0);
    EXPECT_EQ(s.stats().computed_tokens, reuse ? 15 + 1 + 3 + 3 : 15 + 1 + 15 + 15);
    auto got = run_to_end(s, seen);
    for (size_t i = 0; i < 3; ++i) EXPECT_EQ(got[ids[i]].tokens, alone(*model, prompts[i], o)) << i;
    EXPECT_EQ(s.stats().blocks_used, 0);
    // Blocks of finished requests stay findable: a later request with the prefix reuses them.
    const uint64_t later = s.submit(prompts[1], o);
    auto again = run_to_end(s);
    EXPECT_EQ(again[later].tokens, alone(*model, prompts[1], o));
    EXPECT_EQ(s.stats().prefix_hit_tokens, reuse ? 3 * 12 : 0);
    EXPECT_EQ(s.stats().blocks_used, 0);
  }
}

// Per-request sampling: each request draws its own seeded, counter-based numbers, whatever it
// shares a batch with and however often it is preempted.
TEST_P(SchedulerTest, SeededSamplingMatchesAlone) {
  Served s(*model, ServeSetup{.kv_blocks = 12, .block_size = 4, .max_batch = 5, .max_step_tokens = 20});
  std::mt19937 rng(13);
  const Submitted submitted = submit_random(
      s, rng, model->config().vocab_size, 5, [](int i) { return 5 + 4 * i; },
      [](int i) {
        RequestOptions o = greedy(10);
        o.sampling = {0.5f + 0.25f * static_cast<float>(i), i % 3 == 0 ? 0 : 10 * i, i % 2 == 0 ? 1.0f : 0.9f,
                      static_cast<uint64_t>(100 + i)};
        return o;
      });
  // Some requests resume with their sampler mid-sequence.
  expect_outputs_as_alone_after_preemption(s, *model, submitted);
}

TEST_P(SchedulerTest, StopIdsEndARequestEarly) {
  Served s(*model, ServeSetup{.block_size = 4});
  std::vector<int32_t> prompt{3, 1, 4, 1, 5, 9, 2, 6};
  RequestOptions free_run;
  free_run.max_tokens = 12;
  const auto full = alone(*model, prompt, free_run);
  RequestOptions o = free_run;
  o.stop_ids = {full[4]};
  const size_t first = static_cast<size_t>(std::find(full.begin(), full.end(), full[4]) - full.begin());
  const uint64_t stopped = s.submit(prompt, o), unstopped = s.submit(prompt, free_run);
  auto got = run_to_end(s);
  EXPECT_EQ(got[stopped].tokens, std::vector<int32_t>(full.begin(), full.begin() + first + 1));
  EXPECT_EQ(got[stopped].finish, FinishReason::kStop);
  EXPECT_EQ(got[unstopped].tokens, full);
  EXPECT_EQ(got[unstopped].finish, FinishReason::kLength);
  // The names the OpenAI API gives these reasons.
  EXPECT_STREQ(serve::finish_reason_name(FinishReason::kStop), "stop");
  EXPECT_STREQ(serve::finish_reason_name(FinishReason::kLength), "length");
}

TEST_P(SchedulerTest, CancelFreesBlocksAndLeavesOthersIntact) {
  // At most two running, so that some requests are still waiting when cancelled.
  Served t(*model, ServeSetup{.kv_blocks = 40, .block_size = 4, .max_batch = 2, .max_step_tokens = 16});
  std::mt19937 rng(17);
  std::vector<std::vector<int32_t>> prompts;
  std::vector<uint64_t> ids;
  RequestOptions o;
  o.max_tokens = 8;
  for (int i = 0; i < 4; ++i) {
    prompts.push_back(random_prompt(rng, 10, model->config().vocab_size));
    ids.push_back(t.submit(prompts.back(), o));
  }
  std::map<uint64_t, Outcome> part;
  for (int i = 0; i < 3; ++i)
    for (const Event& e : t.step()) part[e.id].tokens.push_back(e.token);
  ASSERT_EQ(t.stats().running, 2);
  EXPECT_GT(t.stats().blocks_used, 0);
  EXPECT_TRUE(t.cancel(ids[0]));  // running
  EXPECT_TRUE(t.cancel(ids[3]));  // waiting
  EXPECT_FALSE(t.cancel(ids[3]));
  EXPECT_FALSE(t.cancel(12345));
  auto got = run_to_end(t, part);
  EXPECT_EQ(got[ids[0]].finish, FinishReason::kCancelled);
  EXPECT_EQ(got[ids[3]].finish, FinishReason::kCancelled);
  EXPECT_TRUE(got[ids[3]].tokens.empty());
  for (size_t i : {1u, 2u}) EXPECT_EQ(got[ids[i]].tokens, alone(*model, prompts[i], o)) << i;
  EXPECT_EQ(t.stats().blocks_used, 0);
  // Cancelling everything at once also leaves nothing behind.
  for (const auto& p : prompts) ids.push_back(t.submit(p, o));
  t.step();
  for (size_t i = 4; i < ids.size(); ++i) EXPECT_TRUE(t.cancel(ids[i]));
  EXPECT_EQ(t.stats().blocks_used, 0);
  EXPECT_FALSE(t.busy());
  auto events = t.step();
  EXPECT_EQ(events.size(), 4u);
  for (const Event& e : events) EXPECT_EQ(e.finish, FinishReason::kCancelled);
}

TEST_P(SchedulerTest, BadRequestsAreRejectedWithOneLine) {
  Served s(*model, ServeSetup{.kv_blocks = 8, .block_size = 4, .max_context = 64});
  const int32_t vocab = static_cast<int32_t>(model->config().vocab_size);
  auto rejects = [&](std::vector<int32_t> prompt, RequestOptions o, const std::string& words) {
    auto e = expect_error([&] { s.submit(prompt, o); });
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find(words), std::string::npos) << e.message();
    EXPECT_EQ(e.message().find('\n'), std::string::npos);
  };
  RequestOptions ok;
  rejects({}, ok, "empty prompt");
  rejects({1, vocab}, ok, std::to_string(vocab));
  rejects({-1}, ok, "outside the vocabulary");
  RequestOptions o = ok;
  o.max_tokens = 0;
  rejects({1}, o, "max_tokens must be at least 1");
  o.max_tokens = 60;
  rejects(std::vector<int32_t>(5, 1), o, "exceeds the context of 64");
  o.max_tokens = INT64_MAX;
  rejects(std::vector<int32_t>(5, 1), o, "exceeds the context of 64");
  o.max_tokens = 30;
  rejects(std::vector<int32_t>(5, 1), o, "needs 9 KV blocks, the pool has 8");  // 34 rows / 4
  o = ok;
  o.sampling.temperature = -1.0f;
  rejects({1}, o, "temperature");
  o = ok;
  o.sampling.top_p = 0.0f;
  rejects({1}, o, "top-p");
  o = ok;
  o.stop_ids = {vocab};
  rejects({1}, o, "stop token id");
  o = ok;
  o.stop_strings = {"x"};
  rejects({1}, o, "stop strings need a tokenizer");
  EXPECT_FALSE(s.busy());  // nothing was queued
  o = ok;
  o.max_tokens = 28;
  s.submit(std::vector<int32_t>(5, 1), o);  // 32 rows: exactly the pool
  EXPECT_TRUE(s.busy());
}

TEST_P(SchedulerTest, BadConfigsAreRejected) {
  auto fails = [&](ServeSetup c, const std::string& words) {
    auto e = expect_error([&] { Served s(*model, c); });
    EXPECT_EQ(e.kind(), ErrorKind::kInvalidArgument);
    EXPECT_NE(e.message().find(words), std::string::npos) << e.message();
  };
  ServeSetup c;
  c.max_batch = 0;
  fails(c, "max_batch");
  c = {};
  c.max_step_tokens = c.max_batch - 1;
  fails(c, "max_step_tokens");
  c = {};
  c.max_context = model->config().max_position_embeddings + 1;
  fails(c, "max_context");
  c = {};
  c.kv_blocks = 0;
  fails(c, "block count");
  c = {};
  c.block_size = 0;
  fails(c, "block size");
}

INSTANTIATE_TEST_SUITE_P(Fixtures, SchedulerTest,
                         ::testing::Values("qwen3_moe_f32", "deepseek_v2_f32", "mixtral_f32",
                                           "qwen2_moe_f32"),
                         [](const auto& info) { return info.param; });

// With a tokenizer: streamed text is the decoded output, cut before a stop string that may span
// several tokens, and never shows a stop string's beginning early.
TEST(SchedulerText, StreamedTextAndStopStrings) {
  const std::string dir = fixture_dir("tiny_qwen3_moe");
  auto model = Model::load(dir);
  Tokenizer tok = Tokenizer::from_file(dir + "/tokenizer.json");
  const int64_t usable = std::min<int64_t>(model->config().vocab_size, tok.vocab_size());
  auto prompt = tok.encode("The quick brown fox jumps over the lazy dog. Then");
  RequestOptions o;
  o.max_tokens = 24;
  const auto ids = alone(*model, prompt, o, usable);
  const std::string text = tok.decode(ids);
  ASSERT_GT(text.size(), 12u);
  const std::string stop = text.substr(text.size() / 2, 4);
  const std::string before = text.substr(0, text.find(stop));

  Served s(*model, ServeSetup{.kv_blocks = 32, .block_size = 8}, &tok);
  RequestOptions with_stop = o;
  with_stop.stop_strings = {"never appears in this text \x01", stop};
  const uint64_t plain = s.submit(prompt, o), stopped = s.submit(prompt, with_stop);
  std::map<uint64_t, Outcome> seen;
  while (s.busy())
    for (const Event& e : s.step()) {
      Outcome& out = seen[e.id];
      out.text += e.text;
      if (e.token >= 0) out.tokens.push_back(e.token);
      if (e.finish != FinishReason::kNone) out.finish = e.finish;
      // Sent text never contains the stop string, nor ends in the middle of it.
      if (e.id == stopped) {
        EXPECT_EQ(before.compare(0, out.text.size(), out.text), 0) << out.text;
      }
    }
  EXPECT_EQ(seen[plain].tokens, ids);
  EXPECT_EQ(seen[plain].text, text);
  EXPECT_EQ(seen[plain].finish, FinishReason::kLength);
  EXPECT_EQ(seen[stopped].text, before);
  EXPECT_EQ(seen[stopped].finish, FinishReason::kStop);
  EXPECT_LT(seen[stopped].tokens.size(), ids.size());
  EXPECT_EQ(s.stats().blocks_used, 0);
}

}  // namespace
}  // namespace moe
