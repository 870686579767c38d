// Where one warp's routing of one token spends its cycles (qwen3-30b-a3b: 128 experts, top 8,
// softmax, renormalised): clock64 around each phase of route_token, one warp, logits in global
// memory as the fused router reads them. Results: docs/perf/router-top-k.md. Build: cmake
// -DMOE_BUILD_LAB=ON, target lab_route_token; or by hand from the repository root:
//   nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -Isrc -Iinclude \
//     -o /tmp/route_token_lab lab/cuda/route_token_lab.cu
#include <cstdio>
#include <vector>
#include <random>

#include "backend/cuda/moe/route_device.cuh"

using namespace moe::cuda::kernels;
using namespace moe::cuda::kernels::route_detail;

constexpr int P = 4, N = 128, K = 8, REPS = 20;

__device__ long long g_sink;

// phase: 0 whole route_token, 1 load+max+exp, 2 serial sum, 3 k rounds (one pass over the
// lane's values per round), 4 the divisions, 5 load only, 6 exp in float (expf), 7 k rounds over
// sorted candidates
__global__ void lab_kernel(const float* logits, RouterParams p, int phase, long long* cycles, int32_t* ids, float* w) {
  __shared__ __align__(16) float buf[kRouterMaxExperts];
  __shared__ float group[kRouterMaxExperts];
  __shared__ float s_w[kRouterMaxTopK];
  const int lane = threadIdx.x;
  long long total = 0;
  float sink = 0.f;
  for (int r = 0; r < REPS; ++r) {
    const float* row = logits + (r % 4) * N;
    __syncwarp();
    const long long t0 = clock64();
    if (phase == 0) {
      route_token<P>([&](int e) { return __ldcg(row + e); }, p, 0, lane, buf, group, s_w, ids, w, nullptr);
      sink += w[lane % K];
    } else {
      float s[P];
      for (int j = 0; j < P; ++j) s[j] = __ldcg(row + lane * P + j);
      if (phase == 5) { for (int j = 0; j < P; ++j) sink += s[j]; }
      if (phase == 1 || phase == 6) {
        float mx = -INFINITY;
        for (int j = 0; j < P; ++j) mx = fmaxf(mx, s[j]);
        mx = from_order_key(__reduce_max_sync(kFull, value_key(mx)));
        for (int j = 0; j < P; ++j) { s[j] = phase == 1 ? exp_rounded(s[j] - mx) : expf(s[j] - mx); buf[lane * P + j] = s[j]; }
        __syncwarp();
        sink += buf[(lane + 1) % 32];
      }
      if (phase == 2) { for (int j = 0; j < P; ++j) buf[lane * P + j] = s[j]; __syncwarp(); sink += serial_sum<P>(buf); }
      if (phase == 7) {
        uint32_t key[P];
        for (int j = 0; j < P; ++j) key[j] = value_key(s[j]);
        sink += take_top_k<P>(key, K, lane);
      }
      if (phase == 4) { const float sum = s[0] + 7.f; for (int j = 0; j < P; ++j) sink += s[j] / sum; }
      if (phase == 3) {
        uint32_t taken = 0;
        const int base = lane * P;
        for (int rr = 0; rr < K; ++rr) {
          float bv = 0.0f;
          int bj = -1;
#pragma unroll
          for (int j = 0; j < P; ++j)
            if (!(taken >> j & 1u) && (bj < 0 || s[j] > bv)) bv = s[j], bj = j;
          const uint32_t key = bj >= 0 ? value_key(bv) : 0u;
          const uint32_t m = __reduce_max_sync(kFull, key);
          const unsigned ball = __ballot_sync(kFull, bj >= 0 && key == m);
          if (lane == __ffs(ball) - 1) taken |= 1u << bj;
        }
        sink += taken + base;
      }
    }
    __syncwarp();
    const long long t1 = clock64();
    total += t1 - t0;
  }
  if (lane == 0) cycles[phase] = total / REPS;
  if (sink == 12345.f) g_sink = 1;
}

int main() {
  std::vector<float> h(4 * N);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.f, 2.f);
  for (auto& v : h) v = nd(rng);
  float *d, *w; long long* cyc; int32_t* ids;
  cudaMalloc(&d, h.size() * 4); cudaMalloc(&w, 64); cudaMalloc(&ids, 64); cudaMalloc(&cyc, 64 * 8);
  cudaMemcpy(d, h.data(), h.size() * 4, cudaMemcpyHostToDevice);
  RouterParams p{};
  p.experts = N; p.top_k = K; p.renormalize = 1; p.scaling = 1.f;
  const char* names[] = {"route_token whole", "load+max+exp(double)", "serial sum 128", "k rounds",
                         "4 divisions", "load only (L2)", "load+max+expf(float)", "sorted k rounds"};
  for (int ph = 0; ph < 8; ++ph) {
    for (int it = 0; it < 3; ++it) lab_kernel<<<1, 32>>>(d, p, ph, cyc, ids, w);
    cudaDeviceSynchronize();
    long long c; cudaMemcpy(&c, cyc + ph, 8, cudaMemcpyDeviceToHost);
    printf("%-24s %6lld cycles\n", names[ph], c);
  }
  printf("%s\n", cudaGetErrorString(cudaGetLastError()));
}
