// One rank's forward (engine_rank.h): loading, step metadata rows, the eager and graph steps,
// the layer loop and its operations, profiling marks.
#include "backend/cuda/engine/engine_rank.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "backend/cuda/attention/attention_launch.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/engine/decode_buckets.h"
#include "backend/cuda/attention/latent_attention_launch.h"
#include "backend/cuda/ops/ops_launch.h"
#include "backend/cuda/engine/projection.h"
#include "backend/cuda/moe/router_params.h"
#include "moe/errors.h"

namespace moe::cuda::engine {
namespace {

// The fields both attention kernels' parameters share: where each sequence's rows and cache
// blocks are in this step, and the host bounds that size the grid.
template <typename AttentionParams>
void describe_sequences(AttentionParams& a, const StepMeta& meta, int block_size, int64_t tokens, int64_t seqs,
                        int64_t max_blocks, int64_t max_context) {
  a.block_tables = meta.block_tables;
  a.seq_starts = meta.seq_starts;
  a.context_lens = meta.context_lens;
  a.num_seqs = static_cast<int>(seqs);
  a.tokens = static_cast<int>(tokens);
  a.block_size = block_size;
  a.max_blocks_per_seq = static_cast<int>(max_blocks);
  a.max_context = static_cast<int>(max_context);
}

}  // namespace

Rank::Rank(const ModelConfig& mc, const EngineOptions& o, int r, int n, const PeerAllReduce* sum, EpLink link)
    : config(mc), opts(o), rank(r), ranks(n), tp(o.tp > 1), dp(o.dp > 1), allreduce(sum), ep_link(link) {
  const dist::EpBackendTraits& traits = dist::ep_backend_traits(o.ep_backend);
  exchanges = n > 1 && traits.reduced_output;
  capturable = !exchanges || traits.graph_capturable;
  group_size = dp ? n / o.dp : n;
  group = r / group_size;
  group_rank = r % group_size;
  split_rows = dp && group_size > 1;
  opts.device = o.device + r;
  opts.progress = o.progress && r == 0;
  max_tokens = step_rows(o);
  max_rows = round_to_unit(o.max_batch, o);
  max_blocks = (o.max_context + o.block_size - 1) / o.block_size;
  logit_rows = std::max<int64_t>(max_rows, 64);
}

// With this rank's device current, which the destroying thread's need not be.
Rank::~Rank() {
  cudaSetDevice(opts.device);
  for (cudaEvent_t e : marks) cudaEventDestroy(e);
  if (routed_log) cudaFree(routed_log);
  for (DecodeGraph& g : graphs)
    if (g.exec) cudaGraphExecDestroy(g.exec);
  if (meta_host) cudaFreeHost(meta_host);
  if (stream) cudaStreamDestroy(stream);
}

void Rank::setup(const std::string& dir) {
  const ModelConfig& mc = config;
  MOE_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  DeviceLoad dl{opts.device, opts.random_weights, opts.seed, opts.strict, opts.progress, max_tokens};
  dl.rank = rank;
  dl.ranks = ranks;
  dl.tp = opts.tp;
  model = load_device_model(dir, mc, dl);
  blas = std::make_unique<Blas>();
  // Room for steps past the GEMV on FP8 dense matrices (projection.cpp): the activations
  // quantised for the W8A8 GEMM, and the largest matrix widened for shapes that GEMM does not take.
  size_t widest = 0;
  int64_t widest_cols = 0;
  bool needs_room = false;
  auto widens = [&](const DeviceMatrix& m) {
    if (!m || !m.format.scaled()) return;
    widest = std::max(widest, static_cast<size_t>(m.rows * m.cols));
    widest_cols = std::max(widest_cols, m.cols);
    needs_room = needs_room || fp8_projection_needs_room(max_tokens, m.cols);
  };
  widens(model->lm_head);
  for (const DeviceLayer& L : model->layers)
    for (const DeviceMatrix* m : {&L.q, &L.k, &L.v, &L.o, &L.q_a, &L.q_b, &L.kv_a, &L.mlp_gate_up, &L.mlp_down,
                                  &L.shared_gate_up, &L.shared_down, &L.shared_gate})
      widens(*m);
  if (needs_room) {
    blas->reserve_widened(widest);
    blas->reserve_fp8_rows(max_tokens, widest_cols);
  }

  if (exchanges) setup_exchange();
  Shapes shapes{max_tokens, logit_rows, 0, 0};
  for (const DeviceLayer& L : model->layers)
    if (L.experts && !exchanges)
      shapes.experts_ws = std::max<int64_t>(
          shapes.experts_ws, static_cast<int64_t>(Experts::workspace_bytes(L.experts->shape(), max_tokens, L.experts->format())));
  shapes.attention_ws = static_cast<int64_t>(
      mc.attention == AttentionKind::kMla
          ? kernels::latent_attention_workspace_bytes(static_cast<int>(max_tokens), static_cast<int>(mc.num_heads),
                                                      static_cast<int>(mc.mla.kv_lora_rank), static_cast<int>(opts.max_context))
          : kernels::paged_attention_workspace_bytes(static_cast<int>(max_tokens), static_cast<int>(mc.num_heads),
                                                     static_cast<int>(mc.head_dim), static_cast<int>(opts.max_context)));
  ArenaSizer sizer;
  carve_workspace(sizer, mc, shapes);
  workspace_arena = DeviceArena("workspace", sizer.bytes());
  ws = carve_workspace(workspace_arena, mc, shapes);
  MOE_CUDA_CHECK(cudaMemset(ws.counter, 0, sizeof(unsigned)));

  ArenaSizer meta_sizer;
  carve_meta(meta_sizer, max_tokens, max_rows, max_blocks);
  meta_arena = DeviceArena("step metadata", meta_sizer.bytes());
  meta = carve_meta(meta_arena, max_tokens, max_rows, max_blocks);
  MOE_CUDA_CHECK(cudaMallocHost(&meta_host, meta_arena.capacity()));

  // The decode graphs' buckets (decode_buckets.h): three rows get their own on one GPU.
  buckets = decode_buckets(static_cast<int>(opts.max_batch), static_cast<int>(row_unit(opts)),
                           own_bucket_for_three_rows(ranks));
  // One output for every graph: the graphs run one at a time, and the host reads a step's
  // tokens before the next step starts.
  const size_t rows = static_cast<size_t>(max_rows);
  graph_arena = DeviceArena("decode graph outputs", rows * (static_cast<size_t>(mc.vocab_size) * 4 + 4) + 1024);
  graph_logits = graph_arena.take_n<float>(rows * static_cast<size_t>(mc.vocab_size));
  graph_sampled = graph_arena.take_n<int32_t>(rows);
}

// Every sparse layer's experts behind the exchange, over the weights the model loaded.
void Rank::setup_exchange() {
  const ModelConfig& mc = config;
  EpLayerConfig c;
  c.backend = opts.ep_backend;
  c.rank = rank;
  c.ranks = ranks;
  c.device = opts.device;
  c.experts = mc.moe.num_experts;
  c.hidden = mc.hidden_size;
  c.inter = mc.moe.intermediate_size;
  c.top_k = mc.moe.top_k;
  c.max_tokens = exchange_rows(opts);
  c.own_tokens = dp;
  for (const DeviceLayer& L : model->layers)
    if (L.sparse) c.expert_format = L.expert_gate_up.format;
  const size_t bytes = EpExperts::workspace_bytes(c);
  ep_arena = DeviceArena("expert-parallel exchange", bytes + 256);
  c.workspace = ep_arena.take<unsigned char>(bytes);
  ep_layers.resize(model->layers.size());
  for (size_t l = 0; l < model->layers.size(); ++l) {
    const DeviceLayer& L = model->layers[l];
    if (!L.sparse) continue;
    ep_layers[l] = std::make_unique<EpExperts>(c, L.expert_gate_up, L.expert_down, ep_link.comm, ep_link.p2p);
  }
}

// KV bytes per block over all layers on this rank: a key pool and a value pool per layer
// (GQA: this rank's key/value heads) or one latent pool (MLA).
size_t Rank::kv_block_bytes(size_t* k_block, size_t* v_block) const {
  const ModelConfig& mc = config;
  const bool mla = mc.attention == AttentionKind::kMla;
  const int64_t kw = mla ? mc.kv_key_width() : model->kv_heads * mc.head_dim;
  const int64_t vw = mla ? mc.kv_value_width() : model->kv_heads * mc.head_dim;
  *k_block = static_cast<size_t>(opts.block_size * kw) * 2;
  *v_block = static_cast<size_t>(opts.block_size * vw) * 2;
  return (*k_block + *v_block) * static_cast<size_t>(mc.num_layers);
}

int64_t Rank::kv_blocks_that_fit() const {
  size_t k_block = 0, v_block = 0, free = 0, total = 0;
  const size_t per_block = kv_block_bytes(&k_block, &v_block);
  MOE_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return static_cast<int64_t>(0.9 * static_cast<double>(free) / static_cast<double>(per_block));
}

void Rank::allocate_kv(int64_t blocks) {
  size_t k_block = 0, v_block = 0;
  const size_t per_block = kv_block_bytes(&k_block, &v_block);
  kv_blocks = blocks;
  kv_arena = DeviceArena("KV cache", static_cast<size_t>(blocks) * per_block + 512 * static_cast<size_t>(config.num_layers));
  for (int64_t l = 0; l < config.num_layers; ++l) {
    k_cache.push_back(kv_arena.take_n<uint16_t>(static_cast<size_t>(blocks) * k_block / 2));
    v_cache.push_back(v_block ? kv_arena.take_n<uint16_t>(static_cast<size_t>(blocks) * v_block / 2) : nullptr);
  }
  MOE_CUDA_CHECK(cudaMemset(kv_arena.base(), 0, kv_arena.capacity()));
}

void Rank::allocate_routing_log() {  // a diagnostic buffer, allocated outside any forward
  if (routed_log) return;
  const int64_t k = std::max<int64_t>(config.moe.top_k, 1);
  MOE_CUDA_CHECK(cudaMalloc(&routed_log, static_cast<size_t>(config.num_layers * max_tokens * k) * 4));
  MOE_CUDA_CHECK(cudaMemset(routed_log, 0xff, static_cast<size_t>(config.num_layers * max_tokens * k) * 4));
}

// --- step metadata ---------------------------------------------------------------------------

void Rank::set_token(int64_t row, int32_t id, int64_t position, int64_t slot) {
  host(meta.ids)[row] = id;
  host(meta.positions)[row] = static_cast<int32_t>(position);
  host(meta.slots)[row] = static_cast<int32_t>(slot + opts.block_size);  // past the scratch block
}

void Rank::set_segment(int index, int64_t first_row, int64_t context, std::span<const int32_t> blocks,
                       const SamplingParams& params, int64_t draw) {
  host(meta.seq_starts)[index] = static_cast<int32_t>(first_row);
  host(meta.context_lens)[index] = static_cast<int32_t>(context);
  write_table(index, blocks);
  write_sampling(index, params, draw);
}

void Rank::end_segments(int segments, int64_t rows) {
  host(meta.seq_starts)[segments] = static_cast<int32_t>(rows);
  host(meta.live_rows)[0] = static_cast<int32_t>(rows);
}

// The pools' block 0 is the scratch block of padding rows, so allocator block b is pool block
// b + 1, and entries past the segment's blocks point at the scratch block.
void Rank::write_table(int row, std::span<const int32_t> blocks) {
  int32_t* t = host(meta.block_tables) + static_cast<int64_t>(row) * max_blocks;
  std::fill_n(t, max_blocks, 0);
  for (size_t i = 0; i < blocks.size(); ++i) t[i] = blocks[i] + 1;
}

void Rank::write_sampling(int row, const SamplingParams& params, int64_t draw) {
  const SamplingParams p = effective_sampling(params, config.vocab_size);  // as the CPU sampler
  host(meta.temperature)[row] = p.temperature;
  host(meta.top_k)[row] = p.top_k;
  host(meta.top_p)[row] = p.top_p;
  host(meta.seed)[row] = p.seed;
  host(meta.step)[row] = static_cast<int32_t>(draw);
}

// Rows [from, to) of a decode step: one token each that writes no KV (slot -1) and attends to
// the zeroed scratch block 0, so padding computes on finite values and touches no sequence. The
// router sends them to no expert, so a step padded to its graph's bucket reads the experts of
// its real rows only.
void Rank::fill_padding(int from, int to) {
  host(meta.live_rows)[0] = from;
  for (int r = from; r < to; ++r) {
    host(meta.ids)[r] = 0;
    host(meta.positions)[r] = 0;
    host(meta.slots)[r] = -1;
    host(meta.seq_starts)[r] = r;
    host(meta.context_lens)[r] = 1;
    write_table(r, {});
    write_sampling(r, SamplingParams{}, 0);
  }
  host(meta.seq_starts)[to] = to;
}

// Positions 0 .. n - 1 write no KV (slot -1) and attend causally to the zeroed scratch block,
// which every entry of the segment's table names: finite values that touch no sequence.
void Rank::pad_segment(int index, int64_t from, int64_t to) {
  host(meta.live_rows)[0] = static_cast<int32_t>(from);
  for (int64_t r = from; r < to; ++r) {
    host(meta.ids)[r] = 0;
    host(meta.positions)[r] = static_cast<int32_t>(r - from);
    host(meta.slots)[r] = -1;
  }
  host(meta.seq_starts)[index] = static_cast<int32_t>(from);
  host(meta.context_lens)[index] = static_cast<int32_t>(to - from);
  write_table(index, {});
  write_sampling(index, SamplingParams{}, 0);
  host(meta.seq_starts)[index + 1] = static_cast<int32_t>(to);
}

void Rank::upload_meta() {
  MOE_CUDA_CHECK(cudaMemcpyAsync(meta_arena.base(), meta_host, meta_arena.used(),
                                 cudaMemcpyHostToDevice, stream));
}

void Rank::upload_meta_from(const Rank& written) {
  if (&written != this) std::memcpy(meta_host, written.meta_host, written.meta_arena.used());
  upload_meta();
}

// --- steps -----------------------------------------------------------------------------------

void Rank::eager_step(int64_t rows, int segments, int64_t real, int64_t context, float* logits_out, bool sample) {
  last_tokens = real;  // the routing log's rows: padding rows take no expert
  run_layers(rows, segments, context);
  if (runs_head() && real > 0) {
    if (logits_out)
      for (int64_t r0 = 0; r0 < real; r0 += logit_rows) {
        const int64_t r = std::min(logit_rows, real - r0);
        head(r0, r, ws.logits, nullptr);
        if (reads_out())
          MOE_CUDA_CHECK(cudaMemcpyAsync(logits_out + r0 * config.vocab_size, ws.logits,
                                         static_cast<size_t>(r * config.vocab_size) * 4, cudaMemcpyDeviceToHost,
                                         stream));
      }
    if (sample) head(real - 1, 1, ws.logits, ws.sampled);
  }
  // The next step's metadata overwrites the pinned buffer: wait for this step's copy.
  finish_step();
}

void Rank::decode_step(int64_t rows, int bucket, DecodeRun how, int32_t* tokens) {
  last_tokens = rows;
  float* logits = ws.logits;
  int32_t* sampled = ws.sampled;
  if (how == DecodeRun::kGraph) {
    const DecodeGraph& g = graph_for(bucket);
    MOE_CUDA_CHECK(cudaGraphLaunch(g.exec, stream));
    logits = g.logits;
    sampled = g.sampled;
  } else if (how == DecodeRun::kProfiled) {
    profiled_step(bucket, logits, sampled);
  } else {
    run_layers(bucket, bucket, opts.max_context);
    if (runs_head()) head(0, bucket, logits, sampled);
  }
  if (reads_out() && rows > 0)
    MOE_CUDA_CHECK(cudaMemcpyAsync(tokens, sampled, static_cast<size_t>(rows) * 4, cudaMemcpyDeviceToHost, stream));
  finish_step();
}

int Rank::bucket_for(int64_t rows) const {
  for (int candidate : buckets)
    if (candidate >= rows) return candidate;
  return buckets.back();
}

DecodeGraph& Rank::graph_for(int bucket) {
  for (DecodeGraph& g : graphs)
    if (g.bucket == bucket) return g;
  DecodeGraph g;
  g.bucket = bucket;
  g.logits = graph_logits;
  g.sampled = graph_sampled;
  // Warm up on padding rows only (library plans, module loading happen outside the capture),
  // then capture the same step.
  fill_padding(0, bucket);
  host(meta.live_rows)[0] = bucket;  // routed, so that every kernel of the step runs before the capture
  upload_meta();
  run_layers(bucket, bucket, opts.max_context);
  if (runs_head()) head(0, bucket, g.logits, g.sampled);
  finish_step();
  cudaGraph_t graph = nullptr;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  try {
    run_layers(bucket, bucket, opts.max_context);
    if (runs_head()) head(0, bucket, g.logits, g.sampled);
  } catch (...) {
    cudaStreamEndCapture(stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaError_t err = cudaGraphInstantiate(&g.exec, graph, 0);
  cudaGraphDestroy(graph);
  MOE_CUDA_CHECK(err);
  graphs.push_back(g);
  return graphs.back();
}

// The step as a graph with an event between operations (rank 0's), replayed twice (the first
// warms up), so the times are those of graph replay, without eager launch gaps.
void Rank::profiled_step(int bucket, float* logits, int32_t* sampled) {
  mark_names.clear();
  if (rank == 0) allocate_routing_log();
  if (!capturable) {  // the exchange waits on the host: eager, once to warm up, once marked
    for (int pass = 0; pass < 2; ++pass) {
      profiling = pass == 1 && rank == 0;
      mark_names.clear();
      run_layers(bucket, bucket, opts.max_context);
      if (runs_head()) head(0, bucket, logits, sampled);
      profiling = false;
      MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
    return;
  }
  cudaGraph_t graph = nullptr;
  MOE_CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal));
  profiling = rank == 0;
  try {
    run_layers(bucket, bucket, opts.max_context);
    if (runs_head()) head(0, bucket, logits, sampled);
  } catch (...) {
    profiling = false;
    cudaStreamEndCapture(stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    throw;
  }
  profiling = false;
  MOE_CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
  cudaGraphExec_t exec = nullptr;
  const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  MOE_CUDA_CHECK(err);
  for (int replay = 0; replay < 2; ++replay) MOE_CUDA_CHECK(cudaGraphLaunch(exec, stream));
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  cudaGraphExecDestroy(exec);
}

// After a step on this rank's stream: the step's all-reduce waits all completed.
void Rank::finish_step() {
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  if (allreduce) allreduce->check(group_rank);
  if (head_gather) head_gather->check(group_rank);
  if (ep_link.p2p)  // the exchange's wait status is one per rank, whichever layer timed out
    for (const auto& e : ep_layers)
      if (e) {
        e->check(stream);
        break;
      }
}

// --- the forward ---------------------------------------------------------------------------

// Every layer for `tokens` rows in `seqs` attention segments whose metadata is on the device;
// leaves the final residual stream in ws.x.
void Rank::run_layers(int64_t tokens, int64_t seqs, int64_t max_context) {
  const ModelConfig& c = config;
  const int t = static_cast<int>(tokens), hidden = static_cast<int>(c.hidden_size);
  mark("host: step metadata, waits");
  MOE_CUDA_CHECK(kernels::embed(model->embed.bf16_data("the embedding"), meta.ids, t, hidden, static_cast<int>(c.vocab_size), ws.x, stream));
  mark("embedding");
  bool has_branch = false, has_branch2 = false, normed = false;
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const DeviceLayer& L = model->layers[static_cast<size_t>(l)];
    if (!normed) {
      qkv_in = {};
      MOE_CUDA_CHECK(kernels::add_rms_norm(ws.x, has_branch ? ws.branch : nullptr,
                                           has_branch2 ? ws.branch2 : nullptr, L.input_norm, t,
                                           hidden, c.rms_norm_eps, ws.h, stream));
      mark("residual add + RMSNorm");
    }
    post_normed = false;
    attention(l, tokens, seqs, max_context);
    normed = false;
    if (!L.sparse && !post_normed) {
      MOE_CUDA_CHECK(kernels::add_rms_norm(ws.x, ws.branch, nullptr, L.post_norm, t, hidden,
                                           c.rms_norm_eps, ws.h, stream));
      mark("residual add + RMSNorm");
    }
    has_branch2 = feed_forward(l, tokens, &normed);
    has_branch = !normed;
  }
  MOE_CUDA_CHECK(kernels::add_rms_norm(ws.x, ws.branch, has_branch2 ? ws.branch2 : nullptr,
                                       nullptr, t, hidden, c.rms_norm_eps, nullptr, stream));
  mark("residual add + RMSNorm");
}

// Multi-head latent attention in the absorbed form: keys and values never leave the latent
// space; each head's key projection folds into its query and its value projection applies
// after the attention (per-head batched products).
void Rank::latent_attention(int64_t l, int64_t tokens, int64_t seqs, int64_t max_context) {
  const ModelConfig& c = config;
  const MlaConfig& m = c.mla;
  const DeviceLayer& L = model->layers[static_cast<size_t>(l)];
  const int64_t heads = model->q_heads, nope = m.qk_nope_head_dim, rope = m.qk_rope_head_dim;
  const int64_t lora = m.kv_lora_rank, vd = m.v_head_dim, qk = m.qk_head_dim();
  constexpr float kLatentNormEps = 1e-6f;  // transformers builds these norms with its default
  if (L.q_a) {
    project(*blas, ws.h, L.q_a, ws.mla_qa, OutType::kF32, tokens, stream);
    MOE_CUDA_CHECK(kernels::rms_norm(ws.mla_qa, L.q_a_norm, static_cast<int>(tokens),
                                     static_cast<int>(m.q_lora_rank), kLatentNormEps, ws.mla_qa_normed, stream));
    project(*blas, ws.mla_qa_normed, L.q_b, ws.qkv, OutType::kF32, tokens, stream);
  } else {
    project(*blas, ws.h, L.q, ws.qkv, OutType::kF32, tokens, stream);
  }
  project(*blas, ws.h, L.kv_a, ws.mla_kv, OutType::kF32, tokens, stream);
  mark("q and latent projections");
  kernels::LatentCacheParams lc;
  lc.kv = ws.mla_kv;
  lc.norm_weight = L.kv_a_norm;
  lc.eps = kLatentNormEps;
  lc.inv_freq = model->inv_freq;
  lc.rope_scale = model->rope_cos_sin_scale;
  lc.positions = meta.positions;
  lc.slots = meta.slots;
  lc.cache = k_cache[static_cast<size_t>(l)];
  lc.tokens = static_cast<int>(tokens);
  lc.lora = static_cast<int>(lora);
  lc.rope = static_cast<int>(rope);
  MOE_CUDA_CHECK(kernels::prepare_latent(lc, stream));
  kernels::MlaQParams mq;
  mq.q = ws.qkv;
  mq.inv_freq = model->inv_freq;
  mq.rope_scale = model->rope_cos_sin_scale;
  mq.positions = meta.positions;
  mq.q_nope = ws.mla_q_nope;
  mq.q_full = ws.q;
  mq.tokens = lc.tokens;
  mq.heads = static_cast<int>(heads);
  mq.nope = static_cast<int>(nope);
  mq.rope = lc.rope;
  mq.lora = lc.lora;
  MOE_CUDA_CHECK(kernels::prepare_mla_q(mq, stream));
  mark("latent norm, rope, cache write");
  project_each(*blas, ws.mla_q_nope, heads * nope, nope, L.uk_t, ws.q, OutType::kBf16, heads * (lora + rope),
               lora + rope, tokens, stream);
  mark("absorbed key projection");
  kernels::LatentAttentionParams a;
  describe_sequences(a, meta, opts.block_size, tokens, seqs, max_blocks, max_context);
  a.q = ws.q;
  a.cache = lc.cache;
  a.heads = mq.heads;
  a.lora = lc.lora;
  a.rope = lc.rope;
  a.scale = c.softmax_scale_factor / std::sqrt(static_cast<float>(qk));
  a.out = ws.mla_o_lat;
  a.workspace = ws.attention;
  MOE_CUDA_CHECK(kernels::latent_attention(a, stream));
  mark("attention");
  project_each(*blas, ws.mla_o_lat, heads * lora, lora, L.uv, ws.attn, OutType::kBf16, heads * vd, vd, tokens,
               stream);
  mark("absorbed value projection");
  project(*blas, ws.attn, L.o, ws.branch, OutType::kBf16, tokens, stream);
  mark("o projection");
  sum_head_shares(L, tokens);
}

void Rank::attention(int64_t l, int64_t tokens, int64_t seqs, int64_t max_context) {
  const ModelConfig& c = config;
  if (c.attention == AttentionKind::kMla) return latent_attention(l, tokens, seqs, max_context);
  const DeviceLayer& L = model->layers[static_cast<size_t>(l)];
  const int64_t hd = c.head_dim, qw = model->q_heads * hd, kw = model->kv_heads * hd;
  const int64_t qkvw = qw + 2 * kw;
  // q, k and v leave their projection in bf16, as the reference's linear layers return them: at a
  // 2048-token prefill of qwen3-30b-a3b that is 21 MB less written and read back a layer than f32.
  auto* qkv = reinterpret_cast<uint16_t*>(ws.qkv);
  if (L.qkv_fused) {
    project(*blas, qkv_in, ws.h, L.q, qkv, OutType::kBf16, tokens, stream);
    qkv_in = {};
  } else {
    project(*blas, ws.h, L.q, qkv, OutType::kBf16, tokens, stream, qkvw);
    project(*blas, ws.h, L.k, qkv + qw, OutType::kBf16, tokens, stream, qkvw);
    project(*blas, ws.h, L.v, qkv + qw + kw, OutType::kBf16, tokens, stream, qkvw);
  }
  mark("qkv projection");
  kernels::QkvParams p;
  p.tokens = static_cast<int>(tokens);
  p.q_heads = static_cast<int>(model->q_heads);
  p.kv_heads = static_cast<int>(model->kv_heads);
  p.head_dim = static_cast<int>(hd);
  p.bias = L.qkv_bias;
  p.qk_norm = c.qk_norm == QkNorm::kNone ? 0 : c.qk_norm == QkNorm::kPerHead ? 1 : 2;
  p.q_norm = L.q_norm;
  p.k_norm = L.k_norm;
  p.eps = c.rms_norm_eps;
  p.clip = c.clip_qkv;
  p.rope_half = c.rope_style == RopeStyle::kHalf ? 1 : 0;
  p.rot_dim = static_cast<int>(hd);
  p.inv_freq = model->inv_freq;
  p.rope_scale = model->rope_cos_sin_scale;
  p.positions = meta.positions;
  p.slots = meta.slots;
  p.k_cache = k_cache[static_cast<size_t>(l)];
  p.v_cache = v_cache[static_cast<size_t>(l)];
  p.q_out = ws.q;
  MOE_CUDA_CHECK(kernels::prepare_qkv(qkv, p, stream));
  mark("qk norm, rope, KV write");
  kernels::PagedAttentionParams a;
  describe_sequences(a, meta, opts.block_size, tokens, seqs, max_blocks, max_context);
  a.q = ws.q;
  a.k_cache = p.k_cache;
  a.v_cache = p.v_cache;
  a.q_heads = p.q_heads;
  a.kv_heads = p.kv_heads;
  a.head_dim = p.head_dim;
  a.scale = 1.0f / std::sqrt(static_cast<float>(hd));
  a.out = ws.attn;
  a.workspace = ws.attention;
  // Where the wgmma kernel runs and the o projection is W8A8, the kernel writes the projection's
  // input quantised (a head's 128 dims are one scale block) instead of bf16 for a quantising pass.
  Fp8Input o_in;
  const bool wgmma = kernels::paged_attention_has_wgmma(a.head_dim);
  if (opts.fuse &&
      kernels::paged_attention_auto_path(a.tokens, a.num_seqs, a.head_dim, wgmma) == kernels::AttentionPath::kWgmma)
    o_in = fp8_input_room(*blas, L.o, ws.branch, OutType::kBf16, tokens);
  a.out_codes = o_in.codes;
  a.out_scales = o_in.scales;
  a.code_rows = static_cast<int>(o_in.rows);
  MOE_CUDA_CHECK(kernels::paged_attention(a, stream));
  mark("attention");
  project(*blas, o_in, ws.attn, L.o, ws.branch, OutType::kBf16, tokens, stream);
  mark("o projection");
  sum_head_shares(L, tokens);
}

// Under tp each rank's output projection covers its heads only: sum the shares over the
// ranks, and where the router does not fold the post-attention norm itself, fold it into the sum.
void Rank::sum_head_shares(const DeviceLayer& L, int64_t tokens) {
  if (!tp) return;
  if (opts.fuse && !(L.sparse && fused_router(tokens))) {
    const PeerAllReduce::AddNorm norm{ws.x, nullptr, L.post_norm, config.rms_norm_eps, ws.h};
    all_reduce(ws.branch, tokens, &norm);
    post_normed = true;
  } else {
    all_reduce(ws.branch, tokens);
  }
}

// The router's input: the post-attention residual add and norm, then its projection and the
// top-k choice; one fused launch for a few rows (decode), three kernels otherwise.
void Rank::route(int64_t l, int64_t tokens) {
  const ModelConfig& c = config;
  const DeviceLayer& L = model->layers[static_cast<size_t>(l)];
  const RouterConfig& rc = c.moe.router;
  const int t = static_cast<int>(tokens), hidden = static_cast<int>(c.hidden_size);
  kernels::RouterParams rp = kernels::router_params(rc, L.router_bias);
  rp.live_rows = meta.live_rows;
  if (ranks > 1 && !exchanges) {  // the experts take this rank's indices
    rp.local_ids = ws.local_ids;
    rp.local_first = static_cast<int>(model->first_expert);
    rp.local_count = static_cast<int>(model->local_experts);
  }
  if (!post_normed && fused_router(tokens)) {
    kernels::NormRouteParams q;
    q.x = ws.x;
    q.branch = ws.branch;
    q.norm_weight = L.post_norm;
    q.eps = c.rms_norm_eps;
    q.normed = ws.h;
    q.router_weight = L.router.bf16_data("the fused router");
    q.logits = ws.router_logits;
    q.counter = ws.counter;
    q.hidden = hidden;
    MOE_CUDA_CHECK(kernels::norm_route(q, rp, t, ws.topk_ids, ws.topk_weights, stream));
    mark("residual add + RMSNorm + route");
    return;
  }
  if (!post_normed) {
    MOE_CUDA_CHECK(kernels::add_rms_norm(ws.x, ws.branch, nullptr, L.post_norm, t, hidden,
                                         c.rms_norm_eps, ws.h, stream));
    mark("residual add + RMSNorm");
  }
  project(*blas, ws.h, L.router, ws.router_logits, OutType::kF32, tokens, stream);
  mark("router projection");
  MOE_CUDA_CHECK(kernels::route(ws.router_logits, rp, t, ws.topk_ids, ws.topk_weights, stream));
  mark("route (top-k)");
}

// Writes the layer's feed-forward output to ws.branch (and ws.branch2); returns whether
// branch2 holds a shared expert's output. Where the routed experts are the layer's last
// operation and another layer follows, their last kernel also adds the output to the residual
// stream and applies that layer's input norm (into ws.h); *next_normed says so.
bool Rank::feed_forward(int64_t l, int64_t tokens, bool* next_normed) {
  const ModelConfig& c = config;
  const DeviceLayer& L = model->layers[static_cast<size_t>(l)];
  const int t = static_cast<int>(tokens);
  if (!L.sparse) {
    const int64_t inter = c.intermediate_size;
    project(*blas, ws.h, L.mlp_gate_up, ws.ffn_gate_up, OutType::kBf16, tokens, stream);
    MOE_CUDA_CHECK(kernels::silu_mul(ws.ffn_gate_up, t, static_cast<int>(inter), ws.ffn_act, stream));
    project(*blas, ws.ffn_act, L.mlp_down, ws.branch, OutType::kBf16, tokens, stream);
    mark("dense MLP");
    return false;
  }
  const RouterConfig& rc = c.moe.router;
  route(l, tokens);
  if ((profiling || opts.record_routing) && routed_log)
    MOE_CUDA_CHECK(cudaMemcpyAsync(routed_log + l * max_tokens * rc.top_k, ws.topk_ids,
                                   static_cast<size_t>(tokens * rc.top_k) * 4, cudaMemcpyDeviceToDevice, stream));
  if (exchanges && split_rows) {
    // Every rank of the attention group holds the group's rows: each exchanges its own share
    // (zeros elsewhere), and the group's all-reduce gives every rank all of them, with the
    // shared expert's output (whole on every rank), the residual add and the next layer's input
    // norm folded in. Adding zeros is exact, so the rows are those of one exchange.
    const int64_t share = tokens / group_size, first = group_rank * share, k = rc.top_k, hidden = c.hidden_size;
    MOE_CUDA_CHECK(cudaMemsetAsync(ws.branch, 0, static_cast<size_t>(tokens * hidden) * 2, stream));
    ep_layers[static_cast<size_t>(l)]->forward(ws.h + first * hidden, ws.topk_ids + first * k,
                                               ws.topk_weights + first * k, share, ws.branch + first * hidden, stream);
    mark("routed experts over the EP exchange (this GPU's share of the rows)");
    return gather_shares(l, tokens, next_normed);
  }
  if (exchanges) {
    // The exchange brings each token's slots to the ranks that hold their experts and the sums
    // back: every rank ends with the whole routed output. The shared expert runs whole on
    // every rank.
    ep_layers[static_cast<size_t>(l)]->forward(ws.h, ws.topk_ids, ws.topk_weights, tokens, ws.branch, stream);
    mark("routed experts over the EP exchange");
    return L.shared_gate_up && shared_expert(l, tokens);
  }
  if (ranks > 1) {
    // This rank's experts on every token (route() wrote their local indices), the others'
    // slots skipped; the shared expert (whole on every rank) before the sum, so that the next
    // layer's input norm folds into it.
    L.experts->forward(ws.h, ws.local_ids, ws.topk_weights, tokens, ws.branch, ws.experts, stream);
    mark("routed experts");
    return gather_shares(l, tokens, next_normed);
  } else if (opts.fuse && !L.shared_gate_up && l + 1 < c.num_layers) {
    // ws.h is both the experts' input and the folded norm's output: the combine writes it only
    // after the expert GEMMs, which read it, have completed (stream order).
    const DeviceLayer& N = model->layers[static_cast<size_t>(l + 1)];
    Experts::NextNorm next{ws.x, N.input_norm, c.rms_norm_eps, ws.h};
    // The next q/k/v projection, where it is one W8A8 product, takes its input quantised here.
    qkv_in = c.attention != AttentionKind::kMla && N.qkv_fused ? fp8_input_room(*blas, N.q, ws.qkv, OutType::kBf16, tokens)
                                                               : Fp8Input{};
    next.codes = qkv_in.codes;
    next.scales = qkv_in.scales;
    next.code_rows = qkv_in.rows;
    L.experts->forward_then_norm(ws.h, ws.topk_ids, ws.topk_weights, tokens, next, ws.experts, stream);
    *next_normed = true;
    mark("routed experts + residual add + RMSNorm");
    return false;
  } else {
    L.experts->forward(ws.h, ws.topk_ids, ws.topk_weights, tokens, ws.branch, ws.experts, stream);
    mark("routed experts");
  }
  return L.shared_gate_up && shared_expert(l, tokens);
}

// The routed output's shares in ws.branch summed over the group; the shared expert (whole on
// every rank) runs first, so that the residual add and the next layer's input norm fold into
// the sum. Returns what feed_forward does.
bool Rank::gather_shares(int64_t l, int64_t tokens, bool* next_normed) {
  const ModelConfig& c = config;
  const DeviceLayer& L = model->layers[static_cast<size_t>(l)];
  const bool shared = L.shared_gate_up && shared_expert(l, tokens);
  if (opts.fuse && l + 1 < c.num_layers) {
    const PeerAllReduce::AddNorm norm{ws.x, shared ? ws.branch2 : nullptr,
                                      model->layers[static_cast<size_t>(l + 1)].input_norm, c.rms_norm_eps, ws.h};
    all_reduce(ws.branch, tokens, &norm);
    *next_normed = true;
    return false;
  }
  all_reduce(ws.branch, tokens);
  return shared;
}

// The layer's shared expert into ws.branch2 (gated where the model gates it); returns true.
bool Rank::shared_expert(int64_t l, int64_t tokens) {
  const ModelConfig& c = config;
  const DeviceLayer& L = model->layers[static_cast<size_t>(l)];
  const int64_t hidden = c.hidden_size;
  const int t = static_cast<int>(tokens);
  const int64_t inter = c.moe.shared_intermediate;
  project(*blas, ws.h, L.shared_gate_up, ws.ffn_gate_up, OutType::kBf16, tokens, stream);
  MOE_CUDA_CHECK(kernels::silu_mul(ws.ffn_gate_up, t, static_cast<int>(inter), ws.ffn_act, stream));
  project(*blas, ws.ffn_act, L.shared_down, ws.branch2, OutType::kBf16, tokens, stream);
  if (L.shared_gate) {
    project(*blas, ws.h, L.shared_gate, ws.shared_gate, OutType::kF32, tokens, stream);
    MOE_CUDA_CHECK(kernels::sigmoid_scale_rows(ws.branch2, ws.shared_gate, t, static_cast<int>(hidden), stream));
  }
  mark("shared expert");
  return true;
}

// Final norm and lm_head for rows [first, first + rows) of ws.x into `logits`; with `sampled`,
// one token per row drawn with the step's sampling rows 0.. rows - 1.
void Rank::head(int64_t first, int64_t rows, float* logits, int32_t* sampled) {
  const ModelConfig& c = config;
  MOE_CUDA_CHECK(kernels::rms_norm(ws.x + first * c.hidden_size, model->final_norm,
                                   static_cast<int>(rows), static_cast<int>(c.hidden_size),
                                   c.rms_norm_eps, ws.normed, stream));
  mark("residual add + RMSNorm");
  if (head_gather) {
    // This rank's share of the vocabulary: the first writes its logits in place, the others into
    // their shards, which the first then gathers.
    const int64_t first_col = head_gather->first_column(group_rank), cols = head_gather->columns(group_rank);
    const DeviceMatrix share = model->lm_head.row_slice(first_col, cols);
    if (!reads_out()) {
      head_gather->before_write(group_rank, stream);
      if (cols > 0) project(*blas, ws.normed, share, head_gather->shard(group_rank), OutType::kF32, rows, stream);
      head_gather->after_write(group_rank, stream);
      return;
    }
    if (cols > 0) project(*blas, ws.normed, share, logits, OutType::kF32, rows, stream, c.vocab_size);
    mark("lm_head, this GPU's share of the vocabulary");
    head_gather->gather(logits, rows, c.vocab_size, stream);
    mark("lm_head, the other shares gathered");
  } else {
    project(*blas, ws.normed, model->lm_head, logits, OutType::kF32, rows, stream);
    mark("lm_head");
  }
  if (!sampled) return;
  kernels::SampleParams sp{meta.temperature, meta.top_k, meta.top_p, meta.seed, meta.step,
                           static_cast<int>(c.vocab_size)};
  const int64_t drawn = opts.sampled_vocab > 0 ? std::min(opts.sampled_vocab, c.vocab_size) : c.vocab_size;
  MOE_CUDA_CHECK(kernels::sample_rows(logits, sp, static_cast<int>(rows), static_cast<int>(drawn),
                                      sampled, stream));
  mark("sampling");
}

// Whether route() takes the post-attention norm into its one fused launch. It beats the three
// separate kernels at 1-2 rows and loses from 4 on (H100, qwen3-30b-a3b decode step: -7% at
// batch 1, -10% at 2, +1% at 4, +4% at 8): its one warp per expert (16 blocks for 128
// experts) leaves most of the device idle as rows grow.
bool Rank::fused_router(int64_t tokens) const {
  constexpr int kFusedRouterMaxRows = 2;
  return opts.fuse && tokens <= kFusedRouterMaxRows &&
         kernels::norm_route_supported(static_cast<int>(tokens), static_cast<int>(config.hidden_size));
}

// Sums a partial [tokens, H] bf16 result over the ranks in place; with `then`, folds the
// residual add and norm that follow into the same kernel instead (ranks > 1 only).
void Rank::all_reduce(uint16_t* rows, int64_t tokens, const PeerAllReduce::AddNorm* then) {
  allreduce->run(group_rank, rows, tokens, config.hidden_size, stream, then);
  mark(then ? "all-reduce + residual add + RMSNorm" : "all-reduce");
}

// --- profiling and diagnostics -------------------------------------------------------------

void Rank::mark(const char* name) {
  if (!profiling) return;
  const size_t i = mark_names.size();
  if (i == marks.size()) {
    cudaEvent_t e = nullptr;
    MOE_CUDA_CHECK(cudaEventCreate(&e));
    marks.push_back(e);
  }
  // While capturing, an external record becomes a node of the graph and keeps a timestamp.
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  MOE_CUDA_CHECK(cudaStreamIsCapturing(stream, &capturing));
  if (capturing == cudaStreamCaptureStatusActive)
    MOE_CUDA_CHECK(cudaEventRecordWithFlags(marks[i], stream, cudaEventRecordExternal));
  else
    MOE_CUDA_CHECK(cudaEventRecord(marks[i], stream));
  mark_names.push_back(name);
}

void Rank::begin_profile(bool on) {
  mark_names.clear();
  profiling = on;
  mark("begin");
}

void Rank::end_profile(OpProfile* profile) {
  profiling = false;
  if (profile) collect(profile);
}

void Rank::collect(OpProfile* profile) {
  *profile = OpProfile{};
  for (size_t i = 1; i < mark_names.size(); ++i) {
    float ms = 0;
    MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, marks[i - 1], marks[i]));
    const std::string name = mark_names[i];
    auto it = std::find_if(profile->seconds.begin(), profile->seconds.end(),
                           [&](const auto& e) { return e.first == name; });
    if (it == profile->seconds.end()) {
      profile->seconds.emplace_back(name, 0.0);
      it = profile->seconds.end() - 1;
    }
    it->second += ms * 1e-3;
    profile->total += ms * 1e-3;
  }
}

std::vector<int32_t> Rank::routing() const {
  const ModelConfig& c = config;
  const int64_t k = std::max<int64_t>(c.moe.top_k, 1);
  std::vector<int32_t> out(static_cast<size_t>(c.num_layers * last_tokens * k), -1);
  if (!routed_log) return out;
  MOE_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (int64_t l = 0; l < c.num_layers; ++l)
    MOE_CUDA_CHECK(cudaMemcpy(out.data() + l * last_tokens * k, routed_log + l * max_tokens * k,
                              static_cast<size_t>(last_tokens * k) * 4, cudaMemcpyDeviceToHost));
  return out;
}

void Rank::count_memory(MemoryReport* r) const {
  r->weights += model->bytes();
  r->kv_cache += kv_arena.capacity();
  r->workspace += workspace_arena.capacity() + meta_arena.capacity() + ep_arena.capacity() + blas->workspace_bytes();
  r->graph_outputs += graph_arena.capacity();
}

}  // namespace moe::cuda::engine
