// Distribution settings (tensor, expert and data parallel degrees; the expert-parallel exchange
// backend) and their validation against what this build and the model can do.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace moe::dist {

// The ways tokens reach the experts of other ranks (docs/architecture.md, "Expert parallelism"). They all
// compute the same function; they differ in what moves between ranks.
enum class EpBackend {
  kLocalAllreduce,          // "local_allreduce": every rank sees every token; all-reduce after
  kAllgatherReducescatter,  // "allgather_reducescatter": all-gather tokens, reduce-scatter outputs
  kAlltoallPadded,          // "alltoall_padded": fixed-capacity all-to-all both ways
  kAlltoallPacked,          // "alltoall_packed": exact all-to-all both ways
  kP2p,                     // "p2p": direct writes into peers' GPU memory (CUDA build only)
  kDeepep,                  // "deepep": DeepEP kernels (CUDA build with DeepEP only)
};

// What a backend needs from the layer around it and gives back: the MoE block is router ->
// dispatch -> experts -> combine, and these say how the last three fit the first and the rest
// of the step.
struct EpBackendTraits {
  // Its exchange is device work only (no host waits or host-driven collectives): a step that
  // uses it can be captured in a CUDA graph and replayed.
  bool graph_capturable = false;
  // Every rank ends with the full sum [T, H]. False for local_allreduce, whose experts leave
  // partial sums for an all-reduce that the caller runs (and may fold the next norm into).
  bool reduced_output = true;
  // Each token leaves from one rank only (its shard of T), so a rank's experts see at most
  // ranks * ceil(T / ranks) rows (the receive capacity); otherwise every rank runs all T.
  bool sharded_tokens = false;
  // The host learns each call's row counts before the exchange (a control-plane round trip).
  bool host_counts = false;
  bool needs_peer_access = false;  // kernels write into the peers' memory
  bool needs_gpu = false;          // exists only in the CUDA build
  // Whether each rank can pass its own tokens (data-parallel attention, --dp): every backend
  // that exchanges rows and returns their sums. local_allreduce needs the same tokens on every
  // rank, whose partial sums its all-reduce adds.
  bool runs_data_parallel() const { return reduced_output; }
  // The rows its experts run for a call of `tokens` tokens on `ranks` ranks, at most. With
  // `own_tokens` (data-parallel attention) each rank's `tokens` are its own, and its experts may
  // receive all of every rank's.
  int64_t expert_rows(int64_t tokens, int ranks, bool own_tokens = false) const {
    if (own_tokens && runs_data_parallel()) return ranks * tokens;
    return sharded_tokens ? ranks * ((tokens + ranks - 1) / ranks) : tokens;
  }
  // Activations move as bf16 rows with f32 routing weights in every backend so far.
};
const EpBackendTraits& ep_backend_traits(EpBackend backend);

struct DistConfig {
  int tp = 1;  // tensor-parallel degree (attention)
  int ep = 1;  // expert-parallel degree: ranks that share the experts of a layer
  int dp = 1;  // data-parallel degree
  std::string ep_backend = "local_allreduce";
};

// What this build (and machine) offers to the distribution layer.
struct BuildCaps {
  bool cuda = false;         // the CUDA backend is compiled in
  bool peer_access = false;  // the GPUs can read and write each other's memory
  bool deepep = false;       // the DeepEP kernels are compiled in
  // The capabilities of this build: CUDA when compiled with MOE_WITH_CUDA; peer access and
  // DeepEP are reported absent until the GPU backend detects them.
  static BuildCaps current();
};

// Every known backend name, in the order of the EpBackend enum.
const std::vector<std::string>& ep_backend_names();
// The names that `caps` can run, in the same order.
std::vector<std::string> available_ep_backends(const BuildCaps& caps);
const char* ep_backend_name(EpBackend backend);
// Throws kConfig naming the valid names when `name` is not one of ep_backend_names().
EpBackend parse_ep_backend(const std::string& name);
// True for the backends that only exist in the CUDA build (p2p, deepep).
bool ep_backend_needs_gpu(EpBackend backend);

// Checks a configuration against this build:
//   tp, ep or dp < 1                 -> kInvalidArgument
//   unknown ep_backend               -> kConfig, listing every valid name
//   backend this build cannot run    -> kUnsupported, saying what it needs and listing the
//                                       names available here
//   dp > 1, tp > 1                   -> kUnsupported (not implemented yet)
void validate_dist_config(const DistConfig& config, const BuildCaps& caps = BuildCaps::current());

// Checks the expert-parallel degree against a model with `num_experts` routed experts per layer:
// ep > num_experts (or ep > 1 on a model without routed experts) -> kInvalidArgument.
void validate_ep_for_model(const DistConfig& config, int64_t num_experts);

}  // namespace moe::dist
