#include "backend/cuda/engine/device_model.h"

#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>

#include "backend/cuda/engine/weight_store.h"
#include "backend/cuda/ops/fill_launch.h"
#include "backend/cuda/ops/fp8_blocks_launch.h"
#include "backend/cuda/attention/latent_attention_launch.h"
#include "core/arena.h"
#include "io/checkpoint.h"
#include "model/model.h"
#include "model/weights.h"
#include "moe/errors.h"
#include "moe/placement.h"

namespace moe::cuda {
namespace {

// The FP8 matrices a consumer reads only as bf16 (the embedding lookup, the router, the latent
// attention's absorbed per-head products, the slices of a tensor-parallel split): their bytes.
size_t widened_bytes(const DeviceMatrix& m) {
  return m && m.format.scaled() ? static_cast<size_t>(m.count * m.rows * m.cols) * 2 + 256 : 0;
}

// Whether b starts where a ends, in one format (scales too), so that one projection can run both.
bool adjacent(const DeviceMatrix& a, const DeviceMatrix& b) {
  if (!a || !b || a.format != b.format || a.cols != b.cols || a.count != 1 || b.count != 1) return false;
  const WeightFormat& f = a.format;
  if (b.data != static_cast<const char*>(a.data) + a.rows * a.cols * static_cast<int64_t>(dtype_size(f.dtype)))
    return false;
  if (!f.scaled()) return true;
  const int64_t scale_cols = (a.cols + f.block_cols - 1) / f.block_cols;
  return a.rows % f.block_rows == 0 && b.scales == a.scales + a.rows / f.block_rows * scale_cols;
}

}  // namespace

void check_cuda_supported(const ModelConfig& mc) {
  if (mc.attention == AttentionKind::kMla) {
    const MlaConfig& m = mc.mla;
    MOE_CHECK(m.kv_lora_rank % 8 == 0 && m.kv_lora_rank <= kernels::kLatentMaxLora &&
                  m.qk_rope_head_dim % 8 == 0 && m.qk_rope_head_dim <= kernels::kLatentMaxRope &&
                  m.qk_nope_head_dim % 2 == 0 && m.qk_nope_head_dim <= kernels::kLatentMaxNope,
              kUnsupported,
              "{}: latent attention on CUDA needs kv_lora_rank and qk_rope_head_dim multiples of 8 "
              "(at most {} and {}) and an even qk_nope_head_dim (at most {}); got {}, {}, {}",
              mc.architecture, kernels::kLatentMaxLora, kernels::kLatentMaxRope, kernels::kLatentMaxNope,
              m.kv_lora_rank, m.qk_rope_head_dim, m.qk_nope_head_dim);
    return;
  }
  MOE_CHECK(!mc.o_bias, kUnsupported,
            "{}: an output-projection bias (attention_bias) is not on the CUDA path yet", mc.architecture);
  MOE_CHECK(mc.head_dim % 2 == 0 && mc.head_dim <= 256, kUnsupported,
            "{}: head_dim {} is not supported on CUDA (even, at most 256)", mc.architecture, mc.head_dim);
}

void check_parallel_supported(const ModelConfig& mc, int ranks, int tp) {
  MOE_CHECK(ranks >= 1, kInvalidArgument, "the number of GPUs must be at least 1, got {}", ranks);
  if (ranks == 1) return;
  MOE_CHECK(mc.num_moe_layers() > 0, kInvalidArgument,
            "{} GPUs: expert parallelism needs a mixture-of-experts model; {} has no routed experts",
            ranks, mc.architecture);
  MOE_CHECK(mc.moe.num_experts >= ranks, kInvalidArgument, "ep {} is larger than the number of experts {}",
            ranks, mc.moe.num_experts);
  if (tp <= 1) return;
  MOE_CHECK(mc.qk_norm != QkNorm::kFull, kUnsupported,
            "{}: its q/k norm spans every head, which tensor-parallel attention cannot split; use --tp 1",
            mc.architecture);
  MOE_CHECK(mc.num_heads % tp == 0 && (mc.num_kv_heads % tp == 0 || tp % mc.num_kv_heads == 0),
            kUnsupported,
            "tp {}: {} attention heads and {} key/value heads do not split over {} GPUs (the heads must "
            "divide evenly; key/value heads divide or are replicated)",
            tp, mc.num_heads, mc.num_kv_heads, tp);
}

std::unique_ptr<DeviceModel> load_device_model(const std::string& dir, const ModelConfig& mc,
                                               const DeviceLoad& opts) {
  check_cuda_supported(mc);
  check_parallel_supported(mc, opts.ranks, opts.tp);
  MOE_CUDA_CHECK(cudaSetDevice(opts.device));
  ExpertSelection selection;
  int64_t first_expert = 0, local_experts = mc.moe.num_experts;
  if (opts.ranks > 1) {
    const ExpertPlacement placement(mc.moe.num_experts, opts.ranks, opts.rank);
    selection.global_to_local = placement.global_to_local();
    first_expert = placement.first_expert();
    local_experts = placement.num_local();
  }
  const bool split_heads = opts.tp > 1;
  const int64_t share = opts.rank % opts.tp;  // of the heads of this rank's attention group
  const int64_t q_heads = split_heads ? mc.num_heads / opts.tp : mc.num_heads;
  const int64_t kv_heads = !split_heads ? mc.num_kv_heads
                           : mc.num_kv_heads >= opts.tp ? mc.num_kv_heads / opts.tp : 1;
  const int64_t q_first = split_heads ? share * q_heads : 0;
  // A rank's key/value heads: its share, or the one head its query heads are grouped on.
  const int64_t kv_first = !split_heads ? 0
                           : mc.num_kv_heads >= opts.tp ? share * kv_heads
                                                           : q_first / (mc.num_heads / mc.num_kv_heads);
  // Size the layout from the state-dict keys: every allocation is at most 63 bytes of padding.
  const auto keys = state_dict_keys(mc, selection);
  size_t host_bytes = 4096;
  for (const auto& [name, shape] : keys) {
    size_t n = 4;
    for (int64_t d : shape) n *= static_cast<size_t>(d);
    host_bytes += n + 64;
  }
  auto layout = Arena::address_space("weight layout", host_bytes);
  auto model = std::make_unique<DeviceModel>();
  model->store = std::make_unique<WeightStore>(mc.quant.fp8, host_bytes / 2);
  WeightStore& store = *model->store;

  ModelWeights w;
  if (opts.random_weights) {
    WeightLoader loader(*layout, opts.seed);
    loader.set_sink(&store);
    if (mc.quant.fp8) loader.set_fp8_blocks(mc.quant.block_rows, mc.quant.block_cols, mc.quant.modules_to_not_convert);
    w = load_weights(mc, loader, selection);
  } else {
    Checkpoint ckpt(dir);
    WeightLoader loader(ckpt, *layout, opts.strict);
    loader.set_sink(&store);
    if (mc.quant.fp8) loader.set_fp8_blocks(mc.quant.block_rows, mc.quant.block_cols, mc.quant.modules_to_not_convert);
    const bool draw = opts.progress && isatty(STDERR_FILENO) && ckpt.total_bytes() >= (64u << 20);
    int last = -1;
    if (draw)
      loader.on_progress = [&](uint64_t done, uint64_t total) {
        const int percent = static_cast<int>(100.0 * static_cast<double>(done) / static_cast<double>(total));
        if (percent == last) return;
        last = percent;
        std::fprintf(stderr, "\rloading weights to the GPU: %3d%% (%.2f / %.2f GB)", percent,
                     done / 1e9, total / 1e9);
        std::fflush(stderr);
      };
    w = load_weights(mc, loader, selection);
    loader.finish();
    check_fp8_found(mc, loader, dir);
    if (draw) std::fprintf(stderr, "\n");
    const int64_t widened = loader.fp8_tensors() - store.fp8_pieces();
    if (widened > 0 && opts.rank == 0)
      std::fprintf(stderr,
                   "note: %lld FP8 weights are held as bf16 on the GPU: fused with a part that is not FP8 or "
                   "that starts inside a %lld-row block\n",
                   static_cast<long long>(widened), static_cast<long long>(mc.quant.block_rows));
    if (opts.rank == 0) note_skipped_mtp(mc, w);
  }
  store.finish();

  // Rank-1 tensors as f32: each was written to the host layout as well.
  size_t small_bytes = 4096 + static_cast<size_t>(mc.head_dim) * 2;
  for (const auto& [name, shape] : keys)
    if (shape.size() == 1) small_bytes += static_cast<size_t>(shape[0]) * 4 + 256;
  small_bytes += static_cast<size_t>(mc.num_layers) *
                 (static_cast<size_t>((mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim) * 4 + 256);
  model->small = DeviceArena("norms", small_bytes);
  auto upload_f32 = [&](const float* host, size_t count) -> const float* {
    float* d = model->small.take_n<float>(count);
    MOE_CUDA_CHECK(cudaMemcpy(d, host, count * 4, cudaMemcpyHostToDevice));
    return d;
  };
  auto f32 = [&](const Tensor& t) -> const float* {
    return t.defined() ? upload_f32(t.data<float>(), static_cast<size_t>(t.numel())) : nullptr;
  };
  // A loaded matrix as the kernels take it: [rows, cols], or count x [rows, cols] for a 3-D
  // tensor (a layer's experts), in its format; empty for a tensor the model does not have.
  auto matrix = [&](const Tensor& t) -> DeviceMatrix { return store.matrix(t); };
  // The same in bf16, for consumers that read nothing else: FP8 ones widened into `widened`.
  auto as_bf16 = [&](const DeviceMatrix& m) -> DeviceMatrix {
    if (!m || !m.format.scaled()) return m;
    uint16_t* out = model->widened.take_n<uint16_t>(static_cast<size_t>(m.count * m.rows * m.cols));
    MOE_CUDA_CHECK(kernels::dequantize_fp8_blocks(static_cast<const uint8_t*>(m.data), m.scales, m.count, m.rows,
                                                  m.cols, static_cast<int>(m.format.block_rows),
                                                  static_cast<int>(m.format.block_cols), out, nullptr));
    return DeviceMatrix::bf16(out, m.rows, m.cols, m.count);
  };
  {
    // Size `widened` for what as_bf16 will be given below.
    size_t bytes = 256 + widened_bytes(matrix(w.embed));
    for (const LayerWeights& lw : w.layers) {
      bytes += widened_bytes(matrix(lw.attn.kv_b)) + widened_bytes(lw.sparse ? matrix(lw.moe.router) : DeviceMatrix{});
      if (split_heads)
        for (const Tensor* t : {&lw.attn.q, &lw.attn.k, &lw.attn.v, &lw.attn.o, &lw.attn.q_b})
          bytes += widened_bytes(matrix(*t));
    }
    model->widened = DeviceArena("widened FP8 weights", bytes);
  }
  // Columns [first, first + width) of a [hidden, columns] matrix (an output projection's share
  // under tp), as a dense [hidden, width] matrix in the derived arena.
  auto gather_columns = [&](const DeviceMatrix& m, int64_t first, int64_t width) -> DeviceMatrix {
    const uint16_t* from = m.bf16_data("a split output projection");
    uint16_t* out = model->derived.take_n<uint16_t>(static_cast<size_t>(m.rows * width));
    MOE_CUDA_CHECK(cudaMemcpy2D(out, static_cast<size_t>(width) * 2, from + first, static_cast<size_t>(m.cols) * 2,
                                static_cast<size_t>(width) * 2, static_cast<size_t>(m.rows), cudaMemcpyDeviceToDevice));
    return DeviceMatrix::bf16(out, m.rows, width);
  };

  // Weights rearranged at load, per layer. Latent attention: this rank's heads' absorbed keys,
  // and under tp its columns of the output projection. Grouped-query attention under tp: the
  // rank's rows of q, k and v back to back (one projection, as on one GPU) and its columns of
  // the output projection, each gathered into a dense matrix.
  const bool mla = mc.attention == AttentionKind::kMla;
  size_t derived_per_layer = 0;
  if (mla)
    derived_per_layer = static_cast<size_t>(q_heads * mc.mla.kv_lora_rank * mc.mla.qk_nope_head_dim) * 2 +
                        (split_heads ? static_cast<size_t>(mc.hidden_size * q_heads * mc.mla.v_head_dim) * 2 : 0);
  else if (split_heads)
    derived_per_layer = static_cast<size_t>(mc.hidden_size * (2 * q_heads + 2 * kv_heads) * mc.head_dim) * 2;
  if (derived_per_layer)
    model->derived = DeviceArena(mla ? "derived weights" : "attention slices",
                                 static_cast<size_t>(mc.num_layers) * (derived_per_layer + 512) + 256);
  model->q_heads = q_heads;
  model->kv_heads = kv_heads;
  model->first_expert = first_expert;
  model->local_experts = local_experts;
  model->embed = as_bf16(matrix(w.embed));
  model->lm_head = matrix(w.lm_head);
  model->final_norm = f32(w.final_norm);
  const RopeTable rope = mc.rope();  // the CPU engine's table (model/rope.h)
  model->inv_freq = upload_f32(rope.inv_freq.data(), rope.inv_freq.size());
  model->rope_cos_sin_scale = rope.cos_sin_scale;

  for (int64_t l = 0; l < mc.num_layers; ++l) {
    const LayerWeights& lw = w.layers[static_cast<size_t>(l)];
    DeviceLayer d;
    d.input_norm = f32(lw.input_norm);
    d.post_norm = f32(lw.post_attention_norm);
    const AttentionWeights& a = lw.attn;
    d.q = matrix(a.q);
    d.k = matrix(a.k);
    d.v = matrix(a.v);
    d.o = matrix(a.o);
    if (split_heads) {  // sliced below, in bf16
      d.q = as_bf16(d.q);
      d.k = as_bf16(d.k);
      d.v = as_bf16(d.v);
      d.o = as_bf16(d.o);
    }
    d.qkv_fused = adjacent(d.q, d.k) && adjacent(d.k, d.v);
    if (d.qkv_fused) d.q.rows += d.k.rows + d.v.rows;  // one projection over the three
    const int64_t hd = mc.head_dim;
    if (split_heads && !mla) {
      // Rows of q, k and v are contiguous per head; the output projection's columns are not.
      const int64_t qw_local = q_heads * hd, kw_local = kv_heads * hd;
      const size_t row = static_cast<size_t>(mc.hidden_size) * 2;
      uint16_t* qkv = model->derived.take_n<uint16_t>(static_cast<size_t>((qw_local + 2 * kw_local) * mc.hidden_size));
      const uint16_t *q = d.q.bf16_data("split attention"), *k = d.k.bf16_data("split attention"),
                     *v = d.v.bf16_data("split attention");
      MOE_CUDA_CHECK(cudaMemcpy(qkv, q + q_first * hd * mc.hidden_size, static_cast<size_t>(qw_local) * row,
                                cudaMemcpyDeviceToDevice));
      MOE_CUDA_CHECK(cudaMemcpy(qkv + qw_local * mc.hidden_size, k + kv_first * hd * mc.hidden_size,
                                static_cast<size_t>(kw_local) * row, cudaMemcpyDeviceToDevice));
      MOE_CUDA_CHECK(cudaMemcpy(qkv + (qw_local + kw_local) * mc.hidden_size, v + kv_first * hd * mc.hidden_size,
                                static_cast<size_t>(kw_local) * row, cudaMemcpyDeviceToDevice));
      d.q = DeviceMatrix::bf16(qkv, qw_local + 2 * kw_local, mc.hidden_size);  // q, k and v rows
      d.k = d.q.row_slice(qw_local, kw_local);
      d.v = d.q.row_slice(qw_local + kw_local, kw_local);
      d.qkv_fused = true;
      d.o = gather_columns(d.o, q_first * hd, qw_local);
    }
    if (mc.qkv_bias) {
      std::vector<float> bias;
      const std::pair<const Tensor*, int64_t> parts[] = {{&a.q_bias, q_first * hd}, {&a.k_bias, kv_first * hd},
                                                         {&a.v_bias, kv_first * hd}};
      for (const auto& [b, first] : parts) {
        const int64_t width = (b == &a.q_bias ? q_heads : kv_heads) * hd;
        bias.insert(bias.end(), b->data<float>() + first, b->data<float>() + first + width);
      }
      d.qkv_bias = upload_f32(bias.data(), bias.size());
    }
    d.q_norm = f32(a.q_norm);
    d.k_norm = f32(a.k_norm);
    if (mla) {
      // Every rank computes the whole latent (kv_a, its norm, the cache): it is shared by all
      // heads and small. Under tp a rank runs its heads only: their rows of the query
      // projection and of kv_b (each contiguous per head), and their columns of o.
      const MlaConfig& m = mc.mla;
      const int64_t qk = m.qk_head_dim(), kv_b_head = (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank;
      d.q_a = matrix(a.q_a);
      d.q_a_norm = f32(a.q_a_norm);
      if (d.q_a) d.q_b = (split_heads ? as_bf16(matrix(a.q_b)) : matrix(a.q_b)).row_slice(q_first * qk, q_heads * qk);
      else d.q = d.q.row_slice(q_first * qk, q_heads * qk);
      d.kv_a = matrix(a.kv_a);
      d.kv_a_norm = f32(a.kv_a_norm);
      const uint16_t* kv_b = as_bf16(matrix(a.kv_b)).bf16_data("latent attention") + q_first * kv_b_head;
      d.uv = DeviceMatrix::bf16(kv_b + m.qk_nope_head_dim * m.kv_lora_rank, m.v_head_dim, m.kv_lora_rank, q_heads,
                                kv_b_head);
      uint16_t* uk_t = model->derived.take_n<uint16_t>(static_cast<size_t>(q_heads * m.kv_lora_rank * m.qk_nope_head_dim));
      MOE_CUDA_CHECK(kernels::extract_uk_transposed(kv_b, static_cast<int>(q_heads),
                                                    static_cast<int>(m.qk_nope_head_dim),
                                                    static_cast<int>(m.v_head_dim),
                                                    static_cast<int>(m.kv_lora_rank), uk_t, nullptr));
      d.uk_t = DeviceMatrix::bf16(uk_t, m.kv_lora_rank, m.qk_nope_head_dim, q_heads);
      if (split_heads) d.o = gather_columns(as_bf16(d.o), q_first * m.v_head_dim, q_heads * m.v_head_dim);
    }
    d.sparse = lw.sparse;
    if (lw.sparse) {
      const MoeWeights& m = lw.moe;
      d.router = as_bf16(matrix(m.router));
      d.router_bias = f32(m.router_bias);
      ExpertShape shape{m.experts.num_local, m.experts.hidden, m.experts.inter, mc.moe.top_k};
      d.expert_gate_up = matrix(m.experts.gate_up);
      d.expert_down = matrix(m.experts.down);
      d.experts = std::make_unique<Experts>(d.expert_gate_up, d.expert_down, shape, opts.max_tokens, opts.device);
      d.shared_gate_up = matrix(m.shared.gate_up);
      d.shared_down = matrix(m.shared.down);
      d.shared_gate = matrix(m.shared_gate);
    } else {
      d.mlp_gate_up = matrix(lw.mlp.gate_up);
      d.mlp_down = matrix(lw.mlp.down);
    }
    model->layers.push_back(std::move(d));
  }
  MOE_CUDA_CHECK(cudaDeviceSynchronize());
  return model;
}

}  // namespace moe::cuda
