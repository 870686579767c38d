// Expert-parallel exchange kernels (ep_exchange_launch.h): the plan of which rows go where, the
// packing of rows into local send buffers or straight into peers' receive buffers over NVLink,
// the bounded waits on flags that peers write, and the sums that bring each token's rows back
// together in rank order. Only CUDA headers here: the host side is in cuda_ep.cpp.
#include <cuda_bf16.h>

#include <algorithm>
#include <atomic>

#include "backend/cuda/comm/ep_exchange_launch.h"
#include "backend/cuda/comm/sys_flags.cuh"
#include "backend/cuda/pdl.h"
#include "backend/cuda/moe/slot_sums.cuh"

namespace moe::cuda::kernels {

namespace {

using namespace sys_flags;

constexpr int kPlanThreads = 1024;
constexpr int kRowThreads = 256;

__device__ __forceinline__ int owner_of(const EpRouting& r, int e) {
  int p = 0;
  while (p + 1 < r.ranks && e >= r.first[p + 1]) ++p;
  return p;
}

// Bit p set when rank p owns one of token t's experts.
__device__ __forceinline__ unsigned owners(const EpRouting& r, int t) {
  unsigned m = 0;
  for (int j = 0; j < r.top_k; ++j) m |= 1u << owner_of(r, __ldg(r.ids + (size_t)t * r.top_k + j));
  return m;
}

// Exclusive scan over the block of one value per thread; returns the block's total too.
__device__ int block_exclusive_scan(int v, int* total) {
  __shared__ int warp_sums[kPlanThreads / 32];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int inc = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int u = __shfl_up_sync(0xffffffffu, inc, o);
    if (lane >= o) inc += u;
  }
  if (lane == 31) warp_sums[warp] = inc;
  __syncthreads();
  if (warp == 0) {
    int w = lane < (int)(blockDim.x / 32) ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int u = __shfl_up_sync(0xffffffffu, w, o);
      if (lane >= o) w += u;
    }
    warp_sums[lane] = w;  // inclusive over warps
  }
  __syncthreads();
  const int before = (warp > 0 ? warp_sums[warp - 1] : 0) + inc - v;
  *total = warp_sums[blockDim.x / 32 - 1];
  __syncthreads();  // warp_sums is reused by the next call
  return before;
}

// Each thread takes a run of consecutive tokens, so a rank's rows stay in token order.
__global__ void __launch_bounds__(kPlanThreads) plan_kernel(EpRouting r, int begin, int count,
                                                            int* __restrict__ pos,
                                                            int* __restrict__ counts) {
  begin_dependent();  // launched as a programmatic dependent (pdl.h)
  const int per = (count + blockDim.x - 1) / blockDim.x;
  const int t0 = threadIdx.x * per, t1 = min(count, t0 + per);
  int mine[kEpMaxRanks];
#pragma unroll
  for (int p = 0; p < kEpMaxRanks; ++p) mine[p] = 0;
  for (int t = t0; t < t1; ++t) {
    const unsigned m = owners(r, begin + t);
#pragma unroll
    for (int p = 0; p < kEpMaxRanks; ++p) mine[p] += (m >> p) & 1u;
  }
#pragma unroll
  for (int p = 0; p < kEpMaxRanks; ++p) {
    if (p >= r.ranks) break;
    int total = 0;
    mine[p] = block_exclusive_scan(mine[p], &total);
    if (threadIdx.x == 0) counts[p] = total;
  }
  for (int t = t0; t < t1; ++t) {
    const unsigned m = owners(r, begin + t);
    for (int p = 0; p < r.ranks; ++p)
      pos[(size_t)t * r.ranks + p] = (m >> p) & 1u ? mine[p]++ : -1;
  }
}

// A flag holds the epoch it signals above kFlagCountBits bits of a row count (dispatch: the rows
// sent to that rank, so that the receiver pads the rest of its slice itself; 0 elsewhere).
constexpr int kFlagCountBits = 20;  // rows per slice are at most 65536
constexpr unsigned long long kFlagCountMask = (1ull << kFlagCountBits) - 1;

// Into local send buffers (the NCCL backends). Blocks [0, count): one shard token each, copied to
// every rank that owns one of its experts; blocks [count, count + ranks): the padding rows of
// destination (block - count).
__global__ void __launch_bounds__(kRowThreads) pack_kernel(const uint16_t* __restrict__ x,
                                                           EpRouting r, int begin, int count,
                                                           int hidden, const int* __restrict__ pos,
                                                           const int* __restrict__ counts,
                                                           EpDest dest) {
  begin_dependent();  // launched as a programmatic dependent (pdl.h)
  const int b = blockIdx.x;
  if (b < count) {
    const int t = begin + b;
    const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)t * hidden);
    const int chunks = hidden / 8;
    for (int p = 0; p < r.ranks; ++p) {
      const int row = pos[(size_t)b * r.ranks + p];
      if (row < 0) continue;
      uint4* dst = reinterpret_cast<uint4*>(dest.x[p] + (size_t)row * hidden);
      for (int c = threadIdx.x; c < chunks; c += blockDim.x) dst[c] = __ldg(src + c);
      if (threadIdx.x < r.top_k) {
        const int j = threadIdx.x, e = __ldg(r.ids + (size_t)t * r.top_k + j);
        const bool here = e >= r.first[p] && e < r.first[p + 1];
        dest.ids[p][(size_t)row * r.top_k + j] = here ? e - r.first[p] : -1;
        dest.w[p][(size_t)row * r.top_k + j] = __ldg(r.weights + (size_t)t * r.top_k + j);
      }
      if (threadIdx.x == 0 && dest.token[p]) dest.token[p][row] = t;
    }
  } else if (dest.pad_rows > 0) {
    const int p = b - count;
    const int from = counts[p];
    const int n = (dest.pad_rows - from) * r.top_k;
    for (int i = threadIdx.x; i < n; i += blockDim.x) dest.ids[p][(size_t)from * r.top_k + i] = -1;
    if (dest.token[p])
      for (int i = from + threadIdx.x; i < dest.pad_rows; i += blockDim.x) dest.token[p][i] = -1;
  }
}

// Thread p < ranks waits for flag[p]; true when every flag arrived in time.
__device__ bool wait_flags(const EpWait& w, int ranks, int* counts = nullptr);

__global__ void __launch_bounds__(kRowThreads) dispatch_p2p_kernel(const uint16_t* __restrict__ x,
                                                                   EpRouting r, int begin,
                                                                   int count, int hidden,
                                                                   P2pDispatch d) {
  begin_dependent();  // launched as a programmatic dependent (pdl.h)
  __shared__ int rows[kEpMaxRanks];
  __shared__ int last;
  const int b = blockIdx.x;
  if (b < count) {
    const int t = begin + b;
    if (threadIdx.x == 0) {
      const unsigned m = owners(r, t);
      for (int p = 0; p < r.ranks; ++p) rows[p] = (m >> p) & 1u ? atomicAdd(d.cursor + p, 1) : -1;
    }
    __syncthreads();
    const uint4* src = reinterpret_cast<const uint4*>(x + (size_t)t * hidden);
    const int chunks = hidden / 8;
    for (int p = 0; p < r.ranks; ++p) {
      const int row = rows[p];
      if (row < 0) continue;
      uint4* dst = reinterpret_cast<uint4*>(d.dest.x[p] + (size_t)row * hidden);
      for (int c = threadIdx.x; c < chunks; c += blockDim.x) dst[c] = __ldg(src + c);
      if (threadIdx.x < r.top_k) {
        const int j = threadIdx.x, e = __ldg(r.ids + (size_t)t * r.top_k + j);
        const bool here = e >= r.first[p] && e < r.first[p + 1];
        d.dest.ids[p][(size_t)row * r.top_k + j] = here ? e - r.first[p] : -1;
        d.dest.w[p][(size_t)row * r.top_k + j] = __ldg(r.weights + (size_t)t * r.top_k + j);
      }
      if (threadIdx.x == 0) d.dest.token[p][row] = t;
    }
  }
  // One system-scope fence per block, after the barrier: it orders every write the block's
  // threads made before it (fences are cumulative) ahead of the count.
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(d.sig.done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  // Every other block has placed its rows and fenced them before counting itself done, which
  // this block has seen: the release stores of the flags come after all of them.
  if (threadIdx.x < r.ranks) rows[threadIdx.x] = atomicAdd(d.cursor + threadIdx.x, 0);
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned long long cur = *(volatile const unsigned long long*)d.sig.epoch + 1;
    for (int q = 0; q < r.ranks; ++q)
      store_release(d.sig.flag[q], cur << kFlagCountBits | static_cast<unsigned long long>(rows[q]));
    for (int p = 0; p < r.ranks; ++p) d.cursor[p] = 0;
    *d.sig.done = 0;
  }
  __shared__ int got[kEpMaxRanks];
  if (!wait_flags(d.wait, r.ranks, got)) return;
  // Rows past what each rank sent are padding here: no expert, no token (local writes, seen by
  // the experts' kernels, which start after this one ends).
  for (int p = 0; p < r.ranks; ++p) {
    const int from = got[p], n = (d.dest.pad_rows - from) * r.top_k;
    int32_t* ids = d.recv_ids + ((size_t)p * d.dest.pad_rows + from) * r.top_k;
    for (int i = threadIdx.x; i < n; i += blockDim.x) ids[i] = -1;
    int32_t* token = d.recv_token + (size_t)p * d.dest.pad_rows;
    for (int i = from + threadIdx.x; i < d.dest.pad_rows; i += blockDim.x) token[i] = -1;
  }
}

__global__ void localize_kernel(const int32_t* __restrict__ ids, int n, int first, int num,
                                int32_t* __restrict__ out) {
  begin_dependent();  // launched as a programmatic dependent (pdl.h)
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  const int e = ids[i];
  out[i] = e >= first && e < first + num ? e - first : -1;
}

__device__ bool wait_flags(const EpWait& w, int ranks, int* counts) {
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  if (threadIdx.x < ranks) {
    const int p = threadIdx.x;
    volatile int* status = w.status;
    const unsigned long long cur = *(volatile const unsigned long long*)w.epoch + 1;
    const unsigned long long start = now_ns();
    unsigned long long f;
    while (((f = load_acquire(w.flag + p)) >> kFlagCountBits) < cur) {
      if (*status != 0 || (long long)(now_ns() - start) > w.timeout_ns) {
        atomicCAS(w.status, 0, ((w.stage << 8) | p) + 1);
        failed = 1;
        break;
      }
    }
    if (counts) counts[p] = static_cast<int>(f & kFlagCountMask);
  }
  __syncthreads();
  return failed == 0;
}

__device__ __forceinline__ void add_row(const uint16_t* row, int h, float (&s)[8]) {
  const uint4 v = __ldcg(reinterpret_cast<const uint4*>(row + h));
  const __nv_bfloat162* q = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float2 f = __bfloat1622float2(q[c]);
    s[2 * c] += f.x, s[2 * c + 1] += f.y;
  }
}

__device__ __forceinline__ void store_row(const float (&s)[8], uint16_t* out) {
  uint4 v;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int c = 0; c < 4; ++c) o[c] = __floats2bfloat162_rn(s[2 * c], s[2 * c + 1]);
  *reinterpret_cast<uint4*>(out) = v;
}

__global__ void unpack_sum_kernel(EpParts parts, const int* __restrict__ pos, int count, int ranks,
                                  int hidden, uint16_t* __restrict__ out) {
  begin_dependent();  // launched as a programmatic dependent (pdl.h)
  const int groups = hidden / 8;
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= count * groups) return;
  const int t = i / groups, h = (i % groups) * 8;
  float s[8] = {};
  for (int p = 0; p < ranks; ++p) {
    const int row = pos[(size_t)t * ranks + p];
    if (row >= 0) add_row(parts.part[p] + (size_t)row * hidden, h, s);
  }
  store_row(s, out + (size_t)t * hidden + h);
}

// Launched with kRowThreads; the register cap keeps sum_slots' loads in flight together (see
// combine_kernel in moe_decode.cu).
template <typename Part, bool kSplit>
__global__ void __maxnreg__(128) combine_p2p_kernel(EpRouting r, P2pCombine c,
                                                                  int tokens, int hidden,
                                                                  uint16_t* __restrict__ out) {
  begin_dependent();  // launched as a programmatic dependent (pdl.h)
  const int groups = hidden / 8;
  const Part* part = static_cast<const Part*>(c.in.sums);
  for (int row = blockIdx.x; row < c.rows; row += gridDim.x) {
    const int t = c.token[row];
    if (t < 0) continue;
    for (int g = threadIdx.x; g < groups; g += blockDim.x) {
      float s[8];
      sum_slots<Part, kSplit>(part, c.in.ids, row, c.in.top_k, hidden, g * 8, c.in.splits,
                              c.in.split_stride, s);
      uint4 v;
      __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
      for (int k = 0; k < 4; ++k) o[k] = __floats2bfloat162_rn(s[2 * k], s[2 * k + 1]);
      if (c.source_rows > 0)  // only the token's own rank holds it
        reinterpret_cast<uint4*>(c.back.dest[row / c.source_rows] + (size_t)t * hidden)[g] = v;
      else
        for (int q = 0; q < r.ranks; ++q) reinterpret_cast<uint4*>(c.back.dest[q] + (size_t)t * hidden)[g] = v;
    }
  }
  // This rank's rows are out once every block has fenced its own: the last one raises the flags.
  __shared__ int last;
  __syncthreads();
  if (threadIdx.x == 0) {  // one fence for the block, as in dispatch_p2p_kernel
    __threadfence_system();
    last = atomicAdd(c.sig.done, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (last && threadIdx.x == 0) {  // every block's rows fenced before its count, as in dispatch
    const unsigned long long cur = *(volatile const unsigned long long*)c.sig.epoch + 1;
    for (int q = 0; q < r.ranks; ++q) store_release(c.sig.flag[q], cur << kFlagCountBits);
    *c.sig.done = 0;
  }
  const bool ok = wait_flags(c.wait, r.ranks);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; ok && i < tokens * groups; i += gridDim.x * blockDim.x) {
    const int t = i / groups, h = (i % groups) * 8;
    const unsigned m = owners(r, t);
    float s[8] = {};
    for (int p = 0; p < r.ranks; ++p)
      if ((m >> p) & 1u) add_row(c.comb + ((size_t)p * c.stride + t) * hidden, h, s);
    store_row(s, out + (size_t)t * hidden + h);
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (atomicAdd(c.done, 1u) != gridDim.x - 1) return;
  // Every block has read the epoch by now: the layer's exchange is over.
  *c.epoch = *(volatile unsigned long long*)c.epoch + 1;
  *c.done = 0;
}

}  // namespace

cudaError_t ep_plan(const EpRouting& r, int begin, int count, int* pos, int* counts,
                    cudaStream_t stream) {
  if (r.ranks < 1 || r.ranks > kEpMaxRanks || count < 0 || count > 65536) return cudaErrorInvalidValue;
  launch_dependent(plan_kernel, dim3(1), dim3(kPlanThreads), 0, stream, r, begin, count, pos,
                   counts);
  return cudaGetLastError();
}

cudaError_t ep_pack(const uint16_t* x, const EpRouting& r, int begin, int count, int hidden,
                    const int* pos, const int* counts, const EpDest& dest, cudaStream_t stream) {
  if (hidden % 8 != 0 || r.top_k > kRowThreads) return cudaErrorInvalidValue;
  const int blocks = count + (dest.pad_rows > 0 ? r.ranks : 0);
  if (blocks == 0) return cudaSuccess;
  launch_dependent(pack_kernel, dim3(blocks), dim3(kRowThreads), 0, stream, x, r, begin, count,
                   hidden, pos, counts, dest);
  return cudaGetLastError();
}

cudaError_t ep_dispatch_p2p(const uint16_t* x, const EpRouting& r, int begin, int count,
                            int hidden, const P2pDispatch& d, cudaStream_t stream) {
  if (hidden % 8 != 0 || r.top_k > kRowThreads || r.ranks > kRowThreads || count < 0)
    return cudaErrorInvalidValue;
  launch_dependent(dispatch_p2p_kernel, dim3(count > 0 ? count : 1), dim3(kRowThreads), 0, stream,
                   x, r, begin, count, hidden, d);
  return cudaGetLastError();
}

cudaError_t ep_localize(const int32_t* ids, int n, int first, int num, int32_t* out,
                        cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  launch_dependent(localize_kernel, dim3((n + 255) / 256), dim3(256), 0, stream, ids, n, first,
                   num, out);
  return cudaGetLastError();
}

cudaError_t ep_unpack_sum(const EpParts& parts, const int* pos, int count, int ranks, int hidden,
                          uint16_t* out, cudaStream_t stream) {
  const int total = count * (hidden / 8);
  if (total == 0) return cudaSuccess;
  launch_dependent(unpack_sum_kernel, dim3((total + 255) / 256), dim3(256), 0, stream, parts, pos,
                   count, ranks, hidden, out);
  return cudaGetLastError();
}

namespace {

// Blocks of kKernel (kRowThreads threads, no shared memory beyond its static) that the current
// device holds at once. Asked once per kernel and device: the answer depends on nothing else, and
// the queries would cost host time on every eager call.
template <auto kKernel>
int resident_blocks() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> cached[kMaxDevices];
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 0;
  if (device >= 0 && device < kMaxDevices) {
    const int known = cached[device].load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int per_sm = 0, sms = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kKernel, kRowThreads, 0) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess)
    return 0;
  if (device >= 0 && device < kMaxDevices) cached[device].store(per_sm * sms, std::memory_order_relaxed);
  return per_sm * sms;
}

}  // namespace

cudaError_t ep_combine_p2p(const EpRouting& r, const P2pCombine& c, int tokens, int hidden,
                           uint16_t* out, cudaStream_t stream) {
  const long long total = (long long)tokens * (hidden / 8);
  if (c.rows <= 0 || total <= 0 || c.in.splits < 1 || (c.in.splits > 1 && c.in.bf16))
    return cudaErrorInvalidValue;
  auto* kernel = c.in.bf16 ? combine_p2p_kernel<__nv_bfloat16, false>
                 : c.in.splits > 1 ? combine_p2p_kernel<float, true>
                                   : combine_p2p_kernel<float, false>;
  const int cap = c.in.bf16 ? resident_blocks<combine_p2p_kernel<__nv_bfloat16, false>>()
                  : c.in.splits > 1 ? resident_blocks<combine_p2p_kernel<float, true>>()
                                    : resident_blocks<combine_p2p_kernel<float, false>>();
  if (cap <= 0) return cudaErrorUnknown;
  const long long want = std::max<long long>(c.rows, (total + kRowThreads - 1) / kRowThreads);
  const int grid = static_cast<int>(std::min<long long>(want, cap));
  launch_dependent(kernel, dim3(grid), dim3(kRowThreads), 0, stream, r, c, tokens, hidden, out);
  return cudaGetLastError();
}

}  // namespace moe::cuda::kernels
