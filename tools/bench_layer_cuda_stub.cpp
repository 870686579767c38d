// Builds without CUDA: the GPU layer benchmark says plainly that it is not there.
#include "bench_layer.h"
#include "moe/errors.h"
#include "moe/router.h"

namespace moe::bench {

int run_layer_bench_cuda(const LayerBenchArgs&, int64_t, int64_t, int64_t, int64_t,
                         const RouterConfig&, const char*) {
  MOE_THROW(kUnsupported, "--device cuda: this build has no CUDA backend (configure with -DMOE_CUDA=ON)");
}

int run_layer_bench_cuda_ep(const LayerBenchArgs&, int64_t, int64_t, int64_t, int64_t,
                            const RouterConfig&, const char*, int64_t) {
  MOE_THROW(kUnsupported, "--device cuda: this build has no CUDA backend (configure with -DMOE_CUDA=ON)");
}

}  // namespace moe::bench
