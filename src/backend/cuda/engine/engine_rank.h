// One GPU's share of the CUDA engine (cuda_engine.cpp): its weights, stream, workspace, KV pools,
// step metadata buffers and decode graphs, and the forward that runs a step on them (the layer
// loop, attention, routing, feed-forward, the head and sampling, profiling marks). A step is
// described here as rows of token ids, positions, cache slots and block ids, written into the
// pinned metadata mirror and uploaded; sequences, their blocks' owners and step plans are the
// engine's, which writes those rows and drives every rank in lockstep. Nothing here calls back
// into the engine.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "backend/cuda/ops/blas.h"
#include "backend/cuda/device_arena.h"
#include "backend/cuda/engine/device_model.h"
#include "backend/cuda/engine/engine_buffers.h"
#include "backend/cuda/engine/projection.h"
#include "backend/cuda/comm/peer_allreduce.h"
#include "backend/cuda/comm/peer_column_gather.h"
#include "backend/cuda_engine.h"
#include "backend/cuda_ep.h"
#include "model/config.h"
#include "runtime/sampler.h"

namespace moe::cuda::engine {

struct DecodeGraph {
  int bucket = 0;
  cudaGraphExec_t exec = nullptr;
  float* logits = nullptr;   // [bucket, vocab] of the rows every graph shares
  int32_t* sampled = nullptr;
};

// A step's rows are a multiple of this: under dp with tp > 1 each GPU of an attention group
// passes an equal share of the group's rows to the EP exchange.
inline int row_unit(const EngineOptions& o) { return o.dp > 1 ? o.tp : 1; }
inline int64_t round_to_unit(int64_t rows, const EngineOptions& o) {
  const int64_t u = row_unit(o);
  return (rows + u - 1) / u * u;
}
// Rows of the largest eager forward: a prefill chunk, or a decode step of max_batch rows.
inline int64_t step_rows(const EngineOptions& o) {
  return round_to_unit(std::max<int64_t>(o.max_step_tokens, o.max_batch), o);
}
// Rows one GPU passes to the EP exchange at most: a step's, or under dp its share of its group's.
inline int64_t exchange_rows(const EngineOptions& o) { return step_rows(o) / row_unit(o); }

// How a decode step runs once its metadata is on the device.
enum class DecodeRun { kGraph, kProfiled, kEager };

// Where a rank's routed experts exchange rows with the other ranks' when o.ep_backend is not
// local_allreduce: this rank's endpoint of the engine's NCCL group (the collective backends) or
// the group's p2p exchange.
struct EpLink {
  dist::Communicator* comm = nullptr;
  P2pExchange* p2p = nullptr;
};

struct Rank {
  // Rank `r` of `n` (on device o.device + r), for options `o` already checked and completed:
  // attention shares (tp) and local_allreduce expert outputs summed through `sum` (its attention
  // group's all-reduce), the other EP backends' exchanges through `link`. Host fields only:
  // setup() allocates.
  Rank(const ModelConfig& mc, const EngineOptions& o, int r, int n, const PeerAllReduce* sum, EpLink link = {});
  ~Rank();
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;

  // --- loading (with this rank's device current) -------------------------------------------
  // This rank's weights, stream, libraries, workspace and step buffers (the KV cache comes after
  // every rank has loaded: allocate_kv).
  void setup(const std::string& dir);
  // The KV blocks that fit in 90% of the device's free memory.
  int64_t kv_blocks_that_fit() const;
  // `blocks` blocks per layer; block 0 is the scratch block of padding rows.
  void allocate_kv(int64_t blocks);
  void allocate_routing_log();  // a diagnostic buffer, allocated outside any forward

  // --- step metadata, into the pinned host mirror ------------------------------------------
  // Row `row` of the step: token `id` at `position`, its keys and values written to cache row
  // `slot` of the engine's block allocator (whose block b is pool block b + 1).
  void set_token(int64_t row, int32_t id, int64_t position, int64_t slot);
  // Attention segment `index`: rows from `first_row` on attend to the `context` tokens held by
  // allocator blocks `blocks`, and its sampled token is draw number `draw` under `params`.
  void set_segment(int index, int64_t first_row, int64_t context, std::span<const int32_t> blocks,
                   const SamplingParams& params, int64_t draw);
  // Ends the step's segments: `segments` of them over `rows` rows.
  void end_segments(int segments, int64_t rows);
  // Rows [from, to) of a decode step as padding (closing the segments at `to`).
  void fill_padding(int from, int to);
  // Rows [from, to) of an eager step as one padding segment `index` (closing the segments after
  // it): a rank under dp whose sequences have fewer rows in the step than another's.
  void pad_segment(int index, int64_t from, int64_t to);
  // Copies `written`'s host mirror unless it is this rank's own, then sends it to the device.
  void upload_meta_from(const Rank& written);

  // --- steps (metadata uploaded) -----------------------------------------------------------
  // One eager forward of `rows` rows in `segments` segments whose contexts end by `context`,
  // the first `real` rows one sequence's (the rest padding). On a rank that reads out: with
  // `logits_out`, the real rows' logits into host memory [real, vocab]; with `sample`, the last
  // real row's logits and next token into ws.logits and ws.sampled. Returns once done.
  void eager_step(int64_t rows, int segments, int64_t real, int64_t context, float* logits_out, bool sample);
  // One decode step of `bucket` rows, the first `rows` real ones; a rank that reads out copies
  // their sampled tokens into host memory `tokens`. Returns once done.
  void decode_step(int64_t rows, int bucket, DecodeRun how, int32_t* tokens);
  // Whether this rank's final rows are read out (logits, sampling): the first rank of its
  // attention group (rank 0 without dp), whose rows the group shares.
  bool reads_out() const { return group_rank == 0; }
  // Whether this rank runs the head: the one that reads out, and with a head_gather every rank
  // of the group (each computing its share of the vocabulary).
  bool runs_head() const { return reads_out() || head_gather != nullptr; }
  // The smallest decode graph bucket of at least `rows` rows (the largest for more).
  int bucket_for(int64_t rows) const;
  // The bucket's graph, captured on first use (which overwrites the step metadata with padding).
  DecodeGraph& graph_for(int bucket);

  // --- profiling and diagnostics ------------------------------------------------------------
  // Profiling of eager forwards (rank 0's): with `on`, marks from here on, the first of which
  // starts the clock; end_profile stops them and, with `profile`, collects their times.
  void begin_profile(bool on);
  void end_profile(OpProfile* profile);
  // Device time between consecutive marks, summed per name (after the stream finished).
  void collect(OpProfile* profile);
  // The routing log of the last forward's real rows, [layers, rows, top_k] (-1 without a log).
  std::vector<int32_t> routing() const;
  // Adds this rank's device bytes.
  void count_memory(MemoryReport* r) const;

  // --- fixed at construction ---------------------------------------------------------------
  ModelConfig config;
  EngineOptions opts;  // this rank's: its device, progress on rank 0 only
  int rank = 0, ranks = 1;
  bool tp = false;
  // Data-parallel attention (opts.dp > 1): this rank's attention group runs attention and the
  // head for its own sequences, with its own KV cache and step metadata, and the experts
  // exchange those rows only.
  bool dp = false;
  // The attention group: the GPUs that share this rank's rows (all of them, or tp under dp), and
  // this rank's place in it.
  int group = 0, group_size = 1, group_rank = 0;
  // Under dp with tp > 1: each rank of a group exchanges its share of the group's rows with the
  // experts, and the group's all-reduce gives every rank all of them back.
  bool split_rows = false;
  const PeerAllReduce* allreduce = nullptr;  // sums partial outputs over the group (tp, local_allreduce)
  // Groups of several GPUs: the group's lm_head shares gathered on its first (set after construction).
  const PeerColumnGather* head_gather = nullptr;
  EpLink ep_link;
  // Whether the routed experts run through an EP exchange (ep_layers) rather than this rank's
  // experts on every token and the all-reduce.
  bool exchanges = false;
  // Whether a decode step can be captured in a graph (the exchange's traits).
  bool capturable = true;
  // max_rows: the largest decode step, max_batch rounded to the row unit.
  int64_t max_tokens = 0, max_rows = 0, max_blocks = 0, logit_rows = 0;

  // --- on the device -----------------------------------------------------------------------
  std::unique_ptr<DeviceModel> model;
  std::unique_ptr<Blas> blas;
  cudaStream_t stream = nullptr;
  DeviceArena workspace_arena, kv_arena, meta_arena, graph_arena;
  float* graph_logits = nullptr;  // [max_batch, vocab] in graph_arena
  int32_t* graph_sampled = nullptr;
  Workspace ws{};
  StepMeta meta{};
  char* meta_host = nullptr;  // pinned mirror of meta_arena
  int64_t kv_blocks = 0;
  std::vector<uint16_t*> k_cache, v_cache;
  std::vector<DecodeGraph> graphs;
  std::vector<int> buckets;
  // With `exchanges`: each sparse layer's experts behind the exchange (null for dense layers),
  // all sharing one workspace (their calls are ordered on the stream).
  std::vector<std::unique_ptr<EpExperts>> ep_layers;
  DeviceArena ep_arena;

 private:
  // Host address of a device meta pointer.
  template <typename T>
  T* host(T* device) {
    return reinterpret_cast<T*>(meta_host + (reinterpret_cast<char*>(device) - static_cast<char*>(meta_arena.base())));
  }
  void write_table(int row, std::span<const int32_t> blocks);
  void write_sampling(int row, const SamplingParams& params, int64_t draw);
  void upload_meta();
  size_t kv_block_bytes(size_t* k_block, size_t* v_block) const;

  // The forward (engine_rank.cpp).
  void run_layers(int64_t tokens, int64_t seqs, int64_t max_context);
  void attention(int64_t l, int64_t tokens, int64_t seqs, int64_t max_context);
  void latent_attention(int64_t l, int64_t tokens, int64_t seqs, int64_t max_context);
  void sum_head_shares(const DeviceLayer& L, int64_t tokens);
  void route(int64_t l, int64_t tokens);
  bool feed_forward(int64_t l, int64_t tokens, bool* next_normed);
  bool shared_expert(int64_t l, int64_t tokens);
  bool gather_shares(int64_t l, int64_t tokens, bool* next_normed);
  void head(int64_t first, int64_t rows, float* logits, int32_t* sampled);
  bool fused_router(int64_t tokens) const;
  void all_reduce(uint16_t* rows, int64_t tokens, const PeerAllReduce::AddNorm* then = nullptr);
  void finish_step();
  void setup_exchange();
  void profiled_step(int bucket, float* logits, int32_t* sampled);
  void mark(const char* name);

  bool post_normed = false;  // this layer's post-attention norm was folded into the all-reduce
  // The next layer's q/k/v input as the routed experts' folded norm wrote it (rows 0: all in ws.h).
  Fp8Input qkv_in;
  // Profiling: events recorded between operations while `profiling` (never inside a capture).
  bool profiling = false;
  std::vector<cudaEvent_t> marks;
  std::vector<const char*> mark_names;
  // [layers, max_tokens, top_k]: each layer's expert choice of the last step, kept while profiling
  // or when the options ask for it (tests compare it with the CPU's).
  int32_t* routed_log = nullptr;
  int64_t last_tokens = 0;
};

}  // namespace moe::cuda::engine
