// How fast can any kernel read the bytes of one M = 1 layer, timed the way `moe-bench layer`
// times it? The routed experts of one token read 8 experts' gate_up rows (qwen3-30b-a3b: 8 x
// 6.29 MB) and then their down rows (8 x 3.15 MB), 75.5 MB in all, with the expert ids read
// first. These kernels do nothing but that reading (16-byte loads, an xor into one word a block,
// so nothing is optimised away; the load and the launch are the library's own, from
// stream_load.cuh and pdl.h), in the shapes a real layer could take:
//   dense      one kernel over 75.5 MB of contiguous memory (no ids; chained by plain launches)
//   gate_up alone    the 8 gate_up chunks (50.3 MB), the ids read in the kernel first
//   ids, 1     one kernel over the 16 expert chunks, the ids read in the kernel first
//   ids, 2     a gate_up-chunks kernel, then a down-chunks kernel launched as a programmatic
//              dependent, which issues its first loads before griddepcontrol.wait (as the
//              library's down_combine_kernel does) and the rest after
//   ids, 2 no wait   the same without the wait: the most two kernels can overlap
// each cold (one layer in a graph, 256 MB written before each replay to flush L2, events around
// the replay, median of 50 after 10: moe-bench layer's method) and chained (8 layers on
// disjoint experts in one graph, per layer). Grid: blocks of 256 threads, B a multiprocessor,
// U loads of 16 bytes in flight a thread; every combination is printed.
//
// Reading: the library's layer takes 34.5-34.9 µs cold (bench and lab) and 28.0 chained; 1.5x
// vLLM is 33.3. If the best "ids, 2" here is not well under 33.3 cold, no kernel design of
// this layout reaches the target under this timing.
//
// Results: docs/perf/m1-cold-floor.md.
//
// Build: cmake -DMOE_BUILD_LAB=ON, target lab_cold_stream; or by hand from the repository root:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude \
//     -o /tmp/cold_stream_lab lab/cuda/cold_stream_lab.cu
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "backend/cuda/pdl.h"
#include "backend/cuda/stream_load.cuh"
#include "lab_timing.cuh"

namespace {

using lab::time_chained;
using lab::time_cold;
using moe::cuda::kernels::allow_dependents;
using moe::cuda::kernels::launch_kernel;
using moe::cuda::kernels::load_stream;
using moe::cuda::kernels::wait_for_predecessor;

constexpr int kExperts = 128, kTopK = 8, kHidden = 2048, kInter = 768;
constexpr uint64_t kGateUpVecs = uint64_t(2) * kInter * kHidden * 2 / 16;  // 16-byte vectors an expert
constexpr uint64_t kDownVecs = uint64_t(kHidden) * kInter * 2 / 16;
constexpr int kThreads = 256;

__device__ __forceinline__ void finish(uint32_t acc, uint32_t* out) {
  for (int o = 16; o > 0; o >>= 1) acc ^= __shfl_xor_sync(0xffffffffu, acc, o);
  if ((threadIdx.x & 31) == 0) atomicXor(out + blockIdx.x, acc);
}

// Reads n vectors of `base` (dense: one range) in rounds of U loads a thread.
template <int U>
__global__ void __launch_bounds__(kThreads) dense_kernel(const uint4* base, uint64_t n, uint32_t* out) {
  allow_dependents();
  const uint64_t stride = uint64_t(gridDim.x) * kThreads;
  uint32_t acc = 0;
  for (uint64_t v0 = uint64_t(blockIdx.x) * kThreads + threadIdx.x; v0 < n; v0 += stride * U) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint64_t v = v0 + u * stride;
      r[u] = load_stream(base + (v < n ? v : n - 1));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
  }
  finish(acc, out);
}

// Reads the chunks a + ids[c] * per_a, then (where b is given) b + ids[c] * per_b, c < kTopK,
// flattened, in rounds of U loads a thread. dependent: the kernel is a programmatic dependent
// whose first round is issued before griddepcontrol.wait (the weights depend on nothing
// computed) and the rest after it; wait = false leaves the wait out.
template <int U>
__global__ void __launch_bounds__(kThreads) chunks_kernel(const uint4* a, uint64_t per_a, const uint4* b,
                                                          uint64_t per_b, const int* ids, bool dependent,
                                                          bool wait, uint32_t* out) {
  allow_dependents();
  __shared__ int s_ids[kTopK];
  if (threadIdx.x < kTopK) s_ids[threadIdx.x] = ids[threadIdx.x];
  __syncthreads();
  const uint64_t na = per_a * kTopK, n = na + (b ? per_b * kTopK : 0);
  const uint64_t stride = uint64_t(gridDim.x) * kThreads;
  uint32_t acc = 0;
  bool waited = !dependent || !wait;
  for (uint64_t v0 = uint64_t(blockIdx.x) * kThreads + threadIdx.x; v0 < n; v0 += stride * U) {
    uint4 r[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      uint64_t v = v0 + u * stride;
      if (v >= n) v = n - 1;
      if (v < na) {
        const uint32_t c = static_cast<uint32_t>(v / per_a);
        r[u] = load_stream(a + uint64_t(s_ids[c]) * per_a + (v - uint64_t(c) * per_a));
      } else {
        v -= na;
        const uint32_t c = static_cast<uint32_t>(v / per_b);
        r[u] = load_stream(b + uint64_t(s_ids[c]) * per_b + (v - uint64_t(c) * per_b));
      }
    }
    if (!waited) {  // the first round is in flight; the predecessor's results are needed now
      wait_for_predecessor();
      waited = true;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= r[u].x ^ r[u].y ^ r[u].z ^ r[u].w;
  }
  if (!waited) wait_for_predecessor();
  finish(acc, out);
}

template <typename K, typename... Args>
void launch(K kernel, int blocks, cudaStream_t s, bool dependent, Args... args) {
  CHECK(launch_kernel(kernel, dim3(blocks), dim3(kThreads), 0, s, dependent, args...));
}

__global__ void empty_kernel() {}

struct Buffers {
  uint4* gate_up;  // kExperts x kGateUpVecs
  uint4* down;     // kExperts x kDownVecs
  int* ids;        // 8 layers x kTopK, disjoint experts
  uint32_t* out;   // one word a block
};

template <int U>
void run_all(const Buffers& b, int sms, int per_sm) {
  const int blocks = sms * per_sm;
  const uint64_t dense_n = (kGateUpVecs + kDownVecs) * kTopK;
  auto dense = [&](int l, cudaStream_t s) {
    // Layer l reads its own 75.5 MB: consecutive experts' gate_up rows.
    launch(dense_kernel<U>, blocks, s, false, (const uint4*)(b.gate_up + l * dense_n), dense_n, b.out);
  };
  const auto* gu = (const uint4*)b.gate_up;
  const auto* dn = (const uint4*)b.down;
  auto ids = [&](int l) { return (const int*)(b.ids + l * kTopK); };
  auto gate_up_only = [&](int l, cudaStream_t s) {
    launch(chunks_kernel<U>, blocks, s, l > 0, gu, kGateUpVecs, (const uint4*)nullptr, uint64_t(0), ids(l),
           l > 0, true, b.out);
  };
  auto one = [&](int l, cudaStream_t s) {  // all 16 chunks in one grid
    launch(chunks_kernel<U>, blocks, s, l > 0, gu, kGateUpVecs, dn, kDownVecs, ids(l), l > 0, true, b.out);
  };
  auto two = [&](bool wait) {
    return [&, wait](int l, cudaStream_t s) {
      launch(chunks_kernel<U>, blocks, s, l > 0, gu, kGateUpVecs, (const uint4*)nullptr, uint64_t(0), ids(l),
             l > 0, true, b.out);
      launch(chunks_kernel<U>, blocks, s, true, dn, kDownVecs, (const uint4*)nullptr, uint64_t(0), ids(l), true,
             wait, b.out);
    };
  };
  std::printf("  B %d, U %d | dense %6.2f / %6.2f | gate_up alone %6.2f / %6.2f | ids, 1 %6.2f / %6.2f"
              " | ids, 2 %6.2f / %6.2f | no wait %6.2f / %6.2f\n",
              per_sm, U, time_cold(dense), time_chained(8, dense), time_cold(gate_up_only),
              time_chained(8, gate_up_only), time_cold(one), time_chained(8, one), time_cold(two(true)),
              time_chained(8, two(true)), time_cold(two(false)), time_chained(8, two(false)));
}

}  // namespace

int main() {
  int sms = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  Buffers b{};
  CHECK(cudaMalloc(&b.gate_up, kExperts * kGateUpVecs * 16));
  CHECK(cudaMalloc(&b.down, kExperts * kDownVecs * 16));
  CHECK(cudaMalloc(&b.ids, 8 * kTopK * sizeof(int)));
  CHECK(cudaMalloc(&b.out, 4096 * sizeof(uint32_t)));
  CHECK(cudaMemset(b.gate_up, 1, kExperts * kGateUpVecs * 16));
  CHECK(cudaMemset(b.down, 2, kExperts * kDownVecs * 16));
  CHECK(cudaMemset(b.out, 0, 4096 * sizeof(uint32_t)));
  // Layer l's experts: 8 of the 16 in [16 l, 16 l + 16), ascending as the router gives them.
  std::vector<int> ids;
  for (int l = 0; l < 8; ++l)
    for (int j = 0; j < kTopK; ++j) ids.push_back(16 * l + (j * 5 + l) % 16);
  for (int l = 0; l < 8; ++l) std::sort(ids.begin() + l * kTopK, ids.begin() + (l + 1) * kTopK);
  CHECK(cudaMemcpy(b.ids, ids.data(), ids.size() * sizeof(int), cudaMemcpyHostToDevice));

  const double empty = time_cold([](int, cudaStream_t s) { empty_kernel<<<1, 32, 0, s>>>(); });
  std::printf("qwen3-30b-a3b, M = 1 bytes (75.5 MB; gate_up chunks alone 50.3 MB), us, cold / chained\n");
  std::printf("  a graph of one empty kernel, cold: %.2f\n", empty);
  for (int rep = 0; rep < 2; ++rep) {
    std::printf(" run %d\n", rep);
    for (int per_sm : {2, 4, 8}) {
      run_all<4>(b, sms, per_sm);
      run_all<8>(b, sms, per_sm);
    }
  }
  return 0;
}
