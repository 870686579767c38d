// Continuous batching over one runtime::Executor (the CPU reference or the CUDA engine): the
// serve::Batcher that moe-server runs.
//
// Each step() plans one StepPlan over the requests that are running, so requests join and leave
// the batch at every step. A step spends at most `max_step_tokens` tokens in each attention group
// (each data-parallel GPU; the whole step with one group): every decoding request
// gets its one token first (oldest first), then prompts are prefilled in chunks with what is
// left, so a long prompt never stalls the decodes. A step takes only the KV blocks the tokens it
// computes need; when they are not there, the newest running request is preempted (its sequence
// closed, to be recomputed later from its prompt and the tokens it already generated), so running
// out of blocks delays requests instead of failing them. A new (or preempted) request first takes
// the cached blocks of its longest computed prefix (Executor::reuse_prefix). A step whose run
// throws sends every request it planned back the same way (the executor may have run part of the
// step), then rethrows.
//
// Sampling is counter-based (runtime/executor.h): a request draws the same tokens whether it
// runs alone, batched, chunked or preempted; greedy output equals the request run alone.
//
// Not thread-safe: one thread calls submit, cancel and step (a server serialises them).
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "text/tokenizer.h"
#include "runtime/executor.h"
#include "serve/batcher.h"

namespace moe::serve {

struct SchedulerConfig {
  // Tokens one step computes in each attention group (>= the group's sequences): under
  // data-parallel attention each GPU runs its own prompt chunks, so each gets the whole budget.
  int64_t max_step_tokens = 256;
  int64_t max_context = 0;        // prompt + max_tokens limit; 0: the executor's context
  bool prefix_reuse = true;       // start new requests from cached prefix blocks
};

class Scheduler final : public Batcher {
 public:
  // The executor and the tokenizer (may be null; it turns tokens into text and enables stop
  // strings) must outlive the scheduler, and no one else may open sequences on the executor
  // meanwhile. Throws kInvalidArgument for an impossible config.
  Scheduler(runtime::Executor& executor, const SchedulerConfig& config, const Tokenizer* tokenizer = nullptr);
  ~Scheduler() override;

  // Queues a request and returns its id. Throws kInvalidArgument (and queues nothing) for a
  // request check_request refuses.
  uint64_t submit(std::vector<int32_t> prompt, const RequestOptions& options) override;
  // Ends a waiting or running request now and closes its sequence; the next step() reports it as
  // cancelled. False when no such request is live.
  bool cancel(uint64_t id) override;
  // Plans and runs one step (admitting waiting requests when there is room) and returns what
  // happened: one event per request that generated a token, finished or was cancelled. When the
  // executor throws, the requests of the step have their sequences closed and wait to be
  // recomputed from the start, and the exception goes on to the caller.
  std::vector<Event> step() override;
  bool busy() const override { return !waiting_.empty() || !running_.empty(); }
  SchedulerStats stats() const override;

 private:
  struct Request;
  // Free in the executor's attention group `group`, less what the step being planned takes there.
  int64_t free_blocks(int group) const;
  int64_t blocks_for(const Request& r, int64_t more) const;
  int64_t room(const Request& r) const;  // tokens r can add within its blocks and the free ones
  int64_t budget_left(int group) const { return budget_[static_cast<size_t>(group)]; }
  void plan(Request& r, int64_t n);
  void unplan(Request& r);
  // Closes r's sequence and puts r (running, not planned) at the front of the queue, to be
  // recomputed from its prompt and the tokens it generated: for preemption and a failed step.
  void requeue(Request& r);
  void preempt(Request& r);
  // The newest running request in r's attention group (r itself at the latest): preempting it
  // frees blocks where r needs them.
  Request& newest_beside(const Request& r) const;
  void emit(Request& r, int32_t token, std::vector<Event>& events, std::vector<Request*>& done);

  runtime::Executor& executor_;
  SchedulerConfig config_;
  const Tokenizer* tokenizer_;
  int64_t block_size_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::unique_ptr<Request>> requests_;  // every live request
  std::deque<Request*> waiting_;   // admission order; preempted requests go to the front
  std::vector<Request*> running_;  // by id: the back is the newest
  std::vector<Event> pending_;     // cancellations not yet reported
  // The step being planned.
  std::vector<Request*> planned_;
  std::vector<int64_t> budget_;          // tokens left to plan, per attention group
  std::vector<int64_t> planned_blocks_;  // per attention group
  bool preempted_ = false;
  SchedulerStats stats_;
};

}  // namespace moe::serve
