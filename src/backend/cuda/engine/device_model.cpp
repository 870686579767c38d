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

// --- a GPU's share of the attention heads under tp ---------------------------------------------
// Shares of a block-scaled matrix that are whole blocks are copied as they are (codes and
// scales), so that the GPU keeps FP8 resident; other shares are cut from a bf16 copy.

int64_t blocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }

// Whether rows [first, first + n) of a block-scaled m are whole blocks (the last may end at the
// matrix's edge); the same for columns.
bool whole_row_blocks(const DeviceMatrix& m, int64_t first, int64_t n) {
  const int64_t b = m.format.block_rows;
  return m && m.format.scaled() && first % b == 0 && (n % b == 0 || first + n == m.rows);
}
bool whole_col_blocks(const DeviceMatrix& m, int64_t first, int64_t n) {
  const int64_t b = m.format.block_cols;
  return m && m.format.scaled() && first % b == 0 && (n % b == 0 || first + n == m.cols);
}

// Device bytes of a [rows, cols] copy in `f` (codes and scales), with room for the arena's
// alignment of both pieces.
size_t copy_bytes(const WeightFormat& f, int64_t rows, int64_t cols) {
  size_t bytes = static_cast<size_t>(rows * cols) * dtype_size(f.dtype) + 2 * kDeviceAlign;
  if (f.scaled()) bytes += static_cast<size_t>(blocks_of(rows, f.block_rows) * blocks_of(cols, f.block_cols)) * 4;
  return bytes;
}

// Rows [first, first + n) of matrices of one format and width, stacked in `arena` as one matrix:
// a GPU's rows of q, k and v back to back, so that one projection runs them. In a scaled format
// every part but the last must be whole blocks (whole_row_blocks).
struct RowPart {
  const DeviceMatrix* m;
  int64_t first, n;
};
DeviceMatrix stack_rows(DeviceArena& arena, std::initializer_list<RowPart> parts) {
  const DeviceMatrix& m0 = *parts.begin()->m;
  const WeightFormat f = m0.format;
  const size_t es = dtype_size(f.dtype);
  int64_t rows = 0;
  for (const RowPart& p : parts) rows += p.n;
  char* data = arena.take<char>(static_cast<size_t>(rows * m0.cols) * es);
  float* scales = f.scaled() ? arena.take_n<float>(static_cast<size_t>(blocks_of(rows, f.block_rows) *
                                                                       blocks_of(m0.cols, f.block_cols)))
                             : nullptr;
  int64_t at = 0;
  for (const RowPart& p : parts) {
    MOE_CHECK(p.m->format == f && p.m->cols == m0.cols && p.m->count == 1, kInternal, "stacking unlike matrices");
    MOE_CUDA_CHECK(cudaMemcpy(data + at * m0.cols * static_cast<int64_t>(es),
                              static_cast<const char*>(p.m->data) + p.first * m0.cols * static_cast<int64_t>(es),
                              static_cast<size_t>(p.n * m0.cols) * es, cudaMemcpyDeviceToDevice));
    if (f.scaled()) {
      MOE_CHECK(at % f.block_rows == 0 && p.first % f.block_rows == 0, kInternal, "a row share splits a block");
      const int64_t sc = blocks_of(m0.cols, f.block_cols);
      MOE_CUDA_CHECK(cudaMemcpy(scales + at / f.block_rows * sc, p.m->scales + p.first / f.block_rows * sc,
                                static_cast<size_t>(blocks_of(p.n, f.block_rows) * sc) * 4, cudaMemcpyDeviceToDevice));
    }
    at += p.n;
  }
  DeviceMatrix out = m0;
  out.data = data;
  out.scales = scales;
  out.rows = rows;
  out.stride = 0;
  return out;
}

// Columns [first, first + width) of m (an output projection's share under tp) as a dense
// [rows, width] matrix in `arena`; in a scaled format they must be whole blocks.
DeviceMatrix gather_columns(DeviceArena& arena, const DeviceMatrix& m, int64_t first, int64_t width) {
  const WeightFormat f = m.format;
  const size_t es = dtype_size(f.dtype);
  MOE_CHECK(m.count == 1 && (!f.scaled() || whole_col_blocks(m, first, width)), kInternal,
            "columns [{}, {}) of a {} x {} matrix", first, first + width, m.rows, m.cols);
  char* data = arena.take<char>(static_cast<size_t>(m.rows * width) * es);
  MOE_CUDA_CHECK(cudaMemcpy2D(data, static_cast<size_t>(width) * es,
                              static_cast<const char*>(m.data) + first * static_cast<int64_t>(es),
                              static_cast<size_t>(m.cols) * es, static_cast<size_t>(width) * es,
                              static_cast<size_t>(m.rows), cudaMemcpyDeviceToDevice));
  DeviceMatrix out = m;
  out.data = data;
  out.cols = width;
  out.stride = 0;
  if (f.scaled()) {
    const int64_t sc = blocks_of(m.cols, f.block_cols), wc = blocks_of(width, f.block_cols),
                  rb = blocks_of(m.rows, f.block_rows);
    float* scales = arena.take_n<float>(static_cast<size_t>(rb * wc));
    MOE_CUDA_CHECK(cudaMemcpy2D(scales, static_cast<size_t>(wc) * 4, m.scales + first / f.block_cols,
                                static_cast<size_t>(sc) * 4, static_cast<size_t>(wc) * 4, static_cast<size_t>(rb),
                                cudaMemcpyDeviceToDevice));
    out.scales = scales;
  }
  return out;
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
  // How each layer's attention heads are cut for this GPU under tp: a block-scaled matrix whose
  // share is whole blocks stays FP8 (its codes and scales copied or viewed), any other is cut
  // from a bf16 copy of the whole matrix.
  const bool mla = mc.attention == AttentionKind::kMla;
  const int64_t hd = mc.head_dim, qw_local = q_heads * hd, kw_local = kv_heads * hd;
  const int64_t qk = mla ? mc.mla.qk_head_dim() : 0, vd = mla ? mc.mla.v_head_dim : 0;
  const int64_t kv_b_rows = mla ? mc.mla.qk_nope_head_dim + mc.mla.v_head_dim : 0;  // per head
  struct Shares {
    bool qkv = false;   // grouped-query: this GPU's rows of q, k and v
    bool o = false;     // its columns of the output projection
    bool q_b = false;   // latent: its rows of q_b (or q)
    bool kv_b = false;  // latent: only its heads of kv_b widened for the absorbed products
  };
  auto shares_of = [&](const AttentionWeights& a) {
    Shares x;
    if (!split_heads) return x;
    const DeviceMatrix q = matrix(a.q), k = matrix(a.k), v = matrix(a.v), o = matrix(a.o);
    const int64_t br = q ? q.format.block_rows : 0;
    if (mla) {
      const DeviceMatrix q_b = matrix(a.q_a.defined() ? a.q_b : a.q);
      x.q_b = whole_row_blocks(q_b, q_first * qk, q_heads * qk);
      x.kv_b = whole_row_blocks(matrix(a.kv_b), q_first * kv_b_rows, q_heads * kv_b_rows);
      x.o = whole_col_blocks(o, q_first * vd, q_heads * vd);
    } else {
      x.qkv = k && v && q.format == k.format && k.format == v.format && q.cols == k.cols && k.cols == v.cols &&
              whole_row_blocks(q, q_first * hd, qw_local) && qw_local % br == 0 &&
              whole_row_blocks(k, kv_first * hd, kw_local) && kw_local % br == 0 &&
              whole_row_blocks(v, kv_first * hd, kw_local);
      x.o = whole_col_blocks(o, q_first * hd, qw_local);
    }
    return x;
  };
  {
    // Size `widened` for what as_bf16 will be given below, and `derived` for the copies.
    size_t bytes = 256 + widened_bytes(matrix(w.embed)), derived = 256;
    for (const LayerWeights& lw : w.layers) {
      const AttentionWeights& a = lw.attn;
      const Shares x = shares_of(a);
      const DeviceMatrix kv_b = matrix(a.kv_b);
      bytes += (x.kv_b ? widened_bytes(kv_b.row_slice(q_first * kv_b_rows, q_heads * kv_b_rows)) : widened_bytes(kv_b)) +
               widened_bytes(lw.sparse ? matrix(lw.moe.router) : DeviceMatrix{});
      const WeightFormat bf16{};
      if (mla) {
        derived += static_cast<size_t>(q_heads * mc.mla.kv_lora_rank * mc.mla.qk_nope_head_dim) * 2 + kDeviceAlign;
        if (!split_heads) continue;
        const DeviceMatrix q_b = matrix(a.q_a.defined() ? a.q_b : a.q);
        if (!x.q_b) bytes += widened_bytes(q_b);
        if (!x.o) bytes += widened_bytes(matrix(a.o));
        derived += copy_bytes(x.o ? matrix(a.o).format : bf16, mc.hidden_size, q_heads * vd);
      } else if (split_heads) {
        if (!x.qkv)
          for (const Tensor* t : {&a.q, &a.k, &a.v}) bytes += widened_bytes(matrix(*t));
        if (!x.o) bytes += widened_bytes(matrix(a.o));
        derived += copy_bytes(x.qkv ? matrix(a.q).format : bf16, qw_local + 2 * kw_local, mc.hidden_size) +
                   copy_bytes(x.o ? matrix(a.o).format : bf16, mc.hidden_size, qw_local);
      }
    }
    model->widened = DeviceArena("widened FP8 weights", bytes);
    if (derived > 256) model->derived = DeviceArena(mla ? "derived weights" : "attention slices", derived);
  }
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
    d.qkv_fused = adjacent(d.q, d.k) && adjacent(d.k, d.v);
    if (d.qkv_fused) d.q.rows += d.k.rows + d.v.rows;  // one projection over the three
    const Shares x = shares_of(a);
    if (split_heads && !mla) {
      // Rows of q, k and v are contiguous per head: this GPU's back to back, one projection; the
      // output projection's columns are not, so they are gathered.
      const DeviceMatrix q = x.qkv ? matrix(a.q) : as_bf16(matrix(a.q)), k = x.qkv ? matrix(a.k) : as_bf16(matrix(a.k)),
                         v = x.qkv ? matrix(a.v) : as_bf16(matrix(a.v));
      d.q = stack_rows(model->derived, {{&q, q_first * hd, qw_local}, {&k, kv_first * hd, kw_local},
                                        {&v, kv_first * hd, kw_local}});
      d.k = d.q.row_slice(qw_local, kw_local);
      d.v = d.q.row_slice(qw_local + kw_local, kw_local);
      d.qkv_fused = true;
      d.o = gather_columns(model->derived, x.o ? matrix(a.o) : as_bf16(matrix(a.o)), q_first * hd, qw_local);
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
      const int64_t kv_b_head = kv_b_rows * m.kv_lora_rank;
      d.q_a = matrix(a.q_a);
      d.q_a_norm = f32(a.q_a_norm);
      const DeviceMatrix q_b = matrix(d.q_a ? a.q_b : a.q);
      (d.q_a ? d.q_b : d.q) = (split_heads && !x.q_b ? as_bf16(q_b) : q_b).row_slice(q_first * qk, q_heads * qk);
      d.kv_a = matrix(a.kv_a);
      d.kv_a_norm = f32(a.kv_a_norm);
      const DeviceMatrix kv_b_all = matrix(a.kv_b);
      const uint16_t* kv_b =
          x.kv_b ? as_bf16(kv_b_all.row_slice(q_first * kv_b_rows, q_heads * kv_b_rows)).bf16_data("latent attention")
                 : as_bf16(kv_b_all).bf16_data("latent attention") + q_first * kv_b_head;
      d.uv = DeviceMatrix::bf16(kv_b + m.qk_nope_head_dim * m.kv_lora_rank, m.v_head_dim, m.kv_lora_rank, q_heads,
                                kv_b_head);
      uint16_t* uk_t = model->derived.take_n<uint16_t>(static_cast<size_t>(q_heads * m.kv_lora_rank * m.qk_nope_head_dim));
      MOE_CUDA_CHECK(kernels::extract_uk_transposed(kv_b, static_cast<int>(q_heads),
                                                    static_cast<int>(m.qk_nope_head_dim),
                                                    static_cast<int>(m.v_head_dim),
                                                    static_cast<int>(m.kv_lora_rank), uk_t, nullptr));
      d.uk_t = DeviceMatrix::bf16(uk_t, m.kv_lora_rank, m.qk_nope_head_dim, q_heads);
      if (split_heads) d.o = gather_columns(model->derived, x.o ? d.o : as_bf16(d.o), q_first * vd, q_heads * vd);
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
