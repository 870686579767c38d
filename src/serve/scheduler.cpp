#include "serve/scheduler.h"

#include <algorithm>
#include <span>

#include "moe/errors.h"

namespace moe::serve {

struct Scheduler::Request {
  Request(uint64_t id, std::vector<int32_t> prompt, const RequestOptions& opts, const Tokenizer* tok)
      : id(id), tokens(std::move(prompt)), prompt_len(static_cast<int64_t>(tokens.size())), options(opts),
        output(opts, tok) {}

  uint64_t id;
  std::vector<int32_t> tokens;  // the prompt, then every generated token
  int64_t prompt_len;
  RequestOptions options;
  OutputFilter output;
  int32_t seq = -1;     // the executor's sequence while running
  int group = 0;        // the executor's attention group that holds it
  int64_t fed = 0;      // tokens of `tokens` in that sequence's cache
  int64_t planned = 0;  // tokens the step being planned computes for it

  int64_t remaining() const { return static_cast<int64_t>(tokens.size()) - fed; }
  int64_t generated() const { return static_cast<int64_t>(tokens.size()) - prompt_len; }
};

Scheduler::Scheduler(runtime::Executor& executor, const SchedulerConfig& config, const Tokenizer* tokenizer)
    : executor_(executor), config_(config), tokenizer_(tokenizer), block_size_(executor.limits().block_size) {
  const runtime::ExecutorLimits& lim = executor.limits();
  if (config_.max_context == 0) config_.max_context = lim.max_context;
  MOE_CHECK(config_.max_context >= 2 && config_.max_context <= lim.max_context, kInvalidArgument,
            "max_context {} must be in [2, {}] (the executor's context)", config_.max_context, lim.max_context);
  MOE_CHECK(lim.groups >= 1 && lim.kv_blocks % lim.groups == 0 && lim.max_sequences % lim.groups == 0,
            kInvalidArgument, "the executor's {} KV blocks and {} sequences do not split evenly into its {} attention groups",
            lim.kv_blocks, lim.max_sequences, lim.groups);
  MOE_CHECK(config_.max_step_tokens >= lim.max_sequences / lim.groups, kInvalidArgument,
            "max_step_tokens ({}) must be at least max_batch ({}), so that every running request can decode",
            config_.max_step_tokens, lim.max_sequences / lim.groups);
  stats_.blocks_total = lim.kv_blocks;
  planned_blocks_.assign(static_cast<size_t>(lim.groups), 0);
  budget_.assign(static_cast<size_t>(lim.groups), 0);
}

Scheduler::~Scheduler() {
  for (auto& [id, r] : requests_)
    if (r->seq >= 0) executor_.close(r->seq);
}

uint64_t Scheduler::submit(std::vector<int32_t> prompt, const RequestOptions& options) {
  // A sequence lives in one attention group's blocks.
  const runtime::ExecutorLimits& lim = executor_.limits();
  check_request(prompt, options, lim.vocab, config_.max_context, lim.kv_blocks / lim.groups, block_size_,
                tokenizer_ != nullptr);
  const uint64_t id = next_id_++;
  auto r = std::make_unique<Request>(id, std::move(prompt), options, tokenizer_);
  waiting_.push_back(r.get());
  requests_.emplace(id, std::move(r));
  return id;
}

bool Scheduler::cancel(uint64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return false;
  Request* r = it->second.get();
  if (r->seq >= 0) {
    executor_.close(r->seq);
    running_.erase(std::find(running_.begin(), running_.end(), r));
  } else {
    waiting_.erase(std::find(waiting_.begin(), waiting_.end(), r));
  }
  Event e;
  e.id = id;
  e.finish = FinishReason::kCancelled;
  pending_.push_back(std::move(e));
  requests_.erase(it);
  return true;
}

int64_t Scheduler::free_blocks(int group) const {
  return executor_.group_kv_usage(group).free - planned_blocks_[static_cast<size_t>(group)];
}

int64_t Scheduler::blocks_for(const Request& r, int64_t more) const {
  const int64_t bs = block_size_;
  return (r.fed + more + bs - 1) / bs - (r.fed + bs - 1) / bs;
}

int64_t Scheduler::room(const Request& r) const {
  const int64_t bs = block_size_;
  return ((r.fed + bs - 1) / bs + free_blocks(r.group)) * bs - r.fed;
}

Scheduler::Request& Scheduler::newest_beside(const Request& r) const {
  for (auto it = running_.rbegin(); it != running_.rend(); ++it)
    if ((*it)->group == r.group) return **it;
  MOE_THROW(kInternal, "request {} is not running", r.id);
}

void Scheduler::plan(Request& r, int64_t n) {
  planned_blocks_[static_cast<size_t>(r.group)] += blocks_for(r, n);
  r.planned = n;
  budget_[static_cast<size_t>(r.group)] -= n;
  planned_.push_back(&r);
}

void Scheduler::unplan(Request& r) {
  planned_blocks_[static_cast<size_t>(r.group)] -= blocks_for(r, r.planned);
  budget_[static_cast<size_t>(r.group)] += r.planned;
  r.planned = 0;
  planned_.erase(std::find(planned_.begin(), planned_.end(), &r));
}

void Scheduler::requeue(Request& r) {
  executor_.close(r.seq);  // recomputed later; its published blocks stay findable until reused
  r.seq = -1;
  r.fed = 0;
  running_.erase(std::find(running_.begin(), running_.end(), &r));
  waiting_.push_front(&r);
}

void Scheduler::preempt(Request& r) {
  if (r.planned > 0) unplan(r);
  requeue(r);
  ++stats_.preemptions;
  preempted_ = true;
}

void Scheduler::emit(Request& r, int32_t token, std::vector<Event>& events, std::vector<Request*>& done) {
  r.tokens.push_back(token);
  Event e;
  e.id = r.id;
  r.output.push(token, r.generated(), e);
  if (e.finish != FinishReason::kNone) done.push_back(&r);
  events.push_back(std::move(e));
}

std::vector<Event> Scheduler::step() {
  std::vector<Event> events = std::move(pending_);
  pending_.clear();
  planned_.clear();
  std::fill(budget_.begin(), budget_.end(), config_.max_step_tokens);
  std::fill(planned_blocks_.begin(), planned_blocks_.end(), 0);
  preempted_ = false;

  // Decodes first, oldest first: they cost one token each and must not wait behind prompts.
  // While a decode's new block is not there, the newest running request of its attention group
  // makes room.
  const std::vector<Request*> running = running_;
  for (Request* r : running) {
    if (r->seq < 0 || r->remaining() != 1 || budget_left(r->group) <= 0) continue;
    while (r->seq >= 0 && blocks_for(*r, 1) > free_blocks(r->group)) preempt(newest_beside(*r));
    if (r->seq >= 0) plan(*r, 1);
  }
  // Then the prompts (and recomputations) already running, in chunks of what the budget and the
  // free blocks leave; the newest running request of the group makes room for an older one.
  for (Request* r : running) {
    if (r->seq < 0 || r->planned > 0 || r->remaining() <= 0 || budget_left(r->group) <= 0) continue;
    while (r->seq >= 0 && room(*r) <= 0) preempt(newest_beside(*r));
    if (r->seq >= 0) plan(*r, std::min({r->remaining(), budget_left(r->group), room(*r)}));
  }
  // Then new requests while there is room; none after a preemption, which means the cache is full.
  while (!preempted_ && *std::max_element(budget_.begin(), budget_.end()) > 0 &&
         static_cast<int64_t>(running_.size()) < executor_.limits().max_sequences &&
         !waiting_.empty()) {
    Request* r = waiting_.front();
    r->seq = executor_.open();
    r->group = executor_.group_of(r->seq);
    const int64_t hits = config_.prefix_reuse ? executor_.reuse_prefix(r->seq, r->tokens) : 0;
    r->fed = hits;
    const int64_t n = std::min({r->remaining(), budget_left(r->group), room(*r)});
    if (n <= 0) {
      executor_.close(r->seq);  // a waiting request holds no blocks
      r->seq = -1;
      r->fed = 0;
      break;
    }
    waiting_.pop_front();
    stats_.prefix_hit_tokens += hits;
    running_.insert(std::upper_bound(running_.begin(), running_.end(), r,
                                     [](const Request* a, const Request* b) { return a->id < b->id; }),
                    r);
    plan(*r, n);
  }
  if (planned_.empty()) return events;

  runtime::StepPlan step;
  for (const Request* r : planned_) {
    runtime::StepRow row;
    row.seq = r->seq;
    row.offset = static_cast<int32_t>(step.tokens.size());
    row.count = static_cast<int32_t>(r->planned);
    row.sample = r->fed + r->planned == static_cast<int64_t>(r->tokens.size());
    row.sampling = r->options.sampling;
    row.draw = r->generated();
    step.tokens.insert(step.tokens.end(), r->tokens.begin() + r->fed, r->tokens.begin() + r->fed + r->planned);
    step.rows.push_back(row);
  }
  std::vector<int32_t> next;
  try {
    next = executor_.run(step).tokens;
  } catch (...) {
    // The executor may have run part of the step before it threw (the CUDA engine runs the decode
    // rows before the prefill rows), so what the cache holds of a planned sequence is no longer
    // what `fed` says. Each planned request goes back to be recomputed, the oldest at the front
    // of the queue, and the next step starts from sequences that match their requests. A caller
    // that then cancels every request (the request loop) finds them waiting, with no sequence.
    std::vector<Request*> failed = std::move(planned_);
    planned_.clear();
    std::sort(failed.begin(), failed.end(), [](const Request* a, const Request* b) { return a->id > b->id; });
    for (Request* r : failed) {
      r->planned = 0;
      requeue(*r);
    }
    throw;
  }
  ++stats_.steps;

  std::vector<Request*> done;
  for (size_t i = 0; i < planned_.size(); ++i) {
    Request* r = planned_[i];
    r->fed += r->planned;
    stats_.computed_tokens += r->planned;
    r->planned = 0;
    if (step.rows[i].sample) emit(*r, next[i], events, done);
  }
  planned_.clear();
  for (Request* r : done) {
    executor_.close(r->seq);
    running_.erase(std::find(running_.begin(), running_.end(), r));
    requests_.erase(r->id);
  }
  return events;
}

SchedulerStats Scheduler::stats() const {
  SchedulerStats s = stats_;
  s.waiting = static_cast<int64_t>(waiting_.size());
  s.running = static_cast<int64_t>(running_.size());
  const runtime::KvUsage kv = executor_.kv_usage();
  s.blocks_used = kv.total - kv.free;
  s.blocks_cached = kv.cached;
  const int64_t groups = executor_.limits().groups;
  if (groups > 1) {
    s.groups.resize(static_cast<size_t>(groups));
    for (int g = 0; g < groups; ++g) {
      const runtime::KvUsage u = executor_.group_kv_usage(g);
      s.groups[static_cast<size_t>(g)].blocks_used = u.total - u.free;
    }
    for (const Request* r : running_) s.groups[static_cast<size_t>(r->group)].running += 1;
  }
  return s;
}

}  // namespace moe::serve
