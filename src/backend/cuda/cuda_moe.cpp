#include "backend/cuda_moe.h"

#include <algorithm>
#include <vector>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/moe_decode_launch.h"

namespace moe::cuda {

using kernels::kDecodeMaxExperts;
using kernels::kDecodeMaxWidth;

struct DecodeExperts::State {
  int64_t max_tokens = 0;
  kernels::DecodeBuffers buffers{};
  std::vector<void*> owned;
  size_t workspace = 0;

  template <typename T>
  T* alloc(size_t count) {
    void* p = nullptr;
    MOE_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(count, 1) * sizeof(T)));
    owned.push_back(p);
    return static_cast<T*>(p);
  }
};

DecodeExperts::DecodeExperts(const ExpertWeights& host, int64_t max_tokens, int64_t top_k, int device)
    : s_(std::make_unique<State>()) {
  MOE_CHECK(host.hidden % 8 == 0 && host.inter % 8 == 0 && host.hidden <= kDecodeMaxWidth &&
                host.inter <= kDecodeMaxWidth,
            kUnsupported,
            "the CUDA decode experts need hidden and intermediate widths that are multiples of 8 "
            "and at most {} (got {} and {})", kDecodeMaxWidth, host.hidden, host.inter);
  MOE_CHECK(host.num_local >= 1 && host.num_local <= kDecodeMaxExperts, kUnsupported,
            "the CUDA decode experts handle 1 to {} experts per device, got {}", kDecodeMaxExperts,
            host.num_local);
  MOE_CHECK(max_tokens >= 1 && top_k >= 1, kInvalidArgument, "max_tokens and top_k must be >= 1");
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    cudaGetLastError();
    MOE_THROW(kUnsupported, "no CUDA device {} (this machine has {})", device, count);
  }
  MOE_CUDA_CHECK(cudaSetDevice(device));
  State& s = *s_;
  s.max_tokens = max_tokens;
  auto upload = [&](const Tensor& t) {
    std::vector<uint16_t> bits(static_cast<size_t>(t.numel()));
    for (size_t i = 0; i < bits.size(); ++i) bits[i] = f32_to_bf16(t.data<float>()[i]);
    uint16_t* d = s.alloc<uint16_t>(bits.size());
    MOE_CUDA_CHECK(cudaMemcpy(d, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
    return d;
  };
  kernels::DecodeBuffers& b = s.buffers;
  b.experts = static_cast<int>(host.num_local);
  b.hidden = static_cast<int>(host.hidden);
  b.inter = static_cast<int>(host.inter);
  b.top_k = static_cast<int>(top_k);
  b.gate_up = upload(host.gate_up);
  b.down = upload(host.down);
  const size_t slots = static_cast<size_t>(max_tokens * top_k);
  b.offsets = s.alloc<int>(static_cast<size_t>(b.experts) + 1);
  b.order = s.alloc<int>(slots);
  b.active = s.alloc<int>(static_cast<size_t>(b.experts));
  b.num_active = s.alloc<int>(1);
  b.act = s.alloc<uint16_t>(slots * static_cast<size_t>(b.inter));
  b.part = s.alloc<float>(slots * static_cast<size_t>(b.hidden));
  s.workspace = (2 * static_cast<size_t>(b.experts) + 2 + slots) * 4 + slots * b.inter * 2 +
                slots * b.hidden * 4;
}

DecodeExperts::~DecodeExperts() {
  if (s_)
    for (void* p : s_->owned) cudaFree(p);
}

size_t DecodeExperts::weight_bytes() const {
  const auto& b = s_->buffers;
  return static_cast<size_t>(b.experts) * 3 * b.hidden * b.inter * 2;
}

size_t DecodeExperts::workspace_bytes() const { return s_->workspace; }

void DecodeExperts::forward(const uint16_t* x, const int32_t* ids, const float* weights,
                            int64_t tokens, uint16_t* y, void* stream) const {
  MOE_CHECK(tokens >= 1 && tokens <= s_->max_tokens, kInvalidArgument,
            "{} tokens: this layer was set up for 1 to {}", tokens, s_->max_tokens);
  MOE_CUDA_CHECK(kernels::launch_decode(s_->buffers, x, ids, weights, static_cast<int>(tokens), y,
                                        static_cast<cudaStream_t>(stream)));
}

}  // namespace moe::cuda
