#include <cmath>

#include "backend/cpu/kernels.h"

namespace moe::cpu {

void rms_norm(ThreadPool& pool, const float* x, const float* weight, float* out, int64_t rows,
              int64_t dim, float eps) {
  pool.parallel_for(
      rows,
      [&](int64_t r0, int64_t r1) {
        for (int64_t r = r0; r < r1; ++r) {
          const float* xr = x + r * dim;
          float* orow = out + r * dim;
          float ss = 0.0f;
          for (int64_t i = 0; i < dim; ++i) ss += xr[i] * xr[i];
          float inv = 1.0f / std::sqrt(ss / static_cast<float>(dim) + eps);
          for (int64_t i = 0; i < dim; ++i) orow[i] = weight[i] * (xr[i] * inv);
        }
      },
      64);
}

namespace {

// Rotates pairs of each head's first rot_dim values by position * inv_freq[i] (cos and sin scaled
// by cos_sin_scale); pair i is the elements first(i) and second(i) of the head.
template <typename First, typename Second>
void rope_pairs(float* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rot_dim,
                const int32_t* positions, const float* inv_freq, float cos_sin_scale, First first,
                Second second) {
  int64_t half = rot_dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      float angle = static_cast<float>(positions[t]) * inv_freq[i];
      float c = std::cos(angle) * cos_sin_scale, s = std::sin(angle) * cos_sin_scale;
      for (int64_t h = 0; h < heads; ++h) {
        float* p = x + (t * heads + h) * head_dim;
        float a = p[first(i)], b = p[second(i)];
        p[first(i)] = a * c - b * s;
        p[second(i)] = b * c + a * s;
      }
    }
  }
}

}  // namespace

void rope_half(float* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rot_dim,
               const int32_t* positions, const float* inv_freq, float cos_sin_scale) {
  const int64_t half = rot_dim / 2;
  rope_pairs(x, tokens, heads, head_dim, rot_dim, positions, inv_freq, cos_sin_scale,
             [](int64_t i) { return i; }, [half](int64_t i) { return i + half; });
}

void rope_interleaved(float* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rot_dim,
                      const int32_t* positions, const float* inv_freq, float cos_sin_scale) {
  rope_pairs(x, tokens, heads, head_dim, rot_dim, positions, inv_freq, cos_sin_scale,
             [](int64_t i) { return 2 * i; }, [](int64_t i) { return 2 * i + 1; });
}

void silu_mul(const float* gate_up, float* out, int64_t tokens, int64_t inter) {
  for (int64_t t = 0; t < tokens; ++t) {
    const float* g = gate_up + t * 2 * inter;
    const float* u = g + inter;
    float* o = out + t * inter;
    for (int64_t i = 0; i < inter; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
  }
}

void softmax_rows(float* x, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r) {
    float* p = x + r * n;
    float mx = -INFINITY;
    for (int64_t i = 0; i < n; ++i) mx = std::fmax(mx, p[i]);
    float sum = 0.0f;
    for (int64_t i = 0; i < n; ++i) {
      p[i] = std::exp(p[i] - mx);
      sum += p[i];
    }
    float inv = 1.0f / sum;
    for (int64_t i = 0; i < n; ++i) p[i] *= inv;
  }
}

}  // namespace moe::cpu
