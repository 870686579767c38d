// The routed experts of one MoE layer on a CUDA device, small-M (decode) path: bf16 weights and
// activations, f32 accumulation. Routing (ids, weights) and the plan stay on the device; every
// buffer is allocated at construction for the largest M, so forward() allocates nothing and can
// be captured in a CUDA graph. Declared without CUDA types so CPU-only code can include it; in a
// build without CUDA every entry point throws kUnsupported.
#pragma once

#include <cstdint>
#include <memory>

#include "moe/experts.h"

namespace moe::cuda {

class DecodeExperts {
 public:
  // Converts the host experts to bf16 on `device` (once, at load). max_tokens bounds M.
  // Throws kUnsupported for widths this path does not handle (hidden and inter must be multiples
  // of 8 and at most 2048) or when no CUDA device exists.
  DecodeExperts(const ExpertWeights& host, int64_t max_tokens, int64_t top_k, int device = 0);
  ~DecodeExperts();
  DecodeExperts(const DecodeExperts&) = delete;
  DecodeExperts& operator=(const DecodeExperts&) = delete;

  // y[M, H] (bf16 bits) = sum_j weights[t, j] * FFN_{ids[t, j]}(x[t]); all pointers on the device,
  // ids in [0, E). `stream` is a cudaStream_t (null: the default stream).
  void forward(const uint16_t* x, const int32_t* ids, const float* weights, int64_t tokens,
               uint16_t* y, void* stream) const;

  size_t weight_bytes() const;     // bf16 experts on the device
  size_t workspace_bytes() const;  // plan, activations and partial sums for max_tokens

 private:
  struct State;
  std::unique_ptr<State> s_;
};

}  // namespace moe::cuda
