#include "backend/cuda_router.h"

#include <cuda_runtime.h>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/moe/router_params.h"
#include "backend/cuda/ops/blas.h"
#include "backend/cuda/ops/ops_launch.h"
#include "moe/errors.h"

namespace moe::cuda {

struct Router::State {
  const uint16_t* weight = nullptr;
  kernels::RouterParams params;
  int64_t hidden = 0, max_rows = 0;
  bool folded = false;        // route_hidden: the projection inside the top-k kernel
  float* logits = nullptr;    // [max_rows, experts] for the projection, unless folded
  std::unique_ptr<Blas> blas;
};

Router::Router(const uint16_t* weight, const float* bias, const RouterConfig& config, int64_t hidden,
               int64_t max_rows)
    : s_(std::make_unique<State>()) {
  MOE_CHECK(weight && hidden > 0 && max_rows > 0 && config.num_experts > 0, kInvalidArgument,
            "router: {} experts over {} hidden for {} rows", config.num_experts, hidden, max_rows);
  State& s = *s_;
  s.weight = weight;
  s.params = kernels::router_params(config, bias);
  s.hidden = hidden;
  s.max_rows = max_rows;
  s.folded = kernels::route_hidden_supported(static_cast<int>(config.num_experts), static_cast<int>(hidden));
  if (!s.folded) {
    MOE_CUDA_CHECK(cudaMalloc(&s.logits, static_cast<size_t>(max_rows * config.num_experts) * sizeof(float)));
    s.blas = std::make_unique<Blas>();
  }
}

Router::~Router() {
  if (s_ && s_->logits) cudaFree(s_->logits);
}

void Router::route(const uint16_t* x, int64_t rows, int32_t* ids, float* weights, void* stream) {
  State& s = *s_;
  MOE_CHECK(rows >= 1 && rows <= s.max_rows, kInvalidArgument, "router: {} rows, set up for 1 to {}", rows,
            s.max_rows);
  auto* st = static_cast<cudaStream_t>(stream);
  const int t = static_cast<int>(rows);
  if (s.folded) {
    MOE_CUDA_CHECK(kernels::route_hidden(x, s.weight, static_cast<int>(s.hidden), s.params, t, ids, weights, nullptr, st));
    return;
  }
  s.blas->linear(x, s.weight, s.logits, OutType::kF32, rows, s.params.experts, s.hidden, st);
  MOE_CUDA_CHECK(kernels::route(s.logits, s.params, t, ids, weights, st));
}

}  // namespace moe::cuda
