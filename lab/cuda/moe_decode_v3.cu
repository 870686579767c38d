// Kernel lab, MoE layer decode path v3: no plan kernel. Every block finds its expert itself:
// the touched experts are the set bits of a bitmap built in shared memory from the M*k ids
// (cheap while M*k is small, as in decode), block x takes the x-th set bit, and reads the slots
// routed to it straight from the ids. Activations are indexed by slot, so the down pass needs no
// plan either. Three launches (gate_up, down, combine) in a graph; v2's best occupancy
// (4 warps per block, 3 blocks per SM).
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o moe_decode_v3 moe_decode_v3.cu
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#define CHECK(x)                                                                     \
  do {                                                                               \
    cudaError_t err_ = (x);                                                          \
    if (err_ != cudaSuccess) {                                                       \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); \
      std::exit(1);                                                                  \
    }                                                                                \
  } while (0)

constexpr int kMaxExperts = 512;
constexpr int kMaxSlots = 512;  // decode path: M * k up to this

// The expert of this block (the blockIdx.x-th touched expert, ascending) and its slots in slot
// order. Returns -1 when fewer experts are touched than there are blocks in x.
__device__ int find_expert(const int* ids, int slots, int* my_slots, int* n_mine) {
  __shared__ unsigned bitmap[kMaxExperts / 32];
  __shared__ int expert;
  for (int i = threadIdx.x; i < kMaxExperts / 32; i += blockDim.x) bitmap[i] = 0;
  __syncthreads();
  for (int s = threadIdx.x; s < slots; s += blockDim.x) atomicOr(&bitmap[ids[s] >> 5], 1u << (ids[s] & 31));
  __syncthreads();
  if (threadIdx.x == 0) {
    int want = blockIdx.x, e = -1;
    for (int w = 0; w < kMaxExperts / 32 && e < 0; ++w) {
      int c = __popc(bitmap[w]);
      if (want < c) {
        unsigned bits = bitmap[w];
        for (int i = 0; i < want; ++i) bits &= bits - 1;  // drop the lowest set bits
        e = w * 32 + __ffs(bits) - 1;
      } else {
        want -= c;
      }
    }
    expert = e;
  }
  __syncthreads();
  // All threads collect the expert's slots, in slot order: a ballot per warp and a running
  // offset across warps (blockDim.x is a multiple of 32, at most 1024).
  __shared__ int warp_counts[32];
  __shared__ int base;
  const int e = expert;
  if (threadIdx.x == 0) base = 0;
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, warps = blockDim.x / 32;
  for (int start = 0; start < slots && e >= 0; start += blockDim.x) {
    const int s = start + threadIdx.x;
    const bool hit = s < slots && ids[s] == e;
    const unsigned ballot = __ballot_sync(0xffffffffu, hit);
    if (lane == 0) warp_counts[warp] = __popc(ballot);
    __syncthreads();
    int before = base;
    for (int w = 0; w < warp; ++w) before += warp_counts[w];
    if (hit) my_slots[before + __popc(ballot & ((1u << lane) - 1))] = s;
    __syncthreads();
    if (threadIdx.x == 0) {
      int total = 0;
      for (int w = 0; w < warps; ++w) total += warp_counts[w];
      base += total;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) *n_mine = e >= 0 ? base : 0;
  __syncthreads();
  return expert;
}

__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
  const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&w);
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&x);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 fa = __bfloat1622float2(a[i]), fb = __bfloat1622float2(b[i]);
    s = fmaf(fa.x, fb.x, s);
    s = fmaf(fa.y, fb.y, s);
  }
  return s;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

template <int H, int WARPS, int MINB>
__global__ void __launch_bounds__(WARPS * 32, MINB) gate_up_kernel(
    const __nv_bfloat16* __restrict__ x, const __nv_bfloat16* __restrict__ w_gate_up,
    const int* __restrict__ ids, int slots, int inter, int top_k, __nv_bfloat16* __restrict__ act) {
  __shared__ int mine[kMaxSlots];
  __shared__ int n_mine;
  const int e = find_expert(ids, slots, mine, &n_mine);
  if (e < 0) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int j = blockIdx.y * WARPS + warp;
  if (j >= inter) return;
  constexpr int C = H / 256;
  const uint4* g = reinterpret_cast<const uint4*>(w_gate_up + ((size_t)e * 2 * inter + j) * H);
  const uint4* u = reinterpret_cast<const uint4*>(w_gate_up + ((size_t)e * 2 * inter + inter + j) * H);
  uint4 gr[C], ur[C];
#pragma unroll
  for (int c = 0; c < C; ++c) {
    gr[c] = __ldg(g + c * 32 + lane);
    ur[c] = __ldg(u + c * 32 + lane);
  }
  for (int p = 0; p < n_mine; ++p) {
    const int slot = mine[p];
    const uint4* xr = reinterpret_cast<const uint4*>(x + (size_t)(slot / top_k) * H);
    float gs = 0.f, us = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) {
      uint4 xv = __ldg(xr + c * 32 + lane);
      gs += dot8(gr[c], xv);
      us += dot8(ur[c], xv);
    }
    gs = warp_sum(gs);
    us = warp_sum(us);
    if (lane == 0) act[(size_t)slot * inter + j] = __float2bfloat16(gs / (1.f + __expf(-gs)) * us);
  }
}

template <int I, int WARPS, int MINB>
__global__ void __launch_bounds__(WARPS * 32, MINB) down_kernel(
    const __nv_bfloat16* __restrict__ act, const __nv_bfloat16* __restrict__ w_down,
    const int* __restrict__ ids, int slots, const float* __restrict__ weights, int hidden,
    float* __restrict__ part) {
  __shared__ int mine[kMaxSlots];
  __shared__ int n_mine;
  const int e = find_expert(ids, slots, mine, &n_mine);
  if (e < 0) return;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int h = blockIdx.y * WARPS + warp;
  if (h >= hidden) return;
  constexpr int C = I / 256;
  const uint4* w = reinterpret_cast<const uint4*>(w_down + ((size_t)e * hidden + h) * I);
  uint4 wr[C];
#pragma unroll
  for (int c = 0; c < C; ++c) wr[c] = __ldg(w + c * 32 + lane);
  for (int p = 0; p < n_mine; ++p) {
    const int slot = mine[p];
    const uint4* ar = reinterpret_cast<const uint4*>(act + (size_t)slot * I);
    float s = 0.f;
#pragma unroll
    for (int c = 0; c < C; ++c) s += dot8(wr[c], __ldg(ar + c * 32 + lane));
    s = warp_sum(s);
    if (lane == 0) part[(size_t)slot * hidden + h] = weights[slot] * s;
  }
}

__global__ void combine_kernel(const float* __restrict__ part, int tokens, int top_k, int hidden,
                               __nv_bfloat16* __restrict__ y) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= tokens * hidden) return;
  const int t = i / hidden, h = i % hidden;
  float s = 0.f;
  for (int j = 0; j < top_k; ++j) s += part[((size_t)t * top_k + j) * hidden + h];
  y[i] = __float2bfloat16(s);
}

int main(int argc, char** argv) {
  constexpr int H = 2048, I = 768, WARPS = 4, MINB = 3;
  int E = 128, k = 8;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 1.f);
  const size_t gu_n = (size_t)E * 2 * I * H, dn_n = (size_t)E * H * I;
  std::vector<__nv_bfloat16> h_gu(gu_n), h_dn(dn_n);
  for (auto& v : h_gu) v = __float2bfloat16(0.02f * nd(rng));
  for (auto& v : h_dn) v = __float2bfloat16(0.02f * nd(rng));
  __nv_bfloat16 *d_gu, *d_dn;
  CHECK(cudaMalloc(&d_gu, gu_n * 2));
  CHECK(cudaMalloc(&d_dn, dn_n * 2));
  CHECK(cudaMemcpy(d_gu, h_gu.data(), gu_n * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(d_dn, h_dn.data(), dn_n * 2, cudaMemcpyHostToDevice));
  void* flush;
  const size_t flush_bytes = 256u << 20;
  CHECK(cudaMalloc(&flush, flush_bytes));
  cudaStream_t stream;
  CHECK(cudaStreamCreate(&stream));
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  std::printf("%6s %8s %10s %10s %10s %10s %9s\n", "M", "touched", "median_us", "min_us", "floor_us", "GB/s", "rel_err");
  for (int M : {1, 2, 4, 8, 16, 32}) {
    const int slots = M * k;
    std::vector<__nv_bfloat16> h_x((size_t)M * H);
    for (auto& v : h_x) v = __float2bfloat16(nd(rng));
    std::vector<int> ids(slots), perm(E);
    std::vector<float> w(slots);
    for (int t = 0; t < M; ++t) {
      for (int e = 0; e < E; ++e) perm[e] = e;
      std::shuffle(perm.begin(), perm.end(), rng);
      std::sort(perm.begin(), perm.begin() + k);
      float sum = 0;
      for (int j = 0; j < k; ++j) {
        ids[t * k + j] = perm[j];
        w[t * k + j] = std::uniform_real_distribution<float>(0.1f, 1.f)(rng);
        sum += w[t * k + j];
      }
      for (int j = 0; j < k; ++j) w[t * k + j] /= sum;
    }
    std::vector<bool> touched(E);
    for (int id : ids) touched[id] = true;
    const int n_touched = (int)std::count(touched.begin(), touched.end(), true);
    __nv_bfloat16 *d_x, *d_act, *d_y;
    int* d_ids;
    float *d_w, *d_part;
    CHECK(cudaMalloc(&d_x, h_x.size() * 2));
    CHECK(cudaMalloc(&d_act, (size_t)slots * I * 2));
    CHECK(cudaMalloc(&d_y, (size_t)M * H * 2));
    CHECK(cudaMalloc(&d_ids, slots * 4));
    CHECK(cudaMalloc(&d_w, slots * 4));
    CHECK(cudaMalloc(&d_part, (size_t)slots * H * 4));
    CHECK(cudaMemcpy(d_x, h_x.data(), h_x.size() * 2, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_ids, ids.data(), slots * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemcpy(d_w, w.data(), slots * 4, cudaMemcpyHostToDevice));
    CHECK(cudaMemset(d_y, 0xff, (size_t)M * H * 2));
    const int max_active = std::min(E, slots);
    auto launch = [&](cudaStream_t s) {
      gate_up_kernel<H, WARPS, MINB><<<dim3(max_active, I / WARPS), WARPS * 32, 0, s>>>(d_x, d_gu, d_ids, slots, I, k, d_act);
      down_kernel<I, WARPS, MINB><<<dim3(max_active, H / WARPS), WARPS * 32, 0, s>>>(d_act, d_dn, d_ids, slots, d_w, H, d_part);
      combine_kernel<<<(M * H + 255) / 256, 256, 0, s>>>(d_part, M, k, H, d_y);
    };
    launch(stream);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(stream));
    std::vector<__nv_bfloat16> h_y((size_t)M * H);
    CHECK(cudaMemcpy(h_y.data(), d_y, h_y.size() * 2, cudaMemcpyDeviceToHost));
    double num = 0, den = 0;
    bool finite = true;
    for (int t = 0; t < M; ++t) {
      std::vector<double> ref(H, 0.0);
      for (int j = 0; j < k; ++j) {
        const int e = ids[t * k + j];
        std::vector<float> a(I);
        for (int r = 0; r < I; ++r) {
          double gs = 0, us = 0;
          for (int c = 0; c < H; ++c) {
            double xv = __bfloat162float(h_x[(size_t)t * H + c]);
            gs += xv * __bfloat162float(h_gu[((size_t)e * 2 * I + r) * H + c]);
            us += xv * __bfloat162float(h_gu[((size_t)e * 2 * I + I + r) * H + c]);
          }
          a[r] = __bfloat162float(__float2bfloat16((float)(gs / (1 + std::exp(-gs)) * us)));
        }
        for (int hh = 0; hh < H; ++hh) {
          double s = 0;
          for (int r = 0; r < I; ++r) s += (double)__bfloat162float(h_dn[((size_t)e * H + hh) * I + r]) * a[r];
          ref[hh] += w[t * k + j] * s;
        }
      }
      for (int hh = 0; hh < H; ++hh) {
        double got = __bfloat162float(h_y[(size_t)t * H + hh]);
        finite &= std::isfinite(got);
        num += (got - ref[hh]) * (got - ref[hh]);
        den += ref[hh] * ref[hh];
      }
    }
    const double rel = finite ? std::sqrt(num / den) : INFINITY;
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
    launch(stream);
    CHECK(cudaStreamEndCapture(stream, &graph));
    CHECK(cudaGraphInstantiate(&exec, graph, 0));
    std::vector<float> times;
    for (int r = 0; r < 60; ++r) {
      CHECK(cudaMemsetAsync(flush, r & 0xff, flush_bytes, stream));
      CHECK(cudaEventRecord(e0, stream));
      CHECK(cudaGraphLaunch(exec, stream));
      CHECK(cudaEventRecord(e1, stream));
      CHECK(cudaEventSynchronize(e1));
      float ms;
      CHECK(cudaEventElapsedTime(&ms, e0, e1));
      if (r >= 10) times.push_back(ms * 1e3f);
    }
    std::sort(times.begin(), times.end());
    const double bytes = (double)n_touched * 3.0 * H * I * 2 + 2.0 * M * H * 2;
    const double med = times[times.size() / 2];
    std::printf("%6d %8d %10.2f %10.2f %10.2f %10.0f %9.2e\n", M, n_touched, med, times[0],
                bytes / 3.0e12 * 1e6, bytes / (med * 1e-6) / 1e9, rel);
    CHECK(cudaGraphExecDestroy(exec));
    CHECK(cudaGraphDestroy(graph));
    for (void* p : {(void*)d_x, (void*)d_act, (void*)d_y, (void*)d_ids, (void*)d_w, (void*)d_part}) CHECK(cudaFree(p));
  }
  return 0;
}
