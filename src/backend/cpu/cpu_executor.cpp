#include "backend/cpu/cpu_executor.h"

#include <algorithm>

#include "moe/errors.h"

namespace moe::cpu {
namespace {

ExecutorOptions checked(ExecutorOptions o, const ModelConfig& mc) {
  MOE_CHECK(o.max_sequences >= 1, kInvalidArgument, "max_batch must be at least 1, got {}", o.max_sequences);
  if (o.max_context == 0) o.max_context = mc.max_position_embeddings;
  MOE_CHECK(o.max_context >= 2 && o.max_context <= mc.max_position_embeddings, kInvalidArgument,
            "max_context {} must be in [2, {}] (the model's positions)", o.max_context, mc.max_position_embeddings);
  MOE_CHECK(o.sampled_vocab >= 0, kInvalidArgument, "sampled_vocab must not be negative, got {}", o.sampled_vocab);
  if (o.sampled_vocab == 0 || o.sampled_vocab > mc.vocab_size) o.sampled_vocab = mc.vocab_size;
  return o;
}

}  // namespace

Executor::Executor(Model& model, const ExecutorOptions& options)
    : model_(model),
      options_(checked(options, model.config())),
      limits_{options_.max_sequences, options_.max_context, options_.block_size, options_.kv_blocks,
              model.config().vocab_size},
      pool_(model.config().num_layers, options_.kv_blocks, options_.block_size, model.config().kv_key_width(),
            model.config().kv_value_width()),
      table_(pool_.allocator(), options_.max_sequences, options_.max_context, options_.prefix_reuse) {}

runtime::KvUsage Executor::kv_usage() const {
  return {pool_.num_blocks(), pool_.free_blocks(), pool_.cached_blocks()};
}

std::vector<int32_t> Executor::run(const runtime::StepPlan& plan) {
  runtime::check_plan(plan, *this);
  int64_t need = 0;
  for (const runtime::StepRow& r : plan.rows) need += table_.blocks_needed(r.seq, r.count);
  MOE_CHECK(need <= pool_.free_blocks(), kInvalidArgument, "KV cache full: {} more blocks needed, {} free", need,
            pool_.free_blocks());
  for (const runtime::StepRow& r : plan.rows) table_.reserve(r.seq, r.count);

  // The model reads and writes each sequence through a view of the table's blocks.
  std::vector<KvCache> caches;
  caches.reserve(plan.rows.size());
  std::vector<SequenceInput> batch;
  for (const runtime::StepRow& r : plan.rows) {
    const Sequence& s = table_.at(r.seq);
    caches.push_back(KvCache::borrowed(pool_, s.blocks, s.length));
    batch.push_back({std::span<const int32_t>(plan.tokens).subspan(static_cast<size_t>(r.offset),
                                                                   static_cast<size_t>(r.count)),
                     &caches.back(), false});
  }
  const std::vector<Tensor> logits = model_.forward_batch(batch);

  std::vector<int32_t> next(plan.rows.size(), -1);
  for (size_t i = 0; i < plan.rows.size(); ++i) {
    const runtime::StepRow& r = plan.rows[i];
    table_.append(r.seq, batch[i].ids);
    if (!r.sample) continue;
    sampler_.set_params(r.sampling);
    next[i] = sampler_.sample(logits[i].data<float>(), options_.sampled_vocab, r.draw);
  }
  return next;
}

}  // namespace moe::cpu
