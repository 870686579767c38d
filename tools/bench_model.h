#pragma once

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

namespace moe::bench {

struct ModelBenchArgs {
  std::string model_dir;
  std::string preset;
  bool random_weights = false;
  static constexpr int kUnset = std::numeric_limits<int>::min();
  int batch = kUnset;  // 1 unless given (cuda: or --batches)
  int input_len = 128;
  int output_len = 32;
  int threads = 0;  // cpu only
  int ep = 1;
  int tp = 1;  // cuda: tensor-parallel attention over the --ep GPUs
  int dp = 1;  // cuda: data-parallel attention, each GPU its own sequences
  std::string ep_backend = "local_allreduce";
  std::string exec;  // cpu only; empty: grouped
  std::string device = "cpu";
  std::vector<int> batches;  // cuda: several decode batch sizes on one loaded model
  int prefill_len = 0;       // cuda: also time one prompt of this many tokens alone
  bool profile = false;      // cuda: one more decode step per batch, timed per operation
  bool no_fuse = false;      // cuda: every operation its own kernel (EngineOptions::fuse off)
  bool json = false;
};

int run_model_bench(const ModelBenchArgs& args);
// The whole model on one GPU (bench_model_cuda.cpp); `dir` is the resolved model directory.
int run_model_bench_cuda(const ModelBenchArgs& args, const std::string& dir);

}  // namespace moe::bench
