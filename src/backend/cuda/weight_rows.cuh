// How the weight-streaming kernels (the expert GEMVs, the dense GEMV) read a weight row: in
// chunks of 16 (or 8) bytes, each dotted with the matching bf16 activations. One traits type per
// weight format, so that a kernel is written once and instantiated per format:
//  - Bf16Rows: 8 values a chunk, no scales;
//  - Fp8Rows: 16 E4M3 codes a chunk, one f32 scale per 128 x 128 block (DeepSeek's layout,
//    moe/weight_format.h); a chunk never straddles two blocks, so its dot product is taken on
//    the codes and scaled once;
//  - Fp8NarrowRows: the same format in 8-byte chunks (8 codes), for rows whose 16-byte chunks
//    would leave lanes of a warp idle (qwen3-30b-a3b's down rows: 48 chunks of 16 bytes, 96 of 8).
// Device code, CUDA headers only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstddef>

#include "backend/cuda/bf16x8.cuh"

namespace moe::cuda::kernels {

// sum over i of code i of w (E4M3) * x[i], for the 2 kPairs codes of w, one fmaf at a time in the
// order of i.
template <int kPairs>
__device__ __forceinline__ float dot_fp8_f32(const __nv_fp8x2_storage_t* q, const float* x) {
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    const float2 wf = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(q[i], __NV_E4M3)));
    s = fmaf(wf.x, x[2 * i], s);
    s = fmaf(wf.y, x[2 * i + 1], s);
  }
  return s;
}

// Every traits type gives: Chunk, the unit a lane loads (16 or 8 bytes); kValues per chunk;
// row() and row_scales() of row `row` of matrix m of count x [rows, cols]; X, the activation
// values one chunk meets, load_x() to read them (kLdg: through the read-only path; plain where a
// predecessor in the same chain wrote them); dot() of a chunk with them; unpack_x() of those
// values to f32 and dot_f32() of a chunk with them (where one chunk of x meets several rows,
// converted once); scale() of chunk c given the row's scales (1 without scales).
struct Bf16Rows {
  using Chunk = uint4;
  static constexpr int kValues = 8;
  static constexpr bool kScaled = false;
  using X = uint4;
  __device__ static const uint4* row(const void* w, size_t m, int rows, int row, int cols) {
    return reinterpret_cast<const uint4*>(static_cast<const __nv_bfloat16*>(w) + (m * rows + row) * cols);
  }
  __device__ static const float* row_scales(const float*, size_t, int, int, int) { return nullptr; }
  template <bool kLdg>
  __device__ static X load_x(const uint4* x, int c) { return kLdg ? __ldg(x + c) : x[c]; }
  __device__ static float dot(uint4 w, const X& x) { return dot_bf16x8(w, x); }
  __device__ static void unpack_x(const X& x, float (&f)[kValues]) { unpack_bf16x8(x, f); }
  __device__ static float dot_f32(uint4 w, const float (&x)[kValues]) {
    float wf[kValues];
    unpack_bf16x8(w, wf);
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < kValues; ++i) s = fmaf(wf[i], x[i], s);
    return s;
  }
  __device__ static float scale(const float*, int) { return 1.0f; }
  // The chunk's values as f32 (scaled: unused).
  __device__ static void unpack(uint4 w, float scale, float (&f)[kValues]) {
    (void)scale;
    unpack_bf16x8(w, f);
  }
};

struct Fp8Rows {
  using Chunk = uint4;
  static constexpr int kValues = 16;
  static constexpr bool kScaled = true;
  static constexpr int kBlock = 128;  // block rows and columns
  struct X {
    uint4 lo, hi;
  };
  __device__ static const uint4* row(const void* w, size_t m, int rows, int row, int cols) {
    return reinterpret_cast<const uint4*>(static_cast<const unsigned char*>(w) + (m * rows + row) * cols);
  }
  __device__ static const float* row_scales(const float* scales, size_t m, int rows, int row, int cols) {
    const int scale_rows = (rows + kBlock - 1) / kBlock, scale_cols = (cols + kBlock - 1) / kBlock;
    return scales + (m * scale_rows + row / kBlock) * scale_cols;
  }
  template <bool kLdg>
  __device__ static X load_x(const uint4* x, int c) {
    return kLdg ? X{__ldg(x + 2 * c), __ldg(x + 2 * c + 1)} : X{x[2 * c], x[2 * c + 1]};
  }
  __device__ static float dot(uint4 w, const X& x) {
    float xf[kValues];
    unpack_x(x, xf);
    return dot_f32(w, xf);
  }
  __device__ static void unpack_x(const X& x, float (&f)[kValues]) {
    unpack_bf16x8(x.lo, reinterpret_cast<float(&)[8]>(f[0]));
    unpack_bf16x8(x.hi, reinterpret_cast<float(&)[8]>(f[8]));
  }
  __device__ static float dot_f32(uint4 w, const float (&x)[kValues]) {
    return dot_fp8_f32<8>(reinterpret_cast<const __nv_fp8x2_storage_t*>(&w), x);
  }
  __device__ static float scale(const float* s, int c) { return __ldg(s + c * kValues / kBlock); }
  // The chunk's weights, code x scale: the f32 values the CPU reference dequantises to.
  __device__ static void unpack(uint4 w, float scale, float (&f)[kValues]) {
    const __nv_fp8x2_storage_t* q = reinterpret_cast<const __nv_fp8x2_storage_t*>(&w);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float2 v = __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(q[i], __NV_E4M3)));
      f[2 * i] = v.x * scale;
      f[2 * i + 1] = v.y * scale;
    }
  }
};

struct Fp8NarrowRows {
  using Chunk = uint2;
  static constexpr int kValues = 8;
  static constexpr bool kScaled = true;
  static constexpr int kBlock = Fp8Rows::kBlock;
  using X = uint4;
  __device__ static const uint2* row(const void* w, size_t m, int rows, int row, int cols) {
    return reinterpret_cast<const uint2*>(static_cast<const unsigned char*>(w) + (m * rows + row) * cols);
  }
  __device__ static const float* row_scales(const float* scales, size_t m, int rows, int row, int cols) {
    return Fp8Rows::row_scales(scales, m, rows, row, cols);
  }
  template <bool kLdg>
  __device__ static X load_x(const uint4* x, int c) { return kLdg ? __ldg(x + c) : x[c]; }
  __device__ static float dot(uint2 w, const X& x) {
    float xf[kValues];
    unpack_x(x, xf);
    return dot_f32(w, xf);
  }
  __device__ static void unpack_x(const X& x, float (&f)[kValues]) { unpack_bf16x8(x, f); }
  __device__ static float dot_f32(uint2 w, const float (&x)[kValues]) {
    return dot_fp8_f32<4>(reinterpret_cast<const __nv_fp8x2_storage_t*>(&w), x);
  }
  __device__ static float scale(const float* s, int c) { return __ldg(s + c * kValues / kBlock); }
};

}  // namespace moe::cuda::kernels
