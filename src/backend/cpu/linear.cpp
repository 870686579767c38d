#include <algorithm>
#include <vector>

#include "backend/cpu/kernels.h"

namespace moe::cpu {

namespace {

// Four rows of x against one row of w at once, so each weight row is read from memory once per
// four tokens. Eight partial sums per row keep the loop vectorisable without -ffast-math.
inline void dot4(const float* w, const float* x0, const float* x1, const float* x2,
                 const float* x3, int64_t k, float out[4]) {
  float a0[8] = {}, a1[8] = {}, a2[8] = {}, a3[8] = {};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8) {
    for (int j = 0; j < 8; ++j) {
      float wv = w[i + j];
      a0[j] += wv * x0[i + j];
      a1[j] += wv * x1[i + j];
      a2[j] += wv * x2[i + j];
      a3[j] += wv * x3[i + j];
    }
  }
  float* accs[4] = {a0, a1, a2, a3};
  const float* xs[4] = {x0, x1, x2, x3};
  for (int r = 0; r < 4; ++r) {
    float* a = accs[r];
    float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
    for (int64_t t = i; t < k; ++t) s += w[t] * xs[r][t];
    out[r] = s;
  }
}

inline float dot1(const float* w, const float* x, int64_t k) {
  float a[8] = {};
  int64_t i = 0;
  for (; i + 8 <= k; i += 8)
    for (int j = 0; j < 8; ++j) a[j] += w[i + j] * x[i + j];
  float s = ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  for (; i < k; ++i) s += w[i] * x[i];
  return s;
}

// Rows [m0, m1) of x against weight rows [n0, n1).
void linear_block(const float* x, const float* w, const float* bias, float* y, int64_t m0,
                  int64_t m1, int64_t k, int64_t n0, int64_t n1, int64_t y_stride) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * k;
    float b = bias ? bias[n] : 0.0f;
    int64_t r = m0;
    for (; r + 4 <= m1; r += 4) {
      float out[4];
      dot4(wr, x + r * k, x + (r + 1) * k, x + (r + 2) * k, x + (r + 3) * k, k, out);
      for (int j = 0; j < 4; ++j) y[(r + j) * y_stride + n] = out[j] + b;
    }
    for (; r < m1; ++r) y[r * y_stride + n] = dot1(wr, x + r * k, k) + b;
  }
}

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
  // Parallel over output features: each thread streams a disjoint slice of the weight matrix.
  int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(k, 1));
  pool.parallel_for(
      n_out,
      [&](int64_t n0, int64_t n1) {
        for (int64_t n = n0; n < n1; ++n) {
          const float* wr = w + n * k;
          float b = bias ? bias[n] : 0.0f;
          int64_t r = 0;
          for (; r + 4 <= m; r += 4) {
            float out[4];
            dot4(wr, x + r * k, x + (r + 1) * k, x + (r + 2) * k, x + (r + 3) * k, k, out);
            for (int j = 0; j < 4; ++j) y[(r + j) * n_out + n] = out[j] + b;
          }
          for (; r < m; ++r) y[r * n_out + n] = dot1(wr, x + r * k, k) + b;
        }
      },
      grain);
}

}  // namespace moe::cpu
