// The CPU reference model as a runtime::Executor: a paged KV pool in host memory, the sequence
// table over it, and the host sampler. What the scheduler runs with --device cpu.
#pragma once

#include <cstdint>

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
  // The model must outlive the executor. Throws kInvalidArgument for impossible options.
  Executor(Model& model, const ExecutorOptions& options);

  const runtime::ExecutorLimits& limits() const override { return limits_; }
  int32_t open() override { return table_.open(); }
  void close(int32_t seq) override { table_.close(seq); }
  int64_t length(int32_t seq) const override { return table_.at(seq).length; }
  int64_t reuse_prefix(int32_t seq, std::span<const int32_t> tokens) override {
    return table_.reuse_prefix(seq, tokens);
  }
  runtime::KvUsage kv_usage() const override;
  std::vector<int32_t> run(const runtime::StepPlan& plan) override;

  Model& model() { return model_; }

 private:
  Model& model_;
  ExecutorOptions options_;  // checked, defaults filled in
  runtime::ExecutorLimits limits_;
  KvBlockPool pool_;     // before the table, which gives its blocks back as it dies
  SequenceTable table_;
  Sampler sampler_{SamplingParams{}};  // scratch kept between draws; each row sets its own parameters
};

}  // namespace moe::cpu
