// Kernel lab: filling a decode step's idle HBM time with L2 prefetches of the weights that come
// next. At batch 1 a qwen3-30b-a3b layer spends ~12 µs in latency-bound kernels between the qkv
// and o projections (q/k norm + rope + KV write, attention) and ~10 µs in the router before the
// experts; HBM idles there. The question: does loading the o projection's weights into L2 during
// the first gap (and the next layer's qkv during the second, marked evict_last so that the
// experts' 75 MB stream does not push them out) shorten the projections that follow?
//
// Model of one layer, on one stream, every kernel a programmatic dependent of the one before:
//   qkv GEMV (5120 x 2048) -> gap 1 (4 blocks spinning `gap1` µs) -> o GEMV (2048 x 4096)
//   -> gap 2 (`gap2` µs) -> experts stand-in (a GEMV streaming 75 MB) -> next layer.
// Each of the 8 layers has its own weights (8 x 113 MB, past the 50 MB L2), so every weight
// starts in HBM as in a decode step. Variants, all captured in one graph and replayed 20 times:
//   none       no prefetch
//   o          a side branch forked after the qkv GEMV prefetches o's weights during gap 1
//   o+qkv      and another, forked after the o GEMV, prefetches the next layer's qkv weights
//              during gap 2 with the evict_last hint
//   bulk/line  the prefetch as cp.async.bulk.prefetch.L2 (one instruction per 64 KB) or as
//              prefetch.global.L2::evict_last per 128-byte line
// Reported: µs per layer, and the o GEMV alone (events around it in an eager run of layer 0).
//
// Build: nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a -o /tmp/prefetch_lab lab/cuda/prefetch_lab.cu
// Run:   /tmp/prefetch_lab [gap1_us=12] [gap2_us=10]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(x)                                                                                 \
  do {                                                                                           \
    cudaError_t err_ = (x);                                                                      \
    if (err_ != cudaSuccess) {                                                                   \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(err_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

__device__ __forceinline__ void pdl_begin() {
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
}

__device__ __forceinline__ uint4 load_stream(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
      : "l"(p));
  return v;
}

__device__ __forceinline__ float dot8(uint4 w, uint4 x) {
  const __nv_bfloat162* a = reinterpret_cast<const __nv_bfloat162*>(&w);
  const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&x);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fa = __bfloat1622float2(a[i]), fb = __bfloat1622float2(b[i]);
    s = fmaf(fa.x, fb.x, s);
    s = fmaf(fa.y, fb.y, s);
  }
  return s;
}

// One row of x: 8 warps per block, 2 rows per warp, 4 loads per row in flight (the library's
// decode GEMV at M = 1).
__global__ void __launch_bounds__(256) gemv(const uint4* __restrict__ x, const uint4* __restrict__ w,
                                            float* __restrict__ y, int n, int k8) {
  pdl_begin();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = (blockIdx.x * 8 + warp) * 2;
  if (row0 >= n) return;
  float acc[2] = {};
  for (int base = lane; base < k8; base += 128) {
    uint4 wv[2][4];
#pragma unroll
    for (int u = 0; u < 4; ++u)
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int c = base + 32 * u;
        wv[r][u] = c < k8 ? load_stream(w + (size_t)(row0 + r) * k8 + c) : make_uint4(0, 0, 0, 0);
      }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int c = base + 32 * u;
      if (c >= k8) break;
      const uint4 xv = __ldg(x + c);
#pragma unroll
      for (int r = 0; r < 2; ++r) acc[r] += dot8(wv[r][u], xv);
    }
  }
#pragma unroll
  for (int r = 0; r < 2; ++r)
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(0xffffffffu, acc[r], o);
  if (lane == 0) y[row0] = acc[0], y[row0 + 1] = acc[1];
}

// A latency-bound stand-in: 4 blocks that spin for `ns` on the global timer.
__global__ void gap(long long ns) {
  pdl_begin();
  unsigned long long t0, t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
  do {
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  } while ((long long)(t - t0) < ns);
}

// Prefetch [p, p + bytes) into L2. Bulk: one cp.async.bulk.prefetch per 64 KB per thread; line:
// prefetch.global.L2::evict_last per 128 bytes, a grid-stride loop.
__global__ void prefetch_bulk(const char* p, size_t bytes) {
  constexpr size_t kChunk = 65536;
  for (size_t off = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * kChunk; off < bytes;
       off += (size_t)gridDim.x * blockDim.x * kChunk) {
    const unsigned n = (unsigned)(bytes - off < kChunk ? bytes - off : kChunk);
    asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" ::"l"(p + off), "r"(n) : "memory");
  }
}

__global__ void prefetch_line(const char* p, size_t bytes) {
  for (size_t off = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 128; off < bytes;
       off += (size_t)gridDim.x * blockDim.x * 128)
    asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p + off));
}

struct Layer {
  uint4 *qkv, *o, *experts;
};

constexpr int kQkvN = 5120, kQkvK = 2048, kON = 2048, kOK = 4096;
constexpr int kExpN = 18432, kExpK = 2048;  // 75.5 MB, the bytes of 8 experts at inter 768
constexpr int kLayers = 8;

template <typename... Args>
void launch(void (*k)(Args...), int grid, int block, cudaStream_t s, bool pdl, Args... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.stream = s;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  CHECK(cudaLaunchKernelEx(&cfg, k, args...));
}

void run_gemv(const uint4* x, const uint4* w, float* y, int n, int k, cudaStream_t s) {
  launch(gemv, (n + 15) / 16, 256, s, true, x, w, y, n, k / 8);
}

enum Prefetch { kNone, kO, kOQkv };
enum Form { kBulk, kLine };

void prefetch(const void* p, size_t bytes, Form f, cudaStream_t s) {
  if (f == kBulk)
    launch(prefetch_bulk, 16, 32, s, false, static_cast<const char*>(p), bytes);
  else
    launch(prefetch_line, 264, 256, s, false, static_cast<const char*>(p), bytes);
}

double time_layers(const std::vector<Layer>& L, const uint4* x, float* y, long long gap1, long long gap2,
                   Prefetch pf, Form form) {
  cudaStream_t s, side;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  std::vector<cudaEvent_t> ev(4 * kLayers);
  for (auto& e : ev) CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal));
  int e = 0;
  for (int l = 0; l < kLayers; ++l) {
    const Layer& a = L[(size_t)l];
    const Layer& next = L[(size_t)(l + 1) % kLayers];
    run_gemv(x, a.qkv, y, kQkvN, kQkvK, s);
    if (pf != kNone) {  // fork: o's weights during gap 1
      CHECK(cudaEventRecord(ev[(size_t)e], s));
      CHECK(cudaStreamWaitEvent(side, ev[(size_t)e++], 0));
      prefetch(a.o, (size_t)kON * kOK * 2, form, side);
    }
    launch(gap, 4, 128, s, true, gap1);
    run_gemv(x, a.o, y, kON, kOK, s);
    if (pf == kOQkv) {  // fork: the next layer's qkv during gap 2
      CHECK(cudaEventRecord(ev[(size_t)e], s));
      CHECK(cudaStreamWaitEvent(side, ev[(size_t)e++], 0));
      prefetch(next.qkv, (size_t)kQkvN * kQkvK * 2, kLine, side);
    }
    launch(gap, 4, 128, s, true, gap2);
    run_gemv(x, a.experts, y, kExpN, kExpK, s);
    if (pf != kNone) {  // join once per layer: the prefetches are hints, nothing waits on them
      CHECK(cudaEventRecord(ev[(size_t)e], side));
      CHECK(cudaStreamWaitEvent(s, ev[(size_t)e++], 0));
    }
  }
  CHECK(cudaStreamEndCapture(s, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  for (int i = 0; i < 3; ++i) CHECK(cudaGraphLaunch(exec, s));
  cudaEvent_t t0, t1;
  CHECK(cudaEventCreate(&t0));
  CHECK(cudaEventCreate(&t1));
  constexpr int kReplays = 20;
  CHECK(cudaEventRecord(t0, s));
  for (int i = 0; i < kReplays; ++i) CHECK(cudaGraphLaunch(exec, s));
  CHECK(cudaEventRecord(t1, s));
  CHECK(cudaEventSynchronize(t1));
  float ms = 0;
  CHECK(cudaEventElapsedTime(&ms, t0, t1));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  for (auto& x2 : ev) CHECK(cudaEventDestroy(x2));
  CHECK(cudaStreamDestroy(side));
  CHECK(cudaStreamDestroy(s));
  return ms * 1e3 / (kReplays * kLayers);
}

int main(int argc, char** argv) {
  const long long gap1 = (argc > 1 ? atoll(argv[1]) : 12) * 1000;
  const long long gap2 = (argc > 2 ? atoll(argv[2]) : 10) * 1000;
  cudaDeviceProp p;
  CHECK(cudaGetDeviceProperties(&p, 0));
  std::printf("%s, %d SMs, L2 %d MB; gaps %lld and %lld us\n", p.name, p.multiProcessorCount, p.l2CacheSize >> 20,
              gap1 / 1000, gap2 / 1000);
  std::vector<Layer> L(kLayers);
  for (auto& a : L) {
    CHECK(cudaMalloc(&a.qkv, (size_t)kQkvN * kQkvK * 2));
    CHECK(cudaMalloc(&a.o, (size_t)kON * kOK * 2));
    CHECK(cudaMalloc(&a.experts, (size_t)kExpN * kExpK * 2));
    CHECK(cudaMemset(a.qkv, 0x11, (size_t)kQkvN * kQkvK * 2));
    CHECK(cudaMemset(a.o, 0x11, (size_t)kON * kOK * 2));
    CHECK(cudaMemset(a.experts, 0x11, (size_t)kExpN * kExpK * 2));
  }
  uint4* x;
  float* y;
  CHECK(cudaMalloc(&x, 8192 * 2));
  CHECK(cudaMemset(x, 0x11, 8192 * 2));
  CHECK(cudaMalloc(&y, kExpN * 4));
  const double floor_us = ((double)kQkvN * kQkvK + (double)kON * kOK + (double)kExpN * kExpK) * 2 / 3.0e12 * 1e6 +
                          (gap1 + gap2) / 1000.0;
  std::printf("per layer: bytes at 3.0 TB/s plus the two gaps = %.1f us\n", floor_us);
  for (int rep = 0; rep < 2; ++rep) {
    std::printf("  none          %.2f us\n", time_layers(L, x, y, gap1, gap2, kNone, kBulk));
    std::printf("  o (bulk)      %.2f us\n", time_layers(L, x, y, gap1, gap2, kO, kBulk));
    std::printf("  o (line)      %.2f us\n", time_layers(L, x, y, gap1, gap2, kO, kLine));
    std::printf("  o+qkv (bulk)  %.2f us\n", time_layers(L, x, y, gap1, gap2, kOQkv, kBulk));
    std::printf("  o+qkv (line)  %.2f us\n", time_layers(L, x, y, gap1, gap2, kOQkv, kLine));
  }
  return 0;
}
