// Continuous batching over the CUDA engine (backend/cuda_engine.h): the serve::Batcher that
// moe-server runs with --device cuda.
//
// Each step() first runs one batched decode over the requests that have a single token left to
// feed (the engine replays it from a CUDA graph), then prefills prompts in chunks with what is left
// of the step's token budget, so a long prompt never stalls the decodes. The engine owns the KV
// cache; requests are admitted while it has sequences and blocks for them, and when a decode needs
// a block that is not there the newest running request is preempted (its sequence closed, to be
// recomputed from its prompt and the tokens it already generated), so running out of blocks
// delays requests instead of failing them. Sampling runs on the device with each request's
// parameters; greedy output is the same as the request run alone. (Sampled output is seeded per
// request but, unlike the CPU scheduler's, not independent of chunking and preemption.) Full
// prompt blocks are shared: a request whose leading blocks another already computed starts after
// them.
//
// Not thread-safe: one thread calls submit, cancel and step.
#pragma once

#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <vector>

#include "backend/cuda_engine.h"
#include "serve/batcher.h"

namespace moe::serve {

struct GpuSchedulerConfig {
  int64_t max_step_tokens = 256;  // tokens one step computes: decodes, then prompt chunks
  int64_t max_context = 0;        // prompt + max_tokens limit; 0: the engine's context
  // A new (or preempted) request starts from the cached blocks of its longest prefix another
  // request computed (Engine::reuse_prefix); with the engine's prefix_reuse on.
  bool prefix_reuse = true;
};

class GpuScheduler final : public Batcher {
 public:
  // The engine (its max_batch bounds the running requests) and the tokenizer (may be null) must
  // outlive the scheduler, and no one else may open sequences on the engine meanwhile.
  GpuScheduler(cuda::Engine& engine, const GpuSchedulerConfig& config,
               const Tokenizer* tokenizer = nullptr);
  ~GpuScheduler() override;

  uint64_t submit(std::vector<int32_t> prompt, const RequestOptions& options) override;
  bool cancel(uint64_t id) override;
  std::vector<Event> step() override;
  bool busy() const override { return !waiting_.empty() || !running_.empty(); }
  SchedulerStats stats() const override;

 private:
  struct Request;
  int64_t blocks_for(const Request& r, int64_t more) const;  // new blocks r needs for `more` tokens
  void preempt(Request& r);
  void emit(Request& r, int32_t token, std::vector<Event>& events, std::vector<Request*>& done);

  cuda::Engine& engine_;
  GpuSchedulerConfig config_;
  const Tokenizer* tokenizer_;
  int64_t block_size_, max_batch_;
  uint64_t next_id_ = 1;
  std::map<uint64_t, std::unique_ptr<Request>> requests_;
  std::deque<Request*> waiting_;   // admission order; preempted requests go to the front
  std::vector<Request*> running_;  // admission order: the back is the newest
  std::vector<Event> pending_;     // cancellations not yet reported
  SchedulerStats stats_;
};

}  // namespace moe::serve
