#include "serve/gpu_scheduler.h"

#include <algorithm>
#include <span>

#include "moe/errors.h"

namespace moe::serve {

struct GpuScheduler::Request {
  Request(uint64_t id, std::vector<int32_t> prompt, const RequestOptions& opts, const Tokenizer* tok)
      : id(id), tokens(std::move(prompt)), prompt_len(static_cast<int64_t>(tokens.size())),
        options(opts), output(opts, tok) {}

  uint64_t id;
  std::vector<int32_t> tokens;  // the prompt, then every generated token
  int64_t prompt_len;
  RequestOptions options;
  OutputFilter output;
  int32_t seq = -1;  // the engine's sequence while running
  int64_t fed = 0;   // tokens of `tokens` in that sequence's cache

  int64_t remaining() const { return static_cast<int64_t>(tokens.size()) - fed; }
};

GpuScheduler::GpuScheduler(cuda::Engine& engine, const GpuSchedulerConfig& config,
                           const Tokenizer* tokenizer)
    : engine_(engine), config_(config), tokenizer_(tokenizer),
      block_size_(engine.options().block_size), max_batch_(engine.options().max_batch) {
  const int64_t context = engine.options().max_context;
  if (config_.max_context == 0) config_.max_context = context;
  MOE_CHECK(config_.max_context >= 2 && config_.max_context <= context, kInvalidArgument,
            "max_context {} must be in [2, {}] (the engine's context)", config_.max_context, context);
  MOE_CHECK(config_.max_step_tokens >= max_batch_, kInvalidArgument,
            "max_step_tokens ({}) must be at least the engine's max_batch ({}), so that every running "
            "request can decode",
            config_.max_step_tokens, max_batch_);
  // The blocks sequences can have: all that are free now (the engine keeps one scratch block).
  stats_.blocks_total = engine.memory().kv_blocks_free;
}

GpuScheduler::~GpuScheduler() {
  for (auto& [id, r] : requests_)
    if (r->seq >= 0) engine_.close_sequence(r->seq);
}

uint64_t GpuScheduler::submit(std::vector<int32_t> prompt, const RequestOptions& options) {
  check_request(prompt, options, engine_.config().vocab_size, config_.max_context, stats_.blocks_total,
                block_size_, tokenizer_ != nullptr);
  const uint64_t id = next_id_++;
  auto r = std::make_unique<Request>(id, std::move(prompt), options, tokenizer_);
  waiting_.push_back(r.get());
  requests_.emplace(id, std::move(r));
  return id;
}

bool GpuScheduler::cancel(uint64_t id) {
  auto it = requests_.find(id);
  if (it == requests_.end()) return false;
  Request* r = it->second.get();
  if (r->seq >= 0) {
    engine_.close_sequence(r->seq);
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

int64_t GpuScheduler::blocks_for(const Request& r, int64_t more) const {
  const int64_t bs = block_size_;
  return (r.fed + more + bs - 1) / bs - (r.fed + bs - 1) / bs;
}

void GpuScheduler::preempt(Request& r) {
  engine_.close_sequence(r.seq);
  r.seq = -1;
  r.fed = 0;
  running_.erase(std::find(running_.begin(), running_.end(), &r));
  waiting_.push_front(&r);
  ++stats_.preemptions;
}

void GpuScheduler::emit(Request& r, int32_t token, std::vector<Event>& events, std::vector<Request*>& done) {
  r.tokens.push_back(token);
  Event e;
  e.id = r.id;
  r.output.push(token, static_cast<int64_t>(r.tokens.size()) - r.prompt_len, e);
  if (e.finish != FinishReason::kNone) done.push_back(&r);
  events.push_back(std::move(e));
}

std::vector<Event> GpuScheduler::step() {
  std::vector<Event> events = std::move(pending_);
  pending_.clear();
  std::vector<Request*> done;
  int64_t budget = config_.max_step_tokens;
  auto free_blocks = [&] { return engine_.memory().kv_blocks_free; };
  auto is_done = [&](const Request* r) { return std::find(done.begin(), done.end(), r) != done.end(); };

  // Decodes first: every running request with one token left to feed, in one batched step.
  // While their new blocks are not there, the newest running request makes room.
  std::vector<Request*> decoding;
  for (Request* r : running_)
    if (r->fed > 0 && r->remaining() == 1) decoding.push_back(r);
  auto decode_blocks = [&] {
    int64_t n = 0;
    for (const Request* r : decoding) n += blocks_for(*r, 1);
    return n;
  };
  while (!decoding.empty() && decode_blocks() > free_blocks()) {
    Request* victim = running_.back();
    auto it = std::find(decoding.begin(), decoding.end(), victim);
    if (it != decoding.end()) decoding.erase(it);
    preempt(*victim);
  }
  if (!decoding.empty()) {
    std::vector<int32_t> seqs, tokens;
    std::vector<SamplingParams> params;
    for (const Request* r : decoding) {
      seqs.push_back(r->seq);
      tokens.push_back(r->tokens.back());
      params.push_back(r->options.sampling);
    }
    const std::vector<int32_t> next = engine_.decode(seqs, tokens, params);
    for (size_t i = 0; i < decoding.size(); ++i) {
      decoding[i]->fed += 1;
      emit(*decoding[i], next[i], events, done);
    }
    budget -= static_cast<int64_t>(decoding.size());
    stats_.computed_tokens += static_cast<int64_t>(decoding.size());
    ++stats_.steps;
  }

  // Runs up to n tokens of r's prompt (or recomputation) as one chunk, within the free blocks.
  // False when not a single token fits.
  auto prefill = [&](Request* r, int64_t n) {
    const int64_t room = ((r->fed + block_size_ - 1) / block_size_ + free_blocks()) * block_size_ - r->fed;
    n = std::min(n, room);
    if (n <= 0) return false;
    const int32_t next = engine_.prefill(
        r->seq, std::span<const int32_t>(r->tokens).subspan(static_cast<size_t>(r->fed), static_cast<size_t>(n)),
        r->options.sampling);
    r->fed += n;
    budget -= n;
    stats_.computed_tokens += n;
    ++stats_.steps;
    if (r->remaining() == 0) emit(*r, next, events, done);
    return true;
  };

  // Then the prompts already running, in chunks of what the budget leaves. One that cannot get a
  // block gives its blocks back (unless it is the oldest), so that prompts never wait on each
  // other forever.
  const std::vector<Request*> running = running_;
  for (Request* r : running) {
    if (budget <= 0) break;
    if (is_done(r) || std::find(decoding.begin(), decoding.end(), r) != decoding.end()) continue;
    if (r->remaining() <= 0 || (r->fed > 0 && r->remaining() == 1)) continue;
    if (!prefill(r, std::min(r->remaining(), budget)) && r != running_.front()) preempt(*r);
  }
  // Then new requests, while there are sequences, blocks and budget.
  while (budget > 0 && static_cast<int64_t>(running_.size()) < max_batch_ && !waiting_.empty()) {
    Request* r = waiting_.front();
    const int64_t n = std::min(r->remaining(), budget);
    if (blocks_for(*r, std::min<int64_t>(n, block_size_)) > free_blocks()) break;
    r->seq = engine_.open_sequence();
    if (config_.prefix_reuse) {
      r->fed = engine_.reuse_prefix(r->seq, r->tokens);
      stats_.prefix_hit_tokens += r->fed;
    }
    waiting_.pop_front();
    running_.push_back(r);
    prefill(r, std::min(r->remaining(), budget));
  }

  for (Request* r : done) {
    engine_.close_sequence(r->seq);
    running_.erase(std::find(running_.begin(), running_.end(), r));
    requests_.erase(r->id);
  }
  return events;
}

SchedulerStats GpuScheduler::stats() const {
  SchedulerStats s = stats_;
  s.waiting = static_cast<int64_t>(waiting_.size());
  s.running = static_cast<int64_t>(running_.size());
  const cuda::MemoryReport m = engine_.memory();
  s.blocks_used = stats_.blocks_total - m.kv_blocks_free;
  s.blocks_cached = m.kv_blocks_cached;
  return s;
}

}  // namespace moe::serve
