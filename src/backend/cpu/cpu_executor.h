// The CPU reference model as a runtime::Executor: a paged KV pool in host memory, the sequence
// table over it, and the host sampler. One rank, or `ep` expert-parallel ranks as threads of this
// process: each rank holds its block of the routed experts (and the rest of the model), its own
// KV pool with the same block ids, and runs every step; rank 0's logits are the step's output.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/model.h"
#include "runtime/executor.h"
#include "runtime/kv_cache.h"
#include "runtime/sampler.h"
#include "runtime/sequence_table.h"

namespace moe::cpu {

struct ExecutorOptions {
  int64_t kv_blocks = 256;      // blocks in the pool
  int64_t block_size = 16;      // tokens per block
  int64_t max_sequences = 16;   // open at once
  int64_t max_context = 0;      // tokens per sequence; 0: the model's max positions
  // Ids at or past this are never sampled (0: none excluded). Models pad their vocabulary past
  // the tokenizer's ids (Qwen3: 151936 vs 151669).
  int64_t sampled_vocab = 0;
  bool prefix_reuse = true;
};

class Executor final : public runtime::Executor {
 public:
  // One rank over a model the caller loaded and keeps alive. Throws kInvalidArgument for
  // impossible options.
  Executor(Model& model, const ExecutorOptions& options);
  // Loads `dir` as `ep` ranks (load.comm must be null; load.ep_backend is how the ranks exchange
  // tokens). The parallel settings are checked against this build and the model's experts
  // before any weight is read; load.threads (0: all) is split between the ranks.
  static std::unique_ptr<Executor> load(const std::string& dir, const LoadOptions& load, int ep,
                                        const ExecutorOptions& options);
  ~Executor() override;

  const runtime::ExecutorLimits& limits() const override { return limits_; }
  int32_t open() override { return table_.open(); }
  void close(int32_t seq) override { table_.close(seq); }
  int64_t length(int32_t seq) const override { return table_.at(seq).length; }
  int64_t reuse_prefix(int32_t seq, std::span<const int32_t> tokens) override {
    return table_.reuse_prefix(seq, tokens);
  }
  runtime::KvUsage kv_usage() const override;
  runtime::StepResult run(const runtime::StepPlan& plan) override;

  int ranks() const { return static_cast<int>(models_.size()); }
  Model& model(int rank = 0) { return *models_.at(static_cast<size_t>(rank)); }

 private:
  struct Ranks;  // the rank threads, their communicators and their models
  Executor(std::unique_ptr<Ranks> ranks, std::vector<Model*> models, const ExecutorOptions& options);

  std::unique_ptr<Ranks> ranks_;  // null for one borrowed model
  std::vector<Model*> models_;    // one per rank
  ExecutorOptions options_;       // checked, defaults filled in
  runtime::ExecutorLimits limits_;
  // One pool per rank, the same shape: a block id means the same rows on every rank. Rank 0's
  // allocator keeps the books for all of them. Before the table, which gives its blocks back as
  // it dies.
  std::vector<std::unique_ptr<KvBlockPool>> pools_;
  SequenceTable table_;
  Sampler sampler_{SamplingParams{}};  // scratch kept between draws; each row sets its own parameters
};

}  // namespace moe::cpu
