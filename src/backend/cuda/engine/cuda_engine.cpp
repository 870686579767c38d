// The engine as an executor: loading every rank, the sequence table over one block allocator,
// and the steps. A plan's rows become step metadata (token ids, positions, cache slots, block
// tables, sampling) written into rank 0's pinned mirror and run by every rank in lockstep; the
// forward itself is engine::Rank's (engine_rank.h), which knows nothing of sequences.
#include "backend/cuda_engine.h"

#include <algorithm>
#include <functional>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/engine/device_model.h"
#include "backend/cuda/engine/engine_rank.h"
#include "backend/cuda/comm/peer_allreduce.h"
#include "backend/cuda_ep.h"
#include "dist/nccl_communicator.h"
#include "core/rank_threads.h"
#include "moe/errors.h"
#include "runtime/block_allocator.h"
#include "runtime/sequence_table.h"

namespace moe::cuda {

using engine::Rank;

struct Engine::State {
  // Rank r on device opts.device + r; rank 0's step metadata mirror is the one the host writes.
  std::vector<std::unique_ptr<Rank>> ranks;
  std::unique_ptr<PeerAllReduce> allreduce;  // sums the ranks' partial outputs (tp, local_allreduce)
  // The expert-parallel exchange of the other backends: NCCL endpoints (rank r's at r) or the
  // p2p exchange.
  std::unique_ptr<NcclGroup> nccl;
  std::vector<std::unique_ptr<dist::Communicator>> comms;
  std::unique_ptr<P2pExchange> p2p;
  std::unique_ptr<RankThreads> threads;      // several GPUs: one host thread per rank
  // Blocks 1 .. kv_blocks - 1 of every rank's pools as allocator blocks 0 .. kv_blocks - 2
  // (pool block 0 is the scratch block of padding rows).
  std::unique_ptr<BlockAllocator> blocks;
  std::unique_ptr<SequenceTable> table;  // over `blocks`, which it gives back to as it dies
  runtime::ExecutorLimits limits;

  ~State() {
    // The host threads first, then the other ranks (each on its own device), what joins them,
    // and rank 0 last.
    threads.reset();
    for (size_t r = 1; r < ranks.size(); ++r) ranks[r].reset();
    allreduce.reset();
    p2p.reset();
    comms.clear();
    nccl.reset();
    ranks.clear();
  }

  Rank& first() { return *ranks.front(); }
  const Rank& first() const { return *ranks.front(); }

  // job(rank) on every rank at once, each on its own thread with its device current.
  void each_rank(const std::function<void(Rank&)>& job) {
    auto one = [&](int r) {
      Rank& x = *ranks[static_cast<size_t>(r)];
      MOE_CUDA_CHECK(cudaSetDevice(x.opts.device));
      job(x);
    };
    if (threads) threads->run(one);
    else one(0);
  }

  int64_t free_blocks() const { return blocks->free_blocks(); }
};

Engine::Engine() : s_(std::make_unique<State>()) {}
Engine::~Engine() = default;

const ModelConfig& Engine::config() const { return s_->first().config; }
const EngineOptions& Engine::options() const { return s_->first().opts; }

namespace {

// The options checked against the model and this machine, with their defaults filled in; throws
// before anything is allocated.
EngineOptions checked_options(const ModelConfig& mc, const EngineOptions& options) {
  EngineOptions o = options;
  MOE_CHECK(o.max_batch >= 1 && o.max_batch <= 1024, kInvalidArgument,
            "max batch {} must be in [1, 1024]", o.max_batch);
  MOE_CHECK(o.block_size >= 8 && o.block_size <= 64 && (o.block_size & (o.block_size - 1)) == 0,
            kInvalidArgument, "KV block size {} must be a power of two in [8, 64]", o.block_size);
  if (o.max_context <= 0) o.max_context = std::min<int64_t>(mc.max_position_embeddings, 4096);
  MOE_CHECK(o.max_context <= mc.max_position_embeddings, kInvalidArgument,
            "max context {} exceeds the model's max_position_embeddings {}", o.max_context,
            mc.max_position_embeddings);
  MOE_CHECK(o.max_step_tokens >= 1, kInvalidArgument, "max step tokens must be >= 1");
  const int ranks = engine_ranks(o.tp, o.ep);
  check_parallel_supported(mc, ranks, o.tp > 1);
  const char* backend = dist::ep_backend_name(o.ep_backend);
  MOE_CHECK(o.ep_backend != dist::EpBackend::kDeepep, kUnsupported, "--ep-backend deepep: this build has no DeepEP kernels");
  MOE_CHECK(ranks > 1 || o.ep_backend == dist::EpBackend::kLocalAllreduce, kInvalidArgument,
            "--ep-backend {} exchanges tokens between GPUs: it needs --ep 2 or more", backend);
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || o.device < 0 || o.device + ranks > count) {
    cudaGetLastError();
    MOE_CHECK(ranks > 1, kUnsupported, "--device cuda: no CUDA device {} (this machine has {})", o.device, count);
    MOE_THROW(kUnsupported, "--tp {} --ep {} needs {} GPUs from device {}; this machine has {}", o.tp, o.ep,
              ranks, o.device, count);
  }
  if (ranks > 1) {
    std::vector<int> devices;
    for (int r = 0; r < ranks; ++r) devices.push_back(o.device + r);
    const dist::EpBackendTraits& traits = dist::ep_backend_traits(o.ep_backend);
    std::string why;
    if ((o.tp > 1 || traits.needs_peer_access || !traits.reduced_output) && !peer_access_available(devices, &why))
      MOE_THROW(kUnsupported, "--tp {} --ep {} --ep-backend {} needs peer access between the GPUs: {}{}", o.tp,
                o.ep, backend, why,
                o.tp > 1 ? "" : "; allgather_reducescatter, alltoall_padded and alltoall_packed run without it");
    if (!traits.needs_peer_access && traits.reduced_output && !nccl_available(&why))
      MOE_THROW(kUnsupported, "--ep-backend {} exchanges through NCCL, which is unavailable: {}", backend, why);
  }
  return o;
}

}  // namespace

std::unique_ptr<Engine> Engine::load(const std::string& dir, const EngineOptions& options) {
  ModelConfig mc = load_model_config(dir);
  check_cuda_supported(mc);
  const EngineOptions o = checked_options(mc, options);
  const int ranks = engine_ranks(o.tp, o.ep);
  const int64_t max_tokens = engine::step_rows(o);
  std::unique_ptr<Engine> engine(new Engine());
  State& s = *engine->s_;
  if (ranks > 1) {
    std::vector<int> devices;
    for (int r = 0; r < ranks; ++r) devices.push_back(o.device + r);
    const dist::EpBackendTraits& traits = dist::ep_backend_traits(o.ep_backend);
    if (o.tp > 1 || !traits.reduced_output)
      s.allreduce = std::make_unique<PeerAllReduce>(devices, max_tokens * mc.hidden_size);
    if (o.ep_backend == dist::EpBackend::kP2p) {
      s.p2p = std::make_unique<P2pExchange>(devices, mc.hidden_size, mc.moe.top_k, max_tokens);
    } else if (traits.reduced_output) {
      s.nccl = std::make_unique<NcclGroup>(devices);
      for (int r = 0; r < ranks; ++r) s.comms.push_back(s.nccl->communicator(r));
    }
  }
  for (int r = 0; r < ranks; ++r) {
    engine::EpLink link{s.comms.empty() ? nullptr : s.comms[static_cast<size_t>(r)].get(), s.p2p.get()};
    s.ranks.push_back(std::make_unique<Rank>(mc, o, r, ranks, s.allreduce.get(), link));
  }
  if (ranks > 1) s.threads = std::make_unique<RankThreads>(ranks);
  // Every rank loads its share at once; then the KV cache takes the same number of blocks on
  // each (block ids are shared), as many as the fullest GPU allows.
  std::vector<int64_t> fits(static_cast<size_t>(ranks));
  s.each_rank([&](Rank& x) {
    x.setup(dir);
    fits[static_cast<size_t>(x.rank)] = x.kv_blocks_that_fit();
  });
  int64_t blocks = o.kv_blocks;
  if (blocks <= 0)
    blocks = std::min<int64_t>(o.max_batch * s.first().max_blocks + 1, *std::min_element(fits.begin(), fits.end()));
  MOE_CHECK(blocks >= 2, kInvalidArgument, "GPU memory: no room for the KV cache ({} blocks)", blocks);
  s.each_rank([&](Rank& x) { x.allocate_kv(blocks); });
  if (o.record_routing) s.first().allocate_routing_log();
  s.blocks = std::make_unique<BlockAllocator>(blocks - 1, o.block_size);
  s.table = std::make_unique<SequenceTable>(*s.blocks, o.max_batch, o.max_context, o.prefix_reuse);
  s.limits = {o.max_batch, o.max_context, o.block_size, blocks - 1, mc.vocab_size};
  return engine;
}

const runtime::ExecutorLimits& Engine::limits() const { return s_->limits; }
int32_t Engine::open() { return s_->table->open(); }
void Engine::close(int32_t seq) { s_->table->close(seq); }
int64_t Engine::length(int32_t seq) const { return s_->table->at(seq).length; }
int64_t Engine::reuse_prefix(int32_t seq, std::span<const int32_t> tokens) {
  return s_->table->reuse_prefix(seq, tokens);
}
runtime::KvUsage Engine::kv_usage() const {
  const State& s = *s_;
  return {s.blocks->num_blocks(), s.blocks->free_blocks(), s.blocks->cached_blocks()};
}

namespace {

using State = Engine::State;

// Runs `ids` after sequence `seq`'s cached tokens (in chunks of max_step_tokens) and draws its
// next token as draw number `draw`.
int32_t run_prefill(State& s, int32_t seq, std::span<const int32_t> ids, const SamplingParams& params,
                    int64_t draw, Tensor* logits, bool all_logits, OpProfile* profile) {
  Rank& s0 = s.first();
  const ModelConfig& c = s0.config;
  const EngineOptions& o = s0.opts;
  MOE_CUDA_CHECK(cudaSetDevice(o.device));  // the caller's thread may not be the loader's
  validate_sampling(params);
  const Sequence& q = s.table->at(seq);
  const int64_t n = static_cast<int64_t>(ids.size());
  MOE_CHECK(n > 0, kInvalidArgument, "empty input: at least one token is needed");
  for (int32_t id : ids)
    MOE_CHECK(id >= 0 && id < c.vocab_size, kInvalidArgument,
              "token id {} is outside the vocabulary [0, {})", id, c.vocab_size);
  s.table->reserve(seq, n);  // checks the context and the free blocks first
  if (logits) *logits = Tensor::zeros({all_logits ? n : 1, c.vocab_size});
  const int64_t start = q.length;
  // Profiled prefill runs as usual (eagerly): its kernels are long enough that launch gaps
  // between them are small. A mark before the first chunk starts the clock.
  s0.begin_profile(profile != nullptr);
  for (int64_t c0 = 0; c0 < n; c0 += o.max_step_tokens) {
    const int64_t c1 = std::min(n, c0 + o.max_step_tokens), rows = c1 - c0;
    for (int64_t i = 0; i < rows; ++i) {
      const int64_t pos = start + c0 + i;
      s0.set_token(i, ids[static_cast<size_t>(c0 + i)], pos, s.table->slot(seq, pos));
    }
    s0.set_segment(0, 0, start + c1, q.blocks, params, draw);
    s0.end_segments(1, rows);
    float* rows_out = logits && all_logits ? logits->data<float>() + c0 * c.vocab_size : nullptr;
    s.each_rank([&](Rank& x) {
      x.upload_meta_from(s0);
      x.eager_step(rows, start + c1, rows_out, c1 == n);
    });
  }
  s0.end_profile(profile);
  int32_t next = 0;
  MOE_CUDA_CHECK(cudaMemcpy(&next, s0.ws.sampled, 4, cudaMemcpyDeviceToHost));
  if (logits && !all_logits)
    MOE_CUDA_CHECK(cudaMemcpy(logits->data<float>(), s0.ws.logits, static_cast<size_t>(c.vocab_size) * 4,
                              cudaMemcpyDeviceToHost));
  s.table->append(seq, ids);
  return next;
}

// One decode step of sequences `seqs`, each taking one token and drawing its next as draw
// number draws[i].
std::vector<int32_t> run_decode(State& s, std::span<const int32_t> seqs, std::span<const int32_t> tokens,
                                std::span<const SamplingParams> params, std::span<const int64_t> draws,
                                OpProfile* profile) {
  Rank& s0 = s.first();
  const ModelConfig& c = s0.config;
  const EngineOptions& o = s0.opts;
  MOE_CUDA_CHECK(cudaSetDevice(o.device));
  const int64_t b = static_cast<int64_t>(seqs.size());
  MOE_CHECK(b >= 1 && b <= o.max_batch, kInvalidArgument,
            "a decode step takes 1 to {} sequences, got {}", o.max_batch, b);
  MOE_CHECK(tokens.size() == seqs.size() && params.size() == seqs.size() && draws.size() == seqs.size(),
            kInvalidArgument, "decode: {} sequences but {} tokens and {} sampling settings", b, tokens.size(),
            params.size());
  int64_t blocks = 0;
  for (int64_t i = 0; i < b; ++i) {
    const int32_t id = seqs[static_cast<size_t>(i)];
    const Sequence& q = s.table->at(id);  // throws for a sequence that is not open
    for (int64_t j = 0; j < i; ++j)
      MOE_CHECK(seqs[static_cast<size_t>(j)] != id, kInvalidArgument, "sequence {} appears twice in one step", id);
    const int32_t t = tokens[static_cast<size_t>(i)];
    MOE_CHECK(t >= 0 && t < c.vocab_size, kInvalidArgument, "token id {} is outside the vocabulary [0, {})", t, c.vocab_size);
    validate_sampling(params[static_cast<size_t>(i)]);
    MOE_CHECK(q.length + 1 <= o.max_context, kInvalidArgument,
              "context full: sequence {} holds {} tokens, the context is {}", id, q.length, o.max_context);
    blocks += s.table->blocks_needed(id, 1);
  }
  MOE_CHECK(blocks <= s.free_blocks(), kInvalidArgument, "KV cache full: {} more blocks needed, {} free",
            blocks, s.free_blocks());
  const int bucket = s0.bucket_for(b);
  for (int64_t i = 0; i < b; ++i) s.table->reserve(seqs[static_cast<size_t>(i)], 1);
  // The bucket's graph first: capturing it (on first use) runs on padding metadata, so the real
  // rows are written after it, once.
  const bool use_graph = o.graphs && !profile && s0.capturable;
  if (use_graph) s.each_rank([&](Rank& x) { x.graph_for(bucket); });
  for (int64_t i = 0; i < b; ++i) {
    const int32_t seq = seqs[static_cast<size_t>(i)];
    const Sequence& q = s.table->at(seq);
    const int r = static_cast<int>(i);
    s0.set_token(r, tokens[static_cast<size_t>(i)], q.length, s.table->slot(seq, q.length));
    s0.set_segment(r, r, q.length + 1, q.blocks, params[static_cast<size_t>(i)], draws[static_cast<size_t>(i)]);
  }
  s0.fill_padding(static_cast<int>(b), bucket);
  const engine::DecodeRun how =
      use_graph ? engine::DecodeRun::kGraph : profile ? engine::DecodeRun::kProfiled : engine::DecodeRun::kEager;
  std::vector<int32_t> out(static_cast<size_t>(b));
  s.each_rank([&](Rank& x) {
    x.upload_meta_from(s0);
    x.decode_step(b, bucket, how, out.data());
  });
  for (int64_t i = 0; i < b; ++i) s.table->append(seqs[static_cast<size_t>(i)], tokens.subspan(static_cast<size_t>(i), 1));
  if (profile) {
    s0.collect(profile);
    const int64_t k = std::max<int64_t>(c.moe.top_k, 1);
    const std::vector<int32_t> routed = s0.routing();
    for (int64_t l = 0; l < c.num_layers; ++l) {
      std::vector<bool> used(static_cast<size_t>(std::max<int64_t>(c.moe.num_experts, 1)), false);
      int touched = 0;
      if (c.moe_layers[static_cast<size_t>(l)])
        for (int64_t i = 0; i < b * k; ++i) {
          const int32_t e = routed[static_cast<size_t>(l * b * k + i)];
          if (e >= 0 && e < c.moe.num_experts && !used[static_cast<size_t>(e)]) {
            used[static_cast<size_t>(e)] = true;
            ++touched;
          }
        }
      profile->experts_touched.push_back(touched);
    }
  }
  return out;
}

}  // namespace

int32_t Engine::prefill(int32_t seq, std::span<const int32_t> ids, const SamplingParams& params, Tensor* logits,
                        bool all_logits, OpProfile* profile) {
  const int32_t next = run_prefill(*s_, seq, ids, params, s_->table->at(seq).draws, logits, all_logits, profile);
  s_->table->count_draw(seq);
  return next;
}

std::vector<int32_t> Engine::decode(std::span<const int32_t> seqs, std::span<const int32_t> tokens,
                                    std::span<const SamplingParams> params, OpProfile* profile) {
  std::vector<int64_t> draws;
  for (int32_t seq : seqs) draws.push_back(s_->table->at(seq).draws);
  std::vector<int32_t> out = run_decode(*s_, seqs, tokens, params, draws, profile);
  for (int32_t seq : seqs) s_->table->count_draw(seq);
  return out;
}

runtime::StepResult Engine::run(const runtime::StepPlan& plan) {
  State& s = *s_;
  runtime::check_plan(plan, *this);
  int64_t need = 0;
  for (const runtime::StepRow& r : plan.rows) need += s.table->blocks_needed(r.seq, r.count);
  MOE_CHECK(need <= s.free_blocks(), kInvalidArgument, "KV cache full: {} more blocks needed, {} free", need,
            s.free_blocks());
  runtime::StepResult out;
  out.tokens.assign(plan.rows.size(), -1);
  out.logits.resize(plan.rows.size());
  std::vector<bool> decoded(plan.rows.size(), false);
  std::vector<size_t> decode_rows;
  std::vector<int32_t> seqs, tokens;
  std::vector<SamplingParams> params;
  std::vector<int64_t> draws;
  for (size_t i = 0; i < plan.rows.size(); ++i) {
    const runtime::StepRow& r = plan.rows[i];
    if (r.count != 1 || r.logits != runtime::RowLogits::kNone || s.table->at(r.seq).length == 0) continue;
    decoded[i] = true;
    decode_rows.push_back(i);
    seqs.push_back(r.seq);
    tokens.push_back(plan.tokens[static_cast<size_t>(r.offset)]);
    params.push_back(r.sampling);
    draws.push_back(r.draw);
  }
  if (!decode_rows.empty()) {
    const std::vector<int32_t> drawn = run_decode(s, seqs, tokens, params, draws, nullptr);
    for (size_t j = 0; j < decode_rows.size(); ++j) out.tokens[decode_rows[j]] = drawn[j];
  }
  for (size_t i = 0; i < plan.rows.size(); ++i) {
    if (decoded[i]) continue;
    const runtime::StepRow& r = plan.rows[i];
    Tensor* logits = r.logits != runtime::RowLogits::kNone ? &out.logits[i] : nullptr;
    out.tokens[i] = run_prefill(
        s, r.seq,
        std::span<const int32_t>(plan.tokens).subspan(static_cast<size_t>(r.offset), static_cast<size_t>(r.count)),
        r.sampling, r.draw, logits, r.logits == runtime::RowLogits::kAll, nullptr);
  }
  for (size_t i = 0; i < plan.rows.size(); ++i)
    if (!plan.rows[i].sample) out.tokens[i] = -1;
  return out;
}

std::vector<int32_t> Engine::last_routing() const { return s_->first().routing(); }

MemoryReport Engine::memory() const {
  const State& s = *s_;
  MemoryReport r;
  for (const auto& x : s.ranks) x->count_memory(&r);
  if (s.allreduce) r.workspace += s.allreduce->bytes_per_rank() * s.ranks.size();
  if (s.p2p) r.workspace += s.p2p->bytes_per_rank() * s.ranks.size();
  r.kv_blocks = s.first().kv_blocks;
  r.kv_blocks_free = s.free_blocks();
  r.kv_blocks_cached = s.blocks->cached_blocks();
  return r;
}

}  // namespace moe::cuda
