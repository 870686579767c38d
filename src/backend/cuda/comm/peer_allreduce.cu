// PeerAllReduce (peer_allreduce.h): the kernel and its buffers.
#include "backend/cuda/comm/peer_allreduce.h"

#include <cuda_bf16.h>

#include <algorithm>
#include <string>

#include "backend/cuda/bf16x8.cuh"
#include "backend/cuda/comm/sys_flags.cuh"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/pdl.h"
#include "backend/cuda/peer_access.h"
#include "moe/errors.h"

namespace moe::cuda {
namespace {

using namespace sys_flags;

constexpr int kThreads = 256;
constexpr int kMaxRanks = PeerAllReduce::kMaxRanks;
constexpr int kMaxBlocks = PeerAllReduce::kMaxBlocks;
constexpr int64_t kMaxNormHidden = PeerAllReduce::kMaxNormHidden;

struct Args {
  uint16_t* data;
  int64_t rows;
  int vectors;           // 8-element (16-byte) vectors per row
  int64_t max_elements;  // one inbox slot
  int rank, ranks;
  uint16_t* inbox[kMaxRanks];  // each rank's inbox
  unsigned* flags[kMaxRanks];  // each rank's flags
  unsigned* epochs;            // this rank's
  uint4* ll_inbox[kMaxRanks];  // each rank's LL inbox
  unsigned* ll_epochs;         // this rank's: LL calls completed, one counter per block
  int64_t ll_slot;             // 16-byte LL lines of one (parity, source) slot
  int* status;                 // this rank's
  long long timeout_ns;
  PeerAllReduce::AddNorm norm;  // folded when norm.weight is set
};

__device__ __forceinline__ float block_sum(float v, float* red) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = v;
  __syncthreads();
  float total = 0.0f;
#pragma unroll
  for (int w = 0; w < kThreads / 32; ++w) total += red[w];
  __syncthreads();  // red is reused by the next row
  return total;
}

// The rank-order f32 sum of eight bf16 values, load(p) giving rank p's, rounded once to bf16
// (as 8 floats): every rank adds the same values in the same order, so all end with the same bits.
template <typename Load>
__device__ __forceinline__ void rank_order_sum(int ranks, Load&& load, float (&out)[8]) {
  float s[8] = {};
  for (int p = 0; p < ranks; ++p) {
    kernels::add_bf16x8(load(p), s);
  }
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const float2 r = __bfloat1622float2(__floats2bfloat162_rn(s[2 * c], s[2 * c + 1]));
    out[2 * c] = r.x;
    out[2 * c + 1] = r.y;
  }
}

// Vector v of the sum, this rank's rows from data, the peers' from the inbox.
__device__ __forceinline__ void rank_sum(const Args& a, const uint16_t* mine, size_t slot, int64_t v,
                                         float (&out)[8]) {
  // Peers' rows bypass L1: the same inbox held other rows two calls ago.
  rank_order_sum(a.ranks, [&](int p) {
    return p == a.rank ? reinterpret_cast<const uint4*>(a.data)[v]
                       : __ldcg(reinterpret_cast<const uint4*>(mine + p * slot) + v);
  }, out);
}

// The folded residual add and norm of one row (whole row per block): v[c] holds this thread's
// summed vectors c = tid, tid + kThreads, ... (at most kNormVectorsPerThread).
constexpr int kNormVectorsPerThread = 4;
static_assert(kNormVectorsPerThread * kThreads * 8 == kMaxNormHidden, "one row's vectors in registers");

// residual += sum (+ extra) as add_rms_norm adds; returns the values in v.
__device__ __forceinline__ void add_residual(const Args& a, int64_t r, int c, const float (&s)[8],
                                             float (&v)[8]) {
  const int hidden = a.vectors * 8;
  float* x = a.norm.residual + r * hidden;
  const float4 lo = reinterpret_cast<const float4*>(x)[2 * c], hi = reinterpret_cast<const float4*>(x)[2 * c + 1];
  const float in[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
  for (int k = 0; k < 8; ++k) v[k] = in[k] + s[k];
  if (a.norm.extra) kernels::add_bf16x8(reinterpret_cast<const uint4*>(a.norm.extra + r * hidden)[c], v);
  reinterpret_cast<float4*>(x)[2 * c] = make_float4(v[0], v[1], v[2], v[3]);
  reinterpret_cast<float4*>(x)[2 * c + 1] = make_float4(v[4], v[5], v[6], v[7]);
}

__device__ __forceinline__ void store_normed(const Args& a, int64_t r, int c, const float (&v)[8], float inv) {
  const int hidden = a.vectors * 8;
  const float4 wl = reinterpret_cast<const float4*>(a.norm.weight)[2 * c];
  const float4 wh = reinterpret_cast<const float4*>(a.norm.weight)[2 * c + 1];
  reinterpret_cast<uint4*>(a.norm.normed + r * hidden)[c] = kernels::norm_bf16x8(wl, wh, v, inv);
}

// Row r's folded residual add and norm, its vector c summed by sum(c, s). sum returns false when
// a peer's values never came (the LL form's timeout): from there on the row is left unwritten.
template <typename Sum>
__device__ __forceinline__ void add_norm_row(const Args& a, int64_t r, float* red, Sum&& sum) {
  const int tid = threadIdx.x;
  float v[kNormVectorsPerThread][8];
  float ss = 0.0f;
  bool ok = true;
#pragma unroll
  for (int i = 0; i < kNormVectorsPerThread; ++i) {
    const int c = tid + i * kThreads;
    if (c >= a.vectors) break;
    float s[8];
    ok = sum(c, s) && ok;
    if (ok) add_residual(a, r, c, s, v[i]);
#pragma unroll
    for (int k = 0; k < 8; ++k) ss += ok ? v[i][k] * v[i][k] : 0.0f;
  }
  ss = block_sum(ss, red);
  const float inv = 1.0f / sqrtf(ss / static_cast<float>(a.vectors * 8) + a.norm.eps);
#pragma unroll
  for (int i = 0; i < kNormVectorsPerThread; ++i) {
    const int c = tid + i * kThreads;
    if (c >= a.vectors || !ok) break;
    store_normed(a, r, c, v[i], inv);
  }
}

__device__ __forceinline__ void store_bf16x8(uint4* dst, const float (&s)[8]) {
  uint4 out;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int k = 0; k < 4; ++k) o[k] = __floats2bfloat162_rn(s[2 * k], s[2 * k + 1]);
  *dst = out;
}

__device__ __forceinline__ void store_volatile(uint4* p, uint4 v) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
               "r"(v.w)
               : "memory");
}

__device__ __forceinline__ uint4 load_volatile(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

// Small calls (decode steps): the LL form. Each 8-byte word a sender stores carries 4 bytes of
// data beside the call's epoch, and an 8-byte store arrives whole, so a receiver that sees the
// epoch in both words of a line has its data: no fence, no separate flag, one trip over NVLink
// instead of stores, fence, flag and poll. It moves twice the bytes, hence only for small calls.
//
// Every call launches all kMaxBlocks blocks and each bumps its own epoch counter, so all
// counters stay equal to the number of LL calls: a line left in the inbox by any earlier call
// holds an older epoch whichever block wrote it. Block b sums row b (rows <= kMaxBlocks). The
// inboxes are double-buffered by epoch parity as in the flag form, for the same reason.
__global__ void __launch_bounds__(kThreads) peer_allreduce_ll_kernel(Args a) {
  __shared__ float red[kThreads / 32];
  kernels::begin_dependent();  // first: see pdl.h
  const int b = blockIdx.x, tid = threadIdx.x;
  const unsigned e = a.ll_epochs[b] + 1;
  const size_t parity = e & 1u;
  const int64_t r = b;
  const bool mine_row = r < a.rows;
  const int64_t base = r * a.vectors;
  const uint4* src = reinterpret_cast<const uint4*>(a.data);
  if (mine_row) {
    for (int c = tid; c < a.vectors; c += kThreads) {
      const uint4 x = src[base + c];
      for (int p = 0; p < a.ranks; ++p) {
        if (p == a.rank) continue;
        uint4* dst = a.ll_inbox[p] + (parity * a.ranks + a.rank) * a.ll_slot + 2 * (base + c);
        store_volatile(dst, make_uint4(x.x, e, x.y, e));
        store_volatile(dst + 1, make_uint4(x.z, e, x.w, e));
      }
    }
  }
  const uint4* inbox = a.ll_inbox[a.rank] + parity * a.ranks * a.ll_slot;
  bool ok = true;
  // Vector c of row r summed over the ranks in rank order (f32, rounded once, as rank_sum).
  auto sum = [&](int c, float (&out)[8]) {
    rank_order_sum(a.ranks, [&](int p) {
      if (p == a.rank) return src[base + c];
      const uint4* line = inbox + p * a.ll_slot + 2 * (base + c);
      uint4 l0 = load_volatile(line), l1 = load_volatile(line + 1);
      const unsigned long long start = now_ns();
      volatile int* status = a.status;
      for (int spin = 0; ok && (l0.y != e || l0.w != e || l1.y != e || l1.w != e); ++spin) {
        if ((spin & 255) == 255 && (*status != 0 || static_cast<long long>(now_ns() - start) > a.timeout_ns)) {
          atomicCAS(a.status, 0, p + 1);
          ok = false;
        }
        l0 = load_volatile(line);
        l1 = load_volatile(line + 1);
      }
      return make_uint4(l0.x, l0.z, l1.x, l1.z);
    }, out);
  };
  if (mine_row && !a.norm.weight) {
    for (int c = tid; c < a.vectors; c += kThreads) {
      float s[8];
      sum(c, s);
      if (!ok) break;
      store_bf16x8(reinterpret_cast<uint4*>(a.data) + base + c, s);
    }
  } else if (mine_row) {
    add_norm_row(a, r, red, [&](int c, float (&s)[8]) {
      sum(c, s);
      return ok;
    });
  }
  __syncthreads();  // every thread has read the epoch
  if (tid == 0) a.ll_epochs[b] = e;
}

__global__ void __launch_bounds__(kThreads) peer_allreduce_kernel(Args a) {
  __shared__ unsigned epoch;
  __shared__ int failed;
  __shared__ float red[kThreads / 32];
  kernels::begin_dependent();  // first: see pdl.h
  const int b = blockIdx.x, tid = threadIdx.x;
  if (tid == 0) {
    epoch = a.epochs[b] + 1;
    failed = 0;
  }
  __syncthreads();
  const unsigned e = epoch;
  const size_t parity = e & 1u;
  const int64_t per = (a.rows + gridDim.x - 1) / gridDim.x;
  const int64_t r0 = b * per, r1 = min(a.rows, r0 + per);
  const int64_t v0 = r0 * a.vectors, v1 = max(v0, r1 * a.vectors);
  const uint4* src = reinterpret_cast<const uint4*>(a.data);
  const size_t slot = static_cast<size_t>(a.max_elements);

  // Push this block's rows to every peer, then raise its flag there.
  for (int p = 0; p < a.ranks; ++p) {
    if (p == a.rank) continue;
    uint4* dst = reinterpret_cast<uint4*>(a.inbox[p] + (parity * a.ranks + a.rank) * slot);
    for (int64_t v = v0 + tid; v < v1; v += kThreads) dst[v] = src[v];
  }
  // The block's stores are ordered before the flag by the barrier and one system-scope fence in
  // each signalling thread (the pattern NCCL's kernels use), not a fence in every thread.
  __syncthreads();
  if (tid < a.ranks && tid != a.rank) {
    __threadfence_system();
    store_release(a.flags[tid] + a.rank * kMaxBlocks + b, e);
  }

  // Wait for every peer's rows of this call.
  if (tid < a.ranks && tid != a.rank) {
    const unsigned* flag = a.flags[a.rank] + tid * kMaxBlocks + b;
    volatile int* status = a.status;
    const unsigned long long start = now_ns();
    while (static_cast<int>(load_acquire(flag) - e) < 0) {
      if (*status != 0 || static_cast<long long>(now_ns() - start) > a.timeout_ns) {
        atomicCAS(a.status, 0, tid + 1);
        failed = 1;
        break;
      }
      __nanosleep(64);
    }
  }
  __syncthreads();
  const uint16_t* mine = a.inbox[a.rank] + parity * a.ranks * slot;
  if (!failed && !a.norm.weight) {
    for (int64_t v = v0 + tid; v < v1; v += kThreads) {
      float s[8];
      rank_sum(a, mine, slot, v, s);
      store_bf16x8(reinterpret_cast<uint4*>(a.data) + v, s);
    }
  } else if (!failed) {
    // Row by row: residual += sum (+ extra) as add_rms_norm adds, then the norm of the row.
    for (int64_t r = r0; r < r1; ++r)
      add_norm_row(a, r, red, [&](int c, float (&s)[8]) {
        rank_sum(a, mine, slot, r * a.vectors + c, s);
        return true;
      });
  }
  if (tid == 0) a.epochs[b] = e;
}

size_t align_up(size_t n) { return (n + 255) / 256 * 256; }

}  // namespace

PeerAllReduce::PeerAllReduce(const std::vector<int>& devices, int64_t max_elements, double timeout_s) {
  const int n = static_cast<int>(devices.size());
  MOE_CHECK(n >= 1 && n <= kMaxRanks, kInvalidArgument, "the all-reduce takes 1 to {} GPUs, got {}",
            kMaxRanks, n);
  MOE_CHECK(max_elements >= 8 && max_elements % 8 == 0 && timeout_s > 0, kInvalidArgument,
            "all-reduce: max elements {} (a positive multiple of 8), timeout {} s (> 0)", max_elements,
            timeout_s);
  std::string why;
  MOE_CHECK(peers_can_access(devices, &why), kUnsupported, "running on several GPUs needs peer access: {}", why);
  max_elements_ = max_elements;
  timeout_ns_ = static_cast<long long>(timeout_s * 1e9);
  const size_t inbox = align_up(2 * static_cast<size_t>(n) * static_cast<size_t>(max_elements) * 2);
  const size_t flags = align_up(static_cast<size_t>(n) * kMaxBlocks * 4);
  const size_t epochs = align_up(kMaxBlocks * 4);
  // LL lines: two of 16 bytes per 8 elements.
  ll_slot_ = std::min<int64_t>(max_elements, kLlMaxElements / std::max(1, n - 1)) / 8 * 2;
  const size_t ll_inbox = align_up(2 * static_cast<size_t>(n) * static_cast<size_t>(ll_slot_) * 16);
  bytes_ = inbox + flags + epochs * 2 + 256 + ll_inbox;
  enable_peer_access(devices);
  for (int d : devices) {
    MOE_CUDA_CHECK(cudaSetDevice(d));
    Rank r;
    r.device = d;
    MOE_CUDA_CHECK(cudaMalloc(&r.base, bytes_));
    char* base = static_cast<char*>(r.base);
    r.inbox = reinterpret_cast<uint16_t*>(base);
    r.flags = reinterpret_cast<unsigned*>(base + inbox);
    r.epochs = reinterpret_cast<unsigned*>(base + inbox + flags);
    r.ll_epochs = reinterpret_cast<unsigned*>(base + inbox + flags + epochs);
    r.status = reinterpret_cast<int*>(base + inbox + flags + 2 * epochs);
    r.ll_inbox = reinterpret_cast<uint4*>(base + inbox + flags + 2 * epochs + 256);
    // The LL inbox too: a line's epoch words must start below every epoch a call will use.
    MOE_CUDA_CHECK(cudaMemset(base + inbox, 0, bytes_ - inbox));
    ranks_.push_back(r);
  }
  for (int d : devices) {
    MOE_CUDA_CHECK(cudaSetDevice(d));
    MOE_CUDA_CHECK(cudaDeviceSynchronize());
  }
}

PeerAllReduce::~PeerAllReduce() {
  for (Rank& r : ranks_) {
    cudaSetDevice(r.device);
    cudaFree(r.base);
  }
}

void PeerAllReduce::run(int rank, uint16_t* data, int64_t rows, int64_t hidden, cudaStream_t stream,
                        const AddNorm* then) const {
  MOE_CHECK(rank >= 0 && rank < ranks() && rows >= 0 && hidden >= 8 && hidden % 8 == 0 &&
                rows * hidden <= max_elements_ &&
                (!then || (then->residual && then->weight && then->normed && hidden <= kMaxNormHidden)),
            kInvalidArgument,
            "all-reduce: rank {} of {}, {} rows of {} (a multiple of 8; at most {} elements){}", rank, ranks(),
            rows, hidden, max_elements_,
            then ? ", with a residual, a norm weight and an output (hidden at most 8192)" : "");
  if (rows == 0) return;
  if (ranks() == 1 && !then) return;
  Args a{};
  a.data = data;
  a.rows = rows;
  a.vectors = static_cast<int>(hidden / 8);
  a.max_elements = max_elements_;
  a.rank = rank;
  a.ranks = ranks();
  for (int p = 0; p < ranks(); ++p) {
    a.inbox[p] = ranks_[static_cast<size_t>(p)].inbox;
    a.flags[p] = ranks_[static_cast<size_t>(p)].flags;
    a.ll_inbox[p] = ranks_[static_cast<size_t>(p)].ll_inbox;
  }
  a.epochs = ranks_[static_cast<size_t>(rank)].epochs;
  a.ll_epochs = ranks_[static_cast<size_t>(rank)].ll_epochs;
  a.ll_slot = ll_slot_;
  a.status = ranks_[static_cast<size_t>(rank)].status;
  a.timeout_ns = timeout_ns_;
  if (then) a.norm = *then;
  if (rows <= kMaxBlocks && rows * hidden * (ranks() - 1) <= kLlMaxElements) {
    MOE_CUDA_CHECK(kernels::launch_dependent(peer_allreduce_ll_kernel, dim3(kMaxBlocks), dim3(kThreads), 0,
                                             stream, a));
    return;
  }
  // Whole rows per block, up to kMaxBlocks blocks: far below one block per multiprocessor, so
  // every block of every rank is resident at once (the waits need it).
  const int64_t blocks = std::min<int64_t>(kMaxBlocks, rows);
  // A dependent launch: scheduled while its predecessor finishes, waiting for it on the device.
  MOE_CUDA_CHECK(kernels::launch_dependent(peer_allreduce_kernel, dim3(static_cast<unsigned>(blocks)),
                                           dim3(kThreads), 0, stream, a));
}

void PeerAllReduce::check(int rank) const {
  MOE_CHECK(rank >= 0 && rank < ranks(), kInvalidArgument, "all-reduce: rank {} of {}", rank, ranks());
  const Rank& r = ranks_[static_cast<size_t>(rank)];
  int status = 0;
  MOE_CUDA_CHECK(cudaSetDevice(r.device));
  MOE_CUDA_CHECK(cudaMemcpy(&status, r.status, 4, cudaMemcpyDeviceToHost));
  MOE_CHECK(status == 0, kInternal,
            "all-reduce on GPU {}: the rows of GPU {} did not arrive within {:.1f} s (a rank stopped "
            "or fell behind); the engine must be reloaded",
            r.device, ranks_[static_cast<size_t>(status - 1)].device, timeout_ns_ * 1e-9);
}

}  // namespace moe::cuda
