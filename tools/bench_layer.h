#pragma once

#include <string>

namespace moe::bench {

struct LayerBenchArgs {
  std::string preset = "seed";
  int64_t tokens = 0;  // 0: the preset's
  int ep = 2;
  std::string dtype = "f32";
  std::string device = "cpu";
  bool json = false;
  int runs = 20;
  int warmup = 3;
  int threads = 0;
  std::string modes;  // empty: all
};

int run_layer_bench(const LayerBenchArgs& args);

}  // namespace moe::bench
