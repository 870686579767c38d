// The launch interface of multi-head latent attention (DeepSeek-V2/V3) in the absorbed form, over
// a paged latent cache: plain pointers and sizes, no library types, so the .cu file needs nothing
// but CUDA headers.
//
// Per layer the engine runs:
//   kv = kv_a(x) f32 [tokens, lora + rope]      -> prepare_latent: cache rows
//   q  = q_b(...) f32 [tokens, heads, nope + rope] -> prepare_mla_q: q_nope, q_full[.., lora:]
//   q_full[t, h, :lora] = q_nope[t, h] . W_UK_h   (the engine's batched GEMM)
//   latent_attention(q_full, cache) -> o_lat bf16 [tokens, heads, lora]
//   o_h = o_lat[t, h] . W_UV_h^T, then the o projection (the engine).
//
// Latent cache of one layer: bf16 [num_blocks, block_size, lora + rope]; the row of a token is
// [ rmsnorm(kv[:lora]) * weight | rope_interleaved(kv[lora:]) ] and serves as the key of every
// head (all lora + rope dims) and as its value (the first lora dims). Position p of sequence s
// lives in block block_tables[s * max_blocks_per_seq + p / block_size], row p % block_size, as in
// the GQA cache (attention_launch.h); slots are block * block_size + row.
//
// Rows and sequences follow paged_attention: row i of sequence s (n_s = seq_starts[s + 1] -
// seq_starts[s] rows) sits at position context_lens[s] - n_s + i and sees cache positions
// 0..that position. seq_starts and context_lens are read on the device, so they may change
// between replays of a captured graph; max_context only sizes the grid. Rows at or past
// seq_starts[num_seqs] are left as they are; a row with a negative position gets zeros.
// Nothing here allocates or synchronises with the host; each call returns cudaGetLastError()
// after its launches, or cudaErrorInvalidValue for sizes it does not support.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moe::cuda::kernels {

// Limits of all three calls.
constexpr int kLatentMaxLora = 512;  // kv_lora_rank: a multiple of 8 in [8, 512]
constexpr int kLatentMaxRope = 64;   // qk_rope_head_dim: a multiple of 8 in [8, 64]
constexpr int kLatentMaxNope = 256;  // qk_nope_head_dim: even, in [2, 256] (prepare_mla_q)
constexpr int kLatentMaxBlockSize = 1024;  // block_size: a power of two in [1, 1024]

struct LatentCacheParams {
  const float* kv = nullptr;  // f32 [tokens, kv_stride]: latent | rope part in columns [0, lora + rope)
  int kv_stride = 0;          // floats between rows of kv; 0: lora + rope
  const float* norm_weight = nullptr;  // f32 [lora] (kv_a_layernorm)
  float eps = 1e-6f;
  const float* inv_freq = nullptr;     // f32 [rope / 2]; angle = f32(position) * inv_freq[i]
  float rope_scale = 1.0f;             // multiplies cos and sin (YaRN's attention factor)
  const int32_t* positions = nullptr;  // [tokens]
  const int32_t* slots = nullptr;      // [tokens]: cache row, block * block_size + offset; < 0 writes nothing
  uint16_t* cache = nullptr;           // bf16 [num_blocks, block_size, lora + rope]
  int tokens = 0, lora = 0, rope = 0;
};

// cache[slots[t]] = bf16([ rmsnorm(kv[t, :lora]) * norm_weight | rope_interleaved(kv[t, lora:]) ]),
// the sum of squares in f32 (as cpu::rms_norm) and the rotation in f32 (as cpu::rope_interleaved).
cudaError_t prepare_latent(const LatentCacheParams& p, cudaStream_t stream);

struct MlaQParams {
  const float* q = nullptr;  // f32 [tokens, heads, nope + rope]
  const float* inv_freq = nullptr;     // f32 [rope / 2]
  float rope_scale = 1.0f;             // multiplies cos and sin
  const int32_t* positions = nullptr;  // [tokens]
  uint16_t* q_nope = nullptr;  // bf16 [tokens, heads, nope]
  uint16_t* q_full = nullptr;  // bf16 [tokens, heads, lora + rope]; only columns [lora, lora + rope) written
  int tokens = 0, heads = 0, nope = 0, rope = 0, lora = 0;
};

// q_nope[t, h] = bf16(q[t, h, :nope]); q_full[t, h, lora:] = bf16(rope_interleaved(q[t, h, nope:])).
cudaError_t prepare_mla_q(const MlaQParams& p, cudaStream_t stream);

struct LatentAttentionParams {
  const uint16_t* q = nullptr;      // bf16 [tokens, heads, lora + rope] (q_full), rows of all sequences back to back
  const uint16_t* cache = nullptr;  // bf16 [num_blocks, block_size, lora + rope]
  const int32_t* block_tables = nullptr;  // [num_seqs, max_blocks_per_seq]
  const int32_t* seq_starts = nullptr;    // [num_seqs + 1]
  const int32_t* context_lens = nullptr;  // [num_seqs]: cache positions after this step, new ones included
  int num_seqs = 0, tokens = 0, heads = 0, lora = 0, rope = 0;
  int block_size = 16, max_blocks_per_seq = 0;
  int max_context = 0;  // host upper bound of context_lens: sizes the grid and the context splits
  float scale = 1.0f;   // softmax scale: 1 / sqrt(nope + rope) for these models (times mscale^2 with YaRN)
  uint16_t* out = nullptr;    // bf16 [tokens, heads, lora] (o_lat)
  void* workspace = nullptr;  // split-context partial results, latent_attention_workspace_bytes
};

// score(t, h, j) = q[t, h, :] . cache_row_j * scale over all lora + rope dims, causal per
// sequence, softmax in f32, out[t, h, :] = sum_j p_j cache_row_j[:lora]. Scores on bf16 tensor
// cores with f32 accumulation; the softmax weights are rounded to bf16 for the value product.
cudaError_t latent_attention(const LatentAttentionParams& p, cudaStream_t stream);

// Bytes of workspace latent_attention needs (0 when it uses no context split). It depends on
// tokens, heads, lora and max_context only: a buffer sized here for the worst case of a captured
// graph serves every replay.
size_t latent_attention_workspace_bytes(int tokens, int heads, int lora, int max_context);

}  // namespace moe::cuda::kernels
