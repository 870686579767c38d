// What moe-server drives: requests in, one event per generated token out, stepped by one thread.
// serve::Scheduler (scheduler.h) implements it over one executor, CPU or CUDA. The request checks
// and the handling of stop ids, stop strings and max_tokens are here, apart from the batching.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "text/tokenizer.h"
#include "runtime/sampler.h"

namespace moe::serve {

struct RequestOptions {
  SamplingParams sampling;
  int64_t max_tokens = 16;
  std::vector<int32_t> stop_ids;          // generating one of these ends the request
  std::vector<std::string> stop_strings;  // text that ends the request (needs a tokenizer)
};

enum class FinishReason { kNone, kLength, kStop, kCancelled };
const char* finish_reason_name(FinishReason r);  // "length", "stop", "cancelled"

// What one step did for one request.
struct Event {
  uint64_t id = 0;
  int32_t token = -1;  // the token generated, -1 for none (cancelled)
  // With a tokenizer: the text that became final with this token. Text that may be the start of
  // a stop string is held back until it is known not to be; a stop string and what follows it
  // are never sent; stop ids add no text.
  std::string text;
  FinishReason finish = FinishReason::kNone;
};

// One attention group's share (a data-parallel rank's): its running requests and KV blocks.
struct GroupLoad {
  int64_t running = 0, blocks_used = 0;
};

struct SchedulerStats {
  int64_t waiting = 0, running = 0;
  std::vector<GroupLoad> groups;  // per attention group when the executor has several
  int64_t blocks_total = 0, blocks_used = 0, blocks_cached = 0;
  int64_t preemptions = 0;        // since construction
  int64_t prefix_hit_tokens = 0;  // prompt tokens taken from shared blocks instead of computed
  int64_t computed_tokens = 0;    // tokens run through the model
  int64_t steps = 0;
};

class Batcher {
 public:
  virtual ~Batcher() = default;
  // Queues a request and returns its id; throws kInvalidArgument (queuing nothing) for a request
  // that cannot run (check_request).
  virtual uint64_t submit(std::vector<int32_t> prompt, const RequestOptions& options) = 0;
  // Ends a waiting or running request now and frees its cache; the next step() reports it as
  // cancelled. False when no such request is live.
  virtual bool cancel(uint64_t id) = 0;
  // Runs one step over the running requests (admitting waiting ones first) and returns one event
  // per request that generated a token, finished or was cancelled.
  virtual std::vector<Event> step() = 0;
  virtual bool busy() const = 0;  // whether any request is waiting or running
  virtual SchedulerStats stats() const = 0;
};

// The checks every Batcher makes at submit (kInvalidArgument): an empty prompt, an id outside
// [0, vocab), max_tokens < 1, a prompt plus max_tokens beyond max_context, more KV blocks than
// the pool has (the last generated token needs no cache row), bad sampling parameters, stop ids
// outside the vocabulary, an empty stop string, or stop strings without a tokenizer.
void check_request(const std::vector<int32_t>& prompt, const RequestOptions& options, int64_t vocab,
                   int64_t max_context, int64_t pool_blocks, int64_t block_size, bool tokenizer);

// One request's output side: decodes each generated token (with a tokenizer), applies stop ids,
// stop strings and max_tokens, and fills the token's event.
class OutputFilter {
 public:
  OutputFilter(const RequestOptions& options, const Tokenizer* tokenizer);
  // `generated`: tokens generated so far, this one included.
  void push(int32_t token, int64_t generated, Event& event);

 private:
  std::vector<int32_t> stop_ids_;
  std::vector<std::string> stop_strings_;
  int64_t max_tokens_;
  std::optional<StreamDecoder> decoder_;
  std::string held_;  // decoded text not sent yet (it may begin a stop string)
};

}  // namespace moe::serve
