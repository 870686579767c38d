// A decoder-only model on the CPU: loads a Hugging Face directory and runs forwards that extend a
// KV cache. The tools and tests use only this and the tokenizer.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/thread_pool.h"
#include "model/config.h"
#include "dist/communicator.h"
#include "dist/dist_config.h"
#include "model/weights.h"
#include "moe/ep/ep_backend.h"
#include "moe/experts.h"
#include "moe/placement.h"
#include "runtime/kv_cache.h"

namespace moe {

struct LoadOptions {
  bool strict = true;     // every tensor must be used and present
  int threads = 0;        // CPU threads; 0 = all hardware threads
  bool progress = false;  // draw a progress line on stderr when it is a terminal
  // Ignore the checkpoint: take config.json only and draw random weights (benchmarks of real
  // shapes). The directory needs no weight files.
  bool random_weights = false;
  uint64_t seed = 0;
  ExecMode exec = ExecMode::kGrouped;  // how routed experts run
  // Expert parallelism: this model is rank comm->rank() of comm->size(), holds only its block of
  // experts, and runs its MoE layers through `ep_backend`. Null: one rank holds everything.
  dist::Communicator* comm = nullptr;
  dist::EpBackend ep_backend = dist::EpBackend::kLocalAllreduce;
};

// One sequence of a batched forward: its new tokens and its own cache.
struct SequenceInput {
  std::span<const int32_t> ids;
  KvCache* cache = nullptr;
  bool all_logits = false;
};

class Model {
 public:
  // Validates the config first, then maps the weights and converts them to the compute layout.
  static std::unique_ptr<Model> load(const std::string& dir, const LoadOptions& opts = {});

  const ModelConfig& config() const { return config_; }
  const std::string& dir() const { return dir_; }

  // A cache for up to `capacity` tokens (0: the model's max_position_embeddings).
  KvCache new_cache(int64_t capacity = 0) const;

  // Runs `ids` at positions [cache.length(), cache.length() + T), appends them to the cache and
  // returns f32 logits: [T, vocab] when all_logits, else [1, vocab] for the last position.
  // Throws kInvalidArgument for an empty input, an id outside the vocabulary, a full cache, or
  // new rows that would land in a block the cache shares with another (a reused prefix).
  Tensor forward(std::span<const int32_t> ids, KvCache& cache, bool all_logits = false);
  // Several sequences in one forward: every linear layer and MoE block sees all their tokens at
  // once; attention runs per sequence over its own cache. Returns one logits tensor per
  // sequence. Nothing is changed when any input is rejected.
  std::vector<Tensor> forward_batch(const std::vector<SequenceInput>& batch);

  size_t weight_bytes() const { return weights_arena_.used(); }
  size_t workspace_bytes() const { return workspace_.high_water(); }
  // Tokens routed to each expert of each layer since load (layer -> expert -> count; empty for
  // dense layers).
  const std::vector<std::vector<int64_t>>& expert_tokens() const { return expert_tokens_; }
  ThreadPool& pool() { return pool_; }
  // Expert-parallel traffic and control-plane time of the MoE layers since load or clear.
  EpStats& ep_stats() { return ep_stats_; }
  size_t expert_bytes() const;  // this rank's routed-expert weights (the packed copy is the only one)
  // Called with every MoE layer's router logits [tokens, experts] as they are computed, and the
  // correction bias of the choice (null when the router has none): lets tests and analysis see
  // how close each routing decision was.
  std::function<void(int64_t layer, const float* logits, const float* bias, int64_t tokens, int64_t experts)>
      on_router;

 private:
  Model(std::string dir, ModelConfig config, int threads, ExecMode exec);
  // Rows [begin, end) of a batched forward belong to one sequence whose cache held `start`
  // tokens before the call.
  struct Segment {
    int64_t begin, end;
    KvCache* cache;
    int64_t start;
  };
  void attention(int64_t layer, const Tensor& h, const std::vector<int32_t>& positions,
                 const std::vector<Segment>& segments, Tensor& out);
  void latent_attention(int64_t layer, const Tensor& h, const std::vector<int32_t>& positions,
                        const std::vector<Segment>& segments, Tensor& out);
  void dense_ffn(const FfnWeights& w, const Tensor& h, Tensor& out);
  void sparse_ffn(int64_t layer, const Tensor& h, Tensor& out);

  std::string dir_;
  ModelConfig config_;
  ExecMode exec_;
  ThreadPool pool_;
  Arena weights_arena_;
  Arena workspace_;
  ModelWeights weights_;
  std::vector<int32_t> local_of_;  // global expert -> packed index on this rank
  dist::Communicator* comm_ = nullptr;
  std::unique_ptr<ExpertPlacement> placement_;
  std::unique_ptr<EpBackend> ep_;
  EpStats ep_stats_;
  ExpertPlan plan_;
  RopeTable rope_;
  std::vector<std::vector<int64_t>> expert_tokens_;
};

// The state-dict keys (and shapes) a configuration implies, in load order; `experts` limits the
// routed experts as a rank of an expert-parallel group would.
std::vector<std::pair<std::string, std::vector<int64_t>>> state_dict_keys(
    const ModelConfig& mc, const ExpertSelection& experts = {});
int64_t parameter_count(const ModelConfig& mc);

}  // namespace moe
