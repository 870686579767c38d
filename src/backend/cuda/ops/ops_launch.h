// The launch interface of the small per-layer CUDA ops (embedding, norms, elementwise, the q/k/v
// epilogue) and of the routers and samplers: plain pointers and sizes, no library types, so the
// .cu files need nothing but CUDA headers. Activations are bf16 stored as uint16_t bits, the
// residual stream and norm weights f32. Nothing here allocates or synchronises with the host, so
// every call can be captured in a CUDA graph; each returns cudaGetLastError() after its launch, or
// cudaErrorInvalidValue for sizes it does not support (checked on the host before launching).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace moe::cuda::kernels {

// out[t, :] = f32(table[ids[t], :]); table bf16 [vocab, hidden]. Ids outside [0, vocab) write
// zeros: the host validates ids before, this only keeps a bad id from reading out of bounds.
cudaError_t embed(const uint16_t* table, const int32_t* ids, int tokens, int hidden, int vocab,
                  float* out, cudaStream_t stream);

// Per row r of x (f32 [rows, width], in place): x += f32(branch[r]) when branch != null, then
// += f32(branch2[r]) when branch2 != null; then, when out != null,
// out[r] = bf16(x[r] / sqrt(mean(x[r]^2) + eps) * weight), weight f32 [width]. Reductions in f32.
cudaError_t add_rms_norm(float* x, const uint16_t* branch, const uint16_t* branch2,
                         const float* weight, int rows, int width, float eps, uint16_t* out,
                         cudaStream_t stream);

// f32 input, bf16 output, no residual (DeepSeek's latent norms, the final norm on selected rows).
cudaError_t rms_norm(const float* in, const float* weight, int rows, int width, float eps,
                     uint16_t* out, cudaStream_t stream);

// act[t, i] = bf16(silu(g) * u), g = gate_up[t, i], u = gate_up[t, inter + i]; math in f32.
cudaError_t silu_mul(const uint16_t* gate_up, int tokens, int inter, uint16_t* act,
                     cudaStream_t stream);

// Qwen2-MoE's gated shared expert: y[t, :] = bf16(f32(y[t, :]) * sigmoid(gate[t])).
cudaError_t sigmoid_scale_rows(uint16_t* y, const float* gate, int rows, int width,
                               cudaStream_t stream);

constexpr int kQkvMaxHeadDim = 256;

// After the fused q|k|v projection: bias, q/k norm, clip, rotary (the order of Model::attention),
// then q to its own buffer and k, v into the paged KV cache.
struct QkvParams {
  int tokens = 0, q_heads = 0, kv_heads = 0, head_dim = 0;  // head_dim even, <= kQkvMaxHeadDim
  const float* bias = nullptr;  // [(q_heads + 2 kv_heads) * head_dim] or null
  // 0 none; 1 per head (weights [head_dim]); 2 full width (q weight [q_heads * head_dim],
  // k weight [kv_heads * head_dim], OLMoE).
  int qk_norm = 0;
  const float* q_norm = nullptr;
  const float* k_norm = nullptr;
  float eps = 1e-6f;
  float clip = 0.0f;    // > 0: clamp q, k, v to [-clip, clip] (after the norm, as the CPU engine)
  int rope_half = 1;    // 1: rotate_half pairs (i, i + rot_dim / 2); 0: interleaved (2i, 2i + 1)
  int rot_dim = 0;      // leading features of each head that rotate (even, <= head_dim)
  const float* inv_freq = nullptr;     // [rot_dim / 2]
  float rope_scale = 1.0f;             // multiplies cos and sin (YaRN's attention factor)
  const int32_t* positions = nullptr;  // [tokens]
  // Paged cache of one layer: pools bf16 [num_blocks, block_size, kv_heads, head_dim]; token t
  // goes to row slots[t] = block * block_size + offset; a negative slot (padding) writes no k, v.
  const int32_t* slots = nullptr;
  uint16_t* k_cache = nullptr;
  uint16_t* v_cache = nullptr;
  uint16_t* q_out = nullptr;  // bf16 [tokens, q_heads, head_dim]
};

// qkv: bf16 [tokens, (q_heads + 2 kv_heads) * head_dim], columns q | k | v, as the projection
// rounds them (the reference implementation's linear layers return bf16 too); 4-byte aligned.
cudaError_t prepare_qkv(const uint16_t* qkv, const QkvParams& p, cudaStream_t stream);

constexpr int kRouterMaxExperts = 512;
constexpr int kRouterMaxTopK = 16;

// The device twin of moe::route (src/moe/router.h): the same experts, tie rule (lower index among
// equal scores, experts and groups alike) and ascending ids per token.
struct RouterParams {
  int experts = 0, top_k = 0;
  int sigmoid = 0;        // 0 softmax scoring, 1 sigmoid
  int group_ranking = 0;  // 0 none, 1 group max (DeepSeek-V2), 2 sum of top-2 (DeepSeek-V3)
  int n_group = 1, topk_group = 1;
  const float* bias = nullptr;  // e_score_correction_bias [experts] (choice only), or null
  int renormalize = 0;
  float scaling = 1.0f;
  // Expert parallelism: when set, each chosen id is also written here ([tokens, top_k], same
  // slots) as an index among the experts [local_first, local_first + local_count) this rank
  // holds, or -1 for another rank's, which saves the experts a separate translation.
  int32_t* local_ids = nullptr;
  int local_first = 0, local_count = 0;
  // When set (one device value), tokens from *live_rows on are padding: their ids (and local
  // ids) are -1 and their weights 0, so the experts and every exchange skip them. Their logits
  // are still computed where a router writes them.
  const int32_t* live_rows = nullptr;
};

// logits f32 [tokens, experts] -> ids int32 [tokens, top_k] ascending per token, weights f32
// [tokens, top_k].
cudaError_t route(const float* logits, const RouterParams& p, int tokens, int32_t* ids,
                  float* weights, cudaStream_t stream);

// route() with the router projection folded in, for small routers (experts * hidden up to
// kRouteHiddenMaxWeights, hidden a multiple of 8): logits[t] = router_weight · x[t] (bf16 x and
// router_weight [experts, hidden], 16-byte aligned; f32 accumulation in lane-strided order, so
// within f32 rounding of a GEMM's logits, not bit-equal), then the same choice as route() on
// those logits. `logits` (f32 [tokens, experts]) receives them when not null. One launch where
// the projection and route() take two.
constexpr int kRouteHiddenMaxWeights = 1 << 16;
bool route_hidden_supported(int experts, int hidden);
cudaError_t route_hidden(const uint16_t* x, const uint16_t* router_weight, int hidden,
                         const RouterParams& p, int tokens, int32_t* ids, float* weights,
                         float* logits, cudaStream_t stream);

// Decode routing in one launch (norm_route.cu): per token t < tokens,
//   x[t] += f32(branch[t]); normed[t] = bf16(rmsnorm(x[t]) * norm_weight)   (add_rms_norm)
//   logits[t] = router_weight · normed[t]                                    (f32 accumulation)
//   ids[t], weights[t] = route(logits[t])                                     (route, same experts)
// For tokens <= kNormRouteMaxTokens with tokens * hidden <= kNormRouteMaxElements (the rows are
// held in registers and shared memory).
constexpr int kNormRouteMaxTokens = 8;
constexpr int kNormRouteMaxElements = 16384;
struct NormRouteParams {
  float* x = nullptr;                      // f32 [tokens, hidden], in place
  const uint16_t* branch = nullptr;        // bf16 [tokens, hidden]
  const float* norm_weight = nullptr;      // f32 [hidden]
  float eps = 0.0f;
  uint16_t* normed = nullptr;              // bf16 [tokens, hidden]
  const uint16_t* router_weight = nullptr;  // bf16 [experts, hidden]
  float* logits = nullptr;                 // f32 [tokens, experts]
  unsigned* counter = nullptr;  // zero before the first launch; each launch leaves it zero
  int hidden = 0;               // a multiple of 8
};
bool norm_route_supported(int tokens, int hidden);
// cudaErrorInvalidValue when unsupported, misaligned (16 bytes) or p invalid for route().
cudaError_t norm_route(const NormRouteParams& q, const RouterParams& p, int tokens, int32_t* ids,
                       float* weights, cudaStream_t stream);

constexpr int kSampleMaxVocab = 1 << 18;

// Greedy: the index of the maximum of each row (ties: the lower index); NaN-free input assumed.
cudaError_t argmax_rows(const float* logits, int rows, int vocab, int32_t* out,
                        cudaStream_t stream);

// Per-row device arrays [rows].
struct SampleParams {
  const float* temperature;
  const int32_t* top_k;
  const float* top_p;
  const uint64_t* seed;
  const int32_t* step;
  // Floats between rows of logits (0: vocab). Larger than vocab when the ids past `vocab` must
  // never be drawn (a model's vocabulary padded past its tokenizer's).
  int row_stride = 0;
};

// temperature <= 0 or top_k == 1: greedy for that row. Otherwise softmax(logits / T) restricted
// to the top_k most likely (0: all; ties broken towards the lower index, as moe::Sampler), then to
// the smallest set of most likely tokens whose probability reaches top_p (>= 1: all), then one
// draw keyed by (seed[row], step[row]) through a counter-based hash: replays give the same token.
cudaError_t sample_rows(const float* logits, const SampleParams& p, int rows, int vocab,
                        int32_t* out, cudaStream_t stream);

}  // namespace moe::cuda::kernels
