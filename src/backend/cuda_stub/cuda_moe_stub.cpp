#include "backend/cuda_moe.h"

#include "moe/errors.h"

namespace moe::cuda {

struct DecodeExperts::State {};

DecodeExperts::DecodeExperts(const ExpertWeights&, int64_t, int64_t, int) {
  MOE_THROW(kUnsupported, "the CUDA MoE path is not compiled in (configure with -DMOE_CUDA=ON)");
}
DecodeExperts::~DecodeExperts() = default;
void DecodeExperts::forward(const uint16_t*, const int32_t*, const float*, int64_t, uint16_t*,
                            void*) const {}
size_t DecodeExperts::weight_bytes() const { return 0; }
size_t DecodeExperts::workspace_bytes() const { return 0; }

}  // namespace moe::cuda
