// Expert parallelism on the GPUs of one process: each rank (one GPU, one host thread) holds a
// contiguous block of a layer's routed experts (ExpertPlacement), every rank passes the same
// tokens and routing (attention is replicated), and every rank gets the full [T, H] output. The
// backends compute the same function and differ in what moves (docs/architecture.md, "Expert parallelism"):
//   local_allreduce          each rank runs its experts' slots of all T tokens; an all-reduce
//                            of [T, H] sums the partial outputs;
//   allgather_reducescatter  tokens sharded by rank: all-gather the shards, run, reduce-scatter
//                            the sums back to the shards' ranks, re-gather;
//   alltoall_padded          each shard token goes once to every rank holding one of its
//                            experts, in fixed-capacity slices (no counts exchanged), and back;
//   alltoall_packed          the same with exact slices, after an exchange of counts through the
//                            host (the control plane, timed in EpStats::control_seconds);
//   p2p                      the packed exchange as kernels that write rows straight into the
//                            peers' memory over NVLink, with completion flags instead of host
//                            synchronisation: nothing leaves the device, every wait is bounded,
//                            and the whole layer can be captured in a CUDA graph.
// The first four run their exchanges through a dist::Communicator of a cuda::NcclGroup (blocking
// calls on the host); p2p through a P2pExchange shared by the ranks (its protocol, and why its
// buffers are safe to reuse: docs/p2p_exchange.md).
//
// Arithmetic: bf16 rows, f32 sums. A rank sums its own slots of a token in slot order and rounds
// to bf16; the ranks' partial rows are then added in rank order in f32 and rounded once. The
// result is within bf16 rounding of the one-GPU layer and identical on every rank.
//
// Declared without CUDA types; in a build without CUDA every constructor throws kUnsupported.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/device_matrix.h"
#include "dist/communicator.h"
#include "dist/dist_config.h"

namespace moe::cuda {

// Whether every pair of `devices` can access each other's memory; *why names a pair that cannot.
bool peer_access_available(const std::vector<int>& devices, std::string* why = nullptr);

// The p2p backend's buffers on every GPU of the group (receive rows, returned rows, flags),
// allocated once for up to max_tokens tokens per call and shared by all layers (their calls are
// ordered). Construction enables peer access between every pair and throws kUnsupported naming
// a pair that has none, kInvalidArgument for a bad group or shape.
class P2pExchange {
 public:
  // own_tokens: sized for layers whose ranks each pass up to max_tokens rows of their own
  // (EpLayerConfig::own_tokens), rather than one batch of max_tokens that they shard.
  P2pExchange(const std::vector<int>& devices, int64_t hidden, int64_t top_k, int64_t max_tokens,
              double timeout_s = 10.0, bool own_tokens = false);
  ~P2pExchange();
  P2pExchange(const P2pExchange&) = delete;
  P2pExchange& operator=(const P2pExchange&) = delete;

  int ranks() const;
  size_t bytes_per_rank() const;  // device memory it holds on each GPU
  struct State;
  State& state() const { return *s_; }

 private:
  std::unique_ptr<State> s_;
};

struct EpStats {
  uint64_t calls = 0;
  uint64_t dispatch_bytes = 0;  // rows handed to the dispatch collectives (NCCL backends)
  uint64_t combine_bytes = 0;   // rows handed to the combine collectives
  uint64_t meta_bytes = 0;      // ids, weights and counts
  uint64_t regather_bytes = 0;  // output shards re-gathered so every rank holds all T rows
  double control_seconds = 0;   // host time spent on counts (alltoall_packed)
};

struct EpLayerConfig {
  dist::EpBackend backend = dist::EpBackend::kLocalAllreduce;
  int rank = 0, ranks = 1;
  int device = 0;
  int64_t experts = 0;  // global routed experts
  int64_t hidden = 0, inter = 0, top_k = 0;
  int64_t max_tokens = 0;  // T per call: every rank's tokens together, or each rank's own
  // Data-parallel attention: each rank passes its own `tokens` rows (the same count on every rank
  // of a call, padding rows included) and gets back the routed output of those rows only, not
  // one batch that every rank holds; nothing is re-gathered. Not for local_allreduce.
  bool own_tokens = false;
  // Measurement only: forward() runs the exchanges but not the experts (their output rows keep
  // whatever they held), so that a benchmark can time dispatch and combine alone.
  bool exchange_only = false;
  // The experts' weight format (Experts::workspace_bytes: FP8 ones need room for quantised
  // activations).
  WeightFormat expert_format = {};
  // Device buffers of workspace_bytes(config) bytes, 256-byte aligned, that the caller owns and
  // may share between layers whose calls are ordered on one stream (an engine's layers); null:
  // the layer allocates its own.
  void* workspace = nullptr;
};

// One rank's routed experts of one layer.
class EpExperts {
 public:
  // gate_up / down: bf16 device pointers of this rank's block of experts (ExpertPlacement's
  // first_expert() and num_local(), the Experts layout). comm: this rank's endpoint of an NCCL
  // group of config.ranks (the collective backends); p2p: the group's exchange (kP2p). Throws
  // kInvalidArgument for a bad configuration, kUnsupported for a backend this build lacks.
  EpExperts(const EpLayerConfig& config, const DeviceMatrix& gate_up, const DeviceMatrix& down,
            dist::Communicator* comm, P2pExchange* p2p);
  // The same over bf16 pointers in the Experts layout.
  EpExperts(const EpLayerConfig& config, const void* gate_up, const void* down, dist::Communicator* comm,
            P2pExchange* p2p);
  ~EpExperts();
  EpExperts(const EpExperts&) = delete;
  EpExperts& operator=(const EpExperts&) = delete;

  // out [T, H] bf16 = sum_j weights[t, j] * FFN_{ids[t, j]}(x[t]) over the experts of all ranks;
  // x [T, H] bf16, ids / weights [T, top_k] (global ids), the same on every rank (with
  // own_tokens: this rank's own rows, T the same on every rank); all on this rank's device. The collective backends return with the result in place; p2p only enqueues
  // on `stream` (a cudaStream_t) and can be captured.
  void forward(const uint16_t* x, const int32_t* ids, const float* weights, int64_t tokens,
               uint16_t* out, void* stream);

  // After `stream` has been synchronised: throws kInternal when a p2p wait timed out (which
  // stage, which peer), leaving the error in place; otherwise returns.
  void check(void* stream) const;

  const EpStats& stats() const;
  void reset_stats();
  size_t weight_bytes() const;     // this rank's experts
  size_t workspace_bytes() const;  // this rank's buffers, the p2p exchange's excluded
  // The same before construction, for a caller that provides the workspace.
  static size_t workspace_bytes(const EpLayerConfig& config);

  struct State;  // what one layer holds (cuda_ep.cpp)

 private:
  std::unique_ptr<State> s_;
};

}  // namespace moe::cuda
