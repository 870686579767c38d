#include "model/model.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <unordered_set>

#include "backend/cpu/kernels.h"
#include "io/checkpoint.h"
#include "moe/errors.h"
#include "moe/router.h"
#include "ops/ops.h"

namespace moe {

namespace {
// transformers builds DeepSeek's q_a / kv_a RMSNorms without passing the config's epsilon.
constexpr float kLatentNormEps = 1e-6f;
}  // namespace

std::vector<std::pair<std::string, std::vector<int64_t>>> state_dict_keys(
    const ModelConfig& mc, const ExpertSelection& experts) {
  Arena unused("record", 4096);
  WeightLoader recorder = WeightLoader::recording(unused);
  load_weights(mc, recorder, experts);
  std::vector<std::pair<std::string, std::vector<int64_t>>> keys;
  std::unordered_set<std::string> seen;  // first occurrence wins: stable order, no duplicates
  for (const auto& entry : recorder.taken())
    if (seen.insert(entry.first).second) keys.push_back(entry);
  return keys;
}

int64_t parameter_count(const ModelConfig& mc) {
  int64_t total = 0;
  for (const auto& [name, shape] : state_dict_keys(mc)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    total += n;
  }
  return total;
}

Model::Model(std::string dir, ModelConfig config, int threads, ExecMode exec)
    : dir_(std::move(dir)),
      config_(std::move(config)),
      exec_(exec),
      pool_(threads),
      weights_arena_("weights", 64 << 20),
      workspace_("workspace", 16 << 20) {}

std::unique_ptr<Model> Model::load(const std::string& dir, const LoadOptions& opts) {
  ModelConfig mc = load_model_config(dir);
  std::unique_ptr<Model> model(new Model(dir, mc, opts.threads, opts.exec));
  ExpertSelection all;
  if (opts.comm && opts.comm->size() > 1) {
    dist::DistConfig dc;
    dc.ep = opts.comm->size();
    dc.ep_backend = dist::ep_backend_name(opts.ep_backend);
    dist::validate_dist_config(dc);
    if (mc.num_moe_layers() > 0) dist::validate_ep_for_model(dc, mc.moe.num_experts);
    model->comm_ = opts.comm;
    model->placement_ = std::make_unique<ExpertPlacement>(std::max<int64_t>(mc.moe.num_experts, 1),
                                                          opts.comm->size(), opts.comm->rank());
    model->ep_ = make_ep_backend(opts.ep_backend);
    all.global_to_local = model->placement_->global_to_local();
  }
  if (opts.random_weights) {
    WeightLoader loader(model->weights_arena_, opts.seed);
    model->weights_ = load_weights(mc, loader, all);
    if (!opts.comm || opts.comm->rank() == 0) note_random_fp8(mc, "f32");
  } else {
    Checkpoint ckpt(dir);
    WeightLoader loader(ckpt, model->weights_arena_, opts.strict);
    if (mc.quant.fp8) loader.set_fp8_blocks(mc.quant.block_rows, mc.quant.block_cols, mc.quant.modules_to_not_convert);
    const bool draw = opts.progress && isatty(STDERR_FILENO) && ckpt.total_bytes() >= (64u << 20);
    int last_percent = -1;
    if (draw) {
      loader.on_progress = [&](uint64_t done, uint64_t total) {
        int percent = static_cast<int>(100.0 * static_cast<double>(done) / static_cast<double>(total));
        if (percent == last_percent) return;
        last_percent = percent;
        std::fprintf(stderr, "\rloading weights: %3d%% (%.2f / %.2f GB)", percent, done / 1e9,
                     total / 1e9);
        std::fflush(stderr);
      };
    }
    model->weights_ = load_weights(mc, loader, all);
    loader.finish();
    check_fp8_found(mc, loader, dir);
    if (draw) std::fprintf(stderr, "\n");
    if (!opts.comm || opts.comm->rank() == 0) note_skipped_mtp(mc, model->weights_);
  }
  if (model->placement_)
    model->local_of_ = model->placement_->global_to_local();
  else
    for (int64_t e = 0; e < mc.moe.num_experts; ++e) model->local_of_.push_back(static_cast<int32_t>(e));

  model->rope_ = mc.rope();  // over head_dim, the rotary width (qk_rope_head_dim for MLA)
  model->expert_tokens_.assign(static_cast<size_t>(mc.num_layers), {});
  for (int64_t l = 0; l < mc.num_layers; ++l)
    if (mc.moe_layers[static_cast<size_t>(l)])
      model->expert_tokens_[static_cast<size_t>(l)].assign(static_cast<size_t>(mc.moe.num_experts), 0);
  return model;
}

size_t Model::expert_bytes() const {
  size_t total = 0;
  for (const auto& l : weights_.layers)
    if (l.sparse) total += l.moe.experts.bytes();
  return total;
}

KvCache Model::new_cache(int64_t capacity) const {
  if (capacity <= 0) capacity = config_.max_position_embeddings;
  return KvCache(config_.num_layers, capacity, config_.kv_key_width(), config_.kv_value_width());
}

void Model::attention(int64_t layer, const Tensor& h, const std::vector<int32_t>& positions,
                      const std::vector<Segment>& segments, Tensor& out) {
  const ModelConfig& c = config_;
  if (c.attention == AttentionKind::kMla) return latent_attention(layer, h, positions, segments, out);
  const AttentionWeights& w = weights_.layers[static_cast<size_t>(layer)].attn;
  const int64_t t = h.dim(0), hd = c.head_dim;
  Tensor q = Tensor::empty(workspace_, {t, c.num_heads * hd});
  Tensor k = Tensor::empty(workspace_, {t, c.num_kv_heads * hd});
  Tensor v = Tensor::empty(workspace_, {t, c.num_kv_heads * hd});
  ops::linear(pool_, h, w.q, c.qkv_bias ? &w.q_bias : nullptr, q);
  ops::linear(pool_, h, w.k, c.qkv_bias ? &w.k_bias : nullptr, k);
  ops::linear(pool_, h, w.v, c.qkv_bias ? &w.v_bias : nullptr, v);
  if (c.qk_norm != QkNorm::kNone) {
    ops::rms_norm_groups(pool_, q, w.q_norm, c.rms_norm_eps);
    ops::rms_norm_groups(pool_, k, w.k_norm, c.rms_norm_eps);
  }
  if (c.clip_qkv > 0.0f) {
    for (Tensor* x : {&q, &k, &v})
      for (int64_t i = 0; i < x->numel(); ++i)
        x->data<float>()[i] = std::clamp(x->data<float>()[i], -c.clip_qkv, c.clip_qkv);
  }
  auto rope = c.rope_style == RopeStyle::kHalf ? cpu::rope_half : cpu::rope_interleaved;
  const float* inv_freq = rope_.inv_freq.data();
  rope(q.data<float>(), t, c.num_heads, hd, hd, positions.data(), inv_freq, rope_.cos_sin_scale);
  rope(k.data<float>(), t, c.num_kv_heads, hd, hd, positions.data(), inv_freq, rope_.cos_sin_scale);
  const int64_t width = c.num_kv_heads * hd;
  Tensor attn = Tensor::empty(workspace_, {t, c.num_heads * hd});
  std::vector<const float*> k_blocks, v_blocks;
  for (const Segment& seg : segments) {
    const int64_t n = seg.end - seg.begin;
    KvCache& cache = *seg.cache;
    for (int64_t i = 0; i < n; ++i) {  // row by row: consecutive positions may cross a block
      std::memcpy(cache.k_row(layer, seg.start + i), k.data<float>() + (seg.begin + i) * width,
                  static_cast<size_t>(width) * 4);
      std::memcpy(cache.v_row(layer, seg.start + i), v.data<float>() + (seg.begin + i) * width,
                  static_cast<size_t>(width) * 4);
    }
    k_blocks.clear();
    v_blocks.clear();
    for (int32_t b : cache.blocks()) {
      k_blocks.push_back(cache.pool()->k(layer, b));
      v_blocks.push_back(cache.pool()->v(layer, b));
    }
    cpu::paged_attention(pool_, q.data<float>() + seg.begin * c.num_heads * hd, k_blocks.data(),
                         v_blocks.data(), cache.block_size(),
                         attn.data<float>() + seg.begin * c.num_heads * hd, n, seg.start + n,
                         c.num_heads, c.num_kv_heads, hd, hd, width, width,
                         1.0f / std::sqrt(static_cast<float>(hd)));
  }
  ops::linear(pool_, attn, w.o, c.o_bias ? &w.o_bias : nullptr, out);
}

// Multi-head latent attention. The cache row of a token is [normalised kv latent | rotated
// shared key part]; keys and values of every head are expanded from the latents of the whole
// context at each call (simple, and exact; the absorbed form is a GPU-path optimisation).
void Model::latent_attention(int64_t layer, const Tensor& h, const std::vector<int32_t>& positions,
                             const std::vector<Segment>& segments, Tensor& out) {
  const ModelConfig& c = config_;
  const MlaConfig& m = c.mla;
  const AttentionWeights& w = weights_.layers[static_cast<size_t>(layer)].attn;
  const int64_t t = h.dim(0), heads = c.num_heads, qk = m.qk_head_dim();
  const int64_t nope = m.qk_nope_head_dim, rope_dim = m.qk_rope_head_dim, vd = m.v_head_dim;
  const int64_t lora = m.kv_lora_rank, row = lora + rope_dim;

  Tensor q = Tensor::empty(workspace_, {t, heads * qk});
  if (m.q_lora_rank > 0) {
    Tensor qa = Tensor::empty(workspace_, {t, m.q_lora_rank});
    ops::linear(pool_, h, w.q_a, nullptr, qa);
    ops::rms_norm(pool_, qa, w.q_a_norm, kLatentNormEps, qa);
    ops::linear(pool_, qa, w.q_b, nullptr, q);
  } else {
    ops::linear(pool_, h, w.q, nullptr, q);
  }
  // Rotate the last rope_dim features of every head: view q as [t * heads, qk] rows.
  for (int64_t i = 0; i < t; ++i)
    cpu::rope_interleaved(q.data<float>() + i * heads * qk + nope, 1, heads, qk, rope_dim,
                          &positions[static_cast<size_t>(i)], rope_.inv_freq.data(), rope_.cos_sin_scale);
  Tensor kv = Tensor::empty(workspace_, {t, row});
  ops::linear(pool_, h, w.kv_a, nullptr, kv);
  Tensor attn = Tensor::empty(workspace_, {t, heads * vd});
  for (const Segment& seg : segments) {
    const KvCache& cache = *seg.cache;
    const int64_t n = seg.end - seg.begin, ctx = seg.start + n;
    for (int64_t i = 0; i < n; ++i) {
      float* dst = cache.k_row(layer, seg.start + i);
      const float* src = kv.data<float>() + (seg.begin + i) * row;
      cpu::rms_norm(pool_, src, w.kv_a_norm.data<float>(), dst, 1, lora, kLatentNormEps);
      std::memcpy(dst + lora, src + lora, static_cast<size_t>(rope_dim) * 4);
      cpu::rope_interleaved(dst + lora, 1, 1, rope_dim, rope_dim, &positions[static_cast<size_t>(seg.begin + i)],
                            rope_.inv_freq.data(), rope_.cos_sin_scale);
    }
    // Expand the whole context's latents into per-head keys and values.
    Tensor latents = Tensor::empty(workspace_, {ctx, lora});
    for (int64_t j = 0; j < ctx; ++j)
      std::memcpy(latents.data<float>() + j * lora, cache.k_row(layer, j), static_cast<size_t>(lora) * 4);
    Tensor kvb = Tensor::empty(workspace_, {ctx, heads * (nope + vd)});
    ops::linear(pool_, latents, w.kv_b, nullptr, kvb);
    Tensor keys = Tensor::empty(workspace_, {ctx, heads * qk});
    Tensor values = Tensor::empty(workspace_, {ctx, heads * vd});
    for (int64_t j = 0; j < ctx; ++j)
      for (int64_t hh = 0; hh < heads; ++hh) {
        const float* src = kvb.data<float>() + (j * heads + hh) * (nope + vd);
        float* kd = keys.data<float>() + (j * heads + hh) * qk;
        std::memcpy(kd, src, static_cast<size_t>(nope) * 4);
        std::memcpy(kd + nope, cache.k_row(layer, j) + lora, static_cast<size_t>(rope_dim) * 4);
        std::memcpy(values.data<float>() + (j * heads + hh) * vd, src + nope, static_cast<size_t>(vd) * 4);
      }
    cpu::attention(pool_, q.data<float>() + seg.begin * heads * qk, keys.data<float>(),
                   values.data<float>(), attn.data<float>() + seg.begin * heads * vd, n, ctx, heads,
                   heads, qk, vd, heads * qk, heads * vd,
                   c.softmax_scale_factor / std::sqrt(static_cast<float>(qk)));
  }
  ops::linear(pool_, attn, w.o, nullptr, out);
}

void Model::dense_ffn(const FfnWeights& w, const Tensor& h, Tensor& out) {
  const int64_t t = h.dim(0), inter = w.down.dim(1);
  Tensor gate_up = Tensor::empty(workspace_, {t, 2 * inter});
  Tensor act = Tensor::empty(workspace_, {t, inter});
  ops::linear(pool_, h, w.gate_up, nullptr, gate_up);
  ops::silu_mul(gate_up, act);
  ops::linear(pool_, act, w.down, nullptr, out);
}

void Model::sparse_ffn(int64_t layer, const Tensor& h, Tensor& out) {
  const ModelConfig& c = config_;
  const MoeWeights& w = weights_.layers[static_cast<size_t>(layer)].moe;
  const int64_t t = h.dim(0), n_exp = c.moe.num_experts, k = c.moe.top_k;
  Tensor logits = Tensor::empty(workspace_, {t, n_exp});
  ops::linear(pool_, h, w.router, nullptr, logits);
  if (on_router)
    on_router(layer, logits.data<float>(), w.router_bias.defined() ? w.router_bias.data<float>() : nullptr,
              t, n_exp);
  std::vector<int32_t> ids(static_cast<size_t>(t * k));
  std::vector<float> weights(static_cast<size_t>(t * k));
  route(c.moe.router, logits.data<float>(), w.router_bias.defined() ? w.router_bias.data<float>() : nullptr,
        t, ids.data(), weights.data());
  auto& stats = expert_tokens_[static_cast<size_t>(layer)];
  for (int32_t e : ids) ++stats[static_cast<size_t>(e)];
  if (ep_) {
    EpContext ctx{*comm_, pool_, workspace_, *placement_, ep_stats_};
    ep_moe_forward(*ep_, ctx, exec_, w.experts, plan_, h, ids.data(), weights.data(), k, out);
  } else {
    run_experts(exec_, pool_, workspace_, w.experts, local_of_, h, ids.data(), weights.data(), k,
                out, plan_);
  }
  if (w.shared.defined()) {
    Tensor shared = Tensor::empty(workspace_, {t, c.hidden_size});
    dense_ffn(w.shared, h, shared);
    if (w.shared_gate.defined()) {
      Tensor gate = Tensor::empty(workspace_, {t, 1});
      ops::linear(pool_, h, w.shared_gate, nullptr, gate);
      for (int64_t i = 0; i < t; ++i) {
        float g = 1.0f / (1.0f + std::exp(-gate.data<float>()[i]));
        float* s = shared.data<float>() + i * c.hidden_size;
        for (int64_t d = 0; d < c.hidden_size; ++d) s[d] *= g;
      }
    }
    ops::add_inplace(out, shared);
  }
}

Tensor Model::forward(std::span<const int32_t> ids, KvCache& cache, bool all_logits) {
  std::vector<SequenceInput> batch{{ids, &cache, all_logits}};
  return std::move(forward_batch(batch)[0]);
}

std::vector<Tensor> Model::forward_batch(const std::vector<SequenceInput>& batch) {
  const ModelConfig& c = config_;
  const int64_t hidden = c.hidden_size;
  MOE_CHECK(!batch.empty(), kInvalidArgument, "empty batch: at least one sequence is needed");
  // Validate everything before any cache is touched, so a rejected call changes nothing.
  std::vector<Segment> segments;
  int64_t t = 0;
  for (const SequenceInput& in : batch) {
    const int64_t n = static_cast<int64_t>(in.ids.size());
    MOE_CHECK(n > 0, kInvalidArgument, "empty input: at least one token is needed");
    for (int32_t id : in.ids)
      MOE_CHECK(id >= 0 && id < c.vocab_size, kInvalidArgument,
                "token id {} is outside the vocabulary [0, {})", id, c.vocab_size);
    MOE_CHECK(in.cache != nullptr, kInvalidArgument, "a sequence has no KV cache");
    KvCache& cache = *in.cache;
    MOE_CHECK(cache.k_width() == c.kv_key_width() && cache.v_width() == c.kv_value_width(),
              kInvalidArgument, "KV cache was made for another model");
    MOE_CHECK(cache.length() + n <= cache.capacity(), kInvalidArgument,
              "context full: {} cached + {} new tokens exceed the capacity of {}", cache.length(),
              n, cache.capacity());
    for (const Segment& other : segments)
      MOE_CHECK(other.cache != in.cache, kInvalidArgument, "two sequences share one KV cache");
    // Blocks shared with other sequences (reused prefixes) are full and must stay as they are.
    // (A borrowed view's owner keeps the references and checked this when it reserved the rows.)
    for (int64_t b = cache.length() / cache.block_size();
         !cache.is_borrowed() && b * cache.block_size() < cache.length() + n; ++b) {
      const int32_t block = cache.blocks()[static_cast<size_t>(b)];
      MOE_CHECK(cache.pool()->ref_count(block) == 1, kInvalidArgument,
                "KV block {} is shared with another sequence and cannot be written", block);
    }
    segments.push_back({t, t + n, in.cache, cache.length()});
    t += n;
  }
  workspace_.reset();
  std::vector<int32_t> positions(static_cast<size_t>(t));
  Tensor x = Tensor::empty(workspace_, {t, hidden});
  for (size_t s = 0; s < batch.size(); ++s)
    for (int64_t i = 0; i < segments[s].end - segments[s].begin; ++i) {
      const int64_t row = segments[s].begin + i;
      positions[static_cast<size_t>(row)] = static_cast<int32_t>(segments[s].start + i);
      std::memcpy(x.data<float>() + row * hidden,
                  weights_.embed.data<float>() + batch[s].ids[static_cast<size_t>(i)] * hidden,
                  static_cast<size_t>(hidden) * 4);
    }
  Tensor h = Tensor::empty(workspace_, {t, hidden});
  Tensor branch = Tensor::empty(workspace_, {t, hidden});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerWeights& lw = weights_.layers[static_cast<size_t>(l)];
    ops::rms_norm(pool_, x, lw.input_norm, c.rms_norm_eps, h);
    attention(l, h, positions, segments, branch);
    ops::add_inplace(x, branch);
    ops::rms_norm(pool_, x, lw.post_attention_norm, c.rms_norm_eps, h);
    if (lw.sparse)
      sparse_ffn(l, h, branch);
    else
      dense_ffn(lw.mlp, h, branch);
    ops::add_inplace(x, branch);
  }
  std::vector<Tensor> out;
  for (size_t s = 0; s < batch.size(); ++s) {
    const Segment& seg = segments[s];
    seg.cache->set_length(seg.start + (seg.end - seg.begin));
    const int64_t rows = batch[s].all_logits ? seg.end - seg.begin : 1;
    Tensor last = x.rows(seg.end - rows, seg.end);
    Tensor normed = Tensor::empty(workspace_, {rows, hidden});
    ops::rms_norm(pool_, last, weights_.final_norm, c.rms_norm_eps, normed);
    Tensor logits = Tensor::zeros({rows, c.vocab_size});
    ops::linear(pool_, normed, weights_.lm_head, nullptr, logits);
    out.push_back(std::move(logits));
  }
  return out;
}

}  // namespace moe
