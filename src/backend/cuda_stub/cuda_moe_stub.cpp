#include "backend/cuda_moe.h"

#include "moe/errors.h"

namespace moe::cuda {

namespace {
[[noreturn]] void not_built() {
  MOE_THROW(kUnsupported, "the CUDA MoE path is not compiled in (configure with -DMOE_CUDA=ON)");
}
}  // namespace

bool experts_support(const ExpertShape&, ExpertPath, const WeightFormat&) { return false; }

Experts::Experts(const DeviceMatrix&, const DeviceMatrix&, ExpertShape shape, int64_t max_tokens, int device)
    : gate_up_(nullptr), down_(nullptr), shape_(shape), max_tokens_(max_tokens), device_(device) {
  not_built();
}
Experts::Experts(const void*, const void*, ExpertShape shape, int64_t max_tokens, int device)
    : gate_up_(nullptr), down_(nullptr), shape_(shape), max_tokens_(max_tokens), device_(device) {
  not_built();
}
size_t Experts::workspace_bytes(const ExpertShape&, int64_t, const WeightFormat&) { not_built(); }
void Experts::forward(const uint16_t*, const int32_t*, const float*, int64_t, uint16_t*, void*,
                      void*, ExpertPath) const {}
void Experts::forward_then_norm(const uint16_t*, const int32_t*, const float*, int64_t,
                                const NextNorm&, void*, void*, ExpertPath) const {
  not_built();
}
Experts::Partials Experts::forward_partials(const uint16_t*, const int32_t*, const float*, int64_t,
                                            void*, void*, ExpertPath) const {
  not_built();
}
Experts::Partials Experts::partials_of(int64_t, void*, ExpertPath) const { not_built(); }
ExpertPath Experts::path_for(int64_t) const { return ExpertPath::kAuto; }
size_t Experts::weight_bytes() const { return 0; }

struct DecodeExperts::State {};

DecodeExperts::DecodeExperts(const ExpertWeights&, int64_t, int64_t, int) { not_built(); }
DecodeExperts::~DecodeExperts() = default;
void DecodeExperts::forward(const uint16_t*, const int32_t*, const float*, int64_t, uint16_t*,
                            void*, ExpertPath) const {}
const Experts& DecodeExperts::core() const { not_built(); }
size_t DecodeExperts::weight_bytes() const { return 0; }
size_t DecodeExperts::workspace_bytes() const { return 0; }

}  // namespace moe::cuda
