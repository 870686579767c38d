#include <algorithm>
#include <cmath>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif
#include <vector>

#include "backend/cpu/kernels.h"

namespace moe::cpu {

namespace {

#if defined(__AVX2__) && defined(__FMA__)
// Eight-lane FMA accumulation along k, then a fixed horizontal order, then the k % 8 tail: every
// output goes through exactly these steps whichever tile computed it, so results do not depend
// on how rows are grouped (the naive and grouped MoE paths agree bit for bit).
inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
  __m128 s = _mm_add_ps(lo, hi);
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float finish(__m256 acc, const float* w, const float* x, int64_t i, int64_t k) {
  float s = hsum(acc);
  for (; i < k; ++i) s = std::fma(w[i], x[i], s);
  return s;
}

// Four rows of x against two rows of w: 8 accumulators, each weight vector loaded once per four
// tokens and each token vector once per two weight rows.
inline void tile4x2(const float* w0, const float* w1, const float* const x[4], int64_t k,
                    float out[4][2]) {
  __m256 a[4][2];
  for (auto& r : a) r[0] = r[1] = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    __m256 v0 = _mm256_loadu_ps(w0 + i), v1 = _mm256_loadu_ps(w1 + i);
    for (int r = 0; r < 4; ++r) {
      __m256 xv = _mm256_loadu_ps(x[r] + i);
      a[r][0] = _mm256_fmadd_ps(v0, xv, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(v1, xv, a[r][1]);
    }
  }
  for (int r = 0; r < 4; ++r) {
    out[r][0] = finish(a[r][0], w0, x[r], i, k);
    out[r][1] = finish(a[r][1], w1, x[r], i, k);
  }
}

inline float dot1(const float* w, const float* x, int64_t k) {
  __m256 a = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(x + i), a);
  return finish(a, w, x, i, k);
}

// Rows [m0, m1) of x against weight rows [n0, n1).
void linear_block(const float* x, const float* w, const float* bias, float* y, int64_t m0,
                  int64_t m1, int64_t k, int64_t n0, int64_t n1, int64_t y_stride) {
  int64_t n = n0;
  for (; n + 2 <= n1; n += 2) {
    const float* w0 = w + n * k;
    const float* w1 = w0 + k;
    const float b0 = bias ? bias[n] : 0.0f, b1 = bias ? bias[n + 1] : 0.0f;
    int64_t r = m0;
    for (; r + 4 <= m1; r += 4) {
      const float* xs[4] = {x + r * k, x + (r + 1) * k, x + (r + 2) * k, x + (r + 3) * k};
      float out[4][2];
      tile4x2(w0, w1, xs, k, out);
      for (int j = 0; j < 4; ++j) {
        y[(r + j) * y_stride + n] = out[j][0] + b0;
        y[(r + j) * y_stride + n + 1] = out[j][1] + b1;
      }
    }
    for (; r < m1; ++r) {
      y[r * y_stride + n] = dot1(w0, x + r * k, k) + b0;
      y[r * y_stride + n + 1] = dot1(w1, x + r * k, k) + b1;
    }
  }
  for (; n < n1; ++n) {
    const float b = bias ? bias[n] : 0.0f;
    for (int64_t r = m0; r < m1; ++r) y[r * y_stride + n] = dot1(w + n * k, x + r * k, k) + b;
  }
}
#else
// Portable fallback: eight partial sums per output keep the loop vectorisable without
// -ffast-math; the same steps for every output, whichever rows are grouped.
inline float dot1(const float* w, const float* x, int64_t k) {
  float a[8] = {};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8)
    for (int j = 0; j < 8; ++j) a[j] += w[i + j] * x[i + j];
  float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  for (; i < k; ++i) s += w[i] * x[i];
  return s;
}

void linear_block(const float* x, const float* w, const float* bias, float* y, int64_t m0,
                  int64_t m1, int64_t k, int64_t n0, int64_t n1, int64_t y_stride) {
  for (int64_t n = n0; n < n1; ++n) {
    const float b = bias ? bias[n] : 0.0f;
    for (int64_t r = m0; r < m1; ++r) y[r * y_stride + n] = dot1(w + n * k, x + r * k, k) + b;
  }
}
#endif

}  // namespace

void grouped_linear(ThreadPool& pool, const float* x, const float* w, const int32_t* offsets,
                    int64_t experts, int64_t k, int64_t n_out, float* y) {
  // Work items: (expert, block of output features); only experts with rows make items.
  const int64_t block = 32;
  const int64_t blocks_per_expert = (n_out + block - 1) / block;
  std::vector<int32_t> busy;
  for (int64_t e = 0; e < experts; ++e)
    if (offsets[e + 1] > offsets[e]) busy.push_back(static_cast<int32_t>(e));
  const int64_t items = static_cast<int64_t>(busy.size()) * blocks_per_expert;
  pool.parallel_for(items, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      int64_t e = busy[static_cast<size_t>(i / blocks_per_expert)];
      int64_t b = i % blocks_per_expert;
      linear_block(x, w + e * n_out * k, nullptr, y, offsets[e], offsets[e + 1], k, b * block,
                   std::min(n_out, (b + 1) * block), n_out);
    }
  });
}

void linear(ThreadPool& pool, const float* x, const float* w, const float* bias, float* y,
            int64_t m, int64_t k, int64_t n_out) {
  // Parallel over blocks of output features: each thread streams a disjoint slice of the weight
  // matrix once, for all rows of x.
  const int64_t block = 16;
  const int64_t blocks = (n_out + block - 1) / block;
  pool.parallel_for(blocks, [&](int64_t b0, int64_t b1) {
    linear_block(x, w, bias, y, 0, m, k, b0 * block, std::min(n_out, b1 * block), n_out);
  });
}

}  // namespace moe::cpu
