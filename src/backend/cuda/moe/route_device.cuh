// The router's warp-level body, shared by route() (route_sample.cu) and the fused decode
// routing (norm_route.cu): one warp chooses one token's experts exactly as moe::route does (the
// arithmetic is explained at the top of route_sample.cu). Device code only; every user is a .cu
// file of this directory.
#pragma once

#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "backend/cuda/ops/ops_launch.h"

namespace moe::cuda::kernels::route_detail {

// Host side: the experts each lane holds (P), or 0 when route() cannot run `p`; *group_lanes as
// route_token takes it.
int route_lanes(const RouterParams& p, int* group_lanes);

constexpr unsigned kFull = 0xffffffffu;
constexpr int kNoIndex = 0x7fffffff;

// The router's order: higher value, then lower index.
__device__ __forceinline__ bool better(float va, int ia, float vb, int ib) {
  return va > vb || (va == vb && ia < ib);
}

__device__ __forceinline__ void warp_best(float& v, int& i) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const float ov = __shfl_xor_sync(kFull, v, o);
    const int oi = __shfl_xor_sync(kFull, i, o);
    if (better(ov, oi, v, i)) v = ov, i = oi;
  }
}

// Unsigned keys in the order of the floats (NaN aside).
__device__ __forceinline__ uint32_t order_key(float z) {
  const uint32_t b = __float_as_uint(z);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ float exp_rounded(float x) { return static_cast<float>(exp(static_cast<double>(x))); }

__device__ __forceinline__ float from_order_key(uint32_t k) {
  return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}

// Adding +0 turns -0 into +0 (round to nearest), so that the order keys of equal floats are equal.
__device__ __forceinline__ uint32_t value_key(float v) { return order_key(v + 0.0f); }

// The CPU's softmax denominator: buf[0] + buf[1] + ... in expert order, in f32. A tree order
// differs from it by up to ~1.4e-6 relative at 128-512 experts (the CPU's own rounding error),
// past the weights' bound, so the order is kept. buf holds 32 P values, zero past the experts
// (adding +0 to the positive sum changes nothing). Every lane reads the same words (a
// broadcast), eight 16-byte loads at a time ahead of their adds, so the chain is one dependent add
// per value and every lane ends with the sum.
template <int P>
__device__ __forceinline__ float serial_sum(const float* buf) {
  constexpr int kInFlight = 8;  // 16-byte loads issued before their adds
  float s = 0.0f;
#pragma unroll
  for (int g = 0; g < 8 * P; g += kInFlight) {
    float4 q[kInFlight];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) q[i] = reinterpret_cast<const float4*>(buf)[g + i];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      s += q[i].x;
      s += q[i].y;
      s += q[i].z;
      s += q[i].w;
    }
  }
  return s;
}

// The top-k choice's k rounds over each lane's P candidate keys (key 0: no candidate; every real
// value's key is larger, NaN included); returns the bits j of this lane's candidates taken. Each
// lane sorts its candidates once (larger key first; an insertion sort that swaps only on a
// strictly larger key, so the lower index goes first among equal ones) and offers its head; the
// warp takes the largest key, among equal keys from the lowest lane, which holds the lowest
// experts. A round is then one max, one ballot and a shift.
template <int P>
__device__ __forceinline__ uint32_t take_top_k(uint32_t (&key)[P], int k, int lane) {
  int idx[P];
#pragma unroll
  for (int j = 0; j < P; ++j) idx[j] = j;
#pragma unroll
  for (int i = 1; i < P; ++i)
#pragma unroll
    for (int j = i; j > 0; --j)
      if (key[j] > key[j - 1]) {
        const uint32_t tk = key[j];
        key[j] = key[j - 1], key[j - 1] = tk;
        const int ti = idx[j];
        idx[j] = idx[j - 1], idx[j - 1] = ti;
      }
  uint32_t taken = 0;
  for (int r = 0; r < k; ++r) {
    const uint32_t m = __reduce_max_sync(kFull, key[0]);
    const unsigned ball = __ballot_sync(kFull, key[0] == m);
    if (lane == __ffs(ball) - 1) {
      taken |= 1u << idx[0];
#pragma unroll
      for (int j = 0; j + 1 < P; ++j) key[j] = key[j + 1], idx[j] = idx[j + 1];
      key[P - 1] = 0u;
    }
  }
  return taken;
}

// Groups that do not fall on lane boundaries: through shared memory, lane g scores group g (the
// first version's code); `choice` [n] is masked in place.
__device__ inline void mask_groups_shared(const RouterParams& p, float* choice, float* group, int lane) {
  const int n = p.experts, per = n / p.n_group;
  for (int g = lane; g < p.n_group; g += 32) {
    const float* c = choice + g * per;
    float gs;
    if (p.group_ranking == 1) {
      gs = c[0];
      for (int j = 1; j < per; ++j) gs = c[j] > gs ? c[j] : gs;
    } else {  // the two largest values; which of equal ones is taken does not change the sum
      float b1 = -INFINITY, b2 = -INFINITY;
      for (int j = 0; j < per; ++j) {
        const float v = c[j];
        if (v > b1) b2 = b1, b1 = v;
        else if (v > b2) b2 = v;
      }
      gs = b1 + b2;
    }
    group[g] = gs;
  }
  __syncwarp();
  uint32_t taken = 0;  // bit j: group lane + 32 j was kept
  for (int r = 0; r < p.topk_group; ++r) {
    float bv = -INFINITY;
    int bi = kNoIndex;
    for (int j = 0; j < kRouterMaxExperts / 32; ++j) {
      const int g = lane + 32 * j;
      if (g < p.n_group && !(taken >> j & 1u) && better(group[g], g, bv, bi)) bv = group[g], bi = g;
    }
    warp_best(bv, bi);
    if (bi != kNoIndex && (bi & 31) == lane) taken |= 1u << (bi >> 5);
  }
  __syncwarp();
  for (int j = 0; j < kRouterMaxExperts / 32; ++j) {
    const int g = lane + 32 * j;
    if (g < p.n_group) group[g] = (taken >> j & 1u) ? 1.0f : 0.0f;
  }
  __syncwarp();
  const float masked = p.group_ranking == 1 ? 0.0f : -INFINITY;
  for (int e = lane; e < n; e += 32)
    if (group[e / per] == 0.0f) choice[e] = masked;
  __syncwarp();
}

// Groups of G = per / P lanes (a power of two): each group's score by shuffles within its lanes,
// the topk_group groups by as many warp-wide max rounds.
template <int P>
__device__ __forceinline__ void mask_groups_lanes(const RouterParams& p, float (&c)[P], int lane, int G) {
  const int g = lane / G;
  const bool real = g < p.n_group;
  float gs;
  if (p.group_ranking == 1) {
    gs = -INFINITY;
#pragma unroll
    for (int j = 0; j < P; ++j) gs = c[j] > gs ? c[j] : gs;
    for (int o = 1; o < G; o <<= 1) gs = fmaxf(gs, __shfl_xor_sync(kFull, gs, o));
  } else {
    float b1 = -INFINITY, b2 = -INFINITY;
#pragma unroll
    for (int j = 0; j < P; ++j) {
      const float v = c[j];
      if (v > b1) b2 = b1, b1 = v;
      else if (v > b2) b2 = v;
    }
    for (int o = 1; o < G; o <<= 1) {  // merge two (largest, second) pairs: the same two values on both lanes
      const float o1 = __shfl_xor_sync(kFull, b1, o), o2 = __shfl_xor_sync(kFull, b2, o);
      if (o1 > b1) b2 = fmaxf(b1, o2), b1 = o1;
      else b2 = fmaxf(b2, o1);
    }
    gs = b1 + b2;
  }
  bool kept = false;
  for (int r = 0; r < p.topk_group; ++r) {
    const bool cand = real && !kept;
    const uint32_t key = cand ? value_key(gs) : 0u;
    const uint32_t m = __reduce_max_sync(kFull, key);
    // Equal scores: the lowest lane holds the lowest group.
    const unsigned ball = __ballot_sync(kFull, cand && key == m);
    if (g == (__ffs(ball) - 1) / G) kept = true;
  }
  if (!kept) {
    const float masked = p.group_ranking == 1 ? 0.0f : -INFINITY;
#pragma unroll
    for (int j = 0; j < P; ++j) c[j] = masked;
  }
}

// The shared memory of route_token for a block of W warps; warp i passes buf[i], group[i] and
// weights[i].
template <int W>
struct RouteScratch {
  alignas(16) float buf[W][kRouterMaxExperts];
  float group[W][kRouterMaxExperts];
  float weights[W][kRouterMaxTopK];
};

// One token on one warp; lane L holds experts [L P, L P + P). load(e) gives logit e. buf, group
// and s_w: the warp's rows of a RouteScratch. group_lanes: G for mask_groups_lanes, 0 for the
// shared-memory path. Writes ids[0, k) ascending and weights[0, k), and with p.local_ids the same
// ids as this rank's indices into local_out[0, k).
template <int P, typename Load>
__device__ __forceinline__ void route_token(Load load, const RouterParams& p, int group_lanes,
                                            int lane, float* buf, float* group, float* s_w,
                                            int32_t* id_out, float* weight_out, int32_t* local_out) {
  const int n = p.experts, k = p.top_k, base = lane * P;
  float s[P], b[P];
#pragma unroll
  for (int j = 0; j < P; ++j) {
    const bool in = base + j < n;
    s[j] = in ? load(base + j) : -INFINITY;
    b[j] = in && p.bias ? __ldg(p.bias + base + j) : 0.0f;
  }
  if (!p.sigmoid) {
    float mx = -INFINITY;
#pragma unroll
    for (int j = 0; j < P; ++j) mx = fmaxf(mx, s[j]);
    mx = from_order_key(__reduce_max_sync(kFull, value_key(mx)));
#pragma unroll
    for (int j = 0; j < P; ++j) {
      s[j] = exp_rounded(s[j] - mx);  // exactly 0 past the experts (exp of -inf)
      buf[base + j] = s[j];
    }
    __syncwarp();
    const float sum = serial_sum<P>(buf);
#pragma unroll
    for (int j = 0; j < P; ++j) s[j] = s[j] / sum;
  } else {
#pragma unroll
    for (int j = 0; j < P; ++j) s[j] = 1.0f / (1.0f + exp_rounded(-s[j]));
  }
  float c[P];
#pragma unroll
  for (int j = 0; j < P; ++j) c[j] = s[j] + b[j];

  if (p.group_ranking != 0) {
    if (group_lanes > 0) {
      mask_groups_lanes<P>(p, c, lane, group_lanes);
    } else {
      __syncwarp();  // every lane has read buf for the sum
#pragma unroll
      for (int j = 0; j < P; ++j)
        if (base + j < n) buf[base + j] = c[j];
      __syncwarp();
      mask_groups_shared(p, buf, group, lane);
#pragma unroll
      for (int j = 0; j < P; ++j)
        if (base + j < n) c[j] = buf[base + j];
    }
  }

  uint32_t key[P];
#pragma unroll
  for (int j = 0; j < P; ++j) key[j] = base + j < n ? value_key(c[j]) : 0u;
  const uint32_t taken = take_top_k<P>(key, k, lane);
  // Ascending ids: a chosen expert's slot is the number of chosen experts below it. Counts are
  // <= 16, so five ballots of their bits give every lane its exclusive prefix.
  const int count = __popc(taken);
  const unsigned below = (1u << lane) - 1u;
  int before = 0;
#pragma unroll
  for (int bit = 0; bit < 5; ++bit) before += __popc(__ballot_sync(kFull, count >> bit & 1) & below) << bit;
  // DeepSeek-V2 weighs by the masked scores, the others by the unbiased ones (router.cpp).
#pragma unroll
  for (int j = 0; j < P; ++j)
    if (taken >> j & 1u) {
      const int slot = before + __popc(taken & ((1u << j) - 1u));
      s_w[slot] = p.group_ranking == 1 ? c[j] : s[j];
      id_out[slot] = base + j;
      if (local_out) {
        const int e = base + j - p.local_first;
        local_out[slot] = e >= 0 && e < p.local_count ? e : -1;
      }
    }
  __syncwarp();
  float sum = 0.0f;  // in ascending expert order, as the CPU
#pragma unroll
  for (int j = 0; j < kRouterMaxTopK; ++j)
    if (j < k) sum += s_w[j];
  if (lane < k) {
    float w = s_w[lane];
    if (p.renormalize) w = w / (p.sigmoid ? sum + 1e-20f : sum);
    weight_out[lane] = w * p.scaling;
  }
}

// A padding row (RouterParams::live_rows) takes no expert: route_token's outputs for token t are
// ids -1 and weights 0 instead, and the warp returns true.
__device__ __forceinline__ bool skip_padding_row(const RouterParams& p, int t, int lane, int32_t* id_out,
                                                 float* weight_out, int32_t* local_out) {
  if (!p.live_rows || t < __ldg(p.live_rows)) return false;
  if (lane < p.top_k) {
    id_out[lane] = -1;
    weight_out[lane] = 0.0f;
    if (local_out) local_out[lane] = -1;
  }
  return true;
}

}  // namespace moe::cuda::kernels::route_detail
