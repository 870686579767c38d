// The interface between attention.cu, the entry of paged attention (attention_launch.h), and its
// four kernels, one file each: attention_row.cu, attention_tiled.cu, attention_decode.cu and
// attention_wgmma.cu (see AttentionPath). The entry checks a call, picks its path and sizes the
// workspace from the row and decode kernels' split plans; each path sizes its own grid. Host code.
#pragma once

#include <cuda_runtime.h>

#include "backend/cuda/attention/attention_launch.h"

namespace moe::cuda::kernels::attention_detail {

// Context splits of the row and decode kernels. A split covers at least kMinChunk positions (fewer
// would spend more on the partial results than on the keys); kMaxSplits bounds the workspace.
constexpr int kMinChunk = 64;
constexpr int kMaxSplits = 64;

// Splits of the row kernel for a call of `tokens` rows (attention_row.cu).
int choose_row_splits(int tokens, int max_context);

// The decode kernel's grid of splits, from the host sizes (attention_decode.cu).
struct DecodePlan {
  int splits;  // grid z: the most splits a row may use
  int chunk;   // keys per split (a multiple of the kernel's key step); the last split of a row takes the rest
};
DecodePlan plan_decode(int tokens, int max_context, int split_keys);

// The four paths, for a call that paged_attention has checked, with tokens > 0.
cudaError_t run_row(const PagedAttentionParams& p, cudaStream_t stream);
cudaError_t run_tiled(const PagedAttentionParams& p, cudaStream_t stream);
cudaError_t run_decode(const PagedAttentionParams& p, cudaStream_t stream);
cudaError_t run_wgmma(const PagedAttentionParams& p, cudaStream_t stream);

// The one head dim the wgmma kernel runs, and whether the current device runs it (attention_wgmma.cu:
// compute capability 9.0).
constexpr int kWgmmaHeadDim = 128;
bool wgmma_attention_device();

}  // namespace moe::cuda::kernels::attention_detail
