// Expert-parallel execution of one MoE layer's routed experts across the ranks of a group. A
// backend is a strategy with two halves around the shared expert computation:
//   dispatch - bring each routed (token, slot) to the rank that holds its expert;
//   combine  - bring the expert outputs back and sum them per token, weighted.
// All backends compute the same function: every rank passes the same T tokens (attention is
// replicated) with their routing, and every rank gets the full [T, H] output back.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "core/arena.h"
#include "core/thread_pool.h"
#include "dist/communicator.h"
#include "dist/dist_config.h"
#include "moe/experts.h"
#include "moe/placement.h"

namespace moe {

// What one layer call moved and spent, accumulated across calls (reset by the caller).
struct EpStats {
  uint64_t dispatch_bytes = 0;  // hidden-state payload handed to the dispatch collectives
  uint64_t combine_bytes = 0;   // hidden-state payload handed to the combine collectives
  uint64_t meta_bytes = 0;      // routing metadata (ids, weights) and counts
  uint64_t regather_bytes = 0;  // outputs re-gathered so every rank holds all T rows again
  double control_seconds = 0;   // host work to plan the exchange (counts, offsets, packing)
  uint64_t calls = 0;
  void clear() { *this = EpStats{}; }
};

// The rows this rank must run through its local experts: `top_k` slots per row, global ids.
struct LocalBatch {
  Tensor x;                      // [rows, H]
  std::vector<int32_t> ids;      // [rows * top_k]; experts of other ranks are skipped
  std::vector<float> weights;    // [rows * top_k]
  int64_t top_k = 1;
};

struct EpContext {
  dist::Communicator& comm;
  ThreadPool& pool;
  Arena& workspace;
  const ExpertPlacement& placement;
  EpStats& stats;
};

class EpBackend {
 public:
  virtual ~EpBackend() = default;
  virtual dist::EpBackend kind() const = 0;
  // x: [T, H] (the same on every rank), ids / weights: [T, k]. Fills `batch`.
  virtual void dispatch(EpContext& ctx, const Tensor& x, const int32_t* ids, const float* weights,
                        int64_t top_k, LocalBatch& batch) = 0;
  // y: [rows, H], the local experts' weighted sums for the batch's rows (zero for rows with no
  // local slot). Writes the full [T, H] output.
  virtual void combine(EpContext& ctx, const Tensor& y, Tensor& out) = 0;
};

// Throws kUnsupported for the GPU-only backends.
std::unique_ptr<EpBackend> make_ep_backend(dist::EpBackend kind);

// The layer step: dispatch, the local experts (`exec` mode), combine.
void ep_moe_forward(EpBackend& backend, EpContext& ctx, ExecMode exec, const ExpertWeights& w,
                    ExpertPlan& plan, const Tensor& x, const int32_t* ids, const float* weights,
                    int64_t top_k, Tensor& out);

// Rows [begin, end) of T owned by `rank` when tokens are sharded (remainder to the first ranks).
std::pair<int64_t, int64_t> token_shard(int64_t tokens, int ranks, int rank);

// Measures bytes a collective call hands over, for EpStats.
class BytesMeter {
 public:
  explicit BytesMeter(const dist::Communicator& comm)
      : comm_(comm), start_(comm.stats().total.bytes_sent) {}
  uint64_t bytes() const { return comm_.stats().total.bytes_sent - start_; }

 private:
  const dist::Communicator& comm_;
  uint64_t start_;
};

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace moe
