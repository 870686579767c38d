// The runtime interface the scheduler drives, over either backend: the CPU reference
// (backend/cpu/cpu_executor.h) or the CUDA engine (backend/cuda_engine.h). An executor holds the
// weights, the paged KV cache and its sequences; a step runs some tokens of some sequences and
// draws each finished row's next token.
//
// A step is one plain StepPlan (ids and numbers only, no pointers), so that a driver could send it
// to workers in other processes unchanged. Sampling is counter-based: a row's draw is a function
// of (seed, draw index, logits) only, so a request that is chunked differently, batched with
// others or preempted and recomputed draws the same tokens.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "moe/tensor.h"
#include "runtime/sampler.h"

namespace moe::runtime {

// What an executor was set up for; fixed after construction.
struct ExecutorLimits {
  int64_t max_sequences = 0;  // open at once: the most rows a step can have
  int64_t max_context = 0;    // tokens per sequence
  int64_t block_size = 0;     // tokens per KV block
  int64_t kv_blocks = 0;      // blocks the sequences can hold between them
  int64_t vocab = 0;          // ids a step accepts
  // Attention groups (data-parallel attention: one per rank): each sequence lives in one group's
  // cache, and max_sequences and kv_blocks are split evenly between the groups. 1 otherwise.
  int64_t groups = 1;
};

// Which logits a row hands back besides its token: none (serving), its last position's, or one
// row per position (scoring a text, comparing with a reference).
enum class RowLogits : uint8_t { kNone, kLast, kAll };

// One sequence's part of a step: `count` ids of StepPlan::tokens from `offset`, run at the
// sequence's current length. With `sample`, the next token is drawn from the logits of the last
// of them as draw number `draw` of the request (the tokens it generated before this one).
struct StepRow {
  int32_t seq = -1;
  int32_t offset = 0, count = 0;
  bool sample = false;
  SamplingParams sampling{};
  int64_t draw = 0;
  RowLogits logits = RowLogits::kNone;
};

struct StepPlan {
  std::vector<int32_t> tokens;
  std::vector<StepRow> rows;  // at most one per sequence
};

// What a step gives back, row by row.
struct StepResult {
  std::vector<int32_t> tokens;  // the token drawn, -1 for rows without `sample`
  std::vector<Tensor> logits;   // f32 [1, vocab] (kLast) or [count, vocab] (kAll); empty for kNone
};

// KV blocks now: the free ones include published blocks nobody holds (they are handed out again
// least recently freed first).
struct KvUsage {
  int64_t total = 0, free = 0, cached = 0;
};

class Executor {
 public:
  virtual ~Executor() = default;

  virtual const ExecutorLimits& limits() const = 0;
  // A new empty sequence; throws kInvalidArgument when max_sequences are open.
  virtual int32_t open() = 0;
  // Frees the sequence's blocks (published ones stay findable until reused).
  virtual void close(int32_t seq) = 0;
  // Tokens whose keys and values the sequence's cache holds.
  virtual int64_t length(int32_t seq) const = 0;
  // Gives the empty sequence the cached blocks of `tokens`' leading full blocks and returns the
  // tokens it now holds (never all of them); 0 when prefix reuse is off.
  virtual int64_t reuse_prefix(int32_t seq, std::span<const int32_t> tokens) = 0;
  virtual KvUsage kv_usage() const = 0;
  // The attention group whose cache holds the open sequence (ExecutorLimits::groups), chosen at
  // open(); and the blocks of one group (the whole cache with one group).
  virtual int group_of(int32_t /*seq*/) const { return 0; }
  virtual KvUsage group_kv_usage(int /*group*/) const { return kv_usage(); }
  // Runs the step and returns, for each row in order, the token drawn and the logits it asked
  // for. Throws kInvalidArgument for a plan that does not fit (an id outside the vocabulary, a
  // sequence not open or twice, a full context, too few free blocks) before anything runs.
  virtual StepResult run(const StepPlan& plan) = 0;
};

// Checks the plan's shape against the limits and the executor's sequences (kInvalidArgument):
// rows within the token list, at most one per sequence, ids in the vocabulary, each sequence open
// and within its context. Shared by the executors.
void check_plan(const StepPlan& plan, const Executor& executor);

}  // namespace moe::runtime
