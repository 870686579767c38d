// CPU reference kernels on raw f32 pointers. Shapes are checked by the callers in src/ops/; these
// functions trust their arguments. Every reduction runs in f32 in a fixed order, so results do
// not depend on the number of threads.
#pragma once

#include <cstdint>

#include "core/thread_pool.h"

namespace moe::cpu {

// One pass over expert-contiguous row slices: rows [offsets[e], offsets[e + 1]) of x are
// multiplied by w[e] ([n_out, k] row-major, experts back to back) into the same rows of y.
void grouped_linear(ThreadPool& pool, const float* x, const float* w, const int32_t* offsets,
                    int64_t experts, int64_t k, int64_t n_out, float* y);

// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]); w is row-major [n_out, k] as in nn.Linear.
void linear(ThreadPool& pool, const float* x, const float* w, const float* bias, float* y,
            int64_t m, int64_t k, int64_t n_out);

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * weight; out may alias x.
void rms_norm(ThreadPool& pool, const float* x, const float* weight, float* out, int64_t rows,
              int64_t dim, float eps);

// Rotary embedding in the "half" layout (rotate_half: pairs (i, i + d/2)), applied in place to
// `heads` heads of width `head_dim` for each of `tokens` rows; row t has position positions[t].
// Only the first `rot_dim` features of each head rotate. cos and sin are multiplied by
// `cos_sin_scale` (YaRN's attention factor, see model/rope.h).
void rope_half(float* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rot_dim,
               const int32_t* positions, const float* inv_freq, float cos_sin_scale = 1.0f);
// The interleaved layout (pairs (2i, 2i + 1)).
void rope_interleaved(float* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rot_dim,
                      const int32_t* positions, const float* inv_freq, float cos_sin_scale = 1.0f);

// out[t, i] = silu(gate_up[t, i]) * gate_up[t, inter + i] for i < inter.
void silu_mul(const float* gate_up, float* out, int64_t tokens, int64_t inter);

// Causal attention for one sequence. q: [tokens, q_heads, head_dim]; k, v: [ctx, kv_heads, *]
// hold the whole context, of which the queries are the last `tokens` positions. Query head h
// reads kv head h / (q_heads / kv_heads). out: [tokens, q_heads, v_dim].
void attention(ThreadPool& pool, const float* q, const float* k, const float* v, float* out,
               int64_t tokens, int64_t ctx, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
               int64_t v_dim, int64_t k_row_stride, int64_t v_row_stride, float scale);
// The same over a paged context: key row j lies at k_blocks[j / block_size] + (j % block_size) *
// k_row_stride, value rows likewise. Gives bit for bit the result of the contiguous form.
void paged_attention(ThreadPool& pool, const float* q, const float* const* k_blocks,
                     const float* const* v_blocks, int64_t block_size, float* out, int64_t tokens,
                     int64_t ctx, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t v_dim,
                     int64_t k_row_stride, int64_t v_row_stride, float scale);

// In-place softmax of each of `rows` rows of width n.
void softmax_rows(float* x, int64_t rows, int64_t n);

}  // namespace moe::cpu
