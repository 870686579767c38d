// The small per-layer ops of the GPU engine: embedding gather, residual add + RMSNorm, plain
// RMSNorm, SiLU gating, sigmoid row scaling and the q/k/v epilogue (bias, q/k norm, clip, rotary,
// paged-cache scatter). They run at every layer of every decode step, so rows are handled by one
// block (norms) or a warp or half-warp per head (q/k/v) with 16-byte loads where the widths allow, and no
// atomics. Arithmetic follows the CPU kernels (src/backend/cpu/elementwise.cpp) term by term:
// rmsnorm is weight * (x * inv), silu is g / (1 + exp(-g)) * u, so only reduction order and
// libm-level rounding differ. Only CUDA headers here (see ops_launch.h).
#include <cuda_bf16.h>

#include <cstdint>

#include "backend/cuda/ops/ops_launch.h"
#include "backend/cuda/pdl.h"

namespace moe::cuda::kernels {

namespace {

__device__ __forceinline__ float bf(uint16_t b) { return __uint_as_float(static_cast<uint32_t>(b) << 16); }
__device__ __forceinline__ uint16_t to_bf(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
__device__ __forceinline__ uint32_t pack2(float a, float b) {
  return static_cast<uint32_t>(to_bf(a)) | (static_cast<uint32_t>(to_bf(b)) << 16);
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// Sum over the block, broadcast to every thread; `red` holds 32 floats.
__device__ float block_sum(float v, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v);
  __syncthreads();  // red may still be read by a previous call
  if (lane == 0) red[warp] = v;
  __syncthreads();
  v = lane < warps ? red[lane] : 0.0f;
  return warp_sum(v);
}

// ---- embed ----------------------------------------------------------------------------------

// One block per token; 8 bf16 (16 bytes) per thread per step when `vec`.
__global__ void embed_kernel(const uint16_t* __restrict__ table, const int32_t* __restrict__ ids,
                             int hidden, int vocab, bool vec, float* __restrict__ out) {
  begin_dependent();  // first: see pdl.h
  const int t = blockIdx.x;
  const int id = ids[t];
  const bool ok = id >= 0 && id < vocab;
  float* o = out + static_cast<size_t>(t) * hidden;
  const uint16_t* row = table + static_cast<size_t>(ok ? id : 0) * hidden;
  if (vec) {
    for (int c = threadIdx.x; c < hidden / 8; c += blockDim.x) {
      uint4 w = ok ? __ldg(reinterpret_cast<const uint4*>(row) + c) : make_uint4(0, 0, 0, 0);
      const uint32_t u[4] = {w.x, w.y, w.z, w.w};
      float f[8];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        f[2 * i] = __uint_as_float(u[i] << 16);
        f[2 * i + 1] = __uint_as_float(u[i] & 0xffff0000u);
      }
      reinterpret_cast<float4*>(o)[2 * c] = make_float4(f[0], f[1], f[2], f[3]);
      reinterpret_cast<float4*>(o)[2 * c + 1] = make_float4(f[4], f[5], f[6], f[7]);
    }
  } else {
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) o[i] = ok ? bf(row[i]) : 0.0f;
  }
}

// ---- add + rmsnorm ----------------------------------------------------------------------------

constexpr int kNormChunks = 4;  // float4 chunks per thread held in registers on the fast path
constexpr int kNormMaxThreads = 1024;

// One block per row. Fast path (`vec`): width % 4 == 0 and width <= 4 * kNormChunks * blockDim,
// the row stays in registers between the sum of squares and the output. Otherwise the row is
// walked twice (the second read is this thread's own earlier write or input, from cache).
__global__ void add_rms_norm_kernel(float* __restrict__ x, const float* __restrict__ in,
                                    const uint16_t* __restrict__ b1, const uint16_t* __restrict__ b2,
                                    const float* __restrict__ weight, int width, float eps,
                                    bool vec, uint16_t* __restrict__ out) {
  begin_dependent();  // first: see pdl.h
  __shared__ float red[32];
  const size_t base = static_cast<size_t>(blockIdx.x) * width;
  const float* src = in ? in + base : x + base;
  float ss = 0.0f;
  if (vec) {
    const int n4 = width / 4;
    float4 v[kNormChunks];
#pragma unroll
    for (int j = 0; j < kNormChunks; ++j) {
      const int c = threadIdx.x + j * blockDim.x;
      if (c >= n4) continue;
      float4 a = reinterpret_cast<const float4*>(src)[c];
      if (b1) {
        const uint2 w = reinterpret_cast<const uint2*>(b1 + base)[c];
        a.x += __uint_as_float(w.x << 16), a.y += __uint_as_float(w.x & 0xffff0000u);
        a.z += __uint_as_float(w.y << 16), a.w += __uint_as_float(w.y & 0xffff0000u);
      }
      if (b2) {
        const uint2 w = reinterpret_cast<const uint2*>(b2 + base)[c];
        a.x += __uint_as_float(w.x << 16), a.y += __uint_as_float(w.x & 0xffff0000u);
        a.z += __uint_as_float(w.y << 16), a.w += __uint_as_float(w.y & 0xffff0000u);
      }
      if (b1 || b2) reinterpret_cast<float4*>(x + base)[c] = a;
      ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
      v[j] = a;
    }
    if (!out) return;
    ss = block_sum(ss, red);
    const float inv = 1.0f / sqrtf(ss / static_cast<float>(width) + eps);
#pragma unroll
    for (int j = 0; j < kNormChunks; ++j) {
      const int c = threadIdx.x + j * blockDim.x;
      if (c >= n4) continue;
      const float4 w = reinterpret_cast<const float4*>(weight)[c];
      const float4 a = v[j];
      reinterpret_cast<uint2*>(out + base)[c] =
          make_uint2(pack2(w.x * (a.x * inv), w.y * (a.y * inv)),
                     pack2(w.z * (a.z * inv), w.w * (a.w * inv)));
    }
    return;
  }
  for (int i = threadIdx.x; i < width; i += blockDim.x) {
    float a = src[i];
    if (b1) a += bf(b1[base + i]);
    if (b2) a += bf(b2[base + i]);
    if (b1 || b2) x[base + i] = a;
    ss += a * a;
  }
  if (!out) return;
  ss = block_sum(ss, red);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(width) + eps);
  const float* again = (b1 || b2) ? x + base : src;
  for (int i = threadIdx.x; i < width; i += blockDim.x)
    out[base + i] = to_bf(weight[i] * (again[i] * inv));
}

cudaError_t launch_norm(float* x, const float* in, const uint16_t* b1, const uint16_t* b2,
                        const float* weight, int rows, int width, float eps, uint16_t* out,
                        cudaStream_t stream) {
  if (rows < 0 || width <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaGetLastError();
  const int n4 = width / 4;
  const bool vec = width % 4 == 0 && n4 <= kNormChunks * kNormMaxThreads &&
                   aligned16(in ? static_cast<const void*>(in) : x) && aligned16(weight) &&
                   (!b1 || (reinterpret_cast<uintptr_t>(b1) & 7) == 0) &&
                   (!b2 || (reinterpret_cast<uintptr_t>(b2) & 7) == 0) &&
                   (!out || (reinterpret_cast<uintptr_t>(out) & 7) == 0);
  int threads = vec ? (n4 + kNormChunks - 1) / kNormChunks : width;
  threads = ((threads + 31) / 32) * 32;
  threads = threads < 64 ? 64 : (threads > kNormMaxThreads ? kNormMaxThreads : threads);
  launch_dependent(add_rms_norm_kernel, rows, threads, 0, stream, x, in, b1, b2, weight, width, eps, vec, out);
  return cudaGetLastError();
}

// ---- elementwise ------------------------------------------------------------------------------

__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// Grid-stride over tokens * inter / 8 chunks when `vec` (inter % 8 == 0), else over elements.
__global__ void silu_mul_kernel(const uint16_t* __restrict__ gu, int tokens, int inter, bool vec,
                                uint16_t* __restrict__ act) {
  begin_dependent();  // first: see pdl.h
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  if (vec) {
    const int per = inter / 8;
    const size_t n = static_cast<size_t>(tokens) * per;
    for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
      const size_t t = i / per, c = i % per;
      const uint4 g = __ldg(reinterpret_cast<const uint4*>(gu + t * 2 * inter) + c);
      const uint4 u = __ldg(reinterpret_cast<const uint4*>(gu + t * 2 * inter + inter) + c);
      const uint32_t ga[4] = {g.x, g.y, g.z, g.w}, ua[4] = {u.x, u.y, u.z, u.w};
      uint32_t r[4];
#pragma unroll
      for (int j = 0; j < 4; ++j)
        r[j] = pack2(silu_times(__uint_as_float(ga[j] << 16), __uint_as_float(ua[j] << 16)),
                     silu_times(__uint_as_float(ga[j] & 0xffff0000u),
                                __uint_as_float(ua[j] & 0xffff0000u)));
      reinterpret_cast<uint4*>(act + t * inter)[c] = make_uint4(r[0], r[1], r[2], r[3]);
    }
    return;
  }
  const size_t n = static_cast<size_t>(tokens) * inter;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const size_t t = i / inter, c = i % inter;
    act[i] = to_bf(silu_times(bf(gu[t * 2 * inter + c]), bf(gu[t * 2 * inter + inter + c])));
  }
}

__global__ void sigmoid_scale_kernel(uint16_t* __restrict__ y, const float* __restrict__ gate,
                                     int rows, int width, bool vec) {
  begin_dependent();  // first: see pdl.h
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  const int per = vec ? width / 8 : width;
  const size_t n = static_cast<size_t>(rows) * per;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n; i += stride) {
    const size_t r = i / per;
    const float s = 1.0f / (1.0f + expf(-gate[r]));
    if (vec) {
      uint4* p = reinterpret_cast<uint4*>(y) + i;
      uint4 v = *p;
      uint32_t a[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j)
        a[j] = pack2(__uint_as_float(a[j] << 16) * s, __uint_as_float(a[j] & 0xffff0000u) * s);
      *p = make_uint4(a[0], a[1], a[2], a[3]);
    } else {
      y[i] = to_bf(bf(y[i]) * s);
    }
  }
}

int grid_for(size_t work, int threads) {
  const size_t blocks = (work + threads - 1) / threads;
  return static_cast<int>(blocks < 1 ? 1 : (blocks > 4096 ? 4096 : blocks));
}

// ---- q/k/v epilogue ---------------------------------------------------------------------------

constexpr int kQkvWarps = 8;

// The rotation's sines and cosines (scaled by rope_scale) of tokens t0 .. t0 + n - 1 for frequency
// indices below rh, into sin_ / cos_ rows of `stride` floats: they depend on the token only, so a
// block computes them once for all its heads, before waiting for the projection (pdl.h).
__device__ __forceinline__ void rotation_table(const QkvParams& p, int t0, int n, int rh, int stride,
                                               float* sin_, float* cos_) {
  for (int i = threadIdx.x; i < n * rh; i += blockDim.x) {
    const int u = i / rh, q = i % rh;
    const float pos = p.positions ? static_cast<float>(p.positions[t0 + u]) : 0.0f;
    float sn, cs;
    sincosf(pos * p.inv_freq[q], &sn, &cs);
    sin_[u * stride + q] = sn * p.rope_scale;
    cos_[u * stride + q] = cs * p.rope_scale;
  }
}

// The full-width q/k norm (qk_norm 2, OLMoE): 1 / rms of the q part and of the k part of each of
// the n rows from t0, into inv[u][0] and inv[u][1] (thread 0 writes; the caller syncs). Every
// block of a token needs both sums; recomputing them per block is cheaper than another launch at
// decode sizes.
__device__ void full_width_inverses(const uint16_t* qkv, const QkvParams& p, int hd, int t0, int n,
                                    float* red, float (*inv)[2]) {
  const int qw = p.q_heads * hd, kw = p.kv_heads * hd, width = (p.q_heads + 2 * p.kv_heads) * hd;
  for (int u = 0; u < n; ++u) {
    const uint16_t* row = qkv + static_cast<size_t>(t0 + u) * width;
    float sq = 0.0f, sk = 0.0f;
    for (int i = threadIdx.x; i < qw + kw; i += blockDim.x) {
      float v = bf(row[i]) + (p.bias ? p.bias[i] : 0.0f);
      (i < qw ? sq : sk) += v * v;
    }
    sq = block_sum(sq, red);
    sk = block_sum(sk, red);
    if (threadIdx.x == 0) {
      inv[u][0] = 1.0f / sqrtf(sq / static_cast<float>(qw) + p.eps);
      inv[u][1] = 1.0f / sqrtf(sk / static_cast<float>(kw) + p.eps);
    }
  }
}

// Grid (token groups of T, head tiles of kQkvWarps); one warp per head of q | k | v, for each of
// the group's T tokens. Lane l owns the feature pairs p = l + 32 m, m < PPL (pairs a lane: the head
// dim / 64, rounded up): rotated pairs (p, p + rot/2) or (2p, 2p + 1) for p < rot/2, then
// consecutive unrotated pairs, so the norm, clip and rotation of a pair never leave the lane. The
// rotation's sines and cosines depend on the token only: the block computes its tokens' once into
// shared memory for its heads. (With one warp computing its own, four warps a block and PPL fixed
// at 4, the 2048-token prefill of qwen3-30b-a3b issued 485 instructions a head and was
// issue-bound: 53 µs a layer under ncu.) A warp issues all T tokens' loads before using any: with
// one token a block a prefill ran about ten waves of short blocks, each a chain of dependent
// latencies (qk_group below). This form serves every layout; the usual one (the whole head
// rotated by halves, head_dim 64 x PPL) takes qkv_whole_kernel below.
template <int PPL, int T>
__global__ void __launch_bounds__(kQkvWarps * 32) qkv_kernel(const uint16_t* __restrict__ qkv,
                                                             QkvParams p) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int head = blockIdx.y * kQkvWarps + warp;
  const bool real = head < p.q_heads + 2 * p.kv_heads;
  const int kind = head < p.q_heads ? 0 : (head < p.q_heads + p.kv_heads ? 1 : 2);  // q, k, v
  const int h = kind == 0 ? head : (kind == 1 ? head - p.q_heads : head - p.q_heads - p.kv_heads);
  const int hd = p.head_dim, pairs = hd / 2, rh = p.rot_dim / 2;
  const bool rope_half = p.rope_half;
  const bool normed = p.qk_norm != 0 && kind != 2;
  const float* w = kind == 0 ? p.q_norm : p.k_norm;
  if (normed && p.qk_norm == 2) w += static_cast<size_t>(h) * hd;

  // What does not depend on the projection is read and computed before waiting for it (pdl.h),
  // overlapping its tail: the norm scales, the tokens' positions and cache slots (metadata,
  // constant over the forward) and the rotation's sines and cosines.
  const int t0 = blockIdx.x * T, n = min(T, p.tokens - t0);
  __shared__ float rot_sin[T][kQkvMaxHeadDim / 2], rot_cos[T][kQkvMaxHeadDim / 2];
  rotation_table(p, t0, n, rh, kQkvMaxHeadDim / 2, &rot_sin[0][0], &rot_cos[0][0]);
  int slot[T];
#pragma unroll
  for (int u = 0; u < T; ++u) slot[u] = kind == 0 || u >= n ? 0 : p.slots[t0 + u];
  int e0[PPL], e1[PPL];
  float w0[PPL], w1[PPL];
#pragma unroll
  for (int m = 0; m < PPL; ++m) {
    const int q = lane + 32 * m;
    if (q < rh) {
      e0[m] = rope_half ? q : 2 * q;
      e1[m] = rope_half ? q + rh : 2 * q + 1;
    } else {
      e0[m] = 2 * rh + 2 * (q - rh);  // rot_dim = 2 rh
      e1[m] = e0[m] + 1;
    }
    const bool mine = real && q < pairs;
    w0[m] = mine && normed ? w[e0[m]] : 1.0f;
    w1[m] = mine && normed ? w[e1[m]] : 1.0f;
  }
  wait_for_predecessor();
  allow_dependents();
  __shared__ float red[32];
  __shared__ float full_inv[T][2];
  const int width = (p.q_heads + 2 * p.kv_heads) * hd;
  if (p.qk_norm == 2) full_width_inverses(qkv, p, hd, t0, n, red, full_inv);
  __syncthreads();  // the sines and cosines, and full_inv
  if (!real) return;
  const float* bias = p.bias ? p.bias + static_cast<size_t>(head) * hd : nullptr;

  float a[T][PPL], b[T][PPL];
#pragma unroll
  for (int u = 0; u < T; ++u) {
    const uint16_t* src = qkv + static_cast<size_t>(t0 + u) * width + static_cast<size_t>(head) * hd;
#pragma unroll
    for (int m = 0; m < PPL; ++m) {
      const int q = lane + 32 * m;
      const bool in = u < n && q < pairs;
      a[u][m] = in ? bf(src[e0[m]]) : 0.0f;
      b[u][m] = in ? bf(src[e1[m]]) : 0.0f;
    }
  }
#pragma unroll
  for (int u = 0; u < T; ++u) {
    if (u >= n) break;
    float ss = 0.0f;
#pragma unroll
    for (int m = 0; m < PPL; ++m) {
      const int q = lane + 32 * m;
      if (q < pairs) {
        a[u][m] += bias ? bias[e0[m]] : 0.0f;
        b[u][m] += bias ? bias[e1[m]] : 0.0f;
        ss += a[u][m] * a[u][m] + b[u][m] * b[u][m];
      }
    }
    float inv = 1.0f;
    if (normed)
      inv = p.qk_norm == 1 ? 1.0f / sqrtf(warp_sum(ss) / static_cast<float>(hd) + p.eps) : full_inv[u][kind];
    const int t = t0 + u;
    uint16_t* dst;
    if (kind == 0) {
      dst = p.q_out + (static_cast<size_t>(t) * p.q_heads + h) * hd;
    } else {
      if (slot[u] < 0) continue;  // padding: no k, v
      dst = (kind == 1 ? p.k_cache : p.v_cache) + (static_cast<size_t>(slot[u]) * p.kv_heads + h) * hd;
    }
#pragma unroll
    for (int m = 0; m < PPL; ++m) {
      const int q = lane + 32 * m;
      if (q >= pairs) continue;
      const int i0 = e0[m], i1 = e1[m];
      float x0 = a[u][m], x1 = b[u][m];
      if (normed) {
        x0 = w0[m] * (x0 * inv);
        x1 = w1[m] * (x1 * inv);
      }
      if (p.clip > 0.0f) {
        x0 = fminf(fmaxf(x0, -p.clip), p.clip);
        x1 = fminf(fmaxf(x1, -p.clip), p.clip);
      }
      if (kind != 2 && q < rh) {
        const float sn = rot_sin[u][q], c = rot_cos[u][q];
        const float r0 = x0 * c - x1 * sn, r1 = x1 * c + x0 * sn;
        x0 = r0;
        x1 = r1;
      }
      if (i1 == i0 + 1) {
        *reinterpret_cast<uint32_t*>(dst + i0) = pack2(x0, x1);
      } else {
        dst[i0] = to_bf(x0);
        dst[i1] = to_bf(x1);
      }
    }
  }
}

// The usual layout (the whole head rotated by halves, head_dim = 64 x PPL: Qwen3-MoE, Mixtral,
// OLMoE, Qwen2-MoE) two heads a warp: the 16 lanes of a half-warp hold one head, lane l the
// 2 PPL consecutive features from l x 2 PPL of each half, which a rotated pair never leaves
// (feature i pairs with i + head_dim / 2). The loads and stores are 4, 8 or 16 bytes wide, the
// sines and cosines one shared-memory vector a half, and the norm's sum takes four shuffles. Sizes
// are compile-time constants. Against one head a warp with 2-byte accesses (qkv_kernel in this
// layout), ncu in the 2048-token prefill of qwen3-30b-a3b on an H200: 23.3-24.9 -> 16.7-19.1 µs a
// layer, 16.3M -> 10.6M warp instructions (docs/perf/qkv-two-heads-a-warp.md).
// Needs qkv 4 x PPL-byte aligned (the caller checks); the halves of a warp shuffle together, so a
// half past the last head runs the arithmetic on zeros and stores nothing.
template <int PPL>
struct BfVec;  // kE = 2 PPL bf16 as one load
template <>
struct BfVec<1> { using type = uint32_t; };
template <>
struct BfVec<2> { using type = uint2; };
template <>
struct BfVec<4> { using type = uint4; };

template <int PPL>
__device__ __forceinline__ void unpack_bf(const typename BfVec<PPL>::type& v, float* f) {
  const uint32_t* w = reinterpret_cast<const uint32_t*>(&v);
#pragma unroll
  for (int i = 0; i < PPL; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}
template <int PPL>
__device__ __forceinline__ typename BfVec<PPL>::type pack_bf(const float* f) {
  typename BfVec<PPL>::type v;
  uint32_t* w = reinterpret_cast<uint32_t*>(&v);
#pragma unroll
  for (int i = 0; i < PPL; ++i) w[i] = pack2(f[2 * i], f[2 * i + 1]);
  return v;
}

template <int PPL, int T>
__global__ void __launch_bounds__(kQkvWarps * 32) qkv_whole_kernel(const uint16_t* __restrict__ qkv,
                                                                   QkvParams p) {
  using Vec = typename BfVec<PPL>::type;
  constexpr int kHd = 64 * PPL, kRh = kHd / 2, kE = 2 * PPL;  // kE features a lane in each half
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, c0 = (lane & 15) * kE;
  const int heads = p.q_heads + 2 * p.kv_heads;
  const int head = (blockIdx.y * kQkvWarps + warp) * 2 + (lane >> 4);
  const bool real = head < heads;
  const int kind = head < p.q_heads ? 0 : (head < p.q_heads + p.kv_heads ? 1 : 2);  // q, k, v
  const int h = kind == 0 ? head : (kind == 1 ? head - p.q_heads : head - p.q_heads - p.kv_heads);
  const bool normed = p.qk_norm != 0 && kind != 2;
  const float* w = kind == 0 ? p.q_norm : p.k_norm;
  if (normed && p.qk_norm == 2) w += static_cast<size_t>(h) * kHd;

  // Before the wait (pdl.h): the norm scales, the tokens' slots, the sines and cosines.
  const int t0 = blockIdx.x * T, n = min(T, p.tokens - t0);
  __shared__ __align__(16) float rot_sin[T][kRh];
  __shared__ __align__(16) float rot_cos[T][kRh];
  rotation_table(p, t0, n, kRh, kRh, &rot_sin[0][0], &rot_cos[0][0]);
  int slot[T];
#pragma unroll
  for (int u = 0; u < T; ++u) slot[u] = kind == 0 || u >= n || !real ? 0 : p.slots[t0 + u];
  float w0[kE], w1[kE];
#pragma unroll
  for (int j = 0; j < kE; ++j) {
    w0[j] = real && normed ? w[c0 + j] : 1.0f;
    w1[j] = real && normed ? w[kRh + c0 + j] : 1.0f;
  }
  wait_for_predecessor();
  allow_dependents();
  __shared__ float red[32];
  __shared__ float full_inv[T][2];
  const int width = heads * kHd;
  if (p.qk_norm == 2) full_width_inverses(qkv, p, kHd, t0, n, red, full_inv);
  __syncthreads();  // the sines and cosines, and full_inv
  const float* bias = p.bias && real ? p.bias + static_cast<size_t>(head) * kHd : nullptr;

  float a[T][kE], b[T][kE];
#pragma unroll
  for (int u = 0; u < T; ++u) {
    const bool in = real && u < n;
    const uint16_t* src = qkv + static_cast<size_t>(t0 + (in ? u : 0)) * width +
                          static_cast<size_t>(in ? head : 0) * kHd + c0;
    Vec va{}, vb{};
    if (in) {
      va = *reinterpret_cast<const Vec*>(src);
      vb = *reinterpret_cast<const Vec*>(src + kRh);
    }
    unpack_bf<PPL>(va, a[u]);
    unpack_bf<PPL>(vb, b[u]);
  }
#pragma unroll
  for (int u = 0; u < T; ++u) {
    if (u >= n) break;
    float ss = 0.0f;
#pragma unroll
    for (int j = 0; j < kE; ++j) {
      if (bias) {
        a[u][j] += bias[c0 + j];
        b[u][j] += bias[kRh + c0 + j];
      }
      ss += a[u][j] * a[u][j] + b[u][j] * b[u][j];
    }
    float inv = 1.0f;
    if (p.qk_norm == 1) {
#pragma unroll
      for (int o = 8; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
      if (normed) inv = 1.0f / sqrtf(ss / static_cast<float>(kHd) + p.eps);
    } else if (normed) {
      inv = full_inv[u][kind];
    }
    const bool store = real && (kind == 0 || slot[u] >= 0);  // a negative slot: padding
    if (!store) continue;
    const int t = t0 + u;
    uint16_t* dst = kind == 0 ? p.q_out + (static_cast<size_t>(t) * p.q_heads + h) * kHd
                              : (kind == 1 ? p.k_cache : p.v_cache) +
                                    (static_cast<size_t>(slot[u]) * p.kv_heads + h) * kHd;
    float x0[kE], x1[kE];
#pragma unroll
    for (int j = 0; j < kE; ++j) {
      x0[j] = a[u][j];
      x1[j] = b[u][j];
      if (normed) {
        x0[j] = w0[j] * (x0[j] * inv);
        x1[j] = w1[j] * (x1[j] * inv);
      }
      if (p.clip > 0.0f) {
        x0[j] = fminf(fmaxf(x0[j], -p.clip), p.clip);
        x1[j] = fminf(fmaxf(x1[j], -p.clip), p.clip);
      }
    }
    if (kind != 2) {
#pragma unroll
      for (int j = 0; j < kE; ++j) {
        const float sn = rot_sin[u][c0 + j], c = rot_cos[u][c0 + j];
        const float r0 = x0[j] * c - x1[j] * sn, r1 = x1[j] * c + x0[j] * sn;
        x0[j] = r0;
        x1[j] = r1;
      }
    }
    *reinterpret_cast<Vec*>(dst + c0) = pack_bf<PPL>(x0);
    *reinterpret_cast<Vec*>(dst + kRh + c0) = pack_bf<PPL>(x1);
  }
}

// Tokens a block takes: four from kQkvGroupFrom tokens (prefill chunks; the grid still runs four
// or more waves of blocks at 1024), one below (decode steps, one block a token as before). H100,
// 2048-token prefill of qwen3-30b-a3b, 48 layers: 1.98 -> 1.74 ms (FP8), 1.99 -> 1.80 ms (bf16);
// smaller chunks were not measured (docs/perf/qkv-bf16-grouped-epilogue.md).
constexpr int kQkvGroupFrom = 1024;
int qk_group(int tokens) { return tokens >= kQkvGroupFrom ? 4 : 1; }

template <int PPL>
void launch_qkv(int group, dim3 grid, cudaStream_t stream, const uint16_t* qkv, const QkvParams& p) {
  if (group == 4) launch_dependent(qkv_kernel<PPL, 4>, grid, kQkvWarps * 32, 0, stream, qkv, p);
  else launch_dependent(qkv_kernel<PPL, 1>, grid, kQkvWarps * 32, 0, stream, qkv, p);
}

// The usual layout (qkv_whole_kernel): two heads a warp, so half the warps of qkv_kernel's grid.
template <int PPL>
void launch_qkv_whole(int group, int heads, cudaStream_t stream, const uint16_t* qkv, const QkvParams& p) {
  const dim3 grid((p.tokens + group - 1) / group, (heads + 2 * kQkvWarps - 1) / (2 * kQkvWarps));
  if (group == 4) launch_dependent(qkv_whole_kernel<PPL, 4>, grid, kQkvWarps * 32, 0, stream, qkv, p);
  else launch_dependent(qkv_whole_kernel<PPL, 1>, grid, kQkvWarps * 32, 0, stream, qkv, p);
}

}  // namespace

cudaError_t embed(const uint16_t* table, const int32_t* ids, int tokens, int hidden, int vocab,
                  float* out, cudaStream_t stream) {
  if (tokens < 0 || hidden <= 0 || vocab <= 0) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaGetLastError();
  const bool vec = hidden % 8 == 0 && aligned16(table) && aligned16(out);
  const int work = vec ? hidden / 8 : hidden;
  int threads = ((work + 31) / 32) * 32;
  threads = threads > 256 ? 256 : threads;
  launch_dependent(embed_kernel, tokens, threads, 0, stream, table, ids, hidden, vocab, vec, out);
  return cudaGetLastError();
}

cudaError_t add_rms_norm(float* x, const uint16_t* branch, const uint16_t* branch2,
                         const float* weight, int rows, int width, float eps, uint16_t* out,
                         cudaStream_t stream) {
  return launch_norm(x, nullptr, branch, branch2, weight, rows, width, eps, out, stream);
}

cudaError_t rms_norm(const float* in, const float* weight, int rows, int width, float eps,
                     uint16_t* out, cudaStream_t stream) {
  if (!out) return cudaErrorInvalidValue;
  return launch_norm(nullptr, in, nullptr, nullptr, weight, rows, width, eps, out, stream);
}

cudaError_t silu_mul(const uint16_t* gate_up, int tokens, int inter, uint16_t* act,
                     cudaStream_t stream) {
  if (tokens < 0 || inter <= 0) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaGetLastError();
  const bool vec = inter % 8 == 0 && aligned16(gate_up) && aligned16(act);
  const size_t work = static_cast<size_t>(tokens) * (vec ? inter / 8 : inter);
  launch_dependent(silu_mul_kernel, grid_for(work, 256), 256, 0, stream, gate_up, tokens, inter, vec, act);
  return cudaGetLastError();
}

cudaError_t sigmoid_scale_rows(uint16_t* y, const float* gate, int rows, int width,
                               cudaStream_t stream) {
  if (rows < 0 || width <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaGetLastError();
  const bool vec = width % 8 == 0 && aligned16(y);
  const size_t work = static_cast<size_t>(rows) * (vec ? width / 8 : width);
  launch_dependent(sigmoid_scale_kernel, grid_for(work, 256), 256, 0, stream, y, gate, rows, width, vec);
  return cudaGetLastError();
}

cudaError_t prepare_qkv(const uint16_t* qkv, const QkvParams& p, cudaStream_t stream) {
  if (p.tokens < 0 || p.q_heads <= 0 || p.kv_heads <= 0 || p.head_dim <= 0 ||
      p.head_dim % 2 != 0 || p.head_dim > kQkvMaxHeadDim || p.rot_dim < 0 || p.rot_dim % 2 != 0 ||
      p.rot_dim > p.head_dim || p.qk_norm < 0 || p.qk_norm > 2 ||
      (p.qk_norm != 0 && (!p.q_norm || !p.k_norm)) || (p.rot_dim > 0 && (!p.inv_freq || !p.positions)) ||
      !p.slots || !p.k_cache || !p.v_cache || !p.q_out || (reinterpret_cast<uintptr_t>(qkv) & 3) != 0)
    return cudaErrorInvalidValue;
  if (p.tokens == 0) return cudaGetLastError();
  const int heads = p.q_heads + 2 * p.kv_heads, group = qk_group(p.tokens);
  // The usual layout two heads a warp wherever its vector accesses (4 x PPL bytes) are aligned,
  // as the engine's buffers always are.
  const bool usual = p.rope_half && p.rot_dim == p.head_dim &&
                     (p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256);
  const uintptr_t addresses = reinterpret_cast<uintptr_t>(qkv) | reinterpret_cast<uintptr_t>(p.q_out) |
                              reinterpret_cast<uintptr_t>(p.k_cache) | reinterpret_cast<uintptr_t>(p.v_cache);
  if (usual && addresses % (2 * p.head_dim / 32) == 0) {
    if (p.head_dim == 64) launch_qkv_whole<1>(group, heads, stream, qkv, p);
    else if (p.head_dim == 128) launch_qkv_whole<2>(group, heads, stream, qkv, p);
    else launch_qkv_whole<4>(group, heads, stream, qkv, p);
    return cudaGetLastError();
  }
  const dim3 grid((p.tokens + group - 1) / group, (heads + kQkvWarps - 1) / kQkvWarps);
  const int pairs_per_lane = (p.head_dim / 2 + 31) / 32;
  if (pairs_per_lane <= 1) launch_qkv<1>(group, grid, stream, qkv, p);
  else if (pairs_per_lane <= 2) launch_qkv<2>(group, grid, stream, qkv, p);
  else launch_qkv<4>(group, grid, stream, qkv, p);
  return cudaGetLastError();
}

}  // namespace moe::cuda::kernels
