// A whole decoder on one CUDA device, or on several of one machine (EngineOptions tp / ep):
// weights, KV cache and workspace allocated once at load, every op on the device, sampling
// included. Prefill runs eagerly in chunks; decode steps replay a CUDA graph captured per
// batch-size bucket (1, 2, 4, 5, 6, 7, 8, 10, 12, ... up to max_batch; padding rows take no
// expert), one per GPU. Declared without CUDA types, so
// CPU-only code can include it; a build without CUDA throws kUnsupported.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "dist/dist_config.h"
#include "model/config.h"
#include "moe/errors.h"
#include "moe/tensor.h"
#include "runtime/executor.h"
#include "runtime/sampler.h"

namespace moe::cuda {

struct EngineOptions {
  int device = 0;
  int max_batch = 8;               // sequences of one decode step: the largest graph bucket
  int64_t max_step_tokens = 2048;  // tokens of one eager forward (a prefill chunk)
  int64_t max_context = 0;         // tokens per sequence; 0: min(max_position_embeddings, 4096)
  int64_t kv_blocks = 0;           // 0: room for max_batch full contexts, capped by free memory
  int block_size = 16;             // tokens per KV block
  bool graphs = true;              // replay decode steps from CUDA graphs
  bool strict = true;              // every checkpoint tensor must be used
  bool progress = false;           // loading progress on a terminal
  bool random_weights = false;     // config.json only; weights drawn on the device
  uint64_t seed = 0;
  // Ids at or past this are never sampled (0: none excluded). Models pad their vocabulary past
  // the tokenizer's ids (Qwen3: 151936 vs 151669).
  int64_t sampled_vocab = 0;
  // Keep every MoE layer's expert choice of the last step (last_routing()): for tests.
  bool record_routing = false;
  // Fold short kernels of a step into their neighbours (the post-attention norm, router
  // projection and top-k into one launch for steps of 1 or 2 rows; the next layer's input norm
  // into the routed experts' combine; an FP8 projection's input quantisation into the kernel that
  // produces it: the prefill attention for o, the folded norm for q/k/v). Same results up to f32
  // summation order; off runs every operation as its own kernel, for comparisons.
  bool fuse = true;
  // Keep full KV blocks findable by their token prefix so that reuse_prefix() can share them.
  bool prefix_reuse = true;
  // Several GPUs of this machine: devices device .. device + max(tp, ep) - 1, one host thread
  // each, in lockstep. ep > 1: each GPU holds 1/ep of every layer's routed experts, and
  // ep_backend says how the tokens reach them and their outputs come back (dist_config.h):
  // local_allreduce runs each GPU's experts on every token and sums the partial outputs with the
  // engine's own peer all-reduce (kernels writing into the peers' memory, inside the decode
  // graphs, with the next norm folded in); the others exchange rows through NCCL collectives
  // (allgather_reducescatter, alltoall_padded, alltoall_packed: decode then runs eagerly, as
  // their host-driven exchanges cannot be captured) or peer writes (p2p, captured). tp (1 or
  // ep, or ep / dp under dp): each GPU also holds 1/tp of the attention heads (key/value heads
  // replicated when there are fewer than tp), and the output projection's partial sums go
  // through the peer all-reduce of its tp GPUs.
  int tp = 1, ep = 1;
  dist::EpBackend ep_backend = dist::EpBackend::kLocalAllreduce;
  // Data-parallel attention (dp × tp = ep): the GPUs form dp attention groups of tp
  // consecutive GPUs, and each group runs attention and sampling for its own sequences with its
  // own KV cache (a sequence lives in the group that open() placed it in: the one with the
  // fewest open sequences), its heads split over its tp GPUs. The routed experts exchange each
  // GPU's own rows (ep_backend allgather_reducescatter, alltoall_padded, alltoall_packed or p2p):
  // with tp > 1 each GPU of a group exchanges 1/tp of the group's rows, and the group's peer
  // all-reduce gives all of them back to every GPU of the group. Every group runs each step on
  // the same number of rows (a multiple of tp), padding where its sequences have fewer.
  // max_batch and the KV blocks are per group.
  int dp = 1;
};

// The GPUs an engine with these parallel degrees runs on (ep: every GPU holds a block of the
// routed experts); throws, in one line, for degrees it cannot combine. Without dp, attention runs
// whole on every GPU (tp 1) or split over all of them (tp = ep); under dp each attention group's
// tp GPUs split it, and dp × tp must be the GPUs.
inline int engine_ranks(int tp, int ep, int dp = 1) {
  MOE_CHECK(tp >= 1 && ep >= 1, kInvalidArgument, "--tp {} and --ep {} must be at least 1", tp, ep);
  MOE_CHECK(dp >= 1, kInvalidArgument, "--dp {} must be at least 1", dp);
  if (dp > 1) {
    MOE_CHECK(dp * tp == ep, kInvalidArgument,
              "--dp {} --tp {} --ep {}: dp × tp must equal the GPUs, which --ep sets (--dp {} --tp {} --ep {})", dp,
              tp, ep, dp, tp, dp * tp);
    return ep;
  }
  MOE_CHECK(tp == 1 || tp == ep, kUnsupported,
            "--tp {} --ep {}: tensor-parallel attention runs over the expert-parallel GPUs (--tp N --ep N), "
            "within data-parallel groups (--dp D --tp T --ep D×T) or not at all (--tp 1)",
            tp, ep);
  return ep;
}

// Checks data-parallel attention against the other degrees and the backend (kUnsupported or
// kInvalidArgument, one line), before anything is loaded: dp × tp must be the GPUs (ep), and
// the backend must exchange each GPU's own tokens.
inline void check_engine_dp(int dp, int tp, int ep, dist::EpBackend backend) {
  MOE_CHECK(dp >= 1, kInvalidArgument, "--dp {} must be at least 1", dp);
  if (dp == 1) return;
  engine_ranks(tp, ep, dp);
  MOE_CHECK(dist::ep_backend_traits(backend).runs_data_parallel(), kInvalidArgument,
            "--dp {} --ep-backend {}: each GPU's own tokens must reach the experts through an exchange; "
            "use allgather_reducescatter, alltoall_padded, alltoall_packed or p2p",
            dp, dist::ep_backend_name(backend));
}

// The EP backend of --ep-backend `name` for the engine, before anything is loaded: an unknown
// name is refused naming the valid ones (kConfig), one this build lacks naming those it has
// (kUnsupported). The engine checks the rest (GPUs, peer access, NCCL) at load, before any
// weight is read.
inline dist::EpBackend engine_ep_backend(const std::string& name) {
  const dist::EpBackend b = dist::parse_ep_backend(name);
  MOE_CHECK(b != dist::EpBackend::kDeepep, kUnsupported,
            "--ep-backend deepep: this build has no DeepEP kernels; the engine runs local_allreduce, "
            "allgather_reducescatter, alltoall_padded, alltoall_packed and p2p");
  return b;
}

// Device bytes by what holds them, summed over the engine's GPUs.
struct MemoryReport {
  size_t weights = 0;    // bf16 matrices and f32 norms/biases
  size_t kv_cache = 0;   // the block pools of every layer
  size_t workspace = 0;  // activations of the largest step, expert and attention scratch, cuBLASLt
  size_t graph_outputs = 0;  // logits and token buffers each decode graph owns
  // kv_blocks counts the scratch block that padding rows of a graph write to, which is never
  // free: kv_blocks_free is at most kv_blocks - 1 (kv_blocks - dp under dp, where every
  // attention group has its own cache and scratch block).
  int64_t kv_blocks = 0, kv_blocks_free = 0;
  int64_t kv_blocks_cached = 0;  // full blocks findable for prefix reuse (in use or free)
};

// Device time of one decode step by operation, summed over layers (events between the
// operations of the step's graph): where a step's time goes.
struct OpProfile {
  std::vector<std::pair<std::string, double>> seconds;  // in first-seen order
  double total = 0;
  // Distinct routed experts the step's real rows used, per MoE layer (0 for dense layers): the
  // expert bytes the step had to read, for an exact floor.
  std::vector<int> experts_touched;
};

class Engine final : public runtime::Executor {
 public:
  // Validates the config (GQA and MLA attention) before anything is allocated.
  static std::unique_ptr<Engine> load(const std::string& dir, const EngineOptions& opts);
  ~Engine() override;
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  const ModelConfig& config() const;
  const EngineOptions& options() const;

  // The executor (runtime/executor.h): at most max_batch sequences (per attention group under
  // dp); the blocks exclude the scratch block that padding rows of a graph
  // write to.
  const runtime::ExecutorLimits& limits() const override;
  // A new empty sequence; throws kInvalidArgument when max_batch sequences are open.
  int32_t open() override;
  // Frees the sequence's KV blocks.
  void close(int32_t seq) override;
  int64_t length(int32_t seq) const override;
  // Prefix reuse: gives the empty sequence `seq` the cached blocks that hold `tokens`' leading
  // full blocks (computed for any sequence, open or closed since and not yet reused), as shared
  // references; returns the tokens it now holds (a multiple of the block size, never all of
  // `tokens`: the last one is left to compute). The caller prefills from there. 0 with
  // prefix_reuse off.
  int64_t reuse_prefix(int32_t seq, std::span<const int32_t> tokens) override;
  runtime::KvUsage kv_usage() const override;
  int group_of(int32_t seq) const override;
  runtime::KvUsage group_kv_usage(int group) const override;
  // One step: the rows of one token after a cached prefix that want no logits run as one batched
  // decode (from the bucket's graph), then each other row as a prefill (under dp, one prefill of
  // each attention group at a time, in lockstep chunks); each row draws with its own draw index.
  runtime::StepResult run(const runtime::StepPlan& plan) override;

  // Runs `ids` after the sequence's cached tokens and samples its next token on the device.
  // logits (when given): f32 on the host, [ids.size(), vocab] when all_logits, else [1, vocab].
  // Throws kInvalidArgument for ids outside the vocabulary, a full context or no free KV block.
  // With `profile`, the device time of the whole prefill per operation. The draw index is the
  // number of tokens this sequence sampled before (prefill or decode).
  int32_t prefill(int32_t seq, std::span<const int32_t> ids, const SamplingParams& params,
                  Tensor* logits = nullptr, bool all_logits = false, OpProfile* profile = nullptr);
  // One decode step: sequence seqs[i] takes tokens[i]; returns each one's next token. With
  // `profile`, the step runs from a graph of its own with events between operations.
  std::vector<int32_t> decode(std::span<const int32_t> seqs, std::span<const int32_t> tokens,
                              std::span<const SamplingParams> params, OpProfile* profile = nullptr);

  // Device bytes summed over the GPUs, and the KV blocks of every attention group.
  MemoryReport memory() const;
  // Each GPU's own bytes (weights, KV cache, workspace with its share of the exchanges' and
  // all-reduces' buffers, graph outputs), GPU device + r at r; its kv_blocks are its pools'
  // blocks and its free and cached ones its attention group's. memory() adds up their bytes.
  std::vector<MemoryReport> memory_per_gpu() const;
  // With record_routing (or after a profiled step): the experts each MoE layer chose for each
  // row of the last forward (the last chunk of a prefill), [layers, rows, top_k], ascending per
  // row; -1 for dense layers.
  std::vector<int32_t> last_routing() const;

  struct State;  // defined with the CUDA sources

 private:
  Engine();
  std::unique_ptr<State> s_;
};

}  // namespace moe::cuda
