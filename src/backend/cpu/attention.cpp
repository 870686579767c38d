#include <cmath>
#include <vector>

#include "backend/cpu/kernels.h"

namespace moe::cpu {

void attention(ThreadPool& pool, const float* q, const float* k, const float* v, float* out,
               int64_t tokens, int64_t ctx, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
               int64_t v_dim, int64_t k_row_stride, int64_t v_row_stride, float scale) {
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
        const float* kr = k + j * k_row_stride + kvh * head_dim;
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
        const float* vr = v + j * v_row_stride + kvh * v_dim;
        for (int64_t d = 0; d < v_dim; ++d) o[d] += p * vr[d];
      }
    }
  });
}

}  // namespace moe::cpu
