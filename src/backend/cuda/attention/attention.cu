// Attention over a paged KV cache (attention_launch.h), bf16 in and out, f32 softmax and
// accumulation: the checks of a call, the choice of its kernel and the size of its workspace.
//
// Four kernels, each correct for every input it runs (decode rows, prefill rows, mixed batches), a
// file each:
// - attention_row.cu: one block per (query row, group of query heads sharing a kv head, context
//   split), plain f32 FMAs; long contexts split and merged (flash-decoding). The reference, and
//   the path for head dims the others lack.
// - attention_decode.cu: the same decomposition with the group's heads as the rows of mma.sync
//   tiles, K/V streamed by cp.async per warp, and the split count chosen per row on the device.
// - attention_tiled.cu: one block per (64 rows of one sequence, one query head), key tiles of 64
//   on mma.sync tensor cores (FlashAttention-2 layout): prefill.
// - attention_wgmma.cu: one block per (128 rows of one sequence, one query head), key tiles of 128
//   on wgmma through a three-stage ring: prefill on compute capability 9.0 at head dim 128.
// Sequence lengths are read on the device; the host sizes only bound the grid. The kernels share
// attention_device.cuh; the three tensor-core ones share mma_sync.cuh and online_softmax.cuh with
// the latent attention kernel (latent_attention.cu).
// Only CUDA headers here.
#include <cuda_runtime.h>

#include <cstddef>

#include "backend/cuda/attention/attention_launch.h"
#include "backend/cuda/attention/attention_paths.h"

namespace moe::cuda::kernels {

size_t paged_attention_workspace_bytes(int tokens, int q_heads, int head_dim, int max_context, int split_keys) {
  // The worst case over every call with at most `tokens` rows: fewer rows may use more splits.
  size_t worst = 0;
  for (int t = 1; t <= tokens; ++t) {
    const int row = attention_detail::choose_row_splits(t, max_context);
    const int dec = attention_detail::plan_decode(t, max_context, split_keys).splits;
    const int s = row > dec ? row : dec;
    if (s > 1 && (size_t)t * s > worst) worst = (size_t)t * s;
  }
  return worst * q_heads * (head_dim + 2) * sizeof(float);
}

bool paged_attention_has_tiled(int head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128;
}

bool paged_attention_has_decode(int head_dim) {
  return head_dim == 32 || head_dim == 64 || head_dim == 128;
}

bool paged_attention_has_wgmma(int head_dim) {
  return head_dim == attention_detail::kWgmmaHeadDim && attention_detail::wgmma_attention_device();
}

AttentionPath paged_attention_auto_path(int tokens, int num_seqs, int head_dim, bool wgmma_device) {
  // Rows per sequence on average: decode has one, prefill hundreds. Below 16 most 64-row tiles
  // would be padding. The wgmma kernel takes a call only where sequences average a whole 128-row
  // block: it computes 128 rows a block however few the sequence has, one block a
  // multiprocessor, so a decode row beside a prompt chunk (a serving step) would cost it a full
  // tile over its context where the tiled kernel's 64-row blocks share a multiprocessor three at
  // a time. It was measured on single prompts; where the two cross in mixed steps was not.
  const bool many_rows = tokens >= 16 * num_seqs;
  const bool full_blocks = tokens >= 128 * num_seqs;
  if (full_blocks && wgmma_device && head_dim == attention_detail::kWgmmaHeadDim) return AttentionPath::kWgmma;
  if (many_rows && paged_attention_has_tiled(head_dim)) return AttentionPath::kTiled;
  if (paged_attention_has_decode(head_dim)) return AttentionPath::kDecode;
  return AttentionPath::kRow;
}

cudaError_t paged_attention(const PagedAttentionParams& p, cudaStream_t stream) {
  const bool pow2_block = (p.block_size & (p.block_size - 1)) == 0;
  if (p.num_seqs <= 0 || p.tokens < 0 || p.q_heads <= 0 || p.kv_heads <= 0 ||
      p.q_heads % p.kv_heads != 0 || p.head_dim <= 0 || p.head_dim % 8 != 0 ||
      p.head_dim > kAttentionMaxHeadDim || !pow2_block || p.block_size < kAttentionMinBlockSize ||
      p.block_size > kAttentionMaxBlockSize || p.max_blocks_per_seq <= 0 || p.max_context < 0)
    return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaSuccess;
  const AttentionPath path =
      p.path != AttentionPath::kAuto
          ? p.path
          : paged_attention_auto_path(p.tokens, p.num_seqs, p.head_dim, attention_detail::wgmma_attention_device());
  const bool codes = p.out_codes || p.out_scales || p.code_rows != 0;
  if (codes && (path != AttentionPath::kWgmma || !p.out_codes || !p.out_scales || p.code_rows < 0 ||
                p.code_rows > p.tokens))
    return cudaErrorInvalidValue;
  switch (path) {
    case AttentionPath::kTiled: return attention_detail::run_tiled(p, stream);
    case AttentionPath::kWgmma:
      if (!paged_attention_has_wgmma(p.head_dim)) return cudaErrorInvalidValue;
      return attention_detail::run_wgmma(p, stream);
    case AttentionPath::kDecode: return attention_detail::run_decode(p, stream);
    default: return attention_detail::run_row(p, stream);
  }
}

}  // namespace moe::cuda::kernels
