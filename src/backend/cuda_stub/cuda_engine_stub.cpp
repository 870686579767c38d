#include "backend/cuda_engine.h"

#include "moe/errors.h"

namespace moe::cuda {

struct Engine::State {};

Engine::Engine() = default;
Engine::~Engine() = default;

std::unique_ptr<Engine> Engine::load(const std::string&, const EngineOptions&) {
  MOE_THROW(kUnsupported, "--device cuda: this build has no CUDA backend (configure with -DMOE_CUDA=ON)");
}
const ModelConfig& Engine::config() const { MOE_THROW(kInternal, "no CUDA engine"); }
const EngineOptions& Engine::options() const { MOE_THROW(kInternal, "no CUDA engine"); }
int32_t Engine::open() { MOE_THROW(kInternal, "no CUDA engine"); }
void Engine::close(int32_t) {}
int64_t Engine::length(int32_t) const { return 0; }
int64_t Engine::reuse_prefix(int32_t, std::span<const int32_t>) { MOE_THROW(kInternal, "no CUDA engine"); }
int32_t Engine::prefill(int32_t, std::span<const int32_t>, const SamplingParams&, Tensor*, bool, OpProfile*) {
  MOE_THROW(kInternal, "no CUDA engine");
}
std::vector<int32_t> Engine::decode(std::span<const int32_t>, std::span<const int32_t>,
                                    std::span<const SamplingParams>, OpProfile*) {
  MOE_THROW(kInternal, "no CUDA engine");
}
const runtime::ExecutorLimits& Engine::limits() const { MOE_THROW(kInternal, "no CUDA engine"); }
runtime::KvUsage Engine::kv_usage() const { return {}; }
int Engine::group_of(int32_t) const { MOE_THROW(kInternal, "no CUDA engine"); }
runtime::KvUsage Engine::group_kv_usage(int) const { return {}; }
runtime::StepResult Engine::run(const runtime::StepPlan&) { MOE_THROW(kInternal, "no CUDA engine"); }
MemoryReport Engine::memory() const { return {}; }
std::vector<MemoryReport> Engine::memory_per_gpu() const { return {}; }
std::vector<int32_t> Engine::last_routing() const { return {}; }

}  // namespace moe::cuda
