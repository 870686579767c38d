#include "backend/cpu/cpu_executor.h"

#include <algorithm>
#include <thread>

#include "dist/dist_config.h"
#include "dist/rank_group.h"
#include "model/config.h"
#include "moe/errors.h"

namespace moe::cpu {

// The ranks of a loaded model: their threads and communicators, and the models (which hold
// their communicators, so they go first).
struct Executor::Ranks {
  std::unique_ptr<dist::RankGroup> group;  // null for one rank
  std::vector<std::unique_ptr<Model>> models;

  ~Ranks() { models.clear(); }
};

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

std::vector<std::unique_ptr<KvBlockPool>> make_pools(size_t ranks, const ModelConfig& mc, const ExecutorOptions& o) {
  std::vector<std::unique_ptr<KvBlockPool>> pools;
  for (size_t r = 0; r < ranks; ++r)
    pools.push_back(std::make_unique<KvBlockPool>(mc.num_layers, o.kv_blocks, o.block_size, mc.kv_key_width(),
                                                  mc.kv_value_width()));
  return pools;
}

}  // namespace

Executor::Executor(Model& model, const ExecutorOptions& options) : Executor(nullptr, {&model}, options) {}

Executor::Executor(std::unique_ptr<Ranks> ranks, std::vector<Model*> models, const ExecutorOptions& options)
    : ranks_(std::move(ranks)),
      models_(std::move(models)),
      options_(checked(options, models_[0]->config())),
      limits_{options_.max_sequences, options_.max_context, options_.block_size, options_.kv_blocks,
              models_[0]->config().vocab_size},
      pools_(make_pools(models_.size(), models_[0]->config(), options_)),
      table_(pools_[0]->allocator(), options_.max_sequences, options_.max_context, options_.prefix_reuse) {}

Executor::~Executor() = default;

std::unique_ptr<Executor> Executor::load(const std::string& dir, const LoadOptions& load, int ep,
                                         const ExecutorOptions& options) {
  MOE_CHECK(load.comm == nullptr, kInvalidArgument, "the executor makes its ranks' communicators itself");
  dist::DistConfig dc;
  dc.ep = ep;
  dc.ep_backend = dist::ep_backend_name(load.ep_backend);
  dist::validate_dist_config(dc);
  if (ep == 1) {
    auto ranks = std::make_unique<Ranks>();
    ranks->models.push_back(Model::load(dir, load));
    Model* m = ranks->models[0].get();
    return std::unique_ptr<Executor>(new Executor(std::move(ranks), {m}, options));
  }
  dist::validate_ep_for_model(dc, load_model_config(dir).moe.num_experts);  // before any weight

  auto ranks = std::make_unique<Ranks>();
  ranks->group = std::make_unique<dist::RankGroup>(ep);
  ranks->models.resize(static_cast<size_t>(ep));
  const int threads = load.threads > 0 ? load.threads : static_cast<int>(std::thread::hardware_concurrency());
  ranks->group->run([&](int r, dist::Communicator& comm) {
    LoadOptions lo = load;
    lo.comm = &comm;
    lo.threads = std::max(1, threads / ep);
    lo.progress = load.progress && r == 0;
    ranks->models[static_cast<size_t>(r)] = Model::load(dir, lo);
  });
  std::vector<Model*> models;
  for (auto& m : ranks->models) models.push_back(m.get());
  return std::unique_ptr<Executor>(new Executor(std::move(ranks), std::move(models), options));
}

runtime::KvUsage Executor::kv_usage() const {
  const KvBlockPool& p = *pools_[0];
  return {p.num_blocks(), p.free_blocks(), p.cached_blocks()};
}

runtime::StepResult Executor::run(const runtime::StepPlan& plan) {
  runtime::check_plan(plan, *this);
  int64_t need = 0;
  for (const runtime::StepRow& r : plan.rows) need += table_.blocks_needed(r.seq, r.count);
  MOE_CHECK(need <= pools_[0]->free_blocks(), kInvalidArgument, "KV cache full: {} more blocks needed, {} free",
            need, pools_[0]->free_blocks());
  for (const runtime::StepRow& r : plan.rows) table_.reserve(r.seq, r.count);

  // Every rank runs the same rows, reading and writing its own pool through views of the
  // table's blocks.
  auto forward = [&](int rank) {
    std::vector<KvCache> caches;
    caches.reserve(plan.rows.size());
    std::vector<SequenceInput> batch;
    for (const runtime::StepRow& r : plan.rows) {
      const Sequence& s = table_.at(r.seq);
      caches.push_back(KvCache::borrowed(*pools_[static_cast<size_t>(rank)], s.blocks, s.length));
      batch.push_back({std::span<const int32_t>(plan.tokens).subspan(static_cast<size_t>(r.offset),
                                                                     static_cast<size_t>(r.count)),
                       &caches.back(), r.logits == runtime::RowLogits::kAll});
    }
    return models_[static_cast<size_t>(rank)]->forward_batch(batch);
  };
  std::vector<Tensor> logits;
  if (ranks() == 1) {
    logits = forward(0);
  } else {
    ranks_->group->run([&](int rank, dist::Communicator&) {
      std::vector<Tensor> mine = forward(rank);
      if (rank == 0) logits = std::move(mine);
    });
  }

  runtime::StepResult out;
  out.tokens.assign(plan.rows.size(), -1);
  out.logits.resize(plan.rows.size());
  for (size_t i = 0; i < plan.rows.size(); ++i) {
    const runtime::StepRow& r = plan.rows[i];
    table_.append(r.seq, std::span<const int32_t>(plan.tokens).subspan(static_cast<size_t>(r.offset),
                                                                       static_cast<size_t>(r.count)));
    const Tensor& l = logits[i];
    if (r.sample) {
      sampler_.set_params(r.sampling);
      // With kAll the last position's row is the one the next token follows.
      out.tokens[i] = sampler_.sample(l.data<float>() + (l.dim(0) - 1) * l.dim(1), options_.sampled_vocab, r.draw);
    }
    if (r.logits != runtime::RowLogits::kNone) out.logits[i] = std::move(logits[i]);
  }
  return out;
}

}  // namespace moe::cpu
