#include "serve/scheduler.h"

#include <algorithm>
#include <span>

#include "moe/errors.h"

namespace moe::serve {

struct Scheduler::Request {
  Request(uint64_t id, std::vector<int32_t> prompt, const RequestOptions& opts, KvBlockPool& pool)
      : id(id), tokens(std::move(prompt)), prompt_len(static_cast<int64_t>(tokens.size())),
        options(opts), sampler(opts.sampling), cache(pool) {}

  uint64_t id;
  std::vector<int32_t> tokens;  // the prompt, then every generated token
  int64_t prompt_len;
  RequestOptions options;
  Sampler sampler;  // kept across preemption, so a recomputed request draws the same numbers
  KvCache cache;    // cache.length() tokens of `tokens` have their keys and values computed
  std::vector<uint64_t> block_keys;  // prefix keys of the full blocks of `tokens`, as far as known
  int64_t published = 0;             // leading blocks of the cache already published
  std::optional<OutputFilter> output;  // set at submit
  int64_t planned = 0;  // tokens the current step computes for it
  bool running = false;

  // The prefix key of full block i of `tokens`.
  uint64_t block_key(size_t i, int64_t block_size) {
    while (block_keys.size() <= i) {
      const size_t b = block_keys.size();
      const uint64_t parent = b == 0 ? 0 : block_keys[b - 1];
      block_keys.push_back(KvBlockPool::chain_hash(
          parent, std::span<const int32_t>(tokens).subspan(b * static_cast<size_t>(block_size),
                                                           static_cast<size_t>(block_size))));
    }
    return block_keys[i];
  }
};

namespace {

SchedulerConfig checked(SchedulerConfig c, const ModelConfig& mc) {
  MOE_CHECK(c.max_batch >= 1, kInvalidArgument, "max_batch must be at least 1, got {}", c.max_batch);
  MOE_CHECK(c.max_step_tokens >= c.max_batch, kInvalidArgument,
            "max_step_tokens ({}) must be at least max_batch ({}), so that every running request can decode",
            c.max_step_tokens, c.max_batch);
  if (c.max_context == 0) c.max_context = mc.max_position_embeddings;
  MOE_CHECK(c.max_context >= 2 && c.max_context <= mc.max_position_embeddings, kInvalidArgument,
            "max_context {} must be in [2, {}] (the model's positions)", c.max_context,
            mc.max_position_embeddings);
  return c;
}

}  // namespace

Scheduler::Scheduler(Model& model, const SchedulerConfig& config, const Tokenizer* tokenizer)
    : model_(model),
      config_(checked(config, model.config())),
      tokenizer_(tokenizer),
      // Models pad their vocabulary past the tokenizer's ids; ids with no token are never sampled.
      usable_vocab_(tokenizer ? std::min<int64_t>(model.config().vocab_size, tokenizer->vocab_size())
                              : model.config().vocab_size),
      pool_(model.config().num_layers, config_.kv_blocks, config_.block_size,
            model.config().kv_key_width(), model.config().kv_value_width()) {
  stats_.blocks_total = pool_.num_blocks();
}

Scheduler::~Scheduler() = default;

uint64_t Scheduler::submit(std::vector<int32_t> prompt, const RequestOptions& options) {
  check_request(prompt, options, model_.config().vocab_size, config_.max_context, pool_.num_blocks(),
                config_.block_size, tokenizer_ != nullptr);
  const uint64_t id = next_id_++;
  auto r = std::make_unique<Request>(id, std::move(prompt), options, pool_);
  r->output.emplace(options, tokenizer_);
  waiting_.push_back(r.get());
  requests_.emplace(id, std::move(r));
  return id;
}

bool Scheduler::cancel(uint64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return false;
  Request* r = it->second.get();
  if (r->running)
    running_.erase(std::find(running_.begin(), running_.end(), r));
  else
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), r));
  Event e;
  e.id = id;
  e.finish = FinishReason::kCancelled;
  pending_.push_back(std::move(e));
  requests_.erase(it);  // the cache gives its blocks back as it dies
  return true;
}

bool Scheduler::reserve(Request& r, int64_t tokens) {
  while (r.cache.capacity() < tokens) {
    const int32_t b = pool_.allocate();
    if (b < 0) return false;
    r.cache.append_block(b);
  }
  return true;
}

// Takes the published blocks that match the request's leading full blocks. At least the last
// token is always left to compute: its logits are what the next token is sampled from, and the
// block it lands in must be the request's own to write.
int64_t Scheduler::attach_prefix(Request& r) {
  if (!config_.prefix_reuse) return 0;
  const int64_t bs = config_.block_size;
  const size_t reusable = static_cast<size_t>((static_cast<int64_t>(r.tokens.size()) - 1) / bs);
  size_t hits = 0;
  while (hits < reusable) {
    auto span = std::span<const int32_t>(r.tokens).subspan(hits * static_cast<size_t>(bs), static_cast<size_t>(bs));
    const int32_t b = pool_.acquire_cached(r.block_key(hits, bs), span);
    if (b < 0) break;
    r.cache.append_block(b);
    ++hits;
  }
  r.cache.set_length(static_cast<int64_t>(hits) * bs);
  r.published = static_cast<int64_t>(hits);
  return r.cache.length();
}

void Scheduler::publish_full_blocks(Request& r) {
  const int64_t bs = config_.block_size, full = r.cache.length() / bs;
  for (; r.published < full; ++r.published) {
    const auto i = static_cast<size_t>(r.published);
    auto span = std::span<const int32_t>(r.tokens).subspan(i * static_cast<size_t>(bs), static_cast<size_t>(bs));
    pool_.publish(r.cache.blocks()[i], r.block_key(i, bs), span);
  }
}

void Scheduler::preempt(Request& r) {
  r.cache.release();  // recomputed later; published blocks stay findable until reused
  r.published = 0;
  r.planned = 0;
  r.running = false;
  waiting_.push_front(&r);
  ++stats_.preemptions;
}

std::vector<Event> Scheduler::step() {
  std::vector<Event> events = std::move(pending_);
  pending_.clear();
  int64_t budget = config_.max_step_tokens;
  std::vector<Request*> plan;
  bool preempted = false;

  // Plans n tokens of r, preempting the newest running requests while the blocks do not suffice.
  // False when r itself had to go.
  auto schedule = [&](Request* r, int64_t n) {
    while (!reserve(*r, r->cache.length() + n)) {
      Request* victim = running_.back();
      running_.pop_back();
      if (victim->planned > 0) {
        budget += victim->planned;
        plan.erase(std::find(plan.begin(), plan.end(), victim));
      }
      preempt(*victim);
      preempted = true;
      if (victim == r) return false;
    }
    r->planned = n;
    plan.push_back(r);
    budget -= n;
    return true;
  };
  auto remaining = [](const Request* r) {
    return static_cast<int64_t>(r->tokens.size()) - r->cache.length();
  };

  // Decodes first, oldest first: they cost one token each and must not wait behind prompts.
  const std::vector<Request*> running = running_;
  for (Request* r : running)
    if (r->running && r->planned == 0 && remaining(r) == 1 && budget > 0) schedule(r, 1);
  // Then the prompts (and recomputations) already running, in chunks of what the budget leaves.
  for (Request* r : running)
    if (r->running && r->planned == 0 && budget > 0) schedule(r, std::min(remaining(r), budget));
  // Then new requests, while there is room; none after a preemption, which means the pool is full.
  while (!preempted && budget > 0 && static_cast<int64_t>(running_.size()) < config_.max_batch &&
         !waiting_.empty()) {
    Request* r = waiting_.front();
    const int64_t hits = attach_prefix(*r);
    const int64_t n = std::min(remaining(r), budget);
    if (!reserve(*r, r->cache.length() + n)) {
      r->cache.release();  // a waiting request holds no blocks
      r->published = 0;
      break;
    }
    waiting_.pop_front();
    stats_.prefix_hit_tokens += hits;
    r->running = true;
    running_.insert(std::upper_bound(running_.begin(), running_.end(), r,
                                     [](const Request* a, const Request* b) { return a->id < b->id; }),
                    r);
    r->planned = n;
    plan.push_back(r);
    budget -= n;
  }
  if (plan.empty()) return events;

  std::vector<SequenceInput> batch;
  for (Request* r : plan) {
    batch.push_back({std::span<const int32_t>(r->tokens).subspan(static_cast<size_t>(r->cache.length()),
                                                                 static_cast<size_t>(r->planned)),
                     &r->cache, false});
    stats_.computed_tokens += r->planned;
  }
  std::vector<Tensor> logits;
  try {
    logits = model_.forward_batch(batch);
  } catch (...) {
    for (Request* r : plan) r->planned = 0;
    throw;
  }
  ++stats_.steps;

  std::vector<Request*> done;
  for (size_t i = 0; i < plan.size(); ++i) {
    Request* r = plan[i];
    r->planned = 0;
    if (config_.prefix_reuse) publish_full_blocks(*r);
    if (remaining(r) > 0) continue;  // a prompt chunk short of the end: nothing to sample yet
    Event e;
    e.id = r->id;
    const int32_t token = r->sampler.sample(logits[i].data<float>(), usable_vocab_);
    r->tokens.push_back(token);
    r->output->push(token, static_cast<int64_t>(r->tokens.size()) - r->prompt_len, e);
    if (e.finish != FinishReason::kNone) done.push_back(r);
    events.push_back(std::move(e));
  }
  for (Request* r : done) {
    running_.erase(std::find(running_.begin(), running_.end(), r));
    requests_.erase(r->id);
  }
  return events;
}

SchedulerStats Scheduler::stats() const {
  SchedulerStats s = stats_;
  s.waiting = static_cast<int64_t>(waiting_.size());
  s.running = static_cast<int64_t>(running_.size());
  s.blocks_used = pool_.used_blocks();
  s.blocks_cached = pool_.cached_blocks();
  return s;
}

}  // namespace moe::serve
