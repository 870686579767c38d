// An executor in another process: the driver (the scheduler's side) holds a RemoteExecutor, the
// worker runs serve_executor over its real executor, and the two talk over one connected stream
// socket (a socketpair across a fork, or TCP). Every Executor call is one request and one reply,
// each a frame of a u32 byte count and that many bytes; a step goes as step_wire's plan and comes
// back as its result, the other calls as a few little-endian numbers. The worker answers a call
// that throws with the error's kind and message, which the driver throws again, so a refused plan
// reads the same on both sides of the socket.
//
// Nothing on the wire is trusted: a frame larger than kMaxFrameBytes, a reply of the wrong size,
// an unknown call or error kind are refused with one line (kFormat); a worker that closes the
// connection or does not answer within the timeout is reported as such (kIo), never waited on
// forever; the timeout bounds a whole call, so a peer that trickles bytes is cut off too.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "runtime/executor.h"

namespace moe::runtime {

// The largest frame either side reads: a step of all-position logits over a large vocabulary
// fits, a corrupt length does not get an allocation.
constexpr uint32_t kMaxFrameBytes = 1u << 30;

class RemoteExecutor final : public Executor {
 public:
  // Takes `fd` (a connected stream socket; closed on destruction, or when this throws) and asks
  // the worker for its limits. Throws kIo when the worker does not answer within `timeout_s`;
  // every later call, its request, the worker's work and the whole reply, takes as long at most.
  explicit RemoteExecutor(int fd, double timeout_s = 600.0);
  ~RemoteExecutor() override;
  RemoteExecutor(const RemoteExecutor&) = delete;
  RemoteExecutor& operator=(const RemoteExecutor&) = delete;

  const ExecutorLimits& limits() const override { return limits_; }
  int32_t open() override;
  void close(int32_t seq) override;
  int64_t length(int32_t seq) const override;
  int64_t reuse_prefix(int32_t seq, std::span<const int32_t> tokens) override;
  KvUsage kv_usage() const override;
  int group_of(int32_t seq) const override;
  KvUsage group_kv_usage(int group) const override;
  StepResult run(const StepPlan& plan) override;

 private:
  void ask_limits();
  // Sends one request and returns the reply's payload; rethrows the worker's error.
  std::vector<uint8_t> call(const std::vector<uint8_t>& request) const;

  // The worker's cache usage as last read, kept until a call that can change it (open, close,
  // prefix reuse, a step): the scheduler asks for a group's free blocks for every request it
  // plans, and the worker's executor changes only through this driver, so each answer holds
  // until then, and a serving step costs a few round trips instead of two per running request.
  void cache_changes() const;

  int fd_;
  double timeout_s_;
  ExecutorLimits limits_;
  mutable std::optional<KvUsage> usage_;
  mutable std::vector<std::optional<KvUsage>> group_usage_;
};

// Answers the requests arriving on `fd` with `executor` until the driver closes the connection
// between requests (then returns). The driver may wait as long as it likes between requests, but
// a request must arrive whole within `timeout_s` of its first byte, and a reply must be taken as
// fast (kIo otherwise). A call that throws is answered with its error; a request that
// cannot be decoded (an unknown call, arguments cut short or left over, a malformed plan) is
// answered with a kFormat error and ends the loop, as the stream can no longer be trusted. A
// frame past kMaxFrameBytes (kFormat) or a driver that goes away inside a message (kIo) throws.
// However it ends, the sequences the driver opened and did not close are closed, so that the
// executor can serve another driver; returns how many there were. With `busy_listener` (a
// listening socket), a driver that connects there meanwhile is answered with one kIo line (the
// worker is busy) and closed. Does not close `fd`.
int64_t serve_executor(Executor& executor, int fd, double timeout_s = 600.0, int busy_listener = -1);

}  // namespace moe::runtime
