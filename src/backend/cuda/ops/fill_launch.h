// Device fills for weights the engine creates itself.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace moe::cuda::kernels {

// The loader's random stream (src/io/checkpoint.cpp) drawn on the device and rounded to bf16:
// pair i of values comes from splitmix64 step i + 1 from `state`, as int32 halves times
// 0.02 * sqrt(3) / 2^31. Same values as the host stream, so CPU and GPU engines with random
// weights hold the same model.
cudaError_t fill_random_bf16(uint16_t* dst, size_t count, uint64_t state, cudaStream_t stream);

// The scale of every block of a random FP8 weight: the stream's values (at most 0.02 * sqrt(3)
// in magnitude) reach E4M3's largest finite code, 448.
constexpr float kRandomFp8Scale = 0.02f * 1.7320508f / 448.0f;

// The same stream divided by kRandomFp8Scale and rounded to E4M3 codes: with every block scale
// kRandomFp8Scale, the weight is the bf16 random weight to FP8 precision.
cudaError_t fill_random_fp8(uint8_t* codes, size_t count, uint64_t state, cudaStream_t stream);

// Latent attention's absorbed key projection, per head: uk_t[h, j, i] = kv_b[h * (nope + v) + i, j]
// for i < nope, j < lora (kv_b bf16 [heads * (nope + v), lora], as stored by DeepSeek), so that
// q_lat = q_nope · W_UK_h is a product with a row-major [lora, nope] matrix.
cudaError_t extract_uk_transposed(const uint16_t* kv_b, int heads, int nope, int v, int lora,
                                  uint16_t* uk_t, cudaStream_t stream);

}  // namespace moe::cuda::kernels
