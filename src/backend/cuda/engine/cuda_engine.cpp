// The engine as an executor: loading every rank, the sequence table over one block allocator
// per attention group, and the steps. A plan's rows become step metadata (token ids, positions,
// cache slots, block tables, sampling) written into the pinned mirror of each group's first rank
// and run by every rank in lockstep; the forward itself is engine::Rank's (engine_rank.h),
// which knows nothing of sequences.
#include "backend/cuda_engine.h"

#include <algorithm>
#include <functional>

#include <fmt/format.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/engine/device_model.h"
#include "backend/cuda/engine/engine_rank.h"
#include "backend/cuda/comm/peer_allreduce.h"
#include "backend/cuda/comm/peer_column_gather.h"
#include "backend/cuda_ep.h"
#include "dist/nccl_communicator.h"
#include "core/rank_threads.h"
#include "moe/errors.h"
#include "runtime/block_allocator.h"
#include "runtime/sequence_table.h"

namespace moe::cuda {

using engine::Rank;

struct Engine::State {
  // Rank r on device opts.device + r; the host writes the step metadata mirror of each attention
  // group's first rank (rank 0 without dp), and the group's other ranks copy it.
  std::vector<std::unique_ptr<Rank>> ranks;
  // Sum the ranks' partial outputs (tp, local_allreduce): one over all the GPUs, or under dp
  // with tp > 1 one per attention group.
  std::vector<std::unique_ptr<PeerAllReduce>> allreduces;
  // The lm_head's logits, each GPU of an attention group of several computing its share of the
  // vocabulary, gathered on the group's first: one per group.
  std::vector<std::unique_ptr<PeerColumnGather>> head_gathers;
  // The expert-parallel exchange of the other backends: NCCL endpoints (rank r's at r) or the
  // p2p exchange.
  std::unique_ptr<NcclGroup> nccl;
  std::vector<std::unique_ptr<dist::Communicator>> comms;
  std::unique_ptr<P2pExchange> p2p;
  std::unique_ptr<RankThreads> threads;      // several GPUs: one host thread per rank
  // An attention group's cache: blocks 1 .. kv_blocks - 1 of its ranks' pools as allocator
  // blocks 0 .. kv_blocks - 2 (pool block 0 is the scratch block of padding rows), and the
  // sequences over them (the table gives its blocks back as it dies, before the allocator).
  struct Group {
    std::unique_ptr<BlockAllocator> blocks;
    std::unique_ptr<SequenceTable> table;
  };
  // One group that every rank's pools hold alike, or under dp one per attention group (tp
  // consecutive ranks), whose sequence ids are g, g + dp, g + 2 dp, ... (the id names its group).
  std::vector<Group> groups;
  bool dp = false;
  int group_size = 1;  // ranks per group
  runtime::ExecutorLimits limits;

  ~State() {
    // The host threads first, then the other ranks (each on its own device), what joins them,
    // and rank 0 last.
    threads.reset();
    for (size_t r = 1; r < ranks.size(); ++r) ranks[r].reset();
    allreduces.clear();
    head_gathers.clear();
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

  int group_of(int32_t seq) const {
    MOE_CHECK(seq >= 0, kInvalidArgument, "sequence {} is not open", seq);
    return static_cast<int>(seq % static_cast<int32_t>(groups.size()));
  }
  SequenceTable& table(int32_t seq) { return *groups[static_cast<size_t>(group_of(seq))].table; }
  const SequenceTable& table(int32_t seq) const { return *groups[static_cast<size_t>(group_of(seq))].table; }
  int64_t free_blocks(int group) const { return groups[static_cast<size_t>(group)].blocks->free_blocks(); }
  // The rank whose metadata mirror holds group g's rows, and the mirror rank x uploads.
  Rank& writer(int group) { return *ranks[static_cast<size_t>(group * group_size)]; }
  const Rank& source_of(const Rank& x) const { return *ranks[static_cast<size_t>(x.group * group_size)]; }
  // Group g's GPUs, for messages: "" with one group, else " on GPU d" or " on GPUs d-e".
  std::string where(int g) const {
    if (!dp) return "";
    const int d = first().opts.device + g * group_size;
    return group_size == 1 ? fmt::format(" on GPU {}", d) : fmt::format(" on GPUs {}-{}", d, d + group_size - 1);
  }
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
  const int ranks = engine_ranks(o.tp, o.ep, o.dp);
  check_engine_dp(o.dp, o.tp, o.ep, o.ep_backend);
  check_parallel_supported(mc, ranks, o.tp);
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
  const int ranks = engine_ranks(o.tp, o.ep, o.dp);
  const int64_t max_tokens = engine::step_rows(o);
  std::unique_ptr<Engine> engine(new Engine());
  State& s = *engine->s_;
  s.dp = o.dp > 1;
  s.group_size = s.dp ? ranks / o.dp : ranks;
  if (ranks > 1) {
    std::vector<int> devices;
    for (int r = 0; r < ranks; ++r) devices.push_back(o.device + r);
    const dist::EpBackendTraits& traits = dist::ep_backend_traits(o.ep_backend);
    if (o.tp > 1 || !traits.reduced_output)
      for (int first = 0; first < ranks; first += s.group_size)
        s.allreduces.push_back(std::make_unique<PeerAllReduce>(
            std::vector<int>(devices.begin() + first, devices.begin() + first + s.group_size),
            max_tokens * mc.hidden_size));
    if (o.ep_backend == dist::EpBackend::kP2p) {
      s.p2p = std::make_unique<P2pExchange>(devices, mc.hidden_size, mc.moe.top_k, engine::exchange_rows(o), 10.0,
                                            o.dp > 1);
    } else if (traits.reduced_output) {
      s.nccl = std::make_unique<NcclGroup>(devices);
      for (int r = 0; r < ranks; ++r) s.comms.push_back(s.nccl->communicator(r));
    }
  }
  for (int r = 0; r < ranks; ++r) {
    engine::EpLink link{s.comms.empty() ? nullptr : s.comms[static_cast<size_t>(r)].get(), s.p2p.get()};
    const PeerAllReduce* sum = s.allreduces.empty() ? nullptr : s.allreduces[static_cast<size_t>(r / s.group_size)].get();
    s.ranks.push_back(std::make_unique<Rank>(mc, o, r, ranks, sum, link));
  }
  // Every GPU of a group holds the group's final rows: each computes the logits of its share of
  // the vocabulary (engine_rank.cpp, Rank::head), where the GPUs reach each other's memory (the
  // NCCL backends also run without; the group's first GPU then computes them all).
  if (s.group_size > 1)
    for (int first = 0; first < ranks; first += s.group_size) {
      std::vector<int> devices;
      for (int r = first; r < first + s.group_size; ++r) devices.push_back(o.device + r);
      if (!peer_access_available(devices)) continue;
      s.head_gathers.push_back(std::make_unique<PeerColumnGather>(devices, s.first().logit_rows, mc.vocab_size));
      for (int r = first; r < first + s.group_size; ++r) s.ranks[static_cast<size_t>(r)]->head_gather = s.head_gathers.back().get();
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
  const int groups = s.dp ? o.dp : 1;
  s.groups.resize(static_cast<size_t>(groups));
  for (int g = 0; g < groups; ++g) {
    State::Group& x = s.groups[static_cast<size_t>(g)];
    x.blocks = std::make_unique<BlockAllocator>(blocks - 1, o.block_size);
    x.table = std::make_unique<SequenceTable>(*x.blocks, o.max_batch, o.max_context, o.prefix_reuse, g, groups);
  }
  s.limits = {int64_t{o.max_batch} * groups, o.max_context, o.block_size, (blocks - 1) * groups, mc.vocab_size,
              groups};
  return engine;
}

const runtime::ExecutorLimits& Engine::limits() const { return s_->limits; }
// Under dp, a new sequence goes to the attention group with the fewest open sequences, then the
// most free blocks: the groups' steps are padded to the fullest one, so even rows waste least.
int32_t Engine::open() {
  State& s = *s_;
  size_t best = 0;
  for (size_t g = 1; g < s.groups.size(); ++g) {
    const int64_t open = s.groups[g].table->open_count(), least = s.groups[best].table->open_count();
    if (open < least || (open == least && s.free_blocks(static_cast<int>(g)) > s.free_blocks(static_cast<int>(best))))
      best = g;
  }
  MOE_CHECK(s.groups[best].table->open_count() < s.groups[best].table->max_sequences(), kInvalidArgument,
            "{} sequences are open: at most {} fit", s.limits.max_sequences, s.limits.max_sequences);
  return s.groups[best].table->open();
}
void Engine::close(int32_t seq) { s_->table(seq).close(seq); }
int64_t Engine::length(int32_t seq) const { return s_->table(seq).at(seq).length; }
int64_t Engine::reuse_prefix(int32_t seq, std::span<const int32_t> tokens) {
  return s_->table(seq).reuse_prefix(seq, tokens);
}
runtime::KvUsage Engine::kv_usage() const {
  runtime::KvUsage u;
  for (int g = 0; g < static_cast<int>(s_->groups.size()); ++g) {
    const runtime::KvUsage x = group_kv_usage(g);
    u.total += x.total, u.free += x.free, u.cached += x.cached;
  }
  return u;
}
int Engine::group_of(int32_t seq) const {
  const State& s = *s_;
  s.table(seq).at(seq);  // throws for a sequence that is not open
  return s.group_of(seq);
}
runtime::KvUsage Engine::group_kv_usage(int group) const {
  const State& s = *s_;
  MOE_CHECK(group >= 0 && group < static_cast<int>(s.groups.size()), kInvalidArgument,
            "attention group {} of {}", group, s.groups.size());
  const BlockAllocator& b = *s.groups[static_cast<size_t>(group)].blocks;
  return {b.num_blocks(), b.free_blocks(), b.cached_blocks()};
}

namespace {

using State = Engine::State;

// One sequence's prefill: `ids` after its cached tokens, its next token drawn as draw number
// `draw`; `next` is set once it ran.
struct Prefill {
  int32_t seq = -1;
  std::span<const int32_t> ids;
  SamplingParams params;
  int64_t draw = 0;
  Tensor* logits = nullptr;
  bool all_logits = false;
  int32_t next = -1;
};

// Checks every prefill and takes the blocks it needs, before anything runs.
void reserve_prefills(State& s, std::vector<Prefill>& jobs) {
  const ModelConfig& c = s.first().config;
  for (Prefill& p : jobs) {
    validate_sampling(p.params);
    MOE_CHECK(!p.ids.empty(), kInvalidArgument, "empty input: at least one token is needed");
    for (int32_t id : p.ids)
      MOE_CHECK(id >= 0 && id < c.vocab_size, kInvalidArgument, "token id {} is outside the vocabulary [0, {})",
                id, c.vocab_size);
    s.table(p.seq).reserve(p.seq, static_cast<int64_t>(p.ids.size()));  // checks the context and blocks first
    const int64_t n = static_cast<int64_t>(p.ids.size());
    if (p.logits) *p.logits = Tensor::zeros({p.all_logits ? n : 1, c.vocab_size});
  }
}

// Runs the prefills in chunks of at most max_step_tokens, each group's one after another. Under
// dp the ranks run in lockstep, each on a chunk of its own current prefill: a step has as many
// rows as the largest chunk, and a rank with fewer (or none) pads its rows.
void run_prefills(State& s, std::vector<Prefill>& jobs, OpProfile* profile) {
  Rank& s0 = s.first();
  const ModelConfig& c = s0.config;
  const EngineOptions& o = s0.opts;
  MOE_CUDA_CHECK(cudaSetDevice(o.device));  // the caller's thread may not be the loader's
  reserve_prefills(s, jobs);
  const size_t groups = s.groups.size();
  std::vector<std::vector<size_t>> queue(groups);
  for (size_t j = 0; j < jobs.size(); ++j) queue[static_cast<size_t>(s.group_of(jobs[j].seq))].push_back(j);
  std::vector<size_t> at(groups, 0);  // each group's current prefill
  std::vector<int64_t> done(jobs.size(), 0), start(jobs.size(), 0);
  for (size_t j = 0; j < jobs.size(); ++j) start[j] = s.table(jobs[j].seq).at(jobs[j].seq).length;
  // What one group runs in the current step.
  struct Chunk {
    size_t job = 0;
    int64_t rows = 0, context = 0;
    int segments = 1;
    float* logits = nullptr;
    bool last = false;
  };
  std::vector<Chunk> chunk(groups);
  // Profiled prefill runs as usual (eagerly): its kernels are long enough that launch gaps
  // between them are small. A mark before the first chunk starts the clock.
  s0.begin_profile(profile != nullptr);
  for (;;) {
    int64_t rows = 0;
    for (size_t g = 0; g < groups; ++g) {
      Chunk& k = chunk[g];
      k = Chunk{};
      if (at[g] == queue[g].size()) continue;
      k.job = queue[g][at[g]];
      const Prefill& p = jobs[k.job];
      const int64_t n = static_cast<int64_t>(p.ids.size()), c0 = done[k.job];
      k.rows = std::min(n - c0, o.max_step_tokens);
      k.context = start[k.job] + c0 + k.rows;
      k.last = c0 + k.rows == n;
      k.logits = p.logits && p.all_logits ? p.logits->data<float>() + c0 * c.vocab_size : nullptr;
      rows = std::max(rows, k.rows);
    }
    if (rows == 0) break;
    rows = engine::round_to_unit(rows, o);  // each GPU of a dp group exchanges an equal share
    for (size_t g = 0; g < groups; ++g) {
      Chunk& k = chunk[g];
      Rank& w = s.writer(static_cast<int>(g));
      if (k.rows == 0) {  // an idle group under dp: padding only
        w.pad_segment(0, 0, rows);
        k.context = rows;
        continue;
      }
      const Prefill& p = jobs[k.job];
      const int64_t c0 = done[k.job];
      for (int64_t i = 0; i < k.rows; ++i) {
        const int64_t pos = start[k.job] + c0 + i;
        w.set_token(i, p.ids[static_cast<size_t>(c0 + i)], pos, s.table(p.seq).slot(p.seq, pos));
      }
      w.set_segment(0, 0, k.context, s.table(p.seq).at(p.seq).blocks, p.params, p.draw);
      if (k.rows < rows) {
        w.pad_segment(1, k.rows, rows);
        k.segments = 2;
        k.context = std::max(k.context, rows - k.rows);
      } else {
        w.end_segments(1, rows);
      }
    }
    s.each_rank([&](Rank& x) {
      x.upload_meta_from(s.source_of(x));
      const Chunk& k = chunk[static_cast<size_t>(x.group)];
      x.eager_step(rows, k.segments, k.rows, k.context, k.logits, k.last);
    });
    for (size_t g = 0; g < groups; ++g) {
      const Chunk& k = chunk[g];
      if (k.rows == 0) continue;
      done[k.job] += k.rows;
      if (!k.last) continue;
      Prefill& p = jobs[k.job];
      const Rank& w = s.writer(static_cast<int>(g));
      MOE_CUDA_CHECK(cudaSetDevice(w.opts.device));
      MOE_CUDA_CHECK(cudaMemcpy(&p.next, w.ws.sampled, 4, cudaMemcpyDeviceToHost));
      if (p.logits && !p.all_logits)
        MOE_CUDA_CHECK(cudaMemcpy(p.logits->data<float>(), w.ws.logits, static_cast<size_t>(c.vocab_size) * 4,
                                  cudaMemcpyDeviceToHost));
      s.table(p.seq).append(p.seq, p.ids);
      ++at[g];
    }
    MOE_CUDA_CHECK(cudaSetDevice(o.device));
  }
  s0.end_profile(profile);
}

// One decode step of sequences `seqs`, each taking one token and drawing its next as draw
// number draws[i]. Under dp each attention group runs its own sequences' rows, all padded to one
// bucket.
std::vector<int32_t> run_decode(State& s, std::span<const int32_t> seqs, std::span<const int32_t> tokens,
                                std::span<const SamplingParams> params, std::span<const int64_t> draws,
                                OpProfile* profile) {
  Rank& s0 = s.first();
  const ModelConfig& c = s0.config;
  const EngineOptions& o = s0.opts;
  MOE_CUDA_CHECK(cudaSetDevice(o.device));
  const int64_t b = static_cast<int64_t>(seqs.size());
  const size_t groups = s.groups.size();
  MOE_CHECK(b >= 1 && b <= s.limits.max_sequences, kInvalidArgument,
            "a decode step takes 1 to {} sequences, got {}", s.limits.max_sequences, b);
  MOE_CHECK(tokens.size() == seqs.size() && params.size() == seqs.size() && draws.size() == seqs.size(),
            kInvalidArgument, "decode: {} sequences but {} tokens and {} sampling settings", b, tokens.size(),
            params.size());
  std::vector<int64_t> blocks(groups, 0), rows(groups, 0);
  for (int64_t i = 0; i < b; ++i) {
    const int32_t id = seqs[static_cast<size_t>(i)];
    const Sequence& q = s.table(id).at(id);  // throws for a sequence that is not open
    for (int64_t j = 0; j < i; ++j)
      MOE_CHECK(seqs[static_cast<size_t>(j)] != id, kInvalidArgument, "sequence {} appears twice in one step", id);
    const int32_t t = tokens[static_cast<size_t>(i)];
    MOE_CHECK(t >= 0 && t < c.vocab_size, kInvalidArgument, "token id {} is outside the vocabulary [0, {})", t, c.vocab_size);
    validate_sampling(params[static_cast<size_t>(i)]);
    MOE_CHECK(q.length + 1 <= o.max_context, kInvalidArgument,
              "context full: sequence {} holds {} tokens, the context is {}", id, q.length, o.max_context);
    const size_t g = static_cast<size_t>(s.group_of(id));
    blocks[g] += s.table(id).blocks_needed(id, 1);
    rows[g] += 1;
  }
  for (size_t g = 0; g < groups; ++g)
    MOE_CHECK(blocks[g] <= s.free_blocks(static_cast<int>(g)), kInvalidArgument,
              "KV cache full: {} more blocks needed, {} free{}", blocks[g], s.free_blocks(static_cast<int>(g)),
              s.where(static_cast<int>(g)));
  const int bucket = s0.bucket_for(*std::max_element(rows.begin(), rows.end()));
  for (int64_t i = 0; i < b; ++i) s.table(seqs[static_cast<size_t>(i)]).reserve(seqs[static_cast<size_t>(i)], 1);
  // The bucket's graph first: capturing it (on first use) runs on padding metadata, so the real
  // rows are written after it, once.
  const bool use_graph = o.graphs && !profile && s0.capturable;
  if (use_graph) s.each_rank([&](Rank& x) { x.graph_for(bucket); });
  std::vector<int> row_of(static_cast<size_t>(b));  // each sequence's row on its rank
  std::vector<int> next_row(groups, 0);
  for (int64_t i = 0; i < b; ++i) {
    const int32_t seq = seqs[static_cast<size_t>(i)];
    const Sequence& q = s.table(seq).at(seq);
    const int g = s.group_of(seq);
    const int r = next_row[static_cast<size_t>(g)]++;
    row_of[static_cast<size_t>(i)] = r;
    Rank& w = s.writer(g);
    w.set_token(r, tokens[static_cast<size_t>(i)], q.length, s.table(seq).slot(seq, q.length));
    w.set_segment(r, r, q.length + 1, q.blocks, params[static_cast<size_t>(i)], draws[static_cast<size_t>(i)]);
  }
  for (size_t g = 0; g < groups; ++g) s.writer(static_cast<int>(g)).fill_padding(next_row[g], bucket);
  const engine::DecodeRun how =
      use_graph ? engine::DecodeRun::kGraph : profile ? engine::DecodeRun::kProfiled : engine::DecodeRun::kEager;
  std::vector<std::vector<int32_t>> drawn(groups, std::vector<int32_t>(static_cast<size_t>(bucket)));
  s.each_rank([&](Rank& x) {
    const size_t g = static_cast<size_t>(x.group);
    x.upload_meta_from(s.source_of(x));
    x.decode_step(rows[g], bucket, how, drawn[g].data());
  });
  std::vector<int32_t> out(static_cast<size_t>(b));
  for (int64_t i = 0; i < b; ++i) {
    const int32_t seq = seqs[static_cast<size_t>(i)];
    out[static_cast<size_t>(i)] = drawn[static_cast<size_t>(s.group_of(seq))][static_cast<size_t>(row_of[static_cast<size_t>(i)])];
    s.table(seq).append(seq, tokens.subspan(static_cast<size_t>(i), 1));
  }
  if (profile) {  // rank 0's rows
    s0.collect(profile);
    const int64_t k = std::max<int64_t>(c.moe.top_k, 1), b0 = rows[0];
    const std::vector<int32_t> routed = s0.routing();
    for (int64_t l = 0; l < c.num_layers; ++l) {
      std::vector<bool> used(static_cast<size_t>(std::max<int64_t>(c.moe.num_experts, 1)), false);
      int touched = 0;
      if (c.moe_layers[static_cast<size_t>(l)])
        for (int64_t i = 0; i < b0 * k; ++i) {
          const int32_t e = routed[static_cast<size_t>(l * b0 * k + i)];
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
  std::vector<Prefill> job{{seq, ids, params, s_->table(seq).at(seq).draws, logits, all_logits}};
  run_prefills(*s_, job, profile);
  s_->table(seq).count_draw(seq);
  return job[0].next;
}

std::vector<int32_t> Engine::decode(std::span<const int32_t> seqs, std::span<const int32_t> tokens,
                                    std::span<const SamplingParams> params, OpProfile* profile) {
  std::vector<int64_t> draws;
  for (int32_t seq : seqs) draws.push_back(s_->table(seq).at(seq).draws);
  std::vector<int32_t> out = run_decode(*s_, seqs, tokens, params, draws, profile);
  for (int32_t seq : seqs) s_->table(seq).count_draw(seq);
  return out;
}

runtime::StepResult Engine::run(const runtime::StepPlan& plan) {
  State& s = *s_;
  runtime::check_plan(plan, *this);
  std::vector<int64_t> need(s.groups.size(), 0);
  for (const runtime::StepRow& r : plan.rows)
    need[static_cast<size_t>(s.group_of(r.seq))] += s.table(r.seq).blocks_needed(r.seq, r.count);
  for (size_t g = 0; g < need.size(); ++g)
    MOE_CHECK(need[g] <= s.free_blocks(static_cast<int>(g)), kInvalidArgument,
              "KV cache full: {} more blocks needed, {} free{}", need[g], s.free_blocks(static_cast<int>(g)),
              s.where(static_cast<int>(g)));
  runtime::StepResult out;
  out.tokens.assign(plan.rows.size(), -1);
  out.logits.resize(plan.rows.size());
  std::vector<size_t> decode_rows, prefill_rows;
  std::vector<int32_t> seqs, tokens;
  std::vector<SamplingParams> params;
  std::vector<int64_t> draws;
  for (size_t i = 0; i < plan.rows.size(); ++i) {
    const runtime::StepRow& r = plan.rows[i];
    if (r.count != 1 || r.logits != runtime::RowLogits::kNone || s.table(r.seq).at(r.seq).length == 0) {
      prefill_rows.push_back(i);
      continue;
    }
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
  std::vector<Prefill> jobs;
  for (size_t i : prefill_rows) {
    const runtime::StepRow& r = plan.rows[i];
    Tensor* logits = r.logits != runtime::RowLogits::kNone ? &out.logits[i] : nullptr;
    jobs.push_back({r.seq,
                    std::span<const int32_t>(plan.tokens).subspan(static_cast<size_t>(r.offset),
                                                                  static_cast<size_t>(r.count)),
                    r.sampling, r.draw, logits, r.logits == runtime::RowLogits::kAll});
  }
  if (!jobs.empty()) run_prefills(s, jobs, nullptr);
  for (size_t j = 0; j < jobs.size(); ++j) out.tokens[prefill_rows[j]] = jobs[j].next;
  for (size_t i = 0; i < plan.rows.size(); ++i)
    if (!plan.rows[i].sample) out.tokens[i] = -1;
  return out;
}

std::vector<int32_t> Engine::last_routing() const { return s_->first().routing(); }

std::vector<MemoryReport> Engine::memory_per_gpu() const {
  const State& s = *s_;
  std::vector<MemoryReport> out;
  for (const auto& x : s.ranks) {
    MemoryReport r;
    x->count_memory(&r);
    if (x->allreduce) r.workspace += x->allreduce->bytes_per_rank();
    if (x->head_gather) r.workspace += x->head_gather->bytes_per_rank();
    if (s.p2p) r.workspace += s.p2p->bytes_per_rank();
    const BlockAllocator& b = *s.groups[static_cast<size_t>(x->group)].blocks;
    r.kv_blocks = x->kv_blocks;
    r.kv_blocks_free = b.free_blocks();
    r.kv_blocks_cached = b.cached_blocks();
    out.push_back(r);
  }
  return out;
}

MemoryReport Engine::memory() const {
  const State& s = *s_;
  MemoryReport r;
  for (const MemoryReport& g : memory_per_gpu()) {
    r.weights += g.weights;
    r.kv_cache += g.kv_cache;
    r.workspace += g.workspace;
    r.graph_outputs += g.graph_outputs;
  }
  // One cache per group: every rank's pools together, or each attention group's under dp.
  const int64_t groups = static_cast<int64_t>(s.groups.size());
  const runtime::KvUsage u = kv_usage();
  r.kv_blocks = s.first().kv_blocks * groups;
  r.kv_blocks_free = u.free;
  r.kv_blocks_cached = u.cached;
  return r;
}

}  // namespace moe::cuda
