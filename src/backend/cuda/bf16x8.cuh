// Eight bf16 values in one 16-byte load (a uint4), the unit the memory-bound kernels read rows
// in: unpacked to f32, added into f32 sums, dotted with another chunk, and an RMSNorm's output
// packed back. Device code, CUDA headers only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace moe::cuda::kernels {

// f[i] = value i of v.
__device__ __forceinline__ void unpack_bf16x8(const uint4& v, float (&f)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 p = __bfloat1622float2(h[i]);
    f[2 * i] = p.x;
    f[2 * i + 1] = p.y;
  }
}

// s[i] += value i of v. v by value: the all-reduce compiled to other machine code with a
// reference into its row.
__device__ __forceinline__ void add_bf16x8(uint4 v, float (&s)[8]) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(h[i]);
    s[2 * i] += f.x;
    s[2 * i + 1] += f.y;
  }
}

// sum over i of a[i] * b[i], one fmaf at a time in the order of i.
__device__ __forceinline__ float dot_bf16x8(uint4 a, uint4 b) {
  const __nv_bfloat162* x = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* y = reinterpret_cast<const __nv_bfloat162*>(&b);
  float s = 0.0f;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 fx = __bfloat1622float2(x[i]), fy = __bfloat1622float2(y[i]);
    s = fmaf(fx.x, fy.x, s);
    s = fmaf(fx.y, fy.y, s);
  }
  return s;
}

// An RMSNorm's output for eight values: bf16(w[i] * (v[i] * inv)), w[0..3] in w0, w[4..7] in w1.
__device__ __forceinline__ uint4 norm_bf16x8(const float4& w0, const float4& w1, const float (&v)[8], float inv) {
  const float w[8] = {w0.x, w0.y, w0.z, w0.w, w1.x, w1.y, w1.z, w1.w};
  uint4 out;
  __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(&out);
#pragma unroll
  for (int i = 0; i < 4; ++i)
    o[i] = __floats2bfloat162_rn(w[2 * i] * (v[2 * i] * inv), w[2 * i + 1] * (v[2 * i + 1] * inv));
  return out;
}

}  // namespace moe::cuda::kernels
