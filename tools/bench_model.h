#pragma once

#include <cstdint>
#include <string>

namespace moe::bench {

struct ModelBenchArgs {
  std::string model_dir;
  std::string preset;
  bool random_weights = false;
  int batch = 1;
  int input_len = 128;
  int output_len = 32;
  int threads = 0;
  int ep = 1;
  std::string ep_backend = "local_allreduce";
  std::string exec = "grouped";
  std::string device = "cpu";
  bool json = false;
};

int run_model_bench(const ModelBenchArgs& args);

}  // namespace moe::bench
