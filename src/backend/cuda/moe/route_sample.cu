// Routers and token samplers on the device (contracts in ops_launch.h).
//
// route: one warp per token, lane L holding experts [L P, L P + P) in registers (P = 1..16, the
// smallest with 32 P >= experts), the device twin of moe::route (src/moe/router.cpp). It chooses
// the very same experts because it reproduces the CPU arithmetic, not just the maths:
// exponentials in double rounded to f32 (a correctly rounded expf; glibc's expf may differ from
// it in rare last-bit cases), the softmax denominator added in expert order as the CPU loop does
// (every lane adds the same shared words, a chain of one add per expert), the score divided by
// it, and every comparison by the router's rule: higher value first, then the lower index. The
// choice cannot be taken from the logits alone: distinct logits can round to one score (e.g.
// -1e30 and -inf both score 0, and two logits a few ulps apart can meet after the exp or the
// division), and the CPU then takes the lower index. The k choices are k rounds of a warp-wide
// max (redux) over each lane's best remaining expert; groups that fall on lane boundaries
// (DeepSeek-V3's 8 of 32) are scored by shuffles, others through shared memory.
//
// sample_rows: one cluster of 8 blocks per row, each block holding its eighth of the row as
// z = logit / T in shared memory, so the row is read once and the passes after it run on-chip,
// on 8 SMs per row. Candidates are ordered by the composite key (z descending, index ascending),
// a strict total order, so "the top_k" and "the smallest top_p prefix" are both the set of tokens
// at or above one threshold (key K, index I). Each threshold comes from a select over histograms
// summed across the cluster through distributed shared memory: a first level by distance to the
// top (1/16 of a unit of z per bin), which spreads the tokens that matter over many bins, then the
// order key 8 bits at a time within the found bin, then one pass in index order among the tokens
// whose key equals K. The top_p search weighs each token by its probability in 2^-45 fixed point,
// so its sums are integers and the outcome does not depend on the order they are added in: the
// same (seed, step) always gives the same token. The draw is Gumbel-max over the allowed set with
// a counter-based hash of (seed, step, token) as the uniform source.
#include <cooperative_groups.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cmath>
#include <cstdint>

#include "backend/cuda/bf16x8.cuh"
#include "backend/cuda/ops/ops_launch.h"
#include "backend/cuda/pdl.h"
#include "backend/cuda/moe/route_device.cuh"

namespace moe::cuda::kernels {

namespace {

namespace cg = cooperative_groups;

using namespace route_detail;

// ---- router -----------------------------------------------------------------------------------

constexpr int kRouteWarps = 4;

// One warp per token (route_detail::route_token).
template <int P>
__global__ void __launch_bounds__(kRouteWarps * 32) route_kernel(const float* __restrict__ logits,
                                                                 RouterParams p, int tokens, int group_lanes,
                                                                 int32_t* __restrict__ ids,
                                                                 float* __restrict__ weights) {
  begin_dependent();  // first: see pdl.h
  __shared__ RouteScratch<kRouteWarps> s_scratch;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = blockIdx.x * kRouteWarps + warp;
  if (t >= tokens) return;
  const float* row = logits + static_cast<size_t>(t) * p.experts;
  int32_t* local = p.local_ids ? p.local_ids + static_cast<size_t>(t) * p.top_k : nullptr;
  route_detail::route_token<P>([&](int e) { return __ldg(row + e); }, p, group_lanes, lane,
                               s_scratch.buf[warp], s_scratch.group[warp], s_scratch.weights[warp],
                               ids + static_cast<size_t>(t) * p.top_k,
                               weights + static_cast<size_t>(t) * p.top_k, local);
  // A padding row is routed and then overwritten: a branch around route_token made ptxas spill.
  __syncwarp();
  skip_padding_row(p, t, lane, ids + static_cast<size_t>(t) * p.top_k, weights + static_cast<size_t>(t) * p.top_k,
                   local);
}

// route() with the projection folded in, for small routers: one warp per token computes the
// logits (lane-strided 16-byte chunks of the bf16 rows, f32 products summed per lane, then a
// butterfly across the warp) into shared memory and routes from there.
template <int P>
__global__ void __launch_bounds__(kRouteWarps * 32) route_hidden_kernel(
    const uint16_t* __restrict__ x, const uint16_t* __restrict__ w, int hidden, RouterParams p,
    int tokens, int group_lanes, int32_t* __restrict__ ids, float* __restrict__ weights,
    float* __restrict__ logits) {
  begin_dependent();
  __shared__ __align__(16) float s_logit[kRouteWarps][kRouterMaxExperts];
  __shared__ RouteScratch<kRouteWarps> s_scratch;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int t = blockIdx.x * kRouteWarps + warp;
  if (t >= tokens) return;
  const uint4* xr = reinterpret_cast<const uint4*>(x + static_cast<size_t>(t) * hidden);
  const int chunks = hidden / 8;
  // `span` lanes share an expert (a power of two; all 32 for one expert, one lane each past 32
  // experts), so that every lane's loads are independent and in flight together.
  int span = 32;
  while (span > 1 && span * p.experts > 32) span >>= 1;
  const int per_pass = 32 / span, part = lane % span;
  // Loads in batches of kBatch per lane, all issued before the first is used (a plain loop
  // keeps one pair in flight: 16 round trips in a row at hidden 512 and 8 experts); the adds
  // stay in chunk order.
  constexpr int kBatch = 8;
  for (int e0 = 0; e0 < p.experts; e0 += per_pass) {
    const int e = e0 + lane / span;
    float sum = 0.0f;
    if (e < p.experts) {
      const uint4* wr = reinterpret_cast<const uint4*>(w + static_cast<size_t>(e) * hidden);
      for (int c0 = part; c0 < chunks; c0 += kBatch * span) {
        uint4 wv[kBatch], xv[kBatch];
#pragma unroll
        for (int i = 0; i < kBatch; ++i) {
          const int c = c0 + i * span;
          wv[i] = c < chunks ? __ldg(wr + c) : make_uint4(0, 0, 0, 0);
          xv[i] = c < chunks ? __ldg(xr + c) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int i = 0; i < kBatch; ++i)
          if (c0 + i * span < chunks) sum += dot_bf16x8(wv[i], xv[i]);
      }
    }
    for (int o = span / 2; o > 0; o >>= 1) sum += __shfl_xor_sync(kFull, sum, o);
    if (part == 0 && e < p.experts) s_logit[warp][e] = sum;
  }
  __syncwarp();
  if (logits)
    for (int e = lane; e < p.experts; e += 32) logits[static_cast<size_t>(t) * p.experts + e] = s_logit[warp][e];
  if (skip_padding_row(p, t, lane, ids + static_cast<size_t>(t) * p.top_k, weights + static_cast<size_t>(t) * p.top_k,
                       p.local_ids ? p.local_ids + static_cast<size_t>(t) * p.top_k : nullptr))
    return;
  route_detail::route_token<P>([&](int e) { return s_logit[warp][e]; }, p, group_lanes, lane,
                               s_scratch.buf[warp], s_scratch.group[warp], s_scratch.weights[warp],
                               ids + static_cast<size_t>(t) * p.top_k,
                               weights + static_cast<size_t>(t) * p.top_k,
                               p.local_ids ? p.local_ids + static_cast<size_t>(t) * p.top_k : nullptr);
}

// ---- samplers -----------------------------------------------------------------------------------

constexpr int kSampleThreads = 1024;
constexpr int kSampleWarps = kSampleThreads / 32;
constexpr int kCluster = 8;  // blocks per row (a portable cluster size)
constexpr int kBins = 256;
constexpr float kBinsPerUnit = 16.0f;  // level 0 bins: 1/16 of a unit of logit / T below the top
constexpr float kMassScale = 35184372088832.0f;  // 2^45: vocab <= 2^18 keeps sums below 2^63
constexpr int kSlots = 8;

__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    const unsigned long long u = __shfl_xor_sync(kFull, v, o);
    v = u > v ? u : v;
  }
  return v;
}

__device__ __forceinline__ unsigned long long warp_sum_u64(unsigned long long v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(kFull, v, o);
  return v;
}

// (value, index) packed so that the larger u64 is the better by the router's order (higher value,
// then lower index); 0 is below every candidate.
__device__ __forceinline__ unsigned long long pack_best(float v, int i) {
  return (static_cast<unsigned long long>(value_key(v)) << 32) | static_cast<uint32_t>(kNoIndex - i);
}
__device__ __forceinline__ int best_index(unsigned long long b) {
  return kNoIndex - static_cast<int>(static_cast<uint32_t>(b));
}

struct SampleShared {
  unsigned long long hist[2][kBins];  // alternate levels: a level clears the one read two levels ago
  unsigned long long scan[32];
  unsigned long long slot[kSlots];  // per-exchange cluster values, each written once per launch
  int tie[2];                       // a select's tie index, written by the block that finds it
  int bin;
  unsigned long long above;
  unsigned long long best[32];
};

__device__ unsigned long long block_max_u64(unsigned long long v, unsigned long long* scratch) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_max_u64(v);
  __syncthreads();
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  return warp_max_u64(scratch[lane]);
}

// Exclusive prefix over threads in thread order; `total` gets the block's sum. `scratch`: 32.
__device__ unsigned long long block_scan(unsigned long long v, unsigned long long* scratch,
                                         unsigned long long& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  unsigned long long inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long u = __shfl_up_sync(kFull, inc, o);
    if (lane >= o) inc += u;
  }
  __syncthreads();
  if (lane == 31) scratch[warp] = inc;
  __syncthreads();
  unsigned long long w = lane < kSampleWarps ? scratch[lane] : 0ull, winc = w;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const unsigned long long u = __shfl_up_sync(kFull, winc, o);
    if (lane >= o) winc += u;
  }
  total = __shfl_sync(kFull, winc, 31);
  const unsigned long long before = __shfl_sync(kFull, winc - w, warp);
  return before + inc - v;
}

// Cluster exchanges: thread 0 publishes `v` in slot s, then every warp reads the kCluster values
// (lane b: block b's). Slots are never rewritten, and every block ends with a cluster barrier,
// so no block reads a slot that is being written or that belongs to a block that has exited.
__device__ __forceinline__ unsigned long long exchange(cg::cluster_group& cl, unsigned long long v,
                                                       SampleShared& sh, int s) {
  if (threadIdx.x == 0) sh.slot[s] = v;
  cl.sync();
  const int lane = threadIdx.x & 31;
  return lane < kCluster ? *cl.map_shared_rank(&sh.slot[s], lane) : 0ull;
}

// The row slice of one block: z = logit / T for [offset, offset + n), in shared memory.
struct Slice {
  const float* z;
  int n, offset;
  float top;
  __device__ unsigned long long mass(float v) const {
    return __float2ull_rn(expf(v - top) * kMassScale);
  }
  // Level 0 of a select: bins of 1/kBinsPerUnit below the top, the last one open-ended. Monotone
  // in z (every step rounds monotonically), so a bin is a run of the order.
  __device__ int value_bin(float v) const {
    const float d = (top - v) * kBinsPerUnit;
    return d < static_cast<float>(kBins - 1) ? static_cast<int>(d) : kBins - 1;
  }
};

// Allowed set so far: key > K, or key == K and index <= I.
struct Threshold {
  uint32_t key;
  int index;
  __device__ bool admits(uint32_t k, int v) const { return k > key || (k == key && v <= index); }
};

// Adds w to hist[bin] (bin < 0: nothing). Lanes of a warp that share a bin (the hot bins of a
// narrow distribution, a run of ties) add once: serialised shared atomics are the slow case.
// (A shuffle-and-__all_sync test of the whole warp alone measured no faster, 20% slower for
// top-k + top-p, on an H200.)
template <bool kMass>
__device__ __forceinline__ void add_to_bin(unsigned long long* hist, int bin, unsigned long long w) {
  const unsigned peers = __match_any_sync(kFull, bin);
  if (bin < 0) return;
  const int lane = threadIdx.x & 31;
  if (peers == kFull) {  // then every lane of the warp is here
    if (kMass) w = warp_sum_u64(w);
    if (lane == 0) atomicAdd(hist + bin, kMass ? w : 32ull);
  } else if (!kMass) {
    if (lane == __ffs(peers) - 1) atomicAdd(hist + bin, static_cast<unsigned long long>(__popc(peers)));
  } else {
    atomicAdd(hist + bin, w);
  }
}

// Among the tokens `within` admits, the threshold whose set is the shortest prefix of the order
// (z descending, index ascending) holding at least `target` weight (1 per token, or its
// fixed-point probability). Level 0 bins z by distance to the top, levels 1-4 take the order key
// of z 8 bits at a time within the level-0 bin, and a last pass takes the tokens of the found key
// in index order. Histograms are summed over the cluster; every block derives the same bins.
template <bool kMass>
__device__ Threshold select(cg::cluster_group& cl, const Slice& s, Threshold within,
                            unsigned long long target, SampleShared& sh, int& phase, int& stage,
                            int tie_slot) {
  int b0 = 0;
  uint32_t prefix = 0, mask = 0;
  for (int level = 0; level < 5; ++level) {
    unsigned long long* hist = sh.hist[phase];
    phase ^= 1;
    const int shift = level == 0 ? 0 : 32 - 8 * level;
    if (threadIdx.x < kBins) hist[threadIdx.x] = 0;
    __syncthreads();
    for (int i0 = 0; i0 < s.n; i0 += kSampleThreads) {  // uniform trip count: add_to_bin is warp-wide
      const int i = i0 + static_cast<int>(threadIdx.x);
      int bin = -1;
      unsigned long long w = 0;
      if (i < s.n) {
        const float z = s.z[i];
        const uint32_t key = value_key(z);
        const int vb = s.value_bin(z);
        if (within.admits(key, s.offset + i) && (level == 0 || (vb == b0 && (key & mask) == prefix))) {
          bin = level == 0 ? vb : static_cast<int>((key >> shift) & 0xffu);
          w = kMass ? s.mass(z) : 1ull;
        }
      }
      add_to_bin<kMass>(hist, bin, w);
    }
    cl.sync();
    // Thread order is the order's descending direction: level 0 from the top bin down, the key
    // levels from the highest digit down.
    unsigned long long mine = 0;
    int bin = 0;
    if (threadIdx.x < kBins) {
      bin = level == 0 ? static_cast<int>(threadIdx.x) : kBins - 1 - static_cast<int>(threadIdx.x);
#pragma unroll
      for (int b = 0; b < kCluster; ++b) mine += *cl.map_shared_rank(hist + bin, b);
    }
    unsigned long long total;
    const unsigned long long before = block_scan(mine, sh.scan, total);
    if (before < target && before + mine >= target) sh.bin = bin, sh.above = before;
    __syncthreads();
    target -= sh.above;
    if (level == 0) b0 = sh.bin;
    else prefix |= static_cast<uint32_t>(sh.bin) << shift, mask |= 0xffu << shift;
    // The next writes of sh.bin and sh.above come after a cluster barrier, past every read here.
  }
  // Ties on the key: in index order (blocks hold consecutive slices) until the target is met.
  const int chunk = (s.n + kSampleThreads - 1) / kSampleThreads;
  const int begin = min(s.n, static_cast<int>(threadIdx.x) * chunk), end = min(s.n, begin + chunk);
  unsigned long long mine = 0;
  for (int v = begin; v < end; ++v) {
    const float z = s.z[v];
    const uint32_t key = value_key(z);
    if (key == prefix && within.admits(key, s.offset + v)) mine += kMass ? s.mass(z) : 1ull;
  }
  unsigned long long total;
  const unsigned long long before = block_scan(mine, sh.scan, total);
  const int rank = static_cast<int>(cl.block_rank());
  const unsigned long long part = exchange(cl, total, sh, stage++);
  const unsigned long long base = warp_sum_u64((threadIdx.x & 31) < static_cast<unsigned>(rank) ? part : 0ull);
  unsigned long long run = base + before;
  if (run < target && run + mine >= target) {
    for (int v = begin; v < end; ++v) {
      const float z = s.z[v];
      const uint32_t key = value_key(z);
      if (key != prefix || !within.admits(key, s.offset + v)) continue;
      run += kMass ? s.mass(z) : 1ull;
      if (run >= target) {
        for (int b = 0; b < kCluster; ++b) *cl.map_shared_rank(&sh.tie[tie_slot], b) = s.offset + v;
        break;
      }
    }
  }
  cl.sync();
  return Threshold{prefix, sh.tie[tie_slot]};
}

__device__ __forceinline__ uint64_t mix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// A standard Gumbel variate for (seed, step, token): -log(E), E = -log(1 - U) ~ Exp(1); U from
// 32 hashed bits so that E, and with it the reach into the tail, goes down to about 2^-33.
__device__ __forceinline__ float gumbel(uint64_t seed, int32_t step, int v) {
  const uint64_t h = mix64(seed ^ mix64((static_cast<uint64_t>(static_cast<uint32_t>(step)) << 32) |
                                        static_cast<uint32_t>(v)));
  const float u = (static_cast<float>(static_cast<uint32_t>(h >> 32)) + 0.5f) * 2.3283064365386963e-10f;
  const float e = -log1pf(-fminf(u, 0.99999994f));
  return -logf(e);
}

__device__ int row_argmax(const float* x, int vocab, bool vec, unsigned long long* scratch) {
  unsigned long long best = 0;
  if (vec) {
    for (int c = threadIdx.x; c < vocab / 4; c += blockDim.x) {
      const float4 q = __ldg(reinterpret_cast<const float4*>(x) + c);
      const unsigned long long a = pack_best(q.x, 4 * c), b = pack_best(q.y, 4 * c + 1);
      const unsigned long long d = pack_best(q.z, 4 * c + 2), e = pack_best(q.w, 4 * c + 3);
      const unsigned long long m1 = a > b ? a : b, m2 = d > e ? d : e, m = m1 > m2 ? m1 : m2;
      best = m > best ? m : best;
    }
  } else {
    for (int v = threadIdx.x; v < vocab; v += blockDim.x) {
      const unsigned long long a = pack_best(__ldg(x + v), v);
      best = a > best ? a : best;
    }
  }
  return best_index(block_max_u64(best, scratch));
}

__global__ void __launch_bounds__(kSampleThreads) argmax_kernel(const float* __restrict__ logits,
                                                                int vocab, bool vec,
                                                                int32_t* __restrict__ out) {
  __shared__ unsigned long long scratch[32];
  const int best = row_argmax(logits + static_cast<size_t>(blockIdx.x) * vocab, vocab, vec, scratch);
  if (threadIdx.x == 0) out[blockIdx.x] = best;
}

// One cluster of kCluster blocks per row; block r holds tokens [r slice, (r + 1) slice) as z in
// shared memory, so the row is read from global memory once and every later pass is on-chip.
__global__ void __cluster_dims__(kCluster, 1, 1) __launch_bounds__(kSampleThreads, 1)
    sample_kernel(const float* __restrict__ logits, SampleParams p, int vocab, int slice, bool vec,
                  int32_t* __restrict__ out) {
  extern __shared__ __align__(16) float zs[];
  __shared__ SampleShared sh;
  cg::cluster_group cl = cg::this_cluster();
  const int row = blockIdx.x / kCluster, rank = static_cast<int>(cl.block_rank());
  const float* x = logits + static_cast<size_t>(row) * (p.row_stride > 0 ? p.row_stride : vocab);
  const float temperature = p.temperature[row];
  const int top_k = p.top_k[row];
  const float top_p = p.top_p[row];
  const bool greedy = !(temperature > 0.0f) || top_k == 1;
  const float inv_t = greedy ? 1.0f : __frcp_rn(temperature);
  if (threadIdx.x < 2) sh.tie[threadIdx.x] = kNoIndex;  // before the first cluster barrier
  const int offset = rank * slice;
  const int n = max(0, min(vocab - offset, slice));
  const float* xs = x + offset;
  // logit / T rounded as the CPU's division (the reciprocal-and-correct sequence is exact for
  // operands in the normal range, which logits and temperatures are), without the out-of-line
  // slow path of `/`.
  auto scaled = [&](float a) {
    if (greedy) return a;
    const float q = a * inv_t;
    return fmaf(fmaf(-q, temperature, a), inv_t, q);
  };
  unsigned long long best = 0;
  for (int i = 4 * static_cast<int>(threadIdx.x); i < n; i += 4 * kSampleThreads) {
    if (vec && i + 3 < n) {
      const float4 q = __ldg(reinterpret_cast<const float4*>(xs + i));
      const float a[4] = {scaled(q.x) + 0.0f, scaled(q.y) + 0.0f, scaled(q.z) + 0.0f, scaled(q.w) + 0.0f};
      *reinterpret_cast<float4*>(zs + i) = make_float4(a[0], a[1], a[2], a[3]);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const unsigned long long c = pack_best(a[j], offset + i + j);
        best = c > best ? c : best;
      }
    } else {
      for (int j = i; j < min(i + 4, n); ++j) {
        const float a = scaled(__ldg(xs + j)) + 0.0f;
        zs[j] = a;
        const unsigned long long c = pack_best(a, offset + j);
        best = c > best ? c : best;
      }
    }
  }
  int stage = 0, phase = 0;
  {
    best = block_max_u64(best, sh.best);
    best = warp_max_u64(exchange(cl, best, sh, stage++));
  }
  const float top = from_order_key(static_cast<uint32_t>(best >> 32));
  const int top_index = best_index(best);
  if (greedy) {
    if (rank == 0 && threadIdx.x == 0) out[row] = top_index;
    cl.sync();
    return;
  }
  const Slice s{zs, n, offset, top};
  __syncthreads();  // zs complete
  Threshold allowed{0u, kNoIndex};  // everything
  if (top_k > 0 && top_k < vocab)
    allowed = select<false>(cl, s, allowed, static_cast<unsigned long long>(top_k), sh, phase, stage, 0);
  if (top_p < 1.0f) {
    unsigned long long mine = 0, total;
    for (int i = threadIdx.x; i < n; i += kSampleThreads) {
      const float z = zs[i];
      if (allowed.admits(value_key(z), offset + i)) mine += s.mass(z);
    }
    block_scan(mine, sh.scan, total);
    total = warp_sum_u64(exchange(cl, total, sh, stage++));
    const double want = ceil(static_cast<double>(top_p) * static_cast<double>(total));
    unsigned long long target = want < 1.0 ? 1ull : static_cast<unsigned long long>(want);
    if (target > total) target = total;
    allowed = select<true>(cl, s, allowed, target, sh, phase, stage, 1);
  }
  const uint64_t seed = p.seed[row];
  const int32_t step = p.step[row];
  best = 0;
  for (int i = threadIdx.x; i < n; i += kSampleThreads) {
    const float z = zs[i];
    if (!allowed.admits(value_key(z), offset + i)) continue;
    const float score = z + gumbel(seed, step, offset + i);
    if (score == score) {
      const unsigned long long c = pack_best(score, offset + i);
      best = c > best ? c : best;
    }
  }
  best = block_max_u64(best, sh.best);
  best = warp_max_u64(exchange(cl, best, sh, stage++));
  // Should every allowed token score NaN (all logits -inf), the most likely one stands.
  if (rank == 0 && threadIdx.x == 0) out[row] = best == 0 ? top_index : best_index(best);
  cl.sync();
}

}  // namespace

int route_detail::route_lanes(const RouterParams& p, int* group_lanes) {
  const bool grouped = p.group_ranking != 0;
  if (p.experts <= 0 || p.experts > kRouterMaxExperts || p.top_k < 1 ||
      p.top_k > kRouterMaxTopK || p.top_k > p.experts || p.group_ranking < 0 || p.group_ranking > 2 ||
      (grouped && (p.n_group < 1 || p.experts % p.n_group != 0 || p.topk_group < 1 ||
                   p.topk_group > p.n_group ||
                   p.topk_group * (p.experts / p.n_group) < p.top_k ||
                   (p.group_ranking == 2 && p.experts / p.n_group < 2))))
    return 0;
  int per_lane = 1;
  while (32 * per_lane < p.experts) per_lane *= 2;
  *group_lanes = 0;  // groups that start and end on lane boundaries, a power of two lanes each
  if (grouped) {
    const int per = p.experts / p.n_group;
    const int g = per / per_lane;
    if (per % per_lane == 0 && (g & (g - 1)) == 0) *group_lanes = g;
  }
  return per_lane;
}

cudaError_t route(const float* logits, const RouterParams& p, int tokens, int32_t* ids,
                  float* weights, cudaStream_t stream) {
  int group_lanes = 0;
  const int per_lane = route_detail::route_lanes(p, &group_lanes);
  if (tokens < 0 || per_lane == 0) return cudaErrorInvalidValue;
  if (tokens == 0) return cudaGetLastError();
  const dim3 grid((tokens + kRouteWarps - 1) / kRouteWarps), block(kRouteWarps * 32);
  switch (per_lane) {
    case 1: launch_dependent(route_kernel<1>, grid, block, 0, stream, logits, p, tokens, group_lanes, ids, weights); break;
    case 2: launch_dependent(route_kernel<2>, grid, block, 0, stream, logits, p, tokens, group_lanes, ids, weights); break;
    case 4: launch_dependent(route_kernel<4>, grid, block, 0, stream, logits, p, tokens, group_lanes, ids, weights); break;
    case 8: launch_dependent(route_kernel<8>, grid, block, 0, stream, logits, p, tokens, group_lanes, ids, weights); break;
    default: launch_dependent(route_kernel<16>, grid, block, 0, stream, logits, p, tokens, group_lanes, ids, weights); break;
  }
  return cudaGetLastError();
}

bool route_hidden_supported(int experts, int hidden) {
  return hidden > 0 && hidden % 8 == 0 && experts > 0 &&
         static_cast<long long>(experts) * hidden <= kRouteHiddenMaxWeights;
}

cudaError_t route_hidden(const uint16_t* x, const uint16_t* router_weight, int hidden,
                         const RouterParams& p, int tokens, int32_t* ids, float* weights,
                         float* logits, cudaStream_t stream) {
  int group_lanes = 0;
  const int per_lane = route_detail::route_lanes(p, &group_lanes);
  if (tokens < 0 || per_lane == 0 || !route_hidden_supported(p.experts, hidden) ||
      (reinterpret_cast<uintptr_t>(x) & 15) || (reinterpret_cast<uintptr_t>(router_weight) & 15))
    return cudaErrorInvalidValue;
  if (tokens == 0) return cudaGetLastError();
  const dim3 grid((tokens + kRouteWarps - 1) / kRouteWarps), block(kRouteWarps * 32);
  auto go = [&](auto kernel) {
    return launch_dependent(kernel, grid, block, 0, stream, x, router_weight, hidden, p, tokens,
                            group_lanes, ids, weights, logits);
  };
  switch (per_lane) {
    case 1: go(route_hidden_kernel<1>); break;
    case 2: go(route_hidden_kernel<2>); break;
    case 4: go(route_hidden_kernel<4>); break;
    case 8: go(route_hidden_kernel<8>); break;
    default: go(route_hidden_kernel<16>); break;
  }
  return cudaGetLastError();
}

cudaError_t argmax_rows(const float* logits, int rows, int vocab, int32_t* out,
                        cudaStream_t stream) {
  if (rows < 0 || vocab <= 0) return cudaErrorInvalidValue;
  if (rows == 0) return cudaGetLastError();
  const bool vec = vocab % 4 == 0 && (reinterpret_cast<uintptr_t>(logits) & 15) == 0;
  argmax_kernel<<<rows, kSampleThreads, 0, stream>>>(logits, vocab, vec, out);
  return cudaGetLastError();
}

cudaError_t sample_rows(const float* logits, const SampleParams& p, int rows, int vocab,
                        int32_t* out, cudaStream_t stream) {
  if (rows < 0 || vocab <= 0 || vocab > kSampleMaxVocab) return cudaErrorInvalidValue;
  if (rows == 0) return cudaGetLastError();
  if (p.row_stride != 0 && p.row_stride < vocab) return cudaErrorInvalidValue;
  const int stride = p.row_stride > 0 ? p.row_stride : vocab;
  const bool vec = stride % 4 == 0 && (reinterpret_cast<uintptr_t>(logits) & 15) == 0;
  const int slice = ((vocab + kCluster - 1) / kCluster + 3) / 4 * 4;  // a multiple of 4: aligned float4s
  // The largest slice (kSampleMaxVocab / kCluster floats, 128 KiB) is allowed once per device, so
  // that nothing but the launch happens inside a graph capture after the first call.
  constexpr int kMaxSlice = kSampleMaxVocab / kCluster;
  static std::atomic<uint64_t> configured{0};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return cudaGetLastError();
  const uint64_t bit = 1ull << (device & 63);
  if (!(configured.load(std::memory_order_relaxed) & bit)) {
    const cudaError_t e = cudaFuncSetAttribute(sample_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               static_cast<int>(kMaxSlice * sizeof(float)));
    if (e != cudaSuccess) return e;
    configured.fetch_or(bit, std::memory_order_relaxed);
  }
  sample_kernel<<<rows * kCluster, kSampleThreads, slice * sizeof(float), stream>>>(logits, p, vocab, slice,
                                                                                    vec, out);
  return cudaGetLastError();
}

}  // namespace moe::cuda::kernels
