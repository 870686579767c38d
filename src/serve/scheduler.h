// Continuous batching over one model and one paged KV pool.
//
// Each step() runs one Model::forward_batch over the requests that are running: requests join and
// leave the batch at every step. A step spends at most `max_step_tokens` tokens: every decoding
// request gets its one token first, then prompts are prefilled in chunks with what is left, so a
// long prompt never stalls the decodes. Blocks are allocated only for the tokens a step computes;
// when the pool runs dry the newest running request is preempted (its blocks are freed and it
// waits to be recomputed, keeping its generated tokens and its sampler state), so running out of
// blocks delays requests instead of failing them. Full blocks are published for prefix reuse: a
// request whose prompt starts with blocks another request already computed shares them.
//
// Not thread-safe: one thread calls submit, cancel and step (a server serialises them).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "io/tokenizer.h"
#include "serve/batcher.h"
#include "model/model.h"
#include "runtime/kv_cache.h"
#include "runtime/sampler.h"

namespace moe::serve {

struct SchedulerConfig {
  int64_t kv_blocks = 256;        // blocks in the pool
  int64_t block_size = 16;        // tokens per block
  int64_t max_batch = 16;         // requests running at once
  int64_t max_step_tokens = 256;  // tokens one step computes (>= max_batch)
  int64_t max_context = 0;        // prompt + max_tokens limit; 0: the model's max positions
  bool prefix_reuse = true;
};

class Scheduler final : public Batcher {
 public:
  // `tokenizer` (may be null) turns tokens into text and enables stop strings; the model and the
  // tokenizer must outlive the scheduler. Throws kInvalidArgument for an impossible config.
  Scheduler(Model& model, const SchedulerConfig& config, const Tokenizer* tokenizer = nullptr);
  ~Scheduler();

  // Queues a request and returns its id. Throws kInvalidArgument (and queues nothing) for an
  // empty prompt, an id outside the vocabulary, max_tokens < 1, a prompt plus max_tokens beyond
  // the context or the pool, bad sampling parameters, an empty stop string, or stop strings
  // without a tokenizer.
  uint64_t submit(std::vector<int32_t> prompt, const RequestOptions& options) override;
  // Ends a waiting or running request now and frees its blocks; the next step() reports it as
  // cancelled. False when no such request is live.
  bool cancel(uint64_t id) override;
  // Runs one forward over the running batch (admitting waiting requests first) and returns what
  // happened: one event per request that generated a token, finished or was cancelled.
  std::vector<Event> step() override;
  // Whether any request is waiting or running.
  bool busy() const override { return !waiting_.empty() || !running_.empty(); }
  SchedulerStats stats() const override;
  const KvBlockPool& pool() const { return pool_; }

 private:
  struct Request;
  bool reserve(Request& r, int64_t tokens);
  int64_t attach_prefix(Request& r);
  void publish_full_blocks(Request& r);
  void preempt(Request& r);
  void finish(Request& r, FinishReason reason, Event& event);

  Model& model_;
  SchedulerConfig config_;
  const Tokenizer* tokenizer_;
  int64_t usable_vocab_;
  KvBlockPool pool_;  // declared before the requests, whose caches hold references into it
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::unique_ptr<Request>> requests_;  // every live request
  std::deque<Request*> waiting_;   // admission order; preempted requests go to the front
  std::vector<Request*> running_;  // by id: the back is the newest
  std::vector<Event> pending_;     // cancellations not yet reported
  SchedulerStats stats_;
};

}  // namespace moe::serve
