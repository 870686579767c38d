#include "model/model.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "backend/cpu/kernels.h"
#include "io/checkpoint.h"
#include "moe/errors.h"
#include "ops/ops.h"

namespace moe {

Model::Model(std::string dir, ModelConfig config, int threads)
    : dir_(std::move(dir)),
      config_(std::move(config)),
      pool_(threads),
      weights_arena_("weights", 64 << 20),
      workspace_("workspace", 16 << 20) {}

std::unique_ptr<Model> Model::load(const std::string& dir, const LoadOptions& opts) {
  ModelConfig mc = load_model_config(dir);
  std::unique_ptr<Model> model(new Model(dir, mc, opts.threads));
  Checkpoint ckpt(dir);
  WeightLoader loader(ckpt, model->weights_arena_, opts.strict);
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
  model->weights_ = load_weights(mc, loader, model->weights_arena_);
  loader.finish();
  if (draw) std::fprintf(stderr, "\n");

  const int64_t hd = mc.head_dim;
  for (int64_t i = 0; i < hd / 2; ++i) {
    // As transformers computes it: in f32, base ** (2i / d), then the reciprocal.
    float exponent = static_cast<float>(2 * i) / static_cast<float>(hd);
    model->inv_freq_.push_back(1.0f / std::pow(mc.rope_theta, exponent));
  }
  model->expert_tokens_.assign(static_cast<size_t>(mc.num_layers), {});
  for (int64_t l = 0; l < mc.num_layers; ++l)
    if (mc.moe_layers[static_cast<size_t>(l)])
      model->expert_tokens_[static_cast<size_t>(l)].assign(static_cast<size_t>(mc.moe.num_experts), 0);
  return model;
}

KvCache Model::new_cache(int64_t capacity) const {
  if (capacity <= 0) capacity = config_.max_position_embeddings;
  const int64_t width = config_.num_kv_heads * config_.head_dim;
  return KvCache(config_.num_layers, capacity, width, width);
}

void Model::attention(int64_t layer, const Tensor& h, const std::vector<int32_t>& positions,
                      KvCache& cache, Tensor& out) {
  const ModelConfig& c = config_;
  const AttentionWeights& w = weights_.layers[static_cast<size_t>(layer)].attn;
  const int64_t t = h.dim(0), hd = c.head_dim, start = cache.length();
  Tensor q = Tensor::empty(workspace_, {t, c.num_heads * hd});
  Tensor k = Tensor::empty(workspace_, {t, c.num_kv_heads * hd});
  Tensor v = Tensor::empty(workspace_, {t, c.num_kv_heads * hd});
  ops::linear(pool_, h, w.q, c.attention_bias ? &w.q_bias : nullptr, q);
  ops::linear(pool_, h, w.k, c.attention_bias ? &w.k_bias : nullptr, k);
  ops::linear(pool_, h, w.v, c.attention_bias ? &w.v_bias : nullptr, v);
  if (c.qk_norm) {
    ops::rms_norm_groups(pool_, q, w.q_norm, c.rms_norm_eps);
    ops::rms_norm_groups(pool_, k, w.k_norm, c.rms_norm_eps);
  }
  auto rope = c.rope_style == RopeStyle::kHalf ? cpu::rope_half : cpu::rope_interleaved;
  rope(q.data<float>(), t, c.num_heads, hd, hd, positions.data(), inv_freq_.data());
  rope(k.data<float>(), t, c.num_kv_heads, hd, hd, positions.data(), inv_freq_.data());
  const int64_t width = c.num_kv_heads * hd;
  std::memcpy(cache.k(layer) + start * width, k.data<float>(), k.nbytes());
  std::memcpy(cache.v(layer) + start * width, v.data<float>(), v.nbytes());
  Tensor attn = Tensor::empty(workspace_, {t, c.num_heads * hd});
  cpu::attention(pool_, q.data<float>(), cache.k(layer), cache.v(layer), attn.data<float>(), t,
                 start + t, c.num_heads, c.num_kv_heads, hd, hd, width, width,
                 1.0f / std::sqrt(static_cast<float>(hd)));
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
  const int64_t t = h.dim(0), hidden = c.hidden_size, n_exp = c.moe.num_experts, k = c.moe.top_k;
  Tensor probs = Tensor::empty(workspace_, {t, n_exp});
  ops::linear(pool_, h, w.router, nullptr, probs);
  cpu::softmax_rows(probs.data<float>(), t, n_exp);
  // Top-k per token; ties go to the lower expert index, so routing is deterministic.
  std::vector<std::vector<std::pair<int64_t, float>>> per_expert(static_cast<size_t>(n_exp));
  std::vector<int64_t> order(static_cast<size_t>(n_exp));
  for (int64_t i = 0; i < t; ++i) {
    const float* p = probs.data<float>() + i * n_exp;
    for (int64_t e = 0; e < n_exp; ++e) order[static_cast<size_t>(e)] = e;
    std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t a, int64_t b) {
      return p[a] > p[b] || (p[a] == p[b] && a < b);
    });
    float sum = 0.0f;
    for (int64_t j = 0; j < k; ++j) sum += p[order[static_cast<size_t>(j)]];
    for (int64_t j = 0; j < k; ++j) {
      int64_t e = order[static_cast<size_t>(j)];
      float weight = c.moe.norm_topk_prob ? p[e] / sum : p[e];
      per_expert[static_cast<size_t>(e)].push_back({i, weight});
    }
  }
  std::memset(out.raw(), 0, out.nbytes());
  auto& stats = expert_tokens_[static_cast<size_t>(layer)];
  for (int64_t e = 0; e < n_exp; ++e) {
    const auto& tokens = per_expert[static_cast<size_t>(e)];
    if (tokens.empty()) continue;
    stats[static_cast<size_t>(e)] += static_cast<int64_t>(tokens.size());
    const FfnWeights& expert = w.experts[static_cast<size_t>(e)];
    MOE_CHECK(expert.defined(), kInternal, "layer {}: expert {} is routed to but not loaded", layer,
              e);
    const int64_t n = static_cast<int64_t>(tokens.size());
    Tensor xin = Tensor::empty(workspace_, {n, hidden});
    for (int64_t j = 0; j < n; ++j)
      std::memcpy(xin.data<float>() + j * hidden, h.data<float>() + tokens[static_cast<size_t>(j)].first * hidden,
                  static_cast<size_t>(hidden) * 4);
    Tensor y = Tensor::empty(workspace_, {n, hidden});
    dense_ffn(expert, xin, y);
    for (int64_t j = 0; j < n; ++j) {
      auto [row, weight] = tokens[static_cast<size_t>(j)];
      float* o = out.data<float>() + row * hidden;
      const float* yr = y.data<float>() + j * hidden;
      for (int64_t d = 0; d < hidden; ++d) o[d] += weight * yr[d];
    }
  }
}

Tensor Model::forward(std::span<const int32_t> ids, KvCache& cache, bool all_logits) {
  const ModelConfig& c = config_;
  const int64_t t = static_cast<int64_t>(ids.size()), hidden = c.hidden_size;
  MOE_CHECK(t > 0, kInvalidArgument, "empty input: at least one token is needed");
  for (int32_t id : ids)
    MOE_CHECK(id >= 0 && id < c.vocab_size, kInvalidArgument,
              "token id {} is outside the vocabulary [0, {})", id, c.vocab_size);
  const int64_t start = cache.length();
  MOE_CHECK(start + t <= cache.capacity(), kInvalidArgument,
            "context full: {} cached + {} new tokens exceed the capacity of {}", start, t,
            cache.capacity());
  MOE_CHECK(cache.k_width() == c.num_kv_heads * c.head_dim, kInvalidArgument,
            "KV cache was made for another model");
  workspace_.reset();
  std::vector<int32_t> positions(static_cast<size_t>(t));
  for (int64_t i = 0; i < t; ++i) positions[static_cast<size_t>(i)] = static_cast<int32_t>(start + i);

  Tensor x = Tensor::empty(workspace_, {t, hidden});
  for (int64_t i = 0; i < t; ++i)
    std::memcpy(x.data<float>() + i * hidden, weights_.embed.data<float>() + ids[static_cast<size_t>(i)] * hidden,
                static_cast<size_t>(hidden) * 4);
  Tensor h = Tensor::empty(workspace_, {t, hidden});
  Tensor branch = Tensor::empty(workspace_, {t, hidden});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const LayerWeights& lw = weights_.layers[static_cast<size_t>(l)];
    ops::rms_norm(pool_, x, lw.input_norm, c.rms_norm_eps, h);
    attention(l, h, positions, cache, branch);
    ops::add_inplace(x, branch);
    ops::rms_norm(pool_, x, lw.post_attention_norm, c.rms_norm_eps, h);
    if (lw.sparse)
      sparse_ffn(l, h, branch);
    else
      dense_ffn(lw.mlp, h, branch);
    ops::add_inplace(x, branch);
  }
  cache.set_length(start + t);

  const int64_t rows = all_logits ? t : 1;
  Tensor last = x.rows(t - rows, t);
  Tensor normed = Tensor::empty(workspace_, {rows, hidden});
  ops::rms_norm(pool_, last, weights_.final_norm, c.rms_norm_eps, normed);
  Tensor logits = Tensor::zeros({rows, c.vocab_size});
  ops::linear(pool_, normed, weights_.lm_head, nullptr, logits);
  return logits;
}

}  // namespace moe
