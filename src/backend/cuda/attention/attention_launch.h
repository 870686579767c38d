// The launch interface of attention over a paged KV cache (GQA; prefill, decode and mixed
// batches in one call): plain pointers and sizes, no library types, so the .cu file needs nothing
// but CUDA headers.
//
// Cache layout of one layer: K and V pools, bf16 [num_blocks, block_size, kv_heads, head_dim];
// position p of sequence s lives in block block_tables[s * max_blocks_per_seq + p / block_size],
// row p % block_size. The new keys and values of this step are already in the cache.
//
// Row i of sequence s (n_s = seq_starts[s + 1] - seq_starts[s] rows) sits at position
// context_lens[s] - n_s + i and attends to cache positions 0..that position. Query head h reads
// kv head h / (q_heads / kv_heads). Softmax and accumulation in f32, output rounded to bf16.
// seq_starts and context_lens are read on the device, so they may change between replays of a
// captured graph while the host fields stay fixed. Rows at or past seq_starts[num_seqs] are left
// as they are; a row whose position is negative (context_lens[s] < n_s) gets zeros.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moe::cuda::kernels {

// Which kernel serves the call. kAuto picks by the host sizes and the device: when sequences
// average a 128-row block or more (prompts alone), the wgmma kernel where it runs (head dim 128,
// compute capability 9.0); when they average 16 rows or more, the tiled tensor-core kernel where
// the head dim has an instantiation; otherwise the decode kernel where the head dim has one,
// otherwise the row kernel. Each is correct for every input; the tests run each on every case it
// runs.
enum class AttentionPath : int {
  kAuto = 0,
  kRow = 1,     // one block per (row, group of query heads, context split), f32 FMAs: the reference
  kTiled = 2,   // 64 rows of one head per block, mma.sync bf16: prefill
  kDecode = 3,  // one block per (row, up to 16 heads of a kv head, context split), mma.sync bf16
  kWgmma = 4,   // 128 rows of one head per block, wgmma bf16 (sm_90a, head dim 128): prefill
};

struct PagedAttentionParams {
  const uint16_t* q = nullptr;        // bf16 [tokens, q_heads, head_dim], rows of all sequences back to back
  const uint16_t* k_cache = nullptr;  // bf16 [num_blocks, block_size, kv_heads, head_dim]
  const uint16_t* v_cache = nullptr;
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
  const int32_t* seq_starts = nullptr;    // [num_seqs + 1]: rows of sequence s are [seq_starts[s], seq_starts[s+1])
  const int32_t* context_lens = nullptr;  // [num_seqs]: tokens in the cache after this step, new ones included
  int num_seqs = 0, tokens = 0, q_heads = 0, kv_heads = 0, head_dim = 0;
  int block_size = 16, max_blocks_per_seq = 0;
  int max_context = 0;    // host upper bound of context_lens, sizes the grid (blocks beyond a sequence's real length exit early)
  float scale = 1.0f;     // softmax scale (1/sqrt(head_dim) for these models)
  uint16_t* out = nullptr;  // bf16 [tokens, q_heads, head_dim]
  void* workspace = nullptr;  // scratch for split-context partial results, see below
  AttentionPath path = AttentionPath::kAuto;
  // Decode kernel only: keys per context split, 0 = the built-in choice. A tuning knob for the
  // benchmarks; a non-zero value must also be passed to paged_attention_workspace_bytes.
  int split_keys = 0;
  // The wgmma kernel only (a call that takes another path is cudaErrorInvalidValue): rows below
  // code_rows written as the input of an FP8 projection instead of into `out`, E4M3 codes
  // [tokens, q_heads, 128] and scales block-major [q_heads, code_rows], a head's dims one scale
  // block; codes and scales are quantize_rows_fp8_by_block's of the bf16 output. Rows from
  // code_rows on go to `out` as bf16.
  uint8_t* out_codes = nullptr;
  float* out_scales = nullptr;
  int code_rows = 0;
};

// Limits checked by paged_attention (cudaErrorInvalidValue otherwise).
constexpr int kAttentionMaxHeadDim = 256;  // and a multiple of 8
constexpr int kAttentionMinBlockSize = 8;  // block_size: a power of two in [8, 64]
constexpr int kAttentionMaxBlockSize = 64;

// Bytes of workspace paged_attention needs for any call with at most `tokens` rows and this
// max_context (0 allowed when no split is used). The split count depends on the host sizes only
// (the device then uses as many of them as each row's real length needs), so a buffer sized here
// serves every replay of a captured graph.
size_t paged_attention_workspace_bytes(int tokens, int q_heads, int head_dim, int max_context,
                                       int split_keys = 0);

// Whether the tiled (tensor-core) kernel has an instantiation for this head dim.
bool paged_attention_has_tiled(int head_dim);

// Whether the decode (tensor-core) kernel has an instantiation for this head dim.
bool paged_attention_has_decode(int head_dim);

// Whether the wgmma kernel runs this head dim on the current device (128, compute capability 9.0).
// A call for kWgmma where it does not is cudaErrorInvalidValue.
bool paged_attention_has_wgmma(int head_dim);

// The kernel kAuto picks for a call of these host sizes, on a device that runs the wgmma kernel
// (compute capability 9.0) or not.
AttentionPath paged_attention_auto_path(int tokens, int num_seqs, int head_dim, bool wgmma_device);

cudaError_t paged_attention(const PagedAttentionParams& p, cudaStream_t stream);

}  // namespace moe::cuda::kernels
