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

void rope_half(float* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rot_dim,
               const int32_t* positions, const float* inv_freq, float cos_sin_scale) {
  int64_t half = rot_dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      float angle = static_cast<float>(positions[t]) * inv_freq[i];
      float c = std::cos(angle) * cos_sin_scale, s = std::sin(angle) * cos_sin_scale;
      for (int64_t h = 0; h < heads; ++h) {
        float* p = x + (t * heads + h) * head_dim;
        float a = p[i], b = p[i + half];
        p[i] = a * c - b * s;
        p[i + half] = b * c + a * s;
      }
    }
  }
}

void rope_interleaved(float* x, int64_t tokens, int64_t heads, int64_t head_dim, int64_t rot_dim,
                      const int32_t* positions, const float* inv_freq, float cos_sin_scale) {
  int64_t half = rot_dim / 2;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t i = 0; i < half; ++i) {
      float angle = static_cast<float>(positions[t]) * inv_freq[i];
      float c = std::cos(angle) * cos_sin_scale, s = std::sin(angle) * cos_sin_scale;
      for (int64_t h = 0; h < heads; ++h) {
        float* p = x + (t * heads + h) * head_dim;
        float a = p[2 * i], b = p[2 * i + 1];
        p[2 * i] = a * c - b * s;
        p[2 * i + 1] = b * c + a * s;
      }
    }
  }
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
