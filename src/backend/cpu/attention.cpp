#include <cmath>
#include <vector>

#include "backend/cpu/kernels.h"

namespace moe::cpu {

namespace {

// One body for the contiguous and the paged layout: `key(j)` and `value(j)` give the rows of
// context position j, so both layouts do exactly the same arithmetic in the same order.
template <typename KeyRow, typename ValueRow>
void attention_rows(ThreadPool& pool, const float* q, KeyRow key, ValueRow value, float* out,
                    int64_t tokens, int64_t ctx, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                    int64_t v_dim, float scale) {
  int64_t group = q_heads / kv_heads;
  int64_t first_pos = ctx - tokens;  // position of the first query in the context
  pool.parallel_for(tokens * q_heads, [&](int64_t w0, int64_t w1) {
    std::vector<float> scores(static_cast<size_t>(ctx));
    for (int64_t w = w0; w < w1; ++w) {
      int64_t t = w / q_heads, h = w % q_heads, kvh = h / group;
      const float* qr = q + (t * q_heads + h) * head_dim;
      int64_t visible = first_pos + t + 1;  // causal: keys at positions <= the query's
      float mx = -INFINITY;
      for (int64_t j = 0; j < visible; ++j) {
        const float* kr = key(j) + kvh * head_dim;
        float s = 0.0f;
        for (int64_t d = 0; d < head_dim; ++d) s += qr[d] * kr[d];
        s *= scale;
        scores[static_cast<size_t>(j)] = s;
        mx = std::fmax(mx, s);
      }
      float sum = 0.0f;
      for (int64_t j = 0; j < visible; ++j) {
        float e = std::exp(scores[static_cast<size_t>(j)] - mx);
        scores[static_cast<size_t>(j)] = e;
        sum += e;
      }
      float inv = 1.0f / sum;
      float* o = out + (t * q_heads + h) * v_dim;
      for (int64_t d = 0; d < v_dim; ++d) o[d] = 0.0f;
      for (int64_t j = 0; j < visible; ++j) {
        float p = scores[static_cast<size_t>(j)] * inv;
        const float* vr = value(j) + kvh * v_dim;
        for (int64_t d = 0; d < v_dim; ++d) o[d] += p * vr[d];
      }
    }
  });
}

}  // namespace

void attention(ThreadPool& pool, const float* q, const float* k, const float* v, float* out,
               int64_t tokens, int64_t ctx, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
               int64_t v_dim, int64_t k_row_stride, int64_t v_row_stride, float scale) {
  attention_rows(
      pool, q, [&](int64_t j) { return k + j * k_row_stride; },
      [&](int64_t j) { return v + j * v_row_stride; }, out, tokens, ctx, q_heads, kv_heads, head_dim,
      v_dim, scale);
}

void paged_attention(ThreadPool& pool, const float* q, const float* const* k_blocks,
                     const float* const* v_blocks, int64_t block_size, float* out, int64_t tokens,
                     int64_t ctx, int64_t q_heads, int64_t kv_heads, int64_t head_dim, int64_t v_dim,
                     int64_t k_row_stride, int64_t v_row_stride, float scale) {
  attention_rows(
      pool, q, [&](int64_t j) { return k_blocks[j / block_size] + (j % block_size) * k_row_stride; },
      [&](int64_t j) { return v_blocks[j / block_size] + (j % block_size) * v_row_stride; }, out,
      tokens, ctx, q_heads, kv_heads, head_dim, v_dim, scale);
}

}  // namespace moe::cpu
