#pragma once

#include <cstdint>
#include <limits>
#include <string>

namespace moe::bench {

struct LayerBenchArgs {
  std::string preset = "seed";
  int64_t tokens = 0;  // 0: the preset's
  int ep = 0;         // 0: 2 for the seed preset (the seed's) and on the CPU, else 1 on CUDA
  std::string dtype;  // empty: f32 on the CPU, bf16 on CUDA
  std::string device = "auto";  // auto: cuda where the GPUs are there (see run_layer_bench)
  bool json = false;
  // kDeviceDefault: the bench's own (20 runs after 3 on the CPU and over several GPUs; on one GPU
  // 50 graph replays after 10).
  static constexpr int kDeviceDefault = std::numeric_limits<int>::min();
  int runs = kDeviceDefault;
  int warmup = kDeviceDefault;
  int threads = 0;  // CPU only
  // Empty: all. On one GPU: the expert paths to time, of gemv, gemm and wgmma.
  std::string modes;
  // CUDA, one GPU: S * sin(12.9898 * e) added to expert e's random router logits, so that some
  // experts draw more tokens than others (0: uniform; 1.5: a few experts take most slots).
  double routing_skew = 0;
};

int run_layer_bench(const LayerBenchArgs& args);

}  // namespace moe::bench
namespace moe {
struct RouterConfig;
}
namespace moe::bench {
// The GPU half (bench_layer_cuda.cpp, or a stub without CUDA).
int run_layer_bench_cuda(const LayerBenchArgs& args, int64_t experts, int64_t hidden,
                         int64_t inter, int64_t top_k, const RouterConfig& router, const char* name);
// The layer over args.ep GPUs of this machine in every expert-parallel mode
// (bench_layer_cuda_ep.cpp, or a stub without CUDA); preset_tokens: the preset's T.
int run_layer_bench_cuda_ep(const LayerBenchArgs& args, int64_t experts, int64_t hidden,
                            int64_t inter, int64_t top_k, const RouterConfig& router,
                            const char* name, int64_t preset_tokens);

}  // namespace moe::bench
