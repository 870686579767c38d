// A MoE layer's router on one GPU, on its own: the projection of bf16 hidden rows onto the
// experts and the top-k choice (moe::RouterConfig: softmax or sigmoid scores, groups, bias,
// renormalisation, scaling), as `moe-bench layer --device cuda --ep N` runs it before the
// experts. Small routers take one kernel that folds the projection in; others a cuBLASLt
// projection and the top-k kernel. The engine folds its router into the norm before it
// (engine_rank.cpp) and does not use this.
//
// Declared without CUDA types; built with the CUDA backend only.
#pragma once

#include <cstdint>
#include <memory>

#include "moe/router.h"

namespace moe::cuda {

class Router {
 public:
  // weight: bf16 [config.num_experts, hidden] on the current device; bias: f32 [num_experts]
  // (the correction bias of DeepSeek-V3-style routers) or null; at most max_rows rows a call.
  Router(const uint16_t* weight, const float* bias, const RouterConfig& config, int64_t hidden, int64_t max_rows);
  ~Router();
  Router(const Router&) = delete;
  Router& operator=(const Router&) = delete;

  // The experts and weights [rows, top_k] of `rows` rows of x [rows, hidden] (bf16), enqueued
  // on `stream` (a cudaStream_t; capturable).
  void route(const uint16_t* x, int64_t rows, int32_t* ids, float* weights, void* stream);

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace moe::cuda
